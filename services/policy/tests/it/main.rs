//! The policy service's integration tests, one binary: issuing tokens, authorizing calls,
//! AuthorizeBatch and the batching handle, and the state kept in a database.

mod authorize;
mod batch;
mod durable_state;
mod issue;
mod support;
