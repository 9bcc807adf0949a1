//! Run leases: claiming free and expired unfinished runs, renewing and releasing the
//! leases this replica holds.

use std::time::{Duration, SystemTime};

use convene_proto::v1;
use convene_store::time::micros;
use convene_store::{Backend, Statement, placeholders, sql};

use super::SqlRunStore;
use super::rows::decode;
use crate::store::StoreError;

/// Leases free and expired unfinished runs on SQLite (see [`RunStore::claim_runs`]).
///
/// Only through the partial index of unfinished runs: left to itself, SQLite walks the
/// primary key to return the runs in `run_id` order, reading every run ever stored,
/// finished or not. That was 42-55 ms with 42,000 runs in the file, holding the write
/// lock, at every claim (every 5 s by default), and grows with the database; through
/// the index it reads the unfinished runs only and sorts those.
pub(super) const CLAIM_SQLITE: &str = "UPDATE runs SET claimed_from = owner, owner = $1, \
     lease_until = $2, lease_epoch = lease_epoch + (CASE WHEN owner = $1 THEN 0 ELSE 1 END) WHERE run_id IN (\
     SELECT run_id FROM runs INDEXED BY runs_unfinished WHERE NOT terminal \
     AND (owner IS NULL OR lease_until IS NULL OR lease_until <= $3) \
     ORDER BY run_id LIMIT $4) RETURNING body, lease_epoch, claimed_from";

/// The unfinished runs on SQLite, through the same index as [`CLAIM_SQLITE`].
pub(super) const UNFINISHED_SQLITE: &str =
    "SELECT body FROM runs INDEXED BY runs_unfinished WHERE NOT terminal ORDER BY run_id";

/// A run as a claim's `RETURNING body, lease_epoch, claimed_from` gives it: with its new
/// lease epoch, its owner, and the claim added to its history (stored with the run's
/// next commit).
pub(super) fn claimed(
    row: &convene_store::Row,
    owner: &str,
    at: SystemTime,
) -> Result<v1::Run, StoreError> {
    let mut run: v1::Run = decode(row, "runs")?;
    let epoch: i64 = row.get("lease_epoch")?;
    let previous: Option<String> = row.get("claimed_from")?;
    run.lease_epoch = u64::try_from(epoch).unwrap_or(0);
    run.owner = owner.to_owned();
    run.claims.push(v1::RunClaim {
        epoch: run.lease_epoch,
        replica: owner.to_owned(),
        // A replica that claims its own expired lease (a restart under a stable id)
        // takes it from no one else.
        previous_replica: previous.filter(|p| p != owner).unwrap_or_default(),
        at: Some(convene_core::time::to_timestamp(at)),
    });
    Ok(run)
}

impl SqlRunStore {
    pub(super) async fn read_unfinished(&self) -> Result<Vec<v1::Run>, StoreError> {
        let unfinished = match self.db.backend() {
            Backend::Sqlite => UNFINISHED_SQLITE,
            Backend::Postgres => "SELECT body FROM runs WHERE NOT terminal ORDER BY run_id",
        };
        let rows = self.db.fetch_all(sql(unfinished)).await?;
        rows.iter().map(|r| decode(r, "runs")).collect()
    }

    pub(super) async fn claim(
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
                "UPDATE runs SET claimed_from = owner, owner = $1, lease_until = $2, \
                 lease_epoch = lease_epoch + (CASE WHEN owner = $1 THEN 0 ELSE 1 END) WHERE run_id IN (\
                 SELECT run_id FROM runs WHERE NOT terminal \
                 AND (owner IS NULL OR lease_until IS NULL OR lease_until <= $3) \
                 ORDER BY run_id LIMIT $4 FOR UPDATE SKIP LOCKED) \
                 RETURNING body, lease_epoch, claimed_from",
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
            .map(|r| claimed(r, owner, now))
            .collect::<Result<Vec<_>, _>>()?;
        runs.sort_by(|a, b| a.run_id.cmp(&b.run_id));
        Ok(runs)
    }

    pub(super) async fn renew(
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

    pub(super) async fn release_lease(
        &self,
        owner: &str,
        run_id: &str,
    ) -> Result<bool, StoreError> {
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
}

#[cfg(test)]
mod tests {
    use convene_store::Database;

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
