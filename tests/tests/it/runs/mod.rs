//! End-to-end behaviour of runs: the payment incident in both modes, deadlines and late
//! results, invalid results, duplicates, width limits, idempotency.
//!
//! This module holds the profiles, mesh options and lookups the tests share.

mod admission;
mod incident;
mod lifecycle;
mod results;
mod templates;

use std::path::Path;
use std::time::Duration;

use crate::harness::{MeshOptions, TestMesh, Workers, example_profiles};
use convene_mesh::auth::request;
use convene_proto::v1;

const ONCALL: &str = "oncall@acme";
const LIMIT: Duration = Duration::from_secs(30);

/// The example profiles with `faults` added to the named profiles.
fn profiles_with_faults(faults: &[(&str, &str)]) -> String {
    let mut text = example_profiles();
    for (profile, f) in faults {
        let anchor = format!("  - id: {profile}\n");
        assert!(
            text.contains(&anchor),
            "profile {profile} is in the example"
        );
        text = text.replace(&anchor, &format!("{anchor}    faults: {f}\n"));
    }
    text
}

/// The example profiles with every delegation held until `release` exists (each held
/// delegation's id appended to `log`, if given).
pub(crate) fn held_profiles(release: &Path, log: Option<&Path>) -> String {
    let log = log.map_or_else(String::new, |l| format!(", log: {}", l.display()));
    example_profiles().replace(
        "    provider: playbook\n",
        &format!(
            "    provider: playbook\n    hold: {{ release: {}{log} }}\n",
            release.display()
        ),
    )
}

fn one_group(profiles: String) -> MeshOptions {
    MeshOptions {
        workers: vec![Workers {
            profiles: Some(profiles),
            count: 1,
            capacity: 64,
        }],
        ..MeshOptions::default()
    }
}

fn delegation_id(run: &v1::Run, name: &str) -> String {
    run.delegations
        .iter()
        .filter_map(|d| d.task.as_ref())
        .find(|t| t.name == name)
        .map(|t| t.delegation_id.clone())
        .unwrap_or_else(|| panic!("no delegation {name}"))
}

fn rejection(run: &v1::Run, name: &str) -> v1::Rejection {
    let id = delegation_id(run, name);
    run.decision
        .as_ref()
        .expect("a decision")
        .rejected
        .iter()
        .find(|r| r.delegation_id == id)
        .cloned()
        .unwrap_or_else(|| panic!("{name} was not rejected: {:#?}", run.decision))
}

/// The first page of the runs `ONCALL` sees.
async fn listed_runs(mesh: &TestMesh) -> Vec<v1::Run> {
    mesh.supervisor()
        .list_runs(request(
            v1::ListRunsRequest::default(),
            &mesh.credential(ONCALL),
        ))
        .await
        .expect("ListRuns")
        .into_inner()
        .runs
}

fn with_join_timeout(
    mut spec: v1::RunSpec,
    timeout: Duration,
    late: v1::LateResultPolicy,
) -> v1::RunSpec {
    let join = spec.join.as_mut().expect("join");
    join.timeout = Some(convene_core::time::to_duration(timeout));
    join.late_result = late as i32;
    spec
}
