//! A supervisor replica that lost its run, from the worker's side: the replica that took
//! the run over dispatches under a newer lease epoch, and from then on nothing of the old
//! one runs. Its running task is cancelled, its dispatches are refused (by this worker,
//! which saw the newer epoch, and by a worker that did not, through the policy service's
//! fence), its tool calls are refused, and a dispatch it sends after its lease may have
//! run out is refused however it is signed.

use std::time::{Duration, SystemTime};

use convene_core::time::to_timestamp;
use convene_proto::v1;
use convene_worker::models::ModelSettings;
use convene_worker::profiles;
use tonic::Code;

use crate::support::{Mesh, profiles_with, status, task, wait_until};

const PROFILE: &str = "logs-investigator";

#[tokio::test]
async fn the_replica_that_lost_a_run_gets_nothing_more_run_for_it() {
    let mesh = Mesh::start().await;
    // Slow enough that the old replica's task is still running when the new one's
    // dispatch arrives.
    let profiles = profiles_with(PROFILE, |p| p.faults.delay = Some(Duration::from_secs(2)));
    let worker = mesh.worker(profiles, 4).await;
    let task = task("del-fenced-1", PROFILE, Duration::from_secs(60));
    let old = mesh.token_under(&task, &[], (0, 1)).await;

    // Epoch 1: the replica that created the run dispatches; the task runs (slowly).
    let running = worker.execute_in_background(&task, &old);
    wait_until(
        "the epoch-1 task in flight",
        || worker.service.in_flight(),
        |n| *n > 0,
    )
    .await;

    // Another replica took the run over: its first tokens fence epoch 1, and its
    // dispatch of the same delegation cancels the old one here and runs anew.
    let new = mesh.token_under(&task, &[], (0, 2)).await;
    let result = worker.execute(&task, &new, 2).await.expect("epoch 2 runs");
    assert_eq!(status(&result), v1::TaskStatus::Completed, "{result:#?}");
    let cancelled = tokio::time::timeout(Duration::from_secs(5), running)
        .await
        .expect("the epoch-1 Execute returns")
        .unwrap()
        .expect("a result")
        .into_inner()
        .result
        .unwrap();
    assert_eq!(status(&cancelled), v1::TaskStatus::Failed, "{cancelled:#?}");
    let error = cancelled.error.unwrap();
    assert_eq!(error.code, "cancelled");
    assert!(error.message.contains("taken over"), "{}", error.message);

    // The old replica wakes and sends the delegation again: refused, nothing runs.
    let refused = worker.execute(&task, &old, 1).await.unwrap_err();
    assert_eq!(refused.code(), Code::Aborted, "{refused:?}");
    assert!(
        refused.message().contains("lease epoch 2") && refused.message().contains("epoch 1"),
        "{}",
        refused.message()
    );
    // Every tool call that ran was the new owner's.
    let decisions = mesh.decisions_for("del-fenced-1");
    assert!(!decisions.is_empty(), "the epoch-2 task called its tools");
    assert!(
        decisions
            .iter()
            .filter(|d| d.allowed)
            .all(|d| d.lease_epoch == 2),
        "{decisions:#?}"
    );

    // A worker that never saw epoch 2 learns the fence from the policy service.
    let other = mesh
        .worker_refreshing(
            profiles::example().unwrap(),
            4,
            ModelSettings::default(),
            Duration::from_millis(50),
        )
        .await;
    let other_task = self::task("del-fenced-1", PROFILE, Duration::from_secs(60));
    let refused = other.execute(&other_task, &old, 1).await.unwrap_err();
    assert_eq!(refused.code(), Code::Unauthenticated, "{refused:?}");
    assert!(
        refused.message().contains("Superseded"),
        "{}",
        refused.message()
    );
    assert_eq!(
        mesh.decisions_for("del-fenced-1").len(),
        decisions.len(),
        "nothing was authorized for the old replica"
    );
}

#[tokio::test]
async fn a_dispatch_that_arrives_after_its_replicas_lease_is_not_run() {
    let mesh = Mesh::start().await;
    let worker = mesh.worker(profiles::example().unwrap(), 4).await;
    let task = task("del-late-1", PROFILE, Duration::from_secs(60));
    let token = mesh.token_under(&task, &[], (0, 1)).await;
    let mut client = worker.client.clone();
    let request = |until: SystemTime| v1::WorkerExecuteRequest {
        task: Some(task.clone()),
        task_token: token.clone(),
        attempt: 1,
        lease_valid_until: Some(to_timestamp(until)),
    };
    // Sent before a pause, received after the lease ran out.
    let late = client
        .execute(request(SystemTime::now() - Duration::from_millis(1500)))
        .await
        .unwrap_err();
    assert_eq!(late.code(), Code::Aborted, "{late:?}");
    assert!(
        late.message()
            .contains("after the sending supervisor replica's lease"),
        "{}",
        late.message()
    );
    assert_eq!(worker.service.in_flight(), 0);
    assert!(mesh.decisions_for("del-late-1").is_empty(), "nothing ran");

    // In time: it runs.
    let result = client
        .execute(request(SystemTime::now() + Duration::from_secs(10)))
        .await
        .expect("a dispatch within the lease runs")
        .into_inner()
        .result
        .unwrap();
    assert_eq!(status(&result), v1::TaskStatus::Completed, "{result:#?}");
}
