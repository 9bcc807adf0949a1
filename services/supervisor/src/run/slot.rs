//! What the run actor keeps of each delegation besides the ledger entry (its slot and
//! the slot's state), and the batches whose parallelism limit slots are started under.

use std::collections::VecDeque;

use tracing::Span;

/// Where a delegation is in this actor's hands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum SlotState {
    /// Not dispatched (yet): queued in its batch, or waiting for the tokens it is
    /// queued with.
    Waiting,
    /// A nested child without a result, found unfinished when the run was resumed: it
    /// waits until its parent's repeated Delegate call addresses it again.
    Dormant,
    /// A dispatch attempt runs, or a retry of it waits for its backoff.
    InFlight,
    /// Its dispatches are over for good, or it never starts (dropped, settled when the
    /// run was resumed, not started once the budget ran out).
    Done,
}

pub(super) struct Slot {
    pub(super) token: String,
    /// A delegation of the run's plan (its result goes to the join), not a nested child.
    pub(super) top_level: bool,
    pub(super) batch: usize,
    pub(super) state: SlotState,
    pub(super) attempts: u32,
    /// Dispatches made before this actor took the run over (0 for a new run): retry
    /// limits count this actor's attempts only.
    pub(super) attempt_base: u32,
    pub(super) workers: Vec<String>,
    /// Children this delegation asked for in its current attempt, dropped ones included:
    /// the next Delegate call's first call index.
    pub(super) children: u32,
    /// The attempt `children` counts for. A retried delegation repeats its Delegate
    /// calls, so its call indices start again at 0 and address the children the earlier
    /// attempt created.
    pub(super) children_attempt: u32,
    /// The run ended and told its dispatches to stop. Whatever the state: a dispatch
    /// cancelled this way is not retried, and its outcome, reported once its slot is
    /// done, marks the delegation cancelled.
    pub(super) cancelled: bool,
    /// The delegation's span, open from planning to its final outcome; every dispatch
    /// attempt runs inside it. `Span::none()` once ended.
    pub(super) span: Span,
}

impl Slot {
    /// A slot in `state` that no attempt of this actor has dispatched yet.
    pub(super) fn new(top_level: bool, batch: usize, state: SlotState, span: Span) -> Self {
        Self {
            token: String::new(),
            top_level,
            batch,
            state,
            attempts: 0,
            attempt_base: 0,
            workers: Vec::new(),
            children: 0,
            children_attempt: 0,
            cancelled: false,
            span,
        }
    }

    pub(super) fn in_flight(&self) -> bool {
        self.state == SlotState::InFlight
    }

    pub(super) fn dormant(&self) -> bool {
        self.state == SlotState::Dormant
    }
}

pub(super) struct Batch {
    pub(super) max_parallel: usize,
    pub(super) queue: VecDeque<usize>,
    pub(super) running: usize,
}

impl Batch {
    pub(super) fn new(max_parallel: usize) -> Self {
        Self {
            max_parallel,
            queue: VecDeque::new(),
            running: 0,
        }
    }
}
