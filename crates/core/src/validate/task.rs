//! Tasks: an entry of a static plan or of a nested Delegate call, the task a worker
//! receives, and the worker profiles tasks are given to; with their scope, budget and
//! tools.

use convene_proto::v1;

use super::deadline::positive_duration;
use super::result::{artifact_uri, evidence_prefix};
use super::rules::{
    at_most, capped, each, finite_number, no_duplicates, non_blank_list, non_zero, plan_name,
    profile_id, required_str,
};
use super::run::goal;
use super::{MAX_SCOPE_ENTRIES, at};
use crate::model::{self, Budget, Limits, TaskScope};
use crate::permissions::{self, Pattern, Permission, PermissionSet};
use crate::time::from_timestamp;
use crate::{FieldPath, Rule, ValidationError};

/// Validates one entry of a static plan or of a nested Delegate call.
pub fn planned_task(
    p: &v1::PlannedDelegation,
    field: &str,
) -> Result<model::PlannedTask, ValidationError> {
    planned_task_at(p, &FieldPath::new(field))
}

pub(super) fn planned_task_at(
    p: &v1::PlannedDelegation,
    field: &FieldPath<'_>,
) -> Result<model::PlannedTask, ValidationError> {
    let name = plan_name(&p.name, &at(field, "name"))?;
    let profile_id = required_str(&p.profile_id, &at(field, "profile_id"))?;
    let goal = goal(&p.goal, &at(field, "goal"))?;
    let acceptance_criteria =
        non_blank_list(&p.acceptance_criteria, &at(field, "acceptance_criteria"))?;
    let scope = task_scope(p.scope.as_ref(), &at(field, "scope"))?;
    let input_refs = each(&p.input_refs, &at(field, "input_refs"), |v, f| {
        artifact_uri(v, f)
    })?;
    let allowed_tools = tools(&p.allowed_tools, &at(field, "allowed_tools"))?;
    at_most(
        &p.required_scopes,
        MAX_SCOPE_ENTRIES,
        &at(field, "required_scopes"),
    )?;
    let required_scopes = each(&p.required_scopes, &at(field, "required_scopes"), |s, f| {
        Permission::from_proto(s, f)
    })?;
    let timeout = p
        .timeout
        .as_ref()
        .map(|t| positive_duration(t, &at(field, "timeout")))
        .transpose()?;
    let budget = budget(p.budget.as_ref(), &at(field, "budget"))?;
    Ok(model::PlannedTask {
        name,
        profile_id,
        goal,
        acceptance_criteria,
        scope,
        input_refs,
        allowed_tools,
        required_scopes,
        timeout,
        budget,
        may_redelegate: p.may_redelegate,
    })
}

/// Checks the structure of a task a worker receives: ids set, depth ≥ 1 (and a parent
/// below the top level), a goal, a deadline, well-formed scope, inputs, tools, evidence
/// prefixes, scopes and budget.
pub fn delegation_task(t: &v1::DelegationTask, field: &str) -> Result<(), ValidationError> {
    delegation_task_at(t, &FieldPath::new(field))
}

fn delegation_task_at(
    t: &v1::DelegationTask,
    field: &FieldPath<'_>,
) -> Result<(), ValidationError> {
    required_str(&t.delegation_id, &at(field, "delegation_id"))?;
    required_str(&t.run_id, &at(field, "run_id"))?;
    if t.depth == 0 {
        return Err(ValidationError::new(
            at(field, "depth"),
            Rule::Range,
            "depth must be at least 1 (1 for the supervisor's own delegations)",
        ));
    }
    if t.depth > 1 && t.parent_delegation_id.trim().is_empty() {
        return Err(ValidationError::new(
            at(field, "parent_delegation_id"),
            Rule::Required,
            format!(
                "a task at depth {} is nested: name the delegation that asked for it",
                t.depth
            ),
        ));
    }
    required_str(&t.profile_id, &at(field, "profile_id"))?;
    goal(&t.goal, &at(field, "goal"))?;
    non_blank_list(&t.acceptance_criteria, &at(field, "acceptance_criteria"))?;
    task_scope(t.scope.as_ref(), &at(field, "scope"))?;
    each(&t.input_refs, &at(field, "input_refs"), |v, f| {
        artifact_uri(v, f)
    })?;
    tools(&t.allowed_tools, &at(field, "allowed_tools"))?;
    each(
        &t.allowed_evidence_prefixes,
        &at(field, "allowed_evidence_prefixes"),
        |v, f| evidence_prefix(v, f),
    )?;
    at_most(
        &t.required_scopes,
        MAX_SCOPE_ENTRIES,
        &at(field, "required_scopes"),
    )?;
    each(&t.required_scopes, &at(field, "required_scopes"), |s, f| {
        Permission::from_proto(s, f)
    })?;
    let deadline_field = at(field, "deadline");
    match &t.deadline {
        Some(d) => from_timestamp(d, &deadline_field).map(drop)?,
        None => {
            return Err(ValidationError::new(
                deadline_field,
                Rule::Required,
                "every task carries the absolute time by which the worker must return",
            ));
        }
    }
    budget(t.budget.as_ref(), &at(field, "budget"))?;
    Ok(())
}

/// Validates a worker profile, applying the [`model::WorkerProfile`] defaults to zero
/// values. The id must be `[A-Za-z0-9._-]{1,128}` (it is reported as `id@version`, so
/// it cannot hold `@`), and the version must be set.
///
/// A temperature of exactly 0 on the wire is indistinguishable from "unset" and takes
/// the default; ask for a small positive value for near-deterministic sampling.
pub fn worker_profile(
    p: &v1::WorkerProfile,
    field: &str,
) -> Result<model::WorkerProfile, ValidationError> {
    worker_profile_at(p, &FieldPath::new(field))
}

fn worker_profile_at(
    p: &v1::WorkerProfile,
    field: &FieldPath<'_>,
) -> Result<model::WorkerProfile, ValidationError> {
    let id = profile_id(&p.id, &at(field, "id"))?;
    let name = match p.name.trim() {
        "" => id.clone(),
        name => name.to_owned(),
    };
    let default_tools = tools(&p.default_tools, &at(field, "default_tools"))?;
    no_duplicates(
        default_tools.iter().map(String::as_str),
        &at(field, "default_tools"),
        "",
    )?;
    let max_iterations = capped(
        p.max_iterations,
        model::WorkerProfile::DEFAULT_MAX_ITERATIONS,
        Limits::MAX_ITERATIONS_CAP,
        &at(field, "max_iterations"),
    )?;
    let max_tokens = match p.max_tokens {
        0 => model::WorkerProfile::DEFAULT_MAX_TOKENS,
        n => n,
    };
    let temperature = match finite_number(
        p.temperature,
        &at(field, "temperature"),
        |t| (0.0..=model::WorkerProfile::MAX_TEMPERATURE).contains(&t),
        "between 0 and 2",
    )? {
        0.0 => model::WorkerProfile::DEFAULT_TEMPERATURE,
        t => t,
    };
    let capabilities = PermissionSet::from_proto(&p.capabilities, &at(field, "capabilities"))?;
    let evidence_prefixes = each(
        &p.evidence_prefixes,
        &at(field, "evidence_prefixes"),
        |v, f| evidence_prefix(v, f),
    )?;
    let version = required_str(&p.version, &at(field, "version"))?;
    Ok(model::WorkerProfile {
        id,
        name,
        version,
        description: p.description.trim().to_owned(),
        instructions: p.instructions.clone(),
        default_tools,
        model: p.model.trim().to_owned(),
        provider: p.provider.trim().to_owned(),
        max_iterations,
        max_tokens,
        temperature,
        capabilities,
        evidence_prefixes,
        supports_parallel_completion: p.supports_parallel_completion,
    })
}

fn task_scope(
    scope: Option<&v1::TaskScope>,
    field: &FieldPath<'_>,
) -> Result<TaskScope, ValidationError> {
    let Some(scope) = scope else {
        return Ok(TaskScope::default());
    };
    at_most(&scope.resources, MAX_SCOPE_ENTRIES, &at(field, "resources"))?;
    let resources = each(&scope.resources, &at(field, "resources"), |r, f| {
        Pattern::parse(r)
            .map(|_| r.clone())
            .map_err(|m| ValidationError::new(f, Rule::Format, m))
    })?;
    let time_range = scope
        .time_range
        .as_ref()
        .map(|tr| permissions::time_window_from_proto(tr, &at(field, "time_range")))
        .transpose()?
        .unwrap_or_default();
    Ok(TaskScope {
        resources,
        time_range,
    })
}

fn budget(b: Option<&v1::Budget>, field: &FieldPath<'_>) -> Result<Budget, ValidationError> {
    let Some(b) = b else {
        return Ok(Budget::default());
    };
    let max_cost = finite_number(
        b.max_cost,
        &at(field, "max_cost"),
        |c| c >= 0.0,
        "a finite number ≥ 0 (0: no limit)",
    )?;
    Ok(Budget {
        max_tool_calls: non_zero(b.max_tool_calls),
        max_tokens: non_zero(b.max_tokens),
        max_cost: (max_cost > 0.0).then_some(max_cost),
    })
}

fn tools(values: &[String], field: &FieldPath<'_>) -> Result<Vec<String>, ValidationError> {
    each(values, field, |t, f| {
        let well_formed = t.split_once('@').is_some_and(|(name, version)| {
            !name.is_empty()
                && !version.is_empty()
                && !version.contains('@')
                && !t.chars().any(char::is_whitespace)
        });
        if well_formed {
            Ok(t.clone())
        } else {
            Err(ValidationError::new(
                f,
                Rule::Format,
                format!("tool `{t}` must be `name@version`, e.g. `search_logs@1`"),
            ))
        }
    })
}
