//! A worker process (`convene serve worker`) attacked over the network. The policy
//! service and the evidence store run beside it, each its own `convene serve` process,
//! and the worker's model-driven profiles call a scripted OpenAI-compatible server in
//! this test. Whoever is not the supervisor, and whatever task token is not genuine,
//! current, unrevoked and the task's own, is refused before the model hears of it: the
//! model server counts zero requests until the supervisor itself sends a task under a
//! valid token, which the worker then investigates with the model (so the zero means
//! something). On plaintext the supervisor proves itself with its credential; under
//! mutual TLS only its certificate counts.

use std::fs::File;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use convene_mesh::auth;
use convene_mesh::policy_file::dev_credential;
use convene_proto::v1::{self, policy_client::PolicyClient, worker_client::WorkerClient};
use convene_server::test_util::pki::{TestCert, TestPki};
use convene_server::test_util::{free_port, wait_ready};
use convene_worker::model_server::{PlaybookResponder, ScriptedModel};
use serde_json::json;
use tokio::process::{Child, Command};
use tonic::Code;
use tonic::transport::Channel;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};

use crate::support::{convene, repo_root};

/// The run every task and token of these tests belongs to.
const RUN_ID: &str = "run-guard-20260723";
/// The model-driven logs specialist, whose tasks the attacker sends.
const PROFILE: &str = "logs-investigator-model";
/// The model-driven planner.
const PLANNER: &str = "incident-planner-model";
/// A person of the example policy, not a service.
const PERSON: &str = "oncall@acme";
/// The worker's `key_refresh`: a revocation reaches it within this long.
const KEY_REFRESH: Duration = Duration::from_millis(500);
/// How long a process may take to start serving: the machine may be a loaded 2-core one.
const START: Duration = Duration::from_secs(60);
/// The deadline of every call to the worker.
const CALL: Duration = Duration::from_secs(60);

/// A `convene serve` process with its standard error in a file; killed when dropped.
struct Service {
    name: &'static str,
    child: Child,
    log: PathBuf,
}

impl Service {
    /// Starts `convene serve <service>` with `env`, logging warnings to `<dir>/<name>.log`.
    fn spawn(name: &'static str, service: &str, dir: &Path, env: &[(&str, String)]) -> Self {
        let log = dir.join(format!("{name}.log"));
        let mut cmd = Command::from(convene());
        cmd.args(["serve", service])
            .env_remove("CONVENE_DATABASE_URL")
            .env_remove("CONVENE_POLICY_FILE")
            .env_remove("CONVENE_PROFILES_FILE")
            .env_remove("CONVENE_MODEL")
            .env("RUST_LOG", "warn")
            .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(File::create(&log).expect("a log file"))
            .kill_on_drop(true);
        let child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {name}: {e}"));
        Self { name, child, log }
    }

    /// What it logged so far.
    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits for `ready`, failing the test (with the log) if the process exits first or
    /// `ready` takes longer than [`START`].
    async fn wait(&mut self, ready: impl Future<Output = ()>) {
        tokio::select! {
            () = ready => {}
            status = self.child.wait() => {
                panic!("{} exited ({status:?}) before serving:\n{}", self.name, self.log())
            }
            () = tokio::time::sleep(START) => {
                panic!("{} did not serve within {START:?}:\n{}", self.name, self.log())
            }
        }
    }
}

/// A policy service process over a data directory of its own: its own signing keys and
/// development credentials.
struct Policy {
    _service: Service,
    endpoint: String,
    credentials: PathBuf,
}

impl Policy {
    async fn start(name: &'static str, dir: &Path) -> Self {
        let data = dir.join(name);
        std::fs::create_dir_all(&data).expect("a data directory");
        let port = free_port();
        let mut service = Service::spawn(
            name,
            "policy",
            dir,
            &[
                ("CONVENE_DATA_DIR", data.display().to_string()),
                ("CONVENE_SERVER__LISTEN", format!("127.0.0.1:{port}")),
            ],
        );
        service
            .wait(wait_ready(SocketAddr::from(([127, 0, 0, 1], port))))
            .await;
        Self {
            _service: service,
            endpoint: format!("http://127.0.0.1:{port}"),
            credentials: data.join("credentials"),
        }
    }

    /// The development credential of `principal`, as the service wrote it.
    fn credential(&self, principal: &str) -> String {
        dev_credential(&self.credentials, principal).expect("a development credential")
    }

    async fn client(&self) -> PolicyClient<Channel> {
        PolicyClient::connect(self.endpoint.clone())
            .await
            .expect("the policy service answers")
    }

    /// A task token of run [`RUN_ID`] for `grant`, issued as the supervisor.
    async fn issue(&self, grant: v1::TokenGrantRequest) -> v1::IssuedToken {
        let request = v1::IssueTaskTokenRequest {
            lease_epoch: 0,
            principal: PERSON.into(),
            run_id: RUN_ID.into(),
            parent_token: String::new(),
            grants: vec![grant],
        };
        self.client()
            .await
            .issue_task_token(auth::request(request, &self.credential("supervisor")))
            .await
            .expect("the supervisor may issue task tokens")
            .into_inner()
            .tokens
            .remove(0)
    }

    /// Revokes the token `token_id`, as the supervisor.
    async fn revoke(&self, token_id: &str) {
        let request = v1::RevokeRequest {
            reason: "stolen".into(),
            target: Some(v1::revoke_request::Target::TokenId(token_id.into())),
        };
        self.client()
            .await
            .revoke(auth::request(request, &self.credential("supervisor")))
            .await
            .expect("the supervisor may revoke tokens");
    }
}

/// The services a worker needs, each its own process, and a temporary directory for
/// their state and logs.
struct Mesh {
    dir: tempfile::TempDir,
    policy: Policy,
    _evidence: Service,
    evidence_endpoint: String,
}

impl Mesh {
    async fn start() -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let policy = Policy::start("policy", dir.path()).await;
        let port = free_port();
        // The evidence store shares the policy service's data directory, and so the
        // development credentials it wrote.
        let mut evidence = Service::spawn(
            "evidence-store",
            "evidence-store",
            dir.path(),
            &[
                (
                    "CONVENE_DATA_DIR",
                    dir.path().join("policy").display().to_string(),
                ),
                ("CONVENE_SERVER__LISTEN", format!("127.0.0.1:{port}")),
                ("CONVENE_POLICY_ENDPOINT", policy.endpoint.clone()),
            ],
        );
        evidence
            .wait(wait_ready(SocketAddr::from(([127, 0, 0, 1], port))))
            .await;
        Self {
            dir,
            policy,
            _evidence: evidence,
            evidence_endpoint: format!("http://127.0.0.1:{port}"),
        }
    }

    /// A `convene serve worker` of this mesh (the example profiles, its `openai` ones
    /// pointed at `model`), not registered with any supervisor, fetching keys and
    /// revocations every [`KEY_REFRESH`]; over TLS with `pki`'s client CA when given.
    async fn worker(&self, model: &ScriptedModel, mtls: Option<&TestPki>) -> Worker {
        let port = free_port();
        let addr = SocketAddr::from(([127, 0, 0, 1], port));
        let mut env = vec![
            ("CONVENE_SERVER__LISTEN", addr.to_string()),
            (
                "CONVENE_DATA_DIR",
                self.dir.path().join("worker").display().to_string(),
            ),
            ("CONVENE_WORKER_ID", "worker-under-attack".to_owned()),
            ("CONVENE_REGISTER", "false".to_owned()),
            // Nothing serves there: these tasks never delegate.
            (
                "CONVENE_SUPERVISOR_ENDPOINT",
                format!("http://127.0.0.1:{}", free_port()),
            ),
            ("CONVENE_POLICY_ENDPOINT", self.policy.endpoint.clone()),
            ("CONVENE_EVIDENCE_ENDPOINT", self.evidence_endpoint.clone()),
            (
                "CONVENE_TOOLS_DATA_DIR",
                repo_root()
                    .join("examples/payment-incident/data")
                    .display()
                    .to_string(),
            ),
            (
                "CONVENE_KEY_REFRESH",
                humantime::format_duration(KEY_REFRESH).to_string(),
            ),
            ("OPENAI_BASE_URL", model.base_url()),
            ("OPENAI_API_KEY", "sk-worker-guard-test".to_owned()),
        ];
        if let Some(pki) = mtls {
            let tls = self.dir.path().join("tls");
            std::fs::create_dir_all(&tls).expect("a TLS directory");
            let (cert, key) = pki.servers.localhost().write(&tls, "worker");
            let client_ca =
                convene_server::test_util::pki::write(&tls, "client-ca.crt", &pki.clients.pem());
            env.extend([
                ("CONVENE_TLS_CERT", cert.display().to_string()),
                ("CONVENE_TLS_KEY", key.display().to_string()),
                ("CONVENE_TLS_CLIENT_CA", client_ca.display().to_string()),
            ]);
        }
        let mut service = Service::spawn("worker", "worker", self.dir.path(), &env);
        match mtls {
            None => service.wait(wait_ready(addr)).await,
            // Any certificate of the client CA may ask for its health.
            Some(pki) => service.wait(tls_ready(pki, addr)).await,
        }
        Worker { service, addr }
    }
}

/// Waits until the worker at `addr` reports SERVING over mutual TLS.
async fn tls_ready(pki: &TestPki, addr: SocketAddr) {
    let probe = pki.clients.service("probe");
    loop {
        if let Ok(channel) = pki.connect(addr, Some(&probe)).await {
            let answer = HealthClient::new(channel)
                .check(HealthCheckRequest {
                    service: String::new(),
                })
                .await;
            if answer.is_ok_and(|a| a.into_inner().status == ServingStatus::Serving as i32) {
                return;
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The worker process under attack.
struct Worker {
    service: Service,
    addr: SocketAddr,
}

impl Worker {
    /// A plaintext client.
    async fn plain(&self) -> WorkerClient<Channel> {
        WorkerClient::connect(format!("http://{}", self.addr))
            .await
            .expect("the worker answers")
    }

    /// A client presenting `cert` over TLS.
    async fn presenting(&self, pki: &TestPki, cert: &TestCert) -> WorkerClient<Channel> {
        WorkerClient::new(
            pki.connect(self.addr, Some(cert))
                .await
                .expect("a certificate of the client CA gets through the handshake"),
        )
    }
}

/// `message` with `credential` as its bearer, if any, and the call's deadline.
fn call<T>(message: T, credential: Option<&str>) -> tonic::Request<T> {
    let mut request = match credential {
        Some(c) => auth::request(message, c),
        None => tonic::Request::new(message),
    };
    request.set_timeout(CALL);
    request
}

/// The example's logs task for the model-driven specialist, as delegation `id`.
fn task(id: &str) -> v1::DelegationTask {
    crate::support::logs_task(id, PROFILE, RUN_ID)
}

/// What `task` needs from its token: its scopes plus evidence access.
fn grant(task: &v1::DelegationTask) -> v1::TokenGrantRequest {
    let mut required = task.required_scopes.clone();
    required.push(crate::support::scope("evidence:*", "evidence"));
    let mut task_scope = task.scope.clone().expect("a scope");
    task_scope.resources.push("evidence".into());
    v1::TokenGrantRequest {
        delegation_id: task.delegation_id.clone(),
        profile_id: task.profile_id.clone(),
        depth: 1,
        required_scopes: required,
        task_scope: Some(task_scope),
        ..v1::TokenGrantRequest::default()
    }
}

/// A planner's grant: bound to the run and the planner profile.
fn planner_grant() -> v1::TokenGrantRequest {
    v1::TokenGrantRequest {
        delegation_id: "planner".into(),
        profile_id: PLANNER.into(),
        depth: 1,
        ..v1::TokenGrantRequest::default()
    }
}

fn execute(task: &v1::DelegationTask, token: &str) -> v1::WorkerExecuteRequest {
    v1::WorkerExecuteRequest {
        lease_valid_until: None,
        task: Some(task.clone()),
        task_token: token.to_owned(),
        attempt: 1,
    }
}

fn plan_turn(token: &str) -> v1::PlanTurnRequest {
    v1::PlanTurnRequest {
        lease_valid_until: None,
        run_id: RUN_ID.into(),
        profile_id: PLANNER.into(),
        round: 1,
        turn: 1,
        task_token: token.into(),
        instructions: "Delegate with `delegate`.".into(),
        messages: vec![v1::ChatMessage {
            role: "user".into(),
            content: "What broke payments?".into(),
            ..v1::ChatMessage::default()
        }],
        tools: Vec::new(),
        max_tokens: 0,
    }
}

fn cancel(task: &v1::DelegationTask) -> v1::WorkerCancelRequest {
    v1::WorkerCancelRequest {
        delegation_id: task.delegation_id.clone(),
        reason: "mischief".into(),
    }
}

/// Base64url without padding, as JWTs encode their parts.
fn b64url(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    let mut out = String::new();
    for chunk in bytes.chunks(3) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |n, (i, b)| n | (u32::from(*b) << (16 - 8 * i)));
        for i in 0..=chunk.len() {
            out.push(char::from(ALPHABET[((n >> (18 - 6 * i)) & 63) as usize]));
        }
    }
    out
}

/// Claims for `task` that no key signed, under `header`, with `signature`.
fn forged(header: &serde_json::Value, task: &v1::DelegationTask, signature: &[u8]) -> String {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("after 1970")
        .as_secs();
    let claims = json!({
        "iss": "convene-policy", "sub": PERSON, "aud": ["convene"], "iat": now, "nbf": now,
        "exp": now + 3600, "jti": "tok-forged", "tenant": "acme-payments", "run": RUN_ID,
        "del": task.delegation_id, "prof": task.profile_id, "depth": 1,
        "scp": [{"action": "logs:read", "resource": "service/*"}], "tools": [],
        "max_calls": 0, "redeleg": false,
    });
    format!(
        "{}.{}.{}",
        b64url(header.to_string().as_bytes()),
        b64url(claims.to_string().as_bytes()),
        b64url(signature)
    )
}

/// Asserts that `answer` is a refusal with `code` whose message says `says`.
#[track_caller]
fn assert_refused<T: std::fmt::Debug>(
    answer: Result<tonic::Response<T>, tonic::Status>,
    code: Code,
    says: &str,
) {
    let refused = answer.expect_err("the worker refuses");
    assert_eq!(refused.code(), code, "{refused:?}");
    assert!(refused.message().contains(says), "{says}: {refused:?}");
}

/// Sleeps until the wall clock has passed `at`.
async fn sleep_past(at: &prost_types::Timestamp) {
    let at = SystemTime::try_from(*at).expect("a valid timestamp");
    if let Ok(left) = at.duration_since(SystemTime::now()) {
        tokio::time::sleep(left + Duration::from_millis(20)).await;
    }
}

/// The result of an Execute the supervisor sent with a valid token: the model is asked
/// and the investigation completes.
fn assert_completed(answer: Result<tonic::Response<v1::WorkerExecuteResponse>, tonic::Status>) {
    let result = answer
        .expect("the supervisor's task runs")
        .into_inner()
        .result
        .expect("a result");
    assert_eq!(
        result.status,
        v1::TaskStatus::Completed as i32,
        "{result:#?}"
    );
    assert_eq!(result.worker_id, "worker-under-attack");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plaintext_worker_process_refuses_every_forged_stale_or_foreign_call() {
    let mesh = Mesh::start().await;
    let model = ScriptedModel::start(
        PlaybookResponder::new(&convene_worker::profiles::example().unwrap()).unwrap(),
    )
    .unwrap();
    let worker = mesh.worker(&model, None).await;
    let supervisor = mesh.policy.credential("supervisor");
    let person = mesh.policy.credential(PERSON);
    let mut client = worker.plain().await;
    let task = task("del-guard-e2e");

    // 1. Claims nobody signed: anonymously the caller is refused first; with the
    // supervisor's credential the token is.
    let unsigned = forged(
        &json!({"alg": "EdDSA", "typ": "JWT"}),
        &task,
        b"not-a-signature",
    );
    assert_refused(
        client.plan_turn(call(plan_turn(&unsigned), None)).await,
        Code::Unauthenticated,
        "only the supervisor may ask for planner turns",
    );
    assert_refused(
        client
            .plan_turn(call(plan_turn(&unsigned), Some(&supervisor)))
            .await,
        Code::Unauthenticated,
        "task token refused",
    );
    let unsecured = forged(&json!({"alg": "none", "typ": "JWT"}), &task, b"");
    for token in [&unsigned, &unsecured] {
        assert_refused(
            client
                .execute(call(execute(&task, token), Some(&supervisor)))
                .await,
            Code::Unauthenticated,
            "task token refused",
        );
    }
    // A genuine token's claims under another genuine token's signature.
    let genuine = mesh.policy.issue(grant(&task)).await.token;
    let other = mesh.policy.issue(grant(&task)).await.token;
    let (claims, _) = genuine.rsplit_once('.').expect("a JWS");
    let (_, signature) = other.rsplit_once('.').expect("a JWS");
    assert_refused(
        client
            .execute(call(
                execute(&task, &format!("{claims}.{signature}")),
                Some(&supervisor),
            ))
            .await,
        Code::Unauthenticated,
        "task token refused",
    );

    // 2. A real token of another policy service, signed by a key this mesh never had,
    // sent with the supervisor's credential: only the token is at fault.
    let foreign_policy = Policy::start("foreign-policy", mesh.dir.path()).await;
    let foreign = foreign_policy.issue(grant(&task)).await.token;
    assert_refused(
        client
            .execute(call(execute(&task, &foreign), Some(&supervisor)))
            .await,
        Code::Unauthenticated,
        "task token refused (UnknownKey)",
    );

    // Another delegation's token, genuine and current, is not this task's.
    let sibling = mesh
        .policy
        .issue(grant(&self::task("del-guard-sibling")))
        .await;
    assert_refused(
        client
            .execute(call(execute(&task, &sibling.token), Some(&supervisor)))
            .await,
        Code::PermissionDenied,
        "task token refused (delegation)",
    );

    // 3. An expired token.
    let short = mesh
        .policy
        .issue(v1::TokenGrantRequest {
            ttl: Some(prost_types::Duration {
                seconds: 1,
                nanos: 0,
            }),
            ..grant(&task)
        })
        .await;
    sleep_past(short.expires_at.as_ref().expect("an expiry")).await;
    assert_refused(
        client
            .execute(call(execute(&task, &short.token), Some(&supervisor)))
            .await,
        Code::Unauthenticated,
        "Expired",
    );

    // 4. A revoked token: the worker last fetched the revocations before the revocation,
    // so one refresh interval later it fetches them again and refuses the token.
    let stolen = mesh.policy.issue(grant(&task)).await;
    mesh.policy.revoke(&stolen.token_id).await;
    tokio::time::sleep(KEY_REFRESH).await;
    assert_refused(
        client
            .execute(call(execute(&task, &stolen.token), Some(&supervisor)))
            .await,
        Code::Unauthenticated,
        "Revoked",
    );

    // 5. Callers that are not the supervisor, with a valid token: anonymous, a person,
    // a task token as the bearer.
    let valid = mesh.policy.issue(grant(&task)).await.token;
    let planner = mesh.policy.issue(planner_grant()).await.token;
    for (credential, code) in [
        (None, Code::Unauthenticated),
        (Some(person.as_str()), Code::PermissionDenied),
        (Some(valid.as_str()), Code::PermissionDenied),
    ] {
        assert_refused(
            client.cancel(call(cancel(&task), credential)).await,
            code,
            "only the supervisor may cancel delegations",
        );
        assert_refused(
            client
                .execute(call(execute(&task, &valid), credential))
                .await,
            code,
            "only the supervisor may execute delegations",
        );
        assert_refused(
            client
                .plan_turn(call(plan_turn(&planner), credential))
                .await,
            code,
            "only the supervisor may ask for planner turns",
        );
    }

    assert_eq!(
        model.request_count(),
        0,
        "no refused call reached the model"
    );
    let log = worker.service.log();
    for logged in [
        "refused a call that did not come from the supervisor",
        "task token refused; nothing was called",
    ] {
        assert!(log.contains(logged), "the worker logs: {logged}\n{log}");
    }

    // The control: the supervisor with a valid token is served, and the model is asked.
    assert_completed(
        client
            .execute(call(execute(&task, &valid), Some(&supervisor)))
            .await,
    );
    assert!(model.request_count() > 0, "the worker called the model");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_mutual_tls_only_the_supervisors_certificate_reaches_the_model() {
    let mesh = Mesh::start().await;
    let model = ScriptedModel::start(
        PlaybookResponder::new(&convene_worker::profiles::example().unwrap()).unwrap(),
    )
    .unwrap();
    let pki = TestPki::new();
    let worker = mesh.worker(&model, Some(&pki)).await;
    let task = task("del-guard-mtls");
    let token = mesh.policy.issue(grant(&task)).await.token;
    let planner = mesh.policy.issue(planner_grant()).await.token;
    let supervisor = mesh.policy.credential("supervisor");

    // A certificate of the client CA naming another service of the mesh, with valid
    // tokens, and even with the supervisor's bearer credential: the certificate decides.
    let mut client = worker
        .presenting(&pki, &pki.clients.service("worker"))
        .await;
    let named = "names spiffe://convene.test/worker,";
    for credential in [None, Some(supervisor.as_str())] {
        assert_refused(
            client
                .execute(call(execute(&task, &token), credential))
                .await,
            Code::PermissionDenied,
            named,
        );
        assert_refused(
            client
                .plan_turn(call(plan_turn(&planner), credential))
                .await,
            Code::PermissionDenied,
            named,
        );
        assert_refused(
            client.cancel(call(cancel(&task), credential)).await,
            Code::PermissionDenied,
            named,
        );
    }
    assert_eq!(
        model.request_count(),
        0,
        "no refused call reached the model"
    );
    assert!(
        worker
            .service
            .log()
            .contains("refused a call that did not come from the supervisor"),
        "{}",
        worker.service.log()
    );

    // The control: the supervisor's certificate with the same token is served.
    let mut supervisor = worker
        .presenting(&pki, &pki.clients.service("supervisor"))
        .await;
    assert_completed(supervisor.execute(call(execute(&task, &token), None)).await);
    assert!(model.request_count() > 0, "the worker called the model");
}
