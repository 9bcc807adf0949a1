//! Service identities under mutual TLS: only the supervisor's certificate (URI SAN
//! `spiffe://<trust domain>/supervisor`) may call Execute. Other certificates of the
//! client CA are refused with PERMISSION_DENIED naming the identity they carry, before
//! the delegation runs; a client without a certificate, or with one of another CA, does
//! not get past the TLS handshake. A server without a client CA asks for no certificate,
//! and the caller must then present the supervisor's credential, as on plaintext; the
//! task token is checked either way.

use std::error::Error as _;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use convene_proto::v1::{self, worker_client::WorkerClient};
use convene_server::test_util::TestServer;
use convene_server::test_util::pki::{TestCa, TestCert, TestPki};
use convene_server::{GrpcServer, ServerSettings};
use convene_worker::models::ModelSettings;
use convene_worker::profiles::{self, ProviderRegistry};
use convene_worker::tools::ToolRegistry;
use convene_worker::{WorkerOptions, WorkerService};

use crate::support::{Mesh, example_data, status, task, unsigned_token};

/// A worker of `mesh` serving the example profiles over TLS: mutual TLS (client
/// certificates of `pki.clients` required) when `mutual`.
async fn tls_worker(mesh: &Mesh, pki: &TestPki, mutual: bool) -> TestServer {
    let models = ModelSettings::default();
    let service = WorkerService::new(
        WorkerOptions {
            worker_id: "worker-mtls-1".into(),
            capacity: 4,
            exit_process_on_fault: false,
            models: Arc::new(models.clone()),
            key_refresh: convene_mesh::auth::DEFAULT_KEY_REFRESH,
        },
        profiles::example().unwrap(),
        &ProviderRegistry::builtin(&models.client()),
        ToolRegistry::builtin(example_data()),
        mesh.policy_handle(),
        mesh.evidence_handle(),
    )
    .unwrap();
    let settings = ServerSettings {
        request_timeout: None,
        ..ServerSettings::default()
    };
    let tls = pki.server_tls(mesh.dir.path(), mutual);
    TestServer::spawn(service.add_to(GrpcServer::new(settings).with_tls(tls))).await
}

/// Why a call did not return a result: the connection failed, or the call was answered
/// with a status.
#[derive(Debug)]
enum Refused {
    Connect(String),
    Status(tonic::Status),
}

impl Refused {
    /// The status, failing the test if the connection was refused instead.
    fn status(self) -> tonic::Status {
        match self {
            Refused::Status(s) => s,
            Refused::Connect(e) => panic!("the call was expected to be answered: {e}"),
        }
    }
}

/// An error with its sources.
fn chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

/// Execute over TLS (attempt 1), presenting `client` when given.
async fn execute(
    pki: &TestPki,
    addr: SocketAddr,
    client: Option<&TestCert>,
    task: &v1::DelegationTask,
    token: &str,
) -> Result<v1::TaskResult, Refused> {
    execute_as(pki, addr, client, None, task, token).await
}

/// [`execute`] with `credential` as the bearer, when given.
async fn execute_as(
    pki: &TestPki,
    addr: SocketAddr,
    client: Option<&TestCert>,
    credential: Option<&str>,
    task: &v1::DelegationTask,
    token: &str,
) -> Result<v1::TaskResult, Refused> {
    let channel = pki
        .connect(addr, client)
        .await
        .map_err(|e| Refused::Connect(chain(&e)))?;
    let request = v1::WorkerExecuteRequest {
        lease_valid_until: None,
        task: Some(task.clone()),
        task_token: token.to_owned(),
        attempt: 1,
    };
    let request = match credential {
        Some(c) => convene_mesh::auth::request(request, c),
        None => tonic::Request::new(request),
    };
    let response = WorkerClient::new(channel)
        .execute(request)
        .await
        .map_err(Refused::Status)?;
    Ok(response
        .into_inner()
        .result
        .expect("Execute answers with a result"))
}

/// Asserts that `refused` is the identity check's refusal naming `presented`.
fn assert_identity_refusal(refused: &tonic::Status, presented: &str) {
    assert_eq!(refused.code(), tonic::Code::PermissionDenied, "{refused:?}");
    let message = refused.message();
    assert!(
        message.contains("only the supervisor may execute delegations")
            && message.contains(&format!("names {presented},"))
            && message.contains("spiffe://<trust domain>/supervisor"),
        "the refusal names what was presented and what is required: {message}"
    );
}

/// Asserts that a call failed at the TLS handshake with the server's `alert`: no
/// connection, or a transport failure, never an answer of the service.
fn assert_handshake_refusal(refused: Refused, alert: &str) {
    let text = match refused {
        Refused::Connect(text) => text,
        Refused::Status(s) => {
            assert!(
                matches!(s.code(), tonic::Code::Unavailable | tonic::Code::Unknown),
                "refused by the transport, not by the service: {s:?}"
            );
            format!(
                "{}: {}",
                s.message(),
                s.source().map(chain).unwrap_or_default()
            )
        }
    };
    assert!(
        text.contains(&format!("received fatal alert: {alert}")),
        "the handshake is refused with {alert}: {text}"
    );
}

#[tokio::test]
async fn only_the_supervisors_certificate_may_execute_delegations() {
    let mesh = Mesh::start().await;
    let pki = TestPki::new();
    let worker = tls_worker(&mesh, &pki, true).await;
    let supervisor = pki.clients.service("supervisor");

    let accepted = task(
        "del-mtls-supervisor",
        "logs-investigator",
        Duration::from_secs(30),
    );
    let token = mesh.token_for(&accepted, &[]).await;
    let result = execute(&pki, worker.addr, Some(&supervisor), &accepted, &token)
        .await
        .expect("the supervisor's certificate may execute");
    assert_eq!(status(&result), v1::TaskStatus::Completed, "{result:#?}");
    assert_eq!(result.worker_id, "worker-mtls-1");
    assert!(
        !mesh.decisions_for("del-mtls-supervisor").is_empty(),
        "the delegation ran its tool calls"
    );

    // The other certificates bring a good task token: the identity alone refuses them,
    // before the delegation runs a single tool call.
    let refused = task(
        "del-mtls-refused",
        "logs-investigator",
        Duration::from_secs(30),
    );
    let token = mesh.token_for(&refused, &[]).await;
    let as_worker = execute(
        &pki,
        worker.addr,
        Some(&pki.clients.service("worker")),
        &refused,
        &token,
    )
    .await
    .expect_err("a worker's certificate may not execute")
    .status();
    assert_identity_refusal(&as_worker, "spiffe://convene.test/worker");
    let anonymous = execute(
        &pki,
        worker.addr,
        Some(&pki.clients.localhost()),
        &refused,
        &token,
    )
    .await
    .expect_err("a certificate without a SPIFFE id may not execute")
    .status();
    assert_identity_refusal(&anonymous, "no spiffe:// identity");
    let nested = execute(
        &pki,
        worker.addr,
        Some(&pki.clients.service("supervisor/shadow")),
        &refused,
        &token,
    )
    .await
    .expect_err("an id under the supervisor's path is not the supervisor's")
    .status();
    assert_identity_refusal(&nested, "spiffe://convene.test/supervisor/shadow");
    assert!(
        mesh.decisions_for("del-mtls-refused").is_empty(),
        "a refused Execute runs nothing: {:#?}",
        mesh.decisions_for("del-mtls-refused")
    );

    // No certificate, or the supervisor's id signed by a CA the worker does not trust:
    // refused by the TLS handshake, the service never answers.
    assert_handshake_refusal(
        execute(&pki, worker.addr, None, &refused, &token)
            .await
            .expect_err("a client without a certificate is refused"),
        "CertificateRequired",
    );
    let stranger = TestCa::new("stranger").service("supervisor");
    assert_handshake_refusal(
        execute(&pki, worker.addr, Some(&stranger), &refused, &token)
            .await
            .expect_err("a certificate of another CA is refused"),
        "UnknownCA",
    );
    assert!(mesh.decisions_for("del-mtls-refused").is_empty());
}

#[tokio::test]
async fn without_a_client_ca_execute_needs_the_supervisors_credential() {
    let mesh = Mesh::start().await;
    let pki = TestPki::new();
    let worker = tls_worker(&mesh, &pki, false).await;

    // No client certificate is asked for, so the caller must prove it is the supervisor
    // with its credential: without one nothing runs, and the refusal says what to send.
    let plain = task(
        "del-tls-plain",
        "logs-investigator",
        Duration::from_secs(30),
    );
    let token = mesh.token_for(&plain, &[]).await;
    let refused = execute(&pki, worker.addr, None, &plain, &token)
        .await
        .expect_err("an anonymous Execute is refused")
        .status();
    assert_eq!(refused.code(), tonic::Code::Unauthenticated, "{refused:?}");
    assert!(
        refused
            .message()
            .contains("only the supervisor may execute delegations")
            && refused.message().contains("credential"),
        "{refused:?}"
    );
    // Another principal's credential, a person's, is not the supervisor's.
    let person = convene_mesh::policy_file::dev_credential(
        &mesh.dir.path().join("credentials"),
        "oncall@acme",
    )
    .unwrap();
    let refused = execute_as(&pki, worker.addr, None, Some(&person), &plain, &token)
        .await
        .expect_err("a person's credential is refused")
        .status();
    assert_eq!(refused.code(), tonic::Code::PermissionDenied, "{refused:?}");
    assert!(mesh.decisions_for("del-tls-plain").is_empty());

    // With the supervisor's credential the delegation runs.
    let result = execute_as(
        &pki,
        worker.addr,
        None,
        Some(&mesh.supervisor),
        &plain,
        &token,
    )
    .await
    .expect("the supervisor's credential is enough where no certificate is asked for");
    assert_eq!(status(&result), v1::TaskStatus::Completed, "{result:#?}");

    // A client offering a worker's certificate is not asked for it: it is not seen, and
    // the credential still decides.
    let offered = task(
        "del-tls-offered",
        "logs-investigator",
        Duration::from_secs(30),
    );
    let token = mesh.token_for(&offered, &[]).await;
    let result = execute_as(
        &pki,
        worker.addr,
        Some(&pki.clients.service("worker")),
        Some(&mesh.supervisor),
        &offered,
        &token,
    )
    .await
    .expect("a certificate the server did not ask for is not checked");
    assert_eq!(status(&result), v1::TaskStatus::Completed, "{result:#?}");

    // The task token decides too: one the policy service did not sign is refused
    // before anything runs.
    let forged = task(
        "del-tls-forged",
        "logs-investigator",
        Duration::from_secs(30),
    );
    let claims = serde_json::json!({ "sub": "oncall@acme", "tenant": "acme-payments" });
    let refused = execute_as(
        &pki,
        worker.addr,
        None,
        Some(&mesh.supervisor),
        &forged,
        &unsigned_token(&claims),
    )
    .await
    .expect_err("an unsigned token is refused")
    .status();
    assert_eq!(refused.code(), tonic::Code::Unauthenticated, "{refused:?}");
    assert!(
        refused.message().contains("task token refused"),
        "{refused:?}"
    );
    assert!(mesh.decisions_for("del-tls-forged").is_empty());
}
