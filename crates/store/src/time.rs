//! Timestamps as stored: microseconds since the Unix epoch in a 64-bit integer, which
//! both back ends compare and index like any integer.

use std::time::{Duration, SystemTime};

/// `time` as microseconds since the Unix epoch (negative before it), saturating far
/// outside the years 1677–2262 is never reached by times convene stores.
pub fn micros(time: SystemTime) -> i64 {
    match time.duration_since(SystemTime::UNIX_EPOCH) {
        Ok(after) => i64::try_from(after.as_micros()).unwrap_or(i64::MAX),
        Err(before) => i64::try_from(before.duration().as_micros()).map_or(i64::MIN, |v| -v),
    }
}

/// The time `micros` microseconds after the Unix epoch (before it when negative).
pub fn from_micros(micros: i64) -> SystemTime {
    let magnitude = Duration::from_micros(micros.unsigned_abs());
    if micros >= 0 {
        SystemTime::UNIX_EPOCH + magnitude
    } else {
        SystemTime::UNIX_EPOCH - magnitude
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_at_microsecond_precision() {
        let t = SystemTime::UNIX_EPOCH + Duration::new(1_700_000_000, 123_456_789);
        assert_eq!(micros(t), 1_700_000_000_123_456);
        assert_eq!(
            from_micros(micros(t)),
            SystemTime::UNIX_EPOCH + Duration::new(1_700_000_000, 123_456_000)
        );
        let before = SystemTime::UNIX_EPOCH - Duration::from_micros(5);
        assert_eq!(micros(before), -5);
        assert_eq!(from_micros(-5), before);
    }
}
