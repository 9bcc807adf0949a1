//! MCP tools against a real MCP server: the example runbook server
//! (`examples/mcp/runbooks.py`, the official Python SDK), started by the worker over
//! stdio or run by the test over streamable HTTP on loopback, with the real policy
//! service (over `examples/mcp/policy.yaml`) and evidence store.
//!
//! The tests of the worker's secrets run the `convene-worker` binary in an environment
//! they give it (the tests' own environment is never changed), with the example server
//! wrapped by the scripts of `services/worker/tests/servers/`: behind a bearer token,
//! and writing down the environment it starts with.
//!
//! The server needs a Python that imports `mcp`: `CONVENE_TEST_PYTHON`, else
//! `.venv/bin/python` or `python3` when they do. Without one these tests skip (and fail
//! under `CONVENE_TEST_REQUIRE_SERVICES=1`), but for the one whose server cannot start
//! on purpose.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use convene_core::time::to_timestamp;
use convene_mesh::auth;
use convene_mesh::handles::{EvidenceHandle, GrpcEvidenceStore, GrpcPolicy, PolicyHandle};
use convene_policy::decision_log::AuthorizeRecord;
use convene_proto::v1;
use convene_proto::v1::worker_client::WorkerClient;
use convene_server::test_util::{connect, endpoint, pick_listener, wait_ready};
use convene_worker::model_server::{Reply, Script, ScriptedModel};
use convene_worker::models::ModelSettings;
use convene_worker::profiles::{self, ProviderRegistry};
use convene_worker::provider::{
    FinishReason, Message, ModelProvider, ModelRequest, ModelResponse, ProviderError, Role,
    TokenUsage, ToolCall,
};
use convene_worker::report::{FinalReport, SUBMIT_REPORT, ToolOutcome};
use convene_worker::tools::ToolRegistry;
use convene_worker::tools::mcp::{McpConfig, McpServerConfig, McpTools};
use convene_worker::{Config, WorkerOptions, WorkerService};
use serde_json::{Value, json};
use tempfile::TempDir;
use tokio::io::AsyncBufReadExt as _;

use crate::support::{Mesh, TestWorker, example_data, scope};

const RUN_ID: &str = "run-mcp-20260723";
const PROFILE: &str = "runbook-reader";
const LOOKUP: &str = "mcp:runbooks/lookup_runbook@1";
const SEARCH: &str = "mcp:runbooks/search_runbooks@1";
const SLOW: &str = "mcp:runbooks/slow_lookup@1";
const RELOAD: &str = "mcp:runbooks/reload_runbooks@1";
const DECLARED: [&str; 4] = [LOOKUP, RELOAD, SEARCH, SLOW];
/// Tools the server serves that the catalog does not declare.
const DELETE: &str = "mcp:runbooks/delete_runbook@1";
const EXECUTE_STEP: &str = "mcp:runbooks/execute_runbook_step@1";

/// How long a test waits for something that should happen soon (a server starting, a
/// marker file) before it fails: a guard against hanging, not a performance bound.
const PATIENCE: Duration = Duration::from_secs(60);

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn server_script() -> PathBuf {
    repo().join("examples/mcp/runbooks.py")
}

/// The Python that runs the example server, or `None` after reporting the skip.
fn python() -> Option<PathBuf> {
    convene_store::test_util::python_with_mcp(&[
        repo().join(".venv/bin/python"),
        PathBuf::from("python3"),
    ])
}

/// Waits until `done()` holds, checking every 20 ms; fails the test after [`PATIENCE`].
async fn wait_for(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + PATIENCE;
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The URL an HTTP server started with piped stdout prints first (`listening on <url>`),
/// once it accepts connections.
async fn listening_url(child: &mut tokio::process::Child) -> String {
    let stdout = child.stdout.take().expect("piped stdout");
    let mut lines = tokio::io::BufReader::new(stdout).lines();
    let line = tokio::time::timeout(PATIENCE, lines.next_line())
        .await
        .expect("the HTTP server says where it listens")
        .unwrap()
        .expect("a line on stdout");
    line.strip_prefix("listening on ")
        .unwrap_or_else(|| panic!("unexpected first line {line:?}"))
        .to_owned()
}

/// How the worker reaches the example server.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Via {
    /// The worker starts it.
    Stdio,
    /// The test runs it on a loopback port.
    Http,
}

/// The example server as a test runs it: its state directory (pid, markers) and, over
/// HTTP, its process.
struct Runbooks {
    python: PathBuf,
    state: TempDir,
    http: Option<HttpServer>,
}

struct HttpServer {
    child: tokio::process::Child,
    url: String,
    port: u16,
}

impl Runbooks {
    /// The server over `via`; an HTTP one is started at once, on a free port.
    async fn start(python: PathBuf, via: Via) -> Self {
        let state = tempfile::tempdir().unwrap();
        let mut runbooks = Self {
            python,
            state,
            http: None,
        };
        if via == Via::Http {
            runbooks.http = Some(runbooks.serve_http(0).await);
        }
        runbooks
    }

    /// Runs the HTTP server on `port` (0: a free one) and waits until it listens.
    async fn serve_http(&self, port: u16) -> HttpServer {
        let mut child = tokio::process::Command::new(&self.python)
            .arg(server_script())
            .args(["--http", "--port", &port.to_string(), "--state-dir"])
            .arg(self.state.path())
            .stdout(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("the example server starts");
        let url = listening_url(&mut child).await;
        let port = url
            .rsplit_once(':')
            .and_then(|(_, rest)| rest.split('/').next())
            .and_then(|p| p.parse().ok())
            .expect("a port in the URL");
        HttpServer { child, url, port }
    }

    /// The worker's configuration of this server.
    fn config(&self, call_timeout: Duration) -> McpServerConfig {
        let mut config = match &self.http {
            None => McpServerConfig::stdio(
                "runbooks",
                self.python.display().to_string(),
                [
                    server_script().display().to_string(),
                    "--state-dir".to_owned(),
                    self.state.path().display().to_string(),
                ],
            ),
            Some(http) => McpServerConfig::http("runbooks", http.url.clone()),
        };
        config.call_timeout = call_timeout;
        config
    }

    fn marker(&self, name: &str) -> PathBuf {
        self.state.path().join(name)
    }

    /// Kills the server's process (SIGKILL): the test's own over HTTP, the worker's
    /// child over stdio.
    async fn kill(&mut self) {
        match &mut self.http {
            Some(http) => http.child.kill().await.expect("the HTTP server is killed"),
            None => {
                let pid = std::fs::read_to_string(self.marker("server.pid")).unwrap();
                let killed = std::process::Command::new("kill")
                    .args(["-KILL", pid.trim()])
                    .status()
                    .unwrap();
                assert!(killed.success(), "kill -KILL {pid}");
            }
        }
    }

    /// Over HTTP, runs the server again on the port it had.
    async fn restart_http(&mut self) {
        if let Some(old) = self.http.take() {
            self.http = Some(self.serve_http(old.port).await);
        }
    }
}

/// A model that plays a script: each turn asks for the calls listed for it, then hands
/// in an empty report. It keeps every request, so a test sees what was offered and what
/// each call came to.
#[derive(Debug)]
struct Scripted {
    turns: Vec<Vec<(&'static str, &'static str, Value)>>,
    requests: Mutex<Vec<ModelRequest>>,
}

impl Scripted {
    fn new(turns: Vec<Vec<(&'static str, &'static str, Value)>>) -> Arc<Self> {
        Arc::new(Self {
            turns,
            requests: Mutex::new(Vec::new()),
        })
    }

    fn requests(&self) -> Vec<ModelRequest> {
        self.requests.lock().unwrap().clone()
    }

    /// The tools offered in the first request.
    fn offered(&self) -> Vec<String> {
        self.requests()[0]
            .tools
            .iter()
            .map(|t| t.name.clone())
            .collect()
    }

    /// What call `id` came to, as the model read it.
    fn outcome(&self, id: &str) -> ToolOutcome {
        self.requests()
            .iter()
            .flat_map(|r| r.messages.iter())
            .find(|m| m.role == Role::Tool && m.tool_call_id.as_deref() == Some(id))
            .map(|m| ToolOutcome::from_content(&m.content).expect("a tool outcome"))
            .unwrap_or_else(|| panic!("no outcome of call {id}"))
    }
}

#[async_trait::async_trait]
impl ModelProvider for Scripted {
    fn name(&self) -> &str {
        "scripted"
    }

    fn records_turns(&self) -> bool {
        false
    }

    async fn complete(&self, request: &ModelRequest) -> Result<ModelResponse, ProviderError> {
        let turn = {
            let mut requests = self.requests.lock().unwrap();
            requests.push(request.clone());
            requests.len() - 1
        };
        let calls = match self.turns.get(turn) {
            Some(calls) => calls
                .iter()
                .map(|(id, name, arguments)| ToolCall {
                    id: (*id).to_owned(),
                    name: (*name).to_owned(),
                    arguments: arguments.clone(),
                })
                .collect(),
            None => vec![ToolCall {
                id: "report".into(),
                name: SUBMIT_REPORT.into(),
                arguments: serde_json::to_value(FinalReport {
                    summary: "scripted".into(),
                    ..FinalReport::default()
                })
                .unwrap(),
            }],
        };
        Ok(ModelResponse {
            model: String::new(),
            message: Message::tool_calls(calls),
            finish: FinishReason::ToolCalls,
            usage: TokenUsage::default(),
        })
    }
}

/// The worker profile `runbook-reader` with `provider`, and `rest` (e.g. a playbook).
fn profile_yaml(provider: &str, rest: &str) -> String {
    format!(
        r#"
profiles:
  - id: {PROFILE}
    version: "1.0.0"
    name: Runbook reader
    description: Reads the on-call runbooks of the services an incident touches.
    instructions: Look up the runbooks of the affected services; report their first steps.
    provider: {provider}
    default_tools: ["{LOOKUP}", "{SEARCH}", "{SLOW}", "{RELOAD}"]
    max_iterations: 4
    capabilities:
      - {{ action: "runbooks:read", resource: "runbook*" }}
      - {{ action: "runbooks:refresh", resource: "runbooks" }}
      - {{ action: "evidence:*", resource: "evidence" }}
    evidence_prefixes: ["mcp://runbooks/"]
{rest}"#
    )
}

/// The playbook profile: the payment-api runbook and a search, one claim from both.
fn playbook_profile() -> String {
    profile_yaml(
        "playbook",
        r#"    playbook:
      summary: runbooks of the payment incident
      steps:
        - id: payment_runbook
          tool: "mcp:runbooks/lookup_runbook@1"
          evidence_kind: runbook
          args: { service: payment-api }
        - id: pool_runbooks
          tool: "mcp:runbooks/search_runbooks@1"
          evidence_kind: runbook_search
          args: { text: POOL_EXHAUSTED }
      rules:
        - step: payment_runbook
          when: { path: structured_content.owner, op: exists, value: true }
          claim:
            claim_id: claim-runbook-owner
            topic: runbook.payment-api.owner
            value: "{structured_content.owner}"
            statement: "The payment-api runbook is {structured_content.owner}'s; its first step: {structured_content.steps.0}"
            confidence: 0.9
          evidence_from: [payment_runbook, pool_runbooks]
"#,
    )
}

/// The policy service (over the example MCP policy) and the evidence store.
struct McpMesh {
    mesh: Mesh,
    policy_endpoint: String,
    evidence_endpoint: String,
}

impl McpMesh {
    async fn start() -> Self {
        let mesh = Mesh::start_with_policy(Some(repo().join("examples/mcp/policy.yaml"))).await;
        Self {
            policy_endpoint: endpoint(mesh.policy_server.addr),
            evidence_endpoint: endpoint(mesh.evidence_server.addr),
            mesh,
        }
    }

    fn policy(&self) -> PolicyHandle {
        Arc::new(GrpcPolicy::connect(&self.policy_endpoint).unwrap())
    }

    fn evidence(&self) -> EvidenceHandle {
        Arc::new(GrpcEvidenceStore::connect(&self.evidence_endpoint).unwrap())
    }

    /// The tools a worker mounts with `servers`, the real way: the catalog from the
    /// policy service with the worker-pool credential of the data directory.
    async fn mount(&self, servers: Vec<McpServerConfig>) -> (ToolRegistry, McpTools) {
        let config = Config {
            data_dir: self.mesh.dir.path().to_owned(),
            tools_data_dir: example_data(),
            mcp: McpConfig { servers },
            ..Config::default()
        };
        config.validate().unwrap();
        let (tools, mcp) = config.mount_tools(&self.policy()).await.unwrap();
        (tools, mcp.expect("servers are configured"))
    }

    /// A worker serving `profile_yaml` with `tools`; `scripted` plays the `scripted`
    /// provider.
    async fn worker(
        &self,
        profile_yaml: &str,
        tools: ToolRegistry,
        scripted: Option<Arc<Scripted>>,
    ) -> TestWorker {
        let models = ModelSettings::default();
        let mut providers = ProviderRegistry::builtin(&models.client());
        if let Some(scripted) = scripted {
            providers.register(
                "scripted",
                Arc::new(move |_| Ok(scripted.clone() as Arc<dyn ModelProvider>)),
            );
        }
        let service = WorkerService::new(
            WorkerOptions {
                worker_id: "worker-mcp-1".into(),
                capacity: 4,
                exit_process_on_fault: false,
                models: Arc::new(models),
                key_refresh: convene_mesh::auth::DEFAULT_KEY_REFRESH,
            },
            profiles::parse(profile_yaml, "the test's profiles").unwrap(),
            &providers,
            tools,
            self.policy(),
            self.evidence(),
        )
        .unwrap();
        TestWorker::start(&self.mesh.supervisor, service).await
    }

    /// The task token of `task`, issued by the policy service as the supervisor would
    /// ask for it.
    async fn token(&self, task: &v1::DelegationTask) -> String {
        let mut required = task.required_scopes.clone();
        required.push(scope("evidence:*", "evidence"));
        let mut task_scope = task.scope.clone().unwrap();
        task_scope.resources.push("evidence".into());
        let request = v1::IssueTaskTokenRequest {
            lease_epoch: 0,
            principal: "oncall@acme".into(),
            run_id: RUN_ID.into(),
            parent_token: String::new(),
            grants: vec![v1::TokenGrantRequest {
                delegation_id: task.delegation_id.clone(),
                profile_id: task.profile_id.clone(),
                depth: 1,
                required_scopes: required,
                task_scope: Some(task_scope),
                ..v1::TokenGrantRequest::default()
            }],
        };
        let issued = self
            .policy()
            .issue_task_token(auth::request(request, &self.mesh.supervisor))
            .await
            .expect("the supervisor may issue task tokens")
            .into_inner()
            .tokens
            .remove(0);
        assert_eq!(issued.tools, DECLARED, "{:?}", issued.narrowed);
        issued.token
    }

    fn decisions_for(&self, delegation_id: &str) -> Vec<AuthorizeRecord> {
        self.mesh.decisions_for(delegation_id)
    }
}

/// A runbook-reader delegation of the example run.
fn task(delegation_id: &str) -> v1::DelegationTask {
    let window = |s: &str| to_timestamp(humantime::parse_rfc3339(s).unwrap());
    v1::DelegationTask {
        delegation_id: delegation_id.into(),
        run_id: RUN_ID.into(),
        depth: 1,
        profile_id: PROFILE.into(),
        goal: "Find the runbook steps for the payment-api incident.".into(),
        acceptance_criteria: vec!["Cite the runbooks read".into()],
        scope: Some(v1::TaskScope {
            resources: vec!["runbook*".into()],
            time_range: Some(v1::TimeRange {
                start: Some(window("2026-07-23T01:45:00Z")),
                end: Some(window("2026-07-23T02:10:00Z")),
            }),
        }),
        allowed_tools: DECLARED.map(str::to_owned).to_vec(),
        allowed_evidence_prefixes: vec!["mcp://runbooks/".into()],
        required_scopes: vec![
            scope("runbooks:read", "runbook*"),
            scope("runbooks:refresh", "runbooks"),
        ],
        deadline: Some(to_timestamp(SystemTime::now() + PATIENCE)),
        name: "runbooks".into(),
        ..v1::DelegationTask::default()
    }
}

/// Runs `task` on `worker` with a fresh token.
async fn execute(mesh: &McpMesh, worker: &TestWorker, task: &v1::DelegationTask) -> v1::TaskResult {
    let token = mesh.token(task).await;
    tokio::time::timeout(PATIENCE, worker.execute(task, &token, 1))
        .await
        .expect("the task ends")
        .expect("Execute answers with a result")
}

/// The declared tools are mounted and offered, the undeclared ones are not, and a
/// declared tool's call is authorized by the policy service and stored as evidence.
async fn declared_tools_are_mounted_called_and_recorded(via: Via) {
    let Some(python) = python() else { return };
    let mesh = McpMesh::start().await;
    let runbooks = Runbooks::start(python, via).await;
    let (tools, mcp) = mesh
        .mount(vec![runbooks.config(Duration::from_secs(30))])
        .await;

    // Mounted: exactly the declared tools, though the server lists more.
    assert_eq!(mcp.names(), [LOOKUP, RELOAD, SEARCH, SLOW]);
    let server = mcp.server("runbooks").unwrap();
    let listed = server.listed();
    assert!(listed.iter().any(|t| t == "delete_runbook"), "{listed:?}");
    for name in DECLARED {
        let spec = tools
            .model_spec(name)
            .unwrap_or_else(|| panic!("{name} is offered"));
        assert_eq!(spec.name, name);
    }
    assert!(tools.get(DELETE).is_none() && tools.model_spec(DELETE).is_none());
    // The model sees the server's schema (and the evidence-kind argument every tool has).
    let lookup = tools.model_spec(LOOKUP).unwrap();
    assert_eq!(lookup.parameters["properties"]["service"]["type"], "string");
    assert_eq!(lookup.parameters["required"], json!(["service"]));
    assert!(lookup.parameters["properties"]["evidence_kind"].is_object());
    assert!(
        lookup.description.contains("on-call runbook"),
        "the catalog's description"
    );

    let worker = mesh.worker(&playbook_profile(), tools, None).await;
    let task = task(&format!("del-runbooks-{via:?}"));
    let result = execute(&mesh, &worker, &task).await;
    assert_eq!(
        v1::TaskStatus::try_from(result.status).unwrap(),
        v1::TaskStatus::Completed,
        "{result:#?}"
    );
    let claim = result
        .claims
        .iter()
        .find(|c| c.topic == "runbook.payment-api.owner")
        .expect("the runbook claim");
    assert_eq!(claim.value, "team-payments");
    assert!(
        claim.statement.contains("POOL_EXHAUSTED"),
        "{}",
        claim.statement
    );

    // Evidence: scheme mcp, subject server/tool, source mcp.<server>.<tool>.
    let evidence_id = format!(
        "mcp://runbooks/lookup_runbook/{RUN_ID}/{}/payment_runbook",
        task.delegation_id
    );
    let record = result
        .evidence
        .iter()
        .find(|e| e.evidence_id == evidence_id)
        .unwrap_or_else(|| panic!("no {evidence_id}: {:#?}", result.evidence));
    assert_eq!(record.source, "mcp.runbooks.lookup_runbook");
    assert_eq!(record.kind, "runbook");
    assert_eq!(
        record.scope.as_ref().unwrap().resources,
        ["runbook/payment-api"]
    );
    assert_eq!(claim.evidence_refs.len(), 2);

    // The artifact holds the server's answer: content blocks and structured content.
    let token = mesh.token(&task).await;
    let artifact = mesh
        .evidence()
        .get_artifact(auth::request(
            v1::GetArtifactRequest {
                uri: record.artifact_uri.clone(),
            },
            &token,
        ))
        .await
        .unwrap()
        .into_inner();
    let stored: Value = serde_json::from_slice(&artifact.content).unwrap();
    assert_eq!(stored["server"], "runbooks");
    assert_eq!(stored["tool"], "lookup_runbook");
    assert_eq!(stored["content"][0]["type"], "text");
    assert_eq!(stored["structured_content"]["service"], "payment-api");

    // Every call was authorized by the policy service, on the resource its arguments
    // fill the catalog's template with.
    let decisions = mesh.decisions_for(&task.delegation_id);
    assert_eq!(decisions.len(), 2, "{decisions:#?}");
    assert!(decisions.iter().all(|d| d.allowed), "{decisions:#?}");
    let lookup_decision = decisions.iter().find(|d| d.tool == LOOKUP).unwrap();
    assert_eq!(
        (
            lookup_decision.action.as_str(),
            lookup_decision.resource.as_str()
        ),
        ("runbooks:read", "runbook/payment-api")
    );
    assert_eq!(lookup_decision.tool_call_id, record.tool_call_id);
    let search_decision = decisions.iter().find(|d| d.tool == SEARCH).unwrap();
    assert_eq!(search_decision.resource, "runbooks");
    mcp.shutdown().await;
}

#[tokio::test]
async fn declared_tools_of_a_stdio_server_are_mounted_called_and_recorded() {
    declared_tools_are_mounted_called_and_recorded(Via::Stdio).await;
}

#[tokio::test]
async fn declared_tools_of_an_http_server_are_mounted_called_and_recorded() {
    declared_tools_are_mounted_called_and_recorded(Via::Http).await;
}

/// An undeclared tool is offered to no model and refused when called by name, also
/// when the server adds it later and says so with `notifications/tools/list_changed`.
async fn undeclared_tools_are_neither_offered_nor_callable(via: Via) {
    let Some(python) = python() else { return };
    let mesh = McpMesh::start().await;
    let runbooks = Runbooks::start(python, via).await;
    let (tools, mcp) = mesh
        .mount(vec![runbooks.config(Duration::from_secs(30))])
        .await;
    let server = mcp.server("runbooks").unwrap().clone();
    let listings = server.listings();

    // Turn 1: the undeclared tool by its catalog-style name and by its MCP name, and a
    // reload that makes the server add execute_runbook_step. Turn 2: the runbook the
    // delete would have removed.
    let scripted = Scripted::new(vec![
        vec![
            ("delete", DELETE, json!({"service": "payment-api"})),
            (
                "delete_bare",
                "delete_runbook",
                json!({"service": "payment-api"}),
            ),
            ("reload", RELOAD, json!({})),
        ],
        vec![("lookup", LOOKUP, json!({"service": "payment-api"}))],
    ]);
    let worker = mesh
        .worker(
            &profile_yaml("scripted", ""),
            tools.clone(),
            Some(scripted.clone()),
        )
        .await;
    let first = task(&format!("del-undeclared-{via:?}"));
    execute(&mesh, &worker, &first).await;

    let mut offered = scripted.offered();
    offered.retain(|t| t != SUBMIT_REPORT);
    assert_eq!(offered, DECLARED, "only declared tools are offered");
    for id in ["delete", "delete_bare"] {
        let outcome = scripted.outcome(id);
        assert!(!outcome.success);
        let error = outcome.error.unwrap();
        assert!(error.contains("unknown tool"), "{id}: {error}");
    }
    assert!(scripted.outcome("reload").success);
    let lookup = scripted.outcome("lookup");
    assert!(
        lookup.success,
        "the delete never reached the server: {lookup:?}"
    );
    // No undeclared call reached the policy service either.
    let decisions = mesh.decisions_for(&first.delegation_id);
    let called: Vec<&str> = decisions.iter().map(|d| d.tool.as_str()).collect();
    assert_eq!(called, [RELOAD, LOOKUP], "{decisions:#?}");

    // The server announced its new tool; the worker listed again and still mounts
    // nothing of it.
    wait_for("the worker to list the server's tools again", || {
        server.listings() > listings && server.listed().iter().any(|t| t == "execute_runbook_step")
    })
    .await;
    assert!(tools.get(EXECUTE_STEP).is_none() && tools.model_spec(EXECUTE_STEP).is_none());
    assert_eq!(mcp.names(), [LOOKUP, RELOAD, SEARCH, SLOW]);

    let later = Scripted::new(vec![vec![(
        "execute",
        EXECUTE_STEP,
        json!({"service": "risk-gateway", "step": "rollback_rule"}),
    )]]);
    let worker = mesh
        .worker(&profile_yaml("scripted", ""), tools, Some(later.clone()))
        .await;
    let second = task(&format!("del-added-later-{via:?}"));
    execute(&mesh, &worker, &second).await;
    let mut offered = later.offered();
    offered.retain(|t| t != SUBMIT_REPORT);
    assert_eq!(offered, DECLARED, "a tool added later is not offered");
    let outcome = later.outcome("execute");
    assert!(!outcome.success);
    assert!(outcome.error.unwrap().contains("unknown tool"));
    assert!(mesh.decisions_for(&second.delegation_id).is_empty());
    mcp.shutdown().await;
}

#[tokio::test]
async fn undeclared_tools_of_a_stdio_server_are_neither_offered_nor_callable() {
    undeclared_tools_are_neither_offered_nor_callable(Via::Stdio).await;
}

#[tokio::test]
async fn undeclared_tools_of_an_http_server_are_neither_offered_nor_callable() {
    undeclared_tools_are_neither_offered_nor_callable(Via::Http).await;
}

/// A server killed during a call fails that call, the task goes on to its end, and the
/// next call reaches the server again (started again over stdio; restarted by the test
/// over HTTP).
async fn a_server_killed_mid_call_fails_the_call_not_the_task(via: Via) {
    let Some(python) = python() else { return };
    let mesh = McpMesh::start().await;
    let mut runbooks = Runbooks::start(python, via).await;
    let (tools, mcp) = mesh
        .mount(vec![runbooks.config(Duration::from_secs(120))])
        .await;
    let server = mcp.server("runbooks").unwrap().clone();
    let first_pid = server.pid().await;

    let scripted = Scripted::new(vec![vec![(
        "slow",
        SLOW,
        json!({"service": "payment-api", "seconds": 300}),
    )]]);
    let worker = Arc::new(
        mesh.worker(
            &profile_yaml("scripted", ""),
            tools.clone(),
            Some(scripted.clone()),
        )
        .await,
    );
    let slow_task = task(&format!("del-killed-{via:?}"));
    let token = mesh.token(&slow_task).await;
    let running = {
        let worker = worker.clone();
        let slow_task = slow_task.clone();
        tokio::spawn(async move { worker.execute(&slow_task, &token, 1).await })
    };
    let started = runbooks.marker("slow_lookup.started");
    wait_for("the server to start the slow call", || started.exists()).await;
    runbooks.kill().await;

    let result = tokio::time::timeout(PATIENCE, running)
        .await
        .expect("the task ends after the server died")
        .unwrap()
        .expect("Execute answers with a result");
    let outcome = scripted.outcome("slow");
    assert!(!outcome.success);
    let error = outcome.error.unwrap();
    assert!(
        error.contains("MCP server runbooks went away during the call"),
        "{error}"
    );
    // The loop went on to another model turn: the failure was the call's, not the task's.
    assert_eq!(scripted.requests().len(), 2);
    assert!(
        result
            .error
            .as_ref()
            .is_none_or(|e| e.code != "upstream_unavailable"),
        "{result:#?}"
    );
    assert!(result.evidence.is_empty());

    runbooks.restart_http().await;
    let again = Scripted::new(vec![vec![(
        "lookup",
        LOOKUP,
        json!({"service": "risk-gateway"}),
    )]]);
    let worker = mesh
        .worker(&profile_yaml("scripted", ""), tools, Some(again.clone()))
        .await;
    let next = task(&format!("del-after-kill-{via:?}"));
    let result = execute(&mesh, &worker, &next).await;
    let outcome = again.outcome("lookup");
    assert!(outcome.success, "{outcome:?}");
    assert_eq!(
        outcome.output.unwrap()["structured_content"]["owner"],
        "team-risk"
    );
    assert_eq!(result.evidence.len(), 1);
    if via == Via::Stdio {
        let pid = server.pid().await;
        assert!(
            pid.is_some() && pid != first_pid,
            "a new process: {pid:?} after {first_pid:?}"
        );
    }
    mcp.shutdown().await;
}

#[tokio::test]
async fn a_stdio_server_killed_mid_call_fails_the_call_not_the_task() {
    a_server_killed_mid_call_fails_the_call_not_the_task(Via::Stdio).await;
}

#[tokio::test]
async fn an_http_server_killed_mid_call_fails_the_call_not_the_task() {
    a_server_killed_mid_call_fails_the_call_not_the_task(Via::Http).await;
}

#[tokio::test]
async fn a_hung_call_times_out_and_server_errors_fail_their_calls() {
    let Some(python) = python() else { return };
    let mesh = McpMesh::start().await;
    let runbooks = Runbooks::start(python, Via::Stdio).await;
    let (tools, mcp) = mesh
        .mount(vec![runbooks.config(Duration::from_secs(2))])
        .await;
    let scripted = Scripted::new(vec![vec![
        (
            "hang",
            SLOW,
            json!({"service": "payment-api", "seconds": 120}),
        ),
        ("unknown", LOOKUP, json!({"service": "billing"})),
        (
            "refused",
            SLOW,
            json!({"service": "payment-api", "seconds": -1}),
        ),
        (
            "off_template",
            LOOKUP,
            json!({"service": "payment-api/../x"}),
        ),
    ]]);
    let worker = mesh
        .worker(&profile_yaml("scripted", ""), tools, Some(scripted.clone()))
        .await;
    let task = task("del-failures");
    let result = execute(&mesh, &worker, &task).await;

    let error = |id| {
        let outcome = scripted.outcome(id);
        assert!(!outcome.success, "{id}: {outcome:?}");
        outcome.error.unwrap()
    };
    let hang = error("hang");
    assert!(
        hang.contains("did not answer within 2s (call_timeout)"),
        "{hang}"
    );
    let unknown = error("unknown");
    assert!(
        unknown.contains("answered that the call failed") && unknown.contains("billing"),
        "{unknown}"
    );
    let refused = error("refused");
    assert!(refused.contains("JSON-RPC error -32602"), "{refused}");
    // Arguments that cannot fill the resource template are refused before anything is
    // asked of the policy service or the server.
    let off_template = error("off_template");
    assert!(off_template.contains("`service`"), "{off_template}");
    let decisions = mesh.decisions_for(&task.delegation_id);
    assert_eq!(decisions.len(), 3, "{decisions:#?}");
    assert!(result.evidence.is_empty());
    // The server is still there for the next call.
    assert!(mcp.server("runbooks").unwrap().is_connected().await);
    mcp.shutdown().await;
}

#[tokio::test]
async fn a_server_that_cannot_start_leaves_its_tools_unoffered_and_fails_their_calls() {
    let mesh = McpMesh::start().await;
    let missing = McpServerConfig::stdio("runbooks", "/nonexistent/mcp-runbooks", ["--stdio"]);
    let (tools, mcp) = mesh.mount(vec![missing]).await;
    // Mounted, so profiles naming the tools load, but offered to no model.
    assert_eq!(mcp.names(), [LOOKUP, RELOAD, SEARCH, SLOW]);
    assert!(DECLARED.iter().all(|t| tools.model_spec(t).is_none()));

    let scripted = Scripted::new(vec![vec![(
        "lookup",
        LOOKUP,
        json!({"service": "payment-api"}),
    )]]);
    let worker = mesh
        .worker(&profile_yaml("scripted", ""), tools, Some(scripted.clone()))
        .await;
    let task = task("del-no-server");
    execute(&mesh, &worker, &task).await;
    let mut offered = scripted.offered();
    offered.retain(|t| t != SUBMIT_REPORT);
    assert!(offered.is_empty(), "{offered:?}");
    let outcome = scripted.outcome("lookup");
    assert!(!outcome.success);
    let error = outcome.error.unwrap();
    assert!(
        error.contains("cannot start `/nonexistent/mcp-runbooks`")
            && error.contains("tries the server again on the next call"),
        "{error}"
    );
}

#[test]
fn the_example_mcp_files_load_and_keep_the_payment_incident_policy() {
    use convene_mesh::policy_file::PolicyFile;

    let config = McpConfig::load(&repo().join("examples/mcp/mcp.yaml")).unwrap();
    assert_eq!(config.servers[0].name, "runbooks");

    let read = |path: &str| {
        let text = std::fs::read_to_string(repo().join(path)).unwrap();
        PolicyFile::parse(&text, Some("yaml"), path).unwrap()
    };
    let base = read("examples/payment-incident/policy.yaml");
    let mcp = read("examples/mcp/policy.yaml");
    mcp.compile("examples/mcp/policy.yaml").unwrap();
    // Everything of the payment-incident policy, so the example's runs work over it too.
    assert_eq!(
        (&mcp.tokens, &mcp.actions, &mcp.rules),
        (&base.tokens, &base.actions, &base.rules)
    );
    for profile in &base.profiles {
        assert!(
            mcp.profiles.contains(profile),
            "profile {} differs",
            profile.id
        );
    }
    for tool in &base.tools {
        assert!(mcp.tools.contains(tool), "tool {} differs", tool.name);
    }
    for principal in &base.principals {
        let ours = mcp
            .principals
            .iter()
            .find(|p| p.id == principal.id)
            .unwrap();
        assert!(
            principal.grants.iter().all(|g| ours.grants.contains(g)),
            "{}",
            principal.id
        );
        assert_eq!(
            (&ours.roles, &ours.tenant),
            (&principal.roles, &principal.tenant)
        );
    }
    // Plus the runbook tools, all declared for the server `runbooks`.
    let added: Vec<&str> = mcp
        .tools
        .iter()
        .filter(|t| !base.tools.contains(t))
        .map(|t| t.name.as_str())
        .collect();
    assert_eq!(added, [LOOKUP, SEARCH, SLOW, RELOAD]);
}

/// A bearer token only the tests below know: it may travel to the MCP server in the
/// Authorization header, and nowhere else.
const BEARER_TOKEN: &str = "mcp-bearer-5d1c8e7a93f24b60-never-log-me";
/// Its distinctive middle, which also catches a token cut short or reformatted.
const BEARER_TOKEN_CORE: &str = "5d1c8e7a93f24b60";
/// The worker's variable holding it, which `bearer_token_env` names.
const BEARER_TOKEN_ENV: &str = "RUNBOOKS_TEST_BEARER_TOKEN";

/// A script of the worker's MCP tests (`services/worker/tests/servers/`).
fn test_server(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/servers")
        .join(name)
}

/// Fails if the bearer token (or its middle) is in `text`, showing where.
fn assert_no_bearer_token(what: &str, text: &str) {
    let leaks: Vec<&str> = text
        .lines()
        .filter(|line| line.contains(BEARER_TOKEN_CORE))
        .take(5)
        .collect();
    assert!(
        leaks.is_empty(),
        "the bearer token leaked into {what}:\n{}",
        leaks.join("\n")
    );
}

/// The `convene-worker` binary over the mesh, in an environment the test gives it whole
/// (a worker's variables are set there, never in the test's own process), with its
/// standard output and error (its logs) in files. Killed when dropped.
struct WorkerProcess {
    child: std::process::Child,
    addr: SocketAddr,
    dir: TempDir,
}

impl WorkerProcess {
    /// Starts the worker with the MCP `servers`, the profiles of `profiles_yaml` and the
    /// environment `env`, and waits until it serves.
    async fn start(
        mesh: &McpMesh,
        servers: Vec<McpServerConfig>,
        profiles_yaml: &str,
        env: &[(&str, &str)],
    ) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let profiles = dir.path().join("profiles.yaml");
        std::fs::write(&profiles, profiles_yaml).unwrap();
        let config = dir.path().join("worker.yaml");
        let settings = json!({
            "worker_id": "worker-mcp-process",
            "data_dir": mesh.mesh.dir.path(),
            "tools_data_dir": example_data(),
            "profiles_file": profiles,
            "policy_endpoint": mesh.policy_endpoint,
            "evidence_endpoint": mesh.evidence_endpoint,
            "register": false,
            "mcp": McpConfig { servers },
        });
        std::fs::write(&config, serde_yaml::to_string(&settings).unwrap()).unwrap();
        let free = pick_listener().await;
        let addr = free.local_addr().unwrap();
        drop(free);
        let output = |name: &str| std::fs::File::create(dir.path().join(name)).unwrap();
        let child = std::process::Command::new(env!("CARGO_BIN_EXE_convene-worker"))
            .env_clear()
            .envs(env.iter().copied())
            .arg("--config")
            .arg(&config)
            .args(["--listen", &addr.to_string()])
            .stdout(output("stdout.log"))
            .stderr(output("stderr.log"))
            .spawn()
            .expect("the worker binary starts");
        let mut worker = Self { child, addr, dir };
        let ready = wait_ready(addr);
        tokio::pin!(ready);
        loop {
            tokio::select! {
                () = &mut ready => return worker,
                () = tokio::time::sleep(Duration::from_millis(100)) => {
                    if let Some(status) = worker.child.try_wait().unwrap() {
                        panic!("the worker exited ({status}) before it served:\n{}", worker.logs());
                    }
                }
            }
        }
    }

    /// Runs `task` with a fresh token, as the supervisor.
    async fn execute(&self, mesh: &McpMesh, task: &v1::DelegationTask) -> v1::TaskResult {
        let token = mesh.token(task).await;
        let mut client = WorkerClient::new(connect(self.addr).await);
        let request = auth::request(
            v1::WorkerExecuteRequest {
                lease_valid_until: None,
                task: Some(task.clone()),
                task_token: token,
                attempt: 1,
            },
            &mesh.mesh.supervisor,
        );
        tokio::time::timeout(PATIENCE, client.execute(request))
            .await
            .expect("the task ends")
            .expect("Execute answers")
            .into_inner()
            .result
            .expect("Execute answers with a result")
    }

    /// Kills the worker, so its logs are complete.
    fn stop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Everything it wrote on standard output and error.
    fn logs(&self) -> String {
        ["stdout.log", "stderr.log"]
            .iter()
            .map(|name| std::fs::read_to_string(self.dir.path().join(name)).unwrap_or_default())
            .collect::<Vec<_>>()
            .join("\n")
    }
}

impl Drop for WorkerProcess {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The `runbook-reader` profile played by the `openai` provider against `model`.
fn model_profile(model: &ScriptedModel, key_file: &std::path::Path) -> String {
    profile_yaml(
        "openai",
        &format!(
            "    model: scripted-model\n    base_url: {}\n    api_key_file: {}\n",
            model.base_url(),
            key_file.display()
        ),
    )
}

/// The model's turn that calls the payment-api lookup with call id `id`.
fn lookup_turn(id: &str) -> Reply {
    let arguments = json!({"service": "payment-api", "evidence_kind": "runbook"});
    Reply::tool_calls(vec![(
        id.to_owned(),
        convene_worker::openai::function_name(LOOKUP),
        arguments.to_string(),
    )])
}

/// The model's turn that hands in an empty report.
fn report_turn() -> Reply {
    let report = FinalReport {
        summary: "scripted".into(),
        ..FinalReport::default()
    };
    Reply::tool_calls(vec![(
        "report".to_owned(),
        SUBMIT_REPORT.to_owned(),
        serde_json::to_string(&report).unwrap(),
    )])
}

/// What call `id` came to, as `model` read it.
fn model_outcome(model: &ScriptedModel, id: &str) -> ToolOutcome {
    model
        .requests()
        .iter()
        .flat_map(|r| r.last_tool_results())
        .find(|r| r.tool_call_id == id)
        .map(|r| ToolOutcome::from_content(&r.content).expect("a tool outcome"))
        .unwrap_or_else(|| panic!("no outcome of call {id}"))
}

/// How the bearer-token server treats the token.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Server {
    /// It never quotes the token, and refuses one it does not take with 401 and a
    /// `WWW-Authenticate: Bearer` challenge, as the MCP authorization spec has it.
    Careful,
    /// It quotes the Authorization header it gets: in its answers (a `served_to` field of
    /// every runbook) and in the body of its 401, which has no challenge.
    Careless,
}

/// What stands for the bearer token where the worker masked it.
const MASKED_BEARER: &str = "Bearer [redacted bearer token]";

/// The log lines holding the bearer token, each as the target (module) that wrote it.
fn log_lines_with_the_token(logs: &str) -> Vec<String> {
    logs.lines()
        .filter(|line| line.contains(BEARER_TOKEN_CORE))
        .map(|line| {
            serde_json::from_str::<Value>(line)
                .ok()
                .and_then(|entry| entry["target"].as_str().map(str::to_owned))
                .unwrap_or_else(|| format!("(not a log entry) {line}"))
        })
        .collect()
}

/// A worker whose `runbooks` server (`server`) is reached over HTTP with a bearer token:
/// the server takes the token for one task, then refuses it for the next, whose two
/// calls fail (the first in the session the server now refuses, the second in the
/// handshake of a new one). The token reaches the server in the Authorization header of
/// every request, and what the model reads (the first call's result, the errors), the
/// evidence stored, the requests to the model and the tasks' results hold none of it.
/// Returns the worker's logs, written at every level as JSON lines, and the errors.
async fn a_bearer_token_reaches_only_the_mcp_server(
    python: PathBuf,
    server: Server,
) -> (String, Vec<String>) {
    let mesh = McpMesh::start().await;
    let state = tempfile::tempdir().unwrap();
    let accepted_token = state.path().join("accepted-token");
    let record = state.path().join("authorization");
    std::fs::write(&accepted_token, BEARER_TOKEN).unwrap();
    let mut command = tokio::process::Command::new(&python);
    command
        .arg(test_server("bearer_runbooks.py"))
        .arg("--token-file")
        .arg(&accepted_token)
        .arg("--record")
        .arg(&record);
    if server == Server::Careless {
        command.args(["--quote-refused", "--quote-accepted"]);
    }
    let mut process = command
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("the bearer-token server starts");
    let mut runbooks = McpServerConfig::http("runbooks", listening_url(&mut process).await);
    runbooks.bearer_token_env = Some(BEARER_TOKEN_ENV.to_owned());

    let model = ScriptedModel::start(Script::new(vec![
        lookup_turn("accepted"),
        report_turn(),
        lookup_turn("refused"),
        lookup_turn("refused_again"),
        report_turn(),
    ]))
    .unwrap();
    let model_key = state.path().join("model.key");
    std::fs::write(&model_key, "scripted-model-key").unwrap();
    let path = std::env::var("PATH").unwrap_or_default();
    let mut worker = WorkerProcess::start(
        &mesh,
        vec![runbooks],
        &model_profile(&model, &model_key),
        &[
            ("PATH", &path),
            ("RUST_LOG", "trace"),
            ("CONVENE_LOG_FORMAT", "json"),
            (BEARER_TOKEN_ENV, BEARER_TOKEN),
        ],
    )
    .await;
    let sent = || {
        std::fs::read_to_string(&record)
            .unwrap_or_default()
            .lines()
            .map(str::to_owned)
            .collect::<Vec<_>>()
    };
    let bearer = format!("Bearer {BEARER_TOKEN}");

    // Taken: the token travels in the Authorization header of every request.
    let accepted_task = task(&format!("del-bearer-accepted-{server:?}"));
    let accepted = worker.execute(&mesh, &accepted_task).await;
    let outcome = model_outcome(&model, "accepted");
    assert!(outcome.success, "{outcome:?}");
    let output = outcome.output.unwrap();
    assert_eq!(output["structured_content"]["owner"], "team-payments");
    // A careless server's answer quotes the token: the model reads it masked, and the
    // evidence stores it masked.
    let served_to = match server {
        Server::Careful => Value::Null,
        Server::Careless => json!(MASKED_BEARER),
    };
    assert_eq!(output["structured_content"]["served_to"], served_to);
    assert_no_bearer_token("a call's result the model read", &output.to_string());
    let artifact = stored_artifact(&mesh, &accepted_task, &accepted, "accepted").await;
    let stored: Value = serde_json::from_slice(&artifact).unwrap();
    assert_eq!(stored["structured_content"]["owner"], "team-payments");
    assert_eq!(stored["structured_content"]["served_to"], served_to);
    assert_no_bearer_token("an evidence artifact", &String::from_utf8_lossy(&artifact));
    let before_refusal = sent();
    assert!(before_refusal.len() >= 3, "{before_refusal:?}");
    assert!(
        before_refusal.iter().all(|h| *h == bearer),
        "{before_refusal:?}"
    );

    // Refused: the server takes another token from now on.
    std::fs::write(&accepted_token, "a-token-the-worker-does-not-hold").unwrap();
    let refused = worker
        .execute(&mesh, &task(&format!("del-bearer-refused-{server:?}")))
        .await;
    let mut errors = Vec::new();
    for id in ["refused", "refused_again"] {
        let outcome = model_outcome(&model, id);
        assert!(!outcome.success, "{id}: {outcome:?}");
        let error = outcome.error.unwrap();
        assert!(error.contains("MCP server runbooks"), "{error}");
        assert_no_bearer_token("a failed call's error", &error);
        errors.push(error);
    }
    let after_refusal = sent();
    assert!(
        after_refusal.len() > before_refusal.len(),
        "the refused calls reached the server: {after_refusal:?}"
    );
    assert!(
        after_refusal.iter().all(|h| *h == bearer),
        "{after_refusal:?}"
    );
    for request in model.requests() {
        assert_no_bearer_token("a request to the model", &request.body.to_string());
    }
    for result in [&accepted, &refused] {
        assert_no_bearer_token("a task's result", &format!("{result:#?}"));
    }
    // The result names the failed calls with their errors, the same as the model read.
    let failure = &refused.error.as_ref().expect("the task failed").message;
    assert!(failure.contains(&errors[1]), "{failure}");

    worker.stop();
    let logs = worker.logs();
    // The logs were written at every level, and hold the connection and the failed
    // calls with their errors.
    let entries: Vec<Value> = logs
        .lines()
        .filter_map(|line| serde_json::from_str(line).ok())
        .collect();
    assert!(
        entries.iter().any(|e| e["level"] == "TRACE"),
        "no trace-level log entry"
    );
    assert!(
        entries
            .iter()
            .any(|e| e["fields"]["message"] == "MCP server connected"),
        "no log of the connection"
    );
    for (id, error) in ["refused", "refused_again"].iter().zip(&errors) {
        assert!(
            entries
                .iter()
                .any(|e| e["fields"]["call_id"] == *id && e["fields"]["error"] == **error),
            "no log of call {id}"
        );
    }
    (logs, errors)
}

/// The artifact of the evidence the lookup call `call_id` of `task` recorded (its record
/// is among those of `result`).
async fn stored_artifact(
    mesh: &McpMesh,
    task: &v1::DelegationTask,
    result: &v1::TaskResult,
    call_id: &str,
) -> Vec<u8> {
    let evidence_id = format!(
        "mcp://runbooks/lookup_runbook/{RUN_ID}/{}/{call_id}",
        task.delegation_id
    );
    let record = result
        .evidence
        .iter()
        .find(|e| e.evidence_id == evidence_id)
        .unwrap_or_else(|| panic!("no {evidence_id}: {:#?}", result.evidence));
    let token = mesh.token(task).await;
    mesh.evidence()
        .get_artifact(auth::request(
            v1::GetArtifactRequest {
                uri: record.artifact_uri.clone(),
            },
            &token,
        ))
        .await
        .unwrap()
        .into_inner()
        .content
}

/// The bearer token reaches the MCP server in the Authorization header, and nothing
/// else: not the worker's logs (at every level), not what the model reads, not the
/// evidence, not the tasks' results, also when the server refuses it with 401 and the
/// calls fail.
#[tokio::test]
async fn an_mcp_bearer_token_never_reaches_logs_results_or_errors() {
    let Some(python) = python() else { return };
    let (logs, _) = a_bearer_token_reaches_only_the_mcp_server(python, Server::Careful).await;
    let leaks = log_lines_with_the_token(&logs);
    assert!(
        leaks.is_empty(),
        "the bearer token leaked into logs of {leaks:?}"
    );
}

/// An MCP server that quotes the token back, in a tool's result and in the body of its
/// 401, sends it back to the worker, which masks it where the answer enters the worker:
/// the result the model reads and the evidence stores, the errors the model reads, the
/// task's result, and every log line, those of the MCP client library (rmcp), which
/// logs what it receives, included.
#[tokio::test]
async fn a_bearer_token_an_mcp_server_quotes_back_is_masked_in_what_the_worker_writes() {
    let Some(python) = python() else { return };
    let (logs, errors) = a_bearer_token_reaches_only_the_mcp_server(python, Server::Careless).await;
    for error in &errors {
        assert!(
            error.contains("401") && error.contains(&format!("not accepted: {MASKED_BEARER}")),
            "the error quotes the server's answer, masked: {error}"
        );
    }
    let leaks = log_lines_with_the_token(&logs);
    assert!(
        leaks.is_empty(),
        "the bearer token leaked into logs of {leaks:?}"
    );
    // The logs hold what rmcp received, masked: the careless server's result.
    assert!(
        logs.lines().any(|line| line.contains("rmcp")
            && line.contains("served_to")
            && line.contains("[redacted bearer token]")),
        "no log of rmcp holds the masked result"
    );
}

/// The worker's secret, which no stdio server's configuration names.
const WORKER_SECRET: &str = "worker-secret-e2b7a4c91f6d3058";
/// The worker's variable holding it.
const WORKER_SECRET_ENV: &str = "RUNBOOKS_TEST_WORKER_SECRET";
/// The worker's variable the server's `pass_env` names.
const PASSED_ENV: &str = "RUNBOOKS_TEST_PASSED";

/// A stdio server starts with a cleared environment: the worker's PATH, HOME, locale,
/// TMPDIR and TZ, the variables its `pass_env` names (those the worker has) and its
/// `env`; nothing else of the worker's, its secrets least of all.
#[tokio::test]
async fn a_stdio_mcp_server_sees_only_the_variables_its_config_names() {
    let Some(python) = python() else { return };
    let mesh = McpMesh::start().await;
    let state = tempfile::tempdir().unwrap();
    let env_file = state.path().join("server-env.json");
    let mut runbooks = McpServerConfig::stdio(
        "runbooks",
        python.display().to_string(),
        [
            test_server("environment_runbooks.py").display().to_string(),
            "--env-file".to_owned(),
            env_file.display().to_string(),
        ],
    );
    runbooks.env = BTreeMap::from([("RUNBOOKS_REGION".to_owned(), "eu".to_owned())]);
    runbooks.pass_env = vec![PASSED_ENV.to_owned(), "RUNBOOKS_TEST_UNSET".to_owned()];

    let home = state.path().join("home");
    std::fs::create_dir(&home).unwrap();
    let home = home.display().to_string();
    let tmp = state.path().display().to_string();
    let path = std::env::var("PATH").unwrap_or_default();
    let inherited = [
        ("PATH", path.as_str()),
        ("HOME", home.as_str()),
        ("LANG", "C.UTF-8"),
        ("LC_ALL", "C.UTF-8"),
        ("TMPDIR", tmp.as_str()),
        ("TZ", "UTC"),
    ];
    let mut env = inherited.to_vec();
    env.extend([
        (PASSED_ENV, "passed-on-purpose"),
        (WORKER_SECRET_ENV, WORKER_SECRET),
        ("RUST_LOG", "info"),
    ]);
    let worker = WorkerProcess::start(&mesh, vec![runbooks], &playbook_profile(), &env).await;
    wait_for("the stdio server to write its environment", || {
        env_file.exists()
    })
    .await;

    let text = std::fs::read_to_string(&env_file).unwrap();
    let seen: BTreeMap<String, String> = serde_json::from_str(&text).unwrap();
    let mut expected: BTreeMap<String, String> = inherited
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
    expected.insert(PASSED_ENV.into(), "passed-on-purpose".into());
    expected.insert("RUNBOOKS_REGION".into(), "eu".into());
    assert_eq!(seen, expected);
    assert!(!text.contains(WORKER_SECRET), "{text}");

    // The server works in that environment: the worker's task reads its runbook.
    let result = worker.execute(&mesh, &task("del-stdio-env")).await;
    let claim = result
        .claims
        .iter()
        .find(|c| c.topic == "runbook.payment-api.owner")
        .unwrap_or_else(|| panic!("the runbook claim: {result:#?}\n{}", worker.logs()));
    assert_eq!(claim.value, "team-payments");
}
