//! `convene-gateway`: the A2A gateway as a standalone binary.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use convene_gateway::{Config, HttpListen};
use convene_server::{ConfigLoader, cli::ServiceArgs, serve_binary};

/// Request handling allocates on many threads: mimalloc costs far less CPU per
/// allocation than the system allocator here ([`convene_server::alloc`] has its settings).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// The convene A2A gateway: other agents find convene's run templates as skills on its
/// Agent Card (/.well-known/agent-card.json) and start, follow and cancel runs over A2A
/// 1.0 (JSON-RPC and HTTP+JSON), authenticating with a principal credential as a bearer.
/// People sign in to the operator console on the same listener, at /console/, when the
/// gateway has a credential to act for them with (`console_credential_file`).
///
/// Without --config it starts on the development settings of the payment-incident
/// example: A2A on 127.0.0.1:7480, gRPC health on 127.0.0.1:7405, the supervisor at
/// http://127.0.0.1:7400, the example policy and templates built into the binary.
#[derive(Debug, Parser)]
#[command(name = "convene-gateway", version)]
struct Cli {
    #[command(flatten)]
    common: ServiceArgs,

    /// Address A2A and the operator console are served on over HTTP (the Agent Card,
    /// both bindings, /console/), or `off`.
    /// Overrides `http_listen` and CONVENE_HTTP_LISTEN. [default: 127.0.0.1:7480]
    #[arg(long, value_name = "ADDR|off")]
    http_listen: Option<HttpListen>,

    /// The URL the Agent Card advertises, for a gateway behind a Service or an ingress,
    /// e.g. https://agents.example.com/convene. Overrides `public_url` and
    /// CONVENE_PUBLIC_URL. [default: http://<http-listen>]
    #[arg(long, value_name = "URL")]
    public_url: Option<String>,

    /// The supervisor to start runs on. Overrides `supervisor_endpoint` and
    /// CONVENE_SUPERVISOR_ENDPOINT. [default: http://127.0.0.1:7400]
    #[arg(long = "supervisor", value_name = "URL")]
    supervisor_endpoint: Option<String>,

    /// Run templates file offered as skills: the supervisor's templates_file. Overrides
    /// `templates_file` and CONVENE_TEMPLATES_FILE. [default: the payment-incident
    /// example's, built in, unless a policy file is given (then none)]
    #[arg(long = "templates", value_name = "FILE")]
    templates_file: Option<PathBuf>,

    /// Policy file whose principals' credentials callers present. Overrides
    /// `policy_file` and CONVENE_POLICY_FILE. [default: the payment-incident example
    /// policy built into the binary]
    #[arg(long, value_name = "FILE")]
    policy_file: Option<PathBuf>,

    /// Directory for the service's data (the task database by default). Overrides
    /// `data_dir` and CONVENE_DATA_DIR. [default: ./.convene]
    #[arg(long, value_name = "DIR")]
    data_dir: Option<PathBuf>,
}

impl Cli {
    /// The config loader with the file and every flag applied; the environment is added
    /// by [`serve_binary`].
    fn loader(&self) -> ConfigLoader {
        self.common
            .common_loader(self.policy_file.as_deref(), self.data_dir.as_deref())
            .set_some("http_listen", self.http_listen.map(|l| l.to_string()))
            .set_some("public_url", self.public_url.clone())
            .set_some("supervisor_endpoint", self.supervisor_endpoint.clone())
            .set_path("templates_file", self.templates_file.as_deref())
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
        "convene-gateway",
        &cli.common,
        cli.loader(),
        |config: &Config| {
            format!(
                "A2A on {}, supervisor {}, policy {}",
                config.http_listen,
                config.supervisor_endpoint,
                config.policy_source().name(),
            )
        },
        convene_gateway::run,
    )
    .await
}
