//! [`ServerSettings`]: the configuration section every gRPC service embeds.
//!
//! Services put it under the key `server` of their own config struct, so the same keys
//! (`server.listen`, `server.request_timeout`, ...) and environment variables
//! (`CONVENE_SERVER__LISTEN`, ...) work for every service.

use std::{
    net::{Ipv4Addr, SocketAddr},
    time::Duration,
};

use serde::{Deserialize, Serialize};

/// The config key services embed [`ServerSettings`] under, which `--listen` overrides.
pub const SERVER_SECTION: &str = "server";

/// Default largest message, in either direction: 4 MiB, gRPC's usual default.
pub const DEFAULT_MAX_MESSAGE_BYTES: usize = 4 * 1024 * 1024;
/// Default time a unary call (or a stream's first response) may take.
pub const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
/// Default number of calls served at once before new ones are shed.
pub const DEFAULT_CONCURRENCY_LIMIT: usize = 1024;
/// Default time in-flight calls get to finish once shutdown starts.
pub const DEFAULT_SHUTDOWN_GRACE: Duration = Duration::from_secs(10);

/// How a gRPC server listens and protects itself.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ServerSettings {
    /// Address to listen on. The default, `127.0.0.1:0`, picks a free loopback port;
    /// services set their well-known port through [`ServerSettings::on_port`].
    pub listen: SocketAddr,
    /// Largest request or response message accepted, in bytes. Bigger requests fail with
    /// `OUT_OF_RANGE` naming this limit.
    pub max_message_bytes: usize,
    /// Time a call may take to produce its response headers (all of a unary call, the
    /// start of a stream) before it is answered `DEADLINE_EXCEEDED`. `"off"` disables it,
    /// for services whose calls legitimately run long.
    #[serde(with = "crate::config::optional_duration")]
    pub request_timeout: Option<Duration>,
    /// Calls served at once; the next one is answered `RESOURCE_EXHAUSTED` at once
    /// instead of queueing without bound. Health checks do not count.
    pub concurrency_limit: usize,
    /// Time in-flight calls get to finish after shutdown starts; calls still running
    /// then are answered `UNAVAILABLE` and the server returns.
    #[serde(with = "crate::config::duration")]
    pub shutdown_grace: Duration,
}

impl Default for ServerSettings {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from((Ipv4Addr::LOCALHOST, 0)),
            max_message_bytes: DEFAULT_MAX_MESSAGE_BYTES,
            request_timeout: Some(DEFAULT_REQUEST_TIMEOUT),
            concurrency_limit: DEFAULT_CONCURRENCY_LIMIT,
            shutdown_grace: DEFAULT_SHUTDOWN_GRACE,
        }
    }
}

impl ServerSettings {
    /// Default settings listening on `127.0.0.1:<port>`: a service's `Default` uses this
    /// with its well-known port.
    pub fn on_port(port: u16) -> Self {
        Self {
            listen: SocketAddr::from((Ipv4Addr::LOCALHOST, port)),
            ..Self::default()
        }
    }

    /// Checks the values that would make a server useless or misbehave.
    ///
    /// # Errors
    ///
    /// A [`SettingsError`] naming the field and what to set it to.
    pub fn validate(&self) -> Result<(), SettingsError> {
        if self.max_message_bytes == 0 {
            return Err(SettingsError {
                field: "max_message_bytes",
                reason: "must be at least 1 byte (the default is 4194304, 4 MiB)",
            });
        }
        if self.concurrency_limit == 0 {
            return Err(SettingsError {
                field: "concurrency_limit",
                reason: "must be at least 1, or every call would be refused",
            });
        }
        if self.request_timeout == Some(Duration::ZERO) {
            return Err(SettingsError {
                field: "request_timeout",
                reason: "must be longer than 0s; write \"off\" to disable the timeout",
            });
        }
        Ok(())
    }
}

/// A [`ServerSettings`] value that cannot work.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("invalid server.{field}: {reason}")]
pub struct SettingsError {
    /// The field, relative to the `server` section.
    pub field: &'static str,
    /// What is wrong and what to do instead.
    pub reason: &'static str,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid_and_documented_values() {
        let settings = ServerSettings::default();
        assert_eq!(settings.validate(), Ok(()));
        assert_eq!(settings.max_message_bytes, 4 * 1024 * 1024);
        assert_eq!(settings.request_timeout, Some(Duration::from_secs(30)));
        assert!(settings.listen.ip().is_loopback());
        assert_eq!(ServerSettings::on_port(7001).listen.port(), 7001);
    }

    #[test]
    fn validate_names_the_bad_field() {
        let zero_limit = ServerSettings {
            concurrency_limit: 0,
            ..ServerSettings::default()
        };
        let err = zero_limit.validate().unwrap_err();
        assert_eq!(err.field, "concurrency_limit");
        assert!(
            err.to_string()
                .starts_with("invalid server.concurrency_limit")
        );

        let zero_timeout = ServerSettings {
            request_timeout: Some(Duration::ZERO),
            ..ServerSettings::default()
        };
        assert_eq!(
            zero_timeout.validate().unwrap_err().field,
            "request_timeout"
        );

        let zero_size = ServerSettings {
            max_message_bytes: 0,
            ..ServerSettings::default()
        };
        assert_eq!(zero_size.validate().unwrap_err().field, "max_message_bytes");

        let no_timeout = ServerSettings {
            request_timeout: None,
            ..ServerSettings::default()
        };
        assert_eq!(no_timeout.validate(), Ok(()));
    }
}
