//! [`ApprovalService`]: the `convene.v1.Approval` service, and its own in-process handle.
//!
//! # Who may do what
//!
//! | call | caller needs | sees |
//! |---|---|---|
//! | RequestApproval | role `approvals:request`; `on_behalf_of` only as a `service` principal | — |
//! | Decide | a `human` principal with role `approvals:decide`, not the requester | its tenant |
//! | Execute | role `approvals:execute` | its tenant |
//! | GetApproval, ListApprovals | any principal | its tenant, plus the requests it filed |
//!
//! The last row is how the supervisor follows the requests it filed: it lives in the
//! `system` tenant and files requests for a run's principal (`on_behalf_of`), so the
//! request belongs to that principal's tenant; the filer may still read it. Deciding and
//! executing stay strictly within the tenant, and requests of other tenants answer
//! NOT_FOUND, never PERMISSION_DENIED, so their existence does not leak.
//!
//! # Concurrency
//!
//! Every change is a compare-and-set on the stored version, re-applied after a lost
//! race. Execution is guarded twice: a per-request async mutex queues concurrent Execute
//! calls in this process (so they all answer with the one record), and a claim written
//! with a compare-and-set before the executor runs keeps a second instance sharing the
//! store from running the action too. The executor runs in its own task, so a caller
//! that disconnects mid-execution cannot leave the request half-executed.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex, Weak},
    time::Duration,
};

use base64::{Engine as _, engine::general_purpose::URL_SAFE_NO_PAD};
use convene_core::{
    Rule, ValidationError,
    ids::content_hash,
    permissions::RiskLevel,
    time::{from_duration, to_timestamp},
};
use convene_mesh::{
    auth::{Authenticator, Caller},
    policy_file::{Policy, PrincipalKind},
};
use convene_proto::v1::{self, approval_server::Approval};
use prost_types::{Struct, Value, value::Kind};
use tokio::sync::OwnedMutexGuard;
use tonic::{Request, Response, Status};
use tracing::Instrument as _;

use crate::{
    canonical,
    clock::{Clock, SystemClock},
    config::{Config, ConfigError, ExecutorKind},
    error::ApprovalError,
    executor::{Executor, ExecutorError, RecordOnlyExecutor},
    model::{ApprovalRequest, Decision, Execution, ExecutionClaim, State, Vote, VoteEffect},
    store::{
        ApprovalStore, Created, Cursor, ListQuery, MemoryStore, StoreError, Versioned, Viewer,
    },
};

/// Role needed to file approval requests.
pub const ROLE_REQUEST: &str = "approvals:request";
/// Role needed to vote on approval requests.
pub const ROLE_DECIDE: &str = "approvals:decide";
/// Role needed to execute approved requests.
pub const ROLE_EXECUTE: &str = "approvals:execute";

/// Page size when the caller asks for 0.
pub const DEFAULT_PAGE_SIZE: usize = 50;
/// Largest page; larger requests are served this many.
pub const MAX_PAGE_SIZE: usize = 500;

/// Longest action name or idempotency key accepted.
const MAX_NAME_LEN: usize = 256;
/// Compare-and-set attempts before a call gives up with ABORTED.
const MAX_ATTEMPTS: usize = 16;

/// The approval service. It implements the tonic-generated [`Approval`] trait, so an
/// `Arc<ApprovalService>` is an in-process
/// [`ApprovalHandle`](convene_mesh::handles::ApprovalHandle) as well as the server behind
/// [`add_to_server`](crate::add_to_server).
#[derive(Debug)]
pub struct ApprovalService {
    auth: Authenticator,
    policy: Arc<Policy>,
    store: Arc<dyn ApprovalStore>,
    executor: Arc<dyn Executor>,
    clock: Arc<dyn Clock>,
    default_ttl: Duration,
    locks: ExecutionLocks,
}

impl ApprovalService {
    /// A service over `policy` with in-memory storage, the record-only executor, the
    /// system clock and the default time to live of one hour.
    pub fn new(policy: Arc<Policy>) -> Self {
        Self {
            auth: Authenticator::principals_only(policy.clone()),
            policy,
            store: Arc::new(MemoryStore::new()),
            executor: Arc::new(RecordOnlyExecutor),
            clock: Arc::new(SystemClock),
            default_ttl: crate::config::DEFAULT_TTL,
            locks: ExecutionLocks::default(),
        }
    }

    /// A service as `config` describes it: its policy (with development credentials when
    /// enabled), time to live and executor.
    ///
    /// # Errors
    ///
    /// The configuration is invalid or the policy cannot be loaded.
    pub fn from_config(config: &Config) -> Result<Self, ConfigError> {
        config.validate()?;
        let executor: Arc<dyn Executor> = match config.executor {
            ExecutorKind::RecordOnly => Arc::new(RecordOnlyExecutor),
        };
        Ok(Self::new(config.load_policy()?)
            .with_default_ttl(config.default_ttl)
            .with_executor(executor))
    }

    /// Uses `clock` for "now" (creation, expiry, votes, executions).
    #[must_use]
    pub fn with_clock(mut self, clock: impl Clock + 'static) -> Self {
        self.clock = Arc::new(clock);
        self
    }

    /// Runs approved actions with `executor`.
    #[must_use]
    pub fn with_executor(mut self, executor: Arc<dyn Executor>) -> Self {
        self.executor = executor;
        self
    }

    /// Keeps requests in `store`.
    #[must_use]
    pub fn with_store(mut self, store: Arc<dyn ApprovalStore>) -> Self {
        self.store = store;
        self
    }

    /// Gives requests that do not set `expires_in` this time to live.
    #[must_use]
    pub fn with_default_ttl(mut self, ttl: Duration) -> Self {
        self.default_ttl = ttl;
        self
    }

    /// The policy callers are authenticated against.
    pub fn policy(&self) -> &Arc<Policy> {
        &self.policy
    }

    async fn request_approval_inner(
        &self,
        caller: &Caller,
        msg: v1::RequestApprovalRequest,
    ) -> Result<(ApprovalRequest, bool), Status> {
        let filer = caller.require_role(ROLE_REQUEST, "request approvals")?;
        let requester = if msg.on_behalf_of.is_empty() || msg.on_behalf_of == filer.id {
            filer.as_ref()
        } else {
            if filer.kind != PrincipalKind::Service {
                return Err(ApprovalError::NotPermitted(format!(
                    "only service principals may set on_behalf_of; {} is a person: leave \
                     on_behalf_of empty to request approval for yourself",
                    filer.id
                ))
                .into());
            }
            self.policy
                .principals
                .get(&msg.on_behalf_of)
                .ok_or_else(|| {
                    invalid(
                        "on_behalf_of",
                        Rule::UnknownReference,
                        format!(
                            "no principal {:?} in the policy file; name the run's principal",
                            msg.on_behalf_of
                        ),
                    )
                })?
        };

        required("action", &msg.action)?;
        bounded("action", &msg.action)?;
        required("idempotency_key", &msg.idempotency_key)?;
        bounded("idempotency_key", &msg.idempotency_key)?;
        if let Some(i) = msg.evidence_refs.iter().position(|r| r.trim().is_empty()) {
            return Err(invalid(
                &format!("evidence_refs[{i}]"),
                Rule::Required,
                "evidence ids must not be empty",
            ));
        }
        let risk = self.effective_risk(&msg.action, msg.risk_level)?;
        let parameters = msg.parameters.unwrap_or_default();
        let parameters_hash =
            canonical::parameters_hash(&parameters).map_err(ApprovalError::from)?;

        let now = self.clock.now();
        let ttl = match &msg.expires_in {
            Some(d) => from_duration(d, "expires_in").map_err(ApprovalError::from)?,
            None => Duration::ZERO,
        };
        let ttl = if ttl.is_zero() { self.default_ttl } else { ttl };
        let expires_at = now.checked_add(ttl).ok_or_else(|| {
            invalid(
                "expires_in",
                Rule::Range,
                "is too long; ask for hours or days",
            )
        })?;

        let request = ApprovalRequest {
            approval_id: format!("apr-{}", uuid::Uuid::now_v7()),
            tenant: requester.tenant.clone(),
            action: msg.action,
            parameters,
            parameters_hash,
            risk,
            idempotency_key: msg.idempotency_key,
            requester: requester.id.clone(),
            filed_by: filer.id.clone(),
            evidence_refs: msg.evidence_refs,
            expires_at,
            state: State::Pending,
            votes: Vec::new(),
            execution: None,
            executing: None,
            run_id: msg.run_id,
            rationale: msg.rationale,
            created_at: now,
        };
        match self
            .store
            .create(request.clone())
            .await
            .map_err(ApprovalError::from)?
        {
            Created::New(stored) => {
                let r = &stored.request;
                tracing::info!(
                    approval_id = %r.approval_id,
                    tenant = %r.tenant,
                    action = %r.action,
                    risk = %r.risk,
                    requester = %r.requester,
                    filed_by = %r.filed_by,
                    run_id = %r.run_id,
                    parameters_hash = %r.parameters_hash,
                    "approval requested"
                );
                Ok((stored.request, true))
            }
            Created::Existing(stored) => {
                let existing = stored.request;
                if existing.action == request.action
                    && existing.parameters_hash == request.parameters_hash
                {
                    Ok((existing, false))
                } else {
                    Err(ApprovalError::KeyReused {
                        key: request.idempotency_key,
                        existing: existing.approval_id,
                    }
                    .into())
                }
            }
        }
    }

    /// The risk an action is held at: what was asked, raised to the catalog's level when
    /// the catalog knows the action. Unset asks count as R3 (fail closed).
    fn effective_risk(&self, action: &str, asked: i32) -> Result<RiskLevel, Status> {
        if asked != 0 && v1::RiskLevel::try_from(asked).is_err() {
            return Err(invalid(
                "risk_level",
                Rule::UnknownEnum,
                format!("unknown risk level {asked}; use RISK_LEVEL_R2 or RISK_LEVEL_R3"),
            ));
        }
        let asked = RiskLevel::from_proto(asked);
        let risk = match self.policy.risk_of(action) {
            Some(catalog) if catalog > asked => {
                tracing::info!(
                    action,
                    asked = %asked,
                    catalog = %catalog,
                    "risk level raised to the action catalog's"
                );
                catalog
            }
            Some(_) => asked,
            None => {
                tracing::warn!(
                    action,
                    risk = %asked,
                    "action is not in the policy's action catalog; keeping the requested risk level"
                );
                asked
            }
        };
        if risk < RiskLevel::R2 {
            return Err(ApprovalError::NoApprovalNeeded {
                action: action.to_owned(),
                risk,
            }
            .into());
        }
        Ok(risk)
    }

    async fn decide_inner(
        &self,
        caller: &Caller,
        msg: v1::DecideRequest,
    ) -> Result<ApprovalRequest, Status> {
        let approver = caller.require_role(ROLE_DECIDE, "decide approval requests")?;
        if approver.kind != PrincipalKind::Human {
            return Err(ApprovalError::NotPermitted(format!(
                "approvers must be people; {} is a service principal",
                approver.id
            ))
            .into());
        }
        required("approval_id", &msg.approval_id)?;
        let decision = match Decision::from_proto(msg.decision) {
            Some(d) => d,
            None if msg.decision == 0 => {
                return Err(invalid(
                    "decision",
                    Rule::Required,
                    "set VOTE_DECISION_APPROVE or VOTE_DECISION_REJECT",
                ));
            }
            None => {
                return Err(invalid(
                    "decision",
                    Rule::UnknownEnum,
                    format!(
                        "unknown decision {}; use VOTE_DECISION_APPROVE or VOTE_DECISION_REJECT",
                        msg.decision
                    ),
                ));
            }
        };
        required_hash(&msg.parameters_hash)?;

        for _ in 0..MAX_ATTEMPTS {
            let stored = self
                .load_in_tenant(&msg.approval_id, &approver.tenant)
                .await?;
            if stored.request.requester == approver.id {
                return Err(ApprovalError::NotPermitted(format!(
                    "the requester cannot approve their own request (nor vote on it): {} \
                     requested {}; another approver must decide",
                    approver.id, msg.approval_id
                ))
                .into());
            }
            let now = self.clock.now();
            let vote = Vote {
                approver: approver.id.clone(),
                decision,
                parameters_hash: msg.parameters_hash.clone(),
                comment: msg.comment.clone(),
                decided_at: now,
            };
            let mut request = stored.request.clone();
            match request.cast_vote(vote, now) {
                Ok(VoteEffect::Repeated) => return Ok(stored.request),
                Ok(VoteEffect::Recorded(state)) => {
                    match self.store.update(stored.version, request).await {
                        Ok(updated) => {
                            tracing::info!(
                                approval_id = %msg.approval_id,
                                approver = %approver.id,
                                decision = decision.as_str(),
                                state = %state,
                                approvals_missing = updated.request.approvals_missing(),
                                "approval vote recorded"
                            );
                            return Ok(updated.request);
                        }
                        Err(StoreError::Conflict { .. }) => continue,
                        Err(e) => return Err(ApprovalError::from(e).into()),
                    }
                }
                Err(e @ ApprovalError::Expired { .. }) => {
                    self.persist_expiry(stored).await;
                    return Err(e.into());
                }
                Err(e) => return Err(e.into()),
            }
        }
        Err(ApprovalError::Contended {
            approval_id: msg.approval_id,
        }
        .into())
    }

    /// Writes down that a pending request expired. Best effort: readers already see it
    /// as expired ([`ApprovalRequest::state_at`]), so losing a race here changes nothing.
    async fn persist_expiry(&self, stored: Versioned) {
        if stored.request.state != State::Pending {
            return;
        }
        let mut expired = stored.request;
        expired.state = State::Expired;
        let approval_id = expired.approval_id.clone();
        match self.store.update(stored.version, expired).await {
            Ok(_) => tracing::info!(%approval_id, "approval request expired"),
            Err(StoreError::Conflict { .. }) => {}
            Err(error) => {
                tracing::warn!(%approval_id, %error, "cannot record the expiry of an approval request");
            }
        }
    }

    async fn execute_inner(
        &self,
        caller: &Caller,
        msg: v1::ApprovalExecuteRequest,
    ) -> Result<(Execution, bool), Status> {
        let principal = caller.require_role(ROLE_EXECUTE, "execute approved requests")?;
        required("approval_id", &msg.approval_id)?;
        required_hash(&msg.parameters_hash)?;

        // Held until the execution is recorded (it moves into the executing task), so
        // concurrent calls for this request wait and then answer with the record.
        let guard = self.locks.acquire(&msg.approval_id).await;
        let mut attempts = 0;
        let claimed = loop {
            attempts += 1;
            if attempts > MAX_ATTEMPTS {
                return Err(ApprovalError::Contended {
                    approval_id: msg.approval_id,
                }
                .into());
            }
            let stored = self
                .load_in_tenant(&msg.approval_id, &principal.tenant)
                .await?;
            let request = &stored.request;
            if msg.parameters_hash != request.parameters_hash {
                return Err(ApprovalError::ParametersChanged {
                    approval_id: msg.approval_id,
                    quoted: msg.parameters_hash,
                    current: request.parameters_hash.clone(),
                }
                .into());
            }
            if let Some(execution) = &request.execution {
                return Ok((execution.clone(), false));
            }
            if request.executing.is_some() {
                return Err(ApprovalError::ExecutionInProgress {
                    approval_id: msg.approval_id,
                }
                .into());
            }
            let now = self.clock.now();
            if let Some(reason) = request.not_executable_reason(now) {
                return Err(ApprovalError::NotApproved {
                    approval_id: msg.approval_id,
                    reason,
                }
                .into());
            }
            let mut claim = stored.request.clone();
            claim.executing = Some(ExecutionClaim {
                by: principal.id.clone(),
                started_at: now,
            });
            match self.store.update(stored.version, claim).await {
                Ok(claimed) => break claimed,
                Err(StoreError::Conflict { .. }) => {}
                Err(e) => return Err(ApprovalError::from(e).into()),
            }
        };

        let run = ExecutionRun {
            store: self.store.clone(),
            executor: self.executor.clone(),
            clock: self.clock.clone(),
            executed_by: principal.id.clone(),
        };
        // A task of its own, so the action runs to completion and is recorded even when
        // the caller goes away mid-call.
        let task = tokio::spawn(run.run(claimed, guard).in_current_span());
        match task.await {
            Ok(result) => Ok((result?, true)),
            Err(join) => Err(ApprovalError::Internal(format!(
                "the executor task for approval request {} failed: {join}",
                msg.approval_id
            ))
            .into()),
        }
    }

    async fn get_inner(
        &self,
        caller: &Caller,
        msg: v1::GetApprovalRequest,
    ) -> Result<ApprovalRequest, Status> {
        let principal = caller.require_principal("read approval requests")?;
        required("approval_id", &msg.approval_id)?;
        let viewer = Viewer {
            tenant: principal.tenant.clone(),
            principal: principal.id.clone(),
        };
        match self
            .store
            .get(&msg.approval_id)
            .await
            .map_err(ApprovalError::from)?
        {
            Some(stored) if viewer.can_see(&stored.request) => Ok(stored.request),
            _ => Err(ApprovalError::NotFound {
                approval_id: msg.approval_id,
            }
            .into()),
        }
    }

    async fn list_inner(
        &self,
        caller: &Caller,
        msg: v1::ListApprovalsRequest,
    ) -> Result<(Vec<ApprovalRequest>, String), Status> {
        let principal = caller.require_principal("list approval requests")?;
        let mut states = Vec::with_capacity(msg.states.len());
        for (i, &s) in msg.states.iter().enumerate() {
            let state = State::from_proto(s).ok_or_else(|| {
                invalid(
                    &format!("states[{i}]"),
                    Rule::UnknownEnum,
                    format!("{s} is not a state to filter by; use APPROVAL_STATE_PENDING ... APPROVAL_STATE_EXECUTED"),
                )
            })?;
            if !states.contains(&state) {
                states.push(state);
            }
        }
        let run_id = (!msg.run_id.is_empty()).then_some(msg.run_id);
        let page_size = match usize::try_from(msg.page_size).unwrap_or(MAX_PAGE_SIZE) {
            0 => DEFAULT_PAGE_SIZE,
            n => n.min(MAX_PAGE_SIZE),
        };
        let viewer = Viewer {
            tenant: principal.tenant.clone(),
            principal: principal.id.clone(),
        };
        let filters = PageFilters {
            viewer: &viewer,
            states: &states,
            run_id: run_id.as_deref(),
        };
        let after = if msg.page_token.is_empty() {
            None
        } else {
            Some(filters.decode(&msg.page_token)?)
        };
        let query = ListQuery {
            viewer: viewer.clone(),
            states: states.clone(),
            run_id: run_id.clone(),
            now: self.clock.now(),
            after,
            // One more than a page tells whether another page follows.
            limit: page_size + 1,
        };
        let mut page: Vec<ApprovalRequest> = self
            .store
            .list(&query)
            .await
            .map_err(ApprovalError::from)?
            .into_iter()
            .map(|stored| stored.request)
            .collect();
        let next_page_token = if page.len() > page_size {
            page.truncate(page_size);
            page.last()
                .map(|last| filters.encode(last))
                .unwrap_or_default()
        } else {
            String::new()
        };
        Ok((page, next_page_token))
    }

    /// The request with `approval_id` if it belongs to `tenant`; NOT_FOUND otherwise.
    async fn load_in_tenant(&self, approval_id: &str, tenant: &str) -> Result<Versioned, Status> {
        match self
            .store
            .get(approval_id)
            .await
            .map_err(ApprovalError::from)?
        {
            Some(stored) if stored.request.tenant == tenant => Ok(stored),
            _ => Err(ApprovalError::NotFound {
                approval_id: approval_id.to_owned(),
            }
            .into()),
        }
    }
}

/// What the executing task needs, owned, so it outlives the call that started it.
struct ExecutionRun {
    store: Arc<dyn ApprovalStore>,
    executor: Arc<dyn Executor>,
    clock: Arc<dyn Clock>,
    executed_by: String,
}

impl ExecutionRun {
    /// Runs the claimed request's action and records the outcome. `_guard` keeps other
    /// Execute calls for the request waiting until the record is written.
    async fn run(
        self,
        claimed: Versioned,
        _guard: OwnedMutexGuard<()>,
    ) -> Result<Execution, ApprovalError> {
        let approval_id = claimed.request.approval_id.clone();
        let action = claimed.request.action.clone();
        let outcome = self.executor.execute(&claimed.request).await;
        let executed_at = self.clock.now();
        let (success, output) = match outcome {
            Ok(outcome) => (outcome.success, outcome.output),
            Err(ExecutorError::Failed(detail)) => (false, error_output(&detail)),
            Err(ExecutorError::NotStarted(detail)) => {
                self.release(claimed).await?;
                tracing::warn!(%approval_id, %detail, "executor could not start the action");
                return Err(ApprovalError::ExecutorUnavailable {
                    executor: self.executor.name().to_owned(),
                    action,
                    detail,
                });
            }
        };
        let execution = Execution {
            executor: self.executor.name().to_owned(),
            success,
            output,
            executed_at,
            executed_by: self.executed_by.clone(),
        };
        let mut current = claimed;
        for _ in 0..MAX_ATTEMPTS {
            let mut done = current.request.clone();
            done.execution = Some(execution.clone());
            done.executing = None;
            done.state = State::Executed;
            match self.store.update(current.version, done).await {
                Ok(_) => {
                    tracing::info!(
                        %approval_id,
                        %action,
                        executor = %execution.executor,
                        success,
                        executed_by = %execution.executed_by,
                        "approved action executed"
                    );
                    return Ok(execution);
                }
                Err(StoreError::Conflict { .. }) => {
                    current =
                        self.store
                            .get(&approval_id)
                            .await?
                            .ok_or_else(|| StoreError::Missing {
                                approval_id: approval_id.clone(),
                            })?;
                }
                Err(e) => {
                    tracing::error!(
                        %approval_id,
                        success,
                        output = ?execution.output,
                        error = %e,
                        "action executed but its record could not be written; the request stays claimed"
                    );
                    return Err(e.into());
                }
            }
        }
        Err(ApprovalError::Contended { approval_id })
    }

    /// Drops the execution claim after the executor did nothing, so the request can be
    /// executed again.
    async fn release(&self, claimed: Versioned) -> Result<(), ApprovalError> {
        let mut current = claimed;
        for _ in 0..MAX_ATTEMPTS {
            let mut released = current.request.clone();
            released.executing = None;
            match self.store.update(current.version, released).await {
                Ok(_) => return Ok(()),
                Err(StoreError::Conflict { .. }) => {
                    current = self
                        .store
                        .get(&current.request.approval_id)
                        .await?
                        .ok_or_else(|| StoreError::Missing {
                            approval_id: current.request.approval_id.clone(),
                        })?;
                }
                Err(e) => return Err(e.into()),
            }
        }
        Err(ApprovalError::Contended {
            approval_id: current.request.approval_id,
        })
    }
}

/// The output recorded for an execution that failed: `{"error": detail}`.
fn error_output(detail: &str) -> Struct {
    Struct {
        fields: [(
            "error".to_owned(),
            Value {
                kind: Some(Kind::StringValue(detail.to_owned())),
            },
        )]
        .into_iter()
        .collect(),
    }
}

/// One async mutex per request being executed, created on demand and forgotten when
/// nobody holds or waits for it.
#[derive(Debug, Default)]
struct ExecutionLocks {
    locks: Mutex<HashMap<String, Weak<tokio::sync::Mutex<()>>>>,
}

impl ExecutionLocks {
    async fn acquire(&self, approval_id: &str) -> OwnedMutexGuard<()> {
        let lock = {
            let mut locks = self.locks.lock().unwrap_or_else(|e| e.into_inner());
            // Entries nobody holds any more are dead weight; the map stays as small as
            // the set of requests being executed right now.
            locks.retain(|_, lock| lock.strong_count() > 0);
            if let Some(lock) = locks.get(approval_id).and_then(Weak::upgrade) {
                lock
            } else {
                let lock = Arc::new(tokio::sync::Mutex::new(()));
                locks.insert(approval_id.to_owned(), Arc::downgrade(&lock));
                lock
            }
        };
        lock.lock_owned().await
    }
}

/// The filters a page token is bound to, so a token cannot resume a different listing.
struct PageFilters<'a> {
    viewer: &'a Viewer,
    states: &'a [State],
    run_id: Option<&'a str>,
}

impl PageFilters<'_> {
    const VERSION: &'static str = "p1";

    fn fingerprint(&self) -> String {
        let mut states: Vec<String> = self.states.iter().map(ToString::to_string).collect();
        states.sort();
        let text = format!(
            "{}\0{}\0{}\0{}",
            self.viewer.tenant,
            self.viewer.principal,
            states.join(","),
            self.run_id.unwrap_or("")
        );
        content_hash(text.as_bytes())[7..23].to_owned()
    }

    /// An opaque token resuming after `last`.
    fn encode(&self, last: &ApprovalRequest) -> String {
        let at = to_timestamp(last.created_at);
        let text = format!(
            "{}|{}|{}|{}|{}",
            Self::VERSION,
            self.fingerprint(),
            at.seconds,
            at.nanos,
            last.approval_id
        );
        URL_SAFE_NO_PAD.encode(text)
    }

    fn decode(&self, token: &str) -> Result<Cursor, ApprovalError> {
        const FOREIGN: &str = "it is not a page token this service issued";
        let bytes = URL_SAFE_NO_PAD
            .decode(token)
            .map_err(|_| ApprovalError::PageToken(FOREIGN))?;
        let text = String::from_utf8(bytes).map_err(|_| ApprovalError::PageToken(FOREIGN))?;
        let mut parts = text.splitn(5, '|');
        let (Some(version), Some(fingerprint), Some(seconds), Some(nanos), Some(approval_id)) = (
            parts.next(),
            parts.next(),
            parts.next(),
            parts.next(),
            parts.next(),
        ) else {
            return Err(ApprovalError::PageToken(FOREIGN));
        };
        if version != Self::VERSION {
            return Err(ApprovalError::PageToken(FOREIGN));
        }
        if fingerprint != self.fingerprint() {
            return Err(ApprovalError::PageToken(
                "it was issued for other filters or another caller",
            ));
        }
        let timestamp = prost_types::Timestamp {
            seconds: seconds
                .parse()
                .map_err(|_| ApprovalError::PageToken(FOREIGN))?,
            nanos: nanos
                .parse()
                .map_err(|_| ApprovalError::PageToken(FOREIGN))?,
        };
        let created_at = convene_core::time::from_timestamp(&timestamp, "page_token")
            .map_err(|_| ApprovalError::PageToken(FOREIGN))?;
        Ok(Cursor {
            created_at,
            approval_id: approval_id.to_owned(),
        })
    }
}

fn invalid(field: &str, rule: Rule, message: impl Into<String>) -> Status {
    ApprovalError::Invalid(ValidationError::new(field, rule, message)).into()
}

fn required(field: &str, value: &str) -> Result<(), Status> {
    if value.trim().is_empty() {
        return Err(invalid(field, Rule::Required, "must not be empty"));
    }
    Ok(())
}

fn bounded(field: &str, value: &str) -> Result<(), Status> {
    if value.len() > MAX_NAME_LEN {
        return Err(invalid(
            field,
            Rule::TooLong,
            format!(
                "is {} bytes; at most {MAX_NAME_LEN} are allowed",
                value.len()
            ),
        ));
    }
    Ok(())
}

fn required_hash(hash: &str) -> Result<(), Status> {
    if hash.is_empty() {
        return Err(invalid(
            "parameters_hash",
            Rule::Required,
            "copy parameters_hash from the approval request you reviewed",
        ));
    }
    Ok(())
}

#[tonic::async_trait]
impl Approval for ApprovalService {
    async fn request_approval(
        &self,
        request: Request<v1::RequestApprovalRequest>,
    ) -> Result<Response<v1::RequestApprovalResponse>, Status> {
        let caller = self.auth.authenticate(&request).await?;
        let msg = request.into_inner();
        let span = tracing::info_span!(
            "approval.request",
            convene.service = "approval",
            caller = %caller.principal_id(),
            convene.approval.action = %msg.action,
            convene.run.id = %msg.run_id,
            convene.approval.id = tracing::field::Empty,
            convene.approval.risk = tracing::field::Empty,
            convene.approval.required = tracing::field::Empty,
            convene.approval.created = tracing::field::Empty,
        );
        let filed = self
            .request_approval_inner(&caller, msg)
            .instrument(span.clone())
            .await;
        let (approval, created) = match filed {
            Ok(filed) => filed,
            Err(status) => {
                convene_telemetry::set_error(&span, status.message().to_owned());
                return Err(status);
            }
        };
        span.record("convene.approval.id", approval.approval_id.as_str());
        span.record(
            "convene.approval.risk",
            approval
                .risk
                .to_proto()
                .as_str_name()
                .trim_start_matches("RISK_LEVEL_"),
        );
        span.record("convene.approval.required", approval.approvals_required());
        span.record("convene.approval.created", created);
        Ok(Response::new(v1::RequestApprovalResponse {
            approval: Some(approval.to_proto(self.clock.now())),
            created,
        }))
    }

    async fn decide(
        &self,
        request: Request<v1::DecideRequest>,
    ) -> Result<Response<v1::DecideResponse>, Status> {
        let caller = self.auth.authenticate(&request).await?;
        let approval = self.decide_inner(&caller, request.into_inner()).await?;
        Ok(Response::new(v1::DecideResponse {
            approval: Some(approval.to_proto(self.clock.now())),
        }))
    }

    async fn get_approval(
        &self,
        request: Request<v1::GetApprovalRequest>,
    ) -> Result<Response<v1::GetApprovalResponse>, Status> {
        let caller = self.auth.authenticate(&request).await?;
        let approval = self.get_inner(&caller, request.into_inner()).await?;
        Ok(Response::new(v1::GetApprovalResponse {
            approval: Some(approval.to_proto(self.clock.now())),
        }))
    }

    async fn list_approvals(
        &self,
        request: Request<v1::ListApprovalsRequest>,
    ) -> Result<Response<v1::ListApprovalsResponse>, Status> {
        let caller = self.auth.authenticate(&request).await?;
        let (approvals, next_page_token) = self.list_inner(&caller, request.into_inner()).await?;
        let now = self.clock.now();
        Ok(Response::new(v1::ListApprovalsResponse {
            approvals: approvals.iter().map(|a| a.to_proto(now)).collect(),
            next_page_token,
        }))
    }

    async fn execute(
        &self,
        request: Request<v1::ApprovalExecuteRequest>,
    ) -> Result<Response<v1::ApprovalExecuteResponse>, Status> {
        let caller = self.auth.authenticate(&request).await?;
        let (execution, executed_now) = self.execute_inner(&caller, request.into_inner()).await?;
        Ok(Response::new(v1::ApprovalExecuteResponse {
            execution: Some(execution.to_proto()),
            executed_now,
        }))
    }
}
