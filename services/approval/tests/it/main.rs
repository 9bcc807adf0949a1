//! The approval service's integration tests, one binary: the service end to end over a
//! loopback socket (execution, decisions, the service around them), the `ApprovalStore`
//! contract on every back end, and the binary black-box.

mod approval_store;
mod binary;
mod decisions;
mod execution;
mod service;
mod support;
