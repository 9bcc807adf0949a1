//! The policy service's state in a database: the `PolicyState` contract on every store
//! (memory, a SQLite file, PostgreSQL when `CONVENE_TEST_POSTGRES_URL` names a server),
//! the decision log in the database, and counters and revocations that survive a
//! restart of the real service.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use crate::support::{Harness, SUPERVISOR, TestClock, policy_yaml, reason};
use convene_mesh::auth::request;
use convene_policy::decision_log::{AuthorizeRecord, DecisionLog, LogEntry, RevokeRecord};
use convene_policy::sql::{SqlDecisionLog, SqlPolicyState};
use convene_policy::state::{
    Call, CallError, Counted, DecisionOf, IssuedToken, MemoryState, PolicyState, RevokeTarget,
};
use convene_policy::{Config, DecisionLogTarget, PolicyService};
use convene_proto::v1::{self, AuthorizeReason, revoke_request::Target};
use convene_server::GrpcServer;
use convene_server::test_util::TestServer;
use convene_store::test_util::{TestDatabase, test_databases};

struct Subject {
    label: &'static str,
    state: Arc<dyn PolicyState>,
    _db: Option<TestDatabase>,
}

async fn subjects() -> Vec<Subject> {
    let mut all = vec![Subject {
        label: "memory",
        state: Arc::new(MemoryState::new()),
        _db: None,
    }];
    for t in test_databases().await {
        all.push(Subject {
            label: t.label,
            state: Arc::new(SqlPolicyState::new(t.db.clone())),
            _db: Some(t),
        });
    }
    all
}

fn at(secs: u64) -> SystemTime {
    SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000 + secs)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_calls_at_the_limit_are_counted_exactly() {
    for s in subjects().await {
        let tasks: Vec<_> = (0..64)
            .map(|_| {
                let state = s.state.clone();
                tokio::spawn(async move { state.record_call("t1", 40, at(100), at(1)).await })
            })
            .collect();
        let mut allowed = Vec::new();
        let mut refused = 0;
        for task in tasks {
            match task.await.unwrap() {
                Ok(n) => allowed.push(n),
                Err(CallError::LimitExceeded { used, max }) => {
                    assert_eq!((used, max), (40, 40), "{}", s.label);
                    refused += 1;
                }
                Err(e) => panic!("{}: {e}", s.label),
            }
        }
        allowed.sort_unstable();
        assert_eq!(allowed, (1..=40).collect::<Vec<_>>(), "{}", s.label);
        assert_eq!(refused, 24, "{}", s.label);
        assert_eq!(s.state.calls_used("t1").await.unwrap(), 40, "{}", s.label);
        assert_eq!(s.state.calls_used("other").await.unwrap(), 0, "{}", s.label);
        // A token without calls gets none.
        assert!(
            matches!(
                s.state.record_call("t0", 0, at(100), at(1)).await,
                Err(CallError::LimitExceeded { used: 0, max: 0 })
            ),
            "{}",
            s.label
        );
    }
}

#[tokio::test]
async fn revocations_keep_the_first_reason_and_the_token_wins() {
    for s in subjects().await {
        let state = &*s.state;
        assert_eq!(
            state.is_revoked("t1", "r1", 0).await.unwrap(),
            None,
            "{}",
            s.label
        );
        state.revoke_run("r1", "incident closed").await.unwrap();
        let r = state.is_revoked("t1", "r1", 0).await.unwrap().unwrap();
        assert_eq!(r.target, RevokeTarget::Run("r1".into()), "{}", s.label);
        assert_eq!(r.reason, "incident closed", "{}", s.label);
        state.revoke_token("t1", "leaked").await.unwrap();
        state.revoke_token("t1", "again").await.unwrap();
        let r = state.is_revoked("t1", "r1", 0).await.unwrap().unwrap();
        assert_eq!(r.target, RevokeTarget::Token("t1".into()), "{}", s.label);
        assert_eq!(r.reason, "leaked", "{}", s.label);
        assert_eq!(
            state.is_revoked("t2", "r2", 0).await.unwrap(),
            None,
            "{}",
            s.label
        );
        // A token id equal to a revoked run id is not revoked by it.
        assert_eq!(
            state.is_revoked("r1", "r9", 0).await.unwrap(),
            None,
            "{}",
            s.label
        );
    }
}

#[tokio::test]
async fn owners_are_known_for_issued_tokens_and_their_runs() {
    for s in subjects().await {
        let state = &*s.state;
        let issued = |token: &str, run: &str, tenant: &str| IssuedToken {
            token_id: token.into(),
            run_id: run.into(),
            tenant: tenant.into(),
            expires_at: at(100),
        };
        // Two tokens of one request, recorded together, then one of another.
        state
            .record_issued(&[issued("t1", "r1", "acme"), issued("t2", "r1", "acme")])
            .await
            .unwrap();
        state
            .record_issued(&[issued("t3", "r2", "globex")])
            .await
            .unwrap();
        let tenant = |t| async move { state.owner_tenant(&t).await.unwrap() };
        assert_eq!(
            tenant(RevokeTarget::Token("t2".into())).await.as_deref(),
            Some("acme"),
            "{}",
            s.label
        );
        assert_eq!(
            tenant(RevokeTarget::Run("r2".into())).await.as_deref(),
            Some("globex"),
            "{}",
            s.label
        );
        assert_eq!(
            tenant(RevokeTarget::Run("r3".into())).await,
            None,
            "{}",
            s.label
        );
        // A wide request, more tokens than one insert takes, recorded twice (a retry
        // records nothing new and fails nothing).
        let wide: Vec<IssuedToken> = (0..150)
            .map(|n| issued(&format!("w{n}"), "r4", "initech"))
            .collect();
        state.record_issued(&wide).await.unwrap();
        state.record_issued(&wide).await.unwrap();
        for token in ["w0", "w63", "w64", "w149"] {
            assert_eq!(
                tenant(RevokeTarget::Token(token.into())).await.as_deref(),
                Some("initech"),
                "{}: {token}",
                s.label
            );
        }
    }
}

#[tokio::test]
async fn expired_counters_and_owners_are_pruned() {
    for t in test_databases().await {
        let state = SqlPolicyState::new(t.db.clone());
        state.record_call("old", 5, at(10), at(1)).await.unwrap();
        state.record_call("new", 5, at(1000), at(1)).await.unwrap();
        for (token, expires) in [("old", at(10)), ("new", at(1000))] {
            state
                .record_issued(&[IssuedToken {
                    token_id: token.into(),
                    run_id: format!("run-{token}"),
                    tenant: "acme".into(),
                    expires_at: expires,
                }])
                .await
                .unwrap();
        }
        state.prune(at(500)).await.unwrap();
        assert_eq!(state.calls_used("old").await.unwrap(), 0, "{}", t.label);
        assert_eq!(state.calls_used("new").await.unwrap(), 1, "{}", t.label);
        assert_eq!(
            state
                .owner_tenant(&RevokeTarget::Token("old".into()))
                .await
                .unwrap(),
            None,
            "{}",
            t.label
        );
        assert_eq!(
            state
                .owner_tenant(&RevokeTarget::Run("run-new".into()))
                .await
                .unwrap()
                .as_deref(),
            Some("acme"),
            "{}",
            t.label
        );
    }
}

fn authorize_record(i: u32) -> LogEntry {
    LogEntry::Authorize(AuthorizeRecord {
        decision_id: format!("d{i}"),
        time: "2026-01-01T00:00:00.000Z".into(),
        token_id: format!("t{i}"),
        run_id: "r".into(),
        delegation_id: "del".into(),
        tenant: "acme".into(),
        principal: "p".into(),
        profile_id: "prof".into(),
        audience: "worker:prof".into(),
        tool: "search_logs@1".into(),
        action: "logs:read".into(),
        resource: "service/a".into(),
        tool_call_id: String::new(),
        allowed: i.is_multiple_of(2),
        reason: "AUTHORIZE_REASON_ALLOWED".into(),
        detail: "ok".into(),
        calls_used: i,
        lease_epoch: 0,
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_decisions_all_land_in_the_database_log() {
    for t in test_databases().await {
        let log = Arc::new(SqlDecisionLog::new(t.db.clone()));
        let tasks: Vec<_> = (0..100)
            .map(|i| {
                let log = log.clone();
                tokio::spawn(async move { log.append(authorize_record(i)).await })
            })
            .collect();
        for task in tasks {
            task.await.unwrap().unwrap();
        }
        let revoke = LogEntry::Revoke(RevokeRecord {
            decision_id: "d-revoke".into(),
            time: "2026-01-01T00:00:01.000Z".into(),
            principal: "supervisor".into(),
            target: "run".into(),
            id: "run-1".into(),
            reason: "done".into(),
        });
        log.append(revoke.clone()).await.unwrap();

        let entries = log.entries().await.unwrap();
        assert_eq!(entries.len(), 101, "{}", t.label);
        assert_eq!(entries.last(), Some(&revoke), "{}", t.label);
        let mut ids: Vec<u32> = entries
            .iter()
            .filter_map(|e| match e {
                LogEntry::Authorize(r) => Some(r.calls_used),
                LogEntry::Revoke(_) => None,
            })
            .collect();
        ids.sort_unstable();
        assert_eq!(ids, (0..100).collect::<Vec<_>>(), "{}", t.label);
        assert!(entries.contains(&authorize_record(7)), "{}", t.label);
    }
}

fn revoke_record(id: &str) -> LogEntry {
    LogEntry::Revoke(RevokeRecord {
        decision_id: format!("d-{id}"),
        time: "2026-01-01T00:00:01.000Z".into(),
        principal: "supervisor".into(),
        target: "run".into(),
        id: id.into(),
        reason: "done".into(),
    })
}

#[tokio::test]
async fn a_call_and_its_decision_commit_together_or_not_at_all() {
    for t in test_databases().await {
        let state = SqlPolicyState::new(t.db.clone());
        let log = SqlDecisionLog::new(t.db.clone());
        let call = Call {
            lease_epoch: 0,
            token_id: "t1",
            run_id: "r1",
            max_calls: 1,
            expires_at: at(100),
            now: at(1),
        };
        // The decision is made from the count: allowed, then refused at the limit.
        let decision: DecisionOf = Arc::new(|counted: &Counted| {
            let LogEntry::Authorize(mut r) = authorize_record(0) else {
                unreachable!()
            };
            (r.allowed, r.calls_used) = match *counted {
                Counted::Allowed { used } => (true, used),
                Counted::LimitExceeded { used, .. } | Counted::Revoked { used, .. } => {
                    (false, used)
                }
            };
            LogEntry::Authorize(r)
        });
        let first = state
            .record_call_logged(call, &log, decision.clone())
            .await
            .unwrap();
        assert_eq!(first, Counted::Allowed { used: 1 }, "{}", t.label);
        let second = state
            .record_call_logged(call, &log, decision.clone())
            .await
            .unwrap();
        assert_eq!(
            second,
            Counted::LimitExceeded { used: 1, max: 1 },
            "{}",
            t.label
        );
        let logged: Vec<(bool, u32)> = log
            .entries()
            .await
            .unwrap()
            .into_iter()
            .filter_map(|e| match e {
                LogEntry::Authorize(r) => Some((r.allowed, r.calls_used)),
                LogEntry::Revoke(_) => None,
            })
            .collect();
        assert_eq!(logged, [(true, 1), (false, 1)], "{}", t.label);

        state
            .revoke_logged(
                &RevokeTarget::Run("r".into()),
                "done",
                &log,
                revoke_record("r"),
            )
            .await
            .unwrap();
        assert!(
            state.is_revoked("t9", "r", 0).await.unwrap().is_some(),
            "{}",
            t.label
        );
        assert_eq!(log.entries().await.unwrap().len(), 3, "{}", t.label);

        // When the record cannot be written, the count and the revocation it came with
        // are rolled back: nothing is counted or revoked that the log does not show.
        t.db.execute(convene_store::sql("DROP TABLE decision_log"))
            .await
            .unwrap();
        let call = Call {
            token_id: "t2",
            ..call
        };
        let err = state
            .record_call_logged(call, &log, decision.clone())
            .await
            .unwrap_err();
        assert!(
            err.to_string().contains("decision_log"),
            "{}: {err}",
            t.label
        );
        assert_eq!(state.calls_used("t2").await.unwrap(), 0, "{}", t.label);
        let err = state
            .revoke_logged(
                &RevokeTarget::Token("t2".into()),
                "done",
                &log,
                revoke_record("t2"),
            )
            .await
            .unwrap_err();
        assert!(
            err.to_string().contains("decision_log"),
            "{}: {err}",
            t.label
        );
        assert_eq!(
            state.is_revoked("t2", "other", 0).await.unwrap(),
            None,
            "{}",
            t.label
        );
    }
}

#[tokio::test]
async fn several_revocations_commit_with_their_records_together_or_not_at_all() {
    for t in test_databases().await {
        let state = SqlPolicyState::new(t.db.clone());
        let log = SqlDecisionLog::new(t.db.clone());
        let runs = ["r1", "r2", "r3"];
        let revocations: Vec<(RevokeTarget, LogEntry)> = runs
            .iter()
            .map(|r| (RevokeTarget::Run((*r).into()), revoke_record(r)))
            .collect();
        state
            .revoke_all_logged(&revocations, "done", &log)
            .await
            .unwrap();
        for r in runs {
            let revoked = state.is_revoked("any-token", r, 0).await.unwrap();
            assert_eq!(
                revoked.map(|v| v.target),
                Some(RevokeTarget::Run(r.into())),
                "{}: {r}",
                t.label
            );
        }
        let logged: Vec<String> = log
            .entries()
            .await
            .unwrap()
            .into_iter()
            .filter_map(|e| match e {
                LogEntry::Revoke(r) => Some(r.id),
                LogEntry::Authorize(_) => None,
            })
            .collect();
        assert_eq!(logged, runs, "{}", t.label);

        // When the records cannot be written, none of the revocations stays.
        t.db.execute(convene_store::sql("DROP TABLE decision_log"))
            .await
            .unwrap();
        let revocations = vec![
            (RevokeTarget::Run("r4".into()), revoke_record("r4")),
            (RevokeTarget::Token("t5".into()), revoke_record("t5")),
        ];
        let err = state
            .revoke_all_logged(&revocations, "done", &log)
            .await
            .unwrap_err();
        assert!(
            err.to_string().contains("decision_log"),
            "{}: {err}",
            t.label
        );
        assert_eq!(
            state.is_revoked("t5", "r4", 0).await.unwrap(),
            None,
            "{}",
            t.label
        );
    }
}

#[tokio::test]
async fn tokens_of_a_revoked_run_or_parent_are_not_recorded() {
    for s in subjects().await {
        let state = &*s.state;
        let issued = |token: &str, run: &str| IssuedToken {
            token_id: token.into(),
            run_id: run.into(),
            tenant: "acme".into(),
            expires_at: at(100),
        };
        let owner = |id: &str| {
            let target = RevokeTarget::Token(id.to_owned());
            async move { state.owner_tenant(&target).await.unwrap() }
        };
        // Nothing revoked: recorded.
        let none = state
            .record_issued_unless_revoked(&[issued("t1", "r1"), issued("t2", "r1")], "", "r1", 0)
            .await
            .unwrap();
        assert_eq!(none, None, "{}", s.label);
        assert_eq!(owner("t2").await.as_deref(), Some("acme"), "{}", s.label);

        // The run revoked: refused with the run's revocation, nothing recorded.
        state.revoke_run("r1", "incident closed").await.unwrap();
        let refused = state
            .record_issued_unless_revoked(&[issued("t3", "r1")], "", "r1", 0)
            .await
            .unwrap()
            .expect("the run's revocation");
        assert_eq!(
            (refused.target, refused.reason.as_str()),
            (RevokeTarget::Run("r1".into()), "incident closed"),
            "{}",
            s.label
        );
        assert_eq!(owner("t3").await, None, "{}", s.label);

        // A child of a revoked parent token, in a run that is not revoked.
        state.revoke_token("p1", "leaked").await.unwrap();
        let refused = state
            .record_issued_unless_revoked(&[issued("c1", "r2")], "p1", "r2", 0)
            .await
            .unwrap()
            .expect("the parent's revocation");
        assert_eq!(
            refused.target,
            RevokeTarget::Token("p1".into()),
            "{}",
            s.label
        );
        assert_eq!(owner("c1").await, None, "{}", s.label);
        let none = state
            .record_issued_unless_revoked(&[issued("c2", "r2")], "p2", "r2", 0)
            .await
            .unwrap();
        assert_eq!(none, None, "{}", s.label);
        assert_eq!(owner("c2").await.as_deref(), Some("acme"), "{}", s.label);
    }
}

/// A replica that claimed a run (lease epoch 2) fences the epoch before it: the old
/// owner's tokens are refused and it is issued no more; the fence only moves up, and
/// verifiers elsewhere learn it with the revocations.
#[tokio::test]
async fn a_newer_lease_epoch_fences_the_older_ones_tokens() {
    for s in subjects().await {
        let state = &*s.state;
        let issued = |token: &str| IssuedToken {
            token_id: token.into(),
            run_id: "r1".into(),
            tenant: "acme".into(),
            expires_at: at(100),
        };
        let label = s.label;
        // The creating replica (epoch 1) fences nothing.
        let none = state
            .record_issued_unless_revoked(&[issued("t1")], "", "r1", 1)
            .await
            .unwrap();
        assert_eq!(none, None, "{label}");
        assert_eq!(
            state.is_revoked("t1", "r1", 1).await.unwrap(),
            None,
            "{label}"
        );
        let before = SystemTime::now() - Duration::from_secs(1);

        // The replica that took the run over asks for epoch 2.
        let none = state
            .record_issued_unless_revoked(&[issued("t2")], "", "r1", 2)
            .await
            .unwrap();
        assert_eq!(none, None, "{label}");
        let superseded = state
            .is_revoked("t1", "r1", 1)
            .await
            .unwrap()
            .expect("epoch 1 is fenced");
        assert_eq!(
            superseded.target,
            RevokeTarget::Lease {
                run_id: "r1".into(),
                epoch: 2
            },
            "{label}"
        );
        assert_eq!(
            state.is_revoked("t2", "r1", 2).await.unwrap(),
            None,
            "{label}"
        );
        // Another run is not touched.
        assert_eq!(
            state.is_revoked("t9", "r9", 1).await.unwrap(),
            None,
            "{label}"
        );

        // The old owner wakes and asks for more: refused, nothing recorded.
        let refused = state
            .record_issued_unless_revoked(&[issued("t3")], "", "r1", 1)
            .await
            .unwrap()
            .expect("the fence refuses epoch 1");
        assert!(
            matches!(refused.target, RevokeTarget::Lease { epoch: 2, .. }),
            "{label}: {refused:?}"
        );
        let target = RevokeTarget::Token("t3".to_owned());
        assert_eq!(state.owner_tenant(&target).await.unwrap(), None, "{label}");

        // A fence never moves down; a later claim moves it up.
        state.fence("r1", 1).await.unwrap();
        assert!(
            state.is_revoked("t1", "r1", 1).await.unwrap().is_some(),
            "{label}"
        );
        state.fence("r1", 3).await.unwrap();
        assert!(
            state.is_revoked("t2", "r1", 2).await.unwrap().is_some(),
            "{label}"
        );

        // Its counted calls are refused, not counted.
        let call = Call {
            token_id: "t2",
            run_id: "r1",
            lease_epoch: 2,
            max_calls: 5,
            expires_at: at(100),
            now: at(10),
        };
        let log = convene_policy::decision_log::MemoryDecisionLog::new();
        let counted = state
            .record_call_logged(call, &log, Arc::new(refusal_record))
            .await
            .unwrap();
        assert!(
            matches!(counted, Counted::Revoked { ref revocation, used: 0 } if matches!(revocation.target, RevokeTarget::Lease { epoch: 3, .. })),
            "{label}: {counted:?}"
        );

        // Verifiers elsewhere get the fence at its current epoch.
        let listed = state.revoked_since(before).await.unwrap();
        assert!(
            listed.iter().any(|(t, _)| *t
                == RevokeTarget::Lease {
                    run_id: "r1".into(),
                    epoch: 3
                }),
            "{label}: {listed:?}"
        );
    }
}

/// What a revoked call records: not allowed, the calls counted before, and which
/// revocation refused it.
fn refusal_record(counted: &Counted) -> LogEntry {
    let LogEntry::Authorize(mut r) = authorize_record(0) else {
        unreachable!()
    };
    (r.allowed, r.calls_used, r.detail) = match counted {
        Counted::Allowed { used } => (true, *used, String::new()),
        Counted::LimitExceeded { used, .. } => (false, *used, "limit".into()),
        Counted::Revoked { revocation, used } => (false, *used, revocation.target.to_string()),
    };
    LogEntry::Authorize(r)
}

/// A decision log of either kind, read back.
enum AnyLog {
    Memory(convene_policy::decision_log::MemoryDecisionLog),
    Sql(SqlDecisionLog),
}

impl AnyLog {
    fn log(&self) -> &dyn DecisionLog {
        match self {
            AnyLog::Memory(log) => log,
            AnyLog::Sql(log) => log,
        }
    }

    async fn entries(&self) -> Vec<LogEntry> {
        match self {
            AnyLog::Memory(log) => log.entries(),
            AnyLog::Sql(log) => log.entries().await.unwrap(),
        }
    }
}

type Pair = (
    &'static str,
    Arc<dyn PolicyState>,
    Arc<AnyLog>,
    Option<TestDatabase>,
);

#[tokio::test]
async fn a_revoked_token_or_run_is_refused_at_the_count_and_not_counted() {
    let mut pairs: Vec<Pair> = vec![(
        "memory",
        Arc::new(MemoryState::new()),
        Arc::new(AnyLog::Memory(
            convene_policy::decision_log::MemoryDecisionLog::new(),
        )),
        None,
    )];
    for t in test_databases().await {
        // The log in the state's database: the check, the count and the record are one
        // transaction.
        pairs.push((
            t.label,
            Arc::new(SqlPolicyState::new(t.db.clone())),
            Arc::new(AnyLog::Sql(SqlDecisionLog::new(t.db.clone()))),
            Some(t),
        ));
    }
    for (label, state, log, _db) in pairs {
        let decision: DecisionOf = Arc::new(refusal_record);
        let call = |token_id| Call {
            lease_epoch: 0,
            token_id,
            run_id: "r1",
            max_calls: 5,
            expires_at: at(100),
            now: at(1),
        };
        let count = |token_id| {
            let (state, log, decision) = (state.clone(), log.clone(), decision.clone());
            async move {
                state
                    .record_call_logged(call(token_id), log.log(), decision)
                    .await
                    .unwrap()
            }
        };
        assert_eq!(count("t1").await, Counted::Allowed { used: 1 }, "{label}");
        assert_eq!(count("t2").await, Counted::Allowed { used: 1 }, "{label}");

        state
            .revoke_logged(
                &RevokeTarget::Token("t1".into()),
                "leaked",
                log.log(),
                revoke_record("t1"),
            )
            .await
            .unwrap();
        let refused = count("t1").await;
        assert_eq!(
            refused,
            Counted::Revoked {
                revocation: convene_policy::state::Revocation {
                    target: RevokeTarget::Token("t1".into()),
                    reason: "leaked".into(),
                },
                used: 1,
            },
            "{label}"
        );
        assert_eq!(count("t2").await, Counted::Allowed { used: 2 }, "{label}");

        // The whole run: its other token is refused too, and the token's own
        // revocation still names the token.
        state
            .revoke_logged(
                &RevokeTarget::Run("r1".into()),
                "run closed",
                log.log(),
                revoke_record("r1"),
            )
            .await
            .unwrap();
        let Counted::Revoked { revocation, used } = count("t2").await else {
            panic!("{label}: a token of a revoked run was counted");
        };
        assert_eq!(
            (revocation.target, revocation.reason.as_str(), used),
            (RevokeTarget::Run("r1".into()), "run closed", 2),
            "{label}"
        );
        let Counted::Revoked { revocation, .. } = count("t1").await else {
            panic!("{label}: a revoked token was counted");
        };
        assert_eq!(
            revocation.target,
            RevokeTarget::Token("t1".into()),
            "{label}"
        );

        // Nothing refused was counted, and every refusal is in the log.
        assert_eq!(state.calls_used("t1").await.unwrap(), 1, "{label}");
        assert_eq!(state.calls_used("t2").await.unwrap(), 2, "{label}");
        let logged: Vec<(bool, u32, String)> = log
            .entries()
            .await
            .into_iter()
            .filter_map(|e| match e {
                LogEntry::Authorize(r) => Some((r.allowed, r.calls_used, r.detail)),
                LogEntry::Revoke(_) => None,
            })
            .collect();
        let expected = [
            (true, 1, ""),
            (true, 1, ""),
            (false, 1, "token t1"),
            (true, 2, ""),
            (false, 2, "run r1"),
            (false, 1, "token t1"),
        ]
        .map(|(a, u, d)| (a, u, d.to_owned()));
        assert_eq!(logged, expected, "{label}");
    }
}

#[tokio::test]
async fn a_log_elsewhere_gets_the_decision_after_the_count() {
    let state = MemoryState::new();
    let log = convene_policy::decision_log::MemoryDecisionLog::new();
    let call = Call {
        lease_epoch: 0,
        token_id: "t1",
        run_id: "r1",
        max_calls: 2,
        expires_at: at(100),
        now: at(1),
    };
    let decision: DecisionOf = Arc::new(|counted: &Counted| {
        let used = match *counted {
            Counted::Allowed { used }
            | Counted::LimitExceeded { used, .. }
            | Counted::Revoked { used, .. } => used,
        };
        authorize_record(used)
    });
    for expected in [1, 2] {
        assert_eq!(
            state
                .record_call_logged(call, &log, decision.clone())
                .await
                .unwrap(),
            Counted::Allowed { used: expected }
        );
    }
    assert_eq!(
        state
            .record_call_logged(call, &log, decision.clone())
            .await
            .unwrap(),
        Counted::LimitExceeded { used: 2, max: 2 }
    );
    assert_eq!(
        log.entries(),
        [
            authorize_record(1),
            authorize_record(2),
            authorize_record(2)
        ]
    );
}

/// The real policy service over `db`, its keys in `dir`, serving on a loopback port.
async fn serve(
    dir: tempfile::TempDir,
    clock: TestClock,
    t0: SystemTime,
    db: convene_store::Database,
) -> Harness {
    let file = dir.path().join("policy.yaml");
    std::fs::write(&file, policy_yaml("")).unwrap();
    let config = Config {
        common: convene_server::ServiceCommon {
            policy_file: Some(file),
            dev_credentials: false,
            ..Config::in_dir(dir.path()).common
        },
        decision_log: DecisionLogTarget::Database,
    };
    let service = PolicyService::open_with_database(&config, clock.clock(), Some(db))
        .expect("the service opens");
    let server = TestServer::start(service.add_to(GrpcServer::new(config.server.clone()))).await;
    Harness {
        dir,
        config,
        clock,
        service,
        server,
        t0,
    }
}

#[tokio::test]
async fn counters_and_revocations_survive_a_restart() {
    for t in test_databases().await {
        let clock = TestClock::new();
        let t0 = clock.now();
        let h = serve(
            tempfile::tempdir().unwrap(),
            clock.clone(),
            t0,
            t.db.clone(),
        )
        .await;
        let mut limited = h.logs_grant("del-1");
        limited.max_calls = 2;
        let limited = h.issue_one("run-a", limited).await;
        let revoked = h.issue_one("run-a", h.logs_grant("del-2")).await;
        let whole_run = h.issue_one("run-b", h.logs_grant("del-3")).await;
        for expected in 1..=2 {
            let answer = h.authorize(h.search_call(&limited.token)).await;
            assert!(answer.allowed, "{}: {}", t.label, answer.detail);
            assert_eq!(answer.calls_used, expected, "{}", t.label);
        }
        let mut client = h.client().await;
        for target in [
            Target::TokenId(revoked.token_id.clone()),
            Target::RunId("run-b".into()),
        ] {
            client
                .revoke(request(
                    v1::RevokeRequest {
                        target: Some(target),
                        reason: "rotated after the incident".into(),
                    },
                    SUPERVISOR,
                ))
                .await
                .unwrap();
        }
        drop(client);

        // Restart: the server stops, the process's pool goes, a new service opens the
        // same data directory over a new connection to the same database.
        let Harness {
            dir,
            server,
            service,
            ..
        } = h;
        server.stop().await.unwrap();
        drop(service);
        let url = t.db.url().to_owned();
        let reopened = convene_store::Database::connect(&url).await.unwrap();
        let h = serve(dir, clock, t0, reopened.clone()).await;

        let answer = h.authorize(h.search_call(&limited.token)).await;
        assert_eq!(
            reason(&answer),
            AuthorizeReason::CallLimitExceeded,
            "{}: a token at its limit stays there: {}",
            t.label,
            answer.detail
        );
        assert_eq!(answer.calls_used, 2, "{}", t.label);
        for (token, why) in [(&revoked.token, "token"), (&whole_run.token, "run")] {
            let answer = h.authorize(h.search_call(token)).await;
            assert_eq!(
                reason(&answer),
                AuthorizeReason::Revoked,
                "{}: the revoked {why} stays revoked: {}",
                t.label,
                answer.detail
            );
            assert!(
                answer.detail.contains("rotated after the incident"),
                "{}: {}",
                t.label,
                answer.detail
            );
        }
        // The decisions of both lives are in the database log.
        let entries = SqlDecisionLog::new(reopened).entries().await.unwrap();
        let (authorizations, revocations) = entries.iter().fold((0, 0), |(a, r), e| match e {
            LogEntry::Authorize(_) => (a + 1, r),
            LogEntry::Revoke(_) => (a, r + 1),
        });
        assert_eq!((authorizations, revocations), (5, 2), "{}", t.label);
    }
}
