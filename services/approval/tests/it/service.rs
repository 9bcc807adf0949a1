//! The service around the decisions: tenant isolation, listing in pages, authentication
//! and required fields, health and reflection.

use std::time::Duration;

use crate::support::{Harness, assert_status, rollback};
use convene_proto::v1::{
    ApprovalState, GetApprovalRequest, ListApprovalsRequest, RiskLevel, VoteDecision,
};
use serde_json::json;
use tonic::Code;

#[tokio::test]
async fn tenants_are_isolated() {
    let h = Harness::start_with_test_policy().await;
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
    for who in ["analyst@globex", "approver@globex"] {
        assert_status(
            h.get(who, &approval.approval_id).await,
            Code::NotFound,
            "not found",
        );
        let listed = h.list(who, ListApprovalsRequest::default()).await.unwrap();
        assert!(listed.approvals.is_empty(), "{who} sees {listed:?}");
    }
    assert_status(
        h.decide("approver@globex", &approval, VoteDecision::Approve)
            .await,
        Code::NotFound,
        "not found",
    );
    assert_status(
        h.execute("approver@globex", &approval).await,
        Code::NotFound,
        "not found",
    );
    // Without the role, the role is what is missing.
    assert_status(
        h.decide("analyst@globex", &approval, VoteDecision::Approve)
            .await,
        Code::PermissionDenied,
        "approvals:decide",
    );
    let untouched = h.get("alice@acme", &approval.approval_id).await.unwrap();
    assert!(untouched.votes.is_empty());
}

#[tokio::test]
async fn listing_is_newest_first_in_pages() {
    let h = Harness::start().await;
    let mut ids = Vec::new();
    for i in 0..5 {
        h.clock.advance(Duration::from_secs(1));
        let approval = h
            .file(
                "oncall@acme",
                "traffic:shift",
                json!({"share": i}),
                RiskLevel::R2,
                &format!("k{i}"),
            )
            .await
            .unwrap()
            .approval
            .unwrap();
        ids.push(approval.approval_id);
    }
    ids.reverse();
    let mut seen = Vec::new();
    let mut token = String::new();
    let mut pages = 0;
    loop {
        let page = h
            .list(
                "bob@acme",
                ListApprovalsRequest {
                    page_size: 2,
                    page_token: token.clone(),
                    states: vec![ApprovalState::Pending as i32],
                    ..Default::default()
                },
            )
            .await
            .unwrap();
        pages += 1;
        seen.extend(page.approvals.into_iter().map(|a| a.approval_id));
        if page.next_page_token.is_empty() {
            break;
        }
        token = page.next_page_token;
        // A token resumes only the listing it came from.
        assert_status(
            h.list(
                "bob@acme",
                ListApprovalsRequest {
                    page_size: 2,
                    page_token: token.clone(),
                    ..Default::default()
                },
            )
            .await,
            Code::InvalidArgument,
            "page_token",
        );
    }
    assert_eq!(pages, 3);
    assert_eq!(seen, ids);
    assert_status(
        h.list(
            "bob@acme",
            ListApprovalsRequest {
                page_token: "not-a-token".into(),
                ..Default::default()
            },
        )
        .await,
        Code::InvalidArgument,
        "page_token",
    );
}

#[tokio::test]
async fn callers_must_authenticate_and_fill_required_fields() {
    let h = Harness::start().await;
    let anonymous = h
        .client()
        .await
        .get_approval(GetApprovalRequest {
            approval_id: "apr-x".into(),
        })
        .await;
    assert_status(anonymous, Code::Unauthenticated, "authorization");
    assert_status(
        h.file(
            "oncall@acme",
            "rule:rollback",
            rollback(),
            RiskLevel::R3,
            "",
        )
        .await,
        Code::InvalidArgument,
        "idempotency_key",
    );
    assert_status(
        h.file(
            "alice@acme",
            "rule:rollback",
            rollback(),
            RiskLevel::R3,
            "k",
        )
        .await,
        Code::PermissionDenied,
        "approvals:request",
    );
    assert_status(
        h.decide_with_hash(
            "alice@acme",
            "apr-x",
            VoteDecision::Unspecified,
            "sha256:00",
        )
        .await,
        Code::InvalidArgument,
        "decision",
    );
}

#[tokio::test]
async fn health_and_reflection_answer() {
    use tonic_health::pb::{
        HealthCheckRequest, health_check_response::ServingStatus, health_client::HealthClient,
    };
    use tonic_reflection::pb::v1::{
        ServerReflectionRequest, server_reflection_client::ServerReflectionClient,
        server_reflection_request::MessageRequest, server_reflection_response::MessageResponse,
    };

    let h = Harness::start().await;
    let health = HealthClient::new(h.server.channel().await)
        .check(HealthCheckRequest {
            service: "convene.v1.Approval".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(health.status, ServingStatus::Serving as i32);

    let ask = ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::ListServices(String::new())),
    };
    let mut answers = ServerReflectionClient::new(h.server.channel().await)
        .server_reflection_info(tokio_stream::once(ask))
        .await
        .unwrap()
        .into_inner();
    let answer = answers.message().await.unwrap().expect("one answer");
    let Some(MessageResponse::ListServicesResponse(list)) = answer.message_response else {
        panic!("unexpected reflection answer {answer:?}");
    };
    assert!(
        list.service.iter().any(|s| s.name == "convene.v1.Approval"),
        "{list:?}"
    );
}
