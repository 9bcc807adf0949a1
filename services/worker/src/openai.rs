//! The `openai` model provider: the chat-completions API with tool calling, spoken to
//! any compatible server (OpenAI, vLLM, Ollama, llama.cpp server, LM Studio) through
//! the `async-openai` client.
//!
//! A profile names the server and the key (see [`Connection`]):
//! - `base_url`: the API base including its version path, e.g.
//!   `http://localhost:11434/v1`; unset, the `OPENAI_BASE_URL` variable, else OpenAI's;
//! - `api_key_env` (default `OPENAI_API_KEY`) or `api_key_file`: where the key is. An
//!   unset or empty variable sends no key at all, which is what local servers expect.
//!
//! The key is read once, when the provider is built, and lives only in the client: it
//! is never part of a profile, a request the loop sees, a span, a log line or an error.
//!
//! A profile with `stream: true` asks for the answer as server-sent events
//! (`"stream": true`, with the usage in the last chunk) and assembles the chunks' text
//! and tool-call deltas into the same [`ModelResponse`] a whole answer gives
//! ([`Assembly`]); a stream that breaks or ends before its `finish_reason` is a
//! transient failure.
//!
//! The client makes one HTTP request per [`ModelProvider::complete`] and retries
//! nothing itself: every failure becomes a [`ProviderError`] that says whether trying
//! again may help (429, 5xx, a broken connection or a timeout) and, for a 429 or 503,
//! how long the server asked to wait (`Retry-After`); the agent loop owns the retries.
//!
//! Tool names such as `search_logs@1` or `mcp:runbooks/lookup@1` are not valid function
//! names for the API (`^[a-zA-Z0-9_-]{1,64}$`), so each request maps them to function
//! names (`search_logs_v1`) and the answer's calls back.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::time::Duration;

use async_openai::Client;
use async_openai::config::OpenAIConfig;
use async_openai::error::OpenAIError;
use async_openai::middleware::HttpRequestFactory;
use async_openai::types::chat::{
    ChatCompletionMessageToolCall, ChatCompletionMessageToolCalls,
    ChatCompletionRequestAssistantMessage, ChatCompletionRequestAssistantMessageContent,
    ChatCompletionRequestMessage, ChatCompletionRequestSystemMessage,
    ChatCompletionRequestSystemMessageContent, ChatCompletionRequestToolMessage,
    ChatCompletionRequestToolMessageContent, ChatCompletionRequestUserMessage,
    ChatCompletionRequestUserMessageContent, ChatCompletionStreamOptions, ChatCompletionTool,
    ChatCompletionTools, CompletionUsage, CreateChatCompletionRequest,
    CreateChatCompletionResponse, CreateChatCompletionStreamResponse,
    FinishReason as ApiFinishReason, FunctionCall, FunctionObject,
};
use futures::StreamExt as _;
use serde_json::Value;

use crate::provider::{
    FinishReason, Message, ModelProvider, ModelRequest, ModelResponse, ProviderError, Role,
    TokenUsage, ToolCall,
};

/// The provider's name, as profiles write it.
pub const PROVIDER_NAME: &str = "openai";
/// The variable naming the API base when a profile sets no `base_url`.
pub const BASE_URL_ENV: &str = "OPENAI_BASE_URL";
/// OpenAI's own API base.
pub const DEFAULT_BASE_URL: &str = "https://api.openai.com/v1";
/// The variable holding the key when a profile names none.
pub const DEFAULT_API_KEY_ENV: &str = "OPENAI_API_KEY";
/// Time one HTTP request may take by default (a long answer from a slow local model
/// takes minutes); the task's deadline bounds the whole loop in any case.
pub const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(10 * 60);
/// Characters of a server's error message kept in a [`ProviderError`].
const MAX_ERROR_CHARS: usize = 500;

/// Where a profile's model server is and where its key is kept.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Connection {
    /// API base with its version path; None: [`BASE_URL_ENV`], else
    /// [`DEFAULT_BASE_URL`].
    pub base_url: Option<String>,
    /// Variable holding the key; None: [`DEFAULT_API_KEY_ENV`] (unless `api_key_file`).
    pub api_key_env: Option<String>,
    /// File holding the key (its content, trimmed).
    pub api_key_file: Option<PathBuf>,
    /// Whether answers are asked for as a stream of server-sent events (default: one
    /// whole answer).
    pub stream: bool,
}

impl Connection {
    /// The API base this connection uses, read from the environment when unset.
    pub fn resolved_base_url(&self) -> String {
        self.base_url
            .clone()
            .filter(|u| !u.trim().is_empty())
            .or_else(|| std::env::var(BASE_URL_ENV).ok())
            .filter(|u| !u.trim().is_empty())
            .unwrap_or_else(|| DEFAULT_BASE_URL.to_owned())
            .trim()
            .trim_end_matches('/')
            .to_owned()
    }

    /// Where the key comes from, for messages (never the key itself).
    pub fn key_source(&self) -> String {
        match (&self.api_key_file, &self.api_key_env) {
            (Some(path), _) => format!("the file {}", path.display()),
            (None, Some(var)) => format!("the variable {var}"),
            (None, None) => format!("the variable {DEFAULT_API_KEY_ENV}"),
        }
    }

    /// The key, or None when there is none to send.
    ///
    /// # Errors
    ///
    /// The key file cannot be read (the message names the file, not its content).
    fn api_key(&self) -> Result<Option<String>, String> {
        let key = match &self.api_key_file {
            Some(path) => std::fs::read_to_string(path).map_err(|e| {
                format!(
                    "cannot read the API key file {}: {e}; point api_key_file at a readable \
                     file or remove it to use {DEFAULT_API_KEY_ENV}",
                    path.display()
                )
            })?,
            None => std::env::var(self.api_key_env.as_deref().unwrap_or(DEFAULT_API_KEY_ENV))
                .unwrap_or_default(),
        };
        let key = key.trim();
        Ok((!key.is_empty()).then(|| key.to_owned()))
    }
}

/// Settings of the HTTP client every `openai` profile of a worker shares.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientSettings {
    /// Time one request may take.
    pub request_timeout: Duration,
}

impl Default for ClientSettings {
    fn default() -> Self {
        Self {
            request_timeout: DEFAULT_REQUEST_TIMEOUT,
        }
    }
}

/// A model behind an OpenAI-compatible chat-completions API.
pub struct OpenAiProvider {
    client: Client<OpenAIConfig>,
    base_url: String,
    key_source: String,
    stream: bool,
}

impl std::fmt::Debug for OpenAiProvider {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The client holds the key: never printed.
        f.debug_struct("OpenAiProvider")
            .field("base_url", &self.base_url)
            .field("key_source", &self.key_source)
            .field("stream", &self.stream)
            .finish_non_exhaustive()
    }
}

impl OpenAiProvider {
    /// A provider for `connection`.
    ///
    /// # Errors
    ///
    /// The base URL is not an http(s) URL, the key file cannot be read, or the HTTP
    /// client cannot be built.
    pub fn new(connection: &Connection, settings: &ClientSettings) -> Result<Self, String> {
        install_crypto_provider();
        let base_url = connection.resolved_base_url();
        let parsed = reqwest::Url::parse(&base_url).map_err(|e| {
            format!(
                "base_url {base_url:?} is not a URL ({e}); give the API base with its version \
                 path, e.g. http://localhost:11434/v1"
            )
        })?;
        if !matches!(parsed.scheme(), "http" | "https") {
            return Err(format!(
                "base_url {base_url:?} must be an http:// or https:// URL, e.g. \
                 http://localhost:11434/v1"
            ));
        }
        let key = connection.api_key()?;
        let http = reqwest::Client::builder()
            .timeout(settings.request_timeout)
            .build()
            .map_err(|e| format!("cannot build the HTTP client: {e}"))?;
        let mut config = OpenAIConfig::new()
            .with_api_base(base_url.clone())
            .with_api_key(key.clone().unwrap_or_default());
        // The organization and project come from the profile's server alone.
        config = config.with_org_id("").with_project_id("");
        let client = Client::with_config(config).with_http_service(Transport {
            http,
            send_key: key.is_some(),
        });
        Ok(Self {
            client,
            base_url,
            key_source: connection.key_source(),
            stream: connection.stream,
        })
    }
}

/// rustls without a built-in crypto provider needs one installed for the process: ring,
/// the one every TLS client of the process uses. Installing twice is harmless.
pub fn install_crypto_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

#[async_trait::async_trait]
impl ModelProvider for OpenAiProvider {
    fn name(&self) -> &str {
        PROVIDER_NAME
    }

    async fn complete(&self, request: &ModelRequest) -> Result<ModelResponse, ProviderError> {
        let names = FunctionNames::new(request);
        let mut body = to_api(request, &names);
        let answer = if self.stream {
            body.stream_options = Some(ChatCompletionStreamOptions {
                include_usage: Some(true),
                include_obfuscation: None,
            });
            self.streamed(body).await?
        } else {
            let response = self
                .client
                .chat()
                .create(body)
                .await
                .map_err(|e| self.error(e))?;
            Answer::whole(response).ok_or_else(no_choices)?
        };
        Ok(answer.into_response(&names))
    }
}

impl OpenAiProvider {
    /// Asks for `body` as a stream and assembles its chunks.
    async fn streamed(&self, body: CreateChatCompletionRequest) -> Result<Answer, ProviderError> {
        let mut stream = self
            .client
            .chat()
            .create_stream(body)
            .await
            .map_err(|e| self.error(e))?;
        let mut assembly = Assembly::default();
        while let Some(chunk) = stream.next().await {
            assembly.add(chunk.map_err(|e| self.error(e))?);
        }
        assembly.finish(&self.base_url)
    }
}

/// The error of an answer without choices.
fn no_choices() -> ProviderError {
    ProviderError::permanent(
        PROVIDER_NAME,
        "the model server answered with no choices; check that the model supports \
         chat completions",
    )
}

/// One tool call of an answer, as the server wrote it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct RawCall {
    id: String,
    function: String,
    /// The arguments' JSON text, or a custom tool's free-form input.
    arguments: String,
    custom: bool,
}

/// The first choice of an answer, whole or assembled from a stream.
#[derive(Debug, Clone, PartialEq)]
struct Answer {
    model: String,
    content: Option<String>,
    refusal: Option<String>,
    calls: Vec<RawCall>,
    finish_reason: Option<ApiFinishReason>,
    usage: Option<CompletionUsage>,
}

impl Answer {
    /// The first choice of a whole answer; None when it has none.
    fn whole(response: CreateChatCompletionResponse) -> Option<Self> {
        let choice = response.choices.into_iter().next()?;
        let calls = choice
            .message
            .tool_calls
            .unwrap_or_default()
            .into_iter()
            .map(|c| match c {
                ChatCompletionMessageToolCalls::Function(f) => RawCall {
                    id: f.id,
                    function: f.function.name,
                    arguments: f.function.arguments,
                    custom: false,
                },
                ChatCompletionMessageToolCalls::Custom(c) => RawCall {
                    id: c.id,
                    function: c.custom_tool.name,
                    arguments: c.custom_tool.input,
                    custom: true,
                },
            })
            .collect();
        Some(Self {
            model: response.model,
            content: choice.message.content,
            refusal: choice.message.refusal,
            calls,
            finish_reason: choice.finish_reason,
            usage: response.usage,
        })
    }

    /// The answer as the loop reads it, its function names mapped back to tools.
    fn into_response(self, names: &FunctionNames) -> ModelResponse {
        let calls: Vec<ToolCall> = self
            .calls
            .into_iter()
            .map(|c| ToolCall {
                id: c.id,
                name: names.tool(&c.function),
                arguments: if c.custom {
                    Value::String(c.arguments)
                } else {
                    parse_arguments(&c.arguments)
                },
            })
            .collect();
        let finish = match self.finish_reason {
            Some(ApiFinishReason::Length) => FinishReason::Length,
            _ if !calls.is_empty() => FinishReason::ToolCalls,
            Some(ApiFinishReason::ToolCalls | ApiFinishReason::FunctionCall) => {
                FinishReason::ToolCalls
            }
            _ => FinishReason::Stop,
        };
        let content = self.content.or(self.refusal).unwrap_or_default();
        let usage = self.usage.map_or_else(TokenUsage::default, |u| TokenUsage {
            input: u64::from(u.prompt_tokens),
            output: u64::from(u.completion_tokens),
        });
        ModelResponse {
            model: self.model,
            message: Message {
                role: Role::Assistant,
                content,
                tool_calls: calls,
                tool_call_id: None,
            },
            finish,
            usage,
        }
    }
}

/// A streamed answer being put together, chunk by chunk: the first choice's text and
/// refusal deltas joined, its tool calls gathered by their index (the id and the name
/// from the first chunk that has them, the argument fragments joined), the finish
/// reason, and the usage of the last chunk.
#[derive(Debug, Default)]
struct Assembly {
    model: String,
    content: Option<String>,
    refusal: Option<String>,
    calls: BTreeMap<u32, RawCall>,
    finish_reason: Option<ApiFinishReason>,
    usage: Option<CompletionUsage>,
    choices: bool,
}

impl Assembly {
    fn add(&mut self, chunk: CreateChatCompletionStreamResponse) {
        if self.model.is_empty() {
            self.model = chunk.model;
        }
        if chunk.usage.is_some() {
            self.usage = chunk.usage;
        }
        for choice in chunk.choices.into_iter().filter(|c| c.index == 0) {
            self.choices = true;
            let delta = choice.delta;
            if let Some(text) = delta.content {
                self.content.get_or_insert_default().push_str(&text);
            }
            if let Some(text) = delta.refusal {
                self.refusal.get_or_insert_default().push_str(&text);
            }
            for part in delta.tool_calls.unwrap_or_default() {
                let call = self.calls.entry(part.index).or_insert_with(|| RawCall {
                    id: String::new(),
                    function: String::new(),
                    arguments: String::new(),
                    custom: false,
                });
                if let Some(id) = part.id
                    && call.id.is_empty()
                {
                    call.id = id;
                }
                if let Some(function) = part.function {
                    if let Some(name) = function.name
                        && call.function.is_empty()
                    {
                        call.function = name;
                    }
                    if let Some(fragment) = function.arguments {
                        call.arguments.push_str(&fragment);
                    }
                }
            }
            if choice.finish_reason.is_some() {
                self.finish_reason = choice.finish_reason;
            }
        }
    }

    /// The assembled answer of the stream from `base_url`.
    ///
    /// # Errors
    ///
    /// The stream had no choice (permanent, as a whole answer without one), or ended
    /// before its finish reason (transient: the connection ended early).
    fn finish(self, base_url: &str) -> Result<Answer, ProviderError> {
        if !self.choices {
            return Err(no_choices());
        }
        if self.finish_reason.is_none() {
            return Err(ProviderError::transient(
                PROVIDER_NAME,
                format!(
                    "the answer stream of {base_url} ended before its finish_reason: the \
                     answer is incomplete"
                ),
            ));
        }
        let calls = self
            .calls
            .into_iter()
            .map(|(index, mut call)| {
                if call.id.is_empty() {
                    call.id = format!("call_{index}");
                }
                call
            })
            .collect();
        Ok(Answer {
            model: self.model,
            content: self.content,
            refusal: self.refusal,
            calls,
            finish_reason: self.finish_reason,
            usage: self.usage,
        })
    }
}

impl OpenAiProvider {
    /// A client error as the loop sees it: retryable or not, with the server's words.
    fn error(&self, e: OpenAIError) -> ProviderError {
        match e {
            OpenAIError::Boxed(boxed) => match boxed.downcast::<HttpFailure>() {
                Ok(failure) => failure.into_provider_error(&self.base_url, &self.key_source),
                Err(other) => ProviderError::transient(
                    PROVIDER_NAME,
                    format!("the request to {} failed: {other}", self.base_url),
                ),
            },
            OpenAIError::Reqwest(e) => transport_error(&self.base_url, &e),
            OpenAIError::StreamError(e) => ProviderError::transient(
                PROVIDER_NAME,
                format!(
                    "the answer stream of {} broke: {}",
                    self.base_url,
                    clip(&e.to_string())
                ),
            ),
            OpenAIError::JSONDeserialize(e, content) => ProviderError::permanent(
                PROVIDER_NAME,
                format!(
                    "the answer of {} is not a chat completion ({e}): {}",
                    self.base_url,
                    clip(&content)
                ),
            ),
            OpenAIError::ApiError(api) => ProviderError {
                provider: PROVIDER_NAME.to_owned(),
                message: format!("{} answered: {}", self.base_url, clip(&api.to_string())),
                retryable: false,
                retry_after: None,
                context_exceeded: api.api_error.code.as_deref() == Some("context_length_exceeded"),
            },
            other => ProviderError::permanent(PROVIDER_NAME, clip(&other.to_string())),
        }
    }
}

fn transport_error(base_url: &str, e: &reqwest::Error) -> ProviderError {
    let what = if e.is_timeout() {
        "timed out"
    } else if e.is_connect() {
        "could not connect"
    } else {
        "failed"
    };
    // reqwest's message names the URL, never the headers.
    ProviderError::transient(
        PROVIDER_NAME,
        format!("the request to {base_url} {what}: {}", error_chain(e)),
    )
}

/// An error and its sources, e.g. "error sending request: connection refused".
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let more = s.to_string();
        if !text.contains(&more) {
            text.push_str(": ");
            text.push_str(&more);
        }
        source = s.source();
    }
    text
}

/// A model's arguments: the JSON it wrote, or the text itself when it is not JSON (the
/// loop then asks for a JSON object).
fn parse_arguments(text: &str) -> Value {
    if text.trim().is_empty() {
        return Value::Object(serde_json::Map::new());
    }
    serde_json::from_str(text).unwrap_or_else(|_| Value::String(text.to_owned()))
}

/// A server's or a model's text, cut for an error message.
fn clip(text: &str) -> String {
    crate::provider::clip(text, MAX_ERROR_CHARS)
}

// ---------------------------------------------------------------------------------------
// The request.

/// Tool names ↔ function names for one request.
struct FunctionNames {
    to_function: HashMap<String, String>,
    to_tool: HashMap<String, String>,
}

impl FunctionNames {
    fn new(request: &ModelRequest) -> Self {
        let mut names = Self {
            to_function: HashMap::new(),
            to_tool: HashMap::new(),
        };
        let called = request
            .messages
            .iter()
            .flat_map(|m| &m.tool_calls)
            .map(|c| c.name.as_str());
        for tool in request.tools.iter().map(|t| t.name.as_str()).chain(called) {
            names.add(tool);
        }
        names
    }

    fn add(&mut self, tool: &str) {
        if self.to_function.contains_key(tool) {
            return;
        }
        let base = function_name(tool);
        let mut name = base.clone();
        let mut n = 2;
        while self.to_tool.contains_key(&name) {
            let suffix = format!("_{n}");
            let keep = 64 - suffix.len();
            name = format!("{}{suffix}", &base[..base.len().min(keep)]);
            n += 1;
        }
        self.to_function.insert(tool.to_owned(), name.clone());
        self.to_tool.insert(name, tool.to_owned());
    }

    fn function(&self, tool: &str) -> String {
        self.to_function
            .get(tool)
            .cloned()
            .unwrap_or_else(|| function_name(tool))
    }

    /// The tool a function name stands for. A name the request did not offer is read
    /// back by the naming rule (`list_changes_v1` → `list_changes@1`), so a call of a
    /// tool the task was not given reaches the loop under its real name and is denied;
    /// anything else is kept as the model wrote it (an unknown tool).
    fn tool(&self, function: &str) -> String {
        if let Some(tool) = self.to_tool.get(function) {
            return tool.clone();
        }
        tool_name(function)
    }
}

/// The tool a function name stands for by the naming rule of [`function_name`]
/// (`list_changes_v1` → `list_changes@1`); a name without a version suffix is kept.
pub fn tool_name(function: &str) -> String {
    match function.rsplit_once("_v") {
        Some((name, version))
            if !name.is_empty()
                && !version.is_empty()
                && version.chars().all(|c| c.is_ascii_digit()) =>
        {
            format!("{name}@{version}")
        }
        _ => function.to_owned(),
    }
}

/// `search_logs@1` → `search_logs_v1`, `mcp:runbooks/lookup@1` → `mcp_runbooks_lookup_v1`:
/// letters, digits, `_` and `-` only, at most 64 characters.
pub fn function_name(tool: &str) -> String {
    let (name, version) = match tool.rsplit_once('@') {
        Some((n, v)) => (n, Some(v)),
        None => (tool, None),
    };
    let mut out: String = name
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '_' || c == '-' {
                c
            } else {
                '_'
            }
        })
        .collect();
    if let Some(v) = version {
        out.push_str("_v");
        out.extend(v.chars().filter(char::is_ascii_alphanumeric));
    }
    if out.is_empty() {
        out.push_str("tool");
    }
    out.truncate(64);
    out
}

fn to_api(request: &ModelRequest, names: &FunctionNames) -> CreateChatCompletionRequest {
    let mut messages = Vec::with_capacity(request.messages.len() + 1);
    if !request.system.is_empty() {
        messages.push(ChatCompletionRequestMessage::System(
            ChatCompletionRequestSystemMessage {
                content: ChatCompletionRequestSystemMessageContent::Text(request.system.clone()),
                name: None,
            },
        ));
    }
    for m in &request.messages {
        messages.push(match m.role {
            Role::System => {
                ChatCompletionRequestMessage::System(ChatCompletionRequestSystemMessage {
                    content: ChatCompletionRequestSystemMessageContent::Text(m.content.clone()),
                    name: None,
                })
            }
            Role::User => ChatCompletionRequestMessage::User(ChatCompletionRequestUserMessage {
                content: ChatCompletionRequestUserMessageContent::Text(m.content.clone()),
                name: None,
            }),
            Role::Assistant => {
                ChatCompletionRequestMessage::Assistant(ChatCompletionRequestAssistantMessage {
                    content: (!m.content.is_empty()).then(|| {
                        ChatCompletionRequestAssistantMessageContent::Text(m.content.clone())
                    }),
                    tool_calls: (!m.tool_calls.is_empty()).then(|| {
                        m.tool_calls
                            .iter()
                            .map(|c| {
                                ChatCompletionMessageToolCalls::Function(
                                    ChatCompletionMessageToolCall {
                                        id: c.id.clone(),
                                        function: FunctionCall {
                                            name: names.function(&c.name),
                                            arguments: match &c.arguments {
                                                Value::String(raw) => raw.clone(),
                                                other => other.to_string(),
                                            },
                                        },
                                    },
                                )
                            })
                            .collect()
                    }),
                    ..Default::default()
                })
            }
            Role::Tool => ChatCompletionRequestMessage::Tool(ChatCompletionRequestToolMessage {
                content: ChatCompletionRequestToolMessageContent::Text(m.content.clone()),
                tool_call_id: m.tool_call_id.clone().unwrap_or_default(),
            }),
        });
    }
    let tools: Vec<ChatCompletionTools> = request
        .tools
        .iter()
        .map(|t| {
            ChatCompletionTools::Function(ChatCompletionTool {
                function: FunctionObject {
                    name: names.function(&t.name),
                    description: Some(t.description.clone()),
                    parameters: Some(t.parameters.clone()),
                    strict: None,
                },
            })
        })
        .collect();
    CreateChatCompletionRequest {
        messages,
        model: request.model.clone(),
        // The current name of the answer's limit; servers that only know `max_tokens`
        // ignore it.
        max_completion_tokens: Some(request.max_tokens),
        #[allow(clippy::cast_possible_truncation)]
        temperature: Some(request.temperature as f32),
        parallel_tool_calls: (!tools.is_empty()).then_some(true),
        tools: (!tools.is_empty()).then_some(tools),
        ..Default::default()
    }
}

// ---------------------------------------------------------------------------------------
// The HTTP transport.

/// Sends the client's requests with no retries of its own and turns every answer that
/// is not a success into an [`HttpFailure`] carrying the status, the server's message
/// and `Retry-After`.
#[derive(Clone)]
struct Transport {
    http: reqwest::Client,
    /// Whether there is a key: without one, no `Authorization` header is sent.
    send_key: bool,
}

impl tower::Service<HttpRequestFactory> for Transport {
    type Response = reqwest::Response;
    type Error = OpenAIError;
    type Future = std::pin::Pin<
        Box<dyn std::future::Future<Output = Result<reqwest::Response, OpenAIError>> + Send>,
    >;

    fn poll_ready(
        &mut self,
        _cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, factory: HttpRequestFactory) -> Self::Future {
        let http = self.http.clone();
        let send_key = self.send_key;
        Box::pin(async move {
            let mut request = factory.build().await?;
            if !send_key {
                request.headers_mut().remove(reqwest::header::AUTHORIZATION);
            }
            let response = http.execute(request).await?;
            let status = response.status();
            if status.is_success() {
                return Ok(response);
            }
            let retry_after = response
                .headers()
                .get(reqwest::header::RETRY_AFTER)
                .and_then(|v| v.to_str().ok())
                .and_then(parse_retry_after);
            let body = response.text().await.unwrap_or_default();
            Err(OpenAIError::Boxed(Box::new(HttpFailure {
                status: status.as_u16(),
                retry_after,
                message: server_message(&body),
                context_exceeded: context_exceeded(status.as_u16(), &body),
            })))
        })
    }
}

/// `Retry-After` as seconds (the HTTP-date form is rare for APIs and is ignored: the
/// loop's own backoff applies).
fn parse_retry_after(value: &str) -> Option<Duration> {
    let value = value.trim();
    value
        .parse::<u64>()
        .map(Duration::from_secs)
        .or_else(|_| value.parse::<f64>().map(Duration::from_secs_f64))
        .ok()
        .filter(|d| *d <= Duration::from_secs(3600))
}

/// The message of an OpenAI-shaped error body, or the body itself.
fn server_message(body: &str) -> String {
    let parsed: Option<Value> = serde_json::from_str(body).ok();
    let message = parsed.as_ref().and_then(|v| {
        v.pointer("/error/message")
            .or_else(|| v.get("error").filter(|e| e.is_string()))
            .or_else(|| v.get("message"))
            .or_else(|| v.get("detail"))
            .and_then(Value::as_str)
    });
    match message {
        Some(m) => clip(m),
        None if body.trim().is_empty() => "no message".to_owned(),
        None => clip(body),
    }
}

/// Whether a refusal says the request does not fit the model's context window: the
/// OpenAI error code `context_length_exceeded`, or (servers that give no code) a 400 or
/// 413 whose message speaks of the context length or window.
fn context_exceeded(status: u16, body: &str) -> bool {
    if !matches!(status, 400 | 413) {
        return false;
    }
    let parsed: Option<Value> = serde_json::from_str(body).ok();
    let code = parsed
        .as_ref()
        .and_then(|v| v.pointer("/error/code").and_then(Value::as_str));
    if code == Some("context_length_exceeded") {
        return true;
    }
    let text = body.to_ascii_lowercase();
    [
        "context_length_exceeded",
        "context length",
        "context window",
    ]
    .iter()
    .any(|needle| text.contains(needle))
}

/// A non-success HTTP answer.
#[derive(Debug)]
struct HttpFailure {
    status: u16,
    retry_after: Option<Duration>,
    message: String,
    /// The server refused the request as longer than the model's context window.
    context_exceeded: bool,
}

impl std::fmt::Display for HttpFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "HTTP {}: {}", self.status, self.message)
    }
}

impl std::error::Error for HttpFailure {}

impl HttpFailure {
    fn into_provider_error(self, base_url: &str, key_source: &str) -> ProviderError {
        let Self {
            status,
            retry_after,
            message,
            context_exceeded,
        } = self;
        let (retryable, message) = match status {
            401 => (
                false,
                format!(
                    "{base_url} refused the API key (HTTP 401: {message}); put a valid key in \
                     {key_source}, or leave it unset for a server that needs none"
                ),
            ),
            403 => (
                false,
                format!(
                    "{base_url} refused access (HTTP 403: {message}); check that the key in \
                     {key_source} may use this model"
                ),
            ),
            404 => (
                false,
                format!(
                    "{base_url} answered HTTP 404 ({message}); check the model name and that \
                     base_url ends with the API's version path, e.g. /v1"
                ),
            ),
            429 => (
                true,
                format!("{base_url} is rate limiting (HTTP 429: {message})"),
            ),
            s if s >= 500 => (true, format!("{base_url} failed (HTTP {s}: {message})")),
            s => (
                false,
                format!("{base_url} refused the request (HTTP {s}: {message})"),
            ),
        };
        ProviderError {
            provider: PROVIDER_NAME.to_owned(),
            message,
            retryable,
            retry_after,
            context_exceeded,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tool_names_become_function_names_and_back() {
        assert_eq!(function_name("search_logs@1"), "search_logs_v1");
        assert_eq!(
            function_name("mcp:runbooks/lookup@1"),
            "mcp_runbooks_lookup_v1"
        );
        assert_eq!(function_name("submit_report"), "submit_report");
        assert_eq!(function_name(&"x".repeat(100)).len(), 64);
        let names = names_of(&["a:b@1", "a_b@1", "submit_report"]);
        // Two tools that map to the same function name stay apart.
        assert_ne!(names.function("a:b@1"), names.function("a_b@1"));
        for tool in ["a:b@1", "a_b@1", "submit_report"] {
            assert_eq!(names.tool(&names.function(tool)), tool);
        }
        assert_eq!(names.tool("made_up"), "made_up");
        assert_eq!(names.tool("list_changes_v1"), "list_changes@1");
        assert_eq!(names.tool("search_v"), "search_v");
    }

    #[test]
    fn arguments_that_are_not_json_are_kept_as_written() {
        assert_eq!(parse_arguments(""), serde_json::json!({}));
        assert_eq!(parse_arguments(r#"{"a":1}"#), serde_json::json!({"a": 1}));
        assert_eq!(parse_arguments("{oops"), Value::String("{oops".into()));
    }

    #[test]
    fn server_errors_are_read_in_the_openai_shape_or_as_text() {
        assert_eq!(
            server_message(r#"{"error":{"message":"bad key","type":"x"}}"#),
            "bad key"
        );
        assert_eq!(server_message(r#"{"error":"plain"}"#), "plain");
        assert_eq!(server_message("oops"), "oops");
        assert_eq!(server_message(""), "no message");
        assert_eq!(parse_retry_after("2"), Some(Duration::from_secs(2)));
        assert_eq!(parse_retry_after("0.5"), Some(Duration::from_millis(500)));
        assert_eq!(parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT"), None);
    }

    #[test]
    fn statuses_are_classified() {
        let failure = |status| HttpFailure {
            status,
            retry_after: None,
            message: "m".into(),
            context_exceeded: false,
        };
        let e = failure(401).into_provider_error("http://x/v1", "the variable K");
        assert!(!e.retryable);
        assert!(e.message.contains("the variable K"), "{}", e.message);
        assert!(failure(429).into_provider_error("u", "k").retryable);
        assert!(failure(503).into_provider_error("u", "k").retryable);
        assert!(!failure(400).into_provider_error("u", "k").retryable);
        assert!(!failure(400).into_provider_error("u", "k").context_exceeded);
    }

    #[test]
    fn a_refusal_for_the_context_length_is_told_apart() {
        let openai = r#"{"error":{"message":"This model's maximum context length is 4096 tokens.","type":"invalid_request_error","param":"messages","code":"context_length_exceeded"}}"#;
        assert!(context_exceeded(400, openai));
        // Servers that give no code, but say it.
        assert!(context_exceeded(
            400,
            r#"{"error":"prompt exceeds the context window"}"#
        ));
        assert!(context_exceeded(
            413,
            "input is longer than the context length"
        ));
        // Anything else is not.
        assert!(!context_exceeded(
            400,
            r#"{"error":{"message":"bad tool schema"}}"#
        ));
        assert!(
            !context_exceeded(500, openai),
            "a server error is retried, not compacted"
        );
    }

    /// A `chat.completion.chunk` with `choices` and `usage`.
    fn chunk(choices: Value, usage: Value) -> CreateChatCompletionStreamResponse {
        serde_json::from_value(serde_json::json!({
            "id": "chatcmpl-1",
            "object": "chat.completion.chunk",
            "created": 1,
            "model": "m-1",
            "choices": choices,
            "usage": usage,
        }))
        .expect("a chunk")
    }

    fn names_of(tools: &[&str]) -> FunctionNames {
        FunctionNames::new(&ModelRequest {
            model: "m".into(),
            system: String::new(),
            messages: Vec::new(),
            tools: tools
                .iter()
                .map(|n| {
                    std::sync::Arc::new(crate::provider::ToolSpec {
                        name: (*n).to_owned(),
                        description: String::new(),
                        parameters: serde_json::json!({"type": "object"}),
                    })
                })
                .collect(),
            max_tokens: 1,
            temperature: 0.0,
        })
    }

    #[test]
    fn streamed_chunks_assemble_into_the_answer_a_whole_completion_gives() {
        use serde_json::json;
        // Text and two tool calls, their arguments in fragments and the calls' chunks
        // interleaved, then the finish reason, then the usage alone.
        let chunks = [
            chunk(
                json!([{"index": 0, "delta": {"role": "assistant", "content": "Look"}}]),
                Value::Null,
            ),
            chunk(
                json!([{"index": 0, "delta": {"content": "ing."}}]),
                Value::Null,
            ),
            chunk(
                json!([{"index": 0, "delta": {"tool_calls": [
                    {"index": 0, "id": "call_a", "type": "function",
                     "function": {"name": "search_logs_v1", "arguments": ""}},
                    {"index": 1, "id": "call_b", "type": "function",
                     "function": {"name": "submit_report", "arguments": "{\"summ"}}
                ]}}]),
                Value::Null,
            ),
            chunk(
                json!([{"index": 0, "delta": {"tool_calls": [
                    {"index": 0, "function": {"arguments": "{\"service\":"}},
                    {"index": 1, "function": {"arguments": "ary\":\"x\"}"}}
                ]}}]),
                Value::Null,
            ),
            chunk(
                json!([{"index": 0, "delta": {"tool_calls": [
                    {"index": 0, "function": {"arguments": "\"payment-api\"}"}}
                ]}}]),
                Value::Null,
            ),
            chunk(
                json!([{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]),
                Value::Null,
            ),
            chunk(
                json!([]),
                json!({"prompt_tokens": 30, "completion_tokens": 7, "total_tokens": 37}),
            ),
        ];
        let mut assembly = Assembly::default();
        for c in chunks {
            assembly.add(c);
        }
        let names = names_of(&["search_logs@1"]);
        let streamed = assembly
            .finish("http://x/v1")
            .unwrap()
            .into_response(&names);

        // The same answer, whole.
        let whole: CreateChatCompletionResponse = serde_json::from_value(json!({
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "created": 1,
            "model": "m-1",
            "choices": [{
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": "Looking.",
                    "tool_calls": [
                        {"id": "call_a", "type": "function", "function":
                            {"name": "search_logs_v1", "arguments": "{\"service\":\"payment-api\"}"}},
                        {"id": "call_b", "type": "function", "function":
                            {"name": "submit_report", "arguments": "{\"summary\":\"x\"}"}}
                    ]
                },
                "finish_reason": "tool_calls"
            }],
            "usage": {"prompt_tokens": 30, "completion_tokens": 7, "total_tokens": 37}
        }))
        .unwrap();
        let whole = Answer::whole(whole).unwrap().into_response(&names);
        assert_eq!(streamed, whole);
        assert_eq!(streamed.message.content, "Looking.");
        assert_eq!(streamed.message.tool_calls.len(), 2);
        assert_eq!(streamed.message.tool_calls[0].name, "search_logs@1");
        assert_eq!(
            streamed.message.tool_calls[0].arguments,
            json!({"service": "payment-api"})
        );
        assert_eq!(streamed.message.tool_calls[1].name, "submit_report");
        assert_eq!(streamed.finish, FinishReason::ToolCalls);
        assert_eq!(streamed.usage.input, 30);
        assert_eq!(streamed.usage.output, 7);
        assert_eq!(streamed.model, "m-1");
    }

    #[test]
    fn a_streamed_text_answer_its_length_stop_and_malformed_arguments_are_kept() {
        use serde_json::json;
        let mut assembly = Assembly::default();
        assembly.add(chunk(
            json!([{"index": 0, "delta": {"content": "cut "}}]),
            Value::Null,
        ));
        assembly.add(chunk(
            json!([{"index": 0, "delta": {"content": "off"}, "finish_reason": "length"}]),
            Value::Null,
        ));
        let answer = assembly.finish("u").unwrap().into_response(&names_of(&[]));
        assert_eq!(answer.message.content, "cut off");
        assert_eq!(answer.finish, FinishReason::Length);
        assert_eq!(answer.usage, TokenUsage::default(), "no usage chunk came");

        // A call without an id gets one from its index; arguments that are not JSON are
        // kept as written, as for a whole answer.
        let mut assembly = Assembly::default();
        assembly.add(chunk(
            json!([{"index": 0, "delta": {"tool_calls": [
                {"index": 3, "function": {"name": "made_up", "arguments": "{oops"}}
            ]}, "finish_reason": "tool_calls"}]),
            Value::Null,
        ));
        let answer = assembly.finish("u").unwrap().into_response(&names_of(&[]));
        assert_eq!(answer.message.tool_calls[0].id, "call_3");
        assert_eq!(answer.message.tool_calls[0].name, "made_up");
        assert_eq!(
            answer.message.tool_calls[0].arguments,
            Value::String("{oops".into())
        );
    }

    #[test]
    fn a_stream_without_choices_or_a_finish_reason_is_an_error() {
        use serde_json::json;
        let empty = Assembly::default().finish("http://x/v1").unwrap_err();
        assert!(!empty.retryable);
        assert!(empty.message.contains("no choices"), "{}", empty.message);

        let mut cut = Assembly::default();
        cut.add(chunk(
            json!([{"index": 0, "delta": {"content": "half an ans"}}]),
            Value::Null,
        ));
        let cut = cut.finish("http://x/v1").unwrap_err();
        assert!(cut.retryable, "a stream cut short may be asked again");
        assert!(cut.message.contains("finish_reason"), "{}", cut.message);
        assert!(cut.message.contains("http://x/v1"), "{}", cut.message);
    }

    #[test]
    fn the_base_url_comes_from_the_profile_first() {
        let c = Connection {
            base_url: Some("http://localhost:11434/v1/".into()),
            ..Connection::default()
        };
        assert_eq!(c.resolved_base_url(), "http://localhost:11434/v1");
        assert_eq!(c.key_source(), "the variable OPENAI_API_KEY");
        let bad = Connection {
            base_url: Some("localhost:11434".into()),
            ..Connection::default()
        };
        assert!(
            OpenAiProvider::new(&bad, &ClientSettings::default())
                .unwrap_err()
                .contains("http")
        );
    }
}
