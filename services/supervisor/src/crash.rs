//! Fault injection for crash tests: TEST-ONLY.
//!
//! With a crash point configured (`crash: { point: after_dispatch, after: 3 }`, or
//! `CONVENE_CRASH__POINT` / `CONVENE_CRASH__AFTER`), the supervisor process aborts the
//! `after`-th time it reaches that point in a run's life, as abruptly as a SIGKILL: no
//! drain, no flush, nothing committed beyond what was committed already. The crash
//! test (`tests/tests/it/durable.rs`) uses it to prove that a restarted supervisor
//! finishes every run exactly as an uncrashed one would. Never set it anywhere else.
//!
//! The hooks exist only with the `test-hooks` cargo feature, which only the test suites'
//! dev-dependencies enable: in any other build [`Crash`] is empty and its `at` does
//! nothing, so the hook calls compile to nothing. The `crash` settings parse either way,
//! so a configuration naming them stays valid; a build without the hooks ignores a
//! configured point, with a warning at start.

#[cfg(feature = "test-hooks")]
use std::sync::atomic::{AtomicU32, Ordering};

use serde::{Deserialize, Serialize};

/// Where in a run's life the supervisor may be made to crash.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CrashPoint {
    /// StartRun committed the new run; its actor has not started.
    AfterAccept,
    /// A delegation's `Dispatched` state was committed; the worker is executing it.
    AfterDispatch,
    /// A dispatch's outcome (a result or a failure) reached the run's actor, which has
    /// not recorded it.
    ResultInFlight,
    /// The join ran on top-level results the actor took; neither they nor what the
    /// join decided are committed (approval requests it filed may exist).
    DuringJoin,
    /// The decision (and the run's terminal state) was committed; the relay has not
    /// delivered its events.
    AfterDecision,
    /// A planner's model turn reached the run's actor, which validated it and has not
    /// committed it: a restarted supervisor asks the model again.
    PlannerTurnReceived,
    /// A planner's model turn and the delegations it proposed were committed; none of
    /// them has been dispatched. A restarted supervisor never asks for the turn again.
    AfterPlannerCommit,
    /// A run's actor took a stored command (a cancel, a person's input, a changed
    /// approval request) and has not committed its effect: the command stays pending
    /// and is applied by whoever runs the run next.
    CommandReceived,
    /// Events of the approval service reached the supervisor, which has not stored
    /// them (nor the commands they make): it reads them again from its cursor.
    ApprovalEventReceived,
}

impl CrashPoint {
    /// Every crash point, in the order a run reaches them.
    pub const ALL: [CrashPoint; 7] = [
        CrashPoint::AfterAccept,
        CrashPoint::PlannerTurnReceived,
        CrashPoint::AfterPlannerCommit,
        CrashPoint::AfterDispatch,
        CrashPoint::ResultInFlight,
        CrashPoint::DuringJoin,
        CrashPoint::AfterDecision,
    ];

    /// The points of a run that waits for people and of the approval events it reacts
    /// to (not in [`Self::ALL`]: a run that never waits never reaches them).
    pub const WAITING: [CrashPoint; 2] = [
        CrashPoint::CommandReceived,
        CrashPoint::ApprovalEventReceived,
    ];

    /// The points a run with a static plan reaches (the others are a planner's).
    pub const STATIC: [CrashPoint; 5] = [
        CrashPoint::AfterAccept,
        CrashPoint::AfterDispatch,
        CrashPoint::ResultInFlight,
        CrashPoint::DuringJoin,
        CrashPoint::AfterDecision,
    ];

    /// The configuration value naming this point (`after_dispatch`, ...).
    pub fn name(self) -> &'static str {
        match self {
            CrashPoint::AfterAccept => "after_accept",
            CrashPoint::AfterDispatch => "after_dispatch",
            CrashPoint::ResultInFlight => "result_in_flight",
            CrashPoint::DuringJoin => "during_join",
            CrashPoint::AfterDecision => "after_decision",
            CrashPoint::PlannerTurnReceived => "planner_turn_received",
            CrashPoint::AfterPlannerCommit => "after_planner_commit",
            CrashPoint::CommandReceived => "command_received",
            CrashPoint::ApprovalEventReceived => "approval_event_received",
        }
    }
}

/// The `crash` configuration section. TEST-ONLY: see the [module docs](self).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CrashSettings {
    /// The point to crash at; unset (the default): never crash.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub point: Option<CrashPoint>,
    /// Crash the `after`-th time the point is reached (counted from the process's
    /// start; 1 = the first time).
    pub after: u32,
}

impl Default for CrashSettings {
    fn default() -> Self {
        Self {
            point: None,
            after: 1,
        }
    }
}

/// A configured crash point and how often it was reached in this process.
#[cfg(feature = "test-hooks")]
#[derive(Debug)]
pub(crate) struct Crash {
    point: Option<CrashPoint>,
    after: u32,
    reached: AtomicU32,
}

#[cfg(feature = "test-hooks")]
impl Crash {
    pub(crate) fn new(settings: &CrashSettings) -> Self {
        if let Some(point) = settings.point {
            tracing::warn!(
                point = point.name(),
                after = settings.after,
                "TEST-ONLY fault injection: this supervisor aborts at a crash point"
            );
        }
        Self {
            point: settings.point,
            after: settings.after.max(1),
            reached: AtomicU32::new(0),
        }
    }

    /// Counts a pass through `point`; aborts the process on the configured pass.
    pub(crate) fn at(&self, point: CrashPoint) {
        if self.point != Some(point) {
            return;
        }
        let n = self.reached.fetch_add(1, Ordering::SeqCst) + 1;
        if n == self.after {
            // stderr is unbuffered: the line is out before the process is gone. Nothing
            // else runs: no destructors, no drain, no flush of logs or traces.
            eprintln!(
                "convene-supervisor: crash point {} reached ({n} time(s)): aborting",
                point.name()
            );
            std::process::abort();
        }
    }
}

/// A build without the `test-hooks` feature: no crash point is ever reached.
#[cfg(not(feature = "test-hooks"))]
#[derive(Debug)]
pub(crate) struct Crash;

#[cfg(not(feature = "test-hooks"))]
impl Crash {
    pub(crate) fn new(settings: &CrashSettings) -> Self {
        if let Some(point) = settings.point {
            tracing::warn!(
                point = point.name(),
                "a crash point is configured, but this build has no test hooks: it is ignored"
            );
        }
        Self
    }

    /// Does nothing: the build has no crash points.
    #[inline]
    pub(crate) fn at(&self, _point: CrashPoint) {}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_parse_from_the_documented_names() {
        let s: CrashSettings =
            serde_json::from_str(r#"{"point": "result_in_flight", "after": 3}"#).unwrap();
        assert_eq!(s.point, Some(CrashPoint::ResultInFlight));
        assert_eq!(s.after, 3);
        for point in CrashPoint::ALL.into_iter().chain(CrashPoint::WAITING) {
            let parsed: CrashPoint =
                serde_json::from_value(serde_json::Value::String(point.name().into())).unwrap();
            assert_eq!(parsed, point);
        }
        assert!(serde_json::from_str::<CrashSettings>(r#"{"point": "later"}"#).is_err());
        assert!(serde_json::from_str::<CrashSettings>(r#"{"when": 1}"#).is_err());
    }

    #[cfg(feature = "test-hooks")]
    #[test]
    fn other_points_and_earlier_passes_do_not_crash() {
        let crash = Crash::new(&CrashSettings {
            point: Some(CrashPoint::AfterDecision),
            after: 3,
        });
        // Reaching this line at all proves no abort: two passes of the configured point
        // and any number of others.
        for _ in 0..10 {
            crash.at(CrashPoint::AfterDispatch);
        }
        crash.at(CrashPoint::AfterDecision);
        crash.at(CrashPoint::AfterDecision);
        assert_eq!(crash.reached.load(Ordering::SeqCst), 2);
        let off = Crash::new(&CrashSettings::default());
        for point in CrashPoint::ALL.into_iter().chain(CrashPoint::WAITING) {
            off.at(point);
        }
        assert_eq!(off.reached.load(Ordering::SeqCst), 0);
    }
}
