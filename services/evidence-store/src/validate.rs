//! Checks of the Evidence Contract fields a writer sets, and the fields the store sets
//! itself (tenant and delegation from the token, never from the message).

use convene_core::FieldPath;
use convene_core::permissions::{Pattern, time_window_from_proto};
use convene_core::time::from_timestamp;
use convene_proto::v1;
use convene_tokens::Claims;

use crate::Error;
use crate::artifacts::{ArtifactRef, is_sha256_hex};

/// Longest evidence id accepted.
pub const MAX_EVIDENCE_ID_LEN: usize = 2048;

/// Longest short text field (kind, tool call id).
const MAX_SHORT_LEN: usize = 256;

/// Longest source name.
const MAX_SOURCE_LEN: usize = 1024;

/// Most resource selectors in an evidence scope.
const MAX_SCOPE_RESOURCES: usize = 256;

/// The record to store: `evidence` checked, with tenant and delegation taken from
/// `claims`. With `stored` (PutArtifact), an empty `artifact_uri` / `content_hash` is
/// filled from the artifact of the same call and a set one must name it; without it
/// (RecordEvidence) both are required.
pub(crate) fn evidence(
    mut e: v1::Evidence,
    field: &str,
    claims: &Claims,
    stored: Option<&ArtifactRef>,
) -> Result<v1::Evidence, Error> {
    let root = FieldPath::new(field);
    let at = |name: &'static str| root.at(name);
    evidence_id(&e.evidence_id, &at("evidence_id"))?;
    short(&e.kind, MAX_SHORT_LEN, &at("kind"))?;
    short(&e.source, MAX_SOURCE_LEN, &at("source"))?;
    short(&e.tool_call_id, MAX_SHORT_LEN, &at("tool_call_id"))?;
    if !e.query_fingerprint.is_empty() && !is_content_hash(&e.query_fingerprint) {
        return Err(Error::invalid(
            at("query_fingerprint"),
            "must be `sha256:<64 lowercase hex digits>` (the SHA-256 of the normalized query), \
             or empty",
        ));
    }
    if !e.trace_id.is_empty() && !is_trace_id(&e.trace_id) {
        return Err(Error::invalid(
            at("trace_id"),
            "must be a W3C trace id (32 lowercase hex digits), or empty",
        ));
    }
    if v1::EvidenceQuality::try_from(e.quality).is_err() {
        return Err(Error::invalid(
            at("quality"),
            format!("unknown value {}; use PASSED or DEGRADED", e.quality),
        ));
    }
    if let Some(observed) = &e.observed_at {
        from_timestamp(observed, &at("observed_at"))?;
    }
    if let Some(scope) = &e.scope {
        task_scope(scope, &at("scope"))?;
    }

    match stored {
        Some(artifact) => {
            let uri = artifact.uri();
            let hash = artifact.content_hash();
            if e.artifact_uri.is_empty() {
                e.artifact_uri = uri;
            } else if e.artifact_uri != uri {
                return Err(Error::FailedPrecondition(format!(
                    "{field}.artifact_uri is {}, but this call stores {uri}; leave it empty to \
                     cite the stored artifact",
                    e.artifact_uri
                )));
            }
            if e.content_hash.is_empty() {
                e.content_hash = hash;
            } else if e.content_hash != hash {
                return Err(Error::FailedPrecondition(format!(
                    "{field}.content_hash is {}, but the stored bytes hash to {hash}; leave it \
                     empty or send the hash of these bytes",
                    e.content_hash
                )));
            }
        }
        None => {
            if e.artifact_uri.is_empty() {
                return Err(Error::invalid(
                    at("artifact_uri"),
                    "must name the artifact holding the raw output \
                     (artifact://<tenant>/<sha256>); store it with PutArtifact first",
                ));
            }
            if !is_content_hash(&e.content_hash) {
                return Err(Error::invalid(
                    at("content_hash"),
                    "must be the artifact's `sha256:<64 lowercase hex digits>`",
                ));
            }
        }
    }
    e.tenant.clone_from(&claims.tenant);
    e.delegation_id.clone_from(&claims.delegation_id);
    Ok(e)
}

/// An evidence id is a URI under its source: `scheme://rest`, the scheme a letter then
/// letters, digits, `+`, `-` or `.`, nothing empty, no whitespace or control characters.
fn evidence_id(id: &str, field: &FieldPath<'_>) -> Result<(), Error> {
    let example = "e.g. logs://payment-api/q-7bc1e2";
    if id.is_empty() {
        return Err(Error::invalid(
            field,
            format!("must not be empty: name the evidence as a URI under its source, {example}"),
        ));
    }
    if id.len() > MAX_EVIDENCE_ID_LEN {
        return Err(Error::invalid(
            field,
            format!("is {} bytes; at most {MAX_EVIDENCE_ID_LEN}", id.len()),
        ));
    }
    let well_formed = id.split_once("://").is_some_and(|(scheme, rest)| {
        scheme.starts_with(|c: char| c.is_ascii_alphabetic())
            && scheme
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.'))
            && !rest.is_empty()
    }) && !id.chars().any(|c| c.is_whitespace() || c.is_control());
    if !well_formed {
        return Err(Error::invalid(
            field,
            format!("`{id}` must look like scheme://..., {example}"),
        ));
    }
    Ok(())
}

fn short(value: &str, max: usize, field: &FieldPath<'_>) -> Result<(), Error> {
    if value.len() > max {
        return Err(Error::invalid(
            field,
            format!("is {} bytes; at most {max}", value.len()),
        ));
    }
    Ok(())
}

fn task_scope(scope: &v1::TaskScope, field: &FieldPath<'_>) -> Result<(), Error> {
    if scope.resources.len() > MAX_SCOPE_RESOURCES {
        return Err(Error::invalid(
            field.at("resources"),
            format!(
                "{} selectors; at most {MAX_SCOPE_RESOURCES}",
                scope.resources.len()
            ),
        ));
    }
    for (i, r) in scope.resources.iter().enumerate() {
        Pattern::parse(r).map_err(|m| Error::invalid(field.at("resources").nth(i), m))?;
    }
    if let Some(tr) = &scope.time_range {
        time_window_from_proto(tr, &field.at("time_range"))?;
    }
    Ok(())
}

/// Whether `s` is a W3C trace id: 32 lowercase hex digits.
fn is_trace_id(s: &str) -> bool {
    s.len() == 32 && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

/// Whether `s` is `sha256:<64 lowercase hex digits>`.
pub(crate) fn is_content_hash(s: &str) -> bool {
    s.strip_prefix("sha256:").is_some_and(is_sha256_hex)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn evidence_ids_must_be_uris() {
        for good in [
            "logs://payment-api/q-7bc1e2",
            "metrics+v2://x",
            "changes://r/7",
        ] {
            assert!(evidence_id(good, &FieldPath::new("id")).is_ok(), "{good}");
        }
        for bad in ["", "logs:/x", "://x", "1logs://x", "logs://", "logs://a b"] {
            let err = evidence_id(bad, &FieldPath::new("evidence.evidence_id")).unwrap_err();
            assert!(
                err.to_string().starts_with("invalid evidence.evidence_id"),
                "{bad}: {err}"
            );
        }
    }

    #[test]
    fn content_hashes_are_lowercase_sha256() {
        let hash = convene_core::ids::content_hash(b"x");
        assert!(is_content_hash(&hash));
        assert!(!is_content_hash(&hash.to_uppercase()));
        assert!(!is_content_hash("sha1:abc"));
    }
}
