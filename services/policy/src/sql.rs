//! The policy service's state in SQLite or PostgreSQL (see `convene_store`):
//! [`SqlPolicyState`] for call counters, revocations and issued-token owners, and
//! [`SqlDecisionLog`] for the decision log. Both survive restarts and may be shared by
//! several policy service instances over one database.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::SystemTime;

use async_trait::async_trait;
use convene_store::time::micros;
use convene_store::{Database, InsertRows, Statement, sql};

use crate::decision_log::{DecisionLog, LogEntry, LogError};
use crate::state::{
    Call, CallError, Counted, DecisionOf, IssuedToken, PolicyState, Revocation, RevokeTarget,
    StateError, count_then_log, revoke_each_then_log,
};

/// The statement that counts one call: the first call inserts the counter at 1; later
/// calls increment it only while it is below the limit. A refused increment returns no
/// row.
fn count_call(token_id: &str, max_calls: u32, expires_at: SystemTime) -> Statement {
    sql(
        "INSERT INTO call_counters (token_id, used, max_calls, expires_at) \
         VALUES ($1, 1, $2, $3) \
         ON CONFLICT (token_id) DO UPDATE SET used = call_counters.used + 1 \
         WHERE call_counters.used < $2 \
         RETURNING used",
    )
    .bind(token_id)
    .bind(i64::from(max_calls))
    .bind(micros(expires_at))
}

/// The revocations that apply to a token with this `jti`, run and lease epoch: a lease
/// fence above the epoch is a row of kind `lease` whose reason is the fence's epoch.
fn revocations_of(token_id: &str, run_id: &str, lease_epoch: u64) -> Statement {
    sql("SELECT kind, reason FROM revocations \
         WHERE (kind = 'token' AND target_id = $1) \
            OR (kind = 'run' AND target_id = $2) \
         UNION ALL SELECT 'lease' AS kind, CAST(epoch AS TEXT) AS reason FROM lease_fences \
         WHERE run_id = $2 AND epoch > $3")
    .bind(token_id)
    .bind(run_id)
    .bind(i64::try_from(lease_epoch).unwrap_or(i64::MAX))
}

/// The upsert that fences `run_id` at lease epoch `epoch` at `now` (a fence never moves
/// down).
fn fence_statement(run_id: &str, epoch: u64, now: SystemTime) -> Statement {
    sql(
        "INSERT INTO lease_fences (run_id, epoch, fenced_at) VALUES ($1, $2, $3) \
         ON CONFLICT (run_id) DO UPDATE SET epoch = excluded.epoch, fenced_at = excluded.fenced_at \
         WHERE lease_fences.epoch < excluded.epoch",
    )
    .bind(run_id)
    .bind(i64::try_from(epoch).unwrap_or(i64::MAX))
    .bind(micros(now))
}

/// The revocation that applies, from the rows of [`revocations_of`]: the token's own
/// first.
fn revocation_in(
    rows: Vec<convene_store::Row>,
    token_id: &str,
    run_id: &str,
) -> Result<Option<Revocation>, convene_store::Error> {
    let mut by_run = None;
    let mut by_lease = None;
    for row in rows {
        let kind: String = row.get("kind")?;
        let reason: String = row.get("reason")?;
        match kind.as_str() {
            "token" => {
                return Ok(Some(Revocation {
                    target: RevokeTarget::Token(token_id.to_owned()),
                    reason,
                }));
            }
            "lease" => {
                let epoch = reason.parse().unwrap_or(u64::MAX);
                by_lease = Some(crate::state::superseded(run_id, epoch));
            }
            _ => {
                by_run = Some(Revocation {
                    target: RevokeTarget::Run(run_id.to_owned()),
                    reason,
                });
            }
        }
    }
    Ok(by_run.or(by_lease))
}

fn calls_used(token_id: &str) -> Statement {
    sql("SELECT used FROM call_counters WHERE token_id = $1").bind(token_id)
}

fn used_of(row: Option<convene_store::Row>) -> Result<u32, convene_store::Error> {
    let used: i64 = match row {
        Some(r) => r.get("used")?,
        None => 0,
    };
    Ok(u32::try_from(used).unwrap_or(u32::MAX))
}

/// Expired counters and token owners are deleted once per this many new tokens.
const PRUNE_EVERY: u64 = 1024;

impl From<convene_store::Error> for StateError {
    fn from(e: convene_store::Error) -> Self {
        StateError::Unavailable(e.to_string())
    }
}

impl From<convene_store::Error> for CallError {
    fn from(e: convene_store::Error) -> Self {
        CallError::State(e.into())
    }
}

/// [`PolicyState`] in a database.
///
/// A call is counted by one atomic statement (an insert that, for a token counted
/// before, becomes an increment guarded by `used < max_calls`), so concurrent calls of
/// one token — through this instance or another sharing the database — are counted
/// exactly and never past the limit. Revocations are kept forever; counters and owner
/// records of expired tokens are pruned now and then.
#[derive(Debug)]
pub struct SqlPolicyState {
    db: Database,
    issued: AtomicU64,
    /// When revocations and fences are made.
    clock: convene_core::time::Clock,
}

impl SqlPolicyState {
    /// State kept in `db` (migrated, as [`Database::connect`] leaves it).
    pub fn new(db: Database) -> Self {
        Self::with_clock(db, convene_core::time::Clock::system())
    }

    /// State kept in `db` that times its revocations and fences by `clock`.
    pub fn with_clock(db: Database, clock: convene_core::time::Clock) -> Self {
        Self {
            db,
            issued: AtomicU64::new(0),
            clock,
        }
    }

    /// Deletes counters and owner records of tokens expired before `now`.
    ///
    /// # Errors
    ///
    /// [`StateError::Unavailable`] when the database fails.
    pub async fn prune(&self, now: SystemTime) -> Result<(), StateError> {
        let now = micros(now);
        let mut tx = self.db.begin().await?;
        tx.execute(sql("DELETE FROM call_counters WHERE expires_at < $1").bind(now))
            .await?;
        tx.execute(sql("DELETE FROM issued_tokens WHERE expires_at < $1").bind(now))
            .await?;
        tx.commit().await?;
        Ok(())
    }
}

/// Why a counted call and its record could not be written.
enum Failed {
    /// Counting.
    State(convene_store::Error),
    /// The record did not encode.
    Encode(serde_json::Error),
    /// Appending the record, or committing the pair.
    Log(convene_store::Error),
}

/// The commit (or beginning the transaction) failed: as before this write was combined,
/// reported as the record that could not be appended.
impl From<convene_store::Error> for Failed {
    fn from(e: convene_store::Error) -> Self {
        Failed::Log(e)
    }
}

#[async_trait]
impl PolicyState for SqlPolicyState {
    async fn record_issued(&self, tokens: &[IssuedToken]) -> Result<(), StateError> {
        // One transaction (one commit) for the tokens of a request.
        let inserts = issued_inserts(tokens);
        self.db
            .write::<_, StateError, _>(move |tx| {
                Box::pin(async move {
                    for insert in inserts {
                        tx.execute(insert).await?;
                    }
                    Ok(())
                })
            })
            .await?;
        self.count_issued(tokens.len()).await
    }

    async fn record_issued_unless_revoked(
        &self,
        tokens: &[IssuedToken],
        token_id: &str,
        run_id: &str,
        lease_epoch: u64,
    ) -> Result<Option<Revocation>, StateError> {
        // The check, the fence and the tokens in one transaction, on the writer's
        // connection: no token is recorded (so none handed out) after its run's
        // revocation or a newer lease's fence committed.
        let revoked = revocations_of(token_id, run_id, lease_epoch);
        let fence =
            (lease_epoch > 1).then(|| fence_statement(run_id, lease_epoch, self.clock.now()));
        let (token_id, run_id) = (token_id.to_owned(), run_id.to_owned());
        let inserts = issued_inserts(tokens);
        let revocation = self
            .db
            .write::<_, StateError, _>(move |tx| {
                Box::pin(async move {
                    let rows = tx.fetch_all(revoked).await?;
                    if let Some(revocation) = revocation_in(rows, &token_id, &run_id)? {
                        return Ok(Some(revocation));
                    }
                    if let Some(fence) = fence {
                        tx.execute(fence).await?;
                    }
                    for insert in inserts {
                        tx.execute(insert).await?;
                    }
                    Ok(None)
                })
            })
            .await?;
        if revocation.is_none() {
            self.count_issued(tokens.len()).await?;
        }
        Ok(revocation)
    }

    async fn owner_tenant(&self, target: &RevokeTarget) -> Result<Option<String>, StateError> {
        let statement = match target {
            RevokeTarget::Token(id) => {
                sql("SELECT tenant FROM issued_tokens WHERE token_id = $1").bind(id)
            }
            // Every token of a run has the run's tenant.
            RevokeTarget::Run(id) | RevokeTarget::Lease { run_id: id, .. } => {
                sql("SELECT tenant FROM issued_tokens WHERE run_id = $1 LIMIT 1").bind(id)
            }
        };
        let row = self.db.fetch_optional(statement).await?;
        Ok(row.map(|r| r.get("tenant")).transpose()?)
    }

    async fn record_call(
        &self,
        token_id: &str,
        max_calls: u32,
        expires_at: SystemTime,
        _now: SystemTime,
    ) -> Result<u32, CallError> {
        let row = if max_calls == 0 {
            None
        } else {
            self.db
                .write_returning(count_call(token_id, max_calls, expires_at))
                .await?
        };
        match row {
            Some(row) => Ok(used_of(Some(row))?),
            None => Err(CallError::LimitExceeded {
                used: self.calls_used(token_id).await?,
                max: max_calls,
            }),
        }
    }

    async fn calls_used(&self, token_id: &str) -> Result<u32, StateError> {
        Ok(used_of(
            self.db.fetch_optional(calls_used(token_id)).await?,
        )?)
    }

    async fn revoke_logged(
        &self,
        target: &RevokeTarget,
        reason: &str,
        log: &dyn DecisionLog,
        entry: LogEntry,
    ) -> Result<(), crate::Error> {
        // One revocation is a list of one: with its record, in one transaction.
        self.revoke_all_logged(&[(target.clone(), entry)], reason, log)
            .await
    }

    async fn revoke_all_logged(
        &self,
        revocations: &[(RevokeTarget, LogEntry)],
        reason: &str,
        log: &dyn DecisionLog,
    ) -> Result<(), crate::Error> {
        if !log.database().is_some_and(|db| db.same_as(&self.db)) {
            return revoke_each_then_log(self, revocations, reason, log).await;
        }
        // Every revocation and its record commit together.
        let mut statements = Vec::with_capacity(2 * revocations.len());
        for (target, entry) in revocations {
            statements.push(revocation(target, reason, self.clock.now()));
            statements
                .push(log_statement(entry).map_err(|e| log_error(&self.db, "encode a record", e))?);
        }
        self.db
            .write::<_, convene_store::Error, _>(move |tx| {
                Box::pin(async move {
                    for statement in statements {
                        tx.execute(statement).await?;
                    }
                    Ok(())
                })
            })
            .await
            .map_err(|e| log_error(&self.db, "append a record", e))?;
        Ok(())
    }

    async fn record_call_logged(
        &self,
        call: Call<'_>,
        log: &dyn DecisionLog,
        decision: DecisionOf,
    ) -> Result<Counted, crate::Error> {
        if !log.database().is_some_and(|db| db.same_as(&self.db)) {
            return count_then_log(self, call, log, decision).await;
        }
        // The revocation check, the count and its decision commit together: no call is
        // counted without its record, none after its token's or run's revocation
        // committed, and the three cost one commit. The check runs on the writer's
        // connection, whose pages the last commit left warm.
        let revoked = revocations_of(call.token_id, call.run_id, call.lease_epoch);
        let (token_id, run_id) = (call.token_id.to_owned(), call.run_id.to_owned());
        let count = (call.max_calls != 0)
            .then(|| count_call(call.token_id, call.max_calls, call.expires_at));
        let used = calls_used(call.token_id);
        let max_calls = call.max_calls;
        let written = self
            .db
            .write::<_, Failed, _>(move |tx| {
                Box::pin(async move {
                    let rows = tx.fetch_all(revoked).await.map_err(Failed::State)?;
                    let revocation =
                        revocation_in(rows, &token_id, &run_id).map_err(Failed::State)?;
                    let counted = if let Some(revocation) = revocation {
                        let row = tx.fetch_optional(used).await.map_err(Failed::State)?;
                        Counted::Revoked {
                            revocation,
                            used: used_of(row).map_err(Failed::State)?,
                        }
                    } else {
                        let row = match count {
                            Some(count) => tx.fetch_optional(count).await.map_err(Failed::State)?,
                            None => None,
                        };
                        match row {
                            Some(row) => Counted::Allowed {
                                used: used_of(Some(row)).map_err(Failed::State)?,
                            },
                            None => {
                                let row = tx.fetch_optional(used).await.map_err(Failed::State)?;
                                Counted::LimitExceeded {
                                    used: used_of(row).map_err(Failed::State)?,
                                    max: max_calls,
                                }
                            }
                        }
                    };
                    let append = log_statement(&decision(&counted)).map_err(Failed::Encode)?;
                    tx.execute(append).await.map_err(Failed::Log)?;
                    Ok(counted)
                })
            })
            .await;
        match written {
            Ok(counted) => Ok(counted),
            Err(Failed::State(e)) => Err(StateError::from(e).into()),
            Err(Failed::Encode(e)) => Err(log_error(&self.db, "encode a record", e).into()),
            Err(Failed::Log(e)) => Err(log_error(&self.db, "append a record", e).into()),
        }
    }

    async fn revoke_token(&self, token_id: &str, reason: &str) -> Result<(), StateError> {
        self.revoke(&RevokeTarget::Token(token_id.to_owned()), reason)
            .await
    }

    async fn revoke_run(&self, run_id: &str, reason: &str) -> Result<(), StateError> {
        self.revoke(&RevokeTarget::Run(run_id.to_owned()), reason)
            .await
    }

    async fn fence(&self, run_id: &str, epoch: u64) -> Result<(), StateError> {
        self.db
            .execute(fence_statement(run_id, epoch, self.clock.now()))
            .await?;
        Ok(())
    }

    async fn revoked_since(
        &self,
        since: SystemTime,
    ) -> Result<Vec<(RevokeTarget, SystemTime)>, StateError> {
        let rows = self
            .db
            .fetch_all(
                sql("SELECT kind, target_id, revoked_at FROM revocations WHERE revoked_at >= $1")
                    .bind(micros(since)),
            )
            .await?;
        let mut out = Vec::with_capacity(rows.len());
        for row in rows {
            let kind: String = row.get("kind")?;
            let id: String = row.get("target_id")?;
            let at: i64 = row.get("revoked_at")?;
            let target = if kind == "token" {
                RevokeTarget::Token(id)
            } else {
                RevokeTarget::Run(id)
            };
            out.push((target, convene_store::time::from_micros(at)));
        }
        let fences = self
            .db
            .fetch_all(
                sql("SELECT run_id, epoch, fenced_at FROM lease_fences WHERE fenced_at >= $1")
                    .bind(micros(since)),
            )
            .await?;
        for row in fences {
            let epoch: i64 = row.get("epoch")?;
            let at: i64 = row.get("fenced_at")?;
            let target = RevokeTarget::Lease {
                run_id: row.get("run_id")?,
                epoch: u64::try_from(epoch).unwrap_or(0),
            };
            out.push((target, convene_store::time::from_micros(at)));
        }
        Ok(out)
    }

    async fn is_revoked(
        &self,
        token_id: &str,
        run_id: &str,
        lease_epoch: u64,
    ) -> Result<Option<Revocation>, StateError> {
        let rows = self
            .db
            .fetch_all(revocations_of(token_id, run_id, lease_epoch))
            .await?;
        Ok(revocation_in(rows, token_id, run_id)?)
    }
}

/// A request's issued tokens, in one insert (in pieces of at most 64: far inside both
/// back ends' limits on bound parameters).
static ISSUED_ROWS: InsertRows = InsertRows::new(
    "INSERT INTO issued_tokens (token_id, run_id, tenant, expires_at)",
    4,
    "ON CONFLICT (token_id) DO NOTHING",
    64,
);

/// The statements that remember issued tokens' owners: a request's tokens in one
/// multi-row insert, not one statement each.
fn issued_inserts(tokens: &[IssuedToken]) -> Vec<Statement> {
    ISSUED_ROWS.all(tokens, |insert, token| {
        insert
            .bind(&token.token_id)
            .bind(&token.run_id)
            .bind(&token.tenant)
            .bind(micros(token.expires_at))
    })
}

impl SqlPolicyState {
    /// Counts `n` recorded tokens, pruning expired rows once per [`PRUNE_EVERY`].
    async fn count_issued(&self, n: usize) -> Result<(), StateError> {
        let n = n as u64;
        let before = self.issued.fetch_add(n, Ordering::Relaxed);
        if before / PRUNE_EVERY != (before + n) / PRUNE_EVERY {
            // Tokens expire within hours; nothing older is worth keeping a row for.
            self.prune(self.clock.now()).await?;
        }
        Ok(())
    }

    async fn revoke(&self, target: &RevokeTarget, reason: &str) -> Result<(), StateError> {
        self.db
            .execute(revocation(target, reason, self.clock.now()))
            .await?;
        Ok(())
    }
}

/// The insert that revokes `target` at `now`; revoking twice keeps the first reason.
fn revocation(target: &RevokeTarget, reason: &str, now: SystemTime) -> Statement {
    if let RevokeTarget::Lease { run_id, epoch } = target {
        return fence_statement(run_id, *epoch, now);
    }
    let (kind, id) = target.kind_and_id();
    sql(
        "INSERT INTO revocations (kind, target_id, reason, revoked_at) \
         VALUES ($1, $2, $3, $4) ON CONFLICT (kind, target_id) DO NOTHING",
    )
    .bind(kind)
    .bind(id)
    .bind(reason)
    .bind(micros(now))
}

/// [`DecisionLog`] as rows of the `decision_log` table: an append is one committed
/// INSERT, so it returns once the record is durable (SQLite commits with
/// `synchronous = FULL`). Each row holds the record as the JSON the file log writes, plus
/// the run, tenant, token and outcome as columns to query by.
#[derive(Debug)]
pub struct SqlDecisionLog {
    db: Database,
}

impl SqlDecisionLog {
    /// A log in `db` (migrated, as [`Database::connect`] leaves it).
    pub fn new(db: Database) -> Self {
        Self { db }
    }

    fn error(&self, action: &'static str, detail: impl ToString) -> LogError {
        log_error(&self.db, action, detail)
    }

    /// Every record, in append order.
    ///
    /// # Errors
    ///
    /// [`LogError::Io`] when the database cannot be read, [`LogError::Corrupt`] for a
    /// record that does not parse (named by its position).
    pub async fn entries(&self) -> Result<Vec<LogEntry>, LogError> {
        let rows = self
            .db
            .fetch_all(sql(
                "SELECT position, record FROM decision_log ORDER BY position",
            ))
            .await
            .map_err(|e| self.error("read the decision log", e))?;
        rows.iter()
            .map(|row| {
                let text: String = row
                    .get("record")
                    .map_err(|e| self.error("read the decision log", e))?;
                serde_json::from_str(&text).map_err(|e| LogError::Corrupt {
                    path: format!("database {}", self.db.url()),
                    line: row
                        .get::<i64>("position")
                        .ok()
                        .and_then(|p| usize::try_from(p).ok())
                        .unwrap_or_default(),
                    detail: e.to_string(),
                })
            })
            .collect()
    }
}

#[async_trait]
impl DecisionLog for SqlDecisionLog {
    async fn append(&self, entry: LogEntry) -> Result<(), LogError> {
        let statement = log_statement(&entry).map_err(|e| self.error("encode a record", e))?;
        self.db
            .execute(statement)
            .await
            .map_err(|e| self.error("append a record", e))?;
        Ok(())
    }

    fn database(&self) -> Option<&Database> {
        Some(&self.db)
    }
}

fn log_error(db: &Database, action: &'static str, detail: impl ToString) -> LogError {
    LogError::Io {
        path: format!("database {}", db.url()),
        action,
        detail: detail.to_string(),
    }
}

/// The insert that appends `entry` to the decision log.
fn log_statement(entry: &LogEntry) -> Result<Statement, serde_json::Error> {
    let record = serde_json::to_string(entry)?;
    Ok(match entry {
        LogEntry::Authorize(r) => sql(
            "INSERT INTO decision_log (decision_id, kind, time, tenant, run_id, token_id, \
                 allowed, record) VALUES ($1, 'authorize', $2, $3, $4, $5, $6, $7)",
        )
        .bind(&r.decision_id)
        .bind(&r.time)
        .bind(&r.tenant)
        .bind(&r.run_id)
        .bind(&r.token_id)
        .bind(r.allowed)
        .bind(record),
        LogEntry::Revoke(r) => {
            let (run_id, token_id) = if r.target == "run" {
                (Some(r.id.as_str()), None)
            } else {
                (None, Some(r.id.as_str()))
            };
            sql(
                "INSERT INTO decision_log (decision_id, kind, time, tenant, run_id, \
                     token_id, allowed, record) VALUES ($1, 'revoke', $2, NULL, $3, $4, NULL, $5)",
            )
            .bind(&r.decision_id)
            .bind(&r.time)
            .bind(run_id)
            .bind(token_id)
            .bind(record)
        }
    })
}

impl crate::PolicyService {
    /// Opens the service as [`open`](Self::open) does, with its counters, revocations and
    /// token owners (and, with `decision_log = "database"`, its decisions) in the database
    /// `database_url` names: by default the SQLite file `<data_dir>/convene.db`, in
    /// memory for `memory`. This is how the standalone service starts.
    ///
    /// # Errors
    ///
    /// As [`open`](Self::open), and [`Error::Database`](crate::Error::Database) when the
    /// database cannot be opened.
    pub async fn connect(config: &crate::Config) -> Result<Self, crate::Error> {
        let database =
            convene_store::open(config.database_url.as_deref(), &config.data_dir).await?;
        match &database {
            Some(db) => tracing::info!(
                backend = %db.backend(),
                url = db.url(),
                "call counters and revocations are stored in the database"
            ),
            None => tracing::info!(
                "call counters and revocations are kept in memory (database_url = \"memory\"): \
                 they are lost at exit"
            ),
        }
        Self::open_with_database(config, crate::Clock::system(), database)
    }
}
