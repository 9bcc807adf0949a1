//! A persistent set of signing keys with rotation.
//!
//! The ring lives in one file, `signing-keys.json` in the given directory: a JWK Set of
//! private keys, the active (signing) key first. Every change rewrites the whole file
//! atomically, so a crash leaves either the old ring or the new one, never a mix. One
//! process owns a ring directory (the policy service); others get the public keys
//! through `GetSigningKeys`.

use std::path::{Path, PathBuf};

use convene_proto::v1;
use serde::{Deserialize, Serialize};

use crate::keys::{PrivateJwk, read_json, write_private};
use crate::{Error, Signer, SigningKey, Verifier};

/// File name of the ring inside its directory.
pub const KEYRING_FILE: &str = "signing-keys.json";

/// The on-disk form: a JWK Set of private keys, active first.
#[derive(Serialize, Deserialize)]
struct KeySetFile {
    keys: Vec<PrivateJwk>,
}

/// Signing keys, the active one first, kept in a directory.
///
/// Rotation is two steps so no valid token is ever cut off: [`KeyRing::rotate`] makes a
/// new key active while the previous one still verifies, and once tokens signed by the
/// previous key have expired (their lifetime is bounded by the policy's maximum TTL),
/// [`KeyRing::retire`] removes it.
#[derive(Debug)]
pub struct KeyRing {
    path: PathBuf,
    /// Never empty; `keys[0]` signs.
    keys: Vec<SigningKey>,
}

impl KeyRing {
    /// Opens the ring in `dir`, creating the directory (owner-only on unix) and a first
    /// key when there is none yet.
    pub fn open(dir: impl AsRef<Path>) -> Result<Self, Error> {
        let dir = dir.as_ref();
        create_private_dir(dir)?;
        let path = dir.join(KEYRING_FILE);
        if !path.try_exists().map_err(|source| Error::Io {
            action: "check",
            path: path.clone(),
            source,
        })? {
            let ring = Self {
                keys: vec![SigningKey::generate()?],
                path,
            };
            ring.save()?;
            return Ok(ring);
        }
        let file: KeySetFile = read_json(&path)?;
        let invalid = |detail: String| Error::KeyFile {
            path: path.clone(),
            detail,
        };
        if file.keys.is_empty() {
            return Err(invalid("it holds no keys".to_owned()));
        }
        let mut keys: Vec<SigningKey> = Vec::with_capacity(file.keys.len());
        for (i, jwk) in file.keys.iter().enumerate() {
            let key = SigningKey::from_private_jwk(jwk)
                .map_err(|d| invalid(format!("keys[{i}]: {d}")))?;
            if keys.iter().any(|k| k.kid() == key.kid()) {
                return Err(invalid(format!(
                    "keys[{i}]: key `{}` appears twice",
                    key.kid()
                )));
            }
            keys.push(key);
        }
        Ok(Self { path, keys })
    }

    /// The file the ring is kept in.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The key that signs new tokens.
    pub fn active(&self) -> &SigningKey {
        &self.keys[0]
    }

    /// Every key, the active one first.
    pub fn keys(&self) -> &[SigningKey] {
        &self.keys
    }

    /// A signer with the active key.
    pub fn signer(&self) -> Signer {
        Signer::new(self.active().clone())
    }

    /// A verifier trusting every key of the ring.
    pub fn verifier(&self) -> Verifier {
        Verifier::from_signing_keys(&self.keys)
    }

    /// The public keys, the active one first (the `GetSigningKeys` answer).
    pub fn jwks(&self) -> Vec<v1::Jwk> {
        self.keys.iter().map(SigningKey::public_jwk).collect()
    }

    /// Makes a fresh key active; the previous ones keep verifying until retired. The ring
    /// is unchanged when saving fails.
    pub fn rotate(&mut self) -> Result<&SigningKey, Error> {
        let mut keys = Vec::with_capacity(self.keys.len() + 1);
        keys.push(SigningKey::generate()?);
        keys.extend(self.keys.iter().cloned());
        write_ring(&self.path, &keys)?;
        self.keys = keys;
        Ok(self.active())
    }

    /// Removes the key `kid`, so tokens it signed stop verifying. The active key cannot
    /// be retired; rotate first. The ring is unchanged when saving fails.
    pub fn retire(&mut self, kid: &str) -> Result<(), Error> {
        let index = self
            .keys
            .iter()
            .position(|k| k.kid() == kid)
            .ok_or_else(|| Error::NoSuchKey {
                kid: kid.to_owned(),
                known: self
                    .keys
                    .iter()
                    .map(SigningKey::kid)
                    .collect::<Vec<_>>()
                    .join(", "),
            })?;
        if index == 0 {
            return Err(Error::RetireActive {
                kid: kid.to_owned(),
            });
        }
        let mut keys = self.keys.clone();
        keys.remove(index);
        write_ring(&self.path, &keys)?;
        self.keys = keys;
        Ok(())
    }

    fn save(&self) -> Result<(), Error> {
        write_ring(&self.path, &self.keys)
    }
}

fn write_ring(path: &Path, keys: &[SigningKey]) -> Result<(), Error> {
    let file = KeySetFile {
        keys: keys.iter().map(SigningKey::to_private_jwk).collect(),
    };
    write_private(path, &file)
}

/// Creates `dir` and its parents when missing; a directory created here is owner-only on
/// unix, since it will hold private keys. An existing directory is left as it is.
fn create_private_dir(dir: &Path) -> Result<(), Error> {
    let mut builder = std::fs::DirBuilder::new();
    builder.recursive(true);
    #[cfg(unix)]
    std::os::unix::fs::DirBuilderExt::mode(&mut builder, 0o700);
    builder.create(dir).map_err(|source| Error::Io {
        action: "create directory",
        path: dir.to_owned(),
        source,
    })
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, UNIX_EPOCH};

    use super::*;
    use crate::TokenError;
    use crate::claims::tests::sample;

    fn now() -> std::time::SystemTime {
        UNIX_EPOCH + Duration::from_secs(1_800_000_100)
    }

    #[test]
    fn open_creates_a_private_ring_and_reopens_the_same_keys() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("data").join("policy");
        let ring = KeyRing::open(&dir).unwrap();
        assert_eq!(ring.keys().len(), 1);
        assert_eq!(ring.path(), dir.join(KEYRING_FILE));
        let claims = sample();
        let token = ring.signer().sign(&claims).unwrap();
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode();
            assert_eq!(
                mode(ring.path()) & 0o077,
                0,
                "ring file is readable by others"
            );
            assert_eq!(mode(&dir) & 0o077, 0, "ring directory is open to others");
        }

        let reopened = KeyRing::open(&dir).unwrap();
        assert_eq!(reopened.active().kid(), ring.active().kid());
        // A token signed before the restart verifies after it.
        assert_eq!(reopened.verifier().verify(&token, now()).unwrap(), claims);
    }

    #[test]
    fn rotation_keeps_old_tokens_valid_until_retired() {
        let tmp = tempfile::tempdir().unwrap();
        let mut ring = KeyRing::open(tmp.path()).unwrap();
        let claims = sample();
        let old_kid = ring.active().kid().to_owned();
        let old_token = ring.signer().sign(&claims).unwrap();

        let new_kid = ring.rotate().unwrap().kid().to_owned();
        assert_ne!(new_kid, old_kid);
        let new_token = ring.signer().sign(&claims).unwrap();
        let jwks = ring.jwks();
        assert_eq!(
            jwks.iter().map(|k| k.kid.as_str()).collect::<Vec<_>>(),
            vec![new_kid.as_str(), old_kid.as_str()],
            "the active key comes first"
        );
        // Verifiers built either way (from the ring, or from the published keys) accept
        // both tokens.
        for verifier in [ring.verifier(), Verifier::from_jwks(&jwks).unwrap()] {
            assert_eq!(verifier.verify(&old_token, now()).unwrap(), claims);
            assert_eq!(verifier.verify(&new_token, now()).unwrap(), claims);
        }

        assert!(matches!(
            ring.retire(&new_kid),
            Err(Error::RetireActive { .. })
        ));
        assert!(matches!(
            ring.retire("nope"),
            Err(Error::NoSuchKey { known, .. }) if known.contains(&old_kid)
        ));
        ring.retire(&old_kid).unwrap();
        let verifier = Verifier::from_jwks(&ring.jwks()).unwrap();
        assert_eq!(
            verifier.verify(&old_token, now()),
            Err(TokenError::UnknownKey {
                kid: old_kid.clone()
            })
        );
        assert!(verifier.verify(&new_token, now()).is_ok());

        // Every step was persisted.
        let reopened = KeyRing::open(tmp.path()).unwrap();
        assert_eq!(
            reopened
                .keys()
                .iter()
                .map(SigningKey::kid)
                .collect::<Vec<_>>(),
            vec![new_kid.as_str()]
        );
    }

    #[test]
    fn a_damaged_ring_is_reported_not_replaced() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join(KEYRING_FILE);
        for content in [&b"{\"keys\": []}"[..], b"{\"keys\": [{}]}", b"garbage"] {
            std::fs::write(&path, content).unwrap();
            let err = KeyRing::open(tmp.path()).unwrap_err();
            assert!(matches!(err, Error::KeyFile { .. }), "{err}");
            // Generating a fresh key here would silently invalidate every issued token.
            assert_eq!(std::fs::read(&path).unwrap(), content);
        }
        let ring = KeyRing::open(tempfile::tempdir().unwrap().path()).unwrap();
        let key = ring.active().to_private_jwk();
        let twice = serde_json::json!({ "keys": [&key, &key] });
        std::fs::write(&path, twice.to_string()).unwrap();
        let err = KeyRing::open(tmp.path()).unwrap_err();
        assert!(err.to_string().contains("appears twice"), "{err}");
    }
}
