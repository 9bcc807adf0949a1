//! `convene run`, `runs resolve` and `runs cancel` on runs that wait for people,
//! black-box: `run` stops at the wait and says what continues the run; a person with
//! the `runs:resolve` role settles a conflict under the run's current ticket, recorded
//! apart from the evidence; a stale ticket and a principal without the role are refused;
//! a waiting run is cancelled once. And `runs list` finding runs by label and time.

use crate::mesh::{ALICE, BOB, LIMIT, Mesh, ONCALL, json};
use crate::support::{convene, wait_for};

#[test]
fn resolve_takes_exactly_one_input_and_a_topic_to_choose_on() {
    let cases: [(&[&str], &str); 5] = [
        (&["--rationale", "r"], "required"),
        (&["--choose", "changes", "--rationale", "r"], "--topic"),
        (
            &[
                "--topic",
                "t",
                "--choose",
                "changes",
                "--close",
                "--rationale",
                "r",
            ],
            "cannot be used with",
        ),
        (
            &[
                "--follow-up-profile",
                "logs-investigator",
                "--rationale",
                "r",
            ],
            "--goal",
        ),
        (&["--close"], "--rationale"),
    ];
    for (args, needle) in cases {
        let out = convene()
            .args(["runs", "resolve", "run-1"])
            .args(args)
            .output()
            .expect("convene runs");
        assert_eq!(out.status.code(), Some(2), "{args:?} was accepted");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains(needle),
            "{args:?}: {needle:?} missing in: {err}"
        );
    }
}

/// The id of the run `convene run` printed it accepted.
fn accepted_run_id(text: &str) -> String {
    text.lines()
        .find_map(|l| {
            l.strip_prefix("Run ")
                .and_then(|rest| rest.split_once(" accepted"))
                .map(|(id, _)| id.to_owned())
        })
        .unwrap_or_else(|| panic!("no accepted run in:\n{text}"))
}

/// The id of the delegation named `name` in the run.
fn delegation_id(run: &serde_json::Value, name: &str) -> String {
    run["delegations"]
        .as_array()
        .expect("delegations")
        .iter()
        .find(|d| d["task"]["name"] == name)
        .and_then(|d| d["task"]["delegationId"].as_str())
        .unwrap_or_else(|| panic!("no delegation {name} in {run:#}"))
        .to_owned()
}

/// The run's conflict on `topic`.
fn conflict<'a>(run: &'a serde_json::Value, topic: &str) -> &'a serde_json::Value {
    run["decision"]["conflicts"]
        .as_array()
        .expect("conflicts")
        .iter()
        .find(|c| c["topic"] == topic)
        .unwrap_or_else(|| panic!("no conflict on {topic} in {run:#}"))
}

fn ticket(run: &serde_json::Value) -> String {
    run["ticket"]["id"]
        .as_str()
        .unwrap_or_else(|| panic!("the run has no ticket: {run:#}"))
        .to_owned()
}

#[test]
fn run_stops_at_the_wait_and_resolve_settles_the_conflict_under_the_current_ticket() {
    let mesh = Mesh::start();
    let spec = mesh.example_spec("resolve-settle");

    // `convene run` returns at the wait, exit status 0, saying what the run waits for
    // and the commands that continue it.
    let text = mesh.ok(ONCALL, &["run", spec.to_str().expect("UTF-8 path")]);
    let run_id = accepted_run_id(&text);
    for needle in [
        "WAITING_INPUT",
        "The run waits for people",
        "Open conflict on primary_cause",
        &format!("convene runs resolve {run_id} --topic primary_cause --choose <"),
        &format!("convene approvals list --run {run_id}"),
        "Unresolved conflict on primary_cause",
    ] {
        assert!(text.contains(needle), "{needle:?} missing in:\n{text}");
    }
    let waiting = mesh.run_json(&run_id);
    assert_eq!(waiting["state"], "RUN_STATE_WAITING_INPUT", "{waiting:#}");
    let first_ticket = ticket(&waiting);
    assert!(text.contains(&first_ticket), "the ticket is shown:\n{text}");
    let open = conflict(&waiting, "primary_cause");
    assert_eq!(
        open["resolution"], "CONFLICT_RESOLUTION_UNRESOLVED",
        "{open:#}"
    );
    let changes = delegation_id(&waiting, "changes");
    let relied_on = open["claims"]
        .as_array()
        .expect("claims")
        .iter()
        .find(|c| c["delegationId"] == changes.as_str())
        .and_then(|c| c["evidenceRefs"][0].as_str())
        .unwrap_or_else(|| panic!("no claim of changes in {open:#}"))
        .to_owned();

    // An approver without the `runs:resolve` role is refused with the service's word,
    // and nothing changes.
    let rationale = "RC-4711 went live 20 s before the drop and the rollback is cheap";
    let settle = [
        "runs",
        "resolve",
        run_id.as_str(),
        "--topic",
        "primary_cause",
        "--choose",
        "changes",
        "--rationale",
        rationale,
        "--evidence",
        relied_on.as_str(),
    ];
    let err = mesh.refused(ALICE, &settle);
    assert!(
        err.contains("runs:resolve") && err.contains("not permitted as alice@acme"),
        "{err}"
    );
    let unchanged = mesh.run_json(&run_id);
    assert_eq!(unchanged["state"], "RUN_STATE_WAITING_INPUT");
    assert_eq!(ticket(&unchanged), first_ticket);
    assert!(unchanged["humanDecisions"].is_null(), "{unchanged:#}");

    // oncall@acme chooses the change auditor's side by the delegation's name, under the
    // run's current ticket.
    let out = mesh.ok(ONCALL, &settle);
    assert!(
        out.contains(&format!("Using the run's current ticket {first_ticket}")),
        "{out}"
    );
    assert!(
        out.contains("Applied") || out.contains("Stored (command"),
        "{out}"
    );
    let settled = wait_for("the conflict to be settled", LIMIT, || {
        let run = mesh.run_json(&run_id);
        if conflict(&run, "primary_cause")["resolution"] == "CONFLICT_RESOLUTION_SETTLED" {
            Ok(run)
        } else {
            Err(run)
        }
    });
    let settlement = &conflict(&settled, "primary_cause")["settlement"];
    assert_eq!(
        settlement["delegationId"],
        changes.as_str(),
        "{settlement:#}"
    );
    assert_eq!(settlement["decidedBy"], ONCALL);
    assert_eq!(settlement["rationale"], rationale);
    assert_eq!(settlement["evidenceIds"], serde_json::json!([relied_on]));
    let decisions = settled["humanDecisions"]
        .as_array()
        .expect("humanDecisions");
    assert_eq!(decisions.len(), 1, "{decisions:#?}");
    assert_eq!(decisions[0]["kind"], "HUMAN_DECISION_KIND_SETTLE");
    assert_eq!(decisions[0]["decidedBy"], ONCALL);
    assert_eq!(decisions[0]["topic"], "primary_cause");
    // No conflict is open any more; the rollback request still waits for approvers.
    let settled = wait_for("the run to move on", LIMIT, || {
        let run = mesh.run_json(&run_id);
        if run["state"] == "RUN_STATE_WAITING_INPUT" || run["state"] == "RUN_STATE_RUNNING" {
            Err(run)
        } else {
            Ok(run)
        }
    });
    assert_eq!(
        settled["state"], "RUN_STATE_WAITING_APPROVAL",
        "{settled:#}"
    );
    let second_ticket = ticket(&settled);
    assert_ne!(second_ticket, first_ticket);

    // The used ticket is stale: refused, naming the current one.
    let err = mesh.refused(
        ONCALL,
        &[
            "runs",
            "resolve",
            &run_id,
            "--topic",
            "primary_cause",
            "--choose",
            "logs",
            "--rationale",
            "second thoughts",
            "--ticket",
            &first_ticket,
        ],
    );
    assert!(err.contains(&second_ticket), "{err}");
    assert_eq!(
        mesh.run_json(&run_id)["humanDecisions"]
            .as_array()
            .map(Vec::len),
        Some(1)
    );

    // The report keeps the person's judgement apart from the evidence.
    let report = mesh.ok(ONCALL, &["runs", "get", &run_id]);
    for needle in [
        "Human judgement",
        "primary_cause: settled by oncall@acme",
        rationale,
        &format!("evidence relied on: {relied_on}"),
        "chosen: risk rule change (changes)",
        "WAITING_APPROVAL",
        "PENDING",
    ] {
        assert!(report.contains(needle), "{needle:?} missing in:\n{report}");
    }
    assert!(
        !report.contains("Unresolved conflict on primary_cause"),
        "{report}"
    );

    // Then the two approvers approve the rollback and one executes it: the run ends.
    let approval_id = settled["actions"][0]["approvalId"]
        .as_str()
        .unwrap_or_else(|| panic!("no action in {settled:#}"))
        .to_owned();
    let hash = mesh.get_approval(&approval_id).parameters_hash;
    for approver in [ALICE, BOB] {
        mesh.ok(
            approver,
            &["approvals", "approve", &approval_id, "--hash", &hash],
        );
    }
    mesh.ok(
        ALICE,
        &["approvals", "execute", &approval_id, "--hash", &hash],
    );
    let ended = wait_for("the run to end", LIMIT, || {
        let run = mesh.run_json(&run_id);
        if run["state"] == "RUN_STATE_SUCCEEDED" {
            Ok(run)
        } else {
            Err(run)
        }
    });
    assert!(ended["ticket"].is_null(), "{ended:#}");
    let action = &ended["actions"][0];
    assert_eq!(action["state"], "ACTION_STATE_EXECUTED", "{action:#}");
    assert_eq!(action["decidedBy"], serde_json::json!([ALICE, BOB]));
    let report = mesh.ok(ONCALL, &["runs", "get", &run_id]);
    assert!(
        report.contains("EXECUTED: approved by alice@acme, bob@acme; executed by alice@acme"),
        "{report}"
    );
    assert!(!report.contains("The run waits for people"), "{report}");
}

#[test]
fn cancel_ends_a_waiting_run_once_and_withdraws_its_requests() {
    let mesh = Mesh::start();
    let (run, approval_id) = mesh.incident("resolve-cancel");
    let run_id = run["runId"].as_str().expect("runId").to_owned();
    let waiting = mesh.run_json(&run_id);
    assert_eq!(waiting["state"], "RUN_STATE_WAITING_INPUT", "{waiting:#}");

    let cancelled = json(&mesh.ok(
        ONCALL,
        &[
            "runs",
            "cancel",
            &run_id,
            "--reason",
            "drill over",
            "--json",
        ],
    ));
    assert_eq!(
        cancelled["outcome"], "COMMAND_OUTCOME_APPLIED",
        "{cancelled:#}"
    );
    assert_eq!(
        cancelled["run"]["state"], "RUN_STATE_CANCELLED",
        "{cancelled:#}"
    );
    assert!(cancelled["commandId"].is_string(), "{cancelled:#}");
    let ended = mesh.run_json(&run_id);
    assert_eq!(ended["state"], "RUN_STATE_CANCELLED");
    assert!(ended["ticket"].is_null(), "{ended:#}");
    wait_for("the approval request to be withdrawn", LIMIT, || {
        let request = mesh.get_approval(&approval_id);
        if request.state == convene_proto::v1::ApprovalState::Cancelled as i32 {
            Ok(())
        } else {
            Err(request)
        }
    });

    // Once ended, it stays as it is.
    let text = mesh.ok(ONCALL, &["runs", "cancel", &run_id]);
    assert!(
        text.contains("had already ended") && text.contains("CANCELLED"),
        "{text}"
    );
    let again = json(&mesh.ok(ONCALL, &["runs", "cancel", &run_id, "--json"]));
    assert_eq!(
        again["outcome"], "COMMAND_OUTCOME_ALREADY_ENDED",
        "{again:#}"
    );
    assert_eq!(again["run"]["state"], "RUN_STATE_CANCELLED");
    let err = mesh.refused(
        ONCALL,
        &[
            "runs",
            "resolve",
            &run_id,
            "--close",
            "--rationale",
            "too late",
        ],
    );
    assert!(err.contains("does not wait for people"), "{err}");
}

/// `runs list --label` keeps the runs that have every label given, `--since` and
/// `--until` those started in the window; a malformed label is refused with what to
/// give instead.
#[test]
fn runs_list_keeps_the_runs_with_every_label_given() {
    let mesh = Mesh::start();
    let start = |key: &str, service: &str| -> String {
        let spec = mesh.example_spec(key);
        let text = std::fs::read_to_string(&spec).expect("the spec");
        let label = "  service: payment-api\n";
        assert!(text.contains(label), "the example spec has the label");
        std::fs::write(
            &spec,
            text.replace(label, &format!("  service: {service}\n")),
        )
        .expect("spec written");
        let started = json(&mesh.ok(
            ONCALL,
            &[
                "run",
                spec.to_str().expect("UTF-8 path"),
                "--detach",
                "--json",
            ],
        ));
        started["runId"].as_str().expect("runId").to_owned()
    };
    let payment = start("list-payment", "payment-api");
    let ledger = start("list-ledger", "ledger");
    let listed = |args: &[&str]| -> Vec<String> {
        let mut all = vec!["runs", "list", "--json"];
        all.extend_from_slice(args);
        let page = json(&mesh.ok(ONCALL, &all));
        page["runs"]
            .as_array()
            .map(|runs| {
                runs.iter()
                    .map(|r| r["runId"].as_str().expect("runId").to_owned())
                    .collect()
            })
            .unwrap_or_default()
    };

    assert_eq!(
        listed(&["--label", "service=payment-api"]),
        [payment.as_str()]
    );
    assert_eq!(
        listed(&[
            "--label",
            "service=ledger",
            "--label",
            "incident=INC-20260723-0202"
        ]),
        [ledger.as_str()]
    );
    assert!(
        listed(&["--label", "service=ledger", "--label", "incident=INC-1"]).is_empty(),
        "every label must match"
    );
    assert_eq!(
        listed(&["--label", "incident=INC-20260723-0202", "--since", "1h"]),
        [ledger.as_str(), payment.as_str()],
        "newest first"
    );
    assert!(listed(&["--until", "1h"]).is_empty(), "both started since");
    let text = mesh.ok(ONCALL, &["runs", "list", "--label", "service=ledger"]);
    assert!(text.contains(&ledger) && !text.contains(&payment), "{text}");
    let text = mesh.ok(ONCALL, &["runs", "list", "--label", "service=billing"]);
    assert_eq!(text.trim(), "No runs match.");

    let err = mesh.refused(ONCALL, &["runs", "list", "--label", "service"]);
    assert!(err.contains("give KEY=VALUE"), "{err}");
    let err = mesh.refused(
        ONCALL,
        &["runs", "list", "--since", "2h", "--until", "1day"],
    );
    assert!(
        err.contains("--since") && err.contains("is not before --until"),
        "{err}"
    );
}
