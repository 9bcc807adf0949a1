//! The `when` conditions of playbook rules: comparisons on a value found by a dotted
//! path in a tool's output (`{ path: matched, op: gt, value: 0 }`, or a list that must
//! all hold), and the path lookup itself, which templates share.

use std::cmp::Ordering;

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// One condition or a list that must all hold.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum When {
    /// One condition.
    One(Condition),
    /// Every condition must hold.
    All(Vec<Condition>),
}

impl When {
    /// The conditions, one or all.
    pub fn conditions(&self) -> &[Condition] {
        match self {
            When::One(c) => std::slice::from_ref(c),
            When::All(cs) => cs,
        }
    }
}

/// A condition on a tool output.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Condition {
    /// Dotted path into the output.
    pub path: String,
    /// Comparison.
    pub op: Op,
    /// Value compared with (for `exists`: whether the path must exist, default true).
    #[serde(default)]
    pub value: Value,
}

/// Comparison operators of conditions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Op {
    /// Greater than.
    Gt,
    /// Greater than or equal.
    Ge,
    /// Equal.
    Eq,
    /// Not equal (an absent value is not equal to anything).
    Ne,
    /// Less than.
    Lt,
    /// Less than or equal.
    Le,
    /// The path exists and is not null (or, with `value: false`, does not).
    Exists,
}

/// The value at a dotted `path` in `value`; numeric segments index arrays, and object
/// keys containing dots are matched greedily (the longest key that exists wins).
pub fn resolve<'a>(value: &'a Value, path: &str) -> Option<&'a Value> {
    fn walk<'a>(value: &'a Value, segments: &[&str]) -> Option<&'a Value> {
        let Some(first) = segments.first() else {
            return Some(value);
        };
        match value {
            Value::Array(items) => walk(items.get(first.parse::<usize>().ok()?)?, &segments[1..]),
            Value::Object(map) => (1..=segments.len()).rev().find_map(|n| {
                let key = segments[..n].join(".");
                map.get(&key).and_then(|v| walk(v, &segments[n..]))
            }),
            _ => None,
        }
    }
    let segments: Vec<&str> = path.split('.').collect();
    walk(value, &segments)
}

impl Condition {
    /// Whether the condition holds on `output`.
    pub fn holds(&self, output: &Value) -> bool {
        let got = resolve(output, &self.path).filter(|v| !v.is_null());
        match self.op {
            Op::Exists => got.is_some() == self.value.as_bool().unwrap_or(true),
            Op::Eq => got.is_some_and(|g| json_eq(g, &self.value)),
            Op::Ne => !got.is_some_and(|g| json_eq(g, &self.value)),
            Op::Gt | Op::Ge | Op::Lt | Op::Le => {
                let Some(ord) = got.and_then(|g| compare(g, &self.value)) else {
                    return false;
                };
                match self.op {
                    Op::Gt => ord == Ordering::Greater,
                    Op::Ge => ord != Ordering::Less,
                    Op::Lt => ord == Ordering::Less,
                    _ => ord != Ordering::Greater,
                }
            }
        }
    }
}

fn json_eq(a: &Value, b: &Value) -> bool {
    match (a.as_f64(), b.as_f64()) {
        (Some(x), Some(y)) => x == y,
        _ => a == b,
    }
}

fn compare(a: &Value, b: &Value) -> Option<Ordering> {
    match (a, b) {
        (Value::Number(x), Value::Number(y)) => x.as_f64()?.partial_cmp(&y.as_f64()?),
        (Value::String(x), Value::String(y)) => Some(x.cmp(y)),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::playbook::tests::output;

    #[test]
    fn paths_index_arrays_and_find_dotted_keys() {
        let out = output();
        assert_eq!(resolve(&out, "changes.0.rule_id"), Some(&json!("RC-4711")));
        assert_eq!(resolve(&out, "groups.risk.rule"), Some(&json!(2)));
        assert_eq!(resolve(&out, "changes.1.rule_id"), None);
        assert_eq!(resolve(&out, "changes.x"), None);
        assert_eq!(resolve(&out, "matched.deeper"), None);
    }

    fn cond(path: &str, op: Op, value: Value) -> Condition {
        Condition {
            path: path.into(),
            op,
            value,
        }
    }

    #[test]
    fn conditions_compare_numbers_strings_and_presence() {
        let out = output();
        assert!(cond("matched", Op::Gt, json!(0)).holds(&out));
        assert!(!cond("matched", Op::Gt, json!(116)).holds(&out));
        assert!(cond("matched", Op::Ge, json!(116)).holds(&out));
        assert!(cond("matched", Op::Eq, json!(116.0)).holds(&out));
        assert!(cond("matched", Op::Le, json!(116)).holds(&out));
        assert!(!cond("matched", Op::Lt, json!(116)).holds(&out));
        assert!(cond("groups.timeout", Op::Ne, json!(0)).holds(&out));
        assert!(cond("first_ts", Op::Lt, json!("2026-07-23T02:02:00Z")).holds(&out));
        assert!(cond("changes.0.rule_id", Op::Eq, json!("RC-4711")).holds(&out));
        assert!(cond("changes.0.rule_id", Op::Exists, Value::Null).holds(&out));
        assert!(!cond("nothing", Op::Exists, Value::Null).holds(&out));
        assert!(cond("nothing", Op::Exists, json!(false)).holds(&out));
        // An absent value is not greater than anything, and not equal to anything.
        assert!(!cond("groups.declined", Op::Gt, json!(0)).holds(&out));
        assert!(cond("groups.declined", Op::Ne, json!(0)).holds(&out));
        // Mixed types never compare.
        assert!(!cond("first_ts", Op::Gt, json!(1)).holds(&out));
    }
}
