//! Durations and deadlines: a positive duration, a duration added to a point in time,
//! and the exclusive deadline/timeout pair resolved against the run's start.

use std::time::{Duration, SystemTime};

use super::{at, leaf};
use crate::time::{from_duration, from_timestamp, to_timestamp};
use crate::{FieldPath, Rule, ValidationError};

/// Resolves the exclusive pair `deadline`/`timeout` of the message at `field` into an
/// absolute deadline after `run_start` (`None` when neither is set).
pub(super) fn resolve_deadline(
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

pub(super) fn positive_duration(
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

pub(super) fn add_duration(
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
