//! The payment incident with model-driven specialists: the example's `-model`
//! profiles (provider `openai`) against a scripted OpenAI-compatible server that
//! investigates as the playbooks do, every service its own process exporting its spans
//! over OTLP. The run ends as the playbook version does — the same outcome and the same
//! preserved conflict — every worker.execute has its model.call spans with the GenAI
//! attributes, and the API key the workers hold never leaves the Authorization header.
//! A model that never names an evidence kind gets its tools' declared kinds, so the join
//! decides on what its claims say.

use std::collections::BTreeMap;
use std::time::Duration;

use crate::harness::{
    MeshOptions, Mode, TestMesh, Workers, example_profiles, repo_root, spec_from_yaml,
};
use convene_proto::v1;
use convene_telemetry::test_util::{OtlpReceiver, ReceivedSpan};
use convene_worker::model_server::{PlaybookResponder, Recorded, Reply, ScriptedModel};
use convene_worker::openai::function_name;
use serde_json::{Value, json};

const ONCALL: &str = "oncall@acme";
const LIMIT: Duration = Duration::from_secs(60);
const KEY: &str = "sk-e2e-5d8c2b7a1f904e36-secret";

/// The example profiles with every `openai` profile pointed at `base_url`.
fn profiles_at(base_url: &str) -> String {
    let text = example_profiles();
    let pointed = text.replace(
        "    provider: openai\n",
        &format!("    provider: openai\n    base_url: {base_url}\n"),
    );
    assert_eq!(
        pointed.matches("    base_url: ").count(),
        3,
        "three model profiles"
    );
    pointed
}

fn model_spec() -> v1::RunSpec {
    spec_from_yaml(
        &std::fs::read_to_string(repo_root().join("examples/payment-incident/run-model.yaml"))
            .expect("the model run spec exists"),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn model_driven_specialists_reach_the_playbook_outcome_in_one_trace() {
    let responder = PlaybookResponder::new(&convene_worker::profiles::example().unwrap()).unwrap();
    let model = ScriptedModel::start(responder).unwrap();
    let receiver = OtlpReceiver::start().await;
    let mesh = TestMesh::start(
        Mode::Processes,
        MeshOptions {
            workers: vec![Workers {
                profiles: Some(profiles_at(&model.base_url())),
                ..Workers::default()
            }],
            env: vec![
                (
                    convene_telemetry::OTEL_EXPORTER_OTLP_ENDPOINT.to_owned(),
                    receiver.endpoint(),
                ),
                ("OTEL_BSP_SCHEDULE_DELAY".to_owned(), "200".to_owned()),
                ("OPENAI_API_KEY".to_owned(), KEY.to_owned()),
                ("CONVENE_MODEL".to_owned(), "scripted-incident".to_owned()),
            ],
            ..MeshOptions::default()
        },
    )
    .await;

    let run_id = mesh.start_run_id(ONCALL, model_spec()).await;
    let run = mesh.wait_terminal(ONCALL, &run_id, LIMIT).await;

    // The playbook version's outcome: the join preserves the primary_cause conflict
    // between the logs and the change audit, and waits for people.
    assert_eq!(run.state, v1::RunState::WaitingInput as i32, "{run:#?}");
    assert_eq!(run.outcome, v1::JoinOutcome::ConflictRequiresHuman as i32);
    let decision = run.decision.clone().expect("decision");
    assert_eq!(decision.accepted.len(), 3, "{decision:#?}");
    assert!(decision.quorum_met);
    let conflict = decision
        .conflicts
        .iter()
        .find(|c| c.topic == "primary_cause")
        .expect("the primary_cause conflict is preserved");
    let values: BTreeMap<&str, &v1::ConflictingClaim> = conflict
        .claims
        .iter()
        .map(|c| (c.value.as_str(), c))
        .collect();
    assert_eq!(
        values.keys().copied().collect::<Vec<_>>(),
        ["connection_pool_exhaustion", "risk_rule_change"]
    );
    for d in &run.delegations {
        let result = d.result.as_ref().expect("result");
        assert!(
            result.profile_id.ends_with("-model"),
            "{}",
            result.profile_id
        );
        let usage = result.usage.as_ref().expect("usage");
        assert_eq!(usage.iterations, 2, "tools, then the report");
        assert!(usage.tokens > 0, "the model's tokens are counted");
    }
    let run_usage = run.usage.as_ref().expect("the run's usage");
    assert!(run_usage.tokens >= 3 * 1320, "{run_usage:?}");

    // The workers asked the scripted server with the key, for the overriding model.
    let requests = model.requests();
    assert_eq!(requests.len(), 6, "two turns for each specialist");
    for r in &requests {
        assert_eq!(r.authorization(), Some(format!("Bearer {KEY}").as_str()));
        assert_eq!(r.model(), Some("scripted-incident"));
    }

    let events = mesh.run_events(ONCALL, &run_id).await;
    mesh.stop(Duration::from_secs(10)).await;
    let all = receiver
        .wait_for(Duration::from_secs(10), |spans| {
            spans
                .iter()
                .filter(|s| s.trace_id == run.trace_id && s.name == "model.call")
                .count()
                >= 6
                && spans
                    .iter()
                    .any(|s| s.trace_id == run.trace_id && s.name == "run")
        })
        .await;
    let trace: Vec<&ReceivedSpan> = all.iter().filter(|s| s.trace_id == run.trace_id).collect();

    // Under each worker.execute, its model.call spans with the GenAI attributes.
    let executions: Vec<&&ReceivedSpan> = trace
        .iter()
        .filter(|s| s.name == "worker.execute")
        .collect();
    assert_eq!(executions.len(), 3);
    for exec in executions {
        let calls: Vec<&&ReceivedSpan> = trace
            .iter()
            .filter(|s| s.name == "model.call" && s.parent_span_id == exec.span_id)
            .collect();
        assert_eq!(calls.len(), 2, "{exec:#?}");
        for m in calls {
            assert_eq!(m.attr("gen_ai.operation.name"), Some("chat"));
            assert_eq!(m.attr("gen_ai.provider.name"), Some("openai"));
            assert_eq!(m.attr("gen_ai.request.model"), Some("scripted-incident"));
            assert_eq!(m.attr("gen_ai.response.model"), Some("scripted-incident"));
            assert_eq!(m.attr("gen_ai.request.max_tokens"), Some("4096"));
            assert!(m.attr("gen_ai.request.temperature").is_some(), "{m:#?}");
            assert_eq!(m.attr("gen_ai.usage.input_tokens"), Some("600"));
            assert_eq!(m.attr("gen_ai.usage.output_tokens"), Some("60"));
            assert_eq!(m.attr("gen_ai.response.finish_reasons"), Some("tool_calls"));
        }
    }

    // The key appears in no span, no stored run and no event.
    for s in &all {
        assert!(
            !format!("{s:?}").contains(KEY),
            "the key leaked into a span: {s:#?}"
        );
    }
    assert!(
        !format!("{run:?}").contains(KEY),
        "the key leaked into the run"
    );
    assert!(
        !format!("{events:?}").contains(KEY),
        "the key leaked into an event"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_model_tokens_count_against_the_runs_budget() {
    // One specialist at a time and a run budget of 1,000 tokens: the first specialist is
    // dispatched with the whole remainder, its two turns (660 tokens each) spend it, it
    // hands in its report on the turn that spends it (PARTIAL, BUDGET_EXHAUSTED), and
    // the supervisor starts no other.
    let responder = PlaybookResponder::new(&convene_worker::profiles::example().unwrap()).unwrap();
    let model = ScriptedModel::start(responder).unwrap();
    let mesh = TestMesh::start(
        Mode::InProcess,
        MeshOptions {
            workers: vec![Workers {
                profiles: Some(profiles_at(&model.base_url())),
                ..Workers::default()
            }],
            ..MeshOptions::default()
        },
    )
    .await;
    let mut spec = model_spec();
    spec.idempotency_key = "model-budget".to_owned();
    let limits = spec.limits.as_mut().expect("limits");
    limits.max_parallel_workers = 1;
    limits.max_tokens = 1000;
    let run_id = mesh.start_run_id(ONCALL, spec).await;
    let run = mesh.wait_terminal(ONCALL, &run_id, LIMIT).await;

    assert_eq!(run.state, v1::RunState::BudgetExhausted as i32, "{run:#?}");
    let usage = run.usage.as_ref().expect("the run's usage");
    assert_eq!(usage.tokens, 1320, "the first specialist's two turns");
    let done: Vec<&v1::Delegation> = run
        .delegations
        .iter()
        .filter(|d| d.result.is_some())
        .collect();
    assert_eq!(done.len(), 1, "{run:#?}");
    let result = done[0].result.as_ref().unwrap();
    assert_eq!(result.status, v1::TaskStatus::Partial as i32, "{result:#?}");
    let error = result.error.as_ref().expect("why it stopped");
    assert_eq!(error.code, "BUDGET_EXHAUSTED");
    assert!(
        !result.claims.is_empty(),
        "the report handed in still counts"
    );
    assert!(
        run.delegations
            .iter()
            .filter(|d| d.result.is_none())
            .all(|d| d.dispatched_at.is_none()),
        "no other specialist started: {run:#?}"
    );
    // The task was given what the run had: its second answer could use no more than
    // the 340 tokens left of 1,000.
    let requests = model.requests();
    assert_eq!(requests.len(), 2);
    assert_eq!(requests[1].body["max_completion_tokens"], 340);
}

/// A model that knows nothing of evidence kinds: it calls each tool it is offered once,
/// with the required arguments only (never `evidence_kind`), then hands in a report whose
/// claims cite every evidence id the calls returned. Which specialist it plays it tells
/// from the tools offered; its findings are the playbooks' (the logs blame the connection
/// pool, the change audit the risk rule).
fn naive_model(request: &Recorded) -> Reply {
    let tools = request.tools();
    let offered = |tool: &str| tools.contains(&function_name(tool).as_str());
    let (calls, topic, value): (Vec<(&str, &str, Value)>, &str, &str) = if offered("list_changes@1")
    {
        (
            vec![
                ("call_changes", "list_changes@1", json!({})),
                (
                    "call_hit_rate",
                    "query_metrics@1",
                    json!({"metric": "risk.rule_hit_rate.RC-4711"}),
                ),
            ],
            "primary_cause",
            "risk_rule_change",
        )
    } else if offered("query_metrics@1") {
        (
            vec![(
                "call_success_rate",
                "query_metrics@1",
                json!({"metric": "payment.success_rate"}),
            )],
            "impact.success_rate",
            "99.6% -> 93.1% at 02:02",
        )
    } else {
        (
            vec![(
                "call_logs",
                "search_logs@1",
                json!({"service": "payment-api"}),
            )],
            "primary_cause",
            "connection_pool_exhaustion",
        )
    };
    let results = request.last_tool_results();
    if results.is_empty() {
        return Reply::tool_calls(
            calls
                .into_iter()
                .map(|(id, tool, args)| (id, function_name(tool), args.to_string())),
        );
    }
    let refs: Vec<String> = results
        .iter()
        .filter_map(|r| {
            let outcome: Value = serde_json::from_str(&r.content).ok()?;
            outcome["evidence_id"].as_str().map(str::to_owned)
        })
        .collect();
    let report = json!({
        "summary": format!("{topic}: {value}"),
        "claims": [{
            "claim_id": "claim-naive",
            "topic": topic,
            "value": value,
            "statement": format!("{topic} is {value}"),
            "evidence_refs": refs,
            "confidence": 0.7
        }]
    });
    Reply::tool_calls([(
        "call_report",
        "submit_report".to_owned(),
        report.to_string(),
    )])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_that_names_no_evidence_kinds_gets_its_tools_kinds_and_a_real_decision() {
    let model = ScriptedModel::start(naive_model).unwrap();
    let mesh = TestMesh::start(
        Mode::InProcess,
        MeshOptions {
            workers: vec![Workers {
                profiles: Some(profiles_at(&model.base_url())),
                ..Workers::default()
            }],
            ..MeshOptions::default()
        },
    )
    .await;
    let mut spec = model_spec();
    spec.idempotency_key = "model-naive-kinds".to_owned();
    let run_id = mesh.start_run_id(ONCALL, spec).await;
    let run = mesh.wait_terminal(ONCALL, &run_id, LIMIT).await;

    // No call named a kind, yet the join has the kinds it requires: it decides on what
    // the claims say, here the logs and the change audit disagreeing on the cause.
    let decision = run.decision.clone().expect("decision");
    assert!(
        decision.missing_evidence_kinds.is_empty(),
        "{:?}",
        decision.reasons
    );
    assert!(decision.quorum_met, "{:?}", decision.reasons);
    assert_eq!(decision.accepted.len(), 3, "{decision:#?}");
    assert_eq!(
        run.outcome,
        v1::JoinOutcome::ConflictRequiresHuman as i32,
        "{:?}",
        decision.reasons
    );
    let conflict = decision
        .conflicts
        .iter()
        .find(|c| c.topic == "primary_cause")
        .expect("the primary_cause conflict");
    assert_eq!(conflict.claims.len(), 2);

    // Every record carries its tool's kind as the profile declares it, marked defaulted.
    let mut kinds: Vec<(String, String)> = Vec::new();
    for d in &run.delegations {
        let result = d.result.as_ref().expect("result");
        assert_eq!(
            result.status,
            v1::TaskStatus::Completed as i32,
            "{result:#?}"
        );
        for e in &result.evidence {
            assert!(e.kind_defaulted, "{e:#?}");
            let call = e.evidence_id.rsplit('/').next().unwrap_or_default();
            kinds.push((call.to_owned(), e.kind.clone()));
        }
    }
    kinds.sort();
    let expected: Vec<(String, String)> = [
        ("call_changes", "causal_signal"),
        ("call_hit_rate", "causal_signal"),
        ("call_logs", "causal_signal"),
        ("call_success_rate", "impact_metric"),
    ]
    .iter()
    .map(|(c, k)| ((*c).to_owned(), (*k).to_owned()))
    .collect();
    assert_eq!(kinds, expected);

    // The decision says which of the evidence it rests on had its kind defaulted.
    let defaulted = decision
        .reasons
        .iter()
        .find(|r| r.contains("evidence kind defaulted"))
        .unwrap_or_else(|| {
            panic!(
                "no reason names the defaulted kinds: {:?}",
                decision.reasons
            )
        });
    for call in [
        "call_changes",
        "call_hit_rate",
        "call_logs",
        "call_success_rate",
    ] {
        assert!(defaulted.contains(call), "{call}: {defaulted}");
    }
    assert!(defaulted.contains("(impact_metric)"), "{defaulted}");

    // The model was never asked to name a kind it could not use: each tool's kinds were
    // offered as an enum, and no call was refused.
    let requests = model.requests();
    assert_eq!(requests.len(), 6, "two turns for each specialist");
    for r in requests.iter().filter(|r| r.last_tool_results().is_empty()) {
        for tool in r.body["tools"].as_array().expect("tools") {
            let function = &tool["function"];
            if function["name"] == "submit_report" {
                continue;
            }
            let kinds = &function["parameters"]["properties"]["evidence_kind"]["enum"];
            assert!(kinds.is_array(), "{function}");
        }
    }
    for r in requests
        .iter()
        .filter(|r| !r.last_tool_results().is_empty())
    {
        for result in r.last_tool_results() {
            let outcome: Value = serde_json::from_str(&result.content).unwrap();
            assert_eq!(outcome["success"], true, "{outcome}");
        }
    }
    mesh.stop(Duration::from_secs(10)).await;
}
