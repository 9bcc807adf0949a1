//! The policy service's configuration and where it keeps its files.
//!
//! `Config::default()` is the development setup of the payment-incident example: the
//! example policy embedded in the binary, data under `./.convene`, development
//! credentials generated for principals without listed hashes, and a file-backed
//! decision log. Every field can be overridden by a config file, `CONVENE_*`
//! environment variables or flags (see `convene_server::config`).

use std::path::PathBuf;

use convene_mesh::policy_file::PolicySource;
use convene_server::{ServerSettings, ServiceCommon};
use serde::{Deserialize, Serialize};

/// The port the policy service listens on by default.
pub const DEFAULT_PORT: u16 = 7401;

/// The default data directory.
pub const DEFAULT_DATA_DIR: &str = convene_server::DEFAULT_DATA_DIR;

/// Where decisions are logged.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DecisionLogTarget {
    /// Append-only JSON lines in `<data_dir>/policy/decisions.jsonl`, fsynced in batches;
    /// a decision is answered only once its record is on disk.
    #[default]
    File,
    /// In memory only, lost at exit. For tests and throwaway setups.
    Memory,
    /// Rows of the `decision_log` table in the service's database (`database_url`),
    /// each committed before the decision is answered; in memory when `database_url` is
    /// `memory`.
    Database,
}

/// Configuration of the policy service. The shared keys are in
/// [`common`](Self::common), which the config also derefs to: the server (listening on
/// `127.0.0.1:7401` by default); the data directory (signing keys in `policy/keys`, the
/// decision log in `policy/decisions.jsonl`, development credentials in `credentials`);
/// the policy file; and `database_url`, where call counters, revocations and
/// issued-token owners are kept (and decisions, with `decision_log = "database"`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// The keys every service that reads the policy file shares.
    #[serde(flatten)]
    pub common: ServiceCommon,
    /// Where decisions are logged.
    pub decision_log: DecisionLogTarget,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            common: ServiceCommon::new(ServerSettings::on_port(DEFAULT_PORT)),
            decision_log: DecisionLogTarget::File,
        }
    }
}

convene_server::common_section!(Config);

impl Config {
    /// Development settings with everything kept under `data_dir` (used by tests and by
    /// `convene up` with a custom data directory).
    pub fn in_dir(data_dir: impl Into<PathBuf>) -> Self {
        Self {
            common: ServiceCommon {
                data_dir: data_dir.into(),
                ..Self::default().common
            },
            ..Self::default()
        }
    }

    /// Directory of the signing-key ring.
    pub fn keys_dir(&self) -> PathBuf {
        self.data_dir.join("policy").join("keys")
    }

    /// Path of the decision log when it is file-backed.
    pub fn decision_log_path(&self) -> PathBuf {
        self.data_dir.join("policy").join("decisions.jsonl")
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
    fn default_is_the_example_on_the_policy_port() {
        let config = Config::default();
        assert_eq!(config.server.listen.port(), DEFAULT_PORT);
        assert!(config.server.listen.ip().is_loopback());
        assert_eq!(config.data_dir, PathBuf::from("./.convene"));
        assert_eq!(
            config.decision_log_path(),
            PathBuf::from("./.convene/policy/decisions.jsonl")
        );
        assert!(config.policy_source().name().contains("embedded"));
    }

    #[test]
    fn embedded_example_compiles_without_touching_the_disk() {
        let config = Config {
            common: ServiceCommon {
                dev_credentials: false,
                ..Config::default().common
            },
            ..Config::default()
        };
        let (policy, created) = config.policy_source().load().unwrap();
        assert!(created.is_empty());
        assert!(policy.principals["supervisor"].has_role("tokens:issue"));
        assert!(policy.profiles.contains_key("logs-investigator"));
    }

    #[test]
    fn env_overrides_data_dir_and_dump_round_trips() {
        let config: Config = convene_server::ConfigLoader::new()
            .env([
                ("CONVENE_DATA_DIR", "/var/lib/convene"),
                ("CONVENE_DECISION_LOG", "memory"),
            ])
            .load()
            .unwrap();
        assert_eq!(config.data_dir, PathBuf::from("/var/lib/convene"));
        assert_eq!(config.decision_log, DecisionLogTarget::Memory);

        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("policy.toml");
        let dumped = convene_server::dump(&config, convene_server::Format::Toml).unwrap();
        std::fs::write(&file, dumped).unwrap();
        let back: Config = convene_server::ConfigLoader::new()
            .file(&file)
            .load()
            .unwrap();
        assert_eq!(back, config);
    }

    #[test]
    fn unknown_keys_are_refused() {
        let err = convene_server::ConfigLoader::new()
            .env([("CONVENE_POLICY_FLIE", "x.yaml")])
            .load::<Config>()
            .unwrap_err();
        assert!(err.to_string().contains("CONVENE_POLICY_FLIE"), "{err}");
    }
}
