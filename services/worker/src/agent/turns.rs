//! Model turns as evidence: each turn is stored as an artifact with an evidence record
//! of kind `model_turn`, so a claim's chain can be walked from its evidence to the tool
//! call that recorded it and on to the turn that asked for that call (`convene evidence
//! verify` shows it).
//!
//! A turn stores only what it added to the conversation: the messages its request sent
//! that the turn before had not (`messages_from` says where they start), the answer, and
//! the system prompt, tool names and model settings only when they differ from the last
//! stored ones (the first turn says everything, and which attempt of which delegation
//! on which provider it belongs to).
//! Each turn names the content hash of the turn before (`previous`), so a task's turns
//! are a hash chain, and the whole conversation is rebuilt by walking it ([`walk`]).
//! The stored bytes grow with the turns, not with their square.
//!
//! A turn's evidence id is derived from the run, the delegation, the dispatch attempt
//! and the turn number ([`turn_evidence_id`]); its answer names the tool calls it asked
//! for. The result's usage gives the number of
//! turns, and the run the attempt, so a reader finds every turn without a search.

use std::time::SystemTime;

use convene_core::ids::content_hash;
use convene_core::time::to_timestamp;
pub use convene_core::turns::{
    ChainBreak, Conversation, MODEL_TURN_KIND, StoredTurn, chain_ids, compaction_evidence_id,
    turn_evidence_id, walk, walk_found,
};
use convene_proto::v1;
use serde_json::{Value, json};

use super::calls::CallError;
use super::{Agent, TaskContext};
use crate::provider::{ModelRequest, ModelResponse};
use crate::report::Infra;
use crate::tools::canonical_json;

/// What a stored model call was for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum TurnKind {
    /// A turn of the loop.
    Turn,
    /// The summary of older turns, made before turn `n` to fit the context window; it
    /// adds nothing to the conversation, which the next turn restates whole.
    Compaction,
}

/// What the stored turns of one task already hold, so the next stores only what it adds.
#[derive(Debug, Default)]
pub(super) struct TurnChain {
    /// The content hash of the last stored turn.
    previous: Option<String>,
    /// Messages of the conversation the chain holds: the last stored request's, and its
    /// answer.
    held: usize,
    /// The last stored system prompt, tool names and model settings.
    system: Option<String>,
    tools: Option<Vec<String>>,
    settings: Option<Value>,
    /// Why the next turn restates the conversation, when it was compacted.
    rewritten: Option<&'static str>,
}

impl TurnChain {
    /// The conversation was rewritten (compacted) for `why`: the next turn stores all of
    /// it and says why.
    pub(super) fn rewritten(&mut self, why: &'static str) {
        self.held = 0;
        self.rewritten = Some(why);
    }
}

impl Agent {
    /// Stores turn `turn`: what its request added to the conversation, the response and
    /// the ids of the calls it asked for, chained to the last stored turn. Only a failure
    /// of the evidence store itself ends the task; a refusal is logged and the task goes
    /// on (the next stored turn then carries what this one would have).
    pub(super) async fn record_turn(
        &self,
        ctx: &TaskContext<'_>,
        chain: &mut TurnChain,
        (turn, kind): (u32, TurnKind),
        request: &ModelRequest,
        response: &ModelResponse,
    ) -> Result<(), Infra> {
        let task = ctx.task;
        let from = if kind == TurnKind::Turn && chain.held <= request.messages.len() {
            chain.held
        } else {
            0
        };
        let tools: Vec<String> = request.tools.iter().map(|t| t.name.clone()).collect();
        let settings = json!({
            "model": request.model,
            "max_tokens": request.max_tokens,
            "temperature": request.temperature,
        });
        let mut request_json = json!({
            "messages_from": from,
            "messages": &request.messages[from..],
        });
        // The first turn, and one that restates a rewritten conversation, says
        // everything; any other only what changed.
        let whole = from == 0;
        if whole || chain.settings.as_ref() != Some(&settings) {
            request_json["settings"] = settings.clone();
        }
        if whole || chain.system.as_deref() != Some(request.system.as_str()) {
            request_json["system"] = json!(request.system);
        }
        if whole || chain.tools.as_ref() != Some(&tools) {
            request_json["tools"] = json!(tools);
        }
        let mut body = json!({
            "turn": turn,
            "previous": chain.previous,
            "request": request_json,
            "response": response,
        });
        if chain.previous.is_none() {
            body["attempt"] = json!(ctx.attempt);
            body["delegation_id"] = json!(task.delegation_id);
            body["provider"] = json!(self.provider.name());
        }
        match kind {
            TurnKind::Compaction => body["kind"] = json!("compaction"),
            TurnKind::Turn => {
                if let Some(why) = chain.rewritten {
                    body["rewritten"] = json!(why);
                }
            }
        }
        let content = canonical_json(&body).into_bytes();
        let hash = content_hash(&content);
        let (evidence_id, tool_call_id) = match kind {
            TurnKind::Turn => (
                turn_evidence_id(&task.run_id, &task.delegation_id, ctx.attempt, turn),
                format!("{}/turn-{turn}", task.delegation_id),
            ),
            TurnKind::Compaction => (
                compaction_evidence_id(&task.run_id, &task.delegation_id, ctx.attempt, turn),
                format!("{}/turn-{turn}-compaction", task.delegation_id),
            ),
        };
        let record = v1::Evidence {
            evidence_id,
            kind: MODEL_TURN_KIND.to_owned(),
            source: format!("model.{}", self.provider.name()),
            query_fingerprint: content_hash(canonical_json(&request_json).as_bytes()),
            scope: None,
            observed_at: Some(to_timestamp(SystemTime::now())),
            artifact_uri: String::new(),
            content_hash: hash.clone(),
            quality: v1::EvidenceQuality::Passed as i32,
            tool_call_id: tool_call_id.clone(),
            trace_id: convene_telemetry::current_trace_id().unwrap_or_default(),
            delegation_id: String::new(),
            tenant: String::new(),
            kind_defaulted: false,
        };
        match self.store(ctx, record, content, tool_call_id).await {
            Ok(_) => {
                chain.previous = Some(hash);
                match kind {
                    TurnKind::Turn => {
                        chain.held = request.messages.len() + 1;
                        chain.system = Some(request.system.clone());
                        chain.tools = Some(tools);
                        chain.settings = Some(settings);
                        chain.rewritten = None;
                    }
                    // The summary's own request is not the conversation: the next turn
                    // restates that whole.
                    TurnKind::Compaction => chain.held = 0,
                }
                Ok(())
            }
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
