//! The service's notion of "now", injectable so expiry can be tested without waiting.

use std::{
    fmt::Debug,
    sync::{Arc, Mutex},
    time::{Duration, SystemTime},
};

/// A source of the current time.
pub trait Clock: Debug + Send + Sync {
    /// The current time.
    fn now(&self) -> SystemTime;
}

/// The system's wall clock.
#[derive(Clone, Copy, Debug, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> SystemTime {
        SystemTime::now()
    }
}

/// A clock that stands still until moved. Clones share one time, so a test keeps a clone
/// and moves the service's clock from outside.
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

    /// Moves the clock forward by `by`.
    pub fn advance(&self, by: Duration) {
        let mut now = self.now.lock().unwrap_or_else(|e| e.into_inner());
        *now += by;
    }

    /// Sets the clock to `to`.
    pub fn set(&self, to: SystemTime) {
        *self.now.lock().unwrap_or_else(|e| e.into_inner()) = to;
    }
}

impl Clock for ManualClock {
    fn now(&self) -> SystemTime {
        *self.now.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn manual_clock_moves_only_when_told_and_clones_share_it() {
        let start = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000);
        let clock = ManualClock::new(start);
        let shared = clock.clone();
        assert_eq!(clock.now(), start);
        shared.advance(Duration::from_secs(5));
        assert_eq!(clock.now(), start + Duration::from_secs(5));
        shared.set(start);
        assert_eq!(clock.now(), start);
    }
}
