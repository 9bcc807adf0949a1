//! Who may call the gateway: a bearer in front of everything but the Agent Card.
//!
//! The credential is a principal's, as the gRPC API takes it. Missing → 401 with
//! `WWW-Authenticate: Bearer realm="convene"`; unknown → 401 with `error="invalid_token"`;
//! a principal without the role the operation needs → 403 with
//! `error="insufficient_scope"`, naming the role. Sending a message needs `runs:start`
//! (or `runs:resolve`, to answer a task that waits for input); reading tasks
//! `runs:read` or `runs:start`; cancelling `runs:start`.

use std::borrow::Cow;
use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use convene_mesh::policy_file::Policy;
use percent_encoding::percent_decode_str;
use serde_json::{Value, json};

/// The realm of the `WWW-Authenticate` challenge.
pub const REALM: &str = "convene";

/// What an A2A call does, for the role it needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Operation {
    /// SendMessage, SendStreamingMessage.
    Send,
    /// GetTask, ListTasks, SubscribeToTask and the rest.
    Read,
    /// CancelTask.
    Cancel,
}

impl Operation {
    /// The roles of which a caller needs one.
    pub fn roles(self) -> &'static [&'static str] {
        match self {
            Operation::Send => &["runs:start", "runs:resolve"],
            Operation::Read => &["runs:read", "runs:start"],
            Operation::Cancel => &["runs:start"],
        }
    }

    /// The operation of a JSON-RPC method.
    pub fn of_method(method: &str) -> Self {
        match method {
            "SendMessage" | "SendStreamingMessage" => Operation::Send,
            "CancelTask" => Operation::Cancel,
            _ => Operation::Read,
        }
    }

    /// The operation of an HTTP+JSON path (below the binding's mount), as the binding's
    /// router reads it: split into segments at the raw path's `/`, each segment
    /// percent-decoded once. So `/tasks/ID%3Acancel` is the cancel it is routed to,
    /// while `/tasks/ID%2Fcancel` stays one segment (task `ID/cancel`), as it is routed.
    pub fn of_path(path: &str) -> Self {
        let segments: Vec<Cow<'_, str>> = path
            .split('/')
            .map(|segment| percent_decode_str(segment).decode_utf8_lossy())
            .collect();
        let last = segments.last().map_or("", |s| s.as_ref());
        if segments.iter().any(|s| s.starts_with("message:")) {
            Operation::Send
        } else if last.ends_with(":cancel") || last == "cancel" {
            Operation::Cancel
        } else {
            Operation::Read
        }
    }
}

/// Which binding a refusal is written for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Binding {
    JsonRpc,
    Rest,
}

fn refusal(binding: Binding, status: StatusCode, challenge: String, message: &str) -> Response {
    let reason = if status == StatusCode::UNAUTHORIZED {
        "UNAUTHENTICATED"
    } else {
        "PERMISSION_DENIED"
    };
    let info = json!({
        "@type": a2a::ERROR_INFO_TYPE,
        "reason": reason,
        "domain": "convene.dev",
    });
    let body: Value = match binding {
        Binding::Rest => json!({
            "error": {"code": status.as_u16(), "status": reason, "message": message, "details": [info]}
        }),
        Binding::JsonRpc => json!({
            "jsonrpc": "2.0",
            "id": Value::Null,
            "error": {"code": a2a::error_code::INVALID_REQUEST, "message": message, "data": [info]}
        }),
    };
    let mut response = (status, axum::Json(body)).into_response();
    if let Ok(value) = HeaderValue::from_str(&challenge) {
        response
            .headers_mut()
            .insert(header::WWW_AUTHENTICATE, value);
    }
    response
}

/// The caller's principal, or the 401 to answer.
fn authenticate<'p>(
    policy: &'p Policy,
    request: &Request,
    binding: Binding,
) -> Result<&'p convene_mesh::policy_file::Principal, Response> {
    let value = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok());
    let Some(value) = value else {
        return Err(refusal(
            binding,
            StatusCode::UNAUTHORIZED,
            format!("Bearer realm=\"{REALM}\""),
            "missing `Authorization: Bearer <credential>`: pass a convene principal credential",
        ));
    };
    let credential = value
        .strip_prefix("Bearer ")
        .or_else(|| value.strip_prefix("bearer "))
        .map(str::trim)
        .unwrap_or_default();
    policy.principal_by_credential(credential).ok_or_else(|| {
        refusal(
            binding,
            StatusCode::UNAUTHORIZED,
            format!("Bearer realm=\"{REALM}\", error=\"invalid_token\""),
            "unknown credential: pass `Authorization: Bearer <credential>` with a principal credential the policy file lists",
        )
    })
}

fn authorize(
    principal: &convene_mesh::policy_file::Principal,
    operation: Operation,
    binding: Binding,
) -> Result<(), Response> {
    let roles = operation.roles();
    if roles.iter().any(|r| principal.has_role(r)) {
        return Ok(());
    }
    Err(refusal(
        binding,
        StatusCode::FORBIDDEN,
        format!("Bearer realm=\"{REALM}\", error=\"insufficient_scope\""),
        &format!(
            "principal {} lacks the role to {} (one of {}); add it to the principal's roles in the policy file",
            principal.id,
            match operation {
                Operation::Send => "send messages",
                Operation::Read => "read tasks",
                Operation::Cancel => "cancel tasks",
            },
            roles.join(", ")
        ),
    ))
}

/// The access check of the HTTP+JSON binding.
pub async fn rest_access(
    State(policy): State<Arc<Policy>>,
    request: Request,
    next: Next,
) -> Response {
    let principal = match authenticate(&policy, &request, Binding::Rest) {
        Ok(p) => p,
        Err(refusal) => return refusal,
    };
    if let Err(refusal) = authorize(
        principal,
        Operation::of_path(request.uri().path()),
        Binding::Rest,
    ) {
        return refusal;
    }
    next.run(request).await
}

/// The access check of the JSON-RPC binding: the method is read from the body, which is
/// handed on unchanged.
pub async fn jsonrpc_access(
    State(policy): State<Arc<Policy>>,
    request: Request,
    next: Next,
) -> Response {
    let principal = match authenticate(&policy, &request, Binding::JsonRpc) {
        Ok(p) => p.clone(),
        Err(refusal) => return refusal,
    };
    let (parts, body) = request.into_parts();
    let bytes = match axum::body::to_bytes(body, a2a_server::jsonrpc::MAX_REQUEST_BODY_BYTES).await
    {
        Ok(bytes) => bytes,
        Err(_) => {
            return (
                StatusCode::PAYLOAD_TOO_LARGE,
                format!(
                    "request body over {} bytes",
                    a2a_server::jsonrpc::MAX_REQUEST_BODY_BYTES
                ),
            )
                .into_response();
        }
    };
    // A body that is not JSON-RPC is left to the binding, which says what is wrong.
    let methods: Vec<String> = match serde_json::from_slice::<Value>(&bytes) {
        Ok(Value::Array(calls)) => calls
            .iter()
            .filter_map(|c| c.get("method").and_then(Value::as_str).map(str::to_owned))
            .collect(),
        Ok(call) => call
            .get("method")
            .and_then(Value::as_str)
            .map(str::to_owned)
            .into_iter()
            .collect(),
        Err(_) => Vec::new(),
    };
    for method in &methods {
        if let Err(refusal) = authorize(&principal, Operation::of_method(method), Binding::JsonRpc)
        {
            return refusal;
        }
    }
    next.run(Request::from_parts(parts, Body::from(bytes)))
        .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn operations_come_from_paths_and_methods() {
        assert_eq!(Operation::of_path("/message:send"), Operation::Send);
        assert_eq!(Operation::of_path("/v1/message:stream"), Operation::Send);
        assert_eq!(Operation::of_path("/tasks/abc:cancel"), Operation::Cancel);
        assert_eq!(Operation::of_path("/tasks/abc/cancel"), Operation::Cancel);
        assert_eq!(Operation::of_path("/tasks/abc"), Operation::Read);
        assert_eq!(Operation::of_path("/tasks"), Operation::Read);
        assert_eq!(Operation::of_path("/tasks/abc:subscribe"), Operation::Read);
    }

    #[test]
    fn paths_are_classified_as_the_router_decodes_them() {
        // `:` percent-encoded, either case: still the cancel the binding routes it to.
        for path in [
            "/tasks/abc%3Acancel",
            "/tasks/abc%3acancel",
            "/tasks/abc%3A%63ancel",
            "/tasks/%61bc%3Acancel",
        ] {
            assert_eq!(Operation::of_path(path), Operation::Cancel, "{path}");
        }
        assert_eq!(Operation::of_path("/message%3Asend"), Operation::Send);
        assert_eq!(Operation::of_path("/message%3astream"), Operation::Send);
        // Decoded once: `%253A` is the text `%3A`, a task id, not a cancel.
        assert_eq!(Operation::of_path("/tasks/abc%253Acancel"), Operation::Read);
        // `%2F` does not split a segment: `abc/cancel` is one task id, read.
        assert_eq!(Operation::of_path("/tasks/abc%2Fcancel"), Operation::Read);
        assert_eq!(Operation::of_path("/tasks/abc%2fcancel"), Operation::Read);
        // ... unless the id itself ends the way a cancel does.
        assert_eq!(
            Operation::of_path("/tasks/abc%2Fx%3Acancel"),
            Operation::Cancel
        );
        assert_eq!(Operation::of_path("/tasks/abc/%63ancel"), Operation::Cancel);
        assert_eq!(
            Operation::of_method("SendStreamingMessage"),
            Operation::Send
        );
        assert_eq!(Operation::of_method("CancelTask"), Operation::Cancel);
        assert_eq!(Operation::of_method("ListTasks"), Operation::Read);
    }
}
