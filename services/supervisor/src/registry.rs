//! The worker registry: which live workers serve which profiles, and how to reach them.
//!
//! Workers register their profiles and capacity and renew a lease by heartbeat. The
//! supervisor picks, for each dispatch, a live worker serving the profile with the
//! fewest delegations in flight (ties broken round-robin), so load spreads across
//! several. Every supervisor replica keeps its own registry (workers register with each,
//! see ARCHITECTURE.md), so a worker's load is what this replica has in flight there or
//! what the worker last reported running, whichever is more. A worker whose lease lapses, or whose connection fails, stops receiving work
//! until it registers again.
//!
//! A registration belongs to the identity that made it ([`Registrant`]: the
//! authenticated principal, and under mutual TLS the SPIFFE ids of its client
//! certificate). While it is live, only that identity may register the same
//! `worker_id` again, heartbeat it or deregister it; a registration whose lease lapsed
//! (missed heartbeats) belongs to nobody and may be taken over. A worker may claim only
//! the profiles its principal's `profiles` allow in the policy file, and when this
//! supervisor dials workers over TLS ([`Connector::requires_tls`]) its endpoint must be
//! `https://`.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use convene_core::time::to_duration;
use convene_mesh::auth::{Authenticator, MeshService, peer_identities, require_peer_service};
use convene_mesh::handles::{GrpcWorker, WorkerHandle};
use convene_mesh::policy_file::Principal;
use convene_proto::v1::{self, worker_registry_server::WorkerRegistry};
use tokio::sync::Notify;
use tonic::{Request, Response, Status};

use crate::error::Error;

/// Turns a registered endpoint into a worker handle.
pub trait Connector: Send + Sync + 'static {
    /// A handle for `endpoint`, or why it cannot be reached.
    fn connect(&self, endpoint: &str) -> Result<WorkerHandle, String>;

    /// Whether remote workers are dialled over TLS: then a worker registering a
    /// plaintext endpoint is refused (workers hosted in this process are not dialled).
    /// No default: a connector wrapping another answers as the one it wraps.
    fn requires_tls(&self) -> bool;
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

    /// TLS is on when this process serves TLS or has a CA to verify the servers it calls
    /// (`--tls-cert`, `--tls-ca`: [`convene_server::tls::installed`]).
    fn requires_tls(&self) -> bool {
        convene_server::tls::installed().is_some_and(|t| {
            t.server.is_some() || t.client.as_ref().is_some_and(|c| c.ca_pem.is_some())
        })
    }
}

/// Who registered a worker: the principal it authenticated as, and under mutual TLS
/// the SPIFFE ids of the client certificate it presented (empty without one).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Registrant {
    /// The principal id.
    pub principal: String,
    /// The certificate's SPIFFE ids, sorted.
    pub certificate: Vec<String>,
}

impl Registrant {
    /// `principal`, with the SPIFFE ids of a client certificate (in any order).
    pub fn new(principal: impl Into<String>, mut certificate: Vec<String>) -> Self {
        certificate.sort();
        certificate.dedup();
        Self {
            principal: principal.into(),
            certificate,
        }
    }
}

impl std::fmt::Display for Registrant {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "principal {}", self.principal)?;
        if !self.certificate.is_empty() {
            write!(f, " with certificate {}", self.certificate.join(", "))?;
        }
        Ok(())
    }
}

struct Entry {
    endpoint: String,
    profiles: Vec<String>,
    capacity: u32,
    in_flight: u32,
    /// What the worker last reported running, dispatched by any supervisor replica.
    reported: u32,
    /// Until when registration and heartbeats keep it: live, and its registrant's.
    lease_until: Instant,
    /// Its connection failed ([`Registry::mark_dead`]): no work until it heartbeats or
    /// registers again. It stays its registrant's until the lease lapses.
    dead: bool,
    /// Who registered it.
    owner: Registrant,
    handle: WorkerHandle,
}

impl Entry {
    /// Whether dispatches may go to it.
    fn live(&self, now: Instant) -> bool {
        !self.dead && self.lease_until > now
    }

    /// Whether its registration is live and another identity's than `who`.
    fn held_by_other(&self, who: &Registrant, now: Instant) -> bool {
        self.lease_until > now && self.owner != *who
    }

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
    /// What each profile is for, as the workers serving it last described it.
    descriptions: Mutex<HashMap<String, String>>,
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
            descriptions: Mutex::new(HashMap::new()),
            connector,
            changed: Notify::new(),
            settings,
            auth,
            round_robin: AtomicU64::new(0),
        }
    }

    /// Keeps what `profile` is for, as a worker registering it describes it (the last
    /// registration's word counts; an empty description is not kept).
    pub fn describe(&self, profile: &str, description: &str) {
        let description = description.trim();
        if description.is_empty() {
            return;
        }
        self.descriptions
            .lock()
            .expect("registry lock poisoned")
            .insert(profile.to_owned(), description.to_owned());
    }

    /// What `profile` is for, if a worker serving it has described it.
    pub fn description(&self, profile: &str) -> Option<String> {
        self.descriptions
            .lock()
            .expect("registry lock poisoned")
            .get(profile)
            .cloned()
    }

    /// Registers a worker for `owner` (what the RPC does once it has authenticated the
    /// caller): refused while `worker_id` is live under another identity
    /// (PERMISSION_DENIED), and for a plaintext endpoint when workers are dialled over
    /// TLS, or one the connector cannot use (INVALID_ARGUMENT). The profiles are not
    /// checked here: the RPC checks them against the principal.
    pub fn register_worker(
        &self,
        owner: &Registrant,
        worker_id: &str,
        endpoint: &str,
        profiles: Vec<String>,
        capacity: u32,
    ) -> Result<(), Error> {
        let remote = !endpoint.starts_with("inproc://");
        if remote && self.connector.requires_tls() && !endpoint.starts_with("https://") {
            return Err(Error::invalid(
                "endpoint",
                format!(
                    "{endpoint:?} is not an https:// URL, and this supervisor dials workers over \
                     TLS: register the worker's https:// endpoint (the worker's `advertise`, \
                     CONVENE_ADVERTISE=https://<host>:<port>)"
                ),
            ));
        }
        self.check_owner(owner, worker_id, "register")?;
        let handle = self
            .connector
            .connect(endpoint)
            .map_err(|e| Error::invalid("endpoint", e))?;
        let mut workers = self.workers.lock().expect("registry lock poisoned");
        let now = Instant::now();
        // Checked again: another registration may have come in while connecting.
        if let Some(e) = workers.get(worker_id)
            && e.held_by_other(owner, now)
        {
            return Err(taken(worker_id, "register", self.settings.lease_ttl));
        }
        let (in_flight, reported) = workers
            .get(worker_id)
            .map_or((0, 0), |e| (e.in_flight, e.reported));
        let previous = workers.insert(
            worker_id.to_owned(),
            Entry {
                endpoint: endpoint.to_owned(),
                profiles,
                capacity: capacity.max(1),
                in_flight,
                reported,
                lease_until: now + self.settings.lease_ttl,
                dead: false,
                owner: owner.clone(),
                handle,
            },
        );
        drop(workers);
        match previous {
            Some(p) if p.owner != *owner => tracing::warn!(
                worker_id,
                endpoint,
                registrant = %owner,
                previous = %p.owner,
                "worker id taken over after its registration lapsed"
            ),
            _ => tracing::info!(worker_id, endpoint, registrant = %owner, "worker registered"),
        }
        self.changed.notify_waiters();
        Ok(())
    }

    /// PERMISSION_DENIED when `worker_id` is live under another identity than `who`.
    fn check_owner(&self, who: &Registrant, worker_id: &str, what: &str) -> Result<(), Error> {
        let workers = self.workers.lock().expect("registry lock poisoned");
        match workers.get(worker_id) {
            Some(e) if e.held_by_other(who, Instant::now()) => {
                tracing::warn!(
                    worker_id,
                    caller = %who,
                    registrant = %e.owner,
                    "refused: {what} a worker id another identity holds"
                );
                Err(taken(worker_id, what, self.settings.lease_ttl))
            }
            _ => Ok(()),
        }
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
                e.live(now) && e.in_flight < e.capacity && e.profiles.iter().any(|p| p == profile)
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
            e.dead = true;
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
            .any(|e| e.live(now) && e.profiles.iter().any(|p| p == profile))
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
            .map(|(id, e)| (id.clone(), e.in_flight, e.live(now)))
            .collect();
        v.sort();
        v
    }

    /// The caller, if it may register workers: its identity and its principal.
    async fn registrant<T>(
        &self,
        request: &Request<T>,
    ) -> Result<(Registrant, Arc<Principal>), Status> {
        let caller = self.auth.authenticate(request).await?;
        let principal = caller
            .require_role("workers:register", "register workers")?
            .clone();
        require_peer_service(request, &caller, MeshService::Worker, "register workers")?;
        let registrant = Registrant::new(principal.id.clone(), peer_identities(request));
        Ok((registrant, principal))
    }
}

/// The refusal of a call about a worker id another identity holds.
fn taken(worker_id: &str, what: &str, lease_ttl: Duration) -> Error {
    Error::PermissionDenied(format!(
        "cannot {what} worker {worker_id}: it belongs to another identity, whose registration \
         is live; only the principal (and client certificate) that registered it may \
         register, heartbeat or deregister it. Give this worker a worker_id of its own; a \
         registration not renewed for {lease_ttl:?} may be taken over"
    ))
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
        let (owner, principal) = self.registrant(&request).await?;
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
        let profiles: Vec<String> = r.profiles.iter().map(|p| p.id.clone()).collect();
        if let Some(refused) = profiles.iter().find(|p| !principal.may_serve(p)) {
            return Err(Error::PermissionDenied(format!(
                "principal {} may not register workers serving profile {refused}: add \
                 {refused} to the principal's `profiles` in the policy file \
                 (principals[].profiles; \"*\" allows any)",
                principal.id
            ))
            .into());
        }
        self.register_worker(&owner, &r.worker_id, &r.endpoint, profiles, r.capacity)?;
        for p in &r.profiles {
            self.describe(&p.id, &p.description);
        }
        Ok(Response::new(v1::RegisterResponse {
            lease_ttl: Some(to_duration(self.settings.lease_ttl)),
            heartbeat_interval: Some(to_duration(self.settings.heartbeat_interval)),
        }))
    }

    async fn heartbeat(
        &self,
        request: Request<v1::HeartbeatRequest>,
    ) -> Result<Response<v1::HeartbeatResponse>, Status> {
        let (owner, _) = self.registrant(&request).await?;
        let r = request.into_inner();
        let now = Instant::now();
        let mut workers = self.workers.lock().expect("registry lock poisoned");
        let registered = match workers.get_mut(&r.worker_id) {
            Some(e) if e.owner == owner => {
                let was_dead = !e.live(now);
                e.lease_until = now + self.settings.lease_ttl;
                e.dead = false;
                e.reported = r.in_flight;
                if was_dead {
                    drop(workers);
                    self.changed.notify_waiters();
                }
                true
            }
            Some(e) if e.held_by_other(&owner, now) => {
                tracing::warn!(
                    worker_id = %r.worker_id,
                    caller = %owner,
                    registrant = %e.owner,
                    "refused: heartbeat a worker id another identity holds"
                );
                return Err(taken(&r.worker_id, "heartbeat", self.settings.lease_ttl).into());
            }
            // Lapsed and another identity's: not renewed for this caller, which may
            // register to take it over.
            Some(_) | None => false,
        };
        Ok(Response::new(v1::HeartbeatResponse { registered }))
    }

    async fn deregister(
        &self,
        request: Request<v1::DeregisterRequest>,
    ) -> Result<Response<v1::DeregisterResponse>, Status> {
        let (owner, _) = self.registrant(&request).await?;
        let r = request.into_inner();
        self.check_owner(&owner, &r.worker_id, "deregister")?;
        let mut workers = self.workers.lock().expect("registry lock poisoned");
        // Checked again under the lock that removes it.
        if workers
            .get(&r.worker_id)
            .is_some_and(|e| e.held_by_other(&owner, Instant::now()))
        {
            return Err(taken(&r.worker_id, "deregister", self.settings.lease_ttl).into());
        }
        let removed = workers.remove(&r.worker_id).is_some();
        drop(workers);
        if removed {
            tracing::info!(worker_id = %r.worker_id, "worker deregistered");
        }
        Ok(Response::new(v1::DeregisterResponse { removed }))
    }
}
