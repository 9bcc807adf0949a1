//! The agent loop with a model: the `openai` provider against a scripted
//! OpenAI-compatible server on loopback, over the real policy service and evidence
//! store. Tool calls round trip to a report whose claims cite recorded evidence;
//! every mistake a model can make comes back to it as a tool outcome; rate limits are
//! waited out, outages fail the task as retryable; budgets and the iteration limit end
//! the loop; and the API key never shows up anywhere but the Authorization header.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use convene_mesh::auth;
use convene_proto::v1;
use convene_telemetry::test_util::Capture;
use convene_worker::agent::turns::{
    MODEL_TURN_KIND, compaction_evidence_id, turn_evidence_id, walk,
};
use convene_worker::model_server::{Recorded, Reply, Script, ScriptedModel};
use convene_worker::models::ModelSettings;
use convene_worker::profiles::{self, Profile};
use opentelemetry::Value as OtelValue;
use serde_json::{Value, json};

use crate::support::{Mesh, RUN_ID, TestWorker, status, task};

const PROFILE: &str = "logs-investigator-model";
/// A key that must never appear outside the Authorization header.
const KEY: &str = "sk-test-7f3a9c1e5b2d4086-never-log-me";

/// A worker whose `logs-investigator-model` profile talks to `model`, its key in a file.
struct Rig {
    mesh: Mesh,
    worker: TestWorker,
    model: ScriptedModel,
    _key_dir: tempfile::TempDir,
}

fn settings() -> ModelSettings {
    ModelSettings {
        retries: 3,
        backoff: Duration::from_millis(10),
        ..ModelSettings::default()
    }
}

async fn rig(model: ScriptedModel, edit: impl FnOnce(&mut Profile)) -> Rig {
    let mesh = Mesh::start().await;
    let key_dir = tempfile::tempdir().unwrap();
    let key_file = key_dir.path().join("openai.key");
    std::fs::write(&key_file, format!("{KEY}\n")).unwrap();
    let mut profiles = profiles::example().unwrap();
    let profile = profiles
        .iter_mut()
        .find(|p| p.profile.id == PROFILE)
        .unwrap();
    profile.connection.base_url = Some(model.base_url());
    profile.connection.api_key_file = Some(key_file);
    profile.profile.model = "scripted-model".into();
    edit(profile);
    let worker = mesh.worker_with_models(profiles, 4, settings()).await;
    Rig {
        mesh,
        worker,
        model,
        _key_dir: key_dir,
    }
}

impl Rig {
    async fn run(&self, task: &v1::DelegationTask) -> (v1::TaskResult, String) {
        let token = self.mesh.token_for(task, &[]).await;
        let result = self.worker.execute(task, &token, 1).await.unwrap();
        (result, token)
    }

    async fn evidence(&self, token: &str, ids: Vec<String>) -> Vec<v1::Evidence> {
        self.mesh
            .evidence_handle()
            .get_evidence(auth::request(
                v1::GetEvidenceRequest { evidence_ids: ids },
                token,
            ))
            .await
            .unwrap()
            .into_inner()
            .evidence
    }

    async fn artifact(&self, token: &str, uri: &str) -> Vec<u8> {
        self.mesh
            .evidence_handle()
            .get_artifact(auth::request(
                v1::GetArtifactRequest { uri: uri.into() },
                token,
            ))
            .await
            .unwrap()
            .into_inner()
            .content
    }
}

fn the_task(id: &str) -> v1::DelegationTask {
    task(id, PROFILE, Duration::from_secs(30))
}

/// `task` with a budget of `tokens` model tokens.
fn with_tokens(mut task: v1::DelegationTask, tokens: u64) -> v1::DelegationTask {
    task.budget = Some(v1::Budget {
        max_tokens: tokens,
        ..v1::Budget::default()
    });
    task
}

/// The search that finds the pool exhaustion, as the model writes it.
fn pool_search() -> String {
    json!({"service": "payment-api", "match": {"error": "POOL_EXHAUSTED"},
           "evidence_kind": "causal_signal"})
    .to_string()
}

/// The outcome the loop answered call `id` with, in the last turn's tool results.
fn outcome_of(request: &Recorded, id: &str) -> Value {
    let result = request
        .last_tool_results()
        .into_iter()
        .find(|r| r.tool_call_id == id)
        .unwrap_or_else(|| panic!("no tool result for {id}: {:#?}", request.messages()));
    serde_json::from_str(&result.content).unwrap()
}

/// A `submit_report` call with one claim on `primary_cause` citing `refs`.
fn report(call_id: &str, refs: &[&str]) -> Reply {
    Reply::tool_calls(vec![(call_id, "submit_report", report_arguments(refs))])
}

/// The arguments of [`report`]'s call.
fn report_arguments(refs: &[&str]) -> String {
    json!({
        "summary": "payment-api ran out of database connections",
        "claims": [{
            "claim_id": "claim-cause",
            "topic": "primary_cause",
            "value": "connection_pool_exhaustion",
            "statement": "POOL_EXHAUSTED errors in payment-api",
            "evidence_refs": refs,
            "confidence": 0.8
        }]
    })
    .to_string()
}

/// One scripted turn: the reply, given the request.
type Turn = Box<dyn Fn(&Recorded) -> Reply + Send + Sync>;

/// A responder answering turn `n` (from 0) with `turns[n]`, each a function of the
/// request; the server answers 500 once they are used up.
fn turns(turns: Vec<Turn>) -> ScriptedModel {
    ScriptedModel::start(move |r: &Recorded| match turns.get(r.index) {
        Some(turn) => turn(r),
        None => Reply::error(500, "the test script has no more turns"),
    })
    .unwrap()
}

/// Fails if the key appears in `text`.
fn assert_no_key(what: &str, text: &str) {
    assert!(
        !text.contains(KEY),
        "the API key leaked into {what}: {text}"
    );
    assert!(
        !text.contains("7f3a9c1e5b2d4086"),
        "part of the API key leaked into {what}"
    );
}

/// Fails if the key appears in any attribute or event of the captured spans.
fn assert_no_key_in_spans(capture: &Capture) {
    for span in capture.spans() {
        let mut text = format!("{} ", span.name);
        for kv in &span.attributes {
            text.push_str(&format!("{}={} ", kv.key, kv.value));
        }
        for event in span.events.iter() {
            text.push_str(&event.name);
            for kv in &event.attributes {
                text.push_str(&format!(" {}={}", kv.key, kv.value));
            }
        }
        assert_no_key("a span", &text);
    }
}

fn attr(span: &opentelemetry_sdk::trace::SpanData, key: &str) -> Option<OtelValue> {
    span.attributes
        .iter()
        .find(|kv| kv.key.as_str() == key)
        .map(|kv| kv.value.clone())
}

/// Log lines written while the guard lives, as text.
struct Logs(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Logs {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[tokio::test]
async fn a_model_calls_tools_and_reports_claims_that_cite_recorded_evidence() {
    let capture = Capture::new();
    let _guard = capture.set_default();
    let model = turns(vec![
        Box::new(|_| {
            Reply::tool_calls(vec![("call_pool", "search_logs_v1", pool_search())])
                .with_usage(500, 40)
        }),
        Box::new(|r| {
            let outcome = outcome_of(r, "call_pool");
            assert_eq!(outcome["success"], true, "{outcome}");
            let id = outcome["evidence_id"].as_str().unwrap().to_owned();
            report("call_report", &[&id]).with_usage(900, 120)
        }),
    ]);
    let rig = rig(model, |_| {}).await;
    let task = the_task("del-model-1");
    let (result, token) = rig.run(&task).await;

    assert_eq!(status(&result), v1::TaskStatus::Completed, "{result:#?}");
    let cause = &result.claims[0];
    assert_eq!(cause.value, "connection_pool_exhaustion");
    let evidence_id = format!("logs://payment-api/{RUN_ID}/del-model-1/call_pool");
    assert_eq!(cause.evidence_refs, std::slice::from_ref(&evidence_id));
    assert_eq!(result.evidence.len(), 1);
    assert_eq!(result.evidence[0].kind, "causal_signal");
    let usage = result.usage.unwrap();
    assert_eq!(
        (usage.iterations, usage.tool_calls, usage.tokens),
        (2, 1, 1560)
    );
    // The call was authorized by the policy service.
    let decisions = rig.mesh.decisions_for("del-model-1");
    assert_eq!(decisions.len(), 1);
    assert!(decisions[0].allowed && decisions[0].tool == "search_logs@1");

    // What the server was asked: the key as a bearer token, the profile's model, the
    // task in the prompt and the tools under function names.
    let requests = rig.model.requests();
    assert_eq!(requests.len(), 2);
    let first = &requests[0];
    assert_eq!(
        first.authorization(),
        Some(format!("Bearer {KEY}").as_str())
    );
    assert_eq!(first.model(), Some("scripted-model"));
    assert_eq!(first.tools(), ["search_logs_v1", "submit_report"]);
    let system = first.messages()[0]["content"].as_str().unwrap();
    assert!(system.contains("logs investigator") && system.contains("submit_report"));
    let user = first.messages()[1]["content"].as_str().unwrap();
    assert!(
        user.contains(&task.goal) && user.contains("search_logs@1"),
        "{user}"
    );
    assert!(user.contains("Acceptance criteria"), "{user}");
    let report_schema = &first.body["tools"][1]["function"]["parameters"];
    assert!(
        report_schema["properties"]["claims"].is_object(),
        "{report_schema}"
    );
    assert!(first.body["max_completion_tokens"].as_u64().unwrap() > 0);

    // Both turns are stored as evidence, and the first lists the call it asked for.
    let turn_ids: Vec<String> = (1..=2)
        .map(|n| turn_evidence_id(RUN_ID, "del-model-1", 1, n))
        .collect();
    let turns = rig.evidence(&token, turn_ids).await;
    assert_eq!(turns.len(), 2, "{turns:#?}");
    assert!(turns.iter().all(|t| t.kind == MODEL_TURN_KIND));
    let first_turn: Value =
        serde_json::from_slice(&rig.artifact(&token, &turns[0].artifact_uri).await).unwrap();
    assert_eq!(
        first_turn["response"]["message"]["tool_calls"][0]["id"],
        "call_pool"
    );
    assert_eq!(first_turn["delegation_id"], "del-model-1");
    assert_eq!(first_turn["response"]["usage"]["input"], 500);
    for t in &turns {
        let bytes = rig.artifact(&token, &t.artifact_uri).await;
        assert_no_key("a stored model turn", &String::from_utf8_lossy(&bytes));
    }

    // One model.call span per request, child of worker.execute, with the GenAI
    // attributes; no prompt text unless asked for.
    let spans = capture.spans();
    let execute = spans.iter().find(|s| s.name == "worker.execute").unwrap();
    let calls: Vec<_> = spans.iter().filter(|s| s.name == "model.call").collect();
    assert_eq!(
        calls.len(),
        2,
        "{:?}",
        spans.iter().map(|s| &s.name).collect::<Vec<_>>()
    );
    for call in &calls {
        assert_eq!(call.parent_span_id, execute.span_context.span_id());
        assert_eq!(
            attr(call, "gen_ai.operation.name"),
            Some(OtelValue::from("chat"))
        );
        assert_eq!(
            attr(call, "gen_ai.provider.name"),
            Some(OtelValue::from("openai"))
        );
        assert_eq!(
            attr(call, "gen_ai.request.model"),
            Some(OtelValue::from("scripted-model"))
        );
        assert_eq!(
            attr(call, "gen_ai.response.model"),
            Some(OtelValue::from("scripted-model"))
        );
        for key in [
            "gen_ai.request.max_tokens",
            "gen_ai.request.temperature",
            "gen_ai.usage.input_tokens",
            "gen_ai.usage.output_tokens",
            "gen_ai.response.finish_reasons",
        ] {
            assert!(attr(call, key).is_some(), "{key} missing");
        }
        assert!(attr(call, "gen_ai.input.messages").is_none());
    }
    assert_eq!(
        attr(calls[0], "gen_ai.usage.input_tokens").map(|v| v.as_str().into_owned()),
        Some("500".to_owned())
    );
    assert_eq!(
        attr(calls[0], "gen_ai.response.finish_reasons"),
        Some(OtelValue::from("tool_calls"))
    );
    assert_no_key_in_spans(&capture);
    assert_no_key("the result", &format!("{result:?}"));
}

#[tokio::test]
async fn parallel_tool_calls_run_concurrently_and_answer_in_call_order() {
    let capture = Capture::new();
    let _guard = capture.set_default();
    let model = turns(vec![
        Box::new(|_| {
            Reply::tool_calls(vec![
                ("c3", "search_logs_v1", pool_search()),
                (
                    "c1",
                    "search_logs_v1",
                    json!({"service": "payment-api", "match": {"event": "payment_confirm"},
                           "group_by": "outcome", "evidence_kind": "impact_metric"})
                    .to_string(),
                ),
                (
                    "c2",
                    "search_logs_v1",
                    json!({"service": "risk-gateway", "text": "timeout"}).to_string(),
                ),
            ])
        }),
        Box::new(|r| {
            let order: Vec<String> = r
                .last_tool_results()
                .into_iter()
                .map(|t| t.tool_call_id)
                .collect();
            assert_eq!(order, ["c3", "c1", "c2"], "answers in call order");
            let ids: Vec<String> = ["c3", "c1"]
                .iter()
                .map(|c| outcome_of(r, c)["evidence_id"].as_str().unwrap().to_owned())
                .collect();
            report("r", &[&ids[0], &ids[1]])
        }),
    ]);
    let rig = rig(model, |_| {}).await;
    let (result, _) = rig.run(&the_task("del-model-par")).await;
    assert_eq!(status(&result), v1::TaskStatus::Completed, "{result:#?}");
    assert_eq!(result.usage.unwrap().tool_calls, 3);
    // The three calls overlapped: each started before any of them ended.
    let calls: Vec<_> = capture
        .spans()
        .into_iter()
        .filter(|s| s.name == "tool.call")
        .collect();
    assert_eq!(calls.len(), 3);
    let last_start = calls.iter().map(|s| s.start_time).max().unwrap();
    let first_end = calls.iter().map(|s| s.end_time).min().unwrap();
    assert!(
        last_start < first_end,
        "the tool calls ran one after another"
    );
}

#[tokio::test]
async fn every_mistake_comes_back_to_the_model_which_corrects_it() {
    let model = turns(vec![
        // Malformed arguments, an unknown tool, a tool not granted to this task, and one
        // good call, all in one turn.
        Box::new(|_| {
            Reply::tool_calls(vec![
                (
                    "bad_json",
                    "search_logs_v1",
                    "{\"service\": payment-api".to_owned(),
                ),
                ("unknown", "drop_tables", "{}".to_owned()),
                ("ungranted", "list_changes_v1", "{}".to_owned()),
                ("good", "search_logs_v1", pool_search()),
            ])
        }),
        // A report citing evidence that was never recorded.
        Box::new(|r| {
            let malformed = outcome_of(r, "bad_json");
            assert_eq!(malformed["success"], false);
            assert!(
                malformed["error"]
                    .as_str()
                    .unwrap()
                    .contains("not a JSON object"),
                "{malformed}"
            );
            let unknown = outcome_of(r, "unknown");
            assert!(
                unknown["error"].as_str().unwrap().contains("unknown tool"),
                "{unknown}"
            );
            let ungranted = outcome_of(r, "ungranted");
            assert!(
                ungranted["error"]
                    .as_str()
                    .unwrap()
                    .contains("denied by policy"),
                "{ungranted}"
            );
            assert_eq!(outcome_of(r, "good")["success"], true);
            report("r1", &["logs://payment-api/made-up-evidence"])
        }),
        // Plain text instead of a report.
        Box::new(|r| {
            let refused = outcome_of(r, "r1");
            let why = refused["error"].as_str().unwrap();
            assert!(
                why.contains("made-up-evidence") && why.contains("not recorded"),
                "{why}"
            );
            Reply::text("The cause is connection pool exhaustion.")
        }),
        // The report, right this time.
        Box::new(|r| {
            let last = r.messages().last().unwrap();
            assert_eq!(last["role"], "user");
            assert!(
                last["content"].as_str().unwrap().contains("submit_report"),
                "{last}"
            );
            let good = format!("logs://payment-api/{RUN_ID}/del-model-fix/good");
            report("r2", &[&good])
        }),
    ]);
    let rig = rig(model, |_| {}).await;
    let (result, _) = rig.run(&the_task("del-model-fix")).await;
    assert_eq!(status(&result), v1::TaskStatus::Completed, "{result:#?}");
    assert_eq!(result.usage.as_ref().unwrap().iterations, 4);
    assert_eq!(rig.model.request_count(), 4);
    // The ungranted call was judged by the policy service, and denied in its log.
    let decisions = rig.mesh.decisions_for("del-model-fix");
    let denied: Vec<_> = decisions.iter().filter(|d| !d.allowed).collect();
    assert_eq!(denied.len(), 1, "{decisions:#?}");
    assert_eq!(denied[0].tool, "list_changes@1");
    assert!(
        decisions
            .iter()
            .any(|d| d.allowed && d.tool == "search_logs@1")
    );
}

#[tokio::test]
async fn a_rate_limit_is_waited_out_as_the_server_asks() {
    let logs = Arc::new(Mutex::new(Vec::new()));
    let writer = logs.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(move || Logs(writer.clone()))
        .with_max_level(tracing::Level::DEBUG)
        .finish();
    let _guard = tracing::subscriber::set_default(subscriber);
    let model = ScriptedModel::start(Script::new(vec![
        Reply::error(
            429,
            json!({"error": {"message": "Rate limit reached", "type": "rate_limit_error"}}),
        )
        .with_header("Retry-After", "1"),
        Reply::tool_calls(vec![("call_pool", "search_logs_v1", pool_search())]),
        report(
            "r",
            &[&format!(
                "logs://payment-api/{RUN_ID}/del-model-429/call_pool"
            )],
        ),
    ]))
    .unwrap();
    let rig = rig(model, |_| {}).await;
    let (result, _) = rig.run(&the_task("del-model-429")).await;
    assert_eq!(status(&result), v1::TaskStatus::Completed, "{result:#?}");
    let requests = rig.model.requests();
    assert_eq!(requests.len(), 3);
    let waited = requests[1].received - requests[0].received;
    assert!(
        waited >= Duration::from_secs(1),
        "Retry-After: 1 honoured, waited {waited:?}"
    );
    // The retry is the same request.
    assert_eq!(requests[0].body, requests[1].body);
    let text = String::from_utf8(logs.lock().unwrap().clone()).unwrap();
    assert!(text.contains("retrying"), "{text}");
    assert_no_key("the logs", &text);
}

#[tokio::test]
async fn repeated_server_errors_fail_the_task_as_retryable() {
    let model = ScriptedModel::start(Script::new(
        (0..4)
            .map(|_| Reply::error(500, json!({"error": {"message": "upstream overloaded"}})))
            .collect(),
    ))
    .unwrap();
    let rig = rig(model, |_| {}).await;
    let (result, _) = rig.run(&the_task("del-model-500")).await;
    assert_eq!(status(&result), v1::TaskStatus::Failed, "{result:#?}");
    let error = result.error.as_ref().unwrap();
    assert!(error.retryable, "{error:?}");
    assert_eq!(error.code, "model_error");
    assert!(
        error.message.contains("HTTP 500") && error.message.contains("upstream overloaded"),
        "{}",
        error.message
    );
    // The first try and three retries.
    assert_eq!(rig.model.request_count(), 4);
}

#[tokio::test]
async fn a_refused_key_fails_the_task_with_a_clear_error_that_never_shows_it() {
    let capture = Capture::new();
    let _guard = capture.set_default();
    let model = ScriptedModel::start(Script::new(vec![Reply::error(
        401,
        json!({"error": {"message": "Incorrect API key provided", "type": "invalid_request_error"}}),
    )]))
    .unwrap();
    let rig = rig(model, |_| {}).await;
    let (result, _) = rig.run(&the_task("del-model-401")).await;
    assert_eq!(status(&result), v1::TaskStatus::Failed, "{result:#?}");
    let error = result.error.as_ref().unwrap();
    assert!(!error.retryable);
    assert!(
        error.message.contains("refused the API key") && error.message.contains("openai.key"),
        "names where the key comes from: {}",
        error.message
    );
    assert_eq!(rig.model.request_count(), 1, "a 401 is not retried");
    assert_no_key("the result", &format!("{result:?}"));
    assert_no_key_in_spans(&capture);
}

#[tokio::test]
async fn an_unset_key_sends_no_authorization_header() {
    let model = ScriptedModel::start(Script::new(vec![Reply::text("hello")])).unwrap();
    let rig = rig(model, |p| {
        p.connection.api_key_file = None;
        p.connection.api_key_env = Some("CONVENE_TEST_UNSET_MODEL_KEY".into());
        p.profile.max_iterations = 1;
    })
    .await;
    let (result, _) = rig.run(&the_task("del-model-nokey")).await;
    assert_eq!(status(&result), v1::TaskStatus::Failed);
    assert_eq!(rig.model.requests()[0].authorization(), None);
}

#[tokio::test]
async fn a_spent_token_budget_ends_the_loop_with_the_usage() {
    let model = turns(vec![
        Box::new(|_| {
            Reply::tool_calls(vec![("c1", "search_logs_v1", pool_search())]).with_usage(600, 100)
        }),
        Box::new(|r| {
            // 300 of the task's 1,000 tokens are left for this answer.
            assert_eq!(r.body["max_completion_tokens"], 300);
            Reply::tool_calls(vec![("c2", "search_logs_v1", pool_search())]).with_usage(700, 100)
        }),
    ]);
    let rig = rig(model, |_| {}).await;
    let (result, _) = rig
        .run(&with_tokens(the_task("del-model-budget"), 1000))
        .await;
    assert_eq!(status(&result), v1::TaskStatus::Failed, "{result:#?}");
    let error = result.error.as_ref().unwrap();
    assert_eq!(error.code, "BUDGET_EXHAUSTED");
    assert!(error.message.contains("1500 of 1000"), "{}", error.message);
    let usage = result.usage.as_ref().unwrap();
    assert_eq!((usage.tokens, usage.iterations), (1500, 2));
    // The evidence gathered before the budget ran out is kept.
    assert_eq!(result.evidence.len(), 1);
}

#[tokio::test]
async fn a_report_handed_in_as_the_budget_runs_out_makes_the_task_partial() {
    let model = turns(vec![
        Box::new(|_| {
            Reply::tool_calls(vec![("c1", "search_logs_v1", pool_search())]).with_usage(400, 50)
        }),
        Box::new(|r| {
            let id = outcome_of(r, "c1")["evidence_id"]
                .as_str()
                .unwrap()
                .to_owned();
            report("r", &[&id]).with_usage(900, 100)
        }),
    ]);
    let rig = rig(model, |_| {}).await;
    let (result, _) = rig
        .run(&with_tokens(the_task("del-model-partial"), 1000))
        .await;
    assert_eq!(status(&result), v1::TaskStatus::Partial, "{result:#?}");
    assert_eq!(result.error.as_ref().unwrap().code, "BUDGET_EXHAUSTED");
    assert_eq!(result.claims.len(), 1);
}

#[tokio::test]
async fn token_usage_is_priced_per_model() {
    let model = ScriptedModel::start(Script::new(vec![
        Reply::tool_calls(vec![("c1", "search_logs_v1", pool_search())]).with_usage(1000, 500),
        report(
            "r",
            &[&format!("logs://payment-api/{RUN_ID}/del-model-cost/c1")],
        )
        .with_usage(2000, 500),
    ]))
    .unwrap();
    let mesh = Mesh::start().await;
    let mut profiles = profiles::example().unwrap();
    let profile = profiles
        .iter_mut()
        .find(|p| p.profile.id == PROFILE)
        .unwrap();
    profile.connection.base_url = Some(model.base_url());
    profile.profile.model = "priced".into();
    let mut models = settings();
    models.prices.insert(
        "priced".into(),
        convene_worker::models::Price {
            input_per_1k: 0.5,
            output_per_1k: 2.0,
        },
    );
    let worker = mesh.worker_with_models(profiles, 1, models).await;
    let task = the_task("del-model-cost");
    let token = mesh.token_for(&task, &[]).await;
    let result = worker.execute(&task, &token, 1).await.unwrap();
    assert_eq!(status(&result), v1::TaskStatus::Completed, "{result:#?}");
    // 3,000 input tokens at 0.5 per 1k and 1,000 output tokens at 2 per 1k.
    let cost = result.usage.unwrap().cost;
    assert!((cost - 3.5).abs() < 1e-9, "{cost}");
}

#[tokio::test]
async fn a_model_that_never_reports_stops_at_the_iteration_limit() {
    let model = ScriptedModel::start(|r: &Recorded| {
        Reply::tool_calls(vec![(
            format!("c{}", r.index),
            "search_logs_v1",
            pool_search(),
        )])
    })
    .unwrap();
    let rig = rig(model, |p| p.profile.max_iterations = 3).await;
    let (result, _) = rig.run(&the_task("del-model-loop")).await;
    assert_eq!(status(&result), v1::TaskStatus::Failed, "{result:#?}");
    let error = result.error.as_ref().unwrap();
    assert_eq!(error.code, "iteration_limit");
    assert!(error.message.contains("3 iterations"), "{}", error.message);
    assert_eq!(rig.model.request_count(), 3);
    assert_eq!(result.evidence.len(), 3, "what it gathered is kept");
}

#[tokio::test]
async fn a_kind_left_out_is_the_tools_default_and_one_it_may_not_record_is_refused() {
    let capture = Capture::new();
    let _guard = capture.set_default();
    let naive = json!({"service": "payment-api"}).to_string();
    let wrong = json!({"service": "payment-api", "evidence_kind": "smoking_gun"}).to_string();
    let model = turns(vec![
        Box::new(move |_| {
            Reply::tool_calls(vec![
                ("call_naive", "search_logs_v1", naive.clone()),
                ("call_wrong", "search_logs_v1", wrong.clone()),
            ])
        }),
        Box::new(|r| {
            let id = outcome_of(r, "call_naive")["evidence_id"]
                .as_str()
                .unwrap_or_default()
                .to_owned();
            report("call_report", &[&id])
        }),
    ]);
    let rig = rig(model, |_| {}).await;
    let task = the_task("del-kinds-1");
    let (result, token) = rig.run(&task).await;

    // The model was offered the kinds the profile declares for the tool, the default
    // first.
    let requests = rig.model.requests();
    assert_eq!(requests.len(), 2);
    let offered = &requests[0].body["tools"][0]["function"];
    assert_eq!(offered["name"], "search_logs_v1");
    let kind_arg = &offered["parameters"]["properties"]["evidence_kind"];
    assert_eq!(kind_arg["enum"], json!(["causal_signal", "impact_metric"]));
    assert!(
        kind_arg["description"]
            .as_str()
            .unwrap()
            .contains("left out, causal_signal"),
        "{kind_arg}"
    );

    // The call that named no kind recorded the default, and says so.
    let naive = outcome_of(&requests[1], "call_naive");
    assert_eq!(naive["success"], true, "{naive}");
    let evidence_id = format!("logs://payment-api/{RUN_ID}/del-kinds-1/call_naive");
    assert_eq!(naive["evidence_id"], evidence_id.as_str());
    assert_eq!(result.evidence.len(), 1, "{result:#?}");
    assert_eq!(result.evidence[0].kind, "causal_signal");
    assert!(result.evidence[0].kind_defaulted);
    let stored = rig.evidence(&token, vec![evidence_id.clone()]).await;
    assert_eq!(stored.len(), 1);
    assert_eq!(stored[0].kind, "causal_signal");
    assert!(stored[0].kind_defaulted, "the store keeps the flag");
    assert_eq!(result.claims[0].evidence_refs, [evidence_id]);

    // The call that named a kind the tool may not record was refused, the model told
    // which kinds it may name; nothing was authorized or read for it.
    let wrong = outcome_of(&requests[1], "call_wrong");
    assert_eq!(wrong["success"], false, "{wrong}");
    let error = wrong["error"].as_str().unwrap();
    for part in [
        "smoking_gun",
        "causal_signal, impact_metric",
        "search_logs@1",
    ] {
        assert!(error.contains(part), "{part}: {error}");
    }
    let decisions = rig.mesh.decisions_for("del-kinds-1");
    assert_eq!(
        decisions.len(),
        1,
        "only the allowed call reaches the policy"
    );
    let usage = result.usage.as_ref().unwrap();
    assert_eq!(
        usage.tool_calls, 2,
        "the refused call counts toward the budget"
    );
    // It is a refusal: a denied tool call, with its reason on the span.
    let refused: Vec<_> = capture
        .spans()
        .into_iter()
        .filter(|s| {
            s.name == "tool.call"
                && attr(s, "convene.authz.reason")
                    == Some(OtelValue::from("EVIDENCE_KIND_NOT_ALLOWED"))
        })
        .collect();
    assert_eq!(refused.len(), 1);
    assert_eq!(
        attr(&refused[0], "convene.authz.decision"),
        Some(OtelValue::from("deny"))
    );
    assert_eq!(
        attr(&refused[0], "error.type"),
        Some(OtelValue::from("permission_denied"))
    );
    assert_eq!(status(&result), v1::TaskStatus::Completed, "{result:#?}");
}

/// The canonical JSON bytes of `values`, one after another.
fn json_bytes<'a>(values: impl IntoIterator<Item = &'a Value>) -> usize {
    values
        .into_iter()
        .map(|v| convene_worker::tools::canonical_json(v).len())
        .sum()
}

#[tokio::test]
async fn a_long_task_stores_each_turn_once_as_a_chain_that_rebuilds_the_conversation() {
    const TURNS: u32 = 200;
    // The turn is read from the conversation, so a request the client retries gets the
    // same answer.
    let turn_of = |r: &Recorded| {
        r.messages()
            .iter()
            .filter(|m| m["role"] == "assistant")
            .count()
    };
    let model = ScriptedModel::start(move |r: &Recorded| {
        let n = turn_of(r);
        if n + 1 < TURNS as usize {
            return Reply::tool_calls(vec![(format!("call_{n}"), "search_logs_v1", pool_search())])
                .with_usage(10, 10);
        }
        let first = outcome_of_first_search(r);
        report("call_report", &[&first]).with_usage(10, 10)
    })
    .unwrap();
    // The last answer, as the server sends it.
    let last_answer = |first: &str| {
        json!({"role": "assistant", "tool_calls": [{"id": "call_report", "type": "function",
            "function": {"name": "submit_report", "arguments": report_arguments(&[first])}}]})
    };
    // A window the whole conversation fits: nothing is compacted.
    let rig = rig(model, |p| {
        p.profile.max_iterations = TURNS;
        p.context_window = Some(1_000_000);
    })
    .await;
    // Enough tool calls for every turn: each turn's own bytes are a real tool result.
    let task = the_task("del-model-long");
    let token = rig.mesh.token_with_calls(&task, &[], TURNS).await;
    let result = rig.worker.execute(&task, &token, 1).await.unwrap();
    assert_eq!(status(&result), v1::TaskStatus::Completed, "{result:#?}");
    assert_eq!(result.usage.as_ref().unwrap().iterations, TURNS);

    // Each turn's own bytes: the messages its request added to the one before (and to
    // that one's answer), and its answer, as the server saw them.
    let mut requests = rig.model.requests();
    requests.dedup_by_key(|r| turn_of(r));
    assert_eq!(requests.len(), TURNS as usize);
    let mut own = 0;
    let mut seen = 1; // the system prompt, which the first turn stores besides
    for r in &requests {
        let messages = r.messages();
        own += json_bytes(&messages[seen..]);
        seen = messages.len() + 1;
    }
    // The answers: every call but the last comes back in the next request.
    own += json_bytes(requests[1..].iter().map(|r| {
        r.messages()
            .iter()
            .rfind(|m| m["role"] == "assistant")
            .unwrap()
    }));
    own += json_bytes([&last_answer(&outcome_of_first_search(
        requests.last().unwrap(),
    ))]);

    let ids: Vec<String> = (1..=TURNS)
        .map(|n| turn_evidence_id(RUN_ID, "del-model-long", 1, n))
        .collect();
    let mut stored_turns = rig.mesh.stored_turns(&token, &ids).await;
    assert_eq!(stored_turns.len(), TURNS as usize);
    let stored: usize = stored_turns.iter().map(|t| t.bytes.len()).sum();
    // Linear, not quadratic: the whole conversation stored again each turn would be
    // about TURNS / 2 times the sum of the turns' own bytes.
    assert!(
        stored as f64 <= 1.2 * own as f64,
        "{stored} bytes stored for {own} bytes of turns ({:.2}×)",
        stored as f64 / own as f64
    );

    // Walking the chain gives back the whole conversation the last request sent, and
    // the last answer.
    let conversation = walk(&stored_turns).expect("an intact chain");
    assert_eq!(conversation.turns, TURNS);
    let last = requests.last().unwrap().messages();
    assert_eq!(conversation.messages.len(), last.len() - 1 + 1);
    assert!(conversation.system.contains("submit_report"));
    assert_eq!(conversation.tools, ["search_logs@1", "submit_report"]);
    let first_user = conversation.messages[0]["content"].as_str().unwrap();
    assert!(first_user.contains(&task.goal), "{first_user}");
    let answer = conversation.messages.last().unwrap();
    assert_eq!(answer["tool_calls"][0]["name"], "submit_report");

    // A turn altered in the store breaks the chain there.
    stored_turns[99].bytes[10] ^= 1;
    assert_eq!(walk(&stored_turns).unwrap_err().turn, 100);
}

/// The evidence id the first `search_logs` call of the conversation returned.
fn outcome_of_first_search(r: &Recorded) -> String {
    let first = r
        .messages()
        .iter()
        .find(|m| m["role"] == "tool")
        .expect("a tool result");
    let outcome: Value = serde_json::from_str(first["content"].as_str().unwrap()).unwrap();
    outcome["evidence_id"].as_str().unwrap().to_owned()
}

/// The error an OpenAI server answers a request longer than the model's window with.
fn too_long(tokens: usize) -> Reply {
    Reply::error(
        400,
        json!({"error": {
            "message": format!("This model's maximum context length is 4096 tokens. However, \
                                your messages resulted in {tokens} tokens."),
            "type": "invalid_request_error",
            "param": "messages",
            "code": "context_length_exceeded",
        }}),
    )
}

/// Whether `r` is the loop's summarising call.
fn is_summary_call(r: &Recorded) -> bool {
    r.messages()
        .first()
        .and_then(|m| m["content"].as_str())
        .is_some_and(|s| s.contains("compress the history"))
}

#[tokio::test]
async fn a_sixty_turn_loop_in_a_4k_window_compacts_its_conversation_and_finishes() {
    const TURNS: usize = 60;
    const WINDOW: usize = 4096;
    // A model with a 4,096-token window (a token per four bytes of request): it refuses
    // longer requests as a real server does; it calls a tool each turn and reports on
    // the last, citing the first evidence it was given.
    let first_evidence: Arc<Mutex<Option<String>>> = Arc::default();
    let turns_seen = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let model = {
        let first_evidence = first_evidence.clone();
        let turns_seen = turns_seen.clone();
        ScriptedModel::start(move |r: &Recorded| {
            let tokens = r.body.to_string().len() / 4;
            if tokens > WINDOW {
                return too_long(tokens);
            }
            if is_summary_call(r) {
                return Reply::text(
                    "They searched the payment-api logs for POOL_EXHAUSTED \
                                    again and again; every search found the same errors.",
                )
                .with_usage(50, 30);
            }
            if let Some(result) = r.last_tool_results().first() {
                let outcome: Value = serde_json::from_str(&result.content).unwrap();
                let mut first = first_evidence.lock().unwrap();
                if first.is_none() {
                    *first = outcome["evidence_id"].as_str().map(str::to_owned);
                }
            }
            let n = turns_seen.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            if n + 1 < TURNS {
                return Reply::tool_calls(vec![(
                    format!("call_{n}"),
                    "search_logs_v1",
                    pool_search(),
                )])
                .with_usage(10, 10);
            }
            let first = first_evidence.lock().unwrap().clone().unwrap();
            report("call_report", &[&first]).with_usage(10, 10)
        })
        .unwrap()
    };
    let rig = rig(model, |p| {
        p.profile.max_iterations = TURNS as u32;
        p.profile.max_tokens = 512;
        p.context_window = Some(WINDOW as u32);
    })
    .await;
    let (result, token) = rig.run(&the_task("del-model-window")).await;
    assert_eq!(status(&result), v1::TaskStatus::Completed, "{result:#?}");
    assert_eq!(result.usage.as_ref().unwrap().iterations, TURNS as u32);

    // No request outgrew the window; older turns were summarised at least once.
    let requests = rig.model.requests();
    assert!(
        requests
            .iter()
            .all(|r| r.body.to_string().len() / 4 <= WINDOW),
        "a request outgrew the window"
    );
    let summaries = requests.iter().filter(|r| is_summary_call(r)).count();
    assert!(summaries >= 1, "no summary in {} requests", requests.len());
    assert_eq!(requests.len(), TURNS + summaries);

    // Each summary is recorded as a compaction, in the chain between the turns it came
    // between, and the chain still walks to the whole conversation as last sent.
    let mut ids = Vec::new();
    for n in 1..=TURNS as u32 {
        ids.push(compaction_evidence_id(RUN_ID, "del-model-window", 1, n));
        ids.push(turn_evidence_id(RUN_ID, "del-model-window", 1, n));
    }
    let records = rig.evidence(&token, ids.clone()).await;
    let compactions = records
        .iter()
        .filter(|r| r.evidence_id.ends_with("-compaction"))
        .count();
    assert_eq!(compactions, summaries);
    let stored_turns = rig.mesh.stored_turns(&token, &ids).await;
    let compaction: Value = serde_json::from_slice(
        &stored_turns
            .iter()
            .find(|t| t.evidence_id.ends_with("-compaction"))
            .unwrap()
            .bytes,
    )
    .unwrap();
    assert_eq!(compaction["kind"], "compaction");
    let conversation = walk(&stored_turns).expect("an intact chain");
    assert_eq!(conversation.turns, TURNS as u32);
    let last_sent = requests.last().unwrap().messages();
    // The last request's messages (less its system prompt), and its answer.
    assert_eq!(conversation.messages.len(), last_sent.len());
    assert!(
        conversation.messages.iter().any(|m| m["content"]
            .as_str()
            .is_some_and(|c| c.contains("Summary of the earlier turns"))),
        "the summary is part of the conversation"
    );
}

#[tokio::test]
async fn a_model_that_keeps_refusing_the_length_fails_the_task_with_context_exhausted() {
    // Four turns go through; from the fifth request on, everything is refused as too
    // long, the summarising call included.
    let model = ScriptedModel::start(|r: &Recorded| {
        if r.index >= 4 {
            return too_long(5000);
        }
        Reply::tool_calls(vec![(
            format!("call_{}", r.index),
            "search_logs_v1",
            pool_search(),
        )])
    })
    .unwrap();
    let rig = rig(model, |_| {}).await;
    let (result, _) = rig.run(&the_task("del-model-exhausted")).await;
    assert_eq!(status(&result), v1::TaskStatus::Failed, "{result:#?}");
    let error = result.error.as_ref().unwrap();
    assert_eq!(error.code, "CONTEXT_EXHAUSTED");
    assert!(!error.retryable);
    assert!(
        error.message.contains("context_window"),
        "{}",
        error.message
    );
    // Turn 5, once refused, then the summary, refused too: no retry loop.
    let requests = rig.model.requests();
    assert_eq!(requests.len(), 6);
    assert!(is_summary_call(&requests[5]));
    assert_eq!(result.evidence.len(), 4, "what it gathered is kept");

    // A first request refused twice: nothing to compact, and the task ends at once.
    let model = ScriptedModel::start(|_: &Recorded| too_long(9000)).unwrap();
    let refusing = self::rig(model, |_| {}).await;
    let (result, _) = refusing.run(&the_task("del-model-exhausted-2")).await;
    assert_eq!(result.error.as_ref().unwrap().code, "CONTEXT_EXHAUSTED");
    assert_eq!(refusing.model.request_count(), 2);
}
