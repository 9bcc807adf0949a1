//! Binary-edge helpers: the flags every service binary shares, and telemetry setup.
//!
//! Each service flattens [`ServiceArgs`] into its own clap parser
//! (`#[command(flatten)] common: ServiceArgs`), so `--listen`, `--config`,
//! `--dump-config`, `--log-format` and `--otlp-endpoint` mean the same everywhere.
//! [`ServiceArgs::load`], [`ServiceArgs::telemetry`] and [`init_logging`] read process
//! state (environment, global subscriber) and belong in `main`, never in a service's
//! library code.

use std::{net::SocketAddr, path::PathBuf};

pub use convene_telemetry::LogFormat;
use serde::{Serialize, de::DeserializeOwned};

use crate::{
    config::{self, ConfigLoader, Format},
    settings::SERVER_SECTION,
};

/// The command-line flags every convene service binary accepts.
#[derive(Clone, Debug, Default, PartialEq, Eq, clap::Args)]
pub struct ServiceArgs {
    /// Address the gRPC server listens on, e.g. 0.0.0.0:7001 to accept connections from
    /// other hosts. Overrides `server.listen` from the config file and the
    /// CONVENE_SERVER__LISTEN environment variable. [default: the service's own port on
    /// 127.0.0.1]
    #[arg(long, value_name = "ADDR")]
    pub listen: Option<SocketAddr>,

    /// Config file, TOML (*.toml) or YAML (*.yaml, *.yml). Its values override the
    /// built-in defaults; CONVENE_* environment variables override the file (nested keys
    /// joined with `__`, e.g. CONVENE_SERVER__REQUEST_TIMEOUT=60s sets
    /// `server.request_timeout`); flags override both. Unknown keys are errors.
    #[arg(long, value_name = "FILE", env = "CONVENE_CONFIG")]
    pub config: Option<PathBuf>,

    /// Print the effective configuration (defaults, file, environment and flags merged)
    /// and exit. The output is a valid config file. FORMAT is toml or yaml.
    #[arg(
        long,
        value_name = "FORMAT",
        value_enum,
        num_args = 0..=1,
        require_equals = true,
        default_missing_value = "toml"
    )]
    pub dump_config: Option<Format>,

    /// Log line format: text for people, json for log collectors. The level is set by
    /// RUST_LOG (default `info`), e.g. RUST_LOG=info,convene_supervisor=debug.
    #[arg(
        long,
        value_name = "FORMAT",
        value_enum,
        default_value_t = LogFormat::Text,
        env = "CONVENE_LOG_FORMAT"
    )]
    pub log_format: LogFormat,

    /// Export trace spans over OTLP/gRPC to this collector, e.g. http://localhost:4317
    /// (Jaeger's OTLP port). Overrides OTEL_EXPORTER_OTLP_TRACES_ENDPOINT and
    /// OTEL_EXPORTER_OTLP_ENDPOINT; OTEL_SDK_DISABLED=true turns export off whatever is
    /// set. [default: no export]
    #[arg(long, value_name = "URL")]
    pub otlp_endpoint: Option<String>,

    /// Say that the credentials this service accepts or presents are public: committed
    /// with the source, as those of deploy/k8s/overlays/dev and deploy/compose.yaml are.
    /// Its first log line then warns that anyone may call it as any principal, so it
    /// belongs on a private cluster only.
    #[arg(long, env = "CONVENE_PUBLIC_CREDENTIALS")]
    pub public_credentials: bool,

    /// TLS for the listeners and the calls to other services.
    #[command(flatten)]
    pub tls: crate::tls::TlsArgs,
}

impl ServiceArgs {
    /// A loader with the file from `--config` and the `--listen` override applied, but no
    /// environment: add it with [`ConfigLoader::env`]. Services embed their
    /// [`ServerSettings`](crate::ServerSettings) under the key `server`.
    pub fn config_loader(&self) -> ConfigLoader {
        let mut loader = ConfigLoader::new();
        if let Some(path) = &self.config {
            loader = loader.file(path);
        }
        if let Some(listen) = self.listen {
            loader = loader.set(format!("{SERVER_SECTION}.listen"), listen.to_string());
        }
        loader
    }

    /// [`config_loader`](Self::config_loader) for a service whose `Config` flattens a
    /// [`ServiceCommon`](crate::ServiceCommon), with its `--policy-file` and
    /// `--data-dir` flags applied when given.
    pub fn common_loader(
        &self,
        policy_file: Option<&std::path::Path>,
        data_dir: Option<&std::path::Path>,
    ) -> ConfigLoader {
        self.config_loader()
            .section::<crate::ServiceCommon>()
            .set_path("policy_file", policy_file)
            .set_path("data_dir", data_dir)
    }

    /// Loads the service's configuration from the defaults, `--config`, the process
    /// environment and the flags. For `main` only: it reads `std::env::vars()`.
    ///
    /// # Errors
    ///
    /// Any [`config::Error`], naming the offending key and its source.
    pub fn load<T>(&self) -> Result<T, config::Error>
    where
        T: Serialize + DeserializeOwned + Default,
    {
        self.config_loader().env(std::env::vars()).load()
    }

    /// The telemetry settings of these flags and the process environment (the `OTEL_*`
    /// variables), for `convene_telemetry::init`. For `main` only: it reads
    /// `std::env::vars()`.
    pub fn telemetry(&self) -> convene_telemetry::Settings {
        convene_telemetry::Settings::from_env(
            self.log_format,
            self.otlp_endpoint.as_deref(),
            std::env::vars(),
        )
    }
}

/// Installs the global `tracing` subscriber for log lines only (no trace export):
/// `RUST_LOG`-style filtering (default `info`), text or JSON lines on standard error.
/// Binaries that serve use `convene_telemetry::init` with [`ServiceArgs::telemetry`]
/// instead, which also exports traces when a collector is configured.
///
/// Idempotent: if a subscriber is already installed (by an earlier call, another service
/// in the same process, or a test harness) it is left alone and `false` is returned.
pub fn init_logging(format: LogFormat) -> bool {
    convene_telemetry::init_logging(format)
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;
    use crate::ServerSettings;

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        common: ServiceArgs,
    }

    #[derive(Debug, Default, PartialEq, Serialize, serde::Deserialize)]
    #[serde(deny_unknown_fields, default)]
    struct Config {
        server: ServerSettings,
    }

    #[test]
    fn flags_parse_with_their_defaults() {
        let cli = Cli::try_parse_from(["svc"]).unwrap();
        assert_eq!(cli.common.listen, None);
        assert_eq!(cli.common.dump_config, None);
        assert_eq!(cli.common.log_format, LogFormat::Text);

        let cli = Cli::try_parse_from([
            "svc",
            "--listen",
            "0.0.0.0:7001",
            "--dump-config",
            "--log-format",
            "json",
        ])
        .unwrap();
        assert_eq!(cli.common.listen, Some("0.0.0.0:7001".parse().unwrap()));
        assert_eq!(cli.common.dump_config, Some(Format::Toml));
        assert_eq!(cli.common.log_format, LogFormat::Json);
        assert_eq!(cli.common.otlp_endpoint, None);

        let cli = Cli::try_parse_from(["svc", "--otlp-endpoint", "http://collector:4317"]).unwrap();
        assert_eq!(
            cli.common.otlp_endpoint.as_deref(),
            Some("http://collector:4317")
        );

        let cli = Cli::try_parse_from(["svc", "--dump-config=yaml"]).unwrap();
        assert_eq!(cli.common.dump_config, Some(Format::Yaml));

        let err = Cli::try_parse_from(["svc", "--listen", "not-an-address"]).unwrap_err();
        assert!(err.to_string().contains("not-an-address"), "{err}");
    }

    #[test]
    fn help_names_the_environment_variables() {
        let help = <Cli as clap::CommandFactory>::command()
            .render_long_help()
            .to_string();
        for needle in [
            "CONVENE_SERVER__LISTEN",
            "CONVENE_CONFIG",
            "CONVENE_LOG_FORMAT",
            "RUST_LOG",
            "--otlp-endpoint",
            "OTEL_EXPORTER_OTLP_ENDPOINT",
            "OTEL_SDK_DISABLED",
        ] {
            assert!(help.contains(needle), "help lacks {needle}:\n{help}");
        }
    }

    #[test]
    fn listen_flag_overrides_the_environment() {
        let cli = Cli::try_parse_from(["svc", "--listen", "127.0.0.1:9100"]).unwrap();
        let config: Config = cli
            .common
            .config_loader()
            .env([("CONVENE_SERVER__LISTEN", "127.0.0.1:9200")])
            .load()
            .unwrap();
        assert_eq!(config.server.listen, "127.0.0.1:9100".parse().unwrap());
    }

    #[test]
    fn init_logging_is_idempotent() {
        // Whichever call installs first, a second one must not panic and must report
        // that it did nothing.
        let _ = init_logging(LogFormat::Text);
        assert!(!init_logging(LogFormat::Json));
    }
}
