//! The supervisor's integration tests, one binary: the `RunStore` contract on every back
//! end, the watchers that read the store only when something is new for them, the
//! limits and starting points of watch streams, the service identity the worker
//! registry requires under mutual TLS, and whose a worker registration is.

mod mtls;
mod registration;
mod run_store;
mod watch;
mod watch_streams;
