//! The A2A gateway of `convene up`, black-box, as another agent sees it: each scenario
//! of `cli/tests/a2a/acceptance.py` (the official Python A2A client, `a2a-sdk` 1.x) runs
//! against a fresh mesh over both bindings, JSON-RPC and HTTP+JSON, and the facts of
//! its JSON summary are checked here again, some against the supervisor's own view of
//! the run.
//!
//! The script needs a Python with the packages of `cli/tests/a2a/requirements.txt`
//! (`CONVENE_TEST_PYTHON`, else `.venv/bin/python` or `python3`); without one the tests
//! skip, and fail under `CONVENE_TEST_REQUIRE_SERVICES=1`.
//!
//! Where a scenario must see a task while its run is still going (polling, cancelling
//! a running task, subscribing to one), the mesh's workers hold every delegation until
//! a release file exists (the profiles' `hold`), and the script creates that file once
//! it has seen what it must see.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use convene_proto::v1;
use convene_store::test_util::{PYTHON_ENV, Service};
use convene_telemetry::test_util::{OtlpReceiver, ReceivedSpan};
use serde_json::{Value, json};

use crate::mesh::{LIMIT, Mesh, json};
use crate::support::repo_root;

/// The scenarios, relative to the repository's root.
const SCRIPT: &str = "cli/tests/a2a/acceptance.py";
/// The packages the script needs, relative to the repository's root.
const REQUIREMENTS: &str = "cli/tests/a2a/requirements.txt";
/// What the script imports.
const IMPORTS: &str = "import a2a.client, a2a.types.a2a_pb2, httpx";

const PYTHON_A2A: Service = Service {
    name: "a Python with the official A2A client (a2a-sdk 1.x)",
    variable: PYTHON_ENV,
};

/// The skill (run template) every scenario starts.
const SKILL: &str = "payment-incident-triage";

/// The transports of the gateway's two A2A bindings, as the script names them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Binding {
    JsonRpc,
    Rest,
}

impl Binding {
    fn name(self) -> &'static str {
        match self {
            Binding::JsonRpc => "jsonrpc",
            Binding::Rest => "rest",
        }
    }

    /// Where the binding is served, below the gateway's base URL.
    fn path(self) -> &'static str {
        match self {
            Binding::JsonRpc => "/a2a/jsonrpc",
            Binding::Rest => "/a2a/rest",
        }
    }
}

fn imports_a2a(python: &Path) -> bool {
    Command::new(python)
        .args(["-c", IMPORTS])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// The Python to run the script with: [`PYTHON_ENV`] if set (it must import the A2A
/// client), else the repository's `.venv/bin/python` or `python3` when they do; `None`
/// after reporting the skip.
fn python() -> Option<PathBuf> {
    let requirements = repo_root().join(REQUIREMENTS);
    if let Some(given) = std::env::var_os(PYTHON_ENV) {
        let given = PathBuf::from(given);
        assert!(
            imports_a2a(&given),
            "{PYTHON_ENV}={} cannot `{IMPORTS}`; install the packages with `{} -m pip \
             install -r {}`",
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
    .find(|p| imports_a2a(p));
    if found.is_none() {
        PYTHON_A2A.missing(&format!(
            "is not found (`python -m pip install -r {}`)",
            requirements.display()
        ));
    }
    found
}

/// A mesh whose workers hold every delegation until `release` exists.
struct Held {
    mesh: Mesh,
    release: PathBuf,
    /// Holds the profiles file and the release file.
    _dir: tempfile::TempDir,
}

impl Held {
    fn start() -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let release = dir.path().join("release");
        let quoted = serde_json::to_string(&release.display().to_string()).expect("a path");
        let text =
            std::fs::read_to_string(repo_root().join("examples/payment-incident/profiles.yaml"))
                .expect("the example profiles")
                .replace(
                    "    provider: playbook\n",
                    &format!("    provider: playbook\n    hold: {{ release: {quoted} }}\n"),
                );
        assert_eq!(
            text.matches("hold: ").count(),
            3,
            "each of the three specialists holds"
        );
        let profiles = dir.path().join("held-profiles.yaml");
        std::fs::write(&profiles, text).expect("profiles written");
        let mesh = Mesh::start_with(|cmd| {
            // Without the warning each held profile logs.
            cmd.arg("--profiles")
                .arg(&profiles)
                .env("RUST_LOG", "error");
        });
        Self {
            mesh,
            release,
            _dir: dir,
        }
    }

    fn run(&self, python: &Path, scenario_name: &str, binding: Binding) -> Value {
        let release = self.release.display().to_string();
        scenario(
            python,
            &self.mesh,
            scenario_name,
            binding,
            &["--release", &release],
        )
    }
}

/// Runs one scenario of the script against `mesh`'s gateway over `binding`; its
/// summary, once it exited 0.
fn scenario(python: &Path, mesh: &Mesh, name: &str, binding: Binding, extra: &[&str]) -> Value {
    let out = Command::new(python)
        .current_dir(repo_root())
        .arg(SCRIPT)
        .arg(name)
        .args(["--url", &mesh.a2a, "--binding", binding.name()])
        .arg("--credentials")
        .arg(mesh.data_dir().join("credentials"))
        .args(extra)
        .stdin(Stdio::null())
        .output()
        .expect("the script starts");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{SCRIPT} {name} --binding {} failed ({}):\n{stdout}\n{}",
        binding.name(),
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let summary = json(&stdout);
    assert_eq!(summary["scenario"], name, "{summary:#}");
    assert_eq!(summary["binding"], binding.name(), "{summary:#}");
    summary
}

fn text<'a>(value: &'a Value, key: &str) -> &'a str {
    value[key]
        .as_str()
        .unwrap_or_else(|| panic!("no text `{key}` in {value:#}"))
}

fn is_going(state: &Value) -> bool {
    state == "SUBMITTED" || state == "WORKING"
}

/// The run behind a task, as the supervisor has it, and the task's metadata checked
/// against it.
fn run_of(mesh: &Mesh, task: &Value) -> v1::Run {
    let run = mesh.get_run(text(task, "runId"));
    assert_eq!(task["skill"], SKILL, "{task:#}");
    assert_eq!(task["traceId"], run.trace_id.as_str(), "{task:#}");
    run
}

/// The payment incident's result artifacts, as a task that waits for people carries
/// them: the conflict on `primary_cause` and the pending R3 rollback.
fn assert_incident_artifacts(artifacts: &Value) {
    assert_eq!(
        artifacts["ids"],
        json!(["assessment", "decision"]),
        "{artifacts:#}"
    );
    assert_eq!(
        artifacts["outcome"], "CONFLICT_REQUIRES_HUMAN",
        "{artifacts:#}"
    );
    assert_eq!(artifacts["runState"], "WAITING_INPUT", "{artifacts:#}");
    assert_eq!(
        artifacts["conflicts"],
        json!(["primary_cause"]),
        "{artifacts:#}"
    );
    assert_eq!(
        artifacts["actions"],
        json!([{"action": "rule:rollback", "risk": "RISK_LEVEL_R3", "state": "ACTION_STATE_PENDING"}]),
        "{artifacts:#}"
    );
    let topics = &artifacts["claimTopics"];
    for topic in ["primary_cause", "impact.success_rate"] {
        assert!(
            topics
                .as_array()
                .is_some_and(|t| t.iter().any(|t| t == topic)),
            "{topic} missing in {artifacts:#}"
        );
    }
    let assessment = text(artifacts, "assessment");
    for needle in [
        "Outcome: CONFLICT_REQUIRES_HUMAN",
        "primary_cause (open): connection_pool_exhaustion",
        "rule:rollback (R3",
    ] {
        assert!(
            assessment.contains(needle),
            "{needle:?} missing in:\n{assessment}"
        );
    }
}

/// A task in INPUT_REQUIRED, and its run waiting for people with the conflict open.
fn assert_waits_for_people(mesh: &Mesh, task: &Value) {
    assert_eq!(task["state"], "INPUT_REQUIRED", "{task:#}");
    assert_eq!(task["runState"], "WAITING_INPUT", "{task:#}");
    let status = text(task, "statusText");
    for needle in [
        "Open conflicts: primary_cause",
        "Approvals pending: rule:rollback",
    ] {
        assert!(status.contains(needle), "{needle:?} missing in {status:?}");
    }
    let run = run_of(mesh, task);
    assert_eq!(run.state, v1::RunState::WaitingInput as i32, "{run:#?}");
    assert!(
        run.decision
            .iter()
            .flat_map(|d| &d.conflicts)
            .any(|c| c.topic == "primary_cause" && c.settlement.is_none()),
        "{run:#?}"
    );
}

fn card(binding: Binding) {
    let Some(python) = python() else { return };
    let mesh = Mesh::start();
    let card = scenario(&python, &mesh, "card", binding, &[]);
    assert_eq!(card["name"], "convene", "{card:#}");
    assert_eq!(
        card["interfaces"],
        json!([
            {"url": format!("{}/a2a/jsonrpc", mesh.a2a), "binding": "JSONRPC", "version": "1.0"},
            {"url": format!("{}/a2a/rest", mesh.a2a), "binding": "HTTP+JSON", "version": "1.0"},
        ]),
        "{card:#}"
    );
    assert_eq!(card["streaming"], true, "{card:#}");
    assert_eq!(
        card["skills"],
        json!({SKILL: ["incident", "read-only"]}),
        "{card:#}"
    );
    assert_eq!(
        card["securitySchemes"],
        json!({"bearer": "bearer"}),
        "{card:#}"
    );
    // Cacheable: a max-age and an entity tag.
    assert!(text(&card, "cacheControl").contains("max-age="), "{card:#}");
    let etag = text(&card, "etag");
    assert!(
        etag.len() > 2 && etag.starts_with('"') && etag.ends_with('"'),
        "{card:#}"
    );
    // The official client picked the binding it was asked for from the card.
    assert_eq!(
        card["clientUrl"],
        format!("{}{}", mesh.a2a, binding.path()),
        "{card:#}"
    );
}

fn send_then_poll(binding: Binding) {
    let Some(python) = python() else { return };
    let held = Held::start();
    let task = held.run(&python, "send-poll", binding);
    assert!(is_going(&task["firstState"]), "{task:#}");
    let seen = task["statesSeen"].as_array().expect("statesSeen");
    // The first GetTask saw the run held, going; the last one waiting for people.
    assert!(is_going(&seen[0]), "{task:#}");
    assert_eq!(seen.last(), Some(&json!("INPUT_REQUIRED")), "{task:#}");
    assert_incident_artifacts(&task["artifacts"]);
    assert_waits_for_people(&held.mesh, &task);
}

fn blocking(binding: Binding) {
    let Some(python) = python() else { return };
    let mesh = Mesh::start();
    let task = scenario(&python, &mesh, "blocking", binding, &[]);
    assert_incident_artifacts(&task["artifacts"]);
    assert_eq!(task["state"], "INPUT_REQUIRED", "{task:#}");
    assert_eq!(task["getTaskState"], "INPUT_REQUIRED", "{task:#}");
    // Cancelled while it waited for people.
    assert_eq!(task["cancelledState"], "CANCELED", "{task:#}");
    assert_eq!(task["afterCancelState"], "CANCELED", "{task:#}");
    let run = run_of(&mesh, &task);
    assert_eq!(run.state, v1::RunState::Cancelled as i32, "{run:#?}");
}

fn unauthenticated(binding: Binding) {
    let Some(python) = python() else { return };
    let mesh = Mesh::start();
    let summary = scenario(&python, &mesh, "unauthenticated", binding, &[]);
    let calls = summary["calls"].as_array().expect("calls");
    let expected = |case: &str| -> (u64, &str) {
        match case {
            "missing" => (401, "Bearer realm=\"convene\""),
            "wrong" => (401, "Bearer realm=\"convene\", error=\"invalid_token\""),
            _ => (
                403,
                "Bearer realm=\"convene\", error=\"insufficient_scope\"",
            ),
        }
    };
    for call in calls {
        let (status, challenge) = expected(text(call, "case"));
        assert_eq!(call["status"], status, "{call:#}");
        assert_eq!(call["wwwAuthenticate"], challenge, "{call:#}");
    }
    let cases = |case: &str| calls.iter().filter(|c| c["case"] == case).count();
    assert_eq!(
        [
            cases("missing"),
            cases("wrong"),
            cases("worker-pool"),
            cases("alice@acme")
        ],
        [4, 4, 4, 2],
        "{summary:#}"
    );
    assert_eq!(summary["readerListTasks"], 200, "{summary:#}");
}

fn cancel_running(binding: Binding) {
    let Some(python) = python() else { return };
    let held = Held::start();
    let task = held.run(&python, "cancel-running", binding);
    assert!(is_going(&task["startedState"]), "{task:#}");
    assert_eq!(task["cancelledState"], "CANCELED", "{task:#}");
    assert_eq!(task["state"], "CANCELED", "{task:#}");
    assert!(
        text(&task, "statusText").contains("cancelled over A2A by oncall@acme"),
        "{task:#}"
    );
    // Cancelled while its delegations were held: it never decided.
    let run = run_of(&held.mesh, &task);
    assert_eq!(run.state, v1::RunState::Cancelled as i32, "{run:#?}");
    assert!(run.decision.is_none(), "{run:#?}");
}

fn cancel_ended(binding: Binding) {
    let Some(python) = python() else { return };
    let mesh = Mesh::start();
    let task = scenario(&python, &mesh, "cancel-ended", binding, &[]);
    assert_eq!(task["cancelledState"], "CANCELED", "{task:#}");
    assert_eq!(task["secondCancel"], "TaskNotCancelable", "{task:#}");
    assert!(
        text(&task, "secondCancelMessage").contains(text(&task, "taskId")),
        "{task:#}"
    );
    assert_eq!(task["state"], "CANCELED", "{task:#}");
    let run = run_of(&mesh, &task);
    assert_eq!(run.state, v1::RunState::Cancelled as i32, "{run:#?}");
}

fn not_found(binding: Binding) {
    let Some(python) = python() else { return };
    let mesh = Mesh::start();
    let summary = scenario(&python, &mesh, "not-found", binding, &[]);
    let task_id = text(&summary, "taskId");
    let errors = &summary["errors"];
    for key in ["getOthers", "cancelOthers", "subscribeOthers"] {
        let message = text(errors, key);
        assert!(message.contains(task_id), "{key}: {summary:#}");
    }
    for key in ["getUnknown", "cancelUnknown"] {
        assert!(
            text(errors, key).contains("not found"),
            "{key}: {summary:#}"
        );
    }
    assert_eq!(summary["analystListed"], json!([]), "{summary:#}");
    assert!(
        summary["oncallListed"]
            .as_array()
            .is_some_and(|l| l.iter().any(|t| t == task_id)),
        "{summary:#}"
    );
    assert_ne!(summary["stateAfterOthersCancel"], "CANCELED", "{summary:#}");
}

/// The events of a stream that followed a task until it waited for people.
fn assert_followed_to_input_required(stream: &Value) {
    let events = stream["events"].as_array().expect("events");
    let task_id = text(stream, "taskId");
    assert!(events.iter().all(|e| e["taskId"] == task_id), "{stream:#}");
    assert_eq!(events[0]["kind"], "task", "{stream:#}");
    assert!(is_going(&events[0]["state"]), "{stream:#}");
    let n = events.len();
    assert!(n >= 4, "{stream:#}");
    assert_eq!(
        events[n - 3..],
        [
            json!({"kind": "artifact_update", "artifactId": "assessment", "taskId": task_id}),
            json!({"kind": "artifact_update", "artifactId": "decision", "taskId": task_id}),
            json!({"kind": "status_update", "state": "INPUT_REQUIRED", "taskId": task_id}),
        ],
        "{stream:#}"
    );
    assert!(
        events[1..n - 3]
            .iter()
            .all(|e| e["kind"] == "status_update" && is_going(&e["state"])),
        "{stream:#}"
    );
}

fn stream(binding: Binding) {
    let Some(python) = python() else { return };
    let held = Held::start();
    let summary = held.run(&python, "stream", binding);
    assert_followed_to_input_required(&summary["subscribe"]);
    let stopped = summary["subscribeStopped"]
        .as_array()
        .expect("subscribeStopped");
    assert_eq!(
        stopped.len(),
        1,
        "a stopped task streams its Task only: {summary:#}"
    );
    assert_eq!(stopped[0]["state"], "INPUT_REQUIRED", "{summary:#}");
    assert_followed_to_input_required(&summary["sendStreaming"]);
    let states = summary["finalStates"].as_object().expect("finalStates");
    assert_eq!(states.len(), 2, "{summary:#}");
    assert!(
        states.values().all(|s| s == "INPUT_REQUIRED"),
        "{summary:#}"
    );
}

fn tighten(binding: Binding) {
    let Some(python) = python() else { return };
    let mesh = Mesh::start();
    let summary = scenario(&python, &mesh, "tighten", binding, &[]);
    let errors = &summary["errors"];
    assert!(
        text(errors, "join").contains("spec.join.minimum.count: 1 is weaker than the template's 2"),
        "{summary:#}"
    );
    assert!(
        text(errors, "limits")
            .contains("spec.limits.max_tool_calls: 1000 is weaker than the template's 24"),
        "{summary:#}"
    );
    // Only the tightening message started a task.
    assert_eq!(summary["tasks"], 1, "{summary:#}");
    assert!(is_going(&summary["tighterState"]), "{summary:#}");
}

/// The caller's trace: its id and the span the gateway's span must be a child of.
const CALLER_TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const CALLER_SPAN: &str = "00f067aa0ba902b7";

fn traced(binding: Binding) {
    let Some(python) = python() else { return };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("a runtime");
    let receiver = runtime.block_on(OtlpReceiver::start());
    let mesh = Mesh::start_with(|cmd| {
        cmd.env_remove("OTEL_SDK_DISABLED")
            .env_remove("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
            .env("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint());
    });
    let traceparent = format!("00-{CALLER_TRACE}-{CALLER_SPAN}-01");
    let task = scenario(
        &python,
        &mesh,
        "traced",
        binding,
        &["--traceparent", &traceparent],
    );
    let run_id = text(&task, "runId").to_owned();
    let run_trace = text(&task, "traceId").to_owned();
    let gateway =
        |s: &ReceivedSpan| s.name == "SendMessage" && s.attr("convene.service") == Some("gateway");
    let run_span =
        |s: &ReceivedSpan| s.name == "run" && s.attr("convene.run.id") == Some(run_id.as_str());
    let spans = runtime.block_on(receiver.wait_for(LIMIT, |spans| {
        spans.iter().any(gateway) && spans.iter().any(run_span)
    }));
    let sent = spans
        .iter()
        .find(|s| gateway(s))
        .unwrap_or_else(|| panic!("no SendMessage span of the gateway in {spans:#?}"));
    // The caller's trace continues into the gateway's span.
    assert_eq!(sent.trace_id, CALLER_TRACE, "{sent:#?}");
    assert_eq!(sent.parent_span_id, CALLER_SPAN, "{sent:#?}");
    // The run is its own trace, the one the task names...
    let run = spans
        .iter()
        .find(|s| run_span(s))
        .unwrap_or_else(|| panic!("no run span of {run_id} in {spans:#?}"));
    assert_eq!(run.trace_id, run_trace, "{run:#?}");
    assert_ne!(run.trace_id, CALLER_TRACE, "{run:#?}");
    // ... and links to the gateway's span, in the caller's trace.
    assert!(
        run.links
            .contains(&(CALLER_TRACE.to_owned(), sent.span_id.clone())),
        "the run does not link to the gateway's span {}: {run:#?}",
        sent.span_id
    );
}

/// One test per binding for each scenario: `a2a::<scenario>::jsonrpc` and
/// `a2a::<scenario>::rest`.
macro_rules! over_both_bindings {
    ($($scenario:ident),+ $(,)?) => {$(
        mod $scenario {
            #[test]
            fn jsonrpc() {
                super::$scenario(super::Binding::JsonRpc);
            }

            #[test]
            fn rest() {
                super::$scenario(super::Binding::Rest);
            }
        }
    )+};
}

over_both_bindings!(
    card,
    send_then_poll,
    blocking,
    unauthenticated,
    cancel_running,
    cancel_ended,
    not_found,
    stream,
    tighten,
    traced,
);
