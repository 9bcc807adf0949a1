//! `convene-supervisor`: the supervisor as its own process.

use clap::Parser;
use convene_server::cli::ServiceArgs;
use convene_server::{Shutdown, dump};
use convene_supervisor::{Config, run};

/// Allocation-heavy request handling on many threads: mimalloc costs far less CPU per
/// allocation than the system allocator here.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// The convene supervisor: owns runs, dispatches delegations to registered workers under
/// task tokens from the policy service, joins their results deterministically and
/// publishes the outcome. Serves convene.v1.Supervisor and convene.v1.WorkerRegistry.
///
/// Without --config it uses the development settings of the payment-incident example:
/// the embedded example policy, data directory ./.convene, and the other services on
/// their default ports (policy 7401, evidence store 7402, approval 7403).
#[derive(Debug, Parser)]
#[command(name = "convene-supervisor", version)]
struct Cli {
    #[command(flatten)]
    common: ServiceArgs,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let config: Config = cli.common.load()?;
    if let Some(format) = cli.common.dump_config {
        print!("{}", dump(&config, format)?);
        return Ok(());
    }
    let telemetry = convene_telemetry::init("convene-supervisor", &cli.common.telemetry());
    if cli.common.config.is_none() {
        tracing::info!(
            data_dir = %config.data_dir.display(),
            "no --config given: using the development settings of the payment-incident example"
        );
    }
    let shutdown = Shutdown::from_signals()?;
    let served = run(config, shutdown).await;
    telemetry.shutdown().await;
    served?;
    Ok(())
}
