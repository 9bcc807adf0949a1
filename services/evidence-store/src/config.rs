//! The evidence store's configuration.
//!
//! `Config::default()` is the development setup of the payment-incident example:
//! artifacts under `./.convene/artifacts`, the policy service on its default local port.

use std::path::PathBuf;

use convene_server::ServerSettings;
use serde::{Deserialize, Serialize};

/// The port the evidence store listens on by default.
pub const DEFAULT_PORT: u16 = 7402;

/// The default data directory.
pub const DEFAULT_DATA_DIR: &str = "./.convene";

/// The default largest artifact: 4 MiB.
pub const DEFAULT_MAX_ARTIFACT_BYTES: usize = 4 * 1024 * 1024;

/// The default policy service endpoint, whose public keys verify task tokens.
pub const DEFAULT_POLICY_ENDPOINT: &str = "http://127.0.0.1:7401";

/// Room for the fields around an artifact's bytes in a request (media type, evidence
/// record). The store's own message limit is `max_artifact_bytes` plus this, so an
/// artifact slightly over the limit still reaches the service and is refused with a
/// message that names `max_artifact_bytes`, instead of a transport error.
pub const ENVELOPE_ALLOWANCE: usize = 1024 * 1024;

/// Configuration of the evidence store.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// The gRPC server (listens on `127.0.0.1:7402` by default). Its
    /// `max_message_bytes` does not bound this service's own messages: those are bounded
    /// by `max_artifact_bytes` (plus room for the other fields).
    pub server: ServerSettings,
    /// Data directory: artifact bytes in `<data_dir>/artifacts/<tenant>/<sha256>`.
    pub data_dir: PathBuf,
    /// Largest artifact accepted, in bytes.
    pub max_artifact_bytes: usize,
    /// The policy service, whose signing keys verify task tokens offline.
    pub policy_endpoint: String,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            server: ServerSettings::on_port(DEFAULT_PORT),
            data_dir: PathBuf::from(DEFAULT_DATA_DIR),
            max_artifact_bytes: DEFAULT_MAX_ARTIFACT_BYTES,
            policy_endpoint: DEFAULT_POLICY_ENDPOINT.to_owned(),
        }
    }
}

impl Config {
    /// Development settings with the data kept under `data_dir`.
    pub fn in_dir(data_dir: impl Into<PathBuf>) -> Self {
        Self {
            data_dir: data_dir.into(),
            ..Self::default()
        }
    }

    /// Where artifact bytes are kept.
    pub fn artifacts_dir(&self) -> PathBuf {
        self.data_dir.join("artifacts")
    }

    /// The largest message the store's gRPC service accepts and sends.
    pub fn message_limit(&self) -> usize {
        self.max_artifact_bytes.saturating_add(ENVELOPE_ALLOWANCE)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_the_development_settings() {
        let config = Config::default();
        assert_eq!(config.server.listen.port(), DEFAULT_PORT);
        assert_eq!(
            config.artifacts_dir(),
            PathBuf::from("./.convene/artifacts")
        );
        assert_eq!(config.max_artifact_bytes, 4 * 1024 * 1024);
        assert!(config.message_limit() > config.max_artifact_bytes);
    }

    #[test]
    fn env_overrides_and_unknown_keys() {
        let config: Config = convene_server::ConfigLoader::new()
            .env([
                ("CONVENE_DATA_DIR", "/data"),
                ("CONVENE_MAX_ARTIFACT_BYTES", "1024"),
                ("CONVENE_POLICY_ENDPOINT", "http://policy:7401"),
            ])
            .load()
            .unwrap();
        assert_eq!(config.data_dir, PathBuf::from("/data"));
        assert_eq!(config.max_artifact_bytes, 1024);
        assert_eq!(config.policy_endpoint, "http://policy:7401");
        let err = convene_server::ConfigLoader::new()
            .env([("CONVENE_MAX_ARTIFACT_BYTE", "1")])
            .load::<Config>()
            .unwrap_err();
        assert!(
            err.to_string().contains("CONVENE_MAX_ARTIFACT_BYTE"),
            "{err}"
        );
    }
}
