//! Runs from the operator's templates (the payment-incident example's, which `convene up`
//! serves by default): a run from a template with a note ends like the example, and a
//! caller's spec may only tighten what the template fixes.

use std::collections::HashMap;

use crate::harness::{MeshOptions, Mode, TestMesh};
use convene_mesh::auth::request;
use convene_proto::v1;

use super::{LIMIT, ONCALL};

const TEMPLATE: &str = "payment-incident-triage";

fn from_template(
    template: &str,
    inputs: &[(&str, &str)],
    spec: Option<v1::RunSpec>,
) -> v1::StartRunRequest {
    v1::StartRunRequest {
        spec,
        wait: false,
        template: template.to_owned(),
        inputs: inputs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect::<HashMap<_, _>>(),
    }
}

async fn start(
    mesh: &TestMesh,
    req: v1::StartRunRequest,
) -> Result<v1::StartRunResponse, tonic::Status> {
    mesh.supervisor()
        .start_run(request(req, &mesh.credential(ONCALL)))
        .await
        .map(tonic::Response::into_inner)
}

/// The status of a refused start, asserting its code and that its message names `field`.
async fn refused(mesh: &TestMesh, req: v1::StartRunRequest, code: tonic::Code, needles: &[&str]) {
    let status = start(mesh, req).await.expect_err("refused");
    assert_eq!(status.code(), code, "{status:?}");
    for needle in needles {
        assert!(
            status.message().contains(needle),
            "{needle:?} is not in {:?}",
            status.message()
        );
    }
}

fn join(edit: impl FnOnce(&mut v1::JoinContract)) -> Option<v1::RunSpec> {
    let mut join = v1::JoinContract::default();
    edit(&mut join);
    Some(v1::RunSpec {
        join: Some(join),
        ..Default::default()
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_template_run_carries_the_note_and_ends_like_the_example() {
    let mesh = TestMesh::start(Mode::InProcess, MeshOptions::default()).await;
    let note = "Paged at 02:04 by the checkout SLO alert.";
    let started = start(&mesh, from_template(TEMPLATE, &[("note", note)], None))
        .await
        .expect("StartRun from the template");
    assert!(started.created);
    let run = started.run.expect("run");
    let spec = run.spec.clone().expect("the run's spec");
    assert!(
        spec.goal
            .ends_with(&format!("\n\nNote from the caller: {note}")),
        "{:?}",
        spec.goal
    );
    assert!(spec.goal.starts_with("Initial assessment of the payment"));
    assert_eq!(spec.delegations.len(), 3);
    let run = mesh.wait_terminal(ONCALL, &run.run_id, LIMIT).await;
    assert_eq!(run.state, v1::RunState::WaitingInput as i32, "{run:#?}");
    assert_eq!(run.outcome, v1::JoinOutcome::ConflictRequiresHuman as i32);
    let decision = run.decision.expect("decision");
    assert!(
        decision
            .conflicts
            .iter()
            .any(|c| c.topic == "primary_cause"),
        "{decision:#?}"
    );

    // A caller's tighter spec is taken: its own key, labels and a stricter join.
    let tighter = v1::RunSpec {
        idempotency_key: "template-tighter".to_owned(),
        labels: [("requested_by".to_owned(), "oncall".to_owned())].into(),
        join: join(|j| {
            j.strategy = v1::JoinStrategy::All as i32;
            j.minimum = Some(v1::JoinMinimum {
                count: 3,
                ..Default::default()
            });
        })
        .and_then(|s| s.join),
        limits: Some(v1::Limits {
            max_tool_calls: 20,
            ..Default::default()
        }),
        ..Default::default()
    };
    let started = start(&mesh, from_template(TEMPLATE, &[], Some(tighter)))
        .await
        .expect("a tighter spec is accepted");
    let spec = started.run.expect("run").spec.expect("spec");
    assert_eq!(spec.idempotency_key, "template-tighter");
    assert_eq!(spec.labels["requested_by"], "oncall");
    assert_eq!(spec.labels["incident"], "INC-20260723-0202");
    let j = spec.join.expect("join");
    assert_eq!(j.strategy, v1::JoinStrategy::All as i32);
    assert_eq!(j.minimum.expect("minimum").count, 3);
    assert_eq!(j.required, ["logs"]);
    assert_eq!(spec.limits.expect("limits").max_tool_calls, 20);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_template_refuses_what_would_weaken_it() {
    let mesh = TestMesh::start(Mode::InProcess, MeshOptions::default()).await;
    let invalid = tonic::Code::InvalidArgument;

    refused(
        &mesh,
        from_template(
            TEMPLATE,
            &[],
            join(|j| j.required = vec!["metrics".to_owned()]),
        ),
        invalid,
        &["spec.join.required", "logs", TEMPLATE],
    )
    .await;
    refused(
        &mesh,
        from_template(
            TEMPLATE,
            &[],
            join(|j| {
                j.minimum = Some(v1::JoinMinimum {
                    count: 1,
                    ..Default::default()
                });
            }),
        ),
        invalid,
        &["join.minimum.count: 1 is weaker than the template's 2 (payment-incident-triage)"],
    )
    .await;
    refused(
        &mesh,
        from_template(
            TEMPLATE,
            &[],
            join(|j| j.strategy = v1::JoinStrategy::FirstValid as i32),
        ),
        invalid,
        &[
            "spec.join.strategy",
            "JOIN_STRATEGY_FIRST_VALID",
            "JOIN_STRATEGY_ALL",
        ],
    )
    .await;
    refused(
        &mesh,
        from_template(
            TEMPLATE,
            &[],
            Some(v1::RunSpec {
                limits: Some(v1::Limits {
                    max_tool_calls: 100,
                    ..Default::default()
                }),
                ..Default::default()
            }),
        ),
        invalid,
        &["spec.limits.max_tool_calls: 100 is weaker than the template's 24"],
    )
    .await;
    refused(
        &mesh,
        from_template(
            TEMPLATE,
            &[],
            Some(v1::RunSpec {
                delegations: vec![v1::PlannedDelegation {
                    name: "extra".to_owned(),
                    profile_id: "logs-investigator".to_owned(),
                    goal: "Anything".to_owned(),
                    ..Default::default()
                }],
                ..Default::default()
            }),
        ),
        invalid,
        &["spec.delegations", "fixes it"],
    )
    .await;
    refused(
        &mesh,
        from_template("no-such-template", &[], None),
        tonic::Code::NotFound,
        &["no-such-template", TEMPLATE],
    )
    .await;
    refused(
        &mesh,
        from_template(TEMPLATE, &[("severity", "high")], None),
        invalid,
        &["inputs.severity", "note"],
    )
    .await;
    refused(
        &mesh,
        v1::StartRunRequest {
            spec: Some(crate::harness::example_spec()),
            inputs: [("note".to_owned(), "x".to_owned())].into(),
            ..Default::default()
        },
        invalid,
        &["inputs", "template"],
    )
    .await;
}
