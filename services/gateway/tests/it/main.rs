//! Integration tests of the gateway's parts: over real databases, the A2A task map and
//! the console's sessions; on services answering from memory, the console's and the
//! access check's answers to browsers and agents.

mod console;
mod sessions;
mod tasks;
