//! Event delivery: the outbox reaches a `WatchEvents` subscriber and a NATS JetStream
//! consumer that disconnect and resume from where they were, every event once, in
//! commit order, across supervisor restarts.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use crate::harness::{MeshOptions, Mode, TestMesh, wait_for, wait_until};
use convene_mesh::auth::request;
use convene_mesh::handles::SupervisorHandle;
use convene_proto::v1;
use convene_store::test_util::Service;
use convene_store::{Database, sql};
use futures::StreamExt as _;

use super::{LIMIT, ONCALL, Rng, load, outbox, outbox_ids, supervisor_env, unique, wait_terminal};

/// Waits until the outbox holds at least `n` events.
async fn wait_outbox(db: &Database, n: usize) {
    wait_until(
        &format!("the outbox to hold {n} events"),
        LIMIT,
        async || outbox_ids(db).await.len() >= n,
    )
    .await;
}

/// NATS with JetStream, named by `CONVENE_TEST_NATS_URL`.
const NATS: Service = Service {
    name: "NATS JetStream",
    variable: "CONVENE_TEST_NATS_URL",
};

/// The local NATS server the relay test tries when none is named.
const DEFAULT_NATS: &str = "nats://127.0.0.1:4222";

/// A client of the NATS server for the relay test, and its URL: the one
/// `CONVENE_TEST_NATS_URL` names (it must answer), else the local default; None after
/// saying that the test is skipped when the default does not answer either.
async fn nats_server() -> Option<(async_nats::Client, String)> {
    let named = std::env::var(NATS.variable)
        .ok()
        .filter(|v| !v.trim().is_empty());
    let url = named.clone().unwrap_or_else(|| DEFAULT_NATS.to_owned());
    // A short timeout: a server that is not there should not hold the suite up.
    let connected = async_nats::ConnectOptions::new()
        .connection_timeout(Duration::from_secs(1))
        .connect(url.as_str())
        .await;
    match connected {
        Ok(client) => Some((client, url)),
        Err(e) if named.is_none() => {
            NATS.missing(&format!(
                "is not configured and does not answer at {url} ({e})"
            ));
            None
        }
        Err(e) => panic!(
            "the relay test needs a NATS server with JetStream at {url} ({}): {e}",
            NATS.variable
        ),
    }
}

/// A `WatchEvents` subscriber that takes a few events at a time, hangs up mid-stream
/// and resumes after the last event it got (also when the supervisor went away), until
/// it got the event `stop` names. Returns the ids it got, in order, and how often it
/// hung up.
async fn subscribe(
    client: SupervisorHandle,
    credential: String,
    seed: u64,
    mut stop: tokio::sync::watch::Receiver<Option<String>>,
) -> (Vec<String>, usize) {
    let mut rng = Rng(seed);
    let mut got: Vec<String> = Vec::new();
    let mut hung_up = 0;
    let done = |stop: &tokio::sync::watch::Receiver<Option<String>>, got: &[String]| {
        stop.borrow()
            .as_ref()
            .is_some_and(|last| got.last() == Some(last))
    };
    loop {
        if done(&stop, &got) {
            return (got, hung_up);
        }
        let opened = client
            .watch_events(request(
                v1::WatchEventsRequest {
                    after_event_id: got.last().cloned().unwrap_or_default(),
                    types: Vec::new(),
                    run_id: String::new(),
                    follow: true,
                    from_now: false,
                },
                &credential,
            ))
            .await;
        let Ok(stream) = opened else {
            // The supervisor restarts.
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        let mut stream = stream.into_inner();
        let take = 1 + rng.below(20);
        let mut taken = 0;
        loop {
            tokio::select! {
                item = stream.next() => match item {
                    Some(Ok(item)) => {
                        got.push(item.event.expect("event set").id);
                        taken += 1;
                        if taken == take {
                            // Hang up mid-stream.
                            hung_up += 1;
                            break;
                        }
                    }
                    // The supervisor went away: resume.
                    Some(Err(_)) | None => break,
                },
                _ = stop.changed() => {}
            }
            if done(&stop, &got) {
                return (got, hung_up);
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watch_events_subscriber_resuming_from_its_last_id_misses_none_and_sees_none_twice() {
    let began = Instant::now();
    let (mut rng, seed) = Rng::seeded();
    eprintln!("event test: seed {seed} (CONVENE_TEST_SEED={seed} repeats this run)");
    let replica = supervisor_env("events-replica", None);
    let mut mesh = TestMesh::start(
        Mode::Processes,
        MeshOptions {
            supervisor_env: replica.clone(),
            ..MeshOptions::default()
        },
    )
    .await;
    let client = mesh.supervisor();
    let credential = mesh.credential(ONCALL);
    let db = mesh.open_database().await;

    let (stop, stop_rx) = tokio::sync::watch::channel(None);
    let subscriber = tokio::spawn(subscribe(
        client.clone(),
        credential.clone(),
        rng.next(),
        stop_rx,
    ));
    let loader = tokio::spawn(load(
        client.clone(),
        credential.clone(),
        30,
        format!("watch-{seed}"),
    ));
    // Mid-load the supervisor dies and comes back: every open stream breaks.
    wait_outbox(&db, 30 + rng.below(40)).await;
    assert!(mesh.restart("supervisor", replica).await);
    let ids = loader.await.expect("the load");
    for id in &ids {
        wait_terminal(&client, &credential, id).await;
    }

    let outbox = outbox_ids(&db).await;
    assert!(outbox.len() >= ids.len() * 5, "{} events", outbox.len());
    stop.send_replace(outbox.last().cloned());
    let (got, hung_up) = tokio::time::timeout(LIMIT, subscriber)
        .await
        .expect("the subscriber got the last event")
        .expect("the subscriber");
    let distinct: BTreeSet<&String> = got.iter().collect();
    assert_eq!(distinct.len(), got.len(), "an event came twice");
    assert_eq!(
        got, outbox,
        "the subscriber got every event, in commit order"
    );
    assert!(hung_up >= 5, "the subscriber hung up {hung_up} times");
    eprintln!(
        "event test: {} events over {} runs, {hung_up} resumptions, {:?}",
        got.len(),
        ids.len(),
        began.elapsed()
    );
}

/// One message of the relay's stream (or one publication seen on its subjects).
#[derive(Debug, Clone)]
struct Delivered {
    /// Stream sequence (0 for a publication seen by a core subscriber).
    sequence: u64,
    msg_id: String,
    subject: String,
    body: serde_json::Value,
}

fn delivered(
    subject: &str,
    headers: Option<&async_nats::HeaderMap>,
    payload: &[u8],
    sequence: u64,
) -> Delivered {
    Delivered {
        sequence,
        msg_id: headers
            .and_then(|h| h.get(async_nats::header::NATS_MESSAGE_ID))
            .map(|v| v.as_str().to_owned())
            .unwrap_or_default(),
        subject: subject.to_owned(),
        body: serde_json::from_slice(payload).expect("a JSON body"),
    }
}

/// A JetStream consumer that reads a few messages at a time with a fresh connection
/// and a fresh consumer starting after the last stream sequence it got, until it has
/// every event id `stop` names. Returns what it got and how often it reconnected.
async fn consume(
    url: String,
    stream_name: String,
    seed: u64,
    mut stop: tokio::sync::watch::Receiver<Option<BTreeSet<String>>>,
) -> (Vec<Delivered>, usize) {
    use async_nats::jetstream::consumer::{AckPolicy, DeliverPolicy, pull};
    let mut rng = Rng(seed);
    let mut got: Vec<Delivered> = Vec::new();
    let mut reconnects = 0;
    let done = |stop: &tokio::sync::watch::Receiver<Option<BTreeSet<String>>>,
                got: &[Delivered]| {
        stop.borrow().as_ref().is_some_and(|all| {
            let seen: BTreeSet<&String> = got.iter().map(|d| &d.msg_id).collect();
            all.iter().all(|id| seen.contains(id))
        })
    };
    loop {
        if done(&stop, &got) {
            return (got, reconnects);
        }
        let _ = tokio::time::timeout(Duration::from_millis(100), stop.changed()).await;
        let Ok(client) = async_nats::connect(url.as_str()).await else {
            continue;
        };
        let js = async_nats::jetstream::new(client);
        // The relay creates the stream when it first connects.
        let Ok(stream) = js.get_stream(&stream_name).await else {
            continue;
        };
        let start = got.last().map_or(1, |d| d.sequence + 1);
        let consumer = stream
            .create_consumer(pull::Config {
                deliver_policy: DeliverPolicy::ByStartSequence {
                    start_sequence: start,
                },
                ack_policy: AckPolicy::None,
                ..Default::default()
            })
            .await
            .expect("a consumer");
        let mut batch = consumer
            .fetch()
            .max_messages(1 + rng.below(25))
            .expires(Duration::from_millis(300))
            .messages()
            .await
            .expect("a fetch");
        while let Some(message) = batch.next().await {
            let message = message.expect("a message");
            let sequence = message.info().expect("JetStream metadata").stream_sequence;
            got.push(delivered(
                message.subject.as_str(),
                message.headers.as_ref(),
                &message.payload,
                sequence,
            ));
        }
        reconnects += 1;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_nats_relay_delivers_every_outbox_event_once_to_a_consumer_resuming_by_sequence() {
    let began = Instant::now();
    let (mut rng, seed) = Rng::seeded();
    eprintln!("NATS test: seed {seed} (CONVENE_TEST_SEED={seed} repeats this run)");
    let Some((nats, url)) = nats_server().await else {
        return;
    };
    // A stream and subjects of this test's own.
    let stream_name = unique("CONVENE_TEST_");
    let prefix = format!("convene.test.{}", unique("t"));
    // Every publication, duplicates included (JetStream drops a re-publication of a
    // message id it holds; a plain subscriber still sees it).
    let mut raw = nats
        .subscribe(format!("{prefix}.>"))
        .await
        .expect("a subscription");
    nats.flush().await.expect("the subscription is in place");

    let mut replica = supervisor_env("nats-replica", None);
    replica.extend([
        ("CONVENE_NATS_URL".to_owned(), url.clone()),
        ("CONVENE_NATS_STREAM".to_owned(), stream_name.clone()),
        ("CONVENE_NATS_SUBJECT_PREFIX".to_owned(), prefix.clone()),
    ]);
    let mut mesh = TestMesh::start(
        Mode::Processes,
        MeshOptions {
            supervisor_env: replica.clone(),
            ..MeshOptions::default()
        },
    )
    .await;
    let client = mesh.supervisor();
    let credential = mesh.credential(ONCALL);
    let db = mesh.open_database().await;

    let (stop, stop_rx) = tokio::sync::watch::channel(None);
    let consumer = tokio::spawn(consume(
        url.clone(),
        stream_name.clone(),
        rng.next(),
        stop_rx,
    ));
    let loader = tokio::spawn(load(
        client.clone(),
        credential.clone(),
        30,
        format!("nats-{seed}"),
    ));
    // Mid-load the supervisor dies between publishing events and storing that they were
    // acknowledged: its cursor is where such a crash leaves it, a few events back. The
    // restarted relay resumes from there and publishes those events again.
    // Each replica keeps a cursor row of its own.
    let relay = format!("nats:{stream_name}@nats-replica");
    let left = LIMIT.saturating_sub(began.elapsed());
    let cursor = wait_for("the relay to acknowledge 30 events", left, async || {
        let row = db
            .fetch_optional(
                sql("SELECT position FROM outbox_relays WHERE relay = $1").bind(relay.as_str()),
            )
            .await
            .expect("the relay cursor reads");
        match row.map(|r| r.get::<i64>("position").expect("position")) {
            Some(position) if position >= 30 => Ok(position),
            position => Err(position),
        }
    })
    .await;
    mesh.kill("supervisor").await;
    let back = 5 + rng.below(10);
    let earlier = db
        .fetch_optional(
            sql("SELECT position, event_id FROM outbox WHERE position < $1 \
                 ORDER BY position DESC LIMIT 1 OFFSET $2")
            .bind(cursor)
            .bind(i64::try_from(back - 1).expect("small")),
        )
        .await
        .expect("the outbox reads")
        .expect("an earlier event");
    db.execute(
        sql("UPDATE outbox_relays SET position = $2, event_id = $3 WHERE relay = $1")
            .bind(relay.as_str())
            .bind(earlier.get::<i64>("position").expect("position"))
            .bind(earlier.get::<String>("event_id").expect("event_id")),
    )
    .await
    .expect("the cursor is set back");
    assert!(mesh.restart("supervisor", replica).await);
    let ids = loader.await.expect("the load");
    for id in &ids {
        wait_terminal(&client, &credential, id).await;
    }

    let outbox = outbox(&client, &credential, "").await;
    let outbox_ids: Vec<String> = outbox.iter().map(|e| e.id.clone()).collect();
    assert_eq!(outbox_ids, self::outbox_ids(&db).await);
    stop.send_replace(Some(outbox_ids.iter().cloned().collect()));
    let (got, reconnects) = tokio::time::timeout(LIMIT, consumer)
        .await
        .expect("the consumer got every event")
        .expect("the consumer");

    // The consumer resumed by sequence: it missed none and got none twice.
    let sequences: Vec<u64> = got.iter().map(|d| d.sequence).collect();
    assert_eq!(
        sequences,
        (1..=got.len() as u64).collect::<Vec<_>>(),
        "stream sequences as consumed"
    );
    assert!(
        reconnects >= 5,
        "the consumer reconnected {reconnects} times"
    );
    // The stream holds every outbox event once, in commit order, as CloudEvents JSON
    // under its id.
    let stream_ids: Vec<String> = got.iter().map(|d| d.msg_id.clone()).collect();
    assert_eq!(stream_ids, outbox_ids, "the stream, message ids in order");
    for (d, event) in got.iter().zip(&outbox) {
        assert_eq!(
            d.body,
            convene_supervisor::events::to_json(event),
            "event {}",
            event.id
        );
        assert_eq!(d.subject, format!("{prefix}.{}", event.r#type));
        for field in [
            "specversion",
            "id",
            "source",
            "type",
            "subject",
            "time",
            "data",
            "correlationid",
            "tenantid",
        ] {
            assert!(!d.body[field].is_null(), "{field} in {}", d.body);
        }
    }

    // What the relay published: every event, and an event published again (after the
    // restart) under the same message id with the same content.
    let mut published: BTreeMap<String, Vec<Delivered>> = BTreeMap::new();
    let expected: BTreeSet<&String> = outbox_ids.iter().collect();
    let deadline = Instant::now() + LIMIT;
    while published.len() < expected.len() {
        let message = tokio::time::timeout(deadline - Instant::now(), raw.next())
            .await
            .expect("every publication reaches the plain subscriber")
            .expect("the subscription is open");
        let d = delivered(
            message.subject.as_str(),
            message.headers.as_ref(),
            &message.payload,
            0,
        );
        published.entry(d.msg_id.clone()).or_default().push(d);
    }
    // Let publications still on their way arrive.
    while let Ok(Some(message)) = tokio::time::timeout(Duration::from_millis(300), raw.next()).await
    {
        let d = delivered(
            message.subject.as_str(),
            message.headers.as_ref(),
            &message.payload,
            0,
        );
        published.entry(d.msg_id.clone()).or_default().push(d);
    }
    assert_eq!(published.keys().collect::<BTreeSet<_>>(), expected);
    let mut again = 0;
    for (id, copies) in &published {
        for copy in copies {
            assert_eq!(
                copy.body["id"],
                id.as_str(),
                "a publication's id and its message id"
            );
            assert_eq!(
                copy.body, copies[0].body,
                "{id} published again with other content"
            );
        }
        again += copies.len() - 1;
    }
    assert!(
        again >= back,
        "{again} re-publications; the restarted relay resumed {back} events back"
    );

    let js = async_nats::jetstream::new(nats);
    js.delete_stream(&stream_name)
        .await
        .expect("the test's stream is deleted");
    eprintln!(
        "NATS test: {} events over {} runs, {reconnects} consumer reconnections, {again} \
         re-publications dropped by the stream, {:?}",
        got.len(),
        ids.len(),
        began.elapsed()
    );
}
