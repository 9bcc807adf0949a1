//! Databases for tests: a fresh SQLite file always, and a fresh PostgreSQL database when
//! [`POSTGRES_ENV`] names a server; and honest skips for tests whose outside service
//! (PostgreSQL, NATS) is missing: [`Service::missing`].
//!
//! ```no_run
//! # async fn example() {
//! for t in convene_store::test_util::test_databases().await {
//!     // ... exercise a store over `t.db`; failures name `t.label` ...
//! }
//! # }
//! ```

use std::fmt;
use std::io::Write as _;

use sqlx::{Connection as _, Executor as _, PgConnection};
use tempfile::TempDir;

use crate::{Database, Error, redact};

/// The variable naming a PostgreSQL server for tests, e.g.
/// `postgres://postgres@127.0.0.1:5432/postgres`. Each test database is created on it as
/// `convene_test_<uuid>` and dropped afterwards; the URL's own database is only used to
/// run `CREATE DATABASE` and `DROP DATABASE`.
pub const POSTGRES_ENV: &str = "CONVENE_TEST_POSTGRES_URL";

/// The variable that forbids skips: when it is `1` (or `true`), a test whose service is
/// missing fails instead of skipping. CI sets it, so that no test is skipped there
/// unnoticed.
pub const REQUIRE_SERVICES_ENV: &str = "CONVENE_TEST_REQUIRE_SERVICES";

/// A service that some tests need from outside their process, and the variable that
/// names it to them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Service {
    /// Its name in messages, e.g. `PostgreSQL`.
    pub name: &'static str,
    /// The variable that names a server of it to the tests.
    pub variable: &'static str,
}

/// PostgreSQL, named by [`POSTGRES_ENV`].
pub const POSTGRES: Service = Service {
    name: "PostgreSQL",
    variable: POSTGRES_ENV,
};

impl Service {
    /// The calling test (or a part of it) cannot run because this service is missing:
    /// `why` says how, e.g. `is not configured` or `does not answer at <url>`. Prints a
    /// line naming the test, the service and the variable that enables it, and returns:
    /// the caller then skips what needs the service.
    ///
    /// # Panics
    ///
    /// With the same message when [`REQUIRE_SERVICES_ENV`] is set: a run that requires
    /// every service must not pass without one.
    pub fn missing(self, why: &str) {
        let line = missing(services_required(), &current_test(), self, why);
        // Straight to the process's stderr, past the test harness's capture: a passing
        // test's captured output is never shown, and a skip must be seen.
        let _ = writeln!(std::io::stderr(), "{line}");
    }
}

/// Whether [`REQUIRE_SERVICES_ENV`] forbids skips.
pub fn services_required() -> bool {
    required(std::env::var(REQUIRE_SERVICES_ENV).ok().as_deref())
}

fn required(value: Option<&str>) -> bool {
    matches!(value.map(str::trim), Some("1" | "true"))
}

/// The skip line for `test`, or, when skips are forbidden, a panic with its reason.
fn missing(required: bool, test: &str, service: Service, why: &str) -> String {
    let Service { name, variable } = service;
    assert!(
        !required,
        "{test} needs {name}, which {why}; {REQUIRE_SERVICES_ENV} is set, so it may not be \
         skipped: set {variable} to a server that answers"
    );
    format!("skipped: {test} needs {name}, which {why}; set {variable} to run it")
}

/// The running test's name: libtest names each test's thread after it. A helper called
/// from another thread (a runtime's worker) says so instead.
pub fn current_test() -> String {
    std::thread::current()
        .name()
        .filter(|name| *name != "main")
        .map_or_else(|| "a test on an unnamed thread".to_owned(), str::to_owned)
}

/// A fresh, migrated database for one test, removed when dropped.
pub struct TestDatabase {
    /// The database.
    pub db: Database,
    /// `sqlite` or `postgres`, for assertion messages.
    pub label: &'static str,
    // Dropped after `db`, so the pool closes before its file or database goes.
    _guard: Guard,
}

impl TestDatabase {
    /// The URL of a PostgreSQL test database (None for SQLite), to open another pool on it
    /// as another process would.
    pub fn postgres_url(&self) -> Option<&str> {
        match &self._guard {
            Guard::Postgres(server) => Some(server.url()),
            _ => None,
        }
    }
}

impl fmt::Debug for TestDatabase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TestDatabase")
            .field("label", &self.label)
            .field("db", &self.db)
            .finish()
    }
}

enum Guard {
    Dir(#[allow(dead_code)] TempDir),
    Postgres(#[allow(dead_code)] TestPostgres),
}

/// A fresh SQLite database in a temporary directory.
///
/// # Panics
///
/// When the directory or database cannot be created.
pub async fn sqlite() -> TestDatabase {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let db = Database::connect(&crate::sqlite_url(&dir.path().join(crate::SQLITE_FILE)))
        .await
        .expect("a fresh SQLite database opens");
    TestDatabase {
        db,
        label: "sqlite",
        _guard: Guard::Dir(dir),
    }
}

/// A fresh SQLite database, and a fresh PostgreSQL database when [`POSTGRES_ENV`] is
/// set (without it, the PostgreSQL half is skipped, saying so: [`Service::missing`]).
///
/// # Panics
///
/// When a database cannot be created, including a PostgreSQL server that the variable
/// names but that does not answer: a test run that asked for PostgreSQL must not pass
/// quietly without it. And without the variable when [`REQUIRE_SERVICES_ENV`] is set.
pub async fn test_databases() -> Vec<TestDatabase> {
    let mut all = vec![sqlite().await];
    let Some(admin) = postgres_server() else {
        POSTGRES.missing("is not configured (the test runs on SQLite only)");
        return all;
    };
    let server = TestPostgres::create(&admin).await.unwrap_or_else(|e| {
        panic!(
            "{POSTGRES_ENV}={} but no test database can be created there: {e}",
            redact(&admin)
        )
    });
    let db = Database::connect(server.url())
        .await
        .expect("the fresh PostgreSQL database opens");
    all.push(TestDatabase {
        db,
        label: "postgres",
        _guard: Guard::Postgres(server),
    });
    all
}

/// The PostgreSQL server a test needs: the one [`POSTGRES_ENV`] names, or None after
/// [`Service::missing`] said that the test is skipped.
///
/// # Panics
///
/// When the variable is unset and [`REQUIRE_SERVICES_ENV`] is set.
pub fn postgres_server_or_skip() -> Option<String> {
    let server = postgres_server();
    if server.is_none() {
        POSTGRES.missing("is not configured");
    }
    server
}

/// The PostgreSQL server tests should use, if [`POSTGRES_ENV`] names one.
pub fn postgres_server() -> Option<String> {
    std::env::var(POSTGRES_ENV)
        .ok()
        .filter(|v| !v.trim().is_empty())
}

/// The variable naming the Python the MCP tests run the example server with.
pub const PYTHON_ENV: &str = "CONVENE_TEST_PYTHON";

/// A Python with the `mcp` package (the official MCP SDK), named by [`PYTHON_ENV`].
pub const PYTHON_MCP: Service = Service {
    name: "a Python with the mcp package",
    variable: PYTHON_ENV,
};

/// The Python that runs the example MCP server: [`PYTHON_ENV`] if set (it must import
/// `mcp`), else the first of `candidates` that does (e.g. the repository's
/// `.venv/bin/python`); `None` after reporting the skip.
///
/// # Panics
///
/// When [`PYTHON_ENV`] names a Python that cannot import `mcp`, or none is found and
/// [`REQUIRE_SERVICES_ENV`] is set.
pub fn python_with_mcp(candidates: &[std::path::PathBuf]) -> Option<std::path::PathBuf> {
    let imports_mcp = |python: &std::path::Path| {
        std::process::Command::new(python)
            .args(["-c", "import mcp.server.mcpserver"])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    };
    if let Some(given) = std::env::var_os(PYTHON_ENV) {
        let given = std::path::PathBuf::from(given);
        assert!(
            imports_mcp(&given),
            "{PYTHON_ENV}={} cannot import the mcp package; install it with `{} -m pip \
             install mcp==2.3.0`",
            given.display(),
            given.display()
        );
        return Some(given);
    }
    let found = candidates.iter().find(|p| imports_mcp(p)).cloned();
    if found.is_none() {
        PYTHON_MCP.missing("is not found (no candidate imports mcp)");
    }
    found
}

/// A database created for a test on a PostgreSQL server, dropped (with its
/// connections) when this value is dropped.
pub struct TestPostgres {
    admin_url: String,
    name: String,
    url: String,
}

impl fmt::Debug for TestPostgres {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TestPostgres")
            .field("url", &redact(&self.url))
            .finish()
    }
}

impl TestPostgres {
    /// Creates `convene_test_<uuid>` on the server `admin_url` connects to.
    ///
    /// # Errors
    ///
    /// [`Error::Unreachable`] or [`Error::Query`] when the server cannot be reached or
    /// refuses to create the database.
    pub async fn create(admin_url: &str) -> Result<Self, Error> {
        let name = format!("convene_test_{}", uuid::Uuid::new_v4().simple());
        let mut admin =
            PgConnection::connect(admin_url)
                .await
                .map_err(|source| Error::Unreachable {
                    backend: crate::Backend::Postgres,
                    url: redact(admin_url),
                    source: source.into(),
                })?;
        // The name is generated above from hex digits only, so it is safe as an
        // identifier; CREATE DATABASE takes no parameters.
        admin
            .execute(sqlx::AssertSqlSafe(format!("CREATE DATABASE \"{name}\"")))
            .await?;
        let _ = admin.close().await;
        Ok(Self {
            url: with_database(admin_url, &name),
            admin_url: admin_url.to_owned(),
            name,
        })
    }

    /// The URL of the new database.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The new database's name.
    pub fn name(&self) -> &str {
        &self.name
    }
}

impl Drop for TestPostgres {
    fn drop(&mut self) {
        let admin_url = self.admin_url.clone();
        let statement = format!("DROP DATABASE IF EXISTS \"{}\" WITH (FORCE)", self.name);
        // Drop may run inside a runtime, which cannot block on a future: a short-lived
        // thread with a runtime of its own does the cleanup.
        let cleanup = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .ok()?;
            runtime.block_on(async {
                let mut admin = PgConnection::connect(&admin_url).await.ok()?;
                admin.execute(sqlx::AssertSqlSafe(statement)).await.ok()?;
                admin.close().await.ok()
            })
        });
        if !matches!(cleanup.join(), Ok(Some(()))) {
            eprintln!(
                "note: test database {} could not be dropped; drop it by hand",
                self.name
            );
        }
    }
}

/// `url` with its database (the path) replaced by `name`, keeping any query string.
pub fn with_database(url: &str, name: &str) -> String {
    let (base, query) = match url.split_once('?') {
        Some((b, q)) => (b, Some(q)),
        None => (url, None),
    };
    let (scheme, rest) = base.split_once("://").unwrap_or(("postgres", base));
    let authority = rest.split('/').next().unwrap_or_default();
    match query {
        Some(q) => format!("{scheme}://{authority}/{name}?{q}"),
        None => format!("{scheme}://{authority}/{name}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const NATS: Service = Service {
        name: "NATS",
        variable: "CONVENE_TEST_NATS_URL",
    };

    #[test]
    fn a_missing_service_is_skipped_with_a_line_naming_test_service_and_variable() {
        let line = missing(false, "it::relay", NATS, "does not answer at nats://h:4222");
        assert_eq!(
            line,
            "skipped: it::relay needs NATS, which does not answer at nats://h:4222; \
             set CONVENE_TEST_NATS_URL to run it"
        );
    }

    #[test]
    #[should_panic(expected = "it::pool needs PostgreSQL, which is not configured; \
                    CONVENE_TEST_REQUIRE_SERVICES is set, so it may not be skipped: \
                    set CONVENE_TEST_POSTGRES_URL to a server that answers")]
    fn a_missing_service_fails_the_test_when_services_are_required() {
        missing(true, "it::pool", POSTGRES, "is not configured");
    }

    #[test]
    fn only_one_or_true_requires_services() {
        assert!(required(Some("1")));
        assert!(required(Some(" true ")));
        for value in [None, Some(""), Some("0"), Some("false"), Some("yes")] {
            assert!(!required(value), "{value:?}");
        }
    }

    #[test]
    fn the_current_test_is_named_after_its_thread() {
        assert_eq!(
            current_test(),
            "test_util::tests::the_current_test_is_named_after_its_thread"
        );
        let elsewhere = std::thread::Builder::new()
            .spawn(current_test)
            .expect("a thread")
            .join()
            .expect("no panic");
        assert_eq!(elsewhere, "a test on an unnamed thread");
    }

    #[test]
    fn database_names_are_replaced_in_urls() {
        assert_eq!(
            with_database("postgres://postgres@127.0.0.1:5432/postgres", "t1"),
            "postgres://postgres@127.0.0.1:5432/t1"
        );
        assert_eq!(
            with_database("postgresql://u:p@h/db?sslmode=disable", "t2"),
            "postgresql://u:p@h/t2?sslmode=disable"
        );
        assert_eq!(with_database("postgres://h", "t3"), "postgres://h/t3");
    }
}
