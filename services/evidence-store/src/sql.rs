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
use convene_core::recent::RecentMap;
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
///
/// Records this catalog wrote or read are kept in bounded per-process sets and answered
/// from there: both kinds are immutable and never deleted, so a record seen once stays
/// the record under its key, whoever else shares the database. What is not known (or
/// was dropped when a set filled up) is read.
#[derive(Debug, Clone)]
pub struct SqlCatalog {
    db: Database,
    artifacts: Arc<Known<ArtifactMeta>>,
    evidence: Arc<Known<v1::Evidence>>,
}

impl SqlCatalog {
    /// A catalog in `db` (migrated, as [`Database::connect`] leaves it).
    pub fn new(db: Database) -> Self {
        Self {
            db,
            artifacts: Arc::default(),
            evidence: Arc::default(),
        }
    }
}

/// Immutable records by (tenant, key), at most [`Known::CAPACITY`]: those in use stay,
/// the others go a generation at a time, off the lock ([`RecentMap`]).
#[derive(Debug)]
struct Known<V> {
    map: RecentMap<(String, String), V>,
}

impl<V: Clone + Send + 'static> Default for Known<V> {
    fn default() -> Self {
        Self {
            map: RecentMap::new(Self::CAPACITY),
        }
    }
}

impl<V: Clone + Send + 'static> Known<V> {
    /// Enough for the records of thousands of runs in flight; a run's are read back
    /// within seconds of being written.
    const CAPACITY: usize = 8_192;

    fn get(&self, tenant: &str, key: &str) -> Option<V> {
        self.map
            .get_with(&(tenant.to_owned(), key.to_owned()), V::clone)
    }

    fn insert(&self, tenant: &str, key: &str, value: &V) {
        self.map
            .insert((tenant.to_owned(), key.to_owned()), value.clone());
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

/// Inserts an artifact's metadata unless the artifact is recorded already.
fn insert_artifact(meta: &ArtifactMeta) -> Statement {
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
    .bind(micros(meta.created_at))
}

/// Inserts an evidence record unless its id is recorded already.
fn insert_evidence(tenant: &str, evidence: &v1::Evidence) -> Statement {
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
    .bind(evidence.encode_to_vec())
}

fn select_artifact(tenant: &str, sha256: &str) -> Statement {
    sql("SELECT * FROM artifacts WHERE tenant = $1 AND sha256 = $2")
        .bind(tenant)
        .bind(sha256)
}

fn select_evidence(tenant: &str, ids: &[String]) -> Statement {
    let mut statement = Statement::built(format!(
        "SELECT evidence_id, body FROM evidence WHERE tenant = $1 AND evidence_id IN ({})",
        placeholders(2, ids.len())
    ))
    .bind(tenant);
    for id in ids {
        statement = statement.bind(id);
    }
    statement
}

/// The metadata as stored by an insert that did (`inserted`) or did not happen; `existing`
/// is the row found when it did not.
fn stored_artifact(
    meta: ArtifactMeta,
    inserted: bool,
    existing: Option<Row>,
) -> Result<(ArtifactMeta, bool), CatalogError> {
    if inserted {
        // As stored: to the microsecond.
        let created_at = from_micros(micros(meta.created_at));
        return Ok((ArtifactMeta { created_at, ..meta }, true));
    }
    let existing = existing.ok_or_else(|| {
        CatalogError::Unavailable(format!(
            "artifact {} was neither stored nor found",
            meta.artifact.uri()
        ))
    })?;
    Ok((artifact_from(&existing)?, false))
}

/// What recording `evidence` did, given whether its insert happened and, when not, the
/// record found under its id.
fn recorded(
    evidence: &v1::Evidence,
    inserted: bool,
    existing: Option<Row>,
) -> Result<Recorded, CatalogError> {
    if inserted {
        return Ok(Recorded::Created);
    }
    let existing = existing
        .as_ref()
        .map(evidence_from)
        .transpose()?
        .ok_or_else(|| {
            CatalogError::Unavailable(format!(
                "evidence {} was neither stored nor found",
                evidence.evidence_id
            ))
        })?;
    Ok(if existing == *evidence {
        Recorded::Unchanged
    } else {
        Recorded::Conflict(Box::new(existing))
    })
}

#[async_trait]
impl Catalog for SqlCatalog {
    async fn put_artifact(&self, meta: ArtifactMeta) -> Result<(ArtifactMeta, bool), CatalogError> {
        let inserted = self.db.execute(insert_artifact(&meta)).await? == 1;
        let existing = if inserted {
            None
        } else {
            self.db
                .fetch_optional(select_artifact(
                    &meta.artifact.tenant,
                    &meta.artifact.sha256,
                ))
                .await?
        };
        let stored = stored_artifact(meta, inserted, existing)?;
        self.know_artifact(&stored.0);
        Ok(stored)
    }

    async fn artifact(
        &self,
        tenant: &str,
        sha256: &str,
    ) -> Result<Option<ArtifactMeta>, CatalogError> {
        if let Some(known) = self.artifacts.get(tenant, sha256) {
            return Ok(Some(known));
        }
        let found = self
            .db
            .fetch_optional(select_artifact(tenant, sha256))
            .await?
            .map(|row| artifact_from(&row))
            .transpose()?;
        if let Some(meta) = &found {
            self.know_artifact(meta);
        }
        Ok(found)
    }

    async fn record_evidence(
        &self,
        tenant: &str,
        evidence: v1::Evidence,
    ) -> Result<Recorded, CatalogError> {
        let inserted = self.db.execute(insert_evidence(tenant, &evidence)).await? == 1;
        let existing = if inserted {
            None
        } else {
            let ids = std::slice::from_ref(&evidence.evidence_id);
            self.db.fetch_optional(select_evidence(tenant, ids)).await?
        };
        let recorded = recorded(&evidence, inserted, existing)?;
        self.know_evidence(tenant, &evidence, &recorded);
        Ok(recorded)
    }

    async fn put_artifact_with_evidence(
        &self,
        meta: ArtifactMeta,
        evidence: v1::Evidence,
    ) -> Result<((ArtifactMeta, bool), Recorded), CatalogError> {
        // One write job: the artifact's entry and the evidence citing it commit together,
        // and whatever was there before is read in the same transaction.
        let tenant = &meta.artifact.tenant;
        let artifact_insert = insert_artifact(&meta);
        let artifact_select = select_artifact(tenant, &meta.artifact.sha256);
        let evidence_insert = insert_evidence(tenant, &evidence);
        let evidence_select = select_evidence(tenant, std::slice::from_ref(&evidence.evidence_id));
        let (artifact, evidence_row) = self
            .db
            .write::<_, CatalogError, _>(move |tx| {
                Box::pin(async move {
                    let artifact = match tx.execute(artifact_insert).await? {
                        1 => (true, None),
                        _ => (false, tx.fetch_optional(artifact_select).await?),
                    };
                    let evidence = match tx.execute(evidence_insert).await? {
                        1 => (true, None),
                        _ => (false, tx.fetch_optional(evidence_select).await?),
                    };
                    Ok((artifact, evidence))
                })
            })
            .await?;
        let recorded = recorded(&evidence, evidence_row.0, evidence_row.1)?;
        let stored = stored_artifact(meta, artifact.0, artifact.1)?;
        self.know_artifact(&stored.0);
        self.know_evidence(&stored.0.artifact.tenant, &evidence, &recorded);
        Ok((stored, recorded))
    }

    async fn evidence(
        &self,
        tenant: &str,
        ids: &[String],
    ) -> Result<Vec<Option<v1::Evidence>>, CatalogError> {
        let mut found: Vec<Option<v1::Evidence>> =
            ids.iter().map(|id| self.evidence.get(tenant, id)).collect();
        let missing: Vec<String> = ids
            .iter()
            .zip(&found)
            .filter(|(_, known)| known.is_none())
            .map(|(id, _)| id.clone())
            .collect();
        if missing.is_empty() {
            return Ok(found);
        }
        let rows = self.db.fetch_all(select_evidence(tenant, &missing)).await?;
        let mut read = HashMap::with_capacity(rows.len());
        for row in &rows {
            let record = evidence_from(row)?;
            self.evidence.insert(tenant, &record.evidence_id, &record);
            read.insert(record.evidence_id.clone(), record);
        }
        for (id, slot) in ids.iter().zip(&mut found) {
            if slot.is_none() {
                *slot = read.get(id).cloned();
            }
        }
        Ok(found)
    }
}

impl SqlCatalog {
    fn know_artifact(&self, meta: &ArtifactMeta) {
        self.artifacts
            .insert(&meta.artifact.tenant, &meta.artifact.sha256, meta);
    }

    /// Keeps `evidence` when it is what the database holds under its id.
    fn know_evidence(&self, tenant: &str, evidence: &v1::Evidence, recorded: &Recorded) {
        match recorded {
            Recorded::Created | Recorded::Unchanged => {
                self.evidence
                    .insert(tenant, &evidence.evidence_id, evidence);
            }
            Recorded::Conflict(existing) => {
                self.evidence
                    .insert(tenant, &existing.evidence_id, existing);
            }
        }
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
        let principals = Arc::new(config.policy_source().load()?.0);
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
