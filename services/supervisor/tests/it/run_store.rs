//! The `RunStore` contract, on every store: in memory, a SQLite file, and PostgreSQL
//! when `CONVENE_TEST_POSTGRES_URL` names a server. Plus what only the SQL store does:
//! the delegation ledger, join decision rows, relay cursors and other processes'
//! commits reaching subscribers. Listing by label and time is in `filters`.

mod filters;

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use convene_core::time::to_timestamp;
use convene_proto::v1;
use convene_store::test_util::{TestDatabase, test_databases};
use convene_supervisor::store::{
    CommandDone, CommandKind, Created, Events, IdempotencyKey, RunCommand, RunFilter, RunStore,
    StoreError,
};
use convene_supervisor::{MemoryStore, SqlRunStore};

/// A store under test, with what keeps its database alive.
struct Subject {
    label: &'static str,
    store: Arc<dyn RunStore>,
    _db: Option<TestDatabase>,
}

async fn subjects() -> Vec<Subject> {
    let mut all = vec![Subject {
        label: "memory",
        store: Arc::new(MemoryStore::default()),
        _db: None,
    }];
    for t in test_databases().await {
        all.push(Subject {
            label: t.label,
            store: Arc::new(SqlRunStore::open(t.db.clone()).await.unwrap()),
            _db: Some(t),
        });
    }
    all
}

fn delegation(id: &str, state: v1::DelegationState) -> v1::Delegation {
    v1::Delegation {
        task: Some(v1::DelegationTask {
            delegation_id: id.into(),
            profile_id: "logs-investigator".into(),
            ..Default::default()
        }),
        state: state as i32,
        ..Default::default()
    }
}

fn new_run(tenant: &str) -> v1::Run {
    let now = to_timestamp(SystemTime::now());
    v1::Run {
        run_id: uuid::Uuid::now_v7().to_string(),
        tenant: tenant.into(),
        principal: format!("oncall@{tenant}"),
        state: v1::RunState::Running as i32,
        version: 1,
        trace_id: "0af7651916cd43dd8448eb211c80319c".into(),
        delegations: vec![
            delegation("d1", v1::DelegationState::Pending),
            delegation("d2", v1::DelegationState::Pending),
        ],
        created_at: Some(now),
        updated_at: Some(now),
        ..Default::default()
    }
}

fn cloud(run: &v1::Run, kind: &str) -> v1::CloudEvent {
    v1::CloudEvent {
        id: uuid::Uuid::now_v7().to_string(),
        r#type: kind.into(),
        correlation_id: run.run_id.clone(),
        tenant_id: run.tenant.clone(),
        time: Some(to_timestamp(SystemTime::now())),
        ..Default::default()
    }
}

fn run_event(run: &v1::Run, sequence: u64) -> v1::RunEvent {
    v1::RunEvent {
        sequence,
        run_id: run.run_id.clone(),
        time: Some(to_timestamp(SystemTime::now())),
        kind: None,
    }
}

/// The events of a change: one run event at `sequence`, one CloudEvent.
fn events(run: &v1::Run, sequence: u64, kind: &str) -> Events {
    Events {
        run: vec![run_event(run, sequence)],
        cloud: vec![cloud(run, kind)],
        commands: Vec::new(),
        release: false,
    }
}

/// `run` one version on, in `state`.
fn next(run: &v1::Run, state: v1::RunState) -> v1::Run {
    v1::Run {
        version: run.version + 1,
        state: state as i32,
        updated_at: Some(to_timestamp(SystemTime::now())),
        ..run.clone()
    }
}

/// A filter of these states only.
fn in_states(states: &[v1::RunState]) -> RunFilter {
    RunFilter {
        states: states.iter().map(|s| *s as i32).collect(),
        ..RunFilter::default()
    }
}

async fn create(store: &dyn RunStore, run: &v1::Run) {
    let created = store
        .create(run, None, &events(run, 1, "started"))
        .await
        .unwrap();
    assert!(matches!(created, Created::New));
}

#[tokio::test]
async fn runs_are_listed_per_tenant_newest_first_in_pages() {
    for s in subjects().await {
        let store = &*s.store;
        let mut acme = Vec::new();
        for i in 0..5 {
            let mut run = new_run("acme");
            if i == 1 {
                run.state = v1::RunState::Succeeded as i32;
            }
            create(store, &run).await;
            acme.push(run);
        }
        create(store, &new_run("globex")).await;
        let newest_first: Vec<String> = acme.iter().rev().map(|r| r.run_id.clone()).collect();

        let first = store
            .list("acme", &RunFilter::default(), 2, None)
            .await
            .unwrap();
        let ids = |p: &[v1::Run]| p.iter().map(|r| r.run_id.clone()).collect::<Vec<_>>();
        assert_eq!(ids(&first.runs), newest_first[..2], "{}", s.label);
        let second = store
            .list("acme", &RunFilter::default(), 2, first.next.as_deref())
            .await
            .unwrap();
        assert_eq!(ids(&second.runs), newest_first[2..4], "{}", s.label);
        let third = store
            .list("acme", &RunFilter::default(), 2, second.next.as_deref())
            .await
            .unwrap();
        assert_eq!(ids(&third.runs), newest_first[4..], "{}", s.label);
        assert_eq!(third.next, None, "{}", s.label);

        let done = store
            .list("acme", &in_states(&[v1::RunState::Succeeded]), 10, None)
            .await
            .unwrap();
        assert_eq!(ids(&done.runs), [acme[1].run_id.clone()], "{}", s.label);
        let open = store
            .list(
                "acme",
                &in_states(&[v1::RunState::Running, v1::RunState::Pending]),
                10,
                None,
            )
            .await
            .unwrap();
        assert_eq!(open.runs.len(), 4, "{}", s.label);

        assert_eq!(
            store.get(&acme[3].run_id).await.unwrap().as_ref(),
            Some(&acme[3]),
            "{}",
            s.label
        );
        assert_eq!(store.get("no-such-run").await.unwrap(), None, "{}", s.label);
        // The tenant alone, as a watch checks it, agrees with the stored run.
        assert_eq!(
            store.tenant_of(&acme[3].run_id).await.unwrap().as_deref(),
            Some("acme"),
            "{}",
            s.label
        );
        assert_eq!(
            store.tenant_of("no-such-run").await.unwrap(),
            None,
            "{}",
            s.label
        );
        assert!(
            store
                .list("initech", &RunFilter::default(), 10, None)
                .await
                .unwrap()
                .runs
                .is_empty(),
            "{}",
            s.label
        );
        let unfinished: BTreeSet<String> = store
            .unfinished()
            .await
            .unwrap()
            .into_iter()
            .map(|r| r.run_id)
            .collect();
        assert_eq!(unfinished.len(), 5, "{}: 4 acme + 1 globex", s.label);
        assert!(!unfinished.contains(&acme[1].run_id), "{}", s.label);
    }
}

#[tokio::test]
async fn a_stale_commit_is_refused_and_leaves_no_event_behind() {
    for s in subjects().await {
        let store = &*s.store;
        let v1_run = new_run("acme");
        create(store, &v1_run).await;
        let v2 = next(&v1_run, v1::RunState::Running);
        store
            .commit(&v2, &events(&v2, 2, "dispatched"))
            .await
            .unwrap();

        // A second writer that also read version 1.
        let stale = next(&v1_run, v1::RunState::Cancelled);
        let err = store
            .commit(&stale, &events(&stale, 2, "cancelled"))
            .await
            .unwrap_err();
        assert!(
            matches!(
                err,
                StoreError::Conflict {
                    expected: 1,
                    found: 2,
                    ..
                }
            ),
            "{}: {err}",
            s.label
        );
        let stored = store.get(&v1_run.run_id).await.unwrap().unwrap();
        assert_eq!(stored, v2, "{}", s.label);
        let seqs: Vec<u64> = store
            .run_events(&v1_run.run_id, 0)
            .await
            .unwrap()
            .iter()
            .map(|e| e.sequence)
            .collect();
        assert_eq!(seqs, [1, 2], "{}", s.label);
        let kinds: Vec<String> = store
            .cloud_events(None, 100)
            .await
            .unwrap()
            .into_iter()
            .map(|e| e.r#type)
            .collect();
        assert_eq!(kinds, ["started", "dispatched"], "{}", s.label);
        assert_eq!(
            store
                .run_events(&v1_run.run_id, 1)
                .await
                .unwrap()
                .iter()
                .map(|e| e.sequence)
                .collect::<Vec<_>>(),
            [2],
            "{}",
            s.label
        );

        // Skipping a version is as stale as repeating one.
        let mut ahead = next(&v2, v1::RunState::Running);
        ahead.version += 1;
        assert!(
            matches!(
                store.commit(&ahead, &Events::default()).await,
                Err(StoreError::Conflict { found: 2, .. })
            ),
            "{}",
            s.label
        );
        let ghost = next(&new_run("acme"), v1::RunState::Running);
        assert!(
            matches!(
                store.commit(&ghost, &Events::default()).await,
                Err(StoreError::NotFound(_))
            ),
            "{}",
            s.label
        );
    }
}

#[tokio::test]
async fn the_outbox_is_in_commit_order_and_resumes_after_an_event() {
    for s in subjects().await {
        let store = &*s.store;
        let a = new_run("acme");
        let b = new_run("globex");
        create(store, &a).await;
        create(store, &b).await;
        let (mut a_now, mut b_now) = (a.clone(), b.clone());
        let mut expected = Vec::new();
        for round in 0..3 {
            // Interleaved commits of two runs: the outbox follows commit order, not run.
            let next_b = next(&b_now, v1::RunState::Running);
            let eb = events(&next_b, 2 + round, "b");
            store.commit(&next_b, &eb).await.unwrap();
            let next_a = next(&a_now, v1::RunState::Running);
            let ea = events(&next_a, 2 + round, "a");
            store.commit(&next_a, &ea).await.unwrap();
            expected.push(eb.cloud[0].id.clone());
            expected.push(ea.cloud[0].id.clone());
            (a_now, b_now) = (next_a, next_b);
        }
        let all: Vec<String> = store
            .cloud_events(None, 100)
            .await
            .unwrap()
            .into_iter()
            .map(|e| e.id)
            .collect();
        assert_eq!(all.len(), 8, "{}", s.label);
        assert_eq!(all[2..], expected[..], "{}", s.label);

        let after_third: Vec<String> = store
            .cloud_events(Some(&all[2]), 3)
            .await
            .unwrap()
            .into_iter()
            .map(|e| e.id)
            .collect();
        assert_eq!(after_third, all[3..6], "{}", s.label);
        // An id no longer in the outbox resumes where it would sort (UUIDv7 by time).
        let between = format!("{}0", &all[4][..all[4].len() - 1]);
        let resumed = store.cloud_events(Some(&between), 100).await.unwrap();
        assert!(
            resumed.iter().all(|e| e.id > between),
            "{}: {resumed:?}",
            s.label
        );
        assert!(
            store
                .cloud_events(Some(&all[7]), 10)
                .await
                .unwrap()
                .is_empty(),
            "{}",
            s.label
        );
    }
}

#[tokio::test]
async fn a_commit_with_many_events_stores_every_one_in_order() {
    // More events than one multi-row INSERT takes, so a commit's rows span statements;
    // and a create and a commit of a single event each, around it.
    const MANY: u64 = 75;
    for s in subjects().await {
        let store = &*s.store;
        let run = new_run("acme");
        create(store, &run).await;
        let wide = next(&run, v1::RunState::Running);
        let many = Events {
            run: (2..2 + MANY).map(|n| run_event(&wide, n)).collect(),
            cloud: (0..MANY)
                .map(|n| cloud(&wide, &format!("wide.{n}")))
                .collect(),
            commands: Vec::new(),
            release: false,
        };
        store.commit(&wide, &many).await.unwrap();
        let last = next(&wide, v1::RunState::Succeeded);
        store
            .commit(&last, &events(&last, 2 + MANY, "done"))
            .await
            .unwrap();

        let sequences: Vec<u64> = store
            .run_events(&run.run_id, 0)
            .await
            .unwrap()
            .into_iter()
            .map(|e| e.sequence)
            .collect();
        assert_eq!(
            sequences,
            (1..=2 + MANY).collect::<Vec<_>>(),
            "{}: every run event, once, in order",
            s.label
        );
        let kinds: Vec<String> = store
            .cloud_events(None, 1000)
            .await
            .unwrap()
            .into_iter()
            .map(|e| e.r#type)
            .collect();
        let expected: Vec<String> = std::iter::once("started".to_owned())
            .chain((0..MANY).map(|n| format!("wide.{n}")))
            .chain(std::iter::once("done".to_owned()))
            .collect();
        assert_eq!(
            kinds, expected,
            "{}: every outbox row, once, in order",
            s.label
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_concurrent_starts_with_one_key_store_one_run() {
    for s in subjects().await {
        let key = IdempotencyKey {
            principal: "oncall@acme".into(),
            key: "incident-2026-02".into(),
        };
        let tasks: Vec<_> = (0..50)
            .map(|_| {
                let store = s.store.clone();
                let key = key.clone();
                tokio::spawn(async move {
                    let run = new_run("acme");
                    let created = store
                        .create(&run, Some(&key), &events(&run, 1, "started"))
                        .await
                        .unwrap();
                    (run.run_id, created)
                })
            })
            .collect();
        let mut new = Vec::new();
        let mut existing = BTreeSet::new();
        for t in tasks {
            match t.await.unwrap() {
                (id, Created::New) => new.push(id),
                (_, Created::Existing(run)) => {
                    existing.insert(run.run_id);
                }
            }
        }
        assert_eq!(new.len(), 1, "{}: exactly one run is stored", s.label);
        assert!(
            existing.iter().all(|id| *id == new[0]),
            "{}: every other start returns it: {existing:?}",
            s.label
        );
        let listed = s
            .store
            .list("acme", &RunFilter::default(), 100, None)
            .await
            .unwrap();
        assert_eq!(listed.runs.len(), 1, "{}", s.label);
        assert_eq!(
            s.store.cloud_events(None, 100).await.unwrap().len(),
            1,
            "{}: the losers' events were not stored",
            s.label
        );
        // The same key of another principal is another run.
        let other = IdempotencyKey {
            principal: "analyst@acme".into(),
            ..key
        };
        let run = new_run("acme");
        assert!(
            matches!(
                s.store
                    .create(&run, Some(&other), &Events::default())
                    .await
                    .unwrap(),
                Created::New
            ),
            "{}",
            s.label
        );
    }
}

#[tokio::test]
async fn subscribers_hear_of_commits() {
    for s in subjects().await {
        let mut notes = s.store.subscribe();
        let run = new_run("acme");
        create(&*s.store, &run).await;
        let note = tokio::time::timeout(Duration::from_secs(5), notes.recv())
            .await
            .expect("a notification")
            .unwrap();
        assert_eq!(
            (note.run_id.as_str(), note.last_sequence, note.cloud),
            (run.run_id.as_str(), 1, true),
            "{}",
            s.label
        );
    }
}

#[tokio::test]
async fn leases_go_to_one_owner_until_released_or_expired() {
    for s in subjects().await {
        let store = &*s.store;
        let runs: Vec<v1::Run> = (0..3).map(|_| new_run("acme")).collect();
        for r in &runs {
            create(store, r).await;
        }
        let mut done = new_run("acme");
        done.state = v1::RunState::Succeeded as i32;
        create(store, &done).await;
        let ids = |v: &[v1::Run]| v.iter().map(|r| r.run_id.clone()).collect::<Vec<_>>();
        let all = ids(&runs);
        let hour = Duration::from_secs(3600);

        let a = store.claim_runs("replica-a", hour, 10).await.unwrap();
        assert_eq!(ids(&a), all, "{}: unfinished runs, oldest first", s.label);
        assert!(
            store
                .claim_runs("replica-b", hour, 10)
                .await
                .unwrap()
                .is_empty(),
            "{}: held by a",
            s.label
        );
        // Claiming again returns nothing new, so a replica may claim in a loop.
        assert!(
            store
                .claim_runs("replica-a", hour, 2)
                .await
                .unwrap()
                .is_empty(),
            "{}",
            s.label
        );

        assert!(
            store.release("replica-a", &all[1]).await.unwrap(),
            "{}",
            s.label
        );
        assert!(
            !store.release("replica-b", &all[0]).await.unwrap(),
            "{}: b holds nothing",
            s.label
        );
        assert_eq!(
            ids(&store.claim_runs("replica-b", hour, 10).await.unwrap()),
            [all[1].clone()],
            "{}",
            s.label
        );
        assert_eq!(
            store.renew_lease("replica-a", &all, hour).await.unwrap(),
            [all[0].clone(), all[2].clone()],
            "{}: a lost the released run",
            s.label
        );

        // Leases that run out are claimable by another owner.
        let short = store
            .renew_lease("replica-b", &all, Duration::from_millis(1))
            .await
            .unwrap();
        assert_eq!(short, [all[1].clone()], "{}", s.label);
        store
            .renew_lease("replica-a", &all, Duration::from_millis(1))
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert_eq!(
            ids(&store.claim_runs("replica-c", hour, 10).await.unwrap()),
            all,
            "{}",
            s.label
        );
        assert!(
            store
                .renew_lease("replica-a", &all, hour)
                .await
                .unwrap()
                .is_empty(),
            "{}: a's leases are gone",
            s.label
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_claimers_never_get_the_same_run() {
    for s in subjects().await {
        let mut all = BTreeSet::new();
        for _ in 0..30 {
            let run = new_run("acme");
            create(&*s.store, &run).await;
            all.insert(run.run_id);
        }
        let claimer = |owner: &'static str| {
            let store = s.store.clone();
            tokio::spawn(async move {
                let mut mine = Vec::new();
                loop {
                    let got = store
                        .claim_runs(owner, Duration::from_secs(3600), 2)
                        .await
                        .unwrap();
                    if got.is_empty() {
                        return mine;
                    }
                    mine.extend(got.into_iter().map(|r| r.run_id));
                    tokio::task::yield_now().await;
                }
            })
        };
        let (a, b) = tokio::join!(claimer("replica-a"), claimer("replica-b"));
        let (a, b) = (a.unwrap(), b.unwrap());
        let a_set: BTreeSet<String> = a.iter().cloned().collect();
        let b_set: BTreeSet<String> = b.iter().cloned().collect();
        assert!(
            a_set.is_disjoint(&b_set),
            "{}: both claimed {:?}",
            s.label,
            a_set.intersection(&b_set).collect::<Vec<_>>()
        );
        let union: BTreeSet<String> = a_set.union(&b_set).cloned().collect();
        assert_eq!(union, all, "{}: every run was claimed", s.label);
    }
}

#[tokio::test]
async fn runs_created_by_an_owner_are_leased_to_it() {
    for t in test_databases().await {
        let store = SqlRunStore::open(t.db.clone())
            .await
            .unwrap()
            .with_owner("replica-a", Duration::from_secs(3600));
        let run = new_run("acme");
        create(&store, &run).await;
        assert!(
            store
                .claim_runs("replica-b", Duration::from_secs(60), 10)
                .await
                .unwrap()
                .is_empty(),
            "{}",
            t.label
        );
        let held = vec![run.run_id.clone()];
        assert_eq!(
            store
                .renew_lease("replica-a", &held, Duration::from_secs(60))
                .await
                .unwrap(),
            held,
            "{}",
            t.label
        );
    }
    let memory = MemoryStore::default().with_owner("replica-a", Duration::from_secs(3600));
    let run = new_run("acme");
    create(&memory, &run).await;
    assert!(
        memory
            .claim_runs("replica-b", Duration::from_secs(60), 10)
            .await
            .unwrap()
            .is_empty()
    );
}

#[tokio::test]
async fn a_replica_whose_run_was_taken_over_can_no_longer_commit_it() {
    for t in test_databases().await {
        // A creates the run and commits it (so it remembers it); its lease runs out, B
        // claims the run and commits it. A's next commit must be refused: the write
        // itself checks lease and version, whatever A remembers.
        let a = SqlRunStore::open(t.db.clone())
            .await
            .unwrap()
            .with_owner("replica-a", Duration::from_millis(200));
        let b = SqlRunStore::open(t.db.clone())
            .await
            .unwrap()
            .with_owner("replica-b", Duration::from_secs(3600));
        let run = new_run("acme");
        create(&a, &run).await;
        let v2 = next(&run, v1::RunState::Running);
        a.commit(&v2, &events(&v2, 2, "running")).await.unwrap();

        tokio::time::sleep(Duration::from_millis(300)).await;
        let claimed = b
            .claim_runs("replica-b", Duration::from_secs(3600), 10)
            .await
            .unwrap();
        assert_eq!(claimed.len(), 1, "{}", t.label);
        assert_eq!(claimed[0].version, 2, "{}", t.label);

        // Same version as B has: refused for the lease.
        let a3 = next(&v2, v1::RunState::Cancelled);
        let err = a
            .commit(&a3, &events(&a3, 3, "cancelled"))
            .await
            .unwrap_err();
        assert!(
            matches!(&err, StoreError::LeaseLost { owner, .. } if owner == "replica-b"),
            "{}: {err}",
            t.label
        );
        // B goes on from what it read; A, now behind, is refused for the version.
        let b3 = next(&claimed[0], v1::RunState::Succeeded);
        b.commit(&b3, &events(&b3, 3, "succeeded")).await.unwrap();
        let a4 = next(&a3, v1::RunState::Cancelled);
        let err = a
            .commit(&a4, &events(&a4, 4, "cancelled"))
            .await
            .unwrap_err();
        assert!(
            matches!(
                &err,
                StoreError::Conflict { found: 3, .. } | StoreError::LeaseLost { .. }
            ),
            "{}: {err}",
            t.label
        );
        let stored = a.get(&run.run_id).await.unwrap().unwrap();
        assert_eq!(stored.state, v1::RunState::Succeeded as i32, "{}", t.label);
        assert_eq!(stored.version, 3, "{}", t.label);
        let ledger_versions: BTreeSet<u64> = a
            .ledger(&run.run_id)
            .await
            .unwrap()
            .iter()
            .map(|e| e.run_version)
            .collect();
        assert!(
            ledger_versions.iter().all(|v| *v <= 3),
            "{}: refused commits left ledger rows: {ledger_versions:?}",
            t.label
        );
    }
}

#[tokio::test]
async fn the_ledger_records_every_delegation_transition_and_every_decision() {
    for t in test_databases().await {
        let store = SqlRunStore::open(t.db.clone()).await.unwrap();
        let v1_run = new_run("acme");
        create(&store, &v1_run).await;

        let mut v2 = next(&v1_run, v1::RunState::Running);
        v2.delegations[0].state = v1::DelegationState::Dispatched as i32;
        v2.delegations[0].worker_id = "worker-1".into();
        v2.delegations[0].attempts = 1;
        store.commit(&v2, &Events::default()).await.unwrap();

        // No delegation changes: no ledger row.
        let v3 = next(&v2, v1::RunState::Running);
        store.commit(&v3, &Events::default()).await.unwrap();

        let decision = |revision| v1::JoinDecision {
            revision,
            outcome: v1::JoinOutcome::PartialEvidence as i32,
            decided_at: Some(to_timestamp(SystemTime::now())),
            ..Default::default()
        };
        let mut v4 = next(&v3, v1::RunState::Partial);
        v4.delegations[0].state = v1::DelegationState::Completed as i32;
        v4.delegations[1].state = v1::DelegationState::Failed as i32;
        // A nested child appears.
        let mut child = delegation("d1.1", v1::DelegationState::Pending);
        child.task.as_mut().unwrap().parent_delegation_id = "d1".into();
        v4.delegations.push(child);
        v4.decision = Some(decision(1));
        v4.revisions = vec![decision(1)];
        store.commit(&v4, &Events::default()).await.unwrap();

        let mut v5 = next(&v4, v1::RunState::Partial);
        v5.decision = Some(decision(2));
        v5.revisions = vec![decision(1), decision(2)];
        store.commit(&v5, &Events::default()).await.unwrap();

        let ledger = store.ledger(&v1_run.run_id).await.unwrap();
        let rows: Vec<(String, u64, i32)> = ledger
            .iter()
            .map(|e| (e.delegation_id.clone(), e.run_version, e.state))
            .collect();
        use v1::DelegationState as S;
        assert_eq!(
            rows,
            [
                ("d1".into(), 1, S::Pending as i32),
                ("d2".into(), 1, S::Pending as i32),
                ("d1".into(), 2, S::Dispatched as i32),
                ("d1".into(), 4, S::Completed as i32),
                ("d1.1".into(), 4, S::Pending as i32),
                ("d2".into(), 4, S::Failed as i32),
            ],
            "{}",
            t.label
        );
        assert_eq!(ledger[2].worker_id, "worker-1", "{}", t.label);
        assert_eq!(ledger[2].attempts, 1, "{}", t.label);
        assert_eq!(ledger[4].parent_delegation_id, "d1", "{}", t.label);

        let revisions: Vec<u32> = store
            .decisions(&v1_run.run_id)
            .await
            .unwrap()
            .iter()
            .map(|d| d.revision)
            .collect();
        assert_eq!(revisions, [1, 2], "{}", t.label);

        // A refused commit records no transition.
        let mut stale = next(&v3, v1::RunState::Cancelled);
        stale.delegations[1].state = v1::DelegationState::Cancelled as i32;
        assert!(store.commit(&stale, &Events::default()).await.is_err());
        assert_eq!(
            store.ledger(&v1_run.run_id).await.unwrap().len(),
            6,
            "{}",
            t.label
        );
    }
}

#[tokio::test]
async fn a_wide_run_records_each_delegations_transition_once() {
    // More delegations than one ledger insert takes: rows span statements.
    const WIDE: usize = 70;
    for t in test_databases().await {
        let store = SqlRunStore::open(t.db.clone()).await.unwrap();
        let mut run = new_run("acme");
        run.delegations = (0..WIDE)
            .map(|n| delegation(&format!("d{n:02}"), v1::DelegationState::Pending))
            .collect();
        create(&store, &run).await;
        let mut dispatched = next(&run, v1::RunState::Running);
        for d in &mut dispatched.delegations {
            d.state = v1::DelegationState::Dispatched as i32;
        }
        // One delegation stays as it was: no row for it at version 2.
        dispatched.delegations[WIDE - 1].state = v1::DelegationState::Pending as i32;
        store.commit(&dispatched, &Events::default()).await.unwrap();

        let rows: BTreeSet<(String, u64, i32)> = store
            .ledger(&run.run_id)
            .await
            .unwrap()
            .into_iter()
            .map(|e| (e.delegation_id, e.run_version, e.state))
            .collect();
        use v1::DelegationState as S;
        let expected: BTreeSet<(String, u64, i32)> = (0..WIDE)
            .map(|n| (format!("d{n:02}"), 1, S::Pending as i32))
            .chain((0..WIDE - 1).map(|n| (format!("d{n:02}"), 2, S::Dispatched as i32)))
            .collect();
        assert_eq!(rows, expected, "{}", t.label);
        assert_eq!(
            store.ledger(&run.run_id).await.unwrap().len(),
            2 * WIDE - 1,
            "{}: no row twice",
            t.label
        );
    }
}

#[tokio::test]
async fn another_process_commits_reach_subscribers_and_relays_resume() {
    for t in test_databases().await {
        // Two handles on one database, as two supervisor replicas would have.
        let other_db = convene_store::Database::connect(t.db.url()).await.unwrap();
        let here = SqlRunStore::open(t.db.clone()).await.unwrap();
        let there = SqlRunStore::open(other_db).await.unwrap();
        let mut notes = here.subscribe();

        let run = new_run("acme");
        create(&there, &run).await;
        let note = tokio::time::timeout(Duration::from_secs(5), notes.recv())
            .await
            .expect("the poll reports the other process's commit")
            .unwrap();
        assert_eq!(note.run_id, run.run_id, "{}", t.label);
        assert_eq!(note.last_sequence, 1, "{}", t.label);
        assert!(note.cloud, "{}", t.label);
        assert_eq!(
            here.get(&run.run_id).await.unwrap(),
            Some(run),
            "{}",
            t.label
        );

        // Relay cursors.
        assert_eq!(
            here.relay_cursor("nats").await.unwrap(),
            None,
            "{}",
            t.label
        );
        let first = here.cloud_events(None, 1).await.unwrap().remove(0);
        here.acknowledge("nats", &first.id).await.unwrap();
        assert_eq!(
            there.relay_cursor("nats").await.unwrap(),
            Some(first.id.clone()),
            "{}",
            t.label
        );
        assert!(
            matches!(
                here.acknowledge("nats", "no-such-event").await,
                Err(StoreError::NotFound(_))
            ),
            "{}",
            t.label
        );
    }
}

#[tokio::test]
async fn the_poll_reports_each_run_once_with_its_highest_sequence() {
    for t in test_databases().await {
        let other_db = convene_store::Database::connect(t.db.url()).await.unwrap();
        let here = SqlRunStore::open(t.db.clone()).await.unwrap();
        let there = SqlRunStore::open(other_db).await.unwrap();
        let mut notes = here.subscribe();

        // Run a: created, then (after run b is) one commit of three run events and no
        // outbox row. Run b: created only.
        let a = new_run("acme");
        create(&there, &a).await;
        let b = new_run("acme");
        create(&there, &b).await;
        let a2 = next(&a, v1::RunState::Running);
        let three = Events {
            run: (2..=4).map(|n| run_event(&a2, n)).collect(),
            cloud: Vec::new(),
            commands: Vec::new(),
            release: false,
        };
        there.commit(&a2, &three).await.unwrap();

        // The poll finds these commits in one or more rounds: a round reports a run
        // once, with the highest sequence it read.
        let mut highest: HashMap<String, (u64, bool)> = HashMap::new();
        while highest.get(&a.run_id).map(|h| h.0) != Some(4) || !highest.contains_key(&b.run_id) {
            let note = tokio::time::timeout(Duration::from_secs(5), notes.recv())
                .await
                .unwrap_or_else(|_| panic!("{}: the poll reports both runs", t.label))
                .unwrap();
            let entry = highest.entry(note.run_id.clone()).or_default();
            assert!(
                note.last_sequence >= entry.0,
                "{}: a note never goes back ({note:?})",
                t.label
            );
            *entry = (note.last_sequence, entry.1 | note.cloud);
        }
        assert_eq!(highest[&a.run_id], (4, true), "{}", t.label);
        assert_eq!(highest[&b.run_id], (1, true), "{}", t.label);
        assert_eq!(highest.len(), 2, "{}: no other run", t.label);

        // Nothing more was committed: no further note (the poll moved past every row).
        let again = tokio::time::timeout(Duration::from_millis(600), notes.recv()).await;
        assert!(
            again.is_err(),
            "{}: rows already reported come again: {again:?}",
            t.label
        );
    }
}

/// A cancel command for `run`.
fn cancel_command(run: &v1::Run, id: &str) -> RunCommand {
    RunCommand {
        command_id: id.to_owned(),
        run_id: run.run_id.clone(),
        principal: "oncall@acme".to_owned(),
        created_at: Some(to_timestamp(SystemTime::now())),
        kind: Some(CommandKind::Cancel(v1::CancelRunRequest {
            run_id: run.run_id.clone(),
            reason: id.to_owned(),
        })),
    }
}

#[tokio::test]
async fn commands_are_stored_once_and_done_with_the_commit_that_applies_them() {
    for s in subjects().await {
        let store = &*s.store;
        let run = new_run("acme");
        create(store, &run).await;
        store
            .add_command(&cancel_command(&run, "c1"))
            .await
            .unwrap();
        store
            .add_command(&cancel_command(&run, "c2"))
            .await
            .unwrap();
        // The same id again (two replicas taking one event) is stored once.
        store
            .add_command(&cancel_command(&run, "c1"))
            .await
            .unwrap();
        let pending = store.pending_commands(&run.run_id).await.unwrap();
        let ids: Vec<&str> = pending.iter().map(|c| c.command_id.as_str()).collect();
        assert_eq!(ids, ["c1", "c2"], "{}: oldest first, once each", s.label);
        assert_eq!(
            pending[0].kind,
            cancel_command(&run, "c1").kind,
            "{}",
            s.label
        );
        assert_eq!(
            store.runs_with_commands().await.unwrap(),
            std::slice::from_ref(&run.run_id),
            "{}",
            s.label
        );
        assert_eq!(store.command_outcome("c1").await.unwrap(), None);

        // A commit that applies c1 marks it done with its outcome, in one transaction.
        let changed = next(&run, v1::RunState::Cancelled);
        let mut ev = events(&changed, 2, "dev.convene.run.completed.v1");
        ev.commands.push(CommandDone {
            command_id: "c1".to_owned(),
            code: 0,
            message: "cancelled".to_owned(),
        });
        store.commit(&changed, &ev).await.unwrap();
        let done = store.command_outcome("c1").await.unwrap().expect("done");
        assert_eq!(
            (done.code, done.message.as_str()),
            (0, "cancelled"),
            "{}",
            s.label
        );
        // A command done elsewhere, with a refusal.
        store
            .end_commands(&[CommandDone {
                command_id: "c2".to_owned(),
                code: 9,
                message: "the run had ended".to_owned(),
            }])
            .await
            .unwrap();
        assert_eq!(
            store.command_outcome("c2").await.unwrap().map(|d| d.code),
            Some(9)
        );
        assert!(
            store
                .pending_commands(&run.run_id)
                .await
                .unwrap()
                .is_empty()
        );
        assert!(
            store.runs_with_commands().await.unwrap().is_empty(),
            "{}",
            s.label
        );
    }
}

#[tokio::test]
async fn a_waiting_run_is_nobodys_until_claimed_for_a_command() {
    for s in subjects().await {
        let store = &*s.store;
        let run = new_run("acme");
        create(store, &run).await;
        let hour = Duration::from_secs(3600);
        let claimed = store.claim_runs("replica-a", hour, 10).await.unwrap();
        assert_eq!(claimed.len(), 1, "{}", s.label);
        // It begins to wait: its lease goes with the commit.
        let waiting = next(&run, v1::RunState::WaitingInput);
        let mut ev = events(&waiting, 2, "dev.convene.run.waiting.v1");
        ev.release = true;
        store.commit(&waiting, &ev).await.unwrap();
        assert!(
            store
                .claim_runs("replica-b", hour, 10)
                .await
                .unwrap()
                .is_empty(),
            "{}: the claim loop never takes a waiting run",
            s.label
        );
        assert!(
            store
                .renew_lease("replica-a", std::slice::from_ref(&run.run_id), hour)
                .await
                .unwrap()
                .is_empty(),
            "{}: replica a holds it no more",
            s.label
        );
        // A command gets it claimed, by one replica.
        let got = store
            .claim_waiting("replica-b", &run.run_id, hour)
            .await
            .unwrap();
        assert_eq!(got.map(|r| r.version), Some(2), "{}", s.label);
        assert!(
            store
                .claim_waiting("replica-a", &run.run_id, hour)
                .await
                .unwrap()
                .is_none(),
            "{}: held by b",
            s.label
        );
        // A running or ended run is never claimed this way.
        let other = new_run("acme");
        create(store, &other).await;
        assert!(
            store
                .claim_waiting("replica-a", &other.run_id, hour)
                .await
                .unwrap()
                .is_none(),
            "{}",
            s.label
        );
    }
}

#[tokio::test]
async fn events_of_another_service_join_the_outbox_once() {
    for s in subjects().await {
        let store = &*s.store;
        let run = new_run("acme");
        create(store, &run).await;
        let mut foreign = cloud(&run, "dev.convene.approval.decided.v1");
        foreign.source = "convene://approval".to_owned();
        store
            .import_events(std::slice::from_ref(&foreign))
            .await
            .unwrap();
        store
            .import_events(std::slice::from_ref(&foreign))
            .await
            .unwrap();
        let all = store.cloud_events(None, 100).await.unwrap();
        let copies = all.iter().filter(|e| e.id == foreign.id).count();
        assert_eq!(copies, 1, "{}: deduplicated by event id", s.label);
        store
            .acknowledge("approval-events", &foreign.id)
            .await
            .unwrap();
        assert_eq!(
            store.relay_cursor("approval-events").await.unwrap(),
            Some(foreign.id.clone()),
            "{}",
            s.label
        );
    }
}
