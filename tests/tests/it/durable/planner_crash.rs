//! A supervisor killed at each of its crash points while model-planned runs are in
//! flight — before and after a planner turn's commit, while the turn's delegations run,
//! during the join, after StartRun and after the decision — in batches of runs, and
//! restarted: every run finishes exactly as an uncrashed run of the same spec, the model
//! is never asked again for a turn that was committed, and no delegation is created or
//! executed twice.
//!
//! The planner is an `openai` profile asking a scripted OpenAI-compatible server in this
//! process, which plays the example planner's playbook; the specialists are the
//! example's playbook profiles. The server's request log is the model's side of the
//! story: every request says which run and which turn it asks for.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant, SystemTime};

use crate::harness::{example_profiles, repo_root, spec_from_yaml};
use convene_core::ids;
use convene_proto::v1;
use convene_supervisor::CrashPoint;
use convene_worker::model_server::{PlaybookResponder, Recorded, ScriptedModel};

use super::cycle::{CrashTest, Outcome, crash_cycles};
use super::shape::{Finished, Shape, assert_once_per_delegation, inspect, shape};
use super::{LIMIT, start_until_accepted};

/// The planner profile the runs use: `openai`, pointed at the scripted server.
const PLANNER: &str = "incident-planner-model";
/// Runs per batch; each batch meets one crash point (sometimes two).
const BATCH: usize = 10;
/// Batches with a crash per point; every point meets `PER_POINT` different `after`s.
const PER_POINT: usize = 3;
/// Runs that must be in flight when a supervisor dies, over the whole test.
const MIN_CRASHED_RUNS: usize = 50;
/// How much later than a turn's commit a request for it may seem to arrive: the
/// request log's monotonic clock and the supervisor's wall clock are mapped onto each
/// other once, at the test's start.
const CLOCK_SLACK: Duration = Duration::from_millis(5);

/// The example profiles with the model planner pointed at `base_url`.
fn profiles_at(base_url: &str) -> String {
    let text = example_profiles();
    let start = text
        .find(&format!("  - id: {PLANNER}\n"))
        .unwrap_or_else(|| panic!("the example profiles hold {PLANNER}"));
    let (before, planner) = text.split_at(start);
    let provider = planner
        .find("    provider: openai")
        .unwrap_or_else(|| panic!("{PLANNER} is an openai profile"));
    let line_end = provider
        + planner[provider..]
            .find('\n')
            .expect("the provider line ends");
    format!(
        "{before}{}\n    base_url: {base_url}{}",
        &planner[..line_end],
        &planner[line_end..]
    )
}

/// run-planner.yaml with the model planner, under its own idempotency key.
fn planner_spec(key: &str) -> v1::RunSpec {
    let path = repo_root().join("examples/payment-incident/run-planner.yaml");
    let mut spec = spec_from_yaml(
        &std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display())),
    );
    let planner = spec
        .planner
        .as_mut()
        .expect("run-planner.yaml has a planner");
    planner.profile_id = PLANNER.to_owned();
    assert_eq!(
        planner.profiles,
        [
            "logs-investigator",
            "metrics-investigator",
            "change-auditor"
        ],
        "the playbook specialists"
    );
    spec.idempotency_key = key.to_owned();
    spec
}

/// The specs a crash batch runs, alternately: the model-planned example (each turn's
/// delegations at once) and the same one delegation at a time (QUEUE overflow: when the
/// supervisor dies, some of a committed turn's delegations wait in the queue).
const SPECS: [fn(&str) -> v1::RunSpec; 2] = [planner_spec, queued_planner_spec];

fn queued_planner_spec(key: &str) -> v1::RunSpec {
    let mut spec = planner_spec(key);
    let limits = spec.limits.as_mut().expect("run-planner.yaml sets limits");
    limits.max_parallel_workers = 1;
    assert_eq!(limits.overflow, v1::OverflowPolicy::Queue as i32);
    spec
}

/// What must be the same of the planner in every run of one spec, crashed or not, with
/// delegation ids replaced by the delegations' names.
#[derive(Debug, PartialEq, Eq)]
struct PlannerShape {
    /// Per committed turn: its round, and each call's tool, delegation and refusal.
    turns: Vec<(u32, Vec<String>)>,
    /// Per delegation name: its round, profile and state.
    delegations: BTreeMap<String, (u32, String, String)>,
    /// The conversation: each message's role, and the calls an assistant message asks.
    conversation: Vec<String>,
    /// The last round.
    round: u32,
    /// How many rounds the join decided (progress hashes recorded).
    decided_rounds: usize,
    /// What `finish` handed in: the summary, the ids it cites, and whether it did.
    summary: String,
    cited: Vec<String>,
    finished: bool,
}

/// Replaces the run's id and its delegations' ids in `text` by `<run>` and their names.
fn normalizer(run: &v1::Run) -> impl Fn(&str) -> String + '_ {
    move |text: &str| {
        let mut s = text.replace(&run.run_id, "<run>");
        for t in run.delegations.iter().filter_map(|d| d.task.as_ref()) {
            s = s.replace(&t.delegation_id, &format!("<{}>", t.name));
        }
        s
    }
}

fn planner_shape(run: &v1::Run) -> PlannerShape {
    let norm = normalizer(run);
    let planner = run.planner.clone().unwrap_or_default();
    let turns = planner
        .turns
        .iter()
        .map(|t| {
            let calls = t
                .calls
                .iter()
                .map(|c| {
                    format!(
                        "{} {} {}{}",
                        c.tool,
                        norm(&c.delegation_id),
                        norm(&c.error),
                        if c.dropped { " (dropped)" } else { "" }
                    )
                })
                .collect();
            (t.round, calls)
        })
        .collect();
    let delegations = run
        .delegations
        .iter()
        .filter_map(|d| {
            let t = d.task.as_ref()?;
            let state = v1::DelegationState::try_from(d.state)
                .map_or("?", |s| s.as_str_name())
                .to_owned();
            Some((t.name.clone(), (t.round, t.profile_id.clone(), state)))
        })
        .collect();
    let conversation = planner
        .messages
        .iter()
        .map(|m| {
            let calls: Vec<String> = m
                .tool_calls
                .iter()
                .map(|c| format!("{}({})", c.name, norm(&c.arguments)))
                .collect();
            format!("{} {}", m.role, calls.join(" "))
        })
        .collect();
    let mut cited: Vec<String> = planner.cited.iter().map(|c| norm(c)).collect();
    cited.sort();
    PlannerShape {
        turns,
        delegations,
        conversation,
        round: planner.round,
        decided_rounds: planner.progress.len(),
        summary: norm(&planner.summary),
        cited,
        finished: planner.finished,
    }
}

/// No delegation was created twice: every accepted `delegate` call names its own
/// delegation, under the id its round and call index plan (`hash(run, round, index)`),
/// and every delegation of the run is the one call's that created it.
fn assert_created_once(run: &v1::Run, label: &str) {
    let planner = run
        .planner
        .as_ref()
        .unwrap_or_else(|| panic!("{label}: the run has no planner state"));
    let mut created: BTreeMap<String, usize> = BTreeMap::new();
    let mut index_in_round: BTreeMap<u32, u32> = BTreeMap::new();
    for t in &planner.turns {
        for c in t.calls.iter().filter(|c| c.tool == "delegate") {
            let index = index_in_round.entry(t.round).or_insert(0);
            let planned = ids::delegation_id(&run.run_id, None, t.round, *index);
            *index += 1;
            if c.delegation_id.is_empty() {
                continue;
            }
            assert_eq!(
                c.delegation_id, planned,
                "{label}: turn {}'s call {} created a delegation under another id than its \
                 round and call index plan",
                t.turn, c.call_id
            );
            *created.entry(c.delegation_id.clone()).or_insert(0) += 1;
        }
    }
    assert!(
        created.values().all(|n| *n == 1),
        "{label}: a delegation created by more than one call: {created:?}"
    );
    let ledger: BTreeMap<String, usize> = run
        .delegations
        .iter()
        .filter_map(|d| d.task.as_ref())
        .fold(BTreeMap::new(), |mut m, t| {
            *m.entry(t.delegation_id.clone()).or_insert(0) += 1;
            m
        });
    assert_eq!(
        ledger, created,
        "{label}: the run's delegations are exactly those its accepted calls created, once each"
    );
}

/// The planner turn a chat-completions request asks for: the run named by its first
/// user message ("Run <id>. Goal of the run: ...") and the turn after the assistant
/// messages it carries. None for a request that is not a planner's.
fn asked_turn(request: &Recorded) -> Option<(String, u32)> {
    if !request.tools().contains(&"delegate") {
        return None;
    }
    let messages = request.messages();
    let task = messages
        .iter()
        .find(|m| m["role"] == "user")?
        .get("content")?
        .as_str()?;
    let run_id = task
        .strip_prefix("Run ")?
        .split(". Goal of the run:")
        .next()?;
    let answered = messages.iter().filter(|m| m["role"] == "assistant").count();
    Some((run_id.to_owned(), u32::try_from(answered).ok()? + 1))
}

/// When each planner turn was asked of the model, per run and turn, in wall-clock time
/// (`origin` pairs one wall-clock reading with one monotonic one).
type Asked = BTreeMap<(String, u32), Vec<SystemTime>>;

fn asked(model: &ScriptedModel, origin: (SystemTime, Instant)) -> Asked {
    let mut asked: Asked = BTreeMap::new();
    for r in model.requests() {
        let Some(key) = asked_turn(&r) else {
            continue;
        };
        let at = origin.0 + r.received.saturating_duration_since(origin.1);
        asked.entry(key).or_default().push(at);
    }
    asked
}

/// No committed turn was asked of the model again: every request for a run's turn
/// arrived before the turn was committed, every committed turn was asked, and no turn
/// beyond the committed ones was asked. Returns how many turns were asked more than once.
fn assert_no_turn_asked_after_commit(asked: &Asked, run: &v1::Run, label: &str) -> usize {
    let planner = run
        .planner
        .as_ref()
        .unwrap_or_else(|| panic!("{label}: the run has no planner state"));
    let mut again = 0;
    for t in &planner.turns {
        let committed: SystemTime = t
            .committed_at
            .unwrap_or_else(|| panic!("{label}: turn {} has no commit time", t.turn))
            .try_into()
            .expect("a commit time after 1970");
        let requests = asked
            .get(&(run.run_id.clone(), t.turn))
            .unwrap_or_else(|| panic!("{label}: turn {} was committed, never asked", t.turn));
        for at in requests {
            assert!(
                *at <= committed + CLOCK_SLACK,
                "{label}: turn {} was asked of the model again {:?} after it was committed \
                 (requests at {requests:?}, committed at {committed:?})",
                t.turn,
                at.duration_since(committed).unwrap_or_default()
            );
        }
        // The last request for the turn came shortly before its commit (else the two
        // clocks are not mapped onto each other, and the check above proves nothing).
        let last = requests.iter().max().expect("at least one request");
        let lead = committed.duration_since(*last).unwrap_or_default();
        assert!(
            lead < LIMIT,
            "{label}: turn {} was last asked {lead:?} before its commit: the request log's \
             times are not mapped onto the supervisor's clock",
            t.turn
        );
        if requests.len() > 1 {
            again += 1;
        }
    }
    let turns: BTreeSet<u32> = planner.turns.iter().map(|t| t.turn).collect();
    let extra: Vec<u32> = asked
        .keys()
        .filter(|(id, turn)| *id == run.run_id && !turns.contains(turn))
        .map(|(_, turn)| *turn)
        .collect();
    assert!(
        extra.is_empty(),
        "{label}: turns {extra:?} were asked of the model and never committed (committed: \
         {turns:?})"
    );
    again
}

/// Everything every planner run must show, crashed or not: its delegations ran once
/// each under their planned ids, and no committed turn was asked again. Returns how
/// many of its turns were asked more than once.
fn check_run(f: &Finished, asked: &Asked, label: &str) -> usize {
    assert_once_per_delegation(f, label);
    assert_created_once(&f.run, label);
    assert_no_turn_asked_after_commit(asked, &f.run, label)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_supervisor_killed_at_any_crash_point_finishes_every_planner_run_like_an_uncrashed_one() {
    const REPLICA: &str = "planner-crash-replica";
    // The wall clock and the monotonic clock at one moment: the request log's times
    // become comparable with the supervisor's commit times.
    let origin = (SystemTime::now(), Instant::now());
    let responder = PlaybookResponder::new(
        &convene_worker::profiles::example().expect("the example profiles load"),
    )
    .expect("the example playbooks can be played");
    let model = ScriptedModel::start(responder).expect("the scripted model server starts");
    let profiles = profiles_at(&model.base_url());
    let mut t = CrashTest::start("planner crash test", REPLICA, Some(profiles)).await;
    let (client, credential, db, seed) = (&t.client, &t.credential, &t.db, t.seed);

    // Uncrashed runs of each spec: what every crashed one must end as.
    let mut expected: Vec<(Shape, PlannerShape)> = Vec::new();
    for (v, variant) in SPECS.iter().enumerate() {
        let mut baselines = Vec::new();
        for i in 0..2 {
            let id = start_until_accepted(
                client.clone(),
                credential.clone(),
                variant(&format!("planner-baseline-{seed}-{v}-{i}")),
            )
            .await;
            baselines.push(inspect(client, credential, db, &id).await);
        }
        let requests = asked(&model, origin);
        for f in &baselines {
            let again = check_run(f, &requests, "uncrashed run");
            assert_eq!(again, 0, "an uncrashed run asks each turn once");
        }
        let mut shapes: Vec<(Shape, PlannerShape)> = baselines
            .iter()
            .map(|f| (shape(f), planner_shape(&f.run)))
            .collect();
        assert_eq!(shapes[0], shapes[1], "uncrashed runs of one spec end alike");
        let (run, planner) = shapes.swap_remove(0);
        assert_eq!(
            run.state,
            "RUN_STATE_WAITING_INPUT JOIN_OUTCOME_CONFLICT_REQUIRES_HUMAN"
        );
        // The example's plan: three specialists in round 1, the change auditor's
        // follow-up in round 2, then finish.
        let tools: Vec<(u32, Vec<&str>)> = planner
            .turns
            .iter()
            .map(|(round, calls)| {
                let tools = calls
                    .iter()
                    .map(|c| c.split(' ').next().unwrap_or_default())
                    .collect();
                (*round, tools)
            })
            .collect();
        assert_eq!(
            tools,
            [
                (1, vec!["delegate"; 3]),
                (2, vec!["delegate"]),
                (2, vec!["finish"]),
            ],
            "{planner:#?}"
        );
        assert!(planner.finished, "{planner:#?}");
        expected.push((run, planner));
    }

    // Each run as an uncrashed one of its spec ends, and what every planner run must
    // show, with every request the model has had so far.
    let check = |runs: &[(String, Finished)]| {
        for (i, (label, f)) in runs.iter().enumerate() {
            assert_eq!(
                (shape(f), planner_shape(&f.run)),
                expected[i % SPECS.len()],
                "{label} ends unlike an uncrashed run"
            );
        }
        let requests = asked(&model, origin);
        for (label, f) in runs {
            check_run(f, &requests, label);
        }
    };
    let outcome = crash_cycles(
        &mut t,
        (&CrashPoint::ALL, BATCH, PER_POINT),
        |cycle, i| SPECS[i % SPECS.len()](&format!("planner-crash-{seed}-{cycle}-{i}")),
        check,
    )
    .await;
    let Outcome {
        runs: finished,
        kills,
        cycles,
        redispatched,
        takeovers,
        interrupted: crashed,
    } = outcome;

    // The model's side once more, with every request that ever came: no committed turn
    // was asked again, not even late.
    let requests = asked(&model, origin);
    let mut asked_again = 0;
    for (label, f) in &finished {
        asked_again += assert_no_turn_asked_after_commit(&requests, &f.run, label);
    }

    let points: usize = kills.values().map(Vec::len).sum();
    eprintln!(
        "planner crash test: seed {seed}: {} runs, {crashed} in flight when a supervisor \
         died, {points} supervisor kills ({kills:?}), {asked_again} turns asked again \
         before their commit, {redispatched} runs with delegations dispatched again, \
         {takeovers} of {} restarts under another replica id, {} model requests, {:?}",
        finished.len(),
        cycles,
        model.request_count(),
        t.began.elapsed()
    );
    assert!(
        crashed >= MIN_CRASHED_RUNS,
        "only {crashed} planner runs were in flight when a supervisor died; at least \
         {MIN_CRASHED_RUNS} must be"
    );
    assert!(
        asked_again > 0,
        "no crash came between a turn's answer and its commit"
    );
    assert!(
        redispatched > 0,
        "no crash interrupted a dispatched delegation"
    );
}
