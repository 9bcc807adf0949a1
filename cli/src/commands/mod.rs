//! The client commands: `run` and `events` here, the rest by concern (`runs`,
//! `approvals`, `evidence`).

use std::collections::HashMap;
use std::io::IsTerminal as _;
use std::time::Duration;

use anyhow::Context as _;
use convene_proto::v1::{self, approval_server::Approval as _, run_event::Kind};
use futures::StreamExt as _;
use indicatif::{MultiProgress, ProgressBar, ProgressStyle};

use crate::client::Client;
use crate::report;

mod approvals;
mod evidence;
mod runs;

pub use approvals::{ApprovalVerb, approvals_decide, approvals_execute, approvals_list};
pub use evidence::{evidence_verify, print_conversation};
pub use runs::{
    ListFilters, ResolveInput, ResolveOptions, runs_cancel, runs_get, runs_list, runs_resolve,
};

/// Prints a message in the protobuf JSON mapping.
pub fn print_json<T: convene_proto::json::Named>(msg: &T) -> anyhow::Result<()> {
    println!(
        "{}",
        serde_json::to_string_pretty(&convene_proto::json::to_value(msg)?)?
    );
    Ok(())
}

/// Options of `convene run`.
#[derive(Debug, Clone, Default)]
pub struct RunOptions {
    /// Print the final Run as JSON instead of the assessment.
    pub json: bool,
    /// Return as soon as the run is accepted.
    pub detach: bool,
    /// Base URL of a Jaeger UI, for a link to the trace.
    pub jaeger: Option<String>,
}

/// `convene run FILE` or `convene run --template ID`: submits `start` (a spec read from
/// the file with [`crate::spec::load`] before the client is resolved, or a template and
/// its inputs), follows and reports the run. Returns the final run.
pub async fn run(
    client: &Client,
    start: v1::StartRunRequest,
    opts: &RunOptions,
) -> anyhow::Result<v1::Run> {
    let supervisor = client.supervisor()?;
    let started = supervisor
        .start_run(client.request(v1::StartRunRequest {
            wait: false,
            ..start
        }))
        .await
        .map_err(|s| client.explain(&s))?
        .into_inner();
    let run = started
        .run
        .context("the supervisor accepted the run but returned none")?;
    if opts.detach {
        if opts.json {
            println!("{}", serde_json::json!({ "runId": run.run_id }));
        } else {
            println!("{}", run.run_id);
        }
        return Ok(run);
    }
    if !opts.json {
        if started.created {
            let plan = match run.spec.as_ref().and_then(|s| s.planner.as_ref()) {
                Some(p) => format!("planned by {}", p.profile_id),
                None => format!("{} delegation(s)", run.delegations.len()),
            };
            println!(
                "Run {} accepted: {plan}; trace {}",
                run.run_id, run.trace_id
            );
        } else {
            println!(
                "Run {} already exists for this idempotency key; following it",
                run.run_id
            );
        }
    }
    let waited = follow(client, &run, !opts.json).await?;
    let run = get_run(client, &run.run_id).await?;
    if opts.json {
        print_json(&run)?;
    } else {
        let approvals = approvals_of(client, &run).await;
        println!(
            "\n{}",
            report::assessment(&run, &approvals, opts.jaeger.as_deref())
        );
        let reason = waited.as_ref().map(|w| w.reason.as_str());
        print!("{}", report::waiting(&run, reason));
    }
    Ok(run)
}

/// The run as it stands (GetRun).
pub async fn get_run(client: &Client, run_id: &str) -> anyhow::Result<v1::Run> {
    client
        .supervisor()?
        .get_run(client.request(v1::GetRunRequest {
            run_id: run_id.to_owned(),
        }))
        .await
        .map_err(|s| client.explain(&s))?
        .into_inner()
        .run
        .context("the supervisor returned no run")
}

async fn approvals_of(client: &Client, run: &v1::Run) -> Vec<v1::ApprovalRequest> {
    if run.approval_ids.is_empty() {
        return Vec::new();
    }
    let Ok(approval) = client.approval() else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for id in &run.approval_ids {
        if let Ok(r) = approval
            .get_approval(client.request(v1::GetApprovalRequest {
                approval_id: id.clone(),
            }))
            .await
            && let Some(a) = r.into_inner().approval
        {
            out.push(a);
        }
    }
    out
}

/// Follows a run's events until it stops, one line per delegation (a live progress
/// display when attached to a terminal): until it ends (a `terminal` event) or waits
/// for people (a `waiting` event of the wait the run is in now, which is returned).
async fn follow(
    client: &Client,
    run: &v1::Run,
    show: bool,
) -> anyhow::Result<Option<v1::RunWaiting>> {
    let supervisor = client.supervisor()?;
    let mut stream = supervisor
        .watch_run(client.request(v1::WatchRunRequest {
            run_id: run.run_id.clone(),
            after_sequence: 0,
        }))
        .await
        .map_err(|s| client.explain(&s))?
        .into_inner();
    let tty = show && std::io::stdout().is_terminal();
    let multi = MultiProgress::new();
    let style = ProgressStyle::with_template("  {spinner} {prefix:<10} {wide_msg}")
        .unwrap_or_else(|_| ProgressStyle::default_spinner());
    let mut bars: HashMap<String, ProgressBar> = HashMap::new();
    let mut names: HashMap<String, String> = run
        .delegations
        .iter()
        .filter_map(|d| {
            d.task
                .as_ref()
                .map(|t| (t.delegation_id.clone(), t.name.clone()))
        })
        .collect();
    let mut line = |id: &str, msg: String, done: bool, names: &HashMap<String, String>| {
        let name = names.get(id).cloned().unwrap_or_else(|| id.to_owned());
        if tty {
            let bar = bars.entry(id.to_owned()).or_insert_with(|| {
                let b = multi.add(ProgressBar::new_spinner());
                b.set_style(style.clone());
                b.set_prefix(name.clone());
                b.enable_steady_tick(Duration::from_millis(100));
                b
            });
            if done {
                bar.finish_with_message(msg);
            } else {
                bar.set_message(msg);
            }
        } else if show {
            println!("  {name:<10} {msg}");
        }
    };
    let mut waited = None;
    while let Some(item) = stream.next().await {
        let event = item
            .map_err(|s| client.explain(&s))?
            .event
            .unwrap_or_default();
        match event.kind {
            Some(Kind::Dispatched(d)) => {
                names
                    .entry(d.delegation_id.clone())
                    .or_insert(d.name.clone());
                let depth = if d.depth > 1 {
                    format!(" (nested, depth {})", d.depth)
                } else {
                    String::new()
                };
                line(
                    &d.delegation_id,
                    format!(
                        "dispatched to {} (attempt {}){depth}",
                        d.worker_id, d.attempt
                    ),
                    false,
                    &names,
                );
            }
            Some(Kind::Completed(c)) => {
                let status = v1::TaskStatus::try_from(c.status)
                    .map_or("?", |s| s.as_str_name().trim_start_matches("TASK_STATUS_"));
                let late = if c.late { " (late)" } else { "" };
                line(
                    &c.delegation_id,
                    format!("{status}{late}: {}", c.summary),
                    true,
                    &names,
                );
            }
            Some(Kind::Decision(d)) => {
                let text = format!(
                    "  join       revision {}: {}",
                    d.revision,
                    v1::JoinOutcome::try_from(d.outcome).map_or("?", |o| o.as_str_name())
                );
                if tty {
                    let _ = multi.println(text);
                } else if show {
                    println!("{text}");
                }
            }
            Some(Kind::Planned(t)) => {
                let text = format!("  round {:<4} {}", t.round, planned_line(&t));
                if tty {
                    let _ = multi.println(text);
                } else if show {
                    println!("{text}");
                }
            }
            Some(Kind::Resumed(r)) => {
                let detail = if r.detail.is_empty() {
                    String::new()
                } else {
                    format!(": {}", r.detail)
                };
                let text = format!("  resumed    {} by {}{detail}", r.input, r.by);
                if tty {
                    let _ = multi.println(text);
                } else if show {
                    println!("{text}");
                }
            }
            Some(Kind::Waiting(w)) => {
                // Watched from the start, a run that waited before and was resumed
                // replays that wait too: stop only at the wait the run is in now.
                if waits_now(client, &run.run_id, &w).await? {
                    waited = Some(w);
                    break;
                }
            }
            Some(Kind::Terminal(_)) => break,
            Some(Kind::Started(_)) | None => {}
        }
    }
    for bar in bars.values() {
        if !bar.is_finished() {
            bar.finish_with_message("no result before the decision");
        }
    }
    Ok(waited)
}

/// Whether `run_id` is still in the wait the `waiting` event announced (or waits with
/// no ticket to tell waits apart). A run that moved on has later events to follow.
async fn waits_now(client: &Client, run_id: &str, event: &v1::RunWaiting) -> anyhow::Result<bool> {
    let run = get_run(client, run_id).await?;
    Ok(report::is_waiting(run.state)
        && match (&run.ticket, &event.ticket) {
            (Some(now), Some(then)) => now.id == then.id,
            _ => true,
        })
}

/// What a planner's committed turn did, in one line: its delegations and refusals.
fn planned_line(t: &v1::PlannerTurn) -> String {
    let delegated = t
        .calls
        .iter()
        .filter(|c| !c.delegation_id.is_empty())
        .count();
    let refused: Vec<&str> = t
        .calls
        .iter()
        .filter(|c| !c.error.is_empty())
        .map(|c| c.error.as_str())
        .collect();
    let finished = t
        .calls
        .iter()
        .any(|c| c.tool == "finish" && c.error.is_empty());
    let mut parts = vec![format!("planner turn {}", t.turn)];
    if delegated > 0 {
        parts.push(format!("delegated {delegated}"));
    }
    if finished {
        parts.push("finished".to_owned());
    }
    if t.calls.is_empty() {
        parts.push("answered in plain text".to_owned());
    }
    for r in refused {
        parts.push(format!("refused: {r}"));
    }
    parts.join("; ")
}

/// Options of `convene events`.
#[derive(Debug, Clone, Default)]
pub struct EventsOptions {
    /// Start after this event id (exclusive); None: from the oldest event.
    pub after: Option<String>,
    /// Keep following new events (reconnecting from the last one printed when the
    /// stream breaks) instead of stopping at the end of the backlog.
    pub follow: bool,
    /// Only this run's events.
    pub run_id: Option<String>,
    /// Only these types (full, `dev.convene.run.completed.v1`, or short, `run.completed`).
    pub types: Vec<String>,
    /// Print each event as one line of JSON (the CloudEvents JSON format).
    pub json: bool,
}

/// The full CloudEvents type for a `--type` value: `run.completed` stands for
/// `dev.convene.run.completed.v1`; a full type is kept.
pub fn event_type(given: &str) -> String {
    let given = given.trim();
    if given.starts_with("dev.convene.") {
        given.to_owned()
    } else {
        format!("dev.convene.{given}.v1")
    }
}

/// `convene events`: prints the tenant's events from the supervisor's outbox in commit
/// order, one per line: as CloudEvents JSON (`--json`), or as `time type subject id`.
/// With `follow` it keeps printing new events and, when the stream breaks (the
/// supervisor restarts), resumes after the last event printed, so none is missed or
/// printed twice. Returns how many events it printed.
pub async fn events(client: &Client, opts: &EventsOptions) -> anyhow::Result<usize> {
    let supervisor = client.supervisor()?;
    let types: Vec<String> = opts.types.iter().map(|t| event_type(t)).collect();
    let mut after = opts.after.clone();
    let mut printed = 0;
    let mut retry = Duration::from_millis(200);
    loop {
        let opened = supervisor
            .watch_events(client.request(v1::WatchEventsRequest {
                after_event_id: after.clone().unwrap_or_default(),
                types: types.clone(),
                run_id: opts.run_id.clone().unwrap_or_default(),
                follow: opts.follow,
                from_now: false,
            }))
            .await;
        let mut stream = match opened {
            Ok(s) => s.into_inner(),
            Err(s) if opts.follow && printed > 0 && s.code() == tonic::Code::Unavailable => {
                tokio::time::sleep(retry).await;
                retry = (retry * 2).min(Duration::from_secs(5));
                continue;
            }
            Err(s) => return Err(client.explain(&s)),
        };
        let broke = loop {
            match stream.next().await {
                None => break None,
                Some(Err(s)) => break Some(s),
                Some(Ok(item)) => {
                    let Some(event) = item.event else { continue };
                    if opts.json {
                        println!(
                            "{}",
                            serde_json::to_string(&convene_supervisor::events::to_json(&event))?
                        );
                    } else {
                        println!("{}", event_line(&event));
                    }
                    printed += 1;
                    retry = Duration::from_millis(200);
                    after = Some(event.id);
                }
            }
        };
        match broke {
            None => return Ok(printed),
            Some(s) if opts.follow && s.code() == tonic::Code::Unavailable => {
                eprintln!(
                    "convene events: the stream broke ({}); resuming after {}",
                    s.message(),
                    after.as_deref().unwrap_or("the start")
                );
                tokio::time::sleep(retry).await;
            }
            Some(s) => return Err(client.explain(&s)),
        }
    }
}

/// One event as a line of text: time (RFC 3339), short type, subject, id.
fn event_line(event: &v1::CloudEvent) -> String {
    let json = convene_supervisor::events::to_json(event);
    let time = json["time"].as_str().unwrap_or_default();
    let short = event
        .r#type
        .strip_prefix("dev.convene.")
        .and_then(|t| t.strip_suffix(".v1"))
        .unwrap_or(&event.r#type);
    format!("{time}  {short:<20} {}  {}", event.subject, event.id)
}
