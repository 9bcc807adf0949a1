//! The `convene.v1.Supervisor` gRPC service: the service value and its calls here;
//! out-of-band results (`deliver`), commands and forwarding (`command`), what
//! StartRun builds and waits for (`start`) and the per-principal limit of watch
//! streams (`streams`) in their own modules.

mod command;
mod deliver;
mod start;
mod streams;

use std::sync::Arc;
use std::time::SystemTime;

use convene_mesh::auth::{Authenticator, Caller, bearer};
use convene_mesh::handles::BoxStream;
use convene_mesh::policy_file::Principal;
use convene_proto::v1::{self, run_event::Kind, supervisor_server::Supervisor};
use convene_server::Shutdown;
use tokio::sync::{broadcast, mpsc, oneshot};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};
use tracing::Instrument;

use self::command::check_resume;
use self::start::RunIdentity;
use self::streams::Streams;
use crate::error::Error;
use crate::run::{self, DelegateAsk, Msg, RunActor};
use crate::store::{
    CommandKind, Created, IdempotencyKey, RunFilter, is_final, is_terminal, is_waiting,
};
use crate::templates::Templates;
use crate::watchers::RunWatchers;
use crate::{Deps, events, trace};

/// The Supervisor service (also its own in-process handle).
#[derive(Clone)]
pub struct SupervisorService {
    deps: Arc<Deps>,
    auth: Authenticator,
    shutdown: Shutdown,
    watchers: Arc<RunWatchers>,
    /// Clients of other replicas, by endpoint, for forwarded calls.
    peers: Arc<
        std::sync::Mutex<std::collections::HashMap<String, convene_mesh::handles::GrpcSupervisor>>,
    >,
    /// The run templates StartRun starts runs from by id.
    templates: Arc<Templates>,
    /// The WatchRun and WatchEvents streams each principal holds open.
    streams: Arc<Streams>,
}

impl std::fmt::Debug for SupervisorService {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SupervisorService").finish_non_exhaustive()
    }
}

/// Refuses an empty run id.
fn require_run_id(run_id: &str) -> Result<(), Error> {
    if run_id.trim().is_empty() {
        return Err(Error::invalid("run_id", "must not be empty"));
    }
    Ok(())
}

/// The answer for a run that is not the caller's: another tenant's run is
/// indistinguishable from a missing one.
fn no_such_run(run_id: &str) -> Error {
    Error::RunNotFound(run_id.to_owned())
}

impl SupervisorService {
    pub(crate) fn new(deps: Arc<Deps>, auth: Authenticator, shutdown: Shutdown) -> Self {
        Self {
            watchers: Arc::new(RunWatchers::new(deps.store.clone())),
            peers: Arc::default(),
            templates: Arc::default(),
            streams: Streams::new(deps.settings.max_watch_streams),
            deps,
            auth,
            shutdown,
        }
    }

    /// This service starting runs from `templates` too (StartRun's `template`).
    #[must_use]
    pub fn with_templates(mut self, templates: Templates) -> Self {
        self.templates = Arc::new(templates);
        self
    }

    /// The run templates this service starts runs from.
    pub fn templates(&self) -> &Templates {
        &self.templates
    }

    /// Waits, at most `grace`, for every run actor to end; call it once shutdown fired
    /// (actors stop at the signal). Their runs' spans are closed then, so a telemetry
    /// flush after it exports them, and their leases are given up. Returns whether all
    /// ended in time.
    pub async fn actors_stopped(&self, grace: std::time::Duration) -> bool {
        self.deps.actors.close();
        let ended = tokio::time::timeout(grace, self.deps.actors.wait())
            .await
            .is_ok();
        if !ended {
            tracing::warn!(
                runs = self.live_runs(),
                ?grace,
                "run actors did not stop in time; their runs resume from the store"
            );
        }
        ended
    }

    /// Runs that still have a live owner task in this process.
    pub fn live_runs(&self) -> usize {
        self.deps.live.lock().expect("live map lock poisoned").len()
    }

    fn mailbox(&self, run_id: &str) -> Result<crate::run::Mailbox, Error> {
        self.deps
            .live
            .lock()
            .expect("live map lock poisoned")
            .get(run_id)
            .map(|live| live.mailbox.clone())
            .ok_or_else(|| {
                Error::FailedPrecondition(format!("run {run_id} is not running in this supervisor"))
            })
    }

    async fn principal<T>(
        &self,
        request: &Request<T>,
        roles: &[&str],
        what: &str,
    ) -> Result<Arc<Principal>, Error> {
        let caller = self.auth.authenticate(request).await?;
        let p = caller.require_principal(what)?;
        if roles.iter().any(|r| p.has_role(r)) {
            Ok(p.clone())
        } else {
            Err(Error::PermissionDenied(format!(
                "principal {} may not {what}: it needs one of the roles {}",
                p.id,
                roles.join(", ")
            )))
        }
    }

    async fn run_of_tenant(&self, run_id: &str, tenant: &str) -> Result<v1::Run, Error> {
        require_run_id(run_id)?;
        let run = self.stored_run(run_id).await?;
        if run.tenant == tenant {
            Ok(run)
        } else {
            Err(no_such_run(run_id))
        }
    }

    /// The run as stored, whatever its tenant (callers check it).
    async fn stored_run(&self, run_id: &str) -> Result<v1::Run, Error> {
        self.deps
            .store
            .get(run_id)
            .await?
            .ok_or_else(|| no_such_run(run_id))
    }

    /// Checks that a run of `tenant` exists, as [`Self::run_of_tenant`] does, without
    /// reading the run.
    async fn check_run_of_tenant(&self, run_id: &str, tenant: &str) -> Result<(), Error> {
        require_run_id(run_id)?;
        match self.deps.store.tenant_of(run_id).await? {
            Some(of) if of == tenant => Ok(()),
            _ => Err(no_such_run(run_id)),
        }
    }
}

/// Strips what ListRuns leaves out (results and revisions) to keep pages small.
fn summary(mut run: v1::Run) -> v1::Run {
    for d in &mut run.delegations {
        d.result = None;
    }
    run.revisions.clear();
    run.received.clear();
    run
}

/// Label filters a ListRuns may carry at most.
const MAX_LABEL_FILTERS: usize = 16;

/// What a ListRuns keeps of the tenant's runs, checked: at most
/// [`MAX_LABEL_FILTERS`] labels with non-empty keys, valid times, and a time window
/// that can hold a run.
fn list_filter(req: &v1::ListRunsRequest) -> Result<RunFilter, Error> {
    if req.labels.len() > MAX_LABEL_FILTERS {
        return Err(Error::invalid(
            "labels",
            format!(
                "{} label filters; at most {MAX_LABEL_FILTERS} are allowed, keep the most \
                 selective ones",
                req.labels.len()
            ),
        ));
    }
    if req.labels.keys().any(|k| k.trim().is_empty()) {
        return Err(Error::invalid(
            "labels",
            "a label filter's key must not be empty: name the label whose value it matches",
        ));
    }
    let time = |ts: Option<&prost_types::Timestamp>, field: &str| {
        ts.map(|t| convene_core::time::from_timestamp(t, field))
            .transpose()
    };
    let created_after = time(req.created_after.as_ref(), "created_after")?;
    let created_before = time(req.created_before.as_ref(), "created_before")?;
    if let (Some(after), Some(before)) = (created_after, created_before)
        && after >= before
    {
        let show =
            |t: Option<&prost_types::Timestamp>| t.map(ToString::to_string).unwrap_or_default();
        return Err(Error::invalid(
            "created_after",
            format!(
                "{} is not before created_before ({}), so no run could match: send an \
                 earlier created_after, a later created_before, or only one of them",
                show(req.created_after.as_ref()),
                show(req.created_before.as_ref()),
            ),
        ));
    }
    Ok(RunFilter {
        states: req.states.clone(),
        labels: req
            .labels
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect(),
        created_after,
        created_before,
    })
}

#[tonic::async_trait]
impl Supervisor for SupervisorService {
    type WatchRunStream = BoxStream<v1::WatchRunResponse>;
    type WatchEventsStream = BoxStream<v1::WatchEventsResponse>;

    async fn start_run(
        &self,
        request: Request<v1::StartRunRequest>,
    ) -> Result<Response<v1::StartRunResponse>, Status> {
        let principal = self
            .principal(&request, &["runs:start"], "start runs")
            .await?;
        let v1::StartRunRequest {
            spec,
            wait,
            template,
            inputs,
        } = request.into_inner();
        let now = SystemTime::now();
        let spec = if template.is_empty() {
            if !inputs.is_empty() {
                return Err(Error::invalid(
                    "inputs",
                    "inputs fill a run template: set template too, or leave inputs empty",
                )
                .into());
            }
            spec.ok_or_else(|| {
                Error::invalid("spec", "required: give the run to start, or a template")
            })?
        } else {
            self.templates.resolve(&template, &inputs, spec, now)?
        };
        let domain = crate::templates::check_spec(&spec, &self.deps.policy_file, now)?;
        // Refused while full before anything is stored or asked for; the place goes
        // back when the run's actor ends, or at once if no actor starts.
        let admitted = self.deps.admission.admit()?;
        let key = domain.idempotency_key.clone().map(|key| IdempotencyKey {
            principal: principal.id.clone(),
            key,
        });
        // The run is its own trace, rooted here; its id is the trace's when tracing is
        // on, so a trace viewer finds the run by the id `convene run` prints.
        let run_id = uuid::Uuid::now_v7().to_string();
        let run_span = trace::run_span(&run_id, &principal.tenant, &spec.goal);
        let (trace_id, trace_parent) = trace::run_trace(&run_span);
        let identity = RunIdentity {
            run_id,
            trace_id,
            trace_parent,
        };
        // A planner's run has a plan span per round instead (its actor's).
        let plan_span = if domain.planner.is_some() {
            tracing::Span::none()
        } else {
            trace::plan_span(&run_span, "spec", domain.plan.len())
        };
        let (run, ev, start) =
            plan_span.in_scope(|| self.build_run(identity, &spec, &domain, &principal, now));
        plan_span.record("convene.plan.dropped", run.truncated.len());
        drop(plan_span);
        // Watched before it is stored, so that no commit of it can pass unseen; the
        // events stored with it are the last the watch has seen.
        let watch = wait.then(|| {
            let stored = ev.run.last().map(|e| e.sequence);
            (self.watchers.watch(&run.run_id), stored)
        });
        // The run's task tokens are asked for while the run is stored: neither waits for
        // the other. Tokens of a run that is not stored (a store error, a duplicate
        // idempotency key) never leave this process, and expire.
        let tokens = async {
            if start {
                let (_, tasks) = run::startable(&run);
                let max_depth = domain.limits.max_depth;
                Some(run::issue_tokens(&self.deps, &run, max_depth, &tasks, None).await)
            } else {
                None
            }
        }
        .instrument(run_span.clone());
        // The lease counts from before the store was asked (see `LeaseDeadline`).
        let leased_at = std::time::Instant::now();
        let (created, issued) =
            tokio::join!(self.deps.store.create(&run, key.as_ref(), &ev), tokens);
        match created.map_err(Error::from)? {
            Created::New => {
                tracing::info!(run_id = %run.run_id, tenant = %run.tenant, trace_id = %run.trace_id, delegations = run.delegations.len(), "run accepted");
                self.deps.crash.at(crate::crash::CrashPoint::AfterAccept);
                if start {
                    RunActor::spawn(
                        self.deps.clone(),
                        run.clone(),
                        domain,
                        Some(run_span),
                        issued,
                        (admitted, leased_at),
                    );
                } else {
                    trace::record_run_end(&run_span, &run);
                }
                let run = match watch {
                    Some((watch, seen)) => self.until_ended(run, watch, seen).await?,
                    None => run,
                };
                Ok(Response::new(v1::StartRunResponse {
                    run: Some(run),
                    created: true,
                }))
            }
            Created::Existing(existing) => {
                // The span of the run that was not created says which run answered.
                run_span.record("convene.run.duplicate_of", existing.run_id.as_str());
                if existing.spec.as_ref() == Some(&spec) {
                    let run = if wait && !is_terminal(existing.state) {
                        // Watched from now on, then read again: it may have ended
                        // between the first read and the watch.
                        let watch = self.watchers.watch(&existing.run_id);
                        let run = self.stored_run(&existing.run_id).await?;
                        self.until_ended(run, watch, None).await?
                    } else {
                        *existing
                    };
                    Ok(Response::new(v1::StartRunResponse {
                        run: Some(run),
                        created: false,
                    }))
                } else {
                    Err(Error::AlreadyExists(format!(
                        "idempotency key {:?} was already used by run {} with a different spec; use a new key for a new run",
                        key.map(|k| k.key).unwrap_or_default(),
                        existing.run_id
                    ))
                    .into())
                }
            }
        }
    }

    async fn get_run(
        &self,
        request: Request<v1::GetRunRequest>,
    ) -> Result<Response<v1::GetRunResponse>, Status> {
        let principal = self
            .principal(&request, &["runs:read", "runs:start"], "read runs")
            .await?;
        let run = self
            .run_of_tenant(&request.get_ref().run_id, &principal.tenant)
            .await?;
        Ok(Response::new(v1::GetRunResponse { run: Some(run) }))
    }

    async fn watch_run(
        &self,
        request: Request<v1::WatchRunRequest>,
    ) -> Result<Response<Self::WatchRunStream>, Status> {
        let principal = self
            .principal(&request, &["runs:read", "runs:start"], "watch runs")
            .await?;
        let req = request.into_inner();
        self.check_run_of_tenant(&req.run_id, &principal.tenant)
            .await?;
        // Held by the stream's task: given back when the stream ends or its client goes.
        let place = self.streams.open(&principal.id)?;
        let run_id = req.run_id;
        let store = self.deps.store.clone();
        let shutdown = self.shutdown.clone();
        let (tx, rx) = mpsc::channel(64);
        // Subscribe before reading the backlog so nothing committed in between is missed.
        let mut watch = self.watchers.watch(&run_id);
        tokio::spawn(async move {
            let _place = place;
            let mut lost = watch.receiver().borrow_and_update().lost;
            let mut last = req.after_sequence;
            let mut done = false;
            let (mut ended, mut waits) = (false, false);
            // The events the last note carried, when they follow on from `last`.
            let mut noted: Option<Vec<v1::RunEvent>> = None;
            loop {
                let batch = match noted.take() {
                    Some(events) => Ok(events),
                    None => store.run_events(&run_id, last).await,
                };
                match batch {
                    Ok(batch) => {
                        for e in batch {
                            last = e.sequence;
                            // The stream ends at the run's end, or at a wait it did
                            // not resume from (late results recorded meanwhile
                            // included).
                            match e.kind {
                                Some(Kind::Terminal(_)) => ended = true,
                                Some(Kind::Waiting(_)) => waits = true,
                                Some(Kind::Resumed(_)) => waits = false,
                                _ => {}
                            }
                            done = ended || waits;
                            if tx
                                .send(Ok(v1::WatchRunResponse { event: Some(e) }))
                                .await
                                .is_err()
                            {
                                return;
                            }
                        }
                    }
                    Err(e) => {
                        let _ = tx.send(Err(Error::from(e).into())).await;
                        return;
                    }
                }
                if done {
                    return;
                }
                // Go on only for a commit of this run past `last` (or after notes were
                // lost): with the events the note carries when they follow on from
                // `last`, else reading the store.
                loop {
                    tokio::select! {
                        changed = watch.receiver().changed() => {
                            if changed.is_err() {
                                return;
                            }
                            let note = watch.receiver().borrow_and_update();
                            if note.sequence > last || note.lost != lost {
                                if note.lost == lost {
                                    noted = note.events_after(last);
                                }
                                lost = note.lost;
                                break;
                            }
                        }
                        () = shutdown.wait() => {
                            let _ = tx.send(Err(Error::Unavailable("the supervisor is shutting down; watch again after it is back".to_owned()).into())).await;
                            return;
                        }
                        () = tx.closed() => return,
                    }
                }
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    async fn cancel_run(
        &self,
        request: Request<v1::CancelRunRequest>,
    ) -> Result<Response<v1::CancelRunResponse>, Status> {
        let principal = self
            .principal(&request, &["runs:start"], "cancel runs")
            .await?;
        let req = request.into_inner();
        let run = self.run_of_tenant(&req.run_id, &principal.tenant).await?;
        if is_final(run.state) {
            return Ok(Response::new(v1::CancelRunResponse {
                run: Some(run),
                outcome: v1::CommandOutcome::AlreadyEnded as i32,
                command_id: String::new(),
            }));
        }
        let (run, outcome, command_id) = self
            .command(&run.run_id, &principal, CommandKind::Cancel(req))
            .await?;
        let outcome = match outcome {
            Some(_) if run.state == v1::RunState::Cancelled as i32 => v1::CommandOutcome::Applied,
            Some(_) => v1::CommandOutcome::AlreadyEnded,
            None => v1::CommandOutcome::Pending,
        };
        Ok(Response::new(v1::CancelRunResponse {
            run: Some(run),
            outcome: outcome as i32,
            command_id,
        }))
    }

    async fn resume_run(
        &self,
        request: Request<v1::ResumeRunRequest>,
    ) -> Result<Response<v1::ResumeRunResponse>, Status> {
        let principal = self
            .principal(&request, &["runs:resolve"], "resume waiting runs")
            .await?;
        let req = request.into_inner();
        let run = self.run_of_tenant(&req.run_id, &principal.tenant).await?;
        check_resume(&req)?;
        if !is_waiting(run.state) {
            return Err(Error::FailedPrecondition(format!(
                "run {} is not waiting for people ({}); only a waiting run can be resumed",
                run.run_id,
                events::run_state_name(run.state)
            ))
            .into());
        }
        let (run, outcome, command_id) = self
            .command(&run.run_id, &principal, CommandKind::Resume(req))
            .await?;
        let outcome = match outcome {
            Some(done) if done.code == tonic::Code::Ok as i32 => v1::CommandOutcome::Applied,
            Some(done) => {
                return Err(Status::new(tonic::Code::from_i32(done.code), done.message));
            }
            None => v1::CommandOutcome::Pending,
        };
        Ok(Response::new(v1::ResumeRunResponse {
            run: Some(run),
            outcome: outcome as i32,
            command_id,
        }))
    }

    async fn list_runs(
        &self,
        request: Request<v1::ListRunsRequest>,
    ) -> Result<Response<v1::ListRunsResponse>, Status> {
        let principal = self
            .principal(&request, &["runs:read", "runs:start"], "list runs")
            .await?;
        let req = request.into_inner();
        let page_size = match req.page_size {
            0 => 50,
            n if n > 500 => {
                return Err(
                    Error::invalid("page_size", format!("{n} is over the maximum of 500")).into(),
                );
            }
            n => n as usize,
        };
        let after = if req.page_token.is_empty() {
            None
        } else {
            if uuid::Uuid::parse_str(&req.page_token).is_err() {
                return Err(Error::invalid(
                    "page_token",
                    "not a token from a previous ListRuns response",
                )
                .into());
            }
            Some(req.page_token.as_str())
        };
        let filter = list_filter(&req)?;
        let page = self
            .deps
            .store
            .list(&principal.tenant, &filter, page_size, after)
            .await
            .map_err(Error::from)?;
        Ok(Response::new(v1::ListRunsResponse {
            runs: page.runs.into_iter().map(summary).collect(),
            next_page_token: page.next.unwrap_or_default(),
        }))
    }

    async fn delegate(
        &self,
        request: Request<v1::DelegateRequest>,
    ) -> Result<Response<v1::DelegateResponse>, Status> {
        let caller = self.auth.authenticate(&request).await?;
        let Caller::Task(claims) = caller else {
            return Err(Error::PermissionDenied(
                "Delegate is called by a worker with its task token, not with a principal credential".to_owned(),
            )
            .into());
        };
        claims
            .check_audience("convene-supervisor")
            .map_err(|_| Error::PermissionDenied("your task token does not allow redelegation (its audience lacks convene-supervisor)".to_owned()))?;
        let token = bearer(&request)?.to_owned();
        let mailbox = match self.mailbox(&claims.run_id) {
            Ok(mailbox) => mailbox,
            // Another replica runs the run: the call goes to it.
            Err(not_here) => return self.forward_delegate(request, not_here).await,
        };
        let (reply, answer) = oneshot::channel();
        mailbox
            .send(Msg::Delegate(Box::new(DelegateAsk {
                claims,
                token,
                children: request.into_inner().delegations,
                reply,
                span: tracing::Span::current(),
            })))
            .map_err(|_| Error::FailedPrecondition("the run is no longer running".to_owned()))?;
        let outcomes = answer.await.map_err(|_| {
            Error::Unavailable("the run's owner stopped before the children finished".to_owned())
        })??;
        Ok(Response::new(v1::DelegateResponse { outcomes }))
    }

    async fn watch_events(
        &self,
        request: Request<v1::WatchEventsRequest>,
    ) -> Result<Response<Self::WatchEventsStream>, Status> {
        let principal = self
            .principal(&request, &["runs:read", "runs:start"], "watch events")
            .await?;
        let req = request.into_inner();
        if req.from_now && !req.after_event_id.is_empty() {
            return Err(Error::invalid(
                "from_now",
                "give after_event_id (resume after it) or from_now (start at the newest), not both",
            )
            .into());
        }
        if req.from_now && !req.follow {
            return Err(Error::invalid(
                "from_now",
                "needs follow: without it the stream would end at once, with nothing",
            )
            .into());
        }
        // Held by the stream's task: given back when the stream ends or its client goes.
        let place = self.streams.open(&principal.id)?;
        let store = self.deps.store.clone();
        let shutdown = self.shutdown.clone();
        let tenant = principal.tenant.clone();
        let (tx, rx) = mpsc::channel(256);
        // Subscribed before the newest event is looked up: whatever commits after it is
        // noticed.
        let mut notes = store.subscribe();
        let mut after = if req.from_now {
            // One lookup; the stream then follows on from there.
            store.newest_cloud_event().await.map_err(Error::from)?
        } else {
            (!req.after_event_id.is_empty()).then(|| req.after_event_id.clone())
        };
        tokio::spawn(async move {
            let _place = place;
            loop {
                loop {
                    let batch = match store.cloud_events(after.as_deref(), 512).await {
                        Ok(b) => b,
                        Err(e) => {
                            let _ = tx.send(Err(Error::from(e).into())).await;
                            return;
                        }
                    };
                    let Some(last) = batch.last() else { break };
                    after = Some(last.id.clone());
                    for e in batch {
                        let wanted = e.tenant_id == tenant
                            && (req.types.is_empty() || req.types.contains(&e.r#type))
                            && (req.run_id.is_empty() || e.correlation_id == req.run_id);
                        if wanted
                            && tx
                                .send(Ok(v1::WatchEventsResponse { event: Some(e) }))
                                .await
                                .is_err()
                        {
                            return;
                        }
                    }
                }
                if !req.follow {
                    return;
                }
                // Read the outbox again only once a commit added to it.
                loop {
                    tokio::select! {
                        note = notes.recv() => match note {
                            Ok(c) if !c.cloud => {}
                            Ok(_) | Err(broadcast::error::RecvError::Lagged(_)) => break,
                            Err(broadcast::error::RecvError::Closed) => return,
                        },
                        () = shutdown.wait() => {
                            let _ = tx.send(Err(Error::Unavailable("the supervisor is shutting down; resume from your last event id".to_owned()).into())).await;
                            return;
                        }
                        () = tx.closed() => return,
                    }
                }
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }
}
