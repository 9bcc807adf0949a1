//! The evidence store (`convene.v1.EvidenceStore`): immutable, content-addressed
//! artifacts and the evidence records that cite them.
//!
//! - **Artifacts** are named by tenant and SHA-256 (`artifact://<tenant>/<sha256>`) and
//!   written once through [`object_store`] with create-only puts: the same bytes give the
//!   same URI, and nothing overwrites stored bytes. Every read re-hashes the bytes; bytes
//!   that no longer match are reported as `DATA_LOSS` and never served. Empty content is
//!   a valid artifact: a query that found nothing is evidence of absence.
//! - **Evidence** records (the Evidence Contract) must point at an artifact of their
//!   tenant with the matching hash; they are immutable (re-recording identical content is
//!   a no-op, different content under the same id is refused).
//! - **VerifyChain** walks claim → evidence → artifact and reports every broken link.
//!
//! Writes need the delegation's task token, verified offline with the policy service's
//! public keys ([`convene_mesh::auth::TokenKeys`]), with scope `evidence:write` on
//! resource `evidence`. Reads accept that token with scope `evidence:read`, or — so a
//! person can audit a run's claims — the credential of a principal of the policy file
//! holding role [`READER_ROLE`]. The tenant comes from the credential only. Metadata
//! lives behind [`catalog::Catalog`] (in the database `database_url` names,
//! [`SqlCatalog`], or in memory); bytes behind [`artifacts::Blobs`]: the local file system,
//! or an S3-compatible bucket that replicas sharing one database also share (the
//! `[artifacts]` section, [`config::ArtifactsConfig`]).
//!
//! The service is a library: [`EvidenceStoreService`] implements the tonic trait, so it
//! is also the in-process [`EvidenceHandle`](convene_mesh::handles::EvidenceHandle);
//! [`EvidenceStoreService::add_to`] mounts it on a shared [`GrpcServer`]; [`run`] serves
//! it alone, as the `convene-evidence-store` binary does.
#![forbid(unsafe_code)]

mod access;
pub mod artifacts;
pub mod catalog;
pub mod config;
mod error;
mod service;
pub mod sql;
mod validate;

use std::sync::Arc;

use convene_mesh::handles::GrpcPolicy;
use convene_server::{GrpcServer, Shutdown};

pub use access::{AUDIENCE, EVIDENCE_RESOURCE, READ, READER_ROLE, WRITE};
pub use config::{Config, DEFAULT_PORT};
pub use error::Error;
pub use service::{
    DEFAULT_MEDIA_TYPE, EvidenceStoreService, MAX_CHAIN_CLAIMS, MAX_CHAIN_REFS, MAX_EVIDENCE_IDS,
};
pub use sql::SqlCatalog;

/// Serves the evidence store as `config` says until `shutdown` triggers, then drains.
/// Task tokens are verified with the keys of the policy service at
/// `config.policy_endpoint`, fetched on first use (the policy service may start later);
/// principals come from the policy file `config` names (or the embedded example).
///
/// # Errors
///
/// An invalid endpoint, policy file or data directory, a listen address that cannot be bound, or a
/// server failure.
pub async fn run(config: Config, shutdown: Shutdown) -> Result<(), Error> {
    let policy = GrpcPolicy::connect(&config.policy_endpoint)
        .map_err(|e| Error::Config(format!("policy_endpoint: {e}")))?;
    let store = EvidenceStoreService::connect(&config, Arc::new(policy)).await?;
    let listener = convene_server::bind(config.server.listen).await?;
    store
        .add_to(GrpcServer::new(config.server.clone()))
        .serve(listener, shutdown)
        .await?;
    Ok(())
}
