//! What a finished run left behind (its run, events, outbox, ledger and decisions), the
//! shape every run of a spec must end in, crashed or not, and the checks that no
//! delegation ran twice or under a second id.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use convene_mesh::auth::request;
use convene_mesh::handles::SupervisorHandle;
use convene_proto::v1::{self, run_event::Kind};
use convene_store::{Database, sql};
use futures::StreamExt as _;

use super::{outbox, wait_terminal};

/// Everything a finished run left behind.
pub(super) struct Finished {
    pub(super) run: v1::Run,
    /// Its run events (WatchRun).
    pub(super) events: Vec<v1::RunEvent>,
    /// Its outbox events.
    pub(super) outbox: Vec<v1::CloudEvent>,
    /// Delegation ids in its ledger.
    pub(super) ledger: BTreeSet<String>,
    /// Rows of its join decisions.
    pub(super) decisions: i64,
}

pub(super) async fn inspect(
    client: &SupervisorHandle,
    credential: &str,
    db: &Database,
    run_id: &str,
) -> Finished {
    let run = wait_terminal(client, credential, run_id).await;
    let mut stream = client
        .watch_run(request(
            v1::WatchRunRequest {
                run_id: run_id.to_owned(),
                after_sequence: 0,
            },
            credential,
        ))
        .await
        .expect("WatchRun")
        .into_inner();
    let mut events = Vec::new();
    while let Some(e) = stream.next().await {
        events.push(e.expect("an event").event.expect("event set"));
    }
    let ledger = db
        .fetch_all(
            sql("SELECT DISTINCT delegation_id FROM delegation_ledger WHERE run_id = $1")
                .bind(run_id),
        )
        .await
        .expect("the ledger reads")
        .iter()
        .map(|r| r.get("delegation_id").expect("delegation_id"))
        .collect();
    let decisions = db
        .fetch_optional(
            sql("SELECT COUNT(*) AS n FROM join_decisions WHERE run_id = $1").bind(run_id),
        )
        .await
        .expect("join decisions read")
        .expect("a count")
        .get("n")
        .expect("n");
    Finished {
        outbox: outbox(client, credential, run_id).await,
        run,
        events,
        ledger,
        decisions,
    }
}

/// What must be the same for every run of one spec, crashed or not: the ids of the run,
/// its delegations and evidence, times, workers and usage differ between runs and are
/// left out (or replaced by the delegation's name); everything else is compared.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct Shape {
    pub(super) state: String,
    pub(super) decision: String,
    /// Per delegation name: state, detail and the result without ids.
    pub(super) delegations: BTreeMap<String, String>,
    pub(super) approvals: usize,
    /// Rows in `join_decisions`.
    pub(super) decisions: i64,
    /// Outbox events by type.
    pub(super) outbox: BTreeMap<String, usize>,
    /// Run events by kind, except dispatches (a restart dispatches again, as a worker
    /// crash does).
    pub(super) run_events: BTreeMap<&'static str, usize>,
}

pub(super) fn shape(f: &Finished) -> Shape {
    let run = &f.run;
    let names: Vec<(String, String)> = run
        .delegations
        .iter()
        .filter_map(|d| d.task.as_ref())
        .map(|t| (t.delegation_id.clone(), format!("<{}>", t.name)))
        .collect();
    let norm = |s: &str| {
        let mut s = s.replace(&run.run_id, "<run>");
        for (id, name) in &names {
            s = s.replace(id, name);
        }
        s
    };
    let sorted = |ids: &[String]| {
        let mut v: Vec<String> = ids.iter().map(|i| norm(i)).collect();
        v.sort();
        v
    };
    let mut decision = run.decision.clone().expect("a decided run");
    decision.decided_at = None;
    decision.accepted = sorted(&decision.accepted);
    decision.missing_required = sorted(&decision.missing_required);
    decision.missing_optional = sorted(&decision.missing_optional);
    decision.late_discarded = sorted(&decision.late_discarded);
    for r in &mut decision.rejected {
        r.delegation_id = norm(&r.delegation_id);
    }
    decision
        .rejected
        .sort_by(|a, b| a.delegation_id.cmp(&b.delegation_id));
    for c in &mut decision.conflicts {
        for claim in &mut c.claims {
            claim.delegation_id = norm(&claim.delegation_id);
            claim.evidence_refs = vec![format!("{} refs", claim.evidence_refs.len())];
        }
        c.claims
            .sort_by(|a, b| (&a.value, &a.delegation_id).cmp(&(&b.value, &b.delegation_id)));
    }
    decision.conflicts.sort_by(|a, b| a.topic.cmp(&b.topic));
    let delegations = run
        .delegations
        .iter()
        .map(|d| {
            let name = d.task.as_ref().map(|t| t.name.clone()).unwrap_or_default();
            let result = d.result.clone().map(|mut r| {
                r.worker_id.clear();
                r.usage = None;
                r.artifacts = vec![format!("{} artifacts", r.artifacts.len())];
                let evidence = r.evidence.len();
                r.evidence.clear();
                for c in &mut r.claims {
                    c.evidence_refs = vec![format!("{} refs", c.evidence_refs.len())];
                }
                for a in &mut r.proposed_actions {
                    a.evidence_refs = vec![format!("{} refs", a.evidence_refs.len())];
                }
                (evidence, r)
            });
            let state = v1::DelegationState::try_from(d.state)
                .map_or("?", |s| s.as_str_name())
                .to_owned();
            (name, norm(&format!("{state} {:?} {result:?}", d.detail)))
        })
        .collect();
    // The supervisor's own events: the approval service's reach the outbox as the
    // supervisor follows them, a moment after the run stopped.
    let mut outbox = BTreeMap::new();
    for e in f
        .outbox
        .iter()
        .filter(|e| e.source == convene_supervisor::events::SOURCE)
    {
        *outbox.entry(e.r#type.clone()).or_insert(0) += 1;
    }
    let mut run_events = BTreeMap::new();
    for e in &f.events {
        let kind = match e.kind {
            Some(Kind::Started(_)) => "started",
            Some(Kind::Dispatched(_)) => continue,
            Some(Kind::Completed(_)) => "completed",
            Some(Kind::Decision(_)) => "decision",
            Some(Kind::Terminal(_)) => "terminal",
            Some(Kind::Planned(_)) => "planned",
            Some(Kind::Waiting(_)) => "waiting",
            Some(Kind::Resumed(_)) => "resumed",
            None => "none",
        };
        *run_events.entry(kind).or_insert(0) += 1;
    }
    Shape {
        state: format!(
            "{} {}",
            v1::RunState::try_from(run.state).map_or("?", |s| s.as_str_name()),
            v1::JoinOutcome::try_from(run.outcome).map_or("?", |o| o.as_str_name())
        ),
        decision: norm(&format!("{decision:?}")),
        delegations,
        approvals: run.approval_ids.len(),
        decisions: f.decisions,
        outbox,
        run_events,
    }
}

/// Every delegation ran under the one id it was planned with: the ledger knows exactly
/// those ids, each result carries its delegation's id and comes from a worker it was
/// dispatched to, each completed once (run events and outbox alike), and the run's
/// events are numbered without gaps or repeats.
pub(super) fn assert_once_per_delegation(f: &Finished, label: &str) {
    let run = &f.run;
    let ids: BTreeSet<String> = run
        .delegations
        .iter()
        .filter_map(|d| d.task.as_ref().map(|t| t.delegation_id.clone()))
        .collect();
    assert_eq!(ids.len(), run.delegations.len(), "{label}: distinct ids");
    assert_eq!(f.ledger, ids, "{label}: the ledger's delegation ids");

    let mut dispatched: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut completed: BTreeMap<String, usize> = BTreeMap::new();
    for (i, e) in f.events.iter().enumerate() {
        assert_eq!(e.sequence, i as u64 + 1, "{label}: run event sequence");
        match &e.kind {
            Some(Kind::Dispatched(d)) => {
                dispatched
                    .entry(d.delegation_id.clone())
                    .or_default()
                    .insert(d.worker_id.clone());
            }
            Some(Kind::Completed(c)) => *completed.entry(c.delegation_id.clone()).or_insert(0) += 1,
            _ => {}
        }
    }
    assert!(
        dispatched.keys().all(|id| ids.contains(id)),
        "{label}: dispatched under unknown ids: {dispatched:?}"
    );
    assert_eq!(
        completed,
        ids.iter().map(|id| (id.clone(), 1)).collect(),
        "{label}: one completion per delegation"
    );
    for d in &run.delegations {
        let task = d.task.as_ref().expect("task");
        let result = d
            .result
            .as_ref()
            .unwrap_or_else(|| panic!("{label}: {} has no result", task.name));
        assert_eq!(result.delegation_id, task.delegation_id, "{label}");
        assert!(
            dispatched
                .get(&task.delegation_id)
                .is_some_and(|w| w.contains(&result.worker_id)),
            "{label}: {}'s result came from {}, not a worker it was dispatched to ({:?})",
            task.name,
            result.worker_id,
            dispatched.get(&task.delegation_id)
        );
    }

    let mut subjects: BTreeMap<String, usize> = BTreeMap::new();
    let mut event_ids = BTreeSet::new();
    for e in &f.outbox {
        assert_eq!(e.correlation_id, run.run_id, "{label}");
        assert!(
            event_ids.insert(e.id.clone()),
            "{label}: event {} twice",
            e.id
        );
        if e.r#type == convene_supervisor::events::DELEGATION_COMPLETED {
            *subjects.entry(e.subject.clone()).or_insert(0) += 1;
        }
    }
    assert_eq!(
        subjects,
        ids.iter()
            .map(|id| (format!("runs/{}/delegations/{id}", run.run_id), 1))
            .collect(),
        "{label}: one delegation.completed event per delegation"
    );
}

/// The delegation ids under which workers' tool calls were authorized, per run, from
/// the policy service's decision log: which ids workers actually executed under.
pub(super) fn executed_under(data_dir: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let text = std::fs::read_to_string(data_dir.join("policy/decisions.jsonl"))
        .expect("the policy service's decision log");
    let mut out: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    // Only complete lines: the log may be appended to while it is read.
    let complete = text.rfind('\n').map_or("", |end| &text[..end]);
    for line in complete.lines().filter(|l| !l.trim().is_empty()) {
        let record: serde_json::Value = serde_json::from_str(line)
            .unwrap_or_else(|e| panic!("a decision log line does not parse ({e}): {line}"));
        if record["kind"] != "authorize" {
            continue;
        }
        let (Some(run), Some(delegation)) =
            (record["run_id"].as_str(), record["delegation_id"].as_str())
        else {
            continue;
        };
        out.entry(run.to_owned())
            .or_default()
            .insert(delegation.to_owned());
    }
    out
}

pub(super) fn assert_executed_under_planned_ids(
    executed: &BTreeMap<String, BTreeSet<String>>,
    f: &Finished,
    label: &str,
) {
    let ids: BTreeSet<String> = f
        .run
        .delegations
        .iter()
        .filter_map(|d| d.task.as_ref().map(|t| t.delegation_id.clone()))
        .collect();
    assert_eq!(
        executed.get(&f.run.run_id),
        Some(&ids),
        "{label}: workers executed exactly the planned delegation ids"
    );
}
