//! [`SqlRunStore`]: runs, their events and the CloudEvents outbox in SQLite or
//! PostgreSQL (see `convene_store`).
//!
//! Every change is one transaction: a commit checks the version it read, rewrites the
//! run, and appends the run events, the outbox events, a ledger row for every delegation
//! whose state changed and a row for every new join decision revision, all or nothing.
//! A commit against a stale version leaves nothing behind.
//!
//! On PostgreSQL every writing transaction first takes one transaction-scoped advisory
//! lock, so event ids and outbox positions are assigned in commit order: a reader that
//! resumes after position `p` can never miss an event committed later with a smaller
//! position. SQLite has a single writer anyway. A store that leases runs lets none of its
//! PostgreSQL transactions sit idle for longer than the lease, so a replica that stalls
//! mid-write never holds the other replicas up for longer than its runs stay its own.
//!
//! A commit needs the run as it was last committed, to know which delegations changed
//! state and which decisions are new. The store remembers that much of each unfinished
//! run it committed itself ([`Last`]), so a commit is one conditional `UPDATE` plus the
//! appends; only a run it has not committed yet (or whose remembered version is not
//! the one being replaced) is read first. The `UPDATE` checks the version and the lease
//! either way, so a stale memory can only cost a refused commit, never a wrong one.
//!
//! Subscribers hear of commits made through this store at once; a background poll of
//! the event tables every [`POLL_INTERVAL`] tells them about commits of other processes
//! sharing the database (other supervisor replicas).
//!
//! The store's code is split by concern: this module holds the store, its memory of
//! the runs it committed and the [`RunStore`] implementation; `commit` writes runs and
//! what a commit appends, `read` reads runs (pages of them through the filters of
//! ListRuns) and their events, `labels` keeps the rows of run labels those filters read,
//! `leases` claims, renews and releases runs, `commands` keeps the commands for runs,
//! `events` watches the event tables for other processes' commits and keeps the relay's
//! cursor, and `rows` decodes stored rows.

mod commands;
mod commit;
mod events;
mod labels;
mod leases;
mod read;
mod rows;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use convene_proto::v1;
use convene_store::time::from_micros;
use convene_store::{Backend, Database, Statement, Tx, sql};
use tokio::sync::broadcast;

use self::commit::latest_revision;
use self::events::{ends, poll};
use self::rows::{decode, narrow};
use crate::store::{
    CommandDone, Committed, Created, Events, IdempotencyKey, Page, RunCommand, RunFilter, RunStore,
    StoreError, is_terminal,
};

/// How often other processes' commits are looked for.
pub const POLL_INTERVAL: Duration = Duration::from_millis(150);

/// Unfinished runs whose [`Last`] a store remembers at most; past that it forgets them
/// all (their next commits read the run first), so runs abandoned mid-way (a lost
/// lease) cannot grow it without bound.
const REMEMBERED_RUNS: usize = 200_000;

/// The advisory lock that orders writers on PostgreSQL ("convene" in ASCII).
const APPEND_LOCK: i64 = 0x0063_6f6e_7665_6e65;

impl From<convene_store::Error> for StoreError {
    fn from(e: convene_store::Error) -> Self {
        StoreError::Backend(e.to_string())
    }
}

/// Runs in a SQL database. See the [module docs](self).
pub struct SqlRunStore {
    db: Database,
    notify: broadcast::Sender<Committed>,
    /// Runs this store creates are leased to this replica, for this long.
    creator: Option<(String, Duration)>,
    poller: tokio::task::JoinHandle<()>,
    /// What the next commit of each unfinished run needs of its last commit through
    /// this store.
    last: Mutex<HashMap<String, Last>>,
}

/// Of a run as committed: what the next commit compares against.
#[derive(Debug, Clone)]
struct Last {
    version: u64,
    /// Each delegation's state, by delegation id.
    states: HashMap<String, i32>,
    /// The latest join decision revision (0: none).
    revision: u32,
}

impl Last {
    fn of(run: &v1::Run) -> Self {
        Self {
            version: run.version,
            states: run
                .delegations
                .iter()
                .filter_map(|d| Some((d.task.as_ref()?.delegation_id.clone(), d.state)))
                .collect(),
            revision: latest_revision(run),
        }
    }
}

impl std::fmt::Debug for SqlRunStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqlRunStore")
            .field("db", &self.db)
            .field("creator", &self.creator)
            .finish_non_exhaustive()
    }
}

impl Drop for SqlRunStore {
    fn drop(&mut self) {
        self.poller.abort();
    }
}

/// One row of the delegation ledger: a delegation's state as of a run version.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LedgerEntry {
    /// The delegation.
    pub delegation_id: String,
    /// The run version whose commit made this transition.
    pub run_version: u64,
    /// The new state (`v1::DelegationState`).
    pub state: i32,
    /// The delegating parent, for nested delegations (empty at the top level).
    pub parent_delegation_id: String,
    /// The profile it runs under.
    pub profile_id: String,
    /// The worker it was last dispatched to.
    pub worker_id: String,
    /// Dispatch attempts so far.
    pub attempts: u32,
    /// When the transition was recorded (the run's update time).
    pub recorded_at: SystemTime,
}

impl SqlRunStore {
    /// A store over `db` (migrated already, as [`Database::connect`] leaves it). Must be
    /// called inside a Tokio runtime: it starts the poll that reports other processes'
    /// commits to subscribers, from the current end of the event tables.
    ///
    /// The first open after the migration that added `run_labels` copies the labels of
    /// the runs stored before it into that table, so ListRuns' label filter finds them.
    ///
    /// # Errors
    ///
    /// [`StoreError::Backend`] when the database cannot be read or written.
    pub async fn open(db: Database) -> Result<Self, StoreError> {
        let copied = labels::backfill(&db).await?;
        if copied > 0 {
            tracing::info!(
                runs = copied,
                "labels of runs stored before run_labels copied"
            );
        }
        let (events_after, outbox_after) = ends(&db).await?;
        let notify = broadcast::channel(4096).0;
        let poller = tokio::spawn(poll(db.clone(), notify.clone(), events_after, outbox_after));
        Ok(Self {
            db,
            notify,
            creator: None,
            poller,
            last: Mutex::new(HashMap::new()),
        })
    }

    /// Leases every run this store creates to the supervisor replica `owner` for
    /// `lease_ttl`, so other replicas' [`RunStore::claim_runs`] leave it alone while
    /// `owner` renews the lease.
    #[must_use]
    pub fn with_owner(mut self, owner: impl Into<String>, lease_ttl: Duration) -> Self {
        self.creator = Some((owner.into(), lease_ttl));
        self
    }

    /// The database underneath.
    pub fn database(&self) -> &Database {
        &self.db
    }

    /// The delegation ledger of a run: every state transition, in run-version order.
    ///
    /// # Errors
    ///
    /// [`StoreError::Backend`] when the database cannot be read.
    pub async fn ledger(&self, run_id: &str) -> Result<Vec<LedgerEntry>, StoreError> {
        let rows = self
            .db
            .fetch_all(
                sql("SELECT * FROM delegation_ledger WHERE run_id = $1 \
                     ORDER BY run_version, delegation_id")
                .bind(run_id),
            )
            .await?;
        rows.iter()
            .map(|r| {
                Ok(LedgerEntry {
                    delegation_id: r.get("delegation_id")?,
                    run_version: r.get_u64("run_version")?,
                    state: narrow(r.get("state")?, "delegation_ledger.state")?,
                    parent_delegation_id: r.get("parent_delegation_id")?,
                    profile_id: r.get("profile_id")?,
                    worker_id: r.get("worker_id")?,
                    attempts: narrow(r.get("attempts")?, "delegation_ledger.attempts")?,
                    recorded_at: from_micros(r.get("recorded_at")?),
                })
            })
            .collect()
    }

    /// Every join decision revision of a run, oldest first.
    ///
    /// # Errors
    ///
    /// [`StoreError::Backend`] when the database cannot be read or holds a record that
    /// does not decode.
    pub async fn decisions(&self, run_id: &str) -> Result<Vec<v1::JoinDecision>, StoreError> {
        let rows = self
            .db
            .fetch_all(
                sql("SELECT body FROM join_decisions WHERE run_id = $1 ORDER BY revision")
                    .bind(run_id),
            )
            .await?;
        rows.iter().map(|r| decode(r, "join_decisions")).collect()
    }

    /// Starts a write transaction; with `appends` (it writes run events or the outbox)
    /// it first waits, on PostgreSQL, for every other writer's transaction to end (see
    /// the [module docs](self)).
    ///
    /// A replica that stalls in the middle of a write (a frozen machine, a long pause)
    /// holds the append lock and row locks that every other replica waits for; the
    /// session limits every connection runs under
    /// ([`convene_store::POSTGRES_SESSION_LIMITS`]) have the server end its session
    /// within half a second instead: the locks go, and the stalled write fails.
    async fn begin(&self, appends: bool) -> Result<Tx, StoreError> {
        let mut tx = self.db.begin().await?;
        if let Some(guard) = self.guard(appends) {
            tx.execute(guard).await?;
        }
        Ok(tx)
    }

    /// What a write transaction runs first on PostgreSQL (see [`SqlRunStore::begin`]).
    fn guard(&self, appends: bool) -> Option<Statement> {
        (appends && self.db.backend() == Backend::Postgres)
            .then(|| sql("SELECT pg_advisory_xact_lock($1)").bind(APPEND_LOCK))
    }

    /// Remembers `run` as committed (forgets it once finished).
    fn remember(&self, run: &v1::Run) {
        let mut last = self.last.lock().unwrap_or_else(PoisonError::into_inner);
        if is_terminal(run.state) {
            last.remove(&run.run_id);
            return;
        }
        if last.len() >= REMEMBERED_RUNS {
            last.clear();
        }
        last.insert(run.run_id.clone(), Last::of(run));
    }

    /// Takes what is remembered of `run_id`, if it is the commit of `version`.
    fn recall(&self, run_id: &str, version: u64) -> Option<Last> {
        self.last
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(run_id)
            .filter(|l| l.version == version)
    }

    /// This replica, when the store leases runs.
    fn owner(&self) -> Option<&str> {
        self.creator.as_ref().map(|(me, _)| me.as_str())
    }

    fn announce(&self, run: &v1::Run, shared: Option<&Arc<v1::Run>>, events: &Events) {
        let last_sequence = events.run.last().map_or(0, |e| e.sequence);
        // Nobody listening is fine.
        let _ = self
            .notify
            .send(Committed::of(run, shared, last_sequence, events));
    }
}

#[async_trait]
impl RunStore for SqlRunStore {
    async fn create(
        &self,
        run: &v1::Run,
        key: Option<&IdempotencyKey>,
        events: &Events,
    ) -> Result<Created, StoreError> {
        self.create_run(run, key, events).await
    }

    async fn commit(&self, run: &v1::Run, events: &Events) -> Result<(), StoreError> {
        self.commit_with(run, None, events).await
    }

    async fn commit_shared(&self, run: &Arc<v1::Run>, events: &Events) -> Result<(), StoreError> {
        self.commit_with(run, Some(run), events).await
    }

    async fn get(&self, run_id: &str) -> Result<Option<v1::Run>, StoreError> {
        self.read_run(run_id).await
    }

    async fn tenant_of(&self, run_id: &str) -> Result<Option<String>, StoreError> {
        self.read_tenant(run_id).await
    }

    async fn list(
        &self,
        tenant: &str,
        filter: &RunFilter,
        page_size: usize,
        after: Option<&str>,
    ) -> Result<Page, StoreError> {
        self.list_runs(tenant, filter, page_size, after).await
    }

    async fn run_events(&self, run_id: &str, after: u64) -> Result<Vec<v1::RunEvent>, StoreError> {
        self.read_run_events(run_id, after).await
    }

    async fn cloud_events(
        &self,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<v1::CloudEvent>, StoreError> {
        self.read_cloud_events(after, limit).await
    }

    async fn newest_cloud_event(&self) -> Result<Option<String>, StoreError> {
        self.read_newest_cloud_event().await
    }

    fn subscribe(&self) -> broadcast::Receiver<Committed> {
        self.notify.subscribe()
    }

    fn owner(&self) -> Option<(&str, Duration)> {
        self.creator
            .as_ref()
            .map(|(owner, ttl)| (owner.as_str(), *ttl))
    }

    async fn unfinished(&self) -> Result<Vec<v1::Run>, StoreError> {
        self.read_unfinished().await
    }

    async fn claim_runs(
        &self,
        owner: &str,
        lease_ttl: Duration,
        limit: usize,
    ) -> Result<Vec<v1::Run>, StoreError> {
        self.claim(owner, lease_ttl, limit).await
    }

    async fn renew_lease(
        &self,
        owner: &str,
        run_ids: &[String],
        lease_ttl: Duration,
    ) -> Result<Vec<String>, StoreError> {
        self.renew(owner, run_ids, lease_ttl).await
    }

    async fn release(&self, owner: &str, run_id: &str) -> Result<bool, StoreError> {
        self.release_lease(owner, run_id).await
    }

    async fn add_command(&self, command: &RunCommand) -> Result<(), StoreError> {
        self.insert_command(command).await
    }

    async fn pending_commands(&self, run_id: &str) -> Result<Vec<RunCommand>, StoreError> {
        self.read_pending_commands(run_id).await
    }

    async fn runs_with_commands(&self) -> Result<Vec<String>, StoreError> {
        self.read_runs_with_commands().await
    }

    async fn command_outcome(&self, command_id: &str) -> Result<Option<CommandDone>, StoreError> {
        self.read_command_outcome(command_id).await
    }

    async fn end_commands(&self, done: &[CommandDone]) -> Result<(), StoreError> {
        self.write_commands_done(done).await
    }

    async fn claim_waiting(
        &self,
        owner: &str,
        run_id: &str,
        lease_ttl: Duration,
    ) -> Result<Option<v1::Run>, StoreError> {
        self.claim_waiting_run(owner, run_id, lease_ttl).await
    }

    async fn import_events(&self, events: &[v1::CloudEvent]) -> Result<(), StoreError> {
        self.insert_foreign_events(events).await
    }

    async fn register_replica(&self, replica: &str, endpoint: &str) -> Result<(), StoreError> {
        self.write_replica(replica, endpoint).await
    }

    async fn run_owner(
        &self,
        run_id: &str,
    ) -> Result<Option<(String, Option<String>)>, StoreError> {
        self.read_run_owner(run_id).await
    }

    async fn relay_cursor(&self, relay: &str) -> Result<Option<String>, StoreError> {
        self.read_relay_cursor(relay).await
    }

    async fn acknowledge(&self, relay: &str, event_id: &str) -> Result<(), StoreError> {
        self.acknowledge_event(relay, event_id).await
    }
}

/// The run store a configuration asks for: the SQL store over the database
/// `database_url` names (by default the SQLite file in `data_dir`), or memory; the runs
/// it creates are leased to the replica `owner` for `lease_ttl`.
///
/// # Errors
///
/// [`convene_store::Error`] when the database cannot be opened.
pub async fn open_store(
    database_url: Option<&str>,
    data_dir: &std::path::Path,
    owner: &str,
    lease_ttl: Duration,
) -> Result<Arc<dyn RunStore>, crate::Error> {
    Ok(match convene_store::open(database_url, data_dir).await? {
        Some(db) => {
            tracing::info!(backend = %db.backend(), url = db.url(), "runs are stored in the database");
            Arc::new(
                SqlRunStore::open(db)
                    .await
                    .map_err(crate::Error::Store)?
                    .with_owner(owner, lease_ttl),
            )
        }
        None => {
            tracing::info!(
                "runs are kept in memory (database_url = \"memory\"): they are lost at exit"
            );
            Arc::new(crate::store::MemoryStore::default().with_owner(owner, lease_ttl))
        }
    })
}
