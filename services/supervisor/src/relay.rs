//! The event relay: the outbox, published to NATS JetStream.
//!
//! The outbox is the source of truth: every CloudEvent is committed in the transaction
//! of the state change it describes (see [`crate::store`]), and `Supervisor.WatchEvents`
//! reads it directly. When `nats_url` is configured, a background task also publishes
//! it, in commit order, to a JetStream stream (`nats_stream`, created when missing,
//! capturing `<nats_subject_prefix>.>`), one message per event:
//!
//! - subject `<prefix>.<type>` (e.g. `convene.events.dev.convene.run.started.v1`);
//! - header `Nats-Msg-Id` = the event id, so JetStream drops a re-publication within
//!   its duplicate window, and consumers dedupe by the id beyond it;
//! - body: the event in the CloudEvents JSON format ([`events::to_json`]).
//!
//! A batch is published, every publish acknowledged by the stream, and only then is the
//! relay's durable cursor (`outbox_relays`, relay `nats:<stream>`) moved past it. A
//! crash between the publish and the acknowledgement re-publishes that batch after the
//! restart: delivery is at least once, never lost.
//!
//! Several supervisor replicas share one database: every replica relays, from the
//! shared cursor, which only moves forward. Two replicas may publish the same event at
//! about the same time; JetStream keeps one (same `Nats-Msg-Id`). This needs no relay
//! lease and no hand-over when a replica dies: the others simply go on.

use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream;
use tokio::sync::broadcast;
use tokio_util::sync::CancellationToken;

use crate::events;
use crate::store::{RunStore, StoreError};

/// Events published per batch (and acknowledged together).
const BATCH: usize = 256;

/// How often the outbox is looked at when no commit was announced (commits of other
/// replicas reach this one through the store's poll, so this is only a backstop).
const IDLE_POLL: Duration = Duration::from_secs(1);

/// Longest pause between reconnection attempts.
const MAX_BACKOFF: Duration = Duration::from_secs(10);

/// Where the relay publishes.
#[derive(Debug, Clone)]
pub(crate) struct RelaySettings {
    /// The NATS server, e.g. `nats://127.0.0.1:4222`.
    pub(crate) url: String,
    /// The JetStream stream.
    pub(crate) stream: String,
    /// Subject prefix; the stream captures `<prefix>.>`.
    pub(crate) subject_prefix: String,
}

impl RelaySettings {
    /// The relay's name in `outbox_relays`: one cursor per stream.
    fn cursor_name(&self) -> String {
        format!("nats:{}", self.stream)
    }
}

/// Why a relay pass stopped (it starts again after a pause).
#[derive(Debug, thiserror::Error)]
enum RelayError {
    #[error("cannot connect to NATS at {url}: {message}")]
    Connect { url: String, message: String },
    #[error("cannot create or read JetStream stream {stream}: {message}")]
    Stream { stream: String, message: String },
    #[error("publishing event {event_id} failed: {message}")]
    Publish { event_id: String, message: String },
    #[error("event {event_id} does not encode as JSON: {message}")]
    Encode { event_id: String, message: String },
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// Starts the relay; it runs until `stop` is cancelled.
pub(crate) fn spawn(store: Arc<dyn RunStore>, settings: RelaySettings, stop: CancellationToken) {
    tracing::info!(
        url = %settings.url,
        stream = %settings.stream,
        subjects = %format!("{}.>", settings.subject_prefix),
        "relaying the outbox to NATS JetStream"
    );
    tokio::spawn(async move {
        let mut backoff = Duration::from_millis(200);
        loop {
            let pass = tokio::select! {
                r = relay(&store, &settings, &stop) => r,
                () = stop.cancelled() => return,
            };
            match pass {
                Ok(()) => return,
                Err(error) => {
                    tracing::warn!(%error, retry_in = ?backoff, "event relay interrupted; events stay in the outbox until it resumes");
                }
            }
            tokio::select! {
                () = tokio::time::sleep(backoff) => {}
                () = stop.cancelled() => return,
            }
            backoff = (backoff * 2).min(MAX_BACKOFF);
        }
    });
}

/// One connection's worth of relaying: returns on `stop`, or with the error that broke
/// it.
async fn relay(
    store: &Arc<dyn RunStore>,
    settings: &RelaySettings,
    stop: &CancellationToken,
) -> Result<(), RelayError> {
    // Subscribe before reading the outbox, so no commit in between goes unnoticed.
    let mut notes = store.subscribe();
    let client = async_nats::ConnectOptions::new()
        .name("convene-supervisor relay")
        .connect(settings.url.as_str())
        .await
        .map_err(|e| RelayError::Connect {
            url: settings.url.clone(),
            message: e.to_string(),
        })?;
    let js = jetstream::new(client);
    js.get_or_create_stream(jetstream::stream::Config {
        name: settings.stream.clone(),
        subjects: vec![format!("{}.>", settings.subject_prefix)],
        ..Default::default()
    })
    .await
    .map_err(|e| RelayError::Stream {
        stream: settings.stream.clone(),
        message: e.to_string(),
    })?;
    let name = settings.cursor_name();
    tracing::info!(url = %settings.url, stream = %settings.stream, "event relay connected");
    loop {
        if stop.is_cancelled() {
            return Ok(());
        }
        // The shared cursor: another replica may have moved it past what this one
        // published, and then there is nothing to publish again.
        let cursor = store.relay_cursor(&name).await?;
        let batch = store.cloud_events(cursor.as_deref(), BATCH).await?;
        let Some(last) = batch.last().map(|e| e.id.clone()) else {
            tokio::select! {
                note = notes.recv() => {
                    if matches!(note, Err(broadcast::error::RecvError::Closed)) {
                        return Ok(());
                    }
                }
                () = tokio::time::sleep(IDLE_POLL) => {}
                () = stop.cancelled() => return Ok(()),
            }
            continue;
        };
        // Publish the whole batch, then wait for every acknowledgement: the stream
        // stores messages in publish order on one connection.
        let mut acks = Vec::with_capacity(batch.len());
        for event in &batch {
            let body =
                serde_json::to_vec(&events::to_json(event)).map_err(|e| RelayError::Encode {
                    event_id: event.id.clone(),
                    message: e.to_string(),
                })?;
            let mut headers = async_nats::HeaderMap::new();
            headers.insert(async_nats::header::NATS_MESSAGE_ID, event.id.as_str());
            let subject = format!("{}.{}", settings.subject_prefix, event.r#type);
            let ack = js
                .publish_with_headers(subject, headers, body.into())
                .await
                .map_err(|e| RelayError::Publish {
                    event_id: event.id.clone(),
                    message: e.to_string(),
                })?;
            acks.push((event.id.clone(), ack));
        }
        for (event_id, ack) in acks {
            ack.await.map_err(|e| RelayError::Publish {
                event_id,
                message: e.to_string(),
            })?;
        }
        store.acknowledge(&name, &last).await?;
        tracing::debug!(events = batch.len(), last = %last, "relayed outbox events");
    }
}
