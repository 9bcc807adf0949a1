//! `convene bench --workload model`: what the agent runtime itself costs per model turn.
//!
//! The model-driven payment incident (`run-model.yaml`: three specialists whose `openai`
//! provider asks a model for their tool calls and their report) runs against a scripted
//! OpenAI-compatible server in the bench's process that answers at once, as the
//! example's playbooks would ([`PlaybookResponder`]): turn 1 the tool calls, turn 2
//! `submit_report`. Its runs so do the work of the playbook incident (`run.yaml`) — the
//! same tool calls, evidence, join and outcome — plus what the model turns cost the
//! runtime: writing each request, the HTTP round trip, reading and checking the answer,
//! storing the turn as `model_turn` evidence, counting its tokens.
//!
//! So the bench measures both in the same mesh with the same load: first the baseline
//! (`run.yaml`), then the model phase (`run-model.yaml`), each after its own warm-up. The
//! scripted server runs on a thread of its own with a current-thread Tokio runtime, so
//! its CPU time is read apart (`/proc/self/task/<tid>/stat`) and taken off:
//!
//! ```text
//! runtime CPU per turn = (model − baseline − server) / turns per run
//! ```
//!
//! where model and baseline are the CPU time per run of every process the bench
//! measures (with `--processes` the bench's own included, which holds the server) and
//! turns per run is the server's request count over the model phase divided by its
//! runs. The goal is at most [`GOAL_CPU_MS_PER_TURN`].

use anyhow::Context as _;
use convene_worker::model_server::{Options, PlaybookResponder, ScriptedModel};
use convene_worker::profiles::Profile;
use serde::Serialize;
use tokio::sync::oneshot;

use super::load::measured_phase;
use super::proc_stats::thread_cpu_seconds;
use super::{BenchArgs, Driver, Load, Measured, Prepared, Report, warm_up};

/// The goal: the agent runtime's own CPU time per model turn, in milliseconds.
pub const GOAL_CPU_MS_PER_TURN: f64 = 1.0;

/// What the `model` workload adds to the [`Report`] of its model phase.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ModelReport {
    /// Model requests per run: the scripted server's requests over the model phase
    /// divided by its runs (6 for the payment incident: two turns per specialist).
    pub turns_per_run: f64,
    /// Runs of the baseline phase (`run.yaml`, the playbook specialists) that ended as
    /// expected.
    pub baseline_runs: u64,
    /// Runs of the baseline phase that failed or ended otherwise.
    pub baseline_errors: u64,
    /// Runs per second of the baseline phase.
    pub baseline_runs_per_s: f64,
    /// CPU milliseconds per run of the baseline phase (every measured process, the
    /// bench's own included when it runs apart from the mesh).
    pub baseline_cpu_ms_per_run: f64,
    /// CPU milliseconds per run of the model phase, measured as the baseline's; the
    /// scripted server's share included.
    pub model_cpu_ms_per_run: f64,
    /// CPU milliseconds per run of the scripted server's thread in the model phase.
    pub server_cpu_ms_per_run: f64,
    /// (model − baseline − server) / turns per run: the agent runtime's own CPU
    /// milliseconds per model turn. Absent when no turn was measured.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub runtime_cpu_ms_per_turn: Option<f64>,
    /// The goal for `runtime_cpu_ms_per_turn`.
    pub goal_cpu_ms_per_turn: f64,
}

impl ModelReport {
    /// The figures of a baseline phase and a model phase, with the scripted server
    /// read right before and right after the model phase.
    fn new(baseline: &Report, model: &Report, before: ServerReading, after: ServerReading) -> Self {
        #[allow(clippy::cast_precision_loss)] // run and request counts are far below 2^52
        let per_run = |x: f64| {
            if model.runs == 0 {
                0.0
            } else {
                x / model.runs as f64
            }
        };
        #[allow(clippy::cast_precision_loss)]
        let turns_per_run = per_run(after.requests.saturating_sub(before.requests) as f64);
        let baseline_cpu_ms_per_run = measured_cpu_s_per_run(baseline) * 1000.0;
        let model_cpu_ms_per_run = measured_cpu_s_per_run(model) * 1000.0;
        let server_cpu_ms_per_run = per_run((after.cpu_s - before.cpu_s).max(0.0)) * 1000.0;
        let runtime_cpu_ms_per_turn = (turns_per_run > 0.0).then(|| {
            (model_cpu_ms_per_run - baseline_cpu_ms_per_run - server_cpu_ms_per_run) / turns_per_run
        });
        Self {
            turns_per_run,
            baseline_runs: baseline.runs,
            baseline_errors: baseline.errors,
            baseline_runs_per_s: baseline.runs_per_s,
            baseline_cpu_ms_per_run,
            model_cpu_ms_per_run,
            server_cpu_ms_per_run,
            runtime_cpu_ms_per_turn,
            goal_cpu_ms_per_turn: GOAL_CPU_MS_PER_TURN,
        }
    }
}

/// CPU seconds per run of every process a phase measured: the mesh's, and the bench's
/// own when it runs apart (with `--processes`, where the scripted server lives).
fn measured_cpu_s_per_run(report: &Report) -> f64 {
    report.cpu_s_per_run + report.client_cpu_s_per_run.unwrap_or(0.0)
}

/// The scripted server's requests so far and its thread's CPU seconds.
#[derive(Debug, Clone, Copy, PartialEq)]
struct ServerReading {
    requests: usize,
    cpu_s: f64,
}

/// The scripted OpenAI-compatible server of the `model` workload, answering as the
/// example's playbooks would, on a thread of its own (a current-thread Tokio runtime)
/// whose CPU time is read apart from the mesh's. Dropping it stops the server and
/// its thread.
pub(super) struct ModelServer {
    model: Option<ScriptedModel>,
    base_url: String,
    /// The thread's id (`gettid`), for `/proc/self/task/<tid>/stat`.
    tid: i32,
    /// Dropped to stop the thread's runtime.
    stop: Option<oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl ModelServer {
    /// Starts the server, playing the `playbook` profiles of `profiles`, and waits
    /// until it listens.
    ///
    /// # Errors
    ///
    /// The profiles cannot be played (two playbooks with the same tools), or the thread,
    /// its runtime or the loopback listener cannot be set up.
    pub(super) async fn start(profiles: &[Profile]) -> anyhow::Result<Self> {
        let responder = PlaybookResponder::new(profiles).map_err(|e| {
            anyhow::anyhow!("the scripted model server cannot play the example's playbooks: {e}")
        })?;
        let (ready_tx, ready_rx) = oneshot::channel();
        let (stop_tx, stop_rx) = oneshot::channel::<()>();
        let thread = std::thread::Builder::new()
            .name("scripted-model".to_owned())
            .spawn(move || {
                let runtime = match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    Ok(runtime) => runtime,
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                let tid = rustix::thread::gettid().as_raw_nonzero().get();
                let started = {
                    let _entered = runtime.enter();
                    // Requests are counted, not kept: memory stays flat however long
                    // the bench runs.
                    let options = Options {
                        keep_requests: false,
                        ..Options::default()
                    };
                    ScriptedModel::start_with(options, responder)
                };
                let serving = started.is_ok();
                if ready_tx.send(started.map(|model| (model, tid))).is_err() || !serving {
                    return;
                }
                // Serve until the bench drops its end (the error is that drop).
                let _ = runtime.block_on(stop_rx);
            })
            .context("cannot start the scripted model server's thread")?;
        let (model, tid) = ready_rx
            .await
            .context("the scripted model server's thread ended before the server started")?
            .context("cannot start the scripted model server")?;
        Ok(Self {
            base_url: model.base_url(),
            model: Some(model),
            tid,
            stop: Some(stop_tx),
            thread: Some(thread),
        })
    }

    /// The API base the workers' `openai` profiles are pointed at.
    pub(super) fn base_url(&self) -> &str {
        &self.base_url
    }

    fn reading(&self) -> ServerReading {
        ServerReading {
            requests: self.model.as_ref().map_or(0, ScriptedModel::request_count),
            cpu_s: thread_cpu_seconds(self.tid),
        }
    }
}

impl Drop for ModelServer {
    fn drop(&mut self) {
        // Stop accepting, then end the thread's runtime, which drops every connection.
        drop(self.model.take());
        drop(self.stop.take());
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// The `model` workload's measurement: the baseline phase (`run.yaml`, the playbook
/// specialists), then the model phase (`run-model.yaml`), each after its own warm-up
/// and with the load `args` asks for. Returns the model phase's report with the
/// [`ModelReport`] of both.
///
/// # Errors
///
/// `prepared` is not the model workload's, or a phase cannot be measured.
pub(super) async fn measure(
    driver: &Driver,
    prepared: &Prepared,
    args: &BenchArgs,
    mesh: &Measured,
    server: &ModelServer,
) -> anyhow::Result<Report> {
    let load = Load::of(args);
    load.check()?;
    let baseline_spec = prepared
        .baseline
        .as_ref()
        .context("the model workload was prepared without its baseline spec")?;
    let expected = prepared.expected;
    warm_up(
        driver,
        baseline_spec,
        expected,
        load,
        args.warmup,
        "baseline: warming up",
    )
    .await?;
    let baseline = measured_phase(
        driver,
        baseline_spec,
        expected,
        args,
        mesh,
        "baseline: measuring",
    )
    .await?;
    warm_up(
        driver,
        &prepared.spec,
        expected,
        load,
        args.warmup,
        "model: warming up",
    )
    .await?;
    // Every warm-up run has ended: the server is idle until the phase's first run.
    let before = server.reading();
    let mut report = measured_phase(
        driver,
        &prepared.spec,
        expected,
        args,
        mesh,
        "model: measuring",
    )
    .await?;
    let after = server.reading();
    report.model = Some(ModelReport::new(&baseline, &report, before, after));
    Ok(report)
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::bench::{Latency, MeshMode, Workload};

    fn report(runs: u64, cpu_s_per_run: f64, client: Option<f64>) -> Report {
        Report {
            workload: Workload::Model,
            mode: MeshMode::OneProcess,
            concurrency: 1,
            rate: None,
            max_in_flight: None,
            duration_s: 10.0,
            runs,
            errors: 0,
            refused: 0,
            runs_per_s: 100.0,
            latency_us: Latency {
                p50: 1,
                p95: 1,
                p99: 1,
                max: 1,
            },
            cpu_s_per_run,
            peak_rss_bytes: 0,
            cpu_s_per_run_by_process: BTreeMap::new(),
            rss_by_process: BTreeMap::new(),
            client_cpu_s_per_run: client,
            model: None,
        }
    }

    #[test]
    fn the_runtime_cost_per_turn_is_what_the_model_phase_adds_less_the_server() {
        let baseline = report(1_000, 0.004, None);
        let model = report(500, 0.009, None);
        let before = ServerReading {
            requests: 12,
            cpu_s: 0.5,
        };
        let after = ServerReading {
            requests: 3_012,
            cpu_s: 1.0,
        };
        let m = ModelReport::new(&baseline, &model, before, after);
        assert!((m.turns_per_run - 6.0).abs() < 1e-9, "{m:?}");
        assert!((m.baseline_cpu_ms_per_run - 4.0).abs() < 1e-9, "{m:?}");
        assert!((m.model_cpu_ms_per_run - 9.0).abs() < 1e-9, "{m:?}");
        assert!((m.server_cpu_ms_per_run - 1.0).abs() < 1e-9, "{m:?}");
        // (9 − 4 − 1) ms over 6 turns.
        let per_turn = m.runtime_cpu_ms_per_turn.expect("turns were measured");
        assert!((per_turn - 4.0 / 6.0).abs() < 1e-9, "{m:?}");
        assert_eq!(m.baseline_runs, 1_000);
        assert!((m.goal_cpu_ms_per_turn - 1.0).abs() < f64::EPSILON);
    }

    #[test]
    fn with_processes_the_bench_process_holding_the_server_is_counted() {
        let baseline = report(100, 0.004, Some(0.001));
        let model = report(100, 0.006, Some(0.0025));
        let before = ServerReading {
            requests: 0,
            cpu_s: 0.0,
        };
        let after = ServerReading {
            requests: 600,
            cpu_s: 0.1,
        };
        let m = ModelReport::new(&baseline, &model, before, after);
        assert!((m.baseline_cpu_ms_per_run - 5.0).abs() < 1e-9, "{m:?}");
        assert!((m.model_cpu_ms_per_run - 8.5).abs() < 1e-9, "{m:?}");
        // (8.5 − 5 − 1) ms over 6 turns.
        let per_turn = m.runtime_cpu_ms_per_turn.expect("turns were measured");
        assert!((per_turn - 2.5 / 6.0).abs() < 1e-9, "{m:?}");
    }

    #[test]
    fn without_runs_there_is_no_cost_per_turn() {
        let reading = ServerReading {
            requests: 0,
            cpu_s: 0.0,
        };
        let m = ModelReport::new(
            &report(0, 0.0, None),
            &report(0, 0.0, None),
            reading,
            reading,
        );
        assert!(m.turns_per_run.abs() < f64::EPSILON);
        assert_eq!(m.runtime_cpu_ms_per_turn, None);
        let json = serde_json::to_value(&m).expect("plain data");
        assert!(json.get("runtime_cpu_ms_per_turn").is_none(), "{json}");
    }

    /// POSTs `body` to the chat-completions route under `base_url` over plain HTTP/1.1
    /// and returns the whole answer.
    async fn post(base_url: &str, body: &str) -> String {
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        let addr = base_url
            .strip_prefix("http://")
            .and_then(|rest| rest.strip_suffix("/v1"))
            .expect("http://<addr>/v1");
        let mut stream = tokio::net::TcpStream::connect(addr)
            .await
            .expect("connects");
        let request = format!(
            "POST /v1/chat/completions HTTP/1.1\r\nHost: {addr}\r\nContent-Type: \
             application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        );
        stream.write_all(request.as_bytes()).await.expect("sent");
        let mut answer = String::new();
        stream.read_to_string(&mut answer).await.expect("answered");
        answer
    }

    #[tokio::test]
    async fn the_server_counts_requests_and_reads_its_own_thread() {
        let profiles = convene_worker::profiles::example().expect("the example profiles");
        let server = ModelServer::start(&profiles).await.expect("started");
        assert!(
            server.base_url().starts_with("http://127.0.0.1:"),
            "{}",
            server.base_url()
        );
        assert!(server.base_url().ends_with("/v1"), "{}", server.base_url());
        let reading = server.reading();
        assert_eq!(reading.requests, 0);
        assert!(reading.cpu_s.is_finite() && reading.cpu_s >= 0.0);
        // A request offering no tools is answered (no playbook plays them) and counted.
        let answer = post(server.base_url(), "{}").await;
        assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
        assert!(answer.contains("no playbook plays the tools"), "{answer}");
        assert_eq!(server.reading().requests, 1);
        // The thread is one of this process's: its stat file is there.
        assert!(std::path::Path::new(&format!("/proc/self/task/{}/stat", server.tid)).is_file());
        let tid = server.tid;
        drop(server);
        // Dropping the server ends its thread. (The join returns as the thread exits;
        // the kernel takes its task entry away a moment later, longer on a busy machine.)
        let stat = format!("/proc/self/task/{tid}/stat");
        let gone = (0..200).any(|_| {
            std::thread::sleep(std::time::Duration::from_millis(5));
            !std::path::Path::new(&stat).exists()
        });
        assert!(
            gone,
            "the server's thread {tid} still runs a second after the drop"
        );
    }
}
