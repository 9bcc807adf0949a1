//! The worker's integration tests, one binary, over a real policy service and evidence
//! store: Execute, PlanTurn, registration with a registry, the binary black-box, MCP
//! tools against a real MCP server, and profiles served by a real remote A2A agent.

mod binary;
mod execute;
mod mcp;
mod model;
mod model_server;
mod planner;
mod registration;
mod remote_a2a;
mod support;
