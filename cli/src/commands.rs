//! The client commands.

use std::collections::HashMap;
use std::io::IsTerminal as _;
use std::time::Duration;

use anyhow::Context as _;
use convene_proto::v1::{
    self, approval_server::Approval as _, evidence_store_server::EvidenceStore as _,
    run_event::Kind,
};
use futures::StreamExt as _;
use indicatif::{MultiProgress, ProgressBar, ProgressStyle};

use crate::client::Client;
use crate::report;
use convene_mesh::handles::GrpcApproval;

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

/// `convene run FILE`: submits `spec` (read from the file with [`crate::spec::load`] before
/// the client is resolved), follows and reports the run. Returns the final run.
pub async fn run(client: &Client, spec: v1::RunSpec, opts: &RunOptions) -> anyhow::Result<v1::Run> {
    let supervisor = client.supervisor()?;
    let started = supervisor
        .start_run(client.request(v1::StartRunRequest {
            spec: Some(spec),
            wait: false,
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
async fn get_run(client: &Client, run_id: &str) -> anyhow::Result<v1::Run> {
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

/// `convene runs get`.
pub async fn runs_get(
    client: &Client,
    run_id: &str,
    json: bool,
    jaeger: Option<&str>,
) -> anyhow::Result<v1::Run> {
    let run = client
        .supervisor()?
        .get_run(client.request(v1::GetRunRequest {
            run_id: run_id.to_owned(),
        }))
        .await
        .map_err(|s| client.explain(&s))?
        .into_inner()
        .run
        .context("the supervisor returned no run")?;
    if json {
        print_json(&run)?;
    } else {
        let approvals = approvals_of(client, &run).await;
        println!("{}", report::assessment(&run, &approvals, jaeger));
        print!("{}", report::waiting(&run, None));
    }
    Ok(run)
}

/// `convene runs list`.
pub async fn runs_list(
    client: &Client,
    states: Vec<i32>,
    limit: u32,
    json: bool,
) -> anyhow::Result<()> {
    let resp = client
        .supervisor()?
        .list_runs(client.request(v1::ListRunsRequest {
            page_size: limit,
            page_token: String::new(),
            states,
        }))
        .await
        .map_err(|s| client.explain(&s))?
        .into_inner();
    if json {
        return print_json(&resp);
    }
    if resp.runs.is_empty() {
        println!("No runs.");
    }
    for r in &resp.runs {
        let goal = r.spec.as_ref().map(|s| s.goal.clone()).unwrap_or_default();
        let goal: String = goal.chars().take(60).collect();
        println!("{}  {:<17} {}", r.run_id, report::one_line_state(r), goal);
    }
    if !resp.next_page_token.is_empty() {
        println!("(more runs exist; raise --limit)");
    }
    Ok(())
}

/// A command's response (CancelRunResponse, ResumeRunResponse) in the protobuf JSON
/// mapping: `run`, `outcome` and `commandId`, default values left out.
fn command_json(
    run: Option<&v1::Run>,
    outcome: i32,
    command_id: &str,
) -> anyhow::Result<serde_json::Value> {
    let mut out = serde_json::Map::new();
    if let Some(run) = run {
        out.insert("run".to_owned(), convene_proto::json::to_value(run)?);
    }
    if outcome != 0 {
        out.insert(
            "outcome".to_owned(),
            match v1::CommandOutcome::try_from(outcome) {
                Ok(o) => serde_json::Value::from(o.as_str_name()),
                Err(_) => serde_json::Value::from(outcome),
            },
        );
    }
    if !command_id.is_empty() {
        out.insert("commandId".to_owned(), command_id.into());
    }
    Ok(serde_json::Value::Object(out))
}

/// `convene runs cancel`: says whether the run is cancelled, the cancellation is
/// pending with the replica that owns the run, or the run had already ended; `json`
/// prints the CancelRunResponse.
pub async fn runs_cancel(
    client: &Client,
    run_id: &str,
    reason: &str,
    json: bool,
) -> anyhow::Result<v1::CancelRunResponse> {
    let resp = client
        .supervisor()?
        .cancel_run(client.request(v1::CancelRunRequest {
            run_id: run_id.to_owned(),
            reason: reason.to_owned(),
        }))
        .await
        .map_err(|s| client.explain(&s))?
        .into_inner();
    if json {
        let value = command_json(resp.run.as_ref(), resp.outcome, &resp.command_id)?;
        println!("{}", serde_json::to_string_pretty(&value)?);
        return Ok(resp);
    }
    let run = resp.run.clone().unwrap_or_default();
    match v1::CommandOutcome::try_from(resp.outcome) {
        Ok(v1::CommandOutcome::Applied) => {
            println!("Cancelled: {}", report::one_line(&run));
        }
        Ok(v1::CommandOutcome::Pending) => println!(
            "Cancellation stored (command {}): the replica that owns run {run_id} applies it; \
             follow it with `convene runs get {run_id}`.",
            resp.command_id
        ),
        Ok(v1::CommandOutcome::AlreadyEnded) => println!(
            "Nothing to cancel: the run had already ended. {}",
            report::one_line(&run)
        ),
        _ => println!("{}", report::one_line(&run)),
    }
    Ok(resp)
}

/// A person's input to a waiting run (`convene runs resolve`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ResolveInput {
    /// Settle the conflict on `topic` by choosing one side.
    Settle {
        /// The conflict's topic.
        topic: String,
        /// The chosen side: a delegation id, or the delegation's name.
        delegation: String,
        /// Evidence ids the decision relies on.
        evidence_ids: Vec<String>,
    },
    /// Ask for a follow-up delegation.
    FollowUp {
        /// A conflict the follow-up is about: checked to be open, not sent.
        topic: Option<String>,
        /// The worker profile to ask.
        profile_id: String,
        /// What it must establish.
        goal: String,
    },
    /// Close the run as it stands.
    Close {
        /// A conflict the closing is about: checked to be open, not sent.
        topic: Option<String>,
    },
}

/// Options of `convene runs resolve`.
#[derive(Debug, Clone)]
pub struct ResolveOptions {
    /// The run.
    pub run_id: String,
    /// The input.
    pub input: ResolveInput,
    /// Why, in the person's words.
    pub rationale: String,
    /// The ticket of the wait decided on; None: the run's current one.
    pub ticket: Option<String>,
    /// Print the ResumeRunResponse as JSON.
    pub json: bool,
}

/// The delegation `given` names in `run`: its id, or the name of one delegation (among
/// the sides of the conflict on `topic` when several share it).
pub fn chosen_delegation(run: &v1::Run, topic: &str, given: &str) -> anyhow::Result<String> {
    let tasks: Vec<&v1::DelegationTask> = run
        .delegations
        .iter()
        .filter_map(|d| d.task.as_ref())
        .collect();
    if tasks.iter().any(|t| t.delegation_id == given) {
        return Ok(given.to_owned());
    }
    let conflict = run
        .decision
        .as_ref()
        .and_then(|d| d.conflicts.iter().find(|c| c.topic == topic));
    let is_side =
        |id: &str| conflict.is_some_and(|c| c.claims.iter().any(|s| s.delegation_id == id));
    let named: Vec<&&v1::DelegationTask> = tasks.iter().filter(|t| t.name == given).collect();
    let sides: Vec<&&v1::DelegationTask> = named
        .iter()
        .copied()
        .filter(|t| is_side(&t.delegation_id))
        .collect();
    match (named.as_slice(), sides.as_slice()) {
        ([one], _) | (_, [one]) => Ok(one.delegation_id.clone()),
        ([], _) => {
            let choices: Vec<String> = match conflict {
                Some(c) => c
                    .claims
                    .iter()
                    .map(|s| {
                        let name = tasks
                            .iter()
                            .find(|t| t.delegation_id == s.delegation_id)
                            .map_or("?", |t| t.name.as_str());
                        format!("{name} ({})", s.delegation_id)
                    })
                    .collect(),
                None => tasks
                    .iter()
                    .map(|t| format!("{} ({})", t.name, t.delegation_id))
                    .collect(),
            };
            anyhow::bail!(
                "run {} has no delegation with id or name {given:?}; choose {}: {}",
                run.run_id,
                if conflict.is_some() {
                    format!("a side of the conflict on {topic}")
                } else {
                    "one of its delegations".to_owned()
                },
                choices.join(", ")
            )
        }
        _ => anyhow::bail!(
            "several delegations of run {} are named {given:?}: {}; pass the delegation id",
            run.run_id,
            named
                .iter()
                .map(|t| t.delegation_id.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        ),
    }
}

/// Refuses a topic on which `run` has no open conflict, naming the open ones.
fn ensure_open_conflict(run: &v1::Run, topic: &str) -> anyhow::Result<()> {
    let open: Vec<&str> = run
        .decision
        .iter()
        .flat_map(|d| &d.conflicts)
        .filter(|c| c.resolution != v1::ConflictResolution::Settled as i32)
        .map(|c| c.topic.as_str())
        .collect();
    anyhow::ensure!(
        open.contains(&topic),
        "run {} has no open conflict on {topic:?}; {}",
        run.run_id,
        if open.is_empty() {
            "it has none open (leave --topic out)".to_owned()
        } else {
            format!("open: {}", open.join(", "))
        }
    );
    Ok(())
}

/// `convene runs resolve`: gives a waiting run a person's input (ResumeRun) under the
/// run's current ticket (or the one given), and says what became of it.
pub async fn runs_resolve(
    client: &Client,
    opts: &ResolveOptions,
) -> anyhow::Result<v1::ResumeRunResponse> {
    anyhow::ensure!(
        !opts.rationale.trim().is_empty(),
        "--rationale is empty: say why, in your words; it is recorded with your decision"
    );
    let run = get_run(client, &opts.run_id).await?;
    anyhow::ensure!(
        !report::is_final(run.state),
        "run {} has ended ({}): it does not wait for people, so there is nothing to resolve",
        run.run_id,
        report::state_name(run.state)
    );
    let input = match &opts.input {
        ResolveInput::Settle {
            topic,
            delegation,
            evidence_ids,
        } => v1::resume_run_request::Input::Settle(v1::SettleConflict {
            topic: topic.clone(),
            delegation_id: chosen_delegation(&run, topic, delegation)?,
            evidence_ids: evidence_ids.clone(),
        }),
        ResolveInput::FollowUp {
            topic,
            profile_id,
            goal,
        } => {
            if let Some(topic) = topic {
                ensure_open_conflict(&run, topic)?;
            }
            v1::resume_run_request::Input::FollowUp(v1::FollowUp {
                profile_id: profile_id.clone(),
                goal: goal.clone(),
            })
        }
        ResolveInput::Close { topic } => {
            if let Some(topic) = topic {
                ensure_open_conflict(&run, topic)?;
            }
            v1::resume_run_request::Input::Close(v1::CloseRun {})
        }
    };
    let current = run
        .ticket
        .as_ref()
        .filter(|_| report::is_waiting(run.state));
    let (ticket, said) = match (&opts.ticket, current) {
        (Some(id), Some(current)) if current.id == *id => (
            current.clone(),
            format!("Using ticket {id} (wait {}), as given.", current.version),
        ),
        (Some(id), _) => (
            v1::RunTicket {
                id: id.clone(),
                ..v1::RunTicket::default()
            },
            format!("Using ticket {id}, as given."),
        ),
        (None, Some(current)) => (
            current.clone(),
            format!(
                "Using the run's current ticket {} (wait {}).",
                current.id, current.version
            ),
        ),
        (None, None) => anyhow::bail!(
            "run {} is {}: it does not wait for people now, so there is nothing to resolve \
             (`convene runs resolve` continues runs in WAITING_INPUT or WAITING_APPROVAL)",
            run.run_id,
            report::state_name(run.state)
        ),
    };
    if opts.json {
        eprintln!("{said}");
    } else {
        println!("{said}");
    }
    let resp = client
        .supervisor()?
        .resume_run(client.request(v1::ResumeRunRequest {
            run_id: opts.run_id.clone(),
            ticket: Some(ticket),
            rationale: opts.rationale.clone(),
            input: Some(input),
        }))
        .await
        .map_err(|s| client.explain(&s))?
        .into_inner();
    if opts.json {
        let value = command_json(resp.run.as_ref(), resp.outcome, &resp.command_id)?;
        println!("{}", serde_json::to_string_pretty(&value)?);
        return Ok(resp);
    }
    let after = resp.run.clone().unwrap_or_default();
    match v1::CommandOutcome::try_from(resp.outcome) {
        Ok(v1::CommandOutcome::Applied) => {
            println!(
                "Applied: run {} is now {}.",
                opts.run_id,
                report::state_name(after.state)
            );
            print!("{}", report::waiting(&after, None));
        }
        Ok(v1::CommandOutcome::Pending) => println!(
            "Stored (command {}); the replica that owns run {} applies it. Follow it with \
             `convene runs get {}`.",
            resp.command_id, opts.run_id, opts.run_id
        ),
        Ok(v1::CommandOutcome::AlreadyEnded) => println!(
            "Nothing changed: the run had already ended. {}",
            report::one_line(&after)
        ),
        _ => println!("{}", report::one_line(&after)),
    }
    Ok(resp)
}

/// `convene approvals list`.
pub async fn approvals_list(
    client: &Client,
    run_id: Option<String>,
    states: Vec<i32>,
    json: bool,
) -> anyhow::Result<()> {
    let resp = client
        .approval()?
        .list_approvals(client.request(v1::ListApprovalsRequest {
            states,
            run_id: run_id.unwrap_or_default(),
            page_size: 100,
            page_token: String::new(),
        }))
        .await
        .map_err(|s| client.explain(&s))?
        .into_inner();
    if json {
        return print_json(&resp);
    }
    if resp.approvals.is_empty() {
        println!("No approval requests.");
    }
    for (i, a) in resp.approvals.iter().enumerate() {
        if i > 0 {
            println!();
        }
        print!("{}", report::approval(a));
    }
    Ok(())
}

/// What an approval command does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ApprovalVerb {
    /// Vote to approve.
    Approve,
    /// Vote to reject.
    Reject,
    /// Execute the approved action.
    Execute,
}

impl ApprovalVerb {
    fn word(self) -> &'static str {
        match self {
            Self::Approve => "approve",
            Self::Reject => "reject",
            Self::Execute => "execute",
        }
    }

    fn done(self) -> &'static str {
        match self {
            Self::Approve => "approved",
            Self::Reject => "rejected",
            Self::Execute => "executed",
        }
    }
}

/// A parameters hash as the approval service writes it, `sha256:<64 lowercase hex>`,
/// from `given` with or without the `sha256:` prefix.
///
/// # Errors
///
/// When `given` is not 64 hex digits after the optional prefix.
pub fn normalize_hash(given: &str) -> anyhow::Result<String> {
    let trimmed = given.trim();
    let hex = match trimmed.get(..7) {
        Some(prefix) if prefix.eq_ignore_ascii_case("sha256:") => &trimmed[7..],
        _ => trimmed,
    };
    anyhow::ensure!(
        hex.len() == 64 && hex.bytes().all(|b| b.is_ascii_hexdigit()),
        "--hash {given:?} is not a parameters hash: pass sha256:<64 hex digits> (the prefix \
         may be left out) as `convene approvals list` shows it"
    );
    Ok(format!("sha256:{}", hex.to_ascii_lowercase()))
}

/// The hash the person vouches for on `request`: `given` when it is the request's;
/// without it, the request's own once they confirmed it on a terminal.
///
/// # Errors
///
/// When `given` is not the request's hash (the parameters are not what they reviewed),
/// when there is no terminal to confirm on, or when they did not answer yes.
async fn vouched_hash(
    request: &v1::ApprovalRequest,
    given: Option<&str>,
    verb: ApprovalVerb,
) -> anyhow::Result<String> {
    let id = &request.approval_id;
    let list = if request.run_id.is_empty() {
        "convene approvals list".to_owned()
    } else {
        format!("convene approvals list --run {}", request.run_id)
    };
    if let Some(given) = given {
        let hash = normalize_hash(given)?;
        anyhow::ensure!(
            hash == request.parameters_hash,
            "refusing to {} approval request {id}: you passed --hash {hash}, but the request \
             binds its parameters to {}. They are not the parameters you reviewed: review the \
             request again (`{list}`) and pass the hash it shows. Nothing was recorded.",
            verb.word(),
            request.parameters_hash
        );
        return Ok(hash);
    }
    if !(std::io::stdin().is_terminal() && std::io::stderr().is_terminal()) {
        anyhow::bail!(
            "refusing to {} approval request {id} without --hash: there is no terminal to \
             confirm on. Review the request (`{list}`) and pass --hash <hash> as shown there; \
             it binds your decision to the parameters you reviewed. Nothing was recorded.",
            verb.word()
        );
    }
    eprint!("{}", report::approval(request));
    eprint!("{}? [y/N] ", verb.word());
    std::io::Write::flush(&mut std::io::stderr())?;
    let answer = tokio::task::spawn_blocking(|| {
        let mut line = String::new();
        std::io::stdin().read_line(&mut line).map(|_| line)
    })
    .await
    .context("reading the answer")??;
    let answer = answer.trim();
    if answer.eq_ignore_ascii_case("y") || answer.eq_ignore_ascii_case("yes") {
        Ok(request.parameters_hash.clone())
    } else {
        anyhow::bail!(
            "not {}: the answer was {answer:?}, not y; nothing was recorded",
            verb.done()
        )
    }
}

/// `convene approvals approve|reject`: votes on the parameters the person reviewed,
/// binding the vote to the hash they passed (`hash`) or confirmed on a terminal.
pub async fn approvals_decide(
    client: &Client,
    id: &str,
    verb: ApprovalVerb,
    hash: Option<&str>,
    comment: &str,
) -> anyhow::Result<v1::ApprovalRequest> {
    let approval = client.approval()?;
    let current = current_approval(client, &approval, id).await?;
    let parameters_hash = vouched_hash(&current, hash, verb).await?;
    let decided = approval
        .decide(client.request(v1::DecideRequest {
            approval_id: id.to_owned(),
            decision: if verb == ApprovalVerb::Reject {
                v1::VoteDecision::Reject
            } else {
                v1::VoteDecision::Approve
            } as i32,
            parameters_hash,
            comment: comment.to_owned(),
        }))
        .await
        .map_err(|s| client.explain(&s))?
        .into_inner()
        .approval
        .context("no approval returned")?;
    let state = v1::ApprovalState::try_from(decided.state).map_or("?", |s| {
        s.as_str_name().trim_start_matches("APPROVAL_STATE_")
    });
    println!(
        "approval {id}: {state} ({} vote(s); {} approval(s) required)",
        decided.votes.len(),
        decided.approvals_required
    );
    Ok(decided)
}

/// `convene approvals execute`: executes the approved parameters the person reviewed
/// (`hash`, or confirmed on a terminal).
pub async fn approvals_execute(
    client: &Client,
    id: &str,
    hash: Option<&str>,
) -> anyhow::Result<v1::ApprovalExecuteResponse> {
    let approval = client.approval()?;
    let current = current_approval(client, &approval, id).await?;
    let parameters_hash = vouched_hash(&current, hash, ApprovalVerb::Execute).await?;
    let resp = approval
        .execute(client.request(v1::ApprovalExecuteRequest {
            approval_id: id.to_owned(),
            parameters_hash,
        }))
        .await
        .map_err(|s| client.explain(&s))?
        .into_inner();
    let rec = resp.execution.clone().unwrap_or_default();
    println!(
        "approval {id}: {} by {} with executor {} (success: {})",
        if resp.executed_now {
            "executed now"
        } else {
            "already executed"
        },
        rec.executed_by,
        rec.executor,
        rec.success
    );
    Ok(resp)
}

/// `convene evidence verify RUN`: walks every accepted claim of the run down to its
/// artifacts' bytes.
pub async fn evidence_verify(client: &Client, run_id: &str, json: bool) -> anyhow::Result<bool> {
    let run = client
        .supervisor()?
        .get_run(client.request(v1::GetRunRequest {
            run_id: run_id.to_owned(),
        }))
        .await
        .map_err(|s| client.explain(&s))?
        .into_inner()
        .run
        .context("the supervisor returned no run")?;
    let claims: Vec<v1::ChainClaim> = run
        .delegations
        .iter()
        .filter_map(|d| d.result.as_ref())
        .flat_map(|r| &r.claims)
        .map(|c| v1::ChainClaim {
            claim_id: c.claim_id.clone(),
            evidence_refs: c.evidence_refs.clone(),
        })
        .collect();
    let resp = client
        .evidence()?
        .verify_chain(client.request(v1::VerifyChainRequest {
            claims,
            rehash_content: true,
        }))
        .await
        .map_err(|s| client.explain(&s))?
        .into_inner();
    if json {
        print_json(&resp)?;
        return Ok(resp.intact);
    }
    let asked_by = model_turns(client, &run, &resp.links).await?;
    for link in &resp.links {
        let status = v1::LinkStatus::try_from(link.status)
            .map_or("?", |s| s.as_str_name().trim_start_matches("LINK_STATUS_"));
        let mark = if link.status == v1::LinkStatus::Ok as i32 {
            "ok "
        } else {
            "BAD"
        };
        println!(
            "{mark} {:<22} → {} → {} {status} {}",
            link.claim_id, link.evidence_id, link.artifact_uri, link.detail
        );
        if let Some((call, turn)) = asked_by.get(&link.evidence_id) {
            println!(
                "    {:<22}   recorded by tool call {call}, asked for by model turn {turn}",
                ""
            );
        }
    }
    println!(
        "{} link(s) checked for run {}: {}",
        resp.links.len(),
        run.run_id,
        if resp.intact {
            "every claim's evidence chain is intact (artifacts re-hashed)"
        } else {
            "BROKEN links found"
        }
    );
    Ok(resp.intact)
}

/// For each evidence id among `links`, the tool call that recorded it and the model turn
/// (`model_turn` evidence) that asked for that call, for delegations run by a model.
///
/// A delegation's turns are found without a search: their ids follow from the run, the
/// delegation, its last dispatch attempt and the result's iteration count, and each
/// turn's artifact lists the tool calls it asked for.
async fn model_turns(
    client: &Client,
    run: &v1::Run,
    links: &[v1::ChainLink],
) -> anyhow::Result<std::collections::HashMap<String, (String, String)>> {
    use std::collections::HashMap;
    let evidence = client.evidence()?;
    let mut turn_ids = Vec::new();
    for d in &run.delegations {
        let (Some(task), Some(result)) = (&d.task, &d.result) else {
            continue;
        };
        let turns = result.usage.as_ref().map_or(0, |u| u.iterations);
        for turn in 1..=turns {
            turn_ids.push(convene_worker::agent::turns::turn_evidence_id(
                &task.run_id,
                &task.delegation_id,
                d.attempts.max(1),
                turn,
            ));
        }
    }
    let mut wanted: Vec<String> = links.iter().map(|l| l.evidence_id.clone()).collect();
    wanted.sort();
    wanted.dedup();
    wanted.extend(turn_ids);
    if wanted.is_empty() {
        return Ok(HashMap::new());
    }
    let found = evidence
        .get_evidence(client.request(v1::GetEvidenceRequest {
            evidence_ids: wanted,
        }))
        .await
        .map_err(|s| client.explain(&s))?
        .into_inner()
        .evidence;
    // tool call id (`<delegation>/<call>`) → the turn that asked for it.
    let mut turn_of_call: HashMap<String, String> = HashMap::new();
    for turn in found
        .iter()
        .filter(|e| e.kind == convene_worker::agent::turns::MODEL_TURN_KIND)
    {
        let artifact = evidence
            .get_artifact(client.request(v1::GetArtifactRequest {
                uri: turn.artifact_uri.clone(),
            }))
            .await
            .map_err(|s| client.explain(&s))?
            .into_inner();
        let Ok(body) = serde_json::from_slice::<serde_json::Value>(&artifact.content) else {
            continue;
        };
        let delegation = body["delegation_id"].as_str().unwrap_or_default();
        for call in body["tool_call_ids"].as_array().into_iter().flatten() {
            if let Some(call) = call.as_str() {
                turn_of_call.insert(format!("{delegation}/{call}"), turn.evidence_id.clone());
            }
        }
    }
    Ok(found
        .iter()
        .filter_map(|e| {
            let turn = turn_of_call.get(&e.tool_call_id)?;
            Some((
                e.evidence_id.clone(),
                (e.tool_call_id.clone(), turn.clone()),
            ))
        })
        .collect())
}

/// Approval `id` as it stands, whose parameter hash a decision or an execution binds to.
async fn current_approval(
    client: &Client,
    approval: &GrpcApproval,
    id: &str,
) -> anyhow::Result<v1::ApprovalRequest> {
    approval
        .get_approval(client.request(v1::GetApprovalRequest {
            approval_id: id.to_owned(),
        }))
        .await
        .map_err(|s| client.explain(&s))?
        .into_inner()
        .approval
        .context("no approval returned")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_hash_is_taken_with_or_without_its_prefix_in_the_service_form() {
        let hex = "AB".repeat(32);
        let want = format!("sha256:{}", "ab".repeat(32));
        for given in [
            hex.clone(),
            format!("sha256:{hex}"),
            format!("SHA256:{hex}"),
            format!("  sha256:{}\n", hex.to_lowercase()),
        ] {
            assert_eq!(normalize_hash(&given).expect(&given), want, "{given:?}");
        }
        for bad in [
            "",
            "sha256:",
            "sha256:abc",
            &format!("md5:{hex}"),
            &"g".repeat(64),
        ] {
            let err = normalize_hash(bad).expect_err(bad).to_string();
            assert!(err.contains("sha256:<64 hex digits>"), "{err}");
        }
    }

    fn conflicted_run() -> v1::Run {
        let task = |id: &str, name: &str| v1::Delegation {
            task: Some(v1::DelegationTask {
                delegation_id: id.to_owned(),
                name: name.to_owned(),
                ..v1::DelegationTask::default()
            }),
            ..v1::Delegation::default()
        };
        let side = |id: &str| v1::ConflictingClaim {
            delegation_id: id.to_owned(),
            ..v1::ConflictingClaim::default()
        };
        v1::Run {
            run_id: "run-1".to_owned(),
            delegations: vec![
                task("d-logs", "logs"),
                task("d-metrics", "metrics"),
                task("d-changes", "changes"),
            ],
            decision: Some(v1::JoinDecision {
                conflicts: vec![v1::Conflict {
                    topic: "primary_cause".to_owned(),
                    claims: vec![side("d-logs"), side("d-changes")],
                    ..v1::Conflict::default()
                }],
                ..v1::JoinDecision::default()
            }),
            ..v1::Run::default()
        }
    }

    #[test]
    fn a_side_is_chosen_by_delegation_id_or_name() {
        let run = conflicted_run();
        for given in ["d-changes", "changes"] {
            assert_eq!(
                chosen_delegation(&run, "primary_cause", given).expect(given),
                "d-changes"
            );
        }
        let err = chosen_delegation(&run, "primary_cause", "change")
            .expect_err("no such delegation")
            .to_string();
        assert!(
            err.contains(
                "a side of the conflict on primary_cause: logs (d-logs), changes (d-changes)"
            ),
            "{err}"
        );
    }

    #[test]
    fn a_topic_given_for_context_must_be_an_open_conflict() {
        let mut run = conflicted_run();
        ensure_open_conflict(&run, "primary_cause").expect("open");
        let err = ensure_open_conflict(&run, "impact")
            .expect_err("no conflict")
            .to_string();
        assert!(err.contains("open: primary_cause"), "{err}");
        run.decision.as_mut().expect("decision").conflicts[0].resolution =
            v1::ConflictResolution::Settled as i32;
        let err = ensure_open_conflict(&run, "primary_cause")
            .expect_err("settled")
            .to_string();
        assert!(err.contains("leave --topic out"), "{err}");
    }

    #[test]
    fn a_command_response_prints_as_its_protobuf_json_mapping() {
        let run = v1::Run {
            run_id: "run-1".to_owned(),
            state: v1::RunState::Cancelled as i32,
            ..v1::Run::default()
        };
        let value =
            command_json(Some(&run), v1::CommandOutcome::Applied as i32, "cmd-1").expect("JSON");
        assert_eq!(
            value,
            serde_json::json!({
                "run": { "runId": "run-1", "state": "RUN_STATE_CANCELLED" },
                "outcome": "COMMAND_OUTCOME_APPLIED",
                "commandId": "cmd-1",
            })
        );
        assert_eq!(
            command_json(None, 0, "").expect("JSON"),
            serde_json::json!({})
        );
    }
}
