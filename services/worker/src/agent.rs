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
//!
//! A provider that serves whole delegations (a remote agent, [`crate::a2a`]) takes the
//! place of the loop: the task goes to it as it is, and each artifact it answers with
//! is stored as evidence the same way and cited by the claims made of it (`remote`).
//!
//! The loop and its model calls are here; the tool calls are in `calls`, remote
//! delegations in `remote`, and the result is built by [`crate::report`].

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime};

use base64::Engine as _;
use convene_core::permissions::{TimeWindow, time_window_from_proto};
use convene_core::time::from_timestamp;
use convene_core::validate;
use convene_mesh::handles::{EvidenceHandle, PolicyHandle, SupervisorHandle};
use convene_proto::v1;
use tokio_util::sync::CancellationToken;
use tracing::Instrument as _;
use tracing::field::Empty;

use crate::models::ModelSettings;
use crate::profiles::Profile;
use crate::provider::{
    FinishReason, Message, ModelProvider, ModelRequest, ModelResponse, ProviderError, ToolCall,
    ToolSpec,
};
use crate::report::{
    self, Ending, FinalReport, Infra, LoopEnd, Progress, Reporter, SUBMIT_REPORT, ToolOutcome,
};
use crate::tools::{ToolRegistry, with_kinds_offered};

mod calls;
pub mod context;
mod remote;
pub mod turns;

/// Time kept back from the deadline to hand in a TIMED_OUT result before the deadline.
const RESULT_MARGIN: Duration = Duration::from_millis(200);

/// What the model is told about how a task ends.
const REPORT_INSTRUCTIONS: &str = "Investigate with the tools you are given. Every tool \
call returns an evidence_id for what it recorded. When you have what you need, end the task \
by calling submit_report: a summary, and claims that each cite in evidence_refs the \
evidence ids your tool calls returned. Do not answer in plain text. Propose actions; never \
perform them.";

/// One delegation to run.
#[derive(Debug, Clone)]
pub struct Assignment {
    /// The Delegation Contract (already validated).
    pub task: v1::DelegationTask,
    /// The task token.
    pub token: String,
    /// The task token as [`crate::guard::Guard::task_token`] accepted it.
    pub verified: crate::guard::Verified,
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
    /// Retries, prices and span content of model calls.
    pub models: Arc<ModelSettings>,
    /// The task-token check, repeated before every model turn and remote call.
    pub guard: crate::guard::Guard,
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
    verified: &'a crate::guard::Verified,
    audience: String,
    window: TimeWindow,
    scope: Option<v1::TaskScope>,
    callable: BTreeSet<String>,
    /// The tools the task token names (a tool outside them is denied by the policy
    /// service, which logs the decision).
    token_tools: BTreeSet<String>,
    max_tool_calls: u32,
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
        let ending = if let Some(injected) = self.profile.faults.fail_before_start(a.attempt) {
            Ending::InjectedFailure(injected)
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
        let profile = &self.profile.profile;
        let reporter = Reporter {
            worker_id: &self.worker_id,
            profile_id: &profile.id,
            profile_version: &profile.version,
            max_iterations: profile.max_iterations,
            faults: &self.profile.faults,
        };
        let result = report::task_result(&reporter, &a.task, a.attempt, ending, progress, started);
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

    /// The task's token still holds ([`crate::guard`]), or how the loop ends.
    async fn recheck_token(&self, ctx: &TaskContext<'_>) -> Result<(), LoopEnd> {
        match self.guard.recheck(ctx.verified).await {
            Ok(_) => Ok(()),
            Err(refused) => Err(LoopEnd::Infra(Infra {
                code: "token_refused",
                retryable: refused.code() == tonic::Code::Unavailable,
                message: format!(
                    "the task token no longer holds, so the worker stopped before asking the \
                     model again: {}",
                    refused.message()
                ),
            })),
        }
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
            verified: &a.verified,
            audience: format!("worker:{}", profile.id),
            window,
            scope: a.task.scope.clone(),
            callable,
            token_tools: claims.tools.into_iter().collect(),
            max_tool_calls,
        })
    }

    async fn run_loop(&self, ctx: &TaskContext<'_>, progress: &Mutex<Progress>) -> LoopEnd {
        if let Some(hold) = &self.profile.hold {
            hold.wait(&ctx.task.delegation_id).await;
        }
        self.profile.faults.before_loop().await;
        if let Some(remote) = self.provider.remote() {
            if let Err(refused) = self.recheck_token(ctx).await {
                return refused;
            }
            return self.run_remote(ctx, remote, progress).await;
        }
        let profile = &self.profile.profile;
        let budget = Budget::of(ctx.task);
        let mut specs: Vec<Arc<ToolSpec>> = ctx
            .callable
            .iter()
            .filter_map(|name| {
                let spec = self.tools.model_spec(name)?;
                // The kinds the profile (or the tool's catalog entry) declares are the
                // only ones offered.
                let declared = self.profile.evidence_kinds_of(name).or_else(|| {
                    self.tools
                        .get(name)
                        .map(|t| t.evidence_kinds())
                        .filter(|k| !k.is_empty())
                });
                Some(match declared {
                    Some(kinds) => Arc::new(with_kinds_offered(spec, kinds)),
                    None => Arc::clone(spec),
                })
            })
            .collect();
        specs.push(submit_report_spec());
        let system = format!("{}\n\n{REPORT_INSTRUCTIONS}", profile.instructions.trim());
        let mut messages = vec![Message::user(task_prompt(ctx))];
        let mut chain = turns::TurnChain::default();
        // The tokens the tools' definitions take in every request, for a model that has
        // a context window (a playbook has none).
        let window = self.provider.has_context_window().then(|| {
            (
                self.profile.context_window(),
                context::tools_estimate(&specs),
            )
        });
        for iteration in 1..=profile.max_iterations {
            let (used, cost) = {
                let mut p = lock(progress);
                p.iterations = iteration;
                (p.tokens, p.cost)
            };
            if let Some(spent) = budget.spent(used, cost) {
                return LoopEnd::Budget {
                    report: None,
                    detail: spent,
                };
            }
            let max_tokens = budget.answer_limit(profile.max_tokens, used);
            let limit = window.map_or(u64::MAX, |(window, tools)| {
                context::request_limit(window, max_tokens).saturating_sub(tools)
            });
            let fit = |force| context::Fit {
                turn: iteration,
                limit,
                system: &system,
                force,
            };
            // A token that expired or was revoked since the last turn stops the loop
            // before the model is asked again.
            if let Err(refused) = self.recheck_token(ctx).await {
                return refused;
            }
            if window.is_some()
                && context::estimate(&system, &messages) > limit
                && let Err(end) = self
                    .compact(ctx, &mut messages, &mut chain, fit(false), progress)
                    .await
            {
                return end;
            }
            let mut compacted_for_refusal = false;
            let (request, response) = loop {
                let request = ModelRequest {
                    model: profile.model.clone(),
                    system: system.clone(),
                    messages: messages.clone(),
                    tools: specs.clone(),
                    max_tokens,
                    temperature: profile.temperature,
                };
                match self.complete(&request).await {
                    Ok(r) => break (request, r),
                    // Refused as too long: compact once with both steps and ask again;
                    // refused again, the task cannot go on.
                    Err(e) if e.context_exceeded && !compacted_for_refusal => {
                        compacted_for_refusal = true;
                        tracing::info!(
                            delegation_id = %ctx.task.delegation_id,
                            turn = iteration,
                            error = %e,
                            "the model refused the request as too long; compacting"
                        );
                        if let Err(end) = self
                            .compact(ctx, &mut messages, &mut chain, fit(true), progress)
                            .await
                        {
                            return end;
                        }
                    }
                    Err(e) if e.context_exceeded => {
                        return LoopEnd::ContextExhausted(format!(
                            "the conversation does not fit the model's context window even \
                             compacted ({e}); raise the profile's context_window if the model \
                             has a larger one, or narrow the task"
                        ));
                    }
                    Err(e) => return LoopEnd::Provider(e),
                }
            };
            // Ids of their own, before the turn is recorded and its calls made.
            let response = calls::unique_call_ids(response, progress, iteration);
            let (used, cost) = self.charge(progress, &response);
            if self.provider.records_turns()
                && let Err(infra) = self
                    .record_turn(
                        ctx,
                        &mut chain,
                        (iteration, turns::TurnKind::Turn),
                        &request,
                        &response,
                    )
                    .await
            {
                return LoopEnd::Infra(infra);
            }
            let calls = response.message.tool_calls.clone();
            let finish = response.finish;
            messages.push(response.message);
            let (reports, tool_calls): (Vec<&ToolCall>, Vec<&ToolCall>) =
                calls.iter().partition(|c| c.name == SUBMIT_REPORT);
            if let Some(spent) = budget.spent(used, cost) {
                // Out of budget: a report handed in on this very turn still counts, if it
                // cites only evidence already recorded.
                let report = reports
                    .first()
                    .and_then(|c| FinalReport::from_arguments(&c.arguments).ok())
                    .filter(|r| report::check_citations(r, &lock(progress)).is_ok());
                return LoopEnd::Budget {
                    report,
                    detail: spent,
                };
            }
            if calls.is_empty() {
                messages.push(Message::user(if finish == FinishReason::Length {
                    format!(
                        "Your answer was cut off at the token limit. Call {SUBMIT_REPORT} with \
                         a shorter report, or a tool, instead."
                    )
                } else {
                    format!(
                        "You answered in plain text. Continue with tool calls, and end the \
                         task by calling {SUBMIT_REPORT}; plain text is not a report."
                    )
                }));
                continue;
            }
            let outcomes = futures::future::join_all(
                tool_calls.iter().map(|c| self.call_tool(ctx, c, progress)),
            )
            .await;
            let mut answers: Vec<(&str, String)> = Vec::with_capacity(calls.len());
            for (call, outcome) in tool_calls.iter().zip(outcomes) {
                match outcome {
                    Ok(o) => answers.push((&call.id, o.to_content())),
                    Err(infra) => return LoopEnd::Infra(infra),
                }
            }
            let mut accepted = None;
            for (i, call) in reports.iter().enumerate() {
                let outcome = if i > 0 {
                    ToolOutcome::failure(format!(
                        "only the first {SUBMIT_REPORT} call of a turn is read"
                    ))
                } else {
                    match FinalReport::from_arguments(&call.arguments)
                        .and_then(|r| report::check_citations(&r, &lock(progress)).map(|()| r))
                    {
                        Ok(r) => {
                            accepted = Some(r);
                            break;
                        }
                        Err(why) => {
                            tracing::info!(
                                delegation_id = %ctx.task.delegation_id,
                                error = %why,
                                "report not accepted; the model gets another turn"
                            );
                            ToolOutcome::failure(why)
                        }
                    }
                };
                answers.push((&call.id, outcome.to_content()));
            }
            if let Some(report) = accepted {
                return LoopEnd::Report(report);
            }
            // Answers in call order, as the API expects.
            for call in &calls {
                if let Some((_, content)) = answers.iter().find(|(id, _)| *id == call.id) {
                    messages.push(Message::tool_result(&call.id, content.clone()));
                }
            }
            if !tool_calls.is_empty()
                && let Some(injected) = self
                    .profile
                    .faults
                    .after_tools(ctx.attempt, self.exit_process, &profile.id)
                    .await
            {
                return LoopEnd::InjectedFailure(injected);
            }
        }
        LoopEnd::IterationLimit
    }

    /// Counts what `response` consumed against the task: its tokens, and their cost at
    /// the price of the model that answered (else the profile's). Returns the task's
    /// totals.
    fn charge(&self, progress: &Mutex<Progress>, response: &ModelResponse) -> (u64, f64) {
        let model = if response.model.is_empty() {
            &self.profile.profile.model
        } else {
            &response.model
        };
        let mut p = lock(progress);
        p.tokens = p.tokens.saturating_add(response.usage.total());
        p.cost += self.models.cost(model, response.usage);
        (p.tokens, p.cost)
    }

    /// A model call, retried with backoff and jitter while the error is transient
    /// (honouring the server's `Retry-After`); one `model.call` span with the
    /// OpenTelemetry GenAI attributes (`gen_ai.*`), retries included.
    pub(crate) async fn complete(
        &self,
        request: &ModelRequest,
    ) -> Result<ModelResponse, ProviderError> {
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
            gen_ai.provider.name = %provider,
            gen_ai.request.model = %model,
            gen_ai.request.max_tokens = request.max_tokens,
            gen_ai.request.temperature = request.temperature,
            gen_ai.response.model = Empty,
            gen_ai.usage.input_tokens = Empty,
            gen_ai.usage.output_tokens = Empty,
            gen_ai.response.finish_reasons = Empty,
            gen_ai.input.messages = Empty,
            gen_ai.output.messages = Empty,
            convene.model.tool_calls = Empty,
            convene.model.retries = Empty,
            error.type = Empty,
        );
        if self.models.record_content {
            span.record(
                "gen_ai.input.messages",
                serde_json::to_string(&request.messages).unwrap_or_default(),
            );
        }
        let mut tries = 0;
        let outcome = async {
            loop {
                match self.provider.complete(request).await {
                    Err(e) if e.retryable && tries < self.models.retries => {
                        tries += 1;
                        let pause = self.models.pause(tries, e.retry_after);
                        tracing::warn!(
                            provider = %e.provider,
                            error = %e.message,
                            tries,
                            pause_ms = u64::try_from(pause.as_millis()).unwrap_or(u64::MAX),
                            "model call failed, retrying"
                        );
                        tokio::time::sleep(pause).await;
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
                let answered_by = if response.model.is_empty() {
                    model
                } else {
                    response.model.as_str()
                };
                span.record("gen_ai.response.model", answered_by);
                span.record("gen_ai.usage.input_tokens", response.usage.input);
                span.record("gen_ai.usage.output_tokens", response.usage.output);
                span.record("gen_ai.response.finish_reasons", response.finish.as_str());
                span.record(
                    "convene.model.tool_calls",
                    response.message.tool_calls.len(),
                );
                if self.models.record_content {
                    span.record(
                        "gen_ai.output.messages",
                        serde_json::to_string(&response.message).unwrap_or_default(),
                    );
                }
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
}

/// The `submit_report` tool, built once.
fn submit_report_spec() -> Arc<ToolSpec> {
    static SPEC: std::sync::OnceLock<Arc<ToolSpec>> = std::sync::OnceLock::new();
    SPEC.get_or_init(|| Arc::new(FinalReport::tool_spec()))
        .clone()
}

/// A task's token and cost budget (0: unlimited).
struct Budget {
    tokens: u64,
    cost: f64,
}

impl Budget {
    fn of(task: &v1::DelegationTask) -> Self {
        let b = task.budget.as_ref();
        Self {
            tokens: b.map_or(0, |b| b.max_tokens),
            cost: b.map_or(0.0, |b| b.max_cost),
        }
    }

    /// Why the budget is spent, if it is.
    fn spent(&self, tokens: u64, cost: f64) -> Option<String> {
        if self.tokens > 0 && tokens >= self.tokens {
            Some(format!(
                "the task's token budget is spent ({tokens} of {} tokens used)",
                self.tokens
            ))
        } else if self.cost > 0.0 && cost >= self.cost {
            Some(format!(
                "the task's cost budget is spent ({cost:.4} of {:.4} used)",
                self.cost
            ))
        } else {
            None
        }
    }

    /// The most tokens the next answer may use: the profile's limit, and no more than
    /// the budget has left.
    fn answer_limit(&self, profile_limit: u32, used: u64) -> u32 {
        if self.tokens == 0 {
            return profile_limit;
        }
        let left = self.tokens.saturating_sub(used);
        u32::try_from(left).unwrap_or(u32::MAX).min(profile_limit)
    }
}

fn describe(set: &BTreeSet<String>) -> String {
    if set.is_empty() {
        "none".to_owned()
    } else {
        set.iter().cloned().collect::<Vec<_>>().join(", ")
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
pub(crate) struct TokenView {
    #[serde(default)]
    tools: Vec<String>,
    #[serde(default)]
    max_calls: u32,
    /// The run the token is bound to (`run`).
    #[serde(default)]
    pub(crate) run: String,
}

pub(crate) fn token_view(token: &str) -> Result<TokenView, String> {
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

#[cfg(test)]
mod tests {
    use super::*;

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
}
