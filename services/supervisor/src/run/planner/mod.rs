//! A planner's run: a model decomposes the goal through `delegate` and `finish`, round
//! by round, and the join stays the only judge of evidence.
//!
//! A round is a planner turn that proposes delegations, those delegations running
//! concurrently, the join over every result accepted so far, and the planner reading the
//! answers to its calls (in call order) and the decision: its next turn delegates again,
//! opening the next round, or finishes the last one. Each round is one `plan` span.
//!
//! The model is asked by a worker that serves the planner's profile, one turn per
//! `Worker.PlanTurn` request: the supervisor sends the conversation so far and gets the
//! model's answer, so model credentials and network access stay on workers. The actor
//! validates every call of the answer ([`RunActor::check_proposal`], the path nested
//! `Delegate` calls take too), and commits the turn — the answer, what it made of each
//! call and the delegations it accepted — in one version before any of them is
//! dispatched. A supervisor that restarts finds the committed turn and runs its
//! delegations under their ids (`hash(run, round, call index)`); only a turn that was not
//! committed is asked for again.
//!
//! The run stops when the planner finishes (its state is the last decision's, waiting
//! states included), at `max_rounds`, when the progress hash stays unchanged for
//! `no_progress_rounds` rounds, when the budget is exhausted, or at the deadline.

pub(crate) mod prompt;

use std::sync::Arc;
use std::time::Duration;

use convene_core::ids;
use convene_core::join::{self, JoinState};
use convene_core::limits::{self, Progress, ProgressDetector};
use convene_core::model::Overflow;
use convene_core::permissions::PermissionSet;
use convene_core::time::to_timestamp;
use convene_proto::v1::{self, run_event::Kind};
use tonic::Request;
use tracing::{Instrument as _, Span};

use self::prompt::{Citable, DELEGATE, FINISH};
use super::propose::{self, Delegator};
use super::slot::{Batch, Slot, SlotState};
use super::{Msg, RunActor, backoff, status_is_transient};
use crate::crash::CrashPoint;
use crate::error::Error;
use crate::plan::{self, Placement};
use crate::store::{Events, StoreError};
use crate::trace;

/// Tries of one planner turn that fails transiently (a worker restarting, a model
/// server's outage that outlasted the worker's own retries).
const TURN_ATTEMPTS: u32 = 5;

/// Turns in a row that may propose nothing that runs (every call refused, plain text)
/// before the run gives up on its planner.
const MAX_REFUSED_TURNS: u32 = 3;

/// What the actor keeps of its planner besides the committed [`v1::PlannerState`].
#[derive(Default)]
pub(crate) struct PlannerRt {
    /// The planner's task token (asked for before its first turn).
    token: String,
    /// A turn is being asked for.
    asking: bool,
    /// Tries of the turn being asked for.
    attempts: u32,
    /// Turns in a row that proposed nothing that runs.
    refused: u32,
    /// The current round's `plan` span, and its round.
    span: Option<(u32, Span)>,
}

/// The round the next turn belongs to: the first, the next one once a round's decision
/// was read, or the current one after a turn that started nothing.
fn next_round(state: &v1::PlannerState) -> u32 {
    if state.turns.is_empty() {
        return 1;
    }
    match state.messages.last().map(|m| m.role.as_str()) {
        Some("user") => state.round + 1,
        _ => state.round.max(1),
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn overflow_name(o: Overflow) -> &'static str {
    match o {
        Overflow::Queue => "QUEUE",
        Overflow::Truncate => "TRUNCATE",
        Overflow::Reject => "REJECT",
    }
}

/// What one call of a turn came to, before the commit.
struct Proposed {
    call: v1::PlannerCall,
    /// For an accepted `delegate`: its task, token and the defaults it was given.
    task: Option<(v1::DelegationTask, String, Vec<v1::AppliedDefault>)>,
}

/// A `delegate` call that passed its own checks: its position in the turn's calls, its
/// call index in the round, the proposal (its defaults applied) and those defaults.
type Valid = (
    usize,
    u32,
    convene_core::model::PlannedTask,
    v1::PlannedDelegation,
    Vec<v1::AppliedDefault>,
);

/// How a committed turn ends the run, if it does.
enum Ending {
    Finished(String),
    Stop(v1::RunState, String),
}

impl RunActor {
    fn planner_state(&self) -> v1::PlannerState {
        self.run.planner.clone().unwrap_or_default()
    }

    fn planner_mut(&mut self) -> &mut v1::PlannerState {
        Arc::make_mut(&mut self.run)
            .planner
            .get_or_insert_with(Default::default)
    }

    /// The profiles the planner may delegate to: those its spec names, else every
    /// profile of the policy that holds tools, its own excepted.
    fn delegable_profiles(&self) -> Vec<String> {
        let wire = self.run.spec.as_ref().and_then(|s| s.planner.as_ref());
        if let Some(named) = wire.filter(|p| !p.profiles.is_empty()) {
            return named.profiles.clone();
        }
        let own = wire.map_or("", |p| p.profile_id.as_str());
        self.deps
            .policy_file
            .profiles
            .iter()
            .filter(|(id, p)| id.as_str() != own && !p.tools.is_empty())
            .map(|(id, _)| id.clone())
            .collect()
    }

    /// The offered profiles as the planner is told them: what each is for, its tools,
    /// and the resources each tool may read within what the run may hand on.
    fn profile_views(&self, profiles: &[String]) -> Vec<prompt::ProfileView> {
        let holds = self.principal_holds();
        let policy = &self.deps.policy_file;
        profiles
            .iter()
            .map(|id| {
                let tools = policy.profiles.get(id).map_or_else(Vec::new, |profile| {
                    profile
                        .tools
                        .iter()
                        .filter_map(|t| policy.tools.get(t))
                        .map(|tool| prompt::ToolView {
                            name: tool.name.clone(),
                            action: tool.action.clone(),
                            reads: propose::needed(profile, tool)
                                .intersect(&holds)
                                .permissions()
                                .iter()
                                .map(|p| p.resource.to_string())
                                .collect(),
                            description: tool.description.clone(),
                        })
                        .collect()
                });
                prompt::ProfileView {
                    id: id.clone(),
                    description: self.deps.registry.description(id),
                    tools,
                }
            })
            .collect()
    }

    /// What the run's principal may hand on to the planner's delegations: its grants
    /// within its delegable scopes (nothing when the policy no longer lists it).
    fn principal_holds(&self) -> PermissionSet {
        self.deps
            .policy_file
            .principal(&self.run.principal)
            .map_or_else(PermissionSet::empty, |p| p.grants.intersect(&p.delegable))
    }

    /// Whether a top-level delegation runs, or waits for a slot it can still get (once
    /// the budget is spent, nothing queued starts: the round is over).
    fn round_open(&self) -> bool {
        self.slots.iter().any(|s| {
            s.top_level
                && (s.in_flight() || (s.state == SlotState::Waiting && !self.budget_stopped))
        })
    }

    /// The planner's next step: nothing while a turn is asked for or the round's
    /// delegations run; the round's decision once they are all over; otherwise the next
    /// turn.
    pub(super) async fn planner_step(&mut self) -> Result<(), StoreError> {
        if self.terminal() || self.planner_rt().asking || self.round_open() {
            return Ok(());
        }
        let state = self.planner_state();
        if state.finished {
            // Finished, and stopped before the end was committed.
            let decision = self.final_decision();
            let run_state = self.state_for(decision.outcome, false);
            let reason = format!("the planner finished: {}", state.summary);
            return self.finish(Some(decision), run_state, reason).await;
        }
        if state.messages.last().is_some_and(|m| m.role == "assistant") {
            self.round_end().await?;
            if self.terminal() {
                return Ok(());
            }
        }
        if self.budget_stopped {
            let decision = self.final_decision();
            let reason = self.run.terminal_reason.clone();
            return self
                .finish(Some(decision), v1::RunState::BudgetExhausted, reason)
                .await;
        }
        if self.planner_rt().token.is_empty() {
            match self.planner_token().await {
                Ok(token) => self.planner_rt().token = token,
                Err(e) => {
                    let reason = format!("the planner's task token was refused: {e}");
                    return self.finish(None, v1::RunState::Failed, reason).await;
                }
            }
        }
        self.ask_planner(Duration::ZERO);
        Ok(())
    }

    fn planner_rt(&mut self) -> &mut PlannerRt {
        self.planner.get_or_insert_with(Box::default)
    }

    /// The planner's own task token: it authenticates the turn requests to the worker
    /// and proves the principal may use the planner's profile.
    async fn planner_token(&self) -> Result<String, Error> {
        let profile = self
            .spec
            .planner
            .as_ref()
            .map(|p| p.profile_id.clone())
            .unwrap_or_default();
        let task = v1::DelegationTask {
            delegation_id: ids::delegation_id(&self.run.run_id, Some("planner"), 0, 0),
            run_id: self.run.run_id.clone(),
            depth: 1,
            profile_id: profile,
            deadline: Some(to_timestamp(self.spec.limits.deadline)),
            ..Default::default()
        };
        let mut tokens = self.issue_tokens(&[task], None).await?;
        Ok(tokens.pop().unwrap_or_default())
    }

    /// Asks a worker serving the planner's profile for the next turn, after `delay`.
    fn ask_planner(&mut self, delay: Duration) {
        let state = self.planner_state();
        let round = next_round(&state);
        let state_round = state.round;
        #[allow(clippy::cast_possible_truncation)] // turns are bounded by rounds
        let turn = state.turns.len() as u32 + 1;
        let run_span = self.span.clone();
        let profiles = self.delegable_profiles();
        let (planner_profile, planner_instructions) = self
            .spec
            .planner
            .as_ref()
            .map(|p| (p.profile_id.clone(), p.instructions.clone()))
            .unwrap_or_default();
        let mut messages = state.messages;
        if messages.is_empty() {
            let view = prompt::LimitsView {
                max_parallel: self.spec.limits.max_parallel_workers,
                overflow: overflow_name(self.spec.limits.overflow),
                max_rounds: self.spec.limits.max_rounds,
                max_depth: self.spec.limits.max_depth,
            };
            let views = self.profile_views(&profiles);
            let task = prompt::message("user", prompt::task_message(&self.run, &views, &view));
            self.planner_mut().messages.push(task.clone());
            messages.push(task);
        }
        let instructions = if planner_instructions.trim().is_empty() {
            prompt::RULES.to_owned()
        } else {
            format!("{}\n\n{}", planner_instructions.trim(), prompt::RULES)
        };
        let run_id = self.run.run_id.clone();
        let rt = self.planner_rt();
        rt.asking = true;
        rt.attempts += 1;
        let attempt = rt.attempts;
        // A turn is asked under the current round's span: a round ends with the
        // planner reading its decision. A turn that delegates opens the next round.
        let span_round = if state_round == 0 { 1 } else { state_round };
        if rt.span.as_ref().is_none_or(|(r, _)| *r != span_round) {
            rt.span = Some((span_round, trace::round_span(&run_span, span_round)));
        }
        let span = rt
            .span
            .as_ref()
            .map(|(_, s)| s.clone())
            .unwrap_or_else(Span::none);
        let request = v1::PlanTurnRequest {
            run_id,
            profile_id: planner_profile.clone(),
            round,
            turn,
            task_token: rt.token.clone(),
            instructions,
            messages,
            tools: prompt::tools(&profiles),
            max_tokens: 0,
            lease_valid_until: None,
        };
        let registry = self.deps.registry.clone();
        let held = self.lease.clone();
        let clock = self.deps.clock.clone();
        let tx = self.tx.clone();
        let cancel = self.cancel.child_token();
        let abandon = self.abandon.clone();
        let deadline = self.spec.limits.deadline;
        tokio::spawn(
            async move {
                let asked = async {
                    let lease = super::dispatch::wait_for_worker(
                        &registry,
                        &clock,
                        &planner_profile,
                        &[],
                        deadline,
                        delay,
                        &cancel,
                    )
                    .await?;
                    // As a dispatch does: nothing is asked while the lease is unsure,
                    // and the worker refuses the turn once it may have run out.
                    let mut request = request;
                    if let Some(held) = &held {
                        request.lease_valid_until =
                            Some(to_timestamp(clock.now() + held.sure().await));
                    }
                    let limit = deadline.duration_since(clock.now()).unwrap_or_default();
                    let mut req = Request::new(request);
                    req.set_timeout(limit);
                    let answer = tokio::time::timeout(limit, lease.handle.plan_turn(req)).await;
                    match answer {
                        Ok(Ok(resp)) => {
                            let mut resp = resp.into_inner();
                            if resp.worker_id.is_empty() {
                                resp.worker_id.clone_from(&lease.worker_id);
                            }
                            Ok(resp)
                        }
                        Ok(Err(status)) => Err(Error::from(status)),
                        Err(_) => Err(Error::WorkerTimeout),
                    }
                };
                let outcome = tokio::select! {
                    o = asked => o,
                    () = abandon.cancelled() => return,
                };
                let _ = tx.send(Msg::PlannerTurn {
                    turn,
                    attempt,
                    outcome: Box::new(outcome),
                });
            }
            .instrument(span),
        );
    }

    /// A turn request ended.
    pub(super) async fn on_planner_turn(
        &mut self,
        turn: u32,
        attempt: u32,
        outcome: Result<v1::PlanTurnResponse, Error>,
    ) -> Result<(), StoreError> {
        let expected = self.planner_state().turns.len() + 1;
        if self.terminal() || turn as usize != expected || attempt != self.planner_rt().attempts {
            return Ok(());
        }
        self.planner_rt().asking = false;
        match outcome {
            Ok(response) => {
                self.planner_rt().attempts = 0;
                self.take_turn(response).await
            }
            Err(e) => {
                let code = e.grpc_code();
                let transient = status_is_transient(code) || matches!(e, Error::NoWorker(_));
                let time_left = self.deps.clock.now() < self.spec.limits.deadline;
                if transient && attempt < TURN_ATTEMPTS && time_left {
                    tracing::warn!(run_id = %self.run.run_id, attempt, error = %e, "the planner's turn failed; asking again");
                    let delay = backoff(&self.deps.settings, attempt);
                    self.ask_planner(delay);
                    return Ok(());
                }
                self.planner_rt().attempts = 0;
                let decision = self.run.decision.clone();
                let reason = format!("the planner's model turn failed: {e}");
                self.finish(decision, v1::RunState::Failed, reason).await
            }
        }
    }

    /// Validates a turn's calls, commits the turn with the delegations it proposed, and
    /// starts them (or ends the run, when the turn does).
    async fn take_turn(&mut self, response: v1::PlanTurnResponse) -> Result<(), StoreError> {
        let state = self.planner_state();
        let round = next_round(&state);
        #[allow(clippy::cast_possible_truncation)]
        let turn = state.turns.len() as u32 + 1;
        let mut message = response.message.unwrap_or_default();
        message.role = "assistant".to_owned();
        prompt::normalize_call_ids(&mut message, turn);
        if let Some(usage) = &response.usage {
            self.account_usage(usage);
        }
        let over_rounds = round > self.spec.limits.max_rounds;
        let delegates = message
            .tool_calls
            .iter()
            .filter(|c| c.name == DELEGATE)
            .count();
        let finishes = message
            .tool_calls
            .iter()
            .filter(|c| c.name == FINISH)
            .count();
        // Call indices count every delegate call of the round, so the ids of a round's
        // later turn never meet an earlier turn's.
        let mut call_index: u32 = state
            .turns
            .iter()
            .filter(|t| t.round == round)
            .flat_map(|t| &t.calls)
            .filter(|c| c.tool == DELEGATE)
            .count()
            .try_into()
            .unwrap_or(u32::MAX);
        let planner_profile = self
            .spec
            .planner
            .as_ref()
            .map(|p| p.profile_id.clone())
            .unwrap_or_default();
        let goal = self
            .run
            .spec
            .as_ref()
            .map(|s| s.goal.clone())
            .unwrap_or_default();
        let offered = self.delegable_profiles();
        let holds = self.principal_holds();
        let delegator = Delegator {
            name: "the planner",
            scope: None,
            holds: &holds,
            tools: None,
            refuses_wider: false,
        };
        let mut proposed: Vec<Proposed> = Vec::with_capacity(message.tool_calls.len());
        let mut ending = None;
        // Valid delegate proposals, by position in `proposed`.
        let mut valid: Vec<Valid> = Vec::new();
        let mut finish_seen = false;
        for (i, c) in message.tool_calls.iter().enumerate() {
            let mut call = v1::PlannerCall {
                call_id: c.id.clone(),
                tool: c.name.clone(),
                ..Default::default()
            };
            match c.name.as_str() {
                DELEGATE => {
                    let index = call_index;
                    call_index = call_index.saturating_add(1);
                    let refusal = if finishes > 0 {
                        Some("delegate and finish were called in one turn: nothing of it runs; delegate, or finish alone".to_owned())
                    } else if self.budget_stopped {
                        Some(format!(
                            "{}; call finish with what the join accepted",
                            self.run.terminal_reason
                        ))
                    } else if over_rounds {
                        Some(
                            limits::LimitError::Rounds {
                                max: self.spec.limits.max_rounds,
                            }
                            .to_string(),
                        )
                    } else {
                        None
                    };
                    if let Some(refusal) = refusal {
                        call.error = refusal;
                    } else {
                        let field = format!("delegate call {i}");
                        let checked = prompt::delegation(&c.arguments, round, index)
                            .map_err(|e| format!("{field}: {e}"))
                            .and_then(|wire| {
                                if offered.contains(&wire.profile_id) {
                                    Ok(wire)
                                } else {
                                    Err(format!(
                                        "{field}: profile {} is not offered to this run's \
                                         planner; delegate to one of: {}",
                                        wire.profile_id,
                                        offered.join(", ")
                                    ))
                                }
                            })
                            .and_then(|mut wire| {
                                let description = self.deps.registry.description(&wire.profile_id);
                                let defaults = propose::apply_defaults(
                                    &mut wire,
                                    &self.deps.policy_file,
                                    &delegator,
                                    description.as_deref(),
                                );
                                let p = self
                                    .check_proposal(
                                        &field,
                                        &wire,
                                        &[(planner_profile.as_str(), goal.as_str())],
                                    )
                                    .map_err(|e| e.to_string())?;
                                propose::check_servable(&wire, &self.deps.policy_file, &delegator)
                                    .map_err(|e| format!("{field}: {e}"))?;
                                Ok((p, wire, defaults))
                            });
                        match checked {
                            Ok((p, wire, defaults)) => {
                                valid.push((proposed.len(), index, p, wire, defaults));
                            }
                            Err(e) => call.error = e,
                        }
                    }
                }
                FINISH => {
                    if delegates > 0 {
                        call.error = "finish was called with delegate in one turn: nothing of it runs; finish alone, once the results you need are in".to_owned();
                    } else if finish_seen {
                        call.error = "only the first finish of a turn is read".to_owned();
                    } else {
                        finish_seen = true;
                        let citable = Citable::of(&self.run, self.run.decision.as_ref());
                        match prompt::finish(&c.arguments)
                            .and_then(|a| citable.check(&a.cite).map(|()| a))
                        {
                            Ok(args) => {
                                let p = self.planner_mut();
                                p.finished = true;
                                p.summary.clone_from(&args.summary);
                                p.cited.clone_from(&args.cite);
                                ending = Some(Ending::Finished(args.summary));
                            }
                            Err(e) => call.error = e,
                        }
                    }
                }
                other => {
                    call.error =
                        format!("unknown tool {other:?}: the tools are {DELEGATE} and {FINISH}");
                }
            }
            proposed.push(Proposed { call, task: None });
        }
        if ending.is_none() && over_rounds && delegates > 0 {
            ending = Some(Ending::Stop(
                v1::RunState::BudgetExhausted,
                limits::LimitError::Rounds {
                    max: self.spec.limits.max_rounds,
                }
                .to_string(),
            ));
        }
        if ending.is_none() && !valid.is_empty() {
            self.accept_proposals(round, &mut proposed, valid).await;
        }
        let starts = proposed.iter().any(|p| p.task.is_some());
        if ending.is_none() && self.budget_stopped && !starts {
            ending = Some(Ending::Stop(
                v1::RunState::BudgetExhausted,
                self.run.terminal_reason.clone(),
            ));
        }
        let plain_text = message.tool_calls.is_empty();
        // A turn that delegates belongs to the round it opens; one that does not (a
        // finish, plain text) to the round whose decision it read.
        let recorded_round = if delegates > 0 {
            round
        } else {
            state.round.max(1)
        };
        let refused_turn = ending.is_none() && !starts;
        // The turn, the delegations it proposed and what the planner is told of its
        // refused calls: one version.
        let now = self.deps.clock.now();
        let calls: Vec<v1::PlannerCall> = proposed.iter().map(|p| p.call.clone()).collect();
        let record = v1::PlannerTurn {
            round: recorded_round,
            turn,
            worker_id: response.worker_id.clone(),
            model: response.model.clone(),
            finish_reason: response.finish_reason.clone(),
            usage: response.usage,
            calls: calls.clone(),
            committed_at: Some(to_timestamp(now)),
        };
        let mut created = Vec::new();
        for p in &mut proposed {
            if let Some((task, token, defaults)) = p.task.take() {
                let index = self.add_pending(task);
                Arc::make_mut(&mut self.run).delegations[index].defaults = defaults;
                created.push((index, token, p.call.call_id.clone()));
            }
        }
        {
            let answers_now = refused_turn;
            let p = self.planner_mut();
            p.round = recorded_round;
            p.messages.push(message);
            p.turns.push(record.clone());
            if answers_now {
                for c in &calls {
                    p.messages.push(prompt::tool_message(
                        &c.call_id,
                        prompt::error_answer(&c.error),
                    ));
                }
                if plain_text {
                    p.messages.push(prompt::message(
                        "user",
                        format!(
                            "You answered in plain text. Continue with tool calls: {DELEGATE} \
                             to delegate, {FINISH} to end the run; plain text is not read."
                        ),
                    ));
                }
            }
        }
        if self.run.state == v1::RunState::Pending as i32 {
            Arc::make_mut(&mut self.run).state = v1::RunState::Running as i32;
        }
        let e = self.event(Kind::Planned(record));
        self.staging.stage_event(e);
        self.deps.crash.at(CrashPoint::PlannerTurnReceived);
        if refused_turn {
            self.planner_rt().refused += 1;
        } else {
            self.planner_rt().refused = 0;
        }
        match ending {
            Some(Ending::Finished(summary)) => {
                let decision = self.final_decision();
                let state = self.state_for(decision.outcome, false);
                return self
                    .finish(
                        Some(decision),
                        state,
                        format!("the planner finished: {summary}"),
                    )
                    .await;
            }
            Some(Ending::Stop(state, reason)) => {
                let decision = self.final_decision();
                return self.finish(Some(decision), state, reason).await;
            }
            None => {}
        }
        if refused_turn && self.planner_rt().refused >= MAX_REFUSED_TURNS {
            let decision = self.run.decision.clone();
            let reason = format!(
                "the planner's last {MAX_REFUSED_TURNS} turns proposed nothing that could run \
                 and did not finish"
            );
            return self.finish(decision, v1::RunState::Failed, reason).await;
        }
        self.commit(Events::default()).await?;
        if !created.is_empty() {
            self.deps.crash.at(CrashPoint::AfterPlannerCommit);
        }
        // Start what the turn proposed, each delegation's span under its call's, in the
        // round's span.
        if !created.is_empty()
            && self
                .planner_rt()
                .span
                .as_ref()
                .is_none_or(|(r, _)| *r != round)
        {
            let span = trace::round_span(&self.span, round);
            self.planner_rt().span = Some((round, span));
        }
        let round_span = self
            .planner_rt()
            .span
            .as_ref()
            .map(|(_, s)| s.clone())
            .unwrap_or_else(Span::none);
        if let Some(span) = self.planner_rt().span.as_ref().map(|(_, s)| s.clone()) {
            span.record("convene.plan.tasks", created.len());
        }
        let batch = self.batches.len();
        self.batches
            .push(Batch::new(self.spec.limits.max_parallel_workers as usize));
        for (index, token, call_id) in created {
            let task = self.run.delegations[index].task.clone().unwrap_or_default();
            let call_span = tracing::info_span!(
                parent: &round_span,
                "planner.delegate",
                convene.service = trace::SERVICE,
                convene.planner.call_id = %call_id,
                convene.delegation.id = %task.delegation_id,
                convene.delegation.profile = %task.profile_id,
            );
            let mut slot = Slot::new(
                true,
                batch,
                SlotState::Waiting,
                trace::delegation_span(&call_span, &task),
            );
            slot.token = token;
            self.slots.push(slot);
            self.batches[batch].queue.push_back(index);
        }
        self.pump(batch);
        if !starts {
            // Nothing runs: the planner reads its refusals and tries again.
            self.ask_planner(Duration::ZERO);
        }
        Ok(())
    }

    /// Applies the width limit and asks for tokens, per call so that a refusal names its
    /// call; the tasks of the accepted calls land in `proposed`.
    async fn accept_proposals(&mut self, round: u32, proposed: &mut [Proposed], valid: Vec<Valid>) {
        let batch = match self.check_batch(1, valid.len()) {
            Ok(plan) => plan,
            Err(e) => {
                for (at, _, _, _, _) in &valid {
                    proposed[*at].call.error = e.to_string();
                }
                return;
            }
        };
        let dropped_names: Vec<String> = batch
            .dropped
            .iter()
            .filter_map(|k| valid.get(*k).map(|(_, _, p, _, _)| p.name.clone()))
            .collect();
        let now = self.deps.clock.now();
        for (k, (at, call_index, p, wire, defaults)) in valid.into_iter().enumerate() {
            if batch.dropped.contains(&k) {
                let call = &mut proposed[at].call;
                call.dropped = true;
                call.error = format!(
                    "dropped: this turn asked for more delegations than max_parallel_workers \
                     ({}) and overflow is TRUNCATE; dropped: {}. Ask again in a later round \
                     if you still need them",
                    self.spec.limits.max_parallel_workers,
                    dropped_names.join(", ")
                );
                Arc::make_mut(&mut self.run).truncated.push(p.name.clone());
                continue;
            }
            let task = plan::task(
                &p,
                &wire,
                Placement {
                    run_id: &self.run.run_id,
                    parent: None,
                    depth: 1,
                    round,
                    call_index,
                },
                &self.deps.policy_file,
                now,
                self.spec.limits.deadline,
            );
            match self.issue_tokens(std::slice::from_ref(&task), None).await {
                Ok(mut tokens) => {
                    proposed[at].call.delegation_id = task.delegation_id.clone();
                    proposed[at].task = Some((task, tokens.pop().unwrap_or_default(), defaults));
                }
                Err(e) => {
                    proposed[at].call.error = format!("the policy refused this delegation: {e}");
                }
            }
        }
    }

    /// The round's delegations are over: the join decides over every result so far,
    /// the planner gets the answers to its calls and the decision, and the run stops if
    /// it made no progress.
    async fn round_end(&mut self) -> Result<(), StoreError> {
        if self.staging.has_unverified() {
            self.verify_staged().await;
        }
        let state = self.planner_state();
        let round = state.round;
        let run_span = self.span.clone();
        let parent = self
            .planner_rt()
            .span
            .as_ref()
            .map_or(run_span, |(_, s)| s.clone());
        let span = trace::join_span(&parent, &self.spec.join, "round");
        let expected = self.expected();
        let now = self.deps.clock.now();
        let input = join::JoinInput {
            contract: &self.spec.join,
            delegations: &expected,
            results: &self.run.received,
            evidence: &self.facts,
            now,
            settlements: &self.settlements,
        };
        let mut decision = span.in_scope(|| match join::decide(&input) {
            JoinState::Decided(d) => d,
            JoinState::Pending { .. } => join::assess(&input),
        });
        decision.revision = self.run.decision.as_ref().map_or(1, |d| d.revision + 1);
        trace::record_decision(&span, &decision);
        drop(span);
        let hash = hex(&self.progress_hash(&decision));
        let mut ev = Events::default();
        self.record_decision(&decision, &mut ev, now);
        // The answers to the round's last turn, in call order, then the decision.
        let last = state.turns.last().cloned().unwrap_or_default();
        let mut answers = Vec::with_capacity(last.calls.len() + 1);
        for c in &last.calls {
            let content = if c.delegation_id.is_empty() {
                prompt::error_answer(&c.error)
            } else {
                self.run
                    .delegations
                    .iter()
                    .find(|d| {
                        d.task
                            .as_ref()
                            .is_some_and(|t| t.delegation_id == c.delegation_id)
                    })
                    .map_or_else(
                        || prompt::error_answer("the delegation is not in the run's ledger"),
                        |d| prompt::delegate_answer(d, Some(&decision)),
                    )
            };
            answers.push(prompt::tool_message(&c.call_id, content));
        }
        let max_rounds = self.spec.limits.max_rounds;
        let next = if round >= max_rounds {
            format!(
                "max_rounds ({max_rounds}) reached: no further round may start. Call {FINISH} \
                 now; a {DELEGATE} call ends the run as BUDGET_EXHAUSTED."
            )
        } else {
            format!(
                "Delegate a targeted follow-up for a conflict or a gap, or call {FINISH}. \
                 Round {} of at most {max_rounds} is next.",
                round + 1
            )
        };
        answers.push(prompt::message(
            "user",
            prompt::decision_message(&self.run, &decision, round, &next),
        ));
        let p = self.planner_mut();
        p.messages.extend(answers);
        p.progress.push(hash);
        let progress = p.progress.clone();
        let mut detector = ProgressDetector::from_limits(&self.spec.limits);
        let mut verdict = Progress::Progressed;
        for h in &progress {
            let mut bytes = [0u8; 32];
            for (i, b) in bytes.iter_mut().enumerate() {
                *b = u8::from_str_radix(h.get(i * 2..i * 2 + 2).unwrap_or("00"), 16).unwrap_or(0);
            }
            verdict = detector.observe(bytes);
        }
        if verdict == Progress::NoProgress {
            for e in ev.run {
                self.staging.stage_event(e);
            }
            let reason = format!(
                "no progress: the progress hash was unchanged for {} round(s) (the same \
                 questions, artifacts and claims)",
                detector.threshold()
            );
            return self
                .finish(Some(decision), v1::RunState::NoProgress, reason)
                .await;
        }
        self.commit(ev).await
    }

    /// The progress hash after a decision: what was asked and answered (each completed
    /// delegation by its profile and goal hash, so asking the same question again is no
    /// progress), the artifacts they rest on, and the claims accepted.
    fn progress_hash(&self, decision: &v1::JoinDecision) -> [u8; 32] {
        let completed: Vec<&v1::Delegation> = self
            .run
            .delegations
            .iter()
            .filter(|d| d.state == v1::DelegationState::Completed as i32)
            .collect();
        let questions = completed.iter().filter_map(|d| {
            let t = d.task.as_ref()?;
            Some(format!(
                "{}:{}",
                t.profile_id,
                hex(&limits::goal_hash(&t.goal))
            ))
        });
        let artifacts = completed
            .iter()
            .filter_map(|d| d.result.as_ref())
            .flat_map(|r| r.artifacts.iter().cloned());
        let claims = completed
            .iter()
            .filter(|d| {
                d.task
                    .as_ref()
                    .is_some_and(|t| decision.accepted.contains(&t.delegation_id))
            })
            .filter_map(|d| d.result.as_ref())
            .flat_map(|r| r.claims.iter().map(|c| c.claim_id.clone()));
        limits::progress_hash(questions, artifacts, claims)
    }

    /// The decision the run ends with: the last round's, or one on what there is.
    fn final_decision(&self) -> v1::JoinDecision {
        if let Some(d) = &self.run.decision {
            return d.clone();
        }
        let expected = self.expected();
        let input = join::JoinInput {
            contract: &self.spec.join,
            delegations: &expected,
            results: &self.run.received,
            evidence: &self.facts,
            now: self.deps.clock.now(),
            settlements: &self.settlements,
        };
        let mut d = join::assess(&input);
        d.revision = 1;
        d
    }
}
