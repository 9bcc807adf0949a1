//! Signing and verifying task tokens: JWTs signed with EdDSA over Ed25519 (RFC 8037).
//!
//! Only one algorithm exists here, so the verifier refuses every other `alg` before it
//! looks at a key: there is no way to make it check an HMAC with a public key or accept
//! `none`. `jsonwebtoken` reads the header; the shape and encoding are checked here, the
//! signature by `ed25519-dalek` against the trusted key decompressed once (with the same
//! check `jsonwebtoken` makes, which would decompress the key for every token), then the
//! claims' JSON. The validity window is checked here against an explicit `now` (and the
//! audience by [`Claims::check_audience`]), so callers and tests decide the clock and
//! every refusal names its exact reason.

use std::sync::{Arc, LazyLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use convene_core::recent::RecentMap;
use convene_proto::v1;
use ed25519_dalek::{Signature, Signer as _, Verifier as _, VerifyingKey};
use jsonwebtoken::errors::ErrorKind;
use jsonwebtoken::{Algorithm, Header};
use serde::Deserialize;

use crate::keys::{ALG, CRV, KTY, USE, thumbprint};
use crate::{Claims, Error, SigningKey, TokenError};

/// Longest token the verifier looks at. Real tokens are a few KiB; the cap bounds the
/// work an unauthenticated caller can cause.
pub const MAX_TOKEN_LEN: usize = 64 * 1024;

/// Longest encoded header accepted; ours is about 110 characters.
const MAX_HEADER_LEN: usize = 640;

/// Encoded length of a 64-byte Ed25519 signature in base64url without padding.
const SIGNATURE_B64_LEN: usize = 86;

/// Signs task tokens with one key.
///
/// The token is the compact JWS `jsonwebtoken::encode` makes (the same header and claims
/// JSON, base64url without padding), signed with the Ed25519 key directly: its encoder
/// rebuilds the key from the seed for every token, deriving the public key each time,
/// which cost as much as the signature itself.
#[derive(Debug, Clone)]
pub struct Signer {
    key: SigningKey,
    /// The encoded header, `alg` EdDSA, `typ` JWT and the key's `kid`: the same for
    /// every token.
    header: Box<str>,
    public: [u8; 32],
}

impl Signer {
    /// A signer for `key`; tokens name its kid in the header.
    pub fn new(key: SigningKey) -> Self {
        let mut header = Header::new(Algorithm::EdDSA);
        header.typ = Some("JWT".to_owned());
        header.kid = Some(key.kid().to_owned());
        let json = serde_json::to_vec(&header).expect("a JWT header always encodes as JSON");
        Self {
            public: key.verifying_key().to_bytes(),
            header: URL_SAFE_NO_PAD.encode(json).into(),
            key,
        }
    }

    /// The id of the signing key.
    pub fn kid(&self) -> &str {
        self.key.kid()
    }

    /// The signing key.
    pub fn key(&self) -> &SigningKey {
        &self.key
    }

    /// The compact JWS of `claims`: `header.payload.signature`.
    ///
    /// The token is remembered as verified for every [`Verifier`] of this process that
    /// trusts this key (see [`Verifier::verify`]): presenting it later costs no signature
    /// check.
    pub fn sign(&self, claims: &Claims) -> Result<String, Error> {
        let payload = serde_json::to_vec(claims)
            .map_err(|e| Error::Sign(jsonwebtoken::errors::Error::from(e)))?;
        let mut token = String::with_capacity(self.header.len() + payload.len() * 4 / 3 + 90);
        token.push_str(&self.header);
        token.push('.');
        URL_SAFE_NO_PAD.encode_string(&payload, &mut token);
        let signature = self.key.dalek().sign(token.as_bytes());
        token.push('.');
        URL_SAFE_NO_PAD.encode_string(signature.to_bytes(), &mut token);
        let _ = VERIFIED.insert(&token, claims, self.key.kid(), self.public);
        Ok(token)
    }
}

/// Verifies task tokens offline against a set of public keys.
///
/// Holding several keys at once is what makes rotation seamless: tokens signed by the
/// previous key stay valid until it is retired from the set.
#[derive(Debug, Clone)]
pub struct Verifier {
    /// Few keys (one or two, three during a rotation overlap), so a linear scan beats a
    /// hash map. Each is parsed and checked once here rather than per token.
    keys: Vec<TrustedKey>,
    leeway: Duration,
}

#[derive(Debug, Clone)]
struct TrustedKey {
    kid: Box<str>,
    /// The public key, to tell the same key listed twice from two keys under one kid.
    public: [u8; 32],
    /// The key as a curve point, decompressed once.
    verifying: VerifyingKey,
}

impl TrustedKey {
    fn new(kid: Box<str>, public: &VerifyingKey) -> Self {
        Self {
            kid,
            public: public.to_bytes(),
            verifying: *public,
        }
    }
}

impl Default for Verifier {
    /// A verifier that trusts no key: every token is refused as
    /// [`TokenError::UnknownKey`].
    fn default() -> Self {
        Self::with_keys(Vec::new())
    }
}

impl Verifier {
    fn with_keys(keys: Vec<TrustedKey>) -> Self {
        Self {
            keys,
            leeway: Duration::ZERO,
        }
    }

    /// A verifier trusting these public keys (as served by `GetSigningKeys`).
    ///
    /// Refuses any key that is not an Ed25519 signing key, naming it; a key without a
    /// `kid` gets its RFC 7638 thumbprint. An empty list is allowed and verifies nothing.
    pub fn from_jwks(jwks: &[v1::Jwk]) -> Result<Self, Error> {
        let mut keys: Vec<TrustedKey> = Vec::with_capacity(jwks.len());
        for (index, jwk) in jwks.iter().enumerate() {
            let unsupported = |detail: String| Error::UnsupportedKey {
                index,
                kid: jwk.kid.clone(),
                detail,
            };
            if jwk.kty != KTY || jwk.crv != CRV {
                return Err(unsupported(format!(
                    "kty `{}` crv `{}` is not an Ed25519 key; task tokens are verified with kty `{KTY}` crv `{CRV}` keys only",
                    jwk.kty, jwk.crv
                )));
            }
            if !(jwk.alg.is_empty() || jwk.alg == ALG) {
                return Err(unsupported(format!("alg `{}` is not `{ALG}`", jwk.alg)));
            }
            if !(jwk.r#use.is_empty() || jwk.r#use == USE) {
                return Err(unsupported(format!("use `{}` is not `{USE}`", jwk.r#use)));
            }
            let mut x = [0u8; 32];
            match URL_SAFE_NO_PAD.decode_slice(&jwk.x, &mut x) {
                Ok(32) => {}
                _ => {
                    return Err(unsupported(
                        "`x` is not a 32-byte base64url (no padding) public key".to_owned(),
                    ));
                }
            }
            // jsonwebtoken would take any 32 bytes and fail on every token later; a
            // small-order (weak) key would accept forged signatures. Both are refused
            // here, where the operator can see which key it is.
            let key = VerifyingKey::from_bytes(&x)
                .ok()
                .filter(|k| !k.is_weak())
                .ok_or_else(|| unsupported("`x` is not a valid Ed25519 public key".to_owned()))?;
            let kid: Box<str> = if jwk.kid.is_empty() {
                thumbprint(&jwk.x).into()
            } else {
                jwk.kid.as_str().into()
            };
            match keys.iter().find(|k| k.kid == kid) {
                Some(existing) if existing.public == x => {}
                Some(_) => {
                    return Err(unsupported(
                        "another key in the set has the same kid; every kid must name one key"
                            .to_owned(),
                    ));
                }
                None => keys.push(TrustedKey::new(kid, &key)),
            }
        }
        Ok(Self::with_keys(keys))
    }

    /// A verifier trusting the public halves of `keys`.
    pub fn from_signing_keys<'a>(keys: impl IntoIterator<Item = &'a SigningKey>) -> Self {
        Self::with_keys(
            keys.into_iter()
                .map(|k| TrustedKey::new(k.kid().into(), &k.verifying_key()))
                .collect(),
        )
    }

    /// The same verifier tolerating clock skew of `leeway` on `nbf` and `exp` (default
    /// none).
    #[must_use]
    pub fn with_leeway(mut self, leeway: Duration) -> Self {
        self.leeway = leeway;
        self
    }

    /// The ids of the trusted keys.
    pub fn kids(&self) -> impl Iterator<Item = &str> {
        self.keys.iter().map(|k| &*k.kid)
    }

    /// Verifies `token` at `now` and returns its claims.
    ///
    /// Checks, in order: three parts and a JSON header ([`TokenError::Malformed`]), `alg`
    /// is EdDSA ([`TokenError::UnsupportedAlgorithm`]), the rest of the header and the
    /// encoding of signature and payload ([`TokenError::Malformed`]), `kid` is known
    /// ([`TokenError::UnknownKey`]), the signature ([`TokenError::BadSignature`]), the
    /// claims parse ([`TokenError::Malformed`]), `nbf <= now + leeway`
    /// ([`TokenError::NotYetValid`]), `now < exp + leeway` ([`TokenError::Expired`]).
    /// Claims are parsed only once the signature holds, so no unauthenticated payload
    /// is ever deserialized.
    /// The audience depends on who presents the token: see [`Claims::check_audience`].
    ///
    /// `jsonwebtoken` reads the header and checks the signature; its own time checks
    /// are off because they read the system clock, round `now` to whole seconds and
    /// treat the `exp` second itself as still valid.
    ///
    /// A task token is presented many times (every tool call, every evidence write), to
    /// several services, which in one process share what was checked: the process keeps
    /// the claims of every token it verified or signed ([`Signer::sign`]), with the key
    /// (kid and public key) whose signature holds. A verifier that trusts that very key
    /// repeats only the time checks; the token's bytes cannot change without failing
    /// the lookup, and a verifier that does not trust the key checks it in full.
    pub fn verify(&self, token: &str, now: SystemTime) -> Result<Claims, TokenError> {
        self.accept(token, now).map(|accepted| accepted.claims)
    }

    /// [`Self::verify`], returning with the claims what a holder needs to check them
    /// again later without the token: the id of the key whose signature held and the
    /// token's revocation keys, all remembered with the claims, so nothing is hashed
    /// or parsed again for a token this process has seen.
    pub fn accept(&self, token: &str, now: SystemTime) -> Result<Accepted, TokenError> {
        let remembered = VERIFIED.get(token, |kid, public| {
            self.keys
                .iter()
                .any(|k| *k.kid == *kid && k.public == *public)
        });
        let accepted = match remembered {
            Some(accepted) => accepted,
            None => {
                let (claims, key) = self.verify_signature(token)?;
                VERIFIED.insert(token, &claims, &key.kid, key.public)
            }
        };
        self.check_times(&accepted.claims, now)?;
        Ok(accepted)
    }

    /// The time checks of [`Self::verify`] alone, for claims it accepted earlier:
    /// `nbf <= now + leeway` ([`TokenError::NotYetValid`]) and `now < exp + leeway`
    /// ([`TokenError::Expired`]).
    pub fn check_times(&self, claims: &Claims, now: SystemTime) -> Result<(), TokenError> {
        let now = now.duration_since(UNIX_EPOCH).unwrap_or(Duration::ZERO);
        if now.saturating_add(self.leeway) < Duration::from_secs(claims.not_before) {
            return Err(TokenError::NotYetValid {
                not_before: claims.not_before,
            });
        }
        if now >= Duration::from_secs(claims.expires_at).saturating_add(self.leeway) {
            return Err(TokenError::Expired {
                expired_at: claims.expires_at,
            });
        }
        Ok(())
    }

    /// Whether this verifier trusts the key named `kid` (a token it accepted earlier
    /// under that key is still good for it only while it does).
    pub fn trusts(&self, kid: &str) -> bool {
        self.keys.iter().any(|k| *k.kid == *kid)
    }

    /// Everything but the time checks: structure, algorithm, key, signature, claims; the
    /// claims and the key whose signature holds.
    fn verify_signature(&self, token: &str) -> Result<(Claims, &TrustedKey), TokenError> {
        #[cfg(test)]
        cache_tests::FULL_CHECKS.with(|n| n.set(n.get() + 1));
        if token.len() > MAX_TOKEN_LEN {
            return Err(TokenError::malformed(format!(
                "it is {} bytes long, more than the {MAX_TOKEN_LEN} bytes a task token can have",
                token.len()
            )));
        }
        // jsonwebtoken splits from the right and so reads `a.b.c.d` as header `a.b`;
        // splitting here first says what is wrong with the shape.
        let (header_b64, rest) = token
            .split_once('.')
            .ok_or_else(|| TokenError::malformed("it has no `.` separators"))?;
        let (payload_b64, signature_b64) = rest
            .split_once('.')
            .ok_or_else(|| TokenError::malformed("it has one `.` separator instead of two"))?;
        if signature_b64.contains('.') {
            return Err(TokenError::malformed(
                "it has more than two `.` separators (JWE and JSON serialization are not accepted)",
            ));
        }
        if header_b64.len() > MAX_HEADER_LEN {
            return Err(TokenError::malformed("its header is too long"));
        }

        let header = match jsonwebtoken::decode_header(token) {
            Ok(header) if header.alg == Algorithm::EdDSA => header,
            // Before anything else about the header: `none` or HMAC tokens get the
            // message that says why, not one about their (absent or odd-sized) signature.
            // jsonwebtoken's algorithm names are the JOSE names, spelled as its variants.
            Ok(header) => {
                return Err(TokenError::UnsupportedAlgorithm {
                    alg: format!("{:?}", header.alg),
                });
            }
            Err(e) => return Err(refused_header(header_b64, e)),
        };
        if header.crit.is_some() {
            return Err(TokenError::malformed(
                "header has `crit` extensions, which task tokens never use",
            ));
        }
        if let Some(typ) = &header.typ
            && !typ.eq_ignore_ascii_case("JWT")
        {
            return Err(TokenError::malformed(format!(
                "header typ is `{typ}`, not `JWT`"
            )));
        }
        // jsonwebtoken refuses an unencoded payload (RFC 7797 `b64` other than true), but
        // only once the key is found; refusing it with the rest of the header keeps the
        // reason independent of the kid.
        if header
            .extras
            .inner()
            .get("b64")
            .is_some_and(|b64| *b64 != serde_json::Value::Bool(true))
        {
            return Err(TokenError::malformed(
                "header has `b64` other than true; task tokens never have an unencoded payload",
            ));
        }

        // jsonwebtoken decodes signature and payload as strictly (no padding, no set
        // trailing bits), but only after the key lookup, and without saying which part
        // failed. Checking the encoding here keeps it ahead of the kid and names the part.
        let mut signature = [0u8; 64];
        if !(signature_b64.len() == SIGNATURE_B64_LEN
            && URL_SAFE_NO_PAD
                .decode_slice(signature_b64, &mut signature)
                .is_ok_and(|n| n == 64))
        {
            return Err(TokenError::malformed(
                "signature is not a 64-byte base64url (no padding) value",
            ));
        }
        check_base64url(payload_b64)
            .map_err(|e| TokenError::malformed(format!("payload is not base64url: {e}")))?;

        let kid = header
            .kid
            .ok_or_else(|| TokenError::malformed("header has no `kid`"))?;
        let key = self
            .keys
            .iter()
            .find(|k| *k.kid == *kid)
            .ok_or_else(|| TokenError::UnknownKey { kid: kid.clone() })?;
        // The signed message is the header and payload as they appear in the token;
        // `verify` is the check `jsonwebtoken` makes (RFC 8032, canonical `s`).
        let message = &token[..header_b64.len() + 1 + payload_b64.len()];
        key.verifying
            .verify(message.as_bytes(), &Signature::from_bytes(&signature))
            .map_err(|_| TokenError::BadSignature { kid })?;
        // Only a payload whose signature holds is decoded.
        let json = URL_SAFE_NO_PAD
            .decode(payload_b64)
            .map_err(|e| TokenError::malformed(format!("payload is not base64url: {e}")))?;
        let claims = serde_json::from_slice::<Claims>(&json)
            .map_err(|e| TokenError::malformed(format!("claims are not the expected JSON: {e}")))?;
        Ok((claims, key))
    }
}

/// The tokens this process verified or signed: see [`Verifier::verify`].
static VERIFIED: LazyLock<VerifiedTokens> = LazyLock::new(VerifiedTokens::default);

/// A bounded set of tokens whose signature holds, with their claims and the key that
/// signed them. A token is known by its exact bytes: a lookup hashes it with the map's
/// keyed hash and compares it whole, so a token that differs in any byte misses, and no
/// digest is computed per lookup (a full set holds a few thousand tokens, each near a
/// kilobyte, about as much again as their claims). The tokens of runs in flight stay as
/// long as they are used; the others go a generation at a time, off the lock
/// ([`RecentMap`]).
#[derive(Debug)]
struct VerifiedTokens {
    map: RecentMap<Box<str>, Verified>,
}

impl Default for VerifiedTokens {
    fn default() -> Self {
        Self {
            map: RecentMap::new(Self::CAPACITY),
        }
    }
}

#[derive(Debug)]
struct Verified {
    claims: Claims,
    kid: Arc<str>,
    revocation: Revocation,
    public: [u8; 32],
}

/// A token the process accepted ([`Verifier::accept`]): its claims, the id of the key
/// whose signature holds, and the keys under which its revocation would be listed.
#[derive(Debug, Clone)]
pub struct Accepted {
    pub claims: Claims,
    pub kid: Arc<str>,
    pub revocation: Revocation,
}

/// The digests under which the policy service lists a token's revocation and its
/// run's: SHA-256 of `token:<jti>` and of `run:<run id>`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Revocation {
    pub token: [u8; 32],
    pub run: [u8; 32],
}

impl Revocation {
    /// The revocation keys of a token with `claims`.
    pub fn of(claims: &Claims) -> Self {
        Self {
            token: revoked_token_digest(&claims.token_id),
            run: revoked_run_digest(&claims.run_id),
        }
    }
}

/// The digest under which a revoked token is listed: SHA-256 of `token:<jti>`.
pub fn revoked_token_digest(token_id: &str) -> [u8; 32] {
    use sha2::Digest as _;
    sha2::Sha256::new()
        .chain_update(b"token:")
        .chain_update(token_id.as_bytes())
        .finalize()
        .into()
}

/// The digest under which a revoked run is listed: SHA-256 of `run:<run id>`.
pub fn revoked_run_digest(run_id: &str) -> [u8; 32] {
    use sha2::Digest as _;
    sha2::Sha256::new()
        .chain_update(b"run:")
        .chain_update(run_id.as_bytes())
        .finalize()
        .into()
}

impl VerifiedTokens {
    /// Entries kept at most; tokens live minutes, and a run's are used within seconds.
    const CAPACITY: usize = 16_384;

    /// What was accepted of `token`, if it is here and `trusted` accepts the key that
    /// signed it.
    fn get(&self, token: &str, trusted: impl Fn(&str, &[u8; 32]) -> bool) -> Option<Accepted> {
        self.map
            .get_with(token, |entry| {
                trusted(&entry.kid, &entry.public).then(|| Accepted {
                    claims: entry.claims.clone(),
                    kid: entry.kid.clone(),
                    revocation: entry.revocation,
                })
            })
            .flatten()
    }

    /// Remembers `token` as signed by `kid` (public key `public`), and returns what a
    /// lookup of it would.
    fn insert(&self, token: &str, claims: &Claims, kid: &str, public: [u8; 32]) -> Accepted {
        let accepted = Accepted {
            claims: claims.clone(),
            kid: kid.into(),
            revocation: Revocation::of(claims),
        };
        let entry = Verified {
            claims: claims.clone(),
            kid: accepted.kid.clone(),
            revocation: accepted.revocation,
            public,
        };
        self.map.insert(token.into(), entry);
        accepted
    }
}

/// Why a header `jsonwebtoken::decode_header` could not read is refused.
///
/// jsonwebtoken parses `alg` into the algorithms it knows, so `none` or `eddsa` fail as
/// JSON there; the `alg` string is read again here to refuse those as unsupported
/// algorithms rather than as malformed headers.
fn refused_header(header_b64: &str, error: jsonwebtoken::errors::Error) -> TokenError {
    #[derive(Deserialize)]
    struct AlgOnly {
        alg: String,
    }
    match error.kind() {
        ErrorKind::Base64(e) => TokenError::malformed(format!("header is not base64url: {e}")),
        ErrorKind::Json(e) => {
            let alg = URL_SAFE_NO_PAD
                .decode(header_b64)
                .ok()
                .and_then(|json| serde_json::from_slice::<AlgOnly>(&json).ok())
                .map(|h| h.alg);
            match alg {
                Some(alg) if alg != ALG => TokenError::UnsupportedAlgorithm { alg },
                _ => TokenError::malformed(format!("header is not the expected JSON: {e}")),
            }
        }
        _ => TokenError::malformed(format!("header is not readable: {error}")),
    }
}

/// Checks that `part` is base64url without padding or set trailing bits, as the decoder
/// will, without allocating: whole 4-character groups decode independently, so the part
/// is decoded a slice at a time into a small buffer.
fn check_base64url(part: &str) -> Result<(), String> {
    use base64::{DecodeError, DecodeSliceError};
    const CHUNK: usize = 512;
    let mut buf = [0u8; CHUNK / 4 * 3];
    for (i, chunk) in part.as_bytes().chunks(CHUNK).enumerate() {
        let start = i * CHUNK;
        match URL_SAFE_NO_PAD.decode_slice(chunk, &mut buf) {
            Ok(_) => {}
            // Offsets made relative to the whole part, so the message points at the byte.
            Err(DecodeSliceError::DecodeError(e)) => {
                let e = match e {
                    DecodeError::InvalidByte(at, byte) => {
                        DecodeError::InvalidByte(start + at, byte)
                    }
                    DecodeError::InvalidLastSymbol(at, byte) => {
                        DecodeError::InvalidLastSymbol(start + at, byte)
                    }
                    other => other,
                };
                return Err(e.to_string());
            }
            Err(e @ DecodeSliceError::OutputSliceTooSmall) => return Err(e.to_string()),
        }
    }
    Ok(())
}

#[cfg(test)]
mod cache_tests {
    use super::*;
    use crate::SigningKey;

    fn claims(now: u64) -> Claims {
        serde_json::from_value(serde_json::json!({
            "iss": "convene-policy", "sub": "p", "aud": ["a"], "iat": now, "nbf": now,
            "exp": now + 60, "jti": "t", "tenant": "x", "run": "r", "del": "d",
            "prof": "p", "depth": 1, "scp": [], "tools": [], "max_calls": 1, "redeleg": false
        }))
        .expect("claims")
    }

    /// A verifier, the signer whose key it trusts, and a token that signer signed,
    /// valid for a minute from `NOW`.
    fn signed() -> (Verifier, Signer, String) {
        let key = SigningKey::generate().expect("key");
        let verifier = Verifier::from_signing_keys([&key]);
        let signer = Signer::new(key);
        let token = signer.sign(&claims(NOW)).expect("signed");
        (verifier, signer, token)
    }

    const NOW: u64 = 2_000_000_000;

    fn at(s: u64) -> SystemTime {
        UNIX_EPOCH + Duration::from_secs(s)
    }

    #[test]
    fn a_remembered_token_still_expires_and_other_bytes_are_still_checked() {
        let (verifier, _, token) = signed();
        let now = NOW;
        assert!(verifier.verify(&token, at(now + 1)).is_ok());
        // Second time from the cache: time checks still apply.
        assert!(matches!(
            verifier.verify(&token, at(now + 60)),
            Err(TokenError::Expired { .. })
        ));
        assert!(matches!(
            verifier.verify(&token, at(now - 1)),
            Err(TokenError::NotYetValid { .. })
        ));
        // A tampered copy is not the cached token: it goes through the full check.
        let mut bytes = token.clone().into_bytes();
        let last = bytes.len() - 2;
        bytes[last] = if bytes[last] == b'A' { b'B' } else { b'A' };
        let tampered = String::from_utf8(bytes).expect("ascii");
        assert!(verifier.verify(&tampered, at(now + 1)).is_err());
        // A verifier with other keys shares nothing with this one.
        let other = Verifier::from_signing_keys([&SigningKey::generate().expect("key")]);
        assert!(matches!(
            other.verify(&token, at(now + 1)),
            Err(TokenError::UnknownKey { .. })
        ));
    }

    #[test]
    fn accepted_claims_are_checked_again_for_their_key_and_times_without_the_token() {
        let (verifier, signer, token) = signed();
        let now = NOW;
        let Accepted {
            claims: accepted,
            kid,
            revocation,
        } = verifier.accept(&token, at(now + 1)).expect("verified");
        assert_eq!(&*kid, signer.kid());
        assert!(verifier.trusts(&kid));
        // The revocation keys are those the policy service lists: SHA-256 of
        // `token:<jti>` and `run:<run id>`.
        use sha2::Digest as _;
        let listed = |s: String| -> [u8; 32] { sha2::Sha256::digest(s).into() };
        assert_eq!(
            revocation.token,
            listed(format!("token:{}", accepted.token_id))
        );
        assert_eq!(revocation.run, listed(format!("run:{}", accepted.run_id)));
        // A second acceptance (remembered, not checked again) says the same.
        let again = verifier.accept(&token, at(now + 2)).expect("verified");
        assert_eq!((&*again.kid, again.revocation), (&*kid, revocation));
        assert!(verifier.check_times(&accepted, at(now + 59)).is_ok());
        assert!(matches!(
            verifier.check_times(&accepted, at(now + 60)),
            Err(TokenError::Expired { .. })
        ));
        assert!(matches!(
            verifier.check_times(&accepted, at(now - 1)),
            Err(TokenError::NotYetValid { .. })
        ));
        // Once its key is no longer listed, the key is not trusted.
        let rotated = Verifier::from_signing_keys([&SigningKey::generate().expect("key")]);
        assert!(!rotated.trusts(&kid));
    }

    thread_local! {
        /// Full checks (structure and signature) made on this thread.
        pub(super) static FULL_CHECKS: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
    }

    fn full_checks() -> usize {
        FULL_CHECKS.with(std::cell::Cell::get)
    }

    #[test]
    fn what_one_verifier_checked_serves_every_verifier_of_the_same_key_only() {
        let key = SigningKey::generate().expect("key");
        let now = 2_000_000_000;
        let at = |s: u64| UNIX_EPOCH + Duration::from_secs(s);
        // Signed elsewhere (not by a Signer of this process): the first verifier checks it.
        let mut claims = claims(now);
        claims.token_id = "shared".into();
        let token = super::tests::forge(
            &serde_json::json!({"alg": "EdDSA", "typ": "JWT", "kid": key.kid()}),
            &claims,
            &key,
        );
        let first = Verifier::from_signing_keys([&key]);
        let before = full_checks();
        assert_eq!(first.verify(&token, at(now + 1)).expect("valid"), claims);
        assert_eq!(full_checks(), before + 1);
        // Another verifier of the same key (another service of the process) does not
        // check it again, and still applies its own time checks.
        let second = Verifier::from_jwks(&[key.public_jwk()]).expect("jwks");
        assert_eq!(second.verify(&token, at(now + 2)).expect("valid"), claims);
        assert!(matches!(
            second.verify(&token, at(now + 60)),
            Err(TokenError::Expired { .. })
        ));
        assert_eq!(full_checks(), before + 1);
        // A verifier trusting another key under the same kid checks it in full and
        // refuses it: what was checked is bound to the key that checked it.
        let impostor = SigningKey::generate().expect("key");
        let mut jwk = impostor.public_jwk();
        jwk.kid = key.kid().to_owned();
        let third = Verifier::from_jwks(&[jwk]).expect("jwks");
        assert!(matches!(
            third.verify(&token, at(now + 1)),
            Err(TokenError::BadSignature { .. })
        ));
        assert_eq!(full_checks(), before + 2);
        // A token this process signs needs no check by any verifier of its key.
        // The very token jsonwebtoken's encoder makes (Ed25519 signatures are
        // deterministic).
        let signed = Signer::new(key.clone()).sign(&claims).expect("signed");
        let mut header = Header::new(Algorithm::EdDSA);
        header.typ = Some("JWT".to_owned());
        header.kid = Some(key.kid().to_owned());
        let der = {
            use ed25519_dalek::pkcs8::EncodePrivateKey as _;
            key.dalek().to_pkcs8_der().expect("pkcs8")
        };
        let encoding = jsonwebtoken::EncodingKey::from_ed_der(der.as_bytes());
        assert_eq!(
            signed,
            jsonwebtoken::encode(&header, &claims, &encoding).expect("encoded")
        );
        let mut other_claims = claims.clone();
        other_claims.token_id = "fresh".into();
        let fresh = Signer::new(key).sign(&other_claims).expect("signed");
        assert_eq!(
            first.verify(&fresh, at(now + 1)).expect("valid"),
            other_claims
        );
        assert_eq!(full_checks(), before + 2);
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use convene_core::permissions::{DataConstraints, Permission, PermissionSet, TimeWindow};
    use convene_proto::v1::AuthorizeReason;
    use ed25519_dalek::Signer as _;
    use jsonwebtoken::{DecodingKey, Validation};

    use super::*;
    use crate::claims::tests::sample;

    fn at(secs: u64) -> SystemTime {
        UNIX_EPOCH + Duration::from_secs(secs)
    }

    /// A token with any header, signed by `key` whatever the header says.
    pub(super) fn forge(header: &serde_json::Value, claims: &Claims, key: &SigningKey) -> String {
        let mut token = URL_SAFE_NO_PAD.encode(header.to_string());
        token.push('.');
        token.push_str(&URL_SAFE_NO_PAD.encode(serde_json::to_vec(claims).unwrap()));
        let signature = key.dalek().sign(token.as_bytes());
        token.push('.');
        token.push_str(&URL_SAFE_NO_PAD.encode(signature.to_bytes()));
        token
    }

    /// A fixed key and fixed claims: Ed25519 is deterministic, so every run checks the
    /// very same token.
    fn setup() -> (Signer, Verifier, Claims) {
        let key = SigningKey::from_secret_bytes(&[42; 32]);
        let verifier = Verifier::from_jwks(&[key.public_jwk()]).unwrap();
        let mut claims = sample();
        claims.token_id = "01890a5d-ac96-774b-bcce-b302099a8057".into();
        let window = TimeWindow {
            start: Some(at(1_799_990_000)),
            end: Some(at(1_800_000_000)),
        };
        claims.set_permissions(&PermissionSet::from_permissions([
            Permission::new("logs:read", "service/*")
                .unwrap()
                .with_data(DataConstraints {
                    time: window,
                    max_rows: Some(500),
                }),
            Permission::new("metrics:*", "service/payment-api").unwrap(),
        ]));
        claims.parent_token_id = Some("01890a5d-ac96-774b-bcce-b302099a8000".into());
        (Signer::new(key), verifier, claims)
    }

    /// A time inside the sample claims' validity.
    const NOW: u64 = 1_800_000_100;

    #[test]
    fn sign_then_verify_returns_identical_claims_and_scopes() {
        let (signer, verifier, claims) = setup();
        let token = signer.sign(&claims).unwrap();
        let verified = verifier.verify(&token, at(NOW)).unwrap();
        assert_eq!(verified, claims);
        assert_eq!(
            verified.permissions().unwrap(),
            claims.permissions().unwrap()
        );
        assert_eq!(verified.permissions().unwrap().permissions().len(), 2);
        // The header names the key, so a verifier can pick it.
        let header = URL_SAFE_NO_PAD
            .decode(token.split('.').next().unwrap())
            .unwrap();
        let header: serde_json::Value = serde_json::from_slice(&header).unwrap();
        assert_eq!(
            header,
            serde_json::json!({"alg": "EdDSA", "typ": "JWT", "kid": signer.kid()})
        );
    }

    #[test]
    fn every_single_bit_flip_is_refused() {
        let (signer, verifier, claims) = setup();
        let token = signer.sign(&claims).unwrap();
        assert!(verifier.verify(&token, at(NOW)).is_ok());
        let mut reasons = BTreeSet::new();
        let mut tried = 0;
        for i in 0..token.len() {
            for mask in [0x01u8, 0x02, 0x20] {
                let mut bytes = token.clone().into_bytes();
                bytes[i] ^= mask;
                // A flip can leave ASCII; the verifier takes `&str`, so such a token can
                // never reach it and is not a case.
                let Ok(tampered) = String::from_utf8(bytes) else {
                    continue;
                };
                tried += 1;
                match verifier.verify(&tampered, at(NOW)) {
                    Ok(_) => panic!("byte {i} ^ {mask:#04x} still verifies: {tampered}"),
                    Err(e) => reasons.insert(e.reason() as i32),
                };
            }
        }
        assert_eq!(tried, token.len() * 3, "every flip of ASCII stays UTF-8");
        // Flips in the kid give UnknownKey, elsewhere in header or payload BadSignature,
        // and flips that break the encoding or the header JSON Malformed.
        for expected in [
            AuthorizeReason::Malformed,
            AuthorizeReason::BadSignature,
            AuthorizeReason::UnknownKey,
        ] {
            assert!(
                reasons.contains(&(expected as i32)),
                "no flip was refused as {expected:?}; seen {reasons:?}"
            );
        }
    }

    #[test]
    fn key_outside_the_verifier_is_unknown() {
        let (_, verifier, claims) = setup();
        let stranger = Signer::new(SigningKey::generate().unwrap());
        let token = stranger.sign(&claims).unwrap();
        let err = verifier.verify(&token, at(NOW)).unwrap_err();
        assert_eq!(
            err,
            TokenError::UnknownKey {
                kid: stranger.kid().to_owned()
            }
        );
        assert_eq!(err.reason(), AuthorizeReason::UnknownKey);
    }

    #[test]
    fn known_kid_with_another_key_is_a_bad_signature() {
        let (signer, verifier, claims) = setup();
        let header = serde_json::json!({"alg": "EdDSA", "typ": "JWT", "kid": signer.kid()});
        let token = forge(&header, &claims, &SigningKey::generate().unwrap());
        let err = verifier.verify(&token, at(NOW)).unwrap_err();
        assert_eq!(
            err,
            TokenError::BadSignature {
                kid: signer.kid().to_owned()
            }
        );
        assert_eq!(err.reason(), AuthorizeReason::BadSignature);
        // The same forge with the right key verifies: the header, not the forge, is what
        // the first case got wrong.
        assert!(
            verifier
                .verify(&forge(&header, &claims, signer.key()), at(NOW))
                .is_ok()
        );
    }

    #[test]
    fn a_signature_with_its_scalar_not_reduced_is_refused() {
        // s + L is the same signature to the curve arithmetic; accepting it would let
        // anyone make a second valid token from each one (RFC 8032 requires s < L).
        const L: [u8; 32] = [
            0xed, 0xd3, 0xf5, 0x5c, 0x1a, 0x63, 0x12, 0x58, 0xd6, 0x9c, 0xf7, 0xa2, 0xde, 0xf9,
            0xde, 0x14, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x10,
        ];
        let (signer, verifier, claims) = setup();
        let token = signer.sign(&claims).unwrap();
        let (signed, signature) = token.rsplit_once('.').unwrap();
        let mut bytes = URL_SAFE_NO_PAD.decode(signature).unwrap();
        let mut carry = 0u16;
        for (b, l) in bytes[32..].iter_mut().zip(L) {
            let sum = u16::from(*b) + u16::from(l) + carry;
            *b = sum.to_le_bytes()[0];
            carry = sum >> 8;
        }
        assert_eq!(carry, 0, "s + L fits in 32 bytes");
        let malleated = format!("{signed}.{}", URL_SAFE_NO_PAD.encode(&bytes));
        assert_eq!(
            verifier.verify(&malleated, at(NOW)).unwrap_err(),
            TokenError::BadSignature {
                kid: signer.kid().to_owned()
            }
        );
        assert!(verifier.verify(&token, at(NOW)).is_ok());
    }

    #[test]
    fn expiry_and_not_before_at_their_exact_boundaries() {
        let (signer, verifier, claims) = setup();
        let token = signer.sign(&claims).unwrap();
        let exp = claims.expires_at;
        let nbf = claims.not_before;
        let just_before_exp = at(exp) - Duration::from_nanos(1);
        assert!(verifier.verify(&token, just_before_exp).is_ok());
        let err = verifier.verify(&token, at(exp)).unwrap_err();
        assert_eq!(err, TokenError::Expired { expired_at: exp });
        assert_eq!(err.reason(), AuthorizeReason::Expired);
        assert!(err.to_string().contains("2027-01-15T08:15:00Z"), "{err}");

        assert!(verifier.verify(&token, at(nbf)).is_ok());
        let err = verifier
            .verify(&token, at(nbf) - Duration::from_nanos(1))
            .unwrap_err();
        assert_eq!(err, TokenError::NotYetValid { not_before: nbf });
        assert_eq!(err.reason(), AuthorizeReason::NotYetValid);
    }

    #[test]
    fn leeway_extends_both_ends_by_exactly_its_length() {
        let (signer, verifier, claims) = setup();
        let verifier = verifier.with_leeway(Duration::from_secs(5));
        let token = signer.sign(&claims).unwrap();
        let (nbf, exp) = (claims.not_before, claims.expires_at);
        assert!(verifier.verify(&token, at(exp + 4)).is_ok());
        assert!(matches!(
            verifier.verify(&token, at(exp + 5)),
            Err(TokenError::Expired { .. })
        ));
        assert!(verifier.verify(&token, at(nbf - 5)).is_ok());
        assert!(matches!(
            verifier.verify(&token, at(nbf - 6)),
            Err(TokenError::NotYetValid { .. })
        ));
    }

    #[test]
    fn other_algorithms_are_refused_even_with_a_known_kid() {
        let (signer, verifier, claims) = setup();
        let payload = URL_SAFE_NO_PAD.encode(serde_json::to_vec(&claims).unwrap());
        for alg in ["none", "HS256", "RS256", "ES256", "eddsa"] {
            let header = serde_json::json!({"alg": alg, "typ": "JWT", "kid": signer.kid()});
            let header = URL_SAFE_NO_PAD.encode(header.to_string());
            // `none` with an empty signature, the others with a plausible one.
            for signature in [String::new(), URL_SAFE_NO_PAD.encode([7u8; 64])] {
                let token = format!("{header}.{payload}.{signature}");
                let err = verifier.verify(&token, at(NOW)).unwrap_err();
                assert_eq!(
                    err,
                    TokenError::UnsupportedAlgorithm {
                        alg: alg.to_owned()
                    }
                );
                assert_eq!(err.reason(), AuthorizeReason::Malformed);
            }
        }
        // An EdDSA header signed with an Ed25519 key is accepted by the same verifier,
        // so what was refused above is the algorithm alone.
        let header = serde_json::json!({"alg": "EdDSA", "kid": signer.kid()});
        assert!(
            verifier
                .verify(&forge(&header, &claims, signer.key()), at(NOW))
                .is_ok()
        );
    }

    #[test]
    fn malformed_shapes_say_what_is_wrong() {
        let (signer, verifier, claims) = setup();
        let token = signer.sign(&claims).unwrap();
        let key = signer.key();
        let malformed = |t: &str| match verifier.verify(t, at(NOW)) {
            Err(TokenError::Malformed { detail }) => detail,
            other => panic!("expected Malformed, got {other:?}"),
        };
        assert!(malformed("").contains("no `.`"));
        assert!(malformed("abc.def").contains("one `.`"));
        assert!(malformed(&format!("{token}.x")).contains("more than two"));
        assert!(malformed(&"a".repeat(MAX_TOKEN_LEN + 1)).contains("bytes long"));
        let with = |header: serde_json::Value| forge(&header, &claims, key);
        assert!(malformed(&with(serde_json::json!({"alg": "EdDSA"}))).contains("no `kid`"));
        assert!(
            malformed(&with(
                serde_json::json!({"alg": "EdDSA", "kid": key.kid(), "crit": ["exp"]})
            ))
            .contains("crit")
        );
        assert!(
            malformed(&with(
                serde_json::json!({"alg": "EdDSA", "kid": key.kid(), "typ": "JWE"})
            ))
            .contains("typ")
        );
        assert!(
            malformed(&with(
                serde_json::json!({"alg": "EdDSA", "kid": key.kid(), "b64": false})
            ))
            .contains("b64")
        );
        // A header field of the wrong type is a header problem, named as such.
        assert!(
            malformed(&with(
                serde_json::json!({"alg": "EdDSA", "kid": key.kid(), "typ": 7})
            ))
            .contains("header is not the expected JSON")
        );
        // The payload's encoding is checked before the key is looked up, so a stray
        // character says so even under a kid this verifier does not know.
        let (head, rest) = token.split_once('.').unwrap();
        let (payload, signature) = rest.split_once('.').unwrap();
        let stranger = Signer::new(SigningKey::generate().unwrap());
        let foreign_head = stranger.sign(&claims).unwrap();
        let foreign_head = foreign_head.split('.').next().unwrap();
        for h in [head, foreign_head] {
            let garbled = format!("{h}.{}*{}.{signature}", &payload[..600], &payload[601..]);
            let detail = malformed(&garbled);
            assert!(
                detail.contains("payload") && detail.contains("offset 600"),
                "{detail}"
            );
        }

        let (head, _) = token.rsplit_once('.').unwrap();
        let padded = format!("{head}.{}==", &token[head.len() + 1..]);
        assert!(malformed(&padded).contains("signature"));
        // Base64url of 64 bytes leaves 4 unused bits in the last character; a token with
        // them set is another spelling of the same signature and must not verify.
        const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
        let last = *token.as_bytes().last().unwrap();
        let index = ALPHABET.iter().position(|&c| c == last).unwrap();
        let respelled = format!(
            "{}{}",
            &token[..token.len() - 1],
            char::from(ALPHABET[index ^ 0b0001])
        );
        assert!(malformed(&respelled).contains("signature"));
        // A correctly signed payload that is not our claims.
        let mut other = serde_json::to_value(&claims).unwrap();
        other.as_object_mut().unwrap().remove("tenant");
        let mut t = URL_SAFE_NO_PAD
            .encode(serde_json::json!({"alg": "EdDSA", "kid": key.kid()}).to_string());
        t.push('.');
        t.push_str(&URL_SAFE_NO_PAD.encode(other.to_string()));
        let sig = key.dalek().sign(t.as_bytes());
        t.push('.');
        t.push_str(&URL_SAFE_NO_PAD.encode(sig.to_bytes()));
        assert!(malformed(&t).contains("tenant"));
    }

    #[test]
    fn jwks_with_other_key_types_are_refused_by_index() {
        let key = SigningKey::generate().unwrap();
        let mut rsa = key.public_jwk();
        rsa.kty = "RSA".into();
        rsa.crv.clear();
        let err = Verifier::from_jwks(&[key.public_jwk(), rsa]).unwrap_err();
        assert!(
            matches!(&err, Error::UnsupportedKey { index: 1, detail, .. } if detail.contains("RSA")),
            "{err}"
        );
        let mut x25519 = key.public_jwk();
        x25519.crv = "X25519".into();
        assert!(Verifier::from_jwks(&[x25519]).is_err());
        let mut hs = key.public_jwk();
        hs.alg = "HS256".into();
        assert!(Verifier::from_jwks(&[hs]).is_err());
        let mut enc = key.public_jwk();
        enc.r#use = "enc".into();
        assert!(Verifier::from_jwks(&[enc]).is_err());
        let mut short = key.public_jwk();
        short.x = URL_SAFE_NO_PAD.encode([1u8; 31]);
        assert!(Verifier::from_jwks(&[short]).is_err());
        // The identity point is a small-order (weak) key: any signature would do.
        let mut weak = key.public_jwk();
        let mut identity = [0u8; 32];
        identity[0] = 1;
        weak.x = URL_SAFE_NO_PAD.encode(identity);
        assert!(Verifier::from_jwks(&[weak]).is_err());
    }

    #[test]
    fn jwks_kid_rules() {
        let a = SigningKey::generate().unwrap();
        let b = SigningKey::generate().unwrap();
        // Without a kid the thumbprint stands in, which is what our tokens carry.
        let mut no_kid = a.public_jwk();
        no_kid.kid.clear();
        let v = Verifier::from_jwks(&[no_kid]).unwrap();
        assert_eq!(v.kids().collect::<Vec<_>>(), vec![a.kid()]);
        // The same key twice is harmless; two keys under one kid are refused.
        let v = Verifier::from_jwks(&[a.public_jwk(), a.public_jwk()]).unwrap();
        assert_eq!(v.kids().count(), 1);
        let mut clash = b.public_jwk();
        clash.kid = a.kid().to_owned();
        assert!(matches!(
            Verifier::from_jwks(&[a.public_jwk(), clash]),
            Err(Error::UnsupportedKey { index: 1, .. })
        ));
    }

    #[test]
    fn several_keys_verify_their_own_tokens() {
        let old = SigningKey::generate().unwrap();
        let new = SigningKey::generate().unwrap();
        let verifier = Verifier::from_jwks(&[new.public_jwk(), old.public_jwk()]).unwrap();
        let claims = sample();
        for key in [old, new] {
            let token = Signer::new(key).sign(&claims).unwrap();
            assert_eq!(verifier.verify(&token, at(NOW)).unwrap(), claims);
        }
    }

    #[test]
    fn every_error_maps_to_its_wire_reason() {
        let cases = [
            (TokenError::malformed("x"), AuthorizeReason::Malformed),
            (
                TokenError::UnsupportedAlgorithm { alg: "none".into() },
                AuthorizeReason::Malformed,
            ),
            (
                TokenError::UnknownKey { kid: "k".into() },
                AuthorizeReason::UnknownKey,
            ),
            (
                TokenError::BadSignature { kid: "k".into() },
                AuthorizeReason::BadSignature,
            ),
            (
                TokenError::NotYetValid { not_before: 0 },
                AuthorizeReason::NotYetValid,
            ),
            (
                TokenError::Expired { expired_at: 0 },
                AuthorizeReason::Expired,
            ),
            (
                TokenError::WrongAudience {
                    presenter: "p".into(),
                    audience: vec![],
                },
                AuthorizeReason::WrongAudience,
            ),
        ];
        for (err, reason) in cases {
            assert_eq!(err.reason(), reason, "{err}");
        }
        // Times past year 9999 (only in forged tokens) still format.
        let far = TokenError::NotYetValid {
            not_before: u64::MAX,
        };
        assert!(far.to_string().contains("unix time"));
    }

    /// Claims valid around the real clock, for checks by plain `jsonwebtoken`, which
    /// reads the system time.
    fn current_claims() -> Claims {
        let now = unix_seconds_now();
        Claims {
            issued_at: now,
            not_before: now,
            expires_at: now + 900,
            ..sample()
        }
    }

    fn unix_seconds_now() -> u64 {
        crate::unix_seconds(SystemTime::now())
    }

    #[test]
    fn our_tokens_pass_plain_jsonwebtoken_with_the_published_key() {
        let key = SigningKey::generate().unwrap();
        let jwk = key.public_jwk();
        let signer = Signer::new(key);
        let claims = current_claims();
        let token = signer.sign(&claims).unwrap();

        // The key as any JWT library gets it: the published JWK, parsed by jsonwebtoken.
        let published: jsonwebtoken::jwk::Jwk = serde_json::from_value(serde_json::json!({
            "kty": jwk.kty, "crv": jwk.crv, "x": jwk.x,
            "kid": jwk.kid, "alg": jwk.alg, "use": jwk.r#use,
        }))
        .unwrap();
        let decoding = DecodingKey::from_jwk(&published).unwrap();
        // jsonwebtoken's default validation: signature, `exp`, plus `nbf` and the audience.
        let mut validation = Validation::new(Algorithm::EdDSA);
        validation.validate_nbf = true;
        validation.set_audience(&["worker:logs-investigator"]);
        validation.set_required_spec_claims(&["exp", "nbf", "aud", "iss", "sub"]);
        let data = jsonwebtoken::decode::<Claims>(&token, &decoding, &validation).unwrap();
        assert_eq!(data.claims, claims);
        assert_eq!(data.header.alg, Algorithm::EdDSA);
        assert_eq!(data.header.kid.as_deref(), Some(signer.kid()));
        assert_eq!(data.header.typ.as_deref(), Some("JWT"));

        // The same decoder refuses the token for another audience and with another key,
        // so the acceptance above is not vacuous.
        validation.set_audience(&["worker:metrics"]);
        let err = jsonwebtoken::decode::<Claims>(&token, &decoding, &validation).unwrap_err();
        assert_eq!(*err.kind(), ErrorKind::InvalidAudience);
        validation.set_audience(&["worker:logs-investigator"]);
        let other = SigningKey::generate().unwrap().public_jwk();
        let other = DecodingKey::from_ed_components(&other.x).unwrap();
        let err = jsonwebtoken::decode::<Claims>(&token, &other, &validation).unwrap_err();
        assert_eq!(*err.kind(), ErrorKind::InvalidSignature);
    }

    #[test]
    fn tokens_from_plain_jsonwebtoken_verify_with_our_verifier() {
        let key = SigningKey::generate().unwrap();
        let verifier = Verifier::from_jwks(&[key.public_jwk()]).unwrap();
        let claims = current_claims();
        // Encoded the way any jsonwebtoken user would: the key's own PKCS#8 document
        // (with its public key) and a default header.
        use ed25519_dalek::pkcs8::EncodePrivateKey as _;
        use jsonwebtoken::EncodingKey;
        let der = key.dalek().to_pkcs8_der().unwrap();
        let encoding = EncodingKey::from_ed_der(der.as_bytes());
        let mut header = Header::new(Algorithm::EdDSA);
        header.kid = Some(key.kid().to_owned());
        let token = jsonwebtoken::encode(&header, &claims, &encoding).unwrap();
        let now = SystemTime::now();
        assert_eq!(verifier.verify(&token, now).unwrap(), claims);

        // Without `typ`, as other JWT libraries may send it, the token is still ours.
        header.typ = None;
        let token = jsonwebtoken::encode(&header, &claims, &encoding).unwrap();
        assert_eq!(verifier.verify(&token, now).unwrap(), claims);

        // Signed with an HMAC of the public key, the classic confusion attack, it is
        // refused for its algorithm before any key is used.
        let hmac = EncodingKey::from_secret(key.public_jwk().x.as_bytes()).unwrap();
        header.alg = Algorithm::HS256;
        let token = jsonwebtoken::encode(&header, &claims, &hmac).unwrap();
        assert_eq!(
            verifier.verify(&token, now),
            Err(TokenError::UnsupportedAlgorithm {
                alg: "HS256".into()
            })
        );
    }

    #[test]
    fn signer_and_verifier_agree_with_the_ring_key_after_cloning() {
        // Signer and Verifier keep jsonwebtoken keys built once; clones share nothing
        // mutable and keep working.
        let key = SigningKey::generate().unwrap();
        let signer = Signer::new(key.clone()).clone();
        let verifier = Verifier::from_signing_keys([&key]).clone();
        let claims = current_claims();
        let token = signer.sign(&claims).unwrap();
        assert_eq!(verifier.verify(&token, SystemTime::now()).unwrap(), claims);
        assert_eq!(
            Verifier::default().verify(&token, SystemTime::now()),
            Err(TokenError::UnknownKey {
                kid: key.kid().to_owned()
            })
        );
    }

    #[test]
    fn base64url_check_agrees_with_the_decoder_across_chunks() {
        const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
        for len in [0usize, 1, 2, 3, 383, 384, 385, 386, 767, 768, 769, 2000] {
            let bytes: Vec<u8> = (0..len).map(|i| (i * 7 + 3) as u8).collect();
            let encoded = URL_SAFE_NO_PAD.encode(&bytes);
            assert_eq!(check_base64url(&encoded), Ok(()), "length {len}");
            let mut variants = vec![
                format!("{encoded}A"),
                format!("{encoded}AA"),
                format!("{encoded}="),
                format!("{encoded}=="),
                format!("+{encoded}"),
            ];
            if let Some(last) = encoded.bytes().last() {
                // Another spelling of the last character: sets trailing bits or not.
                let index = ALPHABET.iter().position(|&c| c == last).unwrap();
                for flip in [1, 2, 16] {
                    let mut v = encoded.clone().into_bytes();
                    *v.last_mut().unwrap() = ALPHABET[index ^ flip];
                    variants.push(String::from_utf8(v).unwrap());
                }
                // A stray character right after a chunk boundary.
                let mut v = encoded.clone();
                v.insert(encoded.len().min(512), '.');
                variants.push(v);
            }
            for v in variants {
                assert_eq!(
                    check_base64url(&v).is_ok(),
                    URL_SAFE_NO_PAD.decode(&v).is_ok(),
                    "length {len}: {v}"
                );
            }
        }
    }
}
