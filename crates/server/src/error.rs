//! The one place service errors become gRPC statuses.
//!
//! Each service defines its own `thiserror` enum and implements [`ServiceError`] for it,
//! choosing an [`ErrorCode`] per variant. [`into_status`] turns any such error into a
//! [`tonic::Status`]: the error's `Display` text is the message the client sees, so it
//! should say what to fix (which field, which limit, which scope). Internal errors are the
//! exception: their detail goes to the log under an error id and the client gets only
//! that id, so implementation details never leak across the wire.

use std::fmt;

use std::time::Duration;

use http::StatusCode;
use tonic::{Code, Status};
use tonic_types::{ErrorDetails, StatusExt};

/// What kind of failure an error is, independent of transport.
///
/// A deliberately small subset of gRPC's codes: the ones convene services return on
/// purpose. Each maps to a [`tonic::Code`], and to an HTTP status for an HTTP surface
/// (none is served yet; the planned A2A gateway is the first).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ErrorCode {
    /// The request is malformed or a field is invalid; retrying it unchanged fails again.
    InvalidArgument,
    /// The addressed entity does not exist.
    NotFound,
    /// The entity to create exists already.
    AlreadyExists,
    /// The caller is known but not allowed to do this.
    PermissionDenied,
    /// The caller did not prove who it is (missing or invalid credentials).
    Unauthenticated,
    /// The system is not in the state the operation needs (e.g. run already terminal).
    FailedPrecondition,
    /// A limit or quota is used up; retry later or ask for less.
    ResourceExhausted,
    /// The operation did not finish before its deadline.
    DeadlineExceeded,
    /// Stored data is lost or corrupt (e.g. an artifact's hash does not match).
    DataLoss,
    /// The service cannot answer now; retrying with backoff may succeed.
    Unavailable,
    /// A bug or an unexpected failure inside the service.
    Internal,
    /// The operation lost a race (concurrency conflict); retry the whole operation.
    Aborted,
    /// A value is outside the valid range (e.g. a page past the end).
    OutOfRange,
    /// The operation was cancelled, usually by the caller.
    Cancelled,
}

impl ErrorCode {
    /// Every code, for exhaustive tests and documentation.
    pub const ALL: [ErrorCode; 14] = [
        ErrorCode::InvalidArgument,
        ErrorCode::NotFound,
        ErrorCode::AlreadyExists,
        ErrorCode::PermissionDenied,
        ErrorCode::Unauthenticated,
        ErrorCode::FailedPrecondition,
        ErrorCode::ResourceExhausted,
        ErrorCode::DeadlineExceeded,
        ErrorCode::DataLoss,
        ErrorCode::Unavailable,
        ErrorCode::Internal,
        ErrorCode::Aborted,
        ErrorCode::OutOfRange,
        ErrorCode::Cancelled,
    ];

    /// The gRPC status code.
    pub fn grpc_code(self) -> Code {
        match self {
            ErrorCode::InvalidArgument => Code::InvalidArgument,
            ErrorCode::NotFound => Code::NotFound,
            ErrorCode::AlreadyExists => Code::AlreadyExists,
            ErrorCode::PermissionDenied => Code::PermissionDenied,
            ErrorCode::Unauthenticated => Code::Unauthenticated,
            ErrorCode::FailedPrecondition => Code::FailedPrecondition,
            ErrorCode::ResourceExhausted => Code::ResourceExhausted,
            ErrorCode::DeadlineExceeded => Code::DeadlineExceeded,
            ErrorCode::DataLoss => Code::DataLoss,
            ErrorCode::Unavailable => Code::Unavailable,
            ErrorCode::Internal => Code::Internal,
            ErrorCode::Aborted => Code::Aborted,
            ErrorCode::OutOfRange => Code::OutOfRange,
            ErrorCode::Cancelled => Code::Cancelled,
        }
    }

    /// The HTTP status, following the mapping gRPC-HTTP gateways use
    /// (`google.rpc.Code` documentation), so that a future HTTP surface, such as the planned
    /// A2A gateway, answers as the gRPC services do.
    pub fn http_status(self) -> StatusCode {
        match self {
            ErrorCode::InvalidArgument | ErrorCode::FailedPrecondition | ErrorCode::OutOfRange => {
                StatusCode::BAD_REQUEST
            }
            ErrorCode::NotFound => StatusCode::NOT_FOUND,
            ErrorCode::AlreadyExists | ErrorCode::Aborted => StatusCode::CONFLICT,
            ErrorCode::PermissionDenied => StatusCode::FORBIDDEN,
            ErrorCode::Unauthenticated => StatusCode::UNAUTHORIZED,
            ErrorCode::ResourceExhausted => StatusCode::TOO_MANY_REQUESTS,
            ErrorCode::DeadlineExceeded => StatusCode::GATEWAY_TIMEOUT,
            ErrorCode::DataLoss | ErrorCode::Internal => StatusCode::INTERNAL_SERVER_ERROR,
            ErrorCode::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
            // 499 "client closed request" has no constant in `http`; it is in range, so
            // the conversion cannot fail.
            ErrorCode::Cancelled => {
                StatusCode::from_u16(499).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
            }
        }
    }

    /// Whether the caller may retry the same request later and expect a different answer.
    pub fn is_retryable(self) -> bool {
        matches!(
            self,
            ErrorCode::Unavailable
                | ErrorCode::ResourceExhausted
                | ErrorCode::Aborted
                | ErrorCode::DeadlineExceeded
        )
    }
}

impl fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The gRPC spelling (e.g. `INVALID_ARGUMENT`), which is what clients and logs show.
        let name = match self {
            ErrorCode::InvalidArgument => "INVALID_ARGUMENT",
            ErrorCode::NotFound => "NOT_FOUND",
            ErrorCode::AlreadyExists => "ALREADY_EXISTS",
            ErrorCode::PermissionDenied => "PERMISSION_DENIED",
            ErrorCode::Unauthenticated => "UNAUTHENTICATED",
            ErrorCode::FailedPrecondition => "FAILED_PRECONDITION",
            ErrorCode::ResourceExhausted => "RESOURCE_EXHAUSTED",
            ErrorCode::DeadlineExceeded => "DEADLINE_EXCEEDED",
            ErrorCode::DataLoss => "DATA_LOSS",
            ErrorCode::Unavailable => "UNAVAILABLE",
            ErrorCode::Internal => "INTERNAL",
            ErrorCode::Aborted => "ABORTED",
            ErrorCode::OutOfRange => "OUT_OF_RANGE",
            ErrorCode::Cancelled => "CANCELLED",
        };
        f.write_str(name)
    }
}

impl From<ErrorCode> for Code {
    fn from(code: ErrorCode) -> Self {
        code.grpc_code()
    }
}

/// An error a service returns to its callers.
///
/// Implement it for each service's error enum; its `Display` text becomes the status
/// message, so write it for the caller.
pub trait ServiceError: std::error::Error {
    /// The kind of failure, which decides the gRPC code and HTTP status.
    fn code(&self) -> ErrorCode;
}

/// Turns a service error into the `Status` sent to the client.
///
/// For [`ErrorCode::Internal`] the error and its source chain are logged at `error`
/// level with a fresh error id, and the client gets a generic message quoting that id,
/// so an operator can find the detail without it leaking to callers.
pub fn into_status<E: ServiceError + ?Sized>(error: &E) -> Status {
    let code = error.code();
    if code == ErrorCode::Internal {
        let error_id = uuid::Uuid::now_v7();
        tracing::error!(
            %error_id,
            error = %error,
            causes = %SourceChain(error),
            "internal error"
        );
        return Status::internal(format!(
            "internal error (error id {error_id}); the details are in the server log under this id"
        ));
    }
    Status::new(code.grpc_code(), error.to_string())
}

/// A `RESOURCE_EXHAUSTED` status whose `google.rpc.RetryInfo` detail says when to try
/// again: the answer to a call refused because the server is full, before any of its
/// work was done (so a retry repeats nothing).
pub fn resource_exhausted(message: impl Into<String>, retry_after: Duration) -> Status {
    Status::with_error_details(
        Code::ResourceExhausted,
        message,
        ErrorDetails::with_retry_info(Some(retry_after)),
    )
}

/// The retry hint of a status (its `google.rpc.RetryInfo` detail), when it has one.
pub fn retry_after(status: &Status) -> Option<Duration> {
    status.get_details_retry_info()?.retry_delay
}

/// A `Status` for an invalid request field: `invalid <field>: <message>`.
///
/// `field` is the path from the request root as the caller wrote it (e.g. `spec.goal`,
/// `grants[2].ttl`), so the caller knows exactly which value to change.
pub fn invalid_field(field: &str, message: impl fmt::Display) -> Status {
    Status::invalid_argument(format!("invalid {field}: {message}"))
}

/// Formats an error's `source()` chain as `a: b: c` (empty when there is none).
struct SourceChain<'a, E: ?Sized>(&'a E);

impl<E: std::error::Error + ?Sized> fmt::Display for SourceChain<'_, E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut source = self.0.source();
        let mut first = true;
        while let Some(cause) = source {
            if !first {
                f.write_str(": ")?;
            }
            write!(f, "{cause}")?;
            first = false;
            source = cause.source();
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    enum StoreError {
        #[error("artifact {0} not found; put it first")]
        Missing(String),
        #[error("database write failed")]
        Database(#[source] std::io::Error),
    }

    impl ServiceError for StoreError {
        fn code(&self) -> ErrorCode {
            match self {
                StoreError::Missing(_) => ErrorCode::NotFound,
                StoreError::Database(_) => ErrorCode::Internal,
            }
        }
    }

    #[test]
    fn caller_errors_keep_their_message() {
        let status = into_status(&StoreError::Missing("artifact://t/abc".into()));
        assert_eq!(status.code(), Code::NotFound);
        assert_eq!(
            status.message(),
            "artifact artifact://t/abc not found; put it first"
        );
    }

    #[test]
    fn internal_errors_hide_their_detail_behind_an_id() {
        let err = StoreError::Database(std::io::Error::other("disk /var/lib/convene full"));
        let status = into_status(&err);
        assert_eq!(status.code(), Code::Internal);
        assert!(!status.message().contains("disk"), "{}", status.message());
        assert!(
            !status.message().contains("database"),
            "{}",
            status.message()
        );
        let id = status
            .message()
            .split("error id ")
            .nth(1)
            .and_then(|rest| rest.split(')').next())
            .expect("message quotes an error id");
        uuid::Uuid::parse_str(id).expect("the error id is a UUID");
        // Each occurrence gets its own id, so log lines can be told apart.
        assert_ne!(into_status(&err).message(), status.message());
    }

    #[test]
    fn source_chain_lists_every_cause() {
        let err = StoreError::Database(std::io::Error::other("disk full"));
        assert_eq!(SourceChain(&err).to_string(), "disk full");
        let leaf = std::io::Error::other("leaf");
        assert_eq!(SourceChain(&leaf).to_string(), "");
    }

    #[test]
    fn every_code_maps_to_its_grpc_and_http_counterpart() {
        for code in ErrorCode::ALL {
            let grpc = code.grpc_code();
            // The display name is the gRPC spelling of the same code.
            let expected = format!("{grpc:?}");
            let display = code.to_string().replace('_', "").to_lowercase();
            assert_eq!(display, expected.to_lowercase(), "{code:?}");
            let http = code.http_status();
            assert!(
                http.is_client_error() || http.is_server_error(),
                "{code:?} maps to {http}"
            );
        }
        assert_eq!(ErrorCode::NotFound.http_status(), StatusCode::NOT_FOUND);
        assert_eq!(
            ErrorCode::Unauthenticated.http_status(),
            StatusCode::UNAUTHORIZED
        );
        assert_eq!(
            ErrorCode::PermissionDenied.http_status(),
            StatusCode::FORBIDDEN
        );
        assert_eq!(
            ErrorCode::ResourceExhausted.http_status(),
            StatusCode::TOO_MANY_REQUESTS
        );
        assert_eq!(ErrorCode::Cancelled.http_status().as_u16(), 499);
        assert!(ErrorCode::Unavailable.is_retryable());
        assert!(!ErrorCode::InvalidArgument.is_retryable());
    }

    #[test]
    fn a_full_server_says_when_to_retry() {
        let status = resource_exhausted("full; retry in 1s", Duration::from_millis(1500));
        assert_eq!(status.code(), Code::ResourceExhausted);
        assert_eq!(status.message(), "full; retry in 1s");
        assert_eq!(retry_after(&status), Some(Duration::from_millis(1500)));
        assert_eq!(retry_after(&Status::resource_exhausted("no hint")), None);
    }

    #[test]
    fn invalid_field_names_the_field() {
        let status = invalid_field("spec.goal", "must not be empty");
        assert_eq!(status.code(), Code::InvalidArgument);
        assert_eq!(status.message(), "invalid spec.goal: must not be empty");
    }
}
