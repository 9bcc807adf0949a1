//! `convene`: run the mesh, submit and inspect runs, review approvals.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{ArgGroup, Parser, Subcommand, ValueEnum};
use convene_cli::client::{Client, DEFAULT_DATA_DIR, DEFAULT_ENDPOINT};
use convene_cli::commands::{
    self, ApprovalVerb, EventsOptions, ResolveInput, ResolveOptions, RunOptions,
};
use convene_cli::{bench, report, spec, up};
use convene_proto::v1;
use convene_server::cli::{LogFormat, ServiceArgs};
use convene_server::{Shutdown, dump};

/// Allocation-heavy request handling on many threads: mimalloc costs far less CPU per
/// allocation than the system allocator here ([`convene_server::alloc`] has its settings).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Parses `--input name=value`.
fn parse_input(text: &str) -> Result<(String, String), String> {
    match text.split_once('=') {
        Some((name, value)) if !name.trim().is_empty() => {
            Ok((name.trim().to_owned(), value.to_owned()))
        }
        _ => Err(format!(
            "{text:?}: give name=value, e.g. note=\"paged at 02:02\""
        )),
    }
}

/// Which run states are waiting and which final, for the help of the commands that
/// show runs.
const RUN_STATES_HELP: &str = "\
Run states:
  active   PENDING, RUNNING
  waiting  WAITING_INPUT (a conflict is open: settle it with `convene runs resolve`),
           WAITING_APPROVAL (an approval request the run filed is pending:
           `convene approvals list --run <run>`). Not final: the run holds no worker
           meanwhile and resumes when people act.
  final    SUCCEEDED, PARTIAL, FAILED, REJECTED, BUDGET_EXHAUSTED, NO_PROGRESS,
           CANCELLED. The run has ended and never changes state again.";

/// convene: a control plane for supervised multi-agent work.
///
/// Start everything in one process with `convene up`, then submit a run from another
/// terminal with `convene run examples/payment-incident/run.yaml`. Client commands find
/// the mesh at --endpoint and act as the principal whose development credential
/// `convene up` created in the data directory (or as --as PRINCIPAL, or with
/// --credential).
#[derive(Debug, Parser)]
#[command(name = "convene", version, propagate_version = true)]
struct Cli {
    /// Data directory shared by `convene up` and the client commands (credentials, keys,
    /// artifacts). [default: .convene]
    #[arg(long, global = true, env = "CONVENE_DATA_DIR", value_name = "DIR")]
    data_dir: Option<PathBuf>,

    #[command(subcommand)]
    command: Command,
}

/// Where client commands connect and as whom.
#[derive(Debug, clap::Args)]
struct ClientArgs {
    /// gRPC endpoint of the mesh (what `convene up` prints at start).
    #[arg(long, env = "CONVENE_ENDPOINT", default_value = DEFAULT_ENDPOINT, value_name = "URL")]
    endpoint: String,
    /// Endpoint of the approval service when it runs apart from the supervisor.
    #[arg(long, env = "CONVENE_APPROVAL_ENDPOINT", value_name = "URL")]
    approval_endpoint: Option<String>,
    /// Act as this principal, using its development credential from the data directory
    /// (e.g. alice@acme to approve). Default: the principal `convene up` recorded.
    #[arg(long = "as", value_name = "PRINCIPAL")]
    as_principal: Option<String>,
    /// Bearer credential to use instead of a development credential.
    #[arg(
        long,
        env = "CONVENE_CREDENTIAL",
        hide_env_values = true,
        value_name = "SECRET"
    )]
    credential: Option<String>,
    /// TLS: --tls-ca to call an https:// endpoint, --tls-cert/--tls-key to present a
    /// client certificate.
    #[command(flatten)]
    tls: convene_server::tls::TlsArgs,
}

/// A refusal to start that exits with status 2 (a setting to fix), not 1.
#[derive(Debug)]
struct StartRefused(String);

impl std::fmt::Display for StartRefused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for StartRefused {}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run every service (policy, evidence store, approval, supervisor, workers) in one
    /// process on one address, with state in the data directory. Nothing to install.
    Up(up::UpArgs),
    /// Run one service on its own, exactly as its binary `convene-<service>` does
    /// (configured by --config FILE and CONVENE_* variables).
    Serve {
        #[command(subcommand)]
        service: ServeCommand,
    },
    /// Submit a run spec, show live progress (one line per delegation) and print the
    /// assessment once the run stops: it ended, or it waits for people (then it says for
    /// what, and the commands that continue it). Exit status 0 for SUCCEEDED, PARTIAL and
    /// the waiting states WAITING_INPUT and WAITING_APPROVAL; 2 for the other final
    /// states.
    ///
    /// Start it from a spec file you wrote (`convene run examples/payment-incident/run.yaml`)
    /// or from a template the operator configured (`convene up --templates FILE`):
    /// `convene run --template payment-incident-triage --input note="started by the
    /// 02:02 page"`. A template fixes the run's delegations, join contract and limits;
    /// you fill in its inputs.
    #[command(after_help = RUN_STATES_HELP)]
    #[command(group(
        ArgGroup::new("what")
            .required(true)
            .args(["file", "template"]),
    ))]
    Run {
        /// Run spec file (YAML or JSON, protobuf JSON mapping). Or give --template.
        file: Option<PathBuf>,
        /// Start the run from the supervisor's template with this id instead of a spec
        /// file (the templates are the operator's: `convene up --templates FILE`, or the
        /// payment-incident example's `payment-incident-triage` by default, also with --local unless --policy
        /// is given). An unknown
        /// id is refused with the list of known ones.
        #[arg(long, value_name = "ID")]
        template: Option<String>,
        /// With --template: a value for one of the template's inputs, as name=value;
        /// repeat for several. `note` (text appended to the run's goal) is always
        /// accepted; other names are those the template declares, and an undeclared one
        /// is refused with the list of declared ones.
        #[arg(long = "input", value_name = "NAME=VALUE", requires = "template", value_parser = parse_input)]
        inputs: Vec<(String, String)>,
        /// Print the Run as it stopped as JSON (protobuf JSON mapping) instead of the
        /// assessment.
        #[arg(long)]
        json: bool,
        /// Print the run id as soon as the run is accepted and return.
        #[arg(long, conflicts_with = "local")]
        detach: bool,
        /// Start every service in this process first (exactly as `convene up` does, on
        /// a free port, with state in the data directory), run, and stop. Nothing else
        /// needs to be running.
        #[arg(long)]
        local: bool,
        /// With --local: the policy file (principals, capabilities, tool catalog,
        /// runtime rules), as `convene up --policy`. [default: the payment-incident
        /// example's, built in]
        #[arg(long = "policy", value_name = "FILE", requires = "local")]
        policy_file: Option<PathBuf>,
        /// With --local: the worker profiles file, as `convene up --profiles`.
        /// [default: the payment-incident example's, built in]
        #[arg(long = "profiles", value_name = "FILE", requires = "local")]
        profiles_file: Option<PathBuf>,
        /// With --local: MCP servers whose tools the workers mount (those the policy's
        /// tool catalog declares), as `convene up --mcp`; see examples/mcp/mcp.yaml.
        #[arg(long = "mcp", value_name = "FILE", requires = "local")]
        mcp_file: Option<PathBuf>,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Measure the mesh: a load generator over the noop or payment-incident workload (a
    /// closed loop of --concurrency clients, or with --rate an open loop at a fixed
    /// rate), reporting runs/s, latency percentiles (HDR histogram), CPU per run and
    /// peak RSS; or, with --scale N, the supervisor's memory per run in flight and the
    /// time N held runs take to drain. Starts a mesh in this process (or, with
    /// --processes, one process per service and worker) unless --endpoint is given.
    Bench(bench::BenchArgs),
    /// Validate a run spec offline and explain what it asks for.
    Check {
        /// Run spec file (YAML or JSON).
        file: PathBuf,
    },
    /// Print your tenant's run events (CloudEvents 1.0, from the supervisor's outbox) in
    /// commit order, one per line. Resume where you left off with --after LAST_ID;
    /// consumers dedupe by event id.
    Events {
        /// Start after this event id (exclusive). Default: from the oldest event.
        #[arg(long, value_name = "EVENT_ID")]
        after: Option<String>,
        /// Keep printing new events as they are committed (Ctrl-C stops); when the
        /// supervisor restarts, resume after the last event printed.
        #[arg(long)]
        follow: bool,
        /// Only this run's events.
        #[arg(long = "run", value_name = "RUN_ID")]
        run_id: Option<String>,
        /// Only events of this type (repeatable): dev.convene.run.completed.v1, or short
        /// run.started, delegation.completed, join.decided, run.waiting, run.resumed,
        /// run.completed (a run ended, once per run), approval.requested.
        #[arg(long = "type", value_name = "TYPE")]
        types: Vec<String>,
        /// Print each event as one line of JSON in the CloudEvents JSON format
        /// (specversion, id, source, type, subject, time, data, correlationid, tenantid).
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Inspect runs, continue waiting ones, cancel them.
    Runs {
        #[command(subcommand)]
        command: RunsCommand,
    },
    /// Review and decide approval requests for R2/R3 actions.
    Approvals {
        #[command(subcommand)]
        command: ApprovalsCommand,
    },
    /// Verify evidence chains.
    Evidence {
        #[command(subcommand)]
        command: EvidenceCommand,
    },
}

/// `convene serve supervisor`'s flags: every service's, and the internal listener's.
#[derive(Debug, clap::Args)]
struct SupervisorServeArgs {
    #[command(flatten)]
    common: ServiceArgs,
    #[command(flatten)]
    internal: convene_supervisor::InternalArgs,
}

#[derive(Debug, Subcommand)]
enum ServeCommand {
    /// The policy service (task tokens, authorization, decision log).
    Policy(ServiceArgs),
    /// The evidence store (immutable artifacts and evidence records).
    EvidenceStore(ServiceArgs),
    /// The approval service (R2/R3 requests, votes, execution).
    Approval(ServiceArgs),
    /// The supervisor (runs, dispatch, join, worker registry): the client API on
    /// --listen, the worker registry on --internal-listen (default: 127.0.0.1 at the
    /// --listen port + 100), where workers register (their --registry).
    Supervisor(SupervisorServeArgs),
    /// A worker (agent loop, read-only tools).
    ///
    /// It registers with every supervisor replica's worker registry: the config key
    /// `registry_endpoints`, a list, which the environment gives in brackets, comma
    /// separated: CONVENE_REGISTRY_ENDPOINTS='[http://supervisor-a:7500,http://supervisor-b:7500]'.
    /// A host name stands for every address it resolves to (a headless Service). Unset:
    /// the supervisor endpoint's host at its port + 100.
    Worker(ServiceArgs),
}

#[derive(Debug, Subcommand)]
enum RunsCommand {
    /// Show one run as an assessment (or JSON): for a waiting run also what it waits
    /// for and the commands that continue it.
    #[command(after_help = RUN_STATES_HELP)]
    Get {
        /// The run id.
        run_id: String,
        /// Print the Run as JSON.
        #[arg(long)]
        json: bool,
        /// Show instead one delegation's whole conversation with its model, rebuilt
        /// from the turns stored as evidence (each chained to the one before).
        #[arg(long, value_name = "DELEGATION_ID")]
        conversation: Option<String>,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// List your tenant's runs, newest first.
    ///
    /// Filters narrow the list, and a run must pass every one: --state, --label and
    /// the time window --since/--until. For example, the payment API's runs of the last
    /// two hours that wait for input: `convene runs list --label service=payment-api
    /// --since 2h --state waiting-input`.
    #[command(after_help = RUN_STATES_HELP)]
    List {
        /// Only runs in this state (repeatable): active (pending, running), waiting
        /// (waiting-input, waiting-approval) or final (the others).
        #[arg(long = "state", value_enum)]
        states: Vec<RunStateArg>,
        #[command(flatten)]
        filters: commands::ListFilters,
        /// How many runs to show.
        #[arg(long, default_value_t = 20)]
        limit: u32,
        /// Print JSON.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Cancel a run, a waiting one included: its in-flight delegations, task tokens and
    /// pending approval requests are cancelled, and late results never reopen it. Says
    /// whether the run is cancelled, the cancellation is pending with the replica that
    /// owns the run, or the run had already ended.
    Cancel {
        /// The run id.
        run_id: String,
        /// Why (recorded as the run's terminal reason).
        #[arg(long, default_value = "")]
        reason: String,
        /// Print the CancelRunResponse as JSON (protobuf JSON mapping).
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Continue a waiting run with your decision: settle a conflict by choosing one side
    /// (--choose), ask for a follow-up delegation (--follow-up-profile with --goal), or
    /// close the run as it stands (--close). Your principal needs the `runs:resolve`
    /// role; the decision is recorded with it and your rationale, apart from the
    /// evidence-backed claims.
    ///
    /// The decision applies to one wait of the run, named by its ticket: without
    /// --ticket the run's current ticket is read and used (and printed). A ticket that
    /// is no longer current (someone acted first, or the run moved on) is refused.
    #[command(group(
        ArgGroup::new("input")
            .required(true)
            .args(["choose", "follow_up_profile", "close"]),
    ))]
    Resolve {
        /// The run id.
        run_id: String,
        /// The conflict's topic, e.g. primary_cause. Required with --choose. With
        /// --follow-up-profile or --close it is optional: when given, the command
        /// checks that the run has an open conflict on it and refuses otherwise (it is
        /// not sent; the rationale says what the decision is about).
        #[arg(long, value_name = "TOPIC")]
        topic: Option<String>,
        /// Settle the conflict on --topic by choosing this side: a delegation id, or
        /// the delegation's name in the run spec (e.g. changes).
        #[arg(long, value_name = "DELEGATION", requires = "topic")]
        choose: Option<String>,
        /// Ask this worker profile for a follow-up delegation (with --goal); it runs
        /// as a new round under the run's limits and the join decides again.
        #[arg(long, value_name = "PROFILE", requires = "goal")]
        follow_up_profile: Option<String>,
        /// With --follow-up-profile: what the follow-up must establish.
        #[arg(long, value_name = "TEXT", requires = "follow_up_profile")]
        goal: Option<String>,
        /// End the run as it stands: open conflicts stay unresolved, pending approval
        /// requests are cancelled.
        #[arg(long)]
        close: bool,
        /// Why, in your words (recorded with your principal).
        #[arg(long, value_name = "TEXT")]
        rationale: String,
        /// With --choose: an evidence id you relied on (repeatable); each must be cited
        /// by a claim of the conflict.
        #[arg(long = "evidence", value_name = "EVIDENCE_ID", requires = "choose")]
        evidence: Vec<String>,
        /// The ticket of the wait you decide on (as `convene run` or `convene runs get`
        /// printed it). Default: the run's current ticket.
        #[arg(long, value_name = "TICKET_ID")]
        ticket: Option<String>,
        /// Print the ResumeRunResponse as JSON (protobuf JSON mapping).
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        client: ClientArgs,
    },
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum RunStateArg {
    /// Active: accepted, not dispatched yet.
    Pending,
    /// Active: delegations dispatched, the join has not decided.
    Running,
    /// Final: joined COMPLETE, every conflict settled.
    Succeeded,
    /// Final: a provisional assessment with named gaps, or closed with a conflict
    /// unresolved.
    Partial,
    /// Waiting: an approval request the run filed is pending.
    WaitingApproval,
    /// Waiting: a conflict is open; a person settles it (`convene runs resolve`).
    WaitingInput,
    /// Final: insufficient evidence, or the run could not run.
    Failed,
    /// Final: refused by limits or policy.
    Rejected,
    /// Final: stopped by a budget.
    BudgetExhausted,
    /// Final: stopped because it made no progress.
    NoProgress,
    /// Final: cancelled.
    Cancelled,
}

impl RunStateArg {
    fn to_proto(self) -> i32 {
        (match self {
            Self::Pending => v1::RunState::Pending,
            Self::Running => v1::RunState::Running,
            Self::Succeeded => v1::RunState::Succeeded,
            Self::Partial => v1::RunState::Partial,
            Self::WaitingApproval => v1::RunState::WaitingApproval,
            Self::WaitingInput => v1::RunState::WaitingInput,
            Self::Failed => v1::RunState::Failed,
            Self::Rejected => v1::RunState::Rejected,
            Self::BudgetExhausted => v1::RunState::BudgetExhausted,
            Self::NoProgress => v1::RunState::NoProgress,
            Self::Cancelled => v1::RunState::Cancelled,
        }) as i32
    }
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum ApprovalStateArg {
    Pending,
    Approved,
    Rejected,
    Expired,
    Executed,
    Cancelled,
}

#[derive(Debug, Subcommand)]
enum ApprovalsCommand {
    /// List approval requests of your tenant.
    List {
        /// Only requests of this run.
        #[arg(long = "run", value_name = "RUN_ID")]
        run_id: Option<String>,
        /// Only requests in this state (repeatable).
        #[arg(long = "state", value_enum)]
        states: Vec<ApprovalStateArg>,
        /// Print JSON.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Approve a request with the parameters you reviewed: your vote binds to their
    /// hash. Pass it with --hash as `convene approvals list` shows it; a hash that is not
    /// the request's is refused before anything is recorded. Without --hash, on a
    /// terminal, the request is shown and you confirm; without a terminal the command
    /// refuses.
    Approve {
        /// The approval id.
        approval_id: String,
        /// The parameters hash you reviewed, `sha256:<hex>` (the prefix may be left
        /// out), as `convene approvals list` shows it.
        #[arg(long, value_name = "HASH")]
        hash: Option<String>,
        /// A comment for the record.
        #[arg(long, default_value = "")]
        comment: String,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Reject a request with the parameters you reviewed (--hash, or confirm on a
    /// terminal, as for approve).
    Reject {
        /// The approval id.
        approval_id: String,
        /// The parameters hash you reviewed, `sha256:<hex>` (the prefix may be left
        /// out), as `convene approvals list` shows it.
        #[arg(long, value_name = "HASH")]
        hash: Option<String>,
        /// A comment for the record.
        #[arg(long, default_value = "")]
        comment: String,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Execute an approved request with the parameters you reviewed (--hash, or confirm
    /// on a terminal, as for approve); exactly once: later calls show the first outcome.
    Execute {
        /// The approval id.
        approval_id: String,
        /// The parameters hash you reviewed, `sha256:<hex>` (the prefix may be left
        /// out), as `convene approvals list` shows it.
        #[arg(long, value_name = "HASH")]
        hash: Option<String>,
        #[command(flatten)]
        client: ClientArgs,
    },
}

#[derive(Debug, Subcommand)]
enum EvidenceCommand {
    /// Walk every claim of a run to its evidence and artifacts, re-hashing the bytes.
    Verify {
        /// The run id.
        run_id: String,
        /// Print JSON.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        client: ClientArgs,
    },
}

fn client(data_dir: &std::path::Path, args: ClientArgs) -> anyhow::Result<Client> {
    convene_server::tls::prepare(&args.tls, &[]).map_err(StartRefused)?;
    Client::resolve(
        args.endpoint,
        args.approval_endpoint,
        data_dir,
        args.as_principal.as_deref(),
        args.credential,
    )
}

/// Telemetry for `run --local`: warnings only unless RUST_LOG says otherwise, so the
/// assessment stays readable; traces are exported when the OTEL_* variables say so.
fn init_telemetry_quiet() -> convene_telemetry::Telemetry {
    let settings = convene_telemetry::Settings::from_env(LogFormat::Text, None, std::env::vars())
        .with_default_log_level(tracing::level_filters::LevelFilter::WARN);
    convene_telemetry::init(convene_telemetry::ONE_PROCESS_SERVICE_NAME, &settings)
}

/// `convene bench`, with quiet telemetry (warnings on stderr; the report on stdout).
async fn run_bench(
    args: &bench::BenchArgs,
    data_dir: Option<&std::path::Path>,
) -> anyhow::Result<bench::Outcome> {
    let telemetry = init_telemetry_quiet();
    let outcome = bench::run(args, data_dir).await;
    telemetry.shutdown().await;
    outcome
}

fn jaeger() -> Option<String> {
    std::env::var("CONVENE_JAEGER_URL")
        .ok()
        .filter(|s| !s.is_empty())
}

/// Loads a service's config (defaults → --config → CONVENE_* → flags, with --data-dir
/// when given; `loader` holds the file and the flags) and runs it until SIGTERM/SIGINT,
/// exporting traces as `convene-<name>` when a collector is configured.
async fn serve<C, F, Fut, E>(
    args: &ServiceArgs,
    loader: convene_server::ConfigLoader,
    data_dir: Option<&PathBuf>,
    name: &str,
    run: F,
) -> anyhow::Result<()>
where
    C: serde::Serialize + serde::de::DeserializeOwned + Default,
    F: FnOnce(C, Shutdown) -> Fut,
    Fut: std::future::Future<Output = Result<(), E>>,
    E: std::error::Error + Send + Sync + 'static,
{
    let mut loader = loader.env(std::env::vars());
    if let Some(dir) = data_dir {
        loader = loader.set("data_dir", dir.display().to_string());
    }
    let config: C = loader.load()?;
    if let Some(format) = args.dump_config {
        print!("{}", dump(&config, format)?);
        return Ok(());
    }
    let listeners = convene_server::binary::listen_addresses(&config);
    let named: Vec<_> = listeners.iter().map(|(k, a)| (k.as_str(), *a)).collect();
    let warnings = convene_server::tls::prepare(&args.tls, &named).map_err(StartRefused)?;
    let telemetry = convene_telemetry::init(&format!("convene-{name}"), &args.telemetry());
    if let Some(warning) =
        convene_server::binary::credentials_warning(args.public_credentials, &config)
    {
        tracing::warn!("{warning}");
    }
    for warning in warnings {
        eprintln!("convene: warning: {warning}");
    }
    if args.config.is_none() {
        tracing::info!(
            "no --config given: using the development settings of the payment-incident example"
        );
    }
    tracing::info!(service = name, "starting");
    let shutdown = Shutdown::from_signals()?;
    let served = run(config, shutdown).await;
    telemetry.shutdown().await;
    served?;
    Ok(())
}

async fn main_inner(cli: Cli) -> anyhow::Result<ExitCode> {
    let explicit_data_dir = cli.data_dir.clone();
    let data_dir = cli
        .data_dir
        .unwrap_or_else(|| PathBuf::from(DEFAULT_DATA_DIR));
    match cli.command {
        Command::Up(args) => {
            let mut listeners = vec![("--listen", args.listen)];
            if let Some(http) = args.http_listen.addr() {
                listeners.push(("--http-listen", http));
            }
            for warning in
                convene_server::tls::prepare(&args.tls, &listeners).map_err(StartRefused)?
            {
                eprintln!("convene: warning: {warning}");
            }
            up::run(args, &data_dir).await?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Bench(args) => {
            let report = run_bench(&args, explicit_data_dir.as_deref()).await?;
            if args.json {
                println!("{}", report.json()?);
            } else {
                println!("{}", report.summary());
            }
            Ok(if report.errors() == 0 {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(2)
            })
        }
        Command::Serve { service } => {
            let dir = explicit_data_dir.as_ref();
            match service {
                ServeCommand::Policy(a) => {
                    serve(&a, a.config_loader(), dir, "policy", convene_policy::run).await?
                }
                ServeCommand::EvidenceStore(a) => {
                    let loader = a.config_loader();
                    serve(
                        &a,
                        loader,
                        dir,
                        "evidence-store",
                        convene_evidence_store::run,
                    )
                    .await?
                }
                ServeCommand::Approval(a) => {
                    serve(
                        &a,
                        a.config_loader(),
                        dir,
                        "approval",
                        convene_approval::run,
                    )
                    .await?
                }
                ServeCommand::Supervisor(a) => {
                    let loader = a.internal.apply(a.common.config_loader());
                    serve(
                        &a.common,
                        loader,
                        dir,
                        "supervisor",
                        convene_supervisor::run,
                    )
                    .await?
                }
                ServeCommand::Worker(a) => {
                    serve(&a, a.config_loader(), dir, "worker", convene_worker::run).await?
                }
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Run {
            file,
            template,
            inputs,
            json,
            detach,
            local,
            policy_file,
            profiles_file,
            mcp_file,
            client: mut c,
        } => {
            // The spec is read before anything else, so a missing or malformed file is
            // reported as such rather than as a missing credential or an unreachable
            // mesh, and no mesh is started for a run that could not be submitted.
            let start = match (file, template) {
                (Some(file), None) => v1::StartRunRequest {
                    spec: Some(spec::load(&file)?),
                    ..Default::default()
                },
                (None, Some(template)) => v1::StartRunRequest {
                    template,
                    inputs: inputs.into_iter().collect(),
                    ..Default::default()
                },
                _ => anyhow::bail!("give a run spec file or --template ID, not both"),
            };
            let mut telemetry = None;
            let mesh = if local {
                telemetry = Some(init_telemetry_quiet());
                let args = up::UpArgs {
                    policy_file,
                    profiles_file,
                    mcp_file,
                    ..up::UpArgs::defaults("127.0.0.1:0".parse()?)
                };
                let mesh = up::start(&args, &data_dir, Shutdown::new()).await?;
                c.endpoint = format!("http://{}", mesh.addr);
                c.approval_endpoint = None;
                Some(mesh)
            } else {
                None
            };
            let c = client(&data_dir, c)?;
            let run = commands::run(
                &c,
                start,
                &RunOptions {
                    json,
                    detach,
                    jaeger: jaeger(),
                },
            )
            .await?;
            if let Some(mesh) = mesh {
                mesh.shutdown.trigger();
                mesh.stopped().await?;
            }
            if let Some(telemetry) = telemetry {
                telemetry.shutdown().await;
            }
            if detach || report::is_success(run.state) {
                Ok(ExitCode::SUCCESS)
            } else {
                eprintln!("{}", report::one_line(&run));
                Ok(ExitCode::from(2))
            }
        }
        Command::Check { file } => {
            let spec = spec::load(&file)?;
            print!("{}", spec::explain(&spec, std::time::SystemTime::now())?);
            Ok(ExitCode::SUCCESS)
        }
        Command::Events {
            after,
            follow,
            run_id,
            types,
            json,
            client: c,
        } => {
            let opts = EventsOptions {
                after,
                follow,
                run_id,
                types,
                json,
            };
            commands::events(&client(&data_dir, c)?, &opts).await?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Runs { command } => match command {
            RunsCommand::Get {
                run_id,
                json,
                conversation: Some(delegation),
                client: c,
            } => {
                let client = client(&data_dir, c)?;
                let run = commands::get_run(&client, &run_id).await?;
                commands::print_conversation(&client, &run, &delegation, json).await?;
                Ok(ExitCode::SUCCESS)
            }
            RunsCommand::Get {
                run_id,
                json,
                conversation: None,
                client: c,
            } => {
                commands::runs_get(&client(&data_dir, c)?, &run_id, json, jaeger().as_deref())
                    .await?;
                Ok(ExitCode::SUCCESS)
            }
            RunsCommand::List {
                states,
                filters,
                limit,
                json,
                client: c,
            } => {
                let states = states.into_iter().map(RunStateArg::to_proto).collect();
                commands::runs_list(&client(&data_dir, c)?, states, &filters, limit, json).await?;
                Ok(ExitCode::SUCCESS)
            }
            RunsCommand::Cancel {
                run_id,
                reason,
                json,
                client: c,
            } => {
                commands::runs_cancel(&client(&data_dir, c)?, &run_id, &reason, json).await?;
                Ok(ExitCode::SUCCESS)
            }
            RunsCommand::Resolve {
                run_id,
                topic,
                choose,
                follow_up_profile,
                goal,
                close,
                rationale,
                evidence,
                ticket,
                json,
                client: c,
            } => {
                let input = match (choose, follow_up_profile, goal) {
                    (Some(delegation), _, _) => ResolveInput::Settle {
                        // clap requires --topic with --choose.
                        topic: topic.unwrap_or_default(),
                        delegation,
                        evidence_ids: evidence,
                    },
                    (None, Some(profile_id), goal) => ResolveInput::FollowUp {
                        topic,
                        profile_id,
                        goal: goal.unwrap_or_default(),
                    },
                    (None, None, _) => {
                        debug_assert!(close, "clap requires one of the three inputs");
                        ResolveInput::Close { topic }
                    }
                };
                let opts = ResolveOptions {
                    run_id,
                    input,
                    rationale,
                    ticket,
                    json,
                };
                commands::runs_resolve(&client(&data_dir, c)?, &opts).await?;
                Ok(ExitCode::SUCCESS)
            }
        },
        Command::Approvals { command } => match command {
            ApprovalsCommand::List {
                run_id,
                states,
                json,
                client: c,
            } => {
                let states = states
                    .into_iter()
                    .map(|s| {
                        (match s {
                            ApprovalStateArg::Pending => v1::ApprovalState::Pending,
                            ApprovalStateArg::Approved => v1::ApprovalState::Approved,
                            ApprovalStateArg::Rejected => v1::ApprovalState::Rejected,
                            ApprovalStateArg::Expired => v1::ApprovalState::Expired,
                            ApprovalStateArg::Executed => v1::ApprovalState::Executed,
                            ApprovalStateArg::Cancelled => v1::ApprovalState::Cancelled,
                        }) as i32
                    })
                    .collect();
                commands::approvals_list(&client(&data_dir, c)?, run_id, states, json).await?;
                Ok(ExitCode::SUCCESS)
            }
            ApprovalsCommand::Approve {
                approval_id,
                hash,
                comment,
                client: c,
            } => {
                commands::approvals_decide(
                    &client(&data_dir, c)?,
                    &approval_id,
                    ApprovalVerb::Approve,
                    hash.as_deref(),
                    &comment,
                )
                .await?;
                Ok(ExitCode::SUCCESS)
            }
            ApprovalsCommand::Reject {
                approval_id,
                hash,
                comment,
                client: c,
            } => {
                commands::approvals_decide(
                    &client(&data_dir, c)?,
                    &approval_id,
                    ApprovalVerb::Reject,
                    hash.as_deref(),
                    &comment,
                )
                .await?;
                Ok(ExitCode::SUCCESS)
            }
            ApprovalsCommand::Execute {
                approval_id,
                hash,
                client: c,
            } => {
                commands::approvals_execute(&client(&data_dir, c)?, &approval_id, hash.as_deref())
                    .await?;
                Ok(ExitCode::SUCCESS)
            }
        },
        Command::Evidence { command } => match command {
            EvidenceCommand::Verify {
                run_id,
                json,
                client: c,
            } => {
                let intact =
                    commands::evidence_verify(&client(&data_dir, c)?, &run_id, json).await?;
                Ok(if intact {
                    ExitCode::SUCCESS
                } else {
                    ExitCode::from(3)
                })
            }
        },
    }
}

fn main() -> ExitCode {
    // Before any thread starts: mimalloc reads its settings as the process loads.
    convene_server::alloc::apply_allocator_settings();
    cli_main()
}

#[tokio::main]
async fn cli_main() -> ExitCode {
    let cli = Cli::parse();
    match main_inner(cli).await {
        Ok(code) => code,
        Err(e) => {
            eprintln!("convene: {e:#}");
            if e.downcast_ref::<StartRefused>().is_some() {
                ExitCode::from(2)
            } else {
                ExitCode::FAILURE
            }
        }
    }
}
