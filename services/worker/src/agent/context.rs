//! Context windows: a conversation that would not fit its model's window is compacted
//! before it is sent, so a long loop does not end with the provider's error.
//!
//! A profile's `context_window` (tokens; else the window of a well-known model name,
//! [`default_window`]) less the tokens kept for the answer (`max_tokens`, at most half
//! the window) is what a request may use. Tokens are estimated from the request's bytes ([`estimate`]): a
//! quarter of a token per byte, the rate of English and JSON in the tokenizers of the
//! hosted models, so a window is rarely overrun and never by much. When a request
//! would not fit, the loop compacts, in two steps:
//!
//! 1. every tool result the model has already read is replaced by its evidence id and
//!    a one-line summary ([`compact_tool_results`]); the evidence itself stays whole
//!    in the evidence store;
//! 2. if that is not enough, the oldest turns are summarised by one extra model call
//!    (recorded as a `model_turn` of kind `compaction`), and the conversation becomes
//!    the task, the summary and the latest turns ([`summary_cut`]).
//!
//! A provider that still refuses a request as too long (`context_length_exceeded`)
//! gets one more compaction of both steps; a second refusal ends the task with
//! `CONTEXT_EXHAUSTED`.

use std::sync::Mutex;

use serde_json::{Value, json};

use super::turns::{TurnChain, TurnKind};
use super::{Agent, TaskContext};
use crate::provider::{Message, ModelRequest, Role, ToolSpec};
use crate::report::{LoopEnd, Progress, ToolOutcome};

/// The window assumed for a model whose name is not known and whose profile names
/// none: small enough for the open models a worker is most often pointed at.
pub const DEFAULT_CONTEXT_WINDOW: u32 = 32_768;

/// The longest one-line summary of a compacted tool result, in characters.
const SUMMARY_CHARS: usize = 160;

/// The key that marks a compacted tool result.
const COMPACTED: &str = "compacted";

/// The context window of a well-known model, by the name a server knows it by (a
/// `vendor/` prefix and a `:tag` are ignored); [`DEFAULT_CONTEXT_WINDOW`] for others.
pub fn default_window(model: &str) -> u32 {
    let name = model.rsplit('/').next().unwrap_or(model);
    let name = name.split(':').next().unwrap_or(name).to_ascii_lowercase();
    // Longest prefixes first, where one is a prefix of another.
    const KNOWN: &[(&str, u32)] = &[
        ("gpt-4.1", 1_047_576),
        ("gpt-4o", 128_000),
        ("gpt-4-turbo", 128_000),
        ("gpt-4", 8_192),
        ("gpt-5", 400_000),
        ("gpt-3.5-turbo", 16_385),
        ("o1", 200_000),
        ("o3", 200_000),
        ("o4", 200_000),
        ("claude", 200_000),
        ("gemini", 1_048_576),
        ("llama3.1", 131_072),
        ("llama3.2", 131_072),
        ("llama3.3", 131_072),
        ("llama-3.1", 131_072),
        ("llama-3.3", 131_072),
        ("qwen2.5", 32_768),
        ("qwen3", 32_768),
        ("mistral", 32_768),
    ];
    KNOWN
        .iter()
        .find(|(prefix, _)| name.starts_with(prefix))
        .map_or(DEFAULT_CONTEXT_WINDOW, |(_, window)| *window)
}

/// The tokens a request may use: the window less what is kept for the answer
/// (`max_tokens`, but never more than half the window).
pub fn request_limit(window: u32, max_tokens: u32) -> u64 {
    u64::from(window.saturating_sub(max_tokens.min(window / 2)))
}

/// The estimated tokens of the tools' definitions, sent with every request.
pub fn tools_estimate(tools: &[std::sync::Arc<ToolSpec>]) -> u64 {
    tools
        .iter()
        .map(|t| bytes_to_tokens(t.name.len() + t.description.len() + json_len(&t.parameters)) + 8)
        .sum()
}

/// The length of `value` as JSON, counted without writing it anywhere.
fn json_len(value: &impl serde::Serialize) -> usize {
    struct Count(usize);
    impl std::io::Write for Count {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0 += buf.len();
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut count = Count(0);
    // Writing into a counter cannot fail; a value that cannot be written counts nothing.
    let _ = serde_json::to_writer(&mut count, value);
    count.0
}

/// The estimated tokens of a request's system prompt and messages (the tools'
/// definitions are [`tools_estimate`]): a token per four bytes of each message as JSON
/// (a tool result's own JSON escaped in it, as on the wire), and a few for its framing.
pub fn estimate(system: &str, messages: &[Message]) -> u64 {
    let framing = 4;
    bytes_to_tokens(system.len())
        + messages
            .iter()
            .map(|m| bytes_to_tokens(json_len(m)) + framing)
            .sum::<u64>()
}

fn bytes_to_tokens(bytes: usize) -> u64 {
    (bytes as u64).div_ceil(4)
}

/// Step 1: replaces every tool result the model has answered since (all but those after
/// the last assistant message) by its evidence id and a one-line summary. Returns how
/// many were replaced.
pub fn compact_tool_results(messages: &mut [Message]) -> usize {
    let unread_from = messages
        .iter()
        .rposition(|m| m.role == Role::Assistant)
        .unwrap_or(0);
    let mut replaced = 0;
    for m in &mut messages[..unread_from] {
        if m.role != Role::Tool {
            continue;
        }
        let Some(compacted) = compact_outcome(&m.content) else {
            continue;
        };
        m.content = compacted;
        replaced += 1;
    }
    replaced
}

/// A tool result's content compacted, or `None` when it is compacted already or too
/// short to gain anything.
fn compact_outcome(content: &str) -> Option<String> {
    if content.len() <= SUMMARY_CHARS + 64 {
        return None;
    }
    let value: Value = serde_json::from_str(content).unwrap_or(Value::Null);
    if value.get(COMPACTED).is_some() {
        return None;
    }
    let compacted = match ToolOutcome::from_content(content) {
        Ok(outcome) => {
            let line = match (&outcome.output, &outcome.error) {
                (_, Some(error)) => one_line(error),
                (Some(output), None) => one_line(&output.to_string()),
                (None, None) => String::new(),
            };
            json!({
                "success": outcome.success,
                "evidence_id": outcome.evidence_id,
                COMPACTED: line,
            })
        }
        Err(_) => json!({ COMPACTED: one_line(content) }),
    };
    Some(compacted.to_string())
}

/// `text` on one line, cut to [`SUMMARY_CHARS`] characters with an ellipsis.
fn one_line(text: &str) -> String {
    let flat: String = text
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    if flat.chars().count() <= SUMMARY_CHARS {
        return flat;
    }
    let mut cut: String = flat.chars().take(SUMMARY_CHARS).collect();
    cut.push('…');
    cut
}

/// Step 2: where to cut the conversation for a summary. `messages[1..cut]` (the turns
/// after the task) are summarised, `messages[cut..]` (the last two turns) kept; `None`
/// when there are too few turns to summarise.
pub fn summary_cut(messages: &[Message]) -> Option<usize> {
    let turns: Vec<usize> = messages
        .iter()
        .enumerate()
        .skip(1)
        .filter(|(_, m)| m.role == Role::Assistant)
        .map(|(i, _)| i)
        .collect();
    if turns.len() < 3 {
        return None;
    }
    Some(turns[turns.len() - 2])
}

/// What the summarising model call is told.
pub const SUMMARY_INSTRUCTIONS: &str = "You compress the history of an investigation so it \
can go on in a shorter context. Summarise the conversation you are given: what was asked, \
which tools were called with what, and what each found. Keep every evidence id exactly as \
written, with what it showed. Answer with the summary only.";

/// The one message the summarising call sends: the turns to summarise, as text, cut to
/// `max_bytes`.
pub fn summary_prompt(turns: &[Message], max_bytes: usize) -> String {
    let mut text = String::from("The conversation to summarise:\n\n");
    for m in turns {
        let who = match m.role {
            Role::System => "system",
            Role::User => "user",
            Role::Assistant => "assistant",
            Role::Tool => "tool result",
        };
        text.push_str(who);
        text.push_str(": ");
        text.push_str(&m.content);
        for c in &m.tool_calls {
            text.push_str(&format!("\n  calls {} {}", c.name, c.arguments));
        }
        text.push('\n');
    }
    if text.len() > max_bytes {
        let mut at = max_bytes;
        while !text.is_char_boundary(at) {
            at -= 1;
        }
        text.truncate(at);
        text.push_str("\n[cut: the rest did not fit]");
    }
    text
}

/// The conversation after a summary: the task, the summary, and the kept turns.
pub fn summarised(messages: &[Message], cut: usize, summary: &str) -> Vec<Message> {
    let mut out = Vec::with_capacity(messages.len() - cut + 2);
    out.push(messages[0].clone());
    out.push(Message::user(format!(
        "Summary of the earlier turns, compacted to fit the context window:\n{summary}"
    )));
    out.extend_from_slice(&messages[cut..]);
    out
}

/// What a compaction must fit, and how hard it must try.
#[derive(Debug, Clone, Copy)]
pub(super) struct Fit<'a> {
    /// The turn it is made before.
    pub turn: u32,
    /// The tokens the system prompt and messages may use.
    pub limit: u64,
    /// The system prompt the turn is sent with.
    pub system: &'a str,
    /// Both steps, whatever the estimate (the model refused the request as too long).
    pub force: bool,
}

/// Tokens the summarising call may answer with at most.
const SUMMARY_MAX_TOKENS: u32 = 1024;

impl Agent {
    /// Fits `messages` under the limit before a turn ([`Fit`]): step 1, then step 2 if
    /// step 1 was not enough, or both steps at once when forced (the model refused the
    /// request as too long). What changed is recorded: the next turn restates the
    /// conversation, and a summary is a `model_turn` of kind `compaction`.
    pub(super) async fn compact(
        &self,
        ctx: &TaskContext<'_>,
        messages: &mut Vec<Message>,
        chain: &mut TurnChain,
        fit: Fit<'_>,
        progress: &Mutex<Progress>,
    ) -> Result<(), LoopEnd> {
        let Fit {
            turn,
            limit,
            system,
            force,
        } = fit;
        let profile = &self.profile.profile;
        let replaced = compact_tool_results(messages);
        if replaced > 0 {
            chain.rewritten("tool results compacted");
            tracing::info!(
                delegation_id = %ctx.task.delegation_id,
                turn,
                replaced,
                "older tool results compacted to fit the context window"
            );
        }
        if !force && estimate(system, messages) <= limit {
            return Ok(());
        }
        let Some(cut) = summary_cut(messages) else {
            return Ok(());
        };
        // The summarising call must fit the window itself: its prompt is cut to what
        // the window holds, less its answer.
        let window = u64::from(self.profile.context_window());
        let room = window
            .saturating_sub(u64::from(SUMMARY_MAX_TOKENS))
            .saturating_sub(estimate(SUMMARY_INSTRUCTIONS, &[]) + 16);
        let max_bytes = usize::try_from(room.saturating_mul(4)).unwrap_or(usize::MAX);
        let request = ModelRequest {
            model: profile.model.clone(),
            system: SUMMARY_INSTRUCTIONS.to_owned(),
            messages: vec![Message::user(summary_prompt(&messages[1..cut], max_bytes))],
            tools: Vec::new(),
            max_tokens: SUMMARY_MAX_TOKENS,
            temperature: 0.0,
        };
        let response = match self.complete(&request).await {
            Ok(response) => response,
            Err(e) if e.context_exceeded => {
                return Err(LoopEnd::ContextExhausted(format!(
                    "even the summary of the older turns does not fit the model's context \
                     window ({e}); raise the profile's context_window if the model has a \
                     larger one"
                )));
            }
            Err(e) => return Err(LoopEnd::Provider(e)),
        };
        self.charge(progress, &response);
        if self.provider.records_turns() {
            self.record_turn(
                ctx,
                chain,
                (turn, TurnKind::Compaction),
                &request,
                &response,
            )
            .await
            .map_err(LoopEnd::Infra)?;
        }
        let summarised_turns = messages[1..cut]
            .iter()
            .filter(|m| m.role == Role::Assistant)
            .count();
        *messages = summarised(messages, cut, &response.message.content);
        chain.rewritten("older turns summarised");
        tracing::info!(
            delegation_id = %ctx.task.delegation_id,
            turn,
            summarised_turns,
            "older turns summarised to fit the context window"
        );
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::provider::ToolCall;

    fn outcome(n: usize) -> String {
        ToolOutcome::success(
            format!("logs://payment-api/run/del/call_{n}"),
            json!({"lines": (0..20).map(|i| format!("line {i} of a long log")).collect::<Vec<_>>()}),
        )
        .to_content()
    }

    fn turn(n: usize) -> Vec<Message> {
        vec![
            Message::tool_calls(vec![ToolCall {
                id: format!("call_{n}"),
                name: "search_logs@1".into(),
                arguments: json!({"service": "payment-api"}),
            }]),
            Message::tool_result(format!("call_{n}"), outcome(n)),
        ]
    }

    fn conversation(turns: usize) -> Vec<Message> {
        let mut messages = vec![Message::user("the task")];
        for n in 0..turns {
            messages.extend(turn(n));
        }
        messages
    }

    #[test]
    fn well_known_models_have_their_windows_and_others_the_default() {
        assert_eq!(default_window("gpt-4o-mini"), 128_000);
        assert_eq!(default_window("openai/gpt-4.1-mini"), 1_047_576);
        assert_eq!(default_window("gpt-4"), 8_192);
        assert_eq!(default_window("llama3.1:8b"), 131_072);
        assert_eq!(default_window("Qwen2.5-7B-Instruct"), 32_768);
        assert_eq!(default_window("my-finetune"), DEFAULT_CONTEXT_WINDOW);
        assert_eq!(request_limit(4096, 1024), 3072);
        assert_eq!(request_limit(1000, 4096), 500);
    }

    #[test]
    fn read_tool_results_become_their_evidence_id_and_one_line() {
        let mut messages = conversation(3);
        let before = estimate("", &messages);
        // The last result has not been read yet: it stays whole.
        assert_eq!(compact_tool_results(&mut messages), 2);
        let first: Value = serde_json::from_str(&messages[2].content).unwrap();
        assert_eq!(first["evidence_id"], "logs://payment-api/run/del/call_0");
        assert_eq!(first["success"], true);
        let line = first[COMPACTED].as_str().unwrap();
        assert!(
            line.chars().count() <= SUMMARY_CHARS + 1 && line.ends_with('…'),
            "{line}"
        );
        assert_eq!(messages[6].content, outcome(2));
        assert!(estimate("", &messages) < before);
        // Compacting again changes nothing.
        assert_eq!(compact_tool_results(&mut messages), 0);
    }

    #[test]
    fn a_summary_keeps_the_task_and_the_last_two_turns() {
        let messages = conversation(2);
        assert_eq!(
            summary_cut(&messages),
            None,
            "two turns: nothing to summarise"
        );
        let messages = conversation(5);
        let cut = summary_cut(&messages).unwrap();
        assert_eq!(cut, 7);
        let after = summarised(&messages, cut, "they searched the logs");
        assert_eq!(after.len(), 2 + 4);
        assert_eq!(after[0].content, "the task");
        assert!(after[1].content.contains("they searched the logs"));
        assert_eq!(after[2].tool_calls[0].id, "call_3");
        // Every kept tool result still follows the call it answers.
        assert_eq!(after[3].tool_call_id.as_deref(), Some("call_3"));
    }

    #[test]
    fn the_summary_prompt_is_cut_to_its_limit_on_a_character_boundary() {
        let turns = vec![Message::user("é".repeat(1000))];
        let prompt = summary_prompt(&turns, 101);
        assert!(prompt.len() <= 101 + 40, "{}", prompt.len());
        assert!(prompt.ends_with("[cut: the rest did not fit]"));
    }
}
