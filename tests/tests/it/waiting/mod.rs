//! Runs that wait for people and resume when they act: the payment incident's conflict
//! settled by a person, its R3 rollback approved and executed (or rejected, or left to
//! expire), a follow-up a person asks for, stale tickets and missing roles, and
//! cancelling a waiting run.

mod approvals;
mod resolve;

use std::collections::BTreeMap;
use std::time::Duration;

use crate::harness::{Mode, TestMesh, wait_for};
use convene_mesh::auth::request;
use convene_proto::v1::{self, approval_server::Approval as _};
use futures::StreamExt as _;

const ONCALL: &str = "oncall@acme";
const ALICE: &str = "alice@acme";
const BOB: &str = "bob@acme";
const LIMIT: Duration = Duration::from_secs(30);

/// The example's run, waiting for input: its conflict on `primary_cause` is open.
async fn waiting_incident(mesh: &TestMesh) -> v1::Run {
    let run_id = mesh
        .start_run_id(ONCALL, crate::harness::example_spec())
        .await;
    let run = mesh.wait_terminal(ONCALL, &run_id, LIMIT).await;
    assert_eq!(
        run.state,
        v1::RunState::WaitingInput as i32,
        "the open conflict holds the run: {run:#?}"
    );
    run
}

/// The delegation of `run` named `name`.
fn delegation(run: &v1::Run, name: &str) -> String {
    run.delegations
        .iter()
        .filter_map(|d| d.task.as_ref())
        .find(|t| t.name == name)
        .map(|t| t.delegation_id.clone())
        .unwrap_or_else(|| panic!("no delegation {name}"))
}

/// ResumeRun as `principal` with the run's current ticket.
async fn resume(
    mesh: &TestMesh,
    principal: &str,
    run: &v1::Run,
    input: v1::resume_run_request::Input,
    rationale: &str,
) -> Result<v1::ResumeRunResponse, tonic::Status> {
    resume_with(mesh, principal, run, run.ticket.clone(), input, rationale).await
}

async fn resume_with(
    mesh: &TestMesh,
    principal: &str,
    run: &v1::Run,
    ticket: Option<v1::RunTicket>,
    input: v1::resume_run_request::Input,
    rationale: &str,
) -> Result<v1::ResumeRunResponse, tonic::Status> {
    mesh.supervisor()
        .resume_run(request(
            v1::ResumeRunRequest {
                run_id: run.run_id.clone(),
                ticket,
                rationale: rationale.to_owned(),
                input: Some(input),
            },
            &mesh.credential(principal),
        ))
        .await
        .map(tonic::Response::into_inner)
}

/// Settles `primary_cause` for the risk-rule change (the change auditor's side).
fn settle_for_the_rule_change(run: &v1::Run) -> v1::resume_run_request::Input {
    v1::resume_run_request::Input::Settle(v1::SettleConflict {
        topic: "primary_cause".to_owned(),
        delegation_id: delegation(run, "changes"),
        evidence_ids: Vec::new(),
    })
}

/// Votes on the run's one approval request as `principal`, bound to its hash.
async fn vote(mesh: &TestMesh, principal: &str, approval_id: &str, decision: v1::VoteDecision) {
    let hash = approval(mesh, approval_id).await.parameters_hash;
    mesh.approval()
        .decide(request(
            v1::DecideRequest {
                approval_id: approval_id.to_owned(),
                decision: decision as i32,
                parameters_hash: hash,
                comment: String::new(),
            },
            &mesh.credential(principal),
        ))
        .await
        .unwrap_or_else(|s| panic!("{principal} votes: {s:?}"));
}

async fn approval(mesh: &TestMesh, approval_id: &str) -> v1::ApprovalRequest {
    mesh.approval()
        .get_approval(request(
            v1::GetApprovalRequest {
                approval_id: approval_id.to_owned(),
            },
            &mesh.credential(ONCALL),
        ))
        .await
        .expect("GetApproval")
        .into_inner()
        .approval
        .expect("approval")
}

/// Waits until the run is in `state`.
async fn wait_state(mesh: &TestMesh, run_id: &str, state: v1::RunState) -> v1::Run {
    wait_for(
        &format!("run {run_id} to be {}", state.as_str_name()),
        LIMIT,
        async || {
            let run = mesh.get_run(ONCALL, run_id).await;
            if run.state == state as i32 {
                Ok(run)
            } else {
                Err(run)
            }
        },
    )
    .await
}

/// How many CloudEvents of each type the run has in the supervisor's outbox.
async fn cloud_events(mesh: &TestMesh, run_id: &str) -> BTreeMap<String, usize> {
    let mut stream = mesh
        .supervisor()
        .watch_events(request(
            v1::WatchEventsRequest {
                run_id: run_id.to_owned(),
                follow: false,
                ..Default::default()
            },
            &mesh.credential(ONCALL),
        ))
        .await
        .expect("WatchEvents")
        .into_inner();
    let mut counts = BTreeMap::new();
    while let Some(e) = stream.next().await {
        let e = e.expect("event").event.expect("event");
        *counts.entry(e.r#type).or_default() += 1;
    }
    counts
}

/// The run's events of one kind.
fn kinds(events: &[v1::RunEvent]) -> Vec<&'static str> {
    use v1::run_event::Kind;
    events
        .iter()
        .filter_map(|e| {
            Some(match e.kind.as_ref()? {
                Kind::Started(_) => "started",
                Kind::Dispatched(_) => "dispatched",
                Kind::Completed(_) => "completed",
                Kind::Decision(_) => "decision",
                Kind::Terminal(_) => "terminal",
                Kind::Planned(_) => "planned",
                Kind::Waiting(_) => "waiting",
                Kind::Resumed(_) => "resumed",
            })
        })
        .collect()
}

#[allow(dead_code)]
fn modes() -> [Mode; 2] {
    [Mode::InProcess, Mode::Processes]
}
