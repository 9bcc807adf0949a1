//! [`SqlCatalog`]: artifact metadata and evidence records in SQLite or PostgreSQL (see
//! `convene_store`), for the evidence store's [`Catalog`] contract.
//!
//! Both tables are keyed by (tenant, id), and every statement names the tenant, so no
//! query reaches another tenant's records. Records are immutable: a second writer's
//! insert does nothing and the first record is returned (artifacts) or compared
//! (evidence). Creation times are kept to the microsecond.

use std::collections::HashMap;
use std::sync::Arc;

use async_trait::async_trait;
use convene_mesh::handles::PolicyHandle;
use convene_proto::v1;
use convene_store::time::{from_micros, micros};
use convene_store::{Database, Row, Statement, placeholders, sql};
use prost::Message as _;

use crate::artifacts::ArtifactRef;
use crate::catalog::{ArtifactMeta, Catalog, CatalogError, MemoryCatalog, Recorded};
use crate::{Config, Error, EvidenceStoreService};

impl From<convene_store::Error> for CatalogError {
    fn from(e: convene_store::Error) -> Self {
        CatalogError::Unavailable(e.to_string())
    }
}

/// Artifact metadata and evidence records in a database. See the [module docs](self).
#[derive(Debug, Clone)]
pub struct SqlCatalog {
    db: Database,
}

impl SqlCatalog {
    /// A catalog in `db` (migrated, as [`Database::connect`] leaves it).
    pub fn new(db: Database) -> Self {
        Self { db }
    }
}

fn artifact_from(row: &Row) -> Result<ArtifactMeta, CatalogError> {
    Ok(ArtifactMeta {
        artifact: ArtifactRef {
            tenant: row.get("tenant")?,
            sha256: row.get("sha256")?,
        },
        media_type: row.get("media_type")?,
        size: row.get_u64("size")?,
        created_by_delegation: row.get("created_by_delegation")?,
        created_by_tool_call: row.get("created_by_tool_call")?,
        created_at: from_micros(row.get("created_at")?),
    })
}

fn evidence_from(row: &Row) -> Result<v1::Evidence, CatalogError> {
    let bytes: Vec<u8> = row.get("body")?;
    v1::Evidence::decode(bytes.as_slice()).map_err(|e| {
        CatalogError::Unavailable(format!("a stored evidence record does not decode: {e}"))
    })
}

#[async_trait]
impl Catalog for SqlCatalog {
    async fn put_artifact(&self, meta: ArtifactMeta) -> Result<(ArtifactMeta, bool), CatalogError> {
        let inserted = self
            .db
            .execute(
                sql("INSERT INTO artifacts (tenant, sha256, media_type, size, \
                     created_by_delegation, created_by_tool_call, created_at) \
                     VALUES ($1, $2, $3, $4, $5, $6, $7) \
                     ON CONFLICT (tenant, sha256) DO NOTHING")
                .bind(&meta.artifact.tenant)
                .bind(&meta.artifact.sha256)
                .bind(&meta.media_type)
                .bind(meta.size)
                .bind(&meta.created_by_delegation)
                .bind(&meta.created_by_tool_call)
                .bind(micros(meta.created_at)),
            )
            .await?;
        if inserted == 1 {
            // As stored: to the microsecond.
            let created_at = from_micros(micros(meta.created_at));
            return Ok((ArtifactMeta { created_at, ..meta }, true));
        }
        let existing = self
            .artifact(&meta.artifact.tenant, &meta.artifact.sha256)
            .await?
            .ok_or_else(|| {
                CatalogError::Unavailable(format!(
                    "artifact {} was neither stored nor found",
                    meta.artifact.uri()
                ))
            })?;
        Ok((existing, false))
    }

    async fn artifact(
        &self,
        tenant: &str,
        sha256: &str,
    ) -> Result<Option<ArtifactMeta>, CatalogError> {
        self.db
            .fetch_optional(
                sql("SELECT * FROM artifacts WHERE tenant = $1 AND sha256 = $2")
                    .bind(tenant)
                    .bind(sha256),
            )
            .await?
            .map(|row| artifact_from(&row))
            .transpose()
    }

    async fn record_evidence(
        &self,
        tenant: &str,
        evidence: v1::Evidence,
    ) -> Result<Recorded, CatalogError> {
        let inserted = self
            .db
            .execute(
                sql(
                    "INSERT INTO evidence (tenant, evidence_id, kind, artifact_uri, \
                     content_hash, body) VALUES ($1, $2, $3, $4, $5, $6) \
                     ON CONFLICT (tenant, evidence_id) DO NOTHING",
                )
                .bind(tenant)
                .bind(&evidence.evidence_id)
                .bind(&evidence.kind)
                .bind(&evidence.artifact_uri)
                .bind(&evidence.content_hash)
                .bind(evidence.encode_to_vec()),
            )
            .await?;
        if inserted == 1 {
            return Ok(Recorded::Created);
        }
        let existing = self
            .evidence(tenant, std::slice::from_ref(&evidence.evidence_id))
            .await?
            .pop()
            .flatten()
            .ok_or_else(|| {
                CatalogError::Unavailable(format!(
                    "evidence {} was neither stored nor found",
                    evidence.evidence_id
                ))
            })?;
        Ok(if existing == evidence {
            Recorded::Unchanged
        } else {
            Recorded::Conflict(Box::new(existing))
        })
    }

    async fn evidence(
        &self,
        tenant: &str,
        ids: &[String],
    ) -> Result<Vec<Option<v1::Evidence>>, CatalogError> {
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let mut statement = Statement::built(format!(
            "SELECT evidence_id, body FROM evidence WHERE tenant = $1 AND evidence_id IN ({})",
            placeholders(2, ids.len())
        ))
        .bind(tenant);
        for id in ids {
            statement = statement.bind(id);
        }
        let rows = self.db.fetch_all(statement).await?;
        let mut found = HashMap::with_capacity(rows.len());
        for row in &rows {
            found.insert(row.get::<String>("evidence_id")?, evidence_from(row)?);
        }
        Ok(ids.iter().map(|id| found.get(id).cloned()).collect())
    }
}

impl EvidenceStoreService {
    /// The store as [`open`](Self::open) builds it, with its catalog in the database
    /// `database_url` names: by default the SQLite file `<data_dir>/convene.db`, in
    /// memory for `memory`. This is how the standalone service starts.
    ///
    /// # Errors
    ///
    /// As [`open`](Self::open), and [`Error::Database`] when the database cannot be
    /// opened.
    pub async fn connect(config: &Config, policy: PolicyHandle) -> Result<Self, Error> {
        let principals = config.load_policy()?;
        let catalog: Arc<dyn Catalog> = match convene_store::open(
            config.database_url.as_deref(),
            &config.data_dir,
        )
        .await?
        {
            Some(db) => {
                tracing::info!(backend = %db.backend(), url = db.url(), "the evidence catalog is stored in the database");
                Arc::new(SqlCatalog::new(db))
            }
            None => {
                tracing::info!(
                    "the evidence catalog is kept in memory (database_url = \"memory\"): it is lost at exit"
                );
                Arc::new(MemoryCatalog::new())
            }
        };
        Self::open_with_catalog(config, policy, principals, catalog)
    }
}
