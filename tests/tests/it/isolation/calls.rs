//! The calls the isolation test makes, each as a caller makes it: the principal's or
//! token's credential on a gRPC call, the answer or the refusal as it came.

use std::time::SystemTime;

use convene_mesh::auth::request;
use convene_proto::v1::{
    self, approval_server::Approval as _, evidence_store_server::EvidenceStore as _,
    resume_run_request::Input,
};
use futures::StreamExt as _;
use tonic::Status;

use crate::harness::TestMesh;

pub(super) async fn resume(
    mesh: &TestMesh,
    who: &str,
    run_id: &str,
    ticket: Option<v1::RunTicket>,
    input: Input,
) -> Result<v1::ResumeRunResponse, Status> {
    mesh.supervisor()
        .resume_run(request(
            v1::ResumeRunRequest {
                run_id: run_id.to_owned(),
                ticket,
                rationale: "as the evidence says".to_owned(),
                input: Some(input),
            },
            &mesh.credential(who),
        ))
        .await
        .map(tonic::Response::into_inner)
}

pub(super) async fn cancel_run(
    mesh: &TestMesh,
    who: &str,
    run_id: &str,
) -> Result<v1::CancelRunResponse, Status> {
    mesh.supervisor()
        .cancel_run(request(
            v1::CancelRunRequest {
                run_id: run_id.to_owned(),
                reason: "isolation".to_owned(),
            },
            &mesh.credential(who),
        ))
        .await
        .map(tonic::Response::into_inner)
}

pub(super) async fn get_approval(
    mesh: &TestMesh,
    who: &str,
    id: &str,
) -> Result<v1::ApprovalRequest, Status> {
    mesh.approval()
        .get_approval(request(
            v1::GetApprovalRequest {
                approval_id: id.to_owned(),
            },
            &mesh.credential(who),
        ))
        .await
        .map(|r| r.into_inner().approval.unwrap_or_default())
}

pub(super) async fn decide(
    mesh: &TestMesh,
    who: &str,
    id: &str,
    hash: &str,
    decision: v1::VoteDecision,
) -> Result<v1::ApprovalRequest, Status> {
    mesh.approval()
        .decide(request(
            v1::DecideRequest {
                approval_id: id.to_owned(),
                decision: decision as i32,
                parameters_hash: hash.to_owned(),
                comment: String::new(),
            },
            &mesh.credential(who),
        ))
        .await
        .map(|r| r.into_inner().approval.unwrap_or_default())
}

pub(super) async fn execute(
    mesh: &TestMesh,
    who: &str,
    id: &str,
    hash: &str,
) -> Result<v1::ApprovalExecuteResponse, Status> {
    mesh.approval()
        .execute(request(
            v1::ApprovalExecuteRequest {
                approval_id: id.to_owned(),
                parameters_hash: hash.to_owned(),
            },
            &mesh.credential(who),
        ))
        .await
        .map(tonic::Response::into_inner)
}

pub(super) async fn cancel_approval(
    mesh: &TestMesh,
    who: &str,
    id: &str,
) -> Result<v1::ApprovalRequest, Status> {
    mesh.approval()
        .cancel_approval(request(
            v1::CancelApprovalRequest {
                approval_id: id.to_owned(),
                reason: "isolation".to_owned(),
            },
            &mesh.credential(who),
        ))
        .await
        .map(|r| r.into_inner().approval.unwrap_or_default())
}

/// An evidence record under `id`, citing `uri` with `hash` (empty: this put's bytes).
pub(super) fn record(id: &str, uri: &str, hash: &str) -> v1::Evidence {
    v1::Evidence {
        evidence_id: id.to_owned(),
        kind: "impact_metric".to_owned(),
        source: "logs.payment_prod".to_owned(),
        scope: Some(v1::TaskScope {
            resources: vec!["service/payment-api".to_owned()],
            time_range: None,
        }),
        observed_at: Some(SystemTime::now().into()),
        artifact_uri: uri.to_owned(),
        content_hash: hash.to_owned(),
        quality: v1::EvidenceQuality::Passed as i32,
        tool_call_id: "call-1".to_owned(),
        ..Default::default()
    }
}

pub(super) async fn put(
    mesh: &TestMesh,
    token: &str,
    bytes: &[u8],
    evidence: Option<v1::Evidence>,
) -> Result<v1::PutArtifactResponse, Status> {
    mesh.evidence()
        .put_artifact(request(
            v1::PutArtifactRequest {
                content: bytes.to_vec(),
                media_type: "application/json".to_owned(),
                tool_call_id: "call-1".to_owned(),
                evidence,
            },
            token,
        ))
        .await
        .map(tonic::Response::into_inner)
}

pub(super) async fn record_evidence(
    mesh: &TestMesh,
    token: &str,
    e: v1::Evidence,
) -> Result<v1::Evidence, Status> {
    mesh.evidence()
        .record_evidence(request(
            v1::RecordEvidenceRequest { evidence: Some(e) },
            token,
        ))
        .await
        .map(|r| r.into_inner().evidence.unwrap_or_default())
}

/// The supervisor's outbox as `who` sees it (WatchEvents, not following).
pub(super) async fn outbox(
    mesh: &TestMesh,
    who: &str,
    after: &str,
    run_id: &str,
) -> Result<Vec<v1::CloudEvent>, Status> {
    let mut stream = mesh
        .supervisor()
        .watch_events(request(
            v1::WatchEventsRequest {
                after_event_id: after.to_owned(),
                types: Vec::new(),
                run_id: run_id.to_owned(),
                follow: false,
                from_now: false,
            },
            &mesh.credential(who),
        ))
        .await?
        .into_inner();
    let mut events = Vec::new();
    while let Some(item) = stream.next().await {
        events.push(item?.event.unwrap_or_default());
    }
    Ok(events)
}

/// The approval service's events as `who` sees them (not following).
pub(super) async fn approval_stream(
    mesh: &TestMesh,
    who: &str,
    after: &str,
    run_id: &str,
) -> Result<Vec<v1::CloudEvent>, Status> {
    let mut stream = mesh
        .approval()
        .watch_events(request(
            v1::ApprovalWatchEventsRequest {
                after_event_id: after.to_owned(),
                follow: false,
                run_id: run_id.to_owned(),
            },
            &mesh.credential(who),
        ))
        .await?
        .into_inner();
    let mut events = Vec::new();
    while let Some(item) = stream.next().await {
        events.push(item?.event.unwrap_or_default());
    }
    Ok(events)
}

/// Every page of ListRuns as `who`, `size` runs a page, from `first_token`: the run ids
/// in order and how many pages held them, and what the pages said.
pub(super) async fn list_runs(
    mesh: &TestMesh,
    who: &str,
    size: u32,
    states: &[i32],
    first_token: &str,
) -> ((Vec<String>, u32), String) {
    let (mut ids, mut pages, mut seen) = (Vec::new(), 0, String::new());
    let mut token = first_token.to_owned();
    loop {
        let page = mesh
            .supervisor()
            .list_runs(request(
                v1::ListRunsRequest {
                    page_size: size,
                    page_token: token,
                    states: states.to_vec(),
                    ..Default::default()
                },
                &mesh.credential(who),
            ))
            .await
            .expect("ListRuns")
            .into_inner();
        pages += 1;
        seen.push_str(&format!("{page:?}"));
        ids.extend(page.runs.iter().map(|r| r.run_id.clone()));
        if page.next_page_token.is_empty() {
            return ((ids, pages), seen);
        }
        token = page.next_page_token;
    }
}

/// Every page of ListApprovals as `who` of `run_id` (empty: all), `size` a page: the
/// ids in order and how many pages held them, and what the pages said.
pub(super) async fn list_approvals(
    mesh: &TestMesh,
    who: &str,
    size: u32,
    run_id: &str,
) -> ((Vec<String>, u32), String) {
    let (mut ids, mut pages, mut seen) = (Vec::new(), 0, String::new());
    let mut token = String::new();
    loop {
        let page = mesh
            .approval()
            .list_approvals(request(
                v1::ListApprovalsRequest {
                    states: Vec::new(),
                    run_id: run_id.to_owned(),
                    page_size: size,
                    page_token: token,
                },
                &mesh.credential(who),
            ))
            .await
            .expect("ListApprovals")
            .into_inner();
        pages += 1;
        seen.push_str(&format!("{page:?}"));
        ids.extend(page.approvals.iter().map(|a| a.approval_id.clone()));
        if page.next_page_token.is_empty() {
            return ((ids, pages), seen);
        }
        token = page.next_page_token;
    }
}
