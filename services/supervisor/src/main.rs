//! `convene-supervisor`: the supervisor as its own process.

use std::process::ExitCode;

use clap::Parser;
use convene_server::cli::ServiceArgs;
use convene_server::serve_binary;
use convene_supervisor::{Config, InternalArgs, run};

/// Allocation-heavy request handling on many threads: mimalloc costs far less CPU per
/// allocation than the system allocator here ([`convene_server::alloc`] has its settings).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// The convene supervisor: owns runs, dispatches delegations to registered workers under
/// task tokens from the policy service, joins their results deterministically and
/// publishes the outcome.
///
/// Two listeners: the client API (convene.v1.Supervisor: StartRun, runs, events, and the
/// workers' Delegate) on --listen, and the internal listener (convene.v1.WorkerRegistry,
/// which only workers call) on --internal-listen, by default on loopback at the client
/// port + 100. With TLS both serve the same certificate; --internal-client-ca requires
/// the workers' client certificates on the internal one.
///
/// Without --config it uses the development settings of the payment-incident example:
/// the embedded example policy, data directory ./.convene, and the other services on
/// their default ports (policy 7401, evidence store 7402, approval 7403).
#[derive(Debug, Parser)]
#[command(name = "convene-supervisor", version)]
struct Cli {
    #[command(flatten)]
    common: ServiceArgs,
    #[command(flatten)]
    internal: InternalArgs,
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
        "convene-supervisor",
        &cli.common,
        cli.internal.apply(cli.common.common_loader(None, None)),
        |config: &Config| {
            format!(
                "{}, workers register on {}",
                config.describe(&config.policy_source().name()),
                config
                    .internal_addr()
                    .map_or_else(|e| e.to_string(), |a| a.to_string())
            )
        },
        run,
    )
    .await
}
