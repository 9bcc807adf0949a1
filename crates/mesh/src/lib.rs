//! How convene services reach and trust each other.
//!
//! - [`handles`]: one handle type per service. A handle is the tonic-generated service
//!   trait behind an `Arc`; it is implemented by the service itself (in-process: no
//!   sockets, no serialization) and by a forwarding gRPC adapter (separate processes).
//!   Code above a handle cannot tell which it has, so checks that matter live in the
//!   services, never in the transport.
//! - [`auth`]: who is calling. A bearer credential in `authorization` metadata is either a
//!   principal's credential (looked up by its SHA-256 in the policy file) or a task token
//!   (verified offline against the policy service's public keys).
//! - [`batch`]: handles that send the calls arriving together as one batch message
//!   (`AuthorizeBatch`, `PutArtifactBatch`), for processes that reach the policy
//!   service and the evidence store over the network.
//! - [`policy_file`]: the policy file schema shared by the services that read it.
//! - [`retry`]: the budget within which the gRPC adapters retry calls a full server
//!   refused.
//! - `test_util` (feature `test-util`): a wrapper that records the calls and batches a
//!   real policy service or evidence store receives, for the batching handles' tests.
#![forbid(unsafe_code)]

pub mod auth;
pub mod batch;
pub mod handles;
pub mod policy_file;
pub mod resolve;
pub mod retry;
#[cfg(feature = "test-util")]
pub mod test_util;
