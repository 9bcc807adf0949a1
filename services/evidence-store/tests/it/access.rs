//! Who may read and write: tenants, scopes and credentials of task tokens, and principals
//! auditing with the reader role, on every link to the policy service.

use crate::support::{
    ANALYST, Mesh, ONCALL, PolicyLink, VIEWER, chain, evidence, put_with_evidence,
};
use convene_evidence_store::artifacts::ArtifactRef;
use convene_mesh::auth::request;
use convene_proto::v1::{self, LinkStatus};
use tonic::Code;

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
    // To globex, acme's artifact does not exist: the answer an unknown URI gets.
    assert_eq!(status.code(), Code::NotFound);
    assert_eq!(
        status.message(),
        format!(
            "artifact {} does not exist; store it with PutArtifact first",
            put.uri
        )
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

        // Another tenant's evidence stays out of reach: its artifact does not exist for
        // the principal, as for a token, and its evidence ids are simply unknown in the principal's tenant.
        let status = client
            .get_artifact(request(
                v1::GetArtifactRequest {
                    uri: theirs.uri.clone(),
                },
                ONCALL,
            ))
            .await
            .unwrap_err();
        assert_eq!(status.code(), Code::NotFound);
        assert_eq!(
            status.message(),
            format!(
                "artifact {} does not exist; store it with PutArtifact first",
                theirs.uri
            )
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
