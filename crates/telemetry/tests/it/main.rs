//! The telemetry crate's integration tests that share a process: W3C trace-context
//! propagation, on per-thread captures. `off.rs`, `export.rs` and `capture.rs` stay
//! binaries of their own: each depends on process-global tracing state (see their
//! headers).

mod propagation;
