//! The `a2a` provider: a profile whose delegations a remote A2A 1.0 agent serves.
//!
//! A profile with `provider: a2a` names the agent by `url`, its base URL (the agent
//! card is then `<url>/.well-known/agent-card.json`) or the URL of its agent card (a
//! URL ending in `.json`), and, optionally, `credential_env`: the name of the variable
//! holding a bearer credential for the agent, or `credential_file`: a file holding it
//! (read once, at start-up; never logged, never stored). The worker's loop does not run
//! for such a profile: for each delegation the worker
//!
//! 1. admits the card's URL against the worker's `a2a` configuration
//!    ([`allow`]: the URL prefixes it may call, and the private addresses it may reach),
//!    resolving the host once and pinning the connection to the addresses it checked;
//! 2. reads the agent card and picks its JSON-RPC (else HTTP+JSON) interface of A2A 1.x,
//!    whose URL is admitted the same way;
//! 3. sends one blocking `SendMessage` through the official SDK's client
//!    (`a2a-client-lf`): the goal, the acceptance criteria and the profile's
//!    instructions as a text part, the delegation's structured inputs (ids, scope and
//!    window, input refs, deadline) as a data part, the run's W3C `traceparent` and the
//!    bearer credential as headers; a task that is not finished when the call returns is
//!    polled with `GetTask` until it is, within the delegation's deadline;
//! 4. hands back every artifact of the completed task (or the agent's direct answer),
//!    each as canonical JSON naming the agent, its interface, the remote task and the
//!    artifact, which the loop stores as evidence of kind [`EVIDENCE_KIND`] under
//!    `a2a://<host>/<run>/<delegation>/<remote task>/<artifact>` and turns into claims
//!    (see `crate::agent`).
//!
//! A remote task that ends FAILED, REJECTED or CANCELED, that asks for input, or an
//! agent that answers something that is not A2A, ends the delegation FAILED with an
//! error code saying which (`remote_failed`, `remote_rejected`, `remote_canceled`,
//! `remote_needs_input`, `remote_protocol_error`, `remote_error`), retryable only when
//! the agent could not be reached (`remote_unavailable`). A URL the configuration does
//! not allow is refused before any connection (`a2a_refused`), and at start-up when the
//! profile's own URL is refused already.
//!
//! Redirects are never followed and proxies never used: the worker connects to the
//! addresses it checked, or not at all.

pub mod allow;
mod exchange;

use std::fmt;
use std::path::PathBuf;
use std::sync::Arc;

use reqwest::Url;
use serde::{Deserialize, Serialize};

use crate::provider::{
    ModelProvider, ModelRequest, ModelResponse, ProviderError, RemoteAgent, RemoteAnswer,
    RemoteError, RemoteTask,
};
pub use allow::{Allowlist, Refusal};

/// The provider's name, as profiles write it.
pub const PROVIDER_NAME: &str = "a2a";

/// The scheme of the evidence ids of a remote agent's artifacts.
pub const EVIDENCE_SCHEME: &str = "a2a";

/// The evidence kind of a remote agent's artifacts.
pub const EVIDENCE_KIND: &str = "a2a_artifact";

/// Where an agent publishes its card, below its base URL.
pub const AGENT_CARD_PATH: &str = ".well-known/agent-card.json";

/// The worker configuration's `a2a` section: the remote agents `a2a` profiles may
/// call.
///
/// ```toml
/// [a2a]
/// # URL prefixes: scheme, host, port and path must match (a path covers those below it).
/// allow = ["https://agents.example.com", "https://partner.example.org/a2a"]
/// # Loopback, private, link-local and other special-purpose addresses are refused
/// # unless listed here, as addresses or CIDRs (IPv4 or IPv6).
/// allow_private = ["10.20.0.0/16"]
/// ```
///
/// Both lists are empty by default: a worker calls no remote agent until its operator
/// says which.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct A2aSettings {
    /// URL prefixes of the agents profiles may name (and of the interfaces their cards
    /// point to).
    pub allow: Vec<String>,
    /// Non-public addresses the worker may connect to, as addresses or CIDRs.
    pub allow_private: Vec<String>,
}

impl A2aSettings {
    /// The compiled allowlist.
    ///
    /// # Errors
    ///
    /// An entry that does not parse, named by its key and index.
    pub fn allowlist(&self) -> Result<Allowlist, String> {
        Allowlist::new(&self.allow, &self.allow_private)
    }
}

/// Where a profile's remote agent is: the profile keys `url`, `credential_env` and
/// `credential_file`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RemoteSpec {
    /// The agent's base URL, or its agent card's URL (ending in `.json`).
    pub url: String,
    /// The variable holding the agent's bearer credential, if it needs one.
    pub credential_env: Option<String>,
    /// A file holding the agent's bearer credential, instead of a variable.
    pub credential_file: Option<PathBuf>,
}

impl RemoteSpec {
    /// The URL of the agent's card.
    ///
    /// # Errors
    ///
    /// `url` is not an http(s) URL without credentials, query or fragment.
    pub fn card_url(&self) -> Result<Url, String> {
        let url = Url::parse(self.url.trim()).map_err(|e| {
            format!(
                "url {:?} is not a URL ({e}); give the agent's base URL, e.g. \
                 https://agents.example.com, or its agent card's URL",
                self.url
            )
        })?;
        if !matches!(url.scheme(), "http" | "https") || url.host_str().is_none() {
            return Err(format!(
                "url {:?} must be an http:// or https:// URL with a host",
                self.url
            ));
        }
        if !url.username().is_empty() || url.password().is_some() {
            return Err(
                "url must not hold a user name or password; put the agent's bearer \
                 credential in a variable and name it in credential_env"
                    .to_owned(),
            );
        }
        if url.query().is_some() || url.fragment().is_some() {
            return Err(format!(
                "url {:?} must not have a query or fragment",
                allow::shown(&url)
            ));
        }
        if url.path().ends_with(".json") {
            return Ok(url);
        }
        let base = format!("{}/", url.as_str().trim_end_matches('/'));
        Url::parse(&base)
            .and_then(|b| b.join(AGENT_CARD_PATH))
            .map_err(|e| format!("url {:?}: cannot derive its agent card URL ({e})", self.url))
    }
}

/// A bearer credential: never printed.
#[derive(Clone)]
pub(crate) struct Bearer(String);

impl Bearer {
    pub(crate) fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Bearer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Bearer(<redacted>)")
    }
}

/// The provider of one `a2a` profile: its agent, its credential and the allowlist.
pub struct A2aProvider {
    profile_id: String,
    /// The agent as the profile names it.
    agent: String,
    card_url: Url,
    credential_source: Option<String>,
    bearer: Option<Bearer>,
    allow: Arc<Allowlist>,
    /// Where the agent's host names are looked up, once per delegation.
    dns: Arc<dyn allow::Dns>,
}

impl fmt::Debug for A2aProvider {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("A2aProvider")
            .field("profile", &self.profile_id)
            .field("agent", &self.agent)
            .field("card_url", &self.card_url.as_str())
            .field("credential", &self.credential_source)
            .finish_non_exhaustive()
    }
}

impl A2aProvider {
    /// The provider of profile `profile_id` whose agent `spec` names, calling only what
    /// `allow` admits.
    ///
    /// # Errors
    ///
    /// The URL is invalid or refused by the allowlist (as far as it can tell without
    /// DNS), or the credential variable is unset or empty.
    pub fn new(profile_id: &str, spec: &RemoteSpec, allow: Arc<Allowlist>) -> Result<Self, String> {
        crate::openai::install_crypto_provider();
        let card_url = spec.card_url()?;
        allow.check_url(&card_url).map_err(|r| r.to_string())?;
        let (bearer, credential_source) = match (&spec.credential_env, &spec.credential_file) {
            (None, None) => (None, None),
            (Some(_), Some(_)) => {
                return Err(
                    "give the agent's credential in a variable (credential_env) or a file \
                     (credential_file), not both"
                        .to_owned(),
                );
            }
            (Some(var), None) => {
                let value = std::env::var(var).unwrap_or_default();
                if value.trim().is_empty() {
                    return Err(format!(
                        "credential_env names {var}, which is unset or empty; set it to the \
                         agent's bearer credential, or remove credential_env to call the \
                         agent without one"
                    ));
                }
                (
                    Some(Bearer(value.trim().to_owned())),
                    Some(format!("the variable {var}")),
                )
            }
            (None, Some(path)) => {
                let value = std::fs::read_to_string(path).map_err(|e| {
                    format!(
                        "cannot read credential_file {}: {e}; point it at a readable file \
                         holding the agent's bearer credential",
                        path.display()
                    )
                })?;
                if value.trim().is_empty() {
                    return Err(format!(
                        "credential_file {} is empty; write the agent's bearer credential \
                         into it",
                        path.display()
                    ));
                }
                (
                    Some(Bearer(value.trim().to_owned())),
                    Some(format!("the file {}", path.display())),
                )
            }
        };
        Ok(Self {
            profile_id: profile_id.to_owned(),
            agent: allow::shown(&Url::parse(spec.url.trim()).unwrap_or_else(|_| card_url.clone())),
            card_url,
            credential_source,
            bearer,
            allow,
            dns: Arc::new(allow::SystemDns),
        })
    }
}

#[async_trait::async_trait]
impl ModelProvider for A2aProvider {
    fn name(&self) -> &str {
        PROVIDER_NAME
    }

    fn records_turns(&self) -> bool {
        false
    }

    async fn complete(&self, _request: &ModelRequest) -> Result<ModelResponse, ProviderError> {
        Err(ProviderError::permanent(
            PROVIDER_NAME,
            format!(
                "profile {} is served by the remote agent at {}, which takes whole \
                 delegations: it cannot answer model turns (a planner needs a playbook or \
                 openai profile)",
                self.profile_id, self.agent
            ),
        ))
    }

    fn remote(&self) -> Option<&dyn RemoteAgent> {
        Some(self)
    }
}

#[async_trait::async_trait]
impl RemoteAgent for A2aProvider {
    async fn delegate(&self, task: RemoteTask<'_>) -> Result<RemoteAnswer, RemoteError> {
        exchange::delegate(self, task).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(url: &str) -> RemoteSpec {
        RemoteSpec {
            url: url.to_owned(),
            ..RemoteSpec::default()
        }
    }

    #[test]
    fn the_card_is_below_the_base_url_unless_the_url_is_the_card() {
        let card = |u: &str| spec(u).card_url().map(|c| c.to_string());
        assert_eq!(
            card("https://agents.example.com").unwrap(),
            "https://agents.example.com/.well-known/agent-card.json"
        );
        assert_eq!(
            card("https://agents.example.com/team/history/").unwrap(),
            "https://agents.example.com/team/history/.well-known/agent-card.json"
        );
        assert_eq!(
            card("http://127.0.0.1:9999/cards/history.json").unwrap(),
            "http://127.0.0.1:9999/cards/history.json"
        );
        for bad in [
            "agents.example.com",
            "ftp://agents.example.com",
            "https://u:p@agents.example.com",
            "https://agents.example.com/?key=1",
        ] {
            let err = card(bad).unwrap_err();
            assert!(!err.contains("u:p"), "{err}");
        }
    }

    #[test]
    fn a_profile_is_refused_at_start_up_when_its_url_is_not_allowed() {
        let allow = Arc::new(
            A2aSettings {
                allow: vec!["https://agents.example.com".into()],
                allow_private: vec![],
            }
            .allowlist()
            .unwrap(),
        );
        A2aProvider::new(
            "history",
            &spec("https://agents.example.com/history"),
            allow.clone(),
        )
        .unwrap();
        let err = A2aProvider::new("history", &spec("https://other.example.net"), allow.clone())
            .unwrap_err();
        assert!(err.contains("https://other.example.net"), "{err}");
        assert!(err.contains("a2a.allow"), "{err}");
        let with = |env: Option<&str>, file: Option<PathBuf>| {
            A2aProvider::new(
                "history",
                &RemoteSpec {
                    url: "https://agents.example.com".into(),
                    credential_env: env.map(str::to_owned),
                    credential_file: file,
                },
                allow.clone(),
            )
        };
        let err = with(Some("CONVENE_TEST_A2A_UNSET_CREDENTIAL"), None).unwrap_err();
        assert!(err.contains("CONVENE_TEST_A2A_UNSET_CREDENTIAL"), "{err}");

        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("history.token");
        std::fs::write(&file, "tok-a2a-secret\n").unwrap();
        let provider = with(None, Some(file.clone())).unwrap();
        assert_eq!(provider.bearer.as_ref().unwrap().expose(), "tok-a2a-secret");
        let shown = format!("{provider:?}");
        assert!(!shown.contains("tok-a2a-secret"), "{shown}");
        assert!(shown.contains("history.token"), "{shown}");
        assert!(
            with(Some("X"), Some(file.clone()))
                .unwrap_err()
                .contains("not both")
        );
        std::fs::write(&file, "  \n").unwrap();
        assert!(with(None, Some(file)).unwrap_err().contains("empty"));
    }
}
