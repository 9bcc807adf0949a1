//! The operator console over real HTTP on `convene up`'s listener: no page without a
//! session, the session cookie's flags, CSRF on state-changing forms and on the sign-in
//! form, throttled sign-ins (also sent at once), the security headers of every
//! response, live streams that end at sign-out, and another tenant's run answered as a
//! missing one.

use std::time::Duration;

use reqwest::header::{self, COOKIE, LOCATION, RETRY_AFTER, SET_COOKIE};
use reqwest::{Client, StatusCode, redirect::Policy};

use crate::mesh::{ALICE, BOB, Mesh, ONCALL};

const ANALYST: &str = "analyst@globex";

/// Runs `future` to its end on a runtime of its own: the mesh is started (and its
/// PostgreSQL database made) outside of it.
fn block<F: std::future::Future>(future: F) -> F::Output {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a Tokio runtime")
        .block_on(future)
}

fn client() -> Client {
    // The workspace's reqwest brings no crypto provider of its own.
    let _ = rustls::crypto::ring::default_provider().install_default();
    Client::builder()
        .redirect(Policy::none())
        .build()
        .expect("an HTTP client")
}

fn credential(mesh: &Mesh, principal: &str) -> String {
    convene_mesh::policy_file::dev_credential(&mesh.data_dir().join("credentials"), principal)
        .expect("a development credential")
}

/// The `Set-Cookie` header of cookie `name` in a response.
fn set_cookie(response: &reqwest::Response, name: &str) -> Option<String> {
    response
        .headers()
        .get_all(SET_COOKIE)
        .iter()
        .map(|v| v.to_str().expect("ASCII").to_owned())
        .find(|v| v.starts_with(&format!("{name}=")))
}

/// The sign-in form: its pre-session cookie (`name=value`, with the whole `Set-Cookie`
/// header) and the CSRF token it carries.
async fn sign_in_form(mesh: &Mesh) -> (String, String, String) {
    let form = get(mesh, "/console/sign-in", None).await;
    assert_eq!(form.status(), StatusCode::OK);
    let set = set_cookie(&form, "convene_sign_in").expect("a pre-session cookie");
    let cookie = set.split(';').next().expect("a cookie").to_owned();
    let csrf = csrf_of(&form.text().await.expect("the form"));
    (set, cookie, csrf)
}

/// A sign-in through the form with `credential`.
async fn attempt(mesh: &Mesh, credential: &str) -> reqwest::Response {
    let (_, cookie, csrf) = sign_in_form(mesh).await;
    client()
        .post(format!("{}/console/sign-in", mesh.a2a))
        .header(COOKIE, cookie)
        .form(&[("credential", credential), ("csrf", &csrf)])
        .send()
        .await
        .expect("sign-in answers")
}

/// Signs in as `principal` through the form; the session's `Set-Cookie` header and the
/// cookie to send.
async fn sign_in(mesh: &Mesh, principal: &str) -> (String, String) {
    let response = attempt(mesh, &credential(mesh, principal)).await;
    assert_eq!(response.status(), StatusCode::SEE_OTHER);
    assert_eq!(response.headers()[LOCATION], "/console/runs");
    let set = set_cookie(&response, "convene_session").expect("a session cookie");
    let cookie = set.split(';').next().expect("a cookie").to_owned();
    (set, cookie)
}

async fn get(mesh: &Mesh, path: &str, cookie: Option<&str>) -> reqwest::Response {
    let mut request = client().get(format!("{}{path}", mesh.a2a));
    if let Some(cookie) = cookie {
        request = request.header(COOKIE, cookie);
    }
    request.send().await.expect("the console answers")
}

/// The CSRF token in a page's forms.
fn csrf_of(page: &str) -> String {
    let at = page
        .find("name=\"csrf\" value=\"")
        .expect("a form with the CSRF token")
        + "name=\"csrf\" value=\"".len();
    page[at..].split('"').next().expect("a value").to_owned()
}

/// A run of the example as ONCALL; its id.
fn a_run(mesh: &Mesh, key: &str) -> String {
    let (run, _) = mesh.incident(key);
    run["runId"].as_str().expect("runId").to_owned()
}

#[test]
fn no_page_answers_without_a_session() {
    let mesh = Mesh::start();
    let run_id = a_run(&mesh, "console-unsigned");
    block(async {
        for path in [
            "/console".to_owned(),
            "/console/".to_owned(),
            "/console/runs".to_owned(),
            "/console/runs?state=running".to_owned(),
            format!("/console/runs/{run_id}"),
        ] {
            for cookie in [None, Some("convene_session=0123abcd")] {
                let response = get(&mesh, &path, cookie).await;
                assert_eq!(
                    response.status(),
                    StatusCode::SEE_OTHER,
                    "{path} {cookie:?}"
                );
                assert_eq!(response.headers()[LOCATION], "/console/sign-in", "{path}");
                let body = response.text().await.unwrap();
                assert!(!body.contains(&run_id), "{path}: nothing of the run");
            }
        }
        let response = client()
            .post(format!("{}/console/sign-out", mesh.a2a))
            .form(&[("csrf", "x")])
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), StatusCode::SEE_OTHER);
        assert_eq!(response.headers()[LOCATION], "/console/sign-in");

        // The form itself answers, labelled.
        let form = get(&mesh, "/console/sign-in", None).await;
        assert_eq!(form.status(), StatusCode::OK);
        let form = form.text().await.unwrap();
        assert!(form.contains("<label for=\"credential\">"), "{form}");
        assert!(form.contains("id=\"credential\""), "{form}");
    });
}

#[test]
fn a_session_cookie_is_http_only_strict_and_expires_and_shows_the_runs() {
    let mesh = Mesh::start_with(|cmd| {
        cmd.env("CONVENE_JAEGER_URL", "http://jaeger.example:16686/");
    });
    let run_id = a_run(&mesh, "console-signed");
    a_run(&mesh, "console-signed-2");
    let trace_id = mesh.get_run(&run_id).trace_id;
    block(async {
        let (set, cookie) = sign_in(&mesh, ONCALL).await;
        for flag in [
            "HttpOnly",
            "SameSite=Strict",
            "Path=/console",
            "Max-Age=28800",
        ] {
            assert!(set.contains(flag), "{flag} in {set}");
        }
        assert!(!set.contains("Secure"), "plaintext listener: {set}");
        assert!(!set.contains(&credential(&mesh, ONCALL)), "{set}");

        let list = get(&mesh, "/console/runs", Some(&cookie)).await;
        assert_eq!(list.status(), StatusCode::OK);
        let list = list.text().await.unwrap();
        assert!(list.contains(&run_id), "{list}");
        assert!(
            list.contains("Signed in as <strong>oncall@acme</strong>"),
            "{list}"
        );

        // Filters: a state the run is not in hides it.
        let none = get(&mesh, "/console/runs?state=succeeded", Some(&cookie)).await;
        assert!(!none.text().await.unwrap().contains(&run_id));
        // A page at a time: with one run per page, the next page's link leads on, and
        // the filters travel with it.
        let first = get(&mesh, "/console/runs?size=1&since=1h", Some(&cookie)).await;
        let first = first.text().await.unwrap();
        let next = first
            .split("rel=\"next\" href=\"")
            .nth(1)
            .and_then(|rest| rest.split('"').next())
            .expect("a next page's link")
            .replace("&amp;", "&");
        assert!(
            next.contains("size=1") && next.contains("since=1h"),
            "{next}"
        );
        let second = get(&mesh, &next, Some(&cookie)).await.text().await.unwrap();
        let listed = |page: &str| page.matches("href=\"/console/runs/").count();
        assert_eq!((listed(&first), listed(&second)), (1, 1));
        assert_ne!(first, second);
        let bad = get(&mesh, "/console/runs?label=nokeyvalue", Some(&cookie)).await;
        assert_eq!(bad.status(), StatusCode::BAD_REQUEST);
        // Time: created in the last hour, not before an hour ago; a window backwards is
        // refused.
        let recent = get(&mesh, "/console/runs?since=1h", Some(&cookie)).await;
        assert!(recent.text().await.unwrap().contains(&run_id));
        let old = get(&mesh, "/console/runs?until=1h", Some(&cookie)).await;
        assert!(!old.text().await.unwrap().contains(&run_id));
        let backwards = get(&mesh, "/console/runs?since=1h&until=2h", Some(&cookie)).await;
        assert_eq!(backwards.status(), StatusCode::BAD_REQUEST);

        // The run page: its delegations and the conflict with both sides.
        let page = get(&mesh, &format!("/console/runs/{run_id}"), Some(&cookie)).await;
        assert_eq!(page.status(), StatusCode::OK);
        let page = page.text().await.unwrap();
        for part in [
            "Delegations",
            "logs-investigator",
            "Conflict: primary_cause",
            "waiting input",
            "CONFLICT_REQUIRES_HUMAN",
        ] {
            assert!(page.contains(part), "{part} in {page}");
        }
        assert!(page.matches("class=\"side\"").count() >= 2, "{page}");
        assert!(
            page.contains(&format!(
                "href=\"http://jaeger.example:16686/trace/{trace_id}\""
            )),
            "a link to the run's trace: {page}"
        );
    });
}

#[test]
fn another_tenants_run_is_not_found_as_a_missing_one() {
    let mesh = Mesh::start();
    let run_id = a_run(&mesh, "console-tenants");
    block(async {
        let (_, cookie) = sign_in(&mesh, ANALYST).await;
        let theirs = get(&mesh, &format!("/console/runs/{run_id}"), Some(&cookie)).await;
        assert_eq!(theirs.status(), StatusCode::NOT_FOUND);
        let made_up = "0190a1b2-c3d4-7e5f-8a9b-0c1d2e3f4a5b";
        let missing = get(&mesh, &format!("/console/runs/{made_up}"), Some(&cookie)).await;
        assert_eq!(missing.status(), StatusCode::NOT_FOUND);
        assert_eq!(
            theirs.text().await.unwrap().replace(&run_id, "RUN"),
            missing.text().await.unwrap().replace(made_up, "RUN")
        );
        let list = get(&mesh, "/console/runs", Some(&cookie)).await;
        assert_eq!(list.status(), StatusCode::OK);
        assert!(!list.text().await.unwrap().contains(&run_id));
    });
}

#[test]
fn a_form_without_the_sessions_csrf_token_is_refused() {
    let mesh = Mesh::start();
    block(async {
        let (_, cookie) = sign_in(&mesh, ONCALL).await;
        let page = get(&mesh, "/console/runs", Some(&cookie))
            .await
            .text()
            .await
            .unwrap();
        let csrf = csrf_of(&page);
        let sign_out = |form: Vec<(&'static str, String)>| {
            client()
                .post(format!("{}/console/sign-out", mesh.a2a))
                .header(COOKIE, cookie.clone())
                .form(&form)
                .send()
        };
        for form in [
            vec![],
            vec![("csrf", String::new())],
            vec![("csrf", "0".repeat(64))],
        ] {
            let refused = sign_out(form).await.unwrap();
            assert_eq!(refused.status(), StatusCode::FORBIDDEN);
            assert!(refused.headers().get(SET_COOKIE).is_none());
        }
        // Still signed in.
        assert_eq!(
            get(&mesh, "/console/runs", Some(&cookie)).await.status(),
            StatusCode::OK
        );
        let out = sign_out(vec![("csrf", csrf)]).await.unwrap();
        assert_eq!(out.status(), StatusCode::SEE_OTHER);
        assert!(
            out.headers()[SET_COOKIE]
                .to_str()
                .unwrap()
                .contains("Max-Age=0")
        );
        // The session is over on the server too: the old cookie no longer works.
        let after = get(&mesh, "/console/runs", Some(&cookie)).await;
        assert_eq!(after.status(), StatusCode::SEE_OTHER);
    });
}

#[test]
fn failed_sign_ins_are_throttled_and_roles_are_checked() {
    let mesh = Mesh::start();
    block(async {
        // A principal that may not view runs is told which role it lacks; that is no
        // successful sign-in, and it counts as an attempt.
        let workers = attempt(&mesh, &credential(&mesh, "worker-pool")).await;
        assert_eq!(workers.status(), StatusCode::FORBIDDEN);
        assert!(set_cookie(&workers, "convene_session").is_none());
        assert!(workers.text().await.unwrap().contains("runs:read"));

        for _ in 0..4 {
            let wrong = attempt(&mesh, "not-a-credential").await;
            assert_eq!(wrong.status(), StatusCode::UNAUTHORIZED);
            assert!(set_cookie(&wrong, "convene_session").is_none());
        }
        let throttled = attempt(&mesh, "not-a-credential").await;
        assert_eq!(throttled.status(), StatusCode::TOO_MANY_REQUESTS);
        let wait: u64 = throttled.headers()[RETRY_AFTER]
            .to_str()
            .unwrap()
            .parse()
            .unwrap();
        assert!((1..=300).contains(&wait), "{wait}");
        // Even the right credential waits now: nothing tells a guesser it was right.
        let right = attempt(&mesh, &credential(&mesh, ONCALL)).await;
        assert_eq!(right.status(), StatusCode::TOO_MANY_REQUESTS);
        assert!(set_cookie(&right, "convene_session").is_none());
    });
}

#[test]
fn wrong_sign_ins_sent_at_once_from_one_address_get_five_attempts() {
    let mesh = Mesh::start();
    block(async {
        let (_, cookie, csrf) = sign_in_form(&mesh).await;
        let start = std::sync::Arc::new(tokio::sync::Barrier::new(20));
        let sent: Vec<_> = (0..20)
            .map(|_| {
                let (url, cookie, csrf, start) = (
                    format!("{}/console/sign-in", mesh.a2a),
                    cookie.clone(),
                    csrf.clone(),
                    start.clone(),
                );
                tokio::spawn(async move {
                    start.wait().await;
                    client()
                        .post(url)
                        .header(COOKIE, cookie)
                        .form(&[("credential", "not-a-credential"), ("csrf", &csrf)])
                        .send()
                        .await
                        .expect("sign-in answers")
                        .status()
                })
            })
            .collect();
        let (mut checked, mut throttled) = (0, 0);
        for attempt in sent {
            match attempt.await.expect("the attempt answers") {
                StatusCode::UNAUTHORIZED => checked += 1,
                StatusCode::TOO_MANY_REQUESTS => throttled += 1,
                other => panic!("a wrong sign-in answered {other}"),
            }
        }
        assert!(
            checked <= 5,
            "{checked} of 20 reached the credential check, {throttled} were throttled"
        );
        assert_eq!(checked + throttled, 20);
        assert!(checked >= 1, "the first attempts are checked");
    });
}

#[test]
fn a_sign_in_without_its_forms_csrf_token_is_refused() {
    let mesh = Mesh::start();
    block(async {
        let (set, cookie, csrf) = sign_in_form(&mesh).await;
        for flag in ["HttpOnly", "SameSite=Strict", "Path=/console/sign-in"] {
            assert!(set.contains(flag), "{flag} in {set}");
        }
        let right = credential(&mesh, ONCALL);
        let post = |cookie: Option<String>, form: Vec<(&'static str, String)>| {
            let mut request = client().post(format!("{}/console/sign-in", mesh.a2a));
            if let Some(cookie) = cookie {
                request = request.header(COOKIE, cookie);
            }
            request.form(&form).send()
        };
        // More refusals than the throttle's attempts: none reaches the credential check.
        for _ in 0..2 {
            for (what, cookie, form) in [
                ("no token", None, vec![("credential", right.clone())]),
                (
                    "the cookie without the token",
                    Some(cookie.clone()),
                    vec![("credential", right.clone())],
                ),
                (
                    "the token without the cookie",
                    None,
                    vec![("credential", right.clone()), ("csrf", csrf.clone())],
                ),
                (
                    "a wrong token",
                    Some(cookie.clone()),
                    vec![("credential", right.clone()), ("csrf", "0".repeat(64))],
                ),
            ] {
                let refused = post(cookie, form).await.unwrap();
                assert_eq!(refused.status(), StatusCode::FORBIDDEN, "{what}");
                assert!(set_cookie(&refused, "convene_session").is_none(), "{what}");
                let page = refused.text().await.unwrap();
                assert!(page.contains("CSRF token"), "{what}: {page}");
            }
        }
        // With its token, the same credential signs in: nothing above was counted.
        let signed = post(
            Some(cookie.clone()),
            vec![("credential", right.clone()), ("csrf", csrf.clone())],
        )
        .await
        .unwrap();
        assert_eq!(signed.status(), StatusCode::SEE_OTHER);
        assert!(set_cookie(&signed, "convene_session").is_some());
    });
}

#[test]
fn cookies_are_secure_behind_an_https_public_url() {
    // TLS ends at an ingress: the gateway itself serves plaintext.
    let mesh = Mesh::start_with(|cmd| {
        cmd.args(["--public-url", "https://console.example.com/convene"]);
    });
    block(async {
        let (form, _, _) = sign_in_form(&mesh).await;
        assert!(form.contains("; Secure"), "{form}");
        let (set, cookie) = sign_in(&mesh, ONCALL).await;
        assert!(set.contains("; Secure"), "{set}");
        let page = get(&mesh, "/console/runs", Some(&cookie))
            .await
            .text()
            .await
            .unwrap();
        let out = client()
            .post(format!("{}/console/sign-out", mesh.a2a))
            .header(COOKIE, &cookie)
            .form(&[("csrf", csrf_of(&page))])
            .send()
            .await
            .unwrap();
        let cleared = set_cookie(&out, "convene_session").expect("the cookie cleared");
        assert!(
            cleared.contains("Max-Age=0") && cleared.contains("; Secure"),
            "{cleared}"
        );
    });
}

/// Asserts the console's security headers on `response` (`what`), and
/// `Cache-Control: no-store` when it carries data.
fn assert_secured(what: &str, response: &reqwest::Response, data: bool) {
    let value = |name: header::HeaderName| {
        response
            .headers()
            .get(&name)
            .unwrap_or_else(|| panic!("{what}: no {name} in {:?}", response.headers()))
            .to_str()
            .expect("ASCII")
            .to_owned()
    };
    let csp = value(header::CONTENT_SECURITY_POLICY);
    assert!(csp.contains("default-src 'self'"), "{what}: {csp}");
    assert!(csp.contains("frame-ancestors 'none'"), "{what}: {csp}");
    assert_eq!(value(header::X_FRAME_OPTIONS), "DENY", "{what}");
    assert_eq!(value(header::X_CONTENT_TYPE_OPTIONS), "nosniff", "{what}");
    assert_eq!(value(header::REFERRER_POLICY), "same-origin", "{what}");
    if data {
        assert_eq!(value(header::CACHE_CONTROL), "no-store", "{what}");
    }
}

#[test]
fn every_console_response_carries_the_security_headers() {
    let mesh = Mesh::start();
    let (run, approval) = mesh.incident("console-headers");
    let run_id = run["runId"].as_str().expect("runId").to_owned();
    block(async {
        let form = get(&mesh, "/console/sign-in", None).await;
        assert_secured("the sign-in form", &form, true);
        let unsigned = get(&mesh, "/console/runs", None).await;
        assert_eq!(unsigned.status(), StatusCode::SEE_OTHER);
        assert_secured("the redirect to sign in", &unsigned, true);
        let wrong = attempt(&mesh, "not-a-credential").await;
        assert_eq!(wrong.status(), StatusCode::UNAUTHORIZED);
        assert_secured("a failed sign-in", &wrong, true);
        let signed_in = attempt(&mesh, &credential(&mesh, ONCALL)).await;
        assert_eq!(signed_in.status(), StatusCode::SEE_OTHER);
        assert_secured("a sign-in", &signed_in, true);

        let (_, cookie) = sign_in(&mesh, ONCALL).await;
        let page = get(&mesh, &format!("/console/runs/{run_id}"), Some(&cookie))
            .await
            .text()
            .await
            .unwrap();
        let evidence = page
            .split("href=\"/console/evidence?")
            .nth(1)
            .and_then(|rest| rest.split('"').next())
            .expect("a claim's evidence link")
            .replace("&amp;", "&");
        for (path, status) in [
            ("/console/".to_owned(), StatusCode::SEE_OTHER),
            ("/console/runs".to_owned(), StatusCode::OK),
            (format!("/console/runs/{run_id}"), StatusCode::OK),
            (
                "/console/runs/0190a1b2-c3d4-7e5f-8a9b-0c1d2e3f4a5b".to_owned(),
                StatusCode::NOT_FOUND,
            ),
            (format!("/console/evidence?{evidence}"), StatusCode::OK),
            (
                format!("/console/evidence?{evidence}&verify=1"),
                StatusCode::OK,
            ),
            ("/console/approvals".to_owned(), StatusCode::OK),
            (format!("/console/approvals/{approval}"), StatusCode::OK),
            ("/console/no-such-page".to_owned(), StatusCode::NOT_FOUND),
        ] {
            let response = get(&mesh, &path, Some(&cookie)).await;
            assert_eq!(response.status(), status, "{path}");
            assert_secured(&path, &response, true);
        }
        let refused = client()
            .post(format!("{}/console/sign-out", mesh.a2a))
            .header(COOKIE, &cookie)
            .form(&[("csrf", "wrong")])
            .send()
            .await
            .unwrap();
        assert_eq!(refused.status(), StatusCode::FORBIDDEN);
        assert_secured("a refused form", &refused, true);
        for asset in ["/console/assets/console.css", "/console/assets/console.js"] {
            let response = get(&mesh, asset, None).await;
            assert_eq!(response.status(), StatusCode::OK, "{asset}");
            assert_secured(asset, &response, false);
        }
        for stream in [
            format!("/console/runs/{run_id}/events"),
            format!("/console/approvals/{approval}/events?since=0"),
        ] {
            let response = get(&mesh, &stream, Some(&cookie)).await;
            assert_eq!(response.status(), StatusCode::OK, "{stream}");
            assert_eq!(
                response.headers()[header::CONTENT_TYPE],
                "text/event-stream"
            );
            assert_secured(&stream, &response, true);
        }
    });
}

/// Reads a stream until it ends; false when it is still open after `limit`.
async fn ends_within(stream: &mut reqwest::Response, limit: Duration) -> bool {
    tokio::time::timeout(limit, async {
        while let Ok(Some(_)) = stream.chunk().await {}
    })
    .await
    .is_ok()
}

#[test]
fn a_live_stream_ends_when_its_session_is_signed_out() {
    // Sessions checked every 200 ms: checks of sessions still open leave their streams be.
    let mesh = Mesh::start_with(|cmd| {
        cmd.env("CONVENE_CONSOLE_LIVE_RECHECK", "200ms");
    });
    let (_, approval_id) = mesh.incident("console-stream-sign-out");
    block(async {
        let (_, cookie) = sign_in(&mesh, ONCALL).await;
        let (_, other) = sign_in(&mesh, ONCALL).await;
        // The stream an approval request's page follows: open until its session ends.
        let page = get(
            &mesh,
            &format!("/console/approvals/{approval_id}"),
            Some(&cookie),
        )
        .await
        .text()
        .await
        .unwrap();
        let path = page
            .split("data-live=\"")
            .nth(1)
            .and_then(|rest| rest.split('"').next())
            .expect("a live stream on the request's page")
            .replace("&amp;", "&");
        let mut stream = get(&mesh, &path, Some(&cookie)).await;
        assert_eq!(stream.status(), StatusCode::OK);
        let mut others = get(&mesh, &path, Some(&other)).await;
        assert_eq!(others.status(), StatusCode::OK);
        assert!(
            !ends_within(&mut stream, Duration::from_secs(1)).await,
            "a signed-in session's stream stays open across checks"
        );

        let page = get(&mesh, "/console/runs", Some(&cookie))
            .await
            .text()
            .await
            .unwrap();
        let out = client()
            .post(format!("{}/console/sign-out", mesh.a2a))
            .header(COOKIE, &cookie)
            .form(&[("csrf", csrf_of(&page))])
            .send()
            .await
            .unwrap();
        assert_eq!(out.status(), StatusCode::SEE_OTHER);
        assert!(
            ends_within(&mut stream, Duration::from_secs(5)).await,
            "the stream ended with its session"
        );
        assert!(
            !ends_within(&mut others, Duration::from_millis(600)).await,
            "another session's stream goes on"
        );
        // Opened again with the old cookie: sent to sign in.
        let again = get(&mesh, &path, Some(&cookie)).await;
        assert_eq!(again.status(), StatusCode::SEE_OTHER);
    });
}

/// Reads a console event stream until it has sent `count` `changed` events (`what`
/// caused them), for at most a minute.
async fn live_events(stream: &mut reqwest::Response, count: usize, what: &str) {
    let mut seen = String::new();
    let arrived = tokio::time::timeout(std::time::Duration::from_secs(60), async {
        while let Some(chunk) = stream.chunk().await.expect("the stream goes on") {
            seen.push_str(&String::from_utf8_lossy(&chunk));
            if seen.matches("event: changed").count() >= count {
                return true;
            }
        }
        false
    })
    .await;
    assert_eq!(arrived, Ok(true), "{what} on the stream: {seen}");
}

/// The value of the first input named `name` in a page.
fn field(page: &str, name: &str) -> String {
    let at = page
        .find(&format!("name=\"{name}\""))
        .unwrap_or_else(|| panic!("a field {name} in {page}"));
    let tag = &page[at..page[at..].find('>').map_or(page.len(), |end| at + end)];
    let value = tag
        .split("value=\"")
        .nth(1)
        .unwrap_or_else(|| panic!("field {name} has a value: {tag}"));
    value.split('"').next().expect("a value").to_owned()
}

async fn post(mesh: &Mesh, path: &str, cookie: &str, form: &[(&str, String)]) -> reqwest::Response {
    client()
        .post(format!("{}{path}", mesh.a2a))
        .header(COOKIE, cookie)
        .form(form)
        .send()
        .await
        .expect("the console answers")
}

#[test]
fn two_people_approve_an_r3_action_in_two_sessions_then_it_is_executed() {
    let mesh = Mesh::start();
    let (_, approval_id) = mesh.incident("console-approvals");
    block(async {
        let path = format!("/console/approvals/{approval_id}");

        // The requester may not vote: oncall@acme lacks approvals:decide.
        let (_, oncall) = sign_in(&mesh, ONCALL).await;
        let page = get(&mesh, &path, Some(&oncall)).await.text().await.unwrap();
        let hash = field(&page, "parameters_hash");
        assert!(hash.starts_with("sha256:"), "{hash}");
        assert!(page.contains("rule:rollback"), "{page}");
        let refused = post(
            &mesh,
            &format!("{path}/decide"),
            &oncall,
            &[
                ("csrf", field(&page, "csrf")),
                ("parameters_hash", hash.clone()),
                ("decision", "approve".into()),
            ],
        )
        .await;
        assert_eq!(refused.status(), StatusCode::FORBIDDEN);
        assert!(refused.text().await.unwrap().contains("approvals:decide"));

        // alice and bob, each in a session of their own.
        let (_, alice) = sign_in(&mesh, ALICE).await;
        let (_, bob) = sign_in(&mesh, BOB).await;
        let queue = get(&mesh, "/console/approvals", Some(&alice))
            .await
            .text()
            .await
            .unwrap();
        assert!(queue.contains(&approval_id), "{queue}");

        // A vote pinned to other parameters is refused and counts nothing.
        let alice_page = get(&mesh, &path, Some(&alice)).await.text().await.unwrap();
        let stale = post(
            &mesh,
            &format!("{path}/decide"),
            &alice,
            &[
                ("csrf", field(&alice_page, "csrf")),
                ("parameters_hash", format!("sha256:{}", "0".repeat(64))),
                ("decision", "approve".into()),
            ],
        )
        .await;
        assert!(stale.status().is_client_error(), "{}", stale.status());

        // alice's page follows the request: bob's vote shows up on its stream.
        let live = alice_page
            .split("data-live=\"")
            .nth(1)
            .and_then(|rest| rest.split('"').next())
            .expect("a live stream on the request's page")
            .replace("&amp;", "&");
        let mut stream = get(&mesh, &live, Some(&alice)).await;
        assert_eq!(stream.status(), StatusCode::OK);
        for (who, cookie) in [(ALICE, &alice), (BOB, &bob)] {
            let page = get(&mesh, &path, Some(cookie)).await.text().await.unwrap();
            let voted = post(
                &mesh,
                &format!("{path}/decide"),
                cookie,
                &[
                    ("csrf", field(&page, "csrf")),
                    ("parameters_hash", field(&page, "parameters_hash")),
                    ("decision", "approve".into()),
                    ("comment", format!("checked by {who}")),
                ],
            )
            .await;
            assert_eq!(voted.status(), StatusCode::SEE_OTHER, "{who}");
        }
        live_events(&mut stream, 2, "both votes").await;
        let approved = get(&mesh, &path, Some(&bob)).await.text().await.unwrap();
        assert!(approved.contains("approved"), "{approved}");
        assert!(
            approved.contains("checked by alice@acme") && approved.contains("checked by bob@acme")
        );
        assert!(
            !approved.contains("class=\"decide\""),
            "no more votes once approved"
        );

        let executed = post(
            &mesh,
            &format!("{path}/execute"),
            &bob,
            &[
                ("csrf", field(&approved, "csrf")),
                ("parameters_hash", field(&approved, "parameters_hash")),
            ],
        )
        .await;
        assert_eq!(executed.status(), StatusCode::SEE_OTHER);
        let done = get(&mesh, &path, Some(&bob)).await.text().await.unwrap();
        assert!(done.contains("Executed by bob@acme"), "{done}");
        assert!(!done.contains("class=\"execute\""), "executed once");
    });
}

#[test]
fn a_waiting_run_is_settled_from_its_page() {
    let mesh = Mesh::start();
    let run_id = a_run(&mesh, "console-settle");
    block(async {
        let (_, cookie) = sign_in(&mesh, ONCALL).await;
        let path = format!("/console/runs/{run_id}");
        let page = get(&mesh, &path, Some(&cookie)).await.text().await.unwrap();
        assert!(page.contains("Which side of"), "{page}");
        let side = field(&page, "delegation_id");

        // The page follows the run: its event stream, opened before anything changes.
        let live = page
            .split("data-live=\"")
            .nth(1)
            .and_then(|rest| rest.split('"').next())
            .expect("a live stream on the run page")
            .replace("&amp;", "&");
        let unsigned = get(&mesh, &live, None).await;
        assert_eq!(
            unsigned.status(),
            StatusCode::SEE_OTHER,
            "no stream without a session"
        );
        let mut stream = get(&mesh, &live, Some(&cookie)).await;
        assert_eq!(stream.status(), StatusCode::OK);
        assert_eq!(
            stream.headers()[reqwest::header::CONTENT_TYPE],
            "text/event-stream"
        );
        let script = get(&mesh, "/console/assets/console.js", None).await;
        assert_eq!(script.status(), StatusCode::OK);
        assert!(script.text().await.unwrap().contains("EventSource"));
        let settled = post(
            &mesh,
            &format!("{path}/resume"),
            &cookie,
            &[
                ("csrf", field(&page, "csrf")),
                ("ticket_id", field(&page, "ticket_id")),
                ("ticket_version", field(&page, "ticket_version")),
                ("kind", "settle".into()),
                ("topic", field(&page, "topic")),
                ("delegation_id", side),
                ("rationale", "the pool ran dry first".into()),
            ],
        )
        .await;
        assert_eq!(settled.status(), StatusCode::SEE_OTHER);
        // The stream says so, without the page being asked again.
        live_events(&mut stream, 1, "the settlement").await;
        // The run goes on; its page no longer asks which side holds.
        let mut after = String::new();
        for _ in 0..50 {
            after = get(&mesh, &path, Some(&cookie)).await.text().await.unwrap();
            if !after.contains("waiting input") {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        }
        assert!(!after.contains("waiting input"), "{after}");
        assert!(!after.contains("Which side of"), "{after}");
        assert!(after.contains("Decisions people took"), "{after}");
        assert!(after.contains("the pool ran dry first"), "{after}");

        // The same ticket again is refused by the supervisor, with its reason.
        let again = post(
            &mesh,
            &format!("{path}/resume"),
            &cookie,
            &[
                ("csrf", field(&page, "csrf")),
                ("ticket_id", field(&page, "ticket_id")),
                ("ticket_version", field(&page, "ticket_version")),
                ("kind", "close".into()),
                ("rationale", "again".into()),
            ],
        )
        .await;
        assert!(again.status().is_client_error(), "{}", again.status());
    });
}

#[test]
fn a_claims_evidence_leads_to_its_artifact_whose_hash_verifies() {
    let mesh = Mesh::start();
    let run_id = a_run(&mesh, "console-evidence");
    block(async {
        let (_, cookie) = sign_in(&mesh, ONCALL).await;
        let page = get(&mesh, &format!("/console/runs/{run_id}"), Some(&cookie))
            .await
            .text()
            .await
            .unwrap();
        let link = page
            .split("href=\"/console/evidence?")
            .nth(1)
            .and_then(|rest| rest.split('"').next())
            .expect("a claim's evidence link")
            .replace("&amp;", "&");
        let evidence = get(&mesh, &format!("/console/evidence?{link}"), Some(&cookie)).await;
        assert_eq!(evidence.status(), StatusCode::OK);
        let evidence = evidence.text().await.unwrap();
        assert!(evidence.contains("Recorded hash"), "{evidence}");
        assert!(evidence.contains("sha256:"), "{evidence}");
        assert!(evidence.contains("Artifact content"), "{evidence}");
        assert!(!evidence.contains("Verified:"), "checked only on request");

        let verified = get(
            &mesh,
            &format!("/console/evidence?{link}&verify=1"),
            Some(&cookie),
        )
        .await;
        assert_eq!(verified.status(), StatusCode::OK);
        let verified = verified.text().await.unwrap();
        assert!(verified.contains("Verified: the artifact"), "{verified}");

        // Another tenant sees none of it.
        let (_, analyst) = sign_in(&mesh, ANALYST).await;
        let theirs = get(&mesh, &format!("/console/evidence?{link}"), Some(&analyst)).await;
        assert_eq!(theirs.status(), StatusCode::NOT_FOUND);
        assert!(!theirs.text().await.unwrap().contains("sha256:"));
    });
}
