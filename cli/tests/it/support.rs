//! What the black-box tests of the `convene` binary share: the command with a clean
//! environment, a fresh PostgreSQL database when the suite runs there, and waiting for
//! a condition that a `convene` process brings about.

use std::fmt::Debug;
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use convene_store::test_util::TestPostgres;

/// The variable that runs the tests' meshes on PostgreSQL: a server URL, on which each
/// test gets a fresh database.
const DATABASE_ENV: &str = "CONVENE_TEST_DATABASE_URL";

/// How long a wait sleeps between two checks: each check may run a `convene` command.
const POLL: Duration = Duration::from_millis(50);

/// The repository's root directory, where the README's commands run.
pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The `convene` binary, run from the repository's root, without the settings a
/// developer's shell may hold that would point it elsewhere.
pub fn convene() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_convene"));
    cmd.current_dir(repo_root())
        .env_remove("CONVENE_DATA_DIR")
        .env_remove("CONVENE_ENDPOINT")
        .env_remove("CONVENE_CREDENTIAL");
    cmd
}

/// The PostgreSQL server [`DATABASE_ENV`] names, if any.
pub fn database_server() -> Option<String> {
    std::env::var(DATABASE_ENV)
        .ok()
        .filter(|url| url.starts_with("postgres://") || url.starts_with("postgresql://"))
}

/// A fresh PostgreSQL database when [`DATABASE_ENV`] names a server; None (saying so):
/// the default SQLite file of the data directory.
pub fn test_database() -> Option<TestPostgres> {
    let Some(server) = database_server() else {
        eprintln!(
            "note: {} runs `convene` on SQLite only; set {DATABASE_ENV} to a PostgreSQL \
             server to run it there",
            convene_store::test_util::current_test()
        );
        return None;
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    Some(
        runtime
            .block_on(TestPostgres::create(&server))
            .unwrap_or_else(|e| panic!("{DATABASE_ENV}: no test database: {e}")),
    )
}

/// Waits until `check` holds, checking again every 50 ms.
///
/// # Panics
///
/// When it does not hold within `limit`, saying that `what` was awaited.
pub fn wait_until(what: &str, limit: Duration, mut check: impl FnMut() -> bool) {
    wait_for(what, limit, || if check() { Ok(()) } else { Err(NotYet) });
}

/// Waits until `check` gives a value and returns it, checking again every 50 ms; while
/// it cannot, `check` returns what it saw instead.
///
/// # Panics
///
/// When no value comes within `limit`, saying that `what` was awaited and what the last
/// check saw.
pub fn wait_for<T, S: Debug>(
    what: &str,
    limit: Duration,
    mut check: impl FnMut() -> Result<T, S>,
) -> T {
    let deadline = Instant::now() + limit;
    loop {
        match check() {
            Ok(value) => return value,
            Err(seen) => assert!(
                Instant::now() < deadline,
                "waited {limit:?} for {what}; last seen: {seen:#?}"
            ),
        }
        std::thread::sleep(POLL);
    }
}

/// What a condition that does not hold yet shows in a failure.
#[derive(Debug)]
struct NotYet;

/// A permission scope on `resource`.
pub fn scope(action: &str, resource: &str) -> convene_proto::v1::PermissionScope {
    convene_proto::v1::PermissionScope {
        action: action.into(),
        resource: resource.into(),
        data_scope: None,
    }
}

/// The example incident's logs investigation, for `profile` in run `run_id`, as
/// delegation `delegation_id`, due in a minute.
pub fn logs_task(
    delegation_id: &str,
    profile: &str,
    run_id: &str,
) -> convene_proto::v1::DelegationTask {
    let at = |text: &str| -> prost_types::Timestamp {
        humantime::parse_rfc3339(text)
            .expect("an RFC 3339 time")
            .into()
    };
    convene_proto::v1::DelegationTask {
        delegation_id: delegation_id.into(),
        run_id: run_id.into(),
        depth: 1,
        profile_id: profile.into(),
        goal: "Identify the main error patterns in payment logs and when they first occurred."
            .into(),
        acceptance_criteria: vec!["Cite read-only query evidence for every conclusion".into()],
        scope: Some(convene_proto::v1::TaskScope {
            resources: vec!["service/payment-api".into(), "service/risk-gateway".into()],
            time_range: Some(convene_proto::v1::TimeRange {
                start: Some(at("2026-07-23T01:45:00Z")),
                end: Some(at("2026-07-23T02:10:00Z")),
            }),
        }),
        allowed_tools: vec!["search_logs@1".into()],
        allowed_evidence_prefixes: vec!["logs://".into()],
        required_scopes: vec![scope("logs:read", "service/*")],
        deadline: Some((std::time::SystemTime::now() + Duration::from_secs(60)).into()),
        name: "logs".into(),
        ..convene_proto::v1::DelegationTask::default()
    }
}

/// A `convene up` (or any child process) killed when dropped, so a failing test leaves
/// nothing running.
pub struct Up(pub std::process::Child);

impl Drop for Up {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Up {
    /// `convene up` on `port`, its state in `dir`, with the variables `env` set and no
    /// HTTP listener; returns once it listens and has written the default principal's
    /// credential.
    pub fn listening(dir: &std::path::Path, port: u16, env: &[(&str, &str)]) -> Self {
        let up = Up(convene()
            .args(["up", "--listen", &format!("127.0.0.1:{port}")])
            .args(["--http-listen", "off"])
            .arg("--data-dir")
            .arg(dir)
            .env("RUST_LOG", "warn")
            .envs(env.iter().copied())
            .stdout(std::process::Stdio::null())
            .spawn()
            .expect("convene up starts"));
        wait_until("convene up to listen", Duration::from_secs(15), || {
            std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
                && dir.join("credentials/default-principal").exists()
        });
        up
    }
}
