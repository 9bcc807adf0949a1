//! How many runs this replica runs at once.
//!
//! Every run with an actor holds an [`Admitted`] for as long as the actor lives: a run
//! that waits for people holds none (it has no actor), and a resumed run takes one
//! without asking, since it was accepted before. A `StartRun` past `max_active_runs` is
//! refused at once with `RESOURCE_EXHAUSTED` and a retry hint, before anything of it is
//! stored, so nothing of a refused run is left behind and its retry (with the same
//! idempotency key) starts it whole.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use crate::error::Error;

/// How long a refused caller is told to wait before trying again.
pub(crate) const RETRY_AFTER: Duration = Duration::from_secs(1);

/// The count of runs with an actor, against its limit.
#[derive(Debug)]
pub(crate) struct Admission {
    active: AtomicUsize,
    max: usize,
}

/// One run's place; dropping it gives the place back.
#[derive(Debug)]
pub(crate) struct Admitted(Arc<Admission>);

impl Drop for Admitted {
    fn drop(&mut self) {
        self.0.active.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Admission {
    pub(crate) fn new(max: usize) -> Arc<Self> {
        Arc::new(Self {
            active: AtomicUsize::new(0),
            max,
        })
    }

    /// A place for a new run, or the refusal to answer its `StartRun` with.
    pub(crate) fn admit(self: &Arc<Self>) -> Result<Admitted, Error> {
        self.active
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < self.max).then_some(n + 1)
            })
            .map_err(|_| Error::Overloaded {
                message: format!(
                    "this supervisor runs {} runs at once (max_active_runs) and has no room for another; \
                     retry in {}s, or raise max_active_runs",
                    self.max,
                    RETRY_AFTER.as_secs()
                ),
                retry_after: RETRY_AFTER,
            })?;
        Ok(Admitted(self.clone()))
    }

    /// A place for a run accepted before (resumed after a restart or a failover), taken
    /// even past the limit: refusing it would strand a run a caller was told started.
    pub(crate) fn readmit(self: &Arc<Self>) -> Admitted {
        self.active.fetch_add(1, Ordering::AcqRel);
        Admitted(self.clone())
    }

    /// Runs holding a place now.
    #[cfg(test)]
    pub(crate) fn active(&self) -> usize {
        self.active.load(Ordering::Acquire)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn places_are_given_back_and_resumed_runs_always_get_one() {
        let admission = Admission::new(2);
        let a = admission.admit().expect("first");
        let b = admission.admit().expect("second");
        let refused = admission.admit().expect_err("third");
        assert!(
            matches!(refused, Error::Overloaded { retry_after, .. } if retry_after == RETRY_AFTER)
        );
        assert!(refused.to_string().contains("max_active_runs"), "{refused}");
        let resumed = admission.readmit();
        assert_eq!(admission.active(), 3);
        drop((a, resumed));
        assert_eq!(admission.active(), 1);
        let c = admission.admit().expect("a place was given back");
        drop((b, c));
        assert_eq!(admission.active(), 0);
    }

    #[test]
    fn racing_starts_never_take_more_places_than_there_are() {
        let admission = Admission::new(8);
        let admitted: Vec<_> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..32)
                .map(|_| s.spawn(|| admission.admit().ok()))
                .collect();
            handles
                .into_iter()
                .filter_map(|h| h.join().unwrap())
                .collect()
        });
        assert_eq!(admitted.len(), 8);
        assert_eq!(admission.active(), 8);
    }
}
