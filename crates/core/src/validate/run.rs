//! Run specs as a whole: the goal, idempotency key, static plan or planner, labels and
//! limits, and the checks that tie the join contract to the plan.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::SystemTime;

use convene_proto::v1;

use super::deadline::{add_duration, resolve_deadline};
use super::enums::{enum_or_default, expected};
use super::join::join_contract_at;
use super::rules::{
    capped, each, finite_number, max_chars, no_duplicates, non_zero, profile_id, required_str,
};
use super::task::planned_task_at;
use super::{
    MAX_GOAL_CHARS, MAX_IDEMPOTENCY_KEY_CHARS, MAX_PLAN_DELEGATIONS,
    MAX_PLANNER_INSTRUCTIONS_CHARS, at, join_list, key, nth,
};
use crate::model::{self, Limits};
use crate::{FieldPath, Rule, ValidationError};

/// Validates a submitted run spec (field root `spec`). `now` is the run's start: it
/// resolves the join's and the limits' timeouts into deadlines and is the instant
/// absolute deadlines must lie after.
///
/// A spec gives exactly one of a static plan (`delegations`) or a `planner`: both is
/// [`Rule::Exclusive`], neither is [`Rule::Required`].
///
/// - **Static plan**: every join reference (`required`, `optional`, `weights`,
///   `required_profiles`) must name a delegation or profile of the plan
///   ([`Rule::UnknownReference`]), and `minimum.count` must be reachable by the plan;
///   `limits.max_rounds` defaults to [`Limits::DEFAULT_MAX_ROUNDS`].
/// - **Planner**: `planner.profile_id` must be a valid profile id and
///   `planner.instructions` at most [`MAX_PLANNER_INSTRUCTIONS_CHARS`] characters. The
///   planner names its delegations, so the contract names profiles only: `join.required`,
///   `join.optional` and `join.weights` must be empty ([`Rule::NotAllowed`]; use
///   `join.required_profiles`). `limits.max_rounds` defaults to
///   [`Limits::DEFAULT_PLANNER_MAX_ROUNDS`]. The validated spec has an empty `plan`.
pub fn run_spec(spec: &v1::RunSpec, now: SystemTime) -> Result<model::RunSpec, ValidationError> {
    const ROOT: &FieldPath<'static> = &FieldPath::new("spec");
    let goal = goal(&spec.goal, &at(ROOT, "goal"))?;
    let idempotency_key = idempotency_key(&spec.idempotency_key, &at(ROOT, "idempotency_key"))?;
    let (plan, planner) = plan_or_planner(spec, ROOT)?;

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
    let default_rounds = if planner.is_some() {
        join_fits_planner(&join, &join_field)?;
        Limits::DEFAULT_PLANNER_MAX_ROUNDS
    } else {
        join_fits_plan(&join, &plan, &join_field)?;
        Limits::DEFAULT_MAX_ROUNDS
    };

    let limits = limits_at(
        spec.limits.as_ref(),
        now,
        default_rounds,
        &at(ROOT, "limits"),
    )?;
    let labels = labels(&spec.labels, &at(ROOT, "labels"))?;
    Ok(model::RunSpec {
        goal,
        idempotency_key,
        plan,
        planner,
        join,
        limits,
        labels,
    })
}

/// Validates run limits, applying the [`Limits`] defaults to zero or unset values and
/// resolving the deadline against `run_start` (default: [`Limits::DEFAULT_TIMEOUT`]).
/// The defaults are those of a static plan (`max_rounds` [`Limits::DEFAULT_MAX_ROUNDS`]);
/// [`run_spec`] applies a planner's run's own default rounds.
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
    limits_at(
        l,
        run_start,
        Limits::DEFAULT_MAX_ROUNDS,
        &FieldPath::new(field),
    )
}

/// [`limits`] with `default_rounds` for a zero or unset `max_rounds`.
fn limits_at(
    l: Option<&v1::Limits>,
    run_start: SystemTime,
    default_rounds: u32,
    field: &FieldPath<'_>,
) -> Result<Limits, ValidationError> {
    let Some(l) = l else {
        return Ok(Limits {
            max_rounds: default_rounds,
            ..Limits::defaults(run_start)
        });
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
        default_rounds,
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

/// The static plan or the planner: exactly one of them.
fn plan_or_planner(
    spec: &v1::RunSpec,
    root: &FieldPath<'_>,
) -> Result<(Vec<model::PlannedTask>, Option<model::Planner>), ValidationError> {
    let field = at(root, "delegations");
    match (spec.delegations.is_empty(), &spec.planner) {
        (false, Some(_)) => Err(ValidationError::new(
            at(root, "planner"),
            Rule::Exclusive,
            "set either delegations (a static plan) or planner, not both",
        )),
        (true, Some(p)) => Ok((Vec::new(), Some(planner(p, &at(root, "planner"))?))),
        (true, None) => Err(ValidationError::new(
            field,
            Rule::Required,
            "give a static plan in delegations (at least one delegation), or a planner that \
             proposes them",
        )),
        (false, None) => {
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
            Ok((plan, None))
        }
    }
}

fn planner(p: &v1::PlannerSpec, field: &FieldPath<'_>) -> Result<model::Planner, ValidationError> {
    let profile_id = profile_id(&p.profile_id, &at(field, "profile_id"))?;
    let instructions = p.instructions.trim().to_owned();
    max_chars(
        &instructions,
        MAX_PLANNER_INSTRUCTIONS_CHARS,
        &at(field, "instructions"),
    )?;
    Ok(model::Planner {
        profile_id,
        instructions,
    })
}

/// A planner names its delegations as it goes, so a planner's contract cannot name them
/// in advance: it names the profiles it needs in `required_profiles`, and nothing in
/// `required`, `optional` or `weights`.
fn join_fits_planner(
    join: &model::JoinContract,
    field: &FieldPath<'_>,
) -> Result<(), ValidationError> {
    let refuse = |name: &str, fix: &str| {
        Err(ValidationError::new(
            at(field, name),
            Rule::NotAllowed,
            format!("a planner's run names profiles, not delegations: {fix}"),
        ))
    };
    if !join.required.is_empty() {
        return refuse("required", "use join.required_profiles");
    }
    if !join.optional.is_empty() {
        return refuse(
            "optional",
            "leave join.optional empty and name what the run needs in join.required_profiles",
        );
    }
    if !join.weights.is_empty() {
        return refuse(
            "weights",
            "leave join.weights empty (every accepted result weighs 1) and name what the run \
             needs in join.required_profiles",
        );
    }
    Ok(())
}

/// Every join reference names a delegation or profile of the plan (a required profile
/// names a profile of the plan), and the minimum count can be reached by the plan at all.
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
    for (i, p) in join.required_profiles.iter().enumerate() {
        if !profiles.contains(p.as_str()) {
            return Err(ValidationError::new(
                nth(&at(field, "required_profiles"), i),
                Rule::UnknownReference,
                format!(
                    "`{p}` is no profile of the plan, so it could never be met; use a profile \
                     id of the plan ({})",
                    join_list(profiles.iter()),
                ),
            ));
        }
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

pub(super) fn goal(value: &str, field: &FieldPath<'_>) -> Result<String, ValidationError> {
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
