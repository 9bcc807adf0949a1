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

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use convene_core::join::{self, EvidenceFact, ExpectedDelegation, JoinInput, JoinState};
use convene_core::limits::{self, BudgetLedger};
use convene_core::model::{LateResultPolicy, Overflow, RunSpec};
use convene_core::permissions::RiskLevel;
use convene_core::time::{from_timestamp, to_timestamp};
use convene_core::validate;
use convene_mesh::auth::request;
use convene_proto::v1::{self, run_event::Kind};
use convene_tokens::Claims;
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;
use tonic::{Code, Request, Status};
use tracing::{Instrument as _, Span};

use crate::crash::CrashPoint;
use crate::plan::{self, Placement};
use crate::registry::Registry;
use crate::store::{Events, StoreError};
use crate::{Deps, Settings};
use crate::{events, trace};

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
        outcome: Box<Result<v1::TaskResult, Status>>,
    },
    /// Cancel the run.
    Cancel {
        reason: String,
        reply: oneshot::Sender<v1::Run>,
    },
    /// A worker asks for child delegations under its own token.
    Delegate(Box<DelegateAsk>),
    /// A result delivered out of band (e.g. a redelivery); it goes through the same
    /// checks as any other.
    Deliver { result: Box<v1::TaskResult> },
    /// Lease renewal found the run held by another replica: stop touching it.
    LeaseLost,
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
    pub(crate) reply: oneshot::Sender<Result<Vec<v1::DelegateOutcome>, Status>>,
    /// The span of the Delegate call (the asking tool call's, through propagation): the
    /// children's delegation spans are its children.
    pub(crate) span: Span,
}

/// The sending side of a run actor's mailbox.
pub(crate) type Mailbox = mpsc::UnboundedSender<Msg>;

struct Slot {
    token: String,
    top_level: bool,
    batch: usize,
    in_flight: bool,
    finished: bool,
    /// A nested child without a result, found unfinished when the run was resumed: it
    /// waits until its parent's repeated Delegate call addresses it again.
    dormant: bool,
    attempts: u32,
    /// Dispatches made before this actor took the run over (0 for a new run): retry
    /// limits count this actor's attempts only.
    attempt_base: u32,
    workers: Vec<String>,
    /// Children this delegation asked for in its current attempt, dropped ones included:
    /// the next Delegate call's first call index.
    children: u32,
    /// The attempt `children` counts for. A retried delegation repeats its Delegate
    /// calls, so its call indices start again at 0 and address the children the earlier
    /// attempt created.
    children_attempt: u32,
    cancelled: bool,
    /// The delegation's span, open from planning to its final outcome; every dispatch
    /// attempt runs inside it. `Span::none()` once ended.
    span: Span,
}

struct Batch {
    max_parallel: usize,
    queue: VecDeque<usize>,
    running: usize,
}

struct PendingDelegate {
    /// Per requested child, in call order: the ledger index, or None when dropped.
    children: Vec<(String, Option<usize>)>,
    reply: oneshot::Sender<Result<Vec<v1::DelegateOutcome>, Status>>,
}

pub(crate) struct RunActor {
    deps: Arc<Deps>,
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
    /// A message taken from the mailbox early (while gathering dispatches and outcomes
    /// to commit together) and not handled yet: the next one handled.
    held: Option<Msg>,
    /// Events of dispatches and results taken from the mailbox but not committed yet:
    /// the next commit carries them, before its own.
    staged: Events,
    /// When staged progress that decided nothing is committed at the latest, if no
    /// other commit carries it first (`commit_linger` after it was held back).
    flush_at: Option<SystemTime>,
    /// The new run's task tokens (or why they were refused), asked for by StartRun
    /// while it stored the run; taken when the actor begins.
    issued: Option<Result<Vec<String>, Status>>,
    /// Top-level results are staged that the join has not seen.
    unjoined: bool,
    /// Received results whose cited evidence is not verified yet (the delegation's
    /// index and the ids it cites): verified together, in one `VerifyChain`, once the
    /// join could decide on them (see [`RunActor::join_step`]); until then they stay
    /// here, committed as received.
    unverified: Vec<(usize, BTreeSet<String>)>,
    /// The join ran on staged results; the commit carrying them (and its decision, if
    /// any) has not happened.
    joined: bool,
    /// Cancels the run's dispatches, telling their workers to stop (deadline, cancel,
    /// decision).
    cancel: CancellationToken,
    /// Abandons the run's dispatches without telling their workers anything: when this
    /// actor stops touching the run (shutdown, takeover), whoever resumes it dispatches
    /// the same delegation ids again and joins what the workers still run.
    abandon: CancellationToken,
    tasks_in_flight: usize,
    join_timer: Option<SystemTime>,
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

/// Tries of an IssueTaskToken call that fails transiently.
const TOKEN_ATTEMPTS: u32 = 8;

fn now() -> SystemTime {
    SystemTime::now()
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

fn deadline_of(task: &v1::DelegationTask) -> SystemTime {
    task.deadline
        .as_ref()
        .and_then(|t| from_timestamp(t, "deadline").ok())
        .unwrap_or_else(now)
}

/// Attempts at filing one approval request, and the first pause between them (doubling):
/// about three seconds in all.
const APPROVAL_ATTEMPTS: u32 = 5;
const APPROVAL_RETRY_BACKOFF: Duration = Duration::from_millis(200);

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

impl RunActor {
    /// Spawns the actor for a freshly created run (version 1, delegations planned) and
    /// returns its mailbox. `span` is the run's root span; `None` continues the trace
    /// stored on the run (`trace_parent`), as for a run picked up again after a restart.
    /// `issued` are the tokens for its [`startable`] delegations, when asked for already
    /// ([`issue_tokens`]); `None`: the actor asks.
    pub(crate) fn spawn(
        deps: Arc<Deps>,
        run: v1::Run,
        spec: RunSpec,
        span: Option<Span>,
        issued: Option<Result<Vec<String>, Status>>,
    ) -> Mailbox {
        let (mailbox, actor) = Self::new(deps, run, spec, span, false);
        match actor {
            Some(mut actor) => {
                actor.issued = issued;
                actor.start();
            }
            None => tracing::warn!("a new run's actor exists already"),
        }
        mailbox
    }

    /// Resumes a stored, unfinished run this replica claimed, continuing its trace.
    /// Returns false when the run has an actor in this process already (nothing to
    /// resume) or cannot be resumed (then it is failed, with the reason).
    pub(crate) fn resume(deps: Arc<Deps>, run: v1::Run) -> bool {
        let Some(wire) = run.spec.clone() else {
            tokio::spawn(fail_stored(
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
            .unwrap_or_else(now);
        let spec = match validate::run_spec(&wire, accepted) {
            Ok(spec) => spec,
            Err(e) => {
                let reason = format!(
                    "the stored spec no longer validates: {}: {}",
                    e.field, e.message
                );
                tokio::spawn(fail_stored(deps, run, reason));
                return false;
            }
        };
        let (_, actor) = Self::new(deps, run, spec, None, true);
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
        resumed: bool,
    ) -> (Mailbox, Option<Self>) {
        let mut live = deps.live.lock().expect("live map lock poisoned");
        if let Some(existing) = live.get(&run.run_id) {
            return (existing.clone(), None);
        }
        let span = span.unwrap_or_else(|| trace::resumed_run_span(&run));
        let (tx, rx) = mpsc::unbounded_channel();
        let ledger = BudgetLedger::new(&spec.limits);
        let max_parallel = spec.limits.max_parallel_workers as usize;
        live.insert(run.run_id.clone(), tx.clone());
        drop(live);
        let run = Arc::new(run);
        let actor = RunActor {
            deps,
            span,
            // run.started was event 1; a resumed run reads its events.
            next_seq: run.version + 1,
            run,
            resumed,
            spec,
            slots: Vec::new(),
            batches: vec![Batch {
                max_parallel,
                queue: VecDeque::new(),
                running: 0,
            }],
            facts: BTreeMap::new(),
            ledger,
            budget_stopped: false,
            pending: Vec::new(),
            tx: tx.clone(),
            rx,
            held: None,
            staged: Events::default(),
            flush_at: None,
            issued: None,
            unjoined: false,
            unverified: Vec::new(),
            joined: false,
            cancel: CancellationToken::new(),
            abandon: CancellationToken::new(),
            tasks_in_flight: 0,
            join_timer: None,
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
            Exit::Done => {
                // Tokens of a finished run are useless to anyone but an attacker. (Only
                // then: a revoked run stays revoked, so a run resumed later could not
                // get working tokens again.)
                if let Err(error) = self.deps.revoker.revoke(run_id.clone()).await {
                    tracing::warn!(run_id, %error, "could not revoke the run's tokens");
                }
            }
            Exit::Shutdown => {
                // Progress held for a later commit is committed first, so whoever
                // resumes the run does not do it again.
                if !self.staged.is_empty()
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
            let msg = if let Some(msg) = self.held.take() {
                Some(msg)
            } else {
                tokio::select! {
                    msg = self.rx.recv() => msg,
                    () = sleep_until(self.flush_at) => {
                        if let Err(e) = Box::pin(self.commit(Events::default())).await {
                            return e.into();
                        }
                        continue;
                    }
                    () = sleep_until(timer) => {
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

    fn event(&mut self, kind: Kind) -> v1::RunEvent {
        let e = v1::RunEvent {
            sequence: self.next_seq,
            run_id: self.run.run_id.clone(),
            time: Some(to_timestamp(now())),
            kind: Some(kind),
        };
        self.next_seq += 1;
        e
    }

    /// Commits the run as it is now with the staged events and then `events`, as one
    /// new version.
    async fn commit(&mut self, events: Events) -> Result<(), StoreError> {
        self.flush_at = None;
        let mut all = std::mem::take(&mut self.staged);
        all.run.extend(events.run);
        all.cloud.extend(events.cloud);
        let dispatches = all
            .run
            .iter()
            .any(|e| matches!(e.kind, Some(Kind::Dispatched(_))));
        if std::mem::take(&mut self.joined) {
            self.deps.crash.at(CrashPoint::DuringJoin);
        }
        Arc::make_mut(&mut self.run).version += 1;
        Arc::make_mut(&mut self.run).updated_at = Some(to_timestamp(now()));
        self.deps.store.commit_shared(&self.run, &all).await?;
        if dispatches {
            self.deps.crash.at(CrashPoint::AfterDispatch);
        }
        Ok(())
    }

    // ---- start ----------------------------------------------------------------------

    async fn begin(&mut self) -> Result<(), StoreError> {
        let (live, tasks) = startable(&self.run);
        let no_task = v1::DelegationTask::default();
        for (i, d) in self.run.delegations.iter().enumerate() {
            let task = d.task.as_ref().unwrap_or(&no_task);
            self.slots.push(Slot {
                token: String::new(),
                top_level: true,
                batch: 0,
                in_flight: false,
                finished: !live.contains(&i),
                dormant: false,
                attempts: 0,
                attempt_base: 0,
                workers: Vec::new(),
                children: 0,
                children_attempt: 0,
                cancelled: false,
                span: trace::delegation_span(&self.span, task),
            });
        }
        // Delegations that never start (dropped by TRUNCATE) are in the trace too.
        for i in 0..self.slots.len() {
            if !live.contains(&i) {
                self.end_delegation_span(i);
            }
        }
        // StartRun asked for the tokens while it stored the run; a run started another
        // way asks now.
        let issued = match self.issued.take() {
            Some(issued) => issued,
            None => self.issue_tokens(&tasks, None).await,
        };
        match issued {
            Ok(tokens) => {
                for (i, token) in live.iter().zip(tokens) {
                    self.slots[*i].token = token;
                    self.batches[0].queue.push_back(*i);
                }
            }
            Err(status) => {
                let reason = format!("task tokens were refused: {}", status.message());
                return self.finish(None, v1::RunState::Failed, reason).await;
            }
        }
        // The run turns RUNNING with its first dispatch, in that dispatch's commit:
        // until a worker takes a delegation it is PENDING, accepted and not dispatched.
        self.pump(0);
        if live.is_empty() {
            self.join_step("plan").await?;
        }
        Ok(())
    }

    /// Takes a stored run over: rebuilds the slots from the ledger, gets fresh tokens
    /// in one call for every top-level delegation that is dispatched again or whose
    /// results are verified again, and applies the join.
    async fn begin_resumed(&mut self) -> Result<(), StoreError> {
        // What the stored events say: the next sequence number, and every worker each
        // delegation was dispatched to (the join checks that a result came from one).
        let stored = self.deps.store.run_events(&self.run.run_id, 0).await?;
        self.next_seq = stored.last().map_or(1, |e| e.sequence + 1);
        let mut dispatched_to: HashMap<String, Vec<String>> = HashMap::new();
        for e in &stored {
            if let Some(Kind::Dispatched(d)) = &e.kind {
                let workers = dispatched_to.entry(d.delegation_id.clone()).or_default();
                if !workers.contains(&d.worker_id) {
                    workers.push(d.worker_id.clone());
                }
            }
        }
        drop(stored);
        tracing::info!(
            run_id = %self.run.run_id,
            version = self.run.version,
            state = events::run_state_name(self.run.state),
            received = self.run.received.len(),
            "resuming the run from its stored state"
        );

        let no_task = v1::DelegationTask::default();
        // Top-level delegations to dispatch again, and those whose results the join has.
        let mut redispatch = Vec::new();
        let mut verify = Vec::new();
        for (i, d) in self.run.delegations.iter().enumerate() {
            let task = d.task.as_ref().unwrap_or(&no_task);
            let top_level = task.parent_delegation_id.is_empty();
            let settled = d.result.is_some()
                || matches!(
                    v1::DelegationState::try_from(d.state),
                    Ok(v1::DelegationState::Dropped
                        | v1::DelegationState::Cancelled
                        | v1::DelegationState::Failed)
                );
            let mut workers = dispatched_to
                .remove(&task.delegation_id)
                .unwrap_or_default();
            if !d.worker_id.is_empty() && !workers.contains(&d.worker_id) {
                workers.push(d.worker_id.clone());
            }
            if top_level && !settled {
                redispatch.push(i);
            }
            if top_level && d.result.is_some() {
                verify.push(i);
            }
            self.slots.push(Slot {
                token: String::new(),
                top_level,
                batch: 0,
                in_flight: false,
                finished: settled,
                // A nested child is dispatched again only when its parent's repeated
                // Delegate call asks for it: without a parent waiting, its result would
                // reach no one.
                dormant: !top_level && !settled,
                attempts: d.attempts,
                attempt_base: d.attempts,
                workers,
                children: 0,
                children_attempt: 0,
                cancelled: false,
                // Settled delegations were traced by whoever settled them.
                span: if top_level && !settled {
                    trace::delegation_span(&self.span, task)
                } else {
                    Span::none()
                },
            });
        }
        if let Some(usage) = self.run.usage
            && let Err(e) = self.ledger.charge(&usage)
        {
            tracing::warn!(run_id = %self.run.run_id, error = %e, "the run's budget is exhausted: no further delegations start");
            self.budget_stopped = true;
        }

        let mut wanted: Vec<usize> = redispatch.iter().chain(&verify).copied().collect();
        wanted.sort_unstable();
        let tasks: Vec<v1::DelegationTask> = wanted
            .iter()
            .filter_map(|i| self.run.delegations[*i].task.clone())
            .collect();
        match self.issue_tokens(&tasks, None).await {
            Ok(tokens) => {
                for (i, token) in wanted.iter().zip(tokens) {
                    self.slots[*i].token = token;
                }
            }
            Err(status) => {
                let reason = format!(
                    "task tokens were refused when the run was resumed: {}",
                    status.message()
                );
                return self.finish(None, v1::RunState::Failed, reason).await;
            }
        }
        if self.run.state == v1::RunState::Pending as i32 {
            // Accepted, then the supervisor stopped before the run started.
            Arc::make_mut(&mut self.run).state = v1::RunState::Running as i32;
            self.commit(Events::default()).await?;
        }
        // The join's facts: every result it received, verified again.
        let by_id: HashMap<String, usize> = self
            .run
            .delegations
            .iter()
            .enumerate()
            .filter_map(|(i, d)| Some((d.task.as_ref()?.delegation_id.clone(), i)))
            .collect();
        for result in &self.run.received {
            if let Some(&index) = by_id.get(&result.delegation_id) {
                self.unverified.push((
                    index,
                    join::cited_evidence_ids(std::slice::from_ref(result)),
                ));
            }
        }
        self.verify_staged().await;
        for i in redispatch {
            self.batches[0].queue.push_back(i);
        }
        self.pump(0);
        self.join_step("resume").await
    }

    async fn issue_tokens(
        &self,
        tasks: &[v1::DelegationTask],
        parent_token: Option<&str>,
    ) -> Result<Vec<String>, Status> {
        issue_tokens(
            &self.deps,
            &self.run,
            self.spec.limits.max_depth,
            tasks,
            parent_token,
        )
        .await
    }

    /// Starts queued delegations of a batch while it has free slots.
    fn pump(&mut self, batch: usize) {
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
    fn launch(&mut self, index: usize, delay: Duration) {
        let slot = &mut self.slots[index];
        slot.in_flight = true;
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
        let task = self.run.delegations[index].task.clone().unwrap_or_default();
        let cancel = self.cancel.child_token();
        let abandon = self.abandon.clone();
        let tx = self.tx.clone();
        let registry = self.deps.registry.clone();
        let grace = self.deps.settings.dispatch_grace;
        // Every attempt runs inside the delegation's span, so the worker's spans (through
        // the trace context on the Execute call) are the delegation's children.
        let span = slot.span.clone();
        self.tasks_in_flight += 1;
        tokio::spawn(
            dispatch(Box::new(Dispatch {
                registry,
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
            }))
            .instrument(span),
        );
    }

    // ---- messages -------------------------------------------------------------------

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
                            self.held = Some(next);
                            break;
                        }
                    }
                    if self.held.is_some() || self.unverified.is_empty() || !self.join_may_decide()
                    {
                        break;
                    }
                    self.verify_staged().await;
                }
                self.settle().await
            }
            Msg::Cancel { reason, reply } => {
                if !self.terminal() {
                    self.cancel.cancel();
                    self.finish(None, v1::RunState::Cancelled, reason).await?;
                }
                let _ = reply.send((*self.run).clone());
                Ok(())
            }
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
                        self.record(index, result, false, false).await?;
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
            // Handled by the loop, which stops.
            Msg::LeaseLost => Ok(()),
        }
    }

    /// Takes a dispatch's report or a dispatch's outcome, staging what it changes for
    /// the next commit ([`RunActor::settle`]).
    async fn take(&mut self, msg: Msg) -> Result<(), StoreError> {
        match msg {
            Msg::Dispatched {
                index,
                worker_id,
                attempt,
            } => {
                let e = self.dispatched(index, worker_id, attempt);
                self.staged.run.push(e);
                Ok(())
            }
            Msg::Outcome {
                index,
                attempt,
                worker_id,
                outcome,
            } => {
                self.deps.crash.at(CrashPoint::ResultInFlight);
                self.tasks_in_flight = self.tasks_in_flight.saturating_sub(1);
                self.on_outcome(index, attempt, worker_id, *outcome).await
            }
            _ => unreachable!("only dispatches and outcomes are taken"),
        }
    }

    /// Runs the join on the staged results (if any) and commits what is staged, or,
    /// when that decided nothing, holds it for the run's next commit: at the latest
    /// `commit_linger` from now (see [`crate::Config::commit_linger`]).
    async fn settle(&mut self) -> Result<(), StoreError> {
        if std::mem::take(&mut self.unjoined) {
            self.joined = true;
            self.join_step("result").await?;
        }
        if self.staged.is_empty() {
            self.joined = false;
            return Ok(());
        }
        let linger = self.deps.settings.commit_linger;
        if self.terminal() || linger.is_zero() {
            self.commit(Events::default()).await?;
        } else if self.flush_at.is_none() {
            // `joined` stays set: the commit that carries the results still follows
            // the join that ran on them.
            self.flush_at = Some(now() + linger);
        }
        Ok(())
    }

    /// Records that delegation `index` was dispatched; returns its event.
    fn dispatched(&mut self, index: usize, worker_id: String, attempt: u32) -> v1::RunEvent {
        if !self.slots[index].workers.contains(&worker_id) {
            self.slots[index].workers.push(worker_id.clone());
        }
        if self.run.state == v1::RunState::Pending as i32 {
            Arc::make_mut(&mut self.run).state = v1::RunState::Running as i32;
        }
        let d = &mut Arc::make_mut(&mut self.run).delegations[index];
        d.state = v1::DelegationState::Dispatched as i32;
        d.worker_id.clone_from(&worker_id);
        d.attempts = attempt;
        if d.dispatched_at.is_none() {
            d.dispatched_at = Some(to_timestamp(now()));
        }
        let task = task_or_empty(&d.task);
        let dispatched = v1::DelegationDispatched {
            delegation_id: task.delegation_id.clone(),
            name: task.name.clone(),
            profile_id: task.profile_id.clone(),
            worker_id,
            attempt,
            depth: task.depth,
        };
        self.event(Kind::Dispatched(dispatched))
    }

    async fn on_outcome(
        &mut self,
        index: usize,
        attempt: u32,
        worker_id: Option<String>,
        outcome: Result<v1::TaskResult, Status>,
    ) -> Result<(), StoreError> {
        let settings = self.deps.settings;
        let max_attempts = self.spec.limits.max_redelegations + 1;
        let task = task_or_empty(&self.run.delegations[index].task);
        let time_left = deadline_of(task) > now();
        let (delegation_id, profile_id) = (task.delegation_id.clone(), task.profile_id.clone());
        let may_retry = !self.terminal()
            && !self.slots[index].cancelled
            && attempt.saturating_sub(self.slots[index].attempt_base) < max_attempts
            && time_left
            && !self.cancel.is_cancelled();
        match outcome {
            Ok(result) => {
                let retryable = result.status == v1::TaskStatus::Failed as i32
                    && result.error.as_ref().is_some_and(|e| e.retryable);
                if retryable && may_retry {
                    self.slots[index].span.in_scope(|| {
                        tracing::info!(run_id = %self.run.run_id, %delegation_id, attempt, "transient worker failure; retrying under the same delegation id");
                    });
                    self.launch(index, backoff(&settings, attempt));
                    return Ok(());
                }
                // Charge before the slot frees up, so a result that exhausts the
                // budget also stops the next queued delegation from starting.
                self.account(&result);
                self.release(index);
                self.record(index, result, false, true).await
            }
            Err(status) => {
                if matches!(status.code(), Code::Unavailable | Code::Unknown)
                    && let Some(w) = &worker_id
                {
                    self.deps.registry.mark_dead(w);
                }
                let transient = status_is_transient(status.code());
                if transient && may_retry {
                    self.slots[index].span.in_scope(|| {
                        tracing::info!(run_id = %self.run.run_id, %delegation_id, attempt, code = ?status.code(), "dispatch failed; dispatching again under the same delegation id");
                    });
                    self.launch(index, backoff(&settings, attempt));
                    return Ok(());
                }
                self.release(index);
                if status.code() == Code::Cancelled && self.slots[index].cancelled {
                    return self.mark_cancelled(index).await;
                }
                let code = match status.code() {
                    Code::NotFound => "no_worker",
                    Code::DeadlineExceeded => "timeout",
                    Code::Cancelled => "cancelled",
                    c if status_is_transient(c) => "worker_unavailable",
                    _ => "dispatch_failed",
                };
                let failed = v1::TaskResult {
                    delegation_id,
                    worker_id: worker_id.unwrap_or_default(),
                    profile_id,
                    status: if code == "timeout" {
                        v1::TaskStatus::TimedOut as i32
                    } else {
                        v1::TaskStatus::Failed as i32
                    },
                    summary: format!("no result after {attempt} attempt(s): {}", status.message()),
                    error: Some(v1::ErrorInfo {
                        code: code.to_owned(),
                        retryable: false,
                        message: status.message().to_owned(),
                    }),
                    ..Default::default()
                };
                self.record(index, failed, true, false).await
            }
        }
    }

    /// A dispatch of `index` is over for good: free its batch slot.
    fn release(&mut self, index: usize) {
        let slot = &mut self.slots[index];
        if slot.in_flight {
            slot.in_flight = false;
            slot.finished = true;
            let batch = slot.batch;
            self.batches[batch].running = self.batches[batch].running.saturating_sub(1);
            self.pump(batch);
        }
    }

    async fn mark_cancelled(&mut self, index: usize) -> Result<(), StoreError> {
        let d = &mut Arc::make_mut(&mut self.run).delegations[index];
        if d.result.is_none() {
            if d.state != v1::DelegationState::TimedOut as i32 {
                d.state = v1::DelegationState::Cancelled as i32;
            }
            d.completed_at = Some(to_timestamp(now()));
        }
        self.end_delegation_span(index);
        self.children_step();
        self.commit(Events::default()).await
    }

    /// Records a delegation's final state on its span and ends it (once).
    fn end_delegation_span(&mut self, index: usize) {
        let span = std::mem::replace(&mut self.slots[index].span, Span::none());
        trace::record_delegation_end(&span, &self.run.delegations[index]);
    }

    /// Adds a result's usage to the run and charges the budget; once the budget is
    /// exhausted no further delegation starts.
    fn account(&mut self, result: &v1::TaskResult) {
        if let Some(usage) = &result.usage {
            let u = Arc::make_mut(&mut self.run)
                .usage
                .get_or_insert_with(Default::default);
            u.iterations += usage.iterations;
            u.tool_calls += usage.tool_calls;
            u.tokens += usage.tokens;
            u.cost += usage.cost;
            u.duration_ms += usage.duration_ms;
            if let Err(e) = self.ledger.charge(usage)
                && !self.budget_stopped
            {
                tracing::warn!(run_id = %self.run.run_id, error = %e, "budget exhausted: no further delegations start");
                self.budget_stopped = true;
                Arc::make_mut(&mut self.run).terminal_reason = e.to_string();
                self.settle_queued_children(&format!(
                    "not started: the run's budget is exhausted ({e})"
                ));
            }
        }
    }

    /// Records a result (or a synthesized failure) of delegation `index`; `accounted`
    /// when its usage was already charged. A top-level result that is not late is
    /// staged for the join: the caller settles ([`RunActor::settle`]).
    async fn record(
        &mut self,
        index: usize,
        result: v1::TaskResult,
        failure: bool,
        accounted: bool,
    ) -> Result<(), StoreError> {
        let late = self.terminal();
        if self.slots[index].top_level && !late {
            // Staged for the join: verified with the others staged (`verify_staged`).
            self.unverified.push((
                index,
                join::cited_evidence_ids(std::slice::from_ref(&result)),
            ));
        } else {
            let span = self.slots[index].span.clone();
            self.verify_evidence(index, &result).instrument(span).await;
        }
        if !accounted {
            self.account(&result);
        }
        let d = &mut Arc::make_mut(&mut self.run).delegations[index];
        d.state = if failure {
            v1::DelegationState::Failed as i32
        } else {
            v1::DelegationState::Completed as i32
        };
        d.completed_at = Some(to_timestamp(now()));
        d.detail = if failure {
            result.summary.clone()
        } else {
            String::new()
        };
        d.result = Some(result.clone());
        let completed = v1::DelegationCompleted {
            delegation_id: result.delegation_id.clone(),
            name: d.task.as_ref().map(|t| t.name.clone()).unwrap_or_default(),
            state: d.state,
            status: result.status,
            summary: result.summary.clone(),
            late,
        };
        self.end_delegation_span(index);
        let e = self.event(Kind::Completed(completed));
        let cloud = events::cloud(
            events::DELEGATION_COMPLETED,
            &self.run,
            Some(&format!("delegations/{}", result.delegation_id)),
            now(),
            events::delegation_completed_data(&self.run, &self.run.delegations[index], late),
        );
        let mut ev = Events {
            run: vec![e],
            cloud: vec![cloud],
        };
        if self.slots[index].top_level {
            Arc::make_mut(&mut self.run).received.push(result);
            if late {
                self.late_revision(
                    &mut ev,
                    &self.run.delegations[index]
                        .task
                        .clone()
                        .unwrap_or_default()
                        .delegation_id,
                );
                return self.commit(ev).await;
            }
            // Committed with the join's decision on it, or when the join waits for more.
            self.staged.run.extend(ev.run);
            self.staged.cloud.extend(ev.cloud);
            self.unjoined = true;
            Ok(())
        } else {
            self.commit(ev).await?;
            self.children_step();
            Ok(())
        }
    }

    /// Asks the evidence store about every evidence id the result cites, with the
    /// delegation's own token (so the tenant is the token's).
    async fn verify_evidence(&mut self, index: usize, result: &v1::TaskResult) {
        let cited = join::cited_evidence_ids(std::slice::from_ref(result));
        self.verify_cited(index, cited).await;
    }

    /// Asks about the evidence ids `cited` by delegation `index` that are not verified
    /// yet, with the delegation's own token. Unanswered, they count as unknown.
    async fn verify_cited(&mut self, index: usize, cited: BTreeSet<String>) {
        let token = self.slots[index].token.clone();
        let unknown: Vec<String> = cited
            .into_iter()
            .filter(|id| !self.facts.contains_key(id))
            .collect();
        if unknown.is_empty() || token.is_empty() {
            return;
        }
        if let Err(s) = self.verify_chain(&token, unknown).await {
            tracing::warn!(run_id = %self.run.run_id, error = %s.message(), "evidence could not be verified; it counts as unknown");
        }
    }

    /// Verifies the evidence cited by the staged results not verified yet, in one call:
    /// a run's delegations share its tenant, so any one of their tokens reads all of it.
    /// If that call fails (that token expired, say), each result is asked about with its
    /// own token, as when results arrive one at a time.
    async fn verify_staged(&mut self) {
        let mut staged = std::mem::take(&mut self.unverified);
        if staged.len() == 1 {
            // One result: asked about as when results come alone.
            let (index, cited) = staged.remove(0);
            let span = self.slots[index].span.clone();
            return self.verify_cited(index, cited).instrument(span).await;
        }
        let Some((token, ids)) = chain_ask(&staged, &self.facts, |index| {
            self.slots[index].token.as_str()
        }) else {
            return;
        };
        let span = self.span.clone();
        let Err(status) = self.verify_chain(&token, ids).instrument(span).await else {
            return;
        };
        tracing::debug!(run_id = %self.run.run_id, error = %status.message(), "verifying the staged results' evidence together failed; asking for each");
        for (index, cited) in staged {
            let span = self.slots[index].span.clone();
            self.verify_cited(index, cited).instrument(span).await;
        }
    }

    /// One `VerifyChain` call (retried while the failure is transient) for `ids`, with
    /// `token`; records what it says of each id in the join's facts.
    async fn verify_chain(&mut self, token: &str, ids: Vec<String>) -> Result<(), Status> {
        let req = v1::VerifyChainRequest {
            claims: vec![v1::ChainClaim {
                claim_id: "cited".to_owned(),
                evidence_refs: ids,
            }],
            rehash_content: false,
        };
        let mut attempt = 1u32;
        let answer = loop {
            match self
                .deps
                .evidence
                .verify_chain(request(req.clone(), token))
                .await
            {
                Ok(r) => break r.into_inner(),
                Err(s) if status_is_transient(s.code()) && attempt < 3 => {
                    tokio::time::sleep(backoff(&self.deps.settings, attempt)).await;
                    attempt += 1;
                }
                Err(s) => return Err(s),
            }
        };
        let kinds: HashMap<&str, &v1::Evidence> = answer
            .evidence
            .iter()
            .map(|e| (e.evidence_id.as_str(), e))
            .collect();
        for link in &answer.links {
            let fact = match v1::LinkStatus::try_from(link.status) {
                Ok(v1::LinkStatus::Ok) => match kinds.get(link.evidence_id.as_str()) {
                    Some(e) => EvidenceFact::Verified {
                        kind: e.kind.clone(),
                        content_hash: e.content_hash.clone(),
                    },
                    None => EvidenceFact::Unknown,
                },
                Ok(v1::LinkStatus::ArtifactMissing) => EvidenceFact::ArtifactMissing,
                Ok(v1::LinkStatus::HashMismatch | v1::LinkStatus::ArtifactCorrupted) => {
                    EvidenceFact::HashMismatch
                }
                _ => EvidenceFact::Unknown,
            };
            self.facts.insert(link.evidence_id.clone(), fact);
        }
        Ok(())
    }

    // ---- the join -------------------------------------------------------------------

    fn expected(&self) -> Vec<ExpectedDelegation> {
        self.run
            .delegations
            .iter()
            .zip(&self.slots)
            .filter(|(d, s)| s.top_level && d.state != v1::DelegationState::Dropped as i32)
            .filter_map(|(d, s)| {
                let t = d.task.as_ref()?;
                Some(ExpectedDelegation {
                    delegation_id: t.delegation_id.clone(),
                    name: t.name.clone(),
                    profile_id: t.profile_id.clone(),
                    worker_ids: s.workers.clone(),
                    allowed_evidence_prefixes: t.allowed_evidence_prefixes.clone(),
                })
            })
            .collect()
    }

    /// Whether the join could decide on the results received, whatever the evidence
    /// store says of them ([`join::may_decide`]).
    fn join_may_decide(&self) -> bool {
        let expected = self.expected();
        join::may_decide(&JoinInput {
            contract: &self.spec.join,
            delegations: &expected,
            results: &self.run.received,
            evidence: &self.facts,
            now: now(),
        })
    }

    /// Evaluates the join (`trigger` says what prompted it, for the trace) and ends the
    /// run when it decides.
    async fn join_step(&mut self, trigger: &'static str) -> Result<(), StoreError> {
        if self.terminal() {
            return Ok(());
        }
        // The staged results' evidence is asked about once the answer can matter: while
        // the join waits for delegations that have not reported, whatever the store
        // says, it stays pending, and the results are asked about with those still to
        // come, in one call. A run that ran out of budget publishes what there is, so
        // it asks at once.
        if !self.unverified.is_empty() && (self.budget_stopped || self.join_may_decide()) {
            self.verify_staged().await;
        }
        let span = trace::join_span(&self.span, &self.spec.join, trigger);
        let expected = self.expected();
        let input = JoinInput {
            contract: &self.spec.join,
            delegations: &expected,
            results: &self.run.received,
            evidence: &self.facts,
            now: now(),
        };
        match span.in_scope(|| join::decide(&input)) {
            JoinState::Decided(decision) => {
                trace::record_decision(&span, &decision);
                let state = self.state_for(decision.outcome, false);
                let reason = decision.reasons.first().cloned().unwrap_or_default();
                // Approval requests the decision files are its children.
                self.finish(Some(decision), state, reason)
                    .instrument(span)
                    .await
            }
            JoinState::Pending {
                deadline,
                waiting_for,
            } => {
                trace::record_pending(&span, &waiting_for);
                self.join_timer = deadline;
                let idle = self.slots.iter().all(|s| !s.in_flight)
                    && self
                        .batches
                        .iter()
                        .all(|b| b.queue.is_empty() || self.budget_stopped);
                if idle && self.budget_stopped {
                    // Nothing can change any more: publish what there is.
                    let decision = join::assess(&input);
                    trace::record_decision(&span, &decision);
                    let reason = self.run.terminal_reason.clone();
                    return self
                        .finish(Some(decision), v1::RunState::BudgetExhausted, reason)
                        .instrument(span)
                        .await;
                }
                Ok(())
            }
        }
    }

    async fn on_timer(&mut self) -> Result<(), StoreError> {
        let t = now();
        if t >= self.spec.limits.deadline {
            // The run's hard deadline: decide on what there is and stop everything.
            self.cancel.cancel();
            self.verify_staged().await;
            let span = trace::join_span(&self.span, &self.spec.join, "deadline");
            let expected = self.expected();
            let input = JoinInput {
                contract: &self.spec.join,
                delegations: &expected,
                results: &self.run.received,
                evidence: &self.facts,
                now: t,
            };
            let decision = join::assess(&input);
            trace::record_decision(&span, &decision);
            let state = self.state_for(decision.outcome, true);
            return self
                .finish(
                    Some(decision),
                    state,
                    "the run's deadline passed".to_owned(),
                )
                .instrument(span)
                .await;
        }
        self.join_timer = None;
        self.join_step("timer").await
    }

    fn state_for(&self, outcome: i32, _hard_deadline: bool) -> v1::RunState {
        match v1::JoinOutcome::try_from(outcome) {
            Ok(v1::JoinOutcome::Complete) => v1::RunState::Succeeded,
            Ok(v1::JoinOutcome::PartialEvidence) => v1::RunState::Partial,
            Ok(
                v1::JoinOutcome::CompleteWithReviewRequired
                | v1::JoinOutcome::ConflictRequiresHuman,
            ) => v1::RunState::WaitingInput,
            _ => v1::RunState::Failed,
        }
    }

    /// Ends the run: records the decision (if any), files approval requests for proposed
    /// R2/R3 actions of accepted results, stops what must stop, and commits.
    async fn finish(
        &mut self,
        decision: Option<v1::JoinDecision>,
        mut state: v1::RunState,
        reason: String,
    ) -> Result<(), StoreError> {
        let t = now();
        let mut ev = Events::default();
        if let Some(decision) = decision {
            Arc::make_mut(&mut self.run).outcome = decision.outcome;
            Arc::make_mut(&mut self.run)
                .revisions
                .push(decision.clone());
            Arc::make_mut(&mut self.run).decision = Some(decision.clone());
            ev.cloud.push(events::cloud(
                events::JOIN_DECIDED,
                &self.run,
                Some("decision"),
                t,
                events::join_decided_data(&self.run, &decision),
            ));
            let e = self.event(Kind::Decision(decision.clone()));
            ev.run.push(e);
            let filed = self.file_approvals(&decision, &mut ev).await;
            if !filed.is_empty() && state == v1::RunState::WaitingInput {
                state = v1::RunState::WaitingApproval;
            }
            Arc::make_mut(&mut self.run).approval_ids.extend(filed);
        }
        Arc::make_mut(&mut self.run).state = state as i32;
        if !reason.is_empty() {
            Arc::make_mut(&mut self.run).terminal_reason = reason.clone();
        }
        // In-flight delegations: under APPEND_REVISION their results may still revise
        // the decision, so they keep running to their own deadlines; otherwise they stop.
        let keep_running = state != v1::RunState::Cancelled
            && self.spec.join.late_result == LateResultPolicy::AppendRevision
            && !self.cancel.is_cancelled();
        let mut never_started = Vec::new();
        for (i, d) in Arc::make_mut(&mut self.run)
            .delegations
            .iter_mut()
            .enumerate()
        {
            let in_flight = self.slots.get(i).is_some_and(|s| s.in_flight);
            let dormant = self.slots.get(i).is_some_and(|s| s.dormant);
            if d.state == v1::DelegationState::Pending as i32 && !in_flight {
                d.state = v1::DelegationState::Cancelled as i32;
                d.detail = "the run ended before it was dispatched".to_owned();
                never_started.push(i);
            } else if dormant && d.result.is_none() {
                d.state = v1::DelegationState::Cancelled as i32;
                d.detail = "the run ended before this child was asked for again after the supervisor restarted".to_owned();
                never_started.push(i);
            } else if in_flight && d.result.is_none() {
                d.state = v1::DelegationState::TimedOut as i32;
                d.detail = "the run decided before this delegation answered".to_owned();
            }
        }
        for i in never_started {
            self.end_delegation_span(i);
        }
        for b in &mut self.batches {
            b.queue.clear();
        }
        if !keep_running {
            for s in &mut self.slots {
                s.cancelled = true;
            }
            self.cancel.cancel();
        }
        let e = self.event(Kind::Terminal(v1::RunTerminal {
            state: state as i32,
            outcome: self.run.outcome,
            reason,
        }));
        ev.run.push(e);
        ev.cloud.push(events::cloud(
            events::RUN_COMPLETED,
            &self.run,
            None,
            t,
            events::run_completed_data(&self.run),
        ));
        let decided = self.run.decision.is_some();
        self.commit(ev).await?;
        if decided {
            self.deps.crash.at(CrashPoint::AfterDecision);
        }
        trace::record_run_end(&self.span, &self.run);
        tracing::info!(
            run_id = %self.run.run_id,
            state = events::run_state_name(self.run.state),
            outcome = events::outcome_name(self.run.outcome),
            "run finished"
        );
        Ok(())
    }

    /// Files one approval request per proposed action above R1 of an accepted result.
    /// The level is the higher of the worker's and the catalog's: a worker can never
    /// talk an action down.
    async fn file_approvals(
        &mut self,
        decision: &v1::JoinDecision,
        ev: &mut Events,
    ) -> Vec<String> {
        let mut ids = Vec::new();
        let accepted: Vec<v1::TaskResult> = self
            .run
            .received
            .iter()
            .filter(|r| decision.accepted.contains(&r.delegation_id))
            .cloned()
            .collect();
        let mut seen = std::collections::BTreeSet::new();
        for result in accepted {
            if !seen.insert(result.delegation_id.clone()) {
                continue;
            }
            for (i, action) in result.proposed_actions.iter().enumerate() {
                let asked = RiskLevel::from_proto(action.risk_level);
                let risk = match self.deps.policy_file.risk_of(&action.action) {
                    Some(catalog) => asked.max(catalog),
                    None => asked,
                };
                if risk < RiskLevel::R2 {
                    continue;
                }
                let req = v1::RequestApprovalRequest {
                    action: action.action.clone(),
                    parameters: action.parameters.clone(),
                    risk_level: risk.to_proto() as i32,
                    idempotency_key: format!("{}/{}/{i}", self.run.run_id, result.delegation_id),
                    evidence_refs: action.evidence_refs.clone(),
                    expires_in: None,
                    run_id: self.run.run_id.clone(),
                    rationale: action.rationale.clone(),
                    on_behalf_of: self.run.principal.clone(),
                };
                // The request is idempotent (its key names the run, delegation and
                // action), so a transient failure — the approval service restarting, its
                // database busy — is retried rather than losing the request.
                let mut backoff = APPROVAL_RETRY_BACKOFF;
                let mut attempt = 1;
                let filed = loop {
                    let outcome = self
                        .deps
                        .approval
                        .request_approval(request(req.clone(), &self.deps.credential))
                        .await;
                    match outcome {
                        Err(s)
                            if attempt < APPROVAL_ATTEMPTS
                                && (status_is_transient(s.code())
                                    || s.code() == Code::DeadlineExceeded) =>
                        {
                            tracing::warn!(run_id = %self.run.run_id, action = %action.action, attempt, error = %s.message(), "approval request failed; retrying");
                            tokio::time::sleep(backoff).await;
                            backoff *= 2;
                            attempt += 1;
                        }
                        other => break other,
                    }
                };
                match filed {
                    Ok(r) => {
                        if let Some(a) = r.into_inner().approval {
                            ev.cloud.push(events::cloud(
                                events::APPROVAL_REQUESTED,
                                &self.run,
                                Some(&format!("approvals/{}", a.approval_id)),
                                now(),
                                serde_json::json!({
                                    "runId": self.run.run_id,
                                    "approvalId": a.approval_id,
                                    "action": a.action,
                                    "riskLevel": v1::RiskLevel::try_from(a.risk_level).map_or("RISK_LEVEL_UNSPECIFIED", |r| r.as_str_name()),
                                    "approvalsRequired": a.approvals_required,
                                    "delegationId": result.delegation_id,
                                }),
                            ));
                            ids.push(a.approval_id);
                        }
                    }
                    Err(s) => {
                        tracing::error!(run_id = %self.run.run_id, action = %action.action, error = %s.message(), "approval request could not be filed");
                        Arc::make_mut(&mut self.run).terminal_reason = format!(
                            "approval request for {} could not be filed: {}",
                            action.action,
                            s.message()
                        );
                    }
                }
            }
        }
        ids
    }

    /// A result arrived after the decision: discard it or append a revision, per the
    /// contract. The run's state never changes.
    fn late_revision(&mut self, ev: &mut Events, delegation_id: &str) {
        let Some(previous) = self.run.decision.clone() else {
            return;
        };
        let expected = self.expected();
        let input = JoinInput {
            contract: &self.spec.join,
            delegations: &expected,
            results: &self.run.received,
            evidence: &self.facts,
            now: now(),
        };
        let span = trace::join_span(&self.span, &self.spec.join, "late_result");
        let decision = span.in_scope(|| join::apply_late(&previous, &input, delegation_id));
        trace::record_decision(&span, &decision);
        if decision.revision != previous.revision {
            Arc::make_mut(&mut self.run)
                .revisions
                .push(decision.clone());
            ev.cloud.push(events::cloud(
                events::JOIN_DECIDED,
                &self.run,
                Some("decision"),
                now(),
                events::join_decided_data(&self.run, &decision),
            ));
            let e = self.event(Kind::Decision(decision.clone()));
            ev.run.push(e);
        }
        Arc::make_mut(&mut self.run).decision = Some(decision);
    }

    // ---- nested delegation ----------------------------------------------------------

    async fn on_delegate(
        &mut self,
        claims: &Claims,
        token: &str,
        children: Vec<v1::PlannedDelegation>,
        reply: oneshot::Sender<Result<Vec<v1::DelegateOutcome>, Status>>,
        caller: &Span,
    ) -> Result<(), StoreError> {
        let plan_span = trace::plan_span(caller, "delegate", children.len());
        let planned = self
            .plan_children(claims, token, &children, caller)
            .instrument(plan_span.clone())
            .await;
        match planned {
            Err(status) => {
                convene_telemetry::set_error(&plan_span, status.message().to_owned());
                let _ = reply.send(Err(status));
                Ok(())
            }
            Ok((indices, dropped_names, batch)) => {
                plan_span.record("convene.plan.dropped", dropped_names.len());
                let mut order = Vec::with_capacity(children.len());
                let mut kept = indices.iter();
                for c in &children {
                    if dropped_names.contains(&c.name) {
                        order.push((c.name.clone(), None));
                    } else {
                        order.push((c.name.clone(), kept.next().copied()));
                    }
                }
                self.pending.push(PendingDelegate {
                    children: order,
                    reply,
                });
                self.commit(Events::default()).await?;
                self.pump(batch);
                self.children_step();
                Ok(())
            }
        }
    }

    /// Checks a nested Delegate call and adds its children to the ledger; returns the
    /// kept children's ledger indices, the names TRUNCATE dropped, and the batch.
    async fn plan_children(
        &mut self,
        claims: &Claims,
        token: &str,
        children: &[v1::PlannedDelegation],
        caller: &Span,
    ) -> Result<(Vec<usize>, Vec<String>, usize), Status> {
        if self.terminal() {
            return Err(Status::failed_precondition(format!(
                "run {} has ended; report what you have",
                self.run.run_id
            )));
        }
        let Some(parent) = self.run.delegations.iter().position(|d| {
            d.task
                .as_ref()
                .is_some_and(|t| t.delegation_id == claims.delegation_id)
        }) else {
            return Err(Status::failed_precondition(format!(
                "delegation {} is not part of run {}",
                claims.delegation_id, self.run.run_id
            )));
        };
        if self.run.delegations[parent].result.is_some() || !self.slots[parent].in_flight {
            return Err(Status::failed_precondition(format!(
                "delegation {} is not running; only a running delegation may delegate",
                claims.delegation_id
            )));
        }
        if !claims.may_redelegate {
            return Err(Status::permission_denied(
                "your task token does not allow redelegation (may_redelegate = false): handle this task yourself",
            ));
        }
        let parent_task = self.run.delegations[parent]
            .task
            .clone()
            .unwrap_or_default();
        let depth = parent_task.depth + 1;
        limits::check_depth(depth, self.spec.limits.max_depth)
            .map_err(|e| Status::failed_precondition(e.to_string()))?;
        if children.is_empty() {
            return Err(Status::invalid_argument(
                "invalid delegations: give at least one child task",
            ));
        }
        self.ledger
            .check()
            .map_err(|e| Status::resource_exhausted(e.to_string()))?;
        let t = now();
        let mut planned = Vec::with_capacity(children.len());
        let mut names = std::collections::BTreeSet::new();
        for (i, c) in children.iter().enumerate() {
            let field = format!("delegations[{i}]");
            let p = validate::planned_task(c, &field)
                .map_err(|e| convene_server::invalid_field(&e.field, &e.message))?;
            if !self.deps.policy_file.profiles.contains_key(&p.profile_id) {
                return Err(convene_server::invalid_field(
                    &format!("{field}.profile_id"),
                    format!("unknown profile {}", p.profile_id),
                ));
            }
            if !names.insert(p.name.clone()) {
                return Err(convene_server::invalid_field(
                    &format!("{field}.name"),
                    format!("name {} is used twice in this call", p.name),
                ));
            }
            planned.push(p);
        }
        let plan = limits::plan_batch(
            children.len(),
            self.spec.limits.max_parallel_workers,
            self.spec.limits.overflow,
        )
        .map_err(|e| Status::resource_exhausted(e.to_string()))?;
        let parent_deadline = deadline_of(&parent_task);
        // A retried delegation repeats its Delegate calls: its call indices start again
        // at 0 with each attempt, so a repeated call derives the ids of the children the
        // earlier attempt created and finds them in the ledger (running or finished)
        // instead of creating and running them again.
        let attempt = self.slots[parent].attempts;
        if self.slots[parent].children_attempt != attempt {
            self.slots[parent].children_attempt = attempt;
            self.slots[parent].children = 0;
        }
        let first_index = self.slots[parent].children;
        // Per kept child, in call order: the ledger index of the child an earlier attempt
        // created (Ok), or the position of its task in `tasks` (Err): a new child, or a
        // dormant one (`revive`) that needs a token and a dispatch again.
        let mut kept: Vec<Result<usize, usize>> = Vec::with_capacity(children.len());
        let mut tasks = Vec::new();
        let mut revive: Vec<Option<usize>> = Vec::new();
        let mut repeated = false;
        let mut dropped_names = Vec::new();
        for (i, (p, wire)) in planned.iter().zip(children).enumerate() {
            if plan.dropped.contains(&i) {
                dropped_names.push(p.name.clone());
                continue;
            }
            #[allow(clippy::cast_possible_truncation)] // batches are capped far below u32
            let call_index = first_index + i as u32;
            let task = plan::task(
                p,
                wire,
                Placement {
                    run_id: &self.run.run_id,
                    parent: Some(&parent_task.delegation_id),
                    depth,
                    round: 0,
                    call_index,
                },
                &self.deps.policy_file,
                t,
                parent_deadline.min(self.spec.limits.deadline),
            );
            let existing = self.run.delegations.iter().position(|d| {
                d.task
                    .as_ref()
                    .is_some_and(|e| e.delegation_id == task.delegation_id)
            });
            match existing {
                Some(index) => {
                    let earlier = self.run.delegations[index].task.as_ref();
                    let same = earlier
                        .is_some_and(|e| e.name == task.name && e.profile_id == task.profile_id);
                    if !same {
                        // Fail closed, as for a conflicting duplicate result: the id is
                        // taken by another child.
                        return Err(Status::failed_precondition(format!(
                            "delegations[{i}]: call index {call_index} of delegation {} already \
                             addresses child {} ({}) from an earlier attempt; a retried \
                             delegation must repeat its Delegate calls in the same order",
                            parent_task.delegation_id,
                            earlier.map_or("", |e| e.name.as_str()),
                            earlier.map_or("", |e| e.profile_id.as_str()),
                        )));
                    }
                    repeated = true;
                    if self.slots[index].dormant {
                        kept.push(Err(tasks.len()));
                        tasks.push(self.run.delegations[index].task.clone().unwrap_or(task));
                        revive.push(Some(index));
                    } else {
                        kept.push(Ok(index));
                    }
                }
                None => {
                    kept.push(Err(tasks.len()));
                    tasks.push(task);
                    revive.push(None);
                }
            }
        }
        // Child tokens can only narrow the parent's; the policy service refuses wider.
        let tokens = self.issue_tokens(&tasks, Some(token)).await?;
        #[allow(clippy::cast_possible_truncation)]
        {
            self.slots[parent].children += children.len() as u32;
        }
        let batch = self.batches.len();
        self.batches.push(Batch {
            max_parallel: self.spec.limits.max_parallel_workers as usize,
            queue: VecDeque::new(),
            running: 0,
        });
        let mut created = Vec::with_capacity(tasks.len());
        for ((task, token), revived) in tasks.into_iter().zip(tokens).zip(revive) {
            // A child's span hangs under the call that asked for it, which is how its
            // parent delegation reached the supervisor.
            let span = trace::delegation_span(caller, &task);
            if let Some(index) = revived {
                // Asked for again after a restart: dispatched again under its own id.
                let slot = &mut self.slots[index];
                slot.dormant = false;
                slot.token = token;
                slot.batch = batch;
                slot.span = span;
                self.batches[batch].queue.push_back(index);
                created.push(index);
                continue;
            }
            let index = self.run.delegations.len();
            Arc::make_mut(&mut self.run)
                .delegations
                .push(v1::Delegation {
                    task: Some(task),
                    state: v1::DelegationState::Pending as i32,
                    ..Default::default()
                });
            self.slots.push(Slot {
                token,
                top_level: false,
                batch,
                in_flight: false,
                finished: false,
                dormant: false,
                attempts: 0,
                attempt_base: 0,
                workers: Vec::new(),
                children: 0,
                children_attempt: 0,
                cancelled: false,
                span,
            });
            self.batches[batch].queue.push_back(index);
            created.push(index);
        }
        let indices = kept
            .into_iter()
            .map(|k| k.unwrap_or_else(|position| created[position]))
            .collect();
        // A repeated call drops the same children again; they are recorded once.
        if !repeated {
            for name in &dropped_names {
                Arc::make_mut(&mut self.run).truncated.push(name.clone());
            }
        }
        Ok((indices, dropped_names, batch))
    }

    /// Answers Delegate calls whose children have all finished, in call order.
    fn children_step(&mut self) {
        let mut i = 0;
        while i < self.pending.len() {
            let done = self.pending[i].children.iter().all(|(_, idx)| {
                idx.is_none_or(|x| {
                    let d = &self.run.delegations[x];
                    d.result.is_some()
                        || matches!(
                            v1::DelegationState::try_from(d.state),
                            Ok(v1::DelegationState::Cancelled
                                | v1::DelegationState::Failed
                                | v1::DelegationState::TimedOut)
                        ) && !self.slots[x].in_flight
                })
            });
            if !done {
                i += 1;
                continue;
            }
            let p = self.pending.swap_remove(i);
            let outcomes = p
                .children
                .iter()
                .map(|(name, idx)| match idx {
                    None => v1::DelegateOutcome {
                        name: name.clone(),
                        dropped: true,
                        error: Some(v1::ErrorInfo {
                            code: "truncated".to_owned(),
                            retryable: false,
                            message: format!(
                                "dropped: the call asked for more than max_parallel_workers ({}) and overflow is TRUNCATE",
                                self.spec.limits.max_parallel_workers
                            ),
                        }),
                        ..Default::default()
                    },
                    Some(x) => {
                        let d = &self.run.delegations[*x];
                        v1::DelegateOutcome {
                            name: name.clone(),
                            delegation_id: d.task.as_ref().map(|t| t.delegation_id.clone()).unwrap_or_default(),
                            result: d.result.clone(),
                            error: d.result.is_none().then(|| v1::ErrorInfo {
                                code: "no_result".to_owned(),
                                retryable: false,
                                message: if d.detail.is_empty() {
                                    "the child delegation produced no result".to_owned()
                                } else {
                                    d.detail.clone()
                                },
                            }),
                            dropped: false,
                        }
                    }
                })
                .collect();
            let _ = p.reply.send(Ok(outcomes));
        }
    }

    /// Settles the nested children still waiting for a slot: once the budget is
    /// exhausted nothing starts again, so they never would. Their Delegate calls are
    /// answered as soon as their running siblings are done, rather than holding the
    /// delegating worker until its deadline. (Top-level delegations stay for the join,
    /// which ends the run on the exhausted budget.)
    fn settle_queued_children(&mut self, detail: &str) {
        let t = to_timestamp(now());
        for b in 0..self.batches.len() {
            let queued: Vec<usize> = self.batches[b]
                .queue
                .iter()
                .copied()
                .filter(|&i| !self.slots[i].top_level)
                .collect();
            if queued.is_empty() {
                continue;
            }
            self.batches[b].queue.retain(|i| !queued.contains(i));
            for i in queued {
                self.slots[i].finished = true;
                let d = &mut Arc::make_mut(&mut self.run).delegations[i];
                d.state = v1::DelegationState::Cancelled as i32;
                d.detail = detail.to_owned();
                d.completed_at = Some(t);
                self.end_delegation_span(i);
            }
        }
        self.children_step();
    }
}

/// The top-level delegations a new run starts with: those still pending (not dropped),
/// by index, with their tasks.
pub(crate) fn startable(run: &v1::Run) -> (Vec<usize>, Vec<v1::DelegationTask>) {
    run.delegations
        .iter()
        .enumerate()
        .filter(|(_, d)| d.state == v1::DelegationState::Pending as i32)
        .filter_map(|(i, d)| Some((i, d.task.clone()?)))
        .unzip()
}

/// Asks the policy service for one task token per task of `run`, in one call.
pub(crate) async fn issue_tokens(
    deps: &Deps,
    run: &v1::Run,
    max_depth: u32,
    tasks: &[v1::DelegationTask],
    parent_token: Option<&str>,
) -> Result<Vec<String>, Status> {
    if tasks.is_empty() {
        return Ok(Vec::new());
    }
    let t = now();
    let req = v1::IssueTaskTokenRequest {
        principal: run.principal.clone(),
        run_id: run.run_id.clone(),
        parent_token: parent_token.unwrap_or_default().to_owned(),
        grants: tasks
            .iter()
            .map(|task| plan::grant(task, max_depth, t))
            .collect(),
    };
    // The policy service may be restarting (a resumed run meets it right after a crash
    // of the mesh): transient failures are retried a few times, so they do not fail the
    // run.
    let mut attempt = 0;
    let tokens = loop {
        attempt += 1;
        match deps
            .policy
            .issue_task_token(request(req.clone(), &deps.credential))
            .await
        {
            Ok(r) => break r.into_inner().tokens,
            Err(s) if status_is_transient(s.code()) && attempt < TOKEN_ATTEMPTS => {
                tracing::warn!(run_id = %run.run_id, attempt, error = %s.message(), "task tokens could not be issued; retrying");
                tokio::time::sleep(
                    backoff(&deps.settings, attempt).max(Duration::from_millis(200)),
                )
                .await;
            }
            Err(s) => return Err(s),
        }
    };
    if tokens.len() != tasks.len() {
        return Err(Status::internal(format!(
            "policy returned {} tokens for {} delegations",
            tokens.len(),
            tasks.len()
        )));
    }
    Ok(tokens.into_iter().map(|t| t.token).collect())
}

/// Ends a stored run that cannot be resumed, as FAILED with `reason`, in one commit with
/// its events (there is no actor to do it).
async fn fail_stored(deps: Arc<Deps>, mut run: v1::Run, reason: String) {
    tracing::error!(run_id = %run.run_id, %reason, "the run cannot be resumed; it fails");
    let next = match deps.store.run_events(&run.run_id, 0).await {
        Ok(e) => e.last().map_or(1, |e| e.sequence + 1),
        Err(e) => {
            tracing::error!(run_id = %run.run_id, error = %e, "the run's events cannot be read");
            return;
        }
    };
    let t = now();
    run.state = v1::RunState::Failed as i32;
    run.terminal_reason = reason.clone();
    run.version += 1;
    run.updated_at = Some(to_timestamp(t));
    let events = Events {
        run: vec![v1::RunEvent {
            sequence: next,
            run_id: run.run_id.clone(),
            time: Some(to_timestamp(t)),
            kind: Some(Kind::Terminal(v1::RunTerminal {
                state: run.state,
                outcome: run.outcome,
                reason,
            })),
        }],
        cloud: vec![events::cloud(
            events::RUN_COMPLETED,
            &run,
            None,
            t,
            events::run_completed_data(&run),
        )],
    };
    if let Err(e) = deps.store.commit(&run, &events).await {
        tracing::error!(run_id = %run.run_id, error = %e, "the failed run could not be stored");
    }
}

async fn sleep_until(t: Option<SystemTime>) {
    match t {
        None => std::future::pending::<()>().await,
        Some(t) => {
            let d = t.duration_since(now()).unwrap_or_default();
            tokio::time::sleep(d).await;
        }
    }
}

struct Dispatch {
    registry: Arc<Registry>,
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
}

impl Dispatch {
    /// Tells the run how this attempt ended.
    fn report(&self, worker_id: Option<String>, outcome: Result<v1::TaskResult, Status>) {
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
    let deadline = deadline_of(&d.task);
    let waited = Box::pin(wait_for_worker(
        &d.registry,
        &d.task.profile_id,
        &d.avoid,
        deadline,
        d.delay,
        &d.cancel,
    ))
    .await;
    let lease = match waited {
        Ok(lease) => lease,
        Err(status) => return d.report(None, Err(status)),
    };
    let worker_id = lease.worker_id.clone();
    let _ = d.tx.send(Msg::Dispatched {
        index: d.index,
        worker_id: worker_id.clone(),
        attempt: d.attempt,
    });
    let limit = deadline.duration_since(now()).unwrap_or_default() + d.grace;
    let call = {
        let task = std::mem::take(&mut d.task);
        let mut req = Request::new(v1::WorkerExecuteRequest {
            task: Some(task),
            task_token: std::mem::take(&mut d.token),
            attempt: d.attempt,
        });
        req.set_timeout(limit);
        tokio::time::timeout(limit, lease.handle.execute(req))
    };
    let answered = tokio::select! {
        r = call => Some(match r {
            Ok(Ok(resp)) => resp
                .into_inner()
                .result
                .ok_or_else(|| Status::internal("the worker answered without a result")),
            Ok(Err(status)) => Err(status),
            Err(_) => Err(Status::deadline_exceeded("the worker did not answer before the delegation's deadline")),
        }),
        () = d.cancel.cancelled() => None,
    };
    let outcome = match answered {
        Some(outcome) => outcome,
        None => {
            Box::pin(cancel_at_worker(&lease, &d.delegation_id)).await;
            Err(cancelled())
        }
    };
    drop(lease);
    d.report(Some(worker_id), outcome);
}

/// Waits `delay`, then for a free slot at a live worker serving `profile_id` (not one
/// of `avoid` when another has room) until `deadline`; the error is the delegation's
/// outcome.
async fn wait_for_worker(
    registry: &Arc<Registry>,
    profile_id: &str,
    avoid: &[String],
    deadline: SystemTime,
    delay: Duration,
    cancel: &CancellationToken,
) -> Result<crate::registry::Lease, Status> {
    if !delay.is_zero() {
        tokio::select! {
            () = tokio::time::sleep(delay) => {}
            () = cancel.cancelled() => return Err(cancelled()),
        }
    }
    loop {
        if let Some(lease) = registry.acquire(profile_id, avoid) {
            return Ok(lease);
        }
        let wait = deadline.duration_since(now()).unwrap_or_default();
        if wait.is_zero() {
            return Err(Status::not_found(format!(
                "no live worker serving profile {profile_id} had a free slot before the delegation's deadline"
            )));
        }
        tokio::select! {
            () = registry.changed() => {}
            () = tokio::time::sleep(Duration::from_millis(200).min(wait)) => {}
            () = cancel.cancelled() => return Err(cancelled()),
        }
    }
}

/// The outcome of a dispatch cancelled with its run.
fn cancelled() -> Status {
    Status::cancelled("the delegation was cancelled")
}

/// Tells the worker holding `lease` to stop delegation `delegation_id`, waiting at most
/// two seconds for it to acknowledge.
async fn cancel_at_worker(lease: &crate::registry::Lease, delegation_id: &str) {
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

/// Overflow as recorded for TRUNCATE at the top level (used by the service).
pub(crate) fn truncated_detail(limit: u32, overflow: Overflow) -> String {
    format!(
        "dropped: the plan is wider than max_parallel_workers ({limit}) and overflow is {overflow:?}"
    )
}

/// What one `VerifyChain` call for the `staged` results asks: every evidence id they cite
/// that `known` has no fact for, once each (result by result), and the token of the first
/// staged delegation that has one. None when there is nothing to ask or no token to ask
/// with.
fn chain_ask<'a>(
    staged: &[(usize, BTreeSet<String>)],
    known: &BTreeMap<String, EvidenceFact>,
    token_of: impl Fn(usize) -> &'a str,
) -> Option<(String, Vec<String>)> {
    let mut seen = BTreeSet::new();
    let ids: Vec<String> = staged
        .iter()
        .flat_map(|(_, cited)| cited)
        .filter(|id| !known.contains_key(*id) && seen.insert(*id))
        .cloned()
        .collect();
    let token = staged
        .iter()
        .map(|(index, _)| token_of(*index))
        .find(|t| !t.is_empty())?;
    (!ids.is_empty()).then(|| (token.to_owned(), ids))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cited(ids: &[&str]) -> BTreeSet<String> {
        ids.iter().map(|s| (*s).to_owned()).collect()
    }

    #[test]
    fn results_taken_together_are_verified_in_one_ask() {
        let tokens = ["", "token-b", "token-c"];
        let staged = vec![
            (0, cited(&["ev://logs/1"])),
            (1, cited(&["ev://logs/1", "ev://metrics/2"])),
            (2, cited(&["ev://changes/3", "ev://known/4"])),
        ];
        let known = BTreeMap::from([("ev://known/4".to_owned(), EvidenceFact::Unknown)]);
        let (token, ids) = chain_ask(&staged, &known, |i| tokens[i]).expect("an ask");
        // The first delegation without a token is passed over; the run's tenant is the
        // same whichever of its tokens asks.
        assert_eq!(token, "token-b");
        // Every id once, none already known.
        assert_eq!(ids, ["ev://logs/1", "ev://metrics/2", "ev://changes/3"]);
    }

    #[test]
    fn nothing_is_asked_without_new_ids_or_a_token() {
        let known = BTreeMap::from([("ev://a".to_owned(), EvidenceFact::ArtifactMissing)]);
        let staged = vec![(0, cited(&["ev://a"])), (1, cited(&[]))];
        assert_eq!(chain_ask(&staged, &known, |_| "token"), None);
        let staged = vec![(0, cited(&["ev://b"]))];
        assert_eq!(chain_ask(&staged, &known, |_| ""), None);
        assert_eq!(chain_ask(&[], &known, |_| "token"), None);
    }
}
