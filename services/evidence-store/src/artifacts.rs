//! Artifact names and bytes.
//!
//! An artifact is named by its tenant and the SHA-256 of its bytes:
//! `artifact://<tenant>/<sha256 hex>`. The bytes live in an [`ObjectStore`] under
//! `<tenant>/<sha256 hex>`, written with [`PutMode::Create`], so there is no code path
//! that overwrites an artifact: storing the same bytes again finds them in place. The
//! local file system is the default store; an S3-compatible bucket
//! (`artifacts.store = "s3"`) keeps them at `[<prefix>/]<tenant>/<sha256 hex>`, written
//! with `If-None-Match: *`, so replicas sharing the bucket share the bytes.
//!
//! Whatever the store, the bytes read back are re-hashed by the service before they are
//! served (bytes whose hash differs from their name are `DATA_LOSS`): nothing here trusts
//! the store to keep them intact.

use std::fmt;
use std::path::Path;
use std::sync::Arc;

use bytes::Bytes;
use object_store::aws::{AmazonS3Builder, AmazonS3ConfigKey};
use object_store::local::LocalFileSystem;
use object_store::path::Path as ObjectPath;
use object_store::prefix::PrefixStore;
use object_store::{ObjectStore, ObjectStoreExt as _, PutMode, PutOptions, PutPayload};
use sha2::{Digest as _, Sha256};

use crate::Error;
use crate::config::{Config, S3Settings};

/// What replaces a credential in error text.
const REDACTED: &str = "[redacted]";

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
#[derive(Clone)]
pub struct Blobs {
    store: Arc<dyn ObjectStore>,
    /// What the store is, for logs: `file system <dir>`, `s3 bucket <b>, ...`.
    description: Arc<str>,
    /// Credential values (from the AWS environment) that error text must not carry.
    secrets: Arc<[String]>,
}

impl fmt::Debug for Blobs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Not the store's own Debug: an S3 client's holds its credential provider.
        f.debug_struct("Blobs")
            .field("store", &self.description)
            .finish_non_exhaustive()
    }
}

impl fmt::Display for Blobs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.description)
    }
}

impl Blobs {
    /// The store `config.artifacts` names: the file system under
    /// [`Config::artifacts_dir`], or an S3 bucket whose credentials come from the
    /// process's AWS environment (see [`s3`](Self::s3)). Logs which store it opened.
    ///
    /// # Errors
    ///
    /// [`Error::Config`] naming the `artifacts.*` key to fix, and the errors of
    /// [`local`](Self::local) and [`s3`](Self::s3).
    pub fn open(config: &Config) -> Result<Self, Error> {
        match config.artifacts.s3().map_err(Error::Config)? {
            None => {
                let dir = config.artifacts_dir();
                let blobs = Self::local(&dir)?;
                tracing::info!(store = "file", dir = %dir.display(), "artifact bytes are kept on the local file system");
                Ok(blobs)
            }
            Some(settings) => {
                let blobs = Self::s3(&settings, std::env::vars())?;
                tracing::info!(
                    store = "s3",
                    bucket = %settings.bucket,
                    prefix = settings.prefix.as_deref().unwrap_or(""),
                    endpoint = settings.endpoint.as_deref().unwrap_or("AWS S3"),
                    region = %settings.region,
                    "artifact bytes are kept in an S3 bucket"
                );
                Ok(blobs)
            }
        }
    }

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
        let store = LocalFileSystem::new_with_prefix(dir)
            .map_err(|e| Error::Storage(error_text(&e)))?
            .with_fsync(true);
        Ok(Self {
            store: Arc::new(store),
            description: format!("file system {}", dir.display()).into(),
            secrets: Arc::new([]),
        })
    }

    /// Bytes in the S3 bucket `settings` names. The client is configured from the
    /// `AWS_*` variables of `env` as object_store reads them (credentials:
    /// `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN`; else a web
    /// identity, container or instance role), then from `settings`, which win for the
    /// bucket, region, endpoint and `allow_http`. The values of secret variables (those
    /// whose name has `SECRET` or `TOKEN` in it) are kept only to be cut out of error
    /// text. HTTPS uses rustls with ring, installed as the process's provider unless one
    /// is installed already.
    ///
    /// # Errors
    ///
    /// [`Error::Storage`] when the client cannot be built from these settings.
    pub fn s3(
        settings: &S3Settings,
        env: impl IntoIterator<Item = (String, String)>,
    ) -> Result<Self, Error> {
        // Another part of the process may have installed it first; either way one is.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let mut builder = AmazonS3Builder::new();
        let mut secrets = Vec::new();
        for (name, value) in env {
            if !name.starts_with("AWS_") {
                continue;
            }
            if (name.contains("SECRET") || name.contains("TOKEN")) && !value.is_empty() {
                secrets.push(value.clone());
            }
            if let Ok(key) = name.to_ascii_lowercase().parse::<AmazonS3ConfigKey>() {
                builder = builder.with_config(key, value);
            }
        }
        let mut builder = builder
            .with_bucket_name(&settings.bucket)
            .with_region(&settings.region)
            .with_allow_http(settings.allow_http);
        if let Some(endpoint) = &settings.endpoint {
            builder = builder.with_endpoint(endpoint);
        }
        let secrets: Arc<[String]> = secrets.into();
        let store = builder
            .build()
            .map_err(|e| Error::Storage(redact(&error_text(&e), &secrets)))?;
        let store: Arc<dyn ObjectStore> = match &settings.prefix {
            Some(prefix) => Arc::new(PrefixStore::new(store, prefix.as_str())),
            None => Arc::new(store),
        };
        Ok(Self {
            store,
            description: format!("s3 {}", settings.describe()).into(),
            secrets,
        })
    }

    /// Bytes in any object store.
    pub fn new(store: Arc<dyn ObjectStore>) -> Self {
        let description = format!("object store {store}").into();
        Self {
            store,
            description,
            secrets: Arc::new([]),
        }
    }

    /// A store error as [`Error::Storage`], its text (with its causes) free of the
    /// credentials this store knows and of session tokens quoted from requests.
    fn failed(&self, error: &object_store::Error) -> Error {
        Error::Storage(redact(&error_text(error), &self.secrets))
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
            Err(e) => Err(self.failed(&e)),
        }
    }

    /// The bytes of `artifact`, or `None` when they are not stored.
    ///
    /// # Errors
    ///
    /// [`Error::Storage`] when the store fails.
    pub async fn get(&self, artifact: &ArtifactRef) -> Result<Option<Bytes>, Error> {
        match self.store.get(&artifact.location()).await {
            Ok(found) => found.bytes().await.map(Some).map_err(|e| self.failed(&e)),
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(self.failed(&e)),
        }
    }
}

/// `error` followed by those of its causes whose text it does not already include.
fn error_text(error: &(dyn std::error::Error + 'static)) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let line = cause.to_string();
        if !text.contains(&line) {
            text.push_str(": ");
            text.push_str(&line);
        }
        source = cause.source();
    }
    text
}

/// `text` with every one of `secrets` and every `x-amz-security-token` value replaced by
/// `[redacted]`. An S3 error quotes the server's response, which may quote the signed
/// request, session-token header included; tokens fetched at run time (web identity,
/// instance roles) are not among `secrets`, so the header's value is cut out by name.
pub(crate) fn redact(text: &str, secrets: &[String]) -> String {
    let mut text = text.to_owned();
    for secret in secrets.iter().filter(|s| !s.is_empty()) {
        text = text.replace(secret.as_str(), REDACTED);
    }
    redact_header_values(&text, "x-amz-security-token")
}

/// `text` with the value after each (case-insensitive) `name`, written `name: value`,
/// `name=value` or `name>value<`, replaced by `[redacted]`.
fn redact_header_values(text: &str, name: &str) -> String {
    // ASCII lowercasing keeps every byte where it is, so positions carry over.
    let lower = text.to_ascii_lowercase();
    let mut out = String::with_capacity(text.len());
    let mut copied = 0;
    let mut from = 0;
    while let Some(found) = lower[from..].find(name) {
        let after_name = from + found + name.len();
        let rest = &text[after_name..];
        let separator = rest.len()
            - rest
                .trim_start_matches([':', '=', '>', ' ', '\t', '"'])
                .len();
        let value_start = after_name + separator;
        let value_len = text[value_start..]
            .find(|c: char| c.is_whitespace() || matches!(c, '&' | '<' | '"' | '\'' | ','))
            .unwrap_or(text.len() - value_start);
        if separator > 0 && value_len > 0 {
            out.push_str(&text[copied..value_start]);
            out.push_str(REDACTED);
            copied = value_start + value_len;
        }
        from = (value_start + value_len).max(after_name);
    }
    out.push_str(&text[copied..]);
    out
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

    #[test]
    fn credentials_are_cut_out_of_error_text() {
        let secrets = vec!["wJalrXUtnFEMI/K7MDENG".to_owned(), String::new()];
        let body = "403 Forbidden: <Error><Code>SignatureDoesNotMatch</Code>\
            <CanonicalRequest>PUT /b/k\nhost:s3\nx-amz-security-token:FQoGZXIvYXdzEJr\n\
            </CanonicalRequest><Key>wJalrXUtnFEMI/K7MDENG</Key></Error> \
            X-Amz-Security-Token=IQoJb3JpZ2lu&X-Amz-Date=1";
        let clean = redact(body, &secrets);
        for secret in ["wJalrXUtnFEMI/K7MDENG", "FQoGZXIvYXdzEJr", "IQoJb3JpZ2lu"] {
            assert!(!clean.contains(secret), "{clean}");
        }
        assert!(
            clean.contains("x-amz-security-token:[redacted]\n")
                && clean.contains("X-Amz-Security-Token=[redacted]&X-Amz-Date=1")
                && clean.contains("<Key>[redacted]</Key>"),
            "{clean}"
        );
        assert_eq!(
            redact("no credentials here", &secrets),
            "no credentials here"
        );
        assert_eq!(
            redact("x-amz-security-token", &secrets),
            "x-amz-security-token"
        );
    }

    #[test]
    fn an_s3_store_is_described_without_its_credentials() {
        let settings = S3Settings {
            bucket: "evidence".into(),
            prefix: Some("prod/eu".into()),
            endpoint: Some("http://127.0.0.1:9000".into()),
            region: "eu-west-1".into(),
            allow_http: true,
        };
        let env = [
            ("AWS_ACCESS_KEY_ID", "AKIDEXAMPLE"),
            ("AWS_SECRET_ACCESS_KEY", "s3cr3t-never-shown"),
            ("AWS_SESSION_TOKEN", "t0ken-never-shown"),
            ("HOME", "/root"),
        ]
        .map(|(k, v)| (k.to_owned(), v.to_owned()));
        let blobs = Blobs::s3(&settings, env).expect("the client builds");
        let shown = format!("{blobs:?} {blobs}");
        assert!(
            shown.contains("bucket evidence, prefix prod/eu, endpoint http://127.0.0.1:9000"),
            "{shown}"
        );
        assert!(
            !shown.contains("never-shown") && !shown.contains("AKIDEXAMPLE"),
            "{shown}"
        );
        assert_eq!(
            &*blobs.secrets,
            [
                "s3cr3t-never-shown".to_owned(),
                "t0ken-never-shown".to_owned()
            ]
        );
    }
}
