//! The supervisor: the single owner of every run.
//!
//! A caller's `StartRun` is validated, planned into delegations with deterministic ids,
//! and handed to the run's actor ([`run`]), which asks the policy service for all of the
//! run's task tokens in one call, dispatches the delegations to live workers from the
//! [`registry`] within the run's limits, retries transient failures under the same
//! delegation id, verifies each result's evidence with the evidence store, and applies
//! the deterministic join on every result. The decision becomes the run's outcome;
//! proposed actions above R1 become approval requests, never actions.
//!
//! Runs and their events live behind [`store::RunStore`]; the supervisor is their only
//! writer and every commit carries the version it read, and the lease of the replica
//! that runs it. A restarted supervisor, or another replica once the lease expired,
//! resumes every unfinished run where its stored state left it ([`recovery`]). A run
//! that waits for people holds no actor; commands for runs (cancel, resume, a settled
//! approval request) work on any replica ([`commands`]). The outbox of CloudEvents reaches `WatchEvents` subscribers, and NATS JetStream when
//! configured ([`relay`]).
#![forbid(unsafe_code)]

mod admission;
mod commands;
mod config;
pub mod crash;
mod error;
pub mod events;
pub mod plan;
mod recovery;
pub mod registry;
mod relay;
mod revoke;
mod run;
mod service;
pub mod sql;
pub mod store;
pub mod templates;
mod trace;
mod watchers;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use convene_mesh::auth::{Authenticator, TokenKeys};
use convene_mesh::handles::{
    ApprovalHandle, EvidenceHandle, GrpcApproval, GrpcEvidenceStore, GrpcPolicy, PolicyHandle,
};
use convene_mesh::policy_file::{self, Policy};
use convene_proto::v1::{
    supervisor_server::SupervisorServer, worker_registry_server::WorkerRegistryServer,
};
use convene_server::{GrpcServer, Shutdown};
use tokio_util::sync::CancellationToken;

pub use config::{
    Config, DEFAULT_COMMIT_LINGER, DEFAULT_MAX_ACTIVE_RUNS, DEFAULT_MAX_WATCH_STREAMS,
    DEFAULT_NATS_STREAM, DEFAULT_NATS_SUBJECT_PREFIX, DEFAULT_PORT, INTERNAL_PORT_OFFSET,
    InternalArgs,
};
pub use crash::{CrashPoint, CrashSettings};
pub use registry::{Connector, MeshConnector, Registry, RegistrySettings};
pub use service::SupervisorService;
pub use sql::SqlRunStore;
pub use store::{MemoryStore, RunStore};
pub use templates::Templates;

/// How long a stopping supervisor waits for its run actors to end (they stop at the
/// shutdown signal; this bounds a stuck store write).
pub const ACTOR_STOP_GRACE: Duration = Duration::from_secs(10);

/// The file in a data directory holding the replica id of `convene up`'s supervisor.
pub const REPLICA_ID_FILE: &str = "supervisor-replica-id";

/// Errors starting the supervisor.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The policy file could not be loaded.
    #[error(transparent)]
    Policy(#[from] policy_file::Error),
    /// The supervisor's own credential could not be read or created.
    #[error("supervisor credential {path}: {source}")]
    Credential {
        /// The file.
        path: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// An endpoint of another service is invalid.
    #[error(transparent)]
    Endpoint(#[from] convene_mesh::handles::EndpointError),
    /// The server failed.
    #[error(transparent)]
    Serve(#[from] convene_server::ServeError),
    /// The listen address could not be bound.
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The database named by `database_url` cannot be opened.
    #[error(transparent)]
    Database(#[from] convene_store::Error),
    /// The run store cannot be read.
    #[error(transparent)]
    Store(store::StoreError),
    /// The configuration is inconsistent.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// The internal listener's client CA cannot be used.
    #[error("internal_client_ca (--internal-client-ca): {0}")]
    InternalTls(#[from] convene_server::tls::TlsError),
    /// The run templates file cannot be read, or a template in it is invalid.
    #[error("run templates {file}: {message}")]
    Templates {
        /// The templates file.
        file: String,
        /// What is wrong (naming the template) and what to fix.
        message: String,
    },
}

/// The replica id of the supervisor that keeps its state in `data_dir` on its own
/// (`convene up`): read from [`REPLICA_ID_FILE`], created on first use. Being stable
/// across restarts, it lets a restarted `convene up` take its unfinished runs back at
/// once.
///
/// # Errors
///
/// When the file cannot be read or written.
pub fn persistent_replica_id(data_dir: &std::path::Path) -> std::io::Result<String> {
    let path = data_dir.join(REPLICA_ID_FILE);
    match std::fs::read_to_string(&path) {
        Ok(id) if !id.trim().is_empty() => Ok(id.trim().to_owned()),
        Ok(_) => write_replica_id(&path),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => write_replica_id(&path),
        Err(e) => Err(e),
    }
}

fn write_replica_id(path: &std::path::Path) -> std::io::Result<String> {
    let id = uuid::Uuid::now_v7().to_string();
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(path, format!("{id}\n"))?;
    Ok(id)
}

/// Dispatch timing.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Settings {
    pub(crate) retry_backoff: Duration,
    pub(crate) max_retry_backoff: Duration,
    pub(crate) dispatch_grace: Duration,
    pub(crate) commit_linger: Duration,
    pub(crate) approval_ttl: Duration,
    /// Watch streams one principal may hold open ([`Config::max_watch_streams`]).
    pub(crate) max_watch_streams: usize,
}

/// What a run actor needs from the rest of the supervisor.
pub(crate) struct Deps {
    /// This replica's id and lease length, when the store leases runs (see
    /// [`RunStore::owner`]); None: no leases, no recovery.
    pub(crate) lease: Option<recovery::Lease>,
    pub(crate) crash: crash::Crash,
    /// What the run actors read "now" from: deadlines, timers, event and ledger times.
    pub(crate) clock: convene_core::time::Clock,
    pub(crate) policy: PolicyHandle,
    /// Revokes finished runs' tokens, many runs to a call.
    pub(crate) revoker: revoke::Revoker,
    pub(crate) evidence: EvidenceHandle,
    pub(crate) approval: ApprovalHandle,
    pub(crate) registry: Arc<Registry>,
    pub(crate) store: Arc<dyn RunStore>,
    pub(crate) policy_file: Arc<Policy>,
    pub(crate) credential: String,
    pub(crate) settings: Settings,
    pub(crate) live: Mutex<HashMap<String, run::Live>>,
    /// The places of the runs with an actor, against `max_active_runs`.
    pub(crate) admission: Arc<admission::Admission>,
    pub(crate) shutdown_token: CancellationToken,
    /// Every run actor's task, so a stopping supervisor can wait for them to close
    /// their runs' spans and give up their leases.
    pub(crate) actors: tokio_util::task::TaskTracker,
}

/// Everything the supervisor is built from.
pub struct Parts {
    /// The policy service.
    pub policy: PolicyHandle,
    /// The evidence store.
    pub evidence: EvidenceHandle,
    /// The approval service.
    pub approval: ApprovalHandle,
    /// The policy file (principals, profiles, catalog).
    pub policy_file: Arc<Policy>,
    /// The supervisor's own service credential.
    pub credential: String,
    /// Run storage.
    pub store: Arc<dyn RunStore>,
    /// How worker endpoints are reached.
    pub connector: Arc<dyn Connector>,
    /// Configuration (timings, leases, the relay, crash points).
    pub config: Config,
    /// Shutdown: streams end and in-flight dispatches are abandoned when it fires.
    pub shutdown: Shutdown,
}

/// Hands out worker handles whose calls prove they come from the supervisor: over
/// mutual TLS (an `https://` endpoint, and this process has a client certificate) the
/// certificate does, and the credential is not sent, so no worker ever holds it;
/// otherwise every call carries the supervisor's own credential, the one workers accept
/// Execute, PlanTurn and Cancel with (on plaintext the worker thus sees it: plaintext
/// meshes rely on their network, see docs/security.md).
struct AsSupervisor {
    inner: Arc<dyn Connector>,
    credential: Arc<str>,
}

impl Connector for AsSupervisor {
    fn connect(&self, endpoint: &str) -> Result<convene_mesh::handles::WorkerHandle, String> {
        let handle = self.inner.connect(endpoint)?;
        let certified = endpoint.starts_with("https://")
            && convene_server::tls::installed()
                .and_then(|t| t.client.as_ref())
                .is_some_and(|c| c.identity.is_some());
        Ok(if certified {
            handle
        } else {
            convene_mesh::handles::AsService::wrap(handle, self.credential.clone())
        })
    }

    fn requires_tls(&self) -> bool {
        self.inner.requires_tls()
    }
}

/// Builds the supervisor service and its worker registry from parts, and starts what
/// runs beside them until `parts.shutdown`: when the store leases runs to this replica
/// ([`RunStore::owner`], set by `with_owner`), lease renewal and the claiming and
/// resuming of unfinished runs (at once, then every `claim_interval`); when `nats_url`
/// is set, the event relay. Must be called inside a Tokio runtime.
pub fn build(parts: Parts) -> (SupervisorService, Arc<Registry>) {
    let keys = Arc::new(TokenKeys::refreshed_every(
        parts.policy.clone(),
        parts.config.common.key_refresh,
    ));
    let auth = Authenticator::new(parts.policy_file.clone(), keys);
    let registry = Arc::new(Registry::new(
        Arc::new(AsSupervisor {
            inner: parts.connector,
            credential: Arc::from(parts.credential.as_str()),
        }),
        RegistrySettings {
            lease_ttl: parts.config.lease_ttl,
            heartbeat_interval: parts.config.heartbeat_interval,
        },
        Authenticator::principals_only(parts.policy_file.clone()),
    ));
    let shutdown_token = CancellationToken::new();
    {
        let token = shutdown_token.clone();
        let shutdown = parts.shutdown.clone();
        tokio::spawn(async move {
            shutdown.wait().await;
            token.cancel();
        });
    }
    let lease = parts.store.owner().map(|(owner, ttl)| recovery::Lease {
        owner: owner.to_owned(),
        ttl,
        claim_interval: parts.config.claim_interval,
        stable: parts.config.replica_id.is_some(),
    });
    if let Some(url) = &parts.config.nats_url {
        relay::spawn(
            parts.store.clone(),
            relay::RelaySettings {
                url: url.clone(),
                stream: parts.config.nats_stream.clone(),
                subject_prefix: parts.config.nats_subject_prefix.clone(),
            },
            shutdown_token.clone(),
        );
    }
    let deps = Arc::new(Deps {
        lease,
        crash: crash::Crash::new(&parts.config.crash),
        clock: convene_core::time::Clock::system(),
        revoker: revoke::Revoker::spawn(parts.policy.clone(), parts.credential.clone()),
        policy: parts.policy,
        evidence: parts.evidence,
        approval: parts.approval,
        registry: registry.clone(),
        store: parts.store,
        policy_file: parts.policy_file,
        credential: parts.credential,
        settings: Settings {
            retry_backoff: parts.config.retry_backoff,
            max_retry_backoff: parts.config.max_retry_backoff,
            dispatch_grace: parts.config.dispatch_grace,
            commit_linger: parts.config.commit_linger,
            approval_ttl: parts.config.approval_ttl,
            max_watch_streams: parts.config.max_watch_streams,
        },
        live: Mutex::new(HashMap::new()),
        admission: admission::Admission::new(parts.config.max_active_runs),
        shutdown_token,
        actors: tokio_util::task::TaskTracker::new(),
    });
    recovery::spawn(deps.clone());
    commands::spawn(deps.clone());
    (SupervisorService::new(deps, auth, parts.shutdown), registry)
}

/// Adds the client API, the Supervisor gRPC service, to a server (the client
/// listener's).
pub fn add_to(server: GrpcServer, service: SupervisorService) -> GrpcServer {
    server.add_service(SupervisorServer::new(service))
}

/// Adds what only the mesh calls, the WorkerRegistry gRPC service, to a server (the
/// internal listener's; `convene up` serves it beside everything else on its one
/// address).
pub fn add_internal_to(server: GrpcServer, registry: Arc<Registry>) -> GrpcServer {
    server.add_service(WorkerRegistryServer::new(registry::RegistryService(
        registry,
    )))
}

/// The internal listener's TLS: the process's (the client listener's certificate),
/// requiring client certificates of `internal_client_ca` when it is set. None:
/// plaintext.
fn internal_tls(config: &Config) -> Result<Option<convene_server::tls::ServerTls>, Error> {
    let process = convene_server::tls::installed().and_then(|t| t.server.as_ref());
    match (&config.internal_client_ca, process) {
        (None, tls) => Ok(tls.cloned()),
        (Some(ca), Some(tls)) => Ok(Some(tls.with_client_ca(ca)?)),
        (Some(ca), None) => Err(Error::Config(format!(
            "internal_client_ca (--internal-client-ca) = {} needs TLS: pass --tls-cert FILE \
             --tls-key FILE (CONVENE_TLS_CERT, CONVENE_TLS_KEY) too",
            ca.display()
        ))),
    }
}

async fn bind(addr: SocketAddr) -> Result<(tokio::net::TcpListener, SocketAddr), Error> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|source| Error::Bind { addr, source })?;
    let bound = listener
        .local_addr()
        .map_err(|source| Error::Bind { addr, source })?;
    Ok((listener, bound))
}

/// Runs the supervisor as its own process: other services are reached over gRPC. Its
/// runs are leased to this replica ([`Config::replica`]); unfinished runs of the
/// database are resumed as their leases allow.
pub async fn run(config: Config, shutdown: Shutdown) -> Result<(), Error> {
    config.check()?;
    let replica = config.replica();
    tracing::info!(replica = %replica, lease_ttl = ?config.run_lease_ttl, "supervisor replica starting");
    let policy = Arc::new(config.policy_source().load()?.0);
    let templates = config.templates(&policy)?;
    let credential_path = config.credential_path();
    let credential = if config.credential_file.is_none() && config.dev_credentials {
        policy_file::dev_credential(&config.credentials_dir(), "supervisor")
    } else {
        std::fs::read_to_string(&credential_path).map(|s| s.trim().to_owned())
    }
    .map_err(|source| Error::Credential {
        path: credential_path.display().to_string(),
        source,
    })?;
    let parts = Parts {
        policy: Arc::new(GrpcPolicy::connect(&config.policy_endpoint)?),
        evidence: Arc::new(GrpcEvidenceStore::connect(&config.evidence_endpoint)?),
        approval: Arc::new(GrpcApproval::connect(&config.approval_endpoint)?),
        policy_file: policy,
        credential,
        store: sql::open_store(
            config.database_url.as_deref(),
            &config.data_dir,
            &replica,
            config.run_lease_ttl,
        )
        .await?,
        connector: Arc::new(MeshConnector::default()),
        config: config.clone(),
        shutdown: shutdown.clone(),
    };
    let internal_tls = internal_tls(&config)?;
    let internal_addr = config.internal_addr()?;
    let (service, registry) = build(parts);
    let service = service.with_templates(templates);
    // The internal listener first: a supervisor whose client port answers takes
    // registrations too.
    let (internal, internal_addr) = bind(internal_addr).await?;
    let (listener, addr) = bind(config.server.listen).await?;
    tracing::info!(%addr, %internal_addr, "supervisor listening: clients on addr, workers' registrations on internal_addr");
    // Other replicas forward calls for this replica's runs to it.
    let advertised = config
        .advertise_endpoint
        .clone()
        .or_else(|| (!addr.ip().is_unspecified()).then(|| format!("http://{addr}")));
    match advertised {
        Some(endpoint) => {
            if let Err(e) = service.register(&replica, &endpoint).await {
                tracing::warn!(error = %e, "this replica's endpoint could not be recorded; other replicas cannot forward calls for its runs to it");
            }
        }
        None => tracing::info!(
            "no advertise_endpoint and an unspecified listen address: other replicas do not forward calls for this replica's runs to it"
        ),
    }
    let mut internal_server = add_internal_to(GrpcServer::new(config.server.clone()), registry);
    if let Some(tls) = internal_tls {
        internal_server = internal_server.with_tls(tls);
    }
    let client = add_to(GrpcServer::new(config.server.clone()), service.clone())
        .serve(listener, shutdown.clone());
    let internal = internal_server.serve(internal, shutdown);
    tokio::try_join!(client, internal)?;
    service.actors_stopped(ACTOR_STOP_GRACE).await;
    Ok(())
}
