//! The `ApprovalStore` contract on every store: in memory, a SQLite file, and PostgreSQL
//! when `CONVENE_TEST_POSTGRES_URL` names a server: requests, their events, and the
//! pending requests an expiry sweep reads.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use convene_approval::events::{EXPIRED, REQUESTED};
use convene_approval::model::{ApprovalRequest, Decision, Execution, ExecutionClaim, State, Vote};
use convene_approval::store::{
    ApprovalStore, Created, Cursor, EventQuery, ListQuery, StoreError, Versioned, Viewer,
};
use convene_approval::{Event, MemoryStore, SqlApprovalStore};
use convene_core::permissions::RiskLevel;
use convene_store::test_util::{TestDatabase, test_databases};
use prost_types::{Struct, Value, value::Kind};

struct Subject {
    label: &'static str,
    store: Arc<dyn ApprovalStore>,
    _db: Option<TestDatabase>,
}

async fn subjects() -> Vec<Subject> {
    let mut all = vec![Subject {
        label: "memory",
        store: Arc::new(MemoryStore::new()),
        _db: None,
    }];
    for t in test_databases().await {
        all.push(Subject {
            label: t.label,
            store: Arc::new(SqlApprovalStore::new(t.db.clone())),
            _db: Some(t),
        });
    }
    all
}

fn t(secs: u64) -> SystemTime {
    SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000 + secs)
}

fn request(id: &str, requester: &str, key: &str, created: u64) -> ApprovalRequest {
    ApprovalRequest {
        approval_id: id.into(),
        tenant: "acme".into(),
        action: "rule:rollback".into(),
        parameters: Struct {
            fields: [(
                "rule".to_owned(),
                Value {
                    kind: Some(Kind::StringValue("risk-rule-42".into())),
                },
            )]
            .into_iter()
            .collect(),
        },
        parameters_hash: "sha256:00".into(),
        risk: RiskLevel::R3,
        idempotency_key: key.into(),
        requester: requester.into(),
        filed_by: "supervisor".into(),
        evidence_refs: vec!["logs://payment-api/1".into()],
        expires_at: t(1_000),
        state: State::Pending,
        votes: vec![],
        execution: None,
        executing: None,
        cancellation: None,
        run_id: String::new(),
        rationale: "the rule's hit rate deviates".into(),
        created_at: t(created),
    }
}

/// Files `r` with its `requested` event.
async fn create(store: &dyn ApprovalStore, r: ApprovalRequest) -> Result<Created, StoreError> {
    let event = Event::requested(&r);
    store.create(r, event).await
}

/// Replaces the request at version `expected` with `r`, with an event (which the store
/// contract commits without reading it).
async fn change(
    store: &dyn ApprovalStore,
    expected: u64,
    r: ApprovalRequest,
) -> Result<Versioned, StoreError> {
    let event = Event::expired(&r, r.created_at);
    store.update(expected, r, Some(event)).await
}

fn viewer() -> Viewer {
    Viewer {
        tenant: "acme".into(),
        principal: "alice@acme".into(),
    }
}

#[tokio::test]
async fn every_field_survives_the_store() {
    for s in subjects().await {
        let mut r = request("apr-1", "oncall@acme", "k", 0);
        // Sub-second times come back exactly.
        r.created_at += Duration::from_nanos(123_456_789);
        let Created::New(stored) = create(&*s.store, r.clone()).await.unwrap() else {
            panic!("{}: new", s.label);
        };
        assert_eq!(stored.request, r, "{}", s.label);
        r.votes = vec![
            Vote {
                approver: "alice@acme".into(),
                decision: Decision::Approve,
                parameters_hash: "sha256:00".into(),
                comment: "checked the evidence".into(),
                decided_at: t(5),
            },
            Vote {
                approver: "bob@acme".into(),
                decision: Decision::Approve,
                parameters_hash: "sha256:00".into(),
                comment: String::new(),
                decided_at: t(6),
            },
        ];
        r.state = State::Approved;
        r.executing = Some(ExecutionClaim {
            by: "oncall@acme".into(),
            started_at: t(7),
        });
        change(&*s.store, 1, r.clone()).await.unwrap();
        r.executing = None;
        r.state = State::Executed;
        r.execution = Some(Execution {
            executor: "record-only".into(),
            success: true,
            output: Struct::default(),
            executed_at: t(8),
            executed_by: "oncall@acme".into(),
        });
        change(&*s.store, 2, r.clone()).await.unwrap();
        assert_eq!(
            s.store.get("apr-1").await.unwrap(),
            Some(Versioned {
                version: 3,
                request: r
            }),
            "{}",
            s.label
        );
        assert_eq!(s.store.get("apr-2").await.unwrap(), None, "{}", s.label);
    }
}

#[tokio::test]
async fn create_is_idempotent_per_requester_and_key() {
    for s in subjects().await {
        let store = &*s.store;
        let first = create(store, request("a", "oncall", "k1", 0))
            .await
            .unwrap();
        assert!(
            matches!(first, Created::New(ref v) if v.version == 1),
            "{}",
            s.label
        );
        let again = create(store, request("b", "oncall", "k1", 1))
            .await
            .unwrap();
        let Created::Existing(existing) = again else {
            panic!("{}: the key is used: {again:?}", s.label);
        };
        assert_eq!(existing.request.approval_id, "a", "{}", s.label);
        let other = create(store, request("c", "analyst", "k1", 2))
            .await
            .unwrap();
        assert!(matches!(other, Created::New(_)), "{}", s.label);
        assert!(store.get("b").await.unwrap().is_none(), "{}", s.label);
        let err = create(store, request("a", "oncall", "k2", 3))
            .await
            .unwrap_err();
        assert!(
            matches!(err, StoreError::DuplicateId { ref approval_id } if approval_id == "a"),
            "{}: {err}",
            s.label
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_filings_with_one_key_create_one_request() {
    for s in subjects().await {
        let tasks: Vec<_> = (0..50)
            .map(|i| {
                let store = s.store.clone();
                tokio::spawn(async move {
                    create(
                        &*store,
                        request(&format!("apr-{i}"), "supervisor", "run-1/rollback", i),
                    )
                    .await
                    .unwrap()
                })
            })
            .collect();
        let mut new = Vec::new();
        let mut existing = Vec::new();
        for task in tasks {
            match task.await.unwrap() {
                Created::New(v) => new.push(v.request.approval_id),
                Created::Existing(v) => existing.push(v.request.approval_id),
            }
        }
        assert_eq!(new.len(), 1, "{}: {new:?}", s.label);
        assert!(existing.iter().all(|id| *id == new[0]), "{}", s.label);
    }
}

#[tokio::test]
async fn update_is_compare_and_set() {
    for s in subjects().await {
        let store = &*s.store;
        create(store, request("a", "oncall", "k", 0)).await.unwrap();
        let mut changed = request("a", "oncall", "k", 0);
        changed.state = State::Rejected;
        let v2 = change(store, 1, changed.clone()).await.unwrap();
        assert_eq!(v2.version, 2, "{}", s.label);
        let mut stale = request("a", "oncall", "k", 0);
        stale.state = State::Approved;
        let err = change(store, 1, stale).await.unwrap_err();
        assert!(
            matches!(
                err,
                StoreError::Conflict {
                    expected: 1,
                    actual: 2,
                    ..
                }
            ),
            "{}: {err}",
            s.label
        );
        assert_eq!(
            store.get("a").await.unwrap().unwrap().request.state,
            State::Rejected,
            "{}",
            s.label
        );
        let err = change(store, 1, request("zzz", "oncall", "k9", 0))
            .await
            .unwrap_err();
        assert!(
            matches!(err, StoreError::Missing { .. }),
            "{}: {err}",
            s.label
        );
    }
}

#[tokio::test]
async fn list_is_newest_first_filtered_and_resumable() {
    for s in subjects().await {
        let store = &*s.store;
        for (i, id) in ["r1", "r2", "r3", "r4", "r5", "r6"].iter().enumerate() {
            let mut r = request(id, "oncall", id, i as u64);
            match *id {
                "r3" => r.tenant = "globex".into(),
                "r4" => r.run_id = "run-9".into(),
                // Another tenant's request, filed by the viewer: visible.
                "r6" => {
                    r.tenant = "globex".into();
                    r.filed_by = "alice@acme".into();
                    r.state = State::Approved;
                }
                _ => {}
            }
            create(store, r).await.unwrap();
        }
        let query = |after: Option<Cursor>, limit| ListQuery {
            viewer: viewer(),
            states: vec![],
            run_id: None,
            now: t(10),
            after,
            limit,
        };
        let ids = |v: Vec<Versioned>| -> Vec<String> {
            v.into_iter().map(|s| s.request.approval_id).collect()
        };
        let page = store.list(&query(None, 2)).await.unwrap();
        let cursor = Cursor {
            created_at: page[1].request.created_at,
            approval_id: page[1].request.approval_id.clone(),
        };
        assert_eq!(ids(page), ["r6", "r5"], "{}", s.label);
        assert_eq!(
            ids(store.list(&query(Some(cursor), 10)).await.unwrap()),
            ["r4", "r2", "r1"],
            "{}: r3 is another tenant's",
            s.label
        );
        let by_run = ListQuery {
            run_id: Some("run-9".into()),
            ..query(None, 10)
        };
        assert_eq!(
            ids(store.list(&by_run).await.unwrap()),
            ["r4"],
            "{}",
            s.label
        );
        let expired = ListQuery {
            states: vec![State::Expired],
            now: t(5_000),
            ..query(None, 10)
        };
        assert_eq!(
            ids(store.list(&expired).await.unwrap()),
            ["r5", "r4", "r2", "r1"],
            "{}: pending past expiry reads as expired",
            s.label
        );
        let pending_or_approved = ListQuery {
            states: vec![State::Pending, State::Approved],
            now: t(5_000),
            ..query(None, 10)
        };
        assert_eq!(
            ids(store.list(&pending_or_approved).await.unwrap()),
            ["r6"],
            "{}",
            s.label
        );
        let pending_before_expiry = ListQuery {
            states: vec![State::Pending],
            ..query(None, 10)
        };
        assert_eq!(
            ids(store.list(&pending_before_expiry).await.unwrap()),
            ["r5", "r4", "r2", "r1"],
            "{}",
            s.label
        );
    }
}

#[tokio::test]
async fn a_change_commits_its_event_and_a_refused_one_commits_none() {
    for s in subjects().await {
        let store = &*s.store;
        let mut committed = store.subscribe();
        committed.borrow_and_update();
        let mut a = request("a", "oncall", "k", 0);
        a.run_id = "run-1".into();
        create(store, a.clone()).await.unwrap();
        assert!(committed.has_changed().unwrap(), "{}", s.label);
        committed.borrow_and_update();

        // An idempotent repeat, a state change without an event, a lost compare-and-set:
        // none of them writes anything.
        let repeat = create(store, request("b", "oncall", "k", 1)).await.unwrap();
        assert!(matches!(repeat, Created::Existing(_)), "{}", s.label);
        let mut approved = a.clone();
        approved.state = State::Approved;
        let err = store.update(1, approved.clone(), None).await.unwrap_err();
        assert!(
            matches!(
                err,
                StoreError::Unrecorded {
                    from: State::Pending,
                    to: State::Approved,
                    ..
                }
            ),
            "{}: {err}",
            s.label
        );
        assert_eq!(
            store.get("a").await.unwrap().unwrap().version,
            1,
            "{}",
            s.label
        );
        // A change of the execution claim alone needs no event.
        let mut claimed = a.clone();
        claimed.executing = Some(ExecutionClaim {
            by: "alice@acme".into(),
            started_at: t(3),
        });
        assert_eq!(
            store.update(1, claimed, None).await.unwrap().version,
            2,
            "{}",
            s.label
        );
        let err = change(store, 1, approved).await.unwrap_err();
        assert!(
            matches!(err, StoreError::Conflict { actual: 2, .. }),
            "{}: {err}",
            s.label
        );
        assert!(!committed.has_changed().unwrap(), "{}", s.label);

        // Another tenant's request, filed by the supervisor; then a's expiry.
        let mut g = request("g", "analyst", "k", 2);
        g.tenant = "globex".into();
        g.run_id = "run-2".into();
        create(store, g).await.unwrap();
        let mut expired = store.get("a").await.unwrap().unwrap().request;
        expired.executing = None;
        expired.state = State::Expired;
        change(store, 2, expired).await.unwrap();
        assert!(committed.has_changed().unwrap(), "{}", s.label);

        let read = |viewer: Viewer, run_id: Option<&str>, after: u64| EventQuery {
            viewer,
            run_id: run_id.map(str::to_owned),
            after,
            limit: 10,
        };
        let supervisor = Viewer {
            tenant: "system".into(),
            principal: "supervisor".into(),
        };
        let all = store
            .events(&read(supervisor.clone(), None, 0))
            .await
            .unwrap();
        let seen: Vec<(&str, &str)> = all
            .iter()
            .map(|e| (e.event.subject.as_str(), e.event.r#type.as_str()))
            .collect();
        assert_eq!(
            seen,
            [
                ("approvals/a", REQUESTED),
                ("approvals/g", REQUESTED),
                ("approvals/a", EXPIRED)
            ],
            "{}",
            s.label
        );
        assert!(
            all.windows(2).all(|w| w[0].position < w[1].position),
            "{}: positions grow in commit order",
            s.label
        );
        // acme's viewer sees a's events only; a run filter and a resume point narrow.
        let acme = store.events(&read(viewer(), None, 0)).await.unwrap();
        assert_eq!(acme.len(), 2, "{}", s.label);
        assert!(
            acme.iter().all(|e| e.event.tenant_id == "acme"),
            "{}",
            s.label
        );
        let run_2 = store
            .events(&read(supervisor.clone(), Some("run-2"), 0))
            .await
            .unwrap();
        assert_eq!(run_2, all[1..2], "{}", s.label);
        let after_first = store
            .events(&read(supervisor.clone(), None, all[0].position))
            .await
            .unwrap();
        assert_eq!(after_first, all[1..], "{}", s.label);
        let limited = EventQuery {
            limit: 1,
            ..read(supervisor.clone(), None, 0)
        };
        assert_eq!(
            store.events(&limited).await.unwrap(),
            all[..1],
            "{}",
            s.label
        );

        // Positions of events: only for viewers that may see them.
        let g_event = &all[1].event.id;
        assert_eq!(
            store.event_position(g_event, &supervisor).await.unwrap(),
            Some(all[1].position),
            "{}",
            s.label
        );
        assert_eq!(
            store.event_position(g_event, &viewer()).await.unwrap(),
            None,
            "{}",
            s.label
        );
        assert_eq!(
            store
                .event_position("no-such-event", &supervisor)
                .await
                .unwrap(),
            None,
            "{}",
            s.label
        );
    }
}

#[tokio::test]
async fn pending_expired_lists_pending_requests_past_expiry_soonest_first() {
    for s in subjects().await {
        let store = &*s.store;
        for (id, expires) in [("late", 900), ("early", 100), ("never", 5_000)] {
            let mut r = request(id, "oncall", id, 0);
            r.expires_at = t(expires);
            create(store, r).await.unwrap();
        }
        let mut approved = request("approved", "oncall", "approved", 0);
        approved.expires_at = t(50);
        approved.state = State::Approved;
        create(store, approved).await.unwrap();
        let ids = |v: Vec<Versioned>| -> Vec<String> {
            v.into_iter().map(|s| s.request.approval_id).collect()
        };
        assert!(
            store.pending_expired(t(99), 10).await.unwrap().is_empty(),
            "{}",
            s.label
        );
        assert_eq!(
            ids(store.pending_expired(t(900), 10).await.unwrap()),
            ["early", "late"],
            "{}: the expiry itself counts",
            s.label
        );
        assert_eq!(
            ids(store.pending_expired(t(10_000), 2).await.unwrap()),
            ["early", "late"],
            "{}",
            s.label
        );
    }
}
