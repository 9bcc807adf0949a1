//! The conformance suite of model behaviours: scripted OpenAI-compatible personas, each
//! served over real HTTP on loopback by the scripted model server, each playing a
//! specialist's model (`logs-investigator-model`, one delegation with `search_logs@1`)
//! and a planner's model (`incident-planner-model`, delegating to the playbook
//! specialists), every run through the real services of one mesh.
//!
//! A persona is told apart from the others by a tag in the goal it is given
//! (`[persona:<name>]`); its answers follow the turn it is asked for. For each persona
//! and role the test states the run's end and asserts it, bounds every wait, checks that
//! every refusal reached the model (its text is in a tool or user message of the
//! persona's next request) and counts them where the runtime counts them: a
//! specialist's refused tool calls in its result's `usage.tool_calls` (every call, made
//! or refused), its refused reports and plain-text turns in `usage.iterations` (each
//! costs a turn); a planner's refused calls as the `error` of the calls of its
//! committed turns, and its plain-text turns as committed turns without calls.
//!
//! A slow persona's run is cancelled while its answer is awaited, and the server must see
//! the worker abandon the call: the cancel cuts the 20 s answer short.
//!
//! The personas run concurrently, one mesh per role; the stream persona has a mesh of
//! its own whose model profiles ask for streaming (`stream: true`), and is answered in
//! server-sent events. docs/model-conformance.md has the table of outcomes.

use std::collections::BTreeSet;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::time::Duration;

use crate::harness::{MeshOptions, Mode, TestMesh, Workers, example_profiles, spec_from_yaml};
use convene_mesh::auth::request;
use convene_proto::v1;
use convene_worker::model_server::{Recorded, Reply, ScriptedModel};
use convene_worker::openai::function_name;
use futures::FutureExt as _;
use serde_json::{Value, json};

const ONCALL: &str = "oncall@acme";
/// How long any run here may take to end: each ends in seconds.
const LIMIT: Duration = Duration::from_secs(45);
/// How long a cancelled run may take to end: far less than the slow persona's answer.
const CANCEL_LIMIT: Duration = Duration::from_secs(10);
/// How long the slow persona takes to answer.
const SLOW: Duration = Duration::from_secs(20);
/// The specialist every worker-role persona plays, and its one tool.
const SPECIALIST: &str = "logs-investigator-model";
const SEARCH_LOGS: &str = "search_logs@1";
/// The planner every planner-role persona plays, and the specialists it may delegate to.
const PLANNER: &str = "incident-planner-model";
const LOGS: &str = "logs-investigator";
const METRICS: &str = "metrics-investigator";
const CHANGES: &str = "change-auditor";
const WINDOW_START: &str = "2026-07-23T01:45:00Z";
const WINDOW_END: &str = "2026-07-23T02:10:00Z";
/// The size of the huge persona's answer.
const HUGE: usize = 1 << 20;

/// The personas.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Persona {
    /// Required fields only.
    Minimal,
    /// Text and tool calls in the same message.
    Verbose,
    /// Invalid JSON arguments, then valid ones.
    Malformed,
    /// Strings for numbers (and a string for a list), then the right types.
    WrongTypes,
    /// A tool nobody offered, then the right one.
    UnknownTool,
    /// Cites evidence (or claims) nobody recorded, then what was recorded.
    MadeUpIds,
    /// Only ever answers in text.
    TextOnly,
    /// The identical call (id and arguments) again and again.
    Repeated,
    /// Several calls in one message.
    Parallel,
    /// The same call id for different calls, in one message and across turns (as
    /// servers that number each answer's calls from 0 do).
    ReusedIds,
    /// 1 MiB of text first, then the minimal persona's calls.
    Huge,
    /// 20 s per answer; the run is cancelled meanwhile.
    Slow,
    /// The minimal persona, answering in server-sent events.
    Stream,
}

const PERSONAS: [Persona; 12] = [
    Persona::Minimal,
    Persona::Verbose,
    Persona::Malformed,
    Persona::WrongTypes,
    Persona::UnknownTool,
    Persona::MadeUpIds,
    Persona::TextOnly,
    Persona::Repeated,
    Persona::Parallel,
    Persona::ReusedIds,
    Persona::Huge,
    Persona::Slow,
];

impl Persona {
    fn name(self) -> &'static str {
        match self {
            Self::Minimal => "minimal",
            Self::Verbose => "verbose",
            Self::Malformed => "malformed",
            Self::WrongTypes => "wrong-types",
            Self::UnknownTool => "unknown-tool",
            Self::MadeUpIds => "made-up-ids",
            Self::TextOnly => "text-only",
            Self::Repeated => "repeated",
            Self::Parallel => "parallel",
            Self::ReusedIds => "reused-ids",
            Self::Huge => "huge",
            Self::Slow => "slow",
            Self::Stream => "stream",
        }
    }

    fn from_name(name: &str) -> Option<Self> {
        PERSONAS
            .into_iter()
            .chain([Self::Stream])
            .find(|p| p.name() == name)
    }

    /// The tag that marks the goals this persona is given.
    fn tag(self) -> String {
        format!("[persona:{}]", self.name())
    }
}

// ---------------------------------------------------------------------------------------
// What the scripted server sees of a request.

/// Whether `r` is a planner's turn: it offers exactly `delegate` and `finish`.
fn is_planner(r: &Recorded) -> bool {
    let tools: BTreeSet<&str> = r.tools().into_iter().collect();
    tools == BTreeSet::from(["delegate", "finish"])
}

/// The persona a request is for, by the tag in its first user message.
fn persona_of(r: &Recorded) -> Option<Persona> {
    let first = r.messages().iter().find(|m| m["role"] == "user")?;
    let text = first["content"].as_str()?;
    let start = text.find("[persona:")? + "[persona:".len();
    let end = start + text[start..].find(']')?;
    Persona::from_name(&text[start..end])
}

/// The turn a request asks for, from 1: one more than the answers it carries.
fn turn_of(r: &Recorded) -> usize {
    r.messages()
        .iter()
        .filter(|m| m["role"] == "assistant")
        .count()
        + 1
}

/// The evidence ids the successful tool calls of the conversation returned.
fn recorded_evidence(r: &Recorded) -> Vec<String> {
    let mut ids = Vec::new();
    for m in r.messages().iter().filter(|m| m["role"] == "tool") {
        let Some(outcome) = m["content"]
            .as_str()
            .and_then(|c| serde_json::from_str::<Value>(c).ok())
        else {
            continue;
        };
        if let Some(id) = outcome["evidence_id"].as_str()
            && !ids.iter().any(|known| known == id)
        {
            ids.push(id.to_owned());
        }
    }
    ids
}

/// The text of the `tool` and `user` messages after the last `assistant` message:
/// what the model is told of its last answer.
fn told(r: &Recorded) -> String {
    let messages = r.messages();
    let after = messages
        .iter()
        .rposition(|m| m["role"] == "assistant")
        .map_or(0, |i| i + 1);
    messages[after..]
        .iter()
        .filter(|m| m["role"] == "tool" || m["role"] == "user")
        .map(|m| {
            let text = m["content"].as_str().unwrap_or_default();
            // A tool answer is JSON: its error, as the model reads it.
            serde_json::from_str::<Value>(text)
                .ok()
                .and_then(|v| v["error"].as_str().map(str::to_owned))
                .unwrap_or_else(|| text.to_owned())
        })
        .collect::<Vec<_>>()
        .join("\n")
}

// ---------------------------------------------------------------------------------------
// The personas as a specialist's model.

/// One tool call `(id, function name, arguments)`.
type Call = (String, String, String);

fn call(id: &str, tool: &str, arguments: impl Into<String>) -> Call {
    (id.to_owned(), function_name(tool), arguments.into())
}

fn search(id: &str) -> Call {
    call(
        id,
        SEARCH_LOGS,
        json!({"service": "payment-api"}).to_string(),
    )
}

/// A report whose one claim cites `refs`, with `confidence` as given.
fn report(id: &str, refs: &[String], confidence: Value) -> Call {
    (
        id.to_owned(),
        "submit_report".to_owned(),
        json!({
            "summary": "payment-api logs show connection pool exhaustion",
            "claims": [{
                "topic": "primary_cause",
                "value": "connection_pool_exhaustion",
                "statement": "payment_confirm failures follow POOL_EXHAUSTED errors",
                "evidence_refs": refs,
                "confidence": confidence,
            }],
        })
        .to_string(),
    )
}

/// The minimal report: required fields only, citing what was recorded.
fn minimal_report(r: &Recorded) -> Call {
    (
        "call_report".to_owned(),
        "submit_report".to_owned(),
        json!({
            "summary": "payment-api logs show connection pool exhaustion",
            "claims": [{
                "topic": "primary_cause",
                "value": "connection_pool_exhaustion",
                "statement": "payment_confirm failures follow POOL_EXHAUSTED errors",
                "evidence_refs": recorded_evidence(r),
            }],
        })
        .to_string(),
    )
}

/// A message of tool calls.
fn calls(calls: Vec<Call>) -> Reply {
    Reply::tool_calls(calls)
}

/// How `persona` answers turn `turn` of a specialist's task.
fn specialist(persona: Persona, turn: usize, r: &Recorded) -> Reply {
    match persona {
        Persona::Minimal | Persona::Stream => match turn {
            1 => calls(vec![search("call_logs")]),
            _ => calls(vec![minimal_report(r)]),
        },
        Persona::Verbose => match turn {
            1 => calls(vec![search("call_logs")])
                .with_content("I will search the payment-api logs for errors first."),
            _ => calls(vec![minimal_report(r)])
                .with_content("The logs point at the connection pool; here is my report."),
        },
        Persona::Malformed => match turn {
            1 => calls(vec![call(
                "call_broken",
                SEARCH_LOGS,
                r#"{"service": "payment-api""#,
            )]),
            2 => calls(vec![search("call_logs")]),
            _ => calls(vec![minimal_report(r)]),
        },
        Persona::WrongTypes => match turn {
            1 => calls(vec![call(
                "call_typed",
                SEARCH_LOGS,
                json!({"service": "payment-api", "sample": "3", "max_rows": "100"}).to_string(),
            )]),
            2 => calls(vec![search("call_logs")]),
            3 => calls(vec![report(
                "call_report_typed",
                &recorded_evidence(r),
                json!("0.8"),
            )]),
            _ => calls(vec![report(
                "call_report",
                &recorded_evidence(r),
                json!(0.8),
            )]),
        },
        Persona::UnknownTool => match turn {
            1 => calls(vec![call(
                "call_db",
                "read_database@1",
                json!({"table": "payments"}).to_string(),
            )]),
            2 => calls(vec![search("call_logs")]),
            _ => calls(vec![minimal_report(r)]),
        },
        Persona::MadeUpIds => match turn {
            1 => calls(vec![search("call_logs")]),
            2 => calls(vec![report(
                "call_report_made_up",
                &["logs://payment-api/made-up/call_42".to_owned()],
                json!(0.9),
            )]),
            _ => calls(vec![minimal_report(r)]),
        },
        Persona::TextOnly => {
            Reply::text("The payment incident was probably caused by the database.")
        }
        Persona::Repeated => match turn {
            1..=3 => calls(vec![search("call_same")]),
            _ => calls(vec![minimal_report(r)]),
        },
        Persona::Parallel => match turn {
            1 => calls(vec![
                search("call_payment"),
                call(
                    "call_gateway",
                    SEARCH_LOGS,
                    json!({"service": "risk-gateway"}).to_string(),
                ),
                call(
                    "call_pool",
                    SEARCH_LOGS,
                    json!({"service": "payment-api", "match": {"error": "POOL_EXHAUSTED"}})
                        .to_string(),
                ),
            ]),
            _ => calls(vec![minimal_report(r)]),
        },
        Persona::ReusedIds => match turn {
            1 => calls(vec![
                search("call_0"),
                call(
                    "call_0",
                    SEARCH_LOGS,
                    json!({"service": "risk-gateway"}).to_string(),
                ),
            ]),
            2 => calls(vec![call(
                "call_0",
                SEARCH_LOGS,
                json!({"service": "payment-api", "match": {"error": "POOL_EXHAUSTED"}}).to_string(),
            )]),
            _ => calls(vec![minimal_report(r)]),
        },
        Persona::Huge => match turn {
            1 => Reply::text("x".repeat(HUGE)),
            2 => calls(vec![search("call_logs")]),
            _ => calls(vec![minimal_report(r)]),
        },
        Persona::Slow => Reply::delayed(SLOW, calls(vec![search("call_logs")])),
    }
}

// ---------------------------------------------------------------------------------------
// The personas as a planner's model.

fn delegate(id: &str, arguments: impl Into<String>) -> Call {
    (id.to_owned(), "delegate".to_owned(), arguments.into())
}

/// A `delegate` call with the required fields only.
fn minimal_delegate(id: &str, profile: &str) -> Call {
    delegate(
        id,
        json!({
            "profile_id": profile,
            "goal": "Find the error patterns in the payment-api logs and when they began.",
        })
        .to_string(),
    )
}

fn finish(id: &str, arguments: Value) -> Call {
    (id.to_owned(), "finish".to_owned(), arguments.to_string())
}

fn minimal_finish() -> Call {
    finish(
        "call_finish",
        json!({"summary": "The specialists' findings are in."}),
    )
}

/// How `persona` answers turn `turn` of a planner.
fn planner(persona: Persona, turn: usize) -> Reply {
    match persona {
        Persona::Minimal | Persona::Stream => match turn {
            1 => calls(vec![minimal_delegate("call_logs", LOGS)]),
            _ => calls(vec![minimal_finish()]),
        },
        Persona::Verbose => match turn {
            1 => calls(vec![minimal_delegate("call_logs", LOGS)])
                .with_content("I will ask the logs investigator first."),
            _ => calls(vec![minimal_finish()])
                .with_content("The decision is in; I am finishing the run."),
        },
        Persona::Malformed => match turn {
            1 => calls(vec![delegate(
                "call_broken",
                r#"{"profile_id": "logs-investigator", "goal": "#,
            )]),
            2 => calls(vec![minimal_delegate("call_logs", LOGS)]),
            _ => calls(vec![minimal_finish()]),
        },
        Persona::WrongTypes => match turn {
            1 => calls(vec![delegate(
                "call_typed",
                json!({
                    "profile_id": LOGS,
                    "goal": "Find the error patterns in the payment-api logs.",
                    "timeout_seconds": "15",
                })
                .to_string(),
            )]),
            2 => calls(vec![minimal_delegate("call_logs", LOGS)]),
            3 => calls(vec![finish(
                "call_finish_typed",
                json!({"summary": "Done.", "cite": "claim-1"}),
            )]),
            _ => calls(vec![minimal_finish()]),
        },
        Persona::UnknownTool => match turn {
            1 => calls(vec![(
                "call_investigate".to_owned(),
                "investigate".to_owned(),
                json!({"question": "why did payments fail?"}).to_string(),
            )]),
            2 => calls(vec![minimal_delegate("call_logs", LOGS)]),
            _ => calls(vec![minimal_finish()]),
        },
        Persona::MadeUpIds => match turn {
            1 => calls(vec![minimal_delegate("call_logs", LOGS)]),
            2 => calls(vec![finish(
                "call_finish_made_up",
                json!({"summary": "Done.", "cite": ["claim-made-up-42"]}),
            )]),
            _ => calls(vec![minimal_finish()]),
        },
        Persona::TextOnly => Reply::text("I think the database caused it; no need to delegate."),
        Persona::Repeated => calls(vec![minimal_delegate("call_same", LOGS)]),
        Persona::Parallel => match turn {
            1 => calls(vec![
                minimal_delegate("call_logs", LOGS),
                minimal_delegate("call_metrics", METRICS),
                minimal_delegate("call_changes", CHANGES),
            ]),
            _ => calls(vec![minimal_finish()]),
        },
        Persona::ReusedIds => match turn {
            1 => calls(vec![
                minimal_delegate("call_0", LOGS),
                minimal_delegate("call_0", METRICS),
            ]),
            _ => calls(vec![finish("call_0", json!({"summary": "Done."}))]),
        },
        Persona::Huge => match turn {
            1 => Reply::text("y".repeat(HUGE)),
            2 => calls(vec![minimal_delegate("call_logs", LOGS)]),
            _ => calls(vec![minimal_finish()]),
        },
        Persona::Slow => Reply::delayed(SLOW, calls(vec![minimal_delegate("call_logs", LOGS)])),
    }
}

/// The scripted server every persona answers from.
fn start_model() -> ScriptedModel {
    ScriptedModel::start(|r: &Recorded| {
        let Some(persona) = persona_of(r) else {
            return Reply::error(
                400,
                format!(
                    "no persona is named in the request's first user message; tools {:?}",
                    r.tools()
                ),
            );
        };
        if is_planner(r) {
            planner(persona, turn_of(r))
        } else {
            specialist(persona, turn_of(r), r)
        }
    })
    .expect("the scripted model server starts")
}

// ---------------------------------------------------------------------------------------
// The mesh and the runs.

/// The example profiles with every `openai` profile pointed at `base_url`, streaming
/// when `stream`.
fn profiles_at(base_url: &str, stream: bool) -> String {
    let mut out = String::new();
    let mut pointed = 0;
    for line in example_profiles().lines() {
        out.push_str(line);
        out.push('\n');
        if line.trim_start().starts_with("provider: openai") {
            let indent = &line[..line.len() - line.trim_start().len()];
            out.push_str(&format!("{indent}base_url: {base_url}\n"));
            if stream {
                out.push_str(&format!("{indent}stream: true\n"));
            }
            pointed += 1;
        }
    }
    assert_eq!(pointed, 4, "three model specialists and the model planner");
    out
}

async fn start_mesh(model: &ScriptedModel, stream: bool) -> TestMesh {
    TestMesh::start(
        Mode::InProcess,
        MeshOptions {
            workers: vec![Workers {
                profiles: Some(profiles_at(&model.base_url(), stream)),
                ..Workers::default()
            }],
            ..MeshOptions::default()
        },
    )
    .await
}

/// A run of one delegation to the model specialist, its goal tagged with `persona`.
fn specialist_spec(persona: Persona) -> v1::RunSpec {
    let tag = persona.tag();
    spec_from_yaml(&format!(
        r#"
goal: "{tag} Assess the payment success-rate drop at 02:02 UTC."
idempotency_key: conformance-specialist-{name}
delegations:
  - name: logs
    profile_id: {SPECIALIST}
    goal: "{tag} Identify the main error patterns in the payment logs and when they began."
    scope:
      resources: ["service/payment-api", "service/risk-gateway"]
      time_range: {{ start: "{WINDOW_START}", end: "{WINDOW_END}" }}
    required_scopes:
      - action: "logs:read"
        resource: "service/*"
    timeout: 40s
join:
  join_id: join-conformance
  strategy: JOIN_STRATEGY_ALL
  on_timeout: ON_TIMEOUT_EMIT_PARTIAL
  late_result: LATE_RESULT_POLICY_DISCARD
limits:
  timeout: 50s
"#,
        name = persona.name(),
    ))
}

/// A planner run of the model planner, its goal tagged with `persona`, offering the
/// playbook specialists.
fn planner_spec(persona: Persona) -> v1::RunSpec {
    let tag = persona.tag();
    spec_from_yaml(&format!(
        r#"
goal: "{tag} Assess the payment success-rate drop at 02:02 UTC: impact and cause."
idempotency_key: conformance-planner-{name}
planner:
  profile_id: {PLANNER}
  instructions: The incident window is {WINDOW_START} to {WINDOW_END}.
  profiles: [{LOGS}, {METRICS}, {CHANGES}]
join:
  join_id: join-conformance-planner
  strategy: JOIN_STRATEGY_ALL
  on_timeout: ON_TIMEOUT_EMIT_PARTIAL
  late_result: LATE_RESULT_POLICY_DISCARD
limits:
  max_rounds: 4
  no_progress_rounds: 2
  timeout: 50s
"#,
        name = persona.name(),
    ))
}

async fn cancel_run(mesh: &TestMesh, run_id: &str) {
    mesh.supervisor()
        .cancel_run(request(
            v1::CancelRunRequest {
                run_id: run_id.to_owned(),
                reason: "the operator stopped a slow model".to_owned(),
            },
            &mesh.credential(ONCALL),
        ))
        .await
        .expect("CancelRun");
}

/// Runs `spec` to its end; for the slow persona, cancels it once its first request has
/// reached the model server.
async fn run_to_end(
    mesh: &TestMesh,
    model: &ScriptedModel,
    persona: Persona,
    planner_role: bool,
    spec: v1::RunSpec,
) -> v1::Run {
    let run_id = mesh.start_run_id(ONCALL, spec).await;
    if persona != Persona::Slow {
        return mesh.wait_terminal(ONCALL, &run_id, LIMIT).await;
    }
    crate::harness::wait_until("the slow persona's first request", LIMIT, async || {
        !requests_of(model, persona, planner_role).is_empty()
    })
    .await;
    cancel_run(mesh, &run_id).await;
    mesh.wait_terminal(ONCALL, &run_id, CANCEL_LIMIT).await
}

/// Waits until the worker has given up its call of the slow persona: the cancel cut the
/// 20 s answer short instead of waiting it out. The slow persona's is the only call of
/// a test that may be abandoned.
async fn slow_call_abandoned(model: &ScriptedModel) {
    crate::harness::wait_until(
        "the worker to abandon the slow persona's call",
        CANCEL_LIMIT,
        async || model.abandoned() >= 1,
    )
    .await;
    assert_eq!(model.abandoned(), 1, "only the slow call was abandoned");
}

/// The requests `persona` received in one role, in order.
fn requests_of(model: &ScriptedModel, persona: Persona, planner_role: bool) -> Vec<Recorded> {
    model
        .requests()
        .into_iter()
        .filter(|r| persona_of(r) == Some(persona) && is_planner(r) == planner_role)
        .collect()
}

fn state_name(state: i32) -> &'static str {
    v1::RunState::try_from(state).map_or("?", |s| s.as_str_name())
}

fn status_name(status: i32) -> &'static str {
    v1::TaskStatus::try_from(status).map_or("?", |s| s.as_str_name())
}

// ---------------------------------------------------------------------------------------
// The checks.

/// Asserts that turn `turn`'s request (from 1) tells the model `refusal`, in a tool or
/// user message after its last answer.
fn assert_told(requests: &[Recorded], turn: usize, refusal: &str, persona: Persona) {
    let r = requests
        .iter()
        .find(|r| turn_of(r) == turn)
        .unwrap_or_else(|| {
            panic!(
                "{}: no request for turn {turn}; turns asked: {:?}",
                persona.name(),
                requests.iter().map(turn_of).collect::<Vec<_>>()
            )
        });
    let told = told(r);
    assert!(
        told.contains(refusal),
        "{}: turn {turn} is not told {refusal:?}; it is told: {}",
        persona.name(),
        crate_clip(&told)
    );
}

fn crate_clip(text: &str) -> String {
    if text.len() <= 2000 {
        return text.to_owned();
    }
    let mut end = 2000;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}… ({} bytes)", &text[..end], text.len())
}

/// The one result of a specialist run.
fn the_result(run: &v1::Run) -> &v1::TaskResult {
    assert_eq!(run.delegations.len(), 1, "{run:#?}");
    run.delegations[0]
        .result
        .as_ref()
        .unwrap_or_else(|| panic!("the delegation has a result: {run:#?}"))
}

/// What a specialist run must come to: the run's state, the result's status, the
/// turns taken, the tool calls made (refused ones included) and the evidence records.
struct SpecialistEnd {
    run: v1::RunState,
    status: v1::TaskStatus,
    iterations: u32,
    tool_calls: u32,
    evidence: usize,
    /// The refusals the model was told: (the turn told, text).
    told: Vec<(usize, &'static str)>,
}

fn specialist_end(persona: Persona) -> SpecialistEnd {
    use v1::RunState as R;
    use v1::TaskStatus as S;
    let done = |iterations, tool_calls, evidence, told| SpecialistEnd {
        run: R::Succeeded,
        status: S::Completed,
        iterations,
        tool_calls,
        evidence,
        told,
    };
    match persona {
        // One search, one report.
        Persona::Minimal | Persona::Verbose | Persona::Stream => done(2, 1, 1, vec![]),
        // The broken call is refused, counted, and made again.
        Persona::Malformed => done(3, 2, 1, vec![(2, "not a JSON object")]),
        // The mistyped call is refused and counted; the mistyped report is refused and
        // costs a turn.
        Persona::WrongTypes => done(
            4,
            2,
            1,
            vec![
                (
                    2,
                    "invalid arguments for search_logs@1: invalid type: string",
                ),
                (4, "report does not match the submit_report schema"),
            ],
        ),
        Persona::UnknownTool => done(3, 2, 1, vec![(2, "unknown tool read_database@1")]),
        Persona::MadeUpIds => done(3, 1, 1, vec![(3, "was not recorded in this task")]),
        // Three identical calls all run (nothing refuses a repeat); the repeated id is
        // replaced, so each records evidence of its own (the same content).
        Persona::Repeated => done(4, 3, 3, vec![]),
        Persona::Parallel => done(2, 3, 3, vec![]),
        // Every call gets an id of its own: three calls, three evidence records.
        Persona::ReusedIds => done(3, 3, 3, vec![]),
        // The 1 MiB of text is answered with the plain-text refusal, then the persona
        // searches and reports.
        Persona::Huge => done(3, 1, 1, vec![(2, "You answered in plain text")]),
        // Eight turns of text, each refused: the iteration limit fails the task, and
        // the join has no result to accept.
        Persona::TextOnly => SpecialistEnd {
            run: R::Failed,
            status: S::Failed,
            iterations: 8,
            tool_calls: 0,
            evidence: 0,
            told: (2..=8).map(|t| (t, "You answered in plain text")).collect(),
        },
        // Cancelled while its first answer is awaited.
        Persona::Slow => SpecialistEnd {
            run: R::Cancelled,
            status: S::Failed,
            iterations: 1,
            tool_calls: 0,
            evidence: 0,
            told: vec![],
        },
    }
}

async fn check_specialist(mesh: &TestMesh, model: &ScriptedModel, persona: Persona) {
    let name = persona.name();
    let run = run_to_end(mesh, model, persona, false, specialist_spec(persona)).await;
    let want = specialist_end(persona);
    assert_eq!(
        run.state,
        want.run as i32,
        "{name}: the run ends {}, not {}: {}",
        want.run.as_str_name(),
        state_name(run.state),
        run.terminal_reason
    );
    let requests = requests_of(model, persona, false);
    if persona == Persona::Slow {
        // The delegation was cancelled with its first answer outstanding; its result, if
        // the worker's came before the run closed, says so.
        assert_eq!(requests.len(), 1, "{name}: asked once");
        if let Some(result) = run.delegations.first().and_then(|d| d.result.as_ref()) {
            assert_eq!(result.status, want.status as i32, "{name}: {result:#?}");
            let error = result.error.as_ref().expect("why it ended");
            assert_eq!(error.code, "cancelled", "{name}: {error:?}");
        }
        slow_call_abandoned(model).await;
        return;
    }
    let result = the_result(&run);
    assert_eq!(
        result.status,
        want.status as i32,
        "{name}: the result is {}, not {}: {:?}",
        want.status.as_str_name(),
        status_name(result.status),
        result.error
    );
    let usage = result.usage.as_ref().expect("usage");
    assert_eq!(
        usage.iterations, want.iterations,
        "{name}: turns: {usage:?}"
    );
    assert_eq!(
        usage.tool_calls, want.tool_calls,
        "{name}: tool calls, refused ones included: {usage:?}"
    );
    assert_eq!(result.evidence.len(), want.evidence, "{name}: evidence");
    assert_eq!(
        requests.len(),
        want.iterations as usize,
        "{name}: one request per turn"
    );
    for (turn, refusal) in &want.told {
        assert_told(&requests, *turn, refusal, persona);
    }
    // Every call the model made is answered once, under an id no other call has, and
    // every answer the model got but its refusals is a success.
    let last = requests.last().expect("a request");
    let mut answered = BTreeSet::new();
    let mut refused = 0;
    for m in last.messages().iter().filter(|m| m["role"] == "tool") {
        let id = m["tool_call_id"].as_str().unwrap_or_default();
        assert!(
            answered.insert(id.to_owned()),
            "{name}: {id} is answered twice"
        );
        let outcome: Value = serde_json::from_str(m["content"].as_str().unwrap_or_default())
            .expect("a tool answer is JSON");
        if outcome["success"] != true {
            refused += 1;
        }
    }
    let called: usize = last
        .messages()
        .iter()
        .filter(|m| m["role"] == "assistant")
        .map(|m| m["tool_calls"].as_array().map_or(0, Vec::len))
        .sum();
    assert_eq!(answered.len(), called, "{name}: every call is answered");
    let refused_reports = want
        .told
        .iter()
        .filter(|(_, t)| t.contains("report") || t.contains("not recorded"))
        .count();
    let refused_calls = want.told.len() - refused_reports;
    let plain = want
        .told
        .iter()
        .filter(|(_, t)| t.contains("plain text"))
        .count();
    assert_eq!(
        refused,
        refused_calls - plain + refused_reports,
        "{name}: refused answers in the conversation"
    );
    if want.status == v1::TaskStatus::Completed {
        assert!(!result.claims.is_empty(), "{name}: {result:#?}");
        for claim in &result.claims {
            assert!(!claim.evidence_refs.is_empty(), "{name}: {claim:#?}");
            for id in &claim.evidence_refs {
                assert!(
                    result.evidence.iter().any(|e| &e.evidence_id == id),
                    "{name}: {id} cites recorded evidence"
                );
            }
        }
        let decision = run.decision.as_ref().expect("a decision");
        assert_eq!(decision.accepted.len(), 1, "{name}: {decision:#?}");
    }
}

/// What a planner run must come to: the run's state, the committed turns, the refused
/// calls among them and the plain-text turns, whether the planner finished, and the
/// results the join accepted.
struct PlannerEnd {
    run: v1::RunState,
    turns: usize,
    refused: usize,
    plain: usize,
    finished: bool,
    accepted: usize,
    told: Vec<(usize, &'static str)>,
}

fn planner_end(persona: Persona) -> PlannerEnd {
    use v1::RunState as R;
    let finished = |turns, refused, plain, accepted, told| PlannerEnd {
        run: R::Succeeded,
        turns,
        refused,
        plain,
        finished: true,
        accepted,
        told,
    };
    match persona {
        // A delegation with the defaults applied, its result accepted, then finish.
        Persona::Minimal | Persona::Verbose | Persona::Stream => finished(2, 0, 0, 1, vec![]),
        Persona::Malformed => finished(
            3,
            1,
            0,
            1,
            vec![(2, "the arguments of delegate are not valid")],
        ),
        Persona::WrongTypes => finished(
            4,
            2,
            0,
            1,
            vec![
                (2, "invalid type: string \"15\""),
                (4, "invalid type: string \"claim-1\""),
            ],
        ),
        Persona::UnknownTool => finished(3, 1, 0, 1, vec![(2, "unknown tool \"investigate\"")]),
        Persona::MadeUpIds => finished(3, 1, 0, 1, vec![(3, "claim-made-up-42")]),
        // Three delegations at once, all accepted: the logs and the change audit
        // disagree on the cause, so the run waits for a person to settle it.
        Persona::Parallel => PlannerEnd {
            run: R::WaitingInput,
            ..finished(2, 0, 0, 3, vec![])
        },
        // The turn's two calls get ids of their own: both delegations run.
        Persona::ReusedIds => finished(2, 0, 0, 2, vec![]),
        Persona::Huge => finished(3, 0, 1, 1, vec![(2, "You answered in plain text")]),
        // Three turns in a row that start nothing: the run gives up on its planner.
        Persona::TextOnly => PlannerEnd {
            run: R::Failed,
            turns: 3,
            refused: 0,
            plain: 3,
            finished: false,
            accepted: 0,
            told: vec![
                (2, "You answered in plain text"),
                (3, "You answered in plain text"),
            ],
        },
        // The same question every round: each round's result is accepted (the join
        // counts their shared artifacts once), and the progress hash stays unchanged
        // for two rounds.
        Persona::Repeated => PlannerEnd {
            run: R::NoProgress,
            turns: 3,
            refused: 0,
            plain: 0,
            finished: false,
            accepted: 3,
            told: vec![],
        },
        Persona::Slow => PlannerEnd {
            run: R::Cancelled,
            turns: 0,
            refused: 0,
            plain: 0,
            finished: false,
            accepted: 0,
            told: vec![],
        },
    }
}

async fn check_planner(mesh: &TestMesh, model: &ScriptedModel, persona: Persona) {
    let name = persona.name();
    let run = run_to_end(mesh, model, persona, true, planner_spec(persona)).await;
    let want = planner_end(persona);
    assert_eq!(
        run.state,
        want.run as i32,
        "{name}: the planner run ends {}, not {}: {}",
        want.run.as_str_name(),
        state_name(run.state),
        run.terminal_reason
    );
    let state = run.planner.clone().unwrap_or_default();
    let requests = requests_of(model, persona, true);
    if persona == Persona::Slow {
        assert_eq!(requests.len(), 1, "{name}: asked once");
        assert!(state.turns.is_empty(), "{name}: no turn committed");
        assert!(run.delegations.is_empty(), "{name}: nothing delegated");
        slow_call_abandoned(model).await;
        return;
    }
    assert_eq!(
        state.turns.len(),
        want.turns,
        "{name}: turns: {:#?}",
        state.turns
    );
    assert_eq!(
        requests.len(),
        want.turns,
        "{name}: one request per committed turn"
    );
    let refused: Vec<&v1::PlannerCall> = state
        .turns
        .iter()
        .flat_map(|t| &t.calls)
        .filter(|c| !c.error.is_empty())
        .collect();
    assert_eq!(
        refused.len(),
        want.refused,
        "{name}: refused calls: {refused:#?}"
    );
    let plain = state.turns.iter().filter(|t| t.calls.is_empty()).count();
    assert_eq!(plain, want.plain, "{name}: plain-text turns");
    assert_eq!(state.finished, want.finished, "{name}: finished");
    for (turn, refusal) in &want.told {
        assert_told(&requests, *turn, refusal, persona);
    }
    // Every refused call's error is what the model was told, in the next request.
    for c in &refused {
        let answered = requests.iter().any(|r| {
            r.messages().iter().any(|m| {
                m["role"] == "tool"
                    && m["tool_call_id"] == c.call_id.as_str()
                    && m["content"].as_str().is_some_and(|t| {
                        serde_json::from_str::<Value>(t)
                            .is_ok_and(|v| v["error"].as_str() == Some(c.error.as_str()))
                    })
            })
        });
        assert!(
            answered,
            "{name}: the refusal of {} reached the model: {c:#?}",
            c.call_id
        );
    }
    let accepted = run.decision.as_ref().map_or(0, |d| d.accepted.len());
    assert_eq!(
        accepted, want.accepted,
        "{name}: accepted: {:#?}",
        run.decision
    );
}

type Check<'a> = Pin<Box<dyn Future<Output = ()> + 'a>>;

/// Runs `checks` concurrently and fails with every persona that failed, not just the
/// first.
async fn all(checks: Vec<(Persona, Check<'_>)>) {
    let outcomes =
        futures::future::join_all(checks.into_iter().map(|(persona, check)| async move {
            (persona, AssertUnwindSafe(check).catch_unwind().await)
        }))
        .await;
    let failed: Vec<String> = outcomes
        .into_iter()
        .filter_map(|(persona, outcome)| {
            let panic = outcome.err()?;
            let message = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| (*s).to_owned()))
                .unwrap_or_default();
            Some(format!("{}: {}", persona.name(), crate_clip(&message)))
        })
        .collect();
    assert!(
        failed.is_empty(),
        "personas failed:\n{}",
        failed.join("\n\n")
    );
}

// ---------------------------------------------------------------------------------------
// The tests.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_persona_as_a_specialists_model_ends_in_its_stated_state() {
    let model = start_model();
    let mesh = start_mesh(&model, false).await;
    all(PERSONAS
        .into_iter()
        .map(|p| (p, Box::pin(check_specialist(&mesh, &model, p)) as Check<'_>))
        .collect())
    .await;
    mesh.stop(Duration::from_secs(10)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_persona_as_a_planners_model_ends_in_its_stated_state() {
    let model = start_model();
    let mesh = start_mesh(&model, false).await;
    all(PERSONAS
        .into_iter()
        .map(|p| (p, Box::pin(check_planner(&mesh, &model, p)) as Check<'_>))
        .collect())
    .await;
    mesh.stop(Duration::from_secs(10)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_stream_persona_answers_in_server_sent_events_in_both_roles() {
    let model = start_model();
    let mesh = start_mesh(&model, true).await;
    all(vec![
        (
            Persona::Stream,
            Box::pin(check_specialist(&mesh, &model, Persona::Stream)) as Check<'_>,
        ),
        (
            Persona::Stream,
            Box::pin(check_planner(&mesh, &model, Persona::Stream)) as Check<'_>,
        ),
    ])
    .await;
    // Every request asked for a stream, with the usage.
    let requests = model.requests();
    assert_eq!(requests.len(), 4, "two specialist turns, two planner turns");
    for r in &requests {
        assert!(r.streams(), "{:?}", r.body.get("stream"));
        assert_eq!(r.body["stream_options"]["include_usage"], true);
    }
    mesh.stop(Duration::from_secs(10)).await;
}
