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
}
