//! The A2A gateway's input: a `SendMessageRequest` as the SDK parses it from JSON, and
//! the convene messages the gateway reads out of it (the join contract and limits
//! that tighten a template, a resumed run's input), validated as the supervisor does.

use a2a::{PartContent, SendMessageRequest};
use convene_core::validate;
use convene_gateway::handler::{JOIN_KEY, LIMITS_KEY};
use convene_proto::v1;
use serde_json::Value;

use crate::{fixtures, requests};

/// The SDK's parse of a `SendMessageRequest`, then what the gateway reads from it:
/// metadata `convene.join` and `convene.limits` (the request's, else the message's) in
/// the protobuf JSON mapping, validated as the supervisor validates a spec's join and
/// limits; and the `settle` / `follow_up` fields of the data parts as a resumed run's
/// input.
pub fn a2a_send_message(data: &[u8]) {
    if data.len() > crate::MAX_INPUT {
        return;
    }
    let Ok(req) = serde_json::from_slice::<SendMessageRequest>(data) else {
        return;
    };
    let now = fixtures::now();
    if let Some(value) = meta(&req, JOIN_KEY)
        && let Ok(join) = convene_proto::json::from_value::<v1::JoinContract>(value.clone())
    {
        requests::json_round_trip(&join);
        let _ = validate::join_contract(&join, now, "join");
    }
    if let Some(value) = meta(&req, LIMITS_KEY)
        && let Ok(limits) = convene_proto::json::from_value::<v1::Limits>(value.clone())
    {
        requests::json_round_trip(&limits);
        let _ = validate::limits(Some(&limits), now, "limits");
    }
    for part in &req.message.parts {
        let PartContent::Data(Value::Object(fields)) = &part.content else {
            continue;
        };
        if let Some(value) = fields.get("settle")
            && let Ok(settle) = convene_proto::json::from_value::<v1::SettleConflict>(value.clone())
        {
            requests::json_round_trip(&settle);
        }
        if let Some(value) = fields.get("follow_up")
            && let Ok(follow_up) = convene_proto::json::from_value::<v1::FollowUp>(value.clone())
        {
            requests::json_round_trip(&follow_up);
        }
    }
}

/// The value of `key` in the request's metadata, else in the message's.
fn meta<'a>(req: &'a SendMessageRequest, key: &str) -> Option<&'a Value> {
    req.metadata
        .as_ref()
        .and_then(|m| m.get(key))
        .or_else(|| req.message.metadata.as_ref().and_then(|m| m.get(key)))
}
