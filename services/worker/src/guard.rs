//! What a worker checks before it acts.
//!
//! A worker spends its model's money and its tools' access on whoever calls it, so
//! nothing leaves it before two checks pass:
//!
//! - **The caller is the supervisor** (`Worker.{Execute, PlanTurn, Cancel}`): under
//!   mutual TLS its client certificate names `supervisor`; otherwise it presents the
//!   credential of a service principal holding `tokens:issue`, which the policy service
//!   vouches for (`WhoAmI`, remembered for a minute).
//! - **The task token is genuine, current, unrevoked and this task's**: its signature
//!   holds against the policy service's keys (refreshed every `key_refresh`, and on an
//!   unknown key id), it has not expired, neither it nor its run is revoked, and it
//!   names this run, delegation and profile. The same check runs again before every
//!   model turn and remote call of a long loop ([`Guard::recheck`], on the claims the
//!   first check accepted: the key still listed, the times, the revocations), so a
//!   token that expires or is revoked mid-task, or whose key is retired, stops the loop
//!   at its next turn. A token verified once is also remembered by the process
//!   ([`convene_tokens::Verifier::verify`]), so other services in it repeat only the
//!   time and revocation checks.
//!
//! A refusal is UNAUTHENTICATED (the token is not genuine, current and unrevoked) or
//! PERMISSION_DENIED (it is another task's), naming the failed claim, and it is logged.

use std::sync::Arc;
use std::time::Duration;

use convene_core::time::Clock;
use convene_mesh::auth::{MeshService, ServiceCallers, TokenKeys};
use convene_mesh::handles::PolicyHandle;
use tonic::{Request, Status};

/// The checks of one worker, shared by its agents.
#[derive(Debug, Clone)]
pub struct Guard {
    callers: ServiceCallers,
    keys: Arc<TokenKeys>,
    clock: Clock,
}

/// A task token that passed [`Guard::task_token`]: its claims, the id of the key whose
/// signature held, and its revocation keys.
pub type Verified = convene_tokens::Accepted;

/// What a token must be bound to.
#[derive(Debug, Clone, Copy)]
pub struct Binding<'a> {
    /// The run.
    pub run_id: &'a str,
    /// The delegation; `None` for a planner's token, which is bound to the run alone.
    pub delegation_id: Option<&'a str>,
    /// The profile that holds it (the one asked to act).
    pub profile_id: &'a str,
}

impl Guard {
    /// Checks against the policy service behind `policy`: its keys and revocations,
    /// fetched again every `key_refresh`, and `WhoAmI` for callers' credentials.
    pub fn new(policy: PolicyHandle, key_refresh: Duration) -> Self {
        Self {
            callers: ServiceCallers::remote(policy.clone()),
            keys: Arc::new(TokenKeys::refreshed_every(policy, key_refresh)),
            clock: Clock::system(),
        }
    }

    /// The time by the clock the checks read.
    pub fn now(&self) -> std::time::SystemTime {
        self.clock.now()
    }

    /// The call must come from the supervisor.
    pub async fn supervisor_only<T>(&self, request: &Request<T>, what: &str) -> Result<(), Status> {
        self.callers
            .require(request, MeshService::Supervisor, what)
            .await
            .inspect_err(|refused| {
                tracing::warn!(
                    refused = %refused.message(),
                    "refused a call that did not come from the supervisor"
                );
            })
    }

    /// The token's claims, if it is genuine, current, unrevoked and bound to `binding`.
    pub async fn task_token(&self, token: &str, binding: Binding<'_>) -> Result<Verified, Status> {
        let refused = |status: Status| {
            tracing::warn!(
                convene.run.id = %binding.run_id,
                convene.delegation.id = binding.delegation_id.unwrap_or(""),
                convene.delegation.profile = %binding.profile_id,
                refused = %status.message(),
                "task token refused; nothing was called"
            );
            status
        };
        let accepted = self
            .keys
            .accept(token, self.clock.now())
            .await
            .map_err(refused)?;
        let claims = &accepted.claims;
        let mismatch = |claim: &str, token_has: &str, wanted: &str| {
            refused(Status::permission_denied(format!(
                "task token refused ({claim}): it is bound to {claim} {token_has}, not {wanted}; \
                 the supervisor sends each task with its own token"
            )))
        };
        if claims.run_id != binding.run_id {
            return Err(mismatch("run", &claims.run_id, binding.run_id));
        }
        if let Some(delegation) = binding.delegation_id
            && claims.delegation_id != delegation
        {
            return Err(mismatch("delegation", &claims.delegation_id, delegation));
        }
        if claims.profile_id != binding.profile_id {
            return Err(mismatch("profile", &claims.profile_id, binding.profile_id));
        }
        Ok(accepted)
    }

    /// Checks again what [`Self::task_token`] accepted, before each model turn and
    /// remote call of a task: the key still listed, the token unexpired, neither it nor
    /// its run revoked since. The binding was checked then and the token has not
    /// changed, so its signature is not checked again.
    pub async fn recheck(&self, verified: &Verified) -> Result<(), Status> {
        self.keys
            .recheck(verified, self.clock.now())
            .await
            .inspect_err(|refused| {
                tracing::warn!(
                    convene.run.id = %verified.claims.run_id,
                    convene.delegation.id = %verified.claims.delegation_id,
                    convene.delegation.profile = %verified.claims.profile_id,
                    refused = %refused.message(),
                    "task token refused; nothing was called"
                );
            })
    }
}
