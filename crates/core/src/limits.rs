//! Limits: depth, width with overflow, rounds and budget, and the no-progress detector.
//!
//! Everything here is pure bookkeeping over validated [`model::Limits`]; the supervisor
//! decides what a [`LimitError`] does to the run (refuse a Delegate call, stop
//! delegating and publish a provisional report, end the run as BUDGET_EXHAUSTED or
//! NO_PROGRESS). Every error says which limit was hit and what to change.

use std::collections::BTreeSet;

use convene_proto::v1;
use sha2::{Digest, Sha256};

use crate::model::{self, Overflow};

/// A limit was hit.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum LimitError {
    /// A delegation would nest deeper than `max_depth`.
    #[error(
        "delegation depth {depth} exceeds max_depth {max}: handle this task yourself instead \
         of delegating"
    )]
    DepthExceeded {
        /// Depth the new delegation would have.
        depth: u32,
        /// The run's `max_depth`.
        max: u32,
    },
    /// A batch is wider than `max_parallel_workers` and overflow is REJECT.
    #[error(
        "a batch of {count} delegations exceeds max_parallel_workers {max} and overflow is \
         REJECT: send at most {max} at once, or choose overflow QUEUE or TRUNCATE"
    )]
    WidthRejected {
        /// Delegations in the batch.
        count: usize,
        /// The run's `max_parallel_workers`.
        max: u32,
    },
    /// A budget of the run is used up.
    #[error(
        "{which} exhausted: {used} used of {limit}; stop delegating and report what you \
         have, or raise {which}"
    )]
    Budget {
        /// The exhausted limit: `max_tool_calls`, `max_tokens` or `max_cost`.
        which: &'static str,
        /// Its value.
        limit: String,
        /// What has been used.
        used: String,
    },
    /// Every allowed planning round has been started.
    #[error(
        "max_rounds {max} reached: no further round may start; report what you have, or \
         raise max_rounds"
    )]
    Rounds {
        /// The run's `max_rounds`.
        max: u32,
    },
    /// A delegation would return to a profile already on its path with the same goal
    /// (A → B → A): a loop, whatever the depth.
    #[error(
        "delegating to {profile} with this goal would loop: {path} already holds {profile} \
         with the same goal; handle this task yourself or give the child a different goal"
    )]
    Loop {
        /// The profile the child would run.
        profile: String,
        /// The chain of profiles from the top-level delegation to the caller, `A → B`.
        path: String,
    },
    /// A limit that must be positive is zero (validated limits never are).
    #[error("{which} must be at least 1, got 0")]
    Zero {
        /// The limit, e.g. `max_parallel_workers`.
        which: &'static str,
    },
}

/// Refuses a delegation at `depth` (top level is 1) deeper than `max_depth`.
pub fn check_depth(depth: u32, max_depth: u32) -> Result<(), LimitError> {
    if depth > max_depth {
        return Err(LimitError::DepthExceeded {
            depth,
            max: max_depth,
        });
    }
    Ok(())
}

/// The hash a goal is compared by in [`check_loop`]: SHA-256 of its words, lowercased
/// and joined by single spaces, so layout and case do not hide a repeated goal.
pub fn goal_hash(goal: &str) -> [u8; 32] {
    let normalized = goal
        .split_whitespace()
        .map(str::to_lowercase)
        .collect::<Vec<_>>()
        .join(" ");
    Sha256::digest(normalized.as_bytes()).into()
}

/// Refuses a child running `profile` with `goal` when a delegation on its `path` (the
/// chain of `(profile, goal)` from the top-level delegation to the caller, in order)
/// already runs that profile with the same goal: A → B → A loops, whatever the depth.
pub fn check_loop<'a>(
    path: &[(&'a str, &'a str)],
    profile: &str,
    goal: &str,
) -> Result<(), LimitError> {
    let hash = goal_hash(goal);
    if path
        .iter()
        .any(|(p, g)| *p == profile && goal_hash(g) == hash)
    {
        let mut chain: Vec<&str> = path.iter().map(|(p, _)| *p).collect();
        chain.dedup();
        return Err(LimitError::Loop {
            profile: profile.to_owned(),
            path: chain.join(" → "),
        });
    }
    Ok(())
}

/// How a batch of delegations runs under the width limit: indices into the batch, in
/// order.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct BatchPlan {
    /// Waves run one after another; each holds at most `max_parallel` indices.
    pub waves: Vec<Vec<usize>>,
    /// Indices that never run (TRUNCATE), to be recorded as dropped.
    pub dropped: Vec<usize>,
}

/// Plans a batch of `count` delegations under `max_parallel` and the overflow policy:
/// QUEUE runs all of them in waves of at most `max_parallel`; TRUNCATE runs the first
/// `max_parallel` and drops the rest; REJECT refuses a batch wider than `max_parallel`.
/// A batch that fits is one wave under every policy; an empty batch is an empty plan.
pub fn plan_batch(
    count: usize,
    max_parallel: u32,
    overflow: Overflow,
) -> Result<BatchPlan, LimitError> {
    if max_parallel == 0 {
        return Err(LimitError::Zero {
            which: "max_parallel_workers",
        });
    }
    // A width beyond the address space is no limit at all.
    let width = usize::try_from(max_parallel).unwrap_or(usize::MAX);
    let all: Vec<usize> = (0..count).collect();
    if count <= width {
        let waves = if all.is_empty() {
            Vec::new()
        } else {
            vec![all]
        };
        return Ok(BatchPlan {
            waves,
            dropped: Vec::new(),
        });
    }
    match overflow {
        Overflow::Queue => Ok(BatchPlan {
            waves: all.chunks(width).map(<[usize]>::to_vec).collect(),
            dropped: Vec::new(),
        }),
        Overflow::Truncate => {
            let (kept, dropped) = all.split_at(width);
            Ok(BatchPlan {
                waves: vec![kept.to_vec()],
                dropped: dropped.to_vec(),
            })
        }
        Overflow::Reject => Err(LimitError::WidthRejected {
            count,
            max: max_parallel,
        }),
    }
}

/// What a run has spent so far.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Spent {
    /// Tool calls.
    pub tool_calls: u64,
    /// Model tokens.
    pub tokens: u64,
    /// Cost.
    pub cost: f64,
}

/// The run's budget and round counter: charged with each result's usage, and the source
/// of the sub-budget each new delegation gets.
#[derive(Debug, Clone, PartialEq)]
pub struct BudgetLedger {
    limit: model::Budget,
    max_rounds: u32,
    spent: Spent,
    rounds: u32,
}

impl BudgetLedger {
    /// A fresh ledger for a run under `limits`.
    pub fn new(limits: &model::Limits) -> Self {
        Self {
            limit: limits.budget(),
            max_rounds: limits.max_rounds,
            spent: Spent::default(),
            rounds: 0,
        }
    }

    /// Adds `usage` to what was spent (it was spent whatever the limits say), then
    /// reports the first exhausted budget, in the order `max_tool_calls`, `max_tokens`,
    /// `max_cost`. A budget is exhausted once nothing of it remains, so a run that used
    /// exactly its budget may not delegate again.
    ///
    /// A negative or NaN cost counts as zero: a report can never refund the budget.
    pub fn charge(&mut self, usage: &v1::Usage) -> Result<(), LimitError> {
        self.spent.tool_calls = self
            .spent
            .tool_calls
            .saturating_add(u64::from(usage.tool_calls));
        self.spent.tokens = self.spent.tokens.saturating_add(usage.tokens);
        self.spent.cost += usage.cost.max(0.0);
        self.check()
    }

    /// The first exhausted budget, if any (see [`Self::charge`]).
    pub fn check(&self) -> Result<(), LimitError> {
        if let Some(max) = self.limit.max_tool_calls
            && self.spent.tool_calls >= u64::from(max)
        {
            return Err(exhausted("max_tool_calls", max, self.spent.tool_calls));
        }
        if let Some(max) = self.limit.max_tokens
            && self.spent.tokens >= max
        {
            return Err(exhausted("max_tokens", max, self.spent.tokens));
        }
        if let Some(max) = self.limit.max_cost
            && self.spent.cost >= max
        {
            return Err(exhausted("max_cost", max, self.spent.cost));
        }
        Ok(())
    }

    /// What has been spent.
    pub fn spent(&self) -> Spent {
        self.spent
    }

    /// What remains of each limited budget (`None`: no limit of this kind). An exhausted
    /// kind is `Some(0)`; check [`Self::check`] before dispatching, because 0 on the
    /// wire means "no limit".
    pub fn remaining(&self) -> model::Budget {
        model::Budget {
            max_tool_calls: self.limit.max_tool_calls.map(|max| {
                u32::try_from(u64::from(max).saturating_sub(self.spent.tool_calls)).unwrap_or(max)
            }),
            max_tokens: self
                .limit
                .max_tokens
                .map(|max| max.saturating_sub(self.spent.tokens)),
            max_cost: self
                .limit
                .max_cost
                .map(|max| (max - self.spent.cost).max(0.0)),
        }
    }

    /// The budget to hand a delegation that asked for `asked`: per kind, the smaller of
    /// the ask and the remainder, so a delegation never gets more than is left; an
    /// unlimited ask gets the remainder.
    pub fn budget_for(&self, asked: &model::Budget) -> model::Budget {
        let left = self.remaining();
        model::Budget {
            max_tool_calls: narrower(asked.max_tool_calls, left.max_tool_calls, Ord::min),
            max_tokens: narrower(asked.max_tokens, left.max_tokens, Ord::min),
            max_cost: narrower(asked.max_cost, left.max_cost, f64::min),
        }
    }

    /// The wire budget a delegation is dispatched with: [`Self::budget_for`] its own
    /// (`asked`, where 0 means "no limit"), or None when neither limits anything.
    pub fn dispatch_budget(&self, asked: Option<&v1::Budget>) -> Option<v1::Budget> {
        let nonzero_u32 = |v: u32| (v > 0).then_some(v);
        let asked = asked.map_or_else(model::Budget::default, |b| model::Budget {
            max_tool_calls: nonzero_u32(b.max_tool_calls),
            max_tokens: (b.max_tokens > 0).then_some(b.max_tokens),
            max_cost: (b.max_cost > 0.0).then_some(b.max_cost),
        });
        let given = self.budget_for(&asked);
        if given == model::Budget::default() {
            return None;
        }
        Some(v1::Budget {
            // An exhausted kind would read as "no limit" on the wire; the ledger's check
            // stops dispatching before that, and 1 is the least a dispatch can be given.
            max_tool_calls: given.max_tool_calls.map_or(0, |v| v.max(1)),
            max_tokens: given.max_tokens.map_or(0, |v| v.max(1)),
            max_cost: given.max_cost.map_or(0.0, |v| v.max(f64::MIN_POSITIVE)),
        })
    }

    /// Starts the next planning round and returns its 0-based index (the static plan is
    /// round 0), or refuses once `max_rounds` rounds have started.
    pub fn start_round(&mut self) -> Result<u32, LimitError> {
        if self.rounds >= self.max_rounds {
            return Err(LimitError::Rounds {
                max: self.max_rounds,
            });
        }
        let round = self.rounds;
        self.rounds += 1;
        Ok(round)
    }

    /// Rounds started so far.
    pub fn rounds_started(&self) -> u32 {
        self.rounds
    }
}

fn exhausted(which: &'static str, limit: impl ToString, used: impl ToString) -> LimitError {
    LimitError::Budget {
        which,
        limit: limit.to_string(),
        used: used.to_string(),
    }
}

/// The tighter of two optional limits (`None` is unlimited).
fn narrower<T>(a: Option<T>, b: Option<T>, min: impl Fn(T, T) -> T) -> Option<T> {
    match (a, b) {
        (Some(a), Some(b)) => Some(min(a, b)),
        (a, b) => a.or(b),
    }
}

/// SHA-256 over the *sets* of completed delegation ids, artifact hashes and claim ids.
///
/// Each set is sorted and deduplicated, so neither order nor repetition changes the
/// hash; each set and each element is length-prefixed under a versioned domain tag, so
/// no element can move between sets or merge with a neighbour without changing it
/// (`({"a"}, {""})` and `({""}, {"a"})` differ).
pub fn progress_hash<A, B, C>(
    completed_delegation_ids: A,
    artifact_hashes: B,
    claim_ids: C,
) -> [u8; 32]
where
    A: IntoIterator,
    A::Item: AsRef<str>,
    B: IntoIterator,
    B::Item: AsRef<str>,
    C: IntoIterator,
    C::Item: AsRef<str>,
{
    let mut h = Sha256::new();
    h.update(b"convene.progress.v1\0");
    hash_set(&mut h, completed_delegation_ids);
    hash_set(&mut h, artifact_hashes);
    hash_set(&mut h, claim_ids);
    h.finalize().into()
}

fn hash_set<I>(h: &mut Sha256, items: I)
where
    I: IntoIterator,
    I::Item: AsRef<str>,
{
    let set: BTreeSet<String> = items.into_iter().map(|s| s.as_ref().to_owned()).collect();
    h.update((set.len() as u64).to_be_bytes());
    for item in &set {
        h.update((item.len() as u64).to_be_bytes());
        h.update(item.as_bytes());
    }
}

/// What one round's progress hash says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Progress {
    /// The first observation, or the hash changed.
    Progressed,
    /// The hash is unchanged, but not yet for `threshold` rounds.
    Stalled {
        /// Consecutive rounds without change so far.
        unchanged_rounds: u32,
    },
    /// The hash has been unchanged for `threshold` consecutive rounds: stop the run as
    /// NO_PROGRESS.
    NoProgress,
}

/// Watches progress hashes round by round.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProgressDetector {
    threshold: u32,
    last: Option<[u8; 32]>,
    unchanged: u32,
}

impl ProgressDetector {
    /// A detector reporting NO_PROGRESS after `threshold` unchanged rounds (at least 1:
    /// a threshold of 0 would stop every run on its first repeat).
    pub fn new(threshold: u32) -> Self {
        Self {
            threshold: threshold.max(1),
            last: None,
            unchanged: 0,
        }
    }

    /// A detector for the run's `no_progress_rounds`.
    pub fn from_limits(limits: &model::Limits) -> Self {
        Self::new(limits.no_progress_rounds)
    }

    /// Unchanged rounds that mean no progress.
    pub fn threshold(&self) -> u32 {
        self.threshold
    }

    /// Records one round's hash. A changed hash resets the count.
    pub fn observe(&mut self, hash: [u8; 32]) -> Progress {
        if self.last == Some(hash) {
            self.unchanged = self.unchanged.saturating_add(1);
            if self.unchanged >= self.threshold {
                Progress::NoProgress
            } else {
                Progress::Stalled {
                    unchanged_rounds: self.unchanged,
                }
            }
        } else {
            self.last = Some(hash);
            self.unchanged = 0;
            Progress::Progressed
        }
    }
}
