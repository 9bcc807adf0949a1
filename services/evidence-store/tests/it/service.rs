//! The service's plumbing: tokens verified in-process across key rotation, health and
//! reflection, the binary's configuration dump, and a graceful drain.

use std::io::BufRead as _;
use std::process::{Command, Stdio};
use std::time::Duration;

use crate::support::{Mesh, PolicyLink};
use convene_mesh::auth::request;
use convene_proto::v1;

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
    let mut reader = std::io::BufReader::new(stderr);
    // First the warning that development credentials are generated, then what the
    // development settings are.
    let mut warning = String::new();
    reader.read_line(&mut warning).unwrap();
    let mut first = String::new();
    reader.read_line(&mut first).unwrap();
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(warning.contains("DEVELOPMENT CREDENTIALS"), "{warning}");
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
