//! What runs an approved action: the [`Executor`] trait and the default
//! [`RecordOnlyExecutor`].
//!
//! The service calls an executor at most once per request (it claims the request with a
//! compare-and-set first), so an executor need not deduplicate. It reports one of three
//! things: the action ran (successfully or not), it failed after it may have changed
//! something, or it could not be started at all. Only the last leaves the request
//! approved for another attempt; anything that may have touched the world is recorded
//! and never run again.

use std::fmt::Debug;

use async_trait::async_trait;
use prost_types::{Struct, Value, value::Kind};

use crate::model::ApprovalRequest;

/// What an executor reports for an action that ran.
#[derive(Clone, Debug, PartialEq)]
pub struct ExecutionOutcome {
    /// Whether the action did what it was asked to.
    pub success: bool,
    /// What the executor wants recorded, e.g. the new rule version.
    pub output: Struct,
}

/// Why an executor did not report an outcome.
#[derive(Debug, thiserror::Error)]
pub enum ExecutorError {
    /// Nothing was done (e.g. the target system was unreachable before any change). The
    /// request stays approved and may be executed again.
    #[error("not started: {0}")]
    NotStarted(String),
    /// The action failed after it may have changed something, or its outcome is unknown.
    /// It is recorded as a failed execution and never run again.
    #[error("failed: {0}")]
    Failed(String),
}

/// Runs approved actions.
#[async_trait]
pub trait Executor: Debug + Send + Sync {
    /// The name recorded in each execution record, e.g. `record-only`.
    fn name(&self) -> &str;

    /// Runs `request`'s action with its parameters, once.
    async fn execute(&self, request: &ApprovalRequest) -> Result<ExecutionOutcome, ExecutorError>;
}

/// Performs nothing: records that the approved action would have run, with which
/// parameters. The default until real executors are configured, so approving an action
/// in a development setup never touches a real system.
#[derive(Clone, Copy, Debug, Default)]
pub struct RecordOnlyExecutor;

impl RecordOnlyExecutor {
    /// The executor's name.
    pub const NAME: &'static str = "record-only";
}

#[async_trait]
impl Executor for RecordOnlyExecutor {
    fn name(&self) -> &str {
        Self::NAME
    }

    async fn execute(&self, request: &ApprovalRequest) -> Result<ExecutionOutcome, ExecutorError> {
        let text = |s: &str| Value {
            kind: Some(Kind::StringValue(s.to_owned())),
        };
        let output = Struct {
            fields: [
                (
                    "recorded".to_owned(),
                    Value {
                        kind: Some(Kind::BoolValue(true)),
                    },
                ),
                ("action".to_owned(), text(&request.action)),
                ("parameters_hash".to_owned(), text(&request.parameters_hash)),
            ]
            .into_iter()
            .collect(),
        };
        Ok(ExecutionOutcome {
            success: true,
            output,
        })
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, SystemTime};

    use convene_core::permissions::RiskLevel;

    use super::*;
    use crate::model::State;

    #[tokio::test]
    async fn record_only_records_the_action_and_its_hash() {
        let at = SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
        let request = ApprovalRequest {
            approval_id: "apr-1".into(),
            tenant: "acme".into(),
            action: "rule:rollback".into(),
            parameters: Struct::default(),
            parameters_hash: "sha256:abc".into(),
            risk: RiskLevel::R3,
            idempotency_key: "k".into(),
            requester: "oncall@acme".into(),
            filed_by: "oncall@acme".into(),
            evidence_refs: vec![],
            expires_at: at,
            state: State::Approved,
            votes: vec![],
            execution: None,
            executing: None,
            cancellation: None,
            run_id: String::new(),
            rationale: String::new(),
            created_at: at,
        };
        let outcome = RecordOnlyExecutor.execute(&request).await.unwrap();
        assert!(outcome.success);
        let field = |name: &str| outcome.output.fields.get(name).and_then(|v| v.kind.clone());
        assert_eq!(field("recorded"), Some(Kind::BoolValue(true)));
        assert_eq!(
            field("action"),
            Some(Kind::StringValue("rule:rollback".into()))
        );
        assert_eq!(
            field("parameters_hash"),
            Some(Kind::StringValue("sha256:abc".into()))
        );
        assert_eq!(RecordOnlyExecutor.name(), "record-only");
    }
}
