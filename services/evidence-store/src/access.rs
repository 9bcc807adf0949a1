//! Who may call the evidence store. There are two kinds of callers:
//!
//! - **Workers**, holding the task token of one delegation, verified offline against the
//!   policy service's public keys. The token's audience must name the store and its
//!   scopes must allow the call: `evidence:write` on `evidence` for PutArtifact and
//!   RecordEvidence, `evidence:read` on `evidence` for GetArtifact, GetEvidence and
//!   VerifyChain. Writes accept task tokens only: evidence is always written on behalf
//!   of one delegation, and the token says which tenant and delegation it belongs to.
//! - **People auditing a run** (`convene evidence verify <run>`), presenting their own
//!   principal credential from the policy file. They may only read, and only when the
//!   principal holds role `evidence:read`; a principal trying to write is refused.
//!
//! Either way the tenant comes from the credential (the token's claims, the principal's
//! entry in the policy file), never from a request message, so a caller reaches only its
//! own tenant's evidence. Reads yield a [`Reader`] (tenant and who, for logs); writes the
//! token's [`Claims`], whose delegation the stored records name.
//!
//! Revocation is checked without a round trip per call: the revocations arrive with the
//! policy service's keys (`TokenKeys`, fetched again every `key_refresh`), so a revoked
//! token or run is refused here within one interval, and by Authorize at once.
//!
//! The token's data constraints (time window, rows) bound the data its tools read, not
//! the evidence store: a scope covering the action on the `evidence` resource is enough,
//! whatever window the task's scope put on it.

use std::fmt;
use std::sync::Arc;

use convene_core::permissions::{DataConstraints, Denial};
use convene_mesh::auth::{
    AUTHORIZATION, Authenticator, Caller, TokenKeys, bearer, looks_like_token,
};
use convene_mesh::handles::PolicyHandle;
use convene_mesh::policy_file::{Policy, Principal};
use convene_tokens::Claims;
use tonic::{Code, Request, Status};

use crate::Error;

/// The audience entry a token needs to be presented here.
pub const AUDIENCE: &str = "convene-evidence-store";

/// The resource evidence scopes name.
pub const EVIDENCE_RESOURCE: &str = "evidence";

/// The action of PutArtifact and RecordEvidence.
pub const WRITE: &str = "evidence:write";

/// The action of GetArtifact, GetEvidence and VerifyChain.
pub const READ: &str = "evidence:read";

/// The role a principal of the policy file needs to read its tenant's evidence with its
/// own credential (GetArtifact, GetEvidence, VerifyChain).
pub const READER_ROLE: &str = "evidence:read";

/// On whose behalf a read is made, as logs name it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Who {
    /// A worker, with the task token of this delegation.
    Delegation(String),
    /// A principal of the policy file, with its own credential.
    Principal(String),
}

impl fmt::Display for Who {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Who::Delegation(id) => write!(f, "delegation {id}"),
            Who::Principal(id) => write!(f, "principal {id}"),
        }
    }
}

/// A caller allowed to read: the tenant whose evidence it reaches, and who it is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Reader {
    /// The tenant, from the credential.
    pub(crate) tenant: String,
    /// Who is reading.
    pub(crate) who: Who,
}

impl Reader {
    /// The reader a task token's holder is.
    pub(crate) fn of_task(claims: &Claims) -> Self {
        Self {
            tenant: claims.tenant.clone(),
            who: Who::Delegation(claims.delegation_id.clone()),
        }
    }
}

/// Checks the credential of each call.
#[derive(Debug)]
pub(crate) struct Access {
    auth: Authenticator,
}

impl Access {
    /// Verifies task tokens with the keys and revocations the policy service behind
    /// `policy` publishes (fetched again every `key_refresh`), and principal credentials
    /// against `principals` (the compiled policy file).
    pub(crate) fn new(
        policy: PolicyHandle,
        principals: Arc<Policy>,
        key_refresh: std::time::Duration,
    ) -> Self {
        Self {
            auth: Authenticator::new(
                principals,
                Arc::new(TokenKeys::refreshed_every(policy, key_refresh)),
            ),
        }
    }

    /// The verified claims of the request's task token, if it may write evidence (for
    /// `method`, named in refusals). Principal credentials are refused.
    pub(crate) async fn writer<T>(
        &self,
        request: &Request<T>,
        method: &str,
    ) -> Result<Claims, Error> {
        if request.metadata().get(AUTHORIZATION).is_none() {
            return Err(Error::Unauthenticated(format!(
                "{method} needs the delegation's task token as `authorization: Bearer \
                 <task token>` metadata"
            )));
        }
        match self.auth.authenticate(request).await {
            Ok(Caller::Task(claims)) => {
                check_scope(&claims, WRITE, method)?;
                Ok(Arc::unwrap_or_clone(claims))
            }
            Ok(Caller::Principal(principal)) => Err(principal_may_not_write(&principal, method)),
            Err(status) if status.code() == Code::Unauthenticated && not_a_token(request) => {
                Err(Error::Unauthenticated(format!(
                    "{method} accepts task tokens only, and a principal credential (or \
                     something else that is not a token) was presented; call it with the \
                     task token the supervisor issued for the delegation"
                )))
            }
            Err(status) => Err(refused(&status)),
        }
    }

    /// Who is reading, if the request's credential may read evidence (for `method`, named
    /// in refusals): a task token with scope `evidence:read`, or the credential of a
    /// principal holding role [`READER_ROLE`].
    pub(crate) async fn reader<T>(
        &self,
        request: &Request<T>,
        method: &str,
    ) -> Result<Reader, Error> {
        if request.metadata().get(AUTHORIZATION).is_none() {
            return Err(Error::Unauthenticated(format!(
                "{method} needs the delegation's task token, or the credential of a principal \
                 holding role `{READER_ROLE}`, as `authorization: Bearer <credential>` metadata"
            )));
        }
        match self.auth.authenticate(request).await {
            Ok(Caller::Task(claims)) => {
                check_scope(&claims, READ, method)?;
                Ok(Reader::of_task(&claims))
            }
            Ok(Caller::Principal(principal)) if principal.has_role(READER_ROLE) => Ok(Reader {
                tenant: principal.tenant.clone(),
                who: Who::Principal(principal.id.clone()),
            }),
            Ok(Caller::Principal(principal)) => Err(Error::PermissionDenied(format!(
                "principal {} lacks role `{READER_ROLE}` needed to call {method}; add it to the \
                 principal's roles in the policy file",
                principal.id
            ))),
            Err(status) if status.code() == Code::Unauthenticated && not_a_token(request) => {
                Err(Error::Unauthenticated(format!(
                    "{method}: the credential presented is neither a task token nor the \
                     credential of a principal in the policy file (which lists each \
                     credential's sha256); present the delegation's task token or your own \
                     principal credential"
                )))
            }
            Err(status) => Err(refused(&status)),
        }
    }
}

/// Whether the request carries a well-formed bearer credential that is not shaped like a
/// task token, so a failure to authenticate it means no principal has it (rather than a
/// token that does not verify, or malformed metadata, whose own reasons are kept).
fn not_a_token<T>(request: &Request<T>) -> bool {
    bearer(request).is_ok_and(|credential| !looks_like_token(credential))
}

/// A failed authentication as the store reports it: the caller's fault stays
/// UNAUTHENTICATED with the verifier's reason; failing to fetch the keys is the policy
/// service being unavailable.
fn refused(status: &Status) -> Error {
    match status.code() {
        Code::Unauthenticated => Error::Unauthenticated(status.message().into()),
        _ => Error::PolicyUnavailable(status.message().into()),
    }
}

/// The refusal of a write made with a principal's own credential.
fn principal_may_not_write(principal: &Principal, method: &str) -> Error {
    Error::PermissionDenied(format!(
        "{method} accepts task tokens only: evidence is written on behalf of one delegation, \
         and principal {} presented its own credential; call it with the task token the \
         supervisor issued for the delegation (principals may only read evidence, with role \
         `{READER_ROLE}`)",
        principal.id
    ))
}

/// Checks that a verified token may be presented here and allows `action` on the
/// evidence resource (for `method`, named in refusals).
fn check_scope(claims: &Claims, action: &str, method: &str) -> Result<(), Error> {
    claims
        .check_audience(AUDIENCE)
        .map_err(|e| Error::PermissionDenied(e.to_string()))?;
    let scopes = claims
        .permissions()
        .map_err(|e| Error::Unauthenticated(e.to_string()))?;
    match scopes.check(action, EVIDENCE_RESOURCE, &DataConstraints::unconstrained()) {
        Ok(()) | Err(Denial::DataScopeExceeded) => Ok(()),
        Err(Denial::ScopeNotGranted) => Err(Error::PermissionDenied(format!(
            "{method} needs scope `{action}` on `{EVIDENCE_RESOURCE}`, which the task token \
             (delegation {}) lacks; ask for a token whose required_scopes include \
             {{action: \"{action}\", resource: \"{EVIDENCE_RESOURCE}\"}}",
            claims.delegation_id
        ))),
    }
}
