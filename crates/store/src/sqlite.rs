//! The SQLite back end: statements run in the calling task, on connections of this
//! process's own.
//!
//! A SQLite statement is a function call into a library in this process, and most of
//! convene's take a few microseconds. Handing each one to a connection thread and back
//! (as an async driver must) costs ten times that in wake-ups, and with it, a run's
//! hundred statements cost milliseconds of CPU and keep the one writer waiting on the
//! scheduler between statements. So statements run inline, where the caller is:
//!
//! - **One writer connection.** Writers of the process take turns anyway
//!   ([`crate::group`]), so the turn holder uses the connection alone; a statement of a
//!   transaction never waits on a lock (the transaction took SQLite's write lock with
//!   `BEGIN IMMEDIATE`). Only two steps can block: taking the write lock while another
//!   process holds it (tried without waiting first; when busy, the wait moves to a
//!   blocking thread), and the commit, whose fsync always runs on a blocking thread.
//! - **Reader connections** for reads outside a write transaction: WAL mode lets them
//!   read beside the writer, seeing what is committed. The pool grows to as many as
//!   read at one moment (at most the threads running tasks) and keeps them.
//!
//! Every connection has `synchronous = FULL`, foreign keys on, temporary storage in
//! memory and a busy handler that polls for a lock another process holds (see
//! [`wait_for_lock`]); the file is in WAL mode (set when it is migrated, and checked by the writer).

use std::cell::Cell;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use rusqlite::types::{Value as SqlValue, ValueRef};
use rusqlite::{Connection, ErrorCode, OpenFlags};

use crate::Error;
use crate::statement::{Arg, Statement};

/// How long taking the write lock waits for another process's write to finish before it
/// gives up. Writers in one process queue on [`crate::group`]'s turn first, so this only
/// covers processes sharing a file (the end-to-end harness, `convene serve` side by
/// side), whose transactions are short.
pub(crate) const BUSY_TIMEOUT: Duration = Duration::from_secs(30);

/// Prepared statements kept per connection: every statement convene's stores run fits.
const STATEMENT_CACHE: usize = 256;

/// The open SQLite file.
pub(crate) struct Sqlite {
    path: PathBuf,
    /// `None` once closed.
    writer: Arc<Mutex<Option<Connection>>>,
    readers: Mutex<Vec<Connection>>,
    closed: AtomicBool,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while a connection was in use leaves it usable: SQLite keeps its own state
    // consistent, and an open transaction is rolled back by the next begin.
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

thread_local! {
    /// When the wait for another process's lock that this thread is in began.
    static WAITING_SINCE: Cell<Option<Instant>> = const { Cell::new(None) };
}

/// Waits for a lock another process holds, as SQLite's busy handler: `tries` is how
/// often this wait asked before; false gives up (after [`BUSY_TIMEOUT`]).
///
/// SQLite's own handler sleeps 1, 2, 5, 10 … 100 ms between tries, so a writer that
/// finds another process's transaction in progress sleeps at least a millisecond, often
/// far longer than convene's transactions hold the lock (processes sharing a file each
/// commit a batch every millisecond or two under load). This one tries again after
/// [`pause`].
fn wait_for_lock(tries: i32) -> bool {
    let now = Instant::now();
    let since = WAITING_SINCE.with(|since| match since.get() {
        Some(start) if tries > 0 => start,
        _ => {
            since.set(Some(now));
            now
        }
    });
    if now.duration_since(since) >= BUSY_TIMEOUT {
        return false;
    }
    std::thread::sleep(pause(tries));
    true
}

/// The pause before try `tries + 1` for a lock: 50 µs, doubling up to 1 ms.
fn pause(tries: i32) -> Duration {
    let doublings = u32::try_from(tries.clamp(0, 5)).unwrap_or(5);
    Duration::from_micros(50 << doublings).min(Duration::from_millis(1))
}

fn connect(path: &Path) -> rusqlite::Result<Connection> {
    // NO_MUTEX: each connection is used by one thread at a time, behind a lock here.
    let conn = Connection::open_with_flags(
        path,
        OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_NO_MUTEX,
    )?;
    conn.busy_handler(Some(wait_for_lock))?;
    // FULL, not NORMAL: see `database::sqlite_options`. Temporary storage in memory:
    // the savepoints of group commit keep their undo pages there instead of writing
    // them to a temporary file.
    conn.execute_batch(
        "PRAGMA foreign_keys = ON; PRAGMA synchronous = FULL; PRAGMA temp_store = MEMORY;",
    )?;
    conn.set_prepared_statement_cache_capacity(STATEMENT_CACHE);
    Ok(conn)
}

impl Sqlite {
    /// Opens the (already created and migrated) file at `path`.
    pub(crate) async fn open(
        path: PathBuf,
    ) -> Result<Self, Box<dyn std::error::Error + Send + Sync>> {
        let opened = path.clone();
        let writer = tokio::task::spawn_blocking(move || {
            let conn = connect(&opened)?;
            let mode: String = conn.query_row("PRAGMA journal_mode = WAL", [], |r| r.get(0))?;
            debug_assert_eq!(mode, "wal");
            Ok::<_, rusqlite::Error>(conn)
        })
        .await??;
        Ok(Self {
            path,
            writer: Arc::new(Mutex::new(Some(writer))),
            readers: Mutex::new(Vec::new()),
            closed: AtomicBool::new(false),
        })
    }

    fn check_open(&self) -> Result<(), Error> {
        if self.closed.load(Ordering::Acquire) {
            Err(Error::Closed)
        } else {
            Ok(())
        }
    }

    /// Runs a reading statement on a reader connection; returns every row.
    pub(crate) fn fetch_all(&self, statement: &Statement) -> Result<Vec<SqliteRow>, Error> {
        self.check_open()?;
        let pooled = lock(&self.readers).pop();
        let conn = match pooled {
            Some(conn) => conn,
            None => connect(&self.path)?,
        };
        let rows = query(&conn, statement);
        if !self.closed.load(Ordering::Acquire) {
            lock(&self.readers).push(conn);
        }
        rows
    }

    /// Starts a write transaction on the writer connection (`BEGIN IMMEDIATE`). Only
    /// one may be open at a time: callers hold [`crate::group`]'s turn.
    pub(crate) async fn begin(&self) -> Result<WriterTx, Error> {
        self.check_open()?;
        // Try without waiting: in one process the lock is free (writers take turns).
        match begin_immediate(&self.writer, false) {
            Ok(()) => {}
            Err(Error::Sqlite(e)) if e.sqlite_error_code() == Some(ErrorCode::DatabaseBusy) => {
                // Another process writes: wait for it on a blocking thread.
                let writer = self.writer.clone();
                tokio::task::spawn_blocking(move || begin_immediate(&writer, true))
                    .await
                    .map_err(|e| Error::Commit(format!("taking the write lock failed: {e}")))??;
            }
            Err(e) => return Err(e),
        }
        Ok(WriterTx {
            writer: self.writer.clone(),
            open: true,
        })
    }

    /// Rolls back a transaction open on the writer with nobody to end it: one that a
    /// begin left behind when its caller stopped waiting for another process's write
    /// lock (the blocking thread takes the lock later and returns to no one). Called
    /// while no writer of this process has the turn ([`crate::group`]); the writer's
    /// lock is only tried, so a begin still waiting is left alone until the next call.
    pub(crate) fn release_orphaned(&self) {
        let guard = match self.writer.try_lock() {
            Ok(guard) => guard,
            Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => return,
        };
        if let Some(conn) = guard.as_ref()
            && !conn.is_autocommit()
        {
            tracing::debug!("rolling back a write transaction whose writer went away");
            let _ = conn.execute_batch("ROLLBACK");
        }
    }

    /// Closes the writer and the idle readers; later calls fail with [`Error::Closed`].
    /// Waits for a statement in progress on the writer.
    pub(crate) fn close(&self) {
        self.closed.store(true, Ordering::Release);
        lock(&self.readers).clear();
        if let Some(conn) = lock(&self.writer).take()
            && !conn.is_autocommit()
        {
            let _ = conn.execute_batch("ROLLBACK");
        }
    }
}

/// `BEGIN IMMEDIATE` on the writer; with `wait`, waiting up to [`BUSY_TIMEOUT`] for
/// another process's lock, else failing at once with `SQLITE_BUSY` when it is taken.
fn begin_immediate(writer: &Mutex<Option<Connection>>, wait: bool) -> Result<(), Error> {
    let mut guard = lock(writer);
    let conn = guard.as_mut().ok_or(Error::Closed)?;
    if !conn.is_autocommit() {
        // Left open by a begin whose writer went away before it returned: it holds
        // nothing of anyone's.
        conn.execute_batch("ROLLBACK")?;
    }
    if !wait {
        // A zero timeout removes the busy handler: a taken lock fails at once.
        conn.busy_timeout(Duration::ZERO)?;
    }
    let begun = conn.execute_batch("BEGIN IMMEDIATE");
    if !wait {
        conn.busy_handler(Some(wait_for_lock))?;
    }
    Ok(begun?)
}

/// The open write transaction. Dropping it without [`commit`](Self::commit) rolls it
/// back.
pub(crate) struct WriterTx {
    writer: Arc<Mutex<Option<Connection>>>,
    open: bool,
}

impl WriterTx {
    fn with<T>(&self, f: impl FnOnce(&Connection) -> Result<T, Error>) -> Result<T, Error> {
        let guard = lock(&self.writer);
        f(guard.as_ref().ok_or(Error::Closed)?)
    }

    /// Runs a statement; returns the rows it changed.
    pub(crate) fn execute(&mut self, statement: &Statement) -> Result<u64, Error> {
        self.with(|conn| {
            query(conn, statement)?;
            Ok(conn.changes())
        })
    }

    /// Runs a statement; returns every row.
    pub(crate) fn fetch_all(&mut self, statement: &Statement) -> Result<Vec<SqliteRow>, Error> {
        self.with(|conn| query(conn, statement))
    }

    /// Runs fixed SQL without arguments (savepoints).
    pub(crate) fn run(&mut self, text: &'static str) -> Result<(), Error> {
        self.with(|conn| {
            conn.prepare_cached(text)?.raw_execute()?;
            Ok(())
        })
    }

    /// Commits, with its fsync on a blocking thread. A failed commit is rolled back.
    pub(crate) async fn commit(mut self) -> Result<(), Error> {
        self.open = false;
        let writer = self.writer.clone();
        tokio::task::spawn_blocking(move || {
            let guard = lock(&writer);
            let conn = guard.as_ref().ok_or(Error::Closed)?;
            let committed = conn.execute_batch("COMMIT");
            if committed.is_err() && !conn.is_autocommit() {
                let _ = conn.execute_batch("ROLLBACK");
            }
            Ok(committed?)
        })
        .await
        .map_err(|e| Error::Commit(format!("the commit did not finish: {e}")))?
    }

    /// Rolls back.
    pub(crate) fn rollback(mut self) -> Result<(), Error> {
        self.open = false;
        self.with(|conn| {
            if !conn.is_autocommit() {
                conn.execute_batch("ROLLBACK")?;
            }
            Ok(())
        })
    }
}

impl Drop for WriterTx {
    fn drop(&mut self) {
        if self.open {
            let guard = lock(&self.writer);
            if let Some(conn) = guard.as_ref()
                && !conn.is_autocommit()
            {
                let _ = conn.execute_batch("ROLLBACK");
            }
        }
    }
}

/// Prepares (from the connection's cache), binds and runs a statement; returns its rows.
fn query(conn: &Connection, statement: &Statement) -> Result<Vec<SqliteRow>, Error> {
    let mut stmt = conn.prepare_cached(statement.text())?;
    let args = statement.args();
    for index in 1..=stmt.parameter_count() {
        // Placeholders are `$n`: the n-th argument, wherever and however often it
        // appears.
        let arg = stmt
            .parameter_name(index)
            .and_then(|name| name.strip_prefix('$'))
            .and_then(|n| n.parse::<usize>().ok())
            .and_then(|n| n.checked_sub(1))
            .and_then(|n| args.get(n))
            .ok_or_else(|| Error::Placeholder {
                statement: statement.text().to_owned(),
                index,
                bound: args.len(),
            })?;
        match arg {
            Arg::Int(v) => stmt.raw_bind_parameter(index, v)?,
            Arg::Text(v) => stmt.raw_bind_parameter(index, v.as_deref())?,
            Arg::Bytes(v) => stmt.raw_bind_parameter(index, v.as_deref())?,
            Arg::Bool(v) => stmt.raw_bind_parameter(index, v.map(i64::from))?,
        }
    }
    let columns: Arc<[String]> = stmt.column_names().into_iter().map(str::to_owned).collect();
    let width = columns.len();
    let mut rows = stmt.raw_query();
    let mut out = Vec::new();
    while let Some(row) = rows.next()? {
        let mut values = Vec::with_capacity(width);
        for i in 0..width {
            values.push(row.get::<_, SqlValue>(i)?);
        }
        out.push(SqliteRow {
            columns: columns.clone(),
            values,
        });
    }
    Ok(out)
}

/// A row read from SQLite: its column names and values.
#[derive(Debug, Clone)]
pub struct SqliteRow {
    columns: Arc<[String]>,
    values: Vec<SqlValue>,
}

impl SqliteRow {
    pub(crate) fn value(&self, column: &str) -> Option<ValueRef<'_>> {
        let i = self.columns.iter().position(|c| c == column)?;
        self.values.get(i).map(ValueRef::from)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lock_is_tried_again_within_a_millisecond() {
        let pauses: Vec<u128> = (0..8).map(|t| pause(t).as_micros()).collect();
        assert_eq!(pauses, [50, 100, 200, 400, 800, 1000, 1000, 1000]);
    }

    #[test]
    fn waiting_for_a_lock_gives_up_after_the_busy_timeout_and_a_new_wait_starts_over() {
        assert!(wait_for_lock(0));
        assert!(wait_for_lock(1));
        // The same wait, once it has lasted the busy timeout, gives up.
        let long_ago = Instant::now()
            .checked_sub(BUSY_TIMEOUT)
            .expect("the monotonic clock reaches back 30 s");
        WAITING_SINCE.with(|since| since.set(Some(long_ago)));
        assert!(!wait_for_lock(9));
        // A new wait (its first try) starts its own clock.
        assert!(wait_for_lock(0));
        assert!(wait_for_lock(1));
    }
}
