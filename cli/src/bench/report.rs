//! What the bench reports: the load's [`Report`], the [`Outcome`] of either kind of
//! bench, and their human summary and JSON.

use std::collections::BTreeMap;

use serde::Serialize;

use super::model::ModelReport;
use super::{MeshMode, Workload, scale};

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
    /// StartRuns refused at once because the mesh was full (RESOURCE_EXHAUSTED with a
    /// retry hint): not errors, and not in `runs` or the latencies.
    pub refused: u64,
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
    /// The `model` workload: its baseline phase, the scripted server, and the agent
    /// runtime's own CPU per model turn (the report's other figures are its model
    /// phase's).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub model: Option<ModelReport>,
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

/// What `convene bench` measured.
#[derive(Debug, Clone)]
pub enum Outcome {
    /// The closed loop.
    Load(Report),
    /// The scale run.
    Scale(scale::ScaleReport),
}

impl Outcome {
    /// Runs that failed or ended otherwise than the workload expects (in every phase
    /// measured).
    pub fn errors(&self) -> u64 {
        match self {
            Outcome::Load(r) => r.errors + r.model.as_ref().map_or(0, |m| m.baseline_errors),
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
        "workload {:?} ({:?}), {load}: {} runs in {:.1} s = {:.0} runs/s ({} errors{})\n\
         latency p50 {:.2} ms, p95 {:.2} ms, p99 {:.2} ms, max {:.2} ms\n\
         CPU {:.3} ms per run (all mesh processes), peak RSS {:.1} MiB",
        r.workload,
        r.mode,
        r.runs,
        r.duration_s,
        r.runs_per_s,
        r.errors,
        if r.refused > 0 {
            format!(", {} refused: the mesh was full", r.refused)
        } else {
            String::new()
        },
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
    if let Some(m) = &r.model {
        text.push('\n');
        text.push_str(&model_summary(m));
    }
    text
}

/// The `model` workload's lines: turns per run and the runtime's CPU per turn against
/// the goal, then the figures it comes from.
fn model_summary(m: &ModelReport) -> String {
    let turns = if (m.turns_per_run - m.turns_per_run.round()).abs() < 1e-9 {
        format!("{:.0}", m.turns_per_run)
    } else {
        format!("{:.2}", m.turns_per_run)
    };
    let per_turn = m.runtime_cpu_ms_per_turn.map_or_else(
        || "no model turn measured".to_owned(),
        |ms| format!("runtime CPU {ms:.3} ms per turn"),
    );
    format!(
        "model turns: {turns} per run; {per_turn} (goal ≤ {} ms)\n  \
         CPU per run: baseline (playbook specialists) {:.3} ms at {:.0} runs/s ({} errors), \
         model {:.3} ms, of which the scripted server {:.3} ms",
        m.goal_cpu_ms_per_turn,
        m.baseline_cpu_ms_per_run,
        m.baseline_runs_per_s,
        m.baseline_errors,
        m.model_cpu_ms_per_run,
        m.server_cpu_ms_per_run,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

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
            refused: 0,
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
            model: None,
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
        assert!(!closed.contains("model turns"), "{closed}");
    }

    #[test]
    fn the_model_workload_reports_the_runtime_cpu_per_turn_against_the_goal() {
        let mut m = ModelReport {
            turns_per_run: 6.0,
            baseline_runs: 900,
            baseline_errors: 0,
            baseline_runs_per_s: 90.0,
            baseline_cpu_ms_per_run: 4.0,
            model_cpu_ms_per_run: 7.0,
            server_cpu_ms_per_run: 0.528,
            runtime_cpu_ms_per_turn: Some(0.412),
            goal_cpu_ms_per_turn: 1.0,
        };
        let text = model_summary(&m);
        assert!(
            text.starts_with("model turns: 6 per run; runtime CPU 0.412 ms per turn (goal ≤ 1 ms)"),
            "{text}"
        );
        assert!(
            text.contains("baseline (playbook specialists) 4.000 ms at 90 runs/s (0 errors)"),
            "{text}"
        );
        assert!(
            text.contains("model 7.000 ms, of which the scripted server 0.528 ms"),
            "{text}"
        );
        m.turns_per_run = 5.5;
        let text = model_summary(&m);
        assert!(text.starts_with("model turns: 5.50 per run;"), "{text}");
        m.turns_per_run = 0.0;
        m.runtime_cpu_ms_per_turn = None;
        let text = model_summary(&m);
        assert!(
            text.starts_with("model turns: 0 per run; no model turn measured"),
            "{text}"
        );
    }
}
