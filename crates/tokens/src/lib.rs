//! Task tokens: short-lived Ed25519-signed JWTs that bind a worker's permissions.
//!
//! The policy service computes a delegation's effective permissions and issues a task
//! token carrying them ([`Claims`]): tenant, run, delegation, profile, audience, scopes,
//! tools, call limit, whether it may redelegate, and its validity window. The token is a
//! JWT (compact JWS) signed with EdDSA over Ed25519, the signing key named by `kid` in the
//! header. Tokens are encoded exactly as the `jsonwebtoken` crate encodes them, signed with
//! `ed25519-dalek`, and verified through `jsonwebtoken` (its RustCrypto backend), so any
//! JWT library that takes an Ed25519 JWK can check our tokens; this crate adds what a task token needs on top: one algorithm only, keys
//! chosen by `kid`, a validity window checked at an explicit `now`, and a precise reason
//! for every refusal.
//!
//! - [`SigningKey`]: key generation, RFC 7638 key ids, public JWKs, key files.
//! - [`KeyRing`]: the persistent keys of the policy service, with rotation.
//! - [`Signer`] signs claims; [`Verifier`] checks a token offline against public keys
//!   (several at once during rotation) at an explicit `now`, and says precisely why a
//!   token is refused ([`TokenError`], mapped to the wire reason by
//!   [`TokenError::reason`]).
//!
//! ```
//! # use std::time::{Duration, SystemTime};
//! # use convene_tokens::{Claims, SigningKey, Signer, Verifier, unix_seconds, new_token_id};
//! let key = SigningKey::generate()?;
//! let verifier = Verifier::from_jwks(&[key.public_jwk()])?;
//! let signer = Signer::new(key);
//! let now = SystemTime::now();
//! let claims = Claims {
//!     issuer: "convene-policy".into(),
//!     subject: "user:alice".into(),
//!     audience: vec!["worker:logs-investigator".into()],
//!     issued_at: unix_seconds(now),
//!     not_before: unix_seconds(now),
//!     expires_at: unix_seconds(now + Duration::from_secs(900)),
//!     token_id: new_token_id(),
//!     tenant: "acme".into(),
//!     run_id: "run-1".into(),
//!     delegation_id: "del-1".into(),
//!     profile_id: "logs-investigator".into(),
//!     depth: 1,
//!     scopes: Vec::new(),
//!     tools: vec!["search_logs@1".into()],
//!     max_calls: 32,
//!     may_redelegate: false,
//!     parent_token_id: None,
//!     lease_epoch: 0,
//! };
//! let token = signer.sign(&claims)?;
//! let verified = verifier.verify(&token, now)?;
//! verified.check_audience("worker:logs-investigator")?;
//! assert_eq!(verified, claims);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
#![forbid(unsafe_code)]

mod claims;
mod error;
mod jwt;
mod keyring;
mod keys;

pub use claims::{Claims, Scope, from_unix_seconds, new_token_id, unix_seconds};
pub use error::{Error, TokenError};
pub use jwt::{
    Accepted, MAX_TOKEN_LEN, Revocation, Signer, Verifier, revoked_run_digest, revoked_token_digest,
};
pub use keyring::{KEYRING_FILE, KeyRing};
pub use keys::{SigningKey, thumbprint};
