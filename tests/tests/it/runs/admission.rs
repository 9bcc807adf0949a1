//! What a run may start and who sees it: width past `max_parallel_workers` under each
//! overflow mode, one run for fifty racing StartRuns with one key, tenants kept apart,
//! cancellation, and a run PENDING until a worker takes its first delegation.

use std::collections::BTreeSet;
use std::time::Duration;

use crate::harness::{MeshOptions, Mode, TestMesh, Workers, example_spec, wait_until};
use convene_mesh::auth::request;
use convene_proto::v1::{self, run_event::Kind};

use super::{LIMIT, ONCALL, held_profiles, listed_runs, one_group, profiles_with_faults};

fn wide_spec(overflow: v1::OverflowPolicy) -> v1::RunSpec {
    let mut spec = example_spec();
    spec.idempotency_key.clear();
    let logs = spec.delegations[0].clone();
    spec.delegations = (1..=6)
        .map(|i| v1::PlannedDelegation {
            name: format!("l{i}"),
            ..logs.clone()
        })
        .collect();
    let join = spec.join.as_mut().expect("join");
    join.required.clear();
    join.optional.clear();
    join.strategy = v1::JoinStrategy::All as i32;
    join.minimum = Some(v1::JoinMinimum {
        count: 1,
        ..Default::default()
    });
    let limits = spec.limits.as_mut().expect("limits");
    limits.max_parallel_workers = 2;
    limits.overflow = overflow as i32;
    spec
}

async fn width_limits(mode: Mode) {
    let mesh = TestMesh::start(
        mode,
        one_group(profiles_with_faults(&[(
            "logs-investigator",
            "{ delay: 150ms }",
        )])),
    )
    .await;

    // QUEUE: all six run, never more than two at once.
    let run_id = mesh
        .start_run_id(ONCALL, wide_spec(v1::OverflowPolicy::Queue))
        .await;
    let run = mesh.wait_terminal(ONCALL, &run_id, LIMIT).await;
    assert_eq!(
        run.decision.as_ref().expect("decision").accepted.len(),
        6,
        "{run:#?}"
    );
    let mut in_flight = 0i32;
    let mut peak = 0;
    for e in mesh.run_events(ONCALL, &run_id).await {
        match e.kind {
            Some(Kind::Dispatched(_)) => in_flight += 1,
            Some(Kind::Completed(_)) => in_flight -= 1,
            _ => {}
        }
        peak = peak.max(in_flight);
    }
    assert_eq!(
        peak, 2,
        "QUEUE keeps at most max_parallel_workers in flight"
    );

    // TRUNCATE: exactly the last four are dropped and recorded.
    let run_id = mesh
        .start_run_id(ONCALL, wide_spec(v1::OverflowPolicy::Truncate))
        .await;
    let run = mesh.wait_terminal(ONCALL, &run_id, LIMIT).await;
    assert_eq!(run.truncated, ["l3", "l4", "l5", "l6"]);
    let states: Vec<i32> = run.delegations.iter().map(|d| d.state).collect();
    assert_eq!(&states[..2], &[v1::DelegationState::Completed as i32; 2]);
    assert_eq!(&states[2..], &[v1::DelegationState::Dropped as i32; 4]);
    assert_eq!(run.decision.as_ref().expect("decision").accepted.len(), 2);

    // REJECT: the run is refused as a whole, saying why.
    let started = mesh
        .start_run(ONCALL, wide_spec(v1::OverflowPolicy::Reject))
        .await
        .expect("StartRun");
    let run = started.run.expect("run");
    assert_eq!(run.state, v1::RunState::Rejected as i32);
    assert!(
        run.terminal_reason.contains("max_parallel_workers 2"),
        "{}",
        run.terminal_reason
    );
    assert!(
        run.delegations
            .iter()
            .all(|d| d.result.is_none() && d.attempts == 0)
    );
}

async fn fifty_racing_start_runs(mode: Mode) {
    let mesh = TestMesh::start(mode, MeshOptions::default()).await;
    let mut spec = example_spec();
    spec.idempotency_key = "same-key-for-everyone".to_owned();
    let calls = (0..50).map(|_| {
        let spec = spec.clone();
        let mesh = &mesh;
        async move { mesh.start_run(ONCALL, spec).await.expect("StartRun") }
    });
    let answers = futures::future::join_all(calls).await;
    let ids: BTreeSet<String> = answers
        .iter()
        .map(|a| a.run.clone().expect("run").run_id)
        .collect();
    assert_eq!(ids.len(), 1, "{ids:?}");
    assert_eq!(answers.iter().filter(|a| a.created).count(), 1);
    // A different spec under the same key is refused, naming the key.
    spec.goal.push_str(" (changed)");
    let err = mesh
        .start_run(ONCALL, spec)
        .await
        .expect_err("a different spec under a used key");
    assert_eq!(err.code(), tonic::Code::AlreadyExists);
    assert!(
        err.message().contains("same-key-for-everyone"),
        "{}",
        err.message()
    );
    assert_eq!(listed_runs(&mesh).await.len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenants_never_see_each_others_runs() {
    let mesh = TestMesh::start(Mode::InProcess, MeshOptions::default()).await;
    let run_id = mesh.start_run_id(ONCALL, example_spec()).await;
    let err = mesh
        .supervisor()
        .get_run(request(
            v1::GetRunRequest {
                run_id: run_id.clone(),
            },
            &mesh.credential("analyst@globex"),
        ))
        .await
        .expect_err("another tenant's run");
    assert_eq!(err.code(), tonic::Code::NotFound);
    // Watching checks the tenant too, and says the same of a run that does not exist.
    for (id, who) in [
        (&run_id, "analyst@globex"),
        (&"no-such-run".to_owned(), ONCALL),
    ] {
        let err = mesh
            .supervisor()
            .watch_run(request(
                v1::WatchRunRequest {
                    run_id: id.clone(),
                    after_sequence: 0,
                },
                &mesh.credential(who),
            ))
            .await
            .err()
            .unwrap_or_else(|| panic!("{who} watched run {id}"));
        assert_eq!(err.code(), tonic::Code::NotFound, "{}", err.message());
        assert_eq!(err.message(), format!("run {id} not found"));
    }
    let listed = mesh
        .supervisor()
        .list_runs(request(
            v1::ListRunsRequest::default(),
            &mesh.credential("analyst@globex"),
        ))
        .await
        .expect("ListRuns")
        .into_inner();
    assert!(listed.runs.is_empty());
    // Bad input: a clear error naming the field, and nothing stored.
    let mut bad = example_spec();
    bad.delegations[1].profile_id = "no-such-profile".to_owned();
    let err = mesh
        .start_run(ONCALL, bad)
        .await
        .expect_err("unknown profile");
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
    assert!(
        err.message().contains("spec.delegations[1].profile_id"),
        "{}",
        err.message()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_stops_in_flight_delegations_and_nothing_reopens_the_run() {
    let mesh = TestMesh::start(
        Mode::InProcess,
        one_group(profiles_with_faults(&[(
            "metrics-investigator",
            "{ hang: true }",
        )])),
    )
    .await;
    let run_id = mesh.start_run_id(ONCALL, example_spec()).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    let cancelled = mesh
        .supervisor()
        .cancel_run(request(
            v1::CancelRunRequest {
                run_id: run_id.clone(),
                reason: "test".to_owned(),
            },
            &mesh.credential(ONCALL),
        ))
        .await
        .expect("CancelRun")
        .into_inner()
        .run
        .expect("run");
    assert_eq!(cancelled.state, v1::RunState::Cancelled as i32);
    assert!(cancelled.terminal_reason.contains("test"));
    tokio::time::sleep(Duration::from_millis(500)).await;
    let run = mesh.get_run(ONCALL, &run_id).await;
    assert_eq!(run.state, v1::RunState::Cancelled as i32);
    assert!(
        run.decision.is_none(),
        "a cancelled run is not decided afterwards"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn width_past_max_parallel_workers_follows_the_overflow_mode_in_one_process() {
    width_limits(Mode::InProcess).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn width_past_max_parallel_workers_follows_the_overflow_mode_as_processes() {
    width_limits(Mode::Processes).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_concurrent_start_runs_with_one_key_make_one_run_in_one_process() {
    fifty_racing_start_runs(Mode::InProcess).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_concurrent_start_runs_with_one_key_make_one_run_as_processes() {
    fifty_racing_start_runs(Mode::Processes).await;
}

/// A run is PENDING until a worker takes one of its delegations, and turns RUNNING with
/// its first dispatch: run B waits, undispatched, while run A's held delegations fill
/// every worker slot, and runs once they are released.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_stays_pending_until_a_worker_takes_its_first_delegation() {
    let dir = tempfile::tempdir().unwrap();
    let release = dir.path().join("release");
    let held = held_profiles(&release, None);
    assert_eq!(held.matches("hold:").count(), 3);
    // One worker with a slot for each of A's three delegations, and none more.
    let mesh = TestMesh::start(
        Mode::InProcess,
        MeshOptions {
            workers: vec![Workers {
                profiles: Some(held),
                count: 1,
                capacity: 3,
            }],
            ..MeshOptions::default()
        },
    )
    .await;
    let start = || async {
        let mut spec = example_spec();
        spec.idempotency_key.clear();
        mesh.start_run_id(ONCALL, spec).await
    };
    let a = start().await;
    wait_until("run A to be RUNNING", LIMIT, async || {
        let run = mesh.get_run(ONCALL, &a).await;
        if run.state == v1::RunState::Running as i32 {
            return true;
        }
        assert_eq!(run.state, v1::RunState::Pending as i32, "{run:#?}");
        false
    })
    .await;

    let b = start().await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let waiting = mesh.get_run(ONCALL, &b).await;
    assert_eq!(waiting.state, v1::RunState::Pending as i32, "{waiting:#?}");
    assert!(
        waiting
            .delegations
            .iter()
            .all(|d| d.state == v1::DelegationState::Pending as i32 && d.worker_id.is_empty()),
        "{waiting:#?}"
    );
    let dispatched = |events: &[v1::RunEvent]| {
        events
            .iter()
            .filter(|e| matches!(e.kind, Some(Kind::Dispatched(_))))
            .count()
    };

    std::fs::write(&release, b"").unwrap();
    let a = mesh.wait_terminal(ONCALL, &a, LIMIT).await;
    let b = mesh.wait_terminal(ONCALL, &b, LIMIT).await;
    assert_eq!(b.state, a.state, "{b:#?}");
    assert_eq!(b.outcome, a.outcome, "{b:#?}");
    assert_eq!(dispatched(&mesh.run_events(ONCALL, &b.run_id).await), 3);
}
