//! Reading a run spec file (YAML or JSON in the protobuf JSON mapping) and explaining it.

use std::fmt::Write as _;
use std::path::Path;
use std::time::SystemTime;

use anyhow::{Context as _, bail};
use convene_core::model::{JoinStrategy, LateResultPolicy, OnConflict, OnTimeout, Overflow};
use convene_core::validate;
use convene_proto::v1;

/// Reads a `convene.v1.RunSpec` from a `.yaml`/`.yml`/`.json` file.
pub fn load(path: &Path) -> anyhow::Result<v1::RunSpec> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read run spec {}", path.display()))?;
    parse(&text, path)
}

/// Parses a run spec; `path` names the format (by extension) and the error messages.
pub fn parse(text: &str, path: &Path) -> anyhow::Result<v1::RunSpec> {
    let value: serde_json::Value = match path.extension().and_then(|e| e.to_str()) {
        Some("yaml" | "yml") => serde_yaml::from_str(text)
            .with_context(|| format!("{} is not valid YAML", path.display()))?,
        Some("json") => serde_json::from_str(text)
            .with_context(|| format!("{} is not valid JSON", path.display()))?,
        other => bail!(
            "{}: unknown file type {other:?}; a run spec is a .yaml, .yml or .json file",
            path.display()
        ),
    };
    convene_proto::json::from_value(value).map_err(|e| {
        anyhow::anyhow!(
            "{} is not a convene.v1.RunSpec: {e} (fields follow the protobuf JSON mapping; see examples/payment-incident/run.yaml)",
            path.display()
        )
    })
}

/// Validates a spec as the supervisor would at `now` and explains what it asks for.
pub fn explain(spec: &v1::RunSpec, now: SystemTime) -> anyhow::Result<String> {
    let domain = validate::run_spec(spec, now).map_err(|e| anyhow::anyhow!("invalid {e}"))?;
    let mut out = String::new();
    let w = &mut out;
    let _ = writeln!(w, "Goal: {}", domain.goal);
    if let Some(key) = &domain.idempotency_key {
        let _ = writeln!(
            w,
            "Idempotency key: {key} (submitting it again returns the same run)"
        );
    }
    let l = &domain.limits;
    let plan = match (&domain.planner, spec.planner.as_ref()) {
        (Some(p), Some(wire)) => {
            let to = if wire.profiles.is_empty() {
                "every profile of the policy that holds tools".to_owned()
            } else {
                wire.profiles.join(", ")
            };
            format!(
                "planned by {} in at most {} round(s), delegating to {to}; it stops after {} round(s) in a row without progress",
                p.profile_id, l.max_rounds, l.no_progress_rounds
            )
        }
        _ => format!("{} delegation(s)", domain.plan.len()),
    };
    let _ = writeln!(
        w,
        "\nPlan: {plan}, at most {} at once ({}), depth ≤ {}, {} iteration(s) per worker, {} retry(ies) per delegation",
        l.max_parallel_workers,
        match l.overflow {
            Overflow::Queue => "the rest queue",
            Overflow::Truncate => "the rest are dropped",
            Overflow::Reject => "a wider plan is rejected",
        },
        l.max_depth,
        l.max_iterations,
        l.max_redelegations
    );
    for (i, t) in domain.plan.iter().enumerate() {
        let _ = writeln!(w, "  {}. {} → profile {}", i + 1, t.name, t.profile_id);
        let _ = writeln!(w, "     {}", t.goal);
        for c in &t.acceptance_criteria {
            let _ = writeln!(w, "     ✓ {c}");
        }
        if !t.scope.resources.is_empty() {
            let _ = writeln!(w, "     scope: {}", t.scope.resources.join(", "));
        }
        for p in &t.required_scopes {
            let _ = writeln!(w, "     needs: {p}");
        }
        if let Some(timeout) = t.timeout {
            let _ = writeln!(w, "     timeout: {}", humanize(timeout));
        }
    }
    let j = &domain.join;
    let _ = writeln!(
        w,
        "\nJoin {}: {}",
        if j.join_id.is_empty() {
            "(unnamed)"
        } else {
            &j.join_id
        },
        match j.strategy {
            JoinStrategy::All => "waits for every delegation",
            JoinStrategy::Quorum =>
                "decides once the required delegations are in and the minimum is met",
            JoinStrategy::TimeoutPartial =>
                "waits for every delegation, and at its deadline decides on what is there",
            JoinStrategy::FirstValid => "decides on the first valid result",
        }
    );
    if !j.required.is_empty() {
        let _ = writeln!(w, "  required: {}", j.required.join(", "));
    }
    if !j.optional.is_empty() {
        let _ = writeln!(w, "  optional: {}", j.optional.join(", "));
    }
    if !j.required_profiles.is_empty() {
        let _ = writeln!(
            w,
            "  required: an accepted result of each of {}",
            j.required_profiles.join(", ")
        );
    }
    let m = &j.minimum;
    let _ = write!(w, "  minimum: {} accepted result(s)", m.count.max(1));
    if m.weight > 0.0 {
        let _ = write!(w, ", weight {}", m.weight);
    }
    if !m.required_evidence_kinds.is_empty() {
        let _ = write!(
            w,
            ", evidence of kinds {}",
            m.required_evidence_kinds.join(" + ")
        );
    }
    let _ = writeln!(w);
    if let Some(deadline) = j.deadline {
        let after = deadline.duration_since(now).unwrap_or_default();
        let _ = writeln!(
            w,
            "  deadline: {} after the start, then {}",
            humanize(after),
            match j.on_timeout {
                OnTimeout::EmitPartial => "publish a provisional assessment naming the gaps",
                OnTimeout::Fail => "fail unless everything is in",
            }
        );
    }
    let _ = writeln!(
        w,
        "  conflicts: {}",
        match j.on_conflict {
            OnConflict::PreserveAndEscalate =>
                "kept with both claims and their evidence, for a human to decide",
            OnConflict::FollowUp => "kept, with a proposed follow-up query, then escalated",
        }
    );
    let _ = writeln!(
        w,
        "  late results: {}",
        match j.late_result {
            LateResultPolicy::Discard => "recorded and discarded",
            LateResultPolicy::AppendRevision =>
                "appended as a new revision; the run is never reopened",
        }
    );
    let after = l.deadline.duration_since(now).unwrap_or_default();
    let _ = writeln!(
        w,
        "\nThe run ends at the latest {} after its start.",
        humanize(after)
    );
    Ok(out)
}

fn humanize(d: std::time::Duration) -> String {
    let secs = d.as_secs();
    if secs >= 60 && secs.is_multiple_of(60) {
        format!("{}m", secs / 60)
    } else if secs > 0 {
        format!("{secs}s")
    } else {
        format!("{}ms", d.as_millis())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    fn example() -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../examples/payment-incident/run.yaml")
    }

    #[test]
    fn the_example_spec_loads_and_explains() {
        let spec = load(&example()).unwrap();
        assert_eq!(spec.delegations.len(), 3);
        let text = explain(&spec, SystemTime::now()).unwrap();
        for needle in [
            "logs → profile logs-investigator",
            "required: logs",
            "impact_metric + causal_signal",
            "provisional",
        ] {
            assert!(text.contains(needle), "missing {needle:?} in:\n{text}");
        }
    }

    #[test]
    fn a_bad_field_is_named() {
        let err = parse("goal: x\ndelegatons: []\n", Path::new("r.yaml"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("delegatons"), "{err}");
        let spec = parse("goal: ''\n", Path::new("r.yaml")).unwrap();
        let err = explain(&spec, SystemTime::now()).unwrap_err().to_string();
        assert!(err.contains("spec.goal"), "{err}");
    }
}
