//! The deterministic join: (contract, delegations, results, evidence facts, now) → a
//! decision, or "pending".
//!
//! The join never calls a model and never performs I/O: the supervisor asks the evidence
//! store about every cited evidence id ([`cited_evidence_ids`]) and hands the answers in
//! as [`EvidenceFact`]s, so the same inputs always give the same decision, in the
//! supervisor, in tests and in recovery.
//!
//! # Checks
//!
//! The results of each expected delegation are judged together, in this fixed order; the
//! first check that fails is the delegation's [`v1::RejectionReason`]:
//!
//! 1. the result names an expected delegation (else `UNKNOWN_DELEGATION`);
//! 2. its worker is one the delegation was dispatched to, then its profile is the
//!    delegation's (`WORKER_MISMATCH`, `PROFILE_MISMATCH`), for every result of it;
//! 3. identical copies count once; results that differ reject the delegation
//!    (`CONFLICTING_DUPLICATE`, fail closed: none of them is accepted);
//! 4. status COMPLETED or PARTIAL with at least one claim (`NOT_SUCCESSFUL`, `NO_CLAIMS`);
//! 5. every claim cites evidence (`CLAIM_WITHOUT_EVIDENCE`);
//! 6. every cited id lies under one of the delegation's evidence prefixes
//!    (`EVIDENCE_OUTSIDE_PREFIX`);
//! 7. every cited id is verified by the store, and the result's own record of it carries
//!    the stored hash (`EVIDENCE_UNKNOWN`, `ARTIFACT_MISSING`, `HASH_MISMATCH`).
//!
//! Over the accepted results it then finds the required delegations without an accepted
//! result, the required profiles without an accepted delegation, the minimum (count,
//! weight, evidence kinds) and the conflicts (one topic, two or more values: every claim
//! on the topic is kept, with its evidence). A conflict a person settled
//! ([`JoinInput::settlements`]: one side chosen, with a rationale) is kept too, marked
//! SETTLED with the settlement: a human judgement, apart from the claims.
//!
//! # Required delegations and required profiles
//!
//! A reference in `required` (a plan name or a profile id) makes every delegation it
//! names required: each of them needs an accepted result. A profile in
//! `required_profiles` is met by *one* accepted delegation of that profile, whichever:
//! a planner may delegate to a profile several times (a follow-up is a new delegation),
//! so a rejected first attempt does not fail the join once a later delegation of the
//! profile is accepted — the delegations of a required profile are not required one by
//! one, and an unaccepted one is a gap like an optional delegation's. An unmet required
//! profile is listed in `missing_required` by its id, after the required delegations and
//! unmatched required references.
//!
//! # Outcome
//!
//! In this precedence: `INSUFFICIENT_EVIDENCE` (a required delegation or a required
//! profile without an accepted result, the minimum not met, or an `on_timeout = FAIL`
//! deadline passed with a gap),
//! `PARTIAL_EVIDENCE` (some expected delegation without an accepted result),
//! `CONFLICT_REQUIRES_HUMAN` (a conflict nobody settled), `COMPLETE_WITH_REVIEW_REQUIRED`
//! (an accepted result proposes
//! an action above R1; an unset level counts as R3), `COMPLETE`.
//!
//! # Choices
//!
//! - **Order independence.** Results are grouped by delegation and every list is built in
//!   plan order or sorted, so any permutation of the results gives the identical decision.
//! - **Every result of a delegation is judged.** A second result from a foreign worker
//!   or profile rejects the delegation even when another result is fine: a delegation is
//!   never both accepted and rejected, and failing closed keeps an answer from counting
//!   when its provenance is in doubt.
//! - **No early failure.** A rejected required delegation already fixes the outcome at
//!   `INSUFFICIENT_EVIDENCE`, but the join still waits for the strategy's trigger, so the
//!   decision carries every result that arrives before the deadline (a fuller provisional
//!   picture) and `TIMEOUT_PARTIAL` never decides before all required results are in.
//! - **`on_timeout = FAIL`** fails a join whose deadline has passed while some expected
//!   delegation has no *accepted* result. Counting a rejected result as "in" would let a
//!   worker escape the failure by sending anything at all, even a FAILED report, and
//!   adding an invalid result must never improve a decision.
//! - **Weights** below zero (or not a number) count as zero, for the same reason: removing
//!   an accepted delegation must never raise the accepted weight.
//! - **Empty evidence prefixes** allow nothing; an empty prefix list allows nothing.
//! - A required reference that names no delegation of the plan, and a required profile
//!   that no delegation has, is listed, as written, in `missing_required`: it can never be
//!   met.
//! - **Required profiles wait like required delegations.** While no delegation of a
//!   required profile is accepted, QUORUM does not decide early, however many others are
//!   accepted (ALL and TIMEOUT_PARTIAL wait for every expected delegation anyway, and
//!   FIRST_VALID decides on the first accepted result, as it does with a required
//!   delegation pending). Whether a profile is met depends only on the set of verdicts,
//!   so arrival order does not matter here either.
//! - A delegation id listed twice in the plan counts once (its first entry).

use std::collections::{BTreeMap, BTreeSet};

mod independence;

use std::fmt::Write as _;
use std::time::SystemTime;

use convene_proto::v1;

use crate::model::{JoinContract, JoinStrategy, LateResultPolicy, OnConflict, OnTimeout};
use crate::permissions::RiskLevel;
use crate::time::to_timestamp;

/// A delegation the join expects a result for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExpectedDelegation {
    /// The delegation's id; results name it.
    pub delegation_id: String,
    /// Plan name (or the name a planner gave it); contracts reference delegations by name
    /// or by profile id.
    pub name: String,
    /// Profile that handles it; results must come from this profile.
    pub profile_id: String,
    /// Workers it was dispatched to (a re-dispatch adds one); empty: any worker.
    pub worker_ids: Vec<String>,
    /// Prefixes cited evidence ids must start with; empty: nothing is allowed.
    pub allowed_evidence_prefixes: Vec<String>,
}

impl ExpectedDelegation {
    /// The name used in reasons: the plan name, or the id when the name is empty.
    fn label(&self) -> &str {
        if self.name.is_empty() {
            &self.delegation_id
        } else {
            &self.name
        }
    }

    fn allows_evidence(&self, evidence_id: &str) -> bool {
        self.allowed_evidence_prefixes
            .iter()
            .any(|p| !p.is_empty() && evidence_id.starts_with(p.as_str()))
    }
}

/// What the evidence store says about one evidence id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EvidenceFact {
    /// The evidence exists, its artifact exists and the bytes hash to `content_hash`.
    Verified {
        /// The evidence kind, e.g. `impact_metric`.
        kind: String,
        /// The verified `sha256:<hex>` of the artifact.
        content_hash: String,
        /// Whether the kind is its tool's default, the call having named none.
        kind_defaulted: bool,
    },
    /// No such evidence in the tenant.
    Unknown,
    /// The evidence points at an artifact that does not exist.
    ArtifactMissing,
    /// The recorded hash differs from the artifact's, or the bytes are corrupted.
    HashMismatch,
}

/// Everything the join decides on.
#[derive(Debug, Clone, Copy)]
pub struct JoinInput<'a> {
    /// The validated join contract.
    pub contract: &'a JoinContract,
    /// The expected delegations, in plan order.
    pub delegations: &'a [ExpectedDelegation],
    /// Every result received, duplicates included, in any order.
    pub results: &'a [v1::TaskResult],
    /// Store facts by evidence id; an id absent from the map counts as unknown.
    pub evidence: &'a BTreeMap<String, EvidenceFact>,
    /// The time the join is evaluated at; it becomes `decided_at`.
    pub now: SystemTime,
    /// People's settlements of conflicts, by topic: a settled conflict is kept, marked
    /// SETTLED with the settlement, and no longer holds the outcome at
    /// CONFLICT_REQUIRES_HUMAN. A settlement whose topic is not in conflict, or whose
    /// delegation is not one of the conflict's sides, changes nothing.
    pub settlements: &'a BTreeMap<String, v1::ConflictSettlement>,
}

/// No settlements: the [`JoinInput::settlements`] of a join nobody settled anything in.
pub static NO_SETTLEMENTS: BTreeMap<String, v1::ConflictSettlement> = BTreeMap::new();

/// Where a join stands.
#[derive(Debug, Clone, PartialEq)]
pub enum JoinState {
    /// The strategy does not allow a decision yet.
    Pending {
        /// Delegation ids without any result, in plan order.
        waiting_for: Vec<String>,
        /// When the join decides at the latest (None: no deadline).
        deadline: Option<SystemTime>,
    },
    /// The join decided (revision 1).
    Decided(v1::JoinDecision),
}

/// Why the join did not accept a delegation's result.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{detail} ({})", reason.as_str_name())]
pub struct RejectionCause {
    /// The first check that failed.
    pub reason: v1::RejectionReason,
    /// What failed, naming the claim, evidence or field.
    pub detail: String,
}

impl RejectionCause {
    fn new(reason: v1::RejectionReason, detail: impl Into<String>) -> Self {
        Self {
            reason,
            detail: detail.into(),
        }
    }
}

/// Decides the join if its strategy allows it now, or says what it waits for.
///
/// The strategy decides *when*: ALL and TIMEOUT_PARTIAL once every expected delegation
/// has a result; QUORUM also as soon as every required delegation is accepted, every
/// required profile has an accepted delegation and the minimum is met; FIRST_VALID also as soon as any result is accepted; every strategy
/// once the deadline has passed. *What* is decided is [`assess`].
pub fn decide(input: &JoinInput<'_>) -> JoinState {
    let evaluation = Evaluation::new(input);
    let decision = evaluation.decision(1);
    let early = match input.contract.strategy {
        JoinStrategy::All | JoinStrategy::TimeoutPartial => false,
        JoinStrategy::Quorum => decision.missing_required.is_empty() && decision.quorum_met,
        JoinStrategy::FirstValid => !decision.accepted.is_empty(),
    };
    if evaluation.all_in() || evaluation.deadline_passed() || early {
        JoinState::Decided(decision)
    } else {
        JoinState::Pending {
            waiting_for: evaluation.waiting_for(),
            deadline: input.contract.deadline,
        }
    }
}

/// Whether [`decide`] can decide on these results, whatever the evidence store says of
/// the evidence they cite. False only while ALL or TIMEOUT_PARTIAL waits for an expected
/// delegation without any result and the deadline has not passed: then `decide` is
/// pending for every `input.evidence`, so the supervisor need not ask the store yet.
pub fn may_decide(input: &JoinInput<'_>) -> bool {
    match input.contract.strategy {
        JoinStrategy::Quorum | JoinStrategy::FirstValid => true,
        JoinStrategy::All | JoinStrategy::TimeoutPartial => {
            input.contract.deadline.is_some_and(|d| input.now >= d)
                || input.delegations.iter().all(|d| {
                    input
                        .results
                        .iter()
                        .any(|r| r.delegation_id == d.delegation_id)
                })
        }
    }
}

/// The decision the join would make if it had to decide now, whatever its strategy says
/// (revision 1). [`decide`] returns exactly this once the strategy allows a decision; the
/// supervisor can show it as a provisional view before that.
pub fn assess(input: &JoinInput<'_>) -> v1::JoinDecision {
    Evaluation::new(input).decision(1)
}

/// Applies a result that arrived after `previous`, a terminal decision. Never reopens it:
///
/// - `DISCARD`: `previous` with `late_delegation_id` added to `late_discarded` (once,
///   so a redelivered late result changes nothing);
/// - `APPEND_REVISION`: a new decision over all of `input.results` at `input.now`, with
///   revision `previous.revision + 1`, whatever the strategy (a revision is never
///   pending); earlier `late_discarded` entries are kept.
pub fn apply_late(
    previous: &v1::JoinDecision,
    input: &JoinInput<'_>,
    late_delegation_id: &str,
) -> v1::JoinDecision {
    match input.contract.late_result {
        LateResultPolicy::Discard => {
            let mut decision = previous.clone();
            if !decision
                .late_discarded
                .iter()
                .any(|id| id == late_delegation_id)
            {
                decision.late_discarded.push(late_delegation_id.to_owned());
            }
            decision
        }
        LateResultPolicy::AppendRevision => {
            let revision = previous.revision.saturating_add(1);
            let mut decision = Evaluation::new(input).decision(revision);
            decision.late_discarded = previous.late_discarded.clone();
            decision.reasons.insert(
                0,
                format!(
                    "revision {revision}: recomputed over all results after a late result for `{late_delegation_id}`"
                ),
            );
            decision
        }
    }
}

/// Runs the checks that concern one result on its own (worker, profile, status, claims,
/// evidence prefixes, evidence facts), in check order. The delegation-level checks —
/// unknown delegation and conflicting duplicates — need every result and run in
/// [`decide`].
pub fn check_result(
    delegation: &ExpectedDelegation,
    result: &v1::TaskResult,
    evidence: &BTreeMap<String, EvidenceFact>,
) -> Result<(), RejectionCause> {
    check_origin(delegation, &[result])?;
    check_content(delegation, result, evidence)
}

/// Every evidence id the results' claims cite: what the supervisor asks the store about
/// before calling the join.
pub fn cited_evidence_ids(results: &[v1::TaskResult]) -> BTreeSet<String> {
    results
        .iter()
        .flat_map(|r| &r.claims)
        .flat_map(|c| &c.evidence_refs)
        .cloned()
        .collect()
}

/// Check 2 over every result of a delegation: worker first, then profile. Offenders are
/// named sorted, so the detail does not depend on arrival order.
fn check_origin(
    delegation: &ExpectedDelegation,
    results: &[&v1::TaskResult],
) -> Result<(), RejectionCause> {
    if !delegation.worker_ids.is_empty() {
        let foreign: BTreeSet<&str> = results
            .iter()
            .map(|r| r.worker_id.as_str())
            .filter(|w| !delegation.worker_ids.iter().any(|d| d == w))
            .collect();
        if !foreign.is_empty() {
            return Err(RejectionCause::new(
                v1::RejectionReason::WorkerMismatch,
                format!(
                    "worker_id {} is not among the workers the delegation was dispatched to ({})",
                    quoted(foreign),
                    quoted(&delegation.worker_ids)
                ),
            ));
        }
    }
    let foreign: BTreeSet<&str> = results
        .iter()
        .map(|r| r.profile_id.as_str())
        .filter(|p| *p != delegation.profile_id)
        .collect();
    if !foreign.is_empty() {
        return Err(RejectionCause::new(
            v1::RejectionReason::ProfileMismatch,
            format!(
                "profile_id {} is not the delegation's profile `{}`",
                quoted(foreign),
                delegation.profile_id
            ),
        ));
    }
    Ok(())
}

/// Checks 4 to 7 on one result.
fn check_content(
    delegation: &ExpectedDelegation,
    result: &v1::TaskResult,
    evidence: &BTreeMap<String, EvidenceFact>,
) -> Result<(), RejectionCause> {
    use v1::RejectionReason as R;

    match v1::TaskStatus::try_from(result.status) {
        Ok(v1::TaskStatus::Completed | v1::TaskStatus::Partial) => {}
        status => {
            let mut detail = match status {
                Ok(s) => format!("status is {}", s.as_str_name()),
                Err(_) => format!("status {} is not a known TaskStatus", result.status),
            };
            if let Some(e) = result.error.as_ref().filter(|e| !e.code.is_empty()) {
                let _ = write!(detail, " (error `{}`: {})", e.code, e.message);
            }
            return Err(RejectionCause::new(R::NotSuccessful, detail));
        }
    }
    if result.claims.is_empty() {
        return Err(RejectionCause::new(
            R::NoClaims,
            format!(
                "status is {} but the result carries no claims",
                v1::TaskStatus::try_from(result.status).map_or("unknown", |s| s.as_str_name())
            ),
        ));
    }
    if let Some(claim) = result.claims.iter().find(|c| c.evidence_refs.is_empty()) {
        return Err(RejectionCause::new(
            R::ClaimWithoutEvidence,
            format!("claim `{}` cites no evidence", claim.claim_id),
        ));
    }
    let cited = || {
        result
            .claims
            .iter()
            .flat_map(|c| c.evidence_refs.iter().map(move |e| (c, e.as_str())))
    };
    if let Some((claim, id)) = cited().find(|(_, id)| !delegation.allows_evidence(id)) {
        let allowed = if delegation.allowed_evidence_prefixes.is_empty() {
            "the delegation allows no evidence prefix".to_owned()
        } else {
            format!("allowed: {}", quoted(&delegation.allowed_evidence_prefixes))
        };
        return Err(RejectionCause::new(
            R::EvidenceOutsidePrefix,
            format!(
                "claim `{}` cites `{id}`, outside the delegation's evidence prefixes ({allowed})",
                claim.claim_id
            ),
        ));
    }
    for (claim, id) in cited() {
        let claim_id = &claim.claim_id;
        match evidence.get(id).unwrap_or(&EvidenceFact::Unknown) {
            EvidenceFact::Verified { content_hash, .. } => {
                if let Some(record) = result
                    .evidence
                    .iter()
                    .find(|e| e.evidence_id == id && e.content_hash != *content_hash)
                {
                    return Err(RejectionCause::new(
                        R::HashMismatch,
                        format!(
                            "claim `{claim_id}` cites `{id}`: the result records content hash `{}`, the store has `{content_hash}`",
                            record.content_hash
                        ),
                    ));
                }
            }
            EvidenceFact::Unknown => {
                return Err(RejectionCause::new(
                    R::EvidenceUnknown,
                    format!(
                        "claim `{claim_id}` cites `{id}`, which the evidence store does not know"
                    ),
                ));
            }
            EvidenceFact::ArtifactMissing => {
                return Err(RejectionCause::new(
                    R::ArtifactMissing,
                    format!("claim `{claim_id}` cites `{id}`, whose artifact is missing"),
                ));
            }
            EvidenceFact::HashMismatch => {
                return Err(RejectionCause::new(
                    R::HashMismatch,
                    format!(
                        "claim `{claim_id}` cites `{id}`, whose artifact does not hash to the recorded content hash"
                    ),
                ));
            }
        }
    }
    Ok(())
}

/// Judges every result of one delegation (checks 2 to 7); `None` when it has none yet.
fn judge<'r>(
    delegation: &ExpectedDelegation,
    results: &[&'r v1::TaskResult],
    evidence: &BTreeMap<String, EvidenceFact>,
) -> Option<Result<&'r v1::TaskResult, RejectionCause>> {
    let (first, rest) = results.split_first()?;
    Some(check_origin(delegation, results).and_then(|()| {
        // Compared with the first rather than pairwise: identical copies all equal it, and
        // any difference (even a NaN, which equals nothing) rejects whatever the order.
        if rest.iter().any(|r| r != first) {
            return Err(RejectionCause::new(
                v1::RejectionReason::ConflictingDuplicate,
                format!(
                    "{} results arrived for this delegation and they differ; none is accepted",
                    results.len()
                ),
            ));
        }
        check_content(delegation, first, evidence).map(|()| *first)
    }))
}

/// Where one expected delegation stands.
enum Verdict<'r> {
    /// No result yet.
    Pending,
    /// Its result passed every check.
    Accepted(&'r v1::TaskResult),
    /// Its results failed a check.
    Rejected(RejectionCause),
}

/// One expected delegation with what the contract and the results say about it.
struct Judged<'a> {
    delegation: &'a ExpectedDelegation,
    /// Named by a reference in `required`.
    required: bool,
    /// Of a profile in `required_profiles` (and not required on its own).
    of_required_profile: bool,
    weight: f64,
    verdict: Verdict<'a>,
}

impl Judged<'_> {
    fn accepted(&self) -> Option<&v1::TaskResult> {
        match self.verdict {
            Verdict::Accepted(r) => Some(r),
            _ => None,
        }
    }
}

/// The per-delegation verdicts of one input, from which the decision is built.
struct Evaluation<'a> {
    input: &'a JoinInput<'a>,
    judged: Vec<Judged<'a>>,
    /// Ids of results that name no expected delegation, sorted and deduplicated.
    unknown: BTreeSet<&'a str>,
    /// Required references that name no delegation of the plan, in contract order.
    unmatched_required: Vec<&'a str>,
}

impl<'a> Evaluation<'a> {
    fn new(input: &'a JoinInput<'a>) -> Self {
        let contract = input.contract;
        let mut seen = BTreeSet::new();
        let expected: Vec<&ExpectedDelegation> = input
            .delegations
            .iter()
            .filter(|d| seen.insert(d.delegation_id.as_str()))
            .collect();
        let index: BTreeMap<&str, usize> = expected
            .iter()
            .enumerate()
            .map(|(i, d)| (d.delegation_id.as_str(), i))
            .collect();

        let mut grouped: Vec<Vec<&v1::TaskResult>> = vec![Vec::new(); expected.len()];
        let mut unknown = BTreeSet::new();
        for result in input.results {
            match index.get(result.delegation_id.as_str()) {
                Some(&i) => grouped[i].push(result),
                None => {
                    unknown.insert(result.delegation_id.as_str());
                }
            }
        }

        let names = |d: &ExpectedDelegation, reference: &str| {
            reference == d.name || reference == d.profile_id
        };
        let judged = expected
            .iter()
            .zip(&grouped)
            .map(|(&delegation, results)| Judged {
                delegation,
                required: contract.required.iter().any(|r| names(delegation, r)),
                of_required_profile: contract.required_profiles.contains(&delegation.profile_id),
                weight: weight_of(contract, delegation),
                verdict: match judge(delegation, results, input.evidence) {
                    None => Verdict::Pending,
                    Some(Ok(r)) => Verdict::Accepted(r),
                    Some(Err(cause)) => Verdict::Rejected(cause),
                },
            })
            .collect();

        let mut unmatched_required: Vec<&str> = Vec::new();
        for reference in &contract.required {
            if !expected.iter().any(|d| names(d, reference))
                && !unmatched_required.contains(&reference.as_str())
            {
                unmatched_required.push(reference);
            }
        }

        Self {
            input,
            judged,
            unknown,
            unmatched_required,
        }
    }

    fn all_in(&self) -> bool {
        self.judged
            .iter()
            .all(|j| !matches!(j.verdict, Verdict::Pending))
    }

    fn deadline_passed(&self) -> bool {
        self.input
            .contract
            .deadline
            .is_some_and(|deadline| self.input.now >= deadline)
    }

    fn waiting_for(&self) -> Vec<String> {
        self.judged
            .iter()
            .filter(|j| matches!(j.verdict, Verdict::Pending))
            .map(|j| j.delegation.delegation_id.clone())
            .collect()
    }

    fn accepted(&self) -> impl Iterator<Item = (&Judged<'a>, &v1::TaskResult)> {
        self.judged
            .iter()
            .filter_map(|j| j.accepted().map(|r| (j, r)))
    }

    /// The decision over the current verdicts, with reasons in check order.
    fn decision(&self, revision: u32) -> v1::JoinDecision {
        let contract = self.input.contract;
        let deadline_passed = self.deadline_passed();
        let mut reasons = Vec::new();

        // Checks 1 to 7: what was rejected, and what has not reported.
        let mut rejected = Vec::new();
        for j in &self.judged {
            match &j.verdict {
                Verdict::Rejected(cause) => {
                    reasons.push(format!("{} rejected: {}", describe(j), cause.detail));
                    rejected.push(v1::Rejection {
                        delegation_id: j.delegation.delegation_id.clone(),
                        reason: cause.reason.into(),
                        detail: cause.detail.clone(),
                    });
                }
                Verdict::Pending if deadline_passed => {
                    reasons.push(format!("deadline passed with {} pending", describe(j)));
                }
                Verdict::Pending => {
                    reasons.push(format!("{} has not reported yet", describe(j)));
                }
                Verdict::Accepted(_) => {}
            }
        }
        for id in &self.unknown {
            let detail = format!("no delegation `{id}` is expected by this join");
            reasons.push(format!("result for `{id}` rejected: {detail}"));
            rejected.push(v1::Rejection {
                delegation_id: (*id).to_owned(),
                reason: v1::RejectionReason::UnknownDelegation.into(),
                detail,
            });
        }

        // Check 8: required delegations.
        let mut missing_required: Vec<String> = self
            .judged
            .iter()
            .filter(|j| j.required && j.accepted().is_none())
            .map(|j| j.delegation.delegation_id.clone())
            .collect();
        if !missing_required.is_empty() {
            let labels: Vec<&str> = self
                .judged
                .iter()
                .filter(|j| j.required && j.accepted().is_none())
                .map(|j| j.delegation.label())
                .collect();
            reasons.push(format!(
                "required delegations without an accepted result: {}",
                quoted(labels)
            ));
        }
        for reference in &self.unmatched_required {
            reasons.push(format!(
                "required reference `{reference}` names no delegation or profile of the plan"
            ));
            missing_required.push((*reference).to_owned());
        }
        // Check 8b: required profiles, met by any one accepted delegation of the profile.
        for profile in &contract.required_profiles {
            if missing_required.contains(profile) {
                continue;
            }
            let of_profile: Vec<&Judged<'_>> = self
                .judged
                .iter()
                .filter(|j| j.delegation.profile_id == *profile)
                .collect();
            if of_profile.iter().any(|j| j.accepted().is_some()) {
                continue;
            }
            if of_profile.is_empty() {
                reasons.push(format!(
                    "required profile `{profile}` has no delegation in the run"
                ));
            } else {
                reasons.push(format!(
                    "required profile `{profile}` has no accepted delegation (of {})",
                    quoted(of_profile.iter().map(|j| j.delegation.label()))
                ));
            }
            missing_required.push(profile.clone());
        }
        let missing_optional: Vec<String> = self
            .judged
            .iter()
            .filter(|j| !j.required && j.accepted().is_none())
            .map(|j| j.delegation.delegation_id.clone())
            .collect();

        // Check 9: the minimum, over independent results (see `independence`).
        let minimum = &contract.minimum;
        let accepted: Vec<String> = self
            .accepted()
            .map(|(j, _)| j.delegation.delegation_id.clone())
            .collect();
        let independence = self.independence();
        for (dependent, on) in &independence.not_independent {
            reasons.push(format!(
                "`{dependent}` rests on the same artifacts as {}: counted once with it",
                quoted(on)
            ));
        }
        let independent = accepted.len() - independence.not_independent.len();
        let needed = usize::try_from(minimum.count.max(1)).unwrap_or(usize::MAX);
        let count_met = independent >= needed;
        if !count_met {
            reasons.push(if independent == accepted.len() {
                format!("minimum count not met: {independent} accepted, {needed} needed")
            } else {
                format!(
                    "minimum count not met: {independent} independent of {} accepted, {needed} needed",
                    accepted.len()
                )
            });
        }
        let weight: f64 = self
            .accepted()
            .filter(|(j, _)| {
                !independence
                    .dependent_ids
                    .contains(&j.delegation.delegation_id)
            })
            .map(|(j, _)| j.weight)
            .sum();
        // A threshold of zero or below is no threshold; a NaN one can never be met.
        let weight_met = if minimum.weight.is_nan() {
            false
        } else {
            minimum.weight <= 0.0 || weight >= minimum.weight
        };
        if !weight_met {
            reasons.push(format!(
                "minimum weight not met: {weight} accepted, {} needed",
                minimum.weight
            ));
        }
        let cited_kinds: BTreeSet<&str> = self
            .accepted()
            .flat_map(|(_, r)| &r.claims)
            .flat_map(|c| &c.evidence_refs)
            .filter_map(|id| match self.input.evidence.get(id) {
                Some(EvidenceFact::Verified { kind, .. }) => Some(kind.as_str()),
                _ => None,
            })
            .collect();
        let mut missing_evidence_kinds: Vec<String> = Vec::new();
        for kind in &minimum.required_evidence_kinds {
            if !cited_kinds.contains(kind.as_str()) && !missing_evidence_kinds.contains(kind) {
                missing_evidence_kinds.push(kind.clone());
            }
        }
        if !missing_evidence_kinds.is_empty() {
            reasons.push(format!(
                "no accepted claim cites evidence of kind {}",
                quoted(&missing_evidence_kinds)
            ));
        }
        let quorum_met = count_met && weight_met && missing_evidence_kinds.is_empty();
        // Kinds no call named but a tool's declaration gave: the decision may rest on them,
        // so it says which they are.
        let mut defaulted: Vec<String> = Vec::new();
        for id in self
            .accepted()
            .flat_map(|(_, r)| &r.claims)
            .flat_map(|c| &c.evidence_refs)
        {
            if let Some(EvidenceFact::Verified {
                kind,
                kind_defaulted: true,
                ..
            }) = self.input.evidence.get(id)
            {
                let entry = format!("`{id}` ({kind})");
                if !defaulted.contains(&entry) {
                    defaulted.push(entry);
                }
            }
        }
        if !defaulted.is_empty() {
            reasons.push(format!(
                "evidence kind defaulted by its tool, not named by the call: {}",
                defaulted.join(", ")
            ));
        }

        // Check 10: conflicts.
        let conflicts = self.conflicts();
        let label_of = |id: &str| {
            self.judged
                .iter()
                .find(|j| j.delegation.delegation_id == id)
                .map_or(id.to_owned(), |j| j.delegation.label().to_owned())
        };
        for conflict in &conflicts {
            if let Some(settled) = &conflict.settlement {
                reasons.push(format!(
                    "conflict on `{}` settled by {}: `{}` from `{}` (a human judgement: {})",
                    conflict.topic,
                    settled.decided_by,
                    settled.value,
                    label_of(&settled.delegation_id),
                    settled.rationale
                ));
                continue;
            }
            let sides: Vec<String> = conflict
                .claims
                .iter()
                .map(|c| {
                    format!(
                        "`{}` from `{}` (claim `{}`)",
                        c.value,
                        label_of(&c.delegation_id),
                        c.claim_id
                    )
                })
                .collect();
            reasons.push(format!(
                "conflict on `{}`: {}",
                conflict.topic,
                sides.join(" vs ")
            ));
        }

        // Review triggers: proposed actions above R1 (unset counts as R3).
        let mut review = false;
        for (j, result) in self.accepted() {
            for action in &result.proposed_actions {
                let risk = RiskLevel::from_proto(action.risk_level);
                if risk >= RiskLevel::R2 {
                    review = true;
                    reasons.push(format!(
                        "`{}` proposes `{}` at risk {risk}: a human must review it",
                        j.delegation.label(),
                        action.action
                    ));
                }
            }
        }

        let gaps: Vec<&str> = self
            .judged
            .iter()
            .filter(|j| j.accepted().is_none())
            .map(|j| j.delegation.label())
            .collect();
        let failed_on_timeout =
            deadline_passed && contract.on_timeout == OnTimeout::Fail && !gaps.is_empty();
        if failed_on_timeout {
            reasons.push(format!(
                "deadline passed and on_timeout is FAIL: {} without an accepted result",
                quoted(&gaps)
            ));
        }

        let outcome = if !missing_required.is_empty() || !quorum_met || failed_on_timeout {
            v1::JoinOutcome::InsufficientEvidence
        } else if !gaps.is_empty() {
            reasons.push(format!(
                "provisional: no accepted result from {}",
                quoted(&gaps)
            ));
            v1::JoinOutcome::PartialEvidence
        } else if conflicts.iter().any(|c| c.settlement.is_none()) {
            v1::JoinOutcome::ConflictRequiresHuman
        } else if review {
            v1::JoinOutcome::CompleteWithReviewRequired
        } else {
            reasons.push(
                "every expected delegation accepted, minimum met, no conflict, nothing to review"
                    .to_owned(),
            );
            v1::JoinOutcome::Complete
        };

        v1::JoinDecision {
            revision,
            outcome: outcome.into(),
            accepted,
            rejected,
            missing_required,
            conflicts,
            quorum_met,
            decided_at: Some(to_timestamp(self.input.now)),
            reasons,
            missing_optional,
            late_discarded: Vec::new(),
            missing_evidence_kinds,
            shared_evidence: independence.shared,
            not_independent: independence.dependent_ids,
        }
    }

    /// Topics on which accepted claims disagree, sorted by topic; each lists every
    /// accepted claim on the topic in plan order, then claim id.
    fn conflicts(&self) -> Vec<v1::Conflict> {
        let mut by_topic: BTreeMap<&str, Vec<(usize, &str, &v1::Claim)>> = BTreeMap::new();
        for (position, j) in self.judged.iter().enumerate() {
            if let Some(result) = j.accepted() {
                for claim in &result.claims {
                    by_topic.entry(claim.topic.as_str()).or_default().push((
                        position,
                        j.delegation.delegation_id.as_str(),
                        claim,
                    ));
                }
            }
        }
        by_topic
            .into_iter()
            .filter(|(_, claims)| claims.iter().any(|(_, _, c)| c.value != claims[0].2.value))
            .map(|(topic, mut claims)| {
                claims.sort_by(|a, b| (a.0, &a.2.claim_id).cmp(&(b.0, &b.2.claim_id)));
                let mut values: Vec<&str> = Vec::new();
                for (_, _, claim) in &claims {
                    if !values.contains(&claim.value.as_str()) {
                        values.push(&claim.value);
                    }
                }
                let settlement = self.input.settlements.get(topic).filter(|s| {
                    claims
                        .iter()
                        .any(|(_, delegation_id, _)| *delegation_id == s.delegation_id)
                });
                let (resolution, next_query) = match (settlement, self.input.contract.on_conflict) {
                    (Some(_), _) => (v1::ConflictResolution::Settled, String::new()),
                    (None, OnConflict::PreserveAndEscalate) => {
                        (v1::ConflictResolution::Unresolved, String::new())
                    }
                    (None, OnConflict::FollowUp) => (
                        v1::ConflictResolution::FollowUpRequested,
                        format!("compare evidence for {topic}: {}", values.join(" vs ")),
                    ),
                };
                v1::Conflict {
                    topic: topic.to_owned(),
                    claims: claims
                        .into_iter()
                        .map(|(_, delegation_id, claim)| v1::ConflictingClaim {
                            delegation_id: delegation_id.to_owned(),
                            claim_id: claim.claim_id.clone(),
                            value: claim.value.clone(),
                            statement: claim.statement.clone(),
                            evidence_refs: claim.evidence_refs.clone(),
                        })
                        .collect(),
                    resolution: resolution.into(),
                    next_query,
                    settlement: settlement.cloned(),
                }
            })
            .collect()
    }
}

/// Weight of a delegation: by name, else by profile id, else 1. Negative and NaN weights
/// count as 0, so an accepted delegation never lowers the accepted weight.
fn weight_of(contract: &JoinContract, delegation: &ExpectedDelegation) -> f64 {
    contract
        .weights
        .get(&delegation.name)
        .or_else(|| contract.weights.get(&delegation.profile_id))
        .copied()
        .unwrap_or(1.0)
        .max(0.0)
}

/// How reasons name a delegation: `` required delegation `logs` ``, `` optional
/// delegation `changes` `` or `` delegation `logs-2` of required profile `logs` ``.
fn describe(j: &Judged<'_>) -> String {
    let label = j.delegation.label();
    if j.required {
        format!("required delegation `{label}`")
    } else if j.of_required_profile {
        format!(
            "delegation `{label}` of required profile `{}`",
            j.delegation.profile_id
        )
    } else {
        format!("optional delegation `{label}`")
    }
}

/// `` `a`, `b` `` for a list of names.
fn quoted<I>(items: I) -> String
where
    I: IntoIterator,
    I::Item: AsRef<str>,
{
    items
        .into_iter()
        .map(|s| format!("`{}`", s.as_ref()))
        .collect::<Vec<_>>()
        .join(", ")
}
