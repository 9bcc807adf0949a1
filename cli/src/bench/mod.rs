//! `convene bench`: a load generator for a mesh, and a scale run.
//!
//! By default a closed loop: `concurrency` clients each start a run, follow it to its
//! end, and start the next, for a duration or a number of runs, after a warm-up whose
//! runs are not counted. With `--rate R` an open loop instead: a run falls due every
//! 1/R seconds whatever the mesh's latency, at most `concurrency` in flight, and each
//! run's latency is counted from when it fell due, so a mesh that falls behind shows
//! it in the percentiles rather than by slowing its own load (no coordinated
//! omission). Latency (StartRun called → terminal state) goes into an HDR histogram;
//! CPU time and peak RSS are read from `/proc` for every mesh process the bench
//! started.
//!
//! The mesh is started in this process (`convene up`'s code, in-process handles), or
//! as one operating-system process per service and worker with `--processes`
//! ([`procs`]), or not at all with `--endpoint`. `--scale N` measures what N runs in
//! flight at once cost the supervisor, and how long they take to drain ([`scale`]).
//!
//! Workloads:
//! - `noop`: the payment-incident shape with no data work — three delegations in
//!   parallel, each making one authorized tool call over a one-record data set whose
//!   output is still hashed, stored as an artifact with its evidence record and cited
//!   by one claim, then the join. Everything a real run persists is persisted.
//! - `payment-incident`: the example run over the example data.
//! - `model`: the payment incident with model-driven specialists (`run-model.yaml`)
//!   against a scripted OpenAI-compatible server in this process that answers at once;
//!   measured beside the playbook incident (`run.yaml`) in the same mesh, it reports
//!   the agent runtime's own CPU per model turn ([`model`]).

mod load;
mod mesh;
mod model;
mod proc_stats;
pub mod procs;
pub mod progress;
mod report;
pub mod scale;
mod workload;

use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::client;

pub use load::{Driver, Load, measure, warm_up};
pub use mesh::{Measured, MeshMode, Proc, Started};
use mesh::{MeshPlan, start_mesh};
pub use model::{GOAL_CPU_MS_PER_TURN, ModelReport};
use proc_stats::{cpu_by_process, peak_rss_by_process};
pub use proc_stats::{cpu_seconds, peak_rss, rss};
pub use report::{Latency, Outcome, Report, summary};
use workload::{NOOP_POLICY_PROFILE, NOOP_PROFILE, NOOP_SPEC, with_profile};
pub use workload::{Prepared, Workload, prepare};

/// Flags of `convene bench`.
#[derive(Debug, Clone, clap::Args)]
pub struct BenchArgs {
    /// The workload.
    #[arg(long, value_enum, default_value_t = Workload::Noop)]
    pub workload: Workload,
    /// Runs in flight at once (closed loop: each client starts its next run when the
    /// previous one ended); with --rate, the most runs in flight at once.
    #[arg(long, default_value_t = 64)]
    pub concurrency: usize,
    /// Open loop: start a run every 1/RATE seconds, however long the runs take, and
    /// count each run's latency from when it fell due (a run due while --concurrency
    /// runs are in flight starts late, and its wait counts). Shows the latency a mesh
    /// gives at a given load, where the closed loop's latency is bound to its
    /// throughput (mean latency = concurrency / runs per second). Every run that falls
    /// due within --duration is measured, so a rate the mesh cannot keep up with
    /// makes the phase last longer than that.
    #[arg(long, value_name = "RUNS_PER_S", conflicts_with = "scale")]
    pub rate: Option<f64>,
    /// Measure for this many seconds (after the warm-up).
    #[arg(
        long,
        value_name = "SECONDS",
        default_value_t = 10.0,
        conflicts_with = "runs"
    )]
    pub duration: f64,
    /// Measure this many runs instead of a duration.
    #[arg(long)]
    pub runs: Option<u64>,
    /// Seconds of warm-up whose runs are not counted.
    #[arg(long, value_name = "SECONDS", default_value_t = 2.0)]
    pub warmup: f64,
    /// Drive an already running mesh at this endpoint instead of starting one (the
    /// credential comes from the data directory or --credential). Not with --workload
    /// model, whose workers must be pointed at the bench's scripted model server.
    #[arg(long, value_name = "URL")]
    pub endpoint: Option<String>,
    /// Bearer credential for --endpoint.
    #[arg(long, env = "CONVENE_CREDENTIAL", hide_env_values = true)]
    pub credential: Option<String>,
    /// Workers of the started mesh.
    #[arg(long, default_value_t = 2)]
    pub workers: usize,
    /// Delegations each worker of the started mesh runs at once [default: 4096; with
    /// --scale, enough for every delegation of the N runs].
    #[arg(long)]
    pub capacity: Option<u32>,
    /// Database of the started mesh: `sqlite` (the SQLite file in the data directory,
    /// the default; with --processes a file per service, `<service>.db`), a SQLite path
    /// or sqlite:// URL (shared by every process), a postgres://... URL, or `memory`
    /// (state in memory only).
    #[arg(long = "store", value_name = "URL")]
    pub database_url: Option<String>,
    /// Start every service and worker as its own process (`convene serve <service>` on
    /// loopback ports) instead of all in this process; CPU and peak RSS are reported
    /// per process. With --workload model the scripted model server stays in the
    /// bench's process (the workers reach it through their profiles file), whose CPU
    /// counts in the model figures.
    #[arg(long, conflicts_with = "endpoint")]
    pub processes: bool,
    /// Scale run: start N runs at once whose workers hold every delegation until all
    /// are in flight, report the supervisor's resident memory per run in flight, then
    /// release them and report the time to drain. --concurrency bounds the StartRun
    /// calls in flight while submitting.
    #[arg(
        long,
        value_name = "N",
        conflicts_with_all = ["endpoint", "runs", "duration", "workload"]
    )]
    pub scale: Option<u64>,
    /// The started mesh's supervisor holds a run's progress that decides nothing for at
    /// most this long, to commit it with the run's next step (see `convene up --help`);
    /// 0s commits every step at once.
    #[arg(
        long,
        value_name = "DURATION",
        default_value = "50ms",
        value_parser = humantime::parse_duration,
        conflicts_with = "endpoint"
    )]
    pub commit_linger: Duration,
    /// The started mesh's supervisor runs at most this many runs at once and refuses
    /// more StartRuns with RESOURCE_EXHAUSTED (counted as refused in the report); with
    /// --scale, at least N.
    #[arg(
        long,
        value_name = "RUNS",
        default_value_t = convene_supervisor::DEFAULT_MAX_ACTIVE_RUNS,
        conflicts_with = "endpoint"
    )]
    pub max_active_runs: usize,
    /// The payment-incident example the workloads are built from: its policy,
    /// profiles, run spec and data (a relative path is from the current directory).
    #[arg(long, value_name = "DIR", default_value = "examples/payment-incident")]
    pub example: PathBuf,
    /// Print one JSON object instead of the human summary.
    #[arg(long)]
    pub json: bool,
}

impl BenchArgs {
    /// The database URL `--store` names: `sqlite` means the default SQLite file in the
    /// data directory (no URL); anything else is passed on as it is.
    pub fn store_url(&self) -> Option<String> {
        self.database_url
            .as_deref()
            .map(str::trim)
            .filter(|u| !u.eq_ignore_ascii_case("sqlite"))
            .map(str::to_owned)
    }
}

/// Resolves when this process is asked to stop (Ctrl-C, SIGTERM, SIGHUP), naming the
/// signal; never when the handlers cannot be installed.
async fn interrupted() -> &'static str {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut term), Ok(mut hup)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::hangup()),
    ) else {
        return std::future::pending().await;
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => "SIGINT",
        _ = term.recv() => "SIGTERM",
        _ = hup.recv() => "SIGHUP",
    }
}

/// `convene bench`: prepares the workload in `data_dir` (a fresh temporary directory
/// when None), starts the mesh (unless --endpoint), measures, and stops the mesh again,
/// also when interrupted or failing: no mesh process outlives the bench.
///
/// # Errors
///
/// The mesh cannot be started or reached, a setting is invalid, or a signal
/// interrupted the bench.
pub async fn run(args: &BenchArgs, data_dir: Option<&Path>) -> anyhow::Result<Outcome> {
    Load::of(args).check()?;
    anyhow::ensure!(args.workers > 0, "--workers must be at least 1");
    let scratch = tempfile::tempdir()?;
    let dir = data_dir.map_or_else(|| scratch.path().to_owned(), Path::to_owned);
    if let Some(n) = args.scale {
        return scale::run(args, n, &dir).await;
    }
    anyhow::ensure!(
        !(args.workload == Workload::Model && args.endpoint.is_some()),
        "--workload model cannot drive a mesh at --endpoint: its workers must be pointed at \
         the bench's scripted model server, which only a mesh the bench starts is; leave \
         out --endpoint (the bench starts a mesh, or one process per service with \
         --processes)"
    );
    // The model workload's scripted server, which its profiles are pointed at.
    let server = match args.workload {
        Workload::Model => {
            Some(model::ModelServer::start(&workload::example_profiles(&args.example)?).await?)
        }
        Workload::Noop | Workload::PaymentIncident => None,
    };
    let prepared = prepare(
        args.workload,
        &dir.join("bench"),
        &args.example,
        server.as_ref().map(model::ModelServer::base_url),
    )?;
    if let Some(endpoint) = &args.endpoint {
        let c =
            client::Client::resolve(endpoint.clone(), None, &dir, None, args.credential.clone())?;
        let driver = Driver::grpc(endpoint, c.credential)?;
        let measured = Measured {
            mode: MeshMode::Endpoint,
            processes: Vec::new(),
            client: None,
        };
        let measuring = measure(&driver, &prepared.spec, prepared.expected, args, &measured);
        return tokio::select! {
            report = measuring => report.map(Outcome::Load),
            signal = interrupted() => Err(anyhow::anyhow!("interrupted by {signal}")),
        };
    }
    let plan = MeshPlan {
        prepared: &prepared,
        dir: &dir,
        capacity: args.capacity.unwrap_or(4096),
        concurrency_limit: None,
        max_active_runs: args.max_active_runs,
    };
    // One set of signal listeners for the whole bench, so no signal falls between two.
    let signal = interrupted();
    tokio::pin!(signal);
    // An interrupted start drops the half-started mesh, which kills its processes.
    let (driver, measured, started) = tokio::select! {
        started = start_mesh(args, &plan) => started?,
        signal = &mut signal => anyhow::bail!("interrupted by {signal} while starting the mesh"),
    };
    let measuring = async {
        match &server {
            Some(server) => model::measure(&driver, &prepared, args, &measured, server).await,
            None => measure(&driver, &prepared.spec, prepared.expected, args, &measured).await,
        }
    };
    let outcome = tokio::select! {
        report = measuring => report,
        signal = &mut signal => Err(anyhow::anyhow!("interrupted by {signal}")),
    };
    started.stop().await;
    // The workers are gone: the scripted model server can stop (when dropped).
    drop(server);
    outcome.map(Outcome::Load)
}
