//! The Python and Node clients of `clients/`, black-box against a real `convene up`: each
//! program starts the payment incident, follows it, settles its conflict, has the R3
//! rollback approved by two people and executed, and the mesh shows the run SUCCEEDED.
//!
//! The Python one needs an interpreter with the packages of
//! `clients/python/requirements.txt` (`CONVENE_TEST_PYTHON`, else `.venv/bin/python` or
//! `python3`); the test generates its stubs with `clients/generate.sh`. The Node one needs
//! `node` and `npm` on the PATH; the test runs `npm ci` when `clients/node/node_modules`
//! is missing. Without them the tests skip, and fail under
//! `CONVENE_TEST_REQUIRE_SERVICES=1`.

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use convene_proto::v1;
use convene_store::test_util::{PYTHON_ENV, REQUIRE_SERVICES_ENV, current_test, services_required};

use crate::mesh::{ALICE, BOB, Mesh, ONCALL};
use crate::support::repo_root;

/// What the Python client imports (grpcio, PyYAML) and its stub generator needs.
const PYTHON_IMPORTS: &str = "import grpc, grpc_tools, yaml";

/// Reports that the running test cannot run without `what`: a skip line, or, when
/// services are required, a panic saying how to provide it (`fix`).
pub(crate) fn unavailable(what: &str, fix: &str) {
    let test = current_test();
    assert!(
        !services_required(),
        "{test} needs {what}; {REQUIRE_SERVICES_ENV} is set, so it may not be skipped: {fix}"
    );
    // Past the harness's capture: a passing test's output is never shown.
    let _ = writeln!(
        std::io::stderr(),
        "skipped: {test} needs {what}; {fix} to run it"
    );
}

fn imports_grpc(python: &Path) -> bool {
    Command::new(python)
        .args(["-c", PYTHON_IMPORTS])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// The Python to run the client with: [`PYTHON_ENV`] if set (it must have the client's
/// packages), else the repository's `.venv/bin/python` or `python3` when they do; `None`
/// after reporting the skip.
fn python_with_grpc() -> Option<PathBuf> {
    let requirements = repo_root().join("clients/python/requirements.txt");
    if let Some(given) = std::env::var_os(PYTHON_ENV) {
        let given = PathBuf::from(given);
        assert!(
            imports_grpc(&given),
            "{PYTHON_ENV}={} cannot `{PYTHON_IMPORTS}`; install the client's packages with \
             `{} -m pip install -r {}`",
            given.display(),
            given.display(),
            requirements.display()
        );
        return Some(given);
    }
    let found = [
        repo_root().join(".venv/bin/python"),
        PathBuf::from("python3"),
    ]
    .into_iter()
    .find(|p| imports_grpc(p));
    if found.is_none() {
        unavailable(
            "a Python with grpcio, grpcio-tools and PyYAML",
            &format!(
                "set {PYTHON_ENV} to one (`python -m pip install -r {}`)",
                requirements.display()
            ),
        );
    }
    found
}

/// Whether `program --version` runs.
pub(crate) fn runs(program: &str) -> bool {
    Command::new(program)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Output of a helper command that must succeed.
pub(crate) fn succeeded(what: &str, out: std::io::Result<Output>) -> Output {
    let out = out.unwrap_or_else(|e| panic!("{what} does not start: {e}"));
    assert!(
        out.status.success(),
        "{what} failed ({}):\n{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// Runs a client program against `mesh` as its default principal, under its own
/// idempotency key; its standard output, once it exited 0.
fn run_client(mesh: &Mesh, program: &Path, script: &str, key: &str) -> String {
    let mut cmd = Command::new(program);
    cmd.current_dir(repo_root())
        .env_remove("CONVENE_ENDPOINT")
        .env_remove("CONVENE_DATA_DIR")
        .env_remove("CONVENE_CREDENTIAL")
        .arg(script)
        .arg("--endpoint")
        .arg(&mesh.endpoint)
        .arg("--data-dir")
        .arg(mesh.data_dir())
        .args(["--idempotency-key", key])
        .stdin(Stdio::null());
    let out = succeeded(&format!("{} {script}", program.display()), cmd.output());
    String::from_utf8(out.stdout).expect("UTF-8 output")
}

/// The id of the run the program said it started.
fn started_run_id(text: &str) -> String {
    text.lines()
        .find_map(|l| {
            l.strip_prefix("Run ")
                .and_then(|rest| rest.split_once(" accepted as "))
                .map(|(id, _)| id.to_owned())
        })
        .unwrap_or_else(|| panic!("no `Run <id> accepted` line in:\n{text}"))
}

/// What every client prints and what the mesh must show after it: the run followed
/// through its conflict and its R3 approval to SUCCEEDED, the rollback executed once
/// with the votes of two distinct people bound to its parameters hash.
fn assert_incident_succeeded(mesh: &Mesh, text: &str) {
    let dispatched = text
        .lines()
        .filter(|l| l.contains(" dispatched to "))
        .count();
    assert!(
        dispatched >= 3,
        "one line per dispatch expected in:\n{text}"
    );
    for needle in [
        "join       revision 1: JOIN_OUTCOME_CONFLICT_REQUIRES_HUMAN",
        "waiting    RUN_STATE_WAITING_INPUT",
        "Conflict on primary_cause: CONFLICT_RESOLUTION_UNRESOLVED",
        "logs says connection_pool_exhaustion",
        "changes says risk_rule_change",
        "Settling primary_cause: choosing changes",
        "as oncall@acme, under the run's current ticket",
        "ResumeRun: COMMAND_OUTCOME_",
        "waiting    RUN_STATE_WAITING_APPROVAL",
        "rule:rollback, RISK_LEVEL_R3, 2 approval(s) required",
        "approved as alice@acme: APPROVAL_STATE_PENDING (1 vote(s))",
        "approved as bob@acme: APPROVAL_STATE_APPROVED (2 vote(s))",
        "executed now by alice@acme",
        "ended      RUN_STATE_SUCCEEDED",
        "Final state: RUN_STATE_SUCCEEDED",
        "Action rule:rollback: ACTION_STATE_EXECUTED, approved by alice@acme, bob@acme; \
         executed by alice@acme",
    ] {
        assert!(text.contains(needle), "{needle:?} missing in:\n{text}");
    }

    let run = mesh.get_run(&started_run_id(text));
    assert_eq!(run.state, v1::RunState::Succeeded as i32, "{run:#?}");
    let settled = run
        .decision
        .as_ref()
        .and_then(|d| d.conflicts.iter().find(|c| c.topic == "primary_cause"))
        .unwrap_or_else(|| panic!("no conflict on primary_cause in {run:#?}"));
    assert_eq!(
        settled.resolution,
        v1::ConflictResolution::Settled as i32,
        "{settled:#?}"
    );
    assert_eq!(run.human_decisions.len(), 1, "{:#?}", run.human_decisions);
    assert_eq!(run.human_decisions[0].decided_by, ONCALL);
    assert_eq!(run.actions.len(), 1, "{:#?}", run.actions);
    let action = &run.actions[0];
    assert_eq!(action.action, "rule:rollback");
    assert_eq!(
        action.state,
        v1::ActionState::Executed as i32,
        "{action:#?}"
    );
    assert_eq!(action.decided_by, [ALICE, BOB], "{action:#?}");
    let execution = action.execution.as_ref().expect("an execution record");
    assert_eq!(execution.executed_by, ALICE);
    assert!(execution.success, "{execution:#?}");

    let request = mesh.get_approval(&action.approval_id);
    assert_eq!(request.state, v1::ApprovalState::Executed as i32);
    let mut approvers: Vec<&str> = request
        .votes
        .iter()
        .filter(|v| v.decision == v1::VoteDecision::Approve as i32)
        .map(|v| v.approver.as_str())
        .collect();
    approvers.sort_unstable();
    approvers.dedup();
    assert_eq!(approvers, [ALICE, BOB], "{request:#?}");
    assert!(
        request
            .votes
            .iter()
            .all(|v| v.parameters_hash == action.parameters_hash),
        "every vote binds the action's hash {}: {request:#?}",
        action.parameters_hash
    );
}

#[test]
fn the_python_client_runs_the_payment_incident_to_success() {
    let Some(python) = python_with_grpc() else {
        return;
    };
    succeeded(
        "clients/generate.sh",
        Command::new("bash")
            .arg(repo_root().join("clients/generate.sh"))
            .env(PYTHON_ENV, &python)
            .output(),
    );
    let mesh = Mesh::start();
    let text = run_client(
        &mesh,
        &python,
        "clients/python/payment_incident.py",
        "clients-python",
    );
    assert_incident_succeeded(&mesh, &text);
}

#[test]
fn the_node_client_runs_the_payment_incident_to_success() {
    if !(runs("node") && runs("npm")) {
        unavailable(
            "Node.js and npm",
            "install them (Node 18 or later) so that `node` and `npm` are on the PATH",
        );
        return;
    }
    let dir = repo_root().join("clients/node");
    if !dir.join("node_modules").is_dir() {
        succeeded(
            "npm ci in clients/node",
            Command::new("npm")
                .args(["ci", "--no-audit", "--no-fund"])
                .current_dir(&dir)
                .output(),
        );
    }
    let mesh = Mesh::start();
    let text = run_client(
        &mesh,
        Path::new("node"),
        "clients/node/payment_incident.js",
        "clients-node",
    );
    assert_incident_succeeded(&mesh, &text);
}
