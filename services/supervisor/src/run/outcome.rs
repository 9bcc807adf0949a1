//! What a dispatch reports: the delegation dispatched, and its outcome (a result, or a
//! failure retried or recorded as the delegation's result), with the budget it used.

use std::sync::Arc;

use convene_core::join;
use convene_core::time::to_timestamp;
use convene_proto::v1::{self, run_event::Kind};
use tonic::Code;
use tracing::{Instrument as _, Span};

use super::slot::SlotState;
use super::{RunActor, backoff, deadline_of, status_is_transient, task_or_empty};
use crate::error::Error;
use crate::events;
use crate::store::{Events, StoreError};
use crate::trace;

impl RunActor {
    /// Records that delegation `index` was dispatched; returns its event.
    pub(super) fn dispatched(
        &mut self,
        index: usize,
        worker_id: String,
        attempt: u32,
    ) -> v1::RunEvent {
        if !self.slots[index].workers.contains(&worker_id) {
            self.slots[index].workers.push(worker_id.clone());
        }
        if self.run.state == v1::RunState::Pending as i32 {
            Arc::make_mut(&mut self.run).state = v1::RunState::Running as i32;
        }
        let d = &mut Arc::make_mut(&mut self.run).delegations[index];
        d.state = v1::DelegationState::Dispatched as i32;
        d.worker_id.clone_from(&worker_id);
        d.attempts = attempt;
        if d.dispatched_at.is_none() {
            d.dispatched_at = Some(to_timestamp(self.deps.clock.now()));
        }
        let task = task_or_empty(&d.task);
        let dispatched = v1::DelegationDispatched {
            delegation_id: task.delegation_id.clone(),
            name: task.name.clone(),
            profile_id: task.profile_id.clone(),
            worker_id,
            attempt,
            depth: task.depth,
        };
        self.event(Kind::Dispatched(dispatched))
    }

    pub(super) async fn on_outcome(
        &mut self,
        index: usize,
        attempt: u32,
        worker_id: Option<String>,
        outcome: Result<v1::TaskResult, Error>,
    ) -> Result<(), StoreError> {
        let settings = self.deps.settings;
        let max_attempts = self.spec.limits.max_redelegations + 1;
        let task = task_or_empty(&self.run.delegations[index].task);
        let now = self.deps.clock.now();
        let time_left = deadline_of(task, now) > now;
        let (delegation_id, profile_id) = (task.delegation_id.clone(), task.profile_id.clone());
        let may_retry = !self.terminal()
            && !self.slots[index].cancelled
            && attempt.saturating_sub(self.slots[index].attempt_base) < max_attempts
            && time_left
            && !self.cancel.is_cancelled();
        match outcome {
            Ok(result) => {
                let retryable = result.status == v1::TaskStatus::Failed as i32
                    && result.error.as_ref().is_some_and(|e| e.retryable);
                if retryable && may_retry {
                    self.slots[index].span.in_scope(|| {
                        tracing::info!(run_id = %self.run.run_id, %delegation_id, attempt, "transient worker failure; retrying under the same delegation id");
                    });
                    self.launch(index, backoff(&settings, attempt));
                    return Ok(());
                }
                // Charge before the slot frees up, so a result that exhausts the
                // budget also stops the next queued delegation from starting.
                self.account(&result);
                self.release(index);
                self.record(index, result, false, true).await
            }
            Err(error) => {
                let status = error.grpc_code();
                if matches!(status, Code::Unavailable | Code::Unknown)
                    && let Some(w) = &worker_id
                {
                    self.deps.registry.mark_dead(w);
                }
                let transient = status_is_transient(status);
                if transient && may_retry {
                    self.slots[index].span.in_scope(|| {
                        tracing::info!(run_id = %self.run.run_id, %delegation_id, attempt, code = ?status, "dispatch failed; dispatching again under the same delegation id");
                    });
                    self.launch(index, backoff(&settings, attempt));
                    return Ok(());
                }
                self.release(index);
                if status == Code::Cancelled && self.slots[index].cancelled {
                    return self.mark_cancelled(index).await;
                }
                let code = match status {
                    Code::NotFound => "no_worker",
                    Code::DeadlineExceeded => "timeout",
                    Code::Cancelled => "cancelled",
                    c if status_is_transient(c) => "worker_unavailable",
                    _ => "dispatch_failed",
                };
                let failed = v1::TaskResult {
                    delegation_id,
                    worker_id: worker_id.unwrap_or_default(),
                    profile_id,
                    status: if code == "timeout" {
                        v1::TaskStatus::TimedOut as i32
                    } else {
                        v1::TaskStatus::Failed as i32
                    },
                    summary: format!("no result after {attempt} attempt(s): {error}"),
                    error: Some(v1::ErrorInfo {
                        code: code.to_owned(),
                        retryable: false,
                        message: error.to_string(),
                    }),
                    ..Default::default()
                };
                self.record(index, failed, true, false).await
            }
        }
    }

    /// A dispatch of `index` is over for good: free its batch slot.
    pub(super) fn release(&mut self, index: usize) {
        let slot = &mut self.slots[index];
        if slot.in_flight() {
            slot.state = SlotState::Done;
            let batch = slot.batch;
            self.batches[batch].running = self.batches[batch].running.saturating_sub(1);
            self.pump(batch);
        }
    }

    pub(super) async fn mark_cancelled(&mut self, index: usize) -> Result<(), StoreError> {
        let d = &mut Arc::make_mut(&mut self.run).delegations[index];
        if d.result.is_none() {
            if d.state != v1::DelegationState::TimedOut as i32 {
                d.state = v1::DelegationState::Cancelled as i32;
            }
            d.completed_at = Some(to_timestamp(self.deps.clock.now()));
        }
        self.end_delegation_span(index);
        self.children_step();
        self.commit(Events::default()).await
    }

    /// Records a delegation's final state on its span and ends it (once).
    pub(super) fn end_delegation_span(&mut self, index: usize) {
        let span = std::mem::replace(&mut self.slots[index].span, Span::none());
        trace::record_delegation_end(&span, &self.run.delegations[index]);
    }

    /// Adds a result's usage to the run and charges the budget; once the budget is
    /// exhausted no further delegation starts.
    pub(super) fn account(&mut self, result: &v1::TaskResult) {
        if let Some(usage) = &result.usage {
            self.account_usage(usage);
        }
    }

    /// Adds `usage` (a result's, a planner turn's) to the run and charges the budget.
    pub(super) fn account_usage(&mut self, usage: &v1::Usage) {
        {
            let u = Arc::make_mut(&mut self.run)
                .usage
                .get_or_insert_with(Default::default);
            u.iterations += usage.iterations;
            u.tool_calls += usage.tool_calls;
            u.tokens += usage.tokens;
            u.cost += usage.cost;
            u.duration_ms += usage.duration_ms;
            if let Err(e) = self.ledger.charge(usage)
                && !self.budget_stopped
            {
                tracing::warn!(run_id = %self.run.run_id, error = %e, "budget exhausted: no further delegations start");
                self.budget_stopped = true;
                Arc::make_mut(&mut self.run).terminal_reason = e.to_string();
                self.settle_queued_children(&format!(
                    "not started: the run's budget is exhausted ({e})"
                ));
            }
        }
    }

    /// Records a result (or a synthesized failure) of delegation `index`; `accounted`
    /// when its usage was already charged. A top-level result that is not late is
    /// staged for the join: the caller settles ([`RunActor::settle`]).
    pub(super) async fn record(
        &mut self,
        index: usize,
        result: v1::TaskResult,
        failure: bool,
        accounted: bool,
    ) -> Result<(), StoreError> {
        let late = self.terminal();
        if self.slots[index].top_level && !late {
            // Staged for the join: verified with the others staged (`verify_staged`).
            self.staging.unverified(
                index,
                join::cited_evidence_ids(std::slice::from_ref(&result)),
            );
        } else {
            let span = self.slots[index].span.clone();
            self.verify_evidence(index, &result).instrument(span).await;
        }
        if !accounted {
            self.account(&result);
        }
        let d = &mut Arc::make_mut(&mut self.run).delegations[index];
        d.state = if failure {
            v1::DelegationState::Failed as i32
        } else {
            v1::DelegationState::Completed as i32
        };
        d.completed_at = Some(to_timestamp(self.deps.clock.now()));
        d.detail = if failure {
            result.summary.clone()
        } else {
            String::new()
        };
        d.result = Some(result.clone());
        let completed = v1::DelegationCompleted {
            delegation_id: result.delegation_id.clone(),
            name: d.task.as_ref().map(|t| t.name.clone()).unwrap_or_default(),
            state: d.state,
            status: result.status,
            summary: result.summary.clone(),
            late,
        };
        self.end_delegation_span(index);
        let e = self.event(Kind::Completed(completed));
        let cloud = events::cloud(
            events::DELEGATION_COMPLETED,
            &self.run,
            Some(&format!("delegations/{}", result.delegation_id)),
            self.deps.clock.now(),
            events::delegation_completed_data(&self.run, &self.run.delegations[index], late),
        );
        let mut ev = Events {
            run: vec![e],
            cloud: vec![cloud],
            commands: Vec::new(),
            release: false,
        };
        if self.slots[index].top_level {
            Arc::make_mut(&mut self.run).received.push(result);
            if late {
                self.late_revision(
                    &mut ev,
                    &self.run.delegations[index]
                        .task
                        .clone()
                        .unwrap_or_default()
                        .delegation_id,
                );
                return self.commit(ev).await;
            }
            // Committed with the join's decision on it, or when the join waits for more.
            self.staging.stage_result(ev);
            Ok(())
        } else {
            self.commit(ev).await?;
            self.children_step();
            Ok(())
        }
    }
}
