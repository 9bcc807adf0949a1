//! A supervisor killed at each of its crash points, in batches of runs, and restarted:
//! every run finishes exactly as an uncrashed run of the same spec.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Instant;

use crate::harness::{MeshOptions, Mode, TestMesh, Workers, wait_for};
use convene_proto::v1::{self, run_event::Kind};
use convene_supervisor::CrashPoint;

use super::shape::{
    Shape, assert_executed_under_planned_ids, assert_once_per_delegation, executed_under, inspect,
    shape,
};
use super::{
    LIMIT, ONCALL, Rng, accepted, all_terminal, assert_aborted, keyed_spec, no_core_dumps,
    start_until_accepted, supervisor_env,
};

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
    for point in CrashPoint::STATIC {
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
                CrashPoint::STATIC[rng.below(CrashPoint::STATIC.len())],
                1 + rng.below(3) as u32,
            )
        });
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
                    && all_terminal(&client, &credential, ids).await
                {
                    // The point was not reached again: the runs are over all the same.
                    return Ok(false);
                }
                Err(ids.clone())
            })
            .await;
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
    for point in CrashPoint::STATIC {
        let afters: BTreeSet<u32> = kills[point.name()].iter().copied().collect();
        assert!(afters.len() >= PER_POINT, "{}: {afters:?}", point.name());
    }
}
