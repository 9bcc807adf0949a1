//! Executing approved requests exactly once: the claim written before the executor
//! runs, the task that runs the action and records its outcome (with its `executed`
//! event), and the per-request locks that queue concurrent Execute calls in this
//! process.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex, Weak},
};

use convene_core::time::Clock;
use convene_mesh::auth::Caller;
use convene_proto::v1;
use prost_types::{Struct, Value, value::Kind};
use tokio::sync::OwnedMutexGuard;
use tonic::Status;
use tracing::Instrument as _;

use super::{ApprovalService, MAX_ATTEMPTS, ROLE_EXECUTE, required, required_hash};
use crate::{
    error::ApprovalError,
    events::Event,
    executor::{Executor, ExecutorError},
    model::{Execution, ExecutionClaim, State},
    store::{ApprovalStore, StoreError, Versioned},
};

impl ApprovalService {
    pub(super) async fn execute_inner(
        &self,
        caller: &Caller,
        msg: v1::ApprovalExecuteRequest,
    ) -> Result<(Execution, bool), Status> {
        let principal = caller.require_role(ROLE_EXECUTE, "execute approved requests")?;
        required("approval_id", &msg.approval_id)?;
        required_hash(&msg.parameters_hash)?;

        // Held until the execution is recorded (it moves into the executing task), so
        // concurrent calls for this request wait and then answer with the record.
        let guard = self.locks.acquire(&msg.approval_id).await;
        let mut attempts = 0;
        let claimed = loop {
            attempts += 1;
            if attempts > MAX_ATTEMPTS {
                return Err(ApprovalError::Contended {
                    approval_id: msg.approval_id,
                }
                .into());
            }
            let stored = self
                .load_in_tenant(&msg.approval_id, &principal.tenant)
                .await?;
            let request = &stored.request;
            if msg.parameters_hash != request.parameters_hash {
                return Err(ApprovalError::ParametersChanged {
                    approval_id: msg.approval_id,
                    quoted: msg.parameters_hash,
                    current: request.parameters_hash.clone(),
                }
                .into());
            }
            if let Some(execution) = &request.execution {
                return Ok((execution.clone(), false));
            }
            if request.executing.is_some() {
                return Err(ApprovalError::ExecutionInProgress {
                    approval_id: msg.approval_id,
                }
                .into());
            }
            let now = self.clock.now();
            if let Some(reason) = request.not_executable_reason(now) {
                return Err(ApprovalError::NotApproved {
                    approval_id: msg.approval_id,
                    reason,
                }
                .into());
            }
            let mut claim = stored.request.clone();
            claim.executing = Some(ExecutionClaim {
                by: principal.id.clone(),
                started_at: now,
            });
            // The claim is no state change: it is written without an event.
            match self.store.update(stored.version, claim, None).await {
                Ok(claimed) => break claimed,
                Err(StoreError::Conflict { .. }) => {}
                Err(e) => return Err(ApprovalError::from(e).into()),
            }
        };

        let run = ExecutionRun {
            store: self.store.clone(),
            executor: self.executor.clone(),
            clock: self.clock.clone(),
            executed_by: principal.id.clone(),
        };
        // A task of its own, so the action runs to completion and is recorded even when
        // the caller goes away mid-call.
        let task = tokio::spawn(run.run(claimed, guard).in_current_span());
        match task.await {
            Ok(result) => Ok((result?, true)),
            Err(join) => Err(ApprovalError::Internal(format!(
                "the executor task for approval request {} failed: {join}",
                msg.approval_id
            ))
            .into()),
        }
    }
}

/// What the executing task needs, owned, so it outlives the call that started it.
struct ExecutionRun {
    store: Arc<dyn ApprovalStore>,
    executor: Arc<dyn Executor>,
    clock: Clock,
    executed_by: String,
}

impl ExecutionRun {
    /// Runs the claimed request's action and records the outcome. `_guard` keeps other
    /// Execute calls for the request waiting until the record is written.
    async fn run(
        self,
        claimed: Versioned,
        _guard: OwnedMutexGuard<()>,
    ) -> Result<Execution, ApprovalError> {
        let approval_id = claimed.request.approval_id.clone();
        let action = claimed.request.action.clone();
        let outcome = self.executor.execute(&claimed.request).await;
        let executed_at = self.clock.now();
        let (success, output) = match outcome {
            Ok(outcome) => (outcome.success, outcome.output),
            Err(ExecutorError::Failed(detail)) => (false, error_output(&detail)),
            Err(ExecutorError::NotStarted(detail)) => {
                self.release(claimed).await?;
                tracing::warn!(%approval_id, %detail, "executor could not start the action");
                return Err(ApprovalError::ExecutorUnavailable {
                    executor: self.executor.name().to_owned(),
                    action,
                    detail,
                });
            }
        };
        let execution = Execution {
            executor: self.executor.name().to_owned(),
            success,
            output,
            executed_at,
            executed_by: self.executed_by.clone(),
        };
        let mut current = claimed;
        for _ in 0..MAX_ATTEMPTS {
            let mut done = current.request.clone();
            done.execution = Some(execution.clone());
            done.executing = None;
            done.state = State::Executed;
            let event = Event::executed(&done, &execution);
            match self.store.update(current.version, done, Some(event)).await {
                Ok(_) => {
                    tracing::info!(
                        %approval_id,
                        %action,
                        executor = %execution.executor,
                        success,
                        executed_by = %execution.executed_by,
                        "approved action executed"
                    );
                    return Ok(execution);
                }
                Err(StoreError::Conflict { .. }) => {
                    current =
                        self.store
                            .get(&approval_id)
                            .await?
                            .ok_or_else(|| StoreError::Missing {
                                approval_id: approval_id.clone(),
                            })?;
                }
                Err(e) => {
                    tracing::error!(
                        %approval_id,
                        success,
                        output = ?execution.output,
                        error = %e,
                        "action executed but its record could not be written; the request stays claimed"
                    );
                    return Err(e.into());
                }
            }
        }
        Err(ApprovalError::Contended { approval_id })
    }

    /// Drops the execution claim after the executor did nothing, so the request can be
    /// executed again.
    async fn release(&self, claimed: Versioned) -> Result<(), ApprovalError> {
        let mut current = claimed;
        for _ in 0..MAX_ATTEMPTS {
            let mut released = current.request.clone();
            released.executing = None;
            match self.store.update(current.version, released, None).await {
                Ok(_) => return Ok(()),
                Err(StoreError::Conflict { .. }) => {
                    current = self
                        .store
                        .get(&current.request.approval_id)
                        .await?
                        .ok_or_else(|| StoreError::Missing {
                            approval_id: current.request.approval_id.clone(),
                        })?;
                }
                Err(e) => return Err(e.into()),
            }
        }
        Err(ApprovalError::Contended {
            approval_id: current.request.approval_id,
        })
    }
}

/// The output recorded for an execution that failed: `{"error": detail}`.
fn error_output(detail: &str) -> Struct {
    Struct {
        fields: [(
            "error".to_owned(),
            Value {
                kind: Some(Kind::StringValue(detail.to_owned())),
            },
        )]
        .into_iter()
        .collect(),
    }
}

/// One async mutex per request being executed, created on demand and forgotten when
/// nobody holds or waits for it.
#[derive(Debug, Default)]
pub(super) struct ExecutionLocks {
    locks: Mutex<HashMap<String, Weak<tokio::sync::Mutex<()>>>>,
}

impl ExecutionLocks {
    pub(super) async fn acquire(&self, approval_id: &str) -> OwnedMutexGuard<()> {
        let lock = {
            let mut locks = self.locks.lock().unwrap_or_else(|e| e.into_inner());
            // Entries nobody holds any more are dead weight; the map stays as small as
            // the set of requests being executed right now.
            locks.retain(|_, lock| lock.strong_count() > 0);
            if let Some(lock) = locks.get(approval_id).and_then(Weak::upgrade) {
                lock
            } else {
                let lock = Arc::new(tokio::sync::Mutex::new(()));
                locks.insert(approval_id.to_owned(), Arc::downgrade(&lock));
                lock
            }
        };
        lock.lock_owned().await
    }
}
