//! Sign-in attempts, counted per client address and in total: an address gets
//! [`MAX_FAILURES`] attempts per [`WINDOW`], and all addresses together
//! [`MAX_TOTAL_FAILURES`]; beyond either, sign-ins wait until the window has passed.
//!
//! An attempt is counted as it is let through, in the same step as the check and under
//! one lock ([`Throttle::attempt`]), so attempts sent at once cannot slip past the
//! limit between a check and a count. Only a successful sign-in of a principal that may
//! view the console takes its address's count back ([`Throttle::succeeded`]).
//!
//! Kept in memory by each replica (a bounded map), so a guesser spread over replicas
//! gets the attempts of each replica per window.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Failed sign-ins an address gets per window.
pub const MAX_FAILURES: u32 = 5;
/// Failed sign-ins all addresses together get per window: a bound on guesses spread
/// over many addresses.
pub const MAX_TOTAL_FAILURES: u32 = 1_000;
/// The window failures are counted in.
pub const WINDOW: Duration = Duration::from_secs(300);
/// Addresses tracked at most; the oldest windows go first beyond it.
const MAX_TRACKED: usize = 10_000;

/// A window's start and the attempts counted in it.
#[derive(Debug, Clone, Copy)]
struct Count {
    since: Instant,
    count: u32,
}

impl Count {
    fn new(now: Instant) -> Self {
        Self {
            since: now,
            count: 0,
        }
    }

    /// Starts a new window when this one has passed, or has counted nothing yet.
    fn roll(&mut self, now: Instant) {
        if self.count == 0 || self.since + WINDOW <= now {
            *self = Self::new(now);
        }
    }

    /// How long until the window ends, when `max` attempts are counted in it.
    fn wait(&self, max: u32, now: Instant) -> Option<Duration> {
        let ends = self.since + WINDOW;
        (self.count >= max && ends > now).then(|| ends - now)
    }
}

#[derive(Debug)]
struct Counts {
    total: Count,
    by_addr: HashMap<IpAddr, Count>,
}

/// The sign-in attempts of each address, and of all, in their current windows.
#[derive(Debug)]
pub struct Throttle {
    counts: Mutex<Counts>,
}

impl Default for Throttle {
    fn default() -> Self {
        Self {
            counts: Mutex::new(Counts {
                total: Count::new(Instant::now()),
                by_addr: HashMap::new(),
            }),
        }
    }
}

impl Throttle {
    /// Lets a sign-in attempt of `addr` through and counts it as failed until
    /// [`succeeded`](Self::succeeded) says otherwise; or, when the address or all
    /// addresses have used their attempts, how long until they may try again (nothing
    /// counted).
    ///
    /// # Errors
    ///
    /// The time to wait, when the attempt may not go through.
    pub fn attempt(&self, addr: IpAddr, now: Instant) -> Result<(), Duration> {
        let mut counts = self.counts.lock().expect("lock poisoned");
        let Counts { total, by_addr } = &mut *counts;
        total.roll(now);
        if let Some(entry) = by_addr.get_mut(&addr) {
            entry.roll(now);
            if let Some(wait) = entry.wait(MAX_FAILURES, now) {
                return Err(wait);
            }
        }
        if let Some(wait) = total.wait(MAX_TOTAL_FAILURES, now) {
            return Err(wait);
        }
        if !by_addr.contains_key(&addr) && by_addr.len() >= MAX_TRACKED {
            by_addr.retain(|_, c| c.since + WINDOW > now);
            if by_addr.len() >= MAX_TRACKED
                && let Some(oldest) = by_addr.iter().min_by_key(|(_, c)| c.since).map(|(a, _)| *a)
            {
                by_addr.remove(&oldest);
            }
        }
        by_addr.entry(addr).or_insert_with(|| Count::new(now)).count += 1;
        total.count += 1;
        Ok(())
    }

    /// A sign-in of `addr` let through by [`attempt`](Self::attempt) succeeded: its
    /// address's count starts again, and the attempt no longer counts in the total.
    pub fn succeeded(&self, addr: IpAddr) {
        let mut counts = self.counts.lock().expect("lock poisoned");
        counts.by_addr.remove(&addr);
        counts.total.count = counts.total.count.saturating_sub(1);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    #[test]
    fn an_address_waits_after_too_many_attempts_and_others_do_not() {
        let throttle = Throttle::default();
        let (a, b): (IpAddr, IpAddr) = ("10.0.0.1".parse().unwrap(), "10.0.0.2".parse().unwrap());
        let t0 = Instant::now();
        for _ in 0..MAX_FAILURES {
            assert_eq!(throttle.attempt(a, t0), Ok(()));
        }
        assert_eq!(throttle.attempt(a, t0), Err(WINDOW));
        assert_eq!(
            throttle.attempt(a, t0 + Duration::from_secs(1)),
            Err(WINDOW - Duration::from_secs(1)),
            "a refused attempt does not extend the window"
        );
        assert_eq!(throttle.attempt(b, t0), Ok(()));
        let later = t0 + WINDOW;
        assert_eq!(throttle.attempt(a, later), Ok(()), "the window has passed");
        for _ in 1..MAX_FAILURES {
            assert_eq!(
                throttle.attempt(a, later),
                Ok(()),
                "a new window counts from one"
            );
        }
        assert!(throttle.attempt(a, later).is_err());
    }

    #[test]
    fn only_a_success_takes_the_count_back() {
        let throttle = Throttle::default();
        let a: IpAddr = "10.0.0.1".parse().unwrap();
        let t0 = Instant::now();
        for _ in 0..MAX_FAILURES - 1 {
            throttle.attempt(a, t0).unwrap();
        }
        // The last attempt succeeds: the address has all of its attempts again.
        throttle.attempt(a, t0).unwrap();
        throttle.succeeded(a);
        for _ in 0..MAX_FAILURES {
            assert_eq!(throttle.attempt(a, t0), Ok(()));
        }
        assert!(throttle.attempt(a, t0).is_err());
    }

    #[test]
    fn all_addresses_together_wait_after_the_total() {
        let throttle = Throttle::default();
        let t0 = Instant::now();
        let addr = |i: u32| IpAddr::from(std::net::Ipv4Addr::from(0x0a00_0000 + i));
        for i in 0..MAX_TOTAL_FAILURES {
            assert_eq!(throttle.attempt(addr(i), t0), Ok(()), "address {i}");
        }
        assert_eq!(
            throttle.attempt(addr(MAX_TOTAL_FAILURES), t0),
            Err(WINDOW),
            "a fresh address waits once the total is spent"
        );
        assert_eq!(throttle.attempt(addr(0), t0 + WINDOW), Ok(()));
    }

    #[test]
    fn attempts_sent_at_once_are_counted_one_by_one() {
        let throttle = Arc::new(Throttle::default());
        let a: IpAddr = "10.0.0.1".parse().unwrap();
        let now = Instant::now();
        let barrier = Arc::new(std::sync::Barrier::new(20));
        let through: u32 = (0..20)
            .map(|_| {
                let (throttle, barrier) = (throttle.clone(), barrier.clone());
                std::thread::spawn(move || {
                    barrier.wait();
                    u32::from(throttle.attempt(a, now).is_ok())
                })
            })
            .collect::<Vec<_>>()
            .into_iter()
            .map(|t| t.join().unwrap())
            .sum();
        assert_eq!(through, MAX_FAILURES);
    }
}
