//! Integration tests of the gateway's parts over real databases: the A2A task map and
//! the console's sessions.

mod sessions;
mod tasks;
