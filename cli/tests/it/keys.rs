//! Signing keys rotated and retired, and a token revoked, while the mesh runs. The
//! policy service runs in this process, so the test can rotate and retire its keys;
//! the evidence store, the supervisor and a worker are `convene serve` processes that
//! verify task tokens against it over gRPC, each fetching its keys and revocations
//! again every [`KEY_REFRESH`]. What one of them refuses, it refused by itself.

use std::future::Future;
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant, SystemTime};

use convene_mesh::auth;
use convene_mesh::policy_file::dev_credential;
use convene_policy::PolicyService;
use convene_proto::v1::{
    self, evidence_store_client::EvidenceStoreClient, policy_client::PolicyClient,
    supervisor_client::SupervisorClient, worker_client::WorkerClient,
};
use convene_server::test_util::{TestServer, endpoint, free_port, wait_ready};
use convene_server::{GrpcServer, ServerSettings};
use tempfile::TempDir;
use tonic::{Code, Status};

use crate::support::{convene, repo_root};

/// How often every verifier of the mesh fetches keys and revocations again.
const KEY_REFRESH: Duration = Duration::from_millis(400);
/// What a refusal may take beyond [`KEY_REFRESH`]: the calls that notice it, on a busy
/// machine (seen: over a second with the whole suite running on two cores). Still far
/// below the default interval of a minute, which these tests would not meet.
const MARGIN: Duration = Duration::from_secs(5);
/// How long a service process may take to serve.
const START: Duration = Duration::from_secs(60);
/// The run every token of these tests belongs to.
const RUN_ID: &str = "run-keys-20260723";
/// The profile of every token and task: the example's logs investigator.
const PROFILE: &str = "logs-investigator";

/// A `convene serve` process, killed when dropped.
struct Service {
    name: &'static str,
    addr: SocketAddr,
    child: Child,
}

impl Drop for Service {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The policy service in this process on a loopback port, with the example policy and
/// development credentials in a fresh data directory that the processes share.
struct Mesh {
    dir: TempDir,
    policy: PolicyService,
    policy_server: TestServer,
    /// The supervisor principal's credential.
    supervisor: String,
}

impl Mesh {
    async fn start() -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let config = convene_policy::Config::in_dir(dir.path());
        let policy = PolicyService::open(&config).expect("the policy service opens");
        let policy_server =
            TestServer::start(policy.add_to(GrpcServer::new(ServerSettings::default()))).await;
        let supervisor = dev_credential(&dir.path().join("credentials"), "supervisor")
            .expect("the supervisor's development credential");
        Self {
            dir,
            policy,
            policy_server,
            supervisor,
        }
    }

    fn data(&self) -> &Path {
        self.dir.path()
    }

    /// Starts `convene serve <name>` on a free loopback port with `env`, its state in
    /// memory, verifying tokens with keys fetched every [`KEY_REFRESH`]; waits until it
    /// serves.
    async fn serve(&self, name: &'static str, env: &[(&str, String)]) -> Service {
        let addr = SocketAddr::from(([127, 0, 0, 1], free_port()));
        let mut cmd = convene();
        cmd.args(["serve", name])
            .env("CONVENE_SERVER__LISTEN", addr.to_string())
            .env("CONVENE_DATA_DIR", self.data())
            .env(
                "CONVENE_KEY_REFRESH",
                humantime::format_duration(KEY_REFRESH).to_string(),
            )
            .env("RUST_LOG", "error")
            .stdin(Stdio::null());
        for (key, value) in env {
            cmd.env(key, value);
        }
        let mut service = Service {
            name,
            addr,
            child: cmd
                .spawn()
                .unwrap_or_else(|e| panic!("cannot start {name}: {e}")),
        };
        let deadline = Instant::now() + START;
        loop {
            if let Some(status) = service.child.try_wait().expect("the process's status") {
                panic!("{name} exited before it served ({status}); see its log above");
            }
            if tokio::time::timeout(Duration::from_millis(500), wait_ready(addr))
                .await
                .is_ok()
            {
                return service;
            }
            assert!(
                Instant::now() < deadline,
                "{} did not serve on {} within {START:?}",
                service.name,
                service.addr
            );
        }
    }

    fn policy_endpoint(&self) -> String {
        endpoint(self.policy_server.addr)
    }

    async fn evidence_store(&self) -> Service {
        self.serve(
            "evidence-store",
            &[
                ("CONVENE_POLICY_ENDPOINT", self.policy_endpoint()),
                ("CONVENE_DATABASE_URL", "memory".to_owned()),
            ],
        )
        .await
    }

    /// The supervisor, calling `evidence` and an approval service of its own.
    async fn supervisor(&self, evidence: &Service, approval: &Service) -> Service {
        self.serve(
            "supervisor",
            &[
                ("CONVENE_POLICY_ENDPOINT", self.policy_endpoint()),
                ("CONVENE_EVIDENCE_ENDPOINT", endpoint(evidence.addr)),
                ("CONVENE_APPROVAL_ENDPOINT", endpoint(approval.addr)),
                (
                    "CONVENE_INTERNAL_LISTEN",
                    format!("127.0.0.1:{}", free_port()),
                ),
                ("CONVENE_DATABASE_URL", "memory".to_owned()),
            ],
        )
        .await
    }

    /// A worker serving the example profiles, storing its evidence in `evidence`; the
    /// test calls it as the supervisor does, so it registers nowhere.
    async fn worker(&self, evidence: &Service, supervisor: &Service) -> Service {
        self.serve(
            "worker",
            &[
                ("CONVENE_POLICY_ENDPOINT", self.policy_endpoint()),
                ("CONVENE_EVIDENCE_ENDPOINT", endpoint(evidence.addr)),
                ("CONVENE_SUPERVISOR_ENDPOINT", endpoint(supervisor.addr)),
                ("CONVENE_REGISTER", "false".to_owned()),
                ("CONVENE_WORKER_ID", "worker-keys-1".to_owned()),
                (
                    "CONVENE_TOOLS_DATA_DIR",
                    repo_root()
                        .join("examples/payment-incident/data")
                        .display()
                        .to_string(),
                ),
            ],
        )
        .await
    }

    /// One task token per delegation id, issued through IssueTaskToken as the
    /// supervisor, for the example's logs investigator acting for oncall@acme: evidence
    /// access, and the supervisor in its audience (it may redelegate), so one token is
    /// presented to every service.
    async fn issue(&self, delegations: &[&str]) -> Vec<v1::IssuedToken> {
        let task = task("");
        let mut required = task.required_scopes.clone();
        required.push(crate::support::scope("evidence:*", "evidence"));
        let mut task_scope = task.scope.clone().expect("the task's scope");
        task_scope.resources.push("evidence".into());
        let grants = delegations
            .iter()
            .map(|delegation| v1::TokenGrantRequest {
                delegation_id: (*delegation).to_owned(),
                profile_id: PROFILE.into(),
                depth: 1,
                required_scopes: required.clone(),
                task_scope: Some(task_scope.clone()),
                tools: Vec::new(),
                max_calls: 0,
                may_redelegate: true,
                ttl: None,
                max_depth: 0,
            })
            .collect();
        let request = v1::IssueTaskTokenRequest {
            lease_epoch: 0,
            principal: "oncall@acme".into(),
            run_id: RUN_ID.into(),
            parent_token: String::new(),
            grants,
        };
        PolicyClient::new(self.policy_server.channel().await)
            .issue_task_token(auth::request(request, &self.supervisor))
            .await
            .expect("the supervisor may issue task tokens")
            .into_inner()
            .tokens
    }

    /// Revokes token `token_id` through Policy.Revoke, as the supervisor.
    async fn revoke(&self, token_id: &str) {
        PolicyClient::new(self.policy_server.channel().await)
            .revoke(auth::request(
                v1::RevokeRequest {
                    reason: "revoked by the key test".into(),
                    target: Some(v1::revoke_request::Target::TokenId(token_id.into())),
                },
                &self.supervisor,
            ))
            .await
            .expect("the supervisor may revoke tokens");
    }

    /// Stores an artifact of its own with `token` at the evidence store.
    async fn put(&self, evidence: &Service, token: &str) -> Result<(), Status> {
        let content = format!(
            "{{\"written_at\":{:?}}}",
            SystemTime::now()
                .duration_since(SystemTime::UNIX_EPOCH)
                .unwrap_or_default()
        );
        EvidenceStoreClient::new(channel(evidence).await)
            .put_artifact(auth::request(
                v1::PutArtifactRequest {
                    content: content.into_bytes(),
                    media_type: "application/json".into(),
                    tool_call_id: "call-keys".into(),
                    evidence: None,
                },
                token,
            ))
            .await
            .map(|stored| {
                assert!(
                    stored.into_inner().artifact.is_some(),
                    "a stored artifact is described"
                );
            })
    }

    /// Runs delegation `delegation_id` on `worker` with `token`, as the supervisor does;
    /// an accepted task must complete.
    async fn execute(
        &self,
        worker: &Service,
        delegation_id: &str,
        token: &str,
    ) -> Result<(), Status> {
        let request = v1::WorkerExecuteRequest {
            lease_valid_until: None,
            task: Some(task(delegation_id)),
            task_token: token.to_owned(),
            attempt: 1,
        };
        let result = WorkerClient::new(channel(worker).await)
            .execute(auth::request(request, &self.supervisor))
            .await?
            .into_inner()
            .result
            .expect("Execute answers with a result");
        assert_eq!(
            result.status,
            v1::TaskStatus::Completed as i32,
            "an accepted task completes: {result:#?}"
        );
        Ok(())
    }

    /// Asks `supervisor` to delegate with `token`, as a worker's `delegate@1` does. The
    /// run is not running there, which the supervisor says only once the token holds:
    /// that refusal is an accepted token.
    async fn delegate(&self, supervisor: &Service, token: &str) -> Result<(), Status> {
        let refused = SupervisorClient::new(channel(supervisor).await)
            .delegate(auth::request(v1::DelegateRequest::default(), token))
            .await
            .expect_err("no run of the test runs in the supervisor");
        if refused.code() == Code::FailedPrecondition
            && refused
                .message()
                .contains("is not running in this supervisor")
        {
            Ok(())
        } else {
            Err(refused)
        }
    }
}

async fn channel(service: &Service) -> tonic::transport::Channel {
    tonic::transport::Channel::from_shared(endpoint(service.addr))
        .expect("a loopback URI")
        .connect()
        .await
        .unwrap_or_else(|e| panic!("cannot reach {}: {e}", service.name))
}

/// The example run's logs investigation as delegation `id`.
fn task(id: &str) -> v1::DelegationTask {
    crate::support::logs_task(id, PROFILE, RUN_ID)
}

/// Calls `probe` every 25 ms until `done` holds of its answer; returns that answer and
/// how long after `since` it came.
///
/// # Panics
///
/// When it does not hold within `limit` of `since`, showing the last answer.
async fn first_answer<F, Fut>(
    what: &str,
    since: Instant,
    limit: Duration,
    mut probe: F,
    done: impl Fn(&Result<(), Status>) -> bool,
) -> (Result<(), Status>, Duration)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<(), Status>>,
{
    loop {
        let answer = probe().await;
        let elapsed = since.elapsed();
        if done(&answer) {
            return (answer, elapsed);
        }
        assert!(
            elapsed < limit,
            "{what}: not within {limit:?}; the last answer: {answer:?}"
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// Whether `answer` refuses a token for its unknown key id.
fn unknown_key(answer: &Result<(), Status>) -> bool {
    matches!(answer, Err(s) if s.code() == Code::Unauthenticated && s.message().contains("UnknownKey"))
}

/// Asserts that `answer`, which came `after` the key was retired, refuses the token
/// for the key it names.
fn assert_refused_for_key(service: &str, answer: &Result<(), Status>, after: Duration) {
    assert!(
        unknown_key(answer),
        "{service} must refuse a token of the retired key as UNAUTHENTICATED naming the key: {answer:?}"
    );
    assert!(
        after <= KEY_REFRESH + MARGIN,
        "{service} refused the retired key {after:?} after it was retired, more than the \
         refresh interval {KEY_REFRESH:?} and {MARGIN:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retired_key_is_refused_by_every_service_within_the_refresh_interval() {
    let mesh = Mesh::start().await;
    let evidence = mesh.evidence_store().await;
    let approval = mesh
        .serve("approval", &[("CONVENE_DATABASE_URL", "memory".to_owned())])
        .await;
    let supervisor = mesh.supervisor(&evidence, &approval).await;
    let worker = mesh.worker(&evidence, &supervisor).await;

    // Key A: one token, accepted by all three.
    let a = mesh.issue(&["del-keys-a"]).await.remove(0);
    mesh.put(&evidence, &a.token)
        .await
        .expect("the evidence store accepts a token of the active key");
    mesh.execute(&worker, &a.delegation_id, &a.token)
        .await
        .expect("the worker runs a task under a token of the active key");
    mesh.delegate(&supervisor, &a.token)
        .await
        .expect("the supervisor authenticates a token of the active key");

    // Key B signs from now on; A keeps verifying.
    let kid_b = mesh.policy.rotate_key().expect("the key rotates");
    let b = mesh.issue(&["del-keys-b"]).await.remove(0);
    let rotated = Instant::now();
    mesh.put(&evidence, &a.token)
        .await
        .expect("a rotated key keeps verifying at the evidence store");
    mesh.execute(&worker, &a.delegation_id, &a.token)
        .await
        .expect("a rotated key keeps verifying at the worker");
    mesh.delegate(&supervisor, &a.token)
        .await
        .expect("a rotated key keeps verifying at the supervisor");
    // Each learns B from the first token naming it (at most once a refresh interval).
    let not_unknown = |answer: &Result<(), Status>| !unknown_key(answer);
    let limit = KEY_REFRESH + MARGIN;
    let (stored, _) = first_answer(
        "the evidence store accepting key B",
        rotated,
        limit,
        || mesh.put(&evidence, &b.token),
        not_unknown,
    )
    .await;
    stored.expect("the evidence store accepts a token of the new key");
    let (ran, _) = first_answer(
        "the worker accepting key B",
        rotated,
        limit,
        || mesh.execute(&worker, &b.delegation_id, &b.token),
        not_unknown,
    )
    .await;
    ran.expect("the worker accepts a token of the new key");
    let (delegated, _) = first_answer(
        "the supervisor accepting key B",
        rotated,
        limit,
        || mesh.delegate(&supervisor, &b.token),
        not_unknown,
    )
    .await;
    delegated.expect("the supervisor accepts a token of the new key");
    // Knowing B, every service still takes A.
    mesh.put(&evidence, &a.token)
        .await
        .expect("both keys verify at the evidence store");
    mesh.execute(&worker, &a.delegation_id, &a.token)
        .await
        .expect("both keys verify at the worker");
    mesh.delegate(&supervisor, &a.token)
        .await
        .expect("both keys verify at the supervisor");

    // Retire A: within one refresh every service refuses its token, naming the key.
    let kid_a = {
        let keys = PolicyClient::new(mesh.policy_server.channel().await)
            .get_signing_keys(v1::GetSigningKeysRequest::default())
            .await
            .expect("the keys are published")
            .into_inner()
            .keys;
        let kids: Vec<String> = keys.into_iter().map(|k| k.kid).collect();
        assert_eq!(
            kids.len(),
            2,
            "the active key and the previous one: {kids:?}"
        );
        assert_eq!(kids[0], kid_b, "the active key is listed first");
        kids[1].clone()
    };
    mesh.policy
        .retire_key(&kid_a)
        .expect("the previous key retires");
    let retired = Instant::now();
    let refused = |answer: &Result<(), Status>| answer.is_err();
    let ((at_store, store_after), (at_worker, worker_after), (at_supervisor, supervisor_after)) = tokio::join!(
        first_answer(
            "the evidence store refusing the retired key",
            retired,
            limit,
            || mesh.put(&evidence, &a.token),
            refused,
        ),
        first_answer(
            "the worker refusing the retired key",
            retired,
            limit,
            || mesh.execute(&worker, &a.delegation_id, &a.token),
            refused,
        ),
        first_answer(
            "the supervisor refusing the retired key",
            retired,
            limit,
            || mesh.delegate(&supervisor, &a.token),
            refused,
        ),
    );
    assert_refused_for_key("the evidence store", &at_store, store_after);
    assert_refused_for_key("the worker", &at_worker, worker_after);
    assert_refused_for_key("the supervisor", &at_supervisor, supervisor_after);
    for answer in [&at_store, &at_worker, &at_supervisor] {
        let message = answer.as_ref().unwrap_err().message();
        assert!(
            message.contains(&kid_a),
            "the refusal names the key: {message}"
        );
    }

    // And it stays refused, while B keeps working everywhere.
    assert!(unknown_key(&mesh.put(&evidence, &a.token).await));
    assert!(unknown_key(
        &mesh.execute(&worker, &a.delegation_id, &a.token).await
    ));
    assert!(unknown_key(&mesh.delegate(&supervisor, &a.token).await));
    mesh.put(&evidence, &b.token)
        .await
        .expect("the active key keeps verifying at the evidence store");
    mesh.execute(&worker, &b.delegation_id, &b.token)
        .await
        .expect("the active key keeps verifying at the worker");
    mesh.delegate(&supervisor, &b.token)
        .await
        .expect("the active key keeps verifying at the supervisor");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_evidence_store_refuses_a_revoked_token_after_one_refresh() {
    let mesh = Mesh::start().await;
    let evidence = mesh.evidence_store().await;
    let mut tokens = mesh.issue(&["del-revoked", "del-sibling"]).await;
    let sibling = tokens.pop().expect("two tokens");
    let revoked = tokens.pop().expect("two tokens");
    for token in [&revoked, &sibling] {
        mesh.put(&evidence, &token.token)
            .await
            .expect("a live token stores evidence");
    }

    mesh.revoke(&revoked.token_id).await;
    let since = Instant::now();
    let (answer, after) = first_answer(
        "the evidence store refusing the revoked token",
        since,
        KEY_REFRESH + MARGIN,
        || mesh.put(&evidence, &revoked.token),
        |answer| answer.is_err(),
    )
    .await;
    let refusal = answer.unwrap_err();
    assert_eq!(refusal.code(), Code::Unauthenticated, "{refusal:?}");
    assert!(
        refusal.message().contains("Revoked") && refusal.message().contains(&revoked.token_id),
        "the refusal says the token was revoked: {refusal:?}"
    );
    assert!(
        after <= KEY_REFRESH + MARGIN,
        "refused {after:?} after the revocation"
    );

    // Only that token: its sibling of the same run and key still stores evidence.
    mesh.put(&evidence, &sibling.token)
        .await
        .expect("an unrevoked token keeps working");
    assert!(
        mesh.put(&evidence, &revoked.token).await.is_err(),
        "a revoked token stays refused"
    );
}
