//! The supervisor's integration tests, one binary: the `RunStore` contract on every back
//! end, and the watchers that read the store only when something is new for them.

mod run_store;
mod watch;
