//! `Worker.PlanTurn`: one model turn of a run's planner.
//!
//! The supervisor keeps the planner's conversation and commits each turn; the worker
//! serving the planner profile only asks the profile's model for the next assistant
//! message. The conversation and the tools (`delegate`, `finish`) travel with the
//! request and nothing of them stays here. The call goes through the same retrying,
//! traced model call as the agent loop's ([`Agent::complete`]), under a `planner.turn`
//! span (a child of the gRPC server span, so of the supervisor's trace).
//!
//! Before a PlanTurn reaches this module the service has checked that the supervisor
//! sent it and that its task token is genuine, current, unrevoked and the run's planner
//! token ([`crate::guard`]); here the token is only read again for the run it is bound
//! to. A PlanTurn takes no Execute slot: it is one short call.

use std::sync::Arc;
use std::time::Instant;

use convene_proto::v1;
use convene_server::{ErrorCode, ServiceError, into_status, invalid_field};
use serde_json::Value;
use tonic::Status;
use tracing::Instrument as _;
use tracing::field::Empty;

use crate::agent::{Agent, token_view};
use crate::provider::{Message, ModelRequest, ProviderError, Role, ToolCall, ToolSpec};

/// Why a PlanTurn is refused or failed, after its fields are checked.
#[derive(Debug, thiserror::Error)]
enum PlanTurnError {
    #[error(
        "the task token is for another run ({token_run:?}, not {run_id}); present the \
         planner token the supervisor was issued for run {run_id}"
    )]
    OtherRun { token_run: String, run_id: String },
    #[error("the planner's model call failed after its retries, try again later: {0}")]
    Unavailable(ProviderError),
    #[error("the planner's model call failed: {0}")]
    Failed(ProviderError),
}

impl ServiceError for PlanTurnError {
    fn code(&self) -> ErrorCode {
        match self {
            Self::OtherRun { .. } => ErrorCode::PermissionDenied,
            Self::Unavailable(_) => ErrorCode::Unavailable,
            Self::Failed(_) => ErrorCode::FailedPrecondition,
        }
    }
}

impl From<ProviderError> for PlanTurnError {
    fn from(e: ProviderError) -> Self {
        if e.retryable {
            Self::Unavailable(e)
        } else {
            Self::Failed(e)
        }
    }
}

/// Checks the fields every PlanTurn needs before its profile is looked up.
///
/// # Errors
///
/// INVALID_ARGUMENT naming an empty `run_id` or `profile_id`.
pub(crate) fn check_ids(request: &v1::PlanTurnRequest) -> Result<(), Status> {
    if request.run_id.trim().is_empty() {
        return Err(invalid_field("run_id", "name the run the planner plans"));
    }
    if request.profile_id.trim().is_empty() {
        return Err(invalid_field(
            "profile_id",
            "name the planner profile, one this worker serves",
        ));
    }
    Ok(())
}

/// Answers one planner turn with `agent`'s model; `worker_id` names this worker in the
/// response.
///
/// # Errors
///
/// INVALID_ARGUMENT for a missing or unreadable token, a message with an unknown role
/// or a tool whose parameters are not a JSON object; PERMISSION_DENIED for a token of
/// another run; UNAVAILABLE when the model kept failing transiently; FAILED_PRECONDITION
/// for any other model failure.
pub(crate) async fn plan_turn(
    agent: &Agent,
    worker_id: &str,
    request: v1::PlanTurnRequest,
) -> Result<v1::PlanTurnResponse, Status> {
    check_token(&request)?;
    let model_request = model_request(agent, &request)?;
    let span = tracing::info_span!(
        "planner.turn",
        convene.service = "worker",
        convene.worker.id = %worker_id,
        convene.run.id = %request.run_id,
        convene.round = request.round,
        convene.planner.turn = request.turn,
        convene.delegation.profile = %request.profile_id,
        convene.model.tool_calls = Empty,
        error.type = Empty,
    );
    let started = Instant::now();
    let outcome = agent
        .complete(&model_request)
        .instrument(span.clone())
        .await;
    let response = match outcome {
        Ok(response) => response,
        Err(e) => {
            let error = PlanTurnError::from(e);
            span.record(
                "error.type",
                match error {
                    PlanTurnError::Unavailable(_) => "provider_unavailable",
                    _ => "provider_error",
                },
            );
            convene_telemetry::set_error(&span, error.to_string());
            span.in_scope(|| {
                tracing::warn!(run_id = %request.run_id, turn = request.turn, error = %error, "planner turn failed");
            });
            return Err(into_status(&error));
        }
    };
    span.record(
        "convene.model.tool_calls",
        response.message.tool_calls.len(),
    );
    let profile = &agent.profile.profile;
    let model = if response.model.is_empty() {
        profile.model.clone()
    } else {
        response.model.clone()
    };
    let usage = v1::Usage {
        iterations: 1,
        tool_calls: 0,
        tokens: response.usage.total(),
        cost: agent.models.cost(&model, response.usage),
        duration_ms: u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX),
    };
    span.in_scope(|| {
        tracing::info!(
            run_id = %request.run_id,
            round = request.round,
            turn = request.turn,
            calls = response.message.tool_calls.len(),
            finish_reason = response.finish.as_str(),
            "planner turn answered"
        );
    });
    Ok(v1::PlanTurnResponse {
        message: Some(to_chat_message(&response.message)),
        finish_reason: response.finish.as_str().to_owned(),
        model,
        usage: Some(usage),
        worker_id: worker_id.to_owned(),
    })
}

/// The token must be present, readable and bound to the request's run.
fn check_token(request: &v1::PlanTurnRequest) -> Result<(), Status> {
    if request.task_token.trim().is_empty() {
        return Err(invalid_field(
            "task_token",
            "give the task token the policy service issued for the run's planner",
        ));
    }
    let claims = token_view(&request.task_token).map_err(|e| invalid_field("task_token", e))?;
    if claims.run != request.run_id {
        return Err(into_status(&PlanTurnError::OtherRun {
            token_run: claims.run,
            run_id: request.run_id.clone(),
        }));
    }
    Ok(())
}

/// The model request for the turn: the profile's model, instructions and limits with
/// the request's instructions, conversation and tools.
fn model_request(agent: &Agent, request: &v1::PlanTurnRequest) -> Result<ModelRequest, Status> {
    let profile = &agent.profile.profile;
    let messages = request
        .messages
        .iter()
        .enumerate()
        .map(|(i, m)| to_message(m, i))
        .collect::<Result<Vec<_>, _>>()?;
    let tools = request
        .tools
        .iter()
        .enumerate()
        .map(|(i, t)| to_tool_spec(t, i).map(Arc::new))
        .collect::<Result<Vec<_>, _>>()?;
    let system = [profile.instructions.trim(), request.instructions.trim()]
        .into_iter()
        .filter(|s| !s.is_empty())
        .collect::<Vec<_>>()
        .join("\n\n");
    let max_tokens = if request.max_tokens > 0 && request.max_tokens < profile.max_tokens {
        request.max_tokens
    } else {
        profile.max_tokens
    };
    Ok(ModelRequest {
        model: profile.model.clone(),
        system,
        messages,
        tools,
        max_tokens,
        temperature: profile.temperature,
    })
}

fn to_message(m: &v1::ChatMessage, i: usize) -> Result<Message, Status> {
    let role = match m.role.as_str() {
        "system" => Role::System,
        "user" => Role::User,
        "assistant" => Role::Assistant,
        "tool" => Role::Tool,
        other => {
            return Err(invalid_field(
                &format!("messages[{i}].role"),
                format!("{other:?} is not a role; use system, user, assistant or tool"),
            ));
        }
    };
    Ok(Message {
        role,
        content: m.content.clone(),
        tool_calls: m
            .tool_calls
            .iter()
            .map(|c| ToolCall {
                id: c.id.clone(),
                name: c.name.clone(),
                arguments: parse_arguments(&c.arguments),
            })
            .collect(),
        tool_call_id: (!m.tool_call_id.is_empty()).then(|| m.tool_call_id.clone()),
    })
}

/// A call's arguments as JSON, or the text itself when it is not JSON (a model's
/// invalid output, which the planner is told about); no text is an empty object.
fn parse_arguments(text: &str) -> Value {
    if text.trim().is_empty() {
        return Value::Object(serde_json::Map::new());
    }
    serde_json::from_str(text).unwrap_or_else(|_| Value::String(text.to_owned()))
}

fn to_tool_spec(t: &v1::ToolDefinition, i: usize) -> Result<ToolSpec, Status> {
    if t.name.trim().is_empty() {
        return Err(invalid_field(
            &format!("tools[{i}].name"),
            "name the tool, e.g. delegate",
        ));
    }
    let parameters = match serde_json::from_str::<Value>(&t.parameters) {
        Ok(v @ Value::Object(_)) => v,
        _ => {
            return Err(invalid_field(
                &format!("tools[{i}].parameters"),
                format!(
                    "the parameters of tool {} must be a JSON schema object, e.g. \
                     {{\"type\":\"object\",\"properties\":{{}}}}",
                    t.name
                ),
            ));
        }
    };
    Ok(ToolSpec {
        name: t.name.clone(),
        description: t.description.clone(),
        parameters,
    })
}

fn to_chat_message(m: &Message) -> v1::ChatMessage {
    let role = match m.role {
        Role::System => "system",
        Role::User => "user",
        Role::Assistant => "assistant",
        Role::Tool => "tool",
    };
    v1::ChatMessage {
        role: role.to_owned(),
        content: m.content.clone(),
        tool_calls: m
            .tool_calls
            .iter()
            .map(|c| v1::ChatToolCall {
                id: c.id.clone(),
                name: c.name.clone(),
                arguments: match &c.arguments {
                    Value::String(raw) => raw.clone(),
                    other => other.to_string(),
                },
            })
            .collect(),
        tool_call_id: m.tool_call_id.clone().unwrap_or_default(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arguments_round_trip_and_invalid_json_is_kept_as_written() {
        assert_eq!(parse_arguments(r#"{"a":1}"#), serde_json::json!({"a": 1}));
        assert_eq!(parse_arguments("{oops"), Value::String("{oops".into()));
        assert_eq!(parse_arguments(" "), serde_json::json!({}));
        let message = Message::tool_calls(vec![
            ToolCall {
                id: "1".into(),
                name: "delegate".into(),
                arguments: Value::String("{oops".into()),
            },
            ToolCall {
                id: "2".into(),
                name: "finish".into(),
                arguments: serde_json::json!({"summary": "s"}),
            },
        ]);
        let chat = to_chat_message(&message);
        assert_eq!(chat.role, "assistant");
        assert_eq!(chat.tool_calls[0].arguments, "{oops");
        assert_eq!(chat.tool_calls[1].arguments, r#"{"summary":"s"}"#);
    }

    #[test]
    fn provider_errors_map_to_unavailable_only_when_retryable() {
        let busy = PlanTurnError::from(ProviderError::transient("openai", "HTTP 429"));
        assert_eq!(busy.code(), ErrorCode::Unavailable);
        let refused = PlanTurnError::from(ProviderError::permanent("openai", "HTTP 401"));
        assert_eq!(refused.code(), ErrorCode::FailedPrecondition);
        assert!(
            refused
                .to_string()
                .contains("model provider openai: HTTP 401"),
            "{refused}"
        );
    }
}
