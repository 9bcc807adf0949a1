//! The evidence store's configuration.
//!
//! `Config::default()` is the development setup of the payment-incident example:
//! artifacts under `./.convene/artifacts`, the policy service on its default local port,
//! the example policy built into the binary (its principals may read evidence with role
//! `evidence:read`), development credentials in `./.convene/credentials`.

use std::path::PathBuf;
use std::sync::Arc;

use convene_mesh::policy_file::{self, Policy, PolicyFile};
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

/// The policy of the payment-incident example, embedded so the binary runs from any
/// directory without a policy file.
pub const EXAMPLE_POLICY: &str = include_str!("../../../examples/payment-incident/policy.yaml");

/// How the embedded example policy is named in errors and logs.
pub const EXAMPLE_POLICY_NAME: &str = "<embedded payment-incident example policy>";

/// Configuration of the evidence store.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// The gRPC server (listens on `127.0.0.1:7402` by default). Its
    /// `max_message_bytes` does not bound this service's own messages: those are bounded
    /// by `max_artifact_bytes` (plus room for the other fields).
    pub server: ServerSettings,
    /// Policy file (YAML or TOML) whose principals may read evidence with their own
    /// credential when they hold role `evidence:read`. Unset: the embedded example policy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub policy_file: Option<PathBuf>,
    /// Data directory: artifact bytes in `<data_dir>/artifacts/<tenant>/<sha256>`,
    /// development credentials in `<data_dir>/credentials`.
    pub data_dir: PathBuf,
    /// Whether principals without a listed credential hash get a development credential
    /// in `<data_dir>/credentials/<principal>.secret` (the same files the other services
    /// of the mesh use). Turn it off in production, where the policy file lists every
    /// credential's hash.
    pub dev_credentials: bool,
    /// Largest artifact accepted, in bytes.
    pub max_artifact_bytes: usize,
    /// The policy service, whose signing keys verify task tokens offline.
    pub policy_endpoint: String,
    /// Where artifact metadata and evidence records are stored: `sqlite://<path>` or
    /// `postgres://...`; unset: the SQLite file `<data_dir>/convene.db`; `memory`: in
    /// memory, lost at exit (the bytes stay in `artifacts_dir` either way).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub database_url: Option<String>,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            server: ServerSettings::on_port(DEFAULT_PORT),
            policy_file: None,
            data_dir: PathBuf::from(DEFAULT_DATA_DIR),
            dev_credentials: true,
            max_artifact_bytes: DEFAULT_MAX_ARTIFACT_BYTES,
            policy_endpoint: DEFAULT_POLICY_ENDPOINT.to_owned(),
            database_url: None,
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

    /// Where development credentials are kept: `<data_dir>/credentials`.
    pub fn credentials_dir(&self) -> PathBuf {
        self.data_dir.join("credentials")
    }

    /// The policy file in effect, as named in logs.
    pub fn policy_source(&self) -> String {
        self.policy_file.as_deref().map_or_else(
            || EXAMPLE_POLICY_NAME.to_owned(),
            |p| p.display().to_string(),
        )
    }

    /// Loads the configured policy (the embedded example when `policy_file` is unset)
    /// and, when `dev_credentials` is on, gives principals without a listed credential a
    /// development credential under [`credentials_dir`](Self::credentials_dir).
    ///
    /// # Errors
    ///
    /// The policy file cannot be read, does not parse or is invalid (the error names the
    /// file and the field), or the credentials directory cannot be written.
    pub fn load_policy(&self) -> Result<Arc<Policy>, policy_file::Error> {
        let mut policy = match &self.policy_file {
            Some(path) => Policy::load(path)?,
            None => PolicyFile::parse(EXAMPLE_POLICY, Some("yaml"), EXAMPLE_POLICY_NAME)?
                .compile(EXAMPLE_POLICY_NAME)?,
        };
        if self.dev_credentials {
            let dir = self.credentials_dir();
            let created = policy.with_dev_credentials(&dir)?;
            if !created.is_empty() {
                tracing::info!(
                    dir = %dir.display(),
                    principals = ?created,
                    "development credentials in use, one <principal>.secret file each"
                );
            }
        }
        Ok(Arc::new(policy))
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
        assert_eq!(config.policy_source(), EXAMPLE_POLICY_NAME);
    }

    #[test]
    fn the_example_policy_lets_its_people_read_evidence() {
        let config = Config {
            dev_credentials: false,
            ..Config::in_dir("/nonexistent")
        };
        let policy = config.load_policy().expect("the embedded example compiles");
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
        let policy = config.load_policy().unwrap();
        let secret = policy_file::dev_credential(&config.credentials_dir(), "oncall@acme")
            .expect("the credential file exists");
        let principal = policy
            .principal_by_credential(&secret)
            .expect("the development credential authenticates");
        assert_eq!(principal.id, "oncall@acme");

        let missing = Config {
            policy_file: Some(dir.path().join("absent.yaml")),
            ..Config::in_dir(dir.path())
        };
        let err = missing.load_policy().unwrap_err();
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
