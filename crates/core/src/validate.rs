//! Validated conversions from the wire types.
//!
//! Every function takes the path of the message it checks (`spec`, `result`, ...) and
//! returns the validated domain value or the first [`ValidationError`] found, whose
//! `field` is the full path of the offending field (`spec.delegations[1].profile_id`,
//! `spec.join.weights["logs"]`). Fields are checked in declaration order, so one invalid
//! message always yields the same error.
//!
//! The wire conventions applied here:
//! - a zero number or an unset message means "the documented default";
//! - an unspecified enum means its documented default, or is [`Rule::Required`] where
//!   the contract has none (a join's strategy, a result's status); a number this
//!   version does not know is [`Rule::UnknownEnum`];
//! - free text is trimmed, and a blank required string counts as missing;
//! - a deadline is absolute and must lie after the run's start; a timeout is relative to
//!   the run's start and is resolved into a deadline here, so the domain only knows
//!   absolute deadlines.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::{Duration, SystemTime};

use convene_proto::v1;

use crate::model::{self, Budget, JoinMinimum, Limits, TaskScope};
use crate::permissions::{self, Pattern, Permission, PermissionSet};
use crate::time::{from_duration, from_timestamp, to_timestamp};
use crate::{FieldPath, Rule, ValidationError};

/// Longest accepted goal, in characters.
pub const MAX_GOAL_CHARS: usize = 4096;
/// Longest accepted idempotency key, in characters.
pub const MAX_IDEMPOTENCY_KEY_CHARS: usize = 256;
/// Longest accepted delegation name, in characters.
pub const MAX_NAME_CHARS: usize = 64;
/// Longest accepted profile id, in characters.
pub const MAX_PROFILE_ID_CHARS: usize = 128;
/// Most delegations in one static plan: even under QUEUE overflow a larger plan is a
/// flood the join cannot meaningfully decide on.
pub const MAX_PLAN_DELEGATIONS: usize = 1024;

/// The URI scheme of stored artifacts.
const ARTIFACT_SCHEME: &str = "artifact://";

/// Validates a submitted run spec (field root `spec`). `now` is the run's start: it
/// resolves the join's and the limits' timeouts into deadlines and is the instant
/// absolute deadlines must lie after.
pub fn run_spec(spec: &v1::RunSpec, now: SystemTime) -> Result<model::RunSpec, ValidationError> {
    const ROOT: &FieldPath<'static> = &FieldPath::new("spec");
    let goal = goal(&spec.goal, &at(ROOT, "goal"))?;
    let idempotency_key = idempotency_key(&spec.idempotency_key, &at(ROOT, "idempotency_key"))?;
    let plan = static_plan(spec, ROOT)?;

    let join_field = at(ROOT, "join");
    let join = match &spec.join {
        Some(j) => join_contract_at(j, now, &join_field)?,
        None => {
            return Err(ValidationError::new(
                join_field,
                Rule::Required,
                format!(
                    "give a join contract with at least a strategy (one of {})",
                    expected::<v1::JoinStrategy>()
                ),
            ));
        }
    };
    join_fits_plan(&join, &plan, &join_field)?;

    let limits = limits_at(spec.limits.as_ref(), now, &at(ROOT, "limits"))?;
    let labels = labels(&spec.labels, &at(ROOT, "labels"))?;
    Ok(model::RunSpec {
        goal,
        idempotency_key,
        plan,
        join,
        limits,
        labels,
    })
}

/// Validates one entry of a static plan or of a nested Delegate call.
pub fn planned_task(
    p: &v1::PlannedDelegation,
    field: &str,
) -> Result<model::PlannedTask, ValidationError> {
    planned_task_at(p, &FieldPath::new(field))
}

fn planned_task_at(
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

/// Validates a join contract; `run_start` resolves `timeout` into the deadline.
///
/// References are only checked for form here; whether they name something of the plan
/// is checked by [`run_spec`], which knows the plan.
pub fn join_contract(
    j: &v1::JoinContract,
    run_start: SystemTime,
    field: &str,
) -> Result<model::JoinContract, ValidationError> {
    join_contract_at(j, run_start, &FieldPath::new(field))
}

fn join_contract_at(
    j: &v1::JoinContract,
    run_start: SystemTime,
    field: &FieldPath<'_>,
) -> Result<model::JoinContract, ValidationError> {
    let required = references(&j.required, &at(field, "required"))?;
    let optional = references(&j.optional, &at(field, "optional"))?;
    if let Some((i, r)) = optional
        .iter()
        .enumerate()
        .find(|(_, r)| required.contains(r))
    {
        return Err(ValidationError::new(
            nth(&at(field, "optional"), i),
            Rule::Duplicate,
            format!("`{r}` is listed as both required and optional; keep it in one list"),
        ));
    }

    let strategy = required_enum::<v1::JoinStrategy>(j.strategy, &at(field, "strategy"))?;
    let minimum = join_minimum(j.minimum.as_ref(), &at(field, "minimum"))?;
    let deadline = resolve_deadline(j.deadline.as_ref(), j.timeout.as_ref(), run_start, field)?;
    if strategy == model::JoinStrategy::TimeoutPartial && deadline.is_none() {
        return Err(ValidationError::new(
            at(field, "deadline"),
            Rule::Required,
            format!(
                "strategy {} decides at a deadline: set deadline or timeout",
                v1::JoinStrategy::TimeoutPartial.as_str_name()
            ),
        ));
    }
    let on_timeout = enum_or_default::<v1::OnTimeout>(j.on_timeout, &at(field, "on_timeout"))?;
    let on_conflict = enum_or_default::<v1::OnConflict>(j.on_conflict, &at(field, "on_conflict"))?;
    let late_result =
        enum_or_default::<v1::LateResultPolicy>(j.late_result, &at(field, "late_result"))?;
    let weights = weights(&j.weights, &at(field, "weights"))?;
    Ok(model::JoinContract {
        join_id: j.join_id.trim().to_owned(),
        required,
        optional,
        strategy,
        minimum,
        deadline,
        on_timeout,
        on_conflict,
        late_result,
        weights,
    })
}

/// Validates run limits, applying the [`Limits`] defaults to zero or unset values and
/// resolving the deadline against `run_start` (default: [`Limits::DEFAULT_TIMEOUT`]).
///
/// Caps: `max_depth` ≤ [`Limits::MAX_DEPTH_CAP`], `max_parallel_workers` ≤
/// [`Limits::MAX_PARALLEL_WORKERS_CAP`], `max_iterations` ≤
/// [`Limits::MAX_ITERATIONS_CAP`], `max_rounds` ≤ [`Limits::MAX_ROUNDS_CAP`],
/// `max_redelegations` ≤ [`Limits::MAX_REDELEGATIONS_CAP`], `no_progress_rounds` ≤
/// [`Limits::MAX_NO_PROGRESS_ROUNDS_CAP`].
pub fn limits(
    l: Option<&v1::Limits>,
    run_start: SystemTime,
    field: &str,
) -> Result<Limits, ValidationError> {
    limits_at(l, run_start, &FieldPath::new(field))
}

fn limits_at(
    l: Option<&v1::Limits>,
    run_start: SystemTime,
    field: &FieldPath<'_>,
) -> Result<Limits, ValidationError> {
    let Some(l) = l else {
        return Ok(Limits::defaults(run_start));
    };
    let max_depth = capped(
        l.max_depth,
        Limits::DEFAULT_MAX_DEPTH,
        Limits::MAX_DEPTH_CAP,
        &at(field, "max_depth"),
    )?;
    let max_parallel_workers = capped(
        l.max_parallel_workers,
        Limits::DEFAULT_MAX_PARALLEL_WORKERS,
        Limits::MAX_PARALLEL_WORKERS_CAP,
        &at(field, "max_parallel_workers"),
    )?;
    let overflow = enum_or_default::<v1::OverflowPolicy>(l.overflow, &at(field, "overflow"))?;
    let max_iterations = capped(
        l.max_iterations,
        Limits::DEFAULT_MAX_ITERATIONS,
        Limits::MAX_ITERATIONS_CAP,
        &at(field, "max_iterations"),
    )?;
    let max_rounds = capped(
        l.max_rounds,
        Limits::DEFAULT_MAX_ROUNDS,
        Limits::MAX_ROUNDS_CAP,
        &at(field, "max_rounds"),
    )?;
    let max_redelegations = capped(
        l.max_redelegations,
        Limits::DEFAULT_MAX_REDELEGATIONS,
        Limits::MAX_REDELEGATIONS_CAP,
        &at(field, "max_redelegations"),
    )?;
    // A zero timeout means "the default" here (unlike a join's, which has no default).
    let timeout = l
        .timeout
        .as_ref()
        .filter(|t| t.seconds != 0 || t.nanos != 0);
    let deadline = match resolve_deadline(l.deadline.as_ref(), timeout, run_start, field)? {
        Some(deadline) => deadline,
        None => add_duration(run_start, Limits::DEFAULT_TIMEOUT, &at(field, "timeout"))?,
    };
    let max_cost = finite_number(
        l.max_cost,
        &at(field, "max_cost"),
        |c| c >= 0.0,
        "a finite number ≥ 0 (0: no limit)",
    )?;
    let no_progress_rounds = capped(
        l.no_progress_rounds,
        Limits::DEFAULT_NO_PROGRESS_ROUNDS,
        Limits::MAX_NO_PROGRESS_ROUNDS_CAP,
        &at(field, "no_progress_rounds"),
    )?;
    Ok(Limits {
        max_depth,
        max_parallel_workers,
        overflow,
        max_iterations,
        max_rounds,
        max_redelegations,
        deadline,
        max_tool_calls: non_zero(l.max_tool_calls),
        max_tokens: non_zero(l.max_tokens),
        max_cost: (max_cost > 0.0).then_some(max_cost),
        no_progress_rounds,
    })
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

/// Checks the structure of a worker's result against the task it answers: the same
/// delegation and profile, a known status, claims with unique ids, a topic, a value,
/// confidence in `[0, 1]` and at least one evidence ref each, every ref inside the
/// task's allowed evidence prefixes, and `artifact://` artifacts.
///
/// The join applies the same rules through its own rejection path; this is for callers
/// that want an error naming the field (a worker checking itself before it returns).
pub fn task_result(
    r: &v1::TaskResult,
    task: &v1::DelegationTask,
    field: &str,
) -> Result<(), ValidationError> {
    task_result_at(r, task, &FieldPath::new(field))
}

fn task_result_at(
    r: &v1::TaskResult,
    task: &v1::DelegationTask,
    field: &FieldPath<'_>,
) -> Result<(), ValidationError> {
    let delegation_field = at(field, "delegation_id");
    let delegation_id = required_str(&r.delegation_id, &delegation_field)?;
    if delegation_id != task.delegation_id {
        return Err(ValidationError::new(
            delegation_field,
            Rule::UnknownReference,
            format!(
                "the result answers delegation `{delegation_id}`, but the task is `{}`; \
                 return it under the task's delegation_id",
                task.delegation_id
            ),
        ));
    }
    let profile_field = at(field, "profile_id");
    let profile_id = required_str(&r.profile_id, &profile_field)?;
    if profile_id != task.profile_id {
        return Err(ValidationError::new(
            profile_field,
            Rule::NotAllowed,
            format!(
                "the result names profile `{profile_id}`, but the task was given to profile \
                 `{}`",
                task.profile_id
            ),
        ));
    }
    required_enum::<v1::TaskStatus>(r.status, &at(field, "status"))?;

    let claims_field = at(field, "claims");
    for (i, c) in r.claims.iter().enumerate() {
        claim(c, &task.allowed_evidence_prefixes, &nth(&claims_field, i))?;
    }
    no_duplicates(
        r.claims.iter().map(|c| c.claim_id.trim()),
        &claims_field,
        ".claim_id",
    )?;
    each(&r.artifacts, &at(field, "artifacts"), |v, f| {
        artifact_uri(v, f)
    })?;
    Ok(())
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

// ---------------------------------------------------------------------------------------
// Run-level pieces.

fn static_plan(
    spec: &v1::RunSpec,
    root: &FieldPath<'_>,
) -> Result<Vec<model::PlannedTask>, ValidationError> {
    let field = at(root, "delegations");
    match (spec.delegations.is_empty(), spec.planner.is_some()) {
        (false, true) => Err(ValidationError::new(
            at(root, "planner"),
            Rule::Exclusive,
            "set either delegations (a static plan) or planner, not both",
        )),
        (true, true) => Err(ValidationError::new(
            at(root, "planner"),
            Rule::Unsupported,
            "model-driven planning is not supported yet; give a static plan in delegations",
        )),
        (true, false) => Err(ValidationError::new(
            field,
            Rule::Required,
            "give a static plan: at least one delegation",
        )),
        (false, false) => {
            if spec.delegations.len() > MAX_PLAN_DELEGATIONS {
                return Err(ValidationError::new(
                    field,
                    Rule::TooLong,
                    format!(
                        "the plan has {} delegations; split the work into runs of at most \
                         {MAX_PLAN_DELEGATIONS}",
                        spec.delegations.len()
                    ),
                ));
            }
            let plan = each(&spec.delegations, &field, planned_task_at)?;
            no_duplicates(plan.iter().map(|t| t.name.as_str()), &field, ".name")?;
            Ok(plan)
        }
    }
}

/// Every join reference names a delegation or profile of the plan, and the minimum
/// count can be reached by the plan at all.
fn join_fits_plan(
    join: &model::JoinContract,
    plan: &[model::PlannedTask],
    field: &FieldPath<'_>,
) -> Result<(), ValidationError> {
    let names: BTreeSet<&str> = plan.iter().map(|t| t.name.as_str()).collect();
    let profiles: BTreeSet<&str> = plan.iter().map(|t| t.profile_id.as_str()).collect();
    let check = |reference: &str, ref_field: FieldPath<'_>| {
        if names.contains(reference) || profiles.contains(reference) {
            return Ok(());
        }
        Err(ValidationError::new(
            ref_field,
            Rule::UnknownReference,
            format!(
                "`{reference}` names no delegation or profile of the plan; use a delegation \
                 name ({}) or a profile id ({})",
                join_list(names.iter()),
                join_list(profiles.iter()),
            ),
        ))
    };
    for (list, refs) in [("required", &join.required), ("optional", &join.optional)] {
        for (i, r) in refs.iter().enumerate() {
            check(r, nth(&at(field, list), i))?;
        }
    }
    for k in join.weights.keys() {
        check(k, key(&at(field, "weights"), k))?;
    }
    let count = join.minimum.count;
    if usize::try_from(count).unwrap_or(usize::MAX) > plan.len() {
        return Err(ValidationError::new(
            at(&at(field, "minimum"), "count"),
            Rule::Range,
            format!(
                "minimum.count {count} can never be met by a plan of {} delegations; lower it",
                plan.len()
            ),
        ));
    }
    Ok(())
}

fn goal(value: &str, field: &FieldPath<'_>) -> Result<String, ValidationError> {
    let goal = required_str(value, field)?;
    max_chars(&goal, MAX_GOAL_CHARS, field)?;
    Ok(goal)
}

fn idempotency_key(value: &str, field: &FieldPath<'_>) -> Result<Option<String>, ValidationError> {
    if value.is_empty() {
        return Ok(None);
    }
    max_chars(value, MAX_IDEMPOTENCY_KEY_CHARS, field)?;
    if value.chars().any(char::is_control) || value.trim().is_empty() {
        return Err(ValidationError::new(
            field,
            Rule::Format,
            "the idempotency key must be printable text without control characters",
        ));
    }
    Ok(Some(value.to_owned()))
}

fn labels(
    labels: &HashMap<String, String>,
    field: &FieldPath<'_>,
) -> Result<BTreeMap<String, String>, ValidationError> {
    let sorted: BTreeMap<String, String> =
        labels.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
    if let Some(k) = sorted.keys().find(|k| k.trim().is_empty()) {
        return Err(ValidationError::new(
            key(field, k),
            Rule::Required,
            "label keys must not be empty",
        ));
    }
    Ok(sorted)
}

// ---------------------------------------------------------------------------------------
// Join pieces.

fn references(values: &[String], field: &FieldPath<'_>) -> Result<Vec<String>, ValidationError> {
    let refs = non_blank_list(values, field)?;
    no_duplicates(refs.iter().map(String::as_str), field, "")?;
    Ok(refs)
}

fn join_minimum(
    m: Option<&v1::JoinMinimum>,
    field: &FieldPath<'_>,
) -> Result<JoinMinimum, ValidationError> {
    let Some(m) = m else {
        return Ok(JoinMinimum {
            count: 1,
            ..JoinMinimum::default()
        });
    };
    let weight = finite_number(
        m.weight,
        &at(field, "weight"),
        |w| w >= 0.0,
        "a finite number ≥ 0 (0: no weight threshold)",
    )?;
    let kinds_field = at(field, "required_evidence_kinds");
    let required_evidence_kinds = non_blank_list(&m.required_evidence_kinds, &kinds_field)?;
    no_duplicates(
        required_evidence_kinds.iter().map(String::as_str),
        &kinds_field,
        "",
    )?;
    Ok(JoinMinimum {
        // The contract reads 0 as 1: a decision always rests on at least one result.
        count: m.count.max(1),
        weight,
        required_evidence_kinds,
    })
}

fn weights(
    weights: &HashMap<String, f64>,
    field: &FieldPath<'_>,
) -> Result<BTreeMap<String, f64>, ValidationError> {
    // Sorted first, so the error reported for several bad entries does not depend on the
    // map's iteration order.
    let sorted: BTreeMap<&str, f64> = weights.iter().map(|(k, v)| (k.as_str(), *v)).collect();
    let mut out = BTreeMap::new();
    for (k, w) in sorted {
        let entry = key(field, k);
        if k.trim().is_empty() {
            return Err(ValidationError::new(
                entry,
                Rule::Required,
                "a weight must be keyed by a delegation name or profile id",
            ));
        }
        let w = finite_number(w, &entry, |w| w > 0.0, "a finite number > 0")?;
        out.insert(k.to_owned(), w);
    }
    Ok(out)
}

/// Resolves the exclusive pair `deadline`/`timeout` of the message at `field` into an
/// absolute deadline after `run_start` (`None` when neither is set).
fn resolve_deadline(
    deadline: Option<&prost_types::Timestamp>,
    timeout: Option<&prost_types::Duration>,
    run_start: SystemTime,
    field: &FieldPath<'_>,
) -> Result<Option<SystemTime>, ValidationError> {
    match (deadline, timeout) {
        (Some(_), Some(_)) => Err(ValidationError::new(
            at(field, "timeout"),
            Rule::Exclusive,
            "set either deadline (absolute) or timeout (relative to the run's start), not both",
        )),
        (Some(d), None) => {
            let deadline_field = at(field, "deadline");
            let deadline = from_timestamp(d, &deadline_field)?;
            if deadline <= run_start {
                return Err(ValidationError::new(
                    deadline_field,
                    Rule::InPast,
                    format!(
                        "deadline {} is not after the run's start {}; give a later deadline or \
                         a timeout",
                        to_timestamp(deadline),
                        to_timestamp(run_start)
                    ),
                ));
            }
            Ok(Some(deadline))
        }
        (None, Some(t)) => {
            let timeout_field = at(field, "timeout");
            let timeout = positive_duration(t, &timeout_field)?;
            add_duration(run_start, timeout, &timeout_field).map(Some)
        }
        (None, None) => Ok(None),
    }
}

// ---------------------------------------------------------------------------------------
// Task pieces, shared by planned and dispatched tasks.

fn task_scope(
    scope: Option<&v1::TaskScope>,
    field: &FieldPath<'_>,
) -> Result<TaskScope, ValidationError> {
    let Some(scope) = scope else {
        return Ok(TaskScope::default());
    };
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

fn claim(
    c: &v1::Claim,
    allowed_prefixes: &[String],
    field: &FieldPath<'_>,
) -> Result<(), ValidationError> {
    let claim_id = required_str(&c.claim_id, &at(field, "claim_id"))?;
    required_str(&c.topic, &at(field, "topic"))?;
    required_str(&c.value, &at(field, "value"))?;
    let refs_field = at(field, "evidence_refs");
    if c.evidence_refs.is_empty() {
        return Err(ValidationError::new(
            refs_field,
            Rule::Required,
            format!(
                "claim `{claim_id}` cites no evidence; cite at least one evidence id under {}",
                describe_prefixes(allowed_prefixes)
            ),
        ));
    }
    for (i, r) in c.evidence_refs.iter().enumerate() {
        let ref_field = nth(&refs_field, i);
        let r = required_str(r, &ref_field)?;
        if !allowed_prefixes.iter().any(|p| r.starts_with(p.as_str())) {
            return Err(ValidationError::new(
                ref_field,
                Rule::NotAllowed,
                format!(
                    "evidence `{r}` lies outside the delegation's allowed evidence prefixes \
                     ({}); cite only evidence under them",
                    describe_prefixes(allowed_prefixes)
                ),
            ));
        }
    }
    finite_number(
        c.confidence,
        &at(field, "confidence"),
        |x| (0.0..=1.0).contains(&x),
        "between 0 and 1",
    )?;
    Ok(())
}

fn describe_prefixes(prefixes: &[String]) -> String {
    if prefixes.is_empty() {
        "none: the delegation allows no evidence".to_owned()
    } else {
        join_list(prefixes.iter())
    }
}

// ---------------------------------------------------------------------------------------
// Field-level rules.

fn required_str(value: &str, field: &FieldPath<'_>) -> Result<String, ValidationError> {
    match value.trim() {
        "" => Err(ValidationError::new(
            field,
            Rule::Required,
            format!("{} must be set and not blank", leaf(field)),
        )),
        v => Ok(v.to_owned()),
    }
}

fn max_chars(value: &str, max: usize, field: &FieldPath<'_>) -> Result<(), ValidationError> {
    let len = value.chars().count();
    if len > max {
        return Err(ValidationError::new(
            field,
            Rule::TooLong,
            format!(
                "{} is {len} characters long; shorten it to at most {max}",
                leaf(field)
            ),
        ));
    }
    Ok(())
}

fn non_blank_list(
    values: &[String],
    field: &FieldPath<'_>,
) -> Result<Vec<String>, ValidationError> {
    each(values, field, |v, f| required_str(v, f))
}

fn plan_name(value: &str, field: &FieldPath<'_>) -> Result<String, ValidationError> {
    if value.is_empty() {
        return Err(ValidationError::new(
            field,
            Rule::Required,
            "give the delegation a name of [a-z0-9_-]{1,64}, e.g. `logs`",
        ));
    }
    max_chars(value, MAX_NAME_CHARS, field)?;
    let allowed = |c: char| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_' || c == '-';
    if !value.chars().all(allowed) {
        return Err(ValidationError::new(
            field,
            Rule::Format,
            format!("name `{value}` may only contain a-z, 0-9, `_` and `-`"),
        ));
    }
    Ok(value.to_owned())
}

fn profile_id(value: &str, field: &FieldPath<'_>) -> Result<String, ValidationError> {
    if value.is_empty() {
        return Err(ValidationError::new(
            field,
            Rule::Required,
            "give the profile a stable id, e.g. `logs-investigator`",
        ));
    }
    max_chars(value, MAX_PROFILE_ID_CHARS, field)?;
    let allowed = |c: char| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-');
    if !value.chars().all(allowed) {
        return Err(ValidationError::new(
            field,
            Rule::Format,
            format!("profile id `{value}` may only contain A-Z, a-z, 0-9, `.`, `_` and `-`"),
        ));
    }
    Ok(value.to_owned())
}

fn artifact_uri(value: &str, field: &FieldPath<'_>) -> Result<String, ValidationError> {
    match value.strip_prefix(ARTIFACT_SCHEME) {
        Some(rest) if !rest.is_empty() => Ok(value.to_owned()),
        _ => Err(ValidationError::new(
            field,
            Rule::Format,
            format!("`{value}` is not an artifact URI; use `artifact://<tenant>/<sha256>`"),
        )),
    }
}

/// An evidence prefix looks like `scheme://...`: a URI scheme (a letter, then letters,
/// digits, `+`, `-` or `.`), `://`, and no whitespace.
fn evidence_prefix(value: &str, field: &FieldPath<'_>) -> Result<String, ValidationError> {
    let well_formed = value.split_once("://").is_some_and(|(scheme, _)| {
        let mut chars = scheme.chars();
        chars.next().is_some_and(|c| c.is_ascii_alphabetic())
            && chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.'))
    }) && !value.chars().any(char::is_whitespace);
    if well_formed {
        Ok(value.to_owned())
    } else {
        Err(ValidationError::new(
            field,
            Rule::Format,
            format!("evidence prefix `{value}` must look like `scheme://...`, e.g. `logs://`"),
        ))
    }
}

fn positive_duration(
    d: &prost_types::Duration,
    field: &FieldPath<'_>,
) -> Result<Duration, ValidationError> {
    let d = from_duration(d, field)?;
    if d.is_zero() {
        return Err(ValidationError::new(
            field,
            Rule::Range,
            format!(
                "{} must be greater than zero; leave it unset instead",
                leaf(field)
            ),
        ));
    }
    Ok(d)
}

fn add_duration(
    start: SystemTime,
    d: Duration,
    field: &FieldPath<'_>,
) -> Result<SystemTime, ValidationError> {
    start.checked_add(d).ok_or_else(|| {
        ValidationError::new(
            field,
            Rule::Range,
            format!("{} is too large to be a point in time", leaf(field)),
        )
    })
}

fn finite_number(
    value: f64,
    field: &FieldPath<'_>,
    ok: impl Fn(f64) -> bool,
    expected: &str,
) -> Result<f64, ValidationError> {
    if value.is_finite() && ok(value) {
        Ok(value)
    } else {
        Err(ValidationError::new(
            field,
            Rule::Range,
            format!("{} is {value}; it must be {expected}", leaf(field)),
        ))
    }
}

/// `0` takes `default`; anything above `cap` is refused.
fn capped(
    value: u32,
    default: u32,
    cap: u32,
    field: &FieldPath<'_>,
) -> Result<u32, ValidationError> {
    match value {
        0 => Ok(default),
        v if v > cap => Err(ValidationError::new(
            field,
            Rule::Range,
            format!("{} {v} exceeds the cap of {cap}; lower it", leaf(field)),
        )),
        v => Ok(v),
    }
}

fn non_zero<T: Default + PartialEq>(value: T) -> Option<T> {
    (value != T::default()).then_some(value)
}

/// Validates every element of `items` with `f`, naming `field[i]`.
fn each<T, R>(
    items: &[T],
    field: &FieldPath<'_>,
    f: impl Fn(&T, &FieldPath<'_>) -> Result<R, ValidationError>,
) -> Result<Vec<R>, ValidationError> {
    items
        .iter()
        .enumerate()
        .map(|(i, item)| f(item, &nth(field, i)))
        .collect()
}

/// Refuses the second occurrence of a value, naming `field[i]suffix` and the first one.
fn no_duplicates<'a>(
    values: impl IntoIterator<Item = &'a str>,
    field: &FieldPath<'_>,
    suffix: &str,
) -> Result<(), ValidationError> {
    let mut seen = HashMap::new();
    for (i, v) in values.into_iter().enumerate() {
        if let Some(first) = seen.insert(v, i) {
            return Err(ValidationError::new(
                format!("{}{suffix}", nth(field, i)),
                Rule::Duplicate,
                format!(
                    "`{v}` repeats {}{suffix}; every entry must be unique",
                    nth(&FieldPath::new(&leaf(field)), first)
                ),
            ));
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Enums.

/// A wire enum: its known values (for messages) and its domain counterpart.
trait WireEnum: Copy + TryFrom<i32> + 'static {
    /// The validated value.
    type Domain;
    /// Every specified value, in wire order.
    const KNOWN: &'static [Self];
    /// The wire name, e.g. `JOIN_STRATEGY_ALL`.
    fn name(self) -> &'static str;
    /// The domain value; `None` for UNSPECIFIED.
    fn domain(self) -> Option<Self::Domain>;
}

macro_rules! wire_enum {
    ($wire:ident => $domain:ty { $($variant:ident => $value:expr),+ $(,)? }) => {
        impl WireEnum for v1::$wire {
            type Domain = $domain;
            const KNOWN: &'static [Self] = &[$(v1::$wire::$variant),+];
            fn name(self) -> &'static str {
                self.as_str_name()
            }
            fn domain(self) -> Option<$domain> {
                match self {
                    v1::$wire::Unspecified => None,
                    $(v1::$wire::$variant => Some($value),)+
                }
            }
        }
    };
}

wire_enum!(JoinStrategy => model::JoinStrategy {
    All => model::JoinStrategy::All,
    Quorum => model::JoinStrategy::Quorum,
    TimeoutPartial => model::JoinStrategy::TimeoutPartial,
    FirstValid => model::JoinStrategy::FirstValid,
});
wire_enum!(OnTimeout => model::OnTimeout {
    EmitPartial => model::OnTimeout::EmitPartial,
    Fail => model::OnTimeout::Fail,
});
wire_enum!(OnConflict => model::OnConflict {
    PreserveAndEscalate => model::OnConflict::PreserveAndEscalate,
    FollowUp => model::OnConflict::FollowUp,
});
wire_enum!(LateResultPolicy => model::LateResultPolicy {
    Discard => model::LateResultPolicy::Discard,
    AppendRevision => model::LateResultPolicy::AppendRevision,
});
wire_enum!(OverflowPolicy => model::Overflow {
    Queue => model::Overflow::Queue,
    Truncate => model::Overflow::Truncate,
    Reject => model::Overflow::Reject,
});
wire_enum!(TaskStatus => v1::TaskStatus {
    Completed => v1::TaskStatus::Completed,
    Partial => v1::TaskStatus::Partial,
    Blocked => v1::TaskStatus::Blocked,
    Failed => v1::TaskStatus::Failed,
    TimedOut => v1::TaskStatus::TimedOut,
});

/// `Ok(None)` for UNSPECIFIED, the domain value for a known one, UnknownEnum otherwise.
fn enum_value<E: WireEnum>(
    raw: i32,
    field: &FieldPath<'_>,
) -> Result<Option<E::Domain>, ValidationError> {
    match E::try_from(raw) {
        Ok(v) => Ok(v.domain()),
        Err(_) => Err(ValidationError::new(
            field,
            Rule::UnknownEnum,
            format!(
                "unknown {} {raw}; expected one of {}",
                leaf(field),
                expected::<E>()
            ),
        )),
    }
}

fn required_enum<E: WireEnum>(
    raw: i32,
    field: &FieldPath<'_>,
) -> Result<E::Domain, ValidationError> {
    enum_value::<E>(raw, field)?.ok_or_else(|| {
        ValidationError::new(
            field,
            Rule::Required,
            format!("set {} to one of {}", leaf(field), expected::<E>()),
        )
    })
}

fn enum_or_default<E: WireEnum>(
    raw: i32,
    field: &FieldPath<'_>,
) -> Result<E::Domain, ValidationError>
where
    E::Domain: Default,
{
    Ok(enum_value::<E>(raw, field)?.unwrap_or_default())
}

fn expected<E: WireEnum>() -> String {
    join_list(E::KNOWN.iter().map(|e| e.name()))
}

// ---------------------------------------------------------------------------------------
// Field paths.

/// `field.name` (just `name` at the root).
fn at<'a>(field: &'a FieldPath<'a>, name: &'a str) -> FieldPath<'a> {
    field.at(name)
}

/// `field[i]`.
fn nth<'a>(field: &'a FieldPath<'a>, i: usize) -> FieldPath<'a> {
    field.nth(i)
}

/// `field["key"]`, quoted so any key stays unambiguous.
fn key<'a>(field: &'a FieldPath<'a>, k: &'a str) -> FieldPath<'a> {
    field.key(k)
}

/// The last name of a path, without indices: `spec.join.strategy` → `strategy`.
fn leaf(field: &FieldPath<'_>) -> String {
    field.leaf()
}

fn join_list<I>(items: I) -> String
where
    I: IntoIterator,
    I::Item: AsRef<str>,
{
    items
        .into_iter()
        .map(|s| s.as_ref().to_owned())
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_and_leaves() {
        let root = FieldPath::new("");
        let spec = FieldPath::new("spec");
        assert_eq!(at(&root, "goal").to_string(), "goal");
        assert_eq!(at(&spec, "goal").to_string(), "spec.goal");
        let delegations = at(&spec, "delegations");
        assert_eq!(nth(&delegations, 2).to_string(), "spec.delegations[2]");
        let first = nth(&delegations, 0);
        assert_eq!(at(&first, "goal").to_string(), "spec.delegations[0].goal");
        let second = nth(&root, 1);
        assert_eq!(at(&second, "goal").to_string(), "[1].goal");
        let join = at(&spec, "join");
        let weights = at(&join, "weights");
        assert_eq!(
            key(&weights, "logs").to_string(),
            "spec.join.weights[\"logs\"]"
        );
        let shown = FieldPath::shown(&join);
        assert_eq!(at(&shown, "strategy").to_string(), "spec.join.strategy");

        assert_eq!(leaf(&FieldPath::new("spec.join.strategy")), "strategy");
        assert_eq!(
            leaf(&FieldPath::new("result.claims[0].evidence_refs[1]")),
            "evidence_refs"
        );
        assert_eq!(leaf(&FieldPath::new("goal")), "goal");
        assert_eq!(leaf(&key(&weights, "a.b")), "weights");
        assert_eq!(leaf(&at(&first, "goal")), "goal");
        assert_eq!(leaf(&nth(&delegations, 3)), "delegations");
    }

    #[test]
    fn enum_lists_name_every_known_value() {
        assert_eq!(
            expected::<v1::JoinStrategy>(),
            "JOIN_STRATEGY_ALL, JOIN_STRATEGY_QUORUM, JOIN_STRATEGY_TIMEOUT_PARTIAL, \
             JOIN_STRATEGY_FIRST_VALID"
        );
        assert_eq!(
            enum_value::<v1::OverflowPolicy>(0, &FieldPath::new("o")),
            Ok(None)
        );
        assert_eq!(
            enum_value::<v1::OverflowPolicy>(2, &FieldPath::new("o")),
            Ok(Some(model::Overflow::Truncate))
        );
    }
}
