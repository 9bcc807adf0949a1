//! Commands for runs (see [`RunCommand`]): stored by whichever replica received them,
//! marked done by the commit that applies them; and the events of other services the
//! outbox carries too.

use std::time::{Duration, SystemTime};

use convene_proto::v1;
use convene_store::sql;
use convene_store::time::micros;
use prost::Message as _;

use super::SqlRunStore;
use super::commit::command_done;
use super::rows::{decode, narrow, ts_micros};
use crate::store::{CommandDone, Committed, RunCommand, StoreError};

impl SqlRunStore {
    pub(super) async fn insert_command(&self, command: &RunCommand) -> Result<(), StoreError> {
        let created = command
            .created_at
            .as_ref()
            .map_or_else(|| micros(SystemTime::now()), |t| ts_micros(Some(t)));
        let mut tx = self.begin(false).await?;
        tx.execute(
            sql(
                "INSERT INTO run_commands (command_id, run_id, created_at, body) \
                 VALUES ($1, $2, $3, $4) ON CONFLICT (command_id) DO NOTHING",
            )
            .bind(&command.command_id)
            .bind(&command.run_id)
            .bind(created)
            .bind(command.encode_to_vec()),
        )
        .await?;
        tx.commit().await?;
        Ok(())
    }

    pub(super) async fn read_pending_commands(
        &self,
        run_id: &str,
    ) -> Result<Vec<RunCommand>, StoreError> {
        let rows = self
            .db
            .fetch_all(
                sql(
                    "SELECT body FROM run_commands WHERE run_id = $1 AND NOT done \
                     ORDER BY created_at, command_id",
                )
                .bind(run_id),
            )
            .await?;
        rows.iter().map(|r| decode(r, "run_commands")).collect()
    }

    pub(super) async fn read_runs_with_commands(&self) -> Result<Vec<String>, StoreError> {
        let rows = self
            .db
            .fetch_all(sql(
                "SELECT DISTINCT run_id FROM run_commands WHERE NOT done",
            ))
            .await?;
        rows.iter()
            .map(|r| r.get::<String>("run_id").map_err(StoreError::from))
            .collect()
    }

    pub(super) async fn read_command_outcome(
        &self,
        command_id: &str,
    ) -> Result<Option<CommandDone>, StoreError> {
        let row = self
            .db
            .fetch_optional(
                sql(
                    "SELECT done, outcome_code, outcome_message FROM run_commands \
                     WHERE command_id = $1",
                )
                .bind(command_id),
            )
            .await?;
        let Some(row) = row else {
            return Err(StoreError::NotFound(format!("command {command_id}")));
        };
        if !row.get::<bool>("done")? {
            return Ok(None);
        }
        Ok(Some(CommandDone {
            command_id: command_id.to_owned(),
            code: narrow(
                row.get::<Option<i64>>("outcome_code")?.unwrap_or(0),
                "outcome_code",
            )?,
            message: row
                .get::<Option<String>>("outcome_message")?
                .unwrap_or_default(),
        }))
    }

    pub(super) async fn write_commands_done(&self, done: &[CommandDone]) -> Result<(), StoreError> {
        if done.is_empty() {
            return Ok(());
        }
        let at = micros(SystemTime::now());
        let mut tx = self.begin(false).await?;
        for d in done {
            tx.execute(command_done(d, at)).await?;
        }
        tx.commit().await?;
        Ok(())
    }

    pub(super) async fn claim_waiting_run(
        &self,
        owner: &str,
        run_id: &str,
        lease_ttl: Duration,
    ) -> Result<Option<v1::Run>, StoreError> {
        let now = SystemTime::now();
        let mut tx = self.begin(false).await?;
        let row = tx
            .fetch_optional(
                sql(
                    "UPDATE runs SET claimed_from = owner, owner = $2, lease_until = $3, \
                     lease_epoch = lease_epoch + (CASE WHEN owner = $2 THEN 0 ELSE 1 END) WHERE run_id = $1 \
                     AND waiting AND (owner IS NULL OR lease_until IS NULL OR lease_until <= $4) \
                     RETURNING body, lease_epoch, claimed_from",
                )
                .bind(run_id)
                .bind(owner)
                .bind(micros(now + lease_ttl))
                .bind(micros(now)),
            )
            .await?;
        tx.commit().await?;
        row.as_ref()
            .map(|r| super::leases::claimed(r, owner, now))
            .transpose()
    }

    pub(super) async fn insert_foreign_events(
        &self,
        events: &[v1::CloudEvent],
    ) -> Result<(), StoreError> {
        if events.is_empty() {
            return Ok(());
        }
        let mut tx = self.begin(true).await?;
        let mut added = 0;
        for e in events {
            added += tx
                .execute(
                    sql(
                        "INSERT INTO outbox (event_id, run_id, tenant, type, created_at, body) \
                         VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT (event_id) DO NOTHING",
                    )
                    .bind(&e.id)
                    .bind(&e.correlation_id)
                    .bind(&e.tenant_id)
                    .bind(&e.r#type)
                    .bind(ts_micros(e.time.as_ref()))
                    .bind(e.encode_to_vec()),
                )
                .await?;
        }
        tx.commit().await?;
        if added > 0 {
            let _ = self.notify.send(Committed {
                run_id: String::new(),
                last_sequence: 0,
                cloud: true,
                events: None,
                ended: None,
            });
        }
        Ok(())
    }

    pub(super) async fn write_replica(
        &self,
        replica: &str,
        endpoint: &str,
    ) -> Result<(), StoreError> {
        let mut tx = self.begin(false).await?;
        tx.execute(
            sql(
                "INSERT INTO supervisor_replicas (replica, endpoint, updated_at) \
                 VALUES ($1, $2, $3) ON CONFLICT (replica) \
                 DO UPDATE SET endpoint = $2, updated_at = $3",
            )
            .bind(replica)
            .bind(endpoint)
            .bind(micros(SystemTime::now())),
        )
        .await?;
        tx.commit().await?;
        Ok(())
    }

    pub(super) async fn read_run_owner(
        &self,
        run_id: &str,
    ) -> Result<Option<(String, Option<String>)>, StoreError> {
        let row = self
            .db
            .fetch_optional(
                sql(
                    "SELECT r.owner AS owner, s.endpoint AS endpoint FROM runs r \
                     LEFT JOIN supervisor_replicas s ON s.replica = r.owner \
                     WHERE r.run_id = $1 AND r.owner IS NOT NULL AND r.lease_until > $2",
                )
                .bind(run_id)
                .bind(micros(SystemTime::now())),
            )
            .await?;
        row.map(|r| {
            Ok((
                r.get::<String>("owner")?,
                r.get::<Option<String>>("endpoint")?,
            ))
        })
        .transpose()
    }
}
