//! Canonical protobuf JSON mapping for convene messages, via the descriptor pool.
//!
//! The same mapping every other language's generated stubs use (lowerCamelCase field
//! names, enums by name, RFC 3339 timestamps, `"30s"` durations), so a `--json` output
//! or a YAML run spec means the same thing to a Go or Python client.

use std::sync::OnceLock;

use prost::Message;
use prost_reflect::{DescriptorPool, DynamicMessage, MessageDescriptor};

/// Errors converting between messages and JSON.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The message type is not part of the convene descriptor set.
    #[error("unknown message type {0}")]
    UnknownType(String),
    /// The JSON does not fit the message (unknown field, wrong type, bad enum name...).
    #[error("{0}")]
    Json(#[from] serde_json::Error),
    /// Encoding or decoding the protobuf bytes failed.
    #[error("protobuf: {0}")]
    Decode(#[from] prost::DecodeError),
}

fn pool() -> &'static DescriptorPool {
    static POOL: OnceLock<DescriptorPool> = OnceLock::new();
    POOL.get_or_init(|| {
        DescriptorPool::decode(crate::FILE_DESCRIPTOR_SET)
            .expect("the descriptor set generated at build time decodes")
    })
}

/// A generated message type with a known protobuf full name.
pub trait Named: Message + Default {
    /// Full protobuf name, e.g. `convene.v1.RunSpec`.
    fn full_name() -> String;
}

fn descriptor<T: Named>() -> Result<MessageDescriptor, Error> {
    let name = T::full_name();
    pool()
        .get_message_by_name(&name)
        .ok_or(Error::UnknownType(name))
}

/// Serializes a message into a JSON value in the protobuf JSON mapping.
pub fn to_value<T: Named>(msg: &T) -> Result<serde_json::Value, Error> {
    let desc = descriptor::<T>()?;
    let dynamic = DynamicMessage::decode(desc, msg.encode_to_vec().as_slice())?;
    let options = prost_reflect::SerializeOptions::new().skip_default_fields(true);
    Ok(dynamic.serialize_with_options(serde_json::value::Serializer, &options)?)
}

/// Serializes a message into a compact JSON string in the protobuf JSON mapping.
pub fn to_string<T: Named>(msg: &T) -> Result<String, Error> {
    Ok(serde_json::to_string(&to_value(msg)?)?)
}

/// Parses a message from a JSON value in the protobuf JSON mapping. Unknown fields are
/// refused, naming the field.
pub fn from_value<T: Named>(value: serde_json::Value) -> Result<T, Error> {
    let desc = descriptor::<T>()?;
    let dynamic = DynamicMessage::deserialize(desc, value)?;
    Ok(T::decode(dynamic.encode_to_vec().as_slice())?)
}

/// Converts JSON into a protobuf `Struct`, losing nothing: an object's members become the
/// fields, and any other value is kept as the one field `value` (`{"value": …}`).
pub fn to_struct(value: &serde_json::Value) -> prost_types::Struct {
    match value {
        serde_json::Value::Object(map) => prost_types::Struct {
            fields: map
                .iter()
                .map(|(k, v)| (k.clone(), to_proto_value(v)))
                .collect(),
        },
        other => prost_types::Struct {
            fields: [("value".to_owned(), to_proto_value(other))]
                .into_iter()
                .collect(),
        },
    }
}

/// Converts a protobuf `Struct` back into a JSON object. Integral numbers below 2^53
/// come back as JSON integers, since counts and revisions went in as integers.
pub fn from_struct(s: &prost_types::Struct) -> serde_json::Value {
    serde_json::Value::Object(
        s.fields
            .iter()
            .map(|(k, v)| (k.clone(), from_proto_value(v)))
            .collect(),
    )
}

/// One JSON value as a protobuf `Value`.
pub fn to_proto_value(value: &serde_json::Value) -> prost_types::Value {
    use prost_types::value::Kind;
    let kind = match value {
        serde_json::Value::Null => Kind::NullValue(0),
        serde_json::Value::Bool(b) => Kind::BoolValue(*b),
        // Without serde_json's arbitrary precision every number has an f64 form.
        serde_json::Value::Number(n) => Kind::NumberValue(n.as_f64().unwrap_or(f64::NAN)),
        serde_json::Value::String(s) => Kind::StringValue(s.clone()),
        serde_json::Value::Array(items) => Kind::ListValue(prost_types::ListValue {
            values: items.iter().map(to_proto_value).collect(),
        }),
        serde_json::Value::Object(_) => Kind::StructValue(to_struct(value)),
    };
    prost_types::Value { kind: Some(kind) }
}

/// One protobuf `Value` as JSON; a value without a kind is `null`, as is a number
/// JSON cannot hold (NaN, infinity).
pub fn from_proto_value(value: &prost_types::Value) -> serde_json::Value {
    use prost_types::value::Kind;
    match &value.kind {
        None | Some(Kind::NullValue(_)) => serde_json::Value::Null,
        Some(Kind::BoolValue(b)) => serde_json::Value::Bool(*b),
        Some(Kind::NumberValue(n)) => {
            #[allow(clippy::float_cmp)]
            let integral = n.fract() == 0.0 && n.abs() < 9.0e15;
            if integral {
                #[allow(clippy::cast_possible_truncation)]
                serde_json::Value::from(*n as i64)
            } else {
                serde_json::Number::from_f64(*n).map_or(serde_json::Value::Null, Into::into)
            }
        }
        Some(Kind::StringValue(s)) => serde_json::Value::String(s.clone()),
        Some(Kind::ListValue(l)) => {
            serde_json::Value::Array(l.values.iter().map(from_proto_value).collect())
        }
        Some(Kind::StructValue(s)) => from_struct(s),
    }
}

macro_rules! named {
    ($($ty:ident),* $(,)?) => {
        $(impl Named for crate::v1::$ty {
            fn full_name() -> String { concat!("convene.v1.", stringify!($ty)).to_owned() }
        })*
    };
}

named!(
    RunSpec,
    Run,
    RunEvent,
    Limits,
    JoinContract,
    JoinDecision,
    DelegationTask,
    PlannedDelegation,
    TaskResult,
    Claim,
    Evidence,
    Artifact,
    WorkerProfile,
    CloudEvent,
    ApprovalRequest,
    PermissionScope,
    StartRunResponse,
    GetRunResponse,
    ListRunsResponse,
    ListApprovalsResponse,
    VerifyChainResponse,
    RunAction,
    SettleConflict,
    FollowUp,
);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::v1::{JoinContract, JoinStrategy, RunSpec};

    #[test]
    fn run_spec_round_trips_through_json_mapping() {
        let spec = RunSpec {
            goal: "find the cause".into(),
            join: Some(JoinContract {
                strategy: JoinStrategy::TimeoutPartial as i32,
                timeout: Some(prost_types::Duration {
                    seconds: 30,
                    nanos: 0,
                }),
                ..Default::default()
            }),
            ..Default::default()
        };
        let value = to_value(&spec).unwrap();
        assert_eq!(value["join"]["strategy"], "JOIN_STRATEGY_TIMEOUT_PARTIAL");
        assert_eq!(value["join"]["timeout"], "30s");
        let back: RunSpec = from_value(value).unwrap();
        assert_eq!(back, spec);
    }

    #[test]
    fn unknown_field_is_named() {
        let err = from_value::<RunSpec>(serde_json::json!({"goal": "x", "gaol": "y"}))
            .unwrap_err()
            .to_string();
        assert!(err.contains("gaol"), "{err}");
    }

    #[test]
    fn objects_round_trip_through_struct() {
        let json = serde_json::json!({
            "count": 3, "ratio": 0.25, "name": "pool", "ok": true, "none": null,
            "list": [1, "two", {"three": 3}], "nested": {"deep": [false]}
        });
        let back = from_struct(&to_struct(&json));
        assert_eq!(back, json);
    }

    #[test]
    fn a_non_object_is_kept_as_value() {
        for json in [
            serde_json::json!([1, 2]),
            serde_json::json!("text"),
            serde_json::json!(7),
            serde_json::json!(null),
        ] {
            let s = to_struct(&json);
            assert_eq!(s.fields.len(), 1, "{json}");
            assert_eq!(from_struct(&s), serde_json::json!({ "value": json }));
        }
    }

    #[test]
    fn numbers_json_cannot_hold_become_null() {
        let nan = prost_types::Value {
            kind: Some(prost_types::value::Kind::NumberValue(f64::NAN)),
        };
        assert_eq!(from_proto_value(&nan), serde_json::Value::Null);
        let half = prost_types::Value {
            kind: Some(prost_types::value::Kind::NumberValue(0.5)),
        };
        assert_eq!(from_proto_value(&half), serde_json::json!(0.5));
    }
}
