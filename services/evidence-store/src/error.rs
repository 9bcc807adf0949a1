//! The evidence store's error type and its gRPC codes.

use convene_server::{ErrorCode, ServiceError};

use crate::catalog::CatalogError;

/// Everything that can go wrong in the evidence store: refused requests (whose text is
/// what the caller sees, so it says what to change) and failures at start.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A request field is invalid.
    #[error("invalid {field}: {message}")]
    InvalidArgument {
        /// Path of the field from the request root, e.g. `evidence.evidence_id`.
        field: String,
        /// What is wrong and what to send instead.
        message: String,
    },
    /// An artifact is larger than the store accepts.
    #[error(
        "artifact is {size} bytes; the limit is {limit} (max_artifact_bytes): store a smaller \
         excerpt, or raise the limit"
    )]
    TooLarge {
        /// The artifact's size.
        size: usize,
        /// The configured limit.
        limit: usize,
    },
    /// No acceptable credential was presented (no task token, or for a read, no known
    /// principal credential either).
    #[error("{0}")]
    Unauthenticated(String),
    /// The caller may not do this (a token's scope, audience or tenant; a principal's
    /// role; a principal attempting a write).
    #[error("{0}")]
    PermissionDenied(String),
    /// The named artifact does not exist.
    #[error("{0}")]
    NotFound(String),
    /// The request refers to something that is not in the state it needs (an artifact
    /// that does not exist, a hash that does not match).
    #[error("{0}")]
    FailedPrecondition(String),
    /// An evidence record with this id exists with other content.
    #[error("{0}")]
    AlreadyExists(String),
    /// Stored bytes are missing or no longer hash to their recorded hash.
    #[error("{0}")]
    DataLoss(String),
    /// The policy service cannot be reached for its signing keys.
    #[error("{0}")]
    PolicyUnavailable(String),
    /// The metadata catalog failed.
    #[error(transparent)]
    Catalog(#[from] CatalogError),
    /// The artifact bytes could not be read or written: the store's error and its
    /// causes, with credentials cut out.
    #[error("artifact storage failed: {0}")]
    Storage(String),
    /// The data directory cannot be prepared.
    #[error("cannot prepare the artifact directory {path}: {source}")]
    DataDir {
        /// The directory.
        path: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The policy file (whose principals may read) cannot be loaded, or development
    /// credentials cannot be written.
    #[error(transparent)]
    PolicyFile(#[from] convene_mesh::policy_file::Error),
    /// The configuration cannot work.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// The database named by `database_url` cannot be opened.
    #[error(transparent)]
    Database(#[from] convene_store::Error),
    /// The gRPC server failed.
    #[error(transparent)]
    Serve(#[from] convene_server::ServeError),
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
            Error::InvalidArgument { .. } | Error::TooLarge { .. } => ErrorCode::InvalidArgument,
            Error::Unauthenticated(_) => ErrorCode::Unauthenticated,
            Error::PermissionDenied(_) => ErrorCode::PermissionDenied,
            Error::NotFound(_) => ErrorCode::NotFound,
            Error::FailedPrecondition(_) => ErrorCode::FailedPrecondition,
            Error::AlreadyExists(_) => ErrorCode::AlreadyExists,
            Error::DataLoss(_) => ErrorCode::DataLoss,
            Error::PolicyUnavailable(_) | Error::Catalog(CatalogError::Unavailable(_)) => {
                ErrorCode::Unavailable
            }
            Error::Database(e) if e.is_transient() => ErrorCode::Unavailable,
            Error::Database(_) => ErrorCode::Internal,
            Error::Storage(_)
            | Error::DataDir { .. }
            | Error::PolicyFile(_)
            | Error::Config(_)
            | Error::Serve(_) => ErrorCode::Internal,
        }
    }
}

impl From<Error> for tonic::Status {
    fn from(e: Error) -> Self {
        convene_server::into_status(&e)
    }
}
