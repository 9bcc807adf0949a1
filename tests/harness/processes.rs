//! Processes mode: every service and worker as its own `convene serve` process, started,
//! restarted, signalled, killed and stopped by name.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use convene_server::test_util::free_port;
use tempfile::TempDir;
use tokio::process::{Child, Command};

use super::{Mode, TestMesh, Workers, convene_bin, example_data};

/// The supervisor process's own environment: settings it keeps across restarts, and
/// the extra that [`TestMesh::restart`] replaces.
pub(crate) struct SupervisorEnv {
    pub(crate) settings: Vec<(String, String)>,
    pub(crate) extra: Vec<(String, String)>,
}

/// How one process of a mesh is started (Processes mode), kept so that it can be
/// started again ([`TestMesh::restart`]) or copied ([`TestMesh::spawn_supervisor`]).
#[derive(Debug, Clone)]
pub(crate) struct Recipe {
    /// `convene` arguments, e.g. `serve supervisor`.
    args: Vec<String>,
    /// The port it listens on (`CONVENE_SERVER__LISTEN`).
    port: u16,
    /// A supervisor's internal listener's port (`CONVENE_INTERNAL_LISTEN`), where
    /// workers register.
    internal_port: Option<u16>,
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
        cmd.env("CONVENE_SERVER__LISTEN", format!("127.0.0.1:{}", self.port));
        if let Some(port) = self.internal_port {
            cmd.env("CONVENE_INTERNAL_LISTEN", format!("127.0.0.1:{port}"));
        }
        cmd.envs(self.env.iter().map(|(k, v)| (k, v)))
            .envs(self.extra.iter().map(|(k, v)| (k, v)))
            .stdin(std::process::Stdio::null())
            .kill_on_drop(true);
        cmd
    }
}

/// A process of the mesh.
pub(crate) struct Proc {
    pub(crate) name: String,
    pub(crate) child: Child,
    pub(crate) recipe: Recipe,
}

impl TestMesh {
    pub(crate) async fn start_processes(
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
                internal_port: None,
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
        r.internal_port = Some(free_port());
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
        self.spawn_worker_with(worker_id, profiles, capacity, &[supervisor_endpoint])
            .await;
    }

    /// Starts one more worker process (Processes mode) registered as `worker_id` with
    /// every supervisor replica in `supervisors` (client endpoints: the worker registers
    /// at each one's internal listener); the first is also the one its `delegate@1`
    /// calls reach.
    pub async fn spawn_worker_with(
        &mut self,
        worker_id: &str,
        profiles: &Path,
        capacity: u32,
        supervisors: &[&str],
    ) {
        let supervisor_endpoint: &str = supervisors.first().copied().expect("a supervisor");
        assert_eq!(
            self.mode,
            Mode::Processes,
            "worker processes exist in Processes mode only"
        );
        let data = self.dir.path().join("data");
        let registries: Vec<String> = supervisors
            .iter()
            .map(|s| self.registry_endpoint(s))
            .collect();
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
            (
                "CONVENE_REGISTRY_ENDPOINTS",
                format!("[{}]", registries.join(",")),
            ),
            ("RUST_LOG", "warn".to_owned()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v))
        .collect();
        env.extend(self.env.iter().cloned());
        let recipe = Recipe {
            args: vec!["serve".into(), "worker".into()],
            port: free_port(),
            internal_port: None,
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
        recipe.internal_port = Some(free_port());
        recipe.extra = extra;
        let endpoint = format!("http://127.0.0.1:{}", recipe.port);
        self.spawn(name, recipe).await;
        endpoint
    }

    /// Starts another approval service replica (Processes mode) named `name`, on a port of
    /// its own, with the settings of the mesh's approval service (the same database and
    /// policy). Returns its endpoint; [`TestMesh::restart`] restarts it by name.
    pub async fn spawn_approval(&mut self, name: &str) -> String {
        let mut recipe = self
            .children
            .iter()
            .find(|p| p.name == "approval")
            .map(|p| p.recipe.clone())
            .expect("the mesh's approval process (Processes mode)");
        recipe.port = free_port();
        let endpoint = format!("http://127.0.0.1:{}", recipe.port);
        self.spawn(name, recipe).await;
        endpoint
    }

    /// The worker registry (internal listener) of the supervisor process serving
    /// `supervisor_endpoint`.
    fn registry_endpoint(&self, supervisor_endpoint: &str) -> String {
        self.children
            .iter()
            .find(|p| format!("http://127.0.0.1:{}", p.recipe.port) == supervisor_endpoint)
            .and_then(|p| p.recipe.internal_port)
            .map(|port| format!("http://127.0.0.1:{port}"))
            .unwrap_or_else(|| panic!("no supervisor process serves {supervisor_endpoint}"))
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

    /// The named process's id (Processes mode); None once it has exited.
    pub fn pid(&self, name: &str) -> Option<u32> {
        self.children
            .iter()
            .find(|p| p.name == name)
            .and_then(|p| p.child.id())
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
}
