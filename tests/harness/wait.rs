//! Waiting for a condition that another process or task brings about: checked again
//! every few milliseconds, and a failure after the limit that names what was awaited.

use std::fmt::Debug;
use std::time::Duration;

use tokio::time::Instant;

/// How long a wait sleeps between two checks: short against the seconds a test allows,
/// long enough not to load the services it asks.
const POLL: Duration = Duration::from_millis(20);

/// Waits until `check` holds, checking again every 20 ms.
///
/// # Panics
///
/// When it does not hold within `limit`, saying that `what` was awaited.
pub async fn wait_until(what: &str, limit: Duration, mut check: impl AsyncFnMut() -> bool) {
    wait_for(what, limit, async || {
        if check().await { Ok(()) } else { Err(NotYet) }
    })
    .await;
}

/// Waits until `check` gives a value and returns it, checking again every 20 ms; while
/// it cannot, `check` returns what it saw instead.
///
/// # Panics
///
/// When no value comes within `limit`, saying that `what` was awaited and what the last
/// check saw.
pub async fn wait_for<T, S: Debug>(
    what: &str,
    limit: Duration,
    mut check: impl AsyncFnMut() -> Result<T, S>,
) -> T {
    let deadline = Instant::now() + limit;
    loop {
        match check().await {
            Ok(value) => return value,
            Err(seen) => assert!(
                Instant::now() < deadline,
                "waited {limit:?} for {what}; last seen: {seen:#?}"
            ),
        }
        tokio::time::sleep(POLL).await;
    }
}

/// What a condition that does not hold yet shows in a failure.
#[derive(Debug)]
struct NotYet;
