//! The one error type of validation: which field, which rule, and what to do.

use std::fmt;

/// The rule a field broke. Stable and machine-readable; the message says the rest.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Rule {
    /// A required field is missing or empty.
    Required,
    /// A value does not have the expected format (name, URI, pattern, hash).
    Format,
    /// A number is outside its allowed range.
    Range,
    /// A deadline or time lies in the past.
    InPast,
    /// An enum carries a value this version does not know.
    UnknownEnum,
    /// A value appears twice where it must be unique.
    Duplicate,
    /// Two fields that exclude each other are both set.
    Exclusive,
    /// A reference names something that does not exist (a delegation, a profile).
    UnknownReference,
    /// A value lies outside what is allowed here (prefix, scope, tool), or a field is set
    /// that this kind of message does not take (a planner's run's delegation references).
    NotAllowed,
    /// A list or string is longer than allowed.
    TooLong,
    /// The feature the field asks for is not supported by this version.
    Unsupported,
}

impl Rule {
    /// Short stable name of the rule, e.g. `required`.
    pub fn as_str(self) -> &'static str {
        match self {
            Rule::Required => "required",
            Rule::Format => "format",
            Rule::Range => "range",
            Rule::InPast => "in_past",
            Rule::UnknownEnum => "unknown_enum",
            Rule::Duplicate => "duplicate",
            Rule::Exclusive => "exclusive",
            Rule::UnknownReference => "unknown_reference",
            Rule::NotAllowed => "not_allowed",
            Rule::TooLong => "too_long",
            Rule::Unsupported => "unsupported",
        }
    }
}

/// The path of a field being checked, built as validation descends into a message and
/// formatted only when something prints it: an error's `field`, mostly. Checking a valid
/// message therefore formats no path at all.
///
/// ```
/// use convene_core::FieldPath;
/// let spec = FieldPath::new("spec");
/// let delegations = spec.at("delegations");
/// let first = delegations.nth(0);
/// assert_eq!(first.at("goal").to_string(), "spec.delegations[0].goal");
/// assert_eq!(FieldPath::new("").at("goal").to_string(), "goal");
/// ```
#[derive(Clone, Copy)]
pub struct FieldPath<'a>(Segment<'a>);

#[derive(Clone, Copy)]
enum Segment<'a> {
    /// A path given as text (empty at a message's root).
    Text(&'a str),
    /// A path of any printable kind, e.g. one a caller built its own way.
    Shown(&'a dyn fmt::Display),
    /// `parent.name`, or `name` under an empty text root.
    Name(&'a FieldPath<'a>, &'a str),
    /// `parent[i]`.
    Index(&'a FieldPath<'a>, usize),
    /// `parent["key"]`, quoted so any key stays unambiguous.
    Key(&'a FieldPath<'a>, &'a str),
}

impl<'a> FieldPath<'a> {
    /// A path given as text, e.g. `spec`; empty for a message's root.
    pub const fn new(path: &'a str) -> Self {
        Self(Segment::Text(path))
    }

    /// A path printed by `path` (anything `Display`, e.g. another crate's path type).
    pub const fn shown(path: &'a dyn fmt::Display) -> Self {
        Self(Segment::Shown(path))
    }

    /// The field `name` of this message: `self.name`.
    pub const fn at(&'a self, name: &'a str) -> Self {
        Self(Segment::Name(self, name))
    }

    /// Element `i` of this list: `self[i]`.
    pub const fn nth(&'a self, i: usize) -> Self {
        Self(Segment::Index(self, i))
    }

    /// Entry `key` of this map: `self["key"]`.
    pub const fn key(&'a self, key: &'a str) -> Self {
        Self(Segment::Key(self, key))
    }

    /// The path's last name, without indices: `spec.join.weights["a"]` → `weights`.
    pub fn leaf(&self) -> String {
        match self.0 {
            Segment::Name(_, name) => name.to_owned(),
            Segment::Index(parent, _) | Segment::Key(parent, _) => parent.leaf(),
            Segment::Text(_) | Segment::Shown(_) => {
                let path = self.to_string();
                let last = path.rsplit('.').next().unwrap_or(&path);
                last.split('[').next().unwrap_or(last).to_owned()
            }
        }
    }

    fn is_empty_text(&self) -> bool {
        matches!(self.0, Segment::Text(""))
    }
}

impl fmt::Display for FieldPath<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Segment::Text(path) => f.write_str(path),
            Segment::Shown(path) => path.fmt(f),
            Segment::Name(parent, name) if parent.is_empty_text() => f.write_str(name),
            Segment::Name(parent, name) => write!(f, "{parent}.{name}"),
            Segment::Index(parent, i) => write!(f, "{parent}[{i}]"),
            Segment::Key(parent, key) => write!(f, "{parent}[{key:?}]"),
        }
    }
}

impl fmt::Debug for FieldPath<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "FieldPath({:?})", self.to_string())
    }
}

impl From<FieldPath<'_>> for String {
    fn from(path: FieldPath<'_>) -> Self {
        path.to_string()
    }
}

impl From<&FieldPath<'_>> for String {
    fn from(path: &FieldPath<'_>) -> Self {
        path.to_string()
    }
}

/// An invalid field: its path (e.g. `spec.join.required[1]`), the rule, and a message that
/// tells the caller what to fix.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub struct ValidationError {
    /// Path of the field from the message root, e.g. `spec.delegations[0].goal`.
    pub field: String,
    /// The rule it broke.
    pub rule: Rule,
    /// What is wrong and what to do about it.
    pub message: String,
}

impl ValidationError {
    /// A new error for `field`.
    pub fn new(field: impl Into<String>, rule: Rule, message: impl Into<String>) -> Self {
        Self {
            field: field.into(),
            rule,
            message: message.into(),
        }
    }

    /// The same error with `prefix.` in front of its field path.
    #[must_use]
    pub fn within(mut self, prefix: &str) -> Self {
        self.field = if self.field.is_empty() {
            prefix.to_owned()
        } else if self.field.starts_with('[') {
            format!("{prefix}{}", self.field)
        } else {
            format!("{prefix}.{}", self.field)
        };
        self
    }
}

impl fmt::Display for ValidationError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}: {} ({})",
            self.field,
            self.message,
            self.rule.as_str()
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn display_names_field_and_rule() {
        let e = ValidationError::new("goal", Rule::Required, "the goal must not be empty")
            .within("spec");
        assert_eq!(e.field, "spec.goal");
        assert_eq!(
            e.to_string(),
            "spec.goal: the goal must not be empty (required)"
        );
        let e = ValidationError::new("[2].name", Rule::Duplicate, "x").within("delegations");
        assert_eq!(e.field, "delegations[2].name");
    }
}
