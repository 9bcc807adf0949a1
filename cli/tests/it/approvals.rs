//! `convene approvals`, black-box: a request is listed with what a vote binds to (its
//! action, parameters as canonical JSON and their hash), and votes and executions carry
//! the hash the person reviewed: passed with --hash, or confirmed on a terminal; never
//! filled in silently.

use std::process::Command;

use convene_core::ids::content_hash;
use convene_proto::v1;

use crate::mesh::{ALICE, BOB, Mesh, ONCALL, json};
use crate::support::repo_root;

/// The block `convene approvals list` prints for `approval_id`: its header line and the
/// indented lines under it.
fn listed_block(text: &str, approval_id: &str) -> Vec<String> {
    let mut lines = text.lines().skip_while(|l| !l.starts_with(approval_id));
    let header = lines
        .next()
        .unwrap_or_else(|| panic!("{approval_id} is not listed in:\n{text}"));
    std::iter::once(header)
        .chain(lines.take_while(|l| l.starts_with("  ")))
        .map(str::to_owned)
        .collect()
}

/// The value of the `  <label>: <value>` line of a listed block.
fn field(block: &[String], label: &str) -> String {
    let prefix = format!("  {label}:");
    block
        .iter()
        .find_map(|l| l.strip_prefix(&prefix))
        .unwrap_or_else(|| panic!("no {label} line in {block:#?}"))
        .trim()
        .to_owned()
}

fn approvals_by(request: &v1::ApprovalRequest, decision: v1::VoteDecision) -> Vec<String> {
    request
        .votes
        .iter()
        .filter(|v| v.decision == decision as i32)
        .map(|v| v.approver.clone())
        .collect()
}

#[test]
fn approvals_bind_to_the_hash_the_approver_passes_and_nothing_else() {
    let mesh = Mesh::start();
    let (run, approval_id) = mesh.incident("approvals-hash-1");
    let run_id = run["runId"].as_str().expect("runId");
    let stored = mesh.get_approval(&approval_id);
    assert!(stored.parameters_hash.starts_with("sha256:"), "{stored:?}");

    // The listing shows the action, its risk, its parameters as canonical JSON and the
    // hash GetApproval returns: the sha256 of exactly the JSON shown.
    let text = mesh.ok(ONCALL, &["approvals", "list", "--run", run_id]);
    let block = listed_block(&text, &approval_id);
    for needle in ["PENDING", "R3", "rule:rollback", "0/2 approvals", run_id] {
        assert!(
            block[0].contains(needle),
            "{needle:?} missing in {block:#?}"
        );
    }
    let parameters = field(&block, "parameters");
    let hash = field(&block, "hash");
    assert_eq!(hash, stored.parameters_hash, "{text}");
    assert_eq!(content_hash(parameters.as_bytes()), hash, "{parameters}");
    let empty = prost_types::Struct::default();
    assert_eq!(
        parameters,
        convene_approval::canonical::canonical_json(stored.parameters.as_ref().unwrap_or(&empty))
            .expect("canonical JSON"),
    );
    assert!(json(&parameters).is_object(), "{parameters}");
    // --json prints the service's messages, the hash included.
    let listed = mesh.approvals(run_id);
    assert_eq!(listed.len(), 1, "{listed:#?}");
    assert_eq!(listed[0]["parametersHash"], hash.as_str());
    assert_eq!(listed[0]["state"], "APPROVAL_STATE_PENDING");

    // A hash that is not the request's is refused before anything is recorded, naming
    // both and saying to review the request again.
    let wrong = format!("sha256:{}", "0".repeat(64));
    let err = mesh.refused(
        ALICE,
        &["approvals", "approve", &approval_id, "--hash", &wrong],
    );
    for needle in [
        wrong.as_str(),
        hash.as_str(),
        "convene approvals list",
        "review",
    ] {
        assert!(err.contains(needle), "{needle:?} missing in: {err}");
    }
    let err = mesh.refused(
        ALICE,
        &["approvals", "approve", &approval_id, "--hash", "abc"],
    );
    assert!(err.contains("sha256:<64 hex digits>"), "{err}");
    // Without --hash and without a terminal to confirm on: refused, and told to pass it.
    let err = mesh.refused(ALICE, &["approvals", "approve", &approval_id]);
    assert!(
        err.contains("--hash <hash>") && err.contains("convene approvals list"),
        "{err}"
    );
    let err = mesh.refused(BOB, &["approvals", "reject", &approval_id]);
    assert!(err.contains("--hash <hash>"), "{err}");
    let err = mesh.refused(ALICE, &["approvals", "execute", &approval_id]);
    assert!(err.contains("--hash <hash>"), "{err}");
    let after = mesh.get_approval(&approval_id);
    assert!(after.votes.is_empty(), "refusals recorded votes: {after:?}");
    assert_eq!(after.state, v1::ApprovalState::Pending as i32);

    // With the hash (the prefix may be left out, or spelled in capitals): two distinct
    // approvers approve an R3 action.
    let bare = hash.trim_start_matches("sha256:").to_owned();
    let out = mesh.ok(
        ALICE,
        &["approvals", "approve", &approval_id, "--hash", &bare],
    );
    assert!(
        out.contains("PENDING") && out.contains("1 vote(s)"),
        "{out}"
    );
    let shouted = format!("SHA256:{}", bare.to_uppercase());
    let out = mesh.ok(
        BOB,
        &[
            "approvals",
            "approve",
            &approval_id,
            "--hash",
            &shouted,
            "--comment",
            "rollback reviewed",
        ],
    );
    assert!(out.contains("APPROVED"), "{out}");
    let approved = mesh.get_approval(&approval_id);
    assert_eq!(approved.state, v1::ApprovalState::Approved as i32);
    assert_eq!(
        approvals_by(&approved, v1::VoteDecision::Approve),
        [ALICE, BOB]
    );
    assert!(
        approved.votes.iter().all(|v| v.parameters_hash == hash),
        "{approved:?}"
    );

    // Executed once; executing again shows the same record.
    let out = mesh.ok(
        ALICE,
        &["approvals", "execute", &approval_id, "--hash", &hash],
    );
    assert!(out.contains("executed now") && out.contains(ALICE), "{out}");
    let executed = mesh.get_approval(&approval_id);
    assert_eq!(executed.state, v1::ApprovalState::Executed as i32);
    let record = executed.execution.clone().expect("an execution record");
    assert_eq!(record.executed_by, ALICE);
    let out = mesh.ok(
        BOB,
        &["approvals", "execute", &approval_id, "--hash", &hash],
    );
    assert!(
        out.contains("already executed") && out.contains(&format!("by {ALICE}")),
        "{out}"
    );
    assert_eq!(mesh.get_approval(&approval_id).execution, Some(record));
    let text = mesh.ok(ONCALL, &["approvals", "list", "--run", run_id]);
    let block = listed_block(&text, &approval_id);
    assert!(block[0].contains("EXECUTED"), "{block:#?}");
    assert!(field(&block, "executed").contains(ALICE), "{block:#?}");
    assert!(
        field(&block, "votes").contains("rollback reviewed"),
        "{block:#?}"
    );

    // Another run's request, rejected with its hash.
    let (other, other_id) = mesh.incident("approvals-hash-2");
    let other_run = other["runId"].as_str().expect("runId");
    assert_ne!(other_run, run_id);
    let other_hash = mesh.get_approval(&other_id).parameters_hash;
    let out = mesh.ok(
        BOB,
        &["approvals", "reject", &other_id, "--hash", &other_hash],
    );
    assert!(out.contains("REJECTED"), "{out}");
    let rejected = mesh.get_approval(&other_id);
    assert_eq!(rejected.state, v1::ApprovalState::Rejected as i32);
    assert_eq!(approvals_by(&rejected, v1::VoteDecision::Reject), [BOB]);
    // The state filter: the rejected one only; `cancelled` is a state to filter by.
    let text = mesh.ok(ONCALL, &["approvals", "list", "--state", "rejected"]);
    assert!(
        text.contains(&other_id) && !text.contains(&approval_id),
        "{text}"
    );
    mesh.ok(ONCALL, &["approvals", "list", "--state", "cancelled"]);
}

/// Drives `argv` through a pseudo-terminal (stdin, stdout and stderr), answering
/// `answer` once it asks `[y/N]`; prints everything the terminal showed and exits with
/// the command's status.
const PTY_DRIVER: &str = r#"
import os, pty, select, sys
answer = sys.argv[1].encode() + b"\n"
pid, fd = pty.fork()
if pid == 0:
    os.execv(sys.argv[2], sys.argv[2:])
shown = b""
answered = False
while True:
    ready, _, _ = select.select([fd], [], [], 120)
    if not ready:
        os.kill(pid, 9)
        break
    try:
        data = os.read(fd, 4096)
    except OSError:
        break
    if not data:
        break
    shown += data
    if not answered and b"[y/N]" in shown:
        os.write(fd, answer)
        answered = True
_, status = os.waitpid(pid, 0)
sys.stdout.buffer.write(shown)
sys.exit(os.waitstatus_to_exitcode(status))
"#;

/// `convene <args>` as `principal` on a terminal, answering `answer`: whether it
/// succeeded, and what the terminal showed.
fn on_terminal(mesh: &Mesh, principal: &str, args: &[&str], answer: &str) -> (bool, String) {
    let out = Command::new("python3")
        .current_dir(repo_root())
        .env_remove("CONVENE_DATA_DIR")
        .env_remove("CONVENE_ENDPOINT")
        .env_remove("CONVENE_CREDENTIAL")
        .env_remove("CONVENE_APPROVAL_ENDPOINT")
        .arg("-c")
        .arg(PTY_DRIVER)
        .arg(answer)
        .arg(env!("CARGO_BIN_EXE_convene"))
        .args(mesh.client_args(principal, args))
        .output()
        .expect("python3 runs (its pty module gives the command a terminal)");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).replace("\r\n", "\n"),
    )
}

#[test]
fn on_a_terminal_approve_shows_the_request_and_votes_only_on_yes() {
    let mesh = Mesh::start();
    let (_, approval_id) = mesh.incident("approvals-terminal");
    let hash = mesh.get_approval(&approval_id).parameters_hash;
    let args = ["approvals", "approve", approval_id.as_str()];

    let (ok, shown) = on_terminal(&mesh, ALICE, &args, "n");
    assert!(!ok, "a no is not a vote:\n{shown}");
    for needle in [
        "rule:rollback",
        "R3",
        "parameters:",
        &hash,
        "approve? [y/N]",
    ] {
        assert!(shown.contains(needle), "{needle:?} missing in:\n{shown}");
    }
    assert!(shown.contains("nothing was recorded"), "{shown}");
    assert!(mesh.get_approval(&approval_id).votes.is_empty());

    let (ok, shown) = on_terminal(&mesh, ALICE, &args, "y");
    assert!(ok, "{shown}");
    assert!(shown.contains("1 vote(s)"), "{shown}");
    let voted = mesh.get_approval(&approval_id);
    assert_eq!(voted.votes.len(), 1, "{voted:?}");
    assert_eq!(voted.votes[0].approver, ALICE);
    assert_eq!(voted.votes[0].decision, v1::VoteDecision::Approve as i32);
    assert_eq!(voted.votes[0].parameters_hash, hash);
}
