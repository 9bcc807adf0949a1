//! One MCP server as the worker sees it: its connection (started or reached when first
//! needed, and again after it is lost), what it lists, and the calls made to it.
//!
//! The worker speaks MCP 2025-11-25 (the `initialize` handshake), in which a server
//! announces a change of its tools with `notifications/tools/list_changed` on the
//! connection itself; each one makes the worker list the tools again.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use rmcp::model::{
    CallToolRequestParams, ClientCapabilities, ClientConfig, Implementation, ProtocolVersion,
};
use rmcp::service::{NotificationContext, RunningService};
use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;
use rmcp::transport::{StreamableHttpClientTransport, TokioChildProcess, Transport};
use rmcp::{ClientHandler, RoleClient, ServiceError, ServiceExt as _};
use serde_json::{Map, Value, json};
use tokio::io::AsyncBufReadExt as _;
use tokio::sync::{Mutex, Notify};
use tokio_util::sync::CancellationToken;

use super::config::{INHERITED_ENV, McpServerConfig, Transport as Reach};
use super::masked_http::{Mask, MaskedHttp};
use super::offer::Offer;
use crate::tools::{ToolError, ToolOutput};

/// A server that could not be started or reached is tried again at most this often:
/// calls in between fail at once with the last error.
pub const RECONNECT_PAUSE: Duration = Duration::from_secs(1);

/// The most characters of a server's error text a failed call quotes.
const MAX_ERROR_TEXT: usize = 2000;

/// An MCP server and the tools the catalog declares for it.
#[derive(Debug)]
pub struct McpServer {
    config: McpServerConfig,
    /// What the server lists, shared with its connection's re-listing task.
    listing: Arc<Listing>,
    connection: Mutex<State>,
    /// Connections made so far; each one's number tells a stale failure report apart.
    serial: AtomicU64,
}

/// Where the connection stands.
#[derive(Debug)]
enum State {
    /// Not tried yet.
    Idle,
    /// Connected.
    Up(Connection),
    /// The last attempt failed (or the connection was lost); the next waits until
    /// `until`.
    Down { why: String, until: Instant },
}

/// A live connection.
struct Connection {
    serial: u64,
    client: RunningService<RoleClient, Handler>,
    /// Fires when the server's side of the transport ends (the process exited, the
    /// HTTP session is gone), so calls in flight fail at once.
    closed: CancellationToken,
    /// The stdio server's process id.
    pid: Option<u32>,
    relister: tokio::task::JoinHandle<()>,
}

impl std::fmt::Debug for Connection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connection")
            .field("serial", &self.serial)
            .field("pid", &self.pid)
            .finish_non_exhaustive()
    }
}

impl Drop for Connection {
    fn drop(&mut self) {
        self.relister.abort();
        self.closed.cancel();
    }
}

/// The tools a server lists, as of its last listing.
#[derive(Debug)]
struct Listing {
    server: String,
    /// The declared tools of this server, whose offers follow the listing.
    offers: Vec<Arc<Offer>>,
    /// Tool names the server lists; empty until it has listed them once.
    listed: RwLock<Vec<String>>,
    /// Undeclared tools already reported, so each is logged once.
    reported: RwLock<std::collections::BTreeSet<String>>,
    /// Listings applied so far.
    generation: AtomicU64,
}

impl Listing {
    /// Applies a listing: the declared tools it names are offered with its schemas, the
    /// others withdrawn; undeclared tools are reported, never mounted.
    fn apply(&self, tools: &[rmcp::model::Tool]) {
        let mut listed = self
            .listed
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        *listed = tools.iter().map(|t| t.name.to_string()).collect();
        for offer in &self.offers {
            match tools.iter().find(|t| t.name == offer.entry.tool) {
                Some(tool) => offer.list(tool),
                None => offer.withdraw(),
            }
        }
        let mut reported = self
            .reported
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        for tool in tools {
            let declared = self.offers.iter().any(|o| o.entry.tool == tool.name);
            if !declared && reported.insert(tool.name.to_string()) {
                tracing::info!(
                    server = %self.server,
                    tool = %tool.name,
                    "the MCP server offers a tool the tool catalog does not declare; it is not \
                     mounted (declare mcp:{}/{}@<version> in the policy file to use it)",
                    self.server,
                    tool.name
                );
            }
        }
        self.generation.fetch_add(1, Ordering::AcqRel);
    }

    fn lists(&self, tool: &str) -> bool {
        self.listed
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .iter()
            .any(|t| t == tool)
    }

    fn names(&self) -> Vec<String> {
        self.listed
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }
}

/// The client side of a connection: answers the server's requests (no sampling, no
/// elicitation, no roots) and hears its tools change.
#[derive(Debug, Clone)]
struct Handler {
    server: Arc<str>,
    changed: Arc<Notify>,
}

impl ClientHandler for Handler {
    async fn on_tool_list_changed(&self, _context: NotificationContext<RoleClient>) {
        tracing::info!(server = %self.server, "the MCP server's tools changed; listing them again");
        self.changed.notify_one();
    }

    fn get_info(&self) -> ClientConfig {
        ClientConfig::new(
            ClientCapabilities::default(),
            Implementation::new("convene-worker", env!("CARGO_PKG_VERSION")),
        )
        .with_protocol_version(ProtocolVersion::V_2025_11_25)
    }
}

/// A transport that says when the server's side of it ends.
struct Watched<T> {
    inner: T,
    closed: CancellationToken,
}

impl<T: Transport<RoleClient>> Transport<RoleClient> for Watched<T> {
    type Error = T::Error;

    fn send(
        &mut self,
        item: rmcp::service::TxJsonRpcMessage<RoleClient>,
    ) -> impl Future<Output = Result<(), Self::Error>> + Send + 'static {
        self.inner.send(item)
    }

    async fn receive(&mut self) -> Option<rmcp::service::RxJsonRpcMessage<RoleClient>> {
        let message = self.inner.receive().await;
        if message.is_none() {
            self.closed.cancel();
        }
        message
    }

    fn close(&mut self) -> impl Future<Output = Result<(), Self::Error>> + Send {
        self.closed.cancel();
        self.inner.close()
    }
}

/// What became of a call that did not return a result.
enum Lost {
    /// The connection ended under it.
    Closed(String),
    /// No answer within the timeout.
    TimedOut,
    /// The server answered with a JSON-RPC error.
    Refused(String),
    /// Anything else the client library reported.
    Other(String),
}

impl McpServer {
    pub(super) fn new(config: McpServerConfig, offers: Vec<Arc<Offer>>) -> Self {
        Self {
            listing: Arc::new(Listing {
                server: config.name.clone(),
                offers,
                listed: RwLock::new(Vec::new()),
                reported: RwLock::default(),
                generation: AtomicU64::new(0),
            }),
            config,
            connection: Mutex::new(State::Idle),
            serial: AtomicU64::new(0),
        }
    }

    /// The server's configured name.
    pub fn name(&self) -> &str {
        &self.config.name
    }

    /// Its configuration.
    pub fn config(&self) -> &McpServerConfig {
        &self.config
    }

    /// The tool names the server listed last (declared or not), empty if it never
    /// listed any.
    pub fn listed(&self) -> Vec<String> {
        self.listing.names()
    }

    /// How many listings the worker has applied: 1 after the first connection, one more
    /// for every re-listing (a `list_changed` notification, a reconnection).
    pub fn listings(&self) -> u64 {
        self.listing.generation.load(Ordering::Acquire)
    }

    /// The process id of a connected stdio server.
    pub async fn pid(&self) -> Option<u32> {
        match &*self.connection.lock().await {
            State::Up(c) => c.pid,
            _ => None,
        }
    }

    /// Whether the server is connected now.
    pub async fn is_connected(&self) -> bool {
        matches!(&*self.connection.lock().await, State::Up(c) if !c.closed.is_cancelled())
    }

    /// Starts or reaches the server unless it is connected; logs the outcome. Used at
    /// start-up, where a failure is a warning and the first call tries again.
    pub(super) async fn start(&self) {
        match self.peer().await {
            Ok(_) => tracing::info!(
                server = %self.config.name,
                listed = ?self.listing.names(),
                offered = ?self
                    .listing
                    .offers
                    .iter()
                    .filter(|o| o.model_spec().is_some())
                    .map(|o| o.entry.name.as_str())
                    .collect::<Vec<_>>(),
                "MCP server connected"
            ),
            Err(why) => tracing::warn!(
                server = %self.config.name,
                error = %why,
                "the MCP server could not be started or reached; its tools are offered to no \
                 model until it lists them, and each call of one tries it again"
            ),
        }
    }

    /// Closes the connection (a stdio server is asked to exit, then killed).
    pub async fn shutdown(&self) {
        let state = std::mem::replace(
            &mut *self.connection.lock().await,
            State::Down {
                why: "the worker shut the connection".into(),
                until: Instant::now(),
            },
        );
        if let State::Up(mut connection) = state
            && let Err(e) = connection
                .client
                .close_with_timeout(Duration::from_secs(5))
                .await
        {
            tracing::warn!(server = %self.config.name, error = %e, "closing the MCP connection failed");
        }
    }

    /// A live connection: the current one, or a new one when there is none (at most one
    /// attempt per [`RECONNECT_PAUSE`]).
    async fn peer(&self) -> Result<(rmcp::Peer<RoleClient>, u64, CancellationToken), String> {
        let mut state = self.connection.lock().await;
        match &*state {
            State::Up(c) if !c.closed.is_cancelled() => {
                return Ok((c.client.peer().clone(), c.serial, c.closed.clone()));
            }
            State::Up(_) => {}
            State::Down { why, until } if Instant::now() < *until => {
                return Err(why.clone());
            }
            State::Down { .. } | State::Idle => {}
        }
        let serial = self.serial.fetch_add(1, Ordering::AcqRel) + 1;
        match self.connect(serial).await {
            Ok(c) => {
                let peer = (c.client.peer().clone(), c.serial, c.closed.clone());
                *state = State::Up(c);
                Ok(peer)
            }
            Err(why) => {
                *state = State::Down {
                    why: why.clone(),
                    until: Instant::now() + RECONNECT_PAUSE,
                };
                Err(why)
            }
        }
    }

    /// Marks connection `serial` lost, so the next call starts or reaches the server
    /// again.
    async fn lost(&self, serial: u64, why: &str) {
        let mut state = self.connection.lock().await;
        if matches!(&*state, State::Up(c) if c.serial == serial) {
            tracing::warn!(server = %self.config.name, error = %why, "the MCP connection is lost");
            // A lost connection is tried again on the next call, at once.
            *state = State::Down {
                why: why.to_owned(),
                until: Instant::now(),
            };
        }
    }

    /// Starts (stdio) or reaches (HTTP) the server, completes the handshake and lists
    /// its tools, within `start_timeout`.
    async fn connect(&self, serial: u64) -> Result<Connection, String> {
        let closed = CancellationToken::new();
        let changed = Arc::new(Notify::new());
        let handler = Handler {
            server: Arc::from(self.config.name.as_str()),
            changed: changed.clone(),
        };
        let limit = self.config.start_timeout;
        let started = tokio::time::timeout(limit, async {
            let (client, pid) = match self.config.transport() {
                Reach::Stdio { command } => {
                    let (transport, pid) = self.spawn(command)?;
                    let watched = Watched {
                        inner: transport,
                        closed: closed.clone(),
                    };
                    let client = handler.serve(watched).await.map_err(|e| {
                        format!("`{command}` started but did not complete the MCP handshake: {e}")
                    })?;
                    (client, pid)
                }
                Reach::Http { url } => {
                    let transport = self.http_transport(url)?;
                    let watched = Watched {
                        inner: transport,
                        closed: closed.clone(),
                    };
                    let client = handler
                        .serve(watched)
                        .await
                        .map_err(|e| format!("{url} did not complete the MCP handshake: {e}"))?;
                    (client, None)
                }
            };
            let tools = client
                .peer()
                .list_all_tools()
                .await
                .map_err(|e| format!("the server did not list its tools: {e}"))?;
            Ok::<_, String>((client, pid, tools))
        })
        .await
        .map_err(|_| {
            format!(
                "the server did not start, complete the handshake and list its tools within \
                 {} (start_timeout)",
                humantime::format_duration(limit)
            )
        });
        let (client, pid, tools) = started.and_then(|r| r).map_err(|why| {
            format!(
                "MCP server {} cannot be used: {}",
                self.config.name,
                self.redact(&why)
            )
        })?;
        self.listing.apply(&tools);
        let relister = tokio::spawn(relist(
            client.peer().clone(),
            self.listing.clone(),
            changed,
            closed.clone(),
            limit,
            bearer_token(&self.config),
        ));
        Ok(Connection {
            serial,
            client,
            closed,
            pid,
            relister,
        })
    }

    /// Starts the stdio server: the configured command in an environment of its own,
    /// its stderr copied to the log.
    fn spawn(&self, command: &str) -> Result<(TokioChildProcess, Option<u32>), String> {
        let mut cmd = tokio::process::Command::new(command);
        cmd.args(&self.config.args).env_clear().kill_on_drop(true);
        for name in INHERITED_ENV
            .iter()
            .copied()
            .chain(self.config.pass_env.iter().map(String::as_str))
        {
            if let Some(value) = std::env::var_os(name) {
                cmd.env(name, value);
            }
        }
        cmd.envs(&self.config.env);
        if let Some(dir) = &self.config.cwd {
            cmd.current_dir(dir);
        }
        let (transport, stderr) = TokioChildProcess::builder(cmd)
            .stderr(std::process::Stdio::piped())
            .spawn()
            .map_err(|e| format!("cannot start `{command}`: {e}"))?;
        let pid = transport.id();
        if let Some(stderr) = stderr {
            let server = self.config.name.clone();
            tokio::spawn(async move {
                let mut lines = tokio::io::BufReader::new(stderr).lines();
                while let Ok(Some(line)) = lines.next_line().await {
                    tracing::info!(server = %server, pid, "mcp server: {line}");
                }
            });
        }
        Ok((transport, pid))
    }

    /// The streamable-HTTP transport to `url`, with the bearer token when one is
    /// configured, which is masked in everything the server answers.
    fn http_transport(
        &self,
        url: &str,
    ) -> Result<StreamableHttpClientTransport<MaskedHttp>, String> {
        // The HTTP client needs a TLS provider even for plain http; the worker's binary
        // installs ring, and a worker hosted elsewhere may not have one yet.
        let _ = rustls::crypto::ring::default_provider().install_default();
        // A server restarted since the session began answers it with 404: open a new
        // session and send the call again, rather than fail it.
        let mut config =
            StreamableHttpClientTransportConfig::with_uri(url).reinit_on_expired_session(true);
        let mut token = None;
        if let Some(var) = &self.config.bearer_token_env {
            let value = std::env::var(var).map_err(|_| {
                format!(
                    "bearer_token_env names {var}, which is not set in the worker's environment"
                )
            })?;
            config = config.auth_header(value.clone());
            token = Some(value);
        }
        let client = MaskedHttp::new(token.as_deref())?;
        Ok(StreamableHttpClientTransport::with_client(client, config))
    }

    /// Calls `tool` with `arguments` and turns the answer into the call's output; every
    /// way the server can fail is a [`ToolError::Failed`] naming it.
    pub(super) async fn call(
        &self,
        offer: &Offer,
        arguments: &Value,
    ) -> Result<ToolOutput, ToolError> {
        let name = &offer.entry.name;
        let failed = |detail: String| ToolError::Failed {
            tool: name.clone().into(),
            detail,
        };
        let server = &self.config.name;
        let (peer, serial, closed) = self.peer().await.map_err(|why| {
            failed(format!(
                "{why}; the worker tries the server again on the next call"
            ))
        })?;
        let tool = offer.entry.tool.as_str();
        if !self.listing.lists(tool) {
            return Err(failed(format!(
                "MCP server {server} does not list tool {tool} now (it lists: {}); the tool \
                 catalog declares it, but only a listed tool can be called",
                describe(&self.listing.names())
            )));
        }
        let params = CallToolRequestParams::new(tool.to_owned())
            .with_arguments(arguments.as_object().cloned().unwrap_or_default());
        let limit = self.config.call_timeout;
        let answer = tokio::select! {
            biased;
            answer = tokio::time::timeout(limit, peer.call_tool(params)) => match answer {
                Ok(Ok(result)) => Ok(result),
                Ok(Err(ServiceError::McpError(e))) => Err(Lost::Refused(
                    self.redact(&format!("JSON-RPC error {}: {}", e.code.0, e.message)),
                )),
                Ok(Err(e @ (ServiceError::TransportClosed | ServiceError::TransportSend(_)))) => {
                    Err(Lost::Closed(self.redact(&e.to_string())))
                }
                Ok(Err(e)) => Err(Lost::Other(self.redact(&e.to_string()))),
                Err(_) => Err(Lost::TimedOut),
            },
            () = closed.cancelled() => Err(Lost::Closed("the connection ended".into())),
        };
        let result = match answer {
            Ok(result) => result,
            Err(Lost::Closed(why)) => {
                self.lost(serial, &why).await;
                let next = match self.config.transport() {
                    Reach::Stdio { .. } => "the worker starts it again on the next call",
                    Reach::Http { .. } => "the worker reaches it again on the next call",
                };
                return Err(failed(format!(
                    "MCP server {server} went away during the call ({why}: the server exited, \
                     was stopped or dropped the connection); {next}"
                )));
            }
            Err(Lost::TimedOut) => {
                return Err(failed(format!(
                    "MCP server {server} did not answer within {} (call_timeout); the call \
                     was cancelled",
                    humantime::format_duration(limit)
                )));
            }
            Err(Lost::Refused(why)) => {
                return Err(failed(format!(
                    "MCP server {server} refused the call: {}",
                    clip(&why)
                )));
            }
            Err(Lost::Other(why)) => {
                return Err(failed(format!("MCP server {server}: {}", clip(&why))));
            }
        };
        let content = serde_json::to_value(&result.content).unwrap_or(Value::Null);
        if result.is_error == Some(true) {
            return Err(failed(format!(
                "MCP server {server} answered that the call failed: {}",
                clip(&self.redact(&text_of(&content)))
            )));
        }
        let mut output = Map::new();
        output.insert("server".into(), json!(server));
        output.insert("tool".into(), json!(tool));
        output.insert("content".into(), content);
        if let Some(structured) = result.structured_content {
            output.insert("structured_content".into(), structured);
        }
        let mut output = Value::Object(output);
        // Stored as evidence and read by the model: never with the bearer token in it.
        if let Some(mask) = bearer_token(&self.config).as_deref().and_then(Mask::new) {
            mask.value(&mut output);
        }
        let output = ToolOutput::new(output, false);
        let size = output.bytes.len() as u64;
        if size > self.config.max_output_bytes {
            return Err(failed(format!(
                "MCP server {server} answered with {size} bytes, more than the {} the worker \
                 accepts (max_output_bytes); ask for less",
                self.config.max_output_bytes
            )));
        }
        Ok(output)
    }

    /// `text` with the server's bearer token masked: a server may quote the credential
    /// it refuses, and error texts reach the logs, the model and the task's result.
    fn redact(&self, text: &str) -> String {
        redact(text, bearer_token(&self.config).as_deref())
    }
}

/// The bearer token `bearer_token_env` names, when the worker's variable holds one.
fn bearer_token(config: &McpServerConfig) -> Option<String> {
    let var = config.bearer_token_env.as_ref()?;
    std::env::var(var).ok().filter(|token| !token.is_empty())
}

/// `text` with every occurrence of `token` masked.
fn redact(text: &str, token: Option<&str>) -> String {
    match token.and_then(Mask::new) {
        Some(mask) => mask.error_text(text),
        None => text.to_owned(),
    }
}

/// Lists the tools again each time the server says they changed, until the connection
/// ends.
async fn relist(
    peer: rmcp::Peer<RoleClient>,
    listing: Arc<Listing>,
    changed: Arc<Notify>,
    closed: CancellationToken,
    limit: Duration,
    bearer_token: Option<String>,
) {
    loop {
        tokio::select! {
            () = changed.notified() => {}
            () = closed.cancelled() => return,
        }
        match tokio::time::timeout(limit, peer.list_all_tools()).await {
            Ok(Ok(tools)) => listing.apply(&tools),
            Ok(Err(e)) => {
                let error = redact(&e.to_string(), bearer_token.as_deref());
                tracing::warn!(server = %listing.server, %error, "listing the MCP server's tools again failed; the last listing stays");
            }
            Err(_) => {
                tracing::warn!(server = %listing.server, "the MCP server did not list its tools in time; the last listing stays");
            }
        }
    }
}

/// The text blocks of a result's content, one per line.
fn text_of(content: &Value) -> String {
    let texts: Vec<&str> = content
        .as_array()
        .into_iter()
        .flatten()
        .filter(|b| b["type"] == "text")
        .filter_map(|b| b["text"].as_str())
        .collect();
    if texts.is_empty() {
        "(no text)".to_owned()
    } else {
        texts.join("\n")
    }
}

/// `text` cut to [`MAX_ERROR_TEXT`] characters.
fn clip(text: &str) -> String {
    crate::provider::clip(text, MAX_ERROR_TEXT)
}

fn describe(names: &[String]) -> String {
    if names.is_empty() {
        "nothing".to_owned()
    } else {
        names.join(", ")
    }
}
