//! With an OTLP endpoint, spans reach a real OTLP/gRPC receiver with the process's
//! resource, their tree, attributes and status, and `shutdown` flushes them.
//!
//! Its own binary: `init` installs the process's global subscriber, with the exporter
//! this test asserts on; it can happen once per process, and it would send the spans of
//! any test beside it to this receiver.

use std::time::Duration;

use convene_telemetry::test_util::OtlpReceiver;
use convene_telemetry::{Settings, set_error, trace_id, traceparent};
use tracing::Instrument as _;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spans_are_exported_with_resource_tree_and_status() {
    let receiver = OtlpReceiver::start().await;
    let telemetry = convene_telemetry::init(
        "convene-test",
        &Settings::default().with_otlp_endpoint(receiver.endpoint()),
    );
    assert!(telemetry.installed());
    assert_eq!(telemetry.exporting_to(), Some(receiver.endpoint().as_str()));

    let root = tracing::info_span!(target: "convene_test::run", parent: None, "run", convene.run.id = "r-1");
    assert!(!root.is_disabled());
    let trace = trace_id(&root).expect("a traced span has a trace id");
    assert_eq!(trace.len(), 32);
    let stored = traceparent(&root).expect("and a traceparent");
    assert!(stored.starts_with(&format!("00-{trace}-")), "{stored}");

    async {
        let child = tracing::info_span!(target: "convene_test::tool", "tool.call", convene.tool.name = "search_logs");
        set_error(&child, "denied by policy");
        // Library spans are not exported.
        let _library = tracing::info_span!(target: "h2::proto", "poll").entered();
        drop(child);
        tracing::info!(target: "convene_test::run", step = 1, "work done");
    }
    .instrument(root.clone())
    .await;
    drop(root);

    // Nothing is exported yet (the batch waits); shutdown flushes.
    telemetry.shutdown().await;
    let spans = receiver
        .wait_for(Duration::from_secs(5), |s| s.len() >= 2)
        .await;
    assert_eq!(spans.len(), 2, "{spans:#?}");
    let run = spans
        .iter()
        .find(|s| s.name == "run")
        .expect("the run span");
    let tool = spans
        .iter()
        .find(|s| s.name == "tool.call")
        .expect("the tool span");
    assert_eq!(run.service, "convene-test");
    assert_eq!(
        run.resource.get("service.version").map(String::as_str),
        Some(env!("CARGO_PKG_VERSION"))
    );
    assert_eq!(
        run.resource.get("service.instance.id").map(String::len),
        Some(36),
        "a UUID: {:?}",
        run.resource
    );
    assert_eq!(run.trace_id, trace);
    assert_eq!(run.parent_span_id, "", "explicit root");
    assert_eq!(run.attr("convene.run.id"), Some("r-1"));
    assert_eq!(
        run.events,
        ["work done"],
        "convene INFO events become span events"
    );
    assert_eq!(tool.trace_id, trace);
    assert_eq!(tool.parent_span_id, run.span_id);
    assert_eq!(tool.attr("convene.tool.name"), Some("search_logs"));
    assert!(tool.is_error());
    assert_eq!(tool.status_message, "denied by policy");
    assert!(!run.is_error());
}
