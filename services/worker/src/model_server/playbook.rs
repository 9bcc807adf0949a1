//! A responder that answers like a playbook: the scripted model of the model-driven
//! payment incident (end-to-end tests, `convene bench --workload model`).
//!
//! [`PlaybookResponder`] holds `playbook` profiles and, for each request, picks the one
//! whose tools are the tools offered (less `submit_report`). With no tool result in the
//! conversation yet it asks for every step's tool call in one turn; once the results
//! are in, it hands in the playbook's report through `submit_report`, its claims citing
//! the calls. The worker's `openai` provider, the loop's checks, the policy service and
//! the evidence store all run for real; only the model's judgment is the playbook's.

use std::collections::{BTreeMap, BTreeSet};

use super::{Recorded, Reply, Responder};
use crate::openai::function_name;
use crate::playbook::PlaybookProvider;
use crate::profiles::Profile;
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
}

impl PlaybookResponder {
    /// A responder playing every `playbook` profile of `profiles`.
    ///
    /// # Errors
    ///
    /// A playbook profile cannot be played, or two have the same tools (a request
    /// could not tell them apart).
    pub fn new(profiles: &[Profile]) -> Result<Self, String> {
        let mut by_tools: Vec<(BTreeSet<String>, PlaybookProvider)> = Vec::new();
        for p in profiles {
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
        Ok(Self { by_tools })
    }

    fn answer(&self, request: &Recorded) -> Result<Reply, String> {
        let offered: BTreeSet<String> = request
            .tools()
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
