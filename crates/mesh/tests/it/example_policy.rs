//! The policy file shipped with the payment-incident example loads and says what the
//! example relies on.

use std::path::PathBuf;

use convene_core::permissions::RiskLevel;
use convene_mesh::policy_file::{Policy, PrincipalKind};

fn example() -> Policy {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../examples/payment-incident/policy.yaml");
    Policy::load(path).expect("the example policy loads")
}

#[test]
fn example_policy_compiles_with_investigators_read_only() {
    let policy = example();
    for id in [
        "logs-investigator",
        "metrics-investigator",
        "change-auditor",
    ] {
        let profile = &policy.profiles[id];
        assert!(profile.investigating, "{id} investigates");
        for tool in &profile.tools {
            assert_eq!(
                policy.tools[tool].risk,
                RiskLevel::R0,
                "{id} holds only R0 tools"
            );
        }
        let rollback = &policy.tools["rollback_rule@1"];
        assert!(
            policy.denying_rule(profile, rollback).is_some(),
            "{id} can never hold an R3 tool"
        );
    }
    assert_eq!(policy.risk_of("rule:rollback"), Some(RiskLevel::R3));
}

#[test]
fn example_has_two_human_approvers_besides_the_requester() {
    let policy = example();
    let approvers: Vec<_> = policy
        .principals
        .values()
        .filter(|p| p.kind == PrincipalKind::Human && p.has_role("approvals:decide"))
        .map(|p| p.id.as_str())
        .collect();
    assert!(approvers.len() >= 2, "{approvers:?}");
    assert!(!approvers.contains(&"oncall@acme"));
    assert!(policy.principals["supervisor"].has_role("tokens:issue"));
}
