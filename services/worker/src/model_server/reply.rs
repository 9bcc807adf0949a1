//! [`Reply`], what a responder answers, and the HTTP responses it becomes: a
//! `chat.completion` object exactly as OpenAI returns it, or an OpenAI-shaped error.

use std::time::{Duration, UNIX_EPOCH};

use axum::body::Body;
use axum::http::header::CONTENT_TYPE;
use axum::http::{HeaderName, HeaderValue, StatusCode};
use axum::response::Response;
use serde::Serialize;
use serde_json::Value;

use super::{DEFAULT_COMPLETION_TOKENS, DEFAULT_PROMPT_TOKENS, SYSTEM_FINGERPRINT};
/// The answer to one request. Built with [`Reply::text`], [`Reply::tool_calls`],
/// [`Reply::error`], [`Reply::delayed`], [`Reply::hang`] or [`Reply::disconnect`], and
/// adjusted with the `with_*` methods.
#[derive(Debug, Clone)]
pub struct Reply {
    pub(super) kind: Kind,
    pub(super) headers: Vec<(String, String)>,
}

#[derive(Debug, Clone)]
pub(super) enum Kind {
    Completion(Completion),
    Error { status: u16, body: ErrorBody },
    Delayed(Duration, Box<Reply>),
    Hang,
    Disconnect,
}

#[derive(Debug, Clone)]
pub(super) struct Completion {
    content: Option<String>,
    tool_calls: Vec<ToolCall>,
    finish_reason: String,
    prompt_tokens: u32,
    completion_tokens: u32,
}

/// An error reply's body: what [`Reply::error`] takes.
#[derive(Debug, Clone)]
pub enum ErrorBody {
    /// The message of an OpenAI-shaped error,
    /// `{"error":{"message":…,"type":…,"param":null,"code":…}}`, whose `type` and `code`
    /// follow the status: 429 is `requests`/`rate_limit_exceeded`, 5xx `server_error`,
    /// any other `invalid_request_error` (code null). From a `&str` or `String`.
    Message(String),
    /// A JSON body sent as is. From a [`serde_json::Value`].
    Json(Value),
    /// A body sent as is, as `text/plain` (e.g. a proxy's error page).
    Raw(String),
}

impl ErrorBody {
    /// A body sent as is, as `text/plain`.
    pub fn raw(text: impl Into<String>) -> Self {
        Self::Raw(text.into())
    }
}

impl From<&str> for ErrorBody {
    fn from(message: &str) -> Self {
        Self::Message(message.to_owned())
    }
}

impl From<String> for ErrorBody {
    fn from(message: String) -> Self {
        Self::Message(message)
    }
}

impl From<Value> for ErrorBody {
    fn from(body: Value) -> Self {
        Self::Json(body)
    }
}

impl Reply {
    fn of(kind: Kind) -> Self {
        Self {
            kind,
            headers: Vec::new(),
        }
    }

    fn completion(content: Option<String>, tool_calls: Vec<ToolCall>, finish: &str) -> Self {
        Self::of(Kind::Completion(Completion {
            content,
            tool_calls,
            finish_reason: finish.to_owned(),
            prompt_tokens: DEFAULT_PROMPT_TOKENS,
            completion_tokens: DEFAULT_COMPLETION_TOKENS,
        }))
    }

    /// An assistant message asking for tool calls, each `(call id, function name,
    /// arguments)`; the arguments are JSON text, sent as a string as the real API does
    /// (and not checked, so a test can send malformed ones). `finish_reason` is
    /// `tool_calls`, the content null.
    pub fn tool_calls<I, A, B, C>(calls: I) -> Self
    where
        I: IntoIterator<Item = (A, B, C)>,
        A: Into<String>,
        B: Into<String>,
        C: Into<String>,
    {
        let calls = calls
            .into_iter()
            .map(|(id, name, arguments)| ToolCall {
                id: id.into(),
                kind: "function",
                function: FunctionCall {
                    name: name.into(),
                    arguments: arguments.into(),
                },
            })
            .collect();
        Self::completion(None, calls, "tool_calls")
    }

    /// A plain assistant message, `finish_reason` `stop`.
    pub fn text(content: impl Into<String>) -> Self {
        Self::completion(Some(content.into()), Vec::new(), "stop")
    }

    /// An HTTP error with `status`: an OpenAI-shaped error from a message (`&str` or
    /// `String`), a JSON body as is, or [`ErrorBody::raw`] text. A status outside
    /// 100..=999 is answered with a 500 saying so.
    pub fn error(status: u16, body: impl Into<ErrorBody>) -> Self {
        Self::of(Kind::Error {
            status,
            body: body.into(),
        })
    }

    /// `reply`, after waiting `delay` (cut short by shutdown, which drops the
    /// connection instead).
    pub fn delayed(delay: Duration, reply: Reply) -> Self {
        Self::of(Kind::Delayed(delay, Box::new(reply)))
    }

    /// No answer: the request waits until the server shuts down, which then drops the
    /// connection. For deadline and cancellation tests.
    pub fn hang() -> Self {
        Self::of(Kind::Hang)
    }

    /// The connection is closed without any HTTP response: the client sees a transport
    /// error (the connection closed before a response), never a status. Later requests
    /// are served on new connections.
    pub fn disconnect() -> Self {
        Self::of(Kind::Disconnect)
    }

    /// The reply's `usage` (`total_tokens` is their sum). Without it:
    /// [`DEFAULT_PROMPT_TOKENS`] and [`DEFAULT_COMPLETION_TOKENS`]. Only for
    /// completions (also inside [`Reply::delayed`]); ignored by other replies.
    pub fn with_usage(mut self, prompt_tokens: u32, completion_tokens: u32) -> Self {
        if let Some(completion) = self.completion_mut() {
            completion.prompt_tokens = prompt_tokens;
            completion.completion_tokens = completion_tokens;
        }
        self
    }

    /// Overrides `finish_reason` (e.g. `length`). Only for completions (also inside
    /// [`Reply::delayed`]); ignored by other replies.
    pub fn with_finish_reason(mut self, finish_reason: impl Into<String>) -> Self {
        if let Some(completion) = self.completion_mut() {
            completion.finish_reason = finish_reason.into();
        }
        self
    }

    /// Sets the message content, also beside tool calls (as some models send). Only for
    /// completions (also inside [`Reply::delayed`]); ignored by other replies.
    pub fn with_content(mut self, content: impl Into<String>) -> Self {
        if let Some(completion) = self.completion_mut() {
            completion.content = Some(content.into());
        }
        self
    }

    /// Adds a response header (e.g. `Retry-After: 1` on a 429). A name or value that is
    /// not valid HTTP turns the reply into a 500 saying which. Ignored by
    /// [`Reply::hang`] and [`Reply::disconnect`].
    pub fn with_header(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.headers.push((name.into(), value.into()));
        self
    }

    fn completion_mut(&mut self) -> Option<&mut Completion> {
        match &mut self.kind {
            Kind::Completion(completion) => Some(completion),
            Kind::Delayed(_, inner) => inner.completion_mut(),
            _ => None,
        }
    }
}

#[derive(Debug, Clone, Serialize)]
struct ToolCall {
    id: String,
    #[serde(rename = "type")]
    kind: &'static str,
    function: FunctionCall,
}

#[derive(Debug, Clone, Serialize)]
struct FunctionCall {
    name: String,
    arguments: String,
}

/// A `chat.completion` object as OpenAI returns it, borrowed from a [`Completion`].
#[derive(Serialize)]
struct CompletionBody<'a> {
    id: String,
    object: &'static str,
    created: u64,
    model: &'a str,
    choices: [Choice<'a>; 1],
    usage: Usage,
    service_tier: &'static str,
    system_fingerprint: &'static str,
}

#[derive(Serialize)]
struct Choice<'a> {
    index: u32,
    message: Message<'a>,
    finish_reason: &'a str,
    logprobs: Option<()>,
}

#[derive(Serialize)]
struct Message<'a> {
    role: &'static str,
    content: Option<&'a str>,
    #[serde(skip_serializing_if = "<[_]>::is_empty")]
    tool_calls: &'a [ToolCall],
    refusal: Option<()>,
    annotations: [(); 0],
}

#[derive(Serialize)]
struct Usage {
    prompt_tokens: u32,
    completion_tokens: u32,
    total_tokens: u32,
    prompt_tokens_details: PromptDetails,
    completion_tokens_details: CompletionDetails,
}

#[derive(Serialize)]
struct PromptDetails {
    cached_tokens: u32,
    audio_tokens: u32,
}

#[derive(Serialize)]
struct CompletionDetails {
    reasoning_tokens: u32,
    audio_tokens: u32,
    accepted_prediction_tokens: u32,
    rejected_prediction_tokens: u32,
}

/// The JSON of `completion` as the answer to request `index`, naming `model`.
pub(super) fn completion_json(
    completion: &Completion,
    model: &str,
    index: usize,
) -> serde_json::Result<Vec<u8>> {
    let created = created_now();
    serde_json::to_vec(&CompletionBody {
        id: format!("chatcmpl-{index}"),
        object: "chat.completion",
        created,
        model,
        choices: [Choice {
            index: 0,
            message: Message {
                role: "assistant",
                content: completion.content.as_deref(),
                tool_calls: &completion.tool_calls,
                refusal: None,
                annotations: [],
            },
            finish_reason: &completion.finish_reason,
            logprobs: None,
        }],
        usage: Usage {
            prompt_tokens: completion.prompt_tokens,
            completion_tokens: completion.completion_tokens,
            total_tokens: completion
                .prompt_tokens
                .saturating_add(completion.completion_tokens),
            prompt_tokens_details: PromptDetails {
                cached_tokens: 0,
                audio_tokens: 0,
            },
            completion_tokens_details: CompletionDetails {
                reasoning_tokens: 0,
                audio_tokens: 0,
                accepted_prediction_tokens: 0,
                rejected_prediction_tokens: 0,
            },
        },
        service_tier: "default",
        system_fingerprint: SYSTEM_FINGERPRINT,
    })
}

/// A completion's `created`: the Unix second it is answered in.
fn created_now() -> u64 {
    convene_core::time::Clock::system()
        .now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |elapsed| elapsed.as_secs())
}

/// Characters of content one streamed chunk carries at most.
const STREAM_PIECE: usize = 4096;

/// `text` in pieces of at most `max` characters (one empty piece for an empty text).
fn pieces(text: &str, max: usize) -> Vec<&str> {
    let mut out = Vec::new();
    let mut rest = text;
    while rest.chars().count() > max {
        let cut = rest.char_indices().nth(max).map_or(rest.len(), |(i, _)| i);
        let (piece, tail) = rest.split_at(cut);
        out.push(piece);
        rest = tail;
    }
    out.push(rest);
    out
}

/// `completion` as the answer to request `index`, naming `model`, streamed as OpenAI
/// streams it: server-sent `chat.completion.chunk` events (the role, the content in
/// pieces, each tool call's id and name and then its arguments in two halves, the
/// finish reason), the usage in a last chunk without choices when `include_usage`, and
/// `data: [DONE]`.
pub(super) fn completion_sse(
    completion: &Completion,
    model: &str,
    index: usize,
    include_usage: bool,
) -> Vec<u8> {
    let created = created_now();
    let id = format!("chatcmpl-{index}");
    let mut body = Vec::new();
    let mut event = |choices: Value, usage: Value| {
        let chunk = serde_json::json!({
            "id": id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "system_fingerprint": SYSTEM_FINGERPRINT,
            "choices": choices,
            "usage": usage,
        });
        body.extend_from_slice(b"data: ");
        body.extend_from_slice(chunk.to_string().as_bytes());
        body.extend_from_slice(b"\n\n");
    };
    let delta = |delta: Value| serde_json::json!([{ "index": 0, "delta": delta, "logprobs": null, "finish_reason": null }]);
    event(
        delta(serde_json::json!({"role": "assistant", "content": ""})),
        Value::Null,
    );
    if let Some(content) = &completion.content {
        for piece in pieces(content, STREAM_PIECE) {
            event(delta(serde_json::json!({ "content": piece })), Value::Null);
        }
    }
    for (i, call) in completion.tool_calls.iter().enumerate() {
        event(
            delta(serde_json::json!({"tool_calls": [{
                "index": i,
                "id": call.id,
                "type": call.kind,
                "function": {"name": call.function.name, "arguments": ""},
            }]})),
            Value::Null,
        );
        let half = call.function.arguments.chars().count().div_ceil(2).max(1);
        for piece in pieces(&call.function.arguments, half) {
            event(
                delta(serde_json::json!({"tool_calls": [{
                    "index": i,
                    "function": {"arguments": piece},
                }]})),
                Value::Null,
            );
        }
    }
    event(
        serde_json::json!([{ "index": 0, "delta": {}, "logprobs": null, "finish_reason": completion.finish_reason }]),
        Value::Null,
    );
    if include_usage {
        event(
            serde_json::json!([]),
            serde_json::json!({
                "prompt_tokens": completion.prompt_tokens,
                "completion_tokens": completion.completion_tokens,
                "total_tokens": completion.prompt_tokens.saturating_add(completion.completion_tokens),
            }),
        );
    }
    body.extend_from_slice(b"data: [DONE]\n\n");
    body
}

/// A streamed answer's response: `text/event-stream`.
pub(super) fn sse_response(body: Vec<u8>) -> Response {
    response(StatusCode::OK, "text/event-stream", body)
}

/// The OpenAI-shaped error body for `message` under `status`.
fn error_json(status: StatusCode, message: &str) -> Vec<u8> {
    let (kind, code) = match status.as_u16() {
        429 => ("requests", Value::from("rate_limit_exceeded")),
        500..=599 => ("server_error", Value::Null),
        _ => ("invalid_request_error", Value::Null),
    };
    serde_json::json!({
        "error": { "message": message, "type": kind, "param": null, "code": code }
    })
    .to_string()
    .into_bytes()
}

fn response(status: StatusCode, content_type: &'static str, body: impl Into<Body>) -> Response {
    let mut response = Response::new(body.into());
    *response.status_mut() = status;
    response
        .headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    response
}

pub(super) fn json_response(status: StatusCode, body: impl Into<Body>) -> Response {
    response(status, "application/json", body)
}

pub(super) fn error_response(status: StatusCode, message: &str) -> Response {
    json_response(status, error_json(status, message))
}

/// The response to an error reply.
pub(super) fn error_reply(status: u16, body: ErrorBody) -> Response {
    let Ok(status) = StatusCode::from_u16(status) else {
        return error_response(
            StatusCode::INTERNAL_SERVER_ERROR,
            &format!(
                "the scripted error reply has status {status}, which is not an HTTP status (100..=999): fix the script"
            ),
        );
    };
    match body {
        ErrorBody::Message(message) => error_response(status, &message),
        ErrorBody::Json(body) => json_response(status, body.to_string()),
        ErrorBody::Raw(text) => response(status, "text/plain; charset=utf-8", text),
    }
}

/// Adds a reply's headers to `response`, or answers a 500 naming an invalid one.
pub(super) fn with_headers(mut response: Response, headers: Vec<(String, String)>) -> Response {
    for (name, value) in headers {
        match (
            HeaderName::try_from(name.as_str()),
            HeaderValue::try_from(value.as_str()),
        ) {
            (Ok(name), Ok(value)) => {
                response.headers_mut().append(name, value);
            }
            _ => {
                return error_response(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    &format!(
                        "the scripted reply's header {name:?}: {value:?} is not valid HTTP: fix the script"
                    ),
                );
            }
        }
    }
    response
}

#[cfg(test)]
mod tests {
    use async_openai::error::WrappedError;
    use async_openai::types::chat::{
        ChatCompletionMessageToolCalls, CreateChatCompletionResponse, FinishReason, Role,
    };

    use super::*;

    fn completion(reply: Reply) -> Completion {
        match reply.kind {
            Kind::Completion(completion) => completion,
            Kind::Delayed(_, inner) => completion(*inner),
            other => panic!("not a completion: {other:?}"),
        }
    }

    /// The body `reply` is sent as, raw and as async-openai reads it.
    fn encode(reply: Reply) -> (Value, CreateChatCompletionResponse) {
        let body = completion_json(&completion(reply), "gpt-test", 3).unwrap();
        (
            serde_json::from_slice(&body).unwrap(),
            serde_json::from_slice(&body).unwrap(),
        )
    }

    async fn body_of(response: Response) -> (StatusCode, Option<String>, Vec<u8>) {
        let status = response.status();
        let content_type = response
            .headers()
            .get(CONTENT_TYPE)
            .map(|v| v.to_str().unwrap().to_owned());
        let body = axum::body::to_bytes(response.into_body(), usize::MAX)
            .await
            .unwrap();
        (status, content_type, body.to_vec())
    }

    #[test]
    #[allow(deprecated)] // `system_fingerprint` is deprecated in the API, still sent
    fn a_text_reply_is_a_complete_chat_completion() {
        let (raw, parsed) = encode(Reply::text("all done"));
        assert_eq!(parsed.id, "chatcmpl-3");
        assert_eq!(parsed.object, "chat.completion");
        assert_eq!(parsed.model, "gpt-test");
        assert!(
            parsed.created > 1_700_000_000,
            "unix seconds: {}",
            parsed.created
        );
        assert_eq!(
            parsed.system_fingerprint.as_deref(),
            Some(SYSTEM_FINGERPRINT)
        );
        let [choice] = parsed.choices.as_slice() else {
            panic!("one choice: {parsed:?}")
        };
        assert_eq!(choice.index, 0);
        assert_eq!(choice.message.role, Role::Assistant);
        assert_eq!(choice.message.content.as_deref(), Some("all done"));
        assert_eq!(choice.message.tool_calls, None);
        assert_eq!(choice.message.refusal, None);
        assert_eq!(choice.finish_reason, Some(FinishReason::Stop));
        let usage = parsed.usage.unwrap();
        assert_eq!(
            (
                usage.prompt_tokens,
                usage.completion_tokens,
                usage.total_tokens
            ),
            (
                DEFAULT_PROMPT_TOKENS,
                DEFAULT_COMPLETION_TOKENS,
                DEFAULT_PROMPT_TOKENS + DEFAULT_COMPLETION_TOKENS
            )
        );
        // The nulls OpenAI sends are present, not left out.
        let choice = &raw["choices"][0];
        assert_eq!(choice["logprobs"], Value::Null);
        assert_eq!(choice["message"]["refusal"], Value::Null);
        assert!(choice["message"].get("tool_calls").is_none());
    }

    #[test]
    fn a_tool_call_reply_sends_arguments_as_a_json_string() {
        let (raw, parsed) = encode(
            Reply::tool_calls(vec![
                ("call_1", "read_file", r#"{"path":"a.log"}"#),
                ("call_2", "search_logs", "{}"),
            ])
            .with_usage(120, 30),
        );
        let choice = &parsed.choices[0];
        assert_eq!(choice.finish_reason, Some(FinishReason::ToolCalls));
        assert_eq!(choice.message.content, None);
        let calls: Vec<_> = choice
            .message
            .tool_calls
            .as_deref()
            .unwrap()
            .iter()
            .map(|call| match call {
                ChatCompletionMessageToolCalls::Function(call) => (
                    call.id.as_str(),
                    call.function.name.as_str(),
                    call.function.arguments.as_str(),
                ),
                other => panic!("a function call: {other:?}"),
            })
            .collect();
        assert_eq!(
            calls,
            [
                ("call_1", "read_file", r#"{"path":"a.log"}"#),
                ("call_2", "search_logs", "{}")
            ]
        );
        let usage = parsed.usage.unwrap();
        assert_eq!(
            (
                usage.prompt_tokens,
                usage.completion_tokens,
                usage.total_tokens
            ),
            (120, 30, 150)
        );
        let message = &raw["choices"][0]["message"];
        assert_eq!(message["content"], Value::Null);
        assert_eq!(message["tool_calls"][0]["type"], "function");
        assert_eq!(
            message["tool_calls"][0]["function"]["arguments"],
            r#"{"path":"a.log"}"#
        );
    }

    #[test]
    fn adjustments_reach_a_delayed_completion() {
        let reply = Reply::delayed(
            Duration::from_secs(1),
            Reply::tool_calls(vec![("c", "f", "{}")]),
        )
        .with_finish_reason("length")
        .with_usage(1, 2)
        .with_content("thinking aloud");
        let (_, parsed) = encode(reply);
        let choice = &parsed.choices[0];
        assert_eq!(choice.finish_reason, Some(FinishReason::Length));
        assert_eq!(choice.message.content.as_deref(), Some("thinking aloud"));
        assert_eq!(choice.message.tool_calls.as_ref().map(Vec::len), Some(1));
        assert_eq!(parsed.usage.unwrap().total_tokens, 3);
        // Replies that are not completions ignore them.
        let hang = Reply::hang().with_usage(1, 2).with_finish_reason("stop");
        assert!(matches!(hang.kind, Kind::Hang));
    }

    #[tokio::test]
    async fn error_messages_are_openai_errors_typed_by_status() {
        for (status, kind, code) in [
            (400, "invalid_request_error", None),
            (401, "invalid_request_error", None),
            (429, "requests", Some("rate_limit_exceeded")),
            (503, "server_error", None),
        ] {
            let (got, content_type, body) =
                body_of(error_reply(status, ErrorBody::from("try later"))).await;
            assert_eq!(got.as_u16(), status);
            assert_eq!(content_type.as_deref(), Some("application/json"));
            let wrapped: WrappedError = serde_json::from_slice(&body).unwrap();
            assert_eq!(wrapped.error.message, "try later");
            assert_eq!(wrapped.error.r#type.as_deref(), Some(kind));
            assert_eq!(wrapped.error.code.as_deref(), code);
            assert_eq!(wrapped.error.param, None);
            let raw: Value = serde_json::from_slice(&body).unwrap();
            assert_eq!(raw["error"]["param"], Value::Null, "param is sent, as null");
        }
    }

    #[tokio::test]
    async fn error_bodies_can_be_any_json_or_raw_text() {
        let json = serde_json::json!({"error": {"message": "custom", "type": "x"}});
        let (status, content_type, body) =
            body_of(error_reply(400, ErrorBody::from(json.clone()))).await;
        assert_eq!(status, StatusCode::BAD_REQUEST);
        assert_eq!(content_type.as_deref(), Some("application/json"));
        assert_eq!(serde_json::from_slice::<Value>(&body).unwrap(), json);

        let (status, content_type, body) =
            body_of(error_reply(502, ErrorBody::raw("<html>bad gateway</html>"))).await;
        assert_eq!(status, StatusCode::BAD_GATEWAY);
        assert_eq!(content_type.as_deref(), Some("text/plain; charset=utf-8"));
        assert_eq!(body, b"<html>bad gateway</html>");
    }

    #[tokio::test]
    async fn a_broken_script_is_answered_with_a_500_that_says_what_to_fix() {
        let (status, _, body) = body_of(error_reply(42, ErrorBody::from("x"))).await;
        assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
        let wrapped: WrappedError = serde_json::from_slice(&body).unwrap();
        assert!(
            wrapped.error.message.contains("status 42"),
            "{}",
            wrapped.error.message
        );

        let response = with_headers(
            json_response(StatusCode::OK, "{}"),
            vec![("Bad Header".to_owned(), "1".to_owned())],
        );
        let (status, _, body) = body_of(response).await;
        assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
        let wrapped: WrappedError = serde_json::from_slice(&body).unwrap();
        assert!(
            wrapped.error.message.contains("Bad Header"),
            "{}",
            wrapped.error.message
        );

        let response = with_headers(
            json_response(StatusCode::TOO_MANY_REQUESTS, "{}"),
            vec![("Retry-After".to_owned(), "1".to_owned())],
        );
        assert_eq!(response.headers()["retry-after"], "1");
    }
}
