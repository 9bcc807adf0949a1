//! The evidence store's configuration.
//!
//! `Config::default()` is the development setup of the payment-incident example:
//! artifacts under `./.convene/artifacts`, the policy service on its default local port,
//! the example policy built into the binary (its principals may read evidence with role
//! `evidence:read`), development credentials in `./.convene/credentials`.

use std::path::PathBuf;

use convene_mesh::policy_file::PolicySource;
use convene_server::{ServerSettings, ServiceCommon};
use serde::{Deserialize, Serialize};

/// The port the evidence store listens on by default.
pub const DEFAULT_PORT: u16 = 7402;

/// The default data directory.
pub const DEFAULT_DATA_DIR: &str = convene_server::DEFAULT_DATA_DIR;

/// The default largest artifact: 4 MiB.
pub const DEFAULT_MAX_ARTIFACT_BYTES: usize = 4 * 1024 * 1024;

/// The default policy service endpoint, whose public keys verify task tokens.
pub const DEFAULT_POLICY_ENDPOINT: &str = "http://127.0.0.1:7401";

/// Room for the fields around an artifact's bytes in a request (media type, evidence
/// record). The store's own message limit is `max_artifact_bytes` plus this, so an
/// artifact slightly over the limit still reaches the service and is refused with a
/// message that names `max_artifact_bytes`, instead of a transport error.
pub const ENVELOPE_ALLOWANCE: usize = 1024 * 1024;

/// Configuration of the evidence store. The shared keys are in
/// [`common`](Self::common), which the config also derefs to: the server (listening on
/// `127.0.0.1:7402` by default; its `max_message_bytes` does not bound this service's own
/// messages, `max_artifact_bytes` does, plus room for the other fields); the data
/// directory (artifact bytes in `<data_dir>/artifacts/<tenant>/<sha256>`); the policy
/// file, whose principals may read evidence with their own credential when they hold
/// role `evidence:read`; and `database_url`, where artifact metadata and evidence
/// records are stored (the bytes stay in the artifacts directory either way).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// The keys every service that reads the policy file shares.
    #[serde(flatten)]
    pub common: ServiceCommon,
    /// Largest artifact accepted, in bytes.
    pub max_artifact_bytes: usize,
    /// The policy service, whose signing keys verify task tokens offline.
    pub policy_endpoint: String,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            common: ServiceCommon::new(ServerSettings::on_port(DEFAULT_PORT)),
            max_artifact_bytes: DEFAULT_MAX_ARTIFACT_BYTES,
            policy_endpoint: DEFAULT_POLICY_ENDPOINT.to_owned(),
        }
    }
}

convene_server::common_section!(Config);

impl Config {
    /// Development settings with the data kept under `data_dir`.
    pub fn in_dir(data_dir: impl Into<PathBuf>) -> Self {
        Self {
            common: ServiceCommon {
                data_dir: data_dir.into(),
                ..Self::default().common
            },
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

    /// Where the policy comes from: `policy_file` (unset: the embedded example), with
    /// development credentials in `<data_dir>/credentials` when `dev_credentials` is on.
    pub fn policy_source(&self) -> PolicySource {
        PolicySource::new(self.policy_file.clone(), self.dev_credentials_dir())
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
        assert_eq!(config.policy_file, None);
        assert!(config.dev_credentials);
        assert_eq!(
            config.policy_source().name(),
            convene_mesh::policy_file::EXAMPLE_POLICY_NAME
        );
    }

    #[test]
    fn the_example_policy_lets_its_people_read_evidence() {
        let config = Config {
            common: ServiceCommon {
                dev_credentials: false,
                ..Config::in_dir("/nonexistent").common
            },
            ..Config::default()
        };
        let (policy, _) = config
            .policy_source()
            .load()
            .expect("the embedded example compiles");
        for id in ["oncall@acme", "alice@acme", "bob@acme", "analyst@globex"] {
            let principal = &policy.principals[id];
            assert!(
                principal.has_role(crate::READER_ROLE),
                "{id} lacks {}",
                crate::READER_ROLE
            );
        }
        // Services of the mesh read evidence with task tokens, never as principals.
        assert!(!policy.principals["worker-pool"].has_role(crate::READER_ROLE));
    }

    #[test]
    fn development_credentials_are_created_in_the_data_dir() {
        let dir = tempfile::tempdir().unwrap();
        let config = Config::in_dir(dir.path());
        let (policy, _) = config.policy_source().load().unwrap();
        let secret =
            convene_mesh::policy_file::dev_credential(&config.credentials_dir(), "oncall@acme")
                .expect("the credential file exists");
        let principal = policy
            .principal_by_credential(&secret)
            .expect("the development credential authenticates");
        assert_eq!(principal.id, "oncall@acme");

        let missing = Config {
            common: ServiceCommon {
                policy_file: Some(dir.path().join("absent.yaml")),
                ..Config::in_dir(dir.path()).common
            },
            ..Config::default()
        };
        let err = missing.policy_source().load().unwrap_err();
        assert!(err.to_string().contains("absent.yaml"), "{err}");
    }

    #[test]
    fn env_overrides_and_unknown_keys() {
        let config: Config = convene_server::ConfigLoader::new()
            .env([
                ("CONVENE_DATA_DIR", "/data"),
                ("CONVENE_MAX_ARTIFACT_BYTES", "1024"),
                ("CONVENE_POLICY_ENDPOINT", "http://policy:7401"),
                ("CONVENE_POLICY_FILE", "/etc/convene/policy.yaml"),
                ("CONVENE_DEV_CREDENTIALS", "false"),
            ])
            .load()
            .unwrap();
        assert_eq!(config.data_dir, PathBuf::from("/data"));
        assert_eq!(config.max_artifact_bytes, 1024);
        assert_eq!(config.policy_endpoint, "http://policy:7401");
        assert_eq!(
            config.policy_file,
            Some(PathBuf::from("/etc/convene/policy.yaml"))
        );
        assert!(!config.dev_credentials);
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
