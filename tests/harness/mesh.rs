//! The mesh itself: what a [`TestMesh`] holds, how it starts in either mode, its data
//! directory and its database, and how it is torn down when dropped.

use std::path::PathBuf;
use std::time::Duration;

use convene_mesh::policy_file::dev_credential;
use convene_server::Shutdown;
use tempfile::TempDir;

use super::processes::{Proc, SupervisorEnv};
use super::{DATABASE_ENV, MeshOptions, Mode, Workers, example_data, example_profiles};

/// Connections each service process of a mesh on PostgreSQL may open: a replica mesh
/// runs five such processes, and two meshes at once (the suite's default of two test
/// threads) must stay well within a stock server's `max_connections` of 100.
const MESH_POOL_SIZE: u32 = 6;

/// `url` with the pool size capped at [`MESH_POOL_SIZE`].
fn pool_capped(url: &str) -> String {
    let sep = if url.contains('?') { '&' } else { '?' };
    format!(
        "{url}{sep}{}={MESH_POOL_SIZE}",
        convene_store::POOL_SIZE_PARAM
    )
}

/// The database URL a mesh uses (None: the default SQLite file in its data directory)
/// and, for a PostgreSQL server, the fresh database created for it.
async fn mesh_database(
    asked: Option<String>,
) -> (
    Option<String>,
    Option<convene_store::test_util::TestPostgres>,
) {
    let chosen = asked.is_some();
    let url = asked.or_else(|| std::env::var(DATABASE_ENV).ok());
    match url.as_deref().map(str::trim) {
        None | Some("") => {
            // The suite runs on PostgreSQL in a second pass only when asked; say which
            // back end this test covered.
            if !chosen {
                eprintln!(
                    "note: {} runs its mesh on SQLite only; set {DATABASE_ENV} to a \
                     PostgreSQL server to run it there",
                    convene_store::test_util::current_test()
                );
            }
            (None, None)
        }
        Some(url) if url.starts_with("postgres://") || url.starts_with("postgresql://") => {
            let database = convene_store::test_util::TestPostgres::create(url)
                .await
                .unwrap_or_else(|e| panic!("{DATABASE_ENV}: cannot create a test database: {e}"));
            (Some(pool_capped(database.url())), Some(database))
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
    pub(crate) dir: TempDir,
    pub(crate) in_process: Option<(Shutdown, convene_cli::up::Mesh)>,
    pub(crate) children: Vec<Proc>,
    pub(crate) env: Vec<(String, String)>,
    pub(crate) database_url: Option<String>,
    /// A PostgreSQL database created for this mesh, dropped after it.
    pub(crate) _database: Option<convene_store::test_util::TestPostgres>,
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

    /// The data directory.
    pub fn data_dir(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    /// Writes a profiles file into the mesh's directory and returns its path.
    pub fn write_profiles(&self, name: &str, text: &str) -> PathBuf {
        let path = self.dir.path().join(format!("{name}.yaml"));
        std::fs::write(&path, text).expect("profiles file written");
        path
    }

    /// The development credential of `principal`.
    pub fn credential(&self, principal: &str) -> String {
        dev_credential(&self.data_dir().join("credentials"), principal)
            .expect("the credential exists or is created")
    }
}
