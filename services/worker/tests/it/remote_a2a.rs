//! Profiles served by a remote A2A agent (`provider: a2a`) against the real policy
//! service and evidence store: the example agent (`examples/a2a/remote_agent.py`, the
//! official Python SDK) answers a delegation and its artifacts become verified evidence
//! with the run's trace context and the bearer credential sent but never recorded; a
//! remote that fails or answers nonsense ends the task FAILED with a clear error; a URL
//! the worker's `a2a` configuration does not allow is refused before any connection.
//!
//! The agent needs a Python that imports `a2a` (a2a-sdk 1.3) and `uvicorn`:
//! `CONVENE_TEST_PYTHON`, else `.venv/bin/python` or `python3` when they do. Without one
//! the tests that need it skip (and fail under `CONVENE_TEST_REQUIRE_SERVICES=1`).

use std::io::ErrorKind;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use convene_core::time::to_timestamp;
use convene_mesh::auth;
use convene_mesh::policy_file::{PolicyFile, ProfileEntry, ScopeEntry};
use convene_proto::v1;
use convene_store::test_util::{PYTHON_ENV, Service};
use convene_telemetry::test_util::Capture;
use convene_worker::a2a::Allowlist;
use convene_worker::models::ModelSettings;
use convene_worker::profiles::{self, ProviderRegistry};
use convene_worker::tools::ToolRegistry;
use convene_worker::{SetupError, WorkerOptions, WorkerService};
use serde_json::Value;
use tokio::io::AsyncBufReadExt as _;

use crate::support::{Mesh, RUN_ID, TestWorker, WINDOW_END, WINDOW_START, example_data, status};

const PROFILE: &str = "incident-history";
/// The bearer credential the agent requires.
const BEARER: &str = "a2a-bearer-7f3c9e21d4b86a05";
/// How long a test waits for the agent to start before it fails.
const PATIENCE: Duration = Duration::from_secs(60);

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The Python that runs the example agent, or `None` after reporting the skip.
fn python() -> Option<PathBuf> {
    let runs_agent = |python: &Path| {
        std::process::Command::new(python)
            .args(["-c", "import a2a.server.routes, uvicorn"])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    };
    if let Some(given) = std::env::var_os(PYTHON_ENV) {
        let given = PathBuf::from(given);
        assert!(
            runs_agent(&given),
            "{PYTHON_ENV}={} cannot import a2a-sdk and uvicorn; install them with `{} -m pip \
             install -r examples/a2a/requirements.txt`",
            given.display(),
            given.display()
        );
        return Some(given);
    }
    let found = [repo().join(".venv/bin/python"), PathBuf::from("python3")]
        .into_iter()
        .find(|p| runs_agent(p));
    if found.is_none() {
        Service {
            name: "a Python with a2a-sdk and uvicorn",
            variable: PYTHON_ENV,
        }
        .missing("is not found (no candidate imports a2a and uvicorn)");
    }
    found
}

/// The example agent, run by the test on a free loopback port; stopped when dropped.
struct Agent {
    _child: tokio::process::Child,
    url: String,
}

impl Agent {
    /// Starts the agent with `args`, requiring [`BEARER`], and waits until it listens.
    async fn start(python: &Path, args: &[&str]) -> Self {
        let mut child = tokio::process::Command::new(python)
            .arg(repo().join("examples/a2a/remote_agent.py"))
            .args(["--port", "0", "--token-env", "HISTORY_AGENT_TOKEN"])
            .args(args)
            .env("HISTORY_AGENT_TOKEN", BEARER)
            .stdout(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("the example agent starts");
        let mut lines = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
        let line = tokio::time::timeout(PATIENCE, lines.next_line())
            .await
            .expect("the agent announces its address in time")
            .unwrap()
            .expect("the agent prints `listening on <url>`");
        let url = line
            .strip_prefix("listening on ")
            .unwrap_or_else(|| panic!("unexpected first line {line:?}"))
            .to_owned();
        Self { _child: child, url }
    }

    fn port(&self) -> u16 {
        self.url.rsplit(':').next().unwrap().parse().unwrap()
    }
}

/// The example policy plus the `incident-history` profile: no tools, its evidence under
/// `a2a://`.
fn policy(dir: &Path) -> PathBuf {
    let text = std::fs::read_to_string(repo().join("examples/payment-incident/policy.yaml"))
        .expect("the example policy exists");
    let mut file = PolicyFile::parse(&text, Some("yaml"), "example policy").unwrap();
    file.profiles.push(ProfileEntry {
        id: PROFILE.to_owned(),
        capabilities: vec![ScopeEntry {
            action: "evidence:*".to_owned(),
            resource: "evidence".to_owned(),
            time_range: None,
            max_rows: None,
        }],
        tools: Vec::new(),
        evidence_prefixes: vec!["a2a://".to_owned()],
        investigating: true,
    });
    let path = dir.join("policy.yaml");
    std::fs::write(&path, serde_yaml::to_string(&file).unwrap()).unwrap();
    path
}

async fn mesh() -> (Mesh, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let mesh = Mesh::start_with_policy(Some(policy(dir.path()))).await;
    (mesh, dir)
}

/// The `incident-history` profile served by the agent at `url`, its credential in
/// `credential` (if any).
fn profile(url: &str, credential: Option<&Path>) -> Vec<profiles::Profile> {
    let credential = credential.map_or_else(String::new, |p| {
        format!("    credential_file: {}\n", p.display())
    });
    profiles::parse(
        &format!(
            r#"
profiles:
  - id: {PROFILE}
    version: "1.0.0"
    instructions: Find the past incident most like this one.
    provider: a2a
    url: {url}
{credential}    capabilities:
      - {{ action: "evidence:*", resource: "evidence" }}
    evidence_prefixes: ["a2a://"]
"#
        ),
        "a2a test profiles",
    )
    .unwrap()
}

/// A worker over `mesh` serving `profiles`, calling what `allow` and `allow_private` admit.
fn service(
    mesh: &Mesh,
    profiles: Vec<profiles::Profile>,
    allow: &[String],
    allow_private: &[&str],
) -> Result<WorkerService, SetupError> {
    let models = ModelSettings::default();
    let mut providers = ProviderRegistry::builtin(&models.client());
    let private: Vec<String> = allow_private.iter().map(|p| (*p).to_owned()).collect();
    providers.register_a2a(Arc::new(Allowlist::new(allow, &private).unwrap()));
    WorkerService::new(
        WorkerOptions {
            worker_id: "worker-a2a-1".into(),
            capacity: 4,
            exit_process_on_fault: false,
            models: Arc::new(models),
            key_refresh: convene_mesh::auth::DEFAULT_KEY_REFRESH,
        },
        profiles,
        &providers,
        ToolRegistry::builtin(example_data()),
        mesh.policy_handle(),
        mesh.evidence_handle(),
    )
}

fn time(s: &str) -> prost_types::Timestamp {
    to_timestamp(humantime::parse_rfc3339(s).unwrap())
}

/// A delegation for the `incident-history` profile.
fn history_task(delegation_id: &str) -> v1::DelegationTask {
    v1::DelegationTask {
        delegation_id: delegation_id.into(),
        run_id: RUN_ID.into(),
        depth: 1,
        profile_id: PROFILE.into(),
        goal: "Find the past incident most like the payment success-rate drop.".into(),
        acceptance_criteria: vec!["Name the incident and its cause".into()],
        scope: Some(v1::TaskScope {
            resources: vec!["service/payment-api".into()],
            time_range: Some(v1::TimeRange {
                start: Some(time(WINDOW_START)),
                end: Some(time(WINDOW_END)),
            }),
        }),
        allowed_evidence_prefixes: vec!["a2a://".into()],
        deadline: Some(to_timestamp(SystemTime::now() + Duration::from_secs(30))),
        name: "history".into(),
        ..v1::DelegationTask::default()
    }
}

async fn run(mesh: &Mesh, worker: &TestWorker, delegation_id: &str) -> (v1::TaskResult, String) {
    let task = history_task(delegation_id);
    let token = mesh.token_for(&task, &[]).await;
    let result = worker.execute(&task, &token, 1).await.unwrap();
    (result, token)
}

fn error_of(result: &v1::TaskResult) -> &v1::ErrorInfo {
    result
        .error
        .as_ref()
        .unwrap_or_else(|| panic!("the result says why it failed: {result:#?}"))
}

#[tokio::test]
async fn a_remote_agent_serves_the_delegation_and_its_artifacts_become_evidence() {
    let Some(python) = python() else { return };
    // Spans recorded in memory (this test's tasks all run on its thread), so the
    // `a2a.call` span has a trace context to send.
    let capture = Capture::new();
    let _spans = capture.set_default();
    let agent = Agent::start(&python, &[]).await;
    let (mesh, dir) = mesh().await;
    let credential = dir.path().join("history.token");
    std::fs::write(&credential, format!("{BEARER}\n")).unwrap();
    let worker = TestWorker::start(
        &mesh.supervisor,
        service(
            &mesh,
            profile(&agent.url, Some(&credential)),
            std::slice::from_ref(&agent.url),
            &["127.0.0.1"],
        )
        .unwrap(),
    )
    .await;

    let (result, token) = run(&mesh, &worker, "del-a2a-1").await;
    assert_eq!(status(&result), v1::TaskStatus::Completed, "{result:#?}");
    assert!(result.error.is_none());
    assert_eq!(
        result.summary,
        "Looked up the incident history of payment-api."
    );

    // Two artifacts, two evidence records under the agent's host, named by the run,
    // the delegation, the remote task and the artifact.
    let base = format!("a2a://127.0.0.1:{}/{RUN_ID}/del-a2a-1/", agent.port());
    assert_eq!(result.evidence.len(), 2, "{result:#?}");
    for e in &result.evidence {
        assert!(e.evidence_id.starts_with(&base), "{}", e.evidence_id);
        assert_eq!(e.kind, "a2a_artifact");
        assert_eq!(e.source, format!("a2a:{}/", agent.url));
        assert!(e.content_hash.starts_with("sha256:"));
        assert!(e.query_fingerprint.starts_with("sha256:"));
        assert!(
            e.tool_call_id.starts_with("del-a2a-1/a2a/"),
            "{}",
            e.tool_call_id
        );
        assert!(result.artifacts.contains(&e.artifact_uri));
    }

    // The text artifact is one claim; the data artifact's two claims are taken as the
    // agent wrote them. Every claim cites the artifact it came from, and verifies.
    let by_topic = |topic: &str| {
        result
            .claims
            .iter()
            .find(|c| c.topic == topic)
            .unwrap_or_else(|| panic!("no claim on {topic}: {:#?}", result.claims))
    };
    assert_eq!(result.claims.len(), 3, "{:#?}", result.claims);
    let assessment = by_topic("assessment");
    assert!(
        assessment.value.starts_with("On 2026-06-11"),
        "{assessment:?}"
    );
    assert_eq!(by_topic("prior_incident").value, "INC-20260611-0140");
    assert_eq!(by_topic("prior_incident").claim_id, "prior-incident");
    assert_eq!(by_topic("prior_cause").value, "connection_pool_exhaustion");
    assert!((by_topic("prior_cause").confidence - 0.6).abs() < 1e-9);
    assert_ne!(
        assessment.evidence_refs,
        by_topic("prior_cause").evidence_refs,
        "each claim cites its own artifact"
    );
    let chain = mesh
        .evidence_handle()
        .verify_chain(auth::request(
            v1::VerifyChainRequest {
                claims: result
                    .claims
                    .iter()
                    .map(|c| v1::ChainClaim {
                        claim_id: c.claim_id.clone(),
                        evidence_refs: c.evidence_refs.clone(),
                    })
                    .collect(),
                rehash_content: true,
            },
            &token,
        ))
        .await
        .unwrap()
        .into_inner();
    assert!(chain.intact, "{:#?}", chain.links);

    // The stored artifacts name the agent, the remote task and artifact, and hold what
    // the agent answered.
    let mut stored = Vec::new();
    for e in &result.evidence {
        let content = mesh
            .evidence_handle()
            .get_artifact(auth::request(
                v1::GetArtifactRequest {
                    uri: e.artifact_uri.clone(),
                },
                &token,
            ))
            .await
            .unwrap()
            .into_inner()
            .content;
        let text = String::from_utf8(content).unwrap();
        assert!(!text.contains(BEARER), "the credential was stored: {text}");
        let json: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(json["a2a"]["agent"], format!("{}/", agent.url));
        assert_eq!(json["a2a"]["binding"], "JSONRPC");
        let task_id = json["a2a"]["task_id"].as_str().unwrap();
        let artifact_id = json["artifact"]["artifactId"].as_str().unwrap();
        assert!(!task_id.is_empty());
        assert!(
            e.evidence_id
                .ends_with(&format!("/{task_id}/{artifact_id}")),
            "{} names task {task_id} and artifact {artifact_id}",
            e.evidence_id
        );
        stored.push(json);
    }
    let findings = stored
        .iter()
        .find(|j| j["artifact"]["name"] == "findings")
        .expect("the findings artifact is stored");
    let received = &findings["artifact"]["parts"][0]["data"]["received"];
    assert_eq!(
        received["delegation_id"], "del-a2a-1",
        "the inputs went as data"
    );
    assert_eq!(
        received["authorized"], true,
        "the bearer credential was sent"
    );

    // The agent got the `a2a.call` span's W3C context.
    let spans = capture.spans();
    let call = spans
        .iter()
        .find(|s| s.name == "a2a.call")
        .expect("an a2a.call span");
    let expected = format!(
        "00-{}-{}-01",
        call.span_context.trace_id(),
        call.span_context.span_id()
    );
    assert_eq!(received["traceparent"], expected.as_str());
    let state = call
        .attributes
        .iter()
        .find(|kv| kv.key.as_str() == "convene.a2a.state")
        .map(|kv| kv.value.to_string());
    assert_eq!(state.as_deref(), Some("COMPLETED"));

    // The credential appears in no result and no span.
    assert!(!format!("{result:?}").contains(BEARER));
    for s in &spans {
        assert!(!format!("{s:?}").contains(BEARER), "{s:#?}");
    }
}

#[tokio::test]
async fn a_remote_task_that_fails_or_is_rejected_fails_the_delegation() {
    let Some(python) = python() else { return };
    let (mesh, dir) = mesh().await;
    let credential = dir.path().join("history.token");
    std::fs::write(&credential, BEARER).unwrap();
    for (outcome, code, said) in [
        (
            "failed",
            "remote_failed",
            "the incident history is unavailable",
        ),
        (
            "rejected",
            "remote_rejected",
            "this agent does not take delegations now",
        ),
    ] {
        let agent = Agent::start(&python, &["--outcome", outcome]).await;
        let worker = TestWorker::start(
            &mesh.supervisor,
            service(
                &mesh,
                profile(&agent.url, Some(&credential)),
                std::slice::from_ref(&agent.url),
                &["127.0.0.1"],
            )
            .unwrap(),
        )
        .await;
        let (result, _) = run(&mesh, &worker, &format!("del-a2a-{outcome}")).await;
        assert_eq!(status(&result), v1::TaskStatus::Failed, "{result:#?}");
        let error = error_of(&result);
        assert_eq!(error.code, code);
        assert!(!error.retryable);
        assert!(error.message.contains(&agent.url), "{}", error.message);
        assert!(error.message.contains(said), "{}", error.message);
        assert!(result.claims.is_empty() && result.evidence.is_empty());
    }

    // Without the credential the agent refuses the call; the error says so, and the
    // worker does not invent a success.
    let agent = Agent::start(&python, &[]).await;
    let worker = TestWorker::start(
        &mesh.supervisor,
        service(
            &mesh,
            profile(&agent.url, None),
            std::slice::from_ref(&agent.url),
            &["127.0.0.1"],
        )
        .unwrap(),
    )
    .await;
    let (result, _) = run(&mesh, &worker, "del-a2a-unauthorized").await;
    assert_eq!(status(&result), v1::TaskStatus::Failed, "{result:#?}");
    assert_eq!(error_of(&result).code, "remote_protocol_error");
}

/// An HTTP server on loopback that answers every request with `card` (GET) or `rpc`
/// (POST), and its URL.
async fn nonsense_server(card: Value, rpc: Value) -> String {
    use axum::routing::get;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let card = card.to_string().replace("{URL}", &url);
    let app = axum::Router::new().route(
        "/.well-known/agent-card.json",
        get(move || async move { ([("content-type", "application/json")], card) }),
    );
    let app = app.route(
        "/",
        axum::routing::post(move || async move { axum::Json(rpc) }),
    );
    tokio::spawn(async move { axum::serve(listener, app).await });
    url
}

#[tokio::test]
async fn a_remote_that_answers_nonsense_fails_the_delegation() {
    let (mesh, _dir) = mesh().await;
    let card = serde_json::json!({
        "name": "Nonsense",
        "description": "Answers anything but A2A.",
        "version": "1",
        "supportedInterfaces": [
            { "url": "{URL}", "protocolBinding": "JSONRPC", "protocolVersion": "1.0" }
        ],
        "capabilities": {},
        "defaultInputModes": ["text/plain"],
        "defaultOutputModes": ["text/plain"],
        "skills": []
    });
    let cases = [
        (
            card.clone(),
            serde_json::json!({ "hello": "world" }),
            "did not get an A2A JSONRPC answer",
        ),
        (
            serde_json::json!({ "not": "a card" }),
            Value::Null,
            "is not an A2A agent card",
        ),
        (
            serde_json::json!({
                "name": "gRPC only", "description": "", "version": "1",
                "supportedInterfaces": [
                    { "url": "{URL}", "protocolBinding": "GRPC", "protocolVersion": "1.0" }
                ],
                "capabilities": {}
            }),
            Value::Null,
            "offers no JSONRPC or HTTP+JSON interface",
        ),
    ];
    for (i, (card, rpc, says)) in cases.into_iter().enumerate() {
        let url = nonsense_server(card, rpc).await;
        let worker = TestWorker::start(
            &mesh.supervisor,
            service(
                &mesh,
                profile(&url, None),
                std::slice::from_ref(&url),
                &["127.0.0.1"],
            )
            .unwrap(),
        )
        .await;
        let (result, _) = run(&mesh, &worker, &format!("del-a2a-nonsense-{i}")).await;
        assert_eq!(status(&result), v1::TaskStatus::Failed, "{result:#?}");
        let error = error_of(&result);
        assert_eq!(error.code, "remote_protocol_error", "{error:?}");
        assert!(error.message.contains(says), "{}", error.message);
        assert!(error.message.contains(&url), "{}", error.message);
    }
}

#[tokio::test]
async fn urls_the_configuration_does_not_allow_are_refused_before_any_connection() {
    let (mesh, _dir) = mesh().await;
    // The port a refused call would reach: the test owns it and checks nothing connected.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    let port = listener.local_addr().unwrap().port();
    let literal = format!("http://127.0.0.1:{port}");
    let named = format!("http://localhost:{port}");

    // Not on the allowlist: the worker does not start, and says how to allow it.
    let err = service(&mesh, profile(&literal, None), &[], &[])
        .unwrap_err()
        .to_string();
    assert!(err.contains(&literal), "{err}");
    assert!(err.contains("not on the worker's A2A allowlist"), "{err}");
    assert!(err.contains("a2a.allow"), "{err}");
    let elsewhere = ["https://agents.example.com".to_owned()];
    let err = service(&mesh, profile(&literal, None), &elsewhere, &[])
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("https://agents.example.com"),
        "lists the allowed: {err}"
    );

    // On the allowlist, but a loopback address that allow_private does not list.
    let err = service(
        &mesh,
        profile(&literal, None),
        std::slice::from_ref(&literal),
        &[],
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("loopback"), "{err}");
    assert!(err.contains("a2a.allow_private"), "{err}");
    let err = service(
        &mesh,
        profile(&literal, None),
        std::slice::from_ref(&literal),
        &["10.0.0.0/8"],
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("127.0.0.1"), "{err}");

    // A name that resolves to loopback: the worker starts, and the delegation is
    // refused once the name is resolved, before a connection.
    let worker = TestWorker::start(
        &mesh.supervisor,
        service(
            &mesh,
            profile(&named, None),
            std::slice::from_ref(&named),
            &[],
        )
        .unwrap(),
    )
    .await;
    let (result, _) = run(&mesh, &worker, "del-a2a-refused").await;
    assert_eq!(status(&result), v1::TaskStatus::Failed, "{result:#?}");
    let error = error_of(&result);
    assert_eq!(error.code, "a2a_refused");
    assert!(!error.retryable);
    assert!(
        error
            .message
            .contains(&format!("{named}/.well-known/agent-card.json")),
        "{}",
        error.message
    );
    assert!(
        error.message.contains("localhost resolves to"),
        "{}",
        error.message
    );
    assert!(
        error.message.contains("a2a.allow_private"),
        "{}",
        error.message
    );

    // Every refusal came before a connection: none is waiting to be accepted.
    match listener.accept() {
        Err(e) if e.kind() == ErrorKind::WouldBlock => {}
        other => panic!("something connected to the refused agent's port: {other:?}"),
    }
}
