//! Commands for runs on any replica, and the approval service's events.
//!
//! CancelRun and ResumeRun store a [`RunCommand`] in the run store, whichever replica
//! receives them, and then nudge the run ([`nudge`]): its actor in this process is told
//! at once; a waiting run nobody holds is claimed here and resumed to apply it; a run
//! another replica owns is left to that replica, whose poll ([`spawn`], every
//! [`POLL_INTERVAL`]) finds the command and hands it to the run's actor. A replica that
//! takes a run over after a crash applies the commands it finds before anything else.
//! The caller waits a little for the outcome ([`outcome`]) and otherwise answers that
//! the command is pending.
//!
//! The supervisor follows the approval service's event stream
//! (`Approval.WatchEvents`, from the cursor it acknowledged last): each event is added
//! to this store's outbox (so `WatchEvents` and the relay carry it), and each change of
//! a request filed for a run becomes an approval command for that run.

use std::sync::Arc;
use std::time::Duration;

use convene_core::time::to_timestamp;
use convene_mesh::auth::request;
use convene_proto::v1;
use futures::{FutureExt as _, StreamExt as _};
use tonic::Code;

use crate::Deps;
use crate::events;
use crate::run::{Msg, RunActor};
use crate::store::{CommandDone, CommandKind, RunCommand, StoreError, is_final, is_waiting};

/// How often a replica looks for commands stored for runs.
pub(crate) const POLL_INTERVAL: Duration = Duration::from_millis(250);

/// How long CancelRun and ResumeRun wait for their command's outcome before answering
/// that it is pending.
pub(crate) const WAIT: Duration = Duration::from_secs(10);

/// The cursor name under which the approval events this store imported are
/// acknowledged.
const APPROVAL_CURSOR: &str = "approval-events";

/// Events taken from the approval stream into one write, at most.
const APPROVAL_BATCH: usize = 256;

/// A new command of `principal` for `run_id`.
pub(crate) fn command(deps: &Deps, run_id: &str, principal: &str, kind: CommandKind) -> RunCommand {
    RunCommand {
        command_id: uuid::Uuid::now_v7().to_string(),
        run_id: run_id.to_owned(),
        principal: principal.to_owned(),
        created_at: Some(to_timestamp(deps.clock.now())),
        kind: Some(kind),
    }
}

/// Gets the run's pending commands applied, as far as this replica can: by the run's
/// actor here, or by claiming the waiting run; commands of a run that ended are closed.
pub(crate) async fn nudge(deps: &Arc<Deps>, run_id: &str) -> Result<(), StoreError> {
    let live = deps
        .live
        .lock()
        .expect("live map lock poisoned")
        .get(run_id)
        .map(|live| live.mailbox.clone());
    if let Some(mailbox) = live
        && mailbox.send(Msg::Commands).is_ok()
    {
        return Ok(());
    }
    let Some(run) = deps.store.get(run_id).await? else {
        return Ok(());
    };
    if is_final(run.state) {
        // Nobody will apply them: say so.
        let pending = deps.store.pending_commands(run_id).await?;
        let ended: Vec<CommandDone> = pending
            .iter()
            .map(|c| {
                let state = events::run_state_name(run.state);
                match c.kind {
                    Some(CommandKind::Resume(_)) => CommandDone {
                        command_id: c.command_id.clone(),
                        code: Code::FailedPrecondition as i32,
                        message: format!("run {run_id} has ended ({state}); it cannot be resumed"),
                    },
                    _ => CommandDone {
                        command_id: c.command_id.clone(),
                        code: Code::Ok as i32,
                        message: format!("the run had ended already ({state})"),
                    },
                }
            })
            .collect();
        return deps.store.end_commands(&ended).await;
    }
    if !is_waiting(run.state) {
        // Running: its owner applies them (or whoever takes it over).
        return Ok(());
    }
    let leased_at = std::time::Instant::now();
    let claimed = match &deps.lease {
        Some(lease) => {
            deps.store
                .claim_waiting(&lease.owner, run_id, lease.ttl)
                .await?
        }
        None => Some(run),
    };
    if let Some(run) = claimed {
        tracing::info!(
            run_id,
            "a command for a waiting run: resuming it to apply it"
        );
        RunActor::resume(deps.clone(), run, leased_at);
    }
    Ok(())
}

/// The command's outcome, waiting for it at most `wait`; `None` when it is still
/// pending then.
pub(crate) async fn outcome(
    deps: &Deps,
    command_id: &str,
    wait: Duration,
) -> Result<Option<CommandDone>, StoreError> {
    let until = tokio::time::Instant::now() + wait;
    let mut pause = Duration::from_millis(5);
    loop {
        if let Some(done) = deps.store.command_outcome(command_id).await? {
            return Ok(Some(done));
        }
        if tokio::time::Instant::now() >= until {
            return Ok(None);
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(Duration::from_millis(100));
    }
}

/// Starts the poll for commands and the follower of the approval service's events,
/// until the supervisor shuts down.
pub(crate) fn spawn(deps: Arc<Deps>) {
    tokio::spawn(poll(deps.clone()));
    tokio::spawn(follow_approvals(deps));
}

async fn poll(deps: Arc<Deps>) {
    let stop = deps.shutdown_token.clone();
    let mut tick = tokio::time::interval(POLL_INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            () = stop.cancelled() => return,
        }
        let runs = match deps.store.runs_with_commands().await {
            Ok(runs) => runs,
            Err(error) => {
                tracing::warn!(%error, "commands for runs cannot be read; trying again");
                continue;
            }
        };
        for run_id in runs {
            if let Err(error) = nudge(&deps, &run_id).await {
                tracing::warn!(%run_id, %error, "a command for the run could not be handed on; trying again");
            }
        }
    }
}

/// Follows `Approval.WatchEvents` from the acknowledged cursor, reconnecting after a
/// pause when the stream breaks.
async fn follow_approvals(deps: Arc<Deps>) {
    let stop = deps.shutdown_token.clone();
    let mut failing = false;
    loop {
        let followed = tokio::select! {
            r = follow_once(&deps) => r,
            () = stop.cancelled() => return,
        };
        match followed {
            Ok(()) => failing = false,
            Err(error) if !failing => {
                failing = true;
                tracing::warn!(%error, "the approval service's events cannot be followed; trying again every second");
            }
            Err(_) => {}
        }
        tokio::select! {
            () = tokio::time::sleep(Duration::from_secs(1)) => {}
            () = stop.cancelled() => return,
        }
    }
}

async fn follow_once(deps: &Arc<Deps>) -> Result<(), String> {
    let after = deps
        .store
        .relay_cursor(APPROVAL_CURSOR)
        .await
        .map_err(|e| e.to_string())?
        .unwrap_or_default();
    let mut stream = deps
        .approval
        .watch_events(request(
            v1::ApprovalWatchEventsRequest {
                after_event_id: after,
                follow: true,
                run_id: String::new(),
            },
            &deps.credential,
        ))
        .await
        .map_err(|s| s.message().to_owned())?
        .into_inner();
    loop {
        let Some(first) = stream.next().await else {
            return Ok(());
        };
        let mut batch = vec![first.map_err(|s| s.message().to_owned())?];
        // What else is ready goes in the same write.
        while batch.len() < APPROVAL_BATCH {
            match stream.next().now_or_never() {
                Some(Some(item)) => batch.push(item.map_err(|s| s.message().to_owned())?),
                _ => break,
            }
        }
        let events: Vec<v1::CloudEvent> = batch.into_iter().filter_map(|r| r.event).collect();
        deps.crash
            .at(crate::crash::CrashPoint::ApprovalEventReceived);
        take_approval_events(deps, &events)
            .await
            .map_err(|e| e.to_string())?;
    }
}

/// Adds approval events to the outbox, turns the changes of runs' requests into
/// commands for those runs, and moves the cursor past them.
async fn take_approval_events(
    deps: &Arc<Deps>,
    events: &[v1::CloudEvent],
) -> Result<(), StoreError> {
    let Some(last) = events.last() else {
        return Ok(());
    };
    deps.store.import_events(events).await?;
    let mut runs = Vec::new();
    for e in events {
        // A new request changes nothing the run does not know: it filed it.
        if e.correlation_id.is_empty() || e.r#type.ends_with(".requested.v1") {
            continue;
        }
        // The event id makes the command's: taking the same event twice (two replicas,
        // a restart before the cursor moved) stores it once.
        let command = RunCommand {
            command_id: format!("approval-event-{}", e.id),
            run_id: e.correlation_id.clone(),
            principal: "approval".to_owned(),
            created_at: e.time,
            kind: Some(CommandKind::Approval(e.clone())),
        };
        deps.store.add_command(&command).await?;
        if !runs.contains(&e.correlation_id) {
            runs.push(e.correlation_id.clone());
        }
    }
    deps.store.acknowledge(APPROVAL_CURSOR, &last.id).await?;
    for run_id in runs {
        nudge(deps, &run_id).await?;
    }
    Ok(())
}
