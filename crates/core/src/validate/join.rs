//! Join contracts: references, strategy, minimum, deadline, conflict and late-result
//! policies, weights, required profiles.

use std::collections::{BTreeMap, HashMap};
use std::time::SystemTime;

use convene_proto::v1;

use super::deadline::resolve_deadline;
use super::enums::{enum_or_default, required_enum};
use super::rules::{each, finite_number, no_duplicates, non_blank_list, profile_id};
use super::{at, key, nth};
use crate::model::{self, JoinMinimum};
use crate::{FieldPath, Rule, ValidationError};

/// Validates a join contract; `run_start` resolves `timeout` into the deadline.
///
/// References are only checked for form here (`required_profiles` must be valid profile
/// ids, without duplicates); whether they name something of the plan, and whether a
/// planner's run may have them at all, is checked by [`run_spec`](super::run_spec),
/// which knows the plan.
pub fn join_contract(
    j: &v1::JoinContract,
    run_start: SystemTime,
    field: &str,
) -> Result<model::JoinContract, ValidationError> {
    join_contract_at(j, run_start, &FieldPath::new(field))
}

pub(super) fn join_contract_at(
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
    let required_profiles = profile_ids(&j.required_profiles, &at(field, "required_profiles"))?;
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
        required_profiles,
    })
}

fn references(values: &[String], field: &FieldPath<'_>) -> Result<Vec<String>, ValidationError> {
    let refs = non_blank_list(values, field)?;
    no_duplicates(refs.iter().map(String::as_str), field, "")?;
    Ok(refs)
}

fn profile_ids(values: &[String], field: &FieldPath<'_>) -> Result<Vec<String>, ValidationError> {
    let ids = each(values, field, |v, f| profile_id(v, f))?;
    no_duplicates(ids.iter().map(String::as_str), field, "")?;
    Ok(ids)
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
