//! The bench's live status line: on a terminal, what phase it is in, how far along, and
//! the runs, throughput and errors so far, redrawn a few times a second on standard
//! error. Off a terminal (a pipe, a file, CI) nothing is drawn, so `--json` output and
//! logs stay as they are.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// How often the line is refreshed.
const TICK: Duration = Duration::from_millis(250);

/// How long a phase lasts: a time or a number of runs.
#[derive(Debug, Clone, Copy)]
pub enum Goal {
    /// Seconds.
    Seconds(f64),
    /// Runs.
    Runs(u64),
}

/// Runs finished so far, counted by the clients.
#[derive(Debug, Clone, Default)]
pub struct Counts {
    /// Runs that ended as the workload expects.
    pub ok: Arc<AtomicU64>,
    /// Runs that failed or ended otherwise.
    pub errors: Arc<AtomicU64>,
    /// StartRuns the mesh refused because it was full (RESOURCE_EXHAUSTED).
    pub refused: Arc<AtomicU64>,
}

/// A phase's status line; [`Progress::finish`] clears it.
#[derive(Debug)]
pub struct Progress {
    bar: ProgressBar,
    ticker: tokio::task::JoinHandle<()>,
}

impl Progress {
    /// Starts the line for `phase` (hidden unless standard error is a terminal).
    pub fn start(phase: &str, goal: Goal, counts: Counts) -> Self {
        Self::with_target(phase, goal, counts, ProgressDrawTarget::stderr())
    }

    fn with_target(phase: &str, goal: Goal, counts: Counts, target: ProgressDrawTarget) -> Self {
        let (len, template) = match goal {
            #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
            Goal::Seconds(s) => (
                (s.max(0.0) * 1000.0) as u64,
                format!("{{prefix:>10}} [{{bar:24}}] {{elapsed:>3}} of {s:.0}s  {{msg}}"),
            ),
            Goal::Runs(n) => (
                n,
                "{prefix:>10} [{bar:24}] {pos}/{len} runs  {msg}".to_owned(),
            ),
        };
        let bar = ProgressBar::with_draw_target(Some(len), target);
        bar.set_style(
            ProgressStyle::with_template(&template)
                .unwrap_or_else(|_| ProgressStyle::default_bar())
                .progress_chars("=> "),
        );
        bar.set_prefix(phase.to_owned());
        let begin = Instant::now();
        let ticker = tokio::spawn({
            let bar = bar.clone();
            async move {
                let mut every = tokio::time::interval(TICK);
                loop {
                    every.tick().await;
                    let ok = counts.ok.load(Ordering::Relaxed);
                    let errors = counts.errors.load(Ordering::Relaxed);
                    let elapsed = begin.elapsed();
                    match goal {
                        #[allow(clippy::cast_possible_truncation)] // ms of a bench fit u64
                        Goal::Seconds(_) => bar.set_position(elapsed.as_millis() as u64),
                        Goal::Runs(_) => bar.set_position(ok + errors),
                    }
                    bar.set_message(status(ok, errors, elapsed));
                }
            }
        });
        Self { bar, ticker }
    }

    /// Ends the phase and clears its line.
    pub fn finish(self) {
        self.ticker.abort();
        self.bar.finish_and_clear();
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        // An interrupted bench drops the line without finishing it: stop redrawing.
        self.ticker.abort();
    }
}

/// What the line says of the runs so far: `1,234 runs, 617 runs/s, 0 errors`.
pub fn status(ok: u64, errors: u64, elapsed: Duration) -> String {
    let secs = elapsed.as_secs_f64();
    #[allow(clippy::cast_precision_loss)] // run counts are far below 2^52
    let rate = if secs > 0.0 { ok as f64 / secs } else { 0.0 };
    let errors = match errors {
        0 => "no errors".to_owned(),
        1 => "1 error".to_owned(),
        n => format!("{} errors", grouped(n)),
    };
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    let rate = rate.round() as u64;
    format!("{} runs, {} runs/s, {errors}", grouped(ok), grouped(rate))
}

/// `1234567` as `1,234,567`.
fn grouped(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_status_counts_runs_rate_and_errors() {
        assert_eq!(
            status(12_345, 0, Duration::from_secs(10)),
            "12,345 runs, 1,235 runs/s, no errors"
        );
        assert_eq!(
            status(7, 1, Duration::from_millis(500)),
            "7 runs, 14 runs/s, 1 error"
        );
        assert_eq!(
            status(0, 2_000, Duration::ZERO),
            "0 runs, 0 runs/s, 2,000 errors"
        );
    }

    #[test]
    fn numbers_are_grouped_by_thousands() {
        assert_eq!(grouped(0), "0");
        assert_eq!(grouped(999), "999");
        assert_eq!(grouped(1_000), "1,000");
        assert_eq!(grouped(1_234_567), "1,234,567");
    }

    #[tokio::test]
    async fn the_line_follows_the_counts_and_is_cleared_at_the_end() {
        let counts = Counts::default();
        let progress = Progress::with_target(
            "measuring",
            Goal::Runs(10),
            counts.clone(),
            ProgressDrawTarget::hidden(),
        );
        counts.ok.store(4, Ordering::Relaxed);
        counts.errors.store(1, Ordering::Relaxed);
        let bar = progress.bar.clone();
        tokio::time::timeout(Duration::from_secs(5), async {
            while bar.position() != 5 {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await
        .expect("the line catches up with the counts");
        assert!(bar.message().starts_with("4 runs, "), "{}", bar.message());
        assert!(bar.message().ends_with(", 1 error"), "{}", bar.message());
        progress.finish();
        assert!(bar.is_finished());
    }
}
