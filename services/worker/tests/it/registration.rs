//! Registration, heartbeats, re-registration and deregistration.
//!
//! The supervisor's worker registry is built separately; this is a boundary the worker
//! cannot reach yet, so these tests serve a small `WorkerRegistry` of their own over
//! real gRPC and check what the worker sends it.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::support::wait_until;
use convene_mesh::auth;
use convene_mesh::handles::{GrpcWorkerRegistry, RegistryHandle};
use convene_proto::v1::{self, worker_registry_server};
use convene_server::test_util::{TestServer, endpoint};
use convene_server::{GrpcServer, ServerSettings, Shutdown};
use convene_worker::Registrar;
use tonic::{Request, Response, Status};

const CREDENTIAL: &str = "cvn_worker_pool_test_credential";

#[derive(Debug, Default)]
struct Seen {
    registers: Vec<v1::RegisterRequest>,
    heartbeats: Vec<v1::HeartbeatRequest>,
    deregistered: Vec<String>,
    known: BTreeMap<String, ()>,
    /// Registrations to refuse (UNAVAILABLE) before accepting one.
    refuse: u32,
}

/// A registry that records every call and can forget its workers.
#[derive(Debug, Clone, Default)]
struct TestRegistry {
    seen: Arc<Mutex<Seen>>,
}

impl TestRegistry {
    fn seen(&self) -> std::sync::MutexGuard<'_, Seen> {
        self.seen.lock().unwrap()
    }

    fn check<T>(request: &Request<T>) -> Result<(), Status> {
        match auth::bearer(request)? {
            CREDENTIAL => Ok(()),
            _ => Err(Status::unauthenticated("wrong worker-pool credential")),
        }
    }

    async fn until(&self, what: &str, done: impl Fn(&Seen) -> bool) {
        wait_until(what, || self.seen(), |seen| done(seen)).await;
    }
}

#[tonic::async_trait]
impl worker_registry_server::WorkerRegistry for TestRegistry {
    async fn register(
        &self,
        request: Request<v1::RegisterRequest>,
    ) -> Result<Response<v1::RegisterResponse>, Status> {
        Self::check(&request)?;
        let mut seen = self.seen();
        if seen.refuse > 0 {
            seen.refuse -= 1;
            return Err(Status::unavailable("registry starting"));
        }
        let r = request.into_inner();
        seen.known.insert(r.worker_id.clone(), ());
        seen.registers.push(r);
        Ok(Response::new(v1::RegisterResponse {
            lease_ttl: Some(prost_types::Duration {
                seconds: 1,
                nanos: 0,
            }),
            heartbeat_interval: Some(prost_types::Duration {
                seconds: 0,
                nanos: 50_000_000,
            }),
        }))
    }

    async fn heartbeat(
        &self,
        request: Request<v1::HeartbeatRequest>,
    ) -> Result<Response<v1::HeartbeatResponse>, Status> {
        Self::check(&request)?;
        let r = request.into_inner();
        let mut seen = self.seen();
        let registered = seen.known.contains_key(&r.worker_id);
        seen.heartbeats.push(r);
        Ok(Response::new(v1::HeartbeatResponse { registered }))
    }

    async fn deregister(
        &self,
        request: Request<v1::DeregisterRequest>,
    ) -> Result<Response<v1::DeregisterResponse>, Status> {
        Self::check(&request)?;
        let id = request.into_inner().worker_id;
        let mut seen = self.seen();
        let removed = seen.known.remove(&id).is_some();
        seen.deregistered.push(id);
        Ok(Response::new(v1::DeregisterResponse { removed }))
    }
}

async fn serve(registry: &TestRegistry) -> (TestServer, RegistryHandle) {
    let server = TestServer::start(GrpcServer::new(ServerSettings::default()).add_service(
        worker_registry_server::WorkerRegistryServer::new(registry.clone()),
    ))
    .await;
    let handle: RegistryHandle =
        Arc::new(GrpcWorkerRegistry::connect(&endpoint(server.addr)).unwrap());
    (server, handle)
}

#[tokio::test]
async fn worker_registers_heartbeats_re_registers_and_deregisters() {
    let mesh = crate::support::Mesh::start().await;
    let worker = mesh
        .worker(convene_worker::profiles::example().unwrap(), 5)
        .await;
    let registry = TestRegistry::default();
    registry.seen().refuse = 2;
    let (_server, handle) = serve(&registry).await;

    let shutdown = Shutdown::new();
    let registrar = worker
        .service
        .registrar(handle, CREDENTIAL.into(), "http://10.0.0.7:7410".into())
        .with_backoff(Duration::from_millis(10));
    let task = tokio::spawn(registrar.run(shutdown.clone()));

    registry
        .until("the registration, after two refusals", |s| {
            s.registers.len() == 1
        })
        .await;
    {
        let seen = registry.seen();
        let r = &seen.registers[0];
        assert_eq!(r.worker_id, "worker-test-1");
        assert_eq!(r.endpoint, "http://10.0.0.7:7410");
        assert_eq!(r.capacity, 5);
        let ids: Vec<&str> = r.profiles.iter().map(|p| p.id.as_str()).collect();
        assert_eq!(
            ids,
            [
                "change-auditor",
                "change-auditor-model",
                "incident-planner",
                "incident-planner-model",
                "logs-investigator",
                "logs-investigator-model",
                "metrics-investigator",
                "metrics-investigator-model"
            ]
        );
        let logs = r
            .profiles
            .iter()
            .find(|p| p.id == "logs-investigator")
            .unwrap();
        assert_eq!(logs.version, "1.0.0");
        assert_eq!(logs.evidence_prefixes, ["logs://"]);
        assert_eq!(logs.max_iterations, 4);
    }
    registry
        .until("two heartbeats", |s| s.heartbeats.len() >= 2)
        .await;
    assert!(
        registry
            .seen()
            .heartbeats
            .iter()
            .all(|h| h.worker_id == "worker-test-1" && h.in_flight == 0)
    );

    // The supervisor restarts and forgets the worker: the next heartbeat says so, and
    // the worker registers again.
    registry.seen().known.clear();
    registry
        .until("the re-registration", |s| s.registers.len() == 2)
        .await;
    {
        let seen = registry.seen();
        assert_eq!(
            seen.registers[1], seen.registers[0],
            "the same registration again"
        );
    }

    shutdown.trigger();
    tokio::time::timeout(Duration::from_secs(5), task)
        .await
        .expect("the registrar stops at shutdown")
        .unwrap();
    assert_eq!(registry.seen().deregistered, ["worker-test-1"]);
    assert!(registry.seen().known.is_empty());
}

#[tokio::test]
async fn heartbeats_report_running_delegations() {
    let registry = TestRegistry::default();
    let (_server, handle) = serve(&registry).await;
    let in_flight = Arc::new(std::sync::atomic::AtomicU32::new(3));
    let load = in_flight.clone();
    let registration = convene_worker::Registration {
        worker_id: "w-2".into(),
        endpoint: "http://127.0.0.1:7411".into(),
        profiles: Vec::new(),
        capacity: 4,
    };
    let shutdown = Shutdown::new();
    let registrar = Registrar::new(
        handle,
        CREDENTIAL.into(),
        registration,
        Arc::new(move || load.load(std::sync::atomic::Ordering::SeqCst)),
    );
    let task = tokio::spawn(registrar.run(shutdown.clone()));
    registry
        .until("a heartbeat with 3 running", |s| {
            s.heartbeats.iter().any(|h| h.in_flight == 3)
        })
        .await;
    in_flight.store(1, std::sync::atomic::Ordering::SeqCst);
    registry
        .until("a heartbeat with 1 running", |s| {
            s.heartbeats.iter().any(|h| h.in_flight == 1)
        })
        .await;
    shutdown.trigger();
    task.await.unwrap();
}

#[tokio::test]
async fn a_wrong_credential_never_registers_and_shutdown_still_ends_the_loop() {
    let registry = TestRegistry::default();
    let (_server, handle) = serve(&registry).await;
    let registration = convene_worker::Registration {
        worker_id: "w-3".into(),
        endpoint: "http://127.0.0.1:7412".into(),
        profiles: Vec::new(),
        capacity: 1,
    };
    let shutdown = Shutdown::new();
    let registrar = Registrar::new(handle, "cvn_wrong".into(), registration, Arc::new(|| 0))
        .with_backoff(Duration::from_millis(10));
    let task = tokio::spawn(registrar.run(shutdown.clone()));
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(registry.seen().registers.is_empty());
    shutdown.trigger();
    tokio::time::timeout(Duration::from_secs(5), task)
        .await
        .expect("a registrar that never registered still stops")
        .unwrap();
}
