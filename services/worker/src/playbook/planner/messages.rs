//! What a planner writes and reads: the arguments of its two tools, `delegate` and
//! `finish`, and the decision message the supervisor adds to the conversation after
//! each round.
//!
//! The supervisor defines and validates these shapes; the types here hold what the
//! planner playbook emits and reads. [`DelegateArgs`] doubles as a `delegate` entry of
//! a profile's `planner:` section, so it refuses unknown keys; the decision types
//! default every field and ignore the ones they do not know, so a richer message still
//! reads.

use serde::{Deserialize, Serialize};

/// The tool a planner calls to delegate one task.
pub const DELEGATE: &str = "delegate";
/// The tool a planner calls to end the run with its summary.
pub const FINISH: &str = "finish";

/// The arguments of one `delegate` call.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DelegateArgs {
    /// The specialist profile to delegate to, e.g. `logs-investigator`.
    #[serde(default)]
    pub profile_id: String,
    /// What the specialist must find out.
    #[serde(default)]
    pub goal: String,
    /// What its result must contain to be accepted.
    #[serde(default)]
    pub acceptance_criteria: Vec<String>,
    /// The resources and time window it may look at.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scope: Option<DelegateScope>,
    /// The permissions it needs, as `{action, resource}`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub required_scopes: Vec<ScopeArgs>,
    /// How long it may take, in seconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_seconds: Option<u64>,
    /// Whether it may delegate in turn.
    #[serde(default)]
    pub may_redelegate: bool,
}

/// The scope of a delegated task.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DelegateScope {
    /// Resource patterns, e.g. `service/payment-api`.
    #[serde(default)]
    pub resources: Vec<String>,
    /// The data window.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub time_range: Option<TimeRangeArgs>,
}

/// A time window, RFC 3339 bounds.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TimeRangeArgs {
    /// First instant, e.g. `2026-07-23T01:45:00Z`.
    #[serde(default)]
    pub start: String,
    /// Last instant.
    #[serde(default)]
    pub end: String,
}

/// One permission a delegated task needs.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScopeArgs {
    /// Action pattern, e.g. `logs:read`.
    #[serde(default)]
    pub action: String,
    /// Resource pattern, e.g. `service/*`.
    #[serde(default)]
    pub resource: String,
}

/// The arguments of the `finish` call.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct FinishArgs {
    /// The run's summary.
    pub summary: String,
    /// The claim (or evidence) ids the summary rests on.
    pub cite: Vec<String>,
}

/// The message (role `user`, JSON text) the supervisor adds after each round.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct DecisionMessage {
    /// The round decided (1-based).
    pub round: u32,
    /// The join's decision on the round's results.
    pub decision: Decision,
    /// What the supervisor suggests next, in words.
    pub next: String,
}

impl DecisionMessage {
    /// The decision message in `content`, if it is one: a JSON object with a
    /// `decision` key.
    pub fn parse(content: &str) -> Option<Self> {
        let value: serde_json::Value = serde_json::from_str(content).ok()?;
        if !value.as_object()?.contains_key("decision") {
            return None;
        }
        serde_json::from_value(value).ok()
    }
}

/// A join decision as a planner reads it.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Decision {
    /// The outcome's name, e.g. `JOIN_OUTCOME_CONFLICT_REQUIRES_HUMAN`.
    pub outcome: String,
    /// The results the join accepted.
    pub accepted: Vec<AcceptedResult>,
    /// The results it rejected, and why.
    pub rejected: Vec<RejectedResult>,
    /// Required delegations or profiles without an accepted result.
    pub missing_required: Vec<String>,
    /// Topics on which accepted claims disagree.
    pub conflicts: Vec<DecisionConflict>,
}

impl Decision {
    /// Whether accepted claims disagree on some topic.
    pub fn has_conflict(&self) -> bool {
        !self.conflicts.is_empty()
    }

    /// Whether something required is missing or a result was rejected.
    pub fn has_gap(&self) -> bool {
        !self.missing_required.is_empty() || !self.rejected.is_empty()
    }

    /// The claim ids of the accepted results, in order, each once.
    pub fn accepted_claim_ids(&self) -> Vec<String> {
        let mut ids: Vec<String> = Vec::new();
        for claim in self.accepted.iter().flat_map(|r| &r.claims) {
            if !claim.claim_id.is_empty() && !ids.contains(&claim.claim_id) {
                ids.push(claim.claim_id.clone());
            }
        }
        ids
    }
}

/// An accepted result.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct AcceptedResult {
    /// Its delegation.
    pub delegation_id: String,
    /// The profile that produced it.
    pub profile_id: String,
    /// Its claims.
    pub claims: Vec<DecisionClaim>,
}

/// A claim of an accepted result.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct DecisionClaim {
    /// The claim's id.
    pub claim_id: String,
    /// Its topic, e.g. `primary_cause`.
    pub topic: String,
    /// Its normalized value.
    pub value: String,
    /// Its statement.
    pub statement: String,
    /// The evidence it cites.
    pub evidence_refs: Vec<String>,
}

/// A rejected result.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct RejectedResult {
    /// Its delegation.
    pub delegation_id: String,
    /// The profile that produced it.
    pub profile_id: String,
    /// The rejection reason's name, e.g. `REJECTION_REASON_CITATION_MISSING`.
    pub reason: String,
    /// What was wrong.
    pub detail: String,
}

/// A topic on which accepted claims disagree.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct DecisionConflict {
    /// The topic.
    pub topic: String,
    /// The disagreeing claims.
    pub claims: Vec<ConflictClaim>,
    /// The question that would settle it.
    pub next_query: String,
}

/// One side of a conflict.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct ConflictClaim {
    /// The claim's id.
    pub claim_id: String,
    /// The delegation whose result holds it.
    pub delegation_id: String,
    /// Its value on the topic.
    pub value: String,
    /// Its statement.
    pub statement: String,
    /// The evidence it cites.
    pub evidence_refs: Vec<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_decision_message_reads_with_extra_and_missing_fields() {
        let text = r#"{"round": 1, "extra": true,
            "decision": {"outcome": "JOIN_OUTCOME_CONFLICT_REQUIRES_HUMAN", "revision": 2,
              "accepted": [
                {"delegation_id": "d1", "claims": [{"claim_id": "c1"}, {"claim_id": "c2"}]},
                {"delegation_id": "d2", "claims": [{"claim_id": "c2"}, {"claim_id": "c3"}]}],
              "conflicts": [{"topic": "primary_cause", "claims": []}]}}"#;
        let message = DecisionMessage::parse(text).unwrap();
        assert_eq!(message.round, 1);
        assert!(message.decision.has_conflict());
        assert!(!message.decision.has_gap());
        assert_eq!(message.decision.accepted_claim_ids(), ["c1", "c2", "c3"]);
        assert!(DecisionMessage::parse(r#"{"round": 1}"#).is_none());
        assert!(DecisionMessage::parse("not json").is_none());
        assert!(DecisionMessage::parse(r#"[{"decision": {}}]"#).is_none());
    }

    #[test]
    fn delegate_arguments_leave_out_what_is_not_set() {
        let args = DelegateArgs {
            profile_id: "change-auditor".into(),
            goal: "Find the changes".into(),
            ..DelegateArgs::default()
        };
        assert_eq!(
            serde_json::to_value(&args).unwrap(),
            serde_json::json!({"profile_id": "change-auditor", "goal": "Find the changes",
                               "acceptance_criteria": [], "may_redelegate": false})
        );
    }
}
