//! Shared setup of the policy service's integration tests: a policy file with known
//! credentials in a temporary data directory, a clock the test moves, the real service
//! on a loopback port, and a gRPC client.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use convene_mesh::auth::request;
use convene_policy::decision_log::{AuthorizeRecord, JsonlDecisionLog, LogEntry};
use convene_policy::{Clock, Config, PolicyService};
use convene_proto::v1::{self, policy_client::PolicyClient};
use convene_server::GrpcServer;
use convene_server::test_util::TestServer;
use convene_tokens::Claims;
use sha2::Digest as _;
use tonic::transport::Channel;

/// Credential of the supervisor (role `tokens:issue`).
pub const SUPERVISOR: &str = "cvn_test_supervisor_credential";
/// Credential of oncall@acme (human, tenant acme, no `tokens:issue`).
pub const ONCALL: &str = "cvn_test_oncall_credential";
/// Credential of analyst@globex (human, tenant globex).
pub const GLOBEX: &str = "cvn_test_globex_credential";
/// Credential of worker-pool (service, no `tokens:issue`).
pub const POOL: &str = "cvn_test_pool_credential";

/// The presenter a logs-investigator worker uses.
pub const LOGS_WORKER: &str = "worker:logs-investigator";

fn sha(credential: &str) -> String {
    hex::encode(sha2::Sha256::digest(credential.as_bytes()))
}

/// The test policy: principals with known credentials in two tenants, an investigating
/// profile whose capabilities exceed its principal's grants, a remediating profile, a
/// tool catalog with an R3 tool, and `extra_rules` appended to the rules section.
pub fn policy_yaml(extra_rules: &str) -> String {
    format!(
        r#"
tokens:
  issuer: convene-policy
  default_ttl: 15m
  max_ttl: 1h
  default_max_calls: 32
principals:
  - id: supervisor
    tenant: system
    kind: service
    credential_sha256: ["{supervisor}"]
    roles: [tokens:issue]
  - id: worker-pool
    tenant: system
    kind: service
    credential_sha256: ["{pool}"]
    roles: [workers:register]
  - id: oncall@acme
    tenant: acme
    kind: human
    credential_sha256: ["{oncall}"]
    roles: [runs:start]
    grants:
      - {{ action: "logs:read", resource: "service/*" }}
      - {{ action: "metrics:read", resource: "metric/*" }}
      - {{ action: "rules:write", resource: "rule/*" }}
      - {{ action: "evidence:*", resource: "evidence" }}
  - id: analyst@globex
    tenant: globex
    kind: human
    credential_sha256: ["{globex}"]
    roles: [runs:start]
    grants:
      - {{ action: "logs:read", resource: "service/*" }}
      - {{ action: "evidence:*", resource: "evidence" }}
profiles:
  - id: logs-investigator
    investigating: true
    tools: [search_logs@1, query_metrics@1, rollback_rule@1]
    evidence_prefixes: ["logs://"]
    capabilities:
      - {{ action: "logs:*", resource: "service/*", max_rows: 500 }}
      - {{ action: "metrics:read", resource: "metric/*" }}
      - {{ action: "changes:read", resource: "change/*" }}
      - {{ action: "evidence:*", resource: "evidence" }}
  - id: remediator
    tools: [rollback_rule@1]
    capabilities:
      - {{ action: "rules:write", resource: "rule/*" }}
tools:
  - {{ name: search_logs@1, action: "logs:read", risk: R0 }}
  - {{ name: query_metrics@1, action: "metrics:read", risk: R0 }}
  - {{ name: list_changes@1, action: "changes:read", risk: R0 }}
  - {{ name: rollback_rule@1, action: "rules:write", risk: R3 }}
rules:
  - {{ name: investigators-are-read-only, applies_to: investigating, deny_risk_at_or_above: R2 }}
{extra_rules}
"#,
        supervisor = sha(SUPERVISOR),
        pool = sha(POOL),
        oncall = sha(ONCALL),
        globex = sha(GLOBEX),
    )
}

/// A clock the test sets, in whole seconds.
#[derive(Clone, Debug)]
pub struct TestClock(Arc<AtomicU64>);

impl TestClock {
    /// Starts at the real current second.
    pub fn new() -> Self {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .expect("after 1970")
            .as_secs();
        Self(Arc::new(AtomicU64::new(now)))
    }

    /// The current test time.
    pub fn now(&self) -> SystemTime {
        UNIX_EPOCH + Duration::from_secs(self.0.load(Ordering::SeqCst))
    }

    /// Moves the clock to `t` (whole seconds).
    pub fn set(&self, t: SystemTime) {
        let secs = t.duration_since(UNIX_EPOCH).expect("after 1970").as_secs();
        self.0.store(secs, Ordering::SeqCst);
    }

    /// The clock as the service reads it.
    pub fn clock(&self) -> Clock {
        let secs = self.0.clone();
        Clock::from_fn(move || UNIX_EPOCH + Duration::from_secs(secs.load(Ordering::SeqCst)))
    }
}

/// The policy service serving on a loopback port, with its files in a temp directory.
pub struct Harness {
    /// The data directory (kept alive as long as the harness).
    pub dir: tempfile::TempDir,
    /// The configuration the service was opened with.
    pub config: Config,
    /// The service's clock.
    pub clock: TestClock,
    /// The service (its in-process handle).
    pub service: PolicyService,
    /// The server.
    pub server: TestServer,
    /// When the harness started (the clock's start).
    pub t0: SystemTime,
}

impl Harness {
    /// The test policy with its usual rules.
    pub async fn start() -> Self {
        Self::start_with(&policy_yaml("")).await
    }

    /// A service over `policy` in a fresh data directory.
    pub async fn start_with(policy: &str) -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        Self::start_in(dir, policy, TestClock::new()).await
    }

    /// A service over `policy` in `dir` (whose key ring may already exist), reading the
    /// time from `clock`.
    pub async fn start_in(dir: tempfile::TempDir, policy: &str, clock: TestClock) -> Self {
        let file = dir.path().join("policy.yaml");
        std::fs::write(&file, policy).expect("write the policy file");
        let config = Config {
            common: convene_server::ServiceCommon {
                policy_file: Some(file),
                dev_credentials: false,
                ..Config::in_dir(dir.path()).common
            },
            ..Config::in_dir(dir.path())
        };
        let service =
            PolicyService::open_with_clock(&config, clock.clock()).expect("the service opens");
        let server =
            TestServer::start(service.add_to(GrpcServer::new(config.server.clone()))).await;
        let t0 = clock.now();
        Self {
            dir,
            config,
            clock,
            service,
            server,
            t0,
        }
    }

    /// A gRPC client of the service.
    pub async fn client(&self) -> PolicyClient<Channel> {
        PolicyClient::new(self.server.channel().await)
    }

    /// The task window every default grant asks for: the hour around the start.
    pub fn window(&self) -> v1::TimeRange {
        range(
            self.t0 - Duration::from_secs(3600),
            self.t0 + Duration::from_secs(3600),
        )
    }

    /// A grant for a logs-investigator at depth 1 over the payment services and the
    /// evidence store, within [`window`](Self::window).
    pub fn logs_grant(&self, delegation: &str) -> v1::TokenGrantRequest {
        v1::TokenGrantRequest {
            delegation_id: delegation.into(),
            profile_id: "logs-investigator".into(),
            depth: 1,
            required_scopes: vec![
                scope("logs:read", "service/*"),
                scope("evidence:write", "evidence"),
                scope("evidence:read", "evidence"),
            ],
            task_scope: Some(v1::TaskScope {
                resources: vec!["service/payment-*".into(), "evidence".into()],
                time_range: Some(self.window()),
            }),
            tools: vec!["search_logs@1".into()],
            max_calls: 0,
            may_redelegate: false,
            ttl: None,
            max_depth: 3,
        }
    }

    /// IssueTaskToken as the supervisor for oncall@acme in `run`.
    pub async fn issue(
        &self,
        run: &str,
        grants: Vec<v1::TokenGrantRequest>,
    ) -> Result<v1::IssueTaskTokenResponse, tonic::Status> {
        let message = v1::IssueTaskTokenRequest {
            lease_epoch: 0,
            principal: "oncall@acme".into(),
            run_id: run.into(),
            parent_token: String::new(),
            grants,
        };
        self.client()
            .await
            .issue_task_token(request(message, SUPERVISOR))
            .await
            .map(tonic::Response::into_inner)
    }

    /// One token for `grant` in `run`.
    pub async fn issue_one(&self, run: &str, grant: v1::TokenGrantRequest) -> v1::IssuedToken {
        let mut tokens = self.issue(run, vec![grant]).await.expect("issued").tokens;
        assert_eq!(tokens.len(), 1);
        tokens.remove(0)
    }

    /// A child token request from `parent`.
    pub async fn issue_child(
        &self,
        parent: &str,
        grant: v1::TokenGrantRequest,
    ) -> Result<v1::IssueTaskTokenResponse, tonic::Status> {
        let message = v1::IssueTaskTokenRequest {
            lease_epoch: 0,
            principal: String::new(),
            run_id: String::new(),
            parent_token: parent.into(),
            grants: vec![grant],
        };
        self.client()
            .await
            .issue_task_token(request(message, SUPERVISOR))
            .await
            .map(tonic::Response::into_inner)
    }

    /// Authorize over the wire.
    pub async fn authorize(&self, call: v1::AuthorizeRequest) -> v1::AuthorizeResponse {
        self.client()
            .await
            .authorize(call)
            .await
            .expect("Authorize answers denies as responses")
            .into_inner()
    }

    /// Every authorization record of the decision log file, in order.
    pub fn decisions(&self) -> Vec<AuthorizeRecord> {
        JsonlDecisionLog::read(self.config.decision_log_path())
            .expect("the decision log reads")
            .into_iter()
            .filter_map(|e| match e {
                LogEntry::Authorize(r) => Some(r),
                LogEntry::Revoke(_) => None,
            })
            .collect()
    }

    /// A search_logs call on `service/payment-api` inside the window, presented by the
    /// logs worker.
    pub fn search_call(&self, token: &str) -> v1::AuthorizeRequest {
        v1::AuthorizeRequest {
            token: token.into(),
            tool: "search_logs@1".into(),
            action: "logs:read".into(),
            resource: "service/payment-api".into(),
            data_scope: Some(v1::DataScope {
                time_range: Some(range(
                    self.t0 - Duration::from_secs(600),
                    self.t0 - Duration::from_secs(60),
                )),
                max_rows: 100,
            }),
            audience: LOGS_WORKER.into(),
            tenant: String::new(),
            tool_call_id: "call-1".into(),
        }
    }
}

/// A scope without data constraints.
pub fn scope(action: &str, resource: &str) -> v1::PermissionScope {
    v1::PermissionScope {
        action: action.into(),
        resource: resource.into(),
        data_scope: None,
    }
}

/// `[start, end)` on the wire.
pub fn range(start: SystemTime, end: SystemTime) -> v1::TimeRange {
    v1::TimeRange {
        start: Some(prost_types::Timestamp::from(start)),
        end: Some(prost_types::Timestamp::from(end)),
    }
}

/// The claims of a token, read without verifying it (for building forgeries).
pub fn claims_of(token: &str) -> Claims {
    let payload = token
        .split('.')
        .nth(1)
        .expect("a compact JWS has a payload");
    let json = URL_SAFE_NO_PAD.decode(payload).expect("base64url payload");
    serde_json::from_slice(&json).expect("claims JSON")
}

/// The wire reason of a response.
pub fn reason(response: &v1::AuthorizeResponse) -> v1::AuthorizeReason {
    v1::AuthorizeReason::try_from(response.reason).expect("a known reason")
}
