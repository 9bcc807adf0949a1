//! [`ServiceCommon`]: the configuration keys the services that read the policy file
//! share (`server`, `data_dir`, `policy_file`, `dev_credentials`, `database_url`).
//!
//! A service flattens it into its own config struct (`#[serde(flatten)] common:
//! ServiceCommon`), so the keys stay at the top level of config files and environment
//! variables (`data_dir`, `CONVENE_DATA_DIR`, `server.listen`, ...) exactly as when each
//! service declared them itself. The policy service, the evidence store, the approval
//! service and the supervisor flatten it; the worker reads no policy file and keeps no
//! database, so it declares its own `server` and `data_dir` instead (sharing the section
//! would add keys it has no use for, and that a config file could then set in vain).
//!
//! Load such a config with [`ConfigLoader::section`](crate::ConfigLoader::section)`::<
//! ServiceCommon>()`, so a bad value of a shared key is reported with the key's name and
//! source like any other.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::ServerSettings;

/// The data directory of the development settings, relative to the working directory.
pub const DEFAULT_DATA_DIR: &str = "./.convene";

/// The directory in the data directory where development credentials are kept.
pub const CREDENTIALS_DIR: &str = "credentials";

/// Lets a service's `Config` that flattens a [`ServiceCommon`] into its field `common`
/// be read and written as one (`config.data_dir`), with the section's keys at the top
/// level of the file as before: `convene_server::common_section!(Config);`.
#[macro_export]
macro_rules! common_section {
    ($config:ty) => {
        impl ::std::ops::Deref for $config {
            type Target = $crate::ServiceCommon;

            fn deref(&self) -> &$crate::ServiceCommon {
                &self.common
            }
        }

        impl ::std::ops::DerefMut for $config {
            fn deref_mut(&mut self) -> &mut $crate::ServiceCommon {
                &mut self.common
            }
        }
    };
}

/// The keys shared by the services that read the policy file. No
/// `deny_unknown_fields` here: the keys it does not know belong to the struct that
/// flattens it, which refuses the ones neither knows.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct ServiceCommon {
    /// How the gRPC server listens and protects itself.
    pub server: ServerSettings,
    /// Data directory; development credentials are kept in `<data_dir>/credentials`,
    /// and the default SQLite database is `<data_dir>/convene.db`.
    pub data_dir: PathBuf,
    /// Policy file (YAML or TOML): principals, profiles, the tool and action catalog
    /// and runtime rules. Unset: the embedded payment-incident example policy.
    #[serde(default)]
    pub policy_file: Option<PathBuf>,
    /// Whether principals without a listed credential hash get a development credential
    /// in `<data_dir>/credentials/<principal>.secret`. Turn it off in production, where
    /// the policy file lists every credential's hash.
    pub dev_credentials: bool,
    /// Where the service keeps its state: `sqlite://<path>` or `postgres://...`; unset:
    /// the SQLite file `<data_dir>/convene.db`; `memory`: in memory, lost at exit.
    #[serde(default)]
    pub database_url: Option<String>,
    /// How often task-token verifiers fetch the policy service's signing keys and
    /// revocations again (besides on a token naming an unknown key): a retired key or a
    /// revoked token is refused within this long.
    #[serde(with = "crate::config::duration")]
    pub key_refresh: std::time::Duration,
}

/// The default of `key_refresh`: a minute.
pub const DEFAULT_KEY_REFRESH: std::time::Duration = std::time::Duration::from_secs(60);

impl Default for ServiceCommon {
    fn default() -> Self {
        Self::new(ServerSettings::default())
    }
}

impl ServiceCommon {
    /// The development settings in use, for the log line of a binary started without
    /// `--config`: `data dir ./.convene, policy <name>, listening on 127.0.0.1:7401`.
    pub fn describe(&self, policy: &str) -> String {
        format!(
            "data dir {}, policy {policy}, listening on {}",
            self.data_dir.display(),
            self.server.listen
        )
    }

    /// The development settings with the server configured as `server`: data in
    /// [`DEFAULT_DATA_DIR`], the embedded example policy, development credentials on,
    /// the default database.
    pub fn new(server: ServerSettings) -> Self {
        Self {
            server,
            data_dir: PathBuf::from(DEFAULT_DATA_DIR),
            policy_file: None,
            dev_credentials: true,
            database_url: None,
            key_refresh: DEFAULT_KEY_REFRESH,
        }
    }

    /// Where development credentials are kept: `<data_dir>/credentials`.
    pub fn credentials_dir(&self) -> PathBuf {
        self.data_dir.join(CREDENTIALS_DIR)
    }

    /// The directory principals get development credentials in, when
    /// `dev_credentials` is on.
    pub fn dev_credentials_dir(&self) -> Option<PathBuf> {
        self.dev_credentials.then(|| self.credentials_dir())
    }
}
