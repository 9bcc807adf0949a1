//! Approval requests for the proposed actions of a decision's accepted results, and the
//! run's record of where each stands (`Run.actions`). The approval service owns the
//! requests and their events; the run reads them again when one of its requests changed
//! and withdraws the pending ones when it is cancelled or closed.

use std::sync::Arc;
use std::time::Duration;

use convene_core::permissions::RiskLevel;
use convene_mesh::auth::request;
use convene_proto::v1;
use tonic::Code;

use convene_core::time::to_timestamp;

use super::{RunActor, status_is_transient};

/// Attempts at filing one approval request, and the first pause between them (doubling):
/// about three seconds in all.
const APPROVAL_ATTEMPTS: u32 = 5;
const APPROVAL_RETRY_BACKOFF: Duration = Duration::from_millis(200);

impl RunActor {
    /// Files one approval request per distinct proposed action above R1 (action and
    /// parameters) of the accepted results.
    /// The level is the higher of the worker's and the catalog's: a worker can never
    /// talk an action down.
    pub(super) async fn file_approvals(
        &mut self,
        decision: &v1::JoinDecision,
    ) -> Vec<v1::RunAction> {
        let mut ids = Vec::new();
        let accepted: Vec<v1::TaskResult> = self
            .run
            .received
            .iter()
            .filter(|r| decision.accepted.contains(&r.delegation_id))
            .cloned()
            .collect();
        let mut seen = std::collections::BTreeSet::new();
        // The same action with the same parameters, proposed by several accepted results
        // (a planner's follow-up to the same specialist), is one request.
        let mut proposed = std::collections::BTreeSet::new();
        for result in accepted {
            if !seen.insert(result.delegation_id.clone()) {
                continue;
            }
            for (i, action) in result.proposed_actions.iter().enumerate() {
                let asked = RiskLevel::from_proto(action.risk_level);
                let risk = match self.deps.policy_file.risk_of(&action.action) {
                    Some(catalog) => asked.max(catalog),
                    None => asked,
                };
                if risk < RiskLevel::R2
                    || !proposed.insert((action.action.clone(), format!("{:?}", action.parameters)))
                {
                    continue;
                }
                let req = v1::RequestApprovalRequest {
                    action: action.action.clone(),
                    parameters: action.parameters.clone(),
                    risk_level: risk.to_proto() as i32,
                    idempotency_key: format!("{}/{}/{i}", self.run.run_id, result.delegation_id),
                    evidence_refs: action.evidence_refs.clone(),
                    expires_in: Some(convene_core::time::to_duration(
                        self.deps.settings.approval_ttl,
                    )),
                    run_id: self.run.run_id.clone(),
                    rationale: action.rationale.clone(),
                    on_behalf_of: self.run.principal.clone(),
                };
                // The request is idempotent (its key names the run, delegation and
                // action), so a transient failure — the approval service restarting, its
                // database busy — is retried rather than losing the request.
                let mut backoff = APPROVAL_RETRY_BACKOFF;
                let mut attempt = 1;
                let filed = loop {
                    let outcome = self
                        .deps
                        .approval
                        .request_approval(request(req.clone(), &self.deps.credential))
                        .await;
                    match outcome {
                        Err(s)
                            if attempt < APPROVAL_ATTEMPTS
                                && (status_is_transient(s.code())
                                    || s.code() == Code::DeadlineExceeded) =>
                        {
                            tracing::warn!(run_id = %self.run.run_id, action = %action.action, attempt, error = %s.message(), "approval request failed; retrying");
                            tokio::time::sleep(backoff).await;
                            backoff *= 2;
                            attempt += 1;
                        }
                        other => break other,
                    }
                };
                match filed {
                    Ok(r) => {
                        if let Some(a) = r.into_inner().approval {
                            ids.push(action_of(&a, self.deps.clock.now()));
                        }
                    }
                    Err(s) => {
                        tracing::error!(run_id = %self.run.run_id, action = %action.action, error = %s.message(), "approval request could not be filed");
                        Arc::make_mut(&mut self.run).terminal_reason = format!(
                            "approval request for {} could not be filed: {}",
                            action.action,
                            s.message()
                        );
                    }
                }
            }
        }
        ids
    }

    /// Reads the run's unsettled actions again from the approval service; whether any
    /// changed. An action that cannot be read stays as it was (it is read again at the
    /// next change of one of the run's requests).
    pub(super) async fn refresh_actions(&mut self) -> bool {
        let mut changed = false;
        for i in 0..self.run.actions.len() {
            if action_settled(self.run.actions[i].state) {
                continue;
            }
            let id = self.run.actions[i].approval_id.clone();
            let read = self
                .deps
                .approval
                .get_approval(request(
                    v1::GetApprovalRequest {
                        approval_id: id.clone(),
                    },
                    &self.deps.credential,
                ))
                .await;
            match read {
                Ok(r) => {
                    if let Some(a) = r.into_inner().approval {
                        let now = action_of(&a, self.deps.clock.now());
                        if now.state != self.run.actions[i].state
                            || now.decided_by != self.run.actions[i].decided_by
                        {
                            Arc::make_mut(&mut self.run).actions[i] = now;
                            changed = true;
                        }
                    }
                }
                Err(s) => {
                    tracing::warn!(run_id = %self.run.run_id, approval_id = %id, error = %s.message(), "the approval request could not be read; its state is read again at its next change");
                }
            }
        }
        changed
    }

    /// Withdraws the run's pending and approved (not executed) requests, because the run
    /// is cancelled or closed; records where each ends. Transient failures are retried.
    pub(super) async fn cancel_actions(&mut self, reason: &str) {
        for i in 0..self.run.actions.len() {
            if action_settled(self.run.actions[i].state) {
                continue;
            }
            let id = self.run.actions[i].approval_id.clone();
            let req = v1::CancelApprovalRequest {
                approval_id: id.clone(),
                reason: reason.to_owned(),
            };
            let mut backoff = APPROVAL_RETRY_BACKOFF;
            let mut attempt = 1;
            let outcome = loop {
                match self
                    .deps
                    .approval
                    .cancel_approval(request(req.clone(), &self.deps.credential))
                    .await
                {
                    Err(s) if attempt < APPROVAL_ATTEMPTS && status_is_transient(s.code()) => {
                        tokio::time::sleep(backoff).await;
                        backoff *= 2;
                        attempt += 1;
                    }
                    other => break other,
                }
            };
            match outcome {
                Ok(r) => {
                    if let Some(a) = r.into_inner().approval {
                        Arc::make_mut(&mut self.run).actions[i] =
                            action_of(&a, self.deps.clock.now());
                    }
                }
                Err(s) if s.code() == Code::FailedPrecondition => {
                    // Settled meanwhile (executed, rejected, expired): record how.
                    self.refresh_actions().await;
                }
                Err(s) => {
                    tracing::error!(run_id = %self.run.run_id, approval_id = %id, error = %s.message(), "the approval request could not be withdrawn");
                    let run = Arc::make_mut(&mut self.run);
                    run.terminal_reason = format!(
                        "{}; approval request {id} could not be withdrawn: {}",
                        run.terminal_reason,
                        s.message()
                    );
                }
            }
        }
    }

    /// Whether an action of the run still waits for people.
    pub(super) fn actions_pending(&self) -> bool {
        self.run.actions.iter().any(|a| !action_settled(a.state))
    }
}

/// Whether an action's state is final.
pub(super) fn action_settled(state: i32) -> bool {
    !matches!(
        v1::ActionState::try_from(state),
        Ok(v1::ActionState::Pending | v1::ActionState::Approved | v1::ActionState::Unspecified)
            | Err(_)
    )
}

/// The run's record of an approval request.
fn action_of(a: &v1::ApprovalRequest, now: std::time::SystemTime) -> v1::RunAction {
    let state = match v1::ApprovalState::try_from(a.state) {
        Ok(v1::ApprovalState::Approved) => v1::ActionState::Approved,
        Ok(v1::ApprovalState::Rejected) => v1::ActionState::Rejected,
        Ok(v1::ApprovalState::Expired) => v1::ActionState::Expired,
        Ok(v1::ApprovalState::Executed) => v1::ActionState::Executed,
        Ok(v1::ApprovalState::Cancelled) => v1::ActionState::Cancelled,
        _ => v1::ActionState::Pending,
    };
    let wanted = if state == v1::ActionState::Rejected {
        v1::VoteDecision::Reject
    } else {
        v1::VoteDecision::Approve
    };
    let mut decided_by: Vec<String> = a
        .votes
        .iter()
        .filter(|v| v.decision == wanted as i32)
        .map(|v| v.approver.clone())
        .collect();
    if let Some(c) = &a.cancellation {
        decided_by.push(c.cancelled_by.clone());
    }
    v1::RunAction {
        approval_id: a.approval_id.clone(),
        action: a.action.clone(),
        parameters: a.parameters.clone(),
        parameters_hash: a.parameters_hash.clone(),
        risk_level: a.risk_level,
        state: state as i32,
        decided_by,
        execution: a.execution.clone(),
        updated_at: Some(to_timestamp(now)),
    }
}
