//! Worker registration from the attacker's side, over real gRPC on loopback: another
//! principal holding `workers:register` cannot re-register, heartbeat or deregister a
//! live worker it did not register, nor claim a profile its `profiles` in the policy
//! file do not allow; and through all of it, runs keep dispatching to the legitimate
//! workers.

use std::time::Duration;

use convene_mesh::auth::request;
use convene_proto::v1::{self, worker_registry_client::WorkerRegistryClient};
use tonic::Code;

use crate::harness::{MeshOptions, Mode, TestMesh, example_spec, repo_root};

const ONCALL: &str = "oncall@acme";

/// A second worker principal, allowed only the logs investigator.
const ROGUE: &str = "rogue-pool";

/// The legitimate in-process worker `convene up` starts first.
const VICTIM: &str = "local-worker-1";

/// The example policy with [`ROGUE`] beside the worker pool.
fn policy() -> String {
    let text = std::fs::read_to_string(repo_root().join("examples/payment-incident/policy.yaml"))
        .expect("the example policy");
    let anchor = "principals:\n";
    assert!(text.contains(anchor), "the example policy lists principals");
    text.replacen(
        anchor,
        &format!(
            "{anchor}  - id: {ROGUE}\n    tenant: system\n    kind: service\n    \
             roles: [workers:register]\n    profiles: [logs-investigator]\n"
        ),
        1,
    )
}

fn registration(worker_id: &str, endpoint: &str, profiles: &[&str]) -> v1::RegisterRequest {
    v1::RegisterRequest {
        worker_id: worker_id.to_owned(),
        endpoint: endpoint.to_owned(),
        profiles: profiles
            .iter()
            .map(|id| v1::WorkerProfile {
                id: (*id).to_owned(),
                ..Default::default()
            })
            .collect(),
        capacity: 8,
    }
}

/// Asserts a refusal because `worker_id` belongs to another identity.
fn assert_taken<T: std::fmt::Debug>(refused: Result<T, tonic::Status>, worker_id: &str) {
    let status = refused.expect_err("another identity's live worker id is refused");
    assert_eq!(status.code(), Code::PermissionDenied, "{status:?}");
    assert!(
        status.message().contains(&format!("worker {worker_id}"))
            && status.message().contains("belongs to another identity"),
        "the refusal names the worker id and says whose it is not: {}",
        status.message()
    );
}

#[tokio::test]
async fn another_identity_cannot_take_a_live_worker_and_runs_keep_their_workers() {
    let mesh = TestMesh::start(
        Mode::InProcess,
        MeshOptions {
            policy: Some(policy()),
            ..MeshOptions::default()
        },
    )
    .await;
    let rogue = mesh.credential(ROGUE);
    let mut registry = WorkerRegistryClient::connect(mesh.supervisor_endpoint.clone())
        .await
        .expect("the supervisor's registry is reachable");
    // A port nothing listens on: had the takeover worked, dispatches would fail there.
    let hijack = "http://127.0.0.1:9";

    assert_taken(
        registry
            .register(request(
                registration(VICTIM, hijack, &["logs-investigator"]),
                &rogue,
            ))
            .await,
        VICTIM,
    );
    assert_taken(
        registry
            .heartbeat(request(
                v1::HeartbeatRequest {
                    worker_id: VICTIM.to_owned(),
                    in_flight: 0,
                },
                &rogue,
            ))
            .await,
        VICTIM,
    );
    assert_taken(
        registry
            .deregister(request(
                v1::DeregisterRequest {
                    worker_id: VICTIM.to_owned(),
                },
                &rogue,
            ))
            .await,
        VICTIM,
    );
    // A worker id of its own, claiming a profile its principal lacks: refused whole.
    let refused = registry
        .register(request(
            registration("rogue-1", hijack, &["logs-investigator", "change-auditor"]),
            &rogue,
        ))
        .await
        .expect_err("a profile the principal lacks is refused");
    assert_eq!(refused.code(), Code::PermissionDenied, "{refused:?}");
    assert!(
        refused.message().contains("profile change-auditor")
            && refused.message().contains(&format!("principal {ROGUE}"))
            && refused.message().contains("`profiles`"),
        "the refusal names the profile and the policy key to add it to: {}",
        refused.message()
    );

    // A run started after the attempts: every delegation went to a legitimate worker.
    let run_id = mesh.start_run_id(ONCALL, example_spec()).await;
    let run = mesh
        .wait_terminal(ONCALL, &run_id, Duration::from_secs(60))
        .await;
    let workers: Vec<&str> = run
        .delegations
        .iter()
        .map(|d| d.worker_id.as_str())
        .collect();
    assert!(
        !workers.is_empty() && workers.iter().all(|w| w.starts_with("local-worker-")),
        "every delegation ran on the mesh's own workers: {workers:?} (run {:?})",
        v1::RunState::try_from(run.state)
    );
    assert!(
        workers.contains(&VICTIM),
        "the attacked worker still receives work: {workers:?}"
    );
}
