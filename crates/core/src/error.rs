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
    /// A value lies outside what is allowed here (prefix, scope, tool).
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
