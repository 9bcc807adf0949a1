//! What the store knows about its artifacts and evidence, keyed by tenant.
//!
//! [`Catalog`] is the seam for durable storage: [`MemoryCatalog`] keeps everything in
//! memory for now (a restart forgets the metadata; the bytes stay on disk and putting
//! them again restores the entry), and a database-backed catalog can replace it without
//! touching the service. Every lookup names the tenant, so no query can reach another
//! tenant's records. The catalog stores what it is given: checking that evidence points
//! at an existing artifact with a matching hash is the service's job.

use std::collections::HashMap;
use std::fmt;
use std::sync::{PoisonError, RwLock};
use std::time::SystemTime;

use async_trait::async_trait;
use convene_core::time::to_timestamp;
use convene_proto::v1;

use crate::artifacts::ArtifactRef;

/// The catalog cannot answer (only durable implementations can fail).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CatalogError {
    /// The backing store is unreachable or failed; retrying later may succeed.
    #[error("the evidence catalog is unavailable: {0}; retry later")]
    Unavailable(String),
}

/// An artifact's metadata.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ArtifactMeta {
    /// Its name (tenant and hash).
    pub artifact: ArtifactRef,
    /// Media type, as the first writer said.
    pub media_type: String,
    /// Size in bytes.
    pub size: u64,
    /// The delegation whose token stored it first.
    pub created_by_delegation: String,
    /// The tool call that produced it, as the first writer said.
    pub created_by_tool_call: String,
    /// When it was first stored.
    pub created_at: SystemTime,
}

impl ArtifactMeta {
    /// The wire form.
    pub fn to_proto(&self) -> v1::Artifact {
        v1::Artifact {
            uri: self.artifact.uri(),
            content_hash: self.artifact.content_hash(),
            media_type: self.media_type.clone(),
            size: self.size,
            created_by_delegation: self.created_by_delegation.clone(),
            created_by_tool_call: self.created_by_tool_call.clone(),
            created_at: Some(to_timestamp(self.created_at)),
        }
    }
}

/// What recording an evidence record did.
#[derive(Debug, Clone, PartialEq)]
pub enum Recorded {
    /// The record is new.
    Created,
    /// The identical record was there already.
    Unchanged,
    /// A different record has this id; it is returned and nothing was changed.
    Conflict(Box<v1::Evidence>),
}

/// Artifact metadata and evidence records, per tenant.
#[async_trait]
pub trait Catalog: Send + Sync + fmt::Debug {
    /// Records `meta` unless its artifact is known already. Returns the stored metadata
    /// (the earlier one when it existed) and whether this call recorded it.
    async fn put_artifact(&self, meta: ArtifactMeta) -> Result<(ArtifactMeta, bool), CatalogError>;

    /// The metadata of an artifact of `tenant`.
    async fn artifact(
        &self,
        tenant: &str,
        sha256: &str,
    ) -> Result<Option<ArtifactMeta>, CatalogError>;

    /// Records `evidence` for `tenant` under its `evidence_id`; evidence is immutable, so
    /// an existing record is never replaced.
    async fn record_evidence(
        &self,
        tenant: &str,
        evidence: v1::Evidence,
    ) -> Result<Recorded, CatalogError>;

    /// [`put_artifact`](Self::put_artifact) and then
    /// [`record_evidence`](Self::record_evidence) for the artifact's tenant. A catalog in
    /// a database does both in one transaction, so the pair costs one commit; the
    /// artifact is recorded even when the evidence conflicts, as it would be in two steps.
    async fn put_artifact_with_evidence(
        &self,
        meta: ArtifactMeta,
        evidence: v1::Evidence,
    ) -> Result<((ArtifactMeta, bool), Recorded), CatalogError> {
        let tenant = meta.artifact.tenant.clone();
        let artifact = self.put_artifact(meta).await?;
        let recorded = self.record_evidence(&tenant, evidence).await?;
        Ok((artifact, recorded))
    }

    /// The records of `ids` in `tenant`, in order (`None` for unknown ids).
    async fn evidence(
        &self,
        tenant: &str,
        ids: &[String],
    ) -> Result<Vec<Option<v1::Evidence>>, CatalogError>;
}

/// A [`Catalog`] in memory: lost at exit.
#[derive(Debug, Default)]
pub struct MemoryCatalog {
    /// By (tenant, sha256).
    artifacts: RwLock<HashMap<(String, String), ArtifactMeta>>,
    /// By (tenant, evidence id).
    evidence: RwLock<HashMap<(String, String), v1::Evidence>>,
}

impl MemoryCatalog {
    /// An empty catalog.
    pub fn new() -> Self {
        Self::default()
    }
}

#[async_trait]
impl Catalog for MemoryCatalog {
    async fn put_artifact(&self, meta: ArtifactMeta) -> Result<(ArtifactMeta, bool), CatalogError> {
        let key = (meta.artifact.tenant.clone(), meta.artifact.sha256.clone());
        let mut artifacts = self
            .artifacts
            .write()
            .unwrap_or_else(PoisonError::into_inner);
        match artifacts.get(&key) {
            Some(existing) => Ok((existing.clone(), false)),
            None => {
                artifacts.insert(key, meta.clone());
                Ok((meta, true))
            }
        }
    }

    async fn artifact(
        &self,
        tenant: &str,
        sha256: &str,
    ) -> Result<Option<ArtifactMeta>, CatalogError> {
        Ok(self
            .artifacts
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&(tenant.to_owned(), sha256.to_owned()))
            .cloned())
    }

    async fn record_evidence(
        &self,
        tenant: &str,
        evidence: v1::Evidence,
    ) -> Result<Recorded, CatalogError> {
        let key = (tenant.to_owned(), evidence.evidence_id.clone());
        let mut records = self
            .evidence
            .write()
            .unwrap_or_else(PoisonError::into_inner);
        Ok(match records.get(&key) {
            Some(existing) if *existing == evidence => Recorded::Unchanged,
            Some(existing) => Recorded::Conflict(Box::new(existing.clone())),
            None => {
                records.insert(key, evidence);
                Recorded::Created
            }
        })
    }

    async fn evidence(
        &self,
        tenant: &str,
        ids: &[String],
    ) -> Result<Vec<Option<v1::Evidence>>, CatalogError> {
        let records = self.evidence.read().unwrap_or_else(PoisonError::into_inner);
        Ok(ids
            .iter()
            .map(|id| records.get(&(tenant.to_owned(), id.clone())).cloned())
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn evidence(id: &str, kind: &str) -> v1::Evidence {
        v1::Evidence {
            evidence_id: id.into(),
            kind: kind.into(),
            ..Default::default()
        }
    }

    #[tokio::test]
    async fn evidence_is_immutable_and_tenant_scoped() {
        let catalog = MemoryCatalog::new();
        let e = evidence("logs://a/1", "impact_metric");
        assert_eq!(
            catalog.record_evidence("acme", e.clone()).await.unwrap(),
            Recorded::Created
        );
        assert_eq!(
            catalog.record_evidence("acme", e.clone()).await.unwrap(),
            Recorded::Unchanged
        );
        let changed = evidence("logs://a/1", "causal_signal");
        assert_eq!(
            catalog.record_evidence("acme", changed).await.unwrap(),
            Recorded::Conflict(Box::new(e.clone()))
        );
        let ids = vec!["logs://a/1".to_owned(), "logs://a/2".to_owned()];
        assert_eq!(
            catalog.evidence("acme", &ids).await.unwrap(),
            vec![Some(e), None]
        );
        assert_eq!(
            catalog.evidence("globex", &ids).await.unwrap(),
            vec![None, None]
        );
    }

    #[tokio::test]
    async fn the_first_artifact_metadata_wins() {
        let catalog = MemoryCatalog::new();
        let meta = ArtifactMeta {
            artifact: ArtifactRef::of("acme", b"x"),
            media_type: "text/plain".into(),
            size: 1,
            created_by_delegation: "del-1".into(),
            created_by_tool_call: "call-1".into(),
            created_at: SystemTime::UNIX_EPOCH,
        };
        assert_eq!(
            catalog.put_artifact(meta.clone()).await.unwrap(),
            (meta.clone(), true)
        );
        let later = ArtifactMeta {
            created_by_delegation: "del-2".into(),
            ..meta.clone()
        };
        assert_eq!(
            catalog.put_artifact(later).await.unwrap(),
            (meta.clone(), false)
        );
        let sha = &meta.artifact.sha256;
        assert!(catalog.artifact("acme", sha).await.unwrap().is_some());
        assert!(catalog.artifact("globex", sha).await.unwrap().is_none());
    }
}
