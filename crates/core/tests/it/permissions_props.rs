//! Property tests of the permission intersection: the effective set never exceeds any of
//! its inputs, and a child computed from its parent only ever narrows it.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use convene_core::permissions::{
    DataConstraints, Pattern, Permission, PermissionSet, Terms, TimeWindow, effective,
};
use proptest::prelude::*;

/// Patterns from a small alphabet so that overlaps, prefixes and misses all occur.
fn pattern() -> impl Strategy<Value = Pattern> {
    prop_oneof![
        Just(Pattern::any()),
        prop::sample::select(vec![
            "logs:",
            "logs:read",
            "metrics:",
            "metrics:read",
            "service/",
            "service/pay",
            "service/payment-api",
            "metric/risk."
        ])
        .prop_flat_map(|s| prop_oneof![
            Just(Pattern::Exact(s.to_owned())),
            Just(Pattern::Prefix(s.to_owned()))
        ]),
    ]
}

fn at(secs: u64) -> SystemTime {
    UNIX_EPOCH + Duration::from_secs(secs)
}

fn window() -> impl Strategy<Value = TimeWindow> {
    (prop::option::of(0u64..10), prop::option::of(5u64..20)).prop_filter_map(
        "non-empty",
        |(s, e)| {
            let w = TimeWindow {
                start: s.map(at),
                end: e.map(at),
            };
            (!w.is_empty()).then_some(w)
        },
    )
}

fn permission() -> impl Strategy<Value = Permission> {
    (pattern(), pattern(), window(), prop::option::of(1u64..100)).prop_map(
        |(action, resource, time, max_rows)| Permission {
            action,
            resource,
            data: DataConstraints { time, max_rows },
        },
    )
}

fn set() -> impl Strategy<Value = PermissionSet> {
    prop::collection::vec(permission(), 0..5).prop_map(PermissionSet::from_permissions)
}

/// Concrete accesses to probe sets with.
fn access() -> impl Strategy<Value = (String, String, DataConstraints)> {
    (
        prop::sample::select(vec![
            "logs:read",
            "logs:write",
            "metrics:read",
            "changes:read",
        ]),
        prop::sample::select(vec![
            "service/payment-api",
            "service/risk-gateway",
            "metric/risk.hit",
            "evidence",
        ]),
        (0u64..10, 10u64..20, prop::option::of(1u64..150)),
    )
        .prop_map(|(a, r, (s, e, rows))| {
            (
                a.to_owned(),
                r.to_owned(),
                DataConstraints {
                    time: TimeWindow {
                        start: Some(at(s)),
                        end: Some(at(e)),
                    },
                    max_rows: rows,
                },
            )
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn the_effective_set_is_a_subset_of_every_input(
        grants in set(), delegable in set(), capabilities in set(), task in set(), runtime in set(),
        probes in prop::collection::vec(access(), 1..8),
    ) {
        let eff = effective(Terms { grants: &grants, delegable: &delegable, capabilities: &capabilities, task: &task, runtime: &runtime });
        for input in [&grants, &delegable, &capabilities, &task, &runtime] {
            prop_assert!(eff.is_subset_of(input), "{eff:?} ⊄ {input:?}");
        }
        // Semantically too: whatever the effective set allows, every input allows.
        for (a, r, d) in &probes {
            if eff.check(a, r, d).is_ok() {
                for input in [&grants, &delegable, &capabilities, &task, &runtime] {
                    prop_assert!(input.check(a, r, d).is_ok(), "{a} {r} allowed by {eff:?} but not by {input:?}");
                }
            }
        }
    }

    #[test]
    fn a_child_is_always_a_subset_of_its_parent(
        parent_terms in prop::collection::vec(set(), 5),
        child_asks in set(), child_caps in set(),
        probes in prop::collection::vec(access(), 1..8),
    ) {
        let parent = effective(Terms {
            grants: &parent_terms[0], delegable: &parent_terms[1], capabilities: &parent_terms[2],
            task: &parent_terms[3], runtime: &parent_terms[4],
        });
        // A child's delegable term is its parent's effective set.
        let child = effective(Terms {
            grants: &parent_terms[0], delegable: &parent, capabilities: &child_caps,
            task: &child_asks, runtime: &PermissionSet::everything(),
        });
        prop_assert!(child.is_subset_of(&parent));
        for (a, r, d) in &probes {
            if child.check(a, r, d).is_ok() {
                prop_assert!(parent.check(a, r, d).is_ok());
            }
        }
        // And a grandchild narrows the child in turn.
        let grandchild = effective(Terms {
            grants: &parent_terms[0], delegable: &child, capabilities: &child_caps,
            task: &child_asks, runtime: &PermissionSet::everything(),
        });
        prop_assert!(grandchild.is_subset_of(&child));
    }

    #[test]
    fn intersection_is_commutative_and_idempotent(a in set(), b in set()) {
        prop_assert_eq!(a.intersect(&b), b.intersect(&a));
        prop_assert_eq!(a.intersect(&a), a.clone());
        prop_assert!(a.intersect(&b).is_subset_of(&a));
    }
}
