//! [`EvidenceStoreService`]: the `convene.v1.EvidenceStore` implementation, which is
//! also its own in-process handle.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::SystemTime;

use convene_mesh::handles::PolicyHandle;
use convene_mesh::policy_file::Policy;
use convene_proto::v1::{self, LinkStatus, evidence_store_server::EvidenceStoreServer};
use convene_server::GrpcServer;
use convene_tokens::Claims;
use tonic::{Request, Response, Status};
use tracing::Instrument as _;

use crate::Error;
use crate::access::{Access, Reader};
use crate::artifacts::{ArtifactRef, Blobs, sha256_hex};
use crate::catalog::{ArtifactMeta, Catalog, MemoryCatalog, Recorded};
use crate::config::{Config, ENVELOPE_ALLOWANCE};
use crate::validate;

/// Most evidence ids one GetEvidence call may ask for.
pub const MAX_EVIDENCE_IDS: usize = 1000;

/// Most puts one PutArtifactBatch call may carry.
pub const MAX_PUT_BATCH: usize = 256;

/// Most claims one VerifyChain call may verify.
pub const MAX_CHAIN_CLAIMS: usize = 1000;

/// Most evidence references one VerifyChain call may follow in total.
pub const MAX_CHAIN_REFS: usize = 10_000;

/// The media type of bytes whose writer named none.
pub const DEFAULT_MEDIA_TYPE: &str = "application/octet-stream";

/// Longest media type accepted.
const MAX_MEDIA_TYPE_LEN: usize = 255;

/// The evidence store. Cloning is cheap and every clone is the same store, so a clone
/// can be handed to other services in the same process as their
/// [`EvidenceHandle`](convene_mesh::handles::EvidenceHandle).
#[derive(Clone)]
pub struct EvidenceStoreService {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for EvidenceStoreService {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EvidenceStoreService")
            .field("blobs", &self.inner.blobs)
            .field("catalog", &self.inner.catalog)
            .field("max_artifact_bytes", &self.inner.max_artifact_bytes)
            .finish_non_exhaustive()
    }
}

struct Inner {
    access: Access,
    blobs: Blobs,
    catalog: Arc<dyn Catalog>,
    max_artifact_bytes: usize,
}

impl EvidenceStoreService {
    /// A store over `blobs` and `catalog`, verifying task tokens with the keys `policy`
    /// publishes and principal credentials against `principals` (the compiled policy
    /// file, whose principals with role [`READER_ROLE`](crate::READER_ROLE) may read),
    /// accepting artifacts up to `max_artifact_bytes`.
    pub fn new(
        policy: PolicyHandle,
        principals: Arc<Policy>,
        blobs: Blobs,
        catalog: Arc<dyn Catalog>,
        max_artifact_bytes: usize,
    ) -> Self {
        Self::with_key_refresh(
            policy,
            principals,
            blobs,
            catalog,
            max_artifact_bytes,
            convene_server::DEFAULT_KEY_REFRESH,
        )
    }

    /// Like [`new`](Self::new), fetching the policy service's keys and revocations again
    /// every `key_refresh`.
    pub fn with_key_refresh(
        policy: PolicyHandle,
        principals: Arc<Policy>,
        blobs: Blobs,
        catalog: Arc<dyn Catalog>,
        max_artifact_bytes: usize,
        key_refresh: std::time::Duration,
    ) -> Self {
        Self {
            inner: Arc::new(Inner {
                access: Access::new(policy, principals, key_refresh),
                blobs,
                catalog,
                max_artifact_bytes,
            }),
        }
    }

    /// The store as `config` says, with an in-memory catalog, reaching the policy
    /// service through `policy` (a gRPC handle, or the service itself in one process),
    /// its principals loaded from `config` ([`Config::policy_source`]: `policy_file`, or
    /// the embedded example, with development credentials when `dev_credentials` is on).
    ///
    /// # Errors
    ///
    /// [`Error::PolicyFile`] when the policy cannot be loaded, [`Error::DataDir`] or
    /// [`Error::Storage`] when the artifact store cannot be opened, [`Error::Config`]
    /// for a zero `max_artifact_bytes` or an invalid `[artifacts]` section (e.g.
    /// `store = "s3"` without `bucket`).
    pub fn open(config: &Config, policy: PolicyHandle) -> Result<Self, Error> {
        let principals = Arc::new(config.policy_source().load()?.0);
        Self::open_with_policy(config, policy, principals)
    }

    /// Like [`open`](Self::open) with the principals of `principals`, a policy already
    /// compiled (so services hosted in one process share one policy file, and
    /// `config.policy_file` and `config.dev_credentials` are not consulted).
    ///
    /// # Errors
    ///
    /// As [`open`](Self::open), except policy loading.
    pub fn open_with_policy(
        config: &Config,
        policy: PolicyHandle,
        principals: Arc<Policy>,
    ) -> Result<Self, Error> {
        Self::open_with_catalog(config, policy, principals, Arc::new(MemoryCatalog::new()))
    }

    /// Like [`open_with_policy`](Self::open_with_policy) with `catalog` for the metadata.
    ///
    /// # Errors
    ///
    /// As [`open_with_policy`](Self::open_with_policy).
    pub fn open_with_catalog(
        config: &Config,
        policy: PolicyHandle,
        principals: Arc<Policy>,
        catalog: Arc<dyn Catalog>,
    ) -> Result<Self, Error> {
        if config.max_artifact_bytes == 0 {
            return Err(Error::Config(
                "max_artifact_bytes must be at least 1 (the default is 4194304, 4 MiB)".into(),
            ));
        }
        let blobs = Blobs::open(config)?;
        tracing::info!(
            artifacts = %blobs,
            max_artifact_bytes = config.max_artifact_bytes,
            "evidence store opened"
        );
        Ok(Self::with_key_refresh(
            policy,
            principals,
            blobs,
            catalog,
            config.max_artifact_bytes,
            config.key_refresh,
        ))
    }

    /// The largest message the service's gRPC endpoint accepts and sends: the artifact
    /// limit plus room for the other fields, so an oversize artifact is refused with the
    /// store's own message.
    pub fn message_limit(&self) -> usize {
        self.inner
            .max_artifact_bytes
            .saturating_add(ENVELOPE_ALLOWANCE)
    }

    /// Adds the `convene.v1.EvidenceStore` gRPC service to `server`, with message limits
    /// sized for its artifacts rather than the server's default.
    #[must_use]
    pub fn add_to(&self, server: GrpcServer) -> GrpcServer {
        let limit = self.message_limit();
        server.add_service_with_own_limits(
            EvidenceStoreServer::new(self.clone())
                .max_decoding_message_size(limit)
                .max_encoding_message_size(limit),
        )
    }
}

impl Inner {
    async fn put_artifact(
        &self,
        claims: &Claims,
        request: v1::PutArtifactRequest,
    ) -> Result<v1::PutArtifactResponse, Error> {
        let size = request.content.len();
        if size > self.max_artifact_bytes {
            return Err(Error::TooLarge {
                size,
                limit: self.max_artifact_bytes,
            });
        }
        let media_type = media_type(&request.media_type)?;
        if request.tool_call_id.len() > 256 {
            return Err(Error::invalid("tool_call_id", "at most 256 bytes"));
        }
        // Empty content is stored like any other: a query that found nothing is evidence
        // of absence, and its artifact is the hash of zero bytes.
        let artifact = ArtifactRef::of(&claims.tenant, &request.content);
        let evidence = request
            .evidence
            .map(|e| validate::evidence(e, "evidence", claims, Some(&artifact)))
            .transpose()?;

        // Content-addressed: bytes the catalog already lists were written (and synced)
        // before their entry was, so the same bytes again need no second write. GetArtifact
        // still re-hashes whatever is on disk.
        let (meta, created, evidence) = match self
            .catalog
            .artifact(&claims.tenant, &artifact.sha256)
            .await?
        {
            Some(known) => {
                let evidence = match evidence {
                    Some(e) => Some(self.store_evidence(&claims.tenant, e).await?),
                    None => None,
                };
                (known, false, evidence)
            }
            None => {
                let created = self.blobs.put(&artifact, request.content).await?;
                let meta = ArtifactMeta {
                    artifact: artifact.clone(),
                    media_type,
                    size: size as u64,
                    created_by_delegation: claims.delegation_id.clone(),
                    created_by_tool_call: request.tool_call_id,
                    created_at: SystemTime::now(),
                };
                match evidence {
                    // The entry and the evidence citing it in one commit.
                    Some(e) => {
                        let ((meta, _), recorded) = self
                            .catalog
                            .put_artifact_with_evidence(meta, e.clone())
                            .await?;
                        (meta, created, Some(evidence_of(e, recorded)?))
                    }
                    None => {
                        let (meta, _) = self.catalog.put_artifact(meta).await?;
                        (meta, created, None)
                    }
                }
            }
        };
        tracing::debug!(
            uri = %artifact.uri(),
            size,
            created,
            delegation_id = %claims.delegation_id,
            evidence_id = evidence.as_ref().map_or("", |e| e.evidence_id.as_str()),
            "artifact stored"
        );
        Ok(v1::PutArtifactResponse {
            artifact: Some(meta.to_proto()),
            created,
            evidence,
        })
    }

    async fn get_artifact(
        &self,
        reader: &Reader,
        request: &v1::GetArtifactRequest,
    ) -> Result<v1::GetArtifactResponse, Error> {
        let artifact = ArtifactRef::parse(&request.uri).map_err(|m| Error::invalid("uri", m))?;
        let meta = self
            .own_artifact(&reader.tenant, &artifact)
            .await?
            .ok_or_else(|| {
                Error::NotFound(format!(
                    "artifact {} does not exist; store it with PutArtifact first",
                    request.uri
                ))
            })?;
        let bytes = self.blobs.get(&artifact).await?.ok_or_else(|| {
            tracing::error!(uri = %request.uri, "artifact bytes are missing");
            Error::DataLoss(format!(
                "artifact {} is recorded but its bytes are missing from the artifact store",
                request.uri
            ))
        })?;
        let actual = sha256_hex(&bytes);
        if actual != artifact.sha256 {
            tracing::error!(uri = %request.uri, actual = %actual, "artifact is corrupted");
            return Err(Error::DataLoss(format!(
                "artifact {} is corrupted: stored bytes hash to sha256:{actual}, recorded {}; \
                 it is not served",
                request.uri,
                artifact.content_hash()
            )));
        }
        tracing::debug!(uri = %request.uri, reader = %reader.who, "artifact read");
        Ok(v1::GetArtifactResponse {
            artifact: Some(meta.to_proto()),
            content: bytes.to_vec(),
        })
    }

    async fn record_evidence(
        &self,
        claims: &Claims,
        request: v1::RecordEvidenceRequest,
    ) -> Result<v1::RecordEvidenceResponse, Error> {
        let evidence = request
            .evidence
            .ok_or_else(|| Error::invalid("evidence", "is required"))?;
        let evidence = validate::evidence(evidence, "evidence", claims, None)?;
        let artifact = ArtifactRef::parse(&evidence.artifact_uri)
            .map_err(|m| Error::invalid("evidence.artifact_uri", m))?;
        if self
            .own_artifact(&claims.tenant, &artifact)
            .await?
            .is_none()
        {
            return Err(Error::FailedPrecondition(format!(
                "evidence.artifact_uri: artifact {} does not exist in tenant {}; store its \
                 bytes with PutArtifact first",
                evidence.artifact_uri, claims.tenant
            )));
        }
        // The URI is the hash of the bytes, so the recorded hash must be that one.
        if evidence.content_hash != artifact.content_hash() {
            return Err(Error::FailedPrecondition(format!(
                "evidence.content_hash {} does not match artifact {}, whose bytes hash to {}",
                evidence.content_hash,
                evidence.artifact_uri,
                artifact.content_hash()
            )));
        }
        let evidence = self.store_evidence(&claims.tenant, evidence).await?;
        Ok(v1::RecordEvidenceResponse {
            evidence: Some(evidence),
        })
    }

    async fn get_evidence(
        &self,
        reader: &Reader,
        request: &v1::GetEvidenceRequest,
    ) -> Result<v1::GetEvidenceResponse, Error> {
        if request.evidence_ids.len() > MAX_EVIDENCE_IDS {
            return Err(Error::invalid(
                "evidence_ids",
                format!(
                    "{} ids; at most {MAX_EVIDENCE_IDS} per call",
                    request.evidence_ids.len()
                ),
            ));
        }
        let found = self
            .catalog
            .evidence(&reader.tenant, &request.evidence_ids)
            .await?;
        let mut response = v1::GetEvidenceResponse::default();
        for (id, record) in request.evidence_ids.iter().zip(found) {
            match record {
                Some(e) => response.evidence.push(e),
                None => response.missing.push(id.clone()),
            }
        }
        tracing::debug!(
            found = response.evidence.len(),
            missing = response.missing.len(),
            reader = %reader.who,
            "evidence read"
        );
        Ok(response)
    }

    async fn verify_chain(
        &self,
        reader: &Reader,
        request: &v1::VerifyChainRequest,
    ) -> Result<v1::VerifyChainResponse, Error> {
        if request.claims.len() > MAX_CHAIN_CLAIMS {
            return Err(Error::invalid(
                "claims",
                format!(
                    "{} claims; at most {MAX_CHAIN_CLAIMS} per call",
                    request.claims.len()
                ),
            ));
        }
        let refs: usize = request.claims.iter().map(|c| c.evidence_refs.len()).sum();
        if refs > MAX_CHAIN_REFS {
            return Err(Error::invalid(
                "claims",
                format!("{refs} evidence refs in total; at most {MAX_CHAIN_REFS} per call"),
            ));
        }
        let tenant = reader.tenant.as_str();

        // Each evidence record and artifact is looked up (and re-hashed) once, however
        // many claims cite it.
        let mut ids: Vec<String> = Vec::new();
        let mut seen = std::collections::HashSet::new();
        for claim in &request.claims {
            for id in &claim.evidence_refs {
                if seen.insert(id.as_str()) {
                    ids.push(id.clone());
                }
            }
        }
        let records: HashMap<String, v1::Evidence> = ids
            .iter()
            .cloned()
            .zip(self.catalog.evidence(tenant, &ids).await?)
            .filter_map(|(id, e)| e.map(|e| (id, e)))
            .collect();
        let mut artifacts: HashMap<String, Artifact> = HashMap::new();

        let mut links = Vec::with_capacity(refs.max(request.claims.len()));
        for claim in &request.claims {
            if claim.evidence_refs.is_empty() {
                links.push(v1::ChainLink {
                    claim_id: claim.claim_id.clone(),
                    evidence_id: String::new(),
                    artifact_uri: String::new(),
                    status: LinkStatus::ClaimWithoutEvidence.into(),
                    detail: format!(
                        "claim `{}` cites no evidence; cite at least one evidence id",
                        claim.claim_id
                    ),
                });
                continue;
            }
            for id in &claim.evidence_refs {
                let (status, artifact_uri, detail) = match records.get(id) {
                    None => (
                        LinkStatus::EvidenceUnknown,
                        String::new(),
                        format!("evidence `{id}` is not known in tenant {tenant}"),
                    ),
                    Some(e) => {
                        let artifact = match artifacts.get(&e.artifact_uri) {
                            Some(a) => a.clone(),
                            None => {
                                let a = self
                                    .inspect(tenant, &e.artifact_uri, request.rehash_content)
                                    .await?;
                                artifacts.insert(e.artifact_uri.clone(), a.clone());
                                a
                            }
                        };
                        let (status, detail) = link_status(id, e, &artifact);
                        (status, e.artifact_uri.clone(), detail)
                    }
                };
                links.push(v1::ChainLink {
                    claim_id: claim.claim_id.clone(),
                    evidence_id: id.clone(),
                    artifact_uri,
                    status: status.into(),
                    detail,
                });
            }
        }
        let intact = links.iter().all(|l| l.status == i32::from(LinkStatus::Ok));
        tracing::debug!(
            claims = request.claims.len(),
            links = links.len(),
            intact,
            reader = %reader.who,
            "chain verified"
        );
        let evidence = ids
            .iter()
            .filter_map(|id| records.get(id).cloned())
            .collect();
        Ok(v1::VerifyChainResponse {
            links,
            intact,
            evidence,
        })
    }

    /// The state of the artifact at `uri` in `tenant`, its bytes re-hashed if `rehash`.
    async fn inspect(&self, tenant: &str, uri: &str, rehash: bool) -> Result<Artifact, Error> {
        let Ok(artifact) = ArtifactRef::parse(uri) else {
            return Ok(Artifact::Missing);
        };
        if artifact.tenant != tenant
            || self
                .catalog
                .artifact(tenant, &artifact.sha256)
                .await?
                .is_none()
        {
            return Ok(Artifact::Missing);
        }
        if !rehash {
            return Ok(Artifact::Recorded(artifact.content_hash()));
        }
        Ok(match self.blobs.get(&artifact).await? {
            None => Artifact::BytesMissing,
            Some(bytes) => {
                let actual = sha256_hex(&bytes);
                if actual == artifact.sha256 {
                    Artifact::Recorded(artifact.content_hash())
                } else {
                    Artifact::Corrupted {
                        recorded: artifact.content_hash(),
                        actual: format!("sha256:{actual}"),
                    }
                }
            }
        })
    }

    /// Stores a checked record; identical re-recording is a no-op, different content
    /// under the same id is refused.
    async fn store_evidence(
        &self,
        tenant: &str,
        evidence: v1::Evidence,
    ) -> Result<v1::Evidence, Error> {
        let recorded = self
            .catalog
            .record_evidence(tenant, evidence.clone())
            .await?;
        evidence_of(evidence, recorded)
    }

    /// The catalog's record of `artifact` when it is in `tenant`'s catalog. Another
    /// tenant's artifact is not looked up: to the caller it does not exist, exactly as
    /// one that was never stored (nothing says whether the other tenant has it).
    async fn own_artifact(
        &self,
        tenant: &str,
        artifact: &ArtifactRef,
    ) -> Result<Option<ArtifactMeta>, Error> {
        if artifact.tenant != tenant {
            return Ok(None);
        }
        Ok(self
            .catalog
            .artifact(&artifact.tenant, &artifact.sha256)
            .await?)
    }
}

/// The evidence as recorded, or why it was not: evidence is immutable.
fn evidence_of(evidence: v1::Evidence, recorded: Recorded) -> Result<v1::Evidence, Error> {
    match recorded {
        Recorded::Created | Recorded::Unchanged => Ok(evidence),
        Recorded::Conflict(existing) => Err(Error::AlreadyExists(format!(
            "evidence {} already exists with different content (recorded for delegation \
             {}); evidence is immutable: record the new observation under a new evidence id",
            evidence.evidence_id, existing.delegation_id
        ))),
    }
}

/// What VerifyChain found about one artifact.
#[derive(Debug, Clone)]
enum Artifact {
    /// Not in the catalog (or not a valid URI of the tenant).
    Missing,
    /// In the catalog, but its bytes are gone (found only when re-hashing).
    BytesMissing,
    /// In the catalog with this content hash (and, when re-hashed, the bytes match).
    Recorded(String),
    /// The bytes no longer hash to the recorded hash.
    Corrupted {
        /// The recorded hash.
        recorded: String,
        /// What the bytes hash to now.
        actual: String,
    },
}

/// The status of the link from evidence `id` (record `e`) to its artifact.
fn link_status(id: &str, e: &v1::Evidence, artifact: &Artifact) -> (LinkStatus, String) {
    let uri = &e.artifact_uri;
    match artifact {
        Artifact::Missing => (
            LinkStatus::ArtifactMissing,
            format!("evidence `{id}` points at artifact {uri}, which does not exist"),
        ),
        Artifact::BytesMissing => (
            LinkStatus::ArtifactMissing,
            format!("the bytes of artifact {uri} (cited by evidence `{id}`) are missing"),
        ),
        Artifact::Recorded(hash) if *hash != e.content_hash => (
            LinkStatus::HashMismatch,
            format!(
                "evidence `{id}` records content hash {} but artifact {uri} has {hash}",
                e.content_hash
            ),
        ),
        Artifact::Corrupted { recorded, .. } if *recorded != e.content_hash => (
            LinkStatus::HashMismatch,
            format!(
                "evidence `{id}` records content hash {} but artifact {uri} has {recorded}",
                e.content_hash
            ),
        ),
        Artifact::Corrupted { recorded, actual } => (
            LinkStatus::ArtifactCorrupted,
            format!(
                "artifact {uri} (cited by evidence `{id}`) is corrupted: stored bytes hash to \
                 {actual}, recorded {recorded}"
            ),
        ),
        Artifact::Recorded(_) => (LinkStatus::Ok, String::new()),
    }
}

/// The media type to record: the writer's, or the default when none was given.
fn media_type(given: &str) -> Result<String, Error> {
    if given.is_empty() {
        return Ok(DEFAULT_MEDIA_TYPE.to_owned());
    }
    let well_formed = given.len() <= MAX_MEDIA_TYPE_LEN
        && given
            .split_once('/')
            .is_some_and(|(t, s)| !t.is_empty() && !s.is_empty())
        && given.is_ascii()
        && !given.chars().any(|c| c.is_ascii_control());
    if !well_formed {
        return Err(Error::invalid(
            "media_type",
            format!("`{given}` is not a media type such as application/json (type/subtype)"),
        ));
    }
    Ok(given.to_owned())
}

/// The span of one put, whichever call asked for it.
fn put_span(req: &v1::PutArtifactRequest) -> tracing::Span {
    tracing::info_span!(
        "evidence.put",
        convene.service = "evidence-store",
        convene.artifact.hash = tracing::field::Empty,
        convene.artifact.size = req.content.len(),
        convene.artifact.media_type = %req.media_type,
        convene.artifact.uri = tracing::field::Empty,
        convene.artifact.created = tracing::field::Empty,
        convene.evidence.id = req.evidence.as_ref().map_or("", |e| e.evidence_id.as_str()),
        convene.tool.call_id = %req.tool_call_id,
        error.type = tracing::field::Empty,
    )
}

impl EvidenceStoreService {
    /// Stores one put made with the bearer credential of `request`, in `span`, and
    /// records the outcome on it.
    async fn put(
        &self,
        request: Request<v1::PutArtifactRequest>,
        span: tracing::Span,
    ) -> Result<v1::PutArtifactResponse, Status> {
        let stored = async {
            let claims = self.inner.access.writer(&request, "PutArtifact").await?;
            self.inner
                .put_artifact(&claims, request.into_inner())
                .await
                .map_err(Status::from)
        }
        .instrument(span.clone())
        .await;
        match &stored {
            Ok(r) => {
                if let Some(a) = &r.artifact {
                    // The store hashed the bytes already; no second pass for the trace.
                    span.record("convene.artifact.hash", a.content_hash.as_str());
                    span.record("convene.artifact.uri", a.uri.as_str());
                }
                span.record("convene.artifact.created", r.created);
            }
            Err(status) => {
                span.record("error.type", format!("{:?}", status.code()).as_str());
                convene_telemetry::set_error(&span, status.message().to_owned());
            }
        }
        stored
    }
}

#[tonic::async_trait]
impl v1::evidence_store_server::EvidenceStore for EvidenceStoreService {
    async fn put_artifact(
        &self,
        request: Request<v1::PutArtifactRequest>,
    ) -> Result<Response<v1::PutArtifactResponse>, Status> {
        let span = put_span(request.get_ref());
        Ok(Response::new(self.put(request, span).await?))
    }

    async fn put_artifact_batch(
        &self,
        request: Request<v1::PutArtifactBatchRequest>,
    ) -> Result<Response<v1::PutArtifactBatchResponse>, Status> {
        let items = request.into_inner().items;
        if items.is_empty() || items.len() > MAX_PUT_BATCH {
            return Err(Status::invalid_argument(format!(
                "items: {} puts given; a batch stores 1 to {MAX_PUT_BATCH} (send more in \
                 further batches)",
                items.len()
            )));
        }
        // Every item is stored as its own PutArtifact call, all at once, so their
        // catalog entries share the catalog's commits.
        let results = futures::future::join_all(items.into_iter().enumerate().map(|(i, item)| {
            let v1::PutArtifactBatchItem {
                token,
                request,
                traceparent,
            } = item;
            async move {
                let Some(put) = request else {
                    return Err(Status::invalid_argument(format!(
                        "items[{i}].request: missing; give the put to store"
                    )));
                };
                if token.is_empty() {
                    return Err(Status::unauthenticated(format!(
                        "items[{i}].token: missing; each put of a batch carries the task \
                         token of its delegation"
                    )));
                }
                let span = put_span(&put);
                // The asking tool call's span is the parent; without one, the batch's is.
                convene_telemetry::continue_trace(&span, &traceparent);
                let request = convene_mesh::auth::request(put, &token);
                self.put(request, span).await
            }
        }))
        .await;
        let results = results
            .into_iter()
            .map(|result| v1::PutArtifactBatchResult {
                result: Some(match result {
                    Ok(response) => v1::put_artifact_batch_result::Result::Response(response),
                    Err(status) => v1::put_artifact_batch_result::Result::Error(v1::ItemStatus {
                        code: status.code() as i32,
                        message: status.message().to_owned(),
                    }),
                }),
            })
            .collect();
        Ok(Response::new(v1::PutArtifactBatchResponse { results }))
    }

    async fn get_artifact(
        &self,
        request: Request<v1::GetArtifactRequest>,
    ) -> Result<Response<v1::GetArtifactResponse>, Status> {
        let reader = self.inner.access.reader(&request, "GetArtifact").await?;
        Ok(Response::new(
            self.inner.get_artifact(&reader, request.get_ref()).await?,
        ))
    }

    async fn record_evidence(
        &self,
        request: Request<v1::RecordEvidenceRequest>,
    ) -> Result<Response<v1::RecordEvidenceResponse>, Status> {
        let claims = self.inner.access.writer(&request, "RecordEvidence").await?;
        Ok(Response::new(
            self.inner
                .record_evidence(&claims, request.into_inner())
                .await?,
        ))
    }

    async fn get_evidence(
        &self,
        request: Request<v1::GetEvidenceRequest>,
    ) -> Result<Response<v1::GetEvidenceResponse>, Status> {
        let reader = self.inner.access.reader(&request, "GetEvidence").await?;
        Ok(Response::new(
            self.inner.get_evidence(&reader, request.get_ref()).await?,
        ))
    }

    async fn verify_chain(
        &self,
        request: Request<v1::VerifyChainRequest>,
    ) -> Result<Response<v1::VerifyChainResponse>, Status> {
        let reader = self.inner.access.reader(&request, "VerifyChain").await?;
        Ok(Response::new(
            self.inner.verify_chain(&reader, request.get_ref()).await?,
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn media_types_default_and_must_look_like_one() {
        assert_eq!(media_type("").unwrap(), DEFAULT_MEDIA_TYPE);
        assert_eq!(media_type("application/json").unwrap(), "application/json");
        assert!(media_type("json").is_err());
        assert!(media_type("text/\n").is_err());
    }

    #[test]
    fn links_name_what_is_broken() {
        let e = v1::Evidence {
            evidence_id: "logs://a/1".into(),
            artifact_uri: "artifact://acme/x".into(),
            content_hash: "sha256:aa".into(),
            ..Default::default()
        };
        let ok = link_status("logs://a/1", &e, &Artifact::Recorded("sha256:aa".into()));
        assert_eq!(ok.0, LinkStatus::Ok);
        let mismatch = link_status("logs://a/1", &e, &Artifact::Recorded("sha256:bb".into()));
        assert_eq!(mismatch.0, LinkStatus::HashMismatch);
        assert!(mismatch.1.contains("sha256:bb"), "{}", mismatch.1);
        let corrupted = Artifact::Corrupted {
            recorded: "sha256:aa".into(),
            actual: "sha256:cc".into(),
        };
        let (status, detail) = link_status("logs://a/1", &e, &corrupted);
        assert_eq!(status, LinkStatus::ArtifactCorrupted);
        assert!(
            detail.contains("hash to sha256:cc, recorded sha256:aa"),
            "{detail}"
        );
        assert_eq!(
            link_status("logs://a/1", &e, &Artifact::Missing).0,
            LinkStatus::ArtifactMissing
        );
    }
}
