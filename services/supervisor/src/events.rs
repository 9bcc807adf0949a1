//! Building run events (WatchRun) and CloudEvents 1.0 envelopes (the outbox), and the
//! CloudEvents JSON event format the relay publishes and `convene events --json` prints.

use std::time::SystemTime;

use convene_core::time::to_timestamp;
use convene_proto::json::{from_struct, to_struct};
use convene_proto::v1;
use serde_json::json;

/// `source` of every event the supervisor produces.
pub const SOURCE: &str = "convene://supervisor";
/// A run was accepted.
pub const RUN_STARTED: &str = "dev.convene.run.started.v1";
/// A delegation's result (or failure) was recorded.
pub const DELEGATION_COMPLETED: &str = "dev.convene.delegation.completed.v1";
/// The join produced a decision (or a revision).
pub const JOIN_DECIDED: &str = "dev.convene.join.decided.v1";
/// A run ended, in a final state (once per run).
pub const RUN_COMPLETED: &str = "dev.convene.run.completed.v1";
/// A run began to wait for people (WAITING_INPUT or WAITING_APPROVAL).
pub const RUN_WAITING: &str = "dev.convene.run.waiting.v1";
/// A waiting run continues: a person acted, or an approval request it waited for was
/// settled.
pub const RUN_RESUMED: &str = "dev.convene.run.resumed.v1";

/// An event in the CloudEvents 1.0 JSON event format (structured content mode):
/// `specversion`, `id`, `source`, `type`, `subject`, `time` (RFC 3339), `datacontenttype`,
/// `dataschema`, the extension attributes `correlationid` (the run id) and `tenantid`,
/// and `data` as JSON. This is what the NATS relay publishes and what
/// `convene events --json` prints, one event per line.
pub fn to_json(event: &v1::CloudEvent) -> serde_json::Value {
    let time = event
        .time
        .as_ref()
        .and_then(|t| convene_core::time::from_timestamp(t, "time").ok())
        .map(|t| humantime::format_rfc3339_micros(t).to_string());
    let mut out = serde_json::Map::new();
    out.insert("specversion".into(), json!(event.spec_version));
    out.insert("id".into(), json!(event.id));
    out.insert("source".into(), json!(event.source));
    out.insert("type".into(), json!(event.r#type));
    out.insert("subject".into(), json!(event.subject));
    if let Some(time) = time {
        out.insert("time".into(), json!(time));
    }
    out.insert("datacontenttype".into(), json!(event.data_content_type));
    out.insert("dataschema".into(), json!(event.data_schema));
    out.insert("correlationid".into(), json!(event.correlation_id));
    out.insert("tenantid".into(), json!(event.tenant_id));
    out.insert(
        "data".into(),
        event
            .data
            .as_ref()
            .map_or(serde_json::Value::Null, from_struct),
    );
    serde_json::Value::Object(out)
}

/// A CloudEvent of `kind` about `run`, with `subject` under the run.
pub fn cloud(
    kind: &str,
    run: &v1::Run,
    subject_suffix: Option<&str>,
    time: SystemTime,
    data: serde_json::Value,
) -> v1::CloudEvent {
    let subject = match subject_suffix {
        Some(s) => format!("runs/{}/{s}", run.run_id),
        None => format!("runs/{}", run.run_id),
    };
    v1::CloudEvent {
        id: uuid::Uuid::now_v7().to_string(),
        source: SOURCE.to_owned(),
        spec_version: "1.0".to_owned(),
        r#type: kind.to_owned(),
        subject,
        time: Some(to_timestamp(time)),
        data_schema: format!("https://convene.dev/schemas/{kind}.json"),
        data_content_type: "application/json".to_owned(),
        correlation_id: run.run_id.clone(),
        tenant_id: run.tenant.clone(),
        data: Some(to_struct(&data)),
    }
}

/// Names of a proto enum value, for event payloads.
pub fn run_state_name(state: i32) -> &'static str {
    v1::RunState::try_from(state).map_or("RUN_STATE_UNSPECIFIED", |s| s.as_str_name())
}

/// Name of a join outcome.
pub fn outcome_name(outcome: i32) -> &'static str {
    v1::JoinOutcome::try_from(outcome).map_or("JOIN_OUTCOME_UNSPECIFIED", |o| o.as_str_name())
}

/// The payload of `run.started`.
pub fn run_started_data(run: &v1::Run) -> serde_json::Value {
    json!({
        "runId": run.run_id,
        "principal": run.principal,
        "delegations": run.delegations.len(),
        "traceId": run.trace_id,
        "labels": run.spec.as_ref().map(|s| s.labels.clone()).unwrap_or_default(),
    })
}

/// The payload of `delegation.completed`.
pub fn delegation_completed_data(
    run: &v1::Run,
    d: &v1::Delegation,
    late: bool,
) -> serde_json::Value {
    let none = v1::DelegationTask::default();
    let task = d.task.as_ref().unwrap_or(&none);
    json!({
        "runId": run.run_id,
        "delegationId": task.delegation_id,
        "name": task.name,
        "profileId": task.profile_id,
        "state": v1::DelegationState::try_from(d.state).map_or("DELEGATION_STATE_UNSPECIFIED", |s| s.as_str_name()),
        "status": d.result.as_ref().and_then(|r| v1::TaskStatus::try_from(r.status).ok()).map(|s| s.as_str_name()),
        "workerId": d.worker_id,
        "attempts": d.attempts,
        "late": late,
    })
}

/// The payload of `join.decided`.
pub fn join_decided_data(run: &v1::Run, decision: &v1::JoinDecision) -> serde_json::Value {
    json!({
        "runId": run.run_id,
        "revision": decision.revision,
        "outcome": outcome_name(decision.outcome),
        "accepted": decision.accepted,
        "rejected": decision.rejected.iter().map(|r| json!({
            "delegationId": r.delegation_id,
            "reason": v1::RejectionReason::try_from(r.reason).map_or("REJECTION_REASON_UNSPECIFIED", |x| x.as_str_name()),
        })).collect::<Vec<_>>(),
        "missingRequired": decision.missing_required,
        "missingOptional": decision.missing_optional,
        "conflicts": decision.conflicts.iter().map(|c| c.topic.clone()).collect::<Vec<_>>(),
        "quorumMet": decision.quorum_met,
    })
}

/// The payload of `run.completed`.
pub fn run_completed_data(run: &v1::Run) -> serde_json::Value {
    json!({
        "runId": run.run_id,
        "state": run_state_name(run.state),
        "outcome": outcome_name(run.outcome),
        "reason": run.terminal_reason,
        "approvalIds": run.approval_ids,
        "actions": run.actions.iter().map(|a| json!({
            "approvalId": a.approval_id,
            "action": a.action,
            "state": v1::ActionState::try_from(a.state).map_or("ACTION_STATE_UNSPECIFIED", |s| s.as_str_name()),
        })).collect::<Vec<_>>(),
    })
}

/// The payload of `run.waiting`.
pub fn run_waiting_data(run: &v1::Run, waiting: &v1::RunWaiting) -> serde_json::Value {
    json!({
        "runId": run.run_id,
        "state": run_state_name(waiting.state),
        "outcome": outcome_name(waiting.outcome),
        "reason": waiting.reason,
        "ticket": waiting.ticket.as_ref().map(|t| json!({"id": t.id, "version": t.version})),
        "openConflicts": waiting.open_conflicts,
        "pendingApprovals": waiting.pending_approvals,
    })
}

/// The payload of `run.resumed`.
pub fn run_resumed_data(run: &v1::Run, resumed: &v1::RunResumed) -> serde_json::Value {
    json!({
        "runId": run.run_id,
        "by": resumed.by,
        "input": resumed.input,
        "detail": resumed.detail,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cloud_events_print_in_the_cloudevents_json_format() {
        let run = v1::Run {
            run_id: "0190e6a0-0000-7000-8000-000000000001".into(),
            tenant: "acme".into(),
            ..Default::default()
        };
        let at = SystemTime::UNIX_EPOCH + std::time::Duration::from_micros(1_785_000_000_123_456);
        let event = cloud(
            RUN_COMPLETED,
            &run,
            None,
            at,
            json!({"runId": run.run_id, "revision": 1}),
        );
        let j = to_json(&event);
        assert_eq!(j["specversion"], "1.0");
        assert_eq!(j["id"], event.id.as_str());
        assert_eq!(j["type"], RUN_COMPLETED);
        assert_eq!(j["source"], SOURCE);
        assert_eq!(j["subject"], format!("runs/{}", run.run_id));
        assert_eq!(j["correlationid"], run.run_id.as_str());
        assert_eq!(j["tenantid"], "acme");
        assert_eq!(j["datacontenttype"], "application/json");
        assert_eq!(j["time"], "2026-07-25T17:20:00.123456Z");
        assert_eq!(j["data"], json!({"runId": run.run_id, "revision": 1}));
    }
}
