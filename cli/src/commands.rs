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
    follow(client, &run, !opts.json).await?;
    let run = supervisor
        .get_run(client.request(v1::GetRunRequest {
            run_id: run.run_id.clone(),
        }))
        .await
        .map_err(|s| client.explain(&s))?
        .into_inner()
        .run
        .context("the supervisor returned no run")?;
    if opts.json {
        print_json(&run)?;
    } else {
        let approvals = approvals_of(client, &run).await;
        println!(
            "\n{}",
            report::assessment(&run, &approvals, opts.jaeger.as_deref())
        );
    }
    Ok(run)
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

/// Follows a run's events until it ends, one line per delegation (a live progress
/// display when attached to a terminal).
async fn follow(client: &Client, run: &v1::Run, show: bool) -> anyhow::Result<()> {
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
            Some(Kind::Terminal(_)) => break,
            Some(Kind::Started(_)) | None => {}
        }
    }
    for bar in bars.values() {
        if !bar.is_finished() {
            bar.finish_with_message("no result before the decision");
        }
    }
    Ok(())
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

/// `convene runs cancel`.
pub async fn runs_cancel(client: &Client, run_id: &str, reason: &str) -> anyhow::Result<()> {
    let run = client
        .supervisor()?
        .cancel_run(client.request(v1::CancelRunRequest {
            run_id: run_id.to_owned(),
            reason: reason.to_owned(),
        }))
        .await
        .map_err(|s| client.explain(&s))?
        .into_inner()
        .run
        .context("no run returned")?;
    println!("{}", report::one_line(&run));
    Ok(())
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
    for a in &resp.approvals {
        let state = v1::ApprovalState::try_from(a.state).map_or("?", |s| {
            s.as_str_name().trim_start_matches("APPROVAL_STATE_")
        });
        let risk = v1::RiskLevel::try_from(a.risk_level)
            .map_or("R?", |r| r.as_str_name().trim_start_matches("RISK_LEVEL_"));
        let approved = a
            .votes
            .iter()
            .filter(|v| v.decision == v1::VoteDecision::Approve as i32)
            .count();
        println!(
            "{}  {:<9} {} {:<16} {}/{} approvals  requested by {}  params {}",
            a.approval_id,
            state,
            risk,
            a.action,
            approved,
            a.approvals_required,
            a.requester,
            a.parameters_hash
        );
    }
    Ok(())
}

/// `convene approvals approve|reject`: votes on the parameters as they are now (the
/// vote binds to their hash).
pub async fn approvals_decide(
    client: &Client,
    id: &str,
    approve: bool,
    comment: &str,
) -> anyhow::Result<()> {
    let approval = client.approval()?;
    let current = current_approval(client, &approval, id).await?;
    let decided = approval
        .decide(client.request(v1::DecideRequest {
            approval_id: id.to_owned(),
            decision: if approve {
                v1::VoteDecision::Approve
            } else {
                v1::VoteDecision::Reject
            } as i32,
            parameters_hash: current.parameters_hash.clone(),
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
    Ok(())
}

/// `convene approvals execute`.
pub async fn approvals_execute(client: &Client, id: &str) -> anyhow::Result<()> {
    let approval = client.approval()?;
    let current = current_approval(client, &approval, id).await?;
    let resp = approval
        .execute(client.request(v1::ApprovalExecuteRequest {
            approval_id: id.to_owned(),
            parameters_hash: current.parameters_hash,
        }))
        .await
        .map_err(|s| client.explain(&s))?
        .into_inner();
    let rec = resp.execution.unwrap_or_default();
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
    Ok(())
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
