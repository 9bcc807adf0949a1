//! Scenario tests of the deterministic join, on the payment incident's plan: `logs`,
//! `metrics` and `changes`, each with its own profile, worker and evidence prefix.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use convene_core::join::{
    EvidenceFact, ExpectedDelegation, JoinInput, JoinState, apply_late, assess, check_result,
    cited_evidence_ids, decide,
};
use convene_core::model::{
    JoinContract, JoinMinimum, JoinStrategy, LateResultPolicy, OnConflict, OnTimeout,
};
use convene_proto::v1;

use v1::JoinOutcome as Outcome;
use v1::RejectionReason as Reason;

const LOGS: &str = "del-logs";
const METRICS: &str = "del-metrics";
const CHANGES: &str = "del-changes";

const POOL_EVIDENCE: &str = "logs://payment-api/q-pool";
const IMPACT_EVIDENCE: &str = "metrics://payment/success-rate";
const RULE_EVIDENCE: &str = "changes://risk-rule/r-42";

/// Seconds after the epoch; the join's deadline in these tests is `at(600)`.
fn at(secs: u64) -> SystemTime {
    UNIX_EPOCH + Duration::from_secs(secs)
}

const BEFORE_DEADLINE: u64 = 300;
const AFTER_DEADLINE: u64 = 900;

fn delegation(id: &str, name: &str, profile: &str, prefix: &str) -> ExpectedDelegation {
    ExpectedDelegation {
        delegation_id: id.to_owned(),
        name: name.to_owned(),
        profile_id: profile.to_owned(),
        worker_ids: vec![format!("worker-{name}")],
        allowed_evidence_prefixes: vec![prefix.to_owned()],
    }
}

/// The incident's three specialists, in plan order.
fn plan() -> Vec<ExpectedDelegation> {
    vec![
        delegation(LOGS, "logs", "logs-investigator", "logs://"),
        delegation(METRICS, "metrics", "metrics-investigator", "metrics://"),
        delegation(CHANGES, "changes", "change-auditor", "changes://"),
    ]
}

/// `logs` is required; the others are waited for but optional. Deadline at 600 s.
fn contract(strategy: JoinStrategy) -> JoinContract {
    JoinContract {
        join_id: "join-incident-evidence-v1".to_owned(),
        required: vec!["logs".to_owned()],
        optional: vec!["metrics".to_owned(), "change-auditor".to_owned()],
        strategy,
        minimum: JoinMinimum {
            count: 1,
            weight: 0.0,
            required_evidence_kinds: Vec::new(),
        },
        deadline: Some(at(600)),
        on_timeout: OnTimeout::EmitPartial,
        on_conflict: OnConflict::PreserveAndEscalate,
        late_result: LateResultPolicy::Discard,
        weights: BTreeMap::new(),
        required_profiles: Vec::new(),
    }
}

fn claim(id: &str, topic: &str, value: &str, refs: &[&str]) -> v1::Claim {
    v1::Claim {
        claim_id: id.to_owned(),
        topic: topic.to_owned(),
        value: value.to_owned(),
        statement: format!("{topic} is {value}"),
        evidence_refs: refs.iter().map(|r| (*r).to_owned()).collect(),
        confidence: 0.8,
    }
}

/// A COMPLETED result for `d` from its first worker and its profile.
fn result_for(d: &ExpectedDelegation, claims: Vec<v1::Claim>) -> v1::TaskResult {
    v1::TaskResult {
        delegation_id: d.delegation_id.clone(),
        worker_id: d.worker_ids[0].clone(),
        profile_id: d.profile_id.clone(),
        profile_version: "1".to_owned(),
        status: v1::TaskStatus::Completed.into(),
        summary: format!("{} findings", d.name),
        claims,
        ..Default::default()
    }
}

fn logs_result() -> v1::TaskResult {
    result_for(
        &plan()[0],
        vec![claim(
            "claim-log-1",
            "primary_cause",
            "connection_pool_exhaustion",
            &[POOL_EVIDENCE],
        )],
    )
}

fn metrics_result() -> v1::TaskResult {
    result_for(
        &plan()[1],
        vec![claim(
            "claim-met-1",
            "impact",
            "success_rate_93.1",
            &[IMPACT_EVIDENCE],
        )],
    )
}

fn changes_result() -> v1::TaskResult {
    result_for(
        &plan()[2],
        vec![claim(
            "claim-chg-1",
            "recent_change",
            "risk_rule_r42_deployed",
            &[RULE_EVIDENCE],
        )],
    )
}

/// A `changes` result that names the risk rule as the primary cause, against `logs`.
fn changes_blaming_rule() -> v1::TaskResult {
    result_for(
        &plan()[2],
        vec![claim(
            "claim-chg-1",
            "primary_cause",
            "risk_rule_change",
            &[RULE_EVIDENCE],
        )],
    )
}

fn hash_of(id: &str) -> String {
    convene_core::ids::content_hash(id.as_bytes())
}

/// The store's view: every evidence id the incident's specialists can cite is verified.
fn store() -> BTreeMap<String, EvidenceFact> {
    [
        (POOL_EVIDENCE, "causal_signal"),
        ("logs://payment-api/q-timeouts", "causal_signal"),
        (IMPACT_EVIDENCE, "impact_metric"),
        (RULE_EVIDENCE, "causal_signal"),
    ]
    .into_iter()
    .map(|(id, kind)| {
        (
            id.to_owned(),
            EvidenceFact::Verified {
                kind: kind.to_owned(),
                content_hash: hash_of(id),
                kind_defaulted: false,
            },
        )
    })
    .collect()
}

/// One join evaluation, with the incident plan and store unless changed.
struct Case {
    contract: JoinContract,
    plan: Vec<ExpectedDelegation>,
    results: Vec<v1::TaskResult>,
    evidence: BTreeMap<String, EvidenceFact>,
    now: SystemTime,
    settlements: BTreeMap<String, v1::ConflictSettlement>,
}

impl Case {
    fn new(strategy: JoinStrategy, results: Vec<v1::TaskResult>) -> Self {
        Self {
            contract: contract(strategy),
            plan: plan(),
            results,
            evidence: store(),
            now: at(BEFORE_DEADLINE),
            settlements: BTreeMap::new(),
        }
    }

    fn settled(mut self, topic: &str, delegation_id: &str, value: &str) -> Self {
        self.settlements.insert(
            topic.to_owned(),
            v1::ConflictSettlement {
                delegation_id: delegation_id.to_owned(),
                value: value.to_owned(),
                decided_by: "oncall@acme".to_owned(),
                rationale: "the rule change preceded the errors".to_owned(),
                evidence_ids: vec![RULE_EVIDENCE.to_owned()],
                decided_at: None,
            },
        );
        self
    }

    fn at(mut self, secs: u64) -> Self {
        self.now = at(secs);
        self
    }

    fn input(&self) -> JoinInput<'_> {
        JoinInput {
            contract: &self.contract,
            delegations: &self.plan,
            results: &self.results,
            evidence: &self.evidence,
            now: self.now,
            settlements: &self.settlements,
        }
    }

    fn state(&self) -> JoinState {
        decide(&self.input())
    }

    /// The decision; fails the test when the join is still pending.
    fn decided(&self) -> v1::JoinDecision {
        match self.state() {
            JoinState::Decided(d) => d,
            JoinState::Pending { waiting_for, .. } => {
                panic!("expected a decision, the join waits for {waiting_for:?}")
            }
        }
    }

    /// What the join waits for; fails the test when it decided.
    fn waiting_for(&self) -> Vec<String> {
        match self.state() {
            JoinState::Pending {
                waiting_for,
                deadline,
            } => {
                assert_eq!(deadline, self.contract.deadline);
                waiting_for
            }
            JoinState::Decided(d) => panic!("expected pending, decided {:?}", d.outcome()),
        }
    }
}

fn ids(list: &[&str]) -> Vec<String> {
    list.iter().map(|s| (*s).to_owned()).collect()
}

/// The single rejection of `delegation_id` (fails when there is none or several).
fn rejection<'d>(decision: &'d v1::JoinDecision, delegation_id: &str) -> &'d v1::Rejection {
    let found: Vec<_> = decision
        .rejected
        .iter()
        .filter(|r| r.delegation_id == delegation_id)
        .collect();
    assert_eq!(found.len(), 1, "rejections of {delegation_id}: {found:?}");
    found[0]
}

/// Decides the incident with `bad` in place of the `logs` result and returns its rejection.
fn reject_logs(bad: v1::TaskResult) -> (v1::JoinDecision, v1::Rejection) {
    reject_logs_in(Case::new(
        JoinStrategy::All,
        vec![bad, metrics_result(), changes_result()],
    ))
}

fn reject_logs_in(case: Case) -> (v1::JoinDecision, v1::Rejection) {
    let decision = case.decided();
    let r = rejection(&decision, LOGS).clone();
    assert!(
        !decision.accepted.contains(&LOGS.to_owned()),
        "a rejected delegation is never accepted"
    );
    assert_eq!(decision.outcome(), Outcome::InsufficientEvidence);
    assert_eq!(decision.missing_required, ids(&[LOGS]));
    (decision, r)
}

// ---------------------------------------------------------------------------------------
// Outcomes
// ---------------------------------------------------------------------------------------

#[test]
fn complete_when_every_result_is_accepted_without_conflict_or_review() {
    let case = Case::new(
        JoinStrategy::All,
        vec![changes_result(), logs_result(), metrics_result()],
    );
    let d = case.decided();
    assert_eq!(d.outcome(), Outcome::Complete);
    assert_eq!(d.revision, 1);
    assert_eq!(d.accepted, ids(&[LOGS, METRICS, CHANGES]), "plan order");
    assert!(d.rejected.is_empty() && d.missing_required.is_empty());
    assert!(d.missing_optional.is_empty() && d.conflicts.is_empty());
    assert!(d.quorum_met);
    assert_eq!(d.decided_at, Some(prost_types::Timestamp::from(case.now)));
    assert!(!d.reasons.is_empty(), "a decision always explains itself");
}

#[test]
fn review_required_when_an_accepted_result_proposes_an_action_above_r1() {
    let with_action = |risk: v1::RiskLevel| {
        let mut changes = changes_result();
        changes.proposed_actions.push(v1::ProposedAction {
            action: "rule:rollback".to_owned(),
            risk_level: risk.into(),
            rationale: "the rule's hit rate deviates since 01:58".to_owned(),
            evidence_refs: vec![RULE_EVIDENCE.to_owned()],
            ..Default::default()
        });
        Case::new(
            JoinStrategy::All,
            vec![logs_result(), metrics_result(), changes],
        )
        .decided()
    };
    let d = with_action(v1::RiskLevel::R3);
    assert_eq!(d.outcome(), Outcome::CompleteWithReviewRequired);
    assert!(
        d.reasons
            .iter()
            .any(|r| r.contains("rule:rollback") && r.contains("R3")),
        "{:?}",
        d.reasons
    );
    assert_eq!(
        with_action(v1::RiskLevel::R2).outcome(),
        Outcome::CompleteWithReviewRequired
    );
    // An unset level fails closed to R3.
    assert_eq!(
        with_action(v1::RiskLevel::Unspecified).outcome(),
        Outcome::CompleteWithReviewRequired
    );
    assert_eq!(with_action(v1::RiskLevel::R1).outcome(), Outcome::Complete);
}

#[test]
fn partial_evidence_when_an_optional_delegation_is_rejected() {
    let mut metrics = metrics_result();
    metrics.status = v1::TaskStatus::TimedOut.into();
    let d = Case::new(
        JoinStrategy::All,
        vec![logs_result(), metrics, changes_result()],
    )
    .decided();
    assert_eq!(d.outcome(), Outcome::PartialEvidence);
    assert_eq!(d.accepted, ids(&[LOGS, CHANGES]));
    assert_eq!(d.missing_optional, ids(&[METRICS]), "the gap is named");
    assert!(d.missing_required.is_empty() && d.quorum_met);
    assert_eq!(rejection(&d, METRICS).reason(), Reason::NotSuccessful);
}

#[test]
fn insufficient_evidence_when_a_required_delegation_is_rejected() {
    let mut logs = logs_result();
    logs.claims[0].evidence_refs.clear();
    let (d, r) = reject_logs(logs);
    assert_eq!(r.reason(), Reason::ClaimWithoutEvidence);
    assert!(
        d.reasons
            .iter()
            .any(|r| r
                == "required delegation `logs` rejected: claim `claim-log-1` cites no evidence"),
        "{:?}",
        d.reasons
    );
}

#[test]
fn a_decision_names_the_evidence_whose_kind_its_tool_defaulted() {
    let mut case = Case::new(
        JoinStrategy::All,
        vec![changes_result(), logs_result(), metrics_result()],
    );
    case.contract.minimum.required_evidence_kinds = ids(&["impact_metric", "causal_signal"]);
    let named = case.decided();
    assert!(
        !named.reasons.iter().any(|r| r.contains("defaulted")),
        "{:?}",
        named.reasons
    );
    // The metrics call named no kind: its tool's default, impact_metric, counts all the
    // same, and the decision says which evidence rests on a default.
    case.evidence.insert(
        IMPACT_EVIDENCE.to_owned(),
        EvidenceFact::Verified {
            kind: "impact_metric".to_owned(),
            content_hash: hash_of(IMPACT_EVIDENCE),
            kind_defaulted: true,
        },
    );
    let d = case.decided();
    assert_eq!(d.outcome(), named.outcome());
    assert!(d.quorum_met && d.missing_evidence_kinds.is_empty());
    let defaulted: Vec<&String> = d
        .reasons
        .iter()
        .filter(|r| r.contains("defaulted"))
        .collect();
    assert_eq!(
        defaulted,
        [&format!(
            "evidence kind defaulted by its tool, not named by the call: `{IMPACT_EVIDENCE}` \
             (impact_metric)"
        )]
    );
}

#[test]
fn insufficient_evidence_when_the_minimum_is_not_met() {
    // Count: three accepted needed, two accepted.
    let mut case =
        Case::new(JoinStrategy::All, vec![logs_result(), changes_result()]).at(AFTER_DEADLINE);
    case.contract.minimum.count = 3;
    let d = case.decided();
    assert_eq!(d.outcome(), Outcome::InsufficientEvidence);
    assert!(!d.quorum_met && d.missing_required.is_empty());

    // Weight: logs weighs 0.5 by name, changes 0.25 by profile id; 1.0 needed.
    let mut case = Case::new(
        JoinStrategy::All,
        vec![logs_result(), changes_result(), metrics_result()],
    );
    case.contract.minimum.weight = 1.0;
    case.contract.weights = BTreeMap::from([
        ("logs".to_owned(), 0.5),
        ("change-auditor".to_owned(), 0.25),
        ("metrics".to_owned(), 0.0),
    ]);
    assert_eq!(case.decided().outcome(), Outcome::InsufficientEvidence);
    case.contract.weights.insert("metrics".to_owned(), 0.25);
    assert_eq!(case.decided().outcome(), Outcome::Complete);

    // Evidence kinds: nothing accepted cites an impact metric.
    let mut case = Case::new(
        JoinStrategy::All,
        vec![logs_result(), changes_result(), metrics_result()],
    );
    case.contract.minimum.required_evidence_kinds =
        ids(&["impact_metric", "causal_signal", "trace_span"]);
    let d = case.decided();
    assert_eq!(d.outcome(), Outcome::InsufficientEvidence);
    assert_eq!(d.missing_evidence_kinds, ids(&["trace_span"]));
    case.contract.minimum.required_evidence_kinds = ids(&["impact_metric", "causal_signal"]);
    let d = case.decided();
    assert!(d.quorum_met && d.missing_evidence_kinds.is_empty());
}

#[test]
fn negative_weights_count_as_zero() {
    let mut case = Case::new(
        JoinStrategy::All,
        vec![logs_result(), metrics_result(), changes_result()],
    );
    case.contract.minimum.weight = 2.0;
    case.contract.weights = BTreeMap::from([("logs".to_owned(), -1.0)]);
    // 0 + 1 + 1: a negative weight must not pull the accepted weight below the others'.
    assert!(case.decided().quorum_met);
    case.contract.minimum.weight = 2.5;
    assert!(!case.decided().quorum_met);
}

#[test]
fn a_required_reference_that_names_nothing_can_never_be_met() {
    let mut case = Case::new(
        JoinStrategy::All,
        vec![logs_result(), metrics_result(), changes_result()],
    );
    case.contract.required.push("impact_assessment".to_owned());
    let d = case.decided();
    assert_eq!(d.outcome(), Outcome::InsufficientEvidence);
    assert_eq!(d.missing_required, ids(&["impact_assessment"]));
    assert_eq!(d.accepted, ids(&[LOGS, METRICS, CHANGES]));
}

#[test]
fn required_references_match_plan_names_and_profile_ids() {
    let mut case = Case::new(
        JoinStrategy::All,
        vec![logs_result(), metrics_result(), changes_result()],
    );
    case.results[2].status = v1::TaskStatus::Failed.into();
    assert_eq!(case.decided().outcome(), Outcome::PartialEvidence);
    case.contract.required = ids(&["change-auditor"]);
    let d = case.decided();
    assert_eq!(d.outcome(), Outcome::InsufficientEvidence);
    assert_eq!(d.missing_required, ids(&[CHANGES]));
    assert!(
        d.missing_optional.is_empty(),
        "logs and metrics are accepted"
    );
}

#[test]
fn a_delegation_listed_twice_in_the_plan_counts_once() {
    let mut case = Case::new(
        JoinStrategy::All,
        vec![logs_result(), metrics_result(), changes_result()],
    );
    case.plan.push(plan()[0].clone());
    let d = case.decided();
    assert_eq!(d.outcome(), Outcome::Complete);
    assert_eq!(d.accepted, ids(&[LOGS, METRICS, CHANGES]));
}

#[test]
fn conflict_requires_human_and_keeps_both_claims_with_their_evidence() {
    let case = Case::new(
        JoinStrategy::All,
        vec![changes_blaming_rule(), metrics_result(), logs_result()],
    );
    let d = case.decided();
    assert_eq!(d.outcome(), Outcome::ConflictRequiresHuman);
    assert_eq!(d.conflicts.len(), 1);
    let c = &d.conflicts[0];
    assert_eq!(c.topic, "primary_cause");
    assert_eq!(c.resolution(), v1::ConflictResolution::Unresolved);
    assert!(c.next_query.is_empty());
    let sides: Vec<(&str, &str, &[String])> = c
        .claims
        .iter()
        .map(|s| {
            (
                s.delegation_id.as_str(),
                s.value.as_str(),
                s.evidence_refs.as_slice(),
            )
        })
        .collect();
    assert_eq!(
        sides,
        vec![
            (
                LOGS,
                "connection_pool_exhaustion",
                &[POOL_EVIDENCE.to_owned()][..]
            ),
            (CHANGES, "risk_rule_change", &[RULE_EVIDENCE.to_owned()][..]),
        ],
        "both sides, in plan order, with their evidence"
    );
    assert!(
        d.reasons
            .iter()
            .any(|r| r.starts_with("conflict on `primary_cause`")
                && r.contains("from `logs`")
                && r.contains("from `changes`")),
        "{:?}",
        d.reasons
    );
}

#[test]
fn a_settled_conflict_is_kept_with_the_settlement_and_no_longer_needs_a_human() {
    let results = vec![changes_blaming_rule(), metrics_result(), logs_result()];
    let d = Case::new(JoinStrategy::All, results.clone())
        .settled("primary_cause", CHANGES, "risk_rule_change")
        .decided();
    assert_eq!(d.outcome(), Outcome::Complete, "{:?}", d.reasons);
    assert_eq!(d.conflicts.len(), 1, "a settled conflict is never dropped");
    let c = &d.conflicts[0];
    assert_eq!(c.resolution(), v1::ConflictResolution::Settled);
    assert_eq!(c.claims.len(), 2, "both sides stay on record");
    let s = c
        .settlement
        .as_ref()
        .expect("the settlement is on the conflict");
    assert_eq!(
        (s.delegation_id.as_str(), s.decided_by.as_str()),
        (CHANGES, "oncall@acme")
    );
    assert!(
        d.reasons
            .iter()
            .any(|r| r.contains("settled by oncall@acme")
                && r.contains("a human judgement")
                && r.contains("from `changes`")),
        "{:?}",
        d.reasons
    );
    // A settlement naming a delegation that is not a side, or a topic not in conflict,
    // settles nothing.
    let d = Case::new(JoinStrategy::All, results.clone())
        .settled("primary_cause", METRICS, "risk_rule_change")
        .decided();
    assert_eq!(d.outcome(), Outcome::ConflictRequiresHuman);
    assert!(d.conflicts[0].settlement.is_none());
    let d = Case::new(JoinStrategy::All, results)
        .settled("impact", CHANGES, "risk_rule_change")
        .decided();
    assert_eq!(d.outcome(), Outcome::ConflictRequiresHuman);
}

#[test]
fn follow_up_conflicts_propose_a_targeted_query() {
    let mut case = Case::new(
        JoinStrategy::All,
        vec![logs_result(), metrics_result(), changes_blaming_rule()],
    );
    case.contract.on_conflict = OnConflict::FollowUp;
    let d = case.decided();
    assert_eq!(d.outcome(), Outcome::ConflictRequiresHuman);
    let c = &d.conflicts[0];
    assert_eq!(c.resolution(), v1::ConflictResolution::FollowUpRequested);
    assert_eq!(
        c.next_query,
        "compare evidence for primary_cause: connection_pool_exhaustion vs risk_rule_change"
    );
}

#[test]
fn a_gap_outranks_a_conflict_but_the_conflict_is_still_reported() {
    let d = Case::new(
        JoinStrategy::All,
        vec![logs_result(), changes_blaming_rule()],
    )
    .at(AFTER_DEADLINE)
    .decided();
    assert_eq!(d.outcome(), Outcome::PartialEvidence);
    assert_eq!(d.conflicts.len(), 1, "conflicts are never dropped");
    assert_eq!(d.conflicts[0].claims.len(), 2);
}

// ---------------------------------------------------------------------------------------
// Strategies
// ---------------------------------------------------------------------------------------

#[test]
fn all_waits_for_every_delegation_until_the_deadline() {
    let case = Case::new(JoinStrategy::All, vec![metrics_result(), logs_result()]);
    assert_eq!(case.waiting_for(), ids(&[CHANGES]));

    let mut case = case;
    case.results.push(changes_result());
    assert_eq!(case.decided().outcome(), Outcome::Complete);

    let d = Case::new(JoinStrategy::All, vec![metrics_result(), logs_result()])
        .at(600)
        .decided();
    assert_eq!(
        d.outcome(),
        Outcome::PartialEvidence,
        "decides at the deadline"
    );
    assert_eq!(d.missing_optional, ids(&[CHANGES]));
}

#[test]
fn quorum_decides_early_once_quorum_met() {
    let mut case = Case::new(JoinStrategy::Quorum, vec![logs_result()]);
    case.contract.minimum.count = 2;
    assert_eq!(case.waiting_for(), ids(&[METRICS, CHANGES]));

    // Two accepted but the required one rejected: not early.
    let mut bad_logs = logs_result();
    bad_logs.status = v1::TaskStatus::Failed.into();
    case.results = vec![bad_logs, metrics_result(), changes_result()];
    assert!(matches!(case.state(), JoinState::Decided(_)), "all in");
    case.results.pop();
    assert_eq!(case.waiting_for(), ids(&[CHANGES]));

    case.results = vec![metrics_result(), logs_result()];
    let d = case.decided();
    assert!(d.quorum_met && d.missing_required.is_empty());
    assert_eq!(d.accepted, ids(&[LOGS, METRICS]));
    assert_eq!(d.outcome(), Outcome::PartialEvidence);
    assert_eq!(
        d.missing_optional,
        ids(&[CHANGES]),
        "the pending one is the gap"
    );
}

#[test]
fn first_valid_decides_on_first_accepted() {
    let mut case = Case::new(JoinStrategy::FirstValid, Vec::new());
    case.contract.required.clear();
    assert_eq!(case.waiting_for(), ids(&[LOGS, METRICS, CHANGES]));

    let mut bad_metrics = metrics_result();
    bad_metrics.claims.clear();
    case.results = vec![bad_metrics.clone()];
    assert_eq!(
        case.waiting_for(),
        ids(&[LOGS, CHANGES]),
        "rejected is not valid"
    );

    case.results = vec![bad_metrics.clone(), changes_result()];
    let d = case.decided();
    assert_eq!(d.accepted, ids(&[CHANGES]));
    assert_eq!(d.outcome(), Outcome::PartialEvidence);
    assert_eq!(d.missing_optional, ids(&[LOGS, METRICS]));

    // Two valid at once: both accepted, in plan order whatever arrived first.
    case.results = vec![changes_result(), bad_metrics, logs_result()];
    assert_eq!(case.decided().accepted, ids(&[LOGS, CHANGES]));
}

#[test]
fn timeout_partial_waits_before_the_deadline_and_names_the_gap_after_it() {
    let case = Case::new(
        JoinStrategy::TimeoutPartial,
        vec![changes_result(), logs_result()],
    );
    assert_eq!(case.waiting_for(), ids(&[METRICS]));

    let case = case.at(AFTER_DEADLINE);
    let d = case.decided();
    assert_eq!(d.outcome(), Outcome::PartialEvidence);
    assert_eq!(d.missing_optional, ids(&[METRICS]));
    assert!(d.quorum_met);
    assert!(
        d.reasons
            .iter()
            .any(|r| r == "deadline passed with optional delegation `metrics` pending"),
        "{:?}",
        d.reasons
    );

    // Under FAIL the same deadline fails the join.
    let mut case = case;
    case.contract.on_timeout = OnTimeout::Fail;
    assert_eq!(case.decided().outcome(), Outcome::InsufficientEvidence);
}

#[test]
fn timeout_partial_does_not_decide_early_even_with_the_minimum_met() {
    let case = Case::new(
        JoinStrategy::TimeoutPartial,
        vec![metrics_result(), changes_result()],
    );
    assert_eq!(case.waiting_for(), ids(&[LOGS]));
    let d = case.at(AFTER_DEADLINE).decided();
    assert_eq!(d.outcome(), Outcome::InsufficientEvidence);
    assert_eq!(d.missing_required, ids(&[LOGS]));
}

#[test]
fn fail_on_timeout_also_fails_when_the_gap_is_a_rejected_result() {
    let mut metrics = metrics_result();
    metrics.status = v1::TaskStatus::Failed.into();
    let mut case = Case::new(
        JoinStrategy::TimeoutPartial,
        vec![logs_result(), changes_result(), metrics],
    )
    .at(AFTER_DEADLINE);
    case.contract.on_timeout = OnTimeout::Fail;
    assert_eq!(case.decided().outcome(), Outcome::InsufficientEvidence);
    // Before the deadline the set is complete and the deadline has nothing to say.
    assert_eq!(
        case.at(BEFORE_DEADLINE).decided().outcome(),
        Outcome::PartialEvidence
    );
}

// ---------------------------------------------------------------------------------------
// Required profiles
// ---------------------------------------------------------------------------------------

const LOGS_FOLLOW_UP: &str = "del-logs-2";

/// `logs-2`: the follow-up a planner sends to the `logs` profile after its first attempt.
fn logs_follow_up() -> ExpectedDelegation {
    delegation(LOGS_FOLLOW_UP, "logs-2", "logs-investigator", "logs://")
}

fn follow_up_result() -> v1::TaskResult {
    result_for(
        &logs_follow_up(),
        vec![claim(
            "claim-log-2",
            "primary_cause",
            "connection_pool_exhaustion",
            &["logs://payment-api/q-timeouts"],
        )],
    )
}

/// The first `logs` attempt, reported as FAILED.
fn failed_logs() -> v1::TaskResult {
    let mut logs = logs_result();
    logs.status = v1::TaskStatus::Failed.into();
    logs
}

/// A planner's run: the incident's delegations plus the follow-up `logs-2`; the contract
/// names no delegation and requires the `logs-investigator` profile.
fn planner_case(strategy: JoinStrategy, results: Vec<v1::TaskResult>) -> Case {
    let mut case = Case::new(strategy, results);
    case.plan.push(logs_follow_up());
    case.contract.required.clear();
    case.contract.optional.clear();
    case.contract.required_profiles = ids(&["logs-investigator"]);
    case
}

#[test]
fn a_required_profile_is_met_by_a_follow_up_after_a_rejected_first_result() {
    let case = planner_case(
        JoinStrategy::All,
        vec![
            failed_logs(),
            metrics_result(),
            changes_result(),
            follow_up_result(),
        ],
    );
    let d = case.decided();
    assert!(d.missing_required.is_empty(), "{:?}", d.missing_required);
    assert_eq!(d.accepted, ids(&[METRICS, CHANGES, LOGS_FOLLOW_UP]));
    assert_eq!(rejection(&d, LOGS).reason(), Reason::NotSuccessful);
    assert_eq!(
        d.outcome(),
        Outcome::PartialEvidence,
        "the rejected first attempt is a named gap, not a failed join"
    );
    assert_eq!(d.missing_optional, ids(&[LOGS]));
    assert!(
        d.reasons.iter().any(|r| r.starts_with(
            "delegation `logs` of required profile `logs-investigator` rejected: status is"
        )),
        "{:?}",
        d.reasons
    );

    // Named in `required` instead, the profile makes each of its delegations required.
    let mut every = case;
    every.contract.required_profiles.clear();
    every.contract.required = ids(&["logs-investigator"]);
    let d = every.decided();
    assert_eq!(d.outcome(), Outcome::InsufficientEvidence);
    assert_eq!(d.missing_required, ids(&[LOGS]));

    // Both attempts rejected: the profile is unmet, and named by its id.
    let mut failed_follow_up = follow_up_result();
    failed_follow_up.claims.clear();
    let d = planner_case(
        JoinStrategy::All,
        vec![
            failed_logs(),
            metrics_result(),
            changes_result(),
            failed_follow_up,
        ],
    )
    .decided();
    assert_eq!(d.outcome(), Outcome::InsufficientEvidence);
    assert_eq!(d.missing_required, ids(&["logs-investigator"]));
    assert_eq!(d.missing_optional, ids(&[LOGS, LOGS_FOLLOW_UP]));
    assert!(
        d.quorum_met,
        "the minimum is met; the profile alone fails it"
    );
    assert!(
        d.reasons.iter().any(|r| r
            == "required profile `logs-investigator` has no accepted delegation (of `logs`, `logs-2`)"),
        "{:?}",
        d.reasons
    );
}

#[test]
fn a_required_profile_without_a_delegation_can_never_be_met() {
    let mut case = Case::new(
        JoinStrategy::All,
        vec![logs_result(), metrics_result(), changes_result()],
    );
    case.contract.required_profiles = ids(&["trace-analyst"]);
    let d = case.decided();
    assert_eq!(d.outcome(), Outcome::InsufficientEvidence);
    assert_eq!(d.missing_required, ids(&["trace-analyst"]));
    assert_eq!(d.accepted, ids(&[LOGS, METRICS, CHANGES]));
    assert!(d.quorum_met && d.missing_optional.is_empty());
    assert!(
        d.reasons
            .iter()
            .any(|r| r == "required profile `trace-analyst` has no delegation in the run"),
        "{:?}",
        d.reasons
    );

    // Listed after the required delegations and the unmatched references, in contract
    // order; a met profile is not listed.
    case.results[0] = failed_logs();
    case.contract.required.push("impact_assessment".to_owned());
    case.contract.required_profiles = ids(&["trace-analyst", "change-auditor", "db-analyst"]);
    let d = case.decided();
    assert_eq!(
        d.missing_required,
        ids(&[LOGS, "impact_assessment", "trace-analyst", "db-analyst"])
    );

    // QUORUM never decides early on it: only the deadline or a full set decides.
    let mut case = Case::new(JoinStrategy::Quorum, vec![logs_result(), metrics_result()]);
    case.contract.required_profiles = ids(&["trace-analyst"]);
    assert_eq!(case.waiting_for(), ids(&[CHANGES]));
    let d = case.at(AFTER_DEADLINE).decided();
    assert_eq!(d.outcome(), Outcome::InsufficientEvidence);
    assert_eq!(d.missing_required, ids(&["trace-analyst"]));
}

#[test]
fn quorum_waits_for_an_outstanding_delegation_of_a_required_profile() {
    let mut case = planner_case(
        JoinStrategy::Quorum,
        vec![metrics_result(), changes_result(), failed_logs()],
    );
    case.contract.minimum.count = 2;
    let provisional = assess(&case.input());
    assert!(provisional.quorum_met);
    assert_eq!(provisional.missing_required, ids(&["logs-investigator"]));
    assert_eq!(
        case.waiting_for(),
        ids(&[LOGS_FOLLOW_UP]),
        "the minimum is met, but the profile's follow-up is outstanding"
    );

    case.results.push(follow_up_result());
    let d = case.decided();
    assert!(d.missing_required.is_empty());
    assert_eq!(d.outcome(), Outcome::PartialEvidence);

    // One accepted delegation of the profile is enough: the other is not waited for.
    case.results = vec![follow_up_result(), metrics_result()];
    let d = case.decided();
    assert_eq!(d.accepted, ids(&[METRICS, LOGS_FOLLOW_UP]));
    assert!(d.missing_required.is_empty() && d.quorum_met);
    assert_eq!(d.outcome(), Outcome::PartialEvidence);
    assert_eq!(d.missing_optional, ids(&[LOGS, CHANGES]));

    // Without one, no quorum of other results decides early.
    case.results = vec![metrics_result(), changes_result()];
    assert_eq!(case.waiting_for(), ids(&[LOGS, LOGS_FOLLOW_UP]));
    let d = case.at(AFTER_DEADLINE).decided();
    assert_eq!(d.outcome(), Outcome::InsufficientEvidence);
    assert_eq!(d.missing_required, ids(&["logs-investigator"]));
}

/// Every ordering of `items`.
fn permutations<T: Clone>(items: &[T]) -> Vec<Vec<T>> {
    if items.len() <= 1 {
        return vec![items.to_vec()];
    }
    let mut all = Vec::new();
    for i in 0..items.len() {
        let mut rest = items.to_vec();
        let first = rest.remove(i);
        for mut tail in permutations(&rest) {
            tail.insert(0, first.clone());
            all.push(tail);
        }
    }
    all
}

#[test]
fn a_required_profile_is_judged_the_same_whatever_the_arrival_order() {
    let mut failed_follow_up = follow_up_result();
    failed_follow_up.status = v1::TaskStatus::Blocked.into();
    let result_sets = [
        // A rejected first attempt and an accepted follow-up, delivered twice.
        vec![
            failed_logs(),
            follow_up_result(),
            metrics_result(),
            changes_result(),
            follow_up_result(),
        ],
        // An accepted first attempt and a rejected follow-up.
        vec![
            logs_result(),
            failed_follow_up.clone(),
            metrics_result(),
            changes_result(),
        ],
        // Both rejected, one delegation outstanding.
        vec![failed_logs(), failed_follow_up, metrics_result()],
    ];
    for strategy in [
        JoinStrategy::All,
        JoinStrategy::Quorum,
        JoinStrategy::TimeoutPartial,
        JoinStrategy::FirstValid,
    ] {
        for results in &result_sets {
            for secs in [BEFORE_DEADLINE, AFTER_DEADLINE] {
                let expected = planner_case(strategy, results.clone()).at(secs).state();
                for order in permutations(results) {
                    assert_eq!(
                        planner_case(strategy, order).at(secs).state(),
                        expected,
                        "{strategy:?} at {secs} s"
                    );
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// Rejection reasons, one per check
// ---------------------------------------------------------------------------------------

#[test]
fn rejects_unknown_delegation_after_the_plan_ordered_rejections() {
    let ghost = |id: &str| {
        let mut r = logs_result();
        r.delegation_id = id.to_owned();
        r
    };
    let mut bad_metrics = metrics_result();
    bad_metrics.status = v1::TaskStatus::Blocked.into();
    let d = Case::new(
        JoinStrategy::All,
        vec![
            ghost("del-zeta"),
            logs_result(),
            ghost("del-alpha"),
            bad_metrics,
            changes_result(),
            ghost("del-zeta"),
        ],
    )
    .decided();
    let rejected: Vec<(&str, Reason)> = d
        .rejected
        .iter()
        .map(|r| (r.delegation_id.as_str(), r.reason()))
        .collect();
    assert_eq!(
        rejected,
        vec![
            (METRICS, Reason::NotSuccessful),
            ("del-alpha", Reason::UnknownDelegation),
            ("del-zeta", Reason::UnknownDelegation),
        ]
    );
    assert!(rejection(&d, "del-zeta").detail.contains("del-zeta"));
    assert_eq!(d.accepted, ids(&[LOGS, CHANGES]));
}

#[test]
fn rejects_worker_mismatch() {
    let mut logs = logs_result();
    logs.worker_id = "worker-intruder".to_owned();
    // The worker check comes before the status check.
    logs.status = v1::TaskStatus::Failed.into();
    let (_, r) = reject_logs(logs.clone());
    assert_eq!(r.reason(), Reason::WorkerMismatch);
    assert!(r.detail.contains("worker-intruder") && r.detail.contains("worker-logs"));

    // A re-dispatched delegation accepts its second worker; no worker list accepts any.
    let mut case = Case::new(
        JoinStrategy::All,
        vec![logs_result(), metrics_result(), changes_result()],
    );
    case.results[0].worker_id = "worker-logs-2".to_owned();
    case.plan[0].worker_ids.push("worker-logs-2".to_owned());
    assert_eq!(case.decided().outcome(), Outcome::Complete);
    case.plan[0].worker_ids.clear();
    case.results[0].worker_id = "anyone".to_owned();
    assert_eq!(case.decided().outcome(), Outcome::Complete);
}

#[test]
fn rejects_profile_mismatch() {
    let mut logs = logs_result();
    logs.profile_id = "metrics-investigator".to_owned();
    let (_, r) = reject_logs(logs);
    assert_eq!(r.reason(), Reason::ProfileMismatch);
    assert!(r.detail.contains("metrics-investigator") && r.detail.contains("logs-investigator"));
}

#[test]
fn rejects_results_that_are_not_successful() {
    for status in [
        v1::TaskStatus::Failed,
        v1::TaskStatus::Blocked,
        v1::TaskStatus::TimedOut,
        v1::TaskStatus::Unspecified,
    ] {
        let mut logs = logs_result();
        logs.status = status.into();
        logs.error = Some(v1::ErrorInfo {
            code: "upstream_unavailable".to_owned(),
            retryable: true,
            message: "log backend unreachable".to_owned(),
        });
        let (_, r) = reject_logs(logs);
        assert_eq!(r.reason(), Reason::NotSuccessful, "{status:?}");
        assert!(
            r.detail.contains(status.as_str_name()) && r.detail.contains("upstream_unavailable"),
            "{}",
            r.detail
        );
    }
    let mut logs = logs_result();
    logs.status = 42;
    assert_eq!(reject_logs(logs).1.reason(), Reason::NotSuccessful);
}

#[test]
fn rejects_results_without_claims_even_when_partial() {
    let mut logs = logs_result();
    logs.status = v1::TaskStatus::Partial.into();
    logs.claims.clear();
    logs.missing_evidence = ids(&["log-shard-cn-east-3"]);
    let (_, r) = reject_logs(logs);
    assert_eq!(r.reason(), Reason::NoClaims);

    // A PARTIAL result with a valid claim is accepted.
    let mut logs = logs_result();
    logs.status = v1::TaskStatus::Partial.into();
    let d = Case::new(
        JoinStrategy::All,
        vec![logs, metrics_result(), changes_result()],
    )
    .decided();
    assert_eq!(d.outcome(), Outcome::Complete);
}

#[test]
fn rejects_claims_without_evidence_before_checking_prefixes() {
    let mut logs = logs_result();
    // The first claim is outside the prefixes, the second cites nothing: check 5 wins.
    logs.claims = vec![
        claim("claim-log-0", "impact", "x", &["changes://elsewhere"]),
        claim("claim-log-1", "primary_cause", "y", &[]),
    ];
    let (_, r) = reject_logs(logs);
    assert_eq!(r.reason(), Reason::ClaimWithoutEvidence);
    assert!(r.detail.contains("claim-log-1"));
}

#[test]
fn rejects_evidence_outside_the_delegation_prefixes() {
    let mut logs = logs_result();
    logs.claims[0]
        .evidence_refs
        .push("changes://risk-rule/r-42".to_owned());
    let (_, r) = reject_logs(logs);
    assert_eq!(r.reason(), Reason::EvidenceOutsidePrefix);
    assert!(r.detail.contains("changes://risk-rule/r-42") && r.detail.contains("claim-log-1"));

    // No prefix at all allows nothing, even evidence the store verifies.
    let mut case = Case::new(
        JoinStrategy::All,
        vec![logs_result(), metrics_result(), changes_result()],
    );
    case.plan[0].allowed_evidence_prefixes.clear();
    assert_eq!(
        reject_logs_in(case).1.reason(),
        Reason::EvidenceOutsidePrefix
    );
}

#[test]
fn rejects_evidence_the_store_does_not_know() {
    let mut logs = logs_result();
    logs.claims[0]
        .evidence_refs
        .push("logs://payment-api/never-recorded".to_owned());
    let (_, r) = reject_logs(logs);
    assert_eq!(r.reason(), Reason::EvidenceUnknown);
    assert!(r.detail.contains("logs://payment-api/never-recorded"));

    let mut case = Case::new(
        JoinStrategy::All,
        vec![logs_result(), metrics_result(), changes_result()],
    );
    case.evidence
        .insert(POOL_EVIDENCE.to_owned(), EvidenceFact::Unknown);
    assert_eq!(reject_logs_in(case).1.reason(), Reason::EvidenceUnknown);
}

#[test]
fn rejects_evidence_whose_artifact_is_missing() {
    let mut case = Case::new(
        JoinStrategy::All,
        vec![logs_result(), metrics_result(), changes_result()],
    );
    case.evidence
        .insert(POOL_EVIDENCE.to_owned(), EvidenceFact::ArtifactMissing);
    let (_, r) = reject_logs_in(case);
    assert_eq!(r.reason(), Reason::ArtifactMissing);
    assert!(r.detail.contains(POOL_EVIDENCE));
}

#[test]
fn rejects_hash_mismatch_from_the_store_or_from_the_result_record() {
    let mut case = Case::new(
        JoinStrategy::All,
        vec![logs_result(), metrics_result(), changes_result()],
    );
    case.evidence
        .insert(POOL_EVIDENCE.to_owned(), EvidenceFact::HashMismatch);
    assert_eq!(reject_logs_in(case).1.reason(), Reason::HashMismatch);

    // The store verifies the artifact, but the result carries another hash for it.
    let record = |hash: String| v1::Evidence {
        evidence_id: POOL_EVIDENCE.to_owned(),
        kind: "causal_signal".to_owned(),
        content_hash: hash,
        ..Default::default()
    };
    let mut logs = logs_result();
    logs.evidence.push(record(hash_of("tampered bytes")));
    let (_, r) = reject_logs(logs);
    assert_eq!(r.reason(), Reason::HashMismatch);
    assert!(r.detail.contains(&hash_of("tampered bytes")));

    let mut logs = logs_result();
    logs.evidence.push(record(hash_of(POOL_EVIDENCE)));
    let d = Case::new(
        JoinStrategy::All,
        vec![logs, metrics_result(), changes_result()],
    )
    .decided();
    assert_eq!(d.outcome(), Outcome::Complete, "a matching record is fine");
}

#[test]
fn check_result_runs_the_single_result_checks_in_order() {
    let p = plan();
    assert_eq!(check_result(&p[0], &logs_result(), &store()), Ok(()));
    let mut r = logs_result();
    r.profile_id = "change-auditor".to_owned();
    r.claims.clear();
    let cause = check_result(&p[0], &r, &store()).unwrap_err();
    assert_eq!(cause.reason, Reason::ProfileMismatch);
    assert!(
        cause
            .to_string()
            .ends_with("(REJECTION_REASON_PROFILE_MISMATCH)"),
        "{cause}"
    );
}

#[test]
fn cited_evidence_ids_lists_what_to_ask_the_store() {
    let mut logs = logs_result();
    logs.claims.push(claim(
        "claim-log-2",
        "symptom",
        "timeouts",
        &["logs://payment-api/q-timeouts", POOL_EVIDENCE],
    ));
    let cited = cited_evidence_ids(&[logs, changes_result()]);
    assert_eq!(
        cited,
        BTreeSet::from([
            "changes://risk-rule/r-42".to_owned(),
            "logs://payment-api/q-pool".to_owned(),
            "logs://payment-api/q-timeouts".to_owned(),
        ])
    );
}

// ---------------------------------------------------------------------------------------
// Duplicates
// ---------------------------------------------------------------------------------------

#[test]
fn identical_duplicates_are_accepted_once() {
    let d = Case::new(
        JoinStrategy::All,
        vec![
            logs_result(),
            metrics_result(),
            logs_result(),
            changes_result(),
            logs_result(),
        ],
    )
    .decided();
    assert_eq!(d.outcome(), Outcome::Complete);
    assert_eq!(d.accepted, ids(&[LOGS, METRICS, CHANGES]));
    assert!(d.rejected.is_empty());
}

#[test]
fn conflicting_duplicates_are_rejected_whatever_the_order() {
    let mut second = logs_result();
    second.claims[0].value = "thread_pool_starvation".to_owned();
    let one = Case::new(
        JoinStrategy::All,
        vec![
            logs_result(),
            second.clone(),
            metrics_result(),
            changes_result(),
        ],
    )
    .decided();
    let other = Case::new(
        JoinStrategy::All,
        vec![second, metrics_result(), changes_result(), logs_result()],
    )
    .decided();
    assert_eq!(one, other);
    assert_eq!(rejection(&one, LOGS).reason(), Reason::ConflictingDuplicate);
    assert!(!one.accepted.contains(&LOGS.to_owned()));
    assert_eq!(one.outcome(), Outcome::InsufficientEvidence);
}

#[test]
fn a_second_result_from_a_foreign_worker_rejects_the_delegation() {
    let mut intruder = logs_result();
    intruder.worker_id = "worker-intruder".to_owned();
    let (_, r) = reject_logs(intruder.clone());
    assert_eq!(r.reason(), Reason::WorkerMismatch);
    let d = Case::new(
        JoinStrategy::All,
        vec![logs_result(), intruder, metrics_result(), changes_result()],
    )
    .decided();
    assert_eq!(rejection(&d, LOGS).reason(), Reason::WorkerMismatch);
    assert!(!d.accepted.contains(&LOGS.to_owned()));
}

// ---------------------------------------------------------------------------------------
// Late results
// ---------------------------------------------------------------------------------------

/// TIMEOUT_PARTIAL decided at the deadline without `metrics`, and `metrics` arriving late.
fn late_metrics(policy: LateResultPolicy) -> (Case, v1::JoinDecision) {
    let mut case = Case::new(
        JoinStrategy::TimeoutPartial,
        vec![logs_result(), changes_result()],
    )
    .at(600);
    case.contract.late_result = policy;
    let first = case.decided();
    assert_eq!(first.outcome(), Outcome::PartialEvidence);
    case.results.push(metrics_result());
    case.now = at(AFTER_DEADLINE);
    (case, first)
}

#[test]
fn late_result_under_discard_leaves_the_decision_and_records_it() {
    let (case, first) = late_metrics(LateResultPolicy::Discard);
    let after = apply_late(&first, &case.input(), METRICS);
    let mut expected = first.clone();
    expected.late_discarded = ids(&[METRICS]);
    assert_eq!(after, expected);
    // Redelivery of the same late result changes nothing more.
    assert_eq!(apply_late(&after, &case.input(), METRICS), after);
}

#[test]
fn late_result_under_append_revision_recomputes_a_new_revision() {
    let (case, first) = late_metrics(LateResultPolicy::AppendRevision);
    let second = apply_late(&first, &case.input(), METRICS);
    assert_eq!(second.revision, 2);
    assert_eq!(second.outcome(), Outcome::Complete);
    assert_eq!(second.accepted, ids(&[LOGS, METRICS, CHANGES]));
    assert!(second.missing_optional.is_empty() && second.late_discarded.is_empty());
    assert_eq!(
        second.decided_at,
        Some(prost_types::Timestamp::from(at(AFTER_DEADLINE)))
    );

    // A later revision is never pending, even where the strategy would still wait.
    let mut case = case;
    case.contract.strategy = JoinStrategy::All;
    case.contract.deadline = None;
    case.results = vec![logs_result()];
    assert!(matches!(case.state(), JoinState::Pending { .. }));
    let third = apply_late(&second, &case.input(), LOGS);
    assert_eq!(third.revision, 3);
    assert_eq!(third.outcome(), Outcome::PartialEvidence);
}

#[test]
fn assess_is_what_decide_returns_once_it_decides() {
    let case = Case::new(JoinStrategy::All, vec![logs_result()]);
    assert!(matches!(case.state(), JoinState::Pending { .. }));
    let provisional = assess(&case.input());
    assert_eq!(provisional.outcome(), Outcome::PartialEvidence);
    let case = case.at(AFTER_DEADLINE);
    assert_eq!(JoinState::Decided(assess(&case.input())), case.state());
}
