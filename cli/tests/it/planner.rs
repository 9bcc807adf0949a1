//! `convene run --local` with the planner example, offline: the playbook planner sends
//! the three specialists in round 1, asks the change auditor one follow-up in round 2
//! and finishes. Its JSON, its progress lines and final report, its trace (one tree,
//! one `plan` span per round) and the errors of a planner spec that cannot run.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::process::Output;
use std::time::Duration;

use convene_telemetry::test_util::{OtlpReceiver, ReceivedSpan};

use crate::support::{convene, repo_root};

/// The example planner run.
const SPEC: &str = "examples/payment-incident/run-planner.yaml";

/// `convene run --local --data-dir <fresh> <spec> [args]`, with `env` set.
async fn run_local(spec: &Path, args: &[&str], env: &[(&str, String)]) -> Output {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut cmd = convene();
    cmd.env_remove("OTEL_EXPORTER_OTLP_ENDPOINT")
        .env_remove("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        .env("RUST_LOG", "warn")
        .args(["run", "--local", "--data-dir"])
        .arg(dir.path())
        .arg(spec)
        .args(args);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = tokio::task::spawn_blocking(move || cmd.output())
        .await
        .expect("join")
        .expect("convene run --local");
    drop(dir);
    out
}

/// Both streams of `out`, for failure messages.
fn shown(out: &Output) -> String {
    format!(
        "status {}\nstdout:\n{}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// The run `convene run --json` printed, after checking that it succeeded.
fn run_json(out: &Output) -> serde_json::Value {
    assert!(out.status.success(), "{}", shown(out));
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("no run JSON ({e}):\n{}", shown(out)))
}

/// The profiles of the delegations of `round`, in creation order.
fn profiles_of_round(run: &serde_json::Value, round: u64) -> Vec<String> {
    run["delegations"]
        .as_array()
        .expect("delegations")
        .iter()
        .filter(|d| d["task"]["round"].as_u64() == Some(round))
        .map(|d| {
            d["task"]["profileId"]
                .as_str()
                .unwrap_or_default()
                .to_owned()
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_planner_example_runs_offline_in_two_rounds() {
    let out = run_local(&repo_root().join(SPEC), &["--json"], &[]).await;
    let run = run_json(&out);
    assert_eq!(run["state"], "RUN_STATE_WAITING_INPUT", "{run}");
    assert_eq!(
        run["outcome"], "JOIN_OUTCOME_CONFLICT_REQUIRES_HUMAN",
        "{run}"
    );

    let delegations = run["delegations"].as_array().expect("delegations");
    assert_eq!(delegations.len(), 4, "{run}");
    for d in delegations {
        assert!(
            d["task"]["round"].as_u64().is_some_and(|r| r >= 1),
            "a planner delegation without its round: {d}"
        );
        assert_eq!(d["state"], "DELEGATION_STATE_COMPLETED", "{d}");
    }
    let mut first = profiles_of_round(&run, 1);
    first.sort();
    assert_eq!(
        first,
        [
            "change-auditor",
            "logs-investigator",
            "metrics-investigator"
        ]
    );
    assert_eq!(profiles_of_round(&run, 2), ["change-auditor"]);

    let planner = &run["planner"];
    assert_eq!(planner["finished"], true, "{planner}");
    let turns = planner["turns"].as_array().expect("planner turns");
    let shape: Vec<(u64, Vec<&str>)> = turns
        .iter()
        .map(|t| {
            let tools = t["calls"]
                .as_array()
                .map(|c| c.iter().map(|c| c["tool"].as_str().unwrap_or("")).collect())
                .unwrap_or_default();
            (t["round"].as_u64().unwrap_or(0), tools)
        })
        .collect();
    assert_eq!(
        shape,
        [
            (1, vec!["delegate"; 3]),
            (2, vec!["delegate"]),
            (2, vec!["finish"]),
        ],
        "{planner}"
    );
    // Every accepted delegate call names the delegation it created, and no call was
    // refused.
    for t in turns {
        for c in t["calls"].as_array().into_iter().flatten() {
            assert!(c.get("error").is_none(), "a refused call: {c}");
            if c["tool"] == "delegate" {
                let id = c["delegationId"].as_str().unwrap_or_default();
                assert!(
                    delegations.iter().any(|d| d["task"]["delegationId"] == id),
                    "call {c} names no delegation of the run"
                );
            }
        }
    }

    // The R3 rollback both change audits propose is one approval request.
    let approvals = run["approvalIds"].as_array().expect("approval ids");
    assert_eq!(approvals.len(), 1, "{run}");
}

/// The spans of the trace whose root is a `run` span, once the run span has arrived.
async fn run_trace(receiver: &OtlpReceiver, trace_id: &str) -> Vec<ReceivedSpan> {
    let spans = receiver
        .wait_for(Duration::from_secs(10), |s| {
            s.iter().any(|s| s.trace_id == trace_id && s.name == "run")
        })
        .await;
    spans
        .into_iter()
        .filter(|s| s.trace_id == trace_id)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_planner_run_is_one_trace_tree_with_a_plan_span_per_round() {
    let receiver = OtlpReceiver::start().await;
    let out = run_local(
        &repo_root().join(SPEC),
        &["--json"],
        &[("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint())],
    )
    .await;
    let run = run_json(&out);
    let trace_id = run["traceId"].as_str().expect("trace id").to_owned();
    let trace = run_trace(&receiver, &trace_id).await;
    assert!(!trace.is_empty(), "no span of trace {trace_id}");

    // Everything the run did is in its one trace; only the command's own calls to the
    // supervisor (start, watch, get) are traces of their own.
    let other: Vec<_> = receiver
        .spans()
        .into_iter()
        .filter(|s| s.trace_id != trace_id)
        .map(|s| s.name)
        .collect();
    assert!(
        other
            .iter()
            .all(|name| name.starts_with("convene.v1.Supervisor/")),
        "spans outside the run's trace: {other:?}"
    );

    // One tree: one root, the `run`; every other span's parent is in the trace.
    let by_id: BTreeMap<&str, &ReceivedSpan> =
        trace.iter().map(|s| (s.span_id.as_str(), s)).collect();
    let roots: Vec<&str> = trace
        .iter()
        .filter(|s| s.parent_span_id.is_empty())
        .map(|s| s.name.as_str())
        .collect();
    assert_eq!(roots, ["run"], "{trace:#?}");
    for s in &trace {
        assert!(
            s.parent_span_id.is_empty() || by_id.contains_key(s.parent_span_id.as_str()),
            "span {} ({}) has a parent outside the trace",
            s.name,
            s.span_id
        );
    }
    let parent = |s: &ReceivedSpan| -> Option<&ReceivedSpan> {
        by_id.get(s.parent_span_id.as_str()).copied()
    };

    // One `plan` span of kind `planner` per round, under the run.
    let round_spans: Vec<&ReceivedSpan> = trace
        .iter()
        .filter(|s| s.name == "plan" && s.attr("convene.plan.kind") == Some("planner"))
        .collect();
    assert_eq!(round_spans.len(), 2, "{trace:#?}");
    let plans: BTreeMap<u64, &ReceivedSpan> = round_spans
        .iter()
        .map(|s| {
            assert_eq!(parent(s).map(|p| p.name.as_str()), Some("run"), "{s:#?}");
            let round = s
                .attr("convene.round")
                .and_then(|r| r.parse().ok())
                .unwrap_or_else(|| panic!("a plan span without its round: {s:#?}"));
            (round, *s)
        })
        .collect();
    assert_eq!(plans.keys().copied().collect::<Vec<_>>(), [1, 2]);
    let round_of_plan = |s: &ReceivedSpan| -> Option<u64> {
        plans
            .iter()
            .find(|(_, p)| p.span_id == s.span_id)
            .map(|(r, _)| *r)
    };

    // Each delegation hangs from its delegate call, which hangs from its round's plan.
    let rounds: BTreeMap<&str, u64> = run["delegations"]
        .as_array()
        .expect("delegations")
        .iter()
        .map(|d| {
            (
                d["task"]["delegationId"].as_str().unwrap_or_default(),
                d["task"]["round"].as_u64().unwrap_or_default(),
            )
        })
        .collect();
    let delegations: Vec<_> = trace.iter().filter(|s| s.name == "delegation").collect();
    assert_eq!(delegations.len(), 4, "{trace:#?}");
    let mut seen = BTreeSet::new();
    for d in delegations {
        let id = d.attr("convene.delegation.id").expect("delegation id");
        seen.insert(id);
        let call = parent(d).expect("the delegation's parent");
        assert_eq!(call.name, "planner.delegate", "delegation {id}: {call:#?}");
        assert_eq!(call.attr("convene.delegation.id"), Some(id));
        assert!(call.attr("convene.planner.call_id").is_some(), "{call:#?}");
        let plan = parent(call).expect("the delegate call's parent");
        assert_eq!(
            round_of_plan(plan),
            Some(rounds[id]),
            "delegation {id} of round {} under {plan:#?}",
            rounds[id]
        );
    }
    assert_eq!(seen, rounds.keys().copied().collect());

    // The planner's turns (asked of a worker) sit under plan spans; the planner reads
    // round 1's decision in round 1's span and finishes in round 2's.
    let turns: Vec<_> = trace.iter().filter(|s| s.name == "planner.turn").collect();
    assert_eq!(turns.len(), 3, "{trace:#?}");
    let mut turn_rounds: Vec<u64> = turns
        .iter()
        .map(|t| {
            let plan = parent(t).expect("the planner turn's parent");
            round_of_plan(plan)
                .unwrap_or_else(|| panic!("a planner turn outside the plan spans: {plan:#?}"))
        })
        .collect();
    turn_rounds.sort_unstable();
    assert_eq!(turn_rounds, [1, 1, 2], "{turns:#?}");

    // Each round's join decision sits under that round's plan span.
    let decides: Vec<_> = trace.iter().filter(|s| s.name == "join.decide").collect();
    let mut revisions = BTreeMap::new();
    for j in &decides {
        let plan = parent(j).expect("the join's parent");
        let round = round_of_plan(plan)
            .unwrap_or_else(|| panic!("a join decision outside the plan spans: {plan:#?}"));
        if let Some(revision) = j.attr("convene.join.revision").filter(|r| !r.is_empty()) {
            revisions.insert(revision.to_owned(), round);
        }
    }
    assert_eq!(
        revisions,
        [("1".to_owned(), 1), ("2".to_owned(), 2)].into(),
        "{decides:#?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_prints_each_round_and_reports_the_planner() {
    let out = run_local(&repo_root().join(SPEC), &[], &[]).await;
    assert!(out.status.success(), "{}", shown(&out));
    let text = String::from_utf8_lossy(&out.stdout);
    let lines: Vec<&str> = text.lines().collect();
    let line = |what: &str, check: &dyn Fn(&str) -> bool| -> usize {
        lines
            .iter()
            .position(|l| check(l))
            .unwrap_or_else(|| panic!("no line with {what} in:\n{text}"))
    };
    assert!(
        lines[0].contains("accepted: planned by incident-planner"),
        "{text}"
    );
    let round1 = line("round 1 delegating 3", &|l| {
        l.trim_start().starts_with("round 1 ") && l.contains("planner turn 1; delegated 3")
    });
    let round2 = line("round 2 delegating 1", &|l| {
        l.trim_start().starts_with("round 2 ") && l.contains("planner turn 2; delegated 1")
    });
    let finished = line("the finishing turn", &|l| {
        l.trim_start().starts_with("round 2 ") && l.contains("planner turn 3; finished")
    });
    let revision1 = line("the first decision", &|l| {
        l.contains("join       revision 1:")
    });
    let revision2 = line("the second decision", &|l| {
        l.contains("join       revision 2:")
    });
    assert!(
        round1 < revision1 && revision1 < round2 && round2 < revision2 && revision2 < finished,
        "rounds out of order:\n{text}"
    );
    // The follow-up is its own delegation, named after its round.
    assert!(
        lines[round2..revision2]
            .iter()
            .any(|l| l.contains("r2c0-change-auditor COMPLETED")),
        "{text}"
    );

    assert!(
        text.contains(
            "\n  (planned by incident-planner in 2 round(s), 3 planner turn(s), \
             4 delegation(s); the last round's join decided)\n"
        ),
        "{text}"
    );
    assert!(
        text.contains("\n  Planner's summary: Payment incident of 02:02 UTC:"),
        "{text}"
    );
    assert!(text.contains(": WAITING_INPUT — "), "{text}");
}

/// The example spec with `from` replaced by `to`, written into `dir`.
fn spec_with(dir: &Path, from: &str, to: &str) -> std::path::PathBuf {
    let spec = std::fs::read_to_string(repo_root().join(SPEC)).expect("the example spec");
    assert!(
        spec.contains(from),
        "the example spec no longer has {from:?}"
    );
    let path = dir.join("run.yaml");
    std::fs::write(&path, spec.replace(from, to)).expect("write the spec");
    path
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_planner_spec_that_cannot_run_says_what_to_fix() {
    let dir = tempfile::tempdir().expect("tempdir");

    let unknown = spec_with(
        dir.path(),
        "profile_id: incident-planner",
        "profile_id: incident-planer",
    );
    let out = run_local(&unknown, &[], &[]).await;
    assert!(!out.status.success(), "{}", shown(&out));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("spec.planner.profile_id"), "{stderr}");
    assert!(stderr.contains("incident-planer"), "{stderr}");
    // The known profiles are listed, so the typo is easy to see.
    assert!(stderr.contains("known profiles:"), "{stderr}");
    for known in ["incident-planner", "logs-investigator", "change-auditor"] {
        assert!(stderr.contains(known), "{known} not listed: {stderr}");
    }

    let by_name = spec_with(
        dir.path(),
        "required_profiles: [\"logs-investigator\"]",
        "required: [\"r1c0-logs-investigator\"]",
    );
    let out = run_local(&by_name, &[], &[]).await;
    assert!(!out.status.success(), "{}", shown(&out));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("spec.join.required"), "{stderr}");
    assert!(stderr.contains("use join.required_profiles"), "{stderr}");
}
