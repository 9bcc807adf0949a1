//! The profiles file: the worker profiles a worker serves.
//!
//! A YAML file with a list of profiles. Each has the fields of `convene.v1.WorkerProfile`
//! (capabilities in the policy file's scope syntax), plus the provider-specific
//! `playbook` section for the `playbook` provider (or, for a planner, its `planner`
//! section; see [`crate::playbook::planner`]), the server and key of the `openai`
//! provider (`base_url`, `api_key_env` or `api_key_file`) and whether it streams
//! (`stream`), the remote agent of the `a2a` provider (`url`, `credential_env`; see [`crate::a2a`]), the kinds of evidence
//! each of its tools may record (`evidence_kinds`, the default first; see
//! [`ProfileEntry::evidence_kinds`]), its model's context window in tokens
//! (`context_window`; see [`crate::agent::context`]), an optional `hold` section for the
//! bench ([`crate::hold`]) and an optional `faults` section for tests
//! ([`crate::faults`]; refused by a build without fault injection). Unknown keys are
//! refused, and every profile is validated with
//! [`convene_core::validate::worker_profile`], so errors name the field
//! (`profiles[1].max_iterations`).
//!
//! Profiles are resolved to their model providers here too: a [`ProviderRegistry`] maps
//! a profile's `provider` name to a factory that builds the provider for that profile;
//! a profile naming a provider the registry does not know keeps the worker from
//! starting.
//!
//! The payment-incident example's profiles are embedded ([`EXAMPLE_PROFILES`]) so the
//! binary runs from any directory.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::path::Path;
use std::sync::Arc;

use convene_core::model;
use convene_core::validate;
use convene_mesh::policy_file::ScopeEntry;
use convene_proto::v1;
use serde::{Deserialize, Serialize};

use crate::a2a::{self, A2aProvider, Allowlist, RemoteSpec};
use crate::faults::Faults;
use crate::hold::Hold;
use crate::openai::{self, ClientSettings, Connection, OpenAiProvider};
use crate::playbook::{self, PlannerProvider, PlannerSpec, PlaybookProvider, PlaybookSpec};
use crate::provider::ModelProvider;

/// The profiles of the payment-incident example, embedded in the binary.
pub const EXAMPLE_PROFILES: &str = include_str!("../../../examples/payment-incident/profiles.yaml");

/// How the embedded example profiles are named in errors and logs.
pub const EXAMPLE_PROFILES_NAME: &str = "<embedded payment-incident example profiles>";

/// Errors loading a profiles file.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The file cannot be read.
    #[error("cannot read profiles file {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The file does not parse (syntax, unknown key, wrong type).
    #[error("profiles file {path}: {detail}")]
    Parse {
        /// The file.
        path: String,
        /// What is wrong, with its location.
        detail: String,
    },
    /// The file parses but a value is invalid.
    #[error("profiles file {path}: {field}: {detail}")]
    Invalid {
        /// The file.
        path: String,
        /// The field, e.g. `profiles[0].playbook.steps[1].tool`.
        field: String,
        /// What is wrong and what to do.
        detail: String,
    },
}

/// The profiles file as written.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProfilesFile {
    /// The profiles.
    pub profiles: Vec<ProfileEntry>,
}

/// One profile as written.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProfileEntry {
    /// Stable id, e.g. `logs-investigator`.
    #[serde(default)]
    pub id: String,
    /// Version, reported in results.
    #[serde(default)]
    pub version: String,
    /// Display name (default: the id).
    #[serde(default)]
    pub name: String,
    /// What the profile is for.
    #[serde(default)]
    pub description: String,
    /// Instructions given to the profile's model.
    #[serde(default)]
    pub instructions: String,
    /// Tools it may use, `name@version`.
    #[serde(default)]
    pub default_tools: Vec<String>,
    /// Model provider (default `playbook`).
    #[serde(default = "default_provider")]
    pub provider: String,
    /// Model name for the provider (empty for `playbook`).
    #[serde(default)]
    pub model: String,
    /// Agent-loop iteration limit (0: 12).
    #[serde(default)]
    pub max_iterations: u32,
    /// Model tokens per task (0: 8192).
    #[serde(default)]
    pub max_tokens: u32,
    /// Sampling temperature (0: 0.4).
    #[serde(default)]
    pub temperature: f64,
    /// Scopes the profile may ever hold, as in the policy file.
    #[serde(default)]
    pub capabilities: Vec<ScopeEntry>,
    /// Evidence URI prefixes its claims may cite.
    #[serde(default)]
    pub evidence_prefixes: Vec<String>,
    /// Whether its delegations complete without external input.
    #[serde(default)]
    pub supports_parallel_completion: bool,
    /// The kinds of evidence each of its tools may record, by tool (`name@version`, one
    /// of `default_tools`), the default first: a call naming another kind is refused, a
    /// call naming none records the default. A tool left out records what its catalog
    /// entry declares (MCP tools), else any kind it is given and its own default.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub evidence_kinds: BTreeMap<String, Vec<String>>,
    /// The `openai` provider's API base, with its version path (default: the
    /// `OPENAI_BASE_URL` variable, else OpenAI's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub base_url: Option<String>,
    /// The `openai` provider: the *name* of the variable holding the API key (default
    /// `OPENAI_API_KEY`). The key itself never goes in a profile.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_key_env: Option<String>,
    /// The `openai` provider: a file holding the API key, instead of a variable.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_key_file: Option<std::path::PathBuf>,
    /// The `openai` provider: ask for each answer as a stream of server-sent events,
    /// assembled into the same answer (default false: one whole answer).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub stream: bool,
    /// The `a2a` provider: the remote agent's base URL, or its agent card's URL (ending
    /// in `.json`). The worker configuration's `a2a.allow` must cover it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
    /// The `a2a` provider: the *name* of the variable holding the agent's bearer
    /// credential (none: calls carry no credential). The credential itself never goes
    /// in a profile.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub credential_env: Option<String>,
    /// The `a2a` provider: a file holding the agent's bearer credential, instead of a
    /// variable.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub credential_file: Option<std::path::PathBuf>,
    /// The `playbook` provider's script.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub playbook: Option<PlaybookSpec>,
    /// The `playbook` provider's script for a planner (instead of `playbook`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub planner: Option<PlannerSpec>,
    /// Delegations wait at their start for a release file (the bench's `hold`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hold: Option<Hold>,
    /// Fault injection, for tests only.
    #[serde(default, skip_serializing_if = "faults_unset")]
    pub faults: Faults,
    /// The model's context window, in tokens (default: the window of a well-known
    /// model name, else 32,768). A request that would not fit it less `max_tokens` is
    /// compacted first.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub context_window: Option<u32>,
}

/// The smallest context window a profile may name.
const MIN_CONTEXT_WINDOW: u32 = 1024;

fn default_provider() -> String {
    playbook::PROVIDER_NAME.to_owned()
}

fn faults_unset(f: &Faults) -> bool {
    !f.any()
}

/// A validated profile.
#[derive(Debug, Clone, PartialEq)]
pub struct Profile {
    /// The profile, defaults applied.
    pub profile: model::WorkerProfile,
    /// The same on the wire, as registered with the supervisor.
    pub wire: v1::WorkerProfile,
    /// The playbook, for the `playbook` provider.
    pub playbook: Option<PlaybookSpec>,
    /// The planner playbook, for a planner with the `playbook` provider.
    pub planner: Option<PlannerSpec>,
    /// Where the `openai` provider's server and key are.
    pub connection: Connection,
    /// The remote agent, for the `a2a` provider.
    pub remote: Option<RemoteSpec>,
    /// The bench's `hold`, if the profile has one.
    pub hold: Option<Hold>,
    /// Injected faults (none in real profiles).
    pub faults: Faults,
    /// The kinds of evidence each tool may record, by tool, the default first (see
    /// [`ProfileEntry::evidence_kinds`]).
    pub evidence_kinds: BTreeMap<String, Vec<String>>,
    /// The context window the profile names, if it names one (see
    /// [`ProfileEntry::context_window`]).
    pub context_window: Option<u32>,
}

impl Profile {
    /// The model's context window in tokens: the profile's, else that of its model.
    pub fn context_window(&self) -> u32 {
        self.context_window
            .unwrap_or_else(|| crate::agent::context::default_window(&self.profile.model))
    }
}

impl Profile {
    /// The kinds of evidence `tool` declares it may record, the default first, as this
    /// profile declares them for it; `None` when the profile declares none for it.
    pub fn evidence_kinds_of(&self, tool: &str) -> Option<&[String]> {
        self.evidence_kinds.get(tool).map(Vec::as_slice)
    }
}

/// Loads and validates a profiles file.
///
/// # Errors
///
/// The file cannot be read, does not parse, or a profile is invalid.
pub fn load(path: &Path) -> Result<Vec<Profile>, Error> {
    let shown = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|source| Error::Read {
        path: shown.clone(),
        source,
    })?;
    parse(&text, &shown)
}

/// The embedded example profiles.
///
/// # Errors
///
/// Only if the embedded file is broken, which the tests rule out.
pub fn example() -> Result<Vec<Profile>, Error> {
    parse(EXAMPLE_PROFILES, EXAMPLE_PROFILES_NAME)
}

/// Parses and validates profiles from YAML `text`; `shown` names the source in errors.
///
/// # Errors
///
/// The text does not parse, or a profile is invalid.
pub fn parse(text: &str, shown: &str) -> Result<Vec<Profile>, Error> {
    let file: ProfilesFile = serde_yaml::from_str(text).map_err(|e| Error::Parse {
        path: shown.to_owned(),
        detail: e.to_string(),
    })?;
    let invalid = |field: String, detail: String| Error::Invalid {
        path: shown.to_owned(),
        field,
        detail,
    };
    if file.profiles.is_empty() {
        return Err(invalid(
            "profiles".into(),
            "list at least one profile for the worker to serve".into(),
        ));
    }
    let mut ids = BTreeSet::new();
    let mut profiles = Vec::with_capacity(file.profiles.len());
    for (i, entry) in file.profiles.iter().enumerate() {
        let field = format!("profiles[{i}]");
        let profile = entry.validate(&field).map_err(|(f, d)| invalid(f, d))?;
        if !ids.insert(profile.profile.id.clone()) {
            return Err(invalid(
                format!("{field}.id"),
                format!("profile {} is listed twice", profile.profile.id),
            ));
        }
        profiles.push(profile);
    }
    Ok(profiles)
}

impl ProfileEntry {
    /// The wire form of the entry as written (no defaults applied).
    ///
    /// # Errors
    ///
    /// `(field, detail)` for a capability time range that is not RFC 3339.
    pub fn to_wire(&self, field: &str) -> Result<v1::WorkerProfile, (String, String)> {
        let capabilities = self
            .capabilities
            .iter()
            .enumerate()
            .map(|(j, s)| scope_to_proto(s, &format!("{field}.capabilities[{j}]")))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(v1::WorkerProfile {
            id: self.id.clone(),
            name: self.name.clone(),
            description: self.description.clone(),
            instructions: self.instructions.clone(),
            default_tools: self.default_tools.clone(),
            model: self.model.clone(),
            provider: self.provider.clone(),
            max_iterations: self.max_iterations,
            max_tokens: self.max_tokens,
            temperature: self.temperature,
            capabilities,
            evidence_prefixes: self.evidence_prefixes.clone(),
            supports_parallel_completion: self.supports_parallel_completion,
            version: self.version.clone(),
        })
    }

    /// Validates the entry; errors name the field below `field`.
    ///
    /// # Errors
    ///
    /// `(field, detail)` for the first invalid value.
    pub fn validate(&self, field: &str) -> Result<Profile, (String, String)> {
        let wire = self.to_wire(field)?;
        let profile = validate::worker_profile(&wire, field).map_err(|e| (e.field, e.message))?;
        if profile.provider.is_empty() {
            return Err((
                format!("{field}.provider"),
                format!("name a model provider, e.g. `{}`", playbook::PROVIDER_NAME),
            ));
        }
        self.check_evidence_kinds(field, &profile)?;
        self.check_script(field, &profile)?;
        let connection = self.connection(field, &profile.provider)?;
        let remote = self.remote(field, &profile)?;
        if profile.provider == openai::PROVIDER_NAME && profile.model.trim().is_empty() {
            return Err((
                format!("{field}.model"),
                "name the model the server should run, e.g. `gpt-4o-mini` or `llama3.1:8b` \
                 (CONVENE_MODEL overrides it for every openai profile)"
                    .into(),
            ));
        }
        self.faults.check(field)?;
        if let Some(window) = self.context_window
            && window < MIN_CONTEXT_WINDOW
        {
            return Err((
                format!("{field}.context_window"),
                format!(
                    "{window} tokens leave no room for a task; name the model's window \
                     (at least {MIN_CONTEXT_WINDOW}), or leave it out for the default of \
                     its model"
                ),
            ));
        }
        // The registered form carries the defaults, so the supervisor sees the limits
        // the worker actually applies.
        let wire = v1::WorkerProfile {
            id: profile.id.clone(),
            name: profile.name.clone(),
            description: profile.description.clone(),
            instructions: profile.instructions.clone(),
            default_tools: profile.default_tools.clone(),
            model: profile.model.clone(),
            provider: profile.provider.clone(),
            max_iterations: profile.max_iterations,
            max_tokens: profile.max_tokens,
            temperature: profile.temperature,
            capabilities: profile.capabilities.to_proto(),
            evidence_prefixes: profile.evidence_prefixes.clone(),
            supports_parallel_completion: profile.supports_parallel_completion,
            version: profile.version.clone(),
        };
        Ok(Profile {
            profile,
            wire,
            playbook: self.playbook.clone(),
            planner: self.planner.clone(),
            connection,
            remote,
            hold: self.hold.clone(),
            faults: self.faults.clone(),
            evidence_kinds: self.evidence_kinds.clone(),
            context_window: self.context_window,
        })
    }
}

impl ProfileEntry {
    /// Checks `evidence_kinds`: each for one of the profile's tools, a list of kinds the
    /// catalog's rules allow; and every playbook step names a kind its tool may record.
    fn check_evidence_kinds(
        &self,
        field: &str,
        profile: &model::WorkerProfile,
    ) -> Result<(), (String, String)> {
        for (tool, kinds) in &self.evidence_kinds {
            let at = format!("{field}.evidence_kinds.{tool}");
            if !profile.default_tools.contains(tool) {
                return Err((
                    at,
                    format!(
                        "{tool} is not one of the profile's default_tools ({}); declare kinds \
                         only for tools the profile uses",
                        profile.default_tools.join(", ")
                    ),
                ));
            }
            if kinds.is_empty() {
                return Err((
                    at,
                    "list the kinds the tool may record, the default first, e.g. \
                     [impact_metric]; leave the tool out to allow any kind"
                        .into(),
                ));
            }
            convene_mesh::policy_file::check_evidence_kinds(kinds).map_err(|m| (at, m))?;
        }
        if let Some(playbook) = &self.playbook {
            for (j, step) in playbook.steps.iter().enumerate() {
                if let Some(kinds) = self.evidence_kinds.get(&step.tool)
                    && !kinds.contains(&step.evidence_kind)
                {
                    return Err((
                        format!("{field}.playbook.steps[{j}].evidence_kind"),
                        format!(
                            "{} is not a kind {} may record here; evidence_kinds allows {}",
                            step.evidence_kind,
                            step.tool,
                            kinds.join(", ")
                        ),
                    ));
                }
            }
        }
        Ok(())
    }

    /// Checks the `playbook` or `planner` section against the provider: the `playbook`
    /// provider needs exactly one of them, other providers read neither.
    fn check_script(
        &self,
        field: &str,
        profile: &model::WorkerProfile,
    ) -> Result<(), (String, String)> {
        let provider = profile.provider.as_str();
        let section = match (&self.playbook, &self.planner) {
            (Some(_), Some(_)) => {
                return Err((
                    format!("{field}.planner"),
                    "a profile has at most one of `playbook` (a specialist's steps and rules) \
                     and `planner` (a planner's rounds); remove one"
                        .into(),
                ));
            }
            (Some(_), None) => Some("playbook"),
            (None, Some(_)) => Some("planner"),
            (None, None) => None,
        };
        if provider != playbook::PROVIDER_NAME {
            return match section {
                Some(key) => Err((
                    format!("{field}.{key}"),
                    format!(
                        "only the `{}` provider reads a {key} section; remove it or set \
                         provider to `{}` (this profile uses `{provider}`)",
                        playbook::PROVIDER_NAME,
                        playbook::PROVIDER_NAME
                    ),
                )),
                None => Ok(()),
            };
        }
        match (&self.playbook, &self.planner) {
            (Some(p), _) => p.validate(&profile.default_tools, &format!("{field}.playbook")),
            (_, Some(p)) => p.validate(&format!("{field}.planner")),
            (None, None) => Err((
                format!("{field}.playbook"),
                "the playbook provider needs a `playbook` section with steps and rules (or, \
                 for a planner, a `planner` section with rounds)"
                    .into(),
            )),
        }
    }

    /// The `a2a` provider's remote agent (required there), refused on other providers.
    fn remote(
        &self,
        field: &str,
        profile: &model::WorkerProfile,
    ) -> Result<Option<RemoteSpec>, (String, String)> {
        let provider = profile.provider.as_str();
        if provider != a2a::PROVIDER_NAME {
            let set = [
                ("url", self.url.is_some()),
                ("credential_env", self.credential_env.is_some()),
                ("credential_file", self.credential_file.is_some()),
            ];
            return match set.iter().find(|(_, on)| *on) {
                Some((key, _)) => Err((
                    format!("{field}.{key}"),
                    format!(
                        "only the `{}` provider reads {key}; remove it (this profile uses \
                         `{provider}`)",
                        a2a::PROVIDER_NAME
                    ),
                )),
                None => Ok(None),
            };
        }
        let Some(url) = self.url.clone().filter(|u| !u.trim().is_empty()) else {
            return Err((
                format!("{field}.url"),
                "name the remote agent the a2a provider calls: its base URL, e.g. \
                 https://agents.example.com, or the URL of its agent card"
                    .into(),
            ));
        };
        if !profile.default_tools.is_empty() {
            return Err((
                format!("{field}.default_tools"),
                "the remote agent serves an a2a profile's delegations; the worker calls no \
                 tool for it: remove default_tools"
                    .into(),
            ));
        }
        if let Some(var) = &self.credential_env
            && (var.trim().is_empty() || var.contains('=') || var.chars().any(char::is_whitespace))
        {
            return Err((
                format!("{field}.credential_env"),
                "name the environment variable that holds the agent's bearer credential, e.g. \
                 HISTORY_AGENT_TOKEN (the name, never the credential itself)"
                    .into(),
            ));
        }
        if self.credential_env.is_some() && self.credential_file.is_some() {
            return Err((
                format!("{field}.credential_file"),
                "give the agent's credential in a variable (credential_env) or a file \
                 (credential_file), not both"
                    .into(),
            ));
        }
        let spec = RemoteSpec {
            url,
            credential_env: self.credential_env.clone(),
            credential_file: self.credential_file.clone(),
        };
        spec.card_url().map_err(|e| (format!("{field}.url"), e))?;
        Ok(Some(spec))
    }

    /// The `openai` connection settings, refused on other providers.
    fn connection(&self, field: &str, provider: &str) -> Result<Connection, (String, String)> {
        let connection = Connection {
            base_url: self.base_url.clone(),
            api_key_env: self.api_key_env.clone(),
            api_key_file: self.api_key_file.clone(),
            stream: self.stream,
        };
        if provider != openai::PROVIDER_NAME {
            let set = [
                ("base_url", connection.base_url.is_some()),
                ("api_key_env", connection.api_key_env.is_some()),
                ("api_key_file", connection.api_key_file.is_some()),
                ("stream", connection.stream),
            ];
            if let Some((key, _)) = set.iter().find(|(_, on)| *on) {
                return Err((
                    format!("{field}.{key}"),
                    format!(
                        "only the `{}` provider reads {key}; remove it (this profile uses \
                         `{provider}`)",
                        openai::PROVIDER_NAME
                    ),
                ));
            }
            return Ok(connection);
        }
        if connection.api_key_env.is_some() && connection.api_key_file.is_some() {
            return Err((
                format!("{field}.api_key_file"),
                "give the key in a variable (api_key_env) or a file (api_key_file), not both"
                    .into(),
            ));
        }
        if let Some(var) = &connection.api_key_env
            && (var.trim().is_empty() || var.contains('=') || var.chars().any(char::is_whitespace))
        {
            return Err((
                format!("{field}.api_key_env"),
                "name the environment variable that holds the key, e.g. OPENAI_API_KEY (the \
                 name, never the key itself)"
                    .into(),
            ));
        }
        if let Some(url) = &connection.base_url
            && !(url.starts_with("http://") || url.starts_with("https://"))
        {
            return Err((
                format!("{field}.base_url"),
                format!(
                    "{url:?} is not an http:// or https:// URL; give the API base with its \
                     version path, e.g. http://localhost:11434/v1"
                ),
            ));
        }
        Ok(connection)
    }
}

/// Sets the model of every `openai` profile to `model` (the `CONVENE_MODEL` override),
/// in the profile and in its registered form.
pub fn override_model(profiles: &mut [Profile], model: &str) {
    let model = model.trim();
    if model.is_empty() {
        return;
    }
    for p in profiles
        .iter_mut()
        .filter(|p| p.profile.provider == openai::PROVIDER_NAME)
    {
        model.clone_into(&mut p.profile.model);
        model.clone_into(&mut p.wire.model);
    }
}

// ---------------------------------------------------------------------------------------
// Model providers by name.

/// Builds the provider for one profile from the profile's settings, or says what is
/// wrong with them.
pub type ProviderFactory =
    Arc<dyn Fn(&Profile) -> Result<Arc<dyn ModelProvider>, String> + Send + Sync>;

/// The model providers a worker knows, by the name profiles use.
#[derive(Clone, Default)]
pub struct ProviderRegistry {
    factories: BTreeMap<String, ProviderFactory>,
}

impl fmt::Debug for ProviderRegistry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ProviderRegistry")
            .field("providers", &self.factories.keys().collect::<Vec<_>>())
            .finish()
    }
}

/// A profile cannot get its provider.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProviderSetupError {
    /// The profile names a provider the registry does not know.
    #[error(
        "profile {profile} asks for model provider {provider:?}, which this worker does not \
         have (it has: {known}); set the profile's provider to one of them"
    )]
    Unknown {
        /// The profile.
        profile: String,
        /// The provider it names.
        provider: String,
        /// The providers the registry knows, comma-separated.
        known: String,
    },
    /// The provider refused the profile's settings.
    #[error("profile {profile}: provider {provider} cannot use its settings: {detail}")]
    Settings {
        /// The profile.
        profile: String,
        /// The provider.
        provider: String,
        /// What is wrong.
        detail: String,
    },
}

impl ProviderRegistry {
    /// A registry without providers.
    pub fn empty() -> Self {
        Self::default()
    }

    /// The providers built into the worker: [`crate::playbook`], playing the profile's
    /// `playbook` (or `planner`) section, [`crate::openai`], an OpenAI-compatible
    /// server, whose HTTP client uses `client`, and [`crate::a2a`], a remote A2A agent,
    /// here with an empty allowlist (every `a2a` profile refused): give the worker's
    /// with [`register_a2a`](Self::register_a2a).
    pub fn builtin(client: &ClientSettings) -> Self {
        let mut registry = Self::empty();
        registry.register(
            playbook::PROVIDER_NAME,
            Arc::new(|profile: &Profile| {
                if let Some(planner) = profile.planner.clone() {
                    return PlannerProvider::new(&profile.profile.id, planner)
                        .map(|p| Arc::new(p) as Arc<dyn ModelProvider>);
                }
                let spec = profile.playbook.clone().ok_or_else(|| {
                    "the playbook provider needs a `playbook` section with steps and rules (or, \
                     for a planner, a `planner` section with rounds)"
                        .to_owned()
                })?;
                PlaybookProvider::new(&profile.profile.id, &profile.profile.default_tools, spec)
                    .map(|p| Arc::new(p) as Arc<dyn ModelProvider>)
            }),
        );
        let client = client.clone();
        registry.register(
            openai::PROVIDER_NAME,
            Arc::new(move |profile: &Profile| {
                OpenAiProvider::new(&profile.connection, &client)
                    .map(|p| Arc::new(p) as Arc<dyn ModelProvider>)
            }),
        );
        registry.register_a2a(Arc::new(Allowlist::default()));
        registry
    }

    /// Registers (or replaces) the [`crate::a2a`] provider, calling only the agents
    /// `allow` admits; a profile whose URL it refuses keeps the worker from starting.
    pub fn register_a2a(&mut self, allow: Arc<Allowlist>) {
        self.register(
            a2a::PROVIDER_NAME,
            Arc::new(move |profile: &Profile| {
                let spec = profile.remote.as_ref().ok_or_else(|| {
                    "the a2a provider needs the remote agent's url in the profile".to_owned()
                })?;
                A2aProvider::new(&profile.profile.id, spec, allow.clone())
                    .map(|p| Arc::new(p) as Arc<dyn ModelProvider>)
            }),
        );
    }

    /// Adds (or replaces) the factory of provider `name`.
    pub fn register(&mut self, name: impl Into<String>, factory: ProviderFactory) {
        self.factories.insert(name.into(), factory);
    }

    /// The names of the known providers, sorted.
    pub fn names(&self) -> Vec<&str> {
        self.factories.keys().map(String::as_str).collect()
    }

    /// Builds the provider `profile` names.
    ///
    /// # Errors
    ///
    /// [`ProviderSetupError::Unknown`] for a provider the registry does not have,
    /// [`ProviderSetupError::Settings`] when the provider refuses the profile.
    pub fn build(&self, profile: &Profile) -> Result<Arc<dyn ModelProvider>, ProviderSetupError> {
        let name = profile.profile.provider.as_str();
        let factory = self
            .factories
            .get(name)
            .ok_or_else(|| ProviderSetupError::Unknown {
                profile: profile.profile.id.clone(),
                provider: name.to_owned(),
                known: self.names().join(", "),
            })?;
        factory(profile).map_err(|detail| ProviderSetupError::Settings {
            profile: profile.profile.id.clone(),
            provider: name.to_owned(),
            detail,
        })
    }
}

fn scope_to_proto(s: &ScopeEntry, field: &str) -> Result<v1::PermissionScope, (String, String)> {
    let time = |t: &Option<String>, which: &str| {
        t.as_deref()
            .map(|t| {
                humantime::parse_rfc3339(t)
                    .map(convene_core::time::to_timestamp)
                    .map_err(|e| {
                        (
                            format!("{field}.time_range.{which}"),
                            format!("{t:?} is not an RFC 3339 time ({e})"),
                        )
                    })
            })
            .transpose()
    };
    let time_range = match &s.time_range {
        Some(tr) => Some(v1::TimeRange {
            start: time(&tr.start, "start")?,
            end: time(&tr.end, "end")?,
        }),
        None => None,
    };
    let data_scope = (time_range.is_some() || s.max_rows.is_some()).then(|| v1::DataScope {
        time_range,
        max_rows: s.max_rows.unwrap_or(0),
    });
    Ok(v1::PermissionScope {
        action: s.action.clone(),
        resource: s.resource.clone(),
        data_scope,
    })
}

#[cfg(test)]
mod tests {
    use convene_core::permissions::Permission;

    use super::*;

    const MINIMAL: &str = r#"
profiles:
  - id: logs-investigator
    version: "1"
    default_tools: [search_logs@1]
    capabilities:
      - { action: "logs:read", resource: "service/*", max_rows: 100 }
    evidence_prefixes: ["logs://"]
    playbook:
      steps:
        - { id: errors, tool: search_logs@1, args: { service: payment-api }, evidence_kind: log_query }
      rules:
        - step: errors
          when: { path: matched, op: gt, value: 0 }
          claim: { claim_id: c1, topic: errors, value: some, statement: "{matched} errors" }
"#;

    fn invalid_field(text: &str) -> String {
        match parse(text, "p.yaml").unwrap_err() {
            Error::Invalid { field, .. } => field,
            other => panic!("expected an invalid field, got {other}"),
        }
    }

    const MODEL: &str = r#"
profiles:
  - id: logs-investigator
    version: "1"
    provider: openai
    model: llama3.1:8b
    base_url: http://localhost:11434/v1
    api_key_env: MY_MODEL_KEY
    default_tools: [search_logs@1]
    capabilities:
      - { action: "logs:read", resource: "service/*" }
    evidence_prefixes: ["logs://"]
"#;

    #[test]
    fn openai_profiles_name_their_server_and_where_the_key_is() {
        let mut profiles = parse(MODEL, "p.yaml").unwrap();
        let p = &profiles[0];
        assert_eq!(
            p.connection.base_url.as_deref(),
            Some("http://localhost:11434/v1")
        );
        assert_eq!(p.connection.api_key_env.as_deref(), Some("MY_MODEL_KEY"));
        assert_eq!(p.connection.key_source(), "the variable MY_MODEL_KEY");
        assert!(
            !p.connection.stream,
            "whole answers unless the profile streams"
        );
        let streaming = parse(
            &MODEL.replace(
                "    model: llama3.1:8b\n",
                "    model: llama3.1:8b\n    stream: true\n",
            ),
            "p.yaml",
        )
        .unwrap();
        assert!(streaming[0].connection.stream);
        // CONVENE_MODEL's override reaches the profile and its registered form.
        override_model(&mut profiles, "qwen2.5:7b");
        assert_eq!(profiles[0].profile.model, "qwen2.5:7b");
        assert_eq!(profiles[0].wire.model, "qwen2.5:7b");

        assert_eq!(
            invalid_field(&MODEL.replace("    model: llama3.1:8b\n", "")),
            "profiles[0].model"
        );
        assert_eq!(
            invalid_field(&MODEL.replace("http://localhost:11434/v1", "localhost:11434")),
            "profiles[0].base_url"
        );
        assert_eq!(
            invalid_field(&MODEL.replace("MY_MODEL_KEY", "sk-abc def")),
            "profiles[0].api_key_env"
        );
        assert_eq!(
            invalid_field(&MODEL.replace(
                "api_key_env: MY_MODEL_KEY",
                "api_key_env: K\n    api_key_file: /run/key"
            )),
            "profiles[0].api_key_file"
        );
        // Connection settings on a playbook profile are refused by name.
        assert_eq!(
            invalid_field(&MINIMAL.replace(
                "    version: \"1\"\n",
                "    version: \"1\"\n    base_url: http://x/v1\n"
            )),
            "profiles[0].base_url"
        );
        assert_eq!(
            invalid_field(&MINIMAL.replace(
                "    version: \"1\"\n",
                "    version: \"1\"\n    stream: true\n"
            )),
            "profiles[0].stream"
        );
        // A key written into the profile is an unknown field, not a setting.
        let err = parse(
            &MODEL.replace("api_key_env: MY_MODEL_KEY", "api_key: sk-1"),
            "p",
        )
        .unwrap_err();
        assert!(matches!(err, Error::Parse { .. }), "{err}");
    }

    const REMOTE: &str = r#"
profiles:
  - id: incident-history
    version: "1"
    provider: a2a
    url: https://agents.example.com/history
    credential_env: HISTORY_AGENT_TOKEN
    capabilities:
      - { action: "evidence:*", resource: "evidence" }
    evidence_prefixes: ["a2a://"]
"#;

    #[test]
    fn a2a_profiles_name_their_agent_and_where_its_credential_is() {
        let profiles = parse(REMOTE, "p.yaml").unwrap();
        let remote = profiles[0].remote.as_ref().unwrap();
        assert_eq!(remote.url, "https://agents.example.com/history");
        assert_eq!(
            remote.credential_env.as_deref(),
            Some("HISTORY_AGENT_TOKEN")
        );
        assert_eq!(profiles[0].profile.provider, "a2a");

        assert_eq!(
            invalid_field(&REMOTE.replace("    url: https://agents.example.com/history\n", "")),
            "profiles[0].url"
        );
        assert_eq!(
            invalid_field(&REMOTE.replace("https://agents.example.com/history", "agents.example")),
            "profiles[0].url"
        );
        assert_eq!(
            invalid_field(&REMOTE.replace("HISTORY_AGENT_TOKEN", "tok en")),
            "profiles[0].credential_env"
        );
        assert_eq!(
            invalid_field(&REMOTE.replace(
                "credential_env: HISTORY_AGENT_TOKEN",
                "credential_env: T\n    credential_file: /run/t"
            )),
            "profiles[0].credential_file"
        );
        assert_eq!(
            invalid_field(&REMOTE.replace(
                "    capabilities:",
                "    default_tools: [search_logs@1]\n    capabilities:"
            )),
            "profiles[0].default_tools"
        );
        // The remote agent's keys belong to the a2a provider alone.
        assert_eq!(
            invalid_field(&MINIMAL.replace(
                "    version: \"1\"\n",
                "    version: \"1\"\n    url: https://agents.example.com\n"
            )),
            "profiles[0].url"
        );
        // The built-in registry refuses every agent until the configuration allows it.
        let err = ProviderRegistry::builtin(&ClientSettings::default())
            .build(&profiles[0])
            .unwrap_err()
            .to_string();
        assert!(err.contains("incident-history"), "{err}");
        assert!(err.contains("a2a.allow"), "{err}");
    }

    #[test]
    fn the_a2a_example_profile_and_configuration_load() {
        let dir = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../examples/a2a");
        let profiles = load(&dir.join("profiles.yaml")).unwrap();
        assert_eq!(profiles.len(), 1);
        assert_eq!(profiles[0].profile.provider, a2a::PROVIDER_NAME);
        let config: crate::Config = convene_server::ConfigLoader::new()
            .file(dir.join("worker.toml"))
            .load()
            .unwrap();
        config.validate().unwrap();
        let allow = Arc::new(config.a2a.allowlist().unwrap());
        let card = profiles[0].remote.as_ref().unwrap().card_url().unwrap();
        allow.check_url(&card).unwrap();
    }

    #[test]
    fn minimal_profile_gets_defaults() {
        let profiles = parse(MINIMAL, "p.yaml").unwrap();
        let p = &profiles[0];
        assert_eq!(p.profile.provider, "playbook");
        assert_eq!(p.profile.name, "logs-investigator");
        assert_eq!(p.profile.max_iterations, 12);
        assert_eq!(p.wire.max_tokens, 8192);
        assert_eq!(p.wire.version, "1");
        assert!(!p.faults.any());
        let mut cap = Permission::new("logs:read", "service/*").unwrap();
        cap.data.max_rows = Some(100);
        assert!(p.profile.capabilities.covers(&cap));
    }

    #[test]
    fn errors_name_the_field() {
        assert_eq!(
            invalid_field(&MINIMAL.replace("version: \"1\"", "version: \"\"")),
            "profiles[0].version"
        );
        assert_eq!(
            invalid_field(&MINIMAL.replace("[search_logs@1]", "[search_logs]")),
            "profiles[0].default_tools[0]"
        );
        assert_eq!(
            invalid_field(&MINIMAL.replace("\"logs://\"", "\"logs\"")),
            "profiles[0].evidence_prefixes[0]"
        );
        assert_eq!(
            invalid_field(&MINIMAL.replace("tool: search_logs@1", "tool: query_metrics@1")),
            "profiles[0].playbook.steps[0].tool"
        );
        assert_eq!(
            invalid_field(&MINIMAL.replace("- step: errors", "- step: warnings")),
            "profiles[0].playbook.rules[0].step"
        );
        assert_eq!(
            invalid_field(&MINIMAL.replace("{matched} errors", "{matched errors")),
            "profiles[0].playbook.rules[0].claim.statement"
        );
        assert_eq!(
            invalid_field(&MINIMAL.replace("op: gt, value: 0", "op: gt")),
            "profiles[0].playbook.rules[0].when[0].value"
        );
        assert_eq!(
            invalid_field(&MINIMAL.replace(
                "evidence_prefixes",
                "provider: openai\n    evidence_prefixes"
            )),
            "profiles[0].playbook"
        );
        let twice = format!("{MINIMAL}{}", &MINIMAL[MINIMAL.find("  - id").unwrap()..]);
        assert_eq!(invalid_field(&twice), "profiles[1].id");
        assert_eq!(invalid_field("profiles: []"), "profiles");
    }

    #[test]
    fn a_profile_declares_the_evidence_kinds_of_its_tools() {
        let declared = |kinds: &str| {
            MINIMAL.replace(
                "    evidence_prefixes",
                &format!("    evidence_kinds:\n      {kinds}\n    evidence_prefixes"),
            )
        };
        let text = declared("search_logs@1: [log_query, causal_signal]");
        let profiles = parse(&text, "p.yaml").unwrap();
        assert_eq!(
            profiles[0].evidence_kinds_of("search_logs@1"),
            Some(&["log_query".to_owned(), "causal_signal".to_owned()][..])
        );
        assert_eq!(profiles[0].evidence_kinds_of("query_metrics@1"), None);
        // Left out: nothing declared, as before.
        assert_eq!(
            parse(MINIMAL, "p.yaml").unwrap()[0].evidence_kinds_of("search_logs@1"),
            None
        );
        for (bad, field) in [
            // Not one of the profile's tools.
            (
                "query_metrics@1: [impact_metric]",
                "profiles[0].evidence_kinds.query_metrics@1",
            ),
            (
                "search_logs@1: []",
                "profiles[0].evidence_kinds.search_logs@1",
            ),
            (
                "search_logs@1: [log_query, log_query]",
                "profiles[0].evidence_kinds.search_logs@1",
            ),
            // The playbook's step names a kind its tool may not record.
            (
                "search_logs@1: [causal_signal]",
                "profiles[0].playbook.steps[0].evidence_kind",
            ),
        ] {
            assert_eq!(invalid_field(&declared(bad)), field, "{bad}");
        }
    }

    #[test]
    fn unknown_keys_are_refused_by_name() {
        let err = parse(
            &MINIMAL.replace("evidence_prefixes", "evidence_prefix"),
            "p.yaml",
        )
        .unwrap_err();
        assert!(matches!(err, Error::Parse { .. }));
        assert!(err.to_string().contains("evidence_prefix"), "{err}");
        let err = parse(
            &MINIMAL.replace(
                "evidence_kind: log_query",
                "evidence_kind: log_query, kind: x",
            ),
            "p.yaml",
        )
        .unwrap_err();
        assert!(err.to_string().contains("kind"), "{err}");
    }

    const PLANNER: &str = r#"
profiles:
  - id: planner
    version: "1"
    planner:
      rounds:
        - delegate:
            - { profile_id: logs-investigator, goal: Find the errors }
      finish: { summary: "Decided {outcome}" }
"#;

    #[test]
    fn a_planner_profile_has_a_planner_section_and_no_playbook() {
        let profiles = parse(PLANNER, "p.yaml").unwrap();
        let p = &profiles[0];
        assert_eq!(p.profile.provider, "playbook");
        assert!(p.playbook.is_none());
        assert_eq!(p.planner.as_ref().unwrap().rounds.len(), 1);
        let provider = ProviderRegistry::builtin(&ClientSettings::default())
            .build(p)
            .unwrap();
        assert_eq!(provider.name(), "playbook");

        assert_eq!(
            invalid_field(&PLANNER.replace("goal: Find the errors", "goal: \"\"")),
            "profiles[0].planner.rounds[0].delegate[0].goal"
        );
        // At most one of playbook and planner, and only on the playbook provider.
        let both = PLANNER.replace(
            "    planner:\n",
            "    playbook: { steps: [] }\n    planner:\n",
        );
        match parse(&both, "p.yaml").unwrap_err() {
            Error::Invalid { field, detail, .. } => {
                assert_eq!(field, "profiles[0].planner");
                assert!(detail.contains("at most one"), "{detail}");
            }
            other => panic!("expected an invalid field, got {other}"),
        }
        assert_eq!(
            invalid_field(&PLANNER.replace(
                "    planner:\n",
                "    provider: openai\n    model: m\n    planner:\n"
            )),
            "profiles[0].planner"
        );
        let unknown = parse(&PLANNER.replace("goal: Find", "goals: Find"), "p.yaml");
        assert!(
            unknown.unwrap_err().to_string().contains("goals"),
            "unknown keys are refused by name"
        );
    }

    #[test]
    fn the_mcp_example_keeps_every_payment_incident_profile() {
        let path = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../../examples/mcp/profiles.yaml");
        let mcp = load(&path).unwrap();
        let base = example().unwrap();
        assert_eq!(&mcp[..base.len()], &base[..], "the copies drifted apart");
        let added: Vec<&str> = mcp[base.len()..]
            .iter()
            .map(|p| p.profile.id.as_str())
            .collect();
        assert_eq!(added, ["runbook-reader", "runbook-reader-model"]);
    }

    #[test]
    fn example_profiles_agree_with_the_example_policy() {
        let profiles = example().expect("the embedded example profiles are valid");
        let policy_path = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../../examples/payment-incident/policy.yaml");
        let policy = convene_mesh::policy_file::Policy::load(policy_path).unwrap();
        let ids: Vec<&str> = profiles.iter().map(|p| p.profile.id.as_str()).collect();
        assert_eq!(
            ids,
            [
                "logs-investigator",
                "metrics-investigator",
                "change-auditor",
                "logs-investigator-model",
                "metrics-investigator-model",
                "change-auditor-model",
                "incident-planner",
                "incident-planner-model"
            ]
        );
        // Each model-driven twin holds what its playbook specialist holds.
        for p in profiles.iter().filter(|p| p.profile.provider == "openai") {
            let twin = profiles
                .iter()
                .find(|t| format!("{}-model", t.profile.id) == p.profile.id)
                .unwrap();
            assert_eq!(p.profile.default_tools, twin.profile.default_tools);
            assert_eq!(p.profile.capabilities, twin.profile.capabilities);
            assert!(!p.profile.model.is_empty());
        }
        for p in &profiles {
            let entry = &policy.profiles[&p.profile.id];
            assert_eq!(p.profile.default_tools, entry.tools, "{}", p.profile.id);
            assert_eq!(
                p.profile.evidence_prefixes, entry.evidence_prefixes,
                "{}",
                p.profile.id
            );
            assert_eq!(
                p.profile.capabilities, entry.capabilities,
                "{}",
                p.profile.id
            );
            assert!(!p.faults.any(), "{} must not inject faults", p.profile.id);
        }
    }
}
