//! `convene-approval`: the approval service as a standalone binary.

use std::{path::PathBuf, process::ExitCode, time::Duration};

use clap::Parser;
use convene_approval::Config;
use convene_server::{ConfigLoader, cli::ServiceArgs, serve_binary};

/// Allocation-heavy request handling on many threads: mimalloc costs far less CPU per
/// allocation than the system allocator here ([`convene_server::alloc`] has its settings).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// The convene approval service: holds R2/R3 actions until enough distinct people
/// approve them (one for R2, two for R3, never the requester), then executes each
/// approved action exactly once.
///
/// Without --config it starts on the development settings of the payment-incident
/// example: 127.0.0.1:7403, the example policy built into the binary, and development
/// credentials in ./.convene/credentials (one <principal>.secret file per principal).
#[derive(Debug, Parser)]
#[command(name = "convene-approval", version)]
struct Cli {
    #[command(flatten)]
    common: ServiceArgs,

    /// Policy file (YAML or TOML) naming the principals who may request, decide and
    /// execute approvals, and the action catalog with risk levels. Overrides
    /// `policy_file` from the config file and CONVENE_POLICY_FILE. [default: the
    /// payment-incident example policy built into the binary]
    #[arg(long, value_name = "FILE")]
    policy_file: Option<PathBuf>,

    /// Directory for the service's data; development credentials are written to
    /// DIR/credentials. Overrides `data_dir` and CONVENE_DATA_DIR. [default: ./.convene]
    #[arg(long, value_name = "DIR")]
    data_dir: Option<PathBuf>,

    /// How long a request waits for its approvers when it does not say (expires_in 0),
    /// e.g. 30m or 4h. Overrides `default_ttl` and CONVENE_DEFAULT_TTL. [default: 1h]
    #[arg(long, value_name = "DURATION", value_parser = humantime::parse_duration)]
    default_ttl: Option<Duration>,
}

impl Cli {
    /// The config loader with the file and every flag applied; the environment is added
    /// by [`serve_binary`].
    fn loader(&self) -> ConfigLoader {
        self.common
            .common_loader(self.policy_file.as_deref(), self.data_dir.as_deref())
            .set_some(
                "default_ttl",
                self.default_ttl
                    .map(|ttl| humantime::format_duration(ttl).to_string()),
            )
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
        "convene-approval",
        &cli.common,
        cli.loader(),
        |config: &Config| {
            format!(
                "data dir {}, development credentials in {}, policy {}",
                config.data_dir.display(),
                config.credentials_dir().display(),
                config.policy_source().name(),
            )
        },
        convene_approval::run,
    )
    .await
}
