-- The approval service's requests. Times are microseconds since the Unix epoch.

CREATE TABLE approvals (
    approval_id     TEXT    NOT NULL PRIMARY KEY,
    tenant          TEXT    NOT NULL,
    requester       TEXT    NOT NULL,
    idempotency_key TEXT    NOT NULL,
    filed_by        TEXT    NOT NULL,
    run_id          TEXT    NOT NULL,
    action          TEXT    NOT NULL,
    -- The state as last written (PENDING, APPROVED, REJECTED, EXPIRED, EXECUTED); a
    -- PENDING request past expires_at reads as expired.
    state           TEXT    NOT NULL,
    expires_at      BIGINT  NOT NULL,
    created_at      BIGINT  NOT NULL,
    -- Compare-and-set version: starts at 1, one more per update.
    version         BIGINT  NOT NULL,
    -- Set while an executor runs the action.
    executing_by    TEXT,
    executing_since BIGINT,
    -- The encoded convene.v1.ApprovalRequest (parameters, votes, execution, ...).
    body            BYTEA   NOT NULL,
    -- Filing is idempotent per requester and key: the constraint decides races.
    UNIQUE (requester, idempotency_key)
);
-- ListApprovals: newest first within a tenant, and the requests a service filed.
CREATE INDEX approvals_by_tenant ON approvals (tenant, created_at, approval_id);
CREATE INDEX approvals_by_filer ON approvals (filed_by, created_at, approval_id);
CREATE INDEX approvals_by_run ON approvals (run_id);
