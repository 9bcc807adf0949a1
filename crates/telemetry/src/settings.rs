//! What [`init`](crate::init) installs: the log format and level, and where spans go.
//!
//! The OTLP endpoint follows the OpenTelemetry SDK conventions so that a deployment
//! configures convene like any other instrumented program:
//!
//! 1. `OTEL_SDK_DISABLED=true` (or `OTEL_TRACES_EXPORTER=none`) turns export off,
//!    whatever else is set;
//! 2. the `--otlp-endpoint` flag;
//! 3. `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`;
//! 4. `OTEL_EXPORTER_OTLP_ENDPOINT`.
//!
//! Nothing set means no export and no OpenTelemetry layer at all. The environment is
//! passed in (see [`Settings::from_env`]), so tests never touch the process's own.

use tracing_subscriber::filter::LevelFilter;

/// Turns the SDK off when `true`, whatever else is configured.
pub const OTEL_SDK_DISABLED: &str = "OTEL_SDK_DISABLED";
/// `none` turns trace export off; `otlp` (the default) is the only exporter convene has.
pub const OTEL_TRACES_EXPORTER: &str = "OTEL_TRACES_EXPORTER";
/// The OTLP endpoint for traces only, e.g. `http://collector:4317`.
pub const OTEL_EXPORTER_OTLP_TRACES_ENDPOINT: &str = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT";
/// The OTLP endpoint for every signal, e.g. `http://localhost:4317`.
pub const OTEL_EXPORTER_OTLP_ENDPOINT: &str = "OTEL_EXPORTER_OTLP_ENDPOINT";

/// How log lines are written (to standard error).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// One human-readable line per event.
    #[default]
    Text,
    /// One JSON object per event, for log collectors.
    Json,
}

/// What [`init`](crate::init) installs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Settings {
    /// Log line format.
    pub log_format: LogFormat,
    /// Log level when `RUST_LOG` is unset.
    pub default_log_level: LevelFilter,
    /// The OTLP/gRPC collector spans are exported to (`http://host:4317`); `None`: no
    /// export and no OpenTelemetry layer.
    pub otlp_endpoint: Option<String>,
}

impl Default for Settings {
    /// Text logs at `info`, no export.
    fn default() -> Self {
        Self {
            log_format: LogFormat::Text,
            default_log_level: LevelFilter::INFO,
            otlp_endpoint: None,
        }
    }
}

impl Settings {
    /// Settings from a `--log-format`, an optional `--otlp-endpoint` flag and the
    /// environment `env` (the process's own is `std::env::vars()`); the endpoint is
    /// resolved as [`otlp_endpoint`] says.
    pub fn from_env<I, K, V>(log_format: LogFormat, otlp_flag: Option<&str>, env: I) -> Self
    where
        I: IntoIterator<Item = (K, V)>,
        K: AsRef<str>,
        V: AsRef<str>,
    {
        Self {
            log_format,
            otlp_endpoint: otlp_endpoint(otlp_flag, env),
            ..Self::default()
        }
    }

    /// The same settings logging at `level` when `RUST_LOG` is unset.
    #[must_use]
    pub fn with_default_log_level(self, level: LevelFilter) -> Self {
        Self {
            default_log_level: level,
            ..self
        }
    }

    /// The same settings exporting to `endpoint`.
    #[must_use]
    pub fn with_otlp_endpoint(self, endpoint: impl Into<String>) -> Self {
        Self {
            otlp_endpoint: Some(endpoint.into()),
            ..self
        }
    }
}

/// The OTLP endpoint in effect for `otlp_flag` and the environment `env`, or `None` when
/// export is off: `OTEL_SDK_DISABLED=true` or `OTEL_TRACES_EXPORTER=none` turn it off,
/// else the flag, `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`, then
/// `OTEL_EXPORTER_OTLP_ENDPOINT`, whichever comes first. Empty values count as unset.
pub fn otlp_endpoint<I, K, V>(otlp_flag: Option<&str>, env: I) -> Option<String>
where
    I: IntoIterator<Item = (K, V)>,
    K: AsRef<str>,
    V: AsRef<str>,
{
    let mut disabled = false;
    let mut traces = None;
    let mut generic = None;
    for (key, value) in env {
        let value = value.as_ref().trim();
        match key.as_ref() {
            OTEL_SDK_DISABLED => disabled |= value.eq_ignore_ascii_case("true"),
            OTEL_TRACES_EXPORTER => disabled |= value.eq_ignore_ascii_case("none"),
            OTEL_EXPORTER_OTLP_TRACES_ENDPOINT if !value.is_empty() => {
                traces = Some(value.to_owned());
            }
            OTEL_EXPORTER_OTLP_ENDPOINT if !value.is_empty() => {
                generic = Some(value.to_owned());
            }
            _ => {}
        }
    }
    if disabled {
        return None;
    }
    otlp_flag
        .map(str::trim)
        .filter(|f| !f.is_empty())
        .map(str::to_owned)
        .or(traces)
        .or(generic)
}

#[cfg(test)]
mod tests {
    use super::*;

    const NONE: [(&str, &str); 0] = [];

    #[test]
    fn nothing_configured_means_no_export() {
        assert_eq!(otlp_endpoint(None, NONE), None);
        assert_eq!(
            otlp_endpoint(Some("  "), [(OTEL_EXPORTER_OTLP_ENDPOINT, "")]),
            None
        );
        assert_eq!(Settings::default().otlp_endpoint, None);
    }

    #[test]
    fn flag_then_traces_endpoint_then_generic_endpoint() {
        let both = [
            (OTEL_EXPORTER_OTLP_ENDPOINT, "http://generic:4317"),
            (OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, "http://traces:4317"),
        ];
        assert_eq!(
            otlp_endpoint(Some("http://flag:4317"), both).as_deref(),
            Some("http://flag:4317")
        );
        assert_eq!(
            otlp_endpoint(None, both).as_deref(),
            Some("http://traces:4317")
        );
        assert_eq!(
            otlp_endpoint(None, [(OTEL_EXPORTER_OTLP_ENDPOINT, "http://generic:4317")]).as_deref(),
            Some("http://generic:4317")
        );
    }

    #[test]
    fn the_sdk_switch_wins_over_every_endpoint() {
        for off in [(OTEL_SDK_DISABLED, "TRUE"), (OTEL_TRACES_EXPORTER, "none")] {
            let env = [(OTEL_EXPORTER_OTLP_ENDPOINT, "http://generic:4317"), off];
            assert_eq!(
                otlp_endpoint(Some("http://flag:4317"), env),
                None,
                "{off:?}"
            );
        }
        // Any other value leaves export on.
        let env = [
            (OTEL_SDK_DISABLED, "false"),
            (OTEL_EXPORTER_OTLP_ENDPOINT, "http://generic:4317"),
        ];
        assert!(otlp_endpoint(None, env).is_some());
    }

    #[test]
    fn settings_carry_the_format_and_the_endpoint() {
        let s = Settings::from_env(
            LogFormat::Json,
            None,
            [(OTEL_EXPORTER_OTLP_ENDPOINT, "http://localhost:4317")],
        )
        .with_default_log_level(LevelFilter::WARN);
        assert_eq!(s.log_format, LogFormat::Json);
        assert_eq!(s.default_log_level, LevelFilter::WARN);
        assert_eq!(s.otlp_endpoint.as_deref(), Some("http://localhost:4317"));
    }
}
