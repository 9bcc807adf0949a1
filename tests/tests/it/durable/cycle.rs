//! The crash cycle both crash tests run: restart the supervisor armed with a crash
//! point, start a batch of runs, see it abort there, bring it back (as itself or as
//! another replica, sometimes armed again), and inspect every run of the batch once
//! it is over. What a test starts and checks is its own; this is the rest.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Instant;

use crate::harness::{MeshOptions, Mode, TestMesh, Workers, wait_for};
use convene_mesh::handles::SupervisorHandle;
use convene_proto::v1::{self, run_event::Kind};
use convene_store::{Database, sql};
use convene_supervisor::CrashPoint;

use super::shape::{Finished, assert_executed_under_planned_ids, executed_under, inspect};
use super::{
    LIMIT, ONCALL, Rng, accepted, all_terminal, assert_aborted, no_core_dumps,
    start_until_accepted, supervisor_env,
};

/// A crash test's mesh (the supervisor its own process, so that it can abort; two
/// workers), what the test reads it through, and its seeded randomness.
pub(super) struct CrashTest {
    /// What its progress lines begin with ("crash test").
    pub(super) name: &'static str,
    /// The supervisor's own replica id (a takeover runs under `{replica}-{cycle}`).
    pub(super) replica: &'static str,
    pub(super) began: Instant,
    pub(super) rng: Rng,
    pub(super) seed: u64,
    pub(super) mesh: TestMesh,
    pub(super) client: SupervisorHandle,
    pub(super) credential: String,
    pub(super) db: Database,
}

impl CrashTest {
    /// Starts the mesh, the workers with `profiles` (the example's if `None`).
    pub(super) async fn start(
        name: &'static str,
        replica: &'static str,
        profiles: Option<String>,
    ) -> Self {
        no_core_dumps();
        let (rng, seed) = Rng::seeded();
        eprintln!("{name}: seed {seed} (CONVENE_TEST_SEED={seed} repeats this run)");
        let began = Instant::now();
        let mesh = TestMesh::start(
            Mode::Processes,
            MeshOptions {
                workers: vec![Workers {
                    profiles,
                    count: 2,
                    capacity: 64,
                }],
                supervisor_env: supervisor_env(replica, None),
                ..MeshOptions::default()
            },
        )
        .await;
        let client = mesh.supervisor();
        let credential = mesh.credential(ONCALL);
        let db = mesh.open_database().await;
        Self {
            name,
            replica,
            began,
            rng,
            seed,
            mesh,
            client,
            credential,
            db,
        }
    }
}

/// What the cycles did, for the test's own assertions and summary.
pub(super) struct Outcome {
    /// Every run the cycles started, labelled, in order.
    pub(super) runs: Vec<(String, Finished)>,
    /// The `after`s each point was reached at.
    pub(super) kills: BTreeMap<&'static str, Vec<u32>>,
    /// How many cycles ran.
    pub(super) cycles: usize,
    /// Runs with a delegation dispatched again after a crash.
    pub(super) redispatched: usize,
    /// Restarts under another replica id.
    pub(super) takeovers: usize,
    /// Runs in flight when a supervisor died.
    pub(super) interrupted: usize,
}

/// Runs the cycles: every one of `points` `per_point` times with different `after`s, in
/// an order the test's randomness draws, `batch` runs a cycle. `spec(cycle, i)` is what
/// run `i` of a cycle starts; `check` sees each cycle's runs, labelled "{what}: run {id}"
/// in the order they were started, before their executions are checked against their
/// planned ids. Asserts at the end that every point was reached with `per_point`
/// different `after`s.
pub(super) async fn crash_cycles(
    test: &mut CrashTest,
    (points, batch, per_point): (&[CrashPoint], usize, usize),
    spec: impl Fn(usize, usize) -> v1::RunSpec,
    mut check: impl FnMut(&[(String, Finished)]),
) -> Outcome {
    let CrashTest {
        name,
        replica: replica0,
        began,
        rng,
        mesh,
        client,
        credential,
        db,
        ..
    } = test;
    let (name, replica0, began) = (*name, *replica0, *began);
    let (client, credential, db) = (&*client, credential.as_str(), &*db);
    // Every point, each with different `after`s, in random order.
    let mut plan = Vec::new();
    for &point in points {
        let mut afters: Vec<u32> = (1..=batch as u32).collect();
        rng.shuffle(&mut afters);
        plan.extend(afters[..per_point].iter().map(|a| (point, *a)));
    }
    rng.shuffle(&mut plan);

    let mut out = Outcome {
        runs: Vec::new(),
        kills: BTreeMap::new(),
        cycles: plan.len(),
        redispatched: 0,
        takeovers: 0,
        interrupted: 0,
    };
    for (cycle, &(point, after)) in plan.iter().enumerate() {
        let what = format!("cycle {cycle}: {} #{after}", point.name());
        // The supervisor is idle (its runs are over): restart it armed.
        assert!(
            mesh.restart("supervisor", supervisor_env(replica0, Some((point, after))))
                .await,
            "{what}: the supervisor did not start"
        );
        let mut tasks = Some::<Vec<_>>(
            (0..batch)
                .map(|i| {
                    tokio::spawn(start_until_accepted(
                        client.clone(),
                        credential.to_owned(),
                        spec(cycle, i),
                    ))
                })
                .collect(),
        );
        if !mesh.wait_exited("supervisor", LIMIT).await {
            // A refused StartRun says why first.
            for t in tasks.take().into_iter().flatten() {
                if t.is_finished() {
                    t.await.expect("a StartRun task");
                }
            }
            panic!(
                "{what}: the supervisor never reached its crash point in {LIMIT:?}; runs \
                 not waiting for approval (their expected end): {:?}",
                unexpected_states(db).await
            );
        }
        assert_aborted(mesh, "supervisor", &what);
        out.kills.entry(point.name()).or_default().push(after);
        let mut interrupted = unfinished(db).await;

        // Half the time the supervisor comes back as itself (its stable replica id: it
        // takes its runs back at once), else as another replica (it claims them once
        // the dead one's leases expire). Half the time it is armed too, so it may crash
        // again while it resumes the runs the first one left.
        let replica = if rng.below(2) == 0 {
            replica0.to_owned()
        } else {
            out.takeovers += 1;
            format!("{replica0}-{cycle}")
        };
        let again =
            (rng.below(2) == 0).then(|| (points[rng.below(points.len())], 1 + rng.below(3) as u32));
        let ready = mesh
            .restart("supervisor", supervisor_env(&replica, again))
            .await;
        let mut ids = None;
        if let Some((point2, after2)) = again {
            let what2 = format!("{what}, then {} #{after2}", point2.name());
            let awaited = format!("{what2}: the runs to finish or the supervisor to crash");
            let crashed = wait_for(&awaited, LIMIT, async || {
                if !ready || mesh.exited("supervisor") {
                    return Ok(true);
                }
                if tasks
                    .as_ref()
                    .is_some_and(|t| t.iter().all(tokio::task::JoinHandle::is_finished))
                {
                    ids = Some(accepted(tasks.take().expect("StartRun tasks")).await);
                }
                if let Some(ids) = &ids
                    && all_terminal(client, credential, ids).await
                {
                    // The point was not reached again: the runs are over all the same.
                    return Ok(false);
                }
                Err(ids.clone())
            })
            .await;
            if crashed {
                assert_aborted(mesh, "supervisor", &what2);
                out.kills.entry(point2.name()).or_default().push(after2);
                interrupted.extend(unfinished(db).await);
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
        let first = out.runs.len();
        for id in &ids {
            let f = inspect(client, credential, db, id).await;
            let dispatches = f
                .events
                .iter()
                .filter(|e| matches!(e.kind, Some(Kind::Dispatched(_))))
                .count();
            if dispatches > f.run.delegations.len() {
                out.redispatched += 1;
            }
            out.runs.push((format!("{what}: run {id}"), f));
        }
        let runs = &out.runs[first..];
        check(runs);
        let executed = executed_under(&mesh.data_dir());
        for (label, f) in runs {
            assert_executed_under_planned_ids(&executed, f, label);
        }
        let hit = ids.iter().filter(|id| interrupted.contains(*id)).count();
        out.interrupted += hit;
        eprintln!(
            "{name}: {what} done at {:?} (replica {replica}, {hit} of {} runs interrupted)",
            began.elapsed(),
            ids.len()
        );
    }

    for point in points {
        let afters: BTreeSet<u32> = out.kills[point.name()].iter().copied().collect();
        assert!(afters.len() >= per_point, "{}: {afters:?}", point.name());
    }
    out
}

/// The runs not over yet, straight from the database (asked while no supervisor runs:
/// these are the runs its death interrupted).
async fn unfinished(db: &Database) -> BTreeSet<String> {
    db.fetch_all(sql("SELECT run_id FROM runs WHERE NOT terminal"))
        .await
        .expect("the runs read")
        .iter()
        .map(|r| r.get("run_id").expect("run_id"))
        .collect()
}

/// The runs not in the state an uncrashed run stops in (WAITING_INPUT), with their
/// states, straight from the database: what a stalled cycle shows.
async fn unexpected_states(db: &Database) -> BTreeMap<String, String> {
    db.fetch_all(
        sql("SELECT run_id, state FROM runs WHERE state <> $1")
            .bind(i64::from(v1::RunState::WaitingInput as i32)),
    )
    .await
    .expect("the runs read")
    .iter()
    .map(|r| {
        let state: i64 = r.get("state").expect("state");
        let name = i32::try_from(state)
            .ok()
            .and_then(|s| v1::RunState::try_from(s).ok())
            .map_or_else(|| state.to_string(), |s| s.as_str_name().to_owned());
        (r.get("run_id").expect("run_id"), name)
    })
    .collect()
}
