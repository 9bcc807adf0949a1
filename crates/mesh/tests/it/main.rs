//! The mesh crate's integration tests, one binary: balancing over resolved addresses,
//! and the example policy file.

mod balance;
mod example_policy;
