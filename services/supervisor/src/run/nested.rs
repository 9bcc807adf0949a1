//! Nested delegation: a running delegation's Delegate call adds child delegations to
//! the run, under tokens narrowed from its own, and is answered once they finish.

use std::sync::Arc;

use convene_core::time::to_timestamp;
use convene_proto::v1;
use convene_tokens::Claims;
use tokio::sync::oneshot;
use tracing::{Instrument as _, Span};

use super::propose::{self, Delegator};
use super::slot::{Batch, Slot, SlotState};
use super::{RunActor, deadline_of};
use crate::error::Error;
use crate::plan::{self, Placement};
use crate::store::{Events, StoreError};
use crate::trace;

impl RunActor {
    /// Handles a worker's Delegate call: plans its children and answers once they have
    /// all finished ([`Self::children_step`]), or at once when the call is refused.
    pub(super) async fn on_delegate(
        &mut self,
        claims: &Claims,
        token: &str,
        children: Vec<v1::PlannedDelegation>,
        reply: oneshot::Sender<Result<Vec<v1::DelegateOutcome>, Error>>,
        caller: &Span,
    ) -> Result<(), StoreError> {
        let plan_span = trace::plan_span(caller, "delegate", children.len());
        let planned = self
            .plan_children(claims, token, &children, caller)
            .instrument(plan_span.clone())
            .await;
        match planned {
            Err(e) => {
                convene_telemetry::set_error(&plan_span, e.to_string());
                let _ = reply.send(Err(e));
                Ok(())
            }
            Ok((indices, dropped_names, batch)) => {
                plan_span.record("convene.plan.dropped", dropped_names.len());
                let mut order = Vec::with_capacity(children.len());
                let mut kept = indices.iter();
                for c in &children {
                    if dropped_names.contains(&c.name) {
                        order.push((c.name.clone(), None));
                    } else {
                        order.push((c.name.clone(), kept.next().copied()));
                    }
                }
                self.pending.push(PendingDelegate {
                    children: order,
                    reply,
                });
                self.commit(Events::default()).await?;
                self.pump(batch);
                self.children_step();
                Ok(())
            }
        }
    }

    /// The tasks from the top-level delegation down to the one at ledger index `index`,
    /// in that order.
    fn path_to(&self, index: usize) -> Vec<&v1::DelegationTask> {
        let mut path = Vec::new();
        let mut next = self.run.delegations[index].task.as_ref();
        while let Some(task) = next {
            path.push(task);
            if task.parent_delegation_id.is_empty() || path.len() > 64 {
                break;
            }
            next = self
                .run
                .delegations
                .iter()
                .filter_map(|d| d.task.as_ref())
                .find(|t| t.delegation_id == task.parent_delegation_id);
        }
        path.reverse();
        path
    }

    /// Checks a nested Delegate call and adds its children to the ledger; returns the
    /// kept children's ledger indices, the names TRUNCATE dropped, and the batch.
    pub(super) async fn plan_children(
        &mut self,
        claims: &Claims,
        token: &str,
        children: &[v1::PlannedDelegation],
        caller: &Span,
    ) -> Result<(Vec<usize>, Vec<String>, usize), Error> {
        if self.terminal() {
            return Err(Error::FailedPrecondition(format!(
                "run {} has ended; report what you have",
                self.run.run_id
            )));
        }
        let Some(parent) = self.run.delegations.iter().position(|d| {
            d.task
                .as_ref()
                .is_some_and(|t| t.delegation_id == claims.delegation_id)
        }) else {
            return Err(Error::FailedPrecondition(format!(
                "delegation {} is not part of run {}",
                claims.delegation_id, self.run.run_id
            )));
        };
        if self.run.delegations[parent].result.is_some() || !self.slots[parent].in_flight() {
            return Err(Error::FailedPrecondition(format!(
                "delegation {} is not running; only a running delegation may delegate",
                claims.delegation_id
            )));
        }
        if !claims.may_redelegate {
            return Err(Error::PermissionDenied(
                "your task token does not allow redelegation (may_redelegate = false): handle this task yourself".to_owned(),
            ));
        }
        let parent_task = self.run.delegations[parent]
            .task
            .clone()
            .unwrap_or_default();
        let depth = parent_task.depth + 1;
        // The chain the children would extend, from the top: a planner's run starts it
        // with the planner and the run's goal.
        let chain = self.path_to(parent);
        let mut path: Vec<(&str, &str)> = Vec::with_capacity(chain.len() + 1);
        if let Some(planner) = &self.spec.planner {
            path.push((
                planner.profile_id.as_str(),
                self.run.spec.as_ref().map_or("", |s| s.goal.as_str()),
            ));
        }
        path.extend(
            chain
                .iter()
                .map(|t| (t.profile_id.as_str(), t.goal.as_str())),
        );
        let plan = self.check_batch(depth, children.len())?;
        // What the delegating task may hand on: its token's scopes and tools.
        let holds = claims.permissions().map_err(|e| {
            Error::PermissionDenied(format!("your task token's scopes cannot be read: {e}"))
        })?;
        let delegator = Delegator {
            name: "this task",
            scope: parent_task.scope.as_ref(),
            holds: &holds,
            tools: Some(&claims.tools),
            refuses_wider: true,
        };
        let mut planned = Vec::with_capacity(children.len());
        let mut filled = Vec::with_capacity(children.len());
        let mut names = std::collections::BTreeSet::new();
        for (i, c) in children.iter().enumerate() {
            let field = format!("delegations[{i}]");
            let mut wire = c.clone();
            let description = self.deps.registry.description(&wire.profile_id);
            let defaults = propose::apply_defaults(
                &mut wire,
                &self.deps.policy_file,
                &delegator,
                description.as_deref(),
            );
            let p = self.check_proposal(&field, &wire, &path)?;
            if !names.insert(p.name.clone()) {
                return Err(Error::invalid(
                    format!("{field}.name"),
                    format!("name {} is used twice in this call", p.name),
                ));
            }
            propose::check_servable(&wire, &self.deps.policy_file, &delegator)
                .map_err(|e| Error::FailedPrecondition(format!("{field}: {e}")))?;
            planned.push(p);
            filled.push((wire, defaults));
        }
        let children = &filled;
        drop(path);
        drop(chain);
        let t = self.deps.clock.now();
        let parent_deadline = deadline_of(&parent_task, self.deps.clock.now());
        // A retried delegation repeats its Delegate calls: its call indices start again
        // at 0 with each attempt, so a repeated call derives the ids of the children the
        // earlier attempt created and finds them in the ledger (running or finished)
        // instead of creating and running them again.
        let attempt = self.slots[parent].attempts;
        if self.slots[parent].children_attempt != attempt {
            self.slots[parent].children_attempt = attempt;
            self.slots[parent].children = 0;
        }
        let first_index = self.slots[parent].children;
        // Per kept child, in call order: where it is, or will be, in the ledger.
        let mut kept: Vec<Kept> = Vec::with_capacity(children.len());
        let mut tasks = Vec::new();
        let mut revive: Vec<Option<usize>> = Vec::new();
        // Per new child (not revived), in order: the defaults it was given.
        let mut new_defaults: Vec<Vec<v1::AppliedDefault>> = Vec::new();
        let mut repeated = false;
        let mut dropped_names = Vec::new();
        for (i, (p, (wire, defaults))) in planned.iter().zip(children).enumerate() {
            if plan.dropped.contains(&i) {
                dropped_names.push(p.name.clone());
                continue;
            }
            #[allow(clippy::cast_possible_truncation)] // batches are capped far below u32
            let call_index = first_index + i as u32;
            let task = plan::task(
                p,
                wire,
                Placement {
                    run_id: &self.run.run_id,
                    parent: Some(&parent_task.delegation_id),
                    depth,
                    round: 0,
                    call_index,
                },
                &self.deps.policy_file,
                t,
                parent_deadline.min(self.spec.limits.deadline),
            );
            let existing = self.run.delegations.iter().position(|d| {
                d.task
                    .as_ref()
                    .is_some_and(|e| e.delegation_id == task.delegation_id)
            });
            match existing {
                Some(index) => {
                    let earlier = self.run.delegations[index].task.as_ref();
                    let same = earlier
                        .is_some_and(|e| e.name == task.name && e.profile_id == task.profile_id);
                    if !same {
                        // Fail closed, as for a conflicting duplicate result: the id is
                        // taken by another child.
                        return Err(Error::FailedPrecondition(format!(
                            "delegations[{i}]: call index {call_index} of delegation {} already \
                             addresses child {} ({}) from an earlier attempt; a retried \
                             delegation must repeat its Delegate calls in the same order",
                            parent_task.delegation_id,
                            earlier.map_or("", |e| e.name.as_str()),
                            earlier.map_or("", |e| e.profile_id.as_str()),
                        )));
                    }
                    repeated = true;
                    if self.slots[index].dormant() {
                        kept.push(Kept::ToStart(tasks.len()));
                        tasks.push(self.run.delegations[index].task.clone().unwrap_or(task));
                        revive.push(Some(index));
                    } else {
                        kept.push(Kept::Existing(index));
                    }
                }
                None => {
                    kept.push(Kept::ToStart(tasks.len()));
                    tasks.push(task);
                    revive.push(None);
                    new_defaults.push(defaults.clone());
                }
            }
        }
        // Child tokens can only narrow the parent's; the policy service refuses wider.
        let tokens = self.issue_tokens(&tasks, Some(token)).await?;
        #[allow(clippy::cast_possible_truncation)]
        {
            self.slots[parent].children += children.len() as u32;
        }
        let batch = self.batches.len();
        self.batches
            .push(Batch::new(self.spec.limits.max_parallel_workers as usize));
        let mut created = Vec::with_capacity(tasks.len());
        let mut new_defaults = new_defaults.into_iter();
        for ((task, token), revived) in tasks.into_iter().zip(tokens).zip(revive) {
            // A child's span hangs under the call that asked for it, which is how its
            // parent delegation reached the supervisor.
            let span = trace::delegation_span(caller, &task);
            if let Some(index) = revived {
                // Asked for again after a restart: dispatched again under its own id.
                let slot = &mut self.slots[index];
                slot.state = SlotState::Waiting;
                slot.token = token;
                slot.batch = batch;
                slot.span = span;
                self.batches[batch].queue.push_back(index);
                created.push(index);
                continue;
            }
            let index = self.add_pending(task);
            Arc::make_mut(&mut self.run).delegations[index].defaults =
                new_defaults.next().unwrap_or_default();
            let mut slot = Slot::new(false, batch, SlotState::Waiting, span);
            slot.token = token;
            self.slots.push(slot);
            self.batches[batch].queue.push_back(index);
            created.push(index);
        }
        let indices = kept
            .into_iter()
            .map(|k| match k {
                Kept::Existing(index) => index,
                Kept::ToStart(position) => created[position],
            })
            .collect();
        // A repeated call drops the same children again; they are recorded once.
        if !repeated {
            for name in &dropped_names {
                Arc::make_mut(&mut self.run).truncated.push(name.clone());
            }
        }
        Ok((indices, dropped_names, batch))
    }

    /// Answers Delegate calls whose children have all finished, in call order.
    pub(super) fn children_step(&mut self) {
        let mut i = 0;
        while i < self.pending.len() {
            let done = self.pending[i].children.iter().all(|(_, idx)| {
                idx.is_none_or(|x| {
                    let d = &self.run.delegations[x];
                    d.result.is_some()
                        || matches!(
                            v1::DelegationState::try_from(d.state),
                            Ok(v1::DelegationState::Cancelled
                                | v1::DelegationState::Failed
                                | v1::DelegationState::TimedOut)
                        ) && !self.slots[x].in_flight()
                })
            });
            if !done {
                i += 1;
                continue;
            }
            let p = self.pending.swap_remove(i);
            let outcomes = p
                .children
                .iter()
                .map(|(name, idx)| match idx {
                    None => v1::DelegateOutcome {
                        name: name.clone(),
                        dropped: true,
                        error: Some(v1::ErrorInfo {
                            code: "truncated".to_owned(),
                            retryable: false,
                            message: format!(
                                "dropped: the call asked for more than max_parallel_workers ({}) and overflow is TRUNCATE",
                                self.spec.limits.max_parallel_workers
                            ),
                        }),
                        ..Default::default()
                    },
                    Some(x) => {
                        let d = &self.run.delegations[*x];
                        v1::DelegateOutcome {
                            name: name.clone(),
                            delegation_id: d.task.as_ref().map(|t| t.delegation_id.clone()).unwrap_or_default(),
                            result: d.result.clone(),
                            error: d.result.is_none().then(|| v1::ErrorInfo {
                                code: "no_result".to_owned(),
                                retryable: false,
                                message: if d.detail.is_empty() {
                                    "the child delegation produced no result".to_owned()
                                } else {
                                    d.detail.clone()
                                },
                            }),
                            dropped: false,
                            defaults: d.defaults.clone(),
                        }
                    }
                })
                .collect();
            let _ = p.reply.send(Ok(outcomes));
        }
    }

    /// Settles the nested children still waiting for a slot: once the budget is
    /// exhausted nothing starts again, so they never would. Their Delegate calls are
    /// answered as soon as their running siblings are done, rather than holding the
    /// delegating worker until its deadline. (Top-level delegations stay for the join,
    /// which ends the run on the exhausted budget.)
    pub(super) fn settle_queued_children(&mut self, detail: &str) {
        let t = to_timestamp(self.deps.clock.now());
        for b in 0..self.batches.len() {
            let queued: Vec<usize> = self.batches[b]
                .queue
                .iter()
                .copied()
                .filter(|&i| !self.slots[i].top_level)
                .collect();
            if queued.is_empty() {
                continue;
            }
            self.batches[b].queue.retain(|i| !queued.contains(i));
            for i in queued {
                self.slots[i].state = SlotState::Done;
                let d = &mut Arc::make_mut(&mut self.run).delegations[i];
                d.state = v1::DelegationState::Cancelled as i32;
                d.detail = detail.to_owned();
                d.completed_at = Some(t);
                self.end_delegation_span(i);
            }
        }
        self.children_step();
    }
}

/// A Delegate call waiting for its children to finish.
pub(super) struct PendingDelegate {
    /// Per requested child, in call order: the ledger index, or None when dropped.
    children: Vec<(String, Option<usize>)>,
    reply: oneshot::Sender<Result<Vec<v1::DelegateOutcome>, Error>>,
}

/// A child a Delegate call keeps (TRUNCATE did not drop it), in call order.
enum Kept {
    /// A child an earlier attempt of the parent created: its ledger index.
    Existing(usize),
    /// A new child, or a dormant one asked for again after a restart: the position of
    /// its task among those that need a token and a dispatch.
    ToStart(usize),
}
