//! Authorizing many tool calls to a message, for a process that reaches the policy
//! service over the network.
//!
//! [`BatchingPolicy`] is a [`PolicyHandle`] over another one (a
//! [`GrpcPolicy`](crate::handles::GrpcPolicy)) that sends `Authorize` calls through one
//! task. A call that finds a free slot goes out at once, alone, as the `Authorize` it
//! is; calls that arrive while every slot is taken wait for the next free one and go
//! out together as one `AuthorizeBatch`. So a lone call waits for nobody, and under load
//! a worker's calls to the policy service stop growing with its tool calls.
//!
//! Each batched item carries the `traceparent` of the span that asked for it, so the
//! policy service's span of that decision is still a child of the asking tool call's.
//! A policy service without `AuthorizeBatch` (an older version, during a rolling
//! upgrade) answers `UNIMPLEMENTED`; the handle then sends each call on its own, and
//! keeps doing so. Every other method forwards as it is.
//!
//! In one process there is nothing to batch: the policy service is a direct call.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use convene_proto::v1::{self, authorize_batch_result, policy_server::Policy};
use futures::StreamExt as _;
use futures::stream::FuturesUnordered;
use tokio::sync::{mpsc, oneshot};
use tonic::{Code, Request, Response, Status};
use tracing::{Instrument as _, Span};

use crate::handles::PolicyHandle;

/// Most calls one `AuthorizeBatch` carries (the policy service takes up to 256).
pub const MAX_BATCH: usize = 256;

/// Calls on their way at once before further calls wait to go out together.
pub const DEFAULT_SLOTS: usize = 1;

type Answer = Result<Response<v1::AuthorizeResponse>, Status>;

/// One call waiting to be sent.
struct Pending {
    request: Request<v1::AuthorizeRequest>,
    /// The asking span: a call sent alone is made in it; a batched call carries its
    /// trace context, and the batch's span is linked to it.
    span: Span,
    done: oneshot::Sender<Answer>,
}

/// A [`Policy`] that batches `Authorize` calls over `inner`; see the module docs.
pub struct BatchingPolicy {
    inner: PolicyHandle,
    tx: mpsc::UnboundedSender<Pending>,
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
        let (tx, rx) = mpsc::unbounded_channel();
        let sender = Sender {
            inner: inner.clone(),
            service,
            batching: Arc::new(AtomicBool::new(true)),
        };
        tokio::spawn(sender.run(rx, slots.max(1)));
        Self { inner, tx }
    }
}

#[derive(Clone)]
struct Sender {
    inner: PolicyHandle,
    service: &'static str,
    /// False once the policy service answered `AuthorizeBatch` with `UNIMPLEMENTED`.
    batching: Arc<AtomicBool>,
}

impl Sender {
    async fn run(self, mut rx: mpsc::UnboundedReceiver<Pending>, slots: usize) {
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
                let calls: Vec<Pending> = queue.drain(..queue.len().min(MAX_BATCH)).collect();
                on_their_way.push(self.clone().send(calls));
            }
        }
    }

    async fn send(self, calls: Vec<Pending>) {
        if calls.len() == 1 || !self.batching.load(Ordering::Relaxed) {
            self.send_each(calls).await;
            return;
        }
        let span = tracing::info_span!(
            "policy.authorize_batch",
            convene.service = self.service,
            convene.calls = calls.len(),
        );
        let items = calls
            .iter()
            .map(|c| {
                span.follows_from(&c.span);
                v1::AuthorizeBatchItem {
                    request: Some(c.request.get_ref().clone()),
                    traceparent: convene_telemetry::traceparent(&c.span).unwrap_or_default(),
                }
            })
            .collect();
        let batch = v1::AuthorizeBatchRequest { items };
        let answer = self
            .inner
            .authorize_batch(Request::new(batch))
            .instrument(span)
            .await;
        match answer {
            Ok(response) => {
                let results = response.into_inner().results;
                if results.len() != calls.len() {
                    let status = Status::internal(format!(
                        "the policy service answered {} of a batch of {} calls",
                        results.len(),
                        calls.len()
                    ));
                    fail_all(calls, &status);
                    return;
                }
                for (call, result) in calls.into_iter().zip(results) {
                    let _ = call.done.send(answer_of(result));
                }
            }
            Err(status) if status.code() == Code::Unimplemented => {
                tracing::info!(
                    "the policy service does not take AuthorizeBatch ({}); sending each call \
                     on its own from now on",
                    status.message()
                );
                self.batching.store(false, Ordering::Relaxed);
                self.send_each(calls).await;
            }
            Err(status) => fail_all(calls, &status),
        }
    }

    /// Sends every call as an `Authorize` of its own, all at once.
    async fn send_each(&self, calls: Vec<Pending>) {
        futures::future::join_all(calls.into_iter().map(|c| self.send_alone(c))).await;
    }

    async fn send_alone(&self, call: Pending) {
        let answer = self
            .inner
            .authorize(call.request)
            .instrument(call.span)
            .await;
        let _ = call.done.send(answer);
    }
}

fn fail_all(calls: Vec<Pending>, status: &Status) {
    for call in calls {
        let _ = call.done.send(Err(status.clone()));
    }
}

fn answer_of(result: v1::AuthorizeBatchResult) -> Answer {
    match result.result {
        Some(authorize_batch_result::Result::Decision(decision)) => Ok(Response::new(decision)),
        Some(authorize_batch_result::Result::Error(error)) => {
            Err(Status::new(Code::from(error.code), error.message))
        }
        None => Err(Status::internal(
            "the policy service answered a batched call with neither a decision nor an error",
        )),
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

    async fn authorize(&self, request: Request<v1::AuthorizeRequest>) -> Answer {
        let (done, answer) = oneshot::channel();
        let call = Pending {
            request,
            span: Span::current(),
            done,
        };
        if self.tx.send(call).is_err() {
            return Err(Status::unavailable(
                "the authorization task stopped; the process is shutting down",
            ));
        }
        answer.await.unwrap_or_else(|_| {
            Err(Status::unavailable(
                "the authorization task stopped before it answered; the process is shutting \
                 down",
            ))
        })
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
}
