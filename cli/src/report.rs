//! Rendering a finished run as the assessment a person reads.

use std::fmt::Write as _;

use convene_proto::v1;

/// Whether a run state is terminal (the run has ended).
pub fn is_terminal(state: i32) -> bool {
    !matches!(
        v1::RunState::try_from(state),
        Ok(v1::RunState::Pending | v1::RunState::Running | v1::RunState::Unspecified) | Err(_)
    )
}

/// Whether a run state counts as success for the exit status.
pub fn is_success(state: i32) -> bool {
    matches!(
        v1::RunState::try_from(state),
        Ok(v1::RunState::Succeeded | v1::RunState::Partial | v1::RunState::WaitingApproval)
    )
}

fn state_name(state: i32) -> &'static str {
    v1::RunState::try_from(state).map_or("UNKNOWN", |s| {
        s.as_str_name().trim_start_matches("RUN_STATE_")
    })
}

fn outcome_name(outcome: i32) -> &'static str {
    v1::JoinOutcome::try_from(outcome).map_or("UNKNOWN", |o| {
        o.as_str_name().trim_start_matches("JOIN_OUTCOME_")
    })
}

/// The run's state and outcome, short, for listings.
pub fn one_line_state(run: &v1::Run) -> String {
    if run.outcome == 0 {
        state_name(run.state).to_owned()
    } else {
        format!("{}/{}", state_name(run.state), outcome_name(run.outcome))
    }
}

/// One line saying how the run ended, for the exit message.
pub fn one_line(run: &v1::Run) -> String {
    let mut s = format!("run {} {}", run.run_id, state_name(run.state));
    if run.outcome != 0 {
        let _ = write!(s, " ({})", outcome_name(run.outcome));
    }
    if !run.terminal_reason.is_empty() {
        let _ = write!(s, ": {}", run.terminal_reason);
    }
    s
}

fn name_of(run: &v1::Run, delegation_id: &str) -> String {
    run.delegations
        .iter()
        .filter_map(|d| d.task.as_ref())
        .find(|t| t.delegation_id == delegation_id)
        .map_or_else(|| delegation_id.to_owned(), |t| t.name.clone())
}

fn accepted_claims(run: &v1::Run) -> Vec<(String, v1::Claim)> {
    let Some(decision) = &run.decision else {
        return Vec::new();
    };
    run.delegations
        .iter()
        .filter_map(|d| {
            let t = d.task.as_ref()?;
            let r = d.result.as_ref()?;
            decision.accepted.contains(&t.delegation_id).then(|| {
                r.claims
                    .iter()
                    .map(|c| (t.name.clone(), c.clone()))
                    .collect::<Vec<_>>()
            })
        })
        .flatten()
        .collect()
}

/// The assessment: status, impact, strongest root-cause candidate with evidence ids,
/// unresolved conflicts, gaps, approval requests and the trace.
pub fn assessment(
    run: &v1::Run,
    approvals: &[v1::ApprovalRequest],
    jaeger: Option<&str>,
) -> String {
    let mut out = String::new();
    let w = &mut out;
    let decision = run.decision.clone().unwrap_or_default();
    let expected = run
        .delegations
        .iter()
        .filter(|d| d.task.as_ref().is_some_and(|t| t.depth <= 1))
        .count();
    let status = match v1::JoinOutcome::try_from(run.outcome) {
        Ok(v1::JoinOutcome::PartialEvidence) => format!(
            "Provisional assessment ({}/{} investigations accepted)",
            decision.accepted.len(),
            expected
        ),
        Ok(v1::JoinOutcome::InsufficientEvidence) => {
            "Insufficient evidence for an assessment".to_owned()
        }
        Ok(v1::JoinOutcome::ConflictRequiresHuman) => format!(
            "Assessment with an unresolved conflict ({}/{} investigations accepted)",
            decision.accepted.len(),
            expected
        ),
        Ok(v1::JoinOutcome::CompleteWithReviewRequired) => {
            "Assessment complete; review required".to_owned()
        }
        Ok(v1::JoinOutcome::Complete) => "Assessment complete".to_owned(),
        _ => "No decision".to_owned(),
    };
    let _ = writeln!(
        w,
        "Run {}: {} — {}",
        run.run_id,
        state_name(run.state),
        status
    );
    if let Some(planner) = run.planner.as_ref().filter(|p| !p.turns.is_empty()) {
        let delegated = run.delegations.len();
        let rounds = run
            .delegations
            .iter()
            .filter_map(|d| d.task.as_ref().map(|t| t.round))
            .max()
            .unwrap_or(0);
        let _ = writeln!(
            w,
            "  (planned by {} in {} round(s), {} planner turn(s), {delegated} delegation(s); the last round's join decided)",
            run.spec
                .as_ref()
                .and_then(|s| s.planner.as_ref())
                .map_or("the planner", |p| p.profile_id.as_str()),
            rounds,
            planner.turns.len(),
        );
        if !planner.summary.is_empty() {
            let _ = writeln!(w, "  Planner's summary: {}", planner.summary);
        }
    } else if decision.revision > 1 {
        let _ = writeln!(
            w,
            "  (decision revision {}: late results were appended; the run was not reopened)",
            decision.revision
        );
    }
    if !run.terminal_reason.is_empty() && run.outcome == 0 {
        let _ = writeln!(w, "  {}", run.terminal_reason);
    }

    let claims = accepted_claims(run);
    let impact: Vec<_> = claims
        .iter()
        .filter(|(_, c)| c.topic.starts_with("impact"))
        .collect();
    if !impact.is_empty() {
        let _ = writeln!(w, "\nImpact:");
        for (who, c) in impact {
            let _ = writeln!(
                w,
                "  - {} [{}; evidence: {}]",
                c.statement,
                who,
                c.evidence_refs.join(", ")
            );
        }
    }

    let conflicted: std::collections::BTreeSet<&str> = decision
        .conflicts
        .iter()
        .map(|c| c.topic.as_str())
        .collect();
    let causes: Vec<_> = claims
        .iter()
        .filter(|(_, c)| c.topic == "primary_cause" || c.topic.ends_with("cause"))
        .collect();
    // "Strongest" is for reading only: most cited evidence, then plan order. The join
    // itself never weighs claims.
    if let Some((who, c)) = causes
        .iter()
        .max_by_key(|(_, c)| c.evidence_refs.len())
        .copied()
    {
        let _ = writeln!(
            w,
            "\nStrongest root-cause candidate: {}",
            c.value.replace('_', " ")
        );
        let _ = writeln!(w, "  - {}", c.statement);
        let _ = writeln!(
            w,
            "  - from {who}; evidence: {}",
            c.evidence_refs.join(", ")
        );
        if conflicted.contains(c.topic.as_str()) {
            let _ = writeln!(w, "  - contested: see the unresolved conflict below");
        }
    }

    for conflict in &decision.conflicts {
        let _ = writeln!(w, "\nUnresolved conflict on {}:", conflict.topic);
        for c in &conflict.claims {
            let _ = writeln!(
                w,
                "  - {} ({}): {} [evidence: {}]",
                c.value.replace('_', " "),
                name_of(run, &c.delegation_id),
                c.statement,
                c.evidence_refs.join(", ")
            );
        }
        if !conflict.next_query.is_empty() {
            let _ = writeln!(w, "  next: {}", conflict.next_query);
        }
        let _ = writeln!(
            w,
            "  The evidence does not establish which is the cause; a person decides."
        );
    }

    let missing: Vec<String> = decision
        .missing_required
        .iter()
        .chain(&decision.missing_optional)
        .map(|id| name_of(run, id))
        .collect();
    if !missing.is_empty() || !decision.rejected.is_empty() {
        let _ = writeln!(w, "\nGaps:");
        for m in &missing {
            let _ = writeln!(w, "  - {m}: no accepted result");
        }
        for r in &decision.rejected {
            let _ = writeln!(
                w,
                "  - {} rejected ({}): {}",
                name_of(run, &r.delegation_id),
                v1::RejectionReason::try_from(r.reason).map_or("UNKNOWN", |x| x
                    .as_str_name()
                    .trim_start_matches("REJECTION_REASON_")),
                r.detail
            );
        }
        for k in &decision.missing_evidence_kinds {
            let _ = writeln!(w, "  - no evidence of kind {k}");
        }
    }
    if !run.truncated.is_empty() {
        let _ = writeln!(
            w,
            "  - dropped by overflow TRUNCATE: {}",
            run.truncated.join(", ")
        );
    }

    if !approvals.is_empty() || !run.approval_ids.is_empty() {
        let _ = writeln!(w, "\nActions waiting for approval (nothing was executed):");
        for a in approvals {
            let risk = v1::RiskLevel::try_from(a.risk_level)
                .map_or("R?", |r| r.as_str_name().trim_start_matches("RISK_LEVEL_"));
            let _ = writeln!(
                w,
                "  - {} {} {} — {} approval(s) needed, {} given; approval id {}",
                risk,
                a.action,
                params(a.parameters.as_ref()),
                a.approvals_required,
                a.votes
                    .iter()
                    .filter(|v| v.decision == v1::VoteDecision::Approve as i32)
                    .count(),
                a.approval_id
            );
        }
        for id in run
            .approval_ids
            .iter()
            .filter(|id| !approvals.iter().any(|a| &a.approval_id == *id))
        {
            let _ = writeln!(w, "  - approval id {id}");
        }
        let _ = writeln!(
            w,
            "  Review with: convene approvals list --run {}",
            run.run_id
        );
    }

    let _ = writeln!(w, "\nTrace: {}", run.trace_id);
    if let Some(base) = jaeger {
        let _ = writeln!(w, "  {}/trace/{}", base.trim_end_matches('/'), run.trace_id);
    }
    out
}

fn params(p: Option<&prost_types::Struct>) -> String {
    let Some(p) = p else { return String::new() };
    let mut parts: Vec<String> = p
        .fields
        .iter()
        .map(|(k, v)| {
            let v = match &v.kind {
                Some(prost_types::value::Kind::StringValue(s)) => s.clone(),
                Some(prost_types::value::Kind::NumberValue(n)) => n.to_string(),
                Some(prost_types::value::Kind::BoolValue(b)) => b.to_string(),
                _ => "…".to_owned(),
            };
            format!("{k}={v}")
        })
        .collect();
    parts.sort();
    format!("({})", parts.join(", "))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run_with_trace(trace_id: &str) -> v1::Run {
        v1::Run {
            run_id: "run-1".to_owned(),
            state: v1::RunState::Succeeded as i32,
            trace_id: trace_id.to_owned(),
            ..v1::Run::default()
        }
    }

    #[test]
    fn the_assessment_links_the_trace_in_jaeger_when_a_ui_is_known() {
        let trace = "4bf92f3577b34da6a3ce929d0e0e4736";
        let run = run_with_trace(trace);

        let plain = assessment(&run, &[], None);
        assert!(plain.contains(&format!("\nTrace: {trace}\n")), "{plain}");
        assert!(!plain.contains("/trace/"), "{plain}");

        for base in ["http://localhost:16686", "http://localhost:16686/"] {
            let linked = assessment(&run, &[], Some(base));
            assert!(
                linked.ends_with(&format!(
                    "Trace: {trace}\n  http://localhost:16686/trace/{trace}\n"
                )),
                "{linked}"
            );
        }
    }
}
