//! The workloads: what each run does, and the files and spec a workload's runs start
//! from, built from the payment-incident example.

use std::path::{Path, PathBuf};

use anyhow::Context as _;
use convene_proto::v1;
use serde::Serialize;

use crate::spec;

/// What each run does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Workload {
    /// Three parallel delegations, one authorized tool call and one stored, cited piece
    /// of evidence each, then the join.
    Noop,
    /// The payment-incident example over its dataset.
    PaymentIncident,
}

/// Files a workload needs: policy, profiles, tool data, and the spec.
pub struct Prepared {
    /// Policy file.
    pub policy: PathBuf,
    /// Profiles file.
    pub profiles: PathBuf,
    /// Tool data directory.
    pub data: PathBuf,
    /// The spec each run submits (without an idempotency key).
    pub spec: v1::RunSpec,
    /// The outcome every run must reach to count.
    pub expected: v1::RunState,
}

const NOOP_CHANGES: &str = r#"{"changes":[{"change_id":"CHG-1","ts":"2026-07-23T02:00:00.000Z","kind":"config","resource":"change/noop","service":"noop","summary":"nothing","owner":"bench","ticket":"B-1"}]}"#;

pub(super) const NOOP_PROFILE: &str = r#"
  - id: noop
    version: "1.0.0"
    name: No-op
    description: One authorized read of a one-record data set, stored and cited.
    instructions: Read the change log once and report it.
    provider: playbook
    default_tools: [list_changes@1]
    max_iterations: 2
    capabilities:
      - { action: "changes:read", resource: "change/*" }
      - { action: "evidence:*", resource: "evidence" }
    evidence_prefixes: ["changes://"]
    supports_parallel_completion: true
    playbook:
      summary: one read
      steps:
        - { id: read, tool: list_changes@1, evidence_kind: observation, args: {} }
      rules:
        - step: read
          when: { path: count, op: gt, value: 0 }
          claim:
            claim_id: claim-noop
            topic: noop
            value: ok
            statement: "{count} change(s) read"
            confidence: 1.0
"#;

pub(super) const NOOP_POLICY_PROFILE: &str = r#"
  - id: noop
    investigating: true
    tools: [list_changes@1]
    evidence_prefixes: ["changes://"]
    capabilities:
      - { action: "changes:read", resource: "change/*" }
      - { action: "evidence:*", resource: "evidence" }
"#;

pub(super) const NOOP_SPEC: &str = r#"
goal: No-op benchmark run
delegations:
  - { name: n1, profile_id: noop, goal: read, scope: { resources: ["change/*"], time_range: { start: "2026-07-23T01:00:00Z", end: "2026-07-23T03:00:00Z" } }, required_scopes: [{ action: "changes:read", resource: "change/*" }] }
  - { name: n2, profile_id: noop, goal: read, scope: { resources: ["change/*"], time_range: { start: "2026-07-23T01:00:00Z", end: "2026-07-23T03:00:00Z" } }, required_scopes: [{ action: "changes:read", resource: "change/*" }] }
  - { name: n3, profile_id: noop, goal: read, scope: { resources: ["change/*"], time_range: { start: "2026-07-23T01:00:00Z", end: "2026-07-23T03:00:00Z" } }, required_scopes: [{ action: "changes:read", resource: "change/*" }] }
join: { strategy: JOIN_STRATEGY_ALL, minimum: { count: 3 } }
limits: { timeout: 60s }
"#;

/// Writes what `workload` needs into `dir`, from the payment-incident example in
/// `example`.
pub fn prepare(workload: Workload, dir: &Path, example: &Path) -> anyhow::Result<Prepared> {
    let example = std::path::absolute(example)
        .with_context(|| format!("cannot resolve {}", example.display()))?;
    anyhow::ensure!(
        example.join("policy.yaml").is_file(),
        "no payment-incident example at {} (its policy.yaml, profiles.yaml, run.yaml and \
         data/, which the bench builds its workloads from): run convene bench from the \
         root of the convene repository, or pass --example <path to its \
         examples/payment-incident>",
        example.display()
    );
    std::fs::create_dir_all(dir)?;
    let read = |p: &Path| {
        std::fs::read_to_string(p).with_context(|| format!("cannot read {}", p.display()))
    };
    let mut policy = read(&example.join("policy.yaml"))?;
    let mut profiles = read(&example.join("profiles.yaml"))?;
    let (data, spec_text, expected) = match workload {
        Workload::PaymentIncident => (
            example.join("data"),
            read(&example.join("run.yaml"))?,
            v1::RunState::WaitingApproval,
        ),
        Workload::Noop => {
            let data = dir.join("noop-data");
            std::fs::create_dir_all(data.join("changes"))?;
            std::fs::write(data.join("changes/changes.json"), NOOP_CHANGES)?;
            policy = policy.replacen("profiles:\n", &format!("profiles:{NOOP_POLICY_PROFILE}"), 1);
            profiles = profiles.replacen("profiles:\n", &format!("profiles:{NOOP_PROFILE}"), 1);
            (data, NOOP_SPEC.to_owned(), v1::RunState::Succeeded)
        }
    };
    let policy_path = dir.join("bench-policy.yaml");
    let profiles_path = dir.join("bench-profiles.yaml");
    std::fs::write(&policy_path, policy)?;
    std::fs::write(&profiles_path, profiles)?;
    let mut spec = spec::parse(&spec_text, Path::new("bench.yaml"))?;
    spec.idempotency_key.clear();
    Ok(Prepared {
        policy: policy_path,
        profiles: profiles_path,
        data,
        spec,
        expected,
    })
}
