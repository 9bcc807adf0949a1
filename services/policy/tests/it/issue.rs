//! IssueTaskToken, Revoke, GetSigningKeys and the service plumbing over a real socket.

use std::io::BufRead as _;
use std::process::{Command, Stdio};
use std::time::Duration;

use crate::support::{GLOBEX, Harness, ONCALL, POOL, SUPERVISOR, reason, scope};
use convene_core::permissions::{Permission, PermissionSet};
use convene_mesh::auth::request;
use convene_policy::decision_log::{JsonlDecisionLog, LogEntry};
use convene_proto::v1::{self, AuthorizeReason, revoke_request::Target};

#[tokio::test]
async fn tokens_carry_the_intersection_and_narrowed_says_what_was_dropped() {
    let h = Harness::start().await;
    let mut grant = h.logs_grant("del-1");
    // The profile may hold changes:read, but oncall@acme was never granted it; logs:*
    // is wider than the grants too; rollback_rule@1 is R3 and the profile investigates.
    grant.required_scopes = vec![
        scope("logs:*", "service/*"),
        scope("changes:read", "change/*"),
        scope("evidence:write", "evidence"),
    ];
    grant.task_scope.as_mut().unwrap().resources = vec![
        "service/payment-*".into(),
        "change/*".into(),
        "evidence".into(),
    ];
    grant.tools = vec!["search_logs@1".into(), "rollback_rule@1".into()];
    let issued = h.issue_one("run-1", grant).await;

    let scopes = PermissionSet::from_proto(&issued.scopes, "scopes").unwrap();
    let window = convene_core::permissions::time_window_from_proto(&h.window(), "w").unwrap();
    let mut logs = Permission::new("logs:read", "service/payment-*").unwrap();
    logs.data.time = window;
    logs.data.max_rows = Some(500);
    let mut evidence = Permission::new("evidence:write", "evidence").unwrap();
    evidence.data.time = window;
    assert_eq!(scopes, PermissionSet::from_permissions([logs, evidence]));
    assert_eq!(issued.tools, vec!["search_logs@1".to_owned()]);

    let narrowed = issued.narrowed.join("\n");
    assert!(
        narrowed.contains("required_scopes[0] `logs:* on service/*`: beyond the grants of principal oncall@acme and the capabilities of profile logs-investigator"),
        "{narrowed}"
    );
    assert!(
        narrowed.contains("required_scopes[1] `changes:read on change/*`: beyond the grants of principal oncall@acme"),
        "{narrowed}"
    );
    assert!(narrowed.contains("granted nothing of it"), "{narrowed}");
    assert!(
        narrowed.contains("tool `rollback_rule@1`: risk R3 is denied to profile logs-investigator by runtime rule `investigators-are-read-only`"),
        "{narrowed}"
    );
    assert!(!narrowed.contains("required_scopes[2]"), "{narrowed}");

    // The token says the same as the response, and it works as described.
    let claims = crate::support::claims_of(&issued.token);
    assert_eq!(claims.permissions().unwrap(), scopes);
    assert_eq!(claims.token_id, issued.token_id);
    assert_eq!(claims.subject, "oncall@acme");
    assert_eq!(claims.tenant, "acme");
    assert_eq!(claims.run_id, "run-1");
    assert_eq!(claims.delegation_id, "del-1");
    assert_eq!(claims.issuer, "convene-policy");
    assert_eq!(claims.max_calls, 32);
    assert_eq!(claims.expires_at - claims.issued_at, 15 * 60);
    assert_eq!(
        claims.audience,
        vec!["worker:logs-investigator", "convene-evidence-store"]
    );
    let mut change_call = h.search_call(&issued.token);
    change_call.action = "changes:read".into();
    change_call.resource = "change/risk-rule-7".into();
    assert_eq!(
        reason(&h.authorize(change_call).await),
        AuthorizeReason::ScopeNotGranted
    );
}

#[tokio::test]
async fn child_tokens_can_only_narrow_their_parent() {
    let h = Harness::start().await;
    let mut parent_grant = h.logs_grant("del-parent");
    parent_grant.may_redelegate = true;
    parent_grant.max_calls = 10;
    let parent = h.issue_one("run-nested", parent_grant).await;
    let parent_claims = crate::support::claims_of(&parent.token);
    assert!(
        parent_claims
            .audience
            .contains(&"convene-supervisor".to_owned())
    );

    // Asking for the logs of one service without the parent's row limit is asking for
    // more than the parent holds.
    let mut child = h.logs_grant("del-child");
    child.depth = 2;
    child.required_scopes = vec![scope("logs:read", "service/payment-api")];
    child.max_calls = 0;
    let status = h
        .issue_child(&parent.token, child.clone())
        .await
        .unwrap_err();
    assert_eq!(status.code(), tonic::Code::PermissionDenied);
    assert!(
        status
            .message()
            .contains("no row limit where the parent limits it to")
            && status.message().contains("max_rows 500"),
        "{}",
        status.message()
    );
    child.required_scopes[0].data_scope = Some(v1::DataScope {
        time_range: None,
        max_rows: 200,
    });
    let issued = h
        .issue_child(&parent.token, child.clone())
        .await
        .unwrap()
        .tokens;
    let claims = crate::support::claims_of(&issued[0].token);
    assert_eq!(
        claims.parent_token_id.as_deref(),
        Some(parent.token_id.as_str())
    );
    assert_eq!(claims.run_id, "run-nested");
    assert_eq!(claims.tenant, "acme");
    assert_eq!(claims.depth, 2);
    assert_eq!(
        claims.max_calls, 10,
        "the default is capped by the parent's max_calls"
    );
    assert!(claims.expires_at <= parent_claims.expires_at);
    // It only reaches what the parent reached, inside the parent's window and rows.
    let scopes = claims.permissions().unwrap();
    assert!(scopes.is_subset_of(&parent_claims.permissions().unwrap()));
    let mut call = h.search_call(&issued[0].token);
    assert!(h.authorize(call.clone()).await.allowed);
    call.resource = "service/payment-gateway".into();
    assert_eq!(
        reason(&h.authorize(call).await),
        AuthorizeReason::ScopeNotGranted
    );

    // Wider than the parent in resources: refused, naming the scope.
    let mut wider = child.clone();
    wider.required_scopes[0].resource = "service/*".into();
    wider.task_scope.as_mut().unwrap().resources = vec!["service/*".into()];
    let status = h.issue_child(&parent.token, wider).await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::PermissionDenied);
    assert!(
        status.message().contains("grants[0].required_scopes[0]")
            && status.message().contains("`logs:read on service/*")
            && status
                .message()
                .contains("wider than the parent token allows")
            && status.message().contains("no parent scope reaches"),
        "{}",
        status.message()
    );

    // A tool the parent does not hold: refused, naming the tool.
    let mut tool = child.clone();
    tool.tools = vec!["query_metrics@1".into()];
    let status = h.issue_child(&parent.token, tool).await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::PermissionDenied);
    assert!(
        status.message().contains("query_metrics@1"),
        "{}",
        status.message()
    );

    let mut calls = child.clone();
    calls.max_calls = 11;
    let status = h.issue_child(&parent.token, calls).await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::PermissionDenied);
    assert!(
        status.message().contains("max_calls 11"),
        "{}",
        status.message()
    );

    let mut depth = child.clone();
    depth.depth = 3;
    let status = h.issue_child(&parent.token, depth).await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::InvalidArgument);
    assert!(
        status.message().contains("grants[0].depth"),
        "{}",
        status.message()
    );

    // Once the parent is revoked, the request that succeeded above is refused.
    h.client()
        .await
        .revoke(request(
            v1::RevokeRequest {
                target: Some(Target::TokenId(parent.token_id.clone())),
                reason: "leaked".into(),
            },
            SUPERVISOR,
        ))
        .await
        .unwrap();
    let status = h.issue_child(&parent.token, child).await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::PermissionDenied);
    assert!(
        status.message().contains("parent token was revoked")
            && status.message().contains("leaked"),
        "{}",
        status.message()
    );
}

#[tokio::test]
async fn redelegation_and_depth_are_limited() {
    let h = Harness::start().await;
    let no_redelegation = h.issue_one("run-d", h.logs_grant("del-1")).await;
    let mut child = h.logs_grant("del-2");
    child.depth = 2;
    child.task_scope = None;
    child.required_scopes = vec![scope("logs:read", "service/payment-api")];
    let status = h
        .issue_child(&no_redelegation.token, child.clone())
        .await
        .unwrap_err();
    assert_eq!(status.code(), tonic::Code::PermissionDenied);
    assert!(
        status
            .message()
            .contains("parent token does not allow redelegation"),
        "{}",
        status.message()
    );

    let mut top = h.logs_grant("del-3");
    top.depth = 4;
    top.max_depth = 3;
    let status = h.issue("run-d", vec![top]).await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::FailedPrecondition);
    assert!(
        status.message().contains(
            "depth 4 exceeds max_depth 3; the delegating agent must handle the task itself"
        ),
        "{}",
        status.message()
    );

    let mut parent = h.logs_grant("del-4");
    parent.may_redelegate = true;
    parent.max_depth = 1;
    let parent = h.issue_one("run-d", parent).await;
    child.max_depth = 1;
    let status = h
        .issue_child(&parent.token, child.clone())
        .await
        .unwrap_err();
    assert_eq!(status.code(), tonic::Code::FailedPrecondition);
    assert!(
        status.message().contains("depth 2 exceeds max_depth 1"),
        "{}",
        status.message()
    );

    // An expired parent is no credential for children.
    h.clock.set(h.t0 + Duration::from_secs(3600));
    child.max_depth = 3;
    let status = h.issue_child(&parent.token, child).await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::Unauthenticated);
    assert!(status.message().contains("EXPIRED"), "{}", status.message());
}

#[tokio::test]
async fn issuing_needs_the_role_and_a_valid_request() {
    let h = Harness::start().await;
    let mut client = h.client().await;
    let valid = v1::IssueTaskTokenRequest {
        lease_epoch: 0,
        principal: "oncall@acme".into(),
        run_id: "run-1".into(),
        parent_token: String::new(),
        grants: vec![h.logs_grant("del-1")],
    };

    let status = client
        .issue_task_token(tonic::Request::new(valid.clone()))
        .await
        .unwrap_err();
    assert_eq!(status.code(), tonic::Code::Unauthenticated);

    let status = client
        .issue_task_token(request(valid.clone(), ONCALL))
        .await
        .unwrap_err();
    assert_eq!(status.code(), tonic::Code::PermissionDenied);
    assert!(
        status.message().contains("tokens:issue"),
        "{}",
        status.message()
    );

    let token = h.issue_one("run-1", h.logs_grant("del-1")).await.token;
    let status = client
        .issue_task_token(request(valid.clone(), &token))
        .await
        .unwrap_err();
    assert_eq!(status.code(), tonic::Code::Unauthenticated);

    let mut unknown_profile = valid.clone();
    let mut grant = h.logs_grant("del-2");
    grant.profile_id = "astrologer".into();
    unknown_profile.grants.push(grant);
    let status = client
        .issue_task_token(request(unknown_profile, SUPERVISOR))
        .await
        .unwrap_err();
    assert_eq!(status.code(), tonic::Code::InvalidArgument);
    assert!(
        status.message().contains("grants[1].profile_id")
            && status.message().contains("astrologer"),
        "{}",
        status.message()
    );

    let mut none = valid.clone();
    none.grants.clear();
    let status = client
        .issue_task_token(request(none, SUPERVISOR))
        .await
        .unwrap_err();
    assert_eq!(status.code(), tonic::Code::InvalidArgument);
    assert!(status.message().contains("grants"), "{}", status.message());

    let mut too_many = valid.clone();
    too_many.grants = (0..257)
        .map(|i| h.logs_grant(&format!("del-{i}")))
        .collect();
    let status = client
        .issue_task_token(request(too_many, SUPERVISOR))
        .await
        .unwrap_err();
    assert_eq!(status.code(), tonic::Code::InvalidArgument);
    assert!(
        status.message().contains("at most 256"),
        "{}",
        status.message()
    );

    let mut stranger = valid;
    stranger.principal = "mallory@acme".into();
    let status = client
        .issue_task_token(request(stranger, SUPERVISOR))
        .await
        .unwrap_err();
    assert_eq!(status.code(), tonic::Code::NotFound);
    assert!(
        status.message().contains("mallory@acme"),
        "{}",
        status.message()
    );
}

#[tokio::test]
async fn people_revoke_their_own_tenant_and_revocations_are_logged() {
    let h = Harness::start().await;
    let token = h.issue_one("run-own", h.logs_grant("del-1")).await.token;
    let mut client = h.client().await;
    let by_run = |run: &str| v1::RevokeRequest {
        target: Some(Target::RunId(run.into())),
        reason: "wrong incident".into(),
    };

    let status = client
        .revoke(request(by_run("run-own"), GLOBEX))
        .await
        .unwrap_err();
    assert_eq!(status.code(), tonic::Code::PermissionDenied);
    assert!(
        status.message().contains("tenant globex"),
        "{}",
        status.message()
    );

    let status = client
        .revoke(request(by_run("run-own"), POOL))
        .await
        .unwrap_err();
    assert_eq!(status.code(), tonic::Code::PermissionDenied);
    assert!(
        status.message().contains("tokens:issue"),
        "{}",
        status.message()
    );

    let status = client
        .revoke(request(
            v1::RevokeRequest {
                target: None,
                reason: String::new(),
            },
            ONCALL,
        ))
        .await
        .unwrap_err();
    assert_eq!(status.code(), tonic::Code::InvalidArgument);

    assert!(h.authorize(h.search_call(&token)).await.allowed);
    let answer = client
        .revoke(request(by_run("run-own"), ONCALL))
        .await
        .unwrap()
        .into_inner();
    assert!(answer.revoked);
    assert_eq!(
        reason(&h.authorize(h.search_call(&token)).await),
        AuthorizeReason::Revoked
    );

    let entries = JsonlDecisionLog::read(h.config.decision_log_path()).unwrap();
    let revocations: Vec<_> = entries
        .iter()
        .filter_map(|e| match e {
            LogEntry::Revoke(r) => Some(r),
            LogEntry::Authorize(_) => None,
        })
        .collect();
    assert_eq!(revocations.len(), 1);
    assert_eq!(revocations[0].principal, "oncall@acme");
    assert_eq!(
        (revocations[0].target.as_str(), revocations[0].id.as_str()),
        ("run", "run-own")
    );
    assert_eq!(revocations[0].reason, "wrong incident");
}

#[tokio::test]
async fn rotated_keys_keep_earlier_tokens_valid() {
    let h = Harness::start().await;
    let mut client = h.client().await;
    let before = client
        .get_signing_keys(v1::GetSigningKeysRequest::default())
        .await
        .unwrap()
        .into_inner()
        .keys;
    assert_eq!(before.len(), 1);
    assert_eq!(
        (before[0].kty.as_str(), before[0].crv.as_str()),
        ("OKP", "Ed25519")
    );
    let old = h.issue_one("run-rot", h.logs_grant("del-1")).await.token;

    let new_kid = h.service.rotate_key().unwrap();
    let after = client
        .get_signing_keys(v1::GetSigningKeysRequest::default())
        .await
        .unwrap()
        .into_inner()
        .keys;
    let kids: Vec<&str> = after.iter().map(|k| k.kid.as_str()).collect();
    assert_eq!(kids, vec![new_kid.as_str(), before[0].kid.as_str()]);

    let new = h.issue_one("run-rot", h.logs_grant("del-2")).await.token;
    assert_ne!(
        new.split('.').next(),
        old.split('.').next(),
        "a new kid in the header"
    );
    assert!(h.authorize(h.search_call(&old)).await.allowed);
    assert!(h.authorize(h.search_call(&new)).await.allowed);

    // The ring is on disk: a restarted service, rotated once more at start as
    // `--rotate-key` does, still accepts both.
    let Harness {
        dir, clock, config, ..
    } = h;
    let newest = convene_policy::rotate_signing_key(&config).unwrap();
    let restarted = Harness::start_in(dir, &crate::support::policy_yaml(""), clock).await;
    let keys = restarted
        .client()
        .await
        .get_signing_keys(v1::GetSigningKeysRequest::default())
        .await
        .unwrap()
        .into_inner()
        .keys;
    assert_eq!(keys.len(), 3);
    assert_eq!(keys[0].kid, newest);
    assert!(
        restarted
            .authorize(restarted.search_call(&old))
            .await
            .allowed
    );
    assert!(
        restarted
            .authorize(restarted.search_call(&new))
            .await
            .allowed
    );
}

#[tokio::test]
async fn health_and_reflection_answer() {
    use tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};
    use tonic_reflection::pb::v1::{
        ServerReflectionRequest, server_reflection_client::ServerReflectionClient,
        server_reflection_request::MessageRequest, server_reflection_response::MessageResponse,
    };

    let h = Harness::start().await;
    let status = HealthClient::new(h.server.channel().await)
        .check(HealthCheckRequest {
            service: "convene.v1.Policy".into(),
        })
        .await
        .unwrap()
        .into_inner()
        .status;
    assert_eq!(
        status,
        tonic_health::pb::health_check_response::ServingStatus::Serving as i32
    );

    let list = ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::ListServices(String::new())),
    };
    let mut answers = ServerReflectionClient::new(h.server.channel().await)
        .server_reflection_info(tokio_stream::once(list))
        .await
        .unwrap()
        .into_inner();
    let answer = answers.message().await.unwrap().expect("one answer");
    let Some(MessageResponse::ListServicesResponse(services)) = answer.message_response else {
        panic!("not a service list: {answer:?}");
    };
    let names: Vec<_> = services.service.iter().map(|s| s.name.as_str()).collect();
    assert!(names.contains(&"convene.v1.Policy"), "{names:?}");
}

#[test]
fn the_binary_dumps_its_config_and_says_when_it_runs_on_development_settings() {
    let binary = env!("CARGO_BIN_EXE_convene-policy");
    let cwd = tempfile::tempdir().unwrap();

    let dump = Command::new(binary)
        .args(["--dump-config", "--data-dir", "/srv/convene"])
        .current_dir(cwd.path())
        .env_remove("CONVENE_CONFIG")
        .output()
        .unwrap();
    assert!(
        dump.status.success(),
        "{}",
        String::from_utf8_lossy(&dump.stderr)
    );
    let text = String::from_utf8(dump.stdout).unwrap();
    assert!(text.contains("listen = \"127.0.0.1:7401\""), "{text}");
    assert!(text.contains("data_dir = \"/srv/convene\""), "{text}");
    assert!(text.contains("decision_log = \"file\""), "{text}");

    let mut child = Command::new(binary)
        .args(["--listen", "127.0.0.1:0"])
        .current_dir(cwd.path())
        .env_remove("CONVENE_CONFIG")
        .env_remove("RUST_LOG")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = child.stderr.take().unwrap();
    let (lines, received) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stderr).lines() {
            if lines.send(line.unwrap_or_default()).is_err() {
                break;
            }
        }
    });
    let mut seen = Vec::new();
    let listening = loop {
        match received.recv_timeout(Duration::from_secs(60)) {
            Ok(line) => {
                let done = line.contains("gRPC server listening");
                seen.push(line);
                if done {
                    break true;
                }
            }
            Err(_) => break false,
        }
    };
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(listening, "the server did not start: {seen:#?}");
    // First the warning that development credentials are generated, then what the
    // development settings are.
    assert!(seen[0].contains("DEVELOPMENT CREDENTIALS"), "{seen:#?}");
    assert!(
        seen[1].contains(
            "no --config given: using the development settings of the payment-incident example (data dir ./.convene"
        ),
        "{seen:#?}"
    );
    // Development credentials and the key ring were created under ./.convene.
    let data = cwd.path().join(".convene");
    assert!(data.join("credentials/oncall@acme.secret").is_file());
    assert!(data.join("policy/keys/signing-keys.json").is_file());
}

#[tokio::test]
async fn shutdown_lets_an_in_flight_authorize_finish() {
    use std::sync::Arc;

    use convene_mesh::policy_file::Policy;
    use convene_policy::PolicyService;
    use convene_policy::decision_log::{DecisionLog, LogError, MemoryDecisionLog};
    use convene_server::test_util::TestServer;
    use convene_server::{GrpcServer, ServerSettings};
    use tokio::sync::{Notify, Semaphore};

    /// Holds each append until the test lets it go, so a call is still in flight when
    /// shutdown starts.
    #[derive(Debug)]
    struct Gate {
        inner: MemoryDecisionLog,
        entered: Notify,
        open: Semaphore,
    }

    #[async_trait::async_trait]
    impl DecisionLog for Gate {
        async fn append(&self, entry: LogEntry) -> Result<(), LogError> {
            self.entered.notify_one();
            let _permit = self.open.acquire().await.expect("the gate stays open");
            self.inner.append(entry).await
        }
    }

    // The parts of a `Harness`, with the gated log in place of the file.
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("policy.yaml");
    std::fs::write(&file, crate::support::policy_yaml("")).unwrap();
    let ring = convene_tokens::KeyRing::open(dir.path().join("keys")).unwrap();
    let gate = Arc::new(Gate {
        inner: MemoryDecisionLog::new(),
        entered: Notify::new(),
        open: Semaphore::new(0),
    });
    let service = PolicyService::builder(Policy::load(&file).unwrap(), ring)
        .decision_log(gate.clone())
        .build();
    let server =
        TestServer::start(service.add_to(GrpcServer::new(ServerSettings::default()))).await;
    let mut client = v1::policy_client::PolicyClient::new(server.channel().await);

    let grant = v1::TokenGrantRequest {
        delegation_id: "del-1".into(),
        profile_id: "logs-investigator".into(),
        depth: 1,
        required_scopes: vec![scope("logs:read", "service/*")],
        tools: vec!["search_logs@1".into()],
        ..Default::default()
    };
    let token = client
        .issue_task_token(request(
            v1::IssueTaskTokenRequest {
                lease_epoch: 0,
                principal: "oncall@acme".into(),
                run_id: "run-drain".into(),
                parent_token: String::new(),
                grants: vec![grant],
            },
            SUPERVISOR,
        ))
        .await
        .unwrap()
        .into_inner()
        .tokens
        .remove(0)
        .token;
    let call = v1::AuthorizeRequest {
        token,
        tool: "search_logs@1".into(),
        action: "logs:read".into(),
        resource: "service/payment-api".into(),
        data_scope: Some(v1::DataScope {
            time_range: None,
            max_rows: 10,
        }),
        audience: crate::support::LOGS_WORKER.into(),
        tenant: String::new(),
        tool_call_id: String::new(),
    };
    let in_flight = tokio::spawn(async move { client.authorize(call).await });
    gate.entered.notified().await;
    server.shutdown.trigger();
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(!server.is_finished(), "serve waits for the call in flight");
    gate.open.add_permits(1);
    let answer = in_flight
        .await
        .unwrap()
        .expect("the call is answered")
        .into_inner();
    assert!(answer.allowed, "{}", answer.detail);
    tokio::time::timeout(Duration::from_secs(10), server.join())
        .await
        .expect("serve returns once drained")
        .unwrap();
    assert_eq!(
        gate.inner.entries().len(),
        1,
        "the decision was logged before the answer"
    );
}

#[tokio::test]
async fn who_am_i_names_only_the_principal_whose_credential_calls_it() {
    let h = Harness::start().await;
    let mut client = h.client().await;

    // A principal learns about itself: id, kind and roles, nothing it could not send.
    let me = client
        .who_am_i(request(v1::WhoAmIRequest {}, SUPERVISOR))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        (me.principal_id.as_str(), me.kind.as_str()),
        ("supervisor", "service")
    );
    assert!(me.roles.contains(&"tokens:issue".to_owned()), "{me:?}");
    let person = client
        .who_am_i(request(v1::WhoAmIRequest {}, ONCALL))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        (person.principal_id.as_str(), person.kind.as_str()),
        ("oncall@acme", "human")
    );

    // No credential, a wrong one, or a task token: refused, naming nobody.
    let anonymous = client
        .who_am_i(tonic::Request::new(v1::WhoAmIRequest {}))
        .await
        .unwrap_err();
    assert_eq!(anonymous.code(), tonic::Code::Unauthenticated);
    let wrong = client
        .who_am_i(request(v1::WhoAmIRequest {}, "cvn_not_a_credential"))
        .await
        .unwrap_err();
    assert_eq!(wrong.code(), tonic::Code::Unauthenticated);
    let token = h.issue_one("run-whoami", h.logs_grant("del-1")).await.token;
    let task = client
        .who_am_i(request(v1::WhoAmIRequest {}, &token))
        .await
        .unwrap_err();
    assert_eq!(task.code(), tonic::Code::Unauthenticated, "{task:?}");
    assert!(
        task.message().contains("principal credentials only"),
        "{task:?}"
    );
}
