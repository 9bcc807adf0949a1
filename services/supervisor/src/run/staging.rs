//! Progress waiting for the run's next commit: the events of dispatches and results
//! taken from the mailbox, what the join has and has not seen of them, and when they
//! are committed at the latest; and the actor's steps that stage, settle and commit it.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use convene_core::time::to_timestamp;
use convene_proto::v1::{self, run_event::Kind};

use super::{Msg, RunActor};
use crate::crash::CrashPoint;
use crate::store::{Events, StoreError};

/// What the actor took and has not committed yet.
#[derive(Default)]
pub(super) struct Staging {
    /// A message taken from the mailbox early (while gathering dispatches and outcomes
    /// to commit together) and not handled yet: the next one handled.
    held: Option<Msg>,
    /// Events of dispatches and results taken from the mailbox but not committed yet:
    /// the next commit carries them, before its own.
    staged: Events,
    /// When staged progress that decided nothing is committed at the latest, if no
    /// other commit carries it first (`commit_linger` after it was held back).
    flush_at: Option<SystemTime>,
    /// Top-level results are staged that the join has not seen.
    unjoined: bool,
    /// Received results whose cited evidence is not verified yet (the delegation's
    /// index and the ids it cites): verified together, in one `VerifyChain`, once the
    /// join could decide on them (see [`RunActor::join_step`]); until then they stay
    /// here, committed as received.
    unverified: Vec<(usize, BTreeSet<String>)>,
    /// The join ran on staged results; the commit carrying them (and its decision, if
    /// any) has not happened.
    joined: bool,
}

impl Staging {
    /// Keeps `msg` to be handled next.
    pub(super) fn hold(&mut self, msg: Msg) {
        self.held = Some(msg);
    }

    /// The message kept to be handled next, if any.
    pub(super) fn take_held(&mut self) -> Option<Msg> {
        self.held.take()
    }

    pub(super) fn holds_message(&self) -> bool {
        self.held.is_some()
    }

    /// When what is staged must be committed at the latest.
    pub(super) fn flush_at(&self) -> Option<SystemTime> {
        self.flush_at
    }

    /// Whether no events wait for a commit.
    pub(super) fn is_empty(&self) -> bool {
        self.staged.is_empty()
    }

    /// Stages the event of a dispatch.
    pub(super) fn stage_event(&mut self, e: v1::RunEvent) {
        self.staged.run.push(e);
    }

    /// Stages the events of a top-level result, which the join has not seen yet.
    pub(super) fn stage_result(&mut self, ev: Events) {
        self.staged.run.extend(ev.run);
        self.staged.cloud.extend(ev.cloud);
        self.unjoined = true;
    }

    /// Notes a received result's cited evidence, to be verified with the others.
    pub(super) fn unverified(&mut self, index: usize, cited: BTreeSet<String>) {
        self.unverified.push((index, cited));
    }

    pub(super) fn has_unverified(&self) -> bool {
        !self.unverified.is_empty()
    }

    /// The results whose evidence is to be verified now.
    pub(super) fn take_unverified(&mut self) -> Vec<(usize, BTreeSet<String>)> {
        std::mem::take(&mut self.unverified)
    }

    /// The staged events followed by `events`, for the commit about to be made, and
    /// whether the join ran on staged results that commit carries.
    fn drain(&mut self, events: Events) -> (Events, bool) {
        self.flush_at = None;
        let mut all = std::mem::take(&mut self.staged);
        all.run.extend(events.run);
        all.cloud.extend(events.cloud);
        all.commands.extend(events.commands);
        all.release |= events.release;
        (all, std::mem::take(&mut self.joined))
    }

    /// Whether staged results wait for the join; if so, the join is about to run on
    /// them.
    fn begin_join(&mut self) -> bool {
        let unjoined = std::mem::take(&mut self.unjoined);
        if unjoined {
            self.joined = true;
        }
        unjoined
    }

    /// Whether nothing waits for a commit (then no join ran on anything uncommitted).
    fn nothing_to_commit(&mut self) -> bool {
        if self.staged.is_empty() {
            self.joined = false;
            return true;
        }
        false
    }

    /// Holds what is staged for the run's next commit, `linger` after `now` at the latest
    /// (unless a deadline is set already).
    fn linger(&mut self, now: SystemTime, linger: Duration) {
        if self.flush_at.is_none() {
            // `joined` stays set: the commit that carries the results still follows
            // the join that ran on them.
            self.flush_at = Some(now + linger);
        }
    }
}

impl RunActor {
    /// Commits the run as it is now with the staged events and then `events`, as one
    /// new version.
    pub(super) async fn commit(&mut self, events: Events) -> Result<(), StoreError> {
        let (all, joined) = self.staging.drain(events);
        let dispatches = all
            .run
            .iter()
            .any(|e| matches!(e.kind, Some(Kind::Dispatched(_))));
        if joined {
            self.deps.crash.at(CrashPoint::DuringJoin);
        }
        Arc::make_mut(&mut self.run).version += 1;
        Arc::make_mut(&mut self.run).updated_at = Some(to_timestamp(self.deps.clock.now()));
        self.deps.store.commit_shared(&self.run, &all).await?;
        if dispatches {
            self.deps.crash.at(CrashPoint::AfterDispatch);
        }
        Ok(())
    }

    /// Takes a dispatch's report or a dispatch's outcome, staging what it changes for
    /// the next commit ([`RunActor::settle`]).
    pub(super) async fn take(&mut self, msg: Msg) -> Result<(), StoreError> {
        match msg {
            Msg::Dispatched {
                index,
                worker_id,
                attempt,
            } => {
                let e = self.dispatched(index, worker_id, attempt);
                self.staging.stage_event(e);
                Ok(())
            }
            Msg::Outcome {
                index,
                attempt,
                worker_id,
                outcome,
            } => {
                self.deps.crash.at(CrashPoint::ResultInFlight);
                self.tasks_in_flight = self.tasks_in_flight.saturating_sub(1);
                self.on_outcome(index, attempt, worker_id, *outcome).await
            }
            _ => unreachable!("only dispatches and outcomes are taken"),
        }
    }

    /// Runs the join on the staged results (if any) and commits what is staged, or,
    /// when that decided nothing, holds it for the run's next commit: at the latest
    /// `commit_linger` from now (see [`crate::Config::commit_linger`]).
    pub(super) async fn settle(&mut self) -> Result<(), StoreError> {
        if self.staging.begin_join() {
            self.join_step("result").await?;
        }
        if self.staging.nothing_to_commit() {
            return Ok(());
        }
        let linger = self.deps.settings.commit_linger;
        if self.terminal() || linger.is_zero() {
            self.commit(Events::default()).await?;
        } else {
            let now = self.deps.clock.now();
            self.staging.linger(now, linger);
        }
        Ok(())
    }
}
