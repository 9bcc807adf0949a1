//! The HTTP client of MCP servers reached over streamable HTTP: `reqwest` as the MCP
//! client library (rmcp) drives it, with the server's bearer token masked in everything
//! that comes back.
//!
//! A server may quote the token it was sent: in a 401 answer, in a tool's result, in a
//! notification. The client library logs what it receives (at trace level every message,
//! at error level the error that ends a connection) before the worker sees any of it, so
//! the token is masked here, where answers enter the worker: in JSON answers, in every
//! event of an SSE stream and in every text an error carries. The response limits the
//! library configures (SSE event size, JSON and error body sizes) are passed on to
//! `reqwest` unchanged.
//!
//! What the library's `reqwest` client logs itself before it returns is out of reach:
//! the `Content-Type` of a successful answer it does not take, and the parse error of a
//! JSON answer to a notification or a response, which may quote a field of it. Neither
//! is masked. The session id a server assigns is not masked either: it must go back to
//! the server as it came.

use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::Arc;

use futures::StreamExt as _;
use futures::stream::BoxStream;
use reqwest::header::{HeaderName, HeaderValue};
use rmcp::model::{ClientJsonRpcMessage, ErrorData, ServerJsonRpcMessage};
use rmcp::transport::streamable_http_client::{
    AuthRequiredError, HttpStatusError, InsufficientScopeError, SseError, StreamableHttpClient,
    StreamableHttpError, StreamableHttpPostResponse, StreamableHttpResponseLimits,
};
use serde_json::Value;
use sse_stream::Sse;

/// What stands for the bearer token in a text that quoted it.
pub const REDACTED: &str = "[redacted bearer token]";

/// The shortest start of the token masked at the end of a text cut short (an error body
/// the library keeps only a prefix of): shorter ones may be chance.
const MIN_PARTIAL: usize = 4;

/// Redirects followed for one request at most.
const MAX_REDIRECTS: usize = 10;

/// A bearer token and what masks it. Its `Debug` never shows the token.
#[derive(Clone)]
pub struct Mask {
    token: Arc<str>,
    /// The token as a JSON string spells it, when that differs (a `/` may be escaped).
    escaped: Option<Arc<str>>,
}

impl std::fmt::Debug for Mask {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Mask(..)")
    }
}

impl Mask {
    /// The mask of `token`; none for an empty one.
    pub fn new(token: &str) -> Option<Self> {
        if token.is_empty() {
            return None;
        }
        let escaped = token.replace('/', "\\/");
        Some(Self {
            token: Arc::from(token),
            escaped: (escaped != token).then(|| Arc::from(escaped)),
        })
    }

    /// Whether `text` holds the token.
    pub fn is_in(&self, text: &str) -> bool {
        text.contains(&*self.token) || self.escaped.as_ref().is_some_and(|e| text.contains(&**e))
    }

    /// `text` with every occurrence of the token masked.
    pub fn text(&self, text: &str) -> String {
        if !self.is_in(text) {
            return text.to_owned();
        }
        let masked = text.replace(&*self.token, REDACTED);
        match &self.escaped {
            Some(escaped) => masked.replace(&**escaped, REDACTED),
            None => masked,
        }
    }

    /// `text` from an error, which may have been cut short: every occurrence of the token
    /// masked, and so is a start of it (of [`MIN_PARTIAL`] characters or more) at its end.
    pub fn error_text(&self, text: &str) -> String {
        let mut masked = self.text(text);
        let longest = self.token.len().min(masked.len());
        let partial = (MIN_PARTIAL..=longest).rev().find(|&n| {
            self.token.is_char_boundary(n)
                && masked.is_char_boundary(masked.len() - n)
                && masked.ends_with(&self.token[..n])
        });
        if let Some(n) = partial {
            masked.truncate(masked.len() - n);
            masked.push_str(REDACTED);
        }
        masked
    }

    /// Masks the token in every string of `value`, object keys included; whether it
    /// held the token.
    pub fn value(&self, value: &mut Value) -> bool {
        match value {
            Value::String(s) if self.is_in(s) => {
                *s = self.text(s);
                true
            }
            Value::Array(items) => items
                .iter_mut()
                .fold(false, |held, item| self.value(item) | held),
            Value::Object(map) => {
                let mut held = false;
                if map.keys().any(|k| self.is_in(k)) {
                    *map = std::mem::take(map)
                        .into_iter()
                        .map(|(k, v)| (self.text(&k), v))
                        .collect();
                    held = true;
                }
                map.values_mut()
                    .fold(held, |held, item| self.value(item) | held)
            }
            _ => false,
        }
    }

    /// A JSON text with the token masked in its strings (the text as it is, should it
    /// not be JSON).
    fn json_text(&self, text: &str) -> String {
        if !self.is_in(text) {
            return text.to_owned();
        }
        match serde_json::from_str::<Value>(text) {
            Ok(mut value) => {
                self.value(&mut value);
                value.to_string()
            }
            Err(_) => self.text(text),
        }
    }

    /// `message` with the token masked in its strings.
    fn message(
        &self,
        message: ServerJsonRpcMessage,
    ) -> Result<ServerJsonRpcMessage, StreamableHttpError<reqwest::Error>> {
        let mut value = match serde_json::to_value(&message) {
            Ok(value) => value,
            Err(e) => return Err(StreamableHttpError::Deserialize(e)),
        };
        if !self.value(&mut value) {
            return Ok(message);
        }
        serde_json::from_value(value).map_err(|_| {
            StreamableHttpError::UnexpectedServerResponse(Cow::Borrowed(
                "the server's answer quoted the bearer token and no longer parses with it masked",
            ))
        })
    }

    /// An SSE event with the token masked in its data.
    fn event(&self, mut event: Sse) -> Sse {
        if let Some(data) = &event.data
            && self.is_in(data)
        {
            event.data = Some(self.json_text(data));
        }
        event
    }

    fn sse_error(&self, error: SseError) -> SseError {
        match error {
            SseError::Body(e) if self.is_in(&e.to_string()) || self.is_in(&format!("{e:?}")) => {
                SseError::Body(Box::new(std::io::Error::other(
                    self.error_text(&e.to_string()),
                )))
            }
            other => other,
        }
    }

    /// `error` with the token masked in every text it carries.
    fn error(
        &self,
        error: StreamableHttpError<reqwest::Error>,
    ) -> StreamableHttpError<reqwest::Error> {
        use StreamableHttpError as E;
        match error {
            E::Sse(e) => E::Sse(self.sse_error(e)),
            E::Io(e) if self.is_in(&e.to_string()) => E::Io(std::io::Error::new(
                e.kind(),
                self.error_text(&e.to_string()),
            )),
            E::Client(e) => E::Client(self.client_error(e)),
            E::HttpStatus(e) => E::HttpStatus(HttpStatusError::new(
                e.status,
                e.retry_after.map(|r| self.error_text(&r)),
            )),
            E::UnexpectedServerResponse(text) => {
                E::UnexpectedServerResponse(Cow::Owned(self.error_text(&text)))
            }
            E::UnexpectedContentType(content_type) => {
                E::UnexpectedContentType(content_type.map(|c| self.error_text(&c)))
            }
            E::Deserialize(e) if self.is_in(&e.to_string()) => E::Deserialize(
                <serde_json::Error as serde::de::Error>::custom(self.error_text(&e.to_string())),
            ),
            E::AuthRequired(e) => E::AuthRequired(AuthRequiredError::new(
                self.error_text(&e.www_authenticate_header),
            )),
            E::InsufficientScope(e) => E::InsufficientScope(InsufficientScopeError::new(
                self.error_text(&e.www_authenticate_header),
                e.required_scope.map(|s| self.error_text(&s)),
            )),
            E::ReservedHeaderConflict(name) => E::ReservedHeaderConflict(self.error_text(&name)),
            E::ReinitializationFailed(e) => E::ReinitializationFailed(self.error_data(e)),
            other => other,
        }
    }

    /// A client error as it is, or without its URL should that quote the token (a
    /// server's redirect may put it there); nothing else in it comes from the server.
    fn client_error(&self, error: reqwest::Error) -> reqwest::Error {
        if self.is_in(&error.to_string()) || self.is_in(&format!("{error:?}")) {
            error.without_url()
        } else {
            error
        }
    }

    fn error_data(&self, mut error: ErrorData) -> ErrorData {
        if self.is_in(&error.message) {
            error.message = Cow::Owned(self.error_text(&error.message));
        }
        if let Some(data) = &mut error.data {
            self.value(data);
        }
        error
    }
}

/// The HTTP client rmcp's streamable-HTTP transport uses: `reqwest`, every answer and
/// error masked with the server's bearer token, when it has one.
#[derive(Clone, Debug)]
pub struct MaskedHttp {
    http: reqwest::Client,
    mask: Option<Mask>,
}

impl MaskedHttp {
    /// A client masking `token`. Like the library's own default client it keeps no idle
    /// connections (a reused connection whose last answer was not read to its end stalls
    /// on delayed ACKs) and follows only same-origin 307 and 308 redirects, which keep
    /// the method and the body, at most [`MAX_REDIRECTS`] of them; any other redirect
    /// is the request's answer.
    pub fn new(token: Option<&str>) -> Result<Self, String> {
        let http = reqwest::Client::builder()
            .pool_max_idle_per_host(0)
            .redirect(reqwest::redirect::Policy::custom(|attempt| {
                let keeps_body = matches!(
                    attempt.status(),
                    reqwest::StatusCode::TEMPORARY_REDIRECT
                        | reqwest::StatusCode::PERMANENT_REDIRECT
                );
                let same_origin = attempt
                    .previous()
                    .first()
                    .is_some_and(|first| first.origin() == attempt.url().origin());
                if keeps_body && same_origin && attempt.previous().len() <= MAX_REDIRECTS {
                    attempt.follow()
                } else {
                    attempt.stop()
                }
            }))
            .build()
            .map_err(|e| format!("cannot build the HTTP client: {e}"))?;
        Ok(Self {
            http,
            mask: token.and_then(Mask::new),
        })
    }

    fn error(
        &self,
        error: StreamableHttpError<reqwest::Error>,
    ) -> StreamableHttpError<reqwest::Error> {
        match &self.mask {
            Some(mask) => mask.error(error),
            None => error,
        }
    }

    fn stream(
        &self,
        stream: BoxStream<'static, Result<Sse, SseError>>,
    ) -> BoxStream<'static, Result<Sse, SseError>> {
        match self.mask.clone() {
            Some(mask) => stream
                .map(move |item| match item {
                    Ok(event) => Ok(mask.event(event)),
                    Err(e) => Err(mask.sse_error(e)),
                })
                .boxed(),
            None => stream,
        }
    }

    fn answer(
        &self,
        answer: Result<StreamableHttpPostResponse, StreamableHttpError<reqwest::Error>>,
    ) -> Result<StreamableHttpPostResponse, StreamableHttpError<reqwest::Error>> {
        let Some(mask) = &self.mask else {
            return answer;
        };
        match answer.map_err(|e| mask.error(e))? {
            StreamableHttpPostResponse::Json(message, session) => Ok(
                StreamableHttpPostResponse::Json(mask.message(message)?, session),
            ),
            StreamableHttpPostResponse::Sse(stream, session) => Ok(
                StreamableHttpPostResponse::Sse(self.stream(stream), session),
            ),
            other => Ok(other),
        }
    }
}

impl StreamableHttpClient for MaskedHttp {
    type Error = reqwest::Error;

    async fn post_message(
        &self,
        uri: Arc<str>,
        message: ClientJsonRpcMessage,
        session_id: Option<Arc<str>>,
        auth_header: Option<String>,
        custom_headers: HashMap<HeaderName, HeaderValue>,
    ) -> Result<StreamableHttpPostResponse, StreamableHttpError<Self::Error>> {
        let answer = self
            .http
            .post_message(uri, message, session_id, auth_header, custom_headers)
            .await;
        self.answer(answer)
    }

    async fn post_message_with_max_sse_event_size(
        &self,
        uri: Arc<str>,
        message: ClientJsonRpcMessage,
        session_id: Option<Arc<str>>,
        auth_header: Option<String>,
        custom_headers: HashMap<HeaderName, HeaderValue>,
        max_sse_event_size: usize,
    ) -> Result<StreamableHttpPostResponse, StreamableHttpError<Self::Error>> {
        let answer = self
            .http
            .post_message_with_max_sse_event_size(
                uri,
                message,
                session_id,
                auth_header,
                custom_headers,
                max_sse_event_size,
            )
            .await;
        self.answer(answer)
    }

    async fn post_message_with_response_limits(
        &self,
        uri: Arc<str>,
        message: ClientJsonRpcMessage,
        session_id: Option<Arc<str>>,
        auth_header: Option<String>,
        custom_headers: HashMap<HeaderName, HeaderValue>,
        limits: StreamableHttpResponseLimits,
    ) -> Result<StreamableHttpPostResponse, StreamableHttpError<Self::Error>> {
        let answer = self
            .http
            .post_message_with_response_limits(
                uri,
                message,
                session_id,
                auth_header,
                custom_headers,
                limits,
            )
            .await;
        self.answer(answer)
    }

    async fn delete_session(
        &self,
        uri: Arc<str>,
        session_id: Arc<str>,
        auth_header: Option<String>,
        custom_headers: HashMap<HeaderName, HeaderValue>,
    ) -> Result<(), StreamableHttpError<Self::Error>> {
        self.http
            .delete_session(uri, session_id, auth_header, custom_headers)
            .await
            .map_err(|e| self.error(e))
    }

    async fn get_stream(
        &self,
        uri: Arc<str>,
        session_id: Option<Arc<str>>,
        last_event_id: Option<String>,
        auth_header: Option<String>,
        custom_headers: HashMap<HeaderName, HeaderValue>,
    ) -> Result<BoxStream<'static, Result<Sse, SseError>>, StreamableHttpError<Self::Error>> {
        let stream = self
            .http
            .get_stream(uri, session_id, last_event_id, auth_header, custom_headers)
            .await
            .map_err(|e| self.error(e))?;
        Ok(self.stream(stream))
    }

    async fn get_stream_with_max_sse_event_size(
        &self,
        uri: Arc<str>,
        session_id: Option<Arc<str>>,
        last_event_id: Option<String>,
        auth_header: Option<String>,
        custom_headers: HashMap<HeaderName, HeaderValue>,
        max_sse_event_size: usize,
    ) -> Result<BoxStream<'static, Result<Sse, SseError>>, StreamableHttpError<Self::Error>> {
        let stream = self
            .http
            .get_stream_with_max_sse_event_size(
                uri,
                session_id,
                last_event_id,
                auth_header,
                custom_headers,
                max_sse_event_size,
            )
            .await
            .map_err(|e| self.error(e))?;
        Ok(self.stream(stream))
    }
}

#[cfg(test)]
mod tests {
    use rmcp::model::{CallToolResult, ContentBlock, RequestId, ServerResult};
    use serde_json::json;

    use super::*;

    const TOKEN: &str = "tok/5d1c8e7a93f24b60";

    fn mask() -> Mask {
        Mask::new(TOKEN).unwrap()
    }

    #[test]
    fn the_token_is_masked_wherever_a_text_holds_it() {
        let mask = mask();
        assert!(Mask::new("").is_none());
        assert_eq!(
            mask.text("got Bearer tok/5d1c8e7a93f24b60, and tok\\/5d1c8e7a93f24b60"),
            format!("got Bearer {REDACTED}, and {REDACTED}")
        );
        assert_eq!(mask.text("nothing here"), "nothing here");
        // An error text cut short ends with a start of the token: masked too, unless it
        // is too short to tell from chance.
        assert_eq!(
            mask.error_text("HTTP 401: not accepted: Bearer tok/5d1c"),
            format!("HTTP 401: not accepted: Bearer {REDACTED}")
        );
        assert_eq!(mask.error_text("a stock"), "a stock");
        assert_eq!(mask.error_text("to"), "to");
    }

    #[test]
    fn the_token_is_masked_in_every_string_and_key_of_a_value() {
        let mask = mask();
        let mut value = json!({
            "owner": "team-payments",
            "served_to": format!("Bearer {TOKEN}"),
            TOKEN: [1, {"nested": TOKEN}],
        });
        assert!(mask.value(&mut value));
        assert_eq!(
            value,
            json!({
                "owner": "team-payments",
                "served_to": format!("Bearer {REDACTED}"),
                REDACTED: [1, {"nested": REDACTED}],
            })
        );
        assert!(!mask.value(&mut value));
    }

    #[test]
    fn a_json_answer_and_an_sse_event_are_masked_and_still_parse() {
        let mask = mask();
        let result = CallToolResult::structured(json!({"served_to": format!("Bearer {TOKEN}")}));
        let message = ServerJsonRpcMessage::response(
            ServerResult::CallToolResult(result),
            RequestId::Number(7),
        );
        let masked = serde_json::to_string(&mask.message(message).unwrap()).unwrap();
        assert!(!masked.contains("5d1c8e7a93f24b60"), "{masked}");
        assert!(masked.contains(&format!("Bearer {REDACTED}")), "{masked}");

        let text = CallToolResult::success(vec![ContentBlock::text(format!("token {TOKEN}"))]);
        let data = serde_json::to_string(&ServerJsonRpcMessage::response(
            ServerResult::CallToolResult(text),
            RequestId::Number(8),
        ))
        .unwrap();
        let event = mask.event(Sse {
            event: Some("message".into()),
            data: Some(data),
            id: Some("8".into()),
            retry: None,
        });
        let data = event.data.unwrap();
        assert!(!data.contains("5d1c8e7a93f24b60"), "{data}");
        let parsed: ServerJsonRpcMessage = serde_json::from_str(&data).unwrap();
        let ServerJsonRpcMessage::Response(response) = parsed else {
            panic!("{data}")
        };
        let ServerResult::CallToolResult(result) = response.result else {
            panic!("{data}")
        };
        assert_eq!(
            result.content[0].as_text().unwrap().text,
            format!("token {REDACTED}")
        );
        assert_eq!(event.id.as_deref(), Some("8"));
    }

    #[test]
    fn every_text_an_error_carries_is_masked() {
        let mask = mask();
        let masked = |error: StreamableHttpError<reqwest::Error>| {
            let error = mask.error(error);
            format!("{error} {error:?}")
        };
        let errors = [
            StreamableHttpError::UnexpectedServerResponse(
                format!(r#"HTTP 401 Unauthorized: {{"why": "Bearer {TOKEN}"}}"#).into(),
            ),
            StreamableHttpError::AuthRequired(AuthRequiredError::new(format!(
                "Bearer error=\"{TOKEN}\""
            ))),
            StreamableHttpError::InsufficientScope(InsufficientScopeError::new(
                format!("Bearer scope=\"{TOKEN}\""),
                Some(TOKEN.to_owned()),
            )),
            StreamableHttpError::UnexpectedContentType(Some(format!("text/{TOKEN}"))),
            StreamableHttpError::Io(std::io::Error::other(format!("read {TOKEN}"))),
            StreamableHttpError::Deserialize(<serde_json::Error as serde::de::Error>::custom(
                format!("invalid {TOKEN}"),
            )),
            StreamableHttpError::Sse(SseError::Body(Box::new(std::io::Error::other(format!(
                "body {TOKEN}"
            ))))),
            StreamableHttpError::ReinitializationFailed(ErrorData::invalid_request(
                format!("not {TOKEN}"),
                Some(json!({"token": TOKEN})),
            )),
        ];
        for error in errors {
            let text = masked(error);
            assert!(!text.contains("5d1c8e7a93f24b60"), "{text}");
            assert!(text.contains(REDACTED), "{text}");
        }
        assert_eq!(format!("{:?}", mask), "Mask(..)");
    }
}
