//! Results a worker returns: ids matching the task, a known status, claims citing
//! evidence inside the task's prefixes; and the form of artifact URIs and evidence
//! prefixes.

use convene_proto::v1;

use super::enums::required_enum;
use super::rules::{each, finite_number, no_duplicates, required_str};
use super::{at, join_list, nth};
use crate::{FieldPath, Rule, ValidationError};

/// The URI scheme of stored artifacts.
const ARTIFACT_SCHEME: &str = "artifact://";

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

pub(super) fn artifact_uri(value: &str, field: &FieldPath<'_>) -> Result<String, ValidationError> {
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
pub(super) fn evidence_prefix(
    value: &str,
    field: &FieldPath<'_>,
) -> Result<String, ValidationError> {
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
