//! Revoking the tokens of finished runs, many runs to a call.
//!
//! A finished run's actor hands its run id to the [`Revoker`] and waits for the answer,
//! as it waited for its own `Revoke` call before. One task makes the calls: the first
//! run id it gets goes out at once, alone, and every run that finishes while that call
//! is on its way goes out together in the next one (at most [`MAX_RUNS`] to a call).
//! So a lone run waits for nobody, and under load the supervisor's calls to the policy
//! service (and the policy service's commits) stop growing with the number of runs.

use convene_mesh::auth::request;
use convene_mesh::handles::PolicyHandle;
use convene_proto::v1::{self, revoke_request::Target};
use tokio::sync::{mpsc, oneshot};
use tracing::{Instrument as _, Span};

/// Most runs one call names (the policy service takes up to 1,000).
pub(crate) const MAX_RUNS: usize = 256;

/// Why a run's tokens were revoked, in the decision log.
const REASON: &str = "run finished";

/// One run waiting for its revocation.
struct Pending {
    run_id: String,
    /// The run's span: a call for this run alone is made in it, a shared call is linked
    /// to it.
    span: Span,
    done: oneshot::Sender<Result<(), String>>,
}

/// Sends revocations for the supervisor's finished runs; cheap to share.
#[derive(Debug, Clone)]
pub(crate) struct Revoker {
    tx: mpsc::UnboundedSender<Pending>,
}

impl Revoker {
    /// Starts the task that makes the calls, with `credential` as the supervisor's
    /// principal. It ends when the last [`Revoker`] is dropped.
    pub(crate) fn spawn(policy: PolicyHandle, credential: String) -> Self {
        let (tx, rx) = mpsc::unbounded_channel();
        tokio::spawn(send_all(policy, credential, rx));
        Self { tx }
    }

    /// Revokes every token of `run_id`; returns once the policy service recorded it, or
    /// why it did not.
    pub(crate) async fn revoke(&self, run_id: String) -> Result<(), String> {
        let (done, answer) = oneshot::channel();
        let pending = Pending {
            run_id,
            span: Span::current(),
            done,
        };
        if self.tx.send(pending).is_err() {
            return Err("the supervisor is stopping; its revocations are no longer sent".into());
        }
        answer
            .await
            .unwrap_or_else(|_| Err("the revocation task stopped before it answered".into()))
    }
}

async fn send_all(
    policy: PolicyHandle,
    credential: String,
    mut rx: mpsc::UnboundedReceiver<Pending>,
) {
    let mut batch = Vec::new();
    while rx.recv_many(&mut batch, MAX_RUNS).await > 0 {
        let (target, span) = match batch.as_slice() {
            [one] => (Target::RunId(one.run_id.clone()), one.span.clone()),
            many => {
                let span = tracing::info_span!(
                    "supervisor.revoke_runs",
                    convene.service = "supervisor",
                    convene.runs = many.len(),
                );
                for p in many {
                    span.follows_from(&p.span);
                }
                let ids = many.iter().map(|p| p.run_id.clone()).collect();
                (Target::RunIds(v1::RunIds { run_ids: ids }), span)
            }
        };
        let revoke = v1::RevokeRequest {
            target: Some(target),
            reason: REASON.to_owned(),
        };
        let result = policy
            .revoke(request(revoke, &credential))
            .instrument(span)
            .await
            .map(|_| ())
            .map_err(|status| status.message().to_owned());
        for p in batch.drain(..) {
            let _ = p.done.send(result.clone());
        }
    }
}
