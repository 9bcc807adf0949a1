//! Authorize over a real socket: every attack on a token is refused with its specific
//! reason, calls are counted, revocation bites, and every decision is logged once.

use std::time::Duration;

use crate::support::{Harness, LOGS_WORKER, SUPERVISOR, policy_yaml, range, reason};
use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use convene_mesh::auth::request;
use convene_policy::decision_log::{JsonlDecisionLog, LogEntry};
use convene_proto::v1::{self, AuthorizeReason, revoke_request::Target};
use convene_tokens::{Signer, SigningKey};
use futures::StreamExt as _;

#[tokio::test]
async fn a_flipped_bit_at_any_byte_of_a_real_token_is_denied() {
    let h = Harness::start().await;
    let issued = h.issue_one("run-flip", h.logs_grant("del-1")).await;
    let original = h.authorize(h.search_call(&issued.token)).await;
    assert!(
        original.allowed,
        "the untouched token works: {}",
        original.detail
    );

    let token = issued.token.as_bytes().to_vec();
    let forgeries: Vec<String> = (0..token.len())
        .map(|i| {
            let mut bytes = token.clone();
            // A different bit at each position; below 0x80, so the result stays ASCII
            // and reaches the service as a string.
            bytes[i] ^= 1 << (i % 7);
            String::from_utf8(bytes).expect("ASCII")
        })
        .collect();
    let answers: Vec<(usize, v1::AuthorizeResponse)> =
        futures::stream::iter(forgeries.iter().enumerate())
            .map(|(i, forged)| {
                let h = &h;
                async move { (i, h.authorize(h.search_call(forged)).await) }
            })
            .buffer_unordered(16)
            .collect()
            .await;

    assert_eq!(answers.len(), token.len());
    for (i, answer) in &answers {
        assert!(!answer.allowed, "flipping a bit at byte {i} was allowed");
        assert!(
            matches!(
                reason(answer),
                AuthorizeReason::Malformed
                    | AuthorizeReason::BadSignature
                    | AuthorizeReason::UnknownKey
            ),
            "byte {i}: {:?} {}",
            reason(answer),
            answer.detail
        );
        assert_eq!(
            answer.calls_used, 0,
            "a forgery learns nothing about the counter"
        );
    }
    // Every one of them was logged as a deny; only the untouched call consumed a call.
    let decisions = h.decisions();
    assert_eq!(decisions.len(), token.len() + 1);
    assert_eq!(decisions.iter().filter(|d| d.allowed).count(), 1);
    let again = h.authorize(h.search_call(&issued.token)).await;
    assert_eq!(again.calls_used, 2);
}

#[tokio::test]
async fn tokens_signed_by_unknown_keys_or_forged_kids_are_refused() {
    let h = Harness::start().await;
    let issued = h.issue_one("run-keys", h.logs_grant("del-1")).await;
    let claims = crate::support::claims_of(&issued.token);

    let stranger = Signer::new(SigningKey::generate().unwrap());
    let foreign = stranger.sign(&claims).unwrap();
    let answer = h.authorize(h.search_call(&foreign)).await;
    assert_eq!(
        reason(&answer),
        AuthorizeReason::UnknownKey,
        "{}",
        answer.detail
    );
    assert!(answer.detail.contains(stranger.kid()), "{}", answer.detail);

    // The real header (naming the ring's key) over the stranger's payload and signature.
    let real_header = issued.token.split('.').next().unwrap();
    let (_, rest) = foreign.split_once('.').unwrap();
    let forged = format!("{real_header}.{rest}");
    let answer = h.authorize(h.search_call(&forged)).await;
    assert_eq!(
        reason(&answer),
        AuthorizeReason::BadSignature,
        "{}",
        answer.detail
    );

    // An unsigned token claiming the ring's key is not even looked at.
    let header = URL_SAFE_NO_PAD.encode(format!(
        r#"{{"alg":"none","typ":"JWT","kid":"{}"}}"#,
        stranger.kid()
    ));
    let payload = issued.token.split('.').nth(1).unwrap();
    let answer = h
        .authorize(h.search_call(&format!("{header}.{payload}.")))
        .await;
    assert_eq!(
        reason(&answer),
        AuthorizeReason::Malformed,
        "{}",
        answer.detail
    );
    assert!(!answer.allowed);
}

#[tokio::test]
async fn the_validity_window_follows_the_clock() {
    let h = Harness::start().await;
    let mut grant = h.logs_grant("del-1");
    grant.ttl = Some(prost_types::Duration {
        seconds: 600,
        nanos: 0,
    });
    let issued = h.issue_one("run-time", grant).await;

    h.clock.set(h.t0 + Duration::from_secs(600));
    let answer = h.authorize(h.search_call(&issued.token)).await;
    assert_eq!(
        reason(&answer),
        AuthorizeReason::Expired,
        "{}",
        answer.detail
    );

    h.clock.set(h.t0 - Duration::from_secs(5));
    let answer = h.authorize(h.search_call(&issued.token)).await;
    assert_eq!(
        reason(&answer),
        AuthorizeReason::NotYetValid,
        "{}",
        answer.detail
    );

    h.clock.set(h.t0 + Duration::from_secs(599));
    let answer = h.authorize(h.search_call(&issued.token)).await;
    assert!(answer.allowed, "{}", answer.detail);
}

#[tokio::test]
async fn audience_and_tenant_must_match_the_token() {
    let h = Harness::start().await;
    let token = h.issue_one("run-aud", h.logs_grant("del-1")).await.token;

    let mut call = h.search_call(&token);
    call.audience = "worker:metrics-investigator".into();
    let answer = h.authorize(call).await;
    assert_eq!(
        reason(&answer),
        AuthorizeReason::WrongAudience,
        "{}",
        answer.detail
    );
    assert!(answer.detail.contains(LOGS_WORKER), "{}", answer.detail);

    // Every token names the evidence store in its audience, but the evidence store is
    // not who presents a token to Authorize: the audience is bound to the presenter,
    // the worker of the token's profile, whatever the token lists.
    let mut call = h.search_call(&token);
    call.audience = "convene-evidence-store".into();
    let answer = h.authorize(call).await;
    assert_eq!(
        reason(&answer),
        AuthorizeReason::WrongAudience,
        "{}",
        answer.detail
    );
    assert!(
        answer.detail.contains("bound to the presenter"),
        "{}",
        answer.detail
    );
    // Left out, it is the presenter's; the call is decided on its merits.
    let mut call = h.search_call(&token);
    call.audience = String::new();
    let answer = h.authorize(call).await;
    assert!(answer.allowed, "{}", answer.detail);

    // Without may_redelegate the supervisor is not an audience either.
    let mut call = h.search_call(&token);
    call.audience = "convene-supervisor".into();
    assert_eq!(
        reason(&h.authorize(call).await),
        AuthorizeReason::WrongAudience
    );

    let mut call = h.search_call(&token);
    call.tenant = "globex".into();
    let answer = h.authorize(call).await;
    assert_eq!(
        reason(&answer),
        AuthorizeReason::WrongTenant,
        "{}",
        answer.detail
    );
    assert!(answer.detail.contains("acme"), "{}", answer.detail);

    let mut call = h.search_call(&token);
    call.tenant = "acme".into();
    assert!(h.authorize(call).await.allowed);
}

#[tokio::test]
async fn scopes_tools_and_data_scope_are_enforced() {
    let h = Harness::start().await;
    let token = h.issue_one("run-scope", h.logs_grant("del-1")).await.token;

    let inside = h.authorize(h.search_call(&token)).await;
    assert!(inside.allowed, "{}", inside.detail);
    assert_eq!(inside.risk_level, i32::from(v1::RiskLevel::R0));

    // The task scope limits resources to service/payment-*.
    let mut call = h.search_call(&token);
    call.resource = "service/checkout".into();
    let answer = h.authorize(call).await;
    assert_eq!(
        reason(&answer),
        AuthorizeReason::ScopeNotGranted,
        "{}",
        answer.detail
    );
    assert!(
        answer.detail.contains("service/checkout"),
        "{}",
        answer.detail
    );

    // The tool performs logs:read; it cannot be used to write.
    let mut call = h.search_call(&token);
    call.action = "logs:write".into();
    assert_eq!(
        reason(&h.authorize(call).await),
        AuthorizeReason::ScopeNotGranted
    );

    // In the catalog and the profile, but not asked for: not in the token.
    let mut call = h.search_call(&token);
    call.tool = "query_metrics@1".into();
    call.action = "metrics:read".into();
    call.resource = "metric/payment_success_rate".into();
    let answer = h.authorize(call).await;
    assert_eq!(
        reason(&answer),
        AuthorizeReason::ToolNotGranted,
        "{}",
        answer.detail
    );

    let mut call = h.search_call(&token);
    call.tool = "grep@9".into();
    let answer = h.authorize(call).await;
    assert_eq!(
        reason(&answer),
        AuthorizeReason::UnknownTool,
        "{}",
        answer.detail
    );
    assert_eq!(answer.risk_level, i32::from(v1::RiskLevel::Unspecified));

    // Data outside the task's time window.
    let mut call = h.search_call(&token);
    call.data_scope = Some(v1::DataScope {
        time_range: Some(range(
            h.t0 - Duration::from_secs(7200),
            h.t0 - Duration::from_secs(60),
        )),
        max_rows: 100,
    });
    let answer = h.authorize(call).await;
    assert_eq!(
        reason(&answer),
        AuthorizeReason::DataScopeExceeded,
        "{}",
        answer.detail
    );

    // More rows than the profile's capability allows (500).
    let mut call = h.search_call(&token);
    call.data_scope.as_mut().unwrap().max_rows = 10_000;
    let answer = h.authorize(call).await;
    assert_eq!(
        reason(&answer),
        AuthorizeReason::DataScopeExceeded,
        "{}",
        answer.detail
    );
    assert!(
        answer.detail.contains("max_rows 10000"),
        "{}",
        answer.detail
    );

    // No data scope at all is an unbounded read, which a limited token does not cover.
    let mut call = h.search_call(&token);
    call.data_scope = None;
    assert_eq!(
        reason(&h.authorize(call).await),
        AuthorizeReason::DataScopeExceeded
    );

    // A malformed data scope is a bad request, not a decision.
    let mut call = h.search_call(&token);
    call.data_scope = Some(v1::DataScope {
        time_range: Some(range(h.t0, h.t0 - Duration::from_secs(1))),
        max_rows: 1,
    });
    let status = h.client().await.authorize(call).await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::InvalidArgument);
    assert!(
        status.message().contains("data_scope.time_range"),
        "{}",
        status.message()
    );
}

#[tokio::test]
async fn only_allowed_calls_count_and_the_fourth_of_three_is_denied() {
    let h = Harness::start().await;
    let mut grant = h.logs_grant("del-1");
    grant.max_calls = 3;
    let token = h.issue_one("run-calls", grant).await.token;

    let mut wrong = h.search_call(&token);
    wrong.audience = "worker:other".into();
    for expected in 1..=3 {
        assert_eq!(
            reason(&h.authorize(wrong.clone()).await),
            AuthorizeReason::WrongAudience
        );
        let answer = h.authorize(h.search_call(&token)).await;
        assert!(answer.allowed, "call {expected}: {}", answer.detail);
        assert_eq!(answer.calls_used, expected);
    }
    let fourth = h.authorize(h.search_call(&token)).await;
    assert_eq!(
        reason(&fourth),
        AuthorizeReason::CallLimitExceeded,
        "{}",
        fourth.detail
    );
    assert_eq!(fourth.calls_used, 3);
    assert!(fourth.detail.contains("max_calls"), "{}", fourth.detail);
}

#[tokio::test]
async fn revoked_tokens_and_runs_are_refused() {
    let h = Harness::start().await;
    let both = h
        .issue("run-a", vec![h.logs_grant("del-1"), h.logs_grant("del-2")])
        .await
        .unwrap()
        .tokens;
    let other_run = h.issue_one("run-b", h.logs_grant("del-3")).await;
    let mut client = h.client().await;

    let revoke = |target: Target| v1::RevokeRequest {
        target: Some(target),
        reason: "leaked in a log line".into(),
    };
    client
        .revoke(request(
            revoke(Target::TokenId(both[0].token_id.clone())),
            SUPERVISOR,
        ))
        .await
        .unwrap();
    let answer = h.authorize(h.search_call(&both[0].token)).await;
    assert_eq!(
        reason(&answer),
        AuthorizeReason::Revoked,
        "{}",
        answer.detail
    );
    assert!(
        answer.detail.contains("leaked in a log line"),
        "{}",
        answer.detail
    );
    assert!(h.authorize(h.search_call(&both[1].token)).await.allowed);

    client
        .revoke(request(revoke(Target::RunId("run-a".into())), SUPERVISOR))
        .await
        .unwrap();
    let answer = h.authorize(h.search_call(&both[1].token)).await;
    assert_eq!(
        reason(&answer),
        AuthorizeReason::Revoked,
        "{}",
        answer.detail
    );
    assert!(answer.detail.contains("run run-a"), "{}", answer.detail);
    assert!(h.authorize(h.search_call(&other_run.token)).await.allowed);

    // A revoked run gets no new tokens.
    let status = h
        .issue("run-a", vec![h.logs_grant("del-4")])
        .await
        .unwrap_err();
    assert_eq!(status.code(), tonic::Code::FailedPrecondition);
    assert!(
        status.message().contains("run run-a was revoked"),
        "{}",
        status.message()
    );
}

#[tokio::test]
async fn one_call_revokes_several_runs_after_checking_them_all() {
    let h = Harness::start().await;
    let a = h.issue_one("run-a", h.logs_grant("del-1")).await.token;
    let b = h.issue_one("run-b", h.logs_grant("del-2")).await.token;
    let c = h.issue_one("run-c", h.logs_grant("del-3")).await.token;
    let mut client = h.client().await;
    let runs = |ids: &[&str]| v1::RevokeRequest {
        target: Some(Target::RunIds(v1::RunIds {
            run_ids: ids.iter().map(|id| (*id).to_owned()).collect(),
        })),
        reason: "runs finished".into(),
    };

    // A bad list is refused whole, naming what to fix; nothing of it is revoked.
    let many: Vec<String> = (0..1_001).map(|i| format!("run-{i}")).collect();
    let many: Vec<&str> = many.iter().map(String::as_str).collect();
    for (ids, field, says) in [
        (&[][..], "run_ids", "at least one run"),
        (&["run-a", " "][..], "run_ids[1]", "must not be empty"),
        (&many[..], "run_ids", "at most 1000"),
    ] {
        let status = client
            .revoke(request(runs(ids), SUPERVISOR))
            .await
            .unwrap_err();
        assert_eq!(status.code(), tonic::Code::InvalidArgument, "{field}");
        assert!(status.message().contains(field), "{}", status.message());
        assert!(status.message().contains(says), "{}", status.message());
    }
    assert!(h.authorize(h.search_call(&a)).await.allowed);

    // A run named twice is revoked once; a run not named keeps its tokens.
    let answer = client
        .revoke(request(runs(&["run-a", "run-b", "run-a"]), SUPERVISOR))
        .await
        .unwrap()
        .into_inner();
    assert!(answer.revoked);
    for (token, run) in [(&a, "run run-a"), (&b, "run run-b")] {
        let answer = h.authorize(h.search_call(token)).await;
        assert_eq!(
            reason(&answer),
            AuthorizeReason::Revoked,
            "{}",
            answer.detail
        );
        assert!(answer.detail.contains(run), "{}", answer.detail);
        assert!(answer.detail.contains("runs finished"), "{}", answer.detail);
    }
    assert!(h.authorize(h.search_call(&c)).await.allowed);

    // Each run is its own record in the decision log.
    let revoked: Vec<(String, String)> = JsonlDecisionLog::read(h.config.decision_log_path())
        .unwrap()
        .into_iter()
        .filter_map(|e| match e {
            LogEntry::Revoke(r) => Some((r.target, r.id)),
            LogEntry::Authorize(_) => None,
        })
        .collect();
    assert_eq!(
        revoked,
        [
            ("run".to_owned(), "run-a".to_owned()),
            ("run".to_owned(), "run-b".to_owned())
        ]
    );
}

#[tokio::test]
async fn a_revocation_outranks_every_other_reason_and_consumes_no_call() {
    let h = Harness::start().await;
    let issued = h.issue_one("run-r", h.logs_grant("del-1")).await;
    assert!(h.authorize(h.search_call(&issued.token)).await.allowed);
    let mut client = h.client().await;
    client
        .revoke(request(
            v1::RevokeRequest {
                target: Some(Target::TokenId(issued.token_id.clone())),
                reason: "rotated".into(),
            },
            SUPERVISOR,
        ))
        .await
        .unwrap();

    // Calls that would be refused for another reason anyway are refused as revoked.
    let wrong_audience = v1::AuthorizeRequest {
        audience: "worker:someone-else".into(),
        ..h.search_call(&issued.token)
    };
    let unknown_tool = v1::AuthorizeRequest {
        tool: "no_such_tool@1".into(),
        ..h.search_call(&issued.token)
    };
    let wrong_tenant = v1::AuthorizeRequest {
        tenant: "globex".into(),
        ..h.search_call(&issued.token)
    };
    for (call, what) in [
        (h.search_call(&issued.token), "an otherwise allowed call"),
        (wrong_audience, "the wrong audience"),
        (unknown_tool, "an unknown tool"),
        (wrong_tenant, "another tenant"),
    ] {
        let answer = h.authorize(call).await;
        assert_eq!(
            reason(&answer),
            AuthorizeReason::Revoked,
            "{what}: {}",
            answer.detail
        );
        assert!(
            answer.detail.contains("rotated"),
            "{what}: {}",
            answer.detail
        );
        assert_eq!(
            answer.calls_used, 1,
            "{what}: a refused call is not counted"
        );
    }
    let logged: Vec<(bool, String, u32)> = h
        .decisions()
        .into_iter()
        .map(|d| (d.allowed, d.reason, d.calls_used))
        .collect();
    let mut expected = vec![(true, "AUTHORIZE_REASON_ALLOWED".to_owned(), 1)];
    expected.extend((0..4).map(|_| (false, "AUTHORIZE_REASON_REVOKED".to_owned(), 1)));
    assert_eq!(logged, expected);
}

#[tokio::test]
async fn a_runtime_rule_added_after_issue_denies_at_authorize() {
    let first = Harness::start().await;
    let grant = v1::TokenGrantRequest {
        delegation_id: "del-fix".into(),
        profile_id: "remediator".into(),
        depth: 1,
        required_scopes: vec![crate::support::scope("rules:write", "rule/*")],
        task_scope: None,
        tools: vec!["rollback_rule@1".into()],
        max_calls: 0,
        may_redelegate: false,
        ttl: None,
        max_depth: 0,
    };
    let token = first.issue_one("run-fix", grant).await.token;
    let call = v1::AuthorizeRequest {
        token: token.clone(),
        tool: "rollback_rule@1".into(),
        action: String::new(), // the catalog action, rules:write
        resource: "rule/risk-velocity-7".into(),
        data_scope: None,
        audience: "worker:remediator".into(),
        tenant: "acme".into(),
        tool_call_id: "call-9".into(),
    };
    let answer = first.authorize(call.clone()).await;
    assert!(answer.allowed, "{}", answer.detail);
    assert_eq!(answer.risk_level, i32::from(v1::RiskLevel::R3));

    // The same keys, a policy with a rule for remediators: the token has not changed,
    // the policy has.
    let Harness { dir, clock, .. } = first;
    let rule =
        "  - { name: freeze-remediation, applies_to: remediator, deny_risk_at_or_above: R3 }";
    let second = Harness::start_in(dir, &policy_yaml(rule), clock).await;
    let answer = second.authorize(call).await;
    assert_eq!(
        reason(&answer),
        AuthorizeReason::PolicyDenied,
        "{}",
        answer.detail
    );
    assert!(
        answer.detail.contains("freeze-remediation"),
        "{}",
        answer.detail
    );
}

#[tokio::test]
async fn every_decision_appends_exactly_one_record_with_its_reason() {
    let h = Harness::start().await;
    let mut grant = h.logs_grant("del-log");
    grant.max_calls = 1;
    let token = h.issue_one("run-log", grant).await.token;

    let mut wrong_tenant = h.search_call(&token);
    wrong_tenant.tenant = "globex".into();
    let mut unknown_tool = h.search_call(&token);
    unknown_tool.tool = "grep@9".into();
    let calls = vec![
        h.search_call(&token),
        h.search_call(&token),
        wrong_tenant,
        unknown_tool,
        h.search_call("not-a-token"),
    ];
    let mut answers = Vec::new();
    for call in calls {
        answers.push(h.authorize(call).await);
    }
    let expected = [
        AuthorizeReason::Allowed,
        AuthorizeReason::CallLimitExceeded,
        AuthorizeReason::WrongTenant,
        AuthorizeReason::UnknownTool,
        AuthorizeReason::Malformed,
    ];
    let got: Vec<_> = answers.iter().map(reason).collect();
    assert_eq!(got, expected);

    let records = h.decisions();
    assert_eq!(records.len(), answers.len());
    for (record, answer) in records.iter().zip(&answers) {
        assert_eq!(record.decision_id, answer.decision_id);
        assert_eq!(record.reason, reason(answer).as_str_name());
        assert_eq!(record.allowed, answer.allowed);
        assert_eq!(record.detail, answer.detail);
        assert_eq!(record.calls_used, answer.calls_used);
        assert_eq!(record.resource, "service/payment-api");
    }
    let claims = crate::support::claims_of(&token);
    assert_eq!(records[0].token_id, claims.token_id);
    assert_eq!(records[0].run_id, "run-log");
    assert_eq!(records[0].delegation_id, "del-log");
    assert_eq!(records[0].tenant, "acme");
    assert_eq!(records[0].tool, "search_logs@1");
    assert_eq!(records[0].tool_call_id, "call-1");
    // A token that does not verify names nothing it claims.
    assert_eq!(records[4].token_id, "");
    assert_eq!(records[4].tenant, "");
    // Decision ids are UUIDv7, so they sort by time.
    let mut ids: Vec<_> = records.iter().map(|r| r.decision_id.clone()).collect();
    ids.dedup();
    assert_eq!(ids.len(), records.len());
    assert!(uuid::Uuid::parse_str(&ids[0]).unwrap().get_version_num() == 7);
}
