//! Approval requests for the proposed actions of a decision's accepted results.

use std::sync::Arc;
use std::time::Duration;

use convene_core::permissions::RiskLevel;
use convene_mesh::auth::request;
use convene_proto::v1;
use tonic::Code;

use super::{RunActor, status_is_transient};
use crate::events;
use crate::store::Events;

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
        ev: &mut Events,
    ) -> Vec<String> {
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
                    expires_in: None,
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
                            ev.cloud.push(events::cloud(
                                events::APPROVAL_REQUESTED,
                                &self.run,
                                Some(&format!("approvals/{}", a.approval_id)),
                                self.deps.clock.now(),
                                serde_json::json!({
                                    "runId": self.run.run_id,
                                    "approvalId": a.approval_id,
                                    "action": a.action,
                                    "riskLevel": v1::RiskLevel::try_from(a.risk_level).map_or("RISK_LEVEL_UNSPECIFIED", |r| r.as_str_name()),
                                    "approvalsRequired": a.approvals_required,
                                    "delegationId": result.delegation_id,
                                }),
                            ));
                            ids.push(a.approval_id);
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
}
