//! A responder that answers like a playbook: the scripted model of the model-driven
//! payment incident (end-to-end tests, `convene bench --workload model`).
//!
//! [`PlaybookResponder`] holds `playbook` profiles and, for each request, picks the one
//! whose tools are the tools offered (less `submit_report`). With no tool result in the
//! conversation yet it asks for every step's tool call in one turn; once the results
//! are in, it hands in the playbook's report through `submit_report`, its claims citing
//! the calls. The worker's `openai` provider, the loop's checks, the policy service and
//! the evidence store all run for real; only the model's judgment is the playbook's.
//!
//! It plays a planner too: a request offering exactly the tools `delegate` and `finish`
//! is answered by the `planner` section of the one profile that has it
//! ([`crate::playbook::planner`]), from the conversation the request carries.

use std::collections::{BTreeMap, BTreeSet};

use serde_json::Value;

use super::{Recorded, Reply, Responder};
use crate::openai::{function_name, tool_name};
use crate::playbook::planner::messages::{DELEGATE, FINISH};
use crate::playbook::{PlannerProvider, PlaybookProvider};
use crate::profiles::Profile;
use crate::provider::{Message, Role, ToolCall};
use crate::report::{SUBMIT_REPORT, ToolOutcome};

/// Usage a playbook answer reports, so token accounting and spans have numbers.
const PROMPT_TOKENS: u32 = 600;
/// See [`PROMPT_TOKENS`].
const COMPLETION_TOKENS: u32 = 60;

/// Answers chat-completions requests as the playbook of the profile whose tools are
/// offered would. See the [module documentation](self).
#[derive(Debug)]
pub struct PlaybookResponder {
    by_tools: Vec<(BTreeSet<String>, PlaybookProvider)>,
    planner: Option<PlannerProvider>,
}

impl PlaybookResponder {
    /// A responder playing every `playbook` profile of `profiles`, and the profile with
    /// a `planner` section, if there is one.
    ///
    /// # Errors
    ///
    /// A playbook profile cannot be played, two have the same tools (a request could
    /// not tell them apart), or two have a `planner` section.
    pub fn new(profiles: &[Profile]) -> Result<Self, String> {
        let mut by_tools: Vec<(BTreeSet<String>, PlaybookProvider)> = Vec::new();
        let mut planner: Option<PlannerProvider> = None;
        for p in profiles {
            if let Some(spec) = p.planner.clone() {
                if let Some(other) = &planner {
                    return Err(format!(
                        "profiles {} and {} both have a planner section; a request could not \
                         tell them apart",
                        other.profile_id(),
                        p.profile.id
                    ));
                }
                planner = Some(PlannerProvider::new(&p.profile.id, spec)?);
                continue;
            }
            let Some(spec) = p.playbook.clone() else {
                continue;
            };
            let tools: BTreeSet<String> = p
                .profile
                .default_tools
                .iter()
                .map(|t| function_name(t))
                .collect();
            if by_tools.iter().any(|(t, _)| *t == tools) {
                return Err(format!(
                    "two playbook profiles have the tools {tools:?}; a request could not tell \
                     them apart"
                ));
            }
            let provider = PlaybookProvider::new(&p.profile.id, &p.profile.default_tools, spec)?;
            by_tools.push((tools, provider));
        }
        Ok(Self { by_tools, planner })
    }

    fn answer(&self, request: &Recorded) -> Result<Reply, String> {
        let tools: BTreeSet<&str> = request.tools().into_iter().collect();
        if tools == BTreeSet::from([DELEGATE, FINISH]) {
            return self.plan(request);
        }
        let offered: BTreeSet<String> = tools
            .into_iter()
            .filter(|f| *f != SUBMIT_REPORT)
            .map(str::to_owned)
            .collect();
        let playbook = self
            .by_tools
            .iter()
            .find(|(tools, _)| *tools == offered)
            .map(|(_, p)| p)
            .ok_or_else(|| format!("no playbook plays the tools {offered:?}"))?;
        let mut outcomes = BTreeMap::new();
        for m in request.messages() {
            if m["role"] != "tool" {
                continue;
            }
            let (Some(id), Some(content)) = (m["tool_call_id"].as_str(), m["content"].as_str())
            else {
                continue;
            };
            if let Ok(outcome) = ToolOutcome::from_content(content) {
                outcomes.insert(id.to_owned(), outcome);
            }
        }
        let reply = if outcomes.is_empty() {
            Reply::tool_calls(
                playbook
                    .tool_calls()
                    .into_iter()
                    .map(|c| (c.id, function_name(&c.name), c.arguments.to_string())),
            )
        } else {
            let report = serde_json::to_value(playbook.report(&outcomes))
                .map_err(|e| format!("cannot write the report: {e}"))?;
            Reply::tool_calls([(
                "report".to_owned(),
                SUBMIT_REPORT.to_owned(),
                report.to_string(),
            )])
        };
        Ok(reply.with_usage(PROMPT_TOKENS, COMPLETION_TOKENS))
    }

    /// A planner's turn, from the conversation the request carries.
    fn plan(&self, request: &Recorded) -> Result<Reply, String> {
        let planner = self.planner.as_ref().ok_or_else(|| {
            "the request offers the planner tools delegate and finish, and no profile has a \
             planner section"
                .to_owned()
        })?;
        let messages: Vec<Message> = request.messages().iter().filter_map(to_message).collect();
        let mut answer = planner.answer(&messages);
        // The playbook names the playbook specialists; a request that offers their
        // model-driven twins (`<id>-model`) gets those instead.
        let offered = offered_profiles(request);
        for call in &mut answer.tool_calls {
            let Some(profile) = call.arguments["profile_id"].as_str().map(str::to_owned) else {
                continue;
            };
            let twin = format!("{profile}-model");
            if !offered.is_empty() && !offered.contains(&profile) && offered.contains(&twin) {
                call.arguments["profile_id"] = Value::String(twin);
            }
        }
        let reply = if answer.tool_calls.is_empty() {
            Reply::text(answer.content)
        } else {
            Reply::tool_calls(
                answer
                    .tool_calls
                    .into_iter()
                    .map(|c| (c.id, function_name(&c.name), c.arguments.to_string())),
            )
        };
        Ok(reply.with_usage(PROMPT_TOKENS, COMPLETION_TOKENS))
    }
}

/// The profile ids the request's `delegate` tool offers (its `profile_id` enum).
fn offered_profiles(request: &Recorded) -> Vec<String> {
    let tools = request.body["tools"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    tools
        .iter()
        .find(|t| t["function"]["name"] == DELEGATE)
        .and_then(|t| {
            t["function"]["parameters"]["properties"]["profile_id"]["enum"]
                .as_array()
                .cloned()
        })
        .unwrap_or_default()
        .iter()
        .filter_map(|v| v.as_str().map(str::to_owned))
        .collect()
}

/// A chat-completions message as the provider's [`Message`] (`developer` is read as
/// `system`); None for a message without a known role.
fn to_message(m: &Value) -> Option<Message> {
    let role = match m["role"].as_str()? {
        "system" | "developer" => Role::System,
        "user" => Role::User,
        "assistant" => Role::Assistant,
        "tool" => Role::Tool,
        _ => return None,
    };
    let content = match &m["content"] {
        Value::String(text) => text.clone(),
        // Content given as parts: their texts joined.
        Value::Array(parts) => parts.iter().filter_map(|p| p["text"].as_str()).collect(),
        _ => String::new(),
    };
    let tool_calls = m["tool_calls"]
        .as_array()
        .map(|calls| {
            calls
                .iter()
                .map(|c| {
                    let raw = c["function"]["arguments"].as_str().unwrap_or_default();
                    ToolCall {
                        id: c["id"].as_str().unwrap_or_default().to_owned(),
                        name: tool_name(c["function"]["name"].as_str().unwrap_or_default()),
                        arguments: serde_json::from_str(raw)
                            .unwrap_or_else(|_| Value::String(raw.to_owned())),
                    }
                })
                .collect()
        })
        .unwrap_or_default();
    Some(Message {
        role,
        content,
        tool_calls,
        tool_call_id: m["tool_call_id"].as_str().map(str::to_owned),
    })
}

impl Responder for PlaybookResponder {
    fn reply(&self, request: &Recorded) -> Reply {
        self.answer(request).unwrap_or_else(|why| {
            Reply::error(
                400,
                serde_json::json!({"error": {"message": why, "type": "invalid_request_error"}}),
            )
        })
    }
}
