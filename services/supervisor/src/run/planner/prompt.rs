//! What a planner's model reads and writes: its tools (`delegate`, `finish`) and their
//! arguments, the task that opens its conversation, the answers to its calls and the
//! join's decision after each round. Pure functions of the run; the actor
//! ([`super`]) decides what to do with them.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use convene_core::time::to_timestamp;
use convene_proto::v1;
use serde::Deserialize;
use serde_json::{Value, json};

/// The tool a planner delegates with.
pub(crate) const DELEGATE: &str = "delegate";
/// The tool a planner ends the run with.
pub(crate) const FINISH: &str = "finish";

/// Longest timeout a planner may give one delegation (the run's deadline caps it too).
const MAX_TIMEOUT_SECONDS: u64 = 24 * 3600;

/// The standing rules of a planner, after its profile's own instructions.
pub(crate) const RULES: &str = "You plan a supervised investigation. Delegate work to \
specialists with the `delegate` tool: one call per task, several calls in one turn run \
concurrently, and their results come back in call order. After each round the join's \
decision follows as JSON: which results it accepted and rejected (with reasons), the \
required evidence still missing, and conflicts with both sides. Then either delegate a \
targeted follow-up for a conflict or a gap, or call `finish` with a summary. `finish` \
may cite only claims and evidence the join accepted; a conflict's claims are cited \
together or not at all. You cannot accept a rejected result or drop a conflict: the \
join decides, and the run ends as its last decision says.";

/// The tools offered to a planner that may delegate to `profiles`.
pub(crate) fn tools(profiles: &[String]) -> Vec<v1::ToolDefinition> {
    let delegate = json!({
        "type": "object",
        "properties": {
            "profile_id": {
                "type": "string",
                "enum": profiles,
                "description": "The specialist profile that runs the task."
            },
            "goal": {"type": "string", "description": "What the specialist must establish."},
            "acceptance_criteria": {
                "type": "array", "items": {"type": "string"},
                "description": "What a good answer contains."
            },
            "scope": {
                "type": "object",
                "properties": {
                    "resources": {
                        "type": "array", "items": {"type": "string"},
                        "description": "Resource selectors, e.g. service/payment-api or metric/payment.*"
                    },
                    "time_range": {
                        "type": "object",
                        "properties": {
                            "start": {"type": "string", "format": "date-time"},
                            "end": {"type": "string", "format": "date-time"}
                        },
                        "required": ["start", "end"],
                        "additionalProperties": false
                    }
                },
                "additionalProperties": false
            },
            "required_scopes": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "action": {"type": "string"},
                        "resource": {"type": "string"}
                    },
                    "required": ["action", "resource"],
                    "additionalProperties": false
                },
                "description": "Permissions the task needs, e.g. {action: logs:read, resource: service/*}."
            },
            "timeout_seconds": {"type": "integer", "minimum": 1},
            "may_redelegate": {"type": "boolean"}
        },
        "required": ["profile_id", "goal"],
        "additionalProperties": false
    });
    let finish = json!({
        "type": "object",
        "properties": {
            "summary": {"type": "string", "description": "The assessment, in words."},
            "cite": {
                "type": "array", "items": {"type": "string"},
                "description": "Ids of accepted claims or of evidence they cite."
            }
        },
        "required": ["summary"],
        "additionalProperties": false
    });
    vec![
        v1::ToolDefinition {
            name: DELEGATE.to_owned(),
            description: "Delegate one task to a specialist. Several calls in one turn run \
                          concurrently; each call's result is answered in call order once \
                          the round is over."
                .to_owned(),
            parameters: delegate.to_string(),
        },
        v1::ToolDefinition {
            name: FINISH.to_owned(),
            description: "End the run with a summary citing accepted claims and evidence. \
                          Call it alone, once the results you need are in."
                .to_owned(),
            parameters: finish.to_string(),
        },
    ]
}

/// A profile the planner may delegate to, as the planner is told it.
#[derive(Debug, Clone, Default)]
pub(crate) struct ProfileView {
    /// The profile id.
    pub(crate) id: String,
    /// What it is for, when a worker serving it described it.
    pub(crate) description: Option<String>,
    /// Its tools: name, the action each call performs, the resources it may read
    /// (within what the run may hand on), and what the tool does.
    pub(crate) tools: Vec<ToolView>,
}

/// One tool of an offered profile.
#[derive(Debug, Clone, Default)]
pub(crate) struct ToolView {
    pub(crate) name: String,
    pub(crate) action: String,
    pub(crate) reads: Vec<String>,
    pub(crate) description: String,
}

/// The lines that describe the offered profiles: each one's purpose, its tools, the
/// action each performs and the resources it reads, so scopes can be chosen well.
fn profile_lines(profiles: &[ProfileView]) -> String {
    let mut text = String::new();
    for p in profiles {
        text.push_str(&format!("- {}", p.id));
        if let Some(d) = p.description.as_deref().filter(|d| !d.trim().is_empty()) {
            text.push_str(&format!(": {}", d.trim()));
        }
        text.push('\n');
        for t in &p.tools {
            let reads = if t.reads.is_empty() {
                "nothing this run may hand on".to_owned()
            } else {
                t.reads.join(", ")
            };
            text.push_str(&format!("  - tool {} ({} on {reads})", t.name, t.action));
            if !t.description.trim().is_empty() {
                text.push_str(&format!(": {}", t.description.trim()));
            }
            text.push('\n');
        }
    }
    text
}

/// The task that opens a planner's conversation.
pub(crate) fn task_message(run: &v1::Run, profiles: &[ProfileView], limits: &LimitsView) -> String {
    let spec = run.spec.as_ref();
    let goal = spec.map_or("", |s| s.goal.as_str());
    let join = spec.and_then(|s| s.join.as_ref());
    let mut text = format!("Run {}. Goal of the run: {goal}\n\n", run.run_id);
    text.push_str(
        "Profiles you may delegate to, their tools, the action each tool performs and the \
         resources it reads:\n",
    );
    text.push_str(&profile_lines(profiles));
    text.push_str(
        "A delegation that leaves out scope gets the planner's (none: the run's grants \
         bound it), one that leaves out required_scopes gets what its profile's tools need \
         within that scope, one that leaves out acceptance_criteria gets the profile's \
         description; the answer to the call lists every default applied. Narrow scope and \
         required_scopes to the resources the task is about.\n",
    );
    text.push_str(&format!(
        "Limits: at most {} delegations at once (overflow {}), {} delegation round(s), \
         depth {}.\n",
        limits.max_parallel, limits.overflow, limits.max_rounds, limits.max_depth
    ));
    if let Some(join) = join {
        if !join.required_profiles.is_empty() {
            text.push_str(&format!(
                "The join requires an accepted result of: {}.\n",
                join.required_profiles.join(", ")
            ));
        }
        if let Some(min) = &join.minimum
            && !min.required_evidence_kinds.is_empty()
        {
            text.push_str(&format!(
                "Accepted claims must cite evidence of the kinds: {}.\n",
                min.required_evidence_kinds.join(", ")
            ));
        }
    }
    if let Some(labels) = spec.map(|s| &s.labels)
        && !labels.is_empty()
    {
        let labels: Vec<String> = labels.iter().map(|(k, v)| format!("{k}={v}")).collect();
        text.push_str(&format!("Labels: {}.\n", labels.join(", ")));
    }
    text
}

/// The run's limits as the planner is told them.
pub(crate) struct LimitsView {
    pub(crate) max_parallel: u32,
    pub(crate) overflow: &'static str,
    pub(crate) max_rounds: u32,
    pub(crate) max_depth: u32,
}

/// `delegate`'s arguments.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct DelegateArgs {
    profile_id: String,
    goal: String,
    #[serde(default)]
    acceptance_criteria: Vec<String>,
    #[serde(default)]
    scope: Option<ScopeArgs>,
    #[serde(default)]
    required_scopes: Vec<PermissionArgs>,
    #[serde(default)]
    timeout_seconds: Option<u64>,
    #[serde(default)]
    may_redelegate: bool,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ScopeArgs {
    #[serde(default)]
    resources: Vec<String>,
    #[serde(default)]
    time_range: Option<TimeRangeArgs>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct TimeRangeArgs {
    start: String,
    end: String,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct PermissionArgs {
    action: String,
    resource: String,
}

/// `finish`'s arguments.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct FinishArgs {
    pub(crate) summary: String,
    #[serde(default)]
    pub(crate) cite: Vec<String>,
}

/// Parses a tool call's arguments text, with a correction the model can act on.
fn parse<T: serde::de::DeserializeOwned>(tool: &str, arguments: &str) -> Result<T, String> {
    let text = if arguments.trim().is_empty() {
        "{}"
    } else {
        arguments
    };
    serde_json::from_str(text).map_err(|e| {
        format!(
            "the arguments of {tool} are not valid: {e}; send a JSON object that matches its schema"
        )
    })
}

/// A `delegate` call, call `index` of `round`, as a planned delegation. Its name says
/// where it was asked for and for whom: `r<round>c<index>-<profile>`.
pub(crate) fn delegation(
    arguments: &str,
    round: u32,
    index: u32,
) -> Result<v1::PlannedDelegation, String> {
    let a: DelegateArgs = parse(DELEGATE, arguments)?;
    let name = format!("r{round}c{index}-{}", a.profile_id);
    let time_range = match a.scope.as_ref().and_then(|s| s.time_range.as_ref()) {
        None => None,
        Some(tr) => Some(v1::TimeRange {
            start: Some(timestamp(&tr.start, "scope.time_range.start")?),
            end: Some(timestamp(&tr.end, "scope.time_range.end")?),
        }),
    };
    let timeout = match a.timeout_seconds {
        None => None,
        Some(0) => return Err("timeout_seconds must be at least 1".to_owned()),
        Some(s) => Some(convene_core::time::to_duration(Duration::from_secs(
            s.min(MAX_TIMEOUT_SECONDS),
        ))),
    };
    Ok(v1::PlannedDelegation {
        name,
        profile_id: a.profile_id,
        goal: a.goal,
        acceptance_criteria: a.acceptance_criteria,
        scope: a.scope.map(|s| v1::TaskScope {
            resources: s.resources,
            time_range,
        }),
        required_scopes: a
            .required_scopes
            .into_iter()
            .map(|p| v1::PermissionScope {
                action: p.action,
                resource: p.resource,
                data_scope: None,
            })
            .collect(),
        timeout,
        may_redelegate: a.may_redelegate,
        ..Default::default()
    })
}

fn timestamp(text: &str, field: &str) -> Result<prost_types::Timestamp, String> {
    humantime::parse_rfc3339_weak(text)
        .map(to_timestamp)
        .map_err(|e| format!("{field} {text:?} is not an RFC 3339 time: {e}"))
}

/// A `finish` call's arguments.
pub(crate) fn finish(arguments: &str) -> Result<FinishArgs, String> {
    let a: FinishArgs = parse(FINISH, arguments)?;
    if a.summary.trim().is_empty() {
        return Err("finish needs a summary: say what the run established".to_owned());
    }
    Ok(a)
}

/// What the join accepted, as `finish` may cite it.
#[derive(Debug, Default)]
pub(crate) struct Citable {
    /// Accepted claim ids and the evidence ids they cite.
    accepted: BTreeSet<String>,
    /// Claim ids of results the join rejected, with the reason.
    rejected: BTreeMap<String, String>,
    /// Per conflict: its topic and the claim ids on its sides.
    conflicts: Vec<(String, BTreeSet<String>)>,
}

impl Citable {
    /// What `decision` allows citing, over the run's ledger.
    pub(crate) fn of(run: &v1::Run, decision: Option<&v1::JoinDecision>) -> Self {
        let mut c = Citable::default();
        let Some(decision) = decision else { return c };
        let result_of = |id: &str| {
            run.delegations
                .iter()
                .find(|d| d.task.as_ref().is_some_and(|t| t.delegation_id == id))
                .and_then(|d| d.result.as_ref())
        };
        for id in &decision.accepted {
            if let Some(r) = result_of(id) {
                for claim in &r.claims {
                    c.accepted.insert(claim.claim_id.clone());
                    c.accepted.extend(claim.evidence_refs.iter().cloned());
                }
            }
        }
        for rejection in &decision.rejected {
            if let Some(r) = result_of(&rejection.delegation_id) {
                for claim in &r.claims {
                    c.rejected
                        .entry(claim.claim_id.clone())
                        .or_insert_with(|| rejection_name(rejection.reason).to_owned());
                }
            }
        }
        for conflict in &decision.conflicts {
            let sides = conflict.claims.iter().map(|c| c.claim_id.clone()).collect();
            c.conflicts.push((conflict.topic.clone(), sides));
        }
        c
    }

    /// Checks `finish`'s citations: only accepted claims and evidence, a conflict's
    /// sides together.
    pub(crate) fn check(&self, cite: &[String]) -> Result<(), String> {
        for id in cite {
            if self.accepted.contains(id) {
                continue;
            }
            if let Some(reason) = self.rejected.get(id) {
                return Err(format!(
                    "{id} is a claim of a result the join rejected ({reason}); a rejected \
                     result cannot be accepted: cite only accepted claims, or delegate a \
                     follow-up that establishes it"
                ));
            }
            return Err(format!(
                "{id} is not an accepted claim or evidence of one; cite only what the join \
                 accepted"
            ));
        }
        let cited: BTreeSet<&String> = cite.iter().collect();
        for (topic, sides) in &self.conflicts {
            let named = sides.iter().filter(|s| cited.contains(s)).count();
            if named > 0 && named < sides.len() {
                let all: Vec<&str> = sides.iter().map(String::as_str).collect();
                return Err(format!(
                    "the claims {} conflict on {topic}; cite every side of a conflict or \
                     none: a conflict cannot be dropped",
                    all.join(" and ")
                ));
            }
        }
        Ok(())
    }
}

fn rejection_name(reason: i32) -> &'static str {
    v1::RejectionReason::try_from(reason)
        .map_or("REJECTION_REASON_UNSPECIFIED", |r| r.as_str_name())
}

fn outcome_name(outcome: i32) -> &'static str {
    v1::JoinOutcome::try_from(outcome).map_or("JOIN_OUTCOME_UNSPECIFIED", |o| o.as_str_name())
}

fn claim_json(claim: &v1::Claim, delegation_id: Option<&str>) -> Value {
    let mut v = json!({
        "claim_id": claim.claim_id,
        "topic": claim.topic,
        "value": claim.value,
        "statement": claim.statement,
        "evidence_refs": claim.evidence_refs,
    });
    if let Some(id) = delegation_id {
        v["delegation_id"] = json!(id);
    }
    v
}

/// The answer to an accepted `delegate` call once its delegation is over.
pub(crate) fn delegate_answer(d: &v1::Delegation, decision: Option<&v1::JoinDecision>) -> String {
    let task = d.task.clone().unwrap_or_default();
    let state = v1::DelegationState::try_from(d.state)
        .map_or("DELEGATION_STATE_UNSPECIFIED", |s| s.as_str_name());
    let mut v = json!({
        "delegation_id": task.delegation_id,
        "profile_id": task.profile_id,
        "state": state,
    });
    if let Some(r) = &d.result {
        v["status"] = json!(
            v1::TaskStatus::try_from(r.status)
                .map_or("TASK_STATUS_UNSPECIFIED", |s| s.as_str_name())
        );
        v["summary"] = json!(r.summary);
        v["claims"] = r.claims.iter().map(|c| claim_json(c, None)).collect();
        if !r.missing_evidence.is_empty() {
            v["missing_evidence"] = json!(r.missing_evidence);
        }
        if let Some(e) = &r.error {
            v["error"] = json!(e.message);
        }
    } else if !d.detail.is_empty() {
        v["error"] = json!(d.detail);
    }
    if !d.defaults.is_empty() {
        v["defaults_applied"] = d
            .defaults
            .iter()
            .map(|a| json!({"field": a.field, "value": a.value, "source": a.source}))
            .collect();
    }
    if let Some(decision) = decision {
        if decision.accepted.contains(&task.delegation_id) {
            v["accepted"] = json!(true);
        } else if let Some(r) = decision
            .rejected
            .iter()
            .find(|r| r.delegation_id == task.delegation_id)
        {
            v["accepted"] = json!(false);
            v["rejected"] = json!({"reason": rejection_name(r.reason), "detail": r.detail});
        }
    }
    v.to_string()
}

/// The answer to a refused call.
pub(crate) fn error_answer(error: &str) -> String {
    json!({"error": error}).to_string()
}

/// The join's decision after `round`, as the planner reads it; `next` says what it may
/// do now.
pub(crate) fn decision_message(
    run: &v1::Run,
    decision: &v1::JoinDecision,
    round: u32,
    next: &str,
) -> String {
    let profile_of = |id: &str| {
        run.delegations
            .iter()
            .filter_map(|d| d.task.as_ref())
            .find(|t| t.delegation_id == id)
            .map(|t| t.profile_id.clone())
            .unwrap_or_default()
    };
    let result_of = |id: &str| {
        run.delegations
            .iter()
            .find(|d| d.task.as_ref().is_some_and(|t| t.delegation_id == id))
            .and_then(|d| d.result.as_ref())
    };
    let accepted: Vec<Value> = decision
        .accepted
        .iter()
        .map(|id| {
            let claims: Vec<Value> = result_of(id)
                .map(|r| r.claims.iter().map(|c| claim_json(c, None)).collect())
                .unwrap_or_default();
            json!({"delegation_id": id, "profile_id": profile_of(id), "claims": claims})
        })
        .collect();
    let rejected: Vec<Value> = decision
        .rejected
        .iter()
        .map(|r| {
            json!({
                "delegation_id": r.delegation_id,
                "profile_id": profile_of(&r.delegation_id),
                "reason": rejection_name(r.reason),
                "detail": r.detail,
            })
        })
        .collect();
    let conflicts: Vec<Value> = decision
        .conflicts
        .iter()
        .map(|c| {
            let sides: Vec<Value> = c
                .claims
                .iter()
                .map(|side| {
                    let claim = result_of(&side.delegation_id)
                        .and_then(|r| r.claims.iter().find(|x| x.claim_id == side.claim_id));
                    match claim {
                        Some(claim) => claim_json(claim, Some(&side.delegation_id)),
                        None => json!({
                            "claim_id": side.claim_id,
                            "delegation_id": side.delegation_id,
                            "value": side.value,
                            "statement": side.statement,
                            "evidence_refs": side.evidence_refs,
                        }),
                    }
                })
                .collect();
            json!({"topic": c.topic, "claims": sides, "next_query": c.next_query})
        })
        .collect();
    json!({
        "round": round,
        "decision": {
            "outcome": outcome_name(decision.outcome),
            "accepted": accepted,
            "rejected": rejected,
            "missing_required": decision.missing_required,
            "conflicts": conflicts,
            "reasons": decision.reasons,
        },
        "next": next,
    })
    .to_string()
}

/// A chat message.
pub(crate) fn message(role: &str, content: String) -> v1::ChatMessage {
    v1::ChatMessage {
        role: role.to_owned(),
        content,
        ..Default::default()
    }
}

/// The answer to call `call_id`.
pub(crate) fn tool_message(call_id: &str, content: String) -> v1::ChatMessage {
    v1::ChatMessage {
        role: "tool".to_owned(),
        content,
        tool_call_id: call_id.to_owned(),
        ..Default::default()
    }
}

/// Gives every call of a turn an id of its own: an empty or repeated model id becomes
/// `call-<turn>-<index>`, so every answer names exactly one call.
pub(crate) fn normalize_call_ids(message: &mut v1::ChatMessage, turn: u32) {
    let mut seen = BTreeSet::new();
    for (i, call) in message.tool_calls.iter_mut().enumerate() {
        if call.id.trim().is_empty() || !seen.insert(call.id.clone()) {
            call.id = format!("call-{turn}-{i}");
            seen.insert(call.id.clone());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_and_repeated_call_ids_are_replaced() {
        let call = |id: &str| v1::ChatToolCall {
            id: id.to_owned(),
            name: DELEGATE.to_owned(),
            arguments: "{}".to_owned(),
        };
        let mut m = v1::ChatMessage {
            role: "assistant".to_owned(),
            tool_calls: vec![call(""), call("a"), call("a"), call("b")],
            ..Default::default()
        };
        normalize_call_ids(&mut m, 3);
        let ids: Vec<&str> = m.tool_calls.iter().map(|c| c.id.as_str()).collect();
        assert_eq!(ids, ["call-3-0", "a", "call-3-2", "b"]);
    }

    #[test]
    fn delegate_arguments_become_a_planned_delegation() {
        let args = r#"{"profile_id":"logs-investigator","goal":"find errors",
            "scope":{"resources":["service/a"],"time_range":{"start":"2026-07-23T01:45:00Z","end":"2026-07-23T02:10:00Z"}},
            "required_scopes":[{"action":"logs:read","resource":"service/*"}],"timeout_seconds":15}"#;
        let p = delegation(args, 1, 0).expect("valid");
        assert_eq!(p.profile_id, "logs-investigator");
        assert_eq!(p.timeout.expect("timeout").seconds, 15);
        assert_eq!(p.required_scopes[0].action, "logs:read");
        let tr = p.scope.expect("scope").time_range.expect("range");
        assert!(tr.start.expect("start").seconds < tr.end.expect("end").seconds);
        let bad = delegation(r#"{"profile_id":"x","goal":"y","extra":1}"#, 1, 0);
        assert!(bad.unwrap_err().contains("unknown field `extra`"));
        let bad = delegation("not json", 1, 0);
        assert!(bad.unwrap_err().contains("not valid"));
        let bad = delegation(
            r#"{"profile_id":"x","goal":"y","scope":{"time_range":{"start":"yesterday","end":"now"}}}"#,
            1,
            0,
        );
        assert!(bad.unwrap_err().contains("RFC 3339"));
    }

    #[test]
    fn finish_may_cite_only_accepted_claims_and_whole_conflicts() {
        let c = Citable {
            accepted: ["a", "b", "c", "ev-1"].map(String::from).into(),
            rejected: [("r".to_owned(), "REJECTION_REASON_NO_CLAIMS".to_owned())].into(),
            conflicts: vec![("cause".to_owned(), ["a", "b"].map(String::from).into())],
        };
        c.check(&["a".into(), "b".into(), "ev-1".into()])
            .expect("both sides");
        c.check(&["c".into()]).expect("no side of the conflict");
        let e = c.check(&["a".into()]).unwrap_err();
        assert!(e.contains("conflict") && e.contains("cause"), "{e}");
        let e = c.check(&["r".into()]).unwrap_err();
        assert!(e.contains("rejected"), "{e}");
        let e = c.check(&["zzz".into()]).unwrap_err();
        assert!(e.contains("not an accepted claim"), "{e}");
        assert!(finish(r#"{"summary":"  "}"#).is_err());
    }
}
