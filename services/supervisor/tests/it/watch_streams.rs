//! Watch streams, over real gRPC: a principal holds at most `max_watch_streams`
//! WatchRun and WatchEvents streams at once (one more is refused with a retry hint, and
//! a closed stream gives its place back); and WatchEvents `from_now` follows from the
//! newest event without the backlog, on every store.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use convene_core::time::to_timestamp;
use convene_mesh::auth::request;
use convene_mesh::handles::{GrpcApproval, GrpcEvidenceStore, GrpcPolicy};
use convene_mesh::policy_file::{PolicySource, dev_credential};
use convene_proto::v1::{self, run_event::Kind, supervisor_client::SupervisorClient};
use convene_server::test_util::TestServer;
use convene_server::{GrpcServer, ServerSettings, Shutdown};
use convene_store::test_util::test_databases;
use convene_supervisor::store::{Events, RunStore};
use convene_supervisor::{Config, MemoryStore, MeshConnector, Parts, SqlRunStore};
use futures::StreamExt as _;
use tempfile::TempDir;
use tonic::Code;
use tonic::transport::Channel;

const TENANT: &str = "acme-payments";
const ONCALL: &str = "oncall@acme";
const ALICE: &str = "alice@acme";

/// A supervisor on `store` served over gRPC on loopback; its peers are never called
/// (these calls only read the store).
struct Fixture {
    dir: TempDir,
    server: TestServer,
    _shutdown: Shutdown,
}

impl Fixture {
    async fn start(store: Arc<dyn RunStore>, max_watch_streams: usize) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let (policy, _) = PolicySource::new(None, Some(dir.path().join("credentials")))
            .load()
            .unwrap();
        let nowhere = "http://127.0.0.1:9";
        let shutdown = Shutdown::new();
        let (service, _registry) = convene_supervisor::build(Parts {
            policy: Arc::new(GrpcPolicy::connect(nowhere).unwrap()),
            evidence: Arc::new(GrpcEvidenceStore::connect(nowhere).unwrap()),
            approval: Arc::new(GrpcApproval::connect(nowhere).unwrap()),
            policy_file: Arc::new(policy),
            credential: "unused".into(),
            store,
            connector: Arc::new(MeshConnector::default()),
            config: Config {
                common: convene_server::ServiceCommon {
                    data_dir: dir.path().to_owned(),
                    ..Config::default().common
                },
                max_watch_streams,
                ..Config::default()
            },
            shutdown: shutdown.clone(),
        });
        let server = TestServer::start(
            GrpcServer::new(ServerSettings::default())
                .add_service(v1::supervisor_server::SupervisorServer::new(service)),
        )
        .await;
        Self {
            dir,
            server,
            _shutdown: shutdown,
        }
    }

    fn credential(&self, principal: &str) -> String {
        dev_credential(&self.dir.path().join("credentials"), principal).unwrap()
    }

    async fn client(&self) -> SupervisorClient<Channel> {
        SupervisorClient::new(self.server.channel().await)
    }
}

/// A new running run of [`TENANT`] with its `run.started` event in the outbox; its id
/// and that event's id.
async fn started(store: &dyn RunStore) -> (String, String) {
    let now = SystemTime::now();
    let run = v1::Run {
        run_id: uuid::Uuid::now_v7().to_string(),
        tenant: TENANT.into(),
        principal: ONCALL.into(),
        state: v1::RunState::Running as i32,
        version: 1,
        created_at: Some(to_timestamp(now)),
        updated_at: Some(to_timestamp(now)),
        ..Default::default()
    };
    let cloud = convene_supervisor::events::cloud(
        convene_supervisor::events::RUN_STARTED,
        &run,
        None,
        now,
        serde_json::json!({ "runId": run.run_id }),
    );
    let event_id = cloud.id.clone();
    let events = Events {
        run: vec![v1::RunEvent {
            sequence: 1,
            run_id: run.run_id.clone(),
            time: Some(to_timestamp(now)),
            kind: Some(Kind::Started(run.clone())),
        }],
        cloud: vec![cloud],
        commands: Vec::new(),
        release: false,
    };
    store.create(&run, None, &events).await.expect("created");
    (run.run_id, event_id)
}

fn watch_run(run_id: &str, credential: &str) -> tonic::Request<v1::WatchRunRequest> {
    request(
        v1::WatchRunRequest {
            run_id: run_id.into(),
            after_sequence: 0,
        },
        credential,
    )
}

fn follow(from_now: bool, credential: &str) -> tonic::Request<v1::WatchEventsRequest> {
    request(
        v1::WatchEventsRequest {
            follow: true,
            from_now,
            ..Default::default()
        },
        credential,
    )
}

#[tokio::test]
async fn a_principal_holds_at_most_max_watch_streams_and_gets_a_place_back_when_one_closes() {
    const LIMIT: usize = 3;
    let store: Arc<dyn RunStore> = Arc::new(MemoryStore::default());
    let (run_id, _) = started(store.as_ref()).await;
    let fx = Fixture::start(store, LIMIT).await;
    let oncall = fx.credential(ONCALL);
    let mut client = fx.client().await;

    // LIMIT streams, of both calls: the run does not end, so each stays open.
    let mut open = Vec::new();
    for n in 0..LIMIT {
        let mut stream = if n % 2 == 0 {
            let mut s = client
                .watch_run(watch_run(&run_id, &oncall))
                .await
                .expect("a stream within the limit")
                .into_inner();
            let first = s.next().await.expect("the backlog").expect("an event");
            assert_eq!(first.event.expect("set").sequence, 1);
            Box::pin(s.map(|_| ())) as futures::stream::BoxStream<'static, ()>
        } else {
            let mut s = client
                .watch_events(follow(false, &oncall))
                .await
                .expect("a stream within the limit")
                .into_inner();
            s.next().await.expect("the backlog").expect("an event");
            Box::pin(s.map(|_| ())) as futures::stream::BoxStream<'static, ()>
        };
        // Still open: nothing more arrives.
        assert!(
            tokio::time::timeout(Duration::from_millis(50), stream.next())
                .await
                .is_err(),
            "stream {n} ended early"
        );
        open.push(stream);
    }

    // One more, of either call, is refused at once with the hint.
    for refused in [
        client
            .watch_run(watch_run(&run_id, &oncall))
            .await
            .map(|_| ()),
        client.watch_events(follow(true, &oncall)).await.map(|_| ()),
    ] {
        let status = refused.expect_err("one stream past the limit is refused");
        assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
        assert!(
            status.message().contains("max_watch_streams")
                && status.message().contains(&format!("principal {ONCALL}")),
            "the refusal names the limit and the principal: {}",
            status.message()
        );
        assert_eq!(
            convene_server::retry_after(&status),
            Some(Duration::from_secs(1)),
            "the refusal carries a google.rpc.RetryInfo hint: {status:?}"
        );
    }
    // Another principal has places of its own.
    let alice = fx.credential(ALICE);
    let _alices = client
        .watch_run(watch_run(&run_id, &alice))
        .await
        .expect("another principal's stream");

    // The client drops one stream: its place comes back once the server sees it gone.
    drop(open.pop());
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let reopened = loop {
        match client.watch_run(watch_run(&run_id, &oncall)).await {
            Ok(stream) => break stream,
            Err(status) if status.code() == Code::ResourceExhausted => {
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "the closed stream's place never came back: {status:?}"
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(status) => panic!("unexpected refusal: {status:?}"),
        }
    };
    // And the limit holds again.
    let status = client
        .watch_events(follow(true, &oncall))
        .await
        .expect_err("the limit holds with the new stream");
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    drop((reopened, open));
}

#[tokio::test]
async fn watch_events_from_now_carries_only_later_events_on_every_store() {
    let mut stores: Vec<(&str, Arc<dyn RunStore>, Option<_>)> =
        vec![("memory", Arc::new(MemoryStore::default()), None)];
    for t in test_databases().await {
        let store = Arc::new(SqlRunStore::open(t.db.clone()).await.unwrap());
        stores.push((t.label, store, Some(t)));
    }
    for (label, store, _db) in stores {
        // An empty outbox: from now is from the start, and the first event arrives.
        let fx = Fixture::start(store.clone(), 8).await;
        let oncall = fx.credential(ONCALL);
        let mut client = fx.client().await;
        let mut empty = client
            .watch_events(follow(true, &oncall))
            .await
            .unwrap_or_else(|s| panic!("{label}: {s:?}"))
            .into_inner();
        let mut from_start = client
            .watch_events(request(v1::WatchEventsRequest::default(), &oncall))
            .await
            .unwrap()
            .into_inner();
        assert!(
            from_start.next().await.is_none(),
            "{label}: the outbox is empty"
        );
        let (_, first) = started(store.as_ref()).await;
        let got = tokio::time::timeout(Duration::from_secs(10), empty.next())
            .await
            .unwrap_or_else(|_| panic!("{label}: the first event never arrived"))
            .expect("an event")
            .expect("ok");
        assert_eq!(got.event.expect("set").id, first, "{label}");

        // A backlog of events, then a follower from now: it gets only what comes next.
        let mut backlog = vec![first];
        for _ in 0..5 {
            backlog.push(started(store.as_ref()).await.1);
        }
        let mut now = client
            .watch_events(follow(true, &oncall))
            .await
            .expect("from now")
            .into_inner();
        // The same request from the start sees the backlog: it is there to be skipped.
        let mut all = client
            .watch_events(request(v1::WatchEventsRequest::default(), &oncall))
            .await
            .unwrap()
            .into_inner();
        let mut seen = Vec::new();
        while let Some(e) = all.next().await {
            seen.push(e.unwrap().event.unwrap().id);
        }
        assert_eq!(seen, backlog, "{label}");
        assert!(
            tokio::time::timeout(Duration::from_millis(100), now.next())
                .await
                .is_err(),
            "{label}: a follower from now received the backlog"
        );
        let (_, later) = started(store.as_ref()).await;
        let got = tokio::time::timeout(Duration::from_secs(10), now.next())
            .await
            .unwrap_or_else(|_| panic!("{label}: the later event never arrived"))
            .expect("an event")
            .expect("ok")
            .event
            .expect("set");
        assert_eq!(got.id, later, "{label}: the first event is the later one");

        // from_now with a resume point, or without follow, says what to change.
        for (req, says) in [
            (
                v1::WatchEventsRequest {
                    after_event_id: later.clone(),
                    follow: true,
                    from_now: true,
                    ..Default::default()
                },
                "not both",
            ),
            (
                v1::WatchEventsRequest {
                    from_now: true,
                    ..Default::default()
                },
                "needs follow",
            ),
        ] {
            let status = client
                .watch_events(request(req, &oncall))
                .await
                .expect_err("refused");
            assert_eq!(status.code(), Code::InvalidArgument, "{label}: {status:?}");
            assert!(
                status.message().contains("from_now") && status.message().contains(says),
                "{label}: {}",
                status.message()
            );
        }
    }
}
