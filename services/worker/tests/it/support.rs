//! The mesh a worker needs, for real: the policy service and the evidence store on
//! loopback gRPC servers over a temporary data directory with the example policy, a
//! supervisor credential to issue task tokens with, and helpers to start workers, build
//! their tasks and call them.

use std::fmt::Debug;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use convene_core::time::to_timestamp;
use convene_evidence_store::EvidenceStoreService;
use convene_mesh::auth;
use convene_mesh::handles::{EvidenceHandle, GrpcEvidenceStore, GrpcPolicy, PolicyHandle};
use convene_mesh::policy_file::dev_credential;
use convene_policy::PolicyService;
use convene_policy::decision_log::{AuthorizeRecord, LogEntry, MemoryDecisionLog};
use convene_proto::v1::{self, worker_client::WorkerClient};
use convene_server::test_util::{TestServer, endpoint};
use convene_server::{GrpcServer, ServerSettings};
use convene_worker::models::ModelSettings;
use convene_worker::profiles::{self, Profile, ProviderRegistry};
use convene_worker::tools::ToolRegistry;
use convene_worker::{WorkerOptions, WorkerService};
use tempfile::TempDir;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;

/// The incident window of the example.
pub const WINDOW_START: &str = "2026-07-23T01:45:00Z";
/// End of the incident window.
pub const WINDOW_END: &str = "2026-07-23T02:10:00Z";
/// The run every test task belongs to.
pub const RUN_ID: &str = "run-incident-20260723";

/// How long [`wait_until`] waits before it fails the test.
const WAIT: Duration = Duration::from_secs(5);

/// Waits until `done` holds of what `probe` reads, reading every 10 ms; fails the test
/// after [`WAIT`], naming `what` and showing the last reading.
pub async fn wait_until<T: Debug>(
    what: &str,
    mut probe: impl FnMut() -> T,
    done: impl Fn(&T) -> bool,
) {
    let deadline = Instant::now() + WAIT;
    loop {
        {
            // The reading may be a lock guard: it is gone before the task sleeps.
            let seen = probe();
            if done(&seen) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "timed out waiting for {what}: {seen:#?}"
            );
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// The example's data directory.
pub fn example_data() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../examples/payment-incident/data")
}

/// The policy service and evidence store, serving on loopback.
pub struct Mesh {
    /// The data directory (keys, credentials, artifacts).
    pub dir: TempDir,
    /// The policy service's decisions.
    pub decisions: Arc<MemoryDecisionLog>,
    /// The compiled example policy.
    pub policy: Arc<convene_mesh::policy_file::Policy>,
    /// The supervisor principal's credential.
    pub supervisor: String,
    /// The policy service's server.
    pub policy_server: TestServer,
    /// The evidence store's server.
    pub evidence_server: TestServer,
}

impl Mesh {
    /// Starts both services with the example policy in a fresh directory.
    pub async fn start() -> Self {
        Self::start_with_policy(None).await
    }

    /// Starts both services with the policy file `policy` (None: the example's) in a
    /// fresh directory.
    pub async fn start_with_policy(policy: Option<PathBuf>) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let policy_config = convene_policy::Config::in_dir(dir.path());
        let source = match policy {
            Some(file) => convene_mesh::policy_file::PolicySource::new(
                Some(file),
                Some(dir.path().join("credentials")),
            ),
            None => policy_config.policy_source(),
        };
        let (policy, _) = source.load().unwrap();
        let ring = convene_tokens::KeyRing::open(policy_config.keys_dir()).unwrap();
        let decisions = Arc::new(MemoryDecisionLog::new());
        let policy_service = PolicyService::builder(policy, ring)
            .decision_log(decisions.clone())
            .build();
        let compiled = policy_service.policy().clone();
        let policy_server =
            TestServer::start(policy_service.add_to(GrpcServer::new(ServerSettings::default())))
                .await;

        let store = EvidenceStoreService::open(
            &convene_evidence_store::Config::in_dir(dir.path()),
            Arc::new(policy_service),
        )
        .unwrap();
        let evidence_server =
            TestServer::start(store.add_to(GrpcServer::new(ServerSettings::default()))).await;

        let supervisor = dev_credential(&dir.path().join("credentials"), "supervisor").unwrap();
        Self {
            dir,
            decisions,
            policy: compiled,
            supervisor,
            policy_server,
            evidence_server,
        }
    }

    /// A gRPC handle on the policy service.
    pub fn policy_handle(&self) -> PolicyHandle {
        Arc::new(GrpcPolicy::connect(&endpoint(self.policy_server.addr)).unwrap())
    }

    /// A gRPC handle on the evidence store.
    pub fn evidence_handle(&self) -> EvidenceHandle {
        Arc::new(GrpcEvidenceStore::connect(&endpoint(self.evidence_server.addr)).unwrap())
    }

    /// The stored model turns among `ids`, in the order of `ids` (an id with nothing
    /// stored is left out), read with `token`.
    pub async fn stored_turns(
        &self,
        token: &str,
        ids: &[String],
    ) -> Vec<convene_worker::agent::turns::StoredTurn> {
        let evidence = self.evidence_handle();
        let found = evidence
            .get_evidence(convene_mesh::auth::request(
                v1::GetEvidenceRequest {
                    evidence_ids: ids.to_vec(),
                },
                token,
            ))
            .await
            .unwrap()
            .into_inner()
            .evidence;
        let mut turns = Vec::new();
        for id in ids {
            let Some(record) = found.iter().find(|e| &e.evidence_id == id) else {
                continue;
            };
            let bytes = evidence
                .get_artifact(convene_mesh::auth::request(
                    v1::GetArtifactRequest {
                        uri: record.artifact_uri.clone(),
                    },
                    token,
                ))
                .await
                .unwrap()
                .into_inner()
                .content;
            turns.push(convene_worker::agent::turns::StoredTurn {
                evidence_id: id.clone(),
                content_hash: record.content_hash.clone(),
                bytes,
            });
        }
        turns
    }

    /// Issues the task token of `grant` through IssueTaskToken, as the supervisor.
    pub async fn issue(&self, grant: v1::TokenGrantRequest) -> v1::IssuedToken {
        self.issue_under(grant, 0).await
    }

    /// [`Self::issue`], as a supervisor replica holding the run under `lease_epoch`.
    pub async fn issue_under(
        &self,
        grant: v1::TokenGrantRequest,
        lease_epoch: u64,
    ) -> v1::IssuedToken {
        let request = v1::IssueTaskTokenRequest {
            lease_epoch,
            principal: "oncall@acme".into(),
            run_id: RUN_ID.into(),
            parent_token: String::new(),
            grants: vec![grant],
        };
        self.policy_handle()
            .issue_task_token(auth::request(request, &self.supervisor))
            .await
            .expect("the supervisor may issue task tokens")
            .into_inner()
            .tokens
            .remove(0)
    }

    /// Revokes token `token_id`, as the supervisor.
    pub async fn revoke_token(&self, token_id: &str) {
        self.policy_handle()
            .revoke(auth::request(
                v1::RevokeRequest {
                    reason: "revoked by the test".into(),
                    target: Some(v1::revoke_request::Target::TokenId(token_id.into())),
                },
                &self.supervisor,
            ))
            .await
            .expect("the supervisor may revoke tokens");
    }

    /// The token `task` needs: its required scopes plus evidence access, over its scope
    /// plus the evidence resource, for `tools` (empty: the profile's).
    pub async fn token_for(&self, task: &v1::DelegationTask, tools: &[&str]) -> String {
        self.token_with_calls(task, tools, 0).await
    }

    /// [`Self::token_for`], allowing `max_calls` tool calls (0: the policy's default).
    pub async fn token_with_calls(
        &self,
        task: &v1::DelegationTask,
        tools: &[&str],
        max_calls: u32,
    ) -> String {
        self.token_under(task, tools, (max_calls, 0)).await
    }

    /// [`Self::token_with_calls`], as a supervisor replica holding the run under
    /// `lease_epoch`.
    pub async fn token_under(
        &self,
        task: &v1::DelegationTask,
        tools: &[&str],
        (max_calls, lease_epoch): (u32, u64),
    ) -> String {
        let mut required = task.required_scopes.clone();
        required.push(scope("evidence:*", "evidence"));
        let mut task_scope = task.scope.clone().unwrap();
        task_scope.resources.push("evidence".into());
        let grant = v1::TokenGrantRequest {
            delegation_id: task.delegation_id.clone(),
            profile_id: task.profile_id.clone(),
            depth: 1,
            required_scopes: required,
            task_scope: Some(task_scope),
            tools: tools.iter().map(|t| (*t).to_owned()).collect(),
            max_calls,
            may_redelegate: false,
            ttl: None,
            max_depth: 0,
        };
        self.issue_under(grant, lease_epoch).await.token
    }

    /// The authorization decisions made for `delegation_id`, in order.
    pub fn decisions_for(&self, delegation_id: &str) -> Vec<AuthorizeRecord> {
        self.decisions
            .entries()
            .into_iter()
            .filter_map(|e| match e {
                LogEntry::Authorize(a) if a.delegation_id == delegation_id => Some(a),
                _ => None,
            })
            .collect()
    }

    /// The evidence prefixes the policy file gives `profile`.
    pub fn prefixes(&self, profile: &str) -> Vec<String> {
        self.policy.profiles[profile].evidence_prefixes.clone()
    }

    /// A worker over this mesh serving `profiles`, on its own loopback server.
    pub async fn worker(&self, profiles: Vec<Profile>, capacity: u32) -> TestWorker {
        self.worker_with_models(profiles, capacity, ModelSettings::default())
            .await
    }

    /// [`Self::worker`] with model settings (retries, prices, span content).
    pub async fn worker_with_models(
        &self,
        profiles: Vec<Profile>,
        capacity: u32,
        models: ModelSettings,
    ) -> TestWorker {
        self.worker_refreshing(
            profiles,
            capacity,
            models,
            convene_mesh::auth::DEFAULT_KEY_REFRESH,
        )
        .await
    }

    /// [`Self::worker_with_models`] fetching the policy service's keys and revocations
    /// again every `key_refresh`.
    pub async fn worker_refreshing(
        &self,
        profiles: Vec<Profile>,
        capacity: u32,
        models: ModelSettings,
        key_refresh: Duration,
    ) -> TestWorker {
        let service = WorkerService::new(
            WorkerOptions {
                worker_id: "worker-test-1".into(),
                capacity,
                exit_process_on_fault: false,
                models: Arc::new(models.clone()),
                key_refresh,
            },
            profiles,
            &ProviderRegistry::builtin(&models.client()),
            ToolRegistry::builtin(example_data()),
            self.policy_handle(),
            self.evidence_handle(),
        )
        .unwrap();
        TestWorker::start(&self.supervisor, service).await
    }
}

/// A worker serving on loopback, with a gRPC client.
pub struct TestWorker {
    /// The service (for in-flight counts).
    pub service: WorkerService,
    /// Its server, which serves until the worker is dropped.
    _server: TestServer,
    /// A client connected to it, calling as the supervisor.
    pub client: WorkerClient<InterceptedService<Channel, AsSupervisor>>,
    /// A client connected to it that presents no credential.
    pub anonymous: WorkerClient<Channel>,
}

/// Sends the supervisor's credential with every call, as the supervisor does.
#[derive(Clone)]
pub struct AsSupervisor(String);

impl tonic::service::Interceptor for AsSupervisor {
    fn call(&mut self, request: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        Ok(auth::with_bearer(request, &self.0))
    }
}

impl TestWorker {
    /// Serves `service` with no request timeout (Execute runs as long as its task); the
    /// client calls with the `supervisor` credential.
    pub async fn start(supervisor: &str, service: WorkerService) -> Self {
        let settings = ServerSettings {
            request_timeout: None,
            ..ServerSettings::default()
        };
        let server = TestServer::start(service.add_to(GrpcServer::new(settings))).await;
        let channel = server.channel().await;
        let client =
            WorkerClient::with_interceptor(channel.clone(), AsSupervisor(supervisor.to_owned()));
        Self {
            service,
            _server: server,
            client,
            anonymous: WorkerClient::new(channel),
        }
    }

    /// Calls PlanTurn over gRPC.
    pub async fn plan_turn(
        &self,
        request: v1::PlanTurnRequest,
    ) -> Result<v1::PlanTurnResponse, tonic::Status> {
        Ok(self.client.clone().plan_turn(request).await?.into_inner())
    }

    /// Calls Execute over gRPC on a task of its own (attempt 1), so the test can act
    /// while the delegation runs.
    pub fn execute_in_background(
        &self,
        task: &v1::DelegationTask,
        token: &str,
    ) -> tokio::task::JoinHandle<Result<tonic::Response<v1::WorkerExecuteResponse>, tonic::Status>>
    {
        let mut client = self.client.clone();
        let request = v1::WorkerExecuteRequest {
            lease_valid_until: None,
            task: Some(task.clone()),
            task_token: token.to_owned(),
            attempt: 1,
        };
        tokio::spawn(async move { client.execute(request).await })
    }

    /// Calls Execute over gRPC.
    pub async fn execute(
        &self,
        task: &v1::DelegationTask,
        token: &str,
        attempt: u32,
    ) -> Result<v1::TaskResult, tonic::Status> {
        let response = self
            .client
            .clone()
            .execute(v1::WorkerExecuteRequest {
                lease_valid_until: None,
                task: Some(task.clone()),
                task_token: token.to_owned(),
                attempt,
            })
            .await?;
        Ok(response
            .into_inner()
            .result
            .expect("Execute answers with a result"))
    }
}

/// The example profiles, with `edit` applied to the one called `id`.
pub fn profiles_with(id: &str, edit: impl FnOnce(&mut Profile)) -> Vec<Profile> {
    let mut profiles = profiles::example().unwrap();
    edit(profiles.iter_mut().find(|p| p.profile.id == id).unwrap());
    profiles
}

/// A token shaped like a task token (a JWS with `claims` as its payload) but not
/// signed by anyone: for calls where the worker reads the claims without verifying them
/// and makes no call with the token.
pub fn unsigned_token(claims: &serde_json::Value) -> String {
    use base64::Engine as _;
    let encode = |bytes: &[u8]| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes);
    format!(
        "{}.{}.{}",
        encode(br#"{"alg":"EdDSA","typ":"JWT"}"#),
        encode(claims.to_string().as_bytes()),
        encode(b"not-a-signature")
    )
}

/// A permission scope.
pub fn scope(action: &str, resource: &str) -> v1::PermissionScope {
    v1::PermissionScope {
        action: action.into(),
        resource: resource.into(),
        data_scope: None,
    }
}

fn time(s: &str) -> prost_types::Timestamp {
    to_timestamp(humantime::parse_rfc3339(s).unwrap())
}

/// The example run's delegation for `profile` (a `-model` twin gets its playbook
/// twin's task), with a deadline `timeout` from now.
pub fn task(delegation_id: &str, profile: &str, timeout: Duration) -> v1::DelegationTask {
    let (goal, resources, required, tools, prefixes): (&str, &[&str], Vec<_>, &[&str], &[&str]) =
        match profile.trim_end_matches("-model") {
            "logs-investigator" => (
                "Identify the main error patterns in payment logs and when they first occurred.",
                &["service/payment-api", "service/risk-gateway"],
                vec![scope("logs:read", "service/*")],
                &["search_logs@1"],
                &["logs://"],
            ),
            "metrics-investigator" => (
                "Quantify the impact and the timeline of the success-rate and latency change.",
                &["metric/payment.*", "metric/gateway.*"],
                vec![scope("metrics:read", "metric/*")],
                &["query_metrics@1"],
                &["metrics://"],
            ),
            "change-auditor" => (
                "Find rule, configuration and deployment changes that coincide with the drop.",
                &["change/*", "metric/risk.*"],
                vec![
                    scope("changes:read", "change/*"),
                    scope("metrics:read", "metric/risk.*"),
                ],
                &["list_changes@1", "query_metrics@1"],
                &["changes://", "metrics://risk."],
            ),
            other => panic!("no example task for {other}"),
        };
    v1::DelegationTask {
        delegation_id: delegation_id.into(),
        run_id: RUN_ID.into(),
        parent_delegation_id: String::new(),
        depth: 1,
        profile_id: profile.into(),
        goal: goal.into(),
        acceptance_criteria: vec!["Cite read-only query evidence for every conclusion".into()],
        scope: Some(v1::TaskScope {
            resources: resources.iter().map(|r| (*r).to_owned()).collect(),
            time_range: Some(v1::TimeRange {
                start: Some(time(WINDOW_START)),
                end: Some(time(WINDOW_END)),
            }),
        }),
        input_refs: Vec::new(),
        allowed_tools: tools.iter().map(|t| (*t).to_owned()).collect(),
        allowed_evidence_prefixes: prefixes.iter().map(|p| (*p).to_owned()).collect(),
        required_scopes: required,
        deadline: Some(to_timestamp(SystemTime::now() + timeout)),
        budget: None,
        may_redelegate: false,
        name: profile.split('-').next().unwrap_or(profile).into(),
        round: 0,
        call_index: 0,
    }
}

/// The status of a result.
pub fn status(result: &v1::TaskResult) -> v1::TaskStatus {
    v1::TaskStatus::try_from(result.status).unwrap()
}

/// The claim on `topic`.
pub fn claim<'a>(result: &'a v1::TaskResult, topic: &str) -> &'a v1::Claim {
    result
        .claims
        .iter()
        .find(|c| c.topic == topic)
        .unwrap_or_else(|| panic!("no claim on {topic}: {:#?}", result.claims))
}
