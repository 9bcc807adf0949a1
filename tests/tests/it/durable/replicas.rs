//! Two supervisor replicas on one PostgreSQL database: they share the load, one finishes
//! the runs of the other when it dies, and one that stalls past its leases never writes
//! over the replica that took its runs.

use std::collections::BTreeSet;
use std::time::Instant;

use crate::harness::{MeshOptions, Mode, TestMesh, Workers, wait_until};
use convene_mesh::handles::SupervisorHandle;
use convene_proto::v1::run_event::Kind;
use convene_store::test_util::POSTGRES;
use convene_store::{Database, sql};

use super::shape::{
    Shape, assert_executed_under_planned_ids, assert_once_per_delegation, executed_under, inspect,
    shape,
};
use super::{
    LIMIT, ONCALL, accepted, keyed_spec, profiles_with_faults, replica_env, start_until_accepted,
};

/// The local PostgreSQL server the replica test tries when none is named.
const DEFAULT_POSTGRES: &str = "postgres://postgres@127.0.0.1:5432/postgres";

/// The PostgreSQL server for the replica tests: `CONVENE_TEST_POSTGRES_URL`, else the
/// local default. Replicas share their runs through PostgreSQL, so without a server
/// that answers the test cannot run: it is skipped, saying so, unless services are
/// required. A server the variable names must answer.
///
/// They run where the whole suite runs on PostgreSQL (`CONVENE_TEST_DATABASE_URL`, the
/// second pass of `.ci/run`): in a pass on SQLite they would only repeat themselves.
pub(super) async fn postgres_server() -> Option<String> {
    let on_postgres = std::env::var(crate::harness::DATABASE_ENV)
        .is_ok_and(|url| url.trim_start().starts_with("postgres"));
    if !on_postgres {
        eprintln!(
            "the replica tests run where the whole suite runs on PostgreSQL: set {} (the \
             second pass of .ci/run does)",
            crate::harness::DATABASE_ENV
        );
        return None;
    }
    let named = convene_store::test_util::postgres_server();
    let url = named.clone().unwrap_or_else(|| DEFAULT_POSTGRES.to_owned());
    match convene_store::test_util::TestPostgres::create(&url).await {
        Ok(_) => Some(url),
        Err(e) if named.is_none() => {
            POSTGRES.missing(&format!(
                "is not configured and does not answer at {} ({e})",
                convene_store::redact(&url)
            ));
            None
        }
        Err(e) => panic!(
            "two supervisor replicas need a PostgreSQL server to share, and none answers at {} \
             ({e}); start one, or name one in {}",
            convene_store::redact(&url),
            convene_store::test_util::POSTGRES_ENV
        ),
    }
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
    /// None when the test is skipped for want of PostgreSQL.
    async fn start() -> Option<Self> {
        let server = postgres_server().await?;
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
        Some(Self {
            mesh,
            a,
            b,
            credential,
            db,
            expected: expected.expect("a baseline"),
        })
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
        super::run_owner(&self.db, run_id).await
    }

    /// The runs among `ids` that replica B dispatched to its worker.
    async fn dispatched_by_b(&self, ids: &[String]) -> Vec<String> {
        let mut by_b = Vec::new();
        for id in ids {
            let f = inspect(&self.b, &self.credential, &self.db, id).await;
            let to_b = f
                .events
                .iter()
                .any(|e| matches!(&e.kind, Some(Kind::Dispatched(d)) if d.worker_id == "worker-b"));
            if to_b {
                by_b.push(id.clone());
            }
        }
        by_b
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
    let Some(mut r) = Replicas::start().await else {
        return;
    };
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
    // A's unfinished runs were B's next: B claimed them once A's leases ran out and
    // dispatched them to its own worker (a waiting run is nobody's, so the lease does
    // not say it). (A commit A had sent just before it died may still land after
    // `orphans` was read: that run ends as A's, finished alike all the same.)
    let taken = r.dispatched_by_b(&orphans).await;
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
    let Some(mut r) = Replicas::start().await else {
        return;
    };
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
    wait_until("replica B to take A's runs over", LIMIT, async || {
        for id in &stalled {
            let open = !r.unfinished(std::slice::from_ref(id)).await.is_empty();
            if open && r.owner(id).await.as_deref() != Some("replica-b") {
                return false;
            }
        }
        true
    })
    .await;
    let taken = r.dispatched_by_b(&stalled).await;
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
