//! Approval requests as the service holds them, and the rules of voting on them.
//!
//! The types here are the validated domain form; [`ApprovalRequest::to_proto`] is the one
//! place they become wire messages. Voting ([`ApprovalRequest::cast_vote`]) is a pure
//! function of the request, the vote and the time, so the service can re-apply it after
//! losing a compare-and-set race without any other state.

use std::{collections::BTreeSet, fmt, time::SystemTime};

use convene_core::{permissions::RiskLevel, time::to_timestamp};
use convene_proto::v1;
use prost_types::Struct;

use crate::error::ApprovalError;

/// Where a request stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum State {
    /// Waiting for approvers.
    Pending,
    /// Enough distinct people approved; may be executed.
    Approved,
    /// Someone rejected it.
    Rejected,
    /// It expired before it was approved.
    Expired,
    /// It was executed.
    Executed,
    /// It was withdrawn before it was executed.
    Cancelled,
}

impl State {
    /// From the wire enum; `None` for unset or unknown values.
    pub fn from_proto(value: i32) -> Option<Self> {
        match v1::ApprovalState::try_from(value).ok()? {
            v1::ApprovalState::Unspecified => None,
            v1::ApprovalState::Pending => Some(Self::Pending),
            v1::ApprovalState::Approved => Some(Self::Approved),
            v1::ApprovalState::Rejected => Some(Self::Rejected),
            v1::ApprovalState::Expired => Some(Self::Expired),
            v1::ApprovalState::Executed => Some(Self::Executed),
            v1::ApprovalState::Cancelled => Some(Self::Cancelled),
        }
    }

    /// To the wire enum.
    pub fn to_proto(self) -> v1::ApprovalState {
        match self {
            Self::Pending => v1::ApprovalState::Pending,
            Self::Approved => v1::ApprovalState::Approved,
            Self::Rejected => v1::ApprovalState::Rejected,
            Self::Expired => v1::ApprovalState::Expired,
            Self::Executed => v1::ApprovalState::Executed,
            Self::Cancelled => v1::ApprovalState::Cancelled,
        }
    }
}

impl fmt::Display for State {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Pending => "PENDING",
            Self::Approved => "APPROVED",
            Self::Rejected => "REJECTED",
            Self::Expired => "EXPIRED",
            Self::Executed => "EXECUTED",
            Self::Cancelled => "CANCELLED",
        })
    }
}

/// An approver's answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Decision {
    /// Approve the request with its bound parameters.
    Approve,
    /// Reject the request.
    Reject,
}

impl Decision {
    /// From the wire enum; `None` for unset or unknown values.
    pub fn from_proto(value: i32) -> Option<Self> {
        match v1::VoteDecision::try_from(value).ok()? {
            v1::VoteDecision::Unspecified => None,
            v1::VoteDecision::Approve => Some(Self::Approve),
            v1::VoteDecision::Reject => Some(Self::Reject),
        }
    }

    /// To the wire enum.
    pub fn to_proto(self) -> v1::VoteDecision {
        match self {
            Self::Approve => v1::VoteDecision::Approve,
            Self::Reject => v1::VoteDecision::Reject,
        }
    }

    /// The wire spelling, for messages.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Approve => "APPROVE",
            Self::Reject => "REJECT",
        }
    }
}

/// One approver's recorded vote.
#[derive(Clone, Debug, PartialEq)]
pub struct Vote {
    /// The approver's principal id.
    pub approver: String,
    /// The answer.
    pub decision: Decision,
    /// The parameters hash the approver reviewed (always the request's).
    pub parameters_hash: String,
    /// Free-text comment.
    pub comment: String,
    /// When the vote was cast.
    pub decided_at: SystemTime,
}

/// The single execution of an approved request.
#[derive(Clone, Debug, PartialEq)]
pub struct Execution {
    /// The executor that ran it, e.g. `record-only`.
    pub executor: String,
    /// Whether the executor reported success.
    pub success: bool,
    /// What the executor reported.
    pub output: Struct,
    /// When it ran.
    pub executed_at: SystemTime,
    /// The principal that asked for the execution.
    pub executed_by: String,
}

impl Execution {
    /// The wire form.
    pub fn to_proto(&self) -> v1::ExecutionRecord {
        v1::ExecutionRecord {
            executor: self.executor.clone(),
            success: self.success,
            output: Some(self.output.clone()),
            executed_at: Some(to_timestamp(self.executed_at)),
            executed_by: self.executed_by.clone(),
        }
    }
}

/// Who withdrew a request, and why.
#[derive(Clone, Debug, PartialEq)]
pub struct Cancellation {
    /// The principal that cancelled it.
    pub cancelled_by: String,
    /// Why.
    pub reason: String,
    /// When.
    pub cancelled_at: SystemTime,
}

impl Cancellation {
    /// The wire form.
    pub fn to_proto(&self) -> v1::Cancellation {
        v1::Cancellation {
            cancelled_by: self.cancelled_by.clone(),
            reason: self.reason.clone(),
            cancelled_at: Some(to_timestamp(self.cancelled_at)),
        }
    }

    /// `by <who>`, with the reason when there is one, for messages.
    pub fn describe(&self) -> String {
        if self.reason.is_empty() {
            format!("by {}", self.cancelled_by)
        } else {
            format!("by {} ({})", self.cancelled_by, self.reason)
        }
    }
}

/// A claim that one caller is executing a request right now. Written with a
/// compare-and-set before the executor runs, so two callers (or two instances sharing a
/// store) can never both run the action.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExecutionClaim {
    /// Who asked for the execution.
    pub by: String,
    /// When the executor was started.
    pub started_at: SystemTime,
}

/// One request for an R2/R3 action.
#[derive(Clone, Debug, PartialEq)]
pub struct ApprovalRequest {
    /// Generated id, `apr-<uuid v7>`.
    pub approval_id: String,
    /// Tenant, from the requester's principal.
    pub tenant: String,
    /// The action, e.g. `rule:rollback`.
    pub action: String,
    /// The parameters the action runs with.
    pub parameters: Struct,
    /// `sha256:<hex>` of the parameters' canonical JSON (see [`crate::canonical`]).
    pub parameters_hash: String,
    /// Effective risk level: never lower than the catalog's.
    pub risk: RiskLevel,
    /// Key that makes filing idempotent per requester.
    pub idempotency_key: String,
    /// The principal the request is made for.
    pub requester: String,
    /// The principal that filed it: the requester, or the service that filed it on the
    /// requester's behalf (the supervisor).
    pub filed_by: String,
    /// Evidence ids supporting the action.
    pub evidence_refs: Vec<String>,
    /// Once this time is reached, the request can no longer be approved.
    pub expires_at: SystemTime,
    /// Where it stands, as last written (see [`state_at`](Self::state_at)).
    pub state: State,
    /// Votes in the order they were cast, at most one per approver.
    pub votes: Vec<Vote>,
    /// The execution, once executed.
    pub execution: Option<Execution>,
    /// Set while an executor runs the action.
    pub executing: Option<ExecutionClaim>,
    /// Who withdrew it, once cancelled.
    pub cancellation: Option<Cancellation>,
    /// The run that proposed the action (empty: none).
    pub run_id: String,
    /// Why the action is proposed.
    pub rationale: String,
    /// When the request was created.
    pub created_at: SystemTime,
}

/// What a vote did to a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum VoteEffect {
    /// The approver had already cast the same vote: nothing changed.
    Repeated,
    /// The vote was recorded; the request is now in this state.
    Recorded(State),
}

impl ApprovalRequest {
    /// Distinct approvals needed: 1 for R2, 2 for R3.
    pub fn approvals_required(&self) -> u32 {
        self.risk.approvals_required()
    }

    /// The distinct principals that approved, in vote order.
    pub fn approvers(&self) -> Vec<&str> {
        let mut seen = BTreeSet::new();
        self.votes
            .iter()
            .filter(|v| v.decision == Decision::Approve)
            .map(|v| v.approver.as_str())
            .filter(|a| seen.insert(*a))
            .collect()
    }

    /// Approvals still missing before the request is approved.
    pub fn approvals_missing(&self) -> u32 {
        let have = u32::try_from(self.approvers().len()).unwrap_or(u32::MAX);
        self.approvals_required().saturating_sub(have)
    }

    /// Whether `now` is at or past the expiry.
    pub fn is_past_expiry(&self, now: SystemTime) -> bool {
        now >= self.expires_at
    }

    /// The state as seen at `now`: a pending request past its expiry is expired even
    /// before anyone writes that down.
    pub fn state_at(&self, now: SystemTime) -> State {
        if self.state == State::Pending && self.is_past_expiry(now) {
            State::Expired
        } else {
            self.state
        }
    }

    /// Records `vote` at `now`, following the rules of approval, in this order:
    ///
    /// 1. the vote must quote the request's parameters hash;
    /// 2. one vote per approver: the same vote again changes nothing (so a retried call
    ///    is harmless), a different one is refused;
    /// 3. only pending and approved requests take votes, none while being executed, and
    ///    none once the expiry is reached (a pending request past it is expired; the
    ///    caller persists that, and [`state_at`](Self::state_at) reports it already);
    /// 4. a REJECT rejects the request (an approved one too, as long as it has not run);
    ///    enough distinct APPROVEs approve it.
    ///
    /// The requester check is the caller's, because it needs the principal.
    ///
    /// # Errors
    ///
    /// The [`ApprovalError`] of the rule that refused the vote; the request is unchanged.
    pub fn cast_vote(&mut self, vote: Vote, now: SystemTime) -> Result<VoteEffect, ApprovalError> {
        if vote.parameters_hash != self.parameters_hash {
            return Err(ApprovalError::ParametersChanged {
                approval_id: self.approval_id.clone(),
                quoted: vote.parameters_hash,
                current: self.parameters_hash.clone(),
            });
        }
        if let Some(previous) = self.votes.iter().find(|v| v.approver == vote.approver) {
            return if previous.decision == vote.decision {
                Ok(VoteEffect::Repeated)
            } else {
                Err(ApprovalError::VoteChanged {
                    approval_id: self.approval_id.clone(),
                    approver: vote.approver,
                    previous: previous.decision.as_str(),
                })
            };
        }
        let closed = |state, hint| ApprovalError::Closed {
            approval_id: self.approval_id.clone(),
            state,
            hint,
        };
        match self.state_at(now) {
            State::Pending | State::Approved if self.executing.is_some() => {
                return Err(closed(
                    self.state,
                    "it is being executed; fetch it with GetApproval to see the outcome",
                ));
            }
            State::Pending | State::Approved if self.is_past_expiry(now) => {
                return Err(ApprovalError::Expired {
                    approval_id: self.approval_id.clone(),
                    expired_at: self.expires_at,
                });
            }
            State::Pending | State::Approved => {}
            State::Expired => {
                return Err(ApprovalError::Expired {
                    approval_id: self.approval_id.clone(),
                    expired_at: self.expires_at,
                });
            }
            State::Rejected => {
                return Err(closed(
                    State::Rejected,
                    "file a new approval request if the action is still needed",
                ));
            }
            State::Executed => {
                return Err(closed(
                    State::Executed,
                    "the action already ran; file a new approval request to run it again",
                ));
            }
            State::Cancelled => {
                return Err(ApprovalError::Cancelled {
                    approval_id: self.approval_id.clone(),
                    by: self.cancellation_text(),
                });
            }
        }
        let decision = vote.decision;
        self.votes.push(vote);
        self.state = match decision {
            Decision::Reject => State::Rejected,
            Decision::Approve if self.approvals_missing() == 0 => State::Approved,
            Decision::Approve => self.state,
        };
        Ok(VoteEffect::Recorded(self.state))
    }

    /// Why the request cannot be executed at `now`, or `None` if it can.
    pub fn not_executable_reason(&self, now: SystemTime) -> Option<String> {
        match self.state_at(now) {
            State::Approved => None,
            State::Pending => {
                let approvers = self.approvers();
                let so_far = if approvers.is_empty() {
                    "nobody has approved yet".to_owned()
                } else {
                    format!("approved so far by {}", approvers.join(", "))
                };
                Some(format!(
                    "it is PENDING: {} of {} approvals missing ({so_far}); a {} action needs \
                     {} distinct approvers other than the requester",
                    self.approvals_missing(),
                    self.approvals_required(),
                    self.risk,
                    self.approvals_required(),
                ))
            }
            State::Rejected => {
                let by: Vec<&str> = self
                    .votes
                    .iter()
                    .filter(|v| v.decision == Decision::Reject)
                    .map(|v| v.approver.as_str())
                    .collect();
                Some(format!(
                    "it is REJECTED (by {}); file a new approval request if the action is \
                     still needed",
                    by.join(", ")
                ))
            }
            State::Expired => Some(format!(
                "it is EXPIRED (at {}) without enough approvals; file a new approval request",
                humantime::format_rfc3339_seconds(self.expires_at)
            )),
            // Executed requests answer with their record instead; this is for completeness.
            State::Executed => Some("it is EXECUTED already".to_owned()),
            State::Cancelled => Some(format!(
                "it was CANCELLED {}; file a new approval request if the action is still \
                 needed",
                self.cancellation_text()
            )),
        }
    }

    /// Who cancelled the request and why (`by <who> (<reason>)`), for messages.
    pub fn cancellation_text(&self) -> String {
        self.cancellation.as_ref().map_or_else(
            || "by an unrecorded principal".to_owned(),
            Cancellation::describe,
        )
    }

    /// The wire form as seen at `now`.
    pub fn to_proto(&self, now: SystemTime) -> v1::ApprovalRequest {
        v1::ApprovalRequest {
            approval_id: self.approval_id.clone(),
            tenant: self.tenant.clone(),
            action: self.action.clone(),
            parameters: Some(self.parameters.clone()),
            parameters_hash: self.parameters_hash.clone(),
            risk_level: self.risk.to_proto() as i32,
            idempotency_key: self.idempotency_key.clone(),
            requester: self.requester.clone(),
            evidence_refs: self.evidence_refs.clone(),
            expires_at: Some(to_timestamp(self.expires_at)),
            state: self.state_at(now).to_proto() as i32,
            votes: self
                .votes
                .iter()
                .map(|v| v1::Vote {
                    approver: v.approver.clone(),
                    decision: v.decision.to_proto() as i32,
                    parameters_hash: v.parameters_hash.clone(),
                    comment: v.comment.clone(),
                    decided_at: Some(to_timestamp(v.decided_at)),
                })
                .collect(),
            execution: self.execution.as_ref().map(Execution::to_proto),
            run_id: self.run_id.clone(),
            rationale: self.rationale.clone(),
            created_at: Some(to_timestamp(self.created_at)),
            approvals_required: self.approvals_required(),
            cancellation: self.cancellation.as_ref().map(Cancellation::to_proto),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    const HASH: &str = "sha256:00";

    fn t(secs: u64) -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000 + secs)
    }

    fn request(risk: RiskLevel) -> ApprovalRequest {
        ApprovalRequest {
            approval_id: "apr-1".into(),
            tenant: "acme".into(),
            action: "rule:rollback".into(),
            parameters: Struct::default(),
            parameters_hash: HASH.into(),
            risk,
            idempotency_key: "k".into(),
            requester: "oncall@acme".into(),
            filed_by: "oncall@acme".into(),
            evidence_refs: vec![],
            expires_at: t(100),
            state: State::Pending,
            votes: vec![],
            execution: None,
            executing: None,
            cancellation: None,
            run_id: String::new(),
            rationale: String::new(),
            created_at: t(0),
        }
    }

    fn vote(approver: &str, decision: Decision) -> Vote {
        Vote {
            approver: approver.into(),
            decision,
            parameters_hash: HASH.into(),
            comment: String::new(),
            decided_at: t(1),
        }
    }

    #[test]
    fn r3_needs_two_distinct_approvers() {
        let mut r = request(RiskLevel::R3);
        let first = r.cast_vote(vote("alice", Decision::Approve), t(1)).unwrap();
        assert_eq!(first, VoteEffect::Recorded(State::Pending));
        assert_eq!(r.approvals_missing(), 1);
        let again = r.cast_vote(vote("alice", Decision::Approve), t(2)).unwrap();
        assert_eq!(again, VoteEffect::Repeated);
        assert_eq!((r.votes.len(), r.state), (1, State::Pending));
        let second = r.cast_vote(vote("bob", Decision::Approve), t(3)).unwrap();
        assert_eq!(second, VoteEffect::Recorded(State::Approved));
        assert_eq!(r.approvers(), ["alice", "bob"]);
        assert!(r.not_executable_reason(t(4)).is_none());
    }

    #[test]
    fn r2_needs_one_and_reject_ends_it() {
        let mut r = request(RiskLevel::R2);
        assert_eq!(
            r.cast_vote(vote("alice", Decision::Approve), t(1)).unwrap(),
            VoteEffect::Recorded(State::Approved)
        );
        // An approved, not yet executed request can still be vetoed.
        assert_eq!(
            r.cast_vote(vote("bob", Decision::Reject), t(2)).unwrap(),
            VoteEffect::Recorded(State::Rejected)
        );
        let err = r
            .cast_vote(vote("carol", Decision::Approve), t(3))
            .unwrap_err();
        assert!(
            matches!(
                err,
                ApprovalError::Closed {
                    state: State::Rejected,
                    ..
                }
            ),
            "{err}"
        );
        assert!(
            r.not_executable_reason(t(3))
                .unwrap()
                .contains("REJECTED (by bob)")
        );
    }

    #[test]
    fn a_vote_cannot_change() {
        let mut r = request(RiskLevel::R3);
        r.cast_vote(vote("alice", Decision::Approve), t(1)).unwrap();
        let err = r
            .cast_vote(vote("alice", Decision::Reject), t(2))
            .unwrap_err();
        assert!(matches!(err, ApprovalError::VoteChanged { .. }), "{err}");
        assert_eq!(r.state, State::Pending);
    }

    #[test]
    fn stale_hashes_and_expired_requests_take_no_votes() {
        let mut r = request(RiskLevel::R3);
        let mut stale = vote("alice", Decision::Approve);
        stale.parameters_hash = "sha256:ff".into();
        let err = r.cast_vote(stale, t(1)).unwrap_err();
        assert!(
            matches!(err, ApprovalError::ParametersChanged { .. }),
            "{err}"
        );
        r.cast_vote(vote("alice", Decision::Approve), t(1)).unwrap();
        assert_eq!(r.state_at(t(99)), State::Pending);
        assert_eq!(r.state_at(t(100)), State::Expired);
        let err = r
            .cast_vote(vote("bob", Decision::Approve), t(100))
            .unwrap_err();
        assert!(matches!(err, ApprovalError::Expired { .. }), "{err}");
        // A retried vote is still answered, with the request showing as expired.
        assert_eq!(
            r.cast_vote(vote("alice", Decision::Approve), t(100))
                .unwrap(),
            VoteEffect::Repeated
        );
        assert_eq!(r.votes.len(), 1);
        // An approved request takes no votes past its expiry either, and stays approved.
        let mut r = request(RiskLevel::R2);
        r.cast_vote(vote("alice", Decision::Approve), t(1)).unwrap();
        let err = r
            .cast_vote(vote("bob", Decision::Reject), t(100))
            .unwrap_err();
        assert!(matches!(err, ApprovalError::Expired { .. }), "{err}");
        assert_eq!(r.state_at(t(100)), State::Approved);
    }

    #[test]
    fn no_votes_while_executing_or_after() {
        let mut r = request(RiskLevel::R2);
        r.cast_vote(vote("alice", Decision::Approve), t(1)).unwrap();
        r.executing = Some(ExecutionClaim {
            by: "bob".into(),
            started_at: t(2),
        });
        let err = r
            .cast_vote(vote("bob", Decision::Reject), t(2))
            .unwrap_err();
        assert!(err.to_string().contains("being executed"), "{err}");
        r.executing = None;
        r.state = State::Executed;
        let err = r
            .cast_vote(vote("bob", Decision::Reject), t(3))
            .unwrap_err();
        assert!(
            matches!(
                err,
                ApprovalError::Closed {
                    state: State::Executed,
                    ..
                }
            ),
            "{err}"
        );
    }

    #[test]
    fn a_cancelled_request_takes_no_votes_and_never_runs() {
        let mut r = request(RiskLevel::R2);
        r.cast_vote(vote("alice", Decision::Approve), t(1)).unwrap();
        r.state = State::Cancelled;
        r.cancellation = Some(Cancellation {
            cancelled_by: "supervisor".into(),
            reason: "run cancelled".into(),
            cancelled_at: t(2),
        });
        let err = r
            .cast_vote(vote("bob", Decision::Reject), t(3))
            .unwrap_err();
        assert!(matches!(err, ApprovalError::Cancelled { .. }), "{err}");
        assert!(
            err.to_string()
                .contains("cancelled by supervisor (run cancelled)"),
            "{err}"
        );
        let reason = r.not_executable_reason(t(3)).unwrap();
        assert!(
            reason.contains("CANCELLED by supervisor (run cancelled)"),
            "{reason}"
        );
        // Past the expiry it still reads as cancelled.
        assert_eq!(r.state_at(t(500)), State::Cancelled);
        let wire = r.to_proto(t(3));
        assert_eq!(wire.state, v1::ApprovalState::Cancelled as i32);
        assert_eq!(wire.cancellation.unwrap().cancelled_by, "supervisor");
    }

    #[test]
    fn pending_reason_counts_missing_approvals() {
        let mut r = request(RiskLevel::R3);
        r.cast_vote(vote("alice", Decision::Approve), t(1)).unwrap();
        let reason = r.not_executable_reason(t(2)).unwrap();
        assert!(reason.contains("1 of 2 approvals missing"), "{reason}");
        assert!(reason.contains("alice"), "{reason}");
    }

    #[test]
    fn wire_form_reports_expiry_and_requirements() {
        let r = request(RiskLevel::R3);
        let wire = r.to_proto(t(200));
        assert_eq!(wire.state, v1::ApprovalState::Expired as i32);
        assert_eq!(wire.approvals_required, 2);
        assert_eq!(wire.risk_level, v1::RiskLevel::R3 as i32);
        assert_eq!(State::from_proto(wire.state), Some(State::Expired));
        assert_eq!(State::from_proto(0), None);
        assert_eq!(Decision::from_proto(2), Some(Decision::Reject));
        assert_eq!(Decision::from_proto(7), None);
    }
}
