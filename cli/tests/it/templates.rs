//! `convene run --template`: a run from the operator's templates (the example's,
//! built into `convene up`) with the caller's inputs.

use crate::support::convene;

#[test]
fn run_from_a_template_with_a_note() {
    let dir = tempfile::tempdir().expect("tempdir");
    let note = "Paged at 02:04 by the checkout SLO alert.";
    let out = convene()
        .args([
            "run",
            "--local",
            "--template",
            "payment-incident-triage",
            "--input",
            &format!("note={note}"),
            "--json",
        ])
        .arg("--data-dir")
        .arg(dir.path())
        .env("RUST_LOG", "warn")
        .output()
        .expect("convene run --template");
    assert!(
        out.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let run: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!(run["state"], "RUN_STATE_WAITING_INPUT");
    assert_eq!(run["outcome"], "JOIN_OUTCOME_CONFLICT_REQUIRES_HUMAN");
    let goal = run["spec"]["goal"].as_str().expect("goal");
    assert!(
        goal.ends_with(&format!("Note from the caller: {note}")),
        "{goal}"
    );

    // An input the template does not declare is refused, naming the declared ones.
    let out = convene()
        .args([
            "run",
            "--local",
            "--template",
            "payment-incident-triage",
            "--input",
            "severity=high",
        ])
        .arg("--data-dir")
        .arg(dir.path())
        .env("RUST_LOG", "warn")
        .output()
        .expect("convene run --template");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("inputs.severity"), "{err}");
    assert!(err.contains("its inputs: note"), "{err}");
}

#[test]
fn run_takes_a_spec_file_or_a_template_not_both() {
    let out = convene()
        .args([
            "run",
            "examples/payment-incident/run.yaml",
            "--template",
            "payment-incident-triage",
        ])
        .output()
        .expect("convene run");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("cannot be used with"), "{err}");
    let out = convene()
        .args(["run", "--input", "note=x"])
        .output()
        .expect("convene run");
    assert!(!out.status.success());
}
