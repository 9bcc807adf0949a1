//! A `convene up` for the tests of people acting on runs (approvals, resolving and
//! cancelling waiting runs): the example policy, client commands as any of its
//! principals, and the payment incident run until it stops.
//!
//! State is kept in the SQLite file of the data directory, or, when
//! `CONVENE_TEST_DATABASE_URL` names a PostgreSQL server, in a fresh database there.

use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};
use std::time::Duration;

use convene_cli::client::Client;
use convene_proto::v1::{self, approval_server::Approval as _};
use convene_server::test_util::free_port;
use convene_store::test_util::TestPostgres;

use crate::support::{self, repo_root, test_database, wait_for, wait_until};

/// Generous: the machine may be a loaded 2-core one.
pub const LIMIT: Duration = Duration::from_secs(90);

/// The principal that starts runs and resolves them (`runs:resolve`); the default one.
pub const ONCALL: &str = "oncall@acme";
/// The approvers, who may not resolve runs.
pub const ALICE: &str = "alice@acme";
/// The second approver.
pub const BOB: &str = "bob@acme";

/// A running `convene up` with its data directory; stopped when dropped.
pub struct Mesh {
    up: Child,
    /// Holds the data directory and the specs.
    home: tempfile::TempDir,
    /// The gRPC endpoint.
    pub endpoint: String,
    /// The A2A gateway's base URL (its Agent Card is below it).
    pub a2a: String,
    _database: Option<TestPostgres>,
}

impl Drop for Mesh {
    fn drop(&mut self) {
        let _ = self.up.kill();
        let _ = self.up.wait();
    }
}

/// `convene`, keeping its state where the test says and publishing no events.
pub fn convene() -> Command {
    let mut cmd = support::convene();
    cmd.env_remove("CONVENE_DATABASE_URL")
        .env_remove("CONVENE_NATS_URL")
        .env_remove("CONVENE_APPROVAL_ENDPOINT");
    cmd
}

impl Mesh {
    /// Starts `convene up` on a free port and waits until it listens.
    pub fn start() -> Self {
        Self::start_with(|_| {})
    }

    /// The data directory `convene up` and the client commands share.
    pub fn data_dir(&self) -> PathBuf {
        self.home.path().join("data")
    }

    /// The arguments of a client command as `principal` against this mesh.
    pub fn client_args(&self, principal: &str, args: &[&str]) -> Vec<String> {
        let mut all: Vec<String> = args.iter().map(|a| (*a).to_owned()).collect();
        all.extend([
            "--endpoint".to_owned(),
            self.endpoint.clone(),
            "--as".to_owned(),
            principal.to_owned(),
            "--data-dir".to_owned(),
            self.data_dir().display().to_string(),
        ]);
        all
    }

    /// A client command as `principal` against this mesh, ready to run, reading
    /// nothing from its standard input.
    pub fn command(&self, principal: &str, args: &[&str]) -> Command {
        let mut cmd = convene();
        cmd.args(self.client_args(principal, args))
            .stdin(Stdio::null());
        cmd
    }

    /// Runs a client command as `principal`.
    pub fn run(&self, principal: &str, args: &[&str]) -> Output {
        self.command(principal, args)
            .output()
            .expect("convene runs")
    }

    /// Runs a client command as `principal` that must succeed; its standard output.
    pub fn ok(&self, principal: &str, args: &[&str]) -> String {
        stdout_of(&self.run(principal, args))
    }

    /// Runs a client command as `principal` that must fail; its standard error.
    pub fn refused(&self, principal: &str, args: &[&str]) -> String {
        let out = self.run(principal, args);
        assert!(
            !out.status.success(),
            "`convene {}` succeeded:\n{}",
            args.join(" "),
            String::from_utf8_lossy(&out.stdout)
        );
        String::from_utf8(out.stderr).expect("UTF-8")
    }

    /// The run as `convene runs get --json` shows it.
    pub fn run_json(&self, run_id: &str) -> serde_json::Value {
        json(&self.ok(ONCALL, &["runs", "get", run_id, "--json"]))
    }

    /// The payment-incident example under its own idempotency key `key`, as oncall@acme,
    /// written to a spec file; its path.
    pub fn example_spec(&self, key: &str) -> PathBuf {
        let text = std::fs::read_to_string(repo_root().join("examples/payment-incident/run.yaml"))
            .expect("the example spec");
        let old = "idempotency_key: incident-20260723-0202";
        assert!(text.contains(old), "the example spec names its key");
        let path = self.home.path().join(format!("{key}.yaml"));
        std::fs::write(&path, text.replace(old, &format!("idempotency_key: {key}")))
            .expect("spec written");
        path
    }

    /// Runs the payment-incident example (`convene run --json`) under idempotency key
    /// `key` until it stops, and waits until its rollback approval request is filed;
    /// the run as it stopped and the request's id.
    pub fn incident(&self, key: &str) -> (serde_json::Value, String) {
        let spec = self.example_spec(key);
        let run = json(&self.ok(
            ONCALL,
            &["run", spec.to_str().expect("UTF-8 path"), "--json"],
        ));
        let run_id = run["runId"].as_str().expect("runId").to_owned();
        let approval_id = wait_for("the rollback approval request", LIMIT, || {
            let listed = self.approvals(&run_id);
            listed
                .iter()
                .find(|a| a["action"] == "rule:rollback")
                .and_then(|a| a["approvalId"].as_str().map(str::to_owned))
                .ok_or(listed)
        });
        (run, approval_id)
    }

    /// The run's approval requests as `convene approvals list --run RUN --json` shows
    /// them.
    pub fn approvals(&self, run_id: &str) -> Vec<serde_json::Value> {
        let listed = json(&self.ok(ONCALL, &["approvals", "list", "--run", run_id, "--json"]));
        listed["approvals"].as_array().cloned().unwrap_or_default()
    }

    /// oncall@acme's client of this mesh, and a runtime to call it on.
    fn oncall_client(&self) -> (Client, tokio::runtime::Runtime) {
        let client = Client::resolve(
            self.endpoint.clone(),
            None,
            &self.data_dir(),
            Some(ONCALL),
            None,
        )
        .expect("oncall@acme's credential");
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a runtime");
        (client, runtime)
    }

    /// The approval request as the approval service's GetApproval returns it.
    pub fn get_approval(&self, approval_id: &str) -> v1::ApprovalRequest {
        let (client, runtime) = self.oncall_client();
        runtime
            .block_on(async {
                client
                    .approval()
                    .expect("an approval client")
                    .get_approval(client.request(v1::GetApprovalRequest {
                        approval_id: approval_id.to_owned(),
                    }))
                    .await
            })
            .expect("GetApproval")
            .into_inner()
            .approval
            .expect("an approval request")
    }

    /// The run as the supervisor's GetRun returns it, asked as oncall@acme.
    pub fn get_run(&self, run_id: &str) -> v1::Run {
        let (client, runtime) = self.oncall_client();
        runtime
            .block_on(async {
                client
                    .supervisor()
                    .expect("a supervisor client")
                    .get_run(client.request(v1::GetRunRequest {
                        run_id: run_id.to_owned(),
                    }))
                    .await
            })
            .expect("GetRun")
            .into_inner()
            .run
            .expect("a run")
    }
}

/// The standard output of a command that must have succeeded.
pub fn stdout_of(out: &Output) -> String {
    assert!(
        out.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout.clone()).expect("UTF-8 output")
}

/// `text` as JSON.
pub fn json(text: &str) -> serde_json::Value {
    serde_json::from_str(text).unwrap_or_else(|e| panic!("not JSON ({e}):\n{text}"))
}

impl Mesh {
    /// Starts `convene up` as [`Mesh::start`] does, with `configure` adding its own
    /// flags and environment to the command first.
    pub fn start_with(configure: impl FnOnce(&mut Command)) -> Self {
        let database = test_database();
        let home = tempfile::tempdir().expect("tempdir");
        let port = free_port();
        let a2a_port = free_port();
        let mut cmd = convene();
        cmd.args(["up", "--listen", &format!("127.0.0.1:{port}")])
            .args(["--http-listen", &format!("127.0.0.1:{a2a_port}")])
            .arg("--data-dir")
            .arg(home.path().join("data"))
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null());
        if let Some(db) = &database {
            cmd.arg("--database-url").arg(db.url());
        }
        configure(&mut cmd);
        let mut mesh = Self {
            up: cmd.spawn().expect("convene up starts"),
            home,
            endpoint: format!("http://127.0.0.1:{port}"),
            a2a: format!("http://127.0.0.1:{a2a_port}"),
            _database: database,
        };
        let dir = mesh.data_dir();
        wait_until("convene up to listen", LIMIT, || {
            assert!(
                mesh.up.try_wait().expect("a status").is_none(),
                "convene up exited"
            );
            std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
                && std::net::TcpStream::connect(("127.0.0.1", a2a_port)).is_ok()
                && dir.join("credentials/default-principal").exists()
        });
        mesh
    }
}
