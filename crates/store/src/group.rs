//! Group commit: the write transactions of one process share physical transactions.
//!
//! A durable commit costs one WAL fsync (SQLite with `synchronous = FULL`) or one WAL
//! flush (PostgreSQL), whatever it holds. Writers take turns anyway — SQLite has one
//! write lock, and convene's stores order their appends — so instead of paying that cost
//! per logical transaction, the writers that queue up behind each other share one:
//!
//! - The writer whose turn it is opens the physical transaction if none is open and runs
//!   its statements in it — inside a savepoint when earlier writers' changes are in it
//!   already (the first writer of a batch needs none: its rollback is the transaction's).
//! - Its commit releases the savepoint. When another writer is already waiting for its
//!   turn (and the batch is not full), it hands the open transaction over and waits;
//!   otherwise it commits the physical transaction and tells every writer of the batch.
//! - A rollback (or a transaction dropped without commit) rolls back to its savepoint:
//!   the batch's other writers keep their changes.
//! - No writer hears "committed" before the physical commit succeeded; when it fails,
//!   every writer of the batch gets the error and nothing of the batch is kept.
//!
//! A writer alone (no queue) commits at once, exactly as without batching, so this adds
//! no latency; under load, one fsync covers a batch of commits. The hand-over and the
//! physical commit run in spawned tasks, so a caller that stops waiting (a cancelled
//! request) can neither strand an open batch nor leave a commit half done.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use sqlx::{Postgres, Transaction};
use tokio::sync::{Mutex, OwnedMutexGuard, oneshot};

use crate::Error;
use crate::sqlite::WriterTx;

/// Logical transactions one physical transaction holds at most, so one batch cannot
/// keep other processes sharing the database from writing for long.
const MAX_BATCH: usize = 256;

/// How often a batch left open with nobody to end it is looked for. A batch is handed
/// over only to a writer already queued for its turn; one that is cancelled before it
/// takes the turn leaves the batch open — holding SQLite's write lock, and its writers
/// waiting — until the next writer comes, or this check commits it.
const ORPHAN_CHECK: Duration = Duration::from_millis(50);

/// The open physical transaction.
pub(crate) enum Physical {
    Sqlite(WriterTx),
    Postgres(Transaction<'static, Postgres>),
}

impl Physical {
    async fn run(&mut self, statement: &'static str) -> Result<(), Error> {
        match self {
            Physical::Sqlite(tx) => tx.run(statement),
            Physical::Postgres(tx) => {
                Ok(sqlx::query(statement).execute(&mut **tx).await.map(drop)?)
            }
        }
    }

    async fn commit(self) -> Result<(), Error> {
        match self {
            Physical::Sqlite(tx) => tx.commit().await,
            Physical::Postgres(tx) => Ok(tx.commit().await?),
        }
    }

    async fn rollback(self) -> Result<(), Error> {
        match self {
            Physical::Sqlite(tx) => tx.rollback(),
            Physical::Postgres(tx) => Ok(tx.rollback().await?),
        }
    }
}

/// What the writer whose turn it is may use.
pub(crate) struct Batch {
    /// The physical transaction, when one is open.
    pub(crate) physical: Option<Physical>,
    /// The writers whose savepoints were released into the open transaction.
    waiters: Vec<oneshot::Sender<Result<(), Arc<str>>>>,
}

/// The turn and the queue of a database's writers.
pub(crate) struct Group {
    turn: Arc<Mutex<Batch>>,
    /// Writers waiting for their turn.
    queued: AtomicUsize,
    /// Logical transactions committed, and the physical commits that carried them.
    logical: AtomicU64,
    physical: AtomicU64,
}

/// A writer's turn: the batch, with its savepoint open when it has one.
pub(crate) struct Turn {
    pub(crate) batch: OwnedMutexGuard<Batch>,
    /// Whether the writer runs in a savepoint; false for the first writer of a batch.
    savepoint: bool,
}

/// Counts a writer as queued until it has its turn or gave up waiting.
struct Queued<'a>(&'a AtomicUsize);

impl Drop for Queued<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// How a writer's turn ends.
enum End {
    Commit(oneshot::Sender<Result<(), Arc<str>>>),
    Rollback(oneshot::Sender<Result<(), Arc<str>>>),
    Abandon,
}

impl Group {
    /// A new group, and the task that commits batches left without a writer (it stops
    /// when the group is dropped). Must be called inside a Tokio runtime.
    ///
    /// `idle` runs on the same check while no writer has the turn and no batch is open:
    /// the back end's chance to end a transaction a cancelled begin left behind.
    pub(crate) fn new(idle: Option<Box<dyn Fn() + Send + Sync>>) -> Arc<Self> {
        let group = Self::unwatched();
        tokio::spawn(watch_orphans(Arc::downgrade(&group), idle));
        group
    }

    fn unwatched() -> Arc<Self> {
        Arc::new(Self {
            turn: Arc::new(Mutex::new(Batch {
                physical: None,
                waiters: Vec::new(),
            })),
            queued: AtomicUsize::new(0),
            logical: AtomicU64::new(0),
            physical: AtomicU64::new(0),
        })
    }

    /// Logical transactions committed so far, and the physical commits that held them.
    pub(crate) fn commits(&self) -> (u64, u64) {
        (
            self.logical.load(Ordering::Relaxed),
            self.physical.load(Ordering::Relaxed),
        )
    }

    /// Waits for this writer's turn, opens the physical transaction with `open` when
    /// none is open, and a savepoint for the writer in it.
    pub(crate) async fn begin<F, Fut>(self: &Arc<Self>, open: F) -> Result<Turn, Error>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<Physical, Error>>,
    {
        let mut batch = {
            self.queued.fetch_add(1, Ordering::SeqCst);
            let _queued = Queued(&self.queued);
            self.turn.clone().lock_owned().await
        };
        let first = batch.physical.is_none();
        if first {
            batch.physical = Some(open().await?);
        } else {
            let physical = batch.physical.as_mut().expect("checked above");
            if let Err(e) = physical.run("SAVEPOINT convene_writer").await {
                let message: Arc<str> = e.to_string().into();
                abort(&mut batch, &message).await;
                return Err(e);
            }
        }
        Ok(Turn {
            batch,
            savepoint: !first,
        })
    }

    /// Ends a turn with a commit: Ok once the physical transaction holding the writer's
    /// changes committed.
    pub(crate) async fn commit(self: &Arc<Self>, turn: Turn) -> Result<(), Error> {
        let (tx, rx) = oneshot::channel();
        tokio::spawn(
            self.clone()
                .end(turn.batch, turn.savepoint, End::Commit(tx)),
        );
        self.outcome(rx).await
    }

    /// Ends a turn with a rollback of the writer's changes (the batch goes on).
    pub(crate) async fn rollback(self: &Arc<Self>, turn: Turn) -> Result<(), Error> {
        let (tx, rx) = oneshot::channel();
        tokio::spawn(
            self.clone()
                .end(turn.batch, turn.savepoint, End::Rollback(tx)),
        );
        rx.await
            .map_err(|_| abandoned())
            .and_then(|r| r.map_err(batch_error))
    }

    /// Ends a turn that was dropped without commit or rollback: its changes are rolled
    /// back. Must be called inside a Tokio runtime.
    pub(crate) fn abandon(self: &Arc<Self>, mut turn: Turn) {
        if !turn.savepoint {
            // The batch's first writer: its changes are all the transaction holds, and
            // dropping the driver's transaction rolls it back and returns the connection
            // to the pool, here and now (no task that a stopping runtime might never run).
            turn.batch.physical = None;
            return;
        }
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(self.clone().end(turn.batch, turn.savepoint, End::Abandon));
        } else {
            // No runtime left (the process is ending): drop the whole batch, which the
            // driver rolls back; its writers hear that it was abandoned.
            turn.batch.physical = None;
            turn.batch.waiters.clear();
        }
    }

    async fn end(self: Arc<Self>, mut batch: OwnedMutexGuard<Batch>, savepoint: bool, end: End) {
        let Some(physical) = batch.physical.as_mut() else {
            // The batch was aborted under this writer: it was told already.
            return;
        };
        if !savepoint && !matches!(end, End::Commit(_)) {
            // The batch's first writer: its changes are all the transaction holds.
            let undone = match batch.physical.take() {
                Some(physical) => physical.rollback().await,
                None => Ok(()),
            };
            if let End::Rollback(reply) = end {
                let _ = reply.send(undone.map_err(|e| Arc::<str>::from(e.to_string())));
            }
            return;
        }
        match end {
            End::Commit(reply) if !savepoint => batch.waiters.push(reply),
            End::Commit(reply) => match physical.run("RELEASE SAVEPOINT convene_writer").await {
                Ok(()) => batch.waiters.push(reply),
                Err(e) => {
                    let message: Arc<str> = e.to_string().into();
                    let _ = reply.send(Err(message.clone()));
                    abort(&mut batch, &message).await;
                    return;
                }
            },
            End::Rollback(_) | End::Abandon => {
                let undone = match physical.run("ROLLBACK TO SAVEPOINT convene_writer").await {
                    Ok(()) => physical.run("RELEASE SAVEPOINT convene_writer").await,
                    Err(e) => Err(e),
                };
                if let Err(e) = undone {
                    // The physical transaction is gone (SQLite rolls back the whole
                    // transaction on some errors): nothing of the batch survived.
                    let message: Arc<str> = e.to_string().into();
                    if let End::Rollback(reply) = end {
                        let _ = reply.send(Err(message.clone()));
                    }
                    abort(&mut batch, &message).await;
                    return;
                }
                if let End::Rollback(reply) = end {
                    let _ = reply.send(Ok(()));
                }
            }
        }
        if self.queued.load(Ordering::SeqCst) > 0 && batch.waiters.len() < MAX_BATCH {
            // The next writer continues in this transaction and commits it, or hands it
            // on in turn.
            return;
        }
        self.flush(&mut batch).await;
    }

    /// Commits the open physical transaction and tells its writers.
    async fn flush(&self, batch: &mut Batch) {
        let Some(physical) = batch.physical.take() else {
            return;
        };
        let outcome = physical
            .commit()
            .await
            .map_err(|e| Arc::<str>::from(e.to_string()));
        if outcome.is_ok() {
            self.physical.fetch_add(1, Ordering::Relaxed);
            self.logical
                .fetch_add(batch.waiters.len() as u64, Ordering::Relaxed);
        }
        for waiter in batch.waiters.drain(..) {
            let _ = waiter.send(outcome.clone());
        }
    }

    /// Waits for the commit of the batch the writer joined.
    async fn outcome(&self, rx: oneshot::Receiver<Result<(), Arc<str>>>) -> Result<(), Error> {
        rx.await
            .map_err(|_| abandoned())
            .and_then(|r| r.map_err(batch_error))
    }
}

/// Commits, every [`ORPHAN_CHECK`], a batch that is open while no writer has the turn
/// (and runs `idle` when none is open).
async fn watch_orphans(group: std::sync::Weak<Group>, idle: Option<Box<dyn Fn() + Send + Sync>>) {
    let mut tick = tokio::time::interval(ORPHAN_CHECK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let Some(group) = group.upgrade() else {
            return;
        };
        // A turn that is taken, or promised to a queued writer, is not orphaned.
        let Ok(mut batch) = group.turn.clone().try_lock_owned() else {
            continue;
        };
        if batch.physical.is_some() {
            group.flush(&mut batch).await;
        } else if let Some(idle) = &idle {
            idle();
        }
    }
}

/// Rolls back the open physical transaction after a failure that broke it; its writers
/// hear `message`.
async fn abort(batch: &mut Batch, message: &Arc<str>) {
    if let Some(physical) = batch.physical.take() {
        // Failing here too means the database rolled it back already.
        let _ = physical.rollback().await;
    }
    for waiter in batch.waiters.drain(..) {
        let _ = waiter.send(Err(message.clone()));
    }
}

fn batch_error(message: Arc<str>) -> Error {
    Error::Commit(message.to_string())
}

fn abandoned() -> Error {
    Error::Commit("the database writer stopped before committing".to_owned())
}
