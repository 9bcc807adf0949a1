//! The payment incident's R3 rollback after its conflict was settled: approved by two
//! people and executed, rejected, or left to expire. The run ends when its request is
//! settled, with the action's final state in `actions[]` and exactly one
//! `run.completed`.

use crate::harness::{MeshOptions, Mode, TestMesh};
use convene_mesh::auth::request;
use convene_proto::v1::{self, approval_server::Approval as _};

use super::{
    ALICE, BOB, ONCALL, approval, cloud_events, kinds, resume, settle_for_the_rule_change, vote,
    wait_state, waiting_incident,
};

/// Settles the example's conflict; the run then waits for its approval request only.
async fn settled(mesh: &TestMesh) -> (v1::Run, String) {
    let run = waiting_incident(mesh).await;
    let answer = resume(
        mesh,
        ONCALL,
        &run,
        settle_for_the_rule_change(&run),
        "the rule change went out two minutes before the errors began",
    )
    .await
    .expect("ResumeRun");
    assert_eq!(answer.outcome, v1::CommandOutcome::Applied as i32);
    let run = answer.run.expect("run");
    assert_eq!(
        run.state,
        v1::RunState::WaitingApproval as i32,
        "settled, it waits for its approval request: {run:#?}"
    );
    assert_eq!(run.actions.len(), 1, "{:#?}", run.actions);
    let action = &run.actions[0];
    assert_eq!(action.action, "rule:rollback");
    assert_eq!(action.state, v1::ActionState::Pending as i32);
    assert!(action.parameters_hash.starts_with("sha256:"));
    let id = action.approval_id.clone();
    (run, id)
}

async fn approved_and_executed(mode: Mode) {
    let mesh = TestMesh::start(mode, MeshOptions::default()).await;
    let (run, id) = settled(&mesh).await;
    vote(&mesh, ALICE, &id, v1::VoteDecision::Approve).await;
    vote(&mesh, BOB, &id, v1::VoteDecision::Approve).await;
    // Approved, not executed: the run still waits.
    let waiting = super::wait_for("the action to be approved", super::LIMIT, async || {
        let run = mesh.get_run(ONCALL, &run.run_id).await;
        if run.actions[0].state == v1::ActionState::Approved as i32 {
            Ok(run)
        } else {
            Err(run)
        }
    })
    .await;
    assert_eq!(waiting.state, v1::RunState::WaitingApproval as i32);
    let hash = approval(&mesh, &id).await.parameters_hash;
    let executed = mesh
        .approval()
        .execute(request(
            v1::ApprovalExecuteRequest {
                approval_id: id.clone(),
                parameters_hash: hash,
            },
            &mesh.credential(ALICE),
        ))
        .await
        .expect("Execute")
        .into_inner();
    assert!(executed.executed_now);

    let run = wait_state(&mesh, &run.run_id, v1::RunState::Succeeded).await;
    let action = &run.actions[0];
    assert_eq!(action.state, v1::ActionState::Executed as i32, "{run:#?}");
    assert_eq!(action.decided_by, [ALICE, BOB]);
    let execution = action.execution.as_ref().expect("the execution record");
    assert!(execution.success);
    assert_eq!(execution.executed_by, ALICE);
    assert!(run.ticket.is_none(), "an ended run has no ticket");

    // The run's story: it waited for input, resumed, waited for approval, resumed when
    // its request was settled, and ended once.
    let events = mesh.run_events(ONCALL, &run.run_id).await;
    let story: Vec<&str> = kinds(&events)
        .into_iter()
        .filter(|k| matches!(*k, "waiting" | "resumed" | "terminal" | "decision"))
        .collect();
    assert_eq!(
        story,
        [
            "decision", "waiting", "resumed", "decision", "waiting", "resumed", "terminal"
        ],
        "{events:#?}"
    );
    let counts = cloud_events(&mesh, &run.run_id).await;
    assert_eq!(
        counts.get("dev.convene.run.completed.v1"),
        Some(&1),
        "{counts:?}"
    );
    assert_eq!(
        counts.get("dev.convene.run.waiting.v1"),
        Some(&2),
        "{counts:?}"
    );
    assert_eq!(
        counts.get("dev.convene.run.resumed.v1"),
        Some(&2),
        "{counts:?}"
    );
    // The approval service's own events reach the run's event feed, once each.
    assert_eq!(
        counts.get("dev.convene.approval.requested.v1"),
        Some(&1),
        "{counts:?}"
    );
    assert_eq!(
        counts.get("dev.convene.approval.decided.v1"),
        Some(&2),
        "{counts:?}"
    );
    assert_eq!(
        counts.get("dev.convene.approval.executed.v1"),
        Some(&1),
        "{counts:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn approved_and_executed_in_one_process() {
    approved_and_executed(Mode::InProcess).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn approved_and_executed_with_every_service_its_own_process() {
    approved_and_executed(Mode::Processes).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rejected_action_ends_the_run_with_the_action_rejected() {
    let mesh = TestMesh::start(Mode::InProcess, MeshOptions::default()).await;
    let (run, id) = settled(&mesh).await;
    vote(&mesh, ALICE, &id, v1::VoteDecision::Reject).await;
    let run = wait_state(&mesh, &run.run_id, v1::RunState::Succeeded).await;
    let action = &run.actions[0];
    assert_eq!(action.state, v1::ActionState::Rejected as i32, "{run:#?}");
    assert_eq!(action.decided_by, [ALICE]);
    assert!(action.execution.is_none(), "nothing ran");
    let counts = cloud_events(&mesh, &run.run_id).await;
    assert_eq!(
        counts.get("dev.convene.run.completed.v1"),
        Some(&1),
        "{counts:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_action_ends_the_run_with_the_action_expired() {
    let mesh = TestMesh::start(
        Mode::Processes,
        MeshOptions {
            supervisor_env: vec![("CONVENE_APPROVAL_TTL".to_owned(), "3s".to_owned())],
            ..MeshOptions::default()
        },
    )
    .await;
    let (run, id) = settled(&mesh).await;
    let run = wait_state(&mesh, &run.run_id, v1::RunState::Succeeded).await;
    let action = &run.actions[0];
    assert_eq!(action.state, v1::ActionState::Expired as i32, "{run:#?}");
    assert_eq!(
        approval(&mesh, &id).await.state,
        v1::ApprovalState::Expired as i32
    );
    let counts = cloud_events(&mesh, &run.run_id).await;
    assert_eq!(
        counts.get("dev.convene.approval.expired.v1"),
        Some(&1),
        "{counts:?}"
    );
    assert_eq!(
        counts.get("dev.convene.run.completed.v1"),
        Some(&1),
        "{counts:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn approvals_reach_the_run_when_the_approval_service_keeps_its_own_database() {
    let mut mesh = TestMesh::start(Mode::Processes, MeshOptions::default()).await;
    // The approval service alone moves to a database of its own: the supervisor hears
    // of its requests' changes only through Approval.WatchEvents.
    let own = mesh.data_dir().join("approval-only.db");
    assert!(
        mesh.restart(
            "approval",
            vec![(
                "CONVENE_DATABASE_URL".to_owned(),
                convene_store::sqlite_url(&own)
            )],
        )
        .await,
        "the approval service restarts"
    );
    let (run, id) = settled(&mesh).await;
    vote(&mesh, ALICE, &id, v1::VoteDecision::Approve).await;
    vote(&mesh, BOB, &id, v1::VoteDecision::Approve).await;
    let hash = approval(&mesh, &id).await.parameters_hash;
    mesh.approval()
        .execute(request(
            v1::ApprovalExecuteRequest {
                approval_id: id.clone(),
                parameters_hash: hash,
            },
            &mesh.credential(ALICE),
        ))
        .await
        .expect("Execute");
    let run = wait_state(&mesh, &run.run_id, v1::RunState::Succeeded).await;
    assert_eq!(run.actions[0].state, v1::ActionState::Executed as i32);
    // The request lives in the approval service's file, not the shared one.
    let db = convene_store::Database::connect(&convene_store::sqlite_url(&own))
        .await
        .expect("the approval service's database");
    let rows = db
        .fetch_all(convene_store::sql("SELECT approval_id FROM approvals"))
        .await
        .expect("approvals read");
    assert_eq!(rows.len(), 1);
    let shared = mesh.open_database().await;
    let none = shared
        .fetch_all(convene_store::sql("SELECT approval_id FROM approvals"))
        .await
        .expect("approvals read");
    assert!(none.is_empty(), "the shared database holds no request");
}
