-- The policy service's state: per-token call counters, revocations, the tenant of every
-- issued token (for revocation rights) and the append-only decision log. Times are
-- microseconds since the Unix epoch.

-- Calls counted against a token's max_calls; the row may go once the token expired.
CREATE TABLE call_counters (
    token_id   TEXT    NOT NULL PRIMARY KEY,
    used       BIGINT  NOT NULL,
    max_calls  BIGINT  NOT NULL,
    expires_at BIGINT  NOT NULL
);
CREATE INDEX call_counters_by_expiry ON call_counters (expires_at);

-- Revoked tokens (kind 'token') and runs (kind 'run'); the first reason stays.
CREATE TABLE revocations (
    kind       TEXT    NOT NULL,
    target_id  TEXT    NOT NULL,
    reason     TEXT    NOT NULL,
    revoked_at BIGINT  NOT NULL,
    PRIMARY KEY (kind, target_id)
);

-- Tokens the service issued: who may revoke them (and their runs).
CREATE TABLE issued_tokens (
    token_id   TEXT    NOT NULL PRIMARY KEY,
    run_id     TEXT    NOT NULL,
    tenant     TEXT    NOT NULL,
    expires_at BIGINT  NOT NULL
);
CREATE INDEX issued_tokens_by_run ON issued_tokens (run_id);
CREATE INDEX issued_tokens_by_expiry ON issued_tokens (expires_at);

-- Every authorization decision and revocation, in append order. `record` is the JSON
-- record the JSON-lines log would hold; the other columns are for queries.
CREATE TABLE decision_log (
    position    BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    decision_id TEXT    NOT NULL,
    kind        TEXT    NOT NULL,
    time        TEXT    NOT NULL,
    tenant      TEXT,
    run_id      TEXT,
    token_id    TEXT,
    allowed     BOOLEAN,
    record      TEXT    NOT NULL
);
CREATE INDEX decision_log_by_run ON decision_log (run_id, position);
