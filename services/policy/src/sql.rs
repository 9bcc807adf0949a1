//! The policy service's state in SQLite or PostgreSQL (see `convene_store`):
//! [`SqlPolicyState`] for call counters, revocations and issued-token owners, and
//! [`SqlDecisionLog`] for the decision log. Both survive restarts and may be shared by
//! several policy service instances over one database.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::SystemTime;

use async_trait::async_trait;
use convene_store::time::micros;
use convene_store::{Database, sql};

use crate::decision_log::{DecisionLog, LogEntry, LogError};
use crate::state::{CallError, IssuedToken, PolicyState, Revocation, RevokeTarget, StateError};

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
}

impl SqlPolicyState {
    /// State kept in `db` (migrated, as [`Database::connect`] leaves it).
    pub fn new(db: Database) -> Self {
        Self {
            db,
            issued: AtomicU64::new(0),
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

fn target_key(target: &RevokeTarget) -> (&'static str, &str) {
    match target {
        RevokeTarget::Token(id) => ("token", id),
        RevokeTarget::Run(id) => ("run", id),
    }
}

#[async_trait]
impl PolicyState for SqlPolicyState {
    async fn record_issued(&self, token: &IssuedToken) -> Result<(), StateError> {
        self.db
            .execute(
                sql(
                    "INSERT INTO issued_tokens (token_id, run_id, tenant, expires_at) \
                     VALUES ($1, $2, $3, $4) ON CONFLICT (token_id) DO NOTHING",
                )
                .bind(&token.token_id)
                .bind(&token.run_id)
                .bind(&token.tenant)
                .bind(micros(token.expires_at)),
            )
            .await?;
        if self.issued.fetch_add(1, Ordering::Relaxed) % PRUNE_EVERY == PRUNE_EVERY - 1 {
            // Tokens expire within hours; nothing older is worth keeping a row for.
            self.prune(SystemTime::now()).await?;
        }
        Ok(())
    }

    async fn owner_tenant(&self, target: &RevokeTarget) -> Result<Option<String>, StateError> {
        let statement = match target {
            RevokeTarget::Token(id) => {
                sql("SELECT tenant FROM issued_tokens WHERE token_id = $1").bind(id)
            }
            // Every token of a run has the run's tenant.
            RevokeTarget::Run(id) => {
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
        let max = i64::from(max_calls);
        // The first call inserts the counter at 1; later calls increment it only while
        // it is below the limit. A refused increment returns no row.
        let row = if max_calls == 0 {
            None
        } else {
            self.db
                .write_returning(
                    sql(
                        "INSERT INTO call_counters (token_id, used, max_calls, expires_at) \
                         VALUES ($1, 1, $2, $3) \
                         ON CONFLICT (token_id) DO UPDATE SET used = call_counters.used + 1 \
                         WHERE call_counters.used < $2 \
                         RETURNING used",
                    )
                    .bind(token_id)
                    .bind(max)
                    .bind(micros(expires_at)),
                )
                .await?
        };
        match row {
            Some(row) => {
                let used: i64 = row.get("used")?;
                Ok(u32::try_from(used).unwrap_or(u32::MAX))
            }
            None => Err(CallError::LimitExceeded {
                used: self.calls_used(token_id).await?,
                max: max_calls,
            }),
        }
    }

    async fn calls_used(&self, token_id: &str) -> Result<u32, StateError> {
        let row = self
            .db
            .fetch_optional(
                sql("SELECT used FROM call_counters WHERE token_id = $1").bind(token_id),
            )
            .await?;
        let used: i64 = match row {
            Some(r) => r.get("used")?,
            None => 0,
        };
        Ok(u32::try_from(used).unwrap_or(u32::MAX))
    }

    async fn revoke_token(&self, token_id: &str, reason: &str) -> Result<(), StateError> {
        self.revoke(&RevokeTarget::Token(token_id.to_owned()), reason)
            .await
    }

    async fn revoke_run(&self, run_id: &str, reason: &str) -> Result<(), StateError> {
        self.revoke(&RevokeTarget::Run(run_id.to_owned()), reason)
            .await
    }

    async fn is_revoked(
        &self,
        token_id: &str,
        run_id: &str,
    ) -> Result<Option<Revocation>, StateError> {
        let rows = self
            .db
            .fetch_all(
                sql("SELECT kind, reason FROM revocations \
                     WHERE (kind = 'token' AND target_id = $1) \
                        OR (kind = 'run' AND target_id = $2)")
                .bind(token_id)
                .bind(run_id),
            )
            .await?;
        let mut by_run = None;
        for row in rows {
            let kind: String = row.get("kind")?;
            let reason: String = row.get("reason")?;
            if kind == "token" {
                // The token's own revocation comes first.
                return Ok(Some(Revocation {
                    target: RevokeTarget::Token(token_id.to_owned()),
                    reason,
                }));
            }
            by_run = Some(Revocation {
                target: RevokeTarget::Run(run_id.to_owned()),
                reason,
            });
        }
        Ok(by_run)
    }
}

impl SqlPolicyState {
    async fn revoke(&self, target: &RevokeTarget, reason: &str) -> Result<(), StateError> {
        let (kind, id) = target_key(target);
        // Revoking twice keeps the first reason.
        self.db
            .execute(
                sql(
                    "INSERT INTO revocations (kind, target_id, reason, revoked_at) \
                     VALUES ($1, $2, $3, $4) ON CONFLICT (kind, target_id) DO NOTHING",
                )
                .bind(kind)
                .bind(id)
                .bind(reason)
                .bind(micros(SystemTime::now())),
            )
            .await?;
        Ok(())
    }
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
        LogError::Io {
            path: format!("database {}", self.db.url()),
            action,
            detail: detail.to_string(),
        }
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
        let record = serde_json::to_string(&entry).map_err(|e| self.error("encode a record", e))?;
        let statement = match &entry {
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
        };
        self.db
            .execute(statement)
            .await
            .map_err(|e| self.error("append a record", e))?;
        Ok(())
    }
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
        Self::open_with_database(config, crate::clock::system_clock(), database)
    }
}
