//! End-to-end behaviour of nested delegation: a coordinator worker calls `delegate@1`,
//! the supervisor runs its children like any delegation, and the coordinator gets their
//! outcomes back in call order — or a refusal it can act on (depth, redelegation,
//! wider scopes), and a record of what the width limit dropped.

use std::time::Duration;

use crate::harness::{
    MeshOptions, Mode, TestMesh, Workers, example_profiles, repo_root, spec_from_yaml, wait_until,
};
use convene_mesh::auth::request;
use convene_mesh::policy_file::{PolicyFile, ProfileEntry, ScopeEntry, ToolEntry};
use convene_proto::v1::{self, evidence_store_server::EvidenceStore as _, run_event::Kind};

const ONCALL: &str = "oncall@acme";
const LIMIT: Duration = Duration::from_secs(30);
pub(crate) const COORDINATOR: &str = "coordinator";
/// The coordinator's one playbook step, and so the last segment of its evidence id.
const STEP: &str = "specialists";

fn scope(action: &str, resource: &str) -> ScopeEntry {
    ScopeEntry {
        action: action.to_owned(),
        resource: resource.to_owned(),
        time_range: None,
        max_rows: None,
    }
}

/// The example policy, plus what nested delegation needs: the on-call engineer may
/// create delegations, a `coordinator` profile that may, and `delegate@1` in the catalog.
///
/// A child token can only narrow its parent's, tools included, so the coordinator's
/// policy profile holds the tools its children use (its worker profile offers only
/// `delegate@1`), and its capabilities cover its children's scopes without row limits
/// (a parent that limits rows would refuse children that do not).
pub(crate) fn nested_policy() -> String {
    let text = std::fs::read_to_string(repo_root().join("examples/payment-incident/policy.yaml"))
        .expect("the example policy exists");
    let mut file =
        PolicyFile::parse(&text, Some("yaml"), "example policy").expect("the example parses");
    file.principals
        .iter_mut()
        .find(|p| p.id == ONCALL)
        .expect("the example has the on-call engineer")
        .grants
        .push(scope("delegation:create", "delegation"));
    file.profiles.push(ProfileEntry {
        id: COORDINATOR.to_owned(),
        capabilities: vec![
            scope("logs:read", "service/*"),
            scope("metrics:read", "metric/*"),
            scope("delegation:create", "delegation"),
            scope("evidence:*", "evidence"),
        ],
        tools: ["delegate@1", "search_logs@1", "query_metrics@1"]
            .map(String::from)
            .to_vec(),
        evidence_prefixes: vec!["delegations://".to_owned()],
        investigating: false,
    });
    // Its workers register it as the worker pool.
    file.principals
        .iter_mut()
        .find(|p| p.id == "worker-pool")
        .expect("the example has the worker pool")
        .profiles
        .push(COORDINATOR.to_owned());
    file.tools.push(ToolEntry {
        name: "delegate@1".to_owned(),
        action: "delegation:create".to_owned(),
        resource: None,
        risk: "R0".to_owned(),
        description: "Hand parts of a task to specialist workers through the supervisor."
            .to_owned(),
        evidence_kinds: Vec::new(),
    });
    serde_yaml::to_string(&file).expect("the policy serializes")
}

/// The two specialists the coordinator asks for, logs first.
pub(crate) const SPECIALISTS: &str = r#"
              - name: logs
                profile_id: logs-investigator
                goal: Find the error patterns in the payment-api logs and when they began.
                scope: { resources: ["service/payment-api"] }
                required_scopes: [{ action: "logs:read", resource: "service/*" }]
              - name: metrics
                profile_id: metrics-investigator
                goal: Quantify the success-rate drop and the gateway latency.
                scope: { resources: ["metric/payment.*", "metric/gateway.*"] }
                required_scopes: [{ action: "metrics:read", resource: "metric/*" }]
"#;

/// The example profiles plus a `coordinator` whose one step delegates `children` (YAML
/// list items, indented for the step's `delegations:`), with `faults` added to the named
/// profiles (the coordinator included).
pub(crate) fn profiles(children: &str, faults: &[(&str, &str)]) -> String {
    let mut text = example_profiles();
    text.push_str(&format!(
        r#"
  - id: {COORDINATOR}
    version: "1.0.0"
    name: Coordinator
    description: Splits an investigation between specialists and reports what they found.
    instructions: Delegate to the specialists, then report their findings in call order.
    provider: playbook
    default_tools: [delegate@1]
    max_iterations: 4
    capabilities:
      - {{ action: "logs:read", resource: "service/*" }}
      - {{ action: "metrics:read", resource: "metric/*" }}
      - {{ action: "delegation:create", resource: "delegation" }}
      - {{ action: "evidence:*", resource: "evidence" }}
    evidence_prefixes: ["delegations://"]
    supports_parallel_completion: true
    playbook:
      summary: What the specialists found
      steps:
        - id: {STEP}
          tool: delegate@1
          evidence_kind: delegated_findings
          args:
            delegations:{children}
      rules:
        - step: {STEP}
          claim:
            claim_id: claim-order
            topic: delegation.order
            value: "{{outcomes.0.name}}:{{outcomes.0.status}},{{outcomes.1.name|default:none}}:{{outcomes.1.status|default:none}}"
            statement: "The specialists answered: {{outcomes.0.name}} {{outcomes.0.status}}, then {{outcomes.1.name|default:none}} {{outcomes.1.status|default:none}}"
            confidence: 1.0
        - step: {STEP}
          when: {{ path: outcomes.0.claims.1.topic, op: eq, value: primary_cause }}
          claim:
            claim_id: claim-cause
            topic: primary_cause
            value: "{{outcomes.0.claims.1.value}}"
            statement: "The {{outcomes.0.name}} specialist found: {{outcomes.0.claims.1.statement}}"
            confidence: 0.8
"#
    ));
    for (profile, f) in faults {
        let anchor = format!("  - id: {profile}\n");
        assert!(text.contains(&anchor), "profile {profile} is in the file");
        text = text.replace(&anchor, &format!("{anchor}    faults: {f}\n"));
    }
    text
}

struct Limits {
    max_depth: u32,
    max_parallel_workers: u32,
    overflow: &'static str,
    may_redelegate: bool,
    max_redelegations: u32,
    /// The run's tool-call budget (None: unlimited).
    max_tool_calls: Option<u32>,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_depth: 2,
            max_parallel_workers: 4,
            overflow: "OVERFLOW_POLICY_QUEUE",
            may_redelegate: true,
            max_redelegations: 2,
            max_tool_calls: None,
        }
    }
}

/// A run of one coordinator delegation over the incident window.
fn coordinator_spec(key: &str, limits: &Limits) -> v1::RunSpec {
    spec_from_yaml(&format!(
        r#"
goal: Assess the payment incident through a coordinator and its specialists.
idempotency_key: {key}
delegations:
  - name: {COORDINATOR}
    profile_id: {COORDINATOR}
    goal: Have the logs and metrics specialists investigate, and report their findings.
    scope:
      time_range: {{ start: "2026-07-23T01:45:00Z", end: "2026-07-23T02:10:00Z" }}
    required_scopes:
      - {{ action: "logs:read", resource: "service/*" }}
      - {{ action: "metrics:read", resource: "metric/*" }}
      - {{ action: "delegation:create", resource: "delegation" }}
    may_redelegate: {may_redelegate}
    timeout: 20s
join:
  join_id: join-nested
  strategy: JOIN_STRATEGY_ALL
  required: ["{COORDINATOR}"]
  timeout: 25s
  on_timeout: ON_TIMEOUT_EMIT_PARTIAL
limits:
  max_depth: {max_depth}
  max_parallel_workers: {max_parallel_workers}
  overflow: {overflow}
  max_redelegations: {max_redelegations}{budget}
  timeout: 30s
"#,
        may_redelegate = limits.may_redelegate,
        max_depth = limits.max_depth,
        max_parallel_workers = limits.max_parallel_workers,
        overflow = limits.overflow,
        max_redelegations = limits.max_redelegations,
        budget = limits
            .max_tool_calls
            .map_or(String::new(), |n| format!("\n  max_tool_calls: {n}")),
    ))
}

fn options(profiles: String) -> MeshOptions {
    MeshOptions {
        workers: vec![Workers {
            profiles: Some(profiles),
            count: 1,
            capacity: 16,
        }],
        policy: Some(nested_policy()),
        ..MeshOptions::default()
    }
}

/// Starts a mesh with the nested policy and `profiles`, runs the coordinator under
/// `limits`, and returns the mesh and the finished run.
async fn run_coordinator(
    mode: Mode,
    profiles: String,
    key: &str,
    limits: &Limits,
) -> (TestMesh, v1::Run) {
    let mesh = TestMesh::start(mode, options(profiles)).await;
    let run_id = mesh
        .start_run_id(ONCALL, coordinator_spec(key, limits))
        .await;
    let run = mesh.wait_terminal(ONCALL, &run_id, LIMIT).await;
    (mesh, run)
}

fn coordinator(run: &v1::Run) -> &v1::Delegation {
    run.delegations
        .iter()
        .find(|d| d.task.as_ref().is_some_and(|t| t.name == COORDINATOR))
        .expect("the coordinator is in the ledger")
}

fn task(d: &v1::Delegation) -> &v1::DelegationTask {
    d.task.as_ref().expect("a task")
}

fn result(d: &v1::Delegation) -> &v1::TaskResult {
    d.result
        .as_ref()
        .unwrap_or_else(|| panic!("{} has a result: {d:#?}", task(d).name))
}

/// The delegations a delegation asked for, in ledger order.
fn children<'a>(run: &'a v1::Run, parent: &str) -> Vec<&'a v1::Delegation> {
    run.delegations
        .iter()
        .filter(|d| task(d).parent_delegation_id == parent)
        .collect()
}

/// The coordinator's `delegate@1` output, read back from the evidence store as the
/// on-call engineer (hash re-verified on read).
async fn delegate_output(mesh: &TestMesh, coordinator: &v1::TaskResult) -> serde_json::Value {
    let evidence = coordinator
        .evidence
        .iter()
        .find(|e| e.evidence_id.starts_with("delegations://"))
        .unwrap_or_else(|| panic!("the coordinator recorded its delegation: {coordinator:#?}"));
    let artifact = mesh
        .evidence()
        .get_artifact(request(
            v1::GetArtifactRequest {
                uri: evidence.artifact_uri.clone(),
            },
            &mesh.credential(ONCALL),
        ))
        .await
        .expect("GetArtifact")
        .into_inner();
    serde_json::from_slice(&artifact.content).expect("the output is JSON")
}

/// What the coordinator's result says about its one step, whichever way it failed.
fn failure_text(result: &v1::TaskResult) -> String {
    format!(
        "{} | {} | {}",
        result.summary,
        result.error.as_ref().map_or("", |e| e.message.as_str()),
        result.missing_evidence.join(", ")
    )
}

async fn outcomes_come_back_in_call_order(mode: Mode) {
    // The first child is the slow one, so arrival order and call order differ.
    let profiles = profiles(SPECIALISTS, &[("logs-investigator", "{ delay: 400ms }")]);
    let (mesh, run) = run_coordinator(mode, profiles, "nested-order", &Limits::default()).await;

    assert_eq!(run.state, v1::RunState::Succeeded as i32, "{run:#?}");
    let parent = coordinator(&run);
    let parent_id = task(parent).delegation_id.clone();
    assert_eq!(task(parent).depth, 1);

    // The children are in the ledger, under the coordinator, one level deeper, with the
    // ids derived from (run, parent, round 0, call index).
    let kids = children(&run, &parent_id);
    let names: Vec<&str> = kids.iter().map(|d| task(d).name.as_str()).collect();
    assert_eq!(names, ["logs", "metrics"], "{run:#?}");
    for (i, child) in kids.iter().enumerate() {
        let t = task(child);
        assert_eq!(t.depth, 2);
        assert_eq!(
            t.delegation_id,
            convene_core::ids::delegation_id(&run.run_id, Some(&parent_id), 0, i as u32),
            "child {i} has the deterministic id"
        );
        assert_eq!(child.state, v1::DelegationState::Completed as i32);
        assert_eq!(result(child).status, v1::TaskStatus::Completed as i32);
    }
    let finished = |d: &v1::Delegation| {
        let t = d.completed_at.expect("completed");
        (t.seconds, t.nanos)
    };
    assert!(
        finished(kids[0]) > finished(kids[1]),
        "the first child finished last: {kids:#?}"
    );

    // The coordinator got them back in call order, not in arrival order.
    let coordinator_result = result(parent);
    assert_eq!(
        coordinator_result.status,
        v1::TaskStatus::Completed as i32,
        "{coordinator_result:#?}"
    );
    let claim = |topic: &str| {
        coordinator_result
            .claims
            .iter()
            .find(|c| c.topic == topic)
            .unwrap_or_else(|| panic!("no claim on {topic}: {coordinator_result:#?}"))
    };
    assert_eq!(
        claim("delegation.order").value,
        "logs:COMPLETED,metrics:COMPLETED"
    );
    assert_eq!(claim("primary_cause").value, "connection_pool_exhaustion");
    let evidence_id = format!("delegations://run/{}/{parent_id}/{STEP}", run.run_id);
    assert_eq!(claim("primary_cause").evidence_refs, [evidence_id]);
    let output = delegate_output(&mesh, coordinator_result).await;
    let outcomes = output["outcomes"].as_array().expect("outcomes");
    let ids: Vec<&str> = outcomes
        .iter()
        .map(|o| o["delegation_id"].as_str().expect("an id"))
        .collect();
    assert_eq!(
        ids,
        kids.iter()
            .map(|d| task(d).delegation_id.as_str())
            .collect::<Vec<_>>()
    );
    assert_eq!(output["answered"], 2);
    assert_eq!(
        outcomes[1]["claims"][0]["topic"], "impact.success_rate",
        "{output:#}"
    );

    // The join covers the top-level plan only: the coordinator, not its children.
    let decision = run.decision.as_ref().expect("a decision");
    assert_eq!(decision.accepted, [parent_id]);
    assert!(decision.rejected.is_empty(), "{decision:#?}");
    assert!(decision.missing_required.is_empty(), "{decision:#?}");

    // The children were dispatched like any delegation, at depth 2.
    let events = mesh.run_events(ONCALL, &run.run_id).await;
    let mut dispatched: Vec<(String, u32)> = events
        .iter()
        .filter_map(|e| match &e.kind {
            Some(Kind::Dispatched(d)) => Some((d.name.clone(), d.depth)),
            _ => None,
        })
        .collect();
    dispatched.sort();
    assert_eq!(
        dispatched,
        [
            (COORDINATOR.to_owned(), 1),
            ("logs".to_owned(), 2),
            ("metrics".to_owned(), 2)
        ]
    );
    if mode == Mode::InProcess {
        owner_ends(&mesh).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn children_results_come_back_in_call_order_in_one_process() {
    outcomes_come_back_in_call_order(Mode::InProcess).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn children_results_come_back_in_call_order_as_processes() {
    outcomes_come_back_in_call_order(Mode::Processes).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delegating_past_max_depth_tells_the_coordinator_to_handle_it_itself() {
    let limits = Limits {
        max_depth: 1,
        ..Limits::default()
    };
    let (mesh, run) = run_coordinator(
        Mode::InProcess,
        profiles(SPECIALISTS, &[]),
        "nested-depth",
        &limits,
    )
    .await;
    assert_eq!(run.delegations.len(), 1, "no child was created: {run:#?}");
    let r = result(coordinator(&run));
    assert_eq!(r.status, v1::TaskStatus::Failed as i32, "{r:#?}");
    assert!(r.claims.is_empty());
    assert_eq!(r.missing_evidence, [STEP]);
    let text = failure_text(r);
    assert!(text.contains("FAILED_PRECONDITION"), "{text}");
    assert!(
        text.contains("delegation depth 2 exceeds max_depth 1"),
        "{text}"
    );
    assert!(
        text.contains("handle this task yourself instead of delegating"),
        "{text}"
    );
    assert_eq!(run.state, v1::RunState::Failed as i32, "{run:#?}");
    owner_ends(&mesh).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delegating_back_to_a_profile_with_the_same_goal_is_refused_as_a_loop() {
    // The coordinator asks for another coordinator with its own goal (written
    // differently): A → A, which would repeat forever whatever max_depth allows.
    let looping = format!(
        r#"
              - name: again
                profile_id: {COORDINATOR}
                goal: "have the LOGS and metrics specialists investigate,   and report their findings."
                scope: {{ resources: ["service/payment-api"] }}
                required_scopes: [{{ action: "logs:read", resource: "service/*" }}]
"#
    );
    let limits = Limits {
        max_depth: 3,
        ..Limits::default()
    };
    let (mesh, run) = run_coordinator(
        Mode::InProcess,
        profiles(&looping, &[]),
        "nested-loop",
        &limits,
    )
    .await;
    assert_eq!(run.delegations.len(), 1, "no child was created: {run:#?}");
    let r = result(coordinator(&run));
    assert_eq!(r.status, v1::TaskStatus::Failed as i32, "{r:#?}");
    let text = failure_text(r);
    assert!(text.contains("FAILED_PRECONDITION"), "{text}");
    assert!(text.contains("would loop"), "{text}");
    assert!(text.contains("handle this task yourself"), "{text}");
    owner_ends(&mesh).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_without_may_redelegate_cannot_delegate() {
    let limits = Limits {
        may_redelegate: false,
        ..Limits::default()
    };
    let (mesh, run) = run_coordinator(
        Mode::InProcess,
        profiles(SPECIALISTS, &[]),
        "nested-no-redelegate",
        &limits,
    )
    .await;
    assert_eq!(run.delegations.len(), 1, "no child was created: {run:#?}");
    let r = result(coordinator(&run));
    // A permission refusal: the coordinator's only call was denied, so it is blocked.
    assert_eq!(r.status, v1::TaskStatus::Blocked as i32, "{r:#?}");
    let text = failure_text(r);
    assert!(text.contains("PERMISSION_DENIED"), "{text}");
    assert!(text.contains("does not allow redelegation"), "{text}");
    owner_ends(&mesh).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_child_cannot_ask_for_more_than_its_parent_holds() {
    // The coordinator holds logs and metrics; the change audit needs changes:read.
    let greedy = r#"
              - name: logs
                profile_id: logs-investigator
                goal: Find the error patterns in the payment-api logs.
                required_scopes: [{ action: "logs:read", resource: "service/*" }]
              - name: changes
                profile_id: change-auditor
                goal: List the changes made in the window.
                allowed_tools: [list_changes@1]
                required_scopes: [{ action: "changes:read", resource: "change/*" }]
"#;
    let (mesh, run) = run_coordinator(
        Mode::InProcess,
        profiles(greedy, &[]),
        "nested-wider",
        &Limits::default(),
    )
    .await;
    assert_eq!(
        run.delegations.len(),
        1,
        "the call is refused as a whole: no child was created: {run:#?}"
    );
    let r = result(coordinator(&run));
    assert_eq!(r.status, v1::TaskStatus::Blocked as i32, "{r:#?}");
    let text = failure_text(r);
    assert!(text.contains("PERMISSION_DENIED"), "{text}");
    assert!(
        text.contains("changes:read"),
        "the refusal names the scope: {text}"
    );
    assert!(text.contains("wider than the parent token"), "{text}");
    owner_ends(&mesh).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn truncate_overflow_in_a_nested_call_drops_the_extra_children() {
    let limits = Limits {
        max_parallel_workers: 1,
        overflow: "OVERFLOW_POLICY_TRUNCATE",
        ..Limits::default()
    };
    let (mesh, run) = run_coordinator(
        Mode::InProcess,
        profiles(SPECIALISTS, &[]),
        "nested-truncate",
        &limits,
    )
    .await;
    let parent = coordinator(&run);
    let parent_id = task(parent).delegation_id.clone();
    let kids = children(&run, &parent_id);
    assert_eq!(
        kids.iter()
            .map(|d| task(d).name.as_str())
            .collect::<Vec<_>>(),
        ["logs"],
        "only the first child ran: {run:#?}"
    );
    assert_eq!(run.truncated, ["metrics"], "{run:#?}");

    let r = result(parent);
    assert_eq!(r.status, v1::TaskStatus::Completed as i32, "{r:#?}");
    let order = r
        .claims
        .iter()
        .find(|c| c.topic == "delegation.order")
        .expect("the order claim");
    assert_eq!(order.value, "logs:COMPLETED,metrics:DROPPED");
    let output = delegate_output(&mesh, r).await;
    assert_eq!(output["dropped"], 1, "{output:#}");
    assert_eq!(output["outcomes"][0]["dropped"], false);
    assert_eq!(output["outcomes"][1]["name"], "metrics");
    assert_eq!(output["outcomes"][1]["dropped"], true);
    assert_eq!(output["outcomes"][1]["delegation_id"], "");
    assert_eq!(output["outcomes"][1]["error"]["code"], "truncated");
    // Cut short by a limit: the evidence says so.
    let evidence = r
        .evidence
        .iter()
        .find(|e| e.evidence_id.starts_with("delegations://"))
        .expect("delegation evidence");
    assert_eq!(evidence.quality, v1::EvidenceQuality::Degraded as i32);
    owner_ends(&mesh).await;
}

/// Waits until the run's owner has ended in the in-process supervisor: every Delegate
/// call of the run was answered and nothing of it is in flight.
async fn owner_ends(mesh: &TestMesh) {
    wait_until(
        "the run's owner to end (every Delegate call answered)",
        Duration::from_secs(10),
        async || mesh.supervisor_service().live_runs() == 0,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retried_coordinator_gets_the_children_it_already_created() {
    // The coordinator's first attempt delegates, then fails transiently; the retry
    // repeats the call and must find the same two children rather than create two more.
    let profiles = profiles(
        SPECIALISTS,
        &[(COORDINATOR, "{ fail_attempts_after_tools: 1 }")],
    );
    let (mesh, run) = run_coordinator(
        Mode::InProcess,
        profiles,
        "nested-retry",
        &Limits::default(),
    )
    .await;
    assert_eq!(run.state, v1::RunState::Succeeded as i32, "{run:#?}");
    let parent = coordinator(&run);
    assert_eq!(parent.attempts, 2, "{parent:#?}");
    let parent_id = task(parent).delegation_id.clone();
    let kids = children(&run, &parent_id);
    assert_eq!(
        kids.iter()
            .map(|d| task(d).name.as_str())
            .collect::<Vec<_>>(),
        ["logs", "metrics"],
        "the retry created no further children: {run:#?}"
    );
    for (i, child) in kids.iter().enumerate() {
        assert_eq!(
            task(child).delegation_id,
            convene_core::ids::delegation_id(&run.run_id, Some(&parent_id), 0, i as u32)
        );
    }
    let r = result(parent);
    assert_eq!(r.status, v1::TaskStatus::Completed as i32, "{r:#?}");
    let order = r
        .claims
        .iter()
        .find(|c| c.topic == "delegation.order")
        .expect("the order claim");
    assert_eq!(order.value, "logs:COMPLETED,metrics:COMPLETED");

    // Each child ran once; the coordinator was dispatched twice.
    let events = mesh.run_events(ONCALL, &run.run_id).await;
    let dispatches = |name: &str| {
        events
            .iter()
            .filter(|e| matches!(&e.kind, Some(Kind::Dispatched(d)) if d.name == name))
            .count()
    };
    assert_eq!(dispatches(COORDINATOR), 2);
    assert_eq!(dispatches("logs"), 1);
    assert_eq!(dispatches("metrics"), 1);
    owner_ends(&mesh).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exhausted_budget_answers_for_the_children_that_never_started() {
    // One child at a time, and a budget the first child's two tool calls use up: the
    // budget is charged before the first child's slot frees up, so neither the second
    // nor the third starts. The coordinator learns so at once instead of waiting for
    // them until its own deadline.
    let three = format!(
        "{SPECIALISTS}{}",
        r#"              - name: logs-again
                profile_id: logs-investigator
                goal: Look at the payment-api logs once more.
                scope: { resources: ["service/payment-api"] }
                required_scopes: [{ action: "logs:read", resource: "service/*" }]
"#
    );
    let limits = Limits {
        max_parallel_workers: 1,
        max_tool_calls: Some(2),
        ..Limits::default()
    };
    let (mesh, run) = run_coordinator(
        Mode::InProcess,
        profiles(&three, &[]),
        "nested-budget",
        &limits,
    )
    .await;
    let parent = coordinator(&run);
    let r = result(parent);
    assert_eq!(r.status, v1::TaskStatus::Completed as i32, "{r:#?}");
    let output = delegate_output(&mesh, r).await;
    let statuses: Vec<&str> = output["outcomes"]
        .as_array()
        .expect("outcomes")
        .iter()
        .map(|o| o["status"].as_str().expect("a status"))
        .collect();
    assert_eq!(
        statuses,
        ["COMPLETED", "NO_RESULT", "NO_RESULT"],
        "{output:#}"
    );
    for i in [1, 2] {
        let message = output["outcomes"][i]["error"]["message"]
            .as_str()
            .expect("why the child has no result");
        assert!(message.contains("budget is exhausted"), "{message}");
        assert!(message.contains("max_tool_calls"), "{message}");
    }
    for unstarted in &children(&run, &task(parent).delegation_id)[1..] {
        assert_eq!(unstarted.state, v1::DelegationState::Cancelled as i32);
        assert!(
            unstarted.dispatched_at.is_none(),
            "it never started: {unstarted:#?}"
        );
    }
    owner_ends(&mesh).await;
}
