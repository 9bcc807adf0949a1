//! The planner playbook: a `playbook` profile's `planner:` section, which plays a
//! planner's model as deterministically as a playbook plays a specialist's.
//!
//! ```yaml
//! planner:
//!   rounds:
//!     - delegate:                # the calls of this round's one turn, in order
//!         - profile_id: logs-investigator
//!           goal: "..."
//!           acceptance_criteria: ["..."]
//!           scope: { resources: ["service/payment-api"], time_range: { start: "...", end: "..." } }
//!           required_scopes: [ { action: "logs:read", resource: "service/*" } ]
//!           timeout_seconds: 15
//!     - when: conflict           # always (default) | conflict | gap
//!       delegate: [ ... ]
//!   finish:
//!     summary: "..."             # {outcome}: the last decision's outcome
//! ```
//!
//! Each turn the supervisor asks for, the provider reads the conversation:
//!
//! - the rounds already played: the assistant turns that call `delegate` (and the round
//!   their call ids name, `r<round>-<i>`, so a round skipped for its condition counts
//!   as taken);
//! - the last decision: the newest `user` message that is a JSON object with a
//!   `decision` key ([`messages::DecisionMessage`]).
//!
//! It answers with the first round not yet played whose `when` holds on the last
//! decision (`conflict`: the decision has a conflict; `gap`: a required result is
//! missing or a result was rejected; there is no decision before the first round), one
//! `delegate` call per entry with the call ids `r<round>-<i>` (round from 1, entry from
//! 0); with no such round left, it calls `finish` (call id `finish`) with the summary and
//! every claim id of the last decision's accepted results. When the newest message
//! answers `finish` with an error (the supervisor refused it), the answer is plain text
//! quoting the error. It consumes no tokens.

pub mod messages;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use self::messages::{DELEGATE, DecisionMessage, DelegateArgs, FINISH, FinishArgs};
use super::PROVIDER_NAME;
use crate::provider::{
    FinishReason, Message, ModelProvider, ModelRequest, ModelResponse, ProviderError, Role,
    TokenUsage, ToolCall,
};

/// The id of the planner playbook's `finish` call.
pub const FINISH_CALL_ID: &str = "finish";
/// What `{outcome}` becomes in the summary when no round has been decided.
const NO_OUTCOME: &str = "no decision";

/// A planner playbook as written in the profile file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PlannerSpec {
    /// The rounds, each one turn of `delegate` calls.
    pub rounds: Vec<PlannerRound>,
    /// How the planner ends the run.
    pub finish: PlannerFinish,
}

/// One round: the `delegate` calls of one turn, and when the round is played.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PlannerRound {
    /// When the round is played (default: always).
    #[serde(default)]
    pub when: RoundCondition,
    /// The tasks to delegate, in call order.
    pub delegate: Vec<DelegateArgs>,
}

/// When a round is played, judged on the last decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RoundCondition {
    /// Whatever was decided.
    #[default]
    Always,
    /// Only when the last decision has a conflict.
    Conflict,
    /// Only when the last decision misses a required result or rejected one.
    Gap,
}

impl RoundCondition {
    /// Whether a round with this condition is played after `decision` (None: before
    /// the first round).
    pub fn holds(self, decision: Option<&messages::Decision>) -> bool {
        match self {
            Self::Always => true,
            Self::Conflict => decision.is_some_and(messages::Decision::has_conflict),
            Self::Gap => decision.is_some_and(messages::Decision::has_gap),
        }
    }
}

/// The `finish` call's content.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PlannerFinish {
    /// The summary; `{outcome}` is replaced by the last decision's outcome name.
    #[serde(default)]
    pub summary: String,
}

impl PlannerSpec {
    /// Checks the planner; errors name the field below `field` (e.g.
    /// `profiles[3].planner.rounds[1].delegate[0].goal`).
    ///
    /// # Errors
    ///
    /// `(field, what is wrong)` for the first problem found.
    pub fn validate(&self, field: &str) -> Result<(), (String, String)> {
        if self.rounds.is_empty() {
            return Err((
                format!("{field}.rounds"),
                "a planner needs at least one round of `delegate` calls".into(),
            ));
        }
        for (i, round) in self.rounds.iter().enumerate() {
            let f = format!("{field}.rounds[{i}]");
            if round.delegate.is_empty() {
                return Err((
                    format!("{f}.delegate"),
                    "a round delegates at least one task; remove the round or add one".into(),
                ));
            }
            for (j, args) in round.delegate.iter().enumerate() {
                check_delegate(args, &format!("{f}.delegate[{j}]"))?;
            }
        }
        if self.finish.summary.trim().is_empty() {
            return Err((
                format!("{field}.finish.summary"),
                "give the summary the planner finishes with ({outcome} stands for the last \
                 decision's outcome)"
                    .into(),
            ));
        }
        Ok(())
    }
}

fn check_delegate(args: &DelegateArgs, f: &str) -> Result<(), (String, String)> {
    let empty = |name: &str, what: &str| Err((format!("{f}.{name}"), what.to_owned()));
    if args.profile_id.trim().is_empty() {
        return empty(
            "profile_id",
            "name the profile to delegate to, e.g. logs-investigator",
        );
    }
    if args.goal.trim().is_empty() {
        return empty("goal", "say what the delegated task must find out");
    }
    for (k, c) in args.acceptance_criteria.iter().enumerate() {
        if c.trim().is_empty() {
            return empty(
                &format!("acceptance_criteria[{k}]"),
                "a criterion must not be empty",
            );
        }
    }
    if let Some(scope) = &args.scope {
        for (k, r) in scope.resources.iter().enumerate() {
            if r.trim().is_empty() {
                return empty(
                    &format!("scope.resources[{k}]"),
                    "a resource must not be empty, e.g. service/payment-api",
                );
            }
        }
        if let Some(range) = &scope.time_range {
            let time = |which: &str, text: &str| {
                crate::tools::parse_time(text).map_err(|e| {
                    (
                        format!("{f}.scope.time_range.{which}"),
                        format!(
                            "{text:?} is not an RFC 3339 time ({e}), e.g. 2026-07-23T01:45:00Z"
                        ),
                    )
                })
            };
            let start = time("start", &range.start)?;
            let end = time("end", &range.end)?;
            if end <= start {
                return empty(
                    "scope.time_range.end",
                    "the window must end after it starts",
                );
            }
        }
    }
    for (k, s) in args.required_scopes.iter().enumerate() {
        if s.action.trim().is_empty() {
            return empty(
                &format!("required_scopes[{k}].action"),
                "name the action, e.g. logs:read",
            );
        }
        if s.resource.trim().is_empty() {
            return empty(
                &format!("required_scopes[{k}].resource"),
                "name the resource, e.g. service/*",
            );
        }
    }
    if args.timeout_seconds == Some(0) {
        return empty(
            "timeout_seconds",
            "give at least 1 second, or leave it out for the run's default",
        );
    }
    Ok(())
}

/// The `playbook` provider of a profile with a `planner:` section.
#[derive(Debug, Clone)]
pub struct PlannerProvider {
    profile_id: String,
    spec: PlannerSpec,
}

impl PlannerProvider {
    /// The provider playing `spec` for profile `profile_id`.
    ///
    /// # Errors
    ///
    /// The planner is invalid.
    pub fn new(profile_id: &str, spec: PlannerSpec) -> Result<Self, String> {
        spec.validate("planner")
            .map_err(|(field, detail)| format!("{field}: {detail}"))?;
        Ok(Self {
            profile_id: profile_id.to_owned(),
            spec,
        })
    }

    /// The profile the provider plays.
    pub fn profile_id(&self) -> &str {
        &self.profile_id
    }

    /// The next assistant message for the conversation `messages`. See the [module
    /// documentation](self).
    pub fn answer(&self, messages: &[Message]) -> Message {
        if let Some(error) = refused_finish(messages) {
            return Message::assistant(format!("The {FINISH} call was refused: {error}"));
        }
        let decision = messages
            .iter()
            .rev()
            .filter(|m| m.role == Role::User)
            .find_map(|m| DecisionMessage::parse(&m.content))
            .map(|m| m.decision);
        let next = self
            .spec
            .rounds
            .iter()
            .enumerate()
            .skip(rounds_played(messages))
            .find(|(_, r)| r.when.holds(decision.as_ref()));
        if let Some((index, round)) = next {
            let calls = round
                .delegate
                .iter()
                .enumerate()
                .map(|(i, args)| ToolCall {
                    id: format!("r{}-{i}", index + 1),
                    name: DELEGATE.to_owned(),
                    arguments: to_value(args),
                })
                .collect();
            return Message::tool_calls(calls);
        }
        let outcome = decision
            .as_ref()
            .map(|d| d.outcome.as_str())
            .filter(|o| !o.is_empty())
            .unwrap_or(NO_OUTCOME);
        let finish = FinishArgs {
            summary: self.spec.finish.summary.replace("{outcome}", outcome),
            cite: decision
                .as_ref()
                .map(messages::Decision::accepted_claim_ids)
                .unwrap_or_default(),
        };
        Message::tool_calls(vec![ToolCall {
            id: FINISH_CALL_ID.to_owned(),
            name: FINISH.to_owned(),
            arguments: to_value(&finish),
        }])
    }
}

fn to_value<T: Serialize>(value: &T) -> Value {
    // The argument types are plain strings, lists and numbers: they always serialize.
    serde_json::to_value(value).unwrap_or_default()
}

/// How many rounds the conversation has taken: the assistant turns that call
/// `delegate`, or, when it is more, the latest round named by a call id `r<round>-<i>`.
fn rounds_played(messages: &[Message]) -> usize {
    let turns = messages
        .iter()
        .filter(|m| m.role == Role::Assistant && m.tool_calls.iter().any(|c| c.name == DELEGATE))
        .count();
    let named = messages
        .iter()
        .filter(|m| m.role == Role::Assistant)
        .flat_map(|m| &m.tool_calls)
        .filter(|c| c.name == DELEGATE)
        .filter_map(|c| round_of(&c.id))
        .max()
        .unwrap_or(0);
    turns.max(named)
}

/// The round a call id `r<round>-<i>` names.
fn round_of(call_id: &str) -> Option<usize> {
    let (round, _) = call_id.strip_prefix('r')?.split_once('-')?;
    round.parse().ok()
}

/// The error the newest message gives for a `finish` call, when it answers one with an
/// error: the `error` of a JSON object, or the text when it is not JSON.
fn refused_finish(messages: &[Message]) -> Option<String> {
    let last = messages.last().filter(|m| m.role == Role::Tool)?;
    let id = last.tool_call_id.as_deref()?;
    let answers_finish = messages
        .iter()
        .rev()
        .filter(|m| m.role == Role::Assistant)
        .flat_map(|m| &m.tool_calls)
        .find(|c| c.id == id)
        .is_some_and(|c| c.name == FINISH);
    if !answers_finish {
        return None;
    }
    match serde_json::from_str::<Value>(&last.content) {
        Ok(Value::Object(map)) => map
            .get("error")
            .and_then(Value::as_str)
            .map(str::trim)
            .filter(|e| !e.is_empty())
            .map(str::to_owned),
        _ => Some(last.content.trim().to_owned()).filter(|e| !e.is_empty()),
    }
}

#[async_trait::async_trait]
impl ModelProvider for PlannerProvider {
    fn name(&self) -> &str {
        PROVIDER_NAME
    }

    fn has_context_window(&self) -> bool {
        false
    }

    fn records_turns(&self) -> bool {
        false
    }

    async fn complete(&self, request: &ModelRequest) -> Result<ModelResponse, ProviderError> {
        let message = self.answer(&request.messages);
        let finish = if message.tool_calls.is_empty() {
            FinishReason::Stop
        } else {
            FinishReason::ToolCalls
        };
        Ok(ModelResponse {
            model: String::new(),
            message,
            finish,
            usage: TokenUsage::default(),
        })
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    const SPEC: &str = r#"
rounds:
  - delegate:
      - profile_id: logs-investigator
        goal: Find the errors
        acceptance_criteria: ["Cite the queries"]
        scope: { resources: ["service/payment-api"], time_range: { start: "2026-07-23T01:45:00Z", end: "2026-07-23T02:10:00Z" } }
        required_scopes: [ { action: "logs:read", resource: "service/*" } ]
        timeout_seconds: 15
      - profile_id: change-auditor
        goal: Find the changes
  - when: conflict
    delegate:
      - { profile_id: change-auditor, goal: Settle the cause }
  - when: gap
    delegate:
      - { profile_id: logs-investigator, goal: Try again }
finish:
  summary: "Decided: {outcome}."
"#;

    fn provider() -> PlannerProvider {
        PlannerProvider::new("planner", serde_yaml::from_str(SPEC).unwrap()).unwrap()
    }

    fn decision(value: serde_json::Value) -> Message {
        Message::user(json!({"round": 1, "decision": value, "next": "go on"}).to_string())
    }

    fn ids(m: &Message) -> Vec<&str> {
        m.tool_calls.iter().map(|c| c.id.as_str()).collect()
    }

    /// The conversation after the first round, decided as `decided`.
    fn after_first_round(p: &PlannerProvider, decided: serde_json::Value) -> Vec<Message> {
        let mut messages = vec![Message::user("Plan the incident")];
        let first = p.answer(&messages);
        for call in &first.tool_calls {
            messages.push(Message::tool_result(&call.id, r#"{"delegation_id":"d"}"#));
        }
        messages.insert(1, first);
        messages.push(decision(decided));
        messages
    }

    #[test]
    fn the_first_round_delegates_every_entry_with_the_schema_arguments() {
        let p = provider();
        let first = p.answer(&[Message::user("Plan the incident")]);
        assert_eq!(ids(&first), ["r1-0", "r1-1"]);
        assert!(first.tool_calls.iter().all(|c| c.name == DELEGATE));
        assert_eq!(
            first.tool_calls[0].arguments,
            json!({
                "profile_id": "logs-investigator",
                "goal": "Find the errors",
                "acceptance_criteria": ["Cite the queries"],
                "scope": {"resources": ["service/payment-api"],
                          "time_range": {"start": "2026-07-23T01:45:00Z", "end": "2026-07-23T02:10:00Z"}},
                "required_scopes": [{"action": "logs:read", "resource": "service/*"}],
                "timeout_seconds": 15,
                "may_redelegate": false
            })
        );
        assert_eq!(
            first.tool_calls[1].arguments,
            json!({"profile_id": "change-auditor", "goal": "Find the changes",
                   "acceptance_criteria": [], "may_redelegate": false})
        );
    }

    #[test]
    fn a_conflict_plays_the_conflict_round_and_then_finishes() {
        let p = provider();
        let mut messages = after_first_round(
            &p,
            json!({"outcome": "JOIN_OUTCOME_CONFLICT_REQUIRES_HUMAN",
                   "accepted": [{"claims": [{"claim_id": "c-logs"}]}],
                   "conflicts": [{"topic": "primary_cause"}]}),
        );
        let second = p.answer(&messages);
        assert_eq!(ids(&second), ["r2-0"]);
        assert_eq!(second.tool_calls[0].arguments["goal"], "Settle the cause");
        messages.push(second);
        messages.push(Message::tool_result("r2-0", "{}"));
        messages.push(decision(json!({
            "outcome": "JOIN_OUTCOME_CONFLICT_REQUIRES_HUMAN",
            "accepted": [{"claims": [{"claim_id": "c-logs"}, {"claim_id": "c-rule"}]},
                         {"claims": [{"claim_id": "c-logs"}]}],
            "conflicts": [{"topic": "primary_cause"}]})));
        // Round 3 (gap) does not hold: finish, citing each accepted claim once.
        let last = p.answer(&messages);
        assert_eq!(ids(&last), [FINISH_CALL_ID]);
        assert_eq!(last.tool_calls[0].name, FINISH);
        assert_eq!(
            last.tool_calls[0].arguments,
            json!({"summary": "Decided: JOIN_OUTCOME_CONFLICT_REQUIRES_HUMAN.",
                   "cite": ["c-logs", "c-rule"]})
        );
    }

    #[test]
    fn a_skipped_round_counts_as_taken() {
        let p = provider();
        // No conflict but a gap: round 2 is skipped, round 3 is played.
        let mut messages = after_first_round(
            &p,
            json!({"outcome": "JOIN_OUTCOME_INSUFFICIENT_EVIDENCE", "missing_required": ["logs"]}),
        );
        let third = p.answer(&messages);
        assert_eq!(ids(&third), ["r3-0"]);
        messages.push(third);
        messages.push(Message::tool_result("r3-0", "{}"));
        messages.push(decision(
            json!({"outcome": "JOIN_OUTCOME_INSUFFICIENT_EVIDENCE", "missing_required": ["logs"]}),
        ));
        // Two delegating turns, but round 3 was the last: nothing is played twice.
        let last = p.answer(&messages);
        assert_eq!(ids(&last), [FINISH_CALL_ID]);
        assert_eq!(
            last.tool_calls[0].arguments["summary"],
            "Decided: JOIN_OUTCOME_INSUFFICIENT_EVIDENCE."
        );
    }

    #[test]
    fn a_refused_finish_is_answered_in_plain_text() {
        let p = provider();
        let mut messages = after_first_round(&p, json!({"outcome": "JOIN_OUTCOME_RESOLVED"}));
        let finish = p.answer(&messages);
        assert_eq!(ids(&finish), [FINISH_CALL_ID]);
        messages.push(finish);
        messages.push(Message::tool_result(
            FINISH_CALL_ID,
            json!({"error": "cite names claim c-9, which no accepted result holds"}).to_string(),
        ));
        let text = p.answer(&messages);
        assert!(text.tool_calls.is_empty());
        assert!(
            text.content.contains("cite names claim c-9"),
            "{}",
            text.content
        );
    }

    /// The example's `incident-planner`.
    fn example_spec() -> PlannerSpec {
        let file: serde_yaml::Value = serde_yaml::from_str(include_str!(
            "../../../../examples/payment-incident/profiles.yaml"
        ))
        .unwrap();
        let entry = file["profiles"]
            .as_sequence()
            .unwrap()
            .iter()
            .find(|p| p["id"].as_str() == Some("incident-planner"))
            .unwrap();
        serde_yaml::from_value(entry["planner"].clone()).unwrap()
    }

    #[test]
    fn the_example_planner_delegates_the_tasks_of_the_example_run() {
        let spec = example_spec();
        let run: serde_yaml::Value = serde_yaml::from_str(include_str!(
            "../../../../examples/payment-incident/run.yaml"
        ))
        .unwrap();
        let delegations = run["delegations"].as_sequence().unwrap();
        let first = &spec.rounds[0];
        assert_eq!(first.when, RoundCondition::Always);
        assert_eq!(first.delegate.len(), delegations.len());
        for (args, d) in first.delegate.iter().zip(delegations) {
            let as_written = |key: &str| serde_json::to_value(&d[key]).unwrap();
            assert_eq!(args.profile_id, d["profile_id"].as_str().unwrap());
            assert_eq!(args.goal, d["goal"].as_str().unwrap());
            assert_eq!(
                serde_json::to_value(&args.acceptance_criteria).unwrap(),
                as_written("acceptance_criteria")
            );
            assert_eq!(
                serde_json::to_value(&args.scope).unwrap(),
                as_written("scope")
            );
            assert_eq!(
                serde_json::to_value(&args.required_scopes).unwrap(),
                as_written("required_scopes")
            );
            assert_eq!(d["timeout"].as_str(), Some("15s"));
            assert_eq!(args.timeout_seconds, Some(15));
        }
        // The follow-up asks the change auditor, within its scope in the run.
        let follow_up = &spec.rounds[1];
        assert_eq!(follow_up.when, RoundCondition::Conflict);
        let [question] = follow_up.delegate.as_slice() else {
            panic!("one follow-up question");
        };
        assert_eq!(question.profile_id, "change-auditor");
        assert_eq!(question.scope, first.delegate[2].scope);
        assert_eq!(question.required_scopes, first.delegate[2].required_scopes);
        assert!(spec.finish.summary.contains("{outcome}"));
    }

    #[test]
    fn validation_names_the_field() {
        let field = |yaml: &str| {
            let spec: PlannerSpec = serde_yaml::from_str(yaml).unwrap();
            spec.validate("planner").unwrap_err().0
        };
        assert_eq!(
            field(&SPEC.replace("goal: Find the errors", "goal: \"\"")),
            "planner.rounds[0].delegate[0].goal"
        );
        assert_eq!(
            field(&SPEC.replace(
                "{ profile_id: change-auditor, goal: Settle the cause }",
                "{ profile_id: \"\", goal: x }"
            )),
            "planner.rounds[1].delegate[0].profile_id"
        );
        assert_eq!(
            field(&SPEC.replace("2026-07-23T02:10:00Z", "02:10")),
            "planner.rounds[0].delegate[0].scope.time_range.end"
        );
        assert_eq!(
            field(&SPEC.replace("timeout_seconds: 15", "timeout_seconds: 0")),
            "planner.rounds[0].delegate[0].timeout_seconds"
        );
        assert_eq!(
            field(&SPEC.replace("resource: \"service/*\"", "resource: \"\"")),
            "planner.rounds[0].delegate[0].required_scopes[0].resource"
        );
        assert_eq!(
            field(&SPEC.replace("\"Decided: {outcome}.\"", "\"\"")),
            "planner.finish.summary"
        );
        assert_eq!(
            field("rounds: []\nfinish: { summary: x }"),
            "planner.rounds"
        );
        let unknown =
            serde_yaml::from_str::<PlannerSpec>(&SPEC.replace("timeout_seconds", "timeout"));
        assert!(unknown.unwrap_err().to_string().contains("timeout"));
        let bad_when =
            serde_yaml::from_str::<PlannerSpec>(&SPEC.replace("when: gap", "when: sometimes"));
        assert!(bad_when.is_err());
    }
}
