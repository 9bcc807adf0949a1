//! A worker process that dies mid-task: the delegation completes on another worker under
//! the same delegation id.

use std::collections::BTreeMap;
use std::time::Duration;

use crate::harness::{
    MeshOptions, Mode, TestMesh, Workers, example_profiles, example_spec, wait_until,
};
use convene_proto::v1::{self, run_event::Kind};

const ONCALL: &str = "oncall@acme";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_killed_mid_task_is_replaced_under_the_same_delegation_ids() {
    // worker-1 exits as soon as its first tool calls are done, before answering: the
    // process is gone mid-task, its evidence half-written.
    let dying = example_profiles().replace(
        "    provider: playbook\n",
        "    provider: playbook\n    faults: { exit_process_after_tools: true }\n",
    );
    assert!(dying.matches("exit_process_after_tools").count() >= 3);
    let mut mesh = TestMesh::start(
        Mode::Processes,
        MeshOptions {
            workers: vec![Workers {
                profiles: Some(dying),
                count: 1,
                capacity: 16,
            }],
            ..MeshOptions::default()
        },
    )
    .await;
    let run_id = mesh.start_run_id(ONCALL, example_spec()).await;

    wait_until("worker-1 to die", Duration::from_secs(20), async || {
        mesh.exited("worker-1")
    })
    .await;
    // A healthy worker joins; the supervisor re-dispatches to it.
    let healthy = mesh.write_profiles("healthy", &example_profiles());
    mesh.spawn_worker("worker-2", &healthy, 16).await;

    let run = mesh
        .wait_terminal(ONCALL, &run_id, Duration::from_secs(30))
        .await;
    assert_eq!(
        run.outcome,
        v1::JoinOutcome::ConflictRequiresHuman as i32,
        "{run:#?}"
    );
    assert_eq!(run.decision.as_ref().expect("decision").accepted.len(), 3);
    for d in &run.delegations {
        assert_eq!(d.worker_id, "worker-2", "{d:#?}");
        assert!(d.attempts >= 2, "{d:#?}");
    }

    // Every dispatch of a delegation used the same id: first to worker-1, then to
    // worker-2; no delegation was created twice.
    let mut dispatches: BTreeMap<String, Vec<(String, u32)>> = BTreeMap::new();
    for e in mesh.run_events(ONCALL, &run_id).await {
        if let Some(Kind::Dispatched(d)) = e.kind {
            dispatches
                .entry(d.delegation_id)
                .or_default()
                .push((d.worker_id, d.attempt));
        }
    }
    let ids: Vec<String> = run
        .delegations
        .iter()
        .filter_map(|d| d.task.as_ref().map(|t| t.delegation_id.clone()))
        .collect();
    assert_eq!(dispatches.keys().cloned().collect::<Vec<_>>(), {
        let mut sorted = ids.clone();
        sorted.sort();
        sorted
    });
    for (id, attempts) in &dispatches {
        assert_eq!(
            attempts.first().map(|a| a.0.as_str()),
            Some("worker-1"),
            "{id}: {attempts:?}"
        );
        assert_eq!(
            attempts.last().map(|a| a.0.as_str()),
            Some("worker-2"),
            "{id}: {attempts:?}"
        );
    }
}
