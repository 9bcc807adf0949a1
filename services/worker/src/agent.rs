//! The agent loop: one delegation, from task to [`v1::TaskResult`].
//!
//! The loop alternates model turns and tool calls until the model gives its final
//! report, bounded by the profile's iteration limit, the task's budget and the task
//! token's call limit, and raced against the task's deadline and cancellation.
//!
//! Every tool call goes the same way, whichever provider asked for it:
//!
//! 1. only tools in `profile.default_tools ∩ token tools ∩ task.allowed_tools` are
//!    callable (the token's `tools` claim is read without verifying its signature: the
//!    policy service verifies the token on every Authorize, and the claim can only
//!    narrow what the worker offers);
//! 2. the tool checks its arguments and says what it touches;
//! 3. `Policy.Authorize(token, tool, action, resource, data scope, audience =
//!    worker:<profile>)`; a deny is an answer;
//! 4. the tool runs (read-only, deterministic output; `delegate@1` calls the supervisor's
//!    Delegate with the task token and waits for the children);
//! 5. the output bytes and their evidence record are stored in one
//!    `EvidenceStore.PutArtifact` call, with the task token as bearer.
//!
//! A call that is refused, denied or fails becomes a structured tool outcome
//! (`success: false` and the reason) the model reads, never a crash. Only failures of
//! the mesh itself (policy or evidence store unreachable) end the task, as FAILED and
//! retryable when transient.
//!
//! Evidence ids are `<scheme>://<subject>/<delegation_id>/<call id>`, so a re-executed
//! delegation records the same ids (the playbook's call ids are its step ids); when the
//! store already holds an id with the same content hash, the stored record is reused.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime};

use base64::Engine as _;
use convene_core::ids::content_hash;
use convene_core::permissions::{RiskLevel, TimeWindow, time_window_from_proto};
use convene_core::time::{from_timestamp, to_timestamp};
use convene_core::validate;
use convene_mesh::auth;
use convene_mesh::handles::{EvidenceHandle, PolicyHandle, SupervisorHandle};
use convene_proto::v1;
use serde_json::Value;
use tokio_util::sync::CancellationToken;
use tonic::Code;
use tracing::Instrument as _;
use tracing::field::Empty;

use crate::profiles::Profile;
use crate::provider::{
    FinishReason, Message, ModelProvider, ModelRequest, ProviderError, ToolCall, ToolSpec,
};
use crate::report::{FinalReport, ToolOutcome};
use crate::tools::{PreparedCall, ToolEnv, ToolError, ToolRegistry};

/// The argument a model (or playbook step) may add to any tool call to name the kind of
/// evidence the call records, e.g. `impact_metric`. The loop removes it before the tool
/// sees the arguments.
pub const EVIDENCE_KIND_ARG: &str = "evidence_kind";

/// Retries of a model call that failed transiently, before the task fails.
const PROVIDER_RETRIES: u32 = 2;
/// First pause between model retries; it doubles each time.
const PROVIDER_BACKOFF: Duration = Duration::from_millis(200);
/// Time kept back from the deadline to hand in a TIMED_OUT result before the deadline.
const RESULT_MARGIN: Duration = Duration::from_millis(200);
/// Exit status of a process killed by the `exit_process_after_tools` fault.
const FAULT_EXIT_CODE: i32 = 86;

/// What the model is told about the report it must give.
const REPORT_FORMAT: &str = "When you have what you need, answer with one JSON object and \
nothing else: {\"summary\": string, \"claims\": [{\"claim_id\": string, \"topic\": string, \
\"value\": string, \"statement\": string, \"evidence_from\": [tool call ids], \
\"confidence\": number in [0, 1]}], \"proposed_actions\": [{\"action\": string, \
\"parameters\": object, \"risk_level\": \"R0\"..\"R3\", \"rationale\": string, \
\"evidence_from\": [tool call ids]}], \"missing_evidence\": [string], \
\"recommended_next\": string}. Cite only tool calls that succeeded. Never perform an \
action: propose it.";

/// One delegation to run.
#[derive(Debug, Clone)]
pub struct Assignment {
    /// The Delegation Contract (already validated).
    pub task: v1::DelegationTask,
    /// The task token.
    pub token: String,
    /// Dispatch attempt, from 1.
    pub attempt: u32,
}

/// A cancellation request for a running delegation.
#[derive(Debug, Default)]
pub struct CancelSignal {
    token: CancellationToken,
    reason: Mutex<String>,
}

impl CancelSignal {
    /// Cancels, remembering why.
    pub fn cancel(&self, reason: &str) {
        *lock(&self.reason) = reason.to_owned();
        self.token.cancel();
    }

    fn reason(&self) -> String {
        let reason = lock(&self.reason).clone();
        if reason.trim().is_empty() {
            "no reason given".to_owned()
        } else {
            reason
        }
    }
}

/// Everything the loop needs for one profile.
#[derive(Clone)]
pub struct Agent {
    /// This worker's id, reported in results.
    pub worker_id: Arc<str>,
    /// The profile.
    pub profile: Arc<Profile>,
    /// Its model provider.
    pub provider: Arc<dyn ModelProvider>,
    /// The tools.
    pub tools: Arc<ToolRegistry>,
    /// The policy service.
    pub policy: PolicyHandle,
    /// The evidence store.
    pub evidence: EvidenceHandle,
    /// The supervisor, which `delegate@1` asks for child delegations; None when the
    /// worker has none (the tool then fails with a message saying so).
    pub supervisor: Option<SupervisorHandle>,
    /// Whether the `exit_process_after_tools` fault may exit the process (standalone
    /// binary only).
    pub exit_process: bool,
}

impl std::fmt::Debug for Agent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Agent")
            .field("worker_id", &self.worker_id)
            .field("profile", &self.profile.profile.id)
            .field("provider", &self.provider.name())
            .finish_non_exhaustive()
    }
}

/// The per-task facts every tool call needs.
struct TaskContext<'a> {
    task: &'a v1::DelegationTask,
    attempt: u32,
    token: &'a str,
    audience: String,
    window: TimeWindow,
    scope: Option<v1::TaskScope>,
    callable: BTreeSet<String>,
    max_tool_calls: u32,
}

/// What happened to one tool call.
#[derive(Debug, Clone)]
enum CallState {
    Running,
    Succeeded(Box<v1::Evidence>),
    /// Refused by the loop or denied by the policy service: a permission problem.
    Denied(String),
    /// Bad arguments, missing data, budget used up.
    Failed(String),
}

#[derive(Debug, Clone)]
struct CallRecord {
    call_id: String,
    state: CallState,
}

/// What the task has done so far; read for the result whichever way the task ends.
#[derive(Debug, Default)]
struct Progress {
    iterations: u32,
    tool_calls: u32,
    tokens: u64,
    calls: Vec<CallRecord>,
}

/// A failure of the mesh (not of a tool): ends the task.
#[derive(Debug, Clone)]
struct Infra {
    code: &'static str,
    retryable: bool,
    message: String,
}

impl Infra {
    fn from_status(service: &str, status: &tonic::Status) -> Self {
        // A connection that broke under the call (reset, or shut down by the HTTP/2
        // peer) reaches the client as UNKNOWN "transport error": the service may well
        // answer the same call on a new connection.
        let broken_connection =
            status.code() == Code::Unknown && status.message().starts_with("transport error");
        let retryable = broken_connection
            || matches!(
                status.code(),
                Code::Unavailable
                    | Code::DeadlineExceeded
                    | Code::ResourceExhausted
                    | Code::Aborted
            );
        Self {
            code: if retryable {
                "upstream_unavailable"
            } else {
                "upstream_error"
            },
            retryable,
            message: format!(
                "the {service} answered {:?}: {}",
                status.code(),
                status.message()
            ),
        }
    }
}

/// Why a tool call did not succeed.
enum CallError {
    Denied(String),
    Failed(String),
    Infra(Infra),
}

/// How the loop ended on its own.
enum LoopEnd {
    Report(FinalReport),
    IterationLimit,
    TokenBudget(u64),
    Provider(ProviderError),
    Infra(Infra),
    /// The `fail_attempts_after_tools` fault, after the first round of tool calls.
    InjectedFailure(u32),
}

/// How the task ended.
enum Ending {
    Loop(LoopEnd),
    TimedOut,
    Cancelled(String),
    Blocked(String),
    InjectedFailure(u32),
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding the lock leaves plain data behind; keep using it.
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Agent {
    /// Runs `a` to its end: the final report, the deadline, cancellation or a failure.
    pub async fn run(&self, a: &Assignment, cancel: &CancelSignal) -> v1::TaskResult {
        let started = Instant::now();
        let progress = Mutex::new(Progress::default());
        let faults = &self.profile.faults;
        let ending = if a.attempt <= faults.fail_attempts {
            Ending::InjectedFailure(faults.fail_attempts)
        } else {
            match self.context(a) {
                Err(reason) => Ending::Blocked(reason),
                Ok(ctx) => {
                    let deadline = deadline_of(&a.task);
                    tokio::select! {
                        end = self.run_loop(&ctx, &progress) => Ending::Loop(end),
                        () = tokio::time::sleep_until(deadline) => Ending::TimedOut,
                        () = cancel.token.cancelled() => Ending::Cancelled(cancel.reason()),
                    }
                }
            }
        };
        let progress = progress
            .into_inner()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let result = self.result(a, ending, progress, started);
        if !self.profile.faults.any()
            && let Err(e) = validate::task_result(&result, &a.task, "result")
        {
            tracing::warn!(
                delegation_id = %a.task.delegation_id,
                error = %e,
                "the result does not satisfy the Result Contract; the join will reject it"
            );
        }
        result
    }

    /// The per-task facts, or why the task cannot use any tool.
    fn context<'a>(&self, a: &'a Assignment) -> Result<TaskContext<'a>, String> {
        let claims = token_view(&a.token)?;
        let profile = &self.profile.profile;
        let callable: BTreeSet<String> = profile
            .default_tools
            .iter()
            .filter(|t| claims.tools.contains(t))
            .filter(|t| a.task.allowed_tools.is_empty() || a.task.allowed_tools.contains(t))
            .cloned()
            .collect();
        let budget = a.task.budget.as_ref().map_or(0, |b| b.max_tool_calls);
        let max_tool_calls = match (budget, claims.max_calls) {
            (0, 0) => u32::MAX,
            (0, n) | (n, 0) => n,
            (b, n) => b.min(n),
        };
        let window = a
            .task
            .scope
            .as_ref()
            .and_then(|s| s.time_range.as_ref())
            .and_then(|tr| time_window_from_proto(tr, "task.scope.time_range").ok())
            .unwrap_or_default();
        Ok(TaskContext {
            task: &a.task,
            attempt: a.attempt,
            token: &a.token,
            audience: format!("worker:{}", profile.id),
            window,
            scope: a.task.scope.clone(),
            callable,
            max_tool_calls,
        })
    }

    async fn run_loop(&self, ctx: &TaskContext<'_>, progress: &Mutex<Progress>) -> LoopEnd {
        let faults = &self.profile.faults;
        if let Some(hold) = &faults.hold {
            hold.wait(&ctx.task.delegation_id).await;
        }
        if let Some(delay) = faults.delay {
            tokio::time::sleep(delay).await;
        }
        if faults.hang {
            std::future::pending::<()>().await;
        }
        let profile = &self.profile.profile;
        let budget_tokens = ctx.task.budget.as_ref().map_or(0, |b| b.max_tokens);
        let max_tokens = match budget_tokens {
            0 => u64::from(profile.max_tokens),
            b => b.min(u64::from(profile.max_tokens)),
        };
        let specs: Vec<Arc<ToolSpec>> = ctx
            .callable
            .iter()
            .filter_map(|name| self.tools.model_spec(name))
            .cloned()
            .collect();
        let mut messages = vec![Message::user(task_prompt(ctx))];
        for iteration in 1..=profile.max_iterations {
            lock(progress).iterations = iteration;
            let used = lock(progress).tokens;
            let request = ModelRequest {
                model: profile.model.clone(),
                system: format!("{}\n\n{REPORT_FORMAT}", profile.instructions.trim()),
                messages: messages.clone(),
                tools: specs.clone(),
                max_tokens: u32::try_from(max_tokens.saturating_sub(used)).unwrap_or(u32::MAX),
                temperature: profile.temperature,
            };
            let response = match self.complete(&request).await {
                Ok(r) => r,
                Err(e) => return LoopEnd::Provider(e),
            };
            let used = {
                let mut p = lock(progress);
                p.tokens = p.tokens.saturating_add(response.usage.total());
                p.tokens
            };
            let calls = response.message.tool_calls.clone();
            let content = response.message.content.clone();
            messages.push(response.message);
            if used > max_tokens {
                return LoopEnd::TokenBudget(max_tokens);
            }
            if !calls.is_empty() {
                let outcomes = futures::future::join_all(
                    calls.iter().map(|c| self.call_tool(ctx, c, progress)),
                )
                .await;
                for (call, outcome) in calls.iter().zip(outcomes) {
                    match outcome {
                        Ok(o) => messages.push(Message::tool_result(&call.id, o.to_content())),
                        Err(infra) => return LoopEnd::Infra(infra),
                    }
                }
                if faults.exit_process_after_tools {
                    self.die().await;
                }
                if ctx.attempt <= faults.fail_attempts_after_tools {
                    return LoopEnd::InjectedFailure(faults.fail_attempts_after_tools);
                }
                continue;
            }
            if response.finish == FinishReason::Length {
                messages.push(Message::user(
                    "Your answer was cut off at the token limit; give the final report as \
                     a shorter JSON object.",
                ));
                continue;
            }
            match FinalReport::parse(&content) {
                Ok(report) => return LoopEnd::Report(report),
                Err(e) => messages.push(Message::user(e)),
            }
        }
        LoopEnd::IterationLimit
    }

    /// A model call, retried with backoff while the error is transient; one
    /// `model.call` span with the OpenTelemetry GenAI attributes (`gen_ai.*`), retries
    /// included.
    async fn complete(
        &self,
        request: &ModelRequest,
    ) -> Result<crate::provider::ModelResponse, ProviderError> {
        let provider = self.provider.name();
        // A provider without models (the playbook) is its own model.
        let model = if request.model.is_empty() {
            provider
        } else {
            request.model.as_str()
        };
        let span = tracing::info_span!(
            "model.call",
            convene.service = "worker",
            gen_ai.operation.name = "chat",
            gen_ai.system = %provider,
            gen_ai.provider.name = %provider,
            gen_ai.request.model = %model,
            gen_ai.request.max_tokens = request.max_tokens,
            gen_ai.request.temperature = request.temperature,
            gen_ai.usage.input_tokens = Empty,
            gen_ai.usage.output_tokens = Empty,
            gen_ai.response.finish_reasons = Empty,
            convene.model.tool_calls = Empty,
            convene.model.retries = Empty,
            error.type = Empty,
        );
        let mut pause = PROVIDER_BACKOFF;
        let mut tries = 0;
        let outcome = async {
            loop {
                match self.provider.complete(request).await {
                    Err(e) if e.retryable && tries < PROVIDER_RETRIES => {
                        tries += 1;
                        tracing::warn!(provider = %e.provider, error = %e.message, tries, "model call failed, retrying");
                        tokio::time::sleep(pause).await;
                        pause *= 2;
                    }
                    other => return other,
                }
            }
        }
        .instrument(span.clone())
        .await;
        span.record("convene.model.retries", tries);
        match &outcome {
            Ok(response) => {
                span.record("gen_ai.usage.input_tokens", response.usage.input);
                span.record("gen_ai.usage.output_tokens", response.usage.output);
                span.record(
                    "gen_ai.response.finish_reasons",
                    match response.finish {
                        FinishReason::ToolCalls => "tool_calls",
                        FinishReason::Stop => "stop",
                        FinishReason::Length => "length",
                    },
                );
                span.record(
                    "convene.model.tool_calls",
                    response.message.tool_calls.len(),
                );
            }
            Err(e) => {
                span.record(
                    "error.type",
                    if e.retryable {
                        "provider_unavailable"
                    } else {
                        "provider_error"
                    },
                );
                convene_telemetry::set_error(&span, e.message.clone());
            }
        }
        outcome
    }

    /// The `exit_process_after_tools` fault: the process dies, or (hosted in-process)
    /// the task is abandoned as if it had.
    async fn die(&self) {
        if self.exit_process {
            tracing::error!(
                profile = %self.profile.profile.id,
                "fault injection: exiting the process mid-task (exit_process_after_tools)"
            );
            std::process::exit(FAULT_EXIT_CODE);
        }
        tracing::warn!(
            profile = %self.profile.profile.id,
            "fault injection: abandoning the task mid-task (exit_process_after_tools, process exit disabled)"
        );
        std::future::pending::<()>().await;
    }

    /// One tool call, recorded in `progress` and as a `tool.call` span (tool and
    /// version, argument fingerprint, authorization decision, error code; failed unless
    /// the call succeeded); `Err` only for mesh failures.
    async fn call_tool(
        &self,
        ctx: &TaskContext<'_>,
        call: &ToolCall,
        progress: &Mutex<Progress>,
    ) -> Result<ToolOutcome, Infra> {
        let (tool_name, tool_version) = call.name.split_once('@').unwrap_or((&call.name, ""));
        let span = tracing::info_span!(
            "tool.call",
            convene.service = "worker",
            gen_ai.operation.name = "execute_tool",
            gen_ai.tool.name = %call.name,
            gen_ai.tool.call.id = %call.id,
            convene.delegation.id = %ctx.task.delegation_id,
            convene.tool = %call.name,
            convene.tool.name = %tool_name,
            convene.tool.version = %tool_version,
            convene.tool.args_fingerprint = %content_hash(
                crate::tools::canonical_json(&call.arguments).as_bytes()
            ),
            convene.authz.decision = Empty,
            convene.authz.reason = Empty,
            convene.authz.decision_id = Empty,
            convene.evidence.id = Empty,
            error.type = Empty,
        );
        self.call_tool_inner(ctx, call, progress, &span)
            .instrument(span.clone())
            .await
    }

    async fn call_tool_inner(
        &self,
        ctx: &TaskContext<'_>,
        call: &ToolCall,
        progress: &Mutex<Progress>,
        span: &tracing::Span,
    ) -> Result<ToolOutcome, Infra> {
        let index = {
            let mut p = lock(progress);
            p.calls.push(CallRecord {
                call_id: call.id.clone(),
                state: CallState::Running,
            });
            p.calls.len() - 1
        };
        let (state, outcome) = match self.try_call(ctx, call, progress).await {
            Ok((evidence, output)) => {
                span.record("convene.evidence.id", evidence.evidence_id.as_str());
                let outcome = ToolOutcome::success(evidence.evidence_id.clone(), output);
                (CallState::Succeeded(Box::new(evidence)), outcome)
            }
            Err(CallError::Denied(reason)) => {
                span.record("error.type", "permission_denied");
                convene_telemetry::set_error(span, reason.clone());
                (
                    CallState::Denied(reason.clone()),
                    ToolOutcome::failure(reason),
                )
            }
            Err(CallError::Failed(reason)) => {
                span.record("error.type", "tool_failed");
                convene_telemetry::set_error(span, reason.clone());
                (
                    CallState::Failed(reason.clone()),
                    ToolOutcome::failure(reason),
                )
            }
            Err(CallError::Infra(infra)) => {
                span.record("error.type", infra.code);
                convene_telemetry::set_error(span, infra.message.clone());
                lock(progress).calls[index].state = CallState::Failed(infra.message.clone());
                return Err(infra);
            }
        };
        tracing::info!(
            delegation_id = %ctx.task.delegation_id,
            call_id = %call.id,
            tool = %call.name,
            success = outcome.success,
            error = outcome.error.as_deref().unwrap_or(""),
            "tool call"
        );
        lock(progress).calls[index].state = state;
        Ok(outcome)
    }

    async fn try_call(
        &self,
        ctx: &TaskContext<'_>,
        call: &ToolCall,
        progress: &Mutex<Progress>,
    ) -> Result<(v1::Evidence, Value), CallError> {
        {
            let mut p = lock(progress);
            if p.tool_calls >= ctx.max_tool_calls {
                return Err(CallError::Failed(format!(
                    "the task's budget of {} tool calls is used up; answer with what you have",
                    ctx.max_tool_calls
                )));
            }
            p.tool_calls += 1;
        }
        let tool = self.tools.get(&call.name).ok_or_else(|| {
            CallError::Failed(format!(
                "unknown tool {}; the tools are: {}",
                call.name,
                ctx.callable.iter().cloned().collect::<Vec<_>>().join(", ")
            ))
        })?;
        if !ctx.callable.contains(&call.name) {
            let span = tracing::Span::current();
            span.record("convene.authz.decision", "deny");
            span.record("convene.authz.reason", "TOOL_NOT_GRANTED_TO_TASK");
            return Err(CallError::Denied(format!(
                "tool {} is not granted to this task (callable: {}); the task token, the \
                 task's allowed tools and the profile must all include it",
                call.name,
                describe(&ctx.callable)
            )));
        }
        let (args, kind) = split_kind(&call.arguments);
        let prepared = tool
            .prepare(&args, &ctx.window)
            .map_err(|e| CallError::Failed(e.to_string()))?;
        let tool_call_id = format!("{}/{}", ctx.task.delegation_id, call.id);

        // The token travels in the message, which is what the policy service judges;
        // a bearer copy of it would only add some 700 bytes of header to every call.
        let decision = self
            .policy
            .authorize(tonic::Request::new(v1::AuthorizeRequest {
                token: ctx.token.to_owned(),
                tool: prepared.tool.to_owned(),
                action: prepared.action.to_owned(),
                resource: prepared.resource.clone(),
                data_scope: Some(prepared.data_scope()),
                audience: ctx.audience.clone(),
                tenant: String::new(),
                tool_call_id: tool_call_id.clone(),
            }))
            .await
            .map_err(|s| CallError::Infra(Infra::from_status("policy service", &s)))?
            .into_inner();
        let reason =
            v1::AuthorizeReason::try_from(decision.reason).map_or("UNKNOWN", |r| r.as_str_name());
        {
            let span = tracing::Span::current();
            span.record(
                "convene.authz.decision",
                if decision.allowed { "allow" } else { "deny" },
            );
            span.record(
                "convene.authz.reason",
                reason.trim_start_matches("AUTHORIZE_REASON_"),
            );
            span.record("convene.authz.decision_id", decision.decision_id.as_str());
        }
        if !decision.allowed {
            return Err(CallError::Denied(format!(
                "denied by policy ({reason}): {}",
                decision.detail
            )));
        }

        let env = ToolEnv {
            data_dir: self.tools.data_dir(),
            token: ctx.token,
            supervisor: self.supervisor.as_ref(),
        };
        let output = tool.run(&prepared, &env).await.map_err(call_error)?;

        // The same call of the same delegation gets the same id (a retry records it
        // again). The run id, a UUIDv7, comes before the hashed delegation id so that
        // ids sort by time within a source: the catalog's key index is appended to
        // rather than written at random pages as the database grows.
        let evidence_id = format!(
            "{}://{}/{}/{}/{}",
            self.profile.faults.scheme(prepared.scheme),
            prepared.subject,
            ctx.task.run_id,
            ctx.task.delegation_id,
            uri_segment(&call.id)
        );
        let record = v1::Evidence {
            evidence_id,
            kind: kind.unwrap_or_else(|| prepared.default_kind.to_owned()),
            source: prepared.source.clone(),
            query_fingerprint: prepared.fingerprint(),
            scope: Some(evidence_scope(ctx, &prepared)),
            observed_at: Some(to_timestamp(SystemTime::now())),
            artifact_uri: String::new(),
            content_hash: content_hash(&output.bytes),
            quality: if output.truncated {
                v1::EvidenceQuality::Degraded
            } else {
                v1::EvidenceQuality::Passed
            } as i32,
            tool_call_id: tool_call_id.clone(),
            // The run's trace, so a record leads back to the tool call that made it.
            trace_id: convene_telemetry::current_trace_id().unwrap_or_default(),
            delegation_id: String::new(),
            tenant: String::new(),
        };
        let stored = self.store(ctx, record, output.bytes, tool_call_id).await?;
        Ok((stored, output.value))
    }

    /// Stores the output and its evidence in one call; reuses an identical record a
    /// previous execution stored.
    async fn store(
        &self,
        ctx: &TaskContext<'_>,
        record: v1::Evidence,
        content: Vec<u8>,
        tool_call_id: String,
    ) -> Result<v1::Evidence, CallError> {
        let request = v1::PutArtifactRequest {
            content,
            media_type: "application/json".to_owned(),
            tool_call_id,
            evidence: Some(record.clone()),
        };
        match self
            .evidence
            .put_artifact(auth::request(request, ctx.token))
            .await
        {
            Ok(response) => {
                let response = response.into_inner();
                Ok(response.evidence.unwrap_or_else(|| {
                    let artifact = response.artifact.unwrap_or_default();
                    v1::Evidence {
                        artifact_uri: artifact.uri,
                        ..record
                    }
                }))
            }
            Err(status) if status.code() == Code::AlreadyExists => self.reuse(ctx, &record).await,
            Err(status)
                if matches!(
                    status.code(),
                    Code::PermissionDenied | Code::Unauthenticated
                ) =>
            {
                Err(CallError::Denied(format!(
                    "the evidence store refused to record {}: {}",
                    record.evidence_id,
                    status.message()
                )))
            }
            Err(status) => Err(CallError::Infra(Infra::from_status(
                "evidence store",
                &status,
            ))),
        }
    }

    async fn reuse(
        &self,
        ctx: &TaskContext<'_>,
        ours: &v1::Evidence,
    ) -> Result<v1::Evidence, CallError> {
        let found = self
            .evidence
            .get_evidence(auth::request(
                v1::GetEvidenceRequest {
                    evidence_ids: vec![ours.evidence_id.clone()],
                },
                ctx.token,
            ))
            .await
            .map_err(|s| CallError::Infra(Infra::from_status("evidence store", &s)))?
            .into_inner();
        match found
            .evidence
            .into_iter()
            .find(|e| e.evidence_id == ours.evidence_id)
        {
            Some(existing) if existing.content_hash == ours.content_hash => Ok(existing),
            Some(existing) => Err(CallError::Failed(format!(
                "evidence {} was recorded before with different content ({} instead of {}); \
                 the data changed since the delegation first ran",
                ours.evidence_id, existing.content_hash, ours.content_hash
            ))),
            None => Err(CallError::Failed(format!(
                "the evidence store says {} exists but does not return it",
                ours.evidence_id
            ))),
        }
    }

    /// Builds the result from how the task ended and what it did.
    fn result(
        &self,
        a: &Assignment,
        ending: Ending,
        progress: Progress,
        started: Instant,
    ) -> v1::TaskResult {
        let profile = &self.profile.profile;
        let faults = &self.profile.faults;
        let task = &a.task;

        let mut evidence: Vec<v1::Evidence> = Vec::new();
        let mut by_call: HashMap<&str, &str> = HashMap::new();
        for c in &progress.calls {
            if let CallState::Succeeded(e) = &c.state {
                by_call.insert(c.call_id.as_str(), e.evidence_id.as_str());
                if !evidence.iter().any(|x| x.evidence_id == e.evidence_id) {
                    evidence.push((**e).clone());
                }
            }
        }
        let not_gathered: Vec<String> = progress
            .calls
            .iter()
            .filter(|c| !matches!(c.state, CallState::Succeeded(_)))
            .map(|c| c.call_id.clone())
            .collect();
        let denials: Vec<&str> = progress
            .calls
            .iter()
            .filter_map(|c| match &c.state {
                CallState::Denied(reason) => Some(reason.as_str()),
                _ => None,
            })
            .collect();
        let all_denied = !progress.calls.is_empty() && denials.len() == progress.calls.len();
        let failures: Vec<String> = progress
            .calls
            .iter()
            .filter_map(|c| match &c.state {
                CallState::Denied(reason) | CallState::Failed(reason) => {
                    Some(format!("{} ({reason})", c.call_id))
                }
                CallState::Running => Some(format!("{} (unfinished)", c.call_id)),
                CallState::Succeeded(_) => None,
            })
            .collect();
        let cite = |from: &[String]| -> Vec<String> {
            let mut refs: Vec<String> = Vec::new();
            for f in from {
                let id = by_call
                    .get(f.as_str())
                    .map(|id| (*id).to_owned())
                    .or_else(|| {
                        evidence
                            .iter()
                            .find(|e| &e.evidence_id == f)
                            .map(|e| e.evidence_id.clone())
                    });
                if let Some(id) = id
                    && !refs.contains(&id)
                {
                    refs.push(id);
                }
            }
            refs
        };

        let mut result = v1::TaskResult {
            delegation_id: task.delegation_id.clone(),
            worker_id: self.worker_id.to_string(),
            profile_id: profile.id.clone(),
            profile_version: profile.version.clone(),
            ..v1::TaskResult::default()
        };
        let gathered = format!(
            "{} tool call(s), {} evidence record(s) gathered",
            progress.calls.len(),
            evidence.len()
        );
        let (status, error) = match ending {
            Ending::Loop(LoopEnd::Report(report)) => {
                result.claims = report
                    .claims
                    .iter()
                    .enumerate()
                    .map(|(i, c)| v1::Claim {
                        claim_id: if c.claim_id.trim().is_empty() {
                            format!("claim-{}", i + 1)
                        } else {
                            c.claim_id.clone()
                        },
                        topic: c.topic.clone(),
                        value: c.value.clone(),
                        statement: c.statement.clone(),
                        evidence_refs: cite(&c.evidence_from),
                        confidence: c.confidence.clamp(0.0, 1.0),
                    })
                    .collect();
                result.proposed_actions = report
                    .proposed_actions
                    .iter()
                    .map(|p| v1::ProposedAction {
                        action: p.action.clone(),
                        parameters: Some(to_struct(&p.parameters)),
                        risk_level: RiskLevel::parse(&p.risk_level)
                            .map_or(v1::RiskLevel::Unspecified, RiskLevel::to_proto)
                            as i32,
                        rationale: p.rationale.clone(),
                        evidence_refs: cite(&p.evidence_from),
                    })
                    .collect();
                result.summary = report.summary.clone();
                result.recommended_next = report.recommended_next.clone();
                for m in report.missing_evidence.iter().chain(&not_gathered) {
                    if !result.missing_evidence.contains(m) {
                        result.missing_evidence.push(m.clone());
                    }
                }
                if all_denied {
                    (v1::TaskStatus::Blocked, Some(blocked(&denials)))
                } else if result.claims.is_empty() {
                    (
                        v1::TaskStatus::Failed,
                        Some(error(
                            "no_findings",
                            false,
                            format!(
                                "the investigation produced no claim ({gathered}); failed \
                                 calls: {}",
                                describe_list(&failures)
                            ),
                        )),
                    )
                } else if result.missing_evidence.is_empty() {
                    (v1::TaskStatus::Completed, None)
                } else {
                    (v1::TaskStatus::Partial, None)
                }
            }
            Ending::Loop(LoopEnd::IterationLimit) if all_denied => {
                (v1::TaskStatus::Blocked, Some(blocked(&denials)))
            }
            Ending::Loop(LoopEnd::IterationLimit) => (
                v1::TaskStatus::Failed,
                Some(error(
                    "iteration_limit",
                    false,
                    format!(
                        "no final report within {} iterations ({gathered}); raise the \
                         profile's max_iterations or narrow the task",
                        profile.max_iterations
                    ),
                )),
            ),
            Ending::Loop(LoopEnd::TokenBudget(limit)) => (
                v1::TaskStatus::Failed,
                Some(error(
                    "token_budget",
                    false,
                    format!(
                        "the model used more than the {limit} tokens the task may spend ({gathered})"
                    ),
                )),
            ),
            Ending::Loop(LoopEnd::Provider(e)) => (
                v1::TaskStatus::Failed,
                Some(error("model_error", e.retryable, e.to_string())),
            ),
            Ending::Loop(LoopEnd::Infra(infra)) => (
                v1::TaskStatus::Failed,
                Some(error(infra.code, infra.retryable, infra.message)),
            ),
            Ending::TimedOut => (
                v1::TaskStatus::TimedOut,
                Some(error(
                    "timeout",
                    false,
                    format!(
                        "the task deadline passed before the investigation finished; {gathered}"
                    ),
                )),
            ),
            Ending::Cancelled(reason) => (
                v1::TaskStatus::Failed,
                Some(error(
                    "cancelled",
                    false,
                    format!("the delegation was cancelled: {reason}"),
                )),
            ),
            Ending::Blocked(reason) => (
                v1::TaskStatus::Blocked,
                Some(error("permission_denied", false, reason)),
            ),
            Ending::InjectedFailure(n) => (
                v1::TaskStatus::Failed,
                Some(error(
                    "injected_failure",
                    true,
                    format!(
                        "fault injection: the first {n} attempt(s) of every delegation fail; \
                         this was attempt {}",
                        a.attempt
                    ),
                )),
            ),
            Ending::Loop(LoopEnd::InjectedFailure(n)) => (
                v1::TaskStatus::Failed,
                Some(error(
                    "injected_failure",
                    true,
                    format!(
                        "fault injection: the first {n} attempt(s) of every delegation fail \
                         after their tool calls ({gathered}); this was attempt {}",
                        a.attempt
                    ),
                )),
            ),
        };
        if result.summary.is_empty() {
            result.summary = match &error {
                Some(e) => format!("{}: {}", e.code, e.message),
                None => gathered.clone(),
            };
        }
        if status != v1::TaskStatus::Completed && status != v1::TaskStatus::Partial {
            for m in &not_gathered {
                if !result.missing_evidence.contains(m) {
                    result.missing_evidence.push(m.clone());
                }
            }
        }
        result.status = status as i32;
        result.error = error;
        result.artifacts = evidence
            .iter()
            .map(|e| e.artifact_uri.clone())
            .filter(|u| !u.is_empty())
            .fold(Vec::new(), |mut acc, u| {
                if !acc.contains(&u) {
                    acc.push(u);
                }
                acc
            });
        result.evidence = evidence;
        result.usage = Some(v1::Usage {
            iterations: progress.iterations,
            tool_calls: progress.tool_calls,
            tokens: progress.tokens,
            cost: 0.0,
            duration_ms: u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX),
        });

        if let Some(id) = &faults.result_delegation_id {
            result.delegation_id = id.clone();
        }
        if faults.drop_evidence_refs {
            for c in &mut result.claims {
                c.evidence_refs.clear();
            }
        }
        if faults.corrupt_evidence_hash {
            for e in &mut result.evidence {
                e.content_hash = content_hash(format!("corrupted:{}", e.content_hash).as_bytes());
            }
        }
        result
    }
}

/// How a tool's failure counts: a permission problem, a failed call the model can work
/// around, or a failure of the mesh that ends the task.
fn call_error(e: ToolError) -> CallError {
    match e {
        ToolError::Denied { .. } => CallError::Denied(e.to_string()),
        ToolError::Unavailable { .. } => CallError::Infra(Infra {
            code: "upstream_unavailable",
            retryable: true,
            message: e.to_string(),
        }),
        ToolError::Crashed { .. } => CallError::Infra(Infra {
            code: "internal",
            retryable: false,
            message: e.to_string(),
        }),
        ToolError::InvalidArguments { .. }
        | ToolError::MissingData { .. }
        | ToolError::BadData { .. }
        | ToolError::Refused { .. } => CallError::Failed(e.to_string()),
    }
}

fn error(code: &str, retryable: bool, message: String) -> v1::ErrorInfo {
    v1::ErrorInfo {
        code: code.to_owned(),
        retryable,
        message,
    }
}

fn blocked(denials: &[&str]) -> v1::ErrorInfo {
    error(
        "permission_denied",
        false,
        format!(
            "every tool call was denied, so nothing could be investigated; first denial: {}",
            denials.first().copied().unwrap_or("none")
        ),
    )
}

fn describe(set: &BTreeSet<String>) -> String {
    if set.is_empty() {
        "none".to_owned()
    } else {
        set.iter().cloned().collect::<Vec<_>>().join(", ")
    }
}

fn describe_list(items: &[String]) -> String {
    if items.is_empty() {
        "none".to_owned()
    } else {
        items.join(", ")
    }
}

/// When the task must hand in its result: the deadline, less a small margin so a
/// TIMED_OUT result arrives before the deadline rather than after it.
fn deadline_of(task: &v1::DelegationTask) -> tokio::time::Instant {
    let now = tokio::time::Instant::now();
    let Some(deadline) = task
        .deadline
        .as_ref()
        .and_then(|d| from_timestamp(d, "task.deadline").ok())
    else {
        return now;
    };
    let remaining = deadline
        .duration_since(SystemTime::now())
        .unwrap_or(Duration::ZERO);
    let margin = RESULT_MARGIN.min(remaining / 10);
    now + remaining.saturating_sub(margin)
}

/// The claims of a task token the loop uses, read without verification (the policy
/// service verifies the token on every call; these can only narrow what is offered).
#[derive(Debug, serde::Deserialize)]
struct TokenView {
    #[serde(default)]
    tools: Vec<String>,
    #[serde(default)]
    max_calls: u32,
}

fn token_view(token: &str) -> Result<TokenView, String> {
    let unreadable = |why: &str| {
        format!(
            "the task token is not a readable JWS ({why}); ask the supervisor for a valid task token"
        )
    };
    let payload = token
        .split('.')
        .nth(1)
        .ok_or_else(|| unreadable("it has no payload segment"))?;
    let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(payload.trim_end_matches('='))
        .map_err(|_| unreadable("its payload is not base64url"))?;
    serde_json::from_slice(&bytes).map_err(|_| unreadable("its payload is not a claims object"))
}

/// Splits the reserved [`EVIDENCE_KIND_ARG`] off a call's arguments.
fn split_kind(arguments: &Value) -> (Value, Option<String>) {
    match arguments {
        Value::Object(map) => {
            let mut map = map.clone();
            let kind = map
                .remove(EVIDENCE_KIND_ARG)
                .and_then(|v| v.as_str().map(str::to_owned))
                .filter(|k| !k.trim().is_empty());
            (Value::Object(map), kind)
        }
        other => (other.clone(), None),
    }
}

/// Adds the [`EVIDENCE_KIND_ARG`] parameter to a tool's schema.
pub(crate) fn with_kind_arg(mut spec: ToolSpec) -> ToolSpec {
    if let Some(Value::Object(props)) = spec.parameters.get_mut("properties") {
        props.insert(
            EVIDENCE_KIND_ARG.to_owned(),
            serde_json::json!({
                "type": "string",
                "description": "Kind of evidence this call gathers, e.g. impact_metric or causal_signal."
            }),
        );
    }
    spec
}

/// A call id made safe for the last segment of an evidence URI.
fn uri_segment(id: &str) -> String {
    let cleaned: String = id
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
                c
            } else {
                '-'
            }
        })
        .collect();
    if cleaned.is_empty() {
        "call".to_owned()
    } else {
        cleaned
    }
}

/// The scope an evidence record covers: the task's window and the resource read.
fn evidence_scope(ctx: &TaskContext<'_>, call: &PreparedCall) -> v1::TaskScope {
    v1::TaskScope {
        resources: vec![call.resource.clone()],
        time_range: ctx.scope.as_ref().and_then(|s| s.time_range),
    }
}

fn task_prompt(ctx: &TaskContext<'_>) -> String {
    let t = ctx.task;
    let mut prompt = format!("Goal: {}\n", t.goal.trim());
    if !t.acceptance_criteria.is_empty() {
        prompt.push_str("Acceptance criteria:\n");
        for c in &t.acceptance_criteria {
            prompt.push_str(&format!("- {c}\n"));
        }
    }
    let resources = ctx
        .scope
        .as_ref()
        .map(|s| s.resources.join(", "))
        .filter(|r| !r.is_empty())
        .unwrap_or_else(|| "any".to_owned());
    let bound = |t: Option<SystemTime>| t.map_or("open".to_owned(), crate::tools::format_time);
    prompt.push_str(&format!(
        "Scope: resources {resources}; window {} to {}\n",
        bound(ctx.window.start),
        bound(ctx.window.end)
    ));
    if !t.input_refs.is_empty() {
        prompt.push_str(&format!("Inputs: {}\n", t.input_refs.join(", ")));
    }
    prompt.push_str(&format!("Tools: {}\n", describe(&ctx.callable)));
    prompt
}

/// A JSON object as a protobuf Struct (anything else becomes an empty Struct).
fn to_struct(value: &Value) -> prost_types::Struct {
    let fields = match value {
        Value::Object(map) => map
            .iter()
            .map(|(k, v)| (k.clone(), to_proto_value(v)))
            .collect(),
        _ => Default::default(),
    };
    prost_types::Struct { fields }
}

fn to_proto_value(value: &Value) -> prost_types::Value {
    use prost_types::value::Kind;
    let kind = match value {
        Value::Null => Kind::NullValue(0),
        Value::Bool(b) => Kind::BoolValue(*b),
        Value::Number(n) => Kind::NumberValue(n.as_f64().unwrap_or(0.0)),
        Value::String(s) => Kind::StringValue(s.clone()),
        Value::Array(items) => Kind::ListValue(prost_types::ListValue {
            values: items.iter().map(to_proto_value).collect(),
        }),
        Value::Object(_) => Kind::StructValue(to_struct(value)),
    };
    prost_types::Value { kind: Some(kind) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_broken_connection_is_retryable_and_a_refusal_is_not() {
        let broken =
            Infra::from_status("policy service", &tonic::Status::unknown("transport error"));
        assert!(broken.retryable);
        assert_eq!(broken.code, "upstream_unavailable");
        let down = Infra::from_status("policy service", &tonic::Status::unavailable("down"));
        assert!(down.retryable);
        let bug = Infra::from_status("policy service", &tonic::Status::unknown("panicked"));
        assert!(!bug.retryable);
        assert_eq!(bug.code, "upstream_error");
        let refused = Infra::from_status("policy service", &tonic::Status::invalid_argument("bad"));
        assert!(!refused.retryable);
        assert!(refused.message.contains("policy service"));
    }

    #[test]
    fn token_claims_are_read_without_verification() {
        let payload = base64::engine::general_purpose::URL_SAFE_NO_PAD
            .encode(br#"{"tools":["search_logs@1"],"max_calls":8,"sub":"x"}"#);
        let view = token_view(&format!("eyJhbGciOiJFZERTQSJ9.{payload}.c2ln")).unwrap();
        assert_eq!(view.tools, ["search_logs@1"]);
        assert_eq!(view.max_calls, 8);
        assert!(token_view("not-a-token").unwrap_err().contains("payload"));
        assert!(token_view("a.!!!.c").unwrap_err().contains("base64url"));
    }

    #[test]
    fn evidence_kind_is_split_off_the_arguments() {
        let (args, kind) =
            split_kind(&serde_json::json!({"metric": "m", EVIDENCE_KIND_ARG: "impact_metric"}));
        assert_eq!(args, serde_json::json!({"metric": "m"}));
        assert_eq!(kind.as_deref(), Some("impact_metric"));
        let (_, none) = split_kind(&serde_json::json!({"metric": "m"}));
        assert_eq!(none, None);
    }

    #[test]
    fn call_ids_become_safe_uri_segments() {
        assert_eq!(uri_segment("pool_exhaustion"), "pool_exhaustion");
        assert_eq!(uri_segment("call/../x y"), "call-..-x-y");
        assert_eq!(uri_segment(""), "call");
    }

    #[test]
    fn parameters_become_a_struct() {
        let s = to_struct(&serde_json::json!({"rule_id": "RC-4711", "n": 2, "ok": true, "l": [1]}));
        use prost_types::value::Kind;
        assert_eq!(
            s.fields["rule_id"].kind,
            Some(Kind::StringValue("RC-4711".into()))
        );
        assert_eq!(s.fields["n"].kind, Some(Kind::NumberValue(2.0)));
        assert_eq!(s.fields["ok"].kind, Some(Kind::BoolValue(true)));
        assert!(matches!(s.fields["l"].kind, Some(Kind::ListValue(_))));
        assert!(to_struct(&Value::Null).fields.is_empty());
    }
}
