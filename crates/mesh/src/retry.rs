//! Retrying calls a full server refused, within a budget.
//!
//! A convene server that is full answers at once with `RESOURCE_EXHAUSTED` and a
//! `google.rpc.RetryInfo` hint, before doing any of the call's work
//! ([`convene_server::resource_exhausted`]): the load-shed layer of every server, and
//! the supervisor's `max_active_runs`. Such a call is safe to send again. The `Grpc*`
//! adapters ([`crate::handles`]) do so after the hint (with jitter, at most
//! [`MAX_RETRIES`] times), but only while their [`RetryBudget`] allows: retries may add
//! at most a fifth to the calls that got an answer over the last ten seconds (plus a
//! small floor), so a client of an overloaded server cannot multiply its load. Every
//! other failure is the caller's to handle, as before.

use std::sync::Arc;
use std::time::Duration;

use tonic::{Code, Status};
use tower::retry::Policy;
use tower::retry::budget::{Budget as _, TpsBudget};

/// Retries of one call, at most.
pub const MAX_RETRIES: u32 = 3;

/// The longest a retry waits, whatever the server's hint says.
pub const MAX_WAIT: Duration = Duration::from_secs(5);

/// How much retrying one client (one adapter, one destination) may do: tower's
/// token-bucket budget over a ten-second window.
#[derive(Debug, Clone)]
pub struct RetryBudget(Arc<TpsBudget>);

impl Default for RetryBudget {
    /// Retries up to 20% of the calls answered in the last 10 s, plus 2 per second.
    fn default() -> Self {
        Self::new(Duration::from_secs(10), 2, 0.2)
    }
}

impl RetryBudget {
    /// A budget allowing `retry_percent` (0.0–1000.0) of the calls answered within
    /// `ttl` to be retried, plus `min_per_sec` retries a second.
    pub fn new(ttl: Duration, min_per_sec: u32, retry_percent: f32) -> Self {
        Self(Arc::new(TpsBudget::new(ttl, min_per_sec, retry_percent)))
    }

    /// The retry policy of one call under this budget.
    pub(crate) fn policy(&self) -> WhenFull {
        WhenFull {
            budget: self.0.clone(),
            retries: 0,
        }
    }
}

/// When a refused call is worth sending again: the server said it was full and when to
/// try again.
pub fn retry_hint(status: &Status) -> Option<Duration> {
    if status.code() != Code::ResourceExhausted {
        return None;
    }
    convene_server::retry_after(status)
}

/// The policy of one call (see the [module docs](self)).
#[derive(Debug, Clone)]
pub(crate) struct WhenFull {
    budget: Arc<TpsBudget>,
    retries: u32,
}

/// `wait`, give or take a quarter, so refused clients do not come back in step.
fn jittered(wait: Duration) -> Duration {
    let wait = wait.min(MAX_WAIT);
    #[allow(clippy::cast_possible_truncation)] // a few seconds in ms
    let quarter = (wait.as_millis() / 4) as u64;
    #[allow(clippy::cast_possible_truncation)] // the low bits of a random id
    let spread = (uuid::Uuid::new_v4().as_u128() as u64) % (2 * quarter + 1);
    (wait + Duration::from_millis(spread)).saturating_sub(Duration::from_millis(quarter))
}

impl<Req: Clone, Res> Policy<Req, Res, Status> for WhenFull {
    type Future = tokio::time::Sleep;

    fn retry(&mut self, _req: &mut Req, result: &mut Result<Res, Status>) -> Option<Self::Future> {
        let hint = match result {
            Err(status) => retry_hint(status),
            Ok(_) => None,
        };
        let Some(hint) = hint else {
            // An answer: it earns the budget its share of retries.
            self.budget.deposit();
            return None;
        };
        if self.retries >= MAX_RETRIES || !self.budget.withdraw() {
            return None;
        }
        self.retries += 1;
        Some(tokio::time::sleep(jittered(hint)))
    }

    fn clone_request(&mut self, req: &Req) -> Option<Req> {
        Some(req.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn full() -> Status {
        convene_server::resource_exhausted("full", Duration::from_millis(1))
    }

    #[test]
    fn only_a_full_server_with_a_hint_is_retried() {
        assert_eq!(retry_hint(&full()), Some(Duration::from_millis(1)));
        assert_eq!(
            retry_hint(&Status::resource_exhausted("a run's limit")),
            None
        );
        assert_eq!(retry_hint(&Status::unavailable("gone")), None);
    }

    #[test]
    fn waits_stay_near_the_hint_and_under_the_cap() {
        for _ in 0..200 {
            let wait = jittered(Duration::from_millis(400));
            assert!(
                (Duration::from_millis(300)..=Duration::from_millis(500)).contains(&wait),
                "{wait:?}"
            );
        }
        assert!(jittered(Duration::from_secs(60)) <= MAX_WAIT + MAX_WAIT / 4);
    }

    #[tokio::test]
    async fn a_call_is_retried_a_few_times_and_no_more_than_the_budget_allows() {
        // No floor and nothing deposited: no retries at all.
        let none = RetryBudget::new(Duration::from_secs(10), 0, 0.0);
        let mut policy = none.policy();
        assert!(Policy::<(), (), Status>::retry(&mut policy, &mut (), &mut Err(full())).is_none());

        // A generous budget: at most MAX_RETRIES for one call.
        let plenty = RetryBudget::new(Duration::from_secs(10), 100, 1.0);
        let mut policy = plenty.policy();
        let mut retried = 0;
        while Policy::<(), (), Status>::retry(&mut policy, &mut (), &mut Err(full())).is_some() {
            retried += 1;
        }
        assert_eq!(retried, MAX_RETRIES);

        // Answers earn retries: 20% of ten answers is two.
        let earned = RetryBudget::new(Duration::from_secs(10), 0, 0.2);
        for _ in 0..10 {
            let mut policy = earned.policy();
            assert!(Policy::<(), (), Status>::retry(&mut policy, &mut (), &mut Ok(())).is_none());
        }
        let retries = (0..10)
            .filter(|_| {
                let mut policy = earned.policy();
                Policy::<(), (), Status>::retry(&mut policy, &mut (), &mut Err(full())).is_some()
            })
            .count();
        assert_eq!(retries, 2);
    }
}
