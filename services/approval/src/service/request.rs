//! Filing approval requests: who may file for whom, the checks on the request, the
//! risk it is held at, and idempotent creation.

use std::time::Duration;

use convene_core::{Rule, permissions::RiskLevel, time::from_duration};
use convene_mesh::{auth::Caller, policy_file::PrincipalKind};
use convene_proto::v1;
use tonic::Status;

use super::{ApprovalService, ROLE_REQUEST, bounded, invalid, required};
use crate::{
    canonical,
    error::ApprovalError,
    events::Event,
    model::{ApprovalRequest, State},
    store::Created,
};

impl ApprovalService {
    pub(super) async fn request_approval_inner(
        &self,
        caller: &Caller,
        msg: v1::RequestApprovalRequest,
    ) -> Result<(ApprovalRequest, bool), Status> {
        let filer = caller.require_role(ROLE_REQUEST, "request approvals")?;
        let requester = if msg.on_behalf_of.is_empty() || msg.on_behalf_of == filer.id {
            filer.as_ref()
        } else {
            if filer.kind != PrincipalKind::Service {
                return Err(ApprovalError::NotPermitted(format!(
                    "only service principals may set on_behalf_of; {} is a person: leave \
                     on_behalf_of empty to request approval for yourself",
                    filer.id
                ))
                .into());
            }
            self.policy
                .principals
                .get(&msg.on_behalf_of)
                .ok_or_else(|| {
                    invalid(
                        "on_behalf_of",
                        Rule::UnknownReference,
                        format!(
                            "no principal {:?} in the policy file; name the run's principal",
                            msg.on_behalf_of
                        ),
                    )
                })?
        };

        required("action", &msg.action)?;
        bounded("action", &msg.action)?;
        required("idempotency_key", &msg.idempotency_key)?;
        bounded("idempotency_key", &msg.idempotency_key)?;
        if let Some(i) = msg.evidence_refs.iter().position(|r| r.trim().is_empty()) {
            return Err(invalid(
                &format!("evidence_refs[{i}]"),
                Rule::Required,
                "evidence ids must not be empty",
            ));
        }
        let risk = self.effective_risk(&msg.action, msg.risk_level)?;
        let parameters = msg.parameters.unwrap_or_default();
        let parameters_hash =
            canonical::parameters_hash(&parameters).map_err(ApprovalError::from)?;

        let now = self.clock.now();
        let ttl = match &msg.expires_in {
            Some(d) => from_duration(d, "expires_in").map_err(ApprovalError::from)?,
            None => Duration::ZERO,
        };
        let ttl = if ttl.is_zero() { self.default_ttl } else { ttl };
        let expires_at = now.checked_add(ttl).ok_or_else(|| {
            invalid(
                "expires_in",
                Rule::Range,
                "is too long; ask for hours or days",
            )
        })?;

        let request = ApprovalRequest {
            approval_id: format!("apr-{}", uuid::Uuid::now_v7()),
            tenant: requester.tenant.clone(),
            action: msg.action,
            parameters,
            parameters_hash,
            risk,
            idempotency_key: msg.idempotency_key,
            requester: requester.id.clone(),
            filed_by: filer.id.clone(),
            evidence_refs: msg.evidence_refs,
            expires_at,
            state: State::Pending,
            votes: Vec::new(),
            execution: None,
            executing: None,
            cancellation: None,
            run_id: msg.run_id,
            rationale: msg.rationale,
            created_at: now,
        };
        let event = Event::requested(&request);
        match self
            .store
            .create(request.clone(), event)
            .await
            .map_err(ApprovalError::from)?
        {
            Created::New(stored) => {
                let r = &stored.request;
                tracing::info!(
                    approval_id = %r.approval_id,
                    tenant = %r.tenant,
                    action = %r.action,
                    risk = %r.risk,
                    requester = %r.requester,
                    filed_by = %r.filed_by,
                    run_id = %r.run_id,
                    parameters_hash = %r.parameters_hash,
                    "approval requested"
                );
                Ok((stored.request, true))
            }
            Created::Existing(stored) => {
                let existing = stored.request;
                if existing.action == request.action
                    && existing.parameters_hash == request.parameters_hash
                {
                    Ok((existing, false))
                } else {
                    Err(ApprovalError::KeyReused {
                        key: request.idempotency_key,
                        existing: existing.approval_id,
                    }
                    .into())
                }
            }
        }
    }

    /// The risk an action is held at: what was asked, raised to the catalog's level when
    /// the catalog knows the action. Unset asks count as R3 (fail closed).
    fn effective_risk(&self, action: &str, asked: i32) -> Result<RiskLevel, Status> {
        if asked != 0 && v1::RiskLevel::try_from(asked).is_err() {
            return Err(invalid(
                "risk_level",
                Rule::UnknownEnum,
                format!("unknown risk level {asked}; use RISK_LEVEL_R2 or RISK_LEVEL_R3"),
            ));
        }
        let asked = RiskLevel::from_proto(asked);
        let risk = match self.policy.risk_of(action) {
            Some(catalog) if catalog > asked => {
                tracing::info!(
                    action,
                    asked = %asked,
                    catalog = %catalog,
                    "risk level raised to the action catalog's"
                );
                catalog
            }
            Some(_) => asked,
            None => {
                tracing::warn!(
                    action,
                    risk = %asked,
                    "action is not in the policy's action catalog; keeping the requested risk level"
                );
                asked
            }
        };
        if risk < RiskLevel::R2 {
            return Err(ApprovalError::NoApprovalNeeded {
                action: action.to_owned(),
                risk,
            }
            .into());
        }
        Ok(risk)
    }
}
