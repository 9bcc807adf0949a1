//! `convene-worker`: a standalone convene worker.
//!
//! Loads its configuration (defaults → `--config` file → `CONVENE_*` environment →
//! flags), starts logging, and runs [`convene_worker::run`] until SIGTERM or Ctrl-C.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use convene_server::cli::ServiceArgs;
use convene_server::serve_binary;
use convene_worker::Config;

/// Allocation-heavy request handling on many threads: mimalloc costs far less CPU per
/// allocation than the system allocator here ([`convene_server::alloc`] has its settings).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// A convene worker: serves worker profiles (logs, metrics, change-audit specialists)
/// and runs the delegations the supervisor sends it. Every tool call is authorized by
/// the policy service and its output stored as evidence in the evidence store.
///
/// Without --config it runs the development settings of the payment-incident example:
/// the built-in example profiles over examples/payment-incident/data, with the
/// supervisor, policy service and evidence store on 127.0.0.1:7400, :7401 and :7402,
/// registering with the supervisor's internal listener on 127.0.0.1:7500.
///
/// MCP servers whose tools the worker mounts (only those the policy's tool catalog
/// declares) are listed in the config file's `mcp` section (`servers`, as in
/// examples/mcp/mcp.yaml).
#[derive(Debug, Parser)]
#[command(name = "convene-worker", version)]
struct Cli {
    #[command(flatten)]
    common: ServiceArgs,

    /// Directory the read-only tools query: logs/<service>.jsonl, metrics/<metric>.json
    /// and changes/changes.json. Overrides `tools_data_dir` (CONVENE_TOOLS_DATA_DIR).
    /// [default: examples/payment-incident/data]
    #[arg(long, value_name = "DIR")]
    tools_data: Option<PathBuf>,

    /// Profiles file (YAML) listing the worker profiles to serve, each with its tools,
    /// capabilities, evidence prefixes and playbook. Overrides `profiles_file`.
    /// [default: the payment-incident example profiles, built in]
    #[arg(long, value_name = "FILE")]
    profiles: Option<PathBuf>,

    /// This worker's id, stable across re-registrations. Overrides `worker_id`.
    /// [default: <hostname>-<pid>]
    #[arg(long, value_name = "ID")]
    worker_id: Option<String>,

    /// Delegations run at once; one more is refused with RESOURCE_EXHAUSTED so the
    /// supervisor dispatches it elsewhere. Overrides `capacity`. [default: 16]
    #[arg(long, value_name = "N")]
    capacity: Option<u32>,

    /// The supervisor's client API, whose Delegate the `delegate@1` tool calls; unless
    /// --registry is given, the worker registers at the same host's port + 100, the
    /// supervisor's internal listener by default. Overrides `supervisor_endpoint`.
    /// [default: http://127.0.0.1:7400]
    #[arg(long, value_name = "URL")]
    supervisor: Option<String>,

    /// A supervisor's worker registry to register with: its internal listener
    /// (--internal-listen), or the one address of `convene up`; repeat it for several.
    /// A host name (a headless Service) stands for every supervisor replica it resolves
    /// to. Overrides `registry_endpoints`
    /// (CONVENE_REGISTRY_ENDPOINTS='[http://a:7500,http://b:7500]'). [default: the
    /// --supervisor host at its port + 100, http://127.0.0.1:7500]
    #[arg(long = "registry", value_name = "URL")]
    registries: Vec<String>,

    /// The policy service, which authorizes every tool call. Overrides
    /// `policy_endpoint`. [default: http://127.0.0.1:7401]
    #[arg(long, value_name = "URL")]
    policy: Option<String>,

    /// The evidence store, which keeps every tool output and its evidence record.
    /// Overrides `evidence_endpoint`. [default: http://127.0.0.1:7402]
    #[arg(long, value_name = "URL")]
    evidence: Option<String>,

    /// Endpoint the supervisor should dispatch to, when it differs from the listen
    /// address (containers, load balancers). Overrides `advertise`. [default: derived
    /// from the listen address]
    #[arg(long, value_name = "URL")]
    advertise: Option<String>,

    /// Do not register with the supervisor; serve Execute only (a static pool, or
    /// tests that call the worker directly).
    #[arg(long)]
    no_register: bool,
}

impl Cli {
    /// The config loader with the file and every flag applied; [`serve_binary`] adds the
    /// process environment.
    fn loader(&self) -> convene_server::ConfigLoader {
        let loader = self
            .common
            .config_loader()
            .set_path("tools_data_dir", self.tools_data.as_deref())
            .set_path("profiles_file", self.profiles.as_deref())
            .set_some("worker_id", self.worker_id.as_deref())
            .set_some("capacity", self.capacity)
            .set_some("supervisor_endpoint", self.supervisor.as_deref())
            .set_some("policy_endpoint", self.policy.as_deref())
            .set_some("evidence_endpoint", self.evidence.as_deref())
            .set_some("advertise", self.advertise.as_deref());
        let loader = if self.registries.is_empty() {
            loader
        } else {
            loader.set("registry_endpoints", &self.registries)
        };
        if self.no_register {
            loader.set("register", false)
        } else {
            loader
        }
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
        "convene-worker",
        &cli.common,
        cli.loader(),
        |config: &Config| {
            format!(
                "data dir {}, tool data {}, profiles {}, MCP servers {}",
                config.data_dir.display(),
                config.tools_data_dir.display(),
                config
                    .profiles_file
                    .as_ref()
                    .map_or_else(|| "built in".to_owned(), |p| p.display().to_string()),
                config.mcp.servers.len(),
            )
        },
        convene_worker::run,
    )
    .await
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory as _;

    use super::*;

    #[test]
    fn flags_override_the_config() {
        let cli = Cli::try_parse_from([
            "convene-worker",
            "--tools-data",
            "/srv/data",
            "--capacity",
            "3",
            "--worker-id",
            "w-1",
            "--no-register",
            "--policy",
            "http://policy:7401",
        ])
        .unwrap();
        let config: Config = cli.loader().load().unwrap();
        assert_eq!(config.tools_data_dir, PathBuf::from("/srv/data"));
        assert_eq!(config.capacity, 3);
        assert_eq!(config.worker_id, "w-1");
        assert!(!config.register);
        assert_eq!(config.policy_endpoint, "http://policy:7401");
    }

    #[test]
    fn help_teaches_the_flags() {
        let help = Cli::command().render_long_help().to_string();
        for needle in [
            "--tools-data",
            "CONVENE_TOOLS_DATA_DIR",
            "--profiles",
            "--no-register",
            "payment-incident",
        ] {
            assert!(help.contains(needle), "help lacks {needle}:\n{help}");
        }
    }
}
