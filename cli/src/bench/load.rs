//! Offering the load: the driver that starts a run and waits for its end, the closed
//! and the open loop, the warm-up, and the measured phase whose tally becomes the
//! [`Report`].

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use convene_mesh::auth::request;
use convene_mesh::handles::{GrpcSupervisor, SupervisorHandle};
use convene_proto::v1;
use hdrhistogram::Histogram;

use super::proc_stats::{cpu_by_process, cpu_seconds, peak_rss_by_process};
use super::{BenchArgs, Latency, Measured, Report, progress};

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
                    ..Default::default()
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
    pub(super) fn check(self) -> anyhow::Result<()> {
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
            Err(e)
                if e.downcast_ref::<tonic::Status>()
                    .is_some_and(|s| s.code() == tonic::Code::ResourceExhausted) =>
            {
                // The mesh was full and said so at once: what overload is meant to
                // look like, counted apart from failures.
                self.counts.refused.fetch_add(1, Ordering::Relaxed);
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

/// Offers runs as `load` says for `seconds`, results dropped: a warm-up, whose status
/// line says `label`.
pub async fn warm_up(
    driver: &Driver,
    spec: &v1::RunSpec,
    expected: v1::RunState,
    load: Load,
    seconds: f64,
    label: &str,
) -> anyhow::Result<()> {
    if seconds <= 0.0 {
        return Ok(());
    }
    let tally = Tally::new(expected)?;
    let line = progress::Progress::start(
        label,
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
    warm_up(driver, spec, expected, load, args.warmup, "warming up").await?;
    measured_phase(driver, spec, expected, args, mesh, "measuring").await
}

/// The measured phase alone (no warm-up), its status line saying `label`: runs of
/// `spec` offered as `args` asks, every run it started waited for, and the CPU time of
/// `mesh`'s processes read right before the first run and right after the last.
pub(super) async fn measured_phase(
    driver: &Driver,
    spec: &v1::RunSpec,
    expected: v1::RunState,
    args: &BenchArgs,
    mesh: &Measured,
    label: &str,
) -> anyhow::Result<Report> {
    let load = Load::of(args);
    load.check()?;
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
    let line = progress::Progress::start(label, goal, tally.counts.clone());
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
        refused: tally.counts.refused.load(Ordering::Relaxed),
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
        model: None,
    })
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
}
