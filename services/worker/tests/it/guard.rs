//! What a worker checks before it acts, tried from the attacker's side: callers that are
//! not the supervisor, and task tokens that are forged, signed by another key, expired,
//! revoked (before the task, or during it) or another task's. Every refusal comes before anything leaves the worker:
//! the scripted model server behind the model-driven profiles counts zero requests, and
//! the policy service logs no decision.

use std::time::Duration;

use convene_mesh::auth;
use convene_proto::v1;
use convene_worker::model_server::{Reply, Script, ScriptedModel};
use convene_worker::models::ModelSettings;
use convene_worker::profiles;
use serde_json::json;

use crate::support::{Mesh, RUN_ID, TestWorker, task, unsigned_token};

const PROFILE: &str = "logs-investigator-model";
const PLANNER: &str = "incident-planner-model";

/// A worker whose model-driven profiles talk to `model`, fetching keys and
/// revocations every `refresh`.
async fn worker(mesh: &Mesh, model: &ScriptedModel, refresh: Duration) -> TestWorker {
    let key_dir = mesh.dir.path().join("model-key");
    std::fs::create_dir_all(&key_dir).unwrap();
    let key_file = key_dir.join("openai.key");
    std::fs::write(&key_file, "sk-guard-test\n").unwrap();
    let mut profiles = profiles::example().unwrap();
    for p in profiles
        .iter_mut()
        .filter(|p| p.profile.id == PROFILE || p.profile.id == PLANNER)
    {
        p.connection.base_url = Some(model.base_url());
        p.connection.api_key_file = Some(key_file.clone());
        p.profile.model = "scripted-model".into();
    }
    mesh.worker_refreshing(profiles, 4, ModelSettings::default(), refresh)
        .await
}

/// A model that fails the test's expectations if it is ever asked.
fn model() -> ScriptedModel {
    ScriptedModel::start(Script::new(vec![Reply::error(
        500,
        json!({"error": {"message": "the worker must not have called the model"}}),
    )]))
    .unwrap()
}

fn execute_request(task: &v1::DelegationTask, token: &str) -> v1::WorkerExecuteRequest {
    v1::WorkerExecuteRequest {
        lease_valid_until: None,
        task: Some(task.clone()),
        task_token: token.to_owned(),
        attempt: 1,
    }
}

fn plan_request(token: &str) -> v1::PlanTurnRequest {
    v1::PlanTurnRequest {
        run_id: RUN_ID.into(),
        profile_id: PLANNER.into(),
        round: 1,
        turn: 1,
        task_token: token.into(),
        instructions: "Delegate with `delegate`.".into(),
        messages: vec![v1::ChatMessage {
            role: "user".into(),
            content: "What broke payments?".into(),
            ..v1::ChatMessage::default()
        }],
        tools: Vec::new(),
        max_tokens: 0,
        lease_valid_until: None,
    }
}

fn assert_refused(status: &tonic::Status, code: tonic::Code, says: &str) {
    assert_eq!(status.code(), code, "{status:?}");
    assert!(status.message().contains(says), "{status:?}");
}

#[tokio::test]
async fn only_the_supervisor_may_call_a_worker() {
    let mesh = Mesh::start().await;
    let model = model();
    let worker = worker(&mesh, &model, Duration::from_secs(60)).await;
    let task = task("del-guard-caller", PROFILE, Duration::from_secs(30));
    let token = mesh.token_for(&task, &[]).await;
    let person = convene_mesh::policy_file::dev_credential(
        &mesh.dir.path().join("credentials"),
        "oncall@acme",
    )
    .unwrap();
    let pool = convene_mesh::policy_file::dev_credential(
        &mesh.dir.path().join("credentials"),
        "worker-pool",
    )
    .unwrap();

    // Anonymous: Execute, PlanTurn and Cancel all say what to present.
    let mut anonymous = worker.anonymous.clone();
    let refused = anonymous
        .execute(execute_request(&task, &token))
        .await
        .unwrap_err();
    assert_refused(
        &refused,
        tonic::Code::Unauthenticated,
        "only the supervisor may execute delegations",
    );
    let refused = anonymous.plan_turn(plan_request(&token)).await.unwrap_err();
    assert_refused(
        &refused,
        tonic::Code::Unauthenticated,
        "only the supervisor may ask for planner turns",
    );
    let refused = anonymous
        .cancel(v1::WorkerCancelRequest {
            delegation_id: task.delegation_id.clone(),
            reason: "mischief".into(),
        })
        .await
        .unwrap_err();
    assert_refused(
        &refused,
        tonic::Code::Unauthenticated,
        "only the supervisor may cancel delegations",
    );

    // A person, another service, a task token as the bearer, an unknown credential.
    for (credential, code) in [
        (person.as_str(), tonic::Code::PermissionDenied),
        (pool.as_str(), tonic::Code::PermissionDenied),
        (token.as_str(), tonic::Code::PermissionDenied),
        ("not-a-credential", tonic::Code::Unauthenticated),
    ] {
        let refused = worker
            .anonymous
            .clone()
            .execute(auth::request(execute_request(&task, &token), credential))
            .await
            .unwrap_err();
        assert_eq!(refused.code(), code, "{refused:?}");
        let refused = worker
            .anonymous
            .clone()
            .cancel(auth::request(
                v1::WorkerCancelRequest {
                    delegation_id: task.delegation_id.clone(),
                    reason: "mischief".into(),
                },
                credential,
            ))
            .await
            .unwrap_err();
        assert_eq!(refused.code(), code, "{refused:?}");
    }
    // Nobody may be acted for at a worker, not even the supervisor.
    let mut acting = auth::request(execute_request(&task, &token), &mesh.supervisor);
    acting
        .metadata_mut()
        .insert(auth::ACT_AS, "supervisor".parse().unwrap());
    let refused = worker.anonymous.clone().execute(acting).await.unwrap_err();
    assert_refused(&refused, tonic::Code::PermissionDenied, auth::ACT_AS);

    assert_eq!(model.request_count(), 0, "no model request was made");
    assert!(mesh.decisions_for(&task.delegation_id).is_empty());
}

#[tokio::test]
async fn tokens_that_do_not_hold_for_the_task_are_refused_before_any_model_call() {
    let mesh = Mesh::start().await;
    let model = model();
    let worker = worker(&mesh, &model, Duration::from_millis(200)).await;
    let task = task("del-guard-token", PROFILE, Duration::from_secs(30));

    // Claims nobody signed.
    let forged = unsigned_token(&json!({"run": RUN_ID, "del": task.delegation_id}));
    let refused = worker.execute(&task, &forged, 1).await.unwrap_err();
    assert_refused(&refused, tonic::Code::Unauthenticated, "task token refused");
    let refused = worker.plan_turn(plan_request(&forged)).await.unwrap_err();
    assert_refused(&refused, tonic::Code::Unauthenticated, "task token refused");

    // A real token of another mesh: signed by a key this policy service never had.
    let other_mesh = Mesh::start().await;
    let foreign = other_mesh.token_for(&task, &[]).await;
    let refused = worker.execute(&task, &foreign, 1).await.unwrap_err();
    assert_refused(&refused, tonic::Code::Unauthenticated, "UnknownKey");

    // Another delegation's token, and this delegation's token for another profile.
    let sibling = task_named("del-guard-sibling");
    let sibling_token = mesh.token_for(&sibling, &[]).await;
    let refused = worker.execute(&task, &sibling_token, 1).await.unwrap_err();
    assert_refused(
        &refused,
        tonic::Code::PermissionDenied,
        "task token refused (delegation)",
    );
    let mut other_profile = task.clone();
    other_profile.profile_id = "logs-investigator".into();
    let token = mesh.token_for(&task, &[]).await;
    let refused = worker.execute(&other_profile, &token, 1).await.unwrap_err();
    assert_refused(
        &refused,
        tonic::Code::PermissionDenied,
        "task token refused (profile)",
    );

    // An expired token.
    let short = mesh
        .issue(v1::TokenGrantRequest {
            delegation_id: task.delegation_id.clone(),
            profile_id: PROFILE.into(),
            depth: 1,
            ttl: Some(prost_types::Duration {
                seconds: 1,
                nanos: 0,
            }),
            ..v1::TokenGrantRequest::default()
        })
        .await;
    tokio::time::sleep(Duration::from_millis(2100)).await;
    let refused = worker.execute(&task, &short.token, 1).await.unwrap_err();
    assert_refused(&refused, tonic::Code::Unauthenticated, "Expired");

    // A revoked token: refused once the worker has fetched the revocations again.
    let issued = mesh
        .issue(v1::TokenGrantRequest {
            delegation_id: task.delegation_id.clone(),
            profile_id: PROFILE.into(),
            depth: 1,
            ..v1::TokenGrantRequest::default()
        })
        .await;
    mesh.revoke_token(&issued.token_id).await;
    tokio::time::sleep(Duration::from_millis(400)).await;
    let refused = worker.execute(&task, &issued.token, 1).await.unwrap_err();
    assert_refused(&refused, tonic::Code::Unauthenticated, "Revoked");

    assert_eq!(model.request_count(), 0, "no model request was made");
    assert!(mesh.decisions_for(&task.delegation_id).is_empty());
}

/// The example's logs task under another delegation id.
fn task_named(id: &str) -> v1::DelegationTask {
    task(id, PROFILE, Duration::from_secs(30))
}

#[tokio::test]
async fn a_token_revoked_mid_task_stops_the_loop_before_the_next_model_turn() {
    let mesh = Mesh::start().await;
    // The first turn asks for a tool call, slowly enough for the revocation to reach
    // the worker before the second turn would be asked.
    let search =
        json!({"service": "payment-api", "match": {"error": "POOL_EXHAUSTED"}}).to_string();
    let model = ScriptedModel::start(Script::new(vec![
        Reply::delayed(
            Duration::from_millis(1500),
            Reply::tool_calls(vec![("call_1", "search_logs_v1", search)]),
        ),
        Reply::text("a second turn the worker must never ask for"),
    ]))
    .unwrap();
    let worker = worker(&mesh, &model, Duration::from_millis(200)).await;
    let task = task("del-guard-midway", PROFILE, Duration::from_secs(30));
    let issued = mesh
        .issue(v1::TokenGrantRequest {
            delegation_id: task.delegation_id.clone(),
            profile_id: PROFILE.into(),
            depth: 1,
            required_scopes: task.required_scopes.clone(),
            task_scope: task.scope.clone(),
            ..v1::TokenGrantRequest::default()
        })
        .await;
    let running = worker.execute_in_background(&task, &issued.token);
    crate::support::wait_until(
        "the first model turn asked",
        || model.request_count(),
        |n| *n == 1,
    )
    .await;
    mesh.revoke_token(&issued.token_id).await;

    let result = running.await.unwrap().unwrap().into_inner().result.unwrap();
    assert_eq!(result.status, v1::TaskStatus::Failed as i32, "{result:#?}");
    let error = result.error.as_ref().expect("the result says why");
    assert_eq!(error.code, "token_refused", "{error:?}");
    assert!(error.message.contains("Revoked"), "{error:?}");
    assert_eq!(
        model.request_count(),
        1,
        "the model is not asked again under a revoked token"
    );
}

/// A planner turn asked by a supervisor replica that lost the run reaches no model: one
/// sent after its lease may have run out, and one under a lease epoch the policy
/// service fenced.
#[tokio::test]
async fn a_planner_turn_of_a_replica_that_lost_the_run_reaches_no_model() {
    let mesh = Mesh::start().await;
    let model = model();
    let worker = worker(&mesh, &model, Duration::from_millis(50)).await;
    let grant = |lease_epoch| {
        mesh.issue_under(
            v1::TokenGrantRequest {
                delegation_id: "planner-token".into(),
                profile_id: PLANNER.into(),
                depth: 1,
                ..v1::TokenGrantRequest::default()
            },
            lease_epoch,
        )
    };
    let old = grant(1).await.token;

    // Sent before a pause, arriving after the lease.
    let mut late = plan_request(&old);
    late.lease_valid_until = Some(convene_core::time::to_timestamp(
        std::time::SystemTime::now() - Duration::from_secs(1),
    ));
    let refused = worker.plan_turn(late).await.unwrap_err();
    assert_refused(
        &refused,
        tonic::Code::Aborted,
        "after the sending supervisor replica's lease",
    );

    // Another replica took the run over: its first token fences epoch 1.
    grant(2).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    let refused = worker.plan_turn(plan_request(&old)).await.unwrap_err();
    assert_refused(&refused, tonic::Code::Unauthenticated, "Superseded");

    assert_eq!(model.request_count(), 0, "no model request was made");
}
