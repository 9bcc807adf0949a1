//! Time: conversions between wire timestamps/durations and `std::time`, and [`Clock`],
//! the source of "now" the services read (the wall clock, or one a test moves).

use std::fmt;
use std::sync::{Arc, Mutex, PoisonError};
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

/// A time as people write it in a filter: an RFC 3339 time (with `Z` or an offset) or
/// how long before `now` (`30m`, `2h`, `7days`). The error says what to write.
///
/// # Errors
///
/// Text that is neither, or a duration reaching before any time this system can show.
pub fn time_or_ago(text: &str, now: SystemTime) -> Result<SystemTime, String> {
    if let Ok(ago) = humantime::parse_duration(text) {
        return now
            .checked_sub(ago)
            .ok_or_else(|| format!("{text:?} ago is before any time this system can show"));
    }
    let invalid = || {
        format!(
            "{text:?}: give an RFC 3339 time (2026-07-23T02:00:00Z, or with an offset: \
             2026-07-23T04:00:00+02:00) or how long ago (30m, 2h, 7days)"
        )
    };
    let at: prost_types::Timestamp = text.parse().map_err(|_| invalid())?;
    SystemTime::try_from(at).map_err(|_| invalid())
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

/// The source of "now" a service reads: a cheap, cloneable handle on the system's wall
/// clock, or on a time that tests control ([`ManualClock`], [`Clock::from_fn`]), so
/// expiry and validity windows can be checked without waiting.
#[derive(Clone, Default)]
pub struct Clock(Source);

#[derive(Clone, Default)]
enum Source {
    /// The system's wall clock: no allocation, no indirection.
    #[default]
    System,
    /// Any other time source.
    Custom(Arc<dyn Fn() -> SystemTime + Send + Sync>),
}

impl Clock {
    /// The system's wall clock (also the [`Default`]).
    pub fn system() -> Self {
        Self(Source::System)
    }

    /// A clock that reads `now` every time it is asked.
    pub fn from_fn(now: impl Fn() -> SystemTime + Send + Sync + 'static) -> Self {
        Self(Source::Custom(Arc::new(now)))
    }

    /// The current time.
    pub fn now(&self) -> SystemTime {
        match &self.0 {
            Source::System => SystemTime::now(),
            Source::Custom(now) => now(),
        }
    }
}

impl fmt::Debug for Clock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.0 {
            Source::System => f.write_str("Clock::System"),
            Source::Custom(_) => f.write_str("Clock::Custom"),
        }
    }
}

/// A clock that stands still until moved. Clones share one time, so a test keeps a clone
/// and moves the service's clock from outside; [`Clock::from`] turns it into the handle a
/// service takes.
#[derive(Clone, Debug)]
pub struct ManualClock {
    now: Arc<Mutex<SystemTime>>,
}

impl ManualClock {
    /// A clock showing `start`.
    pub fn new(start: SystemTime) -> Self {
        Self {
            now: Arc::new(Mutex::new(start)),
        }
    }

    /// The time it shows.
    pub fn now(&self) -> SystemTime {
        *self.now.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Moves the clock forward by `by`.
    pub fn advance(&self, by: Duration) {
        *self.now.lock().unwrap_or_else(PoisonError::into_inner) += by;
    }

    /// Sets the clock to `to`.
    pub fn set(&self, to: SystemTime) {
        *self.now.lock().unwrap_or_else(PoisonError::into_inner) = to;
    }
}

impl From<ManualClock> for Clock {
    fn from(manual: ManualClock) -> Self {
        Clock::from_fn(move || manual.now())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_filter_time_is_rfc_3339_or_a_duration_ago_and_never_panics() {
        let now = UNIX_EPOCH + Duration::from_secs(1_800_000_000);
        assert_eq!(time_or_ago("2h", now), Ok(now - Duration::from_secs(7200)));
        assert_eq!(
            time_or_ago("2027-01-15T08:00:00+02:00", now),
            Ok(UNIX_EPOCH + Duration::from_secs(1_799_992_800))
        );
        assert!(
            time_or_ago("500000000000years", now)
                .unwrap_err()
                .contains("before any time")
        );
        assert!(
            time_or_ago("yesterday-ish", now)
                .unwrap_err()
                .contains("RFC 3339")
        );
    }

    #[test]
    fn the_system_clock_follows_the_wall_clock() {
        let before = SystemTime::now();
        let now = Clock::default().now();
        assert!(now >= before && now <= SystemTime::now());
    }

    #[test]
    fn a_manual_clock_moves_only_when_told_and_clones_share_it() {
        let start = UNIX_EPOCH + Duration::from_secs(1_000);
        let manual = ManualClock::new(start);
        let clock = Clock::from(manual.clone());
        assert_eq!(clock.now(), start);
        manual.advance(Duration::from_secs(5));
        assert_eq!(clock.clone().now(), start + Duration::from_secs(5));
        manual.set(start);
        assert_eq!(clock.now(), start);
    }
}
