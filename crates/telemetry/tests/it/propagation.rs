//! W3C trace context: injected into outgoing metadata, extracted from incoming headers,
//! stored as a traceparent and continued later.

use convene_telemetry::test_util::Capture;
use convene_telemetry::{
    TRACEPARENT, continue_trace, inject_current, link, set_remote_parent, trace_id, traceparent,
};
use opentelemetry::trace::TraceContextExt as _;

#[test]
fn a_call_carries_the_callers_context_to_the_callee() {
    let capture = Capture::new();
    let _guard = capture.set_default();

    let caller = tracing::info_span!(target: "convene_test", "delegation");
    let mut metadata = tonic::metadata::MetadataMap::new();
    // A stale context from an earlier hop is replaced, not kept beside the new one.
    metadata.insert(
        TRACEPARENT,
        "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
            .parse()
            .unwrap(),
    );
    caller.in_scope(|| inject_current(&mut metadata));
    let sent = metadata
        .get(TRACEPARENT)
        .and_then(|v| v.to_str().ok())
        .expect("traceparent injected")
        .to_owned();
    assert_eq!(Some(sent.clone()), traceparent(&caller));

    // The callee's server span adopts it as its remote parent.
    let headers = metadata.into_headers();
    let server = tracing::info_span!(target: "convene_test", parent: None, "grpc.server");
    assert!(set_remote_parent(&server, &headers));
    assert_eq!(trace_id(&server), trace_id(&caller));
    drop(server);
    drop(caller);

    let spans = capture.spans();
    let server = spans.iter().find(|s| s.name == "grpc.server").unwrap();
    let caller = spans.iter().find(|s| s.name == "delegation").unwrap();
    assert_eq!(server.parent_span_id, caller.span_context.span_id());
    assert!(server.parent_span_is_remote);
}

#[test]
fn no_context_means_nothing_injected_and_no_parent() {
    let capture = Capture::new();
    let _guard = capture.set_default();
    // No current span.
    let mut metadata = tonic::metadata::MetadataMap::new();
    inject_current(&mut metadata);
    assert!(metadata.get(TRACEPARENT).is_none());

    let server = tracing::info_span!(target: "convene_test", parent: None, "grpc.server");
    assert!(!set_remote_parent(&server, &http::HeaderMap::new()));
    let mut bad = http::HeaderMap::new();
    bad.insert(TRACEPARENT, "not-a-traceparent".parse().unwrap());
    assert!(!set_remote_parent(&server, &bad));
    assert!(!continue_trace(&server, ""));
    // Still a root of its own.
    assert!(trace_id(&server).is_some());
}

#[test]
fn a_stored_traceparent_continues_the_same_trace() {
    let capture = Capture::new();
    let _guard = capture.set_default();
    let first = tracing::info_span!(target: "convene_test", parent: None, "run");
    let stored = traceparent(&first).expect("traced");
    let trace = trace_id(&first).unwrap();
    drop(first);

    // Later, elsewhere: a new span continues from the stored value alone.
    let resumed = tracing::info_span!(target: "convene_test", parent: None, "run");
    assert!(continue_trace(&resumed, &stored));
    assert_eq!(trace_id(&resumed).as_deref(), Some(trace.as_str()));
    // Once started, the parent cannot change any more.
    assert!(!continue_trace(&resumed, &stored));
    drop(resumed);

    let spans = capture.spans();
    assert_eq!(spans.len(), 2);
    assert_eq!(
        spans[1].parent_span_id,
        spans[0].span_context.span_id(),
        "the resumed span is a child of the stored one"
    );
}

#[test]
fn a_link_points_at_the_other_span() {
    let capture = Capture::new();
    let _guard = capture.set_default();
    let request = tracing::info_span!(target: "convene_test", "StartRun");
    let run = tracing::info_span!(target: "convene_test", parent: None, "run");
    link(&run, &request);
    assert_ne!(trace_id(&run), trace_id(&request), "a link is not a parent");
    let request_cx = {
        use tracing_opentelemetry::OpenTelemetrySpanExt as _;
        request.context().span().span_context().clone()
    };
    drop(run);
    let spans = capture.spans();
    let run = spans.iter().find(|s| s.name == "run").unwrap();
    assert_eq!(run.links.links.len(), 1);
    assert_eq!(run.links.links[0].span_context, request_cx);
}
