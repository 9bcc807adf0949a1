//! The `Catalog` contract on every catalog: in memory, a SQLite file, and PostgreSQL
//! when `CONVENE_TEST_POSTGRES_URL` names a server.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use convene_evidence_store::SqlCatalog;
use convene_evidence_store::artifacts::ArtifactRef;
use convene_evidence_store::catalog::{
    ArtifactMeta, Catalog, CatalogError, MemoryCatalog, Recorded,
};
use convene_proto::v1;
use convene_store::test_util::{TestDatabase, test_databases};

struct Subject {
    label: &'static str,
    catalog: Arc<dyn Catalog>,
    _db: Option<TestDatabase>,
}

async fn subjects() -> Vec<Subject> {
    let mut all = vec![Subject {
        label: "memory",
        catalog: Arc::new(MemoryCatalog::new()),
        _db: None,
    }];
    for t in test_databases().await {
        all.push(Subject {
            label: t.label,
            catalog: Arc::new(SqlCatalog::new(t.db.clone())),
            _db: Some(t),
        });
    }
    all
}

fn evidence(id: &str, kind: &str) -> v1::Evidence {
    v1::Evidence {
        evidence_id: id.into(),
        kind: kind.into(),
        source: "search_logs@1".into(),
        artifact_uri: "artifact://acme/00".into(),
        content_hash: "sha256:00".into(),
        observed_at: Some(prost_types::Timestamp {
            seconds: 1_700_000_000,
            nanos: 5,
        }),
        quality: v1::EvidenceQuality::Passed as i32,
        ..Default::default()
    }
}

#[tokio::test]
async fn evidence_is_immutable_and_tenant_scoped() {
    for s in subjects().await {
        let catalog = &*s.catalog;
        let e = evidence("logs://a/1", "impact_metric");
        assert_eq!(
            catalog.record_evidence("acme", e.clone()).await.unwrap(),
            Recorded::Created,
            "{}",
            s.label
        );
        assert_eq!(
            catalog.record_evidence("acme", e.clone()).await.unwrap(),
            Recorded::Unchanged,
            "{}",
            s.label
        );
        let changed = evidence("logs://a/1", "causal_signal");
        assert_eq!(
            catalog.record_evidence("acme", changed).await.unwrap(),
            Recorded::Conflict(Box::new(e.clone())),
            "{}",
            s.label
        );
        // The same id in another tenant is another record.
        let theirs = evidence("logs://a/1", "causal_signal");
        assert_eq!(
            catalog
                .record_evidence("globex", theirs.clone())
                .await
                .unwrap(),
            Recorded::Created,
            "{}",
            s.label
        );
        let ids = vec![
            "logs://a/2".to_owned(),
            "logs://a/1".to_owned(),
            "logs://a/1".to_owned(),
        ];
        assert_eq!(
            catalog.evidence("acme", &ids).await.unwrap(),
            vec![None, Some(e.clone()), Some(e)],
            "{}: in the order asked, unknown ids as None",
            s.label
        );
        assert_eq!(
            catalog.evidence("globex", &ids).await.unwrap(),
            vec![None, Some(theirs.clone()), Some(theirs)],
            "{}",
            s.label
        );
        assert_eq!(
            catalog.evidence("initech", &ids).await.unwrap(),
            vec![None, None, None],
            "{}",
            s.label
        );
        assert!(catalog.evidence("acme", &[]).await.unwrap().is_empty());
    }
}

#[tokio::test]
async fn the_first_artifact_metadata_wins() {
    for s in subjects().await {
        let catalog = &*s.catalog;
        let meta = ArtifactMeta {
            artifact: ArtifactRef::of("acme", b"x"),
            media_type: "text/plain".into(),
            size: 1,
            created_by_delegation: "del-1".into(),
            created_by_tool_call: "call-1".into(),
            created_at: SystemTime::UNIX_EPOCH + Duration::from_micros(1_700_000_000_000_001),
        };
        assert_eq!(
            catalog.put_artifact(meta.clone()).await.unwrap(),
            (meta.clone(), true),
            "{}",
            s.label
        );
        let later = ArtifactMeta {
            created_by_delegation: "del-2".into(),
            media_type: "application/json".into(),
            ..meta.clone()
        };
        assert_eq!(
            catalog.put_artifact(later).await.unwrap(),
            (meta.clone(), false),
            "{}",
            s.label
        );
        let sha = &meta.artifact.sha256;
        assert_eq!(
            catalog.artifact("acme", sha).await.unwrap(),
            Some(meta.clone()),
            "{}",
            s.label
        );
        assert_eq!(
            catalog.artifact("globex", sha).await.unwrap(),
            None,
            "{}",
            s.label
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_writers_of_one_record_create_it_once() {
    for s in subjects().await {
        let tasks: Vec<_> = (0..20)
            .map(|_| {
                let catalog = s.catalog.clone();
                tokio::spawn(async move {
                    catalog
                        .record_evidence("acme", evidence("logs://b/1", "impact_metric"))
                        .await
                        .unwrap()
                })
            })
            .collect();
        let mut created = 0;
        for task in tasks {
            match task.await.unwrap() {
                Recorded::Created => created += 1,
                Recorded::Unchanged => {}
                Recorded::Conflict(e) => panic!("{}: identical records conflict: {e:?}", s.label),
            }
        }
        assert_eq!(created, 1, "{}", s.label);
    }
}

#[tokio::test]
async fn an_artifact_and_the_evidence_citing_it_are_recorded_together() {
    for s in subjects().await {
        let catalog = &*s.catalog;
        let meta = |bytes: &[u8]| ArtifactMeta {
            artifact: ArtifactRef::of("acme", bytes),
            media_type: "application/json".into(),
            size: bytes.len() as u64,
            created_by_delegation: "del-1".into(),
            created_by_tool_call: "call-1".into(),
            created_at: SystemTime::UNIX_EPOCH + Duration::from_micros(1_700_000_000_000_001),
        };
        let e = evidence("logs://c/1", "impact_metric");
        let x = meta(b"x");
        assert_eq!(
            catalog
                .put_artifact_with_evidence(x.clone(), e.clone())
                .await
                .unwrap(),
            ((x.clone(), true), Recorded::Created),
            "{}",
            s.label
        );
        let sha = &x.artifact.sha256;
        assert_eq!(
            catalog.artifact("acme", sha).await.unwrap(),
            Some(x.clone()),
            "{}",
            s.label
        );
        let ids = vec![e.evidence_id.clone()];
        assert_eq!(
            catalog.evidence("acme", &ids).await.unwrap(),
            vec![Some(e.clone())],
            "{}",
            s.label
        );

        // Again: both were there.
        let again = ArtifactMeta {
            created_by_delegation: "del-2".into(),
            ..x.clone()
        };
        assert_eq!(
            catalog
                .put_artifact_with_evidence(again, e.clone())
                .await
                .unwrap(),
            ((x.clone(), false), Recorded::Unchanged),
            "{}",
            s.label
        );

        // A new artifact with evidence whose id is taken by a different record: the
        // artifact is recorded, the evidence is not, and the caller hears of the conflict.
        let y = meta(b"y");
        let changed = evidence("logs://c/1", "causal_signal");
        assert_eq!(
            catalog
                .put_artifact_with_evidence(y.clone(), changed)
                .await
                .unwrap(),
            ((y.clone(), true), Recorded::Conflict(Box::new(e.clone()))),
            "{}",
            s.label
        );
        assert_eq!(
            catalog.evidence("acme", &ids).await.unwrap(),
            vec![Some(e.clone())],
            "{}",
            s.label
        );

        // In a database the pair is one transaction: when the evidence cannot be written,
        // the artifact's entry is not either.
        if let Some(t) = &s._db {
            t.db.execute(convene_store::sql("DROP TABLE evidence"))
                .await
                .unwrap();
            let z = meta(b"z");
            let err = catalog
                .put_artifact_with_evidence(z.clone(), evidence("logs://c/2", "impact_metric"))
                .await
                .unwrap_err();
            let CatalogError::Unavailable(why) = err;
            assert!(
                why.contains("no such table") || why.contains("does not exist"),
                "{}: {why}",
                s.label
            );
            assert_eq!(
                catalog.artifact("acme", &z.artifact.sha256).await.unwrap(),
                None,
                "{}: the artifact's entry was rolled back",
                s.label
            );
        }
    }
}

#[tokio::test]
async fn another_catalog_on_the_same_database_reads_what_one_wrote() {
    for t in test_databases().await {
        // Two catalogs over one database, as two evidence store replicas: each keeps the
        // records it saw, and what one wrote is in the database for the other.
        let writer = SqlCatalog::new(t.db.clone());
        let reader = SqlCatalog::new(t.db.clone());
        let meta = ArtifactMeta {
            artifact: ArtifactRef::of("acme", b"shared"),
            media_type: "application/json".into(),
            size: 6,
            created_by_delegation: "del-1".into(),
            created_by_tool_call: "call-1".into(),
            created_at: SystemTime::UNIX_EPOCH + Duration::from_micros(1_700_000_000_000_001),
        };
        let e = evidence("logs://d/1", "impact_metric");
        writer
            .put_artifact_with_evidence(meta.clone(), e.clone())
            .await
            .unwrap();
        let other = evidence("logs://d/2", "causal_signal");
        writer.record_evidence("acme", other.clone()).await.unwrap();

        let sha = &meta.artifact.sha256;
        for _ in 0..2 {
            // Read from the database, then from what the reader kept: the same answer.
            assert_eq!(
                reader.artifact("acme", sha).await.unwrap(),
                Some(meta.clone()),
                "{}",
                t.label
            );
            let ids = [&e, &other]
                .map(|r| r.evidence_id.clone())
                .into_iter()
                .chain(["logs://d/unknown".to_owned()])
                .collect::<Vec<_>>();
            assert_eq!(
                reader.evidence("acme", &ids).await.unwrap(),
                vec![Some(e.clone()), Some(other.clone()), None],
                "{}",
                t.label
            );
            assert_eq!(
                reader.evidence("globex", &ids[..1]).await.unwrap(),
                vec![None],
                "{}: another tenant's records stay out of reach",
                t.label
            );
        }
        // A record the reader knows conflicts there as it does in the database.
        assert_eq!(
            reader
                .record_evidence("acme", evidence("logs://d/1", "causal_signal"))
                .await
                .unwrap(),
            Recorded::Conflict(Box::new(e.clone())),
            "{}",
            t.label
        );
    }
}
