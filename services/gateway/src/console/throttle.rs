//! Failed sign-ins, counted per client address: after [`MAX_FAILURES`] within
//! [`WINDOW`], that address may not try again until the window has passed. Kept in
//! memory by each replica (a bounded map), so a guesser spread over replicas gets
//! [`MAX_FAILURES`] tries per replica and window.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Failed sign-ins an address gets per window.
pub const MAX_FAILURES: u32 = 5;
/// The window failures are counted in.
pub const WINDOW: Duration = Duration::from_secs(300);
/// Addresses tracked at most; the oldest windows go first beyond it.
const MAX_TRACKED: usize = 10_000;

/// The failures of each address in its current window.
#[derive(Debug, Default)]
pub struct Throttle {
    failures: Mutex<HashMap<IpAddr, (Instant, u32)>>,
}

impl Throttle {
    /// How long `addr` must wait before trying again, if it must.
    pub fn wait(&self, addr: IpAddr, now: Instant) -> Option<Duration> {
        let failures = self.failures.lock().expect("lock poisoned");
        let (since, count) = failures.get(&addr)?;
        let ends = *since + WINDOW;
        (*count >= MAX_FAILURES && ends > now).then(|| ends - now)
    }

    /// Counts a failed sign-in of `addr`.
    pub fn failed(&self, addr: IpAddr, now: Instant) {
        let mut failures = self.failures.lock().expect("lock poisoned");
        if failures.len() >= MAX_TRACKED {
            failures.retain(|_, (since, _)| *since + WINDOW > now);
        }
        if failures.len() >= MAX_TRACKED
            && let Some(oldest) = failures
                .iter()
                .min_by_key(|(_, (since, _))| *since)
                .map(|(a, _)| *a)
        {
            failures.remove(&oldest);
        }
        let entry = failures.entry(addr).or_insert((now, 0));
        if entry.0 + WINDOW <= now {
            *entry = (now, 0);
        }
        entry.1 += 1;
    }

    /// Forgets `addr`'s failures (a successful sign-in).
    pub fn succeeded(&self, addr: IpAddr) {
        self.failures.lock().expect("lock poisoned").remove(&addr);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_address_waits_after_too_many_failures_and_others_do_not() {
        let throttle = Throttle::default();
        let (a, b): (IpAddr, IpAddr) = ("10.0.0.1".parse().unwrap(), "10.0.0.2".parse().unwrap());
        let t0 = Instant::now();
        for _ in 0..MAX_FAILURES {
            assert_eq!(throttle.wait(a, t0), None);
            throttle.failed(a, t0);
        }
        assert_eq!(throttle.wait(a, t0), Some(WINDOW));
        assert_eq!(throttle.wait(b, t0), None);
        let later = t0 + WINDOW;
        assert_eq!(throttle.wait(a, later), None, "the window has passed");
        throttle.failed(a, later);
        assert_eq!(
            throttle.wait(a, later),
            None,
            "a new window counts from one"
        );
        throttle.succeeded(a);
        assert_eq!(throttle.wait(a, later), None);
    }
}
