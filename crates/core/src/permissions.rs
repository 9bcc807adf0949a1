//! Structured permissions and their intersection.
//!
//! A [`Permission`] is an action pattern, a resource pattern and data constraints (time
//! window, row limit). Patterns are exact strings or prefixes ending in `*`; `*` alone
//! matches everything. A [`PermissionSet`] is a union of permissions.
//!
//! The effective permissions of a task are
//! `grants ∩ delegable ∩ capabilities ∩ task scope ∩ runtime policy` ([`effective`]).
//! Every element of an intersection is the intersection of one element of each side, so
//! it is covered by each side: the effective set is a subset of every input, and a child
//! computed from its parent can only narrow it.

use std::cmp::Ordering;
use std::collections::BTreeSet;
use std::fmt;
use std::time::SystemTime;

use convene_proto::v1;

use crate::time::{from_timestamp, to_timestamp};
use crate::{FieldPath, Rule, ValidationError};

/// An exact string or a `*`-suffixed prefix.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Pattern {
    /// Matches exactly this string.
    Exact(String),
    /// Matches every string that starts with this prefix (`""` matches everything).
    Prefix(String),
}

impl Pattern {
    /// Parses `abc`, `abc*` or `*`. A `*` anywhere but at the end is refused.
    pub fn parse(s: &str) -> Result<Self, String> {
        if s.is_empty() {
            return Err("must not be empty (use `*` for everything)".into());
        }
        let (body, prefix) = match s.strip_suffix('*') {
            Some(body) => (body, true),
            None => (s, false),
        };
        if body.contains('*') {
            return Err(format!(
                "`{s}`: `*` is only allowed at the end of a pattern"
            ));
        }
        if body.chars().any(char::is_whitespace) {
            return Err(format!("`{s}`: patterns must not contain whitespace"));
        }
        Ok(if prefix {
            Pattern::Prefix(body.to_owned())
        } else {
            Pattern::Exact(body.to_owned())
        })
    }

    /// The pattern matching everything.
    pub fn any() -> Self {
        Pattern::Prefix(String::new())
    }

    /// Whether `s` matches.
    pub fn matches(&self, s: &str) -> bool {
        match self {
            Pattern::Exact(e) => e == s,
            Pattern::Prefix(p) => s.starts_with(p.as_str()),
        }
    }

    /// Whether every string this pattern matches is matched by `self` too.
    pub fn covers(&self, other: &Pattern) -> bool {
        match (self, other) {
            (Pattern::Exact(a), Pattern::Exact(b)) => a == b,
            (Pattern::Exact(_), Pattern::Prefix(_)) => false,
            (Pattern::Prefix(p), Pattern::Exact(b)) => b.starts_with(p.as_str()),
            (Pattern::Prefix(p), Pattern::Prefix(q)) => q.starts_with(p.as_str()),
        }
    }

    /// The pattern matching exactly what both match, or `None` when nothing is.
    pub fn intersect(&self, other: &Pattern) -> Option<Pattern> {
        if self.covers(other) {
            Some(other.clone())
        } else if other.covers(self) {
            Some(self.clone())
        } else {
            None
        }
    }
}

impl fmt::Display for Pattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Pattern::Exact(e) => f.write_str(e),
            Pattern::Prefix(p) => write!(f, "{p}*"),
        }
    }
}

/// A time window `[start, end)`; `None` bounds are unbounded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct TimeWindow {
    /// Inclusive start.
    pub start: Option<SystemTime>,
    /// Exclusive end.
    pub end: Option<SystemTime>,
}

impl TimeWindow {
    /// The unbounded window.
    pub fn unbounded() -> Self {
        Self::default()
    }

    /// Whether the window contains no instant.
    pub fn is_empty(&self) -> bool {
        matches!((self.start, self.end), (Some(s), Some(e)) if s >= e)
    }

    /// Whether `other` lies inside `self`.
    pub fn covers(&self, other: &TimeWindow) -> bool {
        let start_ok = match (self.start, other.start) {
            (None, _) => true,
            (Some(_), None) => false,
            (Some(a), Some(b)) => a <= b,
        };
        let end_ok = match (self.end, other.end) {
            (None, _) => true,
            (Some(_), None) => false,
            (Some(a), Some(b)) => a >= b,
        };
        start_ok && end_ok
    }

    /// The overlap of both windows, or `None` when they do not overlap.
    pub fn intersect(&self, other: &TimeWindow) -> Option<TimeWindow> {
        let start = match (self.start, other.start) {
            (Some(a), Some(b)) => Some(a.max(b)),
            (a, b) => a.or(b),
        };
        let end = match (self.end, other.end) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        let w = TimeWindow { start, end };
        (!w.is_empty()).then_some(w)
    }
}

/// Data-scope constraints of a permission. Every set constraint must hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct DataConstraints {
    /// The data must lie inside this window.
    pub time: TimeWindow,
    /// At most this many rows per call (None: no limit).
    pub max_rows: Option<u64>,
}

impl DataConstraints {
    /// No constraint at all.
    pub fn unconstrained() -> Self {
        Self::default()
    }

    /// Whether every access allowed by `other` is allowed by `self`.
    pub fn covers(&self, other: &DataConstraints) -> bool {
        let rows_ok = match (self.max_rows, other.max_rows) {
            (None, _) => true,
            (Some(_), None) => false,
            (Some(a), Some(b)) => b <= a,
        };
        rows_ok && self.time.covers(&other.time)
    }

    /// Constraints allowing what both allow, or `None` when that is nothing.
    pub fn intersect(&self, other: &DataConstraints) -> Option<DataConstraints> {
        let time = self.time.intersect(&other.time)?;
        let max_rows = match (self.max_rows, other.max_rows) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        Some(DataConstraints { time, max_rows })
    }
}

/// One structured permission.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Permission {
    /// Action pattern, e.g. `logs:read` or `logs:*`.
    pub action: Pattern,
    /// Resource pattern, e.g. `service/payment-*`.
    pub resource: Pattern,
    /// Data constraints.
    pub data: DataConstraints,
}

impl Permission {
    /// A permission from pattern strings without data constraints.
    pub fn new(action: &str, resource: &str) -> Result<Self, String> {
        Ok(Self {
            action: Pattern::parse(action)?,
            resource: Pattern::parse(resource)?,
            data: DataConstraints::unconstrained(),
        })
    }

    /// The permission allowing everything.
    pub fn everything() -> Self {
        Self {
            action: Pattern::any(),
            resource: Pattern::any(),
            data: DataConstraints::unconstrained(),
        }
    }

    /// The same permission with these data constraints.
    #[must_use]
    pub fn with_data(mut self, data: DataConstraints) -> Self {
        self.data = data;
        self
    }

    /// Whether everything `other` allows, `self` allows.
    pub fn covers(&self, other: &Permission) -> bool {
        self.action.covers(&other.action)
            && self.resource.covers(&other.resource)
            && self.data.covers(&other.data)
    }

    /// The permission allowing what both allow, or `None` when that is nothing.
    pub fn intersect(&self, other: &Permission) -> Option<Permission> {
        Some(Permission {
            action: self.action.intersect(&other.action)?,
            resource: self.resource.intersect(&other.resource)?,
            data: self.data.intersect(&other.data)?,
        })
    }

    /// Converts a wire scope, naming `field` when it is invalid.
    pub fn from_proto(
        p: &v1::PermissionScope,
        field: &(impl fmt::Display + ?Sized),
    ) -> Result<Self, ValidationError> {
        let field = FieldPath::shown(&field);
        let action = Pattern::parse(&p.action)
            .map_err(|m| ValidationError::new(field.at("action"), Rule::Format, m))?;
        let resource = Pattern::parse(&p.resource)
            .map_err(|m| ValidationError::new(field.at("resource"), Rule::Format, m))?;
        let data = match &p.data_scope {
            None => DataConstraints::unconstrained(),
            Some(ds) => DataConstraints {
                time: match &ds.time_range {
                    None => TimeWindow::unbounded(),
                    Some(tr) => {
                        time_window_from_proto(tr, &field.at("data_scope").at("time_range"))?
                    }
                },
                max_rows: (ds.max_rows > 0).then_some(ds.max_rows),
            },
        };
        Ok(Permission {
            action,
            resource,
            data,
        })
    }

    /// Converts to the wire form.
    pub fn to_proto(&self) -> v1::PermissionScope {
        let data_scope = (self.data != DataConstraints::unconstrained()).then(|| v1::DataScope {
            time_range: time_window_to_proto(&self.data.time),
            max_rows: self.data.max_rows.unwrap_or(0),
        });
        v1::PermissionScope {
            action: self.action.to_string(),
            resource: self.resource.to_string(),
            data_scope,
        }
    }
}

impl fmt::Display for Permission {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} on {}", self.action, self.resource)?;
        if let Some(rows) = self.data.max_rows {
            write!(f, " (≤{rows} rows)")?;
        }
        if self.data.time != TimeWindow::unbounded() {
            f.write_str(" (time-limited)")?;
        }
        Ok(())
    }
}

/// Converts a wire time range, naming `field` when it is invalid or empty.
pub fn time_window_from_proto(
    tr: &v1::TimeRange,
    field: &(impl fmt::Display + ?Sized),
) -> Result<TimeWindow, ValidationError> {
    let field = FieldPath::shown(&field);
    let start = tr
        .start
        .as_ref()
        .map(|t| from_timestamp(t, &field.at("start")))
        .transpose()?;
    let end = tr
        .end
        .as_ref()
        .map(|t| from_timestamp(t, &field.at("end")))
        .transpose()?;
    let w = TimeWindow { start, end };
    if w.is_empty() {
        return Err(ValidationError::new(
            field,
            Rule::Range,
            "start must be before end",
        ));
    }
    Ok(w)
}

/// Converts a window to the wire form (`None` when unbounded).
pub fn time_window_to_proto(w: &TimeWindow) -> Option<v1::TimeRange> {
    (*w != TimeWindow::unbounded()).then(|| v1::TimeRange {
        start: w.start.map(to_timestamp),
        end: w.end.map(to_timestamp),
    })
}

/// Why a set does not allow an access.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Denial {
    /// No permission covers the action on the resource at all.
    ScopeNotGranted,
    /// Some permission covers action and resource, but not the asked data scope.
    DataScopeExceeded,
}

/// A union of permissions, kept minimal (no element covered by another) and sorted, so
/// equal sets compare equal.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PermissionSet(Vec<Permission>);

impl PermissionSet {
    /// The empty set (allows nothing).
    pub fn empty() -> Self {
        Self(Vec::new())
    }

    /// The set allowing everything.
    pub fn everything() -> Self {
        Self(vec![Permission::everything()])
    }

    /// A set from any permissions (normalized).
    pub fn from_permissions(perms: impl IntoIterator<Item = Permission>) -> Self {
        let mut set = Self(perms.into_iter().collect());
        set.normalize();
        set
    }

    /// Converts wire scopes, naming `field[i]` for an invalid one.
    pub fn from_proto(
        scopes: &[v1::PermissionScope],
        field: &(impl fmt::Display + ?Sized),
    ) -> Result<Self, ValidationError> {
        let field = FieldPath::shown(&field);
        let perms = scopes
            .iter()
            .enumerate()
            .map(|(i, s)| Permission::from_proto(s, &field.nth(i)))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self::from_permissions(perms))
    }

    /// Converts to wire scopes.
    pub fn to_proto(&self) -> Vec<v1::PermissionScope> {
        self.0.iter().map(Permission::to_proto).collect()
    }

    /// The permissions, minimal and sorted.
    pub fn permissions(&self) -> &[Permission] {
        &self.0
    }

    /// Whether the set allows nothing.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The set allowing exactly what both allow.
    #[must_use]
    pub fn intersect(&self, other: &PermissionSet) -> PermissionSet {
        Self::from_permissions(
            self.0
                .iter()
                .flat_map(|a| other.0.iter().filter_map(move |b| a.intersect(b))),
        )
    }

    /// Whether some element of the set covers `p`.
    pub fn covers(&self, p: &Permission) -> bool {
        self.0.iter().any(|q| q.covers(p))
    }

    /// Whether every element of `self` is covered by an element of `other`.
    pub fn is_subset_of(&self, other: &PermissionSet) -> bool {
        self.0.iter().all(|p| other.covers(p))
    }

    /// The elements of `self` that `other` does not cover (what a child asked beyond its
    /// parent).
    pub fn not_covered_by<'a>(
        &'a self,
        other: &'a PermissionSet,
    ) -> impl Iterator<Item = &'a Permission> {
        self.0.iter().filter(|p| !other.covers(p))
    }

    /// Whether `action` on `resource` with `data` is allowed, and if not, why.
    pub fn check(
        &self,
        action: &str,
        resource: &str,
        data: &DataConstraints,
    ) -> Result<(), Denial> {
        let asked = Permission {
            action: Pattern::Exact(action.to_owned()),
            resource: Pattern::Exact(resource.to_owned()),
            data: *data,
        };
        if self.covers(&asked) {
            return Ok(());
        }
        let any_data = self
            .0
            .iter()
            .any(|p| p.action.matches(action) && p.resource.matches(resource));
        Err(if any_data {
            Denial::DataScopeExceeded
        } else {
            Denial::ScopeNotGranted
        })
    }

    fn normalize(&mut self) {
        let mut perms = std::mem::take(&mut self.0);
        perms.sort_by(cmp_permission);
        perms.dedup();
        let mut kept: Vec<Permission> = Vec::with_capacity(perms.len());
        for (i, p) in perms.iter().enumerate() {
            // Drop p when another element covers it; of two equal ones, keep the first.
            let covered = perms
                .iter()
                .enumerate()
                .any(|(j, q)| j != i && q.covers(p) && (!p.covers(q) || j < i));
            if !covered {
                kept.push(p.clone());
            }
        }
        self.0 = kept;
    }
}

fn cmp_permission(a: &Permission, b: &Permission) -> Ordering {
    (&a.action, &a.resource)
        .cmp(&(&b.action, &b.resource))
        .then_with(|| a.data.max_rows.cmp(&b.data.max_rows))
        .then_with(|| a.data.time.start.cmp(&b.data.time.start))
        .then_with(|| a.data.time.end.cmp(&b.data.time.end))
}

/// The permission term of a task scope: any action, on the task's resource selectors,
/// within its time window.
pub fn task_scope_set(resources: &[String], time: TimeWindow) -> Result<PermissionSet, String> {
    let data = DataConstraints {
        time,
        max_rows: None,
    };
    if resources.is_empty() {
        return Ok(PermissionSet::from_permissions([
            Permission::everything().with_data(data)
        ]));
    }
    let perms = resources
        .iter()
        .map(|r| {
            Ok(Permission {
                action: Pattern::any(),
                resource: Pattern::parse(r)?,
                data,
            })
        })
        .collect::<Result<Vec<_>, String>>()?;
    Ok(PermissionSet::from_permissions(perms))
}

/// The five terms of an effective permission set.
#[derive(Debug, Clone, Copy)]
pub struct Terms<'a> {
    /// What the principal is granted.
    pub grants: &'a PermissionSet,
    /// What the delegator may hand on (for a child: the parent token's scopes).
    pub delegable: &'a PermissionSet,
    /// What the worker profile may ever hold.
    pub capabilities: &'a PermissionSet,
    /// The task's own scope (required scopes narrowed by its selectors and window).
    pub task: &'a PermissionSet,
    /// What runtime policy allows now.
    pub runtime: &'a PermissionSet,
}

/// `grants ∩ delegable ∩ capabilities ∩ task ∩ runtime`.
pub fn effective(terms: Terms<'_>) -> PermissionSet {
    terms
        .grants
        .intersect(terms.delegable)
        .intersect(terms.capabilities)
        .intersect(terms.task)
        .intersect(terms.runtime)
}

/// The tools a token may carry: the requested ones (or, when none are requested, the
/// profile's defaults) that are also among the profile's defaults and allowed by the
/// catalog and runtime policy.
pub fn effective_tools(
    requested: &[String],
    profile_defaults: &[String],
    allowed: impl Fn(&str) -> bool,
) -> BTreeSet<String> {
    let defaults: BTreeSet<&str> = profile_defaults.iter().map(String::as_str).collect();
    let asked: Vec<&str> = if requested.is_empty() {
        defaults.iter().copied().collect()
    } else {
        requested.iter().map(String::as_str).collect()
    };
    asked
        .into_iter()
        .filter(|t| defaults.contains(t) && allowed(t))
        .map(str::to_owned)
        .collect()
}

/// Risk level of an action or tool; ordered R0 < R1 < R2 < R3.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum RiskLevel {
    /// Read-only.
    R0,
    /// Low risk, idempotent.
    R1,
    /// Medium risk: one approver.
    R2,
    /// High risk: two distinct approvers.
    R3,
}

impl RiskLevel {
    /// From the wire enum; unset or unknown counts as R3 (fail closed).
    pub fn from_proto(v: i32) -> Self {
        match v1::RiskLevel::try_from(v) {
            Ok(v1::RiskLevel::R0) => RiskLevel::R0,
            Ok(v1::RiskLevel::R1) => RiskLevel::R1,
            Ok(v1::RiskLevel::R2) => RiskLevel::R2,
            _ => RiskLevel::R3,
        }
    }

    /// To the wire enum.
    pub fn to_proto(self) -> v1::RiskLevel {
        match self {
            RiskLevel::R0 => v1::RiskLevel::R0,
            RiskLevel::R1 => v1::RiskLevel::R1,
            RiskLevel::R2 => v1::RiskLevel::R2,
            RiskLevel::R3 => v1::RiskLevel::R3,
        }
    }

    /// Distinct human approvals needed before execution (0 for R0/R1).
    pub fn approvals_required(self) -> u32 {
        match self {
            RiskLevel::R0 | RiskLevel::R1 => 0,
            RiskLevel::R2 => 1,
            RiskLevel::R3 => 2,
        }
    }

    /// Parses `R0`..`R3` (case-insensitive).
    pub fn parse(s: &str) -> Option<Self> {
        match s.to_ascii_uppercase().as_str() {
            "R0" => Some(RiskLevel::R0),
            "R1" => Some(RiskLevel::R1),
            "R2" => Some(RiskLevel::R2),
            "R3" => Some(RiskLevel::R3),
            _ => None,
        }
    }
}

impl fmt::Display for RiskLevel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            RiskLevel::R0 => "R0",
            RiskLevel::R1 => "R1",
            RiskLevel::R2 => "R2",
            RiskLevel::R3 => "R3",
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, UNIX_EPOCH};

    fn p(a: &str, r: &str) -> Permission {
        Permission::new(a, r).unwrap()
    }

    #[test]
    fn pattern_parse_refuses_inner_star_and_empty() {
        assert!(Pattern::parse("a*b").is_err());
        assert!(Pattern::parse("").is_err());
        assert_eq!(Pattern::parse("*").unwrap(), Pattern::any());
        assert_eq!(
            Pattern::parse("logs:*").unwrap(),
            Pattern::Prefix("logs:".into())
        );
    }

    #[test]
    fn pattern_intersection() {
        let a = Pattern::parse("service/*").unwrap();
        let b = Pattern::parse("service/pay*").unwrap();
        let c = Pattern::parse("service/payment-api").unwrap();
        let d = Pattern::parse("host/*").unwrap();
        assert_eq!(a.intersect(&b), Some(b.clone()));
        assert_eq!(b.intersect(&c), Some(c.clone()));
        assert_eq!(a.intersect(&d), None);
        assert_eq!(c.intersect(&Pattern::parse("service/other").unwrap()), None);
    }

    #[test]
    fn set_intersection_narrows_to_the_overlap() {
        let grants =
            PermissionSet::from_permissions([p("logs:*", "service/*"), p("metrics:read", "*")]);
        let caps = PermissionSet::from_permissions([
            p("logs:read", "service/payment-*"),
            p("changes:read", "*"),
        ]);
        let eff = grants.intersect(&caps);
        assert_eq!(
            eff,
            PermissionSet::from_permissions([p("logs:read", "service/payment-*")])
        );
        assert!(eff.is_subset_of(&grants) && eff.is_subset_of(&caps));
    }

    #[test]
    fn check_distinguishes_scope_from_data_scope() {
        let t0 = UNIX_EPOCH + Duration::from_secs(1000);
        let t1 = t0 + Duration::from_secs(3600);
        let window = TimeWindow {
            start: Some(t0),
            end: Some(t1),
        };
        let set = PermissionSet::from_permissions([p("logs:read", "service/*").with_data(
            DataConstraints {
                time: window,
                max_rows: Some(100),
            },
        )]);
        let inside = DataConstraints {
            time: window,
            max_rows: Some(50),
        };
        assert_eq!(
            set.check("logs:read", "service/payment-api", &inside),
            Ok(())
        );
        assert_eq!(
            set.check("logs:write", "service/payment-api", &inside),
            Err(Denial::ScopeNotGranted)
        );
        let too_many = DataConstraints {
            time: window,
            max_rows: Some(500),
        };
        assert_eq!(
            set.check("logs:read", "service/payment-api", &too_many),
            Err(Denial::DataScopeExceeded)
        );
        let unbounded = DataConstraints::unconstrained();
        assert_eq!(
            set.check("logs:read", "service/x", &unbounded),
            Err(Denial::DataScopeExceeded)
        );
    }

    #[test]
    fn normalize_drops_covered_elements() {
        let set = PermissionSet::from_permissions([
            p("logs:read", "service/a"),
            p("logs:*", "service/*"),
            p("logs:*", "service/*"),
        ]);
        assert_eq!(set.permissions().len(), 1);
    }

    #[test]
    fn effective_tools_only_narrow() {
        let defaults = vec!["search_logs@1".to_owned(), "query_metrics@1".to_owned()];
        let asked = vec!["search_logs@1".to_owned(), "rollback_rule@1".to_owned()];
        let tools = effective_tools(&asked, &defaults, |_| true);
        assert_eq!(tools.into_iter().collect::<Vec<_>>(), vec!["search_logs@1"]);
        let tools = effective_tools(&[], &defaults, |t| t != "query_metrics@1");
        assert_eq!(tools.into_iter().collect::<Vec<_>>(), vec!["search_logs@1"]);
    }

    #[test]
    fn unspecified_risk_fails_closed() {
        assert_eq!(RiskLevel::from_proto(0), RiskLevel::R3);
        assert_eq!(RiskLevel::R3.approvals_required(), 2);
        assert!(RiskLevel::R1 < RiskLevel::R2);
    }
}
