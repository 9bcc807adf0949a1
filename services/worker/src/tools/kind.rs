//! The evidence kind of a tool call: the reserved argument a model (or playbook step)
//! adds to any call to name the kind of evidence it records, how it is offered in every
//! tool's schema, and how it is taken off before the tool sees the arguments.

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

/// Adds the [`EVIDENCE_KIND_ARG`] parameter to a tool's schema.
pub(crate) fn with_kind_arg(mut spec: ToolSpec) -> ToolSpec {
    if let Some(Value::Object(props)) = spec.parameters.get_mut("properties") {
        props.insert(
            EVIDENCE_KIND_ARG.to_owned(),
            serde_json::json!({
                "type": "string",
                "description": "Kind of evidence this call gathers, e.g. impact_metric or causal_signal."
            }),
        );
    }
    spec
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn evidence_kind_is_split_off_the_arguments() {
        let (args, kind) =
            split_kind(&serde_json::json!({"metric": "m", EVIDENCE_KIND_ARG: "impact_metric"}));
        assert_eq!(args, serde_json::json!({"metric": "m"}));
        assert_eq!(kind.as_deref(), Some("impact_metric"));
        let (_, none) = split_kind(&serde_json::json!({"metric": "m"}));
        assert_eq!(none, None);
    }
}
