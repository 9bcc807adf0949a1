//! `convene-policy`: the policy service as a standalone process.

use std::path::PathBuf;

use anyhow::Context as _;
use clap::Parser;
use convene_policy::Config;
use convene_server::{Shutdown, cli::ServiceArgs};

/// Allocation-heavy request handling on many threads: mimalloc costs far less CPU per
/// allocation than the system allocator here.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// The convene policy service: issues scoped task tokens, authorizes every tool call
/// against them, and logs each decision.
#[derive(Debug, Parser)]
#[command(name = "convene-policy", version, about, long_about = None)]
struct Cli {
    #[command(flatten)]
    common: ServiceArgs,

    /// Policy file (YAML or TOML): principals and their grants, worker-profile
    /// capabilities, the tool catalog with risk levels, and runtime rules. Overrides
    /// `policy_file` from the config file and CONVENE_POLICY_FILE. [default: the
    /// payment-incident example policy built into this binary]
    #[arg(long, value_name = "FILE")]
    policy_file: Option<PathBuf>,

    /// Data directory: signing keys in DIR/policy/keys, the decision log in
    /// DIR/policy/decisions.jsonl, development credentials in DIR/credentials. Overrides
    /// `data_dir` from the config file and CONVENE_DATA_DIR. [default: ./.convene]
    #[arg(long, value_name = "DIR")]
    data_dir: Option<PathBuf>,

    /// Make a new signing key active before serving. The previous key keeps verifying
    /// the tokens it signed (GetSigningKeys lists both, the new one first), so tokens in
    /// flight stay valid until they expire.
    #[arg(long)]
    rotate_key: bool,
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
    let config: Config = loader.env(std::env::vars()).load()?;
    if let Some(format) = cli.common.dump_config {
        print!("{}", convene_server::dump(&config, format)?);
        return Ok(());
    }

    let telemetry = convene_telemetry::init("convene-policy", &cli.common.telemetry());
    if cli.common.config.is_none() {
        tracing::info!(
            "no --config given: using the development settings of the payment-incident \
             example (data dir {}, policy {}, listening on {})",
            config.data_dir.display(),
            config.policy_source(),
            config.server.listen
        );
    }
    if cli.rotate_key {
        let kid =
            convene_policy::rotate_signing_key(&config).context("cannot rotate the signing key")?;
        tracing::info!(signing_key = %kid, "signing key rotated; the previous key still verifies");
    }
    let shutdown = Shutdown::from_signals().context("cannot install signal handlers")?;
    let served = convene_policy::run(config, shutdown).await;
    telemetry.shutdown().await;
    served?;
    Ok(())
}
