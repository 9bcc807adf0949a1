//! A worker registration belongs to the identity that made it, over real gRPC under
//! mutual TLS: another principal, or the same principal presenting another client
//! certificate, cannot register, heartbeat or deregister a live worker id; a lapsed
//! registration may be taken over. A worker claims only the profiles its principal's
//! `profiles` allow, and registers an https:// endpoint when the supervisor dials
//! workers over TLS.

use std::sync::Arc;
use std::time::Duration;

use convene_mesh::auth::{Authenticator, request};
use convene_mesh::handles::{GrpcWorker, WorkerHandle};
use convene_mesh::policy_file::{EXAMPLE_POLICY, PolicyFile, dev_credential};
use convene_proto::v1::{self, worker_registry_client::WorkerRegistryClient};
use convene_server::test_util::TestServer;
use convene_server::test_util::pki::{TestCert, TestPki};
use convene_server::{GrpcServer, ServerSettings};
use convene_supervisor::registry::RegistryService;
use convene_supervisor::{Connector, Registry, RegistrySettings};
use tempfile::TempDir;
use tonic::Code;
use tonic::transport::Channel;

/// A second worker principal, allowed only the logs investigator.
const ROGUE: &str = "rogue-pool";

/// Where registered workers would be dialled; never dialled here (the registry
/// connects lazily, at the first dispatch).
const HTTPS: &str = "https://127.0.0.1:1";

/// Dials workers over TLS, as a supervisor with `--tls-cert` or `--tls-ca` does; its
/// handles are never called.
struct TlsDialler;

impl Connector for TlsDialler {
    fn connect(&self, endpoint: &str) -> Result<WorkerHandle, String> {
        assert!(
            endpoint.starts_with("https://"),
            "{endpoint} reached the connector"
        );
        Ok(Arc::new(
            GrpcWorker::connect("http://127.0.0.1:1").map_err(|e| e.to_string())?,
        ))
    }

    fn requires_tls(&self) -> bool {
        true
    }
}

/// The WorkerRegistry over mutual TLS, dialling workers over TLS, with the example
/// policy plus [`ROGUE`].
struct Fixture {
    _dir: TempDir,
    pki: TestPki,
    registry: Arc<Registry>,
    server: TestServer,
    /// The credential of `worker-pool`.
    pool: String,
    /// The credential of [`ROGUE`].
    rogue: String,
}

impl Fixture {
    async fn start(lease_ttl: Duration) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let credentials = dir.path().join("credentials");
        let text = EXAMPLE_POLICY.replacen(
            "principals:\n",
            &format!(
                "principals:\n  - id: {ROGUE}\n    tenant: system\n    kind: service\n    \
                 roles: [workers:register]\n    profiles: [logs-investigator]\n"
            ),
            1,
        );
        let mut policy = PolicyFile::parse(&text, Some("yaml"), "policy")
            .unwrap()
            .compile("policy")
            .unwrap();
        policy.with_dev_credentials(&credentials).unwrap();
        let registry = Arc::new(Registry::new(
            Arc::new(TlsDialler),
            RegistrySettings {
                lease_ttl,
                ..RegistrySettings::default()
            },
            Authenticator::principals_only(Arc::new(policy)),
        ));
        let pki = TestPki::new();
        let server = TestServer::spawn(
            GrpcServer::new(ServerSettings::default())
                .with_tls(pki.server_tls(dir.path(), true))
                .add_service(v1::worker_registry_server::WorkerRegistryServer::new(
                    RegistryService(registry.clone()),
                )),
        )
        .await;
        Self {
            pool: dev_credential(&credentials, "worker-pool").unwrap(),
            rogue: dev_credential(&credentials, ROGUE).unwrap(),
            _dir: dir,
            pki,
            registry,
            server,
        }
    }

    /// A client presenting `certificate`.
    async fn client(&self, certificate: &TestCert) -> WorkerRegistryClient<Channel> {
        WorkerRegistryClient::new(
            self.pki
                .connect(self.server.addr, Some(certificate))
                .await
                .expect("a client certificate of the client CA gets through"),
        )
    }

    /// A client presenting a worker's certificate (`spiffe://convene.test/worker`).
    async fn worker(&self) -> WorkerRegistryClient<Channel> {
        self.client(&self.pki.clients.service("worker")).await
    }

    /// The live workers.
    fn live(&self) -> Vec<String> {
        self.registry
            .snapshot()
            .into_iter()
            .filter(|(_, _, live)| *live)
            .map(|(id, _, _)| id)
            .collect()
    }
}

fn register(
    worker_id: &str,
    endpoint: &str,
    profiles: &[&str],
    credential: &str,
) -> tonic::Request<v1::RegisterRequest> {
    request(
        v1::RegisterRequest {
            worker_id: worker_id.into(),
            endpoint: endpoint.into(),
            profiles: profiles
                .iter()
                .map(|id| v1::WorkerProfile {
                    id: (*id).into(),
                    ..Default::default()
                })
                .collect(),
            capacity: 2,
        },
        credential,
    )
}

fn heartbeat(worker_id: &str, credential: &str) -> tonic::Request<v1::HeartbeatRequest> {
    request(
        v1::HeartbeatRequest {
            worker_id: worker_id.into(),
            in_flight: 0,
        },
        credential,
    )
}

fn deregister(worker_id: &str, credential: &str) -> tonic::Request<v1::DeregisterRequest> {
    request(
        v1::DeregisterRequest {
            worker_id: worker_id.into(),
        },
        credential,
    )
}

/// Asserts a refusal because `worker_id` belongs to another identity.
fn assert_taken<T: std::fmt::Debug>(refused: Result<T, tonic::Status>, worker_id: &str) {
    let status = refused.expect_err("another identity's live worker id is refused");
    assert_eq!(status.code(), Code::PermissionDenied, "{status:?}");
    assert!(
        status.message().contains(&format!("worker {worker_id}"))
            && status.message().contains("belongs to another identity"),
        "the refusal names the worker id and says whose it is not: {}",
        status.message()
    );
}

#[tokio::test]
async fn a_live_worker_id_answers_only_to_the_identity_that_registered_it() {
    let fx = Fixture::start(Duration::from_secs(30)).await;
    let mut worker = fx.worker().await;
    worker
        .register(register("w-1", HTTPS, &["logs-investigator"], &fx.pool))
        .await
        .expect("the worker pool registers its worker");

    // Another principal, with a worker's certificate.
    for (what, refused) in [
        (
            "register",
            worker
                .register(register("w-1", HTTPS, &["logs-investigator"], &fx.rogue))
                .await
                .map(|_| ()),
        ),
        (
            "heartbeat",
            worker
                .heartbeat(heartbeat("w-1", &fx.rogue))
                .await
                .map(|_| ()),
        ),
        (
            "deregister",
            worker
                .deregister(deregister("w-1", &fx.rogue))
                .await
                .map(|_| ()),
        ),
    ] {
        let refused = refused.inspect_err(|s| {
            assert!(
                s.message().contains(&format!("cannot {what} worker w-1")),
                "{what}: {}",
                s.message()
            );
        });
        assert_taken(refused, "w-1");
    }
    // The same principal presenting another certificate (another trust domain's
    // worker) is another identity too.
    let elsewhere = fx
        .pki
        .clients
        .leaf(&["localhost"], &["spiffe://elsewhere.test/worker"]);
    let mut other = fx.client(&elsewhere).await;
    assert_taken(
        other
            .register(register("w-1", HTTPS, &["logs-investigator"], &fx.pool))
            .await,
        "w-1",
    );
    assert_taken(other.heartbeat(heartbeat("w-1", &fx.pool)).await, "w-1");
    assert_taken(other.deregister(deregister("w-1", &fx.pool)).await, "w-1");

    // The legitimate worker is untouched: still live, still dispatched to, and its own
    // heartbeats, registrations and deregistration still work.
    assert_eq!(fx.live(), ["w-1"]);
    let lease = fx
        .registry
        .acquire("logs-investigator", &[])
        .expect("the worker serves the profile");
    assert_eq!(lease.worker_id, "w-1");
    drop(lease);
    let beat = worker
        .heartbeat(heartbeat("w-1", &fx.pool))
        .await
        .expect("its own heartbeat")
        .into_inner();
    assert!(beat.registered);
    worker
        .register(register("w-1", HTTPS, &["logs-investigator"], &fx.pool))
        .await
        .expect("it registers again");
    let removed = worker
        .deregister(deregister("w-1", &fx.pool))
        .await
        .expect("its own deregistration")
        .into_inner();
    assert!(removed.removed);
    assert!(fx.live().is_empty());
}

#[tokio::test]
async fn a_lapsed_registration_may_be_taken_over() {
    let lease_ttl = Duration::from_millis(300);
    let fx = Fixture::start(lease_ttl).await;
    let mut worker = fx.worker().await;
    worker
        .register(register("w-2", HTTPS, &["logs-investigator"], &fx.pool))
        .await
        .expect("registered");
    assert_taken(
        worker
            .register(register("w-2", HTTPS, &["logs-investigator"], &fx.rogue))
            .await,
        "w-2",
    );
    tokio::time::sleep(lease_ttl + Duration::from_millis(200)).await;
    // Lapsed: another identity's heartbeat renews nothing and says to register.
    let beat = worker
        .heartbeat(heartbeat("w-2", &fx.rogue))
        .await
        .expect("a lapsed worker's heartbeat is answered")
        .into_inner();
    assert!(!beat.registered, "another identity's heartbeat renewed it");
    assert!(fx.live().is_empty());
    worker
        .register(register("w-2", HTTPS, &["logs-investigator"], &fx.rogue))
        .await
        .expect("a lapsed worker id is taken over");
    assert_eq!(fx.live(), ["w-2"]);
    // Now it is the first identity that is refused.
    assert_taken(worker.heartbeat(heartbeat("w-2", &fx.pool)).await, "w-2");
}

#[tokio::test]
async fn a_worker_claims_only_the_profiles_its_principal_may_serve() {
    let fx = Fixture::start(Duration::from_secs(30)).await;
    let mut worker = fx.worker().await;
    for profiles in [
        &["change-auditor"][..],
        &["logs-investigator", "change-auditor"][..],
    ] {
        let refused = worker
            .register(register("r-1", HTTPS, profiles, &fx.rogue))
            .await
            .expect_err("a profile the principal lacks is refused");
        assert_eq!(refused.code(), Code::PermissionDenied, "{refused:?}");
        assert!(
            refused.message().contains("profile change-auditor")
                && refused.message().contains(&format!("principal {ROGUE}"))
                && refused.message().contains("`profiles`"),
            "the refusal names the profile and the policy key to add it to: {}",
            refused.message()
        );
    }
    assert!(
        fx.live().is_empty(),
        "nothing of a refused registration stays"
    );
    worker
        .register(register("r-1", HTTPS, &["logs-investigator"], &fx.rogue))
        .await
        .expect("an allowed profile registers");
    // The example's worker pool may serve every profile of the example.
    worker
        .register(register(
            "w-3",
            HTTPS,
            &["change-auditor", "incident-planner"],
            &fx.pool,
        ))
        .await
        .expect("the example pool's profiles register");
}

#[tokio::test]
async fn under_tls_a_worker_registers_an_https_endpoint() {
    let fx = Fixture::start(Duration::from_secs(30)).await;
    let mut worker = fx.worker().await;
    for endpoint in ["http://127.0.0.1:7410", "127.0.0.1:7410"] {
        let refused = worker
            .register(register("w-4", endpoint, &["logs-investigator"], &fx.pool))
            .await
            .expect_err("a plaintext endpoint is refused under TLS");
        assert_eq!(refused.code(), Code::InvalidArgument, "{refused:?}");
        assert!(
            refused.message().contains("endpoint")
                && refused.message().contains(endpoint)
                && refused.message().contains("https://"),
            "the refusal says to register an https:// endpoint: {}",
            refused.message()
        );
    }
    assert!(fx.live().is_empty());
    worker
        .register(register(
            "w-4",
            "https://127.0.0.1:7410",
            &["logs-investigator"],
            &fx.pool,
        ))
        .await
        .expect("an https:// endpoint registers");
    assert_eq!(fx.live(), ["w-4"]);
}
