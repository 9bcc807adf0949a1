//! A scripted OpenAI-compatible chat-completions server on loopback, for the tests of the
//! `openai` model provider and the model benchmark (`convene bench --workload model`);
//! also handy for offline demos.
//!
//! [`ScriptedModel::start`] binds `127.0.0.1:0` and serves until it is dropped or
//! [`ScriptedModel::shutdown`] is called. Point a client at [`ScriptedModel::base_url`]
//! (`http://127.0.0.1:<port>/v1`, what `OPENAI_BASE_URL` takes). Routes:
//! `POST /v1/chat/completions`, and `GET /v1/models` listing the model the server answers
//! as; anything else is a 404 with an OpenAI-shaped error body.
//!
//! **The script.** A [`Responder`] answers each chat-completions request with a
//! [`Reply`]: a [`Script`] answers from a queue, in order, or a closure
//! `Fn(&Recorded) -> Reply` decides from the request. A reply is a complete
//! `chat.completion` object ([`Reply::text`], [`Reply::tool_calls`]), an HTTP error
//! ([`Reply::error`], with headers such as `Retry-After`), a delay ([`Reply::delayed`]),
//! no answer at all ([`Reply::hang`]) or a dropped connection ([`Reply::disconnect`]).
//! A request with `"stream": true` gets its completion as server-sent
//! `chat.completion.chunk` events, as OpenAI streams it (the usage in a last chunk when
//! `stream_options.include_usage` asks for it); errors stay plain HTTP errors:
//!
//! ```no_run
//! # async fn demo() -> std::io::Result<()> {
//! use convene_worker::model_server::{Reply, Script, ScriptedModel};
//!
//! let model = ScriptedModel::start(Script::new(vec![
//!     Reply::tool_calls(vec![("call_1", "read_file", r#"{"path":"a.log"}"#)]),
//!     Reply::error(429, "slow down").with_header("Retry-After", "1"),
//!     Reply::text("done").with_usage(120, 8),
//! ]))?;
//! // ... point the client under test at model.base_url() ...
//! let requests = model.requests();
//! # Ok(()) }
//! ```
//!
//! **What is recorded.** Every chat-completions request, in arrival order, as a
//! [`Recorded`]: its index, headers, JSON body (or raw text when it is not JSON) and
//! arrival time, with helpers for the model, the messages, the offered tools, the latest
//! tool results and the Authorization header. Credential headers are marked sensitive,
//! so `Debug` output never shows them.
//!
//! The server does no per-request logging and writes compact JSON: the benchmark
//! measures the worker's CPU per model turn against it.

mod connection;
mod playbook;
mod reply;
mod script;

use std::io;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Instant;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{ConnectInfo, Request, State};
use axum::http::{HeaderMap, Method, StatusCode, Uri};
use axum::response::Response;
use axum::routing::{get, post};
use serde_json::Value;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use connection::{Connection, Listener};
pub use playbook::PlaybookResponder;
pub use reply::{ErrorBody, Reply};
use reply::{
    Kind, completion_json, completion_sse, error_reply, error_response, json_response,
    sse_response, with_headers,
};
pub use script::{Recorded, Responder, Script, ToolResult};

/// The model `GET /v1/models` lists, and the one an answer names when its request names
/// none, unless [`Options::model`] says otherwise.
pub const DEFAULT_MODEL: &str = "scripted-model";
/// The `usage.prompt_tokens` of a reply without [`Reply::with_usage`].
pub const DEFAULT_PROMPT_TOKENS: u32 = 16;
/// The `usage.completion_tokens` of a reply without [`Reply::with_usage`].
pub const DEFAULT_COMPLETION_TOKENS: u32 = 8;
/// The `system_fingerprint` of every completion.
pub const SYSTEM_FINGERPRINT: &str = "fp_convene_scripted";
/// The largest request body read; a larger one is refused with a 413.
const MAX_BODY: usize = 64 << 20;
/// Headers that carry credentials, marked sensitive when recorded.
const CREDENTIAL_HEADERS: [&str; 3] = ["authorization", "api-key", "x-api-key"];

/// How a [`ScriptedModel`] names its model and what it keeps.
#[derive(Debug, Clone)]
pub struct Options {
    /// The model every answer names and `GET /v1/models` lists. `None` (the default):
    /// an answer names the model its request asked for, and the list names
    /// [`DEFAULT_MODEL`].
    pub model: Option<String>,
    /// Whether requests are kept for [`ScriptedModel::requests`] (the default). A long
    /// benchmark turns this off so memory stays flat; requests are still counted and
    /// still shown to the responder.
    pub keep_requests: bool,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            model: None,
            keep_requests: true,
        }
    }
}

/// A scripted OpenAI-compatible server on `127.0.0.1`, serving until dropped or
/// [`ScriptedModel::shutdown`]. See the [module documentation](self).
pub struct ScriptedModel {
    addr: SocketAddr,
    shared: Arc<Shared>,
    task: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for ScriptedModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ScriptedModel")
            .field("addr", &self.addr)
            .field("requests", &self.request_count())
            .finish_non_exhaustive()
    }
}

struct Shared {
    responder: Box<dyn Responder>,
    model: Option<String>,
    keep_requests: bool,
    count: AtomicUsize,
    abandoned: AtomicUsize,
    requests: Mutex<Vec<Arc<Recorded>>>,
    models_body: Bytes,
    shutdown: CancellationToken,
}

impl ScriptedModel {
    /// Starts a server answering with `responder`, with the default [`Options`].
    ///
    /// # Errors
    ///
    /// No Tokio runtime is running (call it from within one, e.g. in a
    /// `#[tokio::test]`), or the loopback port cannot be bound.
    pub fn start(responder: impl Responder) -> io::Result<Self> {
        Self::start_with(Options::default(), responder)
    }

    /// Starts a server answering with `responder`, as `options` says.
    ///
    /// # Errors
    ///
    /// As [`ScriptedModel::start`].
    pub fn start_with(options: Options, responder: impl Responder) -> io::Result<Self> {
        let runtime = tokio::runtime::Handle::try_current().map_err(|_| {
            io::Error::other(
                "the scripted model server needs a Tokio runtime: start it from within one \
                 (e.g. in a #[tokio::test])",
            )
        })?;
        let listener = std::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?;
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let listener = TcpListener::from_std(listener)?;

        let listed = options.model.as_deref().unwrap_or(DEFAULT_MODEL);
        let models_body = serde_json::json!({
            "object": "list",
            "data": [{ "id": listed, "object": "model", "created": 0, "owned_by": "convene" }],
        })
        .to_string();
        let shared = Arc::new(Shared {
            responder: Box::new(responder),
            model: options.model,
            keep_requests: options.keep_requests,
            count: AtomicUsize::new(0),
            abandoned: AtomicUsize::new(0),
            requests: Mutex::new(Vec::new()),
            models_body: Bytes::from(models_body),
            shutdown: CancellationToken::new(),
        });
        let router = Router::new()
            .route("/v1/chat/completions", post(chat_completions))
            .route("/v1/models", get(models))
            .fallback(not_found)
            .method_not_allowed_fallback(method_not_allowed)
            .with_state(Arc::clone(&shared));
        let serve = axum::serve(
            Listener(listener),
            router.into_make_service_with_connect_info::<Connection>(),
        )
        .with_graceful_shutdown(shared.shutdown.clone().cancelled_owned());
        let task = runtime.spawn(async move {
            // Serving with graceful shutdown never fails: accept errors are retried.
            let _ = serve.await;
        });
        Ok(Self {
            addr,
            shared,
            task: Some(task),
        })
    }

    /// The address the server listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The API base, `http://127.0.0.1:<port>/v1`, as OpenAI SDKs take it
    /// (`OPENAI_BASE_URL`, `OpenAIConfig::with_api_base`).
    pub fn base_url(&self) -> String {
        format!("http://{}/v1", self.addr)
    }

    /// A snapshot of the chat-completions requests recorded so far, in arrival order
    /// (empty when [`Options::keep_requests`] is off).
    pub fn requests(&self) -> Vec<Recorded> {
        lock(&self.shared.requests)
            .iter()
            .map(|recorded| Recorded::clone(recorded))
            .collect()
    }

    /// How many chat-completions requests have arrived, kept or not.
    pub fn request_count(&self) -> usize {
        self.shared.count.load(Ordering::Acquire)
    }

    /// How many chat-completions requests their clients gave up on: the connection
    /// closed while the reply was still being prepared (a delayed or hanging reply), so
    /// the answer was never sent. A client that cancels a slow call shows here.
    pub fn abandoned(&self) -> usize {
        self.shared.abandoned.load(Ordering::Acquire)
    }

    /// Stops accepting connections, ends hanging and delayed replies by dropping their
    /// connections, and waits until every connection is closed.
    pub async fn shutdown(mut self) {
        self.shared.shutdown.cancel();
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
    }
}

impl Drop for ScriptedModel {
    fn drop(&mut self) {
        self.shared.shutdown.cancel();
    }
}

impl Shared {
    /// Records a request under the next index.
    fn record(
        &self,
        headers: HeaderMap,
        body: Value,
        raw_body: Option<String>,
        received: Instant,
    ) -> Arc<Recorded> {
        let make = |index| {
            Arc::new(Recorded {
                index,
                headers,
                body,
                raw_body,
                received,
            })
        };
        if !self.keep_requests {
            return make(self.count.fetch_add(1, Ordering::AcqRel));
        }
        // The index is taken under the lock so the kept order is the index order.
        let mut requests = lock(&self.requests);
        let recorded = make(self.count.fetch_add(1, Ordering::AcqRel));
        requests.push(Arc::clone(&recorded));
        recorded
    }

    async fn answer(
        &self,
        mut reply: Reply,
        request: &Recorded,
        connection: Option<&Connection>,
    ) -> Response {
        loop {
            match reply.kind {
                Kind::Completion(completion) => {
                    let model = self
                        .model
                        .as_deref()
                        .or_else(|| request.model())
                        .unwrap_or(DEFAULT_MODEL);
                    let response = if request.streams() {
                        let include_usage = request
                            .body
                            .pointer("/stream_options/include_usage")
                            .and_then(Value::as_bool)
                            == Some(true);
                        sse_response(completion_sse(
                            &completion,
                            model,
                            request.index,
                            include_usage,
                        ))
                    } else {
                        match completion_json(&completion, model, request.index) {
                            Ok(body) => json_response(StatusCode::OK, body),
                            Err(e) => error_response(
                                StatusCode::INTERNAL_SERVER_ERROR,
                                &format!("cannot encode the scripted completion: {e}"),
                            ),
                        }
                    };
                    return with_headers(response, reply.headers);
                }
                Kind::Error { status, body } => {
                    return with_headers(error_reply(status, body), reply.headers);
                }
                Kind::Delayed(delay, inner) => {
                    tokio::select! {
                        () = tokio::time::sleep(delay) => {}
                        () = self.shutdown.cancelled() => return disconnect(connection),
                    }
                    let outer = reply.headers;
                    reply = *inner;
                    reply.headers.extend(outer);
                }
                Kind::Hang => {
                    self.shutdown.cancelled().await;
                    return disconnect(connection);
                }
                Kind::Disconnect => return disconnect(connection),
            }
        }
    }
}

async fn chat_completions(State(shared): State<Arc<Shared>>, request: Request) -> Response {
    let received = Instant::now();
    let (parts, body) = request.into_parts();
    let bytes = match axum::body::to_bytes(body, MAX_BODY).await {
        Ok(bytes) => bytes,
        Err(e) => {
            return error_response(
                StatusCode::PAYLOAD_TOO_LARGE,
                &format!("cannot read the request body (at most {MAX_BODY} bytes): {e}"),
            );
        }
    };
    let mut headers = parts.headers;
    for name in CREDENTIAL_HEADERS {
        if let Some(value) = headers.get_mut(name) {
            value.set_sensitive(true);
        }
    }
    let (body, not_json) = match serde_json::from_slice::<Value>(&bytes) {
        Ok(body) => (body, None),
        Err(e) => (
            Value::Null,
            Some((String::from_utf8_lossy(&bytes).into_owned(), e)),
        ),
    };
    let (raw_body, parse_error) = not_json.unzip();
    let recorded = shared.record(headers, body, raw_body, received);
    if let Some(e) = parse_error {
        return error_response(
            StatusCode::BAD_REQUEST,
            &format!(
                "the request body is not JSON ({e}): send the chat-completions request as a JSON object"
            ),
        );
    }
    let reply = shared.responder.reply(&recorded);
    let connection = parts
        .extensions
        .get::<ConnectInfo<Connection>>()
        .map(|info| &info.0);
    // Dropped unanswered when the client closes the connection first.
    let mut pending = Pending {
        abandoned: &shared.abandoned,
        answered: false,
    };
    let response = shared.answer(reply, &recorded, connection).await;
    pending.answered = true;
    response
}

/// Counts a request as abandoned if its handler is dropped before it answers.
struct Pending<'a> {
    abandoned: &'a AtomicUsize,
    answered: bool,
}

impl Drop for Pending<'_> {
    fn drop(&mut self) {
        if !self.answered {
            self.abandoned.fetch_add(1, Ordering::AcqRel);
        }
    }
}

async fn models(State(shared): State<Arc<Shared>>) -> Response {
    json_response(StatusCode::OK, shared.models_body.clone())
}

async fn not_found(uri: Uri) -> Response {
    error_response(
        StatusCode::NOT_FOUND,
        &format!(
            "unknown path {}: this scripted model server serves POST /v1/chat/completions and GET /v1/models",
            uri.path()
        ),
    )
}

async fn method_not_allowed(method: Method, uri: Uri) -> Response {
    error_response(
        StatusCode::METHOD_NOT_ALLOWED,
        &format!(
            "{method} is not served on {}: this scripted model server serves POST /v1/chat/completions and GET /v1/models",
            uri.path()
        ),
    )
}

/// Drops the request's connection: the response returned is never written.
fn disconnect(connection: Option<&Connection>) -> Response {
    match connection {
        Some(connection) => {
            connection.kill();
            Response::new(Body::empty())
        }
        None => error_response(
            StatusCode::INTERNAL_SERVER_ERROR,
            "the scripted model server cannot drop this connection",
        ),
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}
