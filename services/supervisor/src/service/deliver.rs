//! Results delivered out of band, and results for runs that have ended, sealed.

use convene_core::time::to_timestamp;
use convene_proto::v1::{self, run_event::Kind};
use tonic::Status;

use super::SupervisorService;
use crate::error::Error;
use crate::run::{self, Msg};
use crate::store::{Events, is_terminal};

impl SupervisorService {
    /// Delivers a result that arrived out of band — a broker's redelivery, a replay — to
    /// its run. It goes through exactly the checks of a dispatched result: a duplicate
    /// of an identical result counts once, a differing one rejects the delegation, an
    /// unknown delegation id is rejected, and a finished run is never reopened. A result
    /// for a run that has ended is sealed: recorded on the run (in `received`, listed in
    /// the decision's `late_discarded`, with a late `completed` event), never applied.
    pub async fn deliver_result(&self, run_id: &str, result: v1::TaskResult) -> Result<(), Status> {
        if let Ok(mailbox) = self.mailbox(run_id)
            && mailbox
                .send(Msg::Deliver {
                    result: Box::new(result.clone()),
                })
                .is_ok()
        {
            return Ok(());
        }
        let run = self.stored_run(run_id).await?;
        if !is_terminal(run.state) {
            return Err(Error::FailedPrecondition(format!(
                "run {run_id} is not running in this supervisor; deliver the result to the replica that owns it"
            ))
            .into());
        }
        self.seal(run, result).await.map_err(Into::into)
    }

    /// Records `result` on the ended `run` without applying it (see
    /// [`Self::deliver_result`]); a result the run holds already changes nothing.
    async fn seal(&self, mut run: v1::Run, result: v1::TaskResult) -> Result<(), Error> {
        if run.received.contains(&result) {
            return Ok(());
        }
        let t = self.deps.clock.now();
        let delegation = run.delegations.iter().find(|d| {
            d.task
                .as_ref()
                .is_some_and(|t| t.delegation_id == result.delegation_id)
        });
        let completed = v1::DelegationCompleted {
            delegation_id: result.delegation_id.clone(),
            name: delegation
                .and_then(|d| d.task.as_ref())
                .map(|t| t.name.clone())
                .unwrap_or_default(),
            state: delegation.map_or(v1::DelegationState::Unspecified as i32, |d| d.state),
            status: result.status,
            summary: result.summary.clone(),
            late: true,
        };
        if let Some(decision) = run.decision.as_mut()
            && !decision.late_discarded.contains(&result.delegation_id)
        {
            decision.late_discarded.push(result.delegation_id.clone());
        }
        run.received.push(result);
        let next = run::next_sequence(&self.deps, &run.run_id).await?;
        run.version += 1;
        run.updated_at = Some(to_timestamp(t));
        let events = Events {
            run: vec![v1::RunEvent {
                sequence: next,
                run_id: run.run_id.clone(),
                time: Some(to_timestamp(t)),
                kind: Some(Kind::Completed(completed)),
            }],
            cloud: Vec::new(),
            commands: Vec::new(),
            release: false,
        };
        tracing::info!(run_id = %run.run_id, "a result for an ended run was sealed: recorded, not applied");
        self.deps.store.commit(&run, &events).await?;
        Ok(())
    }
}
