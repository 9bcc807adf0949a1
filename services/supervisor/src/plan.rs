//! Turning a validated spec (or a nested Delegate call) into delegation tasks.

use std::time::{Duration, SystemTime};

use convene_core::ids::delegation_id;
use convene_core::model::PlannedTask;
use convene_core::time::to_timestamp;
use convene_mesh::policy_file::Policy;
use convene_proto::v1;

/// The resource evidence scopes name.
pub const EVIDENCE_RESOURCE: &str = "evidence";

/// The permission every worker needs to store and read back its evidence.
pub fn evidence_scope() -> v1::PermissionScope {
    v1::PermissionScope {
        action: "evidence:*".to_owned(),
        resource: EVIDENCE_RESOURCE.to_owned(),
        data_scope: None,
    }
}

/// The error for a profile id the policy file does not define, listing those it does.
pub(crate) fn unknown_profile(policy: &Policy, field: String, id: &str) -> crate::error::Error {
    let known: Vec<&str> = policy.profiles.keys().map(String::as_str).collect();
    crate::error::Error::invalid(
        field,
        format!("unknown profile {id}; known profiles: {}", known.join(", ")),
    )
}

/// Checks that every profile a spec names (its delegations', its planner's and those
/// the planner may delegate to) is one the policy file defines.
pub(crate) fn check_profiles(
    policy: &Policy,
    spec: &convene_proto::v1::RunSpec,
    domain: &convene_core::model::RunSpec,
) -> Result<(), crate::error::Error> {
    let known = |id: &str| policy.profiles.contains_key(id);
    let unknown = domain
        .plan
        .iter()
        .enumerate()
        .map(|(i, p)| (format!("spec.delegations[{i}].profile_id"), &p.profile_id))
        .chain(
            domain
                .planner
                .iter()
                .map(|p| ("spec.planner.profile_id".to_owned(), &p.profile_id)),
        )
        .find(|(_, id)| !known(id));
    if let Some((field, id)) = unknown {
        return Err(unknown_profile(policy, field, id));
    }
    if let Some(planner) = &spec.planner {
        for (i, id) in planner.profiles.iter().enumerate() {
            if !known(id) {
                return Err(unknown_profile(
                    policy,
                    format!("spec.planner.profiles[{i}]"),
                    id,
                ));
            }
        }
    }
    Ok(())
}

/// Where a task sits in the run.
#[derive(Debug, Clone, Copy)]
pub struct Placement<'a> {
    /// The run.
    pub run_id: &'a str,
    /// The delegating delegation (None at the top level).
    pub parent: Option<&'a str>,
    /// Depth of the new task.
    pub depth: u32,
    /// Round of the plan.
    pub round: u32,
    /// Position within its batch (for the id).
    pub call_index: u32,
}

/// Builds the Delegation Contract for one planned task. Evidence prefixes and default
/// tools come from the policy file's profile (the authority), never from the caller.
pub fn task(
    planned: &PlannedTask,
    wire: &v1::PlannedDelegation,
    at: Placement<'_>,
    policy: &Policy,
    now: SystemTime,
    run_deadline: SystemTime,
) -> v1::DelegationTask {
    let profile = policy.profiles.get(&planned.profile_id);
    let deadline = planned
        .timeout
        // A timeout past what a clock can hold ends with the run, like any longer one.
        .map_or(run_deadline, |t| {
            now.checked_add(t)
                .map_or(run_deadline, |d| d.min(run_deadline))
        });
    let allowed_tools = if planned.allowed_tools.is_empty() {
        profile.map(|p| p.tools.clone()).unwrap_or_default()
    } else {
        planned.allowed_tools.clone()
    };
    let mut required_scopes = wire.required_scopes.clone();
    required_scopes.push(evidence_scope());
    v1::DelegationTask {
        delegation_id: delegation_id(at.run_id, at.parent, at.round, at.call_index),
        run_id: at.run_id.to_owned(),
        parent_delegation_id: at.parent.unwrap_or_default().to_owned(),
        depth: at.depth,
        profile_id: planned.profile_id.clone(),
        goal: planned.goal.clone(),
        acceptance_criteria: planned.acceptance_criteria.clone(),
        scope: wire.scope.clone(),
        input_refs: planned.input_refs.clone(),
        allowed_tools,
        allowed_evidence_prefixes: profile
            .map(|p| p.evidence_prefixes.clone())
            .unwrap_or_default(),
        required_scopes,
        deadline: Some(to_timestamp(deadline)),
        budget: wire.budget,
        may_redelegate: planned.may_redelegate,
        name: planned.name.clone(),
        round: at.round,
        call_index: at.call_index,
    }
}

/// The token request for one task; the token outlives the task's deadline by a margin so
/// a worker can still store evidence as the deadline nears.
pub fn grant(task: &v1::DelegationTask, max_depth: u32, now: SystemTime) -> v1::TokenGrantRequest {
    let deadline = task
        .deadline
        .as_ref()
        .and_then(|t| convene_core::time::from_timestamp(t, "deadline").ok())
        .unwrap_or(now);
    let ttl = deadline
        .duration_since(now)
        .unwrap_or_default()
        .saturating_add(Duration::from_secs(60));
    // The task's resource selectors narrow every scope of the token; the evidence the
    // worker stores is part of every task, so its resource joins the selectors.
    let mut task_scope = task.scope.clone().unwrap_or_default();
    if !task_scope.resources.is_empty() {
        task_scope.resources.push(EVIDENCE_RESOURCE.to_owned());
    }
    v1::TokenGrantRequest {
        delegation_id: task.delegation_id.clone(),
        profile_id: task.profile_id.clone(),
        depth: task.depth,
        required_scopes: task.required_scopes.clone(),
        task_scope: Some(task_scope),
        tools: task.allowed_tools.clone(),
        max_calls: task.budget.as_ref().map_or(0, |b| b.max_tool_calls),
        may_redelegate: task.may_redelegate,
        ttl: Some(convene_core::time::to_duration(ttl)),
        max_depth,
    }
}
