//! The `playbook` model provider: deterministic and offline.
//!
//! A profile's playbook lists the tool calls to make (steps) and the rules that turn
//! their outputs into claims and proposed actions. The provider plays the model's part
//! of the conversation in two turns:
//!
//! 1. with no tool results in the conversation, it asks for every step's tool call at
//!    once (parallel tool calls in one assistant message), each call's id being the
//!    step's id;
//! 2. once the results are in, it answers with the final report as JSON: a rule fires
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

use std::cmp::Ordering;
use std::collections::{BTreeMap, BTreeSet};
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::agent::EVIDENCE_KIND_ARG;
use crate::profiles::Profile;
use crate::provider::{
    FinishReason, Message, ModelProvider, ModelRequest, ModelResponse, ProviderError, Role,
    TokenUsage, ToolCall,
};
use crate::report::{FinalReport, ReportAction, ReportClaim, ToolOutcome};
use crate::tools::parse_time;

/// The provider's name, as profiles write it.
pub const PROVIDER_NAME: &str = "playbook";

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

/// One condition or a list that must all hold.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum When {
    /// One condition.
    One(Condition),
    /// Every condition must hold.
    All(Vec<Condition>),
}

impl When {
    fn conditions(&self) -> &[Condition] {
        match self {
            When::One(c) => std::slice::from_ref(c),
            When::All(cs) => cs,
        }
    }
}

/// A condition on a tool output.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Condition {
    /// Dotted path into the output.
    pub path: String,
    /// Comparison.
    pub op: Op,
    /// Value compared with (for `exists`: whether the path must exist, default true).
    #[serde(default)]
    pub value: Value,
}

/// Comparison operators of conditions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Op {
    /// Greater than.
    Gt,
    /// Greater than or equal.
    Ge,
    /// Equal.
    Eq,
    /// Not equal (an absent value is not equal to anything).
    Ne,
    /// Less than.
    Lt,
    /// Less than or equal.
    Le,
    /// The path exists and is not null (or, with `value: false`, does not).
    Exists,
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

/// The `playbook` provider for one profile.
#[derive(Debug, Clone)]
pub struct PlaybookProvider {
    profile_id: String,
    playbook: PlaybookSpec,
}

impl PlaybookProvider {
    /// The provider playing `profile`'s playbook.
    ///
    /// # Errors
    ///
    /// The profile has no playbook section, or it is invalid.
    pub fn for_profile(profile: &Profile) -> Result<Self, String> {
        let playbook = profile.playbook.clone().ok_or_else(|| {
            "the playbook provider needs a `playbook` section with steps and rules".to_owned()
        })?;
        playbook
            .validate(&profile.profile.default_tools, "playbook")
            .map_err(|(field, detail)| format!("{field}: {detail}"))?;
        Ok(Self {
            profile_id: profile.profile.id.clone(),
            playbook,
        })
    }

    /// The first turn: every step's tool call.
    fn tool_calls(&self) -> Vec<ToolCall> {
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
        evidence_from: cited,
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
        evidence_from: cited,
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

    async fn complete(&self, request: &ModelRequest) -> Result<ModelResponse, ProviderError> {
        let asked = request
            .messages
            .iter()
            .any(|m| m.role == Role::Assistant && !m.tool_calls.is_empty());
        if !asked {
            return Ok(ModelResponse {
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
        let content = serde_json::to_string(&report).map_err(|e| {
            ProviderError::permanent(PROVIDER_NAME, format!("cannot write the report: {e}"))
        })?;
        Ok(ModelResponse {
            message: Message::assistant(content),
            finish: FinishReason::Stop,
            usage: TokenUsage::default(),
        })
    }
}

// ---------------------------------------------------------------------------------------
// Paths and conditions.

/// The value at a dotted `path` in `value`; numeric segments index arrays, and object
/// keys containing dots are matched greedily (the longest key that exists wins).
pub fn resolve<'a>(value: &'a Value, path: &str) -> Option<&'a Value> {
    fn walk<'a>(value: &'a Value, segments: &[&str]) -> Option<&'a Value> {
        let Some(first) = segments.first() else {
            return Some(value);
        };
        match value {
            Value::Array(items) => walk(items.get(first.parse::<usize>().ok()?)?, &segments[1..]),
            Value::Object(map) => (1..=segments.len()).rev().find_map(|n| {
                let key = segments[..n].join(".");
                map.get(&key).and_then(|v| walk(v, &segments[n..]))
            }),
            _ => None,
        }
    }
    let segments: Vec<&str> = path.split('.').collect();
    walk(value, &segments)
}

impl Condition {
    /// Whether the condition holds on `output`.
    pub fn holds(&self, output: &Value) -> bool {
        let got = resolve(output, &self.path).filter(|v| !v.is_null());
        match self.op {
            Op::Exists => got.is_some() == self.value.as_bool().unwrap_or(true),
            Op::Eq => got.is_some_and(|g| json_eq(g, &self.value)),
            Op::Ne => !got.is_some_and(|g| json_eq(g, &self.value)),
            Op::Gt | Op::Ge | Op::Lt | Op::Le => {
                let Some(ord) = got.and_then(|g| compare(g, &self.value)) else {
                    return false;
                };
                match self.op {
                    Op::Gt => ord == Ordering::Greater,
                    Op::Ge => ord != Ordering::Less,
                    Op::Lt => ord == Ordering::Less,
                    _ => ord != Ordering::Greater,
                }
            }
        }
    }
}

fn json_eq(a: &Value, b: &Value) -> bool {
    match (a.as_f64(), b.as_f64()) {
        (Some(x), Some(y)) => x == y,
        _ => a == b,
    }
}

fn compare(a: &Value, b: &Value) -> Option<Ordering> {
    match (a, b) {
        (Value::Number(x), Value::Number(y)) => x.as_f64()?.partial_cmp(&y.as_f64()?),
        (Value::String(x), Value::String(y)) => Some(x.cmp(y)),
        _ => None,
    }
}

// ---------------------------------------------------------------------------------------
// Templates.

/// A parsed template: literal text and `{path|filter...}` placeholders.
#[derive(Debug, Clone, PartialEq)]
pub struct Template(Vec<Piece>);

#[derive(Debug, Clone, PartialEq)]
enum Piece {
    Text(String),
    Field { path: String, filters: Vec<Filter> },
}

#[derive(Debug, Clone, PartialEq)]
enum Filter {
    Round(usize),
    Div(f64),
    Mul(f64),
    Time,
    HourMinute,
    SecsBefore(SystemTime),
    Default(String),
}

/// A value between filters: JSON until a filter formats it as text.
enum Rendered {
    Json(Value),
    Text(String),
}

impl Template {
    /// Parses `text`.
    ///
    /// # Errors
    ///
    /// Unbalanced braces, an empty path or an unknown filter, named.
    pub fn parse(text: &str) -> Result<Self, String> {
        let mut pieces = Vec::new();
        let mut literal = String::new();
        let mut chars = text.chars().peekable();
        while let Some(c) = chars.next() {
            match c {
                '{' if chars.peek() == Some(&'{') => {
                    chars.next();
                    literal.push('{');
                }
                '}' if chars.peek() == Some(&'}') => {
                    chars.next();
                    literal.push('}');
                }
                '{' => {
                    let mut inner = String::new();
                    loop {
                        match chars.next() {
                            Some('}') => break,
                            Some(c) => inner.push(c),
                            None => {
                                return Err(format!(
                                    "template {text:?} opens `{{` without closing it; write `{{{{` for a literal brace"
                                ));
                            }
                        }
                    }
                    if !literal.is_empty() {
                        pieces.push(Piece::Text(std::mem::take(&mut literal)));
                    }
                    pieces.push(parse_field(&inner)?);
                }
                '}' => {
                    return Err(format!(
                        "template {text:?} closes `}}` without opening it; write `}}}}` for a literal brace"
                    ));
                }
                c => literal.push(c),
            }
        }
        if !literal.is_empty() {
            pieces.push(Piece::Text(literal));
        }
        Ok(Self(pieces))
    }

    /// The path, when the template is exactly one placeholder without filters.
    fn whole_path(&self) -> Option<&str> {
        match self.0.as_slice() {
            [Piece::Field { path, filters }] if filters.is_empty() => Some(path),
            _ => None,
        }
    }

    /// Fills the template from `output`.
    ///
    /// # Errors
    ///
    /// A path the output lacks (without `default`), or a filter that does not fit its
    /// value.
    pub fn render(&self, output: &Value) -> Result<String, String> {
        let mut out = String::new();
        for piece in &self.0 {
            match piece {
                Piece::Text(t) => out.push_str(t),
                Piece::Field { path, filters } => {
                    let mut value = resolve(output, path)
                        .filter(|v| !v.is_null())
                        .map(|v| Rendered::Json(v.clone()));
                    for f in filters {
                        value = apply(f, value, path)?;
                    }
                    match value {
                        None => return Err(format!("`{path}` is not in the output")),
                        Some(Rendered::Text(t)) => out.push_str(&t),
                        Some(Rendered::Json(Value::String(s))) => out.push_str(&s),
                        Some(Rendered::Json(Value::Number(n))) => out.push_str(&plain_number(&n)),
                        Some(Rendered::Json(v)) => out.push_str(&v.to_string()),
                    }
                }
            }
        }
        Ok(out)
    }
}

fn parse_field(inner: &str) -> Result<Piece, String> {
    let mut parts = inner.split('|');
    let path = parts.next().unwrap_or_default().trim().to_owned();
    if path.is_empty() {
        return Err(format!("placeholder {{{inner}}} names no path"));
    }
    let filters = parts
        .map(|f| {
            let (name, arg) = match f.split_once(':') {
                Some((n, a)) => (n.trim(), Some(a.trim())),
                None => (f.trim(), None),
            };
            let number = |what: &str| {
                arg.and_then(|a| a.parse::<f64>().ok())
                    .filter(|x| x.is_finite())
                    .ok_or_else(|| format!("filter `{name}` needs a number, e.g. `{name}:{what}`"))
            };
            Ok(match name {
                "round" => Filter::Round(
                    arg.and_then(|a| a.parse::<usize>().ok())
                        .filter(|n| *n <= 12)
                        .ok_or("filter `round` needs a number of decimals 0-12, e.g. `round:1`")?,
                ),
                "div" => {
                    let d = number("1000")?;
                    if d == 0.0 {
                        return Err("filter `div:0` divides by zero".to_owned());
                    }
                    Filter::Div(d)
                }
                "mul" => Filter::Mul(number("100")?),
                "time" => Filter::Time,
                "hm" => Filter::HourMinute,
                "secs_before" => Filter::SecsBefore(
                    arg.and_then(|a| parse_time(a).ok())
                        .ok_or("filter `secs_before` needs an RFC 3339 time, e.g. `secs_before:2026-07-23T02:02:00Z`")?,
                ),
                "default" => Filter::Default(arg.unwrap_or_default().to_owned()),
                other => {
                    return Err(format!(
                        "unknown filter `{other}`; use round, div, mul, time, hm, secs_before or default"
                    ));
                }
            })
        })
        .collect::<Result<Vec<_>, String>>()?;
    Ok(Piece::Field { path, filters })
}

fn apply(filter: &Filter, value: Option<Rendered>, path: &str) -> Result<Option<Rendered>, String> {
    let Some(value) = value else {
        return Ok(match filter {
            Filter::Default(text) => Some(Rendered::Text(text.clone())),
            _ => None,
        });
    };
    let as_number = || match &value {
        Rendered::Json(v) => v
            .as_f64()
            .ok_or_else(|| format!("`{path}` is not a number")),
        Rendered::Text(t) => t
            .parse::<f64>()
            .map_err(|_| format!("`{path}` is not a number")),
    };
    let as_time = || {
        let text = match &value {
            Rendered::Json(Value::String(s)) | Rendered::Text(s) => s.as_str(),
            Rendered::Json(_) => return Err(format!("`{path}` is not a time")),
        };
        parse_time(text).map_err(|e| format!("`{path}` is not an RFC 3339 time ({e})"))
    };
    let number = |x: f64| Rendered::Json(crate::tools::number(x));
    Ok(Some(match filter {
        Filter::Round(n) => Rendered::Text(format!("{:.*}", *n, as_number()?)),
        Filter::Div(d) => number(as_number()? / d),
        Filter::Mul(m) => number(as_number()? * m),
        Filter::Time => Rendered::Text(clock(as_time()?, true)),
        Filter::HourMinute => Rendered::Text(clock(as_time()?, false)),
        Filter::SecsBefore(until) => {
            let t = as_time()?;
            let secs = match until.duration_since(t) {
                Ok(d) => d.as_secs_f64().round(),
                Err(e) => -e.duration().as_secs_f64().round(),
            };
            number(secs)
        }
        Filter::Default(_) => value,
    }))
}

/// A number as people write it: `42`, not `42.0`, for whole floats.
fn plain_number(n: &serde_json::Number) -> String {
    match n.as_f64() {
        // Whole floats within the range where every integer is exact print as integers.
        #[allow(clippy::cast_possible_truncation)]
        Some(x) if n.is_f64() && x.fract() == 0.0 && x.abs() < 9.0e15 => format!("{}", x as i64),
        _ => n.to_string(),
    }
}

/// `HH:MM:SS` (or `HH:MM`) of a UTC time.
fn clock(t: SystemTime, seconds: bool) -> String {
    let secs = t.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs()) % 86_400;
    let (h, m, s) = (secs / 3600, secs / 60 % 60, secs % 60);
    if seconds {
        format!("{h:02}:{m:02}:{s:02}")
    } else {
        format!("{h:02}:{m:02}")
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn output() -> Value {
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

    #[test]
    fn paths_index_arrays_and_find_dotted_keys() {
        let out = output();
        assert_eq!(resolve(&out, "changes.0.rule_id"), Some(&json!("RC-4711")));
        assert_eq!(resolve(&out, "groups.risk.rule"), Some(&json!(2)));
        assert_eq!(resolve(&out, "changes.1.rule_id"), None);
        assert_eq!(resolve(&out, "changes.x"), None);
        assert_eq!(resolve(&out, "matched.deeper"), None);
    }

    fn cond(path: &str, op: Op, value: Value) -> Condition {
        Condition {
            path: path.into(),
            op,
            value,
        }
    }

    #[test]
    fn conditions_compare_numbers_strings_and_presence() {
        let out = output();
        assert!(cond("matched", Op::Gt, json!(0)).holds(&out));
        assert!(!cond("matched", Op::Gt, json!(116)).holds(&out));
        assert!(cond("matched", Op::Ge, json!(116)).holds(&out));
        assert!(cond("matched", Op::Eq, json!(116.0)).holds(&out));
        assert!(cond("matched", Op::Le, json!(116)).holds(&out));
        assert!(!cond("matched", Op::Lt, json!(116)).holds(&out));
        assert!(cond("groups.timeout", Op::Ne, json!(0)).holds(&out));
        assert!(cond("first_ts", Op::Lt, json!("2026-07-23T02:02:00Z")).holds(&out));
        assert!(cond("changes.0.rule_id", Op::Eq, json!("RC-4711")).holds(&out));
        assert!(cond("changes.0.rule_id", Op::Exists, Value::Null).holds(&out));
        assert!(!cond("nothing", Op::Exists, Value::Null).holds(&out));
        assert!(cond("nothing", Op::Exists, json!(false)).holds(&out));
        // An absent value is not greater than anything, and not equal to anything.
        assert!(!cond("groups.declined", Op::Gt, json!(0)).holds(&out));
        assert!(cond("groups.declined", Op::Ne, json!(0)).holds(&out));
        // Mixed types never compare.
        assert!(!cond("first_ts", Op::Gt, json!(1)).holds(&out));
    }

    #[test]
    fn templates_fill_paths_and_apply_filters() {
        let out = output();
        let r = |t: &str| Template::parse(t).unwrap().render(&out);
        assert_eq!(r("{groups.timeout} of {matched}").unwrap(), "9 of 116");
        assert_eq!(
            r("{baseline|round:0} ms → {after|div:1000|round:1} s").unwrap(),
            "420 ms → 3.8 s"
        );
        assert_eq!(r("from {first_ts|time}").unwrap(), "from 02:01:18");
        assert_eq!(r("at {first_ts|hm}").unwrap(), "at 02:01");
        assert_eq!(
            r("{first_ts|secs_before:2026-07-23T02:02:00Z} s before").unwrap(),
            "42 s before"
        );
        assert_eq!(
            r("{groups.declined|default:0} declined").unwrap(),
            "0 declined"
        );
        assert_eq!(r("{{literal}}").unwrap(), "{literal}");
        assert_eq!(r("{baseline|mul:2}").unwrap(), "839.96");
        let err = r("{groups.declined}").unwrap_err();
        assert!(err.contains("groups.declined"), "{err}");
        let err = r("{changes.0.rule_id|round:1}").unwrap_err();
        assert!(err.contains("not a number"), "{err}");
    }

    #[test]
    fn template_syntax_errors_are_named() {
        assert!(
            Template::parse("{open")
                .unwrap_err()
                .contains("without closing")
        );
        assert!(
            Template::parse("close}")
                .unwrap_err()
                .contains("without opening")
        );
        assert!(Template::parse("{}").unwrap_err().contains("no path"));
        assert!(
            Template::parse("{x|shout}")
                .unwrap_err()
                .contains("unknown filter")
        );
        assert!(
            Template::parse("{x|round:many}")
                .unwrap_err()
                .contains("round")
        );
        assert!(
            Template::parse("{x|secs_before:noon}")
                .unwrap_err()
                .contains("RFC 3339")
        );
    }

    /// Plays `profile`'s playbook against the real tools over the example data; tool
    /// calls whose id is in `fail` get a failed outcome instead.
    async fn play(profile: &str, fail: &[&str]) -> (Vec<ToolCall>, FinalReport) {
        let profiles = crate::profiles::example().unwrap();
        let profile = profiles.iter().find(|p| p.profile.id == profile).unwrap();
        let provider = PlaybookProvider::for_profile(profile).unwrap();
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
        assert_eq!(second.finish, FinishReason::Stop);
        (calls, FinalReport::parse(&second.message.content).unwrap())
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
        assert_eq!(impact.evidence_from, ["confirm_outcomes"]);
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
        assert_eq!(cause.evidence_from, ["pool_exhaustion", "confirm_outcomes"]);
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
        assert_eq!(cause.evidence_from, ["rule_changes"]);
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
        assert_eq!(action.evidence_from, ["rule_changes", "rule_hit_rate"]);
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
            claim(&report, "primary_cause").evidence_from,
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
