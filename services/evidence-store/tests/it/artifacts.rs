//! Artifacts over real sockets: content addressing, tampered bytes, the hash an evidence
//! record must cite, an evidence id already taken, and the size limit.

use crate::support::{Mesh, PolicyLink, evidence, put_with_evidence};
use convene_evidence_store::artifacts::ArtifactRef;
use convene_mesh::auth::request;
use convene_proto::v1::{self, LinkStatus};
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
