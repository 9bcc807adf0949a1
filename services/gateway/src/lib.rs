//! The A2A gateway (`convene-gateway`): other agents discover convene over A2A 1.0 and
//! hand it work.
//!
//! - **Agent Card** at `/.well-known/agent-card.json`, public: both bindings (JSON-RPC
//!   at [`card::JSONRPC_PATH`], HTTP+JSON at [`card::REST_PATH`], below `public_url`),
//!   streaming, HTTP Bearer security, and one skill per run template ([`card`]).
//! - **Authentication** ([`auth`]): the bearer is a principal credential, checked
//!   against the policy file before the SDK's bindings see the request; 401 and 403
//!   carry `WWW-Authenticate`.
//! - **Operations** ([`handler`]): each A2A task is one run, started from a skill's
//!   template on the supervisor with the caller's own credential; its state, artifacts
//!   and updates follow the run ([`convert`]). Tasks belong to the principal that
//!   created them.
//! - **The mapping** task ↔ run is kept in the service's database ([`tasks`]), so any
//!   replica sharing it serves any task.
//! - **Tracing**: a caller's `traceparent` header parents the gateway's span; the run it
//!   starts links to it.
//!
//! The bindings are the official A2A Rust SDK's (`a2a-server-lf`), with
//! [`handler::Gateway`] as their request handler.
//!
//! The same listener serves the operator console under `/console/` ([`console`]), when
//! the gateway has a credential to act with.
#![forbid(unsafe_code)]

pub mod auth;
pub mod card;
pub mod config;
pub mod console;
pub mod convert;
pub mod handler;
pub mod tasks;

use std::net::SocketAddr;
use std::sync::Arc;

use a2a_server::StaticAgentCard;
use a2a_server::agent_card::agent_card_router;
use a2a_server::jsonrpc::jsonrpc_router;
use a2a_server::rest::rest_router;
use axum::middleware::from_fn_with_state;
use convene_mesh::handles::{GrpcSupervisor, SupervisorHandle};
use convene_mesh::policy_file::Policy;
use convene_server::{GrpcServer, Shutdown};
use convene_supervisor::templates::Templates;

pub use config::{Config, DEFAULT_HTTP_LISTEN, DEFAULT_PORT, HttpListen};
pub use handler::Gateway;
pub use tasks::TaskMap;

/// Errors starting or running the gateway.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The policy file could not be loaded.
    #[error(transparent)]
    Policy(#[from] convene_mesh::policy_file::Error),
    /// The run templates could not be loaded.
    #[error(transparent)]
    Templates(#[from] convene_supervisor::Error),
    /// The supervisor endpoint is invalid.
    #[error(transparent)]
    Endpoint(#[from] convene_mesh::handles::EndpointError),
    /// The database named by `database_url` cannot be opened.
    #[error(transparent)]
    Database(#[from] convene_store::Error),
    /// An address could not be bound.
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The console's credential file cannot be read.
    #[error(
        "cannot read console_credential_file {path}: {source}; point it at the file holding the console principal's credential"
    )]
    ConsoleCredential {
        /// The file.
        path: std::path::PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The HTTP server failed.
    #[error("the A2A HTTP server failed: {0}")]
    Http(std::io::Error),
    /// The gRPC server failed.
    #[error(transparent)]
    Serve(#[from] convene_server::ServeError),
}

/// The HTTP application: the public card, and both bindings behind the access check.
pub fn router(gateway: Gateway, policy: Arc<Policy>, card: a2a::AgentCard) -> axum::Router {
    let handler = Arc::new(gateway);
    let jsonrpc = jsonrpc_router(handler.clone())
        .layer(from_fn_with_state(policy.clone(), auth::jsonrpc_access));
    let rest = rest_router(handler).layer(from_fn_with_state(policy, auth::rest_access));
    agent_card_router(Arc::new(StaticAgentCard::new(card)))
        .nest(card::JSONRPC_PATH, jsonrpc)
        .nest(card::REST_PATH, rest)
}

/// Binds the A2A HTTP listener (`http_listen`), or nothing when it is `off`.
///
/// # Errors
///
/// [`Error::Bind`] when the address cannot be bound.
pub async fn bind_http(listen: HttpListen) -> Result<Option<tokio::net::TcpListener>, Error> {
    match listen.addr() {
        None => Ok(None),
        Some(addr) => tokio::net::TcpListener::bind(addr)
            .await
            .map(Some)
            .map_err(|source| Error::Bind { addr, source }),
    }
}

/// Serves `router` on `listener` until `shutdown`: over TLS when the process has TLS
/// installed ([`convene_server::tls`]), else plaintext.
///
/// # Errors
///
/// [`Error::Http`] when the server fails.
pub async fn serve_http(
    listener: tokio::net::TcpListener,
    router: axum::Router,
    shutdown: Shutdown,
) -> Result<(), Error> {
    match convene_server::tls::installed().and_then(|t| t.server.as_ref()) {
        Some(tls) => {
            let listener =
                convene_server::tls::TlsListener::new(listener, tls).map_err(Error::Http)?;
            axum::serve(
                listener,
                router.into_make_service_with_connect_info::<console::ClientAddr>(),
            )
            .with_graceful_shutdown(shutdown.wait_owned())
            .await
            .map_err(Error::Http)
        }
        None => axum::serve(
            listener,
            router.into_make_service_with_connect_info::<console::ClientAddr>(),
        )
        .with_graceful_shutdown(shutdown.wait_owned())
        .await
        .map_err(Error::Http),
    }
}

/// What the operator console needs beyond the gateway's own parts.
#[derive(Clone)]
pub struct ConsoleSettings {
    /// The approval service.
    pub approval: convene_mesh::handles::ApprovalHandle,
    /// The evidence store.
    pub evidence: convene_mesh::handles::EvidenceHandle,
    /// The credential the console acts with: a principal holding `principals:act-as`.
    pub credential: String,
    /// How long a session lasts.
    pub session_ttl: std::time::Duration,
    /// Jaeger's base URL, for links to a run's trace.
    pub jaeger_url: Option<String>,
}

/// The HTTP application of a gateway starting runs on `supervisor` from `templates`,
/// keeping its tasks (and the console's sessions) in `database` (in memory without
/// one), advertising `base` (the public URL, no trailing slash) on its card; with
/// `console`, the operator console under `/console/` too. Its cookies are `Secure` when
/// the process serves TLS or `base` is `https://`; its live streams check their session
/// every [`console::live_recheck_from_env`].
pub fn build(
    supervisor: SupervisorHandle,
    policy: Arc<Policy>,
    templates: &Templates,
    database: Option<convene_store::Database>,
    base: &str,
    console: Option<ConsoleSettings>,
) -> axum::Router {
    assemble(
        supervisor,
        policy,
        templates,
        database,
        base,
        console.map(|settings| (settings, console::live_recheck_from_env())),
    )
}

/// Whether browsers reach a gateway advertising `base` over HTTPS: it serves TLS, or
/// `base` is an `https://` URL (TLS ending at an ingress in front of it).
pub fn https(base: &str) -> bool {
    convene_server::tls::installed().is_some_and(|t| t.server.is_some())
        || base
            .get(..8)
            .is_some_and(|scheme| scheme.eq_ignore_ascii_case("https://"))
}

/// [`build`], the console's live streams checking their session every `live_recheck`.
fn assemble(
    supervisor: SupervisorHandle,
    policy: Arc<Policy>,
    templates: &Templates,
    database: Option<convene_store::Database>,
    base: &str,
    console: Option<(ConsoleSettings, std::time::Duration)>,
) -> axum::Router {
    let skills = templates.ids().into_iter().map(str::to_owned).collect();
    let card = card::agent_card(templates, base);
    let gateway = Gateway::new(
        supervisor.clone(),
        policy.clone(),
        TaskMap::new(database.clone()),
        skills,
    );
    let app = router(gateway, policy.clone(), card);
    match console {
        None => app,
        Some((settings, live_recheck)) => app.merge(console::router(Arc::new(console::Console {
            supervisor,
            approval: settings.approval,
            evidence: settings.evidence,
            policy,
            credential: settings.credential,
            sessions: console::Sessions::new(database),
            throttle: console::Throttle::default(),
            secure: https(base),
            session_ttl: settings.session_ttl,
            jaeger_url: settings.jaeger_url,
            live_recheck,
            sign_outs: console::SignOuts::default(),
        }))),
    }
}

/// The standalone gateway, as the `convene-gateway` binary runs it: A2A on
/// `http_listen`, gRPC health on `server.listen`, until `shutdown`.
///
/// # Errors
///
/// When the configuration cannot be loaded or a server fails.
pub async fn run(config: Config, shutdown: Shutdown) -> Result<(), Error> {
    let (policy, _) = config.policy_source().load()?;
    let policy = Arc::new(policy);
    let supervisor: SupervisorHandle =
        Arc::new(GrpcSupervisor::connect(&config.supervisor_endpoint)?);
    let http = bind_http(config.http_listen).await?;
    let bound = http.as_ref().and_then(|l| l.local_addr().ok());
    let templates = config.templates(&policy)?;
    let database = convene_store::open(config.database_url.as_deref(), &config.data_dir).await?;
    let approval: convene_mesh::handles::ApprovalHandle = Arc::new(
        convene_mesh::handles::GrpcApproval::connect(&config.approval_endpoint)?,
    );
    let evidence: convene_mesh::handles::EvidenceHandle = Arc::new(
        convene_mesh::handles::GrpcEvidenceStore::connect(&config.evidence_endpoint)?,
    );
    let console = config.console(&policy, approval, evidence)?;
    let app = assemble(
        supervisor,
        policy,
        &templates,
        database,
        &config.public_base(bound),
        console.map(|settings| (settings, config.console_live_recheck)),
    );
    let grpc = convene_server::bind(config.server.listen).await?;
    match bound {
        Some(addr) => {
            let base = config.public_base(Some(addr));
            println!(
                "A2A gateway on http://{addr} (Agent Card: {base}/.well-known/agent-card.json)"
            );
            tracing::info!(http = %addr, card = %format!("{base}/.well-known/agent-card.json"), supervisor = %config.supervisor_endpoint, "A2A gateway starting");
        }
        None => tracing::info!("A2A gateway starting with HTTP off (http_listen = off)"),
    }
    let grpc = GrpcServer::new(config.common.server.clone()).serve(grpc, shutdown.clone());
    match http {
        Some(listener) => {
            let (g, h) = tokio::join!(grpc, serve_http(listener, app, shutdown));
            g?;
            h
        }
        None => Ok(grpc.await?),
    }
}
