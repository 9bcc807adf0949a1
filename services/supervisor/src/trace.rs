//! The supervisor's spans: one trace per run.
//!
//! ```text
//! run                      root, at StartRun (linked to the StartRun call)
//! ├── plan                 the ledger built from the spec (and each nested batch)
//! ├── delegation ×N        one per task, from planning to its final outcome; every
//! │   └── (Worker.Execute)  dispatch attempt runs inside it, so the worker's spans are
//! │                         its children
//! └── join.decide          one per evaluation of the join, the decision's attributes
//!     └── approval.request
//! ```
//!
//! The run's root span context is stored on the run as `trace_parent`, so whoever
//! continues the run later ([`resumed_run_span`]) stays in the same trace. When export
//! is off every span here is disabled and costs nothing beyond that check.
//!
//! Attribute names follow the OpenTelemetry conventions where one exists (`error.type`)
//! and are namespaced `convene.*` otherwise.

use convene_core::model::{JoinContract, JoinStrategy};
use convene_proto::v1;
use tracing::Span;
use tracing::field::Empty;

/// The logical service name carried by every span here (see
/// `convene_telemetry::SERVICE_ATTRIBUTE`).
pub(crate) const SERVICE: &str = "supervisor";

/// The root span of a new run, linked to the current span (the StartRun call that
/// created it). A run is its own trace: a caller's trace may start many runs.
pub(crate) fn run_span(run_id: &str, tenant: &str, goal: &str) -> Span {
    let span = tracing::info_span!(
        parent: None,
        "run",
        convene.service = SERVICE,
        convene.run.id = %run_id,
        convene.tenant = %tenant,
        convene.goal.hash = %convene_core::ids::content_hash(goal.as_bytes()),
        convene.run.state = Empty,
        convene.run.outcome = Empty,
        convene.run.resumed = false,
        convene.run.duplicate_of = Empty,
    );
    convene_telemetry::link(&span, &Span::current());
    span
}

/// A span continuing the trace of a run created earlier, in this process or another:
/// its parent is the run's stored `trace_parent`. For a run whose owner restarted.
pub(crate) fn resumed_run_span(run: &v1::Run) -> Span {
    let goal = run.spec.as_ref().map_or("", |s| s.goal.as_str());
    let span = tracing::info_span!(
        parent: None,
        "run",
        convene.service = SERVICE,
        convene.run.id = %run.run_id,
        convene.tenant = %run.tenant,
        convene.goal.hash = %convene_core::ids::content_hash(goal.as_bytes()),
        convene.run.state = Empty,
        convene.run.outcome = Empty,
        convene.run.resumed = true,
        convene.run.duplicate_of = Empty,
    );
    convene_telemetry::continue_trace(&span, &run.trace_parent);
    span
}

/// The trace id and `traceparent` of a run's root span; a random trace id and no
/// `traceparent` when tracing is off, so every run still has an id to quote.
pub(crate) fn run_trace(span: &Span) -> (String, String) {
    match (
        convene_telemetry::trace_id(span),
        convene_telemetry::traceparent(span),
    ) {
        (Some(id), Some(parent)) => (id, parent),
        _ => (
            format!("{:032x}", uuid::Uuid::new_v4().as_u128()),
            String::new(),
        ),
    }
}

/// Records how a run ended on its root span.
pub(crate) fn record_run_end(span: &Span, run: &v1::Run) {
    if span.is_disabled() {
        return;
    }
    span.record("convene.run.state", run_state_name(run.state));
    if run.outcome != 0 {
        span.record(
            "convene.run.outcome",
            v1::JoinOutcome::try_from(run.outcome).map_or("UNKNOWN", |o| o.as_str_name()),
        );
    }
    if matches!(
        v1::RunState::try_from(run.state),
        Ok(v1::RunState::Failed
            | v1::RunState::Rejected
            | v1::RunState::BudgetExhausted
            | v1::RunState::NoProgress)
    ) {
        convene_telemetry::set_error(span, run.terminal_reason.clone());
    }
}

/// The planning span: the ledger built from the spec, or a nested Delegate call's batch.
/// One round of a planner's run: the planner's turns (their `model.call` spans come
/// from the worker, under this one), its delegate calls and the round's join.
pub(crate) fn round_span(parent: &Span, round: u32) -> Span {
    tracing::info_span!(
        parent: parent,
        "plan",
        convene.service = SERVICE,
        convene.plan.kind = "planner",
        convene.round = round,
        convene.plan.tasks = Empty,
        convene.plan.dropped = Empty,
    )
}

pub(crate) fn plan_span(parent: &Span, kind: &'static str, tasks: usize) -> Span {
    tracing::info_span!(
        parent: parent,
        "plan",
        convene.service = SERVICE,
        convene.plan.kind = kind,
        convene.plan.tasks = tasks,
        convene.plan.dropped = Empty,
    )
}

/// One delegation, from planning to its final outcome. `reason` is why it exists: the
/// task's goal, as the delegator stated it.
pub(crate) fn delegation_span(parent: &Span, task: &v1::DelegationTask) -> Span {
    // Field values are computed only when the span is enabled.
    tracing::info_span!(
        parent: parent,
        "delegation",
        convene.service = SERVICE,
        convene.run.id = %task.run_id,
        convene.delegation.id = %task.delegation_id,
        convene.delegation.name = %task.name,
        convene.delegation.parent_id = %task.parent_delegation_id,
        convene.delegation.profile = %task.profile_id,
        convene.delegation.depth = task.depth,
        convene.delegation.scope = %task
            .scope
            .as_ref()
            .map(|s| s.resources.join(","))
            .unwrap_or_default(),
        convene.delegation.reason = %task.goal,
        convene.delegation.state = Empty,
        convene.delegation.status = Empty,
        convene.delegation.attempts = Empty,
        convene.worker.id = Empty,
        error.type = Empty,
    )
}

/// Records a delegation's final state on its span; anything but a completed result
/// marks it failed, with the reason.
pub(crate) fn record_delegation_end(span: &Span, d: &v1::Delegation) {
    if span.is_disabled() {
        return;
    }
    let state = v1::DelegationState::try_from(d.state).map_or("UNKNOWN", |s| {
        s.as_str_name().trim_start_matches("DELEGATION_STATE_")
    });
    span.record("convene.delegation.state", state);
    span.record("convene.delegation.attempts", d.attempts);
    if !d.worker_id.is_empty() {
        span.record("convene.worker.id", d.worker_id.as_str());
    }
    let result = d.result.as_ref();
    if let Some(r) = result {
        span.record(
            "convene.delegation.status",
            v1::TaskStatus::try_from(r.status).map_or("UNKNOWN", |s| {
                s.as_str_name().trim_start_matches("TASK_STATUS_")
            }),
        );
    }
    let completed = result.is_some_and(|r| {
        matches!(
            v1::TaskStatus::try_from(r.status),
            Ok(v1::TaskStatus::Completed | v1::TaskStatus::Partial)
        )
    });
    if !completed {
        let code = result
            .and_then(|r| r.error.as_ref())
            .map_or(state.to_ascii_lowercase(), |e| e.code.clone());
        span.record("error.type", code.as_str());
        let why = if d.detail.is_empty() {
            result.map(|r| r.summary.clone()).unwrap_or_default()
        } else {
            d.detail.clone()
        };
        convene_telemetry::set_error(span, why);
    }
}

/// One evaluation of the join. `trigger` says what prompted it: `result`, `timer`,
/// `deadline` or `late_result`.
pub(crate) fn join_span(parent: &Span, contract: &JoinContract, trigger: &'static str) -> Span {
    // Field values are computed only when the span is enabled.
    tracing::info_span!(
        parent: parent,
        "join.decide",
        convene.service = SERVICE,
        convene.join.id = %contract.join_id,
        convene.join.trigger = trigger,
        convene.join.strategy = strategy_name(contract.strategy),
        convene.join.wait_set = %wait_set(contract),
        convene.join.required = %contract.required.join(","),
        convene.join.threshold = %threshold(contract),
        convene.join.outcome = Empty,
        convene.join.revision = Empty,
        convene.join.accepted = Empty,
        convene.join.rejected = Empty,
        convene.join.missing = Empty,
        convene.join.waiting_for = Empty,
        convene.join.conflicts = Empty,
        convene.join.conflict_topics = Empty,
    )
}

/// The references the join waits for, required first.
fn wait_set(contract: &JoinContract) -> String {
    let refs: Vec<&str> = contract
        .required
        .iter()
        .chain(&contract.optional)
        .map(String::as_str)
        .collect();
    refs.join(",")
}

/// The contract's minimum, e.g. `count>=2 kinds=impact_metric+causal_signal`.
fn threshold(contract: &JoinContract) -> String {
    let mut threshold = format!("count>={}", contract.minimum.count);
    if contract.minimum.weight > 0.0 {
        threshold.push_str(&format!(" weight>={}", contract.minimum.weight));
    }
    if !contract.minimum.required_evidence_kinds.is_empty() {
        threshold.push_str(&format!(
            " kinds={}",
            contract.minimum.required_evidence_kinds.join("+")
        ));
    }
    threshold
}

/// Records a decision on a `join.decide` span.
pub(crate) fn record_decision(span: &Span, decision: &v1::JoinDecision) {
    if span.is_disabled() {
        return;
    }
    span.record(
        "convene.join.outcome",
        v1::JoinOutcome::try_from(decision.outcome).map_or("UNKNOWN", |o| {
            o.as_str_name().trim_start_matches("JOIN_OUTCOME_")
        }),
    );
    span.record("convene.join.revision", decision.revision);
    span.record("convene.join.accepted", decision.accepted.len());
    span.record("convene.join.rejected", decision.rejected.len());
    span.record(
        "convene.join.missing",
        decision.missing_required.join(",").as_str(),
    );
    span.record("convene.join.conflicts", decision.conflicts.len());
    let topics: Vec<&str> = decision
        .conflicts
        .iter()
        .map(|c| c.topic.as_str())
        .collect();
    span.record("convene.join.conflict_topics", topics.join(",").as_str());
}

/// Records an undecided evaluation: the join waits for `waiting_for`.
pub(crate) fn record_pending(span: &Span, waiting_for: &[String]) {
    if span.is_disabled() {
        return;
    }
    span.record("convene.join.outcome", "PENDING");
    span.record("convene.join.waiting_for", waiting_for.join(",").as_str());
}

fn strategy_name(s: JoinStrategy) -> &'static str {
    match s {
        JoinStrategy::All => "ALL",
        JoinStrategy::Quorum => "QUORUM",
        JoinStrategy::TimeoutPartial => "TIMEOUT_PARTIAL",
        JoinStrategy::FirstValid => "FIRST_VALID",
    }
}

fn run_state_name(state: i32) -> &'static str {
    v1::RunState::try_from(state).map_or("UNKNOWN", |s| {
        s.as_str_name().trim_start_matches("RUN_STATE_")
    })
}

#[cfg(test)]
mod tests {
    use convene_telemetry::test_util::Capture;

    use super::*;

    #[test]
    fn a_resumed_run_continues_the_stored_trace() {
        let capture = Capture::new();
        let _guard = capture.set_default();
        let first = run_span("run-1", "acme", "find the cause");
        let (trace_id, trace_parent) = run_trace(&first);
        assert!(trace_parent.contains(&trace_id), "{trace_parent}");
        drop(first);

        // Another process picks the run up from what was stored.
        let run = v1::Run {
            run_id: "run-1".into(),
            tenant: "acme".into(),
            trace_id: trace_id.clone(),
            trace_parent,
            ..v1::Run::default()
        };
        let resumed = resumed_run_span(&run);
        assert_eq!(run_trace(&resumed).0, trace_id);
        drop(resumed);

        let spans = capture.spans();
        assert_eq!(spans.len(), 2);
        assert_eq!(spans[1].parent_span_id, spans[0].span_context.span_id());
        assert!(
            spans[1]
                .attributes
                .iter()
                .any(|kv| kv.key.as_str() == "convene.run.resumed"
                    && kv.value == opentelemetry::Value::Bool(true))
        );
    }

    #[test]
    fn without_tracing_a_run_still_gets_a_trace_id() {
        // No subscriber on this thread: the span is disabled.
        let span = run_span("run-1", "acme", "find the cause");
        let (trace_id, trace_parent) = run_trace(&span);
        assert_eq!(trace_id.len(), 32);
        assert!(trace_id.chars().all(|c| c.is_ascii_hexdigit()));
        assert_eq!(trace_parent, "");
        assert_ne!(run_trace(&span).0, trace_id, "random per call");
    }
}
