//! A run whose specialist is a remote A2A agent: the example agent
//! (`examples/a2a/remote_agent.py`, the official Python SDK) serves the delegation of a
//! worker profile with `provider: a2a`, the run completes, and the claims made of the
//! agent's artifacts verify down to the stored bytes; the bearer credential the worker
//! sends is nowhere in the run. A worker whose profile names an agent its `a2a`
//! configuration does not allow (not on the allowlist, or on it at a loopback address
//! `allow_private` does not list) does not start, and nothing connects to that agent.
//!
//! The mesh runs in this process; the `a2a` worker runs beside it as the standalone
//! binary does (`convene_worker::run`), with its own `a2a` configuration.
//!
//! The agent needs a Python that imports `a2a` (a2a-sdk 1.3) and `uvicorn`:
//! `CONVENE_TEST_PYTHON`, else `.venv/bin/python` or `python3` when they do. Without one
//! the test skips (and fails under `CONVENE_TEST_REQUIRE_SERVICES=1`).

use std::io::ErrorKind;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::harness::{MeshOptions, Mode, TestMesh, example_data, repo_root, spec_from_yaml};
use convene_mesh::auth::request;
use convene_mesh::policy_file::{PolicyFile, ProfileEntry, ScopeEntry};
use convene_proto::v1::{self, evidence_store_server::EvidenceStore as _};
use convene_server::{ServerSettings, Shutdown};
use convene_store::test_util::{PYTHON_ENV, Service};
use tokio::io::AsyncBufReadExt as _;

const ONCALL: &str = "oncall@acme";
const LIMIT: Duration = Duration::from_secs(60);
const HISTORY: &str = "incident-history";
const BEARER: &str = "a2a-e2e-bearer-41d9c07b3e5f";

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
            "{PYTHON_ENV}={} cannot import a2a-sdk and uvicorn",
            given.display()
        );
        return Some(given);
    }
    let found = [
        repo_root().join(".venv/bin/python"),
        PathBuf::from("python3"),
    ]
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

/// Starts the example agent on a free loopback port, requiring [`BEARER`]; returns the
/// process (stopped when dropped) and its URL.
async fn start_agent(python: &Path) -> (tokio::process::Child, String) {
    let mut child = tokio::process::Command::new(python)
        .arg(repo_root().join("examples/a2a/remote_agent.py"))
        .args(["--port", "0", "--token-env", "HISTORY_AGENT_TOKEN"])
        .env("HISTORY_AGENT_TOKEN", BEARER)
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("the example agent starts");
    let mut lines = tokio::io::BufReader::new(child.stdout.take().expect("stdout")).lines();
    let line = tokio::time::timeout(LIMIT, lines.next_line())
        .await
        .expect("the agent announces its address in time")
        .expect("its stdout reads")
        .expect("the agent prints `listening on <url>`");
    let url = line
        .strip_prefix("listening on ")
        .unwrap_or_else(|| panic!("unexpected first line {line:?}"))
        .to_owned();
    (child, url)
}

/// The example policy plus the remote agent's profile: no tools, evidence under
/// `a2a://`.
fn policy() -> String {
    let text = std::fs::read_to_string(repo_root().join("examples/payment-incident/policy.yaml"))
        .expect("the example policy exists");
    let mut file = PolicyFile::parse(&text, Some("yaml"), "example policy").expect("it parses");
    file.profiles.push(ProfileEntry {
        id: HISTORY.to_owned(),
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
    // Its workers register it as the worker pool.
    file.principals
        .iter_mut()
        .find(|p| p.id == "worker-pool")
        .expect("the example has the worker pool")
        .profiles
        .push(HISTORY.to_owned());
    serde_yaml::to_string(&file).expect("the policy serializes")
}

/// The a2a worker's profiles: the incident-history agent at `url`.
fn profiles(url: &str, credential: &Path) -> String {
    format!(
        r#"profiles:
  - id: {HISTORY}
    version: "1.0.0"
    description: The incident-history agent, over A2A.
    instructions: Find the past incident most like this one.
    provider: a2a
    url: {url}
    credential_file: {}
    capabilities:
      - {{ action: "evidence:*", resource: "evidence" }}
    evidence_prefixes: ["a2a://"]
"#,
        credential.display()
    )
}

/// The a2a worker's configuration over `mesh`: `profiles`, and the `a2a` section.
fn worker_config(
    mesh: &TestMesh,
    name: &str,
    profiles: &str,
    a2a: convene_worker::a2a::A2aSettings,
) -> convene_worker::Config {
    convene_worker::Config {
        server: ServerSettings {
            request_timeout: None,
            ..ServerSettings::default()
        },
        worker_id: name.to_owned(),
        profiles_file: Some(mesh.write_profiles(name, profiles)),
        tools_data_dir: example_data(),
        supervisor_endpoint: mesh.supervisor_endpoint.clone(),
        // The mesh serves every service on one address, the registry included.
        registry_endpoints: vec![mesh.supervisor_endpoint.clone()],
        policy_endpoint: mesh.policy_endpoint.clone(),
        evidence_endpoint: mesh.evidence_endpoint.clone(),
        data_dir: mesh.data_dir(),
        a2a,
        ..convene_worker::Config::default()
    }
}

fn spec(key: &str, profile: &str) -> v1::RunSpec {
    spec_from_yaml(&format!(
        r#"
goal: Find the past incident most like the payment success-rate drop.
idempotency_key: {key}
delegations:
  - name: history
    profile_id: {profile}
    goal: Find the past incident most like the payment success-rate drop, and its cause.
    acceptance_criteria: ["Name the incident and its cause"]
    scope:
      resources: ["service/payment-api"]
      time_range: {{ start: "2026-07-23T01:45:00Z", end: "2026-07-23T02:10:00Z" }}
    timeout: 20s
join:
  join_id: join-a2a
  strategy: JOIN_STRATEGY_ALL
  required: ["history"]
  timeout: 25s
  on_timeout: ON_TIMEOUT_EMIT_PARTIAL
limits:
  max_depth: 1
  max_parallel_workers: 2
  overflow: OVERFLOW_POLICY_QUEUE
  timeout: 30s
"#
    ))
}

fn only_result(run: &v1::Run) -> &v1::TaskResult {
    assert_eq!(run.delegations.len(), 1, "{run:#?}");
    run.delegations[0]
        .result
        .as_ref()
        .unwrap_or_else(|| panic!("the delegation has a result: {run:#?}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_specialist_served_by_a_remote_a2a_agent_completes_a_run_with_verified_evidence() {
    let Some(python) = python() else { return };
    let (_agent, agent_url) = start_agent(&python).await;

    let mesh = TestMesh::start(
        Mode::InProcess,
        MeshOptions {
            policy: Some(policy()),
            ..MeshOptions::default()
        },
    )
    .await;
    let secrets = tempfile::tempdir().expect("a temporary directory");
    let credential = secrets.path().join("history.token");
    std::fs::write(&credential, format!("{BEARER}\n")).expect("credential written");
    let config = worker_config(
        &mesh,
        "a2a-worker-1",
        &profiles(&agent_url, &credential),
        convene_worker::a2a::A2aSettings {
            allow: vec![agent_url.clone()],
            // The agent listens on loopback: that one address, nothing else private.
            allow_private: vec!["127.0.0.1/32".to_owned()],
        },
    );
    let shutdown = Shutdown::new();
    let worker = tokio::spawn(convene_worker::run(config, shutdown.clone()));

    // The run completes on the agent's answer.
    let run_id = mesh
        .start_run_id(ONCALL, spec("a2a-remote-1", HISTORY))
        .await;
    let run = mesh.wait_terminal(ONCALL, &run_id, LIMIT).await;
    assert_eq!(run.state, v1::RunState::Succeeded as i32, "{run:#?}");
    let decision = run.decision.as_ref().expect("a decision");
    assert_eq!(decision.accepted.len(), 1, "{decision:#?}");
    let result = only_result(&run);
    assert_eq!(
        result.status,
        v1::TaskStatus::Completed as i32,
        "{result:#?}"
    );
    assert_eq!(result.profile_id, HISTORY);
    assert_eq!(result.worker_id, "a2a-worker-1");
    assert_eq!(result.evidence.len(), 2, "a text and a data artifact");
    let values: Vec<&str> = result.claims.iter().map(|c| c.value.as_str()).collect();
    assert!(values.contains(&"INC-20260611-0140"), "{values:?}");
    assert!(values.contains(&"connection_pool_exhaustion"), "{values:?}");
    let port = agent_url.rsplit(':').next().expect("a port");
    for c in &result.claims {
        assert_eq!(c.evidence_refs.len(), 1, "{c:?}");
        assert!(
            c.evidence_refs[0].starts_with(&format!("a2a://127.0.0.1:{port}/{run_id}/")),
            "{c:?}"
        );
    }

    // Every claim's evidence chain verifies, artifacts re-hashed.
    let chain = mesh
        .evidence()
        .verify_chain(request(
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
            &mesh.credential(ONCALL),
        ))
        .await
        .expect("VerifyChain")
        .into_inner();
    assert!(chain.intact, "{:#?}", chain.links);

    // The credential reached the agent (it refuses calls without it) and nothing else.
    let events = mesh.run_events(ONCALL, &run_id).await;
    assert!(
        !format!("{run:?}").contains(BEARER),
        "the credential leaked into the run"
    );
    assert!(
        !format!("{events:?}").contains(BEARER),
        "the credential leaked into an event"
    );
    for e in &result.evidence {
        let content = mesh
            .evidence()
            .get_artifact(request(
                v1::GetArtifactRequest {
                    uri: e.artifact_uri.clone(),
                },
                &mesh.credential(ONCALL),
            ))
            .await
            .expect("GetArtifact")
            .into_inner()
            .content;
        let text = String::from_utf8(content).expect("JSON");
        assert!(!text.contains(BEARER), "the credential was stored: {text}");
        assert!(
            text.contains(&agent_url),
            "the artifact names its agent: {text}"
        );
    }

    // A worker whose profile names an agent its configuration does not allow does not
    // start: not on the allowlist, or on it at a loopback address allow_private does not
    // list. The test owns that agent's port: nothing connects to it.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("a free port");
    listener.set_nonblocking(true).expect("non-blocking");
    let elsewhere = format!("http://127.0.0.1:{}", listener.local_addr().unwrap().port());
    for (n, allow, why) in [
        (
            1,
            vec![agent_url.clone()],
            "not on the worker's A2A allowlist",
        ),
        (2, vec![elsewhere.clone()], "a loopback address"),
    ] {
        let refused = worker_config(
            &mesh,
            &format!("a2a-worker-refused-{n}"),
            &profiles(&elsewhere, &credential),
            convene_worker::a2a::A2aSettings {
                allow,
                allow_private: Vec::new(),
            },
        );
        let err = convene_worker::run(refused, Shutdown::new())
            .await
            .expect_err("the worker refuses the profile")
            .to_string();
        assert!(err.contains(&elsewhere), "{err}");
        assert!(err.contains(why), "{err}");
        assert!(err.contains("a2a.allow"), "{err}");
    }
    match listener.accept() {
        Err(e) if e.kind() == ErrorKind::WouldBlock => {}
        other => panic!("something connected to the refused agent's port: {other:?}"),
    }

    shutdown.trigger();
    worker
        .await
        .expect("the worker task ends")
        .expect("the worker stops cleanly");
}
