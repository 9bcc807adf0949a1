//! [`GrpcServer`]: one builder that gives every convene gRPC server the same plumbing.
//!
//! Every server gets, without the service having to ask:
//!
//! - the standard `grpc.health.v1.Health` service, reporting `SERVING` for each added
//!   service and for `""` (the whole server), and `NOT_SERVING` once shutdown begins;
//! - gRPC reflection (v1 and v1alpha) listing exactly the services served, with the
//!   convene, health and reflection descriptors;
//! - message-size limits ([`ServerSettings::max_message_bytes`]) on every added service,
//!   through [`MessageLimits`];
//! - a request timeout answered with `DEADLINE_EXCEEDED`, a concurrency limit that sheds
//!   excess calls with `RESOURCE_EXHAUSTED`, both as proper gRPC responses;
//! - a server span per call whose parent is the caller's W3C trace context, with the
//!   OpenTelemetry RPC attributes and the call's gRPC status;
//! - graceful shutdown driven by a [`Shutdown`] handle, bounded by a grace period.
//!
//! # Layers
//!
//! The per-call layers live in two functions, `app_stack` (services added with
//! [`GrpcServer::add_service`]) and `builtin_stack` (health and reflection), so a new
//! cross-cutting layer is added in one place. Health and reflection are deliberately
//! outside the timeout, the concurrency limit and tracing: an overloaded server must
//! still answer its health checks, and probes would drown the traces.
//!
//! # Shutdown, in order
//!
//! 1. health turns `NOT_SERVING` for every service and for `""`;
//! 2. health and reflection streams end (`UNAVAILABLE`), so watchers learn at once and do
//!    not hold the drain open;
//! 3. the listener closes (new connections are refused) and each connection is told to go
//!    away (HTTP/2 GOAWAY), while calls in flight go on;
//! 4. when the last call finishes, [`GrpcServer::serve`] returns; if calls are still
//!    running after [`ServerSettings::shutdown_grace`], they are answered `UNAVAILABLE`
//!    (unary calls not yet answered, and open response streams), their handlers are
//!    dropped, and `serve` returns.
//!
//! Services whose streams never end on their own (watch-style streams) should end them
//! when the [`Shutdown`] they were given triggers, instead of waiting to be cut off.
//!
//! # In-process use
//!
//! Nothing in here is global: each [`GrpcServer`] owns its semaphore, its health state and
//! its shutdown tokens, so `convene up` can run several servers in one process. The
//! in-process mode bypasses this crate entirely: the service trait implementations are
//! called directly through each service's client trait, and the checks that matter
//! (tokens, tenant, limits) live in the services, not in these layers.

use std::{
    convert::Infallible,
    future::Future,
    marker::PhantomData,
    net::SocketAddr,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
    time::Duration,
};

use bytes::Bytes;
use http::HeaderMap;
use http_body::{Frame, SizeHint};
use tokio::{net::TcpListener, sync::Semaphore};
use tokio_stream::StreamExt as _;
use tokio_util::sync::{CancellationToken, WaitForCancellationFutureOwned};
use tonic::{
    Status,
    body::Body,
    server::NamedService,
    service::RoutesBuilder,
    transport::{Server, server::TcpIncoming},
};
use tonic_health::ServingStatus;
use tower::{
    BoxError, Service, ServiceExt as _,
    limit::ConcurrencyLimit,
    load_shed::{LoadShed, error::Overloaded},
    timeout::{Timeout, error::Elapsed},
    util::BoxCloneSyncService,
};

use crate::{
    Shutdown,
    settings::{ServerSettings, SettingsError},
    trace::TraceCalls,
};

/// The name the health service is served under.
pub const HEALTH_SERVICE: &str = tonic_health::pb::health_server::SERVICE_NAME;
/// The names the reflection services are served under.
pub const REFLECTION_SERVICES: [&str; 2] = [
    tonic_reflection::pb::v1::server_reflection_server::SERVICE_NAME,
    tonic_reflection::pb::v1alpha::server_reflection_server::SERVICE_NAME,
];

/// Time allowed, after calls past the grace period were cut off, for their `UNAVAILABLE`
/// answers to be written and the connections to close before `serve` returns anyway.
const CUT_OFF_FLUSH: Duration = Duration::from_secs(1);

/// The HTTP/2 connection window a server grants each client (bytes in flight over a
/// connection that it has not read yet).
const CONNECTION_WINDOW: u32 = 32 << 20;

/// Why a server could not start or stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The settings cannot work.
    #[error(transparent)]
    Settings(#[from] SettingsError),
    /// Two services with the same gRPC name were added, or one collides with a service
    /// the builder registers itself.
    #[error(
        "service {name} is added twice; a server serves each gRPC service name once \
         (health and reflection are added by the builder itself)"
    )]
    DuplicateService {
        /// The fully qualified gRPC service name.
        name: &'static str,
    },
    /// The listen address cannot be bound.
    #[error("cannot listen on {addr}: {source}; is another process using the port?")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The listener's own address cannot be read.
    #[error("cannot read the listener's address: {0}")]
    LocalAddr(#[source] std::io::Error),
    /// The descriptor sets given to reflection are inconsistent (a build problem).
    #[error("cannot build the reflection service: {0}")]
    Reflection(#[from] tonic_reflection::server::Error),
    /// The transport failed while serving.
    #[error("gRPC server failed: {0}")]
    Transport(#[from] tonic::transport::Error),
}

/// A tonic-generated server whose message-size limits can be set.
///
/// [`GrpcServer::add_service`] uses it to apply [`ServerSettings::max_message_bytes`] to
/// every service, so no service can forget its limits. Implement it for other generated
/// servers with [`impl_message_limits!`](crate::impl_message_limits).
pub trait MessageLimits: Sized {
    /// Returns the server with both its decoding (request) and encoding (response)
    /// message limits set to `max_bytes`.
    #[must_use]
    fn with_message_limits(self, max_bytes: usize) -> Self;
}

/// Implements [`MessageLimits`] for tonic-generated server types, given by path without
/// their type parameter: `impl_message_limits!(my_proto::foo_server::FooServer);`.
#[macro_export]
macro_rules! impl_message_limits {
    ($($($segment:ident)::+),+ $(,)?) => {
        $(
            impl<T> $crate::MessageLimits for $($segment)::+<T> {
                fn with_message_limits(self, max_bytes: usize) -> Self {
                    self.max_decoding_message_size(max_bytes)
                        .max_encoding_message_size(max_bytes)
                }
            }
        )+
    };
}

impl_message_limits!(
    convene_proto::v1::policy_server::PolicyServer,
    convene_proto::v1::evidence_store_server::EvidenceStoreServer,
    convene_proto::v1::supervisor_server::SupervisorServer,
    convene_proto::v1::worker_registry_server::WorkerRegistryServer,
    convene_proto::v1::worker_server::WorkerServer,
    convene_proto::v1::approval_server::ApprovalServer,
);

/// Binds `addr` for a [`GrpcServer`], with an error that names the address.
///
/// # Errors
///
/// [`Error::Bind`] if the address is in use or not local.
pub async fn bind(addr: SocketAddr) -> Result<TcpListener, Error> {
    TcpListener::bind(addr)
        .await
        .map_err(|source| Error::Bind { addr, source })
}

/// Builds and runs one gRPC server. See the [module docs](crate::builder) for what it adds.
pub struct GrpcServer {
    settings: ServerSettings,
    routes: RoutesBuilder,
    names: Vec<&'static str>,
    duplicate: Option<&'static str>,
    guards: CallGuards,
    /// Ends health and reflection streams once draining begins.
    drain: CancellationToken,
    /// TLS of its own; else the process's ([`crate::tls::installed`]); else plaintext.
    tls: Option<crate::tls::ServerTls>,
}

impl std::fmt::Debug for GrpcServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrpcServer")
            .field("settings", &self.settings)
            .field("services", &self.names)
            .finish_non_exhaustive()
    }
}

impl GrpcServer {
    /// A server with no services yet, configured by `settings`.
    pub fn new(settings: ServerSettings) -> Self {
        let guards = CallGuards {
            timeout: settings.request_timeout,
            // At least one permit, so a zero limit (rejected by `serve`) cannot panic here.
            semaphore: Arc::new(Semaphore::new(settings.concurrency_limit.max(1))),
            limit: settings.concurrency_limit,
            cut_off: CancellationToken::new(),
            cut_off_message: Arc::from(format!(
                "server shut down: the call did not finish within the {} shutdown grace \
                 period; retry against another instance",
                humantime::format_duration(settings.shutdown_grace)
            )),
        };
        Self {
            settings,
            routes: RoutesBuilder::default(),
            names: Vec::new(),
            duplicate: None,
            guards,
            drain: CancellationToken::new(),
            tls: None,
        }
    }

    /// Serves TLS with `tls` instead of the process's settings.
    #[must_use]
    pub fn with_tls(mut self, tls: crate::tls::ServerTls) -> Self {
        self.tls = Some(tls);
        self
    }

    /// The settings the server runs with.
    pub fn settings(&self) -> &ServerSettings {
        &self.settings
    }

    /// The gRPC names of the services added so far.
    pub fn service_names(&self) -> &[&'static str] {
        &self.names
    }

    /// Adds a tonic-generated server (e.g. `PolicyServer::new(policy)`), applying the
    /// message-size limits, the request timeout and the concurrency limit, and reporting
    /// it `SERVING` in health and in reflection.
    #[must_use]
    pub fn add_service<S>(self, service: S) -> Self
    where
        S: MessageLimits
            + Service<http::Request<Body>, Response = http::Response<Body>, Error = Infallible>
            + NamedService
            + Clone
            + Send
            + Sync
            + 'static,
        S::Future: Send + 'static,
    {
        let max_bytes = self.settings.max_message_bytes;
        self.add_service_with_own_limits(service.with_message_limits(max_bytes))
    }

    /// Like [`add_service`](Self::add_service) for a server that does not implement
    /// [`MessageLimits`]: the caller is responsible for its message-size limits. The
    /// timeout, the concurrency limit, health and reflection apply as usual.
    #[must_use]
    pub fn add_service_with_own_limits<S>(mut self, service: S) -> Self
    where
        S: Service<http::Request<Body>, Response = http::Response<Body>, Error = Infallible>
            + NamedService
            + Clone
            + Send
            + Sync
            + 'static,
        S::Future: Send + 'static,
    {
        if self.names.contains(&S::NAME) {
            self.duplicate.get_or_insert(S::NAME);
            return self;
        }
        self.names.push(S::NAME);
        self.routes.add_service(app_stack(service, &self.guards));
        self
    }

    /// Serves on `listener` until `shutdown` triggers, then drains as described in the
    /// [module docs](crate::builder) and returns.
    ///
    /// # Errors
    ///
    /// Invalid settings, a duplicate service name, a reflection build failure, or a
    /// transport failure while serving.
    pub async fn serve(self, listener: TcpListener, shutdown: Shutdown) -> Result<(), Error> {
        self.settings.validate()?;
        if let Some(name) = self.duplicate {
            return Err(Error::DuplicateService { name });
        }
        if let Some(&name) = self
            .names
            .iter()
            .find(|n| **n == HEALTH_SERVICE || REFLECTION_SERVICES.contains(n))
        {
            return Err(Error::DuplicateService { name });
        }
        let local_addr = listener.local_addr().map_err(Error::LocalAddr)?;

        let (reporter, health) = tonic_health::server::health_reporter();
        for name in &self.names {
            reporter
                .set_service_status(name, ServingStatus::Serving)
                .await;
        }

        let mut routes = self.routes;
        routes.add_service(builtin_stack(health, &self.drain));
        let (reflection_v1, reflection_v1alpha) = reflection(&self.names)?;
        routes.add_service(builtin_stack(reflection_v1, &self.drain));
        routes.add_service(builtin_stack(reflection_v1alpha, &self.drain));

        let tls = self
            .tls
            .clone()
            .or_else(|| crate::tls::installed().and_then(|t| t.server.clone()));
        let names = self.names.clone();
        let drain = self.drain.clone();
        let begin_drain = {
            let shutdown = shutdown.clone();
            async move {
                shutdown.wait().await;
                tracing::info!(%local_addr, "draining: health NOT_SERVING, listener closed");
                for name in names.iter().copied().chain([""]) {
                    reporter
                        .set_service_status(name, ServingStatus::NotServing)
                        .await;
                }
                // After the status change, so health watchers receive NOT_SERVING before
                // their stream ends.
                drain.cancel();
            }
        };

        tracing::info!(%local_addr, services = ?self.names, tls = tls.is_some(), "gRPC server listening");
        let router = Server::builder()
            // h2 hangs up (GOAWAY ENHANCE_YOUR_CALM "too_many_data_frames") on a client
            // whose small DATA frames not yet read by the server exceed a budget of half
            // the connection window. A burst of thousands of small calls queued behind
            // busy handlers (10,000 runs finishing at once) exceeded the default, and the
            // GOAWAY failed every call on the connection. A larger window raises the
            // budget; callers here are the mesh's own services.
            .initial_connection_window_size(Some(CONNECTION_WINDOW))
            .add_routes(routes.routes());
        let server: Pin<Box<dyn Future<Output = Result<(), tonic::transport::Error>> + Send>> =
            match tls {
                None => Box::pin(router.serve_with_incoming_shutdown(
                    TcpIncoming::from(listener).with_nodelay(Some(true)),
                    begin_drain,
                )),
                Some(tls) => {
                    let accepted = crate::tls::incoming(listener, tls.config(&[b"h2"]));
                    let incoming = tokio_stream::wrappers::ReceiverStream::new(accepted)
                        .map(|(stream, _peer)| Ok::<_, std::io::Error>(stream));
                    Box::pin(router.serve_with_incoming_shutdown(incoming, begin_drain))
                }
            };
        let mut server = server;

        tokio::select! {
            // Before shutdown, the server only returns if it fails.
            result = &mut server => return result.map_err(Error::from),
            () = shutdown.wait() => {}
        }

        let grace = self.settings.shutdown_grace;
        match tokio::time::timeout(grace, &mut server).await {
            Ok(result) => result?,
            Err(_elapsed) => {
                tracing::warn!(
                    %local_addr,
                    grace = %humantime::format_duration(grace),
                    "calls still running after the shutdown grace period; cutting them off"
                );
                self.guards.cut_off.cancel();
                if tokio::time::timeout(CUT_OFF_FLUSH, &mut server)
                    .await
                    .is_err()
                {
                    tracing::warn!(%local_addr, "connections still open after the cut-off; returning anyway");
                }
            }
        }
        tracing::info!(%local_addr, "gRPC server stopped");
        Ok(())
    }
}

/// Builds the v1 and v1alpha reflection services, advertising exactly the services this
/// server runs.
fn reflection(
    names: &[&'static str],
) -> Result<
    (
        tonic_reflection::server::v1::ServerReflectionServer<
            impl tonic_reflection::server::v1::ServerReflection,
        >,
        tonic_reflection::server::v1alpha::ServerReflectionServer<
            impl tonic_reflection::server::v1alpha::ServerReflection,
        >,
    ),
    Error,
> {
    let configure = || {
        let mut builder = tonic_reflection::server::Builder::configure()
            // Both reflection descriptors are registered below, so each version can
            // describe the other as well as itself.
            .include_reflection_service(false)
            .register_encoded_file_descriptor_set(convene_proto::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_reflection::pb::v1::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(
                tonic_reflection::pb::v1alpha::FILE_DESCRIPTOR_SET,
            );
        for name in names
            .iter()
            .copied()
            .chain([HEALTH_SERVICE])
            .chain(REFLECTION_SERVICES)
        {
            builder = builder.with_service_name(name);
        }
        builder
    };
    Ok((configure().build_v1()?, configure().build_v1alpha()?))
}

/// A boxed HTTP service as every route holds it.
type BoxedService = BoxCloneSyncService<http::Request<Body>, http::Response<Body>, Infallible>;

/// What guards the calls of added services.
#[derive(Clone, Debug)]
struct CallGuards {
    timeout: Option<Duration>,
    /// Shared by every added service: the limit is per server, not per service.
    semaphore: Arc<Semaphore>,
    limit: usize,
    /// Fires when the grace period is over.
    cut_off: CancellationToken,
    cut_off_message: Arc<str>,
}

/// The layers around each added service, outermost first: the call's server span (with
/// the caller's trace context as its parent), cut-off at the end of the grace period,
/// mapping of layer errors to gRPC statuses, load shedding over the concurrency limit,
/// the request timeout, the service.
///
/// Cross-cutting layers go here.
fn app_stack<S>(service: S, guards: &CallGuards) -> Named<S>
where
    S: Service<http::Request<Body>, Response = http::Response<Body>, Error = Infallible>
        + Clone
        + Send
        + Sync
        + 'static,
    S::Future: Send + 'static,
{
    let service = service.map_err(|never: Infallible| -> BoxError { match never {} });
    let timed: BoxCloneSyncService<_, _, BoxError> = match guards.timeout {
        Some(timeout) => BoxCloneSyncService::new(Timeout::new(service, timeout)),
        None => BoxCloneSyncService::new(service),
    };
    // `LoadShed` answers at once when `ConcurrencyLimit` has no permit left, instead of
    // letting the call wait for one.
    let limited = LoadShed::new(ConcurrencyLimit::with_semaphore(
        timed,
        guards.semaphore.clone(),
    ));
    let limits = LayerLimits {
        timeout: guards.timeout,
        concurrency: guards.limit,
    };
    let answered = StatusOnError {
        inner: limited,
        limits,
        ready_error: None,
    };
    // Outermost, so the call's span covers shedding, the timeout and the cut-off, and
    // records the statuses they answer with.
    Named::new(BoxCloneSyncService::new(TraceCalls::new(CutOff {
        inner: answered,
        token: guards.cut_off.clone(),
        message: guards.cut_off_message.clone(),
        answer_pending_calls: true,
    })))
}

/// The layers around health and reflection: only their response streams end when
/// draining begins. No timeout (health watches are long streams) and no concurrency
/// limit (health must answer while the server sheds load).
fn builtin_stack<S>(service: S, drain: &CancellationToken) -> Named<S>
where
    S: Service<http::Request<Body>, Response = http::Response<Body>, Error = Infallible>
        + Clone
        + Send
        + Sync
        + 'static,
    S::Future: Send + 'static,
{
    Named::new(BoxCloneSyncService::new(CutOff {
        inner: service,
        token: drain.clone(),
        message: Arc::from("server is shutting down; reconnect to another instance"),
        answer_pending_calls: false,
    }))
}

/// The retry hint of a call shed because the server is full: calls in flight are short,
/// so room comes back soon.
const SHED_RETRY_AFTER: Duration = Duration::from_millis(250);

/// The limits quoted in the statuses the layers produce.
#[derive(Clone, Copy, Debug)]
struct LayerLimits {
    timeout: Option<Duration>,
    concurrency: usize,
}

impl LayerLimits {
    /// Turns an error from the timeout or load-shed layer into a gRPC response, so the
    /// client sees a status with a reason instead of a reset stream.
    fn error_response(self, error: BoxError) -> http::Response<Body> {
        let status = if error.is::<Elapsed>() {
            let timeout = self
                .timeout
                .map(|t| humantime::format_duration(t).to_string())
                .unwrap_or_default();
            Status::deadline_exceeded(format!(
                "the server did not answer within its request timeout of {timeout} \
                 (server.request_timeout)"
            ))
        } else if error.is::<Overloaded>() {
            crate::error::resource_exhausted(
                format!(
                    "server busy: {} requests in flight (server.concurrency_limit); retry with backoff",
                    self.concurrency
                ),
                SHED_RETRY_AFTER,
            )
        } else {
            Status::from_error(error)
        };
        status.into_http()
    }
}

/// Answers errors of the timeout and load-shed layers with gRPC statuses.
struct StatusOnError<S> {
    inner: S,
    limits: LayerLimits,
    /// An error from `poll_ready`, answered by the next `call` (tower services must be
    /// called after a successful `poll_ready`, and this one never fails).
    ready_error: Option<BoxError>,
}

impl<S: Clone> Clone for StatusOnError<S> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            limits: self.limits,
            ready_error: None,
        }
    }
}

impl<S> Service<http::Request<Body>> for StatusOnError<S>
where
    S: Service<http::Request<Body>, Response = http::Response<Body>, Error = BoxError>,
    S::Future: Send + 'static,
{
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<http::Response<Body>, Infallible>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        match self.inner.poll_ready(cx) {
            Poll::Ready(Err(error)) => {
                self.ready_error = Some(error);
                Poll::Ready(Ok(()))
            }
            Poll::Ready(Ok(())) => Poll::Ready(Ok(())),
            Poll::Pending => Poll::Pending,
        }
    }

    fn call(&mut self, request: http::Request<Body>) -> Self::Future {
        let limits = self.limits;
        if let Some(error) = self.ready_error.take() {
            return Box::pin(std::future::ready(Ok(limits.error_response(error))));
        }
        let call = self.inner.call(request);
        Box::pin(async move {
            Ok(call
                .await
                .unwrap_or_else(|error| limits.error_response(error)))
        })
    }
}

/// Gives a boxed service the gRPC name of `S`, which routing and health need.
struct Named<S> {
    inner: BoxedService,
    _service: PhantomData<fn() -> S>,
}

impl<S> Named<S> {
    fn new(inner: BoxedService) -> Self {
        Self {
            inner,
            _service: PhantomData,
        }
    }
}

impl<S> Clone for Named<S> {
    fn clone(&self) -> Self {
        Self::new(self.inner.clone())
    }
}

impl<S: NamedService> NamedService for Named<S> {
    const NAME: &'static str = S::NAME;
}

impl<S> Service<http::Request<Body>> for Named<S> {
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = <BoxedService as Service<http::Request<Body>>>::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<Body>) -> Self::Future {
        self.inner.call(request)
    }
}

/// Ends calls when `token` fires: response streams end with `UNAVAILABLE` trailers, and,
/// if `answer_pending_calls`, calls without a response yet are answered `UNAVAILABLE`
/// and their handler futures dropped.
#[derive(Clone)]
struct CutOff<S> {
    inner: S,
    token: CancellationToken,
    message: Arc<str>,
    answer_pending_calls: bool,
}

impl<S> Service<http::Request<Body>> for CutOff<S>
where
    S: Service<http::Request<Body>, Response = http::Response<Body>, Error = Infallible>,
    S::Future: Send + 'static,
{
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<http::Response<Body>, Infallible>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<Body>) -> Self::Future {
        let call = self.inner.call(request);
        let token = self.token.clone();
        let message = self.message.clone();
        let answer_pending_calls = self.answer_pending_calls;
        Box::pin(async move {
            let response = if answer_pending_calls {
                tokio::select! {
                    // A call that finished is answered normally even if the cut-off
                    // fired at the same moment.
                    biased;
                    response = call => response?,
                    () = token.cancelled() => {
                        return Ok(Status::unavailable(message.as_ref()).into_http());
                    }
                }
            } else {
                call.await?
            };
            Ok(response.map(|body| {
                if http_body::Body::is_end_stream(&body) {
                    body
                } else {
                    Body::new(CutOffBody {
                        inner: Some(body),
                        cancelled: Box::pin(token.cancelled_owned()),
                        message,
                    })
                }
            }))
        })
    }
}

/// A response body that ends with `UNAVAILABLE` trailers once its token fires.
struct CutOffBody {
    /// `None` once the body has ended, normally or by the cut-off.
    inner: Option<Body>,
    cancelled: Pin<Box<WaitForCancellationFutureOwned>>,
    message: Arc<str>,
}

impl http_body::Body for CutOffBody {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        let this = self.get_mut();
        let Some(inner) = this.inner.as_mut() else {
            return Poll::Ready(None);
        };
        // The stream's own frames first: anything it has ready is delivered before the
        // cut-off ends it.
        match Pin::new(inner).poll_frame(cx) {
            Poll::Ready(None) => {
                this.inner = None;
                Poll::Ready(None)
            }
            Poll::Ready(Some(frame)) => Poll::Ready(Some(frame)),
            Poll::Pending => match this.cancelled.as_mut().poll(cx) {
                Poll::Ready(()) => {
                    this.inner = None;
                    let mut trailers = HeaderMap::new();
                    let status = Status::unavailable(this.message.as_ref());
                    // Only fails for a message that cannot be a header value, and ours
                    // are fixed ASCII text; an empty trailer map still ends the stream.
                    let _ = status.add_header(&mut trailers);
                    Poll::Ready(Some(Ok(Frame::trailers(trailers))))
                }
                Poll::Pending => Poll::Pending,
            },
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner
            .as_ref()
            .is_none_or(http_body::Body::is_end_stream)
    }

    fn size_hint(&self) -> SizeHint {
        self.inner
            .as_ref()
            .map_or_else(|| SizeHint::with_exact(0), http_body::Body::size_hint)
    }
}
