//! [`ApprovalService`]: the `convene.v1.Approval` service, and its own in-process handle.
//!
//! # Who may do what
//!
//! | call | caller needs | sees |
//! |---|---|---|
//! | RequestApproval | role `approvals:request`; `on_behalf_of` only as a `service` principal | — |
//! | Decide | a `human` principal with role `approvals:decide`, not the requester | its tenant |
//! | Execute | role `approvals:execute` | its tenant |
//! | CancelApproval | the principal that filed the request, or its requester | its tenant, plus the requests it filed |
//! | GetApproval, ListApprovals, WatchEvents | any principal | its tenant, plus the requests it filed |
//!
//! The last rows are how the supervisor follows the requests it filed: it lives in the
//! `system` tenant and files requests for a run's principal (`on_behalf_of`), so the
//! request belongs to that principal's tenant; the filer may still read, watch and
//! cancel it. Deciding and executing stay strictly within the tenant, and requests of
//! other tenants answer NOT_FOUND, never PERMISSION_DENIED, so their existence does not
//! leak.
//!
//! # Concurrency
//!
//! Every change is a compare-and-set on the stored version, re-applied after a lost
//! race. Execution is guarded twice: a per-request async mutex queues concurrent Execute
//! calls in this process (so they all answer with the one record), and a claim written
//! with a compare-and-set before the executor runs keeps a second instance sharing the
//! store from running the action too. The executor runs in its own task, so a caller
//! that disconnects mid-execution cannot leave the request half-executed.
//!
//! # Layout
//!
//! This file holds the service, its construction, the checks every call shares and the
//! gRPC methods; the work behind them is split by concern: filing requests
//! (`request`), voting (`decide`), executing (`execute`), withdrawing (`cancel`), the
//! expiry sweep (`expiry`), reading (`read`) and streaming events (`watch`).

mod cancel;
mod decide;
mod execute;
mod expiry;
mod read;
mod request;
mod watch;

use std::{
    sync::{Arc, atomic::AtomicBool},
    time::Duration,
};

use convene_core::{Rule, ValidationError, time::Clock};
use convene_mesh::{auth::Authenticator, handles::BoxStream, policy_file::Policy};
use convene_proto::v1::{self, approval_server::Approval};
use convene_server::Shutdown;
use tonic::{Request, Response, Status};
use tracing::Instrument as _;

use crate::{
    config::{Config, ConfigError, ExecutorKind},
    error::ApprovalError,
    executor::{Executor, RecordOnlyExecutor},
    store::{ApprovalStore, MemoryStore, Versioned},
};
use execute::ExecutionLocks;
pub use watch::WATCH_POLL_INTERVAL;

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
    clock: Clock,
    default_ttl: Duration,
    locks: ExecutionLocks,
    expiry_sweep_interval: Duration,
    /// Ends following WatchEvents streams and the expiry sweep, when set.
    shutdown: Option<Shutdown>,
    /// Whether the expiry sweep task was started.
    sweeping: AtomicBool,
}

impl ApprovalService {
    /// A service over `policy` with in-memory storage, the record-only executor, the
    /// system clock, the default time to live of one hour, an expiry sweep every second
    /// (once started: [`spawn_expiry_sweep`](Self::spawn_expiry_sweep)) and no shutdown
    /// signal.
    pub fn new(policy: Arc<Policy>) -> Self {
        Self {
            auth: Authenticator::principals_only(policy.clone()),
            policy,
            store: Arc::new(MemoryStore::new()),
            executor: Arc::new(RecordOnlyExecutor),
            clock: Clock::system(),
            default_ttl: crate::config::DEFAULT_TTL,
            locks: ExecutionLocks::default(),
            expiry_sweep_interval: crate::config::DEFAULT_EXPIRY_SWEEP_INTERVAL,
            shutdown: None,
            sweeping: AtomicBool::new(false),
        }
    }

    /// A service as `config` describes it: its policy (with development credentials when
    /// enabled), time to live, executor and expiry sweep interval.
    ///
    /// # Errors
    ///
    /// The configuration is invalid or the policy cannot be loaded.
    pub fn from_config(config: &Config) -> Result<Self, ConfigError> {
        config.validate()?;
        let executor: Arc<dyn Executor> = match config.executor {
            ExecutorKind::RecordOnly => Arc::new(RecordOnlyExecutor),
        };
        let (policy, _) = config.policy_source().load()?;
        Ok(Self::new(Arc::new(policy))
            .with_default_ttl(config.default_ttl)
            .with_executor(executor)
            .with_expiry_sweep_interval(config.expiry_sweep_interval))
    }

    /// Uses `clock` for "now" (creation, expiry, votes, executions).
    #[must_use]
    pub fn with_clock(mut self, clock: impl Into<Clock>) -> Self {
        self.clock = clock.into();
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

    /// Sweeps expired requests every `interval` once the sweep is started.
    #[must_use]
    pub fn with_expiry_sweep_interval(mut self, interval: Duration) -> Self {
        self.expiry_sweep_interval = interval;
        self
    }

    /// Ends following WatchEvents streams (UNAVAILABLE, saying to resume) and the expiry
    /// sweep when `shutdown` triggers.
    #[must_use]
    pub fn with_shutdown(mut self, shutdown: Shutdown) -> Self {
        self.shutdown = Some(shutdown);
        self
    }

    /// The policy callers are authenticated against.
    pub fn policy(&self) -> &Arc<Policy> {
        &self.policy
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
    type WatchEventsStream = BoxStream<v1::ApprovalWatchEventsResponse>;

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

    async fn cancel_approval(
        &self,
        request: Request<v1::CancelApprovalRequest>,
    ) -> Result<Response<v1::CancelApprovalResponse>, Status> {
        let caller = self.auth.authenticate(&request).await?;
        let approval = self.cancel_inner(&caller, request.into_inner()).await?;
        Ok(Response::new(v1::CancelApprovalResponse {
            approval: Some(approval.to_proto(self.clock.now())),
        }))
    }

    async fn watch_events(
        &self,
        request: Request<v1::ApprovalWatchEventsRequest>,
    ) -> Result<Response<Self::WatchEventsStream>, Status> {
        let caller = self.auth.authenticate(&request).await?;
        let stream = self.watch_inner(&caller, request.into_inner()).await?;
        Ok(Response::new(stream))
    }
}
