//! Workers shared by supervisor replicas: every worker registers with every replica, so
//! the runs each replica owns use every worker, and a worker that dies mid-task is
//! replaced under the same delegation ids whichever replica owns the run.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use crate::harness::{MeshOptions, Mode, TestMesh, Workers, wait_until};
use convene_mesh::handles::SupervisorHandle;
use convene_proto::v1::run_event::Kind;
use convene_store::Database;

use super::replicas::postgres_server;
use super::shape::{Finished, assert_once_per_delegation, inspect};
use super::{
    ONCALL, accepted, keyed_spec, profiles_with_faults, replica_env, start_until_accepted,
};

/// Two supervisor replicas on one fresh PostgreSQL database and no workers yet.
struct Pair {
    mesh: TestMesh,
    a: SupervisorHandle,
    b: SupervisorHandle,
    endpoints: [String; 2],
    credential: String,
    db: Database,
}

impl Pair {
    async fn start() -> Option<Self> {
        let server = postgres_server().await?;
        let mut mesh = TestMesh::start(
            Mode::Processes,
            MeshOptions {
                // No worker of the mesh's own: each test's workers register with both.
                workers: vec![Workers {
                    profiles: None,
                    count: 0,
                    capacity: 16,
                }],
                database_url: Some(server),
                supervisor_env: replica_env("replica-a", "2s", "300ms"),
                ..MeshOptions::default()
            },
        )
        .await;
        let b_endpoint = mesh
            .spawn_supervisor("supervisor-b", replica_env("replica-b", "2s", "300ms"))
            .await;
        let endpoints = [mesh.supervisor_endpoint.clone(), b_endpoint];
        Some(Self {
            a: mesh.supervisor(),
            b: mesh.supervisor_at(&endpoints[1]),
            credential: mesh.credential(ONCALL),
            db: mesh.open_database().await,
            endpoints,
            mesh,
        })
    }

    /// Starts a worker registered with both replicas.
    async fn worker(&mut self, id: &str, profiles: &str) {
        let path = self.mesh.write_profiles(id, profiles);
        let [a, b] = &self.endpoints;
        self.mesh
            .spawn_worker_with(id, &path, 16, &[a.as_str(), b.as_str()])
            .await;
    }

    async fn start_runs(&self, client: &SupervisorHandle, keys: Vec<String>) -> Vec<String> {
        let tasks = keys
            .iter()
            .map(|k| {
                tokio::spawn(start_until_accepted(
                    client.clone(),
                    self.credential.clone(),
                    keyed_spec(k),
                ))
            })
            .collect();
        accepted(tasks).await
    }

    async fn finished(&self, ids: &[String]) -> Vec<Finished> {
        let mut out = Vec::new();
        for id in ids {
            let f = inspect(&self.b, &self.credential, &self.db, id).await;
            assert_once_per_delegation(&f, &format!("run {id}"));
            out.push(f);
        }
        out
    }

    async fn owner(&self, run_id: &str) -> Option<String> {
        super::run_owner(&self.db, run_id).await
    }
}

/// Each delegation's dispatches in order: (worker, attempt).
fn dispatches(f: &Finished) -> BTreeMap<String, Vec<String>> {
    let mut by_id: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for e in &f.events {
        if let Some(Kind::Dispatched(d)) = &e.kind {
            by_id
                .entry(d.delegation_id.clone())
                .or_default()
                .push(d.worker_id.clone());
        }
    }
    by_id
}

fn keys(prefix: &str, n: usize) -> Vec<String> {
    (0..n).map(|i| format!("{prefix}-{i}")).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runs_started_on_either_replica_use_all_three_workers() {
    let Some(mut p) = Pair::start().await else {
        return;
    };
    // Each delegation takes a moment, so a run's three delegations are in flight
    // together and spread over the workers.
    let held = profiles_with_faults("{ delay: 300ms }");
    for id in ["worker-1", "worker-2", "worker-3"] {
        p.worker(id, &held).await;
    }
    let (a, b) = (p.a.clone(), p.b.clone());
    let (on_a, on_b) = tokio::join!(
        p.start_runs(&a, keys("shared-a", 6)),
        p.start_runs(&b, keys("shared-b", 6))
    );
    let all: BTreeSet<&str> = ["worker-1", "worker-2", "worker-3"].into();
    for (replica, ids) in [("replica-a", &on_a), ("replica-b", &on_b)] {
        let mut used: BTreeSet<String> = BTreeSet::new();
        for f in p.finished(ids).await {
            used.extend(dispatches(&f).into_values().flatten());
        }
        let used: BTreeSet<&str> = used.iter().map(String::as_str).collect();
        assert_eq!(
            used, all,
            "the runs started on {replica} used only some of the workers"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_killed_mid_task_is_replaced_under_the_same_ids_on_either_replica() {
    let Some(mut p) = Pair::start().await else {
        return;
    };
    // worker-1 holds each delegation a second (so both replicas' runs reach it), then
    // exits once its first tool calls are done: gone mid-task, evidence half-written.
    p.worker(
        "worker-1",
        &profiles_with_faults("{ delay: 1s, exit_process_after_tools: true }"),
    )
    .await;
    let (a, b) = (p.a.clone(), p.b.clone());
    let (on_a, on_b) = tokio::join!(
        p.start_runs(&a, keys("dying-a", 1)),
        p.start_runs(&b, keys("dying-b", 1))
    );
    assert_eq!(p.owner(&on_a[0]).await.as_deref(), Some("replica-a"));
    assert_eq!(p.owner(&on_b[0]).await.as_deref(), Some("replica-b"));
    wait_until("worker-1 to die", Duration::from_secs(30), async || {
        p.mesh.exited("worker-1")
    })
    .await;
    // A healthy worker joins both replicas; each re-dispatches its runs to it.
    p.worker("worker-2", &profiles_with_faults("{}")).await;

    for (replica, id) in [("replica-a", &on_a[0]), ("replica-b", &on_b[0])] {
        let f = p.finished(std::slice::from_ref(id)).await.remove(0);
        let by_id = dispatches(&f);
        let planned: BTreeSet<String> = f
            .run
            .delegations
            .iter()
            .filter_map(|d| d.task.as_ref().map(|t| t.delegation_id.clone()))
            .collect();
        assert_eq!(
            by_id.keys().cloned().collect::<BTreeSet<_>>(),
            planned,
            "{replica}: every dispatch under a planned delegation id"
        );
        for (delegation, workers) in &by_id {
            assert_eq!(
                workers.first().map(String::as_str),
                Some("worker-1"),
                "{replica} {delegation}: {workers:?}"
            );
            assert_eq!(
                workers.last().map(String::as_str),
                Some("worker-2"),
                "{replica} {delegation}: {workers:?}"
            );
        }
        for d in &f.run.delegations {
            assert_eq!(d.worker_id, "worker-2", "{replica}: {d:#?}");
            assert!(d.attempts >= 2, "{replica}: {d:#?}");
        }
    }
}
