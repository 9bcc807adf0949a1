//! The operator console under `/console/`, on the gateway's HTTP listener: people sign
//! in with the credential they call the API with and look at runs in a browser.
//!
//! - **Sessions** ([`sessions`]): a sign-in opens a session stored in the database; the
//!   browser gets an HttpOnly, SameSite=Strict cookie scoped to `/console` with the
//!   session's expiry (Secure when served over TLS or when the public URL is
//!   `https://`, TLS then ending at an ingress). Sign-in attempts are throttled per
//!   client address and in total ([`throttle`]). State-changing forms carry the
//!   session's CSRF token; the sign-in form carries the token of a pre-session cookie
//!   (double submit). A form without its token is refused (403), a sign-in before any
//!   credential is looked at.
//! - **Headers**: every response under `/console` (pages, redirects, errors, assets,
//!   streams) says [`CONTENT_SECURITY_POLICY`], `X-Frame-Options: DENY`,
//!   `X-Content-Type-Options: nosniff` and `Referrer-Policy: same-origin`; all but the
//!   static assets `Cache-Control: no-store`.
//! - **Live streams** ([`live`]) end when their session does: at sign-out (at once on
//!   this replica), at its expiry, and when a check every [`Console::live_recheck`]
//!   finds it closed. Roles come from the policy read at start: one taken away takes
//!   effect at the restart, which ends every stream.
//! - **Acting for a person**: the console calls the mesh with its own credential (a
//!   principal holding `principals:act-as`) and names the signed-in principal in
//!   `x-convene-act-as` metadata ([`convene_mesh::auth::ACT_AS`]); each service then
//!   checks that principal's tenant and roles as for its own call. Viewing needs
//!   `runs:read`. No credential of a person is stored.
//! - **Pages** ([`pages`]): server-rendered HTML, readable without JavaScript.
//!   Without a session every page redirects to the sign-in form; another tenant's run
//!   is "not found", as one that does not exist.

pub mod approvals;
pub mod conversation;
pub mod evidence;
pub mod live;
pub mod pages;
pub mod resume;
pub mod sessions;
pub mod throttle;

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use axum::Form;
use axum::Router;
use axum::extract::connect_info::{ConnectInfo, Connected};
use axum::extract::{FromRequestParts, Path, Query, State};
use axum::http::request::Parts;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::{any, get, post};
use convene_mesh::auth::{ACT_AS, request};
use convene_mesh::handles::{ApprovalHandle, EvidenceHandle, SupervisorHandle};
use convene_mesh::policy_file::Policy;
use convene_proto::v1;
use maud::Markup;
use tonic::Code;
use tower_http::set_header::SetResponseHeaderLayer;

pub use sessions::{Session, Sessions};
pub use throttle::Throttle;

/// The session cookie's name.
pub const COOKIE: &str = "convene_session";
/// The pre-session cookie whose token the sign-in form carries.
pub const SIGN_IN_COOKIE: &str = "convene_sign_in";
/// How long a sign-in form's token lasts.
const SIGN_IN_TTL: Duration = Duration::from_secs(3600);
/// The `Content-Security-Policy` of every console response: scripts, styles and
/// connections from the gateway only, nothing inline, no framing, forms posted here.
pub const CONTENT_SECURITY_POLICY: &str = "default-src 'self'; base-uri 'none'; \
     form-action 'self'; frame-ancestors 'none'; object-src 'none'";
/// How often a live stream checks its session by default.
pub const DEFAULT_LIVE_RECHECK: Duration = Duration::from_secs(30);
/// The variable setting [`Console::live_recheck`] for [`crate::build`], e.g. `30s`.
pub const LIVE_RECHECK_ENV: &str = "CONVENE_CONSOLE_LIVE_RECHECK";
/// The role viewing the console needs.
pub const VIEW_ROLE: &str = "runs:read";
/// How long a session lasts by default.
pub const DEFAULT_SESSION_TTL: Duration = Duration::from_secs(8 * 3600);
/// Runs per page of the runs list.
const PAGE_SIZE: u32 = 50;

/// What the console serves with.
pub struct Console {
    /// The supervisor it reads and settles runs on.
    pub supervisor: SupervisorHandle,
    /// The approval service whose requests it shows, votes on and executes.
    pub approval: ApprovalHandle,
    /// The evidence store whose evidence and artifacts it shows.
    pub evidence: EvidenceHandle,
    /// The principals people sign in as.
    pub policy: Arc<Policy>,
    /// The console's own credential: a principal with `principals:act-as`.
    pub credential: String,
    /// Where sessions are kept.
    pub sessions: Sessions,
    /// Sign-in attempts per client address and in total.
    pub throttle: Throttle,
    /// Whether browsers reach the console over HTTPS (the cookies are then `Secure`):
    /// the listener serves TLS, or the public URL is `https://`.
    pub secure: bool,
    /// How long a session lasts.
    pub session_ttl: Duration,
    /// Jaeger's base URL, for links to a run's trace (`CONVENE_JAEGER_URL`).
    pub jaeger_url: Option<String>,
    /// How often a live stream checks that its session is still open (closed on another
    /// replica, say).
    pub live_recheck: Duration,
    /// Sign-outs on this replica, for their sessions' streams to end at once.
    pub sign_outs: SignOuts,
}

/// Tells the live streams of this replica that a session was closed.
#[derive(Debug)]
pub struct SignOuts(tokio::sync::watch::Sender<u64>);

impl Default for SignOuts {
    fn default() -> Self {
        Self(tokio::sync::watch::channel(0).0)
    }
}

impl SignOuts {
    /// A session was closed: every stream checks its own.
    pub fn closed(&self) {
        self.0.send_modify(|n| *n = n.wrapping_add(1));
    }

    /// Changes on each sign-out.
    pub fn subscribe(&self) -> tokio::sync::watch::Receiver<u64> {
        self.0.subscribe()
    }
}

/// [`LIVE_RECHECK_ENV`] as a duration; [`DEFAULT_LIVE_RECHECK`] when unset, or (with a
/// warning) when it is not a duration.
pub fn live_recheck_from_env() -> Duration {
    use serde::de::IntoDeserializer as _;
    let Ok(text) = std::env::var(LIVE_RECHECK_ENV) else {
        return DEFAULT_LIVE_RECHECK;
    };
    let parsed: Result<Duration, serde::de::value::Error> =
        convene_server::config::duration::deserialize(text.as_str().into_deserializer());
    match parsed {
        Ok(every) if !every.is_zero() => every,
        Ok(_) => {
            tracing::warn!(
                "{LIVE_RECHECK_ENV} is zero; live streams check their session every {}s",
                DEFAULT_LIVE_RECHECK.as_secs()
            );
            DEFAULT_LIVE_RECHECK
        }
        Err(e) => {
            tracing::warn!(
                "{LIVE_RECHECK_ENV}: {e}; live streams check their session every {}s",
                DEFAULT_LIVE_RECHECK.as_secs()
            );
            DEFAULT_LIVE_RECHECK
        }
    }
}

impl std::fmt::Debug for Console {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Console")
            .field("secure", &self.secure)
            .field("session_ttl", &self.session_ttl)
            .finish_non_exhaustive()
    }
}

/// The address a connection came from, for the sign-in throttle.
#[derive(Debug, Clone, Copy)]
pub struct ClientAddr(pub SocketAddr);

impl Connected<axum::serve::IncomingStream<'_, tokio::net::TcpListener>> for ClientAddr {
    fn connect_info(stream: axum::serve::IncomingStream<'_, tokio::net::TcpListener>) -> Self {
        Self(*stream.remote_addr())
    }
}

impl Connected<axum::serve::IncomingStream<'_, convene_server::tls::TlsListener>> for ClientAddr {
    fn connect_info(
        stream: axum::serve::IncomingStream<'_, convene_server::tls::TlsListener>,
    ) -> Self {
        Self(*stream.remote_addr())
    }
}

fn now_ms() -> i64 {
    crate::handler::now_millis()
}

/// A page with its status.
fn page(status: StatusCode, markup: Markup) -> Response {
    (status, markup).into_response()
}

/// The console's routes, all under `/console`, every response with the console's
/// security headers; every response but the static assets' `Cache-Control: no-store`
/// (over the `no-cache` of the event streams too).
pub fn router(console: Arc<Console>) -> Router {
    let pages = Router::new()
        .route("/console", get(home))
        .route("/console/", get(home))
        .route("/console/sign-in", get(sign_in_form).post(sign_in))
        .route("/console/sign-out", post(sign_out))
        .route("/console/runs", get(runs))
        .route("/console/runs/{run_id}", get(run))
        .route("/console/runs/{run_id}/resume", post(resume::resume))
        .route("/console/runs/{run_id}/events", get(live::events))
        .route("/console/evidence", get(evidence::show))
        .route("/console/conversation", get(conversation::show))
        .route("/console/approvals", get(approvals::queue))
        .route("/console/approvals/{approval_id}", get(approvals::show))
        .route(
            "/console/approvals/{approval_id}/events",
            get(live::approval_events),
        )
        .route(
            "/console/approvals/{approval_id}/decide",
            post(approvals::decide),
        )
        .route(
            "/console/approvals/{approval_id}/execute",
            post(approvals::execute),
        )
        .route("/console/{*rest}", any(not_found))
        .layer(SetResponseHeaderLayer::overriding(
            header::CACHE_CONTROL,
            HeaderValue::from_static("no-store"),
        ));
    // The assets say how long they may be kept.
    let assets = Router::new()
        .route("/console/assets/console.js", get(live::script))
        .route("/console/assets/console.css", get(stylesheet));
    secured(pages.merge(assets).with_state(console))
}

/// `router` with the console's security headers on every response.
fn secured(router: Router) -> Router {
    router
        .layer(SetResponseHeaderLayer::overriding(
            header::CONTENT_SECURITY_POLICY,
            HeaderValue::from_static(CONTENT_SECURITY_POLICY),
        ))
        .layer(SetResponseHeaderLayer::overriding(
            header::X_FRAME_OPTIONS,
            HeaderValue::from_static("DENY"),
        ))
        .layer(SetResponseHeaderLayer::overriding(
            header::X_CONTENT_TYPE_OPTIONS,
            HeaderValue::from_static("nosniff"),
        ))
        .layer(SetResponseHeaderLayer::overriding(
            header::REFERRER_POLICY,
            HeaderValue::from_static("same-origin"),
        ))
}

async fn not_found() -> Response {
    page(
        StatusCode::NOT_FOUND,
        pages::problem(
            "Not found",
            "The console has no page at this address.",
            None,
        ),
    )
}

/// A signed-in request: the session of its cookie, still open, of a principal that
/// still holds the viewing role. Without one, the request is sent to the sign-in form.
pub struct Signed {
    /// The session.
    pub session: Session,
    /// The cookie's token.
    pub token: String,
}

/// Why a request has no session.
pub enum NotSigned {
    /// No session: to the sign-in form.
    SignIn,
    /// The sessions cannot be read.
    Unavailable,
}

impl IntoResponse for NotSigned {
    fn into_response(self) -> Response {
        match self {
            NotSigned::SignIn => Redirect::to("/console/sign-in").into_response(),
            NotSigned::Unavailable => page(
                StatusCode::SERVICE_UNAVAILABLE,
                pages::problem(
                    "Unavailable",
                    "The console cannot read its sessions now; try again in a moment.",
                    None,
                ),
            ),
        }
    }
}

/// The value of cookie `name` in a request's cookies.
fn cookie_value(headers: &HeaderMap, name: &str) -> Option<String> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|pair| pair.trim().split_once('='))
        .find(|(n, _)| *n == name)
        .map(|(_, value)| value.to_owned())
}

/// The token of the sign-in form's pre-session cookie, when it is one the console made
/// (64 hex digits).
fn sign_in_token(headers: &HeaderMap) -> Option<String> {
    cookie_value(headers, SIGN_IN_COOKIE)
        .filter(|t| t.len() == 64 && t.bytes().all(|b| b.is_ascii_hexdigit()))
}

/// Whether two tokens are equal, in a time that does not depend on where they differ.
fn same_token(a: &str, b: &str) -> bool {
    a.len() == b.len()
        && a.bytes()
            .zip(b.bytes())
            .fold(0u8, |acc, (x, y)| acc | (x ^ y))
            == 0
}

impl FromRequestParts<Arc<Console>> for Signed {
    type Rejection = NotSigned;

    async fn from_request_parts(
        parts: &mut Parts,
        console: &Arc<Console>,
    ) -> Result<Self, Self::Rejection> {
        let token = cookie_value(&parts.headers, COOKIE).ok_or(NotSigned::SignIn)?;
        let session = console
            .signed(&token)
            .await
            .map_err(|e| {
                tracing::error!(error = %e, "console sessions cannot be read");
                NotSigned::Unavailable
            })?
            .ok_or(NotSigned::SignIn)?;
        Ok(Self { session, token })
    }
}

impl Console {
    /// The session of cookie token `token` if it is still open and its principal still
    /// holds the viewing role in the session's tenant (under the policy this gateway
    /// started with, which may differ from the one the session was opened under).
    ///
    /// # Errors
    ///
    /// When the sessions cannot be read.
    pub async fn signed(&self, token: &str) -> Result<Option<Session>, sessions::StoreError> {
        let Some(session) = self.sessions.get(token, now_ms()).await? else {
            return Ok(None);
        };
        let still = self
            .policy
            .principal(&session.principal)
            .is_some_and(|p| p.tenant == session.tenant && p.has_role(VIEW_ROLE));
        Ok(still.then_some(session))
    }

    /// A request to the mesh acting for the session's principal.
    fn request<T>(&self, session: &Session, message: T) -> tonic::Request<T> {
        let mut request = request(message, &self.credential);
        if let Ok(value) = session.principal.parse() {
            request.metadata_mut().insert(ACT_AS, value);
        }
        request
    }

    /// The page for a refused call to the mesh.
    fn refused(&self, status: &tonic::Status, session: &Session) -> Response {
        let (code, title) = match status.code() {
            Code::NotFound => (StatusCode::NOT_FOUND, "Not found"),
            Code::PermissionDenied => (StatusCode::FORBIDDEN, "Not permitted"),
            Code::InvalidArgument => (StatusCode::BAD_REQUEST, "Check the filters"),
            Code::Unauthenticated => (StatusCode::UNAUTHORIZED, "Not signed in"),
            Code::FailedPrecondition | Code::Aborted | Code::AlreadyExists => {
                (StatusCode::CONFLICT, "Refused")
            }
            Code::ResourceExhausted => (StatusCode::TOO_MANY_REQUESTS, "Busy"),
            Code::Unavailable | Code::DeadlineExceeded => {
                (StatusCode::SERVICE_UNAVAILABLE, "Unavailable")
            }
            _ => (StatusCode::BAD_GATEWAY, "The mesh did not answer"),
        };
        page(code, pages::problem(title, status.message(), Some(session)))
    }

    /// A `Set-Cookie` value: `name=value` for `path`, for `max_age`, HttpOnly,
    /// SameSite=Strict, Secure when the console is reached over HTTPS.
    fn set_cookie(&self, name: &str, value: &str, path: &str, max_age: Duration) -> HeaderValue {
        let text = format!(
            "{name}={value}; Path={path}; Max-Age={}; HttpOnly; SameSite=Strict{}",
            max_age.as_secs(),
            if self.secure { "; Secure" } else { "" }
        );
        HeaderValue::from_str(&text).expect("cookie tokens are hex")
    }

    /// The `Set-Cookie` value of a new session.
    fn cookie(&self, token: &str) -> HeaderValue {
        self.set_cookie(COOKIE, token, "/console", self.session_ttl)
    }

    /// The `Set-Cookie` value that ends the session in the browser.
    fn cleared(&self) -> HeaderValue {
        self.set_cookie(COOKIE, "", "/console", Duration::ZERO)
    }

    /// The sign-in form with `error`, carrying `token`, and the pre-session cookie
    /// holding it.
    fn sign_in_page(&self, status: StatusCode, error: Option<&str>, token: &str) -> Response {
        let mut response = page(status, pages::sign_in(error, token));
        response.headers_mut().append(
            header::SET_COOKIE,
            self.set_cookie(SIGN_IN_COOKIE, token, "/console/sign-in", SIGN_IN_TTL),
        );
        response
    }
}

async fn home(_: Signed) -> Redirect {
    Redirect::to("/console/runs")
}

async fn stylesheet() -> impl IntoResponse {
    (
        [
            (header::CONTENT_TYPE, "text/css; charset=utf-8"),
            (header::CACHE_CONTROL, "max-age=3600"),
        ],
        pages::STYLESHEET,
    )
}

/// The sign-in form, with the token of the browser's pre-session cookie (a new one
/// when it has none).
async fn sign_in_form(State(console): State<Arc<Console>>, headers: HeaderMap) -> Response {
    let token = sign_in_token(&headers).unwrap_or_else(sessions::random_token);
    console.sign_in_page(StatusCode::OK, None, &token)
}

/// The sign-in form's fields.
#[derive(serde::Deserialize)]
pub struct SignIn {
    #[serde(default)]
    credential: String,
    #[serde(default)]
    csrf: String,
}

/// The client address a request came from, when the server recorded it.
fn client_ip(parts: Option<ConnectInfo<ClientAddr>>) -> IpAddr {
    parts.map_or(IpAddr::from([0, 0, 0, 0]), |ConnectInfo(ClientAddr(a))| {
        a.ip()
    })
}

/// A sign-in: first the form's token against the pre-session cookie's (refused with
/// 403 before anything else), then the throttle (the attempt is counted as it is let
/// through), then the credential and the viewing role. Only a session opened takes the
/// address's count back.
async fn sign_in(
    State(console): State<Arc<Console>>,
    connect: Option<axum::Extension<ConnectInfo<ClientAddr>>>,
    headers: HeaderMap,
    Form(form): Form<SignIn>,
) -> Response {
    let Some(token) = sign_in_token(&headers).filter(|t| same_token(t, &form.csrf)) else {
        let fresh = sign_in_token(&headers).unwrap_or_else(sessions::random_token);
        return console.sign_in_page(
            StatusCode::FORBIDDEN,
            Some(
                "This sign-in was not sent from this console's form (its CSRF token is \
                 missing or wrong); sign in again.",
            ),
            &fresh,
        );
    };
    let ip = client_ip(connect.map(|axum::Extension(c)| c));
    if let Err(wait) = console.throttle.attempt(ip, Instant::now()) {
        let secs = wait.as_secs().max(1);
        let mut response = console.sign_in_page(
            StatusCode::TOO_MANY_REQUESTS,
            Some(&format!(
                "Too many sign-ins from this address; try again in {secs} s."
            )),
            &token,
        );
        response
            .headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from(secs));
        return response;
    }
    let Some(principal) = console
        .policy
        .principal_by_credential(form.credential.trim())
    else {
        return console.sign_in_page(
            StatusCode::UNAUTHORIZED,
            Some("That credential is not known: check the one you were given."),
            &token,
        );
    };
    if !principal.has_role(VIEW_ROLE) {
        return console.sign_in_page(
            StatusCode::FORBIDDEN,
            Some(&format!(
                "Principal {} lacks role {VIEW_ROLE}, which viewing the console needs; add it \
                 to the principal's roles in the policy file.",
                principal.id
            )),
            &token,
        );
    }
    let now = now_ms();
    let ttl = i64::try_from(console.session_ttl.as_millis()).unwrap_or(i64::MAX);
    match console
        .sessions
        .open(
            &principal.id,
            &principal.tenant,
            now,
            now.saturating_add(ttl),
        )
        .await
    {
        Ok((session_token, _)) => {
            console.throttle.succeeded(ip);
            tracing::info!(principal = %principal.id, tenant = %principal.tenant, "console sign-in");
            let mut response = Redirect::to("/console/runs").into_response();
            let headers = response.headers_mut();
            headers.append(header::SET_COOKIE, console.cookie(&session_token));
            headers.append(
                header::SET_COOKIE,
                console.set_cookie(SIGN_IN_COOKIE, "", "/console/sign-in", Duration::ZERO),
            );
            response
        }
        Err(e) => {
            tracing::error!(error = %e, "a console session cannot be stored");
            console.sign_in_page(
                StatusCode::SERVICE_UNAVAILABLE,
                Some("The console cannot store sessions now; try again in a moment."),
                &token,
            )
        }
    }
}

/// A state-changing form's CSRF field.
#[derive(serde::Deserialize)]
pub struct Csrf {
    #[serde(default)]
    csrf: String,
}

/// Refuses a form whose CSRF token (`given`) is not the session's.
fn check_csrf(session: &Session, given: &str) -> Result<(), Response> {
    if !given.is_empty() && same_token(given, &session.csrf) {
        return Ok(());
    }
    Err(page(
        StatusCode::FORBIDDEN,
        pages::problem(
            "Refused",
            "This form was not sent from this session's page (its CSRF token is missing or \
             wrong); reload the page and try again.",
            Some(session),
        ),
    ))
}

async fn sign_out(
    State(console): State<Arc<Console>>,
    signed: Signed,
    Form(form): Form<Csrf>,
) -> Response {
    if let Err(refused) = check_csrf(&signed.session, &form.csrf) {
        return refused;
    }
    if let Err(e) = console.sessions.close(&signed.token).await {
        tracing::error!(error = %e, "a console session cannot be closed");
        return page(
            StatusCode::SERVICE_UNAVAILABLE,
            pages::problem(
                "Unavailable",
                "Signing out failed; try again.",
                Some(&signed.session),
            ),
        );
    }
    console.sign_outs.closed();
    let mut response = Redirect::to("/console/sign-in").into_response();
    response
        .headers_mut()
        .insert(header::SET_COOKIE, console.cleared());
    response
}

/// A time filter ([`convene_core::time::time_or_ago`]); None when empty.
fn when(name: &str, value: &str) -> Result<Option<SystemTime>, String> {
    let value = value.trim();
    if value.is_empty() {
        return Ok(None);
    }
    convene_core::time::time_or_ago(value, SystemTime::now())
        .map(Some)
        .map_err(|e| format!("{name} {e}"))
}

/// A ListRuns request for `filters`, or what is wrong with them.
fn list_request(filters: &pages::RunFilters) -> Result<v1::ListRunsRequest, String> {
    let mut request = v1::ListRunsRequest {
        page_size: filters.size.unwrap_or(PAGE_SIZE).clamp(1, 100),
        page_token: filters.page.clone(),
        ..Default::default()
    };
    if !filters.state.is_empty() {
        let state = pages::STATES
            .iter()
            .find(|(value, _)| *value == filters.state)
            .ok_or_else(|| format!("state {:?} is not one the list knows", filters.state))?;
        request.states.push(state.1 as i32);
    }
    let label = filters.label.trim();
    if !label.is_empty() {
        let (key, value) = label
            .split_once('=')
            .ok_or_else(|| format!("label {label:?}: write it as key=value"))?;
        request
            .labels
            .insert(key.trim().to_owned(), value.trim().to_owned());
    }
    request.created_after = when("since", &filters.since)?.map(prost_types::Timestamp::from);
    request.created_before = when("until", &filters.until)?.map(prost_types::Timestamp::from);
    if let (Some(after), Some(before)) = (&request.created_after, &request.created_before)
        && (after.seconds, after.nanos) >= (before.seconds, before.nanos)
    {
        return Err("since must be before until".to_owned());
    }
    Ok(request)
}

async fn runs(
    State(console): State<Arc<Console>>,
    signed: Signed,
    Query(filters): Query<pages::RunFilters>,
) -> Response {
    let request = match list_request(&filters) {
        Ok(r) => r,
        Err(message) => {
            return page(
                StatusCode::BAD_REQUEST,
                pages::problem("Check the filters", &message, Some(&signed.session)),
            );
        }
    };
    match console
        .supervisor
        .list_runs(console.request(&signed.session, request))
        .await
    {
        Ok(listed) => {
            let listed = listed.into_inner();
            pages::runs(
                &signed.session,
                &filters,
                &listed.runs,
                &listed.next_page_token,
            )
            .into_response()
        }
        Err(status) => console.refused(&status, &signed.session),
    }
}

async fn run(
    State(console): State<Arc<Console>>,
    signed: Signed,
    Path(run_id): Path<String>,
) -> Response {
    match console
        .supervisor
        .get_run(console.request(&signed.session, v1::GetRunRequest { run_id }))
        .await
    {
        Ok(got) => match got.into_inner().run {
            Some(run) => {
                pages::run(&signed.session, &run, console.jaeger_url.as_deref()).into_response()
            }
            None => page(
                StatusCode::BAD_GATEWAY,
                pages::problem(
                    "The mesh did not answer",
                    "GetRun returned no run.",
                    Some(&signed.session),
                ),
            ),
        },
        Err(status) => console.refused(&status, &signed.session),
    }
}
