//! The service's events end to end, on a SQLite file and on PostgreSQL (when
//! `CONVENE_TEST_POSTGRES_URL` names a server): one event per change in commit order,
//! none for refused or repeated calls, the expiry sweep, CancelApproval, and WatchEvents
//! (resume, run filter, visibility, following, shutdown, other processes' commits,
//! reopening the database).

use std::sync::Arc;
use std::time::Duration;

use convene_approval::events::{CANCELLED, DECIDED, EXECUTED, EXPIRED, REQUESTED, SOURCE};
use convene_approval::model::State;
use convene_approval::{ApprovalStore, SqlApprovalStore, canonical::struct_from_json};
use convene_core::time::to_timestamp;
use convene_mesh::auth::request;
use convene_mesh::handles::{ApprovalHandle, GrpcApproval};
use convene_proto::json::from_struct;
use convene_proto::v1::{
    self, ApprovalState, ApprovalWatchEventsRequest, ApprovalWatchEventsResponse,
    CancelApprovalRequest, CloudEvent, RequestApprovalRequest, RiskLevel, VoteDecision,
};
use convene_store::Database;
use convene_store::test_util::{TestDatabase, test_databases};
use futures::StreamExt as _;
use serde_json::json;
use tonic::{Code, Status, Streaming};

use crate::support::{Harness, Options, assert_status, rollback, test_policy};

/// Longest a test waits for an event it expects on a following stream.
const PATIENCE: Duration = Duration::from_secs(30);

/// The service on a fresh database of each back end, with the store kept for checks.
struct Subject {
    h: Harness,
    store: Arc<SqlApprovalStore>,
    t: TestDatabase,
}

async fn subjects() -> Vec<Subject> {
    let mut all = Vec::new();
    for t in test_databases().await {
        all.push(on(t.db.clone(), t).await);
    }
    all
}

async fn on(db: Database, t: TestDatabase) -> Subject {
    let store = Arc::new(SqlApprovalStore::new(db));
    let h = Harness::start_with_options(Options {
        policy: Some(test_policy()),
        store: Some(store.clone()),
        ..Options::default()
    })
    .await;
    Subject { h, store, t }
}

/// The supervisor files a request for `requester`'s run `run_id`.
async fn file_for(
    h: &Harness,
    requester: &str,
    run_id: &str,
    key: &str,
    action: &str,
    expires_in: Option<Duration>,
) -> Result<v1::RequestApprovalResponse, Status> {
    let risk = if action == "rule:rollback" {
        RiskLevel::R3
    } else {
        RiskLevel::R2
    };
    let msg = RequestApprovalRequest {
        action: action.into(),
        parameters: Some(struct_from_json(&rollback()).unwrap()),
        risk_level: risk as i32,
        idempotency_key: key.into(),
        run_id: run_id.into(),
        on_behalf_of: requester.into(),
        expires_in: expires_in.map(|d| prost_types::Duration {
            seconds: i64::try_from(d.as_secs()).unwrap(),
            nanos: 0,
        }),
        ..Default::default()
    };
    h.client()
        .await
        .request_approval(request(msg, &h.credential("supervisor")))
        .await
        .map(tonic::Response::into_inner)
}

async fn filed(
    h: &Harness,
    requester: &str,
    run_id: &str,
    key: &str,
    action: &str,
) -> v1::ApprovalRequest {
    file_for(h, requester, run_id, key, action, None)
        .await
        .unwrap()
        .approval
        .unwrap()
}

async fn cancel(
    h: &Harness,
    who: &str,
    approval_id: &str,
    reason: &str,
) -> Result<v1::ApprovalRequest, Status> {
    let msg = CancelApprovalRequest {
        approval_id: approval_id.into(),
        reason: reason.into(),
    };
    h.client()
        .await
        .cancel_approval(request(msg, &h.credential(who)))
        .await
        .map(|r| r.into_inner().approval.expect("the approval"))
}

async fn open_watch(
    h: &Harness,
    who: &str,
    msg: ApprovalWatchEventsRequest,
) -> Result<Streaming<ApprovalWatchEventsResponse>, Status> {
    h.client()
        .await
        .watch_events(request(msg, &h.credential(who)))
        .await
        .map(tonic::Response::into_inner)
}

/// The backlog `who` sees (`follow` off).
async fn backlog(
    h: &Harness,
    who: &str,
    msg: ApprovalWatchEventsRequest,
) -> Result<Vec<CloudEvent>, Status> {
    let msg = ApprovalWatchEventsRequest {
        follow: false,
        ..msg
    };
    let mut stream = open_watch(h, who, msg).await?;
    let mut events = Vec::new();
    while let Some(item) = stream.next().await {
        events.push(item?.event.expect("an event"));
    }
    Ok(events)
}

async fn everything(h: &Harness, who: &str) -> Vec<CloudEvent> {
    backlog(h, who, ApprovalWatchEventsRequest::default())
        .await
        .unwrap()
}

/// The next item of a following stream.
async fn next(
    stream: &mut Streaming<ApprovalWatchEventsResponse>,
) -> Option<Result<ApprovalWatchEventsResponse, Status>> {
    tokio::time::timeout(PATIENCE, stream.next())
        .await
        .expect("the stream delivers within the test's patience")
}

async fn next_event(stream: &mut Streaming<ApprovalWatchEventsResponse>) -> CloudEvent {
    next(stream)
        .await
        .expect("the stream goes on")
        .expect("an event, not an error")
        .event
        .expect("an event")
}

fn types(events: &[CloudEvent]) -> Vec<&str> {
    events.iter().map(|e| e.r#type.as_str()).collect()
}

fn data(event: &CloudEvent) -> serde_json::Value {
    from_struct(event.data.as_ref().expect("data"))
}

#[tokio::test]
async fn every_change_writes_one_event_in_commit_order() {
    for Subject { h, t, .. } in subjects().await {
        let label = t.label;
        let start = h.clock.now();
        let a = filed(&h, "oncall@acme", "run-1", "a", "rule:rollback").await;
        // An idempotent repeat writes nothing.
        let repeat = file_for(&h, "oncall@acme", "run-1", "a", "rule:rollback", None)
            .await
            .unwrap();
        assert!(!repeat.created, "{label}");

        h.clock.advance(Duration::from_secs(10));
        let first_vote_at = h.clock.now();
        h.decide("alice@acme", &a, VoteDecision::Approve)
            .await
            .unwrap();
        // A repeated vote, a refused vote and a vote on stale parameters write nothing.
        h.decide("alice@acme", &a, VoteDecision::Approve)
            .await
            .unwrap();
        assert_status(
            h.decide("alice@acme", &a, VoteDecision::Reject).await,
            Code::FailedPrecondition,
            "cannot be changed",
        );
        assert_status(
            h.decide("oncall@acme", &a, VoteDecision::Approve).await,
            Code::PermissionDenied,
            "requester",
        );
        assert_status(
            h.decide_with_hash(
                "bob@acme",
                &a.approval_id,
                VoteDecision::Approve,
                "sha256:00",
            )
            .await,
            Code::FailedPrecondition,
            "parameters changed",
        );
        h.clock.advance(Duration::from_secs(10));
        h.decide("bob@acme", &a, VoteDecision::Approve)
            .await
            .unwrap();
        h.clock.advance(Duration::from_secs(10));
        let executed_at = h.clock.now();
        h.execute("alice@acme", &a).await.unwrap();
        // Executing again answers with the record and writes nothing.
        let again = h.execute("alice@acme", &a).await.unwrap();
        assert!(!again.executed_now, "{label}");

        let b = filed(&h, "oncall@acme", "run-2", "b", "traffic:shift").await;
        h.clock.advance(Duration::from_secs(10));
        let cancelled_at = h.clock.now();
        cancel(&h, "supervisor", &b.approval_id, "run cancelled")
            .await
            .unwrap();

        let events = everything(&h, "supervisor").await;
        assert_eq!(
            types(&events),
            [REQUESTED, DECIDED, DECIDED, EXECUTED, REQUESTED, CANCELLED],
            "{label}"
        );
        let mut ids: Vec<&str> = events.iter().map(|e| e.id.as_str()).collect();
        ids.sort_unstable();
        ids.dedup();
        assert_eq!(ids.len(), events.len(), "{label}: ids are unique");
        for e in &events {
            assert_eq!(e.source, SOURCE, "{label}");
            assert_eq!(e.spec_version, "1.0", "{label}");
            assert_eq!(e.data_content_type, "application/json", "{label}");
            assert_eq!(e.tenant_id, "acme-payments", "{label}");
            assert_eq!(
                uuid::Uuid::parse_str(&e.id).unwrap().get_version_num(),
                7,
                "{label}"
            );
            let d = data(e);
            for key in [
                "approvalId",
                "runId",
                "action",
                "riskLevel",
                "state",
                "parametersHash",
            ] {
                assert!(d.get(key).is_some(), "{label}: {key} missing in {d}");
            }
            assert_eq!(
                e.subject,
                format!("approvals/{}", d["approvalId"].as_str().unwrap()),
                "{label}"
            );
            assert_eq!(e.correlation_id, d["runId"], "{label}");
        }
        let requested = data(&events[0]);
        assert_eq!(requested["approvalId"], a.approval_id.as_str(), "{label}");
        assert_eq!(requested["runId"], "run-1", "{label}");
        assert_eq!(requested["action"], "rule:rollback", "{label}");
        assert_eq!(requested["riskLevel"], "R3", "{label}");
        assert_eq!(requested["state"], "PENDING", "{label}");
        assert_eq!(
            requested["parametersHash"],
            a.parameters_hash.as_str(),
            "{label}"
        );
        assert_eq!(requested["requester"], "oncall@acme", "{label}");
        assert_eq!(requested["filedBy"], "supervisor", "{label}");
        assert_eq!(events[0].time, Some(to_timestamp(start)), "{label}");

        let first = data(&events[1]);
        assert_eq!(
            (&first["approver"], &first["decision"], &first["state"]),
            (&json!("alice@acme"), &json!("APPROVE"), &json!("PENDING")),
            "{label}"
        );
        assert_eq!(events[1].time, Some(to_timestamp(first_vote_at)), "{label}");
        let second = data(&events[2]);
        assert_eq!(
            (&second["approver"], &second["state"]),
            (&json!("bob@acme"), &json!("APPROVED")),
            "{label}"
        );
        let executed = data(&events[3]);
        assert_eq!(
            (
                &executed["executor"],
                &executed["success"],
                &executed["executedBy"],
                &executed["state"]
            ),
            (
                &json!("counting"),
                &json!(true),
                &json!("alice@acme"),
                &json!("EXECUTED")
            ),
            "{label}"
        );
        assert_eq!(events[3].time, Some(to_timestamp(executed_at)), "{label}");
        let cancelled = data(&events[5]);
        assert_eq!(
            (
                &cancelled["approvalId"],
                &cancelled["cancelledBy"],
                &cancelled["reason"],
                &cancelled["state"]
            ),
            (
                &json!(b.approval_id),
                &json!("supervisor"),
                &json!("run cancelled"),
                &json!("CANCELLED")
            ),
            "{label}"
        );
        assert_eq!(events[5].correlation_id, "run-2", "{label}");
        assert_eq!(events[5].time, Some(to_timestamp(cancelled_at)), "{label}");

        // The tenant's people see the same events as the supervisor that filed them.
        assert_eq!(everything(&h, "alice@acme").await, events, "{label}");
    }
}

#[tokio::test]
async fn the_expiry_sweep_records_each_expiry_once() {
    for Subject { h, store, t } in subjects().await {
        let label = t.label;
        let soon = file_for(
            &h,
            "oncall@acme",
            "run-1",
            "soon",
            "traffic:shift",
            Some(Duration::from_secs(60)),
        )
        .await
        .unwrap()
        .approval
        .unwrap();
        let later = file_for(
            &h,
            "oncall@acme",
            "run-1",
            "later",
            "traffic:shift",
            Some(Duration::from_secs(600)),
        )
        .await
        .unwrap()
        .approval
        .unwrap();
        assert_eq!(h.service.sweep_expired().await.unwrap(), 0, "{label}");

        h.clock.advance(Duration::from_secs(60));
        // Reads see the expiry before anything records it.
        let seen = h.get("alice@acme", &soon.approval_id).await.unwrap();
        assert_eq!(seen.state, ApprovalState::Expired as i32, "{label}");
        let stored = store.get(&soon.approval_id).await.unwrap().unwrap();
        assert_eq!(stored.request.state, State::Pending, "{label}");

        let expired_at = h.clock.now();
        assert_eq!(h.service.sweep_expired().await.unwrap(), 1, "{label}");
        assert_eq!(h.service.sweep_expired().await.unwrap(), 0, "{label}");
        let stored = store.get(&soon.approval_id).await.unwrap().unwrap();
        assert_eq!(stored.request.state, State::Expired, "{label}");
        let stored = store.get(&later.approval_id).await.unwrap().unwrap();
        assert_eq!(stored.request.state, State::Pending, "{label}");

        // A vote after the expiry is refused and records nothing more.
        assert_status(
            h.decide("alice@acme", &soon, VoteDecision::Approve).await,
            Code::FailedPrecondition,
            "expired",
        );
        let events = everything(&h, "supervisor").await;
        assert_eq!(types(&events), [REQUESTED, REQUESTED, EXPIRED], "{label}");
        let expired = data(&events[2]);
        assert_eq!(expired["approvalId"], soon.approval_id.as_str(), "{label}");
        assert_eq!(expired["state"], "EXPIRED", "{label}");
        assert_eq!(events[2].time, Some(to_timestamp(expired_at)), "{label}");

        // A vote on a request past expiry that no sweep saw yet records the expiry too,
        // once.
        h.clock.advance(Duration::from_secs(600));
        assert_status(
            h.decide("alice@acme", &later, VoteDecision::Approve).await,
            Code::FailedPrecondition,
            "expired",
        );
        assert_eq!(h.service.sweep_expired().await.unwrap(), 0, "{label}");
        let events = everything(&h, "supervisor").await;
        assert_eq!(
            types(&events),
            [REQUESTED, REQUESTED, EXPIRED, EXPIRED],
            "{label}"
        );
    }
}

#[tokio::test]
async fn the_filer_or_the_requester_cancels_once_and_nothing_runs_after() {
    for Subject { h, t, .. } in subjects().await {
        let label = t.label;
        // The supervisor filed it: the supervisor may cancel it.
        let by_filer = filed(&h, "oncall@acme", "run-1", "a", "rule:rollback").await;
        let cancelled = cancel(&h, "supervisor", &by_filer.approval_id, "run cancelled")
            .await
            .unwrap();
        assert_eq!(cancelled.state, ApprovalState::Cancelled as i32, "{label}");
        let record = cancelled.cancellation.clone().expect("the cancellation");
        assert_eq!(
            (record.cancelled_by.as_str(), record.reason.as_str()),
            ("supervisor", "run cancelled"),
            "{label}"
        );
        assert_eq!(
            record.cancelled_at,
            Some(to_timestamp(h.clock.now())),
            "{label}"
        );
        // Again: unchanged, whoever asks and whatever they say.
        h.clock.advance(Duration::from_secs(5));
        let again = cancel(&h, "oncall@acme", &by_filer.approval_id, "other reason")
            .await
            .unwrap();
        assert_eq!(again, cancelled, "{label}");
        assert_eq!(
            h.get("alice@acme", &by_filer.approval_id).await.unwrap(),
            cancelled,
            "{label}"
        );

        // The requester may cancel an approved request.
        let approved = filed(&h, "oncall@acme", "run-1", "b", "traffic:shift").await;
        h.decide("alice@acme", &approved, VoteDecision::Approve)
            .await
            .unwrap();
        let cancelled = cancel(&h, "oncall@acme", &approved.approval_id, "")
            .await
            .unwrap();
        assert_eq!(cancelled.state, ApprovalState::Cancelled as i32, "{label}");

        // Nothing is decided or executed after a cancellation.
        assert_status(
            h.decide("bob@acme", &by_filer, VoteDecision::Approve).await,
            Code::FailedPrecondition,
            "cancelled by supervisor (run cancelled)",
        );
        assert_status(
            h.execute("alice@acme", &approved).await,
            Code::FailedPrecondition,
            "CANCELLED by oncall@acme",
        );
        assert_eq!(
            h.executor.calls.load(std::sync::atomic::Ordering::SeqCst),
            0,
            "{label}"
        );

        // Anyone else: refused, or not even shown the request.
        let other = filed(&h, "oncall@acme", "run-1", "c", "traffic:shift").await;
        assert_status(
            cancel(&h, "alice@acme", &other.approval_id, "").await,
            Code::PermissionDenied,
            "only the principal that filed",
        );
        assert_status(
            cancel(&h, "analyst@globex", &other.approval_id, "").await,
            Code::NotFound,
            "not found",
        );
        assert_status(
            cancel(&h, "supervisor", "", "").await,
            Code::InvalidArgument,
            "approval_id",
        );

        // An executed request stays executed.
        h.decide("alice@acme", &other, VoteDecision::Approve)
            .await
            .unwrap();
        h.execute("alice@acme", &other).await.unwrap();
        assert_status(
            cancel(&h, "supervisor", &other.approval_id, "too late").await,
            Code::FailedPrecondition,
            "is EXECUTED and can no longer be cancelled",
        );

        let events = everything(&h, "supervisor").await;
        assert_eq!(
            types(&events),
            [
                REQUESTED, CANCELLED, REQUESTED, DECIDED, CANCELLED, REQUESTED, DECIDED, EXECUTED
            ],
            "{label}"
        );
    }
}

#[tokio::test]
async fn watch_resumes_filters_by_run_and_shows_only_what_the_caller_may_see() {
    for Subject { h, t, .. } in subjects().await {
        let label = t.label;
        let one = filed(&h, "oncall@acme", "run-1", "a", "traffic:shift").await;
        let two = filed(&h, "oncall@acme", "run-2", "b", "traffic:shift").await;
        h.decide("alice@acme", &one, VoteDecision::Approve)
            .await
            .unwrap();
        let all = everything(&h, "alice@acme").await;
        assert_eq!(types(&all), [REQUESTED, REQUESTED, DECIDED], "{label}");

        // Another tenant sees none of it, with or without a run filter.
        assert!(everything(&h, "analyst@globex").await.is_empty(), "{label}");
        let foreign = backlog(
            &h,
            "approver@globex",
            ApprovalWatchEventsRequest {
                run_id: "run-1".into(),
                ..Default::default()
            },
        )
        .await
        .unwrap();
        assert!(foreign.is_empty(), "{label}");

        // A request filed for the other tenant: its people and the filer see it, acme
        // does not.
        filed(&h, "analyst@globex", "run-3", "c", "traffic:shift").await;
        let globex = everything(&h, "approver@globex").await;
        assert_eq!(types(&globex), [REQUESTED], "{label}");
        assert_eq!(globex[0].correlation_id, "run-3", "{label}");
        assert_eq!(everything(&h, "alice@acme").await, all, "{label}");
        assert_eq!(everything(&h, "supervisor").await.len(), 4, "{label}");

        // The run filter.
        let run_2 = backlog(
            &h,
            "alice@acme",
            ApprovalWatchEventsRequest {
                run_id: "run-2".into(),
                ..Default::default()
            },
        )
        .await
        .unwrap();
        assert_eq!(run_2, all[1..2], "{label}");
        assert_eq!(
            data(&run_2[0])["approvalId"],
            two.approval_id.as_str(),
            "{label}"
        );

        // Resuming strictly after an event.
        let rest = backlog(
            &h,
            "alice@acme",
            ApprovalWatchEventsRequest {
                after_event_id: all[0].id.clone(),
                ..Default::default()
            },
        )
        .await
        .unwrap();
        assert_eq!(rest, all[1..], "{label}");
        let none = backlog(
            &h,
            "alice@acme",
            ApprovalWatchEventsRequest {
                after_event_id: all[2].id.clone(),
                ..Default::default()
            },
        )
        .await
        .unwrap();
        assert!(none.is_empty(), "{label}");
        // Unknown ids, and ids of events the caller may not see, are refused alike.
        for unknown in ["no-such-event", all[0].id.as_str()] {
            assert_status(
                backlog(
                    &h,
                    "analyst@globex",
                    ApprovalWatchEventsRequest {
                        after_event_id: unknown.into(),
                        ..Default::default()
                    },
                )
                .await,
                Code::InvalidArgument,
                "after_event_id",
            );
        }
    }
}

#[tokio::test]
async fn a_following_watch_sees_later_commits_and_ends_at_shutdown() {
    for Subject { h, t, .. } in subjects().await {
        let label = t.label;
        let a = filed(&h, "oncall@acme", "run-1", "a", "traffic:shift").await;
        let mut all = open_watch(
            &h,
            "supervisor",
            ApprovalWatchEventsRequest {
                follow: true,
                ..Default::default()
            },
        )
        .await
        .unwrap();
        let mut run_2 = open_watch(
            &h,
            "alice@acme",
            ApprovalWatchEventsRequest {
                follow: true,
                run_id: "run-2".into(),
                ..Default::default()
            },
        )
        .await
        .unwrap();
        let mut foreign = open_watch(
            &h,
            "approver@globex",
            ApprovalWatchEventsRequest {
                follow: true,
                ..Default::default()
            },
        )
        .await
        .unwrap();
        assert_eq!(next_event(&mut all).await.r#type, REQUESTED, "{label}");

        h.decide("alice@acme", &a, VoteDecision::Approve)
            .await
            .unwrap();
        let decided = next_event(&mut all).await;
        assert_eq!(decided.r#type, DECIDED, "{label}");
        let b = filed(&h, "oncall@acme", "run-2", "b", "traffic:shift").await;
        let requested = next_event(&mut all).await;
        assert_eq!(
            data(&requested)["approvalId"],
            b.approval_id.as_str(),
            "{label}"
        );
        // The run-filtered stream skipped run-1's events.
        assert_eq!(next_event(&mut run_2).await, requested, "{label}");

        // At shutdown, following streams end with UNAVAILABLE, saying how to resume;
        // the other tenant's stream saw nothing before that.
        h.shutdown.trigger();
        for stream in [&mut all, &mut run_2, &mut foreign] {
            let end = next(stream).await.expect("an UNAVAILABLE status");
            let status = end.expect_err("the stream ends with a status");
            assert_eq!(status.code(), Code::Unavailable, "{label}: {status:?}");
            assert!(
                status.message().contains("after_event_id"),
                "{label}: {status:?}"
            );
        }
    }
}

#[tokio::test]
async fn a_following_watch_sees_commits_of_another_process_sharing_the_database() {
    for Subject { h, t, .. } in subjects().await {
        let label = t.label;
        // A second service over its own handle on the same database: its commits do not
        // wake this service's watchers, only the poll finds them.
        let other_db = Database::connect(t.db.url())
            .await
            .expect("a second handle on the test database");
        let other = on_handle(other_db).await;
        let mut stream = open_watch(
            &h,
            "supervisor",
            ApprovalWatchEventsRequest {
                follow: true,
                ..Default::default()
            },
        )
        .await
        .unwrap();
        let a = filed(&other, "oncall@acme", "run-1", "a", "traffic:shift").await;
        let seen = next_event(&mut stream).await;
        assert_eq!(seen.r#type, REQUESTED, "{label}");
        assert_eq!(data(&seen)["approvalId"], a.approval_id.as_str(), "{label}");
    }
}

async fn on_handle(db: Database) -> Harness {
    Harness::start_with_options(Options {
        policy: Some(test_policy()),
        store: Some(Arc::new(SqlApprovalStore::new(db))),
        ..Options::default()
    })
    .await
}

#[tokio::test]
async fn events_survive_reopening_the_database_file() {
    let dir = tempfile::tempdir().unwrap();
    let url = convene_store::sqlite_url(&dir.path().join("approval.db"));
    let db = Database::connect(&url).await.unwrap();
    let h = on_handle(db.clone()).await;
    let a = filed(&h, "oncall@acme", "run-1", "a", "traffic:shift").await;
    h.decide("alice@acme", &a, VoteDecision::Approve)
        .await
        .unwrap();
    let before = everything(&h, "supervisor").await;
    assert_eq!(types(&before), [REQUESTED, DECIDED]);
    drop(h);
    db.close().await;

    let db = Database::connect(&url).await.unwrap();
    let h = on_handle(db).await;
    assert_eq!(everything(&h, "supervisor").await, before);
    // New events follow the old ones, and resuming after the last old one finds them.
    h.execute("alice@acme", &a).await.unwrap();
    let after = backlog(
        &h,
        "supervisor",
        ApprovalWatchEventsRequest {
            after_event_id: before[1].id.clone(),
            ..Default::default()
        },
    )
    .await
    .unwrap();
    assert_eq!(types(&after), [EXECUTED]);
}

#[tokio::test]
async fn the_sweep_runs_in_the_background_once_the_service_serves() {
    let h = Harness::start_with_options(Options {
        policy: Some(test_policy()),
        sweep_interval: Duration::from_millis(20),
        ..Options::default()
    })
    .await;
    let a = file_for(
        &h,
        "oncall@acme",
        "run-1",
        "a",
        "traffic:shift",
        Some(Duration::from_secs(60)),
    )
    .await
    .unwrap()
    .approval
    .unwrap();
    let mut stream = open_watch(
        &h,
        "alice@acme",
        ApprovalWatchEventsRequest {
            follow: true,
            ..Default::default()
        },
    )
    .await
    .unwrap();
    assert_eq!(next_event(&mut stream).await.r#type, REQUESTED);
    h.clock.advance(Duration::from_secs(61));
    let expired = next_event(&mut stream).await;
    assert_eq!(expired.r#type, EXPIRED);
    assert_eq!(data(&expired)["approvalId"], a.approval_id.as_str());
}

#[tokio::test]
async fn cancel_and_watch_work_through_both_handles() {
    let h = Harness::start_with_test_policy().await;
    let grpc: ApprovalHandle = Arc::new(GrpcApproval::new(h.server.channel().await));
    let in_process: ApprovalHandle = h.service.clone();
    for (key, handle) in [("grpc", grpc), ("in-process", in_process)] {
        let a = filed(&h, "oncall@acme", key, key, "traffic:shift").await;
        let cancelled = handle
            .cancel_approval(request(
                CancelApprovalRequest {
                    approval_id: a.approval_id.clone(),
                    reason: key.into(),
                },
                &h.credential("supervisor"),
            ))
            .await
            .unwrap()
            .into_inner()
            .approval
            .unwrap();
        assert_eq!(cancelled.state, ApprovalState::Cancelled as i32, "{key}");
        let mut stream = handle
            .watch_events(request(
                ApprovalWatchEventsRequest {
                    run_id: key.into(),
                    follow: false,
                    ..Default::default()
                },
                &h.credential("supervisor"),
            ))
            .await
            .unwrap()
            .into_inner();
        let mut seen = Vec::new();
        while let Some(item) = stream.next().await {
            seen.push(item.unwrap().event.unwrap());
        }
        assert_eq!(types(&seen), [REQUESTED, CANCELLED], "{key}");
        assert_eq!(data(&seen[1])["reason"], key, "{key}");
    }
}
