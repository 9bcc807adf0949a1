//! Who is calling.
//!
//! Every RPC carries `authorization: Bearer <credential>`. A credential is either a
//! principal's secret (its SHA-256 is listed in the policy file) or a task token (a JWS
//! signed by the policy service, verified offline against its public keys). Tenant and
//! identity come from here, never from a request message.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant, SystemTime};

use convene_proto::v1;
use convene_tokens::{Accepted, Claims, TokenError, Verifier};
use sha2::{Digest as _, Sha256};
use tonic::{Request, Status};

use crate::handles::PolicyHandle;
use crate::policy_file::{Policy, Principal, PrincipalKind};

/// The metadata key carrying the credential.
pub const AUTHORIZATION: &str = "authorization";

/// The metadata key with which a trusted front end (the operator console) names the
/// principal it acts for. Only a principal holding [`ACT_AS_ROLE`] may send it; the call
/// is then checked as that principal's own: its tenant, its roles.
pub const ACT_AS: &str = "x-convene-act-as";

/// The role that lets a principal act for another ([`ACT_AS`]).
pub const ACT_AS_ROLE: &str = "principals:act-as";

/// The authenticated caller of an RPC.
#[derive(Debug, Clone)]
pub enum Caller {
    /// A principal from the policy file (a person, the supervisor, an automation).
    Principal(Arc<Principal>),
    /// The holder of a task token (a worker acting for one delegation).
    Task(Arc<Claims>),
}

impl Caller {
    /// The tenant the caller acts in.
    pub fn tenant(&self) -> &str {
        match self {
            Caller::Principal(p) => &p.tenant,
            Caller::Task(c) => &c.tenant,
        }
    }

    /// The principal id (for a task token, the principal the run acts for).
    pub fn principal_id(&self) -> &str {
        match self {
            Caller::Principal(p) => &p.id,
            Caller::Task(c) => &c.subject,
        }
    }

    /// The principal, or PERMISSION_DENIED when the caller holds a task token.
    pub fn require_principal(&self, what: &str) -> Result<&Arc<Principal>, Status> {
        match self {
            Caller::Principal(p) => Ok(p),
            Caller::Task(_) => Err(Status::permission_denied(format!(
                "{what} needs a principal credential, not a task token"
            ))),
        }
    }

    /// The principal if it holds `role`, else PERMISSION_DENIED naming the role.
    pub fn require_role(&self, role: &str, what: &str) -> Result<&Arc<Principal>, Status> {
        let p = self.require_principal(what)?;
        if p.has_role(role) {
            Ok(p)
        } else {
            Err(Status::permission_denied(format!(
                "principal {} lacks role {role} needed to {what}; add it to the principal's roles in the policy file",
                p.id
            )))
        }
    }

    /// The task token's claims, or PERMISSION_DENIED for a principal.
    pub fn require_task(&self, what: &str) -> Result<&Arc<Claims>, Status> {
        match self {
            Caller::Task(c) => Ok(c),
            Caller::Principal(p) => Err(Status::permission_denied(format!(
                "{what} needs a task token; principal {} called it directly",
                p.id
            ))),
        }
    }
}

/// Puts `credential` into a request's `authorization` metadata, marked sensitive: it is
/// sent as a never-indexed literal (RFC 7541 §7.1.3), which tells every HTTP/2 hop on
/// the way, a proxy or service mesh included, not to keep it in its header compression
/// tables.
pub fn with_bearer<T>(mut request: Request<T>, credential: &str) -> Request<T> {
    if let Ok(mut v) = format!("Bearer {credential}").parse::<tonic::metadata::AsciiMetadataValue>()
    {
        v.set_sensitive(true);
        request.metadata_mut().insert(AUTHORIZATION, v);
    }
    request
}

/// A new request carrying `message` and `credential`.
pub fn request<T>(message: T, credential: &str) -> Request<T> {
    with_bearer(Request::new(message), credential)
}

/// The bearer credential of a request, or UNAUTHENTICATED saying how to send one.
pub fn bearer<T>(request: &Request<T>) -> Result<&str, Status> {
    let value = request
        .metadata()
        .get(AUTHORIZATION)
        .ok_or_else(|| {
            Status::unauthenticated(
                "missing `authorization: Bearer <credential>` metadata; pass a principal credential or a task token",
            )
        })?
        .to_str()
        .map_err(|_| Status::unauthenticated("authorization metadata is not ASCII"))?;
    let credential = value
        .strip_prefix("Bearer ")
        .or_else(|| value.strip_prefix("bearer "))
        .ok_or_else(|| {
            Status::unauthenticated("authorization metadata must be `Bearer <credential>`")
        })?
        .trim();
    if credential.is_empty() {
        return Err(Status::unauthenticated("empty bearer credential"));
    }
    Ok(credential)
}

/// Whether a credential looks like a compact JWS (a task token).
pub fn looks_like_token(credential: &str) -> bool {
    credential.starts_with("eyJ") && credential.bytes().filter(|b| *b == b'.').count() == 2
}

/// Maps a token verification failure to UNAUTHENTICATED with its reason.
pub fn token_status(e: &TokenError) -> Status {
    Status::unauthenticated(format!("task token refused ({:?}): {e}", e.reason()))
}

/// How often verifiers fetch the policy service's keys and revocations again, besides
/// on a token naming an unknown key id.
pub use convene_server::DEFAULT_KEY_REFRESH;

/// The digest under which the policy service lists a revoked token (`token:<jti>`), in
/// hex.
pub fn revoked_token_digest(token_id: &str) -> String {
    hex::encode(convene_tokens::revoked_token_digest(token_id))
}

/// The digest under which the policy service lists a revoked run (`run:<run id>`), in
/// hex.
pub fn revoked_run_digest(run_id: &str) -> String {
    hex::encode(convene_tokens::revoked_run_digest(run_id))
}

/// What a verifier knows from one fetch: the keys and the revocations.
struct KeySnapshot {
    verifier: Arc<Verifier>,
    /// Revoked tokens' and runs' digests, with when they were revoked.
    revoked: HashMap<[u8; 32], SystemTime>,
    /// Lease fences by run digest: the run's current lease epoch, and when it was set.
    fences: HashMap<[u8; 32], (u64, SystemTime)>,
    /// The `revoked_since` of the next fetch.
    revoked_through: Option<prost_types::Timestamp>,
    at: Instant,
}

/// The policy service's public keys and revocations, fetched through a policy handle:
/// again every refresh interval ([`DEFAULT_KEY_REFRESH`]), so a retired key or a
/// revocation reaches every verifier within one interval, and at once when a token
/// names a key id not seen yet (rotation), at most once per `min_refresh`.
pub struct TokenKeys {
    policy: PolicyHandle,
    snapshot: RwLock<Option<Arc<KeySnapshot>>>,
    last_refresh: RwLock<Option<Instant>>,
    min_refresh: Duration,
    refresh_every: Duration,
    /// Held while a refresh runs, so concurrent callers wait for one fetch.
    refreshing: tokio::sync::Mutex<()>,
}

impl std::fmt::Debug for TokenKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenKeys")
            .field("refresh_every", &self.refresh_every)
            .finish_non_exhaustive()
    }
}

impl TokenKeys {
    /// Keys fetched lazily from `policy`, again every [`DEFAULT_KEY_REFRESH`].
    pub fn new(policy: PolicyHandle) -> Self {
        Self::refreshed_every(policy, DEFAULT_KEY_REFRESH)
    }

    /// Keys fetched lazily from `policy`, again every `every`.
    pub fn refreshed_every(policy: PolicyHandle, every: Duration) -> Self {
        Self {
            policy,
            snapshot: RwLock::new(None),
            last_refresh: RwLock::new(None),
            min_refresh: Duration::from_secs(1).min(every),
            refresh_every: every,
            refreshing: tokio::sync::Mutex::new(()),
        }
    }

    async fn refresh(&self, now: SystemTime) -> Result<Arc<KeySnapshot>, Status> {
        let previous = self.current();
        let since = previous.as_ref().and_then(|p| p.revoked_through);
        let answer = self
            .policy
            .get_signing_keys(Request::new(v1::GetSigningKeysRequest {
                revoked_since: since,
            }))
            .await
            .map_err(|s| {
                Status::unavailable(format!(
                    "cannot fetch signing keys from the policy service: {}",
                    s.message()
                ))
            })?
            .into_inner();
        let verifier = Arc::new(Verifier::from_jwks(&answer.keys).map_err(|e| {
            Status::internal(format!("policy service returned unusable keys: {e}"))
        })?);
        let kept = answer
            .revocations_kept
            .and_then(|d| Duration::try_from(d).ok())
            .unwrap_or(Duration::from_secs(24 * 3600));
        let previous_fences = previous
            .as_ref()
            .map(|p| p.fences.clone())
            .unwrap_or_default();
        let mut revoked: HashMap<[u8; 32], SystemTime> = previous
            .map(|p| {
                p.revoked
                    .iter()
                    .filter(|(_, at)| now.duration_since(**at).unwrap_or_default() < kept)
                    .map(|(d, at)| (*d, *at))
                    .collect()
            })
            .unwrap_or_default();
        let through = answer
            .revoked_through
            .and_then(|t| SystemTime::try_from(t).ok())
            .unwrap_or(now);
        for listed in answer.revoked {
            // Anything but 64 hex digits names no token this process could hold.
            let mut digest = [0u8; 32];
            if hex::decode_to_slice(&listed, &mut digest).is_ok() {
                revoked.entry(digest).or_insert(through);
            }
        }
        let mut fences: HashMap<[u8; 32], (u64, SystemTime)> = previous_fences
            .into_iter()
            .filter(|(_, (_, at))| now.duration_since(*at).unwrap_or_default() < kept)
            .collect();
        for fence in answer.fences {
            let mut digest = [0u8; 32];
            if hex::decode_to_slice(&fence.run, &mut digest).is_ok() {
                let held = fences.entry(digest).or_insert((fence.epoch, through));
                if fence.epoch > held.0 {
                    *held = (fence.epoch, through);
                }
            }
        }
        let snapshot = Arc::new(KeySnapshot {
            verifier,
            revoked,
            fences,
            revoked_through: answer.revoked_through.or(since),
            at: Instant::now(),
        });
        *self.snapshot.write().expect("lock poisoned") = Some(snapshot.clone());
        *self.last_refresh.write().expect("lock poisoned") = Some(Instant::now());
        Ok(snapshot)
    }

    /// One fetch at a time: a caller that waited for another's fetch uses its answer.
    async fn refresh_once(
        &self,
        seen: Option<Instant>,
        now: SystemTime,
    ) -> Result<Arc<KeySnapshot>, Status> {
        let _one = self.refreshing.lock().await;
        if let Some(current) = self.current()
            && seen.is_none_or(|t| current.at > t)
        {
            return Ok(current);
        }
        self.refresh(now).await
    }

    fn current(&self) -> Option<Arc<KeySnapshot>> {
        self.snapshot.read().expect("lock poisoned").clone()
    }

    /// The keys and revocations, fetched again when older than the refresh interval;
    /// revocations older than the longest token lifetime at `now` are forgotten.
    async fn fresh(&self, now: SystemTime) -> Result<Arc<KeySnapshot>, Status> {
        match self.current() {
            Some(s) if s.at.elapsed() < self.refresh_every => Ok(s),
            Some(s) => match self.refresh_once(Some(s.at), now).await {
                Ok(fresh) => Ok(fresh),
                // The policy service is briefly away: keep verifying with what is known
                // until it has been away for two intervals.
                Err(e) if s.at.elapsed() < self.refresh_every * 2 => {
                    tracing::warn!(error = %e.message(), "cannot refresh the token keys; using the last ones");
                    Ok(s)
                }
                Err(e) => Err(e),
            },
            None => self.refresh_once(None, now).await,
        }
    }

    /// Verifies a token at `now`: signature, key, validity window, and that neither the
    /// token nor its run is revoked. Refreshes the keys once if its key id is unknown.
    pub async fn verify(&self, token: &str, now: SystemTime) -> Result<Claims, Status> {
        self.accept(token, now)
            .await
            .map(|accepted| accepted.claims)
    }

    /// [`Self::verify`], returning what [`Self::recheck`] needs to check the token again
    /// without it.
    pub async fn accept(&self, token: &str, now: SystemTime) -> Result<Accepted, Status> {
        let snapshot = self.fresh(now).await?;
        let accepted = match snapshot.verifier.accept(token, now) {
            Err(TokenError::UnknownKey { .. }) => {
                let recently = self
                    .last_refresh
                    .read()
                    .expect("lock poisoned")
                    .is_some_and(|t| t.elapsed() < self.min_refresh);
                if recently {
                    return snapshot
                        .verifier
                        .accept(token, now)
                        .map_err(|e| token_status(&e));
                }
                let refreshed = self.refresh_once(Some(snapshot.at), now).await?;
                let accepted = refreshed
                    .verifier
                    .accept(token, now)
                    .map_err(|e| token_status(&e))?;
                check_not_revoked(&refreshed, &accepted)?;
                return Ok(accepted);
            }
            other => other.map_err(|e| token_status(&e))?,
        };
        check_not_revoked(&snapshot, &accepted)?;
        Ok(accepted)
    }

    /// Checks again, at `now`, a token [`Self::accept`] accepted earlier: its key is
    /// still listed, it is still within its times, and neither it nor its run has been
    /// revoked since. The token's signature and bytes are not looked at again, so a
    /// holder that keeps what was accepted (a worker between the turns of one task)
    /// pays for no hashing or parsing.
    pub async fn recheck(&self, accepted: &Accepted, now: SystemTime) -> Result<(), Status> {
        let snapshot = self.fresh(now).await?;
        if !snapshot.verifier.trusts(&accepted.kid) {
            return Err(token_status(&TokenError::UnknownKey {
                kid: accepted.kid.to_string(),
            }));
        }
        snapshot
            .verifier
            .check_times(&accepted.claims, now)
            .map_err(|e| token_status(&e))?;
        check_not_revoked(&snapshot, accepted)
    }
}

fn check_not_revoked(snapshot: &KeySnapshot, accepted: &Accepted) -> Result<(), Status> {
    let claims = &accepted.claims;
    if let Some((epoch, _)) = snapshot.fences.get(&accepted.revocation.run)
        && claims.lease_epoch < *epoch
    {
        return Err(superseded(claims, *epoch));
    }
    if snapshot.revoked.is_empty() {
        return Ok(());
    }
    if snapshot.revoked.contains_key(&accepted.revocation.token) {
        return Err(Status::unauthenticated(format!(
            "task token refused (Revoked): token {} was revoked; ask the supervisor for a new task token",
            claims.token_id
        )));
    }
    if snapshot.revoked.contains_key(&accepted.revocation.run) {
        return Err(Status::unauthenticated(format!(
            "task token refused (Revoked): run {} was revoked; every token of the run is refused",
            claims.run_id
        )));
    }
    Ok(())
}

/// The refusal of a token issued under a lease epoch of its run older than `current`.
pub fn superseded(claims: &Claims, current: u64) -> Status {
    Status::unauthenticated(format!(
        "task token refused (Superseded): it was issued under lease epoch {} of run {}, \
         which another supervisor replica took over (epoch {current}); only that replica's \
         tokens act for the run now",
        claims.lease_epoch, claims.run_id
    ))
}

/// Authenticates callers against the policy file's principals and the policy service's
/// token keys.
#[derive(Debug, Clone)]
pub struct Authenticator {
    policy: Arc<Policy>,
    keys: Option<Arc<TokenKeys>>,
}

impl Authenticator {
    /// Principals only; task tokens are refused.
    pub fn principals_only(policy: Arc<Policy>) -> Self {
        Self { policy, keys: None }
    }

    /// Principals and task tokens.
    pub fn new(policy: Arc<Policy>, keys: Arc<TokenKeys>) -> Self {
        Self {
            policy,
            keys: Some(keys),
        }
    }

    /// The policy the principals come from.
    pub fn policy(&self) -> &Arc<Policy> {
        &self.policy
    }

    /// Who is calling, or UNAUTHENTICATED with what to fix.
    pub async fn authenticate<T>(&self, request: &Request<T>) -> Result<Caller, Status> {
        let credential = bearer(request)?;
        if looks_like_token(credential) {
            let keys = self.keys.as_ref().ok_or_else(|| {
                Status::unauthenticated(
                    "this service accepts principal credentials only, not task tokens",
                )
            })?;
            let claims = keys.verify(credential, SystemTime::now()).await?;
            return Ok(Caller::Task(Arc::new(claims)));
        }
        let principal = self
            .policy
            .principal_by_credential(credential)
            .ok_or_else(|| Status::unauthenticated("unknown credential; check the credential you were given (the policy file lists its sha256)"))?;
        let Some(acting_for) = request.metadata().get(ACT_AS) else {
            return Ok(Caller::Principal(Arc::new(principal.clone())));
        };
        if !principal.has_role(ACT_AS_ROLE) {
            return Err(Status::permission_denied(format!(
                "principal {} lacks role {ACT_AS_ROLE} needed to act for another principal ({ACT_AS})",
                principal.id
            )));
        }
        let target = acting_for
            .to_str()
            .ok()
            .and_then(|id| self.policy.principal(id))
            .ok_or_else(|| {
                Status::unauthenticated(format!("{ACT_AS} names no principal of the policy file"))
            })?;
        check_act_as(principal, target)?;
        // Both names, in the log and as an event of the call's span.
        tracing::info!(
            convene.principal.actor = %principal.id,
            convene.principal.id = %target.id,
            convene.tenant = %target.tenant,
            "call made by {} acting for {}",
            principal.id,
            target.id
        );
        Ok(Caller::Principal(Arc::new(target.clone())))
    }
}

/// Roles only the mesh's own services hold: nobody may act for a principal holding one.
pub const SERVICE_ROLES: [&str; 3] = [ACT_AS_ROLE, "tokens:issue", "workers:register"];

/// Whether `actor` (holding [`ACT_AS_ROLE`]) may act for `target`: only a person, never
/// a holder of a service role, and only in a tenant listed in the actor's `act_as`.
fn check_act_as(actor: &Principal, target: &Principal) -> Result<(), Status> {
    let refuse = |why: String| {
        tracing::warn!(
            convene.principal.actor = %actor.id,
            convene.principal.id = %target.id,
            "act-as refused: {why}"
        );
        Err(Status::permission_denied(format!(
            "principal {} may not act for {}: {why}",
            actor.id, target.id
        )))
    };
    if target.kind != PrincipalKind::Human {
        return refuse("only people (kind: human) can be acted for".to_owned());
    }
    if let Some(role) = SERVICE_ROLES.iter().find(|r| target.has_role(r)) {
        return refuse(format!(
            "it holds {role}, a role nobody may be acted for with"
        ));
    }
    if !actor.act_as_tenants.contains(&target.tenant) {
        return refuse(format!(
            "its tenant {} is not among the tenants listed under act_as.tenants of {} in the policy file",
            target.tenant, actor.id
        ));
    }
    Ok(())
}

/// A service of the mesh, as the caller of an RPC only the mesh makes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MeshService {
    /// The supervisor: calls workers (Execute, PlanTurn, Cancel) and issues tokens.
    Supervisor,
    /// A worker: registers with the supervisor.
    Worker,
}

impl MeshService {
    /// The service's name: the path of its SPIFFE id (`spiffe://<domain>/<name>`).
    pub fn name(self) -> &'static str {
        match self {
            MeshService::Supervisor => "supervisor",
            MeshService::Worker => "worker",
        }
    }

    /// The role its service principal holds in the policy file.
    pub fn role(self) -> &'static str {
        match self {
            MeshService::Supervisor => "tokens:issue",
            MeshService::Worker => "workers:register",
        }
    }

    /// The credential setting that supplies its principal credential.
    fn credential_hint(self) -> &'static str {
        match self {
            MeshService::Supervisor => {
                "the supervisor presents the credential of its service principal (its \
                 `credential_file`, or the development credential with `dev_credentials`)"
            }
            MeshService::Worker => {
                "the worker presents the `worker-pool` credential (its `credential_file`, or \
                 the development credential)"
            }
        }
    }
}

/// Whether a principal is the service principal of `service`: kind `service`, holding
/// the service's role.
fn is_service_principal(p: &Principal, service: MeshService) -> bool {
    p.kind == PrincipalKind::Service && p.has_role(service.role())
}

/// The caller of an RPC only the mesh makes must be `service`. Under mutual TLS its
/// client certificate must name it (URI SAN `spiffe://<trust domain>/<service>`), else
/// PERMISSION_DENIED naming what it presented. Without a client certificate (plaintext,
/// TLS without client certificates, in one process) `caller` must be the service's own
/// principal: kind `service`, holding the service's role ([`MeshService::role`]); a
/// person, a task token or a principal acted for is refused. Never a no-op.
pub fn require_peer_service<T>(
    request: &Request<T>,
    caller: &Caller,
    service: MeshService,
    what: &str,
) -> Result<(), Status> {
    if request.peer_certs().is_some_and(|c| !c.is_empty()) {
        return require_certificate(request, service, what);
    }
    match caller {
        Caller::Principal(p) if is_service_principal(p, service) => Ok(()),
        other => Err(not_the_service(service, what, other.principal_id())),
    }
}

fn not_the_service(service: MeshService, what: &str, who: &str) -> Status {
    Status::permission_denied(format!(
        "only the {} may {what}, and {who} is not its service principal (kind: service, \
         role {}); {}",
        service.name(),
        service.role(),
        service.credential_hint()
    ))
}

/// Under mutual TLS: the client certificate must name `service`.
fn require_certificate<T>(
    request: &Request<T>,
    service: MeshService,
    what: &str,
) -> Result<(), Status> {
    let identities = peer_identities(request);
    if identities
        .iter()
        .any(|id| names_service(id, service.name()))
    {
        return Ok(());
    }
    Err(Status::permission_denied(format!(
        "only the {} may {what}: the client certificate names {}, not spiffe://<trust domain>/{}",
        service.name(),
        if identities.is_empty() {
            "no spiffe:// identity".to_owned()
        } else {
            identities.join(", ")
        },
        service.name()
    )))
}

/// How a service that takes calls only from other services of the mesh tells who is
/// calling: from the policy file itself when it holds one (in one process, or a service
/// configured with it), or by asking the policy service (`WhoAmI`) with the caller's
/// own credential, remembering each answer for a minute.
#[derive(Clone)]
pub struct ServiceCallers {
    inner: Arc<CallersInner>,
}

enum CallersInner {
    Local(Arc<Policy>),
    Remote {
        policy: PolicyHandle,
        /// Answers by the SHA-256 of the credential: the principal, or the refusal.
        seen: Mutex<HashMap<[u8; 32], WhoAmIAnswer>>,
    },
}

/// A `WhoAmI` answer, by when it came: the principal, or the refusal.
type WhoAmIAnswer = (Instant, Result<Arc<Principal>, Status>);

/// How long a `WhoAmI` answer is used.
const WHO_AM_I_TTL: Duration = Duration::from_secs(60);
/// Most answers kept; past it the memory is cleared.
const WHO_AM_I_KEPT: usize = 4096;

impl std::fmt::Debug for ServiceCallers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match &*self.inner {
            CallersInner::Local(_) => "ServiceCallers::Local",
            CallersInner::Remote { .. } => "ServiceCallers::Remote",
        })
    }
}

impl ServiceCallers {
    /// Callers checked against a policy file held in this process.
    pub fn local(policy: Arc<Policy>) -> Self {
        Self {
            inner: Arc::new(CallersInner::Local(policy)),
        }
    }

    /// Callers checked by asking the policy service.
    pub fn remote(policy: PolicyHandle) -> Self {
        Self {
            inner: Arc::new(CallersInner::Remote {
                policy,
                seen: Mutex::new(HashMap::new()),
            }),
        }
    }

    /// The call must come from `service` ([`require_peer_service`]): a client
    /// certificate naming it, or else its service principal's bearer credential.
    pub async fn require<T>(
        &self,
        request: &Request<T>,
        service: MeshService,
        what: &str,
    ) -> Result<(), Status> {
        if request.peer_certs().is_some_and(|c| !c.is_empty()) {
            return require_certificate(request, service, what);
        }
        let credential = bearer(request).map_err(|_| {
            Status::unauthenticated(format!(
                "only the {} may {what}: the call carries neither a client certificate nor a \
                 bearer credential; {} (or serve with mutual TLS)",
                service.name(),
                service.credential_hint()
            ))
        })?;
        if request.metadata().get(ACT_AS).is_some() {
            return Err(Status::permission_denied(format!(
                "only the {} may {what}; nobody may act for it ({ACT_AS} is not accepted here)",
                service.name()
            )));
        }
        if looks_like_token(credential) {
            return Err(Status::permission_denied(format!(
                "only the {} may {what}; a task token is not its credential",
                service.name()
            )));
        }
        let principal = self.principal(credential).await?;
        if is_service_principal(&principal, service) {
            Ok(())
        } else {
            Err(not_the_service(service, what, &principal.id))
        }
    }

    async fn principal(&self, credential: &str) -> Result<Arc<Principal>, Status> {
        let unknown = || {
            Status::unauthenticated(
                "unknown credential; check the credential you were given (the policy file lists its sha256)",
            )
        };
        match &*self.inner {
            CallersInner::Local(policy) => policy
                .principal_by_credential(credential)
                .map(|p| Arc::new(p.clone()))
                .ok_or_else(unknown),
            CallersInner::Remote { policy, seen } => {
                let key: [u8; 32] = Sha256::digest(credential.as_bytes()).into();
                if let Some((at, answer)) = seen.lock().expect("lock poisoned").get(&key)
                    && at.elapsed() < WHO_AM_I_TTL
                {
                    return answer.clone();
                }
                let answer = match policy
                    .who_am_i(request(v1::WhoAmIRequest {}, credential))
                    .await
                {
                    Ok(who) => Ok(Arc::new(principal_of(who.into_inner()))),
                    Err(s) if s.code() == tonic::Code::Unauthenticated => Err(unknown()),
                    Err(s) => {
                        // The policy service could not answer: nothing to remember.
                        return Err(Status::unavailable(format!(
                            "cannot check the caller's credential with the policy service: {}",
                            s.message()
                        )));
                    }
                };
                let mut seen = seen.lock().expect("lock poisoned");
                if seen.len() >= WHO_AM_I_KEPT {
                    seen.clear();
                }
                seen.insert(key, (Instant::now(), answer.clone()));
                answer
            }
        }
    }
}

/// A principal as `WhoAmI` describes it (no grants: a service check needs none).
fn principal_of(who: v1::WhoAmIResponse) -> Principal {
    Principal {
        id: who.principal_id,
        tenant: who.tenant,
        kind: if who.kind == "service" {
            PrincipalKind::Service
        } else {
            PrincipalKind::Human
        },
        roles: who.roles.into_iter().collect(),
        profiles: Default::default(),
        grants: Default::default(),
        delegable: Default::default(),
        act_as_tenants: Default::default(),
    }
}

/// `WhoAmI`'s answer about `principal`.
pub fn who_am_i(principal: &Principal) -> v1::WhoAmIResponse {
    v1::WhoAmIResponse {
        principal_id: principal.id.clone(),
        tenant: principal.tenant.clone(),
        kind: match principal.kind {
            PrincipalKind::Human => "human",
            PrincipalKind::Service => "service",
        }
        .to_owned(),
        roles: principal.roles.iter().cloned().collect(),
    }
}

/// The SPIFFE ids (URI SANs `spiffe://<trust domain>/<path>`) of the leaf certificate a
/// client presented over mutual TLS; empty for a call without one (plaintext, TLS
/// without client certificates, or an in-process call).
pub fn peer_identities<T>(request: &Request<T>) -> Vec<String> {
    use x509_cert::der::Decode as _;
    use x509_cert::ext::pkix::SubjectAltName;
    use x509_cert::ext::pkix::name::GeneralName;
    let Some(certs) = request.peer_certs() else {
        return Vec::new();
    };
    let Some(leaf) = certs.first() else {
        return Vec::new();
    };
    let Ok(cert) = x509_cert::Certificate::from_der(leaf.as_ref()) else {
        return Vec::new();
    };
    let Ok(Some((_, san))) = cert.tbs_certificate().get_extension::<SubjectAltName>() else {
        return Vec::new();
    };
    san.0
        .iter()
        .filter_map(|name| match name {
            GeneralName::UniformResourceIdentifier(uri) => Some(uri.as_str().to_owned()),
            _ => None,
        })
        .filter(|uri| uri.starts_with("spiffe://"))
        .collect()
}

/// Whether `identity` (`spiffe://<trust domain>/<service>`) names `service`.
pub fn names_service(identity: &str, service: &str) -> bool {
    identity
        .strip_prefix("spiffe://")
        .and_then(|rest| rest.split_once('/'))
        .is_some_and(|(domain, path)| !domain.is_empty() && path == service)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_spiffe_id_names_the_service_in_its_path() {
        assert!(names_service(
            "spiffe://convene.local/supervisor",
            "supervisor"
        ));
        assert!(!names_service(
            "spiffe://convene.local/worker",
            "supervisor"
        ));
        assert!(!names_service(
            "spiffe://convene.local/supervisor/x",
            "supervisor"
        ));
        assert!(!names_service("spiffe:///supervisor", "supervisor"));
        assert!(!names_service(
            "https://convene.local/supervisor",
            "supervisor"
        ));
        // Without a certificate the caller's principal decides: a person is not the
        // supervisor, whatever roles it holds.
        let auth = act_as_policy();
        let person = Caller::Principal(Arc::new(
            auth.policy().principal("oncall@acme").unwrap().clone(),
        ));
        let refused = require_peer_service(
            &Request::new(()),
            &person,
            MeshService::Supervisor,
            "issue tokens",
        )
        .unwrap_err();
        assert_eq!(refused.code(), tonic::Code::PermissionDenied);
        assert!(
            refused.message().contains("service principal"),
            "{refused:?}"
        );
    }

    /// A console that may act for the people of `acme`, people of two tenants, a
    /// service, a second act-as holder and a person holding a service role.
    fn act_as_policy() -> Authenticator {
        use crate::policy_file::{PolicyFile, credential_hash};
        let yaml = format!(
            "principals:\n\
             - {{ id: console, tenant: system, kind: service, roles: [principals:act-as], act_as: {{ tenants: [acme] }}, credential_sha256: [{}] }}\n\
             - {{ id: oncall@acme, tenant: acme, kind: human, roles: [runs:read], credential_sha256: [{}] }}\n\
             - {{ id: analyst@globex, tenant: globex, kind: human, roles: [runs:read] }}\n\
             - {{ id: worker-pool, tenant: system, kind: service, roles: [workers:register], credential_sha256: [{}] }}\n\
             - {{ id: supervisor, tenant: system, kind: service, roles: [tokens:issue] }}\n\
             - {{ id: other-console, tenant: acme, kind: human, roles: [principals:act-as], act_as: {{ tenants: [acme] }} }}\n\
             - {{ id: issuer@acme, tenant: acme, kind: human, roles: [tokens:issue] }}\n",
            credential_hash("console-secret"),
            credential_hash("oncall-secret"),
            credential_hash("pool-secret"),
        );
        let policy = PolicyFile::parse(&yaml, Some("yaml"), "test")
            .unwrap()
            .compile("test")
            .unwrap();
        Authenticator::principals_only(Arc::new(policy))
    }

    fn acting(credential: &str, for_principal: &str) -> Request<()> {
        let mut r = request((), credential);
        r.metadata_mut()
            .insert(ACT_AS, for_principal.parse().unwrap());
        r
    }

    #[tokio::test]
    async fn only_a_principal_holding_act_as_may_act_for_another() {
        let auth = act_as_policy();
        // The console acting for a person is that person, tenant and roles.
        let caller = auth
            .authenticate(&acting("console-secret", "oncall@acme"))
            .await
            .unwrap();
        assert_eq!(caller.principal_id(), "oncall@acme");
        assert_eq!(caller.tenant(), "acme");
        assert!(caller.require_role("runs:read", "read runs").is_ok());
        // Without the header it is itself.
        let itself = auth
            .authenticate(&request((), "console-secret"))
            .await
            .unwrap();
        assert_eq!(itself.principal_id(), "console");

        // Anyone else sending the header is refused, naming the role.
        for credential in ["oncall-secret", "pool-secret"] {
            let refused = auth
                .authenticate(&acting(credential, "console"))
                .await
                .unwrap_err();
            assert_eq!(refused.code(), tonic::Code::PermissionDenied);
            assert!(refused.message().contains(ACT_AS_ROLE), "{refused:?}");
        }
        // An unknown principal is not made up.
        let unknown = auth
            .authenticate(&acting("console-secret", "mallory@acme"))
            .await
            .unwrap_err();
        assert_eq!(unknown.code(), tonic::Code::Unauthenticated);
        // And the credential still has to be right.
        let wrong = auth
            .authenticate(&acting("not-a-secret", "oncall@acme"))
            .await
            .unwrap_err();
        assert_eq!(wrong.code(), tonic::Code::Unauthenticated);
    }

    #[tokio::test]
    async fn act_as_reaches_only_people_of_the_listed_tenants_and_never_a_service() {
        let auth = act_as_policy();
        for (target, why) in [
            ("supervisor", "kind: human"),
            ("worker-pool", "kind: human"),
            ("console", "kind: human"),
            ("analyst@globex", "act_as.tenants"),
            ("other-console", ACT_AS_ROLE),
            ("issuer@acme", "tokens:issue"),
        ] {
            let refused = auth
                .authenticate(&acting("console-secret", target))
                .await
                .unwrap_err();
            assert_eq!(refused.code(), tonic::Code::PermissionDenied, "{target}");
            assert!(
                refused.message().contains(why) && refused.message().contains(target),
                "acting for {target}: {refused:?}"
            );
        }
    }

    #[tokio::test]
    async fn an_acted_call_names_both_principals_on_its_span() {
        use opentelemetry::Value;
        let auth = act_as_policy();
        let capture = convene_telemetry::test_util::Capture::new();
        {
            let _default = capture.set_default();
            let span = tracing::info_span!("convene.test.call");
            let request = acting("console-secret", "oncall@acme");
            let caller = tracing::Instrument::instrument(auth.authenticate(&request), span)
                .await
                .unwrap();
            assert_eq!(caller.principal_id(), "oncall@acme");
        }
        let spans = capture.spans();
        let call = spans
            .iter()
            .find(|s| s.name == "convene.test.call")
            .expect("the call's span");
        let event = call
            .events
            .iter()
            .find(|e| e.name.contains("acting for"))
            .unwrap_or_else(|| panic!("no act-as event on {:?}", call.events));
        let attr = |key: &str| {
            event
                .attributes
                .iter()
                .find(|kv| kv.key.as_str() == key)
                .map(|kv| kv.value.clone())
        };
        assert_eq!(
            attr("convene.principal.actor"),
            Some(Value::from("console"))
        );
        assert_eq!(
            attr("convene.principal.id"),
            Some(Value::from("oncall@acme"))
        );
        assert!(event.name.contains("console") && event.name.contains("oncall@acme"));
    }

    #[test]
    fn bearer_extraction_says_what_is_wrong() {
        let r = Request::new(());
        assert!(bearer(&r).unwrap_err().message().contains("missing"));
        let r = request((), "abc");
        assert_eq!(bearer(&r).unwrap(), "abc");
        assert!(
            r.metadata().get(AUTHORIZATION).unwrap().is_sensitive(),
            "a credential must never enter HPACK's tables"
        );
        let mut r = Request::new(());
        r.metadata_mut()
            .insert(AUTHORIZATION, "Basic xyz".parse().unwrap());
        assert!(bearer(&r).unwrap_err().message().contains("Bearer"));
    }

    #[test]
    fn token_shape() {
        assert!(looks_like_token("eyJhbGciOi.eyJzdWIi.c2ln"));
        assert!(!looks_like_token("cvn_secret"));
    }
}
