//! The server plumbing's integration tests, one binary: layered configuration, the
//! server builder over real sockets, and server spans.

mod config;
mod server;
mod tls;
mod trace;
