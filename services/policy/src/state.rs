//! What the policy service remembers between calls: call counters, revocations, and
//! which tenant each issued token and run belongs to.
//!
//! [`PolicyState`] is the seam for durable storage: [`MemoryState`] keeps everything in
//! concurrent maps for now, and a database-backed implementation can replace it without
//! touching the decision code. Every method is async and fallible so such an
//! implementation is honest about I/O; the in-memory one never fails and never awaits.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::SystemTime;

use async_trait::async_trait;
use dashmap::DashMap;

use crate::decision_log::{DecisionLog, LogEntry};

/// The state store cannot answer (only durable implementations can fail).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StateError {
    /// The backing store is unreachable or failed; retrying later may succeed.
    #[error("policy state is unavailable: {0}; retry later")]
    Unavailable(String),
}

/// Why a call could not be counted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CallError {
    /// The token's calls are used up; the call was not counted.
    #[error("all {max} authorized calls of the token are used")]
    LimitExceeded {
        /// Calls counted so far (equal to `max`).
        used: u32,
        /// The token's `max_calls`.
        max: u32,
    },
    /// The store failed.
    #[error(transparent)]
    State(#[from] StateError),
}

/// One call of a token to count.
#[derive(Debug, Clone, Copy)]
pub struct Call<'a> {
    /// The token's `jti`.
    pub token_id: &'a str,
    /// The token's run: a revoked run's tokens are not counted.
    pub run_id: &'a str,
    /// The token's lease epoch: a token of a fenced epoch is not counted.
    pub lease_epoch: u64,
    /// The token's `max_calls`.
    pub max_calls: u32,
    /// The token's expiry: its counter may be dropped after it.
    pub expires_at: SystemTime,
    /// The caller's clock.
    pub now: SystemTime,
}

/// How counting a call ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Counted {
    /// Counted; `used` includes this call.
    Allowed {
        /// Calls counted so far.
        used: u32,
    },
    /// The token's calls are used up; the call was not counted.
    LimitExceeded {
        /// Calls counted so far (equal to `max`).
        used: u32,
        /// The token's `max_calls`.
        max: u32,
    },
    /// The token or its run is revoked; the call was not counted.
    Revoked {
        /// The revocation that applies (the token's own first).
        revocation: Revocation,
        /// Calls counted before.
        used: u32,
    },
}

/// The decision to log for a counted call, made from how the count ended. Owned, so a
/// write job of the database's writer task can make it.
pub type DecisionOf = Arc<dyn Fn(&Counted) -> LogEntry + Send + Sync>;

/// What a revocation names.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum RevokeTarget {
    /// One token, by its `jti`.
    Token(String),
    /// Every token of a run.
    Run(String),
    /// The tokens of a run issued under a lease epoch below `epoch`: a supervisor
    /// replica with that epoch took the run over (a lease fence, set by IssueTaskToken).
    Lease {
        /// The run.
        run_id: String,
        /// The run's current lease epoch.
        epoch: u64,
    },
}

impl RevokeTarget {
    /// What kind of thing is revoked (`token` or `run`) and its id, as the decision log
    /// and the revocations table name them.
    pub fn kind_and_id(&self) -> (&'static str, &str) {
        match self {
            RevokeTarget::Token(id) => ("token", id),
            RevokeTarget::Run(id) => ("run", id),
            RevokeTarget::Lease { run_id, .. } => ("lease", run_id),
        }
    }
}

impl fmt::Display for RevokeTarget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RevokeTarget::Token(id) => write!(f, "token {id}"),
            RevokeTarget::Run(id) => write!(f, "run {id}"),
            RevokeTarget::Lease { run_id, epoch } => {
                write!(f, "the lease epochs of run {run_id} below {epoch}")
            }
        }
    }
}

/// A recorded revocation that applies to a token.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Revocation {
    /// What was revoked: the token itself or its whole run.
    pub target: RevokeTarget,
    /// Why, as the revoker said.
    pub reason: String,
}

/// The revocation of tokens of `run_id` issued under lease epochs below `epoch`.
pub fn superseded(run_id: &str, epoch: u64) -> Revocation {
    Revocation {
        target: RevokeTarget::Lease {
            run_id: run_id.to_owned(),
            epoch,
        },
        reason: format!("a supervisor replica took the run over at lease epoch {epoch}"),
    }
}

/// A token the service issued, as far as revocation rights need it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IssuedToken {
    /// Its `jti`.
    pub token_id: String,
    /// Its run.
    pub run_id: String,
    /// Its tenant.
    pub tenant: String,
    /// When it expires; after that it can be forgotten.
    pub expires_at: SystemTime,
}

/// Counters, revocations and token ownership.
#[async_trait]
pub trait PolicyState: Send + Sync + fmt::Debug {
    /// Remembers the run and tenant of issued tokens (those of one request, recorded
    /// together), so a human of that tenant may revoke them (or their run) later.
    async fn record_issued(&self, tokens: &[IssuedToken]) -> Result<(), StateError>;

    /// Records `tokens` as [`record_issued`](Self::record_issued) does, unless a
    /// revocation of token `token_id` or of run `run_id`, or a lease fence of the run
    /// above `lease_epoch`, is recorded: then returns it and records nothing. Otherwise
    /// a `lease_epoch` above 1 (a replica that claimed the run) fences the lower ones
    /// ([`fence`](Self::fence)). A state in a database checks and records in one
    /// transaction, so no token is recorded after the revocation that should refuse it
    /// committed.
    async fn record_issued_unless_revoked(
        &self,
        tokens: &[IssuedToken],
        token_id: &str,
        run_id: &str,
        lease_epoch: u64,
    ) -> Result<Option<Revocation>, StateError> {
        if let Some(revocation) = self.is_revoked(token_id, run_id, lease_epoch).await? {
            return Ok(Some(revocation));
        }
        if lease_epoch > 1 {
            self.fence(run_id, lease_epoch).await?;
        }
        self.record_issued(tokens).await?;
        Ok(None)
    }

    /// Fences run `run_id` at lease epoch `epoch`: its tokens of lower epochs are refused
    /// from now on. A fence never moves down.
    async fn fence(&self, run_id: &str, epoch: u64) -> Result<(), StateError>;

    /// The tenant a token or run belongs to, if a token of it was issued and has not
    /// been forgotten.
    async fn owner_tenant(&self, target: &RevokeTarget) -> Result<Option<String>, StateError>;

    /// Atomically counts one call of token `token_id` if fewer than `max_calls` were
    /// counted, returning the count including this call. `expires_at` is the token's
    /// expiry (the counter may be dropped after it) and `now` the caller's clock.
    async fn record_call(
        &self,
        token_id: &str,
        max_calls: u32,
        expires_at: SystemTime,
        now: SystemTime,
    ) -> Result<u32, CallError>;

    /// Calls counted so far for a token (0 when none).
    async fn calls_used(&self, token_id: &str) -> Result<u32, StateError>;

    /// Counts `call` as [`record_call`](Self::record_call) does, unless its token or run
    /// is revoked ([`Counted::Revoked`], not counted), and appends the decision `decision`
    /// makes of the result to `log`; returns once both are durable. A state kept in the
    /// same database as `log` checks, counts and logs in one transaction, so no call is
    /// counted after its revocation committed; any other checks, counts, then logs.
    async fn record_call_logged(
        &self,
        call: Call<'_>,
        log: &dyn DecisionLog,
        decision: DecisionOf,
    ) -> Result<Counted, crate::Error> {
        count_then_log(self, call, log, decision).await
    }

    /// Revokes one token. Revoking twice keeps the first reason.
    async fn revoke_token(&self, token_id: &str, reason: &str) -> Result<(), StateError>;

    /// Revokes every token of a run, including tokens issued for it later.
    async fn revoke_run(&self, run_id: &str, reason: &str) -> Result<(), StateError>;

    /// Revokes `target` as [`revoke_token`](Self::revoke_token) or
    /// [`revoke_run`](Self::revoke_run) does and appends `entry` to `log`; returns once
    /// both are durable. A state kept in the same database as `log` does both in one
    /// transaction; any other revokes first, then logs.
    async fn revoke_logged(
        &self,
        target: &RevokeTarget,
        reason: &str,
        log: &dyn DecisionLog,
        entry: LogEntry,
    ) -> Result<(), crate::Error> {
        revoke_then_log(self, target, reason, log, entry).await
    }

    /// [`revoke_logged`](Self::revoke_logged) for each of `revocations` (a target and
    /// its record); returns once all are durable. A state kept in the same database as
    /// `log` commits them all in one transaction; any other revokes and logs each in
    /// turn, stopping at the first failure.
    async fn revoke_all_logged(
        &self,
        revocations: &[(RevokeTarget, LogEntry)],
        reason: &str,
        log: &dyn DecisionLog,
    ) -> Result<(), crate::Error> {
        revoke_each_then_log(self, revocations, reason, log).await
    }

    /// Every revocation made at or after `since`, with its time (for verifiers elsewhere,
    /// through GetSigningKeys).
    async fn revoked_since(
        &self,
        since: SystemTime,
    ) -> Result<Vec<(RevokeTarget, SystemTime)>, StateError>;

    /// The revocation that applies to a token with this `jti`, run and lease epoch, if
    /// any (the token's own revocation first, then its run's, then a lease fence above
    /// its epoch).
    async fn is_revoked(
        &self,
        token_id: &str,
        run_id: &str,
        lease_epoch: u64,
    ) -> Result<Option<Revocation>, StateError>;
}

/// [`PolicyState::record_call_logged`] in steps: the revocation check, the count, then
/// the record.
pub(crate) async fn count_then_log<S: PolicyState + ?Sized>(
    state: &S,
    call: Call<'_>,
    log: &dyn DecisionLog,
    decision: DecisionOf,
) -> Result<Counted, crate::Error> {
    let counted = if let Some(revocation) = state
        .is_revoked(call.token_id, call.run_id, call.lease_epoch)
        .await?
    {
        Counted::Revoked {
            revocation,
            used: state.calls_used(call.token_id).await?,
        }
    } else {
        match state
            .record_call(call.token_id, call.max_calls, call.expires_at, call.now)
            .await
        {
            Ok(used) => Counted::Allowed { used },
            Err(CallError::LimitExceeded { used, max }) => Counted::LimitExceeded { used, max },
            Err(CallError::State(e)) => return Err(e.into()),
        }
    };
    log.append(decision(&counted)).await?;
    Ok(counted)
}

/// [`PolicyState::revoke_logged`] in two steps: the revocation, then the record.
pub(crate) async fn revoke_then_log<S: PolicyState + ?Sized>(
    state: &S,
    target: &RevokeTarget,
    reason: &str,
    log: &dyn DecisionLog,
    entry: LogEntry,
) -> Result<(), crate::Error> {
    match target {
        RevokeTarget::Token(id) => state.revoke_token(id, reason).await?,
        RevokeTarget::Run(id) => state.revoke_run(id, reason).await?,
        RevokeTarget::Lease { run_id, epoch } => state.fence(run_id, *epoch).await?,
    }
    log.append(entry).await?;
    Ok(())
}

/// [`PolicyState::revoke_all_logged`] one revocation at a time, each as
/// [`revoke_then_log`]; stops at the first failure.
pub(crate) async fn revoke_each_then_log<S: PolicyState + ?Sized>(
    state: &S,
    revocations: &[(RevokeTarget, LogEntry)],
    reason: &str,
    log: &dyn DecisionLog,
) -> Result<(), crate::Error> {
    for (target, entry) in revocations {
        revoke_then_log(state, target, reason, log, entry.clone()).await?;
    }
    Ok(())
}

/// Counters below this many entries are never pruned.
const MIN_PRUNE_THRESHOLD: usize = 4096;

#[derive(Debug)]
struct Counter {
    used: u32,
    expires_at: SystemTime,
}

#[derive(Debug)]
struct Owner {
    tenant: String,
    expires_at: SystemTime,
}

/// [`PolicyState`] in concurrent in-memory maps: lost at exit.
///
/// Counters are sharded maps keyed by token id, so concurrent calls of different tokens
/// do not contend and calls of one token are counted exactly. Counters and ownership
/// records of expired tokens are pruned once the maps double in size; revocations are
/// kept for the life of the process (a revoked run stays revoked).
#[derive(Debug)]
pub struct MemoryState {
    counters: DashMap<String, Counter>,
    token_owners: DashMap<String, Owner>,
    run_owners: DashMap<String, Owner>,
    /// Reasons and times of revocations.
    revoked_tokens: DashMap<String, (String, SystemTime)>,
    revoked_runs: DashMap<String, (String, SystemTime)>,
    /// Lease fences: each run's current epoch, and when it was set.
    fences: DashMap<String, (u64, SystemTime)>,
    prune_at: AtomicUsize,
    /// When revocations are made.
    clock: convene_core::time::Clock,
}

impl Default for MemoryState {
    fn default() -> Self {
        Self {
            counters: DashMap::new(),
            token_owners: DashMap::new(),
            run_owners: DashMap::new(),
            revoked_tokens: DashMap::new(),
            revoked_runs: DashMap::new(),
            fences: DashMap::new(),
            prune_at: AtomicUsize::new(MIN_PRUNE_THRESHOLD),
            clock: convene_core::time::Clock::system(),
        }
    }
}

impl MemoryState {
    /// An empty state.
    pub fn new() -> Self {
        Self::default()
    }

    /// An empty state that times its revocations by `clock`.
    pub fn with_clock(clock: convene_core::time::Clock) -> Self {
        Self {
            clock,
            ..Self::default()
        }
    }

    /// Drops counters and ownership records of tokens expired at `now`, once the counter
    /// map has grown past the threshold; then doubles the threshold.
    fn maybe_prune(&self, now: SystemTime) {
        let threshold = self.prune_at.load(Ordering::Relaxed);
        if self.counters.len() <= threshold {
            return;
        }
        self.counters.retain(|_, c| c.expires_at > now);
        self.token_owners.retain(|_, o| o.expires_at > now);
        self.run_owners.retain(|_, o| o.expires_at > now);
        let next = (self.counters.len() * 2).max(MIN_PRUNE_THRESHOLD);
        self.prune_at.store(next, Ordering::Relaxed);
    }
}

impl MemoryState {
    fn record_one(&self, token: &IssuedToken) {
        self.token_owners.insert(
            token.token_id.clone(),
            Owner {
                tenant: token.tenant.clone(),
                expires_at: token.expires_at,
            },
        );
        let mut run = self
            .run_owners
            .entry(token.run_id.clone())
            .or_insert_with(|| Owner {
                tenant: token.tenant.clone(),
                expires_at: token.expires_at,
            });
        // A run lives as long as its longest-lived token.
        run.expires_at = run.expires_at.max(token.expires_at);
    }
}

#[async_trait]
impl PolicyState for MemoryState {
    async fn record_issued(&self, tokens: &[IssuedToken]) -> Result<(), StateError> {
        for token in tokens {
            self.record_one(token);
        }
        Ok(())
    }

    async fn owner_tenant(&self, target: &RevokeTarget) -> Result<Option<String>, StateError> {
        let owner = match target {
            RevokeTarget::Token(id) => self.token_owners.get(id),
            RevokeTarget::Run(id) | RevokeTarget::Lease { run_id: id, .. } => {
                self.run_owners.get(id)
            }
        };
        Ok(owner.map(|o| o.tenant.clone()))
    }

    async fn record_call(
        &self,
        token_id: &str,
        max_calls: u32,
        expires_at: SystemTime,
        now: SystemTime,
    ) -> Result<u32, CallError> {
        let (outcome, inserted) = {
            // The entry guard holds the shard's lock, which makes check-and-increment
            // atomic for this token; it is released before pruning touches other shards.
            let mut inserted = false;
            let mut counter = self.counters.entry(token_id.to_owned()).or_insert_with(|| {
                inserted = true;
                Counter {
                    used: 0,
                    expires_at,
                }
            });
            let outcome = if counter.used < max_calls {
                counter.used += 1;
                Ok(counter.used)
            } else {
                Err(CallError::LimitExceeded {
                    used: counter.used,
                    max: max_calls,
                })
            };
            (outcome, inserted)
        };
        if inserted {
            self.maybe_prune(now);
        }
        outcome
    }

    async fn calls_used(&self, token_id: &str) -> Result<u32, StateError> {
        Ok(self.counters.get(token_id).map_or(0, |c| c.used))
    }

    async fn revoke_token(&self, token_id: &str, reason: &str) -> Result<(), StateError> {
        self.revoked_tokens
            .entry(token_id.to_owned())
            .or_insert_with(|| (reason.to_owned(), self.clock.now()));
        Ok(())
    }

    async fn revoke_run(&self, run_id: &str, reason: &str) -> Result<(), StateError> {
        self.revoked_runs
            .entry(run_id.to_owned())
            .or_insert_with(|| (reason.to_owned(), self.clock.now()));
        Ok(())
    }

    async fn fence(&self, run_id: &str, epoch: u64) -> Result<(), StateError> {
        let now = self.clock.now();
        let mut fence = self.fences.entry(run_id.to_owned()).or_insert((epoch, now));
        if fence.0 < epoch {
            *fence = (epoch, now);
        }
        Ok(())
    }

    async fn revoked_since(
        &self,
        since: SystemTime,
    ) -> Result<Vec<(RevokeTarget, SystemTime)>, StateError> {
        let tokens = self
            .revoked_tokens
            .iter()
            .filter(|e| e.value().1 >= since)
            .map(|e| (RevokeTarget::Token(e.key().clone()), e.value().1));
        let runs = self
            .revoked_runs
            .iter()
            .filter(|e| e.value().1 >= since)
            .map(|e| (RevokeTarget::Run(e.key().clone()), e.value().1));
        let fences = self
            .fences
            .iter()
            .filter(|e| e.value().1 >= since)
            .map(|e| {
                let target = RevokeTarget::Lease {
                    run_id: e.key().clone(),
                    epoch: e.value().0,
                };
                (target, e.value().1)
            });
        Ok(tokens.chain(runs).chain(fences).collect())
    }

    async fn is_revoked(
        &self,
        token_id: &str,
        run_id: &str,
        lease_epoch: u64,
    ) -> Result<Option<Revocation>, StateError> {
        if let Some(revoked) = self.revoked_tokens.get(token_id) {
            return Ok(Some(Revocation {
                target: RevokeTarget::Token(token_id.to_owned()),
                reason: revoked.0.clone(),
            }));
        }
        if let Some(revoked) = self.revoked_runs.get(run_id) {
            return Ok(Some(Revocation {
                target: RevokeTarget::Run(run_id.to_owned()),
                reason: revoked.0.clone(),
            }));
        }
        Ok(self
            .fences
            .get(run_id)
            .filter(|fence| fence.0 > lease_epoch)
            .map(|fence| superseded(run_id, fence.0)))
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use super::*;

    fn at(secs: u64) -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_secs(secs)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_calls_are_counted_exactly_up_to_the_limit() {
        let state = Arc::new(MemoryState::new());
        let tasks: Vec<_> = (0..64)
            .map(|_| {
                let state = state.clone();
                tokio::spawn(async move { state.record_call("t1", 40, at(100), at(1)).await })
            })
            .collect();
        let mut allowed = Vec::new();
        let mut refused = 0;
        for task in tasks {
            match task.await.unwrap() {
                Ok(n) => allowed.push(n),
                Err(CallError::LimitExceeded { used, max }) => {
                    assert_eq!((used, max), (40, 40));
                    refused += 1;
                }
                Err(e) => panic!("{e}"),
            }
        }
        allowed.sort_unstable();
        assert_eq!(allowed, (1..=40).collect::<Vec<_>>());
        assert_eq!(refused, 24);
        assert_eq!(state.calls_used("t1").await.unwrap(), 40);
        assert_eq!(state.calls_used("other").await.unwrap(), 0);
    }

    #[tokio::test]
    async fn revocation_by_token_wins_over_run_and_keeps_the_first_reason() {
        let state = MemoryState::new();
        assert_eq!(state.is_revoked("t1", "r1", 0).await.unwrap(), None);
        state.revoke_run("r1", "incident closed").await.unwrap();
        let r = state.is_revoked("t1", "r1", 0).await.unwrap().unwrap();
        assert_eq!(r.target, RevokeTarget::Run("r1".into()));
        state.revoke_token("t1", "leaked").await.unwrap();
        state.revoke_token("t1", "again").await.unwrap();
        let r = state.is_revoked("t1", "r1", 0).await.unwrap().unwrap();
        assert_eq!(r.target, RevokeTarget::Token("t1".into()));
        assert_eq!(r.reason, "leaked");
        assert_eq!(state.is_revoked("t2", "r2", 0).await.unwrap(), None);
    }

    #[tokio::test]
    async fn expired_counters_are_pruned_once_the_map_grows() {
        let state = MemoryState::new();
        for i in 0..MIN_PRUNE_THRESHOLD {
            state
                .record_call(&format!("old-{i}"), 1, at(10), at(1))
                .await
                .unwrap();
        }
        assert_eq!(state.counters.len(), MIN_PRUNE_THRESHOLD);
        // The next new token arrives after all the old ones expired.
        state.record_call("new", 1, at(100), at(50)).await.unwrap();
        assert_eq!(state.counters.len(), 1);
        assert_eq!(state.calls_used("new").await.unwrap(), 1);
    }

    #[tokio::test]
    async fn owners_are_known_for_issued_tokens_and_runs() {
        let state = MemoryState::new();
        state
            .record_issued(&[IssuedToken {
                token_id: "t1".into(),
                run_id: "r1".into(),
                tenant: "acme".into(),
                expires_at: at(100),
            }])
            .await
            .unwrap();
        let state = &state;
        let tenant = |t| async move { state.owner_tenant(&t).await.unwrap() };
        assert_eq!(
            tenant(RevokeTarget::Token("t1".into())).await.as_deref(),
            Some("acme")
        );
        assert_eq!(
            tenant(RevokeTarget::Run("r1".into())).await.as_deref(),
            Some("acme")
        );
        assert_eq!(tenant(RevokeTarget::Run("r2".into())).await, None);
    }
}
