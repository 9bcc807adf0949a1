//! Recovery, leases and replicas: every unfinished run has exactly one supervisor
//! replica working on it, and a run whose replica died is resumed by another (or by the
//! same one restarted).
//!
//! - A replica has an id (its owner id: a UUIDv7 per process, or `replica_id`). The
//!   runs it creates are leased to it for `run_lease_ttl` (`with_owner` on the store).
//! - It renews the leases of the runs its actors run every third of the lease. A run
//!   missing from the renewal's answer was taken over by another replica after the lease
//!   expired: its actor stops. (Independently, the store refuses every commit of a
//!   replica that is not the run's lease holder, so a replica that stalled past its lease
//!   can never write over the one that took the run over; and on PostgreSQL a write
//!   transaction left idle for half a second is ended by the server
//!   ([`convene_store::POSTGRES_SESSION_LIMITS`]), so the locks of a replica that
//!   stalled mid-write hold no other replica up for longer.)
//! - Nor does it do any more work for a run it lost (fencing beyond the database): its
//!   actor dispatches nothing while its [`LeaseDeadline`] has passed, each dispatch
//!   carries that deadline (a worker refuses the task after it), and each task token
//!   carries the run's lease epoch, which a claim raises: the first tokens the new
//!   owner is issued fence the older epochs at the policy service, which then refuses
//!   their tool calls and tokens, as the workers do once they learn the fence (or see
//!   a newer epoch's dispatch, which also cancels the older one's delegations there).
//! - Once at start and then every `claim_interval` it claims unfinished runs whose lease
//!   is free or expired (`FOR UPDATE SKIP LOCKED` on PostgreSQL, so two replicas never
//!   claim one run) and resumes each ([`RunActor::resume`]).
//! - A replica with a configured, stable id first gives up the leases it holds from
//!   before its restart (nothing of its own can be running at start) and so claims those
//!   runs at once instead of after their leases run out.
//! - At shutdown each actor releases its run's lease, so another replica resumes the run
//!   without waiting.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::time::MissedTickBehavior;

use crate::Deps;
use crate::run::{Msg, RunActor};

/// Runs claimed per query; the claim repeats until fewer come back.
const CLAIM_BATCH: usize = 64;

/// A replica's lease settings.
#[derive(Debug, Clone)]
pub(crate) struct Lease {
    /// The replica's id: the owner of its leases.
    pub(crate) owner: String,
    /// How long a lease lasts unless renewed.
    pub(crate) ttl: Duration,
    /// How often free and expired runs are claimed.
    pub(crate) claim_interval: Duration,
    /// Whether the id outlives the process (configured rather than generated).
    pub(crate) stable: bool,
}

/// Starts lease renewal and claiming, until the supervisor shuts down. Does nothing
/// when the store does not lease runs.
pub(crate) fn spawn(deps: Arc<Deps>) {
    let Some(lease) = deps.lease.clone() else {
        tracing::debug!("the run store leases no runs: no recovery of unfinished runs");
        return;
    };
    tracing::info!(
        replica = %lease.owner,
        lease_ttl = ?lease.ttl,
        claim_interval = ?lease.claim_interval,
        "this supervisor leases the runs it runs and resumes unfinished ones"
    );
    tokio::spawn(maintain(deps, lease));
}

async fn maintain(deps: Arc<Deps>, lease: Lease) {
    let stop = deps.shutdown_token.clone();
    if lease.stable {
        adopt(&deps, &lease).await;
    }
    let mut renew = tokio::time::interval(lease.ttl / 3);
    renew.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let mut claim = tokio::time::interval(lease.claim_interval);
    claim.set_missed_tick_behavior(MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            // Both intervals tick at once first: claiming at start is the recovery.
            _ = claim.tick() => claim_all(&deps, &lease).await,
            _ = renew.tick() => renew_all(&deps, &lease).await,
            () = stop.cancelled() => return,
        }
    }
}

/// Gives up the leases this replica's id holds from before a restart, so the next
/// claim takes those runs at once.
async fn adopt(deps: &Deps, lease: &Lease) {
    let runs = match deps.store.unfinished().await {
        Ok(runs) => runs,
        Err(error) => {
            tracing::warn!(%error, "unfinished runs cannot be read; they are claimed as their leases expire");
            return;
        }
    };
    let mut adopted = 0;
    for run in runs {
        match deps.store.release(&lease.owner, &run.run_id).await {
            Ok(true) => adopted += 1,
            Ok(false) => {}
            Err(error) => {
                tracing::warn!(run_id = %run.run_id, %error, "the run's lease cannot be taken back; it is claimed when it expires");
            }
        }
    }
    if adopted > 0 {
        tracing::info!(
            runs = adopted,
            "taking back the unfinished runs this replica ran before it restarted"
        );
    }
}

/// Claims free and expired runs and resumes each.
async fn claim_all(deps: &Arc<Deps>, lease: &Lease) {
    loop {
        let leased_at = Instant::now();
        let runs = match deps
            .store
            .claim_runs(&lease.owner, lease.ttl, CLAIM_BATCH)
            .await
        {
            Ok(runs) => runs,
            Err(error) => {
                tracing::warn!(%error, "claiming unfinished runs failed; trying again later");
                return;
            }
        };
        let claimed = runs.len();
        for run in runs {
            let run_id = run.run_id.clone();
            let (epoch, previous) = run
                .claims
                .last()
                .map(|c| (c.epoch, c.previous_replica.clone()))
                .unwrap_or_default();
            if RunActor::resume(deps.clone(), run, leased_at) {
                if previous.is_empty() {
                    tracing::info!(%run_id, replica = %lease.owner, lease_epoch = epoch, "claimed an unfinished run whose lease was free; resuming it");
                } else {
                    tracing::info!(%run_id, replica = %lease.owner, previous_replica = %previous, lease_epoch = epoch, "took over a run whose lease expired; resuming it");
                }
            } else {
                tracing::info!(%run_id, replica = %lease.owner, lease_epoch = epoch, "claimed a run this replica runs already");
            }
        }
        if claimed < CLAIM_BATCH {
            return;
        }
    }
}

/// Renews the leases of the runs this replica's actors run; stops the actors of runs
/// another replica holds now.
async fn renew_all(deps: &Deps, lease: &Lease) {
    // Before the store is asked: the leases it extends count from no earlier.
    let asked_at = Instant::now();
    let ids: Vec<String> = deps
        .live
        .lock()
        .expect("live map lock poisoned")
        .keys()
        .cloned()
        .collect();
    if ids.is_empty() {
        return;
    }
    let held: HashSet<String> = match deps.store.renew_lease(&lease.owner, &ids, lease.ttl).await {
        Ok(held) => held.into_iter().collect(),
        Err(error) => {
            tracing::warn!(%error, runs = ids.len(), "renewing run leases failed; trying again shortly");
            return;
        }
    };
    let mut lost = Vec::new();
    {
        let live = deps.live.lock().expect("live map lock poisoned");
        for id in &ids {
            let Some(run) = live.get(id) else { continue };
            if held.contains(id) {
                if let Some(deadline) = &run.lease {
                    deadline.extend(asked_at);
                }
            } else {
                let _ = run.mailbox.send(Msg::LeaseLost);
                lost.push(id);
            }
        }
    }
    // Rare (a replica that stalled past its leases): worth a read to say who has them.
    for id in lost {
        let holder = match deps.store.run_owner(id).await {
            Ok(Some((owner, _))) => owner,
            Ok(None) => "nobody now".to_owned(),
            Err(_) => "unknown".to_owned(),
        };
        tracing::info!(run_id = %id, replica = %lease.owner, new_owner = %holder, "lost the run's lease to another replica; this replica stops working on the run");
    }
}

/// How long this replica is sure it holds a run's lease, on its monotonic clock: the
/// lease's length less a margin ([`LeaseDeadline::margin`]), counted from just before
/// the store was asked to grant or extend it. Dispatches wait while it has passed (a
/// renewal moves it on; a lost lease stops the actor), and each carries its end as
/// wall time, past which the worker refuses it: so a replica that was frozen past its
/// lease sends no work when it wakes, even work it had begun to send.
#[derive(Debug)]
pub(crate) struct LeaseDeadline {
    ttl: Duration,
    until: std::sync::Mutex<Instant>,
    renewed: tokio::sync::Notify,
}

impl LeaseDeadline {
    /// A lease of `ttl` asked for at `asked_at`.
    pub(crate) fn new(asked_at: Instant, ttl: Duration) -> Self {
        Self {
            ttl,
            until: std::sync::Mutex::new(asked_at + ttl - Self::margin(ttl)),
            renewed: tokio::sync::Notify::new(),
        }
    }

    /// What is kept back from a lease of `ttl`: a quarter of it, for the drift between
    /// this replica's clock and those of the replica that would claim the run next and
    /// of the workers. Renewals come every third of the lease, so a healthy replica's
    /// deadline never comes near.
    pub(crate) fn margin(ttl: Duration) -> Duration {
        ttl / 4
    }

    /// The lease was extended by a renewal asked for at `asked_at`.
    pub(crate) fn extend(&self, asked_at: Instant) {
        let mut until = self.until.lock().expect("lease deadline lock poisoned");
        *until = (*until).max(asked_at + self.ttl - Self::margin(self.ttl));
        drop(until);
        self.renewed.notify_waiters();
    }

    /// How much of the lease is left for sure now; None once the deadline passed.
    pub(crate) fn remaining(&self) -> Option<Duration> {
        let until = *self.until.lock().expect("lease deadline lock poisoned");
        until
            .checked_duration_since(Instant::now())
            .filter(|d| !d.is_zero())
    }

    /// Waits until the lease is sure again (at once while it is); returns what is left.
    pub(crate) async fn sure(&self) -> Duration {
        loop {
            let renewed = self.renewed.notified();
            if let Some(left) = self.remaining() {
                return left;
            }
            // A renewal wakes the wait; the timeout only bounds a missed one.
            let _ = tokio::time::timeout(self.ttl / 10, renewed).await;
        }
    }
}
