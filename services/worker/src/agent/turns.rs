//! Model turns as evidence: each turn's request and response is stored as an artifact
//! with an evidence record of kind `model_turn`, so a claim's chain can be walked from
//! its evidence to the tool call that recorded it and on to the turn that asked for
//! that call (`convene evidence verify` shows it).
//!
//! A turn's evidence id is derived from the run, the delegation, the dispatch attempt
//! and the turn number ([`turn_evidence_id`]); its artifact lists the ids of the tool
//! calls the turn asked for (`tool_call_ids`). The result's usage gives the number of
//! turns, and the run the attempt, so a reader finds every turn without a search.

use std::time::SystemTime;

use convene_core::ids::content_hash;
use convene_core::time::to_timestamp;
use convene_proto::v1;
use serde_json::json;

use super::calls::CallError;
use super::{Agent, TaskContext};
use crate::provider::{ModelRequest, ModelResponse};
use crate::report::Infra;
use crate::tools::canonical_json;

/// The evidence kind of a model turn.
pub const MODEL_TURN_KIND: &str = "model_turn";

/// The evidence id of turn `turn` (from 1) of dispatch `attempt` of a delegation.
pub fn turn_evidence_id(run_id: &str, delegation_id: &str, attempt: u32, turn: u32) -> String {
    format!("model://{run_id}/{delegation_id}/{attempt}/turn-{turn}")
}

impl Agent {
    /// Stores turn `turn`: the request (tools by name), the response and the ids of
    /// the calls it asked for. Only a failure of the evidence store itself ends the task;
    /// a refusal is logged and the task goes on.
    pub(super) async fn record_turn(
        &self,
        ctx: &TaskContext<'_>,
        turn: u32,
        request: &ModelRequest,
        response: &ModelResponse,
    ) -> Result<(), Infra> {
        let task = ctx.task;
        let request_json = json!({
            "model": request.model,
            "system": request.system,
            "messages": request.messages,
            "tools": request.tools.iter().map(|t| t.name.as_str()).collect::<Vec<_>>(),
            "max_tokens": request.max_tokens,
            "temperature": request.temperature,
        });
        let content = canonical_json(&json!({
            "turn": turn,
            "attempt": ctx.attempt,
            "delegation_id": task.delegation_id,
            "provider": self.provider.name(),
            "request": request_json,
            "response": response,
            "tool_call_ids": response
                .message
                .tool_calls
                .iter()
                .map(|c| c.id.as_str())
                .collect::<Vec<_>>(),
        }))
        .into_bytes();
        let tool_call_id = format!("{}/turn-{turn}", task.delegation_id);
        let record = v1::Evidence {
            evidence_id: turn_evidence_id(&task.run_id, &task.delegation_id, ctx.attempt, turn),
            kind: MODEL_TURN_KIND.to_owned(),
            source: format!("model.{}", self.provider.name()),
            query_fingerprint: content_hash(canonical_json(&request_json).as_bytes()),
            scope: None,
            observed_at: Some(to_timestamp(SystemTime::now())),
            artifact_uri: String::new(),
            content_hash: content_hash(&content),
            quality: v1::EvidenceQuality::Passed as i32,
            tool_call_id: tool_call_id.clone(),
            trace_id: convene_telemetry::current_trace_id().unwrap_or_default(),
            delegation_id: String::new(),
            tenant: String::new(),
            kind_defaulted: false,
        };
        match self.store(ctx, record, content, tool_call_id).await {
            Ok(_) => Ok(()),
            Err(CallError::Infra(infra)) => Err(infra),
            Err(CallError::Denied(why) | CallError::Failed(why)) => {
                tracing::warn!(
                    delegation_id = %task.delegation_id,
                    turn,
                    error = %why,
                    "the model turn was not recorded as evidence"
                );
                Ok(())
            }
        }
    }
}
