//! Shared helpers for convene's end-to-end tests.
//!
//! A [`TestMesh`] is a whole convene mesh on loopback sockets with its state in a fresh
//! temporary directory, in one of two modes:
//!
//! - [`Mode::InProcess`]: the code `convene up` runs — every service in this process,
//!   talking through in-process handles, all served on one listener;
//! - [`Mode::Processes`]: every service as its own operating-system process
//!   (`convene serve <service>`), talking gRPC to each other.
//!
//! Tests talk to either through the same gRPC clients, as any caller would.
#![forbid(unsafe_code)]

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use convene_mesh::auth::request;
use convene_mesh::handles::{GrpcApproval, GrpcEvidenceStore, GrpcSupervisor, SupervisorHandle};
use convene_mesh::policy_file::dev_credential;
use convene_proto::v1;
use convene_server::Shutdown;
use convene_server::test_util::free_port;
use tempfile::TempDir;
use tokio::process::{Child, Command};

/// How the mesh runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Every service in this process (`convene up`).
    InProcess,
    /// Every service its own process.
    Processes,
}

/// One group of workers serving a profiles file.
#[derive(Debug, Clone)]
pub struct Workers {
    /// Profiles file content (YAML); None: the example profiles.
    pub profiles: Option<String>,
    /// How many workers.
    pub count: usize,
    /// Delegations each runs at once.
    pub capacity: u32,
}

impl Default for Workers {
    fn default() -> Self {
        Self {
            profiles: None,
            count: 1,
            capacity: 64,
        }
    }
}

/// What to start.
#[derive(Debug, Clone, Default)]
pub struct MeshOptions {
    /// Worker groups; empty: one worker with the example profiles.
    pub workers: Vec<Workers>,
    /// Policy file content (YAML) for every service that reads the policy; None: the
    /// example policy.
    pub policy: Option<String>,
    /// The database every service keeps its state in. None: what
    /// [`DATABASE_ENV`] says (unset: the SQLite file in the mesh's data directory; a
    /// `postgres://` server URL: a fresh database created on it for this mesh and
    /// dropped with it; anything else: used as it is).
    pub database_url: Option<String>,
    /// Extra environment for every service and worker process (Processes mode), e.g.
    /// `OTEL_EXPORTER_OTLP_ENDPOINT` to export their traces. Applied last, so it can
    /// override the harness's own settings (`RUST_LOG`).
    pub env: Vec<(String, String)>,
    /// Extra environment for the supervisor process only (Processes mode), applied
    /// after `env`: settings only the supervisor's configuration knows, such as
    /// `CONVENE_REPLICA_ID`, `CONVENE_RUN_LEASE_TTL`, `CONVENE_NATS_URL` or a crash point.
    /// [`TestMesh::restart`] replaces it.
    pub supervisor_env: Vec<(String, String)>,
    /// The supervisor's `commit_linger` (in either mode); None: its default.
    pub commit_linger: Option<Duration>,
}

/// The repository's root directory.
pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The example's tool data directory.
pub fn example_data() -> PathBuf {
    repo_root().join("examples/payment-incident/data")
}

/// The example profiles file's text.
pub fn example_profiles() -> String {
    std::fs::read_to_string(repo_root().join("examples/payment-incident/profiles.yaml"))
        .expect("the example profiles file exists")
}

/// The example run spec.
pub fn example_spec() -> v1::RunSpec {
    spec_from_yaml(
        &std::fs::read_to_string(repo_root().join("examples/payment-incident/run.yaml"))
            .expect("the example run spec exists"),
    )
}

/// A run spec from YAML in the protobuf JSON mapping.
pub fn spec_from_yaml(text: &str) -> v1::RunSpec {
    let value: serde_json::Value = serde_yaml::from_str(text).expect("valid YAML");
    convene_proto::json::from_value(value).expect("a valid RunSpec")
}

/// The `convene` binary built next to this test binary.
pub fn convene_bin() -> PathBuf {
    let exe = std::env::current_exe().expect("the test binary's path");
    let dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("the test binary lives in target/<profile>/deps");
    let bin = dir.join(format!("convene{}", std::env::consts::EXE_SUFFIX));
    assert!(
        bin.exists(),
        "{} is missing: build it with `cargo build -p convene-cli` (cargo test --workspace builds it)",
        bin.display()
    );
    bin
}

/// The variable that chooses the database of every [`TestMesh`] whose
/// [`MeshOptions::database_url`] is unset, so the whole end-to-end suite can run against
/// PostgreSQL: `CONVENE_TEST_DATABASE_URL=postgres://postgres@127.0.0.1:5432/postgres`.
pub const DATABASE_ENV: &str = "CONVENE_TEST_DATABASE_URL";

/// The database URL a mesh uses (None: the default SQLite file in its data directory)
/// and, for a PostgreSQL server, the fresh database created for it.
async fn mesh_database(
    asked: Option<String>,
) -> (
    Option<String>,
    Option<convene_store::test_util::TestPostgres>,
) {
    let url = asked.or_else(|| std::env::var(DATABASE_ENV).ok());
    match url.as_deref().map(str::trim) {
        None | Some("") => (None, None),
        Some(url) if url.starts_with("postgres://") || url.starts_with("postgresql://") => {
            let database = convene_store::test_util::TestPostgres::create(url)
                .await
                .unwrap_or_else(|e| panic!("{DATABASE_ENV}: cannot create a test database: {e}"));
            (Some(database.url().to_owned()), Some(database))
        }
        Some(url) => (Some(url.to_owned()), None),
    }
}

/// A running mesh; stopped when dropped.
pub struct TestMesh {
    /// The mode it runs in.
    pub mode: Mode,
    /// The supervisor's endpoint.
    pub supervisor_endpoint: String,
    /// The approval service's endpoint.
    pub approval_endpoint: String,
    /// The evidence store's endpoint.
    pub evidence_endpoint: String,
    /// The policy service's endpoint.
    pub policy_endpoint: String,
    dir: TempDir,
    in_process: Option<(Shutdown, convene_cli::up::Mesh)>,
    children: Vec<Proc>,
    env: Vec<(String, String)>,
    database_url: Option<String>,
    /// A PostgreSQL database created for this mesh, dropped after it.
    _database: Option<convene_store::test_util::TestPostgres>,
}

impl std::fmt::Debug for TestMesh {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TestMesh")
            .field("mode", &self.mode)
            .field("supervisor", &self.supervisor_endpoint)
            .finish_non_exhaustive()
    }
}

impl Drop for TestMesh {
    fn drop(&mut self) {
        if let Some((shutdown, _)) = &self.in_process {
            shutdown.trigger();
        }
        for p in &mut self.children {
            let _ = p.child.start_kill();
        }
    }
}

/// The supervisor process's own environment: settings it keeps across restarts, and
/// the extra that [`TestMesh::restart`] replaces.
struct SupervisorEnv {
    settings: Vec<(String, String)>,
    extra: Vec<(String, String)>,
}

/// How one process of a mesh is started (Processes mode), kept so that it can be
/// started again ([`TestMesh::restart`]) or copied ([`TestMesh::spawn_supervisor`]).
#[derive(Debug, Clone)]
struct Recipe {
    /// `convene` arguments, e.g. `serve supervisor`.
    args: Vec<String>,
    /// The port it listens on (`CONVENE_SERVER__LISTEN`).
    port: u16,
    /// Variables removed from the inherited environment.
    remove: Vec<String>,
    /// Its environment.
    env: Vec<(String, String)>,
    /// Its own extra environment, applied last; a restart may replace it.
    extra: Vec<(String, String)>,
}

impl Recipe {
    fn command(&self) -> Command {
        let mut cmd = Command::new(convene_bin());
        cmd.args(&self.args);
        for name in &self.remove {
            cmd.env_remove(name);
        }
        cmd.env("CONVENE_SERVER__LISTEN", format!("127.0.0.1:{}", self.port))
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .envs(self.extra.iter().map(|(k, v)| (k, v)))
            .stdin(std::process::Stdio::null())
            .kill_on_drop(true);
        cmd
    }
}

/// A process of the mesh.
struct Proc {
    name: String,
    child: Child,
    recipe: Recipe,
}

impl TestMesh {
    /// Starts a mesh in `mode`.
    pub async fn start(mode: Mode, options: MeshOptions) -> Self {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let workers = if options.workers.is_empty() {
            vec![Workers::default()]
        } else {
            options.workers
        };
        let mut profile_files = Vec::new();
        for (i, w) in workers.iter().enumerate() {
            let path = dir.path().join(format!("profiles-{i}.yaml"));
            std::fs::write(&path, w.profiles.clone().unwrap_or_else(example_profiles))
                .expect("profiles file written");
            profile_files.push(path);
        }
        let policy_file = options.policy.map(|text| {
            let path = dir.path().join("policy.yaml");
            std::fs::write(&path, text).expect("policy file written");
            path
        });
        let (database_url, database) = mesh_database(options.database_url).await;
        let mut mesh = match mode {
            Mode::InProcess => {
                Self::start_in_process(
                    dir,
                    &workers,
                    &profile_files,
                    policy_file,
                    database_url.as_deref(),
                    options.commit_linger,
                )
                .await
            }
            Mode::Processes => {
                Self::start_processes(
                    dir,
                    &workers,
                    &profile_files,
                    policy_file.as_deref(),
                    options.env,
                    SupervisorEnv {
                        settings: options
                            .commit_linger
                            .map(|linger| {
                                let linger = humantime::format_duration(linger).to_string();
                                ("CONVENE_COMMIT_LINGER".to_owned(), linger)
                            })
                            .into_iter()
                            .collect(),
                        extra: options.supervisor_env,
                    },
                    database_url.as_deref(),
                )
                .await
            }
        };
        mesh.database_url = database_url;
        mesh._database = database;
        mesh
    }

    /// The database the mesh's services share; None: the SQLite file `convene.db` in
    /// [`data_dir`](Self::data_dir).
    pub fn database_url(&self) -> Option<&str> {
        self.database_url.as_deref()
    }

    async fn start_in_process(
        dir: TempDir,
        workers: &[Workers],
        profiles: &[PathBuf],
        policy_file: Option<PathBuf>,
        database_url: Option<&str>,
        commit_linger: Option<Duration>,
    ) -> Self {
        // In one process every worker group needs its own profiles; `up` starts one group,
        // and further groups are added the same way `up` adds its workers.
        let mut args = convene_cli::up::UpArgs::defaults("127.0.0.1:0".parse().expect("addr"));
        args.tools_data_dir = example_data();
        args.profiles_file = Some(profiles[0].clone());
        args.policy_file = policy_file;
        args.workers = workers[0].count;
        args.capacity = workers[0].capacity;
        args.database_url = database_url.map(str::to_owned);
        if let Some(linger) = commit_linger {
            args.commit_linger = linger;
        }
        let shutdown = Shutdown::new();
        let mesh = convene_cli::up::start(&args, &dir.path().join("data"), shutdown.clone())
            .await
            .expect("the in-process mesh starts");
        for (group, path) in workers.iter().zip(profiles).skip(1) {
            mesh.add_workers(path, &example_data(), group.count, group.capacity)
                .await
                .expect("more in-process workers start");
        }
        let endpoint = format!("http://{}", mesh.addr);
        Self {
            mode: Mode::InProcess,
            supervisor_endpoint: endpoint.clone(),
            approval_endpoint: endpoint.clone(),
            evidence_endpoint: endpoint.clone(),
            policy_endpoint: endpoint,
            dir,
            in_process: Some((shutdown, mesh)),
            children: Vec::new(),
            env: Vec::new(),
            database_url: None,
            _database: None,
        }
    }

    async fn start_processes(
        dir: TempDir,
        workers: &[Workers],
        profiles: &[PathBuf],
        policy_file: Option<&Path>,
        env: Vec<(String, String)>,
        supervisor_env: SupervisorEnv,
        database_url: Option<&str>,
    ) -> Self {
        let data = dir.path().join("data");
        std::fs::create_dir_all(&data).expect("data dir");
        let port = |_: &str| free_port();
        let (policy, evidence, approval, supervisor) = (
            port("policy"),
            port("evidence"),
            port("approval"),
            port("supervisor"),
        );
        let url = |p: u16| format!("http://127.0.0.1:{p}");
        let mut mesh = Self {
            mode: Mode::Processes,
            supervisor_endpoint: url(supervisor),
            approval_endpoint: url(approval),
            evidence_endpoint: url(evidence),
            policy_endpoint: url(policy),
            dir,
            in_process: None,
            children: Vec::new(),
            env,
            database_url: None,
            _database: None,
        };
        let extra = mesh.env.clone();
        let recipe = |args: &[&str], port: u16| {
            let mut env = vec![
                ("CONVENE_DATA_DIR".to_owned(), data.display().to_string()),
                ("RUST_LOG".to_owned(), "warn".to_owned()),
            ];
            // Every service here reads the policy file (workers do not: their
            // configuration refuses the key).
            if let Some(path) = policy_file {
                env.push(("CONVENE_POLICY_FILE".into(), path.display().to_string()));
            }
            // Every service shares one database (SQLite in the data directory works across
            // processes too: WAL and a busy timeout).
            if let Some(url) = database_url {
                env.push(("CONVENE_DATABASE_URL".into(), url.to_owned()));
            }
            env.extend(extra.iter().cloned());
            Recipe {
                args: args.iter().map(|a| (*a).to_owned()).collect(),
                port,
                remove: Vec::new(),
                env,
                extra: Vec::new(),
            }
        };
        // Policy first: it creates the development credentials everyone else reads.
        mesh.spawn("policy", recipe(&["serve", "policy"], policy))
            .await;
        let mut r = recipe(&["serve", "evidence-store"], evidence);
        r.env
            .insert(0, ("CONVENE_POLICY_ENDPOINT".into(), url(policy)));
        mesh.spawn("evidence-store", r).await;
        mesh.spawn("approval", recipe(&["serve", "approval"], approval))
            .await;
        let mut r = recipe(&["serve", "supervisor"], supervisor);
        r.env.splice(
            0..0,
            [
                ("CONVENE_POLICY_ENDPOINT".to_owned(), url(policy)),
                ("CONVENE_EVIDENCE_ENDPOINT".to_owned(), url(evidence)),
                ("CONVENE_APPROVAL_ENDPOINT".to_owned(), url(approval)),
            ],
        );
        r.env.extend(supervisor_env.settings);
        r.extra = supervisor_env.extra;
        mesh.spawn("supervisor", r).await;
        // Dispatches wait for a live worker, so runs may start before workers register.
        let mut n = 0;
        for (group, path) in workers.iter().zip(profiles) {
            for _ in 0..group.count {
                n += 1;
                mesh.spawn_worker(&format!("worker-{n}"), path, group.capacity)
                    .await;
            }
        }
        mesh
    }

    async fn spawn(&mut self, name: &str, recipe: Recipe) {
        assert!(
            self.launch(name, recipe).await,
            "{name} exited before it was serving; see its log above"
        );
    }

    /// Starts a process and waits until it serves; false when it exited first.
    async fn launch(&mut self, name: &str, recipe: Recipe) -> bool {
        let mut child = recipe
            .command()
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {name}: {e}"));
        let addr: SocketAddr = format!("127.0.0.1:{}", recipe.port).parse().expect("addr");
        let ready = tokio::select! {
            () = convene_server::test_util::wait_ready(addr) => true,
            _ = child.wait() => false,
        };
        self.children.push(Proc {
            name: name.to_owned(),
            child,
            recipe,
        });
        ready
    }

    /// Starts one more worker process (Processes mode) with `profiles` as its
    /// profiles file, registered as `worker_id`.
    pub async fn spawn_worker(&mut self, worker_id: &str, profiles: &Path, capacity: u32) {
        let supervisor = self.supervisor_endpoint.clone();
        self.spawn_worker_at(worker_id, profiles, capacity, &supervisor)
            .await;
    }

    /// Starts one more worker process (Processes mode) registered as `worker_id` with the
    /// supervisor at `supervisor_endpoint` (a replica from
    /// [`spawn_supervisor`](Self::spawn_supervisor), say).
    pub async fn spawn_worker_at(
        &mut self,
        worker_id: &str,
        profiles: &Path,
        capacity: u32,
        supervisor_endpoint: &str,
    ) {
        assert_eq!(
            self.mode,
            Mode::Processes,
            "worker processes exist in Processes mode only"
        );
        let data = self.dir.path().join("data");
        let mut env: Vec<(String, String)> = [
            ("CONVENE_DATA_DIR", data.display().to_string()),
            ("CONVENE_POLICY_ENDPOINT", self.policy_endpoint.clone()),
            ("CONVENE_EVIDENCE_ENDPOINT", self.evidence_endpoint.clone()),
            (
                "CONVENE_SUPERVISOR_ENDPOINT",
                supervisor_endpoint.to_owned(),
            ),
            ("CONVENE_WORKER_ID", worker_id.to_owned()),
            ("CONVENE_PROFILES_FILE", profiles.display().to_string()),
            (
                "CONVENE_TOOLS_DATA_DIR",
                example_data().display().to_string(),
            ),
            ("CONVENE_CAPACITY", capacity.to_string()),
            ("RUST_LOG", "warn".to_owned()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v))
        .collect();
        env.extend(self.env.iter().cloned());
        let recipe = Recipe {
            args: vec!["serve".into(), "worker".into()],
            port: free_port(),
            // Workers keep no state; their configuration refuses the key.
            remove: vec!["CONVENE_DATABASE_URL".into()],
            env,
            extra: Vec::new(),
        };
        self.spawn(worker_id, recipe).await;
    }

    /// Starts another supervisor replica (Processes mode) named `name`, on a port of its
    /// own, with the settings of the mesh's supervisor (the same database, policy,
    /// evidence store and approval service) and `extra` as its own extra environment
    /// (e.g. a `CONVENE_REPLICA_ID` of its own) instead of
    /// [`MeshOptions::supervisor_env`]. Returns its endpoint. Workers register with one
    /// supervisor: give it some with [`spawn_worker_at`](Self::spawn_worker_at).
    pub async fn spawn_supervisor(&mut self, name: &str, extra: Vec<(String, String)>) -> String {
        let mut recipe = self
            .children
            .iter()
            .find(|p| p.name == "supervisor")
            .map(|p| p.recipe.clone())
            .expect("the mesh's supervisor process (Processes mode)");
        recipe.port = free_port();
        recipe.extra = extra;
        let endpoint = format!("http://127.0.0.1:{}", recipe.port);
        self.spawn(name, recipe).await;
        endpoint
    }

    /// Starts the named process again (Processes mode) with the same command line, port
    /// and settings, except that `extra` replaces its own extra environment (for the
    /// supervisor, [`MeshOptions::supervisor_env`]). A process still running is killed
    /// first (SIGKILL). Returns whether it came up serving: false when it exited first,
    /// e.g. at a crash point it reached while resuming runs (then it can be restarted
    /// again).
    pub async fn restart(&mut self, name: &str, extra: Vec<(String, String)>) -> bool {
        let index = self
            .children
            .iter()
            .position(|p| p.name == name)
            .unwrap_or_else(|| panic!("no process named {name}"));
        let mut old = self.children.remove(index);
        if !matches!(old.child.try_wait(), Ok(Some(_))) {
            let _ = old.child.kill().await;
        }
        let mut recipe = old.recipe;
        recipe.extra = extra;
        self.launch(name, recipe).await
    }

    /// Waits, at most `limit`, for the named process to exit; returns whether it did.
    pub async fn wait_exited(&mut self, name: &str, limit: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            if self.exited(name) {
                return true;
            }
            if tokio::time::Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Writes a profiles file into the mesh's directory and returns its path.
    pub fn write_profiles(&self, name: &str, text: &str) -> PathBuf {
        let path = self.dir.path().join(format!("{name}.yaml"));
        std::fs::write(&path, text).expect("profiles file written");
        path
    }

    /// Kills a service or worker process by name (Processes mode): SIGKILL, no drain.
    pub async fn kill(&mut self, name: &str) {
        let p = self
            .children
            .iter_mut()
            .find(|p| p.name == name)
            .unwrap_or_else(|| panic!("no process named {name}"));
        p.child.kill().await.expect("the process is killed");
    }

    /// Stops the mesh gracefully and waits for it: in Processes mode every process gets
    /// SIGTERM (workers first, then the supervisor, then the services it calls), so each
    /// drains and flushes what it buffered (trace spans) before exiting; one that has
    /// not exited after `grace` is killed. (Dropping a mesh kills at once.)
    pub async fn stop(mut self, grace: Duration) {
        if let Some((shutdown, mesh)) = self.in_process.take() {
            shutdown.trigger();
            let _ = tokio::time::timeout(grace, mesh.stopped()).await;
        }
        let order = |name: &str| match name {
            n if n.starts_with("supervisor") => 1,
            "policy" | "evidence-store" | "approval" => 2,
            _ => 0,
        };
        let mut children = std::mem::take(&mut self.children);
        children.sort_by_key(|p| order(&p.name));
        for Proc { name, child, .. } in &mut children {
            let pid = child
                .id()
                .and_then(|id| rustix::process::Pid::from_raw(i32::try_from(id).ok()?));
            let Some(pid) = pid else { continue };
            if rustix::process::kill_process(pid, rustix::process::Signal::TERM).is_err() {
                continue;
            }
            if tokio::time::timeout(grace, child.wait()).await.is_err() {
                eprintln!("{name} did not stop within {grace:?} of SIGTERM; killing it");
                let _ = child.kill().await;
            }
        }
    }

    /// Sends `signal` to the named process (Processes mode), e.g. SIGSTOP to freeze it
    /// as a stalled machine would, and SIGCONT to let it go on.
    pub fn signal(&mut self, name: &str, signal: rustix::process::Signal) {
        let p = self
            .children
            .iter_mut()
            .find(|p| p.name == name)
            .unwrap_or_else(|| panic!("no process named {name}"));
        let pid = p
            .child
            .id()
            .and_then(|id| rustix::process::Pid::from_raw(i32::try_from(id).ok()?))
            .unwrap_or_else(|| panic!("{name} has exited"));
        rustix::process::kill_process(pid, signal)
            .unwrap_or_else(|e| panic!("cannot signal {name}: {e}"));
    }

    /// How the named process exited; None while it runs.
    pub fn exit_status(&mut self, name: &str) -> Option<std::process::ExitStatus> {
        self.children
            .iter_mut()
            .find(|p| p.name == name)
            .and_then(|p| p.child.try_wait().ok().flatten())
    }

    /// Whether the named process has exited.
    pub fn exited(&mut self, name: &str) -> bool {
        self.children
            .iter_mut()
            .find(|p| p.name == name)
            .is_some_and(|p| matches!(p.child.try_wait(), Ok(Some(_))))
    }

    /// The data directory.
    pub fn data_dir(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    /// The development credential of `principal`.
    pub fn credential(&self, principal: &str) -> String {
        dev_credential(&self.data_dir().join("credentials"), principal)
            .expect("the credential exists or is created")
    }

    /// The in-process supervisor (InProcess mode only).
    pub fn supervisor_service(&self) -> &convene_supervisor::SupervisorService {
        &self
            .in_process
            .as_ref()
            .expect("InProcess mode")
            .1
            .supervisor
    }

    /// A gRPC client of the supervisor.
    pub fn supervisor(&self) -> SupervisorHandle {
        Arc::new(GrpcSupervisor::connect(&self.supervisor_endpoint).expect("endpoint"))
    }

    /// A gRPC client of the supervisor replica at `endpoint` (see
    /// [`spawn_supervisor`](Self::spawn_supervisor)).
    pub fn supervisor_at(&self, endpoint: &str) -> SupervisorHandle {
        Arc::new(GrpcSupervisor::connect(endpoint).expect("endpoint"))
    }

    /// The database the mesh's services share, opened for a test to read what they
    /// stored (the SQLite file in the data directory unless
    /// [`database_url`](Self::database_url) names another).
    pub async fn open_database(&self) -> convene_store::Database {
        convene_store::open(self.database_url(), &self.data_dir())
            .await
            .expect("the mesh's database opens")
            .expect("the mesh keeps its state in a database")
    }

    /// A gRPC client of the approval service.
    pub fn approval(&self) -> GrpcApproval {
        GrpcApproval::connect(&self.approval_endpoint).expect("endpoint")
    }

    /// A gRPC client of the evidence store.
    pub fn evidence(&self) -> GrpcEvidenceStore {
        GrpcEvidenceStore::connect(&self.evidence_endpoint).expect("endpoint")
    }

    /// Starts a run as `principal`.
    pub async fn start_run(
        &self,
        principal: &str,
        spec: v1::RunSpec,
    ) -> Result<v1::StartRunResponse, tonic::Status> {
        self.supervisor()
            .start_run(request(
                v1::StartRunRequest {
                    spec: Some(spec),
                    wait: false,
                },
                &self.credential(principal),
            ))
            .await
            .map(tonic::Response::into_inner)
    }

    /// The run, as `principal` sees it.
    pub async fn get_run(&self, principal: &str, run_id: &str) -> v1::Run {
        self.supervisor()
            .get_run(request(
                v1::GetRunRequest {
                    run_id: run_id.to_owned(),
                },
                &self.credential(principal),
            ))
            .await
            .expect("GetRun")
            .into_inner()
            .run
            .expect("a run")
    }

    /// Waits until the run is terminal (at most `limit`) and returns it.
    pub async fn wait_terminal(&self, principal: &str, run_id: &str, limit: Duration) -> v1::Run {
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            let run = self.get_run(principal, run_id).await;
            if convene_supervisor::store::is_terminal(run.state) {
                return run;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "run {run_id} not terminal within {limit:?}: {run:#?}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Every event of a run, in order (after it ended).
    pub async fn run_events(&self, principal: &str, run_id: &str) -> Vec<v1::RunEvent> {
        use futures::StreamExt as _;
        let mut stream = self
            .supervisor()
            .watch_run(request(
                v1::WatchRunRequest {
                    run_id: run_id.to_owned(),
                    after_sequence: 0,
                },
                &self.credential(principal),
            ))
            .await
            .expect("WatchRun")
            .into_inner();
        let mut events = Vec::new();
        while let Some(e) = stream.next().await {
            events.push(e.expect("an event").event.expect("event set"));
        }
        events
    }
}
