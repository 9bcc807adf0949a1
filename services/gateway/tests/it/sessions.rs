//! Console sessions on every back end: found by their token only, ended by expiry or
//! sign-out, never holding the token itself, and kept across a reopen of the database.

use convene_gateway::console::Sessions;
use convene_store::test_util::test_databases;
use convene_store::{Database, sql};

async fn contract(sessions: &Sessions, label: &str) {
    let (token, opened) = sessions
        .open("oncall@acme", "acme-payments", 1_000, 5_000)
        .await
        .unwrap();
    assert_eq!(token.len(), 64, "{label}: 32 random bytes, hex");
    assert_eq!(opened.csrf.len(), 64, "{label}");
    assert_ne!(opened.csrf, token, "{label}");
    assert_eq!(
        sessions.get(&token, 2_000).await.unwrap(),
        Some(opened.clone()),
        "{label}"
    );
    assert_eq!(sessions.get("nope", 2_000).await.unwrap(), None, "{label}");
    assert_eq!(
        sessions.get(&token, 5_000).await.unwrap(),
        None,
        "{label}: ended at its expiry"
    );

    let (other, _) = sessions
        .open("alice@acme", "acme-payments", 1_000, 9_000)
        .await
        .unwrap();
    assert_ne!(other, token, "{label}: every session its own token");
    sessions.close(&other).await.unwrap();
    assert_eq!(
        sessions.get(&other, 2_000).await.unwrap(),
        None,
        "{label}: signed out"
    );
}

#[tokio::test]
async fn sessions_are_found_by_their_token_until_they_end() {
    contract(&Sessions::new(None), "memory").await;
    for t in test_databases().await {
        contract(&Sessions::new(Some(t.db.clone())), t.label).await;
        // Only the token's hash is stored.
        let rows =
            t.db.fetch_all(sql("SELECT session_id FROM console_sessions"))
                .await
                .unwrap();
        for row in rows {
            let id: String = row.get("session_id").unwrap();
            assert_eq!(id.len(), 64, "{}: a SHA-256, hex", t.label);
        }
    }
}

#[tokio::test]
async fn a_session_survives_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let url = convene_store::sqlite_url(&dir.path().join(convene_store::SQLITE_FILE));
    let (token, opened) = {
        let db = Database::connect(&url).await.unwrap();
        let opened = Sessions::new(Some(db.clone()))
            .open("oncall@acme", "acme-payments", 1_000, i64::MAX)
            .await
            .unwrap();
        db.close().await;
        opened
    };
    let reopened = Sessions::new(Some(Database::connect(&url).await.unwrap()));
    assert_eq!(reopened.get(&token, 2_000).await.unwrap(), Some(opened));
}
