//! Validated conversions from the wire types (being written).
