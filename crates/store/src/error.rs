//! What can go wrong opening or using a database, worded so the reader knows what to fix.

use std::path::PathBuf;

/// Why a database could not be opened or a statement failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The URL names no database convene can use.
    #[error(
        "database_url {url:?} is not usable: {reason}; use `sqlite://<path>` (or a plain file \
         path) for an embedded database, `postgres://<user>@<host>:<port>/<database>` for \
         PostgreSQL, or `memory` to keep state in memory only"
    )]
    BadUrl {
        /// The URL as given (password hidden).
        url: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The directory of a SQLite file could not be created.
    #[error("cannot create the directory {} of the SQLite database: {source}", path.display())]
    CreateDir {
        /// The directory.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The database did not answer or refused the connection.
    #[error(
        "cannot connect to the {backend} database {url}: {source}; check that it is running \
         and reachable, and that the user may connect"
    )]
    Unreachable {
        /// `SQLite` or `PostgreSQL`.
        backend: crate::Backend,
        /// Where (password hidden).
        url: String,
        /// The driver's error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The schema could not be brought up to date.
    #[error(
        "cannot migrate the {backend} database {url} to convene's schema: {source}; a database \
         migrated by a newer convene, or edited by hand, cannot be used by this version"
    )]
    Migration {
        /// `SQLite` or `PostgreSQL`.
        backend: crate::Backend,
        /// Where (password hidden).
        url: String,
        /// The migrator's error.
        #[source]
        source: sqlx::migrate::MigrateError,
    },
    /// A statement failed (PostgreSQL, and SQLite's migrations).
    #[error("database statement failed: {0}")]
    Query(#[from] sqlx::Error),
    /// A SQLite statement failed.
    #[error("database statement failed: {0}")]
    Sqlite(#[from] rusqlite::Error),
    /// A statement names a placeholder it has no argument for.
    #[error(
        "statement {statement:?}: placeholder {index} has no argument ({bound} bound); \
         placeholders are $1, $2, ... in the order the arguments are bound"
    )]
    Placeholder {
        /// The SQL text.
        statement: String,
        /// Which placeholder (1-based, in order of appearance).
        index: usize,
        /// How many arguments were bound.
        bound: usize,
    },
    /// The database handle was closed.
    #[error("the database was closed (the service is shutting down)")]
    Closed,
    /// A commit failed, or the batch of writers it was part of was rolled back (see
    /// [`crate::group`]); nothing of the transaction was kept.
    #[error("database commit failed: {0}")]
    Commit(String),
    /// A stored value does not have the shape this version of convene expects.
    #[error("column {column} holds an unexpected value: {detail}")]
    Corrupt {
        /// The column.
        column: String,
        /// What was wrong.
        detail: String,
    },
}

impl Error {
    /// Whether the statement broke a unique or primary-key constraint.
    pub fn is_unique_violation(&self) -> bool {
        match self {
            Error::Query(sqlx::Error::Database(e)) => e.is_unique_violation(),
            Error::Sqlite(rusqlite::Error::SqliteFailure(e, _)) => matches!(
                e.extended_code,
                rusqlite::ffi::SQLITE_CONSTRAINT_UNIQUE
                    | rusqlite::ffi::SQLITE_CONSTRAINT_PRIMARYKEY
            ),
            _ => false,
        }
    }

    /// Whether retrying later may succeed (the database is unreachable, busy or shutting
    /// down), as opposed to a request or schema that can never work.
    pub fn is_transient(&self) -> bool {
        match self {
            Error::Unreachable { .. } | Error::Closed => true,
            Error::Sqlite(e) => matches!(
                e.sqlite_error_code(),
                Some(
                    rusqlite::ErrorCode::DatabaseBusy
                        | rusqlite::ErrorCode::DatabaseLocked
                        | rusqlite::ErrorCode::SystemIoFailure
                        | rusqlite::ErrorCode::DiskFull
                )
            ),
            Error::Query(e) => matches!(
                e,
                sqlx::Error::Io(_)
                    | sqlx::Error::PoolTimedOut
                    | sqlx::Error::PoolClosed
                    | sqlx::Error::WorkerCrashed
            ),
            _ => false,
        }
    }
}
