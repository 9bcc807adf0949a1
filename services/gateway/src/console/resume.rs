//! Settling a run that waits for people: choose a side of a conflict, ask for a
//! follow-up delegation, or close the run as it stands (`ResumeRun`, under the run's
//! current ticket, which the run page's forms carry). Needs `runs:resolve`; the
//! supervisor checks it.

use std::sync::Arc;

use axum::Form;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Redirect, Response};
use convene_proto::v1;
use maud::{Markup, html};

use super::{Console, Signed, check_csrf, page};

/// The forms a waiting run's page offers: a side of each conflict, a follow-up, close.
pub fn forms(run: &v1::Run, csrf: &str) -> Markup {
    let Some(ticket) = run.ticket.as_ref() else {
        return html! {};
    };
    if run.state != v1::RunState::WaitingInput as i32 {
        return html! {};
    }
    let action = format!("/console/runs/{}/resume", run.run_id);
    let hidden = html! {
        input type="hidden" name="csrf" value=(csrf);
        input type="hidden" name="ticket_id" value=(ticket.id);
        input type="hidden" name="ticket_version" value=(ticket.version);
    };
    let conflicts = run
        .decision
        .as_ref()
        .map(|d| d.conflicts.as_slice())
        .unwrap_or_default();
    html! {
        h2 { "Settle" }
        @for (i, conflict) in conflicts.iter().enumerate() {
            @if conflict.settlement.is_none() {
                form.settle method="post" action=(action) {
                    (hidden)
                    input type="hidden" name="kind" value="settle";
                    input type="hidden" name="topic" value=(conflict.topic);
                    fieldset {
                        legend { "Which side of " code { (conflict.topic) } " holds?" }
                        @for (j, claim) in conflict.claims.iter().enumerate() {
                            @let id = format!("side-{i}-{j}");
                            div {
                                input type="radio" name="delegation_id" id=(id) value=(claim.delegation_id) required;
                                label for=(id) { (claim.value) }
                            }
                        }
                        @let rationale = format!("rationale-{i}");
                        label for=(rationale) { "Why" }
                        textarea id=(rationale) name="rationale" required {}
                        button type="submit" { "Settle" }
                    }
                }
            }
        }
        form.follow-up method="post" action=(action) {
            (hidden)
            input type="hidden" name="kind" value="follow_up";
            fieldset {
                legend { "Ask for a follow-up" }
                label for="follow-profile" { "Profile" }
                input #follow-profile name="profile_id" required;
                label for="follow-goal" { "Goal" }
                input #follow-goal name="goal" required;
                label for="follow-rationale" { "Why" }
                textarea #follow-rationale name="rationale" required {}
                button type="submit" { "Ask" }
            }
        }
        form.close method="post" action=(action) {
            (hidden)
            input type="hidden" name="kind" value="close";
            fieldset {
                legend { "Close the run as it stands" }
                label for="close-rationale" { "Why" }
                textarea #close-rationale name="rationale" required {}
                button type="submit" { "Close" }
            }
        }
    }
}

/// A settling form's fields.
#[derive(serde::Deserialize)]
pub struct ResumeForm {
    #[serde(default)]
    csrf: String,
    #[serde(default)]
    ticket_id: String,
    #[serde(default)]
    ticket_version: u32,
    #[serde(default)]
    kind: String,
    #[serde(default)]
    rationale: String,
    #[serde(default)]
    topic: String,
    #[serde(default)]
    delegation_id: String,
    #[serde(default)]
    profile_id: String,
    #[serde(default)]
    goal: String,
}

/// `POST /console/runs/{id}/resume`.
pub async fn resume(
    State(console): State<Arc<Console>>,
    signed: Signed,
    Path(run_id): Path<String>,
    Form(form): Form<ResumeForm>,
) -> Response {
    if let Err(refused) = check_csrf(&signed.session, &form.csrf) {
        return refused;
    }
    let input = match form.kind.as_str() {
        "settle" => v1::resume_run_request::Input::Settle(v1::SettleConflict {
            topic: form.topic,
            delegation_id: form.delegation_id,
            evidence_ids: Vec::new(),
        }),
        "follow_up" => v1::resume_run_request::Input::FollowUp(v1::FollowUp {
            profile_id: form.profile_id,
            goal: form.goal,
        }),
        "close" => v1::resume_run_request::Input::Close(v1::CloseRun {}),
        other => {
            return page(
                StatusCode::BAD_REQUEST,
                super::pages::problem(
                    "Refused",
                    &format!("{other:?}: settle, follow_up or close"),
                    Some(&signed.session),
                ),
            );
        }
    };
    let request = v1::ResumeRunRequest {
        run_id: run_id.clone(),
        ticket: Some(v1::RunTicket {
            id: form.ticket_id,
            version: form.ticket_version,
            issued_at: None,
        }),
        rationale: form.rationale,
        input: Some(input),
    };
    match console
        .supervisor
        .resume_run(console.request(&signed.session, request))
        .await
    {
        Ok(_) => Redirect::to(&format!("/console/runs/{run_id}")).into_response(),
        Err(status) => console.refused(&status, &signed.session),
    }
}
