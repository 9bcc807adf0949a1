//! The schema's migrations, compiled into the binary.
//!
//! Each back end has one file per service area under `migrations/<backend>/`, named
//! `<version>_<description>.sql`. They are listed here with `include_str!` and handed to
//! sqlx's migrator as a [`MigrationSource`], so a deployed binary needs no migration
//! files beside it. The versions, descriptions and checksums are the ones sqlx derives
//! from the same files on disk (a test checks it), so databases migrated by earlier
//! builds are recognised as up to date.
//!
//! This replaces sqlx's `migrate!` macro, which would make every build compile sqlx's
//! proc-macro crate and, with it, a second copy of both database drivers for the host.

use std::borrow::Cow;

use futures::future::BoxFuture;
use sqlx::SqlSafeStr;
use sqlx::error::BoxDynError;
use sqlx::migrate::{MigrateError, Migration, MigrationSource, MigrationType, Migrator};

/// Embeds the named files of `migrations/<dir>/` as `(file name, SQL)` pairs.
macro_rules! files {
    ($dir:literal: $($name:literal),+ $(,)?) => {
        &[$(($name, include_str!(concat!("../migrations/", $dir, "/", $name)))),+]
    };
}

/// The SQLite schema, in order.
const SQLITE: &[(&str, &str)] = files!("sqlite":
    "0001_supervisor.sql", "0002_policy.sql", "0003_approval.sql", "0004_evidence.sql",
    "0005_approval_events.sql", "0006_run_commands.sql", "0007_gateway.sql",
    "0008_run_labels.sql", "0009_console_sessions.sql", "0010_revocations_by_time.sql",
    "0011_lease_epochs.sql");

/// The PostgreSQL schema, in order.
const POSTGRES: &[(&str, &str)] = files!("postgres":
    "0001_supervisor.sql", "0002_policy.sql", "0003_approval.sql", "0004_evidence.sql",
    "0005_approval_events.sql", "0006_run_commands.sql", "0007_gateway.sql",
    "0008_run_labels.sql", "0009_console_sessions.sql", "0010_revocations_by_time.sql",
    "0011_lease_epochs.sql");

/// A back end's embedded migration files.
#[derive(Debug, Clone, Copy)]
struct Embedded(&'static [(&'static str, &'static str)]);

/// A migration from its file name, `<version>_<description>.sql`, read as sqlx reads
/// one on disk: the version is the number before the first `_`, the description the
/// rest without `.sql`, each `_` a space.
fn migration(name: &str, sql: &'static str) -> Result<Migration, String> {
    let (version, rest) = name.split_once('_').ok_or_else(|| {
        format!("migration file {name:?} is not named <version>_<description>.sql")
    })?;
    let version: i64 = version
        .parse()
        .map_err(|_| format!("migration file {name:?} does not start with a version number"))?;
    let description = rest
        .strip_suffix(".sql")
        .ok_or_else(|| format!("migration file {name:?} does not end in .sql"))?
        .replace('_', " ");
    Ok(Migration::new(
        version,
        Cow::Owned(description),
        MigrationType::Simple,
        sql.into_sql_str(),
        sql.starts_with("-- no-transaction"),
    ))
}

impl MigrationSource<'static> for Embedded {
    fn resolve(self) -> BoxFuture<'static, Result<Vec<Migration>, BoxDynError>> {
        Box::pin(async move {
            let migrations = self.0.iter().map(|&(name, sql)| migration(name, sql));
            Ok(migrations.collect::<Result<_, _>>()?)
        })
    }
}

/// The migrator for the SQLite schema.
pub(crate) async fn sqlite() -> Result<Migrator, MigrateError> {
    Migrator::new(Embedded(SQLITE)).await
}

/// The migrator for the PostgreSQL schema.
pub(crate) async fn postgres() -> Result<Migrator, MigrateError> {
    Migrator::new(Embedded(POSTGRES)).await
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::*;

    /// What sqlx reads from a migrations directory on disk, as comparable tuples.
    async fn on_disk(backend: &str) -> Vec<(i64, String, Vec<u8>, bool)> {
        let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("migrations")
            .join(backend);
        let migrator = Migrator::new(dir)
            .await
            .expect("the migrations directory reads");
        migrator.iter().map(summary).collect()
    }

    fn summary(m: &Migration) -> (i64, String, Vec<u8>, bool) {
        (
            m.version,
            m.description.to_string(),
            m.checksum.to_vec(),
            m.no_tx,
        )
    }

    #[tokio::test]
    async fn every_file_is_embedded_with_the_checksum_sqlx_gives_it() {
        for (backend, embedded) in [("sqlite", sqlite().await), ("postgres", postgres().await)] {
            let embedded: Vec<_> = embedded
                .expect("embedded migrations")
                .iter()
                .map(summary)
                .collect();
            let disk = on_disk(backend).await;
            assert!(!disk.is_empty(), "{backend}: no migration files found");
            assert_eq!(
                embedded, disk,
                "{backend}: the embedded list differs from migrations/{backend}/ \
                 (a file added, renamed or missing in migrations.rs?)"
            );
        }
    }
}
