//! A channel to a host name standing for several replicas spreads its calls over every
//! address the name resolves to, and follows the name as replicas come and go.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use convene_mesh::handles::{GrpcWorkerRegistry, channel_with};
use convene_mesh::resolve::Resolver;
use convene_proto::v1::{
    self,
    worker_registry_server::{WorkerRegistry, WorkerRegistryServer},
};
use tokio_stream::wrappers::TcpListenerStream;
use tonic::{Request, Response, Status};

/// A registry replica that counts the heartbeats it answers.
#[derive(Clone, Default)]
struct Counting(Arc<AtomicUsize>);

#[tonic::async_trait]
impl WorkerRegistry for Counting {
    async fn register(
        &self,
        _: Request<v1::RegisterRequest>,
    ) -> Result<Response<v1::RegisterResponse>, Status> {
        Err(Status::unimplemented("heartbeats only"))
    }

    async fn heartbeat(
        &self,
        _: Request<v1::HeartbeatRequest>,
    ) -> Result<Response<v1::HeartbeatResponse>, Status> {
        self.0.fetch_add(1, Ordering::SeqCst);
        Ok(Response::new(v1::HeartbeatResponse { registered: true }))
    }

    async fn deregister(
        &self,
        _: Request<v1::DeregisterRequest>,
    ) -> Result<Response<v1::DeregisterResponse>, Status> {
        Err(Status::unimplemented("heartbeats only"))
    }
}

/// Serves a counting replica on `addr`.
async fn replica(addr: SocketAddr) -> (SocketAddr, Arc<AtomicUsize>) {
    let listener = tokio::net::TcpListener::bind(addr).await.expect("bind");
    let bound = listener.local_addr().expect("local addr");
    let counting = Counting::default();
    let count = counting.0.clone();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(WorkerRegistryServer::new(counting))
            .serve_with_incoming(TcpListenerStream::new(listener)),
    );
    (bound, count)
}

/// A resolver answering whatever `answer` holds at the time.
fn resolver(answer: Arc<Mutex<Vec<SocketAddr>>>) -> Resolver {
    Arc::new(move |host, _| {
        assert_eq!(host, "registry-peers");
        let now = answer.lock().unwrap().clone();
        Box::pin(async move { Ok(now) })
    })
}

async fn heartbeats(registry: &GrpcWorkerRegistry, n: usize) {
    for _ in 0..n {
        registry
            .heartbeat(Request::new(v1::HeartbeatRequest::default()))
            .await
            .expect("a heartbeat answered");
    }
}

#[tokio::test]
async fn calls_spread_over_every_resolved_address_and_follow_the_name() {
    // Two replicas on one port at two loopback addresses, as two pods behind one
    // headless Service name.
    let (a, a_count) = replica("127.0.0.1:0".parse().unwrap()).await;
    let (b, b_count) = replica(SocketAddr::new("127.0.0.2".parse().unwrap(), a.port())).await;
    let answer = Arc::new(Mutex::new(vec![a, b]));
    let channel = channel_with(
        &format!("http://registry-peers:{}", a.port()),
        &resolver(answer.clone()),
        Duration::from_millis(100),
    )
    .expect("a channel");
    let registry = GrpcWorkerRegistry::new(channel);

    heartbeats(&registry, 200).await;
    let (on_a, on_b) = (
        a_count.load(Ordering::SeqCst),
        b_count.load(Ordering::SeqCst),
    );
    assert_eq!(on_a + on_b, 200);
    assert!(
        on_a > 0 && on_b > 0,
        "one replica got every call: {on_a} and {on_b}"
    );

    // Replica B leaves the name: once the channel has resolved it again, every call
    // goes to A.
    *answer.lock().unwrap() = vec![a];
    tokio::time::sleep(Duration::from_millis(500)).await;
    let before = b_count.load(Ordering::SeqCst);
    heartbeats(&registry, 50).await;
    assert_eq!(
        b_count.load(Ordering::SeqCst),
        before,
        "a call reached the departed replica"
    );
    assert_eq!(a_count.load(Ordering::SeqCst), on_a + 50);
}
