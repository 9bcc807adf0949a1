//! Service identities under mutual TLS: only the supervisor's certificate (URI SAN
//! `spiffe://<trust domain>/supervisor`) may call IssueTaskToken; the principal
//! credential is checked as before on top of it.

use std::path::Path;

use convene_mesh::auth::request;
use convene_policy::PolicyService;
use convene_proto::v1;
use convene_server::test_util::pick_listener;
use convene_server::tls::ServerTls;
use convene_server::{GrpcServer, ServerSettings, Shutdown};
use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair, SanType, string::Ia5String,
};
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity};

use crate::support::{SUPERVISOR, scope};

fn ca() -> CertifiedIssuer<'static, KeyPair> {
    let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    CertifiedIssuer::self_signed(params, KeyPair::generate().unwrap()).unwrap()
}

/// A certificate of `ca` for `dns` names and a `spiffe://convene.test/<service>` URI SAN.
fn leaf(ca: &CertifiedIssuer<'static, KeyPair>, service: Option<&str>) -> (String, String) {
    let mut params = CertificateParams::new(vec!["localhost".to_owned()]).unwrap();
    if let Some(service) = service {
        params.subject_alt_names.push(SanType::URI(
            Ia5String::try_from(format!("spiffe://convene.test/{service}")).unwrap(),
        ));
    }
    let key = KeyPair::generate().unwrap();
    (
        params.signed_by(&key, ca).unwrap().pem(),
        key.serialize_pem(),
    )
}

fn write(dir: &Path, name: &str, text: &str) -> std::path::PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path
}

async fn issue(
    addr: std::net::SocketAddr,
    ca: &str,
    identity: &(String, String),
) -> Result<(), tonic::Status> {
    let tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(ca))
        .identity(Identity::from_pem(&identity.0, &identity.1))
        .domain_name("localhost");
    let channel = Endpoint::from_shared(format!("https://{addr}"))
        .unwrap()
        .tls_config(tls)
        .unwrap()
        .connect()
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

    let servers = ca();
    let services = ca();
    let (cert, key) = leaf(&servers, None);
    let tls = ServerTls::load(
        &write(dir.path(), "tls.crt", &cert),
        &write(dir.path(), "tls.key", &key),
        Some(&write(dir.path(), "clients.crt", &services.pem())),
    )
    .unwrap();
    let listener = pick_listener().await;
    let addr = listener.local_addr().unwrap();
    let shutdown = Shutdown::new();
    tokio::spawn(
        service
            .add_to(GrpcServer::new(ServerSettings::default()).with_tls(tls))
            .serve(listener, shutdown.clone()),
    );

    issue(addr, &servers.pem(), &leaf(&services, Some("supervisor")))
        .await
        .expect("the supervisor's certificate and credential issue tokens");
    let refused = issue(addr, &servers.pem(), &leaf(&services, Some("worker")))
        .await
        .expect_err("a worker's certificate cannot");
    assert_eq!(refused.code(), tonic::Code::PermissionDenied, "{refused:?}");
    assert!(
        refused.message().contains("spiffe://convene.test/worker")
            && refused.message().contains("supervisor"),
        "{}",
        refused.message()
    );
    let anonymous = issue(addr, &servers.pem(), &leaf(&services, None))
        .await
        .expect_err("a certificate without an identity cannot");
    assert!(
        anonymous.message().contains("no spiffe:// identity"),
        "{}",
        anonymous.message()
    );
    shutdown.trigger();
}
