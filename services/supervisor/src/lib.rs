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
//! writer and every commit carries the version it read.
#![forbid(unsafe_code)]

pub mod events;
pub mod plan;
pub mod registry;
mod run;
mod service;
pub mod sql;
pub mod store;
mod trace;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use convene_mesh::auth::{Authenticator, TokenKeys};
use convene_mesh::handles::{
    ApprovalHandle, EvidenceHandle, GrpcApproval, GrpcEvidenceStore, GrpcPolicy, PolicyHandle,
};
use convene_mesh::policy_file::{self, Policy, PolicyFile};
use convene_proto::v1::{
    supervisor_server::SupervisorServer, worker_registry_server::WorkerRegistryServer,
};
use convene_server::{GrpcServer, ServerSettings, Shutdown};
use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;

pub use registry::{Connector, MeshConnector, Registry, RegistrySettings};
pub use service::SupervisorService;
pub use sql::SqlRunStore;
pub use store::{MemoryStore, RunStore};

/// The policy file of the payment-incident example, the development default.
pub const EXAMPLE_POLICY: &str = include_str!("../../../examples/payment-incident/policy.yaml");

/// The supervisor's well-known port.
pub const DEFAULT_PORT: u16 = 7400;

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
}

/// Supervisor configuration. The defaults are the development settings of the
/// payment-incident example.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// The gRPC server (Supervisor and WorkerRegistry).
    pub server: ServerSettings,
    /// Data directory (development credentials live in `<data_dir>/credentials`, the
    /// default SQLite database in `<data_dir>/convene.db`).
    pub data_dir: PathBuf,
    /// Where runs, their events and the outbox are stored: `sqlite://<path>` or
    /// `postgres://...`; unset: the SQLite file `<data_dir>/convene.db`; `memory`: in
    /// memory, lost at exit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub database_url: Option<String>,
    /// Policy file (principals, profiles, catalog); None: the embedded example policy.
    pub policy_file: Option<PathBuf>,
    /// Create development credentials for principals without a listed hash.
    pub dev_credentials: bool,
    /// File holding the supervisor's own credential; default
    /// `<data_dir>/credentials/supervisor.secret`.
    pub credential_file: Option<PathBuf>,
    /// The policy service.
    pub policy_endpoint: String,
    /// The evidence store.
    pub evidence_endpoint: String,
    /// The approval service.
    pub approval_endpoint: String,
    /// A worker registration not renewed within this time is considered dead.
    #[serde(with = "convene_server::config::duration")]
    pub lease_ttl: Duration,
    /// How often workers heartbeat.
    #[serde(with = "convene_server::config::duration")]
    pub heartbeat_interval: Duration,
    /// First retry backoff after a transient failure (doubles per attempt, with jitter).
    #[serde(with = "convene_server::config::duration")]
    pub retry_backoff: Duration,
    /// Longest retry backoff.
    #[serde(with = "convene_server::config::duration")]
    pub max_retry_backoff: Duration,
    /// Time a worker gets beyond a delegation's deadline to answer.
    #[serde(with = "convene_server::config::duration")]
    pub dispatch_grace: Duration,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            server: ServerSettings {
                // Delegate calls wait for their children, and WatchRun streams start
                // with the backlog: give calls as long as a delegation may run.
                request_timeout: Some(Duration::from_secs(15 * 60)),
                ..ServerSettings::on_port(DEFAULT_PORT)
            },
            data_dir: PathBuf::from(".convene"),
            database_url: None,
            policy_file: None,
            dev_credentials: true,
            credential_file: None,
            policy_endpoint: "http://127.0.0.1:7401".to_owned(),
            evidence_endpoint: "http://127.0.0.1:7402".to_owned(),
            approval_endpoint: "http://127.0.0.1:7403".to_owned(),
            lease_ttl: Duration::from_secs(10),
            heartbeat_interval: Duration::from_secs(3),
            retry_backoff: Duration::from_millis(100),
            max_retry_backoff: Duration::from_secs(2),
            dispatch_grace: Duration::from_secs(2),
        }
    }
}

impl Config {
    /// The credential file in effect.
    pub fn credential_path(&self) -> PathBuf {
        self.credential_file.clone().unwrap_or_else(|| {
            policy_file::dev_credential_path(&self.data_dir.join("credentials"), "supervisor")
        })
    }
}

/// Loads the policy file named by `path`, or the embedded example when `None`, and adds
/// development credentials from `<data_dir>/credentials` when `dev` is set.
pub fn load_policy(
    path: Option<&std::path::Path>,
    data_dir: &std::path::Path,
    dev: bool,
) -> Result<Policy, policy_file::Error> {
    let mut policy = match path {
        Some(p) => Policy::load(p)?,
        None => PolicyFile::parse(EXAMPLE_POLICY, Some("yaml"), "embedded example policy")?
            .compile("embedded example policy")?,
    };
    if dev {
        policy.with_dev_credentials(&data_dir.join("credentials"))?;
    }
    Ok(policy)
}

/// Dispatch timing.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Settings {
    pub(crate) retry_backoff: Duration,
    pub(crate) max_retry_backoff: Duration,
    pub(crate) dispatch_grace: Duration,
}

/// What a run actor needs from the rest of the supervisor.
pub(crate) struct Deps {
    pub(crate) policy: PolicyHandle,
    pub(crate) evidence: EvidenceHandle,
    pub(crate) approval: ApprovalHandle,
    pub(crate) registry: Arc<Registry>,
    pub(crate) store: Arc<dyn RunStore>,
    pub(crate) policy_file: Arc<Policy>,
    pub(crate) credential: String,
    pub(crate) settings: Settings,
    pub(crate) live: Mutex<HashMap<String, run::Mailbox>>,
    pub(crate) shutdown_token: CancellationToken,
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
    /// Configuration (timings).
    pub config: Config,
    /// Shutdown: streams end and in-flight dispatches are abandoned when it fires.
    pub shutdown: Shutdown,
}

/// Builds the supervisor service and its worker registry from parts.
pub fn build(parts: Parts) -> (SupervisorService, Arc<Registry>) {
    let keys = Arc::new(TokenKeys::new(parts.policy.clone()));
    let auth = Authenticator::new(parts.policy_file.clone(), keys);
    let registry = Arc::new(Registry::new(
        parts.connector,
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
    let deps = Arc::new(Deps {
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
        },
        live: Mutex::new(HashMap::new()),
        shutdown_token,
    });
    (SupervisorService::new(deps, auth, parts.shutdown), registry)
}

/// Adds the Supervisor and WorkerRegistry gRPC services to a server.
pub fn add_to(
    server: GrpcServer,
    service: SupervisorService,
    registry: Arc<Registry>,
) -> GrpcServer {
    server
        .add_service(SupervisorServer::new(service))
        .add_service(WorkerRegistryServer::new(registry::RegistryService(
            registry,
        )))
}

/// Runs the supervisor as its own process: other services are reached over gRPC.
pub async fn run(config: Config, shutdown: Shutdown) -> Result<(), Error> {
    let policy = Arc::new(load_policy(
        config.policy_file.as_deref(),
        &config.data_dir,
        config.dev_credentials,
    )?);
    let credential_path = config.credential_path();
    let credential = if config.credential_file.is_none() && config.dev_credentials {
        policy_file::dev_credential(&config.data_dir.join("credentials"), "supervisor")
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
        store: sql::open_store(config.database_url.as_deref(), &config.data_dir).await?,
        connector: Arc::new(MeshConnector::default()),
        config: config.clone(),
        shutdown: shutdown.clone(),
    };
    let (service, registry) = build(parts);
    let listener = tokio::net::TcpListener::bind(config.server.listen)
        .await
        .map_err(|source| Error::Bind {
            addr: config.server.listen,
            source,
        })?;
    let addr = listener.local_addr().map_err(|source| Error::Bind {
        addr: config.server.listen,
        source,
    })?;
    tracing::info!(%addr, "supervisor listening");
    add_to(GrpcServer::new(config.server.clone()), service, registry)
        .serve(listener, shutdown)
        .await?;
    Ok(())
}
