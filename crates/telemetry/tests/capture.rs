//! The in-memory capture sees the spans of its own thread even when another thread,
//! with no subscriber, reached the same span's callsite first (as a test running
//! beside it does). Its own binary: no other capture may be alive meanwhile.

use convene_telemetry::test_util::Capture;

fn the_span() -> tracing::Span {
    tracing::info_span!(target: "convene_capture_test", "capture.test.shared_callsite")
}

#[test]
fn a_span_first_created_on_a_thread_without_subscriber_is_still_captured_here() {
    let capture = Capture::new();
    let _guard = capture.set_default();
    // Another thread, whose default is no subscriber, registers the callsite.
    std::thread::spawn(|| drop(the_span()))
        .join()
        .expect("other thread");
    drop(the_span());
    let names: Vec<String> = capture
        .spans()
        .into_iter()
        .map(|s| s.name.into_owned())
        .collect();
    assert_eq!(names, ["capture.test.shared_callsite"]);
}
