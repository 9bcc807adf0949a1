//! The supervisor's configuration: [`Config`], its development defaults and the checks
//! serde cannot make.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use convene_mesh::policy_file::{self, Policy, PolicySource};
use convene_server::{ServerSettings, ServiceCommon};
use serde::{Deserialize, Serialize};

use crate::{CrashSettings, Error, Templates};

/// The supervisor's well-known port.
pub const DEFAULT_PORT: u16 = 7400;

/// The internal listener's port is the client listener's plus this, unless
/// `internal_listen` says otherwise: 7500 beside the default 7400.
pub const INTERNAL_PORT_OFFSET: u16 = 100;

/// How long a run's progress that decides nothing may wait for its next commit (see
/// [`Config::commit_linger`]).
pub const DEFAULT_COMMIT_LINGER: Duration = Duration::from_millis(50);

/// Runs a replica runs at once by default (see [`Config::max_active_runs`]).
pub const DEFAULT_MAX_ACTIVE_RUNS: usize = 10_000;

/// WatchRun and WatchEvents streams one principal may hold open on a replica by
/// default (see [`Config::max_watch_streams`]).
pub const DEFAULT_MAX_WATCH_STREAMS: usize = 64;

/// The JetStream stream the relay publishes to by default.
pub const DEFAULT_NATS_STREAM: &str = "CONVENE_EVENTS";

/// The subject prefix of relayed events by default.
pub const DEFAULT_NATS_SUBJECT_PREFIX: &str = "convene.events";

/// Supervisor configuration. The defaults are the development settings of the
/// payment-incident example. The shared keys are in [`common`](Self::common), which the
/// config also derefs to: the server (the client listener, serving the Supervisor
/// service; WorkerRegistry is on [`internal_listen`](Self::internal_listen)), the data directory
/// (`.convene` by default), the policy file (principals, profiles, catalog), and
/// `database_url`, where runs, their events and the outbox are stored.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// The keys every service that reads the policy file shares.
    #[serde(flatten)]
    pub common: ServiceCommon,
    /// File holding the supervisor's own credential; default
    /// `<data_dir>/credentials/supervisor.secret`.
    pub credential_file: Option<PathBuf>,
    /// Address of the internal listener, which serves what only the mesh calls
    /// (`convene.v1.WorkerRegistry`: workers register and heartbeat there), apart from the
    /// client API (`convene.v1.Supervisor`) on `server.listen`. It serves TLS when the
    /// process does (`--tls-cert`), with the same certificate. Unset: loopback, at the
    /// client listener's port + 100 (127.0.0.1:7500 by default).
    #[serde(default)]
    pub internal_listen: Option<SocketAddr>,
    /// PEM CA certificates that the internal listener requires client certificates to
    /// chain to (mutual TLS: only workers of the mesh register), whether or not the
    /// client listener asks for any (`--tls-client-ca`). Needs TLS (`--tls-cert`).
    #[serde(default)]
    pub internal_client_ca: Option<PathBuf>,
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
    /// The endpoint other supervisor replicas reach this one at
    /// (`http://10.0.0.7:7000`), for the calls they forward to the replica that runs a
    /// run (a worker's `Delegate` that reached another replica). Unset: `http://` and
    /// the listen address, unless that is unspecified (`0.0.0.0`, `[::]`): then calls
    /// for its runs are not forwarded to it.
    #[serde(default)]
    pub advertise_endpoint: Option<String>,
    /// How long the approval requests a run files for its proposed actions stay open; a
    /// request nobody approved by then expires, and the run records the action EXPIRED.
    #[serde(with = "convene_server::config::duration")]
    pub approval_ttl: Duration,
    /// This replica's id: the owner of the runs it leases. Unset: a fresh UUIDv7 at
    /// every start, and a restarted supervisor takes its runs back once their leases
    /// expire. A stable id (one process per id!) lets a supervisor that restarts in place
    /// take its unfinished runs back at once.
    #[serde(default)]
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
    #[serde(default)]
    pub nats_url: Option<String>,
    /// JetStream stream the relay publishes to; created when missing.
    pub nats_stream: String,
    /// Subject prefix of relayed events: an event of type T goes to `<prefix>.<T>`, and
    /// the stream captures `<prefix>.>`.
    pub nats_subject_prefix: String,
    /// Run templates file (YAML; see examples/payment-incident/templates.yaml): runs an
    /// operator fixes, which callers start by id (StartRun's `template`). Unset: the
    /// payment-incident example's templates when `policy_file` is unset too (the
    /// example policy), else none.
    #[serde(default)]
    pub templates_file: Option<PathBuf>,
    /// Runs this replica runs at once (a run waiting for people does not count). One
    /// more `StartRun` is refused at once with `RESOURCE_EXHAUSTED` and a retry hint,
    /// before anything of it is stored. A run in flight costs the supervisor about
    /// 60 KB; runs resumed after a restart or a failover are taken even past the limit.
    pub max_active_runs: usize,
    /// `WatchRun` and `WatchEvents` streams one principal may hold open on this replica
    /// at once (a principal acted for counts as itself). One more is refused at once
    /// with `RESOURCE_EXHAUSTED` and a retry hint; a stream's place frees when it ends
    /// or its client goes away.
    pub max_watch_streams: usize,
    /// TEST-ONLY fault injection: abort the process at a point of a run's life (see
    /// [`crash`]). Never set outside crash tests.
    pub crash: CrashSettings,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            common: ServiceCommon {
                server: ServerSettings {
                    // Delegate calls wait for their children, and WatchRun streams start
                    // with the backlog: give calls as long as a delegation may run.
                    request_timeout: Some(Duration::from_secs(15 * 60)),
                    ..ServerSettings::on_port(DEFAULT_PORT)
                },
                data_dir: PathBuf::from(".convene"),
                ..ServiceCommon::default()
            },
            credential_file: None,
            internal_listen: None,
            internal_client_ca: None,
            policy_endpoint: "http://127.0.0.1:7401".to_owned(),
            evidence_endpoint: "http://127.0.0.1:7402".to_owned(),
            approval_endpoint: "http://127.0.0.1:7403".to_owned(),
            lease_ttl: Duration::from_secs(10),
            heartbeat_interval: Duration::from_secs(3),
            retry_backoff: Duration::from_millis(100),
            max_retry_backoff: Duration::from_secs(2),
            dispatch_grace: Duration::from_secs(2),
            commit_linger: DEFAULT_COMMIT_LINGER,
            approval_ttl: Duration::from_secs(3600),
            advertise_endpoint: None,
            replica_id: None,
            run_lease_ttl: Duration::from_secs(15),
            claim_interval: Duration::from_secs(5),
            nats_url: None,
            nats_stream: DEFAULT_NATS_STREAM.to_owned(),
            nats_subject_prefix: DEFAULT_NATS_SUBJECT_PREFIX.to_owned(),
            templates_file: None,
            max_active_runs: DEFAULT_MAX_ACTIVE_RUNS,
            max_watch_streams: DEFAULT_MAX_WATCH_STREAMS,
            crash: CrashSettings::default(),
        }
    }
}

convene_server::common_section!(Config);

/// The flags of the supervisor's internal listener, for `convene-supervisor` and
/// `convene serve supervisor`.
#[derive(Debug, Clone, Default, PartialEq, Eq, clap::Args)]
pub struct InternalArgs {
    /// Address of the internal listener: convene.v1.WorkerRegistry, where workers
    /// register (their --registry), apart from the client API on --listen. It serves
    /// TLS when --tls-cert is given. Overrides `internal_listen`
    /// (CONVENE_INTERNAL_LISTEN). [default: 127.0.0.1 at the --listen port + 100, e.g.
    /// 127.0.0.1:7500]
    #[arg(long, value_name = "ADDR")]
    pub internal_listen: Option<SocketAddr>,
    /// PEM CA certificates that the internal listener requires client certificates to
    /// chain to (mutual TLS: only the mesh's workers register), while the client API
    /// asks for none unless --tls-client-ca says so. Needs --tls-cert. Overrides
    /// `internal_client_ca` (CONVENE_INTERNAL_CLIENT_CA).
    #[arg(long, value_name = "FILE")]
    pub internal_client_ca: Option<PathBuf>,
}

impl InternalArgs {
    /// `loader` with these flags applied.
    pub fn apply(&self, loader: convene_server::ConfigLoader) -> convene_server::ConfigLoader {
        loader
            .set_some(
                "internal_listen",
                self.internal_listen.map(|a| a.to_string()),
            )
            .set_path("internal_client_ca", self.internal_client_ca.as_deref())
    }
}

impl Config {
    /// The credential file in effect.
    pub fn credential_path(&self) -> PathBuf {
        self.credential_file.clone().unwrap_or_else(|| {
            policy_file::dev_credential_path(&self.credentials_dir(), "supervisor")
        })
    }

    /// Where the policy comes from: `policy_file` (unset: the embedded example), with
    /// development credentials in `<data_dir>/credentials` when `dev_credentials` is on.
    pub fn policy_source(&self) -> PolicySource {
        PolicySource::new(self.policy_file.clone(), self.dev_credentials_dir())
    }

    /// The run templates in effect, validated against `policy` (see
    /// [`templates_file`](Self::templates_file)).
    ///
    /// # Errors
    ///
    /// [`Error::Templates`] naming the file, the template and what to fix.
    pub fn templates(&self, policy: &Policy) -> Result<Templates, Error> {
        match (&self.templates_file, &self.policy_file) {
            (Some(file), _) => Templates::load(file, policy),
            (None, None) => Templates::example(policy),
            (None, Some(_)) => Ok(Templates::default()),
        }
    }

    /// The internal listener's address: `internal_listen`, else loopback at the client
    /// listener's port + [`INTERNAL_PORT_OFFSET`] (port 0, any free port, stays 0).
    ///
    /// # Errors
    ///
    /// [`Error::Config`] when the client port leaves no room for the offset, or both
    /// listeners are given one address.
    pub fn internal_addr(&self) -> Result<SocketAddr, Error> {
        let listen = self.server.listen;
        if let Some(addr) = self.internal_listen {
            let overlaps = addr.ip() == listen.ip()
                || addr.ip().is_unspecified()
                || listen.ip().is_unspecified();
            if addr.port() == listen.port() && addr.port() != 0 && overlaps {
                return Err(Error::Config(format!(
                    "internal_listen (--internal-listen) = {addr} takes server.listen's port \
                     ({listen}) too: give the internal listener one of its own (the default is \
                     127.0.0.1:<port + {INTERNAL_PORT_OFFSET}>)"
                )));
            }
            return Ok(addr);
        }
        let port = match listen.port() {
            0 => 0,
            port => port.checked_add(INTERNAL_PORT_OFFSET).ok_or_else(|| {
                Error::Config(format!(
                    "server.listen port {port} leaves no room for the internal listener at \
                     port + {INTERNAL_PORT_OFFSET}: set internal_listen (--internal-listen)"
                ))
            })?,
        };
        Ok(SocketAddr::from(([127, 0, 0, 1], port)))
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
        self.internal_addr()?;
        if self.claim_interval.is_zero() {
            return Err(Error::Config(
                "claim_interval must be more than zero".to_owned(),
            ));
        }
        if self.max_active_runs == 0 {
            return Err(Error::Config(format!(
                "max_active_runs = 0 would refuse every run: give at least 1 (default {DEFAULT_MAX_ACTIVE_RUNS})"
            )));
        }
        if self.max_watch_streams == 0 {
            return Err(Error::Config(format!(
                "max_watch_streams = 0 would refuse every WatchRun and WatchEvents: give at least 1 (default {DEFAULT_MAX_WATCH_STREAMS})"
            )));
        }
        if self.approval_ttl.is_zero() {
            return Err(Error::Config(
                "approval_ttl must be more than zero, e.g. \"1h\": a request would expire as it is filed".to_owned(),
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_internal_listener_is_on_loopback_a_hundred_ports_up_unless_configured() {
        let config = Config::default();
        assert_eq!(
            config.internal_addr().unwrap(),
            "127.0.0.1:7500".parse::<SocketAddr>().unwrap()
        );
        let on = |listen: &str, internal: Option<&str>| {
            let mut config = Config::default();
            config.server.listen = listen.parse().unwrap();
            config.internal_listen = internal.map(|a| a.parse().unwrap());
            config.internal_addr()
        };
        // All interfaces for clients, loopback for the mesh unless said otherwise.
        assert_eq!(
            on("0.0.0.0:7000", None).unwrap(),
            "127.0.0.1:7100".parse::<SocketAddr>().unwrap()
        );
        assert_eq!(
            on("0.0.0.0:7400", Some("0.0.0.0:7500")).unwrap(),
            "0.0.0.0:7500".parse::<SocketAddr>().unwrap()
        );
        assert_eq!(on("127.0.0.1:0", None).unwrap().port(), 0);
        let err = on("127.0.0.1:65500", None).unwrap_err().to_string();
        assert!(err.contains("--internal-listen"), "{err}");
        let err = on("0.0.0.0:7400", Some("0.0.0.0:7400"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("one of its own"), "{err}");
        // All interfaces include loopback: both would bind 7400 there.
        let err = Config {
            internal_listen: Some("0.0.0.0:7400".parse().unwrap()),
            ..Config::default()
        }
        .check()
        .unwrap_err()
        .to_string();
        assert!(err.contains("one of its own"), "{err}");
        assert!(on("127.0.0.1:7400", Some("127.0.0.2:7400")).is_ok());
    }

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
