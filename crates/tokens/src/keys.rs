//! Ed25519 signing keys: generation, key ids (RFC 7638 thumbprints), public JWKs, and
//! key files.
//!
//! A key file is a private JWK (RFC 8037: `kty`, `crv`, `x`, `d`, plus `kid`, `alg`,
//! `use`) and a key-ring file a JWK Set of them. JSON rather than PKCS#8 PEM keeps the
//! dependency tree small and the file self-describing; the `kid` stored beside the key is
//! checked against the thumbprint on load, so a hand-edited file cannot pair one key with
//! another key's id.

use std::fmt;
use std::io::Write;
use std::path::Path;

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use convene_proto::v1;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::Error;

/// JWK `kty` of Ed25519 keys.
pub(crate) const KTY: &str = "OKP";
/// JWK `crv` of Ed25519 keys.
pub(crate) const CRV: &str = "Ed25519";
/// JWS `alg` of Ed25519 signatures.
pub(crate) const ALG: &str = "EdDSA";
/// JWK `use` of signing keys.
pub(crate) const USE: &str = "sig";

/// An Ed25519 private key with its key id. `Debug` shows the id only, never the secret.
#[derive(Clone)]
pub struct SigningKey {
    key: ed25519_dalek::SigningKey,
    /// Base64url of the public key, the JWK `x`.
    x: String,
    /// RFC 7638 thumbprint of the public key.
    kid: String,
}

impl SigningKey {
    /// A fresh key from the operating system's random source.
    pub fn generate() -> Result<Self, Error> {
        let mut secret = [0u8; ed25519_dalek::SECRET_KEY_LENGTH];
        getrandom::fill(&mut secret).map_err(Error::Random)?;
        let key = Self::from_secret_bytes(&secret);
        // The dalek key keeps its own copy and wipes it on drop; wipe ours too.
        secret.fill(0);
        Ok(key)
    }

    /// The key whose 32-byte secret (the RFC 8032 seed, JWK `d`) is `secret`.
    pub fn from_secret_bytes(secret: &[u8; ed25519_dalek::SECRET_KEY_LENGTH]) -> Self {
        Self::from_dalek(ed25519_dalek::SigningKey::from_bytes(secret))
    }

    fn from_dalek(key: ed25519_dalek::SigningKey) -> Self {
        let x = URL_SAFE_NO_PAD.encode(key.verifying_key().as_bytes());
        let kid = thumbprint(&x);
        Self { key, x, kid }
    }

    /// The key id: the RFC 7638 JWK thumbprint (base64url SHA-256 of the canonical public
    /// JWK), so the same key has the same id everywhere and ids never collide by accident.
    pub fn kid(&self) -> &str {
        &self.kid
    }

    /// The public key as a JWK, for `GetSigningKeys`.
    pub fn public_jwk(&self) -> v1::Jwk {
        v1::Jwk {
            kty: KTY.to_owned(),
            crv: CRV.to_owned(),
            x: self.x.clone(),
            kid: self.kid.clone(),
            alg: ALG.to_owned(),
            r#use: USE.to_owned(),
        }
    }

    /// The public half, for verification.
    pub(crate) fn verifying_key(&self) -> ed25519_dalek::VerifyingKey {
        self.key.verifying_key()
    }

    pub(crate) fn dalek(&self) -> &ed25519_dalek::SigningKey {
        &self.key
    }

    /// Writes the key as a private JWK to `path`, atomically (temporary file in the same
    /// directory, then rename) and, on unix, readable by the owner only.
    pub fn save(&self, path: impl AsRef<Path>) -> Result<(), Error> {
        write_private(path.as_ref(), &self.to_private_jwk())
    }

    /// Reads a key written by [`SigningKey::save`].
    pub fn load(path: impl AsRef<Path>) -> Result<Self, Error> {
        let path = path.as_ref();
        let jwk: PrivateJwk = read_json(path)?;
        Self::from_private_jwk(&jwk).map_err(|detail| Error::KeyFile {
            path: path.to_owned(),
            detail,
        })
    }

    pub(crate) fn to_private_jwk(&self) -> PrivateJwk {
        PrivateJwk {
            kty: KTY.to_owned(),
            crv: CRV.to_owned(),
            x: self.x.clone(),
            d: URL_SAFE_NO_PAD.encode(self.key.as_bytes()),
            kid: self.kid.clone(),
            alg: ALG.to_owned(),
            r#use: USE.to_owned(),
        }
    }

    /// The key a private JWK holds, or what is wrong with it.
    pub(crate) fn from_private_jwk(jwk: &PrivateJwk) -> Result<Self, String> {
        if jwk.kty != KTY || jwk.crv != CRV {
            return Err(format!(
                "key type is kty `{}` crv `{}`; only kty `{KTY}` crv `{CRV}` keys are used",
                jwk.kty, jwk.crv
            ));
        }
        let mut secret = [0u8; ed25519_dalek::SECRET_KEY_LENGTH];
        match URL_SAFE_NO_PAD.decode_slice(&jwk.d, &mut secret) {
            Ok(n) if n == secret.len() => {}
            _ => return Err("`d` is not a 32-byte base64url value".to_owned()),
        }
        let key = Self::from_secret_bytes(&secret);
        secret.fill(0);
        if key.x != jwk.x {
            return Err("`x` is not the public key of `d`".to_owned());
        }
        if key.kid != jwk.kid {
            return Err(format!(
                "`kid` is `{}` but the key's thumbprint is `{}`",
                jwk.kid, key.kid
            ));
        }
        Ok(key)
    }
}

impl fmt::Debug for SigningKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SigningKey")
            .field("kid", &self.kid)
            .finish_non_exhaustive()
    }
}

/// The RFC 7638 thumbprint of the Ed25519 public key whose base64url encoding is `x`.
pub fn thumbprint(x: &str) -> String {
    // The required members in lexicographic order, no whitespace (RFC 7638 §3.2). `x` is
    // base64url, which needs no JSON escaping.
    let canonical = format!(r#"{{"crv":"{CRV}","kty":"{KTY}","x":"{x}"}}"#);
    URL_SAFE_NO_PAD.encode(Sha256::digest(canonical.as_bytes()))
}

/// A private JWK as stored on disk. Deliberately not `Debug`, so `d` cannot reach a log.
#[derive(Clone, Serialize, Deserialize)]
pub(crate) struct PrivateJwk {
    pub kty: String,
    pub crv: String,
    pub x: String,
    pub d: String,
    pub kid: String,
    #[serde(default)]
    pub alg: String,
    #[serde(default)]
    pub r#use: String,
}

/// Reads and parses a JSON file, naming the file in errors.
pub(crate) fn read_json<T: serde::de::DeserializeOwned>(path: &Path) -> Result<T, Error> {
    let bytes = std::fs::read(path).map_err(|source| Error::Io {
        action: "read",
        path: path.to_owned(),
        source,
    })?;
    serde_json::from_slice(&bytes).map_err(|e| Error::KeyFile {
        path: path.to_owned(),
        detail: format!("not the expected JSON: {e}"),
    })
}

/// Serializes `value` and replaces `path` with it atomically, owner-readable only.
pub(crate) fn write_private<T: Serialize>(path: &Path, value: &T) -> Result<(), Error> {
    let io = |action: &'static str| {
        let path = path.to_owned();
        move |source| Error::Io {
            action,
            path,
            source,
        }
    };
    let json = serde_json::to_vec_pretty(value).map_err(Error::Encode)?;
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    // tempfile creates the file with mode 0600 on unix, before any secret is written to
    // it, and the rename keeps that mode; a reader sees the old file or the new one.
    let mut tmp = tempfile::Builder::new()
        .prefix(".key-")
        .suffix(".tmp")
        .tempfile_in(dir)
        .map_err(io("create a temporary file beside"))?;
    tmp.write_all(&json).map_err(io("write"))?;
    tmp.as_file().sync_all().map_err(io("sync"))?;
    tmp.persist(path)
        .map_err(|e| e.error)
        .map_err(io("replace"))?;
    sync_dir(dir);
    Ok(())
}

/// Makes the rename durable. Best effort: not every platform can sync a directory, and
/// the key is already safely written either way.
fn sync_dir(dir: &Path) {
    #[cfg(unix)]
    if let Ok(d) = std::fs::File::open(dir) {
        let _ = d.sync_all();
    }
    #[cfg(not(unix))]
    let _ = dir;
}

#[cfg(test)]
mod tests {
    use super::*;
    use ed25519_dalek::Signer as _;

    // RFC 8037 appendix A.1–A.3.
    const RFC_D: &str = "nWGxne_9WmC6hEr0kuwsxERJxWl7MmkZcDusAxyuf2A";
    const RFC_X: &str = "11qYAYKxCrfVS_7TyWQHOg7hcvPapiMlrwIaaPcHURo";
    const RFC_KID: &str = "kPrK_qmxVWaYVA9wwBF6Iuo3vVzz7TxHCTwXBygrS4k";

    fn rfc_key() -> SigningKey {
        let mut d = [0u8; 32];
        assert_eq!(URL_SAFE_NO_PAD.decode_slice(RFC_D, &mut d).unwrap(), 32);
        SigningKey::from_secret_bytes(&d)
    }

    #[test]
    fn matches_rfc_8037_vectors() {
        let key = rfc_key();
        assert_eq!(key.public_jwk().x, RFC_X);
        assert_eq!(key.kid(), RFC_KID);
        // A.4: the JWS signature of "Example of Ed25519 signing" under {"alg":"EdDSA"}.
        let input = b"eyJhbGciOiJFZERTQSJ9.RXhhbXBsZSBvZiBFZDI1NTE5IHNpZ25pbmc";
        let sig = URL_SAFE_NO_PAD.encode(key.dalek().sign(input).to_bytes());
        assert_eq!(
            sig,
            "hgyY0il_MGCjP0JzlnLWG1PPOt7-09PGcvMg3AIbQR6dWbhijcNR4ki4iylGjg5BhVsPt9g7sVvpAr_MuM0KAg"
        );
    }

    #[test]
    fn public_jwk_fields() {
        let jwk = rfc_key().public_jwk();
        assert_eq!(
            (
                jwk.kty.as_str(),
                jwk.crv.as_str(),
                jwk.alg.as_str(),
                jwk.r#use.as_str()
            ),
            ("OKP", "Ed25519", "EdDSA", "sig")
        );
        assert_eq!(jwk.kid, RFC_KID);
    }

    #[test]
    fn generated_keys_differ_and_debug_hides_the_secret() {
        let a = SigningKey::generate().unwrap();
        let b = SigningKey::generate().unwrap();
        assert_ne!(a.kid(), b.kid());
        let shown = format!("{a:?}");
        assert!(shown.contains(a.kid()));
        assert!(!shown.contains(&a.to_private_jwk().d));
    }

    #[test]
    fn save_and_load_keep_the_key_private() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("signing.jwk.json");
        let key = SigningKey::generate().unwrap();
        key.save(&path).unwrap();
        let loaded = SigningKey::load(&path).unwrap();
        assert_eq!(loaded.kid(), key.kid());
        assert_eq!(loaded.dalek().as_bytes(), key.dalek().as_bytes());
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(&path).unwrap().permissions().mode();
            assert_eq!(
                mode & 0o077,
                0,
                "key file mode {mode:o} is readable by others"
            );
        }
        // Saving again replaces the file and leaves no temporary file behind.
        SigningKey::generate().unwrap().save(&path).unwrap();
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, vec![std::ffi::OsString::from("signing.jwk.json")]);
        assert_ne!(SigningKey::load(&path).unwrap().kid(), key.kid());
    }

    #[test]
    fn load_refuses_inconsistent_files() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("k.json");
        let mut jwk = rfc_key().to_private_jwk();
        jwk.kid = "someone-else".into();
        write_private(&path, &jwk).unwrap();
        let err = SigningKey::load(&path).unwrap_err();
        assert!(
            matches!(&err, Error::KeyFile { detail, .. } if detail.contains("thumbprint")),
            "{err}"
        );

        let mut jwk = rfc_key().to_private_jwk();
        jwk.x = SigningKey::generate().unwrap().public_jwk().x;
        write_private(&path, &jwk).unwrap();
        assert!(matches!(
            SigningKey::load(&path),
            Err(Error::KeyFile { .. })
        ));

        std::fs::write(&path, b"not json").unwrap();
        assert!(matches!(
            SigningKey::load(&path),
            Err(Error::KeyFile { .. })
        ));
        assert!(matches!(
            SigningKey::load(dir.path().join("missing.json")),
            Err(Error::Io { action: "read", .. })
        ));
    }
}
