//! The operator console in headless Chromium (Debian's `chromium`, driven by
//! `playwright-core` from npm, no browser download): `cli/tests/console/e2e.mjs` signs
//! in, reads the payment incident's conflict with both sides' evidence, verifies an
//! artifact's hash, approves the R3 rollback as two people in two browser contexts and
//! executes it, and sees the run's page change while another context settles the run,
//! with nothing blocked by the console's Content-Security-Policy.
//! Screenshots of each step are written to `<target>/tmp/console-screenshots/`.
//!
//! Needs `node`, `npm` and a Chromium (`CONVENE_TEST_CHROMIUM`, else `chromium` on the
//! PATH); the test runs `npm ci` in `cli/tests/console` when its `node_modules` is
//! missing. Without them the test skips, and fails under
//! `CONVENE_TEST_REQUIRE_SERVICES=1`.

use std::path::PathBuf;
use std::process::Command;

use crate::clients::{runs, succeeded, unavailable};
use crate::mesh::{ALICE, BOB, Mesh, ONCALL};
use crate::support::repo_root;

/// Names the Chromium binary to drive.
const CHROMIUM_ENV: &str = "CONVENE_TEST_CHROMIUM";

fn chromium() -> Option<PathBuf> {
    if let Some(given) = std::env::var_os(CHROMIUM_ENV) {
        return Some(PathBuf::from(given));
    }
    // playwright-core wants the binary's path, not a name to look up.
    let path = std::env::var_os("PATH")?;
    ["chromium", "chromium-browser", "google-chrome"]
        .into_iter()
        .flat_map(|name| std::env::split_paths(&path).map(move |dir| dir.join(name)))
        .find(|candidate| candidate.is_file())
}

fn credential(mesh: &Mesh, principal: &str) -> String {
    convene_mesh::policy_file::dev_credential(&mesh.data_dir().join("credentials"), principal)
        .expect("a development credential")
}

#[test]
fn the_console_in_a_browser_shows_the_conflict_approves_twice_and_updates_live() {
    if !(runs("node") && runs("npm")) {
        unavailable(
            "Node.js and npm",
            "install them (Node 18 or later) so that `node` and `npm` are on the PATH",
        );
        return;
    }
    let Some(chromium) = chromium() else {
        unavailable(
            "a Chromium",
            &format!("install Debian's `chromium` or set {CHROMIUM_ENV} to a Chromium binary"),
        );
        return;
    };
    let dir = repo_root().join("cli/tests/console");
    if !dir.join("node_modules").is_dir() {
        succeeded(
            "npm ci in cli/tests/console",
            Command::new("npm")
                .args(["ci", "--no-audit", "--no-fund"])
                .current_dir(&dir)
                .output(),
        );
    }
    let mesh = Mesh::start();
    let (run, approval) = mesh.incident("console-browser");
    let run = run["runId"].as_str().expect("runId").to_owned();
    let screenshots = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("console-screenshots");
    let out = succeeded(
        "the console's browser test (cli/tests/console/e2e.mjs)",
        Command::new("node")
            .arg("e2e.mjs")
            .current_dir(&dir)
            .env("CONSOLE", &mesh.a2a)
            .env("CHROMIUM", &chromium)
            .env("RUN", &run)
            .env("APPROVAL", &approval)
            .env("CREDENTIAL_ONCALL", credential(&mesh, ONCALL))
            .env("CREDENTIAL_ALICE", credential(&mesh, ALICE))
            .env("CREDENTIAL_BOB", credential(&mesh, BOB))
            .env("SCREENSHOTS", &screenshots)
            .output(),
    );
    let text = String::from_utf8_lossy(&out.stdout);
    for step in [
        "ok: the conflict shows both claims",
        "ok: the artifact's hash verifies",
        "ok: two distinct approvals approve it",
        "ok: it is executed",
        "ok: the watching page changed without a reload",
        "ok: the sign-in form has its Content-Security-Policy",
        "ok: no Content-Security-Policy violations",
    ] {
        assert!(text.contains(step), "{step} in:\n{text}");
    }
    for shot in [
        "1-run-conflict.png",
        "2-evidence-verified.png",
        "3-approved-by-alice.png",
        "3-approved-by-bob.png",
        "4-executed.png",
        "5-live-update.png",
    ] {
        let bytes = std::fs::read(screenshots.join(shot)).expect("a screenshot");
        assert!(bytes.starts_with(b"\x89PNG"), "{shot} is a PNG");
    }
    // The mesh agrees: the rollback was executed once.
    let executed = mesh.get_approval(&approval);
    assert!(executed.execution.is_some(), "{executed:#?}");
}
