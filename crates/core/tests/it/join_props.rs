//! Properties of the deterministic join over random contracts, results and store facts.
//!
//! Everything is drawn from small alphabets (three delegations and a stranger, two workers
//! per delegation, two topics with two values, two evidence ids per prefix), so
//! duplicates, conflicts, mismatches and every rejection reason come up often.

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use convene_core::join::{
    EvidenceFact, ExpectedDelegation, JoinInput, JoinState, assess, check_result, decide,
    may_decide,
};
use convene_core::model::{
    JoinContract, JoinMinimum, JoinStrategy, LateResultPolicy, OnConflict, OnTimeout,
};
use convene_proto::v1;
use proptest::prelude::*;
use proptest::sample::{Index, select};

const NAMES: [&str; 3] = ["logs", "metrics", "changes"];
const PROFILES: [&str; 3] = [
    "logs-investigator",
    "metrics-investigator",
    "change-auditor",
];
const PREFIXES: [&str; 3] = ["logs://", "metrics://", "changes://"];
const GHOST: &str = "del-ghost";
const DEADLINE_SECS: u64 = 600;

fn at(secs: u64) -> SystemTime {
    UNIX_EPOCH + Duration::from_secs(secs)
}

fn plan() -> Vec<ExpectedDelegation> {
    (0..3)
        .map(|i| ExpectedDelegation {
            delegation_id: format!("del-{}", NAMES[i]),
            name: NAMES[i].to_owned(),
            profile_id: PROFILES[i].to_owned(),
            worker_ids: vec![format!("w-{}", NAMES[i])],
            allowed_evidence_prefixes: vec![PREFIXES[i].to_owned()],
        })
        .collect()
}

/// The evidence ids results can cite: two under each prefix.
fn evidence_id(prefix: usize, which: usize) -> String {
    format!("{}ev-{which}", PREFIXES[prefix])
}

#[derive(Debug, Clone)]
struct ClaimSpec {
    id: usize,
    topic: &'static str,
    value: &'static str,
    /// (cites under its own delegation's prefix?, which of the two ids)
    refs: Vec<(bool, usize)>,
}

#[derive(Debug, Clone)]
struct ResultSpec {
    /// 0..3: a plan delegation; 3: a delegation the plan does not have.
    delegation: usize,
    foreign_worker: bool,
    foreign_profile: bool,
    status: v1::TaskStatus,
    claims: Vec<ClaimSpec>,
    /// An evidence record the result carries: (which id under its prefix, hash).
    record: Option<(usize, &'static str)>,
    /// A proposed action's risk level.
    action_risk: Option<i32>,
    summary: usize,
}

fn claim_spec() -> impl Strategy<Value = ClaimSpec> {
    let refs = prop_oneof![
        29 => prop::collection::vec((prop::bool::weighted(0.97), 0..2usize), 1..=2),
        1 => Just(Vec::new()),
    ];
    (
        0..3usize,
        select(&["cause", "impact"][..]),
        select(&["x", "y"][..]),
        refs,
    )
        .prop_map(|(id, topic, value, refs)| ClaimSpec {
            id,
            topic,
            value,
            refs,
        })
}

/// A result for any delegation, the stranger included.
fn result_spec() -> impl Strategy<Value = ResultSpec> {
    (
        prop_oneof![9 => 0..3usize, 1 => Just(3usize)],
        result_body(),
    )
        .prop_map(|(delegation, mut spec)| {
            spec.delegation = delegation;
            spec
        })
}

/// A result for delegation 0, mostly valid: each defect is drawn rarely, so most joins
/// have accepted results and every check still fails now and then.
fn result_body() -> impl Strategy<Value = ResultSpec> {
    let status = prop_oneof![
        16 => Just(v1::TaskStatus::Completed),
        4 => Just(v1::TaskStatus::Partial),
        1 => Just(v1::TaskStatus::Failed),
        1 => Just(v1::TaskStatus::Unspecified),
    ];
    let claims = prop_oneof![
        1 => Just(Vec::new()),
        19 => prop::collection::vec(claim_spec(), 1..=2),
    ];
    (
        prop::bool::weighted(0.03),
        prop::bool::weighted(0.03),
        status,
        claims,
        prop::option::weighted(0.15, (0..2usize, select(&["h1", "h1", "h1", "h2"][..]))),
        prop::option::weighted(0.2, 0..5i32),
        0..2usize,
    )
        .prop_map(
            |(foreign_worker, foreign_profile, status, claims, record, action_risk, summary)| {
                ResultSpec {
                    delegation: 0,
                    foreign_worker,
                    foreign_profile,
                    status,
                    claims,
                    record,
                    action_risk,
                    summary,
                }
            },
        )
}

fn build(spec: &ResultSpec) -> v1::TaskResult {
    // A stranger's result looks like a logs result under an unknown id.
    let own = spec.delegation.min(2);
    let other = (own + 1) % 3;
    v1::TaskResult {
        delegation_id: if spec.delegation == 3 {
            GHOST.to_owned()
        } else {
            format!("del-{}", NAMES[own])
        },
        worker_id: if spec.foreign_worker {
            "w-stranger".to_owned()
        } else {
            format!("w-{}", NAMES[own])
        },
        profile_id: PROFILES[if spec.foreign_profile { other } else { own }].to_owned(),
        status: spec.status.into(),
        summary: format!("summary {}", spec.summary),
        claims: spec
            .claims
            .iter()
            .map(|c| v1::Claim {
                claim_id: format!("c{}", c.id),
                topic: c.topic.to_owned(),
                value: c.value.to_owned(),
                statement: format!("{} is {}", c.topic, c.value),
                evidence_refs: c
                    .refs
                    .iter()
                    .map(|&(mine, which)| evidence_id(if mine { own } else { other }, which))
                    .collect(),
                confidence: 0.5,
            })
            .collect(),
        evidence: spec
            .record
            .iter()
            .map(|&(which, hash)| v1::Evidence {
                evidence_id: evidence_id(own, which),
                content_hash: hash.to_owned(),
                ..Default::default()
            })
            .collect(),
        proposed_actions: spec
            .action_risk
            .iter()
            .map(|&risk| v1::ProposedAction {
                action: "rule:rollback".to_owned(),
                risk_level: risk,
                ..Default::default()
            })
            .collect(),
        ..Default::default()
    }
}

fn fact() -> impl Strategy<Value = EvidenceFact> {
    prop_oneof![
        // Few distinct artifacts, so that results often cite the same ones through
        // different evidence ids.
        100 => (select(&["impact_metric", "causal_signal"][..]), select(&["h1", "h2"][..]))
            .prop_map(|(kind, hash)| {
                EvidenceFact::Verified {
                    kind: kind.to_owned(),
                    content_hash: hash.to_owned(),
                    kind_defaulted: false,
                }
            }),
        1 => Just(EvidenceFact::Unknown),
        1 => Just(EvidenceFact::ArtifactMissing),
        1 => Just(EvidenceFact::HashMismatch),
    ]
}

/// Facts for the six citable ids; an absent fact (None) leaves the id unknown.
fn store() -> impl Strategy<Value = BTreeMap<String, EvidenceFact>> {
    prop::collection::vec(prop::option::weighted(0.99, fact()), 6).prop_map(|facts| {
        facts
            .into_iter()
            .enumerate()
            .filter_map(|(i, f)| f.map(|f| (evidence_id(i / 2, i % 2), f)))
            .collect()
    })
}

fn strategy() -> impl Strategy<Value = JoinStrategy> {
    select(
        &[
            JoinStrategy::All,
            JoinStrategy::Quorum,
            JoinStrategy::TimeoutPartial,
            JoinStrategy::FirstValid,
        ][..],
    )
}

fn contract() -> impl Strategy<Value = JoinContract> {
    // The unplanned reference is drawn rarely: it makes every join insufficient.
    let references = ["logs", "metrics-investigator", "changes", "unplanned"];
    let required = (
        prop::collection::vec(prop::bool::weighted(0.25), 3),
        prop::bool::weighted(0.03),
    )
        .prop_map(|(mut planned, unplanned)| {
            planned.push(unplanned);
            planned
        });
    // Required profiles, the same way: a profile no delegation has is drawn rarely.
    let profiles = [
        "logs-investigator",
        "metrics-investigator",
        "change-auditor",
        "unplanned",
    ];
    let required_profiles = (
        prop::collection::vec(prop::bool::weighted(0.2), 3),
        prop::bool::weighted(0.03),
    )
        .prop_map(move |(mut planned, unplanned)| {
            planned.push(unplanned);
            profiles
                .iter()
                .zip(&planned)
                .filter(|&(_, &on)| on)
                .map(|(p, _)| (*p).to_owned())
                .collect::<Vec<String>>()
        });
    (
        required,
        strategy(),
        select(&[0, 0, 1, 1, 2, 3][..]),
        select(&[0.0, 0.0, 0.0, 1.0, 2.5][..]),
        prop::collection::vec(prop::bool::weighted(0.15), 2),
        prop::bool::weighted(0.9),
        select(
            &[
                OnTimeout::EmitPartial,
                OnTimeout::EmitPartial,
                OnTimeout::Fail,
            ][..],
        ),
        select(&[OnConflict::PreserveAndEscalate, OnConflict::FollowUp][..]),
        prop::option::of(select(&[0.0, 0.5, 2.0][..])),
        required_profiles,
    )
        .prop_map(
            move |(
                required,
                strategy,
                count,
                weight,
                kinds,
                has_deadline,
                on_timeout,
                on_conflict,
                logs_weight,
                required_profiles,
            )| {
                let required = references
                    .iter()
                    .zip(&required)
                    .filter(|&(_, &on)| on)
                    .map(|(r, _)| (*r).to_owned())
                    .collect();
                JoinContract {
                    join_id: "join-props".to_owned(),
                    required,
                    optional: Vec::new(),
                    strategy,
                    minimum: JoinMinimum {
                        count,
                        weight,
                        required_evidence_kinds: ["impact_metric", "causal_signal"]
                            .iter()
                            .zip(&kinds)
                            .filter(|&(_, &on)| on)
                            .map(|(k, _)| (*k).to_owned())
                            .collect(),
                    },
                    deadline: has_deadline.then(|| at(DEADLINE_SECS)),
                    on_timeout,
                    on_conflict,
                    late_result: LateResultPolicy::Discard,
                    weights: logs_weight
                        .map(|w| BTreeMap::from([("logs".to_owned(), w)]))
                        .unwrap_or_default(),
                    required_profiles,
                }
            },
        )
}

/// One join's inputs (the plan is always the three incident delegations).
#[derive(Debug, Clone)]
struct World {
    contract: JoinContract,
    results: Vec<v1::TaskResult>,
    evidence: BTreeMap<String, EvidenceFact>,
    now: SystemTime,
}

impl World {
    fn input<'a>(&'a self, plan: &'a [ExpectedDelegation]) -> JoinInput<'a> {
        JoinInput {
            contract: &self.contract,
            delegations: plan,
            results: &self.results,
            evidence: &self.evidence,
            now: self.now,
            settlements: &convene_core::join::NO_SETTLEMENTS,
        }
    }
}

fn world() -> impl Strategy<Value = World> {
    (
        contract(),
        // Most delegations report once; some not at all.
        prop::collection::vec(prop::option::weighted(0.8, result_body()), 3),
        // Now and then a second, independent result for any delegation or a stranger.
        prop::option::weighted(0.2, result_spec()),
        // Identical redeliveries of results already there.
        prop::collection::vec(any::<Index>(), 0..3),
        store(),
        select(&[300u64, DEADLINE_SECS, 900][..]),
    )
        .prop_map(|(contract, bodies, extra, copies, evidence, now)| {
            let specs = bodies
                .into_iter()
                .enumerate()
                .filter_map(|(i, body)| {
                    body.map(|mut spec| {
                        spec.delegation = i;
                        spec
                    })
                })
                .chain(extra);
            let mut results: Vec<v1::TaskResult> = specs.map(|spec| build(&spec)).collect();
            if !results.is_empty() {
                for c in copies {
                    let copy = c.get(&results).clone();
                    results.push(copy);
                }
            }
            World {
                contract,
                results,
                evidence,
                now: at(now),
            }
        })
}

/// The outcome order "never improves" is checked against.
fn rank(outcome: v1::JoinOutcome) -> u8 {
    match outcome {
        v1::JoinOutcome::InsufficientEvidence | v1::JoinOutcome::Unspecified => 0,
        v1::JoinOutcome::PartialEvidence => 1,
        v1::JoinOutcome::ConflictRequiresHuman | v1::JoinOutcome::CompleteWithReviewRequired => 2,
        v1::JoinOutcome::Complete => 3,
    }
}

/// A way to make a result fail a per-result check.
#[derive(Debug, Clone, Copy)]
enum Defect {
    UnknownDelegation,
    ForeignWorker,
    ForeignProfile,
    NotSuccessful,
    NoClaims,
    ClaimWithoutEvidence,
    OutsidePrefix,
    UnknownEvidence,
    RecordedHashDiffers,
}

fn defect() -> impl Strategy<Value = Defect> {
    select(
        &[
            Defect::UnknownDelegation,
            Defect::ForeignWorker,
            Defect::ForeignProfile,
            Defect::NotSuccessful,
            Defect::NoClaims,
            Defect::ClaimWithoutEvidence,
            Defect::OutsidePrefix,
            Defect::UnknownEvidence,
            Defect::RecordedHashDiffers,
        ][..],
    )
}

/// `result` with `defect` (an earlier check may still be the one that fails).
fn spoil(
    mut result: v1::TaskResult,
    defect: Defect,
    plan: &[ExpectedDelegation],
) -> v1::TaskResult {
    let own = plan
        .iter()
        .position(|d| d.delegation_id == result.delegation_id)
        .unwrap_or(0);
    let claim = |refs: Vec<String>| v1::Claim {
        claim_id: "c-spoiled".to_owned(),
        topic: "cause".to_owned(),
        value: "x".to_owned(),
        evidence_refs: refs,
        ..Default::default()
    };
    match defect {
        Defect::UnknownDelegation => result.delegation_id = GHOST.to_owned(),
        Defect::ForeignWorker => result.worker_id = "w-stranger".to_owned(),
        Defect::ForeignProfile => result.profile_id = PROFILES[(own + 1) % 3].to_owned(),
        Defect::NotSuccessful => result.status = v1::TaskStatus::Blocked.into(),
        Defect::NoClaims => result.claims.clear(),
        Defect::ClaimWithoutEvidence => result.claims.push(claim(Vec::new())),
        Defect::OutsidePrefix => result.claims.push(claim(vec!["elsewhere://x".to_owned()])),
        Defect::UnknownEvidence => result
            .claims
            .push(claim(vec![format!("{}never-recorded", PREFIXES[own])])),
        Defect::RecordedHashDiffers => {
            let id = evidence_id(own, 0);
            result.claims.push(claim(vec![id.clone()]));
            result.evidence.push(v1::Evidence {
                evidence_id: id,
                content_hash: "h-tampered".to_owned(),
                ..Default::default()
            });
        }
    }
    result
}

fn is_invalid(result: &v1::TaskResult, world: &World, plan: &[ExpectedDelegation]) -> bool {
    match plan
        .iter()
        .find(|d| d.delegation_id == result.delegation_id)
    {
        None => true,
        Some(d) => check_result(d, result, &world.evidence).is_err(),
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// (a) The decision does not depend on the order results arrived in.
    #[test]
    fn decision_is_independent_of_arrival_order(
        (world, shuffled) in world().prop_flat_map(|w| {
            let results = w.results.clone();
            (Just(w), Just(results).prop_shuffle())
        })
    ) {
        let plan = plan();
        let mut other = world.clone();
        other.results = shuffled;
        let a = decide(&world.input(&plan));
        let b = decide(&other.input(&plan));
        prop_assert_eq!(&a, &b);
        prop_assert_eq!(assess(&world.input(&plan)), assess(&other.input(&plan)));
        if let JoinState::Decided(d) = a {
            prop_assert_eq!(d, assess(&world.input(&plan)), "decide returns the assessment");
        }
    }

    /// (b) Two accepted claims on one topic with different values are always a conflict
    /// on that topic that lists both.
    #[test]
    fn conflicts_are_never_dropped(world in world()) {
        let plan = plan();
        let d = assess(&world.input(&plan));
        let accepted_claims: Vec<(&str, &v1::Claim)> = d
            .accepted
            .iter()
            .flat_map(|id| {
                let result = world.results.iter().find(|r| &r.delegation_id == id).unwrap();
                result.claims.iter().map(move |c| (id.as_str(), c))
            })
            .collect();
        for (i, (da, a)) in accepted_claims.iter().enumerate() {
            for (db, b) in &accepted_claims[i + 1..] {
                if da != db && a.topic == b.topic && a.value != b.value {
                    let conflict = d.conflicts.iter().find(|c| c.topic == a.topic);
                    prop_assert!(conflict.is_some(), "no conflict on {}: {:?}", a.topic, d);
                    let conflict = conflict.unwrap();
                    for (del, claim) in [(da, a), (db, b)] {
                        prop_assert!(
                            conflict.claims.iter().any(|s| s.delegation_id == *del
                                && s.claim_id == claim.claim_id
                                && s.value == claim.value
                                && s.evidence_refs == claim.evidence_refs),
                            "claim {} of {} missing from {:?}", claim.claim_id, del, conflict
                        );
                    }
                    prop_assert_ne!(d.outcome(), v1::JoinOutcome::Complete);
                }
            }
        }
        for conflict in &d.conflicts {
            prop_assert!(conflict.claims.iter().all(|s| d.accepted.contains(&s.delegation_id)));
        }
    }

    /// (c) An invalid result never improves the outcome and never adds an acceptance.
    /// Half the time it goes to a delegation that has not reported, where it turns
    /// "pending" into "rejected".
    #[test]
    fn an_invalid_result_never_improves_the_decision(
        world in world(),
        body in result_body(),
        defect in defect(),
        target in 0..3usize,
        prefer_pending in any::<bool>(),
        position in any::<Index>(),
    ) {
        let plan = plan();
        let pending = plan
            .iter()
            .position(|d| world.results.iter().all(|r| r.delegation_id != d.delegation_id));
        let mut spec = body;
        spec.delegation = match pending {
            Some(i) if prefer_pending => i,
            _ => target,
        };
        let extra = spoil(build(&spec), defect, &plan);
        prop_assert!(is_invalid(&extra, &world, &plan), "{:?} left {:?} valid", defect, extra);
        let mut worse = world.clone();
        let at = position.index(worse.results.len() + 1);
        worse.results.insert(at, extra);

        let before = assess(&world.input(&plan));
        let after = assess(&worse.input(&plan));
        prop_assert!(
            rank(after.outcome()) <= rank(before.outcome()),
            "{:?} became {:?}", before.outcome(), after.outcome()
        );
        prop_assert!(after.accepted.iter().all(|id| before.accepted.contains(id)));
        if let (JoinState::Decided(b), JoinState::Decided(a)) =
            (decide(&world.input(&plan)), decide(&worse.input(&plan)))
        {
            prop_assert!(rank(a.outcome()) <= rank(b.outcome()));
        }
    }

    /// (d) TIMEOUT_PARTIAL never decides before the deadline unless every required
    /// delegation has a result — indeed unless every expected one has.
    #[test]
    fn timeout_partial_waits_for_required_results_before_the_deadline(
        mut world in world(),
        secs in 0..DEADLINE_SECS,
    ) {
        let plan = plan();
        world.contract.strategy = JoinStrategy::TimeoutPartial;
        world.contract.deadline = Some(at(DEADLINE_SECS));
        world.now = at(secs);
        if let JoinState::Decided(d) = decide(&world.input(&plan)) {
            for delegation in &plan {
                let required = world
                    .contract
                    .required
                    .iter()
                    .any(|r| *r == delegation.name || *r == delegation.profile_id);
                let reported = world
                    .results
                    .iter()
                    .any(|r| r.delegation_id == delegation.delegation_id);
                prop_assert!(
                    !required || reported,
                    "decided {:?} without the required {}", d.outcome(), delegation.name
                );
                prop_assert!(
                    reported,
                    "decided {:?} before the deadline while {} is pending",
                    d.outcome(),
                    delegation.name
                );
            }
        }
    }

    /// (d2) Where `may_decide` says the join cannot decide yet, no store facts make it
    /// decide; where the strategy waits for every delegation, it says so exactly then.
    #[test]
    fn the_join_waits_whatever_the_evidence_when_may_decide_says_so(
        world in world(),
        other in store(),
    ) {
        let plan = plan();
        let input = world.input(&plan);
        let verified: BTreeMap<String, EvidenceFact> = world
            .results
            .iter()
            .flat_map(|r| r.claims.iter().flat_map(|c| c.evidence_refs.iter()))
            .map(|id| {
                let fact = EvidenceFact::Verified {
                    kind: "impact_metric".to_owned(),
                    content_hash: "sha256:00".to_owned(),
                    kind_defaulted: false,
                };
                (id.clone(), fact)
            })
            .collect();
        let nothing = BTreeMap::new();
        if !may_decide(&input) {
            for evidence in [&world.evidence, &other, &verified, &nothing] {
                let input = JoinInput { evidence, ..input };
                prop_assert!(
                    matches!(decide(&input), JoinState::Pending { .. }),
                    "decided although may_decide said it cannot"
                );
            }
        }
        if matches!(world.contract.strategy, JoinStrategy::All | JoinStrategy::TimeoutPartial) {
            prop_assert_eq!(
                may_decide(&input),
                matches!(decide(&input), JoinState::Decided(_)),
                "ALL and TIMEOUT_PARTIAL decide exactly when may_decide says they can"
            );
        }
    }

    /// (e) A delegation is never both accepted and rejected, nor rejected twice.
    #[test]
    fn no_delegation_is_both_accepted_and_rejected(world in world()) {
        let plan = plan();
        let d = assess(&world.input(&plan));
        for r in &d.rejected {
            prop_assert!(!d.accepted.contains(&r.delegation_id), "{} in both", r.delegation_id);
            prop_assert_eq!(
                d.rejected.iter().filter(|x| x.delegation_id == r.delegation_id).count(),
                1
            );
        }
    }

    /// (f) A required profile is met exactly when one of its delegations is accepted,
    /// whichever one and whatever the arrival order; QUORUM does not decide early while
    /// it is unmet. Here the planner followed `logs` up with a second delegation to the
    /// same profile, whose result may be missing, valid or spoiled.
    #[test]
    fn a_required_profile_is_met_by_any_accepted_delegation_of_it(
        (world, shuffled) in follow_up_world().prop_flat_map(|w| {
            let results = w.results.clone();
            (Just(w), Just(results).prop_shuffle())
        })
    ) {
        let plan = follow_up_plan();
        let d = assess(&world.input(&plan));
        let met = d.accepted.iter().any(|id| id == "del-logs" || id == FOLLOW_UP);
        prop_assert_eq!(
            d.missing_required.contains(&"logs-investigator".to_owned()),
            !met,
            "{:?}", d
        );
        let deadline_passed = world.contract.deadline.is_some_and(|t| world.now >= t);
        let pending = plan
            .iter()
            .any(|p| world.results.iter().all(|r| r.delegation_id != p.delegation_id));
        if world.contract.strategy == JoinStrategy::Quorum && !met && pending && !deadline_passed {
            prop_assert!(
                matches!(decide(&world.input(&plan)), JoinState::Pending { .. }),
                "QUORUM decided early without an accepted delegation of the required profile"
            );
        }

        let mut other = world.clone();
        other.results = shuffled;
        prop_assert_eq!(decide(&world.input(&plan)), decide(&other.input(&plan)));
        prop_assert_eq!(d, assess(&other.input(&plan)));
    }

    /// (s) Results whose claims cite the same artifacts (content hashes), through any
    /// evidence ids, are one finding: they count once toward the minimum, and every
    /// artifact several accepted results cite is flagged.
    #[test]
    fn results_on_the_same_artifacts_count_once_and_are_flagged(world in world()) {
        let plan = plan();
        let d = assess(&world.input(&plan));
        let support = |id: &str| -> std::collections::BTreeSet<String> {
            let result = world.results.iter().find(|r| r.delegation_id == id).unwrap();
            result
                .claims
                .iter()
                .flat_map(|c| &c.evidence_refs)
                .filter_map(|e| match world.evidence.get(e) {
                    Some(EvidenceFact::Verified { content_hash, .. }) => Some(content_hash.clone()),
                    _ => None,
                })
                .collect()
        };
        let supports: Vec<_> = d.accepted.iter().map(|id| (id.clone(), support(id))).collect();
        let distinct: std::collections::BTreeSet<_> =
            supports.iter().filter(|(_, s)| !s.is_empty()).map(|(_, s)| s.clone()).collect();
        let unsupported = supports.iter().filter(|(_, s)| s.is_empty()).count();
        prop_assert_eq!(
            d.accepted.len() - d.not_independent.len(),
            distinct.len() + unsupported,
            "{:?}", d
        );
        for dependent in &d.not_independent {
            let mine = support(dependent);
            prop_assert!(
                supports.iter().any(|(id, s)| id != dependent && *s == mine
                    && !d.not_independent.contains(id)),
                "{} is not counted, yet no counted result cites the same artifacts: {:?}", dependent, d
            );
        }
        let mut by_hash: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for (id, s) in &supports {
            for h in s {
                by_hash.entry(h.clone()).or_default().push(id.clone());
            }
        }
        let flagged: BTreeMap<String, Vec<String>> = d
            .shared_evidence
            .iter()
            .map(|s| (s.content_hash.clone(), s.delegation_ids.clone()))
            .collect();
        let expected: BTreeMap<String, Vec<String>> =
            by_hash.into_iter().filter(|(_, ids)| ids.len() > 1).collect();
        prop_assert_eq!(flagged, expected);
    }
}

/// Id of the follow-up delegation to the `logs` profile in [`follow_up_plan`].
const FOLLOW_UP: &str = "del-logs-2";

/// The incident's plan with a follow-up delegation to the `logs` profile, as a planner
/// makes one after a first attempt.
fn follow_up_plan() -> Vec<ExpectedDelegation> {
    let mut plan = plan();
    plan.push(ExpectedDelegation {
        delegation_id: FOLLOW_UP.to_owned(),
        name: "logs-2".to_owned(),
        ..plan[0].clone()
    });
    plan
}

/// A [`world`] for [`follow_up_plan`] that requires the `logs` profile, with a result
/// for the follow-up now and then (valid, or with a defect).
fn follow_up_world() -> impl Strategy<Value = World> {
    (
        world(),
        prop::option::weighted(0.8, result_body()),
        prop::option::weighted(0.3, defect()),
    )
        .prop_map(|(mut world, follow_up, defect)| {
            world.contract.required_profiles = vec!["logs-investigator".to_owned()];
            if let Some(body) = follow_up {
                // Built (and spoiled) as a `logs` result, then moved to the follow-up,
                // unless the defect already moved it elsewhere.
                let mut result = build(&body);
                if let Some(defect) = defect {
                    result = spoil(result, defect, &plan());
                }
                if result.delegation_id == "del-logs" {
                    result.delegation_id = FOLLOW_UP.to_owned();
                }
                world.results.push(result);
            }
            world
        })
}
