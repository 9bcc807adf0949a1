//! The harness convene's end-to-end tests share (a module of the test binary and of the
//! tracing bench, not a library: its test-only dependencies then never reach a build
//! of the workspace's binaries).
//!
//! A [`TestMesh`] is a whole convene mesh on loopback sockets with its state in a fresh
//! temporary directory, in one of two modes:
//!
//! - [`Mode::InProcess`]: the code `convene up` runs — every service in this process,
//!   talking through in-process handles, all served on one listener;
//! - [`Mode::Processes`]: every service as its own operating-system process
//!   (`convene serve <service>`), talking gRPC to each other.
//!
//! Tests talk to either through the same gRPC clients, as any caller would.

mod client;
mod mesh;
mod processes;
mod wait;

use std::path::{Path, PathBuf};
use std::time::Duration;

use convene_proto::v1;

pub use mesh::TestMesh;
pub use wait::{wait_for, wait_until};

/// How the mesh runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Every service in this process (`convene up`).
    InProcess,
    /// Every service its own process.
    Processes,
}

/// One group of workers serving a profiles file.
#[derive(Debug, Clone)]
pub struct Workers {
    /// Profiles file content (YAML); None: the example profiles.
    pub profiles: Option<String>,
    /// How many workers.
    pub count: usize,
    /// Delegations each runs at once.
    pub capacity: u32,
}

impl Default for Workers {
    fn default() -> Self {
        Self {
            profiles: None,
            count: 1,
            capacity: 64,
        }
    }
}

/// What to start.
#[derive(Debug, Clone, Default)]
pub struct MeshOptions {
    /// Worker groups; empty: one worker with the example profiles.
    pub workers: Vec<Workers>,
    /// Policy file content (YAML) for every service that reads the policy; None: the
    /// example policy.
    pub policy: Option<String>,
    /// The database every service keeps its state in. None: what
    /// [`DATABASE_ENV`] says (unset: the SQLite file in the mesh's data directory; a
    /// `postgres://` server URL: a fresh database created on it for this mesh and
    /// dropped with it; anything else: used as it is).
    pub database_url: Option<String>,
    /// Extra environment for every service and worker process (Processes mode), e.g.
    /// `OTEL_EXPORTER_OTLP_ENDPOINT` to export their traces. Applied last, so it can
    /// override the harness's own settings (`RUST_LOG`).
    pub env: Vec<(String, String)>,
    /// Extra environment for the supervisor process only (Processes mode), applied
    /// after `env`: settings only the supervisor's configuration knows, such as
    /// `CONVENE_REPLICA_ID`, `CONVENE_RUN_LEASE_TTL`, `CONVENE_NATS_URL` or a crash point.
    /// [`TestMesh::restart`] replaces it.
    pub supervisor_env: Vec<(String, String)>,
    /// The supervisor's `commit_linger` (in either mode); None: its default.
    pub commit_linger: Option<Duration>,
}

/// The repository's root directory.
pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The example's tool data directory.
pub fn example_data() -> PathBuf {
    repo_root().join("examples/payment-incident/data")
}

/// The example profiles file's text.
pub fn example_profiles() -> String {
    std::fs::read_to_string(repo_root().join("examples/payment-incident/profiles.yaml"))
        .expect("the example profiles file exists")
}

/// The example run spec.
pub fn example_spec() -> v1::RunSpec {
    spec_from_yaml(
        &std::fs::read_to_string(repo_root().join("examples/payment-incident/run.yaml"))
            .expect("the example run spec exists"),
    )
}

/// A run spec from YAML in the protobuf JSON mapping.
pub fn spec_from_yaml(text: &str) -> v1::RunSpec {
    let value: serde_json::Value = serde_yaml::from_str(text).expect("valid YAML");
    convene_proto::json::from_value(value).expect("a valid RunSpec")
}

/// The `convene` binary built next to this test binary.
pub fn convene_bin() -> PathBuf {
    let exe = std::env::current_exe().expect("the test binary's path");
    let dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("the test binary lives in target/<profile>/deps");
    let bin = dir.join(format!("convene{}", std::env::consts::EXE_SUFFIX));
    assert!(
        bin.exists(),
        "{} is missing: build it with `cargo build -p convene-cli` (cargo test --workspace builds it)",
        bin.display()
    );
    bin
}

/// The variable that chooses the database of every [`TestMesh`] whose
/// [`MeshOptions::database_url`] is unset, so the whole end-to-end suite can run against
/// PostgreSQL: `CONVENE_TEST_DATABASE_URL=postgres://postgres@127.0.0.1:5432/postgres`.
pub const DATABASE_ENV: &str = "CONVENE_TEST_DATABASE_URL";
