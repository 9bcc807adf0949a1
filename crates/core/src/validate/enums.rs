//! Wire enums: unspecified, known and unknown values, and the list of known names an
//! error message offers.

use convene_proto::v1;

use super::{join_list, leaf};
use crate::model;
use crate::{FieldPath, Rule, ValidationError};

/// A wire enum: its known values (for messages) and its domain counterpart.
pub(super) trait WireEnum: Copy + TryFrom<i32> + 'static {
    /// The validated value.
    type Domain;
    /// Every specified value, in wire order.
    const KNOWN: &'static [Self];
    /// The wire name, e.g. `JOIN_STRATEGY_ALL`.
    fn name(self) -> &'static str;
    /// The domain value; `None` for UNSPECIFIED.
    fn domain(self) -> Option<Self::Domain>;
}

macro_rules! wire_enum {
    ($wire:ident => $domain:ty { $($variant:ident => $value:expr),+ $(,)? }) => {
        impl WireEnum for v1::$wire {
            type Domain = $domain;
            const KNOWN: &'static [Self] = &[$(v1::$wire::$variant),+];
            fn name(self) -> &'static str {
                self.as_str_name()
            }
            fn domain(self) -> Option<$domain> {
                match self {
                    v1::$wire::Unspecified => None,
                    $(v1::$wire::$variant => Some($value),)+
                }
            }
        }
    };
}

wire_enum!(JoinStrategy => model::JoinStrategy {
    All => model::JoinStrategy::All,
    Quorum => model::JoinStrategy::Quorum,
    TimeoutPartial => model::JoinStrategy::TimeoutPartial,
    FirstValid => model::JoinStrategy::FirstValid,
});
wire_enum!(OnTimeout => model::OnTimeout {
    EmitPartial => model::OnTimeout::EmitPartial,
    Fail => model::OnTimeout::Fail,
});
wire_enum!(OnConflict => model::OnConflict {
    PreserveAndEscalate => model::OnConflict::PreserveAndEscalate,
    FollowUp => model::OnConflict::FollowUp,
});
wire_enum!(LateResultPolicy => model::LateResultPolicy {
    Discard => model::LateResultPolicy::Discard,
    AppendRevision => model::LateResultPolicy::AppendRevision,
});
wire_enum!(OverflowPolicy => model::Overflow {
    Queue => model::Overflow::Queue,
    Truncate => model::Overflow::Truncate,
    Reject => model::Overflow::Reject,
});
wire_enum!(TaskStatus => v1::TaskStatus {
    Completed => v1::TaskStatus::Completed,
    Partial => v1::TaskStatus::Partial,
    Blocked => v1::TaskStatus::Blocked,
    Failed => v1::TaskStatus::Failed,
    TimedOut => v1::TaskStatus::TimedOut,
});

/// `Ok(None)` for UNSPECIFIED, the domain value for a known one, UnknownEnum otherwise.
pub(super) fn enum_value<E: WireEnum>(
    raw: i32,
    field: &FieldPath<'_>,
) -> Result<Option<E::Domain>, ValidationError> {
    match E::try_from(raw) {
        Ok(v) => Ok(v.domain()),
        Err(_) => Err(ValidationError::new(
            field,
            Rule::UnknownEnum,
            format!(
                "unknown {} {raw}; expected one of {}",
                leaf(field),
                expected::<E>()
            ),
        )),
    }
}

pub(super) fn required_enum<E: WireEnum>(
    raw: i32,
    field: &FieldPath<'_>,
) -> Result<E::Domain, ValidationError> {
    enum_value::<E>(raw, field)?.ok_or_else(|| {
        ValidationError::new(
            field,
            Rule::Required,
            format!("set {} to one of {}", leaf(field), expected::<E>()),
        )
    })
}

pub(super) fn enum_or_default<E: WireEnum>(
    raw: i32,
    field: &FieldPath<'_>,
) -> Result<E::Domain, ValidationError>
where
    E::Domain: Default,
{
    Ok(enum_value::<E>(raw, field)?.unwrap_or_default())
}

pub(super) fn expected<E: WireEnum>() -> String {
    join_list(E::KNOWN.iter().map(|e| e.name()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn enum_lists_name_every_known_value() {
        assert_eq!(
            expected::<v1::JoinStrategy>(),
            "JOIN_STRATEGY_ALL, JOIN_STRATEGY_QUORUM, JOIN_STRATEGY_TIMEOUT_PARTIAL, \
             JOIN_STRATEGY_FIRST_VALID"
        );
        assert_eq!(
            enum_value::<v1::OverflowPolicy>(0, &FieldPath::new("o")),
            Ok(None)
        );
        assert_eq!(
            enum_value::<v1::OverflowPolicy>(2, &FieldPath::new("o")),
            Ok(Some(model::Overflow::Truncate))
        );
    }
}
