//! Commits of other processes: the poll of the event tables that tells this store's
//! subscribers about them, and the relay's cursor in the outbox.

use std::collections::BTreeMap;
use std::time::SystemTime;

use convene_store::time::micros;
use convene_store::{Database, sql};
use tokio::sync::broadcast;

use super::{POLL_INTERVAL, SqlRunStore};
use crate::store::{Committed, StoreError};

/// Rows one poll reads at most; the rest wait for the next one.
pub(super) const POLL_BATCH: i64 = 1000;

/// The ends of the event tables: the last run-event id and outbox position.
pub(super) async fn ends(db: &Database) -> Result<(i64, i64), StoreError> {
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
pub(super) async fn poll(
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
            // Nobody to tell: keep up with the end without reading rows. A subscriber
            // that came while the ends were read may be waiting for a commit they
            // include: then the cursors stay, and the next poll reads that commit.
            ends(&db).await.map(|(e, o)| {
                if notify.receiver_count() == 0 {
                    events_after = e;
                    outbox_after = o;
                }
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

pub(super) async fn poll_once(
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

impl SqlRunStore {
    pub(super) async fn read_relay_cursor(
        &self,
        relay: &str,
    ) -> Result<Option<String>, StoreError> {
        let row = self
            .db
            .fetch_optional(
                sql(
                    "SELECT event_id FROM outbox_relays WHERE relay = $1 OR relay LIKE $2 \
                     ESCAPE '\\' ORDER BY position DESC LIMIT 1",
                )
                .bind(relay)
                .bind(format!("{}@%", like_escaped(relay))),
            )
            .await?;
        Ok(row.map(|r| r.get("event_id")).transpose()?)
    }

    pub(super) async fn acknowledge_event(
        &self,
        relay: &str,
        event_id: &str,
    ) -> Result<(), StoreError> {
        // Several replicas may relay the same outbox: each moves a row of its own (so no
        // replica's frozen transaction holds another's up), and only forward; the cursor
        // is the furthest of them.
        let relay = match &self.creator {
            Some((owner, _)) => format!("{relay}@{owner}"),
            None => relay.to_owned(),
        };
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
                .bind(&relay)
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

/// `text` with LIKE's wildcards and escape character escaped (by a backslash).
fn like_escaped(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        if matches!(c, '\\' | '%' | '_') {
            out.push('\\');
        }
        out.push(c);
    }
    out
}
