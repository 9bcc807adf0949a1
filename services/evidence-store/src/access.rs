//! Who may call the evidence store: the holder of a task token, verified offline against
//! the policy service's public keys, whose audience names the store and whose scopes
//! allow the call.
//!
//! Principals' credentials are refused: evidence is always written and read on behalf
//! of one delegation, whose token says which tenant it belongs to. Revocation is not
//! checked here (that would cost a policy round trip per call); tokens are short-lived,
//! and Authorize refuses a revoked token's tool calls, so it gathers nothing new.
//!
//! The token's data constraints (time window, rows) bound the data its tools read, not
//! the evidence store: a scope covering the action on the `evidence` resource is enough,
//! whatever window the task's scope put on it.

use std::time::SystemTime;

use convene_core::permissions::{DataConstraints, Denial};
use convene_mesh::auth::{AUTHORIZATION, TokenKeys, bearer, looks_like_token};
use convene_mesh::handles::PolicyHandle;
use convene_tokens::Claims;
use tonic::{Code, Request};

use crate::Error;

/// The audience entry a token needs to be presented here.
pub const AUDIENCE: &str = "convene-evidence-store";

/// The resource evidence scopes name.
pub const EVIDENCE_RESOURCE: &str = "evidence";

/// The action of PutArtifact and RecordEvidence.
pub const WRITE: &str = "evidence:write";

/// The action of GetArtifact, GetEvidence and VerifyChain.
pub const READ: &str = "evidence:read";

/// Checks the task token of each call.
#[derive(Debug)]
pub(crate) struct Access {
    keys: TokenKeys,
}

impl Access {
    /// Verifies with the keys the policy service behind `policy` publishes.
    pub(crate) fn new(policy: PolicyHandle) -> Self {
        Self {
            keys: TokenKeys::new(policy),
        }
    }

    /// The verified claims of the request's task token, if it may perform `action` (for
    /// `method`, named in refusals).
    pub(crate) async fn check<T>(
        &self,
        request: &Request<T>,
        action: &str,
        method: &str,
    ) -> Result<Claims, Error> {
        if request.metadata().get(AUTHORIZATION).is_none() {
            return Err(Error::Unauthenticated(format!(
                "{method} needs the delegation's task token as `authorization: Bearer \
                 <task token>` metadata"
            )));
        }
        let credential = bearer(request).map_err(|s| Error::Unauthenticated(s.message().into()))?;
        if !looks_like_token(credential) {
            return Err(Error::Unauthenticated(format!(
                "{method} accepts task tokens only, and a principal credential (or something \
                 else that is not a token) was presented; call it with the task token the \
                 supervisor issued for the delegation"
            )));
        }
        let claims = self
            .keys
            .verify(credential, SystemTime::now())
            .await
            .map_err(|s| match s.code() {
                Code::Unauthenticated => Error::Unauthenticated(s.message().into()),
                _ => Error::PolicyUnavailable(s.message().into()),
            })?;
        claims
            .check_audience(AUDIENCE)
            .map_err(|e| Error::PermissionDenied(e.to_string()))?;
        let scopes = claims
            .permissions()
            .map_err(|e| Error::Unauthenticated(e.to_string()))?;
        match scopes.check(action, EVIDENCE_RESOURCE, &DataConstraints::unconstrained()) {
            Ok(()) | Err(Denial::DataScopeExceeded) => Ok(claims),
            Err(Denial::ScopeNotGranted) => Err(Error::PermissionDenied(format!(
                "{method} needs scope `{action}` on `{EVIDENCE_RESOURCE}`, which the task token \
                 (delegation {}) lacks; ask for a token whose required_scopes include \
                 {{action: \"{action}\", resource: \"{EVIDENCE_RESOURCE}\"}}",
                claims.delegation_id
            ))),
        }
    }
}
