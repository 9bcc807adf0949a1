//! The approval service end to end: the real service on a loopback socket, called through
//! the generated gRPC client with bearer credentials from a temporary data directory.

use std::{
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::{Duration, SystemTime},
};

use async_trait::async_trait;
use convene_approval::{
    ApprovalService, Config, ExecutionOutcome, Executor, ExecutorError, ManualClock, add_to_server,
    canonical::{parameters_hash, struct_from_json},
    model::ApprovalRequest,
};
use convene_mesh::{
    auth::request,
    handles::{ApprovalHandle, GrpcApproval},
    policy_file::dev_credential,
};
use convene_proto::v1::{
    self, ApprovalExecuteRequest, ApprovalExecuteResponse, ApprovalState, DecideRequest,
    GetApprovalRequest, ListApprovalsRequest, RequestApprovalRequest, RequestApprovalResponse,
    RiskLevel, VoteDecision, approval_client::ApprovalClient,
};
use convene_server::{GrpcServer, ServerSettings, test_util::TestServer};
use serde_json::json;
use tempfile::TempDir;
use tonic::{Code, Status, transport::Channel};

/// The example policy with two changes the tests need: the on-call engineer may also
/// decide (so the "never the requester" rule, not a missing role, is what stops them),
/// and the other tenant has an approver of its own.
fn test_policy() -> String {
    let policy = convene_approval::config::EXAMPLE_POLICY
        .replace(
            "roles: [runs:start, runs:read, approvals:request, evidence:read]",
            "roles: [runs:start, runs:read, approvals:request, evidence:read, approvals:decide]",
        )
        .replace(
            "  # Services of the mesh.\n",
            "  - id: approver@globex\n    tenant: globex\n    kind: human\n    \
             roles: [approvals:decide, approvals:execute]\n  # Services of the mesh.\n",
        );
    assert!(policy.contains("evidence:read, approvals:decide"));
    assert!(policy.contains("approver@globex"));
    policy
}

/// An executor that counts its calls, takes a while (so concurrent Execute calls
/// overlap) and can refuse to start a given number of times.
#[derive(Debug, Default)]
struct CountingExecutor {
    calls: AtomicUsize,
    refuse_first: AtomicUsize,
}

#[async_trait]
impl Executor for CountingExecutor {
    fn name(&self) -> &str {
        "counting"
    }

    async fn execute(&self, request: &ApprovalRequest) -> Result<ExecutionOutcome, ExecutorError> {
        let refused = self
            .refuse_first
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok();
        if refused {
            return Err(ExecutorError::NotStarted("target unreachable".into()));
        }
        let call = self.calls.fetch_add(1, Ordering::SeqCst) + 1;
        tokio::time::sleep(Duration::from_millis(100)).await;
        let output = struct_from_json(&json!({
            "call": call,
            "action": request.action,
        }))
        .expect("an object");
        Ok(ExecutionOutcome {
            success: true,
            output,
        })
    }
}

struct Harness {
    server: TestServer,
    service: Arc<ApprovalService>,
    clock: ManualClock,
    executor: Arc<CountingExecutor>,
    data: TempDir,
}

impl Harness {
    /// The service on the embedded example policy.
    async fn start() -> Self {
        Self::start_with(None).await
    }

    /// The service on [`test_policy`].
    async fn start_with_test_policy() -> Self {
        Self::start_with(Some(test_policy())).await
    }

    async fn start_with(policy: Option<String>) -> Self {
        let data = tempfile::tempdir().expect("temp dir");
        let policy_file = policy.map(|text| {
            let path = data.path().join("policy.yaml");
            std::fs::write(&path, text).expect("write the policy");
            path
        });
        let config = Config {
            server: ServerSettings::default(),
            data_dir: data.path().join("data"),
            policy_file,
            ..Config::default()
        };
        let clock = ManualClock::new(SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000));
        let executor = Arc::new(CountingExecutor::default());
        let service = Arc::new(
            ApprovalService::from_config(&config)
                .expect("the service starts")
                .with_clock(clock.clone())
                .with_executor(executor.clone()),
        );
        let server = TestServer::start(add_to_server(
            GrpcServer::new(config.server.clone()),
            service.clone(),
        ))
        .await;
        Self {
            server,
            service,
            clock,
            executor,
            data,
        }
    }

    fn credential(&self, principal: &str) -> String {
        dev_credential(&self.data.path().join("data/credentials"), principal)
            .expect("development credential")
    }

    async fn client(&self) -> ApprovalClient<Channel> {
        ApprovalClient::new(self.server.channel().await)
    }

    async fn file(
        &self,
        who: &str,
        action: &str,
        parameters: serde_json::Value,
        risk: RiskLevel,
        key: &str,
    ) -> Result<RequestApprovalResponse, Status> {
        let msg = RequestApprovalRequest {
            action: action.into(),
            parameters: Some(struct_from_json(&parameters).expect("an object")),
            risk_level: risk as i32,
            idempotency_key: key.into(),
            evidence_refs: vec!["ev-risk-rule-hits".into()],
            rationale: "risk rule r-17 deviates since its deploy".into(),
            run_id: "run-1".into(),
            ..Default::default()
        };
        self.client()
            .await
            .request_approval(request(msg, &self.credential(who)))
            .await
            .map(tonic::Response::into_inner)
    }

    async fn decide(
        &self,
        who: &str,
        approval: &v1::ApprovalRequest,
        decision: VoteDecision,
    ) -> Result<v1::ApprovalRequest, Status> {
        self.decide_with_hash(
            who,
            &approval.approval_id,
            decision,
            &approval.parameters_hash,
        )
        .await
    }

    async fn decide_with_hash(
        &self,
        who: &str,
        approval_id: &str,
        decision: VoteDecision,
        hash: &str,
    ) -> Result<v1::ApprovalRequest, Status> {
        let msg = DecideRequest {
            approval_id: approval_id.into(),
            decision: decision as i32,
            parameters_hash: hash.into(),
            comment: format!("{who} reviewed it"),
        };
        self.client()
            .await
            .decide(request(msg, &self.credential(who)))
            .await
            .map(|r| r.into_inner().approval.expect("the approval"))
    }

    async fn execute(
        &self,
        who: &str,
        approval: &v1::ApprovalRequest,
    ) -> Result<ApprovalExecuteResponse, Status> {
        let msg = ApprovalExecuteRequest {
            approval_id: approval.approval_id.clone(),
            parameters_hash: approval.parameters_hash.clone(),
        };
        self.client()
            .await
            .execute(request(msg, &self.credential(who)))
            .await
            .map(tonic::Response::into_inner)
    }

    async fn get(&self, who: &str, approval_id: &str) -> Result<v1::ApprovalRequest, Status> {
        let msg = GetApprovalRequest {
            approval_id: approval_id.into(),
        };
        self.client()
            .await
            .get_approval(request(msg, &self.credential(who)))
            .await
            .map(|r| r.into_inner().approval.expect("the approval"))
    }

    async fn list(
        &self,
        who: &str,
        msg: ListApprovalsRequest,
    ) -> Result<v1::ListApprovalsResponse, Status> {
        self.client()
            .await
            .list_approvals(request(msg, &self.credential(who)))
            .await
            .map(tonic::Response::into_inner)
    }
}

fn rollback() -> serde_json::Value {
    json!({"rule": "risk-rule-17", "to_version": 3, "reason": {"incident": "INC-2002"}})
}

#[track_caller]
fn assert_status(result: Result<impl std::fmt::Debug, Status>, code: Code, needle: &str) {
    let status = result.expect_err("the call must fail");
    assert_eq!(status.code(), code, "{}", status.message());
    assert!(
        status.message().contains(needle),
        "expected {needle:?} in: {}",
        status.message()
    );
}

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
