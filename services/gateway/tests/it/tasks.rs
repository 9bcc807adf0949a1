//! The task ↔ run mapping on every back end: scoped to its principal, one task per run
//! and principal, listed newest first, and kept across a reopen of the database.

use convene_gateway::TaskMap;
use convene_gateway::tasks::TaskRecord;
use convene_store::Database;
use convene_store::test_util::test_databases;

fn record(task: &str, principal: &str, run: &str, at: i64) -> TaskRecord {
    TaskRecord {
        task_id: task.to_owned(),
        context_id: format!("ctx-{principal}"),
        tenant: "acme".to_owned(),
        principal: principal.to_owned(),
        run_id: run.to_owned(),
        skill: "payment-incident-triage".to_owned(),
        created_at: at,
    }
}

async fn contract(map: &TaskMap, label: &str) {
    let first = map.insert(record("t1", "oncall", "r1", 1)).await.unwrap();
    assert_eq!(first.task_id, "t1", "{label}");
    // The same message again (same run): the first task, not a second one.
    let again = map.insert(record("t9", "oncall", "r1", 5)).await.unwrap();
    assert_eq!(again, first, "{label}: one task per run and principal");
    map.insert(record("t2", "oncall", "r2", 2)).await.unwrap();
    map.insert(record("t3", "analyst", "r3", 3)).await.unwrap();

    assert_eq!(
        map.get("oncall", "t1").await.unwrap(),
        Some(first.clone()),
        "{label}"
    );
    assert_eq!(
        map.get("analyst", "t1").await.unwrap(),
        None,
        "{label}: another principal's task is not found"
    );
    assert_eq!(map.get("oncall", "t9").await.unwrap(), None, "{label}");

    let page = map.list("oncall", None, 0, 1).await.unwrap();
    assert_eq!(page.total, 2, "{label}");
    assert_eq!(
        page.tasks
            .iter()
            .map(|t| t.task_id.as_str())
            .collect::<Vec<_>>(),
        ["t2"],
        "{label}: newest first"
    );
    let next = map.list("oncall", None, 1, 10).await.unwrap();
    assert_eq!(
        next.tasks
            .iter()
            .map(|t| t.task_id.as_str())
            .collect::<Vec<_>>(),
        ["t1"],
        "{label}"
    );
    let other_context = map
        .list("oncall", Some("ctx-analyst"), 0, 10)
        .await
        .unwrap();
    assert!(other_context.tasks.is_empty(), "{label}");
    assert_eq!(other_context.total, 0, "{label}");
}

#[tokio::test]
async fn tasks_are_scoped_unique_per_run_and_listed_newest_first() {
    contract(&TaskMap::new(None), "memory").await;
    for t in test_databases().await {
        contract(&TaskMap::new(Some(t.db.clone())), t.label).await;
    }
}

#[tokio::test]
async fn the_mapping_survives_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let url = convene_store::sqlite_url(&dir.path().join(convene_store::SQLITE_FILE));
    {
        let db = Database::connect(&url).await.unwrap();
        TaskMap::new(Some(db.clone()))
            .insert(record("t1", "oncall", "r1", 1))
            .await
            .unwrap();
        db.close().await;
    }
    let reopened = TaskMap::new(Some(Database::connect(&url).await.unwrap()));
    assert_eq!(
        reopened
            .get("oncall", "t1")
            .await
            .unwrap()
            .map(|t| t.run_id),
        Some("r1".to_owned())
    );
}
