//! PlanTurn over real gRPC: the example's playbook planner plays its rounds from the
//! conversation it is sent; a model-driven planner is asked through the `openai`
//! provider against the scripted server, with the agent loop's retries and spans; and
//! requests that cannot be answered are refused with the field or the reason named.

use std::time::Duration;

use convene_proto::v1;
use convene_telemetry::test_util::Capture;
use convene_worker::model_server::{PlaybookResponder, Reply, Script, ScriptedModel};
use convene_worker::models::{ModelSettings, Price};
use convene_worker::profiles;
use opentelemetry::Value as OtelValue;
use serde_json::{Value, json};

use crate::support::{Mesh, RUN_ID, TestWorker, profiles_with, task, unsigned_token, wait_until};

const PLANNER: &str = "incident-planner";
const MODEL_PLANNER: &str = "incident-planner-model";
/// A key that must never appear in an answer.
const KEY: &str = "sk-test-planner-4c1d9e0b7a2f-never-show";

/// The tools a planner is offered, as the supervisor describes them.
fn tools() -> Vec<v1::ToolDefinition> {
    vec![
        v1::ToolDefinition {
            name: "delegate".into(),
            description: "Delegate one task to a specialist profile.".into(),
            parameters: json!({
                "type": "object",
                "properties": {"profile_id": {"type": "string"}, "goal": {"type": "string"}},
                "required": ["profile_id", "goal"]
            })
            .to_string(),
        },
        v1::ToolDefinition {
            name: "finish".into(),
            description: "End the run with a summary citing accepted claims.".into(),
            parameters: json!({
                "type": "object",
                "properties": {"summary": {"type": "string"}, "cite": {"type": "array"}}
            })
            .to_string(),
        },
    ]
}

fn message(role: &str, content: &str) -> v1::ChatMessage {
    v1::ChatMessage {
        role: role.into(),
        content: content.into(),
        ..v1::ChatMessage::default()
    }
}

fn the_task() -> v1::ChatMessage {
    message(
        "user",
        "Initial assessment of the payment success-rate drop at 02:02 UTC.",
    )
}

/// A PlanTurn for `profile` with `messages` and `token`.
fn request(
    profile: &str,
    turn: u32,
    token: &str,
    messages: Vec<v1::ChatMessage>,
) -> v1::PlanTurnRequest {
    v1::PlanTurnRequest {
        lease_valid_until: None,
        run_id: RUN_ID.into(),
        profile_id: profile.into(),
        round: turn,
        turn,
        task_token: token.into(),
        instructions: "Delegate with `delegate`; end with `finish`.".into(),
        messages,
        tools: tools(),
        max_tokens: 0,
    }
}

/// A real planner token of the example run for `profile`, issued by the policy service
/// as the supervisor asks for it.
async fn planner_token(mesh: &Mesh, profile: &str) -> String {
    mesh.issue(v1::TokenGrantRequest {
        delegation_id: "planner-token".into(),
        profile_id: profile.into(),
        depth: 1,
        ..v1::TokenGrantRequest::default()
    })
    .await
    .token
}

/// The example planner's token.
async fn run_token(mesh: &Mesh) -> String {
    planner_token(mesh, PLANNER).await
}

/// The decision message after `round`, with the given decision.
fn decision(round: u32, decision: &Value) -> v1::ChatMessage {
    message(
        "user",
        &json!({"round": round, "decision": decision, "next": "Decide the next round."})
            .to_string(),
    )
}

/// The answer's calls as (id, tool, arguments).
fn calls(response: &v1::PlanTurnResponse) -> Vec<(String, String, Value)> {
    response
        .message
        .as_ref()
        .unwrap()
        .tool_calls
        .iter()
        .map(|c| {
            (
                c.id.clone(),
                c.name.clone(),
                serde_json::from_str(&c.arguments).unwrap(),
            )
        })
        .collect()
}

/// The conversation after round 1 of the playbook planner, decided as `decided`.
async fn after_round_one(
    worker: &TestWorker,
    token: &str,
    decided: &Value,
) -> Vec<v1::ChatMessage> {
    let first = worker
        .plan_turn(request(PLANNER, 1, token, vec![the_task()]))
        .await
        .unwrap();
    let answer = first.message.unwrap();
    let mut messages = vec![the_task()];
    let answers: Vec<v1::ChatMessage> = answer
        .tool_calls
        .iter()
        .enumerate()
        .map(|(i, c)| v1::ChatMessage {
            role: "tool".into(),
            content: json!({"delegation_id": format!("del-{i}")}).to_string(),
            tool_call_id: c.id.clone(),
            ..v1::ChatMessage::default()
        })
        .collect();
    messages.push(answer);
    messages.extend(answers);
    messages.push(decision(1, decided));
    messages
}

#[tokio::test]
async fn the_playbook_planner_delegates_follows_up_on_a_conflict_and_finishes() {
    let mesh = Mesh::start().await;
    let worker = mesh.worker(profiles::example().unwrap(), 2).await;
    let token = run_token(&mesh).await;

    // Round 1: the three specialists, in one turn, in order.
    let first = worker
        .plan_turn(request(PLANNER, 1, &token, vec![the_task()]))
        .await
        .unwrap();
    let round_one = calls(&first);
    let ids: Vec<(&str, &str, &str)> = round_one
        .iter()
        .map(|(id, tool, args)| {
            (
                id.as_str(),
                tool.as_str(),
                args["profile_id"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        ids,
        [
            ("r1-0", "delegate", "logs-investigator"),
            ("r1-1", "delegate", "metrics-investigator"),
            ("r1-2", "delegate", "change-auditor"),
        ]
    );
    assert_eq!(
        round_one[2].2["required_scopes"],
        json!([{"action": "changes:read", "resource": "change/*"},
               {"action": "metrics:read", "resource": "metric/risk.*"}])
    );
    assert_eq!(round_one[0].2["timeout_seconds"], 15);
    assert_eq!(first.finish_reason, "tool_calls");
    assert_eq!(first.worker_id, "worker-test-1");
    assert_eq!(first.message.as_ref().unwrap().role, "assistant");
    let usage = first.usage.unwrap();
    assert_eq!((usage.iterations, usage.tokens), (1, 0));

    // A conflict: one targeted question to the change auditor.
    let conflict = json!({
        "outcome": "JOIN_OUTCOME_CONFLICT_REQUIRES_HUMAN",
        "accepted": [
            {"delegation_id": "del-0", "profile_id": "logs-investigator",
             "claims": [{"claim_id": "claim-log-cause", "topic": "primary_cause",
                         "value": "connection_pool_exhaustion"}]},
            {"delegation_id": "del-2", "profile_id": "change-auditor",
             "claims": [{"claim_id": "claim-change-cause", "topic": "primary_cause",
                         "value": "risk_rule_change"}]}],
        "conflicts": [{"topic": "primary_cause", "next_query": "Which came first?",
                       "claims": [{"claim_id": "claim-log-cause"}, {"claim_id": "claim-change-cause"}]}]
    });
    let messages = after_round_one(&worker, &token, &conflict).await;
    let second = worker
        .plan_turn(request(PLANNER, 2, &token, messages.clone()))
        .await
        .unwrap();
    let [(id, tool, args)] = calls(&second).try_into().unwrap();
    assert_eq!((id.as_str(), tool.as_str()), ("r2-0", "delegate"));
    assert_eq!(args["profile_id"], "change-auditor");
    assert!(
        args["goal"]
            .as_str()
            .unwrap()
            .starts_with("Did risk rule RC-4711 reject the payments"),
        "{args}"
    );

    // No conflict: finish, citing every accepted claim.
    let settled = json!({
        "outcome": "JOIN_OUTCOME_RESOLVED",
        "accepted": [
            {"delegation_id": "del-0", "claims": [{"claim_id": "claim-log-cause"},
                                                  {"claim_id": "claim-log-impact"}]},
            {"delegation_id": "del-1", "claims": [{"claim_id": "claim-success-rate"}]}]
    });
    let messages = after_round_one(&worker, &token, &settled).await;
    let last = worker
        .plan_turn(request(PLANNER, 2, &token, messages))
        .await
        .unwrap();
    let [(id, tool, args)] = calls(&last).try_into().unwrap();
    assert_eq!((id.as_str(), tool.as_str()), ("finish", "finish"));
    assert_eq!(
        args["cite"],
        json!(["claim-log-cause", "claim-log-impact", "claim-success-rate"])
    );
    assert!(
        args["summary"]
            .as_str()
            .unwrap()
            .contains("JOIN_OUTCOME_RESOLVED"),
        "{args}"
    );
}

#[tokio::test]
async fn plan_turn_takes_no_execute_slot() {
    let mesh = Mesh::start().await;
    let profiles = profiles_with("logs-investigator", |p| p.faults.hang = true);
    let worker = mesh.worker(profiles, 1).await;
    let busy = task(
        "del-logs-busy",
        "logs-investigator",
        Duration::from_secs(60),
    );
    let busy_token = mesh.token_for(&busy, &[]).await;
    let running = worker.execute_in_background(&busy, &busy_token);
    let token = run_token(&mesh).await;
    wait_until(
        "the delegation in flight",
        || worker.service.in_flight(),
        |n| *n == 1,
    )
    .await;
    // The one slot is taken, and the planner is still answered.
    let answered = worker
        .plan_turn(request(PLANNER, 1, &token, vec![the_task()]))
        .await
        .unwrap();
    assert_eq!(calls(&answered).len(), 3);
    assert_eq!(worker.service.in_flight(), 1);

    let cancelled = worker
        .client
        .clone()
        .cancel(v1::WorkerCancelRequest {
            delegation_id: busy.delegation_id.clone(),
            reason: "test over".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(cancelled.cancelled);
    running.await.unwrap().unwrap();
}

/// A worker whose model planner talks to `model` with its key in a file, pricing the
/// scripted model's tokens.
struct Rig {
    _mesh: Mesh,
    worker: TestWorker,
    model: ScriptedModel,
    /// The model planner's token, from this rig's policy service.
    token: String,
    _key_dir: tempfile::TempDir,
}

async fn rig(model: ScriptedModel) -> Rig {
    let mesh = Mesh::start().await;
    let key_dir = tempfile::tempdir().unwrap();
    let key_file = key_dir.path().join("planner.key");
    std::fs::write(&key_file, format!("{KEY}\n")).unwrap();
    let profiles = profiles_with(MODEL_PLANNER, |p| {
        p.connection.base_url = Some(model.base_url());
        p.connection.api_key_file = Some(key_file);
        p.profile.model = "scripted-model".into();
    });
    let mut settings = ModelSettings {
        retries: 3,
        backoff: Duration::from_millis(10),
        ..ModelSettings::default()
    };
    settings.prices.insert(
        "scripted-model".into(),
        Price {
            input_per_1k: 1.0,
            output_per_1k: 2.0,
        },
    );
    let worker = mesh.worker_with_models(profiles, 2, settings).await;
    let token = planner_token(&mesh, MODEL_PLANNER).await;
    Rig {
        _mesh: mesh,
        worker,
        model,
        token,
        _key_dir: key_dir,
    }
}

fn attr(span: &opentelemetry_sdk::trace::SpanData, key: &str) -> Option<OtelValue> {
    span.attributes
        .iter()
        .find(|kv| kv.key.as_str() == key)
        .map(|kv| kv.value.clone())
}

#[tokio::test]
async fn a_model_planner_is_asked_with_the_conversation_and_the_planner_tools() {
    let capture = Capture::new();
    let _guard = capture.set_default();
    let delegate =
        json!({"profile_id": "change-auditor", "goal": "Compare RC-4711 with the pool window"});
    let model = ScriptedModel::start(Script::new(vec![
        Reply::tool_calls(vec![
            ("call_a", "delegate", delegate.to_string()),
            ("call_b", "delegate", "{\"profile_id\": ".to_owned()),
        ])
        .with_usage(1000, 500),
    ]))
    .unwrap();
    let rig = rig(model).await;
    let token = rig.token.clone();
    // A conversation after round 1: the earlier turn (one call's arguments as the model
    // wrote them, not JSON), the answers and the decision.
    let earlier = v1::ChatMessage {
        role: "assistant".into(),
        content: String::new(),
        tool_calls: vec![
            v1::ChatToolCall {
                id: "t1-0".into(),
                name: "delegate".into(),
                arguments: json!({"profile_id": "logs-investigator", "goal": "Find errors"})
                    .to_string(),
            },
            v1::ChatToolCall {
                id: "t1-1".into(),
                name: "delegate".into(),
                arguments: "{broken".into(),
            },
        ],
        tool_call_id: String::new(),
    };
    let answer = |id: &str, content: &str| v1::ChatMessage {
        role: "tool".into(),
        content: content.into(),
        tool_call_id: id.into(),
        ..v1::ChatMessage::default()
    };
    let mut turn = request(
        MODEL_PLANNER,
        2,
        &token,
        vec![
            the_task(),
            earlier,
            answer("t1-0", r#"{"delegation_id":"del-1"}"#),
            answer("t1-1", r#"{"error":"the arguments are not JSON"}"#),
            decision(
                1,
                &json!({"outcome": "JOIN_OUTCOME_CONFLICT_REQUIRES_HUMAN",
                          "conflicts": [{"topic": "primary_cause"}]}),
            ),
        ],
    );
    turn.max_tokens = 1000;
    let response = rig.worker.plan_turn(turn).await.unwrap();

    // The answer: the calls in order, the invalid arguments as the model wrote them.
    let message = response.message.as_ref().unwrap();
    assert_eq!(message.role, "assistant");
    let got: Vec<(&str, &str, &str)> = message
        .tool_calls
        .iter()
        .map(|c| (c.id.as_str(), c.name.as_str(), c.arguments.as_str()))
        .collect();
    assert_eq!(got[0].0, "call_a");
    assert_eq!(got[0].1, "delegate");
    assert_eq!(serde_json::from_str::<Value>(got[0].2).unwrap(), delegate);
    assert_eq!(got[1], ("call_b", "delegate", "{\"profile_id\": "));
    assert_eq!(response.finish_reason, "tool_calls");
    assert_eq!(response.model, "scripted-model");
    let usage = response.usage.unwrap();
    assert_eq!((usage.iterations, usage.tokens), (1, 1500));
    assert!((usage.cost - 2.0).abs() < 1e-9, "{}", usage.cost);

    // What the server was asked: the planner tools under their own names, the profile's
    // instructions then the run's, the conversation as sent, the smaller token limit.
    let requests = rig.model.requests();
    assert_eq!(requests.len(), 1);
    let asked = &requests[0];
    assert_eq!(asked.tools(), ["delegate", "finish"]);
    assert_eq!(asked.model(), Some("scripted-model"));
    assert_eq!(asked.body["max_completion_tokens"], 1000);
    let sent = asked.messages();
    let roles: Vec<&str> = sent.iter().map(|m| m["role"].as_str().unwrap()).collect();
    assert_eq!(
        roles,
        ["system", "user", "assistant", "tool", "tool", "user"]
    );
    let system = sent[0]["content"].as_str().unwrap();
    assert!(
        system.starts_with("You plan the investigation of an incident")
            && system.ends_with("\n\nDelegate with `delegate`; end with `finish`."),
        "{system}"
    );
    let earlier_calls = sent[2]["tool_calls"].as_array().unwrap();
    assert_eq!(earlier_calls[0]["function"]["name"], "delegate");
    assert_eq!(earlier_calls[1]["function"]["arguments"], "{broken");
    assert_eq!(sent[4]["tool_call_id"], "t1-1");
    assert!(
        sent[5]["content"]
            .as_str()
            .unwrap()
            .contains("JOIN_OUTCOME_CONFLICT_REQUIRES_HUMAN")
    );

    // One model.call span under the planner.turn span, which names the run and turn.
    let spans = capture.spans();
    let turn_span = spans
        .iter()
        .find(|s| s.name == "planner.turn")
        .expect("a planner.turn span");
    assert_eq!(
        attr(turn_span, "convene.run.id"),
        Some(OtelValue::from(RUN_ID))
    );
    assert_eq!(
        attr(turn_span, "convene.delegation.profile"),
        Some(OtelValue::from(MODEL_PLANNER))
    );
    assert_eq!(
        attr(turn_span, "convene.planner.turn").map(|v| v.as_str().into_owned()),
        Some("2".to_owned())
    );
    assert!(attr(turn_span, "convene.round").is_some());
    let calls: Vec<_> = spans.iter().filter(|s| s.name == "model.call").collect();
    assert_eq!(calls.len(), 1);
    assert_eq!(calls[0].parent_span_id, turn_span.span_context.span_id());
    assert_eq!(
        attr(calls[0], "gen_ai.provider.name"),
        Some(OtelValue::from("openai"))
    );
    assert_eq!(
        attr(calls[0], "gen_ai.usage.input_tokens").map(|v| v.as_str().into_owned()),
        Some("1000".to_owned())
    );
}

#[tokio::test]
async fn the_scripted_server_plays_the_example_planner_for_a_model_planner() {
    let model =
        ScriptedModel::start(PlaybookResponder::new(&profiles::example().unwrap()).unwrap())
            .unwrap();
    let rig = rig(model).await;
    let token = rig.token.clone();
    let first = rig
        .worker
        .plan_turn(request(MODEL_PLANNER, 1, &token, vec![the_task()]))
        .await
        .unwrap();
    let profiles: Vec<String> = calls(&first)
        .into_iter()
        .map(|(_, tool, args)| format!("{tool}:{}", args["profile_id"].as_str().unwrap()))
        .collect();
    assert_eq!(
        profiles,
        [
            "delegate:logs-investigator",
            "delegate:metrics-investigator",
            "delegate:change-auditor"
        ]
    );
    assert!(first.usage.unwrap().tokens > 0, "the server reports usage");

    // After a decision without conflict, the follow-up round is skipped: finish.
    let mut messages = vec![the_task(), first.message.clone().unwrap()];
    for call in &first.message.unwrap().tool_calls {
        messages.push(v1::ChatMessage {
            role: "tool".into(),
            content: r#"{"delegation_id":"d"}"#.into(),
            tool_call_id: call.id.clone(),
            ..v1::ChatMessage::default()
        });
    }
    messages.push(decision(
        1,
        &json!({"outcome": "JOIN_OUTCOME_RESOLVED",
                "accepted": [{"claims": [{"claim_id": "claim-a"}, {"claim_id": "claim-b"}]}]}),
    ));
    let last = rig
        .worker
        .plan_turn(request(MODEL_PLANNER, 2, &token, messages))
        .await
        .unwrap();
    let [(_, tool, args)] = calls(&last).try_into().unwrap();
    assert_eq!(tool, "finish");
    assert_eq!(args["cite"], json!(["claim-a", "claim-b"]));
}

#[tokio::test]
async fn a_rate_limited_planner_turn_is_retried_and_answered_once() {
    let model = ScriptedModel::start(Script::new(vec![
        Reply::error(
            429,
            json!({"error": {"message": "Rate limit reached", "type": "rate_limit_error"}}),
        ),
        Reply::tool_calls(vec![(
            "call_finish",
            "finish",
            json!({"summary": "done", "cite": []}).to_string(),
        )])
        .with_usage(200, 20),
    ]))
    .unwrap();
    let rig = rig(model).await;
    let token = rig.token.clone();
    let response = rig
        .worker
        .plan_turn(request(MODEL_PLANNER, 1, &token, vec![the_task()]))
        .await
        .unwrap();
    let [(id, tool, args)] = calls(&response).try_into().unwrap();
    assert_eq!((id.as_str(), tool.as_str()), ("call_finish", "finish"));
    assert_eq!(args["summary"], "done");
    assert_eq!(response.usage.unwrap().tokens, 220);
    let requests = rig.model.requests();
    assert_eq!(requests.len(), 2, "one retry");
    assert_eq!(requests[0].body, requests[1].body, "the same request again");
}

#[tokio::test]
async fn model_failures_say_what_went_wrong_and_never_show_the_key() {
    // A refused key is not retried and is no transient failure.
    let model = ScriptedModel::start(Script::new(vec![Reply::error(
        401,
        json!({"error": {"message": "Incorrect API key provided", "type": "invalid_request_error"}}),
    )]))
    .unwrap();
    let refusing = rig(model).await;
    let token = refusing.token.clone();
    let refused = refusing
        .worker
        .plan_turn(request(MODEL_PLANNER, 1, &token, vec![the_task()]))
        .await
        .unwrap_err();
    assert_eq!(refused.code(), tonic::Code::FailedPrecondition);
    let text = refused.message();
    assert!(
        text.contains("model provider openai") && text.contains("planner.key"),
        "names the provider and where the key comes from: {text}"
    );
    assert!(
        !text.contains(KEY) && !text.contains("4c1d9e0b7a2f"),
        "{text}"
    );
    assert_eq!(refusing.model.request_count(), 1, "a 401 is not retried");

    // An outage outlasting the retries is UNAVAILABLE: the supervisor may try later.
    let model = ScriptedModel::start(Script::new(
        (0..4)
            .map(|_| Reply::error(503, json!({"error": {"message": "overloaded"}})))
            .collect(),
    ))
    .unwrap();
    let failing = rig(model).await;
    let unavailable = failing
        .worker
        .plan_turn(request(MODEL_PLANNER, 1, &failing.token, vec![the_task()]))
        .await
        .unwrap_err();
    assert_eq!(unavailable.code(), tonic::Code::Unavailable);
    assert!(
        unavailable.message().contains("overloaded"),
        "{}",
        unavailable.message()
    );
    assert_eq!(
        failing.model.request_count(),
        4,
        "the first try and three retries"
    );
}

#[tokio::test]
async fn requests_that_cannot_be_answered_are_refused_by_field_or_reason() {
    let mesh = Mesh::start().await;
    let worker = mesh.worker(profiles::example().unwrap(), 1).await;
    let token = run_token(&mesh).await;
    let refused = async |edit: &dyn Fn(&mut v1::PlanTurnRequest)| {
        let mut r = request(PLANNER, 1, &token, vec![the_task()]);
        edit(&mut r);
        worker.plan_turn(r).await.unwrap_err()
    };

    let missing = refused(&|r| r.task_token.clear()).await;
    assert_eq!(missing.code(), tonic::Code::InvalidArgument);
    assert!(
        missing.message().contains("task_token"),
        "{}",
        missing.message()
    );

    let unreadable = refused(&|r| r.task_token = "not-a-token".into()).await;
    assert_eq!(unreadable.code(), tonic::Code::Unauthenticated);
    assert!(
        unreadable
            .message()
            .contains("task token refused (Malformed)"),
        "{}",
        unreadable.message()
    );

    // Claims nobody signed are never read as claims.
    let forged = unsigned_token(&json!({"run": RUN_ID}));
    let denied = refused(&|r| r.task_token.clone_from(&forged)).await;
    assert_eq!(denied.code(), tonic::Code::Unauthenticated);
    assert!(
        denied.message().contains("task token refused"),
        "{}",
        denied.message()
    );
    // The real token of this run is refused for another run, naming the claim.
    let denied = refused(&|r| r.run_id = "run-someone-else".into()).await;
    assert_eq!(denied.code(), tonic::Code::PermissionDenied);
    assert!(
        denied.message().contains("task token refused (run)"),
        "{}",
        denied.message()
    );

    let unknown = refused(&|r| r.profile_id = "traces-planner".into()).await;
    assert_eq!(unknown.code(), tonic::Code::FailedPrecondition);
    assert!(
        unknown
            .message()
            .contains("does not serve profile traces-planner")
            && unknown.message().contains(PLANNER),
        "{}",
        unknown.message()
    );

    let no_run = refused(&|r| r.run_id.clear()).await;
    assert_eq!(no_run.code(), tonic::Code::InvalidArgument);
    assert!(no_run.message().contains("run_id"), "{}", no_run.message());

    let bad_role = refused(&|r| r.messages.push(message("planner", "hello"))).await;
    assert_eq!(bad_role.code(), tonic::Code::InvalidArgument);
    assert!(
        bad_role.message().contains("messages[1].role"),
        "{}",
        bad_role.message()
    );

    let bad_tool = refused(&|r| r.tools[1].parameters = "[1, 2]".into()).await;
    assert_eq!(bad_tool.code(), tonic::Code::InvalidArgument);
    assert!(
        bad_tool.message().contains("tools[1].parameters"),
        "{}",
        bad_tool.message()
    );
}
