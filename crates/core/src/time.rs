//! Conversions between wire timestamps/durations and `std::time`.

use std::fmt;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::{Rule, ValidationError};

/// Converts a wire timestamp into a `SystemTime`, naming `field` when it is out of range.
pub fn from_timestamp(
    ts: &prost_types::Timestamp,
    field: &(impl fmt::Display + ?Sized),
) -> Result<SystemTime, ValidationError> {
    if ts.nanos < 0 || ts.nanos >= 1_000_000_000 || ts.seconds < 0 {
        return Err(ValidationError::new(
            field.to_string(),
            Rule::Range,
            "timestamp must be after 1970-01-01 with nanos in [0, 1e9)",
        ));
    }
    #[allow(clippy::cast_sign_loss)] // both checked non-negative above
    Ok(UNIX_EPOCH + Duration::new(ts.seconds as u64, ts.nanos as u32))
}

/// Converts a `SystemTime` into a wire timestamp.
pub fn to_timestamp(t: SystemTime) -> prost_types::Timestamp {
    prost_types::Timestamp::from(t)
}

/// Converts a wire duration into a `Duration`, naming `field` when it is negative or
/// malformed.
pub fn from_duration(
    d: &prost_types::Duration,
    field: &(impl fmt::Display + ?Sized),
) -> Result<Duration, ValidationError> {
    if d.seconds < 0 || d.nanos < 0 || d.nanos >= 1_000_000_000 {
        return Err(ValidationError::new(
            field.to_string(),
            Rule::Range,
            "duration must not be negative",
        ));
    }
    #[allow(clippy::cast_sign_loss)] // both checked non-negative above
    Ok(Duration::new(d.seconds as u64, d.nanos as u32))
}

/// Converts a `Duration` into a wire duration (saturating at i64::MAX seconds).
pub fn to_duration(d: Duration) -> prost_types::Duration {
    prost_types::Duration {
        seconds: i64::try_from(d.as_secs()).unwrap_or(i64::MAX),
        nanos: i32::try_from(d.subsec_nanos()).unwrap_or(0),
    }
}
