//! With no OTLP endpoint configured, `init` installs logging only: convene's trace spans
//! are disabled at their call sites and carry no trace context.
//!
//! Its own binary: it asserts that its `init` is the process's first, installing the
//! global subscriber without an OpenTelemetry layer, which no other test may have done.

use convene_telemetry::{LogFormat, Settings, current_trace_id, trace_id, traceparent};

#[tokio::test]
async fn telemetry_off_installs_no_trace_layer() {
    // The environment of the test process is not read: the settings are explicit.
    let settings = Settings::from_env(LogFormat::Text, None, [("OTEL_SDK_DISABLED", "true")]);
    assert_eq!(settings.otlp_endpoint, None);
    let telemetry = convene_telemetry::init("convene-test", &settings);
    assert!(
        telemetry.installed(),
        "the first init installs the subscriber"
    );
    assert_eq!(telemetry.exporting_to(), None);

    // A convene span is disabled: no layer is interested, so it costs a cached interest
    // check and records nothing.
    let span = tracing::info_span!(target: "convene_test::run", "run", run_id = "r-1");
    assert!(
        span.is_disabled(),
        "no layer may take convene spans when off"
    );
    let _entered = span.enter();
    assert_eq!(trace_id(&span), None);
    assert_eq!(traceparent(&span), None);
    assert_eq!(current_trace_id(), None);

    // Log events still go through.
    assert!(tracing::event_enabled!(target: "convene_test::run", tracing::Level::INFO));
    assert!(!tracing::event_enabled!(target: "convene_test::run", tracing::Level::DEBUG));

    // A second init changes nothing and says so.
    let again = convene_telemetry::init(
        "convene-test",
        &Settings::default().with_otlp_endpoint("http://127.0.0.1:9"),
    );
    assert!(!again.installed());
    assert_eq!(again.exporting_to(), None);
    again.shutdown().await;
    telemetry.shutdown().await;
}
