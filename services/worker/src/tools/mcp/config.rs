//! The MCP servers a worker mounts tools from: the `mcp` section of the worker's
//! configuration, and the file `convene up --mcp FILE` and `convene run --local --mcp
//! FILE` read (the same section on its own, YAML or TOML).
//!
//! ```yaml
//! servers:
//!   - name: runbooks                 # the <server> of mcp:<server>/<tool>@<version>
//!     command: python3               # stdio: a command the worker starts and owns
//!     args: [examples/mcp/runbooks.py]
//!     env: { RUNBOOKS_REGION: eu }   # set for the server, on top of PATH, HOME, ...
//!     pass_env: [RUNBOOKS_TOKEN]     # the worker's own variables the server gets too
//!     call_timeout: 30s
//!   - name: runbooks-http
//!     url: http://127.0.0.1:8765/mcp # streamable HTTP: a server that runs on its own
//!     bearer_token_env: RUNBOOKS_TOKEN
//! ```
//!
//! A stdio server starts with an empty environment but for [`INHERITED_ENV`], the
//! variables `pass_env` names and `env`: the worker's credentials and keys never reach
//! it unless named. Secrets belong in `pass_env` or `bearer_token_env` (the *names* of
//! variables), not in `env`, whose values the configuration holds.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// Time a tool call may take unless a server sets `call_timeout`.
pub const DEFAULT_CALL_TIMEOUT: Duration = Duration::from_secs(30);
/// Time a server has to start (or be reached), complete the MCP handshake and list its
/// tools, unless it sets `start_timeout`.
pub const DEFAULT_START_TIMEOUT: Duration = Duration::from_secs(10);
/// Largest output of one call (its canonical JSON) unless a server sets
/// `max_output_bytes`.
pub const DEFAULT_MAX_OUTPUT_BYTES: u64 = 1024 * 1024;
/// Longest `call_timeout` or `start_timeout`.
pub const MAX_TIMEOUT: Duration = Duration::from_secs(3600);
/// The variables of the worker's environment every stdio server gets, when set.
pub const INHERITED_ENV: &[&str] = &["PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "TZ"];

/// The MCP servers a worker mounts tools from.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct McpConfig {
    /// The servers, each by a name unique among them.
    pub servers: Vec<McpServerConfig>,
}

/// One MCP server: how to reach it and how long to wait for it.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct McpServerConfig {
    /// The server's name in tool names, `mcp:<name>/<tool>@<version>`: 1 to 64 letters,
    /// digits, `_`, `-` or `.`.
    pub name: String,
    /// stdio: the program to start (looked up on `PATH`). Exactly one of `command` and
    /// `url`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub command: Option<String>,
    /// stdio: its arguments.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub args: Vec<String>,
    /// stdio: variables set for the server.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub env: BTreeMap<String, String>,
    /// stdio: names of the worker's own variables the server gets too (secrets go
    /// here, not in `env`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub pass_env: Vec<String>,
    /// stdio: the server's working directory. Default: the worker's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cwd: Option<PathBuf>,
    /// Streamable HTTP: the server's MCP endpoint, e.g. `http://127.0.0.1:8765/mcp`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
    /// Streamable HTTP: the name of the worker's variable holding a bearer token for
    /// the server, sent as `Authorization: Bearer <token>`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bearer_token_env: Option<String>,
    /// Time one tool call may take; a call past it fails (and is cancelled).
    #[serde(
        default = "default_call_timeout",
        with = "convene_server::config::duration"
    )]
    pub call_timeout: Duration,
    /// Time the server has to start (or be reached), complete the handshake and list
    /// its tools.
    #[serde(
        default = "default_start_timeout",
        with = "convene_server::config::duration"
    )]
    pub start_timeout: Duration,
    /// Largest output of one call, in bytes of canonical JSON; a larger one fails the
    /// call.
    #[serde(default = "default_max_output_bytes")]
    pub max_output_bytes: u64,
}

fn default_call_timeout() -> Duration {
    DEFAULT_CALL_TIMEOUT
}

fn default_start_timeout() -> Duration {
    DEFAULT_START_TIMEOUT
}

fn default_max_output_bytes() -> u64 {
    DEFAULT_MAX_OUTPUT_BYTES
}

impl std::fmt::Debug for McpServerConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // `env` values may be credentials: only their names are shown.
        f.debug_struct("McpServerConfig")
            .field("name", &self.name)
            .field("command", &self.command)
            .field("args", &self.args)
            .field("env", &self.env.keys().collect::<Vec<_>>())
            .field("pass_env", &self.pass_env)
            .field("cwd", &self.cwd)
            .field("url", &self.url)
            .field("bearer_token_env", &self.bearer_token_env)
            .field("call_timeout", &self.call_timeout)
            .field("start_timeout", &self.start_timeout)
            .field("max_output_bytes", &self.max_output_bytes)
            .finish()
    }
}

/// How a server is reached.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Transport<'a> {
    /// A child process speaking MCP on its stdin and stdout.
    Stdio {
        /// The program.
        command: &'a str,
    },
    /// A streamable-HTTP endpoint.
    Http {
        /// The URL.
        url: &'a str,
    },
}

impl McpServerConfig {
    /// A stdio server `name` started as `command args...`, with the default limits.
    pub fn stdio(
        name: impl Into<String>,
        command: impl Into<String>,
        args: impl IntoIterator<Item = impl Into<String>>,
    ) -> Self {
        Self {
            command: Some(command.into()),
            args: args.into_iter().map(Into::into).collect(),
            ..Self::named(name.into())
        }
    }

    /// A streamable-HTTP server `name` at `url`, with the default limits.
    pub fn http(name: impl Into<String>, url: impl Into<String>) -> Self {
        Self {
            url: Some(url.into()),
            ..Self::named(name.into())
        }
    }

    fn named(name: String) -> Self {
        Self {
            name,
            command: None,
            args: Vec::new(),
            env: BTreeMap::new(),
            pass_env: Vec::new(),
            cwd: None,
            url: None,
            bearer_token_env: None,
            call_timeout: DEFAULT_CALL_TIMEOUT,
            start_timeout: DEFAULT_START_TIMEOUT,
            max_output_bytes: DEFAULT_MAX_OUTPUT_BYTES,
        }
    }

    /// How the server is reached (checked by [`McpConfig::validate`]: exactly one of
    /// `command` and `url`).
    pub fn transport(&self) -> Transport<'_> {
        match (&self.command, &self.url) {
            (_, Some(url)) => Transport::Http { url },
            (Some(command), None) => Transport::Stdio { command },
            (None, None) => Transport::Stdio { command: "" },
        }
    }

    /// Checks the entry; errors name the field below `field`.
    fn validate(&self, field: &str) -> Result<(), String> {
        convene_mesh::policy_file::check_mcp_server_name(&self.name)
            .map_err(|m| format!("{field}.name: {m}"))?;
        let stdio_only = !self.args.is_empty()
            || !self.env.is_empty()
            || !self.pass_env.is_empty()
            || self.cwd.is_some();
        match (&self.command, &self.url) {
            (Some(_), Some(_)) | (None, None) => {
                return Err(format!(
                    "{field}: set exactly one of `command` (a stdio server the worker starts) \
                     and `url` (a streamable-HTTP server)"
                ));
            }
            (Some(command), None) => {
                if command.trim().is_empty() {
                    return Err(format!("{field}.command: must name a program"));
                }
                if self.bearer_token_env.is_some() {
                    return Err(format!(
                        "{field}.bearer_token_env: only a `url` server takes a bearer token; \
                         give a stdio server its secret with pass_env"
                    ));
                }
            }
            (None, Some(url)) => {
                let scheme_ok = url.starts_with("http://") || url.starts_with("https://");
                if !scheme_ok || url.contains(char::is_whitespace) {
                    return Err(format!(
                        "{field}.url: {url:?} must be an http:// or https:// URL, e.g. \
                         http://127.0.0.1:8765/mcp"
                    ));
                }
                if stdio_only {
                    return Err(format!(
                        "{field}: args, env, pass_env and cwd are for a stdio server \
                         (`command`); a `url` server runs on its own"
                    ));
                }
            }
        }
        for (key, what) in self
            .env
            .keys()
            .map(|k| (k, "env"))
            .chain(self.pass_env.iter().map(|k| (k, "pass_env")))
            .chain(
                self.bearer_token_env
                    .iter()
                    .map(|k| (k, "bearer_token_env")),
            )
        {
            if key.is_empty() || key.contains(['=', '\0']) || key.contains(char::is_whitespace) {
                return Err(format!(
                    "{field}.{what}: {key:?} is not a variable name (no `=`, no whitespace)"
                ));
            }
        }
        for (value, what) in [
            (self.call_timeout, "call_timeout"),
            (self.start_timeout, "start_timeout"),
        ] {
            if value.is_zero() || value > MAX_TIMEOUT {
                return Err(format!(
                    "{field}.{what}: must be positive and at most 1h, e.g. \"30s\""
                ));
            }
        }
        if self.max_output_bytes == 0 {
            return Err(format!(
                "{field}.max_output_bytes: must be at least 1 (default {DEFAULT_MAX_OUTPUT_BYTES})"
            ));
        }
        Ok(())
    }
}

impl McpConfig {
    /// Whether no server is configured.
    pub fn is_empty(&self) -> bool {
        self.servers.is_empty()
    }

    /// Reads the section from its own file (`*.yaml`, `*.yml` or `*.toml`) and checks it.
    ///
    /// # Errors
    ///
    /// The file cannot be read or parsed (naming the key), or an entry is invalid
    /// (naming the field, e.g. `mcp.servers[1].url`).
    pub fn load(path: &Path) -> Result<Self, String> {
        let config: Self = convene_server::ConfigLoader::new()
            .file(path)
            .load()
            .map_err(|e| format!("MCP configuration {}: {e}", path.display()))?;
        config
            .validate()
            .map_err(|e| format!("MCP configuration {}: {e}", path.display()))?;
        Ok(config)
    }

    /// Checks every server; errors name the field (`mcp.servers[1].url`).
    ///
    /// # Errors
    ///
    /// The first invalid value, and what to write instead.
    pub fn validate(&self) -> Result<(), String> {
        let mut names = std::collections::BTreeSet::new();
        for (i, server) in self.servers.iter().enumerate() {
            let field = format!("mcp.servers[{i}]");
            server.validate(&field)?;
            if !names.insert(server.name.as_str()) {
                return Err(format!(
                    "{field}.name: server {} is configured twice; give each server its own name",
                    server.name
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(yaml: &str) -> Result<McpConfig, String> {
        let config: McpConfig = serde_yaml::from_str(yaml).map_err(|e| e.to_string())?;
        config.validate()?;
        Ok(config)
    }

    #[test]
    fn stdio_and_http_servers_parse_with_defaults() {
        let config = parse(
            r#"
servers:
  - name: runbooks
    command: python3
    args: [examples/mcp/runbooks.py]
    env: { RUNBOOKS_REGION: eu }
    call_timeout: 5s
  - name: runbooks-http
    url: http://127.0.0.1:8765/mcp
    bearer_token_env: RUNBOOKS_TOKEN
"#,
        )
        .unwrap();
        let [stdio, http] = config.servers.as_slice() else {
            panic!("two servers: {config:?}");
        };
        assert_eq!(stdio.transport(), Transport::Stdio { command: "python3" });
        assert_eq!(stdio.call_timeout, Duration::from_secs(5));
        assert_eq!(stdio.start_timeout, DEFAULT_START_TIMEOUT);
        assert_eq!(
            http.transport(),
            Transport::Http {
                url: "http://127.0.0.1:8765/mcp"
            }
        );
        assert_eq!(http.max_output_bytes, DEFAULT_MAX_OUTPUT_BYTES);
        // Values of `env` never show in logs.
        let shown = format!("{stdio:?}");
        assert!(
            shown.contains("RUNBOOKS_REGION") && !shown.contains("eu\""),
            "{shown}"
        );
    }

    #[test]
    fn invalid_entries_name_the_field() {
        let cases = [
            (
                "- { name: a, command: x, url: \"http://h/mcp\" }",
                "mcp.servers[0]: set exactly one",
            ),
            ("- { name: a }", "mcp.servers[0]: set exactly one"),
            ("- { name: \"a/b\", command: x }", "mcp.servers[0].name"),
            ("- { name: a, url: \"ftp://h\" }", "mcp.servers[0].url"),
            (
                "- { name: a, url: \"http://h/mcp\", args: [x] }",
                "args, env, pass_env and cwd",
            ),
            (
                "- { name: a, command: x, bearer_token_env: T }",
                "mcp.servers[0].bearer_token_env",
            ),
            (
                "- { name: a, command: x, call_timeout: 0s }",
                "mcp.servers[0].call_timeout",
            ),
            (
                "- { name: a, command: x, pass_env: [\"A=B\"] }",
                "mcp.servers[0].pass_env",
            ),
            (
                "- { name: a, command: x, max_output_bytes: 0 }",
                "mcp.servers[0].max_output_bytes",
            ),
            (
                "- { name: a, command: x }\n  - { name: a, command: y }",
                "mcp.servers[1].name",
            ),
        ];
        for (servers, expected) in cases {
            let err = parse(&format!("servers:\n  {servers}\n")).unwrap_err();
            assert!(err.contains(expected), "{servers}: {err}");
        }
        let err = parse("servers:\n  - { name: a, command: x, timeout: 5s }\n").unwrap_err();
        assert!(err.contains("timeout"), "{err}");
    }

    #[test]
    fn a_file_loads_as_yaml_or_toml() {
        let dir = tempfile::tempdir().unwrap();
        let toml = dir.path().join("mcp.toml");
        std::fs::write(
            &toml,
            "[[servers]]\nname = \"runbooks\"\ncommand = \"python3\"\nargs = [\"r.py\"]\n",
        )
        .unwrap();
        let config = McpConfig::load(&toml).unwrap();
        assert_eq!(
            config.servers[0],
            McpServerConfig::stdio("runbooks", "python3", ["r.py"])
        );
        let bad = dir.path().join("mcp.yaml");
        std::fs::write(&bad, "servers:\n  - { name: runbooks }\n").unwrap();
        let err = McpConfig::load(&bad).unwrap_err();
        assert!(
            err.contains("mcp.yaml") && err.contains("mcp.servers[0]"),
            "{err}"
        );
    }
}
