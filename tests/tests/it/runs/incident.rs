//! The payment incident end to end in both modes, and deadlines: a slow worker gives a
//! PARTIAL decision at the join's deadline and its late result a second revision; a hung
//! one is cancelled and its result discarded.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use crate::harness::{Mode, TestMesh, example_spec, wait_for, wait_until};
use convene_mesh::auth::request;
use convene_proto::v1::{
    self, approval_server::Approval as _, evidence_store_server::EvidenceStore as _,
    run_event::Kind,
};
use futures::StreamExt as _;

use super::{LIMIT, ONCALL, delegation_id, one_group, profiles_with_faults, with_join_timeout};

async fn payment_incident(mode: Mode) {
    // Each specialist holds its task a moment, so all three are provably in flight at
    // once; the assertion below is on event order, not on durations.
    let profiles = profiles_with_faults(&[
        ("logs-investigator", "{ delay: 300ms }"),
        ("metrics-investigator", "{ delay: 300ms }"),
        ("change-auditor", "{ delay: 300ms }"),
    ]);
    let mesh = TestMesh::start(mode, one_group(profiles)).await;
    let started = mesh
        .start_run(ONCALL, example_spec())
        .await
        .expect("StartRun");
    assert!(started.created);
    let run_id = started.run.expect("run").run_id;
    let run = mesh.wait_terminal(ONCALL, &run_id, LIMIT).await;

    // Three delegations in parallel: every dispatch precedes the first completion.
    let events = mesh.run_events(ONCALL, &run_id).await;
    let first_completed = events
        .iter()
        .position(|e| matches!(e.kind, Some(Kind::Completed(_))))
        .expect("a completion");
    let dispatched_before: BTreeSet<String> = events[..first_completed]
        .iter()
        .filter_map(|e| match &e.kind {
            Some(Kind::Dispatched(d)) => Some(d.name.clone()),
            _ => None,
        })
        .collect();
    assert_eq!(
        dispatched_before,
        ["changes", "logs", "metrics"].map(String::from).into(),
        "all three were dispatched before any completed: {events:#?}"
    );

    // Outcome and the preserved conflict.
    assert_eq!(run.state, v1::RunState::WaitingInput as i32, "{run:#?}");
    assert_eq!(run.outcome, v1::JoinOutcome::ConflictRequiresHuman as i32);
    let decision = run.decision.clone().expect("decision");
    assert_eq!(decision.accepted.len(), 3);
    assert!(decision.quorum_met);
    let conflict = decision
        .conflicts
        .iter()
        .find(|c| c.topic == "primary_cause")
        .expect("the primary_cause conflict is preserved");
    assert_eq!(
        conflict.resolution,
        v1::ConflictResolution::Unresolved as i32
    );
    let values: BTreeMap<String, &v1::ConflictingClaim> = conflict
        .claims
        .iter()
        .map(|c| (c.value.clone(), c))
        .collect();
    assert_eq!(
        values.keys().cloned().collect::<Vec<_>>(),
        ["connection_pool_exhaustion", "risk_rule_change"]
    );
    assert_eq!(
        values["connection_pool_exhaustion"].delegation_id,
        delegation_id(&run, "logs")
    );
    assert_eq!(
        values["risk_rule_change"].delegation_id,
        delegation_id(&run, "changes")
    );
    for c in values.values() {
        assert!(!c.evidence_refs.is_empty(), "each side keeps its evidence");
    }

    // Every claim's evidence chain verifies, artifacts re-hashed.
    let claims: Vec<v1::ChainClaim> = run
        .delegations
        .iter()
        .filter_map(|d| d.result.as_ref())
        .flat_map(|r| &r.claims)
        .map(|c| v1::ChainClaim {
            claim_id: c.claim_id.clone(),
            evidence_refs: c.evidence_refs.clone(),
        })
        .collect();
    assert!(claims.len() >= 5, "{claims:#?}");
    let chain = mesh
        .evidence()
        .verify_chain(request(
            v1::VerifyChainRequest {
                claims,
                rehash_content: true,
            },
            &mesh.credential(ONCALL),
        ))
        .await
        .expect("VerifyChain")
        .into_inner();
    assert!(chain.intact, "{:#?}", chain.links);

    // The R3 rollback exists as a request, and nothing executed.
    assert_eq!(run.approval_ids.len(), 1);
    let approval = mesh
        .approval()
        .get_approval(request(
            v1::GetApprovalRequest {
                approval_id: run.approval_ids[0].clone(),
            },
            &mesh.credential(ONCALL),
        ))
        .await
        .expect("GetApproval")
        .into_inner()
        .approval
        .expect("approval");
    assert_eq!(approval.action, "rule:rollback");
    assert_eq!(approval.risk_level, v1::RiskLevel::R3 as i32);
    assert_eq!(approval.approvals_required, 2);
    assert_eq!(approval.state, v1::ApprovalState::Pending as i32);
    assert_eq!(approval.requester, ONCALL);
    assert!(approval.execution.is_none(), "nothing was executed");
    assert_eq!(approval.run_id, run_id);

    // One CloudEvent per state transition; the approval service's own event reaches
    // the run's feed as the supervisor follows it.
    let expected: BTreeMap<String, usize> = [
        ("dev.convene.run.started.v1", 1),
        ("dev.convene.delegation.completed.v1", 3),
        ("dev.convene.join.decided.v1", 1),
        ("dev.convene.approval.requested.v1", 1),
        ("dev.convene.run.waiting.v1", 1),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v))
    .collect();
    wait_for("the run's events", LIMIT, async || {
        let mut stream = mesh
            .supervisor()
            .watch_events(request(
                v1::WatchEventsRequest {
                    run_id: run_id.clone(),
                    follow: false,
                    ..Default::default()
                },
                &mesh.credential(ONCALL),
            ))
            .await
            .expect("WatchEvents")
            .into_inner();
        let mut counts: BTreeMap<String, usize> = BTreeMap::new();
        while let Some(e) = stream.next().await {
            let e = e.expect("event").event.expect("event");
            assert_eq!(e.correlation_id, run_id);
            assert_eq!(e.tenant_id, "acme-payments");
            assert_eq!(e.spec_version, "1.0");
            *counts.entry(e.r#type).or_default() += 1;
        }
        if counts == expected {
            Ok(())
        } else {
            Err(counts)
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn payment_incident_in_one_process() {
    payment_incident(Mode::InProcess).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn payment_incident_with_every_service_its_own_process() {
    payment_incident(Mode::Processes).await;
}

async fn slow_metrics(mode: Mode) {
    let mesh = TestMesh::start(
        mode,
        one_group(profiles_with_faults(&[(
            "metrics-investigator",
            "{ delay: 3s }",
        )])),
    )
    .await;
    let spec = with_join_timeout(
        example_spec(),
        Duration::from_millis(1500),
        v1::LateResultPolicy::AppendRevision,
    );
    let run_id = mesh.start_run_id(ONCALL, spec).await;
    let run = mesh.wait_terminal(ONCALL, &run_id, LIMIT).await;
    // Partial evidence, and the change auditor's rollback waits for approvers.
    assert_eq!(run.state, v1::RunState::WaitingApproval as i32, "{run:#?}");
    let decision = run.decision.clone().expect("decision");
    assert_eq!(decision.outcome, v1::JoinOutcome::PartialEvidence as i32);
    assert_eq!(decision.revision, 1);
    let metrics = delegation_id(&run, "metrics");
    assert_eq!(
        decision.missing_optional,
        vec![metrics.clone()],
        "the gap is named"
    );
    assert!(
        decision.reasons.iter().any(|r| r.contains("metrics")),
        "{:?}",
        decision.reasons
    );
    // The late result arrives, becomes revision 2, and the run stays as it stopped.
    let run = wait_for("the late revision", LIMIT, async || {
        let run = mesh.get_run(ONCALL, &run_id).await;
        if run.revisions.len() >= 2 {
            Ok(run)
        } else {
            Err(run)
        }
    })
    .await;
    assert_eq!(
        run.state,
        v1::RunState::WaitingApproval as i32,
        "a late result never reopens the run"
    );
    let revised = run.decision.clone().expect("decision");
    assert_eq!(revised.revision, 2);
    assert!(revised.accepted.contains(&metrics), "{revised:#?}");
    assert_eq!(
        run.revisions[0].outcome,
        v1::JoinOutcome::PartialEvidence as i32
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_metrics_worker_gives_partial_at_the_deadline_in_one_process() {
    slow_metrics(Mode::InProcess).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_metrics_worker_gives_partial_at_the_deadline_as_processes() {
    slow_metrics(Mode::Processes).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hung_worker_is_cancelled_and_its_result_discarded() {
    let mesh = TestMesh::start(
        Mode::InProcess,
        one_group(profiles_with_faults(&[(
            "metrics-investigator",
            "{ hang: true }",
        )])),
    )
    .await;
    let spec = with_join_timeout(
        example_spec(),
        Duration::from_millis(800),
        v1::LateResultPolicy::Discard,
    );
    let run_id = mesh.start_run_id(ONCALL, spec).await;
    let run = mesh.wait_terminal(ONCALL, &run_id, LIMIT).await;
    assert_eq!(
        run.outcome,
        v1::JoinOutcome::PartialEvidence as i32,
        "{run:#?}"
    );
    // The hung delegation is cancelled; the decision never changes.
    let metrics = delegation_id(&run, "metrics");
    wait_until("the hung delegation to be cancelled", LIMIT, async || {
        let now = mesh.get_run(ONCALL, &run_id).await;
        let d = now
            .delegations
            .iter()
            .find(|d| d.task.as_ref().is_some_and(|t| t.delegation_id == metrics))
            .expect("metrics");
        if d.state != v1::DelegationState::TimedOut as i32 || d.completed_at.is_some() {
            assert_eq!(now.revisions.len(), 1, "DISCARD never adds a revision");
            assert_eq!(now.state, v1::RunState::WaitingApproval as i32);
            return true;
        }
        false
    })
    .await;
}
