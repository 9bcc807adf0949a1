//! Durability end to end, with every service its own process:
//!
//! - a supervisor killed at any point of a run's life (its TEST-ONLY crash points abort
//!   the process like a SIGKILL) and restarted finishes every run exactly as an
//!   uncrashed run of the same spec ends, with no delegation under a second id and one
//!   outbox event per state transition;
//! - two supervisor replicas on one PostgreSQL database share the load, and when one is
//!   killed the other finishes its runs, none decided twice; one that stalls past its
//!   leases (SIGSTOP) holds the other up no longer and never writes over it when it wakes;
//! - under pause, partition and kill nemeses over playbook and model-driven runs, no
//!   delegation runs under a superseded lease, and a frozen replica stalls the other's
//!   commits for at most a second;
//! - two approval service replicas under pauses and a kill keep every vote and execution
//!   once and each request's events in order;
//! - the outbox reaches a `WatchEvents` subscriber and a NATS JetStream consumer that
//!   disconnect and resume from where they were: every event, once, in commit order.
//!
//! This module holds what the three share: seeded randomness, supervisor settings,
//! specs, and starting and reading runs through a supervisor that may be down.

mod approval_replicas;
mod crash;
mod cycle;
mod events;
mod nemesis;
mod planner_crash;
mod replica_commands;
mod replicas;
mod shape;
mod shared_workers;
mod waiting_crash;

use std::os::unix::process::ExitStatusExt as _;
use std::time::{Duration, Instant, SystemTime};

use crate::harness::{TestMesh, example_profiles, example_spec, wait_for};
use convene_mesh::auth::request;
use convene_mesh::handles::SupervisorHandle;
use convene_proto::v1;
use convene_store::{Database, sql};
use convene_supervisor::CrashPoint;
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

/// The example profiles, every playbook one holding its delegations at their start until
/// `release` exists.
fn profiles_held(release: &std::path::Path) -> String {
    example_profiles().replace(
        "    provider: playbook\n",
        &format!(
            "    provider: playbook\n    hold: {{ release: {} }}\n",
            release.display()
        ),
    )
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
                    ..Default::default()
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
    wait_for(
        &format!("run {run_id} to end"),
        LIMIT,
        async || match get_run(client, credential, run_id).await {
            Some(run) if convene_supervisor::store::is_terminal(run.state) => Ok(run),
            run => Err(run),
        },
    )
    .await
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
                from_now: false,
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
/// The replica holding the run's lease (None: nobody, e.g. while it waits).
async fn run_owner(db: &Database, run_id: &str) -> Option<String> {
    db.fetch_optional(sql("SELECT owner FROM runs WHERE run_id = $1").bind(run_id))
        .await
        .expect("the run reads")
        .expect("the run")
        .get("owner")
        .expect("owner")
}

async fn outbox_ids(db: &Database) -> Vec<String> {
    db.fetch_all(sql("SELECT event_id FROM outbox ORDER BY position"))
        .await
        .expect("the outbox reads")
        .iter()
        .map(|r| r.get("event_id").expect("event_id"))
        .collect()
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
