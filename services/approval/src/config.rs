//! The approval service's configuration.
//!
//! [`Config::default`] is the development setup of the payment-incident example: it
//! listens on `127.0.0.1:7403`, reads the example policy embedded in the binary, keeps
//! its data (development credentials) in `./.convene`, and records approved actions
//! without performing them. Every key can be overridden by a config file, by
//! `CONVENE_*` environment variables (`CONVENE_DATA_DIR`, `CONVENE_DEFAULT_TTL`, ...) and
//! by flags, through [`convene_server::ConfigLoader`].

use std::time::Duration;

use convene_mesh::policy_file::{self, PolicySource};
use convene_server::{ServerSettings, ServiceCommon};
use serde::{Deserialize, Serialize};

/// The approval service's well-known port.
pub const DEFAULT_PORT: u16 = 7403;

/// Default data directory, relative to the working directory.
pub const DEFAULT_DATA_DIR: &str = convene_server::DEFAULT_DATA_DIR;

/// Default time an approval request may wait for its approvers.
pub const DEFAULT_TTL: Duration = Duration::from_secs(60 * 60);

/// Default time between two sweeps that record pending requests past their expiry as
/// expired.
pub const DEFAULT_EXPIRY_SWEEP_INTERVAL: Duration = Duration::from_secs(1);

/// Everything the approval service is configured with. The shared keys (`server`,
/// `data_dir`, `policy_file`, `dev_credentials`, `database_url`) are in
/// [`common`](Self::common), which the config also derefs to: its `policy_file` holds
/// the principals who may request, decide and execute and the action catalog with risk
/// levels; its `database_url` says where approval requests are stored.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// The keys every service that reads the policy file shares.
    #[serde(flatten)]
    pub common: ServiceCommon,
    /// Time to live of a request whose `expires_in` is 0.
    #[serde(with = "convene_server::config::duration")]
    pub default_ttl: Duration,
    /// What executes approved actions.
    pub executor: ExecutorKind,
    /// Time between two sweeps that record pending requests past their expiry as
    /// expired (with their `expired` event).
    #[serde(with = "convene_server::config::duration")]
    pub expiry_sweep_interval: Duration,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            common: ServiceCommon::new(ServerSettings::on_port(DEFAULT_PORT)),
            default_ttl: DEFAULT_TTL,
            executor: ExecutorKind::RecordOnly,
            expiry_sweep_interval: DEFAULT_EXPIRY_SWEEP_INTERVAL,
        }
    }
}

convene_server::common_section!(Config);

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
    /// `expiry_sweep_interval` is zero, so the sweep would never pause.
    #[error("invalid expiry_sweep_interval: must be longer than 0s, e.g. \"1s\"")]
    ZeroSweepInterval,
    /// The policy file cannot be loaded.
    #[error(transparent)]
    Policy(#[from] policy_file::Error),
    /// The database named by `database_url` cannot be opened.
    #[error(transparent)]
    Database(#[from] convene_store::Error),
}

impl Config {
    /// Where the policy comes from: `policy_file` (unset: the embedded example), with
    /// development credentials in `<data_dir>/credentials` when `dev_credentials` is on.
    pub fn policy_source(&self) -> PolicySource {
        PolicySource::new(self.policy_file.clone(), self.dev_credentials_dir())
    }

    /// Checks the values that would make the service useless.
    ///
    /// # Errors
    ///
    /// [`ConfigError::ZeroTtl`] for a zero `default_ttl`,
    /// [`ConfigError::ZeroSweepInterval`] for a zero `expiry_sweep_interval`.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.default_ttl.is_zero() {
            return Err(ConfigError::ZeroTtl);
        }
        if self.expiry_sweep_interval.is_zero() {
            return Err(ConfigError::ZeroSweepInterval);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use convene_server::ConfigLoader;

    use super::*;

    #[test]
    fn defaults_are_the_development_settings() {
        let config = Config::default();
        assert_eq!(config.server.listen.port(), DEFAULT_PORT);
        assert!(config.server.listen.ip().is_loopback());
        assert_eq!(config.default_ttl, Duration::from_secs(3600));
        assert_eq!(config.expiry_sweep_interval, Duration::from_secs(1));
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
                ("CONVENE_EXPIRY_SWEEP_INTERVAL", "250ms"),
            ])
            .load()
            .expect("valid environment");
        assert_eq!(config.data_dir, PathBuf::from("/var/lib/convene"));
        assert_eq!(config.default_ttl, Duration::from_secs(900));
        assert_eq!(config.expiry_sweep_interval, Duration::from_millis(250));
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
        let config = Config {
            expiry_sweep_interval: Duration::ZERO,
            ..Config::default()
        };
        assert!(matches!(
            config.validate(),
            Err(ConfigError::ZeroSweepInterval)
        ));
    }

    #[test]
    fn embedded_policy_loads_with_dev_credentials() {
        let dir = tempfile::tempdir().unwrap();
        let config = Config {
            common: ServiceCommon {
                data_dir: dir.path().to_owned(),
                ..Config::default().common
            },
            ..Config::default()
        };
        let (policy, _) = config
            .policy_source()
            .load()
            .expect("the example policy loads");
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
