//! The mesh crate's integration tests, one binary: balancing over resolved addresses,
//! the example policy file, and retries of calls a full server refused.

mod balance;
mod example_policy;
mod retry;
