//! Expiry as a state change: the sweep that records pending requests past their expiry
//! as expired, each with its `expired` event, and the task that runs it.
//!
//! Reads never wait for the sweep: a pending request past its expiry already reads as
//! expired ([`ApprovalRequest::state_at`](crate::model::ApprovalRequest::state_at)).
//! The sweep writes that down, so the state column and the event stream say it too.

use std::{
    sync::{Arc, atomic::Ordering},
    time::SystemTime,
};

use tokio::task::JoinHandle;

use super::ApprovalService;
use crate::{
    error::ApprovalError,
    events::Event,
    model::State,
    store::{StoreError, Versioned},
};

/// Requests one sweep reads at a time.
const SWEEP_BATCH: usize = 256;

impl ApprovalService {
    /// Records every pending request whose expiry is reached (on the service clock) as
    /// expired, each with a compare-and-set and its `expired` event; returns how many it
    /// recorded. A request that changed meanwhile is left to its new state (or to the
    /// next sweep), so two sweeps, or a sweep and a vote, never both record one expiry.
    ///
    /// The service runs this every `expiry_sweep_interval` once
    /// [`spawn_expiry_sweep`](Self::spawn_expiry_sweep) started it; tests call it
    /// directly.
    ///
    /// # Errors
    ///
    /// The store failed; requests recorded before the failure stay recorded.
    pub async fn sweep_expired(&self) -> Result<usize, ApprovalError> {
        let now = self.clock.now();
        let mut recorded = 0;
        loop {
            let due = self.store.pending_expired(now, SWEEP_BATCH).await?;
            let full = due.len() == SWEEP_BATCH;
            let mut progressed = false;
            for stored in due {
                if self.record_expiry(stored, now).await? {
                    recorded += 1;
                    progressed = true;
                }
            }
            // A full batch of which nothing could be recorded was all changed by others
            // meanwhile: the next sweep reads the rest.
            if !full || !progressed {
                return Ok(recorded);
            }
        }
    }

    /// Starts the task that calls [`sweep_expired`](Self::sweep_expired) every
    /// `expiry_sweep_interval`, unless it runs already; [`add_to_server`](crate::add_to_server)
    /// starts it, so the standalone service and `convene up` both sweep. The task holds
    /// the service weakly: it ends once the service is dropped, or when the service's
    /// shutdown signal ([`with_shutdown`](Self::with_shutdown)) triggers.
    ///
    /// # Panics
    ///
    /// Outside a Tokio runtime.
    pub fn spawn_expiry_sweep(self: &Arc<Self>) -> Option<JoinHandle<()>> {
        if self.sweeping.swap(true, Ordering::SeqCst) {
            return None;
        }
        let service = Arc::downgrade(self);
        let interval = self.expiry_sweep_interval;
        let shutdown = self.shutdown.clone();
        Some(tokio::spawn(async move {
            let mut failing = false;
            loop {
                let pause = tokio::time::sleep(interval);
                match &shutdown {
                    Some(shutdown) => tokio::select! {
                        () = pause => {}
                        () = shutdown.wait() => return,
                    },
                    None => pause.await,
                }
                let Some(service) = service.upgrade() else {
                    return;
                };
                match service.sweep_expired().await {
                    Ok(_) if failing => {
                        failing = false;
                        tracing::info!("the approval expiry sweep recovered");
                    }
                    Ok(_) => {}
                    Err(error) if !failing => {
                        failing = true;
                        tracing::warn!(%error, "the approval expiry sweep failed; it tries again every interval");
                    }
                    Err(_) => {}
                }
            }
        }))
    }

    /// Writes down that a pending request expired, if it is still pending and past its
    /// expiry at `now`. Best effort: readers already see it as expired, so losing a race
    /// here changes nothing.
    pub(super) async fn persist_expiry(&self, stored: Versioned, now: SystemTime) {
        let approval_id = stored.request.approval_id.clone();
        if let Err(error) = self.record_expiry(stored, now).await {
            tracing::warn!(%approval_id, %error, "cannot record the expiry of an approval request");
        }
    }

    /// Records `stored` as expired with its event; `false` when it is not pending past
    /// its expiry or changed since it was read.
    async fn record_expiry(&self, stored: Versioned, now: SystemTime) -> Result<bool, StoreError> {
        if stored.request.state != State::Pending || !stored.request.is_past_expiry(now) {
            return Ok(false);
        }
        let mut expired = stored.request;
        expired.state = State::Expired;
        let event = Event::expired(&expired, now);
        let approval_id = expired.approval_id.clone();
        match self
            .store
            .update(stored.version, expired, Some(event))
            .await
        {
            Ok(_) => {
                tracing::info!(%approval_id, "approval request expired");
                Ok(true)
            }
            Err(StoreError::Conflict { .. }) => Ok(false),
            Err(e) => Err(e),
        }
    }
}
