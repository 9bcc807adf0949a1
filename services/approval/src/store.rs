//! Where approval requests are kept: the [`ApprovalStore`] trait and its in-memory
//! implementation, [`MemoryStore`].
//!
//! The trait is shaped for a durable SQL store as much as for memory:
//!
//! - every stored request carries a version; [`ApprovalStore::update`] is a
//!   compare-and-set on it and never overwrites a request someone else changed since it
//!   was read (the caller re-reads and re-applies its change);
//! - [`ApprovalStore::create`] is idempotent on (requester, idempotency key) in the
//!   store itself, so two concurrent filings with one key create one request;
//! - a change takes its [`Event`] with it, committed in the same transaction (the same
//!   critical section in memory) or not at all; an update without an event may not
//!   change the request's state (only the execution claim changes so). Events are read
//!   back in commit order ([`ApprovalStore::events`]), and [`ApprovalStore::subscribe`]
//!   says when this store committed more;
//! - [`ApprovalStore::list`] filters and orders in the store (newest first, by
//!   `created_at` then `approval_id`) and resumes after a [`Cursor`], which a SQL store
//!   answers with an index range scan.

use std::{
    cmp::Reverse,
    collections::{BTreeMap, HashMap},
    fmt::Debug,
    sync::Mutex,
    time::SystemTime,
};

use async_trait::async_trait;
use convene_server::ErrorCode;
use tokio::sync::watch;

use crate::events::{Event, StoredEvent};
use crate::model::{ApprovalRequest, State};

/// A request with the version it was stored at.
#[derive(Clone, Debug, PartialEq)]
pub struct Versioned {
    /// Starts at 1 and grows by one with each update.
    pub version: u64,
    /// The request.
    pub request: ApprovalRequest,
}

/// What [`ApprovalStore::create`] did.
#[derive(Clone, Debug, PartialEq)]
pub enum Created {
    /// The request was stored.
    New(Versioned),
    /// The requester had used the idempotency key already: this is the request stored
    /// under it, which may differ from the one offered.
    Existing(Versioned),
}

/// Who is looking: the tenant they act in and their principal id. A viewer sees the
/// requests of its tenant and those it filed itself (the supervisor, which lives in the
/// `system` tenant, sees the requests it filed for runs of any tenant).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Viewer {
    /// The viewer's tenant.
    pub tenant: String,
    /// The viewer's principal id.
    pub principal: String,
}

impl Viewer {
    /// Whether the viewer may see `request`.
    pub fn can_see(&self, request: &ApprovalRequest) -> bool {
        request.tenant == self.tenant || request.filed_by == self.principal
    }
}

/// Where a listing resumes: strictly after (older than) this request in list order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Cursor {
    /// The last listed request's creation time.
    pub created_at: SystemTime,
    /// The last listed request's id.
    pub approval_id: String,
}

/// What to list.
#[derive(Clone, Debug)]
pub struct ListQuery {
    /// Whose view.
    pub viewer: Viewer,
    /// Only requests in these states (as seen at `now`); empty: all.
    pub states: Vec<State>,
    /// Only requests of this run; `None`: all.
    pub run_id: Option<String>,
    /// The time states are judged at (pending past expiry counts as expired).
    pub now: SystemTime,
    /// Resume after this request.
    pub after: Option<Cursor>,
    /// At most this many.
    pub limit: usize,
}

impl ListQuery {
    /// Whether `request` passes the query's filters (not the cursor or the limit).
    pub fn matches(&self, request: &ApprovalRequest) -> bool {
        self.viewer.can_see(request)
            && (self.states.is_empty() || self.states.contains(&request.state_at(self.now)))
            && self.run_id.as_ref().is_none_or(|r| *r == request.run_id)
    }
}

/// Which events to read.
#[derive(Clone, Debug)]
pub struct EventQuery {
    /// Whose view: events of the requests it may see.
    pub viewer: Viewer,
    /// Only events of requests of this run; `None`: all.
    pub run_id: Option<String>,
    /// Strictly after this position (0: from the first).
    pub after: u64,
    /// At most this many.
    pub limit: usize,
}

impl EventQuery {
    /// Whether an event of a request of `tenant`, filed by `filed_by` for `run_id`,
    /// passes the query's filters (not the position or the limit).
    pub fn matches(&self, tenant: &str, filed_by: &str, run_id: &str) -> bool {
        (tenant == self.viewer.tenant || filed_by == self.viewer.principal)
            && self.run_id.as_deref().is_none_or(|r| r == run_id)
    }
}

/// Why a store operation failed.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The request changed since it was read; re-read and re-apply.
    #[error("approval request {approval_id} is at version {actual}, not {expected}")]
    Conflict {
        /// The request.
        approval_id: String,
        /// The version the caller read.
        expected: u64,
        /// The version stored now.
        actual: u64,
    },
    /// The request to update does not exist.
    #[error("approval request {approval_id} does not exist")]
    Missing {
        /// The request.
        approval_id: String,
    },
    /// A request with this id exists already.
    #[error("approval request {approval_id} exists already")]
    DuplicateId {
        /// The request.
        approval_id: String,
    },
    /// The update would change the request's state without an event describing it.
    #[error(
        "approval request {approval_id} would change from {from} to {to} without an event; \
         every state change is written with its event"
    )]
    Unrecorded {
        /// The request.
        approval_id: String,
        /// Its stored state.
        from: State,
        /// The state the update asked for.
        to: State,
    },
    /// The storage backend failed.
    #[error("storage backend failed: {0}")]
    Backend(#[source] Box<dyn std::error::Error + Send + Sync>),
}

impl StoreError {
    /// The error code the failure maps to when it reaches a caller.
    pub fn code(&self) -> ErrorCode {
        match self {
            StoreError::Conflict { .. } => ErrorCode::Aborted,
            StoreError::Missing { .. }
            | StoreError::DuplicateId { .. }
            | StoreError::Unrecorded { .. }
            | StoreError::Backend(_) => ErrorCode::Internal,
        }
    }
}

/// Storage for approval requests. See the [module docs](self) for the contract.
#[async_trait]
pub trait ApprovalStore: Debug + Send + Sync {
    /// Stores `request` at version 1 with `event` (its `requested` event), unless its
    /// requester already used its idempotency key: then returns the request stored under
    /// that key, unchanged, and commits no event.
    async fn create(&self, request: ApprovalRequest, event: Event) -> Result<Created, StoreError>;

    /// The request with this id, whoever's it is (visibility is the caller's check).
    async fn get(&self, approval_id: &str) -> Result<Option<Versioned>, StoreError>;

    /// Replaces the request with the same id if it is still at version `expected`,
    /// commits `event` with it, and returns it at version `expected + 1`. Without an
    /// event the state must stay as stored.
    ///
    /// # Errors
    ///
    /// [`StoreError::Conflict`] if someone else updated it since, [`StoreError::Missing`]
    /// if it does not exist, [`StoreError::Unrecorded`] if it would change state without
    /// an event. Nothing is written then.
    async fn update(
        &self,
        expected: u64,
        request: ApprovalRequest,
        event: Option<Event>,
    ) -> Result<Versioned, StoreError>;

    /// Up to `limit` requests stored as pending whose expiry is at or before `now`,
    /// soonest expiry first.
    async fn pending_expired(
        &self,
        now: SystemTime,
        limit: usize,
    ) -> Result<Vec<Versioned>, StoreError>;

    /// Up to `query.limit` events matching `query`, in commit order, after
    /// `query.after`.
    async fn events(&self, query: &EventQuery) -> Result<Vec<StoredEvent>, StoreError>;

    /// The position of the event with this id if `viewer` may see it; `None` for an
    /// unknown id or another's event.
    async fn event_position(
        &self,
        event_id: &str,
        viewer: &Viewer,
    ) -> Result<Option<u64>, StoreError>;

    /// A counter that moves whenever this store commits an event: wait on it, then read
    /// [`events`](Self::events) again. Commits of other processes sharing the database
    /// do not move it; readers that need those poll.
    fn subscribe(&self) -> watch::Receiver<u64>;

    /// Up to `query.limit` requests matching `query`, newest first (by `created_at`, then
    /// by `approval_id`, both descending), after `query.after`.
    async fn list(&self, query: &ListQuery) -> Result<Vec<Versioned>, StoreError>;
}

/// Sort key: list order is ascending order of this key.
type OrderKey = (Reverse<SystemTime>, Reverse<String>);

fn order_key(created_at: SystemTime, approval_id: &str) -> OrderKey {
    (Reverse(created_at), Reverse(approval_id.to_owned()))
}

/// Requests in memory; lost when the process ends.
#[derive(Debug)]
pub struct MemoryStore {
    inner: Mutex<Memory>,
    committed: watch::Sender<u64>,
}

impl Default for MemoryStore {
    fn default() -> Self {
        Self {
            inner: Mutex::default(),
            committed: watch::Sender::new(0),
        }
    }
}

#[derive(Debug, Default)]
struct Memory {
    by_id: HashMap<String, Versioned>,
    /// (requester, idempotency key) → approval id.
    by_key: HashMap<(String, String), String>,
    /// List order → approval id.
    order: BTreeMap<OrderKey, String>,
    /// Every committed event; the position of `events[i]` is `i + 1`.
    events: Vec<Event>,
}

impl MemoryStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Memory> {
        // Every critical section leaves the maps consistent before it can panic, so a
        // poisoned lock still guards valid data.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn announce(&self) {
        self.committed.send_modify(|n| *n += 1);
    }
}

#[async_trait]
impl ApprovalStore for MemoryStore {
    async fn create(&self, request: ApprovalRequest, event: Event) -> Result<Created, StoreError> {
        debug_assert_eq!(event.approval_id(), request.approval_id);
        let mut memory = self.lock();
        let key = (request.requester.clone(), request.idempotency_key.clone());
        if let Some(existing) = memory.by_key.get(&key).and_then(|id| memory.by_id.get(id)) {
            return Ok(Created::Existing(existing.clone()));
        }
        if memory.by_id.contains_key(&request.approval_id) {
            return Err(StoreError::DuplicateId {
                approval_id: request.approval_id,
            });
        }
        let id = request.approval_id.clone();
        memory.by_key.insert(key, id.clone());
        memory
            .order
            .insert(order_key(request.created_at, &id), id.clone());
        let stored = Versioned {
            version: 1,
            request,
        };
        memory.by_id.insert(id, stored.clone());
        memory.events.push(event);
        drop(memory);
        self.announce();
        Ok(Created::New(stored))
    }

    async fn get(&self, approval_id: &str) -> Result<Option<Versioned>, StoreError> {
        Ok(self.lock().by_id.get(approval_id).cloned())
    }

    async fn update(
        &self,
        expected: u64,
        request: ApprovalRequest,
        event: Option<Event>,
    ) -> Result<Versioned, StoreError> {
        debug_assert!(
            event
                .as_ref()
                .is_none_or(|e| e.approval_id() == request.approval_id)
        );
        let mut memory = self.lock();
        let Some(current) = memory.by_id.get_mut(&request.approval_id) else {
            return Err(StoreError::Missing {
                approval_id: request.approval_id,
            });
        };
        if current.version != expected {
            return Err(StoreError::Conflict {
                approval_id: request.approval_id,
                expected,
                actual: current.version,
            });
        }
        // The identity, the idempotency key and the creation time never change after
        // creation, so the secondary maps stay valid.
        debug_assert_eq!(current.request.requester, request.requester);
        debug_assert_eq!(current.request.idempotency_key, request.idempotency_key);
        debug_assert_eq!(current.request.created_at, request.created_at);
        if event.is_none() && current.request.state != request.state {
            return Err(StoreError::Unrecorded {
                approval_id: request.approval_id,
                from: current.request.state,
                to: request.state,
            });
        }
        *current = Versioned {
            version: expected + 1,
            request,
        };
        let updated = current.clone();
        if let Some(event) = event {
            memory.events.push(event);
            drop(memory);
            self.announce();
        }
        Ok(updated)
    }

    async fn pending_expired(
        &self,
        now: SystemTime,
        limit: usize,
    ) -> Result<Vec<Versioned>, StoreError> {
        let memory = self.lock();
        let mut due: Vec<Versioned> = memory
            .by_id
            .values()
            .filter(|v| v.request.state == State::Pending && v.request.expires_at <= now)
            .cloned()
            .collect();
        due.sort_by(|a, b| {
            (a.request.expires_at, &a.request.approval_id)
                .cmp(&(b.request.expires_at, &b.request.approval_id))
        });
        due.truncate(limit);
        Ok(due)
    }

    async fn events(&self, query: &EventQuery) -> Result<Vec<StoredEvent>, StoreError> {
        let memory = self.lock();
        let skip = usize::try_from(query.after).unwrap_or(usize::MAX);
        Ok(memory
            .events
            .iter()
            .enumerate()
            .skip(skip)
            .filter(|(_, e)| {
                let cloud = e.cloud();
                query.matches(&cloud.tenant_id, e.filed_by(), &cloud.correlation_id)
            })
            .take(query.limit)
            .map(|(i, e)| StoredEvent {
                position: i as u64 + 1,
                event: e.cloud().clone(),
            })
            .collect())
    }

    async fn event_position(
        &self,
        event_id: &str,
        viewer: &Viewer,
    ) -> Result<Option<u64>, StoreError> {
        let memory = self.lock();
        Ok(memory
            .events
            .iter()
            .position(|e| e.cloud().id == event_id)
            .filter(|&i| {
                let e = &memory.events[i];
                e.cloud().tenant_id == viewer.tenant || e.filed_by() == viewer.principal
            })
            .map(|i| i as u64 + 1))
    }

    fn subscribe(&self) -> watch::Receiver<u64> {
        self.committed.subscribe()
    }

    async fn list(&self, query: &ListQuery) -> Result<Vec<Versioned>, StoreError> {
        let memory = self.lock();
        let start = match &query.after {
            // Excluded: the cursor is the last request already listed.
            Some(c) => std::ops::Bound::Excluded(order_key(c.created_at, &c.approval_id)),
            None => std::ops::Bound::Unbounded,
        };
        Ok(memory
            .order
            .range((start, std::ops::Bound::Unbounded))
            .filter_map(|(_, id)| memory.by_id.get(id))
            .filter(|stored| query.matches(&stored.request))
            .take(query.limit)
            .cloned()
            .collect())
    }
}
