//! The `convene` binary's integration tests, one binary, black-box: the README's
//! commands, runs that outlive a command, people acting on waiting runs (approvals,
//! resolving, cancelling), the bench, tracing of `run --local`, and the mesh's services
//! attacked as processes (a worker's callers and tokens; key rotation, where the policy
//! service alone runs in the test so the test can rotate and retire its keys).

mod a2a;
mod approvals;
mod bench;
mod cli;
mod clients;
mod console;
mod console_browser;
mod durable;
mod gateway_access;
mod isolation;
mod keys;
mod mesh;
mod model;
mod planner;
mod resolve;
mod support;
mod templates;
mod tls;
mod trace;
mod worker_guard;
