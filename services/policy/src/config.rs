//! The policy service's configuration and where it keeps its files.
//!
//! `Config::default()` is the development setup of the payment-incident example: the
//! example policy embedded in the binary, data under `./.convene`, development
//! credentials generated for principals without listed hashes, and a file-backed
//! decision log. Every field can be overridden by a config file, `CONVENE_*`
//! environment variables or flags (see `convene_server::config`).

use std::path::PathBuf;

use convene_mesh::policy_file::{Policy, PolicyFile};
use convene_server::ServerSettings;
use serde::{Deserialize, Serialize};

use crate::Error;

/// The port the policy service listens on by default.
pub const DEFAULT_PORT: u16 = 7401;

/// The default data directory.
pub const DEFAULT_DATA_DIR: &str = "./.convene";

/// The policy file of the payment-incident example, embedded so the binary works from
/// any directory.
pub const EXAMPLE_POLICY: &str = include_str!("../../../examples/payment-incident/policy.yaml");

/// How the embedded example is named in errors and logs.
pub const EXAMPLE_POLICY_NAME: &str = "<embedded payment-incident example policy>";

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

/// Configuration of the policy service.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// The gRPC server (listens on `127.0.0.1:7401` by default).
    pub server: ServerSettings,
    /// Data directory: signing keys in `policy/keys`, the decision log in
    /// `policy/decisions.jsonl`, development credentials in `credentials`.
    pub data_dir: PathBuf,
    /// Policy file (YAML or TOML). Unset: the embedded payment-incident example.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub policy_file: Option<PathBuf>,
    /// Give principals without a listed credential hash a development credential,
    /// written to `<data_dir>/credentials/<principal>.secret`. Turn it off in production,
    /// where the policy file lists every credential's sha256.
    pub dev_credentials: bool,
    /// Where decisions are logged.
    pub decision_log: DecisionLogTarget,
    /// Where call counters, revocations and issued-token owners are kept (and decisions,
    /// with `decision_log = "database"`): `sqlite://<path>` or `postgres://...`; unset:
    /// the SQLite file `<data_dir>/convene.db`; `memory`: in memory, lost at exit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub database_url: Option<String>,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            server: ServerSettings::on_port(DEFAULT_PORT),
            data_dir: PathBuf::from(DEFAULT_DATA_DIR),
            policy_file: None,
            dev_credentials: true,
            decision_log: DecisionLogTarget::File,
            database_url: None,
        }
    }
}

impl Config {
    /// Development settings with everything kept under `data_dir` (used by tests and by
    /// `convene up` with a custom data directory).
    pub fn in_dir(data_dir: impl Into<PathBuf>) -> Self {
        Self {
            data_dir: data_dir.into(),
            ..Self::default()
        }
    }

    /// Directory of the signing-key ring.
    pub fn keys_dir(&self) -> PathBuf {
        self.data_dir.join("policy").join("keys")
    }

    /// Directory of the development credentials.
    pub fn credentials_dir(&self) -> PathBuf {
        self.data_dir.join("credentials")
    }

    /// Path of the decision log when it is file-backed.
    pub fn decision_log_path(&self) -> PathBuf {
        self.data_dir.join("policy").join("decisions.jsonl")
    }

    /// How the policy file is named in logs: its path, or the embedded example.
    pub fn policy_source(&self) -> String {
        self.policy_file.as_deref().map_or_else(
            || EXAMPLE_POLICY_NAME.to_owned(),
            |p| p.display().to_string(),
        )
    }

    /// Loads and compiles the policy file (or the embedded example), then, when
    /// `dev_credentials` is on, gives principals without a listed credential a
    /// development credential. Returns the policy and the principals that received one.
    ///
    /// # Errors
    ///
    /// [`Error::PolicyFile`] naming the file and the offending field, or the credentials
    /// directory that cannot be written.
    pub fn load_policy(&self) -> Result<(Policy, Vec<String>), Error> {
        let mut policy = match &self.policy_file {
            Some(path) => Policy::load(path)?,
            None => PolicyFile::parse(EXAMPLE_POLICY, Some("yaml"), EXAMPLE_POLICY_NAME)?
                .compile(EXAMPLE_POLICY_NAME)?,
        };
        let created = if self.dev_credentials {
            policy.with_dev_credentials(&self.credentials_dir())?
        } else {
            Vec::new()
        };
        Ok((policy, created))
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
        assert!(config.policy_source().contains("embedded"));
    }

    #[test]
    fn embedded_example_compiles_without_touching_the_disk() {
        let config = Config {
            dev_credentials: false,
            ..Config::default()
        };
        let (policy, created) = config.load_policy().unwrap();
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
