//! The two error types of this crate: [`Error`] for keys and signing (operator-facing),
//! [`TokenError`] for a token that does not verify (caller-facing, with a wire reason).

use std::fmt;
use std::path::PathBuf;
use std::time::{Duration, UNIX_EPOCH};

use convene_proto::v1::AuthorizeReason;

/// A key-management or signing failure: the operator has to fix a file, a key set or the
/// host's randomness source.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A key file or directory could not be read or written.
    #[error("cannot {action} `{}`: {source}", path.display())]
    Io {
        /// What was being done (`read`, `write`, `create directory`, ...).
        action: &'static str,
        /// The file or directory concerned.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// A key file exists but does not hold a usable Ed25519 private key.
    #[error(
        "key file `{}` is invalid: {detail}; restore it from a backup or move it away so a new key is generated",
        path.display()
    )]
    KeyFile {
        /// The file concerned.
        path: PathBuf,
        /// What is wrong with it.
        detail: String,
    },
    /// A public key handed to a verifier is not an Ed25519 signing key.
    #[error("verification key {index} (kid `{kid}`) is not usable: {detail}")]
    UnsupportedKey {
        /// Position of the key in the list.
        index: usize,
        /// Its `kid`, as given.
        kid: String,
        /// What is wrong with it and what is accepted instead.
        detail: String,
    },
    /// The operating system's random number generator failed.
    #[error("cannot generate a signing key: the OS random source failed: {0}")]
    Random(#[source] getrandom::Error),
    /// A key file could not be serialized (it holds nothing that can fail; a bug if
    /// seen).
    #[error("cannot encode the key file: {0}")]
    Encode(#[source] serde_json::Error),
    /// `jsonwebtoken` could not encode or sign a token: the claims did not serialize or
    /// it refused the key. Neither can happen with the keys and claims of this crate; a
    /// bug if seen.
    #[error("cannot sign a task token: {0}")]
    Sign(#[source] jsonwebtoken::errors::Error),
    /// The key to retire is the one that signs new tokens.
    #[error("key `{kid}` is the active signing key; rotate to a new key before retiring it")]
    RetireActive {
        /// The active key's id.
        kid: String,
    },
    /// No key with this id is in the key ring.
    #[error("no signing key with kid `{kid}`; known keys: {known}")]
    NoSuchKey {
        /// The id asked for.
        kid: String,
        /// The ids that exist, comma-separated.
        known: String,
    },
}

/// Why a token was refused. Every variant says what the presenter can do about it and maps
/// to the wire reason through [`TokenError::reason`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TokenError {
    /// Not a well-formed compact JWS with the expected header and claims.
    #[error(
        "malformed task token: {detail}; present the token exactly as it was issued (header.payload.signature, base64url)"
    )]
    Malformed {
        /// What is wrong with it.
        detail: String,
    },
    /// The header names an algorithm other than EdDSA (including `none` and HMAC), which
    /// is refused before any key is looked at so no other algorithm can be substituted.
    #[error(
        "task token header says alg `{alg}`; only EdDSA (Ed25519) tokens issued by the policy service are accepted"
    )]
    UnsupportedAlgorithm {
        /// The `alg` the header named.
        alg: String,
    },
    /// The header's `kid` is not among the verifier's keys.
    #[error(
        "task token was signed with key `{kid}`, which this verifier does not know (retired or never published); refresh the signing keys from the policy service or ask the supervisor for a new task token"
    )]
    UnknownKey {
        /// The key id the header named.
        kid: String,
    },
    /// The signature does not verify with the key the header names.
    #[error(
        "task token signature does not verify with key `{kid}`: the token was altered or not signed by the policy service; ask the supervisor for a new task token"
    )]
    BadSignature {
        /// The key id the header named.
        kid: String,
    },
    /// `nbf` lies in the future.
    #[error(
        "task token is not valid before {}; wait until then or check that this host's clock is not behind",
        Rfc3339(*not_before)
    )]
    NotYetValid {
        /// The token's `nbf`, in unix seconds.
        not_before: u64,
    },
    /// `exp` has passed.
    #[error(
        "task token expired at {}; ask the supervisor for a new task token",
        Rfc3339(*expired_at)
    )]
    Expired {
        /// The token's `exp`, in unix seconds.
        expired_at: u64,
    },
    /// The presenter is not in the token's audience.
    #[error(
        "`{presenter}` may not present this task token; its audience is [{}]: present it only from one of those",
        audience.join(", ")
    )]
    WrongAudience {
        /// Who presented it.
        presenter: String,
        /// Who may.
        audience: Vec<String>,
    },
}

impl TokenError {
    /// The machine-readable reason on the wire.
    pub fn reason(&self) -> AuthorizeReason {
        match self {
            TokenError::Malformed { .. } | TokenError::UnsupportedAlgorithm { .. } => {
                AuthorizeReason::Malformed
            }
            TokenError::UnknownKey { .. } => AuthorizeReason::UnknownKey,
            TokenError::BadSignature { .. } => AuthorizeReason::BadSignature,
            TokenError::NotYetValid { .. } => AuthorizeReason::NotYetValid,
            TokenError::Expired { .. } => AuthorizeReason::Expired,
            TokenError::WrongAudience { .. } => AuthorizeReason::WrongAudience,
        }
    }

    pub(crate) fn malformed(detail: impl Into<String>) -> Self {
        TokenError::Malformed {
            detail: detail.into(),
        }
    }
}

/// Unix seconds shown as RFC 3339 UTC. Values past year 9999 (only a forged or broken
/// token carries them) are shown as raw seconds, because the formatter refuses them and a
/// failing `Display` would panic inside `to_string`.
struct Rfc3339(u64);

impl fmt::Display for Rfc3339 {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const YEAR_10000: u64 = 253_402_300_800;
        if self.0 < YEAR_10000 {
            let t = UNIX_EPOCH + Duration::from_secs(self.0);
            write!(f, "{}", humantime::format_rfc3339_seconds(t))
        } else {
            write!(f, "unix time {}", self.0)
        }
    }
}
