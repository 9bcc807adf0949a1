//! convene's domain, free of I/O.
//!
//! Everything here is a pure function of its inputs, so the same inputs give the same
//! answer in the supervisor, in tests and in recovery:
//!
//! - [`validate`]: validated conversions from the wire types; an invalid message yields a
//!   [`ValidationError`] that names the field and the rule it broke.
//! - [`join`]: the deterministic join — (contract, delegations, results, evidence, now)
//!   → decision.
//! - [`limits`]: depth, width with overflow, rounds, budget, and the no-progress detector.
//! - [`permissions`]: structured scopes, their intersection, and risk levels.
//! - [`ids`]: deterministic delegation identities.
//! - [`turns`]: a task's stored model turns, read back as the hash chain they form.
//! - [`model`]: the validated domain types the rest works on.
//!
//! Two utilities the services share are not pure functions: [`recent::RecentMap`], the
//! bounded map of recent entries a process keeps of what it checked or wrote lately, and
//! [`Clock`] ([`time`]), the one source of "now" a service reads, which tests replace
//! with a [`ManualClock`].
#![forbid(unsafe_code)]

pub mod error;
pub mod ids;
pub mod join;
pub mod limits;
pub mod model;
pub mod permissions;
pub mod recent;
pub mod time;
pub mod turns;
pub mod validate;

pub use error::{FieldPath, Rule, ValidationError};
pub use time::{Clock, ManualClock};
