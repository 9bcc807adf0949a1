//! Test support for the batching handles ([`crate::batch`]): [`Recording`] puts a real
//! policy service or evidence store behind a wrapper that records what each call brought
//! (one item alone, a batch, or a batch it refused), holds the first single call until
//! the test lets it through, and can play an older version without the batch method.
//! Holding the first call is how a test makes the calls after it queue up in a handle
//! and go out together.

use std::future::Future;
use std::sync::{Arc, Mutex, PoisonError};

use convene_proto::v1::{self, evidence_store_server::EvidenceStore, policy_server::Policy};
use tokio::sync::{Notify, oneshot};
use tonic::{Request, Response, Status};

/// What the wrapped service was sent, call by call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sent {
    /// One item in a call of its own (`Authorize`, `PutArtifact`).
    Alone,
    /// A batch of this many items.
    Batch(usize),
    /// A batch of this many items, refused as a version without the method would.
    RefusedBatch(usize),
}

/// A service `S` behind a wrapper that records each call, holds the first single call
/// until [`Recording::held_then`] lets it through, and can refuse batches as
/// `UNIMPLEMENTED`. Clones share the record.
pub struct Recording<S> {
    inner: S,
    takes_batches: bool,
    sent: Arc<Mutex<Vec<Sent>>>,
    /// The `traceparent` of every batched item, in order.
    traceparents: Arc<Mutex<Vec<String>>>,
    hold: Arc<Mutex<Option<oneshot::Receiver<()>>>>,
    release: Arc<Mutex<Option<oneshot::Sender<()>>>>,
    held: Arc<Notify>,
}

// Derived `Clone` would ask `S: Clone` of the shared record as well; spelled out it asks
// only of the service.
impl<S: Clone> Clone for Recording<S> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            takes_batches: self.takes_batches,
            sent: Arc::clone(&self.sent),
            traceparents: Arc::clone(&self.traceparents),
            hold: Arc::clone(&self.hold),
            release: Arc::clone(&self.release),
            held: Arc::clone(&self.held),
        }
    }
}

impl<S> Recording<S> {
    /// Wraps `inner`; with `takes_batches` false, every batch is refused.
    pub fn new(inner: S, takes_batches: bool) -> Self {
        let (release, hold) = oneshot::channel();
        Self {
            inner,
            takes_batches,
            sent: Arc::default(),
            traceparents: Arc::default(),
            hold: Arc::new(Mutex::new(Some(hold))),
            release: Arc::new(Mutex::new(Some(release))),
            held: Arc::default(),
        }
    }

    /// Every call so far, in order.
    pub fn sent(&self) -> Vec<Sent> {
        lock(&self.sent).clone()
    }

    /// The `traceparent` of every batched item so far, in order.
    pub fn traceparents(&self) -> Vec<String> {
        lock(&self.traceparents).clone()
    }

    /// Runs `first`, which the wrapper holds; once it is held, runs `rest`, then lets
    /// `first` through: every call of `rest` was handed to the handle while the call
    /// ahead of it was still out. Answers in the order given. Once per wrapper: only the
    /// first single call is held.
    pub async fn held_then<T, F, R>(&self, first: F, rest: R) -> Vec<T>
    where
        F: Future<Output = T>,
        R: IntoIterator,
        R::Item: Future<Output = T>,
    {
        let release = lock(&self.release)
            .take()
            .expect("one held round per wrapper");
        let (first, rest) = tokio::join!(first, async {
            self.held.notified().await;
            let rest = futures::future::join_all(rest);
            let (rest, ()) = tokio::join!(rest, async {
                // `rest` was polled first: each of its calls is in the handle's queue.
                tokio::task::yield_now().await;
                let _ = release.send(());
            });
            rest
        });
        std::iter::once(first).chain(rest).collect()
    }

    /// Records a single call; the first waits until the test releases it.
    async fn alone(&self) {
        lock(&self.sent).push(Sent::Alone);
        let hold = lock(&self.hold).take();
        if let Some(hold) = hold {
            self.held.notify_one();
            let _ = hold.await;
        }
    }

    /// Records a batch of items with these `traceparent`s, or refuses it as a service
    /// without `method` (its full gRPC path) would.
    fn batch<'a>(
        &self,
        method: &str,
        traceparents: impl ExactSizeIterator<Item = &'a String>,
    ) -> Result<(), Status> {
        let n = traceparents.len();
        if !self.takes_batches {
            lock(&self.sent).push(Sent::RefusedBatch(n));
            return Err(Status::unimplemented(format!("Method not found: {method}")));
        }
        lock(&self.sent).push(Sent::Batch(n));
        lock(&self.traceparents).extend(traceparents.cloned());
        Ok(())
    }
}

/// A poisoned record is still the record: a test that panicked holding it fails anyway.
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

#[tonic::async_trait]
impl<S: Policy> Policy for Recording<S> {
    async fn issue_task_token(
        &self,
        request: Request<v1::IssueTaskTokenRequest>,
    ) -> Result<Response<v1::IssueTaskTokenResponse>, Status> {
        self.inner.issue_task_token(request).await
    }

    async fn authorize(
        &self,
        request: Request<v1::AuthorizeRequest>,
    ) -> Result<Response<v1::AuthorizeResponse>, Status> {
        self.alone().await;
        self.inner.authorize(request).await
    }

    async fn authorize_batch(
        &self,
        request: Request<v1::AuthorizeBatchRequest>,
    ) -> Result<Response<v1::AuthorizeBatchResponse>, Status> {
        let items = &request.get_ref().items;
        self.batch(
            "convene.v1.Policy/AuthorizeBatch",
            items.iter().map(|i| &i.traceparent),
        )?;
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

#[tonic::async_trait]
impl<S: EvidenceStore> EvidenceStore for Recording<S> {
    async fn put_artifact(
        &self,
        request: Request<v1::PutArtifactRequest>,
    ) -> Result<Response<v1::PutArtifactResponse>, Status> {
        self.alone().await;
        self.inner.put_artifact(request).await
    }

    async fn put_artifact_batch(
        &self,
        request: Request<v1::PutArtifactBatchRequest>,
    ) -> Result<Response<v1::PutArtifactBatchResponse>, Status> {
        let items = &request.get_ref().items;
        self.batch(
            "convene.v1.EvidenceStore/PutArtifactBatch",
            items.iter().map(|i| &i.traceparent),
        )?;
        self.inner.put_artifact_batch(request).await
    }

    async fn get_artifact(
        &self,
        request: Request<v1::GetArtifactRequest>,
    ) -> Result<Response<v1::GetArtifactResponse>, Status> {
        self.inner.get_artifact(request).await
    }

    async fn record_evidence(
        &self,
        request: Request<v1::RecordEvidenceRequest>,
    ) -> Result<Response<v1::RecordEvidenceResponse>, Status> {
        self.inner.record_evidence(request).await
    }

    async fn get_evidence(
        &self,
        request: Request<v1::GetEvidenceRequest>,
    ) -> Result<Response<v1::GetEvidenceResponse>, Status> {
        self.inner.get_evidence(request).await
    }

    async fn verify_chain(
        &self,
        request: Request<v1::VerifyChainRequest>,
    ) -> Result<Response<v1::VerifyChainResponse>, Status> {
        self.inner.verify_chain(request).await
    }
}
