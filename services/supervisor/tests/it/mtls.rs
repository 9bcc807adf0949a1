//! Service identities under mutual TLS: only workers' certificates (URI SAN
//! `spiffe://<trust domain>/worker`) may call the WorkerRegistry service. The
//! supervisor's or another service's certificate is refused with PERMISSION_DENIED
//! naming the identity it carries, on every RPC and before the registry changes; the
//! worker-pool credential is checked as before on top of the certificate. A server
//! without a client CA asks for no certificate, and the credential alone decides.

use std::sync::Arc;

use convene_mesh::auth::{Authenticator, request};
use convene_mesh::policy_file::{PolicySource, dev_credential};
use convene_proto::v1::{self, worker_registry_client::WorkerRegistryClient};
use convene_server::test_util::TestServer;
use convene_server::test_util::pki::{TestCert, TestPki};
use convene_server::{GrpcServer, ServerSettings};
use convene_supervisor::registry::RegistryService;
use convene_supervisor::{MeshConnector, Registry, RegistrySettings};
use tempfile::TempDir;
use tonic::transport::Channel;

/// A WorkerRegistry over TLS with the example policy and its development credentials.
struct Fixture {
    _dir: TempDir,
    pki: TestPki,
    registry: Arc<Registry>,
    server: TestServer,
    /// The credential of `worker-pool` (role `workers:register`).
    pool: String,
    /// The credential of `supervisor` (no `workers:register`).
    supervisor: String,
}

impl Fixture {
    /// Serves the registry over TLS: mutual TLS (client certificates of `pki.clients`
    /// required) when `mutual`.
    async fn start(mutual: bool) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let credentials = dir.path().join("credentials");
        let (policy, _) = PolicySource::new(None, Some(credentials.clone()))
            .load()
            .unwrap();
        let registry = Arc::new(Registry::new(
            Arc::new(MeshConnector::default()),
            RegistrySettings::default(),
            Authenticator::principals_only(Arc::new(policy)),
        ));
        let pki = TestPki::new();
        let server = TestServer::spawn(
            GrpcServer::new(ServerSettings::default())
                .with_tls(pki.server_tls(dir.path(), mutual))
                .add_service(v1::worker_registry_server::WorkerRegistryServer::new(
                    RegistryService(registry.clone()),
                )),
        )
        .await;
        Self {
            pool: dev_credential(&credentials, "worker-pool").unwrap(),
            supervisor: dev_credential(&credentials, "supervisor").unwrap(),
            _dir: dir,
            pki,
            registry,
            server,
        }
    }

    /// A client presenting `certificate` when given.
    async fn client(
        &self,
        certificate: Option<&TestCert>,
    ) -> Result<WorkerRegistryClient<Channel>, tonic::transport::Error> {
        Ok(WorkerRegistryClient::new(
            self.pki.connect(self.server.addr, certificate).await?,
        ))
    }

    /// A client presenting the certificate of `service`.
    async fn as_service(&self, service: &str) -> WorkerRegistryClient<Channel> {
        self.client(Some(&self.pki.clients.service(service)))
            .await
            .expect("a client certificate of the client CA gets through the handshake")
    }

    /// The workers registered and live.
    fn live(&self) -> Vec<String> {
        self.registry
            .snapshot()
            .into_iter()
            .filter(|(_, _, live)| *live)
            .map(|(id, _, _)| id)
            .collect()
    }
}

fn register(worker_id: &str, credential: &str) -> tonic::Request<v1::RegisterRequest> {
    request(
        v1::RegisterRequest {
            worker_id: worker_id.into(),
            // Never dialled: the registry connects lazily, at the first dispatch.
            endpoint: "http://127.0.0.1:1".into(),
            profiles: vec![v1::WorkerProfile {
                id: "logs-investigator".into(),
                ..Default::default()
            }],
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

/// Asserts that `refused` is the identity check's refusal naming `presented`.
fn assert_identity_refusal<T: std::fmt::Debug>(refused: Result<T, tonic::Status>, presented: &str) {
    let refused = refused.expect_err("the certificate's identity is refused");
    assert_eq!(refused.code(), tonic::Code::PermissionDenied, "{refused:?}");
    let message = refused.message();
    assert!(
        message.contains("only the worker may register workers")
            && message.contains(&format!("names {presented},"))
            && message.contains("spiffe://<trust domain>/worker"),
        "the refusal names what was presented and what is required: {message}"
    );
}

#[tokio::test]
async fn only_workers_certificates_may_use_the_worker_registry() {
    let fx = Fixture::start(true).await;

    let mut worker = fx.as_service("worker").await;
    let registered = worker
        .register(register("worker-mtls-1", &fx.pool))
        .await
        .expect("a worker's certificate and the worker-pool credential register")
        .into_inner();
    assert!(registered.lease_ttl.is_some() && registered.heartbeat_interval.is_some());
    assert_eq!(fx.live(), ["worker-mtls-1"]);
    assert!(
        worker
            .heartbeat(heartbeat("worker-mtls-1", &fx.pool))
            .await
            .expect("a worker's certificate may heartbeat")
            .into_inner()
            .registered
    );

    // The supervisor's certificate, with the worker-pool credential: every RPC is
    // refused for the identity alone, and the registry does not change.
    let mut supervisor = fx.as_service("supervisor").await;
    let as_supervisor = "spiffe://convene.test/supervisor";
    assert_identity_refusal(
        supervisor
            .register(register("worker-mtls-2", &fx.pool))
            .await,
        as_supervisor,
    );
    assert_identity_refusal(
        supervisor
            .heartbeat(heartbeat("worker-mtls-1", &fx.pool))
            .await,
        as_supervisor,
    );
    assert_identity_refusal(
        supervisor
            .deregister(deregister("worker-mtls-1", &fx.pool))
            .await,
        as_supervisor,
    );
    assert_identity_refusal(
        fx.as_service("policy")
            .await
            .register(register("worker-mtls-2", &fx.pool))
            .await,
        "spiffe://convene.test/policy",
    );
    assert_identity_refusal(
        fx.client(Some(&fx.pki.clients.localhost()))
            .await
            .expect("the handshake succeeds")
            .register(register("worker-mtls-2", &fx.pool))
            .await,
        "no spiffe:// identity",
    );
    assert_eq!(
        fx.live(),
        ["worker-mtls-1"],
        "the refused calls changed nothing"
    );

    // A worker's certificate does not replace the credential.
    let wrong_role = worker
        .register(register("worker-mtls-2", &fx.supervisor))
        .await
        .expect_err("the supervisor's credential lacks workers:register");
    assert_eq!(wrong_role.code(), tonic::Code::PermissionDenied);
    assert!(
        wrong_role
            .message()
            .contains("principal supervisor lacks role workers:register"),
        "{}",
        wrong_role.message()
    );
    let unauthenticated = worker
        .register(tonic::Request::new(
            register("worker-mtls-2", &fx.pool).into_inner(),
        ))
        .await
        .expect_err("a call without a credential is refused");
    assert_eq!(unauthenticated.code(), tonic::Code::Unauthenticated);

    // A client without a certificate does not get past the handshake: the service
    // never answers.
    let no_certificate = match fx.client(None).await {
        Err(e) => format!("{e:?}"),
        Ok(mut client) => {
            let refused = client
                .register(register("worker-mtls-2", &fx.pool))
                .await
                .expect_err("a client without a certificate is refused");
            assert!(
                matches!(
                    refused.code(),
                    tonic::Code::Unavailable | tonic::Code::Unknown
                ),
                "refused by the transport, not by the service: {refused:?}"
            );
            format!("{refused:?}")
        }
    };
    assert!(
        no_certificate.contains("received fatal alert: CertificateRequired"),
        "{no_certificate}"
    );
    assert_eq!(fx.live(), ["worker-mtls-1"]);

    assert!(
        worker
            .deregister(deregister("worker-mtls-1", &fx.pool))
            .await
            .expect("a worker's certificate may deregister")
            .into_inner()
            .removed
    );
    assert!(fx.live().is_empty());
}

#[tokio::test]
async fn without_a_client_ca_the_registry_is_left_to_the_credential() {
    let fx = Fixture::start(false).await;
    let mut client = fx
        .client(None)
        .await
        .expect("TLS without a client certificate");
    client
        .register(register("worker-tls-1", &fx.pool))
        .await
        .expect("no client certificate is asked for, so none is checked");
    assert_eq!(fx.live(), ["worker-tls-1"]);
    let refused = client
        .register(register("worker-tls-2", &fx.supervisor))
        .await
        .expect_err("the credential still decides");
    assert_eq!(refused.code(), tonic::Code::PermissionDenied);
    assert!(
        refused.message().contains("lacks role workers:register"),
        "{}",
        refused.message()
    );
    assert_eq!(fx.live(), ["worker-tls-1"]);
}
