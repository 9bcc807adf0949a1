//! `convene runs`: read, list, cancel and resolve runs.

use std::collections::HashMap;
use std::time::SystemTime;

use convene_proto::v1;

use super::{approvals_of, get_run, print_json};
use crate::client::Client;
use crate::report;

/// `convene runs get`.
pub async fn runs_get(
    client: &Client,
    run_id: &str,
    json: bool,
    jaeger: Option<&str>,
) -> anyhow::Result<v1::Run> {
    let run = super::get_run(client, run_id).await?;
    if json {
        print_json(&run)?;
    } else {
        let approvals = approvals_of(client, &run).await;
        println!("{}", report::assessment(&run, &approvals, jaeger));
        print!("{}", report::waiting(&run, None));
        print!("{}", report::replicas(&run));
    }
    Ok(run)
}

/// What `convene runs list` keeps besides the states: labels and a time window.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct ListFilters {
    /// Only runs with this label, as KEY=VALUE (repeatable: a run must have every one).
    /// The value matches exactly what the run spec's `labels` gave, e.g. `--label
    /// service=payment-api --label incident=INC-20260723-0202`.
    #[arg(long = "label", value_name = "KEY=VALUE", value_parser = parse_label)]
    pub labels: Vec<(String, String)>,
    /// Only runs started at or after TIME: an RFC 3339 time (`2026-07-23T02:00:00Z`,
    /// `2026-07-23T04:00:00+02:00`) or how long ago (`30m`, `2h`, `7days`: that long
    /// before now).
    #[arg(long, value_name = "TIME", value_parser = parse_time)]
    pub since: Option<SystemTime>,
    /// Only runs started before TIME, given as for --since; with --since, it must be
    /// the later of the two (`--since 1day --until 2h`: from a day ago to two hours
    /// ago).
    #[arg(long, value_name = "TIME", value_parser = parse_time)]
    pub until: Option<SystemTime>,
}

impl ListFilters {
    /// Whether any filter is set.
    fn any(&self) -> bool {
        !self.labels.is_empty() || self.since.is_some() || self.until.is_some()
    }
}

/// Parses `--label KEY=VALUE`.
fn parse_label(text: &str) -> Result<(String, String), String> {
    match text.split_once('=') {
        Some((key, value)) if !key.trim().is_empty() => {
            Ok((key.trim().to_owned(), value.to_owned()))
        }
        _ => Err(format!(
            "{text:?}: give KEY=VALUE, a label of the run spec, e.g. service=payment-api"
        )),
    }
}

/// Parses `--since` and `--until`: a duration before now, or an RFC 3339 time.
fn parse_time(text: &str) -> Result<SystemTime, String> {
    convene_core::time::time_or_ago(text, SystemTime::now())
}

/// `convene runs list`.
pub async fn runs_list(
    client: &Client,
    states: Vec<i32>,
    filters: &ListFilters,
    limit: u32,
    json: bool,
) -> anyhow::Result<()> {
    let mut labels = HashMap::new();
    for (key, value) in &filters.labels {
        if let Some(first) = labels.insert(key.clone(), value.clone())
            && first != *value
        {
            anyhow::bail!(
                "--label {key}={first} and --label {key}={value}: a run has one value per \
                 label; give one of them"
            );
        }
    }
    if let (Some(since), Some(until)) = (filters.since, filters.until)
        && since >= until
    {
        anyhow::bail!(
            "--since ({}) is not before --until ({}): no run could match; give the earlier \
             time to --since",
            humantime::format_rfc3339_seconds(since),
            humantime::format_rfc3339_seconds(until),
        );
    }
    let resp = client
        .supervisor()?
        .list_runs(client.request(v1::ListRunsRequest {
            page_size: limit,
            page_token: String::new(),
            states,
            labels,
            created_after: filters.since.map(prost_types::Timestamp::from),
            created_before: filters.until.map(prost_types::Timestamp::from),
        }))
        .await
        .map_err(|s| client.explain(&s))?
        .into_inner();
    if json {
        return print_json(&resp);
    }
    if resp.runs.is_empty() {
        if filters.any() {
            println!("No runs match.");
        } else {
            println!("No runs.");
        }
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
fn chosen_delegation(run: &v1::Run, topic: &str, given: &str) -> anyhow::Result<String> {
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

#[cfg(test)]
mod tests {
    use super::*;

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
