//! The server builder's behaviour, observed through real gRPC clients over loopback
//! sockets: health, reflection, timeouts, load shedding, message limits and graceful
//! shutdown.

use std::{
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use convene_proto::v1::{
    AuthorizeBatchRequest, AuthorizeBatchResponse, AuthorizeRequest, AuthorizeResponse,
    GetSigningKeysRequest, GetSigningKeysResponse, IssueTaskTokenRequest, IssueTaskTokenResponse,
    RevokeRequest, RevokeResponse,
    policy_client::PolicyClient,
    policy_server::{Policy, PolicyServer},
};
use convene_server::{
    GrpcServer, ServeError, ServerSettings, Shutdown,
    test_util::{TestServer, connect, pick_listener},
};
use tonic::{Code, Request, Response, Status, transport::Channel};
use tonic_health::pb::{
    HealthCheckRequest, health_check_response::ServingStatus, health_client::HealthClient,
};

/// Counts what the handlers did, so tests can wait for a call to be in flight and check
/// that cut-off handlers were dropped rather than finished.
#[derive(Debug, Default)]
struct Calls {
    started: AtomicUsize,
    in_flight: AtomicUsize,
    max_in_flight: AtomicUsize,
    finished: AtomicUsize,
    dropped: AtomicUsize,
}

/// Tracks one handler run; a run dropped before `finish` counts as dropped.
struct CallGuard {
    calls: Arc<Calls>,
    finished: bool,
}

impl CallGuard {
    fn start(calls: &Arc<Calls>) -> Self {
        calls.started.fetch_add(1, Ordering::SeqCst);
        let now = calls.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        calls.max_in_flight.fetch_max(now, Ordering::SeqCst);
        Self {
            calls: calls.clone(),
            finished: false,
        }
    }

    fn finish(mut self) {
        self.finished = true;
        self.calls.finished.fetch_add(1, Ordering::SeqCst);
    }
}

impl Drop for CallGuard {
    fn drop(&mut self) {
        self.calls.in_flight.fetch_sub(1, Ordering::SeqCst);
        if !self.finished {
            self.calls.dropped.fetch_add(1, Ordering::SeqCst);
        }
    }
}

/// A policy service whose `Authorize` sleeps for the number of milliseconds in `tool`
/// and answers with the size of `action`.
#[derive(Clone, Debug, Default)]
struct SlowPolicy {
    calls: Arc<Calls>,
}

#[tonic::async_trait]
impl Policy for SlowPolicy {
    async fn issue_task_token(
        &self,
        _: Request<IssueTaskTokenRequest>,
    ) -> Result<Response<IssueTaskTokenResponse>, Status> {
        Err(Status::unimplemented("not part of this test"))
    }

    async fn authorize(
        &self,
        request: Request<AuthorizeRequest>,
    ) -> Result<Response<AuthorizeResponse>, Status> {
        let guard = CallGuard::start(&self.calls);
        let request = request.into_inner();
        let millis: u64 = request.tool.parse().unwrap_or(0);
        tokio::time::sleep(Duration::from_millis(millis)).await;
        guard.finish();
        Ok(Response::new(AuthorizeResponse {
            allowed: true,
            detail: format!("{} bytes", request.action.len()),
            ..AuthorizeResponse::default()
        }))
    }

    async fn authorize_batch(
        &self,
        _: Request<AuthorizeBatchRequest>,
    ) -> Result<Response<AuthorizeBatchResponse>, Status> {
        Err(Status::unimplemented("not part of this test"))
    }

    async fn revoke(&self, _: Request<RevokeRequest>) -> Result<Response<RevokeResponse>, Status> {
        Err(Status::unimplemented("not part of this test"))
    }

    async fn get_signing_keys(
        &self,
        _: Request<GetSigningKeysRequest>,
    ) -> Result<Response<GetSigningKeysResponse>, Status> {
        Err(Status::unimplemented("not part of this test"))
    }

    async fn list_tools(
        &self,
        _: Request<convene_proto::v1::ListToolsRequest>,
    ) -> Result<Response<convene_proto::v1::ListToolsResponse>, Status> {
        Err(Status::unimplemented("not part of this test"))
    }

    async fn who_am_i(
        &self,
        _: Request<convene_proto::v1::WhoAmIRequest>,
    ) -> Result<Response<convene_proto::v1::WhoAmIResponse>, Status> {
        Err(Status::unimplemented("not part of this test"))
    }
}

/// Starts a server with one `SlowPolicy` under `settings`.
async fn start(settings: ServerSettings) -> (TestServer, Arc<Calls>) {
    let policy = SlowPolicy::default();
    let calls = policy.calls.clone();
    let server = GrpcServer::new(settings).add_service(PolicyServer::new(policy));
    (TestServer::start(server).await, calls)
}

/// An `Authorize` call whose handler sleeps `millis`.
async fn authorize(channel: Channel, millis: u64) -> Result<AuthorizeResponse, Status> {
    let request = AuthorizeRequest {
        tool: millis.to_string(),
        ..AuthorizeRequest::default()
    };
    PolicyClient::new(channel)
        .authorize(request)
        .await
        .map(Response::into_inner)
}

/// Waits until `count` handlers have started, failing the test after `limit`.
async fn wait_started(calls: &Calls, count: usize, limit: Duration) {
    let deadline = Instant::now() + limit;
    while calls.started.load(Ordering::SeqCst) < count {
        assert!(
            Instant::now() < deadline,
            "{count} handler(s) not started within {limit:?}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

fn health_request(service: &str) -> HealthCheckRequest {
    HealthCheckRequest {
        service: service.to_owned(),
    }
}

#[tokio::test]
async fn health_reports_serving_then_not_serving_once_shutdown_begins() {
    let (server, _) = start(ServerSettings::default()).await;
    let mut health = HealthClient::new(server.channel().await);

    for service in ["convene.v1.Policy", ""] {
        let status = health.check(health_request(service)).await.unwrap();
        assert_eq!(
            status.into_inner().status,
            ServingStatus::Serving as i32,
            "{service:?}"
        );
    }
    let err = health
        .check(health_request("convene.v1.Supervisor"))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::NotFound, "a service not added is unknown");

    let mut watch = health
        .watch(health_request("convene.v1.Policy"))
        .await
        .unwrap()
        .into_inner();
    let first = watch.message().await.unwrap().expect("initial status");
    assert_eq!(first.status, ServingStatus::Serving as i32);

    let triggered = Instant::now();
    server.shutdown.trigger();
    let next = tokio::time::timeout(Duration::from_secs(5), watch.message())
        .await
        .expect("status change arrives promptly")
        .unwrap()
        .expect("a status, not the end of the stream");
    assert_eq!(next.status, ServingStatus::NotServing as i32);

    // The watch then ends instead of holding the drain open until the grace period.
    let end = tokio::time::timeout(Duration::from_secs(5), watch.message())
        .await
        .expect("watch ends promptly");
    let err = end.expect_err("the watch ends with a status");
    assert_eq!(err.code(), Code::Unavailable, "{err:?}");
    assert!(err.message().contains("shutting down"), "{err:?}");

    server.join().await.unwrap();
    // Well under the default 10 s grace: nothing was left to wait for.
    assert!(
        triggered.elapsed() < Duration::from_secs(5),
        "{:?}",
        triggered.elapsed()
    );
}

#[tokio::test]
async fn reflection_lists_exactly_the_served_services() {
    use tokio_stream::StreamExt as _;
    use tonic_reflection::pb::{v1, v1alpha};

    let (server, _) = start(ServerSettings::default()).await;

    let request = v1::ServerReflectionRequest {
        host: String::new(),
        message_request: Some(v1::server_reflection_request::MessageRequest::ListServices(
            String::new(),
        )),
    };
    let mut client =
        v1::server_reflection_client::ServerReflectionClient::new(server.channel().await);
    let mut responses = client
        .server_reflection_info(tokio_stream::once(request))
        .await
        .unwrap()
        .into_inner();
    let response = responses.next().await.expect("a response").unwrap();
    let Some(v1::server_reflection_response::MessageResponse::ListServicesResponse(list)) =
        response.message_response
    else {
        panic!("expected a service list, got {response:?}");
    };
    let names: Vec<String> = list.service.into_iter().map(|s| s.name).collect();
    for expected in [
        "convene.v1.Policy",
        "grpc.health.v1.Health",
        "grpc.reflection.v1.ServerReflection",
    ] {
        assert!(
            names.iter().any(|n| n == expected),
            "{expected} missing from {names:?}"
        );
    }
    assert!(
        !names.iter().any(|n| n == "convene.v1.Supervisor"),
        "only served services are listed: {names:?}"
    );

    // The descriptor behind a listed service can be fetched, so tools can call it.
    let request = v1::ServerReflectionRequest {
        host: String::new(),
        message_request: Some(
            v1::server_reflection_request::MessageRequest::FileContainingSymbol(
                "convene.v1.Policy".into(),
            ),
        ),
    };
    let mut responses = client
        .server_reflection_info(tokio_stream::once(request))
        .await
        .unwrap()
        .into_inner();
    let response = responses.next().await.expect("a response").unwrap();
    let Some(v1::server_reflection_response::MessageResponse::FileDescriptorResponse(files)) =
        response.message_response
    else {
        panic!("expected descriptors, got {response:?}");
    };
    assert!(!files.file_descriptor_proto.is_empty());

    // The older v1alpha protocol, still used by many tools, answers the same list.
    let request = v1alpha::ServerReflectionRequest {
        host: String::new(),
        message_request: Some(
            v1alpha::server_reflection_request::MessageRequest::ListServices(String::new()),
        ),
    };
    let mut client =
        v1alpha::server_reflection_client::ServerReflectionClient::new(server.channel().await);
    let mut responses = client
        .server_reflection_info(tokio_stream::once(request))
        .await
        .unwrap()
        .into_inner();
    let response = responses.next().await.expect("a response").unwrap();
    let Some(v1alpha::server_reflection_response::MessageResponse::ListServicesResponse(list)) =
        response.message_response
    else {
        panic!("expected a service list, got {response:?}");
    };
    assert!(list.service.iter().any(|s| s.name == "convene.v1.Policy"));
}

#[tokio::test]
async fn slow_calls_get_deadline_exceeded_naming_the_timeout() {
    let (server, calls) = start(ServerSettings {
        request_timeout: Some(Duration::from_millis(200)),
        ..ServerSettings::default()
    })
    .await;
    let channel = server.channel().await;

    // A call within the timeout is unaffected.
    authorize(channel.clone(), 0).await.unwrap();

    let started = Instant::now();
    let err = authorize(channel.clone(), 3_000).await.unwrap_err();
    let elapsed = started.elapsed();
    assert_eq!(err.code(), Code::DeadlineExceeded, "{err:?}");
    assert!(err.message().contains("200ms"), "{err:?}");
    assert!(err.message().contains("request_timeout"), "{err:?}");
    // Answered at the timeout, not when the handler would have finished.
    assert!(elapsed < Duration::from_secs(2), "{elapsed:?}");

    // The timed-out handler was dropped, not left running.
    assert_eq!(calls.dropped.load(Ordering::SeqCst), 1);
    assert_eq!(calls.in_flight.load(Ordering::SeqCst), 0);

    // The connection survives: the next call on it works.
    authorize(channel, 0).await.unwrap();
}

#[tokio::test]
async fn calls_over_the_concurrency_limit_are_shed_at_once() {
    const LIMIT: usize = 2;
    const CALLS: usize = 20;
    const HANDLER_MILLIS: u64 = 1_000;
    let (server, calls) = start(ServerSettings {
        concurrency_limit: LIMIT,
        ..ServerSettings::default()
    })
    .await;
    let channel = server.channel().await;

    let tasks: Vec<_> = (0..CALLS)
        .map(|_| {
            let channel = channel.clone();
            tokio::spawn(async move {
                let started = Instant::now();
                let result = authorize(channel, HANDLER_MILLIS).await;
                (result, started.elapsed())
            })
        })
        .collect();

    // While the server is saturated, health still answers: it is outside the limit.
    wait_started(&calls, LIMIT, Duration::from_secs(5)).await;
    let mut health = HealthClient::new(channel.clone());
    let status = health.check(health_request("")).await.unwrap().into_inner();
    assert_eq!(status.status, ServingStatus::Serving as i32);

    let mut succeeded = 0;
    let mut shed = 0;
    for task in tasks {
        // Bounded: a call that hung instead of being shed fails the test here.
        let (result, elapsed) = tokio::time::timeout(Duration::from_secs(10), task)
            .await
            .expect("no call hangs")
            .unwrap();
        match result {
            Ok(_) => succeeded += 1,
            Err(status) => {
                assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
                assert_eq!(
                    status.message(),
                    "server busy: 2 requests in flight (server.concurrency_limit); retry with backoff"
                );
                assert_eq!(
                    convene_server::retry_after(&status),
                    Some(Duration::from_millis(250)),
                    "a shed call says when to retry"
                );
                // Shed calls are answered before any admitted call could finish, so
                // they were never queued.
                assert!(
                    elapsed < Duration::from_millis(HANDLER_MILLIS),
                    "{elapsed:?}"
                );
                shed += 1;
            }
        }
    }
    assert!(
        succeeded >= LIMIT,
        "at least the first {LIMIT} calls run: {succeeded}"
    );
    assert!(shed >= CALLS / 2, "most calls were shed: {shed} of {CALLS}");
    assert_eq!(succeeded + shed, CALLS);
    assert!(calls.max_in_flight.load(Ordering::SeqCst) <= LIMIT);
    assert_eq!(calls.started.load(Ordering::SeqCst), succeeded);
}

#[tokio::test]
async fn requests_over_the_message_limit_are_refused_naming_the_limit() {
    const LIMIT: usize = 64 * 1024;
    let (server, calls) = start(ServerSettings {
        max_message_bytes: LIMIT,
        ..ServerSettings::default()
    })
    .await;
    let channel = server.channel().await;

    let fits = AuthorizeRequest {
        action: "a".repeat(LIMIT / 2),
        ..AuthorizeRequest::default()
    };
    let response = PolicyClient::new(channel.clone())
        .authorize(fits)
        .await
        .unwrap();
    assert_eq!(response.into_inner().detail, format!("{} bytes", LIMIT / 2));

    let too_big = AuthorizeRequest {
        action: "a".repeat(LIMIT + 1),
        ..AuthorizeRequest::default()
    };
    let err = PolicyClient::new(channel)
        .authorize(too_big)
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::OutOfRange, "{err:?}");
    assert!(err.message().contains(&LIMIT.to_string()), "{err:?}");
    // Refused before the handler ran.
    assert_eq!(calls.started.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn shutdown_lets_in_flight_calls_finish_and_refuses_new_connections() {
    const HANDLER_MILLIS: u64 = 1_500;
    let (server, calls) = start(ServerSettings {
        shutdown_grace: Duration::from_secs(10),
        ..ServerSettings::default()
    })
    .await;
    let addr = server.addr;
    let in_flight = tokio::spawn(authorize(server.channel().await, HANDLER_MILLIS));
    wait_started(&calls, 1, Duration::from_secs(5)).await;

    let triggered = Instant::now();
    server.shutdown.trigger();

    // The listener closes at once: new connections are refused while the call runs.
    let refused_by = Instant::now() + Duration::from_secs(1);
    loop {
        match tokio::net::TcpStream::connect(addr).await {
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => break,
            outcome => {
                assert!(Instant::now() < refused_by, "still accepting: {outcome:?}");
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    }
    assert!(
        !in_flight.is_finished(),
        "the refusal was observed during the drain"
    );

    let response = in_flight
        .await
        .unwrap()
        .expect("the in-flight call completes");
    assert!(response.allowed);
    server.join().await.unwrap();
    let drained = triggered.elapsed();
    // `serve` returns when the last call is done: after the handler's remaining time,
    // well before the 10 s grace period.
    assert!(drained < Duration::from_secs(5), "{drained:?}");
    assert_eq!(calls.finished.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn calls_running_past_the_grace_period_are_cut_off() {
    const GRACE: Duration = Duration::from_millis(300);
    let (server, calls) = start(ServerSettings {
        shutdown_grace: GRACE,
        request_timeout: None,
        ..ServerSettings::default()
    })
    .await;
    let in_flight = tokio::spawn(authorize(server.channel().await, 60_000));
    wait_started(&calls, 1, Duration::from_secs(5)).await;

    let triggered = Instant::now();
    server.shutdown.trigger();
    server.join().await.unwrap();
    let stopped = triggered.elapsed();
    // Not before the grace period, and soon after it: the cut-off allows up to 1 s for
    // the answers to go out; the rest is slack for a loaded 2-core CI machine.
    assert!(stopped >= GRACE, "{stopped:?}");
    assert!(stopped < GRACE + Duration::from_secs(3), "{stopped:?}");

    let err = tokio::time::timeout(Duration::from_secs(5), in_flight)
        .await
        .expect("the client gets an answer")
        .unwrap()
        .expect_err("the call was cut off");
    assert_eq!(err.code(), Code::Unavailable, "{err:?}");
    assert!(err.message().contains("grace period"), "{err:?}");
    assert_eq!(calls.finished.load(Ordering::SeqCst), 0);
    assert_eq!(
        calls.dropped.load(Ordering::SeqCst),
        1,
        "the handler was dropped"
    );
}

#[tokio::test]
async fn serve_refuses_invalid_setups() {
    let listener = pick_listener().await;
    let server = GrpcServer::new(ServerSettings {
        concurrency_limit: 0,
        ..ServerSettings::default()
    })
    .add_service(PolicyServer::new(SlowPolicy::default()));
    let err = server.serve(listener, Shutdown::new()).await.unwrap_err();
    assert!(matches!(err, ServeError::Settings(_)), "{err:?}");
    assert!(err.to_string().contains("concurrency_limit"), "{err}");

    let listener = pick_listener().await;
    let server = GrpcServer::new(ServerSettings::default())
        .add_service(PolicyServer::new(SlowPolicy::default()))
        .add_service(PolicyServer::new(SlowPolicy::default()));
    assert_eq!(server.service_names(), ["convene.v1.Policy"]);
    let err = server.serve(listener, Shutdown::new()).await.unwrap_err();
    assert!(
        matches!(
            err,
            ServeError::DuplicateService {
                name: "convene.v1.Policy"
            }
        ),
        "{err:?}"
    );
}

#[tokio::test]
async fn two_servers_in_one_process_are_independent() {
    let (first, _) = start(ServerSettings::default()).await;
    let (second, _) = start(ServerSettings::default()).await;
    let second_addr = second.addr;
    first.stop().await.unwrap();

    // Stopping one leaves the other serving.
    let channel = connect(second_addr).await;
    authorize(channel, 0).await.unwrap();
    second.stop().await.unwrap();
}

/// Thousands of small calls over one connection, arriving faster than the server's
/// handlers get to read them, all succeed: the server's HTTP/2 connection window leaves
/// room for their unread DATA frames. (With h2's default window, its budget for small
/// unread frames is about 150 of them; past it, h2 sends GOAWAY `ENHANCE_YOUR_CALM` and
/// every call on the connection fails.) One thread serves both sides, so the server's
/// connection task reads a burst of frames before any handler runs.
#[tokio::test(flavor = "current_thread")]
async fn a_burst_of_small_calls_on_one_connection_all_succeed() {
    const CALLS: usize = 2_000;
    let (server, calls) = start(ServerSettings {
        concurrency_limit: CALLS,
        ..ServerSettings::default()
    })
    .await;
    let channel = server.channel().await;
    let tasks: Vec<_> = (0..CALLS)
        .map(|_| tokio::spawn(authorize(channel.clone(), 0)))
        .collect();
    let mut failed = Vec::new();
    for task in tasks {
        if let Err(status) = task.await.unwrap() {
            failed.push(status);
        }
    }
    assert!(
        failed.is_empty(),
        "{} of {CALLS} calls failed, the first with {:?}",
        failed.len(),
        failed.first()
    );
    assert_eq!(calls.finished.load(Ordering::SeqCst), CALLS);
}
