//! Shared setup of the approval service's end-to-end tests: the real service on a
//! loopback socket with a counting executor and a clock the test moves, called through
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
    ApprovalService, ApprovalStore, Config, ExecutionOutcome, Executor, ExecutorError, ManualClock,
    add_to_server, canonical::struct_from_json, model::ApprovalRequest,
};
use convene_mesh::{auth::request, policy_file::dev_credential};
use convene_proto::v1::{
    self, ApprovalExecuteRequest, ApprovalExecuteResponse, DecideRequest, GetApprovalRequest,
    ListApprovalsRequest, RequestApprovalRequest, RequestApprovalResponse, RiskLevel, VoteDecision,
    approval_client::ApprovalClient,
};
use convene_server::{GrpcServer, ServerSettings, Shutdown, test_util::TestServer};
use serde_json::json;
use tempfile::TempDir;
use tonic::{Code, Status, transport::Channel};

/// The example policy with two changes the tests need: the on-call engineer may also
/// decide (so the "never the requester" rule, not a missing role, is what stops them),
/// and the other tenant has an approver of its own.
pub fn test_policy() -> String {
    let policy = convene_mesh::policy_file::EXAMPLE_POLICY
        .replacen(
            "approvals:request, evidence:read]",
            "approvals:request, evidence:read, approvals:decide]",
            1,
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
pub struct CountingExecutor {
    pub calls: AtomicUsize,
    pub refuse_first: AtomicUsize,
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

pub struct Harness {
    pub server: TestServer,
    pub service: Arc<ApprovalService>,
    pub clock: ManualClock,
    pub executor: Arc<CountingExecutor>,
    /// The service's own shutdown signal (the server has another).
    pub shutdown: Shutdown,
    pub data: TempDir,
}

/// What a [`Harness`] starts with beyond the defaults.
pub struct Options {
    /// The policy file's text; `None`: the embedded example.
    pub policy: Option<String>,
    /// Where requests are kept; `None`: in memory.
    pub store: Option<Arc<dyn ApprovalStore>>,
    /// Time between two background expiry sweeps. Long by default, so that only the
    /// test's own `sweep_expired` calls record expiries.
    pub sweep_interval: Duration,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            policy: None,
            store: None,
            sweep_interval: Duration::from_secs(3600),
        }
    }
}

impl Harness {
    /// The service on the embedded example policy.
    pub async fn start() -> Self {
        Self::start_with(None).await
    }

    /// The service on [`test_policy`].
    pub async fn start_with_test_policy() -> Self {
        Self::start_with(Some(test_policy())).await
    }

    pub async fn start_with(policy: Option<String>) -> Self {
        Self::start_with_options(Options {
            policy,
            ..Options::default()
        })
        .await
    }

    pub async fn start_with_options(options: Options) -> Self {
        let data = tempfile::tempdir().expect("temp dir");
        let policy_file = options.policy.map(|text| {
            let path = data.path().join("policy.yaml");
            std::fs::write(&path, text).expect("write the policy");
            path
        });
        let config = Config {
            common: convene_server::ServiceCommon {
                server: ServerSettings::default(),
                data_dir: data.path().join("data"),
                policy_file,
                ..convene_server::ServiceCommon::default()
            },
            expiry_sweep_interval: options.sweep_interval,
            ..Config::default()
        };
        let clock = ManualClock::new(SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000));
        let executor = Arc::new(CountingExecutor::default());
        let shutdown = Shutdown::new();
        let mut service = ApprovalService::from_config(&config)
            .expect("the service starts")
            .with_clock(clock.clone())
            .with_executor(executor.clone())
            .with_shutdown(shutdown.clone());
        if let Some(store) = options.store {
            service = service.with_store(store);
        }
        let service = Arc::new(service);
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
            shutdown,
            data,
        }
    }

    pub fn credential(&self, principal: &str) -> String {
        dev_credential(&self.data.path().join("data/credentials"), principal)
            .expect("development credential")
    }

    pub async fn client(&self) -> ApprovalClient<Channel> {
        ApprovalClient::new(self.server.channel().await)
    }

    pub async fn file(
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

    pub async fn decide(
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

    pub async fn decide_with_hash(
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

    pub async fn execute(
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

    pub async fn get(&self, who: &str, approval_id: &str) -> Result<v1::ApprovalRequest, Status> {
        let msg = GetApprovalRequest {
            approval_id: approval_id.into(),
        };
        self.client()
            .await
            .get_approval(request(msg, &self.credential(who)))
            .await
            .map(|r| r.into_inner().approval.expect("the approval"))
    }

    pub async fn list(
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

pub fn rollback() -> serde_json::Value {
    json!({"rule": "risk-rule-17", "to_version": 3, "reason": {"incident": "INC-2002"}})
}

#[track_caller]
pub fn assert_status(result: Result<impl std::fmt::Debug, Status>, code: Code, needle: &str) {
    let status = result.expect_err("the call must fail");
    assert_eq!(status.code(), code, "{}", status.message());
    assert!(
        status.message().contains(needle),
        "expected {needle:?} in: {}",
        status.message()
    );
}
