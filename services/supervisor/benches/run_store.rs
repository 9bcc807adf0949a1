//! The run's storage transactions through `SqlRunStore`, on a SQLite file (WAL,
//! synchronous = FULL) and, when `CONVENE_BENCH_POSTGRES_URL` names a server, on a fresh
//! PostgreSQL database created there (and dropped afterwards):
//!
//! - `create`: a new run of three delegations with its `run.started` events, leased to
//!   the replica (one transaction);
//! - `commit`: one change of a run with a delegation result and its events;
//! - `lifecycle`: what one three-delegation run writes from start to end (create,
//!   dispatch, three results, decision), one run at a time;
//! - `lifecycle_x64`: 64 such runs at once, as 64 run actors write them.
//!
//! `cargo bench -p convene-supervisor --bench run_store`

use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use convene_core::time::to_timestamp;
use convene_proto::v1::{self, run_event::Kind};
use convene_store::Database;
use convene_supervisor::SqlRunStore;
use convene_supervisor::events;
use convene_supervisor::store::{Events, RunStore};
use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use tokio::runtime::Runtime;

/// The variable naming a PostgreSQL server to bench on as well, e.g.
/// `postgres://postgres@127.0.0.1:5432/postgres`.
const POSTGRES_ENV: &str = "CONVENE_BENCH_POSTGRES_URL";

/// Runs written at once by `lifecycle_x64`.
const CONCURRENT: usize = 64;

/// A database to bench on, with what keeps it alive.
struct Backend {
    label: &'static str,
    db: Database,
    _sqlite: Option<convene_store::test_util::TestDatabase>,
    _postgres: Option<convene_store::test_util::TestPostgres>,
}

async fn backends() -> Vec<Backend> {
    let sqlite = convene_store::test_util::sqlite().await;
    let mut all = vec![Backend {
        label: "sqlite",
        db: sqlite.db.clone(),
        _sqlite: Some(sqlite),
        _postgres: None,
    }];
    if let Some(server) = std::env::var(POSTGRES_ENV)
        .ok()
        .filter(|v| !v.trim().is_empty())
    {
        let created = convene_store::test_util::TestPostgres::create(&server)
            .await
            .unwrap_or_else(|e| panic!("{POSTGRES_ENV}: cannot create a database: {e}"));
        let db = Database::connect(created.url())
            .await
            .expect("the fresh PostgreSQL database opens");
        all.push(Backend {
            label: "postgres",
            db,
            _sqlite: None,
            _postgres: Some(created),
        });
    }
    all
}

fn task(run_id: &str, i: usize) -> v1::DelegationTask {
    let now = SystemTime::now();
    v1::DelegationTask {
        delegation_id: format!("del-{:024x}", rand_id() ^ i as u128),
        run_id: run_id.to_owned(),
        depth: 1,
        profile_id: "logs-investigator".into(),
        goal: "Quantify the failed payment confirmations and find when they began".into(),
        scope: Some(v1::TaskScope {
            resources: vec!["service/payment-api".into()],
            time_range: Some(v1::TimeRange {
                start: Some(to_timestamp(now - Duration::from_secs(3600))),
                end: Some(to_timestamp(now)),
            }),
        }),
        allowed_tools: vec!["search_logs@1".into()],
        allowed_evidence_prefixes: vec!["logs://".into()],
        required_scopes: vec![v1::PermissionScope {
            action: "logs:read".into(),
            resource: "service/*".into(),
            data_scope: None,
        }],
        deadline: Some(to_timestamp(now + Duration::from_secs(600))),
        name: format!("d{i}"),
        ..Default::default()
    }
}

fn rand_id() -> u128 {
    uuid::Uuid::new_v4().as_u128()
}

/// A fresh run of three pending delegations, as StartRun stores it.
fn new_run() -> v1::Run {
    let run_id = uuid::Uuid::now_v7().to_string();
    let now = to_timestamp(SystemTime::now());
    v1::Run {
        delegations: (0..3)
            .map(|i| v1::Delegation {
                task: Some(task(&run_id, i)),
                state: v1::DelegationState::Pending as i32,
                ..Default::default()
            })
            .collect(),
        spec: Some(v1::RunSpec {
            goal: "Why did payment confirmations fail at 02:02?".into(),
            ..Default::default()
        }),
        run_id,
        tenant: "acme-payments".into(),
        principal: "oncall@acme".into(),
        state: v1::RunState::Running as i32,
        version: 1,
        trace_id: "0af7651916cd43dd8448eb211c80319c".into(),
        created_at: Some(now),
        updated_at: Some(now),
        ..Default::default()
    }
}

/// A worker's result for delegation `i`: one claim citing one piece of evidence.
fn result(run: &v1::Run, i: usize) -> v1::TaskResult {
    let task = run.delegations[i].task.clone().unwrap_or_default();
    let evidence_id = format!("logs://payment-api/{}/s1", task.delegation_id);
    v1::TaskResult {
        delegation_id: task.delegation_id,
        worker_id: "worker-1".into(),
        profile_id: task.profile_id,
        profile_version: "1.0.0".into(),
        status: v1::TaskStatus::Completed as i32,
        summary: "1,204 of 9,881 payment_confirm calls timed out".into(),
        claims: vec![v1::Claim {
            claim_id: "claim-log-impact".into(),
            topic: "impact.payment_confirm_failures".into(),
            value: "1204/9881".into(),
            statement: "1204 of 9881 payment_confirm calls between 01:45 and 02:10 UTC timed out"
                .into(),
            evidence_refs: vec![evidence_id.clone()],
            confidence: 0.9,
        }],
        evidence: vec![v1::Evidence {
            evidence_id,
            kind: "impact_metric".into(),
            source: "logs.payment-api".into(),
            artifact_uri: format!("artifact://acme-payments/{:064x}", rand_id()),
            content_hash: format!("sha256:{:064x}", rand_id()),
            ..Default::default()
        }],
        ..Default::default()
    }
}

/// A run one version on, with the run events and CloudEvents of the change.
struct Change {
    run: v1::Run,
    events: Events,
}

fn run_event(run: &v1::Run, sequence: u64, kind: Kind) -> v1::RunEvent {
    v1::RunEvent {
        sequence,
        run_id: run.run_id.clone(),
        time: Some(to_timestamp(SystemTime::now())),
        kind: Some(kind),
    }
}

fn started(run: &v1::Run) -> Events {
    Events {
        run: vec![run_event(run, 1, Kind::Started(run.clone()))],
        cloud: vec![events::cloud(
            events::RUN_STARTED,
            run,
            None,
            SystemTime::now(),
            events::run_started_data(run),
        )],
        ..Default::default()
    }
}

fn next(run: &v1::Run) -> v1::Run {
    v1::Run {
        version: run.version + 1,
        updated_at: Some(to_timestamp(SystemTime::now())),
        ..run.clone()
    }
}

/// Every delegation dispatched.
fn dispatched(run: &v1::Run, sequence: u64) -> Change {
    let mut run = next(run);
    let mut events = Events::default();
    for (i, d) in run.delegations.iter_mut().enumerate() {
        d.state = v1::DelegationState::Dispatched as i32;
        d.worker_id = "worker-1".into();
        d.attempts = 1;
        let task = d.task.clone().unwrap_or_default();
        events.run.push(v1::RunEvent {
            sequence: sequence + i as u64,
            run_id: task.run_id.clone(),
            time: Some(to_timestamp(SystemTime::now())),
            kind: Some(Kind::Dispatched(v1::DelegationDispatched {
                delegation_id: task.delegation_id,
                name: task.name,
                profile_id: task.profile_id,
                worker_id: "worker-1".into(),
                attempt: 1,
                depth: 1,
            })),
        });
    }
    Change { run, events }
}

/// Delegation `i`'s result arrived.
fn completed(run: &v1::Run, i: usize, sequence: u64) -> Change {
    let mut run = next(run);
    let result = result(&run, i);
    let d = &mut run.delegations[i];
    d.state = v1::DelegationState::Completed as i32;
    d.result = Some(result.clone());
    d.completed_at = Some(to_timestamp(SystemTime::now()));
    run.received.push(result);
    let d = run.delegations[i].clone();
    let task = d.task.clone().unwrap_or_default();
    let events = Events {
        run: vec![run_event(
            &run,
            sequence,
            Kind::Completed(v1::DelegationCompleted {
                delegation_id: task.delegation_id,
                name: task.name,
                state: d.state,
                status: v1::TaskStatus::Completed as i32,
                summary: "done".into(),
                ..Default::default()
            }),
        )],
        cloud: vec![events::cloud(
            events::DELEGATION_COMPLETED,
            &run,
            Some("delegations"),
            SystemTime::now(),
            events::delegation_completed_data(&run, &d, false),
        )],
        ..Default::default()
    };
    Change { run, events }
}

/// The join decided and the run ended.
fn decided(run: &v1::Run, sequence: u64) -> Change {
    let mut run = next(run);
    let decision = v1::JoinDecision {
        revision: 1,
        outcome: v1::JoinOutcome::Complete as i32,
        accepted: run
            .delegations
            .iter()
            .filter_map(|d| d.task.as_ref().map(|t| t.delegation_id.clone()))
            .collect(),
        ..Default::default()
    };
    run.decision = Some(decision.clone());
    run.outcome = decision.outcome;
    run.state = v1::RunState::Succeeded as i32;
    let now = SystemTime::now();
    let events = Events {
        run: vec![
            run_event(&run, sequence, Kind::Decision(decision.clone())),
            run_event(
                &run,
                sequence + 1,
                Kind::Terminal(v1::RunTerminal {
                    state: run.state,
                    outcome: run.outcome,
                    reason: "the join decided COMPLETE".into(),
                }),
            ),
        ],
        cloud: vec![
            events::cloud(
                events::JOIN_DECIDED,
                &run,
                None,
                now,
                events::join_decided_data(&run, &decision),
            ),
            events::cloud(
                events::RUN_COMPLETED,
                &run,
                None,
                now,
                events::run_completed_data(&run),
            ),
        ],
        ..Default::default()
    };
    Change { run, events }
}

/// One run from start to end: create, then five commits.
async fn lifecycle(store: &SqlRunStore) {
    let run = new_run();
    store
        .create(&run, None, &started(&run))
        .await
        .expect("created");
    let mut change = dispatched(&run, 2);
    store
        .commit(&change.run, &change.events)
        .await
        .expect("committed");
    let mut sequence = 5;
    for i in 0..3 {
        change = completed(&change.run, i, sequence);
        sequence += 1;
        store
            .commit(&change.run, &change.events)
            .await
            .expect("committed");
    }
    let change = decided(&change.run, sequence);
    store
        .commit(&change.run, &change.events)
        .await
        .expect("committed");
}

fn bench_run_store(c: &mut Criterion) {
    let runtime = Runtime::new().expect("a Tokio runtime");
    let backends = runtime.block_on(backends());
    let mut group = c.benchmark_group("run_store");
    group.sample_size(20);
    for backend in &backends {
        let store = Arc::new(runtime.block_on(async {
            SqlRunStore::open(backend.db.clone())
                .await
                .expect("the run store opens")
                .with_owner("bench-replica", Duration::from_secs(15))
        }));

        group.throughput(Throughput::Elements(1));
        group.bench_function(BenchmarkId::new("create", backend.label), |b| {
            b.iter(|| {
                let run = new_run();
                runtime
                    .block_on(store.create(&run, None, &started(&run)))
                    .expect("created");
                black_box(run)
            });
        });

        // One run takes every commit, a version at a time: the row it rewrites stays the
        // size of a finished three-delegation run.
        let mut run = new_run();
        runtime
            .block_on(store.create(&run, None, &started(&run)))
            .expect("created");
        let mut sequence = 2;
        group.bench_function(BenchmarkId::new("commit", backend.label), |b| {
            b.iter(|| {
                let change = completed(&run, (sequence % 3) as usize, sequence);
                runtime
                    .block_on(store.commit(&change.run, &change.events))
                    .expect("committed");
                sequence += 1;
                run = change.run;
                // Keep the row the size of a finished run's.
                let extra = run.received.len().saturating_sub(3);
                run.received.drain(..extra);
            });
        });

        group.bench_function(BenchmarkId::new("lifecycle", backend.label), |b| {
            b.iter(|| runtime.block_on(lifecycle(&store)));
        });

        group.throughput(Throughput::Elements(CONCURRENT as u64));
        group.bench_function(BenchmarkId::new("lifecycle_x64", backend.label), |b| {
            b.iter_custom(|iterations| {
                let begin = Instant::now();
                for _ in 0..iterations {
                    runtime.block_on(async {
                        let runs = (0..CONCURRENT).map(|_| {
                            let store = store.clone();
                            tokio::spawn(async move { lifecycle(&store).await })
                        });
                        for run in futures::future::join_all(runs).await {
                            run.expect("a lifecycle task");
                        }
                    });
                }
                begin.elapsed()
            });
        });
    }
    group.finish();
}

criterion_group!(benches, bench_run_store);
criterion_main!(benches);
