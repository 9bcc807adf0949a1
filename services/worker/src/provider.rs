//! The model-provider boundary: a chat conversation with tool calls, shaped like the
//! chat APIs of hosted language models, so a real model can replace the deterministic
//! playbook without the agent loop noticing.
//!
//! The agent loop only ever sees [`ModelProvider`]: it sends the conversation so far and
//! the tools it may call ([`ModelRequest`]), and gets back one assistant message that
//! asks for tool calls ([`FinishReason::ToolCalls`]) — the last one being
//! `submit_report` with the final report (see [`crate::report::FinalReport`]) — or
//! answers in text, which the loop answers with a reminder to call `submit_report`.
//!
//! A provider may instead serve whole delegations ([`RemoteAgent`], through
//! [`ModelProvider::remote`]): the loop then hands it the task and records what it
//! answers as evidence, with no turns of its own (see [`crate::a2a`]).
//!
//! This module depends on no other part of the worker: providers are built for a
//! profile by the registry where profiles are resolved
//! ([`crate::profiles::ProviderRegistry`]).

use std::fmt;
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// Who wrote a message of the conversation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// Standing instructions (usually carried in [`ModelRequest::system`] instead).
    System,
    /// The task, or the loop's corrections.
    User,
    /// The model.
    Assistant,
    /// The outcome of one tool call, answering the assistant's call of the same id.
    Tool,
}

/// A tool call the model asks for.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolCall {
    /// Id of the call, unique within the conversation; the tool's answer quotes it.
    pub id: String,
    /// Tool name, `name@version`.
    pub name: String,
    /// Arguments, a JSON object matching the tool's parameter schema. A model's
    /// arguments that are not valid JSON arrive as the string it wrote, which the loop
    /// answers with a correction.
    pub arguments: Value,
}

/// One message of the conversation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Message {
    /// Who wrote it.
    pub role: Role,
    /// Its text: the task, the model's answer, or a tool outcome as JSON.
    pub content: String,
    /// Tool calls an assistant message asks for (empty otherwise).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall>,
    /// For a tool message: the id of the call it answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
}

impl Message {
    /// A user message.
    pub fn user(content: impl Into<String>) -> Self {
        Self {
            role: Role::User,
            content: content.into(),
            tool_calls: Vec::new(),
            tool_call_id: None,
        }
    }

    /// An assistant message with text only.
    pub fn assistant(content: impl Into<String>) -> Self {
        Self {
            role: Role::Assistant,
            content: content.into(),
            tool_calls: Vec::new(),
            tool_call_id: None,
        }
    }

    /// An assistant message asking for tool calls.
    pub fn tool_calls(calls: Vec<ToolCall>) -> Self {
        Self {
            role: Role::Assistant,
            content: String::new(),
            tool_calls: calls,
            tool_call_id: None,
        }
    }

    /// The outcome of the tool call `call_id`.
    pub fn tool_result(call_id: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: Role::Tool,
            content: content.into(),
            tool_calls: Vec::new(),
            tool_call_id: Some(call_id.into()),
        }
    }
}

/// A tool the model may call.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolSpec {
    /// Tool name, `name@version`.
    pub name: String,
    /// What it does, for the model.
    pub description: String,
    /// JSON schema of its arguments.
    pub parameters: Value,
}

/// One completion request: the whole conversation so far.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelRequest {
    /// Model name for the provider (empty for providers without models).
    pub model: String,
    /// System prompt: the profile's instructions and the report format.
    pub system: String,
    /// The conversation, oldest first.
    pub messages: Vec<Message>,
    /// Tools the model may call in this task (shared: the same specs go out with every
    /// request).
    pub tools: Vec<Arc<ToolSpec>>,
    /// Tokens the answer may use at most.
    pub max_tokens: u32,
    /// Sampling temperature.
    pub temperature: f64,
}

/// Why the model stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// It asks for tool calls.
    ToolCalls,
    /// It gave its final answer.
    Stop,
    /// It hit the token limit mid-answer.
    Length,
}

impl FinishReason {
    /// The name the chat-completions API uses (`tool_calls`, `stop`, `length`).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::ToolCalls => "tool_calls",
            Self::Stop => "stop",
            Self::Length => "length",
        }
    }
}

/// Tokens a completion consumed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct TokenUsage {
    /// Prompt tokens.
    pub input: u64,
    /// Completion tokens.
    pub output: u64,
}

impl TokenUsage {
    /// Input and output together.
    pub fn total(self) -> u64 {
        self.input.saturating_add(self.output)
    }
}

/// A completion.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelResponse {
    /// The model that answered, as the server names it (empty when it does not say).
    #[serde(default)]
    pub model: String,
    /// The assistant's message.
    pub message: Message,
    /// Why it stopped.
    pub finish: FinishReason,
    /// What it consumed.
    pub usage: TokenUsage,
}

/// A provider could not complete a request.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("model provider {provider}: {message}")]
pub struct ProviderError {
    /// The provider's name.
    pub provider: String,
    /// What went wrong.
    pub message: String,
    /// Whether the same request may succeed later (rate limits, outages).
    pub retryable: bool,
    /// How long the server asked to wait before the next try (`Retry-After`).
    pub retry_after: Option<std::time::Duration>,
    /// The server refused the request as longer than the model's context window; the
    /// loop compacts the conversation and asks once more.
    pub context_exceeded: bool,
}

impl ProviderError {
    /// An error that retrying may cure (rate limit, outage).
    pub fn transient(provider: &str, message: impl Into<String>) -> Self {
        Self {
            provider: provider.to_owned(),
            message: message.into(),
            retryable: true,
            retry_after: None,
            context_exceeded: false,
        }
    }

    /// An error that retrying the same request does not cure.
    pub fn permanent(provider: &str, message: impl Into<String>) -> Self {
        Self {
            provider: provider.to_owned(),
            message: message.into(),
            retryable: false,
            retry_after: None,
            context_exceeded: false,
        }
    }
}

/// `text` trimmed and cut to at most `max` characters (an ellipsis marks a cut), for
/// what a model or a server wrote that goes into a message.
pub fn clip(text: &str, max: usize) -> String {
    let text = text.trim();
    match text.char_indices().nth(max) {
        Some((at, _)) => format!("{}…", &text[..at]),
        None => text.to_owned(),
    }
}

/// A model: turns a conversation into the next assistant message.
#[async_trait::async_trait]
pub trait ModelProvider: Send + Sync + fmt::Debug {
    /// The provider's name, as profiles write it (`playbook`, `openai`, `a2a`).
    fn name(&self) -> &str;

    /// Whether each turn's request and response is stored as `model_turn` evidence
    /// (true for real models; a deterministic script has nothing to audit).
    fn records_turns(&self) -> bool {
        true
    }

    /// Whether the model reads the conversation through a context window of limited
    /// size, which the loop must keep it within (true for real models; a deterministic
    /// script reads what it needs, whatever the length).
    fn has_context_window(&self) -> bool {
        true
    }

    /// Answers the conversation with one assistant message.
    async fn complete(&self, request: &ModelRequest) -> Result<ModelResponse, ProviderError>;

    /// A provider that serves whole delegations itself (a remote agent) instead of the
    /// turns of the agent loop; None (the default) for models.
    fn remote(&self) -> Option<&dyn RemoteAgent> {
        None
    }
}

// ---------------------------------------------------------------------------------------
// Remote agents: providers that take the whole delegation.

/// A delegation handed to a remote agent as it is.
#[derive(Debug, Clone, Copy)]
pub struct RemoteTask<'a> {
    /// The Delegation Contract.
    pub task: &'a convene_proto::v1::DelegationTask,
    /// The profile's instructions, sent along with the goal.
    pub instructions: &'a str,
}

/// One artifact a remote agent produced (or its direct answer), ready to be stored.
#[derive(Debug, Clone, PartialEq)]
pub struct RemoteArtifact {
    /// The remote's id of it.
    pub id: String,
    /// Its name (may be empty).
    pub name: String,
    /// The bytes to store as the artifact: the remote's artifact with where it came
    /// from, as canonical JSON.
    pub content: Vec<u8>,
    /// Its text parts.
    pub texts: Vec<String>,
    /// Its data parts.
    pub data: Vec<Value>,
}

/// What a remote agent answered: the finished remote task and its artifacts.
#[derive(Debug, Clone, PartialEq)]
pub struct RemoteAnswer {
    /// The agent, as the profile names it (never with credentials).
    pub agent: String,
    /// The evidence source of what it produced, e.g. `a2a:https://agents.example.com`.
    pub source: String,
    /// Where its evidence ids begin, `<scheme>://<host>`; the loop appends the run,
    /// the delegation, the remote task and the artifact.
    pub evidence_base: String,
    /// The evidence kind of its artifacts.
    pub kind: String,
    /// The remote task's id (empty for a direct answer without a task).
    pub task_id: String,
    /// The remote's final word on the task (its status message), if any.
    pub summary: String,
    /// The fingerprint of the request sent (`sha256:<hex>`).
    pub request_fingerprint: String,
    /// What it produced, in the remote's order.
    pub artifacts: Vec<RemoteArtifact>,
}

/// Why a remote agent did not serve the delegation.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct RemoteError {
    /// The result's error code, e.g. `remote_failed`.
    pub code: &'static str,
    /// Whether the same delegation may succeed later (the remote unreachable).
    pub retryable: bool,
    /// What went wrong and what to do, naming the agent (never a credential).
    pub message: String,
}

/// A remote agent: takes a whole delegation and answers with artifacts.
#[async_trait::async_trait]
pub trait RemoteAgent: Send + Sync + fmt::Debug {
    /// Hands `task` to the remote agent and waits for its answer.
    async fn delegate(&self, task: RemoteTask<'_>) -> Result<RemoteAnswer, RemoteError>;
}
