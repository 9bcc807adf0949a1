//! [`serve_binary`]: the start-up path every service binary shares, from the parsed flags
//! to the exit code.
//!
//! A service's `main.rs` keeps only its clap parser (its own flags and help) and calls
//! [`serve_binary`], so every binary loads its configuration, answers `--dump-config`,
//! sets up telemetry, handles signals, reports failures and exits alike:
//!
//! - a configuration that cannot be loaded (or dumped) exits with [`EXIT_CONFIG`] (2),
//!   as clap does for bad flags;
//! - a service that fails to start or stops with an error exits with [`EXIT_FAILURE`]
//!   (1);
//! - either way the message goes to standard error, prefixed with the binary's name
//!   (`convene-policy: ...`), since the failure may come before logging is set up.

use std::{error::Error as StdError, fmt::Write as _, process::ExitCode};

use serde::{Serialize, de::DeserializeOwned};

use crate::{ConfigLoader, Shutdown, cli::ServiceArgs, dump};

/// Exit status of a binary whose configuration cannot be loaded.
pub const EXIT_CONFIG: u8 = 2;

/// Exit status of a binary that failed to start or stopped with an error.
pub const EXIT_FAILURE: u8 = 1;

/// The error a service's run returns, whatever its type.
pub type BoxError = Box<dyn StdError + Send + Sync>;

/// Runs a service binary named `name` (`convene-<service>`): loads its configuration
/// from `loader` (the `--config` file and the flags, see
/// [`ServiceArgs::config_loader`]) and the process's `CONVENE_*` environment; with
/// `--dump-config` prints it and exits; otherwise starts telemetry, logs the development
/// settings in use when no `--config` was given (`dev_settings` describes them, e.g.
/// `data dir ./.convene, listening on 127.0.0.1:7401`), and runs `run(config,
/// shutdown)` until SIGTERM or Ctrl-C, then flushes telemetry.
///
/// Returns the exit code; see the [module docs](self) for what each means.
pub async fn serve_binary<C, F, Fut, E>(
    name: &str,
    args: &ServiceArgs,
    loader: ConfigLoader,
    dev_settings: impl FnOnce(&C) -> String,
    run: F,
) -> ExitCode
where
    C: Serialize + DeserializeOwned + Default,
    F: FnOnce(C, Shutdown) -> Fut,
    Fut: Future<Output = Result<(), E>>,
    E: Into<BoxError>,
{
    let config: C = match loader.env(std::env::vars()).load() {
        Ok(config) => config,
        Err(error) => return fail(name, &error, EXIT_CONFIG),
    };
    if let Some(format) = args.dump_config {
        return match dump(&config, format) {
            Ok(text) => {
                print!("{text}");
                ExitCode::SUCCESS
            }
            Err(error) => fail(name, &error, EXIT_CONFIG),
        };
    }
    let listeners = listen_addresses(&config);
    let named: Vec<(&str, std::net::SocketAddr)> =
        listeners.iter().map(|(k, a)| (k.as_str(), *a)).collect();
    let warnings = match crate::tls::prepare(&args.tls, &named) {
        Ok(warnings) => warnings,
        Err(error) => return fail(name, &error, EXIT_CONFIG),
    };
    let telemetry = convene_telemetry::init(name, &args.telemetry());
    if let Some(warning) = credentials_warning(args.public_credentials, &config) {
        tracing::warn!("{warning}");
    }
    for warning in warnings {
        eprintln!("{name}: warning: {warning}");
        tracing::warn!("{warning}");
    }
    if args.config.is_none() {
        tracing::info!(
            "no --config given: using the development settings of the payment-incident \
             example ({})",
            dev_settings(&config)
        );
    }
    let shutdown = match Shutdown::from_signals() {
        Ok(shutdown) => shutdown,
        Err(error) => {
            telemetry.shutdown().await;
            return fail(
                name,
                &format!("cannot install the signal handlers: {error}"),
                EXIT_FAILURE,
            );
        }
    };
    let served = run(config, shutdown).await.map_err(Into::into);
    telemetry.shutdown().await;
    match served {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => fail(name, &chain(&*error), EXIT_FAILURE),
    }
}

/// What the first log line of a service says about its credentials, if anything: that
/// they are public (`--public-credentials`), or that development credentials are on
/// (the `dev_credentials` key). Either way the mesh belongs on a private cluster (or
/// your own machine) only.
pub fn credentials_warning<C: Serialize>(public: bool, config: &C) -> Option<&'static str> {
    let dev = toml::Value::try_from(config)
        .ok()
        .and_then(|v| v.get("dev_credentials").and_then(toml::Value::as_bool))
        == Some(true);
    if public {
        Some(
            "PUBLIC CREDENTIALS: this service runs with credentials committed with convene's \
             source (the dev overlay's), which anyone can read and call it with as any \
             principal: run it on a private cluster only, never where others reach it; \
             deploy/README.md (Prepare prod) says how to make credentials of your own",
        )
    } else if dev {
        Some(
            "DEVELOPMENT CREDENTIALS (dev_credentials = true): principals without a credential \
             hash get one generated into the data directory: for your own machine or a \
             private cluster only; elsewhere turn dev_credentials off and list every \
             credential's hash in the policy file",
        )
    } else {
        None
    }
}

/// The addresses a configuration listens on: every `listen` key and every key ending in
/// `_listen` whose value is an address (`server.listen`, the gateway's `http_listen`),
/// named by their path.
pub fn listen_addresses<C: Serialize>(config: &C) -> Vec<(String, std::net::SocketAddr)> {
    fn walk(value: &toml::Value, path: &str, out: &mut Vec<(String, std::net::SocketAddr)>) {
        let toml::Value::Table(table) = value else {
            return;
        };
        for (key, value) in table {
            let at = if path.is_empty() {
                key.clone()
            } else {
                format!("{path}.{key}")
            };
            match value {
                toml::Value::String(text) if key == "listen" || key.ends_with("_listen") => {
                    if let Ok(addr) = text.parse() {
                        out.push((at, addr));
                    }
                }
                toml::Value::Table(_) => walk(value, &at, out),
                _ => {}
            }
        }
    }
    let mut out = Vec::new();
    if let Ok(value) = toml::Value::try_from(config) {
        walk(&value, "", &mut out);
    }
    out
}

/// Reports `error` on standard error, prefixed with the binary's name, and returns
/// `code`.
fn fail(name: &str, error: &dyn std::fmt::Display, code: u8) -> ExitCode {
    eprintln!("{name}: {error}");
    ExitCode::from(code)
}

/// `error` followed by its sources, each after a colon, leaving out a source whose text
/// the message before it already includes (errors that print their source themselves).
fn chain(error: &(dyn StdError + 'static)) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let line = cause.to_string();
        if !text.contains(&line) {
            let _ = write!(text, ": {line}");
        }
        source = cause.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    enum Outer {
        #[error("cannot start: {0}")]
        Shows(#[source] std::io::Error),
        #[error("cannot start")]
        Hides(#[source] std::io::Error),
    }

    #[test]
    fn the_credentials_warning_says_public_or_development() {
        #[derive(Serialize)]
        struct Common {
            dev_credentials: bool,
        }
        #[derive(Serialize)]
        struct Worker {
            data_dir: String,
        }
        let on = Common {
            dev_credentials: true,
        };
        let off = Common {
            dev_credentials: false,
        };
        let worker = Worker {
            data_dir: ".convene".into(),
        };
        assert!(
            credentials_warning(true, &off).is_some_and(|w| w.contains("private cluster only"))
        );
        assert!(credentials_warning(true, &worker).is_some_and(|w| w.starts_with("PUBLIC")));
        assert!(credentials_warning(false, &on).is_some_and(|w| w.contains("dev_credentials")));
        assert_eq!(credentials_warning(false, &off), None);
        assert_eq!(credentials_warning(false, &worker), None);
    }

    #[test]
    fn the_chain_names_every_cause_once() {
        let io = || std::io::Error::other("disk full");
        assert_eq!(chain(&Outer::Shows(io())), "cannot start: disk full");
        assert_eq!(chain(&Outer::Hides(io())), "cannot start: disk full");
    }
}
