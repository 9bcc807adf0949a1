//! Reading runs, their pages and their events.

use convene_proto::v1;
use convene_store::{Statement, placeholders, sql};

use super::SqlRunStore;
use super::rows::decode;
use crate::store::{Page, StoreError};

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
}
