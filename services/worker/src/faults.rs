//! Fault injection, for chaos and end-to-end tests only: TEST-ONLY.
//!
//! A profile's optional `faults` section makes the worker misbehave in one precise way,
//! so tests can prove that the supervisor, the join and the evidence checks catch it:
//! a worker that hangs, is slow, fails transiently (before or after its tool calls),
//! answers for the wrong delegation, cites no or foreign evidence, lies about a hash,
//! dies mid-task, or finishes a task whose answer never reaches the supervisor.
//!
//! The faults exist only with the `test-faults` cargo feature, which only the test
//! suites' dev-dependencies enable. In any other build [`Faults`] holds no fault and its
//! hooks do nothing, and a profile that asks for a fault fails to load with an error
//! saying fault injection is a test-only feature: it is refused, never silently ignored.
//! The agent loop calls the same hooks in either build.
//!
//! The bench's `hold` is not a fault: it is in every build ([`crate::hold`]).

#[cfg(feature = "test-faults")]
pub use injected::{Faults, Injected};
#[cfg(not(feature = "test-faults"))]
pub use refused::{Faults, Injected};

#[cfg(feature = "test-faults")]
mod injected {
    use std::time::Duration;

    use convene_core::ids::content_hash;
    use convene_proto::v1;
    use serde::{Deserialize, Serialize};

    /// Exit status of a process killed by the `exit_process_after_tools` fault.
    const FAULT_EXIT_CODE: i32 = 86;

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
        /// Record evidence under this scheme (e.g. `other://`) instead of the tool's, so
        /// the ids fall outside the profile's evidence prefixes.
        #[serde(skip_serializing_if = "Option::is_none")]
        pub evidence_scheme: Option<String>,
        /// Report evidence with a content hash that differs from the stored artifact's.
        pub corrupt_evidence_hash: bool,
        /// Exit the process once the first round of tool calls is done, before any
        /// result is returned (a worker killed mid-task). Only the standalone binary
        /// exits; a worker hosted in another process abandons the task instead, as if it
        /// had died.
        pub exit_process_after_tools: bool,
        /// The first N attempts of every delegation run to the end (evidence stored, the
        /// result kept in the worker's result cache), but their Execute answer is lost on
        /// the way back: the call fails as one whose connection dropped before the
        /// response arrived (UNAVAILABLE). The supervisor never sees the result and
        /// dispatches the delegation again.
        pub lose_response_attempts: u32,
    }

    /// An injected failure of one attempt: FAILED, retryable.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub struct Injected {
        /// The attempts that fail, from the first.
        attempts: u32,
        /// Whether the attempt failed after its first round of tool calls.
        after_tools: bool,
    }

    impl Injected {
        /// The error of the failed attempt `attempt`; `gathered` says what it did.
        pub fn error(&self, attempt: u32, gathered: &str) -> v1::ErrorInfo {
            let n = self.attempts;
            let message = if self.after_tools {
                format!(
                    "fault injection: the first {n} attempt(s) of every delegation fail \
                     after their tool calls ({gathered}); this was attempt {attempt}"
                )
            } else {
                format!(
                    "fault injection: the first {n} attempt(s) of every delegation fail; \
                     this was attempt {attempt}"
                )
            };
            v1::ErrorInfo {
                code: "injected_failure".to_owned(),
                retryable: true,
                message,
            }
        }
    }

    impl Faults {
        /// Whether any fault is set.
        pub fn any(&self) -> bool {
            *self != Self::default()
        }

        /// Checks the section; errors name the field below `field` (the profile).
        ///
        /// # Errors
        ///
        /// `(field, detail)` for an evidence scheme that is not a URI scheme.
        pub fn check(&self, field: &str) -> Result<(), (String, String)> {
            if let Some(scheme) = &self.evidence_scheme {
                let name = scheme.trim_end_matches("://");
                let ok = name.chars().next().is_some_and(|c| c.is_ascii_alphabetic())
                    && name
                        .chars()
                        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.'));
                if !ok {
                    return Err((
                        format!("{field}.faults.evidence_scheme"),
                        format!("{scheme:?} is not a URI scheme; write e.g. `other://`"),
                    ));
                }
            }
            Ok(())
        }

        /// `fail_attempts`: whether attempt `attempt` fails before it starts.
        pub fn fail_before_start(&self, attempt: u32) -> Option<Injected> {
            (attempt <= self.fail_attempts).then_some(Injected {
                attempts: self.fail_attempts,
                after_tools: false,
            })
        }

        /// `delay` and `hang`, before the loop's first model call.
        pub async fn before_loop(&self) {
            if let Some(delay) = self.delay {
                tokio::time::sleep(delay).await;
            }
            if self.hang {
                std::future::pending::<()>().await;
            }
        }

        /// After the first round of tool calls: `exit_process_after_tools` (the process
        /// exits when `exit_process` allows it, or the task is abandoned as if it had),
        /// then `fail_attempts_after_tools` for attempt `attempt`.
        pub async fn after_tools(
            &self,
            attempt: u32,
            exit_process: bool,
            profile_id: &str,
        ) -> Option<Injected> {
            if self.exit_process_after_tools {
                if exit_process {
                    tracing::error!(
                        profile = %profile_id,
                        "fault injection: exiting the process mid-task (exit_process_after_tools)"
                    );
                    std::process::exit(FAULT_EXIT_CODE);
                }
                tracing::warn!(
                    profile = %profile_id,
                    "fault injection: abandoning the task mid-task (exit_process_after_tools, process exit disabled)"
                );
                std::future::pending::<()>().await;
            }
            (attempt <= self.fail_attempts_after_tools).then_some(Injected {
                attempts: self.fail_attempts_after_tools,
                after_tools: true,
            })
        }

        /// `lose_response_attempts`: the status that replaces the Execute answer of
        /// attempt `attempt` of `delegation_id`, whose result the worker has.
        pub fn lose_response(&self, attempt: u32, delegation_id: &str) -> Option<tonic::Status> {
            (attempt <= self.lose_response_attempts).then(|| {
                tracing::warn!(
                    delegation_id,
                    attempt,
                    "fault injection: the answer to this Execute call is lost (lose_response_attempts)"
                );
                tonic::Status::unavailable(format!(
                    "fault injection: the first {} attempt(s) of every delegation lose their \
                     answer on the way back (connection reset); this was attempt {attempt}",
                    self.lose_response_attempts
                ))
            })
        }

        /// The evidence scheme to use instead of `tool_scheme` (without `://`).
        pub fn scheme<'a>(&'a self, tool_scheme: &'a str) -> &'a str {
            self.evidence_scheme
                .as_deref()
                .map_or(tool_scheme, |s| s.trim_end_matches("://"))
        }

        /// `result_delegation_id`, `drop_evidence_refs` and `corrupt_evidence_hash`,
        /// applied to the finished result.
        pub fn tamper(&self, result: &mut v1::TaskResult) {
            if let Some(id) = &self.result_delegation_id {
                result.delegation_id = id.clone();
            }
            if self.drop_evidence_refs {
                for c in &mut result.claims {
                    c.evidence_refs.clear();
                }
            }
            if self.corrupt_evidence_hash {
                for e in &mut result.evidence {
                    e.content_hash =
                        content_hash(format!("corrupted:{}", e.content_hash).as_bytes());
                }
            }
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
            let f: Faults = serde_yaml::from_str(
                "{ delay: 2s, fail_attempts: 1, evidence_scheme: 'other://' }",
            )
            .unwrap();
            assert!(f.any());
            assert_eq!(f.fail_attempts_after_tools, 0);
            assert_eq!(f.delay, Some(Duration::from_secs(2)));
            assert_eq!(f.scheme("logs"), "other");
            let err = serde_yaml::from_str::<Faults>("{ hang: true, crash: true }").unwrap_err();
            assert!(err.to_string().contains("crash"), "{err}");
            // `hold` is a profile setting of its own, not a fault.
            let err = serde_yaml::from_str::<Faults>("{ hold: { release: /tmp/go } }").unwrap_err();
            assert!(err.to_string().contains("hold"), "{err}");
        }

        #[test]
        fn failures_are_injected_into_the_first_attempts() {
            let f = Faults {
                fail_attempts: 2,
                ..Faults::default()
            };
            assert!(f.fail_before_start(2).is_some());
            assert!(f.fail_before_start(3).is_none());
            let e = f.fail_before_start(1).unwrap().error(1, "");
            assert_eq!(e.code, "injected_failure");
            assert!(e.retryable);
            assert!(e.message.contains("first 2 attempt(s)"), "{}", e.message);
        }

        #[test]
        fn the_first_attempts_lose_their_answer_as_a_dropped_connection() {
            let f: Faults = serde_yaml::from_str("{ lose_response_attempts: 1 }").unwrap();
            assert!(f.any());
            let lost = f.lose_response(1, "del-1").expect("attempt 1 is lost");
            assert_eq!(lost.code(), tonic::Code::Unavailable);
            assert!(lost.message().contains("attempt 1"), "{}", lost.message());
            assert!(f.lose_response(2, "del-1").is_none());
            assert!(Faults::default().lose_response(1, "del-1").is_none());
        }
    }
}

/// A build without the `test-faults` feature: a profile may ask for no fault.
#[cfg(not(feature = "test-faults"))]
mod refused {
    use std::collections::BTreeMap;

    use convene_proto::v1;
    use serde::{Deserialize, Serialize};

    /// What a profile's `faults` section asked for. This build injects nothing: a
    /// section that asks for anything is refused when the profile is checked.
    #[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
    #[serde(transparent)]
    pub struct Faults {
        /// The section as written, kept only to name it in the refusal.
        asked: BTreeMap<String, serde_json::Value>,
    }

    /// An injected failure, which this build never makes.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum Injected {}

    impl Injected {
        /// Unreachable: there is no injected failure to describe.
        pub fn error(&self, _attempt: u32, _gathered: &str) -> v1::ErrorInfo {
            match *self {}
        }
    }

    impl Faults {
        /// Whether the section asks for anything.
        pub fn any(&self) -> bool {
            !self.asked.is_empty()
        }

        /// Refuses a section that asks for a fault.
        ///
        /// # Errors
        ///
        /// `(field, detail)` when the section asks for anything.
        pub fn check(&self, field: &str) -> Result<(), (String, String)> {
            if !self.any() {
                return Ok(());
            }
            Err((
                format!("{field}.faults"),
                format!(
                    "fault injection ({}) is a test-only feature, and this worker was built \
                     without it (cargo feature `test-faults` of convene-worker, enabled only \
                     by the test suites); remove the `faults` section",
                    self.asked.keys().cloned().collect::<Vec<_>>().join(", ")
                ),
            ))
        }

        /// No attempt fails.
        pub fn fail_before_start(&self, _attempt: u32) -> Option<Injected> {
            None
        }

        /// Nothing to wait for.
        pub async fn before_loop(&self) {}

        /// Nothing happens after the tool calls.
        pub async fn after_tools(
            &self,
            _attempt: u32,
            _exit_process: bool,
            _profile_id: &str,
        ) -> Option<Injected> {
            None
        }

        /// Every answer reaches the caller.
        pub fn lose_response(&self, _attempt: u32, _delegation_id: &str) -> Option<tonic::Status> {
            None
        }

        /// The tool's own scheme.
        pub fn scheme<'a>(&'a self, tool_scheme: &'a str) -> &'a str {
            tool_scheme
        }

        /// The result stays as it is.
        pub fn tamper(&self, _result: &mut v1::TaskResult) {}
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn a_fault_is_refused_as_test_only() {
            let none: Faults = serde_yaml::from_str("{}").unwrap();
            assert!(none.check("profiles[0]").is_ok());
            let asked: Faults = serde_yaml::from_str("{ hang: true }").unwrap();
            let (field, detail) = asked.check("profiles[0]").unwrap_err();
            assert_eq!(field, "profiles[0].faults");
            assert!(detail.contains("test-only feature"), "{detail}");
            assert!(detail.contains("hang"), "{detail}");
        }
    }
}
