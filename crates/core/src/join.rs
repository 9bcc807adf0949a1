//! The deterministic join (being written).
