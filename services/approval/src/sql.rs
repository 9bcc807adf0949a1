//! [`SqlApprovalStore`]: approval requests in SQLite or PostgreSQL (see
//! `convene_store`), for the approval service's [`ApprovalStore`] contract.
//!
//! The columns are what the store filters, orders and guards on (tenant, requester and
//! idempotency key, filer, run, state, expiry, creation time, version, the execution
//! claim); the rest of a request (parameters, votes, execution record) is its wire
//! message, `convene.v1.ApprovalRequest`, in `body`. The constraints do the work the
//! contract asks for: the unique (requester, idempotency key) makes concurrent filings
//! with one key create one request, and every update is a compare-and-set on `version`.

use std::sync::Arc;
use std::time::SystemTime;

use async_trait::async_trait;
use convene_core::permissions::RiskLevel;
use convene_proto::v1;
use convene_store::time::{from_micros, micros};
use convene_store::{Database, Row, Statement, sql};
use prost::Message as _;

use crate::config::ConfigError;
use crate::model::{ApprovalRequest, Decision, Execution, ExecutionClaim, State, Vote};
use crate::store::{ApprovalStore, Created, ListQuery, StoreError, Versioned};
use crate::{ApprovalService, Config, MemoryStore};

impl From<convene_store::Error> for StoreError {
    fn from(e: convene_store::Error) -> Self {
        StoreError::Backend(Box::new(e))
    }
}

/// Approval requests in a database. See the [module docs](self).
#[derive(Debug, Clone)]
pub struct SqlApprovalStore {
    db: Database,
}

impl SqlApprovalStore {
    /// Requests kept in `db` (migrated, as [`Database::connect`] leaves it).
    pub fn new(db: Database) -> Self {
        Self { db }
    }
}

/// How a state is written in the `state` column.
fn state_name(state: State) -> &'static str {
    match state {
        State::Pending => "PENDING",
        State::Approved => "APPROVED",
        State::Rejected => "REJECTED",
        State::Expired => "EXPIRED",
        State::Executed => "EXECUTED",
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

/// A stored request from its row.
fn from_row(row: &Row) -> Result<Versioned, StoreError> {
    let bytes: Vec<u8> = row.get("body")?;
    let wire = v1::ApprovalRequest::decode(bytes.as_slice()).map_err(corrupt)?;
    let state_text: String = row.get("state")?;
    let state = [
        State::Pending,
        State::Approved,
        State::Rejected,
        State::Expired,
        State::Executed,
    ]
    .into_iter()
    .find(|s| state_name(*s) == state_text)
    .ok_or_else(|| corrupt(format!("unknown state {state_text:?}")))?;
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
            run_id: wire.run_id,
            rationale: wire.rationale,
            created_at: time(wire.created_at, "created_at")?,
        },
    })
}

const COLUMNS: &str = "version, filed_by, state, executing_by, executing_since, body";

#[async_trait]
impl ApprovalStore for SqlApprovalStore {
    async fn create(&self, request: ApprovalRequest) -> Result<Created, StoreError> {
        let inserted = self
            .db
            .execute(
                sql(
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
                .bind(body(&request)),
            )
            .await?;
        if inserted == 1 {
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
    ) -> Result<Versioned, StoreError> {
        // Identity, key, filer and creation time never change after creation, so only
        // what can change is written.
        let updated = self
            .db
            .execute(
                sql(
                    "UPDATE approvals SET state = $3, expires_at = $4, executing_by = $5, \
                     executing_since = $6, body = $7, version = version + 1 \
                     WHERE approval_id = $1 AND version = $2",
                )
                .bind(&request.approval_id)
                .bind(expected)
                .bind(state_name(request.state))
                .bind(micros(request.expires_at))
                .bind(request.executing.as_ref().map(|c| c.by.clone()))
                .bind(request.executing.as_ref().map(|c| micros(c.started_at)))
                .bind(body(&request)),
            )
            .await?;
        if updated == 1 {
            return Ok(Versioned {
                version: expected + 1,
                request,
            });
        }
        let row = self
            .db
            .fetch_optional(
                sql("SELECT version FROM approvals WHERE approval_id = $1")
                    .bind(&request.approval_id),
            )
            .await?;
        match row {
            Some(row) => Err(StoreError::Conflict {
                approval_id: request.approval_id,
                expected,
                actual: row.get_u64("version")?,
            }),
            None => Err(StoreError::Missing {
                approval_id: request.approval_id,
            }),
        }
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
