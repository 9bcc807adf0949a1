//! The mesh crate's integration tests, one binary: the example policy file.

mod example_policy;
