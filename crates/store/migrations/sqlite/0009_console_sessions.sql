-- The operator console's sessions: one row per signed-in browser, found by the SHA-256
-- of the random token in its cookie (the token itself is never stored), with the
-- principal, its tenant, the token its forms carry against CSRF, and its expiry in
-- milliseconds since the Unix epoch. Gateway replicas share this table, so a session
-- works on any of them and survives restarts; ended sessions are deleted as new ones
-- open.
CREATE TABLE console_sessions (
    session_id TEXT    NOT NULL PRIMARY KEY,
    principal  TEXT    NOT NULL,
    tenant     TEXT    NOT NULL,
    csrf       TEXT    NOT NULL,
    created_at INTEGER NOT NULL,
    expires_at INTEGER NOT NULL
);
CREATE INDEX console_sessions_expiry ON console_sessions (expires_at);
