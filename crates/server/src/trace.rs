//! The server side of trace-context propagation: one span per gRPC call.
//!
//! [`TraceCalls`] wraps every added service (see `app_stack` in `builder`).
//! For each call it opens a server span named `<service>/<method>` with the
//! OpenTelemetry RPC attributes (`rpc.system = grpc`, `rpc.service`, `rpc.method`),
//! whose parent is the caller's W3C trace context from the `traceparent` header, and
//! runs the handler inside it, so the handler's own spans join the caller's trace. The
//! call's gRPC status is recorded as `rpc.grpc.status_code` when it is known: at once
//! for a trailers-only answer (every error), or from the trailers at the end of the
//! response body. The span lasts until the body has been sent.
//!
//! When export is off the span is disabled and the call passes straight through.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Frame, SizeHint};
use tonic::body::Body;
use tower::Service;
use tracing::{Instrument as _, Span};

/// Wraps a service's calls in server spans.
#[derive(Clone, Debug)]
pub(crate) struct TraceCalls<S> {
    inner: S,
}

impl<S> TraceCalls<S> {
    pub(crate) fn new(inner: S) -> Self {
        Self { inner }
    }
}

impl<S> Service<http::Request<Body>> for TraceCalls<S>
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
        let path = request.uri().path();
        let (service, method) = path
            .trim_start_matches('/')
            .split_once('/')
            .unwrap_or((path, ""));
        let span = tracing::info_span!(
            "grpc.server",
            otel.name = %path.trim_start_matches('/'),
            otel.kind = "server",
            rpc.system = "grpc",
            rpc.service = %service,
            rpc.method = %method,
            rpc.grpc.status_code = tracing::field::Empty,
        );
        if span.is_disabled() {
            return Box::pin(self.inner.call(request));
        }
        convene_telemetry::set_remote_parent(&span, request.headers());
        let call = self.inner.call(request).instrument(span.clone());
        Box::pin(async move {
            let response = call.await?;
            // A trailers-only answer (every error) carries its status in the headers.
            if let Some(code) = grpc_status(response.headers()) {
                record_status(&span, code, response.headers());
                return Ok(response);
            }
            Ok(response.map(|body| Body::new(TracedBody { inner: body, span })))
        })
    }
}

fn grpc_status(headers: &http::HeaderMap) -> Option<tonic::Code> {
    headers
        .get("grpc-status")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<i32>().ok())
        .map(tonic::Code::from_i32)
}

/// Records the call's status; codes that mean the server failed (rather than the
/// caller asked for something it may not have) mark the span as an error, as the
/// OpenTelemetry RPC conventions say for servers.
fn record_status(span: &Span, code: tonic::Code, headers: &http::HeaderMap) {
    span.record("rpc.grpc.status_code", code as i32);
    if matches!(
        code,
        tonic::Code::Unknown
            | tonic::Code::DeadlineExceeded
            | tonic::Code::Unimplemented
            | tonic::Code::Internal
            | tonic::Code::Unavailable
            | tonic::Code::DataLoss
    ) {
        let message = headers
            .get("grpc-message")
            .map(|v| percent_decode(v.as_bytes()))
            .unwrap_or_default();
        convene_telemetry::set_error(span, format!("{code:?}: {message}"));
    }
}

/// Decodes a `grpc-message` header, which gRPC percent-encodes.
fn percent_decode(value: &[u8]) -> String {
    let mut out = Vec::with_capacity(value.len());
    let mut i = 0;
    while i < value.len() {
        let hex = value
            .get(i + 1..i + 3)
            .and_then(|h| std::str::from_utf8(h).ok())
            .and_then(|h| u8::from_str_radix(h, 16).ok());
        match (value[i], hex) {
            (b'%', Some(byte)) => {
                out.push(byte);
                i += 3;
            }
            (byte, _) => {
                out.push(byte);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// A response body that records the status from its trailers and holds the call's span
/// open until the body is done.
struct TracedBody {
    inner: Body,
    span: Span,
}

impl http_body::Body for TracedBody {
    type Data = Bytes;
    type Error = tonic::Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, tonic::Status>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        if let Poll::Ready(Some(Ok(frame))) = &polled
            && let Some(trailers) = frame.trailers_ref()
            && let Some(code) = grpc_status(trailers)
        {
            record_status(&self.span, code, trailers);
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::percent_decode;

    #[test]
    fn grpc_messages_are_percent_decoded() {
        assert_eq!(
            percent_decode(b"the%20list%20is%20gone"),
            "the list is gone"
        );
        assert_eq!(percent_decode("caf%C3%A9".as_bytes()), "café");
        // A stray percent sign stays as it is.
        assert_eq!(percent_decode(b"100% %zz"), "100% %zz");
    }
}
