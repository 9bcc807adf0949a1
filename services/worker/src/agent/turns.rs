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
use convene_proto::v1;
use serde_json::{Value, json};

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

/// The evidence id of the compaction made before turn `turn` (a summarising model call;
/// see [`super::context`]).
pub fn compaction_evidence_id(
    run_id: &str,
    delegation_id: &str,
    attempt: u32,
    turn: u32,
) -> String {
    format!("model://{run_id}/{delegation_id}/{attempt}/turn-{turn}-compaction")
}

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

/// One stored turn as a reader fetched it: its evidence record's content hash and its
/// artifact's bytes.
#[derive(Debug, Clone)]
pub struct StoredTurn {
    /// The turn's evidence id.
    pub evidence_id: String,
    /// The content hash its evidence record names.
    pub content_hash: String,
    /// The artifact's bytes.
    pub bytes: Vec<u8>,
}

/// A task's conversation, rebuilt from its stored turns.
#[derive(Debug, Clone, PartialEq)]
pub struct Conversation {
    /// The system prompt the last turn was sent with.
    pub system: String,
    /// The tools the last turn offered, by name.
    pub tools: Vec<String>,
    /// The messages, oldest first, ending with the last turn's answer.
    pub messages: Vec<Value>,
    /// How many turns it took.
    pub turns: u32,
}

/// Where a chain of turns does not hold.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("turn {turn} ({evidence_id}): {reason}")]
pub struct ChainBreak {
    /// The turn (from 1) at which it breaks.
    pub turn: u32,
    /// Its evidence id.
    pub evidence_id: String,
    /// What is wrong.
    pub reason: String,
}

/// Rebuilds a task's conversation from its stored turns, oldest first (a compaction
/// just before the turn it was made for), checking the chain on the way: each artifact
/// hashes to its record's content hash, the turns are numbered 1, 2, … in order, each
/// names the hash of the one before (the first none), and each adds to the
/// conversation where the one before left it, or restates it whole, from message 0
/// (which a turn after a compaction must).
///
/// # Errors
///
/// The first turn at which the chain does not hold.
pub fn walk(turns: &[StoredTurn]) -> Result<Conversation, ChainBreak> {
    let mut conversation = Conversation {
        system: String::new(),
        tools: Vec::new(),
        messages: Vec::new(),
        turns: 0,
    };
    let mut previous: Option<&str> = None;
    let mut expected: u32 = 1;
    let mut restate = false;
    for stored in turns {
        let broken = |reason: String| ChainBreak {
            turn: expected,
            evidence_id: stored.evidence_id.clone(),
            reason,
        };
        let hash = content_hash(&stored.bytes);
        if hash != stored.content_hash {
            return Err(broken(format!(
                "its bytes hash to {hash}, not to the {} its record names",
                stored.content_hash
            )));
        }
        let body: Value = serde_json::from_slice(&stored.bytes)
            .map_err(|e| broken(format!("it is not JSON: {e}")))?;
        if body["turn"].as_u64() != Some(u64::from(expected)) {
            return Err(broken(format!(
                "it says it is turn {}, where turn {expected} belongs",
                body["turn"]
            )));
        }
        let names = body["previous"].as_str();
        if names != previous {
            return Err(broken(match (names, previous) {
                (Some(n), Some(p)) => format!("it follows {n}, but the turn before is {p}"),
                (Some(n), None) => format!("it follows {n}, but it is the first turn"),
                (None, _) => "it names no turn before it".to_owned(),
            }));
        }
        previous = Some(&stored.content_hash);
        if body["kind"] == "compaction" {
            restate = true;
            continue;
        }
        let request = &body["request"];
        let from = request["messages_from"]
            .as_u64()
            .and_then(|n| usize::try_from(n).ok())
            .ok_or_else(|| broken("its request has no messages_from".to_owned()))?;
        if from != 0 && restate {
            return Err(broken(format!(
                "it follows a compaction, so it must restate the conversation, but it adds \
                 messages from {from}"
            )));
        }
        if from != 0 && from != conversation.messages.len() {
            return Err(broken(format!(
                "it adds messages from {from}, but the turns before hold {}",
                conversation.messages.len()
            )));
        }
        restate = false;
        conversation.messages.truncate(from);
        let added = request["messages"]
            .as_array()
            .ok_or_else(|| broken("its request has no messages".to_owned()))?;
        conversation.messages.extend(added.iter().cloned());
        if let Some(system) = request["system"].as_str() {
            conversation.system = system.to_owned();
        } else if from == 0 {
            return Err(broken(
                "it restates the conversation without its system prompt".into(),
            ));
        }
        if let Some(tools) = request["tools"].as_array() {
            conversation.tools = tools
                .iter()
                .filter_map(|t| t.as_str().map(str::to_owned))
                .collect();
        }
        let answer = &body["response"]["message"];
        if !answer.is_object() {
            return Err(broken("it has no answer".to_owned()));
        }
        conversation.messages.push(answer.clone());
        conversation.turns = expected;
        expected += 1;
    }
    Ok(conversation)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A turn's stored bytes as `record_turn` writes them.
    fn turn(n: u32, previous: Option<&str>, from: usize, added: &[&str], answer: &str) -> Value {
        let mut request = json!({
            "model": "m",
            "messages_from": from,
            "messages": added.iter().map(|t| json!({"role": "user", "content": t})).collect::<Vec<_>>(),
            "max_tokens": 100,
            "temperature": 0.0,
        });
        if n == 1 || from == 0 {
            request["system"] = json!("be brief");
            request["tools"] = json!(["search_logs@1", "submit_report"]);
        }
        json!({
            "turn": n,
            "attempt": 1,
            "delegation_id": "d",
            "provider": "openai",
            "previous": previous,
            "request": request,
            "response": {"model": "m", "message": {"role": "assistant", "content": answer},
                         "finish": "stop", "usage": {"input": 1, "output": 1}},
            "tool_call_ids": [],
        })
    }

    fn stored(n: u32, body: &Value) -> StoredTurn {
        let bytes = canonical_json(body).into_bytes();
        StoredTurn {
            evidence_id: format!("model://r/d/1/turn-{n}"),
            content_hash: content_hash(&bytes),
            bytes,
        }
    }

    /// Three chained turns: a task, a nudge, a second nudge.
    fn chain() -> Vec<StoredTurn> {
        let first = stored(1, &turn(1, None, 0, &["the task"], "a"));
        let second = stored(2, &turn(2, Some(&first.content_hash), 2, &["go on"], "b"));
        let third = stored(3, &turn(3, Some(&second.content_hash), 4, &["finish"], "c"));
        vec![first, second, third]
    }

    #[test]
    fn a_chain_of_turns_rebuilds_the_whole_conversation() {
        let conversation = walk(&chain()).expect("intact");
        let texts: Vec<&str> = conversation
            .messages
            .iter()
            .map(|m| m["content"].as_str().unwrap())
            .collect();
        assert_eq!(texts, ["the task", "a", "go on", "b", "finish", "c"]);
        assert_eq!(conversation.turns, 3);
        assert_eq!(conversation.system, "be brief");
        assert_eq!(conversation.tools, ["search_logs@1", "submit_report"]);
    }

    #[test]
    fn a_compacted_turn_restates_the_conversation_from_its_start() {
        let mut turns = chain();
        let restated = stored(
            4,
            &turn(
                4,
                Some(&turns[2].content_hash),
                0,
                &["summary of it all", "now"],
                "d",
            ),
        );
        turns.push(restated);
        let conversation = walk(&turns).expect("intact");
        let texts: Vec<&str> = conversation
            .messages
            .iter()
            .map(|m| m["content"].as_str().unwrap())
            .collect();
        assert_eq!(texts, ["summary of it all", "now", "d"]);
    }

    #[test]
    fn an_altered_turn_breaks_the_chain_where_it_was_altered() {
        let mut turns = chain();
        let mut bytes = turns[1].bytes.clone();
        let at = bytes.windows(5).position(|w| w == b"go on").unwrap();
        bytes[at] = b'G';
        turns[1].bytes = bytes;
        let broken = walk(&turns).unwrap_err();
        assert_eq!(broken.turn, 2);
        assert!(broken.reason.contains("hash"), "{broken}");

        // Rewritten consistently (bytes and record), the next turn no longer follows it.
        let mut turns = chain();
        let altered = turn(2, Some(&turns[0].content_hash), 2, &["Go on"], "b");
        turns[1] = stored(2, &altered);
        let broken = walk(&turns).unwrap_err();
        assert_eq!(broken.turn, 3);
        assert!(broken.reason.contains("follows"), "{broken}");
    }

    #[test]
    fn a_missing_or_reordered_turn_is_named() {
        let mut turns = chain();
        turns.remove(1);
        let broken = walk(&turns).unwrap_err();
        assert_eq!(broken.turn, 2);
        assert!(broken.reason.contains("turn 3"), "{broken}");

        let turns = chain();
        let swapped = vec![turns[0].clone(), turns[2].clone(), turns[1].clone()];
        assert_eq!(walk(&swapped).unwrap_err().turn, 2);
    }

    #[test]
    fn a_compaction_sits_between_two_turns_and_the_next_restates_the_conversation() {
        let mut turns = chain();
        let mut compaction = turn(4, Some(&turns[2].content_hash), 0, &["summarise this"], "s");
        compaction["kind"] = json!("compaction");
        let compaction = stored(4, &compaction);
        let after = turn(
            4,
            Some(&compaction.content_hash),
            0,
            &["the task", "summary: s"],
            "d",
        );
        turns.push(compaction.clone());
        turns.push(stored(4, &after));
        let conversation = walk(&turns).expect("intact");
        assert_eq!(conversation.turns, 4);
        let texts: Vec<&str> = conversation
            .messages
            .iter()
            .map(|m| m["content"].as_str().unwrap())
            .collect();
        assert_eq!(texts, ["the task", "summary: s", "d"]);

        // A turn after a compaction that only appends is refused.
        let mut turns = chain();
        let appended = turn(4, Some(&compaction.content_hash), 6, &["more"], "d");
        turns.push(compaction);
        turns.push(stored(4, &appended));
        let broken = walk(&turns).unwrap_err();
        assert_eq!(broken.turn, 4);
        assert!(broken.reason.contains("restate"), "{broken}");
    }

    #[test]
    fn a_turn_that_skips_messages_is_refused() {
        let first = stored(1, &turn(1, None, 0, &["the task"], "a"));
        let second = stored(2, &turn(2, Some(&first.content_hash), 5, &["go on"], "b"));
        let broken = walk(&[first, second]).unwrap_err();
        assert_eq!(broken.turn, 2);
        assert!(broken.reason.contains("from 5"), "{broken}");
    }
}
