//! Fuzz targets over every parser of untrusted input in convene: one function per
//! target, taking any bytes.
//!
//! A target decodes its input the way the receiving code does and goes on with what
//! decodes as that code would. It returns quietly on input the code refuses; it panics
//! only when convene's code panics, or when a property that the code relies on does not
//! hold (each such check says which). Inputs longer than [`MAX_INPUT`] are skipped, so
//! every run does bounded work.
//!
//! `fuzz/` drives each target coverage-guided with `cargo fuzz`; `tests/corpus.rs`
//! replays every input ever kept (`fuzz/corpus/<target>/`, `fuzz/regressions/<target>/`)
//! through the same functions on every test run. [`TARGETS`] lists them by the names
//! of those directories.

pub mod files;
pub mod fixtures;
pub mod gateway;
pub mod playbook;
pub mod requests;
pub mod specs;
pub mod tokens;

pub use files::{policy_file, worker_profiles};
pub use gateway::a2a_send_message;
pub use playbook::playbook;
pub use requests::{
    authorize_request, delegate_request, issue_task_token_request, other_requests,
    put_artifact_request, record_evidence_request, request_approval_request, resume_run_request,
    start_run_request, worker_execute_request,
};
pub use specs::{run_spec_file, run_spec_json};
pub use tokens::{jwks, task_token};

/// Longest input a target reads; longer ones are skipped.
pub const MAX_INPUT: usize = 64 * 1024;

/// A fuzz target: any bytes in, no result.
pub type Target = fn(&[u8]);

/// Every target, by name (the name of its `cargo fuzz` target and corpus directories).
pub const TARGETS: &[(&str, Target)] = &[
    ("start_run_request", start_run_request),
    ("delegate_request", delegate_request),
    ("worker_execute_request", worker_execute_request),
    ("issue_task_token_request", issue_task_token_request),
    ("authorize_request", authorize_request),
    ("request_approval_request", request_approval_request),
    ("put_artifact_request", put_artifact_request),
    ("record_evidence_request", record_evidence_request),
    ("resume_run_request", resume_run_request),
    ("other_requests", other_requests),
    ("run_spec_file", run_spec_file),
    ("run_spec_json", run_spec_json),
    ("policy_file", policy_file),
    ("worker_profiles", worker_profiles),
    ("task_token", task_token),
    ("jwks", jwks),
    ("playbook", playbook),
    ("a2a_send_message", a2a_send_message),
];

/// The input as text, when it is UTF-8 (what a file read as a string must be) and no
/// longer than [`MAX_INPUT`].
fn text(data: &[u8]) -> Option<&str> {
    if data.len() > MAX_INPUT {
        return None;
    }
    std::str::from_utf8(data).ok()
}
