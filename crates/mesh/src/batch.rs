//! Sending many calls to a message, for a process that reaches a service over the
//! network.
//!
//! [`Batcher`] sends calls of one kind through one task. A call that finds a free slot
//! goes out at once, alone, as the call it is; calls that arrive while every slot is
//! taken wait for the next free one and go out together as one batch message. So a lone
//! call waits for nobody, and under load a process's messages to the service stop
//! growing with its calls. Two handles use it, both for a worker:
//!
//! - [`BatchingPolicy`]: `Authorize` calls, together as one `AuthorizeBatch`;
//! - [`BatchingEvidence`]: `PutArtifact` calls, together as one `PutArtifactBatch`, each
//!   item carrying the task token its call had as its bearer credential. Puts whose
//!   content is large go alone, and a batch holds at most [`MAX_BATCH_BYTES`] of
//!   content, so it stays far within the store's message limit.
//!
//! Each batched item carries the `traceparent` of the span that asked for it, so the
//! service's span of that item is still a child of the asking tool call's, and the
//! batch's own span is linked to every one of them. A service without the batch method
//! (an older version, during a rolling upgrade) answers `UNIMPLEMENTED`; the handle then
//! sends each call on its own, and keeps doing so. A batch the service finds too large
//! (`OUT_OF_RANGE`, a message limit configured smaller than the batch) is sent again
//! call by call. Every other method forwards as it is.
//!
//! In one process there is nothing to batch: the service is a direct call.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use convene_proto::v1::{
    self, authorize_batch_result, evidence_store_server::EvidenceStore, policy_server::Policy,
    put_artifact_batch_result,
};
use futures::StreamExt as _;
use futures::stream::FuturesUnordered;
use tokio::sync::{mpsc, oneshot};
use tonic::{Code, Request, Response, Status};
use tracing::{Instrument as _, Span};

use crate::auth::bearer;
use crate::handles::{EvidenceHandle, PolicyHandle};

/// Most calls one batch carries (the policy service and the evidence store take up to
/// 256).
pub const MAX_BATCH: usize = 256;

/// Most content bytes the puts of one `PutArtifactBatch` carry together; a put larger
/// than [`MAX_BATCHED_PUT_BYTES`] always goes alone.
pub const MAX_BATCH_BYTES: usize = 1024 * 1024;

/// Largest put content that may share a message with others.
pub const MAX_BATCHED_PUT_BYTES: usize = 64 * 1024;

/// Calls on their way at once before further calls wait to go out together.
pub const DEFAULT_SLOTS: usize = 1;

/// The answer to one call.
pub type Answer<T> = Result<Response<T>, Status>;

/// One kind of call a [`Batcher`] sends: how it goes alone, and how many go together.
#[tonic::async_trait]
pub trait Batched: Send + Sync + 'static {
    /// The call's request message.
    type Request: Send + 'static;
    /// The call's response message.
    type Response: Send + 'static;

    /// The service the calls go to, as messages name it ("the policy service").
    const SERVICE: &'static str;
    /// The batch method, as messages name it ("AuthorizeBatch").
    const METHOD: &'static str;

    /// Sends one call as the call it is, in the current span.
    async fn alone(&self, request: Request<Self::Request>) -> Answer<Self::Response>;

    /// Sends `calls`, each with the `traceparent` of the span that asked for it, as one
    /// batch message, in the current span (the batch's): one answer per call, in order,
    /// or the error of the batch as a whole. The calls are lent, not given: a batch the
    /// service refuses whole may still go call by call.
    async fn together(
        &self,
        calls: Vec<(&Request<Self::Request>, String)>,
    ) -> Result<Vec<Answer<Self::Response>>, Status>;

    /// The span of a batch of `calls` calls.
    fn batch_span(&self, calls: usize) -> Span;

    /// How many bytes of a batch's [`MAX_BATCH_BYTES`] the call takes, or `None` when it
    /// must go alone.
    fn weight(&self, _request: &Request<Self::Request>) -> Option<usize> {
        Some(0)
    }
}

/// One call waiting to be sent.
struct Pending<B: Batched> {
    request: Request<B::Request>,
    /// The asking span: a call sent alone is made in it; a batched call carries its
    /// trace context, and the batch's span is linked to it.
    span: Span,
    done: oneshot::Sender<Answer<B::Response>>,
}

/// Sends calls of kind `B` through one task; see the module docs.
pub struct Batcher<B: Batched> {
    tx: mpsc::UnboundedSender<Pending<B>>,
}

impl<B: Batched> std::fmt::Debug for Batcher<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Batcher")
            .field("service", &B::SERVICE)
            .finish_non_exhaustive()
    }
}

impl<B: Batched> Batcher<B> {
    /// Sends through `calls` with `slots` calls on their way at most (at least one).
    /// Starts the sending task, which ends when the batcher is dropped. Call it inside a
    /// Tokio runtime.
    pub fn new(calls: B, slots: usize) -> Self {
        let (tx, rx) = mpsc::unbounded_channel();
        let sender = Sender {
            calls: Arc::new(calls),
            batching: Arc::new(AtomicBool::new(true)),
        };
        tokio::spawn(sender.run(rx, slots.max(1)));
        Self { tx }
    }

    /// Sends `request` alone or with others, and answers as the call itself would.
    pub async fn call(&self, request: Request<B::Request>) -> Answer<B::Response> {
        let (done, answer) = oneshot::channel();
        let call = Pending {
            request,
            span: Span::current(),
            done,
        };
        if self.tx.send(call).is_err() {
            return Err(Status::unavailable(format!(
                "the task sending calls to {} stopped; the process is shutting down",
                B::SERVICE
            )));
        }
        answer.await.unwrap_or_else(|_| {
            Err(Status::unavailable(format!(
                "the task sending calls to {} stopped before it answered; the process is \
                 shutting down",
                B::SERVICE
            )))
        })
    }
}

struct Sender<B> {
    calls: Arc<B>,
    /// False once the service answered the batch method with `UNIMPLEMENTED`.
    batching: Arc<AtomicBool>,
}

impl<B> Clone for Sender<B> {
    fn clone(&self) -> Self {
        Self {
            calls: Arc::clone(&self.calls),
            batching: Arc::clone(&self.batching),
        }
    }
}

impl<B: Batched> Sender<B> {
    async fn run(self, mut rx: mpsc::UnboundedReceiver<Pending<B>>, slots: usize) {
        let mut queue = Vec::new();
        let mut on_their_way = FuturesUnordered::new();
        let mut open = true;
        loop {
            tokio::select! {
                // Take in every call already handed over before a finished one frees its
                // slot, so they all go out in the next message.
                biased;
                received = rx.recv_many(&mut queue, MAX_BATCH), if open => open = received > 0,
                Some(()) = on_their_way.next(), if !on_their_way.is_empty() => {}
                else => break,
            }
            while on_their_way.len() < slots && !queue.is_empty() {
                let calls = self.next_message(&mut queue);
                on_their_way.push(self.clone().send(calls));
            }
        }
    }

    /// Takes the calls of the next message from the front of `queue`: a call that must
    /// go alone goes alone; otherwise as many as fit [`MAX_BATCH`] and
    /// [`MAX_BATCH_BYTES`], in order, leaving calls that must go alone for later.
    fn next_message(&self, queue: &mut Vec<Pending<B>>) -> Vec<Pending<B>> {
        let mut taken = 0;
        let mut bytes = 0usize;
        for call in queue.iter() {
            match self.calls.weight(&call.request) {
                Some(w) if taken < MAX_BATCH && (taken == 0 || bytes + w <= MAX_BATCH_BYTES) => {
                    bytes += w;
                    taken += 1;
                }
                None if taken == 0 => {
                    taken = 1;
                    break;
                }
                _ => break,
            }
        }
        queue.drain(..taken).collect()
    }

    async fn send(self, calls: Vec<Pending<B>>) {
        if calls.len() == 1 || !self.batching.load(Ordering::Relaxed) {
            self.send_each(calls).await;
            return;
        }
        let span = self.calls.batch_span(calls.len());
        let items = calls
            .iter()
            .map(|call| {
                span.follows_from(&call.span);
                let traceparent = convene_telemetry::traceparent(&call.span).unwrap_or_default();
                (&call.request, traceparent)
            })
            .collect();
        let answer = self.calls.together(items).instrument(span).await;
        match answer {
            Ok(answers) if answers.len() == calls.len() => {
                for (call, answer) in calls.into_iter().zip(answers) {
                    let _ = call.done.send(answer);
                }
            }
            Ok(answers) => {
                let status = Status::internal(format!(
                    "{} answered {} of a batch of {} calls",
                    B::SERVICE,
                    answers.len(),
                    calls.len()
                ));
                fail_all(calls, &status);
            }
            Err(status) if status.code() == Code::Unimplemented => {
                tracing::info!(
                    "{} does not take {} ({}); sending each call on its own from now on",
                    B::SERVICE,
                    B::METHOD,
                    status.message()
                );
                self.batching.store(false, Ordering::Relaxed);
                self.send_each(calls).await;
            }
            // Too large a message for this service's limit: each call fits on its own.
            Err(status) if status.code() == Code::OutOfRange => {
                tracing::debug!(
                    "{} refused a {} of {} calls as too large ({}); sending them one by one",
                    B::SERVICE,
                    B::METHOD,
                    calls.len(),
                    status.message()
                );
                self.send_each(calls).await;
            }
            Err(status) => fail_all(calls, &status),
        }
    }

    /// Sends every call as a call of its own, all at once.
    async fn send_each(&self, calls: Vec<Pending<B>>) {
        futures::future::join_all(calls.into_iter().map(|c| self.send_alone(c))).await;
    }

    async fn send_alone(&self, call: Pending<B>) {
        let answer = self.calls.alone(call.request).instrument(call.span).await;
        let _ = call.done.send(answer);
    }
}

fn fail_all<B: Batched>(calls: Vec<Pending<B>>, status: &Status) {
    for call in calls {
        let _ = call.done.send(Err(status.clone()));
    }
}

/// The status an item's error stands for.
fn item_status(error: v1::ItemStatus) -> Status {
    Status::new(Code::from(error.code), error.message)
}

/// `Authorize` calls, batched as `AuthorizeBatch`.
struct AuthorizeCalls {
    inner: PolicyHandle,
    service: &'static str,
}

#[tonic::async_trait]
impl Batched for AuthorizeCalls {
    type Request = v1::AuthorizeRequest;
    type Response = v1::AuthorizeResponse;
    const SERVICE: &'static str = "the policy service";
    const METHOD: &'static str = "AuthorizeBatch";

    async fn alone(&self, request: Request<v1::AuthorizeRequest>) -> Answer<v1::AuthorizeResponse> {
        self.inner.authorize(request).await
    }

    async fn together(
        &self,
        calls: Vec<(&Request<v1::AuthorizeRequest>, String)>,
    ) -> Result<Vec<Answer<v1::AuthorizeResponse>>, Status> {
        let items = calls
            .into_iter()
            .map(|(request, traceparent)| v1::AuthorizeBatchItem {
                request: Some(request.get_ref().clone()),
                traceparent,
            })
            .collect();
        let response = self
            .inner
            .authorize_batch(Request::new(v1::AuthorizeBatchRequest { items }))
            .await?;
        Ok(response
            .into_inner()
            .results
            .into_iter()
            .map(|result| match result.result {
                Some(authorize_batch_result::Result::Decision(d)) => Ok(Response::new(d)),
                Some(authorize_batch_result::Result::Error(error)) => Err(item_status(error)),
                None => Err(Status::internal(
                    "the policy service answered a batched call with neither a decision nor \
                     an error",
                )),
            })
            .collect())
    }

    fn batch_span(&self, calls: usize) -> Span {
        tracing::info_span!(
            "policy.authorize_batch",
            convene.service = self.service,
            convene.calls = calls,
        )
    }
}

/// A [`Policy`] that batches `Authorize` calls over another one (a
/// [`GrpcPolicy`](crate::handles::GrpcPolicy)); see the module docs.
pub struct BatchingPolicy {
    inner: PolicyHandle,
    batcher: Batcher<AuthorizeCalls>,
}

impl std::fmt::Debug for BatchingPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BatchingPolicy").finish_non_exhaustive()
    }
}

impl BatchingPolicy {
    /// Batches over `inner` with `slots` calls on their way at most (at least one);
    /// `service` names the caller on the batches' spans. Starts the sending task, which
    /// ends when the handle is dropped. Call it inside a Tokio runtime.
    pub fn new(inner: PolicyHandle, service: &'static str, slots: usize) -> Self {
        let calls = AuthorizeCalls {
            inner: Arc::clone(&inner),
            service,
        };
        Self {
            inner,
            batcher: Batcher::new(calls, slots),
        }
    }
}

#[tonic::async_trait]
impl Policy for BatchingPolicy {
    async fn issue_task_token(
        &self,
        request: Request<v1::IssueTaskTokenRequest>,
    ) -> Result<Response<v1::IssueTaskTokenResponse>, Status> {
        self.inner.issue_task_token(request).await
    }

    async fn authorize(
        &self,
        request: Request<v1::AuthorizeRequest>,
    ) -> Answer<v1::AuthorizeResponse> {
        self.batcher.call(request).await
    }

    async fn authorize_batch(
        &self,
        request: Request<v1::AuthorizeBatchRequest>,
    ) -> Result<Response<v1::AuthorizeBatchResponse>, Status> {
        self.inner.authorize_batch(request).await
    }

    async fn revoke(
        &self,
        request: Request<v1::RevokeRequest>,
    ) -> Result<Response<v1::RevokeResponse>, Status> {
        self.inner.revoke(request).await
    }

    async fn get_signing_keys(
        &self,
        request: Request<v1::GetSigningKeysRequest>,
    ) -> Result<Response<v1::GetSigningKeysResponse>, Status> {
        self.inner.get_signing_keys(request).await
    }

    async fn list_tools(
        &self,
        request: Request<v1::ListToolsRequest>,
    ) -> Result<Response<v1::ListToolsResponse>, Status> {
        self.inner.list_tools(request).await
    }

    async fn who_am_i(
        &self,
        request: Request<v1::WhoAmIRequest>,
    ) -> Result<Response<v1::WhoAmIResponse>, Status> {
        self.inner.who_am_i(request).await
    }
}

/// `PutArtifact` calls, batched as `PutArtifactBatch`.
struct PutCalls {
    inner: EvidenceHandle,
    service: &'static str,
}

#[tonic::async_trait]
impl Batched for PutCalls {
    type Request = v1::PutArtifactRequest;
    type Response = v1::PutArtifactResponse;
    const SERVICE: &'static str = "the evidence store";
    const METHOD: &'static str = "PutArtifactBatch";

    async fn alone(
        &self,
        request: Request<v1::PutArtifactRequest>,
    ) -> Answer<v1::PutArtifactResponse> {
        self.inner.put_artifact(request).await
    }

    async fn together(
        &self,
        calls: Vec<(&Request<v1::PutArtifactRequest>, String)>,
    ) -> Result<Vec<Answer<v1::PutArtifactResponse>>, Status> {
        let items = calls
            .into_iter()
            .map(|(request, traceparent)| v1::PutArtifactBatchItem {
                // Only calls with a bearer token are batched (see `weight`).
                token: bearer(request).unwrap_or_default().to_owned(),
                request: Some(request.get_ref().clone()),
                traceparent,
            })
            .collect();
        let response = self
            .inner
            .put_artifact_batch(Request::new(v1::PutArtifactBatchRequest { items }))
            .await?;
        Ok(response
            .into_inner()
            .results
            .into_iter()
            .map(|result| match result.result {
                Some(put_artifact_batch_result::Result::Response(r)) => Ok(Response::new(r)),
                Some(put_artifact_batch_result::Result::Error(error)) => Err(item_status(error)),
                None => Err(Status::internal(
                    "the evidence store answered a batched put with neither a response nor an \
                     error",
                )),
            })
            .collect())
    }

    fn batch_span(&self, calls: usize) -> Span {
        tracing::info_span!(
            "evidence.put_batch",
            convene.service = self.service,
            convene.calls = calls,
        )
    }

    /// A put goes alone when it is large, or when it carries no task token as its bearer
    /// credential (its refusal is the store's to word, as for any PutArtifact).
    fn weight(&self, request: &Request<v1::PutArtifactRequest>) -> Option<usize> {
        let size = request.get_ref().content.len();
        (size <= MAX_BATCHED_PUT_BYTES && bearer(request).is_ok()).then_some(size)
    }
}

/// An [`EvidenceStore`] that batches `PutArtifact` calls over another one (a
/// [`GrpcEvidenceStore`](crate::handles::GrpcEvidenceStore)); see the module docs.
pub struct BatchingEvidence {
    inner: EvidenceHandle,
    batcher: Batcher<PutCalls>,
}

impl std::fmt::Debug for BatchingEvidence {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BatchingEvidence").finish_non_exhaustive()
    }
}

impl BatchingEvidence {
    /// Batches over `inner` with `slots` calls on their way at most (at least one);
    /// `service` names the caller on the batches' spans. Starts the sending task, which
    /// ends when the handle is dropped. Call it inside a Tokio runtime.
    pub fn new(inner: EvidenceHandle, service: &'static str, slots: usize) -> Self {
        let calls = PutCalls {
            inner: Arc::clone(&inner),
            service,
        };
        Self {
            inner,
            batcher: Batcher::new(calls, slots),
        }
    }
}

#[tonic::async_trait]
impl EvidenceStore for BatchingEvidence {
    async fn put_artifact(
        &self,
        request: Request<v1::PutArtifactRequest>,
    ) -> Answer<v1::PutArtifactResponse> {
        self.batcher.call(request).await
    }

    async fn put_artifact_batch(
        &self,
        request: Request<v1::PutArtifactBatchRequest>,
    ) -> Answer<v1::PutArtifactBatchResponse> {
        self.inner.put_artifact_batch(request).await
    }

    async fn get_artifact(
        &self,
        request: Request<v1::GetArtifactRequest>,
    ) -> Answer<v1::GetArtifactResponse> {
        self.inner.get_artifact(request).await
    }

    async fn record_evidence(
        &self,
        request: Request<v1::RecordEvidenceRequest>,
    ) -> Answer<v1::RecordEvidenceResponse> {
        self.inner.record_evidence(request).await
    }

    async fn get_evidence(
        &self,
        request: Request<v1::GetEvidenceRequest>,
    ) -> Answer<v1::GetEvidenceResponse> {
        self.inner.get_evidence(request).await
    }

    async fn verify_chain(
        &self,
        request: Request<v1::VerifyChainRequest>,
    ) -> Answer<v1::VerifyChainResponse> {
        self.inner.verify_chain(request).await
    }
}
