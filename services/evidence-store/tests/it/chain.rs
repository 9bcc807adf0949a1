//! VerifyChain: every kind of broken link between a claim, its evidence and the bytes.

use crate::support::{Mesh, evidence};
use convene_evidence_store::artifacts::ArtifactRef;
use convene_evidence_store::catalog::Catalog as _;
use convene_mesh::auth::request;
use convene_proto::v1::{self, LinkStatus};

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
