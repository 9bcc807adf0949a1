//! The A2A operations, each a call (or a few) to the supervisor made with the caller's
//! own credential, so the supervisor's roles and tenant scoping apply unchanged.
//!
//! - **SendMessage** without a task id starts a run from a skill (a run template): the
//!   message's text parts become the `note` input, its data parts' fields the other
//!   inputs; `metadata.skill` names the skill (default: the first one). Metadata
//!   `convene.join` and `convene.limits` (protobuf JSON) tighten the template. The
//!   message id is the run's idempotency key, so a message sent twice is one task.
//!   With a task id it answers a task in INPUT_REQUIRED: a text part (the rationale)
//!   and a data part `{"settle": {...}}`, `{"follow_up": {...}}` or `{"close": {}}`,
//!   as ResumeRun takes them. It blocks until the run stops unless
//!   `configuration.returnImmediately` is set.
//! - **GetTask**, **ListTasks** (the caller's own tasks only), **CancelTask** (cancels
//!   the run; an ended task is TaskNotCancelable), **SubscribeToTask** and
//!   **SendStreamingMessage** (the Task first, then artifact and status updates until
//!   the task stops).
//! - Another principal's task id is TaskNotFound, as an unknown one is.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use a2a::{
    A2AError, CancelTaskRequest, DeleteTaskPushNotificationConfigRequest,
    GetExtendedAgentCardRequest, GetTaskPushNotificationConfigRequest, GetTaskRequest,
    ListTaskPushNotificationConfigsRequest, ListTaskPushNotificationConfigsResponse,
    ListTasksRequest, ListTasksResponse, Message, PartContent, SendMessageRequest,
    SendMessageResponse, StreamResponse, Task, TaskArtifactUpdateEvent, TaskPushNotificationConfig,
    TaskState, TaskStatusUpdateEvent,
};
use a2a_server::{RequestHandler, ServiceParams};
use async_trait::async_trait;
use convene_mesh::handles::{BoxStream, SupervisorHandle};
use convene_mesh::policy_file::{Policy, Principal};
use convene_proto::v1;
use futures::StreamExt;
use futures::stream::BoxStream as FutBoxStream;
use serde_json::Value;
use tonic::{Code, Status};
use tracing::Instrument;

use crate::convert::{self, stopped, task_state};
use crate::tasks::{TaskMap, TaskRecord};

/// Most tasks ListTasks returns at once.
pub const MAX_PAGE_SIZE: i32 = 100;
/// Tasks ListTasks returns when the caller does not say.
pub const DEFAULT_PAGE_SIZE: i32 = 50;
/// How long CancelTask waits for the run's owner to apply a stored cancellation.
pub const CANCEL_WAIT: Duration = Duration::from_secs(10);

/// The metadata key naming the skill a message starts.
pub const SKILL_KEY: &str = "skill";
/// The metadata key of a join contract that tightens the template's.
pub const JOIN_KEY: &str = "convene.join";
/// The metadata key of limits that tighten the template's.
pub const LIMITS_KEY: &str = "convene.limits";

/// The gateway's request handler.
#[derive(Clone)]
pub struct Gateway {
    inner: Arc<Inner>,
}

struct Inner {
    supervisor: SupervisorHandle,
    policy: Arc<Policy>,
    tasks: TaskMap,
    skills: Vec<String>,
}

impl std::fmt::Debug for Gateway {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gateway")
            .field("skills", &self.inner.skills)
            .finish_non_exhaustive()
    }
}

/// Who is calling, with the credential the supervisor is called with.
#[derive(Clone)]
struct Caller {
    principal: Arc<Principal>,
    credential: String,
}

impl Gateway {
    /// A gateway starting runs on `supervisor`, authenticating callers against
    /// `policy`'s principals, keeping its tasks in `tasks`, offering `skills` (template
    /// ids; the first is the default).
    pub fn new(
        supervisor: SupervisorHandle,
        policy: Arc<Policy>,
        tasks: TaskMap,
        skills: Vec<String>,
    ) -> Self {
        Self {
            inner: Arc::new(Inner {
                supervisor,
                policy,
                tasks,
                skills,
            }),
        }
    }
}

/// The bearer credential of a request's headers, if any.
pub(crate) fn bearer(params: &ServiceParams) -> Option<&str> {
    let value = params.get("authorization")?.first()?;
    let credential = value
        .strip_prefix("Bearer ")
        .or_else(|| value.strip_prefix("bearer "))?
        .trim();
    (!credential.is_empty()).then_some(credential)
}

/// A span for one A2A operation, continuing the caller's trace when its headers carry a
/// `traceparent`.
fn span(operation: &'static str, params: &ServiceParams) -> tracing::Span {
    let span = tracing::info_span!(
        "a2a.request",
        otel.name = operation,
        convene.service = "gateway",
        a2a.method = operation,
    );
    if let Some(parent) = params.get("traceparent").and_then(|v| v.first()) {
        convene_telemetry::continue_trace(&span, parent);
    }
    span
}

/// Now, in milliseconds since the Unix epoch.
pub(crate) fn now_millis() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

/// A supervisor refusal as an A2A error, its message kept (it says what to fix).
fn from_status(status: &Status) -> A2AError {
    let message = status.message().to_owned();
    match status.code() {
        Code::InvalidArgument | Code::AlreadyExists | Code::OutOfRange => {
            A2AError::invalid_params(message)
        }
        Code::NotFound => A2AError::invalid_params(message),
        Code::PermissionDenied | Code::Unauthenticated => {
            A2AError::invalid_request(format!("permission denied: {message}"))
        }
        Code::FailedPrecondition => A2AError::unsupported_operation(message),
        Code::Unavailable | Code::DeadlineExceeded | Code::ResourceExhausted => A2AError::internal(
            format!("the supervisor is unavailable, try again: {message}"),
        ),
        _ => A2AError::internal(format!("the supervisor failed: {message}")),
    }
}

fn store_error(e: &convene_store::Error) -> A2AError {
    tracing::error!(error = %e, "the A2A task store failed");
    A2AError::internal("the gateway's task store is unavailable, try again")
}

/// The value of `key` in the request's or the message's metadata.
fn meta<'a>(req: &'a SendMessageRequest, key: &str) -> Option<&'a Value> {
    req.metadata
        .as_ref()
        .and_then(|m| m.get(key))
        .or_else(|| req.message.metadata.as_ref().and_then(|m| m.get(key)))
}

/// The message's text parts, joined by newlines.
fn text_of(message: &Message) -> String {
    message
        .parts
        .iter()
        .filter_map(|p| match &p.content {
            PartContent::Text(t) => Some(t.trim()),
            _ => None,
        })
        .filter(|t| !t.is_empty())
        .collect::<Vec<_>>()
        .join("\n")
}

/// The fields of the message's data parts, merged in order.
fn data_of(message: &Message) -> Result<serde_json::Map<String, Value>, A2AError> {
    let mut fields = serde_json::Map::new();
    for (i, part) in message.parts.iter().enumerate() {
        match &part.content {
            PartContent::Text(_) => {}
            PartContent::Data(Value::Object(map)) => fields.extend(map.clone()),
            PartContent::Data(_) => {
                return Err(A2AError::invalid_params(format!(
                    "message.parts[{i}]: a data part must be a JSON object of named inputs"
                )));
            }
            PartContent::Raw(_) | PartContent::Url(_) => {
                return Err(A2AError::invalid_params(format!(
                    "message.parts[{i}]: file parts are not accepted; send text and data parts"
                )));
            }
        }
    }
    Ok(fields)
}

/// A protobuf message from the JSON under metadata `key`, or INVALID_PARAMS naming it.
fn proto_meta<T: convene_proto::json::Named>(
    req: &SendMessageRequest,
    key: &str,
) -> Result<Option<T>, A2AError> {
    meta(req, key)
        .map(|value| {
            convene_proto::json::from_value(value.clone())
                .map_err(|e| A2AError::invalid_params(format!("metadata.{key}: {e}")))
        })
        .transpose()
}

impl Inner {
    fn caller(&self, params: &ServiceParams) -> Result<Caller, A2AError> {
        let credential = bearer(params).ok_or_else(|| {
            A2AError::invalid_request("missing `Authorization: Bearer <credential>`")
        })?;
        let principal = self
            .policy
            .principal_by_credential(credential)
            .ok_or_else(|| A2AError::invalid_request("unknown credential"))?;
        Ok(Caller {
            principal: Arc::new(principal.clone()),
            credential: credential.to_owned(),
        })
    }

    fn request<T>(c: &Caller, message: T) -> tonic::Request<T> {
        convene_mesh::auth::request(message, &c.credential)
    }

    async fn get_run(&self, c: &Caller, record: &TaskRecord) -> Result<v1::Run, A2AError> {
        match self
            .supervisor
            .get_run(Self::request(
                c,
                v1::GetRunRequest {
                    run_id: record.run_id.clone(),
                },
            ))
            .await
        {
            Ok(r) => r
                .into_inner()
                .run
                .ok_or_else(|| A2AError::internal("the supervisor returned no run")),
            Err(s) if s.code() == Code::NotFound => Err(A2AError::task_not_found(&record.task_id)),
            Err(s) => Err(from_status(&s)),
        }
    }

    async fn record(&self, c: &Caller, task_id: &str) -> Result<TaskRecord, A2AError> {
        self.tasks
            .get(&c.principal.id, task_id)
            .await
            .map_err(|e| store_error(&e))?
            .ok_or_else(|| A2AError::task_not_found(task_id))
    }

    /// Starts a run for a message without a task id, or answers the task it names.
    async fn accept(
        &self,
        c: &Caller,
        req: &SendMessageRequest,
    ) -> Result<(TaskRecord, v1::Run, Answered), A2AError> {
        match req.message.task_id.as_deref().filter(|t| !t.is_empty()) {
            Some(task_id) => {
                let record = self.record(c, task_id).await?;
                let (run, ticket) = self.answer(c, &record, &req.message).await?;
                Ok((record, run, Some(ticket)))
            }
            None => {
                let (record, run) = self.start(c, req).await?;
                Ok((record, run, None))
            }
        }
    }

    async fn start(
        &self,
        c: &Caller,
        req: &SendMessageRequest,
    ) -> Result<(TaskRecord, v1::Run), A2AError> {
        let skill = match meta(req, SKILL_KEY) {
            Some(Value::String(s)) => s.clone(),
            Some(_) => {
                return Err(A2AError::invalid_params(
                    "metadata.skill must be a string: the id of one of the card's skills",
                ));
            }
            None => self.skills.first().cloned().ok_or_else(|| {
                A2AError::unsupported_operation(
                    "this gateway offers no skills: configure run templates (templates_file)",
                )
            })?,
        };
        if !self.skills.contains(&skill) {
            return Err(A2AError::invalid_params(format!(
                "metadata.skill: unknown skill {skill:?}; this agent's skills: {}",
                self.skills.join(", ")
            )));
        }
        let mut inputs: HashMap<String, String> = data_of(&req.message)?
            .into_iter()
            .map(|(k, v)| {
                let v = match v {
                    Value::String(s) => s,
                    other => other.to_string(),
                };
                (k, v)
            })
            .collect();
        let text = text_of(&req.message);
        if !text.is_empty() {
            let note = inputs.remove(convene_supervisor::templates::NOTE_INPUT);
            let note = note.map_or(text.clone(), |n| format!("{n}\n{text}"));
            inputs.insert(convene_supervisor::templates::NOTE_INPUT.to_owned(), note);
        }
        let join: Option<v1::JoinContract> = proto_meta(req, JOIN_KEY)?;
        let limits: Option<v1::Limits> = proto_meta(req, LIMITS_KEY)?;
        let spec = v1::RunSpec {
            idempotency_key: if req.message.message_id.is_empty() {
                String::new()
            } else {
                format!("a2a:{}", req.message.message_id)
            },
            join,
            limits,
            ..Default::default()
        };
        let started = self
            .supervisor
            .start_run(Self::request(
                c,
                v1::StartRunRequest {
                    spec: Some(spec),
                    wait: false,
                    template: skill.clone(),
                    inputs,
                },
            ))
            .await
            .map_err(|s| from_status(&s))?
            .into_inner();
        let run = started
            .run
            .ok_or_else(|| A2AError::internal("the supervisor returned no run"))?;
        let record = TaskRecord {
            task_id: uuid::Uuid::new_v4().to_string(),
            context_id: req
                .message
                .context_id
                .clone()
                .filter(|c| !c.is_empty())
                .unwrap_or_else(|| uuid::Uuid::new_v4().to_string()),
            tenant: c.principal.tenant.clone(),
            principal: c.principal.id.clone(),
            run_id: run.run_id.clone(),
            skill,
            created_at: now_millis(),
        };
        let record = self
            .tasks
            .insert(record)
            .await
            .map_err(|e| store_error(&e))?;
        tracing::info!(task = %record.task_id, run = %record.run_id, principal = %record.principal, "A2A task started a run");
        Ok((record, run))
    }

    /// Answers a task in INPUT_REQUIRED: the run's ticket, with the message's input.
    async fn answer(
        &self,
        c: &Caller,
        record: &TaskRecord,
        message: &Message,
    ) -> Result<(v1::Run, String), A2AError> {
        let run = self.get_run(c, record).await?;
        let state = task_state(run.state);
        if state != TaskState::InputRequired {
            let why = if state.is_terminal() {
                "has ended; send a message without taskId to start a new task"
            } else {
                "is working; it takes a message only while INPUT_REQUIRED"
            };
            return Err(A2AError::unsupported_operation(format!(
                "task {} {why} (state {state:?})",
                record.task_id
            )));
        }
        let rationale = text_of(message);
        if rationale.is_empty() {
            return Err(A2AError::invalid_params(
                "message.parts: give your rationale as a text part",
            ));
        }
        let data = data_of(message)?;
        let input = resume_input(&data)?;
        let ticket = run
            .ticket
            .as_ref()
            .map(|t| t.id.clone())
            .unwrap_or_default();
        let resumed = self
            .supervisor
            .resume_run(Self::request(
                c,
                v1::ResumeRunRequest {
                    run_id: run.run_id.clone(),
                    ticket: run.ticket.clone(),
                    rationale,
                    input: Some(input),
                },
            ))
            .await
            .map_err(|s| from_status(&s))?
            .into_inner();
        Ok((resumed.run.unwrap_or(run), ticket))
    }

    /// Follows the run until it stops: it ends, or waits for people again.
    async fn wait_stopped(
        self: &Arc<Self>,
        c: &Caller,
        record: &TaskRecord,
        run: v1::Run,
        answered: &Answered,
    ) -> Result<v1::Run, A2AError> {
        let mut follower = Follower::new(self.clone(), c.clone(), record.clone(), &run);
        let mut run = run;
        while !settled(&run, answered) {
            run = follower.next().await?;
        }
        Ok(run)
    }

    /// The Task, then its updates until it stops, on a stream.
    fn follow(
        self: &Arc<Self>,
        c: Caller,
        record: TaskRecord,
        run: v1::Run,
        answered: Answered,
    ) -> FutBoxStream<'static, Result<StreamResponse, A2AError>> {
        let (tx, rx) = tokio::sync::mpsc::channel(16);
        let inner = self.clone();
        let span = tracing::Span::current();
        tokio::spawn(
            async move {
                let first = convert::task(&record, &run, true);
                let mut sent_state = first.status.state.clone();
                let mut sent_revision = first
                    .artifacts
                    .as_ref()
                    .and(run.decision.as_ref().map(|d| d.revision));
                if tx.send(Ok(StreamResponse::Task(first))).await.is_err() {
                    return;
                }
                // A task that has stopped already (ended, or waiting for its caller)
                // has nothing more to stream.
                if settled(&run, &answered) {
                    return;
                }
                let mut follower = Follower::new(inner, c, record.clone(), &run);
                loop {
                    let run = match follower.next().await {
                        Ok(run) => run,
                        Err(e) => {
                            let _ = tx.send(Err(e)).await;
                            return;
                        }
                    };
                    let state = task_state(run.state);
                    let revision = run.decision.as_ref().map(|d| d.revision);
                    let mut updates = Vec::new();
                    if stopped(&state) && revision.is_some() && revision != sent_revision {
                        for artifact in convert::artifacts(&run) {
                            updates.push(StreamResponse::ArtifactUpdate(TaskArtifactUpdateEvent {
                                task_id: record.task_id.clone(),
                                context_id: record.context_id.clone(),
                                artifact,
                                append: Some(false),
                                last_chunk: Some(true),
                                metadata: None,
                            }));
                        }
                        sent_revision = revision;
                    }
                    if state != sent_state {
                        updates.push(StreamResponse::StatusUpdate(TaskStatusUpdateEvent {
                            task_id: record.task_id.clone(),
                            context_id: record.context_id.clone(),
                            status: convert::status(&record, &run),
                            metadata: Some(convert::metadata(&record, &run)),
                        }));
                        sent_state = state.clone();
                    }
                    for update in updates {
                        if tx.send(Ok(update)).await.is_err() {
                            return;
                        }
                    }
                    if settled(&run, &answered) {
                        return;
                    }
                }
            }
            .instrument(span),
        );
        tokio_stream::wrappers::ReceiverStream::new(rx).boxed()
    }
}

/// The ticket of the wait a message answered, while the task's run may still show it.
type Answered = Option<String>;

/// Whether a task has stopped for its caller: its run ended, or waits for people on a
/// wait other than the one just `answered` (a ResumeRun stored for the run's owner
/// leaves the run waiting until the owner applies it).
fn settled(run: &v1::Run, answered: &Answered) -> bool {
    let state = task_state(run.state);
    let stale = state == TaskState::InputRequired
        && answered.is_some()
        && run.ticket.as_ref().map(|t| &t.id) == answered.as_ref();
    stopped(&state) && !stale
}

/// The ResumeRun input a message's data asks for.
fn resume_input(
    data: &serde_json::Map<String, Value>,
) -> Result<v1::resume_run_request::Input, A2AError> {
    use v1::resume_run_request::Input;
    let parse = |key: &str, value: &Value| -> Result<Input, A2AError> {
        let bad = |e: convene_proto::json::Error| {
            A2AError::invalid_params(format!("message data `{key}`: {e}"))
        };
        Ok(match key {
            "settle" => Input::Settle(convene_proto::json::from_value(value.clone()).map_err(bad)?),
            "follow_up" => {
                Input::FollowUp(convene_proto::json::from_value(value.clone()).map_err(bad)?)
            }
            _ => Input::Close(v1::CloseRun {}),
        })
    };
    let mut found = data
        .iter()
        .filter(|(k, _)| matches!(k.as_str(), "settle" | "follow_up" | "close"));
    match (found.next(), found.next()) {
        (Some((key, value)), None) => parse(key, value),
        _ => Err(A2AError::invalid_params(
            "message data: give exactly one of {\"settle\": {\"topic\": ..., \"delegation_id\": ..., \"evidence_ids\": [...]}}, {\"follow_up\": {\"profile_id\": ..., \"goal\": ...}} or {\"close\": {}}",
        )),
    }
}

/// Follows a run's events, yielding the run each time its task state or decision
/// changes. The run's state is always read afresh (GetRun), so events replayed from
/// before the follow began change nothing.
struct Follower {
    inner: Arc<Inner>,
    caller: Caller,
    record: TaskRecord,
    after: u64,
    stream: Option<BoxStream<v1::WatchRunResponse>>,
    last: (TaskState, Option<u32>, Option<String>),
}

impl Follower {
    fn new(inner: Arc<Inner>, caller: Caller, record: TaskRecord, run: &v1::Run) -> Self {
        Self {
            inner,
            caller,
            record,
            after: 0,
            stream: None,
            last: Self::key(run),
        }
    }

    fn key(run: &v1::Run) -> (TaskState, Option<u32>, Option<String>) {
        (
            task_state(run.state),
            run.decision.as_ref().map(|d| d.revision),
            run.ticket.as_ref().map(|t| t.id.clone()),
        )
    }

    async fn next(&mut self) -> Result<v1::Run, A2AError> {
        loop {
            if self.stream.is_none() {
                let stream = self
                    .inner
                    .supervisor
                    .watch_run(Inner::request(
                        &self.caller,
                        v1::WatchRunRequest {
                            run_id: self.record.run_id.clone(),
                            after_sequence: self.after,
                        },
                    ))
                    .await
                    .map_err(|s| from_status(&s))?
                    .into_inner();
                self.stream = Some(stream);
            }
            let event = self.stream.as_mut().expect("opened above").next().await;
            match event {
                Some(Ok(event)) => {
                    if let Some(e) = event.event {
                        self.after = self.after.max(e.sequence);
                    }
                }
                Some(Err(status)) => {
                    self.stream = None;
                    return Err(from_status(&status));
                }
                None => {
                    self.stream = None;
                    // The stream ends where the run stops; the next one follows a
                    // waiting run until it stops again. Do not spin on a run that
                    // has ended.
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
            let run = self.inner.get_run(&self.caller, &self.record).await?;
            let key = Self::key(&run);
            if key != self.last || key.0.is_terminal() {
                self.last = key;
                return Ok(run);
            }
        }
    }
}

#[async_trait]
impl RequestHandler for Gateway {
    async fn send_message(
        &self,
        params: &ServiceParams,
        req: SendMessageRequest,
    ) -> Result<SendMessageResponse, A2AError> {
        let inner = self.inner.clone();
        let c = inner.caller(params)?;
        async move {
            let (record, run, answered) = inner.accept(&c, &req).await?;
            let immediately = req
                .configuration
                .as_ref()
                .and_then(|c| c.return_immediately)
                .unwrap_or(false);
            let run = if immediately {
                run
            } else {
                inner.wait_stopped(&c, &record, run, &answered).await?
            };
            Ok(SendMessageResponse::Task(convert::task(
                &record, &run, true,
            )))
        }
        .instrument(span("SendMessage", params))
        .await
    }

    async fn send_streaming_message(
        &self,
        params: &ServiceParams,
        req: SendMessageRequest,
    ) -> Result<FutBoxStream<'static, Result<StreamResponse, A2AError>>, A2AError> {
        let inner = self.inner.clone();
        let c = inner.caller(params)?;
        async move {
            let (record, run, answered) = inner.accept(&c, &req).await?;
            Ok(inner.follow(c, record, run, answered))
        }
        .instrument(span("SendStreamingMessage", params))
        .await
    }

    async fn get_task(
        &self,
        params: &ServiceParams,
        req: GetTaskRequest,
    ) -> Result<Task, A2AError> {
        let inner = self.inner.clone();
        let c = inner.caller(params)?;
        async move {
            let record = inner.record(&c, &req.id).await?;
            let run = inner.get_run(&c, &record).await?;
            Ok(convert::task(&record, &run, true))
        }
        .instrument(span("GetTask", params))
        .await
    }

    async fn list_tasks(
        &self,
        params: &ServiceParams,
        req: ListTasksRequest,
    ) -> Result<ListTasksResponse, A2AError> {
        let inner = self.inner.clone();
        let c = inner.caller(params)?;
        async move {
            let page_size = match req.page_size {
                None | Some(0) => DEFAULT_PAGE_SIZE,
                Some(n) if (1..=MAX_PAGE_SIZE).contains(&n) => n,
                Some(n) => {
                    return Err(A2AError::invalid_params(format!(
                        "pageSize {n}: give 1 to {MAX_PAGE_SIZE}"
                    )));
                }
            };
            let offset: u64 = match req.page_token.as_deref().filter(|t| !t.is_empty()) {
                None => 0,
                Some(token) => token.parse().map_err(|_| {
                    A2AError::invalid_params(format!(
                        "pageToken {token:?} is not one this gateway issued; pass a previous response's nextPageToken"
                    ))
                })?,
            };
            let page = inner
                .tasks
                .list(
                    &c.principal.id,
                    req.context_id.as_deref().filter(|c| !c.is_empty()),
                    offset,
                    u64::try_from(page_size).unwrap_or(50),
                )
                .await
                .map_err(|e| store_error(&e))?;
            let runs = futures::future::join_all(
                page.tasks.iter().map(|record| inner.get_run(&c, record)),
            )
            .await;
            let with_artifacts = req.include_artifacts.unwrap_or(false);
            let mut tasks = Vec::new();
            for (record, run) in page.tasks.iter().zip(runs) {
                let run = match run {
                    Ok(run) => run,
                    // A run the supervisor no longer has is left out.
                    Err(e) if e.code == a2a::error_code::TASK_NOT_FOUND => continue,
                    Err(e) => return Err(e),
                };
                let task = convert::task(record, &run, with_artifacts);
                if req.status.as_ref().is_some_and(|s| *s != task.status.state) {
                    continue;
                }
                if let (Some(after), Some(at)) = (req.status_timestamp_after, task.status.timestamp)
                    && at <= after
                {
                    continue;
                }
                tasks.push(task);
            }
            let next = offset + page.tasks.len() as u64;
            Ok(ListTasksResponse {
                tasks,
                next_page_token: if next < page.total {
                    next.to_string()
                } else {
                    String::new()
                },
                page_size,
                total_size: i32::try_from(page.total).unwrap_or(i32::MAX),
            })
        }
        .instrument(span("ListTasks", params))
        .await
    }

    async fn cancel_task(
        &self,
        params: &ServiceParams,
        req: CancelTaskRequest,
    ) -> Result<Task, A2AError> {
        let inner = self.inner.clone();
        let c = inner.caller(params)?;
        async move {
            let record = inner.record(&c, &req.id).await?;
            let run = inner.get_run(&c, &record).await?;
            if task_state(run.state).is_terminal() {
                return Err(A2AError::task_not_cancelable(&record.task_id));
            }
            let cancelled = inner
                .supervisor
                .cancel_run(Inner::request(
                    &c,
                    v1::CancelRunRequest {
                        run_id: record.run_id.clone(),
                        reason: format!("cancelled over A2A by {}", c.principal.id),
                    },
                ))
                .await
                .map_err(|s| from_status(&s))?
                .into_inner();
            if cancelled.outcome == v1::CommandOutcome::AlreadyEnded as i32 {
                return Err(A2AError::task_not_cancelable(&record.task_id));
            }
            let mut run = cancelled.run.unwrap_or(run);
            if !task_state(run.state).is_terminal() {
                // Stored for the replica that owns the run: wait a little for it.
                let waited = tokio::time::timeout(CANCEL_WAIT, async {
                    let mut follower =
                        Follower::new(inner.clone(), c.clone(), record.clone(), &run);
                    loop {
                        let next = follower.next().await?;
                        if task_state(next.state).is_terminal() {
                            return Ok::<_, A2AError>(next);
                        }
                    }
                })
                .await;
                if let Ok(next) = waited {
                    run = next?;
                }
            }
            Ok(convert::task(&record, &run, true))
        }
        .instrument(span("CancelTask", params))
        .await
    }

    async fn subscribe_to_task(
        &self,
        params: &ServiceParams,
        req: a2a::SubscribeToTaskRequest,
    ) -> Result<FutBoxStream<'static, Result<StreamResponse, A2AError>>, A2AError> {
        let inner = self.inner.clone();
        let c = inner.caller(params)?;
        async move {
            let record = inner.record(&c, &req.id).await?;
            let run = inner.get_run(&c, &record).await?;
            if task_state(run.state).is_terminal() {
                return Err(A2AError::unsupported_operation(format!(
                    "task {} has ended; read it with GetTask",
                    record.task_id
                )));
            }
            Ok(inner.follow(c, record, run, None))
        }
        .instrument(span("SubscribeToTask", params))
        .await
    }

    async fn create_push_config(
        &self,
        _params: &ServiceParams,
        _req: TaskPushNotificationConfig,
    ) -> Result<TaskPushNotificationConfig, A2AError> {
        Err(A2AError::push_notification_not_supported())
    }

    async fn get_push_config(
        &self,
        _params: &ServiceParams,
        _req: GetTaskPushNotificationConfigRequest,
    ) -> Result<TaskPushNotificationConfig, A2AError> {
        Err(A2AError::push_notification_not_supported())
    }

    async fn list_push_configs(
        &self,
        _params: &ServiceParams,
        _req: ListTaskPushNotificationConfigsRequest,
    ) -> Result<ListTaskPushNotificationConfigsResponse, A2AError> {
        Err(A2AError::push_notification_not_supported())
    }

    async fn delete_push_config(
        &self,
        _params: &ServiceParams,
        _req: DeleteTaskPushNotificationConfigRequest,
    ) -> Result<(), A2AError> {
        Err(A2AError::push_notification_not_supported())
    }

    async fn get_extended_agent_card(
        &self,
        _params: &ServiceParams,
        _req: GetExtendedAgentCardRequest,
    ) -> Result<a2a::AgentCard, A2AError> {
        Err(A2AError::extended_card_not_configured())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_answer_takes_exactly_one_input() {
        let data = |v: Value| v.as_object().expect("object").clone();
        assert!(matches!(
            resume_input(&data(serde_json::json!({"close": {}}))),
            Ok(v1::resume_run_request::Input::Close(_))
        ));
        let settle = resume_input(&data(serde_json::json!({
            "settle": {"topic": "primary_cause", "delegation_id": "d1", "evidence_ids": ["e1"]}
        })))
        .expect("settle");
        assert!(
            matches!(settle, v1::resume_run_request::Input::Settle(s) if s.topic == "primary_cause" && s.evidence_ids == ["e1"])
        );
        let err = resume_input(&data(serde_json::json!({"close": {}, "settle": {}}))).unwrap_err();
        assert!(err.message.contains("exactly one"), "{}", err.message);
        let err = resume_input(&data(serde_json::json!({"settle": {"nope": 1}}))).unwrap_err();
        assert!(err.message.contains("settle"), "{}", err.message);
    }

    #[test]
    fn the_bearer_comes_from_the_authorization_header() {
        let mut params = ServiceParams::new();
        assert_eq!(bearer(&params), None);
        params.insert("authorization".into(), vec!["Bearer  abc ".into()]);
        assert_eq!(bearer(&params), Some("abc"));
        params.insert("authorization".into(), vec!["Basic abc".into()]);
        assert_eq!(bearer(&params), None);
    }
}
