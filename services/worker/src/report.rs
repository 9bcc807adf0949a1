//! The structured messages a model exchanges with the agent loop: the outcome of a tool
//! call (the content of a tool message) and the final report (the content of the last
//! assistant message).
//!
//! Both are JSON, so the deterministic playbook and a hosted model speak the same
//! protocol. Citations in a report name *tool calls* (`evidence_from: [<call id>]`);
//! the loop maps them to the evidence ids it recorded for those calls, so a model can
//! never cite evidence that was not gathered in this task.

use serde::{Deserialize, Serialize};
use serde_json::Value;

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

/// The model's final answer.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct FinalReport {
    /// Short summary.
    pub summary: String,
    /// Checkable claims.
    #[serde(default)]
    pub claims: Vec<ReportClaim>,
    /// Recommended actions (never performed by the worker).
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
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReportClaim {
    /// Id unique within the report; the loop numbers claims that have none.
    #[serde(default)]
    pub claim_id: String,
    /// The key conflicts are found on, e.g. `primary_cause`.
    pub topic: String,
    /// Normalized value on the topic.
    pub value: String,
    /// Human-readable statement.
    pub statement: String,
    /// Tool call ids (or evidence ids) the claim rests on.
    #[serde(default)]
    pub evidence_from: Vec<String>,
    /// Confidence in `[0, 1]`.
    #[serde(default = "default_confidence")]
    pub confidence: f64,
}

/// One proposed action of a report.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
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
    /// Tool call ids (or evidence ids) that support it.
    #[serde(default)]
    pub evidence_from: Vec<String>,
}

fn default_confidence() -> f64 {
    0.5
}

impl FinalReport {
    /// Reads a final report from an assistant message, tolerating a Markdown code fence
    /// around the JSON, which chat models often add.
    ///
    /// # Errors
    ///
    /// The content is not a final report; the message says what is wrong.
    pub fn parse(content: &str) -> Result<Self, String> {
        let trimmed = content.trim();
        let body = trimmed
            .strip_prefix("```json")
            .or_else(|| trimmed.strip_prefix("```"))
            .and_then(|rest| rest.strip_suffix("```"))
            .unwrap_or(trimmed);
        serde_json::from_str(body.trim()).map_err(|e| {
            format!(
                "the answer is not a final report ({e}); answer with one JSON object with \
                 summary, claims, proposed_actions, missing_evidence and recommended_next"
            )
        })
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
    fn reports_parse_with_or_without_a_code_fence() {
        let json = r#"{"summary":"s","claims":[{"topic":"t","value":"v","statement":"x"}]}"#;
        let plain = FinalReport::parse(json).unwrap();
        assert_eq!(plain.claims[0].confidence, 0.5);
        assert!(plain.claims[0].evidence_from.is_empty());
        let fenced = FinalReport::parse(&format!("```json\n{json}\n```")).unwrap();
        assert_eq!(fenced, plain);
        let err = FinalReport::parse("I think it was the database").unwrap_err();
        assert!(err.contains("JSON object"), "{err}");
    }
}
