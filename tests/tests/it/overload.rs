//! Overload through the real services, every service its own process: far more
//! StartRuns at once than the supervisor's `max_active_runs` admits. The runs it takes
//! all end; the others are refused at once with RESOURCE_EXHAUSTED and a retry hint,
//! and nothing of them is stored; the supervisor's memory stays bounded; a refused run
//! started again later (the same idempotency key) runs whole, once.

use std::collections::BTreeSet;
use std::time::Duration;

use crate::harness::{MeshOptions, Mode, TestMesh, Workers, example_spec, wait_for};
use crate::runs::held_profiles;
use convene_mesh::auth::request;
use convene_proto::v1::{self, supervisor_client::SupervisorClient};
use tonic::Code;
use tonic::transport::Channel;

const ONCALL: &str = "oncall@acme";
/// Runs the supervisor takes at once.
const MAX_ACTIVE: usize = 6;
/// StartRuns offered at once: many times what it takes.
const OFFERED: usize = 120;
/// The supervisor's peak resident memory, at most: the Kubernetes manifests' limit.
const MEMORY_BOUND: u64 = 256 * 1024 * 1024;
/// Generous: every service is a process of its own on a machine that may be loaded.
const LIMIT: Duration = Duration::from_secs(120);

fn spec(i: usize) -> v1::RunSpec {
    let mut spec = example_spec();
    spec.idempotency_key = format!("overload-{i}");
    spec
}

/// A StartRun as a caller without retries sends it: every refusal is seen.
async fn start(
    client: &SupervisorClient<Channel>,
    credential: &str,
    i: usize,
) -> Result<String, tonic::Status> {
    let run = client
        .clone()
        .start_run(request(
            v1::StartRunRequest {
                spec: Some(spec(i)),
                ..Default::default()
            },
            credential,
        ))
        .await?
        .into_inner()
        .run
        .expect("an accepted StartRun answers with the run");
    Ok(run.run_id)
}

/// Every run the tenant can see, over all pages.
async fn all_runs(client: &SupervisorClient<Channel>, credential: &str) -> Vec<v1::Run> {
    let mut runs = Vec::new();
    let mut page_token = String::new();
    loop {
        let page = client
            .clone()
            .list_runs(request(
                v1::ListRunsRequest {
                    page_size: 100,
                    page_token: page_token.clone(),
                    ..Default::default()
                },
                credential,
            ))
            .await
            .expect("ListRuns")
            .into_inner();
        runs.extend(page.runs);
        if page.next_page_token.is_empty() {
            return runs;
        }
        page_token = page.next_page_token;
    }
}

/// The peak resident set size of process `pid` (`VmHWM`), in bytes.
fn peak_rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("proc status");
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmHWM in /proc/<pid>/status");
    kib * 1024
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_supervisor_refuses_at_once_and_loses_nothing() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let release = dir.path().join("release");
    let mesh = TestMesh::start(
        Mode::Processes,
        MeshOptions {
            // The workers hold every delegation until `release` exists: no run the
            // supervisor took can end while the StartRuns are offered.
            workers: vec![Workers {
                profiles: Some(held_profiles(&release, None)),
                count: 1,
                capacity: 64,
            }],
            supervisor_env: vec![("CONVENE_MAX_ACTIVE_RUNS".to_owned(), MAX_ACTIVE.to_string())],
            ..MeshOptions::default()
        },
    )
    .await;
    let credential = mesh.credential(ONCALL);
    let client = SupervisorClient::connect(mesh.supervisor_endpoint.clone())
        .await
        .expect("the supervisor answers");

    // All at once.
    let answers = futures::future::join_all((0..OFFERED).map(|i| {
        let (client, credential) = (&client, &credential);
        async move { (i, start(client, credential, i).await) }
    }))
    .await;
    let mut accepted = BTreeSet::new();
    let mut refused = Vec::new();
    for (i, answer) in answers {
        match answer {
            Ok(run_id) => {
                accepted.insert(run_id);
            }
            Err(status) => {
                assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
                assert!(
                    status.message().contains("max_active_runs"),
                    "the refusal names the limit: {status:?}"
                );
                assert_eq!(
                    convene_server::retry_after(&status),
                    Some(Duration::from_secs(1)),
                    "the refusal says when to retry: {status:?}"
                );
                refused.push(i);
            }
        }
    }
    assert_eq!(
        accepted.len(),
        MAX_ACTIVE,
        "exactly as many runs as admitted"
    );
    assert_eq!(refused.len(), OFFERED - MAX_ACTIVE);

    // Nothing of a refused run was stored: the tenant sees exactly the accepted runs.
    let listed: BTreeSet<String> = all_runs(&client, &credential)
        .await
        .into_iter()
        .map(|r| r.run_id)
        .collect();
    assert_eq!(listed, accepted);

    let pid = mesh.pid("supervisor").expect("the supervisor runs");
    let peak = peak_rss(pid);
    assert!(
        peak < MEMORY_BOUND,
        "the supervisor peaked at {} MiB with {OFFERED} StartRuns offered at once",
        peak / (1024 * 1024)
    );

    // Every accepted run ends, as an unloaded one does: the example stops for a person
    // to settle its conflict, with a decision.
    std::fs::write(&release, b"go").expect("release file");
    for run_id in &accepted {
        let run = mesh.wait_terminal(ONCALL, run_id, LIMIT).await;
        assert_eq!(run.state, v1::RunState::WaitingInput as i32, "{run:#?}");
        assert!(run.decision.is_some(), "{run:#?}");
    }

    // Refused runs started again, with their keys, as the hint says: each runs once.
    let mut waiting = refused;
    let mut later = BTreeSet::new();
    let again = wait_for("every refused run to be taken", LIMIT, async || {
        let mut still = Vec::new();
        for &i in &waiting {
            match start(&client, &credential, i).await {
                Ok(run_id) => {
                    later.insert(run_id);
                }
                Err(status) if status.code() == Code::ResourceExhausted => still.push(i),
                Err(status) => panic!("run {i} started again: {status:?}"),
            }
        }
        waiting = still;
        if waiting.is_empty() {
            Ok(std::mem::take(&mut later))
        } else {
            tokio::time::sleep(Duration::from_secs(1)).await;
            Err(waiting.len())
        }
    })
    .await;
    assert_eq!(again.len(), OFFERED - MAX_ACTIVE);
    assert!(again.is_disjoint(&accepted));
    for run_id in &again {
        let run = mesh.wait_terminal(ONCALL, run_id, LIMIT).await;
        assert_eq!(run.state, v1::RunState::WaitingInput as i32, "{run:#?}");
    }
    let runs = all_runs(&client, &credential).await;
    assert_eq!(
        runs.len(),
        OFFERED,
        "one run per key, none lost, none twice"
    );
}
