//! How an actor begins: a new run gets its task tokens and starts its delegations; a
//! resumed one is rebuilt from its stored state. And the token request both share with
//! StartRun.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use convene_core::join;
use convene_core::time::to_timestamp;
use convene_mesh::auth::request;
use convene_proto::v1::{self, run_event::Kind};
use tracing::Span;

use super::slot::{Slot, SlotState};
use super::{RunActor, backoff, status_is_transient};
use crate::error::Error;
use crate::store::{Events, StoreError};
use crate::{Deps, events, plan, trace};

impl RunActor {
    /// Begins a new run: a slot per planned delegation, the run's task tokens (asked
    /// for now unless StartRun has them), and the first dispatches.
    pub(super) async fn begin(&mut self) -> Result<(), StoreError> {
        let (live, tasks) = startable(&self.run);
        let no_task = v1::DelegationTask::default();
        for (i, d) in self.run.delegations.iter().enumerate() {
            let task = d.task.as_ref().unwrap_or(&no_task);
            let state = if live.contains(&i) {
                SlotState::Waiting
            } else {
                SlotState::Done
            };
            self.slots.push(Slot::new(
                true,
                0,
                state,
                trace::delegation_span(&self.span, task),
            ));
        }
        // Delegations that never start (dropped by TRUNCATE) are in the trace too.
        for i in 0..self.slots.len() {
            if !live.contains(&i) {
                self.end_delegation_span(i);
            }
        }
        // StartRun asked for the tokens while it stored the run; a run started another
        // way asks now.
        let issued = match self.issued.take() {
            Some(issued) => issued,
            None => self.issue_tokens(&tasks, None).await,
        };
        match issued {
            Ok(tokens) => {
                for (i, token) in live.iter().zip(tokens) {
                    self.slots[*i].token = token;
                    self.batches[0].queue.push_back(*i);
                }
            }
            Err(e) => {
                let reason = format!("task tokens were refused: {e}");
                return self.finish(None, v1::RunState::Failed, reason).await;
            }
        }
        // The run turns RUNNING with its first dispatch, in that dispatch's commit:
        // until a worker takes a delegation it is PENDING, accepted and not dispatched.
        self.pump(0);
        if live.is_empty() {
            self.join_step("plan").await?;
        }
        Ok(())
    }

    /// Takes a stored run over: rebuilds the slots from the ledger, gets fresh tokens
    /// in one call for every top-level delegation that is dispatched again or whose
    /// results are verified again, and applies the join.
    pub(super) async fn begin_resumed(&mut self) -> Result<(), StoreError> {
        // What the stored events say: the next sequence number, and every worker each
        // delegation was dispatched to (the join checks that a result came from one).
        let stored = self.deps.store.run_events(&self.run.run_id, 0).await?;
        self.next_seq = stored.last().map_or(1, |e| e.sequence + 1);
        let mut dispatched_to: HashMap<String, Vec<String>> = HashMap::new();
        for e in &stored {
            if let Some(Kind::Dispatched(d)) = &e.kind {
                let workers = dispatched_to.entry(d.delegation_id.clone()).or_default();
                if !workers.contains(&d.worker_id) {
                    workers.push(d.worker_id.clone());
                }
            }
        }
        drop(stored);
        tracing::info!(
            run_id = %self.run.run_id,
            version = self.run.version,
            state = events::run_state_name(self.run.state),
            received = self.run.received.len(),
            "resuming the run from its stored state"
        );

        let no_task = v1::DelegationTask::default();
        // A waiting run was claimed for a command: nothing of it is dispatched again
        // (its delegations stopped when it began to wait).
        let waiting = crate::store::is_waiting(self.run.state);
        // Top-level delegations to dispatch again, and those whose results the join has.
        let mut redispatch = Vec::new();
        let mut verify = Vec::new();
        for (i, d) in self.run.delegations.iter().enumerate() {
            let task = d.task.as_ref().unwrap_or(&no_task);
            let top_level = task.parent_delegation_id.is_empty();
            let settled = waiting
                || d.result.is_some()
                || matches!(
                    v1::DelegationState::try_from(d.state),
                    Ok(v1::DelegationState::Dropped
                        | v1::DelegationState::Cancelled
                        | v1::DelegationState::Failed)
                );
            let mut workers = dispatched_to
                .remove(&task.delegation_id)
                .unwrap_or_default();
            if !d.worker_id.is_empty() && !workers.contains(&d.worker_id) {
                workers.push(d.worker_id.clone());
            }
            if top_level && !settled {
                redispatch.push(i);
            }
            if top_level && d.result.is_some() {
                verify.push(i);
            }
            // A nested child is dispatched again only when its parent's repeated
            // Delegate call asks for it: without a parent waiting, its result would
            // reach no one.
            let state = if settled {
                SlotState::Done
            } else if top_level {
                SlotState::Waiting
            } else {
                SlotState::Dormant
            };
            let mut slot = Slot::new(
                top_level,
                0,
                state,
                // Settled delegations were traced by whoever settled them.
                if top_level && !settled {
                    trace::delegation_span(&self.span, task)
                } else {
                    Span::none()
                },
            );
            slot.attempts = d.attempts;
            slot.attempt_base = d.attempts;
            slot.workers = workers;
            self.slots.push(slot);
        }
        if let Some(usage) = self.run.usage
            && let Err(e) = self.ledger.charge(&usage)
        {
            tracing::warn!(run_id = %self.run.run_id, error = %e, "the run's budget is exhausted: no further delegations start");
            self.budget_stopped = true;
        }

        let mut wanted: Vec<usize> = redispatch.iter().chain(&verify).copied().collect();
        wanted.sort_unstable();
        let tasks: Vec<v1::DelegationTask> = wanted
            .iter()
            .filter_map(|i| self.run.delegations[*i].task.clone())
            .collect();
        match self.issue_tokens(&tasks, None).await {
            Ok(tokens) => {
                for (i, token) in wanted.iter().zip(tokens) {
                    self.slots[*i].token = token;
                }
            }
            Err(e) => {
                let reason = format!("task tokens were refused when the run was resumed: {e}");
                return self.finish(None, v1::RunState::Failed, reason).await;
            }
        }
        if self.run.state == v1::RunState::Pending as i32 {
            // Accepted, then the supervisor stopped before the run started.
            Arc::make_mut(&mut self.run).state = v1::RunState::Running as i32;
            self.commit(Events::default()).await?;
        }
        // The join's facts: every result it received, verified again.
        let by_id: HashMap<String, usize> = self
            .run
            .delegations
            .iter()
            .enumerate()
            .filter_map(|(i, d)| Some((d.task.as_ref()?.delegation_id.clone(), i)))
            .collect();
        for result in &self.run.received {
            if let Some(&index) = by_id.get(&result.delegation_id) {
                self.staging.unverified(
                    index,
                    join::cited_evidence_ids(std::slice::from_ref(result)),
                );
            }
        }
        self.verify_staged().await;
        // Commands stored while no actor ran the run (a takeover, a waiting run claimed
        // for them) are applied before anything else happens to it: a cancel before any
        // dispatch or deadline.
        Box::pin(self.on_commands()).await?;
        if self.terminal() && !waiting {
            return Ok(());
        }
        for i in redispatch {
            self.batches[0].queue.push_back(i);
        }
        self.pump(0);
        self.join_step("resume").await
    }

    pub(super) async fn issue_tokens(
        &self,
        tasks: &[v1::DelegationTask],
        parent_token: Option<&str>,
    ) -> Result<Vec<String>, Error> {
        issue_tokens(
            &self.deps,
            &self.run,
            self.spec.limits.max_depth,
            tasks,
            parent_token,
        )
        .await
    }
}

/// Tries of an IssueTaskToken call that fails transiently.
const TOKEN_ATTEMPTS: u32 = 8;

/// The top-level delegations a new run starts with: those still pending (not dropped),
/// by index, with their tasks.
pub(crate) fn startable(run: &v1::Run) -> (Vec<usize>, Vec<v1::DelegationTask>) {
    run.delegations
        .iter()
        .enumerate()
        .filter(|(_, d)| d.state == v1::DelegationState::Pending as i32)
        .filter_map(|(i, d)| Some((i, d.task.clone()?)))
        .unzip()
}

/// Asks the policy service for one task token per task of `run`, in one call.
pub(crate) async fn issue_tokens(
    deps: &Deps,
    run: &v1::Run,
    max_depth: u32,
    tasks: &[v1::DelegationTask],
    parent_token: Option<&str>,
) -> Result<Vec<String>, Error> {
    if tasks.is_empty() {
        return Ok(Vec::new());
    }
    let t = deps.clock.now();
    let req = v1::IssueTaskTokenRequest {
        principal: run.principal.clone(),
        run_id: run.run_id.clone(),
        parent_token: parent_token.unwrap_or_default().to_owned(),
        lease_epoch: run.lease_epoch,
        grants: tasks
            .iter()
            .map(|task| plan::grant(task, max_depth, t))
            .collect(),
    };
    // The policy service may be restarting (a resumed run meets it right after a crash
    // of the mesh): transient failures are retried a few times, so they do not fail the
    // run.
    let mut attempt = 0;
    let tokens = loop {
        attempt += 1;
        match deps
            .policy
            .issue_task_token(request(req.clone(), &deps.credential))
            .await
        {
            Ok(r) => break r.into_inner().tokens,
            Err(s) if status_is_transient(s.code()) && attempt < TOKEN_ATTEMPTS => {
                tracing::warn!(run_id = %run.run_id, attempt, error = %s.message(), "task tokens could not be issued; retrying");
                tokio::time::sleep(
                    backoff(&deps.settings, attempt).max(Duration::from_millis(200)),
                )
                .await;
            }
            Err(s) => return Err(s.into()),
        }
    };
    if tokens.len() != tasks.len() {
        return Err(Error::TokenCount {
            got: tokens.len(),
            wanted: tasks.len(),
        });
    }
    Ok(tokens.into_iter().map(|t| t.token).collect())
}

/// The sequence number the next event of stored run `run_id` gets.
pub(crate) async fn next_sequence(deps: &Deps, run_id: &str) -> Result<u64, StoreError> {
    let stored = deps.store.run_events(run_id, 0).await?;
    Ok(stored.last().map_or(1, |e| e.sequence + 1))
}

/// Ends a stored run that cannot be resumed, as FAILED with `reason`, in one commit with
/// its events (there is no actor to do it).
pub(super) async fn fail_stored(deps: Arc<Deps>, mut run: v1::Run, reason: String) {
    tracing::error!(run_id = %run.run_id, %reason, "the run cannot be resumed; it fails");
    let next = match next_sequence(&deps, &run.run_id).await {
        Ok(next) => next,
        Err(e) => {
            tracing::error!(run_id = %run.run_id, error = %e, "the run's events cannot be read");
            return;
        }
    };
    let t = deps.clock.now();
    run.state = v1::RunState::Failed as i32;
    run.terminal_reason = reason.clone();
    run.version += 1;
    run.updated_at = Some(to_timestamp(t));
    let events = Events {
        run: vec![v1::RunEvent {
            sequence: next,
            run_id: run.run_id.clone(),
            time: Some(to_timestamp(t)),
            kind: Some(Kind::Terminal(v1::RunTerminal {
                state: run.state,
                outcome: run.outcome,
                reason,
            })),
        }],
        cloud: vec![events::cloud(
            events::RUN_COMPLETED,
            &run,
            None,
            t,
            events::run_completed_data(&run),
        )],
        commands: Vec::new(),
        release: false,
    };
    if let Err(e) = deps.store.commit(&run, &events).await {
        tracing::error!(run_id = %run.run_id, error = %e, "the failed run could not be stored");
    }
}
