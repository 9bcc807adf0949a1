//! Shared setup of the evidence store's integration tests: a real policy service issuing
//! task tokens, and the evidence store verifying them, each on its own loopback port,
//! with their files in a temporary directory.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use convene_evidence_store::artifacts::ArtifactRef;
use convene_evidence_store::catalog::{Catalog, MemoryCatalog};
use convene_evidence_store::{Config, EvidenceStoreService};
use convene_mesh::auth::request;
use convene_mesh::handles::{GrpcPolicy, PolicyHandle};
use convene_policy::PolicyService;
use convene_proto::v1::{
    self, evidence_store_client::EvidenceStoreClient, policy_client::PolicyClient,
};
use convene_server::GrpcServer;
use convene_server::test_util::{TestServer, endpoint};
use tonic::transport::Channel;

/// Credential of the supervisor (role `tokens:issue`).
pub const SUPERVISOR: &str = "cvn_test_supervisor_credential";
/// Credential of oncall@acme (tenant acme, role `evidence:read`).
pub const ONCALL: &str = "cvn_test_oncall_credential";
/// Credential of viewer@acme (tenant acme, no roles).
pub const VIEWER: &str = "cvn_test_viewer_credential";
/// Credential of analyst@globex (tenant globex, role `evidence:read`).
pub const ANALYST: &str = "cvn_test_analyst_credential";

/// Largest message the test clients send or accept.
const CLIENT_LIMIT: usize = 64 * 1024 * 1024;

fn sha(credential: &str) -> String {
    convene_evidence_store::artifacts::sha256_hex(credential.as_bytes())
}

/// Two tenants whose principals may read logs and use the evidence store; all but
/// viewer@acme may also read evidence with their own credential.
fn policy_yaml() -> String {
    format!(
        r#"
principals:
  - id: supervisor
    tenant: system
    kind: service
    credential_sha256: ["{supervisor}"]
    roles: [tokens:issue]
  - id: oncall@acme
    tenant: acme
    kind: human
    credential_sha256: ["{oncall}"]
    roles: [evidence:read]
    grants:
      - {{ action: "logs:read", resource: "service/*" }}
      - {{ action: "evidence:*", resource: "evidence" }}
  - id: viewer@acme
    tenant: acme
    kind: human
    credential_sha256: ["{viewer}"]
  - id: analyst@globex
    tenant: globex
    kind: human
    credential_sha256: ["{analyst}"]
    roles: [evidence:read]
    grants:
      - {{ action: "logs:read", resource: "service/*" }}
      - {{ action: "evidence:*", resource: "evidence" }}
profiles:
  - id: logs-investigator
    investigating: true
    tools: [search_logs@1]
    evidence_prefixes: ["logs://"]
    capabilities:
      - {{ action: "logs:read", resource: "service/*" }}
      - {{ action: "evidence:*", resource: "evidence" }}
tools:
  - {{ name: search_logs@1, action: "logs:read", risk: R0 }}
"#,
        supervisor = sha(SUPERVISOR),
        oncall = sha(ONCALL),
        viewer = sha(VIEWER),
        analyst = sha(ANALYST),
    )
}

/// How the evidence store reaches the policy service.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PolicyLink {
    /// Over gRPC, as separate processes do; the store loads the policy file itself.
    Grpc,
    /// Through the service value, as `convene up` does; the store shares the policy
    /// service's compiled policy.
    InProcess,
}

/// A policy service and an evidence store on loopback ports.
pub struct Mesh {
    /// Data of both services, removed when the mesh is dropped.
    _dir: tempfile::TempDir,
    /// The policy service (to rotate its key).
    pub policy: PolicyService,
    /// Its server.
    pub policy_server: TestServer,
    /// The store's catalog, shared with the test so it can plant records.
    pub catalog: Arc<MemoryCatalog>,
    /// The store's configuration.
    pub config: Config,
    /// The store's server.
    pub server: TestServer,
    /// The store itself (to serve it behind another server).
    pub store: EvidenceStoreService,
}

impl Mesh {
    /// The default limits, tokens verified over gRPC.
    pub async fn start() -> Self {
        Self::start_with(Config::default().max_artifact_bytes, PolicyLink::Grpc).await
    }

    /// A mesh whose store accepts artifacts up to `max_artifact_bytes`.
    pub async fn start_with(max_artifact_bytes: usize, link: PolicyLink) -> Self {
        Self::start_wrapped(max_artifact_bytes, link, |catalog| catalog).await
    }

    /// Like [`start_with`](Self::start_with), the store's catalog being `wrap` of the
    /// in-memory one.
    pub async fn start_wrapped(
        max_artifact_bytes: usize,
        link: PolicyLink,
        wrap: impl FnOnce(Arc<MemoryCatalog>) -> Arc<dyn Catalog>,
    ) -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        let (policy_file, policy, policy_server) = start_policy(dir.path()).await;

        let config = Config {
            common: convene_server::ServiceCommon {
                policy_file: Some(policy_file),
                dev_credentials: false,
                ..Config::in_dir(dir.path()).common
            },
            max_artifact_bytes,
            policy_endpoint: endpoint(policy_server.addr),
            ..Config::default()
        };
        let (handle, principals): (PolicyHandle, _) = match link {
            PolicyLink::Grpc => (
                Arc::new(GrpcPolicy::connect(&config.policy_endpoint).unwrap()),
                Arc::new(
                    config
                        .policy_source()
                        .load()
                        .expect("the policy file loads")
                        .0,
                ),
            ),
            PolicyLink::InProcess => (Arc::new(policy.clone()), policy.policy().clone()),
        };
        let catalog = Arc::new(MemoryCatalog::new());
        let store = EvidenceStoreService::open_with_catalog(
            &config,
            handle,
            principals,
            wrap(catalog.clone()),
        )
        .expect("the store opens");
        let server = TestServer::start(store.add_to(GrpcServer::new(config.server.clone()))).await;
        Self {
            _dir: dir,
            policy,
            policy_server,
            catalog,
            config,
            server,
            store,
        }
    }

    /// A client of the store.
    pub async fn client(&self) -> EvidenceStoreClient<Channel> {
        EvidenceStoreClient::new(self.server.channel().await)
            .max_decoding_message_size(CLIENT_LIMIT)
            .max_encoding_message_size(CLIENT_LIMIT)
    }

    /// A task token for a logs-investigator of `principal` holding `scopes` (action,
    /// resource), limited to the last hour as investigation tokens are.
    pub async fn token(
        &self,
        principal: &str,
        delegation: &str,
        scopes: &[(&str, &str)],
    ) -> String {
        issue_token(&self.policy_server, principal, delegation, scopes).await
    }

    /// A token of acme that may write and read evidence.
    pub async fn acme(&self) -> String {
        self.token(
            "oncall@acme",
            "del-acme",
            &[
                ("evidence:write", "evidence"),
                ("evidence:read", "evidence"),
            ],
        )
        .await
    }

    /// A token of globex that may write and read evidence.
    pub async fn globex(&self) -> String {
        self.token(
            "analyst@globex",
            "del-globex",
            &[
                ("evidence:write", "evidence"),
                ("evidence:read", "evidence"),
            ],
        )
        .await
    }

    /// Stores `content` with `token`.
    pub async fn put(&self, token: &str, content: &[u8]) -> v1::PutArtifactResponse {
        self.client()
            .await
            .put_artifact(request(
                v1::PutArtifactRequest {
                    content: content.to_vec(),
                    media_type: "application/json".into(),
                    tool_call_id: "call-1".into(),
                    evidence: None,
                },
                token,
            ))
            .await
            .expect("stored")
            .into_inner()
    }

    /// The file holding an artifact's bytes.
    pub fn artifact_file(&self, uri: &str) -> PathBuf {
        let artifact = ArtifactRef::parse(uri).expect("an artifact URI");
        self.config
            .artifacts_dir()
            .join(&artifact.tenant)
            .join(&artifact.sha256)
    }
}

/// Writes the test policy to `<dir>/policy.yaml` and serves a policy service of it on a
/// loopback port: the file, the service (to rotate its key) and its server.
pub async fn start_policy(dir: &Path) -> (PathBuf, PolicyService, TestServer) {
    let policy_file = dir.join("policy.yaml");
    std::fs::write(&policy_file, policy_yaml()).expect("write the policy file");
    let policy_config = convene_policy::Config {
        common: convene_server::ServiceCommon {
            policy_file: Some(policy_file.clone()),
            dev_credentials: false,
            ..convene_policy::Config::in_dir(dir).common
        },
        decision_log: convene_policy::DecisionLogTarget::Memory,
    };
    let policy = PolicyService::open(&policy_config).expect("the policy service opens");
    let server =
        TestServer::start(policy.add_to(GrpcServer::new(policy_config.server.clone()))).await;
    (policy_file, policy, server)
}

/// A task token from the policy service at `policy_server` for a logs-investigator of
/// `principal` holding `scopes` (action, resource), limited to the last hour as
/// investigation tokens are.
pub async fn issue_token(
    policy_server: &TestServer,
    principal: &str,
    delegation: &str,
    scopes: &[(&str, &str)],
) -> String {
    let now = SystemTime::now();
    let grant = v1::TokenGrantRequest {
        delegation_id: delegation.into(),
        profile_id: "logs-investigator".into(),
        depth: 1,
        required_scopes: scopes
            .iter()
            .map(|(action, resource)| v1::PermissionScope {
                action: (*action).into(),
                resource: (*resource).into(),
                data_scope: None,
            })
            .collect(),
        task_scope: Some(v1::TaskScope {
            resources: Vec::new(),
            time_range: Some(v1::TimeRange {
                start: Some((now - Duration::from_secs(3600)).into()),
                end: Some((now + Duration::from_secs(60)).into()),
            }),
        }),
        ..Default::default()
    };
    let message = v1::IssueTaskTokenRequest {
        lease_epoch: 0,
        principal: principal.into(),
        run_id: "run-1".into(),
        parent_token: String::new(),
        grants: vec![grant],
    };
    PolicyClient::new(policy_server.channel().await)
        .issue_task_token(request(message, SUPERVISOR))
        .await
        .expect("a token is issued")
        .into_inner()
        .tokens
        .remove(0)
        .token
}

/// An evidence record citing `uri` (hash filled by the caller or the store).
pub fn evidence(id: &str, uri: &str, hash: &str) -> v1::Evidence {
    v1::Evidence {
        evidence_id: id.into(),
        kind: "impact_metric".into(),
        source: "logs.payment_prod".into(),
        query_fingerprint: convene_core::ids::content_hash(b"select count(*)"),
        scope: Some(v1::TaskScope {
            resources: vec!["service/payment-api".into()],
            time_range: None,
        }),
        observed_at: Some(SystemTime::now().into()),
        artifact_uri: uri.into(),
        content_hash: hash.into(),
        quality: v1::EvidenceQuality::Passed.into(),
        tool_call_id: "call-1".into(),
        trace_id: "4bf92f3577b34da6a3ce929d0e0e4736".into(),
        delegation_id: String::new(),
        tenant: String::new(),
        kind_defaulted: false,
    }
}

/// Stores `content` with `token` and records evidence `id` citing it; the artifact.
pub async fn put_with_evidence(mesh: &Mesh, token: &str, content: &[u8], id: &str) -> v1::Artifact {
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
pub fn chain(refs: &[&str]) -> v1::VerifyChainRequest {
    v1::VerifyChainRequest {
        claims: vec![v1::ChainClaim {
            claim_id: "c1".into(),
            evidence_refs: refs.iter().map(|r| (*r).to_owned()).collect(),
        }],
        rehash_content: true,
    }
}
