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

pub mod procs;
pub mod progress;
pub mod scale;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use convene_mesh::auth::request;
use convene_mesh::handles::{GrpcSupervisor, SupervisorHandle};
use convene_proto::v1;
use convene_server::Shutdown;
use hdrhistogram::Histogram;
use serde::Serialize;

use crate::{client, spec, up};

/// What each run does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Workload {
    /// Three parallel delegations, one authorized tool call and one stored, cited piece
    /// of evidence each, then the join.
    Noop,
    /// The payment-incident example over its dataset.
    PaymentIncident,
}

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
    /// credential comes from the data directory or --credential).
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
    /// per process.
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

/// Where the measured mesh runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum MeshMode {
    /// Every service in the bench's process.
    OneProcess,
    /// Every service and worker its own process.
    Processes,
    /// A mesh the bench did not start (--endpoint): no CPU or memory figures.
    Endpoint,
}

/// A process of the mesh whose CPU time and memory are reported.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Proc {
    /// Its name in the report (`convene` in one process, else the service or worker).
    pub name: String,
    /// Its pid.
    pub pid: u32,
}

/// The result of a benchmark.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// The workload.
    pub workload: Workload,
    /// Where the mesh runs.
    pub mode: MeshMode,
    /// Runs in flight at once (closed loop), or the most allowed in flight (open loop).
    pub concurrency: usize,
    /// Open loop: the runs per second offered.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rate: Option<f64>,
    /// Open loop: the most runs that were in flight at once.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_in_flight: Option<u64>,
    /// Seconds measured.
    pub duration_s: f64,
    /// Runs that ended as the workload expects.
    pub runs: u64,
    /// Runs that failed or ended otherwise.
    pub errors: u64,
    /// Runs per second.
    pub runs_per_s: f64,
    /// Latency percentiles in microseconds.
    pub latency_us: Latency,
    /// CPU seconds (user + system, all mesh processes) per run.
    pub cpu_s_per_run: f64,
    /// Peak resident set size of the mesh (summed over its processes' peaks).
    pub peak_rss_bytes: u64,
    /// CPU seconds per run of each mesh process.
    pub cpu_s_per_run_by_process: BTreeMap<String, f64>,
    /// Peak resident set size of each mesh process.
    pub rss_by_process: BTreeMap<String, u64>,
    /// CPU seconds per run of the bench's own client work, when it runs apart from the
    /// mesh (with --processes; in one process it is part of `cpu_s_per_run`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub client_cpu_s_per_run: Option<f64>,
}

/// Latency percentiles in microseconds.
#[derive(Debug, Clone, Serialize)]
pub struct Latency {
    /// Median.
    pub p50: u64,
    /// 95th percentile.
    pub p95: u64,
    /// 99th percentile.
    pub p99: u64,
    /// Maximum.
    pub max: u64,
}

/// Files a workload needs: policy, profiles, tool data, and the spec.
pub struct Prepared {
    /// Policy file.
    pub policy: PathBuf,
    /// Profiles file.
    pub profiles: PathBuf,
    /// Tool data directory.
    pub data: PathBuf,
    /// The spec each run submits (without an idempotency key).
    pub spec: v1::RunSpec,
    /// The outcome every run must reach to count.
    pub expected: v1::RunState,
}

const NOOP_CHANGES: &str = r#"{"changes":[{"change_id":"CHG-1","ts":"2026-07-23T02:00:00.000Z","kind":"config","resource":"change/noop","service":"noop","summary":"nothing","owner":"bench","ticket":"B-1"}]}"#;

const NOOP_PROFILE: &str = r#"
  - id: noop
    version: "1.0.0"
    name: No-op
    description: One authorized read of a one-record data set, stored and cited.
    instructions: Read the change log once and report it.
    provider: playbook
    default_tools: [list_changes@1]
    max_iterations: 2
    capabilities:
      - { action: "changes:read", resource: "change/*" }
      - { action: "evidence:*", resource: "evidence" }
    evidence_prefixes: ["changes://"]
    supports_parallel_completion: true
    playbook:
      summary: one read
      steps:
        - { id: read, tool: list_changes@1, evidence_kind: observation, args: {} }
      rules:
        - step: read
          when: { path: count, op: gt, value: 0 }
          claim:
            claim_id: claim-noop
            topic: noop
            value: ok
            statement: "{count} change(s) read"
            confidence: 1.0
"#;

const NOOP_POLICY_PROFILE: &str = r#"
  - id: noop
    investigating: true
    tools: [list_changes@1]
    evidence_prefixes: ["changes://"]
    capabilities:
      - { action: "changes:read", resource: "change/*" }
      - { action: "evidence:*", resource: "evidence" }
"#;

const NOOP_SPEC: &str = r#"
goal: No-op benchmark run
delegations:
  - { name: n1, profile_id: noop, goal: read, scope: { resources: ["change/*"], time_range: { start: "2026-07-23T01:00:00Z", end: "2026-07-23T03:00:00Z" } }, required_scopes: [{ action: "changes:read", resource: "change/*" }] }
  - { name: n2, profile_id: noop, goal: read, scope: { resources: ["change/*"], time_range: { start: "2026-07-23T01:00:00Z", end: "2026-07-23T03:00:00Z" } }, required_scopes: [{ action: "changes:read", resource: "change/*" }] }
  - { name: n3, profile_id: noop, goal: read, scope: { resources: ["change/*"], time_range: { start: "2026-07-23T01:00:00Z", end: "2026-07-23T03:00:00Z" } }, required_scopes: [{ action: "changes:read", resource: "change/*" }] }
join: { strategy: JOIN_STRATEGY_ALL, minimum: { count: 3 } }
limits: { timeout: 60s }
"#;

/// Writes what `workload` needs into `dir`, from the payment-incident example in
/// `example`.
pub fn prepare(workload: Workload, dir: &Path, example: &Path) -> anyhow::Result<Prepared> {
    let example = std::path::absolute(example)
        .with_context(|| format!("cannot resolve {}", example.display()))?;
    anyhow::ensure!(
        example.join("policy.yaml").is_file(),
        "no payment-incident example at {} (its policy.yaml, profiles.yaml, run.yaml and \
         data/, which the bench builds its workloads from): run convene bench from the \
         root of the convene repository, or pass --example <path to its \
         examples/payment-incident>",
        example.display()
    );
    std::fs::create_dir_all(dir)?;
    let read = |p: &Path| {
        std::fs::read_to_string(p).with_context(|| format!("cannot read {}", p.display()))
    };
    let mut policy = read(&example.join("policy.yaml"))?;
    let mut profiles = read(&example.join("profiles.yaml"))?;
    let (data, spec_text, expected) = match workload {
        Workload::PaymentIncident => (
            example.join("data"),
            read(&example.join("run.yaml"))?,
            v1::RunState::WaitingApproval,
        ),
        Workload::Noop => {
            let data = dir.join("noop-data");
            std::fs::create_dir_all(data.join("changes"))?;
            std::fs::write(data.join("changes/changes.json"), NOOP_CHANGES)?;
            policy = policy.replacen("profiles:\n", &format!("profiles:{NOOP_POLICY_PROFILE}"), 1);
            profiles = profiles.replacen("profiles:\n", &format!("profiles:{NOOP_PROFILE}"), 1);
            (data, NOOP_SPEC.to_owned(), v1::RunState::Succeeded)
        }
    };
    let policy_path = dir.join("bench-policy.yaml");
    let profiles_path = dir.join("bench-profiles.yaml");
    std::fs::write(&policy_path, policy)?;
    std::fs::write(&profiles_path, profiles)?;
    let mut spec = spec::parse(&spec_text, Path::new("bench.yaml"))?;
    spec.idempotency_key.clear();
    Ok(Prepared {
        policy: policy_path,
        profiles: profiles_path,
        data,
        spec,
        expected,
    })
}

/// CPU seconds (user + system) of a process, from `/proc/<pid>/stat`.
pub fn cpu_seconds(pid: u32) -> f64 {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return 0.0;
    };
    // Fields after the parenthesised command name; utime and stime are the 12th and 13th.
    let Some(rest) = stat.rsplit_once(')').map(|(_, r)| r) else {
        return 0.0;
    };
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks: u64 = [11, 12]
        .iter()
        .filter_map(|i| fields.get(*i).and_then(|f| f.parse::<u64>().ok()))
        .sum();
    #[allow(clippy::cast_precision_loss)] // CPU ticks fit f64 exactly for any real run
    let secs = ticks as f64 / rustix::param::clock_ticks_per_second() as f64;
    secs
}

/// Peak resident set size of a process in bytes, from `/proc/<pid>/status` (VmHWM).
pub fn peak_rss(pid: u32) -> u64 {
    status_bytes(pid, "VmHWM:")
}

/// Resident set size of a process now, in bytes, from `/proc/<pid>/status` (VmRSS).
pub fn rss(pid: u32) -> u64 {
    status_bytes(pid, "VmRSS:")
}

fn status_bytes(pid: u32, field: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines().find(|l| l.starts_with(field)).and_then(|l| {
                l.split_whitespace()
                    .nth(1)
                    .and_then(|v| v.parse::<u64>().ok())
            })
        })
        .map_or(0, |kb| kb * 1024)
}

/// How runs are submitted and followed.
#[derive(Clone)]
pub struct Driver {
    /// The supervisor.
    pub supervisor: SupervisorHandle,
    /// The credential runs are started with.
    pub credential: String,
}

impl Driver {
    /// A driver for the supervisor at `endpoint`.
    pub fn grpc(endpoint: &str, credential: String) -> anyhow::Result<Self> {
        Ok(Self {
            supervisor: Arc::new(GrpcSupervisor::connect(endpoint)?),
            credential,
        })
    }

    /// Starts one run and waits for its end (`StartRun` with `wait`: the answer comes
    /// when the run has ended, one call and one message per run); returns its
    /// terminal state.
    pub async fn one(&self, spec: &v1::RunSpec) -> anyhow::Result<i32> {
        let run = self
            .supervisor
            .start_run(request(
                v1::StartRunRequest {
                    spec: Some(spec.clone()),
                    wait: true,
                },
                &self.credential,
            ))
            .await?
            .into_inner()
            .run
            .context("no run returned")?;
        anyhow::ensure!(
            crate::report::is_terminal(run.state),
            "run {} was answered before it ended (state {}): the supervisor does not wait for runs; upgrade it",
            run.run_id,
            run.state
        );
        Ok(run.state)
    }
}

/// How runs are offered: a closed loop of `concurrency` clients, or, with a rate, an
/// open loop of at most `concurrency` runs in flight.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Load {
    /// Clients of the closed loop, or the most runs in flight of the open loop.
    pub concurrency: usize,
    /// The open loop's runs per second; None: the closed loop.
    pub rate: Option<f64>,
}

impl Load {
    /// The load `args` asks for.
    pub fn of(args: &BenchArgs) -> Self {
        Self {
            concurrency: args.concurrency,
            rate: args.rate,
        }
    }

    /// Refuses a load no run could be offered at.
    fn check(self) -> anyhow::Result<()> {
        anyhow::ensure!(self.concurrency > 0, "--concurrency must be at least 1");
        if let Some(rate) = self.rate {
            anyhow::ensure!(
                rate.is_finite() && rate > 0.0,
                "--rate must be a positive number of runs per second, not {rate}"
            );
        }
        Ok(())
    }
}

/// When a phase stops starting runs.
#[derive(Debug, Clone, Copy)]
enum Stop {
    /// No run starts (closed loop) or falls due (open loop) at or after this instant;
    /// an open loop that fell behind still starts every run that fell due before it.
    At(Instant),
    /// No run starts at or after this instant, due or not (a warm-up).
    By(Instant),
    /// After this many runs.
    After(u64),
}

/// The runs of a phase as they end: counts, and the latencies of those that ended as
/// the workload expects.
struct Tally {
    expected: v1::RunState,
    counts: progress::Counts,
    histogram: std::sync::Mutex<Histogram<u64>>,
}

impl Tally {
    fn new(expected: v1::RunState) -> anyhow::Result<Arc<Self>> {
        Ok(Arc::new(Self {
            expected,
            counts: progress::Counts::default(),
            histogram: std::sync::Mutex::new(
                Histogram::<u64>::new_with_bounds(1, 600_000_000, 3).context("histogram")?,
            ),
        }))
    }

    /// Counts a run that was due at `due` and ended as `ended` says.
    fn record(&self, due: Instant, ended: anyhow::Result<i32>) {
        match ended {
            Ok(state) if state == self.expected as i32 => {
                #[allow(clippy::cast_possible_truncation)] // µs of one run fit u64
                let us = due.elapsed().as_micros() as u64;
                // A value above the histogram's bound (10 minutes) is clamped to it.
                self.histogram
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .saturating_record(us.max(1));
                self.counts.ok.fetch_add(1, Ordering::Relaxed);
            }
            Ok(state) => {
                tracing::warn!(
                    state = v1::RunState::try_from(state).map_or("UNKNOWN", |s| s.as_str_name()),
                    "a run ended in a state the workload does not expect"
                );
                self.counts.errors.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => {
                tracing::warn!(error = %format!("{e:#}"), "a run failed");
                self.counts.errors.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

/// Offers runs of `spec` as `load` says until `stop`, and waits for every run it
/// started; returns the most runs that were in flight at once (open loop only).
async fn drive(
    driver: &Driver,
    spec: &Arc<v1::RunSpec>,
    load: Load,
    stop: Stop,
    tally: &Arc<Tally>,
) -> Option<u64> {
    match load.rate {
        None => {
            closed_loop(driver, spec, load.concurrency, stop, tally).await;
            None
        }
        Some(rate) => Some(open_loop(driver, spec, rate, load.concurrency, stop, tally).await),
    }
}

/// The closed loop: `concurrency` clients, each starting a run when its last one ended;
/// a run's latency counts from its start.
async fn closed_loop(
    driver: &Driver,
    spec: &v1::RunSpec,
    concurrency: usize,
    stop: Stop,
    tally: &Tally,
) {
    let started = AtomicU64::new(0);
    let clients = (0..concurrency).map(|_| async {
        loop {
            let go = match stop {
                Stop::After(n) => started.fetch_add(1, Ordering::Relaxed) < n,
                Stop::At(at) | Stop::By(at) => Instant::now() < at,
            };
            if !go {
                break;
            }
            let t0 = Instant::now();
            let ended = driver.one(spec).await;
            tally.record(t0, ended);
        }
    });
    futures::future::join_all(clients).await;
}

/// When run `i` of an open loop that began at `begin` falls due: `i / rate` seconds on.
fn due_at(begin: Instant, rate: f64, i: u64) -> Instant {
    #[allow(clippy::cast_precision_loss)] // run numbers are far below 2^52
    let offset = Duration::from_secs_f64(i as f64 / rate);
    begin + offset
}

/// The open loop: run `i` falls due `i / rate` seconds after the start, whatever the
/// runs before it are doing, and starts then unless `concurrency` runs are in flight
/// (then as soon as one ends). Its latency counts from when it fell due. Returns the
/// most runs that were in flight at once.
async fn open_loop(
    driver: &Driver,
    spec: &Arc<v1::RunSpec>,
    rate: f64,
    concurrency: usize,
    stop: Stop,
    tally: &Arc<Tally>,
) -> u64 {
    let slots = Arc::new(tokio::sync::Semaphore::new(concurrency));
    let mut runs = tokio::task::JoinSet::new();
    let mut most = 0;
    let begin = Instant::now();
    for i in 0.. {
        let due = due_at(begin, rate, i);
        let go = match stop {
            Stop::After(n) => i < n,
            Stop::At(at) | Stop::By(at) => due < at,
        };
        if !go {
            break;
        }
        tokio::time::sleep_until(due.into()).await;
        let Ok(slot) = slots.clone().acquire_owned().await else {
            break; // never closed
        };
        // A warm-up starts nothing once its time is up, however far behind it is.
        if matches!(stop, Stop::By(at) if Instant::now() >= at) {
            break;
        }
        most = most.max(concurrency - slots.available_permits());
        let (driver, spec, tally) = (driver.clone(), spec.clone(), tally.clone());
        runs.spawn(async move {
            let ended = driver.one(&spec).await;
            tally.record(due, ended);
            drop(slot);
        });
        // Keep the set to the runs in flight.
        while runs.try_join_next().is_some() {}
    }
    while runs.join_next().await.is_some() {}
    most as u64
}

/// Offers runs as `load` says for `seconds`, results dropped: a warm-up.
pub async fn warm_up(
    driver: &Driver,
    spec: &v1::RunSpec,
    expected: v1::RunState,
    load: Load,
    seconds: f64,
) -> anyhow::Result<()> {
    if seconds <= 0.0 {
        return Ok(());
    }
    let tally = Tally::new(expected)?;
    let line = progress::Progress::start(
        "warming up",
        progress::Goal::Seconds(seconds),
        tally.counts.clone(),
    );
    let until = Instant::now() + Duration::from_secs_f64(seconds);
    drive(
        driver,
        &Arc::new(spec.clone()),
        load,
        Stop::By(until),
        &tally,
    )
    .await;
    line.finish();
    Ok(())
}

/// CPU seconds of each process, by name.
fn cpu_by_process(processes: &[Proc]) -> BTreeMap<String, f64> {
    processes
        .iter()
        .map(|p| (p.name.clone(), cpu_seconds(p.pid)))
        .collect()
}

/// Peak RSS of each process, by name.
fn peak_rss_by_process(processes: &[Proc]) -> BTreeMap<String, u64> {
    processes
        .iter()
        .map(|p| (p.name.clone(), peak_rss(p.pid)))
        .collect()
}

/// What a measured mesh is: where it runs, its processes (whose CPU time and peak RSS
/// are reported), and the bench's own pid when it is not one of them.
#[derive(Debug, Clone)]
pub struct Measured {
    /// Where the mesh runs.
    pub mode: MeshMode,
    /// The mesh's processes.
    pub processes: Vec<Proc>,
    /// This process, when its client work is apart from the mesh.
    pub client: Option<u32>,
}

/// Offers the load `args` asks for: a warm-up, then the measured phase.
pub async fn measure(
    driver: &Driver,
    spec: &v1::RunSpec,
    expected: v1::RunState,
    args: &BenchArgs,
    mesh: &Measured,
) -> anyhow::Result<Report> {
    let load = Load::of(args);
    load.check()?;
    warm_up(driver, spec, expected, load, args.warmup).await?;
    let tally = Tally::new(expected)?;
    let cpu_before = cpu_by_process(&mesh.processes);
    let client_before = mesh.client.map(cpu_seconds);
    let begin = Instant::now();
    let (stop, goal) = match args.runs {
        Some(n) => (Stop::After(n), progress::Goal::Runs(n)),
        None => (
            Stop::At(begin + Duration::from_secs_f64(args.duration)),
            progress::Goal::Seconds(args.duration),
        ),
    };
    let line = progress::Progress::start("measuring", goal, tally.counts.clone());
    let max_in_flight = drive(driver, &Arc::new(spec.clone()), load, stop, &tally).await;
    let elapsed = begin.elapsed().as_secs_f64();
    line.finish();
    let cpu_after = cpu_by_process(&mesh.processes);
    let client_after = mesh.client.map(cpu_seconds);
    let h = tally
        .histogram
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .clone();
    let runs = tally.counts.ok.load(Ordering::Relaxed);
    #[allow(clippy::cast_precision_loss)] // run counts are far below 2^52
    let per_run = |x: f64| if runs == 0 { 0.0 } else { x / runs as f64 };
    #[allow(clippy::cast_precision_loss)]
    let runs_per_s = runs as f64 / elapsed.max(f64::EPSILON);
    let cpu_s_per_run_by_process: BTreeMap<String, f64> = cpu_after
        .iter()
        .map(|(name, after)| {
            let before = cpu_before.get(name).copied().unwrap_or(0.0);
            (name.clone(), per_run(after - before))
        })
        .collect();
    let rss_by_process = peak_rss_by_process(&mesh.processes);
    Ok(Report {
        workload: args.workload,
        mode: mesh.mode,
        concurrency: args.concurrency,
        rate: load.rate,
        max_in_flight,
        duration_s: elapsed,
        runs,
        errors: tally.counts.errors.load(Ordering::Relaxed),
        runs_per_s,
        latency_us: Latency {
            p50: h.value_at_quantile(0.50),
            p95: h.value_at_quantile(0.95),
            p99: h.value_at_quantile(0.99),
            max: h.max(),
        },
        cpu_s_per_run: cpu_s_per_run_by_process.values().sum(),
        peak_rss_bytes: rss_by_process.values().sum(),
        cpu_s_per_run_by_process,
        rss_by_process,
        client_cpu_s_per_run: client_before
            .zip(client_after)
            .map(|(before, after)| per_run(after - before)),
    })
}

/// A mesh the bench started, stopped when the bench ends.
pub enum Started {
    /// Every service in this process.
    InProcess(up::Mesh),
    /// Every service and worker its own process.
    Processes(procs::ProcessMesh),
}

impl Started {
    /// Stops the mesh and waits for it.
    pub async fn stop(self) {
        match self {
            Started::InProcess(mesh) => {
                mesh.shutdown.trigger();
                if let Err(e) = mesh.stopped().await {
                    tracing::warn!(error = %format!("{e:#}"), "the mesh did not stop cleanly");
                }
            }
            Started::Processes(mesh) => mesh.stop(STOP_GRACE).await,
        }
    }
}

/// Time each mesh process gets to drain after SIGTERM before it is killed.
const STOP_GRACE: Duration = Duration::from_secs(15);

/// The default principal of the workloads' policy, whose runs the bench starts.
const PRINCIPAL: &str = "oncall@acme";

/// How the mesh is started: its files, workers and their capacity, and how many calls
/// each server takes at once (processes only).
struct MeshPlan<'a> {
    prepared: &'a Prepared,
    dir: &'a Path,
    capacity: u32,
    concurrency_limit: Option<usize>,
}

/// Starts the mesh `args` asks for (in this process or as processes) and a driver of
/// its supervisor.
async fn start_mesh(
    args: &BenchArgs,
    plan: &MeshPlan<'_>,
) -> anyhow::Result<(Driver, Measured, Started)> {
    let credentials = plan.dir.join("credentials");
    if args.processes {
        let options = procs::Options {
            bin: std::env::current_exe().context("cannot find the convene binary")?,
            data_dir: plan.dir.to_owned(),
            policy: plan.prepared.policy.clone(),
            profiles: plan.prepared.profiles.clone(),
            tools_data: plan.prepared.data.clone(),
            database_url: args.store_url(),
            workers: args.workers,
            capacity: plan.capacity,
            concurrency_limit: plan.concurrency_limit,
            commit_linger: args.commit_linger,
        };
        let mesh = procs::ProcessMesh::start(&options).await?;
        let credential = convene_mesh::policy_file::dev_credential(&credentials, PRINCIPAL)
            .context("reading the bench principal's development credential")?;
        let driver = Driver::grpc(&mesh.supervisor_endpoint, credential)?;
        let measured = Measured {
            mode: MeshMode::Processes,
            processes: mesh
                .processes()
                .into_iter()
                .map(|(name, pid)| Proc { name, pid })
                .collect(),
            client: Some(std::process::id()),
        };
        Ok((driver, measured, Started::Processes(mesh)))
    } else {
        let mut up_args = up::UpArgs::defaults("127.0.0.1:0".parse()?);
        up_args.policy_file = Some(plan.prepared.policy.clone());
        up_args.profiles_file = Some(plan.prepared.profiles.clone());
        up_args.tools_data_dir = plan.prepared.data.clone();
        up_args.workers = args.workers;
        up_args.capacity = plan.capacity;
        up_args.database_url = args.store_url();
        up_args.default_principal = Some(PRINCIPAL.to_owned());
        up_args.commit_linger = args.commit_linger;
        let mesh = up::start(&up_args, plan.dir, Shutdown::new()).await?;
        let credential = convene_mesh::policy_file::dev_credential(&credentials, PRINCIPAL)?;
        let driver = Driver {
            supervisor: Arc::new(mesh.supervisor.clone()),
            credential,
        };
        let measured = Measured {
            mode: MeshMode::OneProcess,
            processes: vec![Proc {
                name: "convene".to_owned(),
                pid: std::process::id(),
            }],
            client: None,
        };
        Ok((driver, measured, Started::InProcess(mesh)))
    }
}

/// What `convene bench` measured.
#[derive(Debug, Clone)]
pub enum Outcome {
    /// The closed loop.
    Load(Report),
    /// The scale run.
    Scale(scale::ScaleReport),
}

impl Outcome {
    /// Runs that failed or ended otherwise than the workload expects.
    pub fn errors(&self) -> u64 {
        match self {
            Outcome::Load(r) => r.errors,
            Outcome::Scale(r) => r.errors,
        }
    }

    /// One JSON object.
    ///
    /// # Errors
    ///
    /// Never in practice (the reports are plain data).
    pub fn json(&self) -> serde_json::Result<String> {
        match self {
            Outcome::Load(r) => serde_json::to_string(r),
            Outcome::Scale(r) => serde_json::to_string(r),
        }
    }

    /// The human summary.
    pub fn summary(&self) -> String {
        match self {
            Outcome::Load(r) => summary(r),
            Outcome::Scale(r) => scale::summary(r),
        }
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
    let prepared = prepare(args.workload, &dir.join("bench"), &args.example)?;
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
    };
    // One set of signal listeners for the whole bench, so no signal falls between two.
    let signal = interrupted();
    tokio::pin!(signal);
    // An interrupted start drops the half-started mesh, which kills its processes.
    let (driver, measured, started) = tokio::select! {
        started = start_mesh(args, &plan) => started?,
        signal = &mut signal => anyhow::bail!("interrupted by {signal} while starting the mesh"),
    };
    let outcome = tokio::select! {
        report = measure(&driver, &prepared.spec, prepared.expected, args, &measured) => report,
        signal = &mut signal => Err(anyhow::anyhow!("interrupted by {signal}")),
    };
    started.stop().await;
    outcome.map(Outcome::Load)
}

/// The human summary.
pub fn summary(r: &Report) -> String {
    let load = match r.rate {
        None => format!("concurrency {}", r.concurrency),
        Some(rate) => {
            let most = r.max_in_flight.unwrap_or(0);
            let capped = if most >= r.concurrency as u64 {
                " (reached: runs started late, their wait counted)"
            } else {
                ""
            };
            format!(
                "open loop at {rate} runs/s offered, at most {} in flight, {most} at once{capped}",
                r.concurrency
            )
        }
    };
    let mut text = format!(
        "workload {:?} ({:?}), {load}: {} runs in {:.1} s = {:.0} runs/s ({} errors)\n\
         latency p50 {:.2} ms, p95 {:.2} ms, p99 {:.2} ms, max {:.2} ms\n\
         CPU {:.3} ms per run (all mesh processes), peak RSS {:.1} MiB",
        r.workload,
        r.mode,
        r.runs,
        r.duration_s,
        r.runs_per_s,
        r.errors,
        r.latency_us.p50 as f64 / 1000.0,
        r.latency_us.p95 as f64 / 1000.0,
        r.latency_us.p99 as f64 / 1000.0,
        r.latency_us.max as f64 / 1000.0,
        r.cpu_s_per_run * 1000.0,
        r.peak_rss_bytes as f64 / (1024.0 * 1024.0),
    );
    if r.rss_by_process.len() > 1 {
        for (name, rss) in &r.rss_by_process {
            let cpu = r.cpu_s_per_run_by_process.get(name).copied().unwrap_or(0.0);
            text.push_str(&format!(
                "\n  {name}: CPU {:.3} ms per run, peak RSS {:.1} MiB",
                cpu * 1000.0,
                *rss as f64 / (1024.0 * 1024.0)
            ));
        }
    }
    if let Some(client) = r.client_cpu_s_per_run {
        text.push_str(&format!(
            "\n  bench client: CPU {:.3} ms per run",
            client * 1000.0
        ));
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn open_loop_runs_fall_due_at_even_intervals_from_the_start() {
        let begin = Instant::now();
        assert_eq!(due_at(begin, 100.0, 0), begin);
        assert_eq!(due_at(begin, 100.0, 50), begin + Duration::from_millis(500));
        assert_eq!(due_at(begin, 4.0, 9), begin + Duration::from_millis(2_250));
        // No drift: run 3,000,000 at 1,500/s falls due 2,000 s on, to the microsecond.
        let late = due_at(begin, 1_500.0, 3_000_000) - begin;
        assert!(late.abs_diff(Duration::from_secs(2_000)) < Duration::from_micros(1));
    }

    #[test]
    fn a_load_without_clients_or_a_rate_is_refused() {
        let check = |concurrency, rate| Load { concurrency, rate }.check();
        assert!(check(1, None).is_ok());
        assert!(check(64, Some(1_500.0)).is_ok());
        let err = check(0, None).expect_err("no clients").to_string();
        assert!(err.contains("--concurrency must be at least 1"), "{err}");
        for rate in [0.0, -5.0, f64::NAN, f64::INFINITY] {
            let err = check(64, Some(rate)).expect_err("no rate").to_string();
            assert!(
                err.contains("--rate must be a positive number"),
                "{rate}: {err}"
            );
        }
    }

    #[test]
    fn the_summary_says_how_runs_were_offered() {
        let report = |rate, max_in_flight| Report {
            workload: Workload::Noop,
            mode: MeshMode::OneProcess,
            concurrency: 64,
            rate,
            max_in_flight,
            duration_s: 10.0,
            runs: 15_000,
            errors: 0,
            runs_per_s: 1_500.0,
            latency_us: Latency {
                p50: 2_000,
                p95: 5_000,
                p99: 9_000,
                max: 20_000,
            },
            cpu_s_per_run: 0.0008,
            peak_rss_bytes: 1 << 27,
            cpu_s_per_run_by_process: BTreeMap::new(),
            rss_by_process: BTreeMap::new(),
            client_cpu_s_per_run: None,
        };
        let closed = summary(&report(None, None));
        assert!(
            closed.contains("(OneProcess), concurrency 64: 15000 runs"),
            "{closed}"
        );
        let open = summary(&report(Some(1_500.0), Some(12)));
        assert!(
            open.contains("open loop at 1500 runs/s offered, at most 64 in flight, 12 at once:"),
            "{open}"
        );
        assert!(!open.contains("reached"), "{open}");
        let capped = summary(&report(Some(1_500.0), Some(64)));
        assert!(
            capped.contains("64 at once (reached: runs started late, their wait counted)"),
            "{capped}"
        );
    }
}
