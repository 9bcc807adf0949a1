//! Helpers for tests that run real servers on loopback sockets (feature `test-util`).

use std::{net::SocketAddr, time::Duration};

use tokio::{net::TcpListener, task::JoinHandle};
use tonic::transport::Channel;
use tonic_health::pb::{
    HealthCheckRequest, health_check_response::ServingStatus, health_client::HealthClient,
};

use crate::{GrpcServer, ServeError, Shutdown};

/// How long [`wait_ready`] waits for a server to report `SERVING`.
pub const READY_TIMEOUT: Duration = Duration::from_secs(10);

/// Loopback ports handed out in this process, by [`pick_listener`] or [`free_port`].
static HANDED_OUT: std::sync::Mutex<std::collections::BTreeSet<u16>> =
    std::sync::Mutex::new(std::collections::BTreeSet::new());

/// Records `port` as handed out; false if it was before.
fn hand_out(port: u16) -> bool {
    HANDED_OUT
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .insert(port)
}

/// A listener on a free loopback port, never handed out before in this process.
///
/// # Panics
///
/// If no loopback port can be bound.
pub async fn pick_listener() -> TcpListener {
    loop {
        let listener = TcpListener::bind(("127.0.0.1", 0))
            .await
            .expect("bind a free loopback port");
        let port = listener.local_addr().expect("a bound address").port();
        if hand_out(port) {
            return listener;
        }
    }
}

/// A loopback port nobody listens on, never handed out before in this process, for a
/// server in another process to bind.
///
/// The port is free when it is picked, not reserved: the process binds it a moment later,
/// and binds it again when it restarts after a crash. Without the record, a test picking
/// a port in that moment could be given the same one, and its server would answer the
/// first test's calls (as `UNIMPLEMENTED`).
///
/// # Panics
///
/// If no loopback port can be bound.
pub fn free_port() -> u16 {
    loop {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("a free loopback port");
        if hand_out(port) {
            return port;
        }
    }
}

/// The `http://` URI of `addr`, as tonic clients want it.
pub fn endpoint(addr: SocketAddr) -> String {
    format!("http://{addr}")
}

/// A channel connected to `addr`.
///
/// # Panics
///
/// If the connection fails.
pub async fn connect(addr: SocketAddr) -> Channel {
    Channel::from_shared(endpoint(addr))
        .expect("a socket address is a valid URI")
        .connect()
        .await
        .unwrap_or_else(|e| panic!("connect to {addr}: {e}"))
}

/// Waits until the server at `addr` answers a health check for `""` with `SERVING`.
///
/// # Panics
///
/// If it does not within [`READY_TIMEOUT`].
pub async fn wait_ready(addr: SocketAddr) {
    let check = async {
        loop {
            let channel = Channel::from_shared(endpoint(addr))
                .expect("a socket address is a valid URI")
                .connect()
                .await;
            if let Ok(channel) = channel {
                let mut client = HealthClient::new(channel);
                let request = HealthCheckRequest {
                    service: String::new(),
                };
                if let Ok(response) = client.check(request).await
                    && response.into_inner().status == ServingStatus::Serving as i32
                {
                    return;
                }
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    tokio::time::timeout(READY_TIMEOUT, check)
        .await
        .unwrap_or_else(|_| panic!("server at {addr} not SERVING within {READY_TIMEOUT:?}"));
}

/// A [`GrpcServer`] serving in a background task on a free loopback port.
///
/// Dropping it triggers its shutdown, so a failing test does not leave it running.
#[derive(Debug)]
pub struct TestServer {
    /// Where it listens.
    pub addr: SocketAddr,
    /// Its shutdown handle.
    pub shutdown: Shutdown,
    task: Option<JoinHandle<Result<(), ServeError>>>,
}

impl TestServer {
    /// Starts `server` and waits until it reports `SERVING`.
    ///
    /// # Panics
    ///
    /// If the server does not become ready (see [`wait_ready`]).
    pub async fn start(server: GrpcServer) -> Self {
        let listener = pick_listener().await;
        let addr = listener.local_addr().expect("listener has an address");
        let shutdown = Shutdown::new();
        let task = tokio::spawn(server.serve(listener, shutdown.clone()));
        wait_ready(addr).await;
        Self {
            addr,
            shutdown,
            task: Some(task),
        }
    }

    /// A channel connected to the server.
    pub async fn channel(&self) -> Channel {
        connect(self.addr).await
    }

    /// Whether `serve` has returned.
    pub fn is_finished(&self) -> bool {
        self.task.as_ref().is_none_or(JoinHandle::is_finished)
    }

    /// Waits for `serve` to return (after [`Shutdown::trigger`]) and returns its result.
    ///
    /// # Panics
    ///
    /// If the serving task panicked or was already joined.
    pub async fn join(mut self) -> Result<(), ServeError> {
        self.task
            .take()
            .expect("the server task is joined once")
            .await
            .expect("the server task does not panic")
    }

    /// Triggers shutdown and waits for `serve` to return.
    ///
    /// # Panics
    ///
    /// As [`join`](Self::join).
    pub async fn stop(self) -> Result<(), ServeError> {
        self.shutdown.trigger();
        self.join().await
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        self.shutdown.trigger();
    }
}
