//! The worker registry: which live workers serve which profiles, and how to reach them.
//!
//! Workers register their profiles and capacity and renew a lease by heartbeat. The
//! supervisor picks, for each dispatch, a live worker serving the profile with the
//! fewest delegations in flight (ties broken round-robin), so load spreads across
//! several. Every supervisor replica keeps its own registry (workers register with each,
//! see ARCHITECTURE.md), so a worker's load is what this replica has in flight there or
//! what the worker last reported running, whichever is more. A worker whose lease lapses, or whose connection fails, stops receiving work
//! until it registers again.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use convene_core::time::to_duration;
use convene_mesh::auth::Authenticator;
use convene_mesh::handles::{GrpcWorker, WorkerHandle};
use convene_proto::v1::{self, worker_registry_server::WorkerRegistry};
use tokio::sync::Notify;
use tonic::{Request, Response, Status};

use crate::error::Error;

/// Turns a registered endpoint into a worker handle.
pub trait Connector: Send + Sync + 'static {
    /// A handle for `endpoint`, or why it cannot be reached.
    fn connect(&self, endpoint: &str) -> Result<WorkerHandle, String>;
}

/// Connects over gRPC (one shared channel per endpoint), and resolves `inproc://<id>`
/// endpoints to workers hosted in this process.
#[derive(Default)]
pub struct MeshConnector {
    local: Mutex<HashMap<String, WorkerHandle>>,
    remote: Mutex<HashMap<String, WorkerHandle>>,
}

impl MeshConnector {
    /// Makes a worker in this process reachable as `inproc://<id>`.
    pub fn add_local(&self, id: &str, handle: WorkerHandle) -> String {
        let endpoint = format!("inproc://{id}");
        self.local
            .lock()
            .expect("connector lock poisoned")
            .insert(endpoint.clone(), handle);
        endpoint
    }
}

impl Connector for MeshConnector {
    fn connect(&self, endpoint: &str) -> Result<WorkerHandle, String> {
        if endpoint.starts_with("inproc://") {
            return self
                .local
                .lock()
                .expect("connector lock poisoned")
                .get(endpoint)
                .cloned()
                .ok_or_else(|| format!("no in-process worker is registered as {endpoint}"));
        }
        let mut remote = self.remote.lock().expect("connector lock poisoned");
        if let Some(h) = remote.get(endpoint) {
            return Ok(h.clone());
        }
        let handle: WorkerHandle =
            Arc::new(GrpcWorker::connect(endpoint).map_err(|e| e.to_string())?);
        remote.insert(endpoint.to_owned(), handle.clone());
        Ok(handle)
    }
}

struct Entry {
    endpoint: String,
    profiles: Vec<String>,
    capacity: u32,
    in_flight: u32,
    /// What the worker last reported running, dispatched by any supervisor replica.
    reported: u32,
    lease_until: Instant,
    handle: WorkerHandle,
}

impl Entry {
    /// How busy the worker is: its delegations from this replica, or what it last
    /// reported running when that is more (other replicas dispatch to it too).
    fn load(&self) -> u32 {
        self.in_flight.max(self.reported)
    }
}

/// Registry settings.
#[derive(Debug, Clone, Copy)]
pub struct RegistrySettings {
    /// A registration not renewed within this time is considered dead.
    pub lease_ttl: Duration,
    /// How often workers are told to heartbeat.
    pub heartbeat_interval: Duration,
}

impl Default for RegistrySettings {
    fn default() -> Self {
        Self {
            lease_ttl: Duration::from_secs(10),
            heartbeat_interval: Duration::from_secs(3),
        }
    }
}

/// The registry (also the `WorkerRegistry` gRPC service).
pub struct Registry {
    workers: Mutex<HashMap<String, Entry>>,
    connector: Arc<dyn Connector>,
    changed: Notify,
    settings: RegistrySettings,
    auth: Authenticator,
    round_robin: AtomicU64,
}

impl std::fmt::Debug for Registry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registry").finish_non_exhaustive()
    }
}

/// A worker chosen for one dispatch; releases its slot when dropped.
pub struct Lease {
    registry: Arc<Registry>,
    /// The worker's id.
    pub worker_id: String,
    /// How to reach it.
    pub handle: WorkerHandle,
}

impl Drop for Lease {
    fn drop(&mut self) {
        let mut workers = self
            .registry
            .workers
            .lock()
            .expect("registry lock poisoned");
        if let Some(e) = workers.get_mut(&self.worker_id) {
            e.in_flight = e.in_flight.saturating_sub(1);
        }
        drop(workers);
        self.registry.changed.notify_waiters();
    }
}

impl Registry {
    /// An empty registry.
    pub fn new(
        connector: Arc<dyn Connector>,
        settings: RegistrySettings,
        auth: Authenticator,
    ) -> Self {
        Self {
            workers: Mutex::new(HashMap::new()),
            connector,
            changed: Notify::new(),
            settings,
            auth,
            round_robin: AtomicU64::new(0),
        }
    }

    /// Registers a worker directly (used by in-process hosting and by the RPC).
    pub fn register_worker(
        &self,
        worker_id: &str,
        endpoint: &str,
        profiles: Vec<String>,
        capacity: u32,
    ) -> Result<(), String> {
        let handle = self.connector.connect(endpoint)?;
        let mut workers = self.workers.lock().expect("registry lock poisoned");
        let (in_flight, reported) = workers
            .get(worker_id)
            .map_or((0, 0), |e| (e.in_flight, e.reported));
        workers.insert(
            worker_id.to_owned(),
            Entry {
                endpoint: endpoint.to_owned(),
                profiles,
                capacity: capacity.max(1),
                in_flight,
                reported,
                lease_until: Instant::now() + self.settings.lease_ttl,
                handle,
            },
        );
        drop(workers);
        tracing::info!(worker_id, endpoint, "worker registered");
        self.changed.notify_waiters();
        Ok(())
    }

    /// Takes a slot on a live worker serving `profile`, avoiding `avoid` when another
    /// worker is available. `None` when no live worker has a free slot.
    pub fn acquire(self: &Arc<Self>, profile: &str, avoid: &[String]) -> Option<Lease> {
        let now = Instant::now();
        let rr = self.round_robin.fetch_add(1, Ordering::Relaxed);
        let mut workers = self.workers.lock().expect("registry lock poisoned");
        let mut candidates: Vec<(&String, &Entry)> = workers
            .iter()
            .filter(|(_, e)| {
                e.lease_until > now
                    && e.in_flight < e.capacity
                    && e.profiles.iter().any(|p| p == profile)
            })
            .collect();
        if candidates.iter().any(|(id, _)| !avoid.contains(id)) {
            candidates.retain(|(id, _)| !avoid.contains(id));
        }
        candidates.sort_by(|a, b| a.1.load().cmp(&b.1.load()).then_with(|| a.0.cmp(b.0)));
        let least = candidates.first()?.1.load();
        let tied: Vec<&String> = candidates
            .iter()
            .take_while(|(_, e)| e.load() == least)
            .map(|(id, _)| *id)
            .collect();
        #[allow(clippy::cast_possible_truncation)] // the modulo keeps it in range
        let chosen = tied[(rr % tied.len() as u64) as usize].clone();
        let entry = workers.get_mut(&chosen)?;
        entry.in_flight += 1;
        Some(Lease {
            registry: self.clone(),
            worker_id: chosen,
            handle: entry.handle.clone(),
        })
    }

    /// Stops dispatching to a worker whose connection failed; it comes back when it
    /// registers again.
    pub fn mark_dead(&self, worker_id: &str) {
        let mut workers = self.workers.lock().expect("registry lock poisoned");
        if let Some(e) = workers.get_mut(worker_id) {
            e.lease_until = Instant::now();
            tracing::warn!(worker_id, endpoint = %e.endpoint, "worker marked dead");
        }
    }

    /// Whether any worker (live or not) has ever registered `profile`.
    pub fn knows_profile(&self, profile: &str) -> bool {
        let now = Instant::now();
        self.workers
            .lock()
            .expect("registry lock poisoned")
            .values()
            .any(|e| e.lease_until > now && e.profiles.iter().any(|p| p == profile))
    }

    /// Waits until a registration changes or a slot frees up.
    pub async fn changed(&self) {
        self.changed.notified().await;
    }

    /// Live workers and their in-flight counts (for diagnostics and tests).
    pub fn snapshot(&self) -> Vec<(String, u32, bool)> {
        let now = Instant::now();
        let mut v: Vec<_> = self
            .workers
            .lock()
            .expect("registry lock poisoned")
            .iter()
            .map(|(id, e)| (id.clone(), e.in_flight, e.lease_until > now))
            .collect();
        v.sort();
        v
    }

    async fn authorize<T>(&self, request: &Request<T>) -> Result<(), Status> {
        convene_mesh::auth::require_peer_service(request, "worker", "register workers")?;
        self.auth
            .authenticate(request)
            .await?
            .require_role("workers:register", "register workers")
            .map(|_| ())
    }
}

/// The `convene.v1.WorkerRegistry` gRPC service over a shared [`Registry`].
#[derive(Debug, Clone)]
pub struct RegistryService(pub Arc<Registry>);

impl std::ops::Deref for RegistryService {
    type Target = Registry;

    fn deref(&self) -> &Registry {
        &self.0
    }
}

#[tonic::async_trait]
impl WorkerRegistry for RegistryService {
    async fn register(
        &self,
        request: Request<v1::RegisterRequest>,
    ) -> Result<Response<v1::RegisterResponse>, Status> {
        self.authorize(&request).await?;
        let r = request.into_inner();
        if r.worker_id.trim().is_empty() {
            return Err(Error::invalid("worker_id", "must not be empty").into());
        }
        if r.endpoint.trim().is_empty() {
            return Err(
                Error::invalid("endpoint", "give the URL the supervisor can dispatch to").into(),
            );
        }
        if r.profiles.is_empty() {
            return Err(
                Error::invalid("profiles", "a worker must serve at least one profile").into(),
            );
        }
        let profiles = r.profiles.iter().map(|p| p.id.clone()).collect();
        self.register_worker(&r.worker_id, &r.endpoint, profiles, r.capacity)
            .map_err(|e| Error::invalid("endpoint", e))?;
        Ok(Response::new(v1::RegisterResponse {
            lease_ttl: Some(to_duration(self.settings.lease_ttl)),
            heartbeat_interval: Some(to_duration(self.settings.heartbeat_interval)),
        }))
    }

    async fn heartbeat(
        &self,
        request: Request<v1::HeartbeatRequest>,
    ) -> Result<Response<v1::HeartbeatResponse>, Status> {
        self.authorize(&request).await?;
        let r = request.into_inner();
        let mut workers = self.workers.lock().expect("registry lock poisoned");
        let registered = match workers.get_mut(&r.worker_id) {
            Some(e) => {
                let was_dead = e.lease_until <= Instant::now();
                e.lease_until = Instant::now() + self.settings.lease_ttl;
                e.reported = r.in_flight;
                if was_dead {
                    drop(workers);
                    self.changed.notify_waiters();
                }
                true
            }
            None => false,
        };
        Ok(Response::new(v1::HeartbeatResponse { registered }))
    }

    async fn deregister(
        &self,
        request: Request<v1::DeregisterRequest>,
    ) -> Result<Response<v1::DeregisterResponse>, Status> {
        self.authorize(&request).await?;
        let r = request.into_inner();
        let removed = self
            .workers
            .lock()
            .expect("registry lock poisoned")
            .remove(&r.worker_id)
            .is_some();
        if removed {
            tracing::info!(worker_id = %r.worker_id, "worker deregistered");
        }
        Ok(Response::new(v1::DeregisterResponse { removed }))
    }
}
