//! Helpers for tests and benchmarks of crates that create spans (feature `test-util`).
//!
//! - [`Capture`]: the same trace layer [`init`](crate::init) installs, exporting to
//!   memory, as a thread-local default subscriber: for unit tests of span trees and
//!   attributes without a collector.
//! - [`OtlpReceiver`]: a real OTLP/gRPC trace receiver on a loopback port, collecting
//!   what processes export to it: for end-to-end tests and benchmarks.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::{AnyValue, any_value};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider, SpanData};
use tracing_subscriber::layer::SubscriberExt as _;

/// Spans exported to memory by a thread-local subscriber with convene's trace layer.
#[derive(Debug)]
pub struct Capture {
    exporter: InMemorySpanExporter,
    provider: SdkTracerProvider,
}

impl Default for Capture {
    fn default() -> Self {
        Self::new()
    }
}

impl Capture {
    /// A capture exporting each span as it ends. Also installs the W3C propagator
    /// globally, as [`init`](crate::init) does.
    pub fn new() -> Self {
        opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new());
        let exporter = InMemorySpanExporter::default();
        let provider = SdkTracerProvider::builder()
            .with_simple_exporter(exporter.clone())
            .build();
        Self { exporter, provider }
    }

    /// Makes the capture this thread's default subscriber until the guard drops.
    pub fn set_default(&self) -> tracing::subscriber::DefaultGuard {
        keep_interest_shared();
        let tracer = self.provider.tracer(crate::ONE_PROCESS_SERVICE_NAME);
        let subscriber = tracing_subscriber::registry().with(crate::trace_layer(tracer));
        tracing::subscriber::set_default(subscriber)
    }

    /// The spans that ended so far, in the order they ended.
    pub fn spans(&self) -> Vec<SpanData> {
        self.exporter.get_finished_spans().unwrap_or_default()
    }
}

/// Keeps a second dispatcher registered for the rest of the process.
///
/// While only one dispatcher exists, `tracing` decides whether a callsite is enabled,
/// the first time it is hit, by asking the default subscriber *of the thread that hit
/// it*. A test running beside a capture, on another thread with no subscriber, would
/// then disable a span for good before the capture's thread ever creates it. With two
/// dispatchers registered, every registered dispatcher is asked, the capture included.
fn keep_interest_shared() {
    static SECOND: std::sync::OnceLock<tracing::Dispatch> = std::sync::OnceLock::new();
    SECOND.get_or_init(|| tracing::Dispatch::new(tracing::subscriber::NoSubscriber::default()));
}

/// One exported span, flattened for assertions.
#[derive(Debug, Clone, PartialEq)]
pub struct ReceivedSpan {
    /// The exporting process's `service.name`.
    pub service: String,
    /// The process's resource attributes.
    pub resource: BTreeMap<String, String>,
    /// Span name.
    pub name: String,
    /// Trace id, 32 hex digits.
    pub trace_id: String,
    /// Span id, 16 hex digits.
    pub span_id: String,
    /// Parent span id, 16 hex digits; empty for a root span.
    pub parent_span_id: String,
    /// Span kind as OTLP numbers it (1 internal, 2 server, 3 client).
    pub kind: i32,
    /// Attributes, values rendered as text (numbers in decimal, booleans as
    /// `true`/`false`, arrays as JSON-like lists).
    pub attributes: BTreeMap<String, String>,
    /// Status code as OTLP numbers it (0 unset, 1 ok, 2 error).
    pub status_code: i32,
    /// Status message.
    pub status_message: String,
    /// Names of the span's events.
    pub events: Vec<String>,
    /// The spans it links to, as (trace id, span id).
    pub links: Vec<(String, String)>,
}

impl ReceivedSpan {
    /// The attribute `key`, if set.
    pub fn attr(&self, key: &str) -> Option<&str> {
        self.attributes.get(key).map(String::as_str)
    }

    /// Whether the span's status is ERROR.
    pub fn is_error(&self) -> bool {
        self.status_code == 2
    }
}

/// An OTLP/gRPC trace receiver on a loopback port, keeping every span it is sent (or,
/// for long benchmarks, only counting them).
#[derive(Debug)]
pub struct OtlpReceiver {
    addr: SocketAddr,
    collector: Collector,
    server: tokio::task::JoinHandle<()>,
}

impl Drop for OtlpReceiver {
    fn drop(&mut self) {
        self.server.abort();
    }
}

#[derive(Debug, Clone)]
struct Collector {
    keep: bool,
    spans: Arc<Mutex<Vec<ReceivedSpan>>>,
    count: Arc<std::sync::atomic::AtomicUsize>,
}

#[tonic::async_trait]
impl TraceService for Collector {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let request = request.into_inner();
        let n: usize = request
            .resource_spans
            .iter()
            .flat_map(|r| &r.scope_spans)
            .map(|s| s.spans.len())
            .sum();
        self.count
            .fetch_add(n, std::sync::atomic::Ordering::Relaxed);
        if self.keep {
            let spans = flatten(request);
            self.spans
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .extend(spans);
        }
        Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
    }
}

impl OtlpReceiver {
    /// Starts a receiver on a free loopback port.
    ///
    /// # Panics
    ///
    /// When no loopback port can be bound.
    pub async fn start() -> Self {
        Self::start_with(true).await
    }

    /// Starts a receiver that only counts the spans it is sent ([`received`](Self::received)),
    /// for runs too long to keep them all.
    ///
    /// # Panics
    ///
    /// When no loopback port can be bound.
    pub async fn start_counting() -> Self {
        Self::start_with(false).await
    }

    async fn start_with(keep: bool) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("a free loopback port for the OTLP receiver");
        let addr = listener.local_addr().expect("the receiver's address");
        let collector = Collector {
            keep,
            spans: Arc::new(Mutex::new(Vec::new())),
            count: Arc::default(),
        };
        // Exports carry a batch of up to 512 spans; allow for large attribute sets.
        let service =
            TraceServiceServer::new(collector.clone()).max_decoding_message_size(64 * 1024 * 1024);
        let incoming = tonic::transport::server::TcpIncoming::from(listener);
        let server = tokio::spawn(async move {
            let _ = tonic::transport::Server::builder()
                .add_service(service)
                .serve_with_incoming(incoming)
                .await;
        });
        Self {
            addr,
            collector,
            server,
        }
    }

    /// How many spans were received so far.
    pub fn received(&self) -> usize {
        self.collector
            .count
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The endpoint to export to, e.g. as `OTEL_EXPORTER_OTLP_ENDPOINT`.
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Every span received so far.
    pub fn spans(&self) -> Vec<ReceivedSpan> {
        self.collector
            .spans
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Forgets the spans received so far.
    pub fn clear(&self) {
        self.collector
            .spans
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clear();
    }

    /// Waits until `done` holds for the spans received (checking every 50 ms), at most
    /// `limit`, and returns them either way.
    pub async fn wait_for(
        &self,
        limit: Duration,
        done: impl Fn(&[ReceivedSpan]) -> bool,
    ) -> Vec<ReceivedSpan> {
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            let spans = self.spans();
            if done(&spans) || tokio::time::Instant::now() >= deadline {
                return spans;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

fn flatten(request: ExportTraceServiceRequest) -> Vec<ReceivedSpan> {
    let mut out = Vec::new();
    for rs in request.resource_spans {
        let resource: BTreeMap<String, String> = rs
            .resource
            .map(|r| {
                r.attributes
                    .into_iter()
                    .map(|kv| (kv.key, render(kv.value.as_ref())))
                    .collect()
            })
            .unwrap_or_default();
        let service = resource.get("service.name").cloned().unwrap_or_default();
        for ss in rs.scope_spans {
            for s in ss.spans {
                let status = s.status.unwrap_or_default();
                out.push(ReceivedSpan {
                    service: service.clone(),
                    resource: resource.clone(),
                    name: s.name,
                    trace_id: hex(&s.trace_id),
                    span_id: hex(&s.span_id),
                    parent_span_id: hex(&s.parent_span_id),
                    kind: s.kind,
                    attributes: s
                        .attributes
                        .into_iter()
                        .map(|kv| (kv.key, render(kv.value.as_ref())))
                        .collect(),
                    status_code: status.code,
                    status_message: status.message,
                    events: s.events.into_iter().map(|e| e.name).collect(),
                    links: s
                        .links
                        .iter()
                        .map(|l| (hex(&l.trace_id), hex(&l.span_id)))
                        .collect(),
                });
            }
        }
    }
    out
}

fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write as _;
    bytes.iter().fold(String::new(), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    })
}

fn render(value: Option<&AnyValue>) -> String {
    match value.and_then(|v| v.value.as_ref()) {
        Some(any_value::Value::StringValue(s)) => s.clone(),
        Some(any_value::Value::BoolValue(b)) => b.to_string(),
        Some(any_value::Value::IntValue(i)) => i.to_string(),
        Some(any_value::Value::DoubleValue(d)) => d.to_string(),
        Some(any_value::Value::ArrayValue(a)) => format!(
            "[{}]",
            a.values
                .iter()
                .map(|v| render(Some(v)))
                .collect::<Vec<_>>()
                .join(", ")
        ),
        Some(any_value::Value::BytesValue(b)) => hex(b),
        Some(other) => format!("{other:?}"),
        None => String::new(),
    }
}
