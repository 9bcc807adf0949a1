//! The `convene` binary's integration tests, one binary, black-box: the README's
//! commands, runs that outlive a command, the bench, and tracing of `run --local`.

mod bench;
mod cli;
mod durable;
mod model;
mod planner;
mod support;
mod trace;
