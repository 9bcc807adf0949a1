//! The checks every proposed delegation passes before anything of it runs, whoever
//! proposes it: a planner's `delegate` call or a worker's nested `Delegate` call. One
//! path, so both see the same rules and the same messages.
//!
//! Per proposal: what it left out is filled in first ([`apply_defaults`]: scope from the
//! delegator's own, required scopes from what the profile's tools need within what the
//! delegator holds, acceptance criteria from the profile's description), each default
//! recorded; then [`RunActor::check_proposal`] checks the Delegation Contract's fields, a
//! profile the policy knows, and no loop (a chain back to a profile on its path with the
//! same goal), and [`check_servable`] refuses a proposal whose token could serve none of
//! its profile's tools, before any token is asked for. Per batch
//! ([`RunActor::check_batch`]): depth, the run's budgets, and the width limit with its
//! overflow mode. The principal's right to the profile and the scope's intersection with
//! what the run may hold are the policy service's, checked when the task token is issued.

use convene_core::limits::{self, BatchPlan};
use convene_core::model::PlannedTask;
use convene_core::permissions::{
    DataConstraints, Pattern, Permission, PermissionSet, TimeWindow, task_scope_set,
    time_window_from_proto,
};
use convene_core::validate;
use convene_mesh::policy_file::{Policy, Profile, Tool};
use convene_proto::v1;

use super::RunActor;
use crate::error::Error;
use crate::plan;

impl RunActor {
    /// Checks one proposed delegation (`field` names it in errors) whose delegating
    /// chain, from the top, is `path` (profile, goal).
    pub(super) fn check_proposal(
        &self,
        field: &str,
        wire: &v1::PlannedDelegation,
        path: &[(&str, &str)],
    ) -> Result<PlannedTask, Error> {
        let p = validate::planned_task(wire, field)?;
        if !self.deps.policy_file.profiles.contains_key(&p.profile_id) {
            return Err(plan::unknown_profile(
                &self.deps.policy_file,
                format!("{field}.profile_id"),
                &p.profile_id,
            ));
        }
        limits::check_loop(path, &p.profile_id, &p.goal)
            .map_err(|e| Error::FailedPrecondition(format!("{field}: {e}")))?;
        Ok(p)
    }

    /// Checks a batch of `count` proposals at `depth` against the run's limits and
    /// plans its width.
    pub(super) fn check_batch(&self, depth: u32, count: usize) -> Result<BatchPlan, Error> {
        limits::check_depth(depth, self.spec.limits.max_depth)
            .map_err(|e| Error::FailedPrecondition(e.to_string()))?;
        if count == 0 {
            return Err(Error::invalid(
                "delegations",
                "give at least one child task",
            ));
        }
        self.ledger
            .check()
            .map_err(|e| Error::ResourceExhausted(e.to_string()))?;
        limits::plan_batch(
            count,
            self.spec.limits.max_parallel_workers,
            self.spec.limits.overflow,
        )
        .map_err(|e| Error::ResourceExhausted(e.to_string()))
    }
}

/// Who proposes a delegation, as the defaults of its proposals and their check see it.
pub(crate) struct Delegator<'a> {
    /// How the delegator is named in what the model reads (`the planner`, `this task`).
    pub(crate) name: &'a str,
    /// Its own scope, which a proposal without one gets; `None`: it has none.
    pub(crate) scope: Option<&'a v1::TaskScope>,
    /// What it may hand on: the run principal's grants within its delegable scopes for
    /// a planner, the delegating task's token scopes for a nested call.
    pub(crate) holds: &'a PermissionSet,
    /// The tools it may hand on; `None`: any (a planner's delegations are top-level).
    pub(crate) tools: Option<&'a [String]>,
    /// Whether the policy service refuses a proposal that asks for more than the
    /// delegator holds (a nested child's token can only narrow its parent's) instead of
    /// narrowing it, as it does for a planner's top-level delegations.
    pub(crate) refuses_wider: bool,
}

/// The catalog tools a task for `profile` could be given: the profile's, narrowed by
/// the proposal's `allowed_tools` and the delegator's tools, without those runtime
/// policy denies the profile.
fn candidate_tools<'p>(
    policy: &'p Policy,
    profile: &'p Profile,
    wire: &v1::PlannedDelegation,
    by: &Delegator<'_>,
) -> Vec<&'p Tool> {
    profile
        .tools
        .iter()
        .filter(|t| wire.allowed_tools.is_empty() || wire.allowed_tools.contains(t))
        .filter(|t| by.tools.is_none_or(|held| held.contains(t)))
        .filter_map(|t| policy.tools.get(t))
        .filter(|t| policy.denying_rule(profile, t).is_none())
        .collect()
}

/// What `tool` needs of `profile`'s capabilities: every capability's part that allows
/// the tool's action.
pub(crate) fn needed(profile: &Profile, tool: &Tool) -> PermissionSet {
    let Ok(action) = Pattern::parse(&tool.action) else {
        return PermissionSet::empty();
    };
    let any_resource = PermissionSet::from_permissions([Permission {
        action,
        resource: Pattern::any(),
        data: DataConstraints::unconstrained(),
    }]);
    profile.capabilities.intersect(&any_resource)
}

/// The permission term of a task scope (`None`: no restriction of its own).
fn scope_term(scope: Option<&v1::TaskScope>) -> Result<PermissionSet, String> {
    let Some(scope) = scope else {
        return Ok(PermissionSet::everything());
    };
    let window = match &scope.time_range {
        None => TimeWindow::unbounded(),
        Some(tr) => time_window_from_proto(tr, "scope.time_range").map_err(|e| e.to_string())?,
    };
    task_scope_set(&scope.resources, window)
}

fn shown(set: &PermissionSet) -> String {
    if set.is_empty() {
        return "nothing".to_owned();
    }
    set.permissions()
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

fn applied(field: &str, value: String, source: String) -> v1::AppliedDefault {
    v1::AppliedDefault {
        field: field.to_owned(),
        value,
        source,
    }
}

/// Fills in what a proposal to a known profile left out, and returns each default it
/// applied:
///
/// - `scope`: the delegator's own scope (a nested child that names no resources gets
///   the delegating task's);
/// - `required_scopes`: the permissions the profile's tools need, from its capabilities,
///   within what the delegator holds and the task's scope;
/// - `acceptance_criteria`: the profile's `description`, or, when no worker has
///   described the profile, the descriptions of its tools.
pub(crate) fn apply_defaults(
    wire: &mut v1::PlannedDelegation,
    policy: &Policy,
    by: &Delegator<'_>,
    description: Option<&str>,
) -> Vec<v1::AppliedDefault> {
    let mut defaults = Vec::new();
    let Some(profile) = policy.profiles.get(&wire.profile_id) else {
        return defaults;
    };
    let own_scope = format!("{}'s own scope", by.name);
    match (&mut wire.scope, by.scope) {
        (None, None) => defaults.push(applied(
            "scope",
            "none: no resource selectors or time window of its own".to_owned(),
            format!(
                "{own_scope} (it has none; what {} may hand on bounds the task)",
                by.name
            ),
        )),
        (None, Some(scope)) => {
            wire.scope = Some(scope.clone());
            defaults.push(applied("scope", scope_text(scope), own_scope));
        }
        (Some(scope), Some(theirs))
            if scope.resources.is_empty() && !theirs.resources.is_empty() =>
        {
            scope.resources.clone_from(&theirs.resources);
            defaults.push(applied(
                "scope.resources",
                theirs.resources.join(", "),
                own_scope,
            ));
        }
        _ => {}
    }
    let tools = candidate_tools(policy, profile, wire, by);
    if wire.required_scopes.is_empty() {
        let needs = PermissionSet::from_permissions(
            tools
                .iter()
                .flat_map(|t| needed(profile, t).permissions().to_vec()),
        );
        let scope = scope_term(wire.scope.as_ref()).unwrap_or_else(|_| PermissionSet::empty());
        let granted = needs.intersect(by.holds).intersect(&scope);
        wire.required_scopes = granted.to_proto();
        let names: Vec<&str> = tools.iter().map(|t| t.name.as_str()).collect();
        defaults.push(applied(
            "required_scopes",
            shown(&granted),
            format!(
                "the capabilities of {} its tools ({}) need, within what {} holds and the \
                 task's scope",
                profile.id,
                names.join(", "),
                by.name
            ),
        ));
    }
    if wire.acceptance_criteria.is_empty() {
        match description.map(str::trim).filter(|d| !d.is_empty()) {
            Some(d) => {
                wire.acceptance_criteria = vec![d.to_owned()];
                defaults.push(applied(
                    "acceptance_criteria",
                    d.to_owned(),
                    format!("the description of profile {}", profile.id),
                ));
            }
            None => {
                let said: Vec<String> = tools
                    .iter()
                    .filter(|t| !t.description.trim().is_empty())
                    .map(|t| format!("{}: {}", t.name, t.description.trim()))
                    .collect();
                if !said.is_empty() {
                    let text = format!(
                        "Answer the goal with what these tools establish, every claim citing \
                         the evidence it rests on. {}",
                        said.join(" ")
                    );
                    wire.acceptance_criteria = vec![text.clone()];
                    defaults.push(applied(
                        "acceptance_criteria",
                        text,
                        format!(
                            "the descriptions of the tools of profile {} (no worker serving \
                             it has described it)",
                            profile.id
                        ),
                    ));
                }
            }
        }
    }
    defaults
}

fn scope_text(scope: &v1::TaskScope) -> String {
    let mut parts = Vec::new();
    if !scope.resources.is_empty() {
        parts.push(format!("resources {}", scope.resources.join(", ")));
    }
    if let Some(tr) = &scope.time_range {
        let at = |t: &Option<prost_types::Timestamp>| {
            t.as_ref()
                .and_then(|t| convene_core::time::from_timestamp(t, "time").ok())
                .map_or_else(
                    || "open".to_owned(),
                    |t| humantime::format_rfc3339_seconds(t).to_string(),
                )
        };
        parts.push(format!("time {} to {}", at(&tr.start), at(&tr.end)));
    }
    if parts.is_empty() {
        "no resource selectors or time window".to_owned()
    } else {
        parts.join("; ")
    }
}

/// Checks that a proposal (its defaults applied) could serve at least one of its
/// profile's tools: a token computed as the policy service computes it — what the
/// delegator holds, the profile's capabilities, the required scopes within the task's
/// scope — must allow some tool's action. Otherwise the error names, per tool, what it
/// needs and what stands in the way. A profile without tools is not checked.
pub(crate) fn check_servable(
    wire: &v1::PlannedDelegation,
    policy: &Policy,
    by: &Delegator<'_>,
) -> Result<(), String> {
    let Some(profile) = policy.profiles.get(&wire.profile_id) else {
        return Ok(());
    };
    if profile.tools.is_empty() {
        return Ok(());
    }
    let required = PermissionSet::from_proto(&wire.required_scopes, "required_scopes")
        .map_err(|e| e.to_string())?;
    let scope = scope_term(wire.scope.as_ref())?;
    let asked = required.intersect(&scope);
    if by.refuses_wider {
        // Asked for more than the delegator holds: the policy service refuses the call
        // outright, naming what is wider, and issues no token.
        let tools_wider = by
            .tools
            .is_some_and(|held| wire.allowed_tools.iter().any(|t| !held.contains(t)));
        if tools_wider || asked.not_covered_by(by.holds).next().is_some() {
            return Ok(());
        }
    }
    let tools = candidate_tools(policy, profile, wire, by);
    if tools.is_empty() {
        return Err(format!(
            "not started: profile {} would get none of its tools ({}): allowed_tools and \
             the tools {} may hand on leave none of them",
            profile.id,
            profile.tools.join(", "),
            by.name
        ));
    }
    let effective = by.holds.intersect(&profile.capabilities).intersect(&asked);
    if tools.iter().any(|t| {
        effective
            .permissions()
            .iter()
            .any(|p| p.action.matches(&t.action))
    }) {
        return Ok(());
    }
    let why: Vec<String> = tools
        .iter()
        .map(|t| {
            let caps = needed(profile, t);
            let held = caps.intersect(by.holds);
            let reason = if caps.is_empty() {
                format!("profile {} may never hold it", profile.id)
            } else if held.is_empty() {
                format!("{} does not hold it", by.name)
            } else if held.intersect(&required).is_empty() {
                format!(
                    "required_scopes does not ask for it (it reads {})",
                    shown(&held)
                )
            } else {
                format!(
                    "the scope's resources and time window leave nothing of what it reads ({})",
                    shown(&held)
                )
            };
            format!("{} needs {}: {reason}", t.name, t.action)
        })
        .collect();
    Err(format!(
        "not started: the task token of this delegation to {} would allow none of its \
         tools, so every tool call would be denied. {}. Leave required_scopes and scope out \
         to get what the profile's tools need within {}'s own, or ask for them",
        profile.id,
        why.join("; "),
        by.name
    ))
}

#[cfg(test)]
mod tests {
    use convene_mesh::policy_file::PolicySource;

    use super::*;

    fn policy() -> Policy {
        PolicySource::new(None, None)
            .load()
            .expect("example policy")
            .0
    }

    /// What the example's on-call engineer may hand on to a planner's delegations.
    fn oncall(policy: &Policy) -> PermissionSet {
        let p = policy.principal("oncall@acme").expect("oncall");
        p.grants.intersect(&p.delegable)
    }

    fn bare(profile: &str) -> v1::PlannedDelegation {
        v1::PlannedDelegation {
            name: "r1c0".to_owned(),
            profile_id: profile.to_owned(),
            goal: "find out".to_owned(),
            ..Default::default()
        }
    }

    fn scopes(wire: &v1::PlannedDelegation) -> Vec<(String, String)> {
        wire.required_scopes
            .iter()
            .map(|s| (s.action.clone(), s.resource.clone()))
            .collect()
    }

    fn fields(defaults: &[v1::AppliedDefault]) -> Vec<&str> {
        defaults.iter().map(|d| d.field.as_str()).collect()
    }

    #[test]
    fn a_bare_planner_proposal_gets_what_its_profiles_tools_need_and_its_description() {
        let policy = policy();
        let holds = oncall(&policy);
        let planner = Delegator {
            name: "the planner",
            scope: None,
            holds: &holds,
            tools: None,
            refuses_wider: false,
        };
        let mut wire = bare("change-auditor-model");
        let defaults = apply_defaults(
            &mut wire,
            &policy,
            &planner,
            Some("Audits the changes of the window."),
        );
        assert_eq!(
            fields(&defaults),
            ["scope", "required_scopes", "acceptance_criteria"]
        );
        assert!(wire.scope.is_none(), "the planner has no scope of its own");
        // Both tools' actions, on what the profile may read (not the principal's wider
        // metric/*), and nothing the tools do not need (no evidence:*: the task adds it).
        assert_eq!(
            scopes(&wire),
            [
                ("changes:read".to_owned(), "change/*".to_owned()),
                ("metrics:read".to_owned(), "metric/risk.*".to_owned()),
            ]
        );
        assert_eq!(
            wire.acceptance_criteria,
            ["Audits the changes of the window."]
        );
        assert!(defaults[1].value.contains("changes:read on change/*"));
        assert!(defaults[2].source.contains("description"));
        check_servable(&wire, &policy, &planner).expect("the defaults serve its tools");

        // Without a description, the criteria come from the tools' own descriptions.
        let mut wire = bare("logs-investigator-model");
        let defaults = apply_defaults(&mut wire, &policy, &planner, None);
        assert!(
            wire.acceptance_criteria[0].contains("search_logs@1"),
            "{:?}",
            wire.acceptance_criteria
        );
        assert!(defaults[2].source.contains("tools"), "{defaults:?}");
    }

    #[test]
    fn what_a_proposal_sets_is_kept_and_only_the_rest_is_defaulted() {
        let policy = policy();
        let holds = oncall(&policy);
        let planner = Delegator {
            name: "the planner",
            scope: None,
            holds: &holds,
            tools: None,
            refuses_wider: false,
        };
        let mut wire = bare("logs-investigator-model");
        wire.scope = Some(v1::TaskScope {
            resources: vec!["service/payment-api".to_owned()],
            time_range: None,
        });
        wire.acceptance_criteria = vec!["quantify the errors".to_owned()];
        let defaults = apply_defaults(&mut wire, &policy, &planner, Some("ignored"));
        assert_eq!(fields(&defaults), ["required_scopes"]);
        // The default permissions lie within the proposal's own scope.
        assert_eq!(
            scopes(&wire),
            [("logs:read".to_owned(), "service/payment-api".to_owned())]
        );
        assert_eq!(wire.acceptance_criteria, ["quantify the errors"]);

        let mut wire = bare("logs-investigator-model");
        wire.required_scopes = vec![v1::PermissionScope {
            action: "logs:read".to_owned(),
            resource: "service/*".to_owned(),
            data_scope: None,
        }];
        let defaults = apply_defaults(&mut wire, &policy, &planner, Some("d"));
        assert_eq!(fields(&defaults), ["scope", "acceptance_criteria"]);
    }

    #[test]
    fn a_nested_child_inherits_its_parents_scope_and_stays_within_its_token() {
        let policy = policy();
        // The parent's token holds logs on payment-api only, and only search_logs@1.
        let holds = PermissionSet::from_permissions([
            Permission::new("logs:read", "service/payment-api").unwrap(),
            Permission::new("evidence:*", "evidence").unwrap(),
        ]);
        let tools = vec!["search_logs@1".to_owned()];
        let parent_scope = v1::TaskScope {
            resources: vec!["service/payment-api".to_owned()],
            time_range: None,
        };
        let parent = Delegator {
            name: "this task",
            scope: Some(&parent_scope),
            holds: &holds,
            tools: Some(&tools),
            refuses_wider: true,
        };
        let mut wire = bare("logs-investigator");
        let defaults = apply_defaults(&mut wire, &policy, &parent, None);
        assert_eq!(wire.scope.as_ref(), Some(&parent_scope));
        assert_eq!(defaults[0].source, "this task's own scope");
        assert_eq!(
            scopes(&wire),
            [("logs:read".to_owned(), "service/payment-api".to_owned())]
        );
        check_servable(&wire, &policy, &parent).expect("servable");

        // A child the worker gave only a time window gets the parent's resources.
        let mut wire = bare("logs-investigator");
        wire.scope = Some(v1::TaskScope::default());
        let defaults = apply_defaults(&mut wire, &policy, &parent, None);
        assert_eq!(defaults[0].field, "scope.resources");
        assert_eq!(wire.scope.unwrap().resources, parent_scope.resources);

        // A metrics investigator under this parent could serve none of its tools: the
        // parent may hand on neither the tool nor the permission.
        let mut wire = bare("metrics-investigator");
        apply_defaults(&mut wire, &policy, &parent, None);
        let e = check_servable(&wire, &policy, &parent).unwrap_err();
        assert!(e.contains("query_metrics@1"), "{e}");

        // One that asks outright for more than the parent holds is left to the policy
        // service, which refuses a child wider than its parent, naming what is wider.
        let mut wire = bare("metrics-investigator");
        wire.required_scopes = vec![v1::PermissionScope {
            action: "metrics:read".to_owned(),
            resource: "metric/*".to_owned(),
            data_scope: None,
        }];
        check_servable(&wire, &policy, &parent).expect("the policy's to refuse");
    }

    #[test]
    fn a_proposal_that_could_serve_none_of_its_tools_is_refused_naming_what_is_missing() {
        let policy = policy();
        let holds = oncall(&policy);
        let planner = Delegator {
            name: "the planner",
            scope: None,
            holds: &holds,
            tools: None,
            refuses_wider: false,
        };
        // The naive proposal of old: permissions that give the tools nothing.
        let mut wire = bare("logs-investigator-model");
        wire.required_scopes = vec![v1::PermissionScope {
            action: "metrics:read".to_owned(),
            resource: "metric/*".to_owned(),
            data_scope: None,
        }];
        let e = check_servable(&wire, &policy, &planner).unwrap_err();
        assert!(
            e.contains("search_logs@1 needs logs:read")
                && e.contains("required_scopes does not ask for it")
                && e.contains("service/*"),
            "{e}"
        );

        // A scope that excludes everything the tools read.
        let mut wire = bare("logs-investigator-model");
        wire.scope = Some(v1::TaskScope {
            resources: vec!["metric/payment.*".to_owned()],
            time_range: None,
        });
        apply_defaults(&mut wire, &policy, &planner, None);
        assert!(
            wire.required_scopes.is_empty(),
            "{:?}",
            wire.required_scopes
        );
        let e = check_servable(&wire, &policy, &planner).unwrap_err();
        assert!(e.contains("scope"), "{e}");

        // A principal that may hand on nothing of it.
        let none =
            PermissionSet::from_permissions([Permission::new("evidence:*", "evidence").unwrap()]);
        let poor = Delegator {
            name: "the planner",
            scope: None,
            holds: &none,
            tools: None,
            refuses_wider: false,
        };
        let mut wire = bare("logs-investigator-model");
        apply_defaults(&mut wire, &policy, &poor, None);
        let e = check_servable(&wire, &policy, &poor).unwrap_err();
        assert!(e.contains("the planner does not hold it"), "{e}");

        // A profile without tools is never refused for it.
        check_servable(&bare("incident-planner-model"), &policy, &poor).expect("no tools");
    }
}
