//! The worker's integration tests, one binary, over a real policy service and evidence
//! store: Execute, registration with a registry, and the binary black-box.

mod binary;
mod execute;
mod registration;
mod support;
