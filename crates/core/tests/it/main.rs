//! The domain's integration tests, one binary: the join (scenarios and properties),
//! limits, permission intersection and wire → domain validation.

mod join;
mod join_props;
mod limits;
mod permissions_props;
mod validate;
