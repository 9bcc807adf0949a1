//! Limits: depth, width under each overflow policy, budget and rounds, and the
//! no-progress detector.

use std::time::{Duration, UNIX_EPOCH};

use convene_core::limits::{
    BatchPlan, BudgetLedger, LimitError, Progress, ProgressDetector, check_depth, plan_batch,
    progress_hash,
};
use convene_core::model::{self, Overflow};
use convene_proto::v1;
use proptest::prelude::*;

fn limits() -> model::Limits {
    model::Limits::defaults(UNIX_EPOCH + Duration::from_secs(1_767_000_000))
}

fn usage(tool_calls: u32, tokens: u64, cost: f64) -> v1::Usage {
    v1::Usage {
        tool_calls,
        tokens,
        cost,
        ..v1::Usage::default()
    }
}

// ---------------------------------------------------------------------------------------
// Depth.

#[test]
fn depth_up_to_the_maximum_is_allowed() {
    assert_eq!(check_depth(1, 3), Ok(()));
    assert_eq!(check_depth(3, 3), Ok(()));
}

#[test]
fn depth_past_the_maximum_tells_the_agent_to_do_it_itself() {
    let e = check_depth(4, 3).unwrap_err();
    assert_eq!(e, LimitError::DepthExceeded { depth: 4, max: 3 });
    assert_eq!(
        e.to_string(),
        "delegation depth 4 exceeds max_depth 3: handle this task yourself instead of delegating"
    );
}

// ---------------------------------------------------------------------------------------
// Width.

#[test]
fn queue_runs_everything_in_waves() {
    let plan = plan_batch(7, 3, Overflow::Queue).unwrap();
    assert_eq!(
        plan,
        BatchPlan {
            waves: vec![vec![0, 1, 2], vec![3, 4, 5], vec![6]],
            dropped: vec![],
        }
    );
}

#[test]
fn truncate_keeps_the_first_and_records_the_dropped() {
    let plan = plan_batch(6, 4, Overflow::Truncate).unwrap();
    assert_eq!(plan.waves, vec![vec![0, 1, 2, 3]]);
    assert_eq!(plan.dropped, vec![4, 5]);
}

#[test]
fn reject_refuses_a_wide_batch_and_names_count_and_limit() {
    let e = plan_batch(5, 4, Overflow::Reject).unwrap_err();
    assert_eq!(e, LimitError::WidthRejected { count: 5, max: 4 });
    let message = e.to_string();
    assert!(message.contains("5 delegations"), "{message}");
    assert!(message.contains("max_parallel_workers 4"), "{message}");
}

#[test]
fn a_batch_that_fits_is_one_wave_under_every_policy() {
    for overflow in [Overflow::Queue, Overflow::Truncate, Overflow::Reject] {
        let plan = plan_batch(4, 4, overflow).unwrap();
        assert_eq!(plan.waves, vec![vec![0, 1, 2, 3]], "{overflow:?}");
        assert!(plan.dropped.is_empty(), "{overflow:?}");
    }
}

#[test]
fn an_empty_batch_is_an_empty_plan() {
    for overflow in [Overflow::Queue, Overflow::Truncate, Overflow::Reject] {
        assert_eq!(plan_batch(0, 4, overflow), Ok(BatchPlan::default()));
    }
}

#[test]
fn zero_width_is_refused_rather_than_looping() {
    assert_eq!(
        plan_batch(3, 0, Overflow::Queue),
        Err(LimitError::Zero {
            which: "max_parallel_workers"
        })
    );
}

proptest! {
    #[test]
    fn queue_waves_partition_the_batch_in_order(count in 0usize..200, max in 1u32..20) {
        let plan = plan_batch(count, max, Overflow::Queue).unwrap();
        prop_assert!(plan.dropped.is_empty());
        for wave in &plan.waves {
            prop_assert!(!wave.is_empty());
            prop_assert!(wave.len() <= max as usize);
        }
        let flat: Vec<usize> = plan.waves.concat();
        prop_assert_eq!(flat, (0..count).collect::<Vec<_>>());
    }

    #[test]
    fn truncate_keeps_and_drops_exactly_the_batch(count in 0usize..200, max in 1u32..20) {
        let plan = plan_batch(count, max, Overflow::Truncate).unwrap();
        prop_assert!(plan.waves.len() <= 1);
        let kept: Vec<usize> = plan.waves.concat();
        prop_assert_eq!(kept.len(), count.min(max as usize));
        let all: Vec<usize> = kept.into_iter().chain(plan.dropped).collect();
        prop_assert_eq!(all, (0..count).collect::<Vec<_>>());
    }
}

// ---------------------------------------------------------------------------------------
// Budget and rounds.

#[test]
fn tool_calls_run_out() {
    let mut l = limits();
    l.max_tool_calls = Some(10);
    let mut ledger = BudgetLedger::new(&l);
    assert_eq!(ledger.charge(&usage(6, 1_000_000, 99.0)), Ok(()));
    let e = ledger.charge(&usage(4, 0, 0.0)).unwrap_err();
    assert_eq!(
        e,
        LimitError::Budget {
            which: "max_tool_calls",
            limit: "10".into(),
            used: "10".into(),
        }
    );
    assert!(e.to_string().contains("raise max_tool_calls"), "{e}");
}

#[test]
fn tokens_run_out() {
    let mut l = limits();
    l.max_tokens = Some(5000);
    let mut ledger = BudgetLedger::new(&l);
    assert_eq!(ledger.charge(&usage(100, 4999, 0.0)), Ok(()));
    assert_eq!(
        ledger.charge(&usage(0, 2, 0.0)),
        Err(LimitError::Budget {
            which: "max_tokens",
            limit: "5000".into(),
            used: "5001".into(),
        })
    );
}

#[test]
fn cost_runs_out_and_cannot_be_refunded() {
    let mut l = limits();
    l.max_cost = Some(1.5);
    let mut ledger = BudgetLedger::new(&l);
    assert_eq!(ledger.charge(&usage(0, 0, 1.0)), Ok(()));
    // A negative or NaN report does not give budget back.
    assert_eq!(ledger.charge(&usage(0, 0, -5.0)), Ok(()));
    assert_eq!(ledger.charge(&usage(0, 0, f64::NAN)), Ok(()));
    assert!((ledger.spent().cost - 1.0).abs() < f64::EPSILON);
    let e = ledger.charge(&usage(0, 0, 0.75)).unwrap_err();
    assert!(
        matches!(&e, LimitError::Budget { which: "max_cost", limit, used } if limit == "1.5" && used == "1.75"),
        "{e:?}"
    );
}

#[test]
fn the_first_exhausted_budget_is_reported_in_a_fixed_order() {
    let mut l = limits();
    l.max_tool_calls = Some(1);
    l.max_tokens = Some(1);
    let mut ledger = BudgetLedger::new(&l);
    let e = ledger.charge(&usage(5, 5, 0.0)).unwrap_err();
    assert!(
        matches!(
            e,
            LimitError::Budget {
                which: "max_tool_calls",
                ..
            }
        ),
        "{e:?}"
    );
    // It stays exhausted: check() reports it without another charge.
    assert!(ledger.check().is_err());
}

#[test]
fn unlimited_budgets_never_run_out() {
    let mut ledger = BudgetLedger::new(&limits());
    assert_eq!(ledger.charge(&usage(u32::MAX, u64::MAX, 1e12)), Ok(()));
    assert_eq!(ledger.remaining(), model::Budget::default());
}

#[test]
fn a_delegation_never_gets_more_than_remains() {
    let mut l = limits();
    l.max_tool_calls = Some(10);
    l.max_cost = Some(2.0);
    let mut ledger = BudgetLedger::new(&l);
    ledger.charge(&usage(7, 300, 0.5)).unwrap();
    assert_eq!(
        ledger.remaining(),
        model::Budget {
            max_tool_calls: Some(3),
            max_tokens: None,
            max_cost: Some(1.5),
        }
    );

    let asked = model::Budget {
        max_tool_calls: Some(20),
        max_tokens: Some(4000),
        max_cost: Some(0.25),
    };
    assert_eq!(
        ledger.budget_for(&asked),
        model::Budget {
            max_tool_calls: Some(3),
            max_tokens: Some(4000),
            max_cost: Some(0.25),
        }
    );
    // An unlimited ask gets the remainder.
    assert_eq!(
        ledger.budget_for(&model::Budget::default()),
        ledger.remaining()
    );
}

#[test]
fn a_dispatched_task_gets_the_smaller_of_its_budget_and_what_the_run_has_left() {
    let mut l = limits();
    l.max_tokens = Some(1000);
    let mut ledger = BudgetLedger::new(&l);
    ledger.charge(&usage(0, 600, 0.0)).unwrap();
    let asked = v1::Budget {
        max_tool_calls: 5,
        max_tokens: 800,
        max_cost: 0.0,
    };
    // 400 tokens are left of the run's 1000: the task's 800 shrink to them; its tool
    // calls stay its own, and an unlimited cost stays unlimited (0 on the wire).
    assert_eq!(
        ledger.dispatch_budget(Some(&asked)),
        Some(v1::Budget {
            max_tool_calls: 5,
            max_tokens: 400,
            max_cost: 0.0,
        })
    );
    let small = v1::Budget {
        max_tokens: 100,
        ..v1::Budget::default()
    };
    assert_eq!(ledger.dispatch_budget(Some(&small)), Some(small));
    // A task without a budget gets what the run has left.
    assert_eq!(
        ledger.dispatch_budget(None).map(|b| b.max_tokens),
        Some(400)
    );
    // With no limit anywhere, nothing is set.
    assert_eq!(BudgetLedger::new(&limits()).dispatch_budget(None), None);
}

#[test]
fn rounds_stop_at_max_rounds() {
    let mut l = limits();
    l.max_rounds = 2;
    let mut ledger = BudgetLedger::new(&l);
    assert_eq!(ledger.start_round(), Ok(0));
    assert_eq!(ledger.start_round(), Ok(1));
    let e = ledger.start_round().unwrap_err();
    assert_eq!(e, LimitError::Rounds { max: 2 });
    assert!(e.to_string().contains("max_rounds 2"), "{e}");
    assert_eq!(ledger.rounds_started(), 2);
}

#[test]
fn a_static_plan_has_exactly_one_round_by_default() {
    let mut ledger = BudgetLedger::new(&limits());
    assert_eq!(ledger.start_round(), Ok(0));
    assert!(ledger.start_round().is_err());
}

// ---------------------------------------------------------------------------------------
// Progress.

#[test]
fn progress_hash_ignores_order_and_repetition() {
    let a = progress_hash(["d1", "d2"], ["sha256:aa", "sha256:bb"], ["c1", "c2", "c3"]);
    let b = progress_hash(
        ["d2", "d1", "d2"],
        ["sha256:bb", "sha256:aa"],
        ["c3", "c1", "c2"],
    );
    assert_eq!(a, b);
    assert_ne!(
        a,
        progress_hash(["d1", "d2"], ["sha256:aa"], ["c1", "c2", "c3"])
    );
}

#[test]
fn progress_hash_separates_sets_and_elements() {
    let none: [&str; 0] = [];
    assert_ne!(
        progress_hash(["a"], [""], none),
        progress_hash([""], ["a"], none)
    );
    assert_ne!(
        progress_hash(["a"], none, none),
        progress_hash(none, ["a"], none)
    );
    assert_ne!(
        progress_hash(none, ["a"], none),
        progress_hash(none, none, ["a"])
    );
    assert_ne!(
        progress_hash(["ab"], none, none),
        progress_hash(["a", "b"], none, none)
    );
    assert_ne!(
        progress_hash(none, none, none),
        progress_hash([""], none, none)
    );
}

#[test]
fn no_progress_after_exactly_threshold_unchanged_rounds() {
    let h = progress_hash(["d1"], ["sha256:aa"], ["c1"]);
    let mut detector = ProgressDetector::new(2);
    assert_eq!(detector.observe(h), Progress::Progressed);
    assert_eq!(
        detector.observe(h),
        Progress::Stalled {
            unchanged_rounds: 1
        }
    );
    assert_eq!(detector.observe(h), Progress::NoProgress);
    assert_eq!(detector.observe(h), Progress::NoProgress);
}

#[test]
fn a_changed_hash_resets_the_count() {
    let h1 = progress_hash(["d1"], ["sha256:aa"], ["c1"]);
    let h2 = progress_hash(["d1", "d2"], ["sha256:aa"], ["c1"]);
    let mut detector = ProgressDetector::new(3);
    assert_eq!(detector.observe(h1), Progress::Progressed);
    assert_eq!(
        detector.observe(h1),
        Progress::Stalled {
            unchanged_rounds: 1
        }
    );
    assert_eq!(
        detector.observe(h1),
        Progress::Stalled {
            unchanged_rounds: 2
        }
    );
    assert_eq!(detector.observe(h2), Progress::Progressed);
    assert_eq!(
        detector.observe(h2),
        Progress::Stalled {
            unchanged_rounds: 1
        }
    );
    assert_eq!(
        detector.observe(h2),
        Progress::Stalled {
            unchanged_rounds: 2
        }
    );
    assert_eq!(detector.observe(h2), Progress::NoProgress);
}

#[test]
fn the_detector_follows_the_run_limits() {
    let mut l = limits();
    l.no_progress_rounds = 1;
    let mut detector = ProgressDetector::from_limits(&l);
    assert_eq!(detector.threshold(), 1);
    let h = [7u8; 32];
    assert_eq!(detector.observe(h), Progress::Progressed);
    assert_eq!(detector.observe(h), Progress::NoProgress);
    assert_eq!(ProgressDetector::new(0).threshold(), 1);
}

#[test]
fn a_chain_that_returns_to_a_profile_with_the_same_goal_is_a_loop() {
    use convene_core::limits::check_loop;
    let path = [
        ("coordinator", "Assess the incident"),
        ("logs-investigator", "Read the logs"),
    ];
    // A → B → A with the same goal, however it is written.
    let err = check_loop(&path, "coordinator", "  assess THE   incident ").unwrap_err();
    assert!(matches!(err, LimitError::Loop { .. }), "{err:?}");
    let text = err.to_string();
    assert!(text.contains("coordinator → logs-investigator"), "{text}");
    assert!(text.contains("handle this task yourself"), "{text}");
    // The same profile with another goal, or another profile with the same goal, is not.
    check_loop(&path, "coordinator", "Summarize the logs").unwrap();
    check_loop(&path, "metrics-investigator", "Read the logs").unwrap();
    check_loop(&[], "coordinator", "Assess the incident").unwrap();
}
