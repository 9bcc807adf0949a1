//! The approval service's events: one CloudEvents 1.0 envelope per state change of a
//! request, committed with the change ([`ApprovalStore`](crate::ApprovalStore) takes the
//! [`Event`] with the write), and read back in commit order by `WatchEvents`.
//!
//! | type | when | data beyond the common keys |
//! |---|---|---|
//! | `dev.convene.approval.requested.v1` | a new request (not an idempotent repeat) | `requester`, `filedBy`, `expiresAt`, `approvalsRequired` |
//! | `dev.convene.approval.decided.v1` | every recorded vote | `approver`, `decision`, `approvalsMissing` |
//! | `dev.convene.approval.executed.v1` | the one execution | `executor`, `success`, `executedBy` |
//! | `dev.convene.approval.expired.v1` | a pending request is recorded expired | `expiresAt` |
//! | `dev.convene.approval.cancelled.v1` | a request is withdrawn | `cancelledBy`, `reason` |
//!
//! Every event's data holds `approvalId`, `runId`, `action`, `riskLevel` (`R2`, `R3`),
//! `state` (the request's state after the change, e.g. `APPROVED`) and
//! `parametersHash`. The envelope: a UUIDv7 `id`, `source` `convene://approval`,
//! `subject` `approvals/<approval id>`, `time` the change's time on the service clock,
//! `correlation_id` the request's run id, `tenant_id` the request's tenant.

use std::time::SystemTime;

use convene_core::time::to_timestamp;
use convene_proto::{json::to_struct, v1};
use serde_json::{Value, json};

use crate::model::{ApprovalRequest, Cancellation, Execution, Vote};

/// `source` of every event the approval service produces.
pub const SOURCE: &str = "convene://approval";
/// A request was filed.
pub const REQUESTED: &str = "dev.convene.approval.requested.v1";
/// A vote was recorded.
pub const DECIDED: &str = "dev.convene.approval.decided.v1";
/// The approved action was executed.
pub const EXECUTED: &str = "dev.convene.approval.executed.v1";
/// A pending request expired.
pub const EXPIRED: &str = "dev.convene.approval.expired.v1";
/// A request was cancelled.
pub const CANCELLED: &str = "dev.convene.approval.cancelled.v1";

/// Every event type, in lifecycle order.
pub const TYPES: [&str; 5] = [REQUESTED, DECIDED, EXECUTED, EXPIRED, CANCELLED];

/// An event to commit with the change it describes. Built only from the request as it
/// is after the change, so the envelope (subject, tenant, run) always matches it.
#[derive(Clone, Debug, PartialEq)]
pub struct Event {
    cloud: v1::CloudEvent,
    approval_id: String,
    filed_by: String,
    at: SystemTime,
}

impl Event {
    /// `request` was filed (at its creation time).
    pub fn requested(request: &ApprovalRequest) -> Self {
        Self::new(
            REQUESTED,
            request,
            request.created_at,
            json!({
                "requester": request.requester,
                "filedBy": request.filed_by,
                "expiresAt": rfc3339(request.expires_at),
                "approvalsRequired": request.approvals_required(),
            }),
        )
    }

    /// `vote` was recorded on `request` (at the vote's time).
    pub fn decided(request: &ApprovalRequest, vote: &Vote) -> Self {
        Self::new(
            DECIDED,
            request,
            vote.decided_at,
            json!({
                "approver": vote.approver,
                "decision": vote.decision.as_str(),
                "approvalsMissing": request.approvals_missing(),
            }),
        )
    }

    /// `request` was executed (at the execution's time).
    pub fn executed(request: &ApprovalRequest, execution: &Execution) -> Self {
        Self::new(
            EXECUTED,
            request,
            execution.executed_at,
            json!({
                "executor": execution.executor,
                "success": execution.success,
                "executedBy": execution.executed_by,
            }),
        )
    }

    /// `request` was recorded expired at `at`.
    pub fn expired(request: &ApprovalRequest, at: SystemTime) -> Self {
        Self::new(
            EXPIRED,
            request,
            at,
            json!({ "expiresAt": rfc3339(request.expires_at) }),
        )
    }

    /// `request` was cancelled (at the cancellation's time).
    pub fn cancelled(request: &ApprovalRequest, cancellation: &Cancellation) -> Self {
        Self::new(
            CANCELLED,
            request,
            cancellation.cancelled_at,
            json!({
                "cancelledBy": cancellation.cancelled_by,
                "reason": cancellation.reason,
            }),
        )
    }

    fn new(kind: &str, request: &ApprovalRequest, at: SystemTime, extra: Value) -> Self {
        let mut data = json!({
            "approvalId": request.approval_id,
            "runId": request.run_id,
            "action": request.action,
            "riskLevel": request.risk.to_string(),
            "state": request.state.to_string(),
            "parametersHash": request.parameters_hash,
        });
        if let (Value::Object(data), Value::Object(extra)) = (&mut data, extra) {
            data.extend(extra);
        }
        Self {
            cloud: v1::CloudEvent {
                id: uuid::Uuid::now_v7().to_string(),
                source: SOURCE.to_owned(),
                spec_version: "1.0".to_owned(),
                r#type: kind.to_owned(),
                subject: format!("approvals/{}", request.approval_id),
                time: Some(to_timestamp(at)),
                data_schema: format!("https://convene.dev/schemas/{kind}.json"),
                data_content_type: "application/json".to_owned(),
                correlation_id: request.run_id.clone(),
                tenant_id: request.tenant.clone(),
                data: Some(to_struct(&data)),
            },
            approval_id: request.approval_id.clone(),
            filed_by: request.filed_by.clone(),
            at,
        }
    }

    /// The envelope.
    pub fn cloud(&self) -> &v1::CloudEvent {
        &self.cloud
    }

    /// The envelope, owned.
    pub fn into_cloud(self) -> v1::CloudEvent {
        self.cloud
    }

    /// The request the event is about.
    pub fn approval_id(&self) -> &str {
        &self.approval_id
    }

    /// The principal that filed the request (who may see the event besides its tenant).
    pub fn filed_by(&self) -> &str {
        &self.filed_by
    }

    /// When the change happened.
    pub fn at(&self) -> SystemTime {
        self.at
    }
}

/// An event as committed: its place in commit order and its envelope.
#[derive(Clone, Debug, PartialEq)]
pub struct StoredEvent {
    /// Commit order: grows with every event the store commits.
    pub position: u64,
    /// The envelope.
    pub event: v1::CloudEvent,
}

fn rfc3339(time: SystemTime) -> String {
    humantime::format_rfc3339_micros(time).to_string()
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use convene_core::permissions::RiskLevel;
    use convene_proto::json::from_struct;
    use prost_types::Struct;

    use super::*;
    use crate::model::{Decision, State};

    fn request() -> ApprovalRequest {
        let at = SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
        ApprovalRequest {
            approval_id: "apr-1".into(),
            tenant: "acme".into(),
            action: "rule:rollback".into(),
            parameters: Struct::default(),
            parameters_hash: "sha256:00".into(),
            risk: RiskLevel::R3,
            idempotency_key: "k".into(),
            requester: "oncall@acme".into(),
            filed_by: "supervisor".into(),
            evidence_refs: vec![],
            expires_at: at + Duration::from_secs(60),
            state: State::Pending,
            votes: vec![],
            execution: None,
            executing: None,
            cancellation: None,
            run_id: "run-1".into(),
            rationale: String::new(),
            created_at: at,
        }
    }

    #[test]
    fn the_envelope_names_the_request_its_run_and_tenant() {
        let r = request();
        let event = Event::requested(&r);
        let cloud = event.cloud();
        assert_eq!(cloud.source, SOURCE);
        assert_eq!(cloud.spec_version, "1.0");
        assert_eq!(cloud.r#type, REQUESTED);
        assert_eq!(cloud.subject, "approvals/apr-1");
        assert_eq!(cloud.correlation_id, "run-1");
        assert_eq!(cloud.tenant_id, "acme");
        assert_eq!(cloud.data_content_type, "application/json");
        assert_eq!(cloud.time, Some(to_timestamp(r.created_at)));
        assert_eq!(
            uuid::Uuid::parse_str(&cloud.id).unwrap().get_version_num(),
            7
        );
        let data = from_struct(cloud.data.as_ref().unwrap());
        assert_eq!(data["approvalId"], "apr-1");
        assert_eq!(data["runId"], "run-1");
        assert_eq!(data["action"], "rule:rollback");
        assert_eq!(data["riskLevel"], "R3");
        assert_eq!(data["state"], "PENDING");
        assert_eq!(data["parametersHash"], "sha256:00");
        assert_eq!(data["filedBy"], "supervisor");
        assert_eq!(data["approvalsRequired"], 2.0);
        assert_eq!(event.filed_by(), "supervisor");
    }

    #[test]
    fn a_decision_carries_the_vote_and_the_state_after_it() {
        let mut r = request();
        let vote = Vote {
            approver: "alice@acme".into(),
            decision: Decision::Reject,
            parameters_hash: "sha256:00".into(),
            comment: String::new(),
            decided_at: r.created_at + Duration::from_secs(5),
        };
        r.votes.push(vote.clone());
        r.state = State::Rejected;
        let event = Event::decided(&r, &vote);
        assert_eq!(event.at(), vote.decided_at);
        let data = from_struct(event.cloud().data.as_ref().unwrap());
        assert_eq!(data["approver"], "alice@acme");
        assert_eq!(data["decision"], "REJECT");
        assert_eq!(data["state"], "REJECTED");
    }
}
