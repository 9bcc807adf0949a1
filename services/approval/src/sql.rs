//! [`SqlApprovalStore`]: approval requests in SQLite or PostgreSQL (see
//! `convene_store`), for the approval service's [`ApprovalStore`] contract.
//!
//! The columns are what the store filters, orders and guards on (tenant, requester and
//! idempotency key, filer, run, state, expiry, creation time, version, the execution
//! claim); the rest of a request (parameters, votes, execution record) is its wire
//! message, `convene.v1.ApprovalRequest`, in `body`. The constraints do the work the
//! contract asks for: the unique (requester, idempotency key) makes concurrent filings
//! with one key create one request, and every update is a compare-and-set on `version`.
//!
//! A change and its event are one write (`Database::write`): the row and the
//! `approval_events` row commit together or not at all. An update without an event also
//! requires the stored state to be the one it writes, so no state changes unrecorded.
//! On PostgreSQL a write that appends an event first takes a transaction-scoped advisory
//! lock, so event positions are assigned in commit order and a reader resuming after
//! position `p` never misses an event committed later with a smaller one. SQLite has one
//! writer anyway.

use std::sync::Arc;
use std::time::SystemTime;

use async_trait::async_trait;
use convene_core::permissions::RiskLevel;
use convene_proto::v1;
use convene_store::time::{from_micros, micros};
use convene_store::{Backend, Database, Row, Statement, Tx, sql};
use prost::Message as _;
use tokio::sync::watch;

use crate::config::ConfigError;
use crate::events::{Event, StoredEvent};
use crate::model::{
    ApprovalRequest, Cancellation, Decision, Execution, ExecutionClaim, State, Vote,
};
use crate::store::{ApprovalStore, Created, EventQuery, ListQuery, StoreError, Versioned, Viewer};
use crate::{ApprovalService, Config, MemoryStore};

/// The advisory lock a PostgreSQL write takes before it appends an event. It is the
/// lock the supervisor's run store takes before its appends ("convene" in ASCII): one
/// physical transaction may carry writes of both services (`convene up` shares one
/// database handle), and one lock cannot be taken in opposite orders by two of them.
const APPEND_LOCK: i64 = 0x0063_6f6e_7665_6e65;

impl From<convene_store::Error> for StoreError {
    fn from(e: convene_store::Error) -> Self {
        StoreError::Backend(Box::new(e))
    }
}

/// Approval requests in a database. See the [module docs](self).
#[derive(Debug, Clone)]
pub struct SqlApprovalStore {
    db: Database,
    committed: watch::Sender<u64>,
}

impl SqlApprovalStore {
    /// Requests kept in `db` (migrated, as [`Database::connect`] leaves it).
    pub fn new(db: Database) -> Self {
        Self {
            db,
            committed: watch::Sender::new(0),
        }
    }

    /// What a write that appends an event runs first (see the [module docs](self)).
    fn append_guard(&self) -> Option<Statement> {
        (self.db.backend() == Backend::Postgres)
            .then(|| sql("SELECT pg_advisory_xact_lock($1)").bind(APPEND_LOCK))
    }

    fn announce(&self) {
        self.committed.send_modify(|n| *n += 1);
    }
}

/// Inserts `event` (its `correlation_id` is its request's run).
fn insert_event(event: &Event) -> Statement {
    let cloud = event.cloud();
    sql(
        "INSERT INTO approval_events (event_id, approval_id, tenant, filed_by, run_id, type, \
         created_at, body) VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
    )
    .bind(&cloud.id)
    .bind(event.approval_id())
    .bind(&cloud.tenant_id)
    .bind(event.filed_by())
    .bind(&cloud.correlation_id)
    .bind(&cloud.r#type)
    .bind(micros(event.at()))
    .bind(cloud.encode_to_vec())
}

/// Runs `guard` (when there is one) and then `statement` in `tx`; returns the rows the
/// statement changed.
async fn guarded(
    tx: &mut Tx,
    guard: Option<Statement>,
    statement: Statement,
) -> Result<u64, StoreError> {
    if let Some(guard) = guard {
        tx.execute(guard).await?;
    }
    Ok(tx.execute(statement).await?)
}

/// How a state is written in the `state` column.
fn state_name(state: State) -> &'static str {
    match state {
        State::Pending => "PENDING",
        State::Approved => "APPROVED",
        State::Rejected => "REJECTED",
        State::Expired => "EXPIRED",
        State::Executed => "EXECUTED",
        State::Cancelled => "CANCELLED",
    }
}

fn corrupt(what: impl std::fmt::Display) -> StoreError {
    StoreError::Backend(format!("a stored approval request is unreadable: {what}").into())
}

fn time(ts: Option<prost_types::Timestamp>, field: &str) -> Result<SystemTime, StoreError> {
    let ts = ts.ok_or_else(|| corrupt(format!("{field} is missing")))?;
    SystemTime::try_from(ts).map_err(|e| corrupt(format!("{field}: {e}")))
}

/// The wire message stored in `body`: the request with its state as written (not as
/// seen at some time).
fn body(request: &ApprovalRequest) -> Vec<u8> {
    let mut wire = request.to_proto(request.created_at);
    wire.state = request.state.to_proto() as i32;
    wire.encode_to_vec()
}

/// A state from the `state` column.
fn parse_state(text: &str) -> Result<State, StoreError> {
    [
        State::Pending,
        State::Approved,
        State::Rejected,
        State::Expired,
        State::Executed,
        State::Cancelled,
    ]
    .into_iter()
    .find(|s| state_name(*s) == text)
    .ok_or_else(|| corrupt(format!("unknown state {text:?}")))
}

/// A stored request from its row.
fn from_row(row: &Row) -> Result<Versioned, StoreError> {
    let bytes: Vec<u8> = row.get("body")?;
    let wire = v1::ApprovalRequest::decode(bytes.as_slice()).map_err(corrupt)?;
    let state = parse_state(&row.get::<String>("state")?)?;
    let executing = match row.get::<Option<String>>("executing_by")? {
        Some(by) => Some(ExecutionClaim {
            by,
            started_at: from_micros(row.get::<Option<i64>>("executing_since")?.unwrap_or(0)),
        }),
        None => None,
    };
    let votes = wire
        .votes
        .into_iter()
        .map(|v| {
            Ok(Vote {
                decision: Decision::from_proto(v.decision)
                    .ok_or_else(|| corrupt(format!("vote decision {}", v.decision)))?,
                decided_at: time(v.decided_at, "votes.decided_at")?,
                approver: v.approver,
                parameters_hash: v.parameters_hash,
                comment: v.comment,
            })
        })
        .collect::<Result<_, StoreError>>()?;
    let execution = wire
        .execution
        .map(|e| {
            Ok::<_, StoreError>(Execution {
                executed_at: time(e.executed_at, "execution.executed_at")?,
                executor: e.executor,
                success: e.success,
                output: e.output.unwrap_or_default(),
                executed_by: e.executed_by,
            })
        })
        .transpose()?;
    let cancellation = wire
        .cancellation
        .map(|c| {
            Ok::<_, StoreError>(Cancellation {
                cancelled_at: time(c.cancelled_at, "cancellation.cancelled_at")?,
                cancelled_by: c.cancelled_by,
                reason: c.reason,
            })
        })
        .transpose()?;
    Ok(Versioned {
        version: row.get_u64("version")?,
        request: ApprovalRequest {
            approval_id: wire.approval_id,
            tenant: wire.tenant,
            action: wire.action,
            parameters: wire.parameters.unwrap_or_default(),
            parameters_hash: wire.parameters_hash,
            risk: RiskLevel::from_proto(wire.risk_level),
            idempotency_key: wire.idempotency_key,
            requester: wire.requester,
            filed_by: row.get("filed_by")?,
            evidence_refs: wire.evidence_refs,
            expires_at: time(wire.expires_at, "expires_at")?,
            state,
            votes,
            execution,
            executing,
            cancellation,
            run_id: wire.run_id,
            rationale: wire.rationale,
            created_at: time(wire.created_at, "created_at")?,
        },
    })
}

const COLUMNS: &str = "version, filed_by, state, executing_by, executing_since, body";

#[async_trait]
impl ApprovalStore for SqlApprovalStore {
    async fn create(&self, request: ApprovalRequest, event: Event) -> Result<Created, StoreError> {
        debug_assert_eq!(event.approval_id(), request.approval_id);
        let guard = self.append_guard();
        let insert_request = sql(
            "INSERT INTO approvals (approval_id, tenant, requester, idempotency_key, \
             filed_by, run_id, action, state, expires_at, created_at, version, \
             executing_by, executing_since, body) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, 1, $11, $12, $13) \
             ON CONFLICT DO NOTHING",
        )
        .bind(&request.approval_id)
        .bind(&request.tenant)
        .bind(&request.requester)
        .bind(&request.idempotency_key)
        .bind(&request.filed_by)
        .bind(&request.run_id)
        .bind(&request.action)
        .bind(state_name(request.state))
        .bind(micros(request.expires_at))
        .bind(micros(request.created_at))
        .bind(request.executing.as_ref().map(|c| c.by.clone()))
        .bind(request.executing.as_ref().map(|c| micros(c.started_at)))
        .bind(body(&request));
        let insert_event = insert_event(&event);
        let inserted = self
            .db
            .write::<_, StoreError, _>(move |tx| {
                Box::pin(async move {
                    let inserted = guarded(tx, guard, insert_request).await?;
                    // The event only with the request: an idempotent repeat writes none.
                    if inserted == 1 {
                        tx.execute(insert_event).await?;
                    }
                    Ok(inserted)
                })
            })
            .await?;
        if inserted == 1 {
            self.announce();
            return Ok(Created::New(Versioned {
                version: 1,
                request,
            }));
        }
        // Either constraint refused it: the (requester, key) pair first, as the
        // contract says, then the id.
        let by_key = self
            .db
            .fetch_optional(
                Statement::built(format!(
                    "SELECT {COLUMNS} FROM approvals WHERE requester = $1 AND idempotency_key = $2"
                ))
                .bind(&request.requester)
                .bind(&request.idempotency_key),
            )
            .await?;
        if let Some(row) = by_key {
            return Ok(Created::Existing(from_row(&row)?));
        }
        Err(StoreError::DuplicateId {
            approval_id: request.approval_id,
        })
    }

    async fn get(&self, approval_id: &str) -> Result<Option<Versioned>, StoreError> {
        self.db
            .fetch_optional(
                Statement::built(format!(
                    "SELECT {COLUMNS} FROM approvals WHERE approval_id = $1"
                ))
                .bind(approval_id),
            )
            .await?
            .map(|row| from_row(&row))
            .transpose()
    }

    async fn update(
        &self,
        expected: u64,
        request: ApprovalRequest,
        event: Option<Event>,
    ) -> Result<Versioned, StoreError> {
        debug_assert!(
            event
                .as_ref()
                .is_none_or(|e| e.approval_id() == request.approval_id)
        );
        // Identity, key, filer and creation time never change after creation, so only
        // what can change is written. Without an event the state must stay as stored.
        let text = if event.is_some() {
            "UPDATE approvals SET state = $3, expires_at = $4, executing_by = $5, \
             executing_since = $6, body = $7, version = version + 1 \
             WHERE approval_id = $1 AND version = $2"
        } else {
            "UPDATE approvals SET state = $3, expires_at = $4, executing_by = $5, \
             executing_since = $6, body = $7, version = version + 1 \
             WHERE approval_id = $1 AND version = $2 AND state = $3"
        };
        let update = sql(text)
            .bind(&request.approval_id)
            .bind(expected)
            .bind(state_name(request.state))
            .bind(micros(request.expires_at))
            .bind(request.executing.as_ref().map(|c| c.by.clone()))
            .bind(request.executing.as_ref().map(|c| micros(c.started_at)))
            .bind(body(&request));
        let guard = event.as_ref().and(self.append_guard());
        let insert_event = event.as_ref().map(insert_event);
        let updated = self
            .db
            .write::<_, StoreError, _>(move |tx| {
                Box::pin(async move {
                    let updated = guarded(tx, guard, update).await?;
                    if updated == 1
                        && let Some(insert_event) = insert_event
                    {
                        tx.execute(insert_event).await?;
                    }
                    Ok(updated)
                })
            })
            .await?;
        if updated == 1 {
            if event.is_some() {
                self.announce();
            }
            return Ok(Versioned {
                version: expected + 1,
                request,
            });
        }
        let row = self
            .db
            .fetch_optional(
                sql("SELECT version, state FROM approvals WHERE approval_id = $1")
                    .bind(&request.approval_id),
            )
            .await?;
        let Some(row) = row else {
            return Err(StoreError::Missing {
                approval_id: request.approval_id,
            });
        };
        let actual = row.get_u64("version")?;
        if actual != expected {
            return Err(StoreError::Conflict {
                approval_id: request.approval_id,
                expected,
                actual,
            });
        }
        let stored: String = row.get("state")?;
        Err(StoreError::Unrecorded {
            approval_id: request.approval_id,
            from: parse_state(&stored)?,
            to: request.state,
        })
    }

    async fn pending_expired(
        &self,
        now: SystemTime,
        limit: usize,
    ) -> Result<Vec<Versioned>, StoreError> {
        let rows = self
            .db
            .fetch_all(
                Statement::built(format!(
                    "SELECT {COLUMNS} FROM approvals WHERE state = 'PENDING' AND expires_at <= $1 \
                     ORDER BY expires_at, approval_id LIMIT $2"
                ))
                .bind(micros(now))
                .bind(i64::try_from(limit).unwrap_or(i64::MAX)),
            )
            .await?;
        rows.iter().map(from_row).collect()
    }

    async fn events(&self, query: &EventQuery) -> Result<Vec<StoredEvent>, StoreError> {
        let mut text = String::from(
            "SELECT position, body FROM approval_events \
             WHERE position > $1 AND (tenant = $2 OR filed_by = $3)",
        );
        let mut statement_args: Vec<convene_store::Arg> = vec![
            i64::try_from(query.after).unwrap_or(i64::MAX).into(),
            query.viewer.tenant.clone().into(),
            query.viewer.principal.clone().into(),
        ];
        if let Some(run_id) = &query.run_id {
            statement_args.push(run_id.clone().into());
            text.push_str(&format!(" AND run_id = ${}", statement_args.len()));
        }
        statement_args.push(i64::try_from(query.limit).unwrap_or(i64::MAX).into());
        text.push_str(&format!(
            " ORDER BY position LIMIT ${}",
            statement_args.len()
        ));
        let mut statement = Statement::built(text);
        for a in statement_args {
            statement = statement.bind(a);
        }
        let rows = self.db.fetch_all(statement).await?;
        rows.iter()
            .map(|row| {
                let bytes: Vec<u8> = row.get("body")?;
                Ok(StoredEvent {
                    position: row.get_u64("position")?,
                    event: v1::CloudEvent::decode(bytes.as_slice()).map_err(|e| {
                        StoreError::Backend(
                            format!("a stored approval event is unreadable: {e}").into(),
                        )
                    })?,
                })
            })
            .collect()
    }

    async fn event_position(
        &self,
        event_id: &str,
        viewer: &Viewer,
    ) -> Result<Option<u64>, StoreError> {
        let row = self
            .db
            .fetch_optional(
                sql("SELECT position FROM approval_events \
                     WHERE event_id = $1 AND (tenant = $2 OR filed_by = $3)")
                .bind(event_id)
                .bind(&viewer.tenant)
                .bind(&viewer.principal),
            )
            .await?;
        row.map(|r| r.get_u64("position"))
            .transpose()
            .map_err(Into::into)
    }

    fn subscribe(&self) -> watch::Receiver<u64> {
        self.committed.subscribe()
    }

    async fn list(&self, query: &ListQuery) -> Result<Vec<Versioned>, StoreError> {
        let mut text =
            format!("SELECT {COLUMNS} FROM approvals WHERE (tenant = $1 OR filed_by = $2)");
        let mut args: Vec<convene_store::Arg> = vec![
            query.viewer.tenant.clone().into(),
            query.viewer.principal.clone().into(),
        ];
        /// Binds `value` next and returns its placeholder.
        fn next(args: &mut Vec<convene_store::Arg>, value: convene_store::Arg) -> String {
            args.push(value);
            format!("${}", args.len())
        }
        if let Some(run_id) = &query.run_id {
            let p = next(&mut args, run_id.clone().into());
            text.push_str(&format!(" AND run_id = {p}"));
        }
        if !query.states.is_empty() {
            // States as seen at `now`: a pending request past its expiry is expired.
            let now = next(&mut args, micros(query.now).into());
            let conditions: Vec<String> = query
                .states
                .iter()
                .map(|s| match s {
                    State::Pending => format!("(state = 'PENDING' AND expires_at > {now})"),
                    State::Expired => format!(
                        "(state = 'EXPIRED' OR (state = 'PENDING' AND expires_at <= {now}))"
                    ),
                    // Names from the fixed set above, never from a caller.
                    other => format!("state = '{}'", state_name(*other)),
                })
                .collect();
            text.push_str(&format!(" AND ({})", conditions.join(" OR ")));
        }
        if let Some(cursor) = &query.after {
            let at = next(&mut args, micros(cursor.created_at).into());
            let id = next(&mut args, cursor.approval_id.clone().into());
            text.push_str(&format!(
                " AND (created_at < {at} OR (created_at = {at} AND approval_id < {id}))"
            ));
        }
        let limit = next(
            &mut args,
            i64::try_from(query.limit).unwrap_or(i64::MAX).into(),
        );
        text.push_str(&format!(
            " ORDER BY created_at DESC, approval_id DESC LIMIT {limit}"
        ));
        let mut statement = Statement::built(text);
        for a in args {
            statement = statement.bind(a);
        }
        let rows = self.db.fetch_all(statement).await?;
        rows.iter().map(from_row).collect()
    }
}

impl ApprovalService {
    /// The service as [`from_config`](Self::from_config) builds it, with its requests in
    /// the database `database_url` names: by default the SQLite file
    /// `<data_dir>/convene.db`, in memory for `memory`. This is how the standalone
    /// service starts.
    ///
    /// # Errors
    ///
    /// As [`from_config`](Self::from_config), and [`ConfigError::Database`] when the
    /// database cannot be opened.
    pub async fn connect(config: &Config) -> Result<Self, ConfigError> {
        let service = Self::from_config(config)?;
        let store: Arc<dyn ApprovalStore> = match convene_store::open(
            config.database_url.as_deref(),
            &config.data_dir,
        )
        .await?
        {
            Some(db) => {
                tracing::info!(backend = %db.backend(), url = db.url(), "approval requests are stored in the database");
                Arc::new(SqlApprovalStore::new(db))
            }
            None => {
                tracing::info!(
                    "approval requests are kept in memory (database_url = \"memory\"): they are lost at exit"
                );
                Arc::new(MemoryStore::new())
            }
        };
        Ok(service.with_store(store))
    }
}
