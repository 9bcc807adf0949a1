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
    let profiles_path = mesh.dir.path().join("profiles-with-fault.yaml");
    std::fs::write(&profiles_path, serde_yaml::to_string(&file).unwrap()).unwrap();

    let free = pick_listener().await;
    let addr = free.local_addr().unwrap();
    drop(free);
    let policy = convene_server::test_util::endpoint(mesh.policy_server.addr);
    let evidence = convene_server::test_util::endpoint(mesh.evidence_server.addr);
    let mut child = Running(
        Command::new(BIN)
            .env_clear()
            .args([
                "--listen",
                &addr.to_string(),
                "--no-register",
                "--policy",
                &policy,
            ])
            .args(["--evidence", &evidence])
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

    let task = task(
        "del-logs-killed",
        "logs-investigator",
        Duration::from_secs(30),
    );
    let token = mesh.token_for(&task, &[]).await;
    let mut client = WorkerClient::new(convene_server::test_util::connect(addr).await);
    let answer = client
        .execute(convene_mesh::auth::request(
            v1::WorkerExecuteRequest {
                task: Some(task.clone()),
                task_token: token.clone(),
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
