//! The approvals queue: the tenant's approval requests, one request with its action,
//! parameters and their hash, and the forms that approve, reject and execute it.
//!
//! A vote or an execution carries the parameters hash of the page the person read (a
//! hidden field), as `convene approvals approve --hash` does: the approval service
//! refuses it when the request's parameters are not those. Two distinct people must
//! approve an R3 action; the service counts them, the console only shows the votes.

use std::sync::Arc;

use axum::Form;
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Redirect, Response};
use convene_proto::v1;
use maud::{Markup, html};

use super::pages::{layout, time};
use super::{Console, Signed, check_csrf, page};

/// The approval states the queue filters by, with their query values.
pub const STATES: [(&str, v1::ApprovalState); 4] = [
    ("pending", v1::ApprovalState::Pending),
    ("approved", v1::ApprovalState::Approved),
    ("rejected", v1::ApprovalState::Rejected),
    ("expired", v1::ApprovalState::Expired),
];

fn approval_state(state: i32) -> String {
    v1::ApprovalState::try_from(state)
        .map_or("APPROVAL_STATE_UNSPECIFIED", |s| s.as_str_name())
        .trim_start_matches("APPROVAL_STATE_")
        .to_ascii_lowercase()
        .replace('_', " ")
}

fn risk(level: i32) -> &'static str {
    v1::RiskLevel::try_from(level).map_or("RISK_LEVEL_UNSPECIFIED", |r| r.as_str_name())
}

/// The queue's filter.
#[derive(Debug, Default, serde::Deserialize)]
pub struct QueueFilter {
    /// A state's query value; empty: pending.
    #[serde(default)]
    pub state: String,
}

/// `/console/approvals`: the tenant's requests in one state (pending by default).
pub async fn queue(
    State(console): State<Arc<Console>>,
    signed: Signed,
    Query(filter): Query<QueueFilter>,
) -> Response {
    let chosen = if filter.state.is_empty() {
        "pending"
    } else {
        filter.state.as_str()
    };
    let Some((_, state)) = STATES.iter().find(|(value, _)| *value == chosen) else {
        return page(
            StatusCode::BAD_REQUEST,
            super::pages::problem(
                "Check the filter",
                &format!("state {chosen:?} is not one of pending, approved, rejected, expired"),
                Some(&signed.session),
            ),
        );
    };
    let request = v1::ListApprovalsRequest {
        states: vec![*state as i32],
        page_size: 100,
        ..Default::default()
    };
    match console
        .approval
        .list_approvals(console.request(&signed.session, request))
        .await
    {
        Ok(listed) => queue_page(&signed, chosen, &listed.into_inner().approvals).into_response(),
        Err(status) => console.refused(&status, &signed.session),
    }
}

fn queue_page(signed: &Signed, chosen: &str, approvals: &[v1::ApprovalRequest]) -> Markup {
    layout(
        "Approvals",
        Some(&signed.session),
        &html! {
            h1 { "Approvals" }
            form.filters method="get" action="/console/approvals" {
                label for="state" { "State" }
                select #state name="state" {
                    @for (value, _) in STATES {
                        option value=(value) selected[chosen == value] { (value) }
                    }
                }
                button type="submit" { "Show" }
            }
            @if approvals.is_empty() {
                p { "No " (chosen) " approval requests." }
            } @else {
                table {
                    thead { tr {
                        th scope="col" { "Request" } th scope="col" { "Action" } th scope="col" { "Risk" }
                        th scope="col" { "Run" } th scope="col" { "Votes" } th scope="col" { "Expires" }
                    } }
                    tbody {
                        @for a in approvals {
                            @let approvals_given = a.votes.iter().filter(|v| v.decision == v1::VoteDecision::Approve as i32).count();
                            tr {
                                td { a href={ "/console/approvals/" (a.approval_id) } { code { (a.approval_id) } } }
                                td { (a.action) }
                                td { (risk(a.risk_level)) }
                                td { @if !a.run_id.is_empty() { a href={ "/console/runs/" (a.run_id) } { code { (a.run_id) } } } }
                                td { (approvals_given) " of " (a.approvals_required) }
                                td { (time(a.expires_at.as_ref())) }
                            }
                        }
                    }
                }
            }
        },
    )
}

/// `/console/approvals/{id}`: one request, with the forms its state allows.
pub async fn show(
    State(console): State<Arc<Console>>,
    signed: Signed,
    Path(approval_id): Path<String>,
) -> Response {
    match console
        .approval
        .get_approval(console.request(&signed.session, v1::GetApprovalRequest { approval_id }))
        .await
    {
        Ok(got) => match got.into_inner().approval {
            Some(a) => request_page(&signed, &a).into_response(),
            None => page(
                StatusCode::BAD_GATEWAY,
                super::pages::problem(
                    "The mesh did not answer",
                    "GetApproval returned no request.",
                    Some(&signed.session),
                ),
            ),
        },
        Err(status) => console.refused(&status, &signed.session),
    }
}

fn request_page(signed: &Signed, a: &v1::ApprovalRequest) -> Markup {
    let parameters = a
        .parameters
        .as_ref()
        .map(convene_proto::json::from_struct)
        .map(|v| serde_json::to_string_pretty(&v).unwrap_or_default())
        .unwrap_or_default();
    let pending = a.state == v1::ApprovalState::Pending as i32;
    let executable = a.state == v1::ApprovalState::Approved as i32 && a.execution.is_none();
    layout(
        &format!("Approval {}", a.approval_id),
        Some(&signed.session),
        &html! {
            h1 { "Approval request " code { (a.approval_id) } }
            @if !a.run_id.is_empty() {
                div hidden data-live={ "/console/approvals/" (a.approval_id) "/events?since=" (super::now_ms()) } {}
            }
            dl.summary {
                dt { "Action" } dd { code { (a.action) } }
                dt { "Risk" } dd { (risk(a.risk_level)) }
                dt { "State" } dd { (approval_state(a.state)) }
                dt { "Requested by" } dd { (a.requester) }
                @if !a.run_id.is_empty() {
                    dt { "Run" } dd { a href={ "/console/runs/" (a.run_id) } { code { (a.run_id) } } }
                }
                @if !a.rationale.is_empty() { dt { "Why" } dd { (a.rationale) } }
                dt { "Approvals needed" } dd { (a.approvals_required) " distinct people" }
                dt { "Expires" } dd { (time(a.expires_at.as_ref())) }
                dt { "Parameters hash" } dd { code #parameters-hash { (a.parameters_hash) } }
            }
            h2 { "Parameters" }
            pre { code { (parameters) } }
            @if !a.evidence_refs.is_empty() {
                h2 { "Evidence" }
                ul { @for e in &a.evidence_refs { li { code { (e) } } } }
            }
            h2 { "Votes" }
            @if a.votes.is_empty() {
                p { "No votes yet." }
            } @else {
                ul.votes {
                    @for v in &a.votes {
                        li {
                            strong { (v.approver) } ": "
                            (v1::VoteDecision::try_from(v.decision).map_or("UNSPECIFIED", |d| d.as_str_name()).trim_start_matches("VOTE_DECISION_").to_ascii_lowercase())
                            @if !v.comment.is_empty() { " — " (v.comment) }
                        }
                    }
                }
            }
            @if pending {
                form.decide method="post" action={ "/console/approvals/" (a.approval_id) "/decide" } {
                    input type="hidden" name="csrf" value=(signed.session.csrf);
                    input type="hidden" name="parameters_hash" value=(a.parameters_hash);
                    label for="comment" { "Comment" }
                    input #comment name="comment";
                    p.hint { "Your vote binds to the parameters above (" code { (a.parameters_hash) } "); if they change, it is refused." }
                    button type="submit" name="decision" value="approve" { "Approve" }
                    " "
                    button.reject type="submit" name="decision" value="reject" { "Reject" }
                }
            }
            @if executable {
                form.execute method="post" action={ "/console/approvals/" (a.approval_id) "/execute" } {
                    input type="hidden" name="csrf" value=(signed.session.csrf);
                    input type="hidden" name="parameters_hash" value=(a.parameters_hash);
                    button type="submit" { "Execute" }
                }
            }
            @if let Some(execution) = &a.execution {
                h2 { "Execution" }
                p { "Executed by " (execution.executed_by) " at " (time(execution.executed_at.as_ref())) }
            }
        },
    )
}

/// A vote's form.
#[derive(serde::Deserialize)]
pub struct DecideForm {
    #[serde(default)]
    csrf: String,
    #[serde(default)]
    parameters_hash: String,
    #[serde(default)]
    decision: String,
    #[serde(default)]
    comment: String,
}

/// `POST /console/approvals/{id}/decide`.
pub async fn decide(
    State(console): State<Arc<Console>>,
    signed: Signed,
    Path(approval_id): Path<String>,
    Form(form): Form<DecideForm>,
) -> Response {
    if let Err(refused) = check_csrf(&signed.session, &form.csrf) {
        return refused;
    }
    let decision = match form.decision.as_str() {
        "approve" => v1::VoteDecision::Approve,
        "reject" => v1::VoteDecision::Reject,
        other => {
            return page(
                StatusCode::BAD_REQUEST,
                super::pages::problem(
                    "Refused",
                    &format!("decision {other:?}: approve or reject"),
                    Some(&signed.session),
                ),
            );
        }
    };
    let request = v1::DecideRequest {
        approval_id: approval_id.clone(),
        decision: decision as i32,
        parameters_hash: form.parameters_hash,
        comment: form.comment,
    };
    match console
        .approval
        .decide(console.request(&signed.session, request))
        .await
    {
        Ok(_) => Redirect::to(&format!("/console/approvals/{approval_id}")).into_response(),
        Err(status) => console.refused(&status, &signed.session),
    }
}

/// An execution's form.
#[derive(serde::Deserialize)]
pub struct ExecuteForm {
    #[serde(default)]
    csrf: String,
    #[serde(default)]
    parameters_hash: String,
}

/// `POST /console/approvals/{id}/execute`.
pub async fn execute(
    State(console): State<Arc<Console>>,
    signed: Signed,
    Path(approval_id): Path<String>,
    Form(form): Form<ExecuteForm>,
) -> Response {
    if let Err(refused) = check_csrf(&signed.session, &form.csrf) {
        return refused;
    }
    let request = v1::ApprovalExecuteRequest {
        approval_id: approval_id.clone(),
        parameters_hash: form.parameters_hash,
    };
    match console
        .approval
        .execute(console.request(&signed.session, request))
        .await
    {
        Ok(_) => Redirect::to(&format!("/console/approvals/{approval_id}")).into_response(),
        Err(status) => console.refused(&status, &signed.session),
    }
}
