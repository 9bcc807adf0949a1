//! Fault injection, for chaos and end-to-end tests only.
//!
//! A profile's optional `faults` section makes the worker misbehave in one precise way,
//! so tests can prove that the supervisor, the join and the evidence checks catch it:
//! a worker that hangs, is slow, fails transiently (before or after its tool calls),
//! answers for the wrong delegation, cites no or foreign evidence, lies about a hash, or
//! dies mid-task. Never set it in a profile that serves real work; the worker logs a
//! warning for every profile that has one.

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// The faults a profile injects. Every field defaults to "no fault".
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Faults {
    /// Execute never returns on its own: only the task's deadline (TIMED_OUT) or a
    /// Cancel ends it.
    pub hang: bool,
    /// Wait this long before starting (counts against the deadline), e.g. `"2s"`.
    #[serde(
        with = "convene_server::config::optional_duration",
        skip_serializing_if = "Option::is_none"
    )]
    pub delay: Option<Duration>,
    /// The first N attempts of every delegation return FAILED with `retryable = true`.
    pub fail_attempts: u32,
    /// The first N attempts of every delegation make their first round of tool calls
    /// (evidence stored, children delegated), then return FAILED with `retryable =
    /// true`: a retry repeats calls whose effects already happened.
    pub fail_attempts_after_tools: u32,
    /// Report this delegation id in the result instead of the task's.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub result_delegation_id: Option<String>,
    /// Report claims without their evidence references.
    pub drop_evidence_refs: bool,
    /// Record evidence under this scheme (e.g. `other://`) instead of the tool's, so the
    /// ids fall outside the profile's evidence prefixes.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub evidence_scheme: Option<String>,
    /// Report evidence with a content hash that differs from the stored artifact's.
    pub corrupt_evidence_hash: bool,
    /// Exit the process once the first round of tool calls is done, before any result
    /// is returned (a worker killed mid-task). Only the standalone binary exits; a
    /// worker hosted in another process abandons the task instead, as if it had died.
    pub exit_process_after_tools: bool,
}

impl Faults {
    /// Whether any fault is set.
    pub fn any(&self) -> bool {
        *self != Self::default()
    }

    /// The evidence scheme to use instead of `tool_scheme` (without `://`).
    pub fn scheme<'a>(&'a self, tool_scheme: &'a str) -> &'a str {
        self.evidence_scheme
            .as_deref()
            .map_or(tool_scheme, |s| s.trim_end_matches("://"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn faults_parse_from_yaml_and_default_to_none() {
        let f: Faults = serde_yaml::from_str("{}").unwrap();
        assert!(!f.any());
        assert_eq!(f.scheme("logs"), "logs");
        let f: Faults =
            serde_yaml::from_str("{ delay: 2s, fail_attempts: 1, evidence_scheme: 'other://' }")
                .unwrap();
        assert!(f.any());
        assert_eq!(f.fail_attempts_after_tools, 0);
        assert_eq!(f.delay, Some(Duration::from_secs(2)));
        assert_eq!(f.scheme("logs"), "other");
        let err = serde_yaml::from_str::<Faults>("{ hang: true, crash: true }").unwrap_err();
        assert!(err.to_string().contains("crash"), "{err}");
    }
}
