//! Durability end to end, with every service its own process:
//!
//! - a supervisor killed at any point of a run's life (its TEST-ONLY crash points abort
//!   the process like a SIGKILL) and restarted finishes every run exactly as an
//!   uncrashed run of the same spec ends, with no delegation under a second id and one
//!   outbox event per state transition;
//! - two supervisor replicas on one PostgreSQL database share the load, and when one is
//!   killed the other finishes its runs, none decided twice; one that stalls past its
//!   leases (SIGSTOP) holds the other up no longer and never writes over it when it wakes;
//! - the outbox reaches a `WatchEvents` subscriber and a NATS JetStream consumer that
//!   disconnect and resume from where they were: every event, once, in commit order.

use std::collections::{BTreeMap, BTreeSet};
use std::os::unix::process::ExitStatusExt as _;
use std::path::Path;
use std::time::{Duration, Instant, SystemTime};

use convene_mesh::auth::request;
use convene_mesh::handles::SupervisorHandle;
use convene_proto::v1::{self, run_event::Kind};
use convene_store::{Database, sql};
use convene_supervisor::CrashPoint;
use convene_tests::{MeshOptions, Mode, TestMesh, Workers, example_profiles, example_spec};
use futures::StreamExt as _;
use tonic::Code;

const ONCALL: &str = "oncall@acme";
/// Generous: the machine may be a loaded 2-core one.
const LIMIT: Duration = Duration::from_secs(90);

// ---- shared helpers ----------------------------------------------------------------

/// A small seeded generator (SplitMix64): the test prints its seed, and
/// `CONVENE_TEST_SEED=<seed>` repeats a run exactly.
struct Rng(u64);

impl Rng {
    fn seeded() -> (Self, u64) {
        let seed = std::env::var("CONVENE_TEST_SEED")
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or_else(|| {
                let t = SystemTime::now()
                    .duration_since(SystemTime::UNIX_EPOCH)
                    .unwrap_or_default();
                t.as_secs() ^ u64::from(t.subsec_nanos()) ^ u64::from(std::process::id())
            });
        (Self(seed), seed)
    }

    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A number in `0..n`.
    fn below(&mut self, n: usize) -> usize {
        usize::try_from(self.next() % n as u64).expect("below n")
    }

    fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            items.swap(i, self.below(i + 1));
        }
    }
}

/// A unique name for things outside the mesh's own directory (NATS streams).
fn unique(prefix: &str) -> String {
    let t = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default();
    format!("{prefix}{}_{}", std::process::id(), t.as_nanos())
}

/// The supervisor's settings: a stable replica id (a restarted supervisor takes its
/// runs back at once), short lease and claim timing, fast worker heartbeats (workers
/// find a restarted supervisor quickly), and the crash point, if any.
fn supervisor_env(replica: &str, crash: Option<(CrashPoint, u32)>) -> Vec<(String, String)> {
    let mut env = replica_env(replica, "2s", "200ms");
    if let Some((point, after)) = crash {
        env.push(("CONVENE_CRASH__POINT".to_owned(), point.name().to_owned()));
        env.push(("CONVENE_CRASH__AFTER".to_owned(), after.to_string()));
    }
    env
}

/// A replica's id and lease timing, and fast worker heartbeats.
fn replica_env(replica: &str, lease_ttl: &str, claim_interval: &str) -> Vec<(String, String)> {
    [
        ("CONVENE_REPLICA_ID", replica),
        ("CONVENE_RUN_LEASE_TTL", lease_ttl),
        ("CONVENE_CLAIM_INTERVAL", claim_interval),
        ("CONVENE_HEARTBEAT_INTERVAL", "200ms"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v.to_owned()))
    .collect()
}

/// The example spec under its own idempotency key, so a client that lost the answer to
/// StartRun (the supervisor died) can ask again and get the same run.
fn keyed_spec(key: &str) -> v1::RunSpec {
    let mut spec = example_spec();
    spec.idempotency_key = key.to_owned();
    spec
}

/// The example profiles with `faults` on every profile.
fn profiles_with_faults(faults: &str) -> String {
    let text = example_profiles().replace(
        "    provider: playbook\n",
        &format!("    provider: playbook\n    faults: {faults}\n"),
    );
    assert_eq!(text.matches("faults:").count(), 3, "three example profiles");
    text
}

/// Aborting processes must not leave core files behind (in the test's directory).
fn no_core_dumps() {
    use rustix::process::{Resource, getrlimit, setrlimit};
    let mut limit = getrlimit(Resource::Core);
    limit.current = Some(0);
    let _ = setrlimit(Resource::Core, limit);
}

/// Starts a run, asking again under the same idempotency key while the supervisor is
/// down (it crashed, or restarts); returns the run id.
async fn start_until_accepted(
    client: SupervisorHandle,
    credential: String,
    spec: v1::RunSpec,
) -> String {
    let deadline = Instant::now() + LIMIT;
    loop {
        let asked = client
            .start_run(request(
                v1::StartRunRequest {
                    spec: Some(spec.clone()),
                    wait: false,
                },
                &credential,
            ))
            .await;
        match asked {
            Ok(r) => return r.into_inner().run.expect("a run").run_id,
            Err(s) => {
                assert!(
                    !matches!(
                        s.code(),
                        Code::InvalidArgument
                            | Code::AlreadyExists
                            | Code::PermissionDenied
                            | Code::Unauthenticated
                    ),
                    "StartRun refused: {s:?}"
                );
                assert!(
                    Instant::now() < deadline,
                    "StartRun kept failing for {LIMIT:?}: {s:?}"
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

async fn get_run(client: &SupervisorHandle, credential: &str, run_id: &str) -> Option<v1::Run> {
    client
        .get_run(request(
            v1::GetRunRequest {
                run_id: run_id.to_owned(),
            },
            credential,
        ))
        .await
        .ok()
        .and_then(|r| r.into_inner().run)
}

/// Waits until the run is terminal, reading through `client` (a supervisor that is
/// restarting answers nothing for a moment).
async fn wait_terminal(client: &SupervisorHandle, credential: &str, run_id: &str) -> v1::Run {
    let deadline = Instant::now() + LIMIT;
    loop {
        let run = get_run(client, credential, run_id).await;
        if let Some(run) = &run
            && convene_supervisor::store::is_terminal(run.state)
        {
            return run.clone();
        }
        assert!(
            Instant::now() < deadline,
            "run {run_id} not terminal within {LIMIT:?}: {run:#?}"
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// Whether every run is terminal (false while the supervisor does not answer).
async fn all_terminal(client: &SupervisorHandle, credential: &str, run_ids: &[String]) -> bool {
    for id in run_ids {
        match get_run(client, credential, id).await {
            Some(run) if convene_supervisor::store::is_terminal(run.state) => {}
            _ => return false,
        }
    }
    true
}

/// The outbox as a subscriber reads it: `WatchEvents` without following, from the
/// start, optionally only one run's events.
async fn outbox(client: &SupervisorHandle, credential: &str, run_id: &str) -> Vec<v1::CloudEvent> {
    let mut stream = client
        .watch_events(request(
            v1::WatchEventsRequest {
                after_event_id: String::new(),
                types: Vec::new(),
                run_id: run_id.to_owned(),
                follow: false,
            },
            credential,
        ))
        .await
        .expect("WatchEvents")
        .into_inner();
    let mut events = Vec::new();
    while let Some(item) = stream.next().await {
        events.push(item.expect("an event").event.expect("event set"));
    }
    events
}

/// The event ids of the outbox table in commit order, straight from the database.
async fn outbox_ids(db: &Database) -> Vec<String> {
    db.fetch_all(sql("SELECT event_id FROM outbox ORDER BY position"))
        .await
        .expect("the outbox reads")
        .iter()
        .map(|r| r.get("event_id").expect("event_id"))
        .collect()
}

/// Everything a finished run left behind.
struct Finished {
    run: v1::Run,
    /// Its run events (WatchRun).
    events: Vec<v1::RunEvent>,
    /// Its outbox events.
    outbox: Vec<v1::CloudEvent>,
    /// Delegation ids in its ledger.
    ledger: BTreeSet<String>,
    /// Rows of its join decisions.
    decisions: i64,
}

async fn inspect(
    client: &SupervisorHandle,
    credential: &str,
    db: &Database,
    run_id: &str,
) -> Finished {
    let run = wait_terminal(client, credential, run_id).await;
    let mut stream = client
        .watch_run(request(
            v1::WatchRunRequest {
                run_id: run_id.to_owned(),
                after_sequence: 0,
            },
            credential,
        ))
        .await
        .expect("WatchRun")
        .into_inner();
    let mut events = Vec::new();
    while let Some(e) = stream.next().await {
        events.push(e.expect("an event").event.expect("event set"));
    }
    let ledger = db
        .fetch_all(
            sql("SELECT DISTINCT delegation_id FROM delegation_ledger WHERE run_id = $1")
                .bind(run_id),
        )
        .await
        .expect("the ledger reads")
        .iter()
        .map(|r| r.get("delegation_id").expect("delegation_id"))
        .collect();
    let decisions = db
        .fetch_optional(
            sql("SELECT COUNT(*) AS n FROM join_decisions WHERE run_id = $1").bind(run_id),
        )
        .await
        .expect("join decisions read")
        .expect("a count")
        .get("n")
        .expect("n");
    Finished {
        outbox: outbox(client, credential, run_id).await,
        run,
        events,
        ledger,
        decisions,
    }
}

/// What must be the same for every run of one spec, crashed or not: the ids of the run,
/// its delegations and evidence, times, workers and usage differ between runs and are
/// left out (or replaced by the delegation's name); everything else is compared.
#[derive(Debug, PartialEq, Eq)]
struct Shape {
    state: String,
    decision: String,
    /// Per delegation name: state, detail and the result without ids.
    delegations: BTreeMap<String, String>,
    approvals: usize,
    /// Rows in `join_decisions`.
    decisions: i64,
    /// Outbox events by type.
    outbox: BTreeMap<String, usize>,
    /// Run events by kind, except dispatches (a restart dispatches again, as a worker
    /// crash does).
    run_events: BTreeMap<&'static str, usize>,
}

fn shape(f: &Finished) -> Shape {
    let run = &f.run;
    let names: Vec<(String, String)> = run
        .delegations
        .iter()
        .filter_map(|d| d.task.as_ref())
        .map(|t| (t.delegation_id.clone(), format!("<{}>", t.name)))
        .collect();
    let norm = |s: &str| {
        let mut s = s.replace(&run.run_id, "<run>");
        for (id, name) in &names {
            s = s.replace(id, name);
        }
        s
    };
    let sorted = |ids: &[String]| {
        let mut v: Vec<String> = ids.iter().map(|i| norm(i)).collect();
        v.sort();
        v
    };
    let mut decision = run.decision.clone().expect("a decided run");
    decision.decided_at = None;
    decision.accepted = sorted(&decision.accepted);
    decision.missing_required = sorted(&decision.missing_required);
    decision.missing_optional = sorted(&decision.missing_optional);
    decision.late_discarded = sorted(&decision.late_discarded);
    for r in &mut decision.rejected {
        r.delegation_id = norm(&r.delegation_id);
    }
    decision
        .rejected
        .sort_by(|a, b| a.delegation_id.cmp(&b.delegation_id));
    for c in &mut decision.conflicts {
        for claim in &mut c.claims {
            claim.delegation_id = norm(&claim.delegation_id);
            claim.evidence_refs = vec![format!("{} refs", claim.evidence_refs.len())];
        }
        c.claims
            .sort_by(|a, b| (&a.value, &a.delegation_id).cmp(&(&b.value, &b.delegation_id)));
    }
    decision.conflicts.sort_by(|a, b| a.topic.cmp(&b.topic));
    let delegations = run
        .delegations
        .iter()
        .map(|d| {
            let name = d.task.as_ref().map(|t| t.name.clone()).unwrap_or_default();
            let result = d.result.clone().map(|mut r| {
                r.worker_id.clear();
                r.usage = None;
                r.artifacts = vec![format!("{} artifacts", r.artifacts.len())];
                let evidence = r.evidence.len();
                r.evidence.clear();
                for c in &mut r.claims {
                    c.evidence_refs = vec![format!("{} refs", c.evidence_refs.len())];
                }
                for a in &mut r.proposed_actions {
                    a.evidence_refs = vec![format!("{} refs", a.evidence_refs.len())];
                }
                (evidence, r)
            });
            let state = v1::DelegationState::try_from(d.state)
                .map_or("?", |s| s.as_str_name())
                .to_owned();
            (name, norm(&format!("{state} {:?} {result:?}", d.detail)))
        })
        .collect();
    let mut outbox = BTreeMap::new();
    for e in &f.outbox {
        *outbox.entry(e.r#type.clone()).or_insert(0) += 1;
    }
    let mut run_events = BTreeMap::new();
    for e in &f.events {
        let kind = match e.kind {
            Some(Kind::Started(_)) => "started",
            Some(Kind::Dispatched(_)) => continue,
            Some(Kind::Completed(_)) => "completed",
            Some(Kind::Decision(_)) => "decision",
            Some(Kind::Terminal(_)) => "terminal",
            None => "none",
        };
        *run_events.entry(kind).or_insert(0) += 1;
    }
    Shape {
        state: format!(
            "{} {}",
            v1::RunState::try_from(run.state).map_or("?", |s| s.as_str_name()),
            v1::JoinOutcome::try_from(run.outcome).map_or("?", |o| o.as_str_name())
        ),
        decision: norm(&format!("{decision:?}")),
        delegations,
        approvals: run.approval_ids.len(),
        decisions: f.decisions,
        outbox,
        run_events,
    }
}

/// Every delegation ran under the one id it was planned with: the ledger knows exactly
/// those ids, each result carries its delegation's id and comes from a worker it was
/// dispatched to, each completed once (run events and outbox alike), and the run's
/// events are numbered without gaps or repeats.
fn assert_once_per_delegation(f: &Finished, label: &str) {
    let run = &f.run;
    let ids: BTreeSet<String> = run
        .delegations
        .iter()
        .filter_map(|d| d.task.as_ref().map(|t| t.delegation_id.clone()))
        .collect();
    assert_eq!(ids.len(), run.delegations.len(), "{label}: distinct ids");
    assert_eq!(f.ledger, ids, "{label}: the ledger's delegation ids");

    let mut dispatched: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut completed: BTreeMap<String, usize> = BTreeMap::new();
    for (i, e) in f.events.iter().enumerate() {
        assert_eq!(e.sequence, i as u64 + 1, "{label}: run event sequence");
        match &e.kind {
            Some(Kind::Dispatched(d)) => {
                dispatched
                    .entry(d.delegation_id.clone())
                    .or_default()
                    .insert(d.worker_id.clone());
            }
            Some(Kind::Completed(c)) => *completed.entry(c.delegation_id.clone()).or_insert(0) += 1,
            _ => {}
        }
    }
    assert!(
        dispatched.keys().all(|id| ids.contains(id)),
        "{label}: dispatched under unknown ids: {dispatched:?}"
    );
    assert_eq!(
        completed,
        ids.iter().map(|id| (id.clone(), 1)).collect(),
        "{label}: one completion per delegation"
    );
    for d in &run.delegations {
        let task = d.task.as_ref().expect("task");
        let result = d
            .result
            .as_ref()
            .unwrap_or_else(|| panic!("{label}: {} has no result", task.name));
        assert_eq!(result.delegation_id, task.delegation_id, "{label}");
        assert!(
            dispatched
                .get(&task.delegation_id)
                .is_some_and(|w| w.contains(&result.worker_id)),
            "{label}: {}'s result came from {}, not a worker it was dispatched to ({:?})",
            task.name,
            result.worker_id,
            dispatched.get(&task.delegation_id)
        );
    }

    let mut subjects: BTreeMap<String, usize> = BTreeMap::new();
    let mut event_ids = BTreeSet::new();
    for e in &f.outbox {
        assert_eq!(e.correlation_id, run.run_id, "{label}");
        assert!(
            event_ids.insert(e.id.clone()),
            "{label}: event {} twice",
            e.id
        );
        if e.r#type == convene_supervisor::events::DELEGATION_COMPLETED {
            *subjects.entry(e.subject.clone()).or_insert(0) += 1;
        }
    }
    assert_eq!(
        subjects,
        ids.iter()
            .map(|id| (format!("runs/{}/delegations/{id}", run.run_id), 1))
            .collect(),
        "{label}: one delegation.completed event per delegation"
    );
}

/// The delegation ids under which workers' tool calls were authorized, per run, from
/// the policy service's decision log: which ids workers actually executed under.
fn executed_under(data_dir: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let text = std::fs::read_to_string(data_dir.join("policy/decisions.jsonl"))
        .expect("the policy service's decision log");
    let mut out: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    // Only complete lines: the log may be appended to while it is read.
    let complete = text.rfind('\n').map_or("", |end| &text[..end]);
    for line in complete.lines().filter(|l| !l.trim().is_empty()) {
        let record: serde_json::Value = serde_json::from_str(line)
            .unwrap_or_else(|e| panic!("a decision log line does not parse ({e}): {line}"));
        if record["kind"] != "authorize" {
            continue;
        }
        let (Some(run), Some(delegation)) =
            (record["run_id"].as_str(), record["delegation_id"].as_str())
        else {
            continue;
        };
        out.entry(run.to_owned())
            .or_default()
            .insert(delegation.to_owned());
    }
    out
}

fn assert_executed_under_planned_ids(
    executed: &BTreeMap<String, BTreeSet<String>>,
    f: &Finished,
    label: &str,
) {
    let ids: BTreeSet<String> = f
        .run
        .delegations
        .iter()
        .filter_map(|d| d.task.as_ref().map(|t| t.delegation_id.clone()))
        .collect();
    assert_eq!(
        executed.get(&f.run.run_id),
        Some(&ids),
        "{label}: workers executed exactly the planned delegation ids"
    );
}

/// The run ids the StartRun tasks got.
async fn accepted(tasks: Vec<tokio::task::JoinHandle<String>>) -> Vec<String> {
    let mut ids = Vec::with_capacity(tasks.len());
    for t in tasks {
        ids.push(t.await.expect("a StartRun task"));
    }
    ids
}

/// Asserts the named process ended by SIGABRT: it reached its crash point (and did not
/// fail in some other way).
fn assert_aborted(mesh: &mut TestMesh, name: &str, what: &str) {
    let status = mesh
        .exit_status(name)
        .unwrap_or_else(|| panic!("{name} is still running ({what})"));
    assert_eq!(
        status.signal(),
        Some(rustix::process::Signal::ABORT.as_raw()),
        "{name} did not abort at its crash point ({what}): {status:?}"
    );
}

// ---- 1. crash and restart ----------------------------------------------------------

/// The specs a crash batch runs, alternately: the example (its three delegations at
/// once) and the example one delegation at a time (QUEUE overflow: when the supervisor
/// dies, some wait in the queue).
const SPECS: [fn(&str) -> v1::RunSpec; 2] = [keyed_spec, queued_spec];

fn queued_spec(key: &str) -> v1::RunSpec {
    let mut spec = keyed_spec(key);
    let limits = spec.limits.as_mut().expect("the example sets limits");
    limits.max_parallel_workers = 1;
    assert_eq!(limits.overflow, v1::OverflowPolicy::Queue as i32);
    spec
}

/// Runs per batch; each batch meets one crash point (sometimes two).
const BATCH: usize = 12;
/// Batches with a crash per point; every point meets `PER_POINT` different `after`s.
const PER_POINT: usize = 2;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_supervisor_killed_at_any_crash_point_finishes_every_run_like_an_uncrashed_one() {
    const REPLICA: &str = "crash-test-replica";
    no_core_dumps();
    let (mut rng, seed) = Rng::seeded();
    eprintln!("crash test: seed {seed} (CONVENE_TEST_SEED={seed} repeats this run)");
    let began = Instant::now();
    let mut mesh = TestMesh::start(
        Mode::Processes,
        MeshOptions {
            workers: vec![Workers {
                profiles: None,
                count: 2,
                capacity: 64,
            }],
            supervisor_env: supervisor_env(REPLICA, None),
            ..MeshOptions::default()
        },
    )
    .await;
    let client = mesh.supervisor();
    let credential = mesh.credential(ONCALL);
    let db = mesh.open_database().await;

    // Uncrashed runs of each spec: what every crashed one must end as.
    let mut expected: Vec<Shape> = Vec::new();
    for (v, variant) in SPECS.iter().enumerate() {
        let mut shapes = Vec::new();
        for i in 0..2 {
            let id = start_until_accepted(
                client.clone(),
                credential.clone(),
                variant(&format!("baseline-{seed}-{v}-{i}")),
            )
            .await;
            let f = inspect(&client, &credential, &db, &id).await;
            assert_once_per_delegation(&f, "uncrashed run");
            shapes.push(shape(&f));
        }
        assert_eq!(shapes[0], shapes[1], "uncrashed runs of one spec end alike");
        assert_eq!(
            shapes[0].state,
            "RUN_STATE_WAITING_APPROVAL JOIN_OUTCOME_CONFLICT_REQUIRES_HUMAN"
        );
        expected.push(shapes.swap_remove(0));
    }

    // Every point, each with different `after`s, in random order.
    let mut plan = Vec::new();
    for point in CrashPoint::ALL {
        let mut afters: Vec<u32> = (1..=BATCH as u32).collect();
        rng.shuffle(&mut afters);
        plan.extend(afters[..PER_POINT].iter().map(|a| (point, *a)));
    }
    rng.shuffle(&mut plan);

    let mut kills: BTreeMap<&'static str, Vec<u32>> = BTreeMap::new();
    let mut runs = 2 * SPECS.len();
    // Runs with a delegation dispatched again after a crash; cycles whose runs another
    // replica id took over.
    let mut redispatched = 0;
    let mut takeovers = 0;
    for (cycle, &(point, after)) in plan.iter().enumerate() {
        let what = format!("cycle {cycle}: {} #{after}", point.name());
        // The supervisor is idle (its runs are over): restart it armed.
        assert!(
            mesh.restart("supervisor", supervisor_env(REPLICA, Some((point, after))))
                .await,
            "{what}: the supervisor did not start"
        );
        let mut tasks = Some::<Vec<_>>(
            (0..BATCH)
                .map(|i| {
                    tokio::spawn(start_until_accepted(
                        client.clone(),
                        credential.clone(),
                        SPECS[i % SPECS.len()](&format!("crash-{seed}-{cycle}-{i}")),
                    ))
                })
                .collect(),
        );
        assert!(
            mesh.wait_exited("supervisor", LIMIT).await,
            "{what}: the supervisor never reached its crash point"
        );
        assert_aborted(&mut mesh, "supervisor", &what);
        kills.entry(point.name()).or_default().push(after);

        // Half the time the supervisor comes back as itself (its stable replica id: it
        // takes its runs back at once), else as another replica (it claims them once
        // the dead one's leases expire). Half the time it is armed too, so it may crash
        // again while it resumes the runs the first one left.
        let replica = if rng.below(2) == 0 {
            REPLICA.to_owned()
        } else {
            takeovers += 1;
            format!("{REPLICA}-{cycle}")
        };
        let again = (rng.below(2) == 0).then(|| {
            (
                CrashPoint::ALL[rng.below(CrashPoint::ALL.len())],
                1 + rng.below(3) as u32,
            )
        });
        let ready = mesh
            .restart("supervisor", supervisor_env(&replica, again))
            .await;
        let mut ids = None;
        if let Some((point2, after2)) = again {
            let what2 = format!("{what}, then {} #{after2}", point2.name());
            let deadline = Instant::now() + LIMIT;
            let crashed = loop {
                if !ready || mesh.exited("supervisor") {
                    break true;
                }
                if tasks
                    .as_ref()
                    .is_some_and(|t| t.iter().all(tokio::task::JoinHandle::is_finished))
                {
                    ids = Some(accepted(tasks.take().expect("StartRun tasks")).await);
                }
                if let Some(ids) = &ids
                    && all_terminal(&client, &credential, ids).await
                {
                    // The point was not reached again: the runs are over all the same.
                    break false;
                }
                assert!(Instant::now() < deadline, "{what2}: runs never finished");
                tokio::time::sleep(Duration::from_millis(50)).await;
            };
            if crashed {
                assert_aborted(&mut mesh, "supervisor", &what2);
                kills.entry(point2.name()).or_default().push(after2);
                assert!(
                    mesh.restart("supervisor", supervisor_env(&replica, None))
                        .await,
                    "{what2}: the supervisor did not start again"
                );
            }
        } else {
            assert!(ready, "{what}: the supervisor did not start again");
        }

        let ids = match ids {
            Some(ids) => ids,
            None => accepted(tasks.take().expect("StartRun tasks")).await,
        };
        let mut finished = Vec::new();
        for (i, id) in ids.iter().enumerate() {
            let f = inspect(&client, &credential, &db, id).await;
            let label = format!("{what}: run {id}");
            assert_once_per_delegation(&f, &label);
            assert_eq!(
                shape(&f),
                expected[i % SPECS.len()],
                "{label} ends unlike an uncrashed run"
            );
            let dispatches = f
                .events
                .iter()
                .filter(|e| matches!(e.kind, Some(Kind::Dispatched(_))))
                .count();
            if dispatches > f.run.delegations.len() {
                redispatched += 1;
            }
            finished.push(f);
        }
        let executed = executed_under(&mesh.data_dir());
        for f in &finished {
            assert_executed_under_planned_ids(&executed, f, &what);
        }
        runs += ids.len();
        eprintln!(
            "crash test: {what} done at {:?} (replica {replica})",
            began.elapsed()
        );
    }

    let points: usize = kills.values().map(Vec::len).sum();
    eprintln!(
        "crash test: seed {seed}: {runs} runs, {points} supervisor kills ({kills:?}), \
         {redispatched} runs with delegations dispatched again, {takeovers} of {} restarts \
         under another replica id, {:?}",
        plan.len(),
        began.elapsed()
    );
    assert!(runs >= 100, "{runs} runs");
    assert!(
        redispatched > 0,
        "no crash interrupted a dispatched delegation"
    );
    for point in CrashPoint::ALL {
        let afters: BTreeSet<u32> = kills[point.name()].iter().copied().collect();
        assert!(afters.len() >= PER_POINT, "{}: {afters:?}", point.name());
    }
}

// ---- 2. two replicas ---------------------------------------------------------------

/// The PostgreSQL server for the replica test: `CONVENE_TEST_POSTGRES_URL`, else the
/// local default. Replicas share their runs through PostgreSQL, so the test fails (it
/// never skips) when no server answers.
async fn postgres_server() -> String {
    let url = convene_store::test_util::postgres_server()
        .unwrap_or_else(|| "postgres://postgres@127.0.0.1:5432/postgres".to_owned());
    if let Err(e) = convene_store::test_util::TestPostgres::create(&url).await {
        panic!(
            "two supervisor replicas need a PostgreSQL server to share, and none answers at {} \
             ({e}); start one, or name one in {}",
            convene_store::redact(&url),
            convene_store::test_util::POSTGRES_ENV
        );
    }
    url
}

/// Two supervisor replicas on one fresh PostgreSQL database (leases of 1 s, claims every
/// 300 ms), each with a worker of its own that holds every delegation for a second (so
/// runs are in flight when something happens to a replica), and what every run must
/// end as: the shape of an uncrashed run on each.
struct Replicas {
    mesh: TestMesh,
    a: SupervisorHandle,
    b: SupervisorHandle,
    credential: String,
    db: Database,
    expected: Shape,
}

impl Replicas {
    async fn start() -> Self {
        let server = postgres_server().await;
        let held = profiles_with_faults("{ delay: 1s }");
        let mut mesh = TestMesh::start(
            Mode::Processes,
            MeshOptions {
                workers: vec![Workers {
                    profiles: Some(held.clone()),
                    count: 1,
                    capacity: 128,
                }],
                database_url: Some(server),
                supervisor_env: replica_env("replica-a", "1s", "300ms"),
                ..MeshOptions::default()
            },
        )
        .await;
        let b_endpoint = mesh
            .spawn_supervisor("supervisor-b", replica_env("replica-b", "1s", "300ms"))
            .await;
        let held_path = mesh.write_profiles("held", &held);
        mesh.spawn_worker_at("worker-b", &held_path, 128, &b_endpoint)
            .await;
        let a = mesh.supervisor();
        let b = mesh.supervisor_at(&b_endpoint);
        let credential = mesh.credential(ONCALL);
        let db = mesh.open_database().await;

        let baseline = vec![
            tokio::spawn(start_until_accepted(
                a.clone(),
                credential.clone(),
                keyed_spec("replicas-baseline-a"),
            )),
            tokio::spawn(start_until_accepted(
                b.clone(),
                credential.clone(),
                keyed_spec("replicas-baseline-b"),
            )),
        ];
        let mut expected: Option<Shape> = None;
        for id in accepted(baseline).await {
            let f = inspect(&b, &credential, &db, &id).await;
            assert_once_per_delegation(&f, "uncrashed run");
            let s = shape(&f);
            match &expected {
                None => expected = Some(s),
                Some(e) => assert_eq!(&s, e, "both replicas end runs alike"),
            }
        }
        Self {
            mesh,
            a,
            b,
            credential,
            db,
            expected: expected.expect("a baseline"),
        }
    }

    /// Starts runs `range` through `client`; returns their ids once accepted.
    async fn start_runs(
        &self,
        client: &SupervisorHandle,
        range: std::ops::Range<usize>,
    ) -> Vec<String> {
        let tasks = range
            .map(|i| {
                tokio::spawn(start_until_accepted(
                    client.clone(),
                    self.credential.clone(),
                    keyed_spec(&format!("replicas-{i}")),
                ))
            })
            .collect();
        accepted(tasks).await
    }

    /// The runs among `ids` not finished yet.
    async fn unfinished(&self, ids: &[String]) -> Vec<String> {
        let open: BTreeSet<String> = self
            .db
            .fetch_all(sql("SELECT run_id FROM runs WHERE NOT terminal"))
            .await
            .expect("runs read")
            .iter()
            .map(|r| r.get("run_id").expect("run_id"))
            .collect();
        ids.iter()
            .filter(|id| open.contains(*id))
            .cloned()
            .collect()
    }

    async fn owner(&self, run_id: &str) -> Option<String> {
        self.db
            .fetch_optional(sql("SELECT owner FROM runs WHERE run_id = $1").bind(run_id))
            .await
            .expect("the run reads")
            .expect("the run")
            .get("owner")
            .expect("owner")
    }

    /// The runs among `ids` that `replica` holds now.
    async fn owned_by(&self, ids: &[String], replica: &str) -> Vec<String> {
        let mut held = Vec::new();
        for id in ids {
            if self.owner(id).await.as_deref() == Some(replica) {
                held.push(id.clone());
            }
        }
        held
    }

    /// Every run in `ids` ends as an uncrashed one, decided once, every delegation
    /// under its one id; read through `client`.
    async fn assert_finished_alike(&self, client: &SupervisorHandle, ids: &[String]) {
        let mut finished = Vec::new();
        for id in ids {
            let f = inspect(client, &self.credential, &self.db, id).await;
            let label = format!("run {id}");
            assert_once_per_delegation(&f, &label);
            assert_eq!(
                shape(&f),
                self.expected,
                "{label} ends unlike an uncrashed run"
            );
            finished.push(f);
        }
        let executed = executed_under(&self.mesh.data_dir());
        for f in &finished {
            assert_executed_under_planned_ids(&executed, f, "replicas");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_share_the_load_and_one_finishes_the_runs_of_the_other_when_it_dies() {
    let began = Instant::now();
    let mut r = Replicas::start().await;
    // Load on both replicas.
    let (a, b) = (r.a.clone(), r.b.clone());
    let (on_a, on_b) = tokio::join!(r.start_runs(&a, 0..12), r.start_runs(&b, 12..24));

    // Replica A dies mid-load, without a word.
    r.mesh.kill("supervisor").await;
    let orphans = r.unfinished(&on_a).await;
    assert!(
        !orphans.is_empty(),
        "every run of replica A finished before it died; nothing was handed over"
    );
    // The load goes on, on B alone.
    let more = r.start_runs(&b, 24..32).await;

    let all: Vec<String> = on_a.iter().chain(&on_b).chain(&more).cloned().collect();
    r.assert_finished_alike(&b, &all).await;
    // A's unfinished runs are B's now: B claimed them once A's leases ran out. (A commit
    // A had sent just before it died may still land after `orphans` was read: that run
    // ends as A's, finished alike all the same.)
    let taken = r.owned_by(&orphans, "replica-b").await;
    assert!(
        !taken.is_empty(),
        "replica B finished none of the runs replica A left unfinished: {orphans:?}"
    );
    eprintln!(
        "replica test: {} runs, {} of replica A's {} runs finished by replica B, {:?}",
        all.len() + 2,
        taken.len(),
        on_a.len(),
        began.elapsed()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_stalled_past_its_leases_never_writes_over_the_one_that_took_its_runs() {
    let began = Instant::now();
    let mut r = Replicas::start().await;
    let (a, b) = (r.a.clone(), r.b.clone());
    let (on_a, on_b) = tokio::join!(r.start_runs(&a, 0..12), r.start_runs(&b, 12..24));

    // Replica A stalls (a frozen machine, a long pause) with its runs in flight; its
    // workers answer meanwhile, into its sockets.
    r.mesh.signal("supervisor", rustix::process::Signal::STOP);
    let stalled = r.unfinished(&on_a).await;
    assert!(
        !stalled.is_empty(),
        "every run of replica A finished before it stalled"
    );
    // B takes A's runs over once their leases have run out.
    let deadline = Instant::now() + LIMIT;
    loop {
        let mut all_b = true;
        for id in &stalled {
            let open = !r.unfinished(std::slice::from_ref(id)).await.is_empty();
            if open && r.owner(id).await.as_deref() != Some("replica-b") {
                all_b = false;
                break;
            }
        }
        if all_b {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "replica B never took A's runs over"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let taken = r.owned_by(&stalled, "replica-b").await;
    assert!(
        !taken.is_empty(),
        "replica B took none of the runs replica A stalled on: {stalled:?}"
    );
    // A wakes up with its workers' answers waiting: every commit it tries on those runs
    // is refused, and it stops touching them. Each run is decided once, its events in
    // one unbroken sequence, each delegation done once: nothing was written twice.
    // (Who owns a run at the end is not asserted: on a loaded machine a lease can lapse
    // again later, and then either replica may rightly claim the run and finish it.)
    r.mesh.signal("supervisor", rustix::process::Signal::CONT);
    let all: Vec<String> = on_a.iter().chain(&on_b).cloned().collect();
    r.assert_finished_alike(&b, &all).await;
    // A is well and runs new runs.
    assert!(!r.mesh.exited("supervisor"), "replica A died");
    let after = r.start_runs(&a, 24..28).await;
    r.assert_finished_alike(&a, &after).await;
    eprintln!(
        "stalled replica test: {} of replica A's {} runs taken over by replica B, {:?}",
        taken.len(),
        on_a.len(),
        began.elapsed()
    );
}

// ---- 3. event delivery ---------------------------------------------------------------

/// Starts `n` runs through `client`, a few at a time, asking again while the supervisor
/// is down; returns their ids.
async fn load(
    client: SupervisorHandle,
    credential: String,
    n: usize,
    prefix: String,
) -> Vec<String> {
    let mut ids = Vec::with_capacity(n);
    for first in (0..n).step_by(3) {
        let tasks = (first..n.min(first + 3))
            .map(|i| {
                tokio::spawn(start_until_accepted(
                    client.clone(),
                    credential.clone(),
                    keyed_spec(&format!("{prefix}-{i}")),
                ))
            })
            .collect();
        ids.extend(accepted(tasks).await);
        tokio::time::sleep(Duration::from_millis(30)).await;
    }
    ids
}

/// Waits until the outbox holds at least `n` events.
async fn wait_outbox(db: &Database, n: usize) {
    let deadline = Instant::now() + LIMIT;
    while outbox_ids(db).await.len() < n {
        assert!(
            Instant::now() < deadline,
            "the outbox never reached {n} events"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A `WatchEvents` subscriber that takes a few events at a time, hangs up mid-stream
/// and resumes after the last event it got (also when the supervisor went away), until
/// it got the event `stop` names. Returns the ids it got, in order, and how often it
/// hung up.
async fn subscribe(
    client: SupervisorHandle,
    credential: String,
    seed: u64,
    mut stop: tokio::sync::watch::Receiver<Option<String>>,
) -> (Vec<String>, usize) {
    let mut rng = Rng(seed);
    let mut got: Vec<String> = Vec::new();
    let mut hung_up = 0;
    let done = |stop: &tokio::sync::watch::Receiver<Option<String>>, got: &[String]| {
        stop.borrow()
            .as_ref()
            .is_some_and(|last| got.last() == Some(last))
    };
    loop {
        if done(&stop, &got) {
            return (got, hung_up);
        }
        let opened = client
            .watch_events(request(
                v1::WatchEventsRequest {
                    after_event_id: got.last().cloned().unwrap_or_default(),
                    types: Vec::new(),
                    run_id: String::new(),
                    follow: true,
                },
                &credential,
            ))
            .await;
        let Ok(stream) = opened else {
            // The supervisor restarts.
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        let mut stream = stream.into_inner();
        let take = 1 + rng.below(20);
        let mut taken = 0;
        loop {
            tokio::select! {
                item = stream.next() => match item {
                    Some(Ok(item)) => {
                        got.push(item.event.expect("event set").id);
                        taken += 1;
                        if taken == take {
                            // Hang up mid-stream.
                            hung_up += 1;
                            break;
                        }
                    }
                    // The supervisor went away: resume.
                    Some(Err(_)) | None => break,
                },
                _ = stop.changed() => {}
            }
            if done(&stop, &got) {
                return (got, hung_up);
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watch_events_subscriber_resuming_from_its_last_id_misses_none_and_sees_none_twice() {
    let began = Instant::now();
    let (mut rng, seed) = Rng::seeded();
    eprintln!("event test: seed {seed} (CONVENE_TEST_SEED={seed} repeats this run)");
    let replica = supervisor_env("events-replica", None);
    let mut mesh = TestMesh::start(
        Mode::Processes,
        MeshOptions {
            supervisor_env: replica.clone(),
            ..MeshOptions::default()
        },
    )
    .await;
    let client = mesh.supervisor();
    let credential = mesh.credential(ONCALL);
    let db = mesh.open_database().await;

    let (stop, stop_rx) = tokio::sync::watch::channel(None);
    let subscriber = tokio::spawn(subscribe(
        client.clone(),
        credential.clone(),
        rng.next(),
        stop_rx,
    ));
    let loader = tokio::spawn(load(
        client.clone(),
        credential.clone(),
        30,
        format!("watch-{seed}"),
    ));
    // Mid-load the supervisor dies and comes back: every open stream breaks.
    wait_outbox(&db, 30 + rng.below(40)).await;
    assert!(mesh.restart("supervisor", replica).await);
    let ids = loader.await.expect("the load");
    for id in &ids {
        wait_terminal(&client, &credential, id).await;
    }

    let outbox = outbox_ids(&db).await;
    assert!(outbox.len() >= ids.len() * 5, "{} events", outbox.len());
    stop.send_replace(outbox.last().cloned());
    let (got, hung_up) = tokio::time::timeout(LIMIT, subscriber)
        .await
        .expect("the subscriber got the last event")
        .expect("the subscriber");
    let distinct: BTreeSet<&String> = got.iter().collect();
    assert_eq!(distinct.len(), got.len(), "an event came twice");
    assert_eq!(
        got, outbox,
        "the subscriber got every event, in commit order"
    );
    assert!(hung_up >= 5, "the subscriber hung up {hung_up} times");
    eprintln!(
        "event test: {} events over {} runs, {hung_up} resumptions, {:?}",
        got.len(),
        ids.len(),
        began.elapsed()
    );
}

/// One message of the relay's stream (or one publication seen on its subjects).
#[derive(Debug, Clone)]
struct Delivered {
    /// Stream sequence (0 for a publication seen by a core subscriber).
    sequence: u64,
    msg_id: String,
    subject: String,
    body: serde_json::Value,
}

fn delivered(
    subject: &str,
    headers: Option<&async_nats::HeaderMap>,
    payload: &[u8],
    sequence: u64,
) -> Delivered {
    Delivered {
        sequence,
        msg_id: headers
            .and_then(|h| h.get(async_nats::header::NATS_MESSAGE_ID))
            .map(|v| v.as_str().to_owned())
            .unwrap_or_default(),
        subject: subject.to_owned(),
        body: serde_json::from_slice(payload).expect("a JSON body"),
    }
}

/// A JetStream consumer that reads a few messages at a time with a fresh connection
/// and a fresh consumer starting after the last stream sequence it got, until it has
/// every event id `stop` names. Returns what it got and how often it reconnected.
async fn consume(
    url: String,
    stream_name: String,
    seed: u64,
    mut stop: tokio::sync::watch::Receiver<Option<BTreeSet<String>>>,
) -> (Vec<Delivered>, usize) {
    use async_nats::jetstream::consumer::{AckPolicy, DeliverPolicy, pull};
    let mut rng = Rng(seed);
    let mut got: Vec<Delivered> = Vec::new();
    let mut reconnects = 0;
    let done = |stop: &tokio::sync::watch::Receiver<Option<BTreeSet<String>>>,
                got: &[Delivered]| {
        stop.borrow().as_ref().is_some_and(|all| {
            let seen: BTreeSet<&String> = got.iter().map(|d| &d.msg_id).collect();
            all.iter().all(|id| seen.contains(id))
        })
    };
    loop {
        if done(&stop, &got) {
            return (got, reconnects);
        }
        let _ = tokio::time::timeout(Duration::from_millis(100), stop.changed()).await;
        let Ok(client) = async_nats::connect(url.as_str()).await else {
            continue;
        };
        let js = async_nats::jetstream::new(client);
        // The relay creates the stream when it first connects.
        let Ok(stream) = js.get_stream(&stream_name).await else {
            continue;
        };
        let start = got.last().map_or(1, |d| d.sequence + 1);
        let consumer = stream
            .create_consumer(pull::Config {
                deliver_policy: DeliverPolicy::ByStartSequence {
                    start_sequence: start,
                },
                ack_policy: AckPolicy::None,
                ..Default::default()
            })
            .await
            .expect("a consumer");
        let mut batch = consumer
            .fetch()
            .max_messages(1 + rng.below(25))
            .expires(Duration::from_millis(300))
            .messages()
            .await
            .expect("a fetch");
        while let Some(message) = batch.next().await {
            let message = message.expect("a message");
            let sequence = message.info().expect("JetStream metadata").stream_sequence;
            got.push(delivered(
                message.subject.as_str(),
                message.headers.as_ref(),
                &message.payload,
                sequence,
            ));
        }
        reconnects += 1;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_nats_relay_delivers_every_outbox_event_once_to_a_consumer_resuming_by_sequence() {
    let began = Instant::now();
    let (mut rng, seed) = Rng::seeded();
    eprintln!("NATS test: seed {seed} (CONVENE_TEST_SEED={seed} repeats this run)");
    let url =
        std::env::var("CONVENE_TEST_NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into());
    let nats = async_nats::connect(url.as_str()).await.unwrap_or_else(|e| {
        panic!(
            "the relay test needs a NATS server with JetStream at {url} (set CONVENE_TEST_NATS_URL): {e}"
        )
    });
    // A stream and subjects of this test's own.
    let stream_name = unique("CONVENE_TEST_");
    let prefix = format!("convene.test.{}", unique("t"));
    // Every publication, duplicates included (JetStream drops a re-publication of a
    // message id it holds; a plain subscriber still sees it).
    let mut raw = nats
        .subscribe(format!("{prefix}.>"))
        .await
        .expect("a subscription");
    nats.flush().await.expect("the subscription is in place");

    let mut replica = supervisor_env("nats-replica", None);
    replica.extend([
        ("CONVENE_NATS_URL".to_owned(), url.clone()),
        ("CONVENE_NATS_STREAM".to_owned(), stream_name.clone()),
        ("CONVENE_NATS_SUBJECT_PREFIX".to_owned(), prefix.clone()),
    ]);
    let mut mesh = TestMesh::start(
        Mode::Processes,
        MeshOptions {
            supervisor_env: replica.clone(),
            ..MeshOptions::default()
        },
    )
    .await;
    let client = mesh.supervisor();
    let credential = mesh.credential(ONCALL);
    let db = mesh.open_database().await;

    let (stop, stop_rx) = tokio::sync::watch::channel(None);
    let consumer = tokio::spawn(consume(
        url.clone(),
        stream_name.clone(),
        rng.next(),
        stop_rx,
    ));
    let loader = tokio::spawn(load(
        client.clone(),
        credential.clone(),
        30,
        format!("nats-{seed}"),
    ));
    // Mid-load the supervisor dies between publishing events and storing that they were
    // acknowledged: its cursor is where such a crash leaves it, a few events back. The
    // restarted relay resumes from there and publishes those events again.
    let relay = format!("nats:{stream_name}");
    let cursor = loop {
        let row = db
            .fetch_optional(
                sql("SELECT position FROM outbox_relays WHERE relay = $1").bind(relay.as_str()),
            )
            .await
            .expect("the relay cursor reads");
        if let Some(position) = row.map(|r| r.get::<i64>("position").expect("position"))
            && position >= 30
        {
            break position;
        }
        assert!(began.elapsed() < LIMIT, "the relay acknowledged nothing");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    mesh.kill("supervisor").await;
    let back = 5 + rng.below(10);
    let earlier = db
        .fetch_optional(
            sql("SELECT position, event_id FROM outbox WHERE position < $1 \
                 ORDER BY position DESC LIMIT 1 OFFSET $2")
            .bind(cursor)
            .bind(i64::try_from(back - 1).expect("small")),
        )
        .await
        .expect("the outbox reads")
        .expect("an earlier event");
    db.execute(
        sql("UPDATE outbox_relays SET position = $2, event_id = $3 WHERE relay = $1")
            .bind(relay.as_str())
            .bind(earlier.get::<i64>("position").expect("position"))
            .bind(earlier.get::<String>("event_id").expect("event_id")),
    )
    .await
    .expect("the cursor is set back");
    assert!(mesh.restart("supervisor", replica).await);
    let ids = loader.await.expect("the load");
    for id in &ids {
        wait_terminal(&client, &credential, id).await;
    }

    let outbox = outbox(&client, &credential, "").await;
    let outbox_ids: Vec<String> = outbox.iter().map(|e| e.id.clone()).collect();
    assert_eq!(outbox_ids, self::outbox_ids(&db).await);
    stop.send_replace(Some(outbox_ids.iter().cloned().collect()));
    let (got, reconnects) = tokio::time::timeout(LIMIT, consumer)
        .await
        .expect("the consumer got every event")
        .expect("the consumer");

    // The consumer resumed by sequence: it missed none and got none twice.
    let sequences: Vec<u64> = got.iter().map(|d| d.sequence).collect();
    assert_eq!(
        sequences,
        (1..=got.len() as u64).collect::<Vec<_>>(),
        "stream sequences as consumed"
    );
    assert!(
        reconnects >= 5,
        "the consumer reconnected {reconnects} times"
    );
    // The stream holds every outbox event once, in commit order, as CloudEvents JSON
    // under its id.
    let stream_ids: Vec<String> = got.iter().map(|d| d.msg_id.clone()).collect();
    assert_eq!(stream_ids, outbox_ids, "the stream, message ids in order");
    for (d, event) in got.iter().zip(&outbox) {
        assert_eq!(
            d.body,
            convene_supervisor::events::to_json(event),
            "event {}",
            event.id
        );
        assert_eq!(d.subject, format!("{prefix}.{}", event.r#type));
        for field in [
            "specversion",
            "id",
            "source",
            "type",
            "subject",
            "time",
            "data",
            "correlationid",
            "tenantid",
        ] {
            assert!(!d.body[field].is_null(), "{field} in {}", d.body);
        }
    }

    // What the relay published: every event, and an event published again (after the
    // restart) under the same message id with the same content.
    let mut published: BTreeMap<String, Vec<Delivered>> = BTreeMap::new();
    let expected: BTreeSet<&String> = outbox_ids.iter().collect();
    let deadline = Instant::now() + LIMIT;
    while published.len() < expected.len() {
        let message = tokio::time::timeout(deadline - Instant::now(), raw.next())
            .await
            .expect("every publication reaches the plain subscriber")
            .expect("the subscription is open");
        let d = delivered(
            message.subject.as_str(),
            message.headers.as_ref(),
            &message.payload,
            0,
        );
        published.entry(d.msg_id.clone()).or_default().push(d);
    }
    // Let publications still on their way arrive.
    while let Ok(Some(message)) = tokio::time::timeout(Duration::from_millis(300), raw.next()).await
    {
        let d = delivered(
            message.subject.as_str(),
            message.headers.as_ref(),
            &message.payload,
            0,
        );
        published.entry(d.msg_id.clone()).or_default().push(d);
    }
    assert_eq!(published.keys().collect::<BTreeSet<_>>(), expected);
    let mut again = 0;
    for (id, copies) in &published {
        for copy in copies {
            assert_eq!(
                copy.body["id"],
                id.as_str(),
                "a publication's id and its message id"
            );
            assert_eq!(
                copy.body, copies[0].body,
                "{id} published again with other content"
            );
        }
        again += copies.len() - 1;
    }
    assert!(
        again >= back,
        "{again} re-publications; the restarted relay resumed {back} events back"
    );

    let js = async_nats::jetstream::new(nats);
    js.delete_stream(&stream_name)
        .await
        .expect("the test's stream is deleted");
    eprintln!(
        "NATS test: {} events over {} runs, {reconnects} consumer reconnections, {again} \
         re-publications dropped by the stream, {:?}",
        got.len(),
        ids.len(),
        began.elapsed()
    );
}
