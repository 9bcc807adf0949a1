//! A person continues a waiting run: settles a conflict, asks for a follow-up, closes it
//! as it stands, or cancels it; stale tickets, missing roles and bad input are refused
//! with what to fix.

use crate::harness::{MeshOptions, Mode, TestMesh};
use convene_mesh::auth::request;
use convene_proto::v1::{self, resume_run_request::Input};
use tonic::Code;

use super::{
    ALICE, ONCALL, approval, cloud_events, delegation, resume, resume_with,
    settle_for_the_rule_change, wait_state, waiting_incident,
};

async fn mesh() -> TestMesh {
    TestMesh::start(Mode::InProcess, MeshOptions::default()).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn settling_a_conflict_records_the_decision_the_person_and_the_evidence() {
    let mesh = mesh().await;
    let run = waiting_incident(&mesh).await;
    let ticket = run.ticket.clone().expect("a waiting run has a ticket");
    assert_eq!(ticket.version, 1);
    let changes = delegation(&run, "changes");
    let rule_evidence: Vec<String> = run.decision.as_ref().expect("decision").conflicts[0]
        .claims
        .iter()
        .find(|c| c.delegation_id == changes)
        .expect("the change auditor's side")
        .evidence_refs
        .clone();
    let answer = resume(
        &mesh,
        ONCALL,
        &run,
        Input::Settle(v1::SettleConflict {
            topic: "primary_cause".to_owned(),
            // By name: the delegation's plan name works as well as its id.
            delegation_id: "changes".to_owned(),
            evidence_ids: rule_evidence.clone(),
        }),
        "the rule change went out two minutes before the errors began",
    )
    .await
    .expect("ResumeRun");
    let run = answer.run.expect("run");
    let decision = run.decision.clone().expect("decision");
    assert_eq!(decision.revision, 2, "the join decided again");
    assert_eq!(run.revisions.len(), 2);
    assert_ne!(
        decision.outcome,
        v1::JoinOutcome::ConflictRequiresHuman as i32,
        "{:?}",
        decision.reasons
    );
    let conflict = &decision.conflicts[0];
    assert_eq!(conflict.resolution, v1::ConflictResolution::Settled as i32);
    assert_eq!(conflict.claims.len(), 2, "both sides stay on record");
    let settlement = conflict.settlement.as_ref().expect("the settlement");
    assert_eq!(settlement.delegation_id, changes);
    assert_eq!(settlement.value, "risk_rule_change");
    assert_eq!(settlement.decided_by, ONCALL);
    assert_eq!(settlement.evidence_ids, rule_evidence);
    assert!(settlement.rationale.contains("two minutes before"));
    assert!(
        decision
            .reasons
            .iter()
            .any(|r| r.contains("settled by oncall@acme") && r.contains("a human judgement")),
        "{:?}",
        decision.reasons
    );
    // The judgement is in the run's record of people's decisions, apart from the claims.
    let human = &run.human_decisions[0];
    assert_eq!(human.kind, v1::HumanDecisionKind::Settle as i32);
    assert_eq!(human.decided_by, ONCALL);
    assert_eq!(human.topic, "primary_cause");
    assert_eq!(human.ticket.as_ref(), Some(&ticket));
    assert!(human.decided_at.is_some());
    // Waiting for the approval now, under a new ticket.
    assert_eq!(run.state, v1::RunState::WaitingApproval as i32);
    assert_eq!(run.ticket.as_ref().map(|t| t.version), Some(2));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follow_up_runs_a_new_round_and_the_join_decides_again() {
    let mesh = mesh().await;
    let run = waiting_incident(&mesh).await;
    let answer = resume(
        &mesh,
        ONCALL,
        &run,
        Input::FollowUp(v1::FollowUp {
            profile_id: "metrics-investigator".to_owned(),
            goal: "compare the error rate before and after the risk-rule change".to_owned(),
        }),
        "the metrics should tell the two causes apart",
    )
    .await
    .expect("ResumeRun");
    assert_eq!(answer.outcome, v1::CommandOutcome::Applied as i32);
    let resumed = answer.run.expect("run");
    assert_eq!(resumed.delegations.len(), 4, "a fourth delegation");
    let follow_up = resumed.delegations[3].task.clone().expect("task");
    assert_eq!(follow_up.profile_id, "metrics-investigator");
    assert_eq!(follow_up.round, 1, "a new round");
    assert_eq!(
        resumed.human_decisions[0].follow_up_delegation_id,
        follow_up.delegation_id
    );
    let run = mesh.wait_terminal(ONCALL, &run.run_id, super::LIMIT).await;
    let done = &run.delegations[3];
    assert_eq!(
        done.state,
        v1::DelegationState::Completed as i32,
        "{run:#?}"
    );
    let decision = run.decision.clone().expect("decision");
    assert_eq!(
        decision.revision, 2,
        "the join decided again over every result"
    );
    assert!(decision.accepted.contains(&follow_up.delegation_id));
    // The follow-up did not settle the conflict: the run waits for input again, under a
    // new ticket.
    assert_eq!(run.state, v1::RunState::WaitingInput as i32);
    assert_eq!(run.ticket.as_ref().map(|t| t.version), Some(2));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_or_used_ticket_is_refused_naming_the_current_one() {
    let mesh = mesh().await;
    let run = waiting_incident(&mesh).await;
    let current = run.ticket.clone().expect("ticket");
    let stale = v1::RunTicket {
        id: "0190e6a0-0000-7000-8000-00000000dead".to_owned(),
        version: current.version,
        issued_at: None,
    };
    let refused = resume_with(
        &mesh,
        ONCALL,
        &run,
        Some(stale),
        settle_for_the_rule_change(&run),
        "a guess",
    )
    .await
    .expect_err("a stale ticket is refused");
    assert_eq!(refused.code(), Code::FailedPrecondition, "{refused:?}");
    assert!(refused.message().contains(&current.id), "{refused:?}");
    // Used once, the ticket is spent.
    resume(
        &mesh,
        ONCALL,
        &run,
        settle_for_the_rule_change(&run),
        "the rule change preceded the errors",
    )
    .await
    .expect("ResumeRun");
    let again = resume(
        &mesh,
        ONCALL,
        &run,
        Input::Close(v1::CloseRun {}),
        "again with the old ticket",
    )
    .await
    .expect_err("a used ticket is refused");
    assert_eq!(again.code(), Code::FailedPrecondition, "{again:?}");
    let now = mesh.get_run(ONCALL, &run.run_id).await;
    let new = now.ticket.expect("the new ticket");
    assert!(again.message().contains(&new.id), "{again:?}");
    assert_eq!(
        now.human_decisions.len(),
        1,
        "the refused input left no trace"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resuming_needs_the_runs_resolve_role_and_good_input() {
    let mesh = mesh().await;
    let run = waiting_incident(&mesh).await;
    let denied = resume(&mesh, ALICE, &run, settle_for_the_rule_change(&run), "mine")
        .await
        .expect_err("alice may not resolve runs");
    assert_eq!(denied.code(), Code::PermissionDenied, "{denied:?}");
    assert!(denied.message().contains("runs:resolve"), "{denied:?}");

    let no_rationale = resume(&mesh, ONCALL, &run, settle_for_the_rule_change(&run), " ")
        .await
        .expect_err("a rationale is required");
    assert_eq!(no_rationale.code(), Code::InvalidArgument);
    assert!(
        no_rationale.message().contains("rationale"),
        "{no_rationale:?}"
    );

    let no_conflict = resume(
        &mesh,
        ONCALL,
        &run,
        Input::Settle(v1::SettleConflict {
            topic: "impact".to_owned(),
            delegation_id: delegation(&run, "changes"),
            evidence_ids: Vec::new(),
        }),
        "there is no such conflict",
    )
    .await
    .expect_err("no open conflict on that topic");
    assert_eq!(
        no_conflict.code(),
        Code::FailedPrecondition,
        "{no_conflict:?}"
    );
    assert!(
        no_conflict.message().contains("primary_cause"),
        "{no_conflict:?}"
    );

    let not_a_side = resume(
        &mesh,
        ONCALL,
        &run,
        Input::Settle(v1::SettleConflict {
            topic: "primary_cause".to_owned(),
            delegation_id: delegation(&run, "metrics"),
            evidence_ids: Vec::new(),
        }),
        "metrics did not take a side",
    )
    .await
    .expect_err("metrics is not a side");
    assert_eq!(not_a_side.code(), Code::InvalidArgument, "{not_a_side:?}");
    assert!(not_a_side.message().contains("its sides"), "{not_a_side:?}");

    let unknown_profile = resume(
        &mesh,
        ONCALL,
        &run,
        Input::FollowUp(v1::FollowUp {
            profile_id: "astrologer".to_owned(),
            goal: "read the stars".to_owned(),
        }),
        "why not",
    )
    .await
    .expect_err("no such profile");
    assert_eq!(
        unknown_profile.code(),
        Code::InvalidArgument,
        "{unknown_profile:?}"
    );
    // Nothing was recorded, and the ticket still holds.
    let still = mesh.get_run(ONCALL, &run.run_id).await;
    assert!(still.human_decisions.is_empty());
    assert_eq!(still.ticket, run.ticket);
    assert_eq!(still.state, v1::RunState::WaitingInput as i32);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn closing_ends_the_run_as_it_stands_and_withdraws_its_requests() {
    let mesh = mesh().await;
    let run = waiting_incident(&mesh).await;
    let answer = resume(
        &mesh,
        ONCALL,
        &run,
        Input::Close(v1::CloseRun {}),
        "the incident is over; the cause stays open",
    )
    .await
    .expect("ResumeRun");
    let run = answer.run.expect("run");
    assert_eq!(run.state, v1::RunState::Partial as i32, "{run:#?}");
    assert_eq!(run.actions[0].state, v1::ActionState::Cancelled as i32);
    assert_eq!(
        approval(&mesh, &run.actions[0].approval_id).await.state,
        v1::ApprovalState::Cancelled as i32
    );
    assert_eq!(
        run.decision.as_ref().expect("decision").conflicts[0].resolution,
        v1::ConflictResolution::Unresolved as i32,
        "closing settles nothing"
    );
    let counts = cloud_events(&mesh, &run.run_id).await;
    assert_eq!(
        counts.get("dev.convene.run.completed.v1"),
        Some(&1),
        "{counts:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelling_a_waiting_run_withdraws_its_approval_requests() {
    let mesh = mesh().await;
    let run = waiting_incident(&mesh).await;
    let cancel = async |mesh: &TestMesh| {
        mesh.supervisor()
            .cancel_run(request(
                v1::CancelRunRequest {
                    run_id: run.run_id.clone(),
                    reason: "handled by hand".to_owned(),
                },
                &mesh.credential(ONCALL),
            ))
            .await
    };
    let answer = cancel(&mesh).await.expect("CancelRun").into_inner();
    assert_eq!(answer.outcome, v1::CommandOutcome::Applied as i32);
    let cancelled = answer.run.expect("run");
    assert_eq!(cancelled.state, v1::RunState::Cancelled as i32);
    assert_eq!(
        cancelled.actions[0].state,
        v1::ActionState::Cancelled as i32
    );
    let approval = approval(&mesh, &cancelled.actions[0].approval_id).await;
    assert_eq!(approval.state, v1::ApprovalState::Cancelled as i32);
    let again = cancel(&mesh).await.expect("CancelRun").into_inner();
    assert_eq!(again.outcome, v1::CommandOutcome::AlreadyEnded as i32);
    let run = wait_state(&mesh, &run.run_id, v1::RunState::Cancelled).await;
    let counts = cloud_events(&mesh, &run.run_id).await;
    assert_eq!(
        counts.get("dev.convene.run.completed.v1"),
        Some(&1),
        "{counts:?}"
    );
    assert_eq!(
        counts.get("dev.convene.approval.cancelled.v1"),
        Some(&1),
        "{counts:?}"
    );
}
