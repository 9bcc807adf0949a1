//! The signing keys as the service uses them: a persistent ring, plus a signer, a
//! verifier and the JWKS built from it once and swapped as a whole on rotation.

use std::sync::{Arc, Mutex, PoisonError, RwLock};

use convene_proto::v1;
use convene_tokens::{KeyRing, Signer, Verifier};

/// What calls need from the ring, built once per ring state. Authorize clones the `Arc`
/// and verifies without holding any lock.
pub(crate) struct KeySet {
    /// Signs new tokens with the active key.
    pub(crate) signer: Signer,
    /// Trusts every key of the ring (the previous ones keep verifying after rotation).
    pub(crate) verifier: Verifier,
    /// The public keys, active first.
    pub(crate) jwks: Vec<v1::Jwk>,
}

impl KeySet {
    fn of(ring: &KeyRing) -> Self {
        Self {
            signer: ring.signer(),
            verifier: ring.verifier(),
            jwks: ring.jwks(),
        }
    }
}

/// The ring and its current [`KeySet`].
pub(crate) struct Keys {
    /// Only rotation touches the ring; the mutex serializes rotations.
    ring: Mutex<KeyRing>,
    current: RwLock<Arc<KeySet>>,
}

impl Keys {
    pub(crate) fn new(ring: KeyRing) -> Self {
        let current = RwLock::new(Arc::new(KeySet::of(&ring)));
        Self {
            ring: Mutex::new(ring),
            current,
        }
    }

    /// The current signer, verifier and JWKS.
    pub(crate) fn current(&self) -> Arc<KeySet> {
        self.current
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Stops trusting key `kid` (not the active one): tokens it signed no longer verify
    /// here, and verifiers elsewhere drop it at their next refresh of GetSigningKeys.
    pub(crate) fn retire(&self, kid: &str) -> Result<(), convene_tokens::Error> {
        let mut ring = self.ring.lock().unwrap_or_else(PoisonError::into_inner);
        ring.retire(kid)?;
        let set = Arc::new(KeySet::of(&ring));
        *self.current.write().unwrap_or_else(PoisonError::into_inner) = set;
        Ok(())
    }

    /// Makes a new key active, keeping the previous ones; returns the new key id.
    pub(crate) fn rotate(&self) -> Result<String, convene_tokens::Error> {
        let mut ring = self.ring.lock().unwrap_or_else(PoisonError::into_inner);
        let kid = ring.rotate()?.kid().to_owned();
        let set = Arc::new(KeySet::of(&ring));
        *self.current.write().unwrap_or_else(PoisonError::into_inner) = set;
        Ok(kid)
    }
}
