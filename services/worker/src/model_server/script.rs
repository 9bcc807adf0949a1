//! What the server shows a responder and keeps: [`Recorded`] requests and their
//! helpers; the [`Responder`] trait and the queue responder [`Script`].

use std::collections::VecDeque;
use std::sync::Mutex;
use std::time::Instant;

use axum::http::HeaderMap;
use axum::http::header::AUTHORIZATION;
use serde_json::Value;

use super::{Reply, lock};

/// Decides the answer to each chat-completions request. Implemented by [`Script`] and by
/// every closure `Fn(&Recorded) -> Reply`.
///
/// Called once per request that has a JSON body, in the request's task, without any
/// lock held: a responder may call [`ScriptedModel::requests`](super::ScriptedModel::requests).
pub trait Responder: Send + Sync + 'static {
    /// The reply to `request`.
    fn reply(&self, request: &Recorded) -> Reply;
}

impl<F> Responder for F
where
    F: Fn(&Recorded) -> Reply + Send + Sync + 'static,
{
    fn reply(&self, request: &Recorded) -> Reply {
        self(request)
    }
}

/// A queue of replies given in order, one per request. Once it is empty every request
/// gets a 500 whose error message says the script ran out and how many requests came,
/// so a test that fails that way says why.
#[derive(Debug)]
pub struct Script {
    replies: Mutex<VecDeque<Reply>>,
    scripted: usize,
}

impl Script {
    /// A script answering with `replies`, first to last.
    pub fn new(replies: Vec<Reply>) -> Self {
        Self {
            scripted: replies.len(),
            replies: Mutex::new(replies.into()),
        }
    }

    /// How many replies are still queued.
    pub fn remaining(&self) -> usize {
        lock(&self.replies).len()
    }
}

impl Responder for Script {
    fn reply(&self, request: &Recorded) -> Reply {
        let next = lock(&self.replies).pop_front();
        next.unwrap_or_else(|| {
            let received = request.index + 1;
            Reply::error(
                500,
                format!(
                    "the script has no more replies: it held {}, and {received} requests \
                     were received; add a reply for this request or find why the client \
                     asked again",
                    self.scripted
                ),
            )
        })
    }
}

/// One chat-completions request as the server received it.
#[derive(Debug, Clone)]
pub struct Recorded {
    /// Its position among the server's chat-completions requests, from 0.
    pub index: usize,
    /// Its HTTP headers; credential headers (Authorization, `api-key`, `x-api-key`) are
    /// marked sensitive, so `Debug` shows them as `Sensitive`.
    pub headers: HeaderMap,
    /// Its JSON body; `Null` when the body is not JSON (see [`Recorded::raw_body`]).
    pub body: Value,
    /// The body's text, kept only when it is not JSON (the request got a 400).
    pub raw_body: Option<String>,
    /// When it arrived.
    pub received: Instant,
}

/// One `tool` role message: the result of a tool call sent back to the model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolResult {
    /// The `tool_call_id` it answers.
    pub tool_call_id: String,
    /// Its content; content given as parts is their texts joined.
    pub content: String,
}

impl Recorded {
    /// The value of header `name` (any case), if present and text.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name)?.to_str().ok()
    }

    /// The Authorization header, if any (e.g. `Bearer <key>`).
    pub fn authorization(&self) -> Option<&str> {
        self.header(AUTHORIZATION.as_str())
    }

    /// Whether the request asks for its answer as a stream (`"stream": true`).
    pub fn streams(&self) -> bool {
        self.body.get("stream").and_then(Value::as_bool) == Some(true)
    }

    /// The `model` the request asked for.
    pub fn model(&self) -> Option<&str> {
        self.body.get("model")?.as_str()
    }

    /// The request's `messages`, as sent (empty when there are none).
    pub fn messages(&self) -> &[Value] {
        self.body
            .get("messages")
            .and_then(Value::as_array)
            .map_or(&[][..], Vec::as_slice)
    }

    /// The names of the functions offered in `tools`, in order.
    pub fn tools(&self) -> Vec<&str> {
        self.body
            .get("tools")
            .and_then(Value::as_array)
            .map(|tools| {
                tools
                    .iter()
                    .filter_map(|tool| tool.get("function")?.get("name")?.as_str())
                    .collect()
            })
            .unwrap_or_default()
    }

    /// The `tool` messages after the last `assistant` message (after none: all of
    /// them), in order: the results the client sends back for the model's latest calls.
    pub fn last_tool_results(&self) -> Vec<ToolResult> {
        let messages = self.messages();
        let after = messages
            .iter()
            .rposition(|m| role(m) == Some("assistant"))
            .map_or(0, |i| i + 1);
        messages[after..]
            .iter()
            .filter(|m| role(m) == Some("tool"))
            .map(|m| ToolResult {
                tool_call_id: m
                    .get("tool_call_id")
                    .and_then(Value::as_str)
                    .unwrap_or_default()
                    .to_owned(),
                content: m.get("content").map(content_text).unwrap_or_default(),
            })
            .collect()
    }
}

fn role(message: &Value) -> Option<&str> {
    message.get("role")?.as_str()
}

/// A message's content as text: a string as is, parts as their texts joined.
fn content_text(content: &Value) -> String {
    match content {
        Value::String(text) => text.clone(),
        Value::Array(parts) => parts
            .iter()
            .filter_map(|part| part.get("text")?.as_str())
            .collect(),
        Value::Null => String::new(),
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::super::reply::{ErrorBody, Kind};
    use super::*;

    fn recorded(index: usize, body: Value) -> Recorded {
        let mut headers = HeaderMap::new();
        let mut key = axum::http::HeaderValue::from_static("Bearer sk-secret");
        key.set_sensitive(true);
        headers.insert(AUTHORIZATION, key);
        Recorded {
            index,
            headers,
            body,
            raw_body: None,
            received: Instant::now(),
        }
    }

    #[test]
    fn helpers_read_the_request() {
        let request = recorded(
            0,
            json!({
                "model": "gpt-test",
                "messages": [
                    {"role": "system", "content": "be brief"},
                    {"role": "user", "content": "why did payments fail?"},
                    {"role": "assistant", "content": null, "tool_calls": [
                        {"id": "old", "type": "function", "function": {"name": "f", "arguments": "{}"}}
                    ]},
                    {"role": "tool", "tool_call_id": "old", "content": "stale"},
                    {"role": "assistant", "content": null, "tool_calls": [
                        {"id": "call_1", "type": "function", "function": {"name": "read_file", "arguments": "{}"}},
                        {"id": "call_2", "type": "function", "function": {"name": "search_logs", "arguments": "{}"}}
                    ]},
                    {"role": "tool", "tool_call_id": "call_1", "content": "line 1"},
                    {"role": "tool", "tool_call_id": "call_2", "content": [
                        {"type": "text", "text": "part a, "}, {"type": "text", "text": "part b"}
                    ]}
                ],
                "tools": [
                    {"type": "function", "function": {"name": "read_file", "parameters": {}}},
                    {"type": "function", "function": {"name": "search_logs", "parameters": {}}}
                ]
            }),
        );
        assert_eq!(request.model(), Some("gpt-test"));
        assert_eq!(request.messages().len(), 7);
        assert_eq!(request.tools(), ["read_file", "search_logs"]);
        assert_eq!(
            request.last_tool_results(),
            [
                ToolResult {
                    tool_call_id: "call_1".to_owned(),
                    content: "line 1".to_owned()
                },
                ToolResult {
                    tool_call_id: "call_2".to_owned(),
                    content: "part a, part b".to_owned()
                },
            ]
        );
        assert_eq!(request.authorization(), Some("Bearer sk-secret"));
        assert_eq!(request.header("AUTHORIZATION"), Some("Bearer sk-secret"));
        assert!(
            !format!("{request:?}").contains("sk-secret"),
            "a credential must not show in Debug output"
        );
    }

    #[test]
    fn helpers_of_a_bare_request_are_empty() {
        let request = recorded(0, Value::Null);
        assert_eq!(request.model(), None);
        assert!(request.messages().is_empty());
        assert!(request.tools().is_empty());
        assert!(request.last_tool_results().is_empty());
        let first_turn = recorded(0, json!({"messages": [{"role": "user", "content": "hi"}]}));
        assert!(first_turn.last_tool_results().is_empty());
    }

    #[test]
    fn a_script_answers_in_order_then_says_it_ran_out() {
        let script = Script::new(vec![Reply::text("one"), Reply::hang()]);
        assert!(matches!(
            script.reply(&recorded(0, Value::Null)).kind,
            Kind::Completion(_)
        ));
        assert!(matches!(
            script.reply(&recorded(1, Value::Null)).kind,
            Kind::Hang
        ));
        assert_eq!(script.remaining(), 0);
        match script.reply(&recorded(2, Value::Null)).kind {
            Kind::Error {
                status: 500,
                body: ErrorBody::Message(message),
            } => {
                assert!(message.contains("no more replies"), "{message}");
                assert!(message.contains("it held 2"), "{message}");
                assert!(message.contains("3 requests"), "{message}");
            }
            other => panic!("a 500 saying the script ran out: {other:?}"),
        }
    }
}
