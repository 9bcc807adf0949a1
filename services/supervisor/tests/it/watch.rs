//! WatchRun and WatchEvents read the store when there is something new for them, not on
//! every other run's commit: with many runs watched at once, the latter would cost
//! every watcher a query per commit of any run.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use convene_core::time::to_timestamp;
use convene_mesh::auth::request;
use convene_mesh::handles::{GrpcApproval, GrpcEvidenceStore, GrpcPolicy};
use convene_mesh::policy_file::dev_credential;
use convene_proto::v1::supervisor_server::Supervisor as _;
use convene_proto::v1::{self, run_event::Kind};
use convene_server::Shutdown;
use convene_supervisor::store::{
    CommandDone, Committed, Created, Events, IdempotencyKey, Page, RunCommand, RunFilter, RunStore,
    StoreError,
};
use convene_supervisor::{Config, MemoryStore, MeshConnector, Parts};
use futures::StreamExt as _;
use tokio::sync::broadcast;

/// A memory store counting the reads of run events and of the outbox.
#[derive(Default)]
struct Counting {
    inner: MemoryStore,
    run_reads: AtomicUsize,
    outbox_reads: AtomicUsize,
}

#[async_trait]
impl RunStore for Counting {
    async fn create(
        &self,
        run: &v1::Run,
        key: Option<&IdempotencyKey>,
        events: &Events,
    ) -> Result<Created, StoreError> {
        self.inner.create(run, key, events).await
    }
    async fn commit(&self, run: &v1::Run, events: &Events) -> Result<(), StoreError> {
        self.inner.commit(run, events).await
    }
    async fn get(&self, run_id: &str) -> Result<Option<v1::Run>, StoreError> {
        self.inner.get(run_id).await
    }
    async fn list(
        &self,
        tenant: &str,
        filter: &RunFilter,
        page_size: usize,
        after: Option<&str>,
    ) -> Result<Page, StoreError> {
        self.inner.list(tenant, filter, page_size, after).await
    }
    async fn run_events(&self, run_id: &str, after: u64) -> Result<Vec<v1::RunEvent>, StoreError> {
        self.run_reads.fetch_add(1, Ordering::SeqCst);
        self.inner.run_events(run_id, after).await
    }
    async fn cloud_events(
        &self,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<v1::CloudEvent>, StoreError> {
        self.outbox_reads.fetch_add(1, Ordering::SeqCst);
        self.inner.cloud_events(after, limit).await
    }
    fn subscribe(&self) -> broadcast::Receiver<Committed> {
        self.inner.subscribe()
    }
    fn owner(&self) -> Option<(&str, Duration)> {
        self.inner.owner()
    }
    async fn unfinished(&self) -> Result<Vec<v1::Run>, StoreError> {
        self.inner.unfinished().await
    }
    async fn claim_runs(
        &self,
        owner: &str,
        lease_ttl: Duration,
        limit: usize,
    ) -> Result<Vec<v1::Run>, StoreError> {
        self.inner.claim_runs(owner, lease_ttl, limit).await
    }
    async fn renew_lease(
        &self,
        owner: &str,
        run_ids: &[String],
        lease_ttl: Duration,
    ) -> Result<Vec<String>, StoreError> {
        self.inner.renew_lease(owner, run_ids, lease_ttl).await
    }
    async fn release(&self, owner: &str, run_id: &str) -> Result<bool, StoreError> {
        self.inner.release(owner, run_id).await
    }
    async fn relay_cursor(&self, relay: &str) -> Result<Option<String>, StoreError> {
        self.inner.relay_cursor(relay).await
    }
    async fn acknowledge(&self, relay: &str, event_id: &str) -> Result<(), StoreError> {
        self.inner.acknowledge(relay, event_id).await
    }
    async fn add_command(&self, command: &RunCommand) -> Result<(), StoreError> {
        self.inner.add_command(command).await
    }
    async fn pending_commands(&self, run_id: &str) -> Result<Vec<RunCommand>, StoreError> {
        self.inner.pending_commands(run_id).await
    }
    async fn runs_with_commands(&self) -> Result<Vec<String>, StoreError> {
        self.inner.runs_with_commands().await
    }
    async fn command_outcome(&self, command_id: &str) -> Result<Option<CommandDone>, StoreError> {
        self.inner.command_outcome(command_id).await
    }
    async fn end_commands(&self, done: &[CommandDone]) -> Result<(), StoreError> {
        self.inner.end_commands(done).await
    }
    async fn claim_waiting(
        &self,
        owner: &str,
        run_id: &str,
        lease_ttl: Duration,
    ) -> Result<Option<v1::Run>, StoreError> {
        self.inner.claim_waiting(owner, run_id, lease_ttl).await
    }
    async fn import_events(&self, events: &[v1::CloudEvent]) -> Result<(), StoreError> {
        self.inner.import_events(events).await
    }
    async fn register_replica(&self, replica: &str, endpoint: &str) -> Result<(), StoreError> {
        self.inner.register_replica(replica, endpoint).await
    }
    async fn run_owner(
        &self,
        run_id: &str,
    ) -> Result<Option<(String, Option<String>)>, StoreError> {
        self.inner.run_owner(run_id).await
    }
}

const TENANT: &str = "acme-payments";

fn run(n: usize) -> v1::Run {
    let now = to_timestamp(SystemTime::now());
    v1::Run {
        run_id: format!("run-{n:04}"),
        tenant: TENANT.into(),
        principal: "oncall@acme".into(),
        state: v1::RunState::Running as i32,
        version: 1,
        created_at: Some(now),
        updated_at: Some(now),
        ..Default::default()
    }
}

fn event(run: &v1::Run, sequence: u64, kind: Kind) -> v1::RunEvent {
    v1::RunEvent {
        sequence,
        run_id: run.run_id.clone(),
        time: Some(to_timestamp(SystemTime::now())),
        kind: Some(kind),
    }
}

fn cloud(run: &v1::Run, kind: &str) -> v1::CloudEvent {
    convene_supervisor::events::cloud(
        kind,
        run,
        None,
        SystemTime::now(),
        serde_json::json!({ "runId": run.run_id }),
    )
}

/// Ends `run` at version 2 with a terminal event (sequence 2) and `run.completed`.
async fn finish(store: &Counting, run: &v1::Run) {
    let ended = v1::Run {
        version: 2,
        state: v1::RunState::Succeeded as i32,
        ..run.clone()
    };
    let events = Events {
        run: vec![event(
            &ended,
            2,
            Kind::Terminal(v1::RunTerminal {
                state: ended.state,
                ..Default::default()
            }),
        )],
        cloud: vec![cloud(&ended, convene_supervisor::events::RUN_COMPLETED)],
        commands: Vec::new(),
        release: false,
    };
    store.commit(&ended, &events).await.expect("committed");
}

/// Starts `run` (sequence 1) without an outbox event, so only WatchRun has news.
async fn start(store: &Counting, run: &v1::Run) {
    let events = Events {
        run: vec![event(run, 1, Kind::Started(run.clone()))],
        cloud: Vec::new(),
        commands: Vec::new(),
        release: false,
    };
    store.create(run, None, &events).await.expect("created");
}

#[tokio::test]
async fn watchers_read_the_store_only_for_their_own_news() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (policy, _) =
        convene_mesh::policy_file::PolicySource::new(None, Some(dir.path().join("credentials")))
            .load()
            .expect("policy");
    let credential = dev_credential(&dir.path().join("credentials"), "oncall@acme").expect("cred");
    // The peers are never called here: WatchRun and WatchEvents only read the store.
    let nowhere = "http://127.0.0.1:9";
    let store = Arc::new(Counting::default());
    let shutdown = Shutdown::new();
    let (service, _registry) = convene_supervisor::build(Parts {
        policy: Arc::new(GrpcPolicy::connect(nowhere).expect("endpoint")),
        evidence: Arc::new(GrpcEvidenceStore::connect(nowhere).expect("endpoint")),
        approval: Arc::new(GrpcApproval::connect(nowhere).expect("endpoint")),
        policy_file: Arc::new(policy),
        credential: "unused".into(),
        store: store.clone(),
        connector: Arc::new(MeshConnector::default()),
        config: Config {
            common: convene_server::ServiceCommon {
                data_dir: dir.path().to_owned(),
                ..Config::default().common
            },
            ..Config::default()
        },
        shutdown: shutdown.clone(),
    });

    let watched = run(0);
    start(&store, &watched).await;
    let mut run_stream = service
        .watch_run(request(
            v1::WatchRunRequest {
                run_id: watched.run_id.clone(),
                after_sequence: 0,
            },
            &credential,
        ))
        .await
        .expect("WatchRun")
        .into_inner();
    let mut event_stream = service
        .watch_events(request(
            v1::WatchEventsRequest {
                types: vec![convene_supervisor::events::RUN_COMPLETED.into()],
                run_id: watched.run_id.clone(),
                follow: true,
                ..Default::default()
            },
            &credential,
        ))
        .await
        .expect("WatchEvents")
        .into_inner();
    let first = run_stream.next().await.expect("an event").expect("ok");
    assert_eq!(first.event.expect("set").sequence, 1);

    // A hundred other runs start (no outbox events) while both streams wait; each
    // watcher gets to see each commit (the test runs on one thread: yielding lets them).
    for n in 1..=100 {
        start(&store, &run(n)).await;
        tokio::task::yield_now().await;
    }
    // The watched run ends: one run event and one outbox event, for both streams.
    finish(&store, &watched).await;
    let last = tokio::time::timeout(Duration::from_secs(30), run_stream.next())
        .await
        .expect("the terminal event arrives")
        .expect("an event")
        .expect("ok")
        .event
        .expect("set");
    assert!(matches!(last.kind, Some(Kind::Terminal(_))), "{last:?}");
    let completed = tokio::time::timeout(Duration::from_secs(30), event_stream.next())
        .await
        .expect("run.completed arrives")
        .expect("an event")
        .expect("ok")
        .event
        .expect("set");
    assert_eq!(completed.correlation_id, watched.run_id);

    // WatchRun: the backlog, then once for the terminal commit. WatchEvents: the
    // backlog (until an empty page), then once more for the one commit with outbox
    // events, with a page to find the end. A read per other run's commit would be 100
    // more of each.
    let run_reads = store.run_reads.load(Ordering::SeqCst);
    let outbox_reads = store.outbox_reads.load(Ordering::SeqCst);
    assert!(run_reads <= 3, "WatchRun read run events {run_reads} times");
    assert!(
        outbox_reads <= 6,
        "WatchEvents read the outbox {outbox_reads} times"
    );
    shutdown.trigger();
}
