//! Supervisors killed around runs that wait for people: while runs wait, while a run
//! resumes with a person's input (the command taken, its effect not committed), and
//! between an approval request's decision and the run's reaction (the approval event
//! received, not stored). Nothing is lost: every input is applied once, no action runs
//! twice, and each run ends with exactly one `run.completed`.

use std::collections::BTreeMap;

use convene_mesh::auth::request;
use convene_proto::v1::{self, approval_server::Approval as _};
use convene_supervisor::CrashPoint;

use super::cycle::CrashTest;
use super::{
    LIMIT, assert_aborted, get_run, keyed_spec, outbox, start_until_accepted, supervisor_env,
};
use crate::harness::wait_for;

const RUNS: usize = 3;
const ALICE: &str = "alice@acme";
const BOB: &str = "bob@acme";

/// Waits until `run_id` is in `state`, through a supervisor that may be restarting.
async fn wait_state(t: &CrashTest, run_id: &str, state: v1::RunState) -> v1::Run {
    wait_for(
        &format!("run {run_id} to be {}", state.as_str_name()),
        LIMIT,
        async || match get_run(&t.client, &t.credential, run_id).await {
            Some(run) if run.state == state as i32 => Ok(run),
            run => Err(run.map(|r| r.state)),
        },
    )
    .await
}

/// Settles the run's `primary_cause` for the change auditor, as on-call; the call's
/// answer is not awaited past a crash.
async fn settle(t: &CrashTest, run: &v1::Run) -> Result<v1::ResumeRunResponse, tonic::Status> {
    let changes = run
        .delegations
        .iter()
        .filter_map(|d| d.task.as_ref())
        .find(|d| d.name == "changes")
        .expect("changes")
        .delegation_id
        .clone();
    t.client
        .resume_run(request(
            v1::ResumeRunRequest {
                run_id: run.run_id.clone(),
                ticket: run.ticket.clone(),
                rationale: "the rule change preceded the errors".to_owned(),
                input: Some(v1::resume_run_request::Input::Settle(v1::SettleConflict {
                    topic: "primary_cause".to_owned(),
                    delegation_id: changes,
                    evidence_ids: Vec::new(),
                })),
            },
            &t.credential,
        ))
        .await
        .map(tonic::Response::into_inner)
}

/// The parameters hash of a request, as `principal` reads it.
async fn hash_of(t: &CrashTest, approval_id: &str, principal: &str) -> String {
    t.mesh
        .approval()
        .get_approval(request(
            v1::GetApprovalRequest {
                approval_id: approval_id.to_owned(),
            },
            &t.mesh.credential(principal),
        ))
        .await
        .expect("GetApproval")
        .into_inner()
        .approval
        .expect("approval")
        .parameters_hash
}

/// Votes to approve the run's request as `principal`, bound to its hash.
async fn approve(t: &CrashTest, approval_id: &str, principal: &str) {
    let hash = hash_of(t, approval_id, principal).await;
    t.mesh
        .approval()
        .decide(request(
            v1::DecideRequest {
                approval_id: approval_id.to_owned(),
                decision: v1::VoteDecision::Approve as i32,
                parameters_hash: hash,
                comment: String::new(),
            },
            &t.mesh.credential(principal),
        ))
        .await
        .expect("Decide");
}

async fn execute(t: &CrashTest, approval_id: &str) -> v1::ApprovalExecuteResponse {
    let hash = hash_of(t, approval_id, ALICE).await;
    t.mesh
        .approval()
        .execute(request(
            v1::ApprovalExecuteRequest {
                approval_id: approval_id.to_owned(),
                parameters_hash: hash,
            },
            &t.mesh.credential(ALICE),
        ))
        .await
        .expect("Execute")
        .into_inner()
}

/// Restarts the supervisor as itself, armed with `crash` if given.
async fn restart(t: &mut CrashTest, crash: Option<(CrashPoint, u32)>) {
    let env = supervisor_env(t.replica, crash);
    assert!(
        t.mesh.restart("supervisor", env).await,
        "the supervisor restarts"
    );
}

/// Waits for the supervisor to abort at its crash point.
async fn aborted(t: &mut CrashTest, what: &str) {
    assert!(
        t.mesh.wait_exited("supervisor", LIMIT).await,
        "the supervisor did not reach its crash point ({what})"
    );
    assert_aborted(&mut t.mesh, "supervisor", what);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn supervisors_killed_while_runs_wait_resume_and_react_to_approvals_lose_nothing() {
    let mut t = CrashTest::start("waiting crash test", "waiting-crash-replica", None).await;
    let mut ids = Vec::new();
    for i in 0..RUNS {
        let key = format!("waiting-{}-{i}", t.seed);
        ids.push(
            start_until_accepted(t.client.clone(), t.credential.clone(), keyed_spec(&key)).await,
        );
    }
    let mut waiting = Vec::new();
    for id in &ids {
        waiting.push(wait_state(&t, id, v1::RunState::WaitingInput).await);
    }

    // Killed while the runs wait: they wait on, under the same tickets.
    t.mesh.kill("supervisor").await;
    restart(&mut t, None).await;
    for run in &waiting {
        let again = wait_state(&t, &run.run_id, v1::RunState::WaitingInput).await;
        assert_eq!(again.ticket, run.ticket, "the wait and its ticket survive");
        assert_eq!(again.version, run.version, "nothing was written");
    }

    // Killed while a run resumes: the settlement is taken, its effect not committed.
    restart(&mut t, Some((CrashPoint::CommandReceived, 1))).await;
    let refused = settle(&t, &waiting[0]).await;
    aborted(&mut t, "a person's input taken").await;
    eprintln!("waiting crash test: the settling call saw the crash as {refused:?}");
    restart(&mut t, None).await;
    // The stored input is applied once by the restarted supervisor (a command nobody
    // applied is pending; it is applied when the run is claimed for it).
    let settled = wait_state(&t, &waiting[0].run_id, v1::RunState::WaitingApproval).await;
    assert_eq!(settled.human_decisions.len(), 1, "{settled:#?}");
    for run in &waiting[1..] {
        let answer = settle(&t, run).await.expect("ResumeRun");
        assert_eq!(answer.outcome, v1::CommandOutcome::Applied as i32);
    }

    // Killed between an approval's decision and the run's reaction: the event arrived,
    // it was not stored; the restarted supervisor reads it again from its cursor.
    restart(&mut t, Some((CrashPoint::ApprovalEventReceived, 1))).await;
    let first = settled.actions[0].approval_id.clone();
    approve(&t, &first, ALICE).await;
    aborted(&mut t, "an approval event received").await;
    restart(&mut t, None).await;
    wait_for(
        "the run to see alice's vote",
        LIMIT,
        async || match get_run(&t.client, &t.credential, &settled.run_id).await {
            Some(run) if run.actions[0].decided_by == [ALICE] => Ok(()),
            run => Err(run.map(|r| r.actions)),
        },
    )
    .await;

    // And killed as a run takes an approval's change: the command stays pending.
    restart(&mut t, Some((CrashPoint::CommandReceived, 1))).await;
    approve(&t, &first, BOB).await;
    aborted(&mut t, "an approval command taken").await;
    restart(&mut t, None).await;

    // Every request approved (twice) and executed once; every run ends once.
    for id in &ids {
        let run = wait_state(&t, id, v1::RunState::WaitingApproval).await;
        let approval_id = run.actions[0].approval_id.clone();
        if approval_id != first {
            approve(&t, &approval_id, ALICE).await;
            approve(&t, &approval_id, BOB).await;
        }
        let executed = execute(&t, &approval_id).await;
        assert!(executed.executed_now, "executed once");
        let again = execute(&t, &approval_id).await;
        assert!(!again.executed_now, "never twice");
    }
    for id in &ids {
        let run = wait_state(&t, id, v1::RunState::Succeeded).await;
        assert_eq!(
            run.actions[0].state,
            v1::ActionState::Executed as i32,
            "{run:#?}"
        );
        assert_eq!(run.actions[0].decided_by, [ALICE, BOB]);
        assert_eq!(run.human_decisions.len(), 1, "each input applied once");
        let mut counts: BTreeMap<String, usize> = BTreeMap::new();
        for e in outbox(&t.client, &t.credential, id).await {
            *counts.entry(e.r#type).or_default() += 1;
        }
        assert_eq!(
            counts.get("dev.convene.run.completed.v1"),
            Some(&1),
            "{id}: {counts:?}"
        );
        assert_eq!(
            counts.get("dev.convene.approval.executed.v1"),
            Some(&1),
            "{id}: {counts:?}"
        );
        assert_eq!(
            counts.get("dev.convene.approval.decided.v1"),
            Some(&2),
            "{id}: {counts:?}"
        );
        assert_eq!(
            counts.get("dev.convene.run.resumed.v1"),
            Some(&2),
            "{id}: {counts:?}"
        );
    }
    eprintln!(
        "waiting crash test: {RUNS} runs, 4 kills, {:?}",
        t.began.elapsed()
    );
}
