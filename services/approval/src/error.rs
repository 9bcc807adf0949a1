//! What can go wrong, and what the caller should do about it.
//!
//! [`ApprovalError`] is what an RPC refuses with; [`into_status`] turns it into the
//! `Status` the caller sees, whose message is this type's `Display` text. [`Error`] is
//! why the service as a whole could not start or stopped.

use std::time::SystemTime;

use convene_core::{ValidationError, permissions::RiskLevel};
use convene_server::{ErrorCode, ServeError, ServiceError, into_status};
use tonic::Status;

use crate::{config::ConfigError, model::State, store::StoreError};

/// Why an approval RPC was refused.
#[derive(Debug, thiserror::Error)]
pub enum ApprovalError {
    /// A request field is missing or malformed.
    #[error("invalid {0}")]
    Invalid(#[from] ValidationError),
    /// The action is R0 or R1 (as asked and in the catalog), which needs no approval.
    #[error(
        "action {action} is {risk}: R0 and R1 actions need no approval, so there is nothing \
         to request; run it directly, or ask with risk_level R2 or R3 if it does need people \
         to approve it"
    )]
    NoApprovalNeeded {
        /// The action.
        action: String,
        /// Its effective risk level.
        risk: RiskLevel,
    },
    /// The caller may not do this, for a reason other than a missing role.
    #[error("{0}")]
    NotPermitted(String),
    /// The request does not exist, or belongs to another tenant.
    #[error(
        "approval request {approval_id} not found; check the id (requests of other tenants \
         are not visible)"
    )]
    NotFound {
        /// The id asked for.
        approval_id: String,
    },
    /// An idempotency key was reused for a different action or different parameters.
    #[error(
        "idempotency_key {key:?} was already used for approval request {existing} with a \
         different action or different parameters; use a new idempotency_key for a new \
         request"
    )]
    KeyReused {
        /// The key.
        key: String,
        /// The request created under it.
        existing: String,
    },
    /// The parameters hash the caller quotes is not the request's.
    #[error(
        "parameters changed since you reviewed them (you quoted {quoted}, request \
         {approval_id} binds {current}); file a new approval request for the new parameters"
    )]
    ParametersChanged {
        /// The request.
        approval_id: String,
        /// The hash the caller sent.
        quoted: String,
        /// The request's hash.
        current: String,
    },
    /// The request expired before enough people approved it.
    #[error(
        "approval request {approval_id} expired at {} and can no longer be approved; file a \
         new approval request",
        humantime::format_rfc3339_seconds(*expired_at)
    )]
    Expired {
        /// The request.
        approval_id: String,
        /// When it expired.
        expired_at: SystemTime,
    },
    /// The request is past voting (rejected, executed, expired or being executed).
    #[error("approval request {approval_id} is {state} and takes no more votes; {hint}")]
    Closed {
        /// The request.
        approval_id: String,
        /// Where it stands.
        state: State,
        /// What the caller can do instead.
        hint: &'static str,
    },
    /// The request was cancelled: it takes no votes and is never executed.
    #[error(
        "approval request {approval_id} was cancelled {by}; it can no longer be decided or \
         executed: file a new approval request if the action is still needed"
    )]
    Cancelled {
        /// The request.
        approval_id: String,
        /// Who cancelled it and why.
        by: String,
    },
    /// CancelApproval was called on a request that reached a final state.
    #[error("approval request {approval_id} is {state} and can no longer be cancelled; {hint}")]
    NotCancellable {
        /// The request.
        approval_id: String,
        /// Where it stands.
        state: State,
        /// What that means for the caller.
        hint: &'static str,
    },
    /// The approver already voted differently.
    #[error(
        "{approver} already voted {previous} on approval request {approval_id}; a vote cannot \
         be changed"
    )]
    VoteChanged {
        /// The request.
        approval_id: String,
        /// The approver.
        approver: String,
        /// The vote already cast.
        previous: &'static str,
    },
    /// Execute was called on a request that is not approved.
    #[error("approval request {approval_id} cannot be executed: {reason}")]
    NotApproved {
        /// The request.
        approval_id: String,
        /// Its state and, when pending, how many approvals are missing.
        reason: String,
    },
    /// Another instance is executing the request right now.
    #[error(
        "approval request {approval_id} is being executed by another call; fetch it with \
         GetApproval to see the outcome"
    )]
    ExecutionInProgress {
        /// The request.
        approval_id: String,
    },
    /// The executor could not start the action; nothing was done and the request stays
    /// approved.
    #[error(
        "the {executor} executor could not start action {action} ({detail}); nothing was \
         done, the request is still approved: retry Execute later"
    )]
    ExecutorUnavailable {
        /// The executor.
        executor: String,
        /// The action.
        action: String,
        /// What the executor reported.
        detail: String,
    },
    /// Concurrent updates kept winning the race for the same request.
    #[error("approval request {approval_id} changed concurrently too often; retry the call")]
    Contended {
        /// The request.
        approval_id: String,
    },
    /// The page token was not issued for this query.
    #[error(
        "invalid page_token: {0}; pass next_page_token from the previous response unchanged, \
         with the same filters"
    )]
    PageToken(&'static str),
    /// The service is shutting down; the call may be retried elsewhere or later.
    #[error("{0}")]
    ShuttingDown(String),
    /// Storage failed.
    #[error("approval storage failed")]
    Store(#[from] StoreError),
    /// Something inside the service failed unexpectedly.
    #[error("{0}")]
    Internal(String),
}

impl ServiceError for ApprovalError {
    fn code(&self) -> ErrorCode {
        match self {
            Self::Invalid(_) | Self::NoApprovalNeeded { .. } | Self::PageToken(_) => {
                ErrorCode::InvalidArgument
            }
            Self::NotPermitted(_) => ErrorCode::PermissionDenied,
            Self::NotFound { .. } => ErrorCode::NotFound,
            Self::KeyReused { .. } => ErrorCode::AlreadyExists,
            Self::ParametersChanged { .. }
            | Self::Expired { .. }
            | Self::Closed { .. }
            | Self::VoteChanged { .. }
            | Self::Cancelled { .. }
            | Self::NotCancellable { .. }
            | Self::NotApproved { .. } => ErrorCode::FailedPrecondition,
            Self::ExecutionInProgress { .. } | Self::Contended { .. } => ErrorCode::Aborted,
            Self::ExecutorUnavailable { .. } | Self::ShuttingDown(_) => ErrorCode::Unavailable,
            Self::Store(e) => e.code(),
            Self::Internal(_) => ErrorCode::Internal,
        }
    }
}

impl From<ApprovalError> for Status {
    fn from(error: ApprovalError) -> Self {
        into_status(&error)
    }
}

/// Why the approval service could not start, or stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The configuration cannot be used.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The gRPC server could not start or failed.
    #[error(transparent)]
    Serve(#[from] ServeError),
}
