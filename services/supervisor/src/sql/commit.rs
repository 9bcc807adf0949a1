//! Writing runs: a new run with its idempotency key and labels, a commit over the
//! version it read, and the rows a commit appends (run events, outbox events, ledger
//! rows, join decision revisions).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::SystemTime;

use convene_proto::v1;
use convene_store::time::micros;
use convene_store::{Arg, Backend, InsertRows, Row, Statement, Tx, sql};
use prost::Message as _;

use super::labels::label_rows;
use super::rows::{decode, ts_micros};
use super::{Last, SqlRunStore};
use crate::store::{
    CommandDone, Created, Events, IdempotencyKey, StoreError, is_terminal, is_waiting,
};

impl SqlRunStore {
    pub(super) async fn create_run(
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
             created_at, updated_at, owner, lease_until, trace_id, body, lease_epoch) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13)",
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
        .bind(run.encode_to_vec())
        .bind(i64::try_from(run.lease_epoch).unwrap_or(i64::MAX));
        let appended = appends(run, events);
        let labels = label_rows(run);
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
                    for insert in labels {
                        tx.execute(insert).await?;
                    }
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

    /// [`RunStore::commit`], with the run itself for the note when its owner shares it.
    pub(super) async fn commit_with(
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
        // A run that begins to wait is nobody's: its lease goes in the same write
        // (`release`), and a command for it makes a replica claim it again.
        let text = if me.is_some() {
            "UPDATE runs SET state = $3, terminal = $4, version = $5, \
             updated_at = $6, trace_id = $7, body = $8, waiting = $9, \
             owner = CASE WHEN $10 THEN NULL ELSE owner END, \
             lease_until = CASE WHEN $10 THEN NULL ELSE lease_until END \
             WHERE run_id = $1 AND version = $2 AND (owner IS NULL OR owner = $11)"
        } else {
            "UPDATE runs SET state = $3, terminal = $4, version = $5, \
             updated_at = $6, trace_id = $7, body = $8, waiting = $9, \
             owner = CASE WHEN $10 THEN NULL ELSE owner END, \
             lease_until = CASE WHEN $10 THEN NULL ELSE lease_until END \
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
            .bind(run.encode_to_vec())
            .bind(is_waiting(run.state))
            .bind(events.release);
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
pub(super) fn refusal(
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

/// A row a change appends, built (encoded and bound) before the write job runs, so the
/// job owns statements rather than a copy of the whole run.
pub(super) enum Append {
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
pub(super) fn appends(run: &v1::Run, events: &Events) -> Vec<Append> {
    let replica = (!run.owner.is_empty()).then(|| run.owner.clone());
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
                Arg::from(replica.clone()),
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
            .bind(replica.clone())
    });
    let outbox = OUTBOX_ROWS.all(&events.cloud, |insert, e| {
        insert
            .bind(&e.id)
            .bind(&e.correlation_id)
            .bind(&e.tenant_id)
            .bind(&e.r#type)
            .bind(ts_micros(e.time.as_ref()))
            .bind(e.encode_to_vec())
            .bind(replica.clone())
    });
    out.extend(run_events.into_iter().chain(outbox).map(Append::Always));
    // The commands this change applied are done in the same transaction.
    for done in &events.commands {
        out.push(Append::Always(command_done(done, updated_at)));
    }
    out
}

/// Marks one command done with its outcome (a command done already stays as it was).
pub(super) fn command_done(done: &CommandDone, at: i64) -> Statement {
    sql(
        "UPDATE run_commands SET done = TRUE, done_at = $2, outcome_code = $3, \
         outcome_message = $4 WHERE command_id = $1 AND NOT done",
    )
    .bind(&done.command_id)
    .bind(at)
    .bind(done.code)
    .bind(&done.message)
}

// A commit's rows of each kind go in one statement (in pieces of at most 32 rows: a
// commit usually carries a handful, and a large fan-out's stays far inside both back
// ends' limits on bound parameters).
// Each row names the replica that wrote it: the run's owner, whose lease the commit
// holds (NULL when the supervisor leases no runs).
pub(super) static RUN_EVENT_ROWS: InsertRows = InsertRows::new(
    "INSERT INTO run_events (run_id, sequence, body, replica)",
    4,
    "",
    32,
);
pub(super) static OUTBOX_ROWS: InsertRows = InsertRows::new(
    "INSERT INTO outbox (event_id, run_id, tenant, type, created_at, body, replica)",
    7,
    "",
    32,
);
pub(super) static LEDGER_ROWS: InsertRows = InsertRows::new(
    "INSERT INTO delegation_ledger (run_id, delegation_id, run_version, state, \
     parent_delegation_id, profile_id, worker_id, attempts, recorded_at, replica)",
    10,
    "",
    32,
);

/// Writes the rows of `appends` that are new since `before` (all of them for a new run).
pub(super) async fn write_appends(
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

pub(super) fn latest_revision(run: &v1::Run) -> u32 {
    run.revisions
        .iter()
        .chain(run.decision.as_ref())
        .map(|d| d.revision)
        .max()
        .unwrap_or(0)
}
