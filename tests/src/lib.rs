//! Shared helpers for convene end-to-end tests.
