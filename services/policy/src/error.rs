//! The policy service's error type and its gRPC codes.

use convene_server::{ErrorCode, ServiceError};

use crate::decision_log::LogError;
use crate::state::StateError;

/// Everything that can go wrong in the policy service: refused requests (whose text is
/// what the caller sees, so it says what to change) and failures at start.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A request field is invalid.
    #[error("invalid {field}: {message}")]
    InvalidArgument {
        /// Path of the field from the request root, e.g. `grants[2].profile_id`.
        field: String,
        /// What is wrong and what to send instead.
        message: String,
    },
    /// The caller did not prove who it is, or a presented token does not verify.
    #[error("{0}")]
    Unauthenticated(String),
    /// The caller is known but may not do this.
    #[error("{0}")]
    PermissionDenied(String),
    /// A named entity (principal) does not exist.
    #[error("{0}")]
    NotFound(String),
    /// The request is valid but the state forbids it (depth limit, revoked run).
    #[error("{0}")]
    FailedPrecondition(String),
    /// The policy file cannot be loaded, or development credentials cannot be written.
    #[error(transparent)]
    PolicyFile(#[from] convene_mesh::policy_file::Error),
    /// The signing keys cannot be read, written or used.
    #[error("signing keys: {0}")]
    Keys(#[from] convene_tokens::Error),
    /// The decision log cannot be opened or written.
    #[error(transparent)]
    DecisionLog(#[from] LogError),
    /// Counters or revocations cannot be read or written.
    #[error(transparent)]
    State(#[from] StateError),
    /// The gRPC server failed.
    #[error(transparent)]
    Serve(#[from] convene_server::ServeError),
    /// The database named by `database_url` cannot be opened.
    #[error(transparent)]
    Database(#[from] convene_store::Error),
}

impl Error {
    /// An [`Error::InvalidArgument`] for `field`.
    pub fn invalid(field: impl Into<String>, message: impl Into<String>) -> Self {
        Error::InvalidArgument {
            field: field.into(),
            message: message.into(),
        }
    }
}

impl From<convene_core::ValidationError> for Error {
    fn from(e: convene_core::ValidationError) -> Self {
        Error::invalid(e.field, e.message)
    }
}

impl ServiceError for Error {
    fn code(&self) -> ErrorCode {
        match self {
            Error::InvalidArgument { .. } => ErrorCode::InvalidArgument,
            Error::Unauthenticated(_) => ErrorCode::Unauthenticated,
            Error::PermissionDenied(_) => ErrorCode::PermissionDenied,
            Error::NotFound(_) => ErrorCode::NotFound,
            Error::FailedPrecondition(_) => ErrorCode::FailedPrecondition,
            Error::State(StateError::Unavailable(_)) => ErrorCode::Unavailable,
            Error::Database(e) if e.is_transient() => ErrorCode::Unavailable,
            Error::Database(_) => ErrorCode::Internal,
            Error::PolicyFile(_) | Error::Keys(_) | Error::DecisionLog(_) | Error::Serve(_) => {
                ErrorCode::Internal
            }
        }
    }
}

impl From<Error> for tonic::Status {
    fn from(e: Error) -> Self {
        convene_server::into_status(&e)
    }
}
