//! Validated domain types. Built from wire messages by [`crate::validate`]; everything
//! here already satisfies the contracts' rules, so the logic working on it does not
//! re-check them.

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime};

use crate::permissions::{Permission, PermissionSet, TimeWindow};

/// When the join may decide (`JoinStrategy` on the wire).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum JoinStrategy {
    /// Wait for every expected delegation (or the deadline).
    All,
    /// Decide once the required delegations are in and the minimum is met.
    Quorum,
    /// Wait for every expected delegation; at the deadline decide on what is there.
    TimeoutPartial,
    /// Decide on the first valid result (ties broken by plan order).
    FirstValid,
}

/// What the deadline does to an undecided join.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum OnTimeout {
    /// Decide on what has arrived.
    #[default]
    EmitPartial,
    /// Decide INSUFFICIENT_EVIDENCE unless everything is in.
    Fail,
}

/// How conflicts are handled (they are never dropped).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum OnConflict {
    /// Keep both claims and escalate to a human.
    #[default]
    PreserveAndEscalate,
    /// Keep both claims, propose a follow-up query, then escalate.
    FollowUp,
}

/// What a result arriving after the decision does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum LateResultPolicy {
    /// Record it; the decision stays.
    #[default]
    Discard,
    /// Compute a new revision including it; the run is not reopened.
    AppendRevision,
}

/// The evidence threshold of a join.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct JoinMinimum {
    /// Accepted results needed (at least 1).
    pub count: u32,
    /// Sum of accepted delegations' weights needed (0: no weight threshold).
    pub weight: f64,
    /// Evidence kinds accepted claims must cite between them.
    pub required_evidence_kinds: Vec<String>,
}

/// A validated join contract. References in `required`/`optional`/`weights` name a
/// delegation (by plan name) or a profile (by id); `required_profiles` names profiles
/// only. A planner's run names profiles only: its delegations are named by the planner,
/// so `required`, `optional` and `weights` are empty there.
#[derive(Debug, Clone, PartialEq)]
pub struct JoinContract {
    /// Contract name.
    pub join_id: String,
    /// References whose delegations must be accepted.
    pub required: Vec<String>,
    /// References that are waited for but not required.
    pub optional: Vec<String>,
    /// When the join may decide.
    pub strategy: JoinStrategy,
    /// The evidence threshold.
    pub minimum: JoinMinimum,
    /// Absolute deadline, if any.
    pub deadline: Option<SystemTime>,
    /// What the deadline does.
    pub on_timeout: OnTimeout,
    /// How conflicts are handled.
    pub on_conflict: OnConflict,
    /// What late results do.
    pub late_result: LateResultPolicy,
    /// Weight per reference; default 1.
    pub weights: BTreeMap<String, f64>,
    /// Profiles (by id) of which at least one delegation must be accepted. Unlike a
    /// profile in `required`, which makes every delegation of it required, one accepted
    /// delegation of the profile meets it (a follow-up may stand in for a rejected
    /// first attempt).
    pub required_profiles: Vec<String>,
}

/// What happens to delegations beyond the width limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Overflow {
    /// Run the rest in waves.
    #[default]
    Queue,
    /// Drop the rest and record which.
    Truncate,
    /// Refuse the batch.
    Reject,
}

/// Validated run limits with defaults applied.
#[derive(Debug, Clone, PartialEq)]
pub struct Limits {
    /// Maximum delegation depth (top level is 1). Default 3.
    pub max_depth: u32,
    /// Maximum delegations running at once per batch. Default 4.
    pub max_parallel_workers: u32,
    /// Overflow behaviour. Default QUEUE.
    pub overflow: Overflow,
    /// Agent-loop iterations per worker. Default 12.
    pub max_iterations: u32,
    /// Planning rounds. Default 1 for a static plan, 4 for a planner's run.
    pub max_rounds: u32,
    /// Re-dispatches of one delegation after transient failures. Default 2.
    pub max_redelegations: u32,
    /// Absolute deadline of the run.
    pub deadline: SystemTime,
    /// Tool calls across the run (None: unlimited).
    pub max_tool_calls: Option<u32>,
    /// Model tokens across the run (None: unlimited).
    pub max_tokens: Option<u64>,
    /// Cost across the run (None: unlimited).
    pub max_cost: Option<f64>,
    /// Rounds without progress before NO_PROGRESS. Default 2.
    pub no_progress_rounds: u32,
}

impl Limits {
    /// Default maximum depth.
    pub const DEFAULT_MAX_DEPTH: u32 = 3;
    /// Default width.
    pub const DEFAULT_MAX_PARALLEL_WORKERS: u32 = 4;
    /// Default iterations per worker.
    pub const DEFAULT_MAX_ITERATIONS: u32 = 12;
    /// Default rounds for a static plan.
    pub const DEFAULT_MAX_ROUNDS: u32 = 1;
    /// Default rounds for a planner's run: enough for a first fan-out, follow-ups on what
    /// it found, and a last check, without letting a planner loop unbounded.
    pub const DEFAULT_PLANNER_MAX_ROUNDS: u32 = 4;
    /// Default re-dispatches per delegation.
    pub const DEFAULT_MAX_REDELEGATIONS: u32 = 2;
    /// Default run timeout.
    pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(600);
    /// Default no-progress rounds.
    pub const DEFAULT_NO_PROGRESS_ROUNDS: u32 = 2;

    /// Largest accepted `max_depth`. Every level multiplies the fan-out, so deeper trees
    /// are almost always a planning loop rather than real work.
    pub const MAX_DEPTH_CAP: u32 = 16;
    /// Largest accepted `max_parallel_workers`; beyond it a batch is a flood, not a plan.
    pub const MAX_PARALLEL_WORKERS_CAP: u32 = 1024;
    /// Largest accepted `max_iterations` per worker: an agent loop that needs more is
    /// not converging.
    pub const MAX_ITERATIONS_CAP: u32 = 1000;
    /// Largest accepted `max_rounds`, for the same reason at the run's level.
    pub const MAX_ROUNDS_CAP: u32 = 1000;
    /// Largest accepted `max_redelegations`: retries of a transient failure beyond this
    /// only add load to whatever is failing.
    pub const MAX_REDELEGATIONS_CAP: u32 = 16;
    /// Largest accepted `no_progress_rounds` (more is never reached under
    /// [`Self::MAX_ROUNDS_CAP`]).
    pub const MAX_NO_PROGRESS_ROUNDS_CAP: u32 = 1000;

    /// The budget part of the limits (tool calls, tokens, cost).
    pub fn budget(&self) -> Budget {
        Budget {
            max_tool_calls: self.max_tool_calls,
            max_tokens: self.max_tokens,
            max_cost: self.max_cost,
        }
    }

    /// Defaults everywhere (those of a static plan), with the deadline
    /// [`Self::DEFAULT_TIMEOUT`] after `run_start`.
    pub fn defaults(run_start: SystemTime) -> Self {
        Self {
            max_depth: Self::DEFAULT_MAX_DEPTH,
            max_parallel_workers: Self::DEFAULT_MAX_PARALLEL_WORKERS,
            overflow: Overflow::default(),
            max_iterations: Self::DEFAULT_MAX_ITERATIONS,
            max_rounds: Self::DEFAULT_MAX_ROUNDS,
            max_redelegations: Self::DEFAULT_MAX_REDELEGATIONS,
            deadline: run_start + Self::DEFAULT_TIMEOUT,
            max_tool_calls: None,
            max_tokens: None,
            max_cost: None,
            no_progress_rounds: Self::DEFAULT_NO_PROGRESS_ROUNDS,
        }
    }
}

/// Structured task scope: resource selectors and a time window.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct TaskScope {
    /// Resource selectors (exact or `*`-suffixed prefixes); empty: no restriction.
    pub resources: Vec<String>,
    /// Time window.
    pub time_range: TimeWindow,
}

/// Budget of a delegation or run (None: no limit of this kind).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Budget {
    /// Tool calls.
    pub max_tool_calls: Option<u32>,
    /// Model tokens.
    pub max_tokens: Option<u64>,
    /// Cost.
    pub max_cost: Option<f64>,
}

/// One validated entry of a static plan (or of a nested Delegate call).
#[derive(Debug, Clone, PartialEq)]
pub struct PlannedTask {
    /// Unique name within the plan.
    pub name: String,
    /// Profile that handles it.
    pub profile_id: String,
    /// What to find out.
    pub goal: String,
    /// What a complete answer contains.
    pub acceptance_criteria: Vec<String>,
    /// Resource selectors and time window.
    pub scope: TaskScope,
    /// Input artifact URIs.
    pub input_refs: Vec<String>,
    /// Tools asked for (`name@version`); empty: the profile's defaults.
    pub allowed_tools: Vec<String>,
    /// Permissions the task needs.
    pub required_scopes: Vec<Permission>,
    /// Time the worker has from dispatch.
    pub timeout: Option<Duration>,
    /// What it may spend.
    pub budget: Budget,
    /// Whether it may delegate further.
    pub may_redelegate: bool,
}

/// A model-driven plan: the planner profile's model proposes the run's delegations over
/// rounds, instead of a static plan.
#[derive(Debug, Clone, PartialEq)]
pub struct Planner {
    /// Worker profile that plans (its model proposes the delegations).
    pub profile_id: String,
    /// Extra instructions for the planner, trimmed (empty: none).
    pub instructions: String,
}

/// A validated run spec: either a static plan (`plan`, with `planner` None) or a
/// planner (`planner`, with `plan` empty).
#[derive(Debug, Clone, PartialEq)]
pub struct RunSpec {
    /// What the run must establish.
    pub goal: String,
    /// Idempotency key (None: none).
    pub idempotency_key: Option<String>,
    /// The static plan, in order; empty for a planner's run.
    pub plan: Vec<PlannedTask>,
    /// The model-driven plan (None: the run follows the static `plan`).
    pub planner: Option<Planner>,
    /// The join contract, with its deadline resolved.
    pub join: JoinContract,
    /// Limits with defaults applied and the deadline resolved.
    pub limits: Limits,
    /// Labels.
    pub labels: BTreeMap<String, String>,
}

/// A validated worker profile: a kind of specialist, the tools and scopes it may ever
/// hold, and the evidence it may cite.
#[derive(Debug, Clone, PartialEq)]
pub struct WorkerProfile {
    /// Stable id, e.g. `logs-investigator`.
    pub id: String,
    /// Display name (the id when none was given).
    pub name: String,
    /// Version, reported in results as `id@version`.
    pub version: String,
    /// What the profile is for.
    pub description: String,
    /// Instructions given to the profile's model.
    pub instructions: String,
    /// Tools it may use (`name@version`); a token can only narrow them.
    pub default_tools: Vec<String>,
    /// Model name for its provider (empty for providers without models).
    pub model: String,
    /// Model provider, e.g. `playbook`.
    pub provider: String,
    /// Agent-loop iteration limit. Default 12.
    pub max_iterations: u32,
    /// Model token limit per task. Default 8192.
    pub max_tokens: u32,
    /// Sampling temperature in `0..=2`. Default 0.4.
    pub temperature: f64,
    /// Scopes this profile may ever hold.
    pub capabilities: PermissionSet,
    /// Evidence URI prefixes its claims may cite, e.g. `logs://`.
    pub evidence_prefixes: Vec<String>,
    /// Whether a delegation to it completes without awaiting external input.
    pub supports_parallel_completion: bool,
}

impl WorkerProfile {
    /// Default agent-loop iterations.
    pub const DEFAULT_MAX_ITERATIONS: u32 = 12;
    /// Default model tokens per task.
    pub const DEFAULT_MAX_TOKENS: u32 = 8192;
    /// Default sampling temperature.
    pub const DEFAULT_TEMPERATURE: f64 = 0.4;
    /// Highest accepted sampling temperature.
    pub const MAX_TEMPERATURE: f64 = 2.0;

    /// `id@version`, the form results report the profile in.
    pub fn reference(&self) -> String {
        format!("{}@{}", self.id, self.version)
    }

    /// Whether `evidence_ref` lies inside one of the profile's evidence prefixes.
    pub fn allows_evidence(&self, evidence_ref: &str) -> bool {
        self.evidence_prefixes
            .iter()
            .any(|p| evidence_ref.starts_with(p.as_str()))
    }
}
