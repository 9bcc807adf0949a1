//! Run labels as rows of `run_labels`, what ListRuns' label filter reads: written with
//! the run that carries them (a run's labels never change after it was created), and
//! copied once from the runs stored before the table existed.

use convene_proto::v1;
use convene_store::{Database, InsertRows, Statement, placeholders, sql};

use super::rows::decode;
use crate::store::StoreError;

/// A run's labels go in one statement (in pieces of 32 rows, far inside both back ends'
/// limits on bound parameters). Inserting a row already there changes nothing, so
/// copying labels again is harmless.
static LABEL_ROWS: InsertRows = InsertRows::new(
    "INSERT INTO run_labels (run_id, key, value)",
    3,
    "ON CONFLICT (run_id, key) DO NOTHING",
    32,
);

/// Runs whose labels one transaction of the backfill copies.
const BACKFILL_BATCH: usize = 500;

/// The statements that store `run`'s labels (none when it has none).
pub(super) fn label_rows(run: &v1::Run) -> Vec<Statement> {
    let labels = run.spec.iter().flat_map(|s| &s.labels);
    LABEL_ROWS.all(labels, |insert, (key, value)| {
        insert.bind(&run.run_id).bind(key).bind(value)
    })
}

/// Copies the labels of the runs stored before `run_labels` existed (listed in
/// `run_labels_backfill` by the migration that made the table) into it, a batch of runs
/// per transaction, each run taken off the list in the transaction that copies its
/// labels. Replicas opening the database at once may copy the same run twice, which
/// changes nothing. Returns how many runs it copied.
pub(super) async fn backfill(db: &Database) -> Result<usize, StoreError> {
    let mut copied = 0;
    loop {
        let limit = i64::try_from(BACKFILL_BATCH).unwrap_or(i64::MAX);
        let rows = db
            .fetch_all(
                sql("SELECT r.run_id, r.body FROM run_labels_backfill b \
                     JOIN runs r ON r.run_id = b.run_id ORDER BY b.run_id LIMIT $1")
                .bind(limit),
            )
            .await?;
        if rows.is_empty() {
            return Ok(copied);
        }
        let runs = rows
            .iter()
            .map(|r| decode::<v1::Run>(r, "runs"))
            .collect::<Result<Vec<_>, _>>()?;
        let mut tx = db.begin().await?;
        for run in &runs {
            for insert in label_rows(run) {
                tx.execute(insert).await?;
            }
        }
        let done = runs.iter().map(|r| r.run_id.clone()).fold(
            Statement::built(format!(
                "DELETE FROM run_labels_backfill WHERE run_id IN ({})",
                placeholders(1, runs.len())
            )),
            Statement::bind,
        );
        tx.execute(done).await?;
        tx.commit().await?;
        copied += runs.len();
    }
}
