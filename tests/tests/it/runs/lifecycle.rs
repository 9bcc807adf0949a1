//! A run's life after it started: its tokens revoked when it finishes, progress held
//! back for one commit (and committed at shutdown), StartRun calls that wait for the
//! run's end, and finding runs again with ListRuns' filters.

use std::collections::BTreeSet;
use std::time::Duration;

use crate::harness::{MeshOptions, Mode, TestMesh, Workers, example_spec, wait_for, wait_until};
use convene_mesh::auth::request;
use convene_proto::v1::{self, run_event::Kind};

use super::{LIMIT, ONCALL, held_profiles, listed_runs, one_group};

/// Every finished run's tokens are revoked, each run recorded once in the decision log,
/// also when many runs finish at once (the supervisor then revokes those that finished
/// while its last revocation was on its way in one call).
async fn finished_runs_revoked(mode: Mode) {
    const RUNS: usize = 16;
    let dir = tempfile::tempdir().unwrap();
    let release = dir.path().join("release");
    let held = held_profiles(&release, None);
    let mesh = TestMesh::start(
        mode,
        MeshOptions {
            workers: vec![Workers {
                profiles: Some(held),
                count: 1,
                capacity: 3 * RUNS as u32,
            }],
            ..MeshOptions::default()
        },
    )
    .await;
    let starts = (0..RUNS).map(|_| async {
        let mut spec = example_spec();
        spec.idempotency_key.clear();
        mesh.start_run_id(ONCALL, spec).await
    });
    let ids: BTreeSet<String> = futures::future::join_all(starts)
        .await
        .into_iter()
        .collect();
    assert_eq!(ids.len(), RUNS);
    let db = mesh.open_database().await;
    let revoked_runs = || async {
        db.fetch_all(convene_store::sql(
            "SELECT target_id FROM revocations WHERE kind = 'run'",
        ))
        .await
        .expect("revocations read")
        .iter()
        .map(|r| r.get::<String>("target_id").expect("target_id"))
        .collect::<Vec<String>>()
    };
    assert!(revoked_runs().await.is_empty(), "revoked while running");

    // Every held delegation goes on at once, so the runs finish together.
    std::fs::write(&release, b"").unwrap();
    let mut states = BTreeSet::new();
    let mut waiting = Vec::new();
    for id in &ids {
        let run = mesh.wait_terminal(ONCALL, id, LIMIT).await;
        states.insert(run.state);
        waiting.push(run);
    }
    assert_eq!(states.len(), 1, "runs alike stop alike: {states:?}");
    // A waiting run keeps its tokens: it may need them again.
    assert!(revoked_runs().await.is_empty(), "revoked while waiting");
    // Closed together, they end together.
    let closes = waiting.iter().map(async |run| {
        mesh.supervisor()
            .resume_run(request(
                v1::ResumeRunRequest {
                    run_id: run.run_id.clone(),
                    ticket: run.ticket.clone(),
                    rationale: "closed as it stands".to_owned(),
                    input: Some(v1::resume_run_request::Input::Close(v1::CloseRun {})),
                },
                &mesh.credential(ONCALL),
            ))
            .await
    });
    for closed in futures::future::join_all(closes).await {
        let run = closed.expect("ResumeRun").into_inner().run.expect("run");
        assert!(convene_supervisor::store::is_final(run.state), "{run:#?}");
    }
    // The decision log: rows of the database in one process, a file of the policy
    // process otherwise.
    let logged_runs = || async {
        let mut logged: Vec<String> = db
            .fetch_all(convene_store::sql(
                "SELECT run_id FROM decision_log WHERE kind = 'revoke'",
            ))
            .await
            .expect("decision log read")
            .iter()
            .map(|r| r.get::<String>("run_id").expect("run_id"))
            .collect();
        if let Ok(text) = std::fs::read_to_string(mesh.data_dir().join("policy/decisions.jsonl")) {
            // Whole lines only: the last may be half written.
            for line in text.split_inclusive('\n').filter(|l| l.ends_with('\n')) {
                let record: serde_json::Value = serde_json::from_str(line).expect("a JSON record");
                if record["kind"] == "revoke" && record["target"] == "run" {
                    logged.push(record["id"].as_str().expect("id").to_owned());
                }
            }
        }
        logged
    };
    // The revocation follows the terminal state, and its record follows the revocation
    // (a policy process appends it to its file after the revocation committed): wait
    // for the last of both.
    let (revoked, mut logged) = wait_for(
        "every finished run to be revoked and logged",
        LIMIT,
        async || {
            let revoked = revoked_runs().await;
            let logged = logged_runs().await;
            if revoked.len() >= RUNS && logged.len() >= RUNS {
                Ok((revoked, logged))
            } else {
                Err((revoked, logged))
            }
        },
    )
    .await;
    let revoked_set: BTreeSet<String> = revoked.iter().cloned().collect();
    assert_eq!(revoked_set, ids, "the revoked runs are the finished ones");
    assert_eq!(revoked.len(), RUNS, "each run revoked once: {revoked:?}");
    logged.sort();
    let expected: Vec<String> = ids.iter().cloned().collect();
    assert_eq!(logged, expected, "each run in the decision log once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn finished_runs_have_their_tokens_revoked_each_once_in_one_process() {
    finished_runs_revoked(Mode::InProcess).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn finished_runs_have_their_tokens_revoked_each_once_as_processes() {
    finished_runs_revoked(Mode::Processes).await;
}

/// Each event kind of a run, in order.
fn kinds(events: &[v1::RunEvent]) -> Vec<&'static str> {
    events
        .iter()
        .map(|e| match e.kind {
            Some(Kind::Started(_)) => "started",
            Some(Kind::Dispatched(_)) => "dispatched",
            Some(Kind::Completed(_)) => "completed",
            Some(Kind::Decision(_)) => "decision",
            Some(Kind::Terminal(_)) => "terminal",
            Some(Kind::Waiting(_)) => "waiting",
            _ => "other",
        })
        .collect()
}

/// One example run on a fresh in-process mesh whose supervisor holds progress that
/// decides nothing for `linger`: the run as it ended, and its events.
async fn example_run_lingering(linger: Duration) -> (v1::Run, Vec<v1::RunEvent>) {
    let mesh = TestMesh::start(
        Mode::InProcess,
        MeshOptions {
            commit_linger: Some(linger),
            ..MeshOptions::default()
        },
    )
    .await;
    let run = mesh
        .start_run(ONCALL, example_spec())
        .await
        .expect("StartRun")
        .run
        .expect("run");
    let run = mesh.wait_terminal(ONCALL, &run.run_id, LIMIT).await;
    let events = mesh.run_events(ONCALL, &run.run_id).await;
    (run, events)
}

/// With a commit linger, a run's dispatches and its results that decide nothing wait
/// for the commit of the join's decision, so the run takes fewer commits (versions) to
/// end; it ends the same, with every event, in order, without gaps.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn progress_that_decides_nothing_commits_with_the_decision() {
    // Long enough that the example's fast workers answer well inside it.
    let (lingered, lingered_events) = example_run_lingering(Duration::from_millis(800)).await;
    let (eager, eager_events) = example_run_lingering(Duration::ZERO).await;

    assert_eq!(lingered.state, eager.state, "{lingered:#?}");
    assert_eq!(lingered.outcome, eager.outcome, "{lingered:#?}");
    for events in [&lingered_events, &eager_events] {
        let sequences: Vec<u64> = events.iter().map(|e| e.sequence).collect();
        let gapless: Vec<u64> = (1..=events.len() as u64).collect();
        assert_eq!(sequences, gapless, "{events:#?}");
        let kinds = kinds(events);
        for (kind, n) in [("dispatched", 3), ("completed", 3), ("waiting", 1)] {
            assert_eq!(kinds.iter().filter(|k| **k == kind).count(), n, "{kinds:?}");
        }
    }
    // Accepted (version 1), then the decision with everything before it: what would
    // have taken a commit for the dispatches and for each result it waited past.
    assert!(
        lingered.version < eager.version,
        "lingering: version {}, committing each step: version {}",
        lingered.version,
        eager.version
    );
    assert_eq!(lingered.version, 2, "{:?}", kinds(&lingered_events));
}

/// Progress held back for a later commit is committed when the supervisor shuts down
/// (SIGTERM), not lost: the stored run shows its dispatches although the linger has
/// not passed and no result came.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_supervisor_shutting_down_commits_the_progress_it_held() {
    use convene_supervisor::store::RunStore as _;

    let dir = tempfile::tempdir().unwrap();
    let (release, log) = (dir.path().join("release"), dir.path().join("held.log"));
    let held = held_profiles(&release, Some(&log));
    let mut mesh = TestMesh::start(
        Mode::Processes,
        MeshOptions {
            workers: vec![Workers {
                profiles: Some(held),
                count: 1,
                capacity: 3,
            }],
            commit_linger: Some(Duration::from_secs(1)),
            ..MeshOptions::default()
        },
    )
    .await;
    let run_id = mesh.start_run_id(ONCALL, example_spec()).await;
    wait_until(
        "the worker to hold all three delegations",
        LIMIT,
        async || std::fs::read_to_string(&log).map_or(0, |l| l.lines().count()) >= 3,
    )
    .await;
    // The worker reported its dispatches before holding them; give the reports a moment
    // to reach the run, well inside the linger.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let stored = convene_supervisor::SqlRunStore::open(mesh.open_database().await)
        .await
        .expect("the run store opens");
    let before = stored.get(&run_id).await.expect("read").expect("stored");
    assert_eq!(
        before.state,
        v1::RunState::Pending as i32,
        "held: {before:#?}"
    );

    mesh.signal("supervisor", rustix::process::Signal::TERM);
    assert!(
        mesh.wait_exited("supervisor", LIMIT).await,
        "the supervisor stops"
    );
    let after = stored.get(&run_id).await.expect("read").expect("stored");
    assert_eq!(after.state, v1::RunState::Running as i32, "{after:#?}");
    let events = stored.run_events(&run_id, 0).await.expect("events read");
    assert_eq!(
        kinds(&events),
        ["started", "dispatched", "dispatched", "dispatched"]
    );
    std::fs::write(&release, b"").unwrap();
}

/// A `StartRun` of `spec` as `ONCALL` (waiting for the run's end with `wait`) that can
/// run as a task of its own.
fn start_run_call(
    mesh: &TestMesh,
    spec: v1::RunSpec,
    wait: bool,
) -> impl std::future::Future<Output = Result<v1::StartRunResponse, tonic::Status>> + Send + 'static
{
    let supervisor = mesh.supervisor();
    let credential = mesh.credential(ONCALL);
    async move {
        supervisor
            .start_run(request(
                v1::StartRunRequest {
                    spec: Some(spec),
                    wait,
                    ..Default::default()
                },
                &credential,
            ))
            .await
            .map(tonic::Response::into_inner)
    }
}

/// Waits until a new mesh has stored its first run.
async fn until_a_run_is_stored(mesh: &TestMesh) {
    wait_until("the run to be stored", LIMIT, async || {
        !listed_runs(mesh).await.is_empty()
    })
    .await;
}

/// `StartRun` with `wait` answers once the run has ended, with the ended run; a second
/// call with the same idempotency key waits for the same run.
async fn start_run_waits(mode: Mode) {
    let dir = tempfile::tempdir().unwrap();
    let release = dir.path().join("release");
    let mesh = TestMesh::start(mode, one_group(held_profiles(&release, None))).await;
    let mut spec = example_spec();
    spec.idempotency_key = "wait-for-me".to_owned();
    let start = |wait: bool| start_run_call(&mesh, spec.clone(), wait);
    let first = tokio::spawn(start(true));
    // The run is stored while the call waits (the mesh is new: it is the only run).
    until_a_run_is_stored(&mesh).await;
    // Without `wait` the same key answers at once, with the run still going.
    let accepted = start(false).await.expect("StartRun");
    assert!(!accepted.created);
    let accepted = accepted.run.expect("run");
    assert!(
        !convene_supervisor::store::is_terminal(accepted.state),
        "{accepted:#?}"
    );
    let second = tokio::spawn(start(true));
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        !first.is_finished() && !second.is_finished(),
        "a waiting StartRun answered while every delegation is held"
    );

    std::fs::write(&release, b"").unwrap();
    let first = tokio::time::timeout(LIMIT, first)
        .await
        .expect("the waiting StartRun answers once the run ends")
        .unwrap()
        .expect("StartRun");
    let second = tokio::time::timeout(LIMIT, second)
        .await
        .expect("the second waiting StartRun answers too")
        .unwrap()
        .expect("StartRun");
    assert!(first.created && !second.created);
    let ended = first.run.expect("run");
    assert_eq!(ended.run_id, accepted.run_id);
    // The example stops waiting for a human (its specialists conflict).
    assert_eq!(ended.state, v1::RunState::WaitingInput as i32, "{ended:#?}");
    assert_ne!(
        ended.outcome,
        v1::JoinOutcome::Unspecified as i32,
        "the ended run carries its outcome"
    );
    assert!(ended.decision.is_some(), "and its decision");
    // What the calls answered is the run as stored at its end.
    let stored = mesh.get_run(ONCALL, &ended.run_id).await;
    assert_eq!(ended, stored);
    assert_eq!(second.run.expect("run"), stored);
    // An ended run is answered at once.
    let again = tokio::time::timeout(Duration::from_secs(5), start(true))
        .await
        .expect("an ended run is answered at once")
        .expect("StartRun");
    assert_eq!(again.run.expect("run"), stored);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn start_run_with_wait_answers_when_the_run_ends_in_one_process() {
    start_run_waits(Mode::InProcess).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn start_run_with_wait_answers_when_the_run_ends_as_processes() {
    start_run_waits(Mode::Processes).await;
}

/// A `StartRun` waiting for a run when the supervisor shuts down answers UNAVAILABLE,
/// saying the run goes on, instead of hanging or dropping the call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_start_run_answers_unavailable_when_the_supervisor_shuts_down() {
    let dir = tempfile::tempdir().unwrap();
    let release = dir.path().join("release");
    let mesh = TestMesh::start(Mode::InProcess, one_group(held_profiles(&release, None))).await;
    let waiting = tokio::spawn(start_run_call(&mesh, example_spec(), true));
    until_a_run_is_stored(&mesh).await;
    assert!(
        !waiting.is_finished(),
        "answered while every delegation is held"
    );

    mesh.stop(Duration::from_secs(10)).await;
    let status = tokio::time::timeout(LIMIT, waiting)
        .await
        .expect("the waiting call answers when the supervisor shuts down")
        .unwrap()
        .expect_err("the run has not ended");
    assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}");
    assert!(
        status.message().contains("shutting down") && status.message().contains("goes on"),
        "{}",
        status.message()
    );
}

/// One ListRuns call as `who`.
async fn list_runs_as(
    mesh: &TestMesh,
    who: &str,
    req: v1::ListRunsRequest,
) -> Result<v1::ListRunsResponse, tonic::Status> {
    mesh.supervisor()
        .list_runs(request(req, &mesh.credential(who)))
        .await
        .map(tonic::Response::into_inner)
}

/// Every page ListRuns answers to `req`, as run ids, following next_page_token with the
/// same filters.
async fn listed_pages(
    mesh: &TestMesh,
    who: &str,
    mut req: v1::ListRunsRequest,
) -> Vec<Vec<String>> {
    let mut pages = Vec::new();
    loop {
        let page = list_runs_as(mesh, who, req.clone())
            .await
            .expect("ListRuns");
        pages.push(page.runs.iter().map(|r| r.run_id.clone()).collect());
        if page.next_page_token.is_empty() || pages.len() > 10 {
            return pages;
        }
        req.page_token = page.next_page_token;
    }
}

/// ListRuns keeps the runs whose labels, state and creation time match, page by page,
/// within the caller's tenant; filters it cannot apply are refused naming the field.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_runs_filters_by_label_state_and_time() {
    let mesh = TestMesh::start(Mode::InProcess, MeshOptions::default()).await;
    let labelled = |incident: &str, service: &str| {
        let mut spec = example_spec();
        spec.idempotency_key.clear();
        spec.labels = [("incident", incident), ("service", service)]
            .into_iter()
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .collect();
        spec
    };
    // One after the other, so their creation times are in this order.
    let mut runs = Vec::new();
    for (incident, service) in [
        ("INC-1", "payment-api"),
        ("INC-2", "payment-api"),
        ("INC-1", "ledger"),
        ("INC-1", "payment-api"),
        ("INC-1", "payment-api"),
    ] {
        let started = mesh
            .start_run(ONCALL, labelled(incident, service))
            .await
            .expect("StartRun");
        runs.push(started.run.expect("run"));
    }
    let other = mesh
        .start_run("analyst@globex", labelled("INC-1", "payment-api"))
        .await
        .expect("another tenant's StartRun")
        .run
        .expect("run");
    for run in &runs {
        mesh.wait_terminal(ONCALL, &run.run_id, LIMIT).await;
    }
    mesh.wait_terminal("analyst@globex", &other.run_id, LIMIT)
        .await;
    // The example stops waiting for input; cancel one of them.
    mesh.supervisor()
        .cancel_run(request(
            v1::CancelRunRequest {
                run_id: runs[3].run_id.clone(),
                reason: "duplicate".to_owned(),
            },
            &mesh.credential(ONCALL),
        ))
        .await
        .expect("CancelRun");
    let id = |i: usize| runs[i].run_id.clone();
    let created = |i: usize| runs[i].created_at;
    let waiting = mesh.get_run(ONCALL, &id(0)).await.state;
    assert_eq!(waiting, v1::RunState::WaitingInput as i32);
    wait_for("the run to be cancelled", LIMIT, async || {
        let run = mesh.get_run(ONCALL, &id(3)).await;
        if run.state == v1::RunState::Cancelled as i32 {
            Ok(())
        } else {
            Err(run)
        }
    })
    .await;

    let incident = |labels: &[(&str, &str)]| v1::ListRunsRequest {
        page_size: 1,
        labels: labels
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect(),
        ..Default::default()
    };
    let inc1_payment = incident(&[("incident", "INC-1"), ("service", "payment-api")]);
    assert_eq!(
        listed_pages(&mesh, ONCALL, inc1_payment.clone()).await,
        [vec![id(4)], vec![id(3)], vec![id(0)]],
        "every label must match, newest first, a run a page"
    );
    assert_eq!(
        listed_pages(
            &mesh,
            ONCALL,
            v1::ListRunsRequest {
                states: vec![v1::RunState::WaitingInput as i32],
                ..inc1_payment.clone()
            }
        )
        .await,
        [vec![id(4)], vec![id(0)]],
        "labels and state"
    );
    // From the second run's creation (inclusive) to the last one's (exclusive).
    assert_eq!(
        listed_pages(
            &mesh,
            ONCALL,
            v1::ListRunsRequest {
                page_size: 2,
                states: vec![v1::RunState::WaitingInput as i32],
                created_after: created(1),
                created_before: created(4),
                labels: [("incident".to_owned(), "INC-1".to_owned())].into(),
                ..Default::default()
            }
        )
        .await,
        [vec![id(2)]],
        "labels, state and time window"
    );
    assert_eq!(
        listed_pages(
            &mesh,
            ONCALL,
            v1::ListRunsRequest {
                created_after: created(3),
                ..inc1_payment.clone()
            }
        )
        .await,
        [vec![id(4)], vec![id(3)]],
    );
    // The other tenant's run with the same labels is its own.
    assert_eq!(
        listed_pages(&mesh, "analyst@globex", inc1_payment.clone()).await,
        [vec![other.run_id.clone()]]
    );

    let too_many = v1::ListRunsRequest {
        labels: (0..17).map(|i| (format!("k{i}"), "v".to_owned())).collect(),
        ..Default::default()
    };
    let empty_key = incident(&[("", "INC-1")]);
    let backwards = v1::ListRunsRequest {
        created_after: created(4),
        created_before: created(1),
        ..Default::default()
    };
    let bad_time = v1::ListRunsRequest {
        created_before: Some(prost_types::Timestamp {
            seconds: 1,
            nanos: -5,
        }),
        ..Default::default()
    };
    for (req, field) in [
        (too_many, "labels"),
        (empty_key, "labels"),
        (backwards, "created_after"),
        (bad_time, "created_before"),
    ] {
        let status = list_runs_as(&mesh, ONCALL, req)
            .await
            .expect_err("an invalid filter");
        assert_eq!(status.code(), tonic::Code::InvalidArgument, "{status:?}");
        assert!(
            status.message().starts_with(&format!("invalid {field}: ")),
            "{}",
            status.message()
        );
    }
}
