//! Every call to an added service runs in a server span that continues the caller's
//! W3C trace context and records the gRPC status.

use convene_proto::v1::{
    AuthorizeBatchRequest, AuthorizeBatchResponse, AuthorizeRequest, AuthorizeResponse,
    GetSigningKeysRequest, GetSigningKeysResponse, IssueTaskTokenRequest, IssueTaskTokenResponse,
    RevokeRequest, RevokeResponse,
    policy_client::PolicyClient,
    policy_server::{Policy, PolicyServer},
};
use convene_server::{GrpcServer, ServerSettings, test_util::TestServer};
use convene_telemetry::test_util::Capture;
use opentelemetry::trace::{SpanKind, Status as SpanStatus};
use tonic::{Request, Response, Status};

/// Answers Authorize, fails Revoke with INTERNAL and IssueTaskToken with
/// PERMISSION_DENIED; records the trace id it runs under in the answer.
#[derive(Clone, Debug, Default)]
struct EchoPolicy;

#[tonic::async_trait]
impl Policy for EchoPolicy {
    async fn issue_task_token(
        &self,
        _: Request<IssueTaskTokenRequest>,
    ) -> Result<Response<IssueTaskTokenResponse>, Status> {
        Err(Status::permission_denied("not you"))
    }

    async fn authorize(
        &self,
        _: Request<AuthorizeRequest>,
    ) -> Result<Response<AuthorizeResponse>, Status> {
        Ok(Response::new(AuthorizeResponse {
            detail: convene_telemetry::current_trace_id().unwrap_or_default(),
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
        Err(Status::internal("the revocation list is gone"))
    }

    async fn get_signing_keys(
        &self,
        _: Request<GetSigningKeysRequest>,
    ) -> Result<Response<GetSigningKeysResponse>, Status> {
        Ok(Response::new(GetSigningKeysResponse::default()))
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

const CALLER_TRACE: &str = "0af7651916cd43dd8448eb211c80319c";
const CALLER_SPAN: &str = "b7ad6b7169203331";

fn with_caller_context<T>(message: T) -> Request<T> {
    let mut request = Request::new(message);
    request.metadata_mut().insert(
        "traceparent",
        format!("00-{CALLER_TRACE}-{CALLER_SPAN}-01")
            .parse()
            .expect("ASCII"),
    );
    request
}

fn attr(span: &opentelemetry_sdk::trace::SpanData, key: &str) -> Option<String> {
    span.attributes
        .iter()
        .find(|kv| kv.key.as_str() == key)
        .map(|kv| kv.value.to_string())
}

// A current-thread runtime: the server's tasks run on this thread, where the capture is
// the default subscriber.
#[tokio::test]
async fn calls_continue_the_callers_trace_and_record_their_status() {
    let capture = Capture::new();
    let _guard = capture.set_default();
    let server = TestServer::start(
        GrpcServer::new(ServerSettings::default()).add_service(PolicyServer::new(EchoPolicy)),
    )
    .await;
    let mut client = PolicyClient::new(server.channel().await);

    let answer = client
        .authorize(with_caller_context(AuthorizeRequest::default()))
        .await
        .expect("Authorize answers")
        .into_inner();
    assert_eq!(
        answer.detail, CALLER_TRACE,
        "the handler runs inside the caller's trace"
    );
    let denied = client
        .issue_task_token(with_caller_context(IssueTaskTokenRequest::default()))
        .await
        .unwrap_err();
    assert_eq!(denied.code(), tonic::Code::PermissionDenied);
    let failed = client
        .revoke(Request::new(RevokeRequest::default()))
        .await
        .unwrap_err();
    assert_eq!(failed.code(), tonic::Code::Internal);
    server.stop().await.expect("clean stop");

    let spans = capture.spans();
    let find = |name: &str| {
        spans
            .iter()
            .find(|s| s.name == name)
            .unwrap_or_else(|| panic!("no span {name}: {spans:#?}"))
    };
    let authorize = find("convene.v1.Policy/Authorize");
    assert_eq!(authorize.span_kind, SpanKind::Server);
    assert_eq!(authorize.span_context.trace_id().to_string(), CALLER_TRACE);
    assert_eq!(authorize.parent_span_id.to_string(), CALLER_SPAN);
    assert!(authorize.parent_span_is_remote);
    assert_eq!(attr(authorize, "rpc.system").as_deref(), Some("grpc"));
    assert_eq!(
        attr(authorize, "rpc.service").as_deref(),
        Some("convene.v1.Policy")
    );
    assert_eq!(attr(authorize, "rpc.method").as_deref(), Some("Authorize"));
    assert_eq!(
        attr(authorize, "rpc.grpc.status_code").as_deref(),
        Some("0")
    );
    assert_eq!(authorize.status, SpanStatus::Unset);

    // A refusal is the caller's problem, not a server failure.
    let issue = find("convene.v1.Policy/IssueTaskToken");
    assert_eq!(attr(issue, "rpc.grpc.status_code").as_deref(), Some("7"));
    assert_eq!(issue.status, SpanStatus::Unset);

    // A server failure marks the span; without a caller context it is a root.
    let revoke = find("convene.v1.Policy/Revoke");
    assert_eq!(attr(revoke, "rpc.grpc.status_code").as_deref(), Some("13"));
    assert!(
        matches!(&revoke.status, SpanStatus::Error { description } if description.contains("the revocation list is gone")),
        "{:?}",
        revoke.status
    );
    assert_ne!(revoke.span_context.trace_id().to_string(), CALLER_TRACE);
    assert_eq!(revoke.parent_span_id, opentelemetry::trace::SpanId::INVALID);

    // Health checks are not traced.
    assert!(
        spans.iter().all(|s| !s.name.starts_with("grpc.health")),
        "{spans:#?}"
    );
}
