//! The end-to-end tests, one binary, over real sockets: runs in both modes, nested
//! delegation, worker failover, durability (crashes, replicas, event delivery) and
//! tracing across processes.

#[path = "../../harness/mod.rs"]
mod harness;

mod a2a_remote;
mod deploy;
mod durable;
mod failover;
mod faults;
mod isolation;
mod listeners;
mod model;
mod model_conformance;
mod nested;
mod overload;
mod planner;
mod planner_delivery;
mod registration;
mod runs;
mod trace;
mod waiting;
