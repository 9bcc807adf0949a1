//! The evidence store's integration tests, one binary, over real sockets with a real
//! policy service issuing tokens: artifacts, access, chain verification and the service's
//! plumbing; PutArtifactBatch and the batching handle; and the `Catalog` contract on every
//! back end.

mod access;
mod artifacts;
mod batch;
mod catalog_store;
mod chain;
mod service;
mod support;
