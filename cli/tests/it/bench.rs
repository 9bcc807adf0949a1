//! `convene bench`, black-box: the closed loop in one process and as processes, the
//! model workload, the scale run, and that no mesh process outlives the bench, even an
//! interrupted one.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use serde_json::Value;

use crate::support::{self, database_server, test_database, wait_for};

/// `convene`, keeping its state where the test says (not in a database the
/// environment names).
fn convene() -> Command {
    let mut cmd = support::convene();
    cmd.env_remove("CONVENE_DATABASE_URL");
    cmd
}

/// Runs `convene bench <args> --json --data-dir <dir>` (on a fresh PostgreSQL database
/// when the environment names a server) and returns its report.
fn bench(dir: &Path, args: &[&str]) -> Value {
    let postgres = test_database();
    let mut cmd = convene();
    cmd.arg("bench")
        .args(args)
        .args(["--json", "--warmup", "0.5", "--data-dir"])
        .arg(dir);
    if let Some(db) = &postgres {
        cmd.args(["--store", db.url()]);
    }
    let out: Output = cmd.output().expect("convene runs");
    assert!(
        out.status.success(),
        "convene bench {args:?} failed ({}):\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    report_of(&out)
}

/// The JSON report on the last line of a `convene bench --json`'s standard output.
fn report_of(out: &Output) -> Value {
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout.lines().last().unwrap_or_default();
    serde_json::from_str(line).unwrap_or_else(|e| panic!("not one JSON object ({e}): {stdout}"))
}

fn u64_of(report: &Value, key: &str) -> u64 {
    report[key]
        .as_u64()
        .unwrap_or_else(|| panic!("{key} is not an unsigned integer in {report}"))
}

fn f64_of(report: &Value, key: &str) -> f64 {
    report[key]
        .as_f64()
        .unwrap_or_else(|| panic!("{key} is not a number in {report}"))
}

/// Processes whose environment names `dir` (every process a bench started there has
/// `CONVENE_DATA_DIR=<dir>`).
fn processes_of(dir: &Path) -> Vec<u32> {
    let needle = format!("CONVENE_DATA_DIR={}", dir.display());
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").expect("/proc").flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        let Ok(environ) = std::fs::read(entry.path().join("environ")) else {
            continue;
        };
        if environ
            .split(|b| *b == 0)
            .any(|var| var == needle.as_bytes())
        {
            found.push(pid);
        }
    }
    found
}

/// The closed-loop report's required fields, and its per-process figures.
fn check_load_report(report: &Value, runs: u64, mode: &str, processes: &[&str]) {
    assert_eq!(report["workload"], "noop", "{report}");
    assert_eq!(report["mode"], mode, "{report}");
    assert_eq!(u64_of(report, "runs"), runs, "{report}");
    assert_eq!(u64_of(report, "errors"), 0, "{report}");
    assert_eq!(u64_of(report, "concurrency"), 64, "{report}");
    assert!(f64_of(report, "duration_s") > 0.0, "{report}");
    assert!(f64_of(report, "runs_per_s") > 0.0, "{report}");
    let latency = &report["latency_us"];
    let (p50, p95, p99, max) = (
        u64_of(latency, "p50"),
        u64_of(latency, "p95"),
        u64_of(latency, "p99"),
        u64_of(latency, "max"),
    );
    assert!(
        0 < p50 && p50 <= p95 && p95 <= p99 && p99 <= max,
        "{report}"
    );
    assert!(f64_of(report, "cpu_s_per_run") > 0.0, "{report}");
    let rss = report["rss_by_process"]
        .as_object()
        .unwrap_or_else(|| panic!("rss_by_process is not an object in {report}"));
    let mut names: Vec<&str> = rss.keys().map(String::as_str).collect();
    names.sort_unstable();
    let mut expected = processes.to_vec();
    expected.sort_unstable();
    assert_eq!(names, expected, "{report}");
    assert!(
        rss.values().all(|v| v.as_u64().is_some_and(|b| b > 0)),
        "{report}"
    );
    let total: u64 = rss.values().filter_map(Value::as_u64).sum();
    assert_eq!(u64_of(report, "peak_rss_bytes"), total, "{report}");
    let cpu = report["cpu_s_per_run_by_process"]
        .as_object()
        .unwrap_or_else(|| panic!("cpu_s_per_run_by_process is not an object in {report}"));
    assert_eq!(cpu.len(), processes.len(), "{report}");
}

#[test]
fn the_closed_loop_runs_in_one_process_and_as_processes() {
    let dir = tempfile::tempdir().expect("tempdir");
    let one = dir.path().join("one");
    let report = bench(&one, &["--workload", "noop", "--runs", "20"]);
    check_load_report(&report, 20, "one-process", &["convene"]);
    assert!(report.get("client_cpu_s_per_run").is_none(), "{report}");
    // A closed loop offers no rate.
    assert!(report.get("rate").is_none(), "{report}");
    assert!(report.get("max_in_flight").is_none(), "{report}");

    let many = dir.path().join("many");
    let report = bench(
        &many,
        &["--workload", "noop", "--processes", "--runs", "10"],
    );
    check_load_report(
        &report,
        10,
        "processes",
        &[
            "policy",
            "evidence-store",
            "approval",
            "supervisor",
            "worker-1",
            "worker-2",
        ],
    );
    assert!(f64_of(&report, "client_cpu_s_per_run") >= 0.0, "{report}");
    // Every service ran apart: each has its own log, and none outlives the bench.
    for name in ["policy", "supervisor", "worker-2"] {
        assert!(many.join(format!("logs/{name}.log")).is_file(), "{name}");
    }
    assert_eq!(processes_of(&many), Vec::<u32>::new());
    if database_server().is_none() {
        each_service_kept_its_state_in_a_file_of_its_own(&many, 10);
    }
}

/// `--rate`: the open loop starts a run every 1/rate seconds, however long the runs take,
/// and counts each run's latency from when it fell due.
#[test]
fn the_open_loop_offers_runs_at_the_rate_and_counts_latency_from_when_each_fell_due() {
    let dir = tempfile::tempdir().expect("tempdir");
    // 20 runs at 40 a second: the last falls due 475 ms after the first, so the phase
    // lasts at least that long (a closed loop of 64 would start all 20 at once).
    let report = bench(
        &dir.path().join("paced"),
        &["--workload", "noop", "--rate", "40", "--runs", "20"],
    );
    check_load_report(&report, 20, "one-process", &["convene"]);
    assert!(
        (f64_of(&report, "rate") - 40.0).abs() < f64::EPSILON,
        "{report}"
    );
    assert!(f64_of(&report, "duration_s") >= 0.475, "{report}");
    assert!(
        (1..=64).contains(&u64_of(&report, "max_in_flight")),
        "{report}"
    );

    // A thousand a second offered, one in flight at most: runs start late, one after
    // another, and their wait counts. The last run fell due 29 ms after the first but
    // ended only as the phase did, so its latency is the phase less those 29 ms, where
    // timed from its own start it would be one run's.
    let report = bench(
        &dir.path().join("capped"),
        &[
            "--workload",
            "noop",
            "--rate",
            "1000",
            "--concurrency",
            "1",
            "--runs",
            "30",
        ],
    );
    assert_eq!(u64_of(&report, "runs"), 30, "{report}");
    assert_eq!(u64_of(&report, "errors"), 0, "{report}");
    assert_eq!(u64_of(&report, "concurrency"), 1, "{report}");
    assert_eq!(u64_of(&report, "max_in_flight"), 1, "{report}");
    let phase_us = f64_of(&report, "duration_s") * 1e6;
    #[allow(clippy::cast_precision_loss)] // microseconds of a short phase
    let max_us = u64_of(&report["latency_us"], "max") as f64;
    assert!(max_us >= phase_us - 29_000.0 - 5_000.0, "{report}");
}

/// The model workload's section of a report: six model turns per run (two for each
/// specialist), and finite CPU figures. Its value against the goal is a benchmark's
/// business, not a test's.
fn check_model_section(report: &Value, runs: u64) {
    assert_eq!(report["workload"], "model", "{report}");
    assert_eq!(u64_of(report, "runs"), runs, "{report}");
    assert_eq!(u64_of(report, "errors"), 0, "{report}");
    let model = &report["model"];
    assert!(
        (f64_of(model, "turns_per_run") - 6.0).abs() < 1e-9,
        "{report}"
    );
    assert_eq!(u64_of(model, "baseline_runs"), runs, "{report}");
    assert_eq!(u64_of(model, "baseline_errors"), 0, "{report}");
    for key in ["baseline_cpu_ms_per_run", "model_cpu_ms_per_run"] {
        let ms = f64_of(model, key);
        assert!(ms.is_finite() && ms > 0.0, "{key}: {report}");
    }
    // /proc counts CPU time in ticks of 10 ms, which a few runs' worth of the scripted
    // server's answers may not fill.
    let server = f64_of(model, "server_cpu_ms_per_run");
    assert!(server.is_finite() && server >= 0.0, "{report}");
    assert!(
        f64_of(model, "runtime_cpu_ms_per_turn").is_finite(),
        "{report}"
    );
    assert!(
        (f64_of(model, "goal_cpu_ms_per_turn") - 1.0).abs() < f64::EPSILON,
        "{report}"
    );
}

/// `--workload model`: the payment incident with model-driven specialists against the
/// bench's scripted model server reaches the playbook outcome (WAITING_INPUT, no
/// errors) in both phases, in one process and as processes, and reports the turns and
/// CPU figures; `--endpoint` is refused, saying why.
#[test]
fn the_model_workload_reports_the_runtime_cpu_per_model_turn() {
    let dir = tempfile::tempdir().expect("tempdir");
    let args = ["--workload", "model", "--runs", "6", "--concurrency", "2"];
    let report = bench(&dir.path().join("one"), &args);
    check_model_section(&report, 6);
    assert_eq!(report["mode"], "one-process", "{report}");

    let many = dir.path().join("many");
    let report = bench(&many, &[&args[..], &["--processes"]].concat());
    check_model_section(&report, 6);
    assert_eq!(report["mode"], "processes", "{report}");
    assert_eq!(processes_of(&many), Vec::<u32>::new());

    let out = convene()
        .args(["bench", "--workload", "model", "--runs", "1"])
        .args(["--endpoint", "http://127.0.0.1:9", "--data-dir"])
        .arg(dir.path().join("endpoint"))
        .output()
        .expect("convene runs");
    assert!(!out.status.success(), "drove an endpoint");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--workload model cannot drive a mesh at --endpoint"),
        "{err}"
    );
}

/// Rows of `table` in the SQLite file `<dir>/<file>`.
fn rows(dir: &Path, file: &str, table: &str) -> u64 {
    let path = dir.join(file);
    assert!(path.is_file(), "{} is missing", path.display());
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    runtime.block_on(async {
        let db = convene_store::Database::connect(&convene_store::sqlite_url(&path))
            .await
            .expect("the file opens");
        let count = db
            .fetch_optional(convene_store::Statement::built(format!(
                "SELECT COUNT(*) AS n FROM {table}"
            )))
            .await
            .expect("counted")
            .expect("one row")
            .get_u64("n")
            .expect("a count");
        db.close().await;
        count
    })
}

/// With `--processes` on the SQLite default, every service writes its own file, so no
/// commit waits for another process's: the supervisor's runs, the policy service's
/// decisions and the evidence store's records each in their service's file alone.
fn each_service_kept_its_state_in_a_file_of_its_own(dir: &Path, runs: u64) {
    assert!(
        !dir.join("convene.db").exists(),
        "a shared file was created"
    );
    // The warm-up's runs are stored too.
    assert!(rows(dir, "supervisor.db", "runs") >= runs);
    assert!(rows(dir, "policy.db", "decision_log") >= 3 * runs);
    assert!(rows(dir, "evidence-store.db", "evidence") >= 3 * runs);
    assert!(rows(dir, "approval.db", "approvals") == 0);
    for other in ["policy.db", "evidence-store.db", "approval.db"] {
        assert_eq!(rows(dir, other, "runs"), 0, "{other}");
    }
    for other in ["supervisor.db", "evidence-store.db"] {
        assert_eq!(rows(dir, other, "decision_log"), 0, "{other}");
    }
    assert_eq!(rows(dir, "supervisor.db", "evidence"), 0);
}

#[test]
fn the_scale_run_holds_every_delegation_then_drains() {
    let dir = tempfile::tempdir().expect("tempdir");
    for (mode, flags, measured) in [
        ("one-process", &[][..], "convene"),
        ("processes", &["--processes"][..], "supervisor"),
    ] {
        let data = dir.path().join(mode);
        let mut args = vec!["--scale", "50"];
        args.extend_from_slice(flags);
        let report = bench(&data, &args);
        assert_eq!(report["workload"], "hold", "{report}");
        assert_eq!(report["mode"], mode, "{report}");
        assert_eq!(u64_of(&report, "runs"), 50, "{report}");
        assert_eq!(u64_of(&report, "errors"), 0, "{report}");
        assert_eq!(u64_of(&report, "delegations_per_run"), 3, "{report}");
        assert_eq!(report["supervisor_process"], measured, "{report}");
        let before = u64_of(&report, "supervisor_rss_before_bytes");
        let in_flight = u64_of(&report, "supervisor_rss_in_flight_bytes");
        assert!(before > 0 && in_flight > 0, "{report}");
        assert_eq!(
            u64_of(&report, "bytes_per_in_flight_run"),
            in_flight.saturating_sub(before) / 50,
            "{report}"
        );
        let (submit, in_flight_s, drain) = (
            f64_of(&report, "submit_s"),
            f64_of(&report, "in_flight_s"),
            f64_of(&report, "drain_s"),
        );
        assert!(
            0.0 < submit && submit <= in_flight_s && drain > 0.0,
            "{report}"
        );
        assert!(f64_of(&report, "drain_runs_per_s") > 0.0, "{report}");
        assert!(f64_of(&report, "cpu_s_per_run") > 0.0, "{report}");
        assert!(u64_of(&report, "peak_rss_bytes") > 0, "{report}");
        assert!(
            report["rss_by_process"][measured].as_u64().is_some(),
            "{report}"
        );
        // Every delegation of every run was held before the release, exactly once.
        let held = std::fs::read_to_string(data.join("bench/hold/held")).expect("hold log");
        let mut ids: Vec<&str> = held.lines().collect();
        assert_eq!(ids.len(), 150, "{held}");
        ids.sort_unstable();
        ids.dedup();
        assert_eq!(ids.len(), 150, "a delegation was held twice: {held}");
        assert!(data.join("bench/hold/release").is_file());
        assert_eq!(processes_of(&data), Vec::<u32>::new(), "{mode}");
    }
}

#[test]
fn an_interrupted_bench_stops_every_process_it_started() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut child = convene()
        .args(["bench", "--processes", "--duration", "600", "--data-dir"])
        .arg(dir.path())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("convene starts");
    // Wait until the mesh is up: its four services' and two workers' processes exist
    // (the last worker starts after every service answered its health check).
    wait_for("the mesh to start", Duration::from_secs(120), || {
        let processes = processes_of(dir.path());
        assert!(
            child.try_wait().expect("wait").is_none(),
            "the bench exited"
        );
        if processes.len() >= 6 && dir.path().join("logs/worker-2.log").exists() {
            Ok(())
        } else {
            Err(processes)
        }
    });
    let pid =
        rustix::process::Pid::from_raw(i32::try_from(child.id()).expect("pid")).expect("a pid");
    rustix::process::kill_process(pid, rustix::process::Signal::INT).expect("SIGINT sent");
    let out = child.wait_with_output().expect("the bench exits");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("interrupted by SIGINT"), "{err}");
    assert_eq!(processes_of(dir.path()), Vec::<u32>::new());
}

/// Checks that a `convene bench --runs 3 --json` succeeded and measured three runs, none
/// of them failed.
fn three_runs_without_errors(out: &Output) {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report = report_of(out);
    assert_eq!(u64_of(&report, "runs"), 3, "{report}");
    assert_eq!(u64_of(&report, "errors"), 0, "{report}");
}

/// `--store sqlite` names the default: the SQLite file in the data directory, not a file
/// called "sqlite".
#[test]
fn store_sqlite_is_the_data_directorys_database() {
    let dir = tempfile::tempdir().expect("tempdir");
    let data = dir.path().join("data");
    let repo = support::repo_root();
    let stray = repo.join("sqlite");
    let out = convene()
        .args(["bench", "--workload", "noop", "--runs", "3", "--json"])
        .args(["--warmup", "0", "--store", "sqlite", "--data-dir"])
        .arg(&data)
        .output()
        .expect("convene runs");
    three_runs_without_errors(&out);
    assert!(data.join("convene.db").exists());
    assert!(!stray.exists(), "a file named sqlite was created");
    assert!(!data.join("sqlite").exists());
}

/// The workloads come from the payment-incident example: outside the repository the
/// bench says where it looked and how to point it at the example, and with `--example`
/// it runs from any directory.
#[test]
fn the_example_is_found_from_any_directory_with_example() {
    let elsewhere = tempfile::tempdir().expect("tempdir");
    let example = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../examples/payment-incident");
    let run = |extra: &[&std::ffi::OsStr]| {
        convene()
            .current_dir(elsewhere.path())
            .args(["bench", "--workload", "noop", "--runs", "3", "--json"])
            .args(["--warmup", "0", "--data-dir"])
            .arg(elsewhere.path().join("data"))
            .args(extra)
            .output()
            .expect("convene runs")
    };

    let out = run(&[]);
    assert!(!out.status.success(), "ran without the example");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("no payment-incident example at") && err.contains("--example"),
        "{err}"
    );
    let looked_at = std::path::absolute(elsewhere.path().join("examples/payment-incident"))
        .expect("an absolute path");
    assert!(err.contains(&looked_at.display().to_string()), "{err}");

    let out = run(&["--example".as_ref(), example.as_os_str()]);
    three_runs_without_errors(&out);
}
