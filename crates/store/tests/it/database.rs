//! The database handle on every back end the environment offers: a SQLite file always,
//! PostgreSQL when `CONVENE_TEST_POSTGRES_URL` names a server.

use std::path::Path;
use std::time::Duration;

use convene_store::test_util::test_databases;
use convene_store::{Backend, Database, Error, Location, sql};

#[tokio::test]
async fn values_round_trip_and_nulls_stay_null() {
    for t in test_databases().await {
        let db = &t.db;
        let n = db
            .execute(
                sql(
                    "INSERT INTO runs (run_id, tenant, principal, state, terminal, version, \
                     created_at, updated_at, owner, lease_until, trace_id, body) \
                     VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12)",
                )
                .bind("run-1")
                .bind("acme")
                .bind("oncall@acme")
                .bind(2_i32)
                .bind(true)
                .bind(7_u64)
                .bind(-5_i64)
                .bind(i64::MAX)
                .bind(None::<String>)
                .bind(None::<i64>)
                .bind(String::from("trace"))
                .bind(vec![0_u8, 255, 7]),
            )
            .await
            .unwrap();
        assert_eq!(n, 1, "{}", t.label);
        let row = db
            .fetch_optional(sql("SELECT * FROM runs WHERE run_id = $1").bind("run-1"))
            .await
            .unwrap()
            .expect("the row is there");
        assert_eq!(row.get::<String>("tenant").unwrap(), "acme", "{}", t.label);
        assert_eq!(row.get::<i64>("state").unwrap(), 2, "{}", t.label);
        assert!(row.get::<bool>("terminal").unwrap(), "{}", t.label);
        assert_eq!(row.get_u64("version").unwrap(), 7, "{}", t.label);
        assert_eq!(row.get::<i64>("created_at").unwrap(), -5, "{}", t.label);
        assert_eq!(
            row.get::<i64>("updated_at").unwrap(),
            i64::MAX,
            "{}",
            t.label
        );
        assert_eq!(
            row.get::<Option<String>>("owner").unwrap(),
            None,
            "{}",
            t.label
        );
        assert_eq!(
            row.get::<Option<i64>>("lease_until").unwrap(),
            None,
            "{}",
            t.label
        );
        assert_eq!(
            row.get::<Vec<u8>>("body").unwrap(),
            [0, 255, 7],
            "{}",
            t.label
        );
        // A negative value is not an unsigned one.
        let err = row.get_u64("created_at").unwrap_err();
        assert!(err.to_string().contains("created_at"), "{}: {err}", t.label);
        // A missing column is named.
        assert!(row.get::<i64>("nope").is_err(), "{}", t.label);
    }
}

#[tokio::test]
async fn a_dropped_transaction_leaves_nothing_and_a_committed_one_everything() {
    for t in test_databases().await {
        let db = &t.db;
        let insert = |id: &'static str| {
            sql(
                "INSERT INTO revocations (kind, target_id, reason, revoked_at) \
                 VALUES ('token', $1, 'r', 0)",
            )
            .bind(id)
        };
        {
            let mut tx = db.begin().await.unwrap();
            tx.execute(insert("dropped")).await.unwrap();
            // Dropped without commit.
        }
        let mut tx = db.begin().await.unwrap();
        assert_eq!(tx.backend(), db.backend());
        tx.execute(insert("kept")).await.unwrap();
        tx.commit().await.unwrap();
        let mut tx = db.begin().await.unwrap();
        tx.execute(insert("rolled-back")).await.unwrap();
        tx.rollback().await.unwrap();

        let ids = revoked_ids(db).await;
        assert_eq!(ids, ["kept"], "{}", t.label);

        let err = db.execute(insert("kept")).await.unwrap_err();
        assert!(err.is_unique_violation(), "{}: {err}", t.label);
        assert!(!err.is_transient(), "{}: {err}", t.label);
    }
}

#[tokio::test]
async fn sqlite_runs_in_wal_mode_with_full_sync_and_foreign_keys() {
    let t = convene_store::test_util::sqlite().await;
    let pragma = |name: &'static str| {
        let db = t.db.clone();
        async move {
            let row = db.fetch_optional(sql(name)).await.unwrap().unwrap();
            match &row {
                convene_store::Row::Sqlite(_) => {}
                other => panic!("not SQLite: {other:?}"),
            }
            row
        }
    };
    let mode: String = pragma("PRAGMA journal_mode")
        .await
        .get("journal_mode")
        .unwrap();
    assert_eq!(mode, "wal");
    let sync: i64 = pragma("PRAGMA synchronous")
        .await
        .get("synchronous")
        .unwrap();
    assert_eq!(sync, 2, "FULL");
    let fk: i64 = pragma("PRAGMA foreign_keys")
        .await
        .get("foreign_keys")
        .unwrap();
    assert_eq!(fk, 1);
    // Foreign keys hold: an event of a run that does not exist is refused.
    let err =
        t.db.execute(
            sql("INSERT INTO run_events (run_id, sequence, body) VALUES ($1, 1, $2)")
                .bind("no-such-run")
                .bind(vec![1_u8]),
        )
        .await
        .unwrap_err();
    assert!(err.to_string().contains("FOREIGN KEY"), "{err}");
}

#[tokio::test]
async fn reopening_a_database_finds_its_data_and_migrates_nothing_twice() {
    let dir = tempfile::tempdir().unwrap();
    // A plain path works like a URL, and missing directories are created.
    let path = dir.path().join("nested/dir/state.db");
    let url = path.display().to_string();
    let db = Database::connect(&url).await.unwrap();
    assert_eq!(db.backend(), Backend::Sqlite);
    db.execute(sql(
        "INSERT INTO issued_tokens (token_id, run_id, tenant, expires_at) \
             VALUES ('t', 'r', 'acme', 1)",
    ))
    .await
    .unwrap();
    db.close().await;
    let again = Database::connect(&format!("sqlite://{}", path.display()))
        .await
        .unwrap();
    let row = again
        .fetch_optional(sql("SELECT tenant FROM issued_tokens WHERE token_id = 't'"))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(row.get::<String>("tenant").unwrap(), "acme");
    let applied = again
        .fetch_all(sql("SELECT version FROM _sqlx_migrations ORDER BY version"))
        .await
        .unwrap();
    let versions: Vec<i64> = applied.iter().map(|r| r.get("version").unwrap()).collect();
    assert_eq!(versions, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]);
}

#[tokio::test]
async fn two_handles_on_one_file_write_concurrently_like_two_processes() {
    // Two handles do not share their writer lock, as two processes would not: SQLite's
    // own lock and the busy handler have to order them.
    let dir = tempfile::tempdir().unwrap();
    let url = convene_store::sqlite_url(&dir.path().join("shared.db"));
    let (a, b) = tokio::join!(Database::connect(&url), Database::connect(&url));
    let (a, b) = (a.unwrap(), b.unwrap());
    let writes = (0..40).map(|i| {
        let db = if i % 2 == 0 { a.clone() } else { b.clone() };
        tokio::spawn(async move {
            db.execute(
                sql(
                    "INSERT INTO revocations (kind, target_id, reason, revoked_at) \
                     VALUES ('run', $1, 'r', 0)",
                )
                .bind(format!("run-{i}")),
            )
            .await
        })
    });
    for w in join_all(writes).await {
        assert_eq!(w.unwrap(), 1);
    }
    let row = a
        .fetch_optional(sql("SELECT COUNT(*) AS n FROM revocations"))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(row.get::<i64>("n").unwrap(), 40);
}

async fn join_all<T>(
    tasks: impl Iterator<Item = tokio::task::JoinHandle<Result<T, Error>>>,
) -> Vec<Result<T, Error>> {
    let mut out = Vec::new();
    for task in tasks.collect::<Vec<_>>() {
        out.push(task.await.expect("the task finished"));
    }
    out
}

#[tokio::test]
async fn urls_that_name_no_database_are_refused_with_what_to_use() {
    for url in ["mysql://root@localhost/db", "", "sqlite://"] {
        let err = Database::connect(url).await.unwrap_err();
        assert!(matches!(err, Error::BadUrl { .. }), "{url:?}: {err}");
        assert!(err.to_string().contains("postgres://"), "{url:?}: {err}");
    }
    let err = Database::connect("postgres://u:secret@127.0.0.1:1/none")
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Unreachable { .. }), "{err}");
    assert!(err.is_transient());
    let text = err.to_string();
    assert!(text.contains("u:****@127.0.0.1:1"), "{text}");
    assert!(!text.contains("secret"), "{text}");
    assert!(text.contains("check that it is running"), "{text}");
}

#[tokio::test]
async fn a_sqlite_file_in_an_unwritable_place_names_the_directory() {
    let dir = tempfile::tempdir().unwrap();
    let blocker = dir.path().join("file");
    std::fs::write(&blocker, b"not a directory").unwrap();
    let err = Database::connect(&blocker.join("sub/convene.db").display().to_string())
        .await
        .unwrap_err();
    assert!(matches!(err, Error::CreateDir { .. }), "{err}");
    assert!(err.to_string().contains("sub"), "{err}");
}

#[test]
fn locations_resolve_from_the_setting() {
    let data = Path::new("/var/lib/convene");
    assert_eq!(
        Location::resolve(None, data),
        Location::Url("sqlite:///var/lib/convene/convene.db?mode=rwc".into())
    );
    assert_eq!(Location::resolve(Some("memory"), data), Location::Memory);
    assert_eq!(Location::resolve(Some(" MEMORY "), data), Location::Memory);
    assert_eq!(
        Location::resolve(Some("postgres://db/convene"), data),
        Location::Url("postgres://db/convene".into())
    );
    assert_eq!(
        convene_store::redact("postgres://convene:hunter2@db:5432/c"),
        "postgres://convene:****@db:5432/c"
    );
    assert_eq!(
        convene_store::redact("postgres://convene@db/c"),
        "postgres://convene@db/c"
    );
    assert_eq!(convene_store::placeholders(3, 3), "$3, $4, $5");
    static ROWS: convene_store::InsertRows =
        convene_store::InsertRows::new("INSERT INTO t (a, b)", 2, "ON CONFLICT DO NOTHING", 3);
    assert_eq!(
        ROWS.statement(3).text(),
        "INSERT INTO t (a, b) VALUES ($1, $2), ($3, $4), ($5, $6) ON CONFLICT DO NOTHING"
    );
    assert_eq!(
        ROWS.statement(1).text(),
        "INSERT INTO t (a, b) VALUES ($1, $2) ON CONFLICT DO NOTHING"
    );
    assert!(std::panic::catch_unwind(|| ROWS.statement(4)).is_err());
    // Seven items: three statements of 3, 3 and 1 rows, the values in order.
    let all = ROWS.all(1..=7_i64, |s, n| s.bind(n).bind(-n));
    assert_eq!(
        all.iter().map(|s| s.arg_count()).collect::<Vec<_>>(),
        [6, 6, 2]
    );
    assert_eq!(all[2].text(), ROWS.statement(1).text());
    assert!(ROWS.all(Vec::<i64>::new(), |s, n| s.bind(n)).is_empty());
    assert!(std::panic::catch_unwind(|| ROWS.statement(0)).is_err());
}

#[tokio::test]
async fn memory_opens_no_database() {
    let dir = tempfile::tempdir().unwrap();
    assert!(
        convene_store::open(Some("memory"), dir.path())
            .await
            .unwrap()
            .is_none()
    );
    let db = convene_store::open(None, dir.path())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(db.backend(), Backend::Sqlite);
    assert!(dir.path().join("convene.db").exists());
}

/// The target ids in `revocations`, sorted: what the writers of a test left.
async fn revoked_ids(db: &Database) -> Vec<String> {
    let rows = db
        .fetch_all(sql("SELECT target_id FROM revocations ORDER BY target_id"))
        .await
        .unwrap();
    rows.iter().map(|r| r.get("target_id").unwrap()).collect()
}

/// The rows the writers in `tasks` (each ending with its index and whether it
/// committed) leave, with the `taken` row written before them, sorted.
async fn committed_pairs(mut tasks: tokio::task::JoinSet<(usize, bool)>) -> Vec<String> {
    let mut expected = vec!["taken".to_owned()];
    while let Some(done) = tasks.join_next().await {
        let (i, committed) = done.unwrap();
        if committed {
            expected.push(format!("w{i:03}-a"));
            expected.push(format!("w{i:03}-b"));
        }
    }
    expected.sort();
    expected
}

/// Writers that queue up behind each other share physical commits; each one still
/// commits or rolls back on its own, and a failing one takes nobody else down.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queued_writers_share_commits_and_keep_their_own_outcome() {
    const WRITERS: usize = 120;
    for t in test_databases().await {
        let db = t.db.clone();
        let (logical_before, physical_before) = db.commits();
        let insert = |id: String| {
            sql(
                "INSERT INTO revocations (kind, target_id, reason, revoked_at) \
                 VALUES ('token', $1, 'r', 0)",
            )
            .bind(id)
        };
        // Taken before the load: every fourth writer collides with it.
        db.execute(insert("taken".to_owned())).await.unwrap();
        let mut tasks = tokio::task::JoinSet::new();
        for i in 0..WRITERS {
            let db = db.clone();
            tasks.spawn(async move {
                let mut tx = db.begin().await.unwrap();
                tx.execute(insert(format!("w{i:03}-a"))).await.unwrap();
                match i % 4 {
                    // A statement fails: the writer gives up its own changes only.
                    0 => {
                        let err = tx.execute(insert("taken".to_owned())).await.unwrap_err();
                        assert!(err.is_unique_violation(), "{err}");
                        tx.rollback().await.unwrap();
                        (i, false)
                    }
                    // Rolled back on purpose.
                    1 => {
                        tx.execute(insert(format!("w{i:03}-b"))).await.unwrap();
                        tx.rollback().await.unwrap();
                        (i, false)
                    }
                    // Dropped without commit.
                    2 if i % 8 == 2 => {
                        drop(tx);
                        (i, false)
                    }
                    _ => {
                        tx.execute(insert(format!("w{i:03}-b"))).await.unwrap();
                        tx.commit().await.unwrap();
                        (i, true)
                    }
                }
            });
        }
        let mut expected = committed_pairs(tasks).await;
        // A dropped transaction's rollback runs in the background; the next writer waits
        // for it.
        db.execute(insert("after".to_owned())).await.unwrap();
        expected.push("after".to_owned());
        expected.sort();
        let ids = revoked_ids(&db).await;
        assert_eq!(ids, expected, "{}", t.label);

        let committed = expected.len() as u64 / 2 + 1; // pairs, plus `after` and `taken`
        let (logical, physical) = db.commits();
        assert_eq!(logical - logical_before, committed, "{}", t.label);
        assert!(
            physical - physical_before < committed,
            "{}: {} logical commits took {} physical ones: no batching",
            t.label,
            committed,
            physical - physical_before
        );
    }
}

/// Writes given to `Database::write` from many tasks at once run one after another in
/// shared transactions: each caller gets its own job's value once it is committed, a job
/// that fails (with an error, or by panicking) undoes only itself, and a job whose
/// caller stopped waiting is still committed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn combined_writes_keep_their_own_outcome_and_share_commits() {
    const WRITERS: usize = 120;
    let insert = |id: String| {
        sql(
            "INSERT INTO revocations (kind, target_id, reason, revoked_at) \
             VALUES ('token', $1, 'r', 0)",
        )
        .bind(id)
    };
    for t in test_databases().await {
        let db = t.db.clone();
        db.execute(insert("taken".to_owned())).await.unwrap();
        let (_, physical_before) = db.commits();
        let mut tasks = tokio::task::JoinSet::new();
        for i in 0..WRITERS {
            let db = db.clone();
            tasks.spawn(async move {
                let a = insert(format!("w{i:03}-a"));
                let b = insert(format!("w{i:03}-b"));
                match i % 4 {
                    // A statement fails: the job's error, and only its changes undone.
                    0 => {
                        let taken = insert("taken".to_owned());
                        let err = db
                            .write(move |tx| {
                                Box::pin(async move {
                                    tx.execute(a).await?;
                                    tx.execute(taken).await?;
                                    Ok::<_, Error>(())
                                })
                            })
                            .await
                            .unwrap_err();
                        assert!(err.is_unique_violation(), "{err}");
                        (i, false)
                    }
                    // A job that panics fails alone.
                    1 => {
                        let err = db
                            .write(move |tx| {
                                Box::pin(async move {
                                    tx.execute(a).await?;
                                    if i < WRITERS {
                                        panic!("job {i} panics on purpose");
                                    }
                                    Ok::<_, Error>(())
                                })
                            })
                            .await
                            .unwrap_err();
                        assert!(err.to_string().contains("panicked"), "{err}");
                        (i, false)
                    }
                    // The caller stops waiting once the job is queued: it still commits.
                    // The job holds on until the caller has gone, so the write cannot
                    // end first, however the threads are scheduled.
                    2 => {
                        let (gone, caller_gone) = tokio::sync::oneshot::channel::<()>();
                        let waited = tokio::time::timeout(
                            Duration::ZERO,
                            db.write(move |tx| {
                                Box::pin(async move {
                                    let _ = caller_gone.await;
                                    tx.execute(a).await?;
                                    tx.execute(b).await?;
                                    Ok::<_, Error>(())
                                })
                            }),
                        )
                        .await;
                        assert!(waited.is_err(), "the write finished at once");
                        let _ = gone.send(());
                        (i, true)
                    }
                    _ => {
                        let value = db
                            .write(move |tx| {
                                Box::pin(async move {
                                    tx.execute(a).await?;
                                    tx.execute(b).await?;
                                    Ok::<_, Error>(i)
                                })
                            })
                            .await
                            .unwrap();
                        assert_eq!(value, i);
                        (i, true)
                    }
                }
            });
        }
        let mut expected = committed_pairs(tasks).await;
        let writes = WRITERS as u64 + 1;
        // Jobs run in the order they were given: this one runs after every job above,
        // including those whose callers went away.
        db.execute(insert("after".to_owned())).await.unwrap();
        expected.push("after".to_owned());
        expected.sort();
        let ids = revoked_ids(&db).await;
        assert_eq!(ids, expected, "{}", t.label);
        let (_, physical) = db.commits();
        assert!(
            physical - physical_before < writes,
            "{}: {writes} writes took {} physical commits: none shared one",
            t.label,
            physical - physical_before
        );
    }
}

/// The first job of a transaction runs without a savepoint: when it fails after it
/// changed something — a statement error, or a panic — the rollback undoes its changes
/// alone, and the jobs queued behind it commit in a transaction of their own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_first_job_undoes_only_itself_and_the_jobs_behind_it_commit() {
    let insert = |id: &str| {
        sql(
            "INSERT INTO revocations (kind, target_id, reason, revoked_at) \
             VALUES ('token', $1, 'r', 0)",
        )
        .bind(id.to_owned())
    };
    for t in test_databases().await {
        let db = t.db.clone();
        db.execute(insert("taken")).await.unwrap();
        let mut expected = vec!["taken".to_owned()];
        for (round, panics) in [(0, false), (1, true)] {
            let (started, running) = tokio::sync::oneshot::channel::<()>();
            let (go, wait) = tokio::sync::oneshot::channel::<()>();
            let changed = insert(&format!("r{round}-first"));
            let taken = insert("taken");
            let first = tokio::spawn({
                let db = db.clone();
                async move {
                    db.write(move |tx| {
                        Box::pin(async move {
                            let _ = started.send(());
                            let _ = wait.await;
                            tx.execute(changed).await?;
                            if panics {
                                panic!("the first job panics on purpose");
                            }
                            tx.execute(taken).await?;
                            Ok::<_, Error>(())
                        })
                    })
                    .await
                }
            });
            // The first job is running, alone in its transaction; these two queue
            // behind it (a write is queued when it is first polled).
            running.await.unwrap();
            let mut behind = Vec::new();
            for n in 0..2 {
                let id = format!("r{round}-behind-{n}");
                let row = insert(&id);
                let mut write = Box::pin(db.write(move |tx| {
                    Box::pin(async move {
                        tx.execute(row).await?;
                        Ok::<_, Error>(n)
                    })
                }));
                assert!(futures::poll!(&mut write).is_pending(), "{}", t.label);
                behind.push(write);
                expected.push(id);
            }
            go.send(()).unwrap();
            let err = first.await.unwrap().unwrap_err();
            if panics {
                assert!(err.to_string().contains("panicked"), "{}: {err}", t.label);
            } else {
                assert!(err.is_unique_violation(), "{}: {err}", t.label);
            }
            for (n, write) in behind.into_iter().enumerate() {
                assert_eq!(write.await.unwrap(), n, "{}", t.label);
            }
        }
        expected.sort();
        assert_eq!(revoked_ids(&db).await, expected, "{}", t.label);
    }
}

/// A batch handed over to a queued writer that is cancelled before it takes its turn is
/// still committed: the writers in it hear so, and the write lock is free again.
#[tokio::test]
async fn a_batch_whose_next_writer_went_away_is_still_committed() {
    for t in test_databases().await {
        let db = t.db.clone();
        let insert = |id: &'static str| {
            sql(
                "INSERT INTO revocations (kind, target_id, reason, revoked_at) \
                 VALUES ('token', $1, 'r', 0)",
            )
            .bind(id)
        };
        let mut first = db.begin().await.unwrap();
        first.execute(insert("first")).await.unwrap();
        // Queued behind `first`.
        let queued = {
            let db = db.clone();
            tokio::spawn(async move { db.begin().await.map(drop) })
        };
        tokio::task::yield_now().await;
        // `first` commits and hands the batch to the queued writer...
        let committing = tokio::spawn(first.commit());
        tokio::task::yield_now().await;
        tokio::task::yield_now().await;
        // ...which goes away before it takes its turn.
        queued.abort();
        let committed = tokio::time::timeout(Duration::from_secs(10), committing)
            .await
            .expect("the batch is committed though its next writer went away");
        committed.unwrap().unwrap();
        // And the next writer gets its turn.
        tokio::time::timeout(Duration::from_secs(10), db.execute(insert("next")))
            .await
            .expect("the write lock is free again")
            .unwrap();
        let ids = revoked_ids(&db).await;
        assert_eq!(ids, ["first", "next"], "{}", t.label);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_writer_that_stops_waiting_for_another_processs_lock_leaves_it_free() {
    // B waits for the write lock that A (another "process") holds, and its caller gives
    // up. When A commits, B's wait ends with nobody to take the transaction: it must be
    // rolled back, or B's process holds SQLite's write lock for good and every other
    // writer of the file times out.
    let dir = tempfile::tempdir().unwrap();
    let url = convene_store::sqlite_url(&dir.path().join("shared.db"));
    let a = Database::connect(&url).await.unwrap();
    let b = Database::connect(&url).await.unwrap();
    let revoke = |id: &str| {
        sql(
            "INSERT INTO revocations (kind, target_id, reason, revoked_at) \
             VALUES ('run', $1, 'r', 0)",
        )
        .bind(id)
    };
    let mut held = a.begin().await.unwrap();
    held.execute(revoke("by-a")).await.unwrap();
    // (Through `begin`: a combined write, `execute`, would finish after its caller gave
    // up, by design.)
    let gave_up = tokio::time::timeout(Duration::from_millis(300), async {
        let mut tx = b.begin().await?;
        tx.execute(revoke("by-b")).await?;
        tx.commit().await
    })
    .await;
    assert!(gave_up.is_err(), "B cannot write while A holds the lock");
    held.commit().await.unwrap();
    // B's wait ends within its busy handler's back-off (at most 100 ms a try).
    tokio::time::sleep(Duration::from_millis(500)).await;

    // A writes again: it must not wait out the busy timeout (30 s) on B's leftover.
    let again = tokio::time::timeout(Duration::from_secs(10), a.execute(revoke("again")))
        .await
        .expect("the write lock is free again")
        .unwrap();
    assert_eq!(again, 1);
    let ids = revoked_ids(&a).await;
    assert_eq!(ids, ["again", "by-a"], "B's abandoned write left nothing");
}

#[tokio::test]
async fn a_postgres_pool_opens_no_more_connections_than_the_url_allows() {
    // A bad size is refused before anything is dialled.
    let err = Database::connect("postgres://nobody@127.0.0.1:1/none?pool_max_conns=lots")
        .await
        .unwrap_err();
    assert!(
        matches!(err, Error::BadUrl { .. }) && err.to_string().contains("pool_max_conns"),
        "{err}"
    );
    let Some(admin) = convene_store::test_util::postgres_server_or_skip() else {
        return;
    };
    let server = convene_store::test_util::TestPostgres::create(&admin)
        .await
        .unwrap();
    let separator = if server.url().contains('?') { '&' } else { '?' };
    let db = Database::connect(&format!("{}{separator}pool_max_conns=2", server.url()))
        .await
        .unwrap();
    assert_eq!(db.max_connections(), Some(2));
    // Eight readers at once share the two connections.
    let reads = (0..8).map(|_| db.fetch_all(sql("SELECT pg_sleep(0.05) IS NULL AS slept")));
    for rows in futures::future::join_all(reads).await {
        assert_eq!(rows.unwrap().len(), 1);
    }
    use sqlx::Connection as _;
    let mut admin = sqlx::postgres::PgConnection::connect(&admin).await.unwrap();
    let name = server.name();
    let open: i64 = sqlx::query_scalar("SELECT count(*) FROM pg_stat_activity WHERE datname = $1")
        .bind(name)
        .fetch_one(&mut admin)
        .await
        .unwrap();
    assert!(
        (1..=2).contains(&open),
        "{open} connections to {name}, the pool allows 2"
    );
    db.close().await;
}

/// Every PostgreSQL session runs under the session limits, and a session that stops
/// inside a transaction holding a lock (a frozen process) is ended by the server within
/// its idle limit: another session's write that waited for the lock goes through.
#[tokio::test]
async fn a_postgres_session_left_idle_in_a_transaction_is_ended_and_frees_its_locks() {
    for t in test_databases().await {
        let Some(url) = t.postgres_url() else {
            continue;
        };
        for (name, value) in convene_store::POSTGRES_SESSION_LIMITS {
            let row =
                t.db.fetch_optional(convene_store::Statement::built(format!("SHOW {name}")))
                    .await
                    .unwrap()
                    .unwrap();
            assert_eq!(row.get::<String>(name).unwrap(), value, "{name}");
        }
        let insert = sql(
            "INSERT INTO revocations (kind, target_id, reason, revoked_at) \
                          VALUES ('run', 'held', 'r', 0)",
        );
        t.db.execute(insert).await.unwrap();
        let frozen = Database::connect(url).await.unwrap();
        let mut tx = frozen.begin().await.unwrap();
        tx.fetch_all(sql(
            "SELECT target_id FROM revocations WHERE target_id = 'held' FOR UPDATE",
        ))
        .await
        .unwrap();
        // Never heard from again: another session's write of the row waits for it.
        let began = std::time::Instant::now();
        t.db.execute(sql(
            "UPDATE revocations SET reason = 'moved' WHERE target_id = 'held'",
        ))
        .await
        .unwrap();
        let waited = began.elapsed();
        assert!(
            waited < Duration::from_secs(1),
            "waited {waited:?} for a frozen session"
        );
        assert!(
            tx.commit().await.is_err(),
            "the frozen session's transaction was ended"
        );
        frozen.close().await;
    }
}
