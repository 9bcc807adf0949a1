//! `convene-evidence-store`: the evidence store as a standalone process.

use std::path::PathBuf;

use anyhow::Context as _;
use clap::Parser;
use convene_evidence_store::Config;
use convene_server::{Shutdown, cli::ServiceArgs};

/// Allocation-heavy request handling on many threads: mimalloc costs far less CPU per
/// allocation than the system allocator here.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// The convene evidence store: immutable, content-addressed artifacts and the evidence
/// records that cite them, written with task tokens and read with task tokens or by
/// principals holding role `evidence:read`.
#[derive(Debug, Parser)]
#[command(name = "convene-evidence-store", version, about, long_about = None)]
struct Cli {
    #[command(flatten)]
    common: ServiceArgs,

    /// Policy file (YAML or TOML) whose principals may read evidence with their own
    /// credential when they hold role `evidence:read` (writes always need a task token).
    /// Overrides `policy_file` from the config file and CONVENE_POLICY_FILE. [default: the
    /// payment-incident example policy built into the binary]
    #[arg(long, value_name = "FILE")]
    policy_file: Option<PathBuf>,

    /// Data directory: artifact bytes are kept in DIR/artifacts/<tenant>/<sha256>,
    /// development credentials in DIR/credentials. Overrides `data_dir` from the config
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

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let mut loader = cli.common.config_loader();
    if let Some(path) = &cli.policy_file {
        loader = loader.set("policy_file", path.display().to_string());
    }
    if let Some(dir) = &cli.data_dir {
        loader = loader.set("data_dir", dir.display().to_string());
    }
    if let Some(endpoint) = &cli.policy_endpoint {
        loader = loader.set("policy_endpoint", endpoint);
    }
    if let Some(bytes) = cli.max_artifact_bytes {
        loader = loader.set("max_artifact_bytes", bytes);
    }
    let config: Config = loader.env(std::env::vars()).load()?;
    if let Some(format) = cli.common.dump_config {
        print!("{}", convene_server::dump(&config, format)?);
        return Ok(());
    }

    let telemetry = convene_telemetry::init("convene-evidence-store", &cli.common.telemetry());
    if cli.common.config.is_none() {
        tracing::info!(
            "no --config given: using the development settings of the payment-incident \
             example (data dir {}, policy service {}, principals from {}, listening on {})",
            config.data_dir.display(),
            config.policy_endpoint,
            config.policy_source(),
            config.server.listen
        );
    }
    let shutdown = Shutdown::from_signals().context("cannot install signal handlers")?;
    let served = convene_evidence_store::run(config, shutdown).await;
    telemetry.shutdown().await;
    served?;
    Ok(())
}
