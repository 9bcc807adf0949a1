//! Staying registered with the supervisor's worker registry.
//!
//! [`Registrar::run`] registers the worker's profiles and capacity, heartbeats at the
//! interval the registry asks for (reporting how many delegations are running), registers
//! again whenever a heartbeat answers `registered = false` (the supervisor restarted or
//! let the lease lapse), and deregisters when shutdown begins. Every call carries the
//! `worker-pool` principal's credential.
//!
//! It talks to a [`RegistryHandle`], so the same code runs against the gRPC registry
//! of a separate supervisor or an in-process one. Registry failures are retried with
//! backoff and never stop the worker: a worker that cannot register still serves
//! whoever calls it.

use std::sync::Arc;
use std::time::Duration;

use convene_core::time::from_duration;
use convene_mesh::auth;
use convene_mesh::handles::RegistryHandle;
use convene_proto::v1;
use convene_server::Shutdown;

/// Heartbeat interval used when the registry names none.
pub const DEFAULT_HEARTBEAT: Duration = Duration::from_secs(3);
/// Shortest heartbeat interval honoured, so a misconfigured registry cannot make the
/// worker spin.
pub const MIN_HEARTBEAT: Duration = Duration::from_millis(20);
/// Longest pause between registration attempts.
pub const MAX_BACKOFF: Duration = Duration::from_secs(5);
/// Time the deregistration at shutdown may take.
pub const DEREGISTER_TIMEOUT: Duration = Duration::from_secs(2);

/// What the worker announces.
#[derive(Debug, Clone, PartialEq)]
pub struct Registration {
    /// The worker's id, stable across re-registrations.
    pub worker_id: String,
    /// Where the supervisor reaches it, e.g. `http://127.0.0.1:7410`.
    pub endpoint: String,
    /// The profiles it serves.
    pub profiles: Vec<v1::WorkerProfile>,
    /// Delegations it runs at once.
    pub capacity: u32,
}

/// Keeps one worker registered.
pub struct Registrar {
    registry: RegistryHandle,
    credential: String,
    registration: Registration,
    in_flight: Arc<dyn Fn() -> u32 + Send + Sync>,
    first_backoff: Duration,
}

impl std::fmt::Debug for Registrar {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registrar")
            .field("registration", &self.registration)
            .finish_non_exhaustive()
    }
}

impl Registrar {
    /// A registrar announcing `registration` to `registry` with `credential` (the
    /// `worker-pool` principal's); `in_flight` reports the running delegations for each
    /// heartbeat.
    pub fn new(
        registry: RegistryHandle,
        credential: String,
        registration: Registration,
        in_flight: Arc<dyn Fn() -> u32 + Send + Sync>,
    ) -> Self {
        Self {
            registry,
            credential,
            registration,
            in_flight,
            first_backoff: Duration::from_millis(200),
        }
    }

    /// Sets the first pause between failed registration attempts (it doubles up to
    /// [`MAX_BACKOFF`]); tests shorten it.
    #[must_use]
    pub fn with_backoff(mut self, first: Duration) -> Self {
        self.first_backoff = first;
        self
    }

    /// Registers, heartbeats and re-registers until `shutdown` triggers, then
    /// deregisters.
    pub async fn run(self, shutdown: Shutdown) {
        let worker_id = self.registration.worker_id.clone();
        'register: loop {
            let Some(interval) = self.register(&shutdown).await else {
                break 'register;
            };
            loop {
                tokio::select! {
                    () = tokio::time::sleep(interval) => {}
                    () = shutdown.wait() => break 'register,
                }
                let request = v1::HeartbeatRequest {
                    worker_id: worker_id.clone(),
                    in_flight: (self.in_flight)(),
                };
                match self
                    .registry
                    .heartbeat(auth::request(request, &self.credential))
                    .await
                {
                    Ok(r) if r.get_ref().registered => {}
                    Ok(_) => {
                        tracing::warn!(%worker_id, "the registry no longer knows this worker; registering again");
                        continue 'register;
                    }
                    Err(status) => {
                        tracing::warn!(%worker_id, code = ?status.code(), error = %status.message(), "heartbeat failed");
                    }
                }
            }
        }
        self.deregister().await;
    }

    /// Registers, retrying with backoff; the heartbeat interval, or `None` on shutdown.
    async fn register(&self, shutdown: &Shutdown) -> Option<Duration> {
        let mut backoff = self.first_backoff;
        loop {
            let request = v1::RegisterRequest {
                worker_id: self.registration.worker_id.clone(),
                endpoint: self.registration.endpoint.clone(),
                profiles: self.registration.profiles.clone(),
                capacity: self.registration.capacity,
            };
            let attempt = self
                .registry
                .register(auth::request(request, &self.credential));
            let outcome = tokio::select! {
                r = attempt => r,
                () = shutdown.wait() => return None,
            };
            match outcome {
                Ok(response) => {
                    let interval = response
                        .get_ref()
                        .heartbeat_interval
                        .as_ref()
                        .and_then(|d| from_duration(d, "heartbeat_interval").ok())
                        .filter(|d| !d.is_zero())
                        .unwrap_or(DEFAULT_HEARTBEAT)
                        .max(MIN_HEARTBEAT);
                    tracing::info!(
                        worker_id = %self.registration.worker_id,
                        endpoint = %self.registration.endpoint,
                        profiles = self.registration.profiles.len(),
                        heartbeat = %humantime::format_duration(interval),
                        "registered with the supervisor"
                    );
                    return Some(interval);
                }
                Err(status) => {
                    tracing::warn!(
                        worker_id = %self.registration.worker_id,
                        code = ?status.code(),
                        error = %status.message(),
                        retry_in = %humantime::format_duration(backoff),
                        "registration failed"
                    );
                }
            }
            tokio::select! {
                () = tokio::time::sleep(backoff) => {}
                () = shutdown.wait() => return None,
            }
            backoff = (backoff * 2).min(MAX_BACKOFF);
        }
    }

    async fn deregister(&self) {
        let request = v1::DeregisterRequest {
            worker_id: self.registration.worker_id.clone(),
        };
        let call = self
            .registry
            .deregister(auth::request(request, &self.credential));
        match tokio::time::timeout(DEREGISTER_TIMEOUT, call).await {
            Ok(Ok(_)) => {
                tracing::info!(worker_id = %self.registration.worker_id, "deregistered from the supervisor");
            }
            Ok(Err(status)) => {
                tracing::warn!(worker_id = %self.registration.worker_id, error = %status.message(), "deregistration failed");
            }
            Err(_) => {
                tracing::warn!(worker_id = %self.registration.worker_id, "deregistration timed out");
            }
        }
    }
}
