//! Tracing for every convene process: log lines on standard error and, when an OTLP
//! collector is configured, OpenTelemetry spans exported to it.
//!
//! A binary calls [`init`] once at start, with its `service.name` (`convene-supervisor`,
//! `convene-worker`, ...; `convene` when `convene up` hosts every service in one
//! process), and [`Telemetry::shutdown`] after its server returned, so buffered spans
//! reach the collector before the process exits.
//!
//! # Two audiences, two filters
//!
//! - **Logs** keep their own filter (`RUST_LOG`, default `info`) and format (text or
//!   JSON). The spans convene creates for traces (targets starting with `convene`) are
//!   not part of log lines: log events carry their own fields (`run_id = ...`).
//! - **Traces** get every convene span at `INFO` and above, and convene's `INFO` events
//!   as span events, exported in batches over OTLP/gRPC (tonic). Only configured by the
//!   standard `OTEL_*` variables or a flag (see [`Settings`]); off by default.
//!
//! When export is off, no OpenTelemetry layer is installed at all: convene's trace spans
//! are then disabled at their call sites, which costs what a disabled `tracing` span
//! costs (a cached interest check) and nothing else.
//!
//! # Trace context
//!
//! [`init`] installs the W3C `TraceContextPropagator` globally. [`inject_current`] and
//! [`set_remote_parent`] carry the context across a gRPC hop (the mesh's clients and the
//! server builder use them), [`traceparent`] and [`continue_trace`] store it and pick it
//! up again (a run resumed by another process continues its trace).
//!
//! `init` needs a Tokio runtime (the exporter's gRPC channel is driven by it); export
//! runs on the SDK's own background thread, so spans are never exported on the request
//! path.
#![forbid(unsafe_code)]

mod propagation;
mod settings;
#[cfg(feature = "test-util")]
pub mod test_util;

use std::time::Duration;

use opentelemetry::KeyValue;
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{SdkTracer, SdkTracerProvider};
use tracing::Metadata;
use tracing::level_filters::LevelFilter;
use tracing_subscriber::filter::{EnvFilter, FilterExt as _, filter_fn};
use tracing_subscriber::layer::{Layer, SubscriberExt as _};
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::util::SubscriberInitExt as _;

pub use propagation::{
    TRACEPARENT, TRACESTATE, continue_trace, current_trace_id, inject_current, link, set_error,
    set_remote_parent, trace_id, traceparent,
};
pub use settings::{
    LogFormat, OTEL_EXPORTER_OTLP_ENDPOINT, OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, OTEL_SDK_DISABLED,
    OTEL_TRACES_EXPORTER, Settings, otlp_endpoint,
};

/// The target prefix of the spans convene creates for traces. Spans of other targets
/// (libraries) are neither exported nor kept out of the logs.
pub const SPAN_TARGET_PREFIX: &str = "convene";

/// The `service.name` of a process hosting every service (`convene up`, `run --local`);
/// its spans name the logical service in [`SERVICE_ATTRIBUTE`].
pub const ONE_PROCESS_SERVICE_NAME: &str = "convene";

/// The span attribute naming the logical service (`policy`, `worker`, ...) that
/// produced a span, so traces of a one-process mesh still say who did what.
pub const SERVICE_ATTRIBUTE: &str = "convene.service";

/// How long [`Telemetry::shutdown`] waits for buffered spans to reach the collector.
const SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(5);

/// What [`init`] installed; [`shutdown`](Self::shutdown) flushes it.
#[derive(Debug)]
#[must_use = "call `shutdown` before exiting, or buffered spans are lost"]
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
    endpoint: Option<String>,
    installed: bool,
}

impl Telemetry {
    /// Whether this call installed the global subscriber (false when one was already
    /// installed: a second `init` in one process changes nothing).
    pub fn installed(&self) -> bool {
        self.installed
    }

    /// The collector spans are exported to, when export is on.
    pub fn exporting_to(&self) -> Option<&str> {
        self.provider.as_ref().and(self.endpoint.as_deref())
    }

    /// Exports the spans still buffered and stops the exporter, waiting at most a few
    /// seconds for an unreachable collector. The SDK's flush blocks its caller, so it
    /// runs on Tokio's blocking pool, never on a runtime worker.
    pub async fn shutdown(mut self) {
        let Some(provider) = self.provider.take() else {
            return;
        };
        let endpoint = self.endpoint.take().unwrap_or_default();
        match tokio::task::spawn_blocking(move || provider.shutdown_with_timeout(SHUTDOWN_TIMEOUT))
            .await
        {
            Ok(Ok(())) => {}
            Ok(Err(error)) => {
                tracing::warn!(%endpoint, %error, "spans may be lost: the trace exporter did not shut down cleanly");
            }
            Err(error) => {
                tracing::warn!(%endpoint, %error, "spans may be lost: the trace flush task failed");
            }
        }
    }
}

/// Installs the global `tracing` subscriber for a process whose spans are exported as
/// `service_name`: log lines as [`Settings`] say and, when an OTLP endpoint is
/// configured, an OpenTelemetry layer with a batch OTLP/gRPC exporter and the resource
/// `service.name`, `service.version` and `service.instance.id` (a fresh UUID per
/// process). Installs the W3C trace-context propagator globally.
///
/// Idempotent: when a subscriber is already installed (an earlier call, a test
/// harness), nothing changes and [`Telemetry::installed`] is false. An endpoint that
/// cannot be used is reported in the log and export stays off; the process runs on.
///
/// Call it from within a Tokio runtime.
pub fn init(service_name: &str, settings: &Settings) -> Telemetry {
    let built = build(service_name, settings);
    let installed = built.dispatch.try_init().is_ok();
    let provider = match built.provider {
        Some(provider) if installed => {
            opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new());
            opentelemetry::global::set_tracer_provider(provider.clone());
            Some(provider)
        }
        Some(provider) => {
            // Another subscriber won; this provider has nothing to export. Its shutdown
            // joins the exporter thread, so not on the caller's (runtime) thread.
            std::thread::spawn(move || provider.shutdown());
            None
        }
        None => None,
    };
    if installed {
        if let Some(error) = built.filter_error {
            tracing::warn!(%error, "RUST_LOG is invalid; logging at the default level");
        }
        if let Some(error) = built.export_error {
            tracing::warn!(
                endpoint = settings.otlp_endpoint.as_deref().unwrap_or_default(),
                %error,
                "traces are not exported: the OTLP endpoint cannot be used; give a URL such as http://localhost:4317"
            );
        }
        tracing::debug!(
            service = service_name,
            endpoint = settings.otlp_endpoint.as_deref().unwrap_or("none"),
            exporting = provider.is_some(),
            "telemetry initialized"
        );
    }
    Telemetry {
        provider,
        endpoint: settings.otlp_endpoint.clone(),
        installed,
    }
}

/// The subscriber [`init`] would install, returned instead of installed: for a program
/// that compares settings in one process (a benchmark sets it as the default of its
/// runtime's threads). Installs the W3C propagator globally, as `init` does.
///
/// Call it from within a Tokio runtime when `settings` export.
pub fn dispatch(service_name: &str, settings: &Settings) -> (tracing::Dispatch, Telemetry) {
    let built = build(service_name, settings);
    if let Some(error) = &built.export_error {
        tracing::warn!(%error, "traces are not exported: the OTLP endpoint cannot be used");
    }
    opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new());
    let telemetry = Telemetry {
        provider: built.provider,
        endpoint: settings.otlp_endpoint.clone(),
        installed: false,
    };
    (built.dispatch, telemetry)
}

/// A subscriber and what it exports through, not installed yet.
struct Built {
    dispatch: tracing::Dispatch,
    provider: Option<SdkTracerProvider>,
    filter_error: Option<tracing_subscriber::filter::FromEnvError>,
    export_error: Option<opentelemetry_otlp::ExporterBuildError>,
}

fn build(service_name: &str, settings: &Settings) -> Built {
    let (filter, filter_error) = log_filter(settings.default_log_level);
    let logs = fmt_layer(settings.log_format).with_filter(filter.and(filter_fn(not_a_trace_span)));
    let registry = tracing_subscriber::registry().with(logs);
    let mut built = Built {
        dispatch: tracing::Dispatch::none(),
        provider: None,
        filter_error,
        export_error: None,
    };
    match settings.otlp_endpoint.as_deref() {
        None => built.dispatch = tracing::Dispatch::new(registry),
        Some(endpoint) => match provider(service_name, endpoint) {
            Ok(provider) => {
                let tracer = provider.tracer(ONE_PROCESS_SERVICE_NAME);
                built.dispatch = tracing::Dispatch::new(registry.with(trace_layer(tracer)));
                built.provider = Some(provider);
            }
            Err(error) => {
                built.dispatch = tracing::Dispatch::new(registry);
                built.export_error = Some(error);
            }
        },
    }
    built
}

/// Installs only the log-line subscriber (no export), as [`init`] does with export off.
/// Returns whether it was installed (false when one already was).
pub fn init_logging(format: LogFormat) -> bool {
    let telemetry = init(
        ONE_PROCESS_SERVICE_NAME,
        &Settings {
            log_format: format,
            ..Settings::default()
        },
    );
    telemetry.installed()
}

/// `RUST_LOG`, or `default` when it is unset; a malformed `RUST_LOG` falls back to the
/// default and is reported once logging is up.
fn log_filter(
    default: LevelFilter,
) -> (EnvFilter, Option<tracing_subscriber::filter::FromEnvError>) {
    match EnvFilter::try_from_default_env() {
        Ok(filter) => (filter, None),
        Err(error) => (
            EnvFilter::new(default.to_string()),
            // An unset RUST_LOG is the normal case; only a malformed one is worth a word.
            std::env::var_os(EnvFilter::DEFAULT_ENV).map(|_| error),
        ),
    }
}

fn fmt_layer<S>(format: LogFormat) -> Box<dyn Layer<S> + Send + Sync>
where
    S: tracing::Subscriber + for<'a> LookupSpan<'a>,
{
    // Colour only on a terminal: a log collector reading a pipe or a file gets the plain
    // lines, whatever the format.
    let layer = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()));
    match format {
        LogFormat::Text => layer.boxed(),
        LogFormat::Json => layer.json().boxed(),
    }
}

/// Whether a callsite is one of convene's trace spans.
fn is_trace_span(meta: &Metadata<'_>) -> bool {
    meta.is_span() && meta.target().starts_with(SPAN_TARGET_PREFIX)
}

fn not_a_trace_span(meta: &Metadata<'_>) -> bool {
    !is_trace_span(meta)
}

/// What the trace layer sees: convene's spans and events at `INFO` and above (events
/// become span events; an `ERROR` event marks its span failed).
fn exported(meta: &Metadata<'_>) -> bool {
    meta.target().starts_with(SPAN_TARGET_PREFIX) && *meta.level() <= tracing::Level::INFO
}

/// The OpenTelemetry layer: lean spans (no thread or busy/idle attributes, which the
/// tree does not need and every enter would pay for; no source locations, three more
/// attributes on every span and event that a span's name and `convene.service` already
/// place), filtered to convene's own.
fn trace_layer<S>(tracer: SdkTracer) -> impl Layer<S>
where
    S: tracing::Subscriber + for<'a> LookupSpan<'a>,
{
    tracing_opentelemetry::layer()
        .with_tracer(tracer)
        .with_threads(false)
        .with_tracked_inactivity(false)
        .with_target(false)
        .with_location(false)
        .with_filter(filter_fn(exported))
}

/// A tracer provider exporting in batches to `endpoint` over OTLP/gRPC.
fn provider(
    service_name: &str,
    endpoint: &str,
) -> Result<SdkTracerProvider, opentelemetry_otlp::ExporterBuildError> {
    use opentelemetry_otlp::WithExportConfig as _;
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_tonic()
        .with_endpoint(endpoint)
        .build()?;
    Ok(SdkTracerProvider::builder()
        .with_resource(resource(service_name))
        .with_batch_exporter(exporter)
        .build())
}

/// The resource every span of this process carries.
fn resource(service_name: &str) -> Resource {
    Resource::builder()
        .with_service_name(service_name.to_owned())
        .with_attributes([
            KeyValue::new("service.version", env!("CARGO_PKG_VERSION")),
            KeyValue::new("service.instance.id", uuid::Uuid::new_v4().to_string()),
        ])
        .build()
}
