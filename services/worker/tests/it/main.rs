//! The worker's integration tests, one binary, over a real policy service and evidence
//! store: Execute, PlanTurn, fencing off a supervisor replica that lost its run, registration with a registry, the binary black-box, MCP
//! tools against a real MCP server, profiles served by a real remote A2A agent, and the
//! service identity Execute requires under mutual TLS.

mod binary;
mod execute;
mod fencing;
mod guard;
mod mcp;
mod model;
mod model_server;
mod mtls;
mod planner;
mod registration;
mod remote_a2a;
mod support;
