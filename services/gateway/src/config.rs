//! The gateway's configuration.
//!
//! [`Config::default`] is the development setup of the payment-incident example: A2A
//! over HTTP on `127.0.0.1:7480`, gRPC health on `127.0.0.1:7405`, the supervisor at
//! `http://127.0.0.1:7400`, the example policy and templates built into the binary.
//! Every key can be overridden by a config file, by `CONVENE_*` environment variables
//! (`CONVENE_HTTP_LISTEN`, `CONVENE_PUBLIC_URL`, ...) and by flags, through
//! [`convene_server::ConfigLoader`].

use std::fmt;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

use convene_mesh::policy_file::{Policy, PolicySource};
use convene_server::{ServerSettings, ServiceCommon};
use convene_supervisor::templates::Templates;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// The gateway's gRPC port (health and reflection only).
pub const DEFAULT_PORT: u16 = 7405;

/// Where A2A is served by default.
pub const DEFAULT_HTTP_LISTEN: SocketAddr =
    SocketAddr::new(std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST), 7480);

/// The principal whose development credential the console acts with by default.
pub const CONSOLE_PRINCIPAL: &str = "console";

/// Where the evidence store is by default.
pub const DEFAULT_EVIDENCE_ENDPOINT: &str = "http://127.0.0.1:7402";

/// Where the approval service is by default.
pub const DEFAULT_APPROVAL_ENDPOINT: &str = "http://127.0.0.1:7403";

/// Where the supervisor is by default.
pub const DEFAULT_SUPERVISOR_ENDPOINT: &str = "http://127.0.0.1:7400";

/// Where the gateway serves A2A over HTTP: an address, or `off`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HttpListen(pub Option<SocketAddr>);

impl HttpListen {
    /// The address, unless A2A is turned off.
    pub fn addr(self) -> Option<SocketAddr> {
        self.0
    }
}

impl Default for HttpListen {
    fn default() -> Self {
        Self(Some(DEFAULT_HTTP_LISTEN))
    }
}

impl fmt::Display for HttpListen {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Some(addr) => write!(f, "{addr}"),
            None => f.write_str("off"),
        }
    }
}

impl FromStr for HttpListen {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let s = s.trim();
        if s.eq_ignore_ascii_case("off") {
            return Ok(Self(None));
        }
        s.parse().map(|a| Self(Some(a))).map_err(|_| {
            format!("{s:?} is not an address such as 127.0.0.1:7480 or 0.0.0.0:7480, nor `off`")
        })
    }
}

impl Serialize for HttpListen {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for HttpListen {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        String::deserialize(deserializer)?
            .parse()
            .map_err(serde::de::Error::custom)
    }
}

/// Everything the gateway is configured with. The shared keys (`server`, `data_dir`,
/// `policy_file`, `dev_credentials`, `database_url`) are in [`common`](Self::common):
/// its `policy_file` holds the principals whose credentials A2A callers present, its
/// `database_url` where the A2A task ↔ run mapping is kept (share it between replicas).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// The keys every service that reads the policy file shares.
    #[serde(flatten)]
    pub common: ServiceCommon,
    /// Where A2A is served over HTTP (both bindings and the Agent Card), or `off`.
    pub http_listen: HttpListen,
    /// The URL the Agent Card advertises, e.g. https://agents.example.com/convene for a
    /// gateway behind a Service or an ingress. Unset: `http://<http_listen>`.
    #[serde(default)]
    pub public_url: Option<String>,
    /// The supervisor (or its Service) the gateway starts and follows runs on.
    pub supervisor_endpoint: String,
    /// The approval service (or its Service), whose requests the console shows, votes
    /// on and executes.
    pub approval_endpoint: String,
    /// The evidence store (or its Service), whose evidence and artifacts the console
    /// shows.
    pub evidence_endpoint: String,
    /// Run templates offered as the card's skills: the supervisor's `templates_file`.
    /// Unset: the payment-incident example's, unless `policy_file` is set (then none).
    #[serde(default)]
    pub templates_file: Option<PathBuf>,
    /// File holding the credential the operator console acts with: a principal of the
    /// policy file holding `principals:act-as`. Unset: the development credential of
    /// principal `console` when `dev_credentials` is on and the policy has it; else
    /// the console is off.
    #[serde(default)]
    pub console_credential_file: Option<PathBuf>,
    /// How long a console session lasts.
    #[serde(with = "convene_server::config::duration")]
    pub console_session_ttl: Duration,
    /// How often the console's live streams check that their session is still open and
    /// its principal still holds `runs:read`; they end at the first check that finds it
    /// not (and at once at a sign-out on the same replica, or the session's expiry).
    /// `convene up` reads `CONVENE_CONSOLE_LIVE_RECHECK` for it.
    #[serde(with = "convene_server::config::duration")]
    pub console_live_recheck: Duration,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            common: ServiceCommon::new(ServerSettings::on_port(DEFAULT_PORT)),
            http_listen: HttpListen::default(),
            public_url: None,
            supervisor_endpoint: DEFAULT_SUPERVISOR_ENDPOINT.to_owned(),
            approval_endpoint: DEFAULT_APPROVAL_ENDPOINT.to_owned(),
            evidence_endpoint: DEFAULT_EVIDENCE_ENDPOINT.to_owned(),
            templates_file: None,
            console_credential_file: None,
            console_session_ttl: crate::console::DEFAULT_SESSION_TTL,
            console_live_recheck: crate::console::DEFAULT_LIVE_RECHECK,
        }
    }
}

convene_server::common_section!(Config);

impl Config {
    /// Where the policy comes from: `policy_file` (unset: the embedded example), with
    /// development credentials in `<data_dir>/credentials` when `dev_credentials` is on.
    pub fn policy_source(&self) -> PolicySource {
        PolicySource::new(self.policy_file.clone(), self.dev_credentials_dir())
    }

    /// The run templates offered as skills, as the supervisor reads them.
    ///
    /// # Errors
    ///
    /// The supervisor's templates error, naming the file, the template and what to fix.
    pub fn templates(&self, policy: &Policy) -> Result<Templates, convene_supervisor::Error> {
        match (&self.templates_file, &self.policy_file) {
            (Some(file), _) => Templates::load(file, policy),
            (None, None) => Templates::example(policy),
            (None, Some(_)) => Ok(Templates::default()),
        }
    }

    /// The console's settings: its credential from `console_credential_file`, else the
    /// development credential of principal [`CONSOLE_PRINCIPAL`] (when development
    /// credentials are on and the policy has that principal); None: no console. Its
    /// links to a run's trace go to Jaeger at `CONVENE_JAEGER_URL`, which the `convene`
    /// client commands read too, when that variable is set.
    ///
    /// # Errors
    ///
    /// [`crate::Error::ConsoleCredential`] when the file cannot be read.
    pub fn console(
        &self,
        policy: &Policy,
        approval: convene_mesh::handles::ApprovalHandle,
        evidence: convene_mesh::handles::EvidenceHandle,
    ) -> Result<Option<crate::ConsoleSettings>, crate::Error> {
        let credential = match &self.console_credential_file {
            Some(path) => Some(
                std::fs::read_to_string(path)
                    .map(|s| s.trim().to_owned())
                    .map_err(|source| crate::Error::ConsoleCredential {
                        path: path.clone(),
                        source,
                    })?,
            ),
            None => self
                .dev_credentials_dir()
                .filter(|_| policy.principal(CONSOLE_PRINCIPAL).is_some())
                .and_then(|dir| {
                    convene_mesh::policy_file::dev_credential(&dir, CONSOLE_PRINCIPAL).ok()
                }),
        };
        if credential.is_none() {
            tracing::info!(
                "the operator console is off: set console_credential_file to a principal's credential holding principals:act-as"
            );
        }
        Ok(credential.map(|credential| crate::ConsoleSettings {
            approval,
            evidence,
            credential,
            session_ttl: self.console_session_ttl,
            jaeger_url: std::env::var("CONVENE_JAEGER_URL")
                .ok()
                .filter(|url| !url.trim().is_empty()),
        }))
    }

    /// The base URL the card advertises: `public_url` without a trailing slash, else
    /// `http://<http_listen>` (`https://` when the process serves TLS).
    pub fn public_base(&self, bound: Option<SocketAddr>) -> String {
        match &self.public_url {
            Some(url) => url.trim_end_matches('/').to_owned(),
            None => format!(
                "{}://{}",
                if convene_server::tls::installed().is_some_and(|t| t.server.is_some()) {
                    "https"
                } else {
                    "http"
                },
                bound
                    .or(self.http_listen.addr())
                    .unwrap_or(DEFAULT_HTTP_LISTEN)
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn http_listen_reads_an_address_or_off_and_says_what_it_wants() {
        assert_eq!("off".parse::<HttpListen>().unwrap(), HttpListen(None));
        assert_eq!(
            "0.0.0.0:9000".parse::<HttpListen>().unwrap().addr(),
            Some("0.0.0.0:9000".parse().unwrap())
        );
        let err = "nowhere".parse::<HttpListen>().unwrap_err();
        assert!(err.contains("off"), "{err}");
        assert_eq!(HttpListen(None).to_string(), "off");
    }

    #[test]
    fn the_public_url_wins_over_the_listen_address() {
        let mut config = Config::default();
        assert_eq!(config.public_base(None), "http://127.0.0.1:7480");
        config.public_url = Some("https://agents.example.com/convene/".to_owned());
        assert_eq!(
            config.public_base(None),
            "https://agents.example.com/convene"
        );
    }
}
