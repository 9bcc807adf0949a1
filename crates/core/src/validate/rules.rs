//! Rules for single fields shared by every contract area: required and bounded text,
//! names and ids, numbers, lists without duplicates.

use std::collections::HashMap;

use super::{MAX_NAME_CHARS, MAX_PROFILE_ID_CHARS, leaf, nth};
use crate::{FieldPath, Rule, ValidationError};

pub(super) fn required_str(value: &str, field: &FieldPath<'_>) -> Result<String, ValidationError> {
    match value.trim() {
        "" => Err(ValidationError::new(
            field,
            Rule::Required,
            format!("{} must be set and not blank", leaf(field)),
        )),
        v => Ok(v.to_owned()),
    }
}

pub(super) fn max_chars(
    value: &str,
    max: usize,
    field: &FieldPath<'_>,
) -> Result<(), ValidationError> {
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

pub(super) fn non_blank_list(
    values: &[String],
    field: &FieldPath<'_>,
) -> Result<Vec<String>, ValidationError> {
    each(values, field, |v, f| required_str(v, f))
}

pub(super) fn plan_name(value: &str, field: &FieldPath<'_>) -> Result<String, ValidationError> {
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

pub(super) fn profile_id(value: &str, field: &FieldPath<'_>) -> Result<String, ValidationError> {
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

pub(super) fn finite_number(
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
pub(super) fn capped(
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

pub(super) fn non_zero<T: Default + PartialEq>(value: T) -> Option<T> {
    (value != T::default()).then_some(value)
}

/// Refuses a list longer than `max`, naming the field, how long it is and what to do.
pub(super) fn at_most<T>(
    items: &[T],
    max: usize,
    field: &FieldPath<'_>,
) -> Result<(), ValidationError> {
    if items.len() > max {
        return Err(ValidationError::new(
            field,
            Rule::TooLong,
            format!(
                "{} has {} entries; give at most {max} (wildcards such as service/* cover many)",
                leaf(field),
                items.len()
            ),
        ));
    }
    Ok(())
}

/// Validates every element of `items` with `f`, naming `field[i]`.
pub(super) fn each<T, R>(
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
pub(super) fn no_duplicates<'a>(
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
