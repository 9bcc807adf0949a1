//! Durable state for convene's services.
//!
//! One [`Database`] handle per process, chosen by URL: an embedded SQLite file by
//! default (`<data_dir>/convene.db`, WAL mode, nothing to install) or PostgreSQL for
//! clusters (`postgres://...`). Opening it brings the schema up to date with the
//! migrations embedded in this crate, one file per service area
//! (`migrations/{sqlite,postgres}/0001_supervisor.sql`, `0002_policy.sql`,
//! `0003_approval.sql`, `0004_evidence.sql`); the two back ends share one schema whose
//! column types differ only where they must (`BLOB`/`BYTEA`, `INTEGER`/`BIGINT`,
//! autoincrement/identity).
//!
//! The services' stores are written once for both back ends: a [`Statement`] is SQL with
//! `$n` placeholders and owned arguments, run on the [`Database`] (reads; a write in a
//! transaction of its own) or in a [`Tx`], returning [`Row`]s. Everything that differs
//! between the drivers stays inside this crate.
//!
//! Writers of one process take turns and share physical transactions (group commit):
//! one fsync covers every commit that queued up behind another, and a writer alone
//! commits at once (see the `group` module).
//!
//! A service's `database_url` setting is resolved by [`open`]: unset means the SQLite
//! file in its data directory, [`MEMORY`] keeps its in-memory stores.
//!
//! With the `test-util` feature, `test_util::test_databases()` yields a fresh SQLite
//! file always and a fresh PostgreSQL database when `CONVENE_TEST_POSTGRES_URL` names a
//! server, so each store test runs on every back end that is available.
#![forbid(unsafe_code)]

mod combine;
mod database;
mod error;
mod group;
mod sqlite;
mod statement;
pub mod time;

#[cfg(feature = "test-util")]
pub mod test_util;

pub use combine::WriteFuture;
pub use database::{
    Backend, Database, Location, MEMORY, SQLITE_FILE, Tx, open, redact, sqlite_url,
};
pub use error::Error;
pub use sqlite::SqliteRow;
pub use statement::{Arg, Row, Statement, Value, sql};

/// `$first, $first+1, ...` for `count` placeholders, for an `IN (...)` list whose
/// arguments are bound in that order after the `first - 1` bound before them.
pub fn placeholders(first: usize, count: usize) -> String {
    (first..first + count)
        .map(|n| format!("${n}"))
        .collect::<Vec<_>>()
        .join(", ")
}
