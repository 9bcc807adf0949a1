//! The service's notion of "now", injectable so tests can move time.

use std::sync::Arc;
use std::time::SystemTime;

/// A source of the current time. Production uses [`system_clock`]; tests pass a closure
/// over a value they control, to check expiry and not-before without waiting.
pub type Clock = Arc<dyn Fn() -> SystemTime + Send + Sync>;

/// The operating system's wall clock.
pub fn system_clock() -> Clock {
    Arc::new(SystemTime::now)
}
