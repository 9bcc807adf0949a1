//! Who is calling.
//!
//! Every RPC carries `authorization: Bearer <credential>`. A credential is either a
//! principal's secret (its SHA-256 is listed in the policy file) or a task token (a JWS
//! signed by the policy service, verified offline against its public keys). Tenant and
//! identity come from here, never from a request message.

use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant, SystemTime};

use convene_proto::v1;
use convene_tokens::{Claims, TokenError, Verifier};
use tonic::{Request, Status};

use crate::handles::PolicyHandle;
use crate::policy_file::{Policy, Principal};

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

/// The policy service's public keys, fetched through a policy handle and refreshed when
/// a token names a key id not seen yet (key rotation), at most once per `min_refresh`.
pub struct TokenKeys {
    policy: PolicyHandle,
    verifier: RwLock<Option<Arc<Verifier>>>,
    last_refresh: RwLock<Option<Instant>>,
    min_refresh: Duration,
}

impl std::fmt::Debug for TokenKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenKeys").finish_non_exhaustive()
    }
}

impl TokenKeys {
    /// Keys fetched lazily from `policy`.
    pub fn new(policy: PolicyHandle) -> Self {
        Self {
            policy,
            verifier: RwLock::new(None),
            last_refresh: RwLock::new(None),
            min_refresh: Duration::from_secs(1),
        }
    }

    async fn refresh(&self) -> Result<Arc<Verifier>, Status> {
        let keys = self
            .policy
            .get_signing_keys(Request::new(v1::GetSigningKeysRequest {}))
            .await
            .map_err(|s| {
                Status::unavailable(format!(
                    "cannot fetch signing keys from the policy service: {}",
                    s.message()
                ))
            })?
            .into_inner()
            .keys;
        let verifier = Arc::new(Verifier::from_jwks(&keys).map_err(|e| {
            Status::internal(format!("policy service returned unusable keys: {e}"))
        })?);
        *self.verifier.write().expect("lock poisoned") = Some(verifier.clone());
        *self.last_refresh.write().expect("lock poisoned") = Some(Instant::now());
        Ok(verifier)
    }

    fn current(&self) -> Option<Arc<Verifier>> {
        self.verifier.read().expect("lock poisoned").clone()
    }

    /// Verifies a token at `now`, refreshing the keys once if its key id is unknown.
    pub async fn verify(&self, token: &str, now: SystemTime) -> Result<Claims, Status> {
        let verifier = match self.current() {
            Some(v) => v,
            None => self.refresh().await?,
        };
        match verifier.verify(token, now) {
            Err(TokenError::UnknownKey { .. }) => {
                let recently = self
                    .last_refresh
                    .read()
                    .expect("lock poisoned")
                    .is_some_and(|t| t.elapsed() < self.min_refresh);
                if recently {
                    return verifier.verify(token, now).map_err(|e| token_status(&e));
                }
                self.refresh()
                    .await?
                    .verify(token, now)
                    .map_err(|e| token_status(&e))
            }
            other => other.map_err(|e| token_status(&e)),
        }
    }
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
        acting_for
            .to_str()
            .ok()
            .and_then(|id| self.policy.principal(id))
            .map(|p| Caller::Principal(Arc::new(p.clone())))
            .ok_or_else(|| {
                Status::unauthenticated(format!("{ACT_AS} names no principal of the policy file"))
            })
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

/// Under mutual TLS, the call must come from `service`: its client certificate must name
/// it (URI SAN `spiffe://<trust domain>/<service>`), else PERMISSION_DENIED naming what
/// it presented. Calls without a client certificate (plaintext on loopback, in-process)
/// are left to the credential checks, as before.
pub fn require_peer_service<T>(
    request: &Request<T>,
    service: &str,
    what: &str,
) -> Result<(), Status> {
    if request.peer_certs().is_none_or(|c| c.is_empty()) {
        return Ok(());
    }
    let identities = peer_identities(request);
    if identities.iter().any(|id| names_service(id, service)) {
        return Ok(());
    }
    Err(Status::permission_denied(format!(
        "only the {service} may {what}: the client certificate names {}, not spiffe://<trust domain>/{service}",
        if identities.is_empty() {
            "no spiffe:// identity".to_owned()
        } else {
            identities.join(", ")
        }
    )))
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
        // No certificate: nothing to check here.
        assert!(require_peer_service(&Request::new(()), "supervisor", "issue tokens").is_ok());
    }

    /// Three principals: a console that may act for others, a person, and a service
    /// that may not.
    fn act_as_policy() -> Authenticator {
        use crate::policy_file::{PolicyFile, credential_hash};
        let yaml = format!(
            "principals:\n\
             - {{ id: console, tenant: system, kind: service, roles: [principals:act-as], credential_sha256: [{}] }}\n\
             - {{ id: oncall@acme, tenant: acme, kind: human, roles: [runs:read], credential_sha256: [{}] }}\n\
             - {{ id: worker-pool, tenant: system, kind: service, roles: [workers:register], credential_sha256: [{}] }}\n",
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
