//! The worker's configuration.
//!
//! [`Config::default`] is the development setup of the payment-incident example: listen
//! on `127.0.0.1:7410`, serve the embedded example profiles over the example data in
//! `examples/payment-incident/data`, reach the supervisor, policy service and evidence
//! store on their well-known local ports, and read the `worker-pool` credential from
//! `./.convene/credentials`. Every key can be overridden by a config file, `CONVENE_*`
//! environment variables (`CONVENE_DATA_DIR`, `CONVENE_TOOLS_DATA_DIR`, ...) and flags,
//! through [`convene_server::ConfigLoader`].
//!
//! Profiles served by a remote A2A agent (`provider: a2a`) call only what the `a2a`
//! section allows ([`crate::a2a::A2aSettings`]); both lists are empty by default, so a
//! worker calls no remote agent until its operator says which:
//!
//! ```toml
//! [a2a]
//! # URL prefixes the profiles' agents (and the interfaces their cards name) must match:
//! # scheme, host and port exactly, the path segment by segment.
//! allow = ["https://agents.example.com", "https://partner.example.org/a2a"]
//! # Loopback, private, link-local and other special-purpose addresses (IPv4 and IPv6)
//! # are refused unless listed here, as addresses or CIDRs.
//! allow_private = ["10.20.0.0/16"]
//! ```
//!
//! In the environment: `CONVENE_A2A__ALLOW='[https://agents.example.com]'`,
//! `CONVENE_A2A__ALLOW_PRIVATE='[10.20.0.0/16]'`.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use convene_server::ServerSettings;
use serde::{Deserialize, Serialize};

use convene_mesh::handles::PolicyHandle;

use crate::Error;
use crate::profiles::{self, Profile};
use crate::tools::ToolRegistry;
use crate::tools::mcp::{CATALOG_PATIENCE, Catalog, McpConfig, McpTools};

/// The worker's well-known port.
pub const DEFAULT_PORT: u16 = 7410;
/// Default time an Execute call may take: it runs for the whole task, so the server's
/// usual 30 s would cut investigations short. Task deadlines bound it in practice.
pub const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(15 * 60);
/// Default data directory, relative to the working directory.
pub const DEFAULT_DATA_DIR: &str = "./.convene";
/// Default directory of the tools' data, relative to the working directory.
pub const DEFAULT_TOOLS_DATA_DIR: &str = "examples/payment-incident/data";
/// Default delegations run at once.
pub const DEFAULT_CAPACITY: u32 = 16;
/// The principal whose credential workers register with.
pub const WORKER_POOL_PRINCIPAL: &str = "worker-pool";
/// A supervisor serves its worker registry on an internal listener at its client port
/// plus this by default (`convene_supervisor::INTERNAL_PORT_OFFSET`): 7500 beside 7400.
pub const REGISTRY_PORT_OFFSET: u16 = 100;

/// Everything a worker is configured with.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// How the gRPC server listens; `request_timeout` must cover a whole task (or be
    /// `"off"`).
    pub server: ServerSettings,
    /// This worker's id, stable across re-registrations. Default: `<hostname>-<pid>`.
    pub worker_id: String,
    /// Endpoint the supervisor dispatches to. Unset: derived from the bound address
    /// (the host name when listening on all interfaces).
    #[serde(default)]
    pub advertise: Option<String>,
    /// Profiles file (YAML). Unset: the embedded payment-incident example profiles.
    #[serde(default)]
    pub profiles_file: Option<PathBuf>,
    /// Directory the read-only tools query: `logs/<service>.jsonl`,
    /// `metrics/<metric>.json`, `changes/changes.json`.
    pub tools_data_dir: PathBuf,
    /// Delegations run at once; one more is refused as "worker busy".
    pub capacity: u32,
    /// Whether to register with the supervisor's worker registry.
    pub register: bool,
    /// The supervisor: its worker registry, and its Delegate for `delegate@1`.
    pub supervisor_endpoint: String,
    /// The worker registries to register with: each supervisor's internal listener
    /// (every supervisor replica keeps its own registry). A URL whose host is a name (a
    /// headless Service) stands for every address it resolves to, resolved again every
    /// 10 s. Empty: `supervisor_endpoint`'s host at its port + 100, where a supervisor
    /// serves its registry by default (http://127.0.0.1:7500).
    pub registry_endpoints: Vec<String>,
    /// The policy service.
    pub policy_endpoint: String,
    /// The evidence store.
    pub evidence_endpoint: String,
    /// Data directory; the development `worker-pool` credential is
    /// `<data_dir>/credentials/worker-pool.secret`.
    pub data_dir: PathBuf,
    /// File holding the `worker-pool` credential. Unset: the development credential in
    /// the data directory (created if absent, shared with the other services there).
    #[serde(default)]
    pub credential_file: Option<PathBuf>,
    /// Model of every profile whose provider is `openai`, over the profiles' own. Unset:
    /// the `CONVENE_MODEL` variable, if set.
    #[serde(default)]
    pub model: Option<String>,
    /// Retries, timeout, prices and span content of model calls.
    pub models: crate::models::ModelSettings,
    /// MCP servers whose tools the worker mounts, those the tool catalog declares (see
    /// [`crate::tools::mcp`]). Their catalog entries are read from the policy service
    /// with the `worker-pool` credential.
    pub mcp: McpConfig,
    /// The remote A2A agents `a2a` profiles may call: URL prefixes (`allow`) and the
    /// non-public addresses the worker may connect to (`allow_private`, addresses or
    /// CIDRs). Empty: none.
    pub a2a: crate::a2a::A2aSettings,
    /// How often the policy service's signing keys and revocations are fetched again
    /// (besides on a token naming an unknown key): a retired key or a revoked token is
    /// refused within this long.
    #[serde(with = "convene_server::config::duration")]
    pub key_refresh: std::time::Duration,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            server: ServerSettings {
                request_timeout: Some(DEFAULT_REQUEST_TIMEOUT),
                ..ServerSettings::on_port(DEFAULT_PORT)
            },
            worker_id: default_worker_id(),
            advertise: None,
            profiles_file: None,
            tools_data_dir: PathBuf::from(DEFAULT_TOOLS_DATA_DIR),
            capacity: DEFAULT_CAPACITY,
            register: true,
            supervisor_endpoint: "http://127.0.0.1:7400".to_owned(),
            registry_endpoints: Vec::new(),
            policy_endpoint: "http://127.0.0.1:7401".to_owned(),
            evidence_endpoint: "http://127.0.0.1:7402".to_owned(),
            data_dir: PathBuf::from(DEFAULT_DATA_DIR),
            credential_file: None,
            model: None,
            models: crate::models::ModelSettings::default(),
            mcp: McpConfig::default(),
            a2a: crate::a2a::A2aSettings::default(),
            key_refresh: convene_mesh::auth::DEFAULT_KEY_REFRESH,
        }
    }
}

/// `<hostname>-<pid>`: unique among the workers of one host and readable in logs.
pub fn default_worker_id() -> String {
    let host = std::env::var("HOSTNAME")
        .ok()
        .or_else(|| std::fs::read_to_string("/proc/sys/kernel/hostname").ok())
        .map(|h| h.trim().to_owned())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "worker".to_owned());
    format!("{host}-{}", std::process::id())
}

impl Config {
    /// Where development credentials are kept: `<data_dir>/credentials`.
    pub fn credentials_dir(&self) -> PathBuf {
        self.data_dir.join("credentials")
    }

    /// Checks the values that would make the worker useless.
    ///
    /// # Errors
    ///
    /// [`Error::Config`] naming the key.
    pub fn validate(&self) -> Result<(), Error> {
        self.server
            .validate()
            .map_err(|e| Error::Config(e.to_string()))?;
        if self.capacity == 0 {
            return Err(Error::Config(
                "capacity must be at least 1 (delegations run at once)".into(),
            ));
        }
        self.mcp.validate().map_err(Error::Config)?;
        self.models.validate().map_err(Error::Config)?;
        self.a2a.allowlist().map_err(Error::Config)?;
        if self.worker_id.trim().is_empty() {
            return Err(Error::Config(
                "worker_id must not be empty; leave it unset for <hostname>-<pid>".into(),
            ));
        }
        for url in &self.registry_endpoints {
            let parsed: Result<tonic::transport::Uri, _> = url.parse();
            if !parsed.is_ok_and(|u| u.scheme().is_some() && u.host().is_some()) {
                return Err(Error::Config(format!(
                    "registry_endpoints: `{url}` is not a URL; give each supervisor's \
                     registry (its internal listener) as http://host:port, e.g. \
                     http://convene-supervisor-peers:7500"
                )));
            }
        }
        Ok(())
    }

    /// The registries to register with: `registry_endpoints`, else the supervisor's
    /// default internal listener, `supervisor_endpoint`'s host at its port +
    /// [`REGISTRY_PORT_OFFSET`] (`supervisor_endpoint` itself when that cannot be
    /// worked out: registering there then fails and says so).
    pub fn registry_urls(&self) -> Vec<String> {
        if !self.registry_endpoints.is_empty() {
            return self.registry_endpoints.clone();
        }
        let supervisor = &self.supervisor_endpoint;
        let derived = supervisor
            .parse::<tonic::transport::Uri>()
            .ok()
            .and_then(|uri| {
                let scheme = uri.scheme_str()?;
                let port = uri.port_u16().or(match scheme {
                    "http" => Some(80),
                    "https" => Some(443),
                    _ => None,
                })?;
                let port = port.checked_add(REGISTRY_PORT_OFFSET)?;
                Some(format!("{scheme}://{}:{port}", uri.host()?))
            });
        vec![derived.unwrap_or_else(|| supervisor.clone())]
    }

    /// The configured profiles (the embedded example when `profiles_file` is unset).
    ///
    /// # Errors
    ///
    /// The file cannot be read or a profile is invalid.
    /// The model every `openai` profile uses instead of its own: `model`, else
    /// `CONVENE_MODEL`.
    pub fn model_override(&self) -> Option<String> {
        self.model
            .clone()
            .map(|m| m.trim().to_owned())
            .filter(|m| !m.is_empty())
            .or_else(crate::models::model_from_env)
    }

    pub fn load_profiles(&self) -> Result<Vec<Profile>, Error> {
        Ok(match &self.profiles_file {
            Some(path) => profiles::load(path)?,
            None => profiles::example()?,
        })
    }

    /// The built-in tools over `tools_data_dir`, for a worker without MCP servers.
    ///
    /// # Errors
    ///
    /// [`Error::ToolsDataDir`] when the directory does not exist, [`Error::Config`] when
    /// `mcp.servers` is set (use [`mount_tools`](Self::mount_tools)).
    pub fn tools(&self) -> Result<ToolRegistry, Error> {
        if !self.mcp.is_empty() {
            return Err(Error::Config(
                "mcp.servers is set, and MCP tools are mounted at start-up from the tool \
                 catalog: build the tools with Config::mount_tools"
                    .into(),
            ));
        }
        if !self.tools_data_dir.is_dir() {
            return Err(Error::ToolsDataDir {
                path: self.tools_data_dir.clone(),
            });
        }
        Ok(ToolRegistry::builtin(self.tools_data_dir.clone()))
    }

    /// The built-in tools over `tools_data_dir` and the MCP tools of `mcp.servers`: the
    /// ones the tool catalog declares, read from `policy` with the `worker-pool`
    /// credential (see [`crate::tools::mcp`]). Returns the mounted MCP tools too (None
    /// without servers), to [shut down](McpTools::shutdown) with the worker. A server
    /// that cannot be started or reached is a warning, not an error.
    ///
    /// # Errors
    ///
    /// [`Error::ToolsDataDir`], an unreadable credential, or a catalog the policy service
    /// does not give ([`Error::Mcp`]).
    pub async fn mount_tools(
        &self,
        policy: &PolicyHandle,
    ) -> Result<(ToolRegistry, Option<McpTools>), Error> {
        if self.mcp.is_empty() {
            return Ok((self.tools()?, None));
        }
        if !self.tools_data_dir.is_dir() {
            return Err(Error::ToolsDataDir {
                path: self.tools_data_dir.clone(),
            });
        }
        let credential = self.credential()?;
        let catalog = Catalog::fetch(policy, &credential, CATALOG_PATIENCE).await?;
        let mcp = McpTools::mount(&self.mcp, &catalog).await;
        let tools = ToolRegistry::builtin(self.tools_data_dir.clone()).with_mcp(&mcp);
        Ok((tools, Some(mcp)))
    }

    /// The `worker-pool` credential the worker registers with.
    ///
    /// # Errors
    ///
    /// [`Error::Credential`] when the file cannot be read (or created) or is empty.
    pub fn credential(&self) -> Result<String, Error> {
        let (path, read) = match &self.credential_file {
            Some(path) => (
                path.clone(),
                std::fs::read_to_string(path).map(|s| s.trim().to_owned()),
            ),
            None => {
                let dir = self.credentials_dir();
                (
                    convene_mesh::policy_file::dev_credential_path(&dir, WORKER_POOL_PRINCIPAL),
                    std::fs::create_dir_all(&dir).and_then(|()| {
                        convene_mesh::policy_file::dev_credential(&dir, WORKER_POOL_PRINCIPAL)
                    }),
                )
            }
        };
        match read {
            Ok(secret) if !secret.is_empty() => Ok(secret),
            Ok(_) => Err(Error::Credential {
                path,
                source: std::io::Error::other("the file is empty"),
            }),
            Err(source) => Err(Error::Credential { path, source }),
        }
    }

    /// The endpoint to register: `advertise`, or one derived from the bound address.
    pub fn advertise_endpoint(&self, bound: SocketAddr) -> String {
        if let Some(a) = self.advertise.as_deref().filter(|a| !a.trim().is_empty()) {
            return a.to_owned();
        }
        if bound.ip().is_unspecified() {
            let host = std::env::var("HOSTNAME")
                .ok()
                .or_else(|| std::fs::read_to_string("/proc/sys/kernel/hostname").ok())
                .map(|h| h.trim().to_owned())
                .filter(|h| !h.is_empty())
                .unwrap_or_else(|| "localhost".to_owned());
            format!("http://{host}:{}", bound.port())
        } else {
            format!("http://{bound}")
        }
    }
}

#[cfg(test)]
mod tests {
    use convene_server::ConfigLoader;

    use super::*;

    #[test]
    fn the_default_registry_is_the_supervisors_internal_listener() {
        let with = |supervisor: &str| {
            Config {
                supervisor_endpoint: supervisor.to_owned(),
                ..Config::default()
            }
            .registry_urls()
        };
        assert_eq!(Config::default().registry_urls(), ["http://127.0.0.1:7500"]);
        assert_eq!(
            with("https://sup.example:7000/"),
            ["https://sup.example:7100"]
        );
        assert_eq!(with("http://[::1]:7400"), ["http://[::1]:7500"]);
        assert_eq!(with("https://sup.example"), ["https://sup.example:543"]);
        let listed = Config {
            registry_endpoints: vec!["http://a:7500".into(), "http://b:7500".into()],
            ..Config::default()
        };
        assert_eq!(listed.registry_urls(), ["http://a:7500", "http://b:7500"]);
    }

    #[test]
    fn defaults_are_the_development_settings() {
        let config = Config::default();
        assert_eq!(config.server.listen.port(), DEFAULT_PORT);
        assert!(config.server.listen.ip().is_loopback());
        assert_eq!(config.server.request_timeout, Some(DEFAULT_REQUEST_TIMEOUT));
        assert_eq!(config.capacity, 16);
        assert!(
            config
                .worker_id
                .ends_with(&format!("-{}", std::process::id()))
        );
        assert_eq!(
            config.credentials_dir(),
            PathBuf::from("./.convene/credentials")
        );
        config.validate().unwrap();
        assert_eq!(config.load_profiles().unwrap().len(), 8);
    }

    #[test]
    fn environment_overrides_and_unknown_keys_are_refused() {
        let config: Config = ConfigLoader::new()
            .env([
                ("CONVENE_DATA_DIR", "/var/lib/convene"),
                ("CONVENE_TOOLS_DATA_DIR", "/srv/data"),
                ("CONVENE_CAPACITY", "4"),
                ("CONVENE_SERVER__REQUEST_TIMEOUT", "off"),
            ])
            .load()
            .unwrap();
        assert_eq!(config.data_dir, PathBuf::from("/var/lib/convene"));
        assert_eq!(config.tools_data_dir, PathBuf::from("/srv/data"));
        assert_eq!(config.capacity, 4);
        assert_eq!(config.server.request_timeout, None);
        let err = ConfigLoader::new()
            .env([("CONVENE_TOOL_DATA_DIR", "/srv/data")])
            .load::<Config>()
            .unwrap_err();
        assert!(err.to_string().contains("CONVENE_TOOL_DATA_DIR"), "{err}");
    }

    #[test]
    fn mcp_servers_come_from_the_file_and_are_checked() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("worker.yaml");
        std::fs::write(
            &file,
            "mcp:\n  servers:\n    - { name: runbooks, command: python3, args: [r.py] }\n",
        )
        .unwrap();
        let config: Config = ConfigLoader::new().file(&file).load().unwrap();
        assert_eq!(config.mcp.servers[0].name, "runbooks");
        config.validate().unwrap();
        // The sync builder cannot mount them: it says which one can.
        let err = config.tools().unwrap_err().to_string();
        assert!(err.contains("mount_tools"), "{err}");

        std::fs::write(&file, "mcp:\n  servers:\n    - { name: runbooks }\n").unwrap();
        let config: Config = ConfigLoader::new().file(&file).load().unwrap();
        let err = config.validate().unwrap_err().to_string();
        assert!(err.contains("mcp.servers[0]"), "{err}");
    }

    #[test]
    fn the_a2a_allowlist_comes_from_the_file_or_the_environment_and_is_checked() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("worker.toml");
        std::fs::write(
            &file,
            "[a2a]\nallow = [\"https://agents.example.com\"]\nallow_private = [\"10.20.0.0/16\"]\n",
        )
        .unwrap();
        let config: Config = ConfigLoader::new().file(&file).load().unwrap();
        assert_eq!(config.a2a.allow, ["https://agents.example.com"]);
        assert_eq!(config.a2a.allow_private, ["10.20.0.0/16"]);
        config.validate().unwrap();

        let config: Config = ConfigLoader::new()
            .env([
                ("CONVENE_A2A__ALLOW", "[http://127.0.0.1:9999]"),
                ("CONVENE_A2A__ALLOW_PRIVATE", "[127.0.0.1]"),
            ])
            .load()
            .unwrap();
        assert_eq!(config.a2a.allow, ["http://127.0.0.1:9999"]);
        assert_eq!(config.a2a.allow_private, ["127.0.0.1"]);

        let bad = Config {
            a2a: crate::a2a::A2aSettings {
                allow: vec![],
                allow_private: vec!["10.0.0.0/40".into()],
            },
            ..Config::default()
        };
        let err = bad.validate().unwrap_err().to_string();
        assert!(err.contains("a2a.allow_private[0]"), "{err}");
        assert!(
            Config::default().a2a.allow.is_empty(),
            "no remote agent is allowed by default"
        );
    }

    #[test]
    fn missing_tools_data_dir_says_how_to_fix_it() {
        let config = Config {
            tools_data_dir: PathBuf::from("/nonexistent/convene-data"),
            ..Config::default()
        };
        let err = config.tools().unwrap_err().to_string();
        assert!(err.contains("/nonexistent/convene-data"), "{err}");
        assert!(err.contains("--tools-data"), "{err}");
        assert!(err.contains("tools_data_dir"), "{err}");
    }

    #[test]
    fn zero_capacity_is_refused() {
        let config = Config {
            capacity: 0,
            ..Config::default()
        };
        assert!(
            config
                .validate()
                .unwrap_err()
                .to_string()
                .contains("capacity")
        );
    }

    #[test]
    fn credential_comes_from_the_file_or_the_data_dir() {
        let dir = tempfile::tempdir().unwrap();
        let config = Config {
            data_dir: dir.path().to_owned(),
            ..Config::default()
        };
        let dev = config.credential().unwrap();
        assert_eq!(
            config.credential().unwrap(),
            dev,
            "created once, then reused"
        );
        assert!(dir.path().join("credentials/worker-pool.secret").is_file());

        let file = dir.path().join("pool.secret");
        std::fs::write(&file, "cvn_given\n").unwrap();
        let config = Config {
            credential_file: Some(file.clone()),
            ..config
        };
        assert_eq!(config.credential().unwrap(), "cvn_given");
        std::fs::write(&file, "  ").unwrap();
        assert!(
            config
                .credential()
                .unwrap_err()
                .to_string()
                .contains("empty")
        );
    }

    #[test]
    fn advertised_endpoint_follows_the_bound_address() {
        let config = Config::default();
        assert_eq!(
            config.advertise_endpoint("127.0.0.1:7410".parse().unwrap()),
            "http://127.0.0.1:7410"
        );
        let any = config.advertise_endpoint("0.0.0.0:7410".parse().unwrap());
        assert!(any.starts_with("http://") && any.ends_with(":7410") && !any.contains("0.0.0.0"));
        let explicit = Config {
            advertise: Some("http://worker-3.pool:7410".into()),
            ..Config::default()
        };
        assert_eq!(
            explicit.advertise_endpoint("0.0.0.0:7410".parse().unwrap()),
            "http://worker-3.pool:7410"
        );
    }
}
