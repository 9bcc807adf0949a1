//! The gRPC plumbing every convene service shares.
//!
//! - [`GrpcServer`]: the server builder. Health, reflection, message-size limits, request
//!   timeouts, load shedding and graceful shutdown for every service alike.
//! - [`Shutdown`]: the shutdown signal passed into servers (and, at the binary edge,
//!   raised by SIGTERM/SIGINT).
//! - [`config`]: layered configuration (defaults → file → `CONVENE_*` env → flags) with
//!   unknown keys rejected, and [`ServerSettings`], the `server` section services embed;
//!   [`ServiceCommon`], the keys shared by the services that read the policy file.
//! - [`ErrorCode`], [`ServiceError`], [`into_status`]: the one place service errors
//!   become gRPC statuses.
//! - [`cli`]: the flags every service binary shares, and telemetry setup (logging and
//!   trace export, through `convene-telemetry`).
//! - the per-call server span that continues the caller's W3C trace context (a layer of
//!   every [`GrpcServer`]).
//! - `test_util` (feature `test-util`): free ports, wait-until-ready, background servers.
//!
//! A service is a library exposing `run(config, shutdown)`; its `main.rs` parses its
//! flags (flattening [`cli::ServiceArgs`]) and hands them to [`binary::serve_binary`],
//! which loads the config, sets up telemetry and the signal handlers, runs the service
//! and turns the outcome into the exit code, alike for every binary. Nothing outside
//! [`binary`], [`cli`] and [`Shutdown::from_signals`] touches process-global state, so
//! `convene up` can host several services in one process.
#![forbid(unsafe_code)]

pub mod alloc;
pub mod binary;
pub mod builder;
pub mod cli;
mod common;
pub mod config;
mod error;
mod settings;
mod shutdown;
#[cfg(feature = "test-util")]
pub mod test_util;
pub mod tls;
mod trace;

pub use binary::serve_binary;
pub use builder::{
    Error as ServeError, GrpcServer, HEALTH_SERVICE, MessageLimits, REFLECTION_SERVICES, bind,
};
pub use common::{CREDENTIALS_DIR, DEFAULT_DATA_DIR, DEFAULT_KEY_REFRESH, ServiceCommon};
pub use config::{ConfigLoader, Error as ConfigError, Format, dump};
pub use error::{
    ErrorCode, ServiceError, into_status, invalid_field, resource_exhausted, retry_after,
};
pub use settings::{
    DEFAULT_CONCURRENCY_LIMIT, DEFAULT_MAX_MESSAGE_BYTES, DEFAULT_REQUEST_TIMEOUT,
    DEFAULT_SHUTDOWN_GRACE, SERVER_SECTION, ServerSettings, SettingsError,
};
pub use shutdown::Shutdown;
