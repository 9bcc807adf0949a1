//! The join over 3, 30 and 300 results: what the supervisor pays on every result.

use std::collections::BTreeMap;
use std::hint::black_box;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use convene_core::join::{EvidenceFact, ExpectedDelegation, JoinInput, decide};
use convene_core::model::{
    JoinContract, JoinMinimum, JoinStrategy, LateResultPolicy, OnConflict, OnTimeout,
};
use convene_proto::v1;
use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};

fn fixture(
    n: usize,
) -> (
    JoinContract,
    Vec<ExpectedDelegation>,
    Vec<v1::TaskResult>,
    BTreeMap<String, EvidenceFact>,
) {
    let contract = JoinContract {
        join_id: "bench".into(),
        required: vec!["d0".into()],
        optional: Vec::new(),
        strategy: JoinStrategy::All,
        minimum: JoinMinimum {
            count: 1,
            weight: 0.0,
            required_evidence_kinds: vec!["impact_metric".into()],
        },
        deadline: Some(UNIX_EPOCH + Duration::from_secs(10_000)),
        on_timeout: OnTimeout::EmitPartial,
        on_conflict: OnConflict::PreserveAndEscalate,
        late_result: LateResultPolicy::Discard,
        weights: BTreeMap::new(),
        required_profiles: Vec::new(),
    };
    let mut delegations = Vec::with_capacity(n);
    let mut results = Vec::with_capacity(n);
    let mut evidence = BTreeMap::new();
    for i in 0..n {
        let id = format!("del-{i:024}");
        delegations.push(ExpectedDelegation {
            delegation_id: id.clone(),
            name: format!("d{i}"),
            profile_id: "p".into(),
            worker_ids: vec!["w".into()],
            allowed_evidence_prefixes: vec!["logs://".into()],
        });
        let ev = format!("logs://svc/{id}/s");
        evidence.insert(
            ev.clone(),
            EvidenceFact::Verified {
                kind: "impact_metric".into(),
                content_hash: "sha256:00".into(),
                kind_defaulted: false,
            },
        );
        results.push(v1::TaskResult {
            delegation_id: id,
            worker_id: "w".into(),
            profile_id: "p".into(),
            status: v1::TaskStatus::Completed as i32,
            claims: vec![v1::Claim {
                claim_id: "c".into(),
                // Every tenth claim disagrees, so conflicts are found and kept.
                topic: "primary_cause".into(),
                value: if i % 10 == 0 { "b".into() } else { "a".into() },
                evidence_refs: vec![ev],
                ..Default::default()
            }],
            ..Default::default()
        });
    }
    (contract, delegations, results, evidence)
}

fn bench_join(c: &mut Criterion) {
    let mut group = c.benchmark_group("join.decide");
    for n in [3usize, 30, 300] {
        let (contract, delegations, results, evidence) = fixture(n);
        group.bench_with_input(BenchmarkId::from_parameter(n), &n, |b, _| {
            b.iter(|| {
                let input = JoinInput {
                    contract: &contract,
                    delegations: &delegations,
                    results: &results,
                    evidence: &evidence,
                    now: SystemTime::UNIX_EPOCH + Duration::from_secs(1),
                    settlements: &convene_core::join::NO_SETTLEMENTS,
                };
                black_box(decide(black_box(&input)))
            });
        });
    }
    group.finish();
}

criterion_group!(benches, bench_join);
criterion_main!(benches);
