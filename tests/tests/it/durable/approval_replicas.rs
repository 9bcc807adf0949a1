//! Two approval service replicas on one PostgreSQL database, every service its own
//! process, under pause (SIGSTOP/SIGCONT) and kill (SIGKILL and restart) nemeses, while
//! requests are filed, voted on and executed through either replica (a call that gets no
//! answer in time is asked again, of either replica): every request ends with each
//! approver's vote recorded once and one execution, its events in lifecycle order, and
//! both replicas answer the same for it.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use convene_mesh::auth::request;
use convene_mesh::handles::GrpcApproval;
use convene_proto::json::to_struct;
use convene_proto::v1::{self, RiskLevel, VoteDecision, approval_server::Approval as _};
use futures::StreamExt as _;
use rustix::process::Signal;
use serde_json::json;
use tonic::{Code, Status};

use super::replicas::postgres_server;
use super::{ONCALL, Rng};
use crate::harness::{MeshOptions, Mode, TestMesh, Workers};

const REQUESTS: usize = 36;
/// How long one call may go unanswered before it is asked again.
const CALL_TIMEOUT: Duration = Duration::from_secs(2);
/// How long a request's whole life may take, faults included.
const PATIENCE: Duration = Duration::from_secs(90);

/// Both replicas' clients, and which one to ask next.
#[derive(Clone)]
struct Replicas {
    clients: [GrpcApproval; 2],
}

/// What a retried call ended as.
enum Answer<T> {
    Done(T),
    /// The effect is in place already (a vote recorded by an earlier try).
    AlreadyDone,
}

impl Replicas {
    /// Calls `call` on a replica drawn from `rng` until it answers, or answers that its
    /// effect is in place (an earlier try landed); asks again on no answer, a transient
    /// refusal, or an execution another call is finishing.
    async fn until_done<T, F, Fut>(&self, what: &str, rng: &mut Rng, call: F) -> Answer<T>
    where
        F: Fn(GrpcApproval) -> Fut,
        Fut: std::future::Future<Output = Result<T, Status>>,
    {
        let began = Instant::now();
        loop {
            let client = self.clients[rng.below(2)].clone();
            match tokio::time::timeout(CALL_TIMEOUT, call(client)).await {
                Ok(Ok(answer)) => return Answer::Done(answer),
                Ok(Err(s)) if s.message().contains("already voted") => {
                    return Answer::AlreadyDone;
                }
                Ok(Err(s))
                    if matches!(
                        s.code(),
                        Code::Unavailable
                            | Code::DeadlineExceeded
                            | Code::Cancelled
                            | Code::Unknown
                            | Code::Aborted
                            | Code::Internal
                    ) => {}
                Ok(Err(s)) => panic!("{what}: refused: {s:?}"),
                Err(_) => {}
            }
            assert!(
                began.elapsed() < PATIENCE,
                "{what}: no replica answered for {PATIENCE:?}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

fn call_of<T>(msg: T, credential: &str) -> tonic::Request<T> {
    let mut req = request(msg, credential);
    req.set_timeout(CALL_TIMEOUT);
    req
}

/// Files request `i`, has alice and bob approve it and alice execute it, each through
/// either replica; returns its id.
async fn life(
    replicas: Replicas,
    credentials: BTreeMap<&'static str, String>,
    i: usize,
    seed: u64,
) -> String {
    let mut rng = Rng(seed ^ (i as u64).wrapping_mul(0x9e37_79b9));
    let supervisor = credentials["supervisor"].clone();
    let filed = replicas
        .until_done(&format!("request {i}: filing"), &mut rng, |client| {
            let msg = v1::RequestApprovalRequest {
                action: "rule:rollback".into(),
                parameters: Some(to_struct(
                    &json!({"rule": "risk-rule-17", "to_version": 3, "n": i}),
                )),
                risk_level: RiskLevel::R3 as i32,
                idempotency_key: format!("approval-replicas-{seed}-{i}"),
                run_id: format!("run-{i}"),
                on_behalf_of: ONCALL.into(),
                ..Default::default()
            };
            let credential = supervisor.clone();
            async move {
                Ok(client
                    .request_approval(call_of(msg, &credential))
                    .await?
                    .into_inner()
                    .approval
                    .expect("the request"))
            }
        })
        .await;
    let Answer::Done(filed) = filed else {
        unreachable!("filing is idempotent by key")
    };
    let (id, hash) = (filed.approval_id.clone(), filed.parameters_hash.clone());
    for approver in ["alice@acme", "bob@acme"] {
        let credential = credentials[approver].clone();
        replicas
            .until_done(
                &format!("request {i}: {approver}'s vote"),
                &mut rng,
                |client| {
                    let msg = v1::DecideRequest {
                        approval_id: id.clone(),
                        decision: VoteDecision::Approve as i32,
                        parameters_hash: hash.clone(),
                        comment: String::new(),
                    };
                    let credential = credential.clone();
                    async move { client.decide(call_of(msg, &credential)).await.map(|_| ()) }
                },
            )
            .await;
    }
    let alice = credentials["alice@acme"].clone();
    replicas
        .until_done(&format!("request {i}: execution"), &mut rng, |client| {
            let msg = v1::ApprovalExecuteRequest {
                approval_id: id.clone(),
                parameters_hash: hash.clone(),
            };
            let credential = alice.clone();
            async move { client.execute(call_of(msg, &credential)).await.map(|_| ()) }
        })
        .await;
    id
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_approval_replicas_keep_votes_and_executions_exactly_once_under_pauses_and_a_kill() {
    let began = Instant::now();
    let Some(server) = postgres_server().await else {
        return;
    };
    let (mut rng, seed) = Rng::seeded();
    eprintln!("approval replicas seed {seed} (CONVENE_TEST_SEED={seed} repeats it)");
    let mut mesh = TestMesh::start(
        Mode::Processes,
        MeshOptions {
            workers: vec![Workers {
                profiles: None,
                count: 0,
                capacity: 1,
            }],
            database_url: Some(server),
            ..MeshOptions::default()
        },
    )
    .await;
    let b_endpoint = mesh.spawn_approval("approval-b").await;
    let replicas = Replicas {
        clients: [
            mesh.approval(),
            GrpcApproval::connect(&b_endpoint).expect("endpoint"),
        ],
    };
    let credentials: BTreeMap<&'static str, String> = ["supervisor", "alice@acme", "bob@acme"]
        .into_iter()
        .map(|p| (p, mesh.credential(p)))
        .collect();

    // Requests live their lives a few at a time while the nemeses act.
    let lives = {
        let replicas = replicas.clone();
        let credentials = credentials.clone();
        tokio::spawn(async move {
            let mut ids = Vec::with_capacity(REQUESTS);
            for batch in (0..REQUESTS).collect::<Vec<_>>().chunks(6) {
                let tasks: Vec<_> = batch
                    .iter()
                    .map(|&i| tokio::spawn(life(replicas.clone(), credentials.clone(), i, seed)))
                    .collect();
                for t in tasks {
                    ids.push(t.await.expect("a request's life"));
                }
            }
            ids
        })
    };
    let mut pauses = 0;
    for _ in 0..3 {
        tokio::time::sleep(Duration::from_millis(300 + rng.next() % 700)).await;
        let name = if rng.below(2) == 0 {
            "approval"
        } else {
            "approval-b"
        };
        mesh.signal(name, Signal::STOP);
        tokio::time::sleep(Duration::from_millis(1500 + rng.next() % 1500)).await;
        mesh.signal(name, Signal::CONT);
        pauses += 1;
    }
    tokio::time::sleep(Duration::from_millis(300 + rng.next() % 700)).await;
    mesh.kill("approval-b").await;
    tokio::time::sleep(Duration::from_millis(500 + rng.next() % 1000)).await;
    assert!(
        mesh.restart("approval-b", Vec::new()).await,
        "approval-b came back"
    );
    let ids = lives.await.expect("the requests");

    // Each request: both votes once, one execution, and both replicas say the same.
    let alice = &credentials["alice@acme"];
    for id in &ids {
        let mut seen = Vec::new();
        for client in &replicas.clients {
            let approval = client
                .get_approval(call_of(
                    v1::GetApprovalRequest {
                        approval_id: id.clone(),
                    },
                    alice,
                ))
                .await
                .unwrap_or_else(|s| panic!("{id}: a replica does not answer: {s:?}"))
                .into_inner()
                .approval
                .expect("the request");
            seen.push(approval);
        }
        assert_eq!(seen[0], seen[1], "{id}: both replicas answer alike");
        let approval = &seen[0];
        assert_eq!(
            approval.state,
            v1::ApprovalState::Executed as i32,
            "{approval:#?}"
        );
        let mut voters: Vec<&str> = approval.votes.iter().map(|v| v.approver.as_str()).collect();
        voters.sort_unstable();
        assert_eq!(voters, ["alice@acme", "bob@acme"], "{id}: each vote once");
    }
    // The events: per request, requested, two decisions, one execution, in that order.
    let mut stream = replicas.clients[1]
        .watch_events(call_of(
            v1::ApprovalWatchEventsRequest {
                after_event_id: String::new(),
                follow: false,
                run_id: String::new(),
            },
            &credentials["supervisor"],
        ))
        .await
        .expect("WatchEvents")
        .into_inner();
    let mut by_request: BTreeMap<String, Vec<String>> = BTreeMap::new();
    while let Some(item) = stream.next().await {
        let event = item.expect("an event").event.expect("event set");
        let kind = event
            .r#type
            .rsplit('.')
            .nth(1)
            .unwrap_or_default()
            .to_owned();
        by_request
            .entry(event.subject.trim_start_matches("approvals/").to_owned())
            .or_default()
            .push(kind);
    }
    for id in &ids {
        assert_eq!(
            by_request.get(id).map(Vec::as_slice),
            Some(&["requested", "decided", "decided", "executed"].map(str::to_owned)[..]),
            "{id}: its events, once each, in order"
        );
    }
    eprintln!(
        "approval replicas: {} requests through two replicas, {pauses} pauses and a kill; every \
         vote and execution once, events in order; {:?}",
        ids.len(),
        began.elapsed()
    );
}
