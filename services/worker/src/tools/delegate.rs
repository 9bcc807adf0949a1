//! `delegate@1`: hands parts of the task to other workers through the supervisor and
//! returns their outcomes, in the order they were asked for.
//!
//! The call is `Supervisor.Delegate` with the task token as the bearer credential, so the
//! supervisor knows which delegation delegates and the policy service derives every
//! child token from this one: children can only narrow what the task holds. Whether the
//! task may delegate at all (`may_redelegate`), how deep (`max_depth`) and how wide
//! (`max_parallel_workers` and the overflow mode) is the supervisor's decision; a
//! refusal comes back as a failed tool outcome carrying the supervisor's message word
//! for word (e.g. "… handle this task yourself instead of delegating"), which the model
//! reads and the result reports.
//!
//! Like every tool, the call is authorized first (`delegation:create` on `delegation`;
//! the row limit of the data scope is the number of children asked for), and its
//! output — a JSON summary of the outcomes — is stored as an artifact with evidence
//! `delegations://run/<run id>/<delegation>/<call>`, so claims built on the children's
//! findings cite it.

use std::collections::BTreeSet;

use convene_core::permissions::{TimeWindow, time_window_to_proto};
use convene_core::validate;
use convene_mesh::auth;
use convene_proto::v1;
use serde::Deserialize;
use serde_json::{Value, json};
use tonic::Code;

use super::{PreparedCall, Tool, ToolEnv, ToolError, ToolOutput, parse_args};
use crate::provider::ToolSpec;

const NAME: &str = "delegate@1";
/// The action a call performs, as the policy catalog names it.
pub const ACTION: &str = "delegation:create";
/// The resource a call touches.
pub const RESOURCE: &str = "delegation";
/// The evidence scheme of its outputs.
pub const EVIDENCE_SCHEME: &str = "delegations";
/// Children one call may ask for at most; the run's width limit decides how many run.
pub const MAX_CHILDREN: usize = 64;
const SERVICE: &str = "supervisor";

/// `delegate@1`. Resource `delegation`, action `delegation:create`; the output is the
/// children's outcomes in call order.
#[derive(Debug, Clone, Copy, Default)]
pub struct Delegate;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Args {
    #[serde(default)]
    delegations: Vec<Value>,
}

#[async_trait::async_trait]
impl Tool for Delegate {
    fn name(&self) -> &str {
        NAME
    }

    fn spec(&self) -> ToolSpec {
        ToolSpec {
            name: NAME.to_owned(),
            description: "Hand parts of the task to specialist workers and wait for their \
                          results. Each delegation names a worker profile, a goal, a scope \
                          and the scopes it needs; a child can only get a subset of what this \
                          task holds. A delegation that leaves out its scope gets this task's, \
                          one that leaves out required_scopes gets what its profile's tools \
                          need within what this task holds, one that leaves out \
                          acceptance_criteria gets the profile's description; each outcome \
                          lists the defaults applied. A delegation whose profile could use \
                          none of its tools under those permissions is refused. Returns one \
                          outcome per delegation, in the order asked: \
                          its status, summary and claims, or why it did not run (dropped by \
                          the width limit). When the call is refused (too deep, too wide, not \
                          allowed to delegate, wider scopes than this task holds), the error \
                          says why: then handle the task yourself."
                .to_owned(),
            parameters: json!({
                "type": "object",
                "required": ["delegations"],
                "properties": {
                    "delegations": {
                        "type": "array",
                        "minItems": 1,
                        "maxItems": MAX_CHILDREN,
                        "description": "Child tasks in call order, each a convene.v1.PlannedDelegation in the protobuf JSON mapping.",
                        "items": {
                            "type": "object",
                            "required": ["name", "profile_id", "goal"],
                            "properties": {
                                "name": { "type": "string", "description": "Unique within the call, [a-z0-9_-]{1,64}." },
                                "profile_id": { "type": "string", "description": "Worker profile to run it, e.g. logs-investigator." },
                                "goal": { "type": "string" },
                                "acceptance_criteria": { "type": "array", "items": { "type": "string" } },
                                "scope": {
                                    "type": "object",
                                    "description": "Resources and time window; the window defaults to this task's.",
                                    "properties": {
                                        "resources": { "type": "array", "items": { "type": "string" } },
                                        "time_range": {
                                            "type": "object",
                                            "properties": {
                                                "start": { "type": "string", "format": "date-time" },
                                                "end": { "type": "string", "format": "date-time" }
                                            }
                                        }
                                    }
                                },
                                "required_scopes": {
                                    "type": "array",
                                    "items": {
                                        "type": "object",
                                        "required": ["action", "resource"],
                                        "properties": {
                                            "action": { "type": "string" },
                                            "resource": { "type": "string" }
                                        }
                                    }
                                },
                                "allowed_tools": { "type": "array", "items": { "type": "string" } },
                                "timeout": { "type": "string", "description": "e.g. \"10s\"; default: what this task has left." },
                                "may_redelegate": { "type": "boolean" }
                            }
                        }
                    }
                },
                "additionalProperties": false
            }),
        }
    }

    fn prepare(&self, args: &Value, scope: &TimeWindow) -> Result<PreparedCall, ToolError> {
        let a: Args = parse_args(NAME, args)?;
        let invalid = |detail: String| ToolError::InvalidArguments {
            tool: NAME.into(),
            detail,
        };
        if a.delegations.is_empty() {
            return Err(invalid(
                "delegations must list at least one child task".to_owned(),
            ));
        }
        if a.delegations.len() > MAX_CHILDREN {
            return Err(invalid(format!(
                "{} delegations in one call; ask for at most {MAX_CHILDREN}",
                a.delegations.len()
            )));
        }
        let mut names = BTreeSet::new();
        let mut normalized = Vec::with_capacity(a.delegations.len());
        for (i, value) in a.delegations.iter().enumerate() {
            let field = format!("delegations[{i}]");
            let mut child = planned(value).map_err(|e| invalid(format!("{field}: {e}")))?;
            inherit_window(&mut child, scope);
            let checked =
                validate::planned_task(&child, &field).map_err(|e| invalid(e.to_string()))?;
            if !names.insert(checked.name.clone()) {
                return Err(invalid(format!(
                    "{field}.name: {} is used twice in this call; give every child its own name",
                    checked.name
                )));
            }
            normalized.push(
                convene_proto::json::to_value(&child)
                    .map_err(|e| invalid(format!("{field}: {e}")))?,
            );
        }
        Ok(PreparedCall {
            tool: NAME.to_owned(),
            action: ACTION.to_owned(),
            resource: RESOURCE.to_owned(),
            window: *scope,
            max_rows: normalized.len() as u64,
            scheme: EVIDENCE_SCHEME,
            subject: "run".to_owned(),
            source: "supervisor.delegate".to_owned(),
            default_kind: "delegation_outcomes",
            args: json!({ "delegations": normalized }),
        })
    }

    async fn run(&self, call: &PreparedCall, env: &ToolEnv<'_>) -> Result<ToolOutput, ToolError> {
        let Some(supervisor) = env.supervisor else {
            return Err(ToolError::Unavailable {
                tool: NAME.into(),
                service: SERVICE,
                detail: "this worker was started without a supervisor to delegate through; \
                         give it one (supervisor_endpoint, or WorkerService::with_supervisor)"
                    .to_owned(),
            });
        };
        let a: Args = parse_args(NAME, &call.args)?;
        let delegations = a
            .delegations
            .iter()
            .map(planned)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|detail| ToolError::InvalidArguments {
                tool: NAME.into(),
                detail,
            })?;
        let asked = delegations.len();
        let response = supervisor
            .delegate(auth::request(
                v1::DelegateRequest { delegations },
                env.token,
            ))
            .await
            .map_err(|status| refusal(&status))?
            .into_inner();
        if response.outcomes.len() != asked {
            return Err(ToolError::Refused {
                tool: NAME.into(),
                service: SERVICE,
                code: code_name(Code::Internal).to_owned(),
                detail: format!(
                    "the supervisor answered {} outcomes for {asked} delegations",
                    response.outcomes.len()
                ),
            });
        }
        let dropped = response.outcomes.iter().any(|o| o.dropped);
        // A child the width limit dropped is evidence cut short, like a read cut short.
        Ok(ToolOutput::new(summarize(&response.outcomes), dropped))
    }
}

/// One child task from its protobuf JSON mapping.
fn planned(value: &Value) -> Result<v1::PlannedDelegation, String> {
    if !value.is_object() {
        return Err("a delegation must be an object (a convene.v1.PlannedDelegation)".to_owned());
    }
    convene_proto::json::from_value(value.clone()).map_err(|e| e.to_string())
}

/// A child without a time window of its own investigates the task's window, as every
/// read-only tool does.
fn inherit_window(child: &mut v1::PlannedDelegation, window: &TimeWindow) {
    let Some(task_range) = time_window_to_proto(window) else {
        return;
    };
    let scope = child.scope.get_or_insert_with(v1::TaskScope::default);
    if scope.time_range.is_none() {
        scope.time_range = Some(task_range);
    }
}

/// How a Delegate call that did not answer counts: permission problems are denials,
/// an unreachable supervisor is a failure of the mesh, anything else is a refusal the
/// model can act on. The supervisor's message is kept word for word.
fn refusal(status: &tonic::Status) -> ToolError {
    let code = code_name(status.code()).to_owned();
    let detail = status.message().to_owned();
    match status.code() {
        Code::Unavailable => ToolError::Unavailable {
            tool: NAME.into(),
            service: SERVICE,
            detail: format!("{code}: {detail}"),
        },
        Code::PermissionDenied | Code::Unauthenticated => ToolError::Denied {
            tool: NAME.into(),
            service: SERVICE,
            code,
            detail,
        },
        _ => ToolError::Refused {
            tool: NAME.into(),
            service: SERVICE,
            code,
            detail,
        },
    }
}

/// The canonical gRPC name of a status code, e.g. `PERMISSION_DENIED`.
fn code_name(code: Code) -> &'static str {
    match code {
        Code::Ok => "OK",
        Code::Cancelled => "CANCELLED",
        Code::Unknown => "UNKNOWN",
        Code::InvalidArgument => "INVALID_ARGUMENT",
        Code::DeadlineExceeded => "DEADLINE_EXCEEDED",
        Code::NotFound => "NOT_FOUND",
        Code::AlreadyExists => "ALREADY_EXISTS",
        Code::PermissionDenied => "PERMISSION_DENIED",
        Code::ResourceExhausted => "RESOURCE_EXHAUSTED",
        Code::FailedPrecondition => "FAILED_PRECONDITION",
        Code::Aborted => "ABORTED",
        Code::OutOfRange => "OUT_OF_RANGE",
        Code::Unimplemented => "UNIMPLEMENTED",
        Code::Internal => "INTERNAL",
        Code::Unavailable => "UNAVAILABLE",
        Code::DataLoss => "DATA_LOSS",
        Code::Unauthenticated => "UNAUTHENTICATED",
    }
}

/// The tool's output: every child's outcome in call order, and counts for rules.
///
/// `status` is the child's result status without its prefix (`COMPLETED`, `PARTIAL`,
/// `FAILED`, ...), `DROPPED` for a child the width limit dropped, and `NO_RESULT` for one
/// that ended without a result. `answered` counts the children that came back with
/// findings (COMPLETED or PARTIAL).
pub fn summarize(outcomes: &[v1::DelegateOutcome]) -> Value {
    let mut answered = 0usize;
    let mut dropped = 0usize;
    let items: Vec<Value> = outcomes
        .iter()
        .map(|o| {
            let status = match &o.result {
                _ if o.dropped => "DROPPED".to_owned(),
                None => "NO_RESULT".to_owned(),
                Some(r) => v1::TaskStatus::try_from(r.status).map_or_else(
                    |_| "UNSPECIFIED".to_owned(),
                    |s| {
                        s.as_str_name()
                            .trim_start_matches("TASK_STATUS_")
                            .to_owned()
                    },
                ),
            };
            if o.dropped {
                dropped += 1;
            } else if matches!(status.as_str(), "COMPLETED" | "PARTIAL") {
                answered += 1;
            }
            let claims: Vec<Value> = o
                .result
                .iter()
                .flat_map(|r| &r.claims)
                .map(|c| json!({ "topic": c.topic, "value": c.value, "statement": c.statement }))
                .collect();
            let error = o
                .error
                .as_ref()
                .or_else(|| o.result.as_ref().and_then(|r| r.error.as_ref()))
                .map(|e| json!({ "code": e.code, "message": e.message }));
            let mut item = json!({
                "name": o.name,
                "delegation_id": o.delegation_id,
                "status": status,
                "summary": o.result.as_ref().map(|r| r.summary.as_str()).unwrap_or_default(),
                "claims": claims,
                "dropped": o.dropped,
            });
            if let (Some(error), Value::Object(map)) = (error, &mut item) {
                map.insert("error".to_owned(), error);
            }
            if !o.defaults.is_empty() {
                item["defaults_applied"] = o
                    .defaults
                    .iter()
                    .map(|d| json!({ "field": d.field, "value": d.value, "source": d.source }))
                    .collect();
            }
            item
        })
        .collect();
    json!({
        "requested": outcomes.len(),
        "answered": answered,
        "dropped": dropped,
        "outcomes": items,
    })
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;
    use crate::tools::parse_time;

    fn window() -> TimeWindow {
        TimeWindow {
            start: Some(parse_time("2026-07-23T01:45:00Z").unwrap()),
            end: Some(parse_time("2026-07-23T02:10:00Z").unwrap()),
        }
    }

    fn child(name: &str, profile: &str) -> Value {
        json!({ "name": name, "profile_id": profile, "goal": format!("investigate for {name}") })
    }

    #[test]
    fn prepare_checks_every_child_and_fills_in_the_task_window() {
        let args = json!({ "delegations": [
            child("logs", "logs-investigator"),
            {
                "name": "metrics",
                "profileId": "metrics-investigator",
                "goal": "quantify",
                "scope": { "resources": ["metric/*"], "time_range": { "start": "2026-07-23T02:00:00Z", "end": "2026-07-23T02:05:00Z" } },
                "required_scopes": [{ "action": "metrics:read", "resource": "metric/*" }],
                "timeout": "5s"
            }
        ]});
        let call = Delegate.prepare(&args, &window()).unwrap();
        assert_eq!(call.action, "delegation:create");
        assert_eq!(call.resource, "delegation");
        assert_eq!(call.max_rows, 2, "one row per child");
        assert_eq!(call.window, window());
        assert_eq!(call.scheme, "delegations");
        assert_eq!(call.subject, "run");
        let children = call.args["delegations"].as_array().unwrap();
        assert_eq!(children[0]["name"], "logs");
        assert_eq!(
            children[0]["scope"]["timeRange"]["start"], "2026-07-23T01:45:00Z",
            "a child without a window gets the task's: {children:#?}"
        );
        assert_eq!(
            children[1]["scope"]["timeRange"]["start"], "2026-07-23T02:00:00Z",
            "a child's own window is kept"
        );
        assert_eq!(children[1]["profileId"], "metrics-investigator");
        assert_eq!(children[1]["timeout"], "5s");
        // The normalized arguments parse back into the same children.
        let back = planned(&children[1]).unwrap();
        assert_eq!(back.required_scopes[0].action, "metrics:read");
        // Same request, other spelling: same fingerprint.
        let again = Delegate
            .prepare(
                &json!({ "delegations": [
                    { "goal": "investigate for logs", "profile_id": "logs-investigator", "name": "logs" },
                    children[1].clone()
                ]}),
                &window(),
            )
            .unwrap();
        assert_eq!(again.fingerprint(), call.fingerprint());
    }

    #[test]
    fn bad_arguments_name_the_child_and_field() {
        let err = |args: Value| Delegate.prepare(&args, &window()).unwrap_err().to_string();
        assert!(err(json!({ "delegations": [] })).contains("at least one"));
        assert!(err(json!({})).contains("at least one"));
        assert!(err(json!({ "children": [] })).contains("children"));
        let e = err(
            json!({ "delegations": [child("logs", "logs-investigator"), child("Bad Name", "x")] }),
        );
        assert!(e.contains("delegations[1].name"), "{e}");
        let e = err(
            json!({ "delegations": [child("a", "logs-investigator"), child("a", "metrics-investigator")] }),
        );
        assert!(e.contains("used twice"), "{e}");
        let e = err(
            json!({ "delegations": [{ "name": "a", "profile_id": "p", "goal": "g", "colour": "red" }] }),
        );
        assert!(e.contains("delegations[0]") && e.contains("colour"), "{e}");
        let e = err(json!({ "delegations": ["logs"] }));
        assert!(e.contains("must be an object"), "{e}");
        let e = err(json!({ "delegations": [{ "name": "a", "profile_id": "p" }] }));
        assert!(e.contains("delegations[0].goal"), "{e}");
    }

    #[test]
    fn outcomes_are_summarized_in_call_order() {
        let result = |status: v1::TaskStatus, summary: &str| v1::TaskResult {
            status: status as i32,
            summary: summary.to_owned(),
            claims: vec![v1::Claim {
                claim_id: "c1".into(),
                topic: "primary_cause".into(),
                value: "connection_pool_exhaustion".into(),
                statement: "the pool ran dry".into(),
                ..Default::default()
            }],
            ..Default::default()
        };
        let outcomes = vec![
            v1::DelegateOutcome {
                name: "slow".into(),
                delegation_id: "del-1".into(),
                result: Some(result(v1::TaskStatus::Completed, "found it")),
                error: None,
                dropped: false,
                defaults: vec![v1::AppliedDefault {
                    field: "required_scopes".into(),
                    value: "logs:read on service/*".into(),
                    source: "the capabilities its tools need".into(),
                }],
            },
            v1::DelegateOutcome {
                name: "failed".into(),
                delegation_id: "del-2".into(),
                result: Some(v1::TaskResult {
                    status: v1::TaskStatus::Failed as i32,
                    error: Some(v1::ErrorInfo {
                        code: "no_findings".into(),
                        retryable: false,
                        message: "nothing".into(),
                    }),
                    ..Default::default()
                }),
                error: None,
                dropped: false,
                ..Default::default()
            },
            v1::DelegateOutcome {
                name: "extra".into(),
                dropped: true,
                error: Some(v1::ErrorInfo {
                    code: "truncated".into(),
                    retryable: false,
                    message: "dropped".into(),
                }),
                ..Default::default()
            },
        ];
        let v = summarize(&outcomes);
        assert_eq!(v["requested"], 3);
        assert_eq!(v["answered"], 1);
        assert_eq!(v["dropped"], 1);
        let names: Vec<&str> = v["outcomes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|o| o["name"].as_str().unwrap())
            .collect();
        assert_eq!(names, ["slow", "failed", "extra"]);
        assert_eq!(v["outcomes"][0]["status"], "COMPLETED");
        assert_eq!(v["outcomes"][0]["summary"], "found it");
        assert_eq!(
            v["outcomes"][0]["claims"][0]["value"],
            "connection_pool_exhaustion"
        );
        assert!(v["outcomes"][0].get("error").is_none());
        assert_eq!(
            v["outcomes"][0]["defaults_applied"][0]["value"], "logs:read on service/*",
            "the model reads the defaults its child was given"
        );
        assert!(v["outcomes"][1].get("defaults_applied").is_none());
        assert_eq!(v["outcomes"][1]["status"], "FAILED");
        assert_eq!(v["outcomes"][1]["error"]["code"], "no_findings");
        assert_eq!(v["outcomes"][2]["status"], "DROPPED");
        assert_eq!(v["outcomes"][2]["dropped"], true);
        assert_eq!(v["outcomes"][2]["error"]["code"], "truncated");
    }

    #[test]
    fn refusals_keep_the_supervisors_message() {
        let depth = refusal(&tonic::Status::failed_precondition(
            "delegation depth 2 exceeds max_depth 1: handle this task yourself instead of delegating",
        ));
        assert!(matches!(depth, ToolError::Refused { .. }));
        let text = depth.to_string();
        assert!(text.contains("FAILED_PRECONDITION"), "{text}");
        assert!(text.contains("handle this task yourself"), "{text}");
        let wider = refusal(&tonic::Status::permission_denied("`logs:read` is wider"));
        assert!(matches!(wider, ToolError::Denied { .. }));
        assert!(wider.to_string().contains("PERMISSION_DENIED"));
        assert!(matches!(
            refusal(&tonic::Status::unavailable("down")),
            ToolError::Unavailable { .. }
        ));
        assert!(matches!(
            refusal(&tonic::Status::resource_exhausted("width")),
            ToolError::Refused { .. }
        ));
    }

    #[tokio::test]
    async fn without_a_supervisor_the_call_says_what_is_missing() {
        let call = Delegate
            .prepare(
                &json!({ "delegations": [child("logs", "logs-investigator")] }),
                &window(),
            )
            .unwrap();
        let env = ToolEnv {
            data_dir: Path::new("."),
            token: "t",
            supervisor: None,
        };
        let err = Delegate.run(&call, &env).await.unwrap_err();
        assert!(matches!(err, ToolError::Unavailable { .. }), "{err}");
        assert!(err.to_string().contains("supervisor"), "{err}");
    }
}
