//! The supervisor's integration tests, one binary: the `RunStore` contract on every back
//! end, the watchers that read the store only when something is new for them, and the
//! service identity the worker registry requires under mutual TLS.

mod mtls;
mod run_store;
mod watch;
