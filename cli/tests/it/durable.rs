//! The `convene` binary, black-box, for runs that outlive a command: `run --detach`
//! returns once the run is accepted, `events` prints the outbox as CloudEvents JSON and
//! resumes after an id, and a `convene up` killed with a run in flight finishes it when
//! it is started again on its data directory.
//!
//! `convene up` keeps its state in the SQLite file of its data directory, or, when
//! `CONVENE_TEST_DATABASE_URL` names a PostgreSQL server, in a fresh database there.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use convene_server::test_util::free_port;
use convene_store::test_util::TestPostgres;

use crate::support::{self, Up, repo_root, test_database, wait_for, wait_until};

/// Generous: the machine may be a loaded 2-core one.
const LIMIT: Duration = Duration::from_secs(90);

/// `convene`, keeping its state where the test says and publishing no events.
fn convene() -> Command {
    let mut cmd = support::convene();
    cmd.env_remove("CONVENE_DATABASE_URL")
        .env_remove("CONVENE_NATS_URL");
    cmd
}

impl Up {
    /// Starts `convene up` on `port` with its state in `dir` (and `database`), its one
    /// worker serving `profiles` (the example's when None), and waits until it listens.
    fn start(dir: &Path, port: u16, profiles: Option<&Path>, database: Option<&str>) -> Self {
        let mut cmd = convene();
        cmd.args([
            "up",
            "--workers",
            "1",
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--http-listen",
            "off",
        ])
        .arg("--data-dir")
        .arg(dir)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null());
        if let Some(profiles) = profiles {
            cmd.arg("--profiles").arg(profiles);
        }
        if let Some(url) = database {
            cmd.arg("--database-url").arg(url);
        }
        let mut up = Up(cmd.spawn().expect("convene up starts"));
        wait_until("convene up to listen", LIMIT, || {
            assert!(
                up.0.try_wait().expect("a status").is_none(),
                "convene up exited"
            );
            std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
                && dir.join("credentials/default-principal").exists()
        });
        up
    }

    /// SIGKILL: no drain, nothing flushed.
    fn kill(mut self) {
        self.0.kill().expect("convene up is killed");
        self.0.wait().expect("convene up is reaped");
    }
}

/// A client command against the mesh at `endpoint` with `dir`'s credentials.
fn client(dir: &Path, endpoint: &str, args: &[&str]) -> Output {
    convene()
        .args(args)
        .args(["--endpoint", endpoint])
        .arg("--data-dir")
        .arg(dir)
        .output()
        .expect("convene runs")
}

fn stdout_of(out: &Output) -> String {
    assert!(
        out.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout.clone()).expect("UTF-8 output")
}

fn run_json(dir: &Path, endpoint: &str, run_id: &str) -> serde_json::Value {
    let out = client(dir, endpoint, &["runs", "get", run_id, "--json"]);
    serde_json::from_str(&stdout_of(&out)).expect("the run as JSON")
}

/// The example spec with room for a restart: its delegations, join and run may take
/// minutes instead of seconds.
fn patient_spec(dir: &Path) -> PathBuf {
    let text = std::fs::read_to_string(repo_root().join("examples/payment-incident/run.yaml"))
        .expect("the example spec");
    assert_eq!(text.matches("timeout: 15s").count(), 3);
    assert_eq!(text.matches("timeout: 20s").count(), 1);
    assert_eq!(text.matches("timeout: 60s").count(), 1);
    let text = text
        .replace("timeout: 15s", "timeout: 240s")
        .replace("timeout: 20s", "timeout: 270s")
        .replace("timeout: 60s", "timeout: 300s");
    let path = dir.join("run.yaml");
    std::fs::write(&path, text).expect("spec written");
    path
}

/// The example profiles, every one of them holding its delegations until cancelled.
fn hanging_profiles(dir: &Path) -> PathBuf {
    let text = std::fs::read_to_string(repo_root().join("examples/payment-incident/profiles.yaml"))
        .expect("the example profiles")
        .replace(
            "    provider: playbook\n",
            "    provider: playbook\n    faults: { hang: true }\n",
        );
    assert_eq!(text.matches("hang: true").count(), 3);
    let path = dir.join("hanging-profiles.yaml");
    std::fs::write(&path, text).expect("profiles written");
    path
}

/// `convene events --json` and the given flags: one CloudEvent per line.
fn events(dir: &Path, endpoint: &str, flags: &[&str]) -> Vec<serde_json::Value> {
    let mut args = vec!["events", "--json"];
    args.extend_from_slice(flags);
    stdout_of(&client(dir, endpoint, &args))
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect()
}

#[test]
fn a_detached_run_survives_convene_up_being_killed_and_its_events_print_once() {
    let database = test_database();
    let home = tempfile::tempdir().expect("tempdir");
    let dir = home.path().join("data");
    let spec = patient_spec(home.path());
    let port = free_port();
    let endpoint = format!("http://127.0.0.1:{port}");

    // Workers that never answer on their own: the run cannot end while they serve it.
    let hanging = hanging_profiles(home.path());
    let up = Up::start(
        &dir,
        port,
        Some(&hanging),
        database.as_ref().map(TestPostgres::url),
    );
    let out = client(
        &dir,
        &endpoint,
        &[
            "run",
            spec.to_str().expect("UTF-8 path"),
            "--detach",
            "--json",
        ],
    );
    let text = stdout_of(&out);
    let printed: serde_json::Value = serde_json::from_str(text.trim()).expect("one JSON object");
    let run_id = printed["runId"].as_str().expect("runId").to_owned();
    assert_eq!(
        printed,
        serde_json::json!({ "runId": run_id }),
        "--detach --json prints the run id only"
    );
    // It returned with the run still going: every delegation is out with a worker.
    wait_for("every delegation to be dispatched", LIMIT, || {
        let run = run_json(&dir, &endpoint, &run_id);
        assert!(
            run["state"] == "RUN_STATE_PENDING" || run["state"] == "RUN_STATE_RUNNING",
            "{run:#}"
        );
        let delegations = run["delegations"].as_array().expect("delegations");
        if delegations.len() == 3
            && delegations
                .iter()
                .all(|d| d["state"] == "DELEGATION_STATE_DISPATCHED")
        {
            Ok(())
        } else {
            Err(run.to_string())
        }
    });

    // Killed with the run in flight, then started again on the same data directory with
    // workers that answer: the run is taken back and finishes.
    up.kill();
    let _up = Up::start(&dir, port, None, database.as_ref().map(TestPostgres::url));
    let run = wait_for("the run to finish", LIMIT, || {
        let run = run_json(&dir, &endpoint, &run_id);
        if run["state"] != "RUN_STATE_RUNNING" && run["state"] != "RUN_STATE_PENDING" {
            Ok(run)
        } else {
            Err(run.to_string())
        }
    });
    assert_eq!(run["state"], "RUN_STATE_WAITING_INPUT", "{run:#}");
    assert_eq!(run["outcome"], "JOIN_OUTCOME_CONFLICT_REQUIRES_HUMAN");
    assert_eq!(
        run["decision"]["accepted"].as_array().map(Vec::len),
        Some(3),
        "{run:#}"
    );
    // The restarted replica claimed the run: a new lease epoch, and the claim on record.
    let number = |v: &serde_json::Value| v.to_string().trim_matches('"').to_owned();
    let owner = run["owner"].as_str().unwrap_or_default();
    assert!(!owner.is_empty(), "{run:#}");
    assert_eq!(number(&run["leaseEpoch"]), "2", "{run:#}");
    let claims = run["claims"].as_array().expect("the run's claims");
    assert_eq!(claims.len(), 1, "{run:#}");
    assert_eq!(claims[0]["replica"], owner, "{run:#}");
    assert_eq!(number(&claims[0]["epoch"]), "2", "{run:#}");
    let shown = stdout_of(&client(&dir, &endpoint, &["runs", "get", &run_id]));
    assert!(
        shown.contains(&format!("Replica: {owner} (lease epoch 2)"))
            && shown.contains(&format!("claimed by {owner}")),
        "{shown}"
    );

    // The outbox as CloudEvents JSON lines: one event per transition, across the kill
    // (the approval service's event joins it as the supervisor follows that service).
    let all = wait_for("the approval service's event in the outbox", LIMIT, || {
        let all = events(&dir, &endpoint, &[]);
        if all
            .iter()
            .any(|e| e["type"] == "dev.convene.approval.requested.v1")
        {
            Ok(all)
        } else {
            Err(format!("{all:#?}"))
        }
    });
    for e in &all {
        assert_eq!(e["specversion"], "1.0", "{e}");
        assert_eq!(e["correlationid"], run_id.as_str(), "{e}");
        assert_eq!(e["tenantid"], "acme-payments", "{e}");
        assert!(e["subject"].as_str().is_some_and(
            |s| s.starts_with(&format!("runs/{run_id}")) || s.starts_with("approvals/")
        ));
        assert!(e["time"].as_str().is_some_and(|t| t.ends_with('Z')), "{e}");
        assert!(e["data"].is_object(), "{e}");
        assert!(e["id"].as_str().is_some_and(|id| !id.is_empty()), "{e}");
    }
    let mut types: BTreeMap<String, usize> = BTreeMap::new();
    for e in &all {
        *types
            .entry(e["type"].as_str().expect("type").to_owned())
            .or_insert(0) += 1;
    }
    assert_eq!(
        types,
        [
            ("dev.convene.approval.requested.v1", 1),
            ("dev.convene.delegation.completed.v1", 3),
            ("dev.convene.join.decided.v1", 1),
            ("dev.convene.run.started.v1", 1),
            ("dev.convene.run.waiting.v1", 1),
        ]
        .into_iter()
        .map(|(t, n)| (t.to_owned(), n))
        .collect(),
        "{all:#?}"
    );
    assert_eq!(all[0]["type"], "dev.convene.run.started.v1");

    // --after resumes right after the id given: the rest, nothing twice.
    for k in [0, 2, all.len() - 1] {
        let after = all[k]["id"].as_str().expect("id");
        assert_eq!(
            events(&dir, &endpoint, &["--after", after]),
            all[k + 1..],
            "after event {k}"
        );
    }
    // Filters by run and by (short) type.
    let completed = events(
        &dir,
        &endpoint,
        &["--run", &run_id, "--type", "run.waiting"],
    );
    assert_eq!(completed.len(), 1, "{completed:#?}");
    assert_eq!(completed[0]["data"]["state"], "RUN_STATE_WAITING_INPUT");
}
