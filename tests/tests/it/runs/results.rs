//! Results the join must not take at face value: invalid results are rejected with their
//! reason while their siblings go on, and duplicates count once (conflicting ones fail
//! closed).

use std::time::Duration;

use crate::harness::{Mode, TestMesh, example_spec, wait_for};
use convene_proto::v1;

use super::{
    LIMIT, ONCALL, delegation_id, one_group, profiles_with_faults, rejection, with_join_timeout,
};

async fn invalid_results(mode: Mode) {
    let cases = [
        (
            "logs-investigator",
            "{ drop_evidence_refs: true }",
            "logs",
            v1::RejectionReason::ClaimWithoutEvidence,
        ),
        (
            "change-auditor",
            "{ evidence_scheme: 'other://' }",
            "changes",
            v1::RejectionReason::EvidenceOutsidePrefix,
        ),
        (
            "metrics-investigator",
            "{ corrupt_evidence_hash: true }",
            "metrics",
            v1::RejectionReason::HashMismatch,
        ),
        (
            "metrics-investigator",
            "{ result_delegation_id: del-000000000000000000000000 }",
            "metrics",
            v1::RejectionReason::UnknownDelegation,
        ),
    ];
    for (profile, faults, name, reason) in cases {
        let mesh =
            TestMesh::start(mode, one_group(profiles_with_faults(&[(profile, faults)]))).await;
        // The foreign-result case waits out this deadline (its real delegation never
        // reports); the others must all report before it, which on a loaded CI machine
        // running the suite against PostgreSQL took over 2 s once.
        let spec = with_join_timeout(
            example_spec(),
            Duration::from_secs(5),
            v1::LateResultPolicy::Discard,
        );
        let run_id = mesh.start_run_id(ONCALL, spec).await;
        let run = mesh.wait_terminal(ONCALL, &run_id, LIMIT).await;
        let decision = run.decision.clone().expect("decision");
        let rejected = if reason == v1::RejectionReason::UnknownDelegation {
            decision
                .rejected
                .iter()
                .find(|r| r.delegation_id == "del-000000000000000000000000")
                .cloned()
                .unwrap_or_else(|| panic!("the foreign result was not rejected: {decision:#?}"))
        } else {
            rejection(&run, name)
        };
        assert_eq!(rejected.reason, reason as i32, "{faults}: {rejected:#?}");
        assert!(!rejected.detail.is_empty());
        for sibling in ["logs", "metrics", "changes"]
            .into_iter()
            .filter(|n| *n != name)
        {
            assert!(
                decision.accepted.contains(&delegation_id(&run, sibling)),
                "{faults}: sibling {sibling} must stay accepted: {decision:#?}"
            );
        }
        assert!(
            !decision.accepted.contains(&delegation_id(&run, name)),
            "{faults}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duplicate_results_count_once_and_conflicting_duplicates_fail_closed() {
    for conflicting in [false, true] {
        let mesh = TestMesh::start(
            Mode::InProcess,
            one_group(profiles_with_faults(&[(
                "metrics-investigator",
                "{ delay: 1500ms }",
            )])),
        )
        .await;
        let run_id = mesh.start_run_id(ONCALL, example_spec()).await;
        // Wait for the logs result, then deliver it again before the join decides.
        let logs_result = wait_for("the logs result", LIMIT, async || {
            let run = mesh.get_run(ONCALL, &run_id).await;
            let logs = delegation_id(&run, "logs");
            run.delegations
                .iter()
                .find(|d| d.task.as_ref().is_some_and(|t| t.delegation_id == logs))
                .and_then(|d| d.result.clone())
                .ok_or(run)
        })
        .await;
        let mut again = logs_result.clone();
        if conflicting {
            again.summary.push_str(" (edited)");
        }
        mesh.supervisor_service()
            .deliver_result(&run_id, again)
            .await
            .expect("the run is still running");
        let run = mesh.wait_terminal(ONCALL, &run_id, LIMIT).await;
        let decision = run.decision.clone().expect("decision");
        let logs = delegation_id(&run, "logs");
        if conflicting {
            assert_eq!(
                rejection(&run, "logs").reason,
                v1::RejectionReason::ConflictingDuplicate as i32
            );
            assert!(!decision.accepted.contains(&logs));
            assert_eq!(
                decision.outcome,
                v1::JoinOutcome::InsufficientEvidence as i32,
                "logs is required"
            );
        } else {
            assert_eq!(
                decision.accepted.iter().filter(|id| **id == logs).count(),
                1
            );
            assert!(decision.rejected.iter().all(|r| r.delegation_id != logs));
            assert_eq!(
                decision.outcome,
                v1::JoinOutcome::ConflictRequiresHuman as i32
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_results_are_rejected_with_their_reason_and_siblings_are_unaffected_in_one_process()
{
    invalid_results(Mode::InProcess).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_results_are_rejected_with_their_reason_and_siblings_are_unaffected_as_processes() {
    invalid_results(Mode::Processes).await;
}
