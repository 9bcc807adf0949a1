//! The `playbook` provider: a profile's playbook or planner section, and the report a
//! playbook writes from tool outputs.

use std::collections::BTreeMap;

use convene_worker::playbook::planner::messages::DELEGATE;
use convene_worker::playbook::{PlannerProvider, PlannerSpec, PlaybookProvider, PlaybookSpec};
use convene_worker::provider::Message;
use convene_worker::report::ToolOutcome;

/// The line that separates the YAML section from the tool output (JSON) in an input.
pub const OUTPUT_SEPARATOR: &str = "\n#output\n";

/// A playbook or planner section (YAML) and, after [`OUTPUT_SEPARATOR`], a JSON value.
///
/// A playbook that its profile's tools accept (here: the tools its steps name) asks for
/// its tool calls and writes its report with the JSON as every step's output, then with
/// every other step failed. A planner that validates answers a conversation whose user
/// message is the JSON text (a join decision, when it reads as one).
pub fn playbook(data: &[u8]) {
    let Some(text) = crate::text(data) else {
        return;
    };
    let (section, output) = match text.split_once(OUTPUT_SEPARATOR) {
        Some((section, output)) => (section, output),
        None => (text, ""),
    };
    let value: serde_json::Value = serde_json::from_str(output).unwrap_or_default();
    if let Ok(spec) = serde_yaml::from_str::<PlaybookSpec>(section) {
        let mut tools: Vec<String> = spec.steps.iter().map(|s| s.tool.clone()).collect();
        tools.sort();
        tools.dedup();
        let steps: Vec<String> = spec.steps.iter().map(|s| s.id.clone()).collect();
        if let Ok(provider) = PlaybookProvider::new("profile", &tools, spec) {
            let _ = provider.tool_calls();
            let all: BTreeMap<String, ToolOutcome> = steps
                .iter()
                .map(|id| {
                    let outcome = ToolOutcome::success(format!("logs://{id}"), value.clone());
                    (id.clone(), outcome)
                })
                .collect();
            let _ = provider.report(&all);
            let some: BTreeMap<String, ToolOutcome> = all.into_iter().step_by(2).collect();
            let _ = provider.report(&some);
        }
    }
    if let Ok(spec) = serde_yaml::from_str::<PlannerSpec>(section) {
        let rounds = spec.rounds.len();
        if let Ok(provider) = PlannerProvider::new("planner", spec) {
            plan(&provider, rounds, output);
        }
    }
}

/// A planner's conversation: the goal, then after every round of `delegate` calls the
/// `decision` text as the join's answer, until it finishes (at most one turn a round).
fn plan(provider: &PlannerProvider, rounds: usize, decision: &str) {
    let mut messages = vec![Message::user("Assess the incident.")];
    for _ in 0..=rounds {
        let answer = provider.answer(&messages);
        let delegated = answer.tool_calls.iter().any(|c| c.name == DELEGATE);
        messages.push(answer);
        if !delegated {
            break;
        }
        messages.push(Message::user(decision));
    }
}
