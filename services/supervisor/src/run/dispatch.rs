//! Dispatching: the actor starts queued delegations within their batch's limit, each
//! attempt a task of its own ([`Dispatch`]) that waits for a worker slot, sends the task
//! and reports back by message.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use convene_proto::v1;
use tokio_util::sync::CancellationToken;
use tonic::Request;
use tracing::Instrument as _;

use super::slot::SlotState;
use super::{Mailbox, Msg, RunActor, deadline_of};
use crate::error::Error;
use crate::recovery::LeaseDeadline;
use crate::registry::{Lease, Registry};
use convene_core::time::Clock;
use convene_core::time::to_timestamp;

impl RunActor {
    /// Starts queued delegations of a batch while it has free slots.
    pub(super) fn pump(&mut self, batch: usize) {
        if self.terminal() || self.budget_stopped {
            return;
        }
        while self.batches[batch].running < self.batches[batch].max_parallel {
            let Some(index) = self.batches[batch].queue.pop_front() else {
                break;
            };
            self.batches[batch].running += 1;
            self.launch(index, Duration::ZERO);
        }
    }

    /// Spawns one dispatch attempt of delegation `index` after `delay`.
    pub(super) fn launch(&mut self, index: usize, delay: Duration) {
        let slot = &mut self.slots[index];
        slot.state = SlotState::InFlight;
        slot.attempts += 1;
        let attempt = slot.attempts;
        // A retry prefers another worker; the first dispatch after a takeover prefers
        // none, so it may find the worker that still runs (or has the result of) the
        // earlier dispatch of the same id.
        let avoid = if attempt == slot.attempt_base + 1 {
            Vec::new()
        } else {
            slot.workers.clone()
        };
        let token = slot.token.clone();
        let mut task = self.run.delegations[index].task.clone().unwrap_or_default();
        // No more than the run has left: usage reported so far counts against it.
        task.budget = self.ledger.dispatch_budget(task.budget.as_ref());
        let cancel = self.cancel.child_token();
        let abandon = self.abandon.clone();
        let tx = self.tx.clone();
        let registry = self.deps.registry.clone();
        let clock = self.deps.clock.clone();
        let grace = self.deps.settings.dispatch_grace;
        let lease = self.lease.clone();
        // Every attempt runs inside the delegation's span, so the worker's spans (through
        // the trace context on the Execute call) are the delegation's children.
        let span = slot.span.clone();
        self.tasks_in_flight += 1;
        tokio::spawn(
            dispatch(Box::new(Dispatch {
                registry,
                clock,
                tx,
                index,
                delegation_id: task.delegation_id.clone(),
                task,
                token,
                attempt,
                avoid,
                cancel,
                abandon,
                delay,
                grace,
                lease,
            }))
            .instrument(span),
        );
    }
}

/// One dispatch attempt of a delegation, as its task holds it.
struct Dispatch {
    registry: Arc<Registry>,
    clock: Clock,
    tx: Mailbox,
    index: usize,
    /// The task's; the task itself is sent.
    delegation_id: String,
    task: v1::DelegationTask,
    token: String,
    attempt: u32,
    avoid: Vec<String>,
    cancel: CancellationToken,
    abandon: CancellationToken,
    delay: Duration,
    grace: Duration,
    /// The run's lease as this replica knows it: nothing is sent while it is unsure.
    lease: Option<Arc<LeaseDeadline>>,
}

impl Dispatch {
    /// Tells the run how this attempt ended.
    fn report(&self, worker_id: Option<String>, outcome: Result<v1::TaskResult, Error>) {
        let _ = self.tx.send(Msg::Outcome {
            index: self.index,
            attempt: self.attempt,
            worker_id,
            outcome: Box::new(outcome),
        });
    }
}

/// One dispatch attempt: wait for a worker slot, send the task, report the outcome. An
/// abandoned dispatch just stops: it reports nothing and leaves the worker alone.
async fn dispatch(d: Box<Dispatch>) {
    let abandon = d.abandon.clone();
    tokio::select! {
        () = attempt_dispatch(d) => {}
        () = abandon.cancelled() => {}
    }
}

// Thousands of these wait on their workers at once, so the task is kept small: the
// dispatch stays boxed, and every step but the call itself is a boxed future of its own.
async fn attempt_dispatch(mut d: Box<Dispatch>) {
    let deadline = deadline_of(&d.task, d.clock.now());
    let waited = Box::pin(wait_for_worker(
        &d.registry,
        &d.clock,
        &d.task.profile_id,
        &d.avoid,
        deadline,
        d.delay,
        &d.cancel,
    ))
    .await;
    let lease = match waited {
        Ok(lease) => lease,
        Err(e) => return d.report(None, Err(e)),
    };
    let worker_id = lease.worker_id.clone();
    let _ = d.tx.send(Msg::Dispatched {
        index: d.index,
        worker_id: worker_id.clone(),
        attempt: d.attempt,
    });
    // Last, just before the call: the lease must be sure now (a replica frozen past
    // it waits here until a renewal says it still holds the run, or stops), and the
    // worker refuses the task once the lease may have run out.
    let lease_valid_until = match &d.lease {
        Some(lease) => Some(to_timestamp(d.clock.now() + lease.sure().await)),
        None => None,
    };
    let limit = deadline.duration_since(d.clock.now()).unwrap_or_default() + d.grace;
    let call = {
        let task = std::mem::take(&mut d.task);
        let mut req = Request::new(v1::WorkerExecuteRequest {
            task: Some(task),
            task_token: std::mem::take(&mut d.token),
            attempt: d.attempt,
            lease_valid_until,
        });
        req.set_timeout(limit);
        tokio::time::timeout(limit, lease.handle.execute(req))
    };
    let answered = tokio::select! {
        r = call => Some(match r {
            Ok(Ok(resp)) => resp
                .into_inner()
                .result
                .ok_or(Error::NoResult),
            Ok(Err(status)) => Err(status.into()),
            Err(_) => Err(Error::WorkerTimeout),
        }),
        () = d.cancel.cancelled() => None,
    };
    let outcome = match answered {
        Some(outcome) => outcome,
        None => {
            Box::pin(cancel_at_worker(&lease, &d.delegation_id)).await;
            Err(Error::Cancelled)
        }
    };
    drop(lease);
    d.report(Some(worker_id), outcome);
}

/// Waits `delay`, then for a free slot at a live worker serving `profile_id` (not one
/// of `avoid` when another has room) until `deadline`; the error is the delegation's
/// outcome.
pub(super) async fn wait_for_worker(
    registry: &Arc<Registry>,
    clock: &Clock,
    profile_id: &str,
    avoid: &[String],
    deadline: SystemTime,
    delay: Duration,
    cancel: &CancellationToken,
) -> Result<Lease, Error> {
    if !delay.is_zero() {
        tokio::select! {
            () = tokio::time::sleep(delay) => {}
            () = cancel.cancelled() => return Err(Error::Cancelled),
        }
    }
    loop {
        if let Some(lease) = registry.acquire(profile_id, avoid) {
            return Ok(lease);
        }
        let wait = deadline.duration_since(clock.now()).unwrap_or_default();
        if wait.is_zero() {
            return Err(Error::NoWorker(profile_id.to_owned()));
        }
        tokio::select! {
            () = registry.changed() => {}
            () = tokio::time::sleep(Duration::from_millis(200).min(wait)) => {}
            () = cancel.cancelled() => return Err(Error::Cancelled),
        }
    }
}

/// Tells the worker holding `lease` to stop delegation `delegation_id`, waiting at most
/// two seconds for it to acknowledge.
async fn cancel_at_worker(lease: &Lease, delegation_id: &str) {
    let cancel_req = v1::WorkerCancelRequest {
        delegation_id: delegation_id.to_owned(),
        reason: "cancelled by the supervisor".to_owned(),
    };
    let _ = tokio::time::timeout(
        Duration::from_secs(2),
        lease.handle.cancel(Request::new(cancel_req)),
    )
    .await;
}
