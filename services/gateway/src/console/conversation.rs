//! The conversation view: one delegation's conversation with its model, rebuilt from the
//! turns its worker stored as `model_turn` evidence by walking their hash chain
//! ([`convene_core::turns::walk`]); a chain that does not hold is shown as broken, at
//! the turn where it breaks.

use std::collections::HashMap;
use std::sync::Arc;

use axum::extract::{Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use convene_core::turns::{ChainBreak, Conversation, StoredTurn, chain_ids, walk_found};
use convene_proto::v1;
use maud::{Markup, html};

use super::pages::{layout, problem};
use super::{Console, Signed, page};

/// Characters of one message shown at most; longer ones are cut, and the page says so.
pub const MAX_SHOWN_CHARS: usize = 8 * 1024;

/// Which delegation of which run.
#[derive(Debug, Default, serde::Deserialize)]
pub struct Which {
    /// The run.
    #[serde(default)]
    pub run: String,
    /// The delegation.
    #[serde(default)]
    pub delegation: String,
}

/// `GET /console/conversation?run=...&delegation=...`.
pub async fn show(
    State(console): State<Arc<Console>>,
    signed: Signed,
    Query(which): Query<Which>,
) -> Response {
    let session = &signed.session;
    let run = match console
        .supervisor
        .get_run(console.request(
            session,
            v1::GetRunRequest {
                run_id: which.run.clone(),
            },
        ))
        .await
    {
        Ok(got) => got.into_inner().run,
        Err(status) => return console.refused(&status, session),
    };
    let found = run.as_ref().and_then(|run| {
        run.delegations.iter().find(|d| {
            d.task
                .as_ref()
                .is_some_and(|t| t.delegation_id == which.delegation)
        })
    });
    let (Some(delegation), Some(task)) = (found, found.and_then(|d| d.task.as_ref())) else {
        return page(
            StatusCode::NOT_FOUND,
            problem(
                "Not found",
                &format!("run {} has no delegation {}", which.run, which.delegation),
                Some(session),
            ),
        );
    };
    let turns = delegation
        .result
        .as_ref()
        .and_then(|r| r.usage.as_ref())
        .map_or(0, |u| u.iterations);
    let attempt = delegation.attempts.max(1);
    let ids = chain_ids(&task.run_id, &task.delegation_id, attempt, turns);
    let records = if ids.is_empty() {
        Vec::new()
    } else {
        match console
            .evidence
            .get_evidence(console.request(
                session,
                v1::GetEvidenceRequest {
                    evidence_ids: ids.clone(),
                },
            ))
            .await
        {
            Ok(got) => got.into_inner().evidence,
            Err(status) => return console.refused(&status, session),
        }
    };
    let mut stored = HashMap::new();
    for record in records {
        let bytes = match console
            .evidence
            .get_artifact(console.request(
                session,
                v1::GetArtifactRequest {
                    uri: record.artifact_uri.clone(),
                },
            ))
            .await
        {
            Ok(got) => got.into_inner().content,
            Err(status) => return console.refused(&status, session),
        };
        stored.insert(
            record.evidence_id.clone(),
            StoredTurn {
                evidence_id: record.evidence_id,
                content_hash: record.content_hash,
                bytes,
            },
        );
    }
    let walked = (!stored.is_empty()).then(|| walk_found(&ids, &stored));
    conversation_page(&signed, task, attempt, walked.as_ref()).into_response()
}

/// `text` cut to [`MAX_SHOWN_CHARS`], and whether it was.
fn shown(text: &str) -> (&str, bool) {
    match text.char_indices().nth(MAX_SHOWN_CHARS) {
        Some((at, _)) => (&text[..at], true),
        None => (text, false),
    }
}

fn conversation_page(
    signed: &Signed,
    task: &v1::DelegationTask,
    attempt: u32,
    walked: Option<&Result<Conversation, ChainBreak>>,
) -> Markup {
    let run_link = format!("/console/runs/{}", task.run_id);
    layout(
        "Conversation",
        Some(&signed.session),
        &html! {
            h1 { "Conversation of " (task.name) " (" (task.profile_id) ")" }
            p { "Delegation " code { (task.delegation_id) } " of run " a href=(run_link) { code { (task.run_id) } } ", attempt " (attempt) "." }
            @match walked {
                None => p #chain { "No model turns are stored for this delegation: it has no result yet, or its provider stores none (a playbook, a remote agent)." },
                Some(Err(broken)) => p.error role="alert" #chain { "The chain of turns breaks at " (broken.to_string()) "; the conversation cannot be shown." },
                Some(Ok(conversation)) => {
                    p.ok role="status" #chain { "Chain intact: " (conversation.turns) " turn(s), each chained to the one before by its hash." }
                    @if !conversation.tools.is_empty() {
                        p { "Tools offered: " @for (i, t) in conversation.tools.iter().enumerate() { @if i > 0 { ", " } code { (t) } } }
                    }
                    details { summary { "System prompt" } pre { (conversation.system) } }
                    ol.conversation {
                        @for m in &conversation.messages {
                            @let role = m["role"].as_str().unwrap_or("?");
                            li class={ "message message-" (role) } {
                                strong { (role) }
                                @if let Some(id) = m["tool_call_id"].as_str() { " (answers " code { (id) } ")" }
                                @let (text, cut) = shown(m["content"].as_str().unwrap_or_default());
                                @if !text.is_empty() { pre { (text) } }
                                @if cut { p.hint { "(cut to the first " (MAX_SHOWN_CHARS / 1024) "k characters)" } }
                                @for call in m["tool_calls"].as_array().into_iter().flatten() {
                                    p { "calls " code { (call["name"].as_str().unwrap_or("?")) } " " code { (call["arguments"].to_string()) } }
                                }
                            }
                        }
                    }
                }
            }
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_messages_are_cut_on_a_character_boundary() {
        let long = "é".repeat(MAX_SHOWN_CHARS + 5);
        let (text, cut) = shown(&long);
        assert!(cut);
        assert_eq!(text.chars().count(), MAX_SHOWN_CHARS);
        assert_eq!(shown("short"), ("short", false));
    }
}
