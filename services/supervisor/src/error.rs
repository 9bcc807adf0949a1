//! The supervisor's domain failures and the one place they become gRPC statuses.
//!
//! The run actor, its dispatches and the service handlers say what went wrong with an
//! [`Error`]; `impl From<Error> for Status` picks the code. The `Display` text is the
//! message the caller sees (and what a failed delegation's result records), so it says
//! what to change. Failures of the supervisor's start-up are [`crate::Error`].

use convene_server::{ErrorCode, ServiceError};
use tonic::{Code, Status};

use crate::store::StoreError;

/// A refused request or a failed step of a run.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A request field is invalid.
    #[error("invalid {field}: {message}")]
    InvalidArgument {
        /// Path of the field from the request root, e.g. `delegations[2].profile_id`.
        field: String,
        /// What is wrong and what to send instead.
        message: String,
    },
    /// The run does not exist, or is another tenant's (indistinguishable on purpose).
    #[error("run {0} not found")]
    RunNotFound(String),
    /// Something else the request names (a run template) does not exist; the message
    /// lists what does.
    #[error("{0}")]
    NotFound(String),
    /// The caller is known but may not do this.
    #[error("{0}")]
    PermissionDenied(String),
    /// The request is valid but the run's state forbids it.
    #[error("{0}")]
    FailedPrecondition(String),
    /// A limit of the run is used up.
    #[error("{0}")]
    ResourceExhausted(String),
    /// The supervisor has no room for another run now; the caller may retry after
    /// `retry_after` (sent as a `google.rpc.RetryInfo` detail).
    #[error("{message}")]
    Overloaded {
        /// What is full and what to do.
        message: String,
        /// When a retry may find room.
        retry_after: std::time::Duration,
    },
    /// An idempotency key names another run.
    #[error("{0}")]
    AlreadyExists(String),
    /// The supervisor cannot answer now (shutting down, its run's owner stopped).
    #[error("{0}")]
    Unavailable(String),
    /// A commit lost a race with another writer or replica.
    #[error("{0}")]
    Aborted(String),
    /// The run store cannot be reached.
    #[error("run store unavailable: {0}")]
    StoreUnavailable(String),
    /// No live worker serving the delegation's profile had room before its deadline.
    #[error("no live worker serving profile {0} had a free slot before the delegation's deadline")]
    NoWorker(String),
    /// The worker did not answer a dispatch in time.
    #[error("the worker did not answer before the delegation's deadline")]
    WorkerTimeout,
    /// The worker's answer to a dispatch held no result.
    #[error("the worker answered without a result")]
    NoResult,
    /// The dispatch was cancelled with its run.
    #[error("the delegation was cancelled")]
    Cancelled,
    /// The policy service answered a token request with the wrong number of tokens.
    #[error("policy returned {got} tokens for {wanted} delegations")]
    TokenCount {
        /// Tokens returned.
        got: usize,
        /// Tokens asked for.
        wanted: usize,
    },
    /// Another service (or the caller's authentication) refused: passed on as it is.
    #[error("{}", .0.message())]
    Upstream(Box<Status>),
}

impl Error {
    /// An [`Error::InvalidArgument`] for `field`.
    pub(crate) fn invalid(field: impl Into<String>, message: impl ToString) -> Self {
        Error::InvalidArgument {
            field: field.into(),
            message: message.to_string(),
        }
    }

    /// The gRPC code the error is answered with; a dispatch's retries and its failure's
    /// result are decided by it.
    pub(crate) fn grpc_code(&self) -> Code {
        match self {
            Error::Upstream(status) => status.code(),
            other => other.code().grpc_code(),
        }
    }
}

impl ServiceError for Error {
    fn code(&self) -> ErrorCode {
        match self {
            Error::InvalidArgument { .. } => ErrorCode::InvalidArgument,
            Error::RunNotFound(_) | Error::NotFound(_) | Error::NoWorker(_) => ErrorCode::NotFound,
            Error::PermissionDenied(_) => ErrorCode::PermissionDenied,
            Error::FailedPrecondition(_) => ErrorCode::FailedPrecondition,
            Error::ResourceExhausted(_) | Error::Overloaded { .. } => ErrorCode::ResourceExhausted,
            Error::AlreadyExists(_) => ErrorCode::AlreadyExists,
            Error::Unavailable(_) | Error::StoreUnavailable(_) => ErrorCode::Unavailable,
            Error::Aborted(_) => ErrorCode::Aborted,
            Error::WorkerTimeout => ErrorCode::DeadlineExceeded,
            Error::Cancelled => ErrorCode::Cancelled,
            Error::NoResult | Error::TokenCount { .. } => ErrorCode::Internal,
            // Not chosen here: `grpc_code` and the conversion keep the status's own code.
            Error::Upstream(_) => ErrorCode::Internal,
        }
    }
}

impl From<Status> for Error {
    fn from(status: Status) -> Self {
        Error::Upstream(Box::new(status))
    }
}

impl From<convene_core::ValidationError> for Error {
    fn from(e: convene_core::ValidationError) -> Self {
        Error::invalid(e.field, e.message)
    }
}

impl From<StoreError> for Error {
    fn from(e: StoreError) -> Self {
        match e {
            StoreError::NotFound(id) => Error::RunNotFound(id),
            StoreError::Conflict { .. } | StoreError::LeaseLost { .. } => {
                Error::Aborted(e.to_string())
            }
            StoreError::Backend(m) => Error::StoreUnavailable(m),
        }
    }
}

impl From<Error> for Status {
    fn from(e: Error) -> Self {
        match e {
            Error::Upstream(status) => *status,
            Error::Overloaded {
                message,
                retry_after,
            } => convene_server::resource_exhausted(message, retry_after),
            // Internal failures here are a peer's wrong answer, not the supervisor's
            // internals: their text goes to the caller, and into the delegation's
            // recorded failure, as it is.
            e => Status::new(e.code().grpc_code(), e.to_string()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_keep_their_codes_and_messages() {
        let cases = [
            (
                Error::invalid("run_id", "must not be empty"),
                Code::InvalidArgument,
                "invalid run_id: must not be empty",
            ),
            (
                Error::RunNotFound("r1".into()),
                Code::NotFound,
                "run r1 not found",
            ),
            (
                Error::NoWorker("p".into()),
                Code::NotFound,
                "no live worker serving profile p had a free slot before the delegation's deadline",
            ),
            (
                Error::WorkerTimeout,
                Code::DeadlineExceeded,
                "the worker did not answer before the delegation's deadline",
            ),
            (
                Error::NoResult,
                Code::Internal,
                "the worker answered without a result",
            ),
            (
                Error::Cancelled,
                Code::Cancelled,
                "the delegation was cancelled",
            ),
            (
                Error::TokenCount { got: 1, wanted: 2 },
                Code::Internal,
                "policy returned 1 tokens for 2 delegations",
            ),
            (
                StoreError::Backend("down".into()).into(),
                Code::Unavailable,
                "run store unavailable: down",
            ),
            (
                Status::unavailable("worker gone").into(),
                Code::Unavailable,
                "worker gone",
            ),
        ];
        for (error, code, message) in cases {
            assert_eq!(error.grpc_code(), code, "{error}");
            assert_eq!(error.to_string(), message);
            let status = Status::from(error);
            assert_eq!(status.code(), code);
            assert_eq!(status.message(), message);
        }
    }
}
