//! The checks every proposed delegation passes before anything of it runs, whoever
//! proposes it: a planner's `delegate` call or a worker's nested `Delegate` call. One
//! path, so both see the same rules and the same messages.
//!
//! Per proposal ([`RunActor::check_proposal`]): the Delegation Contract's fields, a
//! profile the policy knows, and no loop (a chain back to a profile on its path with the
//! same goal). Per batch ([`RunActor::check_batch`]): depth, the run's budgets, and the
//! width limit with its overflow mode. The principal's right to the profile and the
//! scope's intersection with what the run may hold are the policy service's, checked
//! when the task token is issued.

use convene_core::limits::{self, BatchPlan};
use convene_core::model::PlannedTask;
use convene_core::validate;
use convene_proto::v1;

use super::RunActor;
use crate::error::Error;
use crate::plan;

impl RunActor {
    /// Checks one proposed delegation (`field` names it in errors) whose delegating
    /// chain, from the top, is `path` (profile, goal).
    pub(super) fn check_proposal(
        &self,
        field: &str,
        wire: &v1::PlannedDelegation,
        path: &[(&str, &str)],
    ) -> Result<PlannedTask, Error> {
        let p = validate::planned_task(wire, field)?;
        if !self.deps.policy_file.profiles.contains_key(&p.profile_id) {
            return Err(plan::unknown_profile(
                &self.deps.policy_file,
                format!("{field}.profile_id"),
                &p.profile_id,
            ));
        }
        limits::check_loop(path, &p.profile_id, &p.goal)
            .map_err(|e| Error::FailedPrecondition(format!("{field}: {e}")))?;
        Ok(p)
    }

    /// Checks a batch of `count` proposals at `depth` against the run's limits and
    /// plans its width.
    pub(super) fn check_batch(&self, depth: u32, count: usize) -> Result<BatchPlan, Error> {
        limits::check_depth(depth, self.spec.limits.max_depth)
            .map_err(|e| Error::FailedPrecondition(e.to_string()))?;
        if count == 0 {
            return Err(Error::invalid(
                "delegations",
                "give at least one child task",
            ));
        }
        self.ledger
            .check()
            .map_err(|e| Error::ResourceExhausted(e.to_string()))?;
        limits::plan_batch(
            count,
            self.spec.limits.max_parallel_workers,
            self.spec.limits.overflow,
        )
        .map_err(|e| Error::ResourceExhausted(e.to_string()))
    }
}
