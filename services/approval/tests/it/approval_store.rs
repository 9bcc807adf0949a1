//! The `ApprovalStore` contract on every store: in memory, a SQLite file, and PostgreSQL
//! when `CONVENE_TEST_POSTGRES_URL` names a server.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use convene_approval::model::{ApprovalRequest, Decision, Execution, ExecutionClaim, State, Vote};
use convene_approval::store::{
    ApprovalStore, Created, Cursor, ListQuery, StoreError, Versioned, Viewer,
};
use convene_approval::{MemoryStore, SqlApprovalStore};
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
        run_id: String::new(),
        rationale: "the rule's hit rate deviates".into(),
        created_at: t(created),
    }
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
        let Created::New(stored) = s.store.create(r.clone()).await.unwrap() else {
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
        s.store.update(1, r.clone()).await.unwrap();
        r.executing = None;
        r.state = State::Executed;
        r.execution = Some(Execution {
            executor: "record-only".into(),
            success: true,
            output: Struct::default(),
            executed_at: t(8),
            executed_by: "oncall@acme".into(),
        });
        s.store.update(2, r.clone()).await.unwrap();
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
        let first = store.create(request("a", "oncall", "k1", 0)).await.unwrap();
        assert!(
            matches!(first, Created::New(ref v) if v.version == 1),
            "{}",
            s.label
        );
        let again = store.create(request("b", "oncall", "k1", 1)).await.unwrap();
        let Created::Existing(existing) = again else {
            panic!("{}: the key is used: {again:?}", s.label);
        };
        assert_eq!(existing.request.approval_id, "a", "{}", s.label);
        let other = store
            .create(request("c", "analyst", "k1", 2))
            .await
            .unwrap();
        assert!(matches!(other, Created::New(_)), "{}", s.label);
        assert!(store.get("b").await.unwrap().is_none(), "{}", s.label);
        let err = store
            .create(request("a", "oncall", "k2", 3))
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
                    store
                        .create(request(
                            &format!("apr-{i}"),
                            "supervisor",
                            "run-1/rollback",
                            i,
                        ))
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
        store.create(request("a", "oncall", "k", 0)).await.unwrap();
        let mut changed = request("a", "oncall", "k", 0);
        changed.state = State::Rejected;
        let v2 = store.update(1, changed.clone()).await.unwrap();
        assert_eq!(v2.version, 2, "{}", s.label);
        let mut stale = request("a", "oncall", "k", 0);
        stale.state = State::Approved;
        let err = store.update(1, stale).await.unwrap_err();
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
        let err = store
            .update(1, request("zzz", "oncall", "k9", 0))
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
            store.create(r).await.unwrap();
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
