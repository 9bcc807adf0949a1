//! Execution: exactly once after enough distinct approvals, and a request left approved
//! when its executor could not start.

use std::sync::atomic::Ordering;

use crate::support::{Harness, assert_status, rollback};
use convene_proto::v1::{ApprovalExecuteResponse, ApprovalState, RiskLevel, VoteDecision};
use serde_json::json;
use tonic::Code;

#[tokio::test]
async fn r3_executes_exactly_once_after_two_distinct_approvals() {
    let h = Harness::start().await;
    let filed = h
        .file(
            "oncall@acme",
            "rule:rollback",
            rollback(),
            RiskLevel::R3,
            "rb-1",
        )
        .await
        .unwrap();
    assert!(filed.created);
    let approval = filed.approval.unwrap();
    assert_eq!(approval.approvals_required, 2);
    assert_eq!(approval.tenant, "acme-payments");
    assert_eq!(approval.requester, "oncall@acme");

    let after_one = h
        .decide("alice@acme", &approval, VoteDecision::Approve)
        .await
        .unwrap();
    assert_eq!(after_one.state, ApprovalState::Pending as i32);
    assert_status(
        h.execute("bob@acme", &approval).await,
        Code::FailedPrecondition,
        "1 of 2 approvals missing",
    );
    assert_eq!(h.executor.calls.load(Ordering::SeqCst), 0);

    let after_two = h
        .decide("bob@acme", &approval, VoteDecision::Approve)
        .await
        .unwrap();
    assert_eq!(after_two.state, ApprovalState::Approved as i32);

    let calls = (0..8).map(|i| {
        let who = if i % 2 == 0 { "alice@acme" } else { "bob@acme" };
        h.execute(who, &approval)
    });
    let answers: Vec<ApprovalExecuteResponse> = futures::future::join_all(calls)
        .await
        .into_iter()
        .collect::<Result<_, _>>()
        .expect("every Execute answers");
    assert_eq!(
        h.executor.calls.load(Ordering::SeqCst),
        1,
        "the action ran once"
    );
    assert_eq!(answers.iter().filter(|a| a.executed_now).count(), 1);
    let first = answers[0].execution.clone().unwrap();
    assert!(first.success);
    assert_eq!(first.executor, "counting");
    for answer in &answers {
        assert_eq!(answer.execution.as_ref(), Some(&first));
    }

    // Later calls keep answering with the first record.
    let later = h.execute("alice@acme", &approval).await.unwrap();
    assert!(!later.executed_now);
    assert_eq!(later.execution, Some(first.clone()));
    let stored = h.get("oncall@acme", &approval.approval_id).await.unwrap();
    assert_eq!(stored.state, ApprovalState::Executed as i32);
    assert_eq!(stored.execution, Some(first));
    assert_eq!(h.executor.calls.load(Ordering::SeqCst), 1);
    assert_status(
        h.decide("alice@acme", &approval, VoteDecision::Reject)
            .await,
        Code::FailedPrecondition,
        "cannot be changed",
    );
}

#[tokio::test]
async fn an_executor_that_could_not_start_leaves_the_request_approved() {
    let h = Harness::start().await;
    h.executor.refuse_first.store(1, Ordering::SeqCst);
    let approval = h
        .file(
            "oncall@acme",
            "traffic:shift",
            json!({"share": 0.1}),
            RiskLevel::R2,
            "ts",
        )
        .await
        .unwrap()
        .approval
        .unwrap();
    h.decide("alice@acme", &approval, VoteDecision::Approve)
        .await
        .unwrap();
    assert_status(
        h.execute("alice@acme", &approval).await,
        Code::Unavailable,
        "nothing was done",
    );
    let stored = h.get("alice@acme", &approval.approval_id).await.unwrap();
    assert_eq!(stored.state, ApprovalState::Approved as i32);
    let executed = h.execute("alice@acme", &approval).await.unwrap();
    assert!(executed.executed_now);
    assert_eq!(h.executor.calls.load(Ordering::SeqCst), 1);
}
