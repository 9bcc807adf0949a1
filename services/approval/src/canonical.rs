//! The canonical JSON of an action's parameters and the hash approvals bind to.
//!
//! Approvers approve *these exact parameters*: the request stores
//! `sha256:<hex>` of the parameters' canonical JSON, every vote and every execution must
//! quote it, and any change to the parameters yields another hash. For that, equal
//! parameters must always give equal bytes, whatever produced them (a Go client, a YAML
//! file, a Rust struct), so the text is defined here rather than left to a serializer:
//!
//! - **objects**: keys sorted by their UTF-8 bytes (which is Unicode code point order),
//!   recursively; `{"k":v,...}` with no whitespace anywhere;
//! - **strings** and keys: JSON strings in UTF-8; `"` and `\` are escaped, control
//!   characters are written `\n`, `\t`, ... or `\u00XX` (lowercase hex); every other
//!   character, including non-ASCII, is written as itself;
//! - **numbers** (protobuf `Value` numbers are doubles): an integral value of magnitude
//!   below 2^53 is written as a plain integer (`3`, `-12`; `-0` is `0`); any other value
//!   is written in Rust's shortest round-trip scientific form (`1.5e-1`, `1e100`), so one
//!   double has exactly one spelling. NaN and infinities are not JSON and are refused;
//! - `true`, `false`, `null`; a `Value` with no kind set counts as `null`;
//! - lists: `[a,b,...]` in their order.
//!
//! Missing parameters are the empty object `{}`.

use std::fmt::Write as _;

use convene_core::{Rule, ValidationError, ids::content_hash};
use prost_types::{Struct, Value, value::Kind};

/// Largest magnitude below which every integral double is an exact integer (2^53).
const EXACT_INTEGER_LIMIT: f64 = 9_007_199_254_740_992.0;

/// The canonical JSON text of `parameters` (see the [module docs](self)).
///
/// # Errors
///
/// A [`ValidationError`] naming the path of a NaN or infinite number, e.g.
/// `parameters.rule.weights[2]`.
pub fn canonical_json(parameters: &Struct) -> Result<String, ValidationError> {
    let mut out = String::new();
    write_struct(&mut out, parameters, "parameters")?;
    Ok(out)
}

/// `sha256:<hex>` of the canonical JSON of `parameters`.
///
/// # Errors
///
/// As [`canonical_json`].
pub fn parameters_hash(parameters: &Struct) -> Result<String, ValidationError> {
    Ok(content_hash(canonical_json(parameters)?.as_bytes()))
}

fn write_struct(out: &mut String, value: &Struct, path: &str) -> Result<(), ValidationError> {
    out.push('{');
    // `Struct::fields` is a BTreeMap over `String`, which iterates in byte order: the
    // sort order the canonical form asks for.
    for (i, (key, field)) in value.fields.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        write_string(out, key);
        out.push(':');
        write_value(out, field, &format!("{path}.{key}"))?;
    }
    out.push('}');
    Ok(())
}

fn write_value(out: &mut String, value: &Value, path: &str) -> Result<(), ValidationError> {
    match &value.kind {
        None | Some(Kind::NullValue(_)) => out.push_str("null"),
        Some(Kind::BoolValue(b)) => out.push_str(if *b { "true" } else { "false" }),
        Some(Kind::NumberValue(n)) => write_number(out, *n, path)?,
        Some(Kind::StringValue(s)) => write_string(out, s),
        Some(Kind::StructValue(s)) => write_struct(out, s, path)?,
        Some(Kind::ListValue(list)) => {
            out.push('[');
            for (i, item) in list.values.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_value(out, item, &format!("{path}[{i}]"))?;
            }
            out.push(']');
        }
    }
    Ok(())
}

fn write_number(out: &mut String, n: f64, path: &str) -> Result<(), ValidationError> {
    if !n.is_finite() {
        return Err(ValidationError::new(
            path,
            Rule::Format,
            format!("{n} is not a JSON number; send a finite number or a string"),
        ));
    }
    if n.fract() == 0.0 && n.abs() < EXACT_INTEGER_LIMIT {
        // Exact: the value is an integer below 2^53, so the cast neither rounds nor
        // saturates, and -0.0 becomes 0.
        #[allow(clippy::cast_possible_truncation)]
        let integer = n as i64;
        let _ = write!(out, "{integer}");
    } else {
        let _ = write!(out, "{n:e}");
    }
    Ok(())
}

fn write_string(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{08}' => out.push_str("\\b"),
            '\u{0c}' => out.push_str("\\f"),
            c if u32::from(c) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", u32::from(c));
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Builds `Struct`s from JSON, for tests and for clients that hold JSON.
///
/// # Errors
///
/// `json` is not an object.
pub fn struct_from_json(json: &serde_json::Value) -> Result<Struct, String> {
    match json {
        serde_json::Value::Object(_) => Ok(convene_proto::json::to_struct(json)),
        other => Err(format!("parameters must be a JSON object, not {other}")),
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn canon(v: serde_json::Value) -> String {
        canonical_json(&struct_from_json(&v).unwrap()).unwrap()
    }

    #[test]
    fn keys_are_sorted_recursively_without_whitespace() {
        assert_eq!(
            canon(json!({"b": 1, "a": {"z": [true, null], "y": "x"}})),
            r#"{"a":{"y":"x","z":[true,null]},"b":1}"#
        );
        assert_eq!(canonical_json(&Struct::default()).unwrap(), "{}");
    }

    #[test]
    fn numbers_have_one_spelling() {
        assert_eq!(canon(json!({"n": 3})), canon(json!({"n": 3.0})));
        assert_eq!(canon(json!({"n": -0.0})), r#"{"n":0}"#);
        assert_eq!(canon(json!({"n": 0.1})), r#"{"n":1e-1}"#);
        assert_eq!(canon(json!({"n": -12})), r#"{"n":-12}"#);
        assert_eq!(canon(json!({"n": 1e100})), r#"{"n":1e100}"#);
        // 2^53 is past the exact-integer range, so it takes the scientific form.
        assert_eq!(
            canon(json!({"n": 9_007_199_254_740_992_u64})),
            r#"{"n":9.007199254740992e15}"#
        );
        assert_ne!(canon(json!({"n": 1})), canon(json!({"n": "1"})));
    }

    #[test]
    fn strings_escape_only_what_json_requires() {
        assert_eq!(
            canon(json!({"s": "a\"b\\c\nd\u{1}é"})),
            "{\"s\":\"a\\\"b\\\\c\\nd\\u0001é\"}"
        );
        // The output is JSON that parses back to the same value.
        let text = canon(json!({"s": "tab\there", "k\u{7f}": [1.5, -2]}));
        let back: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(back, json!({"s": "tab\there", "k\u{7f}": [1.5, -2]}));
    }

    #[test]
    fn non_finite_numbers_are_refused_by_path() {
        let mut params = struct_from_json(&json!({"rule": {"weights": [1, 2, 3]}})).unwrap();
        let Some(Kind::StructValue(rule)) =
            params.fields.get_mut("rule").and_then(|v| v.kind.as_mut())
        else {
            panic!("rule is an object");
        };
        let Some(Kind::ListValue(weights)) =
            rule.fields.get_mut("weights").and_then(|v| v.kind.as_mut())
        else {
            panic!("weights is a list");
        };
        weights.values[2].kind = Some(Kind::NumberValue(f64::NAN));
        let err = canonical_json(&params).unwrap_err();
        assert_eq!(err.field, "parameters.rule.weights[2]");
    }

    #[test]
    fn hash_changes_with_any_parameter() {
        let a =
            parameters_hash(&struct_from_json(&json!({"rule": "r-17", "to": 3})).unwrap()).unwrap();
        let b =
            parameters_hash(&struct_from_json(&json!({"to": 3, "rule": "r-17"})).unwrap()).unwrap();
        let c =
            parameters_hash(&struct_from_json(&json!({"rule": "r-17", "to": 2})).unwrap()).unwrap();
        assert_eq!(a, b);
        assert_ne!(a, c);
        assert!(a.starts_with("sha256:") && a.len() == 7 + 64, "{a}");
    }
}
