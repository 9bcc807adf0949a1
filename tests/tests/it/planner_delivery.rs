//! Results of a planner's children delivered out of band, the way a broker's redelivery
//! would bring them, in the example planner run (`run-planner.yaml`, the playbook
//! planner): an identical duplicate counts once and changes nothing, a differing one
//! fails closed in the round's decision, and once the run has ended nothing reopens it.

use std::time::Duration;

use crate::harness::{
    MeshOptions, Mode, TestMesh, Workers, example_profiles, repo_root, spec_from_yaml, wait_for,
    wait_until,
};
use convene_proto::v1::{self, run_event::Kind};

const ONCALL: &str = "oncall@acme";
/// How long a run may take to end; each ends in a few seconds.
const LIMIT: Duration = Duration::from_secs(30);
const LOGS: &str = "logs-investigator";
const METRICS: &str = "metrics-investigator";
const CHANGES: &str = "change-auditor";
/// A delegation id no run has.
const FOREIGN: &str = "del-000000000000000000000000";

/// The example planner run, under its own idempotency key.
fn planner_spec(key: &str) -> v1::RunSpec {
    let text =
        std::fs::read_to_string(repo_root().join("examples/payment-incident/run-planner.yaml"))
            .expect("the example planner run exists");
    let mut spec = spec_from_yaml(&text);
    spec.idempotency_key = key.to_owned();
    spec
}

/// One worker serving the example profiles, the metrics investigator slowed down so that
/// round 1 stays open after the logs result is in.
async fn mesh() -> TestMesh {
    let anchor = format!("  - id: {METRICS}\n");
    let profiles = example_profiles();
    assert!(profiles.contains(&anchor), "{METRICS} is in the example");
    let profiles = profiles.replace(
        &anchor,
        &format!("{anchor}    faults: {{ delay: 1500ms }}\n"),
    );
    TestMesh::start(
        Mode::InProcess,
        MeshOptions {
            workers: vec![Workers {
                profiles: Some(profiles),
                count: 1,
                capacity: 64,
            }],
            ..MeshOptions::default()
        },
    )
    .await
}

fn task(d: &v1::Delegation) -> &v1::DelegationTask {
    d.task.as_ref().expect("a delegation has its task")
}

/// The delegation to `profile` created in `round`.
fn delegation<'a>(run: &'a v1::Run, round: u32, profile: &str) -> &'a v1::Delegation {
    run.delegations
        .iter()
        .find(|d| task(d).round == round && task(d).profile_id == profile)
        .unwrap_or_else(|| panic!("no round-{round} delegation to {profile}: {run:#?}"))
}

/// Waits until the round-1 logs result is stored while round 1 is still open (the slowed
/// metrics investigator has not reported) and returns it.
async fn logs_result_in_round_one(mesh: &TestMesh, run_id: &str) -> v1::TaskResult {
    let (logs, metrics_done) = wait_for("the round-1 logs result", LIMIT, async || {
        let run = mesh.get_run(ONCALL, run_id).await;
        if run.delegations.is_empty() {
            return Err(run);
        }
        let logs = delegation(&run, 1, LOGS).result.clone();
        let metrics_done = delegation(&run, 1, METRICS).result.is_some();
        logs.map(|r| (r, metrics_done)).ok_or(run)
    })
    .await;
    assert!(
        !metrics_done,
        "round 1 was still open when the logs result was taken (metrics is slowed down)"
    );
    logs
}

/// What a run's end says, by delegation name rather than id (ids differ between runs).
#[derive(Debug, PartialEq)]
struct Ending {
    state: i32,
    outcome: i32,
    accepted: Vec<String>,
    rejected: Vec<(String, i32)>,
    revision: u32,
    approvals: usize,
    turns: Vec<(u32, Vec<String>)>,
}

fn name_of(run: &v1::Run, delegation_id: &str) -> String {
    run.delegations
        .iter()
        .map(task)
        .find(|t| t.delegation_id == delegation_id)
        .map_or_else(|| delegation_id.to_owned(), |t| t.name.clone())
}

fn ending(run: &v1::Run) -> Ending {
    let decision = run.decision.clone().unwrap_or_default();
    let mut accepted: Vec<String> = decision
        .accepted
        .iter()
        .map(|id| name_of(run, id))
        .collect();
    accepted.sort();
    let mut rejected: Vec<(String, i32)> = decision
        .rejected
        .iter()
        .map(|r| (name_of(run, &r.delegation_id), r.reason))
        .collect();
    rejected.sort();
    let planner = run.planner.clone().unwrap_or_default();
    Ending {
        state: run.state,
        outcome: run.outcome,
        accepted,
        rejected,
        revision: decision.revision,
        approvals: run.approval_ids.len(),
        turns: planner
            .turns
            .iter()
            .map(|t| (t.round, t.calls.iter().map(|c| c.tool.clone()).collect()))
            .collect(),
    }
}

/// Starts `spec` and waits for the run to end.
async fn run_to_end(mesh: &TestMesh, spec: v1::RunSpec) -> v1::Run {
    let run_id = mesh.start_run_id(ONCALL, spec).await;
    mesh.wait_terminal(ONCALL, &run_id, LIMIT).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_identical_duplicate_of_a_planner_child_counts_once() {
    let mesh = mesh().await;

    // The run as it ends without a duplicate.
    let plain = run_to_end(&mesh, planner_spec("planner-delivery-plain")).await;
    assert_eq!(plain.state, v1::RunState::WaitingInput as i32, "{plain:#?}");

    // The same run, with the logs result of round 1 delivered a second time, unchanged,
    // before round 1's join decides.
    let run_id = mesh
        .start_run_id(ONCALL, planner_spec("planner-delivery-duplicate"))
        .await;
    let logs = logs_result_in_round_one(&mesh, &run_id).await;
    mesh.supervisor_service()
        .deliver_result(&run_id, logs.clone())
        .await
        .expect("the run is running");
    let run = mesh.wait_terminal(ONCALL, &run_id, LIMIT).await;

    assert_eq!(
        ending(&run),
        ending(&plain),
        "the duplicate changed the run"
    );
    let decision = run.decision.clone().expect("a decision");
    assert_eq!(
        decision
            .accepted
            .iter()
            .filter(|id| **id == logs.delegation_id)
            .count(),
        1,
        "{decision:#?}"
    );
    assert!(
        decision.rejected.is_empty(),
        "no result is rejected, least of all as a conflicting duplicate: {decision:#?}"
    );
    // Every round's decision took it once.
    for revision in &run.revisions {
        assert!(
            revision.accepted.contains(&logs.delegation_id),
            "{revision:#?}"
        );
        assert!(revision.rejected.is_empty(), "{revision:#?}");
    }
    // The delegation keeps the result it reported.
    assert_eq!(delegation(&run, 1, LOGS).result.as_ref(), Some(&logs));
}

fn state_name(state: i32) -> &'static str {
    v1::RunState::try_from(state).map_or("?", |s| s.as_str_name())
}

/// The run's tool calls so far.
fn tool_calls(run: &v1::Run) -> u32 {
    run.usage.as_ref().map_or(0, |u| u.tool_calls)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redelivered_child_result_is_not_charged_to_the_budget_twice() {
    let mesh = mesh().await;
    // A tool-call budget the run fits in with one call to spare.
    let budgeted = |key: &str| {
        let mut spec = planner_spec(key);
        let limits = spec.limits.as_mut().expect("limits");
        limits.max_tool_calls = 9;
        spec
    };
    let plain = run_to_end(&mesh, budgeted("planner-delivery-budget-plain")).await;
    assert_eq!(plain.state, v1::RunState::WaitingInput as i32, "{plain:#?}");
    assert_eq!(tool_calls(&plain), 8, "{:#?}", plain.usage);

    let run_id = mesh
        .start_run_id(ONCALL, budgeted("planner-delivery-budget-duplicate"))
        .await;
    let logs = logs_result_in_round_one(&mesh, &run_id).await;
    mesh.supervisor_service()
        .deliver_result(&run_id, logs)
        .await
        .expect("the run is running");
    let run = mesh.wait_terminal(ONCALL, &run_id, LIMIT).await;
    assert_eq!(
        (state_name(run.state), tool_calls(&run)),
        (state_name(plain.state), tool_calls(&plain)),
        "the redelivered result was charged to the budget again ({:?}): {}",
        run.usage,
        run.terminal_reason
    );
    assert_eq!(ending(&run), ending(&plain));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_differing_duplicate_of_a_planner_child_fails_closed() {
    let mesh = mesh().await;
    let run_id = mesh
        .start_run_id(ONCALL, planner_spec("planner-delivery-conflicting"))
        .await;
    let logs = logs_result_in_round_one(&mesh, &run_id).await;
    let mut edited = logs.clone();
    edited.summary.push_str(" (edited)");
    if let Some(claim) = edited.claims.first_mut() {
        claim.value.push_str("-edited");
    }
    mesh.supervisor_service()
        .deliver_result(&run_id, edited)
        .await
        .expect("the run is running");
    let run = mesh.wait_terminal(ONCALL, &run_id, LIMIT).await;

    // Round 1's decision rejects the logs delegation: neither version is taken.
    let first = run.revisions.first().expect("round 1's decision");
    let rejected = first
        .rejected
        .iter()
        .find(|r| r.delegation_id == logs.delegation_id)
        .unwrap_or_else(|| panic!("the logs delegation was not rejected: {first:#?}"));
    assert_eq!(
        rejected.reason,
        v1::RejectionReason::ConflictingDuplicate as i32,
        "{rejected:#?}"
    );
    assert!(!rejected.detail.is_empty());
    assert!(!first.accepted.contains(&logs.delegation_id), "{first:#?}");
    // Its siblings are unaffected.
    for profile in [METRICS, CHANGES] {
        let id = &task(delegation(&run, 1, profile)).delegation_id;
        assert!(first.accepted.contains(id), "{profile}: {first:#?}");
    }

    // The run's last decision still rejects it, and the logs investigator is required:
    // the run cannot end as if its evidence were in.
    let last = run.decision.clone().expect("a decision");
    assert!(
        last.rejected
            .iter()
            .any(|r| r.delegation_id == logs.delegation_id
                && r.reason == v1::RejectionReason::ConflictingDuplicate as i32),
        "{last:#?}"
    );
    assert!(!last.accepted.contains(&logs.delegation_id), "{last:#?}");
    assert_ne!(last.outcome, v1::JoinOutcome::Complete as i32, "{last:#?}");
    assert_ne!(
        run.state,
        v1::RunState::Succeeded as i32,
        "a rejected required result never lets the run succeed: {run:#?}"
    );

    // The planner was told: the decision it read after round 1 names the rejection.
    let planner = run.planner.clone().expect("the planner's state");
    let told = planner.messages.iter().any(|m| {
        m.role == "user"
            && m.content.contains(&logs.delegation_id)
            && m.content.contains("CONFLICTING_DUPLICATE")
    });
    assert!(
        told,
        "no decision message to the planner names the rejected duplicate: {:#?}",
        planner.messages
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_child_result_after_the_planner_run_ended_is_recorded_and_never_applied() {
    let mesh = mesh().await;
    let ended = run_to_end(&mesh, planner_spec("planner-delivery-after-end")).await;
    let run_id = ended.run_id.clone();
    assert_eq!(ended.state, v1::RunState::WaitingInput as i32, "{ended:#?}");
    assert_eq!(
        ended
            .spec
            .as_ref()
            .and_then(|s| s.join.as_ref())
            .map(|j| j.late_result),
        Some(v1::LateResultPolicy::Discard as i32)
    );
    // A planner's run ends with none of its children in flight: its owner is gone.
    wait_until(
        "the run's owner to end",
        Duration::from_secs(10),
        async || mesh.supervisor_service().live_runs() == 0,
    )
    .await;
    let ended = mesh.get_run(ONCALL, &run_id).await;
    let events = mesh.run_events(ONCALL, &run_id).await;

    // A round-1 child's result, changed; the same unchanged; and one for a delegation
    // the run never had.
    let logs = delegation(&ended, 1, LOGS)
        .result
        .clone()
        .expect("the logs result");
    let mut changed = logs.clone();
    changed.summary.push_str(" (late)");
    let mut foreign = logs.clone();
    foreign.delegation_id = FOREIGN.to_owned();
    for (what, result) in [
        ("changed", changed.clone()),
        ("identical", logs.clone()),
        ("foreign", foreign.clone()),
    ] {
        mesh.supervisor_service()
            .deliver_result(&run_id, result)
            .await
            .unwrap_or_else(|e| {
                panic!("{what}: a result for an ended run is sealed, not refused: {e:?}")
            });
    }

    // Recorded: the changed and the foreign result (the identical one the run holds
    // already), each with a late `completed` event, listed as discarded late.
    let after = mesh.get_run(ONCALL, &run_id).await;
    let mut received = ended.received.clone();
    received.push(changed);
    received.push(foreign);
    assert_eq!(
        after.received, received,
        "sealed results are recorded in order"
    );
    let late = after
        .decision
        .as_ref()
        .map(|d| d.late_discarded.clone())
        .unwrap_or_default();
    assert!(
        late.contains(&logs.delegation_id) && late.contains(&FOREIGN.to_owned()),
        "{late:?}"
    );
    let events_after = mesh.run_events(ONCALL, &run_id).await;
    assert_eq!(
        events_after[..events.len()],
        events[..],
        "earlier events stay"
    );
    let added: Vec<&v1::RunEvent> = events_after[events.len()..].iter().collect();
    assert_eq!(added.len(), 2, "{added:#?}");
    assert!(
        added
            .iter()
            .all(|e| matches!(&e.kind, Some(Kind::Completed(c)) if c.late)),
        "{added:#?}"
    );

    // Never applied: state, outcome, the decision's revision and content, the ledger.
    assert_eq!(after.state, ended.state);
    assert_eq!(after.outcome, ended.outcome);
    assert_eq!(after.revisions, ended.revisions);
    assert_eq!(after.delegations, ended.delegations);
    let (mut before_decision, mut after_decision) = (
        ended.decision.clone().expect("decision"),
        after.decision.clone().expect("decision"),
    );
    before_decision.late_discarded.clear();
    after_decision.late_discarded.clear();
    assert_eq!(
        after_decision, before_decision,
        "the decision is not revised"
    );
}
