//! Execute against the real policy service and evidence store: claims, evidence that
//! verifies, authorized tool calls, denials, deadlines, cancellation and idempotency.

use std::time::{Duration, Instant};

use crate::support::{Mesh, RUN_ID, claim, profiles_with, status, task, wait_until};
use convene_mesh::auth;
use convene_proto::v1;
use convene_worker::profiles;

/// Verifies every claim of `result` down to the artifact bytes.
async fn verify_chain(
    mesh: &Mesh,
    result: &v1::TaskResult,
    token: &str,
) -> v1::VerifyChainResponse {
    let claims = result
        .claims
        .iter()
        .map(|c| v1::ChainClaim {
            claim_id: c.claim_id.clone(),
            evidence_refs: c.evidence_refs.clone(),
        })
        .collect();
    mesh.evidence_handle()
        .verify_chain(auth::request(
            v1::VerifyChainRequest {
                claims,
                rehash_content: true,
            },
            token,
        ))
        .await
        .unwrap()
        .into_inner()
}

/// What every successful investigation must satisfy: evidence inside the profile's
/// prefixes and stored as reported, every claim verifiable, every tool call authorized.
async fn check_evidence_and_authorization(mesh: &Mesh, result: &v1::TaskResult, token: &str) {
    let prefixes = mesh.prefixes(&result.profile_id);
    assert!(!result.evidence.is_empty());
    for e in &result.evidence {
        assert!(
            prefixes.iter().any(|p| e.evidence_id.starts_with(p)),
            "{} lies outside {prefixes:?}",
            e.evidence_id
        );
        assert!(
            e.evidence_id.contains(&result.delegation_id),
            "{}",
            e.evidence_id
        );
        assert!(
            result.artifacts.contains(&e.artifact_uri),
            "{} not listed",
            e.artifact_uri
        );
        assert_eq!(
            e.tenant, "acme-payments",
            "the store sets the tenant from the token"
        );
        assert!(e.query_fingerprint.starts_with("sha256:"));
    }
    for c in &result.claims {
        assert!(
            !c.evidence_refs.is_empty(),
            "claim {} cites nothing",
            c.claim_id
        );
    }
    let chain = verify_chain(mesh, result, token).await;
    assert!(chain.intact, "broken links: {:#?}", chain.links);

    let decisions = mesh.decisions_for(&result.delegation_id);
    let usage = result.usage.as_ref().unwrap();
    assert_eq!(decisions.len() as u32, usage.tool_calls);
    assert!(decisions.iter().all(|d| d.allowed), "{decisions:#?}");
    assert!(
        decisions
            .iter()
            .all(|d| d.audience == format!("worker:{}", result.profile_id))
    );
    // Each evidence record names the tool call whose authorization the log holds.
    for e in &result.evidence {
        assert!(
            decisions.iter().any(|d| d.tool_call_id == e.tool_call_id),
            "no authorization for {}",
            e.tool_call_id
        );
    }
}

fn kind_of<'a>(result: &'a v1::TaskResult, evidence_id: &str) -> &'a str {
    &result
        .evidence
        .iter()
        .find(|e| e.evidence_id == evidence_id)
        .unwrap()
        .kind
}

#[tokio::test]
async fn logs_investigator_finds_impact_and_pool_exhaustion() {
    let mesh = Mesh::start().await;
    let worker = mesh.worker(profiles::example().unwrap(), 4).await;
    let task = task("del-logs-1", "logs-investigator", Duration::from_secs(30));
    let token = mesh.token_for(&task, &[]).await;

    let result = worker.execute(&task, &token, 1).await.unwrap();
    assert_eq!(status(&result), v1::TaskStatus::Completed, "{result:#?}");
    assert_eq!(result.worker_id, "worker-test-1");
    assert_eq!(result.profile_version, "1.0.0");
    assert!(result.missing_evidence.is_empty());
    let impact = claim(&result, "impact.payment_confirm_failures");
    assert!(
        impact.statement.contains("payment_confirm calls"),
        "{}",
        impact.statement
    );
    assert_eq!(kind_of(&result, &impact.evidence_refs[0]), "impact_metric");
    let cause = claim(&result, "primary_cause");
    assert_eq!(cause.value, "connection_pool_exhaustion");
    assert!(cause.statement.contains("02:01:18") && cause.statement.contains("42 s before"));
    assert_eq!(cause.evidence_refs.len(), 2, "cites both log queries");
    assert_eq!(kind_of(&result, &cause.evidence_refs[0]), "causal_signal");
    assert_eq!(
        result.evidence[0].evidence_id,
        format!("logs://payment-api/{RUN_ID}/del-logs-1/pool_exhaustion")
    );
    let usage = result.usage.as_ref().unwrap();
    assert_eq!(
        (usage.iterations, usage.tool_calls, usage.tokens),
        (2, 2, 0)
    );
    check_evidence_and_authorization(&mesh, &result, &token).await;
}

#[tokio::test]
async fn metrics_investigator_quantifies_the_drop() {
    let mesh = Mesh::start().await;
    let worker = mesh.worker(profiles::example().unwrap(), 4).await;
    let task = task(
        "del-metrics-1",
        "metrics-investigator",
        Duration::from_secs(30),
    );
    let token = mesh.token_for(&task, &[]).await;

    let result = worker.execute(&task, &token, 1).await.unwrap();
    assert_eq!(status(&result), v1::TaskStatus::Completed, "{result:#?}");
    let rate = claim(&result, "impact.success_rate");
    assert_eq!(rate.value, "99.6% → 93.1% at 02:02");
    assert_eq!(kind_of(&result, &rate.evidence_refs[0]), "impact_metric");
    assert_eq!(claim(&result, "impact.gateway_p95").value, "420 ms → 3.8 s");
    check_evidence_and_authorization(&mesh, &result, &token).await;
}

#[tokio::test]
async fn change_auditor_blames_the_rule_and_proposes_an_r3_rollback() {
    let mesh = Mesh::start().await;
    let worker = mesh.worker(profiles::example().unwrap(), 4).await;
    let task = task("del-changes-1", "change-auditor", Duration::from_secs(30));
    let token = mesh.token_for(&task, &[]).await;

    let result = worker.execute(&task, &token, 1).await.unwrap();
    assert_eq!(status(&result), v1::TaskStatus::Completed, "{result:#?}");
    let cause = claim(&result, "primary_cause");
    assert_eq!(cause.value, "risk_rule_change");
    assert!(cause.statement.contains("RC-4711") && cause.statement.contains("02:01:40"));
    assert_eq!(
        cause.evidence_refs,
        [format!("changes://log/{RUN_ID}/del-changes-1/rule_changes")]
    );
    assert_eq!(kind_of(&result, &cause.evidence_refs[0]), "causal_signal");
    let hit = claim(&result, "risk.rule_hit_rate");
    assert!(
        hit.evidence_refs[0].starts_with("metrics://risk."),
        "{:?}",
        hit.evidence_refs
    );

    let [action] = result.proposed_actions.as_slice() else {
        panic!(
            "one proposed action expected: {:#?}",
            result.proposed_actions
        );
    };
    assert_eq!(action.action, "rule:rollback");
    assert_eq!(action.risk_level, v1::RiskLevel::R3 as i32);
    let params = &action.parameters.as_ref().unwrap().fields;
    let text = |k: &str| match &params[k].kind {
        Some(prost_types::value::Kind::StringValue(s)) => s.clone(),
        other => panic!("{k} is {other:?}"),
    };
    assert_eq!(
        (text("rule_id"), text("to_version")),
        ("RC-4711".into(), "2026.7.1".into())
    );
    assert_eq!(action.evidence_refs.len(), 2);
    assert!(
        result.side_effects.is_empty(),
        "investigators change nothing"
    );
    check_evidence_and_authorization(&mesh, &result, &token).await;
}

#[tokio::test]
async fn a_tool_missing_from_the_token_is_a_structured_failure() {
    let mesh = Mesh::start().await;
    let worker = mesh.worker(profiles::example().unwrap(), 4).await;
    let task = task("del-changes-2", "change-auditor", Duration::from_secs(30));
    // The token carries list_changes only; query_metrics cannot be called.
    let token = mesh.token_for(&task, &["list_changes@1"]).await;

    let result = worker.execute(&task, &token, 1).await.unwrap();
    assert_eq!(status(&result), v1::TaskStatus::Partial, "{result:#?}");
    assert_eq!(result.missing_evidence, ["rule_hit_rate"]);
    assert_eq!(claim(&result, "primary_cause").value, "risk_rule_change");
    assert!(
        result
            .claims
            .iter()
            .all(|c| c.topic != "risk.rule_hit_rate")
    );
    // The action still stands on the evidence that exists.
    assert_eq!(
        result.proposed_actions[0].evidence_refs,
        [format!("changes://log/{RUN_ID}/del-changes-2/rule_changes")]
    );
    // The call of the tool the token lacks was judged by the policy service, so the
    // denial is in its decision log.
    let decisions = mesh.decisions_for("del-changes-2");
    let denied: Vec<_> = decisions.iter().filter(|d| !d.allowed).collect();
    assert_eq!(denied.len(), 1, "{decisions:#?}");
    assert_eq!(denied[0].tool, "query_metrics@1");
    assert!(denied[0].reason.contains("TOOL_NOT_GRANTED"), "{denied:#?}");
    assert!(
        decisions
            .iter()
            .filter(|d| d.allowed)
            .all(|d| d.tool == "list_changes@1")
    );
    assert_eq!(
        result.usage.as_ref().unwrap().tool_calls,
        2,
        "both calls count"
    );
}

#[tokio::test]
async fn every_call_denied_by_policy_blocks_the_task() {
    let mesh = Mesh::start().await;
    let worker = mesh.worker(profiles::example().unwrap(), 4).await;
    let mut task = task("del-logs-2", "logs-investigator", Duration::from_secs(30));
    // The token is issued without logs:read, so every search is denied.
    task.required_scopes.clear();
    let token = mesh.token_for(&task, &[]).await;

    let result = worker.execute(&task, &token, 1).await.unwrap();
    assert_eq!(status(&result), v1::TaskStatus::Blocked, "{result:#?}");
    let error = result.error.as_ref().unwrap();
    assert_eq!(error.code, "permission_denied");
    assert!(!error.retryable);
    assert!(
        error.message.contains("SCOPE_NOT_GRANTED"),
        "{}",
        error.message
    );
    assert!(result.claims.is_empty() && result.evidence.is_empty());
    assert_eq!(
        result.missing_evidence,
        ["pool_exhaustion", "confirm_outcomes"]
    );
    let decisions = mesh.decisions_for("del-logs-2");
    assert_eq!(decisions.len(), 2);
    assert!(
        decisions
            .iter()
            .all(|d| !d.allowed && d.reason == "AUTHORIZE_REASON_SCOPE_NOT_GRANTED")
    );
}

#[tokio::test]
async fn the_deadline_returns_timed_out_with_what_was_gathered() {
    let mesh = Mesh::start().await;
    // The worker stalls after its tool calls, as if it had died mid-task.
    let profiles = profiles_with("logs-investigator", |p| {
        p.faults.exit_process_after_tools = true
    });
    let worker = mesh.worker(profiles, 4).await;
    let task = task("del-logs-3", "logs-investigator", Duration::from_secs(2));
    let token = mesh.token_for(&task, &[]).await;

    let started = Instant::now();
    let result = worker.execute(&task, &token, 1).await.unwrap();
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "returned by the deadline"
    );
    assert_eq!(status(&result), v1::TaskStatus::TimedOut, "{result:#?}");
    assert_eq!(result.error.as_ref().unwrap().code, "timeout");
    assert!(result.claims.is_empty());
    assert_eq!(
        result.evidence.len(),
        2,
        "the evidence gathered before the stall is reported"
    );
    assert_eq!(worker.service.in_flight(), 0);
}

#[tokio::test]
async fn cancel_ends_a_running_delegation_promptly() {
    let mesh = Mesh::start().await;
    let profiles = profiles_with("metrics-investigator", |p| p.faults.hang = true);
    let worker = mesh.worker(profiles, 4).await;
    let task = task(
        "del-metrics-2",
        "metrics-investigator",
        Duration::from_secs(60),
    );
    let token = mesh.token_for(&task, &[]).await;

    let running = worker.execute_in_background(&task, &token);
    wait_until(
        "the task in flight",
        || worker.service.in_flight(),
        |n| *n > 0,
    )
    .await;
    let cancelled = worker
        .client
        .clone()
        .cancel(v1::WorkerCancelRequest {
            delegation_id: "del-metrics-2".into(),
            reason: "run cancelled by oncall@acme".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(cancelled.cancelled);
    let result = tokio::time::timeout(Duration::from_secs(2), running)
        .await
        .expect("Execute returns promptly after Cancel")
        .unwrap()
        .unwrap()
        .into_inner()
        .result
        .unwrap();
    assert_eq!(status(&result), v1::TaskStatus::Failed);
    let error = result.error.unwrap();
    assert_eq!(error.code, "cancelled");
    assert!(
        error.message.contains("run cancelled by oncall@acme"),
        "{}",
        error.message
    );

    let again = worker
        .client
        .clone()
        .cancel(v1::WorkerCancelRequest {
            delegation_id: "del-metrics-2".into(),
            reason: String::new(),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(!again.cancelled, "nothing runs any more");
}

#[tokio::test]
async fn execute_is_idempotent_per_delegation() {
    let mesh = Mesh::start().await;
    // A short delay keeps the first call running while the second one arrives.
    let profiles = profiles_with("logs-investigator", |p| {
        p.faults.delay = Some(Duration::from_millis(300));
    });
    let worker = mesh.worker(profiles, 4).await;
    let task = task("del-logs-4", "logs-investigator", Duration::from_secs(30));
    let token = mesh.token_for(&task, &[]).await;

    let (a, b) = tokio::join!(
        worker.execute(&task, &token, 1),
        worker.execute(&task, &token, 1)
    );
    let (a, b) = (a.unwrap(), b.unwrap());
    assert_eq!(a, b, "the second call joined the first");
    assert_eq!(
        mesh.decisions_for("del-logs-4").len(),
        2,
        "the task ran once"
    );
    let cached = worker.execute(&task, &token, 1).await.unwrap();
    assert_eq!(cached, a, "a finished delegation answers from the cache");
    assert_eq!(mesh.decisions_for("del-logs-4").len(), 2);

    // A new worker (say, after a restart) re-executes under the same delegation id: it
    // records the same evidence ids, and the store's records are reused.
    let fresh = mesh.worker(profiles::example().unwrap(), 4).await;
    let token2 = mesh.token_for(&task, &[]).await;
    let rerun = fresh.execute(&task, &token2, 2).await.unwrap();
    assert_eq!(status(&rerun), v1::TaskStatus::Completed, "{rerun:#?}");
    let ids = |r: &v1::TaskResult| {
        r.evidence
            .iter()
            .map(|e| (e.evidence_id.clone(), e.content_hash.clone()))
            .collect::<Vec<_>>()
    };
    assert_eq!(ids(&rerun), ids(&a));
    assert_eq!(
        rerun.evidence, a.evidence,
        "the records stored by the first run are reused, observation time included"
    );
    assert_eq!(rerun.claims, a.claims);
}

#[tokio::test]
async fn injected_transient_failures_are_retried_under_the_same_id() {
    let mesh = Mesh::start().await;
    let profiles = profiles_with("metrics-investigator", |p| p.faults.fail_attempts = 1);
    let worker = mesh.worker(profiles, 4).await;
    let task = task(
        "del-metrics-3",
        "metrics-investigator",
        Duration::from_secs(30),
    );
    let token = mesh.token_for(&task, &[]).await;

    let first = worker.execute(&task, &token, 1).await.unwrap();
    assert_eq!(status(&first), v1::TaskStatus::Failed);
    assert!(first.error.as_ref().unwrap().retryable);
    // The same attempt again is a duplicate delivery: the same answer.
    assert_eq!(worker.execute(&task, &token, 1).await.unwrap(), first);
    // The next attempt runs the delegation again.
    let second = worker.execute(&task, &token, 2).await.unwrap();
    assert_eq!(status(&second), v1::TaskStatus::Completed, "{second:#?}");
}

#[tokio::test]
async fn capacity_is_enforced_and_refusals_say_why() {
    let mesh = Mesh::start().await;
    let profiles = profiles_with("logs-investigator", |p| p.faults.hang = true);
    let worker = mesh.worker(profiles, 1).await;
    let busy = task("del-logs-5", "logs-investigator", Duration::from_secs(60));
    let busy_token = mesh.token_for(&busy, &[]).await;
    let running = worker.execute_in_background(&busy, &busy_token);
    wait_until(
        "the task in flight",
        || worker.service.in_flight(),
        |n| *n > 0,
    )
    .await;
    let other = task(
        "del-metrics-4",
        "metrics-investigator",
        Duration::from_secs(30),
    );
    let token = mesh.token_for(&other, &[]).await;
    let refused = worker.execute(&other, &token, 1).await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::ResourceExhausted);
    assert!(
        refused.message().contains("worker busy"),
        "{}",
        refused.message()
    );

    let mut unknown = other.clone();
    unknown.profile_id = "traces-investigator".into();
    let refused = worker.execute(&unknown, &token, 1).await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::FailedPrecondition);
    assert!(
        refused.message().contains("logs-investigator"),
        "{}",
        refused.message()
    );

    let mut invalid = other.clone();
    invalid.deadline = None;
    let refused = worker.execute(&invalid, &token, 1).await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::InvalidArgument);
    assert!(
        refused.message().contains("task.deadline"),
        "{}",
        refused.message()
    );

    worker
        .client
        .clone()
        .cancel(v1::WorkerCancelRequest {
            delegation_id: "del-logs-5".into(),
            reason: "test over".into(),
        })
        .await
        .unwrap();
    running.await.unwrap().unwrap();
}

#[tokio::test]
async fn an_unreachable_evidence_store_fails_the_task_as_retryable() {
    let mesh = Mesh::start().await;
    let dead = convene_server::test_util::pick_listener().await;
    let dead_addr = dead.local_addr().unwrap();
    drop(dead);
    let service = convene_worker::WorkerService::new(
        convene_worker::WorkerOptions {
            worker_id: "worker-test-2".into(),
            capacity: 2,
            exit_process_on_fault: false,
            models: Default::default(),
            key_refresh: convene_mesh::auth::DEFAULT_KEY_REFRESH,
        },
        profiles::example().unwrap(),
        &convene_worker::profiles::ProviderRegistry::builtin(&Default::default()),
        convene_worker::tools::ToolRegistry::builtin(crate::support::example_data()),
        mesh.policy_handle(),
        std::sync::Arc::new(
            convene_mesh::handles::GrpcEvidenceStore::connect(
                &convene_server::test_util::endpoint(dead_addr),
            )
            .unwrap(),
        ),
    )
    .unwrap();
    let worker = crate::support::TestWorker::start(&mesh.supervisor, service).await;
    let task = task(
        "del-metrics-5",
        "metrics-investigator",
        Duration::from_secs(30),
    );
    let token = mesh.token_for(&task, &[]).await;

    let result = worker.execute(&task, &token, 1).await.unwrap();
    assert_eq!(status(&result), v1::TaskStatus::Failed, "{result:#?}");
    let error = result.error.unwrap();
    assert_eq!(error.code, "upstream_unavailable");
    assert!(
        error.retryable,
        "a retry may succeed once the store is back"
    );
    assert!(
        error.message.contains("evidence store"),
        "{}",
        error.message
    );
}
