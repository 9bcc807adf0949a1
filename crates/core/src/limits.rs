//! Limits (being written).
