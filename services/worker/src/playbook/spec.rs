//! The playbook's YAML schema, as written in a profile's `playbook` section: the steps
//! (tool calls), the rules with their claim and action templates, and the checks a
//! playbook must pass against its profile's tools.

use std::collections::BTreeSet;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::condition::{Op, When};
use super::template::Template;

/// A playbook as written in the profile file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PlaybookSpec {
    /// Opening of the report's summary; the fired claims' statements follow.
    #[serde(default)]
    pub summary: String,
    /// The report's suggested next step.
    #[serde(default)]
    pub recommended_next: String,
    /// The tool calls to make, all in the first turn.
    pub steps: Vec<Step>,
    /// Rules turning outputs into claims and proposed actions, in report order.
    #[serde(default)]
    pub rules: Vec<Rule>,
}

/// One tool call of a playbook.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Step {
    /// Step id, `[a-z0-9_-]{1,64}`: the tool call's id and the last segment of its
    /// evidence id.
    pub id: String,
    /// Tool, `name@version`; must be one of the profile's default tools.
    pub tool: String,
    /// The tool's arguments.
    #[serde(default)]
    pub args: Value,
    /// Kind of the evidence the call records, e.g. `impact_metric`.
    pub evidence_kind: String,
}

/// One rule: when a step's output satisfies `when`, emit a claim or an action.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Rule {
    /// The step whose output the rule reads; the rule fires only if it succeeded.
    pub step: String,
    /// Conditions on the output; none means "whenever the step succeeded".
    #[serde(default)]
    pub when: Option<When>,
    /// The claim to emit.
    #[serde(default)]
    pub claim: Option<ClaimTemplate>,
    /// The action to propose.
    #[serde(default)]
    pub action: Option<ActionTemplate>,
    /// Steps whose evidence the claim or action cites (those that succeeded); default:
    /// the rule's step.
    #[serde(default)]
    pub evidence_from: Vec<String>,
}

/// A claim a rule emits; every string is a template.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClaimTemplate {
    /// Claim id, unique within the playbook.
    pub claim_id: String,
    /// Topic, e.g. `primary_cause`.
    pub topic: String,
    /// Normalized value on the topic.
    pub value: String,
    /// Human-readable statement.
    pub statement: String,
    /// Confidence in `[0, 1]`.
    #[serde(default = "default_confidence")]
    pub confidence: f64,
}

fn default_confidence() -> f64 {
    0.5
}

/// An action a rule proposes; strings (also inside parameters) are templates.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ActionTemplate {
    /// Action name from the policy's catalog, e.g. `rule:rollback`.
    pub action: String,
    /// Parameters, a JSON object.
    #[serde(default)]
    pub parameters: Value,
    /// Risk level `R0`..`R3`.
    pub risk_level: String,
    /// Why.
    #[serde(default)]
    pub rationale: String,
}

impl PlaybookSpec {
    /// Checks the playbook against the profile's tools. Errors name the field below
    /// `field` (e.g. `profiles[0].playbook.rules[1].step`).
    ///
    /// # Errors
    ///
    /// `(field, what is wrong)` for the first problem found.
    pub fn validate(&self, tools: &[String], field: &str) -> Result<(), (String, String)> {
        if self.steps.is_empty() {
            return Err((
                format!("{field}.steps"),
                "a playbook needs at least one step".into(),
            ));
        }
        let mut ids = BTreeSet::new();
        for (i, step) in self.steps.iter().enumerate() {
            let f = format!("{field}.steps[{i}]");
            let id_ok = !step.id.is_empty()
                && step.id.len() <= 64
                && step
                    .id
                    .chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_' || c == '-');
            if !id_ok {
                return Err((
                    format!("{f}.id"),
                    format!(
                        "step id {:?} must be 1-64 of a-z, 0-9, `_` and `-`",
                        step.id
                    ),
                ));
            }
            if !ids.insert(step.id.as_str()) {
                return Err((format!("{f}.id"), format!("step id {} repeats", step.id)));
            }
            if !tools.contains(&step.tool) {
                return Err((
                    format!("{f}.tool"),
                    format!(
                        "tool {} is not among the profile's default_tools ({})",
                        step.tool,
                        tools.join(", ")
                    ),
                ));
            }
            if !(step.args.is_object() || step.args.is_null()) {
                return Err((format!("{f}.args"), "args must be a mapping".into()));
            }
            if step.evidence_kind.trim().is_empty() {
                return Err((
                    format!("{f}.evidence_kind"),
                    "name the kind of evidence the step records, e.g. impact_metric".into(),
                ));
            }
        }
        let mut claim_ids = BTreeSet::new();
        for (i, rule) in self.rules.iter().enumerate() {
            let f = format!("{field}.rules[{i}]");
            if !ids.contains(rule.step.as_str()) {
                return Err((
                    format!("{f}.step"),
                    format!("no step is called {:?}", rule.step),
                ));
            }
            for (j, s) in rule.evidence_from.iter().enumerate() {
                if !ids.contains(s.as_str()) {
                    return Err((
                        format!("{f}.evidence_from[{j}]"),
                        format!("no step is called {s:?}"),
                    ));
                }
            }
            for (j, c) in rule.when.iter().flat_map(When::conditions).enumerate() {
                if c.op != Op::Exists && c.value.is_null() {
                    return Err((
                        format!("{f}.when[{j}].value"),
                        format!("operator {:?} needs a value to compare with", c.op),
                    ));
                }
                if c.path.is_empty() {
                    return Err((
                        format!("{f}.when[{j}].path"),
                        "path must not be empty".into(),
                    ));
                }
            }
            match (&rule.claim, &rule.action) {
                (Some(claim), None) => {
                    for (name, text) in [
                        ("claim_id", &claim.claim_id),
                        ("topic", &claim.topic),
                        ("value", &claim.value),
                        ("statement", &claim.statement),
                    ] {
                        if text.trim().is_empty() {
                            return Err((
                                format!("{f}.claim.{name}"),
                                format!("{name} must not be empty"),
                            ));
                        }
                        Template::parse(text).map_err(|e| (format!("{f}.claim.{name}"), e))?;
                    }
                    if !claim_ids.insert(claim.claim_id.as_str()) {
                        return Err((
                            format!("{f}.claim.claim_id"),
                            format!("claim id {} repeats", claim.claim_id),
                        ));
                    }
                    if !(0.0..=1.0).contains(&claim.confidence) {
                        return Err((
                            format!("{f}.claim.confidence"),
                            format!("{} must be between 0 and 1", claim.confidence),
                        ));
                    }
                }
                (None, Some(action)) => {
                    Template::parse(&action.action)
                        .map_err(|e| (format!("{f}.action.action"), e))?;
                    Template::parse(&action.rationale)
                        .map_err(|e| (format!("{f}.action.rationale"), e))?;
                    check_value_templates(&action.parameters)
                        .map_err(|e| (format!("{f}.action.parameters"), e))?;
                    if convene_core::permissions::RiskLevel::parse(&action.risk_level).is_none() {
                        return Err((
                            format!("{f}.action.risk_level"),
                            format!(
                                "{:?} is not a risk level; use R0, R1, R2 or R3",
                                action.risk_level
                            ),
                        ));
                    }
                    if !(action.parameters.is_object() || action.parameters.is_null()) {
                        return Err((
                            format!("{f}.action.parameters"),
                            "parameters must be a mapping".into(),
                        ));
                    }
                }
                _ => {
                    return Err((f, "a rule has exactly one of `claim` and `action`".into()));
                }
            }
        }
        Ok(())
    }
}

fn check_value_templates(value: &Value) -> Result<(), String> {
    match value {
        Value::String(s) => Template::parse(s).map(|_| ()),
        Value::Array(items) => items.iter().try_for_each(check_value_templates),
        Value::Object(map) => map.values().try_for_each(check_value_templates),
        _ => Ok(()),
    }
}
