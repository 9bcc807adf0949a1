//! The evidence store over real sockets, with a real policy service issuing the tokens.

mod support;

use std::io::BufRead as _;
use std::process::{Command, Stdio};
use std::time::Duration;

use convene_evidence_store::artifacts::ArtifactRef;
use convene_evidence_store::catalog::Catalog as _;
use convene_mesh::auth::request;
use convene_proto::v1::{self, LinkStatus};
use support::{ANALYST, Mesh, ONCALL, PolicyLink, VIEWER, evidence};
use tonic::Code;

#[tokio::test]
async fn the_same_bytes_twice_are_one_artifact() {
    let mesh = Mesh::start().await;
    let token = mesh.acme().await;
    let bytes = br#"{"matches": 1423, "window": "02:00-02:10"}"#;

    let first = mesh.put(&token, bytes).await;
    let second = mesh.put(&token, bytes).await;
    assert!(first.created);
    assert!(!second.created);
    let artifact = first.artifact.unwrap();
    assert_eq!(
        second.artifact.unwrap(),
        artifact,
        "the first put's metadata is kept"
    );
    let hash = convene_core::ids::content_hash(bytes);
    assert_eq!(artifact.content_hash, hash);
    assert_eq!(
        artifact.uri,
        format!("artifact://acme/{}", hash.trim_start_matches("sha256:"))
    );
    assert_eq!(artifact.size, bytes.len() as u64);
    assert_eq!(artifact.media_type, "application/json");
    assert_eq!(artifact.created_by_delegation, "del-acme");
    assert_eq!(artifact.created_by_tool_call, "call-1");
    assert_eq!(
        std::fs::read(mesh.artifact_file(&artifact.uri)).unwrap(),
        bytes
    );

    let got = mesh
        .client()
        .await
        .get_artifact(request(
            v1::GetArtifactRequest {
                uri: artifact.uri.clone(),
            },
            &token,
        ))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(got.content, bytes);

    // Empty output is evidence too (a query that found nothing).
    let empty = mesh.put(&token, b"").await.artifact.unwrap();
    assert_eq!(empty.content_hash, convene_core::ids::content_hash(b""));
    assert_eq!(empty.size, 0);
}

#[tokio::test]
async fn tampered_bytes_are_reported_and_never_served() {
    let mesh = Mesh::start().await;
    let token = mesh.acme().await;
    let mut client = mesh.client().await;
    let stored = client
        .put_artifact(request(
            v1::PutArtifactRequest {
                content: b"rows: 1423 timeouts".to_vec(),
                media_type: String::new(),
                tool_call_id: "call-7".into(),
                evidence: Some(evidence("logs://payment-api/q-1", "", "")),
            },
            &token,
        ))
        .await
        .unwrap()
        .into_inner();
    let artifact = stored.artifact.unwrap();
    assert_eq!(artifact.media_type, "application/octet-stream");
    let recorded = stored.evidence.unwrap();
    assert_eq!(recorded.artifact_uri, artifact.uri);
    assert_eq!(recorded.content_hash, artifact.content_hash);

    std::fs::write(mesh.artifact_file(&artifact.uri), b"rows: 0 timeouts").unwrap();

    let status = client
        .get_artifact(request(
            v1::GetArtifactRequest {
                uri: artifact.uri.clone(),
            },
            &token,
        ))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::DataLoss);
    let expected = format!(
        "is corrupted: stored bytes hash to {}, recorded {}",
        convene_core::ids::content_hash(b"rows: 0 timeouts"),
        artifact.content_hash
    );
    assert!(status.message().contains(&expected), "{}", status.message());

    let chain = |rehash_content| v1::VerifyChainRequest {
        claims: vec![v1::ChainClaim {
            claim_id: "c1".into(),
            evidence_refs: vec!["logs://payment-api/q-1".into()],
        }],
        rehash_content,
    };
    let report = client
        .verify_chain(request(chain(true), &token))
        .await
        .unwrap()
        .into_inner();
    assert!(!report.intact);
    assert_eq!(
        report.links[0].status,
        i32::from(LinkStatus::ArtifactCorrupted)
    );
    assert!(
        report.links[0].detail.contains("corrupted"),
        "{}",
        report.links[0].detail
    );
    // Without re-reading the bytes only the records are compared, and they agree.
    let report = client
        .verify_chain(request(chain(false), &token))
        .await
        .unwrap()
        .into_inner();
    assert!(report.intact, "{:?}", report.links);
}

#[tokio::test]
async fn evidence_must_cite_an_existing_artifact_with_its_hash() {
    let mesh = Mesh::start().await;
    let token = mesh.acme().await;
    let mut client = mesh.client().await;
    let artifact = mesh.put(&token, b"p95 3.8s").await.artifact.unwrap();
    let record = |e: v1::Evidence| request(v1::RecordEvidenceRequest { evidence: Some(e) }, &token);

    let wrong_hash = convene_core::ids::content_hash(b"p95 420ms");
    let status = client
        .record_evidence(record(evidence(
            "metrics://gw/p95",
            &artifact.uri,
            &wrong_hash,
        )))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::FailedPrecondition);
    assert!(
        status.message().contains(&wrong_hash) && status.message().contains(&artifact.content_hash),
        "{}",
        status.message()
    );

    let unknown = ArtifactRef::of("acme", b"never stored");
    let status = client
        .record_evidence(record(evidence(
            "metrics://gw/p95",
            &unknown.uri(),
            &unknown.content_hash(),
        )))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::FailedPrecondition);
    assert!(
        status.message().contains(&unknown.uri()),
        "{}",
        status.message()
    );

    let status = client
        .record_evidence(record(evidence(
            "p95-of-the-gateway",
            &artifact.uri,
            &artifact.content_hash,
        )))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);
    assert!(
        status.message().contains("evidence.evidence_id"),
        "{}",
        status.message()
    );

    // Tenant and delegation come from the token, whatever the message says.
    let mut claimed = evidence("metrics://gw/p95", &artifact.uri, &artifact.content_hash);
    claimed.tenant = "globex".into();
    claimed.delegation_id = "del-someone-else".into();
    let stored = client
        .record_evidence(record(claimed.clone()))
        .await
        .unwrap()
        .into_inner()
        .evidence
        .unwrap();
    assert_eq!(
        (stored.tenant.as_str(), stored.delegation_id.as_str()),
        ("acme", "del-acme")
    );
    // Recording it again is a no-op; changing it is refused.
    client
        .record_evidence(record(claimed.clone()))
        .await
        .unwrap();
    let mut changed = claimed;
    changed.kind = "causal_signal".into();
    let status = client.record_evidence(record(changed)).await.unwrap_err();
    assert_eq!(status.code(), Code::AlreadyExists);
    assert!(
        status.message().contains("immutable"),
        "{}",
        status.message()
    );

    // A put's evidence must cite that put's bytes.
    let status = client
        .put_artifact(request(
            v1::PutArtifactRequest {
                content: b"other bytes".to_vec(),
                media_type: "text/plain".into(),
                tool_call_id: String::new(),
                evidence: Some(evidence("metrics://gw/other", &artifact.uri, "")),
            },
            &token,
        ))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::FailedPrecondition);

    let found = client
        .get_evidence(request(
            v1::GetEvidenceRequest {
                evidence_ids: vec!["metrics://gw/p95".into(), "metrics://gw/other".into()],
            },
            &token,
        ))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(found.evidence, vec![stored]);
    assert_eq!(found.missing, vec!["metrics://gw/other".to_owned()]);
}

#[tokio::test]
async fn tenants_scopes_and_credentials_are_enforced() {
    let mesh = Mesh::start().await;
    let acme = mesh.acme().await;
    let globex = mesh.globex().await;
    let mut client = mesh.client().await;
    let put = mesh.put(&acme, b"acme's logs").await.artifact.unwrap();
    client
        .record_evidence(request(
            v1::RecordEvidenceRequest {
                evidence: Some(evidence("logs://acme/1", &put.uri, &put.content_hash)),
            },
            &acme,
        ))
        .await
        .unwrap();

    let get = |uri: &str| v1::GetArtifactRequest { uri: uri.into() };
    let status = client
        .get_artifact(request(get(&put.uri), &globex))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::PermissionDenied);
    assert!(
        status
            .message()
            .contains("artifact belongs to another tenant"),
        "{}",
        status.message()
    );
    // The same bytes stored by globex are globex's own artifact, not acme's.
    let theirs = mesh.put(&globex, b"acme's logs").await;
    assert!(theirs.created);
    assert_ne!(theirs.artifact.unwrap().uri, put.uri);
    let missing = client
        .get_evidence(request(
            v1::GetEvidenceRequest {
                evidence_ids: vec!["logs://acme/1".into()],
            },
            &globex,
        ))
        .await
        .unwrap()
        .into_inner();
    assert!(missing.evidence.is_empty());
    assert_eq!(missing.missing, vec!["logs://acme/1".to_owned()]);

    let reader = mesh
        .token(
            "oncall@acme",
            "del-reader",
            &[("evidence:read", "evidence")],
        )
        .await;
    let status = client
        .put_artifact(request(v1::PutArtifactRequest::default(), &reader))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::PermissionDenied);
    assert!(
        status.message().contains("`evidence:write` on `evidence`"),
        "{}",
        status.message()
    );
    assert!(
        client
            .get_artifact(request(get(&put.uri), &reader))
            .await
            .is_ok()
    );

    let no_evidence = mesh
        .token(
            "oncall@acme",
            "del-logs-only",
            &[("logs:read", "service/*")],
        )
        .await;
    let status = client
        .get_artifact(request(get(&put.uri), &no_evidence))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::PermissionDenied);
    assert!(
        status.message().contains("`evidence:read` on `evidence`"),
        "{}",
        status.message()
    );

    // A credential that is neither a token nor any principal's.
    let status = client
        .get_artifact(request(get(&put.uri), "cvn_nobody_has_this"))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::Unauthenticated);
    assert!(
        status
            .message()
            .contains("neither a task token nor the credential of a principal"),
        "{}",
        status.message()
    );
    let status = client
        .put_artifact(request(
            v1::PutArtifactRequest::default(),
            "cvn_nobody_has_this",
        ))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::Unauthenticated);
    assert!(
        status.message().contains("task tokens only"),
        "{}",
        status.message()
    );

    let status = client
        .get_artifact(tonic::Request::new(get(&put.uri)))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::Unauthenticated);
    assert!(
        status.message().contains("task token"),
        "{}",
        status.message()
    );
    // Malformed metadata is reported as such, on reads and writes alike.
    fn basic<T>(message: T) -> tonic::Request<T> {
        let mut request = tonic::Request::new(message);
        request
            .metadata_mut()
            .insert("authorization", "Basic b25jYWxs".parse().unwrap());
        request
    }
    let refusals = [
        client.get_artifact(basic(get(&put.uri))).await.unwrap_err(),
        client
            .put_artifact(basic(v1::PutArtifactRequest::default()))
            .await
            .unwrap_err(),
    ];
    for status in refusals {
        assert_eq!(status.code(), Code::Unauthenticated);
        assert!(
            status.message().contains("must be `Bearer <credential>`"),
            "{}",
            status.message()
        );
    }

    // A token altered after issue does not verify.
    let mut forged = acme.into_bytes();
    let last = forged.len() - 10;
    forged[last] = if forged[last] == b'A' { b'B' } else { b'A' };
    let forged = String::from_utf8(forged).unwrap();
    let status = client
        .get_artifact(request(get(&put.uri), &forged))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::Unauthenticated);
}

#[tokio::test]
async fn new_bytes_are_kept_when_their_evidence_id_is_taken() {
    let mesh = Mesh::start().await;
    let token = mesh.acme().await;
    put_with_evidence(&mesh, &token, b"first rows", "logs://payment-api/q-9").await;

    // New bytes whose evidence reuses the id with a different record: the evidence is
    // refused (evidence is immutable), the bytes and their entry are stored all the same.
    let status = mesh
        .client()
        .await
        .put_artifact(request(
            v1::PutArtifactRequest {
                content: b"second rows".to_vec(),
                media_type: "text/plain".into(),
                tool_call_id: "call-2".into(),
                evidence: Some(evidence("logs://payment-api/q-9", "", "")),
            },
            &token,
        ))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::AlreadyExists, "{}", status.message());
    assert!(
        status.message().contains("immutable"),
        "{}",
        status.message()
    );
    let uri = format!(
        "artifact://acme/{}",
        convene_evidence_store::artifacts::sha256_hex(b"second rows")
    );
    let got = mesh
        .client()
        .await
        .get_artifact(request(v1::GetArtifactRequest { uri }, &token))
        .await
        .expect("the bytes were stored")
        .into_inner();
    assert_eq!(got.content, b"second rows");
    assert_eq!(got.artifact.unwrap().created_by_tool_call, "call-2");
}

/// Stores `content` with `token` and records evidence `id` citing it; the artifact.
async fn put_with_evidence(mesh: &Mesh, token: &str, content: &[u8], id: &str) -> v1::Artifact {
    let stored = mesh
        .client()
        .await
        .put_artifact(request(
            v1::PutArtifactRequest {
                content: content.to_vec(),
                media_type: "text/plain".into(),
                tool_call_id: "call-1".into(),
                evidence: Some(evidence(id, "", "")),
            },
            token,
        ))
        .await
        .expect("stored with its evidence")
        .into_inner();
    assert_eq!(stored.evidence.expect("evidence recorded").evidence_id, id);
    stored.artifact.expect("artifact metadata")
}

/// A VerifyChain request for one claim citing `refs`, re-hashing the bytes.
fn chain(refs: &[&str]) -> v1::VerifyChainRequest {
    v1::VerifyChainRequest {
        claims: vec![v1::ChainClaim {
            claim_id: "c1".into(),
            evidence_refs: refs.iter().map(|r| (*r).to_owned()).collect(),
        }],
        rehash_content: true,
    }
}

#[tokio::test]
async fn principals_with_the_reader_role_audit_their_own_tenants_evidence() {
    for link in [PolicyLink::Grpc, PolicyLink::InProcess] {
        let mesh = Mesh::start_with(1024, link).await;
        let acme = mesh.acme().await;
        let globex = mesh.globex().await;
        let ours = put_with_evidence(&mesh, &acme, b"1423 timeouts", "logs://acme/1").await;
        let theirs = put_with_evidence(&mesh, &globex, b"7 timeouts", "logs://globex/1").await;
        let mut client = mesh.client().await;

        // The worker's records, read by a person with their own credential.
        let report = client
            .verify_chain(request(chain(&["logs://acme/1"]), ONCALL))
            .await
            .expect("oncall@acme may verify")
            .into_inner();
        assert!(report.intact, "{link:?}: {:?}", report.links);
        assert_eq!(report.evidence.len(), 1);
        assert_eq!(report.evidence[0].delegation_id, "del-acme");
        assert_eq!(report.evidence[0].content_hash, ours.content_hash);
        let found = client
            .get_evidence(request(
                v1::GetEvidenceRequest {
                    evidence_ids: vec!["logs://acme/1".into()],
                },
                ONCALL,
            ))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(found.evidence, report.evidence);
        assert!(found.missing.is_empty());
        let got = client
            .get_artifact(request(
                v1::GetArtifactRequest {
                    uri: ours.uri.clone(),
                },
                ONCALL,
            ))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(got.content, b"1423 timeouts");
        assert_eq!(got.artifact.unwrap(), ours);

        // Another tenant's evidence stays out of reach: its artifact is refused as for a
        // token, its evidence ids are simply unknown in the principal's tenant.
        let status = client
            .get_artifact(request(
                v1::GetArtifactRequest {
                    uri: theirs.uri.clone(),
                },
                ONCALL,
            ))
            .await
            .unwrap_err();
        assert_eq!(status.code(), Code::PermissionDenied);
        assert!(
            status
                .message()
                .contains("artifact belongs to another tenant than principal oncall@acme's (acme)"),
            "{}",
            status.message()
        );
        let missing = client
            .get_evidence(request(
                v1::GetEvidenceRequest {
                    evidence_ids: vec!["logs://globex/1".into()],
                },
                ONCALL,
            ))
            .await
            .unwrap()
            .into_inner();
        assert!(missing.evidence.is_empty());
        assert_eq!(missing.missing, vec!["logs://globex/1".to_owned()]);
        let report = client
            .verify_chain(request(chain(&["logs://globex/1"]), ONCALL))
            .await
            .unwrap()
            .into_inner();
        assert!(!report.intact);
        assert!(report.evidence.is_empty());
        assert_eq!(
            report.links[0].status,
            i32::from(LinkStatus::EvidenceUnknown)
        );
        assert!(
            report.links[0].detail.contains("not known in tenant acme"),
            "{}",
            report.links[0].detail
        );

        // The other tenant's auditor sees its own and not acme's.
        let report = client
            .verify_chain(request(
                chain(&["logs://globex/1", "logs://acme/1"]),
                ANALYST,
            ))
            .await
            .unwrap()
            .into_inner();
        let statuses: Vec<_> = report.links.iter().map(|l| l.status).collect();
        assert_eq!(
            statuses,
            vec![
                i32::from(LinkStatus::Ok),
                i32::from(LinkStatus::EvidenceUnknown)
            ]
        );
    }
}

#[tokio::test]
async fn principals_may_not_write_evidence() {
    let mesh = Mesh::start().await;
    let acme = mesh.acme().await;
    let artifact = mesh
        .put(&acme, b"written by a worker")
        .await
        .artifact
        .unwrap();
    let mut client = mesh.client().await;

    for credential in [ONCALL, VIEWER] {
        let status = client
            .put_artifact(request(
                v1::PutArtifactRequest {
                    content: b"written by a person".to_vec(),
                    ..Default::default()
                },
                credential,
            ))
            .await
            .unwrap_err();
        assert_eq!(status.code(), Code::PermissionDenied);
        assert!(
            status
                .message()
                .contains("PutArtifact accepts task tokens only")
                && status
                    .message()
                    .contains("the task token the supervisor issued for the delegation"),
            "{}",
            status.message()
        );
    }
    let refused = ArtifactRef::of("acme", b"written by a person");
    assert!(
        !mesh.artifact_file(&refused.uri()).exists(),
        "a refused put stores no bytes"
    );

    let status = client
        .record_evidence(request(
            v1::RecordEvidenceRequest {
                evidence: Some(evidence(
                    "logs://by-hand/1",
                    &artifact.uri,
                    &artifact.content_hash,
                )),
            },
            ONCALL,
        ))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::PermissionDenied);
    assert!(
        status
            .message()
            .contains("principal oncall@acme presented its own credential"),
        "{}",
        status.message()
    );
    let found = client
        .get_evidence(request(
            v1::GetEvidenceRequest {
                evidence_ids: vec!["logs://by-hand/1".into()],
            },
            &acme,
        ))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(found.missing, vec!["logs://by-hand/1".to_owned()]);
}

#[tokio::test]
async fn principals_without_the_reader_role_are_refused_naming_it() {
    let mesh = Mesh::start().await;
    let acme = mesh.acme().await;
    let artifact = put_with_evidence(&mesh, &acme, b"p95 3.8s", "metrics://gw/p95").await;
    let mut client = mesh.client().await;

    let refusals = [
        client
            .verify_chain(request(chain(&["metrics://gw/p95"]), VIEWER))
            .await
            .unwrap_err(),
        client
            .get_evidence(request(
                v1::GetEvidenceRequest {
                    evidence_ids: vec!["metrics://gw/p95".into()],
                },
                VIEWER,
            ))
            .await
            .unwrap_err(),
        client
            .get_artifact(request(
                v1::GetArtifactRequest { uri: artifact.uri },
                VIEWER,
            ))
            .await
            .unwrap_err(),
    ];
    for (status, method) in refusals
        .iter()
        .zip(["VerifyChain", "GetEvidence", "GetArtifact"])
    {
        assert_eq!(status.code(), Code::PermissionDenied);
        let expected = format!(
            "principal viewer@acme lacks role `evidence:read` needed to call {method}; add it \
             to the principal's roles in the policy file"
        );
        assert!(status.message().contains(&expected), "{}", status.message());
    }
}

#[tokio::test]
async fn a_store_opened_on_the_development_settings_lets_the_example_people_audit() {
    use convene_evidence_store::{Config, EvidenceStoreService};
    use convene_mesh::handles::GrpcPolicy;
    use convene_server::GrpcServer;
    use convene_server::test_util::{TestServer, endpoint};
    use std::sync::Arc;

    let mesh = Mesh::start().await;
    // The embedded example policy, with development credentials in the data dir.
    let dir = tempfile::tempdir().unwrap();
    let config = Config {
        policy_endpoint: endpoint(mesh.policy_server.addr),
        ..Config::in_dir(dir.path())
    };
    let policy = Arc::new(GrpcPolicy::connect(&config.policy_endpoint).unwrap());
    let store = EvidenceStoreService::open(&config, policy).expect("the store opens");
    let server = TestServer::start(store.add_to(GrpcServer::new(config.server.clone()))).await;
    let mut client =
        convene_proto::v1::evidence_store_client::EvidenceStoreClient::new(server.channel().await);
    let credential = |principal: &str| {
        convene_mesh::policy_file::dev_credential(&config.credentials_dir(), principal)
            .expect("a development credential was created")
    };

    for auditor in ["oncall@acme", "alice@acme", "bob@acme"] {
        let report = client
            .verify_chain(request(chain(&["logs://none/1"]), &credential(auditor)))
            .await
            .unwrap_or_else(|s| panic!("{auditor} may audit: {s}"))
            .into_inner();
        assert!(
            report.links[0]
                .detail
                .contains("not known in tenant acme-payments"),
            "{}",
            report.links[0].detail
        );
    }
    let status = client
        .verify_chain(request(
            chain(&["logs://none/1"]),
            &credential("worker-pool"),
        ))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::PermissionDenied);
    assert!(
        status
            .message()
            .contains("worker-pool lacks role `evidence:read`"),
        "{}",
        status.message()
    );
}

#[tokio::test]
async fn oversize_artifacts_are_refused_naming_the_limit() {
    let mesh = Mesh::start_with(1024, PolicyLink::Grpc).await;
    let token = mesh.acme().await;
    let mut client = mesh.client().await;
    let put = |size: usize| {
        request(
            v1::PutArtifactRequest {
                content: vec![b'x'; size],
                ..Default::default()
            },
            &token,
        )
    };
    assert!(client.put_artifact(put(1024)).await.is_ok());
    let status = client.put_artifact(put(1025)).await.unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);
    assert!(
        status
            .message()
            .contains("artifact is 1025 bytes; the limit is 1024 (max_artifact_bytes)"),
        "{}",
        status.message()
    );

    // With the default limit (4 MiB) the transport still lets the oversize request
    // through, so the caller gets the store's own explanation.
    let mesh = Mesh::start().await;
    let token = mesh.acme().await;
    let limit = mesh.config.max_artifact_bytes;
    let status = mesh
        .client()
        .await
        .put_artifact(request(
            v1::PutArtifactRequest {
                content: vec![0; limit + 1],
                ..Default::default()
            },
            &token,
        ))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);
    assert!(
        status
            .message()
            .contains(&format!("the limit is {limit} (max_artifact_bytes)")),
        "{}",
        status.message()
    );
}

#[tokio::test]
async fn verify_chain_reports_every_broken_link_kind() {
    let mesh = Mesh::start().await;
    let token = mesh.acme().await;
    let mut client = mesh.client().await;
    let store = |content: &'static [u8], id: &'static str| {
        let token = token.clone();
        let mesh = &mesh;
        async move {
            mesh.client()
                .await
                .put_artifact(request(
                    v1::PutArtifactRequest {
                        content: content.to_vec(),
                        media_type: "text/plain".into(),
                        tool_call_id: String::new(),
                        evidence: Some(evidence(id, "", "")),
                    },
                    &token,
                ))
                .await
                .unwrap()
                .into_inner()
                .artifact
                .unwrap()
        }
    };
    store(b"healthy", "logs://ok/1").await;
    let tampered = store(b"tampered", "logs://bad/1").await;
    std::fs::write(mesh.artifact_file(&tampered.uri), b"edited later").unwrap();

    // Records no writer could store through the API, planted as a broken or migrated
    // catalog would hold them.
    let ghost = ArtifactRef::of("acme", b"never stored");
    let mut missing = evidence("logs://ghost/1", &ghost.uri(), &ghost.content_hash());
    missing.tenant = "acme".into();
    mesh.catalog.record_evidence("acme", missing).await.unwrap();
    let healthy = ArtifactRef::of("acme", b"healthy");
    let mut mismatched = evidence(
        "logs://mismatch/1",
        &healthy.uri(),
        &convene_core::ids::content_hash(b"something else"),
    );
    mismatched.tenant = "acme".into();
    mesh.catalog
        .record_evidence("acme", mismatched)
        .await
        .unwrap();

    let claim = |id: &str, refs: &[&str]| v1::ChainClaim {
        claim_id: id.into(),
        evidence_refs: refs.iter().map(|r| (*r).to_owned()).collect(),
    };
    let report = client
        .verify_chain(request(
            v1::VerifyChainRequest {
                claims: vec![
                    claim("ok", &["logs://ok/1"]),
                    claim("bare", &[]),
                    claim("unknown", &["logs://nobody/1"]),
                    claim("ghost", &["logs://ghost/1"]),
                    claim("mismatch", &["logs://mismatch/1"]),
                    claim("corrupt", &["logs://bad/1", "logs://ok/1"]),
                ],
                rehash_content: true,
            },
            &token,
        ))
        .await
        .unwrap()
        .into_inner();
    let got: Vec<(String, LinkStatus)> = report
        .links
        .iter()
        .map(|l| (l.claim_id.clone(), LinkStatus::try_from(l.status).unwrap()))
        .collect();
    let expected = [
        ("ok", LinkStatus::Ok),
        ("bare", LinkStatus::ClaimWithoutEvidence),
        ("unknown", LinkStatus::EvidenceUnknown),
        ("ghost", LinkStatus::ArtifactMissing),
        ("mismatch", LinkStatus::HashMismatch),
        ("corrupt", LinkStatus::ArtifactCorrupted),
        ("corrupt", LinkStatus::Ok),
    ];
    let expected: Vec<(String, LinkStatus)> = expected
        .iter()
        .map(|(c, s)| ((*c).to_owned(), *s))
        .collect();
    assert_eq!(got, expected);
    assert!(!report.intact);
    for link in &report.links {
        let ok = link.status == i32::from(LinkStatus::Ok);
        assert_eq!(link.detail.is_empty(), ok, "{link:?}");
    }
    let found: Vec<&str> = report
        .evidence
        .iter()
        .map(|e| e.evidence_id.as_str())
        .collect();
    assert_eq!(
        found,
        vec![
            "logs://ok/1",
            "logs://ghost/1",
            "logs://mismatch/1",
            "logs://bad/1"
        ]
    );

    let whole = client
        .verify_chain(request(
            v1::VerifyChainRequest {
                claims: vec![claim("ok", &["logs://ok/1"])],
                rehash_content: true,
            },
            &token,
        ))
        .await
        .unwrap()
        .into_inner();
    assert!(whole.intact);
}

#[tokio::test]
async fn an_in_process_policy_handle_verifies_tokens_across_key_rotation() {
    let mesh = Mesh::start_with(1024, PolicyLink::InProcess).await;
    let before = mesh.acme().await;
    mesh.put(&before, b"before rotation").await;

    mesh.policy.rotate_key().unwrap();
    let after = mesh.acme().await;
    // The store refreshes its keys for an unknown key id at most once a second.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    assert!(mesh.put(&after, b"after rotation").await.created);
    assert!(!mesh.put(&before, b"after rotation").await.created);
}

#[tokio::test]
async fn health_and_reflection_answer() {
    use tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};
    use tonic_reflection::pb::v1::{
        ServerReflectionRequest, server_reflection_client::ServerReflectionClient,
        server_reflection_request::MessageRequest, server_reflection_response::MessageResponse,
    };

    let mesh = Mesh::start().await;
    let status = HealthClient::new(mesh.server.channel().await)
        .check(HealthCheckRequest {
            service: "convene.v1.EvidenceStore".into(),
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
    let mut answers = ServerReflectionClient::new(mesh.server.channel().await)
        .server_reflection_info(tokio_stream::once(list))
        .await
        .unwrap()
        .into_inner();
    let answer = answers.message().await.unwrap().expect("one answer");
    let Some(MessageResponse::ListServicesResponse(services)) = answer.message_response else {
        panic!("not a service list: {answer:?}");
    };
    let names: Vec<_> = services.service.iter().map(|s| s.name.as_str()).collect();
    assert!(names.contains(&"convene.v1.EvidenceStore"), "{names:?}");
}

#[test]
fn the_binary_dumps_its_config_and_says_when_it_runs_on_development_settings() {
    let binary = env!("CARGO_BIN_EXE_convene-evidence-store");
    let cwd = tempfile::tempdir().unwrap();
    let dump = Command::new(binary)
        .args(["--dump-config", "--max-artifact-bytes", "1048576"])
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
    assert!(text.contains("listen = \"127.0.0.1:7402\""), "{text}");
    assert!(text.contains("max_artifact_bytes = 1048576"), "{text}");
    assert!(
        text.contains("policy_endpoint = \"http://127.0.0.1:7401\""),
        "{text}"
    );

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
    let mut first = String::new();
    std::io::BufReader::new(stderr)
        .read_line(&mut first)
        .unwrap();
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(
        first.contains(
            "no --config given: using the development settings of the payment-incident example (data dir ./.convene"
        ),
        "{first}"
    );
}

#[tokio::test]
async fn shutdown_lets_an_in_flight_put_finish() {
    use convene_evidence_store::catalog::{
        ArtifactMeta, Catalog, CatalogError, MemoryCatalog, Recorded,
    };
    use std::sync::Arc;
    use tokio::sync::{Notify, Semaphore};

    /// Holds each artifact write until the test lets it go, so a put is still in flight
    /// when shutdown starts.
    #[derive(Debug)]
    struct Gate {
        inner: Arc<MemoryCatalog>,
        entered: Notify,
        open: Semaphore,
    }

    #[async_trait::async_trait]
    impl Catalog for Gate {
        async fn put_artifact(
            &self,
            meta: ArtifactMeta,
        ) -> Result<(ArtifactMeta, bool), CatalogError> {
            self.entered.notify_one();
            let _permit = self.open.acquire().await.expect("the gate stays open");
            self.inner.put_artifact(meta).await
        }
        async fn artifact(
            &self,
            tenant: &str,
            sha256: &str,
        ) -> Result<Option<ArtifactMeta>, CatalogError> {
            self.inner.artifact(tenant, sha256).await
        }
        async fn record_evidence(
            &self,
            tenant: &str,
            evidence: v1::Evidence,
        ) -> Result<Recorded, CatalogError> {
            self.inner.record_evidence(tenant, evidence).await
        }
        async fn evidence(
            &self,
            tenant: &str,
            ids: &[String],
        ) -> Result<Vec<Option<v1::Evidence>>, CatalogError> {
            self.inner.evidence(tenant, ids).await
        }
    }

    let gate = std::sync::OnceLock::new();
    let mesh = Mesh::start_wrapped(1024, PolicyLink::Grpc, |inner| {
        let g = Arc::new(Gate {
            inner,
            entered: Notify::new(),
            open: Semaphore::new(0),
        });
        gate.set(g.clone()).expect("set once");
        g
    })
    .await;
    let gate = gate.get().expect("the store was built").clone();
    let token = mesh.acme().await;
    let mut client = mesh.client().await;
    let put = tokio::spawn(async move {
        client
            .put_artifact(request(
                v1::PutArtifactRequest {
                    content: b"in flight".to_vec(),
                    ..Default::default()
                },
                &token,
            ))
            .await
    });
    gate.entered.notified().await;
    mesh.server.shutdown.trigger();
    // The call is held while the server drains; releasing it lets it answer.
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(
        !mesh.server.is_finished(),
        "serve waits for the call in flight"
    );
    gate.open.add_permits(1);
    let answer = put.await.unwrap().expect("the in-flight put is answered");
    assert!(answer.into_inner().created);
    let Mesh { server, .. } = mesh;
    tokio::time::timeout(Duration::from_secs(10), server.join())
        .await
        .expect("serve returns once drained")
        .unwrap();
}
