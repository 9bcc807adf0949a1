//! Storing and reading artifacts through the evidence store, as a worker and an auditor
//! do (task token verified, bytes hashed, catalog consulted), on three back ends:
//!
//! - `memory`: bytes and catalog in memory — the service's own cost;
//! - `fs`: bytes on the local file system (fsynced), catalog in memory;
//! - `sqlite`: bytes on the file system, catalog in a SQLite file (WAL, synchronous =
//!   FULL), as `convene up` keeps them.
//!
//! Each with 1 KiB and 64 KiB artifacts: `put` stores new bytes, `put_with_evidence` new
//! bytes and an evidence record citing them (a worker's tool call), `put_again` stores
//! bytes already stored (content-addressed: one catalog lookup), `get` reads and
//! re-hashes.
//!
//! `cargo bench -p convene-evidence-store --bench artifacts`

use std::hint::black_box;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

use convene_evidence_store::artifacts::Blobs;
use convene_evidence_store::catalog::{Catalog, MemoryCatalog};
use convene_evidence_store::{Config, EvidenceStoreService, SqlCatalog};
use convene_mesh::auth::request;
use convene_mesh::handles::PolicyHandle;
use convene_policy::PolicyService;
use convene_proto::v1;
use convene_proto::v1::evidence_store_server::EvidenceStore as _;
use convene_proto::v1::policy_server::Policy as _;
use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use tokio::runtime::Runtime;

const SUPERVISOR: &str = "cvn_bench_supervisor_credential";

fn policy_yaml() -> String {
    let sha = |c: &str| convene_evidence_store::artifacts::sha256_hex(c.as_bytes());
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
        oncall = sha("cvn_bench_oncall_credential"),
    )
}

/// An evidence store on one back end, and a task token that may write and read it.
struct Subject {
    store: EvidenceStoreService,
    token: String,
    _dir: tempfile::TempDir,
}

async fn subject(backend: &str) -> Subject {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let policy_file = dir.path().join("policy.yaml");
    std::fs::write(&policy_file, policy_yaml()).expect("the policy file is written");
    let policy_config = convene_policy::Config {
        common: convene_server::ServiceCommon {
            policy_file: Some(policy_file),
            dev_credentials: false,
            ..convene_policy::Config::in_dir(dir.path()).common
        },
        decision_log: convene_policy::DecisionLogTarget::Memory,
    };
    let policy = PolicyService::open(&policy_config).expect("the policy service opens");
    let config = Config::in_dir(dir.path());
    let blobs = match backend {
        "memory" => Blobs::new(Arc::new(object_store::memory::InMemory::new())),
        _ => Blobs::local(&config.artifacts_dir()).expect("the artifact directory"),
    };
    let catalog: Arc<dyn Catalog> = match backend {
        "sqlite" => {
            let url = convene_store::sqlite_url(&dir.path().join("convene.db"));
            let db = convene_store::Database::connect(&url)
                .await
                .expect("the SQLite catalog opens");
            Arc::new(SqlCatalog::new(db))
        }
        _ => Arc::new(MemoryCatalog::new()),
    };
    let handle: PolicyHandle = Arc::new(policy.clone());
    let store = EvidenceStoreService::new(
        handle,
        policy.policy().clone(),
        blobs,
        catalog,
        config.max_artifact_bytes,
    );
    let now = SystemTime::now();
    let grant = v1::TokenGrantRequest {
        delegation_id: "del-bench".into(),
        profile_id: "logs-investigator".into(),
        depth: 1,
        required_scopes: ["evidence:write", "evidence:read"]
            .into_iter()
            .map(|action| v1::PermissionScope {
                action: action.into(),
                resource: "evidence".into(),
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
    let token = policy
        .issue_task_token(request(
            v1::IssueTaskTokenRequest {
                lease_epoch: 0,
                principal: "oncall@acme".into(),
                run_id: "run-bench".into(),
                parent_token: String::new(),
                grants: vec![grant],
            },
            SUPERVISOR,
        ))
        .await
        .expect("a token is issued")
        .into_inner()
        .tokens
        .remove(0)
        .token;
    Subject {
        store,
        token,
        _dir: dir,
    }
}

/// `size` bytes of JSON, made unique by `n`.
fn content(size: usize, n: u64) -> Vec<u8> {
    let mut bytes = format!("{{\"n\":{n:020},\"rows\":\"").into_bytes();
    bytes.resize(size - 2, b'x');
    bytes.extend_from_slice(b"\"}");
    bytes
}

/// An evidence record `n` citing the bytes of the same put.
fn evidence(n: u64) -> v1::Evidence {
    v1::Evidence {
        evidence_id: format!("logs://payment-api/q-{n}"),
        kind: "impact_metric".into(),
        source: "logs.payment_prod".into(),
        observed_at: Some(SystemTime::now().into()),
        quality: v1::EvidenceQuality::Passed.into(),
        tool_call_id: "call-1".into(),
        ..Default::default()
    }
}

async fn put(s: &Subject, bytes: Vec<u8>) -> v1::PutArtifactResponse {
    put_citing(s, bytes, None).await
}

async fn put_citing(
    s: &Subject,
    bytes: Vec<u8>,
    evidence: Option<v1::Evidence>,
) -> v1::PutArtifactResponse {
    s.store
        .put_artifact(request(
            v1::PutArtifactRequest {
                content: bytes,
                media_type: "application/json".into(),
                tool_call_id: "call-1".into(),
                evidence,
            },
            &s.token,
        ))
        .await
        .expect("stored")
        .into_inner()
}

fn bench_artifacts(c: &mut Criterion) {
    let runtime = Runtime::new().expect("a Tokio runtime");
    let counter = AtomicU64::new(0);
    let mut group = c.benchmark_group("evidence_store");
    group.sample_size(30);
    for backend in ["memory", "fs", "sqlite"] {
        let s = runtime.block_on(subject(backend));
        for (label, size) in [("1KiB", 1024), ("64KiB", 64 * 1024)] {
            let id = format!("{backend}/{label}");
            group.throughput(Throughput::Bytes(size as u64));
            group.bench_function(BenchmarkId::new("put", &id), |b| {
                b.iter(|| {
                    let bytes = content(size, counter.fetch_add(1, Ordering::Relaxed));
                    let stored = runtime.block_on(put(&s, bytes));
                    assert!(stored.created);
                    black_box(stored)
                });
            });
            // What a worker's tool call does: new bytes and the evidence citing them.
            group.bench_function(BenchmarkId::new("put_with_evidence", &id), |b| {
                b.iter(|| {
                    let n = counter.fetch_add(1, Ordering::Relaxed);
                    let stored =
                        runtime.block_on(put_citing(&s, content(size, n), Some(evidence(n))));
                    assert!(stored.created && stored.evidence.is_some());
                    black_box(stored)
                });
            });
            let known = content(size, u64::MAX);
            let uri = runtime
                .block_on(put(&s, known.clone()))
                .artifact
                .expect("an artifact")
                .uri;
            group.bench_function(BenchmarkId::new("put_again", &id), |b| {
                b.iter(|| {
                    let stored = runtime.block_on(put(&s, known.clone()));
                    assert!(!stored.created);
                    black_box(stored)
                });
            });
            group.bench_function(BenchmarkId::new("get", &id), |b| {
                b.iter(|| {
                    let read = runtime
                        .block_on(s.store.get_artifact(request(
                            v1::GetArtifactRequest { uri: uri.clone() },
                            &s.token,
                        )))
                        .expect("read")
                        .into_inner();
                    assert_eq!(read.content.len(), size);
                    black_box(read)
                });
            });
        }
    }
    group.finish();
}

criterion_group!(benches, bench_artifacts);
criterion_main!(benches);
