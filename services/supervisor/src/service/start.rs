//! What StartRun builds (the run, its ledger and first events) and how it waits for
//! the run to stop.

use std::time::SystemTime;

use convene_core::limits;
use convene_core::time::to_timestamp;
use convene_mesh::policy_file::Principal;
use convene_proto::v1::{self, run_event::Kind};

use super::SupervisorService;
use crate::error::Error;
use crate::events;
use crate::plan::{self, Placement};
use crate::store::{Events, is_terminal};

impl SupervisorService {
    /// `run` once it has ended (`StartRun` with `wait`). `watch` was taken before the
    /// version of `run` at hand was stored or read, and `seen` is the sequence of the
    /// last event that version holds, when known. The note of this process's commit
    /// that ended the run carries the run as stored; a note that carries the run's next
    /// events says by itself that it goes on; any other (a gap, another replica's
    /// commit, lost notes) is checked in the store.
    pub(super) async fn until_ended(
        &self,
        mut run: v1::Run,
        mut watch: crate::watchers::Watch,
        mut seen: Option<u64>,
    ) -> Result<v1::Run, Error> {
        while !is_terminal(run.state) {
            let read = tokio::select! {
                changed = watch.receiver().changed() => {
                    if changed.is_err() {
                        return Err(Error::Unavailable(format!(
                            "the supervisor stopped watching run {}; it goes on: follow it with WatchRun or GetRun",
                            run.run_id
                        )));
                    }
                    let note = watch.receiver().borrow_and_update();
                    if let Some(ended) = &note.ended {
                        return Ok(ended.as_ref().clone());
                    }
                    let next = seen.and_then(|last| note.events_after(last));
                    seen = next.is_some().then_some(note.sequence);
                    next.is_none_or(|events| {
                        events.iter().any(|e| {
                            matches!(e.kind, Some(Kind::Terminal(_) | Kind::Waiting(_)))
                        })
                    })
                }
                () = self.shutdown.wait() => {
                    return Err(Error::Unavailable(format!(
                        "the supervisor is shutting down; run {} goes on: follow it with WatchRun or GetRun",
                        run.run_id
                    )));
                }
            };
            if read {
                run = self.stored_run(&run.run_id).await?;
            }
        }
        Ok(run)
    }

    pub(super) fn build_run(
        &self,
        identity: RunIdentity,
        spec: &v1::RunSpec,
        domain: &convene_core::model::RunSpec,
        principal: &Principal,
        now: SystemTime,
    ) -> (v1::Run, Events, bool) {
        let RunIdentity {
            run_id,
            trace_id,
            trace_parent,
        } = identity;
        let limits = &domain.limits;
        let plan = limits::plan_batch(
            domain.plan.len(),
            limits.max_parallel_workers,
            limits.overflow,
        );
        let mut delegations = Vec::with_capacity(domain.plan.len());
        let mut truncated = Vec::new();
        for (i, (p, wire)) in domain.plan.iter().zip(&spec.delegations).enumerate() {
            #[allow(clippy::cast_possible_truncation)] // plans are capped far below u32
            let task = plan::task(
                p,
                wire,
                Placement {
                    run_id: &run_id,
                    parent: None,
                    depth: 1,
                    round: 0,
                    call_index: i as u32,
                },
                &self.deps.policy_file,
                now,
                limits.deadline,
            );
            let dropped = plan.as_ref().is_ok_and(|b| b.dropped.contains(&i));
            if dropped {
                truncated.push(p.name.clone());
            }
            delegations.push(v1::Delegation {
                task: Some(task),
                state: if dropped {
                    v1::DelegationState::Dropped as i32
                } else {
                    v1::DelegationState::Pending as i32
                },
                detail: if dropped {
                    crate::run::truncated_detail(limits.max_parallel_workers, limits.overflow)
                } else {
                    String::new()
                },
                ..Default::default()
            });
        }
        let mut run = v1::Run {
            run_id,
            tenant: principal.tenant.clone(),
            principal: principal.id.clone(),
            spec: Some(spec.clone()),
            state: v1::RunState::Pending as i32,
            trace_id,
            trace_parent,
            created_at: Some(to_timestamp(now)),
            updated_at: Some(to_timestamp(now)),
            version: 1,
            delegations,
            truncated,
            // The creating replica holds the run's first lease.
            owner: self
                .deps
                .lease
                .as_ref()
                .map(|l| l.owner.clone())
                .unwrap_or_default(),
            lease_epoch: u64::from(self.deps.lease.is_some()),
            ..Default::default()
        };
        let mut ev = Events::default();
        let rejected = plan.err();
        if let Some(e) = &rejected {
            run.state = v1::RunState::Rejected as i32;
            run.terminal_reason = e.to_string();
            for d in &mut run.delegations {
                d.state = v1::DelegationState::Cancelled as i32;
                d.detail = "the plan was rejected".to_owned();
            }
        }
        ev.run.push(v1::RunEvent {
            sequence: 1,
            run_id: run.run_id.clone(),
            time: Some(to_timestamp(now)),
            kind: Some(Kind::Started(run.clone())),
        });
        ev.cloud.push(events::cloud(
            events::RUN_STARTED,
            &run,
            None,
            now,
            events::run_started_data(&run),
        ));
        if rejected.is_some() {
            ev.run.push(v1::RunEvent {
                sequence: 2,
                run_id: run.run_id.clone(),
                time: Some(to_timestamp(now)),
                kind: Some(Kind::Terminal(v1::RunTerminal {
                    state: run.state,
                    outcome: 0,
                    reason: run.terminal_reason.clone(),
                })),
            });
            ev.cloud.push(events::cloud(
                events::RUN_COMPLETED,
                &run,
                None,
                now,
                events::run_completed_data(&run),
            ));
        }
        (run, ev, rejected.is_none())
    }
}

/// A new run's id and its trace.
pub(super) struct RunIdentity {
    pub(super) run_id: String,
    pub(super) trace_id: String,
    pub(super) trace_parent: String,
}
