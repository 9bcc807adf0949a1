//! `convene-evidence-store`: the evidence store as a standalone process.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use convene_evidence_store::Config;
use convene_server::{ConfigLoader, cli::ServiceArgs, serve_binary};

/// Allocation-heavy request handling on many threads: mimalloc costs far less CPU per
/// allocation than the system allocator here ([`convene_server::alloc`] has its settings).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// The convene evidence store: immutable, content-addressed artifacts and the evidence
/// records that cite them, written with task tokens and read with task tokens or by
/// principals holding role `evidence:read`.
///
/// Artifact bytes are kept in <data_dir>/artifacts by default. The config file's
/// `[artifacts]` section puts them in an S3-compatible bucket instead, which replicas
/// sharing one `database_url` also share: `store = "s3"`, `bucket` (required), `prefix`
/// (objects at <prefix>/<tenant>/<sha256>), `endpoint` (an S3-compatible server such as
/// MinIO; unset: AWS S3), `region` (default us-east-1), `allow_http` (default false).
/// Each key has an environment override, CONVENE_ARTIFACTS__<KEY>
/// (CONVENE_ARTIFACTS__BUCKET, ...). Credentials come only from the standard AWS
/// environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN, or a web
/// identity, container or instance role); they are never configuration and never shown.
#[derive(Debug, Parser)]
#[command(name = "convene-evidence-store", version, about)]
struct Cli {
    #[command(flatten)]
    common: ServiceArgs,

    /// Policy file (YAML or TOML) whose principals may read evidence with their own
    /// credential when they hold role `evidence:read` (writes always need a task token).
    /// Overrides `policy_file` from the config file and CONVENE_POLICY_FILE. [default: the
    /// payment-incident example policy built into the binary]
    #[arg(long, value_name = "FILE")]
    policy_file: Option<PathBuf>,

    /// Data directory: artifact bytes are kept in DIR/artifacts/<tenant>/<sha256> (unless
    /// `[artifacts]` names a bucket), development credentials in DIR/credentials. Overrides `data_dir` from the config
    /// file and CONVENE_DATA_DIR. [default: ./.convene]
    #[arg(long, value_name = "DIR")]
    data_dir: Option<PathBuf>,

    /// The policy service whose public signing keys verify task tokens, e.g.
    /// http://policy:7401. Overrides `policy_endpoint` and CONVENE_POLICY_ENDPOINT.
    /// [default: http://127.0.0.1:7401]
    #[arg(long, value_name = "URL")]
    policy_endpoint: Option<String>,

    /// Largest artifact accepted, in bytes; larger puts are refused with a message naming
    /// this limit. Overrides `max_artifact_bytes` and CONVENE_MAX_ARTIFACT_BYTES.
    /// [default: 4194304, 4 MiB]
    #[arg(long, value_name = "BYTES")]
    max_artifact_bytes: Option<usize>,
}

impl Cli {
    /// The config loader with the file and every flag applied; the environment is added
    /// by [`serve_binary`].
    fn loader(&self) -> ConfigLoader {
        self.common
            .common_loader(self.policy_file.as_deref(), self.data_dir.as_deref())
            .set_some("policy_endpoint", self.policy_endpoint.as_deref())
            .set_some("max_artifact_bytes", self.max_artifact_bytes)
    }
}

fn main() -> ExitCode {
    // Before any thread starts: mimalloc reads its settings as the process loads.
    convene_server::alloc::apply_allocator_settings();
    serve_main()
}

#[tokio::main]
async fn serve_main() -> ExitCode {
    let cli = Cli::parse();
    serve_binary(
        "convene-evidence-store",
        &cli.common,
        cli.loader(),
        |config: &Config| {
            format!(
                "data dir {}, policy service {}, principals from {}, listening on {}",
                config.data_dir.display(),
                config.policy_endpoint,
                config.policy_source().name(),
                config.server.listen
            )
        },
        convene_evidence_store::run,
    )
    .await
}
