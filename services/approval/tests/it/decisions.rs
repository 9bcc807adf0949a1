//! Decisions: who may approve (never the requester; by risk level, one vote each), the
//! parameters a vote is bound to, and expiry.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use crate::support::{Harness, assert_status, rollback};
use convene_approval::canonical::{parameters_hash, struct_from_json};
use convene_mesh::auth::request;
use convene_mesh::handles::{ApprovalHandle, GrpcApproval};
use convene_proto::v1::{
    self, ApprovalState, ListApprovalsRequest, RequestApprovalRequest, RiskLevel, VoteDecision,
};
use serde_json::json;
use tonic::Code;

#[tokio::test]
async fn the_requester_cannot_approve_even_when_the_supervisor_filed_for_them() {
    let h = Harness::start_with_test_policy().await;
    let own = h
        .file(
            "oncall@acme",
            "traffic:shift",
            json!({"share": 0.05}),
            RiskLevel::R2,
            "ts-1",
        )
        .await
        .unwrap()
        .approval
        .unwrap();
    assert_status(
        h.decide("oncall@acme", &own, VoteDecision::Approve).await,
        Code::PermissionDenied,
        "the requester cannot approve their own request",
    );

    // The supervisor files for the run's principal, over gRPC and in process alike.
    let supervisor = h.credential("supervisor");
    let grpc: ApprovalHandle = Arc::new(GrpcApproval::new(h.server.channel().await));
    let in_process: ApprovalHandle = h.service.clone();
    let mut filed = Vec::new();
    for (key, handle) in [("sv-1", grpc), ("sv-2", in_process)] {
        let msg = RequestApprovalRequest {
            action: "rule:rollback".into(),
            parameters: Some(struct_from_json(&rollback()).unwrap()),
            risk_level: RiskLevel::R3 as i32,
            idempotency_key: key.into(),
            run_id: "run-7".into(),
            on_behalf_of: "oncall@acme".into(),
            ..Default::default()
        };
        let approval = handle
            .request_approval(request(msg, &supervisor))
            .await
            .unwrap()
            .into_inner()
            .approval
            .unwrap();
        assert_eq!(approval.requester, "oncall@acme");
        assert_eq!(approval.tenant, "acme-payments");
        filed.push(approval);
    }
    for approval in &filed {
        assert_status(
            h.decide("oncall@acme", approval, VoteDecision::Approve)
                .await,
            Code::PermissionDenied,
            "the requester cannot approve their own request",
        );
        let voted = h
            .decide("alice@acme", approval, VoteDecision::Approve)
            .await
            .unwrap();
        assert_eq!(voted.votes.len(), 1, "only alice's vote counts");
    }
    // The supervisor follows the requests it filed, though they are another tenant's.
    let seen = h.get("supervisor", &filed[0].approval_id).await.unwrap();
    assert_eq!(seen.approval_id, filed[0].approval_id);
    let listed = h
        .list(
            "supervisor",
            ListApprovalsRequest {
                run_id: "run-7".into(),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    let ids: Vec<&str> = listed
        .approvals
        .iter()
        .map(|a| a.approval_id.as_str())
        .collect();
    assert_eq!(ids, [&filed[1].approval_id, &filed[0].approval_id]);
    // The supervisor cannot see the request oncall filed itself.
    assert_status(
        h.get("supervisor", &own.approval_id).await,
        Code::NotFound,
        "not found",
    );

    // Only services may file for someone else.
    let msg = RequestApprovalRequest {
        action: "traffic:shift".into(),
        risk_level: RiskLevel::R2 as i32,
        idempotency_key: "ts-2".into(),
        on_behalf_of: "alice@acme".into(),
        ..Default::default()
    };
    assert_status(
        h.client()
            .await
            .request_approval(request(msg, &h.credential("oncall@acme")))
            .await,
        Code::PermissionDenied,
        "only service principals may set on_behalf_of",
    );
}

#[tokio::test]
async fn changed_parameters_need_a_new_request() {
    let h = Harness::start().await;
    let approval = h
        .file(
            "oncall@acme",
            "rule:rollback",
            rollback(),
            RiskLevel::R3,
            "rb-1",
        )
        .await
        .unwrap()
        .approval
        .unwrap();
    assert_eq!(
        approval.parameters_hash,
        parameters_hash(&struct_from_json(&rollback()).unwrap()).unwrap()
    );

    let changed =
        json!({"rule": "risk-rule-17", "to_version": 2, "reason": {"incident": "INC-2002"}});
    let changed_hash = parameters_hash(&struct_from_json(&changed).unwrap()).unwrap();
    assert_ne!(changed_hash, approval.parameters_hash);
    assert_status(
        h.decide_with_hash(
            "alice@acme",
            &approval.approval_id,
            VoteDecision::Approve,
            &changed_hash,
        )
        .await,
        Code::FailedPrecondition,
        "parameters changed since you reviewed them",
    );

    // The same key with other parameters is refused; with the same ones (in any key
    // order) it answers with the existing request.
    assert_status(
        h.file(
            "oncall@acme",
            "rule:rollback",
            changed.clone(),
            RiskLevel::R3,
            "rb-1",
        )
        .await,
        Code::AlreadyExists,
        "idempotency_key \"rb-1\"",
    );
    let reordered =
        json!({"reason": {"incident": "INC-2002"}, "to_version": 3.0, "rule": "risk-rule-17"});
    let again = h
        .file(
            "oncall@acme",
            "rule:rollback",
            reordered,
            RiskLevel::R3,
            "rb-1",
        )
        .await
        .unwrap();
    assert!(!again.created);
    assert_eq!(again.approval.unwrap().approval_id, approval.approval_id);

    let fresh = h
        .file(
            "oncall@acme",
            "rule:rollback",
            changed,
            RiskLevel::R3,
            "rb-2",
        )
        .await
        .unwrap();
    assert!(fresh.created);
    let fresh = fresh.approval.unwrap();
    assert_ne!(fresh.approval_id, approval.approval_id);
    assert_eq!(fresh.parameters_hash, changed_hash);

    // Executing with a stale hash is refused as well.
    h.decide("alice@acme", &fresh, VoteDecision::Approve)
        .await
        .unwrap();
    h.decide("bob@acme", &fresh, VoteDecision::Approve)
        .await
        .unwrap();
    let stale = v1::ApprovalRequest {
        parameters_hash: approval.parameters_hash.clone(),
        ..fresh.clone()
    };
    assert_status(
        h.execute("alice@acme", &stale).await,
        Code::FailedPrecondition,
        "parameters changed",
    );
    assert_eq!(h.executor.calls.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn expired_requests_cannot_be_approved() {
    let h = Harness::start().await;
    let msg = RequestApprovalRequest {
        action: "rule:rollback".into(),
        parameters: Some(struct_from_json(&rollback()).unwrap()),
        risk_level: RiskLevel::R3 as i32,
        idempotency_key: "rb-exp".into(),
        expires_in: Some(prost_types::Duration {
            seconds: 600,
            nanos: 0,
        }),
        ..Default::default()
    };
    let approval = h
        .client()
        .await
        .request_approval(request(msg, &h.credential("oncall@acme")))
        .await
        .unwrap()
        .into_inner()
        .approval
        .unwrap();
    let created = approval.created_at.unwrap();
    assert_eq!(approval.expires_at.unwrap().seconds, created.seconds + 600);

    h.clock.advance(Duration::from_secs(300));
    h.decide("alice@acme", &approval, VoteDecision::Approve)
        .await
        .unwrap();
    h.clock.advance(Duration::from_secs(300));
    assert_status(
        h.decide("bob@acme", &approval, VoteDecision::Approve).await,
        Code::FailedPrecondition,
        "expired",
    );
    let stored = h.get("oncall@acme", &approval.approval_id).await.unwrap();
    assert_eq!(stored.state, ApprovalState::Expired as i32);
    assert_eq!(stored.votes.len(), 1);
    assert_status(
        h.execute("alice@acme", &approval).await,
        Code::FailedPrecondition,
        "EXPIRED",
    );
    let expired = h
        .list(
            "alice@acme",
            ListApprovalsRequest {
                states: vec![ApprovalState::Expired as i32],
                ..Default::default()
            },
        )
        .await
        .unwrap();
    assert_eq!(expired.approvals.len(), 1);
    assert_eq!(h.executor.calls.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn risk_levels_decide_who_must_approve() {
    let h = Harness::start().await;
    // R2: one approver is enough.
    let shift = h
        .file(
            "oncall@acme",
            "traffic:shift",
            json!({"service": "payment-api", "share": 0.1}),
            RiskLevel::R2,
            "ts",
        )
        .await
        .unwrap()
        .approval
        .unwrap();
    assert_eq!(
        (shift.risk_level, shift.approvals_required),
        (RiskLevel::R2 as i32, 1)
    );
    let approved = h
        .decide("bob@acme", &shift, VoteDecision::Approve)
        .await
        .unwrap();
    assert_eq!(approved.state, ApprovalState::Approved as i32);
    let executed = h.execute("alice@acme", &shift).await.unwrap();
    assert!(executed.executed_now);
    assert_eq!(executed.execution.unwrap().executed_by, "alice@acme");

    // R0 and R1 need no approval.
    assert_status(
        h.file(
            "oncall@acme",
            "ticket:create",
            json!({}),
            RiskLevel::R1,
            "t1",
        )
        .await,
        Code::InvalidArgument,
        "need no approval",
    );
    assert_status(
        h.file("oncall@acme", "cache:warm", json!({}), RiskLevel::R0, "t0")
            .await,
        Code::InvalidArgument,
        "need no approval",
    );

    // The catalog raises an under-declared risk: a rollback is R3 whatever was asked.
    let raised = h
        .file(
            "oncall@acme",
            "rule:rollback",
            rollback(),
            RiskLevel::R2,
            "rb",
        )
        .await
        .unwrap()
        .approval
        .unwrap();
    assert_eq!(
        (raised.risk_level, raised.approvals_required),
        (RiskLevel::R3 as i32, 2)
    );
    let after_one = h
        .decide("alice@acme", &raised, VoteDecision::Approve)
        .await
        .unwrap();
    assert_eq!(after_one.state, ApprovalState::Pending as i32);

    // An action outside the catalog keeps the asked level; an unset one counts as R3.
    let unknown = h
        .file(
            "oncall@acme",
            "dns:failover",
            json!({}),
            RiskLevel::R2,
            "dns",
        )
        .await
        .unwrap()
        .approval
        .unwrap();
    assert_eq!(unknown.risk_level, RiskLevel::R2 as i32);
    let unset = h
        .file(
            "oncall@acme",
            "dns:failover",
            json!({}),
            RiskLevel::Unspecified,
            "dns-2",
        )
        .await
        .unwrap()
        .approval
        .unwrap();
    assert_eq!(unset.risk_level, RiskLevel::R3 as i32);
}

#[tokio::test]
async fn one_vote_per_approver_and_a_reject_ends_the_request() {
    let h = Harness::start().await;
    let approval = h
        .file(
            "oncall@acme",
            "rule:rollback",
            rollback(),
            RiskLevel::R3,
            "rb",
        )
        .await
        .unwrap()
        .approval
        .unwrap();
    h.decide("alice@acme", &approval, VoteDecision::Approve)
        .await
        .unwrap();
    let twice = h
        .decide("alice@acme", &approval, VoteDecision::Approve)
        .await
        .unwrap();
    assert_eq!(
        twice.state,
        ApprovalState::Pending as i32,
        "alice counts once"
    );
    assert_eq!(twice.votes.len(), 1);
    assert_status(
        h.execute("bob@acme", &approval).await,
        Code::FailedPrecondition,
        "1 of 2 approvals missing",
    );
    assert_status(
        h.decide("alice@acme", &approval, VoteDecision::Reject)
            .await,
        Code::FailedPrecondition,
        "already voted APPROVE",
    );

    let rejected = h
        .decide("bob@acme", &approval, VoteDecision::Reject)
        .await
        .unwrap();
    assert_eq!(rejected.state, ApprovalState::Rejected as i32);
    assert_status(
        h.execute("alice@acme", &approval).await,
        Code::FailedPrecondition,
        "REJECTED (by bob@acme)",
    );
    assert_eq!(h.executor.calls.load(Ordering::SeqCst), 0);
}
