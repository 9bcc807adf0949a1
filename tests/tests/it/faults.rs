//! Faults through the real services, every service its own process: a worker's answer
//! lost on the way back, a coordinator asking for more than the run's limits admit, a
//! delegation loop through two delegating profiles, and artifact bytes changed in
//! storage before the join looks at them.
//!
//! (A worker that times out, a result that breaks the contract and an action that lacks
//! its approvals are covered by `runs/` and `waiting/`.)

use std::path::Path;
use std::time::Duration;

use crate::harness::{MeshOptions, Mode, TestMesh, Workers, example_profiles, example_spec};
use crate::harness::{spec_from_yaml, wait_for};
use crate::nested::{COORDINATOR, SPECIALISTS, nested_policy, profiles as coordinator_profiles};
use convene_mesh::auth::request;
use convene_mesh::policy_file::{PolicyFile, ProfileEntry};
use convene_proto::v1::{self, evidence_store_server::EvidenceStore as _, run_event::Kind};

const ONCALL: &str = "oncall@acme";
/// Generous: every service is a process of its own on a machine that may be loaded.
const LIMIT: Duration = Duration::from_secs(60);

// ---- shared lookups -----------------------------------------------------------------

fn task(d: &v1::Delegation) -> &v1::DelegationTask {
    d.task.as_ref().expect("a task")
}

/// The delegation named `name` (the first, in ledger order).
fn named<'a>(run: &'a v1::Run, name: &str) -> &'a v1::Delegation {
    run.delegations
        .iter()
        .find(|d| task(d).name == name)
        .unwrap_or_else(|| panic!("no delegation {name}: {run:#?}"))
}

fn result_of(d: &v1::Delegation) -> &v1::TaskResult {
    d.result
        .as_ref()
        .unwrap_or_else(|| panic!("{} has a result: {d:#?}", task(d).name))
}

/// What a result says about how it ended, whichever field says it.
fn failure_text(result: &v1::TaskResult) -> String {
    format!(
        "{} | {}",
        result.summary,
        result.error.as_ref().map_or("", |e| e.message.as_str()),
    )
}

fn decision(run: &v1::Run) -> &v1::JoinDecision {
    run.decision
        .as_ref()
        .unwrap_or_else(|| panic!("the run has a decision: {run:#?}"))
}

fn accepted_times(run: &v1::Run, delegation_id: &str) -> usize {
    decision(run)
        .accepted
        .iter()
        .filter(|id| *id == delegation_id)
        .count()
}

/// The example profiles with `section` (a YAML line, e.g. `faults: {...}`) added to the
/// named profiles.
fn example_with(sections: &[(&str, String)]) -> String {
    let mut text = example_profiles();
    for (profile, section) in sections {
        let anchor = format!("  - id: {profile}\n");
        assert!(
            text.contains(&anchor),
            "profile {profile} is in the example"
        );
        text = text.replace(&anchor, &format!("{anchor}    {section}\n"));
    }
    text
}

fn one_worker(profiles: String, policy: Option<String>) -> MeshOptions {
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

/// The `delegate@1` output a delegating result recorded, read back from the evidence
/// store (hash re-verified on read).
async fn delegate_output(mesh: &TestMesh, result: &v1::TaskResult) -> serde_json::Value {
    let evidence = result
        .evidence
        .iter()
        .find(|e| e.evidence_id.starts_with("delegations://"))
        .unwrap_or_else(|| panic!("the result recorded its delegation: {result:#?}"));
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

/// The authorization decisions the policy service logged for `delegation_id` (its
/// decision log, JSON lines in its data directory, each on disk before it answered).
fn authorizations(mesh: &TestMesh, delegation_id: &str) -> Vec<serde_json::Value> {
    let path = mesh.data_dir().join("policy").join("decisions.jsonl");
    std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("the decision log {} is read: {e}", path.display()))
        .lines()
        .map(|line| serde_json::from_str::<serde_json::Value>(line).expect("a JSON record"))
        .filter(|d| d["kind"] == "authorize" && d["delegation_id"] == delegation_id)
        .collect()
}

// ---- 1. a worker's answer lost on the way back -----------------------------------------

/// The logs investigator finishes its task, but the answer to its first Execute call
/// never reaches the supervisor (the call fails as a dropped connection does). The
/// supervisor dispatches the delegation again under the same id; the worker answers
/// from its result cache, without running its tools again, and the join takes that one
/// result once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_worker_answer_is_dispatched_again_and_its_result_counts_once() {
    let mut options = one_worker(
        example_with(&[(
            "logs-investigator",
            "faults: { lose_response_attempts: 1 }".to_owned(),
        )]),
        None,
    );
    // A worker the lost call marked dead comes back with its next heartbeat.
    options.supervisor_env = vec![("CONVENE_HEARTBEAT_INTERVAL".into(), "200ms".into())];
    let mesh = TestMesh::start(Mode::Processes, options).await;
    let mut spec = example_spec();
    spec.idempotency_key = "fault-lost-answer".to_owned();
    let run_id = mesh.start_run_id(ONCALL, spec).await;
    let run = mesh.wait_terminal(ONCALL, &run_id, LIMIT).await;

    let logs = named(&run, "logs");
    let logs_id = task(logs).delegation_id.clone();
    assert_eq!(
        logs.attempts, 2,
        "dispatched again after the lost answer: {logs:#?}"
    );
    assert_eq!(
        logs.state,
        v1::DelegationState::Completed as i32,
        "{logs:#?}"
    );
    let result = result_of(logs);
    assert_eq!(
        result.status,
        v1::TaskStatus::Completed as i32,
        "{result:#?}"
    );
    assert_eq!(result.worker_id, "worker-1");

    // Two dispatches of one delegation id to the one worker; every other delegation once.
    let events = mesh.run_events(ONCALL, &run_id).await;
    let dispatched: Vec<(&str, &str, u32)> = events
        .iter()
        .filter_map(|e| match &e.kind {
            Some(Kind::Dispatched(d)) if d.delegation_id == logs_id => {
                Some((d.delegation_id.as_str(), d.worker_id.as_str(), d.attempt))
            }
            _ => None,
        })
        .collect();
    assert_eq!(
        dispatched,
        [
            (logs_id.as_str(), "worker-1", 1),
            (logs_id.as_str(), "worker-1", 2)
        ]
    );
    for name in ["metrics", "changes"] {
        assert_eq!(named(&run, name).attempts, 1, "{name} ran once");
    }
    let completed = events
        .iter()
        .filter(|e| matches!(&e.kind, Some(Kind::Completed(c)) if c.delegation_id == logs_id))
        .count();
    assert_eq!(completed, 1, "one completion of logs: {events:#?}");

    // The lost answer never reached the supervisor: the join's input holds the one
    // result that did, and the decision lists the delegation once.
    let received: Vec<&v1::TaskResult> = run
        .received
        .iter()
        .filter(|r| r.delegation_id == logs_id)
        .collect();
    assert_eq!(received, [result], "{:#?}", run.received);
    assert_eq!(accepted_times(&run, &logs_id), 1, "{:#?}", run.decision);
    assert!(
        decision(&run)
            .rejected
            .iter()
            .all(|r| r.delegation_id != logs_id),
        "{:#?}",
        run.decision
    );
    // The run decides as it does without the fault.
    assert_eq!(
        decision(&run).outcome,
        v1::JoinOutcome::ConflictRequiresHuman as i32,
        "{:#?}",
        run.decision
    );
    assert_eq!(run.state, v1::RunState::WaitingInput as i32);

    // The second attempt was answered from the worker's result cache: the investigator's
    // two tool calls were authorized once each, by the first attempt.
    let calls = authorizations(&mesh, &logs_id);
    assert_eq!(calls.len(), 2, "{calls:#?}");
    assert!(calls.iter().all(|d| d["allowed"] == true), "{calls:#?}");
    assert_eq!(
        result.usage.as_ref().map(|u| u.tool_calls),
        Some(2),
        "{result:#?}"
    );
}

// ---- 2. more than the run's limits admit -------------------------------------------

/// A run of one coordinator delegation whose one step delegates the coordinator's
/// `children`, under the YAML `limits` (the run's timeout is added).
fn coordinator_spec(key: &str, goal: &str, limits: &str) -> v1::RunSpec {
    spec_from_yaml(&format!(
        r#"
goal: Assess the payment incident through delegating workers.
idempotency_key: {key}
delegations:
  - name: {COORDINATOR}
    profile_id: {COORDINATOR}
    goal: "{goal}"
    scope:
      time_range: {{ start: "2026-07-23T01:45:00Z", end: "2026-07-23T02:10:00Z" }}
    required_scopes:
      - {{ action: "logs:read", resource: "service/*" }}
      - {{ action: "metrics:read", resource: "metric/*" }}
      - {{ action: "delegation:create", resource: "delegation" }}
    may_redelegate: true
    timeout: 30s
join:
  join_id: join-faults
  strategy: JOIN_STRATEGY_ALL
  required: ["{COORDINATOR}"]
  timeout: 40s
  on_timeout: ON_TIMEOUT_EMIT_PARTIAL
limits:
{limits}
  timeout: 50s
"#
    ))
}

/// The coordinator's goal in the limit runs.
const INVESTIGATE: &str =
    "Have the logs and metrics specialists investigate, and report their findings.";

/// The supervisor refuses every delegation past the run's limits, whoever asks: a batch
/// wider than `max_parallel_workers` under REJECT, a child deeper than `max_depth`, and
/// children that would start after the tool-call budget is spent. Nothing past a limit
/// is created or dispatched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_coordinator_cannot_delegate_past_the_runs_limits() {
    // Three children: the two specialists and the logs specialist once more.
    let three = format!(
        "{SPECIALISTS}{}",
        r#"              - name: logs-again
                profile_id: logs-investigator
                goal: Look at the payment-api logs once more.
                scope: { resources: ["service/payment-api"] }
                required_scopes: [{ action: "logs:read", resource: "service/*" }]
"#
    );
    let mesh = TestMesh::start(
        Mode::Processes,
        one_worker(coordinator_profiles(&three, &[]), Some(nested_policy())),
    )
    .await;

    // Width: three children at once where one is admitted and overflow is REJECT.
    let run_id = mesh
        .start_run_id(
            ONCALL,
            coordinator_spec(
                "fault-too-wide",
                INVESTIGATE,
                "  max_depth: 2\n  max_parallel_workers: 1\n  overflow: OVERFLOW_POLICY_REJECT",
            ),
        )
        .await;
    let run = mesh.wait_terminal(ONCALL, &run_id, LIMIT).await;
    assert_eq!(run.delegations.len(), 1, "no child was created: {run:#?}");
    let r = result_of(named(&run, COORDINATOR));
    assert_eq!(r.status, v1::TaskStatus::Failed as i32, "{r:#?}");
    assert!(r.claims.is_empty(), "{r:#?}");
    let text = failure_text(r);
    assert!(text.contains("RESOURCE_EXHAUSTED"), "{text}");
    assert!(
        text.contains("a batch of 3 delegations exceeds max_parallel_workers 1"),
        "{text}"
    );
    assert!(text.contains("overflow is REJECT"), "{text}");
    assert_eq!(run.state, v1::RunState::Failed as i32, "{run:#?}");

    // Depth: the coordinator is at depth 1, the run admits no deeper delegation.
    let run_id = mesh
        .start_run_id(
            ONCALL,
            coordinator_spec(
                "fault-too-deep",
                INVESTIGATE,
                "  max_depth: 1\n  max_parallel_workers: 4",
            ),
        )
        .await;
    let run = mesh.wait_terminal(ONCALL, &run_id, LIMIT).await;
    assert_eq!(run.delegations.len(), 1, "no child was created: {run:#?}");
    let r = result_of(named(&run, COORDINATOR));
    assert_eq!(r.status, v1::TaskStatus::Failed as i32, "{r:#?}");
    let text = failure_text(r);
    assert!(text.contains("FAILED_PRECONDITION"), "{text}");
    assert!(
        text.contains("delegation depth 2 exceeds max_depth 1"),
        "{text}"
    );
    assert_eq!(run.state, v1::RunState::Failed as i32, "{run:#?}");

    // Budget: one child at a time under a budget of two tool calls, which the first
    // child's two calls spend; the other two never start.
    let run_id = mesh
        .start_run_id(
            ONCALL,
            coordinator_spec(
                "fault-over-budget",
                INVESTIGATE,
                "  max_depth: 2\n  max_parallel_workers: 1\n  overflow: OVERFLOW_POLICY_QUEUE\n  max_tool_calls: 2",
            ),
        )
        .await;
    let run = mesh.wait_terminal(ONCALL, &run_id, LIMIT).await;
    let parent = named(&run, COORDINATOR);
    let output = delegate_output(&mesh, result_of(parent)).await;
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
    let children: Vec<&v1::Delegation> = run
        .delegations
        .iter()
        .filter(|d| task(d).parent_delegation_id == task(parent).delegation_id)
        .collect();
    assert_eq!(children.len(), 3, "{run:#?}");
    for unstarted in &children[1..] {
        assert_eq!(unstarted.state, v1::DelegationState::Cancelled as i32);
        assert_eq!(unstarted.attempts, 0, "never dispatched: {unstarted:#?}");
        assert!(unstarted.result.is_none(), "{unstarted:#?}");
    }
    let events = mesh.run_events(ONCALL, &run_id).await;
    let dispatched = events
        .iter()
        .filter(|e| matches!(&e.kind, Some(Kind::Dispatched(_))))
        .count();
    assert_eq!(
        dispatched, 2,
        "the coordinator and its first child: {events:#?}"
    );
}

// ---- 3. a delegation loop through two delegating profiles --------------------------------

/// A second delegating profile: it hands its task on to the coordinator.
const RELAY: &str = "relay";
/// The goal the relay gives the coordinator it delegates to.
const RELAYED_GOAL: &str = "Investigate the payment incident and report what you find.";
/// The goal the coordinator gives the relay.
const RELAY_GOAL: &str = "Pass the investigation on and report what comes back.";

/// What a delegating child needs: the coordinator's scopes, and leave to delegate.
const DELEGATING_SCOPES: &str = r#"[{ action: "logs:read", resource: "service/*" }, { action: "metrics:read", resource: "metric/*" }, { action: "delegation:create", resource: "delegation" }]"#;

/// The nested-delegation policy plus the relay, holding what the coordinator holds (a
/// child token only narrows its parent's, so either may delegate to the other).
fn loop_policy() -> String {
    let mut file = PolicyFile::parse(&nested_policy(), Some("yaml"), "nested policy")
        .expect("the nested policy parses");
    let coordinator = file
        .profiles
        .iter()
        .find(|p| p.id == COORDINATOR)
        .expect("the coordinator's policy profile")
        .clone();
    file.profiles.push(ProfileEntry {
        id: RELAY.to_owned(),
        ..coordinator
    });
    // Its workers register it as the worker pool.
    file.principals
        .iter_mut()
        .find(|p| p.id == "worker-pool")
        .expect("the example has the worker pool")
        .profiles
        .push(RELAY.to_owned());
    serde_yaml::to_string(&file).expect("the policy serializes")
}

/// The coordinator delegating to the relay, and the relay delegating back to the
/// coordinator with [`RELAYED_GOAL`]: A → B → A, and on.
fn loop_profiles() -> String {
    let to_relay = format!(
        r#"
              - name: {RELAY}
                profile_id: {RELAY}
                goal: {RELAY_GOAL}
                required_scopes: {DELEGATING_SCOPES}
                may_redelegate: true
"#
    );
    let mut text = coordinator_profiles(&to_relay, &[]);
    text.push_str(&format!(
        r#"
  - id: {RELAY}
    version: "1.0.0"
    name: Relay
    description: Hands its task on to the coordinator and reports what came back.
    instructions: Delegate the task to the coordinator, then report its outcome.
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
      summary: What the coordinator found
      steps:
        - id: hand-on
          tool: delegate@1
          evidence_kind: delegated_findings
          args:
            delegations:
              - name: back
                profile_id: {COORDINATOR}
                goal: {RELAYED_GOAL}
                required_scopes: {DELEGATING_SCOPES}
                may_redelegate: true
      rules:
        - step: hand-on
          claim:
            claim_id: claim-relayed
            topic: delegation.relayed
            value: "{{outcomes.0.name}}:{{outcomes.0.status}}"
            statement: "The coordinator answered {{outcomes.0.status}}"
            confidence: 1.0
"#
    ));
    text
}

/// The delegation chain of a run, from the top, by profile: each delegation's one child.
fn chain(run: &v1::Run) -> Vec<(String, u32)> {
    let mut out = Vec::new();
    let mut parent = String::new();
    while let Some(d) = run
        .delegations
        .iter()
        .find(|d| task(d).parent_delegation_id == parent)
    {
        out.push((task(d).profile_id.clone(), task(d).depth));
        parent.clone_from(&task(d).delegation_id);
    }
    out
}

/// The coordinator (A) delegates to the relay (B), which delegates back to the
/// coordinator. With the goal the top-level coordinator already runs, A → B → A is
/// refused as a loop, well within `max_depth`. With another goal at the top, the
/// second A is let through (the loop rule compares profile *and* goal): the cycle is
/// stopped one hop later, when B would run again with the goal it has on the path.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delegation_loop_through_two_profiles_is_refused() {
    let mesh = TestMesh::start(
        Mode::Processes,
        one_worker(loop_profiles(), Some(loop_policy())),
    )
    .await;
    let limits = "  max_depth: 4\n  max_parallel_workers: 4";

    // A → B → A, A with its own goal again.
    let run_id = mesh
        .start_run_id(ONCALL, coordinator_spec("fault-loop", RELAYED_GOAL, limits))
        .await;
    let run = mesh.wait_terminal(ONCALL, &run_id, LIMIT).await;
    assert_eq!(
        chain(&run),
        [(COORDINATOR.to_owned(), 1), (RELAY.to_owned(), 2)],
        "the second coordinator was never created: {run:#?}"
    );
    let relay = result_of(named(&run, RELAY));
    assert_eq!(relay.status, v1::TaskStatus::Failed as i32, "{relay:#?}");
    assert!(relay.claims.is_empty(), "{relay:#?}");
    let text = failure_text(relay);
    assert!(text.contains("FAILED_PRECONDITION"), "{text}");
    assert!(
        text.contains(&format!(
            "delegating to {COORDINATOR} with this goal would loop: {COORDINATOR} → {RELAY} \
             already holds {COORDINATOR} with the same goal"
        )),
        "{text}"
    );
    // The coordinator learned that its relay failed, and reported so.
    let top = named(&run, COORDINATOR);
    let order = result_of(top)
        .claims
        .iter()
        .find(|c| c.topic == "delegation.order")
        .unwrap_or_else(|| panic!("the order claim: {top:#?}"));
    assert_eq!(order.value, format!("{RELAY}:FAILED,none:none"));
    assert_eq!(accepted_times(&run, &task(top).delegation_id), 1);
    assert_eq!(run.state, v1::RunState::Succeeded as i32, "{run:#?}");

    // A → B → A with another goal at the top: the second A runs; its own call, B with
    // B's goal again, is the loop.
    let run_id = mesh
        .start_run_id(
            ONCALL,
            coordinator_spec("fault-loop-reworded", INVESTIGATE, limits),
        )
        .await;
    let run = mesh.wait_terminal(ONCALL, &run_id, LIMIT).await;
    assert_eq!(
        chain(&run),
        [
            (COORDINATOR.to_owned(), 1),
            (RELAY.to_owned(), 2),
            (COORDINATOR.to_owned(), 3)
        ],
        "{run:#?}"
    );
    let inner = run
        .delegations
        .iter()
        .find(|d| task(d).depth == 3)
        .expect("the second coordinator");
    let r = result_of(inner);
    assert_eq!(r.status, v1::TaskStatus::Failed as i32, "{r:#?}");
    let text = failure_text(r);
    assert!(
        text.contains(&format!(
            "delegating to {RELAY} with this goal would loop: {COORDINATOR} → {RELAY} → \
             {COORDINATOR} already holds {RELAY} with the same goal"
        )),
        "{text}"
    );
    assert!(
        run.delegations.iter().all(|d| task(d).depth <= 3),
        "nothing ran at depth 4, which max_depth admits: {run:#?}"
    );
}

// ---- 4. artifact bytes changed in storage before the join ------------------------------

/// Where the evidence store keeps an artifact's bytes on the file system.
fn artifact_path(data_dir: &Path, uri: &str) -> std::path::PathBuf {
    let rest = uri
        .strip_prefix("artifact://")
        .unwrap_or_else(|| panic!("{uri} is an artifact URI"));
    let (tenant, sha256) = rest.rsplit_once('/').expect("artifact://<tenant>/<sha256>");
    data_dir.join("artifacts").join(tenant).join(sha256)
}

/// The logs investigator stores its evidence and reports; while the join waits for the
/// change auditor (held at its start), the bytes of one artifact logs cites are
/// replaced on disk. Then the auditor goes on and the join decides: its siblings are
/// accepted, the evidence store refuses the changed bytes whenever it reads them, and
/// the join rejects the logs result as HASH_MISMATCH.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_artifact_changed_in_storage_before_the_join_fails_its_result_and_only_it() {
    let hold = tempfile::tempdir().expect("a temporary directory");
    let release = hold.path().join("release");
    let mesh = TestMesh::start(
        Mode::Processes,
        one_worker(
            example_with(&[(
                "change-auditor",
                format!("hold: {{ release: {} }}", release.display()),
            )]),
            None,
        ),
    )
    .await;
    let mut spec = example_spec();
    spec.idempotency_key = "fault-artifact-changed".to_owned();
    let run_id = mesh.start_run_id(ONCALL, spec).await;

    // The logs and metrics results are in; the join waits for the held auditor.
    let logs = wait_for("the logs and metrics results", LIMIT, async || {
        let run = mesh.get_run(ONCALL, &run_id).await;
        let done = |name: &str| {
            run.delegations
                .iter()
                .any(|d| task(d).name == name && d.result.is_some())
        };
        if done("logs") && done("metrics") && run.decision.is_none() {
            Ok(result_of(named(&run, "logs")).clone())
        } else {
            Err(run)
        }
    })
    .await;
    let cited = logs
        .claims
        .iter()
        .find(|c| c.topic == "primary_cause")
        .and_then(|c| c.evidence_refs.first())
        .expect("the logs cause claim cites evidence")
        .clone();
    let evidence = logs
        .evidence
        .iter()
        .find(|e| e.evidence_id == cited)
        .expect("the cited evidence is in the result");
    let path = artifact_path(&mesh.data_dir(), &evidence.artifact_uri);
    let original = std::fs::read(&path)
        .unwrap_or_else(|e| panic!("the artifact's bytes are at {}: {e}", path.display()));
    let mut replaced = original.clone();
    replaced.extend_from_slice(b"\n{\"pool\":\"forged\"}");
    std::fs::write(&path, &replaced).expect("the artifact's bytes are replaced");

    std::fs::write(&release, b"").expect("the auditor is released");
    let run = mesh.wait_terminal(ONCALL, &run_id, LIMIT).await;
    let logs_id = task(named(&run, "logs")).delegation_id.clone();
    let d = decision(&run);
    for sibling in ["metrics", "changes"] {
        let id = &task(named(&run, sibling)).delegation_id;
        assert_eq!(accepted_times(&run, id), 1, "{sibling} is accepted: {d:#?}");
    }

    // The evidence store sees the change whenever it reads the bytes: it refuses to
    // serve them, and a verification that re-hashes reports the artifact corrupted.
    let read = mesh
        .evidence()
        .get_artifact(request(
            v1::GetArtifactRequest {
                uri: evidence.artifact_uri.clone(),
            },
            &mesh.credential(ONCALL),
        ))
        .await
        .expect_err("changed bytes are never served");
    assert_eq!(read.code(), tonic::Code::DataLoss, "{read:?}");
    let chain = mesh
        .evidence()
        .verify_chain(request(
            v1::VerifyChainRequest {
                claims: vec![v1::ChainClaim {
                    claim_id: "cause".to_owned(),
                    evidence_refs: vec![cited.clone()],
                }],
                rehash_content: true,
            },
            &mesh.credential(ONCALL),
        ))
        .await
        .expect("VerifyChain")
        .into_inner();
    assert!(!chain.intact, "{chain:#?}");
    assert_eq!(
        chain.links.first().map(|l| l.status),
        Some(v1::LinkStatus::ArtifactCorrupted as i32),
        "{chain:#?}"
    );

    // The join sees it too: results are verified once the join may decide, re-hashing
    // the bytes, so the result whose claim rests on the changed artifact is rejected as
    // HASH_MISMATCH, and its siblings stand.
    assert_eq!(accepted_times(&run, &logs_id), 0, "{d:#?}");
    let rejection = d
        .rejected
        .iter()
        .find(|r| r.delegation_id == logs_id)
        .unwrap_or_else(|| panic!("logs is rejected: {d:#?}"));
    assert_eq!(
        rejection.reason,
        v1::RejectionReason::HashMismatch as i32,
        "{rejection:#?}"
    );
}

/// Two agents cite the same underlying evidence: a second metrics specialist runs the
/// same queries over the same data, so its evidence ids differ but its artifacts are
/// the first one's, byte for byte. The join flags the shared artifacts and counts the
/// two results once: with a minimum of all four delegations, the decision is
/// insufficient although four results were accepted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_agents_citing_the_same_artifacts_count_once_and_are_flagged() {
    let mesh = TestMesh::start(Mode::Processes, one_worker(example_profiles(), None)).await;
    let mut spec = example_spec();
    spec.idempotency_key = "fault-shared-evidence".to_owned();
    let mut again = spec
        .delegations
        .iter()
        .find(|d| d.name == "metrics")
        .expect("the example has a metrics delegation")
        .clone();
    again.name = "metrics-again".to_owned();
    spec.delegations.push(again);
    let join = spec.join.as_mut().expect("the example has a join");
    join.optional.push("metrics-again".to_owned());
    join.minimum.as_mut().expect("a minimum").count = 4;
    let limits = spec.limits.as_mut().expect("the example has limits");
    limits.max_parallel_workers = limits.max_parallel_workers.max(4);

    let run_id = mesh.start_run_id(ONCALL, spec).await;
    let run = mesh.wait_terminal(ONCALL, &run_id, LIMIT).await;
    let d = decision(&run);
    let metrics = task(named(&run, "metrics")).delegation_id.clone();
    let again = task(named(&run, "metrics-again")).delegation_id.clone();
    assert_eq!(d.accepted.len(), 4, "every result is accepted: {d:#?}");
    assert!(
        !d.shared_evidence.is_empty(),
        "the shared artifacts are flagged: {d:#?}"
    );
    for shared in &d.shared_evidence {
        assert_eq!(
            shared.delegation_ids,
            [metrics.clone(), again.clone()],
            "{shared:#?}"
        );
        assert!(
            shared.evidence_ids.len() >= 2,
            "cited through different ids: {shared:#?}"
        );
    }
    assert_eq!(d.not_independent, std::slice::from_ref(&again), "{d:#?}");
    assert!(!d.quorum_met, "{d:#?}");
    assert_eq!(d.outcome(), v1::JoinOutcome::InsufficientEvidence, "{d:#?}");
    assert!(
        d.reasons
            .iter()
            .any(|r| r.contains("3 independent of 4 accepted")),
        "{:#?}",
        d.reasons
    );
}
