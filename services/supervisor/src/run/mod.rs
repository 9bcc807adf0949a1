//! The run actor: the single writer of one run.
//!
//! Every change to a run — a dispatch, a result, a decision, a cancellation, a nested
//! delegation — arrives as a message to the run's one task, which applies it to its copy
//! of the run and commits the new version with the events it produced; dispatch reports
//! and results already waiting in the mailbox are applied with the one at hand and
//! committed with it, so a run's parallel results and the join's decision on them are
//! usually one version. Dispatches run
//! as their own tasks and report back by message, so one slow worker never holds up the
//! rest, and a worker's failure only ever touches its own delegation.
//!
//! An actor starts for a new run ([`RunActor::spawn`]) or for a stored, unfinished one
//! that this replica claimed after a restart or from a replica that died
//! ([`RunActor::resume`]). A resumed actor rebuilds its state from what was committed:
//! delegations with a result stay done, the others are dispatched again under their
//! existing ids, the results the join received are verified again, and the join is
//! applied at once. The actor stops without another write when the supervisor shuts
//! down (its lease is released, so the run resumes at once elsewhere) or when another
//! replica took the run over (its commit is refused).
//!
//! The actor's code is split by concern: this module holds its messages, its start
//! (spawn, resume) and its loop; [`start`] begins a new or resumed run, [`dispatch`]
//! launches dispatch attempts, [`outcome`] records what they report, [`staging`] holds
//! the progress waiting for the next commit, [`verify`] asks the evidence store about
//! cited evidence, [`decide`] runs the join and ends the run ([`approvals`] files its
//! approval requests), [`nested`] handles a worker's Delegate calls, [`planner`] runs a
//! planner's rounds, and [`propose`] holds the checks every proposed delegation passes,
//! a planner's or a worker's.

mod approvals;
mod decide;
mod dispatch;
mod nested;
mod outcome;
mod planner;
mod propose;
mod slot;
mod staging;
mod start;
mod verify;
mod waiting;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use convene_core::join::EvidenceFact;
use convene_core::limits::BudgetLedger;
use convene_core::model::{Overflow, RunSpec};
use convene_core::time::{Clock, from_timestamp, to_timestamp};
use convene_core::validate;
use convene_proto::v1::{self, run_event::Kind};
use convene_tokens::Claims;
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;
use tonic::Code;
use tracing::{Instrument as _, Span};

use crate::admission::Admitted;
use crate::error::Error;
use crate::recovery::LeaseDeadline;
use crate::store::{Events, StoreError};
use crate::{Deps, Settings, trace};

use self::nested::PendingDelegate;
use self::slot::{Batch, Slot};
use self::staging::Staging;

pub(crate) use self::start::{issue_tokens, next_sequence, startable};

/// A message to a run actor.
///
/// Kept small (large payloads boxed): a mailbox allocates room for 32 messages up front,
/// and every run in flight has one.
pub(crate) enum Msg {
    /// A dispatch task reached a worker.
    Dispatched {
        index: usize,
        worker_id: String,
        attempt: u32,
    },
    /// A dispatch attempt ended.
    Outcome {
        index: usize,
        attempt: u32,
        worker_id: Option<String>,
        outcome: Box<Result<v1::TaskResult, Error>>,
    },
    /// Commands for the run are stored: apply them (see [`waiting`]).
    Commands,
    /// A worker asks for child delegations under its own token.
    Delegate(Box<DelegateAsk>),
    /// A result delivered out of band (e.g. a redelivery); it goes through the same
    /// checks as any other.
    Deliver { result: Box<v1::TaskResult> },
    /// Lease renewal found the run held by another replica: stop touching it.
    LeaseLost,
    /// A planner turn request ended (see [`planner`]).
    PlannerTurn {
        turn: u32,
        attempt: u32,
        outcome: Box<Result<v1::PlanTurnResponse, Error>>,
    },
}

const _: () = assert!(
    std::mem::size_of::<Msg>() <= 64,
    "box the payload of the variant that grew"
);

/// A worker's request for child delegations under its own token.
pub(crate) struct DelegateAsk {
    pub(crate) claims: Arc<Claims>,
    pub(crate) token: String,
    pub(crate) children: Vec<v1::PlannedDelegation>,
    pub(crate) reply: oneshot::Sender<Result<Vec<v1::DelegateOutcome>, Error>>,
    /// The span of the Delegate call (the asking tool call's, through propagation): the
    /// children's delegation spans are its children.
    pub(crate) span: Span,
}

/// The sending side of a run actor's mailbox.
pub(crate) type Mailbox = mpsc::UnboundedSender<Msg>;

/// A run with an actor in this process: its mailbox, and how long this replica is sure
/// it holds the run's lease (None: the store leases no runs).
#[derive(Debug, Clone)]
pub(crate) struct Live {
    pub(crate) mailbox: Mailbox,
    pub(crate) lease: Option<Arc<LeaseDeadline>>,
}

pub(crate) struct RunActor {
    deps: Arc<Deps>,
    /// The run's place among the replica's active runs, given back as the actor ends.
    _admitted: Admitted,
    /// The run as last committed, plus the change being made. `run.received` is the
    /// join's input: every result received. Shared with the store's note of the commit
    /// that ends the run (changed in place while nothing else holds it).
    run: Arc<v1::Run>,
    /// Whether the run was stored before this actor started (a restart, a takeover).
    resumed: bool,
    /// The run's root span (see [`trace`]); the parent of its delegation, plan and join
    /// spans.
    span: Span,
    spec: RunSpec,
    slots: Vec<Slot>,
    batches: Vec<Batch>,
    facts: BTreeMap<String, EvidenceFact>,
    ledger: BudgetLedger,
    budget_stopped: bool,
    next_seq: u64,
    pending: Vec<PendingDelegate>,
    tx: Mailbox,
    rx: mpsc::UnboundedReceiver<Msg>,
    /// Progress taken from the mailbox and not committed yet, and what the join has
    /// and has not seen of it.
    staging: Staging,
    /// The new run's task tokens (or why they were refused), asked for by StartRun
    /// while it stored the run; taken when the actor begins.
    issued: Option<Result<Vec<String>, Error>>,
    /// Cancels the run's dispatches, telling their workers to stop (deadline, cancel,
    /// decision).
    cancel: CancellationToken,
    /// Abandons the run's dispatches without telling their workers anything: when this
    /// actor stops touching the run (shutdown, takeover), whoever resumes it dispatches
    /// the same delegation ids again and joins what the workers still run.
    abandon: CancellationToken,
    tasks_in_flight: usize,
    join_timer: Option<SystemTime>,
    /// The planner's runtime state (a run with a planner only).
    planner: Option<Box<planner::PlannerRt>>,
    /// People's settlements of conflicts, by topic (from `run.human_decisions`): the
    /// join's input.
    settlements: BTreeMap<String, v1::ConflictSettlement>,
    /// Whether the run's current ticket was used by an input: its next wait gets a new
    /// one.
    ticket_used: bool,
    /// Whether the run's lease was given up with its last commit (it waits).
    lease_released: bool,
    /// Until when this replica is sure it holds the run's lease; nothing is dispatched
    /// past it (None: the store leases no runs).
    lease: Option<Arc<LeaseDeadline>>,
}

/// Why an actor stopped.
enum Exit {
    /// The run is terminal and nothing of it is in flight.
    Done,
    /// The supervisor shuts down; the run resumes at the next start (or elsewhere).
    Shutdown,
    /// Another replica holds the run now.
    Lost(String),
    /// A commit failed; the run resumes once its lease lapses.
    Failed(StoreError),
}

impl From<StoreError> for Exit {
    fn from(e: StoreError) -> Self {
        match e {
            StoreError::Conflict { .. } | StoreError::LeaseLost { .. } => Exit::Lost(e.to_string()),
            e => Exit::Failed(e),
        }
    }
}

fn backoff(settings: &Settings, attempt: u32) -> Duration {
    let base = settings.retry_backoff.as_millis() as u64;
    let exp = base.saturating_mul(1 << attempt.min(8).saturating_sub(1));
    let capped = exp
        .min(settings.max_retry_backoff.as_millis() as u64)
        .max(1);
    // Jitter in [50%, 100%] of the capped backoff, so retries of many runs spread out.
    let jitter = u64::from(uuid::Uuid::new_v4().as_u128() as u32) % (capped / 2 + 1);
    Duration::from_millis(capped / 2 + jitter)
}

/// A delegation's task, or an empty one (every delegation the supervisor plans has one).
fn task_or_empty(task: &Option<v1::DelegationTask>) -> &v1::DelegationTask {
    static EMPTY: std::sync::OnceLock<v1::DelegationTask> = std::sync::OnceLock::new();
    task.as_ref()
        .unwrap_or_else(|| EMPTY.get_or_init(v1::DelegationTask::default))
}

/// A task's deadline; `now` for one without a readable deadline (every task the
/// supervisor plans has one), so it counts as due.
fn deadline_of(task: &v1::DelegationTask, now: SystemTime) -> SystemTime {
    task.deadline
        .as_ref()
        .and_then(|t| from_timestamp(t, "deadline").ok())
        .unwrap_or(now)
}

fn status_is_transient(code: Code) -> bool {
    matches!(
        code,
        Code::Unavailable
            | Code::Unknown
            | Code::Internal
            | Code::ResourceExhausted
            | Code::Aborted
    )
}

async fn sleep_until(clock: &Clock, t: Option<SystemTime>) {
    match t {
        None => std::future::pending::<()>().await,
        Some(t) => {
            let d = t.duration_since(clock.now()).unwrap_or_default();
            tokio::time::sleep(d).await;
        }
    }
}

/// Overflow as recorded for TRUNCATE at the top level (used by the service).
pub(crate) fn truncated_detail(limit: u32, overflow: Overflow) -> String {
    format!(
        "dropped: the plan is wider than max_parallel_workers ({limit}) and overflow is {overflow:?}"
    )
}

impl RunActor {
    /// Spawns the actor for a freshly created run (version 1, delegations planned) and
    /// returns its mailbox. `span` is the run's root span; `None` continues the trace
    /// stored on the run (`trace_parent`), as for a run picked up again after a restart.
    /// `issued` are the tokens for its [`startable`] delegations, when asked for already
    /// ([`issue_tokens`]); `None`: the actor asks. `leased_at` is when the store was
    /// asked to create the run (its lease counts from no earlier).
    pub(crate) fn spawn(
        deps: Arc<Deps>,
        run: v1::Run,
        spec: RunSpec,
        span: Option<Span>,
        issued: Option<Result<Vec<String>, Error>>,
        (admitted, leased_at): (Admitted, Instant),
    ) -> Mailbox {
        let (mailbox, actor) = Self::new(deps, run, spec, span, (false, admitted, leased_at));
        match actor {
            Some(mut actor) => {
                actor.issued = issued;
                actor.start();
            }
            None => tracing::warn!("a new run's actor exists already"),
        }
        mailbox
    }

    /// Resumes a stored, unfinished run this replica claimed (asking at `leased_at`),
    /// continuing its trace. Returns false when the run has an actor in this process
    /// already (nothing to resume) or cannot be resumed (then it is failed, with the
    /// reason).
    pub(crate) fn resume(deps: Arc<Deps>, run: v1::Run, leased_at: Instant) -> bool {
        let Some(wire) = run.spec.clone() else {
            tokio::spawn(start::fail_stored(
                deps,
                run,
                "the stored run has no spec".to_owned(),
            ));
            return false;
        };
        // The spec's relative deadlines count from the run's acceptance, exactly as they
        // did when it was accepted.
        let accepted = run
            .created_at
            .as_ref()
            .and_then(|t| from_timestamp(t, "created_at").ok())
            .unwrap_or_else(|| deps.clock.now());
        let spec = match validate::run_spec(&wire, accepted) {
            Ok(spec) => spec,
            Err(e) => {
                let reason = format!(
                    "the stored spec no longer validates: {}: {}",
                    e.field, e.message
                );
                tokio::spawn(start::fail_stored(deps, run, reason));
                return false;
            }
        };
        let admitted = deps.admission.readmit();
        let (_, actor) = Self::new(deps, run, spec, None, (true, admitted, leased_at));
        match actor {
            Some(actor) => {
                actor.start();
                true
            }
            None => false,
        }
    }

    /// Builds an actor and enters it in the live map; `None` (and the live actor's
    /// mailbox) when the run has one already.
    fn new(
        deps: Arc<Deps>,
        run: v1::Run,
        spec: RunSpec,
        span: Option<Span>,
        (resumed, admitted, leased_at): (bool, Admitted, Instant),
    ) -> (Mailbox, Option<Self>) {
        let mut live = deps.live.lock().expect("live map lock poisoned");
        if let Some(existing) = live.get(&run.run_id) {
            return (existing.mailbox.clone(), None);
        }
        let span = span.unwrap_or_else(|| trace::resumed_run_span(&run));
        let (tx, rx) = mpsc::unbounded_channel();
        let ledger = BudgetLedger::new(&spec.limits);
        let max_parallel = spec.limits.max_parallel_workers as usize;
        let lease = deps
            .lease
            .as_ref()
            .map(|l| Arc::new(LeaseDeadline::new(leased_at, l.ttl)));
        live.insert(
            run.run_id.clone(),
            Live {
                mailbox: tx.clone(),
                lease: lease.clone(),
            },
        );
        drop(live);
        let settlements = run
            .human_decisions
            .iter()
            .filter(|h| h.kind == v1::HumanDecisionKind::Settle as i32)
            .map(|h| {
                (
                    h.topic.clone(),
                    v1::ConflictSettlement {
                        delegation_id: h.delegation_id.clone(),
                        value: h.value.clone(),
                        decided_by: h.decided_by.clone(),
                        rationale: h.rationale.clone(),
                        evidence_ids: h.evidence_ids.clone(),
                        decided_at: h.decided_at,
                    },
                )
            })
            .collect();
        let run = Arc::new(run);
        let actor = RunActor {
            deps,
            _admitted: admitted,
            span,
            // run.started was event 1; a resumed run reads its events.
            next_seq: run.version + 1,
            run,
            resumed,
            spec,
            slots: Vec::new(),
            batches: vec![Batch::new(max_parallel)],
            facts: BTreeMap::new(),
            ledger,
            budget_stopped: false,
            pending: Vec::new(),
            tx: tx.clone(),
            rx,
            staging: Staging::default(),
            issued: None,
            cancel: CancellationToken::new(),
            abandon: CancellationToken::new(),
            tasks_in_flight: 0,
            join_timer: None,
            planner: None,
            settlements,
            ticket_used: false,
            lease_released: false,
            lease,
        };
        (tx, Some(actor))
    }

    fn start(self) {
        let span = self.span.clone();
        let actors = self.deps.actors.clone();
        // Boxed, so the task holds the actor once (a future taking it by value would
        // hold it twice) for as long as the run is in flight.
        actors.spawn(Box::new(self).main().instrument(span));
    }

    async fn main(mut self: Box<Self>) {
        let run_id = self.run.run_id.clone();
        let exit = self.drive().await;
        Box::pin(self.stop(run_id, exit)).await;
    }

    /// What the actor does as it stops, by why it stops.
    async fn stop(&mut self, run_id: String, exit: Exit) {
        self.abandon.cancel();
        self.deps
            .live
            .lock()
            .expect("live map lock poisoned")
            .remove(&run_id);
        // Delegations still open when the actor stops end with the state they reached.
        for index in 0..self.slots.len() {
            self.end_delegation_span(index);
        }
        match exit {
            Exit::Done if crate::store::is_waiting(self.run.state) => {
                // A waiting run keeps its tokens (a follow-up may need the run's again);
                // its lease went with the commit that made it wait, unless delegations
                // were in flight then or nothing was committed since this replica
                // claimed it.
                if !self.lease_released
                    && let Some(lease) = &self.deps.lease
                    && let Err(e) = self.deps.store.release(&lease.owner, &run_id).await
                {
                    tracing::warn!(run_id, error = %e, "the waiting run's lease could not be released; it lapses");
                }
            }
            Exit::Done => {
                // Tokens of a finished run are useless to anyone but an attacker. (Only
                // then: a revoked run stays revoked, so a run resumed later could not
                // get working tokens again.)
                if let Err(error) = self.deps.revoker.revoke(run_id.clone()).await {
                    tracing::warn!(run_id, %error, "could not revoke the run's tokens");
                }
            }
            Exit::Lost(_) if crate::store::is_waiting(self.run.state) => {
                tracing::debug!(run_id, "the run waits: its lease was given up");
            }
            Exit::Shutdown => {
                // Progress held for a later commit is committed first, so whoever
                // resumes the run does not do it again.
                if !self.staging.is_empty()
                    && let Err(e) = self.commit(Events::default()).await
                {
                    tracing::warn!(run_id, error = %e, "shutting down: the run's latest progress could not be committed; it is redone when the run resumes");
                }
                // Hand the run over at once rather than when the lease runs out.
                if let Some(lease) = &self.deps.lease
                    && !self.terminal()
                {
                    match self.deps.store.release(&lease.owner, &run_id).await {
                        Ok(_) => tracing::info!(
                            run_id,
                            "shutting down: the run's lease is released; it resumes on the next start or another replica"
                        ),
                        Err(e) => {
                            tracing::warn!(run_id, error = %e, "shutting down: the run's lease could not be released; it resumes when the lease expires")
                        }
                    }
                }
            }
            Exit::Lost(reason) => {
                tracing::warn!(run_id, %reason, "another supervisor replica took the run over; this one stops touching it");
            }
            Exit::Failed(e) => {
                tracing::error!(run_id, error = %e, "run stopped: its state could not be committed; it resumes when its lease lapses");
            }
        }
    }

    /// Runs the actor until the run is over for this replica.
    async fn drive(&mut self) -> Exit {
        // Each step is boxed: the actor's own future (allocated for as long as the run
        // is in flight) then holds only the wait for the next message, not the largest
        // state of every step.
        let started = if self.resumed {
            Box::pin(self.begin_resumed()).await
        } else {
            Box::pin(self.begin()).await
        };
        if let Err(e) = started {
            return e.into();
        }
        let shutdown = self.deps.shutdown_token.clone();
        loop {
            if self.finished() {
                return Exit::Done;
            }
            let timer = self.next_timer();
            let msg = if let Some(msg) = self.staging.take_held() {
                Some(msg)
            } else {
                tokio::select! {
                    msg = self.rx.recv() => msg,
                    () = sleep_until(&self.deps.clock, self.staging.flush_at()) => {
                        if let Err(e) = Box::pin(self.commit(Events::default())).await {
                            return e.into();
                        }
                        continue;
                    }
                    () = sleep_until(&self.deps.clock, timer) => {
                        if let Err(e) = Box::pin(self.on_timer()).await {
                            return e.into();
                        }
                        continue;
                    }
                    () = shutdown.cancelled() => return Exit::Shutdown,
                }
            };
            // The actor holds a sender itself, so the mailbox never closes.
            let Some(msg) = msg else { return Exit::Done };
            if matches!(msg, Msg::LeaseLost) {
                return Exit::Lost(
                    "lease renewal found the run held by another replica".to_owned(),
                );
            }
            if let Err(e) = Box::pin(self.handle(msg)).await {
                return e.into();
            }
        }
    }

    fn terminal(&self) -> bool {
        crate::store::is_terminal(self.run.state)
    }

    fn finished(&self) -> bool {
        self.terminal() && self.tasks_in_flight == 0 && self.pending.is_empty()
    }

    fn next_timer(&self) -> Option<SystemTime> {
        if self.terminal() {
            return None;
        }
        let run_deadline = Some(self.spec.limits.deadline);
        match self.join_timer {
            Some(t) => run_deadline.map(|d| d.min(t)),
            None => run_deadline,
        }
    }

    /// Adds `task` to the ledger as a pending delegation; its index.
    fn add_pending(&mut self, task: v1::DelegationTask) -> usize {
        let run = Arc::make_mut(&mut self.run);
        run.delegations.push(v1::Delegation {
            task: Some(task),
            state: v1::DelegationState::Pending as i32,
            ..Default::default()
        });
        run.delegations.len() - 1
    }

    fn event(&mut self, kind: Kind) -> v1::RunEvent {
        let e = v1::RunEvent {
            sequence: self.next_seq,
            run_id: self.run.run_id.clone(),
            time: Some(to_timestamp(self.deps.clock.now())),
            kind: Some(kind),
        };
        self.next_seq += 1;
        e
    }

    /// Applies one message (with the dispatch reports and outcomes waiting behind it).
    async fn handle(&mut self, msg: Msg) -> Result<(), StoreError> {
        match msg {
            msg @ (Msg::Dispatched { .. } | Msg::Outcome { .. }) => {
                // Dispatches and outcomes that reported meanwhile (a run's parallel
                // delegations start, and often finish, together) are taken with this
                // one: the join runs once on every result taken, and one commit
                // carries them all, with the decision when the join decides.
                // Their evidence is verified together; what reports while that is
                // asked is taken too.
                self.take(msg).await?;
                loop {
                    while let Ok(next) = self.rx.try_recv() {
                        if matches!(next, Msg::Dispatched { .. } | Msg::Outcome { .. }) {
                            self.take(next).await?;
                        } else {
                            self.staging.hold(next);
                            break;
                        }
                    }
                    if self.staging.holds_message()
                        || !self.staging.has_unverified()
                        || !self.join_may_decide()
                    {
                        break;
                    }
                    self.verify_staged().await;
                }
                self.settle().await
            }
            Msg::Commands => Box::pin(self.on_commands()).await,
            Msg::Delegate(ask) => {
                let DelegateAsk {
                    claims,
                    token,
                    children,
                    reply,
                    span,
                } = *ask;
                self.on_delegate(&claims, &token, children, reply, &span)
                    .await
            }
            Msg::Deliver { result } => {
                let result = *result;
                match self.run.delegations.iter().position(|d| {
                    d.task
                        .as_ref()
                        .is_some_and(|t| t.delegation_id == result.delegation_id)
                }) {
                    Some(index) => {
                        // A redelivery of work already reported is not charged again.
                        let accounted = self.run.delegations[index].result.is_some();
                        self.record(index, result, false, accounted).await?;
                        self.settle().await
                    }
                    None => {
                        // A result for a delegation this run does not have: the join
                        // rejects it as UNKNOWN_DELEGATION, visibly.
                        if !self.terminal() {
                            Arc::make_mut(&mut self.run).received.push(result);
                            self.join_step("result").await?;
                            if !self.terminal() {
                                // Undecided: keep the join's input durable all the same.
                                self.commit(Events::default()).await?;
                            }
                        }
                        Ok(())
                    }
                }
            }
            Msg::PlannerTurn {
                turn,
                attempt,
                outcome,
            } => self.on_planner_turn(turn, attempt, *outcome).await,
            // Handled by the loop, which stops.
            Msg::LeaseLost => Ok(()),
        }
    }
}
