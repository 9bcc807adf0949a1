//! The evidence kind of a tool call: the reserved argument a model (or playbook step)
//! adds to any call to name the kind of evidence it records, how it is offered in every
//! tool's schema, how it is taken off before the tool sees the arguments, and how the
//! kind a call records is chosen from the kinds its tool may record.
//!
//! A profile (its `evidence_kinds`) or an MCP tool's catalog entry declares the kinds a
//! tool may record, the default first. A call naming one of them records it; a call
//! naming none records the default, and its evidence says the kind was defaulted; a call
//! naming another kind is refused, the refusal naming the kinds it may use. A tool
//! without a declaration records any kind it is given, and its own default otherwise.

use serde_json::Value;

use crate::provider::ToolSpec;

/// The argument a model (or playbook step) may add to any tool call to name the kind of
/// evidence the call records, e.g. `impact_metric`. The loop removes it before the tool
/// sees the arguments.
pub const EVIDENCE_KIND_ARG: &str = "evidence_kind";

/// Splits the reserved [`EVIDENCE_KIND_ARG`] off a call's arguments.
pub(crate) fn split_kind(arguments: &Value) -> (Value, Option<String>) {
    match arguments {
        Value::Object(map) => {
            let mut map = map.clone();
            let kind = map
                .remove(EVIDENCE_KIND_ARG)
                .and_then(|v| v.as_str().map(str::to_owned))
                .filter(|k| !k.trim().is_empty());
            (Value::Object(map), kind)
        }
        other => (other.clone(), None),
    }
}

/// The kind a call's evidence records.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum KindChoice {
    /// The kind the call named.
    Named(String),
    /// The call named none: the tool's default.
    Defaulted(String),
}

impl KindChoice {
    /// The kind, and whether it was defaulted.
    pub(crate) fn into_parts(self) -> (String, bool) {
        match self {
            Self::Named(kind) => (kind, false),
            Self::Defaulted(kind) => (kind, true),
        }
    }
}

/// Chooses the kind the evidence of a call of `tool` records: the kind the call `named`
/// when `allowed` (the declared kinds, the default first) lists it or declares nothing;
/// when it named none, the first of `allowed`, or the tool's own `fallback` when nothing
/// is declared.
///
/// # Errors
///
/// The refusal the model reads when it named a kind `allowed` does not list: it names
/// the kinds it may use and the default.
pub(crate) fn choose_kind(
    tool: &str,
    named: Option<String>,
    allowed: &[String],
    fallback: &str,
) -> Result<KindChoice, String> {
    match (named, allowed.first()) {
        (Some(kind), _) if allowed.is_empty() || allowed.contains(&kind) => {
            Ok(KindChoice::Named(kind))
        }
        (Some(kind), Some(default)) => Err(format!(
            "{EVIDENCE_KIND_ARG} {kind:?} is refused: a call of {tool} may record evidence of \
             kind {} only; call it again naming one of them, or leave {EVIDENCE_KIND_ARG} out \
             to record {default}",
            allowed.join(", ")
        )),
        (None, Some(default)) => Ok(KindChoice::Defaulted(default.clone())),
        (None, None) | (Some(_), None) => Ok(KindChoice::Defaulted(fallback.to_owned())),
    }
}

/// Adds the [`EVIDENCE_KIND_ARG`] parameter to a tool's schema.
pub(crate) fn with_kind_arg(mut spec: ToolSpec) -> ToolSpec {
    if let Some(Value::Object(props)) = spec.parameters.get_mut("properties") {
        props.insert(
            EVIDENCE_KIND_ARG.to_owned(),
            serde_json::json!({
                "type": "string",
                "description": "Kind of evidence this call gathers, e.g. impact_metric or \
                                causal_signal; left out, the tool's default kind."
            }),
        );
    }
    spec
}

/// A tool's schema (with the [`EVIDENCE_KIND_ARG`] parameter) narrowed to the kinds
/// `allowed` declares, the default first: the parameter becomes an enum of them.
pub(crate) fn with_kinds_offered(spec: &ToolSpec, allowed: &[String]) -> ToolSpec {
    let mut spec = spec.clone();
    if let (Some(Value::Object(props)), Some(default)) =
        (spec.parameters.get_mut("properties"), allowed.first())
    {
        props.insert(
            EVIDENCE_KIND_ARG.to_owned(),
            serde_json::json!({
                "type": "string",
                "enum": allowed,
                "description": format!(
                    "Kind of evidence this call gathers: one of {}; left out, {default}.",
                    allowed.join(", ")
                ),
            }),
        );
    }
    spec
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kinds(k: &[&str]) -> Vec<String> {
        k.iter().map(|&s| s.to_owned()).collect()
    }

    #[test]
    fn evidence_kind_is_split_off_the_arguments() {
        let (args, kind) =
            split_kind(&serde_json::json!({"metric": "m", EVIDENCE_KIND_ARG: "impact_metric"}));
        assert_eq!(args, serde_json::json!({"metric": "m"}));
        assert_eq!(kind.as_deref(), Some("impact_metric"));
        let (_, none) = split_kind(&serde_json::json!({"metric": "m"}));
        assert_eq!(none, None);
    }

    #[test]
    fn a_kind_left_out_is_the_declared_default() {
        let allowed = kinds(&["causal_signal", "impact_metric"]);
        assert_eq!(
            choose_kind("search_logs@1", None, &allowed, "log_query"),
            Ok(KindChoice::Defaulted("causal_signal".into()))
        );
        // Nothing declared: the tool's own default.
        assert_eq!(
            choose_kind("search_logs@1", None, &[], "log_query"),
            Ok(KindChoice::Defaulted("log_query".into()))
        );
        assert_eq!(
            KindChoice::Defaulted("causal_signal".into()).into_parts(),
            ("causal_signal".to_owned(), true)
        );
    }

    #[test]
    fn a_named_kind_must_be_one_the_tool_may_record() {
        let allowed = kinds(&["causal_signal", "impact_metric"]);
        assert_eq!(
            choose_kind("search_logs@1", Some("impact_metric".into()), &allowed, "x"),
            Ok(KindChoice::Named("impact_metric".into()))
        );
        let refusal =
            choose_kind("search_logs@1", Some("smoking_gun".into()), &allowed, "x").unwrap_err();
        for part in [
            "\"smoking_gun\"",
            "search_logs@1",
            "causal_signal, impact_metric",
            "leave evidence_kind out to record causal_signal",
        ] {
            assert!(refusal.contains(part), "{part}: {refusal}");
        }
        // Nothing declared: any kind, as before declarations existed.
        assert_eq!(
            choose_kind(
                "search_logs@1",
                Some("smoking_gun".into()),
                &[],
                "log_query"
            )
            .map(KindChoice::into_parts),
            Ok(("smoking_gun".to_owned(), false))
        );
    }

    #[test]
    fn the_schema_offers_the_declared_kinds_only() {
        let spec = with_kind_arg(ToolSpec {
            name: "query_metrics@1".into(),
            description: "d".into(),
            parameters: serde_json::json!({"type": "object", "properties": {"metric": {"type": "string"}}}),
        });
        assert!(spec.parameters["properties"][EVIDENCE_KIND_ARG]["enum"].is_null());
        let narrowed = with_kinds_offered(&spec, &kinds(&["impact_metric", "causal_signal"]));
        let arg = &narrowed.parameters["properties"][EVIDENCE_KIND_ARG];
        assert_eq!(
            arg["enum"],
            serde_json::json!(["impact_metric", "causal_signal"])
        );
        assert!(
            arg["description"]
                .as_str()
                .unwrap()
                .contains("left out, impact_metric")
        );
        assert_eq!(
            narrowed.parameters["properties"]["metric"],
            spec.parameters["properties"]["metric"]
        );
        // Nothing declared: the schema as it was.
        assert_eq!(with_kinds_offered(&spec, &[]), spec);
    }
}
