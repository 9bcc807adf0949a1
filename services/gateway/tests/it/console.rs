//! The operator console and the gateway's access check as a browser or an agent meets
//! them, on services that answer from memory: the security headers of every response,
//! live streams that end with their session, the sign-in form's CSRF token, the
//! sign-in throttle under attempts sent at once, `Secure` cookies behind an HTTPS
//! ingress, and REST routes classified as the binding decodes them.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::http::{HeaderMap, Method, Request, StatusCode, header};
use axum::response::Response;
use convene_gateway::console::{self, Console, Sessions, SignOuts, Throttle};
use convene_mesh::handles::BoxStream;
use convene_mesh::policy_file::{Policy, PolicyFile, credential_hash};
use convene_proto::v1;
use convene_proto::v1::approval_server::Approval;
use convene_proto::v1::evidence_store_server::EvidenceStore;
use convene_proto::v1::supervisor_server::Supervisor;
use futures::StreamExt as _;
use tonic::{Status, async_trait};
use tower::ServiceExt as _;

const RUN: &str = "0190a1b2-c3d4-7e5f-8a9b-0c1d2e3f4a5b";
const APPROVAL: &str = "0190a1b2-c3d4-7e5f-8a9b-0c1d2e3f4a5c";

/// Principals: `oncall` views and starts runs, `reader` only views, `worker-pool` may
/// not view, `console` acts for the others.
fn policy() -> Arc<Policy> {
    policy_where_reader_holds("[runs:read]")
}

/// [`policy`] with `reader`'s roles `roles` (a YAML list).
fn policy_where_reader_holds(roles: &str) -> Arc<Policy> {
    let hash = |who: &str| credential_hash(&credential(who));
    let text = format!(
        "principals:
  - {{ id: oncall, tenant: acme, kind: human, roles: [runs:read, runs:start], credential_sha256: [{}] }}
  - {{ id: reader, tenant: acme, kind: human, roles: {roles}, credential_sha256: [{}] }}
  - {{ id: worker-pool, tenant: system, kind: service, roles: [workers:register], credential_sha256: [{}] }}
  - {{ id: console, tenant: system, kind: service, roles: [principals:act-as], act_as: {{ tenants: [acme] }}, credential_sha256: [{}] }}
",
        hash("oncall"),
        hash("reader"),
        hash("worker-pool"),
        hash("console"),
    );
    Arc::new(
        PolicyFile::parse(&text, Some("yaml"), "test policy")
            .and_then(|file| file.compile("test policy"))
            .expect("the test policy compiles"),
    )
}

fn credential(who: &str) -> String {
    format!("{who}-credential-0123456789")
}

/// The supervisor: one run, which changes once after a watch starts and then not
/// again; counts the cancels it is asked for.
#[derive(Default)]
struct Runs {
    cancels: AtomicUsize,
}

fn the_run() -> v1::Run {
    let talked = |id: &str| v1::Delegation {
        task: Some(v1::DelegationTask {
            delegation_id: id.to_owned(),
            run_id: RUN.to_owned(),
            name: "logs".to_owned(),
            profile_id: "logs-investigator-model".to_owned(),
            ..Default::default()
        }),
        attempts: 1,
        result: Some(v1::TaskResult {
            usage: Some(v1::Usage {
                iterations: 2,
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    };
    v1::Run {
        run_id: RUN.to_owned(),
        version: 3,
        delegations: vec![talked("del-chat"), talked("del-broken")],
        ..Default::default()
    }
}

/// The stored turns of the run's two model delegations, by evidence id: `del-chat`'s
/// chain holds, `del-broken`'s second turn names a turn that is not its first.
static TURNS: std::sync::LazyLock<HashMap<String, (v1::Evidence, Vec<u8>)>> =
    std::sync::LazyLock::new(|| {
        use convene_core::ids::content_hash;
        use convene_core::turns::turn_evidence_id;
        use serde_json::json;
        let mut stored = HashMap::new();
        for delegation in ["del-chat", "del-broken"] {
            let first = json!({
                "turn": 1, "previous": null, "attempt": 1, "delegation_id": delegation,
                "request": {"messages_from": 0, "system": "be careful", "tools": ["search_logs@1"],
                            "messages": [{"role": "user", "content": "Find the <b>cause</b>"}]},
                "response": {"message": {"role": "assistant", "content": "",
                    "tool_calls": [{"id": "c1", "name": "search_logs@1", "arguments": {"service": "payment-api"}}]}},
            });
            let first = serde_json::to_vec(&first).unwrap();
            let previous = if delegation == "del-chat" {
                content_hash(&first)
            } else {
                content_hash(b"another turn")
            };
            let second = json!({
                "turn": 2, "previous": previous,
                "request": {"messages_from": 2,
                            "messages": [{"role": "tool", "tool_call_id": "c1", "content": "{\"matched\":116}"}]},
                "response": {"message": {"role": "assistant", "content": "",
                    "tool_calls": [{"id": "c2", "name": "submit_report", "arguments": {"summary": "pool"}}]}},
            });
            let second = serde_json::to_vec(&second).unwrap();
            for (n, bytes) in [(1, first), (2, second)] {
                let id = turn_evidence_id(RUN, delegation, 1, n);
                let record = v1::Evidence {
                    evidence_id: id.clone(),
                    kind: "model_turn".to_owned(),
                    artifact_uri: format!("artifact://acme/{id}"),
                    content_hash: content_hash(&bytes),
                    ..Default::default()
                };
                stored.insert(id, (record, bytes));
            }
        }
        stored
    });

fn unused<T>(what: &str) -> Result<T, Status> {
    Err(Status::unimplemented(format!(
        "{what} is not part of this test"
    )))
}

#[async_trait]
impl Supervisor for Runs {
    type WatchRunStream = BoxStream<v1::WatchRunResponse>;
    type WatchEventsStream = BoxStream<v1::WatchEventsResponse>;

    async fn start_run(
        &self,
        _: tonic::Request<v1::StartRunRequest>,
    ) -> Result<tonic::Response<v1::StartRunResponse>, Status> {
        unused("StartRun")
    }

    async fn get_run(
        &self,
        request: tonic::Request<v1::GetRunRequest>,
    ) -> Result<tonic::Response<v1::GetRunResponse>, Status> {
        if request.get_ref().run_id != RUN {
            return Err(Status::not_found("no such run"));
        }
        Ok(tonic::Response::new(v1::GetRunResponse {
            run: Some(the_run()),
        }))
    }

    async fn watch_run(
        &self,
        request: tonic::Request<v1::WatchRunRequest>,
    ) -> Result<tonic::Response<Self::WatchRunStream>, Status> {
        let first = v1::WatchRunResponse {
            event: Some(v1::RunEvent {
                sequence: request.get_ref().after_sequence + 1,
                ..Default::default()
            }),
        };
        let events = futures::stream::iter([Ok(first)]).chain(futures::stream::pending());
        Ok(tonic::Response::new(Box::pin(events)))
    }

    async fn cancel_run(
        &self,
        _: tonic::Request<v1::CancelRunRequest>,
    ) -> Result<tonic::Response<v1::CancelRunResponse>, Status> {
        self.cancels.fetch_add(1, Ordering::SeqCst);
        unused("CancelRun")
    }

    async fn resume_run(
        &self,
        _: tonic::Request<v1::ResumeRunRequest>,
    ) -> Result<tonic::Response<v1::ResumeRunResponse>, Status> {
        unused("ResumeRun")
    }

    async fn list_runs(
        &self,
        _: tonic::Request<v1::ListRunsRequest>,
    ) -> Result<tonic::Response<v1::ListRunsResponse>, Status> {
        Ok(tonic::Response::new(v1::ListRunsResponse {
            runs: vec![the_run()],
            ..Default::default()
        }))
    }

    async fn delegate(
        &self,
        _: tonic::Request<v1::DelegateRequest>,
    ) -> Result<tonic::Response<v1::DelegateResponse>, Status> {
        unused("Delegate")
    }

    async fn watch_events(
        &self,
        _: tonic::Request<v1::WatchEventsRequest>,
    ) -> Result<tonic::Response<Self::WatchEventsStream>, Status> {
        unused("WatchEvents")
    }
}

/// The approval service: one request, for the run, whose events never come.
struct Approvals;

fn the_approval() -> v1::ApprovalRequest {
    v1::ApprovalRequest {
        approval_id: APPROVAL.to_owned(),
        run_id: RUN.to_owned(),
        ..Default::default()
    }
}

#[async_trait]
impl Approval for Approvals {
    type WatchEventsStream = BoxStream<v1::ApprovalWatchEventsResponse>;

    async fn request_approval(
        &self,
        _: tonic::Request<v1::RequestApprovalRequest>,
    ) -> Result<tonic::Response<v1::RequestApprovalResponse>, Status> {
        unused("RequestApproval")
    }

    async fn decide(
        &self,
        _: tonic::Request<v1::DecideRequest>,
    ) -> Result<tonic::Response<v1::DecideResponse>, Status> {
        unused("Decide")
    }

    async fn get_approval(
        &self,
        _: tonic::Request<v1::GetApprovalRequest>,
    ) -> Result<tonic::Response<v1::GetApprovalResponse>, Status> {
        Ok(tonic::Response::new(v1::GetApprovalResponse {
            approval: Some(the_approval()),
        }))
    }

    async fn list_approvals(
        &self,
        _: tonic::Request<v1::ListApprovalsRequest>,
    ) -> Result<tonic::Response<v1::ListApprovalsResponse>, Status> {
        Ok(tonic::Response::new(v1::ListApprovalsResponse {
            approvals: vec![the_approval()],
            ..Default::default()
        }))
    }

    async fn execute(
        &self,
        _: tonic::Request<v1::ApprovalExecuteRequest>,
    ) -> Result<tonic::Response<v1::ApprovalExecuteResponse>, Status> {
        unused("Execute")
    }

    async fn cancel_approval(
        &self,
        _: tonic::Request<v1::CancelApprovalRequest>,
    ) -> Result<tonic::Response<v1::CancelApprovalResponse>, Status> {
        unused("CancelApproval")
    }

    async fn watch_events(
        &self,
        _: tonic::Request<v1::ApprovalWatchEventsRequest>,
    ) -> Result<tonic::Response<Self::WatchEventsStream>, Status> {
        Ok(tonic::Response::new(Box::pin(futures::stream::pending())))
    }
}

/// The evidence store: only the run's model turns ([`TURNS`]) are found.
struct Evidence;

#[async_trait]
impl EvidenceStore for Evidence {
    async fn put_artifact(
        &self,
        _: tonic::Request<v1::PutArtifactRequest>,
    ) -> Result<tonic::Response<v1::PutArtifactResponse>, Status> {
        unused("PutArtifact")
    }

    async fn put_artifact_batch(
        &self,
        _: tonic::Request<v1::PutArtifactBatchRequest>,
    ) -> Result<tonic::Response<v1::PutArtifactBatchResponse>, Status> {
        unused("PutArtifactBatch")
    }

    async fn get_artifact(
        &self,
        request: tonic::Request<v1::GetArtifactRequest>,
    ) -> Result<tonic::Response<v1::GetArtifactResponse>, Status> {
        let uri = &request.get_ref().uri;
        let (_, content) = TURNS
            .values()
            .find(|(record, _)| &record.artifact_uri == uri)
            .ok_or_else(|| Status::not_found("no such artifact"))?;
        Ok(tonic::Response::new(v1::GetArtifactResponse {
            content: content.clone(),
            ..Default::default()
        }))
    }

    async fn record_evidence(
        &self,
        _: tonic::Request<v1::RecordEvidenceRequest>,
    ) -> Result<tonic::Response<v1::RecordEvidenceResponse>, Status> {
        unused("RecordEvidence")
    }

    async fn get_evidence(
        &self,
        request: tonic::Request<v1::GetEvidenceRequest>,
    ) -> Result<tonic::Response<v1::GetEvidenceResponse>, Status> {
        let evidence: Vec<v1::Evidence> = request
            .get_ref()
            .evidence_ids
            .iter()
            .filter_map(|id| TURNS.get(id).map(|(record, _)| record.clone()))
            .collect();
        if evidence.is_empty() {
            return Err(Status::not_found("no such evidence"));
        }
        Ok(tonic::Response::new(v1::GetEvidenceResponse {
            evidence,
            ..Default::default()
        }))
    }

    async fn verify_chain(
        &self,
        _: tonic::Request<v1::VerifyChainRequest>,
    ) -> Result<tonic::Response<v1::VerifyChainResponse>, Status> {
        unused("VerifyChain")
    }
}

fn settings() -> convene_gateway::ConsoleSettings {
    convene_gateway::ConsoleSettings {
        approval: Arc::new(Approvals),
        evidence: Arc::new(Evidence),
        credential: credential("console"),
        session_ttl: console::DEFAULT_SESSION_TTL,
        jaeger_url: None,
    }
}

/// The whole gateway as `build` makes it, advertising `base`.
fn gateway(base: &str, supervisor: Arc<Runs>) -> Router {
    convene_gateway::build(
        supervisor,
        policy(),
        &convene_supervisor::templates::Templates::default(),
        None,
        base,
        Some(settings()),
    )
}

/// The console alone, its sessions lasting `ttl` and its streams checking them every
/// `recheck`.
fn console_with(ttl: Duration, recheck: Duration) -> (Router, Arc<Console>) {
    console_of(policy(), Sessions::new(None), ttl, recheck)
}

/// A console on `policy` keeping its sessions in `sessions`, as one replica, or one
/// start of the gateway, is.
fn console_of(
    policy: Arc<Policy>,
    sessions: Sessions,
    ttl: Duration,
    recheck: Duration,
) -> (Router, Arc<Console>) {
    let settings = settings();
    let console = Arc::new(Console {
        supervisor: Arc::new(Runs::default()),
        approval: settings.approval,
        evidence: settings.evidence,
        policy,
        credential: settings.credential,
        sessions,
        throttle: Throttle::default(),
        secure: false,
        session_ttl: ttl,
        jaeger_url: None,
        live_recheck: recheck,
        sign_outs: SignOuts::default(),
    });
    (console::router(console.clone()), console)
}

async fn send(app: &Router, request: Request<Body>) -> Response {
    app.clone()
        .oneshot(request)
        .await
        .expect("the router answers")
}

async fn get(app: &Router, path: &str, cookie: Option<&str>) -> Response {
    let mut request = Request::get(path);
    if let Some(cookie) = cookie {
        request = request.header(header::COOKIE, cookie);
    }
    send(app, request.body(Body::empty()).unwrap()).await
}

async fn post_form(
    app: &Router,
    path: &str,
    cookie: Option<&str>,
    form: &[(&str, &str)],
) -> Response {
    let body = form
        .iter()
        .map(|(k, v)| {
            format!(
                "{k}={}",
                percent_encoding::utf8_percent_encode(v, percent_encoding::NON_ALPHANUMERIC)
            )
        })
        .collect::<Vec<_>>()
        .join("&");
    let mut request =
        Request::post(path).header(header::CONTENT_TYPE, "application/x-www-form-urlencoded");
    if let Some(cookie) = cookie {
        request = request.header(header::COOKIE, cookie);
    }
    send(app, request.body(Body::from(body)).unwrap()).await
}

async fn text(response: Response) -> String {
    let bytes = axum::body::to_bytes(response.into_body(), 1 << 20)
        .await
        .expect("a body");
    String::from_utf8(bytes.to_vec()).expect("UTF-8")
}

/// The `name=value` of each `Set-Cookie`, by name, with the whole header.
fn set_cookies(headers: &HeaderMap) -> HashMap<String, String> {
    headers
        .get_all(header::SET_COOKIE)
        .iter()
        .map(|v| v.to_str().expect("ASCII").to_owned())
        .map(|v| {
            let name = v.split('=').next().expect("a name").to_owned();
            (name, v)
        })
        .collect()
}

/// The value of field `name` in a page's form.
fn field(page: &str, name: &str) -> String {
    let marker = format!("name=\"{name}\" value=\"");
    let at = page
        .find(&marker)
        .unwrap_or_else(|| panic!("a field {name} in {page}"))
        + marker.len();
    page[at..].split('"').next().expect("a value").to_owned()
}

/// The sign-in form: its pre-session cookie (`name=value`) and its CSRF token.
async fn sign_in_form(app: &Router) -> (String, String) {
    let form = get(app, "/console/sign-in", None).await;
    assert_eq!(form.status(), StatusCode::OK);
    let cookies = set_cookies(form.headers());
    let cookie = cookies[console::SIGN_IN_COOKIE]
        .split(';')
        .next()
        .expect("a cookie")
        .to_owned();
    (cookie, field(&text(form).await, "csrf"))
}

/// Signs in as `who` through the form; the session cookie to send.
async fn sign_in(app: &Router, who: &str) -> String {
    let (cookie, csrf) = sign_in_form(app).await;
    let response = post_form(
        app,
        "/console/sign-in",
        Some(&cookie),
        &[("credential", &credential(who)), ("csrf", &csrf)],
    )
    .await;
    assert_eq!(response.status(), StatusCode::SEE_OTHER, "{who} signs in");
    let cookies = set_cookies(response.headers());
    assert!(
        cookies[console::SIGN_IN_COOKIE].contains("Max-Age=0"),
        "the pre-session cookie is dropped: {cookies:?}"
    );
    cookies[console::COOKIE]
        .split(';')
        .next()
        .expect("a cookie")
        .to_owned()
}

fn assert_secured(what: &str, response: &Response, data: bool) {
    let headers = response.headers();
    let value = |name: header::HeaderName| {
        headers
            .get(&name)
            .unwrap_or_else(|| panic!("{what}: no {name} header in {headers:?}"))
            .to_str()
            .expect("ASCII")
            .to_owned()
    };
    let csp = value(header::CONTENT_SECURITY_POLICY);
    assert!(csp.contains("default-src 'self'"), "{what}: {csp}");
    assert!(csp.contains("frame-ancestors 'none'"), "{what}: {csp}");
    assert!(!csp.contains("unsafe-inline"), "{what}: {csp}");
    assert_eq!(value(header::X_FRAME_OPTIONS), "DENY", "{what}");
    assert_eq!(value(header::X_CONTENT_TYPE_OPTIONS), "nosniff", "{what}");
    assert_eq!(value(header::REFERRER_POLICY), "same-origin", "{what}");
    if data {
        assert_eq!(value(header::CACHE_CONTROL), "no-store", "{what}");
    }
}

/// Reads a stream's body until it ends; false when it is still open after `limit`.
async fn ends_within(response: Response, limit: Duration) -> bool {
    let mut body = response.into_body().into_data_stream();
    tokio::time::timeout(limit, async {
        while let Some(chunk) = body.next().await {
            chunk.expect("the stream's data");
        }
    })
    .await
    .is_ok()
}

/// Reads a stream until its first `changed` event.
async fn first_event(response: Response) -> axum::body::BodyDataStream {
    let mut body = response.into_body().into_data_stream();
    let mut seen = String::new();
    tokio::time::timeout(Duration::from_secs(10), async {
        while !seen.contains("event: changed") {
            let chunk = body
                .next()
                .await
                .expect("the stream goes on")
                .expect("data");
            seen.push_str(&String::from_utf8_lossy(&chunk));
        }
    })
    .await
    .unwrap_or_else(|_| panic!("no event on the stream: {seen}"));
    body
}

#[tokio::test]
async fn every_console_response_carries_the_security_headers() {
    let app = gateway("http://127.0.0.1:7480", Arc::new(Runs::default()));
    let form = get(&app, "/console/sign-in", None).await;
    assert_secured("the sign-in form", &form, true);
    let unsigned = get(&app, "/console/runs", None).await;
    assert_eq!(unsigned.status(), StatusCode::SEE_OTHER);
    assert_secured("the redirect to the sign-in form", &unsigned, true);
    let refused = post_form(&app, "/console/sign-in", None, &[("credential", "x")]).await;
    assert_eq!(refused.status(), StatusCode::FORBIDDEN);
    assert_secured("a refused sign-in", &refused, true);

    let cookie = sign_in(&app, "oncall").await;
    let signed = Some(cookie.as_str());
    for (path, status) in [
        ("/console".to_owned(), StatusCode::SEE_OTHER),
        ("/console/runs".to_owned(), StatusCode::OK),
        (format!("/console/runs/{RUN}"), StatusCode::OK),
        (
            "/console/runs/0190a1b2-0000-7000-8000-000000000000".to_owned(),
            StatusCode::NOT_FOUND,
        ),
        (
            "/console/runs?label=nokeyvalue".to_owned(),
            StatusCode::BAD_REQUEST,
        ),
        (
            format!("/console/evidence?run={RUN}&id=e1"),
            StatusCode::NOT_FOUND,
        ),
        ("/console/approvals".to_owned(), StatusCode::OK),
        (format!("/console/approvals/{APPROVAL}"), StatusCode::OK),
        ("/console/no-such-page".to_owned(), StatusCode::NOT_FOUND),
        ("/console/runs/a/b/c".to_owned(), StatusCode::NOT_FOUND),
    ] {
        let response = get(&app, &path, signed).await;
        assert_eq!(response.status(), status, "{path}");
        assert_secured(&path, &response, true);
    }
    let wrong_method = post_form(&app, "/console/runs", signed, &[]).await;
    assert_eq!(wrong_method.status(), StatusCode::METHOD_NOT_ALLOWED);
    assert_secured("a method the page does not take", &wrong_method, true);
    let no_csrf = post_form(&app, "/console/sign-out", signed, &[]).await;
    assert_eq!(no_csrf.status(), StatusCode::FORBIDDEN);
    assert_secured("a form refused for its CSRF token", &no_csrf, true);

    for asset in ["/console/assets/console.css", "/console/assets/console.js"] {
        let response = get(&app, asset, None).await;
        assert_eq!(response.status(), StatusCode::OK, "{asset}");
        assert_secured(asset, &response, false);
    }
    for stream in [
        format!("/console/runs/{RUN}/events?after=3"),
        format!("/console/approvals/{APPROVAL}/events?since=0"),
    ] {
        let response = get(&app, &stream, signed).await;
        assert_eq!(response.status(), StatusCode::OK, "{stream}");
        assert_eq!(
            response.headers()[header::CONTENT_TYPE],
            "text/event-stream"
        );
        assert_secured(&stream, &response, true);
    }
    // The A2A bindings are for agents, not browsers: their answers are their own.
    let card = get(&app, "/.well-known/agent-card.json", None).await;
    assert_eq!(card.status(), StatusCode::OK);
    assert!(
        card.headers()
            .get(header::CONTENT_SECURITY_POLICY)
            .is_none()
    );
}

#[tokio::test]
async fn a_live_stream_ends_at_sign_out_at_once() {
    // A check an hour apart: only the sign-out itself can end the stream in time.
    let (app, _) = console_with(console::DEFAULT_SESSION_TTL, Duration::from_secs(3600));
    let cookie = sign_in(&app, "oncall").await;
    let other = sign_in(&app, "reader").await;
    let stream = get(
        &app,
        &format!("/console/runs/{RUN}/events?after=3"),
        Some(&cookie),
    )
    .await;
    assert_eq!(stream.status(), StatusCode::OK);
    let mut body = first_event(stream).await;
    let others = get(
        &app,
        &format!("/console/runs/{RUN}/events?after=3"),
        Some(&other),
    )
    .await;
    let mut others = first_event(others).await;

    let page = text(get(&app, "/console/runs", Some(&cookie)).await).await;
    let out = post_form(
        &app,
        "/console/sign-out",
        Some(&cookie),
        &[("csrf", &field(&page, "csrf"))],
    )
    .await;
    assert_eq!(out.status(), StatusCode::SEE_OTHER);
    let ended = tokio::time::timeout(Duration::from_secs(2), async {
        while let Some(chunk) = body.next().await {
            chunk.expect("data");
        }
    })
    .await;
    assert!(ended.is_ok(), "the signed-out session's stream ended");
    // Another session's stream goes on.
    let still = tokio::time::timeout(Duration::from_millis(300), others.next()).await;
    assert!(
        still.is_err(),
        "the other session's stream is still open: {still:?}"
    );
}

#[tokio::test]
async fn a_live_stream_ends_within_a_check_of_its_session_closing_elsewhere() {
    // Closed in the sessions, as a sign-out on another replica does: the next check
    // (every 100 ms here) finds it.
    let (app, console) = console_with(console::DEFAULT_SESSION_TTL, Duration::from_millis(100));
    let cookie = sign_in(&app, "oncall").await;
    let approval = get(
        &app,
        &format!("/console/approvals/{APPROVAL}/events?since=0"),
        Some(&cookie),
    )
    .await;
    assert_eq!(approval.status(), StatusCode::OK);
    let run = get(
        &app,
        &format!("/console/runs/{RUN}/events?after=3"),
        Some(&cookie),
    )
    .await;
    let run = first_event(run).await;
    // Checks that find the session open leave the stream be.
    let approval = {
        let mut body = approval.into_body().into_data_stream();
        let early = tokio::time::timeout(Duration::from_millis(500), body.next()).await;
        assert!(early.is_err(), "still open after several checks: {early:?}");
        body
    };
    let token = cookie.split_once('=').expect("name=value").1;
    console.sessions.close(token).await.unwrap();
    for (what, mut body) in [
        ("the approval's stream", approval),
        ("the run's stream", run),
    ] {
        let ended = tokio::time::timeout(Duration::from_secs(2), async {
            while let Some(chunk) = body.next().await {
                chunk.expect("data");
            }
        })
        .await;
        assert!(ended.is_ok(), "{what} ended");
    }
}

#[tokio::test]
async fn a_live_stream_ends_at_its_sessions_expiry() {
    let (app, _) = console_with(Duration::from_secs(1), Duration::from_secs(3600));
    let cookie = sign_in(&app, "oncall").await;
    let stream = get(
        &app,
        &format!("/console/approvals/{APPROVAL}/events?since=0"),
        Some(&cookie),
    )
    .await;
    assert_eq!(stream.status(), StatusCode::OK);
    let started = std::time::Instant::now();
    assert!(
        ends_within(stream, Duration::from_secs(5)).await,
        "the stream ended with the session"
    );
    assert!(
        started.elapsed() >= Duration::from_millis(500),
        "not before the session's expiry: {:?}",
        started.elapsed()
    );
}

#[tokio::test]
async fn a_session_whose_viewing_role_is_taken_away_gets_no_stream_after_the_restart() {
    // The policy is read at start: an operator takes a role away by editing the policy
    // file and restarting the gateway. Sessions live in the database and outlast the
    // restart; the restart ends every stream, and the browsers reconnect.
    let dir = tempfile::tempdir().unwrap();
    let url = convene_store::sqlite_url(&dir.path().join(convene_store::SQLITE_FILE));
    let db = convene_store::Database::connect(&url).await.unwrap();
    let recheck = Duration::from_millis(100);
    let run_events = format!("/console/runs/{RUN}/events?after=3");
    let approval_events = format!("/console/approvals/{APPROVAL}/events?since=0");

    let (before, _) = console_of(
        policy(),
        Sessions::new(Some(db.clone())),
        console::DEFAULT_SESSION_TTL,
        recheck,
    );
    let reader = sign_in(&before, "reader").await;
    let oncall = sign_in(&before, "oncall").await;
    for cookie in [&reader, &oncall] {
        let stream = get(&before, &run_events, Some(cookie)).await;
        assert_eq!(stream.status(), StatusCode::OK, "{cookie}");
        drop(first_event(stream).await);
    }
    drop(before);

    let (after, console) = console_of(
        policy_where_reader_holds("[]"),
        Sessions::new(Some(db.clone())),
        console::DEFAULT_SESSION_TTL,
        recheck,
    );
    let token = reader.split_once('=').expect("name=value").1;
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap();
    assert!(
        console
            .sessions
            .get(token, i64::try_from(now.as_millis()).unwrap())
            .await
            .unwrap()
            .is_some_and(|s| s.principal == "reader"),
        "the reader's session outlasted the restart"
    );
    // It is the role, not the session, that is gone: no stream, no page.
    for path in [
        run_events.as_str(),
        approval_events.as_str(),
        "/console/runs",
    ] {
        let refused = get(&after, path, Some(&reader)).await;
        assert_eq!(refused.status(), StatusCode::SEE_OTHER, "{path}");
        assert_eq!(
            refused.headers()[header::LOCATION],
            "/console/sign-in",
            "{path}"
        );
        assert_ne!(
            refused.headers().get(header::CONTENT_TYPE),
            Some(&header::HeaderValue::from_static("text/event-stream")),
            "{path}"
        );
    }
    // A principal that keeps the role is served again, and its stream outlasts several
    // checks.
    let stream = get(&after, &run_events, Some(&oncall)).await;
    assert_eq!(stream.status(), StatusCode::OK);
    let mut body = first_event(stream).await;
    let still = tokio::time::timeout(recheck * 5, async {
        while let Some(chunk) = body.next().await {
            chunk.expect("data");
        }
    })
    .await;
    assert!(
        still.is_err(),
        "the stream of a session that keeps the role ended"
    );
    db.close().await;
}

#[tokio::test]
async fn a_sign_in_without_its_csrf_token_is_refused_before_the_credential() {
    let (app, _) = console_with(console::DEFAULT_SESSION_TTL, console::DEFAULT_LIVE_RECHECK);
    let (cookie, csrf) = sign_in_form(&app).await;
    assert_eq!(csrf.len(), 64, "{csrf}");
    assert_eq!(cookie, format!("{}={csrf}", console::SIGN_IN_COOKIE));
    let right = credential("oncall");
    let other_token = "0".repeat(64);
    let other_cookie = format!("{}={other_token}", console::SIGN_IN_COOKIE);
    // More refusals than the throttle allows attempts: none of them is counted.
    for _ in 0..3 {
        for (what, cookie, form) in [
            (
                "no token, no cookie",
                None,
                vec![("credential", right.as_str())],
            ),
            (
                "a cookie, no token",
                Some(cookie.as_str()),
                vec![("credential", right.as_str())],
            ),
            (
                "a token, no cookie",
                None,
                vec![("credential", right.as_str()), ("csrf", csrf.as_str())],
            ),
            (
                "an empty token",
                Some(cookie.as_str()),
                vec![("credential", right.as_str()), ("csrf", "")],
            ),
            (
                "another cookie's token",
                Some(cookie.as_str()),
                vec![
                    ("credential", right.as_str()),
                    ("csrf", other_token.as_str()),
                ],
            ),
            (
                "a token of another cookie",
                Some(other_cookie.as_str()),
                vec![("credential", right.as_str()), ("csrf", csrf.as_str())],
            ),
        ] {
            let refused = post_form(&app, "/console/sign-in", cookie, &form).await;
            assert_eq!(refused.status(), StatusCode::FORBIDDEN, "{what}");
            assert!(
                !set_cookies(refused.headers()).contains_key(console::COOKIE),
                "{what}: no session"
            );
            let page = text(refused).await;
            assert!(page.contains("CSRF token"), "{what}: {page}");
            assert!(
                !page.contains(&right),
                "{what}: the credential is not echoed"
            );
        }
    }
    // Nothing was checked or counted: a wrong credential is still told so, and the
    // right one signs in.
    let wrong = post_form(
        &app,
        "/console/sign-in",
        Some(&cookie),
        &[("credential", "not-a-credential"), ("csrf", &csrf)],
    )
    .await;
    assert_eq!(wrong.status(), StatusCode::UNAUTHORIZED);
    let again = field(&text(wrong).await, "csrf");
    assert_eq!(
        again, csrf,
        "the form shown again carries the cookie's token"
    );
    sign_in(&app, "oncall").await;
}

/// Sends `n` wrong sign-ins at once from one address; how many reached the credential
/// check (401) and how many the throttle held back (429).
async fn wrong_sign_ins_at_once(app: &Router, n: usize) -> (usize, usize) {
    let (cookie, csrf) = sign_in_form(app).await;
    let start = Arc::new(tokio::sync::Barrier::new(n));
    let attempts: Vec<_> = (0..n)
        .map(|_| {
            let (app, cookie, csrf, start) =
                (app.clone(), cookie.clone(), csrf.clone(), start.clone());
            tokio::spawn(async move {
                start.wait().await;
                post_form(
                    &app,
                    "/console/sign-in",
                    Some(&cookie),
                    &[("credential", "not-a-credential"), ("csrf", &csrf)],
                )
                .await
                .status()
            })
        })
        .collect();
    let (mut checked, mut throttled) = (0, 0);
    for attempt in attempts {
        match attempt.await.expect("the attempt answers") {
            StatusCode::UNAUTHORIZED => checked += 1,
            StatusCode::TOO_MANY_REQUESTS => throttled += 1,
            other => panic!("a wrong sign-in answered {other}"),
        }
    }
    (checked, throttled)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn wrong_sign_ins_sent_at_once_get_five_attempts() {
    let (app, _) = console_with(console::DEFAULT_SESSION_TTL, console::DEFAULT_LIVE_RECHECK);
    let (checked, throttled) = wrong_sign_ins_at_once(&app, 20).await;
    assert_eq!(
        (checked, throttled),
        (
            console::throttle::MAX_FAILURES as usize,
            20 - console::throttle::MAX_FAILURES as usize
        ),
        "at most five reach the credential check"
    );
    // The right credential waits too: nothing tells a guesser it was right.
    let (cookie, csrf) = sign_in_form(&app).await;
    let right = post_form(
        &app,
        "/console/sign-in",
        Some(&cookie),
        &[("credential", &credential("oncall")), ("csrf", &csrf)],
    )
    .await;
    assert_eq!(right.status(), StatusCode::TOO_MANY_REQUESTS);
    assert!(right.headers().contains_key(header::RETRY_AFTER));
    assert!(!set_cookies(right.headers()).contains_key(console::COOKIE));
}

#[tokio::test]
async fn only_a_sign_in_that_may_view_takes_the_count_back() {
    let (app, _) = console_with(console::DEFAULT_SESSION_TTL, console::DEFAULT_LIVE_RECHECK);
    let (cookie, csrf) = sign_in_form(&app).await;
    let attempt = |who: &'static str| {
        let (app, cookie, csrf) = (app.clone(), cookie.clone(), csrf.clone());
        async move {
            let credential = if who.is_empty() {
                "not-a-credential".to_owned()
            } else {
                credential(who)
            };
            post_form(
                &app,
                "/console/sign-in",
                Some(&cookie),
                &[("credential", &credential), ("csrf", &csrf)],
            )
            .await
            .status()
        }
    };
    for _ in 0..3 {
        assert_eq!(attempt("").await, StatusCode::UNAUTHORIZED);
    }
    // A known credential without the viewing role is no success: it counts.
    assert_eq!(attempt("worker-pool").await, StatusCode::FORBIDDEN);
    assert_eq!(attempt("").await, StatusCode::UNAUTHORIZED);
    assert_eq!(attempt("").await, StatusCode::TOO_MANY_REQUESTS);

    let (app, _) = console_with(console::DEFAULT_SESSION_TTL, console::DEFAULT_LIVE_RECHECK);
    let (cookie, csrf) = sign_in_form(&app).await;
    let attempt = |credential: String| {
        let (app, cookie, csrf) = (app.clone(), cookie.clone(), csrf.clone());
        async move {
            post_form(
                &app,
                "/console/sign-in",
                Some(&cookie),
                &[("credential", &credential), ("csrf", &csrf)],
            )
            .await
            .status()
        }
    };
    for _ in 0..4 {
        assert_eq!(attempt("wrong".into()).await, StatusCode::UNAUTHORIZED);
    }
    // A sign-in that opens a session gives the address its attempts back.
    assert_eq!(attempt(credential("reader")).await, StatusCode::SEE_OTHER);
    for _ in 0..5 {
        assert_eq!(attempt("wrong".into()).await, StatusCode::UNAUTHORIZED);
    }
    assert_eq!(attempt("wrong".into()).await, StatusCode::TOO_MANY_REQUESTS);
}

#[tokio::test]
async fn cookies_are_secure_when_the_public_url_is_https() {
    for (base, secure) in [
        ("https://console.example.com/convene", true),
        ("HTTPS://CONSOLE.EXAMPLE.COM", true),
        ("http://127.0.0.1:7480", false),
    ] {
        // The gateway itself serves plaintext here: TLS ends in front of it.
        let app = gateway(base, Arc::new(Runs::default()));
        let form = get(&app, "/console/sign-in", None).await;
        let (cookie, csrf) = {
            let set = set_cookies(form.headers())[console::SIGN_IN_COOKIE].clone();
            assert_eq!(set.contains("; Secure"), secure, "{base}: {set}");
            (
                set.split(';').next().unwrap().to_owned(),
                field(&text(form).await, "csrf"),
            )
        };
        let signed = post_form(
            &app,
            "/console/sign-in",
            Some(&cookie),
            &[("credential", &credential("oncall")), ("csrf", &csrf)],
        )
        .await;
        assert_eq!(signed.status(), StatusCode::SEE_OTHER, "{base}");
        let set = set_cookies(signed.headers());
        for name in [console::COOKIE, console::SIGN_IN_COOKIE] {
            assert_eq!(
                set[name].contains("; Secure"),
                secure,
                "{base}: {}",
                set[name]
            );
            assert!(set[name].contains("HttpOnly") && set[name].contains("SameSite=Strict"));
        }
        let session = set[console::COOKIE].split(';').next().unwrap().to_owned();
        let page = text(get(&app, "/console/runs", Some(&session)).await).await;
        let out = post_form(
            &app,
            "/console/sign-out",
            Some(&session),
            &[("csrf", &field(&page, "csrf"))],
        )
        .await;
        let cleared = set_cookies(out.headers())[console::COOKIE].clone();
        assert!(cleared.contains("Max-Age=0"), "{cleared}");
        assert_eq!(cleared.contains("; Secure"), secure, "{base}: {cleared}");
    }
}

fn rest(method: Method, path: &str, who: &str) -> Request<Body> {
    Request::builder()
        .method(method)
        .uri(format!("/a2a/rest{path}"))
        .header(header::AUTHORIZATION, format!("Bearer {}", credential(who)))
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::empty())
        .unwrap()
}

#[tokio::test]
async fn a_cancel_spelled_with_percent_escapes_needs_the_role_to_cancel() {
    let runs = Arc::new(Runs::default());
    let app = gateway("http://127.0.0.1:7480", runs.clone());
    let task = "0190a1b2-c3d4-7e5f-8a9b-0c1d2e3f4a5d";
    for path in [
        format!("/tasks/{task}:cancel"),
        format!("/tasks/{task}%3Acancel"),
        format!("/tasks/{task}%3acancel"),
        format!("/tasks/{task}%3A%63ancel"),
        format!("/tasks/{task}/cancel"),
    ] {
        let refused = send(&app, rest(Method::POST, &path, "reader")).await;
        assert_eq!(refused.status(), StatusCode::FORBIDDEN, "{path}");
        let challenge = refused.headers()[header::WWW_AUTHENTICATE]
            .to_str()
            .unwrap()
            .to_owned();
        assert!(
            challenge.contains("insufficient_scope"),
            "{path}: {challenge}"
        );
        let body = text(refused).await;
        assert!(
            body.contains("cancel tasks"),
            "the gateway's own refusal: {body}"
        );
        // A principal that may cancel gets past the check, to the binding (which knows
        // no such task).
        let passed = send(&app, rest(Method::POST, &path, "oncall")).await;
        assert_ne!(passed.status(), StatusCode::FORBIDDEN, "{path}");
        assert_ne!(passed.status(), StatusCode::UNAUTHORIZED, "{path}");
    }
    // `%2F` does not split a segment: `ID/cancel` is one (unknown) task id, and posting
    // to it is no cancel the binding knows, whoever asks.
    for path in [
        format!("/tasks/{task}%2Fcancel"),
        format!("/tasks/{task}%2fcancel"),
    ] {
        let answer = send(&app, rest(Method::POST, &path, "reader")).await;
        assert!(
            answer.status().is_client_error(),
            "{path}: {}",
            answer.status()
        );
        assert_ne!(
            answer.status(),
            StatusCode::FORBIDDEN,
            "read, as routed: {path}"
        );
        let read = send(&app, rest(Method::GET, &path, "reader")).await;
        assert!(read.status().is_client_error(), "{path}: {}", read.status());
    }
    // A segment that only decodes to `cancel` is no route of the binding.
    let unrouted = send(
        &app,
        rest(Method::POST, &format!("/tasks/{task}/%63ancel"), "oncall"),
    )
    .await;
    assert_eq!(unrouted.status(), StatusCode::NOT_FOUND);
    // Reading stays open to readers.
    let read = send(&app, rest(Method::GET, &format!("/tasks/{task}"), "reader")).await;
    assert_ne!(read.status(), StatusCode::FORBIDDEN);
    assert_eq!(
        runs.cancels.load(Ordering::SeqCst),
        0,
        "no run was cancelled"
    );
}

#[tokio::test]
async fn a_model_conversation_is_shown_walked_from_its_chain_and_a_broken_one_says_where() {
    let (app, _) = console_with(console::DEFAULT_SESSION_TTL, Duration::from_secs(60));
    let signed = sign_in(&app, "reader").await;
    let signed = Some(signed.as_str());

    // The run page links each delegation that had turns to its conversation.
    let run = text(get(&app, &format!("/console/runs/{RUN}"), signed).await).await;
    assert!(
        run.contains(&format!(
            "/console/conversation?run={RUN}&amp;delegation=del-chat"
        )),
        "{run}"
    );

    let path = format!("/console/conversation?run={RUN}&delegation=del-chat");
    let response = get(&app, &path, signed).await;
    assert_eq!(response.status(), StatusCode::OK);
    assert_secured(&path, &response, true);
    let page = text(response).await;
    assert!(page.contains("Chain intact: 2 turn(s)"), "{page}");
    // The task, the call, its answer and the report, in order; text is escaped.
    let at = |needle: &str| {
        page.find(needle)
            .unwrap_or_else(|| panic!("{needle} in {page}"))
    };
    assert!(at("Find the &lt;b&gt;cause&lt;/b&gt;") < at("calls <code>search_logs@1</code>"));
    assert!(at("calls <code>search_logs@1</code>") < at("{&quot;matched&quot;:116}"));
    assert!(at("{&quot;matched&quot;:116}") < at("submit_report"));
    assert!(!page.contains("<b>cause</b>"));

    let broken = text(
        get(
            &app,
            &format!("/console/conversation?run={RUN}&delegation=del-broken"),
            signed,
        )
        .await,
    )
    .await;
    assert!(broken.contains("breaks at turn 2"), "{broken}");
    assert!(!broken.contains("submit_report"), "{broken}");

    let unknown = get(
        &app,
        &format!("/console/conversation?run={RUN}&delegation=del-nope"),
        signed,
    )
    .await;
    assert_eq!(unknown.status(), StatusCode::NOT_FOUND);
    // Without a session, nothing is shown.
    let anonymous = get(&app, &path, None).await;
    assert_ne!(anonymous.status(), StatusCode::OK);
}
