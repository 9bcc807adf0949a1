//! Listing runs by label and creation time, on every store: the filter applies before
//! a page is cut, so every page but the last is full of matching runs and the cursor
//! continues after them; and, on SQL, the labels of runs stored before `run_labels`
//! existed are copied in when the store opens.

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime};

use convene_core::time::to_timestamp;
use convene_proto::v1;
use convene_store::sql;
use convene_store::test_util::test_databases;
use convene_supervisor::SqlRunStore;
use convene_supervisor::store::{RunFilter, RunStore};

use super::{create, new_run, subjects};

/// A run of `tenant` whose spec carries `labels`.
fn labelled(tenant: &str, labels: &[(&str, &str)]) -> v1::Run {
    v1::Run {
        spec: Some(v1::RunSpec {
            goal: "find the cause".into(),
            labels: labels
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
            ..Default::default()
        }),
        ..new_run(tenant)
    }
}

fn with_labels(labels: &[(&str, &str)]) -> RunFilter {
    RunFilter {
        labels: labels
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect::<BTreeMap<_, _>>(),
        ..RunFilter::default()
    }
}

/// Every page of `tenant`'s runs that meet `filter`, `size` a page, as run ids. Each
/// page but the last must be full and say that more follow; the last must not.
async fn pages(
    store: &dyn RunStore,
    label: &str,
    tenant: &str,
    filter: &RunFilter,
    size: usize,
) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    let mut after: Option<String> = None;
    loop {
        let page = store
            .list(tenant, filter, size, after.as_deref())
            .await
            .unwrap();
        let ids: Vec<String> = page.runs.iter().map(|r| r.run_id.clone()).collect();
        assert!(
            page.runs.iter().all(|r| filter.matches(r)),
            "{label}: {filter:?} listed a run it does not match: {:#?}",
            page.runs
        );
        match page.next {
            Some(next) => {
                assert_eq!(ids.len(), size, "{label}: a page before the last is full");
                assert_eq!(
                    Some(&next),
                    ids.last(),
                    "{label}: the cursor is the last run"
                );
                after = Some(next);
                out.push(ids);
            }
            None => {
                out.push(ids);
                return out;
            }
        }
        assert!(out.len() < 20, "{label}: the pages never end");
    }
}

fn ids(runs: &[&v1::Run]) -> Vec<String> {
    runs.iter().map(|r| r.run_id.clone()).collect()
}

#[tokio::test]
async fn runs_are_listed_by_label_in_full_pages() {
    let prod = [("service", "payment-api"), ("env", "prod")];
    for s in subjects().await {
        let store = &*s.store;
        let l = s.label;
        // Oldest first; the newest two match none of the payment-api filters, so a page
        // cut before filtering would come back short or empty.
        let mut r = vec![
            labelled("acme", &prod),
            labelled("acme", &prod),
            labelled("acme", &[("service", "ledger"), ("env", "prod")]),
            labelled("acme", &[("service", "payment-api"), ("env", "staging")]),
            labelled("acme", &prod),
            labelled("acme", &[("note", "")]),
            labelled(
                "acme",
                &[("service", "payment-api"), ("env", "prod"), ("team", "sre")],
            ),
            labelled("acme", &[("service", "ledger")]),
            labelled("acme", &[("service", "ledger")]),
        ];
        r[1].state = v1::RunState::Succeeded as i32;
        for run in &r {
            create(store, run).await;
        }
        let other = labelled("globex", &prod);
        create(store, &other).await;

        let f = with_labels(&prod);
        assert_eq!(
            pages(store, l, "acme", &f, 2).await,
            [ids(&[&r[6], &r[4]]), ids(&[&r[1], &r[0]])],
            "{l}: every label must match"
        );
        assert_eq!(
            pages(
                store,
                l,
                "acme",
                &with_labels(&[("service", "payment-api")]),
                2
            )
            .await,
            [ids(&[&r[6], &r[4]]), ids(&[&r[3], &r[1]]), ids(&[&r[0]])],
            "{l}"
        );
        let running = RunFilter {
            states: vec![v1::RunState::Running as i32],
            ..f.clone()
        };
        assert_eq!(
            pages(store, l, "acme", &running, 2).await,
            [ids(&[&r[6], &r[4]]), ids(&[&r[0]])],
            "{l}: labels and states together"
        );
        assert_eq!(
            pages(store, l, "acme", &with_labels(&[("team", "sre")]), 5).await,
            [ids(&[&r[6]])],
            "{l}"
        );
        // An empty value matches a label whose value is empty, not a missing label.
        assert_eq!(
            pages(store, l, "acme", &with_labels(&[("note", "")]), 5).await,
            [ids(&[&r[5]])],
            "{l}"
        );
        for nothing in [
            with_labels(&[("service", "Payment-API")]),
            with_labels(&[("env", "")]),
            with_labels(&[("service", "payment-api"), ("env", "prod"), ("x", "y")]),
        ] {
            assert_eq!(
                pages(store, l, "acme", &nothing, 5).await,
                [Vec::<String>::new()],
                "{l}: values match exactly: {nothing:?}"
            );
        }
        // The other tenant's run with the same labels stays its own.
        assert_eq!(
            pages(store, l, "globex", &f, 5).await,
            [ids(&[&other])],
            "{l}"
        );
        assert_eq!(
            pages(store, l, "initech", &f, 5).await,
            [Vec::<String>::new()],
            "{l}"
        );
    }
}

#[tokio::test]
async fn runs_are_listed_by_creation_time_in_full_pages() {
    // Microseconds matter: the SQL store keeps times at that precision.
    let base = SystemTime::UNIX_EPOCH + Duration::new(1_800_000_000, 123_456_000);
    let at = |minutes: u64| base + Duration::from_secs(60 * minutes);
    for s in subjects().await {
        let store = &*s.store;
        let l = s.label;
        let mut r = Vec::new();
        for i in 0..7 {
            let mut run = labelled("acme", &[("env", if i % 2 == 0 { "prod" } else { "dev" })]);
            run.created_at = Some(to_timestamp(at(i)));
            create(store, &run).await;
            r.push(run);
        }
        let mut other = new_run("globex");
        other.created_at = Some(to_timestamp(at(2)));
        create(store, &other).await;

        // From minute 1 (inclusive) to minute 5 (exclusive).
        let window = RunFilter {
            created_after: Some(at(1)),
            created_before: Some(at(5)),
            ..RunFilter::default()
        };
        assert_eq!(
            pages(store, l, "acme", &window, 3).await,
            [ids(&[&r[4], &r[3], &r[2]]), ids(&[&r[1]])],
            "{l}: created_after is inclusive, created_before exclusive"
        );
        let since = RunFilter {
            created_after: Some(at(4) + Duration::from_micros(1)),
            ..RunFilter::default()
        };
        assert_eq!(
            pages(store, l, "acme", &since, 3).await,
            [ids(&[&r[6], &r[5]])],
            "{l}: one microsecond after a run leaves it out"
        );
        let until = RunFilter {
            created_before: Some(at(2) + Duration::from_micros(1)),
            ..RunFilter::default()
        };
        assert_eq!(
            pages(store, l, "acme", &until, 2).await,
            [ids(&[&r[2], &r[1]]), ids(&[&r[0]])],
            "{l}: one microsecond before the bound is inside it"
        );
        let prod_in_window = RunFilter {
            states: vec![v1::RunState::Running as i32],
            ..with_labels(&[("env", "prod")])
        };
        let prod_in_window = RunFilter {
            created_after: Some(at(0)),
            created_before: Some(at(6)),
            ..prod_in_window
        };
        assert_eq!(
            pages(store, l, "acme", &prod_in_window, 2).await,
            [ids(&[&r[4], &r[2]]), ids(&[&r[0]])],
            "{l}: labels, states and times together"
        );
        assert_eq!(
            pages(store, l, "globex", &window, 5).await,
            [ids(&[&other])],
            "{l}"
        );
    }
}

/// Runs stored before `run_labels` existed have their labels only in the encoded run;
/// opening the store copies them in, once, and takes them off the migration's list.
#[tokio::test]
async fn opening_the_store_copies_the_labels_of_runs_stored_before_the_table() {
    for t in test_databases().await {
        let l = t.label;
        let store = SqlRunStore::open(t.db.clone()).await.unwrap();
        let old = labelled("acme", &[("service", "payment-api"), ("env", "prod")]);
        let copied_already = labelled("acme", &[("service", "payment-api"), ("env", "prod")]);
        let unlabelled = new_run("acme");
        for run in [&old, &copied_already, &unlabelled] {
            create(&store, run).await;
        }
        // As the migration leaves a run stored before it: no label rows, on the list.
        t.db.execute(sql("DELETE FROM run_labels WHERE run_id = $1").bind(&old.run_id))
            .await
            .unwrap();
        for run in [&old, &copied_already, &unlabelled] {
            t.db.execute(
                sql("INSERT INTO run_labels_backfill (run_id) VALUES ($1)").bind(&run.run_id),
            )
            .await
            .unwrap();
        }
        let f = with_labels(&[("service", "payment-api")]);
        assert_eq!(
            pages(&store, l, "acme", &f, 5).await,
            [ids(&[&copied_already])],
            "{l}: before the copy, the old run matches no label filter"
        );

        let reopened = SqlRunStore::open(t.db.clone()).await.unwrap();
        assert_eq!(
            pages(&reopened, l, "acme", &f, 1).await,
            [ids(&[&copied_already]), ids(&[&old])],
            "{l}"
        );
        let left =
            t.db.fetch_all(sql("SELECT run_id FROM run_labels_backfill"))
                .await
                .unwrap();
        assert!(left.is_empty(), "{l}: every listed run was copied");
        let rows =
            t.db.fetch_all(sql("SELECT key FROM run_labels WHERE run_id = $1").bind(&old.run_id))
                .await
                .unwrap();
        assert_eq!(rows.len(), 2, "{l}: each label once");
        // Nothing left to copy: opening again changes nothing.
        let again = SqlRunStore::open(t.db.clone()).await.unwrap();
        assert_eq!(
            pages(&again, l, "acme", &f, 5).await,
            [ids(&[&copied_already, &old])],
            "{l}"
        );
    }
}
