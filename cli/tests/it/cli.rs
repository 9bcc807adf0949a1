//! The `convene` binary, black-box: what a person typing the README's commands sees.

use std::process::Stdio;

use convene_server::test_util::free_port;

use crate::support::{Up, convene};

#[test]
fn check_explains_the_example_and_names_bad_fields() {
    let out = convene()
        .args(["check", "examples/payment-incident/run.yaml"])
        .output()
        .expect("convene runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("3 delegation(s)"), "{text}");
    assert!(text.contains("impact_metric + causal_signal"), "{text}");

    let dir = tempfile::tempdir().expect("tempdir");
    let bad = dir.path().join("bad.yaml");
    std::fs::write(&bad, "goal: x\ndelegations:\n  - name: Bad Name\n    profile_id: p\n    goal: g\njoin: { strategy: JOIN_STRATEGY_ALL }\n")
        .expect("written");
    let out = convene()
        .args(["check"])
        .arg(&bad)
        .output()
        .expect("convene runs");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("spec.delegations[0].name"), "{err}");
}

/// `--dump-config` shows every key a replica may set, the unset ones commented, in a
/// file that loads back; and the worker's `--help` gives the registry list syntax.
#[test]
fn dump_config_shows_unset_keys_and_the_worker_help_the_registry_list() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = convene()
        .env_clear()
        .args(["serve", "supervisor", "--dump-config"])
        .output()
        .expect("convene runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    for unset in [
        "# replica_id =",
        "# database_url =",
        "# advertise_endpoint =",
        "# nats_url =",
    ] {
        assert!(text.lines().any(|l| l == unset), "no {unset:?} in:\n{text}");
    }
    let file = dir.path().join("supervisor.toml");
    std::fs::write(&file, &text).expect("written");
    let again = convene()
        .env_clear()
        .args(["serve", "supervisor", "--dump-config", "--config"])
        .arg(&file)
        .output()
        .expect("convene runs");
    assert!(
        again.status.success(),
        "{}",
        String::from_utf8_lossy(&again.stderr)
    );
    assert_eq!(
        String::from_utf8_lossy(&again.stdout),
        text,
        "it loads back as it was"
    );

    let help = convene()
        .args(["serve", "worker", "--help"])
        .output()
        .expect("convene runs");
    let help = String::from_utf8_lossy(&help.stdout);
    assert!(
        help.contains(
            "CONVENE_REGISTRY_ENDPOINTS='[http://supervisor-a:7500,http://supervisor-b:7500]'"
        ),
        "{help}"
    );
}

#[test]
fn client_commands_say_what_to_do_when_nothing_listens() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = convene()
        .args([
            "run",
            "examples/payment-incident/run.yaml",
            "--credential",
            "x",
            "--endpoint",
        ])
        .arg(format!("http://127.0.0.1:{}", free_port()))
        .arg("--data-dir")
        .arg(dir.path())
        .output()
        .expect("convene runs");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("is `convene up` running?"), "{err}");
    // Without credentials at all, the message says where they come from.
    let out = convene()
        .args(["runs", "list", "--data-dir"])
        .arg(dir.path())
        .output()
        .expect("convene runs");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--credential") && err.contains("convene up"),
        "{err}"
    );
}

#[test]
fn run_names_a_missing_spec_file_before_asking_for_credentials() {
    let dir = tempfile::tempdir().expect("tempdir");
    for detach in [false, true] {
        let mut cmd = convene();
        cmd.args(["run", "/nonexistent.yaml", "--data-dir"])
            .arg(dir.path());
        if detach {
            cmd.arg("--detach");
        }
        let out = cmd.output().expect("convene runs");
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("/nonexistent.yaml"), "{err}");
        assert!(!err.contains("credential"), "{err}");
    }
}

#[test]
fn up_then_run_prints_the_assessment_and_evidence_verifies() {
    let dir = tempfile::tempdir().expect("tempdir");
    let port = free_port();
    let endpoint = format!("http://127.0.0.1:{port}");
    let _up = Up::listening(dir.path(), port, &[]);

    let out = convene()
        .args([
            "run",
            "examples/payment-incident/run.yaml",
            "--endpoint",
            &endpoint,
        ])
        .arg("--data-dir")
        .arg(dir.path())
        .output()
        .expect("convene run");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for needle in [
        "WAITING_INPUT",
        "Impact:",
        "Strongest root-cause candidate",
        "Unresolved conflict on primary_cause",
        "connection pool exhaustion (logs)",
        "risk rule change (changes)",
        "R3 rule:rollback",
        "nothing was executed",
        "Trace: ",
    ] {
        assert!(text.contains(needle), "missing {needle:?} in:\n{text}");
    }

    // The same run again (same idempotency key) as JSON: the protobuf JSON mapping.
    let out = convene()
        .args([
            "run",
            "examples/payment-incident/run.yaml",
            "--json",
            "--endpoint",
            &endpoint,
        ])
        .arg("--data-dir")
        .arg(dir.path())
        .output()
        .expect("convene run --json");
    assert!(out.status.success());
    let run: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!(run["state"], "RUN_STATE_WAITING_INPUT");
    assert_eq!(run["outcome"], "JOIN_OUTCOME_CONFLICT_REQUIRES_HUMAN");
    let run_id = run["runId"].as_str().expect("runId").to_owned();
    assert_eq!(run["traceId"].as_str().map(str::len), Some(32));

    let out = convene()
        .args(["evidence", "verify", &run_id, "--endpoint", &endpoint])
        .arg("--data-dir")
        .arg(dir.path())
        .output()
        .expect("convene evidence verify");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    assert!(text.contains("intact"), "{text}");
}

/// A service process runs with the allocator settings (it re-executes itself to get
/// them, as its process id stays the same) and keeps a setting its caller chose.
#[test]
fn a_service_runs_with_the_allocator_settings_and_keeps_a_chosen_one() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut child = convene()
        .args(["serve", "policy", "--data-dir"])
        .arg(dir.path())
        .env(
            "CONVENE_SERVER__LISTEN",
            format!("127.0.0.1:{}", free_port()),
        )
        .env_remove("MIMALLOC_ARENA_EAGER_COMMIT")
        .env("MIMALLOC_PURGE_DELAY", "5")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("convene serve policy");
    let environ = std::path::PathBuf::from(format!("/proc/{}/environ", child.id()));
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let env = loop {
        let text = std::fs::read(&environ).unwrap_or_default();
        let vars: Vec<String> = text
            .split(|b| *b == 0)
            .map(|v| String::from_utf8_lossy(v).into_owned())
            .collect();
        if vars
            .iter()
            .any(|v| v.starts_with("MIMALLOC_ARENA_EAGER_COMMIT="))
        {
            break vars;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the service never ran with the allocator settings: {vars:?}"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    let _ = child.kill();
    let _ = child.wait();
    assert!(
        env.contains(&"MIMALLOC_ARENA_EAGER_COMMIT=0".to_owned()),
        "{env:?}"
    );
    assert!(
        env.contains(&"MIMALLOC_PURGE_DELAY=5".to_owned()),
        "{env:?}"
    );
}

/// Log lines on a stream that is not a terminal carry no ANSI colour codes, in either
/// format: a log collector reading a pipe gets them plain.
#[test]
fn logs_to_a_pipe_carry_no_colour_codes() {
    use std::io::{BufRead as _, BufReader};
    for format in ["text", "json"] {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut child = convene()
            .args(["serve", "policy", "--log-format", format, "--data-dir"])
            .arg(dir.path())
            .env(
                "CONVENE_SERVER__LISTEN",
                format!("127.0.0.1:{}", free_port()),
            )
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("convene serve policy");
        let stderr = child.stderr.take().expect("stderr");
        let mut lines = Vec::new();
        for line in BufReader::new(stderr).lines() {
            let line = line.expect("a log line");
            let started = line.contains("starting");
            lines.push(line);
            if started {
                break;
            }
        }
        let _ = child.kill();
        let _ = child.wait();
        assert!(
            lines.iter().any(|l| l.contains("starting")),
            "{format}: no start line in {lines:#?}"
        );
        for line in &lines {
            assert!(
                !line.contains('\u{1b}'),
                "{format}: a colour code in {line:?}"
            );
        }
    }
}
