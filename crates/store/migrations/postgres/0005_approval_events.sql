-- The approval service's event outbox: one CloudEvent per state change of a request
-- (requested, decided, executed, expired, cancelled), written in the same transaction as
-- the change. `position` is the commit order WatchEvents resumes from. Times are
-- microseconds since the Unix epoch. `approvals.state` also takes CANCELLED (a request
-- withdrawn before it was executed).

CREATE TABLE approval_events (
    position    BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    event_id    TEXT    NOT NULL UNIQUE,
    approval_id TEXT    NOT NULL,
    -- Who may see it: the request's tenant, and the principal that filed it.
    tenant      TEXT    NOT NULL,
    filed_by    TEXT    NOT NULL,
    run_id      TEXT    NOT NULL,
    type        TEXT    NOT NULL,
    created_at  BIGINT  NOT NULL,
    -- The encoded convene.v1.CloudEvent.
    body        BYTEA   NOT NULL
);

-- WatchEvents: a viewer's events (its tenant's, and those of the requests it filed) in
-- commit order.
CREATE INDEX approval_events_by_tenant ON approval_events (tenant, position);
CREATE INDEX approval_events_by_filer ON approval_events (filed_by, position);

-- The expiry sweep looks at pending requests only.
CREATE INDEX approvals_pending_expiry ON approvals (expires_at) WHERE state = 'PENDING';
