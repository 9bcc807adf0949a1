//! The `convene-worker` binary, black-box: its configuration output, its startup
//! errors, and a worker process killed mid-task by fault injection.

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use crate::support::{Mesh, RUN_ID, example_data, task};
use convene_mesh::auth;
use convene_proto::v1::{self, worker_client::WorkerClient};
use convene_server::test_util::{pick_listener, wait_ready};
use convene_worker::profiles::{EXAMPLE_PROFILES, ProfilesFile};

const BIN: &str = env!("CARGO_BIN_EXE_convene-worker");

/// Kills the child when dropped, so a failing test leaves no process behind.
struct Running(Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn dump_config_prints_the_effective_configuration() {
    let out = Command::new(BIN)
        .env_clear()
        .env("CONVENE_DATA_DIR", "/var/lib/convene")
        .args([
            "--dump-config=yaml",
            "--capacity",
            "3",
            "--worker-id",
            "w-7",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    // Every key, the unset ones as comments.
    for unset in [
        "# advertise:",
        "# profiles_file:",
        "# model:",
        "# credential_file:",
    ] {
        assert!(
            text.lines().any(|l| l == unset),
            "no {unset:?} line in:\n{text}"
        );
    }
    let config: convene_worker::Config = serde_yaml::from_str(&text).unwrap();
    assert_eq!(config.server.listen.port(), 7410);
    assert_eq!(
        config.server.request_timeout,
        Some(Duration::from_secs(900))
    );
    assert_eq!(config.capacity, 3);
    assert_eq!(config.worker_id, "w-7");
    assert_eq!(
        config.data_dir,
        std::path::PathBuf::from("/var/lib/convene")
    );
}

#[test]
fn a_missing_tool_data_directory_is_a_clear_startup_error() {
    let out = Command::new(BIN)
        .env_clear()
        .args([
            "--tools-data",
            "/nonexistent/convene-tool-data",
            "--no-register",
            "--listen",
            "127.0.0.1:0",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(
            "no --config given: using the development settings of the payment-incident example"
        ),
        "{stderr}"
    );
    assert!(
        stderr.contains(
            "tool data directory /nonexistent/convene-tool-data not found; pass --tools-data DIR"
        ),
        "{stderr}"
    );
}

#[tokio::test]
async fn a_worker_killed_mid_task_exits_after_storing_its_evidence() {
    let mesh = Mesh::start().await;
    let mut file: ProfilesFile = serde_yaml::from_str(EXAMPLE_PROFILES).unwrap();
    let logs = file
        .profiles
        .iter_mut()
        .find(|p| p.id == "logs-investigator")
        .unwrap();
    logs.faults.exit_process_after_tools = true;
    let task = task(
        "del-logs-killed",
        "logs-investigator",
        Duration::from_secs(30),
    );
    let token = mesh.token_for(&task, &[]).await;
    dies_after_tools(&mesh, &file, &task, &token).await;

    // What it read before dying is in the evidence store, under the ids a retry would
    // record again.
    let stored = mesh
        .evidence_handle()
        .get_evidence(auth::request(
            v1::GetEvidenceRequest {
                evidence_ids: vec![
                    format!("logs://payment-api/{RUN_ID}/del-logs-killed/pool_exhaustion"),
                    format!("logs://payment-api/{RUN_ID}/del-logs-killed/confirm_outcomes"),
                ],
            },
            &token,
        ))
        .await
        .unwrap()
        .into_inner();
    assert!(stored.missing.is_empty(), "{stored:?}");
    assert_eq!(stored.evidence.len(), 2);
}

#[tokio::test]
async fn a_worker_killed_mid_conversation_leaves_an_intact_chain_and_the_retry_starts_its_own() {
    use convene_worker::agent::turns::{turn_evidence_id, walk};
    use convene_worker::model_server::{Recorded, Reply, ScriptedModel};

    let search = serde_json::json!({"service": "payment-api",
                                    "match": {"error": "POOL_EXHAUSTED"}})
    .to_string();
    // Request 0: the killed worker's first turn; 1 and 2: the retry's two turns.
    let model = ScriptedModel::start(move |r: &Recorded| {
        if r.index < 2 {
            return Reply::tool_calls(vec![("call_pool", "search_logs_v1", search.clone())]);
        }
        let outcome: serde_json::Value =
            serde_json::from_str(&r.last_tool_results()[0].content).unwrap();
        let args = serde_json::json!({"summary": "pool exhaustion", "claims": [{
            "claim_id": "claim-cause", "topic": "primary_cause",
            "value": "connection_pool_exhaustion", "statement": "POOL_EXHAUSTED errors",
            "evidence_refs": [outcome["evidence_id"]], "confidence": 0.8}]});
        Reply::tool_calls(vec![("call_report", "submit_report", args.to_string())])
    })
    .unwrap();
    let mesh = Mesh::start().await;
    let mut file: ProfilesFile = serde_yaml::from_str(EXAMPLE_PROFILES).unwrap();
    let logs = file
        .profiles
        .iter_mut()
        .find(|p| p.id == "logs-investigator-model")
        .unwrap();
    logs.base_url = Some(model.base_url());
    logs.model = "scripted-model".into();
    logs.faults.exit_process_after_tools = true;
    let task = task(
        "del-model-killed",
        "logs-investigator-model",
        Duration::from_secs(30),
    );
    let token = mesh.token_for(&task, &[]).await;
    dies_after_tools(&mesh, &file, &task, &token).await;

    // The retry, on a healthy worker, as the supervisor would send it.
    let mut profiles = convene_worker::profiles::example().unwrap();
    let healthy = profiles
        .iter_mut()
        .find(|p| p.profile.id == "logs-investigator-model")
        .unwrap();
    healthy.connection.base_url = Some(model.base_url());
    healthy.profile.model = "scripted-model".into();
    let worker = mesh
        .worker_with_models(profiles, 4, Default::default())
        .await;
    let result = worker.execute(&task, &token, 2).await.unwrap();
    assert_eq!(
        v1::TaskStatus::try_from(result.status).unwrap(),
        v1::TaskStatus::Completed,
        "{result:#?}"
    );

    // Each attempt's turns are a chain of their own: the first ends at the turn the
    // worker died after, intact; the second starts anew.
    let chain_of = async |attempt: u32, turns: u32| {
        let ids: Vec<String> = (1..=turns)
            .map(|n| turn_evidence_id(RUN_ID, "del-model-killed", attempt, n))
            .collect();
        mesh.stored_turns(&token, &ids).await
    };
    let first = chain_of(1, 2).await;
    assert_eq!(first.len(), 1, "the killed attempt stored its one turn");
    assert_eq!(walk(&first).expect("intact").turns, 1);
    let second = chain_of(2, 2).await;
    assert_eq!(second.len(), 2);
    let conversation = walk(&second).expect("intact");
    assert_eq!(conversation.turns, 2);
    let opening: serde_json::Value = serde_json::from_slice(&second[0].bytes).unwrap();
    assert!(
        opening["previous"].is_null(),
        "the retry's chain starts anew"
    );
    assert_eq!(model.request_count(), 3);
}

/// Runs `task` (attempt 1) on a worker process serving `profiles`, one of which has the
/// `exit_process_after_tools` fault: the call gets no result, and the process exits
/// with the fault's status once its first tool calls are done.
async fn dies_after_tools(
    mesh: &Mesh,
    profiles: &ProfilesFile,
    task: &v1::DelegationTask,
    token: &str,
) {
    let profiles_path = mesh.dir.path().join("profiles-with-fault.yaml");
    std::fs::write(&profiles_path, serde_yaml::to_string(profiles).unwrap()).unwrap();
    let free = pick_listener().await;
    let addr = free.local_addr().unwrap();
    drop(free);
    let policy = convene_server::test_util::endpoint(mesh.policy_server.addr);
    let evidence = convene_server::test_util::endpoint(mesh.evidence_server.addr);
    let mut child = Running(
        Command::new(BIN)
            .env_clear()
            .args(["--listen", &addr.to_string(), "--no-register"])
            .args(["--policy", &policy, "--evidence", &evidence])
            .arg("--tools-data")
            .arg(example_data())
            .arg("--profiles")
            .arg(&profiles_path)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    wait_ready(addr).await;
    let mut client = WorkerClient::new(convene_server::test_util::connect(addr).await);
    let answer = client
        .execute(auth::request(
            v1::WorkerExecuteRequest {
                lease_valid_until: None,
                task: Some(task.clone()),
                task_token: token.to_owned(),
                attempt: 1,
            },
            &mesh.supervisor,
        ))
        .await;
    assert!(
        answer.is_err(),
        "a dead worker returns no result: {answer:?}"
    );
    let status = tokio::task::spawn_blocking(move || child.0.wait())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(status.code(), Some(86), "the fault's exit status");
}
