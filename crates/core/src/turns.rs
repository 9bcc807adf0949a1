//! Reading a task's model turns back: their evidence ids, and the hash chain they form.
//!
//! A worker stores each model turn of a task as `model_turn` evidence holding only what
//! the turn added to the conversation (the messages from `messages_from`, the answer;
//! the system prompt, tool names and settings when they changed) and the content hash
//! of the turn before (`previous`). A compaction (the summary of older turns made to
//! fit the context window) sits in the chain just before the turn it was made for, and
//! that turn restates the conversation from message 0. [`walk`] rebuilds the
//! conversation and checks every link on the way.

use std::collections::HashMap;

use serde_json::Value;

use crate::ids::content_hash;

/// The evidence kind of a model turn.
pub const MODEL_TURN_KIND: &str = "model_turn";

/// The evidence id of turn `turn` (from 1) of dispatch `attempt` of a delegation.
pub fn turn_evidence_id(run_id: &str, delegation_id: &str, attempt: u32, turn: u32) -> String {
    format!("model://{run_id}/{delegation_id}/{attempt}/turn-{turn}")
}

/// The evidence id of the compaction made before turn `turn` (a summary of the older
/// turns, made to fit the model's context window).
pub fn compaction_evidence_id(
    run_id: &str,
    delegation_id: &str,
    attempt: u32,
    turn: u32,
) -> String {
    format!("model://{run_id}/{delegation_id}/{attempt}/turn-{turn}-compaction")
}

/// The evidence ids of a delegation's stored turns, oldest first: before each turn's,
/// the id of the compaction that may have been made for it.
pub fn chain_ids(run_id: &str, delegation_id: &str, attempt: u32, turns: u32) -> Vec<String> {
    (1..=turns)
        .flat_map(|turn| {
            [
                compaction_evidence_id(run_id, delegation_id, attempt, turn),
                turn_evidence_id(run_id, delegation_id, attempt, turn),
            ]
        })
        .collect()
}

/// [`walk`] over what a reader found of [`chain_ids`]: compactions are there only where
/// one was made, but a turn missing is a break in the chain.
///
/// # Errors
///
/// The first missing turn, else [`walk`]'s.
pub fn walk_found(
    ids: &[String],
    found: &HashMap<String, StoredTurn>,
) -> Result<Conversation, ChainBreak> {
    let turn_ids = ids.iter().skip(1).step_by(2);
    if let Some((at, id)) = turn_ids
        .enumerate()
        .find(|(_, id)| !found.contains_key(*id))
    {
        return Err(ChainBreak {
            turn: u32::try_from(at + 1).unwrap_or(u32::MAX),
            evidence_id: id.clone(),
            reason: "it is not in the evidence store".to_owned(),
        });
    }
    let turns: Vec<StoredTurn> = ids.iter().filter_map(|id| found.get(id).cloned()).collect();
    walk(&turns)
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
    use serde_json::json;

    use super::*;

    fn canonical_json(value: &Value) -> String {
        serde_json::to_string(value).unwrap()
    }

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
