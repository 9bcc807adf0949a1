//! A run as an A2A task: its state, its status message and its result as artifacts.
//!
//! | run state | task state |
//! |---|---|
//! | PENDING | SUBMITTED |
//! | RUNNING | WORKING |
//! | WAITING_INPUT, WAITING_APPROVAL | INPUT_REQUIRED |
//! | SUCCEEDED, PARTIAL | COMPLETED |
//! | FAILED, BUDGET_EXHAUSTED, NO_PROGRESS | FAILED |
//! | REJECTED | REJECTED |
//! | CANCELLED | CANCELED |
//!
//! The result travels as two artifacts once the join has decided and the run stops
//! (it ends, or waits for people): `assessment`, the decision in words (a text part),
//! and `decision`, the join decision, the accepted claims with the evidence they cite,
//! the conflicts and the recommended actions (a data part, protobuf JSON).

use std::collections::HashMap;

use a2a::{Artifact, Message, Part, PartContent, Role, Task, TaskState, TaskStatus};
use chrono::{DateTime, Utc};
use convene_proto::v1;
use serde_json::{Value, json};

use crate::tasks::TaskRecord;

/// The id of the text artifact.
pub const ASSESSMENT_ARTIFACT: &str = "assessment";
/// The id of the data artifact.
pub const DECISION_ARTIFACT: &str = "decision";

/// The task state of a run state.
pub fn task_state(state: i32) -> TaskState {
    use v1::RunState as S;
    match S::try_from(state).unwrap_or(S::Unspecified) {
        S::Unspecified | S::Pending => TaskState::Submitted,
        S::Running => TaskState::Working,
        S::WaitingApproval | S::WaitingInput => TaskState::InputRequired,
        S::Succeeded | S::Partial => TaskState::Completed,
        S::Failed | S::BudgetExhausted | S::NoProgress => TaskState::Failed,
        S::Rejected => TaskState::Rejected,
        S::Cancelled => TaskState::Canceled,
    }
}

/// Whether a task in `state` has stopped: it ended, or waits for its caller.
pub fn stopped(state: &TaskState) -> bool {
    state.is_terminal() || *state == TaskState::InputRequired
}

/// A name without its protobuf enum prefix: `RUN_STATE_SUCCEEDED` → `SUCCEEDED`.
fn short<'a>(name: &'a str, prefix: &str) -> &'a str {
    name.strip_prefix(prefix).unwrap_or(name)
}

fn run_state_name(state: i32) -> &'static str {
    v1::RunState::try_from(state).map_or("UNSPECIFIED", |s| short(s.as_str_name(), "RUN_STATE_"))
}

fn outcome_name(outcome: i32) -> &'static str {
    v1::JoinOutcome::try_from(outcome)
        .map_or("UNSPECIFIED", |o| short(o.as_str_name(), "JOIN_OUTCOME_"))
}

/// A protobuf timestamp as the SDK's.
pub fn timestamp(t: Option<&prost_types::Timestamp>) -> Option<DateTime<Utc>> {
    let t = t?;
    DateTime::from_timestamp(t.seconds, u32::try_from(t.nanos).unwrap_or(0))
}

/// The task's status: its state, when the run last changed, and a message from the
/// agent saying why it stands there (why it ended, or what it waits for).
pub fn status(record: &TaskRecord, run: &v1::Run) -> TaskStatus {
    let state = task_state(run.state);
    let text = if state == TaskState::InputRequired {
        Some(waiting_text(run))
    } else if state.is_terminal() && !run.terminal_reason.is_empty() {
        Some(run.terminal_reason.clone())
    } else {
        None
    };
    TaskStatus {
        state,
        message: text.map(|text| agent_message(record, text)),
        timestamp: timestamp(run.updated_at.as_ref()),
    }
}

fn agent_message(record: &TaskRecord, text: String) -> Message {
    let mut message = Message::new(Role::Agent, vec![Part::text(text)]);
    message.task_id = Some(record.task_id.clone());
    message.context_id = Some(record.context_id.clone());
    message
}

/// What a waiting run waits for, and how to answer it over A2A.
fn waiting_text(run: &v1::Run) -> String {
    let conflicts: Vec<&str> = run
        .decision
        .iter()
        .flat_map(|d| &d.conflicts)
        .filter(|c| c.settlement.is_none())
        .map(|c| c.topic.as_str())
        .collect();
    let pending: Vec<&str> = run
        .actions
        .iter()
        .filter(|a| a.state == v1::ActionState::Pending as i32)
        .map(|a| a.action.as_str())
        .collect();
    let mut text = format!("The run waits for people ({}).", run_state_name(run.state));
    if !conflicts.is_empty() {
        text.push_str(&format!(
            " Open conflicts: {}. Answer with a message to this task: a text part (your \
             rationale) and a data part {{\"settle\": {{\"topic\": ..., \"delegation_id\": \
             ...}}}}, {{\"follow_up\": {{\"profile_id\": ..., \"goal\": ...}}}} or \
             {{\"close\": {{}}}}.",
            conflicts.join(", ")
        ));
    }
    if !pending.is_empty() {
        text.push_str(&format!(
            " Approvals pending: {} (approvers decide with `convene approvals`).",
            pending.join(", ")
        ));
    }
    text
}

/// The run as a task; its artifacts once the run has stopped with a decision, and only
/// when `with_artifacts`.
pub fn task(record: &TaskRecord, run: &v1::Run, with_artifacts: bool) -> Task {
    let artifacts = if with_artifacts {
        artifacts(run)
    } else {
        Vec::new()
    };
    Task {
        id: record.task_id.clone(),
        context_id: record.context_id.clone(),
        status: status(record, run),
        artifacts: (!artifacts.is_empty()).then_some(artifacts),
        history: None,
        metadata: Some(metadata(record, run)),
    }
}

/// What links the task to convene: its run, its trace and its skill.
pub fn metadata(record: &TaskRecord, run: &v1::Run) -> HashMap<String, Value> {
    HashMap::from([
        ("convene.run_id".to_owned(), json!(run.run_id)),
        ("convene.skill".to_owned(), json!(record.skill)),
        (
            "convene.run_state".to_owned(),
            json!(run_state_name(run.state)),
        ),
        ("convene.trace_id".to_owned(), json!(run.trace_id)),
    ])
}

/// The run's result as artifacts: none until the join has decided and the run stopped.
pub fn artifacts(run: &v1::Run) -> Vec<Artifact> {
    let Some(decision) = run.decision.as_ref() else {
        return Vec::new();
    };
    if !stopped(&task_state(run.state)) {
        return Vec::new();
    }
    let revision = json!(decision.revision);
    vec![
        Artifact {
            artifact_id: ASSESSMENT_ARTIFACT.to_owned(),
            name: Some("Assessment".to_owned()),
            description: Some("The join's decision in words.".to_owned()),
            parts: vec![Part::text(assessment(run, decision))],
            metadata: Some(HashMap::from([(
                "convene.revision".to_owned(),
                revision.clone(),
            )])),
            extensions: None,
        },
        Artifact {
            artifact_id: DECISION_ARTIFACT.to_owned(),
            name: Some("Decision".to_owned()),
            description: Some(
                "The join decision, the accepted claims with their evidence, and the \
                 recommended actions (convene.v1 protobuf JSON)."
                    .to_owned(),
            ),
            parts: vec![Part {
                content: PartContent::Data(decision_data(run, decision)),
                filename: None,
                media_type: Some("application/json".to_owned()),
                metadata: None,
            }],
            metadata: Some(HashMap::from([("convene.revision".to_owned(), revision)])),
            extensions: None,
        },
    ]
}

/// The claims of the accepted results, with the delegation each came from.
fn accepted_claims<'a>(
    run: &'a v1::Run,
    decision: &'a v1::JoinDecision,
) -> impl Iterator<Item = (&'a v1::Delegation, &'a v1::Claim)> {
    run.delegations
        .iter()
        .filter(move |d| {
            d.task
                .as_ref()
                .is_some_and(|t| decision.accepted.contains(&t.delegation_id))
        })
        .flat_map(|d| {
            d.result
                .iter()
                .flat_map(move |r| r.claims.iter().map(move |c| (d, c)))
        })
}

fn profile_of(d: &v1::Delegation) -> &str {
    d.task.as_ref().map_or("", |t| t.profile_id.as_str())
}

fn to_json<T: convene_proto::json::Named>(message: &T) -> Value {
    convene_proto::json::to_value(message).unwrap_or(Value::Null)
}

fn decision_data(run: &v1::Run, decision: &v1::JoinDecision) -> Value {
    let claims: Vec<Value> = accepted_claims(run, decision)
        .map(|(d, c)| {
            json!({
                "delegationId": d.task.as_ref().map_or("", |t| t.delegation_id.as_str()),
                "profileId": profile_of(d),
                "claim": to_json(c),
            })
        })
        .collect();
    json!({
        "runId": run.run_id,
        "state": run_state_name(run.state),
        "outcome": outcome_name(decision.outcome),
        "decision": to_json(decision),
        "claims": claims,
        "actions": run.actions.iter().map(to_json).collect::<Vec<_>>(),
        "traceId": run.trace_id,
    })
}

/// The decision in words: outcome, reasons, findings with their evidence, conflicts and
/// recommended actions.
fn assessment(run: &v1::Run, decision: &v1::JoinDecision) -> String {
    let mut out = format!(
        "Outcome: {} (run {}, {}).\n",
        outcome_name(decision.outcome),
        run.run_id,
        run_state_name(run.state)
    );
    for reason in &decision.reasons {
        out.push_str(&format!("- {reason}\n"));
    }
    let claims: Vec<_> = accepted_claims(run, decision).collect();
    if !claims.is_empty() {
        out.push_str("Findings:\n");
        for (d, c) in claims {
            out.push_str(&format!(
                "- {} = {} ({}): {} [evidence: {}]\n",
                c.topic,
                c.value,
                profile_of(d),
                c.statement,
                c.evidence_refs.join(", ")
            ));
        }
    }
    if !decision.conflicts.is_empty() {
        out.push_str("Conflicts:\n");
        for conflict in &decision.conflicts {
            let sides: Vec<String> = conflict
                .claims
                .iter()
                .map(|c| format!("{} (delegation {})", c.value, c.delegation_id))
                .collect();
            let state = if conflict.settlement.is_some() {
                "settled"
            } else {
                "open"
            };
            out.push_str(&format!(
                "- {} ({state}): {}\n",
                conflict.topic,
                sides.join(" vs ")
            ));
        }
    }
    if !run.actions.is_empty() {
        out.push_str("Recommended actions:\n");
        for action in &run.actions {
            let risk = v1::RiskLevel::try_from(action.risk_level)
                .map_or("UNSPECIFIED", |r| short(r.as_str_name(), "RISK_LEVEL_"));
            let state = v1::ActionState::try_from(action.state)
                .map_or("UNSPECIFIED", |s| short(s.as_str_name(), "ACTION_STATE_"));
            out.push_str(&format!(
                "- {} ({risk}, approval {}): {state}\n",
                action.action, action.approval_id
            ));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_run_state_has_its_task_state() {
        use v1::RunState as S;
        let cases = [
            (S::Pending, TaskState::Submitted),
            (S::Running, TaskState::Working),
            (S::WaitingInput, TaskState::InputRequired),
            (S::WaitingApproval, TaskState::InputRequired),
            (S::Succeeded, TaskState::Completed),
            (S::Partial, TaskState::Completed),
            (S::Failed, TaskState::Failed),
            (S::BudgetExhausted, TaskState::Failed),
            (S::NoProgress, TaskState::Failed),
            (S::Rejected, TaskState::Rejected),
            (S::Cancelled, TaskState::Canceled),
        ];
        for (run, task) in cases {
            assert_eq!(task_state(run as i32), task, "{run:?}");
        }
    }

    #[test]
    fn artifacts_wait_for_a_decision_and_a_stopped_run() {
        let mut run = v1::Run {
            run_id: "r1".to_owned(),
            state: v1::RunState::Running as i32,
            decision: Some(v1::JoinDecision {
                revision: 1,
                outcome: v1::JoinOutcome::Complete as i32,
                reasons: vec!["quorum met".to_owned()],
                ..Default::default()
            }),
            ..Default::default()
        };
        assert!(
            artifacts(&run).is_empty(),
            "a running run has no result yet"
        );
        run.state = v1::RunState::Succeeded as i32;
        let a = artifacts(&run);
        assert_eq!(a.len(), 2);
        assert!(
            matches!(&a[0].parts[0].content, PartContent::Text(t) if t.contains("COMPLETE") && t.contains("quorum met"))
        );
        assert!(
            matches!(&a[1].parts[0].content, PartContent::Data(v) if v["outcome"] == "COMPLETE")
        );
    }
}
