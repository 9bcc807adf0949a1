//! `convene bench`: a closed-loop load generator for a mesh.
//!
//! `concurrency` clients each start a run, follow it to its end, and start the next, for
//! a duration or a number of runs, after a warm-up whose runs are not counted. Latency
//! (StartRun accepted → terminal state) goes into an HDR histogram; CPU time and peak
//! RSS are read from `/proc` for this process and every mesh process it started.
//!
//! Workloads:
//! - `noop`: the payment-incident shape with no data work — three delegations in
//!   parallel, each making one authorized tool call over a one-record data set whose
//!   output is still hashed, stored as an artifact with its evidence record and cited
//!   by one claim, then the join. Everything a real run persists is persisted.
//! - `payment-incident`: the example run over the example data.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use convene_mesh::auth::request;
use convene_mesh::handles::{GrpcSupervisor, SupervisorHandle};
use convene_proto::v1::{self, run_event::Kind};
use futures::StreamExt as _;
use hdrhistogram::Histogram;
use serde::Serialize;
use tokio::sync::Mutex;

use crate::spec;

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
    /// previous one ended).
    #[arg(long, default_value_t = 64)]
    pub concurrency: usize,
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
    /// Database of the started mesh: a SQLite path/URL or postgres://... URL
    /// [default: SQLite in the data directory]; `memory` keeps state in memory.
    #[arg(long = "store", value_name = "URL")]
    pub database_url: Option<String>,
    /// Print one JSON object instead of the human summary.
    #[arg(long)]
    pub json: bool,
}

/// The result of a benchmark.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// The workload.
    pub workload: Workload,
    /// Runs in flight at once.
    pub concurrency: usize,
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
    /// Peak resident set size of the mesh (summed over its processes).
    pub peak_rss_bytes: u64,
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

/// Writes what `workload` needs into `dir`.
pub fn prepare(workload: Workload, dir: &Path, repo: &Path) -> anyhow::Result<Prepared> {
    std::fs::create_dir_all(dir)?;
    let example = repo.join("examples/payment-incident");
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
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines().find(|l| l.starts_with("VmHWM:")).and_then(|l| {
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

    /// Starts one run and follows it to its end; returns its terminal state.
    pub async fn one(&self, spec: &v1::RunSpec) -> anyhow::Result<i32> {
        let run = self
            .supervisor
            .start_run(request(
                v1::StartRunRequest {
                    spec: Some(spec.clone()),
                },
                &self.credential,
            ))
            .await?
            .into_inner()
            .run
            .context("no run returned")?;
        if crate::report::is_terminal(run.state) {
            return Ok(run.state);
        }
        let mut events = self
            .supervisor
            .watch_run(request(
                v1::WatchRunRequest {
                    run_id: run.run_id.clone(),
                    after_sequence: 0,
                },
                &self.credential,
            ))
            .await?
            .into_inner();
        while let Some(e) = events.next().await {
            if let Some(Kind::Terminal(t)) = e?.event.and_then(|e| e.kind) {
                return Ok(t.state);
            }
        }
        anyhow::bail!(
            "run {} ended its event stream without a terminal event",
            run.run_id
        )
    }
}

/// Runs the closed loop: a warm-up, then the measured phase. `pids` are the mesh's
/// processes whose CPU time and peak RSS are reported.
pub async fn measure(
    driver: &Driver,
    spec: &v1::RunSpec,
    expected: v1::RunState,
    args: &BenchArgs,
    pids: &[u32],
) -> anyhow::Result<Report> {
    anyhow::ensure!(args.concurrency > 0, "--concurrency must be at least 1");
    // Warm-up: same loop, results dropped.
    if args.warmup > 0.0 {
        let until = Instant::now() + Duration::from_secs_f64(args.warmup);
        let clients = (0..args.concurrency).map(|_| async {
            while Instant::now() < until {
                let _ = driver.one(spec).await;
            }
        });
        futures::future::join_all(clients).await;
    }
    let histogram = Arc::new(Mutex::new(
        Histogram::<u64>::new_with_bounds(1, 600_000_000, 3).context("histogram")?,
    ));
    let ok = Arc::new(AtomicU64::new(0));
    let errors = Arc::new(AtomicU64::new(0));
    let started = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let cpu_before: f64 = pids.iter().map(|p| cpu_seconds(*p)).sum();
    let begin = Instant::now();
    let until = begin + Duration::from_secs_f64(args.duration);
    let clients = (0..args.concurrency).map(|_| {
        let (histogram, ok, errors, started, stop) = (
            histogram.clone(),
            ok.clone(),
            errors.clone(),
            started.clone(),
            stop.clone(),
        );
        async move {
            loop {
                if stop.load(Ordering::Relaxed) {
                    break;
                }
                match args.runs {
                    Some(n) if started.fetch_add(1, Ordering::Relaxed) >= n => break,
                    None if Instant::now() >= until => break,
                    _ => {}
                }
                let t0 = Instant::now();
                match driver.one(spec).await {
                    Ok(state) if state == expected as i32 => {
                        #[allow(clippy::cast_possible_truncation)] // µs of one run fit u64
                        let us = t0.elapsed().as_micros() as u64;
                        let _ = histogram.lock().await.record(us.max(1));
                        ok.fetch_add(1, Ordering::Relaxed);
                    }
                    Ok(_) | Err(_) => {
                        errors.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
        }
    });
    futures::future::join_all(clients).await;
    let elapsed = begin.elapsed().as_secs_f64();
    let cpu_after: f64 = pids.iter().map(|p| cpu_seconds(*p)).sum();
    let h = histogram.lock().await;
    let runs = ok.load(Ordering::Relaxed);
    #[allow(clippy::cast_precision_loss)] // run counts are far below 2^52
    let per_run = |x: f64| if runs == 0 { 0.0 } else { x / runs as f64 };
    #[allow(clippy::cast_precision_loss)]
    let runs_per_s = runs as f64 / elapsed.max(f64::EPSILON);
    Ok(Report {
        workload: args.workload,
        concurrency: args.concurrency,
        duration_s: elapsed,
        runs,
        errors: errors.load(Ordering::Relaxed),
        runs_per_s,
        latency_us: Latency {
            p50: h.value_at_quantile(0.50),
            p95: h.value_at_quantile(0.95),
            p99: h.value_at_quantile(0.99),
            max: h.max(),
        },
        cpu_s_per_run: per_run(cpu_after - cpu_before),
        peak_rss_bytes: pids.iter().map(|p| peak_rss(*p)).sum(),
    })
}

/// The human summary.
pub fn summary(r: &Report) -> String {
    format!(
        "workload {:?}, concurrency {}: {} runs in {:.1} s = {:.0} runs/s ({} errors)\n\
         latency p50 {:.2} ms, p95 {:.2} ms, p99 {:.2} ms, max {:.2} ms\n\
         CPU {:.3} ms per run (all mesh processes), peak RSS {:.1} MiB",
        r.workload,
        r.concurrency,
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
    )
}
