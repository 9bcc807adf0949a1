//! Planner runs end to end: the run's planner is the example's `openai` planner profile
//! (`incident-planner-model`) asking a scripted OpenAI-compatible server, which plays the
//! planner's model turn by turn, over the real services (in one process, but for the
//! example run, which runs as processes with the model key in their environment).
//!
//! What the planner does comes back through the real mesh: the delegations of one turn
//! run concurrently and are answered in call order; a specialist's ungranted tool call
//! is denied and logged while the run goes on; a planner's delegation cannot nest past
//! `max_depth`; the width limit queues, truncates or rejects a turn's calls; refused
//! calls (a loop, a round past `max_rounds`, a spent token budget, a `finish` citing
//! what the join did not accept, a profile the run does not offer) are answered with
//! errors the model can act on; the run stops when its rounds make no progress; and the
//! example's model planner ends where the playbook planner does without its key showing
//! anywhere.

use std::collections::BTreeSet;
use std::time::{Duration, SystemTime};

use crate::harness::{
    MeshOptions, Mode, TestMesh, Workers, example_profiles, repo_root, spec_from_yaml, wait_until,
};
use crate::nested::COORDINATOR;
use convene_proto::v1::{self, run_event::Kind};
use convene_worker::model_server::{PlaybookResponder, Recorded, Reply, ScriptedModel};
use serde_json::{Value, json};

const ONCALL: &str = "oncall@acme";
/// How long a run may take to end; each runs in a few seconds.
const LIMIT: Duration = Duration::from_secs(20);
/// The example's model-driven planner profile.
const PLANNER: &str = "incident-planner-model";
const LOGS: &str = "logs-investigator";
const METRICS: &str = "metrics-investigator";
const CHANGES: &str = "change-auditor";
const WINDOW_START: &str = "2026-07-23T01:45:00Z";
const WINDOW_END: &str = "2026-07-23T02:10:00Z";
/// The goal of every run here.
const GOAL: &str = "Assess the payment success-rate drop at 02:02 UTC: impact and cause.";
/// A goal for the logs investigator, asked again by the planner that makes no progress.
const LOGS_GOAL: &str = "Find the error patterns in the payment-api logs and when they began.";
const METRICS_GOAL: &str = "Quantify the success-rate drop and the gateway latency.";
const CHANGES_GOAL: &str = "List the changes made in the incident window.";

// ---------------------------------------------------------------------------------------
// Profiles, policy and run specs.

/// `text` with every `openai` profile pointed at `base_url`, and `faults` added to the
/// named profiles.
fn pointed(text: &str, base_url: &str, faults: &[(&str, &str)]) -> String {
    let mut out = String::with_capacity(text.len() + 512);
    let mut pointed = 0;
    for line in text.lines() {
        out.push_str(line);
        out.push('\n');
        if line.trim_start().starts_with("provider: openai") {
            let indent = &line[..line.len() - line.trim_start().len()];
            out.push_str(&format!("{indent}base_url: {base_url}\n"));
            pointed += 1;
        }
    }
    assert!(
        pointed >= 4,
        "the profiles have the model planner and three model specialists; pointed {pointed}"
    );
    for (profile, f) in faults {
        let anchor = format!("  - id: {profile}\n");
        assert!(out.contains(&anchor), "profile {profile} is in the file");
        out = out.replace(&anchor, &format!("{anchor}    faults: {f}\n"));
    }
    out
}

/// The example profiles, the model ones at `base_url`, with `faults`.
fn profiles_at(base_url: &str, faults: &[(&str, &str)]) -> String {
    pointed(&example_profiles(), base_url, faults)
}

/// One worker serving `profiles`, with room for every delegation of a run at once.
fn options(profiles: String, policy: Option<String>) -> MeshOptions {
    MeshOptions {
        workers: vec![Workers {
            profiles: Some(profiles),
            count: 1,
            capacity: 16,
        }],
        policy,
        ..MeshOptions::default()
    }
}

/// A planner run of [`PLANNER`] that may delegate to `profiles`, with `limits` (YAML
/// lines under `limits:`, indented by two spaces).
fn spec(key: &str, profiles: &[&str], limits: &str) -> v1::RunSpec {
    spec_from_yaml(&format!(
        r#"
goal: "{GOAL}"
idempotency_key: {key}
planner:
  profile_id: {PLANNER}
  instructions: The incident window is {WINDOW_START} to {WINDOW_END}.
  profiles: [{profiles}]
join:
  join_id: join-planner-e2e
  strategy: JOIN_STRATEGY_ALL
  on_timeout: ON_TIMEOUT_EMIT_PARTIAL
  late_result: LATE_RESULT_POLICY_DISCARD
limits:
{limits}
  timeout: 30s
"#,
        profiles = profiles.join(", "),
    ))
}

/// What a delegation to `profile` needs besides its goal: its scope and permissions.
fn scope_of(profile: &str) -> (Vec<&'static str>, Vec<(&'static str, &'static str)>) {
    match profile.trim_end_matches("-model") {
        LOGS => (
            vec!["service/payment-api"],
            vec![("logs:read", "service/*")],
        ),
        METRICS => (
            vec!["metric/payment.*", "metric/gateway.*"],
            vec![("metrics:read", "metric/*")],
        ),
        CHANGES => (
            vec!["change/*", "metric/risk.*"],
            vec![
                ("changes:read", "change/*"),
                ("metrics:read", "metric/risk.*"),
            ],
        ),
        // No resources: the scope does not narrow what its children may be given.
        COORDINATOR => (
            vec![],
            vec![
                ("logs:read", "service/*"),
                ("metrics:read", "metric/*"),
                ("delegation:create", "delegation"),
            ],
        ),
        // The planner itself, or a profile the test means to be refused.
        _ => (
            vec!["service/payment-api"],
            vec![("logs:read", "service/*")],
        ),
    }
}

/// The arguments of a `delegate` call to `profile` with `goal` over the incident window.
fn delegate_args(profile: &str, goal: &str) -> Value {
    let (resources, scopes) = scope_of(profile);
    json!({
        "profile_id": profile,
        "goal": goal,
        "acceptance_criteria": ["Cite read-only query evidence for every conclusion"],
        "scope": {
            "resources": resources,
            "time_range": {"start": WINDOW_START, "end": WINDOW_END},
        },
        "required_scopes": scopes
            .iter()
            .map(|(action, resource)| json!({"action": action, "resource": resource}))
            .collect::<Vec<_>>(),
        "timeout_seconds": 15,
    })
}

/// One `delegate` call `(id, "delegate", arguments)`.
fn delegate(id: &str, profile: &str, goal: &str) -> (String, String, String) {
    (
        id.to_owned(),
        "delegate".to_owned(),
        delegate_args(profile, goal).to_string(),
    )
}

/// Turn 1 delegates to the logs investigator, every later turn to the metrics one.
fn logs_then_metrics(turn: usize) -> (String, String, String) {
    let (profile, goal) = if turn == 1 {
        (LOGS, LOGS_GOAL)
    } else {
        (METRICS, METRICS_GOAL)
    };
    delegate(&format!("turn-{turn}"), profile, goal)
}

/// One `finish` call citing `cite`.
fn finish(id: &str, summary: &str, cite: &[&str]) -> (String, String, String) {
    (
        id.to_owned(),
        "finish".to_owned(),
        json!({"summary": summary, "cite": cite}).to_string(),
    )
}

// ---------------------------------------------------------------------------------------
// The scripted server.

/// Whether `r` is a planner's turn: it offers exactly `delegate` and `finish`.
fn is_planner(r: &Recorded) -> bool {
    let tools: BTreeSet<&str> = r.tools().into_iter().collect();
    tools == BTreeSet::from(["delegate", "finish"])
}

/// The planner turn `r` asks for, from 1: one more than the answers it carries.
fn turn_of(r: &Recorded) -> usize {
    r.messages()
        .iter()
        .filter(|m| m["role"] == "assistant")
        .count()
        + 1
}

/// How a test's model specialists answer the scripted server.
type Specialists = Box<dyn Fn(&Recorded) -> Reply + Send + Sync>;

/// A scripted server whose planner turns `planner` answers (given the turn number and
/// the request); every other request is a specialist's, answered by `specialists`
/// (None: refused, since the test's specialists are all playbooks).
fn start_model(
    planner: impl Fn(usize, &Recorded) -> Reply + Send + Sync + 'static,
    specialists: Option<Specialists>,
) -> ScriptedModel {
    ScriptedModel::start(move |r: &Recorded| {
        if is_planner(r) {
            return planner(turn_of(r), r);
        }
        match &specialists {
            Some(answer) => answer(r),
            None => Reply::error(
                400,
                format!(
                    "this test scripts no model specialist, and was asked with the tools {:?}",
                    r.tools()
                ),
            ),
        }
    })
    .expect("the scripted model server starts")
}

/// The planner's requests the server received, in order.
fn planner_requests(model: &ScriptedModel) -> Vec<Recorded> {
    model.requests().into_iter().filter(is_planner).collect()
}

/// The `tool` answers of a request as (call id, JSON content).
fn answers(r: &Recorded) -> Vec<(String, Value)> {
    r.last_tool_results()
        .into_iter()
        .map(|t| {
            let content = serde_json::from_str(&t.content)
                .unwrap_or_else(|e| panic!("a tool answer is JSON ({e}): {}", t.content));
            (t.tool_call_id, content)
        })
        .collect()
}

/// The `error` of a refused call's answer.
fn answer_error(content: &Value) -> &str {
    content["error"]
        .as_str()
        .unwrap_or_else(|| panic!("the answer is a refusal with an error: {content:#}"))
}

/// The newest `user` message of a request, as JSON when it is (the decision).
fn last_user(r: &Recorded) -> Value {
    let m = r
        .messages()
        .iter()
        .rev()
        .find(|m| m["role"] == "user")
        .expect("a user message");
    let text = m["content"].as_str().unwrap_or_default();
    serde_json::from_str(text).unwrap_or_else(|_| Value::String(text.to_owned()))
}

// ---------------------------------------------------------------------------------------
// The run.

fn planner_state(run: &v1::Run) -> &v1::PlannerState {
    run.planner
        .as_ref()
        .unwrap_or_else(|| panic!("a planner run has a planner state: {run:#?}"))
}

/// The calls of the run's committed turn `turn` (from 1).
fn calls_of(run: &v1::Run, turn: usize) -> &[v1::PlannerCall] {
    let p = planner_state(run);
    &p.turns
        .get(turn - 1)
        .unwrap_or_else(|| panic!("the run committed turn {turn}: {:#?}", p.turns))
        .calls
}

fn task(d: &v1::Delegation) -> &v1::DelegationTask {
    d.task.as_ref().expect("a delegation has its task")
}

fn delegation<'a>(run: &'a v1::Run, delegation_id: &str) -> &'a v1::Delegation {
    run.delegations
        .iter()
        .find(|d| task(d).delegation_id == delegation_id)
        .unwrap_or_else(|| panic!("delegation {delegation_id} is in the ledger: {run:#?}"))
}

fn names(run: &v1::Run) -> Vec<&str> {
    run.delegations
        .iter()
        .map(|d| task(d).name.as_str())
        .collect()
}

fn time(t: Option<&prost_types::Timestamp>, what: &str) -> (i64, i32) {
    let t = t.unwrap_or_else(|| panic!("{what} is set"));
    (t.seconds, t.nanos)
}

fn state_name(state: i32) -> &'static str {
    v1::RunState::try_from(state).map_or("?", |s| s.as_str_name())
}

/// Starts a mesh, runs `spec` and returns the mesh and the ended run.
async fn run_once(options: MeshOptions, spec: v1::RunSpec) -> (TestMesh, v1::Run) {
    let mesh = TestMesh::start(Mode::InProcess, options).await;
    let run_id = mesh.start_run_id(ONCALL, spec).await;
    let run = mesh.wait_terminal(ONCALL, &run_id, LIMIT).await;
    (mesh, run)
}

/// Waits until the run's owner has ended in the in-process supervisor: nothing of the
/// run is in flight any more, so the scripted server's request log is complete.
async fn owner_ends(mesh: &TestMesh) {
    wait_until(
        "the run's owner to end (nothing of the run in flight)",
        Duration::from_secs(10),
        async || mesh.supervisor_service().live_runs() == 0,
    )
    .await;
}

/// The most delegations of the run in flight at once, by its event stream.
fn most_in_flight(events: &[v1::RunEvent]) -> usize {
    let mut running = BTreeSet::new();
    let mut most = 0;
    for e in events {
        match &e.kind {
            Some(Kind::Dispatched(d)) => {
                running.insert(d.delegation_id.clone());
                most = most.max(running.len());
            }
            Some(Kind::Completed(c)) => {
                running.remove(&c.delegation_id);
            }
            _ => {}
        }
    }
    most
}

// ---------------------------------------------------------------------------------------
// One turn, three specialists, concurrently; the answers in call order.

#[tokio::test(flavor = "current_thread")]
async fn three_delegations_of_one_turn_run_at_once_and_are_answered_in_call_order() {
    // Every span of the in-process mesh, which runs on this one thread.
    let capture = convene_telemetry::test_util::Capture::new();
    let _guard = capture.set_default();
    // The first call's specialist is the slowest, so finishing order and call order differ;
    // the call ids sort in neither order.
    let calls = [
        ("b-logs", LOGS),
        ("c-metrics", METRICS),
        ("a-changes", CHANGES),
    ];
    let model = start_model(
        move |turn, _| match turn {
            1 => Reply::tool_calls(vec![
                delegate(calls[0].0, LOGS, LOGS_GOAL),
                delegate(calls[1].0, METRICS, METRICS_GOAL),
                delegate(calls[2].0, CHANGES, CHANGES_GOAL),
            ]),
            _ => Reply::tool_calls(vec![finish("done", "Impact and cause found.", &[])]),
        },
        None,
    );
    let profiles = profiles_at(&model.base_url(), &[(LOGS, "{ delay: 500ms }")]);
    let (mesh, run) = run_once(
        options(profiles, None),
        spec(
            "planner-three",
            &[LOGS, METRICS, CHANGES],
            "  max_parallel_workers: 4\n  max_rounds: 2",
        ),
    )
    .await;
    owner_ends(&mesh).await;

    assert_ne!(
        run.state,
        v1::RunState::Failed as i32,
        "the run ends as its decision says: {run:#?}"
    );
    let turn = calls_of(&run, 1);
    assert_eq!(turn.len(), 3, "{turn:#?}");
    for (i, (call, (id, profile))) in turn.iter().zip(calls).enumerate() {
        assert_eq!(call.call_id, id, "call {i} keeps the model's id");
        assert!(call.error.is_empty(), "call {i} was accepted: {call:#?}");
        let expected = convene_core::ids::delegation_id(&run.run_id, None, 1, i as u32);
        assert_eq!(
            call.delegation_id, expected,
            "call {i}: id from (run, round 1, {i})"
        );
        let t = task(delegation(&run, &call.delegation_id));
        assert_eq!(t.profile_id, profile);
        assert_eq!(t.name, format!("r1c{i}-{profile}"));
        assert_eq!(t.round, 1);
    }

    // They ran at once: each was dispatched before any of them completed; the first one,
    // slowed down, completed last.
    let ds: Vec<&v1::Delegation> = turn
        .iter()
        .map(|c| delegation(&run, &c.delegation_id))
        .collect();
    let last_dispatch = ds
        .iter()
        .map(|d| time(d.dispatched_at.as_ref(), "dispatched_at"))
        .max()
        .unwrap();
    let first_completion = ds
        .iter()
        .map(|d| time(d.completed_at.as_ref(), "completed_at"))
        .min()
        .unwrap();
    assert!(
        last_dispatch < first_completion,
        "every delegation of the turn was dispatched before the first completed: {ds:#?}"
    );
    let completed = |d: &v1::Delegation| time(d.completed_at.as_ref(), "completed_at");
    assert!(
        completed(ds[0]) > completed(ds[1]) && completed(ds[0]) > completed(ds[2]),
        "the slowed-down first call's delegation completed last: {ds:#?}"
    );

    // Their spans overlap in time, each under its call's `planner.delegate` span.
    let spans = capture.spans();
    let mut windows = Vec::new();
    for (call, (id, _)) in turn.iter().zip(calls) {
        let span = spans
            .iter()
            .find(|s| {
                s.name == "delegation"
                    && s.attributes.iter().any(|kv| {
                        kv.key.as_str() == "convene.delegation.id"
                            && kv.value.as_str() == call.delegation_id.as_str()
                    })
            })
            .unwrap_or_else(|| {
                panic!(
                    "a delegation span for {}; spans: {:?}",
                    call.delegation_id,
                    spans.iter().map(|s| s.name.as_ref()).collect::<Vec<_>>()
                )
            });
        let parent = spans
            .iter()
            .find(|s| s.span_context.span_id() == span.parent_span_id)
            .unwrap_or_else(|| panic!("the delegation span of {id} has its parent"));
        assert_eq!(parent.name, "planner.delegate");
        assert!(
            parent
                .attributes
                .iter()
                .any(|kv| kv.key.as_str() == "convene.planner.call_id" && kv.value.as_str() == id),
            "the parent names call {id}: {parent:#?}"
        );
        windows.push((span.start_time, span.end_time));
    }
    let latest_start: SystemTime = windows.iter().map(|w| w.0).max().unwrap();
    let earliest_end: SystemTime = windows.iter().map(|w| w.1).min().unwrap();
    assert!(
        latest_start < earliest_end,
        "the three delegation spans overlap: {windows:?}"
    );

    // The planner's next turn got the three answers in call order, whatever the order
    // they finished in.
    let requests = planner_requests(&model);
    assert_eq!(
        requests.len(),
        2,
        "the delegating turn and the finishing one"
    );
    let got = answers(&requests[1]);
    let ids: Vec<&str> = got.iter().map(|(id, _)| id.as_str()).collect();
    assert_eq!(
        ids,
        ["b-logs", "c-metrics", "a-changes"],
        "answers in call order"
    );
    // ... the order of the calls in the assistant message the request repeats.
    let asked: Vec<&str> = requests[1]
        .messages()
        .iter()
        .rev()
        .find(|m| m["role"] == "assistant")
        .and_then(|m| m["tool_calls"].as_array())
        .expect("the planner's turn is in the conversation")
        .iter()
        .filter_map(|c| c["id"].as_str())
        .collect();
    assert_eq!(ids, asked, "the answers follow the calls");
    for ((_, content), call) in got.iter().zip(turn) {
        assert_eq!(
            content["delegation_id"],
            call.delegation_id.as_str(),
            "{content:#}"
        );
        assert_eq!(
            content["state"], "DELEGATION_STATE_COMPLETED",
            "{content:#}"
        );
        assert_eq!(content["status"], "TASK_STATUS_COMPLETED", "{content:#}");
        assert!(
            !content["claims"].as_array().expect("claims").is_empty(),
            "{content:#}"
        );
    }
    let profiles: Vec<&str> = got
        .iter()
        .map(|(_, c)| c["profile_id"].as_str().unwrap_or_default())
        .collect();
    assert_eq!(profiles, [LOGS, METRICS, CHANGES]);
    // Then the decision of round 1.
    let decision = last_user(&requests[1]);
    assert_eq!(decision["round"], 1, "{decision:#}");
    assert!(decision["decision"]["outcome"].is_string(), "{decision:#}");
}

// ---------------------------------------------------------------------------------------
// A model specialist calling a tool its token does not grant.

/// The first turn of the logs investigator's playbook, as a model would ask for it, and
/// one call of `list_changes` that its token does not grant.
fn logs_calls_and_an_ungranted_one() -> Reply {
    let profiles = convene_worker::profiles::example().expect("the example profiles load");
    let logs = profiles
        .iter()
        .find(|p| p.profile.id == LOGS)
        .expect("the example has the logs investigator");
    let playbook = convene_worker::playbook::PlaybookProvider::new(
        LOGS,
        &logs.profile.default_tools,
        logs.playbook.clone().expect("a playbook"),
    )
    .expect("the playbook plays");
    let mut calls: Vec<(String, String, String)> = playbook
        .tool_calls()
        .into_iter()
        .map(|c| {
            (
                c.id,
                convene_worker::openai::function_name(&c.name),
                c.arguments.to_string(),
            )
        })
        .collect();
    calls.push((
        "ungranted".to_owned(),
        convene_worker::openai::function_name("list_changes@1"),
        json!({"kind": "risk_rule", "evidence_kind": "causal_signal"}).to_string(),
    ));
    Reply::tool_calls(calls).with_usage(600, 60)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_specialist_calling_an_ungranted_tool_is_denied_and_logged_and_the_run_goes_on() {
    const SPECIALIST: &str = "logs-investigator-model";
    let playbooks = PlaybookResponder::new(&convene_worker::profiles::example().unwrap())
        .expect("the example playbooks play");
    let model = start_model(
        |turn, r| match turn {
            1 => Reply::tool_calls(vec![delegate("logs", SPECIALIST, LOGS_GOAL)]),
            _ => {
                let cite: Vec<String> = last_user(r)["decision"]["accepted"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .flat_map(|a| a["claims"].as_array().cloned().unwrap_or_default())
                    .filter_map(|c| c["claim_id"].as_str().map(str::to_owned))
                    .collect();
                let cite: Vec<&str> = cite.iter().map(String::as_str).collect();
                Reply::tool_calls(vec![finish("done", "Connection pool exhaustion.", &cite)])
            }
        },
        Some(Box::new(move |r: &Recorded| {
            // First turn: the playbook's calls and the ungranted one; then its report.
            if r.last_tool_results().is_empty() {
                logs_calls_and_an_ungranted_one()
            } else {
                use convene_worker::model_server::Responder as _;
                playbooks.reply(r)
            }
        })),
    );
    let (mesh, run) = run_once(
        options(profiles_at(&model.base_url(), &[]), None),
        spec("planner-ungranted", &[SPECIALIST], "  max_rounds: 2"),
    )
    .await;
    owner_ends(&mesh).await;

    // The worker answered the ungranted call as denied, and the specialist went on.
    let specialist: Vec<Recorded> = model
        .requests()
        .into_iter()
        .filter(|r| !is_planner(r))
        .collect();
    assert_eq!(specialist.len(), 2, "the calls, then the report");
    let results = answers(&specialist[1]);
    let denied = &results
        .iter()
        .find(|(id, _)| id == "ungranted")
        .expect("the ungranted call is answered")
        .1;
    assert_eq!(denied["success"], false, "{denied:#}");
    assert!(
        denied["error"]
            .as_str()
            .is_some_and(|e| e.contains("denied by policy")),
        "{denied:#}"
    );
    assert!(
        results
            .iter()
            .filter(|(id, _)| id != "ungranted")
            .all(|(_, c)| c["success"] == true),
        "the granted calls succeeded: {results:#?}"
    );

    // The policy service judged it and logged the denial.
    let call = &calls_of(&run, 1)[0];
    let db = mesh.open_database().await;
    let rows = db
        .fetch_all(convene_store::sql(
            "SELECT record FROM decision_log WHERE kind = 'authorize'",
        ))
        .await
        .expect("the decision log is read");
    let decisions: Vec<Value> = rows
        .iter()
        .map(|row| {
            let text: String = row.get("record").expect("a record");
            serde_json::from_str::<Value>(&text).expect("a JSON record")
        })
        .filter(|d| d["delegation_id"] == call.delegation_id.as_str())
        .collect();
    let denied: Vec<&Value> = decisions.iter().filter(|d| d["allowed"] == false).collect();
    assert_eq!(denied.len(), 1, "one denial: {decisions:#?}");
    assert_eq!(denied[0]["tool"], "list_changes@1");
    assert_eq!(denied[0]["profile_id"], SPECIALIST);
    assert!(
        decisions
            .iter()
            .any(|d| d["allowed"] == true && d["tool"] == "search_logs@1"),
        "{decisions:#?}"
    );

    // The run went on: the result counts, the planner finished citing it.
    let d = delegation(&run, &call.delegation_id);
    let result = d.result.as_ref().expect("a result");
    assert_eq!(
        result.status,
        v1::TaskStatus::Completed as i32,
        "{result:#?}"
    );
    assert!(!result.claims.is_empty(), "{result:#?}");
    assert!(planner_state(&run).finished, "{run:#?}");
    assert!(!planner_state(&run).cited.is_empty(), "{run:#?}");
    assert_eq!(
        run.state,
        v1::RunState::Succeeded as i32,
        "not {}: {run:#?}",
        state_name(run.state)
    );
}

// ---------------------------------------------------------------------------------------
// The same question every round: NO_PROGRESS.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_planner_asking_the_same_question_every_round_ends_without_progress() {
    let model = start_model(
        |turn, _| Reply::tool_calls(vec![delegate(&format!("again-{turn}"), LOGS, LOGS_GOAL)]),
        None,
    );
    let (mesh, run) = run_once(
        options(profiles_at(&model.base_url(), &[]), None),
        spec(
            "planner-no-progress",
            &[LOGS],
            "  max_rounds: 6\n  no_progress_rounds: 2",
        ),
    )
    .await;
    owner_ends(&mesh).await;

    assert_eq!(
        run.state,
        v1::RunState::NoProgress as i32,
        "the run stops without progress, not {}: {run:#?}",
        state_name(run.state)
    );
    // Round 1 is new; rounds 2 and 3 repeat it: two unchanged rounds.
    let p = planner_state(&run);
    assert_eq!(p.round, 3, "three rounds: {p:#?}");
    assert_eq!(p.turns.len(), 3, "{p:#?}");
    assert_eq!(
        p.progress.len(),
        3,
        "a progress hash per decided round: {p:#?}"
    );
    assert!(
        p.progress.iter().all(|h| *h == p.progress[0]),
        "the same questions, artifacts and claims every round: {:?}",
        p.progress
    );
    assert_eq!(
        names(&run),
        [
            "r1c0-logs-investigator",
            "r2c0-logs-investigator",
            "r3c0-logs-investigator"
        ]
    );
    assert!(!p.finished);
    assert!(
        run.terminal_reason.contains("no progress")
            && run.terminal_reason.contains("unchanged for 2 round(s)"),
        "{}",
        run.terminal_reason
    );
    // The planner was not asked after the third round.
    assert_eq!(planner_requests(&model).len(), 3);
    let decisions = run.revisions.len();
    assert_eq!(decisions, 3, "a decision per round: {:#?}", run.revisions);
}

// ---------------------------------------------------------------------------------------
// Depth: the planner's delegation may not delegate further at max_depth 1.

/// The example profiles plus a playbook `coordinator` whose one step delegates to the
/// logs and metrics specialists with `delegate@1`.
fn coordinator_profiles(base_url: &str) -> String {
    let text = crate::nested::profiles(crate::nested::SPECIALISTS, &[]);
    pointed(&text, base_url, &[])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_max_depth_one_the_planners_coordinator_must_handle_its_task_itself() {
    let model = start_model(
        |turn, _| match turn {
            1 => {
                let mut args = delegate_args(
                    COORDINATOR,
                    "Have the logs and metrics specialists investigate, and report.",
                );
                args["may_redelegate"] = json!(true);
                Reply::tool_calls(vec![("coord", "delegate", args.to_string())])
            }
            _ => Reply::tool_calls(vec![finish(
                "done",
                "The coordinator could not delegate.",
                &[],
            )]),
        },
        None,
    );
    let (mesh, run) = run_once(
        options(
            coordinator_profiles(&model.base_url()),
            Some(crate::nested::nested_policy()),
        ),
        spec(
            "planner-depth",
            &[COORDINATOR, LOGS, METRICS],
            "  max_depth: 1\n  max_rounds: 2",
        ),
    )
    .await;
    owner_ends(&mesh).await;

    let call = &calls_of(&run, 1)[0];
    assert!(
        call.error.is_empty(),
        "the planner's own delegation is at depth 1: {call:#?}"
    );
    assert_eq!(run.delegations.len(), 1, "no child was created: {run:#?}");
    let coordinator = delegation(&run, &call.delegation_id);
    assert_eq!(task(coordinator).depth, 1);
    let result = coordinator
        .result
        .as_ref()
        .expect("the coordinator's result");
    assert_eq!(result.status, v1::TaskStatus::Failed as i32, "{result:#?}");
    let text = format!(
        "{} | {}",
        result.summary,
        result.error.as_ref().map_or("", |e| e.message.as_str())
    );
    for needed in [
        "delegation depth 2 exceeds max_depth 1",
        "handle this task yourself instead of delegating",
    ] {
        assert!(text.contains(needed), "the refusal says {needed:?}: {text}");
    }
    // The planner read it in the answer to its call.
    let requests = planner_requests(&model);
    assert_eq!(requests.len(), 2);
    let got = answers(&requests[1]);
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].0, "coord");
    assert_eq!(got[0].1["status"], "TASK_STATUS_FAILED", "{:#}", got[0].1);
    assert!(
        got[0]
            .1
            .to_string()
            .contains("delegation depth 2 exceeds max_depth 1"),
        "the planner is told why: {:#}",
        got[0].1
    );
    assert!(planner_state(&run).finished);
}

// ---------------------------------------------------------------------------------------
// Width: three delegate calls in one turn, at most two at once.

/// The planner of the width tests: three calls in its first turn (logs, metrics,
/// changes), two in a turn that follows a refusal of all three, then `finish`.
fn three_then_finish(turn: usize, r: &Recorded) -> Reply {
    let refused_all =
        answers(r).len() == 3 && answers(r).iter().all(|(_, c)| c["error"].is_string());
    match turn {
        1 => Reply::tool_calls(vec![
            delegate("w-logs", LOGS, LOGS_GOAL),
            delegate("w-metrics", METRICS, METRICS_GOAL),
            delegate("w-changes", CHANGES, CHANGES_GOAL),
        ]),
        2 if refused_all => Reply::tool_calls(vec![
            delegate("v-logs", LOGS, LOGS_GOAL),
            delegate("v-metrics", METRICS, METRICS_GOAL),
        ]),
        _ => Reply::tool_calls(vec![finish("done", "What the specialists found.", &[])]),
    }
}

/// Runs [`three_then_finish`] with `max_parallel_workers: 2` and `overflow`; every
/// specialist takes a little while, so running three at once would show.
async fn width_run(key: &str, overflow: &str) -> (TestMesh, ScriptedModel, v1::Run) {
    let model = start_model(three_then_finish, None);
    let slow = "{ delay: 150ms }";
    let profiles = profiles_at(
        &model.base_url(),
        &[(LOGS, slow), (METRICS, slow), (CHANGES, slow)],
    );
    let (mesh, run) = run_once(
        options(profiles, None),
        spec(
            key,
            &[LOGS, METRICS, CHANGES],
            &format!("  max_parallel_workers: 2\n  overflow: {overflow}\n  max_rounds: 3"),
        ),
    )
    .await;
    owner_ends(&mesh).await;
    (mesh, model, run)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queue_overflow_runs_all_three_delegations_two_at_a_time() {
    let (mesh, model, run) = width_run("planner-queue", "OVERFLOW_POLICY_QUEUE").await;
    assert_eq!(
        names(&run),
        [
            "r1c0-logs-investigator",
            "r1c1-metrics-investigator",
            "r1c2-change-auditor"
        ],
        "all three calls were accepted: {run:#?}"
    );
    for d in &run.delegations {
        assert_eq!(d.state, v1::DelegationState::Completed as i32, "{d:#?}");
    }
    assert!(
        calls_of(&run, 1)
            .iter()
            .all(|c| c.error.is_empty() && !c.dropped)
    );
    assert!(run.truncated.is_empty(), "{:?}", run.truncated);
    let events = mesh.run_events(ONCALL, &run.run_id).await;
    assert_eq!(
        most_in_flight(&events),
        2,
        "two ran at once, never three: {events:#?}"
    );
    // The third waited for a slot: dispatched after one of the first two completed.
    let third = time(run.delegations[2].dispatched_at.as_ref(), "dispatched_at");
    let first_done = run.delegations[..2]
        .iter()
        .map(|d| time(d.completed_at.as_ref(), "completed_at"))
        .min()
        .unwrap();
    assert!(third >= first_done, "{run:#?}");
    let got = answers(&planner_requests(&model)[1]);
    assert_eq!(got.len(), 3);
    assert!(
        got.iter()
            .all(|(_, c)| c["status"] == "TASK_STATUS_COMPLETED"),
        "{got:#?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn truncate_overflow_runs_two_delegations_and_tells_the_planner_which_was_dropped() {
    let (mesh, model, run) = width_run("planner-truncate", "OVERFLOW_POLICY_TRUNCATE").await;
    assert_eq!(
        names(&run),
        ["r1c0-logs-investigator", "r1c1-metrics-investigator"],
        "the third call was dropped: {run:#?}"
    );
    assert_eq!(run.truncated, ["r1c2-change-auditor"]);
    let calls = calls_of(&run, 1);
    assert!(
        calls[..2].iter().all(|c| c.error.is_empty() && !c.dropped),
        "{calls:#?}"
    );
    let dropped = &calls[2];
    assert!(dropped.dropped, "{dropped:#?}");
    assert!(dropped.delegation_id.is_empty(), "{dropped:#?}");
    for needed in [
        "dropped:",
        "TRUNCATE",
        "r1c2-change-auditor",
        "max_parallel_workers (2)",
    ] {
        assert!(
            dropped.error.contains(needed),
            "says {needed:?}: {}",
            dropped.error
        );
    }
    let events = mesh.run_events(ONCALL, &run.run_id).await;
    assert!(most_in_flight(&events) <= 2, "{events:#?}");
    // The answers after the round: the two results, then the dropped call's warning.
    let got = answers(&planner_requests(&model)[1]);
    let ids: Vec<&str> = got.iter().map(|(id, _)| id.as_str()).collect();
    assert_eq!(ids, ["w-logs", "w-metrics", "w-changes"]);
    assert_eq!(got[0].1["status"], "TASK_STATUS_COMPLETED");
    assert_eq!(got[1].1["status"], "TASK_STATUS_COMPLETED");
    assert_eq!(answer_error(&got[2].1), dropped.error);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reject_overflow_refuses_the_whole_turn_and_the_planner_sends_fewer() {
    let (mesh, model, run) = width_run("planner-reject", "OVERFLOW_POLICY_REJECT").await;
    let first = calls_of(&run, 1);
    assert_eq!(first.len(), 3);
    for c in first {
        assert!(c.delegation_id.is_empty() && !c.dropped, "{c:#?}");
        for needed in [
            "a batch of 3 delegations exceeds max_parallel_workers 2",
            "REJECT",
        ] {
            assert!(c.error.contains(needed), "says {needed:?}: {}", c.error);
        }
    }
    // Refused at once: the planner's second request carries the three errors.
    let requests = planner_requests(&model);
    let got = answers(&requests[1]);
    let ids: Vec<&str> = got.iter().map(|(id, _)| id.as_str()).collect();
    assert_eq!(ids, ["w-logs", "w-metrics", "w-changes"]);
    for ((_, content), call) in got.iter().zip(first) {
        assert_eq!(answer_error(content), call.error);
    }
    // Its two calls ran, in the same round, after the refused three.
    let second = calls_of(&run, 2);
    assert_eq!(second.len(), 2);
    assert!(second.iter().all(|c| c.error.is_empty()), "{second:#?}");
    assert_eq!(
        names(&run),
        ["r1c3-logs-investigator", "r1c4-metrics-investigator"],
        "call indices count every delegate call of the round: {run:#?}"
    );
    for d in &run.delegations {
        assert_eq!(d.state, v1::DelegationState::Completed as i32, "{d:#?}");
    }
    assert!(run.truncated.is_empty());
    let events = mesh.run_events(ONCALL, &run.run_id).await;
    assert_eq!(most_in_flight(&events), 2, "{events:#?}");
    assert_eq!(requests.len(), 3, "refused, delegated, finished");
    assert!(planner_state(&run).finished);
}

// ---------------------------------------------------------------------------------------
// Delegating back to the planner's own profile with the run's goal.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delegating_the_runs_goal_back_to_the_planner_is_refused_as_a_loop() {
    let model = start_model(
        |turn, _| match turn {
            1 => Reply::tool_calls(vec![delegate("self", PLANNER, GOAL)]),
            _ => Reply::tool_calls(vec![finish("done", "Nothing could be delegated.", &[])]),
        },
        None,
    );
    let (mesh, run) = run_once(
        options(profiles_at(&model.base_url(), &[]), None),
        spec("planner-loop", &[LOGS, PLANNER], "  max_rounds: 3"),
    )
    .await;
    owner_ends(&mesh).await;

    assert!(
        run.delegations.is_empty(),
        "nothing was delegated: {run:#?}"
    );
    let call = &calls_of(&run, 1)[0];
    assert!(call.delegation_id.is_empty(), "{call:#?}");
    for needed in ["would loop", PLANNER, "handle this task yourself"] {
        assert!(
            call.error.contains(needed),
            "the refusal says {needed:?}: {}",
            call.error
        );
    }
    // The planner was told at once, in the answer to its call.
    let requests = planner_requests(&model);
    assert_eq!(requests.len(), 2, "asked again right after the refusal");
    let got = answers(&requests[1]);
    assert_eq!(got.len(), 1, "{got:#?}");
    assert_eq!(got[0].0, "self");
    assert_eq!(answer_error(&got[0].1), call.error);
    assert!(
        planner_state(&run).finished,
        "the planner finished after it"
    );
}

// ---------------------------------------------------------------------------------------
// A delegation past max_rounds ends the run.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delegating_again_past_max_rounds_exhausts_the_budget() {
    let model = start_model(
        |turn, _| Reply::tool_calls(vec![logs_then_metrics(turn)]),
        None,
    );
    let (mesh, run) = run_once(
        options(profiles_at(&model.base_url(), &[]), None),
        spec("planner-max-rounds", &[LOGS, METRICS], "  max_rounds: 1"),
    )
    .await;
    owner_ends(&mesh).await;

    assert_eq!(
        run.state,
        v1::RunState::BudgetExhausted as i32,
        "not {}: {run:#?}",
        state_name(run.state)
    );
    assert!(
        run.terminal_reason.contains("max_rounds 1 reached"),
        "the reason names the limit: {}",
        run.terminal_reason
    );
    assert_eq!(
        names(&run),
        ["r1c0-logs-investigator"],
        "round 2 started nothing"
    );
    let second = &calls_of(&run, 2)[0];
    assert!(second.delegation_id.is_empty(), "{second:#?}");
    assert!(
        second.error.contains("max_rounds 1 reached"),
        "the second delegate call is refused for the rounds: {}",
        second.error
    );
    // The planner had been told after round 1 that no further round may start.
    let requests = planner_requests(&model);
    assert_eq!(requests.len(), 2, "not asked after the run ended");
    let decision = last_user(&requests[1]);
    assert!(
        decision["next"]
            .as_str()
            .is_some_and(|n| n.contains("max_rounds (1) reached")),
        "{decision:#}"
    );
}

// ---------------------------------------------------------------------------------------
// The planner's own tokens spend the run's budget.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_planners_tokens_exhaust_the_runs_budget() {
    // 600 tokens a turn against a budget of 1,000: the second turn spends it.
    let model = start_model(
        |turn, _| Reply::tool_calls(vec![logs_then_metrics(turn)]).with_usage(500, 100),
        None,
    );
    let (mesh, run) = run_once(
        options(profiles_at(&model.base_url(), &[]), None),
        spec(
            "planner-tokens",
            &[LOGS, METRICS],
            "  max_rounds: 4\n  max_tokens: 1000",
        ),
    )
    .await;
    owner_ends(&mesh).await;

    assert_eq!(
        run.state,
        v1::RunState::BudgetExhausted as i32,
        "not {}: {run:#?}",
        state_name(run.state)
    );
    let usage = run.usage.as_ref().expect("the run's usage");
    assert!(
        usage.tokens >= 1000,
        "the planner's tokens count: {usage:?}"
    );
    assert_eq!(
        usage.tokens, 1200,
        "two planner turns, playbook specialists: {usage:?}"
    );
    assert!(
        run.terminal_reason.contains("max_tokens"),
        "the reason names the budget: {}",
        run.terminal_reason
    );
    let p = planner_state(&run);
    let spent: u64 = p
        .turns
        .iter()
        .map(|t| t.usage.as_ref().map_or(0, |u| u.tokens))
        .sum();
    assert_eq!(spent, 1200, "each turn records its usage: {:#?}", p.turns);
    assert_eq!(
        names(&run),
        ["r1c0-logs-investigator"],
        "the second turn started nothing"
    );
    let refused = &calls_of(&run, 2)[0];
    assert!(
        refused.delegation_id.is_empty() && refused.error.contains("max_tokens"),
        "{refused:#?}"
    );
    assert_eq!(
        planner_requests(&model).len(),
        2,
        "the planner is not asked again once the budget is spent"
    );
}

// ---------------------------------------------------------------------------------------
// `finish` may cite only accepted claims.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_finish_citing_an_unaccepted_claim_is_refused_then_a_valid_one_ends_the_run() {
    let model = start_model(
        |turn, _| match turn {
            1 => Reply::tool_calls(vec![
                delegate("logs", LOGS, LOGS_GOAL),
                delegate("metrics", METRICS, METRICS_GOAL),
            ]),
            2 => Reply::tool_calls(vec![finish(
                "finish-1",
                "The cause is a rule change.",
                &["claim-log-cause", "claim-made-up"],
            )]),
            _ => Reply::tool_calls(vec![finish(
                "finish-2",
                "Connection pool exhaustion; the success rate fell at 02:02.",
                &["claim-log-cause", "claim-metric-success-rate"],
            )]),
        },
        None,
    );
    let (mesh, run) = run_once(
        options(profiles_at(&model.base_url(), &[]), None),
        spec("planner-finish", &[LOGS, METRICS], "  max_rounds: 2"),
    )
    .await;
    owner_ends(&mesh).await;

    let refused = &calls_of(&run, 2)[0];
    assert_eq!(refused.tool, "finish");
    assert!(
        refused.error.contains("claim-made-up") && refused.error.contains("not an accepted claim"),
        "the refusal names the claim: {}",
        refused.error
    );
    let requests = planner_requests(&model);
    assert_eq!(requests.len(), 3, "asked again after the refused finish");
    let got = answers(&requests[2]);
    assert_eq!(got.len(), 1, "{got:#?}");
    assert_eq!(got[0].0, "finish-1");
    assert_eq!(answer_error(&got[0].1), refused.error);

    // The valid finish ended the run as the decision says.
    let decision = run.decision.as_ref().expect("a decision");
    assert_eq!(
        decision.outcome,
        v1::JoinOutcome::Complete as i32,
        "{decision:#?}"
    );
    assert_eq!(
        run.state,
        v1::RunState::Succeeded as i32,
        "not {}: {run:#?}",
        state_name(run.state)
    );
    assert_eq!(run.outcome, decision.outcome);
    let p = planner_state(&run);
    assert!(p.finished);
    assert_eq!(p.cited, ["claim-log-cause", "claim-metric-success-rate"]);
    assert!(
        p.summary.starts_with("Connection pool exhaustion"),
        "{}",
        p.summary
    );
    assert!(calls_of(&run, 3)[0].error.is_empty());
    assert!(
        run.terminal_reason.contains("the planner finished"),
        "{}",
        run.terminal_reason
    );
}

// ---------------------------------------------------------------------------------------
// The example's model planner, played by the scripted server, against the playbook
// planner; the API key stays in the Authorization header.

/// A key the workers hold, which must never reach a run, an event or a message.
const KEY: &str = "sk-e2e-planner-7c41d09a2be5-secret";

fn example_spec(file: &str) -> v1::RunSpec {
    spec_from_yaml(
        &std::fs::read_to_string(repo_root().join("examples/payment-incident").join(file))
            .unwrap_or_else(|e| panic!("the example run spec {file} exists: {e}")),
    )
}

/// Each committed turn of a run's planner as its delegated profiles (without the
/// `-model` suffix) or `finish`.
fn turn_shapes(run: &v1::Run) -> Vec<Vec<String>> {
    planner_state(run)
        .turns
        .iter()
        .map(|t| {
            t.calls
                .iter()
                .map(|c| {
                    if c.tool == "finish" {
                        assert!(c.error.is_empty(), "{c:#?}");
                        return "finish".to_owned();
                    }
                    assert!(c.error.is_empty(), "every call is accepted: {c:#?}");
                    let profile = &task(delegation(run, &c.delegation_id)).profile_id;
                    profile.trim_end_matches("-model").to_owned()
                })
                .collect()
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_example_model_planner_ends_as_the_playbook_planner_and_never_shows_the_key() {
    // The example's playbooks as a scripted model; its planner delegates to the `-model`
    // specialists the model run offers.
    let model = ScriptedModel::start(
        PlaybookResponder::new(&convene_worker::profiles::example().unwrap()).unwrap(),
    )
    .expect("the server starts");
    let mesh = TestMesh::start(
        Mode::Processes,
        MeshOptions {
            workers: vec![Workers {
                profiles: Some(profiles_at(&model.base_url(), &[])),
                ..Workers::default()
            }],
            env: vec![("OPENAI_API_KEY".to_owned(), KEY.to_owned())],
            ..MeshOptions::default()
        },
    )
    .await;
    let played = mesh
        .start_run_id(ONCALL, example_spec("run-planner.yaml"))
        .await;
    let modelled = mesh
        .start_run_id(ONCALL, example_spec("run-planner-model.yaml"))
        .await;
    let played = mesh.wait_terminal(ONCALL, &played, LIMIT).await;
    let modelled = mesh.wait_terminal(ONCALL, &modelled, LIMIT).await;
    let events = mesh.run_events(ONCALL, &modelled.run_id).await;

    // The key went to the model server, in the Authorization header only.
    let requests = model.requests();
    let planner_turns = requests.iter().filter(|r| is_planner(r)).count();
    assert_eq!(planner_turns, 3, "two delegating turns and the finish");
    assert_eq!(
        requests.len(),
        3 + 2 * 4,
        "and two turns of each of four specialists"
    );
    for r in &requests {
        assert_eq!(r.authorization(), Some(format!("Bearer {KEY}").as_str()));
        assert!(
            !r.body.to_string().contains(KEY),
            "the key is in a request body"
        );
    }
    // ... and nowhere in the stored run, its events or its messages.
    for (what, text) in [
        ("the run", format!("{modelled:?}")),
        ("its events", format!("{events:?}")),
        ("its terminal reason", modelled.terminal_reason.clone()),
        (
            "the planner's conversation",
            format!("{:?}", planner_state(&modelled).messages),
        ),
    ] {
        assert!(!text.contains(KEY), "the key leaked into {what}");
    }

    // Both runs stop alike: the conflict between the logs and the change audit is
    // preserved and waits for a person; the R3 rollback waits for approvers.
    for run in [&played, &modelled] {
        assert_eq!(
            run.state,
            v1::RunState::WaitingInput as i32,
            "{} stops WAITING_INPUT, not {}: {} {run:#?}",
            run.spec.as_ref().map_or("", |s| s.idempotency_key.as_str()),
            state_name(run.state),
            run.terminal_reason
        );
        assert_eq!(run.outcome, v1::JoinOutcome::ConflictRequiresHuman as i32);
        assert!(!run.approval_ids.is_empty(), "the rollback awaits approval");
        assert!(planner_state(run).finished);
        let decision = run.decision.as_ref().expect("a decision");
        assert!(
            decision
                .conflicts
                .iter()
                .any(|c| c.topic == "primary_cause"),
            "{decision:#?}"
        );
        assert_eq!(run.revisions.len(), 2, "a decision per round");
    }
    // Two rounds: the three specialists, then the change auditor's follow-up.
    let expected = vec![
        vec![LOGS.to_owned(), METRICS.to_owned(), CHANGES.to_owned()],
        vec![CHANGES.to_owned()],
        vec!["finish".to_owned()],
    ];
    assert_eq!(turn_shapes(&played), expected);
    assert_eq!(turn_shapes(&modelled), expected);
    assert!(
        modelled
            .delegations
            .iter()
            .all(|d| task(d).profile_id.ends_with("-model")),
        "the model run delegated to the model specialists: {:?}",
        names(&modelled)
    );
    assert_eq!(
        modelled.decision.as_ref().map(|d| d.accepted.len()),
        played.decision.as_ref().map(|d| d.accepted.len())
    );
    mesh.stop(Duration::from_secs(10)).await;
}

// ---------------------------------------------------------------------------------------
// What a planner may delegate to: the profiles its run names.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delegation_to_a_profile_the_run_does_not_offer_is_refused() {
    // The run offers only the metrics investigator; the planner asks the logs
    // investigator, a profile the policy knows.
    let model = start_model(
        |turn, _| match turn {
            1 => Reply::tool_calls(vec![delegate("logs", LOGS, LOGS_GOAL)]),
            _ => Reply::tool_calls(vec![finish("done", "Nothing to report.", &[])]),
        },
        None,
    );
    let (mesh, run) = run_once(
        options(profiles_at(&model.base_url(), &[]), None),
        spec("planner-not-offered", &[METRICS], "  max_rounds: 2"),
    )
    .await;
    owner_ends(&mesh).await;
    let call = &calls_of(&run, 1)[0];
    assert!(
        run.delegations.is_empty() && call.delegation_id.is_empty(),
        "a profile outside planner.profiles (the delegate tool's enum) must not run, but \
         {} ran: {call:#?}",
        names(&run).join(", ")
    );
    assert!(
        call.error.contains(LOGS) && call.error.contains(METRICS),
        "the refusal names the profile and the ones offered: {}",
        call.error
    );
    assert!(
        call.error.contains("is not offered to this run's planner;"),
        "the refusal reads as one sentence: {}",
        call.error
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_scripted_example_planner_delegates_only_to_the_profiles_it_is_offered() {
    // The example's model run offers the `-model` specialists; the scripted server
    // playing the example planner must pick from what the request offers.
    let model = ScriptedModel::start(
        PlaybookResponder::new(&convene_worker::profiles::example().unwrap()).unwrap(),
    )
    .unwrap();
    let (mesh, run) = run_once(
        options(profiles_at(&model.base_url(), &[]), None),
        example_spec("run-planner-model.yaml"),
    )
    .await;
    owner_ends(&mesh).await;
    let first = &planner_requests(&model)[0];
    let offered: Vec<String> = first.body["tools"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|t| t["function"]["name"] == "delegate")
        .and_then(|t| t["function"]["parameters"]["properties"]["profile_id"]["enum"].as_array())
        .expect("the delegate tool offers a profile enum")
        .iter()
        .filter_map(|p| p.as_str().map(str::to_owned))
        .collect();
    let asked: Vec<&str> = run
        .delegations
        .iter()
        .map(|d| task(d).profile_id.as_str())
        .collect();
    assert!(
        asked.iter().all(|p| offered.iter().any(|o| o == p)),
        "the scripted planner delegated to {asked:?}, the request offered {offered:?}; \
         the run ended {} ({})",
        state_name(run.state),
        run.terminal_reason
    );
}

// ---------------------------------------------------------------------------------------
// A model as it is: `delegate` with only its required fields.

/// A `delegate` call with only the schema's required fields.
fn bare_delegate(id: &str, profile: &str, goal: &str) -> (String, String, String) {
    (
        id.to_owned(),
        "delegate".to_owned(),
        json!({"profile_id": profile, "goal": goal}).to_string(),
    )
}

/// The `issued_tokens` rows of run `run_id` in the mesh's database.
async fn tokens_issued(mesh: &TestMesh, run_id: &str) -> usize {
    let db = mesh.open_database().await;
    db.fetch_all(
        convene_store::sql("SELECT token_id FROM issued_tokens WHERE run_id = $1").bind(run_id),
    )
    .await
    .expect("the issued tokens are read")
    .len()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_planner_naming_only_profile_and_goal_gets_working_defaults_and_sees_them() {
    let playbooks = PlaybookResponder::new(&convene_worker::profiles::example().unwrap())
        .expect("the example playbooks play");
    let specialists = [
        ("logs", "logs-investigator-model", LOGS_GOAL),
        ("metrics", "metrics-investigator-model", METRICS_GOAL),
        ("changes", "change-auditor-model", CHANGES_GOAL),
    ];
    let model = start_model(
        move |turn, _| match turn {
            1 => Reply::tool_calls(
                specialists
                    .iter()
                    .map(|(id, profile, goal)| bare_delegate(id, profile, goal))
                    .collect::<Vec<_>>(),
            ),
            _ => Reply::tool_calls(vec![finish("done", "The assessment is in.", &[])]),
        },
        Some(Box::new(move |r: &Recorded| {
            use convene_worker::model_server::Responder as _;
            playbooks.reply(r)
        })),
    );
    let (mesh, run) = run_once(
        options(profiles_at(&model.base_url(), &[]), None),
        example_spec("run-planner-model.yaml"),
    )
    .await;
    owner_ends(&mesh).await;

    // Round 1's decision accepted the three specialists' results.
    let calls = calls_of(&run, 1);
    assert_eq!(calls.len(), 3, "{calls:#?}");
    for c in calls {
        assert!(c.error.is_empty(), "every bare call is accepted: {c:#?}");
    }
    let first = run.revisions.first().unwrap_or_else(|| {
        panic!(
            "round 1 was decided; the run ended {} ({})",
            state_name(run.state),
            run.terminal_reason
        )
    });
    for c in calls {
        let d = delegation(&run, &c.delegation_id);
        assert!(
            first.accepted.contains(&c.delegation_id),
            "round 1 accepted {} ({}): {first:#?}\n{d:#?}",
            task(d).profile_id,
            c.delegation_id
        );
    }
    assert!(
        run.state != v1::RunState::NoProgress as i32 && run.state != v1::RunState::Failed as i32,
        "the run ended {}: {}",
        state_name(run.state),
        run.terminal_reason
    );
    assert!(planner_state(&run).finished, "{}", run.terminal_reason);

    // The ledger records each default; the permissions are what the tools need.
    let logs = delegation(&run, &calls[0].delegation_id);
    let fields: Vec<&str> = logs.defaults.iter().map(|d| d.field.as_str()).collect();
    assert_eq!(fields, ["scope", "required_scopes", "acceptance_criteria"]);
    assert!(
        task(logs)
            .required_scopes
            .iter()
            .any(|s| s.action == "logs:read" && s.resource == "service/*"),
        "{:#?}",
        task(logs).required_scopes
    );
    let described = convene_worker::profiles::example()
        .unwrap()
        .into_iter()
        .find(|p| p.wire.id == "logs-investigator-model")
        .expect("the example describes its logs investigator")
        .wire
        .description;
    assert!(!described.is_empty());
    assert_eq!(
        task(logs).acceptance_criteria,
        [described],
        "the profile's description, as its worker registered it"
    );

    // ... and the model read them in the answers to its calls.
    let requests = planner_requests(&model);
    let opening = requests[0].messages()[1]["content"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    assert!(
        opening.contains("tool search_logs@1 (logs:read on service/*)")
            && opening.contains("tool list_changes@1 (changes:read on change/*)"),
        "the opening message shows each profile's tools and what they read: {opening}"
    );
    let answered = answers(&requests[1]);
    assert_eq!(answered.len(), 3, "{answered:#?}");
    for (id, content) in &answered {
        let applied = content["defaults_applied"]
            .as_array()
            .unwrap_or_else(|| panic!("call {id}'s answer lists its defaults: {content:#}"));
        assert!(
            applied.iter().any(|a| a["field"] == "required_scopes"),
            "{content:#}"
        );
    }
    assert!(
        answered[0].1["defaults_applied"]
            .to_string()
            .contains("logs:read on service/*"),
        "{:#}",
        answered[0].1
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delegation_that_could_serve_none_of_its_tools_is_refused_before_dispatch() {
    // The logs investigator asked for with metrics permissions only: its token would
    // allow search_logs@1 nothing.
    let model = start_model(
        |turn, _| match turn {
            1 => Reply::tool_calls(vec![(
                "logs".to_owned(),
                "delegate".to_owned(),
                json!({
                    "profile_id": LOGS,
                    "goal": LOGS_GOAL,
                    "required_scopes": [{"action": "metrics:read", "resource": "metric/*"}],
                })
                .to_string(),
            )]),
            _ => Reply::tool_calls(vec![finish("done", "Nothing could run.", &[])]),
        },
        None,
    );
    let (mesh, run) = run_once(
        options(profiles_at(&model.base_url(), &[]), None),
        spec("planner-unservable", &[LOGS], "  max_rounds: 2"),
    )
    .await;
    owner_ends(&mesh).await;

    let call = &calls_of(&run, 1)[0];
    assert!(
        run.delegations.is_empty() && call.delegation_id.is_empty(),
        "an unservable delegation must not be created: {:?}",
        names(&run)
    );
    assert!(
        call.error.contains("search_logs@1 needs logs:read")
            && call.error.contains("required_scopes"),
        "the refusal names what is missing: {}",
        call.error
    );
    // The refusal reached the model in its next turn.
    let requests = planner_requests(&model);
    assert_eq!(requests.len(), 2, "the refused turn, then the finish");
    let answered = answers(&requests[1]);
    assert_eq!(answered.len(), 1);
    assert_eq!(answer_error(&answered[0].1), call.error);
    // No worker ran it, and no token was issued for it: the planner's own is the
    // run's only token.
    assert!(
        model.requests().iter().all(is_planner),
        "a specialist was asked"
    );
    assert_eq!(tokens_issued(&mesh, &run.run_id).await, 1);
}
