//! [`Database`]: a connection pool to SQLite or PostgreSQL, chosen by URL, migrated to
//! convene's schema when it is opened.

use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr as _;
use std::sync::Arc;
use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous};

use crate::Error;
use crate::combine::{Combiner, WriteFuture};
use crate::group::{Group, Physical, Turn};
use crate::sqlite::{BUSY_TIMEOUT as SQLITE_BUSY_TIMEOUT, Sqlite};
use crate::statement::{Row, Statement};

/// The value of `database_url` that keeps a service's state in memory.
pub const MEMORY: &str = "memory";

/// File name of the SQLite database in a data directory.
pub const SQLITE_FILE: &str = "convene.db";

/// Connections per PostgreSQL pool unless the URL says otherwise ([`POOL_SIZE_PARAM`]):
/// enough for concurrent commits of many runs. (SQLite has one writer connection and as
/// many readers as read at once: see [`crate::sqlite`].)
pub const POSTGRES_CONNECTIONS: u32 = 16;

/// The PostgreSQL URL's query parameter that sets how many connections the process's
/// pool opens at most, e.g. `postgres://db/convene?pool_max_conns=4`: every service
/// process holds its own pool, so a deployment of many replicas sizes it to stay within
/// the server's `max_connections`. convene takes it off the URL before connecting.
pub const POOL_SIZE_PARAM: &str = "pool_max_conns";

/// The largest pool [`POOL_SIZE_PARAM`] may ask for.
const MAX_POOL_SIZE: u32 = 1000;

/// How long opening a pool may wait for its first connection.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// The limits every PostgreSQL session of convene runs under, so that no process that
/// stops mid-transaction (frozen, paused, cut off from the server) holds up the others
/// for long: the server ends a session left idle inside a transaction after
/// `idle_in_transaction_session_timeout`, which frees its row and advisory locks at
/// once; a lock wait and a statement have upper bounds too, so nothing waits forever.
/// Each applies unless the URL's `options` parameter sets it (`options=-c
/// lock_timeout=30s`). convene's transactions run their statements back to back, so a
/// live process never sits idle in one for that long.
pub const POSTGRES_SESSION_LIMITS: [(&str, &str); 3] = [
    ("idle_in_transaction_session_timeout", "500ms"),
    ("lock_timeout", "10s"),
    ("statement_timeout", "1min"),
];

/// Which database a [`Database`] talks to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Backend {
    /// An embedded SQLite file (the default).
    Sqlite,
    /// A PostgreSQL server (clusters).
    Postgres,
}

impl fmt::Display for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Backend::Sqlite => "SQLite",
            Backend::Postgres => "PostgreSQL",
        })
    }
}

#[derive(Clone)]
enum Pool {
    Sqlite(Arc<Sqlite>),
    Postgres(PgPool),
}

/// A pool of connections to one database, shared by every store of a process.
/// Cloning is cheap: clones share the pool.
#[derive(Clone)]
pub struct Database {
    pool: Pool,
    /// Writers of this process take turns here, in order (so SQLite's single write lock
    /// is not fought over through its busy-wait back-off, which sleeps up to 100 ms per
    /// try), and share physical transactions: see [`crate::group`].
    group: Arc<Group>,
    /// Where, for logs and errors (password hidden).
    shown: Arc<str>,
    /// The queue of combined writes ([`Database::write`]); None in the combining task's
    /// own handle, so the queue closes with the last handle of everyone else.
    combiner: Option<Arc<Combiner>>,
}

impl fmt::Debug for Database {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Database")
            .field("backend", &self.backend())
            .field("url", &self.shown)
            .finish()
    }
}

/// Where a service keeps its state, as `database_url` and `data_dir` say.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Location {
    /// In memory, lost at exit (`database_url = "memory"`).
    Memory,
    /// In the database at this URL (or SQLite file path).
    Url(String),
}

impl Location {
    /// Resolves a configured `database_url`: unset means the SQLite file
    /// `<data_dir>/convene.db`, [`MEMORY`] means in memory, anything else is a URL.
    pub fn resolve(database_url: Option<&str>, data_dir: &Path) -> Self {
        match database_url.map(str::trim) {
            None | Some("") => Location::Url(sqlite_url(&data_dir.join(SQLITE_FILE))),
            Some(url) if url.eq_ignore_ascii_case(MEMORY) => Location::Memory,
            Some(url) => Location::Url(url.to_owned()),
        }
    }
}

/// The URL of the SQLite file at `path` (created when missing).
pub fn sqlite_url(path: &Path) -> String {
    format!("sqlite://{}?mode=rwc", path.display())
}

/// Opens the database a service's configuration names: `None` for [`MEMORY`], else the
/// migrated [`Database`] (by default the SQLite file `<data_dir>/convene.db`).
///
/// # Errors
///
/// As [`Database::connect`].
pub async fn open(database_url: Option<&str>, data_dir: &Path) -> Result<Option<Database>, Error> {
    match Location::resolve(database_url, data_dir) {
        Location::Memory => Ok(None),
        Location::Url(url) => Database::connect(&url).await.map(Some),
    }
}

/// Takes [`POOL_SIZE_PARAM`] off a PostgreSQL URL: the URL without it, and the pool size
/// it asks for ([`POSTGRES_CONNECTIONS`] when it is absent).
fn pool_size(url: &str) -> Result<(String, u32), String> {
    let Some((base, query)) = url.split_once('?') else {
        return Ok((url.to_owned(), POSTGRES_CONNECTIONS));
    };
    let mut size = POSTGRES_CONNECTIONS;
    let mut rest = Vec::new();
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        match pair.split_once('=') {
            Some((POOL_SIZE_PARAM, value)) => {
                size = value
                    .parse()
                    .ok()
                    .filter(|n| (1..=MAX_POOL_SIZE).contains(n))
                    .ok_or_else(|| {
                        format!(
                            "{POOL_SIZE_PARAM} must be a whole number of connections from 1 \
                             to {MAX_POOL_SIZE}, not `{value}`"
                        )
                    })?;
            }
            None if pair == POOL_SIZE_PARAM => {
                return Err(format!(
                    "{POOL_SIZE_PARAM} needs a value: the most connections this process may \
                     open, e.g. {POOL_SIZE_PARAM}=4"
                ));
            }
            _ => rest.push(pair),
        }
    }
    let url = if rest.is_empty() {
        base.to_owned()
    } else {
        format!("{base}?{}", rest.join("&"))
    };
    Ok((url, size))
}

/// The URL with its password replaced by `****`, for logs and errors.
pub fn redact(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    let authority_end = rest.find('/').unwrap_or(rest.len());
    let (authority, path) = rest.split_at(authority_end);
    match authority.rsplit_once('@') {
        Some((userinfo, host)) if userinfo.contains(':') => {
            let user = userinfo.split(':').next().unwrap_or_default();
            format!("{scheme}://{user}:****@{host}{path}")
        }
        _ => url.to_owned(),
    }
}

impl Database {
    /// Connects to the database at `url` and brings its schema up to date.
    ///
    /// - `postgres://` or `postgresql://` URLs name a PostgreSQL database;
    /// - `sqlite://<path>` or `sqlite:<path>` (with `?mode=rwc` to create it; without a
    ///   `mode` it is created too) or a plain file path name a SQLite file, opened in WAL
    ///   mode with `synchronous = FULL`, a busy timeout and foreign keys on.
    ///
    /// # Errors
    ///
    /// [`Error::BadUrl`] for a URL that names neither, [`Error::CreateDir`] when a SQLite
    /// file's directory cannot be created, [`Error::Unreachable`] when no connection can
    /// be made, [`Error::Migration`] when the schema cannot be migrated.
    pub async fn connect(url: &str) -> Result<Self, Error> {
        let url = url.trim();
        let shown = redact(url);
        let bad = |reason: String| Error::BadUrl {
            url: shown.clone(),
            reason,
        };
        let lower = url.to_ascii_lowercase();
        let db = if lower.starts_with("postgres://") || lower.starts_with("postgresql://") {
            let (url, connections) = pool_size(url).map_err(bad)?;
            let options =
                session_limits(PgConnectOptions::from_str(&url).map_err(|e| bad(e.to_string()))?);
            let pool = PgPoolOptions::new()
                .max_connections(connections)
                .acquire_timeout(CONNECT_TIMEOUT)
                // No ping before every use: a broken connection fails its statement,
                // which callers treat as transient, and the pool replaces it.
                .test_before_acquire(false)
                .connect_with(options)
                .await
                .map_err(|source| Error::Unreachable {
                    backend: Backend::Postgres,
                    url: shown.clone(),
                    source: source.into(),
                })?;
            let migrated = async { crate::migrations::postgres().await?.run(&pool).await };
            migrated.await.map_err(|source| Error::Migration {
                backend: Backend::Postgres,
                url: shown.clone(),
                source,
            })?;
            Self::new(Pool::Postgres(pool), &shown)
        } else {
            let options = sqlite_options(url).map_err(bad)?;
            let file = options.get_filename().to_owned();
            if file.as_os_str() == ":memory:" {
                return Err(bad(
                    "an in-memory SQLite database is private to one connection; use \
                     `memory` to keep state in memory"
                        .to_owned(),
                ));
            }
            if let Some(dir) = file.parent().filter(|d| !d.as_os_str().is_empty()) {
                std::fs::create_dir_all(dir).map_err(|source| Error::CreateDir {
                    path: dir.to_owned(),
                    source,
                })?;
            }
            migrate_sqlite(options, &shown).await?;
            let sqlite = Sqlite::open(file)
                .await
                .map_err(|source| Error::Unreachable {
                    backend: Backend::Sqlite,
                    url: shown.clone(),
                    source,
                })?;
            Self::new(Pool::Sqlite(Arc::new(sqlite)), &shown)
        };
        tracing::debug!(backend = %db.backend(), url = %db.shown, "database open and migrated");
        Ok(db)
    }

    fn new(pool: Pool, shown: &str) -> Self {
        let idle: Option<Box<dyn Fn() + Send + Sync>> = match &pool {
            Pool::Sqlite(sqlite) => {
                let sqlite = Arc::downgrade(sqlite);
                Some(Box::new(move || {
                    if let Some(sqlite) = sqlite.upgrade() {
                        sqlite.release_orphaned();
                    }
                }))
            }
            Pool::Postgres(_) => None,
        };
        let base = Self {
            pool,
            group: Group::new(idle),
            shown: shown.into(),
            combiner: None,
        };
        Self {
            combiner: Some(Arc::new(Combiner::start(base.clone()))),
            ..base
        }
    }

    /// Which back end this is.
    pub fn backend(&self) -> Backend {
        match self.pool {
            Pool::Sqlite(_) => Backend::Sqlite,
            Pool::Postgres(_) => Backend::Postgres,
        }
    }

    /// The most connections the PostgreSQL pool opens ([`POOL_SIZE_PARAM`]); `None` for
    /// SQLite.
    pub fn max_connections(&self) -> Option<u32> {
        match &self.pool {
            Pool::Sqlite(_) => None,
            Pool::Postgres(pool) => Some(pool.options().get_max_connections()),
        }
    }

    /// Whether `other` is a handle on this very database (a clone of this handle), whose
    /// writes can share this one's transactions.
    pub fn same_as(&self, other: &Database) -> bool {
        Arc::ptr_eq(&self.group, &other.group)
    }

    /// Where the database is, with any password hidden.
    pub fn url(&self) -> &str {
        &self.shown
    }

    /// Starts a write transaction. On SQLite it waits for this process's other writers,
    /// then takes the database's write lock at once (`BEGIN IMMEDIATE`), so a transaction
    /// that reads before it writes can never fail to upgrade its lock half-way. Dropping
    /// the transaction without [`Tx::commit`] rolls it back.
    ///
    /// # Errors
    ///
    /// [`Error::Query`] when no connection is available or `BEGIN` fails.
    pub async fn begin(&self) -> Result<Tx, Error> {
        let turn = match &self.pool {
            Pool::Sqlite(sqlite) => {
                let sqlite = sqlite.clone();
                self.group
                    .begin(|| async move { Ok(Physical::Sqlite(sqlite.begin().await?)) })
                    .await?
            }
            Pool::Postgres(pool) => {
                let pool = pool.clone();
                self.group
                    .begin(|| async move { Ok(Physical::Postgres(pool.begin().await?)) })
                    .await?
            }
        };
        Ok(Tx {
            turn: Some(turn),
            group: self.group.clone(),
            backend: self.backend(),
        })
    }

    /// Runs `job` in a write transaction and commits it: its value once its changes are
    /// on disk, or its error (or the commit's) with nothing of it kept.
    ///
    /// Unlike [`Database::begin`], the job runs in the task that combines this process's
    /// writes ([`crate::combine`]), one after another with the others queued, in a
    /// savepoint of its own, and they share one commit: under load, no writer waits for
    /// its own task to be scheduled before it may write. So the job must own what it
    /// writes (`'static`), and should only run statements: it holds up every other
    /// writer of the process while it runs. It runs to its end even when the caller
    /// stops waiting.
    ///
    /// ```no_run
    /// # use convene_store::{Database, Error, sql};
    /// # async fn example(db: &Database, a: String) -> Result<(), Error> {
    /// db.write(move |tx| Box::pin(async move {
    ///     tx.execute(sql("INSERT INTO t (a) VALUES ($1)").bind(a)).await?;
    ///     Ok::<_, Error>(())
    /// }))
    /// .await?;
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// # Errors
    ///
    /// The job's own error, or [`Error::Commit`] when the transaction could not begin or
    /// commit (or the job panicked).
    pub async fn write<T, E, F>(&self, job: F) -> Result<T, E>
    where
        F: for<'a> FnOnce(&'a mut Tx) -> WriteFuture<'a, Result<T, E>> + Send + 'static,
        T: Send + 'static,
        E: From<Error> + Send + 'static,
    {
        match &self.combiner {
            Some(combiner) => combiner.write(job).await,
            None => {
                let mut tx = self.begin().await?;
                let value = job(&mut tx).await?;
                tx.commit().await?;
                Ok(value)
            }
        }
    }

    /// Write transactions committed through this handle so far, and the physical
    /// commits (fsyncs) that carried them: writers that queue up behind each other share
    /// one (see [`crate::group`]).
    pub fn commits(&self) -> (u64, u64) {
        self.group.commits()
    }

    /// Runs one writing statement as a write of its own ([`Database::write`]); returns
    /// the rows it changed.
    ///
    /// # Errors
    ///
    /// [`Error::Query`] when the statement fails (nothing is changed then).
    pub async fn execute(&self, statement: Statement) -> Result<u64, Error> {
        self.write(move |tx| Box::pin(async move { tx.execute(statement).await }))
            .await
    }

    /// Runs one writing statement with a `RETURNING` clause as a write of its own
    /// ([`Database::write`]); returns its row, if any.
    ///
    /// # Errors
    ///
    /// [`Error::Query`] when the statement fails (nothing is changed then).
    pub async fn write_returning(&self, statement: Statement) -> Result<Option<Row>, Error> {
        self.write(move |tx| Box::pin(async move { tx.fetch_optional(statement).await }))
            .await
    }

    /// Runs a reading statement; returns its first row, if any. Writes go through
    /// [`execute`](Self::execute) or [`begin`](Self::begin), which order writers.
    ///
    /// # Errors
    ///
    /// [`Error::Query`] when the statement fails.
    pub async fn fetch_optional(&self, statement: Statement) -> Result<Option<Row>, Error> {
        Ok(match &self.pool {
            Pool::Sqlite(sqlite) => sqlite
                .fetch_all(&statement)?
                .into_iter()
                .next()
                .map(Row::Sqlite),
            Pool::Postgres(pool) => statement
                .postgres()
                .fetch_optional(pool)
                .await?
                .map(Row::Postgres),
        })
    }

    /// Runs a reading statement; returns every row.
    ///
    /// # Errors
    ///
    /// [`Error::Query`] when the statement fails.
    pub async fn fetch_all(&self, statement: Statement) -> Result<Vec<Row>, Error> {
        Ok(match &self.pool {
            Pool::Sqlite(sqlite) => sqlite
                .fetch_all(&statement)?
                .into_iter()
                .map(Row::Sqlite)
                .collect(),
            Pool::Postgres(pool) => statement
                .postgres()
                .fetch_all(pool)
                .await?
                .into_iter()
                .map(Row::Postgres)
                .collect(),
        })
    }

    /// Closes every connection; later calls fail. Waits for connections in use to come
    /// back first.
    pub async fn close(&self) {
        match &self.pool {
            Pool::Sqlite(sqlite) => sqlite.close(),
            Pool::Postgres(pool) => pool.close().await,
        }
    }
}

/// Brings a SQLite file's schema up to date, through a connection of its own that is
/// closed afterwards.
async fn migrate_sqlite(options: SqliteConnectOptions, shown: &str) -> Result<(), Error> {
    // Processes opening one file at the same moment may find it locked while another
    // sets it up (WAL mode, migrations), or fail on a table the other just created: a
    // few tries order them, and a later pass finds every migration applied.
    let mut attempt: u32 = 0;
    loop {
        attempt += 1;
        let opened = SqlitePoolOptions::new()
            .max_connections(1)
            .acquire_timeout(CONNECT_TIMEOUT)
            .connect_with(options.clone())
            .await;
        let pool = match opened {
            Ok(pool) => pool,
            Err(sqlx::Error::Database(e)) if attempt < 5 && e.code().as_deref() == Some("5") => {
                tracing::debug!(attempt, "the SQLite file is locked while opening; retrying");
                tokio::time::sleep(Duration::from_millis(50 * u64::from(attempt))).await;
                continue;
            }
            Err(source) => {
                return Err(Error::Unreachable {
                    backend: Backend::Sqlite,
                    url: shown.to_owned(),
                    source: source.into(),
                });
            }
        };
        let outcome = async { crate::migrations::sqlite().await?.run(&pool).await }.await;
        pool.close().await;
        match outcome {
            Ok(()) => return Ok(()),
            Err(e) if attempt < 5 => {
                tracing::debug!(error = %e, attempt, "migration raced another process; retrying");
                tokio::time::sleep(Duration::from_millis(50 * u64::from(attempt))).await;
            }
            Err(source) => {
                return Err(Error::Migration {
                    backend: Backend::Sqlite,
                    url: shown.to_owned(),
                    source,
                });
            }
        }
    }
}

/// The options of a SQLite URL or path, with convene's settings.
fn sqlite_options(url: &str) -> Result<SqliteConnectOptions, String> {
    let lower = url.to_ascii_lowercase();
    let options = if lower.starts_with("sqlite:") {
        let explicit_mode = url.contains("mode=");
        let options = SqliteConnectOptions::from_str(url).map_err(|e| e.to_string())?;
        // Creating the file is what every convene service wants unless the URL says
        // otherwise (`mode=ro` / `mode=rw`).
        if explicit_mode {
            options
        } else {
            options.create_if_missing(true)
        }
    } else if url.contains("://") {
        let scheme = url.split("://").next().unwrap_or_default();
        return Err(format!(
            "scheme {scheme}:// is not supported (only sqlite:// and postgres://)"
        ));
    } else if url.is_empty() {
        return Err("it is empty".to_owned());
    } else {
        SqliteConnectOptions::new()
            .filename(PathBuf::from(url))
            .create_if_missing(true)
    };
    if options.get_filename().as_os_str().is_empty() {
        return Err("it names no file".to_owned());
    }
    Ok(options
        .journal_mode(SqliteJournalMode::Wal)
        // FULL, not NORMAL: in WAL mode NORMAL survives a crash of the process but may
        // lose the last commits on power loss or an operating-system crash. convene
        // answers callers only after their state is committed (a counted call, a logged
        // decision, an executed approval, an accepted run) and promises exactly-once
        // effects on top of it, so a commit must be on disk when it returns. The price is
        // one WAL fsync per write transaction, which batching writers share.
        .synchronous(SqliteSynchronous::Full)
        .busy_timeout(SQLITE_BUSY_TIMEOUT)
        .foreign_keys(true))
}

/// A write transaction on either back end (see [`Database::begin`]): a savepoint of the
/// physical transaction its batch of writers shares ([`crate::group`]).
pub struct Tx {
    turn: Option<Turn>,
    group: Arc<Group>,
    backend: Backend,
}

impl fmt::Debug for Tx {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tx")
            .field("backend", &self.backend())
            .finish_non_exhaustive()
    }
}

impl Drop for Tx {
    fn drop(&mut self) {
        if let Some(turn) = self.turn.take() {
            self.group.abandon(turn);
        }
    }
}

impl Tx {
    /// Which back end the transaction runs on.
    pub fn backend(&self) -> Backend {
        self.backend
    }

    fn physical(&mut self) -> Result<&mut Physical, Error> {
        self.turn
            .as_mut()
            .and_then(|t| t.batch.physical.as_mut())
            .ok_or_else(|| {
                Error::Commit("the transaction was rolled back by an earlier failure".to_owned())
            })
    }

    /// Runs a statement; returns the rows it changed.
    ///
    /// # Errors
    ///
    /// [`Error::Query`] when it fails. PostgreSQL then refuses every further statement
    /// of the transaction: roll back (drop it) and start over.
    pub async fn execute(&mut self, statement: Statement) -> Result<u64, Error> {
        Ok(match self.physical()? {
            Physical::Sqlite(tx) => tx.execute(&statement)?,
            Physical::Postgres(tx) => statement
                .postgres()
                .execute(&mut **tx)
                .await?
                .rows_affected(),
        })
    }

    /// Runs a statement; returns its first row, if any.
    ///
    /// # Errors
    ///
    /// As [`execute`](Self::execute).
    pub async fn fetch_optional(&mut self, statement: Statement) -> Result<Option<Row>, Error> {
        Ok(match self.physical()? {
            Physical::Sqlite(tx) => tx
                .fetch_all(&statement)?
                .into_iter()
                .next()
                .map(Row::Sqlite),
            Physical::Postgres(tx) => statement
                .postgres()
                .fetch_optional(&mut **tx)
                .await?
                .map(Row::Postgres),
        })
    }

    /// Runs a statement; returns every row.
    ///
    /// # Errors
    ///
    /// As [`execute`](Self::execute).
    pub async fn fetch_all(&mut self, statement: Statement) -> Result<Vec<Row>, Error> {
        Ok(match self.physical()? {
            Physical::Sqlite(tx) => tx
                .fetch_all(&statement)?
                .into_iter()
                .map(Row::Sqlite)
                .collect(),
            Physical::Postgres(tx) => statement
                .postgres()
                .fetch_all(&mut **tx)
                .await?
                .into_iter()
                .map(Row::Postgres)
                .collect(),
        })
    }

    /// Commits. The changes are durable when this returns Ok (they were committed with
    /// the other writers of their batch).
    ///
    /// # Errors
    ///
    /// [`Error::Commit`] when the commit fails; nothing was changed then.
    pub async fn commit(mut self) -> Result<(), Error> {
        let turn = self.turn.take().expect("a transaction ends once");
        self.group.commit(turn).await
    }

    /// Rolls back now (dropping the transaction does too, a moment later).
    ///
    /// # Errors
    ///
    /// [`Error::Commit`] when the rollback fails.
    pub async fn rollback(mut self) -> Result<(), Error> {
        let turn = self.turn.take().expect("a transaction ends once");
        self.group.rollback(turn).await
    }
}

/// `options` with each of [`POSTGRES_SESSION_LIMITS`] its own `options` do not set.
fn session_limits(options: PgConnectOptions) -> PgConnectOptions {
    let set = options.get_options().unwrap_or_default().to_owned();
    let missing: Vec<(&str, &str)> = POSTGRES_SESSION_LIMITS
        .into_iter()
        .filter(|(name, _)| !set.contains(name))
        .collect();
    options.options(missing)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_pool_size_comes_off_the_url_and_bad_ones_say_what_to_give() {
        let base = "postgres://app:pw@db:5432/convene";
        assert_eq!(
            pool_size(base).unwrap(),
            (base.to_owned(), POSTGRES_CONNECTIONS)
        );
        assert_eq!(
            pool_size(&format!("{base}?pool_max_conns=4")).unwrap(),
            (base.to_owned(), 4)
        );
        // Other parameters stay, in their order.
        assert_eq!(
            pool_size(&format!(
                "{base}?sslmode=require&pool_max_conns=2&application_name=x"
            ))
            .unwrap(),
            (format!("{base}?sslmode=require&application_name=x"), 2)
        );
        for bad in ["0", "1001", "-3", "four", ""] {
            let err = pool_size(&format!("{base}?pool_max_conns={bad}")).unwrap_err();
            assert!(
                err.contains("pool_max_conns must be a whole number of connections from 1 to 1000")
                    && err.contains(&format!("`{bad}`")),
                "{bad}: {err}"
            );
        }
        let err = pool_size(&format!("{base}?pool_max_conns")).unwrap_err();
        assert!(err.contains("needs a value"), "{err}");
    }
}
