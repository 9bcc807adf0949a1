//! One delegation's exchange with a remote agent: admit and pin, read the card, send
//! the message, wait for the task, and turn its artifacts into what the loop stores.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use ::a2a::{
    AgentCard, AgentInterface, Artifact, GetTaskRequest, Message, Part, PartContent, Role,
    SendMessageConfiguration, SendMessageRequest, SendMessageResponse,
    TRANSPORT_PROTOCOL_HTTP_JSON, TRANSPORT_PROTOCOL_JSONRPC, Task, TaskState,
};
use a2a_client::auth::AuthInterceptor;
use a2a_client::jsonrpc::JsonRpcTransport;
use a2a_client::middleware::CallInterceptor;
use a2a_client::rest::RestTransport;
use a2a_client::{A2AClient, ServiceParams, Transport};
use convene_core::ids::content_hash;
use convene_core::time::from_timestamp;
use convene_proto::v1;
use reqwest::Url;
use serde_json::{Value, json};

use super::allow::{self, Allowlist, Dns};
use super::{A2aProvider, Bearer, EVIDENCE_KIND, EVIDENCE_SCHEME};
use crate::provider::{RemoteAnswer, RemoteArtifact, RemoteError, RemoteTask, clip};
use crate::tools::{canonical_json, format_time};

/// The largest agent card read.
const MAX_CARD_BYTES: usize = 256 * 1024;
/// The most artifacts one remote task may hand in.
const MAX_ARTIFACTS: usize = 64;
/// The first pause between two `GetTask` polls; it doubles up to [`MAX_POLL_PAUSE`].
const FIRST_POLL_PAUSE: Duration = Duration::from_millis(100);
/// The longest pause between two `GetTask` polls.
const MAX_POLL_PAUSE: Duration = Duration::from_secs(2);
/// How long the exchange may take when the task names no deadline.
const NO_DEADLINE: Duration = Duration::from_secs(60);
/// The longest a connection may take to open.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// What stands in for the bearer credential wherever a remote echoes it back.
const REDACTED: &str = "[redacted credential]";

/// The addresses each host of this exchange may be reached at: checked once, used for
/// every connection.
#[derive(Debug, Default)]
struct Pins {
    hosts: BTreeMap<String, Vec<SocketAddr>>,
}

impl Pins {
    /// Admits `url`; resolves its host unless it is pinned already. Returns whether a
    /// host was added (the client must then be built again).
    async fn admit(
        &mut self,
        allow: &Allowlist,
        dns: &dyn Dns,
        url: &Url,
    ) -> Result<bool, RemoteError> {
        let host = url.host_str().unwrap_or_default().to_owned();
        if self.hosts.contains_key(&host) {
            allow.check_url(url).map_err(refused)?;
            return Ok(false);
        }
        let addrs = allow.admit_with(url, dns).await.map_err(refused)?;
        self.hosts.insert(host, addrs);
        Ok(true)
    }

    /// An HTTP client that reaches the pinned hosts at their checked addresses and no
    /// other host at all: no DNS, no proxy, no redirect.
    fn client(&self, timeout: Duration) -> Result<reqwest::Client, RemoteError> {
        let mut builder = reqwest::Client::builder()
            .redirect(reqwest::redirect::Policy::none())
            .no_proxy()
            .dns_resolver(Arc::new(NoDns))
            .timeout(timeout)
            .connect_timeout(CONNECT_TIMEOUT.min(timeout))
            .user_agent(concat!("convene-worker/", env!("CARGO_PKG_VERSION")));
        for (host, addrs) in &self.hosts {
            // Only names go through resolution; an IP literal is connected to as written.
            let name = host.trim_start_matches('[').trim_end_matches(']');
            if name.parse::<std::net::IpAddr>().is_err() {
                builder = builder.resolve_to_addrs(name, addrs);
            }
        }
        builder.build().map_err(|e| RemoteError {
            code: "internal",
            retryable: false,
            message: format!("cannot build the HTTP client for the A2A call: {e}"),
        })
    }
}

/// The resolver behind the pinned names: refuses every other name.
struct NoDns;

impl reqwest::dns::Resolve for NoDns {
    fn resolve(&self, name: reqwest::dns::Name) -> reqwest::dns::Resolving {
        let message = format!(
            "{} was not admitted for this A2A call; the worker resolves names only while \
             admitting them",
            name.as_str()
        );
        Box::pin(std::future::ready(Err(message.into())))
    }
}

fn refused(r: allow::Refusal) -> RemoteError {
    RemoteError {
        code: "a2a_refused",
        retryable: false,
        message: r.to_string(),
    }
}

/// Adds fixed headers to every call (the run's `traceparent`).
struct Headers(Vec<(String, String)>);

#[async_trait::async_trait]
impl CallInterceptor for Headers {
    async fn before(
        &self,
        _method: &str,
        params: &mut ServiceParams,
    ) -> Result<(), ::a2a::A2AError> {
        for (name, value) in &self.0 {
            params.insert(name.clone(), vec![value.clone()]);
        }
        Ok(())
    }
}

/// Who is called, for messages and evidence.
struct Peer<'a> {
    provider: &'a A2aProvider,
    /// The interface the call went to, once chosen.
    endpoint: String,
    binding: String,
}

impl Peer<'_> {
    /// `text` from the remote, safe to put in a message: the credential masked, cut short.
    fn quote(&self, text: &str) -> String {
        clip(&redact(text, self.provider.bearer.as_ref()), 300)
    }

    fn error(&self, code: &'static str, retryable: bool, what: String) -> RemoteError {
        RemoteError {
            code,
            retryable,
            message: format!("the A2A agent at {}: {what}", self.provider.agent),
        }
    }

    /// An error of the SDK's client, by what it says went wrong.
    fn failed_call(&self, method: &str, e: &::a2a::A2AError) -> RemoteError {
        let said = self.quote(&e.message);
        if e.message.starts_with("HTTP request failed") {
            self.error(
                "remote_unavailable",
                true,
                format!("{method} to {} could not be sent: {said}", self.endpoint),
            )
        } else if e.code == ::a2a::error_code::INTERNAL_ERROR
            && (e.message.starts_with("failed to parse")
                || e.message.starts_with("failed to deserialize")
                || e.message.contains("missing result"))
        {
            self.error(
                "remote_protocol_error",
                false,
                format!(
                    "{method} to {} did not get an A2A {} answer: {said}",
                    self.endpoint, self.binding
                ),
            )
        } else {
            self.error(
                "remote_error",
                false,
                format!(
                    "{method} to {} answered error {} ({}): {said}",
                    self.endpoint,
                    e.code,
                    ::a2a::error_reason(e.code)
                ),
            )
        }
    }
}

/// `text` with every occurrence of the credential masked.
fn redact(text: &str, bearer: Option<&Bearer>) -> String {
    match bearer {
        Some(b) if !b.expose().is_empty() && text.contains(b.expose()) => {
            text.replace(b.expose(), REDACTED)
        }
        _ => text.to_owned(),
    }
}

/// Time left until the task's deadline (a fallback when it has none).
fn time_left(task: &v1::DelegationTask) -> Duration {
    task.deadline
        .as_ref()
        .and_then(|d| from_timestamp(d, "task.deadline").ok())
        .map_or(NO_DEADLINE, |d| {
            d.duration_since(SystemTime::now())
                .unwrap_or(Duration::ZERO)
                .max(Duration::from_secs(1))
        })
}

/// Hands `task` to `provider`'s agent and waits for its answer.
pub(super) async fn delegate(
    provider: &A2aProvider,
    task: RemoteTask<'_>,
) -> Result<RemoteAnswer, RemoteError> {
    let started = Instant::now();
    let budget = time_left(task.task);
    let mut peer = Peer {
        provider,
        endpoint: provider.card_url.to_string(),
        binding: "agent card".to_owned(),
    };
    let mut pins = Pins::default();
    pins.admit(&provider.allow, provider.dns.as_ref(), &provider.card_url)
        .await?;
    let mut client = pins.client(budget)?;
    let card = fetch_card(&peer, &client, &provider.card_url).await?;
    let iface = choose_interface(&peer, &card)?;
    let endpoint = Url::parse(&iface.url).map_err(|e| {
        peer.error(
            "remote_protocol_error",
            false,
            format!(
                "its card names the interface URL {:?}, which is not a URL ({e})",
                peer.quote(&iface.url)
            ),
        )
    })?;
    if pins
        .admit(&provider.allow, provider.dns.as_ref(), &endpoint)
        .await?
    {
        client = pins.client(budget)?;
    }
    peer.endpoint = allow::shown(&endpoint);
    peer.binding.clone_from(&iface.protocol_binding);

    let transport: Box<dyn Transport> = if iface.protocol_binding == TRANSPORT_PROTOCOL_JSONRPC {
        Box::new(JsonRpcTransport::new(client, iface.url.clone()))
    } else {
        Box::new(RestTransport::new(client, iface.url.clone()))
    };
    let mut interceptors: Vec<Arc<dyn CallInterceptor>> = Vec::new();
    if let Some(bearer) = &provider.bearer {
        interceptors.push(Arc::new(AuthInterceptor::bearer(bearer.expose())));
    }
    if let Some(traceparent) = convene_telemetry::traceparent(&tracing::Span::current()) {
        interceptors.push(Arc::new(Headers(vec![(
            convene_telemetry::TRACEPARENT.to_owned(),
            traceparent,
        )])));
    }
    let mut a2a = A2AClient::new(transport).with_interceptors(interceptors);
    if let Some(tenant) = iface.tenant.as_deref().filter(|t| !t.is_empty()) {
        a2a = a2a.with_tenant(tenant);
    }

    let (request, fingerprint) = message(task);
    let response = a2a
        .send_message(&request)
        .await
        .map_err(|e| peer.failed_call("SendMessage", &e))?;
    let span = tracing::Span::current();
    let (task_id, summary, artifacts) = match response {
        SendMessageResponse::Message(m) => {
            span.record("convene.a2a.state", "MESSAGE");
            let summary = text_of(&m.parts);
            let artifact = Answered::Message(&m);
            (String::new(), summary, vec![artifact.stored(&peer, "")?])
        }
        SendMessageResponse::Task(t) => {
            let t = finish(&peer, &a2a, t, started, budget).await?;
            span.record("convene.a2a.task_id", t.id.as_str());
            span.record("convene.a2a.state", state_name(&t.status.state));
            check_state(&peer, &t)?;
            let artifacts = t.artifacts.as_deref().unwrap_or_default();
            if artifacts.len() > MAX_ARTIFACTS {
                return Err(peer.error(
                    "remote_protocol_error",
                    false,
                    format!(
                        "task {} handed in {} artifacts, more than the {MAX_ARTIFACTS} a \
                         delegation records",
                        peer.quote(&t.id),
                        artifacts.len()
                    ),
                ));
            }
            let stored = artifacts
                .iter()
                .map(|a| Answered::Artifact(a).stored(&peer, &t.id))
                .collect::<Result<Vec<_>, _>>()?;
            let summary = t
                .status
                .message
                .as_ref()
                .map(|m| text_of(&m.parts))
                .unwrap_or_default();
            (t.id, summary, stored)
        }
    };
    let host = match (provider.card_url.host_str(), provider.card_url.port()) {
        (Some(h), Some(p)) => format!("{h}:{p}"),
        (Some(h), None) => h.to_owned(),
        (None, _) => "agent".to_owned(),
    };
    Ok(RemoteAnswer {
        agent: provider.agent.clone(),
        source: format!("{EVIDENCE_SCHEME}:{}", provider.agent),
        evidence_base: format!("{EVIDENCE_SCHEME}://{host}"),
        kind: EVIDENCE_KIND.to_owned(),
        task_id,
        summary: redact(&summary, provider.bearer.as_ref()),
        request_fingerprint: fingerprint,
        artifacts,
    })
}

/// Reads the agent card at `url`.
async fn fetch_card(
    peer: &Peer<'_>,
    client: &reqwest::Client,
    url: &Url,
) -> Result<AgentCard, RemoteError> {
    let mut response = client
        .get(url.clone())
        .header(reqwest::header::ACCEPT, "application/json")
        .send()
        .await
        .map_err(|e| {
            peer.error(
                "remote_unavailable",
                true,
                format!(
                    "its agent card could not be read from {}: {e}",
                    peer.endpoint
                ),
            )
        })?;
    let status = response.status();
    if status.is_redirection() {
        return Err(peer.error(
            "a2a_refused",
            false,
            format!(
                "its agent card URL {} answered {status}, a redirect, which the worker does not \
                 follow; name the final URL in the profile",
                peer.endpoint
            ),
        ));
    }
    if !status.is_success() {
        return Err(peer.error(
            if status.is_server_error() {
                "remote_unavailable"
            } else {
                "remote_protocol_error"
            },
            status.is_server_error(),
            format!("its agent card URL {} answered {status}", peer.endpoint),
        ));
    }
    let mut body = Vec::new();
    while let Some(chunk) = response.chunk().await.map_err(|e| {
        peer.error(
            "remote_unavailable",
            true,
            format!("its agent card at {} broke off: {e}", peer.endpoint),
        )
    })? {
        if body.len() + chunk.len() > MAX_CARD_BYTES {
            return Err(peer.error(
                "remote_protocol_error",
                false,
                format!(
                    "its agent card at {} is larger than {MAX_CARD_BYTES} bytes",
                    peer.endpoint
                ),
            ));
        }
        body.extend_from_slice(&chunk);
    }
    serde_json::from_slice(&body).map_err(|e| {
        peer.error(
            "remote_protocol_error",
            false,
            format!(
                "{} is not an A2A agent card ({e}); check the profile's url",
                peer.endpoint
            ),
        )
    })
}

/// The interface to call: JSON-RPC, else HTTP+JSON, of A2A 1.x.
fn choose_interface(peer: &Peer<'_>, card: &AgentCard) -> Result<AgentInterface, RemoteError> {
    let major_one = |i: &&AgentInterface| {
        let v = i.protocol_version.trim();
        v.is_empty() || v == "1" || v.starts_with("1.")
    };
    [TRANSPORT_PROTOCOL_JSONRPC, TRANSPORT_PROTOCOL_HTTP_JSON]
        .iter()
        .find_map(|binding| {
            card.supported_interfaces
                .iter()
                .filter(major_one)
                .find(|i| i.protocol_binding.eq_ignore_ascii_case(binding))
                .map(|i| AgentInterface {
                    protocol_binding: (*binding).to_owned(),
                    ..i.clone()
                })
        })
        .ok_or_else(|| {
            let offered: Vec<String> = card
                .supported_interfaces
                .iter()
                .map(|i| format!("{} {}", i.protocol_binding, i.protocol_version))
                .collect();
            peer.error(
                "remote_protocol_error",
                false,
                format!(
                    "its card offers no JSONRPC or HTTP+JSON interface of A2A 1.x (it offers: \
                     {})",
                    peer.quote(&if offered.is_empty() {
                        "none".to_owned()
                    } else {
                        offered.join(", ")
                    })
                ),
            )
        })
}

/// The message that hands over `task`, and its fingerprint.
fn message(task: RemoteTask<'_>) -> (SendMessageRequest, String) {
    let t = task.task;
    let mut text = String::new();
    if !task.instructions.trim().is_empty() {
        text.push_str(task.instructions.trim());
        text.push_str("\n\n");
    }
    text.push_str(&format!("Goal: {}\n", t.goal.trim()));
    if !t.acceptance_criteria.is_empty() {
        text.push_str("Acceptance criteria:\n");
        for c in &t.acceptance_criteria {
            text.push_str(&format!("- {c}\n"));
        }
    }
    let time = |ts: Option<&prost_types::Timestamp>| {
        ts.and_then(|ts| from_timestamp(ts, "time").ok())
            .map(format_time)
    };
    let scope = t.scope.as_ref().map(|s| {
        let range = s.time_range.as_ref();
        json!({
            "resources": s.resources,
            "time_range": {
                "start": time(range.and_then(|r| r.start.as_ref())),
                "end": time(range.and_then(|r| r.end.as_ref())),
            },
        })
    });
    let inputs = json!({
        "run_id": t.run_id,
        "delegation_id": t.delegation_id,
        "name": t.name,
        "profile_id": t.profile_id,
        "goal": t.goal,
        "acceptance_criteria": t.acceptance_criteria,
        "scope": scope,
        "input_refs": t.input_refs,
        "deadline": time(t.deadline.as_ref()),
    });
    let fingerprint =
        content_hash(canonical_json(&json!({ "text": text, "inputs": inputs })).as_bytes());
    let message = Message::new(
        Role::User,
        vec![
            Part::text(text).with_media_type("text/plain"),
            Part::data(inputs).with_media_type("application/json"),
        ],
    );
    let request = SendMessageRequest {
        message,
        configuration: Some(SendMessageConfiguration {
            accepted_output_modes: None,
            task_push_notification_config: None,
            history_length: Some(0),
            return_immediately: Some(false),
        }),
        metadata: None,
        tenant: None,
    };
    (request, fingerprint)
}

/// Waits for `task` to finish (or stop for input): polls `GetTask`, pausing longer each
/// time, within `budget` of `started`.
async fn finish<T: Transport>(
    peer: &Peer<'_>,
    a2a: &A2AClient<T>,
    mut task: Task,
    started: Instant,
    budget: Duration,
) -> Result<Task, RemoteError> {
    let mut pause = FIRST_POLL_PAUSE;
    let id = task.id.clone();
    while !settled(&task.status.state) {
        if started.elapsed() + pause >= budget {
            return Err(peer.error(
                "timeout",
                false,
                format!(
                    "task {} was still {} when the delegation's deadline came",
                    peer.quote(&id),
                    state_name(&task.status.state)
                ),
            ));
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(MAX_POLL_PAUSE);
        task = a2a
            .get_task(&GetTaskRequest {
                id: id.clone(),
                history_length: Some(0),
                tenant: None,
            })
            .await
            .map_err(|e| peer.failed_call("GetTask", &e))?;
        if task.id != id {
            return Err(peer.error(
                "remote_protocol_error",
                false,
                format!(
                    "GetTask for task {} answered task {}",
                    peer.quote(&id),
                    peer.quote(&task.id)
                ),
            ));
        }
    }
    Ok(task)
}

/// Whether the task will not change without the caller: finished, or waiting for input.
fn settled(state: &TaskState) -> bool {
    state.is_terminal() || matches!(state, TaskState::InputRequired | TaskState::AuthRequired)
}

fn state_name(state: &TaskState) -> &'static str {
    match state {
        TaskState::Unspecified => "UNSPECIFIED",
        TaskState::Submitted => "SUBMITTED",
        TaskState::Working => "WORKING",
        TaskState::Completed => "COMPLETED",
        TaskState::Failed => "FAILED",
        TaskState::Canceled => "CANCELED",
        TaskState::InputRequired => "INPUT_REQUIRED",
        TaskState::Rejected => "REJECTED",
        TaskState::AuthRequired => "AUTH_REQUIRED",
    }
}

/// A settled task that did not complete, as an error.
fn check_state(peer: &Peer<'_>, task: &Task) -> Result<(), RemoteError> {
    let said = task
        .status
        .message
        .as_ref()
        .map(|m| text_of(&m.parts))
        .filter(|t| !t.trim().is_empty())
        .map_or_else(|| "it gave no reason".to_owned(), |t| peer.quote(&t));
    let id = peer.quote(&task.id);
    let (code, what) = match task.status.state {
        TaskState::Completed => return Ok(()),
        TaskState::Failed => ("remote_failed", format!("task {id} FAILED: {said}")),
        TaskState::Rejected => ("remote_rejected", format!("task {id} was REJECTED: {said}")),
        TaskState::Canceled => ("remote_canceled", format!("task {id} was CANCELED: {said}")),
        TaskState::InputRequired | TaskState::AuthRequired => (
            "remote_needs_input",
            format!(
                "task {id} stopped in {} ({said}); a delegation cannot answer it: give the \
                 agent what it needs in the delegation's goal and inputs, or its credential \
                 in the profile's credential_env",
                state_name(&task.status.state)
            ),
        ),
        TaskState::Unspecified | TaskState::Submitted | TaskState::Working => (
            "remote_protocol_error",
            format!(
                "task {id} is {}, not finished",
                state_name(&task.status.state)
            ),
        ),
    };
    Err(peer.error(code, false, what))
}

/// The text parts of `parts`, joined by blank lines.
fn text_of(parts: &[Part]) -> String {
    parts
        .iter()
        .filter_map(Part::as_text)
        .collect::<Vec<_>>()
        .join("\n\n")
}

/// What the agent answered with: an artifact of its task, or a direct message.
enum Answered<'a> {
    Artifact(&'a Artifact),
    Message(&'a Message),
}

impl Answered<'_> {
    /// The artifact to store: canonical JSON naming the agent, the interface, the remote
    /// task and what it answered (the credential masked, should the agent echo it).
    fn stored(&self, peer: &Peer<'_>, task_id: &str) -> Result<RemoteArtifact, RemoteError> {
        let (id, name, parts, key, answered) = match self {
            Answered::Artifact(a) => (
                a.artifact_id.clone(),
                a.name.clone().unwrap_or_default(),
                &a.parts,
                "artifact",
                serde_json::to_value(a),
            ),
            Answered::Message(m) => (
                m.message_id.clone(),
                "message".to_owned(),
                &m.parts,
                "message",
                serde_json::to_value(m),
            ),
        };
        let answered = answered.map_err(|e| {
            peer.error(
                "remote_protocol_error",
                false,
                format!("its {key} {} cannot be recorded: {e}", peer.quote(&id)),
            )
        })?;
        let envelope = json!({
            "a2a": {
                "agent": peer.provider.agent,
                "agent_card": peer.provider.card_url.as_str(),
                "endpoint": peer.endpoint,
                "binding": peer.binding,
                "task_id": task_id,
            },
            key: answered,
        });
        let content = redact(&canonical_json(&envelope), peer.provider.bearer.as_ref());
        let texts = parts
            .iter()
            .filter_map(Part::as_text)
            .map(|t| redact(t, peer.provider.bearer.as_ref()))
            .collect();
        let data = parts
            .iter()
            .filter_map(|p| match &p.content {
                PartContent::Data(v) => Some(v.clone()),
                _ => None,
            })
            .collect::<Vec<Value>>();
        Ok(RemoteArtifact {
            id,
            name,
            content: content.into_bytes(),
            texts,
            data,
        })
    }
}

#[cfg(test)]
mod tests {
    use std::net::{IpAddr, Ipv4Addr};
    use std::sync::atomic::{AtomicUsize, Ordering};

    use axum::serve::ListenerExt as _;

    use super::*;
    use crate::a2a::RemoteSpec;

    /// The address the agent's name first resolves to: the one the worker checks.
    const CHECKED: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 1);
    /// Another loopback address, on the same port: where a later answer or a redirect
    /// points.
    const OTHER: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 2);
    /// The agent's host name, known only to the test's resolver.
    const NAME: &str = "agent.test";

    /// How a test agent answers.
    #[derive(Clone, Copy)]
    enum Serve {
        /// As an A2A agent: its card, then a task that completes at the first `GetTask`.
        Agent,
        /// Its card with a redirect to [`OTHER`].
        RedirectCard,
        /// Its card, then every JSON-RPC call with a redirect to [`OTHER`].
        RedirectRpc,
    }

    /// An A2A agent on `ip:port` that answers as `serve` says, closes every connection
    /// after one answer (so each request is dialled anew), and counts the connections it
    /// accepts.
    async fn agent(ip: Ipv4Addr, port: u16, base: String, serve: Serve) -> Arc<AtomicUsize> {
        use axum::http::{StatusCode, header};
        use axum::response::IntoResponse;
        use axum::routing::{get, post};
        let listener = tokio::net::TcpListener::bind((ip, port))
            .await
            .unwrap_or_else(|e| panic!("cannot listen on {ip}:{port}: {e}"));
        let dialled = Arc::new(AtomicUsize::new(0));
        let counter = dialled.clone();
        let listener = listener.tap_io(move |_| {
            counter.fetch_add(1, Ordering::SeqCst);
        });
        let elsewhere = move |path: &str| {
            (
                StatusCode::TEMPORARY_REDIRECT,
                [(header::LOCATION, format!("http://{OTHER}:{port}{path}"))],
            )
                .into_response()
        };
        let card = json!({
            "name": "History",
            "description": "Finds similar incidents.",
            "version": "1",
            "supportedInterfaces": [
                { "url": format!("{base}/rpc"), "protocolBinding": "JSONRPC", "protocolVersion": "1.0" }
            ],
            "capabilities": {},
            "defaultInputModes": ["text/plain"],
            "defaultOutputModes": ["text/plain"],
            "skills": []
        });
        let app = axum::Router::new()
            .route(
                "/.well-known/agent-card.json",
                get(move || async move {
                    match serve {
                        Serve::RedirectCard => elsewhere("/.well-known/agent-card.json"),
                        _ => axum::Json(card).into_response(),
                    }
                }),
            )
            .route(
                "/rpc",
                post(move |axum::Json(call): axum::Json<Value>| async move {
                    if matches!(serve, Serve::RedirectRpc) {
                        return elsewhere("/rpc");
                    }
                    let task = |state: &str| {
                        json!({ "id": "t-1", "contextId": "c-1", "status": { "state": state } })
                    };
                    let result = match call["method"].as_str() {
                        Some("SendMessage") => json!({ "task": task("TASK_STATE_WORKING") }),
                        Some("GetTask") => {
                            let mut done = task("TASK_STATE_COMPLETED");
                            done["artifacts"] = json!([{
                                "artifactId": "a-1",
                                "parts": [{ "text": format!("answered at {ip}") }]
                            }]);
                            done
                        }
                        other => panic!("an unexpected call {other:?}"),
                    };
                    axum::Json(json!({ "jsonrpc": "2.0", "id": call["id"], "result": result }))
                        .into_response()
                }),
            )
            .layer(axum::middleware::map_response(
                |mut response: axum::response::Response| async move {
                    response
                        .headers_mut()
                        .insert(header::CONNECTION, "close".parse().unwrap());
                    response
                },
            ));
        tokio::spawn(async move { axum::serve(listener, app).await });
        dialled
    }

    /// A free port on both [`CHECKED`] and [`OTHER`].
    fn shared_port() -> u16 {
        for _ in 0..20 {
            let first = std::net::TcpListener::bind((CHECKED, 0)).unwrap();
            let port = first.local_addr().unwrap().port();
            if std::net::TcpListener::bind((OTHER, port)).is_ok() {
                return port;
            }
        }
        panic!("no port is free on both {CHECKED} and {OTHER}");
    }

    /// A resolver whose first answer for [`NAME`] is [`CHECKED`] and every later one
    /// [`OTHER`]: DNS rebinding.
    #[derive(Default)]
    struct Rebinding {
        asked: AtomicUsize,
    }

    #[async_trait::async_trait]
    impl Dns for Rebinding {
        async fn lookup(&self, name: &str, port: u16) -> std::io::Result<Vec<SocketAddr>> {
            assert_eq!(name, NAME, "only the agent's name is looked up");
            let ip = if self.asked.fetch_add(1, Ordering::SeqCst) == 0 {
                CHECKED
            } else {
                OTHER
            };
            Ok(vec![SocketAddr::new(IpAddr::V4(ip), port)])
        }
    }

    /// The provider of a profile whose agent is at `url`, calling what `allow` and
    /// `allow_private` admit.
    fn provider(url: &str, allow: &[String], allow_private: &[&str]) -> A2aProvider {
        let private: Vec<String> = allow_private.iter().map(|p| (*p).to_owned()).collect();
        A2aProvider::new(
            "history",
            &RemoteSpec {
                url: url.to_owned(),
                ..RemoteSpec::default()
            },
            Arc::new(Allowlist::new(allow, &private).unwrap()),
        )
        .unwrap()
    }

    fn history_task() -> v1::DelegationTask {
        v1::DelegationTask {
            delegation_id: "del-1".into(),
            run_id: "run-1".into(),
            profile_id: "history".into(),
            goal: "Find similar incidents".into(),
            ..v1::DelegationTask::default()
        }
    }

    #[tokio::test]
    async fn a_resolved_address_is_pinned_so_a_second_answer_is_never_dialled() {
        let port = shared_port();
        let base = format!("http://{NAME}:{port}");
        let checked = agent(CHECKED, port, base.clone(), Serve::Agent).await;
        let other = agent(OTHER, port, base.clone(), Serve::Agent).await;
        // Only the first answer is an address the worker may reach: the later one is
        // what a rebinding name turns to.
        let mut provider = provider(&base, std::slice::from_ref(&base), &["127.0.0.1"]);
        let dns = Arc::new(Rebinding::default());
        provider.dns = dns.clone();

        let task = history_task();
        let answer = delegate(
            &provider,
            RemoteTask {
                task: &task,
                instructions: "",
            },
        )
        .await
        .unwrap_or_else(|e| panic!("the delegation completes at the checked address: {e:?}"));
        assert_eq!(
            other.load(Ordering::SeqCst),
            0,
            "the address of the later answer is never dialled"
        );
        assert_eq!(
            checked.load(Ordering::SeqCst),
            3,
            "the card, SendMessage and GetTask each dialled the checked address"
        );
        assert_eq!(
            dns.asked.load(Ordering::SeqCst),
            1,
            "the name is looked up once, for the card; the interface on the same host \
             reuses the checked addresses"
        );
        assert_eq!(answer.artifacts.len(), 1, "{answer:?}");
        assert_eq!(
            answer.artifacts[0].texts,
            [format!("answered at {CHECKED}")]
        );
    }

    #[tokio::test]
    async fn a_redirect_to_another_address_is_never_followed() {
        for (serve, code, says) in [
            (Serve::RedirectCard, "a2a_refused", "a redirect"),
            (Serve::RedirectRpc, "remote_protocol_error", "SendMessage"),
        ] {
            let port = shared_port();
            let base = format!("http://{CHECKED}:{port}");
            let checked = agent(CHECKED, port, base.clone(), serve).await;
            let other = agent(OTHER, port, base.clone(), Serve::Agent).await;
            // The redirect's target is on the allowlist and allow_private covers it:
            // only the refusal to follow redirects keeps the worker from it.
            let target = format!("http://{OTHER}:{port}");
            let provider = provider(&base, &[base.clone(), target], &["127.0.0.0/8"]);

            let task = history_task();
            let err = delegate(
                &provider,
                RemoteTask {
                    task: &task,
                    instructions: "",
                },
            )
            .await
            .expect_err("a redirect fails the delegation");
            assert_eq!(err.code, code, "{err:?}");
            assert!(!err.retryable, "{err:?}");
            assert!(err.message.contains(says), "{}", err.message);
            assert!(checked.load(Ordering::SeqCst) >= 1);
            assert_eq!(
                other.load(Ordering::SeqCst),
                0,
                "the redirect's target is never dialled"
            );
        }
    }

    #[test]
    fn the_credential_is_masked_wherever_a_remote_echoes_it() {
        let bearer = Bearer("tok-1234567".to_owned());
        assert_eq!(
            redact("got Bearer tok-1234567 ok", Some(&bearer)),
            "got Bearer [redacted credential] ok"
        );
        assert_eq!(redact("nothing here", Some(&bearer)), "nothing here");
        assert_eq!(redact("tok-1234567", None), "tok-1234567");
    }

    #[test]
    fn the_message_carries_the_goal_as_text_and_the_inputs_as_data() {
        let task = v1::DelegationTask {
            delegation_id: "del-1".into(),
            run_id: "run-1".into(),
            profile_id: "history".into(),
            goal: "Find similar incidents".into(),
            acceptance_criteria: vec!["Name the incident".into()],
            scope: Some(v1::TaskScope {
                resources: vec!["service/payment-api".into()],
                time_range: None,
            }),
            input_refs: vec!["logs://payment-api/x".into()],
            ..v1::DelegationTask::default()
        };
        let (request, fingerprint) = message(RemoteTask {
            task: &task,
            instructions: "Answer from the history.",
        });
        let parts = &request.message.parts;
        let text = parts[0].as_text().unwrap();
        assert!(
            text.starts_with("Answer from the history.\n\nGoal: Find similar"),
            "{text}"
        );
        assert!(text.contains("- Name the incident"), "{text}");
        let PartContent::Data(inputs) = &parts[1].content else {
            panic!("the second part is data: {parts:?}");
        };
        assert_eq!(inputs["delegation_id"], "del-1");
        assert_eq!(inputs["scope"]["resources"][0], "service/payment-api");
        assert_eq!(inputs["input_refs"][0], "logs://payment-api/x");
        assert_eq!(request.message.role, Role::User);
        let config = request.configuration.unwrap();
        assert_eq!(config.return_immediately, Some(false), "a blocking send");
        assert!(fingerprint.starts_with("sha256:"));
        let (_, again) = message(RemoteTask {
            task: &task,
            instructions: "Answer from the history.",
        });
        assert_eq!(
            fingerprint, again,
            "the same delegation, the same fingerprint"
        );
    }

    #[test]
    fn only_completed_tasks_pass() {
        let provider = A2aProvider {
            profile_id: "p".into(),
            agent: "https://agents.example.com/".into(),
            card_url: Url::parse("https://agents.example.com/.well-known/agent-card.json").unwrap(),
            credential_source: None,
            bearer: Some(Bearer("sekrit-token".into())),
            allow: Arc::new(Allowlist::default()),
            dns: Arc::new(allow::SystemDns),
        };
        let peer = Peer {
            provider: &provider,
            endpoint: "https://agents.example.com/".into(),
            binding: "JSONRPC".into(),
        };
        let task = |state: TaskState, said: &str| Task {
            id: "t-1".into(),
            context_id: "c-1".into(),
            status: ::a2a::TaskStatus {
                state,
                message: Some(Message::new(Role::Agent, vec![Part::text(said)])),
                timestamp: None,
            },
            artifacts: None,
            history: None,
            metadata: None,
        };
        check_state(&peer, &task(TaskState::Completed, "done")).unwrap();
        for (state, code) in [
            (TaskState::Failed, "remote_failed"),
            (TaskState::Rejected, "remote_rejected"),
            (TaskState::Canceled, "remote_canceled"),
            (TaskState::InputRequired, "remote_needs_input"),
            (TaskState::AuthRequired, "remote_needs_input"),
            (TaskState::Working, "remote_protocol_error"),
        ] {
            let err = check_state(&peer, &task(state, "no: sekrit-token")).unwrap_err();
            assert_eq!(err.code, code);
            assert!(!err.retryable);
            assert!(err.message.contains("https://agents.example.com/"), "{err}");
            assert!(err.message.contains("t-1"), "{err}");
            assert!(!err.message.contains("sekrit-token"), "{err}");
        }
    }
}
