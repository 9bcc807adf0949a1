//! The policy service's integration tests, one binary: issuing tokens, authorizing calls,
//! AuthorizeBatch and the batching handle, the state kept in a database, and MCP tools
//! in the catalog.

mod authorize;
mod batch;
mod durable_state;
mod issue;
mod mcp;
mod mtls;
mod support;
