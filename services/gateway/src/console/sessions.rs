//! Console sessions: who signed in, until when, and the token their forms must carry.
//!
//! The browser holds a random session token in an HttpOnly cookie; the database holds
//! only its SHA-256 (table `console_sessions`), with the principal, its tenant, the
//! session's CSRF token and its expiry. Any gateway replica sharing the database serves
//! any session, and a restart signs nobody out. No credential is ever stored: the
//! console acts for the principal with its own credential (see [`super`]).

use std::collections::HashMap;
use std::sync::Mutex;

use convene_mesh::policy_file::credential_hash;
use convene_store::{Database, Row, sql};

/// A failure of the database behind the sessions.
pub type StoreError = convene_store::Error;

/// One signed-in principal.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Session {
    /// The principal.
    pub principal: String,
    /// Its tenant.
    pub tenant: String,
    /// The token every state-changing form of this session carries.
    pub csrf: String,
    /// When the session ends, in milliseconds since the Unix epoch.
    pub expires_at: i64,
}

/// Where sessions are kept.
#[derive(Debug)]
pub enum Sessions {
    /// In the service's database.
    Sql(Database),
    /// In memory (`database_url = memory`), lost at exit.
    Memory(Mutex<HashMap<String, Session>>),
}

/// 32 random bytes, hex: a session or CSRF token.
pub(crate) fn random_token() -> String {
    let mut bytes = [0u8; 32];
    getrandom::fill(&mut bytes).expect("the operating system's random source");
    hex::encode(bytes)
}

impl Sessions {
    /// Sessions in `database`, or in memory without one.
    pub fn new(database: Option<Database>) -> Self {
        match database {
            Some(db) => Self::Sql(db),
            None => Self::Memory(Mutex::new(HashMap::new())),
        }
    }

    /// Opens a session for `principal` of `tenant` until `expires_at` (ms); returns the
    /// token for the cookie and the session. Sessions ended by `now` are dropped.
    pub async fn open(
        &self,
        principal: &str,
        tenant: &str,
        now: i64,
        expires_at: i64,
    ) -> Result<(String, Session), StoreError> {
        let token = random_token();
        let session = Session {
            principal: principal.to_owned(),
            tenant: tenant.to_owned(),
            csrf: random_token(),
            expires_at,
        };
        let id = credential_hash(&token);
        match self {
            Self::Sql(db) => {
                db.execute(sql("DELETE FROM console_sessions WHERE expires_at <= $1").bind(now))
                    .await?;
                db.execute(
                    sql("INSERT INTO console_sessions (session_id, principal, tenant, csrf, created_at, expires_at) \
                         VALUES ($1, $2, $3, $4, $5, $6)")
                        .bind(&id)
                        .bind(&session.principal)
                        .bind(&session.tenant)
                        .bind(&session.csrf)
                        .bind(now)
                        .bind(expires_at),
                )
                .await?;
            }
            Self::Memory(map) => {
                let mut map = map.lock().expect("lock poisoned");
                map.retain(|_, s| s.expires_at > now);
                map.insert(id, session.clone());
            }
        }
        Ok((token, session))
    }

    /// The live session of cookie token `token` at `now`.
    pub async fn get(&self, token: &str, now: i64) -> Result<Option<Session>, StoreError> {
        let id = credential_hash(token);
        let session = match self {
            Self::Sql(db) => db
                .fetch_optional(
                    sql("SELECT principal, tenant, csrf, expires_at FROM console_sessions WHERE session_id = $1")
                        .bind(&id),
                )
                .await?
                .map(|row| from_row(&row))
                .transpose()?,
            Self::Memory(map) => map.lock().expect("lock poisoned").get(&id).cloned(),
        };
        Ok(session.filter(|s| s.expires_at > now))
    }

    /// Ends the session of `token` (sign-out); nothing when there is none.
    pub async fn close(&self, token: &str) -> Result<(), StoreError> {
        let id = credential_hash(token);
        match self {
            Self::Sql(db) => {
                db.execute(sql("DELETE FROM console_sessions WHERE session_id = $1").bind(&id))
                    .await?;
            }
            Self::Memory(map) => {
                map.lock().expect("lock poisoned").remove(&id);
            }
        }
        Ok(())
    }
}

fn from_row(row: &Row) -> Result<Session, StoreError> {
    Ok(Session {
        principal: row.get("principal")?,
        tenant: row.get("tenant")?,
        csrf: row.get("csrf")?,
        expires_at: row.get("expires_at")?,
    })
}
