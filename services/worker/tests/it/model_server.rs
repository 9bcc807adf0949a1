//! The scripted model server over real loopback HTTP: what async-openai's client and a
//! plain reqwest client see, and what the server records.

use std::time::Duration;

use async_openai::Client;
use async_openai::config::OpenAIConfig;
use async_openai::error::WrappedError;
use async_openai::types::chat::{
    ChatCompletionMessageToolCalls, CreateChatCompletionRequest, FinishReason,
};
use convene_worker::model_server::{
    DEFAULT_MODEL, Options, Recorded, Reply, Script, ScriptedModel, ToolResult,
};
use serde_json::{Value, json};

use crate::support::wait_until;

/// A reqwest client, with the process's TLS provider installed as the worker does.
fn http() -> reqwest::Client {
    // Another test may have installed it already.
    let _ = rustls::crypto::ring::default_provider().install_default();
    reqwest::Client::new()
}

fn openai(model: &ScriptedModel) -> Client<OpenAIConfig> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    Client::with_config(
        OpenAIConfig::new()
            .with_api_base(model.base_url())
            .with_api_key("test-key"),
    )
}

/// A first turn offering two tools.
fn first_turn() -> Value {
    json!({
        "model": "gpt-test",
        "messages": [
            {"role": "system", "content": "You investigate incidents."},
            {"role": "user", "content": "Why did payments fail?"}
        ],
        "tools": [
            {"type": "function", "function": {
                "name": "read_file",
                "description": "Reads a file.",
                "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}
            }},
            {"type": "function", "function": {
                "name": "search_logs",
                "parameters": {"type": "object", "properties": {}}
            }}
        ]
    })
}

async fn post(model: &ScriptedModel, body: &Value) -> reqwest::Response {
    http()
        .post(format!("{}/chat/completions", model.base_url()))
        .json(body)
        .send()
        .await
        .unwrap()
}

async fn content_of(response: reqwest::Response) -> String {
    assert_eq!(response.status(), 200);
    let body: Value = response.json().await.unwrap();
    body["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_owned()
}

async fn error_of(response: reqwest::Response) -> WrappedError {
    response.json().await.unwrap()
}

#[tokio::test]
async fn an_openai_client_gets_the_scripted_turns_and_every_request_is_recorded() {
    let model = ScriptedModel::start(Script::new(vec![
        Reply::tool_calls(vec![("call_1", "read_file", r#"{"path":"app.log"}"#)]),
        Reply::text("payments failed on a bad config push").with_usage(120, 9),
    ]))
    .unwrap();
    let client = openai(&model);

    let request: CreateChatCompletionRequest = serde_json::from_value(first_turn()).unwrap();
    let first = client.chat().create(request).await.unwrap();
    assert_eq!(first.model, "gpt-test");
    assert_eq!(first.id, "chatcmpl-0");
    let choice = &first.choices[0];
    assert_eq!(choice.finish_reason, Some(FinishReason::ToolCalls));
    let Some([ChatCompletionMessageToolCalls::Function(call)]) =
        choice.message.tool_calls.as_deref()
    else {
        panic!("one function call: {choice:?}")
    };
    assert_eq!(call.id, "call_1");
    assert_eq!(call.function.name, "read_file");
    assert_eq!(call.function.arguments, r#"{"path":"app.log"}"#);

    let mut second = first_turn();
    let messages = second["messages"].as_array_mut().unwrap();
    messages.push(json!({"role": "assistant", "content": null, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "read_file", "arguments": "{\"path\":\"app.log\"}"}}
    ]}));
    messages.push(json!({"role": "tool", "tool_call_id": "call_1", "content": "ERROR config"}));
    let request: CreateChatCompletionRequest = serde_json::from_value(second).unwrap();
    let answer = client.chat().create(request).await.unwrap();
    let choice = &answer.choices[0];
    assert_eq!(choice.finish_reason, Some(FinishReason::Stop));
    assert_eq!(
        choice.message.content.as_deref(),
        Some("payments failed on a bad config push")
    );
    let usage = answer.usage.unwrap();
    assert_eq!((usage.prompt_tokens, usage.completion_tokens), (120, 9));

    let requests = model.requests();
    assert_eq!(requests.len(), 2);
    assert_eq!(model.request_count(), 2);
    let [first, second] = requests.as_slice() else {
        unreachable!()
    };
    assert_eq!((first.index, second.index), (0, 1));
    assert!(first.received <= second.received);
    for request in &requests {
        assert_eq!(request.model(), Some("gpt-test"));
        assert_eq!(request.tools(), ["read_file", "search_logs"]);
        assert_eq!(request.authorization(), Some("Bearer test-key"));
        assert!(
            !format!("{request:?}").contains("test-key"),
            "the API key must not show in Debug output"
        );
    }
    assert_eq!(first.messages().len(), 2);
    assert_eq!(first.messages()[1]["content"], "Why did payments fail?");
    assert!(first.last_tool_results().is_empty());
    assert_eq!(second.messages().len(), 4);
    assert_eq!(
        second.last_tool_results(),
        [ToolResult {
            tool_call_id: "call_1".to_owned(),
            content: "ERROR config".to_owned()
        }]
    );
    model.shutdown().await;
}

#[tokio::test]
async fn a_script_answers_in_order_then_says_it_ran_out() {
    let model =
        ScriptedModel::start(Script::new(vec![Reply::text("one"), Reply::text("two")])).unwrap();
    assert_eq!(content_of(post(&model, &first_turn()).await).await, "one");
    assert_eq!(content_of(post(&model, &first_turn()).await).await, "two");

    let exhausted = post(&model, &first_turn()).await;
    assert_eq!(exhausted.status(), 500);
    let message = error_of(exhausted).await.error.message;
    assert!(message.contains("no more replies"), "{message}");
    assert!(message.contains("3 requests"), "{message}");
    assert_eq!(model.requests().len(), 3);
}

#[tokio::test]
async fn a_rate_limit_carries_its_retry_after_header() {
    let model = ScriptedModel::start(Script::new(vec![
        Reply::error(429, "Rate limit reached").with_header("Retry-After", "1"),
        Reply::text("after the wait"),
    ]))
    .unwrap();
    let limited = post(&model, &first_turn()).await;
    assert_eq!(limited.status(), 429);
    assert_eq!(limited.headers()["retry-after"], "1");
    let error = error_of(limited).await.error;
    assert_eq!(error.message, "Rate limit reached");
    assert_eq!(error.code.as_deref(), Some("rate_limit_exceeded"));
    assert_eq!(
        content_of(post(&model, &first_turn()).await).await,
        "after the wait"
    );
}

#[tokio::test]
async fn a_disconnect_is_a_transport_error_not_a_status() {
    let model = ScriptedModel::start(Script::new(vec![
        Reply::disconnect(),
        Reply::text("on a new connection"),
    ]))
    .unwrap();
    let client = http();
    let url = format!("{}/chat/completions", model.base_url());
    let error = client
        .post(&url)
        .json(&first_turn())
        .send()
        .await
        .expect_err("a dropped connection is no response");
    assert_eq!(error.status(), None, "no status: {error:?}");
    assert!(!error.is_timeout(), "{error:?}");

    let after = client.post(&url).json(&first_turn()).send().await.unwrap();
    assert_eq!(content_of(after).await, "on a new connection");
    assert_eq!(model.request_count(), 2);
}

#[tokio::test]
async fn a_disconnect_writes_not_a_byte() {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

    let model = ScriptedModel::start(Script::new(vec![Reply::disconnect()])).unwrap();
    let mut tcp = tokio::net::TcpStream::connect(model.addr()).await.unwrap();
    let body = first_turn().to_string();
    let request = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: {}\r\ncontent-type: application/json\r\n\
         content-length: {}\r\n\r\n{body}",
        model.addr(),
        body.len()
    );
    tcp.write_all(request.as_bytes()).await.unwrap();
    let mut received = Vec::new();
    // The connection ends (closed or reset) without a response.
    let _ = tcp.read_to_end(&mut received).await;
    assert_eq!(String::from_utf8_lossy(&received), "");
    assert_eq!(model.request_count(), 1);
}

#[tokio::test]
async fn a_delayed_reply_runs_into_the_client_deadline_or_arrives_late() {
    let model = ScriptedModel::start(Script::new(vec![
        Reply::delayed(Duration::from_secs(30), Reply::text("too late")),
        Reply::delayed(Duration::from_millis(20), Reply::text("late")),
    ]))
    .unwrap();
    let error = http()
        .post(format!("{}/chat/completions", model.base_url()))
        .timeout(Duration::from_millis(200))
        .json(&first_turn())
        .send()
        .await
        .expect_err("the client gives up first");
    assert!(error.is_timeout(), "{error:?}");
    assert_eq!(content_of(post(&model, &first_turn()).await).await, "late");
    // Shutdown ends the first reply's wait rather than waiting for it.
    model.shutdown().await;
}

#[tokio::test]
async fn a_hanging_reply_ends_at_shutdown_as_a_dropped_connection() {
    let model = ScriptedModel::start(Script::new(vec![Reply::hang()])).unwrap();
    let url = format!("{}/chat/completions", model.base_url());
    let waiting = tokio::spawn(async move { http().post(url).json(&first_turn()).send().await });
    wait_until(
        "the request to arrive",
        || model.request_count(),
        |n| *n == 1,
    )
    .await;
    assert!(!waiting.is_finished(), "a hanging reply never answers");
    model.shutdown().await;
    let error = waiting.await.unwrap().expect_err("no response");
    assert_eq!(error.status(), None, "{error:?}");
}

#[tokio::test]
async fn a_closure_decides_from_the_request() {
    let model =
        ScriptedModel::start(
            |request: &Recorded| match request.last_tool_results().first() {
                Some(result) => Reply::text(format!("read: {}", result.content)),
                None => {
                    Reply::tool_calls(vec![(format!("call_{}", request.index), "read_file", "{}")])
                }
            },
        )
        .unwrap();
    let first: Value = post(&model, &first_turn()).await.json().await.unwrap();
    assert_eq!(
        first["choices"][0]["message"]["tool_calls"][0]["id"],
        "call_0"
    );
    let mut second = first_turn();
    second["messages"].as_array_mut().unwrap().extend([
        json!({"role": "assistant", "content": null,
               "tool_calls": first["choices"][0]["message"]["tool_calls"]}),
        json!({"role": "tool", "tool_call_id": "call_0", "content": "42 lines"}),
    ]);
    assert_eq!(
        content_of(post(&model, &second).await).await,
        "read: 42 lines"
    );
}

#[tokio::test]
async fn a_named_model_is_listed_and_answers_whatever_was_asked() {
    let model = ScriptedModel::start_with(
        Options {
            model: Some("local-llama".to_owned()),
            keep_requests: false,
        },
        |_: &Recorded| Reply::text("hi"),
    )
    .unwrap();
    let list: Value = http()
        .get(format!("{}/models", model.base_url()))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(list["object"], "list");
    assert_eq!(list["data"][0]["id"], "local-llama");
    assert_eq!(list["data"].as_array().map(Vec::len), Some(1));

    let answer: Value = post(&model, &first_turn()).await.json().await.unwrap();
    assert_eq!(answer["model"], "local-llama");
    // Not kept, but counted.
    assert!(model.requests().is_empty());
    assert_eq!(model.request_count(), 1);

    let default = ScriptedModel::start(|_: &Recorded| Reply::text("hi")).unwrap();
    let list: Value = http()
        .get(format!("{}/models", default.base_url()))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(list["data"][0]["id"], DEFAULT_MODEL);
}

#[tokio::test]
async fn other_paths_and_methods_get_openai_shaped_errors() {
    let model = ScriptedModel::start(Script::new(vec![])).unwrap();
    let client = http();
    let missing = client
        .post(format!("{}/completions", model.base_url()))
        .send()
        .await
        .unwrap();
    assert_eq!(missing.status(), 404);
    let error = error_of(missing).await.error;
    assert!(
        error.message.contains("/v1/completions"),
        "{}",
        error.message
    );
    assert_eq!(error.r#type.as_deref(), Some("invalid_request_error"));

    let wrong_method = client
        .get(format!("{}/chat/completions", model.base_url()))
        .send()
        .await
        .unwrap();
    assert_eq!(wrong_method.status(), 405);
    let error = error_of(wrong_method).await.error;
    assert!(error.message.contains("GET"), "{}", error.message);
    assert_eq!(
        model.request_count(),
        0,
        "only chat completions are recorded"
    );
}

#[tokio::test]
async fn a_body_that_is_not_json_is_refused_and_recorded() {
    let model = ScriptedModel::start(Script::new(vec![Reply::text("first reply")])).unwrap();
    let client = http();
    let url = format!("{}/chat/completions", model.base_url());
    let refused = client.post(&url).body("not json").send().await.unwrap();
    assert_eq!(refused.status(), 400);
    let message = error_of(refused).await.error.message;
    assert!(message.contains("not JSON"), "{message}");

    // It used no scripted reply.
    assert_eq!(
        content_of(post(&model, &first_turn()).await).await,
        "first reply"
    );
    let requests = model.requests();
    assert_eq!(requests.len(), 2);
    assert_eq!(requests[0].raw_body.as_deref(), Some("not json"));
    assert_eq!(requests[0].body, Value::Null);
    assert_eq!(requests[1].raw_body, None);
}

#[tokio::test]
async fn a_streaming_request_gets_sse_chunks_that_add_up_to_the_scripted_reply() {
    use convene_worker::openai::{ClientSettings, Connection, OpenAiProvider};
    use convene_worker::provider::{FinishReason as Finish, Message, ModelProvider, ModelRequest};

    let long = "x".repeat(10_000);
    let model = ScriptedModel::start(Script::new(vec![
        Reply::tool_calls(vec![
            ("call_1", "read_file", r#"{"path":"a.log"}"#),
            ("call_2", "search_logs", r#"{"q":"é"}"#),
        ])
        .with_content("Reading.")
        .with_usage(120, 8),
        Reply::text(long.clone()),
        Reply::error(429, "slow down"),
    ]))
    .unwrap();

    // Raw: server-sent events, the content in pieces, the usage last, then [DONE].
    let mut body = first_turn();
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    let response = post(&model, &body).await;
    assert_eq!(response.status(), 200);
    assert_eq!(
        response.headers()["content-type"].to_str().unwrap(),
        "text/event-stream"
    );
    let text = response.text().await.unwrap();
    let events: Vec<&str> = text
        .split("\n\n")
        .filter(|e| !e.is_empty())
        .map(|e| e.strip_prefix("data: ").expect("a data line"))
        .collect();
    assert_eq!(events.last(), Some(&"[DONE]"));
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    assert!(
        chunks
            .iter()
            .all(|c| c["object"] == "chat.completion.chunk")
    );
    let usage = &chunks.last().unwrap()["usage"];
    assert_eq!(usage["total_tokens"], 128);
    assert!(
        chunks
            .iter()
            .filter(|c| c["choices"][0]["delta"]["tool_calls"].is_array())
            .count()
            >= 4
    );

    // Through the provider, streaming as a profile with `stream: true` asks: the same
    // answer a whole completion gives.
    let provider = OpenAiProvider::new(
        &Connection {
            base_url: Some(model.base_url()),
            stream: true,
            ..Connection::default()
        },
        &ClientSettings::default(),
    )
    .unwrap();
    let request = ModelRequest {
        model: "gpt-test".into(),
        system: "s".into(),
        messages: vec![Message::user("go")],
        tools: Vec::new(),
        max_tokens: 100,
        temperature: 0.0,
    };
    let answer = provider.complete(&request).await.unwrap();
    assert_eq!(answer.message.content, long);
    assert_eq!(answer.finish, Finish::Stop);
    let asked = &model.requests()[1];
    assert!(asked.streams());
    assert_eq!(asked.body["stream_options"]["include_usage"], true);
    // An error is still an HTTP error, read as one.
    let refused = provider.complete(&request).await.unwrap_err();
    assert!(refused.retryable, "{refused}");
    assert!(refused.message.contains("429"), "{}", refused.message);
}
