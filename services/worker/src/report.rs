//! The structured messages a model exchanges with the agent loop: the outcome of a tool
//! call (the content of a tool message) and the final report (the arguments of the
//! [`SUBMIT_REPORT`] tool call that ends a task); and the [`v1::TaskResult`] the loop
//! hands in, built from how the task ended and what it did.
//!
//! Both are JSON, so the deterministic playbook and a hosted model speak the same
//! protocol, and the report's JSON schema is generated from [`FinalReport`], the type
//! that reads it. A report's claims cite evidence ids that this task's tool calls
//! returned (a call id also stands for its evidence); [`check_citations`] refuses a
//! report citing anything else, so a model can never cite evidence that was not
//! gathered in this task.
//!
//! The result: the claims and proposed actions of the report (if the loop got one),
//! every evidence record gathered, the usage (tokens and their cost), and the status
//! with its error ([`status_and_error`]): a report with claims is COMPLETED (PARTIAL
//! with missing evidence or when the model says so), every call denied is BLOCKED, the
//! deadline is TIMED_OUT, a spent budget is PARTIAL with the report's claims or else
//! FAILED (error code `BUDGET_EXHAUSTED`), and anything else is FAILED with a code
//! saying why (retryable when retrying may cure it).

use std::collections::HashMap;
use std::time::Instant;

use convene_core::permissions::RiskLevel;
use convene_proto::v1;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use tonic::Code;

use crate::faults::{Faults, Injected};
use crate::provider::{ProviderError, ToolSpec};

/// What a tool call came to, as the model reads it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolOutcome {
    /// Whether the call was authorized, ran and its evidence was recorded.
    pub success: bool,
    /// The evidence recorded for the call's output.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub evidence_id: Option<String>,
    /// The tool's output.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output: Option<Value>,
    /// Why the call failed: denied by policy, refused by the loop, or failed in the tool.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

impl ToolOutcome {
    /// A successful call.
    pub fn success(evidence_id: String, output: Value) -> Self {
        Self {
            success: true,
            evidence_id: Some(evidence_id),
            output: Some(output),
            error: None,
        }
    }

    /// A failed call and why.
    pub fn failure(error: impl Into<String>) -> Self {
        Self {
            success: false,
            evidence_id: None,
            output: None,
            error: Some(error.into()),
        }
    }

    /// The JSON text a tool message carries.
    pub fn to_content(&self) -> String {
        serde_json::to_string(self).unwrap_or_else(|e| {
            // Only non-string map keys can fail, and outcomes have none; say so rather
            // than panic if that ever changes.
            format!(r#"{{"success":false,"error":"unserializable tool outcome: {e}"}}"#)
        })
    }

    /// Reads the content of a tool message.
    ///
    /// # Errors
    ///
    /// The content is not a tool outcome.
    pub fn from_content(content: &str) -> Result<Self, serde_json::Error> {
        serde_json::from_str(content)
    }
}

/// The name of the tool a model ends its task with; its arguments are the
/// [`FinalReport`]. It is never authorized or recorded: the loop checks the report and
/// either ends the task with it or tells the model what to fix.
pub const SUBMIT_REPORT: &str = "submit_report";

/// How the model judges its own work.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum ReportStatus {
    /// The task is done: the claims answer it.
    #[default]
    Completed,
    /// Some of it is done: the claims stand, and `missing_evidence` names the rest.
    Partial,
    /// It could not be done; `summary` says why.
    Failed,
}

/// The model's final report: the arguments of [`SUBMIT_REPORT`].
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct FinalReport {
    /// How the task went (default `completed`).
    #[serde(default)]
    pub status: ReportStatus,
    /// A short summary of what was found.
    pub summary: String,
    /// Checkable claims, each citing evidence recorded in this task.
    #[serde(default)]
    pub claims: Vec<ReportClaim>,
    /// Actions recommended to people (never performed by the worker).
    #[serde(default)]
    pub proposed_actions: Vec<ReportAction>,
    /// Evidence that could not be gathered, named.
    #[serde(default)]
    pub missing_evidence: Vec<String>,
    /// Suggested next step.
    #[serde(default)]
    pub recommended_next: String,
}

/// One claim of a report.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ReportClaim {
    /// Id unique within the report; claims without one are numbered.
    #[serde(default)]
    pub claim_id: String,
    /// The key conflicts are found on, e.g. `primary_cause`.
    pub topic: String,
    /// Normalized value on the topic, e.g. `db_pool_exhaustion`.
    pub value: String,
    /// Human-readable statement.
    pub statement: String,
    /// The evidence ids the claim rests on, as tool calls returned them in
    /// `evidence_id` (a tool call's id also stands for the evidence it recorded).
    #[serde(default, alias = "evidence_from")]
    pub evidence_refs: Vec<String>,
    /// Confidence in `[0, 1]`.
    #[serde(default = "default_confidence")]
    pub confidence: f64,
}

/// One proposed action of a report.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ReportAction {
    /// Action name from the catalog, e.g. `rule:rollback`.
    pub action: String,
    /// Parameters, a JSON object.
    #[serde(default)]
    pub parameters: Value,
    /// Risk level `R0`..`R3` the model believes applies.
    pub risk_level: String,
    /// Why.
    #[serde(default)]
    pub rationale: String,
    /// The evidence ids that support it.
    #[serde(default, alias = "evidence_from")]
    pub evidence_refs: Vec<String>,
}

fn default_confidence() -> f64 {
    0.5
}

impl FinalReport {
    /// Reads a report from the arguments of a [`SUBMIT_REPORT`] call.
    ///
    /// # Errors
    ///
    /// The arguments are not a report; the message says what is wrong, for the model.
    pub fn from_arguments(arguments: &Value) -> Result<Self, String> {
        if let Value::String(raw) = arguments {
            return Err(format!(
                "the arguments of {SUBMIT_REPORT} are not a JSON object ({}); call it again \
                 with a JSON object matching its schema",
                crate::provider::clip(raw, 200)
            ));
        }
        Self::deserialize(arguments).map_err(|e| {
            format!(
                "the report does not match the {SUBMIT_REPORT} schema ({e}); call \
                 {SUBMIT_REPORT} again with status, summary, claims (topic, value, statement, \
                 evidence_refs, confidence), proposed_actions and missing_evidence"
            )
        })
    }

    /// The [`SUBMIT_REPORT`] tool as models are shown it; its schema is generated from
    /// [`FinalReport`], the type that reads its arguments.
    pub fn tool_spec() -> ToolSpec {
        let parameters = crate::tools::schema_of::<Self>();
        ToolSpec {
            name: SUBMIT_REPORT.to_owned(),
            description: "End the task by handing in the final report. Every claim must cite \
                          evidence_refs: evidence ids that tool calls of this task returned. \
                          Propose actions; never perform them."
                .to_owned(),
            parameters,
        }
    }
}

/// Checks that every evidence id `report` cites was recorded by this task's tool calls
/// (or names one of its successful calls).
///
/// # Errors
///
/// The message for the model: which ids are unknown, and which may be cited.
pub(crate) fn check_citations(report: &FinalReport, progress: &Progress) -> Result<(), String> {
    let mut known: Vec<&str> = Vec::new();
    for c in &progress.calls {
        if let CallState::Succeeded(e) = &c.state {
            known.push(e.evidence_id.as_str());
            known.push(c.call_id.as_str());
        }
    }
    let cited = report.claims.iter().flat_map(|c| &c.evidence_refs).chain(
        report
            .proposed_actions
            .iter()
            .flat_map(|a| &a.evidence_refs),
    );
    let mut unknown: Vec<&str> = Vec::new();
    for id in cited {
        if !known.contains(&id.as_str()) && !unknown.contains(&id.as_str()) {
            unknown.push(id);
        }
    }
    let uncited: Vec<&str> = report
        .claims
        .iter()
        .filter(|c| c.evidence_refs.is_empty())
        .map(|c| c.topic.as_str())
        .collect();
    if unknown.is_empty() && uncited.is_empty() {
        return Ok(());
    }
    let recorded: Vec<&str> = progress
        .calls
        .iter()
        .filter_map(|c| match &c.state {
            CallState::Succeeded(e) => Some(e.evidence_id.as_str()),
            _ => None,
        })
        .collect();
    let recorded = if recorded.is_empty() {
        "none yet: call a tool first".to_owned()
    } else {
        recorded.join(", ")
    };
    let mut problems = Vec::new();
    if !unknown.is_empty() {
        problems.push(format!(
            "evidence {} was not recorded in this task",
            unknown.join(", ")
        ));
    }
    if !uncited.is_empty() {
        problems.push(format!(
            "the claims on {} cite no evidence",
            uncited.join(", ")
        ));
    }
    Err(format!(
        "report not accepted: {}. Cite only evidence ids your tool calls returned \
         (recorded: {recorded}), drop claims you cannot support, and call {SUBMIT_REPORT} \
         again.",
        problems.join("; ")
    ))
}

// ---------------------------------------------------------------------------------------
// The task result.

/// What happened to one tool call.
#[derive(Debug, Clone)]
pub(crate) enum CallState {
    Running,
    Succeeded(Box<v1::Evidence>),
    /// Refused by the loop or denied by the policy service: a permission problem.
    Denied(String),
    /// Bad arguments, missing data, budget used up.
    Failed(String),
}

/// One tool call of the task and what became of it.
#[derive(Debug, Clone)]
pub(crate) struct CallRecord {
    pub(crate) call_id: String,
    pub(crate) state: CallState,
}

/// What the task has done so far; read for the result whichever way the task ends.
#[derive(Debug, Default)]
pub(crate) struct Progress {
    pub(crate) iterations: u32,
    pub(crate) tool_calls: u32,
    pub(crate) tokens: u64,
    pub(crate) cost: f64,
    pub(crate) calls: Vec<CallRecord>,
}

/// A failure of the mesh (not of a tool): ends the task.
#[derive(Debug, Clone)]
pub(crate) struct Infra {
    pub(crate) code: &'static str,
    pub(crate) retryable: bool,
    pub(crate) message: String,
}

impl Infra {
    pub(crate) fn from_status(service: &str, status: &tonic::Status) -> Self {
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

/// How the loop ended on its own.
pub(crate) enum LoopEnd {
    Report(FinalReport),
    IterationLimit,
    /// The task's token or cost budget is spent; the report, when the last turn handed
    /// in one that checks out.
    Budget {
        report: Option<FinalReport>,
        detail: String,
    },
    Provider(ProviderError),
    /// The conversation does not fit the model's context window, even compacted.
    ContextExhausted(String),
    Infra(Infra),
    /// The `fail_attempts_after_tools` fault, after the first round of tool calls.
    InjectedFailure(Injected),
}

/// How the task ended.
pub(crate) enum Ending {
    Loop(LoopEnd),
    TimedOut,
    Cancelled(String),
    Blocked(String),
    /// The `fail_attempts` fault, before the task started.
    InjectedFailure(Injected),
}

/// Who reports a result: the worker and the profile that ran the task.
pub(crate) struct Reporter<'a> {
    pub(crate) worker_id: &'a str,
    pub(crate) profile_id: &'a str,
    pub(crate) profile_version: &'a str,
    /// The profile's iteration limit, named when the loop hit it.
    pub(crate) max_iterations: u32,
    pub(crate) faults: &'a Faults,
}

/// What the task's tool calls came to.
struct Gathered<'a> {
    /// The evidence recorded, each record once, in call order.
    evidence: Vec<v1::Evidence>,
    /// Evidence id by call id, for the calls that succeeded.
    by_call: HashMap<&'a str, &'a str>,
    /// Ids of the calls that did not succeed.
    not_gathered: Vec<String>,
    /// Why calls were denied.
    denials: Vec<&'a str>,
    /// Whether there were calls and every one was denied.
    all_denied: bool,
    /// Every call that did not succeed, and why.
    failures: Vec<String>,
    /// "N tool call(s), M evidence record(s) gathered".
    summary: String,
}

impl<'a> Gathered<'a> {
    fn new(progress: &'a Progress) -> Self {
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
        let summary = format!(
            "{} tool call(s), {} evidence record(s) gathered",
            progress.calls.len(),
            evidence.len()
        );
        Self {
            evidence,
            by_call,
            not_gathered,
            denials,
            all_denied,
            failures,
            summary,
        }
    }

    /// The evidence ids a report's `evidence_from` (call ids, or evidence ids) cites.
    fn cite(&self, from: &[String]) -> Vec<String> {
        let mut refs: Vec<String> = Vec::new();
        for f in from {
            let id = self
                .by_call
                .get(f.as_str())
                .map(|id| (*id).to_owned())
                .or_else(|| {
                    self.evidence
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
    }
}

/// Builds the result of attempt `attempt` of `task` from how it ended and what it did.
pub(crate) fn task_result(
    by: &Reporter<'_>,
    task: &v1::DelegationTask,
    attempt: u32,
    ending: Ending,
    progress: Progress,
    started: Instant,
) -> v1::TaskResult {
    let gathered = Gathered::new(&progress);
    let mut result = v1::TaskResult {
        delegation_id: task.delegation_id.clone(),
        worker_id: by.worker_id.to_owned(),
        profile_id: by.profile_id.to_owned(),
        profile_version: by.profile_version.to_owned(),
        ..v1::TaskResult::default()
    };
    if let Ending::Loop(
        LoopEnd::Report(report)
        | LoopEnd::Budget {
            report: Some(report),
            ..
        },
    ) = &ending
    {
        add_report(&mut result, report, &gathered);
    }
    let (status, error) = status_and_error(&ending, &result, &gathered, by.max_iterations, attempt);
    if result.summary.is_empty() {
        result.summary = match &error {
            Some(e) => format!("{}: {}", e.code, e.message),
            None => gathered.summary.clone(),
        };
    }
    if status != v1::TaskStatus::Completed && status != v1::TaskStatus::Partial {
        for m in &gathered.not_gathered {
            if !result.missing_evidence.contains(m) {
                result.missing_evidence.push(m.clone());
            }
        }
    }
    result.status = status as i32;
    result.error = error;
    result.artifacts = gathered
        .evidence
        .iter()
        .map(|e| e.artifact_uri.clone())
        .filter(|u| !u.is_empty())
        .fold(Vec::new(), |mut acc, u| {
            if !acc.contains(&u) {
                acc.push(u);
            }
            acc
        });
    result.evidence = gathered.evidence;
    result.usage = Some(v1::Usage {
        iterations: progress.iterations,
        tool_calls: progress.tool_calls,
        tokens: progress.tokens,
        cost: progress.cost,
        duration_ms: u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX),
    });
    by.faults.tamper(&mut result);
    result
}

/// Puts the model's final report into the result: claims and proposed actions citing
/// the evidence recorded, summary, next step, and the evidence the report names as
/// missing.
fn add_report(result: &mut v1::TaskResult, report: &FinalReport, gathered: &Gathered<'_>) {
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
            evidence_refs: gathered.cite(&c.evidence_refs),
            confidence: c.confidence.clamp(0.0, 1.0),
        })
        .collect();
    result.proposed_actions = report
        .proposed_actions
        .iter()
        .map(|p| v1::ProposedAction {
            action: p.action.clone(),
            parameters: Some(convene_proto::json::to_struct(&p.parameters)),
            risk_level: RiskLevel::parse(&p.risk_level)
                .map_or(v1::RiskLevel::Unspecified, RiskLevel::to_proto)
                as i32,
            rationale: p.rationale.clone(),
            evidence_refs: gathered.cite(&p.evidence_refs),
        })
        .collect();
    result.summary = report.summary.clone();
    result.recommended_next = report.recommended_next.clone();
    // The report names what is missing: a call that failed may have been corrected
    // and made again (a model's malformed arguments), so failed calls are not missing
    // evidence by themselves.
    for m in &report.missing_evidence {
        if !result.missing_evidence.contains(m) {
            result.missing_evidence.push(m.clone());
        }
    }
}

/// The status of a task that ended as `ending`, and its error unless it succeeded.
/// `result` already holds the report's claims and missing evidence, if there was one.
fn status_and_error(
    ending: &Ending,
    result: &v1::TaskResult,
    gathered: &Gathered<'_>,
    max_iterations: u32,
    attempt: u32,
) -> (v1::TaskStatus, Option<v1::ErrorInfo>) {
    let done = &gathered.summary;
    match ending {
        Ending::Loop(LoopEnd::Report(report)) => {
            if report.status == ReportStatus::Failed {
                (
                    v1::TaskStatus::Failed,
                    Some(error(
                        "reported_failure",
                        false,
                        format!("the agent reports failure: {} ({done})", report.summary),
                    )),
                )
            } else if gathered.all_denied {
                (v1::TaskStatus::Blocked, Some(blocked(&gathered.denials)))
            } else if result.claims.is_empty() {
                (
                    v1::TaskStatus::Failed,
                    Some(error(
                        "no_findings",
                        false,
                        format!(
                            "the investigation produced no claim ({done}); failed calls: {}",
                            describe_list(&gathered.failures)
                        ),
                    )),
                )
            } else if result.missing_evidence.is_empty() && report.status == ReportStatus::Completed
            {
                (v1::TaskStatus::Completed, None)
            } else {
                (v1::TaskStatus::Partial, None)
            }
        }
        Ending::Loop(LoopEnd::IterationLimit) if gathered.all_denied => {
            (v1::TaskStatus::Blocked, Some(blocked(&gathered.denials)))
        }
        Ending::Loop(LoopEnd::IterationLimit) => (
            v1::TaskStatus::Failed,
            Some(error(
                "iteration_limit",
                false,
                format!(
                    "no final report within {max_iterations} iterations ({done}); raise the \
                     profile's max_iterations or narrow the task"
                ),
            )),
        ),
        Ending::Loop(LoopEnd::Budget { detail, .. }) => (
            if result.claims.is_empty() {
                v1::TaskStatus::Failed
            } else {
                v1::TaskStatus::Partial
            },
            Some(error(
                BUDGET_EXHAUSTED,
                false,
                format!("{detail}; the task ended with the evidence it had ({done})"),
            )),
        ),
        Ending::Loop(LoopEnd::Provider(e)) => (
            v1::TaskStatus::Failed,
            Some(error("model_error", e.retryable, e.to_string())),
        ),
        Ending::Loop(LoopEnd::ContextExhausted(detail)) => (
            v1::TaskStatus::Failed,
            Some(error(
                CONTEXT_EXHAUSTED,
                false,
                format!("{detail}; the task ended with the evidence it had ({done})"),
            )),
        ),
        Ending::Loop(LoopEnd::Infra(infra)) => (
            v1::TaskStatus::Failed,
            Some(error(infra.code, infra.retryable, infra.message.clone())),
        ),
        Ending::TimedOut => (
            v1::TaskStatus::TimedOut,
            Some(error(
                "timeout",
                false,
                format!("the task deadline passed before the investigation finished; {done}"),
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
            Some(error("permission_denied", false, reason.clone())),
        ),
        Ending::InjectedFailure(injected) => {
            (v1::TaskStatus::Failed, Some(injected.error(attempt, "")))
        }
        Ending::Loop(LoopEnd::InjectedFailure(injected)) => {
            (v1::TaskStatus::Failed, Some(injected.error(attempt, done)))
        }
    }
}

/// The error code of a task whose token or cost budget ran out.
pub const BUDGET_EXHAUSTED: &str = "BUDGET_EXHAUSTED";

/// The error code of a task whose conversation no longer fits its model's context
/// window, even compacted.
pub const CONTEXT_EXHAUSTED: &str = "CONTEXT_EXHAUSTED";

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

fn describe_list(items: &[String]) -> String {
    if items.is_empty() {
        "none".to_owned()
    } else {
        items.join(", ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outcomes_round_trip_through_message_content() {
        let ok = ToolOutcome::success("logs://a/d/s".into(), serde_json::json!({"matched": 3}));
        let back = ToolOutcome::from_content(&ok.to_content()).unwrap();
        assert_eq!(back, ok);
        let failed = ToolOutcome::failure("denied by policy");
        let text = failed.to_content();
        assert!(!text.contains("output"), "{text}");
        assert_eq!(ToolOutcome::from_content(&text).unwrap(), failed);
    }

    #[test]
    fn reports_are_read_from_submit_report_arguments() {
        let args = serde_json::json!({"summary": "s", "claims": [
            {"topic": "t", "value": "v", "statement": "x"}]});
        let report = FinalReport::from_arguments(&args).unwrap();
        assert_eq!(report.claims[0].confidence, 0.5);
        assert_eq!(report.status, ReportStatus::Completed);
        assert!(report.claims[0].evidence_refs.is_empty());
        let err = FinalReport::from_arguments(&Value::String("{oops".into())).unwrap_err();
        assert!(err.contains("not a JSON object"), "{err}");
        let err = FinalReport::from_arguments(&serde_json::json!({"claims": []})).unwrap_err();
        assert!(err.contains("summary"), "{err}");
        // The schema the model sees comes from the same type.
        let spec = FinalReport::tool_spec();
        assert_eq!(spec.name, SUBMIT_REPORT);
        let props = &spec.parameters["properties"];
        for key in ["status", "summary", "claims", "missing_evidence"] {
            assert!(
                props.get(key).is_some(),
                "{key} missing from {}",
                spec.parameters
            );
        }
        assert_eq!(spec.parameters["required"], serde_json::json!(["summary"]));
        let claim = &props["claims"]["items"];
        assert!(claim["properties"]["evidence_refs"].is_object(), "{claim}");
    }

    #[test]
    fn citations_must_name_evidence_recorded_in_the_task() {
        let progress = Progress {
            calls: vec![succeeded("errors")],
            ..Progress::default()
        };
        let cite = |refs: &[&str]| FinalReport {
            summary: "s".into(),
            claims: vec![ReportClaim {
                claim_id: String::new(),
                topic: "cause".into(),
                value: "v".into(),
                statement: "x".into(),
                evidence_refs: refs.iter().map(|r| (*r).to_owned()).collect(),
                confidence: 0.9,
            }],
            ..FinalReport::default()
        };
        check_citations(&cite(&["logs://api/run/del-1/errors"]), &progress).unwrap();
        check_citations(&cite(&["errors"]), &progress).unwrap();
        let err = check_citations(&cite(&["logs://made/up"]), &progress).unwrap_err();
        assert!(err.contains("logs://made/up"), "{err}");
        assert!(err.contains("logs://api/run/del-1/errors"), "{err}");
        let err = check_citations(&cite(&[]), &progress).unwrap_err();
        assert!(err.contains("cause"), "{err}");
    }

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

    fn result_of(ending: Ending, calls: Vec<CallRecord>) -> v1::TaskResult {
        let faults = Faults::default();
        let by = Reporter {
            worker_id: "worker-1",
            profile_id: "logs-investigator",
            profile_version: "1",
            max_iterations: 12,
            faults: &faults,
        };
        let task = v1::DelegationTask {
            delegation_id: "del-1".into(),
            ..v1::DelegationTask::default()
        };
        let progress = Progress {
            calls,
            ..Progress::default()
        };
        task_result(&by, &task, 1, ending, progress, Instant::now())
    }

    fn succeeded(call_id: &str) -> CallRecord {
        CallRecord {
            call_id: call_id.into(),
            state: CallState::Succeeded(Box::new(v1::Evidence {
                evidence_id: format!("logs://api/run/del-1/{call_id}"),
                ..v1::Evidence::default()
            })),
        }
    }

    #[test]
    fn action_parameters_become_a_struct_without_loss() {
        use prost_types::value::Kind;
        let report = FinalReport {
            summary: "s".into(),
            claims: vec![ReportClaim {
                claim_id: String::new(),
                topic: "t".into(),
                value: "v".into(),
                statement: "x".into(),
                evidence_refs: vec!["errors".into()],
                confidence: 1.5,
            }],
            proposed_actions: [
                serde_json::json!({"rule_id": "RC-4711", "n": 2, "ok": true, "l": [1]}),
                serde_json::json!("RC-4711"),
                Value::Null,
            ]
            .into_iter()
            .map(|parameters| ReportAction {
                action: "rule:rollback".into(),
                parameters,
                risk_level: "R3".into(),
                rationale: String::new(),
                evidence_refs: vec!["errors".into()],
            })
            .collect(),
            ..FinalReport::default()
        };
        let result = result_of(
            Ending::Loop(LoopEnd::Report(report)),
            vec![succeeded("errors")],
        );
        assert_eq!(result.status, v1::TaskStatus::Completed as i32);
        assert_eq!(result.claims[0].claim_id, "claim-1");
        assert_eq!(result.claims[0].confidence, 1.0);
        assert_eq!(
            result.claims[0].evidence_refs,
            ["logs://api/run/del-1/errors"]
        );
        let params: Vec<&prost_types::Struct> = result
            .proposed_actions
            .iter()
            .map(|a| a.parameters.as_ref().unwrap())
            .collect();
        let s = params[0];
        assert_eq!(
            s.fields["rule_id"].kind,
            Some(Kind::StringValue("RC-4711".into()))
        );
        assert_eq!(s.fields["n"].kind, Some(Kind::NumberValue(2.0)));
        assert_eq!(s.fields["ok"].kind, Some(Kind::BoolValue(true)));
        assert!(matches!(s.fields["l"].kind, Some(Kind::ListValue(_))));
        // Parameters that are not an object are kept, under `value`.
        assert_eq!(
            params[1].fields["value"].kind,
            Some(Kind::StringValue("RC-4711".into()))
        );
        assert_eq!(params[2].fields["value"].kind, Some(Kind::NullValue(0)));
    }

    #[test]
    fn endings_map_to_a_status_and_an_error() {
        let denied = || CallRecord {
            call_id: "errors".into(),
            state: CallState::Denied("denied by policy".into()),
        };
        let status = |r: &v1::TaskResult| v1::TaskStatus::try_from(r.status).unwrap();
        let code = |r: &v1::TaskResult| r.error.as_ref().map(|e| e.code.clone());

        let blocked = result_of(Ending::Loop(LoopEnd::IterationLimit), vec![denied()]);
        assert_eq!(status(&blocked), v1::TaskStatus::Blocked);
        assert_eq!(code(&blocked).as_deref(), Some("permission_denied"));
        assert_eq!(blocked.missing_evidence, ["errors"]);

        let limit = result_of(Ending::Loop(LoopEnd::IterationLimit), vec![]);
        assert_eq!(status(&limit), v1::TaskStatus::Failed);
        assert!(
            limit
                .error
                .unwrap()
                .message
                .contains("within 12 iterations")
        );

        let no_claims = result_of(
            Ending::Loop(LoopEnd::Report(FinalReport::default())),
            vec![succeeded("errors")],
        );
        assert_eq!(code(&no_claims).as_deref(), Some("no_findings"));
        assert!(
            no_claims.summary.starts_with("no_findings: "),
            "{}",
            no_claims.summary
        );

        let timed_out = result_of(Ending::TimedOut, vec![succeeded("errors")]);
        assert_eq!(status(&timed_out), v1::TaskStatus::TimedOut);
        assert_eq!(timed_out.evidence.len(), 1);

        let infra = Infra::from_status("evidence store", &tonic::Status::unavailable("down"));
        let failed = result_of(Ending::Loop(LoopEnd::Infra(infra)), vec![]);
        assert_eq!(code(&failed).as_deref(), Some("upstream_unavailable"));
        assert!(failed.error.unwrap().retryable);

        let cancelled = result_of(Ending::Cancelled("superseded".into()), vec![]);
        assert!(cancelled.error.unwrap().message.ends_with("superseded"));
    }
}
