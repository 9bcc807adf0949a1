//! Live updates: a run page's events as server-sent events
//! (`/console/runs/{id}/events`, from `WatchRun`), an approval request's
//! (`/console/approvals/{id}/events`, from the approval service's `WatchEvents` for its
//! run), and the few lines of script that,
//! where scripts run, fetch the page again when one arrives and swap its content in.
//! Without scripts the page is whole as loaded; a reload shows what changed.
//!
//! A stream lasts as long as its session ([`while_signed`]): it ends at sign-out, at the
//! session's expiry, and when a check every [`Console::live_recheck`] finds the session
//! closed (on another replica). A role taken away in the policy file takes effect when
//! the gateway restarts with it: the restart ends every stream, and the session opens
//! none again.

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Path, Query, State};
use axum::http::header;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use convene_proto::v1;
use futures::{Stream, StreamExt as _};
use tokio::sync::watch;
use tokio::time::{Instant, Interval, MissedTickBehavior};

use super::{Console, Signed};

/// The script, served at `/console/assets/console.js`.
pub const SCRIPT: &str = include_str!("console.js");

/// The name of an event's kind, as the stream sends it (`dispatched`, `terminal`, ...).
fn kind_name(event: &v1::RunEvent) -> &'static str {
    use v1::run_event::Kind;
    match &event.kind {
        Some(Kind::Dispatched(_)) => "dispatched",
        Some(Kind::Completed(_)) => "completed",
        Some(Kind::Terminal(_)) => "terminal",
        Some(Kind::Waiting(_)) => "waiting",
        Some(_) => "changed",
        None => "unknown",
    }
}

/// What a live stream follows its session with.
struct Follow {
    events: Pin<Box<dyn Stream<Item = Result<Event, Infallible>> + Send>>,
    console: Arc<Console>,
    token: String,
    expires: Instant,
    recheck: Interval,
    sign_outs: watch::Receiver<u64>,
}

/// Whether the session of `token` still holds; sessions that cannot be read end the
/// stream (the browser reconnects and is answered as its session is then).
async fn still_signed(console: &Console, token: &str) -> bool {
    match console.signed(token).await {
        Ok(session) => session.is_some(),
        Err(e) => {
            tracing::warn!(error = %e, "console sessions cannot be read: a live stream ends");
            false
        }
    }
}

/// `events` for as long as `signed`'s session lasts: they end at its expiry, at a
/// sign-out on this replica that closed it, and at the first check (every
/// [`Console::live_recheck`]) that finds it closed (the check also asks for the
/// viewing role, which changes only with the policy a gateway starts with).
pub fn while_signed(
    console: Arc<Console>,
    signed: &Signed,
    events: impl Stream<Item = Result<Event, Infallible>> + Send + 'static,
) -> impl Stream<Item = Result<Event, Infallible>> + Send + 'static {
    let left = signed.session.expires_at.saturating_sub(super::now_ms());
    let expires = Instant::now() + Duration::from_millis(u64::try_from(left).unwrap_or(0));
    let every = console.live_recheck.max(Duration::from_millis(1));
    let mut recheck = tokio::time::interval_at(Instant::now() + every, every);
    recheck.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let mut sign_outs = console.sign_outs.subscribe();
    sign_outs.mark_unchanged();
    let follow = Follow {
        events: Box::pin(events),
        console,
        token: signed.token.clone(),
        expires,
        recheck,
        sign_outs,
    };
    futures::stream::unfold(follow, |mut follow| async move {
        loop {
            tokio::select! {
                event = follow.events.next() => return event.map(|e| (e, follow)),
                () = tokio::time::sleep_until(follow.expires) => return None,
                _ = follow.recheck.tick() => {}
                changed = follow.sign_outs.changed() => {
                    if changed.is_err() {
                        return None;
                    }
                }
            }
            if !still_signed(&follow.console, &follow.token).await {
                return None;
            }
        }
    })
}

/// Where a stream starts.
#[derive(Debug, Default, serde::Deserialize)]
pub struct After {
    /// The last event the page shows (the run's version when it was rendered); unset:
    /// from now on.
    pub after: Option<u64>,
}

/// `GET /console/runs/{id}/events?after=N`: one `changed` event per run event after
/// the `N`th, its data the event's kind and sequence.
pub async fn events(
    State(console): State<Arc<Console>>,
    signed: Signed,
    Path(run_id): Path<String>,
    Query(after): Query<After>,
) -> Response {
    let after_sequence = match after.after {
        Some(n) => n,
        None => match console
            .supervisor
            .get_run(console.request(
                &signed.session,
                v1::GetRunRequest {
                    run_id: run_id.clone(),
                },
            ))
            .await
        {
            Ok(got) => got.into_inner().run.map_or(0, |r| r.version),
            Err(status) => return console.refused(&status, &signed.session),
        },
    };
    let watched = console
        .supervisor
        .watch_run(console.request(
            &signed.session,
            v1::WatchRunRequest {
                run_id,
                after_sequence,
            },
        ))
        .await;
    match watched {
        Ok(stream) => {
            let events = stream.into_inner().filter_map(|item| async move {
                let event = item.ok()?.event?;
                Some(Ok::<_, Infallible>(
                    Event::default().event("changed").data(format!(
                        "{} {}",
                        kind_name(&event),
                        event.sequence
                    )),
                ))
            });
            Sse::new(while_signed(console.clone(), &signed, events))
                .keep_alive(KeepAlive::new().interval(Duration::from_secs(15)))
                .into_response()
        }
        Err(status) => console.refused(&status, &signed.session),
    }
}

/// Where an approval request's stream starts.
#[derive(Debug, Default, serde::Deserialize)]
pub struct Since {
    /// When the page was rendered, in milliseconds since the Unix epoch: earlier events
    /// are what the page shows already.
    #[serde(default)]
    pub since: i64,
}

fn millis(ts: Option<&prost_types::Timestamp>) -> i64 {
    ts.map_or(0, |t| {
        t.seconds
            .saturating_mul(1000)
            .saturating_add(i64::from(t.nanos) / 1_000_000)
    })
}

/// `GET /console/approvals/{id}/events?since=MS`: one `changed` event per approval
/// event of the request's run from `since` on (votes, executions, expiries), from the
/// approval service's `WatchEvents` (following, for that run only).
pub async fn approval_events(
    State(console): State<Arc<Console>>,
    signed: Signed,
    Path(approval_id): Path<String>,
    Query(since): Query<Since>,
) -> Response {
    let approval = match console
        .approval
        .get_approval(console.request(&signed.session, v1::GetApprovalRequest { approval_id }))
        .await
    {
        Ok(got) => got.into_inner().approval.unwrap_or_default(),
        Err(status) => return console.refused(&status, &signed.session),
    };
    let watched = console
        .approval
        .watch_events(console.request(
            &signed.session,
            v1::ApprovalWatchEventsRequest {
                after_event_id: String::new(),
                follow: true,
                run_id: approval.run_id,
            },
        ))
        .await;
    match watched {
        Ok(stream) => {
            let from = since.since;
            let events = stream.into_inner().filter_map(move |item| async move {
                let event = item.ok()?.event?;
                (millis(event.time.as_ref()) >= from).then(|| {
                    Ok::<_, Infallible>(Event::default().event("changed").data(event.r#type))
                })
            });
            Sse::new(while_signed(console.clone(), &signed, events))
                .keep_alive(KeepAlive::new().interval(Duration::from_secs(15)))
                .into_response()
        }
        Err(status) => console.refused(&status, &signed.session),
    }
}

/// `GET /console/assets/console.js`.
pub async fn script() -> impl IntoResponse {
    (
        [
            (header::CONTENT_TYPE, "text/javascript; charset=utf-8"),
            (header::CACHE_CONTROL, "max-age=3600"),
        ],
        SCRIPT,
    )
}
