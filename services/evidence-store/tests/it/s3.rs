//! Artifacts in an S3-compatible bucket, against moto's S3 server run for real: replicas
//! (the `convene-evidence-store` binary, one process each) sharing one database and one
//! bucket serve each other's artifacts; an object changed or removed in the bucket is
//! `DATA_LOSS`; the AWS credentials of the processes' environment appear in none of their
//! output; and an S3 store without a bucket is refused at start.
//!
//! moto's server is `moto_server` next to the Python that `CONVENE_TEST_PYTHON` names
//! (else the repository's `.venv/bin`); without it the tests that need it say they
//! skipped, or fail when `CONVENE_TEST_REQUIRE_SERVICES` is set.

use std::fs::File;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use convene_evidence_store::artifacts::ArtifactRef;
use convene_mesh::auth::request;
use convene_policy::PolicyService;
use convene_proto::v1::{self, LinkStatus, evidence_store_client::EvidenceStoreClient};
use convene_server::test_util::{TestServer, endpoint, free_port, wait_ready};
use convene_store::test_util::{PYTHON_ENV, Service, TestPostgres, postgres_server};
use object_store::aws::{AmazonS3, AmazonS3Builder};
use object_store::path::Path as ObjectPath;
use object_store::{ObjectStoreExt as _, PutPayload};
use tonic::Code;
use tonic::transport::Channel;

use crate::support::{chain, evidence, issue_token, start_policy};

/// moto's S3 server, found next to the Python of [`PYTHON_ENV`].
const MOTO: Service = Service {
    name: "moto's S3 server (moto_server, from `pip install 'moto[server]'`)",
    variable: PYTHON_ENV,
};

/// The bucket the replicas share.
const BUCKET: &str = "convene-evidence";
/// The key prefix the replicas are configured with.
const PREFIX: &str = "cluster/eu";
/// The credentials set in the replicas' environment; moto accepts any.
const ACCESS_KEY_ID: &str = "AKIACONVENETEST";
const SECRET_ACCESS_KEY: &str = "cvnS3cretKey+never/printed0123456789abcd";
const SESSION_TOKEN: &str = "cvnSessionToken+never/printed/FwoGZXIvYXdzE";

/// How long a server started by a test may take to answer before the test gives up.
const START_LIMIT: Duration = Duration::from_secs(60);

/// A child process with its output in files, killed and reaped when dropped.
struct Process {
    name: String,
    child: Child,
    stdout: PathBuf,
    stderr: PathBuf,
}

impl Process {
    /// Starts `command` as `name`, its output in `dir/<name>.stdout` and `.stderr`.
    fn spawn(name: &str, mut command: Command, dir: &Path) -> Self {
        let stdout = dir.join(format!("{name}.stdout"));
        let stderr = dir.join(format!("{name}.stderr"));
        let child = command
            .stdin(Stdio::null())
            .stdout(File::create(&stdout).expect("create the stdout file"))
            .stderr(File::create(&stderr).expect("create the stderr file"))
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {name} ({command:?}): {e}"));
        Self {
            name: name.to_owned(),
            child,
            stdout,
            stderr,
        }
    }

    /// Everything it wrote so far, stdout then stderr.
    fn output(&self) -> String {
        let read = |path: &Path| std::fs::read_to_string(path).unwrap_or_default();
        format!("{}{}", read(&self.stdout), read(&self.stderr))
    }

    /// Panics with its output if it has exited.
    fn assert_running(&mut self) {
        if let Some(status) = self.child.try_wait().expect("poll the child") {
            panic!(
                "{} exited ({status}) before it served; its output:\n{}",
                self.name,
                self.output()
            );
        }
    }

    /// Waits until it answers gRPC health checks at `addr`, failing with its output if
    /// it exits first.
    async fn wait_serving(&mut self, addr: SocketAddr) {
        let ready = wait_ready(addr);
        tokio::pin!(ready);
        loop {
            tokio::select! {
                () = &mut ready => return,
                () = tokio::time::sleep(Duration::from_millis(50)) => self.assert_running(),
            }
        }
    }

    /// Kills it and waits for it to go.
    fn stop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The `moto_server` of the Python tests use, or `None` after saying the test skips.
fn moto_binary() -> Option<PathBuf> {
    let python = std::env::var_os(PYTHON_ENV).map(PathBuf::from).or_else(|| {
        let venv = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../.venv/bin/python");
        venv.exists().then_some(venv)
    });
    let Some(python) = python else {
        MOTO.missing("is not found: no Python is named and the repository has no .venv");
        return None;
    };
    let binary = python.with_file_name("moto_server");
    if binary.exists() {
        Some(binary)
    } else {
        MOTO.missing(&format!(
            "is not installed: {} does not exist; install it with `{} -m pip install \
             'moto[server]'`",
            binary.display(),
            python.display()
        ));
        None
    }
}

/// An HTTP client for moto (plain HTTP; rustls needs its provider to build one anyway).
fn http_client() -> reqwest::Client {
    let _ = rustls::crypto::ring::default_provider().install_default();
    reqwest::Client::new()
}

/// moto's S3 server on a loopback port.
struct Moto {
    process: Process,
    /// `http://127.0.0.1:<port>`.
    endpoint: String,
}

impl Moto {
    /// Starts moto in `dir` and waits until it answers; `None` when moto is missing.
    async fn start(dir: &Path) -> Option<Self> {
        let binary = moto_binary()?;
        let port = free_port();
        let mut command = Command::new(&binary);
        command.args(["-H", "127.0.0.1", "-p", &port.to_string()]);
        let mut moto = Self {
            process: Process::spawn("moto_server", command, dir),
            endpoint: format!("http://127.0.0.1:{port}"),
        };
        let client = http_client();
        let answered = tokio::time::timeout(START_LIMIT, async {
            loop {
                moto.process.assert_running();
                if client.get(&moto.endpoint).send().await.is_ok() {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
        .await;
        assert!(
            answered.is_ok(),
            "moto_server did not answer at {} within {START_LIMIT:?}; its output:\n{}",
            moto.endpoint,
            moto.process.output()
        );
        Some(moto)
    }

    /// Creates `bucket` (object_store cannot; S3's CreateBucket is a plain PUT).
    async fn create_bucket(&self, bucket: &str) {
        let response = http_client()
            .put(format!("{}/{bucket}", self.endpoint))
            .send()
            .await
            .unwrap_or_else(|e| panic!("create bucket {bucket} on moto: {e}"));
        let status = response.status();
        let body = response.text().await.unwrap_or_default();
        assert!(
            status.is_success(),
            "create bucket {bucket}: {status} {body}"
        );
    }

    /// An S3 client of `bucket`, for the test to look at and change what is stored.
    fn bucket(&self, bucket: &str) -> AmazonS3 {
        let _ = rustls::crypto::ring::default_provider().install_default();
        AmazonS3Builder::new()
            .with_endpoint(&self.endpoint)
            .with_allow_http(true)
            .with_region("us-east-1")
            .with_bucket_name(bucket)
            .with_access_key_id(ACCESS_KEY_ID)
            .with_secret_access_key(SECRET_ACCESS_KEY)
            .build()
            .expect("an S3 client of moto")
    }
}

/// An evidence-store process and where it listens.
struct Replica {
    process: Process,
    addr: SocketAddr,
}

impl Replica {
    /// A client of it.
    async fn client(&self) -> EvidenceStoreClient<Channel> {
        EvidenceStoreClient::new(convene_server::test_util::connect(self.addr).await)
    }
}

/// moto with the shared bucket, a database, a policy service issuing tokens, and the
/// evidence-store replicas started on them. Fields drop in order: replicas, moto, the
/// policy service, the database, the directory.
struct Cluster {
    replicas: Vec<Replica>,
    moto: Moto,
    policy_server: TestServer,
    _policy: PolicyService,
    policy_file: PathBuf,
    database_url: String,
    _postgres: Option<TestPostgres>,
    dir: tempfile::TempDir,
}

impl Cluster {
    /// moto with [`BUCKET`], a database (PostgreSQL when `CONVENE_TEST_POSTGRES_URL`
    /// names a server, else one SQLite file) and a policy service; `None` when moto is
    /// missing (the test then skips).
    async fn start() -> Option<Self> {
        let dir = tempfile::tempdir().expect("temp dir");
        let moto = Moto::start(dir.path()).await?;
        moto.create_bucket(BUCKET).await;
        let postgres = match postgres_server() {
            Some(admin) => Some(
                TestPostgres::create(&admin)
                    .await
                    .expect("a test database on the PostgreSQL server"),
            ),
            None => None,
        };
        let database_url = match &postgres {
            Some(db) => db.url().to_owned(),
            None => convene_store::sqlite_url(&dir.path().join("convene.db")),
        };
        let (policy_file, policy, policy_server) = start_policy(dir.path()).await;
        Some(Self {
            replicas: Vec::new(),
            moto,
            policy_server,
            _policy: policy,
            policy_file,
            database_url,
            _postgres: postgres,
            dir,
        })
    }

    /// The config file of replica `name` listening on `port`, its bytes in `bucket`.
    fn config_file(&self, name: &str, port: u16, bucket: &str) -> PathBuf {
        let data_dir = self.dir.path().join(name);
        let text = format!(
            "data_dir = {data_dir:?}\n\
             policy_file = {policy_file:?}\n\
             dev_credentials = false\n\
             database_url = {database_url:?}\n\
             policy_endpoint = {policy_endpoint:?}\n\
             \n\
             [server]\n\
             listen = \"127.0.0.1:{port}\"\n\
             \n\
             [artifacts]\n\
             store = \"s3\"\n\
             bucket = {bucket:?}\n\
             prefix = {PREFIX:?}\n\
             endpoint = {moto:?}\n\
             allow_http = true\n",
            data_dir = data_dir.display().to_string(),
            policy_file = self.policy_file.display().to_string(),
            database_url = self.database_url,
            policy_endpoint = endpoint(self.policy_server.addr),
            moto = self.moto.endpoint,
        );
        let path = self.dir.path().join(format!("{name}.toml"));
        std::fs::write(&path, text).expect("write the replica's config file");
        path
    }

    /// The binary with `args`, in an environment holding only the AWS credentials and
    /// debug logging.
    fn command(&self, args: &[&str]) -> Command {
        let mut command = Command::new(env!("CARGO_BIN_EXE_convene-evidence-store"));
        command
            .args(args)
            .current_dir(self.dir.path())
            .env_clear()
            .env("AWS_ACCESS_KEY_ID", ACCESS_KEY_ID)
            .env("AWS_SECRET_ACCESS_KEY", SECRET_ACCESS_KEY)
            .env("AWS_SESSION_TOKEN", SESSION_TOKEN)
            .env("RUST_LOG", "debug");
        command
    }

    /// Starts replica `name` on `bucket` and waits until it serves; its index.
    async fn start_replica(&mut self, name: &str, bucket: &str) -> usize {
        let port = free_port();
        let config = self.config_file(name, port, bucket);
        let command = self.command(&["--config", &config.display().to_string()]);
        let mut process = Process::spawn(name, command, self.dir.path());
        let addr = SocketAddr::from(([127, 0, 0, 1], port));
        process.wait_serving(addr).await;
        self.replicas.push(Replica { process, addr });
        self.replicas.len() - 1
    }

    /// A task token of acme that may write and read evidence.
    async fn acme(&self) -> String {
        issue_token(
            &self.policy_server,
            "oncall@acme",
            "del-acme",
            &[
                ("evidence:write", "evidence"),
                ("evidence:read", "evidence"),
            ],
        )
        .await
    }

    /// Stores `content` through replica `at` with an evidence record `id` citing it.
    async fn put_with_evidence(
        &self,
        at: usize,
        token: &str,
        content: &[u8],
        id: &str,
    ) -> v1::Artifact {
        let stored = self.replicas[at]
            .client()
            .await
            .put_artifact(request(
                v1::PutArtifactRequest {
                    content: content.to_vec(),
                    media_type: "application/json".into(),
                    tool_call_id: "call-1".into(),
                    evidence: Some(evidence(id, "", "")),
                },
                token,
            ))
            .await
            .expect("stored with its evidence")
            .into_inner();
        assert!(stored.created);
        stored.artifact.expect("artifact metadata")
    }

    /// Replica `at`'s GetArtifact of `uri`.
    async fn get(
        &self,
        at: usize,
        token: &str,
        uri: &str,
    ) -> Result<v1::GetArtifactResponse, tonic::Status> {
        self.replicas[at]
            .client()
            .await
            .get_artifact(request(v1::GetArtifactRequest { uri: uri.into() }, token))
            .await
            .map(tonic::Response::into_inner)
    }

    /// Replica `at`'s VerifyChain of one claim citing `id`, re-hashing the bytes.
    async fn verify(&self, at: usize, token: &str, id: &str) -> v1::VerifyChainResponse {
        self.replicas[at]
            .client()
            .await
            .verify_chain(request(chain(&[id]), token))
            .await
            .expect("the chain is verified")
            .into_inner()
    }
}

/// Where the replicas keep an artifact's bytes in the bucket.
fn object_path(uri: &str) -> ObjectPath {
    let artifact = ArtifactRef::parse(uri).expect("an artifact URI");
    ObjectPath::from(format!("{PREFIX}/{}/{}", artifact.tenant, artifact.sha256))
}

/// Bytes that are not text, larger than one network read.
fn sample_bytes() -> Vec<u8> {
    (0..200_000_u32)
        .map(|i| (i.wrapping_mul(31) % 251) as u8)
        .collect()
}

#[tokio::test]
async fn replicas_sharing_a_bucket_serve_each_others_artifacts() {
    let Some(mut cluster) = Cluster::start().await else {
        return;
    };
    let a = cluster.start_replica("replica-a", BUCKET).await;
    let b = cluster.start_replica("replica-b", BUCKET).await;
    let token = cluster.acme().await;
    let content = sample_bytes();
    let id = "logs://payment-api/q-1";

    let artifact = cluster.put_with_evidence(a, &token, &content, id).await;
    let in_bucket = cluster
        .moto
        .bucket(BUCKET)
        .get(&object_path(&artifact.uri))
        .await
        .expect("the object is at <prefix>/<tenant>/<sha256>")
        .bytes()
        .await
        .expect("its bytes");
    assert_eq!(in_bucket.as_ref(), content.as_slice());

    let got = cluster
        .get(b, &token, &artifact.uri)
        .await
        .expect("replica b reads it");
    assert!(got.content == content, "replica b served other bytes");
    assert_eq!(got.artifact.as_ref(), Some(&artifact));

    let report = cluster.verify(b, &token, id).await;
    assert!(report.intact, "{:?}", report.links);
    assert_eq!(report.links[0].status, i32::from(LinkStatus::Ok));

    // The same bytes through the other replica are the artifact already stored.
    let again = cluster.replicas[b]
        .client()
        .await
        .put_artifact(request(
            v1::PutArtifactRequest {
                content: content.clone(),
                ..Default::default()
            },
            &token,
        ))
        .await
        .expect("stored")
        .into_inner();
    assert!(!again.created);
    assert_eq!(again.artifact.expect("metadata").uri, artifact.uri);
}

#[tokio::test]
async fn an_object_changed_or_removed_in_the_bucket_is_data_loss() {
    let Some(mut cluster) = Cluster::start().await else {
        return;
    };
    let a = cluster.start_replica("replica-a", BUCKET).await;
    let b = cluster.start_replica("replica-b", BUCKET).await;
    let token = cluster.acme().await;
    let id = "logs://payment-api/q-7";
    let artifact = cluster
        .put_with_evidence(a, &token, b"rows: 1423 timeouts", id)
        .await;

    let bucket = cluster.moto.bucket(BUCKET);
    let location = object_path(&artifact.uri);
    bucket
        .put(&location, PutPayload::from_static(b"rows: 0 timeouts"))
        .await
        .expect("the object is overwritten behind the store's back");

    let expected = format!(
        "is corrupted: stored bytes hash to {}, recorded {}",
        convene_core::ids::content_hash(b"rows: 0 timeouts"),
        artifact.content_hash
    );
    for at in [a, b] {
        let status = cluster.get(at, &token, &artifact.uri).await.unwrap_err();
        assert_eq!(status.code(), Code::DataLoss, "{status:?}");
        assert!(status.message().contains(&expected), "{}", status.message());
    }
    let report = cluster.verify(b, &token, id).await;
    assert!(!report.intact);
    assert_eq!(
        report.links[0].status,
        i32::from(LinkStatus::ArtifactCorrupted)
    );

    bucket
        .delete(&location)
        .await
        .expect("the object is removed");
    let status = cluster.get(b, &token, &artifact.uri).await.unwrap_err();
    assert_eq!(status.code(), Code::DataLoss, "{status:?}");
    assert!(
        status.message().contains("its bytes are missing"),
        "{}",
        status.message()
    );
    let report = cluster.verify(a, &token, id).await;
    assert_eq!(
        report.links[0].status,
        i32::from(LinkStatus::ArtifactMissing)
    );
}

#[tokio::test]
async fn aws_credentials_stay_out_of_output_and_the_config_dump() {
    let Some(mut cluster) = Cluster::start().await else {
        return;
    };
    let good = cluster.start_replica("replica-good", BUCKET).await;
    // A bucket nobody created: every write fails in the S3 client, and the failure is
    // logged with the server's answer.
    let broken = cluster
        .start_replica("replica-broken", "absent-bucket")
        .await;
    let token = cluster.acme().await;
    let artifact = cluster
        .put_with_evidence(good, &token, b"p95 3.8s", "metrics://gw/p95")
        .await;
    cluster
        .get(good, &token, &artifact.uri)
        .await
        .expect("read back");
    let status = cluster.replicas[broken]
        .client()
        .await
        .put_artifact(request(
            v1::PutArtifactRequest {
                content: b"never stored".to_vec(),
                ..Default::default()
            },
            &token,
        ))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::Internal, "{status:?}");

    let config = cluster.config_file("dump", free_port(), BUCKET);
    let dump = cluster
        .command(&["--dump-config", "--config", &config.display().to_string()])
        .output()
        .expect("run --dump-config");
    assert!(
        dump.status.success(),
        "{}",
        String::from_utf8_lossy(&dump.stderr)
    );
    let dumped = format!(
        "{}{}",
        String::from_utf8_lossy(&dump.stdout),
        String::from_utf8_lossy(&dump.stderr)
    );
    assert!(
        dumped.contains(&format!("bucket = \"{BUCKET}\"")),
        "{dumped}"
    );

    for replica in &mut cluster.replicas {
        replica.process.stop();
    }
    let good_log = cluster.replicas[good].process.output();
    let broken_log = cluster.replicas[broken].process.output();
    assert!(
        good_log.contains("artifact bytes are kept in an S3 bucket")
            && good_log.contains(&format!("bucket={BUCKET}")),
        "the start-up log names the bucket:\n{good_log}"
    );
    assert!(
        broken_log.contains("artifact storage failed") && broken_log.contains("absent-bucket"),
        "the failed write is logged:\n{broken_log}"
    );
    for (what, text) in [
        ("replica-good's output", &good_log),
        ("replica-broken's output", &broken_log),
        ("--dump-config", &dumped),
    ] {
        for (name, secret) in [
            ("AWS_SECRET_ACCESS_KEY", SECRET_ACCESS_KEY),
            ("AWS_SESSION_TOKEN", SESSION_TOKEN),
        ] {
            assert!(!text.contains(secret), "{what} shows {name}:\n{text}");
        }
    }
}

#[test]
fn an_s3_store_without_a_bucket_is_refused_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port().to_string();
    let mut child = Command::new(env!("CARGO_BIN_EXE_convene-evidence-store"))
        .args(["--listen", &format!("127.0.0.1:{port}"), "--data-dir"])
        .arg(dir.path())
        .current_dir(dir.path())
        .env_clear()
        .env("CONVENE_ARTIFACTS__STORE", "s3")
        .stdout(Stdio::null())
        .stderr(File::create(dir.path().join("stderr")).unwrap())
        .spawn()
        .unwrap();
    let mut waited = Duration::ZERO;
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if waited > START_LIMIT {
            let _ = child.kill();
            let _ = child.wait();
            panic!("the evidence store started without artifacts.bucket");
        }
        std::thread::sleep(Duration::from_millis(50));
        waited += Duration::from_millis(50);
    };
    let stderr = std::fs::read_to_string(dir.path().join("stderr")).unwrap();
    assert_eq!(status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains(
            "convene-evidence-store: invalid configuration: artifacts.bucket is required when \
             artifacts.store = \"s3\""
        ) && stderr.contains("CONVENE_ARTIFACTS__BUCKET"),
        "{stderr}"
    );
}
