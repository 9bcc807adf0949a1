//! Integration tests of the gateway's parts over real databases.

mod tasks;
