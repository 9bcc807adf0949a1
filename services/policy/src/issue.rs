//! IssueTaskToken's pure part: from a grant request to unsigned claims and a report of
//! what was narrowed.
//!
//! A top-level token carries `grants ∩ delegable ∩ capabilities ∩ task ∩ runtime`, where
//! the task term is the required scopes narrowed by the task's resource selectors and
//! time window, and runtime policy acts on tools (a rule removes tools at or above a
//! risk level from the profiles it applies to). A child token is computed the same way
//! for the parent's principal and further intersected with the parent's scopes; but
//! where a top-level request is narrowed and told so, a child that asks for more than
//! its parent holds is refused outright, so an agent never mistakes a silently smaller
//! token for the one it asked for.

use std::collections::BTreeSet;
use std::time::{Duration, SystemTime};

use convene_core::FieldPath;
use convene_core::permissions::{
    DataConstraints, Permission, PermissionSet, Terms, TimeWindow, effective, effective_tools,
    task_scope_set, time_window_from_proto,
};
use convene_core::time::from_duration;
use convene_mesh::policy_file::{Policy, Principal, Profile};
use convene_proto::v1;
use convene_tokens::{Claims, new_token_id, unix_seconds};

use crate::Error;

/// Most grants one IssueTaskToken call may ask for.
pub const MAX_GRANTS: usize = 256;

/// The audience entry of the evidence store: every task token may write and read
/// evidence there (within its scopes).
pub const EVIDENCE_STORE_AUDIENCE: &str = "convene-evidence-store";

/// The audience entry of the supervisor, added when the holder may redelegate (it
/// presents its token to the supervisor's Delegate call).
pub const SUPERVISOR_AUDIENCE: &str = "convene-supervisor";

/// The audience entry of the worker holding a token for `profile_id`.
pub fn worker_audience(profile_id: &str) -> String {
    format!("worker:{profile_id}")
}

/// Where a batch of tokens takes its permissions from.
pub(crate) enum Origin<'a> {
    /// The delegations of a run, on behalf of a principal.
    Principal {
        /// The principal.
        principal: &'a Principal,
        /// The run.
        run_id: &'a str,
    },
    /// Nested delegations, from the delegating worker's verified token.
    Parent {
        /// The parent token's principal (`sub`).
        principal: &'a Principal,
        /// The parent token's claims.
        parent: &'a Claims,
        /// The parent token's scopes.
        scopes: &'a PermissionSet,
    },
}

impl Origin<'_> {
    fn principal(&self) -> &Principal {
        match self {
            Origin::Principal { principal, .. } | Origin::Parent { principal, .. } => principal,
        }
    }

    fn parent(&self) -> Option<&Claims> {
        match self {
            Origin::Principal { .. } => None,
            Origin::Parent { parent, .. } => Some(parent),
        }
    }
}

/// A token ready to be signed, with the narrowing report.
pub(crate) struct Planned {
    /// The claims, scopes included.
    pub(crate) claims: Claims,
    /// What was asked for and not granted, and why.
    pub(crate) narrowed: Vec<String>,
}

/// Plans the token for `grant` (at `field`, e.g. `grants[3]`), issued at `now`.
pub(crate) fn plan(
    policy: &Policy,
    origin: &Origin<'_>,
    grant: &v1::TokenGrantRequest,
    field: &str,
    now: SystemTime,
) -> Result<Planned, Error> {
    let at = |name: &str| format!("{field}.{name}");
    if grant.delegation_id.trim().is_empty() {
        return Err(Error::invalid(
            at("delegation_id"),
            "must not be empty: name the delegation the token is bound to",
        ));
    }
    let profile = policy.profiles.get(&grant.profile_id).ok_or_else(|| {
        Error::invalid(
            at("profile_id"),
            format!(
                "unknown profile `{}`; the policy file defines: {}",
                grant.profile_id,
                list(policy.profiles.keys())
            ),
        )
    })?;
    check_depth(origin, grant, field)?;

    let required = grant
        .required_scopes
        .iter()
        .enumerate()
        .map(|(j, s)| {
            Permission::from_proto(s, &FieldPath::new(field).at("required_scopes").nth(j))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let task_term = task_term(grant.task_scope.as_ref(), field)?;
    // Each required scope narrowed by the task's own selectors and window: what the
    // task really asks for.
    let asked: Vec<PermissionSet> = required
        .iter()
        .map(|p| PermissionSet::from_permissions([p.clone()]).intersect(&task_term))
        .collect();

    if let Origin::Parent { scopes, .. } = origin {
        for (j, asked_j) in asked.iter().enumerate() {
            if let Some(wider) = asked_j.not_covered_by(scopes).next() {
                return Err(Error::PermissionDenied(format!(
                    "{field}.required_scopes[{j}]: `{wider}` is wider than the parent token \
                     allows: {}; a child token can only narrow its parent, so ask for a \
                     subset of the parent's scopes",
                    why_wider(wider, scopes)
                )));
            }
        }
        let parent = origin.parent().expect("a parent origin has a parent");
        for (k, tool) in grant.tools.iter().enumerate() {
            if !parent.tools.contains(tool) {
                return Err(Error::PermissionDenied(format!(
                    "{field}.tools[{k}]: tool `{tool}` is not among the parent token's tools \
                     [{}]; a child token can only narrow its parent",
                    parent.tools.join(", ")
                )));
            }
        }
    }

    let principal = origin.principal();
    let delegable = match origin {
        Origin::Principal { .. } => principal.delegable.clone(),
        Origin::Parent { scopes, .. } => principal.delegable.intersect(scopes),
    };
    let asked_all =
        PermissionSet::from_permissions(asked.iter().flat_map(|a| a.permissions().iter().cloned()));
    let runtime = PermissionSet::everything();
    let granted = effective(Terms {
        grants: &principal.grants,
        delegable: &delegable,
        capabilities: &profile.capabilities,
        task: &asked_all,
        runtime: &runtime,
    });

    let mut narrowed = Vec::new();
    for (j, (p, asked_j)) in required.iter().zip(&asked).enumerate() {
        if let Some(note) = scope_narrowing(
            j, p, asked_j, &granted, principal, &delegable, profile, origin,
        ) {
            narrowed.push(note);
        }
    }
    let tools = plan_tools(policy, origin, profile, &grant.tools, &mut narrowed);

    let (issued_at, expires_at) = lifetime(policy, origin, grant, field, now, &mut narrowed)?;
    let max_calls = max_calls(policy, origin, grant, field)?;

    let mut audience = vec![
        worker_audience(&profile.id),
        EVIDENCE_STORE_AUDIENCE.to_owned(),
    ];
    if grant.may_redelegate {
        audience.push(SUPERVISOR_AUDIENCE.to_owned());
    }
    let (tenant, run_id, parent_token_id) = match origin {
        Origin::Principal { principal, run_id } => {
            (principal.tenant.clone(), (*run_id).to_owned(), None)
        }
        Origin::Parent { parent, .. } => (
            parent.tenant.clone(),
            parent.run_id.clone(),
            Some(parent.token_id.clone()),
        ),
    };
    let mut claims = Claims {
        issuer: policy.tokens.issuer.clone(),
        subject: principal.id.clone(),
        audience,
        issued_at,
        not_before: issued_at,
        expires_at,
        token_id: new_token_id(),
        tenant,
        run_id,
        delegation_id: grant.delegation_id.clone(),
        profile_id: profile.id.clone(),
        depth: grant.depth,
        scopes: Vec::new(),
        tools: tools.into_iter().collect(),
        max_calls,
        may_redelegate: grant.may_redelegate,
        parent_token_id,
        lease_epoch: 0,
    };
    claims.set_permissions(&granted);
    Ok(Planned { claims, narrowed })
}

/// Depth must be at least 1, one more than a parent's, and within the run's max_depth.
fn check_depth(
    origin: &Origin<'_>,
    grant: &v1::TokenGrantRequest,
    field: &str,
) -> Result<(), Error> {
    if grant.depth == 0 {
        return Err(Error::invalid(
            format!("{field}.depth"),
            "must be at least 1: 1 for a run's own delegations, the parent's depth + 1 for \
             nested ones",
        ));
    }
    if let Some(parent) = origin.parent()
        && grant.depth != parent.depth.saturating_add(1)
    {
        return Err(Error::invalid(
            format!("{field}.depth"),
            format!(
                "must be {} (the parent token's depth {} + 1), not {}",
                parent.depth.saturating_add(1),
                parent.depth,
                grant.depth
            ),
        ));
    }
    if grant.max_depth > 0 && grant.depth > grant.max_depth {
        return Err(Error::FailedPrecondition(format!(
            "{field}: depth {} exceeds max_depth {}; the delegating agent must handle the task \
             itself",
            grant.depth, grant.max_depth
        )));
    }
    Ok(())
}

/// The task term: any action on the task's resource selectors within its window.
fn task_term(scope: Option<&v1::TaskScope>, field: &str) -> Result<PermissionSet, Error> {
    let Some(scope) = scope else {
        return Ok(PermissionSet::everything());
    };
    let window = match &scope.time_range {
        Some(tr) => {
            time_window_from_proto(tr, &FieldPath::new(field).at("task_scope").at("time_range"))?
        }
        None => TimeWindow::unbounded(),
    };
    task_scope_set(&scope.resources, window)
        .map_err(|m| Error::invalid(format!("{field}.task_scope.resources"), m))
}

/// The note for required scope `j` when the token does not carry all the task asked of
/// it, naming the terms that fell short and what was granted instead.
#[allow(clippy::too_many_arguments)] // each term is named in the note
fn scope_narrowing(
    j: usize,
    required: &Permission,
    asked: &PermissionSet,
    granted: &PermissionSet,
    principal: &Principal,
    delegable: &PermissionSet,
    profile: &Profile,
    origin: &Origin<'_>,
) -> Option<String> {
    if asked.is_empty() {
        return Some(format!(
            "required_scopes[{j}] `{required}`: outside the task scope's resources and time \
             range; nothing of it was granted"
        ));
    }
    if asked.is_subset_of(granted) {
        return None;
    }
    let mut short = Vec::new();
    let beyond_grants = !asked.is_subset_of(&principal.grants);
    if beyond_grants {
        short.push(format!("the grants of principal {}", principal.id));
    }
    // Delegable scopes default to the grants; naming them too would say the same twice.
    if !beyond_grants && !asked.is_subset_of(delegable) {
        short.push(match origin {
            Origin::Principal { .. } => format!("what principal {} may delegate", principal.id),
            Origin::Parent { .. } => "what the parent token may delegate".to_owned(),
        });
    }
    if !asked.is_subset_of(&profile.capabilities) {
        short.push(format!("the capabilities of profile {}", profile.id));
    }
    let kept = asked.intersect(granted);
    Some(format!(
        "required_scopes[{j}] `{required}`: beyond {}; granted {}",
        short.join(" and "),
        if kept.is_empty() {
            "nothing of it".to_owned()
        } else {
            describe(&kept)
        }
    ))
}

/// The token's tools (see [`effective_tools`]), noting every asked tool left out and why.
fn plan_tools(
    policy: &Policy,
    origin: &Origin<'_>,
    profile: &Profile,
    requested: &[String],
    narrowed: &mut Vec<String>,
) -> BTreeSet<String> {
    let parent_tools = origin.parent().map(|p| &p.tools);
    let allowed = |t: &str| {
        policy
            .tools
            .get(t)
            .is_some_and(|tool| policy.denying_rule(profile, tool).is_none())
            && parent_tools.is_none_or(|tools| tools.iter().any(|p| p == t))
    };
    let tools = effective_tools(requested, &profile.tools, allowed);
    let asked = if requested.is_empty() {
        &profile.tools
    } else {
        requested
    };
    let mut seen = BTreeSet::new();
    for tool in asked {
        if tools.contains(tool) || !seen.insert(tool) {
            continue;
        }
        let why = if !profile.tools.contains(tool) {
            format!(
                "not among the tools of profile {} [{}]",
                profile.id,
                profile.tools.join(", ")
            )
        } else if let Some(entry) = policy.tools.get(tool) {
            match policy.denying_rule(profile, entry) {
                Some(rule) => format!(
                    "risk {} is denied to profile {} by runtime rule `{}`",
                    entry.risk, profile.id, rule.name
                ),
                None => "not among the parent token's tools".to_owned(),
            }
        } else {
            "not in the tool catalog".to_owned()
        };
        narrowed.push(format!("tool `{tool}`: {why}"));
    }
    tools
}

/// `iat` and `exp`: the asked lifetime (or the default), capped by the policy's
/// maximum and, for a child, by the parent's expiry.
fn lifetime(
    policy: &Policy,
    origin: &Origin<'_>,
    grant: &v1::TokenGrantRequest,
    field: &str,
    now: SystemTime,
    narrowed: &mut Vec<String>,
) -> Result<(u64, u64), Error> {
    let asked = match &grant.ttl {
        Some(d) => {
            Some(from_duration(d, &FieldPath::new(field).at("ttl"))?).filter(|d| !d.is_zero())
        }
        None => None,
    };
    if asked.is_some_and(|d| d < Duration::from_secs(1)) {
        return Err(Error::invalid(
            format!("{field}.ttl"),
            "must be at least 1s (token times are whole seconds), or 0 for the policy default",
        ));
    }
    let max = policy.tokens.max_ttl;
    let mut ttl = asked.unwrap_or(policy.tokens.default_ttl);
    if ttl > max {
        narrowed.push(format!(
            "ttl {}: capped at the policy's max_ttl {}",
            humantime::format_duration(ttl),
            humantime::format_duration(max)
        ));
        ttl = max;
    }
    let issued_at = unix_seconds(now);
    let mut expires_at = issued_at.saturating_add(ttl.as_secs().max(1));
    if let Some(parent) = origin.parent()
        && expires_at > parent.expires_at
    {
        narrowed.push(format!(
            "ttl {}: shortened to the parent token's expiry",
            humantime::format_duration(ttl)
        ));
        expires_at = parent.expires_at;
    }
    Ok((issued_at, expires_at))
}

/// The token's call limit: asked or the policy default, never above a parent's.
fn max_calls(
    policy: &Policy,
    origin: &Origin<'_>,
    grant: &v1::TokenGrantRequest,
    field: &str,
) -> Result<u32, Error> {
    let default = policy.tokens.default_max_calls;
    match origin.parent() {
        None if grant.max_calls == 0 => Ok(default),
        None => Ok(grant.max_calls),
        Some(parent) if grant.max_calls == 0 => Ok(default.min(parent.max_calls)),
        Some(parent) if grant.max_calls > parent.max_calls => {
            Err(Error::PermissionDenied(format!(
                "{field}.max_calls {} exceeds the parent token's max_calls {}; a child token \
                 can only narrow its parent",
                grant.max_calls, parent.max_calls
            )))
        }
        Some(_) => Ok(grant.max_calls),
    }
}

/// Why `asked` is not covered by `parent`: no scope reaches its action and resource, or
/// the ones that do limit its data more.
fn why_wider(asked: &Permission, parent: &PermissionSet) -> String {
    let reaching: Vec<&Permission> = parent
        .permissions()
        .iter()
        .filter(|p| p.action.covers(&asked.action) && p.resource.covers(&asked.resource))
        .collect();
    if reaching.is_empty() {
        return format!(
            "no parent scope reaches that action on that resource (the parent holds {})",
            describe(parent)
        );
    }
    let limits: Vec<String> = reaching.iter().map(|p| describe_data(&p.data)).collect();
    format!(
        "it asks for {} where the parent limits it to {}; set the same limits in the \
         scope's data_scope or the task_scope's time_range",
        describe_data(&asked.data),
        limits.join(" or ")
    )
}

/// `time [a, b), max_rows N` in words.
pub(crate) fn describe_data(data: &DataConstraints) -> String {
    let bound = |t: Option<SystemTime>| {
        t.map_or_else(
            || "unbounded".to_owned(),
            |t| humantime::format_rfc3339_seconds(t).to_string(),
        )
    };
    let time = if data.time == TimeWindow::unbounded() {
        "no time range".to_owned()
    } else {
        format!(
            "time [{}, {})",
            bound(data.time.start),
            bound(data.time.end)
        )
    };
    let rows = data
        .max_rows
        .map_or_else(|| "no row limit".to_owned(), |r| format!("max_rows {r}"));
    format!("{time}, {rows}")
}

/// `[a on x, b on y]`, or `nothing` for the empty set.
pub(crate) fn describe(set: &PermissionSet) -> String {
    if set.is_empty() {
        return "nothing".to_owned();
    }
    let items: Vec<String> = set.permissions().iter().map(ToString::to_string).collect();
    format!("[{}]", items.join(", "))
}

/// `a, b, c` of some names, or `none`.
pub(crate) fn list<'a>(names: impl Iterator<Item = &'a String>) -> String {
    let names: Vec<&str> = names.map(String::as_str).collect();
    if names.is_empty() {
        "none".to_owned()
    } else {
        names.join(", ")
    }
}

#[cfg(test)]
mod tests {
    use convene_mesh::policy_file::PolicyFile;

    use super::*;

    const POLICY: &str = r#"
tokens: { default_ttl: 10m, max_ttl: 30m, default_max_calls: 8 }
principals:
  - id: oncall
    tenant: acme
    kind: human
    grants:
      - { action: "logs:read", resource: "service/*" }
      - { action: "evidence:*", resource: "evidence" }
profiles:
  - id: logs
    investigating: true
    tools: [search_logs@1, rollback@1]
    capabilities:
      - { action: "logs:*", resource: "*", max_rows: 100 }
      - { action: "evidence:*", resource: "evidence" }
tools:
  - { name: search_logs@1, action: "logs:read", risk: R0 }
  - { name: rollback@1, action: "rules:write", risk: R3 }
rules:
  - { name: read-only, applies_to: investigating, deny_risk_at_or_above: R2 }
"#;

    fn policy() -> Policy {
        PolicyFile::parse(POLICY, Some("yaml"), "t.yaml")
            .unwrap()
            .compile("t.yaml")
            .unwrap()
    }

    fn scope(action: &str, resource: &str) -> v1::PermissionScope {
        v1::PermissionScope {
            action: action.into(),
            resource: resource.into(),
            data_scope: None,
        }
    }

    fn grant() -> v1::TokenGrantRequest {
        v1::TokenGrantRequest {
            delegation_id: "del-1".into(),
            profile_id: "logs".into(),
            depth: 1,
            required_scopes: vec![
                scope("logs:*", "service/*"),
                scope("evidence:write", "evidence"),
            ],
            task_scope: Some(v1::TaskScope {
                resources: vec!["service/payment-*".into(), "evidence".into()],
                time_range: None,
            }),
            ..Default::default()
        }
    }

    #[test]
    fn top_level_tokens_carry_the_intersection_and_say_what_was_dropped() {
        let policy = policy();
        let origin = Origin::Principal {
            principal: &policy.principals["oncall"],
            run_id: "run-1",
        };
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000);
        let planned = plan(&policy, &origin, &grant(), "grants[0]", now).unwrap();
        let c = &planned.claims;
        let scopes = c.permissions().unwrap();
        let mut logs = Permission::new("logs:read", "service/payment-*").unwrap();
        logs.data.max_rows = Some(100);
        let expected = PermissionSet::from_permissions([
            logs,
            Permission::new("evidence:write", "evidence").unwrap(),
        ]);
        assert_eq!(scopes, expected);
        assert_eq!(c.tools, vec!["search_logs@1".to_owned()]);
        assert_eq!((c.issued_at, c.expires_at), (1_000, 1_600));
        assert_eq!(c.max_calls, 8);
        assert_eq!(c.tenant, "acme");
        assert_eq!(c.audience, vec!["worker:logs", "convene-evidence-store"]);
        let notes = planned.narrowed.join("\n");
        assert!(notes.contains("required_scopes[0]"), "{notes}");
        assert!(notes.contains("the grants of principal oncall"), "{notes}");
        assert!(notes.contains("tool `rollback@1`"), "{notes}");
        assert!(notes.contains("runtime rule `read-only`"), "{notes}");
        assert!(!notes.contains("required_scopes[1]"), "{notes}");
    }

    #[test]
    fn depth_limits_and_lifetimes() {
        let policy = policy();
        let origin = Origin::Principal {
            principal: &policy.principals["oncall"],
            run_id: "run-1",
        };
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000);
        let deep = v1::TokenGrantRequest {
            depth: 4,
            max_depth: 3,
            ..grant()
        };
        let err = plan(&policy, &origin, &deep, "grants[0]", now)
            .err()
            .unwrap();
        assert!(
            matches!(&err, Error::FailedPrecondition(m) if m.contains("depth 4 exceeds max_depth 3; the delegating agent must handle the task itself")),
            "{err}"
        );
        let long = v1::TokenGrantRequest {
            ttl: Some(prost_types::Duration {
                seconds: 7200,
                nanos: 0,
            }),
            ..grant()
        };
        let planned = plan(&policy, &origin, &long, "grants[0]", now).unwrap();
        assert_eq!(planned.claims.expires_at, 1_000 + 1_800);
        assert!(planned.narrowed.iter().any(|n| n.contains("max_ttl 30m")));
        let zero_depth = v1::TokenGrantRequest {
            depth: 0,
            ..grant()
        };
        let err = plan(&policy, &origin, &zero_depth, "grants[2]", now)
            .err()
            .unwrap();
        assert!(
            err.to_string().starts_with("invalid grants[2].depth"),
            "{err}"
        );
    }
}
