//! Reading runs, their pages and their events.

use convene_proto::v1;
use convene_store::time::micros;
use convene_store::{Arg, Statement, placeholders, sql};

use super::SqlRunStore;
use super::rows::decode;
use crate::store::{Page, RunFilter, StoreError};

impl SqlRunStore {
    pub(super) async fn read_run(&self, run_id: &str) -> Result<Option<v1::Run>, StoreError> {
        self.db
            .fetch_optional(sql("SELECT body FROM runs WHERE run_id = $1").bind(run_id))
            .await?
            .map(|row| decode(&row, "runs"))
            .transpose()
    }

    pub(super) async fn read_tenant(&self, run_id: &str) -> Result<Option<String>, StoreError> {
        self.db
            .fetch_optional(sql("SELECT tenant FROM runs WHERE run_id = $1").bind(run_id))
            .await?
            .map(|row| row.get::<String>("tenant"))
            .transpose()
            .map_err(StoreError::from)
    }

    pub(super) async fn list_runs(
        &self,
        tenant: &str,
        filter: &RunFilter,
        page_size: usize,
        after: Option<&str>,
    ) -> Result<Page, StoreError> {
        // One more than asked tells whether another page exists.
        let limit = i64::try_from(page_size.saturating_add(1)).unwrap_or(i64::MAX);
        let rows = self
            .db
            .fetch_all(list_statement(tenant, filter, after, limit))
            .await?;
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

    pub(super) async fn read_run_events(
        &self,
        run_id: &str,
        after: u64,
    ) -> Result<Vec<v1::RunEvent>, StoreError> {
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

    pub(super) async fn read_cloud_events(
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

    /// The id of the last event of the outbox (by position, its primary key: one index
    /// step), or None when it is empty.
    pub(super) async fn read_newest_cloud_event(&self) -> Result<Option<String>, StoreError> {
        let row = self
            .db
            .fetch_optional(sql(
                "SELECT event_id FROM outbox ORDER BY position DESC LIMIT 1",
            ))
            .await?;
        Ok(row.map(|r| r.get::<String>("event_id")).transpose()?)
    }
}

/// The page of `tenant`'s runs after `after` that meet `filter`, newest first, at most
/// `limit` of them. Every condition is part of the statement, so the database skips
/// what does not match before the limit counts. The rows are read along
/// `runs_by_tenant` (newest first, stopping once the page is full); each label asked
/// for is one lookup of the run's row in `run_labels`.
fn list_statement(tenant: &str, filter: &RunFilter, after: Option<&str>, limit: i64) -> Statement {
    let mut text = String::from("SELECT body FROM runs WHERE tenant = $1");
    let mut args: Vec<Arg> = vec![tenant.into()];
    if let Some(cursor) = after {
        let n = next(&mut args, cursor);
        text.push_str(&format!(" AND run_id < ${n}"));
    }
    if !filter.states.is_empty() {
        text.push_str(&format!(
            " AND state IN ({})",
            placeholders(args.len() + 1, filter.states.len())
        ));
        args.extend(filter.states.iter().map(|s| Arg::from(*s)));
    }
    if let Some(t) = filter.created_after {
        let n = next(&mut args, micros(t));
        text.push_str(&format!(" AND created_at >= ${n}"));
    }
    if let Some(t) = filter.created_before {
        let n = next(&mut args, micros(t));
        text.push_str(&format!(" AND created_at < ${n}"));
    }
    for (key, value) in &filter.labels {
        let k = next(&mut args, key);
        let v = next(&mut args, value);
        text.push_str(&format!(
            " AND EXISTS (SELECT 1 FROM run_labels l WHERE l.run_id = runs.run_id \
             AND l.key = ${k} AND l.value = ${v})"
        ));
    }
    let n = next(&mut args, limit);
    text.push_str(&format!(" ORDER BY run_id DESC LIMIT ${n}"));
    args.into_iter()
        .fold(Statement::built(text), Statement::bind)
}

/// Adds `arg` after the arguments bound so far; the number of its placeholder.
fn next(args: &mut Vec<Arg>, arg: impl Into<Arg>) -> usize {
    args.push(arg.into());
    args.len()
}
