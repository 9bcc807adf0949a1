//! Validated conversions from the wire types.
//!
//! Every function takes the path of the message it checks (`spec`, `result`, ...) and
//! returns the validated domain value or the first
//! [`ValidationError`](crate::ValidationError) found, whose `field` is the full path of
//! the offending field (`spec.delegations[1].profile_id`, `spec.join.weights["logs"]`).
//! Fields are checked in declaration order, so one invalid message always yields the
//! same error.
//!
//! The wire conventions applied here:
//! - a zero number or an unset message means "the documented default";
//! - an unspecified enum means its documented default, or is
//!   [`Rule::Required`](crate::Rule::Required) where the contract has none (a join's
//!   strategy, a result's status); a number this version does not know is
//!   [`Rule::UnknownEnum`](crate::Rule::UnknownEnum);
//! - free text is trimmed, and a blank required string counts as missing;
//! - a deadline is absolute and must lie after the run's start; a timeout is relative to
//!   the run's start and is resolved into a deadline here, so the domain only knows
//!   absolute deadlines.
//!
//! One file per contract area: `run` (run specs with their static plan or planner, and
//! limits), `join` (join contracts),
//! `task` (planned and dispatched tasks, worker profiles), `result` (results, claims and
//! evidence references); the rules they share are in `rules` (single fields), `deadline`
//! (durations and deadlines) and `enums` (wire enums). This file keeps the field-path
//! helpers every one of them names fields with.

mod deadline;
mod enums;
mod join;
mod result;
mod rules;
mod run;
mod task;

use crate::FieldPath;

pub use join::join_contract;
pub use result::task_result;
pub use run::{limits, run_spec};
pub use task::{delegation_task, planned_task, worker_profile};

/// Longest accepted goal, in characters.
pub const MAX_GOAL_CHARS: usize = 4096;
/// Longest accepted planner instructions, in characters: as long as a goal.
pub const MAX_PLANNER_INSTRUCTIONS_CHARS: usize = MAX_GOAL_CHARS;
/// Longest accepted idempotency key, in characters.
pub const MAX_IDEMPOTENCY_KEY_CHARS: usize = 256;
/// Longest accepted delegation name, in characters.
pub const MAX_NAME_CHARS: usize = 64;
/// Longest accepted profile id, in characters.
pub const MAX_PROFILE_ID_CHARS: usize = 128;
/// Most delegations in one static plan: even under QUEUE overflow a larger plan is a
/// flood the join cannot meaningfully decide on.
pub const MAX_PLAN_DELEGATIONS: usize = 1024;
/// Most resource selectors in a task's scope, and most permissions it requires: each
/// set is normalized by comparing every element with every other.
pub const MAX_SCOPE_ENTRIES: usize = 256;

/// `field.name` (just `name` at the root).
fn at<'a>(field: &'a FieldPath<'a>, name: &'a str) -> FieldPath<'a> {
    field.at(name)
}

/// `field[i]`.
fn nth<'a>(field: &'a FieldPath<'a>, i: usize) -> FieldPath<'a> {
    field.nth(i)
}

/// `field["key"]`, quoted so any key stays unambiguous.
fn key<'a>(field: &'a FieldPath<'a>, k: &'a str) -> FieldPath<'a> {
    field.key(k)
}

/// The last name of a path, without indices: `spec.join.strategy` → `strategy`.
fn leaf(field: &FieldPath<'_>) -> String {
    field.leaf()
}

fn join_list<I>(items: I) -> String
where
    I: IntoIterator,
    I::Item: AsRef<str>,
{
    items
        .into_iter()
        .map(|s| s.as_ref().to_owned())
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_and_leaves() {
        let root = FieldPath::new("");
        let spec = FieldPath::new("spec");
        assert_eq!(at(&root, "goal").to_string(), "goal");
        assert_eq!(at(&spec, "goal").to_string(), "spec.goal");
        let delegations = at(&spec, "delegations");
        assert_eq!(nth(&delegations, 2).to_string(), "spec.delegations[2]");
        let first = nth(&delegations, 0);
        assert_eq!(at(&first, "goal").to_string(), "spec.delegations[0].goal");
        let second = nth(&root, 1);
        assert_eq!(at(&second, "goal").to_string(), "[1].goal");
        let join = at(&spec, "join");
        let weights = at(&join, "weights");
        assert_eq!(
            key(&weights, "logs").to_string(),
            "spec.join.weights[\"logs\"]"
        );
        let shown = FieldPath::shown(&join);
        assert_eq!(at(&shown, "strategy").to_string(), "spec.join.strategy");

        assert_eq!(leaf(&FieldPath::new("spec.join.strategy")), "strategy");
        assert_eq!(
            leaf(&FieldPath::new("result.claims[0].evidence_refs[1]")),
            "evidence_refs"
        );
        assert_eq!(leaf(&FieldPath::new("goal")), "goal");
        assert_eq!(leaf(&key(&weights, "a.b")), "weights");
        assert_eq!(leaf(&at(&first, "goal")), "goal");
        assert_eq!(leaf(&nth(&delegations, 3)), "delegations");
    }
}
