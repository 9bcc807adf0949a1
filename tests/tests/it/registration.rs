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

/// The workers a run's delegations went to, once it stopped.
async fn workers_of_a_run(mesh: &TestMesh) -> Vec<String> {
    let mut spec = example_spec();
    // A new run each time, not the one the example's idempotency key names.
    spec.idempotency_key.clear();
    let run_id = mesh.start_run_id(ONCALL, spec).await;
    let run = mesh
        .wait_terminal(ONCALL, &run_id, Duration::from_secs(60))
        .await;
    // A result from each: had a worker's endpoint been replaced, its dispatches would
    // have failed.
    for d in &run.delegations {
        assert_eq!(
            d.state,
            v1::DelegationState::Completed as i32,
            "delegation {d:?} has no result"
        );
    }
    let workers: Vec<String> = run
        .delegations
        .iter()
        .map(|d| d.worker_id.clone())
        .collect();
    assert!(
        !workers.is_empty() && workers.iter().all(|w| w.starts_with("local-worker-")),
        "every delegation ran on the mesh's own workers: {workers:?}"
    );
    workers
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
    // The mesh's one worker (`convene up` numbers its workers across the process).
    let before = workers_of_a_run(&mesh).await;
    let victim = before[0].as_str();
    assert!(before.iter().all(|w| w == victim), "one worker: {before:?}");
    let rogue = mesh.credential(ROGUE);
    let mut registry = WorkerRegistryClient::connect(mesh.supervisor_endpoint.clone())
        .await
        .expect("the supervisor's registry is reachable");
    // A port nothing listens on: had the takeover worked, dispatches would fail there.
    let hijack = "http://127.0.0.1:9";

    assert_taken(
        registry
            .register(request(
                registration(victim, hijack, &["logs-investigator"]),
                &rogue,
            ))
            .await,
        victim,
    );
    assert_taken(
        registry
            .heartbeat(request(
                v1::HeartbeatRequest {
                    worker_id: victim.to_owned(),
                    in_flight: 0,
                },
                &rogue,
            ))
            .await,
        victim,
    );
    assert_taken(
        registry
            .deregister(request(
                v1::DeregisterRequest {
                    worker_id: victim.to_owned(),
                },
                &rogue,
            ))
            .await,
        victim,
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

    // A run started after the attempts: every delegation went to the same worker.
    let after = workers_of_a_run(&mesh).await;
    assert!(
        after.iter().all(|w| w == victim),
        "the attacked worker still receives the work: {after:?}"
    );
}
