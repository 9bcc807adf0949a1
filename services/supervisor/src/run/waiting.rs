//! A run that waits for people, and the commands that continue it.
//!
//! A run the join decided stops in a state that says what it waits for
//! ([`RunActor::settled_state`]): WAITING_INPUT while a conflict is open, else
//! WAITING_APPROVAL while an approval request it filed is pending, else a final state
//! by the decision. A waiting run holds no worker and no replica (its lease goes in the
//! commit that makes it wait), and carries a ticket.
//!
//! Commands (`crate::store::RunCommand`) are stored by whichever replica receives them;
//! the replica that owns the run, or claims the waiting run for them, applies them in
//! order ([`RunActor::on_commands`]), each in the commit that carries its effect:
//!
//! - **cancel**: the run ends CANCELLED, its pending approval requests are withdrawn;
//! - **resume** with the current ticket: settle a conflict (a new decision revision with
//!   the person's settlement), ask for a follow-up (a new delegation under the run's
//!   budget; the join decides again when it reports), or close the run as it stands;
//! - **approval**: one of the run's approval requests changed; its actions are read
//!   again and the run goes on waiting, or ends.

use std::sync::Arc;

use convene_core::join;
use convene_core::time::to_timestamp;
use convene_proto::v1::{self, run_event::Kind};
use tonic::Code;

use super::RunActor;
use super::slot::{Slot, SlotState};
use crate::events;
use crate::store::{CommandDone, CommandKind, Events, StoreError, is_final, is_waiting};
use crate::trace;

/// A command's outcome.
fn done(command_id: &str, code: Code, message: impl Into<String>) -> CommandDone {
    CommandDone {
        command_id: command_id.to_owned(),
        code: code as i32,
        message: message.into(),
    }
}

/// The final state a decision maps to once people's part is over.
fn final_state(outcome: i32) -> v1::RunState {
    match v1::JoinOutcome::try_from(outcome) {
        Ok(v1::JoinOutcome::Complete | v1::JoinOutcome::CompleteWithReviewRequired) => {
            v1::RunState::Succeeded
        }
        Ok(v1::JoinOutcome::PartialEvidence | v1::JoinOutcome::ConflictRequiresHuman) => {
            v1::RunState::Partial
        }
        _ => v1::RunState::Failed,
    }
}

impl RunActor {
    /// Whether a person closed the run.
    fn closed(&self) -> bool {
        self.run
            .human_decisions
            .iter()
            .any(|h| h.kind == v1::HumanDecisionKind::Close as i32)
    }

    /// Whether a person asked for a follow-up: the join then decides on the run's
    /// delegations as on a static plan's.
    pub(super) fn human_round(&self) -> bool {
        self.run
            .human_decisions
            .iter()
            .any(|h| h.kind == v1::HumanDecisionKind::FollowUp as i32)
    }

    /// Topics of the current decision's conflicts nobody settled, while they hold the
    /// run (the outcome is CONFLICT_REQUIRES_HUMAN and nobody closed the run).
    fn open_conflicts(&self) -> Vec<String> {
        let Some(decision) = &self.run.decision else {
            return Vec::new();
        };
        if self.closed() || decision.outcome != v1::JoinOutcome::ConflictRequiresHuman as i32 {
            return Vec::new();
        }
        decision
            .conflicts
            .iter()
            .filter(|c| c.settlement.is_none())
            .map(|c| c.topic.clone())
            .collect()
    }

    /// The state of a run the join decided, after people's part: waiting for input while
    /// a conflict is open, for approvals while a request it filed is pending, else final
    /// by the decision.
    pub(super) fn settled_state(&self) -> v1::RunState {
        if !self.open_conflicts().is_empty() {
            v1::RunState::WaitingInput
        } else if !self.closed() && self.actions_pending() {
            v1::RunState::WaitingApproval
        } else {
            final_state(self.run.outcome)
        }
    }

    /// The `waiting` event of the run stopping in `state`.
    pub(super) fn waiting_event(&self, state: v1::RunState, reason: String) -> v1::RunWaiting {
        v1::RunWaiting {
            state: state as i32,
            outcome: self.run.outcome,
            reason,
            ticket: self.run.ticket.clone(),
            open_conflicts: self.open_conflicts(),
            pending_approvals: self
                .run
                .actions
                .iter()
                .filter(|a| !super::approvals::action_settled(a.state))
                .map(|a| a.approval_id.clone())
                .collect(),
        }
    }

    /// Adds the `resumed` event (and its CloudEvent) to `ev`.
    fn push_resumed(&mut self, ev: &mut Events, by: &str, input: &str, detail: String) {
        let resumed = v1::RunResumed {
            by: by.to_owned(),
            input: input.to_owned(),
            detail,
        };
        ev.cloud.push(events::cloud(
            events::RUN_RESUMED,
            &self.run,
            None,
            self.deps.clock.now(),
            events::run_resumed_data(&self.run, &resumed),
        ));
        let e = self.event(Kind::Resumed(resumed));
        ev.run.push(e);
    }

    /// Applies the run's pending commands, oldest first.
    pub(super) async fn on_commands(&mut self) -> Result<(), StoreError> {
        let commands = self.deps.store.pending_commands(&self.run.run_id).await?;
        for command in commands {
            self.deps
                .crash
                .at(crate::crash::CrashPoint::CommandReceived);
            let id = command.command_id.clone();
            let unapplied = match command.kind {
                Some(CommandKind::Cancel(req)) => {
                    self.apply_cancel(&id, &command.principal, &req).await?
                }
                Some(CommandKind::Resume(req)) => {
                    self.apply_resume(&id, &command.principal, req).await?
                }
                Some(CommandKind::Approval(event)) => self.apply_approval(&id, &event).await?,
                None => Some(done(&id, Code::InvalidArgument, "the command is empty")),
            };
            if let Some(outcome) = unapplied {
                self.deps.store.end_commands(&[outcome]).await?;
            }
        }
        Ok(())
    }

    /// Cancels the run. `None`: committed with the change.
    async fn apply_cancel(
        &mut self,
        id: &str,
        principal: &str,
        req: &v1::CancelRunRequest,
    ) -> Result<Option<CommandDone>, StoreError> {
        if is_final(self.run.state) {
            return Ok(Some(done(
                id,
                Code::Ok,
                format!(
                    "the run had ended already ({})",
                    events::run_state_name(self.run.state)
                ),
            )));
        }
        let reason = if req.reason.trim().is_empty() {
            format!("cancelled by {principal}")
        } else {
            format!("cancelled by {principal}: {}", req.reason.trim())
        };
        self.cancel.cancel();
        self.cancel_actions(&reason).await;
        let mut ev = Events::default();
        ev.commands.push(done(id, Code::Ok, "cancelled"));
        if is_waiting(self.run.state) {
            self.push_resumed(&mut ev, principal, "cancel", reason.clone());
        }
        self.stop_in(v1::RunState::Cancelled, reason, ev).await?;
        Ok(None)
    }

    /// One of the run's approval requests changed.
    async fn apply_approval(
        &mut self,
        id: &str,
        event: &v1::CloudEvent,
    ) -> Result<Option<CommandDone>, StoreError> {
        if !is_waiting(self.run.state) {
            // A run that does not wait reads its requests when it stops next.
            return Ok(Some(done(id, Code::Ok, "the run was not waiting")));
        }
        let changed = self.refresh_actions().await;
        let state = self.settled_state();
        let mut ev = Events::default();
        ev.commands
            .push(done(id, Code::Ok, "the run's actions were read again"));
        if state as i32 == self.run.state {
            if !changed {
                return Ok(Some(done(id, Code::Ok, "nothing changed")));
            }
            self.commit(ev).await?;
            return Ok(None);
        }
        let detail = format!(
            "{} on approval request {}",
            event.r#type,
            event.subject.trim_start_matches("approvals/")
        );
        self.push_resumed(&mut ev, "approval", "approval", detail);
        let reason = if is_waiting(state as i32) {
            self.run.terminal_reason.clone()
        } else {
            "every approval request the run filed is settled".to_owned()
        };
        self.stop_in(state, reason, ev).await?;
        Ok(None)
    }

    /// Resumes the waiting run with a person's input, under the current ticket.
    async fn apply_resume(
        &mut self,
        id: &str,
        principal: &str,
        req: v1::ResumeRunRequest,
    ) -> Result<Option<CommandDone>, StoreError> {
        if !is_waiting(self.run.state) {
            return Ok(Some(done(
                id,
                Code::FailedPrecondition,
                format!(
                    "run {} is not waiting for input ({}); only a waiting run can be resumed",
                    self.run.run_id,
                    events::run_state_name(self.run.state)
                ),
            )));
        }
        let current = self.run.ticket.clone().unwrap_or_default();
        let given = req.ticket.clone().unwrap_or_default();
        if given.id != current.id || given.version != current.version || self.ticket_used {
            return Ok(Some(done(
                id,
                Code::FailedPrecondition,
                format!(
                    "ticket {} (version {}) is not the run's current ticket; the current ticket is {} (version {}): read the run again and decide on what it shows now",
                    given.id, given.version, current.id, current.version
                ),
            )));
        }
        let rationale = req.rationale.trim().to_owned();
        match req.input {
            Some(v1::resume_run_request::Input::Settle(settle)) => {
                self.settle_conflict(id, principal, &rationale, current, settle)
                    .await
            }
            Some(v1::resume_run_request::Input::FollowUp(follow_up)) => {
                self.follow_up(id, principal, &rationale, current, follow_up)
                    .await
            }
            Some(v1::resume_run_request::Input::Close(_)) => {
                let t = self.deps.clock.now();
                Arc::make_mut(&mut self.run)
                    .human_decisions
                    .push(v1::HumanDecision {
                        kind: v1::HumanDecisionKind::Close as i32,
                        decided_by: principal.to_owned(),
                        decided_at: Some(to_timestamp(t)),
                        rationale: rationale.clone(),
                        ticket: Some(current),
                        ..Default::default()
                    });
                self.ticket_used = true;
                let reason = format!("closed by {principal}: {rationale}");
                self.cancel_actions(&reason).await;
                let mut ev = Events::default();
                ev.commands.push(done(id, Code::Ok, "closed"));
                self.push_resumed(&mut ev, principal, "close", reason.clone());
                let state = self.settled_state();
                self.stop_in(state, reason, ev).await?;
                Ok(None)
            }
            None => Ok(Some(done(
                id,
                Code::InvalidArgument,
                "input: give one of settle, follow_up or close",
            ))),
        }
    }

    /// Settles an open conflict by the side a person chose; the join decides again.
    async fn settle_conflict(
        &mut self,
        id: &str,
        principal: &str,
        rationale: &str,
        ticket: v1::RunTicket,
        settle: v1::SettleConflict,
    ) -> Result<Option<CommandDone>, StoreError> {
        let open = self.open_conflicts();
        let Some(conflict) = self
            .run
            .decision
            .as_ref()
            .and_then(|d| d.conflicts.iter().find(|c| c.topic == settle.topic))
            .filter(|c| open.contains(&c.topic))
            .cloned()
        else {
            return Ok(Some(done(
                id,
                Code::FailedPrecondition,
                format!(
                    "run {} has no open conflict on `{}`; its open conflicts: {}",
                    self.run.run_id,
                    settle.topic,
                    if open.is_empty() {
                        "none".to_owned()
                    } else {
                        open.join(", ")
                    }
                ),
            )));
        };
        let name_of = |delegation_id: &str| {
            self.run
                .delegations
                .iter()
                .filter_map(|d| d.task.as_ref())
                .find(|t| t.delegation_id == delegation_id)
                .map_or_else(|| delegation_id.to_owned(), |t| t.name.clone())
        };
        let Some(side) = conflict
            .claims
            .iter()
            .find(|c| {
                c.delegation_id == settle.delegation_id
                    || name_of(&c.delegation_id) == settle.delegation_id
            })
            .cloned()
        else {
            let sides: Vec<String> = conflict
                .claims
                .iter()
                .map(|c| {
                    format!(
                        "{} ({}) = {}",
                        c.delegation_id,
                        name_of(&c.delegation_id),
                        c.value
                    )
                })
                .collect();
            return Ok(Some(done(
                id,
                Code::InvalidArgument,
                format!(
                    "settle.delegation_id: `{}` is not a side of the conflict on `{}`; its sides: {}",
                    settle.delegation_id,
                    conflict.topic,
                    sides.join("; ")
                ),
            )));
        };
        let cited: Vec<&String> = conflict
            .claims
            .iter()
            .flat_map(|c| &c.evidence_refs)
            .collect();
        if let Some(unknown) = settle.evidence_ids.iter().find(|e| !cited.contains(e)) {
            return Ok(Some(done(
                id,
                Code::InvalidArgument,
                format!(
                    "settle.evidence_ids: `{unknown}` is not cited by the conflict's claims; name evidence of: {}",
                    cited
                        .iter()
                        .map(|s| s.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            )));
        }
        let chosen_name = name_of(&side.delegation_id);
        let evidence_ids = if settle.evidence_ids.is_empty() {
            side.evidence_refs.clone()
        } else {
            settle.evidence_ids.clone()
        };
        let t = self.deps.clock.now();
        let settlement = v1::ConflictSettlement {
            delegation_id: side.delegation_id.clone(),
            value: side.value.clone(),
            decided_by: principal.to_owned(),
            rationale: rationale.to_owned(),
            evidence_ids: evidence_ids.clone(),
            decided_at: Some(to_timestamp(t)),
        };
        self.settlements.insert(conflict.topic.clone(), settlement);
        Arc::make_mut(&mut self.run)
            .human_decisions
            .push(v1::HumanDecision {
                kind: v1::HumanDecisionKind::Settle as i32,
                decided_by: principal.to_owned(),
                decided_at: Some(to_timestamp(t)),
                rationale: rationale.to_owned(),
                ticket: Some(ticket),
                topic: conflict.topic.clone(),
                delegation_id: side.delegation_id.clone(),
                value: side.value.clone(),
                evidence_ids,
                ..Default::default()
            });
        self.ticket_used = true;
        let detail = format!(
            "settled `{}`: `{}` from `{}`",
            conflict.topic, side.value, chosen_name
        );
        let mut ev = Events::default();
        ev.commands.push(done(id, Code::Ok, detail.clone()));
        self.push_resumed(&mut ev, principal, "settle", detail);
        // The join decides again over every result, with the settlement.
        let previous = self.run.decision.clone().unwrap_or_default();
        let expected = self.expected();
        let span = trace::join_span(&self.span, &self.spec.join, "settlement");
        let mut decision = span.in_scope(|| join::assess(&self.join_input(&expected, t)));
        decision.revision = previous.revision + 1;
        decision.late_discarded = previous.late_discarded;
        decision.reasons.insert(
            0,
            format!(
                "revision {}: {principal} settled the conflict on `{}`",
                decision.revision, conflict.topic
            ),
        );
        trace::record_decision(&span, &decision);
        let state = self.state_for(decision.outcome, false);
        let reason = decision.reasons.first().cloned().unwrap_or_default();
        self.finish_with(Some(decision), state, reason, ev).await?;
        Ok(None)
    }

    /// Starts a follow-up delegation a person asked for: the run runs again, and the
    /// join decides when it reports.
    async fn follow_up(
        &mut self,
        id: &str,
        principal: &str,
        rationale: &str,
        ticket: v1::RunTicket,
        follow_up: v1::FollowUp,
    ) -> Result<Option<CommandDone>, StoreError> {
        let refuse = |code: Code, message: String| Ok(Some(done(id, code, message)));
        let goal = follow_up.goal.trim().to_owned();
        if goal.is_empty() {
            return refuse(
                Code::InvalidArgument,
                "follow_up.goal: must not be empty: say what the follow-up must establish"
                    .to_owned(),
            );
        }
        if !self
            .deps
            .policy_file
            .profiles
            .contains_key(&follow_up.profile_id)
        {
            return refuse(
                Code::InvalidArgument,
                crate::plan::unknown_profile(
                    &self.deps.policy_file,
                    "follow_up.profile_id".to_owned(),
                    &follow_up.profile_id,
                )
                .to_string(),
            );
        }
        let now = self.deps.clock.now();
        if now >= self.spec.limits.deadline {
            return refuse(
                Code::FailedPrecondition,
                "the run's deadline has passed: a follow-up cannot run within its limits; start a new run".to_owned(),
            );
        }
        if let Err(e) = self.ledger.check() {
            return refuse(
                Code::ResourceExhausted,
                format!("the run's budget is spent ({e}): a follow-up cannot run within it"),
            );
        }
        // The follow-up asks what the person wants of a profile the run used, with the
        // scope the run gave that profile; a profile the run never used gets the
        // profile's own tools and no data scope beyond its evidence.
        let template = self
            .run
            .delegations
            .iter()
            .rev()
            .filter_map(|d| d.task.as_ref())
            .find(|t| t.profile_id == follow_up.profile_id && t.parent_delegation_id.is_empty())
            .cloned();
        let round = self
            .run
            .delegations
            .iter()
            .filter_map(|d| d.task.as_ref())
            .map(|t| t.round)
            .max()
            .unwrap_or(0)
            + 1;
        let n = self
            .run
            .human_decisions
            .iter()
            .filter(|h| h.kind == v1::HumanDecisionKind::FollowUp as i32)
            .count()
            + 1;
        let profile = self.deps.policy_file.profiles.get(&follow_up.profile_id);
        let mut task = template.unwrap_or_else(|| v1::DelegationTask {
            allowed_tools: profile.map(|p| p.tools.clone()).unwrap_or_default(),
            allowed_evidence_prefixes: profile
                .map(|p| p.evidence_prefixes.clone())
                .unwrap_or_default(),
            required_scopes: vec![crate::plan::evidence_scope()],
            acceptance_criteria: vec![
                "answer the goal with claims that cite the evidence they rest on".to_owned(),
            ],
            depth: 1,
            ..Default::default()
        });
        task.delegation_id = convene_core::ids::delegation_id(&self.run.run_id, None, round, 0);
        task.run_id = self.run.run_id.clone();
        task.parent_delegation_id = String::new();
        task.depth = 1;
        task.profile_id = follow_up.profile_id.clone();
        task.goal = goal.clone();
        task.name = format!("follow-up-{n}-{}", follow_up.profile_id);
        task.round = round;
        task.call_index = 0;
        task.deadline = Some(to_timestamp(self.spec.limits.deadline));
        let token = match self.issue_tokens(std::slice::from_ref(&task), None).await {
            Ok(mut tokens) => tokens.pop().unwrap_or_default(),
            Err(e) => {
                return refuse(
                    Code::PermissionDenied,
                    format!("the policy refused the follow-up's task token: {e}"),
                );
            }
        };
        let t = self.deps.clock.now();
        let delegation_id = task.delegation_id.clone();
        let index = self.add_pending(task.clone());
        let mut slot = Slot::new(
            true,
            0,
            SlotState::Waiting,
            trace::delegation_span(&self.span, &task),
        );
        slot.token = token;
        self.slots.push(slot);
        self.batches[0].queue.push_back(index);
        // The run runs again: the dispatches and their reports are its own once more.
        self.cancel = tokio_util::sync::CancellationToken::new();
        let run = Arc::make_mut(&mut self.run);
        run.state = v1::RunState::Running as i32;
        run.ticket = None;
        run.human_decisions.push(v1::HumanDecision {
            kind: v1::HumanDecisionKind::FollowUp as i32,
            decided_by: principal.to_owned(),
            decided_at: Some(to_timestamp(t)),
            rationale: rationale.to_owned(),
            ticket: Some(ticket),
            profile_id: follow_up.profile_id.clone(),
            goal,
            follow_up_delegation_id: delegation_id.clone(),
            ..Default::default()
        });
        self.ticket_used = true;
        let detail = format!(
            "follow-up {delegation_id} asked of `{}`",
            follow_up.profile_id
        );
        let mut ev = Events::default();
        ev.commands.push(done(id, Code::Ok, detail.clone()));
        self.push_resumed(&mut ev, principal, "follow_up", detail);
        self.commit(ev).await?;
        self.pump(0);
        Ok(None)
    }
}
