//! The `convene` command: the user's entry point.
//!
//! `convene up` runs every service in one process on the embedded default (SQLite-free
//! in-memory state for now, artifacts and keys in the data directory); the other
//! commands are clients of a running mesh: `run`, `runs`, `approvals`, `evidence`,
//! `check`.
#![forbid(unsafe_code)]

pub mod bench;
pub mod client;
pub mod commands;
pub mod report;
pub mod spec;
pub mod up;
