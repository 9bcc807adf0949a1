//! What a worker learns of the supervisor's credential, over real gRPC on loopback: on
//! plaintext the supervisor proves itself with its service credential, sent as the
//! bearer of every Execute, PlanTurn and Cancel; under mutual TLS (an `https://` worker
//! endpoint, and the supervisor holds a client certificate) its certificate proves it
//! and the credential is never sent. The workers here are stubs that record what each
//! call carried; they are registered and dispatched to through the supervisor's own
//! registry, as `convene_supervisor::build` makes it.
//!
//! A binary of its own: a process's TLS settings (`convene_server::tls::install`) are
//! set once, and this test sets them part way, after the plaintext calls.

use std::sync::{Arc, Mutex};

use convene_mesh::auth::{self, peer_identities};
use convene_mesh::handles::{GrpcApproval, GrpcEvidenceStore, GrpcPolicy};
use convene_mesh::policy_file::{PolicySource, dev_credential};
use convene_proto::v1::{self, worker_server};
use convene_server::test_util::TestServer;
use convene_server::test_util::pki::{TestPki, spiffe_id};
use convene_server::tls::{self, ClientTls, Tls};
use convene_server::{GrpcServer, ServerSettings, Shutdown};
use convene_supervisor::registry::Registrant;
use convene_supervisor::{Config, MemoryStore, MeshConnector, Parts, Registry};
use tonic::{Request, Response, Status};

/// What one call brought to a worker.
#[derive(Debug, Clone)]
struct Seen {
    method: &'static str,
    /// The `authorization` metadata, if any.
    authorization: Option<String>,
    /// The SPIFFE ids of the client certificate, if one was presented.
    identities: Vec<String>,
}

/// A worker that records every call and answers it with an empty response.
#[derive(Clone, Default)]
struct Recorder(Arc<Mutex<Vec<Seen>>>);

impl Recorder {
    fn record<T>(&self, method: &'static str, request: &Request<T>) {
        self.0.lock().unwrap().push(Seen {
            method,
            authorization: request
                .metadata()
                .get(auth::AUTHORIZATION)
                .map(|v| v.to_str().unwrap_or("(not ASCII)").to_owned()),
            identities: peer_identities(request),
        });
    }

    fn seen(&self) -> Vec<Seen> {
        self.0.lock().unwrap().clone()
    }
}

#[tonic::async_trait]
impl worker_server::Worker for Recorder {
    async fn execute(
        &self,
        request: Request<v1::WorkerExecuteRequest>,
    ) -> Result<Response<v1::WorkerExecuteResponse>, Status> {
        self.record("Execute", &request);
        Ok(Response::new(v1::WorkerExecuteResponse::default()))
    }

    async fn cancel(
        &self,
        request: Request<v1::WorkerCancelRequest>,
    ) -> Result<Response<v1::WorkerCancelResponse>, Status> {
        self.record("Cancel", &request);
        Ok(Response::new(v1::WorkerCancelResponse::default()))
    }

    async fn plan_turn(
        &self,
        request: Request<v1::PlanTurnRequest>,
    ) -> Result<Response<v1::PlanTurnResponse>, Status> {
        self.record("PlanTurn", &request);
        Ok(Response::new(v1::PlanTurnResponse::default()))
    }
}

/// Takes a slot on the worker serving `profile` and sends it Execute, PlanTurn and
/// Cancel, as the supervisor does.
async fn dispatch(registry: &Arc<Registry>, profile: &str) {
    let lease = registry
        .acquire(profile, &[])
        .unwrap_or_else(|| panic!("a live worker serves {profile}"));
    let task = v1::DelegationTask {
        delegation_id: "del-1".into(),
        run_id: "run-1".into(),
        profile_id: profile.into(),
        ..v1::DelegationTask::default()
    };
    lease
        .handle
        .execute(Request::new(v1::WorkerExecuteRequest {
            lease_valid_until: None,
            task: Some(task),
            task_token: "a task token".into(),
            attempt: 1,
        }))
        .await
        .expect("Execute reaches the worker");
    lease
        .handle
        .plan_turn(Request::new(v1::PlanTurnRequest {
            run_id: "run-1".into(),
            profile_id: profile.into(),
            ..v1::PlanTurnRequest::default()
        }))
        .await
        .expect("PlanTurn reaches the worker");
    lease
        .handle
        .cancel(Request::new(v1::WorkerCancelRequest {
            delegation_id: "del-1".into(),
            reason: "the run ended".into(),
        }))
        .await
        .expect("Cancel reaches the worker");
}

#[tokio::test]
async fn under_mutual_tls_the_supervisor_sends_no_bearer_credential_to_workers() {
    let dir = tempfile::tempdir().unwrap();
    let credentials = dir.path().join("credentials");
    let (policy, _) = PolicySource::new(None, Some(credentials.clone()))
        .load()
        .unwrap();
    let credential = dev_credential(&credentials, "supervisor").unwrap();
    // The supervisor's peers are never called here: only its workers are.
    let nowhere = "http://127.0.0.1:9";
    let shutdown = Shutdown::new();
    let (_service, registry) = convene_supervisor::build(Parts {
        policy: Arc::new(GrpcPolicy::connect(nowhere).unwrap()),
        evidence: Arc::new(GrpcEvidenceStore::connect(nowhere).unwrap()),
        approval: Arc::new(GrpcApproval::connect(nowhere).unwrap()),
        policy_file: Arc::new(policy),
        credential: credential.clone(),
        store: Arc::new(MemoryStore::default()),
        connector: Arc::new(MeshConnector::default()),
        config: Config {
            common: convene_server::ServiceCommon {
                data_dir: dir.path().to_owned(),
                ..Config::default().common
            },
            ..Config::default()
        },
        shutdown: shutdown.clone(),
    });
    let pool = Registrant::new("worker-pool", Vec::new());

    // Plaintext (the process has no TLS yet): every call carries the credential.
    let plain = Recorder::default();
    let plain_server = TestServer::start(
        GrpcServer::new(ServerSettings::default())
            .add_service(worker_server::WorkerServer::new(plain.clone())),
    )
    .await;
    registry
        .register_worker(
            &pool,
            "worker-plain",
            &format!("http://{}", plain_server.addr),
            vec!["logs-investigator".into()],
            1,
        )
        .expect("a plaintext worker registers with a plaintext supervisor");
    dispatch(&registry, "logs-investigator").await;
    let seen = plain.seen();
    assert_eq!(seen.len(), 3, "{seen:?}");
    for call in &seen {
        assert_eq!(
            call.authorization.as_deref(),
            Some(format!("Bearer {credential}").as_str()),
            "on plaintext the credential proves the supervisor: {}",
            call.method
        );
        assert!(call.identities.is_empty(), "{call:?}");
    }

    // Mutual TLS: the supervisor verifies workers against the servers' CA and presents
    // its own certificate.
    let pki = TestPki::new();
    let certificate = pki.clients.service("supervisor");
    assert!(
        tls::install(Tls {
            server: None,
            client: Some(ClientTls {
                ca_pem: Some(pki.servers.pem().into_bytes()),
                identity: Some((
                    certificate.cert.clone().into_bytes(),
                    certificate.key.clone().into_bytes()
                )),
            }),
            insecure: false,
        }),
        "this process had no TLS settings before"
    );
    let mutual = Recorder::default();
    let mutual_server = TestServer::spawn(
        GrpcServer::new(ServerSettings::default())
            .with_tls(pki.server_tls(dir.path(), true))
            .add_service(worker_server::WorkerServer::new(mutual.clone())),
    )
    .await;
    registry
        .register_worker(
            &pool,
            "worker-mutual",
            &format!("https://localhost:{}", mutual_server.addr.port()),
            vec!["metrics-investigator".into()],
            1,
        )
        .expect("an https worker registers with a supervisor that dials over TLS");
    dispatch(&registry, "metrics-investigator").await;
    let seen = mutual.seen();
    assert_eq!(seen.len(), 3, "{seen:?}");
    for call in &seen {
        assert_eq!(
            call.authorization, None,
            "under mutual TLS the worker never receives the supervisor's credential: {}",
            call.method
        );
        assert_eq!(
            call.identities,
            [spiffe_id("supervisor")],
            "the certificate proves the supervisor instead: {}",
            call.method
        );
    }
}
