//! A supervisor killed at each of its crash points, in batches of runs, and restarted:
//! every run finishes exactly as an uncrashed run of the same spec.

use convene_proto::v1;
use convene_supervisor::CrashPoint;

use super::cycle::{CrashTest, Outcome, crash_cycles};
use super::shape::{Shape, assert_once_per_delegation, inspect, shape};
use super::{keyed_spec, start_until_accepted};

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
    let mut t = CrashTest::start("crash test", "crash-test-replica", None).await;
    let (client, credential, db, seed) = (&t.client, &t.credential, &t.db, t.seed);

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
            let f = inspect(client, credential, db, &id).await;
            assert_once_per_delegation(&f, "uncrashed run");
            shapes.push(shape(&f));
        }
        assert_eq!(shapes[0], shapes[1], "uncrashed runs of one spec end alike");
        assert_eq!(
            shapes[0].state,
            "RUN_STATE_WAITING_INPUT JOIN_OUTCOME_CONFLICT_REQUIRES_HUMAN"
        );
        expected.push(shapes.swap_remove(0));
    }

    let outcome = crash_cycles(
        &mut t,
        (&CrashPoint::STATIC, BATCH, PER_POINT),
        |cycle, i| SPECS[i % SPECS.len()](&format!("crash-{seed}-{cycle}-{i}")),
        |runs| {
            for (i, (label, f)) in runs.iter().enumerate() {
                assert_once_per_delegation(f, label);
                assert_eq!(
                    shape(f),
                    expected[i % SPECS.len()],
                    "{label} ends unlike an uncrashed run"
                );
            }
        },
    )
    .await;

    let runs = 2 * SPECS.len() + outcome.runs.len();
    let Outcome {
        kills,
        cycles,
        redispatched,
        takeovers,
        ..
    } = outcome;
    let points: usize = kills.values().map(Vec::len).sum();
    eprintln!(
        "crash test: seed {seed}: {runs} runs, {points} supervisor kills ({kills:?}), \
         {redispatched} runs with delegations dispatched again, {takeovers} of {cycles} \
         restarts under another replica id, {:?}",
        t.began.elapsed()
    );
    assert!(runs >= 100, "{runs} runs");
    assert!(
        redispatched > 0,
        "no crash interrupted a dispatched delegation"
    );
}
