//! The policy file: principals and their grants, worker-profile capabilities, the tool
//! and action catalog with risk levels, and runtime rules.
//!
//! The policy service owns the decisions made from it; the supervisor and the approval
//! service read the principals (to authenticate callers; the supervisor also the
//! profiles a worker principal's workers may register) and the profiles (for evidence
//! prefixes). Unknown keys are refused, naming the key, and every pattern and risk level
//! is checked when the file is loaded, so a typo fails at start, not at the first call.
//!
//! Tools served by MCP servers are declared in the same catalog, as
//! `mcp:<server>/<tool>@<version>` ([`McpToolName`]) with an exact action and a
//! [`ResourceTemplate`] that builds each call's resource from its arguments. Workers
//! learn the declared ones from the policy service (`Policy.ListTools`) and mount
//! nothing else.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::time::Duration;

use convene_core::permissions::{Pattern, Permission, PermissionSet, RiskLevel, TimeWindow};
use serde::{Deserialize, Serialize};

mod mcp;
mod source;

pub use mcp::{
    MCP_TOOL_PREFIX, McpToolName, ResourceTemplate, TemplateError, check_mcp_server_name,
};
pub use source::{
    EXAMPLE_POLICY, EXAMPLE_POLICY_NAME, PolicySource, credential_hash, dev_credential,
    dev_credential_path,
};

/// Errors loading a policy file.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The file could not be read.
    #[error("cannot read policy file {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The file does not parse (syntax, unknown key, wrong type).
    #[error("policy file {path}: {detail}")]
    Parse {
        /// The file.
        path: String,
        /// What is wrong, naming the key.
        detail: String,
    },
    /// The file parses but says something invalid.
    #[error("policy file {path}: {field}: {detail}")]
    Invalid {
        /// The file.
        path: String,
        /// The offending field, e.g. `principals[1].grants[0].resource`.
        field: String,
        /// What is wrong and what to do.
        detail: String,
    },
}

/// One permission as written in the policy file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScopeEntry {
    /// Action pattern, e.g. `logs:read` or `logs:*`.
    pub action: String,
    /// Resource pattern, e.g. `service/*`.
    pub resource: String,
    /// Optional time window limit, RFC 3339 bounds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub time_range: Option<TimeRangeEntry>,
    /// Optional per-call row limit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_rows: Option<u64>,
}

/// A time window in the policy file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TimeRangeEntry {
    /// Inclusive start (RFC 3339).
    #[serde(default)]
    pub start: Option<String>,
    /// Exclusive end (RFC 3339).
    #[serde(default)]
    pub end: Option<String>,
}

/// In a principal's `profiles`: every profile.
pub const ANY_PROFILE: &str = "*";

/// What kind of principal a credential belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PrincipalKind {
    /// A person (approvers must be people).
    Human,
    /// A service of the mesh (the supervisor) or an automation.
    Service,
}

/// A principal: who may call, in which tenant, with which grants.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PrincipalEntry {
    /// Principal id, e.g. `oncall@acme`.
    pub id: String,
    /// Tenant the principal acts in.
    pub tenant: String,
    /// Human or service.
    pub kind: PrincipalKind,
    /// Hex SHA-256 of the principal's bearer credential(s). Credentials themselves never
    /// appear in the file.
    #[serde(default)]
    pub credential_sha256: Vec<String>,
    /// Roles: `runs:start`, `runs:read`, `runs:resolve` (resume a waiting run: settle a
    /// conflict, ask for a follow-up, close it), `approvals:decide`, `approvals:execute`,
    /// `tokens:issue`, `approvals:request`, `workers:register`.
    #[serde(default)]
    pub roles: Vec<String>,
    /// For a principal holding `workers:register`: the worker profiles its workers may
    /// serve (ids of `profiles:`, or `"*"` for any). A worker registering a profile not
    /// listed is refused. Absent or empty: none.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub profiles: Vec<String>,
    /// What the principal may access.
    #[serde(default)]
    pub grants: Vec<ScopeEntry>,
    /// What the principal may hand on to delegations; defaults to its grants.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub delegable: Option<Vec<ScopeEntry>>,
    /// For a principal holding `principals:act-as` (the operator console): whom it may
    /// act for. Only people of these tenants, and never a principal holding
    /// `principals:act-as`, `tokens:issue` or `workers:register`. Absent: no one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub act_as: Option<ActAsEntry>,
}

/// The bounds of a principal's `principals:act-as`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ActAsEntry {
    /// Tenants whose people the principal may act for.
    #[serde(default)]
    pub tenants: Vec<String>,
}

/// What a worker profile may ever hold, as policy sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProfileEntry {
    /// Profile id.
    pub id: String,
    /// Scopes the profile may ever hold.
    #[serde(default)]
    pub capabilities: Vec<ScopeEntry>,
    /// Tools it may be given (`name@version`).
    #[serde(default)]
    pub tools: Vec<String>,
    /// Evidence URI prefixes its claims may cite.
    #[serde(default)]
    pub evidence_prefixes: Vec<String>,
    /// Investigating profiles never receive tools above `max_risk` (runtime rules).
    #[serde(default)]
    pub investigating: bool,
}

/// A tool in the catalog.
///
/// A tool served by an MCP server is named `mcp:<server>/<tool>@<version>` (see
/// [`McpToolName`]): `<server>` is the name a worker's MCP configuration gives the
/// server, `<tool>` the name the server lists. Only the MCP tools declared here are ever
/// mounted by a worker, offered to a model or authorized. An MCP tool needs a
/// [`resource`](Self::resource) template and one exact action.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ToolEntry {
    /// `name@version`.
    pub name: String,
    /// The action every call of the tool performs, e.g. `logs:read`.
    pub action: String,
    /// How a call's resource is built from its arguments: text with `{argument}`
    /// placeholders, e.g. `runbook/{service}` (see [`ResourceTemplate`]). Required for
    /// MCP tools; the built-in tools build their resources themselves and leave it
    /// out. Authorize refuses a call whose resource the template cannot produce.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resource: Option<String>,
    /// Risk level `R0`..`R3`.
    pub risk: String,
    /// What it does.
    #[serde(default)]
    pub description: String,
    /// The kinds of evidence a call of the tool may record, e.g. `[runbook]`; the first
    /// is the default when a call names none. Left out: any kind, and the tool's own
    /// default. Declared for MCP tools only; a worker profile declares the kinds of the
    /// built-in tools it uses (its `evidence_kinds`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub evidence_kinds: Vec<String>,
}

/// An action that needs approval (never a tool an investigator holds).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ActionEntry {
    /// Action name, e.g. `rule:rollback`.
    pub name: String,
    /// Risk level `R0`..`R3`.
    pub risk: String,
    /// What it does.
    #[serde(default)]
    pub description: String,
}

/// A runtime rule.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RuleEntry {
    /// Rule name, reported in denials.
    pub name: String,
    /// Profiles it applies to (pattern); `investigating` applies it to every investigating
    /// profile.
    pub applies_to: String,
    /// Tools at or above this risk level are denied.
    pub deny_risk_at_or_above: String,
}

/// Token settings.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TokenSettings {
    /// Issuer (`iss`).
    #[serde(default = "default_issuer")]
    pub issuer: String,
    /// Default lifetime of a task token.
    #[serde(default = "default_ttl", with = "humantime_serde_compat")]
    pub default_ttl: Duration,
    /// Longest lifetime a task token may be given.
    #[serde(default = "default_max_ttl", with = "humantime_serde_compat")]
    pub max_ttl: Duration,
    /// Default authorized calls per token.
    #[serde(default = "default_max_calls")]
    pub default_max_calls: u32,
}

fn default_issuer() -> String {
    "convene-policy".to_owned()
}
fn default_ttl() -> Duration {
    Duration::from_secs(15 * 60)
}
fn default_max_ttl() -> Duration {
    Duration::from_secs(60 * 60)
}
fn default_max_calls() -> u32 {
    32
}

impl Default for TokenSettings {
    fn default() -> Self {
        Self {
            issuer: default_issuer(),
            default_ttl: default_ttl(),
            max_ttl: default_max_ttl(),
            default_max_calls: default_max_calls(),
        }
    }
}

mod humantime_serde_compat {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer};

    pub(super) fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&humantime::format_duration(*d).to_string())
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        let s = String::deserialize(d)?;
        humantime::parse_duration(&s).map_err(|e| {
            serde::de::Error::custom(format!("invalid duration {s:?} ({e}); write e.g. \"15m\""))
        })
    }
}

/// The policy file as written.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct PolicyFile {
    /// Token settings.
    #[serde(default)]
    pub tokens: TokenSettings,
    /// Principals.
    #[serde(default)]
    pub principals: Vec<PrincipalEntry>,
    /// Worker profiles' capabilities.
    #[serde(default)]
    pub profiles: Vec<ProfileEntry>,
    /// Tool catalog.
    #[serde(default)]
    pub tools: Vec<ToolEntry>,
    /// Actions that need approval.
    #[serde(default)]
    pub actions: Vec<ActionEntry>,
    /// Runtime rules.
    #[serde(default)]
    pub rules: Vec<RuleEntry>,
}

/// A principal, compiled.
#[derive(Debug, Clone, PartialEq)]
pub struct Principal {
    /// Principal id.
    pub id: String,
    /// Tenant.
    pub tenant: String,
    /// Human or service.
    pub kind: PrincipalKind,
    /// Roles.
    pub roles: BTreeSet<String>,
    /// Worker profiles its workers may serve (`"*"`: any); empty: none.
    pub profiles: BTreeSet<String>,
    /// Grants.
    pub grants: PermissionSet,
    /// Delegable scopes.
    pub delegable: PermissionSet,
    /// Tenants whose people it may act for (with `principals:act-as`); empty: none.
    pub act_as_tenants: BTreeSet<String>,
}

impl Principal {
    /// Whether the principal holds `role`.
    pub fn has_role(&self, role: &str) -> bool {
        self.roles.contains(role)
    }

    /// Whether workers registered by the principal may serve `profile` (its `profiles`
    /// list names it, or `"*"`).
    pub fn may_serve(&self, profile: &str) -> bool {
        self.profiles.contains(ANY_PROFILE) || self.profiles.contains(profile)
    }
}

/// A profile, compiled.
#[derive(Debug, Clone, PartialEq)]
pub struct Profile {
    /// Profile id.
    pub id: String,
    /// Capabilities.
    pub capabilities: PermissionSet,
    /// Tools it may be given.
    pub tools: Vec<String>,
    /// Evidence prefixes.
    pub evidence_prefixes: Vec<String>,
    /// Whether it investigates (runtime rules for investigators apply).
    pub investigating: bool,
}

/// A tool, compiled.
#[derive(Debug, Clone, PartialEq)]
pub struct Tool {
    /// `name@version`.
    pub name: String,
    /// Action each call performs.
    pub action: String,
    /// How a call's resource is built from its arguments (always set for MCP tools).
    pub resource: Option<ResourceTemplate>,
    /// Risk level.
    pub risk: RiskLevel,
    /// What it does.
    pub description: String,
    /// Kinds of evidence its calls may record, the default first; empty: any.
    pub evidence_kinds: Vec<String>,
}

/// A runtime rule, compiled.
#[derive(Debug, Clone, PartialEq)]
pub struct Rule {
    /// Name.
    pub name: String,
    /// `None`: every investigating profile; `Some(p)`: profiles matching `p`.
    pub applies_to: Option<Pattern>,
    /// Lowest denied risk level.
    pub deny_from: RiskLevel,
}

/// The policy file, validated and compiled for lookups.
#[derive(Debug, Clone, PartialEq)]
pub struct Policy {
    /// Token settings.
    pub tokens: TokenSettings,
    /// Principals by id.
    pub principals: BTreeMap<String, Principal>,
    /// Principal id by credential hash (hex SHA-256).
    pub credentials: BTreeMap<String, String>,
    /// Profiles by id.
    pub profiles: BTreeMap<String, Profile>,
    /// Tools by `name@version`.
    pub tools: BTreeMap<String, Tool>,
    /// Actions by name, with risk.
    pub actions: BTreeMap<String, RiskLevel>,
    /// Runtime rules, in file order.
    pub rules: Vec<Rule>,
}

impl Policy {
    /// Loads and compiles a policy file (`.yaml`, `.yml` or `.toml`).
    pub fn load(path: impl AsRef<Path>) -> Result<Self, Error> {
        let path = path.as_ref();
        let shown = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| Error::Read {
            path: shown.clone(),
            source,
        })?;
        let file = PolicyFile::parse(&text, path.extension().and_then(|e| e.to_str()), &shown)?;
        file.compile(&shown)
    }

    /// The runtime rule that denies `tool` to `profile`, if any.
    pub fn denying_rule(&self, profile: &Profile, tool: &Tool) -> Option<&Rule> {
        self.rules.iter().find(|r| {
            let applies = match &r.applies_to {
                None => profile.investigating,
                Some(p) => p.matches(&profile.id),
            };
            applies && tool.risk >= r.deny_from
        })
    }

    /// Risk of a named action or tool (`None`: not in the catalog).
    pub fn risk_of(&self, action: &str) -> Option<RiskLevel> {
        self.actions
            .get(action)
            .copied()
            .or_else(|| self.tools.get(action).map(|t| t.risk))
    }

    /// The principal `id`.
    pub fn principal(&self, id: &str) -> Option<&Principal> {
        self.principals.get(id)
    }

    /// The principal owning a bearer credential.
    pub fn principal_by_credential(&self, credential: &str) -> Option<&Principal> {
        let hash = credential_hash(credential);
        self.credentials
            .get(&hash)
            .and_then(|id| self.principals.get(id))
    }
}

impl PolicyFile {
    /// Parses text in the format given by `extension` (`yaml`/`yml`/`toml`).
    pub fn parse(text: &str, extension: Option<&str>, shown: &str) -> Result<Self, Error> {
        let parse_err = |detail: String| Error::Parse {
            path: shown.to_owned(),
            detail,
        };
        match extension {
            Some("yaml" | "yml") => {
                serde_yaml::from_str(text).map_err(|e| parse_err(e.to_string()))
            }
            Some("toml") => toml::from_str(text).map_err(|e| parse_err(e.to_string())),
            other => Err(parse_err(format!(
                "unknown file type {other:?}; name the policy file *.yaml, *.yml or *.toml"
            ))),
        }
    }

    /// Validates and compiles the file.
    pub fn compile(&self, shown: &str) -> Result<Policy, Error> {
        let invalid = |field: String, detail: String| Error::Invalid {
            path: shown.to_owned(),
            field,
            detail,
        };
        let risk = |s: &str, field: String| {
            RiskLevel::parse(s).ok_or_else(|| {
                invalid(
                    field,
                    format!("unknown risk level {s:?}; use R0, R1, R2 or R3"),
                )
            })
        };
        if self.tokens.default_ttl > self.tokens.max_ttl || self.tokens.default_ttl.is_zero() {
            return Err(invalid(
                "tokens.default_ttl".into(),
                "must be positive and not longer than tokens.max_ttl".into(),
            ));
        }

        let mut principals = BTreeMap::new();
        let mut credentials = BTreeMap::new();
        for (i, p) in self.principals.iter().enumerate() {
            let field = format!("principals[{i}]");
            if p.id.trim().is_empty() || p.tenant.trim().is_empty() {
                return Err(invalid(field, "id and tenant must not be empty".into()));
            }
            let grants = scope_set(&p.grants, &format!("{field}.grants"), &invalid)?;
            let delegable = match &p.delegable {
                Some(d) => scope_set(d, &format!("{field}.delegable"), &invalid)?,
                None => grants.clone(),
            };
            for (j, h) in p.credential_sha256.iter().enumerate() {
                let h = h.to_ascii_lowercase();
                if h.len() != 64 || !h.bytes().all(|b| b.is_ascii_hexdigit()) {
                    return Err(invalid(
                        format!("{field}.credential_sha256[{j}]"),
                        "must be 64 hex digits (sha256 of the credential)".into(),
                    ));
                }
                if let Some(other) = credentials.insert(h, p.id.clone()) {
                    return Err(invalid(
                        format!("{field}.credential_sha256[{j}]"),
                        format!("credential already belongs to principal {other}"),
                    ));
                }
            }
            let principal = Principal {
                id: p.id.clone(),
                tenant: p.tenant.clone(),
                kind: p.kind,
                roles: p.roles.iter().cloned().collect(),
                profiles: p.profiles.iter().cloned().collect(),
                grants,
                delegable,
                act_as_tenants: p
                    .act_as
                    .as_ref()
                    .map(|a| a.tenants.iter().cloned().collect())
                    .unwrap_or_default(),
            };
            if principals.insert(p.id.clone(), principal).is_some() {
                return Err(invalid(
                    format!("{field}.id"),
                    format!("duplicate principal {}", p.id),
                ));
            }
        }

        let mut tools = BTreeMap::new();
        for (i, t) in self.tools.iter().enumerate() {
            let field = format!("tools[{i}]");
            if !t
                .name
                .split_once('@')
                .is_some_and(|(n, v)| !n.is_empty() && !v.is_empty())
            {
                return Err(invalid(
                    format!("{field}.name"),
                    format!("{:?} must look like name@version", t.name),
                ));
            }
            Pattern::parse(&t.action).map_err(|m| invalid(format!("{field}.action"), m))?;
            let mcp =
                McpToolName::parse(&t.name).map_err(|m| invalid(format!("{field}.name"), m))?;
            if mcp.is_some() && t.action.ends_with('*') {
                return Err(invalid(
                    format!("{field}.action"),
                    format!(
                        "{:?} is a pattern; an MCP tool performs one action: name it exactly, \
                         e.g. `runbooks:read`",
                        t.action
                    ),
                ));
            }
            let resource = match (&t.resource, mcp) {
                (Some(text), _) => Some(
                    ResourceTemplate::parse(text)
                        .map_err(|m| invalid(format!("{field}.resource"), m))?,
                ),
                (None, Some(_)) => {
                    return Err(invalid(
                        format!("{field}.resource"),
                        "an MCP tool needs a resource template: the resource each call is \
                         authorized on, built from its arguments, e.g. `runbook/{service}`"
                            .into(),
                    ));
                }
                (None, None) => None,
            };
            if !t.evidence_kinds.is_empty() && mcp.is_none() {
                return Err(invalid(
                    format!("{field}.evidence_kinds"),
                    "only an MCP tool's catalog entry declares evidence kinds; declare the \
                     kinds of a built-in tool in the worker profiles that use it (their \
                     `evidence_kinds`)"
                        .into(),
                ));
            }
            check_evidence_kinds(&t.evidence_kinds)
                .map_err(|m| invalid(format!("{field}.evidence_kinds"), m))?;
            let tool = Tool {
                name: t.name.clone(),
                action: t.action.clone(),
                resource,
                risk: risk(&t.risk, format!("{field}.risk"))?,
                description: t.description.clone(),
                evidence_kinds: t.evidence_kinds.clone(),
            };
            if tools.insert(t.name.clone(), tool).is_some() {
                return Err(invalid(
                    format!("{field}.name"),
                    format!("duplicate tool {}", t.name),
                ));
            }
        }

        let mut actions = BTreeMap::new();
        for (i, a) in self.actions.iter().enumerate() {
            let field = format!("actions[{i}]");
            let level = risk(&a.risk, format!("{field}.risk"))?;
            if actions.insert(a.name.clone(), level).is_some() {
                return Err(invalid(
                    format!("{field}.name"),
                    format!("duplicate action {}", a.name),
                ));
            }
        }

        let mut profiles = BTreeMap::new();
        for (i, p) in self.profiles.iter().enumerate() {
            let field = format!("profiles[{i}]");
            for (j, t) in p.tools.iter().enumerate() {
                if !tools.contains_key(t) {
                    return Err(invalid(
                        format!("{field}.tools[{j}]"),
                        format!("tool {t} is not in the tool catalog (tools:)"),
                    ));
                }
            }
            for (j, prefix) in p.evidence_prefixes.iter().enumerate() {
                if !prefix.contains("://") {
                    return Err(invalid(
                        format!("{field}.evidence_prefixes[{j}]"),
                        format!("{prefix:?} must look like scheme://..."),
                    ));
                }
            }
            let profile = Profile {
                id: p.id.clone(),
                capabilities: scope_set(
                    &p.capabilities,
                    &format!("{field}.capabilities"),
                    &invalid,
                )?,
                tools: p.tools.clone(),
                evidence_prefixes: p.evidence_prefixes.clone(),
                investigating: p.investigating,
            };
            if profiles.insert(p.id.clone(), profile).is_some() {
                return Err(invalid(
                    format!("{field}.id"),
                    format!("duplicate profile {}", p.id),
                ));
            }
        }

        for (i, p) in self.principals.iter().enumerate() {
            for (j, id) in p.profiles.iter().enumerate() {
                if id != ANY_PROFILE && !profiles.contains_key(id) {
                    return Err(invalid(
                        format!("principals[{i}].profiles[{j}]"),
                        format!(
                            "profile {id:?} is not in profiles:; name one of its ids, or \"*\" \
                             for any"
                        ),
                    ));
                }
            }
        }

        let mut rules = Vec::new();
        for (i, r) in self.rules.iter().enumerate() {
            let field = format!("rules[{i}]");
            let applies_to = if r.applies_to == "investigating" {
                None
            } else {
                Some(
                    Pattern::parse(&r.applies_to)
                        .map_err(|m| invalid(format!("{field}.applies_to"), m))?,
                )
            };
            rules.push(Rule {
                name: r.name.clone(),
                applies_to,
                deny_from: risk(
                    &r.deny_risk_at_or_above,
                    format!("{field}.deny_risk_at_or_above"),
                )?,
            });
        }

        Ok(Policy {
            tokens: self.tokens.clone(),
            principals,
            credentials,
            profiles,
            tools,
            actions,
            rules,
        })
    }
}

/// Checks a list of evidence kinds a tool may record (a catalog entry's, or a worker
/// profile's for one tool): each a non-blank word of letters, digits, `_`, `-` or `.`,
/// none twice. The first is the default.
///
/// # Errors
///
/// What is wrong, naming the kind.
pub fn check_evidence_kinds(kinds: &[String]) -> Result<(), String> {
    for (i, kind) in kinds.iter().enumerate() {
        let word = !kind.is_empty()
            && kind.len() <= 100
            && kind
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'));
        if !word {
            return Err(format!(
                "{kind:?} must be 1-100 letters, digits, `_`, `-` or `.`, e.g. impact_metric"
            ));
        }
        if kinds[..i].contains(kind) {
            return Err(format!("{kind} is listed twice"));
        }
    }
    Ok(())
}

fn scope_set(
    entries: &[ScopeEntry],
    field: &str,
    invalid: &impl Fn(String, String) -> Error,
) -> Result<PermissionSet, Error> {
    let mut perms = Vec::with_capacity(entries.len());
    for (i, e) in entries.iter().enumerate() {
        let f = format!("{field}[{i}]");
        let mut p = Permission::new(&e.action, &e.resource)
            .map_err(|m| invalid(format!("{f}.action/resource"), m))?;
        p.data.max_rows = e.max_rows;
        if let Some(tr) = &e.time_range {
            let parse = |s: &Option<String>, which: &str| {
                s.as_deref()
                    .map(|s| {
                        humantime::parse_rfc3339(s).map_err(|err| {
                            invalid(
                                format!("{f}.time_range.{which}"),
                                format!("{s:?} is not RFC 3339 ({err})"),
                            )
                        })
                    })
                    .transpose()
            };
            p.data.time = TimeWindow {
                start: parse(&tr.start, "start")?,
                end: parse(&tr.end, "end")?,
            };
            if p.data.time.is_empty() {
                return Err(invalid(
                    format!("{f}.time_range"),
                    "start must be before end".into(),
                ));
            }
        }
        perms.push(p);
    }
    Ok(PermissionSet::from_permissions(perms))
}

#[cfg(test)]
mod tests {
    use super::*;

    const SAMPLE: &str = r#"
tokens: { default_ttl: 10m }
principals:
  - id: oncall@acme
    tenant: acme
    kind: human
    credential_sha256: ["2c26b46b68ffc68ff99b453c1d30413413422d706483bfa0f98a5e886266e7ae"]
    roles: [runs:start]
    grants: [{ action: "logs:*", resource: "service/*" }]
profiles:
  - id: logs-investigator
    capabilities: [{ action: "logs:read", resource: "*" }]
    tools: [search_logs@1]
    evidence_prefixes: ["logs://"]
    investigating: true
tools:
  - { name: search_logs@1, action: "logs:read", risk: R0 }
  - { name: restart@1, action: "service:restart", risk: R2 }
actions:
  - { name: "rule:rollback", risk: R3 }
rules:
  - { name: investigators-read-only, applies_to: investigating, deny_risk_at_or_above: R2 }
"#;

    #[test]
    fn sample_compiles_and_looks_up() {
        let policy = PolicyFile::parse(SAMPLE, Some("yaml"), "sample.yaml")
            .unwrap()
            .compile("sample.yaml")
            .unwrap();
        assert_eq!(policy.tokens.default_ttl, Duration::from_secs(600));
        let p = policy
            .principal_by_credential("foo")
            .expect("sha256(foo) is listed");
        assert_eq!(p.tenant, "acme");
        assert_eq!(p.delegable, p.grants);
        assert!(policy.principal_by_credential("bar").is_none());
        assert_eq!(policy.risk_of("rule:rollback"), Some(RiskLevel::R3));
        let profile = &policy.profiles["logs-investigator"];
        assert!(
            policy
                .denying_rule(profile, &policy.tools["restart@1"])
                .is_some()
        );
        assert!(
            policy
                .denying_rule(profile, &policy.tools["search_logs@1"])
                .is_none()
        );
    }

    #[test]
    fn dev_credentials_are_created_once_and_authenticate() {
        let dir = tempfile::tempdir().unwrap();
        let mut policy = PolicyFile::parse(SAMPLE, Some("yaml"), "s.yaml")
            .unwrap()
            .compile("s.yaml")
            .unwrap();
        // oncall@acme already has a credential listed; nobody else exists.
        assert!(policy.with_dev_credentials(dir.path()).unwrap().is_empty());
        let text = SAMPLE.replace("credential_sha256: [\"2c26b46b68ffc68ff99b453c1d30413413422d706483bfa0f98a5e886266e7ae\"]", "");
        let mut policy = PolicyFile::parse(&text, Some("yaml"), "s.yaml")
            .unwrap()
            .compile("s.yaml")
            .unwrap();
        assert_eq!(
            policy.with_dev_credentials(dir.path()).unwrap(),
            vec!["oncall@acme".to_owned()]
        );
        let secret = dev_credential(dir.path(), "oncall@acme").unwrap();
        assert!(secret.starts_with("cvn_") && secret.len() > 60);
        assert_eq!(
            policy.principal_by_credential(&secret).unwrap().id,
            "oncall@acme"
        );
        // A second load reuses the same secret.
        let mut again = PolicyFile::parse(&text, Some("yaml"), "s.yaml")
            .unwrap()
            .compile("s.yaml")
            .unwrap();
        again.with_dev_credentials(dir.path()).unwrap();
        assert!(again.principal_by_credential(&secret).is_some());
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt as _;
            let mode = std::fs::metadata(dev_credential_path(dir.path(), "oncall@acme"))
                .unwrap()
                .permissions()
                .mode();
            assert_eq!(
                mode & 0o077,
                0,
                "credential file must not be readable by others"
            );
        }
    }

    #[test]
    fn unknown_key_is_named() {
        let err = PolicyFile::parse("principals: []\nprincipels: []\n", Some("yaml"), "p.yaml")
            .unwrap_err();
        assert!(err.to_string().contains("principels"), "{err}");
    }

    #[test]
    fn invalid_values_name_the_field() {
        let text = SAMPLE.replace("risk: R3", "risk: R7");
        let err = PolicyFile::parse(&text, Some("yaml"), "p.yaml")
            .unwrap()
            .compile("p.yaml")
            .unwrap_err();
        assert!(err.to_string().contains("actions[0].risk"), "{err}");
        let text = SAMPLE.replace("tools: [search_logs@1]", "tools: [grep@1]");
        let err = PolicyFile::parse(&text, Some("yaml"), "p.yaml")
            .unwrap()
            .compile("p.yaml")
            .unwrap_err();
        assert!(err.to_string().contains("profiles[0].tools[0]"), "{err}");
    }

    fn compile(text: &str) -> Result<Policy, Error> {
        PolicyFile::parse(text, Some("yaml"), "p.yaml")?.compile("p.yaml")
    }

    #[test]
    fn mcp_tools_need_an_exact_action_and_a_resource_template() {
        let mcp = "  - { name: \"mcp:runbooks/lookup_runbook@1\", action: \"runbooks:read\", \
                   resource: \"runbook/{service}\", risk: R0, description: Runbook of a service }\n";
        let text = SAMPLE.replace(
            "tools:\n  - { name: search_logs@1",
            &format!("tools:\n{mcp}  - {{ name: search_logs@1"),
        );
        let policy = compile(&text).unwrap();
        let tool = &policy.tools["mcp:runbooks/lookup_runbook@1"];
        assert_eq!(
            tool.resource.as_ref().map(ResourceTemplate::as_str),
            Some("runbook/{service}")
        );
        assert_eq!(tool.description, "Runbook of a service");
        assert_eq!(policy.tools["search_logs@1"].resource, None);

        let err = compile(&text.replace(", resource: \"runbook/{service}\"", "")).unwrap_err();
        assert!(err.to_string().contains("tools[0].resource"), "{err}");
        assert!(err.to_string().contains("resource template"), "{err}");
        let err = compile(&text.replace("\"runbooks:read\"", "\"runbooks:*\"")).unwrap_err();
        assert!(err.to_string().contains("tools[0].action"), "{err}");
        let err = compile(&text.replace("runbook/{service}", "runbook/{service")).unwrap_err();
        assert!(err.to_string().contains("tools[0].resource"), "{err}");
        assert!(tool.evidence_kinds.is_empty());
        for bad in [
            "mcp:runbooks@1",
            "mcp:/lookup@1",
            "mcp:run books/lookup@1",
            "mcp:runbooks/lookup",
        ] {
            let err = compile(&text.replace("mcp:runbooks/lookup_runbook@1", bad)).unwrap_err();
            assert!(err.to_string().contains("tools[0].name"), "{bad}: {err}");
        }
    }

    #[test]
    fn an_mcp_tool_declares_the_evidence_kinds_it_may_record() {
        let mcp = "  - { name: \"mcp:runbooks/lookup_runbook@1\", action: \"runbooks:read\", \
                   resource: \"runbook/{service}\", risk: R0, evidence_kinds: [runbook, causal_signal] }\n";
        let text = SAMPLE.replace(
            "tools:\n  - { name: search_logs@1",
            &format!("tools:\n{mcp}  - {{ name: search_logs@1"),
        );
        let policy = compile(&text).unwrap();
        assert_eq!(
            policy.tools["mcp:runbooks/lookup_runbook@1"].evidence_kinds,
            ["runbook", "causal_signal"]
        );
        for (bad, why) in [
            ("[runbook, runbook]", "twice"),
            ("[\"\"]", "letters"),
            ("[\"run book\"]", "letters"),
        ] {
            let err = compile(&text.replace("[runbook, causal_signal]", bad)).unwrap_err();
            assert!(
                err.to_string().contains("tools[0].evidence_kinds"),
                "{bad}: {err}"
            );
            assert!(err.to_string().contains(why), "{bad}: {err}");
        }
        // A built-in tool's kinds are its profiles' to declare.
        let builtin = SAMPLE.replace(
            "{ name: search_logs@1",
            "{ evidence_kinds: [causal_signal], name: search_logs@1",
        );
        assert_ne!(builtin, SAMPLE);
        let err = compile(&builtin).unwrap_err();
        assert!(err.to_string().contains("evidence_kinds"), "{err}");
        assert!(err.to_string().contains("worker profiles"), "{err}");
    }

    #[test]
    fn the_profiles_a_principal_may_serve_are_named_or_any() {
        let with = |profiles: &str| {
            SAMPLE.replace(
                "    roles: [runs:start]\n",
                &format!("    roles: [runs:start]\n    profiles: {profiles}\n"),
            )
        };
        let listed = compile(&with("[logs-investigator]")).unwrap();
        let p = &listed.principals["oncall@acme"];
        assert!(p.may_serve("logs-investigator"));
        assert!(!p.may_serve("metrics-investigator"));
        let any = compile(&with("[\"*\"]")).unwrap();
        assert!(any.principals["oncall@acme"].may_serve("metrics-investigator"));
        // Absent: none.
        let none = compile(SAMPLE).unwrap();
        assert!(!none.principals["oncall@acme"].may_serve("logs-investigator"));
        // A typo fails at load, naming the entry.
        let err = compile(&with("[logs-investigater]"))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("principals[0].profiles[0]") && err.contains("logs-investigater"),
            "{err}"
        );
    }
}
