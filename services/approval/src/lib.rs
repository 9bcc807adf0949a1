//! The approval service (`convene.v1.Approval`): holds actions with side effects above
//! R1 until the right people approve them, then executes each approved action exactly
//! once.
//!
//! - A request binds an action, its parameters and their hash
//!   ([`canonical::parameters_hash`]), a risk level that is never lower than the policy's
//!   action catalog says, an idempotency key, the requester, evidence and an expiry.
//! - R2 needs one approver, R3 two distinct ones; approvers are people with the
//!   `approvals:decide` role, never the requester, and their votes bind to the parameters
//!   hash, so changed parameters need a new request.
//! - Execution happens once, through an [`Executor`]; every later Execute returns the
//!   first [`ExecutionRecord`](convene_proto::v1::ExecutionRecord).
//! - CancelApproval withdraws a pending or approved request that is not being executed;
//!   only the principal that filed it (e.g. the supervisor) or its requester may. A
//!   cancelled request takes no votes and never runs; cancelling it again changes
//!   nothing.
//! - Expiry is a state change: a sweep every `expiry_sweep_interval` records pending
//!   requests past their expiry as EXPIRED ([`ApprovalService::sweep_expired`]); reads
//!   treat them as expired before that already.
//! - Every state change writes one CloudEvent ([`events`]: requested, decided for each
//!   recorded vote, executed, expired, cancelled) with the change, in the same
//!   transaction; refused and repeated calls write none. WatchEvents streams the events
//!   a caller may see in commit order, resumable after an event id, optionally filtered
//!   by run and following new commits.
//!
//! # Entry points
//!
//! - [`ApprovalService`]: the service. `Arc<ApprovalService>` is also an in-process
//!   [`ApprovalHandle`](convene_mesh::handles::ApprovalHandle); across processes, use
//!   [`GrpcApproval`](convene_mesh::handles::GrpcApproval). The supervisor files requests
//!   for a run's principal through either handle, with its own service credential and
//!   `on_behalf_of` set to that principal.
//! - [`add_to_server`]: adds the service to a [`GrpcServer`], so `convene up` can host it
//!   beside the others on one listener, and starts its expiry sweep
//!   ([`ApprovalService::spawn_expiry_sweep`]), which ends when the service is dropped or
//!   its shutdown signal ([`ApprovalService::with_shutdown`]) triggers.
//! - [`run`]: the standalone service, as the `convene-approval` binary runs it; its
//!   shutdown signal also ends following WatchEvents streams (UNAVAILABLE).
//!
//! Requests and their events live behind [`ApprovalStore`], a versioned compare-and-set
//! store that takes each change's event with it: in the database `database_url` names
//! ([`SqlApprovalStore`], by default the SQLite file in the data directory; table
//! `approval_events`), or in memory ([`MemoryStore`]).
#![forbid(unsafe_code)]

pub mod canonical;
pub mod config;
pub mod error;
pub mod events;
pub mod executor;
pub mod model;
pub mod service;
pub mod sql;
pub mod store;

use std::sync::Arc;

use convene_proto::v1::approval_server::ApprovalServer;
use convene_server::{GrpcServer, Shutdown};

pub use config::{Config, ExecutorKind};
pub use convene_core::time::{Clock, ManualClock};
pub use error::{ApprovalError, Error};
pub use events::{Event, StoredEvent};
pub use executor::{ExecutionOutcome, Executor, ExecutorError, RecordOnlyExecutor};
pub use service::{
    ApprovalService, DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE, ROLE_DECIDE, ROLE_EXECUTE, ROLE_REQUEST,
    WATCH_POLL_INTERVAL,
};
pub use sql::SqlApprovalStore;
pub use store::{ApprovalStore, MemoryStore};

/// Adds the approval service to `server` and starts its expiry sweep
/// ([`ApprovalService::spawn_expiry_sweep`]; once per service). The same `Arc` can be
/// kept as the in-process handle, so calls through the socket and in-process calls share
/// one state.
///
/// # Panics
///
/// Outside a Tokio runtime.
#[must_use]
pub fn add_to_server(server: GrpcServer, service: Arc<ApprovalService>) -> GrpcServer {
    service.spawn_expiry_sweep();
    server.add_service(ApprovalServer::from_arc(service))
}

/// Runs the approval service as configured until `shutdown` triggers, then drains.
///
/// # Errors
///
/// The configuration or policy is invalid, the listen address cannot be bound, or the
/// server fails.
pub async fn run(config: Config, shutdown: Shutdown) -> Result<(), Error> {
    let service = Arc::new(
        ApprovalService::connect(&config)
            .await?
            .with_shutdown(shutdown.clone()),
    );
    let listener = convene_server::bind(config.server.listen).await?;
    tracing::info!(
        listen = %config.server.listen,
        executor = config.executor.as_str(),
        default_ttl = %humantime::format_duration(config.default_ttl),
        expiry_sweep_interval = %humantime::format_duration(config.expiry_sweep_interval),
        "approval service starting"
    );
    add_to_server(GrpcServer::new(config.common.server), service)
        .serve(listener, shutdown)
        .await?;
    Ok(())
}
