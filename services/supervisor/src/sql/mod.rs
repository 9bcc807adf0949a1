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

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use convene_proto::v1;
use convene_store::time::{from_micros, micros};
use convene_store::{Arg, Backend, Database, InsertRows, Row, Statement, Tx, placeholders, sql};
use prost::Message as _;
use tokio::sync::broadcast;

use crate::store::{
    Committed, Created, Events, IdempotencyKey, Page, RunStore, StoreError, is_terminal,
};

/// How often other processes' commits are looked for.
pub const POLL_INTERVAL: Duration = Duration::from_millis(150);

/// Rows one poll reads at most; the rest wait for the next one.
const POLL_BATCH: i64 = 1000;

/// Unfinished runs whose [`Last`] a store remembers at most; past that it forgets them
/// all (their next commits read the run first), so runs abandoned mid-way (a lost
/// lease) cannot grow it without bound.
const REMEMBERED_RUNS: usize = 200_000;

/// Leases free and expired unfinished runs on SQLite (see [`RunStore::claim_runs`]).
///
/// Only through the partial index of unfinished runs: left to itself, SQLite walks the
/// primary key to return the runs in `run_id` order, reading every run ever stored,
/// finished or not. That was 42-55 ms with 42,000 runs in the file, holding the write
/// lock, at every claim (every 5 s by default), and grows with the database; through
/// the index it reads the unfinished runs only and sorts those.
const CLAIM_SQLITE: &str = "UPDATE runs SET owner = $1, lease_until = $2 WHERE run_id IN (\
     SELECT run_id FROM runs INDEXED BY runs_unfinished WHERE NOT terminal \
     AND (owner IS NULL OR lease_until IS NULL OR lease_until <= $3) \
     ORDER BY run_id LIMIT $4) RETURNING body";

/// The unfinished runs on SQLite, through the same index as [`CLAIM_SQLITE`].
const UNFINISHED_SQLITE: &str =
    "SELECT body FROM runs INDEXED BY runs_unfinished WHERE NOT terminal ORDER BY run_id";

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
    /// # Errors
    ///
    /// [`StoreError::Backend`] when the database cannot be read.
    pub async fn open(db: Database) -> Result<Self, StoreError> {
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
    /// On PostgreSQL a store that leases runs also bounds how long the transaction may
    /// sit idle to the lease's length. A replica that stalls in the middle of a write (a
    /// frozen machine, a long pause) holds the append lock and row locks that every other
    /// replica waits for; past its lease, when the others take its runs over anyway, the
    /// server ends its session instead, the locks go, and the stalled write fails.
    async fn begin(&self, appends: bool) -> Result<Tx, StoreError> {
        let mut tx = self.db.begin().await?;
        if let Some(guard) = self.guard(appends) {
            tx.execute(guard).await?;
        }
        Ok(tx)
    }

    /// What a write transaction runs first on PostgreSQL (see [`SqlRunStore::begin`]).
    fn guard(&self, appends: bool) -> Option<Statement> {
        if self.db.backend() != Backend::Postgres {
            return None;
        }
        let idle = self
            .creator
            .as_ref()
            .map(|(_, ttl)| ttl.as_millis().max(1).to_string());
        match (idle, appends) {
            (Some(ms), true) => Some(
                sql(
                    "SELECT set_config('idle_in_transaction_session_timeout', $1, true), \
                     pg_advisory_xact_lock($2)",
                )
                .bind(ms)
                .bind(APPEND_LOCK),
            ),
            (Some(ms), false) => Some(
                sql("SELECT set_config('idle_in_transaction_session_timeout', $1, true)").bind(ms),
            ),
            (None, true) => Some(sql("SELECT pg_advisory_xact_lock($1)").bind(APPEND_LOCK)),
            (None, false) => None,
        }
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

    /// [`RunStore::commit`], with the run itself for the note when its owner shares it.
    async fn commit_with(
        &self,
        run: &v1::Run,
        shared: Option<&Arc<v1::Run>>,
        events: &Events,
    ) -> Result<(), StoreError> {
        let expected = run.version.saturating_sub(1);
        let remembered = self.recall(&run.run_id, expected);
        let guard = self.guard(true);
        let me = self.owner().map(str::to_owned);
        let postgres = self.db.backend() == Backend::Postgres;
        let run_id = run.run_id.clone();
        let read = if postgres {
            sql("SELECT version, owner, body FROM runs WHERE run_id = $1 FOR UPDATE")
        } else {
            sql("SELECT version, owner, body FROM runs WHERE run_id = $1")
        }
        .bind(&run.run_id);
        // The version and lease checks again, in the write itself: they hold for the row
        // as it is then (SQLite has one writer; PostgreSQL locks the row it updates).
        // With leases, a run another replica claimed is not this one's to write.
        let text = if me.is_some() {
            "UPDATE runs SET state = $3, terminal = $4, version = $5, \
             updated_at = $6, trace_id = $7, body = $8 \
             WHERE run_id = $1 AND version = $2 AND (owner IS NULL OR owner = $9)"
        } else {
            "UPDATE runs SET state = $3, terminal = $4, version = $5, \
             updated_at = $6, trace_id = $7, body = $8 \
             WHERE run_id = $1 AND version = $2"
        };
        let mut update = sql(text)
            .bind(&run.run_id)
            .bind(expected)
            .bind(run.state)
            .bind(is_terminal(run.state))
            .bind(run.version)
            .bind(ts_micros(run.updated_at.as_ref()))
            .bind(&run.trace_id)
            .bind(run.encode_to_vec());
        if let Some(me) = &me {
            update = update.bind(me);
        }
        let appended = appends(run, events);
        self.db
            .write::<_, StoreError, _>(move |tx| {
                Box::pin(async move {
                    let me = me.as_deref();
                    if let Some(guard) = guard {
                        tx.execute(guard).await?;
                    }
                    let before = match remembered {
                        Some(last) => last,
                        None => {
                            let row = tx.fetch_optional(read.clone()).await?;
                            refusal(me, row.as_ref(), &run_id, expected)?;
                            let stored: v1::Run =
                                decode(row.as_ref().expect("checked above"), "runs")?;
                            Last::of(&stored)
                        }
                    };
                    if tx.execute(update).await? != 1 {
                        // Changed since this store last committed it: say how.
                        let row = tx.fetch_optional(read).await?;
                        refusal(me, row.as_ref(), &run_id, expected)?;
                        // The row is locked (or the database has one writer), so this is
                        // a bug elsewhere; refuse rather than commit half a change.
                        return Err(StoreError::Conflict {
                            run_id,
                            expected,
                            found: expected,
                        });
                    }
                    write_appends(tx, appended, Some(&before)).await
                })
            })
            .await?;
        self.remember(run);
        self.announce(run, shared, events);
        Ok(())
    }
}

/// Why the commit of `run` over `expected` may not go ahead, from the stored row: no
/// such run, another version, or another replica's lease (`me`: this replica, when runs
/// are leased).
fn refusal(
    me: Option<&str>,
    row: Option<&Row>,
    run_id: &str,
    expected: u64,
) -> Result<(), StoreError> {
    let row = row.ok_or_else(|| StoreError::NotFound(run_id.to_owned()))?;
    let found = row.get_u64("version")?;
    if found != expected {
        return Err(StoreError::Conflict {
            run_id: run_id.to_owned(),
            expected,
            found,
        });
    }
    // Lease fencing: once another replica claimed the run, this one never writes it
    // again, even where its version still matches. A lease that merely expired with
    // nobody claiming it still names this replica, which may go on.
    if me.is_some() {
        let holder: Option<String> = row.get("owner")?;
        if let Some(holder) = holder.filter(|h| Some(h.as_str()) != me) {
            return Err(StoreError::LeaseLost {
                run_id: run_id.to_owned(),
                owner: holder,
            });
        }
    }
    Ok(())
}

/// The ends of the event tables: the last run-event id and outbox position.
async fn ends(db: &Database) -> Result<(i64, i64), StoreError> {
    let row = db
        .fetch_optional(sql(
            "SELECT (SELECT COALESCE(MAX(id), 0) FROM run_events) AS events, \
                    (SELECT COALESCE(MAX(position), 0) FROM outbox) AS outbox",
        ))
        .await?
        .ok_or_else(|| StoreError::Backend("no answer to a SELECT without FROM".into()))?;
    Ok((row.get("events")?, row.get("outbox")?))
}

/// Reports commits that appear in the event tables, whoever made them.
async fn poll(
    db: Database,
    notify: broadcast::Sender<Committed>,
    mut events_after: i64,
    mut outbox_after: i64,
) {
    let mut tick = tokio::time::interval(POLL_INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut failing = false;
    loop {
        tick.tick().await;
        let outcome = if notify.receiver_count() == 0 {
            // Nobody to tell: keep up with the end without reading rows.
            ends(&db).await.map(|(e, o)| {
                events_after = e;
                outbox_after = o;
            })
        } else {
            poll_once(&db, &notify, &mut events_after, &mut outbox_after).await
        };
        match outcome {
            Ok(()) if failing => {
                failing = false;
                tracing::info!("run store poll recovered");
            }
            Ok(()) => {}
            Err(error) if !failing => {
                failing = true;
                tracing::warn!(%error, "run store poll failed; subscribers hear only of this process's commits until it recovers");
            }
            Err(_) => {}
        }
    }
}

async fn poll_once(
    db: &Database,
    notify: &broadcast::Sender<Committed>,
    events_after: &mut i64,
    outbox_after: &mut i64,
) -> Result<(), StoreError> {
    // One statement, so one snapshot: a commit's run events and outbox events are seen
    // together or not at all.
    let rows = db
        .fetch_all(
            sql("SELECT 'e' AS kind, id AS pos, run_id, sequence FROM \
                   (SELECT id, run_id, sequence FROM run_events WHERE id > $1 \
                    ORDER BY id LIMIT $3) AS e \
                 UNION ALL \
                 SELECT 'o' AS kind, position AS pos, run_id, 0 AS sequence FROM \
                   (SELECT position, run_id FROM outbox WHERE position > $2 \
                    ORDER BY position LIMIT $3) AS o")
            .bind(*events_after)
            .bind(*outbox_after)
            .bind(POLL_BATCH),
        )
        .await?;
    let (events, outbox): (Vec<_>, Vec<_>) = rows
        .iter()
        .partition(|r| r.get::<String>("kind").is_ok_and(|k| k == "e"));
    // Per run: (highest sequence, whether outbox events came too).
    let mut runs: BTreeMap<String, (u64, bool)> = BTreeMap::new();
    for row in events {
        *events_after = (*events_after).max(row.get("pos")?);
        let entry = runs.entry(row.get("run_id")?).or_default();
        entry.0 = entry.0.max(row.get_u64("sequence")?);
    }
    for row in outbox {
        *outbox_after = (*outbox_after).max(row.get("pos")?);
        runs.entry(row.get("run_id")?).or_default().1 = true;
    }
    for (run_id, (last_sequence, cloud)) in runs {
        let _ = notify.send(Committed {
            run_id,
            last_sequence,
            cloud,
            events: None,
            ended: None,
        });
    }
    Ok(())
}

fn decode<M: prost::Message + Default>(row: &Row, table: &str) -> Result<M, StoreError> {
    let bytes: Vec<u8> = row.get("body")?;
    M::decode(bytes.as_slice())
        .map_err(|e| StoreError::Backend(format!("a stored {table} record does not decode: {e}")))
}

fn narrow<T: TryFrom<i64>>(v: i64, column: &str) -> Result<T, StoreError> {
    T::try_from(v).map_err(|_| StoreError::Backend(format!("{column} holds {v}, out of range")))
}

fn ts_micros(ts: Option<&prost_types::Timestamp>) -> i64 {
    ts.map_or(0, |t| {
        t.seconds
            .saturating_mul(1_000_000)
            .saturating_add(i64::from(t.nanos) / 1_000)
    })
}

/// A row a change appends, built (encoded and bound) before the write job runs, so the
/// job owns statements rather than a copy of the whole run.
enum Append {
    /// Written whatever the run's last commit was: run events, outbox events.
    Always(Statement),
    /// A delegation's ledger row, its values in [`LEDGER_ROWS`]' column order: written
    /// when its state differs from the last commit's, with the commit's other new ones.
    Ledger {
        delegation_id: String,
        state: i32,
        row: Vec<Arg>,
    },
    /// A join decision revision: written when newer than the last commit's.
    Decision { revision: u32, insert: Statement },
}

impl Append {
    /// Whether the row is new since `before` (everything is, for a new run).
    fn is_new(&self, before: Option<&Last>) -> bool {
        match (self, before) {
            (Self::Always(_), _) | (_, None) => true,
            (
                Self::Ledger {
                    delegation_id,
                    state,
                    ..
                },
                Some(b),
            ) => b.states.get(delegation_id) != Some(state),
            (Self::Decision { revision, .. }, Some(b)) => *revision > b.revision,
        }
    }
}

/// What a change may append: a ledger row per delegation, a row per decision revision,
/// the run events and the outbox events. [`write_appends`] writes those new since the
/// last commit.
fn appends(run: &v1::Run, events: &Events) -> Vec<Append> {
    let updated_at = ts_micros(run.updated_at.as_ref());
    let mut out =
        Vec::with_capacity(run.delegations.len() + events.run.len() + events.cloud.len() + 1);
    for d in &run.delegations {
        let Some(task) = d.task.as_ref() else {
            continue;
        };
        out.push(Append::Ledger {
            delegation_id: task.delegation_id.clone(),
            state: d.state,
            row: vec![
                Arg::from(&run.run_id),
                Arg::from(&task.delegation_id),
                Arg::from(run.version),
                Arg::from(d.state),
                Arg::from(&task.parent_delegation_id),
                Arg::from(&task.profile_id),
                Arg::from(&d.worker_id),
                Arg::from(d.attempts),
                Arg::from(updated_at),
            ],
        });
    }

    let revisions: BTreeMap<u32, &v1::JoinDecision> = run
        .revisions
        .iter()
        .chain(run.decision.as_ref())
        .map(|d| (d.revision, d))
        .collect();
    for (revision, decision) in revisions {
        out.push(Append::Decision {
            revision,
            insert: sql(
                "INSERT INTO join_decisions (run_id, revision, run_version, outcome, \
                 decided_at, body) VALUES ($1, $2, $3, $4, $5, $6) \
                 ON CONFLICT (run_id, revision) DO NOTHING",
            )
            .bind(&run.run_id)
            .bind(revision)
            .bind(run.version)
            .bind(decision.outcome)
            .bind(ts_micros(decision.decided_at.as_ref()))
            .bind(decision.encode_to_vec()),
        });
    }

    // A commit's run events go in one statement, and its outbox rows in another: one
    // statement per row was a third of the rows a run writes, each its own execution
    // (bind, step, reset) in the writer every commit waits for.
    let run_events = RUN_EVENT_ROWS.all(&events.run, |insert, e| {
        insert
            .bind(&run.run_id)
            .bind(e.sequence)
            .bind(e.encode_to_vec())
    });
    let outbox = OUTBOX_ROWS.all(&events.cloud, |insert, e| {
        insert
            .bind(&e.id)
            .bind(&e.correlation_id)
            .bind(&e.tenant_id)
            .bind(&e.r#type)
            .bind(ts_micros(e.time.as_ref()))
            .bind(e.encode_to_vec())
    });
    out.extend(run_events.into_iter().chain(outbox).map(Append::Always));
    out
}

// A commit's rows of each kind go in one statement (in pieces of at most 32 rows: a
// commit usually carries a handful, and a large fan-out's stays far inside both back
// ends' limits on bound parameters).
static RUN_EVENT_ROWS: InsertRows =
    InsertRows::new("INSERT INTO run_events (run_id, sequence, body)", 3, "", 32);
static OUTBOX_ROWS: InsertRows = InsertRows::new(
    "INSERT INTO outbox (event_id, run_id, tenant, type, created_at, body)",
    6,
    "",
    32,
);
static LEDGER_ROWS: InsertRows = InsertRows::new(
    "INSERT INTO delegation_ledger (run_id, delegation_id, run_version, state, \
     parent_delegation_id, profile_id, worker_id, attempts, recorded_at)",
    9,
    "",
    32,
);

/// Writes the rows of `appends` that are new since `before` (all of them for a new run).
async fn write_appends(
    tx: &mut Tx,
    appends: Vec<Append>,
    before: Option<&Last>,
) -> Result<(), StoreError> {
    let mut ledger = Vec::new();
    for append in appends {
        if !append.is_new(before) {
            continue;
        }
        match append {
            Append::Ledger { row, .. } => ledger.push(row),
            Append::Always(insert) | Append::Decision { insert, .. } => {
                tx.execute(insert).await?;
            }
        }
    }
    for insert in LEDGER_ROWS.all(ledger, |insert, row| {
        row.into_iter().fold(insert, Statement::bind)
    }) {
        tx.execute(insert).await?;
    }
    Ok(())
}

fn latest_revision(run: &v1::Run) -> u32 {
    run.revisions
        .iter()
        .chain(run.decision.as_ref())
        .map(|d| d.revision)
        .max()
        .unwrap_or(0)
}

#[async_trait]
impl RunStore for SqlRunStore {
    async fn create(
        &self,
        run: &v1::Run,
        key: Option<&IdempotencyKey>,
        events: &Events,
    ) -> Result<Created, StoreError> {
        let guard = self.guard(true);
        let (owner, lease_until) = match &self.creator {
            Some((owner, ttl)) => (Some(owner.clone()), Some(micros(SystemTime::now() + *ttl))),
            None => (None, None),
        };
        let key = key.cloned();
        let run_id = run.run_id.clone();
        let insert = sql(
            "INSERT INTO runs (run_id, tenant, principal, state, terminal, version, \
             created_at, updated_at, owner, lease_until, trace_id, body) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12)",
        )
        .bind(&run.run_id)
        .bind(&run.tenant)
        .bind(&run.principal)
        .bind(run.state)
        .bind(is_terminal(run.state))
        .bind(run.version)
        .bind(ts_micros(run.created_at.as_ref()))
        .bind(ts_micros(run.updated_at.as_ref()))
        .bind(owner)
        .bind(lease_until)
        .bind(&run.trace_id)
        .bind(run.encode_to_vec());
        let appended = appends(run, events);
        let created = self
            .db
            .write::<_, StoreError, _>(move |tx| {
                Box::pin(async move {
                    if let Some(guard) = guard {
                        tx.execute(guard).await?;
                    }
                    if let Some(key) = &key {
                        // The primary key decides a race between two StartRuns with one
                        // key: the loser inserts nothing (PostgreSQL waits for the
                        // winner's commit first).
                        let inserted = tx
                            .execute(
                                sql("INSERT INTO idempotency_keys (principal, key, run_id) \
                                     VALUES ($1, $2, $3) ON CONFLICT (principal, key) DO NOTHING")
                                .bind(&key.principal)
                                .bind(&key.key)
                                .bind(&run_id),
                            )
                            .await?;
                        if inserted == 0 {
                            // Read inside the transaction: the winner may be an earlier
                            // write of this very batch, whose run only this transaction
                            // sees until the batch commits. Committing (nothing) then
                            // waits for that commit, so the run returned is durable.
                            let row = tx
                                .fetch_optional(
                                    sql("SELECT r.body FROM idempotency_keys k \
                                         JOIN runs r ON r.run_id = k.run_id \
                                         WHERE k.principal = $1 AND k.key = $2")
                                    .bind(&key.principal)
                                    .bind(&key.key),
                                )
                                .await?
                                .ok_or_else(|| {
                                    StoreError::Backend(format!(
                                        "idempotency key {:?} of {} points at no run",
                                        key.key, key.principal
                                    ))
                                })?;
                            let existing: v1::Run = decode(&row, "runs")?;
                            return Ok(Created::Existing(Box::new(existing)));
                        }
                    }
                    tx.execute(insert).await?;
                    write_appends(tx, appended, None).await?;
                    Ok(Created::New)
                })
            })
            .await?;
        if matches!(created, Created::New) {
            self.remember(run);
            self.announce(run, None, events);
        }
        Ok(created)
    }

    async fn commit(&self, run: &v1::Run, events: &Events) -> Result<(), StoreError> {
        self.commit_with(run, None, events).await
    }

    async fn commit_shared(&self, run: &Arc<v1::Run>, events: &Events) -> Result<(), StoreError> {
        self.commit_with(run, Some(run), events).await
    }

    async fn get(&self, run_id: &str) -> Result<Option<v1::Run>, StoreError> {
        self.db
            .fetch_optional(sql("SELECT body FROM runs WHERE run_id = $1").bind(run_id))
            .await?
            .map(|row| decode(&row, "runs"))
            .transpose()
    }

    async fn tenant_of(&self, run_id: &str) -> Result<Option<String>, StoreError> {
        self.db
            .fetch_optional(sql("SELECT tenant FROM runs WHERE run_id = $1").bind(run_id))
            .await?
            .map(|row| row.get::<String>("tenant"))
            .transpose()
            .map_err(StoreError::from)
    }

    async fn list(
        &self,
        tenant: &str,
        states: &[i32],
        page_size: usize,
        after: Option<&str>,
    ) -> Result<Page, StoreError> {
        let mut text = String::from("SELECT body FROM runs WHERE tenant = $1");
        let mut args: Vec<String> = vec![tenant.to_owned()];
        if let Some(cursor) = after {
            args.push(cursor.to_owned());
            text.push_str(&format!(" AND run_id < ${}", args.len()));
        }
        if !states.is_empty() {
            let first = args.len() + 1;
            text.push_str(&format!(
                " AND state IN ({})",
                placeholders(first, states.len())
            ));
        }
        // One more than asked tells whether another page exists.
        let limit = i64::try_from(page_size.saturating_add(1)).unwrap_or(i64::MAX);
        text.push_str(&format!(
            " ORDER BY run_id DESC LIMIT ${}",
            args.len() + states.len() + 1
        ));
        let mut statement = Statement::built(text);
        for a in args {
            statement = statement.bind(a);
        }
        for s in states {
            statement = statement.bind(*s);
        }
        let rows = self.db.fetch_all(statement.bind(limit)).await?;
        let mut runs = rows
            .iter()
            .map(|r| decode::<v1::Run>(r, "runs"))
            .collect::<Result<Vec<_>, _>>()?;
        let next = if runs.len() > page_size {
            runs.truncate(page_size);
            runs.last().map(|r| r.run_id.clone())
        } else {
            None
        };
        Ok(Page { runs, next })
    }

    async fn run_events(&self, run_id: &str, after: u64) -> Result<Vec<v1::RunEvent>, StoreError> {
        let rows = self
            .db
            .fetch_all(
                sql(
                    "SELECT body FROM run_events WHERE run_id = $1 AND sequence > $2 \
                     ORDER BY sequence",
                )
                .bind(run_id)
                .bind(after),
            )
            .await?;
        rows.iter().map(|r| decode(r, "run_events")).collect()
    }

    async fn cloud_events(
        &self,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<v1::CloudEvent>, StoreError> {
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let statement = match after {
            None => sql("SELECT body FROM outbox ORDER BY position LIMIT $1").bind(limit),
            // An id not (or no longer) in the outbox: UUIDv7 ids sort by time, so resume
            // after the last event whose id sorts before it.
            Some(id) => sql("SELECT body FROM outbox WHERE position > COALESCE(\
                     (SELECT position FROM outbox WHERE event_id = $1), \
                     (SELECT MAX(position) FROM outbox WHERE event_id <= $1), 0) \
                 ORDER BY position LIMIT $2")
            .bind(id)
            .bind(limit),
        };
        let rows = self.db.fetch_all(statement).await?;
        rows.iter().map(|r| decode(r, "outbox")).collect()
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
        let unfinished = match self.db.backend() {
            Backend::Sqlite => UNFINISHED_SQLITE,
            Backend::Postgres => "SELECT body FROM runs WHERE NOT terminal ORDER BY run_id",
        };
        let rows = self.db.fetch_all(sql(unfinished)).await?;
        rows.iter().map(|r| decode(r, "runs")).collect()
    }

    async fn claim_runs(
        &self,
        owner: &str,
        lease_ttl: Duration,
        limit: usize,
    ) -> Result<Vec<v1::Run>, StoreError> {
        let now = SystemTime::now();
        // One statement: the subquery picks the runs, the UPDATE leases them. On
        // PostgreSQL, SKIP LOCKED lets concurrent claimers pass over each other's rows
        // instead of waiting for them and then claiming them a second time; SQLite has
        // one writer at a time, so its plain UPDATE cannot race.
        let claim = match self.db.backend() {
            Backend::Sqlite => sql(CLAIM_SQLITE),
            Backend::Postgres => sql(
                "UPDATE runs SET owner = $1, lease_until = $2 WHERE run_id IN (\
                 SELECT run_id FROM runs WHERE NOT terminal \
                 AND (owner IS NULL OR lease_until IS NULL OR lease_until <= $3) \
                 ORDER BY run_id LIMIT $4 FOR UPDATE SKIP LOCKED) RETURNING body",
            ),
        };
        let mut tx = self.begin(false).await?;
        let rows = tx
            .fetch_all(
                claim
                    .bind(owner)
                    .bind(micros(now + lease_ttl))
                    .bind(micros(now))
                    .bind(i64::try_from(limit).unwrap_or(i64::MAX)),
            )
            .await?;
        tx.commit().await?;
        let mut runs = rows
            .iter()
            .map(|r| decode::<v1::Run>(r, "runs"))
            .collect::<Result<Vec<_>, _>>()?;
        runs.sort_by(|a, b| a.run_id.cmp(&b.run_id));
        Ok(runs)
    }

    async fn renew_lease(
        &self,
        owner: &str,
        run_ids: &[String],
        lease_ttl: Duration,
    ) -> Result<Vec<String>, StoreError> {
        if run_ids.is_empty() {
            return Ok(Vec::new());
        }
        let mut statement = Statement::built(format!(
            "UPDATE runs SET lease_until = $2 WHERE owner = $1 AND run_id IN ({}) \
             RETURNING run_id",
            placeholders(3, run_ids.len())
        ))
        .bind(owner)
        .bind(micros(SystemTime::now() + lease_ttl));
        for id in run_ids {
            statement = statement.bind(id);
        }
        let mut tx = self.begin(false).await?;
        let rows = tx.fetch_all(statement).await?;
        tx.commit().await?;
        let held: Vec<String> = rows
            .iter()
            .map(|r| r.get("run_id"))
            .collect::<Result<_, _>>()?;
        // In the order asked.
        Ok(run_ids
            .iter()
            .filter(|id| held.contains(id))
            .cloned()
            .collect())
    }

    async fn release(&self, owner: &str, run_id: &str) -> Result<bool, StoreError> {
        let mut tx = self.begin(false).await?;
        let n = tx
            .execute(
                sql("UPDATE runs SET owner = NULL, lease_until = NULL \
                     WHERE run_id = $1 AND owner = $2")
                .bind(run_id)
                .bind(owner),
            )
            .await?;
        tx.commit().await?;
        Ok(n == 1)
    }

    async fn relay_cursor(&self, relay: &str) -> Result<Option<String>, StoreError> {
        let row = self
            .db
            .fetch_optional(sql("SELECT event_id FROM outbox_relays WHERE relay = $1").bind(relay))
            .await?;
        Ok(row.map(|r| r.get("event_id")).transpose()?)
    }

    async fn acknowledge(&self, relay: &str, event_id: &str) -> Result<(), StoreError> {
        // Several replicas may relay the same outbox: the cursor only moves forward.
        let n = self
            .db
            .execute(
                sql(
                    "INSERT INTO outbox_relays (relay, position, event_id, updated_at) \
                     SELECT $1, position, event_id, $3 FROM outbox WHERE event_id = $2 \
                     ON CONFLICT (relay) DO UPDATE SET position = excluded.position, \
                     event_id = excluded.event_id, updated_at = excluded.updated_at \
                     WHERE outbox_relays.position < excluded.position",
                )
                .bind(relay)
                .bind(event_id)
                .bind(micros(SystemTime::now())),
            )
            .await?;
        if n == 0 {
            let known = self
                .db
                .fetch_optional(
                    sql("SELECT position FROM outbox WHERE event_id = $1").bind(event_id),
                )
                .await?;
            if known.is_none() {
                return Err(StoreError::NotFound(format!("outbox event {event_id}")));
            }
        }
        Ok(())
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

#[cfg(test)]
mod tests {
    use super::*;

    /// What SQLite's planner says it does for `statement` on a freshly migrated file.
    async fn plan(statement: &str, args: usize) -> String {
        let dir = tempfile::tempdir().expect("tempdir");
        let db = Database::connect(&convene_store::sqlite_url(&dir.path().join("plan.db")))
            .await
            .expect("migrated");
        let explain = (0..args).fold(
            Statement::built(format!("EXPLAIN QUERY PLAN {statement}")),
            |s, _| s.bind(0_i64),
        );
        let rows = db.fetch_all(explain).await.expect("explained");
        db.close().await;
        rows.iter()
            .map(|r| r.get::<String>("detail").expect("detail"))
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// A claim and the start-up read look at unfinished runs only: a search or scan of
    /// the partial index, never a scan of the whole table.
    #[tokio::test]
    async fn claims_and_the_unfinished_read_use_the_index_of_unfinished_runs() {
        for (statement, args) in [(CLAIM_SQLITE, 4), (UNFINISHED_SQLITE, 0)] {
            let plan = plan(statement, args).await;
            assert!(
                plan.contains("USING INDEX runs_unfinished"),
                "{statement}:\n{plan}"
            );
            assert!(
                plan.lines()
                    .filter(|step| step.contains("SCAN runs"))
                    .all(|step| step.contains("runs_unfinished")),
                "{statement} walks the whole table:\n{plan}"
            );
        }
    }
}
