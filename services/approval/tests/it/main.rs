//! The approval service's integration tests, one binary: the service end to end over a
//! loopback socket (execution, decisions, the service around them, events and
//! cancellation), the `ApprovalStore` contract on every back end, and the binary
//! black-box.

mod approval_store;
mod binary;
mod decisions;
mod events;
mod execution;
mod service;
mod support;
