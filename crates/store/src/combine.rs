//! Combined writes: one task runs the write jobs of a process one after another in a
//! shared transaction.
//!
//! Group commit ([`crate::group`]) lets writers share a physical commit, but each
//! writer's turn still starts with its own task being woken and scheduled. Under load,
//! when every Tokio worker is busy, that wake-up takes longer than the writer's
//! statements, and the turn — which nobody else may use meanwhile — sits idle. A job
//! given to [`Database::write`](crate::Database::write) instead runs in the combining
//! task itself: the task takes the turn once, runs every job that is queued (each in a
//! savepoint of its own, so a failed job undoes only itself), commits them together and
//! tells each caller. A caller is woken once, when its job's commit is on disk (or its
//! job failed).
//!
//! The first job of a transaction runs without a savepoint: nothing else is in the
//! transaction yet, so when that job fails, rolling the whole transaction back undoes it
//! alone, and the jobs queued behind it start a new one. A savepoint costs two statements
//! and a copy of every page the job changes, and when writes are few — one run at a
//! time — most jobs are the first of their transaction.
//!
//! Jobs are run in the order they were given. A job runs to its end even when its caller
//! stops waiting, so a write that was asked for is never left half done. A job that
//! panics fails alone: its caller hears that the writer stopped, the others go on.

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};

use futures::FutureExt as _;
use tokio::sync::{mpsc, oneshot};

use crate::Error;
use crate::database::{Database, Tx};
use crate::statement::sql;

/// Jobs one shared transaction runs at most, so that one commit stays short and other
/// processes sharing the database get their turn.
const MAX_JOBS: usize = 256;

/// A future borrowing the transaction it writes in.
pub type WriteFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// Tells a job's caller the outcome of the commit that carried the job.
type Tell = Box<dyn FnOnce(Result<(), Arc<str>>) + Send>;

/// Runs a job in the shared transaction.
type Run = Box<dyn for<'a> FnOnce(&'a mut Tx) -> WriteFuture<'a, Ran> + Send>;

/// How a job ended: whether to keep its changes, and how to tell its caller once the
/// commit's outcome is known.
struct Ran {
    keep: bool,
    tell: Tell,
}

/// A queued write: the job, and how to tell its caller it could not run.
struct Job {
    run: Run,
    fail: Box<dyn FnOnce(Arc<str>) + Send>,
}

/// The queue of a database's combined writes.
pub(crate) struct Combiner {
    jobs: mpsc::UnboundedSender<Job>,
}

impl Combiner {
    /// The queue, and the task that runs it on `db` (it stops when the queue is
    /// dropped). Must be called inside a Tokio runtime.
    pub(crate) fn start(db: Database) -> Self {
        let (jobs, queue) = mpsc::unbounded_channel();
        tokio::spawn(combine(db, queue));
        Self { jobs }
    }

    /// Queues `job` and waits for its outcome: its value once its changes are
    /// committed, or its error (nothing of it kept).
    pub(crate) async fn write<T, E, F>(&self, job: F) -> Result<T, E>
    where
        F: for<'a> FnOnce(&'a mut Tx) -> WriteFuture<'a, Result<T, E>> + Send + 'static,
        T: Send + 'static,
        E: From<Error> + Send + 'static,
    {
        let (reply, outcome) = oneshot::channel::<Result<T, E>>();
        // Whoever ends the job first answers: the job when it ran, or the combiner when
        // it could not run it.
        let reply = Arc::new(Mutex::new(Some(reply)));
        let answer = move |reply: &Mutex<Option<oneshot::Sender<Result<T, E>>>>,
                           outcome: Result<T, E>| {
            let sender = reply.lock().unwrap_or_else(PoisonError::into_inner).take();
            if let Some(sender) = sender {
                let _ = sender.send(outcome);
            }
        };
        let failed = reply.clone();
        let job = Job {
            run: Box::new(move |tx: &mut Tx| {
                Box::pin(async move {
                    match job(tx).await {
                        Ok(value) => Ran {
                            keep: true,
                            tell: Box::new(move |committed: Result<(), Arc<str>>| {
                                let outcome = committed
                                    .map(|()| value)
                                    .map_err(|m| E::from(Error::Commit(m.to_string())));
                                answer(&reply, outcome);
                            }),
                        },
                        Err(e) => Ran {
                            keep: false,
                            tell: Box::new(move |_| answer(&reply, Err(e))),
                        },
                    }
                })
            }),
            fail: Box::new(move |message: Arc<str>| {
                answer(&failed, Err(E::from(Error::Commit(message.to_string()))));
            }),
        };
        if self.jobs.send(job).is_err() {
            return Err(E::from(stopped()));
        }
        outcome.await.unwrap_or_else(|_| Err(E::from(stopped())))
    }
}

fn stopped() -> Error {
    Error::Commit("the database writer stopped before the write was committed".to_owned())
}

async fn combine(db: Database, mut queue: mpsc::UnboundedReceiver<Job>) {
    'batches: while let Some(first) = queue.recv().await {
        let mut tx = match db.begin().await {
            Ok(tx) => tx,
            Err(e) => {
                // Nothing began: this job and every one queued behind it fail alike.
                let message: Arc<str> = e.to_string().into();
                (first.fail)(message.clone());
                while let Ok(job) = queue.try_recv() {
                    (job.fail)(message.clone());
                }
                continue;
            }
        };
        let mut kept: Vec<Tell> = Vec::new();
        let mut next = Some(first);
        let mut broken: Option<Arc<str>> = None;
        // Whether a job ran in the transaction already: every job after the first runs
        // in a savepoint.
        let mut guarded = false;
        while let Some(job) = next.take().or_else(|| {
            (kept.len() < MAX_JOBS)
                .then(|| queue.try_recv().ok())
                .flatten()
        }) {
            if guarded && let Err(e) = tx.execute(sql("SAVEPOINT convene_job")).await {
                let message: Arc<str> = e.to_string().into();
                (job.fail)(message.clone());
                broken = Some(message);
                break;
            }
            let Job { run, fail } = job;
            let ran = AssertUnwindSafe(run(&mut tx)).catch_unwind().await;
            let (keep, tell) = match ran {
                Ok(Ran { keep, tell }) => (keep, Some(tell)),
                Err(_) => {
                    fail("the write panicked; nothing of it was kept".into());
                    (false, None)
                }
            };
            if !guarded {
                guarded = true;
                match (keep, tell) {
                    (true, Some(tell)) => kept.push(tell),
                    (_, tell) => {
                        // The transaction holds this job's changes alone: undo them
                        // with it, and let the jobs behind it begin another.
                        let _ = tx.rollback().await;
                        if let Some(tell) = tell {
                            tell(Ok(()));
                        }
                        continue 'batches;
                    }
                }
                continue;
            }
            let ended = if keep {
                tx.execute(sql("RELEASE SAVEPOINT convene_job")).await
            } else {
                match tx.execute(sql("ROLLBACK TO SAVEPOINT convene_job")).await {
                    Ok(_) => tx.execute(sql("RELEASE SAVEPOINT convene_job")).await,
                    Err(e) => Err(e),
                }
            };
            if let Err(e) = ended {
                // The transaction is gone (SQLite ends it on some errors): nothing of
                // this batch survived.
                let message: Arc<str> = e.to_string().into();
                if let Some(tell) = tell {
                    tell(Err(message.clone()));
                }
                broken = Some(message);
                break;
            }
            match (keep, tell) {
                (true, Some(tell)) => kept.push(tell),
                (false, Some(tell)) => tell(Ok(())),
                (_, None) => {}
            }
        }
        let outcome = match broken {
            Some(message) => {
                let _ = tx.rollback().await;
                Err(message)
            }
            None => tx
                .commit()
                .await
                .map_err(|e| Arc::<str>::from(e.to_string())),
        };
        for tell in kept {
            tell(outcome.clone());
        }
    }
}
