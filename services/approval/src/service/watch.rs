//! Streaming the events a caller may see: the backlog after a resume point, then (when
//! following) every event committed later, in commit order.

use std::time::Duration;

use convene_core::Rule;
use convene_mesh::{auth::Caller, handles::BoxStream};
use convene_proto::v1;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Status;

use super::{ApprovalService, invalid};
use crate::{
    error::ApprovalError,
    store::{EventQuery, Viewer},
};

/// Events read from the store at a time.
const WATCH_BATCH: usize = 512;

/// How often a following stream reads the store without being woken, so it sees the
/// commits of other processes sharing the database.
pub const WATCH_POLL_INTERVAL: Duration = Duration::from_secs(1);

impl ApprovalService {
    pub(super) async fn watch_inner(
        &self,
        caller: &Caller,
        msg: v1::ApprovalWatchEventsRequest,
    ) -> Result<BoxStream<v1::ApprovalWatchEventsResponse>, Status> {
        let principal = caller.require_principal("watch approval events")?;
        let viewer = Viewer {
            tenant: principal.tenant.clone(),
            principal: principal.id.clone(),
        };
        let after = if msg.after_event_id.is_empty() {
            0
        } else {
            self.store
                .event_position(&msg.after_event_id, &viewer)
                .await
                .map_err(ApprovalError::from)?
                .ok_or_else(|| {
                    invalid(
                        "after_event_id",
                        Rule::UnknownReference,
                        format!(
                            "no approval event {:?} that you can see; pass the id of the last \
                             event you received, or leave after_event_id empty to start from \
                             the oldest",
                            msg.after_event_id
                        ),
                    )
                })?
        };
        let mut query = EventQuery {
            viewer,
            run_id: (!msg.run_id.is_empty()).then_some(msg.run_id),
            after,
            limit: WATCH_BATCH,
        };
        let store = self.store.clone();
        let shutdown = self.shutdown.clone();
        let follow = msg.follow;
        // Subscribed before the first read, so no commit falls between the two.
        let mut committed = store.subscribe();
        let (tx, rx) = mpsc::channel(256);
        tokio::spawn(async move {
            loop {
                committed.borrow_and_update();
                loop {
                    let batch = match store.events(&query).await {
                        Ok(batch) => batch,
                        Err(e) => {
                            let _ = tx.send(Err(ApprovalError::from(e).into())).await;
                            return;
                        }
                    };
                    let full = batch.len() == WATCH_BATCH;
                    for stored in batch {
                        query.after = stored.position;
                        let response = v1::ApprovalWatchEventsResponse {
                            event: Some(stored.event),
                        };
                        if tx.send(Ok(response)).await.is_err() {
                            return;
                        }
                    }
                    if !full {
                        break;
                    }
                }
                if !follow {
                    return;
                }
                let shutting_down = async {
                    match &shutdown {
                        Some(shutdown) => shutdown.wait().await,
                        None => std::future::pending().await,
                    }
                };
                tokio::select! {
                    changed = committed.changed() => {
                        if changed.is_err() {
                            return;
                        }
                    }
                    () = tokio::time::sleep(WATCH_POLL_INTERVAL) => {}
                    () = shutting_down => {
                        let status = ApprovalError::ShuttingDown(
                            "the approval service is shutting down; resume WatchEvents with \
                             after_event_id set to the last event you received"
                                .to_owned(),
                        );
                        let _ = tx.send(Err(status.into())).await;
                        return;
                    }
                    () = tx.closed() => return,
                }
            }
        });
        Ok(Box::pin(ReceiverStream::new(rx)))
    }
}
