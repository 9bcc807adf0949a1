//! The workloads: what each run does, and the files and spec a workload's runs start
//! from, built from the payment-incident example.
//!
//! The `model` workload points the example's `openai` profiles at the bench's scripted
//! model server (`base_url`), and keeps two specs: `run-model.yaml`, whose specialists
//! are those model-driven profiles, and `run.yaml`, the same incident with the playbook
//! specialists, which its baseline phase runs.

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
    /// The payment incident with model-driven specialists, against a scripted
    /// OpenAI-compatible server in this process with zero latency; reports the agent
    /// runtime's own CPU per model turn (goal: at most 1 ms).
    Model,
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
    /// The `model` workload's baseline: the same incident with the playbook
    /// specialists (`run.yaml`, without an idempotency key); None for the others.
    pub baseline: Option<v1::RunSpec>,
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

/// Three delegations read the same data, so their artifacts are the same: for the join
/// they are one finding (`minimum.count` counts results on the same artifacts once),
/// and a minimum of 1 is what they can meet; the join still waits for all three.
pub(super) const NOOP_SPEC: &str = r#"
goal: No-op benchmark run
delegations:
  - { name: n1, profile_id: noop, goal: read, scope: { resources: ["change/*"], time_range: { start: "2026-07-23T01:00:00Z", end: "2026-07-23T03:00:00Z" } }, required_scopes: [{ action: "changes:read", resource: "change/*" }] }
  - { name: n2, profile_id: noop, goal: read, scope: { resources: ["change/*"], time_range: { start: "2026-07-23T01:00:00Z", end: "2026-07-23T03:00:00Z" } }, required_scopes: [{ action: "changes:read", resource: "change/*" }] }
  - { name: n3, profile_id: noop, goal: read, scope: { resources: ["change/*"], time_range: { start: "2026-07-23T01:00:00Z", end: "2026-07-23T03:00:00Z" } }, required_scopes: [{ action: "changes:read", resource: "change/*" }] }
join: { strategy: JOIN_STRATEGY_ALL, minimum: { count: 1 } }
limits: { timeout: 60s }
"#;

/// The variable the `model` workload's profiles take their API key from
/// (`api_key_env`): one nobody sets, so the scripted server is never sent a real key.
pub(super) const MODEL_KEY_ENV: &str = "BENCH_SCRIPTED_MODEL_API_KEY";

/// The payment-incident example at `example`, as an absolute path, or an error saying
/// how to point the bench at it.
fn example_dir(example: &Path) -> anyhow::Result<PathBuf> {
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
    Ok(example)
}

fn read(path: &Path) -> anyhow::Result<String> {
    std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))
}

/// The profiles of the payment-incident example in `example`, parsed and validated as a
/// worker would: what the `model` workload's scripted server plays.
pub(super) fn example_profiles(
    example: &Path,
) -> anyhow::Result<Vec<convene_worker::profiles::Profile>> {
    let path = example_dir(example)?.join("profiles.yaml");
    Ok(convene_worker::profiles::load(&path)?)
}

/// `profiles` (a profiles file's YAML) with every `openai` profile pointed at
/// `base_url`, its key read from [`MODEL_KEY_ENV`].
fn point_at(profiles: &str, base_url: &str) -> anyhow::Result<String> {
    use serde_yaml::Value;
    let mut file: Value =
        serde_yaml::from_str(profiles).context("the example's profiles.yaml is not YAML")?;
    let list = file
        .get_mut("profiles")
        .and_then(Value::as_sequence_mut)
        .context("the example's profiles.yaml has no `profiles:` list")?;
    let mut pointed = 0;
    for profile in list.iter_mut().filter_map(Value::as_mapping_mut) {
        if profile.get("provider").and_then(Value::as_str) != Some("openai") {
            continue;
        }
        profile.insert("base_url".into(), base_url.into());
        profile.remove("api_key_file");
        profile.insert("api_key_env".into(), MODEL_KEY_ENV.into());
        pointed += 1;
    }
    anyhow::ensure!(
        pointed > 0,
        "the example's profiles.yaml has no profile with `provider: openai`, which the \
         model workload's run-model.yaml needs: use the convene repository's \
         examples/payment-incident"
    );
    Ok(serde_yaml::to_string(&file)?)
}

/// `policy` (a policy file's text) with the profile `entry` (one item of a policy
/// file's `profiles:` list, as YAML) added, and among those every principal holding
/// `workers:register` may register, so the bench's workers may serve it.
pub(super) fn with_profile(policy: &str, entry: &str) -> anyhow::Result<String> {
    use convene_mesh::policy_file::{ANY_PROFILE, PolicyFile, ProfileEntry};
    let mut file = PolicyFile::parse(policy, Some("yaml"), "the bench's policy")?;
    let added: Vec<ProfileEntry> =
        serde_yaml::from_str(entry).context("the bench's policy profile is not YAML")?;
    for profile in added {
        for principal in &mut file.principals {
            let registers = principal.roles.iter().any(|r| r == "workers:register");
            let allowed = principal
                .profiles
                .iter()
                .any(|p| p == ANY_PROFILE || *p == profile.id);
            if registers && !allowed {
                principal.profiles.push(profile.id.clone());
            }
        }
        file.profiles.push(profile);
    }
    Ok(serde_yaml::to_string(&file)?)
}

/// Writes what `workload` needs into `dir`, from the payment-incident example in
/// `example`. The `model` workload's `openai` profiles are pointed at `model_base_url`
/// (the bench's scripted model server), which it needs.
pub fn prepare(
    workload: Workload,
    dir: &Path,
    example: &Path,
    model_base_url: Option<&str>,
) -> anyhow::Result<Prepared> {
    let example = example_dir(example)?;
    std::fs::create_dir_all(dir)?;
    let mut policy = read(&example.join("policy.yaml"))?;
    let mut profiles = read(&example.join("profiles.yaml"))?;
    let mut baseline = None;
    let (data, spec_text, expected) = match workload {
        Workload::PaymentIncident => (
            example.join("data"),
            read(&example.join("run.yaml"))?,
            v1::RunState::WaitingInput,
        ),
        Workload::Model => {
            let base_url = model_base_url
                .context("the model workload needs its scripted model server's base URL")?;
            profiles = point_at(&profiles, base_url)?;
            let mut spec = spec::parse(&read(&example.join("run.yaml"))?, Path::new("run.yaml"))?;
            spec.idempotency_key.clear();
            baseline = Some(spec);
            (
                example.join("data"),
                read(&example.join("run-model.yaml"))?,
                v1::RunState::WaitingInput,
            )
        }
        Workload::Noop => {
            let data = dir.join("noop-data");
            std::fs::create_dir_all(data.join("changes"))?;
            std::fs::write(data.join("changes/changes.json"), NOOP_CHANGES)?;
            policy = with_profile(&policy, NOOP_POLICY_PROFILE)?;
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
        baseline,
        expected,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn example() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/payment-incident")
    }

    #[test]
    fn the_model_workload_points_the_openai_profiles_at_the_scripted_server() {
        let dir = tempfile::tempdir().expect("tempdir");
        let url = "http://127.0.0.1:4321/v1";
        let prepared =
            prepare(Workload::Model, dir.path(), &example(), Some(url)).expect("prepared");
        let profiles = convene_worker::profiles::load(&prepared.profiles).expect("valid");
        let (model, playbook): (Vec<_>, Vec<_>) = profiles
            .iter()
            .partition(|p| p.profile.provider == convene_worker::openai::PROVIDER_NAME);
        // The three specialists and the planner.
        assert_eq!(model.len(), 4);
        for p in &model {
            assert_eq!(
                p.connection.base_url.as_deref(),
                Some(url),
                "{}",
                p.profile.id
            );
            assert_eq!(p.connection.api_key_env.as_deref(), Some(MODEL_KEY_ENV));
        }
        assert!(playbook.iter().all(|p| p.connection.base_url.is_none()));
        // The model phase runs the model-driven specialists, the baseline the playbook
        // ones; neither spec is deduplicated by an idempotency key.
        let baseline = prepared.baseline.expect("a baseline spec");
        let ids = |spec: &v1::RunSpec| -> Vec<String> {
            spec.delegations
                .iter()
                .map(|d| d.profile_id.clone())
                .collect()
        };
        assert!(ids(&prepared.spec).iter().all(|id| id.ends_with("-model")));
        assert!(ids(&baseline).iter().all(|id| !id.ends_with("-model")));
        assert_eq!(ids(&prepared.spec).len(), ids(&baseline).len());
        assert!(prepared.spec.idempotency_key.is_empty());
        assert!(baseline.idempotency_key.is_empty());
        assert_eq!(prepared.expected, v1::RunState::WaitingInput);

        let err = prepare(Workload::Model, dir.path(), &example(), None)
            .err()
            .expect("no server, no model workload")
            .to_string();
        assert!(err.contains("scripted model server"), "{err}");
    }

    #[test]
    fn the_noop_policy_lets_the_worker_pool_serve_noop() {
        let dir = tempfile::tempdir().expect("tempdir");
        let prepared = prepare(Workload::Noop, dir.path(), &example(), None).expect("prepared");
        let policy = convene_mesh::policy_file::Policy::load(&prepared.policy)
            .expect("the bench's policy compiles");
        assert!(policy.profiles.contains_key("noop"));
        let pool = &policy.principals["worker-pool"];
        assert!(pool.may_serve("noop") && pool.may_serve("logs-investigator"));
    }

    #[test]
    fn the_other_workloads_have_no_baseline() {
        let dir = tempfile::tempdir().expect("tempdir");
        for workload in [Workload::Noop, Workload::PaymentIncident] {
            let prepared = prepare(workload, dir.path(), &example(), None).expect("prepared");
            assert!(prepared.baseline.is_none(), "{workload:?}");
        }
    }
}
