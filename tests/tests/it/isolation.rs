//! Tenants never meet: a property test over one mesh with two tenants, each staffed
//! alike (an on-call engineer who starts and resolves runs, two approvers).
//!
//! Each case gives both tenants a random mix of runs (ended; waiting for input; waiting
//! for approval; its request rejected, or approved and executed; cancelled; closed),
//! approval requests of their own with random fates, evidence and artifacts stored
//! directly under task tokens, and writes that reuse the other tenant's ids (an
//! idempotency key, its bytes, an evidence id, a run id an approval request names).
//! Then, both ways round:
//!
//! - every call that takes an id, made with the other tenant's ids and with ids of the
//!   same shape that nobody has, answers the same refusal, word for word once the ids
//!   are replaced by a placeholder: NOT_FOUND where the id names an object, never
//!   PERMISSION_DENIED;
//! - every listing, stream and page shows exactly the caller's own objects;
//! - nothing the caller receives names an object, a person or the name of the other
//!   tenant;
//! - nothing of the other tenant changed (the probes include CancelRun, ResumeRun,
//!   Decide, Execute and CancelApproval).
//!
//! The cases are drawn from a seed printed at the start; set the variable it names to
//! replay them. Every case runs, and the test then reports everything it found broken.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use convene_mesh::auth::request;
use convene_mesh::handles::GrpcPolicy;
use convene_proto::v1::{
    self, approval_server::Approval as _, policy_server::Policy as _, resume_run_request::Input,
};
use tonic::Status;

use crate::harness::{MeshOptions, Mode, TestMesh, example_spec, repo_root, wait_for};

mod calls;
mod probe;

use calls::{
    approval_stream, cancel_approval, cancel_run, decide, execute, get_approval, outbox, put,
    record, record_evidence, resume,
};
use probe::View;

/// Cases in one run of the test; each adds objects to the same mesh.
const CASES: u64 = 6;
/// The base seed to replay, as the test prints it.
const SEED_ENV: &str = "CONVENE_TEST_ISOLATION_SEED";
const LIMIT: Duration = Duration::from_secs(60);
const STARTED: &str = "dev.convene.run.started.v1";
const REQUESTED: &str = "dev.convene.approval.requested.v1";

/// A tenant and its people.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Tenant {
    name: &'static str,
    oncall: &'static str,
    alice: &'static str,
    bob: &'static str,
}

const ACME: Tenant = Tenant {
    name: "acme-payments",
    oncall: "oncall@acme",
    alice: "alice@acme",
    bob: "bob@acme",
};
const GLOBEX: Tenant = Tenant {
    name: "globex",
    oncall: "oncall@globex",
    alice: "alice@globex",
    bob: "bob@globex",
};

/// The example policy with globex staffed as acme is.
fn policy() -> String {
    let text = std::fs::read_to_string(repo_root().join("examples/payment-incident/policy.yaml"))
        .expect("the example policy");
    let anchor = "  # Services of the mesh.\n";
    assert!(
        text.contains(anchor),
        "the example policy lists its people first"
    );
    let people = "  - id: oncall@globex
    tenant: globex
    kind: human
    roles: [runs:start, runs:read, runs:resolve, approvals:request, evidence:read]
    grants:
      - { action: \"logs:read\", resource: \"service/*\" }
      - { action: \"metrics:read\", resource: \"metric/*\" }
      - { action: \"changes:read\", resource: \"change/*\" }
      - { action: \"evidence:*\", resource: \"evidence\" }
  - id: alice@globex
    tenant: globex
    kind: human
    roles: [runs:read, approvals:decide, approvals:execute, evidence:read]
  - id: bob@globex
    tenant: globex
    kind: human
    roles: [runs:read, approvals:decide, approvals:execute, evidence:read]
";
    text.replacen(anchor, &format!("{people}{anchor}"), 1)
}

/// SplitMix64: a small seeded generator, so a case replays from its seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    fn chance(&mut self, percent: u64) -> bool {
        self.next() % 100 < percent
    }

    fn hex(&mut self, len: usize) -> String {
        (0..len)
            .map(|_| char::from_digit((self.next() % 16) as u32, 16).expect("a hex digit"))
            .collect()
    }

    fn uuid(&mut self) -> String {
        let h = self.hex(32);
        format!(
            "{}-{}-7{}-8{}-{}",
            &h[..8],
            &h[8..12],
            &h[13..16],
            &h[17..20],
            &h[20..]
        )
    }

    fn pick<'a, T>(&mut self, items: &'a [T]) -> Option<&'a T> {
        (!items.is_empty()).then(|| &items[self.below(items.len())])
    }
}

/// An id of the same shape as `id` that nobody has: each run of eight or more hex digits
/// (the UUIDs and hashes ids are made of) drawn again.
fn made_up(rng: &mut Rng, id: &str) -> String {
    let is_hex = |c: &char| c.is_ascii_digit() || ('a'..='f').contains(c);
    let chars: Vec<char> = id.chars().collect();
    let mut out = String::with_capacity(id.len());
    let mut i = 0;
    while i < chars.len() {
        let run = chars[i..].iter().take_while(|c| is_hex(c)).count();
        if run >= 8 {
            out.push_str(&rng.hex(run));
        } else {
            out.extend(&chars[i..i + run.max(1)]);
        }
        i += run.max(1);
    }
    assert_ne!(out, id, "{id} has no part to draw again");
    out
}

/// `text` with each of `ids` replaced by a placeholder, the longest first (an id may
/// hold another: evidence ids hold their run's id).
fn scrub<'a>(text: &str, ids: impl IntoIterator<Item = &'a str>) -> String {
    let mut ids: Vec<&str> = ids.into_iter().filter(|id| !id.is_empty()).collect();
    ids.sort_by_key(|id| std::cmp::Reverse(id.len()));
    ids.into_iter()
        .fold(text.to_owned(), |t, id| t.replace(id, "<id>"))
}

/// What the properties found broken, by what was asked: how often, and the first
/// instance with the case it came from.
#[derive(Debug, Default)]
struct Findings {
    case: u64,
    found: BTreeMap<String, (usize, String)>,
}

impl Findings {
    fn add(&mut self, what: String, detail: String) {
        let case = self.case;
        self.found
            .entry(what)
            .or_insert_with(|| (0, format!("case {case}: {detail}")))
            .0 += 1;
    }

    fn check(&mut self, ok: bool, what: &str, detail: impl FnOnce() -> String) {
        if !ok {
            self.add(what.to_owned(), detail());
        }
    }
}

/// Bytes a tenant stored directly, and where.
#[derive(Debug, Clone)]
struct Stored {
    bytes: Vec<u8>,
    uri: String,
    hash: String,
}

/// What one tenant made, as the test knows it.
#[derive(Debug, Default)]
struct Made {
    /// Run id → its state once settled.
    runs: BTreeMap<String, i32>,
    /// Run id → how many events WatchRun shows once it settled.
    run_events: BTreeMap<String, usize>,
    /// Run id → the ticket it waits under.
    tickets: BTreeMap<String, v1::RunTicket>,
    /// Every ticket id a run was given.
    ticket_ids: BTreeSet<String>,
    delegations: BTreeSet<String>,
    /// Run id → its `changes` delegation (a side of its conflict), for runs waiting
    /// for input.
    sides: BTreeMap<String, String>,
    /// Approval id → the run it names (empty: none).
    approvals: BTreeMap<String, String>,
    /// Approval id → its state once settled.
    approval_states: BTreeMap<String, i32>,
    evidence: BTreeSet<String>,
    artifacts: BTreeSet<String>,
    stored: Vec<Stored>,
    /// Supervisor outbox events, as the tenant's own WatchEvents shows them.
    events: BTreeSet<String>,
    /// Approval events, as the tenant's own Approval.WatchEvents shows them.
    approval_events: BTreeSet<String>,
    /// The idempotency keys its runs were started under.
    keys: Vec<String>,
    /// The other tenant's ids this tenant's own objects carry.
    borrowed: BTreeSet<String>,
}

impl Made {
    fn ids(&self) -> BTreeSet<&str> {
        self.runs
            .keys()
            .chain(&self.ticket_ids)
            .chain(&self.delegations)
            .chain(self.approvals.keys())
            .chain(&self.evidence)
            .chain(&self.artifacts)
            .chain(&self.events)
            .chain(&self.approval_events)
            .map(String::as_str)
            .collect()
    }

    /// How many of each it holds, runs by state.
    fn summary(&self) -> String {
        let mut states: BTreeMap<&str, usize> = BTreeMap::new();
        for s in self.runs.values() {
            let name = v1::RunState::try_from(*s).map_or("?", |s| s.as_str_name());
            *states
                .entry(name.trim_start_matches("RUN_STATE_"))
                .or_default() += 1;
        }
        let mut requests: BTreeMap<&str, usize> = BTreeMap::new();
        for s in self.approval_states.values() {
            let name = v1::ApprovalState::try_from(*s).map_or("?", |s| s.as_str_name());
            *requests
                .entry(name.trim_start_matches("APPROVAL_STATE_"))
                .or_default() += 1;
        }
        format!(
            "runs {states:?}, requests {requests:?}, {} evidence, {} artifacts, {} + {} events, {} borrowed ids",
            self.evidence.len(),
            self.artifacts.len(),
            self.events.len(),
            self.approval_events.len(),
            self.borrowed.len()
        )
    }

    /// Notes a settled run and what it holds.
    async fn add_run(&mut self, mesh: &TestMesh, t: Tenant, run: v1::Run) {
        let events = mesh.run_events(t.oncall, &run.run_id).await;
        for e in &events {
            if let Some(v1::run_event::Kind::Waiting(w)) = &e.kind
                && let Some(ticket) = &w.ticket
            {
                self.ticket_ids.insert(ticket.id.clone());
            }
        }
        self.run_events.insert(run.run_id.clone(), events.len());
        self.runs.insert(run.run_id.clone(), run.state);
        if let Some(ticket) = &run.ticket {
            self.tickets.insert(run.run_id.clone(), ticket.clone());
        }
        for d in &run.delegations {
            if let Some(task) = &d.task {
                self.delegations.insert(task.delegation_id.clone());
                if task.name == "changes" && run.state == v1::RunState::WaitingInput as i32 {
                    self.sides
                        .insert(run.run_id.clone(), task.delegation_id.clone());
                }
            }
            if let Some(r) = &d.result {
                for e in &r.evidence {
                    self.evidence.insert(e.evidence_id.clone());
                    self.artifacts.insert(e.artifact_uri.clone());
                }
                self.artifacts.extend(r.artifacts.iter().cloned());
            }
        }
        self.artifacts.remove("");
        for id in &run.approval_ids {
            let a = get_approval(mesh, t.oncall, id).await.expect("GetApproval");
            self.approvals.insert(id.clone(), run.run_id.clone());
            self.approval_states.insert(id.clone(), a.state);
        }
    }
}

/// How a run of the case ends up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fate {
    /// Logs only: it ends on its own.
    Quick,
    /// The example, waiting for input on its conflict.
    Open,
    /// Closed while it waited for input.
    Closed,
    /// Settled; its R3 rollback request pending.
    Pending,
    /// Settled; its request rejected.
    Rejected,
    /// Settled; its request approved twice and executed.
    Executed,
    /// Settled, then cancelled with its request.
    Cancelled,
}

const FATES: [Fate; 7] = [
    Fate::Quick,
    Fate::Open,
    Fate::Closed,
    Fate::Pending,
    Fate::Rejected,
    Fate::Executed,
    Fate::Cancelled,
];

fn incident_spec(key: &str) -> v1::RunSpec {
    let mut spec = example_spec();
    key.clone_into(&mut spec.idempotency_key);
    spec
}

fn quick_spec(key: &str) -> v1::RunSpec {
    let mut spec = incident_spec(key);
    spec.delegations.truncate(1);
    let join = spec.join.as_mut().expect("join");
    join.optional.clear();
    join.minimum = Some(v1::JoinMinimum {
        count: 1,
        ..Default::default()
    });
    spec
}

/// Starts a run of `t` under idempotency key `key` and brings it to `fate`; the run as
/// it then stands.
async fn drive(mesh: &TestMesh, t: Tenant, fate: Fate, key: &str) -> v1::Run {
    let spec = if fate == Fate::Quick {
        quick_spec(key)
    } else {
        incident_spec(key)
    };
    let run_id = mesh.start_run_id(t.oncall, spec).await;
    let run = mesh.wait_terminal(t.oncall, &run_id, LIMIT).await;
    if fate == Fate::Quick || fate == Fate::Open {
        return run;
    }
    assert_eq!(run.state, v1::RunState::WaitingInput as i32, "{run:#?}");
    let settle = Input::Settle(v1::SettleConflict {
        topic: "primary_cause".to_owned(),
        delegation_id: run
            .delegations
            .iter()
            .filter_map(|d| d.task.as_ref())
            .find(|task| task.name == "changes")
            .expect("the changes delegation")
            .delegation_id
            .clone(),
        evidence_ids: Vec::new(),
    });
    let input = if fate == Fate::Closed {
        Input::Close(v1::CloseRun {})
    } else {
        settle
    };
    let run = resume(mesh, t.oncall, &run_id, run.ticket.clone(), input)
        .await
        .expect("ResumeRun")
        .run
        .expect("run");
    if let Some(action) = run.actions.first() {
        let (id, hash) = (&action.approval_id, &action.parameters_hash);
        let vote = async |who, decision| {
            decide(mesh, who, id, hash, decision)
                .await
                .unwrap_or_else(|s| panic!("{who} votes: {s:?}"))
        };
        match fate {
            Fate::Rejected => {
                vote(t.alice, v1::VoteDecision::Reject).await;
            }
            Fate::Executed => {
                vote(t.alice, v1::VoteDecision::Approve).await;
                vote(t.bob, v1::VoteDecision::Approve).await;
                execute(mesh, t.alice, id, hash).await.expect("Execute");
            }
            Fate::Cancelled => {
                cancel_run(mesh, t.oncall, &run_id)
                    .await
                    .expect("CancelRun");
            }
            _ => {}
        }
    }
    wait_for(&format!("run {run_id} to be {fate:?}"), LIMIT, async || {
        let run = mesh.get_run(t.oncall, &run_id).await;
        let settled = match fate {
            Fate::Pending => run.state == v1::RunState::WaitingApproval as i32,
            _ => convene_supervisor::store::is_final(run.state),
        };
        if settled { Ok(run) } else { Err(run) }
    })
    .await
}

/// Files an R2 request of `t`'s on-call engineer naming `run_id`, and settles it at
/// random (left pending, rejected, approved, executed or withdrawn).
async fn request_approval(
    mesh: &TestMesh,
    rng: &mut Rng,
    t: Tenant,
    run_id: &str,
    made: &mut Made,
) {
    use prost_types::value::Kind;
    let number = Kind::NumberValue((1 + rng.below(20)) as f64);
    let parameters = prost_types::Struct {
        fields: [
            ("share_percent", number),
            ("nonce", Kind::StringValue(rng.hex(12))),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), prost_types::Value { kind: Some(v) }))
        .collect(),
    };
    let filed = mesh
        .approval()
        .request_approval(request(
            v1::RequestApprovalRequest {
                action: "traffic:shift".to_owned(),
                parameters: Some(parameters),
                risk_level: v1::RiskLevel::R2 as i32,
                idempotency_key: format!("isolation-{}", rng.hex(16)),
                run_id: run_id.to_owned(),
                rationale: "shift a little traffic away".to_owned(),
                ..Default::default()
            },
            &mesh.credential(t.oncall),
        ))
        .await
        .expect("RequestApproval")
        .into_inner()
        .approval
        .expect("the request");
    let (id, hash) = (filed.approval_id.as_str(), filed.parameters_hash.as_str());
    let approve = v1::VoteDecision::Approve;
    let settled = match rng.below(5) {
        0 => Ok(filed.clone()),
        1 => decide(mesh, t.alice, id, hash, v1::VoteDecision::Reject).await,
        2 => decide(mesh, t.alice, id, hash, approve).await,
        3 => match decide(mesh, t.alice, id, hash, approve).await {
            Ok(_) => execute(mesh, t.bob, id, hash).await.map(|_| filed.clone()),
            Err(s) => Err(s),
        },
        _ => cancel_approval(mesh, t.oncall, id).await,
    };
    settled.unwrap_or_else(|s| panic!("settling {id}: {s:?}"));
    let state = get_approval(mesh, t.oncall, id)
        .await
        .expect("GetApproval")
        .state;
    made.approvals.insert(id.to_owned(), run_id.to_owned());
    made.approval_states.insert(id.to_owned(), state);
}

/// A task token of `t`'s on-call engineer that may store and read evidence, as the
/// supervisor would ask for one.
async fn task_token(mesh: &TestMesh, rng: &mut Rng, t: Tenant) -> String {
    let now = SystemTime::now();
    let scope = |action: &str| v1::PermissionScope {
        action: action.to_owned(),
        resource: "evidence".to_owned(),
        data_scope: None,
    };
    GrpcPolicy::connect(&mesh.policy_endpoint)
        .expect("endpoint")
        .issue_task_token(request(
            v1::IssueTaskTokenRequest {
                lease_epoch: 0,
                principal: t.oncall.to_owned(),
                run_id: rng.uuid(),
                parent_token: String::new(),
                grants: vec![v1::TokenGrantRequest {
                    delegation_id: format!("isolation-{}", rng.hex(16)),
                    profile_id: "logs-investigator".to_owned(),
                    depth: 1,
                    required_scopes: vec![scope("evidence:write"), scope("evidence:read")],
                    task_scope: Some(v1::TaskScope {
                        resources: Vec::new(),
                        time_range: Some(v1::TimeRange {
                            start: Some((now - Duration::from_secs(3600)).into()),
                            end: Some((now + Duration::from_secs(60)).into()),
                        }),
                    }),
                    ..Default::default()
                }],
            },
            &mesh.credential("supervisor"),
        ))
        .await
        .expect("IssueTaskToken")
        .into_inner()
        .tokens
        .remove(0)
        .token
}

/// `t`'s own objects of one case: runs of random fates, requests, evidence.
async fn make(mesh: &TestMesh, rng: &mut Rng, t: Tenant, made: &mut Made) {
    let fates: Vec<Fate> = (0..1 + rng.below(3))
        .map(|_| *rng.pick(&FATES).expect("fates"))
        .collect();
    let keys: Vec<String> = fates
        .iter()
        .map(|_| format!("isolation-{}", rng.hex(16)))
        .collect();
    let runs =
        futures::future::join_all(fates.iter().zip(&keys).map(|(f, k)| drive(mesh, t, *f, k)))
            .await;
    made.keys.extend(keys);
    let mut ids = vec![String::new()];
    for run in runs {
        ids.push(run.run_id.clone());
        made.add_run(mesh, t, run).await;
    }
    for _ in 0..rng.below(3) {
        let run_id = rng.pick(&ids).expect("ids").clone();
        request_approval(mesh, rng, t, &run_id, made).await;
    }
    let token = task_token(mesh, rng, t).await;
    for _ in 0..1 + rng.below(3) {
        let bytes = format!("{{\"isolation\":\"{}\"}}", rng.hex(24)).into_bytes();
        let id = format!("logs://isolation/{}/{}", rng.uuid(), rng.hex(16));
        let with_record = rng.chance(70);
        let stored = put(
            mesh,
            &token,
            &bytes,
            with_record.then(|| record(&id, "", "")),
        )
        .await
        .expect("PutArtifact");
        let artifact = stored.artifact.expect("artifact");
        if with_record {
            made.evidence.insert(id);
        }
        made.artifacts.insert(artifact.uri.clone());
        made.stored.push(Stored {
            bytes,
            uri: artifact.uri,
            hash: artifact.content_hash,
        });
    }
    if let Some(s) = rng.pick(&made.stored).cloned() {
        let id = format!("logs://isolation/{}/{}", rng.uuid(), rng.hex(16));
        record_evidence(mesh, &token, record(&id, &s.uri, &s.hash))
            .await
            .expect("RecordEvidence");
        made.evidence.insert(id);
    }
}

/// Writes of `me` that reuse `other`'s ids: a run started under one of its idempotency
/// keys, its bytes stored again, an evidence id of its recorded again, one of its runs
/// named by a request. Each must act as if the id were new.
async fn borrow(
    mesh: &TestMesh,
    rng: &mut Rng,
    f: &mut Findings,
    me: Tenant,
    mine: &mut Made,
    other: &Made,
) {
    if let Some(key) = rng.pick(&other.keys).cloned()
        && !mine.keys.contains(&key)
    {
        match mesh.start_run(me.oncall, quick_spec(&key)).await {
            Ok(started) => {
                let run_id = started.run.as_ref().map_or("", |r| r.run_id.as_str());
                f.check(
                    started.created && !other.runs.contains_key(run_id),
                    "StartRun under an idempotency key only the other tenant used starts a new run",
                    || format!("{key}: {started:?}"),
                );
                if started.created {
                    let run = mesh.wait_terminal(me.oncall, run_id, LIMIT).await;
                    mine.add_run(mesh, me, run).await;
                    mine.keys.push(key);
                }
            }
            Err(s) => f.add(
                "StartRun under an idempotency key only the other tenant used is not refused"
                    .to_owned(),
                format!("{key}: {s:?}"),
            ),
        }
    }
    let token = task_token(mesh, rng, me).await;
    if let Some(theirs) = rng.pick(&other.stored).cloned()
        && !mine.stored.iter().any(|s| s.bytes == theirs.bytes)
    {
        let stored = put(mesh, &token, &theirs.bytes, None)
            .await
            .expect("PutArtifact");
        let artifact = stored.artifact.expect("artifact");
        let sha = theirs.uri.rsplit('/').next().unwrap_or_default();
        f.check(
            stored.created && artifact.uri == format!("artifact://{}/{sha}", me.name),
            "PutArtifact of bytes only the other tenant stored",
            || format!("created {}, {artifact:?}", stored.created),
        );
        mine.artifacts.insert(artifact.uri.clone());
        mine.stored.push(Stored {
            bytes: theirs.bytes,
            uri: artifact.uri,
            hash: artifact.content_hash,
        });
    }
    let theirs: Vec<String> = other.evidence.difference(&mine.evidence).cloned().collect();
    if let (Some(id), Some(own)) = (rng.pick(&theirs), rng.pick(&mine.stored)) {
        let recorded = record_evidence(mesh, &token, record(id, &own.uri, &own.hash)).await;
        f.check(
            recorded.as_ref().is_ok_and(|e| e.tenant == me.name),
            "RecordEvidence under an evidence id only the other tenant has",
            || format!("{id}: {recorded:?}"),
        );
        mine.evidence.insert(id.clone());
        mine.borrowed.insert(id.clone());
    }
    let runs: Vec<&String> = other.runs.keys().collect();
    if let Some(run_id) = rng.pick(&runs).copied() {
        request_approval(mesh, rng, me, run_id, mine).await;
        mine.borrowed.insert(run_id.clone());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_call_of_one_tenant_returns_counts_or_reveals_the_other_tenants_objects() {
    let base = std::env::var(SEED_ENV)
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or_else(|| {
            SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos() as u64)
        });
    eprintln!("isolation: base seed {base} ({SEED_ENV}={base} replays these cases)");
    let mesh = TestMesh::start(
        Mode::InProcess,
        MeshOptions {
            policy: Some(policy()),
            ..MeshOptions::default()
        },
    )
    .await;
    let (mut acme, mut globex) = (Made::default(), Made::default());
    // Every case runs, so one run of the test reports all it finds.
    let mut f = Findings::default();
    for case in 0..CASES {
        f.case = case;
        let mut rng = Rng(base.wrapping_add(case));
        let (mut ra, mut rg) = (Rng(rng.next()), Rng(rng.next()));
        tokio::join!(
            make(&mesh, &mut ra, ACME, &mut acme),
            make(&mesh, &mut rg, GLOBEX, &mut globex)
        );
        borrow(&mesh, &mut rng, &mut f, ACME, &mut acme, &globex).await;
        borrow(&mesh, &mut rng, &mut f, GLOBEX, &mut globex, &acme).await;
        for (t, made) in [(ACME, &mut acme), (GLOBEX, &mut globex)] {
            made.events = ids_of(outbox(&mesh, t.oncall, "", "").await);
            made.approval_events = ids_of(approval_stream(&mesh, t.oncall, "", "").await);
            eprintln!(
                "isolation: case {case}, {} holds {}",
                t.name,
                made.summary()
            );
        }
        for (me, other, mine, theirs) in [
            (ACME, GLOBEX, &acme, &globex),
            (GLOBEX, ACME, &globex, &acme),
        ] {
            let token = task_token(&mesh, &mut rng, me).await;
            let view = View::new(&mesh, me, other, &token, mine, theirs);
            view.all(&mut rng, &mut f).await;
        }
        for (t, made) in [(ACME, &acme), (GLOBEX, &globex)] {
            unchanged(&mesh, &mut f, t, made).await;
        }
    }
    let found = &f.found;
    assert!(
        found.is_empty(),
        "{} propert{} broken (base seed {base}; {SEED_ENV}={base} replays the cases):\n{}",
        found.len(),
        if found.len() == 1 { "y" } else { "ies" },
        found
            .iter()
            .map(|(what, (n, first))| format!("- {what} ({n}x), e.g. {first}"))
            .collect::<Vec<_>>()
            .join("\n")
    );
}

fn ids_of(events: Result<Vec<v1::CloudEvent>, Status>) -> BTreeSet<String> {
    events
        .expect("the tenant's own events")
        .into_iter()
        .map(|e| e.id)
        .collect()
}

/// Checks that `t`'s runs and requests are as they settled: the other tenant's calls
/// changed nothing.
async fn unchanged(mesh: &TestMesh, f: &mut Findings, t: Tenant, made: &Made) {
    for (run_id, state) in &made.runs {
        let run = mesh.get_run(t.oncall, run_id).await;
        let events = mesh.run_events(t.oncall, run_id).await;
        f.check(
            run.state == *state && Some(&events.len()) == made.run_events.get(run_id),
            &format!("a run of {} stays as it settled", t.name),
            || {
                format!(
                    "{run_id}: state {} → {}, events {events:#?}",
                    state, run.state
                )
            },
        );
    }
    for (id, state) in &made.approval_states {
        let now = get_approval(mesh, t.oncall, id).await;
        f.check(
            now.as_ref().is_ok_and(|a| a.state == *state),
            &format!("a request of {} stays as it settled", t.name),
            || format!("{id}: state {state} → {now:?}"),
        );
    }
}
