//! Voting on approval requests: who may vote, and the vote itself under
//! compare-and-set, written with its `decided` event.

use convene_core::Rule;
use convene_mesh::{auth::Caller, policy_file::PrincipalKind};
use convene_proto::v1;
use tonic::Status;

use super::{ApprovalService, MAX_ATTEMPTS, ROLE_DECIDE, invalid, required, required_hash};
use crate::{
    error::ApprovalError,
    events::Event,
    model::{ApprovalRequest, Decision, Vote, VoteEffect},
    store::StoreError,
};

impl ApprovalService {
    pub(super) async fn decide_inner(
        &self,
        caller: &Caller,
        msg: v1::DecideRequest,
    ) -> Result<ApprovalRequest, Status> {
        let approver = caller.require_role(ROLE_DECIDE, "decide approval requests")?;
        if approver.kind != PrincipalKind::Human {
            return Err(ApprovalError::NotPermitted(format!(
                "approvers must be people; {} is a service principal",
                approver.id
            ))
            .into());
        }
        required("approval_id", &msg.approval_id)?;
        let decision = match Decision::from_proto(msg.decision) {
            Some(d) => d,
            None if msg.decision == 0 => {
                return Err(invalid(
                    "decision",
                    Rule::Required,
                    "set VOTE_DECISION_APPROVE or VOTE_DECISION_REJECT",
                ));
            }
            None => {
                return Err(invalid(
                    "decision",
                    Rule::UnknownEnum,
                    format!(
                        "unknown decision {}; use VOTE_DECISION_APPROVE or VOTE_DECISION_REJECT",
                        msg.decision
                    ),
                ));
            }
        };
        required_hash(&msg.parameters_hash)?;

        for _ in 0..MAX_ATTEMPTS {
            let stored = self
                .load_in_tenant(&msg.approval_id, &approver.tenant)
                .await?;
            if stored.request.requester == approver.id {
                return Err(ApprovalError::NotPermitted(format!(
                    "the requester cannot approve their own request (nor vote on it): {} \
                     requested {}; another approver must decide",
                    approver.id, msg.approval_id
                ))
                .into());
            }
            let now = self.clock.now();
            let vote = Vote {
                approver: approver.id.clone(),
                decision,
                parameters_hash: msg.parameters_hash.clone(),
                comment: msg.comment.clone(),
                decided_at: now,
            };
            let mut request = stored.request.clone();
            match request.cast_vote(vote.clone(), now) {
                Ok(VoteEffect::Repeated) => return Ok(stored.request),
                Ok(VoteEffect::Recorded(state)) => {
                    let event = Event::decided(&request, &vote);
                    match self
                        .store
                        .update(stored.version, request, Some(event))
                        .await
                    {
                        Ok(updated) => {
                            tracing::info!(
                                approval_id = %msg.approval_id,
                                approver = %approver.id,
                                decision = decision.as_str(),
                                state = %state,
                                approvals_missing = updated.request.approvals_missing(),
                                "approval vote recorded"
                            );
                            return Ok(updated.request);
                        }
                        Err(StoreError::Conflict { .. }) => continue,
                        Err(e) => return Err(ApprovalError::from(e).into()),
                    }
                }
                Err(e @ ApprovalError::Expired { .. }) => {
                    self.persist_expiry(stored, now).await;
                    return Err(e.into());
                }
                Err(e) => return Err(e.into()),
            }
        }
        Err(ApprovalError::Contended {
            approval_id: msg.approval_id,
        }
        .into())
    }
}
