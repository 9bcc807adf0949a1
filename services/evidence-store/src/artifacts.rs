//! Artifact names and bytes.
//!
//! An artifact is named by its tenant and the SHA-256 of its bytes:
//! `artifact://<tenant>/<sha256 hex>`. The bytes live in an [`ObjectStore`] under
//! `<tenant>/<sha256 hex>`, written with [`PutMode::Create`], so there is no code path
//! that overwrites an artifact: storing the same bytes again finds them in place. The
//! local file system is the default store; an S3-compatible one fits the same seam.

use std::path::Path;
use std::sync::Arc;

use bytes::Bytes;
use object_store::local::LocalFileSystem;
use object_store::path::Path as ObjectPath;
use object_store::{ObjectStore, ObjectStoreExt as _, PutMode, PutOptions, PutPayload};
use sha2::{Digest as _, Sha256};

use crate::Error;

/// The scheme of artifact URIs.
pub const SCHEME: &str = "artifact://";

/// Hex SHA-256 of `bytes`.
pub fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

/// The name of one artifact.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ArtifactRef {
    /// The tenant owning it.
    pub tenant: String,
    /// Hex SHA-256 of its bytes (64 lowercase digits).
    pub sha256: String,
}

impl ArtifactRef {
    /// The artifact holding `bytes` in `tenant`.
    pub fn of(tenant: &str, bytes: &[u8]) -> Self {
        Self {
            tenant: tenant.to_owned(),
            sha256: sha256_hex(bytes),
        }
    }

    /// Parses `artifact://<tenant>/<sha256 hex>`.
    ///
    /// # Errors
    ///
    /// What is wrong with the URI, for the caller.
    pub fn parse(uri: &str) -> Result<Self, String> {
        let rest = uri.strip_prefix(SCHEME).ok_or_else(|| {
            format!("`{uri}` is not an artifact URI; expected artifact://<tenant>/<sha256 hex>")
        })?;
        let (tenant, sha256) = rest.rsplit_once('/').ok_or_else(|| {
            format!(
                "`{uri}` lacks the /<sha256 hex> part; expected artifact://<tenant>/<sha256 hex>"
            )
        })?;
        if tenant.is_empty() {
            return Err(format!("`{uri}` names no tenant"));
        }
        if !is_sha256_hex(sha256) {
            return Err(format!(
                "`{uri}` does not end in a SHA-256 (64 lowercase hex digits)"
            ));
        }
        Ok(Self {
            tenant: tenant.to_owned(),
            sha256: sha256.to_owned(),
        })
    }

    /// `artifact://<tenant>/<sha256 hex>`.
    pub fn uri(&self) -> String {
        format!("{SCHEME}{}/{}", self.tenant, self.sha256)
    }

    /// `sha256:<hex>`, the content-hash format used across convene.
    pub fn content_hash(&self) -> String {
        format!("sha256:{}", self.sha256)
    }

    /// Where the bytes are kept in the object store.
    fn location(&self) -> ObjectPath {
        ObjectPath::from_iter([self.tenant.as_str(), self.sha256.as_str()])
    }
}

/// Whether `s` is 64 lowercase hex digits.
pub fn is_sha256_hex(s: &str) -> bool {
    s.len() == 64 && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

/// Artifact bytes in an object store.
#[derive(Debug, Clone)]
pub struct Blobs {
    store: Arc<dyn ObjectStore>,
}

impl Blobs {
    /// Bytes in `dir` on the local file system (created if missing), each write fsynced
    /// before it is acknowledged: evidence is only worth something if it survives.
    ///
    /// # Errors
    ///
    /// [`Error::DataDir`] when the directory cannot be created, [`Error::Storage`] when
    /// the store cannot be opened on it.
    pub fn local(dir: &Path) -> Result<Self, Error> {
        std::fs::create_dir_all(dir).map_err(|source| Error::DataDir {
            path: dir.display().to_string(),
            source,
        })?;
        let store = LocalFileSystem::new_with_prefix(dir)?.with_fsync(true);
        Ok(Self::new(Arc::new(store)))
    }

    /// Bytes in any object store.
    pub fn new(store: Arc<dyn ObjectStore>) -> Self {
        Self { store }
    }

    /// Stores `bytes` as artifact `artifact` unless it is stored already. Returns whether
    /// this call stored them.
    ///
    /// # Errors
    ///
    /// [`Error::Storage`] when the store fails.
    pub async fn put(&self, artifact: &ArtifactRef, bytes: Vec<u8>) -> Result<bool, Error> {
        let options = PutOptions {
            mode: PutMode::Create,
            ..PutOptions::default()
        };
        match self
            .store
            .put_opts(&artifact.location(), PutPayload::from(bytes), options)
            .await
        {
            Ok(_) => Ok(true),
            Err(object_store::Error::AlreadyExists { .. }) => Ok(false),
            Err(e) => Err(e.into()),
        }
    }

    /// The bytes of `artifact`, or `None` when they are not stored.
    ///
    /// # Errors
    ///
    /// [`Error::Storage`] when the store fails.
    pub async fn get(&self, artifact: &ArtifactRef) -> Result<Option<Bytes>, Error> {
        match self.store.get(&artifact.location()).await {
            Ok(found) => Ok(Some(found.bytes().await?)),
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(e.into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uris_round_trip_and_bad_ones_say_why() {
        let a = ArtifactRef::of("acme", b"rows");
        assert_eq!(ArtifactRef::parse(&a.uri()).unwrap(), a);
        assert_eq!(a.content_hash(), convene_core::ids::content_hash(b"rows"));
        for (bad, why) in [
            ("https://acme/abc", "not an artifact URI"),
            ("artifact://acme", "lacks the /<sha256 hex> part"),
            ("artifact://acme/ABC", "SHA-256"),
            (&format!("artifact:///{}", a.sha256), "names no tenant"),
        ] {
            let err = ArtifactRef::parse(bad).unwrap_err();
            assert!(err.contains(why), "{bad}: {err}");
        }
    }

    #[tokio::test]
    async fn local_bytes_are_created_once_and_never_overwritten() {
        let dir = tempfile::tempdir().unwrap();
        let blobs = Blobs::local(&dir.path().join("artifacts")).unwrap();
        let a = ArtifactRef::of("acme", b"first");
        assert!(blobs.put(&a, b"first".to_vec()).await.unwrap());
        // Even different bytes under the same name cannot replace what is stored.
        assert!(!blobs.put(&a, b"other".to_vec()).await.unwrap());
        assert_eq!(blobs.get(&a).await.unwrap().unwrap().as_ref(), b"first");
        let on_disk = dir.path().join("artifacts/acme").join(&a.sha256);
        assert_eq!(std::fs::read(on_disk).unwrap(), b"first");
        let missing = ArtifactRef::of("acme", b"never stored");
        assert_eq!(blobs.get(&missing).await.unwrap(), None);
    }
}
