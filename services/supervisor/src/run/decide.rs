//! The join and the run's end: the join step on the results received, its timers and
//! the run's deadline, finishing the run with its decision, and revisions for results
//! that arrive after it.

use std::sync::Arc;
use std::time::SystemTime;

use convene_core::join::{self, ExpectedDelegation, JoinInput, JoinState};
use convene_core::model::LateResultPolicy;
use convene_core::time::to_timestamp;
use convene_proto::v1::{self, run_event::Kind};
use tracing::Instrument as _;

use super::RunActor;
use super::slot::Slot;
use crate::crash::CrashPoint;
use crate::store::{Events, StoreError, is_waiting};
use crate::{events, trace};

impl RunActor {
    /// The top-level delegations the join expects a result of.
    pub(super) fn expected(&self) -> Vec<ExpectedDelegation> {
        self.run
            .delegations
            .iter()
            .zip(&self.slots)
            .filter(|(d, s)| s.top_level && d.state != v1::DelegationState::Dropped as i32)
            .filter_map(|(d, s)| {
                let t = d.task.as_ref()?;
                Some(ExpectedDelegation {
                    delegation_id: t.delegation_id.clone(),
                    name: t.name.clone(),
                    profile_id: t.profile_id.clone(),
                    worker_ids: s.workers.clone(),
                    allowed_evidence_prefixes: t.allowed_evidence_prefixes.clone(),
                })
            })
            .collect()
    }

    /// The join's input at `now`: the contract, the `expected` delegations (from
    /// [`Self::expected`]), every result received and the evidence facts known.
    pub(super) fn join_input<'a>(
        &'a self,
        expected: &'a [ExpectedDelegation],
        now: SystemTime,
    ) -> JoinInput<'a> {
        JoinInput {
            contract: &self.spec.join,
            delegations: expected,
            results: &self.run.received,
            evidence: &self.facts,
            now,
            settlements: &self.settlements,
        }
    }

    /// Whether the join could decide on the results received, whatever the evidence
    /// store says of them ([`join::may_decide`]).
    pub(super) fn join_may_decide(&self) -> bool {
        let expected = self.expected();
        join::may_decide(&self.join_input(&expected, self.deps.clock.now()))
    }

    /// Evaluates the join (`trigger` says what prompted it, for the trace) and ends the
    /// run when it decides.
    pub(super) async fn join_step(&mut self, trigger: &'static str) -> Result<(), StoreError> {
        if self.terminal() {
            return Ok(());
        }
        if self.spec.planner.is_some() && !self.human_round() {
            // A planner's run decides round by round (until a person asks for a
            // follow-up: then the join decides on it as on a static plan's).
            return Box::pin(self.planner_step()).await;
        }
        // The staged results' evidence is asked about once the answer can matter: while
        // the join waits for delegations that have not reported, whatever the store
        // says, it stays pending, and the results are asked about with those still to
        // come, in one call. A run that ran out of budget publishes what there is, so
        // it asks at once.
        if self.staging.has_unverified() && (self.budget_stopped || self.join_may_decide()) {
            self.verify_staged().await;
        }
        let span = trace::join_span(&self.span, &self.spec.join, trigger);
        let expected = self.expected();
        let input = self.join_input(&expected, self.deps.clock.now());
        match span.in_scope(|| join::decide(&input)) {
            JoinState::Decided(mut decision) => {
                // A run that resumed (a follow-up a person asked for) decides again: the
                // next revision.
                if let Some(previous) = &self.run.decision {
                    decision.revision = previous.revision + 1;
                }
                trace::record_decision(&span, &decision);
                let state = self.state_for(decision.outcome, false);
                let reason = decision.reasons.first().cloned().unwrap_or_default();
                // Approval requests the decision files are its children.
                self.finish(Some(decision), state, reason)
                    .instrument(span)
                    .await
            }
            JoinState::Pending {
                deadline,
                waiting_for,
            } => {
                trace::record_pending(&span, &waiting_for);
                let idle = self.slots.iter().all(|s| !s.in_flight())
                    && self
                        .batches
                        .iter()
                        .all(|b| b.queue.is_empty() || self.budget_stopped);
                // Nothing can change any more: publish what there is.
                let assessed = (idle && self.budget_stopped).then(|| join::assess(&input));
                self.join_timer = deadline;
                if let Some(decision) = assessed {
                    trace::record_decision(&span, &decision);
                    let reason = self.run.terminal_reason.clone();
                    return self
                        .finish(Some(decision), v1::RunState::BudgetExhausted, reason)
                        .instrument(span)
                        .await;
                }
                Ok(())
            }
        }
    }

    /// The join's timer or the run's deadline is due.
    pub(super) async fn on_timer(&mut self) -> Result<(), StoreError> {
        let t = self.deps.clock.now();
        if t >= self.spec.limits.deadline {
            // The run's hard deadline: decide on what there is and stop everything.
            self.cancel.cancel();
            self.verify_staged().await;
            let span = trace::join_span(&self.span, &self.spec.join, "deadline");
            let expected = self.expected();
            let decision = join::assess(&self.join_input(&expected, t));
            trace::record_decision(&span, &decision);
            let state = self.state_for(decision.outcome, true);
            return self
                .finish(
                    Some(decision),
                    state,
                    "the run's deadline passed".to_owned(),
                )
                .instrument(span)
                .await;
        }
        self.join_timer = None;
        self.join_step("timer").await
    }

    /// The run's state for a join outcome.
    pub(super) fn state_for(&self, outcome: i32, _hard_deadline: bool) -> v1::RunState {
        match v1::JoinOutcome::try_from(outcome) {
            Ok(v1::JoinOutcome::Complete) => v1::RunState::Succeeded,
            Ok(v1::JoinOutcome::PartialEvidence) => v1::RunState::Partial,
            Ok(
                v1::JoinOutcome::CompleteWithReviewRequired
                | v1::JoinOutcome::ConflictRequiresHuman,
            ) => v1::RunState::WaitingInput,
            _ => v1::RunState::Failed,
        }
    }

    /// Stops the run on a decision (if any) in `state`: records the decision, files
    /// approval requests for proposed R2/R3 actions of accepted results, stops what must
    /// stop, and commits. A state the join decided (SUCCEEDED, PARTIAL or a waiting
    /// state) becomes the run's state after people's part ([`Self::settled_state`]):
    /// waiting while a conflict is open or an action pending, else final.
    pub(super) async fn finish(
        &mut self,
        decision: Option<v1::JoinDecision>,
        state: v1::RunState,
        reason: String,
    ) -> Result<(), StoreError> {
        self.finish_with(decision, state, reason, Events::default())
            .await
    }

    /// [`Self::finish`], committing `ev` (what led to it) with the end.
    pub(super) async fn finish_with(
        &mut self,
        decision: Option<v1::JoinDecision>,
        mut state: v1::RunState,
        reason: String,
        mut ev: Events,
    ) -> Result<(), StoreError> {
        let t = self.deps.clock.now();
        let decided_by_join = matches!(
            state,
            v1::RunState::Succeeded
                | v1::RunState::Partial
                | v1::RunState::WaitingInput
                | v1::RunState::WaitingApproval
        );
        // A planner's run ends on the decision its last round recorded already: its
        // approval requests are filed now, and it is not recorded twice.
        let recorded = decision.is_some() && decision == self.run.decision;
        if let Some(decision) = decision {
            if !recorded {
                self.record_decision(&decision, &mut ev, t);
            }
            if decided_by_join {
                let filed = self.file_approvals(&decision).await;
                let run = Arc::make_mut(&mut self.run);
                for action in filed {
                    if !run.approval_ids.contains(&action.approval_id) {
                        run.approval_ids.push(action.approval_id.clone());
                        run.actions.push(action);
                    }
                }
            }
        }
        if decided_by_join {
            state = self.settled_state();
        }
        self.stop_in(state, reason, ev).await
    }

    /// Puts the run in the stopped `state` (final or waiting) with `reason`, stops what
    /// must stop, and commits `ev` with the events of the stop: `waiting` (a new ticket
    /// when the run begins to wait or its ticket was used) or `terminal` and
    /// `run.completed`, once.
    pub(super) async fn stop_in(
        &mut self,
        state: v1::RunState,
        reason: String,
        mut ev: Events,
    ) -> Result<(), StoreError> {
        let t = self.deps.clock.now();
        let was = self.run.state;
        Arc::make_mut(&mut self.run).state = state as i32;
        if !reason.is_empty() {
            Arc::make_mut(&mut self.run).terminal_reason = reason.clone();
        }
        let waiting = is_waiting(state as i32);
        // In-flight delegations: under APPEND_REVISION their results may still revise
        // the decision of a run that stopped, so they keep running to their own
        // deadlines; otherwise they stop.
        let keep_running = state != v1::RunState::Cancelled
            && self.spec.join.late_result == LateResultPolicy::AppendRevision
            && !self.cancel.is_cancelled();
        let mut never_started = Vec::new();
        for (i, d) in Arc::make_mut(&mut self.run)
            .delegations
            .iter_mut()
            .enumerate()
        {
            let in_flight = self.slots.get(i).is_some_and(Slot::in_flight);
            let dormant = self.slots.get(i).is_some_and(Slot::dormant);
            if d.state == v1::DelegationState::Pending as i32 && !in_flight {
                d.state = v1::DelegationState::Cancelled as i32;
                d.detail = "the run ended before it was dispatched".to_owned();
                never_started.push(i);
            } else if d.state == v1::DelegationState::Dispatched as i32
                && !in_flight
                && d.result.is_none()
            {
                // Dispatched by a replica that died; this one ends the run before
                // dispatching it again.
                d.state = v1::DelegationState::Cancelled as i32;
                d.detail = "the run ended before this delegation answered".to_owned();
                never_started.push(i);
            } else if dormant && d.result.is_none() {
                d.state = v1::DelegationState::Cancelled as i32;
                d.detail = "the run ended before this child was asked for again after the supervisor restarted".to_owned();
                never_started.push(i);
            } else if in_flight && d.result.is_none() {
                d.state = v1::DelegationState::TimedOut as i32;
                d.detail = "the run decided before this delegation answered".to_owned();
            }
        }
        for i in never_started {
            self.end_delegation_span(i);
        }
        for b in &mut self.batches {
            b.queue.clear();
        }
        if !keep_running {
            for s in &mut self.slots {
                s.cancelled = true;
            }
            self.cancel.cancel();
        }
        if waiting {
            let fresh = !is_waiting(was) || self.ticket_used || self.run.ticket.is_none();
            if fresh {
                self.ticket_used = false;
                // Versions count the run's waits: past the current ticket and every
                // ticket an input was given under.
                let version = self
                    .run
                    .human_decisions
                    .iter()
                    .filter_map(|h| h.ticket.as_ref())
                    .chain(self.run.ticket.as_ref())
                    .map(|t| t.version)
                    .max()
                    .unwrap_or(0)
                    + 1;
                Arc::make_mut(&mut self.run).ticket = Some(v1::RunTicket {
                    id: uuid::Uuid::now_v7().to_string(),
                    version,
                    issued_at: Some(to_timestamp(t)),
                });
            }
            if fresh || was != state as i32 {
                let waiting = self.waiting_event(state, reason);
                ev.cloud.push(events::cloud(
                    events::RUN_WAITING,
                    &self.run,
                    None,
                    t,
                    events::run_waiting_data(&self.run, &waiting),
                ));
                let e = self.event(Kind::Waiting(waiting));
                ev.run.push(e);
            }
        } else {
            // Nothing to resume any more.
            if self.run.ticket.is_some() {
                Arc::make_mut(&mut self.run).ticket = None;
            }
            let e = self.event(Kind::Terminal(v1::RunTerminal {
                state: state as i32,
                outcome: self.run.outcome,
                reason,
            }));
            ev.run.push(e);
            ev.cloud.push(events::cloud(
                events::RUN_COMPLETED,
                &self.run,
                None,
                t,
                events::run_completed_data(&self.run),
            ));
        }
        // A waiting run gives up its lease with this commit, unless delegations whose
        // late results may still revise its decision are in flight: then when they are
        // done (see `RunActor::stop`).
        if waiting && !(keep_running && self.slots.iter().any(Slot::in_flight)) {
            ev.release = true;
            self.lease_released = true;
        }
        let decided = self.run.decision.is_some();
        self.commit(ev).await?;
        if decided {
            self.deps.crash.at(CrashPoint::AfterDecision);
        }
        trace::record_run_end(&self.span, &self.run);
        tracing::info!(
            run_id = %self.run.run_id,
            state = events::run_state_name(self.run.state),
            outcome = events::outcome_name(self.run.outcome),
            "{}",
            if waiting { "run waits for people" } else { "run finished" }
        );
        Ok(())
    }

    /// Makes `decision` the run's latest, with its revision, its `join.decided` cloud
    /// event and its run event in `ev`.
    pub(super) fn record_decision(
        &mut self,
        decision: &v1::JoinDecision,
        ev: &mut Events,
        t: SystemTime,
    ) {
        let run = Arc::make_mut(&mut self.run);
        run.outcome = decision.outcome;
        run.revisions.push(decision.clone());
        run.decision = Some(decision.clone());
        ev.cloud.push(events::cloud(
            events::JOIN_DECIDED,
            &self.run,
            Some("decision"),
            t,
            events::join_decided_data(&self.run, decision),
        ));
        let e = self.event(Kind::Decision(decision.clone()));
        ev.run.push(e);
    }

    /// A result arrived after the decision: discard it or append a revision, per the
    /// contract. The run's state never changes.
    pub(super) fn late_revision(&mut self, ev: &mut Events, delegation_id: &str) {
        let Some(previous) = self.run.decision.clone() else {
            return;
        };
        let expected = self.expected();
        let input = self.join_input(&expected, self.deps.clock.now());
        let span = trace::join_span(&self.span, &self.spec.join, "late_result");
        let decision = span.in_scope(|| join::apply_late(&previous, &input, delegation_id));
        trace::record_decision(&span, &decision);
        if decision.revision != previous.revision {
            Arc::make_mut(&mut self.run)
                .revisions
                .push(decision.clone());
            ev.cloud.push(events::cloud(
                events::JOIN_DECIDED,
                &self.run,
                Some("decision"),
                self.deps.clock.now(),
                events::join_decided_data(&self.run, &decision),
            ));
            let e = self.event(Kind::Decision(decision.clone()));
            ev.run.push(e);
        }
        Arc::make_mut(&mut self.run).decision = Some(decision);
    }
}
