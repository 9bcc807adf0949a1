//! The evidence view: a piece of evidence a claim cites, the artifact it rests on, the
//! artifact's hash checked again on request (VerifyChain with the bytes re-hashed), and
//! the artifact's bytes as text or JSON up to [`MAX_SHOWN_BYTES`].

use std::sync::Arc;

use axum::extract::{Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use convene_proto::v1;
use maud::{Markup, html};

use super::pages::{layout, time};
use super::{Console, Signed, page};

/// Artifact bytes shown at most; longer ones are cut, and the page says so.
pub const MAX_SHOWN_BYTES: usize = 64 * 1024;

/// Which evidence, and whether to check its artifact's hash now.
#[derive(Debug, Default, serde::Deserialize)]
pub struct Which {
    /// The evidence id (a claim's evidence reference).
    #[serde(default)]
    pub id: String,
    /// `1`: re-hash the artifact's bytes and say whether they still match.
    #[serde(default)]
    pub verify: String,
}

/// `GET /console/evidence?id=...[&verify=1]`.
pub async fn show(
    State(console): State<Arc<Console>>,
    signed: Signed,
    Query(which): Query<Which>,
) -> Response {
    let session = &signed.session;
    let got = console
        .evidence
        .get_evidence(console.request(
            session,
            v1::GetEvidenceRequest {
                evidence_ids: vec![which.id.clone()],
            },
        ))
        .await;
    let evidence = match got {
        Ok(got) => got.into_inner().evidence.into_iter().next(),
        Err(status) => return console.refused(&status, session),
    };
    let Some(evidence) = evidence else {
        return page(
            StatusCode::NOT_FOUND,
            super::pages::problem(
                "Not found",
                &format!("evidence {} not found", which.id),
                Some(session),
            ),
        );
    };
    let verified = if which.verify == "1" {
        let checked = console
            .evidence
            .verify_chain(console.request(
                session,
                v1::VerifyChainRequest {
                    claims: vec![v1::ChainClaim {
                        claim_id: "console".to_owned(),
                        evidence_refs: vec![evidence.evidence_id.clone()],
                    }],
                    rehash_content: true,
                },
            ))
            .await;
        match checked {
            Ok(checked) => Some(checked.into_inner()),
            Err(status) => return console.refused(&status, session),
        }
    } else {
        None
    };
    let artifact = console
        .evidence
        .get_artifact(console.request(
            session,
            v1::GetArtifactRequest {
                uri: evidence.artifact_uri.clone(),
            },
        ))
        .await
        .map(tonic::Response::into_inner);
    evidence_page(&signed, &evidence, verified.as_ref(), artifact).into_response()
}

/// The artifact's bytes as people read them: pretty JSON, else text, cut to the limit.
fn shown(content: &[u8]) -> (String, bool) {
    let cut = content.len() > MAX_SHOWN_BYTES;
    let bytes = &content[..content.len().min(MAX_SHOWN_BYTES)];
    if !cut && let Ok(value) = serde_json::from_slice::<serde_json::Value>(bytes) {
        return (
            serde_json::to_string_pretty(&value).unwrap_or_default(),
            false,
        );
    }
    (String::from_utf8_lossy(bytes).into_owned(), cut)
}

fn evidence_page(
    signed: &Signed,
    evidence: &v1::Evidence,
    verified: Option<&v1::VerifyChainResponse>,
    artifact: Result<v1::GetArtifactResponse, tonic::Status>,
) -> Markup {
    let verify_link = format!(
        "/console/evidence?{}",
        url::form_urlencoded::Serializer::new(String::new())
            .append_pair("id", &evidence.evidence_id)
            .append_pair("verify", "1")
            .finish()
    );
    layout(
        "Evidence",
        Some(&signed.session),
        &html! {
            h1 { "Evidence " code { (evidence.evidence_id) } }
            dl.summary {
                dt { "Kind" } dd {
                    (evidence.kind)
                    @if evidence.kind_defaulted { " (its tool's default: the call named no kind)" }
                }
                dt { "Source" } dd { (evidence.source) }
                dt { "Observed" } dd { (time(evidence.observed_at.as_ref())) }
                dt { "Delegation" } dd { code { (evidence.delegation_id) } }
                dt { "Artifact" } dd { code { (evidence.artifact_uri) } }
                dt { "Recorded hash" } dd { code #content-hash { (evidence.content_hash) } }
            }
            @match verified {
                None => p { a href=(verify_link) { "Check the artifact's hash now" } },
                Some(checked) => {
                    @let link = checked.links.first();
                    @if checked.intact {
                        p.ok role="status" #verified { "Verified: the artifact's bytes hash to " code { (evidence.content_hash) } " now." }
                    } @else {
                        p.error role="alert" #verified {
                            "Not intact: "
                            (link.map_or("no link", |l| v1::LinkStatus::try_from(l.status).map_or("UNSPECIFIED", |s| s.as_str_name())))
                            @if let Some(l) = link { @if !l.detail.is_empty() { " — " (l.detail) } }
                        }
                    }
                }
            }
            h2 { "Artifact content" }
            @match artifact {
                Ok(got) => {
                    @let (text, cut) = shown(&got.content);
                    @if cut { p.hint { "The first " (MAX_SHOWN_BYTES / 1024) " KiB of " (got.content.len()) " bytes:" } }
                    pre { code { (text) } }
                }
                Err(status) => p.error role="alert" { "The artifact cannot be shown: " (status.message()) },
            }
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_is_pretty_text_is_text_and_long_content_is_cut() {
        let (json, cut) = shown(br#"{"a":1}"#);
        assert_eq!(json, "{\n  \"a\": 1\n}");
        assert!(!cut);
        let (text, cut) = shown(b"plain lines\nof log");
        assert_eq!(text, "plain lines\nof log");
        assert!(!cut);
        let long = vec![b'x'; MAX_SHOWN_BYTES + 10];
        let (text, cut) = shown(&long);
        assert_eq!(text.len(), MAX_SHOWN_BYTES);
        assert!(cut);
    }
}
