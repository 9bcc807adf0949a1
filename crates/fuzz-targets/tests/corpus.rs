//! Replays every input the fuzzers ever kept through its target: the corpus
//! (`fuzz/corpus/<target>/`, seeds and what coverage-guided runs added) and the inputs
//! that once made a target fail (`fuzz/regressions/<target>/`). A test per target, so a
//! failure names the target and every failing file.

use std::panic::{self, AssertUnwindSafe};
use std::path::{Path, PathBuf};

use convene_fuzz_targets::{TARGETS, Target};

fn fuzz_dir() -> PathBuf {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .nth(2)
        .expect("the crate sits two levels below the repository root");
    root.join("fuzz")
}

/// The files of `dir`, sorted; none when it does not exist.
fn inputs(dir: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut files: Vec<PathBuf> = entries
        .map(|e| e.expect("a corpus directory entry reads").path())
        .filter(|p| p.is_file())
        .collect();
    files.sort();
    files
}

fn target(name: &str) -> Target {
    TARGETS
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, f)| *f)
        .unwrap_or_else(|| panic!("no target {name} in TARGETS"))
}

/// Runs every kept input of `name` through its target; fails naming each input that
/// panics. The corpus must hold at least one input (the seeds).
fn replay(name: &str) {
    let run = target(name);
    let corpus = inputs(&fuzz_dir().join("corpus").join(name));
    assert!(
        !corpus.is_empty(),
        "fuzz/corpus/{name} is empty: seed it (cargo run -p convene-fuzz-targets --example \
         seed_corpus)"
    );
    let regressions = inputs(&fuzz_dir().join("regressions").join(name));
    let mut failed = Vec::new();
    for path in corpus.iter().chain(&regressions) {
        let data = std::fs::read(path).expect("a kept input reads");
        if panic::catch_unwind(AssertUnwindSafe(|| run(&data))).is_err() {
            failed.push(path.display().to_string());
        }
    }
    assert!(
        failed.is_empty(),
        "{name}: {} of {} kept input(s) fail (fuzz/README.md says how to run one under \
         the fuzzer):\n{}",
        failed.len(),
        corpus.len() + regressions.len(),
        failed.join("\n")
    );
}

macro_rules! replay_tests {
    ($($name:ident),* $(,)?) => {
        $(
            #[test]
            fn $name() {
                replay(stringify!($name));
            }
        )*

        /// Every target has its replay test here, and a cargo fuzz target in fuzz/.
        #[test]
        fn every_target_is_replayed_and_fuzzed() {
            let replayed = [$(stringify!($name)),*];
            let manifest = std::fs::read_to_string(fuzz_dir().join("Cargo.toml"))
                .expect("fuzz/Cargo.toml reads");
            for (name, _) in TARGETS {
                assert!(replayed.contains(name), "target {name} has no replay test");
                assert!(
                    manifest.contains(&format!("name = \"{name}\"")),
                    "target {name} has no [[bin]] in fuzz/Cargo.toml"
                );
                let source = fuzz_dir().join("fuzz_targets").join(format!("{name}.rs"));
                let text = std::fs::read_to_string(&source)
                    .unwrap_or_else(|e| panic!("{}: {e}", source.display()));
                assert!(
                    text.contains(&format!("convene_fuzz_targets::{name}(")),
                    "{} does not call convene_fuzz_targets::{name}",
                    source.display()
                );
            }
            assert_eq!(replayed.len(), TARGETS.len(), "a replay test names no target");
        }
    };
}

replay_tests!(
    start_run_request,
    delegate_request,
    worker_execute_request,
    issue_task_token_request,
    authorize_request,
    request_approval_request,
    put_artifact_request,
    record_evidence_request,
    resume_run_request,
    other_requests,
    run_spec_file,
    run_spec_json,
    policy_file,
    worker_profiles,
    task_token,
    jwks,
    playbook,
    a2a_send_message,
);
