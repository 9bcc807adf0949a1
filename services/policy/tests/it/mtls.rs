//! Service identities under mutual TLS: only the supervisor's certificate (URI SAN
//! `spiffe://<trust domain>/supervisor`) may call IssueTaskToken; the principal
//! credential is checked as before on top of it.

use convene_mesh::auth::request;
use convene_policy::PolicyService;
use convene_proto::v1;
use convene_server::test_util::TestServer;
use convene_server::test_util::pki::{TestCert, TestPki, write};
use convene_server::{GrpcServer, ServerSettings};

use crate::support::{SUPERVISOR, scope};

/// IssueTaskToken over TLS, presenting `identity`, with the supervisor's credential.
async fn issue(
    pki: &TestPki,
    addr: std::net::SocketAddr,
    identity: &TestCert,
) -> Result<(), tonic::Status> {
    let channel = pki
        .connect(addr, Some(identity))
        .await
        .expect("the TLS connection is made");
    let grant = v1::TokenGrantRequest {
        delegation_id: "del-1".into(),
        profile_id: "logs-investigator".into(),
        depth: 1,
        required_scopes: vec![scope("logs:read", "service/*")],
        tools: vec!["search_logs@1".into()],
        ..Default::default()
    };
    v1::policy_client::PolicyClient::new(channel)
        .issue_task_token(request(
            v1::IssueTaskTokenRequest {
                lease_epoch: 0,
                principal: "oncall@acme".into(),
                run_id: "run-mtls".into(),
                parent_token: String::new(),
                grants: vec![grant],
            },
            SUPERVISOR,
        ))
        .await
        .map(|_| ())
}

#[tokio::test]
async fn only_the_supervisors_certificate_may_issue_task_tokens() {
    let dir = tempfile::tempdir().unwrap();
    let file = write(dir.path(), "policy.yaml", &crate::support::policy_yaml(""));
    let ring = convene_tokens::KeyRing::open(dir.path().join("keys")).unwrap();
    let service = PolicyService::builder(
        convene_mesh::policy_file::Policy::load(&file).unwrap(),
        ring,
    )
    .build();

    let pki = TestPki::new();
    let server = TestServer::spawn(service.add_to(
        GrpcServer::new(ServerSettings::default()).with_tls(pki.server_tls(dir.path(), true)),
    ))
    .await;
    let addr = server.addr;

    issue(&pki, addr, &pki.clients.service("supervisor"))
        .await
        .expect("the supervisor's certificate and credential issue tokens");
    let refused = issue(&pki, addr, &pki.clients.service("worker"))
        .await
        .expect_err("a worker's certificate cannot");
    assert_eq!(refused.code(), tonic::Code::PermissionDenied, "{refused:?}");
    assert!(
        refused.message().contains("spiffe://convene.test/worker")
            && refused.message().contains("supervisor"),
        "{}",
        refused.message()
    );
    let anonymous = issue(&pki, addr, &pki.clients.localhost())
        .await
        .expect_err("a certificate without an identity cannot");
    assert_eq!(
        anonymous.code(),
        tonic::Code::PermissionDenied,
        "{anonymous:?}"
    );
    assert!(
        anonymous.message().contains("no spiffe:// identity"),
        "{}",
        anonymous.message()
    );
}
