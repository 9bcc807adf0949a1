//! `convene run --local` with the model-driven specialists, exactly as the README shows
//! it: the server, key and model come from `OPENAI_BASE_URL`, `OPENAI_API_KEY` and
//! `CONVENE_MODEL`; here the server is a scripted OpenAI-compatible one in this test.
//! Whatever the model answers, the run ends, and the key never shows.

use std::process::Output;

use std::path::PathBuf;

use convene_worker::model_server::{PlaybookResponder, Recorded, Reply, ScriptedModel};

use crate::support::{Up, convene, repo_root};

const KEY: &str = "sk-cli-93e1d7c0a4b25f68-secret";

/// `convene run --local --data-dir DIR examples/payment-incident/run-model.yaml --json`
/// against `model`.
async fn run_model(model: &ScriptedModel) -> Output {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut cmd = convene();
    cmd.env("OPENAI_BASE_URL", model.base_url())
        .env("OPENAI_API_KEY", KEY)
        .env("CONVENE_MODEL", "scripted-cli")
        .env("RUST_LOG", "info")
        .args(["run", "--local", "--data-dir"])
        .arg(dir.path())
        .args(["examples/payment-incident/run-model.yaml", "--json"]);
    let out = tokio::task::spawn_blocking(move || cmd.output())
        .await
        .expect("join")
        .expect("convene run --local");
    drop(dir);
    out
}

fn check_no_key(out: &Output) {
    for (what, bytes) in [("stdout", &out.stdout), ("stderr", &out.stderr)] {
        let text = String::from_utf8_lossy(bytes);
        assert!(
            !text.contains(KEY),
            "the API key leaked into {what}:\n{text}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_readme_command_runs_the_incident_with_a_model() {
    let responder = PlaybookResponder::new(&convene_worker::profiles::example().unwrap()).unwrap();
    let model = ScriptedModel::start(responder).unwrap();
    let out = run_model(&model).await;
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let run: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!(run["state"], "RUN_STATE_WAITING_INPUT", "{run}");
    assert_eq!(run["outcome"], "JOIN_OUTCOME_CONFLICT_REQUIRES_HUMAN");
    let profiles: Vec<&str> = run["delegations"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["task"]["profileId"].as_str().unwrap())
        .collect();
    assert!(
        profiles.iter().all(|p| p.ends_with("-model")),
        "{profiles:?}"
    );
    let requests = model.requests();
    assert_eq!(requests.len(), 6);
    for r in &requests {
        assert_eq!(r.authorization(), Some(format!("Bearer {KEY}").as_str()));
        assert_eq!(r.model(), Some("scripted-cli"));
    }
    check_no_key(&out);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_that_never_calls_a_tool_still_ends_the_run() {
    let model = ScriptedModel::start(|_: &Recorded| {
        Reply::text("I believe it was the database, but I will not say why.")
    })
    .unwrap();
    let out = run_model(&model).await;
    let run: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "no run JSON ({e}):\n{}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    });
    let state = run["state"].as_str().unwrap();
    assert!(
        !["RUN_STATE_PENDING", "RUN_STATE_RUNNING"].contains(&state),
        "the run ended: {run}"
    );
    assert!(!out.status.success(), "nothing was found: {state}");
    // Each specialist was told to call submit_report, turn after turn, until its
    // iteration limit (8) said enough.
    for d in run["delegations"].as_array().unwrap() {
        let error = &d["result"]["error"];
        assert_eq!(error["code"], "iteration_limit", "{d}");
    }
    assert_eq!(model.request_count(), 3 * 8);
    check_no_key(&out);
}

/// A Python that imports `mcp`, for the example MCP server.
fn python() -> Option<PathBuf> {
    convene_store::test_util::python_with_mcp(&[repo_root().join(".venv/bin/python")])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_mcp_adds_a_specialist_that_reads_the_runbook_over_mcp() {
    let Some(python) = python() else {
        return;
    };
    let dir = tempfile::tempdir().expect("tempdir");
    // The example MCP file, with this Python.
    let mcp = dir.path().join("mcp.yaml");
    std::fs::write(
        &mcp,
        format!(
            "servers:\n  - name: runbooks\n    command: {}\n    args: [{}]\n",
            python.display(),
            repo_root().join("examples/mcp/runbooks.py").display()
        ),
    )
    .unwrap();
    let profiles =
        convene_worker::profiles::load(&repo_root().join("examples/mcp/profiles.yaml")).unwrap();
    let model = ScriptedModel::start(PlaybookResponder::new(&profiles).unwrap()).unwrap();
    let mut cmd = convene();
    cmd.env("OPENAI_BASE_URL", model.base_url())
        .env("OPENAI_API_KEY", KEY)
        .env("RUST_LOG", "warn")
        .args(["run", "--local", "--data-dir"])
        .arg(dir.path().join("data"))
        .args([
            "--policy",
            "examples/mcp/policy.yaml",
            "--profiles",
            "examples/mcp/profiles.yaml",
            "--mcp",
        ])
        .arg(&mcp)
        .args(["examples/payment-incident/run-mcp.yaml", "--json"]);
    let out = tokio::task::spawn_blocking(move || cmd.output())
        .await
        .expect("join")
        .expect("convene run --local");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let run: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!(run["state"], "RUN_STATE_WAITING_INPUT", "{run}");
    let runbook = run["delegations"]
        .as_array()
        .unwrap()
        .iter()
        .find(|d| d["task"]["name"] == "runbook")
        .expect("the runbook delegation");
    let result = &runbook["result"];
    assert_eq!(result["status"], "TASK_STATUS_COMPLETED", "{runbook}");
    let claim = &result["claims"][0];
    assert_eq!(claim["topic"], "runbook.payment-api");
    assert_eq!(claim["value"], "team-payments");
    let cited = claim["evidenceRefs"][0].as_str().unwrap();
    assert!(
        cited.starts_with("mcp://runbooks/lookup_runbook/"),
        "{cited}"
    );
    assert_eq!(
        model.request_count(),
        8,
        "two turns for each of four specialists"
    );
    check_no_key(&out);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn evidence_verify_walks_each_model_conversation_and_runs_get_shows_one() {
    let responder = PlaybookResponder::new(&convene_worker::profiles::example().unwrap()).unwrap();
    let model = ScriptedModel::start(responder).unwrap();
    let dir = tempfile::tempdir().expect("tempdir");
    let port = convene_server::test_util::free_port();
    let endpoint = format!("http://127.0.0.1:{port}");
    let base_url = model.base_url();
    let _up = Up::listening(
        dir.path(),
        port,
        &[
            ("OPENAI_BASE_URL", &base_url),
            ("CONVENE_MODEL", "scripted-cli"),
        ],
    );
    let cli = |args: &[&str]| {
        convene()
            .args(args)
            .args(["--endpoint", &endpoint])
            .arg("--data-dir")
            .arg(dir.path())
            .output()
            .expect("convene")
    };
    let out = cli(&["run", "examples/payment-incident/run-model.yaml", "--json"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let run: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    let run_id = run["runId"].as_str().unwrap().to_owned();
    let delegations: Vec<String> = run["delegations"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["task"]["delegationId"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(delegations.len(), 3);

    // Every claim's evidence, and every specialist's conversation: 2 turns each.
    let out = cli(&["evidence", "verify", &run_id]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    for d in &delegations {
        assert!(
            text.contains(&format!("ok  conversation of {d} (attempt 1): 2 turn(s)")),
            "{d} in:\n{text}"
        );
    }
    assert!(text.contains("3 conversation(s) checked"), "{text}");
    let out = cli(&["evidence", "verify", &run_id, "--json"]);
    let verified: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!(verified["intact"], true);
    assert_eq!(verified["conversations"].as_array().unwrap().len(), 3);

    // One conversation, whole: the task, the tool calls and their answers, the report.
    let out = cli(&[
        "runs",
        "get",
        &run_id,
        "--conversation",
        &delegations[0],
        "--json",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let conversation: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!(conversation["turns"], 2);
    let messages = conversation["messages"].as_array().unwrap();
    assert_eq!(messages[0]["role"], "user");
    assert!(messages.iter().any(|m| m["role"] == "tool"));
    let last = messages.last().unwrap();
    assert_eq!(last["tool_calls"][0]["name"], "submit_report", "{last}");
    // The same as text.
    let out = cli(&["runs", "get", &run_id, "--conversation", &delegations[0]]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("[assistant] calls submit_report"), "{text}");

    // A delegation the run does not have is named, with the ones it has.
    let out = cli(&["runs", "get", &run_id, "--conversation", "del-nope"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("no delegation del-nope") && err.contains(&delegations[1]),
        "{err}"
    );
}
