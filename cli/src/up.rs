//! `convene up`: every service in one process, on one address, sharing one state.
//!
//! The services are the very same code as the separate binaries; they reach each other
//! through in-process handles (a direct async call, no socket, no encoding), and the
//! gRPC server exposes all of them on one listener: the supervisor's worker registry
//! too, which its own binary serves on an internal listener apart. Workers run
//! in-process too and register with the supervisor's registry like remote ones do.
//!
//! State outlives the process: a `convene up` started again on the same data directory
//! resumes the runs the previous one left unfinished (its supervisor keeps one replica
//! id in the data directory, so it takes them back at once).
//!
//! With `--mcp FILE` the workers also mount the tools of MCP servers, those the policy's
//! tool catalog declares (see `convene_worker::tools::mcp`). The servers are started (or
//! reached) once and shared by every in-process worker.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use convene_mesh::handles::{
    ApprovalHandle, EvidenceHandle, PolicyHandle, RegistryHandle, SupervisorHandle, WorkerHandle,
};
use convene_mesh::policy_file::{Policy, PrincipalKind, dev_credential};
use convene_server::cli::LogFormat;
use convene_server::{GrpcServer, ServerSettings, Shutdown};
use convene_supervisor::registry::RegistryService;
use convene_supervisor::{MemoryStore, MeshConnector, SqlRunStore, SupervisorService};

use crate::client::DEFAULT_PRINCIPAL_FILE;

/// Flags of `convene up`.
#[derive(Debug, Clone, clap::Args)]
pub struct UpArgs {
    /// Address every gRPC service is served on, the supervisor's worker registry
    /// included (a worker run apart registers here with --registry, where a
    /// supervisor of its own would have it on an internal listener).
    #[arg(
        long,
        env = "CONVENE_LISTEN",
        default_value = "127.0.0.1:7400",
        value_name = "ADDR"
    )]
    pub listen: SocketAddr,
    /// Policy file (principals, profiles' capabilities, tool catalog, runtime rules).
    /// Default: the payment-incident example's, built in.
    #[arg(long = "policy", value_name = "FILE")]
    pub policy_file: Option<PathBuf>,
    /// Worker profiles file. Default: the payment-incident example's, built in.
    #[arg(long = "profiles", value_name = "FILE")]
    pub profiles_file: Option<PathBuf>,
    /// Run templates file: runs you fix (join contract, limits, profiles) that callers
    /// start by id with `convene run --template ID` and may only tighten; see
    /// examples/payment-incident/templates.yaml. Default: the payment-incident example's,
    /// built in, unless --policy is given (then none).
    #[arg(long = "templates", value_name = "FILE")]
    pub templates_file: Option<PathBuf>,
    /// MCP servers whose tools the workers mount (YAML or TOML: `servers:`, each with a
    /// `name` and a stdio `command` + `args` + `env` or a streamable-HTTP `url`; see
    /// examples/mcp/mcp.yaml). Only the tools the policy's tool catalog declares, as
    /// mcp:<server>/<tool>@<version>, are mounted. [default: no MCP servers]
    #[arg(long = "mcp", value_name = "FILE")]
    pub mcp_file: Option<PathBuf>,
    /// Directory the workers' read-only tools read (logs/, metrics/, changes/).
    #[arg(
        long = "tools-data",
        default_value = "examples/payment-incident/data",
        value_name = "DIR"
    )]
    pub tools_data_dir: PathBuf,
    /// In-process workers to start (each serves every profile).
    #[arg(long, default_value_t = 2)]
    pub workers: usize,
    /// Delegations each worker runs at once.
    #[arg(long, default_value_t = 64)]
    pub capacity: u32,
    /// Principal the client commands act as by default (its credential is created in the
    /// data directory). Default: oncall@acme if the policy has it, else the first person
    /// allowed to start runs.
    #[arg(long, value_name = "PRINCIPAL")]
    pub default_principal: Option<String>,
    /// Where every service keeps its state: `sqlite://<path>` (or a file path) for an
    /// embedded SQLite database, `postgres://<user>@<host>:<port>/<database>` for
    /// PostgreSQL, `memory` to keep nothing past exit. [default: the SQLite file
    /// convene.db in the data directory]
    #[arg(long, env = "CONVENE_DATABASE_URL", value_name = "URL")]
    pub database_url: Option<String>,
    /// Also publish every run event (the CloudEvents outbox) to this NATS server's
    /// JetStream, e.g. nats://127.0.0.1:4222: stream CONVENE_EVENTS, subjects
    /// convene.events.<type>, deduplicated by event id (Nats-Msg-Id). [default: events
    /// reach `convene events` and WatchEvents subscribers only]
    #[arg(long, env = "CONVENE_NATS_URL", value_name = "URL")]
    pub nats_url: Option<String>,
    /// Log line format.
    #[arg(long, value_enum, default_value_t = LogFormat::Text, env = "CONVENE_LOG_FORMAT")]
    pub log_format: LogFormat,
    /// Export trace spans over OTLP/gRPC to this collector, e.g. http://localhost:4317
    /// (Jaeger's OTLP port), as service `convene`. Overrides
    /// OTEL_EXPORTER_OTLP_TRACES_ENDPOINT and OTEL_EXPORTER_OTLP_ENDPOINT;
    /// OTEL_SDK_DISABLED=true turns export off. [default: no export]
    #[arg(long, value_name = "URL")]
    pub otlp_endpoint: Option<String>,
    /// Address the A2A gateway serves on over HTTP (its Agent Card at
    /// /.well-known/agent-card.json, JSON-RPC and HTTP+JSON bindings), or `off`. Other
    /// agents start runs from the run templates there, with a principal credential as
    /// the bearer; people sign in to the operator console at /console/.
    #[arg(
        long,
        env = "CONVENE_HTTP_LISTEN",
        default_value = "127.0.0.1:7480",
        value_name = "ADDR|off"
    )]
    pub http_listen: convene_gateway::HttpListen,
    /// The URL the A2A gateway's Agent Card advertises, for a gateway behind a proxy,
    /// e.g. https://agents.example.com/convene. [default: http://<http-listen>]
    #[arg(long, env = "CONVENE_PUBLIC_URL", value_name = "URL")]
    pub public_url: Option<String>,
    /// TLS for the gRPC listener and the A2A gateway.
    #[command(flatten)]
    pub tls: convene_server::tls::TlsArgs,
    /// How long a run's progress that decides nothing yet (its delegations dispatched,
    /// a result the join must wait past) may wait to be committed together with the
    /// run's next step, e.g. 100ms; 0s commits every step at once. Fewer commits per run
    /// for progress that GetRun shows that much later, and that a crash makes the
    /// resumed run redo. At most 1s.
    #[arg(
        long,
        env = "CONVENE_COMMIT_LINGER",
        value_name = "DURATION",
        default_value = "50ms",
        value_parser = humantime::parse_duration
    )]
    pub commit_linger: std::time::Duration,
    /// Runs the supervisor runs at once (runs waiting for people do not count); one
    /// more StartRun is refused at once with RESOURCE_EXHAUSTED and a retry hint, and
    /// nothing of it is stored. About 60 KB of memory per run in flight.
    #[arg(
        long,
        env = "CONVENE_MAX_ACTIVE_RUNS",
        value_name = "RUNS",
        default_value_t = convene_supervisor::DEFAULT_MAX_ACTIVE_RUNS
    )]
    pub max_active_runs: usize,
    /// WatchRun and WatchEvents streams one principal may hold open at once; one more
    /// is refused with RESOURCE_EXHAUSTED and a retry hint.
    #[arg(
        long,
        env = "CONVENE_MAX_WATCH_STREAMS",
        value_name = "STREAMS",
        default_value_t = convene_supervisor::DEFAULT_MAX_WATCH_STREAMS
    )]
    pub max_watch_streams: usize,
}

impl UpArgs {
    /// The flags' defaults, listening on `listen`.
    pub fn defaults(listen: SocketAddr) -> Self {
        Self {
            listen,
            policy_file: None,
            profiles_file: None,
            templates_file: None,
            mcp_file: None,
            tools_data_dir: PathBuf::from("examples/payment-incident/data"),
            workers: 2,
            capacity: 64,
            default_principal: None,
            database_url: None,
            nats_url: None,
            log_format: LogFormat::Text,
            otlp_endpoint: None,
            // A free port: never the one a running `convene up` holds.
            http_listen: convene_gateway::HttpListen(Some(std::net::SocketAddr::new(
                listen.ip(),
                0,
            ))),
            public_url: None,
            tls: convene_server::tls::TlsArgs::default(),
            commit_linger: convene_supervisor::DEFAULT_COMMIT_LINGER,
            max_active_runs: convene_supervisor::DEFAULT_MAX_ACTIVE_RUNS,
            max_watch_streams: convene_supervisor::DEFAULT_MAX_WATCH_STREAMS,
        }
    }

    /// The telemetry settings of these flags and the process environment (the `OTEL_*`
    /// variables). Reads `std::env::vars()`.
    pub fn telemetry(&self) -> convene_telemetry::Settings {
        convene_telemetry::Settings::from_env(
            self.log_format,
            self.otlp_endpoint.as_deref(),
            std::env::vars(),
        )
    }
}

/// `https` when this process serves TLS ([`convene_server::tls::install`]), else `http`.
fn scheme() -> &'static str {
    if convene_server::tls::installed().is_some_and(|t| t.server.is_some()) {
        "https"
    } else {
        "http"
    }
}

/// A mesh running in this process.
pub struct Mesh {
    /// Where clients reach it.
    pub addr: SocketAddr,
    /// Stops it.
    pub shutdown: Shutdown,
    /// The supervisor (an in-process handle).
    pub supervisor: SupervisorService,
    /// The principal client commands act as by default.
    pub default_principal: String,
    /// Where the A2A gateway serves, unless it is off.
    pub a2a: Option<SocketAddr>,
    /// Whether the operator console serves beside the gateway (the policy has principal
    /// `console`).
    pub console: bool,
    server: tokio::task::JoinHandle<Result<(), convene_server::ServeError>>,
    gateway: Option<tokio::task::JoinHandle<Result<(), convene_gateway::Error>>>,
    workers: std::sync::Mutex<Vec<tokio::task::JoinHandle<()>>>,
    pool: WorkerPool,
}

/// Mounts the MCP tools of `file` for the in-process workers: reads the configuration,
/// asks the (in-process) policy service for its tool catalog as `worker-pool`, and starts
/// or reaches every server. A server that cannot be started or reached is a warning.
async fn mount_mcp(
    file: &Path,
    policy: &PolicyHandle,
    credential: &str,
) -> anyhow::Result<convene_worker::tools::mcp::McpTools> {
    use convene_worker::tools::mcp::{Catalog, McpConfig, McpTools};
    let config = McpConfig::load(file).map_err(anyhow::Error::msg)?;
    let catalog = Catalog::fetch(policy, credential, Duration::ZERO)
        .await
        .context("reading the tool catalog for the MCP tools")?;
    let mcp = McpTools::mount(&config, &catalog).await;
    tracing::info!(
        file = %file.display(),
        servers = config.servers.len(),
        tools = ?mcp.names(),
        "MCP tools mounted"
    );
    Ok(mcp)
}

/// What starting another in-process worker needs.
#[derive(Clone)]
struct WorkerPool {
    policy: PolicyHandle,
    evidence: EvidenceHandle,
    /// The in-process supervisor, whose Delegate `delegate@1` calls.
    supervisor: SupervisorHandle,
    connector: Arc<MeshConnector>,
    registry: Arc<convene_supervisor::Registry>,
    credential: String,
    data_dir: PathBuf,
    shutdown: Shutdown,
    /// The MCP tools every worker mounts (`--mcp`), shared.
    mcp: Option<convene_worker::tools::mcp::McpTools>,
}

impl WorkerPool {
    /// Starts `count` workers serving the profiles in `profiles` (None: the example's),
    /// registered with the supervisor like remote workers; returns their profile ids.
    fn start(
        &self,
        profiles: Option<&Path>,
        tools_data: &Path,
        count: usize,
        capacity: u32,
    ) -> anyhow::Result<(Vec<String>, Vec<tokio::task::JoinHandle<()>>)> {
        let registry_handle: RegistryHandle = Arc::new(RegistryService(self.registry.clone()));
        let mut profile_ids = Vec::new();
        let mut tasks = Vec::new();
        for _ in 0..count.max(1) {
            let n = NEXT_WORKER.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let worker_config = convene_worker::Config {
                worker_id: format!("local-worker-{n}"),
                profiles_file: profiles.map(Path::to_owned),
                tools_data_dir: tools_data.to_owned(),
                capacity,
                data_dir: self.data_dir.clone(),
                ..convene_worker::Config::default()
            };
            let mut tools = worker_config.tools().context("starting a worker")?;
            if let Some(mcp) = &self.mcp {
                tools = tools.with_mcp(mcp);
            }
            let worker = convene_worker::WorkerService::from_config_with_tools(
                &worker_config,
                tools,
                self.policy.clone(),
                self.evidence.clone(),
                false,
            )
            .context("starting a worker")?
            .with_supervisor(self.supervisor.clone());
            if profile_ids.is_empty() {
                profile_ids = worker.profiles().into_iter().map(|p| p.id).collect();
            }
            let handle: WorkerHandle = Arc::new(worker.clone());
            let endpoint = self.connector.add_local(worker.worker_id(), handle);
            let registrar =
                worker.registrar(registry_handle.clone(), self.credential.clone(), endpoint);
            tasks.push(tokio::spawn(registrar.run(self.shutdown.clone())));
        }
        Ok((profile_ids, tasks))
    }
}

static NEXT_WORKER: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(1);

async fn wait_registered(registry: &convene_supervisor::Registry, at_least: usize) {
    // Registration is asynchronous; a run submitted right after start should find them.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while registry
        .snapshot()
        .iter()
        .filter(|(_, _, live)| *live)
        .count()
        < at_least
        && tokio::time::Instant::now() < deadline
    {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

impl std::fmt::Debug for Mesh {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mesh")
            .field("addr", &self.addr)
            .finish_non_exhaustive()
    }
}

impl Mesh {
    /// Starts `count` more in-process workers serving the profiles in `profiles`, and
    /// waits until they are registered.
    pub async fn add_workers(
        &self,
        profiles: &Path,
        tools_data: &Path,
        count: usize,
        capacity: u32,
    ) -> anyhow::Result<()> {
        let before = self
            .pool
            .registry
            .snapshot()
            .iter()
            .filter(|(_, _, live)| *live)
            .count();
        let (_, tasks) = self
            .pool
            .start(Some(profiles), tools_data, count, capacity)?;
        self.workers
            .lock()
            .expect("workers lock poisoned")
            .extend(tasks);
        wait_registered(&self.pool.registry, before + count.max(1)).await;
        Ok(())
    }

    /// Waits until the mesh has stopped (after `shutdown` fired) and drained.
    pub async fn stopped(self) -> anyhow::Result<()> {
        let served = self.server.await.context("the server task panicked")?;
        if let Some(gateway) = self.gateway {
            gateway
                .await
                .context("the A2A gateway task panicked")?
                .context("the A2A gateway failed")?;
        }
        let workers = std::mem::take(&mut *self.workers.lock().expect("workers lock poisoned"));
        for w in workers {
            let _ = w.await;
        }
        self.supervisor
            .actors_stopped(convene_supervisor::ACTOR_STOP_GRACE)
            .await;
        if let Some(mcp) = &self.pool.mcp {
            mcp.shutdown().await;
        }
        served.context("the gRPC server failed")
    }
}

fn pick_default_principal(policy: &Policy, asked: Option<&str>) -> anyhow::Result<String> {
    if let Some(p) = asked {
        anyhow::ensure!(
            policy.principals.contains_key(p),
            "--default-principal {p} is not in the policy file"
        );
        return Ok(p.to_owned());
    }
    if policy.principals.contains_key("oncall@acme") {
        return Ok("oncall@acme".to_owned());
    }
    policy
        .principals
        .values()
        .find(|p| p.kind == PrincipalKind::Human && p.has_role("runs:start"))
        .map(|p| p.id.clone())
        .context("the policy file has no person allowed to start runs (role runs:start)")
}

/// Starts every service in this process, serving gRPC on a listener bound to
/// `args.listen`.
pub async fn start(args: &UpArgs, data_dir: &Path, shutdown: Shutdown) -> anyhow::Result<Mesh> {
    std::fs::create_dir_all(data_dir)
        .with_context(|| format!("cannot create data directory {}", data_dir.display()))?;
    let creds = data_dir.join("credentials");

    // One database (one pool) holds every service's state: the SQLite file in the data
    // directory unless --database-url says otherwise; None keeps state in memory.
    let database = convene_store::open(args.database_url.as_deref(), data_dir)
        .await
        .context("opening the database")?;
    match &database {
        Some(db) => {
            tracing::info!(backend = %db.backend(), url = db.url(), "state is stored in the database")
        }
        None => {
            tracing::info!("state is kept in memory (--database-url memory): it is lost at exit")
        }
    }

    // Policy: keys and dev credentials in the data directory; counters, revocations and
    // decisions in the database.
    let policy_config = convene_policy::Config {
        common: convene_server::ServiceCommon {
            data_dir: data_dir.to_owned(),
            policy_file: args.policy_file.clone(),
            dev_credentials: true,
            ..convene_policy::Config::default().common
        },
        decision_log: convene_policy::DecisionLogTarget::Database,
    };
    let policy_service = convene_policy::PolicyService::open_with_database(
        &policy_config,
        convene_policy::Clock::system(),
        database.clone(),
    )
    .context("starting the policy service")?;
    let policy: Arc<Policy> = policy_service.policy().clone();
    let policy_handle: PolicyHandle = Arc::new(policy_service.clone());

    let evidence_config = convene_evidence_store::Config::in_dir(data_dir);
    let catalog: Arc<dyn convene_evidence_store::catalog::Catalog> = match &database {
        Some(db) => Arc::new(convene_evidence_store::SqlCatalog::new(db.clone())),
        None => Arc::new(convene_evidence_store::catalog::MemoryCatalog::new()),
    };
    let evidence_service = convene_evidence_store::EvidenceStoreService::open_with_catalog(
        &evidence_config,
        policy_handle.clone(),
        policy.clone(),
        catalog,
    )
    .context("starting the evidence store")?;
    let evidence_handle: EvidenceHandle = Arc::new(evidence_service.clone());

    let approvals: Arc<dyn convene_approval::ApprovalStore> = match &database {
        Some(db) => Arc::new(convene_approval::SqlApprovalStore::new(db.clone())),
        None => Arc::new(convene_approval::MemoryStore::new()),
    };
    let approval_service = Arc::new(
        convene_approval::ApprovalService::new(policy.clone())
            .with_store(approvals)
            .with_shutdown(shutdown.clone()),
    );
    let approval_handle: ApprovalHandle = approval_service.clone();

    // One supervisor per data directory: its replica id is kept there, so a restarted
    // `convene up` takes back the runs it left unfinished at once.
    let supervisor_config = convene_supervisor::Config {
        common: convene_server::ServiceCommon {
            data_dir: data_dir.to_owned(),
            policy_file: args.policy_file.clone(),
            ..convene_supervisor::Config::default().common
        },
        replica_id: Some(
            convene_supervisor::persistent_replica_id(data_dir)
                .context("reading the supervisor's replica id in the data directory")?,
        ),
        nats_url: args.nats_url.clone(),
        commit_linger: args.commit_linger,
        max_active_runs: args.max_active_runs,
        max_watch_streams: args.max_watch_streams,
        templates_file: args.templates_file.clone(),
        ..convene_supervisor::Config::default()
    };
    supervisor_config.check()?;
    // The templates' specs are checked against the policy, as StartRun checks a spec.
    let templates = supervisor_config.templates(&policy)?;
    let gateway_templates = templates.clone();
    let gateway_database = database.clone();
    let replica = supervisor_config.replica();
    let lease_ttl = supervisor_config.run_lease_ttl;
    let run_store: Arc<dyn convene_supervisor::RunStore> = match database {
        Some(db) => Arc::new(
            SqlRunStore::open(db)
                .await
                .context("opening the run store")?
                .with_owner(replica, lease_ttl),
        ),
        None => Arc::new(MemoryStore::default().with_owner(replica, lease_ttl)),
    };
    let connector = Arc::new(MeshConnector::default());
    let (supervisor, registry) = convene_supervisor::build(convene_supervisor::Parts {
        policy: policy_handle.clone(),
        evidence: evidence_handle.clone(),
        approval: approval_handle.clone(),
        policy_file: policy.clone(),
        credential: dev_credential(&creds, "supervisor").context("supervisor credential")?,
        store: run_store,
        connector: connector.clone(),
        config: supervisor_config,
        shutdown: shutdown.clone(),
    });
    let supervisor = supervisor.with_templates(templates);

    // Workers: in-process, registered like remote ones, with the MCP tools of --mcp.
    let worker_credential = dev_credential(&creds, "worker-pool").context("worker credential")?;
    let mcp = match &args.mcp_file {
        Some(file) => Some(mount_mcp(file, &policy_handle, &worker_credential).await?),
        None => None,
    };
    let pool = WorkerPool {
        policy: policy_handle.clone(),
        evidence: evidence_handle.clone(),
        supervisor: Arc::new(supervisor.clone()),
        connector: connector.clone(),
        registry: registry.clone(),
        credential: worker_credential,
        data_dir: data_dir.to_owned(),
        shutdown: shutdown.clone(),
        mcp,
    };
    let (profile_ids, workers) = pool.start(
        args.profiles_file.as_deref(),
        &args.tools_data_dir,
        args.workers,
        args.capacity,
    )?;

    let default_principal = pick_default_principal(&policy, args.default_principal.as_deref())?;
    std::fs::write(
        creds.join(DEFAULT_PRINCIPAL_FILE),
        format!("{default_principal}\n"),
    )
    .context("cannot record the default principal")?;
    // Creates the default principal's credential now, so the CLI finds it.
    dev_credential(&creds, &default_principal).context("default principal credential")?;

    let settings = ServerSettings {
        listen: args.listen,
        // Delegate calls wait for their children and workers run for minutes.
        request_timeout: Some(Duration::from_secs(15 * 60)),
        max_message_bytes: evidence_service.message_limit(),
        ..ServerSettings::default()
    };
    let listener = convene_server::bind(args.listen).await?;
    let addr = listener.local_addr()?;
    let mut server = GrpcServer::new(settings);
    server = policy_service.add_to(server);
    server = evidence_service.add_to(server);
    server = convene_approval::add_to_server(server, approval_service);
    // One address for everything, the worker registry included: a worker run apart
    // registers here (`--registry http://<this address>`), not at a port + 100.
    server = convene_supervisor::add_to(server, supervisor.clone());
    server = convene_supervisor::add_internal_to(server, registry.clone());
    let server = tokio::spawn(server.serve(listener, shutdown.clone()));

    // The A2A gateway, on the in-process supervisor.
    let mut console_on = false;
    let (a2a, gateway) = match convene_gateway::bind_http(args.http_listen).await? {
        Some(http) => {
            let a2a = http.local_addr()?;
            let base = args.public_url.as_deref().map_or_else(
                || format!("{}://{a2a}", scheme()),
                |url| url.trim_end_matches('/').to_owned(),
            );
            // The operator console acts with principal `console`'s development
            // credential, when the policy has that principal.
            let console = policy
                .principal(convene_gateway::config::CONSOLE_PRINCIPAL)
                .map(|_| {
                    convene_mesh::policy_file::dev_credential(
                        &data_dir.join(convene_server::CREDENTIALS_DIR),
                        convene_gateway::config::CONSOLE_PRINCIPAL,
                    )
                })
                .transpose()
                .context("reading the console's development credential")?
                .map(|credential| convene_gateway::ConsoleSettings {
                    approval: approval_handle.clone(),
                    evidence: evidence_handle.clone(),
                    credential,
                    session_ttl: convene_gateway::console::DEFAULT_SESSION_TTL,
                    jaeger_url: std::env::var("CONVENE_JAEGER_URL").ok(),
                });
            console_on = console.is_some();
            let app = convene_gateway::build(
                Arc::new(supervisor.clone()),
                policy.clone(),
                &gateway_templates,
                gateway_database,
                &base,
                console,
            );
            let served = tokio::spawn(convene_gateway::serve_http(http, app, shutdown.clone()));
            (Some(a2a), Some(served))
        }
        None => (None, None),
    };

    wait_registered(&registry, args.workers.max(1)).await;
    tracing::info!(
        %addr,
        data_dir = %data_dir.display(),
        workers = args.workers.max(1),
        profiles = ?profile_ids,
        default_principal,
        "convene up: policy, evidence store, approval, supervisor and workers serving"
    );
    Ok(Mesh {
        addr,
        shutdown,
        supervisor,
        default_principal,
        a2a,
        console: console_on,
        server,
        gateway,
        workers: std::sync::Mutex::new(workers),
        pool,
    })
}

/// `convene up`: starts the mesh and serves until Ctrl-C / SIGTERM, then flushes the
/// trace spans still buffered. One process, one tracer provider: spans carry
/// `service.name = convene` and name their logical service in `convene.service`.
pub async fn run(args: UpArgs, data_dir: &Path) -> anyhow::Result<()> {
    let telemetry = convene_telemetry::init(
        convene_telemetry::ONE_PROCESS_SERVICE_NAME,
        &args.telemetry(),
    );
    let shutdown = Shutdown::from_signals()?;
    let mesh = start(&args, data_dir, shutdown).await?;
    println!(
        "convene up: serving on {}://{} (data dir {}); client commands act as {} by default. Ctrl-C stops.",
        scheme(),
        mesh.addr,
        data_dir.display(),
        mesh.default_principal
    );
    if let Some(a2a) = mesh.a2a {
        let base = args.public_url.as_deref().map_or_else(
            || format!("{}://{a2a}", scheme()),
            |u| u.trim_end_matches('/').to_owned(),
        );
        println!(
            "convene up: A2A gateway on {}://{a2a} (Agent Card: {base}/.well-known/agent-card.json)",
            scheme()
        );
        if mesh.console {
            println!(
                "convene up: operator console at {base}/console/ (sign in with a principal's credential)"
            );
        }
    }
    if let Some(endpoint) = telemetry.exporting_to() {
        println!("convene up: exporting traces over OTLP to {endpoint}");
    }
    let stopped = mesh.stopped().await;
    telemetry.shutdown().await;
    stopped
}
