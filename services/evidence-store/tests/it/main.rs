//! The evidence store's integration tests, one binary, over real sockets with a real
//! policy service issuing tokens: artifacts, access, chain verification and the service's
//! plumbing; PutArtifactBatch and the batching handle; the `Catalog` contract on every
//! back end; and artifacts in an S3 bucket shared by evidence-store processes (moto).

mod access;
mod artifacts;
mod batch;
mod catalog_store;
mod chain;
mod s3;
mod service;
mod support;
