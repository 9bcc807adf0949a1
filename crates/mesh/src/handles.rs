//! One handle per service: the tonic-generated service trait behind an `Arc`.
//!
//! In one process (`convene up`, tests) a handle is the service value itself, so a call
//! is a direct async call: no socket, no protobuf encoding. Across processes it is a
//! `Grpc*` adapter that forwards each request — metadata included — over a shared,
//! multiplexed HTTP/2 channel. Both paths run the same service code behind the trait.
//!
//! Trace context: a `Grpc*` adapter writes the current span's W3C context
//! (`traceparent`) into the request's metadata, so the callee's server span continues
//! the caller's trace. An in-process call needs nothing: the callee runs inside the
//! caller's span.
//!
//! Overload: a unary call a server refused because it was full (`RESOURCE_EXHAUSTED`
//! with a retry hint, before doing any of its work) is sent again after the hint,
//! within the adapter's [`RetryBudget`] ([`crate::retry`]).

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use convene_proto::v1::{
    self, approval_client::ApprovalClient, approval_server::Approval,
    evidence_store_client::EvidenceStoreClient, evidence_store_server::EvidenceStore,
    policy_client::PolicyClient, policy_server::Policy, supervisor_client::SupervisorClient,
    supervisor_server::Supervisor, worker_client::WorkerClient,
    worker_registry_client::WorkerRegistryClient, worker_registry_server::WorkerRegistry,
    worker_server::Worker,
};
use futures::Stream;
use tokio::sync::mpsc::Sender;
use tonic::transport::channel::Change;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};

use crate::resolve::{self, Followed, Named, Resolver};
use crate::retry::RetryBudget;
use tonic::metadata::MetadataMap;
use tonic::{Extensions, Request, Response, Status};
use tower::ServiceExt as _;
use tower::retry::Retry;

/// A boxed stream of messages, the stream type of every streaming RPC in the mesh.
pub type BoxStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send + 'static>>;

/// The policy service.
pub type PolicyHandle = Arc<dyn Policy>;
/// The evidence store.
pub type EvidenceHandle = Arc<dyn EvidenceStore>;
/// The approval service.
pub type ApprovalHandle =
    Arc<dyn Approval<WatchEventsStream = BoxStream<v1::ApprovalWatchEventsResponse>>>;
/// A worker.
pub type WorkerHandle = Arc<dyn Worker>;
/// The supervisor's worker registry.
pub type RegistryHandle = Arc<dyn WorkerRegistry>;
/// The supervisor.
pub type SupervisorHandle = Arc<
    dyn Supervisor<
            WatchRunStream = BoxStream<v1::WatchRunResponse>,
            WatchEventsStream = BoxStream<v1::WatchEventsResponse>,
        >,
>;

/// Largest message a mesh client accepts or sends (servers enforce their own limit).
pub const MAX_CLIENT_MESSAGE_BYTES: usize = 16 * 1024 * 1024;

/// Errors opening a channel.
#[derive(Debug, thiserror::Error)]
#[error("invalid endpoint {endpoint:?}: {detail}; use a URL such as http://127.0.0.1:7400")]
pub struct EndpointError {
    /// The endpoint as given.
    pub endpoint: String,
    /// What is wrong with it.
    pub detail: String,
}

/// A lazily connecting channel to `endpoint` (`http://host:port`). It connects on the
/// first call and reconnects after failures, so services may start in any order. A host
/// name (not an IP literal or `localhost`) is resolved to every address and calls are
/// balanced over them ([`crate::resolve`]).
pub fn channel(endpoint: &str) -> Result<Channel, EndpointError> {
    channel_with(endpoint, &resolve::dns(), resolve::RESOLVE_INTERVAL)
}

/// [`channel`] with `resolver` resolving host names, again every `every`.
pub fn channel_with(
    endpoint: &str,
    resolver: &Resolver,
    every: Duration,
) -> Result<Channel, EndpointError> {
    let endpoint = if endpoint.contains("://") {
        endpoint.to_owned()
    } else {
        format!("http://{endpoint}")
    };
    let ep = configured(&endpoint)?;
    let Some(name) = resolve::named(&endpoint) else {
        return Ok(ep.connect_lazy());
    };
    let (channel, changes) = Channel::balance_channel::<SocketAddr>(16);
    tokio::spawn(follow(name, resolver.clone(), every, changes));
    Ok(channel)
}

/// The TLS settings of an `https://` endpoint: the process's CA and client identity
/// ([`convene_server::tls::installed`]), the server checked under `host`.
fn client_tls(url: &str, host: &str) -> Result<ClientTlsConfig, EndpointError> {
    let client = convene_server::tls::installed().and_then(|t| t.client.as_ref());
    let Some(ca) = client.and_then(|c| c.ca_pem.as_ref()) else {
        return Err(EndpointError {
            endpoint: url.to_owned(),
            detail: "an https:// endpoint needs the CA to verify it with: pass --tls-ca FILE \
                     (CONVENE_TLS_CA)"
                .to_owned(),
        });
    };
    let mut config = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(ca))
        .domain_name(host);
    if let Some((cert, key)) = client.and_then(|c| c.identity.as_ref()) {
        config = config.identity(Identity::from_pem(cert, key));
    }
    Ok(config)
}

/// An endpoint with the mesh's connection settings; TLS for `https://`.
fn configured(url: &str) -> Result<Endpoint, EndpointError> {
    let ep = Endpoint::from_shared(url.to_owned()).map_err(|e| EndpointError {
        endpoint: url.to_owned(),
        detail: e.to_string(),
    })?;
    let ep = if ep.uri().scheme_str() == Some("https") {
        let host = ep
            .uri()
            .host()
            .unwrap_or_default()
            .trim_matches(['[', ']'])
            .to_owned();
        ep.tls_config(client_tls(url, &host)?)
            .map_err(|e| EndpointError {
                endpoint: url.to_owned(),
                detail: format!("TLS settings: {e}"),
            })?
    } else {
        ep
    };
    Ok(ep
        .connect_timeout(Duration::from_secs(5))
        .tcp_nodelay(true)
        .http2_keep_alive_interval(Duration::from_secs(30))
        .keep_alive_while_idle(true))
}

/// Keeps a balanced channel's endpoints equal to what `name` resolves to, until the
/// channel is dropped.
async fn follow(
    name: Named,
    resolver: Resolver,
    every: Duration,
    changes: Sender<Change<SocketAddr, Endpoint>>,
) {
    let mut followed = Followed::new(name);
    loop {
        if let Some(diff) = followed.refresh(&resolver, "a service's addresses").await {
            for addr in diff.removed {
                if changes.send(Change::Remove(addr)).await.is_err() {
                    return;
                }
            }
            for addr in diff.added {
                let Ok(ep) = configured(&followed.name.url_of(addr)) else {
                    continue;
                };
                if changes.send(Change::Insert(addr, ep)).await.is_err() {
                    return;
                }
            }
        }
        tokio::select! {
            () = tokio::time::sleep(followed.next_in(every)) => {}
            () = changes.closed() => return,
        }
    }
}

macro_rules! grpc_adapter {
    (
        $(#[$doc:meta])*
        $adapter:ident, $client:ident, $service:ident {
            $($method:ident: $req:ident => $resp:ident),* $(,)?
        }
        $(streaming { $($smethod:ident: $sreq:ident => $sresp:ident as $stype:ident),* $(,)? })?
    ) => {
        $(#[$doc])*
        #[derive(Debug, Clone)]
        pub struct $adapter {
            client: $client<Channel>,
            budget: RetryBudget,
        }

        impl $adapter {
            /// An adapter over `channel`, retrying calls the server refused as full
            /// within the default [`RetryBudget`].
            pub fn new(channel: Channel) -> Self {
                Self::with_budget(channel, RetryBudget::default())
            }

            /// An adapter over `channel` whose retries of refused calls spend `budget`
            /// (shared by every clone of the adapter).
            pub fn with_budget(channel: Channel, budget: RetryBudget) -> Self {
                Self {
                    client: $client::new(channel)
                        .max_decoding_message_size(MAX_CLIENT_MESSAGE_BYTES)
                        .max_encoding_message_size(MAX_CLIENT_MESSAGE_BYTES),
                    budget,
                }
            }

            /// An adapter connecting lazily to `endpoint`.
            pub fn connect(endpoint: &str) -> Result<Self, EndpointError> {
                Ok(Self::new(channel(endpoint)?))
            }
        }

        #[tonic::async_trait]
        impl $service for $adapter {
            $(
                async fn $method(
                    &self,
                    mut request: Request<v1::$req>,
                ) -> Result<Response<v1::$resp>, Status> {
                    convene_telemetry::inject_current(request.metadata_mut());
                    let (metadata, _, message) = request.into_parts();
                    let client = self.client.clone();
                    let call = tower::service_fn(move |(metadata, message): (MetadataMap, v1::$req)| {
                        let mut client = client.clone();
                        async move {
                            client
                                .$method(Request::from_parts(metadata, Extensions::default(), message))
                                .await
                        }
                    });
                    Retry::new(self.budget.policy(), call)
                        .oneshot((metadata, message))
                        .await
                }
            )*
            $($(
                type $stype = BoxStream<v1::$sresp>;

                async fn $smethod(
                    &self,
                    mut request: Request<v1::$sreq>,
                ) -> Result<Response<Self::$stype>, Status> {
                    convene_telemetry::inject_current(request.metadata_mut());
                    let response = self.client.clone().$smethod(request).await?;
                    Ok(response.map(|s| Box::pin(s) as BoxStream<v1::$sresp>))
                }
            )*)?
        }
    };
}

grpc_adapter!(
    /// The policy service over gRPC.
    GrpcPolicy, PolicyClient, Policy {
        issue_task_token: IssueTaskTokenRequest => IssueTaskTokenResponse,
        authorize: AuthorizeRequest => AuthorizeResponse,
        authorize_batch: AuthorizeBatchRequest => AuthorizeBatchResponse,
        revoke: RevokeRequest => RevokeResponse,
        get_signing_keys: GetSigningKeysRequest => GetSigningKeysResponse,
        list_tools: ListToolsRequest => ListToolsResponse,
        who_am_i: WhoAmIRequest => WhoAmIResponse,
    }
);

grpc_adapter!(
    /// The evidence store over gRPC.
    GrpcEvidenceStore, EvidenceStoreClient, EvidenceStore {
        put_artifact: PutArtifactRequest => PutArtifactResponse,
        put_artifact_batch: PutArtifactBatchRequest => PutArtifactBatchResponse,
        get_artifact: GetArtifactRequest => GetArtifactResponse,
        record_evidence: RecordEvidenceRequest => RecordEvidenceResponse,
        get_evidence: GetEvidenceRequest => GetEvidenceResponse,
        verify_chain: VerifyChainRequest => VerifyChainResponse,
    }
);

grpc_adapter!(
    /// The approval service over gRPC.
    GrpcApproval, ApprovalClient, Approval {
        request_approval: RequestApprovalRequest => RequestApprovalResponse,
        decide: DecideRequest => DecideResponse,
        get_approval: GetApprovalRequest => GetApprovalResponse,
        list_approvals: ListApprovalsRequest => ListApprovalsResponse,
        execute: ApprovalExecuteRequest => ApprovalExecuteResponse,
        cancel_approval: CancelApprovalRequest => CancelApprovalResponse,
    }
    streaming {
        watch_events: ApprovalWatchEventsRequest => ApprovalWatchEventsResponse as WatchEventsStream,
    }
);

grpc_adapter!(
    /// A worker over gRPC.
    GrpcWorker, WorkerClient, Worker {
        execute: WorkerExecuteRequest => WorkerExecuteResponse,
        cancel: WorkerCancelRequest => WorkerCancelResponse,
        plan_turn: PlanTurnRequest => PlanTurnResponse,
    }
);

grpc_adapter!(
    /// The worker registry over gRPC.
    GrpcWorkerRegistry, WorkerRegistryClient, WorkerRegistry {
        register: RegisterRequest => RegisterResponse,
        heartbeat: HeartbeatRequest => HeartbeatResponse,
        deregister: DeregisterRequest => DeregisterResponse,
    }
);

grpc_adapter!(
    /// The supervisor over gRPC.
    GrpcSupervisor, SupervisorClient, Supervisor {
        start_run: StartRunRequest => StartRunResponse,
        get_run: GetRunRequest => GetRunResponse,
        cancel_run: CancelRunRequest => CancelRunResponse,
        resume_run: ResumeRunRequest => ResumeRunResponse,
        list_runs: ListRunsRequest => ListRunsResponse,
        delegate: DelegateRequest => DelegateResponse,
    }
    streaming {
        watch_run: WatchRunRequest => WatchRunResponse as WatchRunStream,
        watch_events: WatchEventsRequest => WatchEventsResponse as WatchEventsStream,
    }
);

/// A worker handle whose every call carries the caller's service credential (the
/// supervisor's): workers take `Execute`, `PlanTurn` and `Cancel` only from the
/// supervisor, in one process as across processes.
pub struct AsService {
    inner: WorkerHandle,
    credential: Arc<str>,
}

impl AsService {
    /// `inner`, called with `credential` as the bearer of every request.
    pub fn wrap(inner: WorkerHandle, credential: Arc<str>) -> WorkerHandle {
        Arc::new(Self { inner, credential })
    }
}

#[tonic::async_trait]
impl Worker for AsService {
    async fn execute(
        &self,
        request: Request<v1::WorkerExecuteRequest>,
    ) -> Result<Response<v1::WorkerExecuteResponse>, Status> {
        self.inner
            .execute(crate::auth::with_bearer(request, &self.credential))
            .await
    }

    async fn cancel(
        &self,
        request: Request<v1::WorkerCancelRequest>,
    ) -> Result<Response<v1::WorkerCancelResponse>, Status> {
        self.inner
            .cancel(crate::auth::with_bearer(request, &self.credential))
            .await
    }

    async fn plan_turn(
        &self,
        request: Request<v1::PlanTurnRequest>,
    ) -> Result<Response<v1::PlanTurnResponse>, Status> {
        self.inner
            .plan_turn(crate::auth::with_bearer(request, &self.credential))
            .await
    }
}
