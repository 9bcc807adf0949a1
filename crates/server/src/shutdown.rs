//! Shutdown as an input: a cloneable handle that servers wait on and binaries trigger.
//!
//! A [`Shutdown`] is passed into [`GrpcServer::serve`](crate::GrpcServer::serve) rather
//! than discovered from process state, so several services hosted in one process can share
//! one handle (or get separate ones) and tests can trigger it directly. Only
//! [`Shutdown::from_signals`] touches process-global state, and it is meant for the
//! binary edge.

use tokio_util::sync::CancellationToken;

/// Exit status used when a second signal forces an immediate exit (128 + SIGINT).
const FORCED_EXIT_CODE: i32 = 130;

/// A cloneable shutdown signal. Every clone observes the same trigger.
#[derive(Clone, Debug, Default)]
pub struct Shutdown {
    token: CancellationToken,
}

impl Shutdown {
    /// Returns a handle that is not triggered yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Starts shutdown. Idempotent: later calls do nothing.
    pub fn trigger(&self) {
        self.token.cancel();
    }

    /// Whether shutdown has been triggered.
    pub fn is_triggered(&self) -> bool {
        self.token.is_cancelled()
    }

    /// Completes once shutdown has been triggered (at once if it already was).
    pub async fn wait(&self) {
        self.token.cancelled().await;
    }

    /// Like [`wait`](Self::wait), but owns its handle, for futures that must be `'static`
    /// (spawned tasks, servers that take the signal by value).
    pub fn wait_owned(self) -> impl Future<Output = ()> + Send + 'static {
        self.token.cancelled_owned()
    }

    /// Returns a handle triggered by the first SIGTERM or SIGINT (Ctrl-C) the process
    /// receives. A second signal exits the process at once with status 130, for the
    /// operator who does not want to wait for the drain.
    ///
    /// For binaries only: it installs process-wide signal handlers. Must be called from
    /// inside a Tokio runtime.
    ///
    /// # Errors
    ///
    /// Fails if the signal handlers cannot be installed.
    pub fn from_signals() -> std::io::Result<Self> {
        let shutdown = Self::new();
        let mut signals = Signals::install()?;
        let handle = shutdown.clone();
        tokio::spawn(async move {
            let name = signals.next().await;
            tracing::info!(
                signal = name,
                "shutting down, draining (press Ctrl-C again to exit at once)"
            );
            handle.trigger();
            let name = signals.next().await;
            tracing::warn!(signal = name, "second signal received, exiting at once");
            std::process::exit(FORCED_EXIT_CODE);
        });
        Ok(shutdown)
    }
}

/// The termination signals a binary listens to, installed eagerly so that a signal
/// arriving before the first poll is not lost.
#[cfg(unix)]
struct Signals {
    terminate: tokio::signal::unix::Signal,
    interrupt: tokio::signal::unix::Signal,
}

#[cfg(unix)]
impl Signals {
    fn install() -> std::io::Result<Self> {
        use tokio::signal::unix::{SignalKind, signal};
        Ok(Self {
            terminate: signal(SignalKind::terminate())?,
            interrupt: signal(SignalKind::interrupt())?,
        })
    }

    /// Waits for the next signal and returns its name.
    async fn next(&mut self) -> &'static str {
        tokio::select! {
            _ = self.terminate.recv() => "SIGTERM",
            _ = self.interrupt.recv() => "SIGINT",
        }
    }
}

#[cfg(not(unix))]
struct Signals;

#[cfg(not(unix))]
impl Signals {
    fn install() -> std::io::Result<Self> {
        Ok(Self)
    }

    /// Waits for the next Ctrl-C and returns its name.
    async fn next(&mut self) -> &'static str {
        // If the handler cannot be installed there is nothing to wait for; never
        // resolving keeps the process running rather than shutting it down spuriously.
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
        "Ctrl-C"
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[tokio::test]
    async fn clones_observe_one_trigger() {
        let shutdown = Shutdown::new();
        let clone = shutdown.clone();
        assert!(!clone.is_triggered());

        let waiter = tokio::spawn(clone.clone().wait_owned());
        // The waiter must still be pending before the trigger.
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!waiter.is_finished());

        shutdown.trigger();
        tokio::time::timeout(Duration::from_secs(5), waiter)
            .await
            .expect("waiter completes after trigger")
            .expect("waiter task does not panic");
        assert!(clone.is_triggered());
        // Waiting after the trigger completes at once, and triggering again is harmless.
        shutdown.trigger();
        tokio::time::timeout(Duration::from_secs(1), clone.wait())
            .await
            .expect("wait after trigger is immediate");
    }

    #[tokio::test]
    async fn separate_handles_are_independent() {
        let a = Shutdown::new();
        let b = Shutdown::new();
        a.trigger();
        assert!(a.is_triggered());
        assert!(!b.is_triggered());
    }
}
