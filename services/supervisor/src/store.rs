//! Run storage. The supervisor is the single writer of a run: each run has one owner
//! task that reads it once and then commits every change with the version it read
//! (`... where version = n`), together with the events the change produces. A commit
//! against a stale version is refused, never merged silently.
//!
//! [`MemoryStore`] keeps everything in memory; durable back ends implement the same
//! trait with one database transaction per commit (the state change and its outbox
//! events together).

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use convene_proto::v1;
use convene_store::time::micros;
use tokio::sync::broadcast;

/// Errors from a store.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The run changed since it was read (another writer): re-read and merge.
    #[error(
        "run {run_id} was changed by another writer (expected version {expected}, found {found})"
    )]
    Conflict {
        /// The run.
        run_id: String,
        /// Version the writer read.
        expected: u64,
        /// Version in the store.
        found: u64,
    },
    /// Another supervisor replica holds the run's lease: this one must stop touching
    /// the run (its lease expired and the other replica claimed it).
    #[error(
        "run {run_id} is now owned by supervisor replica {owner}; this replica's lease on it was lost"
    )]
    LeaseLost {
        /// The run.
        run_id: String,
        /// The replica holding it now.
        owner: String,
    },
    /// No such run.
    #[error("run {0} not found")]
    NotFound(String),
    /// The back end failed.
    #[error("run store: {0}")]
    Backend(String),
}

/// The idempotency identity of a StartRun: (principal, key).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct IdempotencyKey {
    /// Principal that started the run.
    pub principal: String,
    /// Caller-chosen key.
    pub key: String,
}

/// What creating a run did.
#[derive(Debug, Clone)]
pub enum Created {
    /// The run was stored.
    New,
    /// A run with this idempotency key exists already; here it is.
    Existing(Box<v1::Run>),
}

/// One page of runs.
#[derive(Debug, Clone, Default)]
pub struct Page {
    /// Runs, newest first.
    pub runs: Vec<v1::Run>,
    /// Cursor for the next page (the last run id), if more exist.
    pub next: Option<String>,
}

/// Which of a tenant's runs a listing returns: those that meet every condition set.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RunFilter {
    /// Only runs in these states (`v1::RunState` values); empty: any state.
    pub states: Vec<i32>,
    /// Only runs whose spec has each of these labels with exactly this value.
    pub labels: BTreeMap<String, String>,
    /// Only runs created at or after this time.
    pub created_after: Option<SystemTime>,
    /// Only runs created before this time.
    pub created_before: Option<SystemTime>,
}

impl RunFilter {
    /// Whether `run` meets the filter. Times compare at microsecond precision, as the
    /// SQL store keeps them.
    pub fn matches(&self, run: &v1::Run) -> bool {
        if !self.states.is_empty() && !self.states.contains(&run.state) {
            return false;
        }
        let created = run.created_at.as_ref().map_or(0, |t| {
            t.seconds
                .saturating_mul(1_000_000)
                .saturating_add(i64::from(t.nanos) / 1_000)
        });
        if self.created_after.is_some_and(|t| created < micros(t))
            || self.created_before.is_some_and(|t| created >= micros(t))
        {
            return false;
        }
        let labels = run.spec.as_ref().map(|s| &s.labels);
        self.labels
            .iter()
            .all(|(key, value)| labels.and_then(|l| l.get(key)) == Some(value))
    }
}

/// Events produced by one change, committed with it.
#[derive(Debug, Clone, Default)]
pub struct Events {
    /// Run events (WatchRun), with sequence numbers assigned by the writer.
    pub run: Vec<v1::RunEvent>,
    /// CloudEvents for the outbox (WatchEvents and brokers).
    pub cloud: Vec<v1::CloudEvent>,
    /// Commands for the run this change applied: marked done, with their outcome, in
    /// the same commit.
    pub commands: Vec<CommandDone>,
    /// The run begins to wait with nothing of it in flight: its lease goes in the same
    /// commit (see `run/waiting.rs`).
    pub release: bool,
}

impl Events {
    /// Whether there is nothing to commit.
    pub fn is_empty(&self) -> bool {
        self.run.is_empty() && self.cloud.is_empty() && self.commands.is_empty() && !self.release
    }
}

/// A command for a run (cancel it, resume it with a person's input, look at its
/// approval requests again), stored by whichever replica received it and applied by the
/// replica that owns the run.
#[derive(Clone, PartialEq, prost::Message)]
pub struct RunCommand {
    /// Unique id.
    #[prost(string, tag = "1")]
    pub command_id: String,
    /// The run.
    #[prost(string, tag = "2")]
    pub run_id: String,
    /// Who sent it (a principal id, or `approval` for an approval event).
    #[prost(string, tag = "3")]
    pub principal: String,
    /// When it was stored.
    #[prost(message, optional, tag = "4")]
    pub created_at: Option<prost_types::Timestamp>,
    /// What to do.
    #[prost(oneof = "CommandKind", tags = "5, 6, 7")]
    pub kind: Option<CommandKind>,
}

/// What a [`RunCommand`] asks for.
#[derive(Clone, PartialEq, prost::Oneof)]
pub enum CommandKind {
    /// Cancel the run.
    #[prost(message, tag = "5")]
    Cancel(v1::CancelRunRequest),
    /// Resume the waiting run with a person's input.
    #[prost(message, tag = "6")]
    Resume(v1::ResumeRunRequest),
    /// An approval request of the run changed: look at its requests again.
    #[prost(message, tag = "7")]
    Approval(v1::CloudEvent),
}

/// What applying a command did: a status code (OK: applied) and its message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CommandDone {
    /// The command.
    pub command_id: String,
    /// `tonic::Code` as an integer; 0 when applied.
    pub code: i32,
    /// What happened, in words.
    pub message: String,
}

/// Storage of runs, their events and the outbox.
#[async_trait]
pub trait RunStore: Send + Sync + 'static {
    /// Stores a new run (version 1) with its first events. With an idempotency key, a
    /// second run under the same key is not stored: the existing one is returned. The
    /// check and the insert are one atomic step.
    async fn create(
        &self,
        run: &v1::Run,
        key: Option<&IdempotencyKey>,
        events: &Events,
    ) -> Result<Created, StoreError>;

    /// Commits a changed run whose stored version is `run.version - 1`, with the
    /// events the change produced. A store that leases the runs it creates to a replica
    /// ([`MemoryStore::with_owner`], `SqlRunStore::with_owner`) also refuses the commit
    /// with [`StoreError::LeaseLost`] when another replica holds the run's lease: a
    /// replica whose lease expired and was taken over can never write again.
    async fn commit(&self, run: &v1::Run, events: &Events) -> Result<(), StoreError>;

    /// [`commit`](Self::commit) of a run its owner shares: a commit that ends the run
    /// hands `run` itself to whoever waits for the end ([`Committed::ended`]) instead
    /// of a copy.
    async fn commit_shared(&self, run: &Arc<v1::Run>, events: &Events) -> Result<(), StoreError> {
        self.commit(run, events).await
    }

    /// A run by id, whatever its tenant (callers check the tenant).
    async fn get(&self, run_id: &str) -> Result<Option<v1::Run>, StoreError>;

    /// The tenant of a run, when the run exists: what a caller that does not need the
    /// run itself (a watch) checks, without reading the whole run.
    async fn tenant_of(&self, run_id: &str) -> Result<Option<String>, StoreError> {
        Ok(self.get(run_id).await?.map(|run| run.tenant))
    }

    /// A tenant's runs that meet `filter`, newest first, after the cursor (the last run
    /// of the previous page). The filter applies before the page is cut: a page holds
    /// `page_size` matching runs when that many follow the cursor.
    async fn list(
        &self,
        tenant: &str,
        filter: &RunFilter,
        page_size: usize,
        after: Option<&str>,
    ) -> Result<Page, StoreError>;

    /// Run events of a run with sequence > `after`, in order.
    async fn run_events(&self, run_id: &str, after: u64) -> Result<Vec<v1::RunEvent>, StoreError>;

    /// Outbox events after event id `after` (exclusive; None: from the start), in
    /// commit order, at most `limit`.
    async fn cloud_events(
        &self,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<v1::CloudEvent>, StoreError>;

    /// The id of the newest outbox event (None: the outbox is empty): where a follower
    /// that wants only what comes next starts ([`cloud_events`](Self::cloud_events)
    /// after it). This default pages through the whole outbox; the stores look it up
    /// at once.
    async fn newest_cloud_event(&self) -> Result<Option<String>, StoreError> {
        let mut newest = None;
        loop {
            let page = self.cloud_events(newest.as_deref(), 512).await?;
            match page.last() {
                Some(last) => newest = Some(last.id.clone()),
                None => return Ok(newest),
            }
        }
    }

    /// Notifications of committed events, for live subscribers. A lagging receiver
    /// re-reads from the store.
    fn subscribe(&self) -> broadcast::Receiver<Committed>;

    /// The supervisor replica this store leases the runs it creates to, and for how long
    /// (set by `with_owner`); None: runs are not leased, and nothing is recovered.
    fn owner(&self) -> Option<(&str, Duration)>;

    /// Non-terminal runs, for recovery after a restart.
    async fn unfinished(&self) -> Result<Vec<v1::Run>, StoreError>;

    /// Claims up to `limit` unfinished runs for the supervisor replica `owner`, oldest
    /// first: runs nobody holds and runs whose lease expired (a crashed replica's, or
    /// `owner`'s own from before a restart). Each is leased to `owner` for `lease_ttl`
    /// from now; runs `owner` holds already are not returned again, so a replica can claim
    /// in a loop. Two replicas claiming at the same time never get the same run.
    async fn claim_runs(
        &self,
        owner: &str,
        lease_ttl: Duration,
        limit: usize,
    ) -> Result<Vec<v1::Run>, StoreError>;

    /// Extends `owner`'s leases on `run_ids` to `lease_ttl` from now. Returns the ids
    /// `owner` still holds: a run missing from the answer was claimed by another replica
    /// after its lease expired, and its actor here must stop.
    async fn renew_lease(
        &self,
        owner: &str,
        run_ids: &[String],
        lease_ttl: Duration,
    ) -> Result<Vec<String>, StoreError>;

    /// Gives up `owner`'s lease on a run (it finished, or the replica shuts down), so
    /// another replica may claim it at once. Returns whether `owner` held it.
    async fn release(&self, owner: &str, run_id: &str) -> Result<bool, StoreError>;

    /// The last outbox event `relay` acknowledged, where it resumes after a restart.
    async fn relay_cursor(&self, relay: &str) -> Result<Option<String>, StoreError>;

    /// Stores a command for a run; a command id stored already is left as it is.
    async fn add_command(&self, command: &RunCommand) -> Result<(), StoreError>;

    /// The commands of `run_id` not applied yet, oldest first.
    async fn pending_commands(&self, run_id: &str) -> Result<Vec<RunCommand>, StoreError>;

    /// The runs that have commands not applied yet.
    async fn runs_with_commands(&self) -> Result<Vec<String>, StoreError>;

    /// What applying a command did, once it was applied; `None` while it is pending.
    async fn command_outcome(&self, command_id: &str) -> Result<Option<CommandDone>, StoreError>;

    /// Marks commands of a run that will never be applied (the run has ended) as done,
    /// with `code` and `message`, outside any commit of the run.
    async fn end_commands(&self, done: &[CommandDone]) -> Result<(), StoreError>;

    /// Claims one waiting run for `owner` (see [`RunStore::claim_runs`]) when its lease
    /// is free or expired, to apply the commands pending for it. `None` when the run is
    /// not waiting or another replica holds it.
    async fn claim_waiting(
        &self,
        owner: &str,
        run_id: &str,
        lease_ttl: Duration,
    ) -> Result<Option<v1::Run>, StoreError>;

    /// Adds events another service produced (an approval service's) to the outbox,
    /// unless an event with the same id is there already, so `WatchEvents` and the relay
    /// carry them too.
    async fn import_events(&self, events: &[v1::CloudEvent]) -> Result<(), StoreError>;

    /// Records where the supervisor replica `replica` can be reached (its advertised
    /// endpoint), replacing what was recorded before.
    async fn register_replica(&self, replica: &str, endpoint: &str) -> Result<(), StoreError>;

    /// The replica holding `run_id`'s lease now and the endpoint it registered, if any.
    async fn run_owner(&self, run_id: &str)
    -> Result<Option<(String, Option<String>)>, StoreError>;

    /// Records that `relay` delivered every outbox event up to `event_id`. The cursor
    /// only moves forward: an acknowledgement of an event before the cursor (a slower
    /// replica relaying the same events) changes nothing. A relay delivers at least
    /// once: after a crash it resumes from the last acknowledgement.
    ///
    /// [`StoreError::NotFound`] for an event id not in the outbox.
    async fn acknowledge(&self, relay: &str, event_id: &str) -> Result<(), StoreError>;
}

/// A notification that events of a run were committed.
#[derive(Debug, Clone)]
pub struct Committed {
    /// The run.
    pub run_id: String,
    /// Its highest committed run-event sequence.
    pub last_sequence: u64,
    /// Whether outbox events were committed too.
    pub cloud: bool,
    /// The run events this commit carried, in sequence order, when this process made
    /// the commit (a watcher then needs no read to see them); `None` for commits found
    /// by polling the store, and for commits without run events.
    pub events: Option<Arc<[v1::RunEvent]>>,
    /// The run as this commit stored it, when the commit ended the run and this process
    /// made it (a caller waiting for the end then needs no read); `None` otherwise.
    pub ended: Option<Arc<v1::Run>>,
}

impl Committed {
    /// The note of this process's commit of `run` that carried `events`, the run's
    /// highest committed sequence being `last_sequence`. `shared` is `run` itself when
    /// its owner shares it, so a commit that ends the run need not copy it.
    pub(crate) fn of(
        run: &v1::Run,
        shared: Option<&Arc<v1::Run>>,
        last_sequence: u64,
        events: &Events,
    ) -> Self {
        Self {
            run_id: run.run_id.clone(),
            last_sequence,
            cloud: !events.cloud.is_empty(),
            events: (!events.run.is_empty()).then(|| Arc::from(events.run.as_slice())),
            ended: is_terminal(run.state)
                .then(|| shared.map_or_else(|| Arc::new(run.clone()), Arc::clone)),
        }
    }
}

/// Whether a run in this state has stopped: it has ended (a final state) or waits for
/// people (a waiting state). A stopped run needs no actor; a waiting one gets one again
/// when a command for it arrives.
pub fn is_terminal(state: i32) -> bool {
    !matches!(
        v1::RunState::try_from(state),
        Ok(v1::RunState::Pending | v1::RunState::Running | v1::RunState::Unspecified) | Err(_)
    )
}

/// Whether a run in this state waits for people: WAITING_APPROVAL or WAITING_INPUT.
pub fn is_waiting(state: i32) -> bool {
    matches!(
        v1::RunState::try_from(state),
        Ok(v1::RunState::WaitingApproval | v1::RunState::WaitingInput)
    )
}

/// Whether a run in this state has ended for good.
pub fn is_final(state: i32) -> bool {
    is_terminal(state) && !is_waiting(state)
}

#[derive(Default)]
struct Inner {
    runs: HashMap<String, v1::Run>,
    /// Run ids per tenant, in creation order (UUIDv7 ids sort by time).
    by_tenant: HashMap<String, BTreeMap<String, ()>>,
    keys: HashMap<IdempotencyKey, String>,
    run_events: HashMap<String, Vec<v1::RunEvent>>,
    outbox: Vec<v1::CloudEvent>,
    outbox_index: HashMap<String, usize>,
    /// Run id → (owner, lease expiry).
    leases: HashMap<String, (String, SystemTime)>,
    /// Run id → its lease epoch, once claimed (before: the stored run's).
    epochs: HashMap<String, u64>,
    /// Relay → outbox index of the last acknowledged event.
    relays: HashMap<String, usize>,
    /// Replica → advertised endpoint.
    replicas: HashMap<String, String>,
    /// Commands by id, with their outcome once applied; and their order.
    commands: HashMap<String, (RunCommand, Option<CommandDone>)>,
    command_order: Vec<String>,
}

impl Inner {
    /// Leases `run` to `owner` from `now`: its next lease epoch, and the claim in its
    /// history, as the SQL store's claim gives it.
    fn claim(&mut self, run: &mut v1::Run, owner: &str, now: SystemTime, ttl: Duration) {
        let before = self
            .leases
            .insert(run.run_id.clone(), (owner.to_owned(), now + ttl))
            .map(|(held_by, _)| held_by);
        // A replica that takes back its own expired lease took it from nobody: the
        // epoch stays.
        let own = before.as_deref() == Some(owner);
        let previous = before.filter(|p| p != owner);
        let epoch = self
            .epochs
            .entry(run.run_id.clone())
            .or_insert(run.lease_epoch);
        if !own {
            *epoch += 1;
        }
        run.lease_epoch = *epoch;
        run.owner = owner.to_owned();
        run.claims.push(v1::RunClaim {
            epoch: *epoch,
            replica: owner.to_owned(),
            previous_replica: previous.unwrap_or_default(),
            at: Some(convene_core::time::to_timestamp(now)),
        });
    }
}

/// Everything in memory: fast, and lost with the process.
pub struct MemoryStore {
    inner: Mutex<Inner>,
    notify: broadcast::Sender<Committed>,
    /// Runs this store creates are leased to this replica, for this long.
    creator: Option<(String, Duration)>,
}

impl MemoryStore {
    /// Sends `note` to subscribers as if a commit had made it.
    #[cfg(test)]
    pub(crate) fn announce_for_test(&self, note: Committed) {
        let _ = self.notify.send(note);
    }
}

impl Default for MemoryStore {
    fn default() -> Self {
        Self {
            inner: Mutex::new(Inner::default()),
            notify: broadcast::channel(4096).0,
            creator: None,
        }
    }
}

impl std::fmt::Debug for MemoryStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryStore").finish_non_exhaustive()
    }
}

impl MemoryStore {
    /// Leases every run this store creates to the supervisor replica `owner` for
    /// `lease_ttl`, so other replicas' [`RunStore::claim_runs`] leave it alone while
    /// `owner` renews the lease.
    #[must_use]
    pub fn with_owner(mut self, owner: impl Into<String>, lease_ttl: Duration) -> Self {
        self.creator = Some((owner.into(), lease_ttl));
        self
    }

    fn append(inner: &mut Inner, run: &v1::Run, events: &Events) -> Committed {
        let log = inner.run_events.entry(run.run_id.clone()).or_default();
        log.extend(events.run.iter().cloned());
        let last_sequence = log.last().map_or(0, |e| e.sequence);
        for e in &events.cloud {
            inner.outbox_index.insert(e.id.clone(), inner.outbox.len());
            inner.outbox.push(e.clone());
        }
        Committed::of(run, None, last_sequence, events)
    }
}

#[async_trait]
impl RunStore for MemoryStore {
    async fn create(
        &self,
        run: &v1::Run,
        key: Option<&IdempotencyKey>,
        events: &Events,
    ) -> Result<Created, StoreError> {
        let committed = {
            let mut inner = self.inner.lock().expect("store lock poisoned");
            if let Some(key) = key {
                if let Some(existing) = inner.keys.get(key) {
                    let run = inner.runs.get(existing).cloned().ok_or_else(|| {
                        StoreError::Backend(format!(
                            "idempotency key points at missing run {existing}"
                        ))
                    })?;
                    return Ok(Created::Existing(Box::new(run)));
                }
                inner.keys.insert(key.clone(), run.run_id.clone());
            }
            inner.runs.insert(run.run_id.clone(), run.clone());
            inner
                .by_tenant
                .entry(run.tenant.clone())
                .or_default()
                .insert(run.run_id.clone(), ());
            if let Some((owner, ttl)) = &self.creator {
                inner.leases.insert(
                    run.run_id.clone(),
                    (owner.clone(), SystemTime::now() + *ttl),
                );
            }
            Self::append(&mut inner, run, events)
        };
        let _ = self.notify.send(committed);
        Ok(Created::New)
    }

    async fn commit(&self, run: &v1::Run, events: &Events) -> Result<(), StoreError> {
        let committed = {
            let mut inner = self.inner.lock().expect("store lock poisoned");
            let found = inner
                .runs
                .get(&run.run_id)
                .ok_or_else(|| StoreError::NotFound(run.run_id.clone()))?
                .version;
            if found + 1 != run.version {
                return Err(StoreError::Conflict {
                    run_id: run.run_id.clone(),
                    expected: run.version.saturating_sub(1),
                    found,
                });
            }
            if let Some((me, _)) = &self.creator
                && let Some((holder, _)) = inner.leases.get(&run.run_id)
                && holder != me
            {
                return Err(StoreError::LeaseLost {
                    run_id: run.run_id.clone(),
                    owner: holder.clone(),
                });
            }
            let stored = inner
                .runs
                .get_mut(&run.run_id)
                .ok_or_else(|| StoreError::NotFound(run.run_id.clone()))?;
            *stored = run.clone();
            // A waiting run is nobody's until a command wakes it.
            if events.release {
                inner.leases.remove(&run.run_id);
            }
            for done in &events.commands {
                if let Some((_, outcome)) = inner.commands.get_mut(&done.command_id)
                    && outcome.is_none()
                {
                    *outcome = Some(done.clone());
                }
            }
            Self::append(&mut inner, run, events)
        };
        let _ = self.notify.send(committed);
        Ok(())
    }

    async fn get(&self, run_id: &str) -> Result<Option<v1::Run>, StoreError> {
        Ok(self
            .inner
            .lock()
            .expect("store lock poisoned")
            .runs
            .get(run_id)
            .cloned())
    }

    async fn list(
        &self,
        tenant: &str,
        filter: &RunFilter,
        page_size: usize,
        after: Option<&str>,
    ) -> Result<Page, StoreError> {
        let inner = self.inner.lock().expect("store lock poisoned");
        let Some(ids) = inner.by_tenant.get(tenant) else {
            return Ok(Page::default());
        };
        let mut runs = Vec::with_capacity(page_size);
        let iter: Box<dyn Iterator<Item = &String>> = match after {
            Some(cursor) => Box::new(
                ids.range::<String, _>(..cursor.to_owned())
                    .rev()
                    .map(|(k, _)| k),
            ),
            None => Box::new(ids.keys().rev()),
        };
        let mut more = false;
        for id in iter {
            let Some(run) = inner.runs.get(id) else {
                continue;
            };
            if !filter.matches(run) {
                continue;
            }
            if runs.len() == page_size {
                more = true;
                break;
            }
            runs.push(run.clone());
        }
        let next = if more {
            runs.last().map(|r| r.run_id.clone())
        } else {
            None
        };
        Ok(Page { runs, next })
    }

    async fn run_events(&self, run_id: &str, after: u64) -> Result<Vec<v1::RunEvent>, StoreError> {
        let inner = self.inner.lock().expect("store lock poisoned");
        Ok(inner
            .run_events
            .get(run_id)
            .map(|log| log.iter().filter(|e| e.sequence > after).cloned().collect())
            .unwrap_or_default())
    }

    async fn cloud_events(
        &self,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<v1::CloudEvent>, StoreError> {
        let inner = self.inner.lock().expect("store lock poisoned");
        let start = match after {
            None => 0,
            Some(id) => match inner.outbox_index.get(id) {
                Some(i) => i + 1,
                // An id not (or no longer) known: UUIDv7 ids sort by time, so resume
                // after the position where it would have been.
                None => inner.outbox.partition_point(|e| e.id.as_str() <= id),
            },
        };
        Ok(inner
            .outbox
            .iter()
            .skip(start)
            .take(limit)
            .cloned()
            .collect())
    }

    async fn newest_cloud_event(&self) -> Result<Option<String>, StoreError> {
        let inner = self.inner.lock().expect("store lock poisoned");
        Ok(inner.outbox.last().map(|e| e.id.clone()))
    }

    fn subscribe(&self) -> broadcast::Receiver<Committed> {
        self.notify.subscribe()
    }

    fn owner(&self) -> Option<(&str, Duration)> {
        self.creator
            .as_ref()
            .map(|(owner, ttl)| (owner.as_str(), *ttl))
    }

    async fn unfinished(&self) -> Result<Vec<v1::Run>, StoreError> {
        let inner = self.inner.lock().expect("store lock poisoned");
        Ok(inner
            .runs
            .values()
            .filter(|r| !is_terminal(r.state))
            .cloned()
            .collect())
    }

    async fn claim_runs(
        &self,
        owner: &str,
        lease_ttl: Duration,
        limit: usize,
    ) -> Result<Vec<v1::Run>, StoreError> {
        let now = SystemTime::now();
        let mut inner = self.inner.lock().expect("store lock poisoned");
        let mut claimable: Vec<v1::Run> = inner
            .runs
            .values()
            .filter(|r| !is_terminal(r.state))
            .filter(|r| {
                inner
                    .leases
                    .get(&r.run_id)
                    .is_none_or(|(_, until)| *until <= now)
            })
            .cloned()
            .collect();
        // UUIDv7 ids sort by creation time.
        claimable.sort_by(|a, b| a.run_id.cmp(&b.run_id));
        claimable.truncate(limit);
        for run in &mut claimable {
            inner.claim(run, owner, now, lease_ttl);
        }
        Ok(claimable)
    }

    async fn renew_lease(
        &self,
        owner: &str,
        run_ids: &[String],
        lease_ttl: Duration,
    ) -> Result<Vec<String>, StoreError> {
        let until = SystemTime::now() + lease_ttl;
        let mut inner = self.inner.lock().expect("store lock poisoned");
        Ok(run_ids
            .iter()
            .filter(|id| match inner.leases.get_mut(*id) {
                Some((held_by, lease)) if held_by == owner => {
                    *lease = until;
                    true
                }
                _ => false,
            })
            .cloned()
            .collect())
    }

    async fn release(&self, owner: &str, run_id: &str) -> Result<bool, StoreError> {
        let mut inner = self.inner.lock().expect("store lock poisoned");
        let held = inner
            .leases
            .get(run_id)
            .is_some_and(|(held_by, _)| held_by == owner);
        if held {
            inner.leases.remove(run_id);
        }
        Ok(held)
    }

    async fn add_command(&self, command: &RunCommand) -> Result<(), StoreError> {
        let mut inner = self.inner.lock().expect("store lock poisoned");
        if !inner.commands.contains_key(&command.command_id) {
            inner.command_order.push(command.command_id.clone());
            inner
                .commands
                .insert(command.command_id.clone(), (command.clone(), None));
        }
        Ok(())
    }

    async fn pending_commands(&self, run_id: &str) -> Result<Vec<RunCommand>, StoreError> {
        let inner = self.inner.lock().expect("store lock poisoned");
        Ok(inner
            .command_order
            .iter()
            .filter_map(|id| inner.commands.get(id))
            .filter(|(c, done)| done.is_none() && c.run_id == run_id)
            .map(|(c, _)| c.clone())
            .collect())
    }

    async fn runs_with_commands(&self) -> Result<Vec<String>, StoreError> {
        let inner = self.inner.lock().expect("store lock poisoned");
        let mut runs: Vec<String> = Vec::new();
        for (c, done) in inner.commands.values() {
            if done.is_none() && !runs.contains(&c.run_id) {
                runs.push(c.run_id.clone());
            }
        }
        Ok(runs)
    }

    async fn command_outcome(&self, command_id: &str) -> Result<Option<CommandDone>, StoreError> {
        let inner = self.inner.lock().expect("store lock poisoned");
        Ok(inner
            .commands
            .get(command_id)
            .and_then(|(_, done)| done.clone()))
    }

    async fn end_commands(&self, done: &[CommandDone]) -> Result<(), StoreError> {
        let mut inner = self.inner.lock().expect("store lock poisoned");
        for d in done {
            if let Some((_, outcome)) = inner.commands.get_mut(&d.command_id)
                && outcome.is_none()
            {
                *outcome = Some(d.clone());
            }
        }
        Ok(())
    }

    async fn claim_waiting(
        &self,
        owner: &str,
        run_id: &str,
        lease_ttl: Duration,
    ) -> Result<Option<v1::Run>, StoreError> {
        let now = SystemTime::now();
        let mut inner = self.inner.lock().expect("store lock poisoned");
        let Some(mut run) = inner
            .runs
            .get(run_id)
            .filter(|r| is_waiting(r.state))
            .cloned()
        else {
            return Ok(None);
        };
        if inner
            .leases
            .get(run_id)
            .is_some_and(|(_, until)| *until > now)
        {
            return Ok(None);
        }
        inner.claim(&mut run, owner, now, lease_ttl);
        Ok(Some(run))
    }

    async fn register_replica(&self, replica: &str, endpoint: &str) -> Result<(), StoreError> {
        let mut inner = self.inner.lock().expect("store lock poisoned");
        inner
            .replicas
            .insert(replica.to_owned(), endpoint.to_owned());
        Ok(())
    }

    async fn run_owner(
        &self,
        run_id: &str,
    ) -> Result<Option<(String, Option<String>)>, StoreError> {
        let now = SystemTime::now();
        let inner = self.inner.lock().expect("store lock poisoned");
        Ok(inner
            .leases
            .get(run_id)
            .filter(|(_, until)| *until > now)
            .map(|(owner, _)| (owner.clone(), inner.replicas.get(owner).cloned())))
    }

    async fn import_events(&self, events: &[v1::CloudEvent]) -> Result<(), StoreError> {
        let imported = {
            let mut inner = self.inner.lock().expect("store lock poisoned");
            let mut any = false;
            for e in events {
                if !inner.outbox_index.contains_key(&e.id) {
                    let at = inner.outbox.len();
                    inner.outbox_index.insert(e.id.clone(), at);
                    inner.outbox.push(e.clone());
                    any = true;
                }
            }
            any
        };
        if imported {
            let _ = self.notify.send(Committed {
                run_id: String::new(),
                last_sequence: 0,
                cloud: true,
                events: None,
                ended: None,
            });
        }
        Ok(())
    }

    async fn relay_cursor(&self, relay: &str) -> Result<Option<String>, StoreError> {
        let inner = self.inner.lock().expect("store lock poisoned");
        Ok(inner
            .relays
            .get(relay)
            .and_then(|i| inner.outbox.get(*i))
            .map(|e| e.id.clone()))
    }

    async fn acknowledge(&self, relay: &str, event_id: &str) -> Result<(), StoreError> {
        let mut inner = self.inner.lock().expect("store lock poisoned");
        let index = *inner
            .outbox_index
            .get(event_id)
            .ok_or_else(|| StoreError::NotFound(format!("outbox event {event_id}")))?;
        let cursor = inner.relays.entry(relay.to_owned()).or_insert(index);
        *cursor = (*cursor).max(index);
        Ok(())
    }
}
