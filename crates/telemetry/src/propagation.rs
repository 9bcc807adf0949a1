//! W3C trace context across process boundaries, and the span facts other crates need.
//!
//! Everything here works on `tracing` spans, so the services never touch OpenTelemetry
//! types. Each function returns early, without looking anything up, when the span is
//! disabled — which every convene span is while export is off — so callers need no
//! "is tracing on" checks of their own.

use std::borrow::Cow;

use opentelemetry::propagation::{Extractor, Injector};
use opentelemetry::trace::{Status, TraceContextExt as _};
use opentelemetry::{Context, global};
use tonic::metadata::{MetadataKey, MetadataMap, MetadataValue};
use tracing::Span;
use tracing_opentelemetry::OpenTelemetrySpanExt as _;

/// The W3C header carrying trace id, parent span id and flags.
pub const TRACEPARENT: &str = "traceparent";
/// The W3C header carrying vendor-specific trace state.
pub const TRACESTATE: &str = "tracestate";

/// Writes the trace context of the current span into outgoing gRPC metadata
/// (`traceparent`, `tracestate`), replacing any the request already carried, so the
/// callee's spans join the caller's trace. Does nothing when the current span is not
/// traced.
pub fn inject_current(metadata: &mut MetadataMap) {
    let span = Span::current();
    if span.is_disabled() {
        return;
    }
    let cx = span.context();
    if !cx.span().span_context().is_valid() {
        return;
    }
    global::get_text_map_propagator(|p| p.inject_context(&cx, &mut MetadataCarrier(metadata)));
}

/// Makes the trace context in `headers` (an incoming request's) the parent of `span`.
/// Returns whether there was a valid one. Call it before the span is first entered.
pub fn set_remote_parent(span: &Span, headers: &http::HeaderMap) -> bool {
    if span.is_disabled() {
        return false;
    }
    let cx = global::get_text_map_propagator(|p| p.extract(&HeaderCarrier(headers)));
    adopt(span, cx)
}

/// The span's context as a W3C `traceparent` value
/// (`00-<trace id>-<span id>-<flags>`), to store and continue later with
/// [`continue_trace`]; `None` when the span is not traced.
pub fn traceparent(span: &Span) -> Option<String> {
    if span.is_disabled() {
        return None;
    }
    let cx = span.context();
    if !cx.span().span_context().is_valid() {
        return None;
    }
    let mut carrier = std::collections::HashMap::new();
    global::get_text_map_propagator(|p| p.inject_context(&cx, &mut carrier));
    carrier.remove(TRACEPARENT)
}

/// Makes the span stored as `traceparent` (see [`traceparent`]) the parent of `span`,
/// so work resumed in another process continues the same trace. Returns whether the
/// value was a valid trace context. Call it before the span is first entered.
pub fn continue_trace(span: &Span, traceparent: &str) -> bool {
    if span.is_disabled() || traceparent.is_empty() {
        return false;
    }
    let carrier =
        std::collections::HashMap::from([(TRACEPARENT.to_owned(), traceparent.to_owned())]);
    let cx = global::get_text_map_propagator(|p| p.extract(&carrier));
    adopt(span, cx)
}

fn adopt(span: &Span, cx: Context) -> bool {
    if !cx.span().span_context().is_valid() {
        return false;
    }
    span.set_parent(cx).is_ok()
}

/// Links `span` to `other` (e.g. a run's root span to the request that started it),
/// when both are traced.
pub fn link(span: &Span, other: &Span) {
    if span.is_disabled() || other.is_disabled() {
        return;
    }
    let cx = other.context().span().span_context().clone();
    span.add_link(cx);
}

/// The trace id of `span` as 32 lowercase hex digits; `None` when it is not traced.
pub fn trace_id(span: &Span) -> Option<String> {
    if span.is_disabled() {
        return None;
    }
    let cx = span.context();
    let sc = cx.span().span_context().clone();
    sc.is_valid().then(|| sc.trace_id().to_string())
}

/// The trace id of the current span (see [`trace_id`]).
pub fn current_trace_id() -> Option<String> {
    trace_id(&Span::current())
}

/// Marks `span` as failed, with `description` saying why (the span status that trace
/// viewers show in red).
pub fn set_error(span: &Span, description: impl Into<Cow<'static, str>>) {
    if !span.is_disabled() {
        span.set_status(Status::error(description));
    }
}

struct MetadataCarrier<'a>(&'a mut MetadataMap);

impl Injector for MetadataCarrier<'_> {
    fn set(&mut self, key: &str, value: String) {
        // The propagator only writes its own well-formed ASCII headers; a value that is
        // not one is skipped rather than sent corrupted.
        if let (Ok(key), Ok(value)) = (
            MetadataKey::from_bytes(key.as_bytes()),
            MetadataValue::try_from(value),
        ) {
            self.0.insert(key, value);
        }
    }
}

struct HeaderCarrier<'a>(&'a http::HeaderMap);

impl Extractor for HeaderCarrier<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(http::HeaderName::as_str).collect()
    }
}
