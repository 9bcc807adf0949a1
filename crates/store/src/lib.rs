//! Durable state for convene's services.
//!
//! One [`Database`] handle per process, chosen by URL: an embedded SQLite file by
//! default (`<data_dir>/convene.db`, WAL mode, nothing to install) or PostgreSQL for
//! clusters (`postgres://...`). Opening it brings the schema up to date with the
//! migrations embedded in this crate, one file per service area
//! (`migrations/{sqlite,postgres}/0001_supervisor.sql`, `0002_policy.sql`,
//! `0003_approval.sql`, `0004_evidence.sql`, `0005_approval_events.sql`,
//! `0006_run_commands.sql`, `0007_gateway.sql`, `0008_run_labels.sql`, `0009_console_sessions.sql`, `0010_revocations_by_time.sql`); the two back
//! ends share one schema whose column types differ only where they must
//! (`BLOB`/`BYTEA`, `INTEGER`/`BIGINT`, autoincrement/identity).
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
mod migrations;
mod sqlite;
mod statement;
pub mod time;

#[cfg(feature = "test-util")]
pub mod test_util;

pub use combine::WriteFuture;
pub use database::{
    Backend, Database, Location, MEMORY, POOL_SIZE_PARAM, POSTGRES_SESSION_LIMITS, SQLITE_FILE, Tx,
    open, redact, sqlite_url,
};
pub use error::Error;
pub use sqlite::SqliteRow;
pub use statement::{Arg, Row, Statement, Value, sql};

/// A multi-row `INSERT`: `<head> VALUES ($1, ...), ($n, ...), ... <tail>`, one statement
/// for up to `max_rows` rows, each row's arguments bound in turn.
/// The text for each number of rows is built once per process and shared, so a
/// statement borrows it and costs no formatting; [`all`](Self::all) splits a longer
/// list into statements of at most `max_rows` rows.
#[derive(Debug)]
pub struct InsertRows {
    head: &'static str,
    columns: usize,
    tail: &'static str,
    max_rows: usize,
    texts: std::sync::OnceLock<Vec<String>>,
}

impl InsertRows {
    /// `head` is `INSERT INTO t (a, b, ...)`, `tail` what follows the values (e.g. an
    /// `ON CONFLICT` clause, or empty).
    pub const fn new(
        head: &'static str,
        columns: usize,
        tail: &'static str,
        max_rows: usize,
    ) -> Self {
        Self {
            head,
            columns,
            tail,
            max_rows,
            texts: std::sync::OnceLock::new(),
        }
    }

    /// The statements that insert every item, at most `max_rows` to a statement, in
    /// order; `bind` binds one item's values (as many as the columns).
    /// No items, no statement.
    pub fn all<T>(
        &'static self,
        items: impl IntoIterator<Item = T>,
        mut bind: impl FnMut(Statement, T) -> Statement,
    ) -> Vec<Statement> {
        let mut items = items.into_iter().peekable();
        let mut out = Vec::new();
        while items.peek().is_some() {
            let chunk: Vec<T> = items.by_ref().take(self.max_rows).collect();
            let insert = self.statement(chunk.len());
            out.push(chunk.into_iter().fold(insert, &mut bind));
        }
        out
    }

    /// The statement for `rows` rows (1 to `max_rows`), arguments not bound yet.
    ///
    /// # Panics
    ///
    /// When `rows` is 0 or above `max_rows`: a writer's bug, not a runtime condition.
    pub fn statement(&'static self, rows: usize) -> Statement {
        assert!(
            (1..=self.max_rows).contains(&rows),
            "InsertRows::statement: {rows} rows, expected 1 to {}",
            self.max_rows
        );
        let texts = self.texts.get_or_init(|| {
            (1..=self.max_rows)
                .map(|n| {
                    let values = (0..n)
                        .map(|r| format!("({})", placeholders(r * self.columns + 1, self.columns)))
                        .collect::<Vec<_>>()
                        .join(", ");
                    let tail = if self.tail.is_empty() {
                        String::new()
                    } else {
                        format!(" {}", self.tail)
                    };
                    format!("{} VALUES {values}{tail}", self.head)
                })
                .collect()
        });
        sql(&texts[rows - 1])
    }
}

/// `$first, $first+1, ...` for `count` placeholders, for an `IN (...)` list whose
/// arguments are bound in that order after the `first - 1` bound before them.
pub fn placeholders(first: usize, count: usize) -> String {
    (first..first + count)
        .map(|n| format!("${n}"))
        .collect::<Vec<_>>()
        .join(", ")
}
