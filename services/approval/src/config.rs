//! The approval service's configuration.
//!
//! [`Config::default`] is the development setup of the payment-incident example: it
//! listens on `127.0.0.1:7403`, reads the example policy embedded in the binary, keeps
//! its data (development credentials) in `./.convene`, and records approved actions
//! without performing them. Every key can be overridden by a config file, by
//! `CONVENE_*` environment variables (`CONVENE_DATA_DIR`, `CONVENE_DEFAULT_TTL`, ...) and
//! by flags, through [`convene_server::ConfigLoader`].

use std::{path::PathBuf, sync::Arc, time::Duration};

use convene_mesh::policy_file::{self, Policy, PolicyFile};
use convene_server::ServerSettings;
use serde::{Deserialize, Serialize};

/// The approval service's well-known port.
pub const DEFAULT_PORT: u16 = 7403;

/// The policy of the payment-incident example, embedded so the binary runs from any
/// directory without a policy file.
pub const EXAMPLE_POLICY: &str = include_str!("../../../examples/payment-incident/policy.yaml");

/// How the embedded example policy is named in errors and logs.
pub const EXAMPLE_POLICY_NAME: &str = "<embedded payment-incident example policy>";

/// Default data directory, relative to the working directory.
pub const DEFAULT_DATA_DIR: &str = "./.convene";

/// Default time an approval request may wait for its approvers.
pub const DEFAULT_TTL: Duration = Duration::from_secs(60 * 60);

/// Everything the approval service is configured with.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// How the gRPC server listens and protects itself.
    pub server: ServerSettings,
    /// Policy file (YAML or TOML) with the principals who may request, decide and execute,
    /// and the action catalog with risk levels. Unset: the embedded example policy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub policy_file: Option<PathBuf>,
    /// Directory for the service's data; development credentials go to
    /// `<data_dir>/credentials`.
    pub data_dir: PathBuf,
    /// Whether principals without a listed credential hash get a development credential
    /// in `<data_dir>/credentials/<principal>.secret`. Turn it off in production, where
    /// the policy file lists every credential's hash.
    pub dev_credentials: bool,
    /// Time to live of a request whose `expires_in` is 0.
    #[serde(with = "convene_server::config::duration")]
    pub default_ttl: Duration,
    /// What executes approved actions.
    pub executor: ExecutorKind,
    /// Where approval requests are stored: `sqlite://<path>` or `postgres://...`; unset:
    /// the SQLite file `<data_dir>/convene.db`; `memory`: in memory, lost at exit.
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
            default_ttl: DEFAULT_TTL,
            executor: ExecutorKind::RecordOnly,
            database_url: None,
        }
    }
}

/// The executors the service can be configured with.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ExecutorKind {
    /// Performs nothing and records that the approved action would have run
    /// ([`RecordOnlyExecutor`](crate::RecordOnlyExecutor)).
    #[default]
    RecordOnly,
}

impl ExecutorKind {
    /// The name used in config files and execution records.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::RecordOnly => crate::executor::RecordOnlyExecutor::NAME,
        }
    }
}

/// Why the configuration cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// `default_ttl` is zero, so every request would be born expired.
    #[error("invalid default_ttl: must be longer than 0s, e.g. \"1h\"")]
    ZeroTtl,
    /// The policy file cannot be loaded.
    #[error(transparent)]
    Policy(#[from] policy_file::Error),
    /// The database named by `database_url` cannot be opened.
    #[error(transparent)]
    Database(#[from] convene_store::Error),
}

impl Config {
    /// Where development credentials are kept: `<data_dir>/credentials`.
    pub fn credentials_dir(&self) -> PathBuf {
        self.data_dir.join("credentials")
    }

    /// Checks the values that would make the service useless.
    ///
    /// # Errors
    ///
    /// [`ConfigError::ZeroTtl`] for a zero `default_ttl`.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.default_ttl.is_zero() {
            return Err(ConfigError::ZeroTtl);
        }
        Ok(())
    }

    /// Loads the configured policy (the embedded example when `policy_file` is unset)
    /// and, when `dev_credentials` is on, gives principals without a listed credential a
    /// development credential under [`credentials_dir`](Self::credentials_dir).
    ///
    /// # Errors
    ///
    /// The policy file cannot be read, does not parse or is invalid, or the credentials
    /// directory cannot be written.
    pub fn load_policy(&self) -> Result<Arc<Policy>, ConfigError> {
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
    use convene_server::ConfigLoader;

    use super::*;

    #[test]
    fn defaults_are_the_development_settings() {
        let config = Config::default();
        assert_eq!(config.server.listen.port(), DEFAULT_PORT);
        assert!(config.server.listen.ip().is_loopback());
        assert_eq!(config.default_ttl, Duration::from_secs(3600));
        assert_eq!(config.executor, ExecutorKind::RecordOnly);
        assert!(config.dev_credentials);
        assert_eq!(
            config.credentials_dir(),
            PathBuf::from("./.convene/credentials")
        );
        config.validate().expect("the defaults are valid");
    }

    #[test]
    fn environment_overrides_data_dir_and_ttl() {
        let config: Config = ConfigLoader::new()
            .env([
                ("CONVENE_DATA_DIR", "/var/lib/convene"),
                ("CONVENE_DEFAULT_TTL", "15m"),
                ("CONVENE_EXECUTOR", "record-only"),
            ])
            .load()
            .expect("valid environment");
        assert_eq!(config.data_dir, PathBuf::from("/var/lib/convene"));
        assert_eq!(config.default_ttl, Duration::from_secs(900));
    }

    #[test]
    fn unknown_keys_and_executors_are_refused() {
        let err = ConfigLoader::new()
            .env([("CONVENE_DEFAULT_TTLL", "15m")])
            .load::<Config>()
            .unwrap_err();
        assert!(err.to_string().contains("CONVENE_DEFAULT_TTLL"), "{err}");
        let err = ConfigLoader::new()
            .env([("CONVENE_EXECUTOR", "shell")])
            .load::<Config>()
            .unwrap_err();
        assert!(err.to_string().contains("record-only"), "{err}");
    }

    #[test]
    fn zero_ttl_is_refused() {
        let config = Config {
            default_ttl: Duration::ZERO,
            ..Config::default()
        };
        assert!(matches!(config.validate(), Err(ConfigError::ZeroTtl)));
    }

    #[test]
    fn embedded_policy_loads_with_dev_credentials() {
        let dir = tempfile::tempdir().unwrap();
        let config = Config {
            data_dir: dir.path().to_owned(),
            ..Config::default()
        };
        let policy = config.load_policy().expect("the example policy loads");
        assert!(policy.principals.contains_key("alice@acme"));
        let secret = policy_file::dev_credential(&config.credentials_dir(), "alice@acme").unwrap();
        assert_eq!(
            policy
                .principal_by_credential(&secret)
                .map(|p| p.id.as_str()),
            Some("alice@acme")
        );
    }
}
