//! `convene-policy`: the policy service as a standalone process.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use convene_policy::Config;
use convene_server::binary::BoxError;
use convene_server::{ConfigLoader, cli::ServiceArgs, serve_binary};

/// Allocation-heavy request handling on many threads: mimalloc costs far less CPU per
/// allocation than the system allocator here ([`convene_server::alloc`] has its settings).
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

impl Cli {
    /// The config loader with the file and every flag applied; the environment is added
    /// by [`serve_binary`].
    fn loader(&self) -> ConfigLoader {
        self.common
            .common_loader(self.policy_file.as_deref(), self.data_dir.as_deref())
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
    let rotate_key = cli.rotate_key;
    serve_binary(
        "convene-policy",
        &cli.common,
        cli.loader(),
        |config: &Config| config.describe(&config.policy_source().name()),
        |config, shutdown| async move {
            if rotate_key {
                let kid = convene_policy::rotate_signing_key(&config)
                    .map_err(|e| format!("cannot rotate the signing key: {e}"))?;
                tracing::info!(
                    signing_key = %kid,
                    "signing key rotated; the previous key still verifies"
                );
            }
            convene_policy::run(config, shutdown)
                .await
                .map_err(BoxError::from)
        },
    )
    .await
}
