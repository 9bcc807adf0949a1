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
//! resumes every unfinished run where its stored state left it ([`recovery`]). The
//! outbox of CloudEvents reaches `WatchEvents` subscribers, and NATS JetStream when
//! configured ([`relay`]).
#![forbid(unsafe_code)]

pub mod crash;
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
mod trace;
mod watchers;

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

pub use crash::{CrashPoint, CrashSettings};
pub use registry::{Connector, MeshConnector, Registry, RegistrySettings};
pub use service::SupervisorService;
pub use sql::SqlRunStore;
pub use store::{MemoryStore, RunStore};

/// The policy file of the payment-incident example, the development default.
pub const EXAMPLE_POLICY: &str = include_str!("../../../examples/payment-incident/policy.yaml");

/// How long a stopping supervisor waits for its run actors to end (they stop at the
/// shutdown signal; this bounds a stuck store write).
pub const ACTOR_STOP_GRACE: Duration = Duration::from_secs(10);

/// The supervisor's well-known port.
pub const DEFAULT_PORT: u16 = 7400;

/// How long a run's progress that decides nothing may wait for its next commit (see
/// [`Config::commit_linger`]).
pub const DEFAULT_COMMIT_LINGER: Duration = Duration::from_millis(50);

/// The JetStream stream the relay publishes to by default.
pub const DEFAULT_NATS_STREAM: &str = "CONVENE_EVENTS";

/// The subject prefix of relayed events by default.
pub const DEFAULT_NATS_SUBJECT_PREFIX: &str = "convene.events";

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
    /// How long a run's progress that decides nothing (a delegation dispatched, a
    /// result the join must wait past) may wait to be committed with the run's next
    /// commit: a run's dispatches then usually commit with its first results, and its
    /// results with the decision on them, one commit instead of three. Until committed,
    /// that progress is not in `GetRun` or `WatchRun`, and a crash loses it (the
    /// resumed run dispatches those delegations again under their ids). The run's
    /// acceptance and its decision are never held. 0: commit each at once.
    #[serde(with = "convene_server::config::duration")]
    pub commit_linger: Duration,
    /// This replica's id: the owner of the runs it leases. Unset: a fresh UUIDv7 at
    /// every start, and a restarted supervisor takes its runs back once their leases
    /// expire. A stable id (one process per id!) lets a supervisor that restarts in place
    /// take its unfinished runs back at once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replica_id: Option<String>,
    /// How long a run's lease lasts unless renewed; the replica renews the leases of the
    /// runs it runs every third of it. When a replica dies, another resumes its runs
    /// this long after its last renewal.
    #[serde(with = "convene_server::config::duration")]
    pub run_lease_ttl: Duration,
    /// How often unfinished runs whose lease is free or expired are claimed and resumed
    /// (also once at start).
    #[serde(with = "convene_server::config::duration")]
    pub claim_interval: Duration,
    /// NATS server to relay the outbox to (`nats://host:4222`), JetStream enabled.
    /// Unset: events reach `WatchEvents` subscribers only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nats_url: Option<String>,
    /// JetStream stream the relay publishes to; created when missing.
    pub nats_stream: String,
    /// Subject prefix of relayed events: an event of type T goes to `<prefix>.<T>`, and
    /// the stream captures `<prefix>.>`.
    pub nats_subject_prefix: String,
    /// TEST-ONLY fault injection: abort the process at a point of a run's life (see
    /// [`crash`]). Never set outside crash tests.
    pub crash: CrashSettings,
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
            commit_linger: DEFAULT_COMMIT_LINGER,
            replica_id: None,
            run_lease_ttl: Duration::from_secs(15),
            claim_interval: Duration::from_secs(5),
            nats_url: None,
            nats_stream: DEFAULT_NATS_STREAM.to_owned(),
            nats_subject_prefix: DEFAULT_NATS_SUBJECT_PREFIX.to_owned(),
            crash: CrashSettings::default(),
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

    /// This replica's id: `replica_id` when configured, else a fresh UUIDv7.
    pub fn replica(&self) -> String {
        self.replica_id
            .as_deref()
            .map(str::trim)
            .filter(|id| !id.is_empty())
            .map_or_else(|| uuid::Uuid::now_v7().to_string(), str::to_owned)
    }

    /// Checks what serde cannot: lease and commit timing, and relay names.
    ///
    /// # Errors
    ///
    /// [`Error::Config`] naming the key and what to change.
    pub fn check(&self) -> Result<(), Error> {
        if self.run_lease_ttl < Duration::from_millis(300) {
            return Err(Error::Config(format!(
                "run_lease_ttl = {:?} is too short: give at least 300ms (leases are renewed every third of it)",
                self.run_lease_ttl
            )));
        }
        // Held progress must commit well inside the lease it is committed under.
        let linger_limit = (self.run_lease_ttl / 3).min(Duration::from_secs(1));
        if self.commit_linger > linger_limit {
            return Err(Error::Config(format!(
                "commit_linger (--commit-linger) = {:?} is too long: it may be at most 1s and \
                 a third of run_lease_ttl ({:?}), here {linger_limit:?}; give less, or 0s to \
                 commit every step at once",
                self.commit_linger, self.run_lease_ttl
            )));
        }
        if self.claim_interval.is_zero() {
            return Err(Error::Config(
                "claim_interval must be more than zero".to_owned(),
            ));
        }
        if self.nats_url.is_some() {
            let valid_token = |s: &str| {
                !s.is_empty()
                    && s.chars()
                        .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
            };
            if !valid_token(&self.nats_stream) {
                return Err(Error::Config(format!(
                    "nats_stream = {:?}: use letters, digits, '_' and '-' only",
                    self.nats_stream
                )));
            }
            if self.nats_subject_prefix.is_empty()
                || !self.nats_subject_prefix.split('.').all(valid_token)
            {
                return Err(Error::Config(format!(
                    "nats_subject_prefix = {:?}: give dot-separated tokens of letters, digits, '_' and '-' (no wildcards)",
                    self.nats_subject_prefix
                )));
            }
        }
        Ok(())
    }
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
    pub(crate) commit_linger: Duration,
}

/// What a run actor needs from the rest of the supervisor.
pub(crate) struct Deps {
    /// This replica's id and lease length, when the store leases runs (see
    /// [`RunStore::owner`]); None: no leases, no recovery.
    pub(crate) lease: Option<recovery::Lease>,
    pub(crate) crash: crash::Crash,
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
    pub(crate) live: Mutex<HashMap<String, run::Mailbox>>,
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

/// Builds the supervisor service and its worker registry from parts, and starts what
/// runs beside them until `parts.shutdown`: when the store leases runs to this replica
/// ([`RunStore::owner`], set by `with_owner`), lease renewal and the claiming and
/// resuming of unfinished runs (at once, then every `claim_interval`); when `nats_url`
/// is set, the event relay. Must be called inside a Tokio runtime.
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
        },
        live: Mutex::new(HashMap::new()),
        shutdown_token,
        actors: tokio_util::task::TaskTracker::new(),
    });
    recovery::spawn(deps.clone());
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

/// Runs the supervisor as its own process: other services are reached over gRPC. Its
/// runs are leased to this replica ([`Config::replica`]); unfinished runs of the
/// database are resumed as their leases allow.
pub async fn run(config: Config, shutdown: Shutdown) -> Result<(), Error> {
    config.check()?;
    let replica = config.replica();
    tracing::info!(replica = %replica, lease_ttl = ?config.run_lease_ttl, "supervisor replica starting");
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
    add_to(
        GrpcServer::new(config.server.clone()),
        service.clone(),
        registry,
    )
    .serve(listener, shutdown)
    .await?;
    service.actors_stopped(ACTOR_STOP_GRACE).await;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commit_linger_must_fit_well_inside_the_lease() {
        assert!(Config::default().check().is_ok());
        let linger = |commit_linger, run_lease_ttl| Config {
            commit_linger,
            run_lease_ttl,
            ..Config::default()
        };
        assert!(
            linger(Duration::ZERO, Duration::from_secs(1))
                .check()
                .is_ok()
        );
        assert!(
            linger(Duration::from_secs(1), Duration::from_secs(15))
                .check()
                .is_ok()
        );
        let err = linger(Duration::from_millis(1500), Duration::from_secs(15))
            .check()
            .expect_err("more than 1s")
            .to_string();
        assert!(
            err.contains("commit_linger (--commit-linger) = 1.5s is too long"),
            "{err}"
        );
        // A third of a 1.5s lease: 500ms.
        let err = linger(Duration::from_millis(600), Duration::from_millis(1500))
            .check()
            .expect_err("more than a third of the lease")
            .to_string();
        assert!(err.contains("(1.5s), here 500ms"), "{err}");
    }
}
