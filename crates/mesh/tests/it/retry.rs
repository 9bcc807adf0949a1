//! A call a full server refused is sent again after the server's hint, a few times at
//! most and only within the client's retry budget: retries never multiply an overload.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use convene_mesh::handles::{GrpcWorkerRegistry, channel};
use convene_mesh::retry::{MAX_RETRIES, RetryBudget};
use convene_proto::v1::{
    self,
    worker_registry_server::{WorkerRegistry, WorkerRegistryServer},
};
use tokio_stream::wrappers::TcpListenerStream;
use tonic::{Code, Request, Response, Status};

/// A registry that answers the heartbeats it is sent after the first `refuse` with
/// `registered`, and refuses those before as a full server does: with a retry hint
/// (or, with `hint` false, without one).
#[derive(Clone)]
struct Full {
    calls: Arc<AtomicUsize>,
    refuse: usize,
    hint: bool,
}

#[tonic::async_trait]
impl WorkerRegistry for Full {
    async fn register(
        &self,
        _: Request<v1::RegisterRequest>,
    ) -> Result<Response<v1::RegisterResponse>, Status> {
        Err(Status::unimplemented("heartbeats only"))
    }

    async fn heartbeat(
        &self,
        request: Request<v1::HeartbeatRequest>,
    ) -> Result<Response<v1::HeartbeatResponse>, Status> {
        // What the caller sent arrives whole on every attempt, metadata included.
        assert_eq!(request.get_ref().worker_id, "w1");
        assert_eq!(
            request
                .metadata()
                .get("authorization")
                .map(|v| v.to_str().unwrap()),
            Some("Bearer secret")
        );
        let n = self.calls.fetch_add(1, Ordering::SeqCst);
        if n < self.refuse {
            return Err(if self.hint {
                convene_server::resource_exhausted("full", Duration::from_millis(10))
            } else {
                Status::resource_exhausted("a limit of this request")
            });
        }
        Ok(Response::new(v1::HeartbeatResponse { registered: true }))
    }

    async fn deregister(
        &self,
        _: Request<v1::DeregisterRequest>,
    ) -> Result<Response<v1::DeregisterResponse>, Status> {
        Err(Status::unimplemented("heartbeats only"))
    }
}

/// Serves `full` on a loopback port; returns the adapter of a client with `budget`.
async fn serve(full: Full, budget: RetryBudget) -> GrpcWorkerRegistry {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("local addr");
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(WorkerRegistryServer::new(full))
            .serve_with_incoming(TcpListenerStream::new(listener)),
    );
    GrpcWorkerRegistry::with_budget(channel(&format!("http://{addr}")).expect("channel"), budget)
}

async fn heartbeat(client: &GrpcWorkerRegistry) -> Result<bool, Status> {
    let mut request = Request::new(v1::HeartbeatRequest {
        worker_id: "w1".to_owned(),
        ..Default::default()
    });
    request
        .metadata_mut()
        .insert("authorization", "Bearer secret".parse().unwrap());
    client
        .heartbeat(request)
        .await
        .map(|r| r.into_inner().registered)
}

fn full(refuse: usize, hint: bool) -> (Full, Arc<AtomicUsize>) {
    let calls = Arc::new(AtomicUsize::new(0));
    (
        Full {
            calls: calls.clone(),
            refuse,
            hint,
        },
        calls,
    )
}

#[tokio::test]
async fn a_refusal_with_a_hint_is_retried_and_the_caller_sees_the_answer() {
    let (server, calls) = full(2, true);
    let client = serve(server, RetryBudget::default()).await;
    assert!(heartbeat(&client).await.expect("answered on the third try"));
    assert_eq!(calls.load(Ordering::SeqCst), 3);
}

#[tokio::test]
async fn a_call_gives_up_after_a_few_retries_with_the_servers_refusal() {
    let (server, calls) = full(usize::MAX, true);
    let client = serve(server, RetryBudget::default()).await;
    let refused = heartbeat(&client).await.expect_err("always full");
    assert_eq!(refused.code(), Code::ResourceExhausted);
    assert_eq!(refused.message(), "full");
    assert_eq!(
        calls.load(Ordering::SeqCst),
        1 + MAX_RETRIES as usize,
        "the first try and MAX_RETRIES retries"
    );
}

#[tokio::test]
async fn other_failures_and_refusals_without_a_hint_are_not_retried() {
    let (server, calls) = full(usize::MAX, false);
    let client = serve(server, RetryBudget::default()).await;
    let refused = heartbeat(&client).await.expect_err("refused");
    assert_eq!(refused.message(), "a limit of this request");
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn retries_stop_when_the_budget_is_spent_so_an_overload_is_not_multiplied() {
    // Two retries a second over a one-second window and nothing earned by answers
    // (the server answers none): many callers at once get about two retries in all,
    // not three each.
    let callers = 40;
    let (server, calls) = full(usize::MAX, true);
    let client = serve(server, RetryBudget::new(Duration::from_secs(1), 2, 0.0)).await;
    let results = futures::future::join_all((0..callers).map(|_| heartbeat(&client))).await;
    assert!(results.iter().all(|r| {
        r.as_ref()
            .is_err_and(|s| s.code() == Code::ResourceExhausted)
    }));
    let sent = calls.load(Ordering::SeqCst);
    assert!(
        (callers..=callers + 4).contains(&sent),
        "{sent} calls reached the server for {callers} callers: retries went past the budget"
    );

    // With a budget that allows none, every call reaches the server exactly once.
    let (server, calls) = full(usize::MAX, true);
    let client = serve(server, RetryBudget::new(Duration::from_secs(1), 0, 0.0)).await;
    let results = futures::future::join_all((0..callers).map(|_| heartbeat(&client))).await;
    assert!(results.iter().all(Result::is_err));
    assert_eq!(calls.load(Ordering::SeqCst), callers);
}
