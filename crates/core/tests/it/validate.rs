//! Wire → domain validation: every invalid case names the exact field path and rule, and
//! a valid incident spec converts with defaults applied and timeouts resolved.

use std::collections::HashMap;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use convene_core::model::{self, JoinStrategy, LateResultPolicy, OnConflict, OnTimeout, Overflow};
use convene_core::permissions::Permission;
use convene_core::validate;
use convene_core::{Rule, ValidationError};
use convene_proto::v1;

/// The run's start in every test: a fixed instant, so deadlines are exact.
fn now() -> SystemTime {
    UNIX_EPOCH + Duration::from_secs(1_767_000_000)
}

fn ts(t: SystemTime) -> prost_types::Timestamp {
    prost_types::Timestamp::from(t)
}

fn secs(s: i64) -> prost_types::Duration {
    prost_types::Duration {
        seconds: s,
        nanos: 0,
    }
}

fn strings(items: &[&str]) -> Vec<String> {
    items.iter().map(|s| (*s).to_owned()).collect()
}

fn planned(name: &str, profile: &str, domain: &str) -> v1::PlannedDelegation {
    v1::PlannedDelegation {
        name: name.into(),
        profile_id: profile.into(),
        goal: format!("Find what the {domain} say about the payment_confirm timeouts"),
        acceptance_criteria: strings(&["every claim cites evidence"]),
        scope: Some(v1::TaskScope {
            resources: strings(&["service/payment-*", "service/gateway"]),
            time_range: Some(v1::TimeRange {
                start: Some(ts(now() - Duration::from_secs(3600))),
                end: Some(ts(now())),
            }),
        }),
        input_refs: strings(&["artifact://acme/3f2a9c"]),
        allowed_tools: vec![format!("search_{domain}@1")],
        required_scopes: vec![v1::PermissionScope {
            action: format!("{domain}:read"),
            resource: "service/payment-*".into(),
            data_scope: None,
        }],
        timeout: Some(secs(60)),
        budget: Some(v1::Budget {
            max_tool_calls: 20,
            max_tokens: 0,
            max_cost: 0.5,
        }),
        may_redelegate: false,
    }
}

/// The 2:02 a.m. payment incident: three read-only specialists, a TIMEOUT_PARTIAL join.
fn incident_spec() -> v1::RunSpec {
    v1::RunSpec {
        goal: "  Why did payment success drop from 99.6% to 93.1% at 02:02?  ".into(),
        idempotency_key: "incident-0202".into(),
        delegations: vec![
            planned("logs", "logs-investigator", "logs"),
            planned("metrics", "metrics-analyst", "metrics"),
            planned("changes", "change-auditor", "changes"),
        ],
        planner: None,
        join: Some(v1::JoinContract {
            join_id: "join-incident-evidence-v1".into(),
            required: strings(&["logs", "metrics"]),
            optional: strings(&["changes"]),
            strategy: v1::JoinStrategy::TimeoutPartial as i32,
            minimum: Some(v1::JoinMinimum {
                count: 2,
                weight: 0.0,
                required_evidence_kinds: strings(&["impact_metric"]),
            }),
            deadline: None,
            timeout: Some(secs(90)),
            on_timeout: 0,
            on_conflict: v1::OnConflict::PreserveAndEscalate as i32,
            late_result: v1::LateResultPolicy::AppendRevision as i32,
            weights: HashMap::from([("logs".into(), 1.0), ("change-auditor".into(), 2.0)]),
            required_profiles: Vec::new(),
        }),
        limits: Some(v1::Limits {
            max_parallel_workers: 3,
            timeout: Some(secs(300)),
            max_tool_calls: 60,
            ..v1::Limits::default()
        }),
        labels: HashMap::from([("incident".into(), "payment-0202".into())]),
    }
}

#[track_caller]
fn assert_invalid<T: std::fmt::Debug>(
    result: Result<T, ValidationError>,
    field: &str,
    rule: Rule,
) -> ValidationError {
    match result {
        Ok(v) => panic!("expected {field} to break {rule:?}, but it validated: {v:?}"),
        Err(e) => {
            assert_eq!(
                (e.field.as_str(), e.rule),
                (field, rule),
                "wrong error: {e}"
            );
            assert!(!e.message.is_empty());
            e
        }
    }
}

#[test]
fn incident_spec_converts_with_defaults_and_resolved_deadlines() {
    let spec = validate::run_spec(&incident_spec(), now()).expect("the incident spec is valid");

    assert_eq!(
        spec.goal,
        "Why did payment success drop from 99.6% to 93.1% at 02:02?"
    );
    assert_eq!(spec.idempotency_key.as_deref(), Some("incident-0202"));
    let names: Vec<&str> = spec.plan.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(names, ["logs", "metrics", "changes"]);

    let logs = &spec.plan[0];
    assert_eq!(logs.profile_id, "logs-investigator");
    assert_eq!(logs.timeout, Some(Duration::from_secs(60)));
    assert_eq!(
        logs.budget,
        model::Budget {
            max_tool_calls: Some(20),
            max_tokens: None,
            max_cost: Some(0.5),
        }
    );
    assert_eq!(
        logs.required_scopes,
        [Permission::new("logs:read", "service/payment-*").unwrap()]
    );
    assert_eq!(
        logs.scope.resources,
        ["service/payment-*", "service/gateway"]
    );
    assert_eq!(logs.scope.time_range.end, Some(now()));
    assert_eq!(logs.allowed_tools, ["search_logs@1"]);

    let join = &spec.join;
    assert_eq!(join.strategy, JoinStrategy::TimeoutPartial);
    assert_eq!(join.deadline, Some(now() + Duration::from_secs(90)));
    assert_eq!(
        join.on_timeout,
        OnTimeout::EmitPartial,
        "unspecified → default"
    );
    assert_eq!(join.on_conflict, OnConflict::PreserveAndEscalate);
    assert_eq!(join.late_result, LateResultPolicy::AppendRevision);
    assert_eq!(join.minimum.count, 2);
    assert_eq!(join.minimum.required_evidence_kinds, ["impact_metric"]);
    assert_eq!(join.weights.get("change-auditor"), Some(&2.0));

    let limits = &spec.limits;
    assert_eq!(limits.max_depth, model::Limits::DEFAULT_MAX_DEPTH);
    assert_eq!(limits.max_parallel_workers, 3);
    assert_eq!(limits.overflow, Overflow::Queue);
    assert_eq!(limits.max_iterations, model::Limits::DEFAULT_MAX_ITERATIONS);
    assert_eq!(limits.max_rounds, model::Limits::DEFAULT_MAX_ROUNDS);
    assert_eq!(
        limits.max_redelegations,
        model::Limits::DEFAULT_MAX_REDELEGATIONS
    );
    assert_eq!(limits.deadline, now() + Duration::from_secs(300));
    assert_eq!(limits.max_tool_calls, Some(60));
    assert_eq!(limits.max_tokens, None);
    assert_eq!(limits.max_cost, None);
    assert_eq!(
        limits.no_progress_rounds,
        model::Limits::DEFAULT_NO_PROGRESS_ROUNDS
    );
    assert_eq!(
        spec.labels.get("incident").map(String::as_str),
        Some("payment-0202")
    );
}

#[test]
fn unset_limits_take_every_default() {
    let limits = validate::limits(None, now(), "spec.limits").unwrap();
    assert_eq!(limits, model::Limits::defaults(now()));
    assert_eq!(limits.deadline, now() + model::Limits::DEFAULT_TIMEOUT);

    // Zero values mean "default" too, including a zero timeout.
    let zeros = v1::Limits {
        timeout: Some(secs(0)),
        ..v1::Limits::default()
    };
    assert_eq!(
        validate::limits(Some(&zeros), now(), "spec.limits").unwrap(),
        model::Limits::defaults(now())
    );
}

#[test]
fn an_absolute_deadline_is_kept_as_given() {
    let mut spec = incident_spec();
    let deadline = now() + Duration::from_secs(45);
    let join = spec.join.as_mut().unwrap();
    join.timeout = None;
    join.deadline = Some(ts(deadline));
    let spec = validate::run_spec(&spec, now()).unwrap();
    assert_eq!(spec.join.deadline, Some(deadline));
}

#[test]
fn join_references_may_name_profiles() {
    let mut spec = incident_spec();
    spec.join.as_mut().unwrap().required = strings(&["logs-investigator"]);
    let spec = validate::run_spec(&spec, now()).unwrap();
    assert_eq!(spec.join.required, ["logs-investigator"]);
}

#[test]
fn a_join_minimum_of_zero_means_one() {
    let j = v1::JoinContract {
        strategy: v1::JoinStrategy::All as i32,
        ..v1::JoinContract::default()
    };
    let join = validate::join_contract(&j, now(), "join").unwrap();
    assert_eq!(join.minimum.count, 1);
    assert_eq!(join.deadline, None);
    assert_eq!(join.late_result, LateResultPolicy::Discard);
}

/// One invalid case: a name, how to break a valid message, and the error expected.
type Case<M> = (&'static str, fn(&mut M), &'static str, Rule);

/// Checks that `base` is valid and that each case's mutation of it fails with exactly
/// the case's field and rule.
#[track_caller]
fn check_cases<M: Clone, T>(
    base: &M,
    cases: Vec<Case<M>>,
    validate: impl Fn(&M) -> Result<T, ValidationError>,
) {
    validate(base).expect("the base message is valid");
    for (name, mutate, field, rule) in cases {
        let mut m = base.clone();
        mutate(&mut m);
        match validate(&m) {
            Err(e) => assert_eq!(
                (e.field.as_str(), e.rule),
                (field, rule),
                "case `{name}`: wrong error: {e}"
            ),
            Ok(_) => panic!("case `{name}`: expected {field} to break {rule:?}, but it validated"),
        }
    }
}

fn join(spec: &mut v1::RunSpec) -> &mut v1::JoinContract {
    spec.join.as_mut().unwrap()
}

fn limits(spec: &mut v1::RunSpec) -> &mut v1::Limits {
    spec.limits.as_mut().unwrap()
}

#[test]
fn every_invalid_run_spec_names_its_field_and_rule() {
    // One case per line reads as a table; keep rustfmt from unrolling it.
    #[rustfmt::skip]
    let cases: Vec<Case<v1::RunSpec>> = vec![
        // Run-level fields.
        ("blank goal", |s| s.goal = "   ".into(), "spec.goal", Rule::Required),
        ("long goal", |s| s.goal = "x".repeat(4097), "spec.goal", Rule::TooLong),
        ("control char in key", |s| s.idempotency_key = "a\u{7}b".into(), "spec.idempotency_key", Rule::Format),
        ("long key", |s| s.idempotency_key = "k".repeat(257), "spec.idempotency_key", Rule::TooLong),
        ("planner and delegations", |s| s.planner = Some(v1::PlannerSpec::default()), "spec.planner", Rule::Exclusive),
        ("no plan", |s| s.delegations.clear(), "spec.delegations", Rule::Required),
        ("duplicate names", |s| s.delegations[2].name = "logs".into(), "spec.delegations[2].name", Rule::Duplicate),
        ("labels with empty key", |s| {
            s.labels.insert(String::new(), "x".into());
        }, "spec.labels[\"\"]", Rule::Required),
        // Planned delegations.
        ("empty name", |s| s.delegations[1].name.clear(), "spec.delegations[1].name", Rule::Required),
        ("bad name", |s| s.delegations[1].name = "Logs!".into(), "spec.delegations[1].name", Rule::Format),
        ("long name", |s| s.delegations[1].name = "n".repeat(65), "spec.delegations[1].name", Rule::TooLong),
        ("empty profile", |s| s.delegations[1].profile_id = " ".into(), "spec.delegations[1].profile_id", Rule::Required),
        ("empty task goal", |s| s.delegations[0].goal.clear(), "spec.delegations[0].goal", Rule::Required),
        ("blank criterion", |s| s.delegations[0].acceptance_criteria.push(String::new()), "spec.delegations[0].acceptance_criteria[1]", Rule::Required),
        ("tool without version", |s| s.delegations[0].allowed_tools = strings(&["search_logs@"]), "spec.delegations[0].allowed_tools[0]", Rule::Format),
        ("tool without @", |s| s.delegations[0].allowed_tools.push("search_logs".into()), "spec.delegations[0].allowed_tools[1]", Rule::Format),
        ("bad scope resource", |s| s.delegations[0].scope.as_mut().unwrap().resources[1] = "a*b".into(), "spec.delegations[0].scope.resources[1]", Rule::Format),
        ("inverted scope window", |s| {
            let tr = s.delegations[0].scope.as_mut().unwrap().time_range.as_mut().unwrap();
            std::mem::swap(&mut tr.start, &mut tr.end);
        }, "spec.delegations[0].scope.time_range", Rule::Range),
        ("bad required-scope pattern", |s| s.delegations[2].required_scopes[0].resource = "service/*/db".into(), "spec.delegations[2].required_scopes[0].resource", Rule::Format),
        ("empty required-scope action", |s| s.delegations[2].required_scopes[0].action.clear(), "spec.delegations[2].required_scopes[0].action", Rule::Format),
        ("input ref not an artifact", |s| s.delegations[0].input_refs = strings(&["s3://bucket/x"]), "spec.delegations[0].input_refs[0]", Rule::Format),
        ("zero task timeout", |s| s.delegations[0].timeout = Some(secs(0)), "spec.delegations[0].timeout", Rule::Range),
        ("negative task timeout", |s| s.delegations[0].timeout = Some(secs(-5)), "spec.delegations[0].timeout", Rule::Range),
        ("negative task cost", |s| s.delegations[0].budget.as_mut().unwrap().max_cost = -1.0, "spec.delegations[0].budget.max_cost", Rule::Range),
        ("infinite task cost", |s| s.delegations[0].budget.as_mut().unwrap().max_cost = f64::INFINITY, "spec.delegations[0].budget.max_cost", Rule::Range),
        // The join contract.
        ("no join", |s| s.join = None, "spec.join", Rule::Required),
        ("unspecified strategy", |s| join(s).strategy = 0, "spec.join.strategy", Rule::Required),
        ("unknown strategy", |s| join(s).strategy = 9, "spec.join.strategy", Rule::UnknownEnum),
        ("unknown on_timeout", |s| join(s).on_timeout = 7, "spec.join.on_timeout", Rule::UnknownEnum),
        ("unknown on_conflict", |s| join(s).on_conflict = -1, "spec.join.on_conflict", Rule::UnknownEnum),
        ("unknown late_result", |s| join(s).late_result = 3, "spec.join.late_result", Rule::UnknownEnum),
        ("deadline and timeout", |s| join(s).deadline = Some(ts(now() + Duration::from_secs(60))), "spec.join.timeout", Rule::Exclusive),
        ("deadline in the past", |s| {
            join(s).timeout = None;
            join(s).deadline = Some(ts(now() - Duration::from_secs(1)));
        }, "spec.join.deadline", Rule::InPast),
        ("deadline at the start", |s| {
            join(s).timeout = None;
            join(s).deadline = Some(ts(now()));
        }, "spec.join.deadline", Rule::InPast),
        ("zero join timeout", |s| join(s).timeout = Some(secs(0)), "spec.join.timeout", Rule::Range),
        ("timeout-partial without deadline", |s| join(s).timeout = None, "spec.join.deadline", Rule::Required),
        ("negative minimum weight", |s| join(s).minimum.as_mut().unwrap().weight = -0.5, "spec.join.minimum.weight", Rule::Range),
        ("NaN minimum weight", |s| join(s).minimum.as_mut().unwrap().weight = f64::NAN, "spec.join.minimum.weight", Rule::Range),
        ("zero weight", |s| {
            join(s).weights.insert("logs".into(), 0.0);
        }, "spec.join.weights[\"logs\"]", Rule::Range),
        ("infinite weight", |s| {
            join(s).weights.insert("metrics".into(), f64::INFINITY);
        }, "spec.join.weights[\"metrics\"]", Rule::Range),
        ("required and optional", |s| join(s).optional = strings(&["metrics"]), "spec.join.optional[0]", Rule::Duplicate),
        ("repeated required", |s| join(s).required = strings(&["logs", "logs"]), "spec.join.required[1]", Rule::Duplicate),
        ("blank required", |s| join(s).required = strings(&[""]), "spec.join.required[0]", Rule::Required),
        ("unknown required", |s| join(s).required = strings(&["logs", "tracing"]), "spec.join.required[1]", Rule::UnknownReference),
        ("unknown optional", |s| join(s).optional = strings(&["change-audit"]), "spec.join.optional[0]", Rule::UnknownReference),
        ("unknown weight key", |s| {
            join(s).weights.insert("nope".into(), 1.0);
        }, "spec.join.weights[\"nope\"]", Rule::UnknownReference),
        ("unreachable minimum", |s| join(s).minimum.as_mut().unwrap().count = 4, "spec.join.minimum.count", Rule::Range),
        ("blank required profile", |s| join(s).required_profiles = strings(&[""]), "spec.join.required_profiles[0]", Rule::Required),
        ("bad required profile", |s| join(s).required_profiles = strings(&["logs investigator"]), "spec.join.required_profiles[0]", Rule::Format),
        ("repeated required profile", |s| join(s).required_profiles = strings(&["change-auditor", "logs-investigator", "change-auditor"]), "spec.join.required_profiles[2]", Rule::Duplicate),
        ("required profile not in the plan", |s| join(s).required_profiles = strings(&["logs-investigator", "trace-analyst"]), "spec.join.required_profiles[1]", Rule::UnknownReference),
        ("required profile named by a delegation name", |s| join(s).required_profiles = strings(&["logs"]), "spec.join.required_profiles[0]", Rule::UnknownReference),
        // Limits.
        ("unknown overflow", |s| limits(s).overflow = 9, "spec.limits.overflow", Rule::UnknownEnum),
        ("limits deadline and timeout", |s| limits(s).deadline = Some(ts(now() + Duration::from_secs(60))), "spec.limits.timeout", Rule::Exclusive),
        ("limits deadline in the past", |s| {
            limits(s).timeout = None;
            limits(s).deadline = Some(ts(now() - Duration::from_secs(600)));
        }, "spec.limits.deadline", Rule::InPast),
        ("depth past the cap", |s| limits(s).max_depth = 17, "spec.limits.max_depth", Rule::Range),
        ("width past the cap", |s| limits(s).max_parallel_workers = 1025, "spec.limits.max_parallel_workers", Rule::Range),
        ("redelegations past the cap", |s| limits(s).max_redelegations = 17, "spec.limits.max_redelegations", Rule::Range),
        ("negative run cost", |s| limits(s).max_cost = -2.0, "spec.limits.max_cost", Rule::Range),
    ];

    check_cases(&incident_spec(), cases, |s| validate::run_spec(s, now()));
}

#[test]
fn an_unknown_strategy_lists_the_known_ones() {
    let mut spec = incident_spec();
    join(&mut spec).strategy = 9;
    let e = assert_invalid(
        validate::run_spec(&spec, now()),
        "spec.join.strategy",
        Rule::UnknownEnum,
    );
    assert_eq!(
        e.message,
        "unknown strategy 9; expected one of JOIN_STRATEGY_ALL, JOIN_STRATEGY_QUORUM, \
         JOIN_STRATEGY_TIMEOUT_PARTIAL, JOIN_STRATEGY_FIRST_VALID"
    );
}

#[test]
fn an_unknown_reference_lists_what_exists() {
    let mut spec = incident_spec();
    join(&mut spec).required = strings(&["tracing"]);
    let e = assert_invalid(
        validate::run_spec(&spec, now()),
        "spec.join.required[0]",
        Rule::UnknownReference,
    );
    assert!(e.message.contains("`tracing`"), "{e}");
    assert!(e.message.contains("changes, logs, metrics"), "{e}");
    assert!(e.message.contains("logs-investigator"), "{e}");
}

#[test]
fn a_spec_without_a_plan_names_both_ways_to_give_one() {
    let mut spec = incident_spec();
    spec.delegations.clear();
    let e = assert_invalid(
        validate::run_spec(&spec, now()),
        "spec.delegations",
        Rule::Required,
    );
    assert!(e.message.contains("static plan in delegations"), "{e}");
    assert!(e.message.contains("or a planner"), "{e}");
}

#[test]
fn a_static_plan_may_require_profiles() {
    let mut spec = incident_spec();
    join(&mut spec).required_profiles = strings(&["change-auditor", "logs-investigator"]);
    let spec = validate::run_spec(&spec, now()).unwrap();
    assert_eq!(
        spec.join.required_profiles,
        ["change-auditor", "logs-investigator"]
    );
    assert_eq!(spec.planner, None);
    assert_eq!(spec.limits.max_rounds, model::Limits::DEFAULT_MAX_ROUNDS);

    let mut spec = incident_spec();
    join(&mut spec).required_profiles = strings(&["trace-analyst"]);
    let e = assert_invalid(
        validate::run_spec(&spec, now()),
        "spec.join.required_profiles[0]",
        Rule::UnknownReference,
    );
    assert!(e.message.contains("`trace-analyst`"), "{e}");
    assert!(
        e.message
            .contains("change-auditor, logs-investigator, metrics-analyst"),
        "{e}"
    );
}

// ---------------------------------------------------------------------------------------
// Planner runs.

/// The incident handed to a planner: no static plan, a contract that names the profiles
/// the answer needs.
fn planner_spec() -> v1::RunSpec {
    let mut spec = incident_spec();
    spec.delegations.clear();
    spec.planner = Some(v1::PlannerSpec {
        profile_id: "incident-planner".into(),
        instructions: "  Start with the logs; ask metrics for the impact.  ".into(),
        ..v1::PlannerSpec::default()
    });
    let join = join(&mut spec);
    join.required.clear();
    join.optional.clear();
    join.weights.clear();
    join.required_profiles = strings(&["logs-investigator", "metrics-analyst"]);
    // A planner's run has no plan to check the count against: it stays as given.
    join.minimum.as_mut().unwrap().count = 5;
    spec
}

fn planner(spec: &mut v1::RunSpec) -> &mut v1::PlannerSpec {
    spec.planner.as_mut().unwrap()
}

#[test]
fn a_planner_spec_converts_with_an_empty_plan() {
    let spec = validate::run_spec(&planner_spec(), now()).expect("the planner spec is valid");
    assert!(spec.plan.is_empty(), "the planner names the delegations");
    assert_eq!(
        spec.planner,
        Some(model::Planner {
            profile_id: "incident-planner".into(),
            instructions: "Start with the logs; ask metrics for the impact.".into(),
        })
    );
    assert_eq!(
        spec.join.required_profiles,
        ["logs-investigator", "metrics-analyst"]
    );
    assert!(spec.join.required.is_empty() && spec.join.weights.is_empty());
    assert_eq!(spec.join.minimum.count, 5);
    assert_eq!(spec.limits.max_parallel_workers, 3, "given limits are kept");

    // No instructions, no required profiles: still a valid planner run.
    let mut bare = planner_spec();
    planner(&mut bare).instructions.clear();
    join(&mut bare).required_profiles.clear();
    let bare = validate::run_spec(&bare, now()).unwrap();
    assert_eq!(bare.planner.unwrap().instructions, "");
    assert!(bare.join.required_profiles.is_empty());
}

#[test]
fn a_planner_run_defaults_to_four_rounds() {
    let rounds = |spec: &v1::RunSpec| validate::run_spec(spec, now()).unwrap().limits.max_rounds;
    assert_eq!(model::Limits::DEFAULT_PLANNER_MAX_ROUNDS, 4);

    let mut spec = planner_spec();
    assert_eq!(limits(&mut spec).max_rounds, 0, "unset in the base spec");
    assert_eq!(rounds(&spec), model::Limits::DEFAULT_PLANNER_MAX_ROUNDS);
    spec.limits = None;
    assert_eq!(rounds(&spec), model::Limits::DEFAULT_PLANNER_MAX_ROUNDS);
    let spec = validate::run_spec(&spec, now()).unwrap();
    assert_eq!(
        spec.limits,
        model::Limits {
            max_rounds: model::Limits::DEFAULT_PLANNER_MAX_ROUNDS,
            ..model::Limits::defaults(now())
        },
        "every other limit keeps its default"
    );

    let mut spec = planner_spec();
    limits(&mut spec).max_rounds = 9;
    assert_eq!(rounds(&spec), 9, "a given max_rounds is kept");

    // A static plan keeps its own default, and may ask for more rounds.
    let mut spec = incident_spec();
    assert_eq!(rounds(&spec), model::Limits::DEFAULT_MAX_ROUNDS);
    limits(&mut spec).max_rounds = 3;
    assert_eq!(rounds(&spec), 3);
}

#[test]
fn every_invalid_planner_spec_names_its_field_and_rule() {
    #[rustfmt::skip]
    let cases: Vec<Case<v1::RunSpec>> = vec![
        ("planner and delegations", |s| s.delegations.push(planned("logs", "logs-investigator", "logs")), "spec.planner", Rule::Exclusive),
        ("no planner profile", |s| planner(s).profile_id.clear(), "spec.planner.profile_id", Rule::Required),
        ("planner profile with a space", |s| planner(s).profile_id = "incident planner".into(), "spec.planner.profile_id", Rule::Format),
        ("long planner profile", |s| planner(s).profile_id = "p".repeat(129), "spec.planner.profile_id", Rule::TooLong),
        ("long instructions", |s| planner(s).instructions = "i".repeat(4097), "spec.planner.instructions", Rule::TooLong),
        ("required delegations", |s| join(s).required = strings(&["logs"]), "spec.join.required", Rule::NotAllowed),
        ("required profile in required", |s| join(s).required = strings(&["logs-investigator"]), "spec.join.required", Rule::NotAllowed),
        ("optional delegations", |s| join(s).optional = strings(&["changes"]), "spec.join.optional", Rule::NotAllowed),
        ("weights", |s| {
            join(s).weights.insert("logs-investigator".into(), 2.0);
        }, "spec.join.weights", Rule::NotAllowed),
        ("blank required profile", |s| join(s).required_profiles.push(" ".into()), "spec.join.required_profiles[2]", Rule::Format),
        ("bad required profile", |s| join(s).required_profiles[0] = "logs/investigator".into(), "spec.join.required_profiles[0]", Rule::Format),
        ("repeated required profile", |s| join(s).required_profiles.push("logs-investigator".into()), "spec.join.required_profiles[2]", Rule::Duplicate),
        ("rounds past the cap", |s| limits(s).max_rounds = 1001, "spec.limits.max_rounds", Rule::Range),
    ];

    check_cases(&planner_spec(), cases, |s| validate::run_spec(s, now()));
}

#[test]
fn a_planner_run_asks_for_profiles_instead_of_delegations() {
    let mut spec = planner_spec();
    join(&mut spec).required = strings(&["logs"]);
    let e = assert_invalid(
        validate::run_spec(&spec, now()),
        "spec.join.required",
        Rule::NotAllowed,
    );
    assert_eq!(
        e.message,
        "a planner's run names profiles, not delegations: use join.required_profiles"
    );

    let mut spec = planner_spec();
    join(&mut spec).optional = strings(&["metrics-analyst"]);
    let e = assert_invalid(
        validate::run_spec(&spec, now()),
        "spec.join.optional",
        Rule::NotAllowed,
    );
    assert!(
        e.message
            .starts_with("a planner's run names profiles, not delegations: "),
        "{e}"
    );
    assert!(e.message.contains("join.required_profiles"), "{e}");
}

#[test]
fn a_duplicate_name_points_at_the_first_use() {
    let mut spec = incident_spec();
    spec.delegations[2].name = "metrics".into();
    let e = assert_invalid(
        validate::run_spec(&spec, now()),
        "spec.delegations[2].name",
        Rule::Duplicate,
    );
    assert!(e.message.contains("delegations[1].name"), "{e}");
}

#[test]
fn planned_task_uses_the_callers_root() {
    let mut p = planned("logs", "logs-investigator", "logs");
    p.allowed_tools = strings(&["search logs@1"]);
    assert_invalid(
        validate::planned_task(&p, "request.delegations[3]"),
        "request.delegations[3].allowed_tools[0]",
        Rule::Format,
    );
}

// ---------------------------------------------------------------------------------------
// Worker profiles.

fn profile() -> v1::WorkerProfile {
    v1::WorkerProfile {
        id: "logs-investigator".into(),
        name: String::new(),
        description: "Reads payment logs".into(),
        instructions: "Cite every log line you rely on.".into(),
        default_tools: strings(&["search_logs@1", "get_log_context@2"]),
        model: String::new(),
        provider: "playbook".into(),
        max_iterations: 0,
        max_tokens: 0,
        temperature: 0.0,
        capabilities: vec![v1::PermissionScope {
            action: "logs:read".into(),
            resource: "service/*".into(),
            data_scope: None,
        }],
        evidence_prefixes: strings(&["logs://payment-api/", "logs://gateway/"]),
        supports_parallel_completion: true,
        version: "1.2.0".into(),
    }
}

#[test]
fn a_profile_converts_with_defaults() {
    let p = validate::worker_profile(&profile(), "profile").unwrap();
    assert_eq!(p.name, "logs-investigator", "the name defaults to the id");
    assert_eq!(p.reference(), "logs-investigator@1.2.0");
    assert_eq!(p.max_iterations, 12);
    assert_eq!(p.max_tokens, 8192);
    assert!((p.temperature - 0.4).abs() < f64::EPSILON);
    assert_eq!(p.capabilities.permissions().len(), 1);
    assert!(p.allows_evidence("logs://gateway/q-1"));
    assert!(!p.allows_evidence("metrics://gateway/q-1"));
    assert!(p.supports_parallel_completion);

    let mut explicit = profile();
    explicit.max_iterations = 30;
    explicit.max_tokens = 1000;
    explicit.temperature = 1.5;
    let p = validate::worker_profile(&explicit, "profile").unwrap();
    assert_eq!((p.max_iterations, p.max_tokens), (30, 1000));
    assert!((p.temperature - 1.5).abs() < f64::EPSILON);
}

#[test]
fn every_invalid_profile_names_its_field_and_rule() {
    // One case per line reads as a table; keep rustfmt from unrolling it.
    #[rustfmt::skip]
    let cases: Vec<Case<v1::WorkerProfile>> = vec![
        ("no id", |p| p.id.clear(), "profile.id", Rule::Required),
        ("id with @", |p| p.id = "logs@1".into(), "profile.id", Rule::Format),
        ("tool without version", |p| p.default_tools[1] = "get_log_context".into(), "profile.default_tools[1]", Rule::Format),
        ("repeated tool", |p| p.default_tools.push("search_logs@1".into()), "profile.default_tools[2]", Rule::Duplicate),
        ("too many iterations", |p| p.max_iterations = 5000, "profile.max_iterations", Rule::Range),
        ("temperature above 2", |p| p.temperature = 2.5, "profile.temperature", Rule::Range),
        ("negative temperature", |p| p.temperature = -0.1, "profile.temperature", Rule::Range),
        ("NaN temperature", |p| p.temperature = f64::NAN, "profile.temperature", Rule::Range),
        ("bad capability", |p| p.capabilities[0].action = "logs:*:x*".into(), "profile.capabilities[0].action", Rule::Format),
        ("prefix without scheme", |p| p.evidence_prefixes[1] = "gateway/".into(), "profile.evidence_prefixes[1]", Rule::Format),
        ("prefix with bad scheme", |p| p.evidence_prefixes[0] = "1logs://x".into(), "profile.evidence_prefixes[0]", Rule::Format),
        ("no version", |p| p.version.clear(), "profile.version", Rule::Required),
    ];
    check_cases(&profile(), cases, |p| {
        validate::worker_profile(p, "profile")
    });
}

// ---------------------------------------------------------------------------------------
// Tasks and results.

fn task() -> v1::DelegationTask {
    v1::DelegationTask {
        delegation_id: "del-0a1b2c".into(),
        run_id: "run-1".into(),
        parent_delegation_id: String::new(),
        depth: 1,
        profile_id: "logs-investigator".into(),
        goal: "Find payment_confirm timeouts in the payment-api logs".into(),
        acceptance_criteria: strings(&["names the first failing minute"]),
        scope: Some(v1::TaskScope {
            resources: strings(&["service/payment-api"]),
            time_range: None,
        }),
        input_refs: Vec::new(),
        allowed_tools: strings(&["search_logs@1"]),
        allowed_evidence_prefixes: strings(&["logs://payment-api/", "logs://gateway/"]),
        required_scopes: vec![v1::PermissionScope {
            action: "logs:read".into(),
            resource: "service/payment-api".into(),
            data_scope: None,
        }],
        deadline: Some(ts(now() + Duration::from_secs(60))),
        budget: None,
        may_redelegate: false,
        name: "logs".into(),
        round: 0,
        call_index: 0,
    }
}

fn result() -> v1::TaskResult {
    v1::TaskResult {
        delegation_id: "del-0a1b2c".into(),
        worker_id: "worker-1".into(),
        profile_id: "logs-investigator".into(),
        profile_version: "1.2.0".into(),
        status: v1::TaskStatus::Completed as i32,
        summary: "Connection pool exhausted from 02:01".into(),
        claims: vec![
            v1::Claim {
                claim_id: "claim-log-1".into(),
                topic: "primary_cause".into(),
                value: "connection_pool_exhaustion".into(),
                statement: "The DB pool hit its limit at 02:01".into(),
                evidence_refs: strings(&["logs://payment-api/q-1", "logs://gateway/q-2"]),
                confidence: 0.8,
            },
            v1::Claim {
                claim_id: "claim-log-2".into(),
                topic: "first_failure".into(),
                value: "02:01".into(),
                statement: String::new(),
                evidence_refs: strings(&["logs://payment-api/q-3"]),
                confidence: 1.0,
            },
        ],
        artifacts: strings(&["artifact://acme/9c1f"]),
        ..v1::TaskResult::default()
    }
}

#[test]
fn every_invalid_result_names_its_field_and_rule() {
    // One case per line reads as a table; keep rustfmt from unrolling it.
    #[rustfmt::skip]
    let cases: Vec<Case<v1::TaskResult>> = vec![
        ("no delegation id", |r| r.delegation_id.clear(), "result.delegation_id", Rule::Required),
        ("other delegation", |r| r.delegation_id = "del-ffff".into(), "result.delegation_id", Rule::UnknownReference),
        ("other profile", |r| r.profile_id = "metrics-analyst".into(), "result.profile_id", Rule::NotAllowed),
        ("no status", |r| r.status = 0, "result.status", Rule::Required),
        ("unknown status", |r| r.status = 42, "result.status", Rule::UnknownEnum),
        ("claim without id", |r| r.claims[0].claim_id.clear(), "result.claims[0].claim_id", Rule::Required),
        ("repeated claim id", |r| r.claims[1].claim_id = "claim-log-1".into(), "result.claims[1].claim_id", Rule::Duplicate),
        ("claim without topic", |r| r.claims[1].topic.clear(), "result.claims[1].topic", Rule::Required),
        ("claim without value", |r| r.claims[0].value = " ".into(), "result.claims[0].value", Rule::Required),
        ("claim without evidence", |r| r.claims[0].evidence_refs.clear(), "result.claims[0].evidence_refs", Rule::Required),
        ("blank evidence ref", |r| r.claims[1].evidence_refs[0].clear(), "result.claims[1].evidence_refs[0]", Rule::Required),
        ("evidence outside prefixes", |r| r.claims[0].evidence_refs[1] = "metrics://gateway/p95".into(), "result.claims[0].evidence_refs[1]", Rule::NotAllowed),
        ("confidence above 1", |r| r.claims[1].confidence = 1.01, "result.claims[1].confidence", Rule::Range),
        ("negative confidence", |r| r.claims[0].confidence = -0.2, "result.claims[0].confidence", Rule::Range),
        ("artifact not a URI", |r| r.artifacts[0] = "/tmp/out.json".into(), "result.artifacts[0]", Rule::Format),
    ];
    check_cases(&result(), cases, |r| {
        validate::task_result(r, &task(), "result")
    });
}

#[test]
fn evidence_outside_the_prefixes_names_the_ref_and_the_prefixes() {
    let mut r = result();
    r.claims[0].evidence_refs[1] = "metrics://gateway/p95".into();
    let e = assert_invalid(
        validate::task_result(&r, &task(), "result"),
        "result.claims[0].evidence_refs[1]",
        Rule::NotAllowed,
    );
    assert!(e.message.contains("`metrics://gateway/p95`"), "{e}");
    assert!(
        e.message.contains("logs://payment-api/, logs://gateway/"),
        "{e}"
    );
}

#[test]
fn a_task_without_prefixes_accepts_no_evidence() {
    let mut t = task();
    t.allowed_evidence_prefixes.clear();
    assert_invalid(
        validate::task_result(&result(), &t, "result"),
        "result.claims[0].evidence_refs[0]",
        Rule::NotAllowed,
    );
}

#[test]
fn every_invalid_task_names_its_field_and_rule() {
    // One case per line reads as a table; keep rustfmt from unrolling it.
    #[rustfmt::skip]
    let cases: Vec<Case<v1::DelegationTask>> = vec![
        ("no delegation id", |t| t.delegation_id.clear(), "task.delegation_id", Rule::Required),
        ("no run id", |t| t.run_id.clear(), "task.run_id", Rule::Required),
        ("depth 0", |t| t.depth = 0, "task.depth", Rule::Range),
        ("nested without parent", |t| t.depth = 2, "task.parent_delegation_id", Rule::Required),
        ("no profile", |t| t.profile_id.clear(), "task.profile_id", Rule::Required),
        ("no goal", |t| t.goal.clear(), "task.goal", Rule::Required),
        ("bad resource", |t| t.scope.as_mut().unwrap().resources[0] = "*x".into(), "task.scope.resources[0]", Rule::Format),
        ("bad input", |t| t.input_refs = strings(&["artifact://"]), "task.input_refs[0]", Rule::Format),
        ("bad tool", |t| t.allowed_tools[0] = "@1".into(), "task.allowed_tools[0]", Rule::Format),
        ("bad prefix", |t| t.allowed_evidence_prefixes[1] = "logs:/gateway".into(), "task.allowed_evidence_prefixes[1]", Rule::Format),
        ("bad scope", |t| t.required_scopes[0].resource = " ".into(), "task.required_scopes[0].resource", Rule::Format),
        ("no deadline", |t| t.deadline = None, "task.deadline", Rule::Required),
        ("NaN budget", |t| t.budget = Some(v1::Budget { max_cost: f64::NAN, ..v1::Budget::default() }), "task.budget.max_cost", Rule::Range),
    ];
    let mut nested = task();
    nested.depth = 2;
    nested.parent_delegation_id = "del-parent".into();
    validate::delegation_task(&nested, "task").expect("a nested task with its parent is valid");
    check_cases(&task(), cases, |t| validate::delegation_task(t, "task"));
}

#[test]
fn a_scope_of_more_selectors_than_the_cap_is_refused_by_name() {
    let max = validate::MAX_SCOPE_ENTRIES;
    let mut spec = incident_spec();
    spec.delegations[1].scope.as_mut().unwrap().resources =
        (0..=max).map(|i| format!("service/s{i}")).collect();
    let e = assert_invalid(
        validate::run_spec(&spec, now()),
        "spec.delegations[1].scope.resources",
        Rule::TooLong,
    );
    assert!(e.message.contains(&format!("at most {max}")), "{e}");

    let mut spec = incident_spec();
    let scope = spec.delegations[0].required_scopes[0].clone();
    spec.delegations[0].required_scopes = vec![scope; max + 1];
    assert_invalid(
        validate::run_spec(&spec, now()),
        "spec.delegations[0].required_scopes",
        Rule::TooLong,
    );

    // At the cap, both validate.
    let mut spec = incident_spec();
    spec.delegations[1].scope.as_mut().unwrap().resources =
        (0..max).map(|i| format!("service/s{i}")).collect();
    validate::run_spec(&spec, now()).expect("a scope at the cap");
}
