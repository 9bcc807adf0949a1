//! The agent loop's tool calls: the task's limits and grants checked, the policy
//! service asked, the tool run, and its output stored with its evidence record (or an
//! identical record of an earlier execution reused).

use std::collections::BTreeSet;
use std::sync::Mutex;
use std::time::SystemTime;

use convene_core::ids::content_hash;
use convene_core::time::to_timestamp;
use convene_mesh::auth;
use convene_proto::v1;
use serde_json::Value;
use tonic::Code;
use tracing::Instrument as _;
use tracing::field::Empty;

use super::{Agent, TaskContext, describe, lock};
use crate::provider::{ModelResponse, ToolCall};
use crate::report::{CallRecord, CallState, Infra, Progress, ToolOutcome};
use crate::tools::{PreparedCall, ToolEnv, ToolError, canonical_json, choose_kind, split_kind};

/// Why a tool call did not succeed.
pub(super) enum CallError {
    Denied(String),
    Failed(String),
    Infra(Infra),
}

impl Agent {
    /// One tool call, recorded in `progress` and as a `tool.call` span (tool and
    /// version, argument fingerprint, authorization decision, error code; failed unless
    /// the call succeeded); `Err` only for mesh failures.
    pub(super) async fn call_tool(
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
                canonical_json(&call.arguments).as_bytes()
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
                describe(&ctx.callable)
            ))
        })?;
        if !call.arguments.is_object() {
            let written = match &call.arguments {
                Value::String(raw) => raw.clone(),
                other => other.to_string(),
            };
            return Err(CallError::Failed(format!(
                "the arguments of {} are not a JSON object ({}); call it again with a JSON \
                 object matching its schema",
                call.name,
                crate::provider::clip(&written, 200)
            )));
        }
        let granted = ctx.callable.contains(&call.name);
        // A tool the token does not name goes to the policy service all the same, which
        // denies it and logs the decision; one the token names but the profile or the
        // task does not is refused here.
        if !granted && ctx.token_tools.contains(&call.name) {
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
        let (args, named_kind) = split_kind(&call.arguments);
        let prepared = tool
            .prepare(&args, &ctx.window)
            .map_err(|e| CallError::Failed(e.to_string()))?;
        // The kind is chosen before anything is asked or read: a kind the tool may not
        // record is refused like a tool the task may not call.
        let allowed = self
            .profile
            .evidence_kinds_of(&call.name)
            .unwrap_or_else(|| tool.evidence_kinds());
        let (kind, kind_defaulted) =
            choose_kind(&call.name, named_kind, allowed, prepared.default_kind)
                .map_err(|refusal| {
                    let span = tracing::Span::current();
                    span.record("convene.authz.decision", "deny");
                    span.record("convene.authz.reason", "EVIDENCE_KIND_NOT_ALLOWED");
                    CallError::Denied(refusal)
                })?
                .into_parts();
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
        if !granted {
            // The policy service allowed what the task may not call: refuse all the same.
            tracing::Span::current().record("convene.authz.decision", "deny");
            return Err(CallError::Denied(format!(
                "tool {} is not granted to this task (callable: {})",
                call.name,
                describe(&ctx.callable)
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
            kind,
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
            kind_defaulted,
        };
        let stored = self.store(ctx, record, output.bytes, tool_call_id).await?;
        Ok((stored, output.value))
    }

    /// Stores the output and its evidence in one call; reuses an identical record a
    /// previous execution stored.
    pub(super) async fn store(
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
}

/// Gives every tool call of `response` (turn `turn`) an id that no earlier call of the
/// task and no other call of the answer has: an empty or repeated id becomes
/// `call-<turn>-<index>`. A call's evidence id is made of its id, so without this a model
/// that reuses ids (a server numbering each answer's calls from 0, a model repeating
/// itself) would find a later call's evidence refused as a conflicting record, and two
/// calls of one answer would share one answer.
pub(super) fn unique_call_ids(
    mut response: ModelResponse,
    progress: &Mutex<Progress>,
    turn: u32,
) -> ModelResponse {
    let mut seen: BTreeSet<String> = lock(progress)
        .calls
        .iter()
        .map(|c| c.call_id.clone())
        .collect();
    for (i, call) in response.message.tool_calls.iter_mut().enumerate() {
        if call.id.trim().is_empty() || seen.contains(&call.id) {
            let mut id = format!("call-{turn}-{i}");
            let mut n = 2;
            while seen.contains(&id) {
                id = format!("call-{turn}-{i}-{n}");
                n += 1;
            }
            call.id = id;
        }
        seen.insert(call.id.clone());
    }
    response
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
        | ToolError::Refused { .. }
        | ToolError::Failed { .. } => CallError::Failed(e.to_string()),
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn call_ids_become_safe_uri_segments() {
        assert_eq!(uri_segment("pool_exhaustion"), "pool_exhaustion");
        assert_eq!(uri_segment("call/../x y"), "call-..-x-y");
        assert_eq!(uri_segment(""), "call");
    }

    #[test]
    fn empty_and_reused_call_ids_get_ids_of_their_own() {
        use crate::provider::{FinishReason, Message, TokenUsage};
        let call = |id: &str| ToolCall {
            id: id.to_owned(),
            name: "search_logs@1".to_owned(),
            arguments: Value::Null,
        };
        let progress = Mutex::new(Progress::default());
        lock(&progress).calls.push(CallRecord {
            call_id: "call_0".to_owned(),
            state: CallState::Running,
        });
        lock(&progress).calls.push(CallRecord {
            call_id: "call-3-1".to_owned(),
            state: CallState::Running,
        });
        let response = ModelResponse {
            model: String::new(),
            message: Message::tool_calls(vec![
                call("call_0"),
                call(""),
                call("fresh"),
                call("fresh"),
            ]),
            finish: FinishReason::ToolCalls,
            usage: TokenUsage::default(),
        };
        let response = unique_call_ids(response, &progress, 3);
        let ids: Vec<&str> = response
            .message
            .tool_calls
            .iter()
            .map(|c| c.id.as_str())
            .collect();
        // Reused from an earlier turn, empty, and repeated in the answer: replaced; an
        // id already taken by the replacement rule gets a suffix.
        assert_eq!(ids, ["call-3-0", "call-3-1-2", "fresh", "call-3-3"]);
    }
}
