//! The `playbook` model provider: deterministic and offline.
//!
//! A profile's playbook lists the tool calls to make (steps) and the rules that turn
//! their outputs into claims and proposed actions. The provider plays the model's part
//! of the conversation in two turns:
//!
//! 1. with no tool results in the conversation, it asks for every step's tool call at
//!    once (parallel tool calls in one assistant message), each call's id being the
//!    step's id;
//! 2. once the results are in, it hands in the final report by calling `submit_report`
//!    (call id `report`): a rule fires
//!    when its step succeeded and its condition holds on the step's output, and its
//!    templates are filled from that output. Steps whose call was denied or failed are
//!    listed as missing evidence and their rules stay silent.
//!
//! A hosted model would be asked for the same report; the agent loop cannot tell them
//! apart. The playbook provider consumes no tokens.
//!
//! # Rules
//!
//! ```yaml
//! - step: pool_exhaustion                          # the output the rule reads
//!   when: { path: matched, op: gt, value: 0 }      # or a list: all must hold
//!   claim:
//!     claim_id: claim-log-cause
//!     topic: primary_cause
//!     value: connection_pool_exhaustion
//!     statement: "pool exhausted from {first_ts|time} UTC"
//!     confidence: 0.8
//!   evidence_from: [pool_exhaustion, confirm_outcomes]  # default: [step]
//! ```
//!
//! A rule has either a `claim` or an `action` (`action`, `parameters`, `risk_level`,
//! `rationale`). Condition operators: `gt`, `ge`, `lt`, `le` (numbers, or strings
//! compared as text, which orders RFC 3339 times), `eq`, `ne`, and `exists` (`value:
//! false` asks for absence). Paths are dotted, with numeric indices into arrays
//! (`changes.0.rule_id`); a key that itself contains dots (`groups.risk.rule`) is found
//! too.
//!
//! # Templates
//!
//! `{path}` is replaced by the value at `path`; `{{` and `}}` are literal braces.
//! Filters follow `|` and apply left to right: `round:N` (N decimals), `div:X`, `mul:X`,
//! `time` (`HH:MM:SS` of an RFC 3339 time), `hm` (`HH:MM`), `secs_before:<RFC 3339>`
//! (whole seconds from the value until that time) and `default:<text>` (used when the
//! path is absent). In action parameters a string that is exactly one `{path}` keeps
//! the value's JSON type.
//!
//! The YAML schema is [`spec`], the rules' conditions [`condition`], the templates
//! [`template`]; this module plays the model's part with them.
//!
//! # Planners
//!
//! A `playbook` profile may carry a `planner:` section instead of `playbook:`: it then
//! plays a run's planner, whose tools are `delegate` and `finish`, round by round
//! ([`planner`]).

mod condition;
pub mod planner;
mod spec;
mod template;

use std::collections::BTreeMap;

use serde_json::Value;

pub use condition::{Condition, Op, When, resolve};
pub use planner::{PlannerProvider, PlannerSpec};
pub use spec::{ActionTemplate, ClaimTemplate, PlaybookSpec, Rule, Step};
pub use template::Template;

use crate::provider::{
    FinishReason, Message, ModelProvider, ModelRequest, ModelResponse, ProviderError, Role,
    TokenUsage, ToolCall,
};
use crate::report::{FinalReport, ReportAction, ReportClaim, SUBMIT_REPORT, ToolOutcome};
use crate::tools::EVIDENCE_KIND_ARG;

/// The provider's name, as profiles write it.
pub const PROVIDER_NAME: &str = "playbook";
/// The id of the `submit_report` call that hands in the playbook's report.
pub const REPORT_CALL_ID: &str = "report";

/// The `playbook` provider for one profile.
#[derive(Debug, Clone)]
pub struct PlaybookProvider {
    profile_id: String,
    playbook: PlaybookSpec,
}

impl PlaybookProvider {
    /// The provider playing `playbook` for profile `profile_id`, whose tools are
    /// `default_tools`.
    ///
    /// # Errors
    ///
    /// The playbook is invalid for those tools.
    pub fn new(
        profile_id: &str,
        default_tools: &[String],
        playbook: PlaybookSpec,
    ) -> Result<Self, String> {
        playbook
            .validate(default_tools, "playbook")
            .map_err(|(field, detail)| format!("{field}: {detail}"))?;
        Ok(Self {
            profile_id: profile_id.to_owned(),
            playbook,
        })
    }

    /// The first turn: every step's tool call.
    pub fn tool_calls(&self) -> Vec<ToolCall> {
        self.playbook
            .steps
            .iter()
            .map(|step| {
                let mut args = match &step.args {
                    Value::Object(map) => map.clone(),
                    _ => serde_json::Map::new(),
                };
                args.insert(
                    EVIDENCE_KIND_ARG.to_owned(),
                    Value::String(step.evidence_kind.clone()),
                );
                ToolCall {
                    id: step.id.clone(),
                    name: step.tool.clone(),
                    arguments: Value::Object(args),
                }
            })
            .collect()
    }

    /// The second turn: the report, from the tool outcomes by call id.
    pub fn report(&self, outcomes: &BTreeMap<String, ToolOutcome>) -> FinalReport {
        let succeeded = |step: &str| {
            outcomes
                .get(step)
                .filter(|o| o.success)
                .and_then(|o| o.output.as_ref())
        };
        let mut claims = Vec::new();
        let mut proposed_actions = Vec::new();
        for (i, rule) in self.playbook.rules.iter().enumerate() {
            let Some(output) = succeeded(&rule.step) else {
                continue;
            };
            let holds = rule
                .when
                .as_ref()
                .is_none_or(|w| w.conditions().iter().all(|c| c.holds(output)));
            if !holds {
                continue;
            }
            let cited: Vec<String> = if rule.evidence_from.is_empty() {
                vec![rule.step.clone()]
            } else {
                rule.evidence_from
                    .iter()
                    .filter(|s| succeeded(s).is_some())
                    .cloned()
                    .collect()
            };
            let rendered = match (&rule.claim, &rule.action) {
                (Some(c), _) => render_claim(c, output, cited).map(|c| claims.push(c)),
                (None, Some(a)) => {
                    render_action(a, output, cited).map(|a| proposed_actions.push(a))
                }
                (None, None) => Ok(()),
            };
            if let Err(error) = rendered {
                // A template naming a field the output lacks is a playbook bug for this
                // data; the rule stays silent rather than emit a half-filled claim.
                tracing::warn!(profile = %self.profile_id, rule = i, %error, "playbook rule not rendered");
            }
        }
        let missing_evidence: Vec<String> = self
            .playbook
            .steps
            .iter()
            .filter(|s| succeeded(&s.id).is_none())
            .map(|s| s.id.clone())
            .collect();
        FinalReport {
            status: crate::report::ReportStatus::Completed,
            summary: summary(&self.playbook.summary, &claims, &missing_evidence),
            claims,
            proposed_actions,
            missing_evidence,
            recommended_next: self.playbook.recommended_next.clone(),
        }
    }
}

fn summary(opening: &str, claims: &[ReportClaim], missing: &[String]) -> String {
    let mut parts: Vec<String> = Vec::new();
    if !opening.trim().is_empty() {
        parts.push(opening.trim().trim_end_matches('.').to_owned() + ".");
    }
    if claims.is_empty() {
        parts.push("No finding.".to_owned());
    }
    for c in claims {
        parts.push(c.statement.trim_end_matches('.').to_owned() + ".");
    }
    if !missing.is_empty() {
        parts.push(format!("Missing evidence: {}.", missing.join(", ")));
    }
    parts.join(" ")
}

fn render_claim(
    c: &ClaimTemplate,
    output: &Value,
    cited: Vec<String>,
) -> Result<ReportClaim, String> {
    let render = |text: &str| Template::parse(text)?.render(output);
    Ok(ReportClaim {
        claim_id: render(&c.claim_id)?,
        topic: render(&c.topic)?,
        value: render(&c.value)?,
        statement: render(&c.statement)?,
        evidence_refs: cited,
        confidence: c.confidence,
    })
}

fn render_action(
    a: &ActionTemplate,
    output: &Value,
    cited: Vec<String>,
) -> Result<ReportAction, String> {
    let render = |text: &str| Template::parse(text)?.render(output);
    Ok(ReportAction {
        action: render(&a.action)?,
        parameters: render_value(&a.parameters, output)?,
        risk_level: a.risk_level.clone(),
        rationale: render(&a.rationale)?,
        evidence_refs: cited,
    })
}

fn render_value(value: &Value, output: &Value) -> Result<Value, String> {
    Ok(match value {
        Value::String(s) => {
            let template = Template::parse(s)?;
            match template.whole_path() {
                // `"{path}"` alone keeps the value's type (a number stays a number).
                Some(path) => resolve(output, path)
                    .cloned()
                    .ok_or_else(|| format!("`{path}` is not in the output"))?,
                None => Value::String(template.render(output)?),
            }
        }
        Value::Array(items) => Value::Array(
            items
                .iter()
                .map(|v| render_value(v, output))
                .collect::<Result<_, _>>()?,
        ),
        Value::Object(map) => Value::Object(
            map.iter()
                .map(|(k, v)| Ok((k.clone(), render_value(v, output)?)))
                .collect::<Result<_, String>>()?,
        ),
        other => other.clone(),
    })
}

#[async_trait::async_trait]
impl ModelProvider for PlaybookProvider {
    fn name(&self) -> &str {
        PROVIDER_NAME
    }

    fn has_context_window(&self) -> bool {
        false
    }

    fn records_turns(&self) -> bool {
        // The turns follow from the profile, which is versioned: nothing to audit.
        false
    }

    async fn complete(&self, request: &ModelRequest) -> Result<ModelResponse, ProviderError> {
        let asked = request.messages.iter().any(|m| {
            m.role == Role::Assistant && m.tool_calls.iter().any(|c| c.name != SUBMIT_REPORT)
        });
        if !asked {
            return Ok(ModelResponse {
                model: String::new(),
                message: Message::tool_calls(self.tool_calls()),
                finish: FinishReason::ToolCalls,
                usage: TokenUsage::default(),
            });
        }
        let mut outcomes = BTreeMap::new();
        for m in request.messages.iter().filter(|m| m.role == Role::Tool) {
            let (Some(id), Ok(outcome)) = (&m.tool_call_id, ToolOutcome::from_content(&m.content))
            else {
                continue;
            };
            outcomes.insert(id.clone(), outcome);
        }
        let report = self.report(&outcomes);
        let arguments = serde_json::to_value(&report).map_err(|e| {
            ProviderError::permanent(PROVIDER_NAME, format!("cannot write the report: {e}"))
        })?;
        Ok(ModelResponse {
            model: String::new(),
            message: Message::tool_calls(vec![ToolCall {
                id: REPORT_CALL_ID.to_owned(),
                name: SUBMIT_REPORT.to_owned(),
                arguments,
            }]),
            finish: FinishReason::ToolCalls,
            usage: TokenUsage::default(),
        })
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::tools::parse_time;

    /// A tool output with numbers, times, nested keys, a dotted key and a null.
    pub(super) fn output() -> Value {
        json!({
            "matched": 116,
            "first_ts": "2026-07-23T02:01:18.000Z",
            "groups": { "timeout": 9, "ok": 741, "risk.rule": 2 },
            "baseline": 419.98,
            "after": 3808.72,
            "changes": [ { "rule_id": "RC-4711", "ts": "2026-07-23T02:01:40.000Z", "rollback": { "to_version": "2026.7.1" } } ],
            "nothing": null,
        })
    }

    /// The provider of the example profile `id`, read from the example's profiles file.
    fn example_provider(id: &str) -> PlaybookProvider {
        let file: serde_yaml::Value = serde_yaml::from_str(include_str!(
            "../../../../examples/payment-incident/profiles.yaml"
        ))
        .unwrap();
        let entry = file["profiles"]
            .as_sequence()
            .unwrap()
            .iter()
            .find(|p| p["id"].as_str() == Some(id))
            .unwrap();
        let tools: Vec<String> = serde_yaml::from_value(entry["default_tools"].clone()).unwrap();
        let spec: PlaybookSpec = serde_yaml::from_value(entry["playbook"].clone()).unwrap();
        PlaybookProvider::new(id, &tools, spec).unwrap()
    }

    /// Plays `profile`'s playbook against the real tools over the example data; tool
    /// calls whose id is in `fail` get a failed outcome instead.
    async fn play(profile: &str, fail: &[&str]) -> (Vec<ToolCall>, FinalReport) {
        let provider = example_provider(profile);
        let mut request = ModelRequest {
            model: String::new(),
            system: String::new(),
            messages: vec![Message::user("investigate")],
            tools: Vec::new(),
            max_tokens: 8192,
            temperature: 0.2,
        };
        let first = provider.complete(&request).await.unwrap();
        assert_eq!(first.finish, FinishReason::ToolCalls);
        assert_eq!(first.usage.total(), 0);
        let calls = first.message.tool_calls.clone();
        request.messages.push(first.message);

        let data = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../../examples/payment-incident/data");
        let tools = crate::tools::ToolRegistry::builtin(data.clone());
        let window = convene_core::permissions::TimeWindow {
            start: Some(parse_time("2026-07-23T01:45:00Z").unwrap()),
            end: Some(parse_time("2026-07-23T02:10:00Z").unwrap()),
        };
        for call in &calls {
            let outcome = if fail.contains(&call.id.as_str()) {
                ToolOutcome::failure("denied by policy (TOOL_NOT_GRANTED)")
            } else {
                let mut args = call.arguments.clone();
                args.as_object_mut().unwrap().remove(EVIDENCE_KIND_ARG);
                let tool = tools.get(&call.name).unwrap();
                let prepared = tool.prepare(&args, &window).unwrap();
                let env = crate::tools::ToolEnv {
                    data_dir: &data,
                    token: "",
                    supervisor: None,
                };
                let output = tool.run(&prepared, &env).await.unwrap();
                ToolOutcome::success(format!("ev/{}", call.id), output.value)
            };
            request
                .messages
                .push(Message::tool_result(&call.id, outcome.to_content()));
        }
        let second = provider.complete(&request).await.unwrap();
        assert_eq!(second.finish, FinishReason::ToolCalls);
        let [submit] = second.message.tool_calls.as_slice() else {
            panic!("one submit_report call expected: {:?}", second.message)
        };
        assert_eq!(submit.name, SUBMIT_REPORT);
        (
            calls,
            FinalReport::from_arguments(&submit.arguments).unwrap(),
        )
    }

    fn claim<'a>(report: &'a FinalReport, topic: &str) -> &'a ReportClaim {
        report
            .claims
            .iter()
            .find(|c| c.topic == topic)
            .unwrap_or_else(|| panic!("no claim on {topic}: {report:#?}"))
    }

    #[tokio::test]
    async fn first_turn_calls_every_step_in_parallel_with_its_evidence_kind() {
        let (calls, _) = play("logs-investigator", &[]).await;
        let ids: Vec<&str> = calls.iter().map(|c| c.id.as_str()).collect();
        assert_eq!(ids, ["pool_exhaustion", "confirm_outcomes"]);
        assert_eq!(calls[0].arguments[EVIDENCE_KIND_ARG], "causal_signal");
        assert_eq!(calls[1].arguments[EVIDENCE_KIND_ARG], "impact_metric");
        assert!(calls.iter().all(|c| c.name == "search_logs@1"));
    }

    #[tokio::test]
    async fn logs_playbook_finds_the_timeouts_and_the_pool_exhaustion() {
        let (_, report) = play("logs-investigator", &[]).await;
        assert!(report.missing_evidence.is_empty());
        let impact = claim(&report, "impact.payment_confirm_failures");
        let (timeouts, calls) = impact.value.split_once('/').unwrap();
        assert!(
            impact
                .statement
                .starts_with(&format!("{timeouts} of {calls} payment_confirm calls")),
            "{}",
            impact.statement
        );
        assert_eq!(impact.evidence_refs, ["confirm_outcomes"]);
        let cause = claim(&report, "primary_cause");
        assert_eq!(cause.value, "connection_pool_exhaustion");
        assert!(
            cause.statement.contains("from 02:01:18 UTC, 42 s before"),
            "{}",
            cause.statement
        );
        assert!(
            cause.statement.contains("payments-primary"),
            "{}",
            cause.statement
        );
        assert_eq!(cause.evidence_refs, ["pool_exhaustion", "confirm_outcomes"]);
    }

    #[tokio::test]
    async fn metrics_playbook_quantifies_the_drop() {
        let (_, report) = play("metrics-investigator", &[]).await;
        assert_eq!(
            claim(&report, "impact.success_rate").value,
            "99.6% → 93.1% at 02:02"
        );
        assert_eq!(claim(&report, "impact.gateway_p95").value, "420 ms → 3.8 s");
    }

    #[tokio::test]
    async fn change_playbook_blames_the_rule_and_proposes_a_rollback() {
        let (_, report) = play("change-auditor", &[]).await;
        let cause = claim(&report, "primary_cause");
        assert_eq!(cause.value, "risk_rule_change");
        assert!(
            cause.statement.contains("RC-4711") && cause.statement.contains("02:01:40"),
            "{}",
            cause.statement
        );
        assert_eq!(cause.evidence_refs, ["rule_changes"]);
        let hit = claim(&report, "risk.rule_hit_rate");
        assert!(hit.value.ends_with("at 02:02"), "{}", hit.value);
        let [action] = report.proposed_actions.as_slice() else {
            panic!("one proposed action expected: {report:#?}");
        };
        assert_eq!(action.action, "rule:rollback");
        assert_eq!(
            action.parameters,
            json!({"rule_id": "RC-4711", "to_version": "2026.7.1"})
        );
        assert_eq!(action.risk_level, "R3");
        assert_eq!(action.evidence_refs, ["rule_changes", "rule_hit_rate"]);
    }

    #[tokio::test]
    async fn failed_steps_are_missing_and_their_rules_stay_silent() {
        let (_, report) = play("logs-investigator", &["confirm_outcomes"]).await;
        assert_eq!(report.missing_evidence, ["confirm_outcomes"]);
        assert!(
            report
                .claims
                .iter()
                .all(|c| c.topic != "impact.payment_confirm_failures")
        );
        // The cause still fires, citing only the evidence that exists.
        assert_eq!(
            claim(&report, "primary_cause").evidence_refs,
            ["pool_exhaustion"]
        );
        assert!(
            report
                .summary
                .contains("Missing evidence: confirm_outcomes"),
            "{}",
            report.summary
        );

        let (_, none) = play("change-auditor", &["rule_changes", "rule_hit_rate"]).await;
        assert!(none.claims.is_empty() && none.proposed_actions.is_empty());
        assert_eq!(none.missing_evidence, ["rule_changes", "rule_hit_rate"]);
    }

    #[test]
    fn whole_placeholders_keep_their_json_type_in_parameters() {
        let out = output();
        let params = json!({
            "rule_id": "{changes.0.rule_id}",
            "to_version": "{changes.0.rollback.to_version}",
            "count": "{matched}",
            "note": "{matched} events",
        });
        let rendered = render_value(&params, &out).unwrap();
        assert_eq!(
            rendered,
            json!({"rule_id": "RC-4711", "to_version": "2026.7.1", "count": 116, "note": "116 events"})
        );
    }
}
