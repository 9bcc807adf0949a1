//! A mesh of operating-system processes for `convene bench --processes`: every service
//! and every worker runs as `convene serve <service>` (this very binary) on its own
//! loopback port, sharing the bench's data directory, talking gRPC.
//!
//! The processes are stopped in order at the end (workers, then the supervisor, then
//! the services it calls: SIGTERM, a grace period, then SIGKILL). They run in their own
//! process group, so a Ctrl-C at the terminal reaches the bench alone, which stops them
//! the same way; and a [`ProcessMesh`] dropped without [`ProcessMesh::stop`] (an error,
//! a panic, an interrupted start) kills them at once, so none outlives the bench.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use anyhow::Context as _;
use tokio::process::{Child, Command};
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

/// Time a service gets to answer its health check after it was started.
const READY_TIMEOUT: Duration = Duration::from_secs(60);

/// What to start.
#[derive(Debug, Clone)]
pub struct Options {
    /// The `convene` binary.
    pub bin: PathBuf,
    /// Data directory every process shares (credentials, keys, artifacts, the default
    /// SQLite file); logs go to `<data_dir>/logs/<process>.log`.
    pub data_dir: PathBuf,
    /// Policy file.
    pub policy: PathBuf,
    /// Worker profiles file.
    pub profiles: PathBuf,
    /// Directory the workers' tools read.
    pub tools_data: PathBuf,
    /// Database every service shares (None: each its own SQLite file,
    /// `<data_dir>/<service>.db`).
    pub database_url: Option<String>,
    /// Worker processes.
    pub workers: usize,
    /// Delegations each worker runs at once.
    pub capacity: u32,
    /// Calls each server serves at once (None: the servers' default).
    pub concurrency_limit: Option<usize>,
    /// The supervisor's `commit_linger`.
    pub commit_linger: Duration,
    /// The supervisor's `max_active_runs`.
    pub max_active_runs: usize,
}

/// One process of the mesh.
#[derive(Debug)]
struct Service {
    name: String,
    pid: u32,
    child: Child,
    log: PathBuf,
}

/// Every service and worker as its own process. Dropping it kills them.
#[derive(Debug)]
pub struct ProcessMesh {
    /// The supervisor's endpoint.
    pub supervisor_endpoint: String,
    services: Vec<Service>,
}

fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

fn url(port: u16) -> String {
    format!("http://127.0.0.1:{port}")
}

impl ProcessMesh {
    /// Starts policy, evidence store, approval, supervisor and `options.workers`
    /// workers, each waited for until its health check answers SERVING.
    ///
    /// # Errors
    ///
    /// A process that cannot be started, exits, or does not become ready; the error
    /// carries the end of its log. Processes started so far are killed.
    pub async fn start(options: &Options) -> anyhow::Result<Self> {
        let logs = options.data_dir.join("logs");
        std::fs::create_dir_all(&logs)
            .with_context(|| format!("cannot create {}", logs.display()))?;
        let (policy, evidence, approval, supervisor) =
            (free_port()?, free_port()?, free_port()?, free_port()?);
        let mut mesh = Self {
            supervisor_endpoint: url(supervisor),
            services: Vec::new(),
        };
        let service = |name: &str, port: u16| {
            let mut cmd = base_command(options, &["serve", name], port);
            // Every service reads the bench's policy file. Each owns its tables and
            // nothing reads another's, so on the SQLite default each has a file of its
            // own in the data directory: their commits do not queue for one file's
            // write lock. A configured database is shared. Workers have neither: their
            // configuration refuses both keys.
            cmd.env("CONVENE_POLICY_FILE", &options.policy);
            let database = options.database_url.clone().unwrap_or_else(|| {
                convene_store::sqlite_url(&options.data_dir.join(format!("{name}.db")))
            });
            cmd.env("CONVENE_DATABASE_URL", database);
            cmd
        };
        // Policy first: it creates the development credentials everyone else reads.
        let mut cmd = service("policy", policy);
        // As `convene up` does: decisions in the database rather than a file.
        cmd.env("CONVENE_DECISION_LOG", "database");
        mesh.spawn("policy", cmd, policy, &logs).await?;
        let mut cmd = service("evidence-store", evidence);
        cmd.env("CONVENE_POLICY_ENDPOINT", url(policy));
        mesh.spawn("evidence-store", cmd, evidence, &logs).await?;
        let cmd = service("approval", approval);
        mesh.spawn("approval", cmd, approval, &logs).await?;
        // Workers register on the supervisor's internal listener.
        let registry = free_port()?;
        let mut cmd = service("supervisor", supervisor);
        cmd.env("CONVENE_INTERNAL_LISTEN", format!("127.0.0.1:{registry}"))
            .env("CONVENE_POLICY_ENDPOINT", url(policy))
            .env("CONVENE_EVIDENCE_ENDPOINT", url(evidence))
            .env("CONVENE_APPROVAL_ENDPOINT", url(approval))
            .env(
                "CONVENE_COMMIT_LINGER",
                humantime::format_duration(options.commit_linger).to_string(),
            )
            .env(
                "CONVENE_MAX_ACTIVE_RUNS",
                options.max_active_runs.to_string(),
            );
        mesh.spawn("supervisor", cmd, supervisor, &logs).await?;
        for n in 1..=options.workers.max(1) {
            let port = free_port()?;
            let name = format!("worker-{n}");
            let mut cmd = base_command(options, &["serve", "worker"], port);
            cmd.env("CONVENE_POLICY_ENDPOINT", url(policy))
                .env("CONVENE_EVIDENCE_ENDPOINT", url(evidence))
                .env("CONVENE_SUPERVISOR_ENDPOINT", url(supervisor))
                .env("CONVENE_REGISTRY_ENDPOINTS", format!("[{}]", url(registry)))
                .env("CONVENE_WORKER_ID", format!("bench-{name}"))
                .env("CONVENE_PROFILES_FILE", &options.profiles)
                .env("CONVENE_TOOLS_DATA_DIR", &options.tools_data)
                .env("CONVENE_CAPACITY", options.capacity.to_string());
            mesh.spawn(&name, cmd, port, &logs).await?;
        }
        Ok(mesh)
    }

    /// Every process by name, with its pid.
    pub fn processes(&self) -> Vec<(String, u32)> {
        self.services
            .iter()
            .map(|s| (s.name.clone(), s.pid))
            .collect()
    }

    async fn spawn(
        &mut self,
        name: &str,
        mut cmd: Command,
        port: u16,
        logs: &Path,
    ) -> anyhow::Result<()> {
        let log = logs.join(format!("{name}.log"));
        let file = std::fs::File::create(&log)
            .with_context(|| format!("cannot create {}", log.display()))?;
        cmd.stdout(file.try_clone()?).stderr(file);
        let child = cmd
            .spawn()
            .with_context(|| format!("cannot start the {name} process"))?;
        let pid = child
            .id()
            .with_context(|| format!("the {name} process exited at once"))?;
        self.services.push(Service {
            name: name.to_owned(),
            pid,
            child,
            log,
        });
        let addr: SocketAddr = ([127, 0, 0, 1], port).into();
        let service = self.services.last_mut().expect("just pushed");
        wait_ready(service, addr).await
    }

    /// Stops every process: SIGTERM in order (workers, the supervisor, then the
    /// services it calls), each given `grace` to drain and exit before it is killed.
    pub async fn stop(mut self, grace: Duration) {
        let order = |name: &str| match name {
            "supervisor" => 1,
            "policy" | "evidence-store" | "approval" => 2,
            _ => 0,
        };
        let mut services = std::mem::take(&mut self.services);
        services.sort_by_key(|s| order(&s.name));
        for s in &mut services {
            if matches!(s.child.try_wait(), Ok(Some(_))) {
                continue;
            }
            let signalled = i32::try_from(s.pid)
                .ok()
                .and_then(rustix::process::Pid::from_raw)
                .is_some_and(|pid| {
                    rustix::process::kill_process(pid, rustix::process::Signal::TERM).is_ok()
                });
            if !signalled || tokio::time::timeout(grace, s.child.wait()).await.is_err() {
                tracing::warn!(process = %s.name, "did not stop after SIGTERM; killing it");
                let _ = s.child.kill().await;
            }
        }
    }
}

impl Drop for ProcessMesh {
    fn drop(&mut self) {
        for s in &mut self.services {
            let _ = s.child.start_kill();
        }
        // Reap them before the bench goes on (or exits), so none is still alive after
        // it. SIGKILL takes effect at once; the bound only guards against the
        // impossible.
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        for s in &mut self.services {
            while matches!(s.child.try_wait(), Ok(None)) && std::time::Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(2));
            }
        }
    }
}

/// `convene <args>` listening on `port`, with the bench's data directory and nothing
/// of this process's `CONVENE_*` environment: services refuse keys they do not know,
/// and the bench's own settings are not theirs.
fn base_command(options: &Options, args: &[&str], port: u16) -> Command {
    let mut cmd = Command::new(&options.bin);
    cmd.args(args);
    for (key, _) in std::env::vars_os() {
        if key.to_string_lossy().starts_with("CONVENE_") {
            cmd.env_remove(key);
        }
    }
    cmd.env("CONVENE_DATA_DIR", &options.data_dir)
        .env("CONVENE_SERVER__LISTEN", format!("127.0.0.1:{port}"))
        .stdin(Stdio::null())
        // Their own process group: a Ctrl-C at the terminal reaches the bench, which
        // stops them in order.
        .process_group(0)
        .kill_on_drop(true);
    if let Some(limit) = options.concurrency_limit {
        cmd.env("CONVENE_SERVER__CONCURRENCY_LIMIT", limit.to_string());
    }
    if std::env::var_os("RUST_LOG").is_none() {
        cmd.env("RUST_LOG", "warn");
    }
    cmd
}

/// Waits until the process answers a health check with SERVING; fails when it exits
/// first or takes longer than [`READY_TIMEOUT`].
async fn wait_ready(service: &mut Service, addr: SocketAddr) -> anyhow::Result<()> {
    let deadline = tokio::time::Instant::now() + READY_TIMEOUT;
    let endpoint = format!("http://{addr}");
    loop {
        if let Ok(Some(status)) = service.child.try_wait() {
            anyhow::bail!(
                "the {} process exited ({status}) before it was ready; its log ({}) ends:\n{}",
                service.name,
                service.log.display(),
                log_tail(&service.log)
            );
        }
        if let Ok(channel) = tonic::transport::Endpoint::from_shared(endpoint.clone())?
            .connect()
            .await
        {
            let answer = HealthClient::new(channel)
                .check(HealthCheckRequest {
                    service: String::new(),
                })
                .await;
            if answer.is_ok_and(|r| r.into_inner().status == ServingStatus::Serving as i32) {
                return Ok(());
            }
        }
        if tokio::time::Instant::now() >= deadline {
            anyhow::bail!(
                "the {} process did not become ready on {addr} within {READY_TIMEOUT:?}; its \
                 log ({}) ends:\n{}",
                service.name,
                service.log.display(),
                log_tail(&service.log)
            );
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The last lines of a log file.
fn log_tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(20)..].join("\n")
}
