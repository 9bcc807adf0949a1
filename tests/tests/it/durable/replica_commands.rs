//! Commands for runs on either of two supervisor replicas (PostgreSQL, each replica on
//! its own address): CancelRun and ResumeRun sent to the replica that does not own the
//! run act on it, and a cancel stored while the owner cannot act is honoured by the
//! replica that takes the run over after the owner is killed.

use crate::harness::{MeshOptions, Mode, TestMesh, Workers};
use convene_mesh::auth::request;
use convene_mesh::handles::SupervisorHandle;
use convene_proto::v1::{self, approval_server::Approval as _, policy_server::Policy as _};
use convene_store::{Database, sql};
use futures::StreamExt as _;

use super::replicas::postgres_server;
use super::{LIMIT, ONCALL, keyed_spec, replica_env, wait_terminal};

/// Two replicas on one fresh PostgreSQL database, each with its own worker holding
/// every delegation until `release` exists.
struct Two {
    mesh: TestMesh,
    a: SupervisorHandle,
    b: SupervisorHandle,
    credential: String,
    db: Database,
    release: std::path::PathBuf,
}

impl Two {
    async fn start(lease: &str) -> Option<Self> {
        let server = postgres_server().await?;
        let dir = tempfile::tempdir().expect("tempdir");
        let release = dir.keep().join("release");
        let held = super::profiles_held(&release);
        let mut mesh = TestMesh::start(
            Mode::Processes,
            MeshOptions {
                workers: vec![Workers {
                    profiles: Some(held.clone()),
                    count: 1,
                    capacity: 32,
                }],
                database_url: Some(server),
                supervisor_env: replica_env("replica-a", lease, "300ms"),
                ..MeshOptions::default()
            },
        )
        .await;
        let b_endpoint = mesh
            .spawn_supervisor("supervisor-b", replica_env("replica-b", lease, "300ms"))
            .await;
        let held_path = mesh.write_profiles("held", &held);
        mesh.spawn_worker_at("worker-b", &held_path, 32, &b_endpoint)
            .await;
        let a = mesh.supervisor();
        let b = mesh.supervisor_at(&b_endpoint);
        let credential = mesh.credential(ONCALL);
        let db = mesh.open_database().await;
        Some(Self {
            mesh,
            a,
            b,
            credential,
            db,
            release,
        })
    }

    /// A run started on replica A, held in flight there.
    async fn running_on_a(&self, key: &str) -> String {
        self.spec_running_on_a(keyed_spec(key)).await
    }

    /// A run of `spec` started on replica A, held in flight there.
    async fn spec_running_on_a(&self, spec: v1::RunSpec) -> String {
        let run = self
            .a
            .start_run(request(
                v1::StartRunRequest {
                    spec: Some(spec),
                    wait: false,
                    ..Default::default()
                },
                &self.credential,
            ))
            .await
            .expect("StartRun")
            .into_inner()
            .run
            .expect("run");
        crate::harness::wait_until("the run to be dispatched", LIMIT, async || {
            self.get(&run.run_id).await.state == v1::RunState::Running as i32
        })
        .await;
        assert_eq!(self.owner(&run.run_id).await.as_deref(), Some("replica-a"));
        run.run_id
    }

    async fn get(&self, run_id: &str) -> v1::Run {
        self.b
            .get_run(request(
                v1::GetRunRequest {
                    run_id: run_id.to_owned(),
                },
                &self.credential,
            ))
            .await
            .expect("GetRun")
            .into_inner()
            .run
            .expect("run")
    }

    async fn owner(&self, run_id: &str) -> Option<String> {
        super::run_owner(&self.db, run_id).await
    }

    async fn revoked(&self, run_id: &str) -> bool {
        self.db
            .fetch_optional(
                sql("SELECT 1 AS one FROM revocations WHERE target_id = $1").bind(run_id),
            )
            .await
            .expect("revocations read")
            .is_some()
    }

    async fn cancel(&self, via: &SupervisorHandle, run_id: &str) -> v1::CancelRunResponse {
        via.cancel_run(request(
            v1::CancelRunRequest {
                run_id: run_id.to_owned(),
                reason: "not needed any more".to_owned(),
            },
            &self.credential,
        ))
        .await
        .expect("CancelRun")
        .into_inner()
    }

    /// The run's delegations were all cancelled, and its tokens revoked.
    async fn assert_cancelled(&self, run_id: &str) {
        let run = wait_terminal(&self.b, &self.credential, run_id).await;
        assert_eq!(run.state, v1::RunState::Cancelled as i32, "{run:#?}");
        for d in &run.delegations {
            assert_ne!(
                d.state,
                v1::DelegationState::Completed as i32,
                "nothing completed: {run:#?}"
            );
            assert_ne!(d.state, v1::DelegationState::Dispatched as i32, "{run:#?}");
        }
        crate::harness::wait_until("the run's tokens to be revoked", LIMIT, async || {
            self.revoked(run_id).await
        })
        .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_and_resume_sent_to_the_replica_that_does_not_own_the_run_act_on_it() {
    let Some(two) = Two::start("2s").await else {
        return;
    };
    // A running run of A's, watched and cancelled through B.
    let run_id = two.running_on_a("replica-commands-running").await;
    let mut watch = two
        .b
        .watch_run(request(
            v1::WatchRunRequest {
                run_id: run_id.clone(),
                after_sequence: 0,
            },
            &two.credential,
        ))
        .await
        .expect("WatchRun through B")
        .into_inner();
    let answer = two.cancel(&two.b, &run_id).await;
    assert_eq!(
        answer.outcome,
        v1::CommandOutcome::Applied as i32,
        "B stored the cancel and A applied it: {answer:#?}"
    );
    assert!(!answer.command_id.is_empty());
    two.assert_cancelled(&run_id).await;
    // B's stream followed A's commits to the end.
    let mut last = None;
    while let Some(e) = watch.next().await {
        last = e.expect("an event").event.and_then(|e| e.kind);
    }
    match last {
        Some(v1::run_event::Kind::Terminal(t)) => {
            assert_eq!(t.state, v1::RunState::Cancelled as i32);
        }
        other => panic!("the watch through B ended on {other:?}"),
    }

    // Waiting runs (nobody holds one), started on A, continued through B.
    std::fs::write(&two.release, b"").expect("release");
    let started = two
        .a
        .start_run(request(
            v1::StartRunRequest {
                spec: Some(keyed_spec("replica-commands-waiting")),
                wait: true,
                ..Default::default()
            },
            &two.credential,
        ))
        .await
        .expect("StartRun")
        .into_inner()
        .run
        .expect("run");
    assert_eq!(
        started.state,
        v1::RunState::WaitingInput as i32,
        "{started:#?}"
    );
    assert_eq!(
        two.owner(&started.run_id).await,
        None,
        "a waiting run is nobody's"
    );
    let changes = started
        .delegations
        .iter()
        .filter_map(|d| d.task.as_ref())
        .find(|t| t.name == "changes")
        .expect("changes")
        .delegation_id
        .clone();
    let resumed = two
        .b
        .resume_run(request(
            v1::ResumeRunRequest {
                run_id: started.run_id.clone(),
                ticket: started.ticket.clone(),
                rationale: "the rule change preceded the errors".to_owned(),
                input: Some(v1::resume_run_request::Input::Settle(v1::SettleConflict {
                    topic: "primary_cause".to_owned(),
                    delegation_id: changes,
                    evidence_ids: Vec::new(),
                })),
            },
            &two.credential,
        ))
        .await
        .expect("ResumeRun through B")
        .into_inner();
    assert_eq!(resumed.outcome, v1::CommandOutcome::Applied as i32);
    let run = resumed.run.expect("run");
    assert_eq!(run.state, v1::RunState::WaitingApproval as i32, "{run:#?}");
    assert_eq!(run.human_decisions.len(), 1);

    // Cancelled through A now: its pending approval request is withdrawn.
    let answer = two.cancel(&two.a, &run.run_id).await;
    assert_eq!(answer.outcome, v1::CommandOutcome::Applied as i32);
    let run = answer.run.expect("run");
    assert_eq!(run.state, v1::RunState::Cancelled as i32);
    assert_eq!(run.actions[0].state, v1::ActionState::Cancelled as i32);
    let approval = two
        .mesh
        .approval()
        .get_approval(request(
            v1::GetApprovalRequest {
                approval_id: run.actions[0].approval_id.clone(),
            },
            &two.credential,
        ))
        .await
        .expect("GetApproval")
        .into_inner()
        .approval
        .expect("approval");
    assert_eq!(approval.state, v1::ApprovalState::Cancelled as i32);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_pending_when_the_owner_is_killed_is_honoured_by_the_replica_that_takes_over() {
    // Leases long enough that the cancel is still pending when B answers.
    let Some(mut two) = Two::start("20s").await else {
        return;
    };
    let run_id = two.running_on_a("replica-commands-frozen").await;
    // A cannot act (frozen), so the cancel B stores stays pending.
    two.mesh.signal("supervisor", rustix::process::Signal::STOP);
    let answer = two.cancel(&two.b, &run_id).await;
    assert_eq!(
        answer.outcome,
        v1::CommandOutcome::Pending as i32,
        "the owner is frozen: the cancel is stored and pending: {answer:#?}"
    );
    let pending: i64 = two
        .db
        .fetch_optional(
            sql("SELECT COUNT(*) AS n FROM run_commands WHERE run_id = $1 AND NOT done")
                .bind(&run_id),
        )
        .await
        .expect("commands read")
        .expect("a row")
        .get("n")
        .expect("n");
    assert_eq!(pending, 1, "the intent is durable");
    // The owner dies; B takes the run over when A's lease runs out, and honours the
    // cancel before anything else.
    two.mesh.kill("supervisor").await;
    two.assert_cancelled(&run_id).await;
    assert_eq!(two.owner(&run_id).await.as_deref(), Some("replica-b"));
    let reason = two.get(&run_id).await.terminal_reason;
    assert!(reason.contains("not needed any more"), "{reason}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_workers_delegate_that_reaches_the_other_replica_is_answered_by_the_owner() {
    let Some(two) = Two::start("2s").await else {
        return;
    };
    let mut spec = keyed_spec("replica-commands-delegate");
    spec.delegations[0].may_redelegate = true;
    let run_id = two.spec_running_on_a(spec).await;
    let run = two.get(&run_id).await;
    let logs = run.delegations[0].task.clone().expect("task");
    assert_eq!(logs.name, "logs");
    // The logs worker's task token, as the policy service issues it for the task.
    let token = convene_mesh::handles::GrpcPolicy::connect(&two.mesh.policy_endpoint)
        .expect("endpoint")
        .issue_task_token(request(
            v1::IssueTaskTokenRequest {
                lease_epoch: 0,
                principal: ONCALL.to_owned(),
                run_id: run_id.clone(),
                parent_token: String::new(),
                grants: vec![convene_supervisor::plan::grant(
                    &logs,
                    2,
                    std::time::SystemTime::now(),
                )],
            },
            &two.mesh.credential("supervisor"),
        ))
        .await
        .expect("IssueTaskToken")
        .into_inner()
        .tokens
        .pop()
        .expect("a token")
        .token;
    // The worker's Delegate reaches B, which does not run the run: B forwards it to A,
    // whose run actor checks the children (this one names no profile of the policy).
    let refused = two
        .b
        .delegate(request(
            v1::DelegateRequest {
                delegations: vec![v1::PlannedDelegation {
                    name: "pool-detail".to_owned(),
                    profile_id: "astrologer".to_owned(),
                    goal: "read the pool's stars".to_owned(),
                    acceptance_criteria: vec!["cite evidence".to_owned()],
                    ..Default::default()
                }],
            },
            &token,
        ))
        .await
        .expect_err("the owner refuses the child");
    assert_eq!(refused.code(), tonic::Code::InvalidArgument, "{refused:?}");
    assert!(refused.message().contains("astrologer"), "{refused:?}");
    assert!(
        !refused.message().contains("not running in this supervisor"),
        "B answered itself instead of forwarding: {refused:?}"
    );
}
