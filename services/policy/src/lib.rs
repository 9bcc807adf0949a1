//! The policy service (`convene.v1.Policy`): who may do what, as signed task tokens and
//! per-call decisions.
//!
//! - **IssueTaskToken** computes each delegation's effective permissions as
//!   `grants ∩ delegable ∩ capabilities ∩ task scope ∩ runtime policy`
//!   ([`convene_core::permissions::effective`]), its tools through the catalog and the
//!   runtime rules, and signs a task token binding them to tenant, run, delegation,
//!   audience, lifetime and call limit. It reports what was asked and not granted. A
//!   child token (nested delegation) can only narrow its parent: asking for more is
//!   refused, never silently trimmed.
//! - **Authorize** decides one tool call against a token in a fixed order (signature and
//!   validity, revocation, audience, tenant, tool, runtime rules, action, scopes and data
//!   scope, call count), counts allowed calls against `max_calls`, and appends every
//!   decision, allow or deny, to the [`decision_log`] before answering.
//! - **Revoke** cuts off a token or a whole run. Principals with role `tokens:issue` may
//!   revoke anything; people (human principals) may revoke the runs and tokens of their
//!   own tenant, as far as this service issued tokens for them. **GetSigningKeys**
//!   publishes the public keys so other services verify tokens offline. Keys rotate
//!   without breaking tokens in flight ([`PolicyService::rotate_key`],
//!   `convene-policy --rotate-key`).
//!
//! Counters and revocations live behind [`state::PolicyState`], decisions behind
//! [`decision_log::DecisionLog`]: in memory and in a JSON-lines file today, replaceable
//! by durable storage without touching the decisions.
//!
//! The service is a library: [`PolicyService`] implements the tonic trait, so it is also
//! the in-process [`PolicyHandle`](convene_mesh::handles::PolicyHandle);
//! [`PolicyService::add_to`] mounts it on a shared [`GrpcServer`]; [`run`] serves it
//! alone, as the `convene-policy` binary does.
#![forbid(unsafe_code)]

mod authorize;
pub mod config;
pub mod decision_log;
mod error;
pub mod issue;
mod keys;
mod service;
pub mod sql;
pub mod state;

use convene_server::{GrpcServer, Shutdown};
use convene_tokens::KeyRing;

pub use config::{Config, DEFAULT_PORT, DecisionLogTarget};
pub use convene_core::time::Clock;
pub use error::Error;
pub use service::{ISSUE_ROLE, PolicyService, PolicyServiceBuilder};

/// Serves the policy service as `config` says until `shutdown` triggers, then drains.
///
/// # Errors
///
/// An invalid policy file or data directory, a listen address that cannot be bound, or a
/// server failure.
pub async fn run(config: Config, shutdown: Shutdown) -> Result<(), Error> {
    let service = PolicyService::connect(&config).await?;
    let listener = convene_server::bind(config.server.listen).await?;
    service
        .add_to(GrpcServer::new(config.server.clone()))
        .serve(listener, shutdown)
        .await?;
    Ok(())
}

/// Rotates the key ring in `config`'s data directory before the service starts: a new
/// key signs from now on, the previous ones keep verifying. Returns the new key id.
///
/// # Errors
///
/// [`Error::Keys`] when the ring cannot be read or written.
pub fn rotate_signing_key(config: &Config) -> Result<String, Error> {
    let mut ring = KeyRing::open(config.keys_dir())?;
    Ok(ring.rotate()?.kid().to_owned())
}
