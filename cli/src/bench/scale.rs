//! `convene bench --scale N`: what N runs in flight at once cost, and how fast they
//! drain.
//!
//! The mesh serves the noop workload and a `hold` profile: the same one authorized,
//! stored and cited read, but each delegation first waits for a release file (the
//! worker's `hold` fault) and records that it waits in a log file. After a warm-up of
//! noop runs, the bench notes the supervisor's resident memory, submits N hold runs
//! (at most `--concurrency` StartRun calls at a time) and waits until every delegation
//! of every accepted run is held at a worker. The supervisor's resident memory then,
//! less the baseline, divided by N, is the memory one run in flight costs. Then the
//! bench creates the release file and measures the time until every run has ended,
//! following the supervisor's `run.completed` events.
//!
//! In one process the supervisor shares its process with every other service and the
//! workers, so its memory figure includes theirs; `--processes` measures the supervisor
//! process alone.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use convene_mesh::auth::request;
use convene_proto::v1;
use futures::StreamExt as _;
use serde::Serialize;

use super::{
    BenchArgs, Driver, MeshMode, MeshPlan, NOOP_POLICY_PROFILE, NOOP_PROFILE, NOOP_SPEC, Outcome,
    Prepared, Proc, Workload, cpu_by_process, interrupted, peak_rss_by_process, prepare, progress,
    rss, start_mesh, warm_up, with_profile,
};

/// The type of the event that ends a run.
const RUN_COMPLETED: &str = "dev.convene.run.completed.v1";

/// Delegations of each hold run (the noop shape).
const DELEGATIONS_PER_RUN: u64 = 3;

/// The result of a scale run.
#[derive(Debug, Clone, Serialize)]
pub struct ScaleReport {
    /// Always `hold`.
    pub workload: &'static str,
    /// Where the mesh runs.
    pub mode: MeshMode,
    /// Runs asked for (N).
    pub runs: u64,
    /// Delegations of each run, every one held at a worker.
    pub delegations_per_run: u64,
    /// Runs not accepted, or that ended otherwise than SUCCEEDED.
    pub errors: u64,
    /// How many of the accepted runs ended in each state.
    pub states: BTreeMap<String, u64>,
    /// The most frequent reasons given for runs that did not succeed (at most five), with
    /// how many runs gave each.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub failures: BTreeMap<String, u64>,
    /// Seconds to submit the N runs (every StartRun answered).
    pub submit_s: f64,
    /// Seconds from the first StartRun until every delegation was held.
    pub in_flight_s: f64,
    /// The process whose memory is measured: `supervisor`, or `convene` when every
    /// service runs in one process.
    pub supervisor_process: String,
    /// Its resident memory after the warm-up, before the N runs.
    pub supervisor_rss_before_bytes: u64,
    /// Its resident memory with all N runs in flight.
    pub supervisor_rss_in_flight_bytes: u64,
    /// (in flight − before) / N.
    pub bytes_per_in_flight_run: u64,
    /// Seconds from the release until every run had ended.
    pub drain_s: f64,
    /// Runs per second while draining.
    pub drain_runs_per_s: f64,
    /// CPU seconds (user + system, all mesh processes) per run, submit to drained.
    pub cpu_s_per_run: f64,
    /// Peak resident set size of the mesh (summed over its processes' peaks).
    pub peak_rss_bytes: u64,
    /// Peak resident set size of each mesh process.
    pub rss_by_process: BTreeMap<String, u64>,
}

/// The files of the hold profile.
struct Hold {
    release: std::path::PathBuf,
    log: std::path::PathBuf,
}

/// Writes the noop workload plus the `hold` profile into `dir`; returns it, the hold
/// run's spec and the hold files.
fn prepare_hold(dir: &Path, example: &Path) -> anyhow::Result<(Prepared, v1::RunSpec, Hold)> {
    let prepared = prepare(Workload::Noop, dir, example, None)?;
    let hold_dir = dir.join("hold");
    std::fs::create_dir_all(&hold_dir)?;
    let hold = Hold {
        release: hold_dir.join("release"),
        log: hold_dir.join("held"),
    };
    // A data directory used before may still hold the last run's files.
    for file in [&hold.release, &hold.log] {
        match std::fs::remove_file(file) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                return Err(e).with_context(|| format!("cannot remove {}", file.display()));
            }
            _ => {}
        }
    }
    let quoted = |p: &Path| serde_json::to_string(&p.display().to_string());
    let profile = NOOP_PROFILE
        .replacen("id: noop", "id: hold", 1)
        .replacen("name: No-op", "name: Hold", 1)
        .replacen(
            "    playbook:",
            &format!(
                "    hold: {{ release: {}, log: {} }}\n    playbook:",
                quoted(&hold.release)?,
                quoted(&hold.log)?
            ),
            1,
        );
    let policy_profile = NOOP_POLICY_PROFILE.replacen("id: noop", "id: hold", 1);
    let add = |path: &Path, entry: &str| -> anyhow::Result<()> {
        let text = std::fs::read_to_string(path)?;
        std::fs::write(
            path,
            text.replacen("profiles:\n", &format!("profiles:{entry}"), 1),
        )?;
        Ok(())
    };
    add(&prepared.profiles, &profile)?;
    let policy = std::fs::read_to_string(&prepared.policy)?;
    std::fs::write(&prepared.policy, with_profile(&policy, &policy_profile)?)?;
    // Long enough to submit, hold and drain many thousands of runs.
    let spec_text = NOOP_SPEC
        .replace("profile_id: noop", "profile_id: hold")
        .replace("timeout: 60s", "timeout: 1800s");
    let mut spec = crate::spec::parse(&spec_text, Path::new("hold.yaml"))?;
    spec.idempotency_key.clear();
    Ok((prepared, spec, hold))
}

/// How a run ended: its state and the reason given.
struct Ended {
    state: String,
    reason: String,
}

/// How runs ended, by run id, as the supervisor's `run.completed` events say.
#[derive(Default)]
struct Completions {
    ended: std::sync::Mutex<HashMap<String, Ended>>,
    /// The event stream ended or failed: nothing more will be recorded.
    closed: AtomicBool,
}

impl Completions {
    fn ended(&self) -> std::sync::MutexGuard<'_, HashMap<String, Ended>> {
        self.ended
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// How many of `runs` have ended.
    fn count(&self, runs: &[String]) -> usize {
        let ended = self.ended();
        runs.iter().filter(|r| ended.contains_key(*r)).count()
    }
}

/// Follows `run.completed` events into `completions` until the stream ends.
async fn follow_completions(driver: &Driver) -> anyhow::Result<Arc<Completions>> {
    let mut stream = driver
        .supervisor
        .watch_events(request(
            v1::WatchEventsRequest {
                after_event_id: String::new(),
                types: vec![RUN_COMPLETED.to_owned()],
                run_id: String::new(),
                follow: true,
                from_now: false,
            },
            &driver.credential,
        ))
        .await
        .context("WatchEvents")?
        .into_inner();
    let completions = Arc::new(Completions::default());
    let recorder = completions.clone();
    tokio::spawn(async move {
        while let Some(Ok(message)) = stream.next().await {
            let Some(event) = message.event else { continue };
            let field = |name: &str| {
                event
                    .data
                    .as_ref()
                    .and_then(|d| d.fields.get(name))
                    .and_then(|v| match &v.kind {
                        Some(prost_types::value::Kind::StringValue(s)) => Some(s.clone()),
                        _ => None,
                    })
                    .unwrap_or_default()
            };
            let ended = Ended {
                state: field("state"),
                reason: field("reason"),
            };
            recorder.ended().insert(event.correlation_id, ended);
        }
        recorder.closed.store(true, Ordering::Relaxed);
    });
    Ok(completions)
}

/// Lines in the hold log: delegations held so far.
fn held(log: &Path) -> u64 {
    std::fs::read(log).map_or(0, |bytes| {
        bytes.iter().filter(|b| **b == b'\n').count() as u64
    })
}

/// Polls `done` every `every` until it holds, failing with `what` after `limit` or when
/// the completion stream closed.
async fn wait_until(
    what: &str,
    limit: Duration,
    completions: &Completions,
    mut done: impl FnMut() -> bool,
) -> anyhow::Result<()> {
    let deadline = Instant::now() + limit;
    while !done() {
        anyhow::ensure!(
            !completions.closed.load(Ordering::Relaxed),
            "the supervisor's event stream ended while waiting until {what}"
        );
        anyhow::ensure!(Instant::now() < deadline, "not {what} within {limit:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(())
}

/// The scale run (see the [module docs](self)).
pub(super) async fn run(args: &BenchArgs, n: u64, dir: &Path) -> anyhow::Result<Outcome> {
    anyhow::ensure!(n > 0, "--scale must be at least 1");
    let (prepared, hold_spec, hold) = prepare_hold(&dir.join("bench"), &args.example)?;
    let delegations = n.saturating_mul(DELEGATIONS_PER_RUN);
    let workers = u64::try_from(args.workers.max(1)).unwrap_or(u64::MAX);
    // Every delegation must find a free slot while all the others are held.
    let capacity = match args.capacity {
        Some(c) => c,
        None => u32::try_from(delegations.div_ceil(workers) + 64).unwrap_or(u32::MAX),
    };
    // Every held delegation is an open Execute call, and after the release they all
    // call the policy service and the evidence store at once.
    let calls = usize::try_from(delegations.saturating_mul(2)).unwrap_or(usize::MAX);
    let plan = MeshPlan {
        prepared: &prepared,
        dir,
        capacity,
        concurrency_limit: Some(calls.saturating_add(1024)),
        // Every run of the scale run is in flight at once.
        max_active_runs: args
            .max_active_runs
            .max(usize::try_from(n).unwrap_or(usize::MAX)),
    };
    // One set of signal listeners for the whole bench, so no signal falls between two.
    let signal = interrupted();
    tokio::pin!(signal);
    // An interrupted start drops the half-started mesh, which kills its processes.
    let (driver, measured, started) = tokio::select! {
        started = start_mesh(args, &plan) => started?,
        signal = &mut signal => anyhow::bail!("interrupted by {signal} while starting the mesh"),
    };
    let measuring = measure(args, n, &driver, &prepared, &hold_spec, &hold, &measured);
    let outcome = tokio::select! {
        report = measuring => report,
        signal = &mut signal => Err(anyhow::anyhow!("interrupted by {signal}")),
    };
    started.stop().await;
    outcome.map(Outcome::Scale)
}

async fn measure(
    args: &BenchArgs,
    n: u64,
    driver: &Driver,
    prepared: &Prepared,
    hold_spec: &v1::RunSpec,
    hold: &Hold,
    measured: &super::Measured,
) -> anyhow::Result<ScaleReport> {
    let supervisor: Proc = measured
        .processes
        .iter()
        .find(|p| p.name == "supervisor")
        .or_else(|| measured.processes.first())
        .cloned()
        .context("no mesh process to measure")?;
    let warm = super::Load {
        concurrency: args.concurrency,
        rate: None,
    };
    warm_up(
        driver,
        &prepared.spec,
        prepared.expected,
        warm,
        args.warmup,
        "warming up",
    )
    .await?;
    let completions = follow_completions(driver).await?;
    let rss_before = rss(supervisor.pid);
    let cpu_before = cpu_by_process(&measured.processes);

    // Submit.
    let begin = Instant::now();
    let counts = progress::Counts::default();
    let line = progress::Progress::start("submitting", progress::Goal::Runs(n), counts.clone());
    let submitted: Vec<anyhow::Result<String>> = futures::stream::iter(0..n)
        .map(|_| async {
            let accepted = async {
                let response = driver
                    .supervisor
                    .start_run(request(
                        v1::StartRunRequest {
                            spec: Some(hold_spec.clone()),
                            wait: false,
                            ..Default::default()
                        },
                        &driver.credential,
                    ))
                    .await?;
                response
                    .into_inner()
                    .run
                    .map(|r| r.run_id)
                    .context("StartRun returned no run")
            }
            .await;
            let count = if accepted.is_ok() {
                &counts.ok
            } else {
                &counts.errors
            };
            count.fetch_add(1, Ordering::Relaxed);
            accepted
        })
        .buffer_unordered(args.concurrency)
        .collect()
        .await;
    let submit_s = begin.elapsed().as_secs_f64();
    line.finish();
    let mut refused = 0u64;
    let mut runs = Vec::with_capacity(submitted.len());
    for s in submitted {
        match s {
            Ok(id) => runs.push(id),
            Err(e) => {
                if refused == 0 {
                    tracing::warn!(error = %format!("{e:#}"), "a run was not accepted");
                }
                refused += 1;
            }
        }
    }

    // Wait until every delegation of every accepted run that has not ended is held.
    let hold_limit = Duration::from_secs(300).max(Duration::from_millis(50) * saturate(n));
    wait_until(
        "every delegation was held",
        hold_limit,
        &completions,
        || {
            let live = runs.len().saturating_sub(completions.count(&runs)) as u64;
            held(&hold.log) >= live * DELEGATIONS_PER_RUN
        },
    )
    .await?;
    let in_flight_s = begin.elapsed().as_secs_f64();
    let rss_in_flight = rss(supervisor.pid);

    // Release and drain.
    std::fs::write(&hold.release, b"")
        .with_context(|| format!("cannot create {}", hold.release.display()))?;
    let released = Instant::now();
    let drain_limit = Duration::from_secs(600).max(Duration::from_millis(100) * saturate(n));
    let ended = progress::Counts::default();
    let line = progress::Progress::start(
        "draining",
        progress::Goal::Runs(runs.len() as u64),
        ended.clone(),
    );
    wait_until("every run had ended", drain_limit, &completions, || {
        let count = completions.count(&runs);
        ended.ok.store(count as u64, Ordering::Relaxed);
        count == runs.len()
    })
    .await?;
    let drain_s = released.elapsed().as_secs_f64();
    line.finish();

    let cpu_after = cpu_by_process(&measured.processes);
    let succeeded = v1::RunState::Succeeded.as_str_name();
    let mut states = BTreeMap::new();
    let mut reasons: HashMap<String, u64> = HashMap::new();
    {
        let ended = completions.ended();
        for run in &runs {
            let (state, reason) = ended
                .get(run)
                .map_or(("", ""), |e| (e.state.as_str(), e.reason.as_str()));
            *states.entry(state.to_owned()).or_insert(0u64) += 1;
            if state != v1::RunState::Succeeded.as_str_name() {
                *reasons.entry(reason.to_owned()).or_default() += 1;
            }
        }
    }
    let mut reasons: Vec<(String, u64)> = reasons.into_iter().collect();
    reasons.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    let failures: BTreeMap<String, u64> = reasons.into_iter().take(5).collect();
    let failed = runs.len() as u64 - states.get(succeeded).copied().unwrap_or(0);
    let cpu: f64 = cpu_after
        .iter()
        .map(|(name, after)| after - cpu_before.get(name).copied().unwrap_or(0.0))
        .sum();
    let rss_by_process = peak_rss_by_process(&measured.processes);
    #[allow(clippy::cast_precision_loss)] // run counts are far below 2^52
    let (per_run, drain_runs_per_s) = (
        cpu / n as f64,
        runs.len() as f64 / drain_s.max(f64::EPSILON),
    );
    Ok(ScaleReport {
        workload: "hold",
        mode: measured.mode,
        runs: n,
        delegations_per_run: DELEGATIONS_PER_RUN,
        errors: refused + failed,
        states,
        failures,
        submit_s,
        in_flight_s,
        supervisor_process: supervisor.name,
        supervisor_rss_before_bytes: rss_before,
        supervisor_rss_in_flight_bytes: rss_in_flight,
        bytes_per_in_flight_run: rss_in_flight.saturating_sub(rss_before) / n,
        drain_s,
        drain_runs_per_s,
        cpu_s_per_run: per_run,
        peak_rss_bytes: rss_by_process.values().sum(),
        rss_by_process,
    })
}

fn saturate(n: u64) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

/// The human summary.
pub fn summary(r: &ScaleReport) -> String {
    let mib = |b: u64| b as f64 / (1024.0 * 1024.0);
    format!(
        "scale ({:?}): {} runs × {} delegations held at once ({} errors)\n\
         submitted in {:.1} s, all in flight after {:.1} s\n\
         {} RSS {:.1} MiB before, {:.1} MiB in flight: {:.1} KiB per run in flight\n\
         drained in {:.1} s ({:.0} runs/s); CPU {:.3} ms per run; peak RSS {:.1} MiB",
        r.mode,
        r.runs,
        r.delegations_per_run,
        r.errors,
        r.submit_s,
        r.in_flight_s,
        r.supervisor_process,
        mib(r.supervisor_rss_before_bytes),
        mib(r.supervisor_rss_in_flight_bytes),
        r.bytes_per_in_flight_run as f64 / 1024.0,
        r.drain_s,
        r.drain_runs_per_s,
        r.cpu_s_per_run * 1000.0,
        mib(r.peak_rss_bytes),
    )
}
