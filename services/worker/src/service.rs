//! [`WorkerService`]: the `convene.v1.Worker` service, and so its own in-process handle.
//!
//! Execute is idempotent per delegation id while the worker is alive: a second Execute
//! for a running delegation joins it (the task runs once, in its own Tokio task, and
//! every caller awaits the same shared future), and one for a finished delegation gets
//! the cached result (the cache is bounded; the oldest results go first). A retry with
//! a higher attempt number runs the delegation again only when the cached result
//! invites it: FAILED with `retryable` or `cancelled`, or TIMED_OUT.
//!
//! Cancel ends a running delegation promptly: its Execute returns a FAILED result with
//! error code `cancelled` and whatever evidence was gathered, rather than a gRPC error,
//! so the supervisor's ledger records how the delegation ended like any other result.
//!
//! Capacity counts running delegations; one more is refused with RESOURCE_EXHAUSTED
//! ("worker busy") so the supervisor dispatches it elsewhere. Joining a running
//! delegation does not count.
//!
//! PlanTurn asks a planner profile's model for one turn of a run's planner
//! ([`crate::planner`]). It keeps no state and takes no capacity slot: it is one short
//! model call.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};

use convene_core::recent::RecentMap;
use convene_core::validate;
use convene_mesh::handles::{EvidenceHandle, PolicyHandle, SupervisorHandle};
use convene_proto::v1::{self, worker_server};
use convene_server::{ErrorCode, GrpcServer, ServiceError, into_status, invalid_field};
use futures::FutureExt as _;
use futures::future::{BoxFuture, Shared};
use tonic::{Request, Response, Status};
use tracing::Instrument as _;

use crate::agent::{Agent, Assignment, CancelSignal};
use crate::guard::{Binding, Guard};
use crate::profiles::{Profile, ProviderRegistry, ProviderSetupError};
use crate::tools::ToolRegistry;

/// Finished results kept for repeated Execute calls, at most.
pub const RESULT_CACHE: usize = 1024;

/// Encoded bytes of the finished results kept, at most.
pub const RESULT_CACHE_BYTES: usize = 16 * 1024 * 1024;

/// Records a delegation's result on its `worker.execute` span; a result that is not
/// COMPLETED or PARTIAL marks the span failed with the result's error code.
fn record_result(span: &tracing::Span, result: &v1::TaskResult) {
    if span.is_disabled() {
        return;
    }
    let status = v1::TaskStatus::try_from(result.status).unwrap_or_default();
    span.record(
        "convene.task.status",
        status.as_str_name().trim_start_matches("TASK_STATUS_"),
    );
    span.record("convene.task.claims", result.claims.len());
    span.record("convene.task.evidence", result.evidence.len());
    if !matches!(status, v1::TaskStatus::Completed | v1::TaskStatus::Partial) {
        if let Some(e) = &result.error {
            span.record("error.type", e.code.as_str());
        }
        convene_telemetry::set_error(span, result.summary.clone());
    }
}

/// Why the service cannot be built.
#[derive(Debug, thiserror::Error)]
pub enum SetupError {
    /// No profile to serve.
    #[error("the worker has no profile to serve; list at least one in the profiles file")]
    NoProfiles,
    /// A profile's provider is unknown or refuses it.
    #[error(transparent)]
    Provider(#[from] ProviderSetupError),
    /// A profile lists a tool the worker does not implement.
    #[error(
        "profile {profile} lists tool {tool}, which this worker does not implement (it has: \
         {known}); remove it from the profile's default_tools (an MCP tool, \
         mcp:<server>/<tool>@<version>, is there only when the worker's mcp configuration \
         names its server and the policy file's tool catalog declares it)"
    )]
    UnknownTool {
        /// The profile.
        profile: String,
        /// The tool.
        tool: String,
        /// The tools the worker has.
        known: String,
    },
    /// Capacity zero would refuse every delegation.
    #[error("capacity must be at least 1 (delegations run at once)")]
    ZeroCapacity,
}

/// Why Execute refuses a call (a result is always returned once a delegation runs).
#[derive(Debug, thiserror::Error)]
enum ExecuteError {
    #[error("this worker does not serve profile {profile}; it serves: {served}")]
    UnknownProfile { profile: String, served: String },
    #[error(
        "worker busy: {running} of {capacity} delegations running; dispatch to another worker \
         or retry later"
    )]
    Busy { running: usize, capacity: usize },
    #[error(
        "run {run_id} was taken over by another supervisor replica: this worker has seen its \
         lease epoch {seen}, and this dispatch comes under epoch {epoch}; the replica that \
         sent it no longer runs the run"
    )]
    Superseded {
        run_id: String,
        epoch: u64,
        seen: u64,
    },
    #[error(
        "the dispatch arrived {late:?} after the sending supervisor replica's lease on run \
         {run_id} may have run out (it was frozen or cut off past its lease); it is not run, \
         so that no two replicas run the delegation"
    )]
    LeaseLapsed {
        run_id: String,
        late: std::time::Duration,
    },
}

impl ServiceError for ExecuteError {
    fn code(&self) -> ErrorCode {
        match self {
            ExecuteError::UnknownProfile { .. } => ErrorCode::FailedPrecondition,
            ExecuteError::Busy { .. } => ErrorCode::ResourceExhausted,
            // A lost race with another replica: the sender may retry once it knows it
            // still holds the run (it does not, unless clocks drifted).
            ExecuteError::Superseded { .. } | ExecuteError::LeaseLapsed { .. } => {
                ErrorCode::Aborted
            }
        }
    }
}

/// A worker: serves its profiles' delegations.
#[derive(Debug, Clone)]
pub struct WorkerService {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    worker_id: Arc<str>,
    /// Who may call, and which tokens hold.
    guard: Guard,
    agents: BTreeMap<String, Agent>,
    capacity: usize,
    tasks: Mutex<Tasks>,
    /// The newest lease epoch each run's dispatches came under, for the most recent
    /// [`EPOCHS_KEPT`] runs.
    epochs: RecentMap<String, u64>,
}

type ResultFuture = Shared<BoxFuture<'static, v1::TaskResult>>;

#[derive(Debug, Default)]
struct Tasks {
    running: HashMap<String, Running>,
    done: ResultCache,
}

/// Runs whose lease epoch a worker remembers: a run it has not seen for this many others
/// is one whose replica changes it no longer hears about.
const EPOCHS_KEPT: usize = 16_384;

impl Tasks {
    /// Enters lease epoch `epoch` of `run_id`: refused when a newer one was seen; a newer
    /// one than before cancels the run's delegations running under older epochs (their
    /// replica lost the run: its successor dispatches them again).
    fn enter_epoch(
        &mut self,
        epochs: &RecentMap<String, u64>,
        run_id: &str,
        epoch: u64,
    ) -> Result<(), ExecuteError> {
        if epoch == 0 {
            return Ok(());
        }
        let seen = epochs.get_with(run_id, |e| *e).unwrap_or(0);
        if seen > epoch {
            return Err(ExecuteError::Superseded {
                run_id: run_id.to_owned(),
                epoch,
                seen,
            });
        }
        if seen < epoch {
            epochs.insert(run_id.to_owned(), epoch);
            for (id, running) in &self.running {
                if running.run_id == run_id && running.lease_epoch < epoch {
                    tracing::info!(
                        run_id,
                        delegation_id = %id,
                        lease_epoch = running.lease_epoch,
                        newer = epoch,
                        "cancelling a delegation of a replica that lost the run"
                    );
                    running.cancel.cancel(&format!(
                        "run {run_id} was taken over by another supervisor replica (lease \
                         epoch {epoch})"
                    ));
                }
            }
        }
        Ok(())
    }
}

/// Finished results by delegation id, bounded in entries ([`RESULT_CACHE`]) and in
/// encoded bytes ([`RESULT_CACHE_BYTES`]): a result carries whatever its model or
/// playbook wrote (summary, claims, actions), so a count alone would not bound it. The
/// oldest go first.
#[derive(Debug, Default)]
struct ResultCache {
    done: HashMap<String, Done>,
    /// Finished delegation ids, oldest first, for eviction.
    order: VecDeque<String>,
    /// Encoded size of the results held.
    bytes: usize,
}

impl ResultCache {
    fn get(&self, id: &str) -> Option<&Done> {
        self.done.get(id)
    }

    fn remove(&mut self, id: &str) {
        if let Some(gone) = self.done.remove(id) {
            self.bytes -= gone.size;
            self.order.retain(|d| d != id);
        }
    }

    /// Keeps `result`, then drops the oldest until both bounds hold (the newest result
    /// stays even when it alone is larger than the byte bound).
    fn insert(&mut self, id: &str, result: &v1::TaskResult, attempt: u32) {
        self.remove(id);
        let size = prost::Message::encoded_len(result);
        self.done.insert(
            id.to_owned(),
            Done {
                result: result.clone(),
                attempt,
                size,
            },
        );
        self.bytes += size;
        self.order.push_back(id.to_owned());
        while self.order.len() > 1
            && (self.order.len() > RESULT_CACHE || self.bytes > RESULT_CACHE_BYTES)
        {
            if let Some(old) = self.order.pop_front()
                && let Some(gone) = self.done.remove(&old)
            {
                self.bytes -= gone.size;
            }
        }
    }
}

struct Running {
    result: ResultFuture,
    cancel: Arc<CancelSignal>,
    attempt: u32,
    /// The run and lease epoch it was dispatched under.
    run_id: String,
    lease_epoch: u64,
}

impl std::fmt::Debug for Running {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Running")
            .field("attempt", &self.attempt)
            .finish_non_exhaustive()
    }
}

#[derive(Debug)]
struct Done {
    result: v1::TaskResult,
    attempt: u32,
    /// The result's encoded size.
    size: usize,
}

impl Done {
    /// Whether a call with `attempt` should run the delegation again rather than get
    /// this result: only a later attempt after an ending that invites one (a retryable
    /// failure, a cancellation, a timeout).
    fn rerun_for(&self, attempt: u32) -> bool {
        let status = v1::TaskStatus::try_from(self.result.status).ok();
        let failed = status == Some(v1::TaskStatus::Failed);
        let invites_retry = self
            .result
            .error
            .as_ref()
            .is_some_and(|e| e.retryable || e.code == "cancelled");
        attempt > self.attempt
            && ((failed && invites_retry) || status == Some(v1::TaskStatus::TimedOut))
    }
}

fn lock(m: &Mutex<Tasks>) -> MutexGuard<'_, Tasks> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// What a worker is built from besides its handles.
#[derive(Debug, Clone)]
pub struct WorkerOptions {
    /// This worker's id, reported in results and registration.
    pub worker_id: String,
    /// Delegations run at once.
    pub capacity: u32,
    /// Whether the `exit_process_after_tools` fault may exit the process. Only the
    /// standalone binary sets it; a worker hosted with other services abandons the
    /// task instead.
    pub exit_process_on_fault: bool,
    /// Retries, prices and span content of model calls.
    pub models: Arc<crate::models::ModelSettings>,
    /// How often the policy service's keys and revocations are fetched again (also on a
    /// token naming an unknown key).
    pub key_refresh: std::time::Duration,
}

impl WorkerService {
    /// A worker serving `profiles` with `tools`, building each profile's model provider
    /// from `providers`.
    ///
    /// # Errors
    ///
    /// No profiles, zero capacity, a profile naming an unknown provider or tool.
    pub fn new(
        options: WorkerOptions,
        profiles: Vec<Profile>,
        providers: &ProviderRegistry,
        tools: ToolRegistry,
        policy: PolicyHandle,
        evidence: EvidenceHandle,
    ) -> Result<Self, SetupError> {
        if profiles.is_empty() {
            return Err(SetupError::NoProfiles);
        }
        if options.capacity == 0 {
            return Err(SetupError::ZeroCapacity);
        }
        let worker_id: Arc<str> = Arc::from(options.worker_id.as_str());
        let tools = Arc::new(tools);
        let guard = Guard::new(policy.clone(), options.key_refresh);
        let mut agents = BTreeMap::new();
        for profile in profiles {
            for tool in &profile.profile.default_tools {
                if tools.get(tool).is_none() {
                    return Err(SetupError::UnknownTool {
                        profile: profile.profile.id.clone(),
                        tool: tool.clone(),
                        known: tools.names().join(", "),
                    });
                }
            }
            if profile.faults.any() {
                tracing::warn!(
                    profile = %profile.profile.id,
                    faults = ?profile.faults,
                    "fault injection is on for this profile; it is for tests only"
                );
            }
            if let Some(hold) = &profile.hold {
                tracing::warn!(
                    profile = %profile.profile.id,
                    release = %hold.release.display(),
                    "this profile holds every delegation until its release file exists; it is for benchmarks only"
                );
            }
            let provider = providers.build(&profile)?;
            agents.insert(
                profile.profile.id.clone(),
                Agent {
                    worker_id: worker_id.clone(),
                    profile: Arc::new(profile),
                    provider,
                    tools: tools.clone(),
                    policy: policy.clone(),
                    evidence: evidence.clone(),
                    supervisor: None,
                    exit_process: options.exit_process_on_fault,
                    models: options.models.clone(),
                    guard: guard.clone(),
                },
            );
        }
        Ok(Self {
            inner: Arc::new(Inner {
                worker_id,
                guard,
                agents,
                capacity: usize::try_from(options.capacity).unwrap_or(usize::MAX),
                tasks: Mutex::new(Tasks::default()),
                epochs: RecentMap::new(EPOCHS_KEPT),
            }),
        })
    }

    /// The same worker with `supervisor` to delegate through: `delegate@1` calls its
    /// `Delegate` with the task token. Call it before serving: a worker built without a
    /// supervisor answers every `delegate@1` call with a failure saying so.
    #[must_use]
    pub fn with_supervisor(self, supervisor: SupervisorHandle) -> Self {
        let inner = &self.inner;
        let agents = inner
            .agents
            .iter()
            .map(|(id, agent)| {
                let agent = Agent {
                    supervisor: Some(supervisor.clone()),
                    ..agent.clone()
                };
                (id.clone(), agent)
            })
            .collect();
        // A new service value: delegations already started on this one (there are none
        // before serving) stay with it.
        Self {
            inner: Arc::new(Inner {
                worker_id: inner.worker_id.clone(),
                guard: inner.guard.clone(),
                agents,
                capacity: inner.capacity,
                tasks: Mutex::new(Tasks::default()),
                epochs: RecentMap::new(EPOCHS_KEPT),
            }),
        }
    }

    /// This worker's id.
    pub fn worker_id(&self) -> &str {
        &self.inner.worker_id
    }

    /// The profiles served, as registered with the supervisor.
    pub fn profiles(&self) -> Vec<v1::WorkerProfile> {
        self.inner
            .agents
            .values()
            .map(|a| a.profile.wire.clone())
            .collect()
    }

    /// Delegations running at once at most.
    pub fn capacity(&self) -> u32 {
        u32::try_from(self.inner.capacity).unwrap_or(u32::MAX)
    }

    /// Delegations running now.
    pub fn in_flight(&self) -> u32 {
        u32::try_from(lock(&self.inner.tasks).running.len()).unwrap_or(u32::MAX)
    }

    /// Adds the Worker service to `server`, so one listener can host it beside others.
    #[must_use]
    pub fn add_to(&self, server: GrpcServer) -> GrpcServer {
        server.add_service(worker_server::WorkerServer::new(self.clone()))
    }

    /// The agent of `profile`, or FAILED_PRECONDITION naming the profiles served.
    fn agent(&self, profile: &str) -> Result<&Agent, Status> {
        self.inner.agents.get(profile).ok_or_else(|| {
            into_status(&ExecuteError::UnknownProfile {
                profile: profile.to_owned(),
                served: self
                    .inner
                    .agents
                    .keys()
                    .cloned()
                    .collect::<Vec<_>>()
                    .join(", "),
            })
        })
    }

    /// Joins the delegation if it runs, returns its cached result if it finished, or
    /// starts it.
    fn start_or_join(
        &self,
        agent: &Agent,
        assignment: Assignment,
    ) -> Result<ResultFuture, ExecuteError> {
        let id = assignment.task.delegation_id.clone();
        let attempt = assignment.attempt;
        let run_id = assignment.task.run_id.clone();
        let lease_epoch = assignment.verified.claims.lease_epoch;
        let mut tasks = lock(&self.inner.tasks);
        tasks.enter_epoch(&self.inner.epochs, &run_id, lease_epoch)?;
        // A delegation running under an older epoch was just cancelled: it is run anew
        // (its end leaves this one alone, see `finish`).
        if let Some(running) = tasks.running.get(&id)
            && running.lease_epoch >= lease_epoch
        {
            tracing::info!(delegation_id = %id, attempt, running_attempt = running.attempt, "joining the running delegation");
            return Ok(running.result.clone());
        }
        if let Some(done) = tasks.done.get(&id) {
            if !done.rerun_for(attempt) {
                tracing::info!(delegation_id = %id, attempt, "returning the cached result");
                let result = done.result.clone();
                return Ok(futures::future::ready(result).boxed().shared());
            }
            tasks.done.remove(&id);
        }
        if tasks.running.len() >= self.inner.capacity {
            return Err(ExecuteError::Busy {
                running: tasks.running.len(),
                capacity: self.inner.capacity,
            });
        }
        let cancel = Arc::new(CancelSignal::default());
        // A child of the caller's span (the Execute call's server span, or in one
        // process the supervisor's delegation span), so the delegation's tool calls sit
        // under it in the run's trace.
        let span = tracing::info_span!(
            "worker.execute",
            convene.service = "worker",
            convene.worker.id = %self.inner.worker_id,
            convene.run.id = %assignment.task.run_id,
            convene.delegation.id = %id,
            convene.delegation.profile = %assignment.task.profile_id,
            convene.delegation.depth = assignment.task.depth,
            convene.attempt = attempt,
            convene.task.status = tracing::field::Empty,
            convene.task.claims = tracing::field::Empty,
            convene.task.evidence = tracing::field::Empty,
            error.type = tracing::field::Empty,
        );
        let handle = {
            let agent = agent.clone();
            let cancel = cancel.clone();
            let service = self.clone();
            let id = id.clone();
            let traced = span.clone();
            tokio::spawn(
                async move {
                    tracing::info!(delegation_id = %id, profile = %agent.profile.profile.id, attempt, "delegation started");
                    let result = agent.run(&assignment, &cancel).await;
                    let status = v1::TaskStatus::try_from(result.status)
                        .map_or("UNKNOWN", |s| s.as_str_name());
                    tracing::info!(
                        delegation_id = %id,
                        status,
                        claims = result.claims.len(),
                        evidence = result.evidence.len(),
                        "delegation finished"
                    );
                    record_result(&traced, &result);
                    service.finish(&id, (attempt, lease_epoch), &result);
                    result
                }
                .instrument(span),
            )
        };
        let task_id = id.clone();
        let this = self.clone();
        let result = handle
            .map(move |joined| {
                joined.unwrap_or_else(|e| {
                    // The agent panicked: a bug. Answer with a failed result rather than
                    // leave the caller hanging, and free the slot.
                    tracing::error!(delegation_id = %task_id, error = %e, "delegation task crashed");
                    let result = v1::TaskResult {
                        delegation_id: task_id.clone(),
                        worker_id: this.worker_id().to_owned(),
                        status: v1::TaskStatus::Failed as i32,
                        summary: "the worker crashed while running the delegation".into(),
                        error: Some(v1::ErrorInfo {
                            code: "internal".into(),
                            retryable: false,
                            message: "the worker crashed while running the delegation; see its log".into(),
                        }),
                        ..v1::TaskResult::default()
                    };
                    this.finish(&task_id, (attempt, lease_epoch), &result);
                    result
                })
            })
            .boxed()
            .shared();
        tasks.running.insert(
            id,
            Running {
                result: result.clone(),
                cancel,
                attempt,
                run_id,
                lease_epoch,
            },
        );
        Ok(result)
    }

    /// Refuses a call of a run's replica that arrives after `valid_until`, the end of its
    /// lease as it knew it; for a planner turn (`Execute` checks its epoch when it starts
    /// the task), also one under an epoch older than one seen for the run.
    fn check_lease(
        &self,
        run_id: &str,
        valid_until: Option<prost_types::Timestamp>,
        lease_epoch: u64,
    ) -> Result<(), ExecuteError> {
        if let Some(until) = valid_until.and_then(|t| std::time::SystemTime::try_from(t).ok())
            && let Ok(late) = self.inner.guard.now().duration_since(until)
        {
            let refused = ExecuteError::LeaseLapsed {
                run_id: run_id.to_owned(),
                late,
            };
            tracing::warn!(convene.run.id = %run_id, lease_epoch, refused = %refused, "refused a call that came after its replica's lease");
            return Err(refused);
        }
        let seen = self.inner.epochs.get_with(run_id, |e| *e).unwrap_or(0);
        if lease_epoch != 0 && seen > lease_epoch {
            return Err(ExecuteError::Superseded {
                run_id: run_id.to_owned(),
                epoch: lease_epoch,
                seen,
            });
        }
        Ok(())
    }

    /// Moves a finished delegation from running to the bounded result cache, unless a
    /// dispatch under a newer lease epoch replaced it meanwhile (then that one's result
    /// counts, and this one's is dropped).
    fn finish(&self, id: &str, (attempt, lease_epoch): (u32, u64), result: &v1::TaskResult) {
        let mut tasks = lock(&self.inner.tasks);
        if tasks
            .running
            .get(id)
            .is_some_and(|r| r.lease_epoch > lease_epoch)
        {
            return;
        }
        tasks.running.remove(id);
        tasks.done.insert(id, result, attempt);
    }
}

#[tonic::async_trait]
impl worker_server::Worker for WorkerService {
    async fn execute(
        &self,
        request: Request<v1::WorkerExecuteRequest>,
    ) -> Result<Response<v1::WorkerExecuteResponse>, Status> {
        self.inner
            .guard
            .supervisor_only(&request, "execute delegations")
            .await?;
        let request = request.into_inner();
        let task = request
            .task
            .ok_or_else(|| invalid_field("task", "give the Delegation Contract to run"))?;
        validate::delegation_task(&task, "task").map_err(|e| invalid_field(&e.field, e.message))?;
        if request.task_token.trim().is_empty() {
            return Err(invalid_field(
                "task_token",
                "give the task token the policy service issued for this delegation",
            ));
        }
        let agent = self.agent(&task.profile_id)?;
        // Nothing starts, joins or answers from the cache under a token that does not
        // hold for this very task.
        let verified = self
            .inner
            .guard
            .task_token(
                &request.task_token,
                Binding {
                    run_id: &task.run_id,
                    delegation_id: Some(&task.delegation_id),
                    profile_id: &task.profile_id,
                },
            )
            .await?;
        // A dispatch that arrives after its replica's lease may have run out is not run:
        // that replica was frozen or cut off, and another may run the run now.
        self.check_lease(
            &task.run_id,
            request.lease_valid_until,
            verified.claims.lease_epoch,
        )
        .map_err(|e| into_status(&e))?;
        let attempt = request.attempt.max(1);
        let assignment = Assignment {
            task,
            token: request.task_token,
            verified,
            attempt,
        };
        let result = self
            .start_or_join(agent, assignment)
            .map_err(|e| {
                if matches!(e, ExecuteError::Superseded { .. }) {
                    tracing::warn!(refused = %e, "refused a dispatch of a replica that lost the run");
                }
                into_status(&e)
            })?
            .await;
        // Fault injection (test builds only): the task ran, its answer is lost.
        if let Some(lost) = agent
            .profile
            .faults
            .lose_response(attempt, &result.delegation_id)
        {
            return Err(lost);
        }
        Ok(Response::new(v1::WorkerExecuteResponse {
            result: Some(result),
        }))
    }

    async fn cancel(
        &self,
        request: Request<v1::WorkerCancelRequest>,
    ) -> Result<Response<v1::WorkerCancelResponse>, Status> {
        self.inner
            .guard
            .supervisor_only(&request, "cancel delegations")
            .await?;
        let request = request.into_inner();
        if request.delegation_id.trim().is_empty() {
            return Err(invalid_field(
                "delegation_id",
                "name the delegation to cancel",
            ));
        }
        let signal = lock(&self.inner.tasks)
            .running
            .get(&request.delegation_id)
            .map(|r| r.cancel.clone());
        let cancelled = match signal {
            Some(signal) => {
                tracing::info!(delegation_id = %request.delegation_id, reason = %request.reason, "cancelling delegation");
                signal.cancel(&request.reason);
                true
            }
            None => false,
        };
        Ok(Response::new(v1::WorkerCancelResponse { cancelled }))
    }

    async fn plan_turn(
        &self,
        request: Request<v1::PlanTurnRequest>,
    ) -> Result<Response<v1::PlanTurnResponse>, Status> {
        self.inner
            .guard
            .supervisor_only(&request, "ask for planner turns")
            .await?;
        let request = request.into_inner();
        crate::planner::check_ids(&request)?;
        let agent = self.agent(&request.profile_id)?;
        if request.task_token.trim().is_empty() {
            return Err(invalid_field(
                "task_token",
                "give the task token the policy service issued for the run's planner",
            ));
        }
        // The model is asked only under a planner token that holds for this run, from a
        // replica that still holds the run (by its epoch and its lease's deadline).
        let verified = self
            .inner
            .guard
            .task_token(
                &request.task_token,
                Binding {
                    run_id: &request.run_id,
                    delegation_id: None,
                    profile_id: &request.profile_id,
                },
            )
            .await?;
        self.check_lease(
            &request.run_id,
            request.lease_valid_until,
            verified.claims.lease_epoch,
        )
        .map_err(|e| into_status(&e))?;
        let response = crate::planner::plan_turn(agent, &self.inner.worker_id, request).await?;
        Ok(Response::new(response))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn done(status: v1::TaskStatus, code: &str, retryable: bool) -> Done {
        Done {
            result: v1::TaskResult {
                status: status as i32,
                error: (!code.is_empty()).then(|| v1::ErrorInfo {
                    code: code.into(),
                    retryable,
                    message: String::new(),
                }),
                ..v1::TaskResult::default()
            },
            attempt: 1,
            size: 0,
        }
    }

    fn sized(id: &str, bytes: usize) -> v1::TaskResult {
        v1::TaskResult {
            delegation_id: id.to_owned(),
            summary: "x".repeat(bytes),
            ..v1::TaskResult::default()
        }
    }

    #[test]
    fn the_result_cache_is_bounded_in_bytes_as_well_as_in_entries() {
        let mut cache = ResultCache::default();
        // Results of 1 MiB each: far fewer than RESULT_CACHE fit in the byte bound.
        for i in 0..40 {
            cache.insert(&format!("d{i}"), &sized(&format!("d{i}"), 1 << 20), 1);
            assert!(
                cache.bytes <= RESULT_CACHE_BYTES,
                "{} bytes held",
                cache.bytes
            );
        }
        assert_eq!(cache.done.len(), cache.order.len());
        assert!(cache.done.len() < 17, "{} results held", cache.done.len());
        assert!(cache.get("d39").is_some(), "the newest is kept");
        assert!(cache.get("d0").is_none(), "the oldest went first");
        let held: usize = cache.done.values().map(|d| d.size).sum();
        assert_eq!(held, cache.bytes);

        // Small results: the entry bound holds.
        for i in 0..RESULT_CACHE + 10 {
            cache.insert(&format!("s{i}"), &sized("s", 10), 1);
        }
        assert_eq!(cache.done.len(), RESULT_CACHE);

        // A single result larger than the byte bound is still kept (alone), so a
        // duplicate delivery of it gets the same answer.
        cache.insert("huge", &sized("huge", RESULT_CACHE_BYTES + 1), 1);
        assert_eq!(cache.done.len(), 1);
        assert!(cache.get("huge").is_some());
        cache.remove("huge");
        assert_eq!(
            (cache.bytes, cache.done.len(), cache.order.len()),
            (0, 0, 0)
        );
    }

    #[test]
    fn only_later_attempts_after_retryable_endings_run_again() {
        let transient = done(v1::TaskStatus::Failed, "upstream_unavailable", true);
        assert!(
            !transient.rerun_for(1),
            "a duplicate delivery gets the cached result"
        );
        assert!(transient.rerun_for(2));
        assert!(done(v1::TaskStatus::TimedOut, "timeout", false).rerun_for(2));
        assert!(done(v1::TaskStatus::Failed, "cancelled", false).rerun_for(2));
        assert!(!done(v1::TaskStatus::Failed, "no_findings", false).rerun_for(2));
        assert!(!done(v1::TaskStatus::Blocked, "permission_denied", false).rerun_for(2));
        assert!(!done(v1::TaskStatus::Completed, "", false).rerun_for(2));
    }
}
