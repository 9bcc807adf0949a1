//! Withdrawing requests: who may cancel, from which states, and the compare-and-set
//! that writes the cancellation with its `cancelled` event.

use convene_core::Rule;
use convene_mesh::auth::Caller;
use convene_proto::v1;
use tonic::Status;

use super::{ApprovalService, MAX_ATTEMPTS, invalid, required};
use crate::{
    error::ApprovalError,
    events::Event,
    model::{ApprovalRequest, Cancellation, State},
    store::{StoreError, Viewer},
};

/// Longest cancellation reason accepted.
const MAX_REASON_LEN: usize = 1024;

impl ApprovalService {
    pub(super) async fn cancel_inner(
        &self,
        caller: &Caller,
        msg: v1::CancelApprovalRequest,
    ) -> Result<ApprovalRequest, Status> {
        let principal = caller.require_principal("cancel approval requests")?;
        required("approval_id", &msg.approval_id)?;
        if msg.reason.len() > MAX_REASON_LEN {
            return Err(invalid(
                "reason",
                Rule::TooLong,
                format!(
                    "is {} bytes; at most {MAX_REASON_LEN} are allowed",
                    msg.reason.len()
                ),
            ));
        }
        let viewer = Viewer {
            tenant: principal.tenant.clone(),
            principal: principal.id.clone(),
        };
        for _ in 0..MAX_ATTEMPTS {
            let stored = match self
                .store
                .get(&msg.approval_id)
                .await
                .map_err(ApprovalError::from)?
            {
                Some(stored) if viewer.can_see(&stored.request) => stored,
                _ => {
                    return Err(ApprovalError::NotFound {
                        approval_id: msg.approval_id,
                    }
                    .into());
                }
            };
            let request = &stored.request;
            if principal.id != request.filed_by && principal.id != request.requester {
                return Err(ApprovalError::NotPermitted(format!(
                    "only the principal that filed approval request {} ({}) or its requester \
                     ({}) may cancel it; {} is neither",
                    request.approval_id, request.filed_by, request.requester, principal.id
                ))
                .into());
            }
            let now = self.clock.now();
            let refuse = |state, hint| {
                Err(ApprovalError::NotCancellable {
                    approval_id: msg.approval_id.clone(),
                    state,
                    hint,
                }
                .into())
            };
            match request.state_at(now) {
                State::Cancelled => return Ok(stored.request),
                State::Executed => {
                    return refuse(
                        State::Executed,
                        "the action already ran; GetApproval shows its execution record",
                    );
                }
                State::Rejected => {
                    return refuse(State::Rejected, "it will never be executed");
                }
                State::Expired => {
                    self.persist_expiry(stored, now).await;
                    return refuse(State::Expired, "it will never be executed");
                }
                State::Pending | State::Approved if request.executing.is_some() => {
                    return Err(ApprovalError::ExecutionInProgress {
                        approval_id: msg.approval_id,
                    }
                    .into());
                }
                State::Pending | State::Approved => {}
            }
            let cancellation = Cancellation {
                cancelled_by: principal.id.clone(),
                reason: msg.reason.clone(),
                cancelled_at: now,
            };
            let mut cancelled = stored.request.clone();
            cancelled.state = State::Cancelled;
            cancelled.cancellation = Some(cancellation.clone());
            let event = Event::cancelled(&cancelled, &cancellation);
            match self
                .store
                .update(stored.version, cancelled, Some(event))
                .await
            {
                Ok(updated) => {
                    tracing::info!(
                        approval_id = %msg.approval_id,
                        cancelled_by = %principal.id,
                        reason = %msg.reason,
                        was = %stored.request.state,
                        "approval request cancelled"
                    );
                    return Ok(updated.request);
                }
                Err(StoreError::Conflict { .. }) => continue,
                Err(e) => return Err(ApprovalError::from(e).into()),
            }
        }
        Err(ApprovalError::Contended {
            approval_id: msg.approval_id,
        }
        .into())
    }
}
