//! [`PolicyService`]: the `convene.v1.Policy` implementation, which is also its own
//! in-process handle.

use std::sync::Arc;

use convene_core::time::{Clock, to_timestamp};
use convene_mesh::auth::{Authenticator, Caller};
use convene_mesh::policy_file::{Policy, PrincipalKind};
use convene_proto::v1::{self, policy_server::PolicyServer, revoke_request::Target};
use convene_server::GrpcServer;
use convene_tokens::{KeyRing, from_unix_seconds};
use tonic::{Request, Response, Status};
use tracing::Instrument as _;

use crate::Error;
use crate::config::{Config, DecisionLogTarget};
use crate::decision_log::{
    DecisionLog, JsonlDecisionLog, LogEntry, MemoryDecisionLog, RevokeRecord,
};
use crate::issue::{MAX_GRANTS, Origin, Planned, list, plan};
use crate::keys::Keys;
use crate::state::{IssuedToken, MemoryState, PolicyState, Revocation, RevokeTarget};

/// The role a principal needs to issue task tokens (and to revoke any token).
pub const ISSUE_ROLE: &str = "tokens:issue";

/// The policy service. Cloning is cheap and every clone is the same service, so a clone
/// can be handed to other services in the same process as their
/// [`PolicyHandle`](convene_mesh::handles::PolicyHandle).
#[derive(Clone)]
pub struct PolicyService {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for PolicyService {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PolicyService")
            .field("principals", &self.inner.policy.principals.len())
            .field("profiles", &self.inner.policy.profiles.len())
            .field("state", &self.inner.state)
            .field("decision_log", &self.inner.log)
            .finish_non_exhaustive()
    }
}

/// What every call shares.
pub(crate) struct Inner {
    pub(crate) policy: Arc<Policy>,
    pub(crate) auth: Authenticator,
    pub(crate) keys: Keys,
    pub(crate) state: Arc<dyn PolicyState>,
    pub(crate) log: Arc<dyn DecisionLog>,
    pub(crate) clock: Clock,
}

/// Builds a [`PolicyService`] from its parts; see [`PolicyService::builder`].
pub struct PolicyServiceBuilder {
    policy: Policy,
    ring: KeyRing,
    state: Option<Arc<dyn PolicyState>>,
    log: Option<Arc<dyn DecisionLog>>,
    clock: Option<Clock>,
}

impl PolicyServiceBuilder {
    /// Keeps counters and revocations in `state` (default: a fresh [`MemoryState`]).
    #[must_use]
    pub fn state(mut self, state: Arc<dyn PolicyState>) -> Self {
        self.state = Some(state);
        self
    }

    /// Logs decisions to `log` (default: a fresh [`MemoryDecisionLog`]).
    #[must_use]
    pub fn decision_log(mut self, log: Arc<dyn DecisionLog>) -> Self {
        self.log = Some(log);
        self
    }

    /// Reads the time from `clock` (default: the system clock).
    #[must_use]
    pub fn clock(mut self, clock: Clock) -> Self {
        self.clock = Some(clock);
        self
    }

    /// The service.
    pub fn build(self) -> PolicyService {
        let policy = Arc::new(self.policy);
        let clock = self.clock.unwrap_or_default();
        PolicyService {
            inner: Arc::new(Inner {
                auth: Authenticator::principals_only(policy.clone()),
                policy,
                keys: Keys::new(self.ring),
                state: self
                    .state
                    .unwrap_or_else(|| Arc::new(MemoryState::with_clock(clock.clone()))),
                log: self
                    .log
                    .unwrap_or_else(|| Arc::new(MemoryDecisionLog::new())),
                clock,
            }),
        }
    }
}

impl PolicyService {
    /// A builder over a compiled policy and an open key ring.
    pub fn builder(policy: Policy, ring: KeyRing) -> PolicyServiceBuilder {
        PolicyServiceBuilder {
            policy,
            ring,
            state: None,
            log: None,
            clock: None,
        }
    }

    /// Opens the service as `config` says: loads the policy file (creating development
    /// credentials when enabled), opens the key ring (creating a first key) and the
    /// decision log (whose writer is a thread of its own, so no runtime is needed here).
    ///
    /// # Errors
    ///
    /// An invalid policy file, an unreadable or unwritable data directory.
    pub fn open(config: &Config) -> Result<Self, Error> {
        Self::open_with_clock(config, Clock::system())
    }

    /// Like [`open`](Self::open), reading the time from `clock`.
    ///
    /// # Errors
    ///
    /// As [`open`](Self::open).
    pub fn open_with_clock(config: &Config, clock: Clock) -> Result<Self, Error> {
        Self::open_with_database(config, clock, None)
    }

    /// Like [`open_with_clock`](Self::open_with_clock), keeping call counters,
    /// revocations and token owners in `database` (in memory when `None`), and the
    /// decisions too when `decision_log = "database"`. [`PolicyService::connect`] opens
    /// the database the configuration names.
    ///
    /// # Errors
    ///
    /// As [`open`](Self::open).
    pub fn open_with_database(
        config: &Config,
        clock: Clock,
        database: Option<convene_store::Database>,
    ) -> Result<Self, Error> {
        let source = config.policy_source();
        let (policy, _) = source.load()?;
        let ring = KeyRing::open(config.keys_dir())?;
        let log: Arc<dyn DecisionLog> = match config.decision_log {
            DecisionLogTarget::File => {
                Arc::new(JsonlDecisionLog::open(config.decision_log_path())?)
            }
            DecisionLogTarget::Memory => Arc::new(MemoryDecisionLog::new()),
            DecisionLogTarget::Database => match &database {
                Some(db) => Arc::new(crate::sql::SqlDecisionLog::new(db.clone())),
                None => Arc::new(MemoryDecisionLog::new()),
            },
        };
        let state: Arc<dyn PolicyState> = match database {
            Some(db) => Arc::new(crate::sql::SqlPolicyState::with_clock(db, clock.clone())),
            None => Arc::new(MemoryState::with_clock(clock.clone())),
        };
        tracing::info!(
            policy = %source.name(),
            principals = policy.principals.len(),
            profiles = policy.profiles.len(),
            tools = policy.tools.len(),
            signing_key = ring.active().kid(),
            decision_log = ?config.decision_log,
            "policy loaded"
        );
        Ok(Self::builder(policy, ring)
            .state(state)
            .decision_log(log)
            .clock(clock)
            .build())
    }

    /// The compiled policy the service decides with.
    pub fn policy(&self) -> &Arc<Policy> {
        &self.inner.policy
    }

    /// Makes a new signing key active at once. Tokens signed by the previous key keep
    /// verifying (GetSigningKeys lists both, the new one first). Returns the new key id.
    /// Writes the key ring file, so it blocks briefly.
    ///
    /// # Errors
    ///
    /// [`Error::Keys`] when the ring cannot be saved; the previous key stays active.
    pub fn rotate_key(&self) -> Result<String, Error> {
        let kid = self.inner.keys.rotate()?;
        tracing::info!(signing_key = %kid, "signing key rotated; the previous key still verifies");
        Ok(kid)
    }

    /// Retires signing key `kid`, which must not be the active one: from now on tokens
    /// it signed are refused here, and by every other service once it refreshes the keys
    /// (every minute by default). Writes the key ring file.
    ///
    /// # Errors
    ///
    /// [`Error::Keys`] for an unknown or the active key, or a ring that cannot be saved.
    pub fn retire_key(&self, kid: &str) -> Result<(), Error> {
        self.inner.keys.retire(kid)?;
        tracing::info!(signing_key = %kid, "signing key retired; tokens it signed are refused");
        Ok(())
    }

    /// Adds the `convene.v1.Policy` gRPC service to `server`.
    #[must_use]
    pub fn add_to(&self, server: GrpcServer) -> GrpcServer {
        server.add_service(PolicyServer::new(self.clone()))
    }
}

impl Inner {
    async fn issue(
        &self,
        caller: &Caller,
        request: &v1::IssueTaskTokenRequest,
    ) -> Result<v1::IssueTaskTokenResponse, Error> {
        let issuer = match caller {
            Caller::Principal(p) if p.has_role(ISSUE_ROLE) => p,
            other => {
                return Err(Error::PermissionDenied(format!(
                    "principal {} lacks role {ISSUE_ROLE}, which IssueTaskToken needs; add it \
                     to the principal's roles in the policy file",
                    other.principal_id()
                )));
            }
        };
        if request.grants.is_empty() {
            return Err(Error::invalid(
                "grants",
                "must not be empty: ask for one token per delegation",
            ));
        }
        if request.grants.len() > MAX_GRANTS {
            return Err(Error::invalid(
                "grants",
                format!(
                    "{} grants; at most {MAX_GRANTS} per call: split the batch",
                    request.grants.len()
                ),
            ));
        }
        let now = self.clock.now();
        let keys = self.keys.current();
        // Which revocation refuses the request: its run's, or its parent token's (or the
        // parent's run's); checked again in the commit that records the tokens.
        let (planned, parent_token_id): (Vec<Planned>, Option<String>) =
            if request.parent_token.is_empty() {
                let principal = self.top_level_principal(request)?;
                let origin = Origin::Principal {
                    principal,
                    run_id: &request.run_id,
                };
                (self.plan_all(&origin, request, now)?, None)
            } else {
                let parent = keys
                    .verifier
                    .verify(&request.parent_token, now)
                    .map_err(|e| {
                        Error::Unauthenticated(format!(
                            "parent_token refused ({}): {e}",
                            e.reason().as_str_name()
                        ))
                    })?;
                if let Some(revocation) = self
                    .state
                    .is_revoked(&parent.token_id, &parent.run_id, parent.lease_epoch)
                    .await?
                {
                    return Err(parent_revoked(&revocation));
                }
                if !parent.may_redelegate {
                    return Err(Error::PermissionDenied(
                        "parent token does not allow redelegation (it was issued with \
                     may_redelegate = false); the delegating agent must handle the task itself"
                            .to_owned(),
                    ));
                }
                if !request.run_id.is_empty() && request.run_id != parent.run_id {
                    return Err(Error::invalid(
                        "run_id",
                        format!(
                            "must be empty or the parent token's run {}, not {}",
                            parent.run_id, request.run_id
                        ),
                    ));
                }
                let principal = self.policy.principals.get(&parent.subject).ok_or_else(|| {
                    Error::PermissionDenied(format!(
                        "the parent token's principal {} is no longer in the policy file",
                        parent.subject
                    ))
                })?;
                let scopes = parent.permissions().map_err(|e| {
                    Error::Unauthenticated(format!(
                        "parent_token refused ({}): {e}",
                        e.reason().as_str_name()
                    ))
                })?;
                let origin = Origin::Parent {
                    principal,
                    parent: &parent,
                    scopes: &scopes,
                };
                (
                    self.plan_all(&origin, request, now)?,
                    Some(parent.token_id.clone()),
                )
            };

        let run_id = planned
            .first()
            .map(|p| p.claims.run_id.clone())
            .unwrap_or_default();
        // Authorize (and, in one process, every service) will see these tokens on every
        // tool call; they are signed here, so their signatures need no checking when they
        // come back (see `Signer::sign`).
        let mut signed = Vec::with_capacity(planned.len());
        for mut planned in planned {
            planned.claims.lease_epoch = request.lease_epoch;
            signed.push((keys.signer.sign(&planned.claims)?, planned));
        }
        let issued: Vec<IssuedToken> = signed
            .iter()
            .map(|(_, Planned { claims, .. })| IssuedToken {
                token_id: claims.token_id.clone(),
                run_id: claims.run_id.clone(),
                tenant: claims.tenant.clone(),
                expires_at: from_unix_seconds(claims.expires_at).unwrap_or(now),
            })
            .collect();
        // Recorded before any token is handed out, in one commit for the request, unless
        // the run (or the parent token) was revoked.
        let revocation = self
            .state
            .record_issued_unless_revoked(
                &issued,
                // No token id is ever empty: a top-level request asks about its run alone.
                parent_token_id.as_deref().unwrap_or(""),
                &run_id,
                request.lease_epoch,
            )
            .await?;
        if let Some(revocation) = revocation {
            return Err(match (&revocation.target, parent_token_id) {
                (RevokeTarget::Lease { run_id, epoch }, _) => Error::FailedPrecondition(format!(
                    "run {run_id} was taken over by another supervisor replica (lease \
                         epoch {epoch}); no tokens are issued for its lease epoch {} any more: \
                         this replica no longer runs the run",
                    request.lease_epoch
                )),
                (_, None) => Error::FailedPrecondition(format!(
                    "{} was revoked ({}); it gets no new tokens: start a new run",
                    revocation.target, revocation.reason
                )),
                (_, Some(_)) => parent_revoked(&revocation),
            });
        }
        let mut tokens = Vec::with_capacity(signed.len());
        for (token, Planned { claims, narrowed }) in signed {
            let expires_at = from_unix_seconds(claims.expires_at).unwrap_or(now);
            // The scopes as the token carries them (whole-second windows), which is what
            // Authorize will check.
            let scopes = convene_core::permissions::PermissionSet::from_permissions(
                claims.scopes.iter().filter_map(|s| s.to_permission().ok()),
            );
            tokens.push(v1::IssuedToken {
                delegation_id: claims.delegation_id,
                token,
                token_id: claims.token_id,
                expires_at: Some(to_timestamp(expires_at)),
                scopes: scopes.to_proto(),
                tools: claims.tools,
                narrowed,
            });
        }
        tracing::info!(
            issuer = %issuer.id,
            %run_id,
            tokens = tokens.len(),
            child = !request.parent_token.is_empty(),
            "task tokens issued"
        );
        Ok(v1::IssueTaskTokenResponse { tokens })
    }

    /// The principal a top-level request names.
    fn top_level_principal(
        &self,
        request: &v1::IssueTaskTokenRequest,
    ) -> Result<&convene_mesh::policy_file::Principal, Error> {
        if request.principal.trim().is_empty() {
            return Err(Error::invalid(
                "principal",
                "must name the principal the run acts for (or set parent_token for a nested \
                 delegation)",
            ));
        }
        let principal = self
            .policy
            .principals
            .get(&request.principal)
            .ok_or_else(|| {
                Error::NotFound(format!(
                    "principal `{}` is not in the policy file; known principals: {}",
                    request.principal,
                    list(self.policy.principals.keys())
                ))
            })?;
        if request.run_id.trim().is_empty() {
            return Err(Error::invalid(
                "run_id",
                "must name the run the tokens are bound to",
            ));
        }
        Ok(principal)
    }

    fn plan_all(
        &self,
        origin: &Origin<'_>,
        request: &v1::IssueTaskTokenRequest,
        now: std::time::SystemTime,
    ) -> Result<Vec<Planned>, Error> {
        request
            .grants
            .iter()
            .enumerate()
            .map(|(i, grant)| plan(&self.policy, origin, grant, &format!("grants[{i}]"), now))
            .collect()
    }

    async fn revoke(
        &self,
        caller: &Caller,
        request: &v1::RevokeRequest,
    ) -> Result<v1::RevokeResponse, Error> {
        let principal = match caller {
            Caller::Principal(p) => p,
            Caller::Task(_) => {
                return Err(Error::PermissionDenied(
                    "Revoke needs a principal credential, not a task token".to_owned(),
                ));
            }
        };
        let targets = revoke_targets(request)?;
        if !principal.has_role(ISSUE_ROLE) {
            // People may stop the work of their own tenant; anything else needs the
            // issuing role.
            if principal.kind != PrincipalKind::Human {
                return Err(Error::PermissionDenied(format!(
                    "principal {} lacks role {ISSUE_ROLE}, which Revoke needs for service \
                     principals (people may revoke the runs and tokens of their own tenant)",
                    principal.id
                )));
            }
            for target in &targets {
                let owner = self.state.owner_tenant(target).await?;
                if owner.as_deref() != Some(principal.tenant.as_str()) {
                    return Err(Error::PermissionDenied(format!(
                        "principal {} may revoke only runs and tokens of tenant {}; {target} is \
                         not one this service issued tokens for in that tenant",
                        principal.id, principal.tenant
                    )));
                }
            }
        }
        let reason = if request.reason.trim().is_empty() {
            "no reason given"
        } else {
            request.reason.as_str()
        };
        let time = humantime::format_rfc3339_millis(self.clock.now()).to_string();
        let revocations: Vec<(RevokeTarget, LogEntry)> = targets
            .into_iter()
            .map(|target| {
                let (kind, id) = target.kind_and_id();
                let entry = LogEntry::Revoke(RevokeRecord {
                    decision_id: uuid::Uuid::now_v7().to_string(),
                    time: time.clone(),
                    principal: principal.id.clone(),
                    target: kind.to_owned(),
                    id: id.to_owned(),
                    reason: reason.to_owned(),
                });
                (target, entry)
            })
            .collect();
        self.state
            .revoke_all_logged(&revocations, reason, &*self.log)
            .await?;
        for (target, _) in &revocations {
            let (kind, id) = target.kind_and_id();
            tracing::info!(principal = %principal.id, target = kind, id, reason, "revoked");
        }
        Ok(v1::RevokeResponse { revoked: true })
    }
}

/// Most calls one `AuthorizeBatch` decides.
pub const MAX_AUTHORIZE_BATCH: usize = 256;

/// The span of one authorization decision, whichever call asked for it.
fn authorize_span(req: &v1::AuthorizeRequest) -> tracing::Span {
    tracing::info_span!(
        "policy.authorize",
        convene.service = "policy",
        convene.tool = %req.tool,
        convene.authz.action = %req.action,
        convene.authz.resource = %req.resource,
        convene.authz.audience = %req.audience,
        convene.tool.call_id = %req.tool_call_id,
        convene.authz.decision = tracing::field::Empty,
        convene.authz.reason = tracing::field::Empty,
        convene.authz.decision_id = tracing::field::Empty,
        convene.authz.calls_used = tracing::field::Empty,
    )
}

fn error_result(error: v1::ItemStatus) -> v1::AuthorizeBatchResult {
    v1::AuthorizeBatchResult {
        result: Some(v1::authorize_batch_result::Result::Error(error)),
    }
}

impl PolicyService {
    /// Decides one call in `span` and records the decision on it.
    async fn decide(
        &self,
        req: &v1::AuthorizeRequest,
        span: tracing::Span,
    ) -> Result<v1::AuthorizeResponse, Status> {
        let answer = self.inner.authorize(req).instrument(span.clone()).await;
        match &answer {
            // A deny is a decision made, not a failure of the service: it is an
            // attribute here, and the asking tool call's span is the one that fails.
            Ok(decision) => {
                span.record(
                    "convene.authz.decision",
                    if decision.allowed { "allow" } else { "deny" },
                );
                span.record(
                    "convene.authz.reason",
                    v1::AuthorizeReason::try_from(decision.reason).map_or("UNKNOWN", |r| {
                        r.as_str_name().trim_start_matches("AUTHORIZE_REASON_")
                    }),
                );
                span.record("convene.authz.decision_id", decision.decision_id.as_str());
                span.record("convene.authz.calls_used", decision.calls_used);
            }
            Err(error) => convene_telemetry::set_error(&span, error.to_string()),
        }
        Ok(answer?)
    }
}

#[tonic::async_trait]
impl v1::policy_server::Policy for PolicyService {
    async fn issue_task_token(
        &self,
        request: Request<v1::IssueTaskTokenRequest>,
    ) -> Result<Response<v1::IssueTaskTokenResponse>, Status> {
        let caller = self.inner.auth.authenticate(&request).await?;
        convene_mesh::auth::require_peer_service(
            &request,
            &caller,
            convene_mesh::auth::MeshService::Supervisor,
            "issue task tokens",
        )?;
        Ok(Response::new(
            self.inner.issue(&caller, request.get_ref()).await?,
        ))
    }

    async fn authorize(
        &self,
        request: Request<v1::AuthorizeRequest>,
    ) -> Result<Response<v1::AuthorizeResponse>, Status> {
        // No bearer credential: the token in the message is what is being judged, and
        // under mutual TLS the presenter must be a worker.
        require_worker_presenter(&request)?;
        let req = request.get_ref();
        Ok(Response::new(self.decide(req, authorize_span(req)).await?))
    }

    async fn authorize_batch(
        &self,
        request: Request<v1::AuthorizeBatchRequest>,
    ) -> Result<Response<v1::AuthorizeBatchResponse>, Status> {
        require_worker_presenter(&request)?;
        let items = &request.get_ref().items;
        if items.is_empty() || items.len() > MAX_AUTHORIZE_BATCH {
            return Err(Status::invalid_argument(format!(
                "items: {} calls given; a batch decides 1 to {MAX_AUTHORIZE_BATCH} (send more \
                 in further batches)",
                items.len()
            )));
        }
        // Every item is decided as its own Authorize call, all at once, so their counts
        // and decision records share the decision log's commits.
        let results = futures::future::join_all(items.iter().enumerate().map(|(i, item)| {
            let Some(req) = item.request.as_ref() else {
                let error = v1::ItemStatus {
                    code: tonic::Code::InvalidArgument as i32,
                    message: format!("items[{i}].request: missing; give the call to decide"),
                };
                return futures::future::Either::Left(std::future::ready(error_result(error)));
            };
            let span = authorize_span(req);
            // The asking tool call's span is the parent; without one, the batch's is.
            convene_telemetry::continue_trace(&span, &item.traceparent);
            futures::future::Either::Right(async move {
                match self.decide(req, span).await {
                    Ok(decision) => v1::AuthorizeBatchResult {
                        result: Some(v1::authorize_batch_result::Result::Decision(decision)),
                    },
                    Err(status) => error_result(v1::ItemStatus {
                        code: status.code() as i32,
                        message: status.message().to_owned(),
                    }),
                }
            })
        }))
        .await;
        Ok(Response::new(v1::AuthorizeBatchResponse { results }))
    }

    async fn revoke(
        &self,
        request: Request<v1::RevokeRequest>,
    ) -> Result<Response<v1::RevokeResponse>, Status> {
        let caller = self.inner.auth.authenticate(&request).await?;
        Ok(Response::new(
            self.inner.revoke(&caller, request.get_ref()).await?,
        ))
    }

    async fn get_signing_keys(
        &self,
        request: Request<v1::GetSigningKeysRequest>,
    ) -> Result<Response<v1::GetSigningKeysResponse>, Status> {
        // Public: keys, and revocations as digests that name nothing.
        let keys = self.inner.keys.current().jwks.clone();
        let kept = self.inner.policy.tokens.max_ttl;
        let now = self.inner.clock.now();
        let oldest = now.checked_sub(kept).unwrap_or(std::time::UNIX_EPOCH);
        // A little before what the caller saw last: a revocation committed late, with an
        // earlier time, is still found.
        let since = request
            .get_ref()
            .revoked_since
            .and_then(|t| std::time::SystemTime::try_from(t).ok())
            .map(|t| t.checked_sub(REVOCATION_OVERLAP).unwrap_or(oldest))
            .map_or(oldest, |t| t.max(oldest));
        let revocations = self
            .inner
            .state
            .revoked_since(since)
            .await
            .map_err(|e| Status::unavailable(format!("cannot read revocations: {e}")))?;
        let through = revocations.iter().map(|(_, at)| *at).max();
        Ok(Response::new(v1::GetSigningKeysResponse {
            keys,
            revoked: revocations
                .iter()
                .filter_map(|(target, _)| match target {
                    RevokeTarget::Token(id) => Some(convene_mesh::auth::revoked_token_digest(id)),
                    RevokeTarget::Run(id) => Some(convene_mesh::auth::revoked_run_digest(id)),
                    RevokeTarget::Lease { .. } => None,
                })
                .collect(),
            fences: revocations
                .iter()
                .filter_map(|(target, _)| match target {
                    RevokeTarget::Lease { run_id, epoch } => Some(v1::LeaseFence {
                        run: convene_mesh::auth::revoked_run_digest(run_id),
                        epoch: *epoch,
                    }),
                    _ => None,
                })
                .collect(),
            revoked_through: through.map(prost_types::Timestamp::from),
            revocations_kept: prost_types::Duration::try_from(kept).ok(),
        }))
    }

    async fn who_am_i(
        &self,
        request: Request<v1::WhoAmIRequest>,
    ) -> Result<Response<v1::WhoAmIResponse>, Status> {
        let caller = self.inner.auth.authenticate(&request).await?;
        let principal = caller.require_principal("WhoAmI")?;
        Ok(Response::new(convene_mesh::auth::who_am_i(principal)))
    }

    async fn list_tools(
        &self,
        request: Request<v1::ListToolsRequest>,
    ) -> Result<Response<v1::ListToolsResponse>, Status> {
        // Any principal: the catalog says what tools exist and what their calls ask for,
        // nothing a token allows.
        self.inner.auth.authenticate(&request).await?;
        Ok(Response::new(list_tools(
            &self.inner.policy,
            &request.get_ref().name_prefix,
        )))
    }
}

/// The catalog's tools whose name starts with `prefix`, sorted by name.
fn list_tools(policy: &Policy, prefix: &str) -> v1::ListToolsResponse {
    let tools = policy
        .tools
        .values()
        .filter(|t| t.name.starts_with(prefix))
        .map(|t| v1::CatalogTool {
            name: t.name.clone(),
            action: t.action.clone(),
            resource_template: t
                .resource
                .as_ref()
                .map(|r| r.as_str().to_owned())
                .unwrap_or_default(),
            risk_level: t.risk.to_proto().into(),
            description: t.description.clone(),
            evidence_kinds: t.evidence_kinds.clone(),
        })
        .collect();
    v1::ListToolsResponse { tools }
}

/// Under mutual TLS, the caller presenting tokens to Authorize must be a worker (its
/// client certificate names `worker`): tokens are bound to the worker of their profile,
/// and no other service presents them. Without a certificate the token alone binds the
/// audience (see the authorization's audience check).
fn require_worker_presenter<T>(request: &Request<T>) -> Result<(), Status> {
    if request.peer_certs().is_none_or(|c| c.is_empty()) {
        return Ok(());
    }
    let identities = convene_mesh::auth::peer_identities(request);
    if identities
        .iter()
        .any(|id| convene_mesh::auth::names_service(id, "worker"))
    {
        return Ok(());
    }
    Err(Status::permission_denied(format!(
        "only a worker presents task tokens to Authorize: the client certificate names {}, \
         not spiffe://<trust domain>/worker",
        if identities.is_empty() {
            "no spiffe:// identity".to_owned()
        } else {
            identities.join(", ")
        }
    )))
}

/// How far before a verifier's last revocation GetSigningKeys looks again.
const REVOCATION_OVERLAP: std::time::Duration = std::time::Duration::from_secs(10);

/// Most runs one `Revoke` call names.
pub const MAX_REVOKE_RUNS: usize = 1_000;

/// What a `Revoke` request names, checked.
fn revoke_targets(request: &v1::RevokeRequest) -> Result<Vec<RevokeTarget>, Error> {
    match &request.target {
        None => Err(Error::invalid(
            "target",
            "set token_id (one token), run_id (every token of a run) or run_ids (of several)",
        )),
        Some(Target::TokenId(id)) if id.trim().is_empty() => {
            Err(Error::invalid("token_id", "must not be empty"))
        }
        Some(Target::RunId(id)) if id.trim().is_empty() => {
            Err(Error::invalid("run_id", "must not be empty"))
        }
        Some(Target::TokenId(id)) => Ok(vec![RevokeTarget::Token(id.clone())]),
        Some(Target::RunId(id)) => Ok(vec![RevokeTarget::Run(id.clone())]),
        Some(Target::RunIds(ids)) => {
            let ids = &ids.run_ids;
            if ids.is_empty() {
                return Err(Error::invalid("run_ids", "name at least one run"));
            }
            if ids.len() > MAX_REVOKE_RUNS {
                return Err(Error::invalid(
                    "run_ids",
                    format!(
                        "names {} runs; at most {MAX_REVOKE_RUNS} per call (split the list)",
                        ids.len()
                    ),
                ));
            }
            if let Some(i) = ids.iter().position(|id| id.trim().is_empty()) {
                return Err(Error::invalid(format!("run_ids[{i}]"), "must not be empty"));
            }
            let mut seen = std::collections::HashSet::with_capacity(ids.len());
            Ok(ids
                .iter()
                .filter(|id| seen.insert(id.as_str()))
                .map(|id| RevokeTarget::Run(id.clone()))
                .collect())
        }
    }
}

/// Why no child token can be derived from a revoked parent.
fn parent_revoked(revocation: &Revocation) -> Error {
    Error::PermissionDenied(format!(
        "parent token was revoked ({}: {}); no child token can be derived from it",
        revocation.target, revocation.reason
    ))
}
