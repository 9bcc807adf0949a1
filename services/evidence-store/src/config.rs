//! The evidence store's configuration.
//!
//! `Config::default()` is the development setup of the payment-incident example:
//! artifacts under `./.convene/artifacts`, the policy service on its default local port,
//! the example policy built into the binary (its principals may read evidence with role
//! `evidence:read`), development credentials in `./.convene/credentials`.
//!
//! The `[artifacts]` section ([`ArtifactsConfig`]) moves artifact bytes to an
//! S3-compatible bucket, so that several evidence-store replicas sharing one database
//! also share the bytes:
//!
//! ```toml
//! database_url = "postgres://convene@db/convene"
//!
//! [artifacts]
//! store = "s3"
//! bucket = "convene-evidence"
//! prefix = "prod"                      # objects at prod/<tenant>/<sha256>
//! endpoint = "http://minio:9000"       # unset: AWS S3 in `region`
//! region = "us-east-1"
//! allow_http = true                    # plain HTTP, for a local MinIO
//! ```
//!
//! Credentials are never configuration: the S3 client takes them from the standard AWS
//! environment (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN`, or a
//! web-identity, container or instance role), so `--dump-config` cannot show them.

use std::path::PathBuf;

use convene_mesh::policy_file::PolicySource;
use convene_server::{ServerSettings, ServiceCommon};
use serde::{Deserialize, Serialize};

/// The port the evidence store listens on by default.
pub const DEFAULT_PORT: u16 = 7402;

/// The default data directory.
pub const DEFAULT_DATA_DIR: &str = convene_server::DEFAULT_DATA_DIR;

/// The default largest artifact: 4 MiB.
pub const DEFAULT_MAX_ARTIFACT_BYTES: usize = 4 * 1024 * 1024;

/// The default policy service endpoint, whose public keys verify task tokens.
pub const DEFAULT_POLICY_ENDPOINT: &str = "http://127.0.0.1:7401";

/// Room for the fields around an artifact's bytes in a request (media type, evidence
/// record). The store's own message limit is `max_artifact_bytes` plus this, so an
/// artifact slightly over the limit still reaches the service and is refused with a
/// message that names `max_artifact_bytes`, instead of a transport error.
pub const ENVELOPE_ALLOWANCE: usize = 1024 * 1024;

/// Configuration of the evidence store. The shared keys are in
/// [`common`](Self::common), which the config also derefs to: the server (listening on
/// `127.0.0.1:7402` by default; its `max_message_bytes` does not bound this service's own
/// messages, `max_artifact_bytes` does, plus room for the other fields); the data
/// directory (artifact bytes in `<data_dir>/artifacts/<tenant>/<sha256>` unless
/// [`artifacts`](Self::artifacts) names a bucket); the policy file, whose principals may
/// read evidence with their own credential when they hold role `evidence:read`; and
/// `database_url`, where artifact metadata and evidence records are stored.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// The keys every service that reads the policy file shares.
    #[serde(flatten)]
    pub common: ServiceCommon,
    /// Largest artifact accepted, in bytes.
    pub max_artifact_bytes: usize,
    /// The policy service, whose signing keys verify task tokens offline.
    pub policy_endpoint: String,
    /// Where artifact bytes are kept: the `[artifacts]` section.
    pub artifacts: ArtifactsConfig,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            common: ServiceCommon::new(ServerSettings::on_port(DEFAULT_PORT)),
            max_artifact_bytes: DEFAULT_MAX_ARTIFACT_BYTES,
            policy_endpoint: DEFAULT_POLICY_ENDPOINT.to_owned(),
            artifacts: ArtifactsConfig::default(),
        }
    }
}

/// The region of an S3 store whose `region` is not configured.
pub const DEFAULT_S3_REGION: &str = "us-east-1";

/// The kind of store that keeps artifact bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum StoreKind {
    /// The local file system, under `<data_dir>/artifacts`: one process owns the bytes.
    #[default]
    File,
    /// An S3-compatible bucket (AWS S3, MinIO, Ceph, moto, ...), shared by replicas.
    S3,
}

/// The `[artifacts]` section: where artifact bytes are kept. Every key has an
/// environment override, `CONVENE_ARTIFACTS__<KEY>` (`CONVENE_ARTIFACTS__BUCKET`, ...).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ArtifactsConfig {
    /// `file` (the default: `<data_dir>/artifacts`) or `s3`.
    pub store: StoreKind,
    /// The bucket, which must exist; required for `store = "s3"`.
    #[serde(default)]
    pub bucket: Option<String>,
    /// A key prefix within the bucket: objects are kept at `<prefix>/<tenant>/<sha256>`
    /// (unset: `<tenant>/<sha256>`).
    #[serde(default)]
    pub prefix: Option<String>,
    /// The URL of an S3-compatible server, e.g. `http://minio:9000` (unset: AWS S3).
    #[serde(default)]
    pub endpoint: Option<String>,
    /// The bucket's region; it takes precedence over `AWS_REGION`.
    pub region: String,
    /// Whether plain-HTTP endpoints are allowed (a local MinIO or moto); off, only HTTPS.
    pub allow_http: bool,
}

impl Default for ArtifactsConfig {
    fn default() -> Self {
        Self {
            store: StoreKind::File,
            bucket: None,
            prefix: None,
            endpoint: None,
            region: DEFAULT_S3_REGION.to_owned(),
            allow_http: false,
        }
    }
}

/// An S3 store's settings, checked: what [`ArtifactsConfig::s3`] returns.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct S3Settings {
    /// The bucket.
    pub bucket: String,
    /// The key prefix, without leading or trailing `/`; `None` when empty.
    pub prefix: Option<String>,
    /// The server's URL; `None` for AWS S3.
    pub endpoint: Option<String>,
    /// The region.
    pub region: String,
    /// Whether plain HTTP is allowed.
    pub allow_http: bool,
}

impl S3Settings {
    /// `bucket B, prefix P, endpoint E, region R` for the start-up log line (no
    /// credentials: they are not part of the settings).
    pub fn describe(&self) -> String {
        format!(
            "bucket {}, prefix {}, endpoint {}, region {}",
            self.bucket,
            self.prefix.as_deref().unwrap_or("(none)"),
            self.endpoint.as_deref().unwrap_or("AWS S3"),
            self.region
        )
    }
}

impl ArtifactsConfig {
    /// The S3 settings when `store = "s3"`, `None` for the file store.
    ///
    /// # Errors
    ///
    /// What to fix, naming the key: a missing or empty `artifacts.bucket`; S3 keys set
    /// while `store = "file"` (they would be ignored); an endpoint that is not an
    /// `http://` or `https://` URL, or is `http://` without `allow_http`.
    pub fn s3(&self) -> Result<Option<S3Settings>, String> {
        let non_empty = |value: &Option<String>| {
            value
                .as_deref()
                .map(str::trim)
                .filter(|v| !v.is_empty())
                .map(str::to_owned)
        };
        if self.store == StoreKind::File {
            let s3_only = [
                ("bucket", &self.bucket),
                ("prefix", &self.prefix),
                ("endpoint", &self.endpoint),
            ];
            if let Some((key, _)) = s3_only.iter().find(|(_, value)| value.is_some()) {
                return Err(format!(
                    "artifacts.{key} is set but artifacts.store is \"file\", which keeps the \
                     bytes in <data_dir>/artifacts; set artifacts.store = \"s3\" \
                     (CONVENE_ARTIFACTS__STORE=s3) to use a bucket, or remove artifacts.{key}"
                ));
            }
            return Ok(None);
        }
        let bucket = non_empty(&self.bucket).ok_or_else(|| {
            "artifacts.bucket is required when artifacts.store = \"s3\": name an existing \
             bucket in the [artifacts] section or in CONVENE_ARTIFACTS__BUCKET"
                .to_owned()
        })?;
        let prefix = self
            .prefix
            .as_deref()
            .map(|p| p.trim().trim_matches('/'))
            .filter(|p| !p.is_empty())
            .map(str::to_owned);
        let endpoint = non_empty(&self.endpoint);
        if let Some(url) = &endpoint {
            let scheme = url.split_once("://").map(|(scheme, _)| scheme);
            match scheme {
                Some("https") => {}
                Some("http") if self.allow_http => {}
                Some("http") => {
                    return Err(format!(
                        "artifacts.endpoint is {url}, plain HTTP, but artifacts.allow_http is \
                         false; set allow_http = true (CONVENE_ARTIFACTS__ALLOW_HTTP=true) for a \
                         server without TLS, or use its https:// URL"
                    ));
                }
                _ => {
                    return Err(format!(
                        "artifacts.endpoint is {url:?}; expected an http:// or https:// URL of \
                         the S3-compatible server, e.g. http://minio:9000"
                    ));
                }
            }
        }
        let region = self.region.trim();
        if region.is_empty() {
            return Err(format!(
                "artifacts.region is empty; name the bucket's region (default \
                 {DEFAULT_S3_REGION})"
            ));
        }
        Ok(Some(S3Settings {
            bucket,
            prefix,
            endpoint,
            region: region.to_owned(),
            allow_http: self.allow_http,
        }))
    }
}

convene_server::common_section!(Config);

impl Config {
    /// Development settings with the data kept under `data_dir`.
    pub fn in_dir(data_dir: impl Into<PathBuf>) -> Self {
        Self {
            common: ServiceCommon {
                data_dir: data_dir.into(),
                ..Self::default().common
            },
            ..Self::default()
        }
    }

    /// Where artifact bytes are kept by the file store (`artifacts.store = "file"`).
    pub fn artifacts_dir(&self) -> PathBuf {
        self.data_dir.join("artifacts")
    }

    /// The largest message the store's gRPC service accepts and sends.
    pub fn message_limit(&self) -> usize {
        self.max_artifact_bytes.saturating_add(ENVELOPE_ALLOWANCE)
    }

    /// Where the policy comes from: `policy_file` (unset: the embedded example), with
    /// development credentials in `<data_dir>/credentials` when `dev_credentials` is on.
    pub fn policy_source(&self) -> PolicySource {
        PolicySource::new(self.policy_file.clone(), self.dev_credentials_dir())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_the_development_settings() {
        let config = Config::default();
        assert_eq!(config.server.listen.port(), DEFAULT_PORT);
        assert_eq!(
            config.artifacts_dir(),
            PathBuf::from("./.convene/artifacts")
        );
        assert_eq!(config.max_artifact_bytes, 4 * 1024 * 1024);
        assert!(config.message_limit() > config.max_artifact_bytes);
        assert_eq!(config.policy_file, None);
        assert!(config.dev_credentials);
        assert_eq!(
            config.policy_source().name(),
            convene_mesh::policy_file::EXAMPLE_POLICY_NAME
        );
    }

    #[test]
    fn the_example_policy_lets_its_people_read_evidence() {
        let config = Config {
            common: ServiceCommon {
                dev_credentials: false,
                ..Config::in_dir("/nonexistent").common
            },
            ..Config::default()
        };
        let (policy, _) = config
            .policy_source()
            .load()
            .expect("the embedded example compiles");
        for id in ["oncall@acme", "alice@acme", "bob@acme", "analyst@globex"] {
            let principal = &policy.principals[id];
            assert!(
                principal.has_role(crate::READER_ROLE),
                "{id} lacks {}",
                crate::READER_ROLE
            );
        }
        // Services of the mesh read evidence with task tokens, never as principals.
        assert!(!policy.principals["worker-pool"].has_role(crate::READER_ROLE));
    }

    #[test]
    fn development_credentials_are_created_in_the_data_dir() {
        let dir = tempfile::tempdir().unwrap();
        let config = Config::in_dir(dir.path());
        let (policy, _) = config.policy_source().load().unwrap();
        let secret =
            convene_mesh::policy_file::dev_credential(&config.credentials_dir(), "oncall@acme")
                .expect("the credential file exists");
        let principal = policy
            .principal_by_credential(&secret)
            .expect("the development credential authenticates");
        assert_eq!(principal.id, "oncall@acme");

        let missing = Config {
            common: ServiceCommon {
                policy_file: Some(dir.path().join("absent.yaml")),
                ..Config::in_dir(dir.path()).common
            },
            ..Config::default()
        };
        let err = missing.policy_source().load().unwrap_err();
        assert!(err.to_string().contains("absent.yaml"), "{err}");
    }

    #[test]
    fn env_overrides_and_unknown_keys() {
        let config: Config = convene_server::ConfigLoader::new()
            .env([
                ("CONVENE_DATA_DIR", "/data"),
                ("CONVENE_MAX_ARTIFACT_BYTES", "1024"),
                ("CONVENE_POLICY_ENDPOINT", "http://policy:7401"),
                ("CONVENE_POLICY_FILE", "/etc/convene/policy.yaml"),
                ("CONVENE_DEV_CREDENTIALS", "false"),
            ])
            .load()
            .unwrap();
        assert_eq!(config.data_dir, PathBuf::from("/data"));
        assert_eq!(config.max_artifact_bytes, 1024);
        assert_eq!(config.policy_endpoint, "http://policy:7401");
        assert_eq!(
            config.policy_file,
            Some(PathBuf::from("/etc/convene/policy.yaml"))
        );
        assert!(!config.dev_credentials);
        let err = convene_server::ConfigLoader::new()
            .env([("CONVENE_MAX_ARTIFACT_BYTE", "1")])
            .load::<Config>()
            .unwrap_err();
        assert!(
            err.to_string().contains("CONVENE_MAX_ARTIFACT_BYTE"),
            "{err}"
        );
    }

    #[test]
    fn the_artifacts_section_comes_from_file_and_environment() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("evidence.toml");
        std::fs::write(
            &file,
            "[artifacts]\nstore = \"s3\"\nbucket = \"from-file\"\nprefix = \"/prod/eu/\"\n",
        )
        .unwrap();
        let config: Config = convene_server::ConfigLoader::new()
            .file(&file)
            .env([
                ("CONVENE_ARTIFACTS__BUCKET", "evidence"),
                ("CONVENE_ARTIFACTS__ENDPOINT", "http://127.0.0.1:9000"),
                ("CONVENE_ARTIFACTS__REGION", "eu-west-1"),
                ("CONVENE_ARTIFACTS__ALLOW_HTTP", "true"),
            ])
            .load()
            .unwrap();
        assert_eq!(config.artifacts.store, StoreKind::S3);
        let s3 = config.artifacts.s3().unwrap().expect("an S3 store");
        assert_eq!(
            s3,
            S3Settings {
                bucket: "evidence".into(),
                prefix: Some("prod/eu".into()),
                endpoint: Some("http://127.0.0.1:9000".into()),
                region: "eu-west-1".into(),
                allow_http: true,
            }
        );

        // The dump loads back as the same configuration, and the default is the file store.
        let dumped = convene_server::dump(&config, convene_server::Format::Toml).unwrap();
        assert!(dumped.contains("[artifacts]\nstore = \"s3\""), "{dumped}");
        let again = dir.path().join("again.toml");
        std::fs::write(&again, &dumped).unwrap();
        let reloaded: Config = convene_server::ConfigLoader::new()
            .file(&again)
            .load()
            .unwrap();
        assert_eq!(reloaded, config);
        assert_eq!(Config::default().artifacts.s3(), Ok(None));
    }

    #[test]
    fn credentials_are_not_artifacts_keys() {
        let err = convene_server::ConfigLoader::new()
            .env([("CONVENE_ARTIFACTS__SECRET_ACCESS_KEY", "s3cr3t-value")])
            .load::<Config>()
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("CONVENE_ARTIFACTS__SECRET_ACCESS_KEY") && !err.contains("s3cr3t-value"),
            "{err}"
        );
    }

    #[test]
    fn an_unusable_artifacts_section_names_the_key_to_fix() {
        let s3 = |f: fn(&mut ArtifactsConfig)| {
            let mut artifacts = ArtifactsConfig {
                store: StoreKind::S3,
                bucket: Some("evidence".into()),
                ..ArtifactsConfig::default()
            };
            f(&mut artifacts);
            artifacts.s3().unwrap_err()
        };
        let cases = [
            (s3(|a| a.bucket = None), "artifacts.bucket is required"),
            (
                s3(|a| a.bucket = Some(" ".into())),
                "CONVENE_ARTIFACTS__BUCKET",
            ),
            (
                s3(|a| a.endpoint = Some("http://minio:9000".into())),
                "artifacts.allow_http is false",
            ),
            (
                s3(|a| a.endpoint = Some("minio:9000".into())),
                "artifacts.endpoint is \"minio:9000\"",
            ),
            (
                s3(|a| a.region = String::new()),
                "artifacts.region is empty",
            ),
        ];
        for (err, expected) in cases {
            assert!(err.contains(expected), "{err}");
        }
        let file_with_bucket = ArtifactsConfig {
            bucket: Some("evidence".into()),
            ..ArtifactsConfig::default()
        };
        let err = file_with_bucket.s3().unwrap_err();
        assert!(
            err.contains("artifacts.bucket is set but artifacts.store is \"file\""),
            "{err}"
        );
    }
}
