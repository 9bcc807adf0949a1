//! Run templates: runs an operator fixes in configuration (the `templates_file` beside
//! the policy file), which callers start by id with their inputs.
//!
//! A template holds a complete `RunSpec`, validated at load as StartRun validates a
//! spec. A caller fills the template's inputs and may send a partial spec that only
//! tightens it: its own idempotency key, extra labels, a stricter join, lower limits.
//! Everything else the template fixes (goal, delegations, profiles, planner) is the
//! operator's.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use convene_core::time::{from_duration, from_timestamp};
use convene_core::validate;
use convene_mesh::policy_file::Policy;
use convene_proto::v1;
use serde::Deserialize;

use crate::error::Error;

/// The payment-incident example's templates, used when neither a templates file nor a
/// policy file is configured.
pub const EXAMPLE_TEMPLATES: &str =
    include_str!("../../../examples/payment-incident/templates.yaml");

/// The example's run spec, which [`EXAMPLE_TEMPLATES`] names as `run.yaml`.
const EXAMPLE_RUN: &str = include_str!("../../../examples/payment-incident/run.yaml");

/// The input every template accepts: text appended to the run's goal.
pub const NOTE_INPUT: &str = "note";

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct TemplatesFile {
    templates: Vec<Entry>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Entry {
    id: String,
    name: String,
    #[serde(default)]
    description: String,
    #[serde(default)]
    tags: Vec<String>,
    spec: PathBuf,
    #[serde(default)]
    inputs: Vec<Input>,
}

/// An input a template declares.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Input {
    /// The name callers give it under, and its placeholder `{{name}}`.
    pub name: String,
    /// What to give.
    #[serde(default)]
    pub description: String,
    /// Whether a run from the template needs it.
    #[serde(default)]
    pub required: bool,
}

/// One template: the operator's spec and what a caller may fill in.
#[derive(Debug, Clone)]
pub struct Template {
    /// The id callers start it by.
    pub id: String,
    /// A short human name.
    pub name: String,
    /// What a run from it does.
    pub description: String,
    /// Free-form tags.
    pub tags: Vec<String>,
    /// The inputs callers may give.
    pub inputs: Vec<Input>,
    /// Whether its runs only read: every profile it can delegate to (its delegations',
    /// its planner's and the planner's choices) holds only R0 tools of the policy's
    /// catalog. Actions its runs recommend still wait for approval either way.
    pub read_only: bool,
    spec: v1::RunSpec,
}

/// The templates a supervisor serves, by id (none by default).
#[derive(Debug, Clone, Default)]
pub struct Templates {
    by_id: BTreeMap<String, Template>,
}

impl Templates {
    /// Reads a templates file; each template's spec file is read relative to it and
    /// validated against `policy` as StartRun would validate it.
    ///
    /// # Errors
    ///
    /// [`crate::Error::Templates`] naming the file, the template id and what to fix.
    pub fn load(path: &Path, policy: &Policy) -> Result<Self, crate::Error> {
        let failed = |message: String| crate::Error::Templates {
            file: path.display().to_string(),
            message,
        };
        let text =
            std::fs::read_to_string(path).map_err(|e| failed(format!("cannot read it: {e}")))?;
        let dir = path.parent().unwrap_or(Path::new("."));
        Self::parse(&text, policy, |spec| {
            let file = dir.join(spec);
            std::fs::read_to_string(&file)
                .map(|text| (text, file.clone()))
                .map_err(|e| format!("cannot read its spec {}: {e}", file.display()))
        })
        .map_err(failed)
    }

    /// The payment-incident example's templates, validated against `policy`.
    ///
    /// # Errors
    ///
    /// [`crate::Error::Templates`] when `policy` lacks the example's profiles.
    pub fn example(policy: &Policy) -> Result<Self, crate::Error> {
        Self::parse(EXAMPLE_TEMPLATES, policy, |spec| {
            if spec == Path::new("run.yaml") {
                Ok((EXAMPLE_RUN.to_owned(), PathBuf::from("run.yaml")))
            } else {
                Err(format!(
                    "the built-in example has no spec {}",
                    spec.display()
                ))
            }
        })
        .map_err(|message| crate::Error::Templates {
            file: "(built-in example templates.yaml)".to_owned(),
            message,
        })
    }

    fn parse(
        text: &str,
        policy: &Policy,
        read_spec: impl Fn(&Path) -> Result<(String, PathBuf), String>,
    ) -> Result<Self, String> {
        let file: TemplatesFile = serde_yaml::from_str(text).map_err(|e| {
            format!("not a templates file: {e} (see examples/payment-incident/templates.yaml)")
        })?;
        let now = SystemTime::now();
        let mut by_id = BTreeMap::new();
        for entry in file.templates {
            let id = entry.id.trim().to_owned();
            if id.is_empty() {
                return Err("a template has an empty id".to_owned());
            }
            let at = |m: String| format!("template {id}: {m}");
            let (spec_text, spec_path) = read_spec(&entry.spec).map_err(at)?;
            let value: serde_json::Value = serde_yaml::from_str(&spec_text)
                .map_err(|e| at(format!("{} is not valid YAML: {e}", spec_path.display())))?;
            let mut spec: v1::RunSpec = convene_proto::json::from_value(value).map_err(|e| {
                at(format!(
                    "{} is not a convene.v1.RunSpec: {e}",
                    spec_path.display()
                ))
            })?;
            // Every run from a template would share the template's key: callers give
            // their own.
            spec.idempotency_key.clear();
            check_spec(&spec, policy, now).map_err(|e| at(e.to_string()))?;
            let mut inputs = entry.inputs;
            for input in &inputs {
                if input.name.is_empty() || input.name.contains(['{', '}']) {
                    return Err(at(format!(
                        "input name {:?}: give a name without braces",
                        input.name
                    )));
                }
            }
            if !inputs.iter().any(|i| i.name == NOTE_INPUT) {
                inputs.push(Input {
                    name: NOTE_INPUT.to_owned(),
                    description: "Free text appended to the run's goal.".to_owned(),
                    required: false,
                });
            }
            let template = Template {
                id: id.clone(),
                name: entry.name,
                description: entry.description,
                tags: entry.tags,
                inputs,
                read_only: reads_only(&spec, policy),
                spec,
            };
            if by_id.insert(id.clone(), template).is_some() {
                return Err(format!("template id {id} is used twice"));
            }
        }
        Ok(Self { by_id })
    }

    /// The templates' ids, sorted.
    pub fn ids(&self) -> Vec<&str> {
        self.by_id.keys().map(String::as_str).collect()
    }

    /// The template `id`, if configured.
    pub fn get(&self, id: &str) -> Option<&Template> {
        self.by_id.get(id)
    }

    /// The spec of a run from template `id` with `inputs` and the caller's partial
    /// `given` spec, validated only for what the caller may change.
    pub(crate) fn resolve(
        &self,
        id: &str,
        inputs: &HashMap<String, String>,
        given: Option<v1::RunSpec>,
        now: SystemTime,
    ) -> Result<v1::RunSpec, Error> {
        let Some(template) = self.by_id.get(id) else {
            let known = self.ids();
            return Err(Error::NotFound(if known.is_empty() {
                format!(
                    "run template {id} not found: this supervisor has no templates (its templates_file is unset)"
                )
            } else {
                format!(
                    "run template {id} not found; known templates: {}",
                    known.join(", ")
                )
            }));
        };
        let mut spec = template.fill(inputs)?;
        if let Some(given) = given {
            template.tighten(&mut spec, given, now)?;
        }
        Ok(spec)
    }
}

/// Whether every profile `spec` can delegate to holds only read-only (R0) tools of
/// `policy`'s catalog; a tool the catalog does not list counts as not read-only.
fn reads_only(spec: &v1::RunSpec, policy: &Policy) -> bool {
    let planner = spec.planner.iter().flat_map(|p| {
        std::iter::once(p.profile_id.as_str()).chain(p.profiles.iter().map(String::as_str))
    });
    let mut profiles = spec
        .delegations
        .iter()
        .map(|d| d.profile_id.as_str())
        .chain(planner);
    profiles.all(|id| {
        policy.profiles.get(id).is_some_and(|profile| {
            profile.tools.iter().all(|tool| {
                policy
                    .tools
                    .get(tool)
                    .is_some_and(|t| t.risk == convene_core::permissions::RiskLevel::R0)
            })
        })
    })
}

/// Validates a spec as StartRun does: its fields, then its profiles against the policy.
pub(crate) fn check_spec(
    spec: &v1::RunSpec,
    policy: &Policy,
    now: SystemTime,
) -> Result<convene_core::model::RunSpec, Error> {
    let domain = validate::run_spec(spec, now)?;
    crate::plan::check_profiles(policy, spec, &domain)?;
    Ok(domain)
}

impl Template {
    /// The template's spec with `inputs` filled in.
    fn fill(&self, inputs: &HashMap<String, String>) -> Result<v1::RunSpec, Error> {
        let declared = || {
            self.inputs
                .iter()
                .map(|i| i.name.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        };
        let mut names: Vec<&String> = inputs.keys().collect();
        names.sort();
        for name in names {
            if !self.inputs.iter().any(|i| &i.name == name) {
                return Err(Error::invalid(
                    format!("inputs.{name}"),
                    format!(
                        "template {} declares no such input; its inputs: {}",
                        self.id,
                        declared()
                    ),
                ));
            }
        }
        if let Some(missing) = self
            .inputs
            .iter()
            .find(|i| i.required && inputs.get(&i.name).is_none_or(|v| v.trim().is_empty()))
        {
            return Err(Error::invalid(
                format!("inputs.{}", missing.name),
                format!(
                    "required by template {}: {}",
                    self.id,
                    if missing.description.is_empty() {
                        "give a value"
                    } else {
                        &missing.description
                    }
                ),
            ));
        }
        let substitute = |text: &mut String| {
            for input in &self.inputs {
                if input.name == NOTE_INPUT {
                    continue;
                }
                let placeholder = format!("{{{{{}}}}}", input.name);
                if text.contains(&placeholder) {
                    let value = inputs.get(&input.name).map_or("", String::as_str);
                    *text = text.replace(&placeholder, value);
                }
            }
        };
        let mut spec = self.spec.clone();
        substitute(&mut spec.goal);
        for d in &mut spec.delegations {
            substitute(&mut d.goal);
        }
        for value in spec.labels.values_mut() {
            substitute(value);
        }
        if let Some(note) = inputs
            .get(NOTE_INPUT)
            .map(|n| n.trim())
            .filter(|n| !n.is_empty())
        {
            spec.goal.push_str("\n\nNote from the caller: ");
            spec.goal.push_str(note);
        }
        Ok(spec)
    }

    /// Applies the caller's `given` spec to `spec`, refusing anything that is not the
    /// caller's to set or that weakens the template.
    fn tighten(
        &self,
        spec: &mut v1::RunSpec,
        given: v1::RunSpec,
        now: SystemTime,
    ) -> Result<(), Error> {
        let id = &self.id;
        let fixed = |field: &str| {
            Error::invalid(
                format!("spec.{field}"),
                format!(
                    "template {id} fixes it; with a template the spec may set only idempotency_key, labels, join and limits"
                ),
            )
        };
        if !given.goal.is_empty() {
            return Err(fixed("goal"));
        }
        if !given.delegations.is_empty() {
            return Err(fixed("delegations"));
        }
        if given.planner.is_some() {
            return Err(fixed("planner"));
        }
        spec.idempotency_key = given.idempotency_key;
        for (key, value) in given.labels {
            match spec.labels.get(&key) {
                Some(fixed_value) if *fixed_value != value => {
                    return Err(Error::invalid(
                        format!("spec.labels.{key}"),
                        format!("template {id} sets it to {fixed_value:?}; give another label"),
                    ));
                }
                _ => {
                    spec.labels.insert(key, value);
                }
            }
        }
        if let Some(join) = given.join {
            let base = spec.join.clone().unwrap_or_default();
            spec.join = Some(tighten_join(id, &base, join)?);
        }
        if let Some(limits) = given.limits {
            let base = spec.limits.unwrap_or_default();
            let effective = validate::run_spec(&self.spec, now)?.limits;
            spec.limits = Some(tighten_limits(id, &base, &effective, limits, now)?);
        }
        Ok(())
    }
}

fn weaker(
    id: &str,
    field: &str,
    given: impl std::fmt::Display,
    template: impl std::fmt::Display,
) -> Error {
    Error::invalid(
        format!("spec.{field}"),
        format!("{given} is weaker than the template's {template} ({id})"),
    )
}

fn missing(id: &str, field: &str, template: &[String], given: &[String]) -> Option<Error> {
    let lacking: Vec<&str> = template
        .iter()
        .filter(|t| !given.contains(t))
        .map(String::as_str)
        .collect();
    (!lacking.is_empty()).then(|| {
        Error::invalid(
            format!("spec.{field}"),
            format!(
                "drops {} that the template requires ({id}); keep [{}]",
                lacking.join(", "),
                template.join(", ")
            ),
        )
    })
}

/// The template's join with the caller's stricter settings: every field the caller
/// leaves unset keeps the template's value.
fn tighten_join(
    id: &str,
    t: &v1::JoinContract,
    g: v1::JoinContract,
) -> Result<v1::JoinContract, Error> {
    let mut out = t.clone();
    let same = |field: &str, differs: bool| {
        if differs {
            Err(Error::invalid(
                format!("spec.join.{field}"),
                format!("template {id} fixes it; leave it unset or give the template's value"),
            ))
        } else {
            Ok(())
        }
    };
    if !g.required.is_empty() {
        if let Some(e) = missing(id, "join.required", &t.required, &g.required) {
            return Err(e);
        }
        out.required = g.required;
    }
    if !g.required_profiles.is_empty() {
        if let Some(e) = missing(
            id,
            "join.required_profiles",
            &t.required_profiles,
            &g.required_profiles,
        ) {
            return Err(e);
        }
        out.required_profiles = g.required_profiles;
    }
    if g.strategy != 0 {
        if g.strategy != t.strategy && g.strategy != v1::JoinStrategy::All as i32 {
            let name = |s: i32| {
                v1::JoinStrategy::try_from(s)
                    .map_or_else(|_| s.to_string(), |s| s.as_str_name().to_owned())
            };
            return Err(Error::invalid(
                "spec.join.strategy",
                format!(
                    "{} is weaker than the template's {} ({id}); give it or JOIN_STRATEGY_ALL",
                    name(g.strategy),
                    name(t.strategy)
                ),
            ));
        }
        out.strategy = g.strategy;
    }
    if let Some(gm) = g.minimum {
        let tm = t.minimum.clone().unwrap_or_default();
        let mut m = tm.clone();
        if gm.count != 0 {
            if gm.count.max(1) < tm.count.max(1) {
                return Err(weaker(id, "join.minimum.count", gm.count, tm.count));
            }
            m.count = gm.count;
        }
        if gm.weight != 0.0 {
            if gm.weight < tm.weight {
                return Err(weaker(id, "join.minimum.weight", gm.weight, tm.weight));
            }
            m.weight = gm.weight;
        }
        if !gm.required_evidence_kinds.is_empty() {
            if let Some(e) = missing(
                id,
                "join.minimum.required_evidence_kinds",
                &tm.required_evidence_kinds,
                &gm.required_evidence_kinds,
            ) {
                return Err(e);
            }
            m.required_evidence_kinds = gm.required_evidence_kinds;
        }
        out.minimum = Some(m);
    }
    same("join_id", !g.join_id.is_empty() && g.join_id != t.join_id)?;
    same(
        "optional",
        !g.optional.is_empty() && g.optional != t.optional,
    )?;
    same("deadline", g.deadline.is_some() && g.deadline != t.deadline)?;
    same("timeout", g.timeout.is_some() && g.timeout != t.timeout)?;
    same(
        "on_timeout",
        g.on_timeout != 0 && g.on_timeout != t.on_timeout,
    )?;
    same(
        "on_conflict",
        g.on_conflict != 0 && g.on_conflict != t.on_conflict,
    )?;
    same(
        "late_result",
        g.late_result != 0 && g.late_result != t.late_result,
    )?;
    same("weights", !g.weights.is_empty() && g.weights != t.weights)?;
    Ok(out)
}

/// The template's limits with the caller's lower ones: a field the caller sets (not
/// zero) must be at most the template's effective limit `e` (its value, or the default
/// it stands for; unlimited budgets allow any).
fn tighten_limits(
    id: &str,
    t: &v1::Limits,
    e: &convene_core::model::Limits,
    g: v1::Limits,
    now: SystemTime,
) -> Result<v1::Limits, Error> {
    let mut out = *t;
    macro_rules! at_most {
        ($($field:ident: $limit:expr),+ $(,)?) => {$(
            if g.$field != 0 {
                if let Some(limit) = $limit {
                    if g.$field > limit {
                        return Err(weaker(id, concat!("limits.", stringify!($field)), g.$field, limit));
                    }
                }
                out.$field = g.$field;
            }
        )+};
    }
    at_most!(
        max_depth: Some(e.max_depth),
        max_parallel_workers: Some(e.max_parallel_workers),
        max_iterations: Some(e.max_iterations),
        max_rounds: Some(e.max_rounds),
        max_redelegations: Some(e.max_redelegations),
        max_tool_calls: e.max_tool_calls,
        max_tokens: e.max_tokens,
        no_progress_rounds: Some(e.no_progress_rounds),
    );
    if g.max_cost != 0.0 {
        if let Some(limit) = e.max_cost.filter(|limit| g.max_cost > *limit) {
            return Err(weaker(id, "limits.max_cost", g.max_cost, limit));
        }
        out.max_cost = g.max_cost;
    }
    if g.overflow != 0 && g.overflow != t.overflow {
        return Err(Error::invalid(
            "spec.limits.overflow",
            format!("template {id} fixes it; leave it unset or give the template's value"),
        ));
    }
    if let Some(timeout) = &g.timeout {
        let given = from_duration(timeout, "spec.limits.timeout")?;
        if now.checked_add(given).is_none_or(|d| d > e.deadline) {
            let allowed = e.deadline.duration_since(now).unwrap_or_default();
            return Err(weaker(
                id,
                "limits.timeout",
                humantime::format_duration(given),
                humantime::format_duration(std::time::Duration::from_secs(allowed.as_secs())),
            ));
        }
        out.timeout = g.timeout;
        out.deadline = None;
    }
    if let Some(deadline) = &g.deadline {
        let given = from_timestamp(deadline, "spec.limits.deadline")?;
        if given > e.deadline {
            return Err(Error::invalid(
                "spec.limits.deadline",
                format!(
                    "it is later than the deadline the template sets ({id}); give an earlier one"
                ),
            ));
        }
        out.deadline = g.deadline;
        out.timeout = None;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use convene_mesh::policy_file::PolicySource;

    use super::*;

    fn policy() -> Policy {
        PolicySource::new(None, None)
            .load()
            .expect("example policy")
            .0
    }

    #[test]
    fn the_example_loads_and_a_bad_template_names_its_file_and_id() {
        let templates = Templates::example(&policy()).expect("the example's templates");
        assert_eq!(templates.ids(), ["payment-incident-triage"]);
        let t = templates.get("payment-incident-triage").expect("template");
        assert!(t.inputs.iter().any(|i| i.name == NOTE_INPUT));
        assert!(t.spec.idempotency_key.is_empty());
        assert!(t.read_only, "the example's specialists hold R0 tools only");
        let mut writer = policy();
        writer
            .profiles
            .get_mut("change-auditor")
            .expect("profile")
            .tools
            .push("rollback_rule@1".to_owned());
        assert!(
            !reads_only(&t.spec, &writer),
            "a profile holding an R3 tool makes the template not read-only"
        );

        let dir = tempfile::tempdir().expect("tempdir");
        let run = EXAMPLE_RUN.replace("profile_id: change-auditor", "profile_id: nobody");
        std::fs::write(dir.path().join("bad.yaml"), run).expect("write");
        let file = dir.path().join("templates.yaml");
        std::fs::write(
            &file,
            "templates:\n  - id: broken\n    name: Broken\n    spec: bad.yaml\n",
        )
        .expect("write");
        let err = Templates::load(&file, &policy())
            .expect_err("unknown profile")
            .to_string();
        assert!(err.contains(&file.display().to_string()), "{err}");
        assert!(err.contains("template broken"), "{err}");
        assert!(err.contains("spec.delegations[2].profile_id"), "{err}");
    }

    #[test]
    fn required_inputs_fill_placeholders() {
        let mut t = Templates::example(&policy())
            .expect("example")
            .get("payment-incident-triage")
            .cloned()
            .expect("template");
        t.spec.goal = "Assess {{service}}.".to_owned();
        t.inputs.push(Input {
            name: "service".to_owned(),
            description: "The service paged.".to_owned(),
            required: true,
        });
        let err = t.fill(&HashMap::new()).expect_err("required").to_string();
        assert!(err.contains("inputs.service"), "{err}");
        let inputs = [("service".to_owned(), "payment-api".to_owned())].into();
        assert_eq!(t.fill(&inputs).expect("filled").goal, "Assess payment-api.");
    }
}
