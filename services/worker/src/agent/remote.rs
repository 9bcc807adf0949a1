//! Delegations a remote agent serves ([`ModelProvider::remote`], e.g. [`crate::a2a`]):
//! no turns and no tool calls of the worker's own. The task goes to the remote agent as
//! it is; every artifact it answers with is stored like a tool's output, an artifact
//! with its evidence record (under the task token, content-addressed, the remote task
//! and artifact named in the record and the stored JSON), and becomes claims citing it:
//!
//! - a data part that is an object with `claims` (each with `topic`, `value`,
//!   `statement` and optionally `claim_id` and `confidence`, as in `submit_report`)
//!   gives those claims;
//! - an artifact with text but no such claims gives one claim: its name as the topic
//!   (`remote_answer` without one), its first line as the value, its text as the
//!   statement.
//!
//! A remote failure ends the task FAILED with the remote error's code; an artifact the
//! evidence store refuses is named as missing evidence (the result is then PARTIAL).

use std::collections::BTreeSet;
use std::sync::Mutex;
use std::time::SystemTime;

use convene_core::ids::content_hash;
use convene_core::time::to_timestamp;
use convene_proto::v1;
use serde_json::Value;
use tracing::Instrument as _;
use tracing::field::Empty;

use super::calls::CallError;
use super::{Agent, TaskContext, lock};
use crate::provider::{RemoteAgent, RemoteArtifact, RemoteTask, clip};
use crate::report::{
    CallRecord, CallState, FinalReport, Infra, LoopEnd, Progress, ReportClaim, ReportStatus,
};

/// The topic of a text answer whose artifact has no name.
const DEFAULT_TOPIC: &str = "remote_answer";
/// The longest value taken from a text answer's first line.
const MAX_VALUE_CHARS: usize = 120;
/// The longest statement taken from a text answer.
const MAX_STATEMENT_CHARS: usize = 2000;
/// The longest tool-call id the evidence store accepts.
const MAX_TOOL_CALL_ID: usize = 256;

impl Agent {
    /// Runs the delegation on `remote`: one `a2a.call` span around the exchange, then
    /// the artifacts stored and the report built from them.
    pub(super) async fn run_remote(
        &self,
        ctx: &TaskContext<'_>,
        remote: &dyn RemoteAgent,
        progress: &Mutex<Progress>,
    ) -> LoopEnd {
        lock(progress).iterations = 1;
        let span = tracing::info_span!(
            "a2a.call",
            convene.service = "worker",
            convene.delegation.id = %ctx.task.delegation_id,
            convene.provider = %self.provider.name(),
            convene.a2a.agent = Empty,
            convene.a2a.task_id = Empty,
            convene.a2a.state = Empty,
            convene.a2a.artifacts = Empty,
            error.type = Empty,
        );
        let task = RemoteTask {
            task: ctx.task,
            instructions: &self.profile.profile.instructions,
        };
        let answer = match remote.delegate(task).instrument(span.clone()).await {
            Ok(answer) => answer,
            Err(e) => {
                span.record("error.type", e.code);
                convene_telemetry::set_error(&span, e.message.clone());
                tracing::warn!(
                    delegation_id = %ctx.task.delegation_id,
                    code = e.code,
                    error = %e.message,
                    "the remote agent did not serve the delegation"
                );
                return LoopEnd::Infra(Infra {
                    code: e.code,
                    retryable: e.retryable,
                    message: e.message,
                });
            }
        };
        span.record("convene.a2a.agent", answer.agent.as_str());
        span.record("convene.a2a.artifacts", answer.artifacts.len());

        let task_segment = if answer.task_id.is_empty() {
            "message".to_owned()
        } else {
            segment(&answer.task_id)
        };
        let mut segments = BTreeSet::new();
        let mut claims: Vec<ReportClaim> = Vec::new();
        let mut missing = Vec::new();
        for artifact in &answer.artifacts {
            let mut seg = segment(&artifact.id);
            let mut n = 1;
            while !segments.insert(seg.clone()) {
                n += 1;
                seg = format!("{}-{n}", segment(&artifact.id));
            }
            let tool_call_id = clip_bytes(
                &format!("{}/a2a/{task_segment}/{seg}", ctx.task.delegation_id),
                MAX_TOOL_CALL_ID,
            );
            let record = v1::Evidence {
                evidence_id: format!(
                    "{}/{}/{}/{task_segment}/{seg}",
                    answer.evidence_base, ctx.task.run_id, ctx.task.delegation_id
                ),
                kind: answer.kind.clone(),
                source: answer.source.clone(),
                query_fingerprint: answer.request_fingerprint.clone(),
                scope: ctx.scope.clone(),
                observed_at: Some(to_timestamp(SystemTime::now())),
                artifact_uri: String::new(),
                content_hash: content_hash(&artifact.content),
                quality: v1::EvidenceQuality::Passed as i32,
                tool_call_id: tool_call_id.clone(),
                trace_id: convene_telemetry::current_trace_id().unwrap_or_default(),
                delegation_id: String::new(),
                tenant: String::new(),
                kind_defaulted: false,
            };
            let index = {
                let mut p = lock(progress);
                p.calls.push(CallRecord {
                    call_id: seg.clone(),
                    state: CallState::Running,
                });
                p.calls.len() - 1
            };
            let state = match self
                .store(ctx, record, artifact.content.clone(), tool_call_id)
                .await
            {
                Ok(evidence) => {
                    claims.extend(claims_of(artifact, &evidence.evidence_id, &claims));
                    CallState::Succeeded(Box::new(evidence))
                }
                Err(CallError::Infra(infra)) => {
                    lock(progress).calls[index].state = CallState::Failed(infra.message.clone());
                    return LoopEnd::Infra(infra);
                }
                Err(CallError::Denied(why) | CallError::Failed(why)) => {
                    tracing::warn!(
                        delegation_id = %ctx.task.delegation_id,
                        artifact = %seg,
                        error = %why,
                        "a remote artifact was not recorded as evidence"
                    );
                    missing.push(format!("{seg} ({why})"));
                    CallState::Failed(why)
                }
            };
            lock(progress).calls[index].state = state;
        }
        let summary = if answer.summary.trim().is_empty() {
            format!(
                "The A2A agent at {} answered with {} artifact(s).",
                answer.agent,
                answer.artifacts.len()
            )
        } else {
            clip(&answer.summary, MAX_STATEMENT_CHARS)
        };
        LoopEnd::Report(FinalReport {
            status: if missing.is_empty() {
                ReportStatus::Completed
            } else {
                ReportStatus::Partial
            },
            summary,
            claims,
            proposed_actions: Vec::new(),
            missing_evidence: missing,
            recommended_next: String::new(),
        })
    }
}

/// The claims `artifact` gives, citing `evidence_id`; ids unique among `earlier`.
fn claims_of(
    artifact: &RemoteArtifact,
    evidence_id: &str,
    earlier: &[ReportClaim],
) -> Vec<ReportClaim> {
    let mut claims: Vec<ReportClaim> = Vec::new();
    for data in &artifact.data {
        let Some(listed) = data.get("claims").and_then(Value::as_array) else {
            continue;
        };
        for (i, item) in listed.iter().enumerate() {
            match claim_from(item) {
                Some(c) => claims.push(c),
                None => tracing::warn!(
                    artifact = %artifact.id,
                    claim = i,
                    "a remote claim without topic, value and statement was left out"
                ),
            }
        }
    }
    let text = artifact.texts.join("\n\n");
    if claims.is_empty() && !text.trim().is_empty() {
        let topic = topic_of(&artifact.name);
        let first_line = text.trim().lines().next().unwrap_or_default();
        claims.push(ReportClaim {
            claim_id: String::new(),
            topic,
            value: clip(first_line, MAX_VALUE_CHARS),
            statement: clip(&text, MAX_STATEMENT_CHARS),
            evidence_refs: Vec::new(),
            confidence: 0.5,
        });
    }
    let mut taken: BTreeSet<String> = earlier
        .iter()
        .map(|c| c.claim_id.clone())
        .filter(|id| !id.is_empty())
        .collect();
    for c in &mut claims {
        c.evidence_refs = vec![evidence_id.to_owned()];
        c.confidence = if c.confidence.is_finite() {
            c.confidence.clamp(0.0, 1.0)
        } else {
            0.5
        };
        let base = match c.claim_id.trim() {
            "" => format!("{}-{}", segment(&artifact.id), topic_of(&c.topic)),
            id => id.to_owned(),
        };
        let mut id = base.clone();
        let mut n = 1;
        while !taken.insert(id.clone()) {
            n += 1;
            id = format!("{base}-{n}");
        }
        c.claim_id = id;
    }
    claims
}

/// A claim as a remote wrote it: `topic`, `value` and `statement` (strings, or numbers
/// and booleans written out), optionally `claim_id` and `confidence`; other keys are
/// ignored (evidence refs among them: a remote claim cites what the worker stored).
fn claim_from(item: &Value) -> Option<ReportClaim> {
    let text = |key: &str| {
        match item.get(key)? {
            Value::String(s) => Some(s.trim().to_owned()),
            Value::Number(n) => Some(n.to_string()),
            Value::Bool(b) => Some(b.to_string()),
            _ => None,
        }
        .filter(|s| !s.is_empty())
    };
    Some(ReportClaim {
        claim_id: text("claim_id").unwrap_or_default(),
        topic: text("topic")?,
        value: clip(&text("value")?, MAX_VALUE_CHARS),
        statement: clip(&text("statement")?, MAX_STATEMENT_CHARS),
        evidence_refs: Vec::new(),
        confidence: item
            .get("confidence")
            .and_then(Value::as_f64)
            .unwrap_or(0.5),
    })
}

/// A topic from an artifact's name: lowercase letters, digits and `_`.
fn topic_of(name: &str) -> String {
    let mut topic = String::new();
    for c in name.trim().chars() {
        if c.is_ascii_alphanumeric() {
            topic.push(c.to_ascii_lowercase());
        } else if !topic.ends_with('_') && !topic.is_empty() {
            topic.push('_');
        }
    }
    let topic = topic.trim_end_matches('_');
    if topic.is_empty() {
        DEFAULT_TOPIC.to_owned()
    } else {
        topic.to_owned()
    }
}

/// A remote id made safe for one segment of an evidence URI.
fn segment(id: &str) -> String {
    let cleaned: String = id
        .chars()
        .take(128)
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
                c
            } else {
                '-'
            }
        })
        .collect();
    if cleaned.is_empty() || cleaned.chars().all(|c| c == '.') {
        "artifact".to_owned()
    } else {
        cleaned
    }
}

/// `text` cut to at most `max` bytes, on a character boundary.
fn clip_bytes(text: &str, max: usize) -> String {
    if text.len() <= max {
        return text.to_owned();
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    text[..end].to_owned()
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn artifact(id: &str, name: &str, texts: &[&str], data: Vec<Value>) -> RemoteArtifact {
        RemoteArtifact {
            id: id.into(),
            name: name.into(),
            content: Vec::new(),
            texts: texts.iter().map(|t| (*t).to_owned()).collect(),
            data,
        }
    }

    #[test]
    fn data_claims_are_taken_and_text_becomes_one_claim() {
        let findings = artifact(
            "a-2",
            "findings",
            &[],
            vec![json!({"claims": [
                {"claim_id": "prior", "topic": "prior_incident", "value": "INC-1",
                 "statement": "INC-1 matches", "confidence": 0.7},
                {"topic": "prior_cause", "value": "pool", "statement": "pool exhaustion",
                 "confidence": 7.0},
                {"topic": "", "value": "x", "statement": "no topic"},
                {"topic": "t", "value": 3, "statement": "s", "evidence_refs": ["x://made/up"],
                 "extra": 1},
                {"topic": "t", "value": "v"},
            ]})],
        );
        let claims = claims_of(&findings, "a2a://h/r/d/t/a-2", &[]);
        assert_eq!(claims.len(), 3, "{claims:#?}");
        assert_eq!(claims[2].value, "3");
        assert_eq!(claims[0].claim_id, "prior");
        assert_eq!(claims[1].claim_id, "a-2-prior_cause");
        assert_eq!(claims[1].confidence, 1.0);
        for c in &claims {
            assert_eq!(c.evidence_refs, ["a2a://h/r/d/t/a-2"]);
        }

        let text = artifact(
            "a-1",
            "Assessment (prose)",
            &["First line.\nMore detail."],
            vec![],
        );
        let claims2 = claims_of(&text, "a2a://h/r/d/t/a-1", &claims);
        assert_eq!(claims2.len(), 1);
        let c = &claims2[0];
        assert_eq!(c.topic, "assessment_prose");
        assert_eq!(c.value, "First line.");
        assert_eq!(c.statement, "First line.\nMore detail.");
        assert_eq!(c.evidence_refs, ["a2a://h/r/d/t/a-1"]);

        let again = claims_of(&findings, "a2a://h/r/d/t/a-3", &claims);
        assert_eq!(again[0].claim_id, "prior-2", "ids stay unique");

        let nameless = artifact("a-4", "", &["Answer"], vec![json!({"other": 1})]);
        assert_eq!(claims_of(&nameless, "e", &[])[0].topic, DEFAULT_TOPIC);
        assert!(claims_of(&artifact("a-5", "n", &[], vec![]), "e", &[]).is_empty());
    }

    #[test]
    fn remote_ids_become_safe_segments() {
        assert_eq!(segment("30804d41-85f9"), "30804d41-85f9");
        assert_eq!(segment("a/../b c"), "a-..-b-c");
        assert_eq!(segment(""), "artifact");
        assert_eq!(segment(".."), "artifact");
        assert_eq!(segment(&"x".repeat(300)).len(), 128);
        assert_eq!(clip_bytes("ééé", 3), "é");
    }
}
