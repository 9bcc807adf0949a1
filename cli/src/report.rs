//! Rendering runs and approval requests as what a person reads: the assessment, what
//! a waiting run waits for, the actions and their approvals.

use std::fmt::Write as _;

use convene_proto::v1;

/// Whether the run has stopped: it ended (a final state) or waits for people
/// (WAITING_INPUT, WAITING_APPROVAL).
pub fn is_terminal(state: i32) -> bool {
    !matches!(
        v1::RunState::try_from(state),
        Ok(v1::RunState::Pending | v1::RunState::Running | v1::RunState::Unspecified) | Err(_)
    )
}

/// Whether the run waits for people: not final, it resumes when they act.
pub fn is_waiting(state: i32) -> bool {
    matches!(
        v1::RunState::try_from(state),
        Ok(v1::RunState::WaitingInput | v1::RunState::WaitingApproval)
    )
}

/// Whether the run has ended for good (a final state).
pub fn is_final(state: i32) -> bool {
    is_terminal(state) && !is_waiting(state)
}

/// Whether a run state counts as success for the exit status: SUCCEEDED, PARTIAL, or
/// waiting for people.
pub fn is_success(state: i32) -> bool {
    is_waiting(state)
        || matches!(
            v1::RunState::try_from(state),
            Ok(v1::RunState::Succeeded | v1::RunState::Partial)
        )
}

/// The state's name without its prefix, e.g. `WAITING_INPUT`.
pub fn state_name(state: i32) -> &'static str {
    v1::RunState::try_from(state).map_or("UNKNOWN", |s| {
        s.as_str_name().trim_start_matches("RUN_STATE_")
    })
}

/// A command's outcome without its prefix, e.g. `APPLIED`.
pub fn command_outcome_name(outcome: i32) -> &'static str {
    v1::CommandOutcome::try_from(outcome).map_or("UNKNOWN", |o| {
        o.as_str_name().trim_start_matches("COMMAND_OUTCOME_")
    })
}

fn approval_state_name(state: i32) -> &'static str {
    v1::ApprovalState::try_from(state).map_or("UNKNOWN", |s| {
        s.as_str_name().trim_start_matches("APPROVAL_STATE_")
    })
}

fn action_state_name(state: i32) -> &'static str {
    v1::ActionState::try_from(state).map_or("UNKNOWN", |s| {
        s.as_str_name().trim_start_matches("ACTION_STATE_")
    })
}

fn risk_name(risk: i32) -> &'static str {
    v1::RiskLevel::try_from(risk)
        .map_or("R?", |r| r.as_str_name().trim_start_matches("RISK_LEVEL_"))
}

/// A timestamp in RFC 3339 (seconds), or `?` when unset or out of range.
fn when(ts: Option<&prost_types::Timestamp>) -> String {
    ts.and_then(|t| convene_core::time::from_timestamp(t, "timestamp").ok())
        .map_or_else(
            || "?".to_owned(),
            |t| humantime::format_rfc3339_seconds(t).to_string(),
        )
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

    let settled = |topic: &str| {
        decision
            .conflicts
            .iter()
            .any(|c| c.topic == topic && is_settled(c))
    };
    let contested = |topic: &str| decision.conflicts.iter().any(|c| c.topic == topic);
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
        if settled(&c.topic) {
            let _ = writeln!(
                w,
                "  - contested; a person settled it: see Human judgement below"
            );
        } else if contested(&c.topic) {
            let _ = writeln!(w, "  - contested: see the unresolved conflict below");
        }
    }

    for conflict in decision.conflicts.iter().filter(|c| !is_settled(c)) {
        let _ = writeln!(w, "\nUnresolved conflict on {}:", conflict.topic);
        write_sides(w, run, &conflict.claims, None);
        if !conflict.next_query.is_empty() {
            let _ = writeln!(w, "  next: {}", conflict.next_query);
        }
        let _ = writeln!(
            w,
            "  The evidence does not establish which is the cause; a person decides."
        );
    }

    human_judgement(w, run, &decision);

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

    actions(w, run, approvals);

    let _ = writeln!(w, "\nTrace: {}", run.trace_id);
    if let Some(base) = jaeger {
        let _ = writeln!(w, "  {}/trace/{}", base.trim_end_matches('/'), run.trace_id);
    }
    out
}

fn is_settled(conflict: &v1::Conflict) -> bool {
    conflict.resolution == v1::ConflictResolution::Settled as i32
}

/// The sides of a conflict, one line each; the chosen one (a delegation id) marked.
fn write_sides(
    w: &mut String,
    run: &v1::Run,
    claims: &[v1::ConflictingClaim],
    chosen: Option<&str>,
) {
    for c in claims {
        let mark = match chosen {
            Some(id) if id == c.delegation_id => "chosen: ",
            Some(_) => "not chosen: ",
            None => "",
        };
        let _ = writeln!(
            w,
            "  - {mark}{} ({}): {} [evidence: {}]",
            c.value.replace('_', " "),
            name_of(run, &c.delegation_id),
            c.statement,
            c.evidence_refs.join(", ")
        );
    }
}

/// What people decided on the run (settled conflicts, follow-ups, closing), kept apart
/// from the evidence-backed claims above.
fn human_judgement(w: &mut String, run: &v1::Run, decision: &v1::JoinDecision) {
    let settled: Vec<&v1::Conflict> = decision
        .conflicts
        .iter()
        .filter(|c| is_settled(c))
        .collect();
    if settled.is_empty() && run.human_decisions.is_empty() {
        return;
    }
    let _ = writeln!(
        w,
        "\nHuman judgement (people's decisions, not evidence-backed claims):"
    );
    let mut shown: Vec<&str> = Vec::new();
    for d in &run.human_decisions {
        let by = format!("{} at {}", d.decided_by, when(d.decided_at.as_ref()));
        match v1::HumanDecisionKind::try_from(d.kind) {
            Ok(v1::HumanDecisionKind::Settle) => {
                if let Some(c) = settled.iter().find(|c| c.topic == d.topic) {
                    write_settlement(w, run, c);
                    shown.push(c.topic.as_str());
                    continue;
                }
                let _ = writeln!(
                    w,
                    "  {}: settled by {by}: {} ({})",
                    d.topic,
                    d.value.replace('_', " "),
                    name_of(run, &d.delegation_id)
                );
                write_reasons(w, &d.rationale, &d.evidence_ids);
            }
            Ok(v1::HumanDecisionKind::FollowUp) => {
                let created = if d.follow_up_delegation_id.is_empty() {
                    String::new()
                } else {
                    format!(" -> delegation {}", d.follow_up_delegation_id)
                };
                let _ = writeln!(
                    w,
                    "  follow-up asked by {by}: {} to establish {:?}{created}",
                    d.profile_id, d.goal
                );
                write_reasons(w, &d.rationale, &[]);
            }
            Ok(v1::HumanDecisionKind::Close) => {
                let _ = writeln!(w, "  run closed as it stood by {by}");
                write_reasons(w, &d.rationale, &[]);
            }
            _ => {
                let _ = writeln!(w, "  decision by {by}");
                write_reasons(w, &d.rationale, &[]);
            }
        }
    }
    for c in settled
        .iter()
        .filter(|c| !shown.contains(&c.topic.as_str()))
    {
        write_settlement(w, run, c);
    }
}

fn write_settlement(w: &mut String, run: &v1::Run, conflict: &v1::Conflict) {
    let s = conflict.settlement.clone().unwrap_or_default();
    let _ = writeln!(
        w,
        "  {}: settled by {} at {}: {} ({})",
        conflict.topic,
        s.decided_by,
        when(s.decided_at.as_ref()),
        s.value.replace('_', " "),
        name_of(run, &s.delegation_id)
    );
    write_reasons(w, &s.rationale, &s.evidence_ids);
    write_sides(w, run, &conflict.claims, Some(&s.delegation_id));
}

fn write_reasons(w: &mut String, rationale: &str, evidence_ids: &[String]) {
    if !rationale.is_empty() {
        let _ = writeln!(w, "    rationale: {rationale}");
    }
    if !evidence_ids.is_empty() {
        let _ = writeln!(w, "    evidence relied on: {}", evidence_ids.join(", "));
    }
}

/// An approval request as the run's action, for runs whose supervisor does not list
/// `Run.actions`.
fn action_of(a: &v1::ApprovalRequest) -> v1::RunAction {
    let state = match v1::ApprovalState::try_from(a.state) {
        Ok(v1::ApprovalState::Pending) => v1::ActionState::Pending,
        Ok(v1::ApprovalState::Approved) => v1::ActionState::Approved,
        Ok(v1::ApprovalState::Executed) => v1::ActionState::Executed,
        Ok(v1::ApprovalState::Rejected) => v1::ActionState::Rejected,
        Ok(v1::ApprovalState::Expired) => v1::ActionState::Expired,
        Ok(v1::ApprovalState::Cancelled) => v1::ActionState::Cancelled,
        _ => v1::ActionState::Unspecified,
    };
    let decision = if state == v1::ActionState::Rejected {
        v1::VoteDecision::Reject
    } else {
        v1::VoteDecision::Approve
    };
    v1::RunAction {
        approval_id: a.approval_id.clone(),
        action: a.action.clone(),
        parameters: a.parameters.clone(),
        parameters_hash: a.parameters_hash.clone(),
        risk_level: a.risk_level,
        state: state as i32,
        decided_by: a
            .votes
            .iter()
            .filter(|v| v.decision == decision as i32)
            .map(|v| v.approver.clone())
            .collect(),
        execution: a.execution.clone(),
        updated_at: None,
    }
}

/// The run's recommended actions, each with where it stands, who decided and its
/// execution.
fn actions(w: &mut String, run: &v1::Run, approvals: &[v1::ApprovalRequest]) {
    let listed: Vec<v1::RunAction> = if run.actions.is_empty() {
        approvals.iter().map(action_of).collect()
    } else {
        run.actions.clone()
    };
    let unknown: Vec<&String> = run
        .approval_ids
        .iter()
        .filter(|id| !listed.iter().any(|a| &a.approval_id == *id))
        .collect();
    if listed.is_empty() && unknown.is_empty() {
        return;
    }
    let executed = listed
        .iter()
        .any(|a| a.state == v1::ActionState::Executed as i32);
    let _ = writeln!(
        w,
        "\nRecommended actions{}:",
        if executed {
            ""
        } else {
            " (nothing was executed)"
        }
    );
    let mut open = !unknown.is_empty();
    for a in &listed {
        let request = approvals.iter().find(|r| r.approval_id == a.approval_id);
        let decided = a.decided_by.join(", ");
        let detail = match v1::ActionState::try_from(a.state) {
            Ok(v1::ActionState::Pending) => {
                open = true;
                let given = request.map_or(a.decided_by.len(), |r| {
                    r.votes
                        .iter()
                        .filter(|v| v.decision == v1::VoteDecision::Approve as i32)
                        .count()
                });
                match request {
                    Some(r) => {
                        format!("{} approval(s) needed, {given} given", r.approvals_required)
                    }
                    None => format!("{given} approval(s) given"),
                }
            }
            Ok(v1::ActionState::Approved) => {
                open = true;
                format!("approved by {decided}; not executed yet")
            }
            Ok(v1::ActionState::Executed) => {
                let e = a.execution.clone().unwrap_or_default();
                format!(
                    "approved by {decided}; executed by {} with executor {} at {} ({})",
                    e.executed_by,
                    e.executor,
                    when(e.executed_at.as_ref()),
                    if e.success { "success" } else { "failed" }
                )
            }
            Ok(v1::ActionState::Rejected) => format!("rejected by {decided}"),
            Ok(v1::ActionState::Cancelled) => match request.and_then(|r| r.cancellation.as_ref()) {
                Some(c) if !c.reason.is_empty() => {
                    format!("withdrawn by {}: {}", c.cancelled_by, c.reason)
                }
                Some(c) => format!("withdrawn by {}", c.cancelled_by),
                None => "withdrawn".to_owned(),
            },
            _ => String::new(),
        };
        let _ = writeln!(
            w,
            "  - {} {} {} — {}{}{detail}; approval id {}",
            risk_name(a.risk_level),
            a.action,
            params(a.parameters.as_ref()),
            action_state_name(a.state),
            if detail.is_empty() { "" } else { ": " },
            a.approval_id
        );
    }
    for id in unknown {
        let _ = writeln!(w, "  - approval id {id}");
    }
    if open {
        let _ = writeln!(
            w,
            "  Review with: convene approvals list --run {}",
            run.run_id
        );
    }
}

/// The parameters' canonical JSON, the text their hash is computed over (`{}` when
/// there are none).
pub fn canonical_parameters(p: Option<&prost_types::Struct>) -> String {
    let empty = prost_types::Struct::default();
    convene_approval::canonical::canonical_json(p.unwrap_or(&empty))
        .unwrap_or_else(|e| format!("(parameters have no canonical form: {e})"))
}

/// One approval request as `convene approvals list` shows it: id, state, risk, action,
/// approvals; then the parameters (canonical JSON) and the hash votes bind to, the
/// votes, and the execution or withdrawal.
pub fn approval(a: &v1::ApprovalRequest) -> String {
    let mut out = String::new();
    let w = &mut out;
    let approved = a
        .votes
        .iter()
        .filter(|v| v.decision == v1::VoteDecision::Approve as i32)
        .count();
    let _ = writeln!(
        w,
        "{}  {:<9} {} {}  {approved}/{} approvals  run {}  requested by {}",
        a.approval_id,
        approval_state_name(a.state),
        risk_name(a.risk_level),
        a.action,
        a.approvals_required,
        if a.run_id.is_empty() { "-" } else { &a.run_id },
        a.requester
    );
    let _ = writeln!(
        w,
        "  parameters: {}",
        canonical_parameters(a.parameters.as_ref())
    );
    let _ = writeln!(w, "  hash:       {}", a.parameters_hash);
    if !a.rationale.is_empty() {
        let _ = writeln!(w, "  why:        {}", a.rationale);
    }
    if !a.votes.is_empty() {
        let votes: Vec<String> = a
            .votes
            .iter()
            .map(|v| {
                let decision = if v.decision == v1::VoteDecision::Approve as i32 {
                    "approved"
                } else {
                    "rejected"
                };
                if v.comment.is_empty() {
                    format!("{} {decision}", v.approver)
                } else {
                    format!("{} {decision} ({:?})", v.approver, v.comment)
                }
            })
            .collect();
        let _ = writeln!(w, "  votes:      {}", votes.join(", "));
    }
    if let Some(e) = &a.execution {
        let _ = writeln!(
            w,
            "  executed:   by {} with executor {} at {} ({})",
            e.executed_by,
            e.executor,
            when(e.executed_at.as_ref()),
            if e.success { "success" } else { "failed" }
        );
    }
    if let Some(c) = &a.cancellation {
        let _ = writeln!(
            w,
            "  withdrawn:  by {} at {}{}",
            c.cancelled_by,
            when(c.cancelled_at.as_ref()),
            if c.reason.is_empty() {
                String::new()
            } else {
                format!(": {}", c.reason)
            }
        );
    }
    if a.state == v1::ApprovalState::Pending as i32 {
        let _ = writeln!(w, "  expires:    {}", when(a.expires_at.as_ref()));
    }
    out
}

/// Which supervisor replica ran the run last and each claim of it by another (empty
/// when the supervisor leases no runs).
pub fn replicas(run: &v1::Run) -> String {
    if run.owner.is_empty() {
        return String::new();
    }
    let mut out = String::new();
    let w = &mut out;
    let _ = writeln!(
        w,
        "Replica: {} (lease epoch {}).",
        run.owner, run.lease_epoch
    );
    for c in &run.claims {
        let from = if c.previous_replica.is_empty() {
            "its lease was free".to_owned()
        } else {
            format!("taken over from {}", c.previous_replica)
        };
        let _ = writeln!(
            w,
            "  claimed by {} at {} (epoch {}): {from}",
            c.replica,
            when(c.at.as_ref()),
            c.epoch
        );
    }
    out
}

/// For a waiting run: what it waits for and the commands that continue it (empty for
/// a run that does not wait). `reason` is the `waiting` event's, when known.
pub fn waiting(run: &v1::Run, reason: Option<&str>) -> String {
    if !is_waiting(run.state) {
        return String::new();
    }
    let mut out = String::new();
    let w = &mut out;
    let id = &run.run_id;
    let _ = writeln!(
        w,
        "The run waits for people ({}): it is not over, and resumes when they act.",
        state_name(run.state)
    );
    if let Some(reason) = reason.filter(|r| !r.is_empty()) {
        let _ = writeln!(w, "  {reason}");
    }
    let decision = run.decision.clone().unwrap_or_default();
    let open: Vec<&v1::Conflict> = decision
        .conflicts
        .iter()
        .filter(|c| !is_settled(c))
        .collect();
    for c in &open {
        let mut sides: Vec<String> = c
            .claims
            .iter()
            .map(|claim| name_of(run, &claim.delegation_id))
            .collect();
        sides.dedup();
        let _ = writeln!(
            w,
            "  Open conflict on {}: settle it by choosing one side ({}):",
            c.topic,
            sides.join(" or ")
        );
        let _ = writeln!(
            w,
            "    convene runs resolve {id} --topic {} --choose <{}> --rationale \"<why>\" [--evidence <evidence-id>]...",
            c.topic,
            sides.join("|")
        );
    }
    let pending: Vec<String> = if run.actions.is_empty() {
        run.approval_ids.clone()
    } else {
        run.actions
            .iter()
            .filter(|a| {
                a.state == v1::ActionState::Pending as i32
                    || a.state == v1::ActionState::Approved as i32
            })
            .map(|a| {
                format!(
                    "{} ({} {}, {})",
                    a.approval_id,
                    risk_name(a.risk_level),
                    a.action,
                    action_state_name(a.state)
                )
            })
            .collect()
    };
    if !pending.is_empty() {
        let _ = writeln!(w, "  Approval requests: {}", pending.join(", "));
        let _ = writeln!(
            w,
            "    convene approvals list --run {id}    # then approve or reject with --hash as listed"
        );
    }
    if !open.is_empty() {
        let _ = writeln!(
            w,
            "  Or ask for a follow-up, or close the run as it stands:"
        );
        let _ = writeln!(
            w,
            "    convene runs resolve {id} --follow-up-profile <profile> --goal \"<what to establish>\" --rationale \"<why>\""
        );
        let _ = writeln!(
            w,
            "    convene runs resolve {id} --close --rationale \"<why>\""
        );
    }
    if let Some(t) = &run.ticket {
        let _ = writeln!(
            w,
            "  Ticket {} (wait {}): `convene runs resolve` uses the current one, or the one given with --ticket.",
            t.id, t.version
        );
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

    fn task(id: &str, name: &str) -> v1::Delegation {
        v1::Delegation {
            task: Some(v1::DelegationTask {
                delegation_id: id.to_owned(),
                name: name.to_owned(),
                ..v1::DelegationTask::default()
            }),
            ..v1::Delegation::default()
        }
    }

    fn side(delegation_id: &str, value: &str, evidence: &str) -> v1::ConflictingClaim {
        v1::ConflictingClaim {
            delegation_id: delegation_id.to_owned(),
            claim_id: "c1".to_owned(),
            value: value.to_owned(),
            statement: format!("{value} caused it"),
            evidence_refs: vec![evidence.to_owned()],
        }
    }

    fn rollback(state: v1::ActionState) -> v1::RunAction {
        v1::RunAction {
            approval_id: "apr-1".to_owned(),
            action: "rule:rollback".to_owned(),
            parameters: Some(convene_proto::json::to_struct(
                &serde_json::json!({ "rule_id": "RC-4711" }),
            )),
            parameters_hash: "sha256:ab".to_owned(),
            risk_level: v1::RiskLevel::R3 as i32,
            state: state as i32,
            ..v1::RunAction::default()
        }
    }

    /// The payment incident waiting for input: a conflict on primary_cause between
    /// logs and changes, the rollback pending.
    fn waiting_run() -> v1::Run {
        v1::Run {
            run_id: "run-1".to_owned(),
            state: v1::RunState::WaitingInput as i32,
            outcome: v1::JoinOutcome::ConflictRequiresHuman as i32,
            delegations: vec![task("d-logs", "logs"), task("d-changes", "changes")],
            decision: Some(v1::JoinDecision {
                revision: 1,
                outcome: v1::JoinOutcome::ConflictRequiresHuman as i32,
                accepted: vec!["d-logs".to_owned(), "d-changes".to_owned()],
                conflicts: vec![v1::Conflict {
                    topic: "primary_cause".to_owned(),
                    claims: vec![
                        side("d-logs", "pool_exhaustion", "ev-logs"),
                        side("d-changes", "risk_rule_change", "ev-changes"),
                    ],
                    resolution: v1::ConflictResolution::Unresolved as i32,
                    ..v1::Conflict::default()
                }],
                ..v1::JoinDecision::default()
            }),
            approval_ids: vec!["apr-1".to_owned()],
            actions: vec![rollback(v1::ActionState::Pending)],
            ticket: Some(v1::RunTicket {
                id: "tk-1".to_owned(),
                version: 1,
                issued_at: None,
            }),
            ..v1::Run::default()
        }
    }

    #[test]
    fn states_are_active_waiting_or_final() {
        for (state, waiting, fin, success) in [
            (v1::RunState::Running, false, false, false),
            (v1::RunState::WaitingInput, true, false, true),
            (v1::RunState::WaitingApproval, true, false, true),
            (v1::RunState::Succeeded, false, true, true),
            (v1::RunState::Partial, false, true, true),
            (v1::RunState::Failed, false, true, false),
            (v1::RunState::Cancelled, false, true, false),
        ] {
            let s = state as i32;
            assert_eq!(is_waiting(s), waiting, "{state:?}");
            assert_eq!(is_final(s), fin, "{state:?}");
            assert_eq!(is_terminal(s), waiting || fin, "{state:?}");
            assert_eq!(is_success(s), success, "{state:?}");
        }
    }

    #[test]
    fn a_waiting_run_says_what_it_waits_for_and_what_continues_it() {
        let run = waiting_run();
        let text = waiting(&run, Some("a conflict on primary_cause is open"));
        for needle in [
            "The run waits for people (WAITING_INPUT)",
            "  a conflict on primary_cause is open\n",
            "Open conflict on primary_cause: settle it by choosing one side (logs or changes)",
            "convene runs resolve run-1 --topic primary_cause --choose <logs|changes> --rationale",
            "Approval requests: apr-1 (R3 rule:rollback, PENDING)",
            "convene approvals list --run run-1",
            "convene runs resolve run-1 --close --rationale",
            "Ticket tk-1 (wait 1)",
        ] {
            assert!(text.contains(needle), "{needle:?} missing in:\n{text}");
        }

        let ended = v1::Run {
            state: v1::RunState::Succeeded as i32,
            ticket: None,
            ..run
        };
        assert_eq!(waiting(&ended, None), "");
    }

    #[test]
    fn a_settled_conflict_is_human_judgement_not_an_unresolved_conflict() {
        let mut run = waiting_run();
        run.state = v1::RunState::WaitingApproval as i32;
        let conflict = &mut run.decision.as_mut().expect("decision").conflicts[0];
        conflict.resolution = v1::ConflictResolution::Settled as i32;
        conflict.settlement = Some(v1::ConflictSettlement {
            delegation_id: "d-changes".to_owned(),
            value: "risk_rule_change".to_owned(),
            decided_by: "oncall@acme".to_owned(),
            rationale: "the rule went live first".to_owned(),
            evidence_ids: vec!["ev-changes".to_owned()],
            decided_at: Some(prost_types::Timestamp {
                seconds: 1_784_772_000,
                nanos: 0,
            }),
        });
        run.human_decisions = vec![v1::HumanDecision {
            kind: v1::HumanDecisionKind::Settle as i32,
            decided_by: "oncall@acme".to_owned(),
            topic: "primary_cause".to_owned(),
            delegation_id: "d-changes".to_owned(),
            value: "risk_rule_change".to_owned(),
            rationale: "the rule went live first".to_owned(),
            ..v1::HumanDecision::default()
        }];

        let text = assessment(&run, &[], None);
        assert!(!text.contains("Unresolved conflict"), "{text}");
        let judgement = text
            .split_once("Human judgement")
            .map(|(_, rest)| rest)
            .unwrap_or_else(|| panic!("no Human judgement section in:\n{text}"));
        for needle in [
            "primary_cause: settled by oncall@acme at 2026-07-23T02:00:00Z: risk rule change (changes)",
            "rationale: the rule went live first",
            "evidence relied on: ev-changes",
            "- chosen: risk rule change (changes)",
            "- not chosen: pool exhaustion (logs)",
        ] {
            assert!(judgement.contains(needle), "{needle:?} missing in:\n{text}");
        }
        // Shown once, though both the conflict and the decision record it.
        assert_eq!(text.matches("settled by oncall@acme").count(), 1, "{text}");
        let waits = waiting(&run, None);
        assert!(!waits.contains("Open conflict"), "{waits}");
        assert!(waits.contains("apr-1"), "{waits}");
    }

    #[test]
    fn actions_show_their_state_who_decided_and_the_execution() {
        let mut run = waiting_run();
        assert!(
            assessment(&run, &[], None).contains(
                "Recommended actions (nothing was executed):\n  - R3 rule:rollback (rule_id=RC-4711) — PENDING: 0 approval(s) given; approval id apr-1"
            ),
            "{}",
            assessment(&run, &[], None)
        );

        run.state = v1::RunState::Succeeded as i32;
        run.actions = vec![v1::RunAction {
            decided_by: vec!["alice@acme".to_owned(), "bob@acme".to_owned()],
            execution: Some(v1::ExecutionRecord {
                executor: "record-only".to_owned(),
                success: true,
                executed_by: "alice@acme".to_owned(),
                executed_at: Some(prost_types::Timestamp {
                    seconds: 1_784_772_000,
                    nanos: 0,
                }),
                ..v1::ExecutionRecord::default()
            }),
            ..rollback(v1::ActionState::Executed)
        }];
        let text = assessment(&run, &[], None);
        assert!(
            text.contains(
                "Recommended actions:\n  - R3 rule:rollback (rule_id=RC-4711) — EXECUTED: approved by alice@acme, bob@acme; executed by alice@acme with executor record-only at 2026-07-23T02:00:00Z (success); approval id apr-1"
            ),
            "{text}"
        );
        assert!(!text.contains("Review with"), "{text}");
    }

    #[test]
    fn an_approval_request_is_listed_with_its_canonical_parameters_and_hash() {
        let parameters = convene_proto::json::to_struct(
            &serde_json::json!({ "to_version": 3, "rule_id": "RC-4711" }),
        );
        let hash = convene_approval::canonical::parameters_hash(&parameters).expect("a hash");
        let request = v1::ApprovalRequest {
            approval_id: "apr-1".to_owned(),
            action: "rule:rollback".to_owned(),
            parameters: Some(parameters),
            parameters_hash: hash.clone(),
            risk_level: v1::RiskLevel::R3 as i32,
            requester: "oncall@acme".to_owned(),
            state: v1::ApprovalState::Approved as i32,
            run_id: "run-1".to_owned(),
            approvals_required: 2,
            votes: vec![
                v1::Vote {
                    approver: "alice@acme".to_owned(),
                    decision: v1::VoteDecision::Approve as i32,
                    ..v1::Vote::default()
                },
                v1::Vote {
                    approver: "bob@acme".to_owned(),
                    decision: v1::VoteDecision::Approve as i32,
                    comment: "ok".to_owned(),
                    ..v1::Vote::default()
                },
            ],
            ..v1::ApprovalRequest::default()
        };
        let text = approval(&request);
        assert_eq!(
            text,
            format!(
                "apr-1  APPROVED  R3 rule:rollback  2/2 approvals  run run-1  requested by oncall@acme\n  \
                 parameters: {{\"rule_id\":\"RC-4711\",\"to_version\":3}}\n  \
                 hash:       {hash}\n  \
                 votes:      alice@acme approved, bob@acme approved (\"ok\")\n"
            )
        );
    }

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
