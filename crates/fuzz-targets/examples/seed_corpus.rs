//! Writes the seed inputs of every fuzz target into `fuzz/corpus/<target>/`, from the
//! files of `examples/` and requests built from them as the services build theirs.
//!
//! `cargo run -p convene-fuzz-targets --example seed_corpus [DIR]` (again after an
//! example changes; files are named by content, so a seed written twice is one file).
//! With `DIR`, the seeds go to `DIR/<target>/` instead, e.g. to merge a grown corpus
//! into them.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use a2a::{Message as A2aMessage, Part, Role, SendMessageRequest};
use convene_core::time::{to_duration, to_timestamp};
use convene_core::validate;
use convene_fuzz_targets::fixtures;
use convene_fuzz_targets::playbook::OUTPUT_SEPARATOR;
use convene_proto::v1;
use convene_supervisor::plan::{self, Placement};
use prost::Message as _;
use serde_json::json;
use sha2::{Digest, Sha256};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let out = std::env::args_os()
        .nth(1)
        .map_or_else(|| root.join("fuzz/corpus"), PathBuf::from);
    let mut seeds = Seeds::new(out);
    let examples = root.join("examples");
    let read = |path: &str| std::fs::read_to_string(examples.join(path));

    // Run specs: the example files, in YAML and in the JSON mapping.
    let mut specs = Vec::new();
    for name in [
        "run.yaml",
        "run-model.yaml",
        "run-mcp.yaml",
        "run-planner.yaml",
        "run-planner-model.yaml",
    ] {
        let text = read(&format!("payment-incident/{name}"))?;
        let spec = convene_cli::spec::parse(&text, Path::new(name))?;
        let json = convene_proto::json::to_string(&spec)?;
        seeds.add("run_spec_file", text.as_bytes());
        seeds.add("run_spec_file", json.as_bytes());
        seeds.add("run_spec_json", json.as_bytes());
        specs.push(spec);
    }
    seeds.add("run_spec_json", br#"{"goal":"g","join":{"strategy":"JOIN_STRATEGY_ALL"},"delegations":[{"name":"a","profileId":"logs-investigator","goal":"g","timeout":"1s"}]}"#);

    // The operator's files.
    for name in ["payment-incident/policy.yaml", "mcp/policy.yaml"] {
        seeds.add("policy_file", read(name)?.as_bytes());
    }
    seeds.add("policy_file", POLICY_TOML.as_bytes());
    let mut profile_files = Vec::new();
    for name in ["payment-incident/profiles.yaml", "mcp/profiles.yaml"] {
        let text = read(name)?;
        seeds.add("worker_profiles", text.as_bytes());
        profile_files.push(text);
    }

    // Playbooks and planners, each with an output for its rules or a decision.
    let output = json!({
        "matched": 1200,
        "groups": {"timeout": 83, "ok": 1117, "POOL_EXHAUSTED": 41},
        "first_ts": "2026-07-23T02:01:30Z",
        "changes": [{"rule_id": "RC-4711", "time": "2026-07-23T02:01:00Z", "owner": "risk-team"}],
        "before": 99.6, "after": 93.1, "change_point": "2026-07-23T02:02:00Z",
    });
    let decision = json!({
        "round": 1,
        "decision": {
            "outcome": "CONFLICT",
            "accepted": [{"delegation_id": "d1", "profile_id": "logs-investigator",
                "claims": [{"claim_id": "claim-log-cause", "topic": "primary_cause",
                    "value": "connection_pool_exhaustion", "statement": "s",
                    "evidence_refs": ["logs://pool_exhaustion"]}]}],
            "rejected": [],
            "conflicts": [{"topic": "primary_cause"}],
            "missing_required": [],
        },
        "next": "settle the conflict",
    });
    for text in &profile_files {
        let file: serde_yaml::Value = serde_yaml::from_str(text)?;
        let profiles = file["profiles"].as_sequence().cloned().unwrap_or_default();
        for profile in profiles {
            for (section, extra) in [("playbook", &output), ("planner", &decision)] {
                if let Some(s) = profile.get(section) {
                    let yaml = serde_yaml::to_string(s)?;
                    seeds.add(
                        "playbook",
                        format!("{yaml}{OUTPUT_SEPARATOR}{extra}").as_bytes(),
                    );
                }
            }
        }
    }

    // The requests of the example run, as the supervisor and the workers send them.
    let now = fixtures::now();
    let policy = fixtures::policy();
    let mut tasks = Vec::new();
    for spec in &specs {
        seeds.proto(
            "start_run_request",
            &v1::StartRunRequest {
                spec: Some(spec.clone()),
                wait: true,
                ..Default::default()
            },
        );
        let domain = validate::run_spec(spec, now)?;
        for (i, (planned, wire)) in domain.plan.iter().zip(&spec.delegations).enumerate() {
            let at = Placement {
                run_id: "run-1",
                parent: None,
                depth: 1,
                round: 0,
                call_index: u32::try_from(i)?,
            };
            tasks.push(plan::task(
                planned,
                wire,
                at,
                policy,
                now,
                domain.limits.deadline,
            ));
        }
        if !spec.delegations.is_empty() {
            seeds.proto(
                "delegate_request",
                &v1::DelegateRequest {
                    delegations: spec.delegations.clone(),
                },
            );
        }
    }
    seeds.proto(
        "start_run_request",
        &v1::StartRunRequest {
            template: "payment-incident-triage".into(),
            inputs: [("note".to_owned(), "paged at 02:05".to_owned())].into(),
            spec: Some(v1::RunSpec {
                idempotency_key: "a2a:m-1".into(),
                ..Default::default()
            }),
            ..Default::default()
        },
    );

    let mut claims = fixtures::claims();
    let logs = policy
        .profiles
        .get("logs-investigator")
        .ok_or("the example policy has the logs investigator")?;
    claims.set_permissions(&logs.capabilities);
    let token = fixtures::signer().sign(&claims)?;
    let mut grants = Vec::new();
    for task in &tasks {
        seeds.proto(
            "worker_execute_request",
            &v1::WorkerExecuteRequest {
                lease_valid_until: None,
                task: Some(task.clone()),
                task_token: token.clone(),
                attempt: 1,
            },
        );
        grants.push(plan::grant(task, 2, now));
    }
    seeds.proto(
        "issue_task_token_request",
        &v1::IssueTaskTokenRequest {
            lease_epoch: 0,
            principal: "oncall@acme".into(),
            run_id: "run-1".into(),
            parent_token: String::new(),
            grants: grants.clone(),
        },
    );
    for grant in grants.iter().take(3) {
        seeds.proto(
            "issue_task_token_request",
            &v1::IssueTaskTokenRequest {
                lease_epoch: 0,
                principal: "oncall@acme".into(),
                run_id: "run-1".into(),
                parent_token: token.clone(),
                grants: vec![grant.clone()],
            },
        );
    }

    let window = v1::TimeRange {
        start: Some(to_timestamp(now - Duration::from_secs(900))),
        end: Some(to_timestamp(now)),
    };
    let authorize = |tool: &str, action: &str, resource: &str, token: &str| v1::AuthorizeRequest {
        token: token.to_owned(),
        tool: tool.into(),
        action: action.into(),
        resource: resource.into(),
        data_scope: Some(v1::DataScope {
            time_range: Some(window),
            max_rows: 500,
        }),
        audience: "worker:logs-investigator".into(),
        tenant: "acme-payments".into(),
        tool_call_id: "call-1".into(),
    };
    let calls = [
        authorize("search_logs@1", "logs:read", "service/payment-api", &token),
        authorize("search_logs@1", "", "service/risk-gateway", &token),
        authorize(
            "query_metrics@1",
            "metrics:read",
            "metric/payment.success_rate",
            &token,
        ),
        authorize(
            "search_logs@1",
            "logs:read",
            "service/payment-api",
            "not.a.token",
        ),
    ];
    for call in &calls {
        seeds.proto("authorize_request", call);
    }

    let parameters = convene_approval::canonical::struct_from_json(&json!({
        "rule_id": "RC-4711",
        "to_version": 3,
        "share": 0.05,
        "reason": "line\nbreak \"quoted\" \u{1}",
        "targets": ["payment-api", {"region": "eu-1"}, null, true, -0.0, 1e300],
    }))?;
    for (action, risk) in [
        ("rule:rollback", v1::RiskLevel::R3),
        ("traffic:shift", v1::RiskLevel::R2),
    ] {
        seeds.proto(
            "request_approval_request",
            &v1::RequestApprovalRequest {
                action: action.into(),
                parameters: Some(parameters.clone()),
                risk_level: risk as i32,
                idempotency_key: format!("run-1/{action}"),
                evidence_refs: vec!["logs://pool_exhaustion".into()],
                expires_in: Some(to_duration(Duration::from_secs(3600))),
                run_id: "run-1".into(),
                rationale: "the rule coincides with the drop".into(),
                on_behalf_of: "oncall@acme".into(),
            },
        );
    }

    let content = read("payment-incident/data/metrics/payment.success_rate.json")?;
    let artifact =
        convene_evidence_store::artifacts::ArtifactRef::of("acme-payments", content.as_bytes());
    let evidence = v1::Evidence {
        evidence_id: "run-1/del-1/logs://pool_exhaustion".into(),
        kind: "causal_signal".into(),
        source: "search_logs@1".into(),
        query_fingerprint: format!("sha256:{}", "ab".repeat(32)),
        observed_at: Some(to_timestamp(now)),
        artifact_uri: artifact.uri(),
        content_hash: artifact.content_hash(),
        scope: Some(v1::TaskScope {
            resources: vec!["service/payment-api".into()],
            time_range: Some(window),
        }),
        tool_call_id: "call-1".into(),
        trace_id: "0af7651916cd43dd8448eb211c80319c".into(),
        ..Default::default()
    };
    let put = v1::PutArtifactRequest {
        content: content.clone().into_bytes(),
        media_type: "application/json".into(),
        tool_call_id: "call-1".into(),
        evidence: Some(v1::Evidence {
            artifact_uri: String::new(),
            content_hash: String::new(),
            ..evidence.clone()
        }),
    };
    seeds.proto("put_artifact_request", &put);
    seeds.proto(
        "record_evidence_request",
        &v1::RecordEvidenceRequest {
            evidence: Some(evidence.clone()),
        },
    );

    use v1::resume_run_request::Input;
    let ticket = v1::RunTicket {
        id: "ticket-1".into(),
        version: 1,
        issued_at: Some(to_timestamp(now)),
    };
    for input in [
        Input::Settle(v1::SettleConflict {
            topic: "primary_cause".into(),
            delegation_id: "del-1".into(),
            evidence_ids: vec!["run-1/del-1/logs://pool_exhaustion".into()],
        }),
        Input::FollowUp(v1::FollowUp {
            profile_id: "change-auditor".into(),
            goal: "Did RC-4711 change the decline rate?".into(),
        }),
        Input::Close(v1::CloseRun {}),
    ] {
        seeds.proto(
            "resume_run_request",
            &v1::ResumeRunRequest {
                run_id: "run-1".into(),
                ticket: Some(ticket.clone()),
                rationale: "the logs show the pool first".into(),
                input: Some(input),
            },
        );
    }

    // Every other request type, one seed per selector byte.
    let profiles = convene_worker::profiles::parse(&profile_files[0], "profiles.yaml")?;
    let wire: Vec<v1::WorkerProfile> = profiles.iter().map(|p| p.wire.clone()).collect();
    let others: Vec<Vec<u8>> = vec![
        v1::RegisterRequest {
            worker_id: "worker-1".into(),
            endpoint: "http://127.0.0.1:7004".into(),
            profiles: wire,
            capacity: 8,
        }
        .encode_to_vec(),
        v1::HeartbeatRequest {
            worker_id: "worker-1".into(),
            ..Default::default()
        }
        .encode_to_vec(),
        v1::DeregisterRequest {
            worker_id: "worker-1".into(),
        }
        .encode_to_vec(),
        v1::PlanTurnRequest {
            run_id: "run-1".into(),
            profile_id: "incident-planner".into(),
            round: 1,
            turn: 1,
            task_token: token.clone(),
            ..Default::default()
        }
        .encode_to_vec(),
        v1::WorkerCancelRequest {
            delegation_id: "del-1".into(),
            reason: "run cancelled".into(),
        }
        .encode_to_vec(),
        v1::GetRunRequest {
            run_id: "run-1".into(),
        }
        .encode_to_vec(),
        v1::WatchRunRequest {
            run_id: "run-1".into(),
            ..Default::default()
        }
        .encode_to_vec(),
        v1::CancelRunRequest {
            run_id: "run-1".into(),
            ..Default::default()
        }
        .encode_to_vec(),
        v1::ListRunsRequest {
            page_size: 10,
            ..Default::default()
        }
        .encode_to_vec(),
        v1::WatchEventsRequest {
            after_event_id: "evt-1".into(),
            ..Default::default()
        }
        .encode_to_vec(),
        v1::DecideRequest {
            approval_id: "appr-1".into(),
            ..Default::default()
        }
        .encode_to_vec(),
        v1::GetApprovalRequest {
            approval_id: "appr-1".into(),
        }
        .encode_to_vec(),
        v1::ListApprovalsRequest::default().encode_to_vec(),
        v1::ApprovalExecuteRequest {
            approval_id: "appr-1".into(),
            ..Default::default()
        }
        .encode_to_vec(),
        v1::CancelApprovalRequest {
            approval_id: "appr-1".into(),
            ..Default::default()
        }
        .encode_to_vec(),
        v1::ApprovalWatchEventsRequest::default().encode_to_vec(),
        v1::PutArtifactBatchRequest {
            items: vec![v1::PutArtifactBatchItem {
                token: token.clone(),
                request: Some(put.clone()),
                traceparent: String::new(),
            }],
        }
        .encode_to_vec(),
        v1::GetArtifactRequest {
            uri: artifact.uri(),
        }
        .encode_to_vec(),
        v1::GetEvidenceRequest {
            evidence_ids: vec![evidence.evidence_id.clone()],
        }
        .encode_to_vec(),
        v1::VerifyChainRequest {
            claims: vec![v1::ChainClaim {
                claim_id: "claim-log-cause".into(),
                evidence_refs: vec![evidence.evidence_id.clone()],
            }],
            rehash_content: true,
        }
        .encode_to_vec(),
        v1::AuthorizeBatchRequest {
            items: calls
                .iter()
                .map(|c| v1::AuthorizeBatchItem {
                    request: Some(c.clone()),
                    traceparent: String::new(),
                })
                .collect(),
        }
        .encode_to_vec(),
        v1::RevokeRequest::default().encode_to_vec(),
        v1::GetSigningKeysRequest::default().encode_to_vec(),
        v1::ListToolsRequest::default().encode_to_vec(),
    ];
    for (which, body) in others.iter().enumerate() {
        let mut input = vec![u8::try_from(which)?];
        input.extend_from_slice(body);
        seeds.add("other_requests", &input);
    }

    // Task tokens: valid, expired, tampered, foreign, and the signed-payload modes.
    let expired = fixtures::signer().sign(&convene_tokens::Claims {
        expires_at: fixtures::NOW_UNIX - 1,
        ..claims.clone()
    })?;
    let mut tampered = token.clone().into_bytes();
    let last = tampered.len() - 1;
    tampered[last] = if tampered[last] == b'A' { b'B' } else { b'A' };
    let foreign =
        convene_tokens::Signer::new(convene_tokens::SigningKey::from_secret_bytes(&[9; 32]))
            .sign(&claims)?;
    for text in [&token, &expired, &foreign] {
        seeds.add("task_token", &[&[0u8][..], text.as_bytes()].concat());
    }
    seeds.add("task_token", &[&[0u8][..], &tampered].concat());
    seeds.add("task_token", b"\0eyJhbGciOiJub25lIn0.e30.");
    let payload = serde_json::to_vec(&claims)?;
    seeds.add("task_token", &[&[1u8][..], &payload].concat());
    let header = fixtures::header();
    seeds.add(
        "task_token",
        &[&[2u8][..], header.as_bytes(), b"\n", &payload].concat(),
    );
    seeds.add(
        "task_token",
        &[
            &[2u8][..],
            br#"{"alg":"EdDSA","kid":"k","crit":["b64"],"b64":false}"#,
            b"\n{}",
        ]
        .concat(),
    );

    // Signing keys as GetSigningKeys serves them.
    let key = fixtures::signing_key().public_jwk();
    let other = convene_tokens::SigningKey::from_secret_bytes(&[9; 32]).public_jwk();
    for keys in [
        vec![key.clone()],
        vec![key.clone(), other.clone()],
        vec![v1::Jwk {
            kid: String::new(),
            ..other.clone()
        }],
        vec![v1::Jwk {
            kty: "RSA".into(),
            ..key.clone()
        }],
        vec![
            key.clone(),
            v1::Jwk {
                kid: key.kid.clone(),
                ..other
            },
        ],
    ] {
        seeds.proto(
            "jwks",
            &v1::GetSigningKeysResponse {
                keys,
                ..Default::default()
            },
        );
    }

    // A2A messages: a new task with the convene metadata, and answers to a waiting one.
    let start = SendMessageRequest {
        message: A2aMessage {
            message_id: "m-1".into(),
            metadata: Some(
                [(
                    "convene.limits".to_owned(),
                    json!({"maxParallelWorkers": 2, "timeout": "45s"}),
                )]
                .into(),
            ),
            ..A2aMessage::new(
                Role::User,
                vec![
                    Part::text("Success rate dropped at 02:02."),
                    Part::data(json!({"service": "payment-api"})),
                ],
            )
        },
        configuration: None,
        metadata: Some(
            [
                ("skill".to_owned(), json!("payment-incident-triage")),
                (
                    "convene.join".to_owned(),
                    json!({"strategy": "JOIN_STRATEGY_ALL", "required": ["logs"], "timeout": "20s"}),
                ),
            ]
            .into(),
        ),
        tenant: None,
    };
    seeds.add("a2a_send_message", &serde_json::to_vec(&start)?);
    for data in [
        json!({"settle": {"topic": "primary_cause", "delegationId": "del-1", "evidenceIds": ["e-1"]}}),
        json!({"follow_up": {"profile_id": "change-auditor", "goal": "check RC-4711"}}),
        json!({"close": {}}),
    ] {
        let answer = SendMessageRequest {
            message: A2aMessage {
                message_id: "m-2".into(),
                task_id: Some("task-1".into()),
                ..A2aMessage::new(
                    Role::User,
                    vec![Part::text("the logs show the pool first"), Part::data(data)],
                )
            },
            configuration: None,
            metadata: None,
            tenant: None,
        };
        seeds.add("a2a_send_message", &serde_json::to_vec(&answer)?);
    }

    for (target, count) in &seeds.written {
        println!("{target}: {count} seed(s)");
    }
    Ok(())
}

/// A small policy file in TOML, the other format the loader reads.
const POLICY_TOML: &str = r#"[tokens]
issuer = "convene-policy"
default_ttl = "15m"
max_ttl = "1h"
default_max_calls = 32

[[principals]]
id = "oncall@acme"
tenant = "acme-payments"
kind = "human"
roles = ["runs:start", "runs:read"]
grants = [{ action = "logs:read", resource = "service/*" }]

[[profiles]]
id = "logs-investigator"
investigating = true
tools = ["search_logs@1"]
evidence_prefixes = ["logs://"]
capabilities = [{ action = "logs:read", resource = "service/*", max_rows = 50000 }]

[[tools]]
name = "search_logs@1"
action = "logs:read"
risk = "R0"
"#;

/// The seeds written, by target.
struct Seeds {
    dir: PathBuf,
    written: BTreeMap<&'static str, usize>,
}

impl Seeds {
    fn new(dir: PathBuf) -> Self {
        Self {
            dir,
            written: BTreeMap::new(),
        }
    }

    /// Writes `input` as a seed of `target`, named by its content.
    fn add(&mut self, target: &'static str, input: &[u8]) {
        let dir = self.dir.join(target);
        std::fs::create_dir_all(&dir).expect("the corpus directory can be created");
        let name = hex::encode(&Sha256::digest(input)[..20]);
        std::fs::write(dir.join(name), input).expect("the seed can be written");
        *self.written.entry(target).or_default() += 1;
    }

    /// Writes the protobuf encoding of `msg` as a seed of `target`.
    fn proto(&mut self, target: &'static str, msg: &impl prost::Message) {
        self.add(target, &msg.encode_to_vec());
    }
}
