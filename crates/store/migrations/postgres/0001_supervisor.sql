-- The supervisor's state: runs, their idempotency keys, run events, the CloudEvents
-- outbox, the delegation ledger and join decisions. Times are microseconds since the
-- Unix epoch; encoded protobuf messages are BYTEA.

CREATE TABLE runs (
    run_id      TEXT    NOT NULL PRIMARY KEY,
    tenant      TEXT    NOT NULL,
    principal   TEXT    NOT NULL,
    state       BIGINT  NOT NULL,
    terminal    BOOLEAN NOT NULL,
    version     BIGINT  NOT NULL,
    created_at  BIGINT  NOT NULL,
    updated_at  BIGINT  NOT NULL,
    -- The supervisor replica running the run, and until when its lease holds.
    owner       TEXT,
    lease_until BIGINT,
    trace_id    TEXT    NOT NULL,
    -- The encoded convene.v1.Run.
    body        BYTEA   NOT NULL
);
-- ListRuns: a tenant's runs, newest first (UUIDv7 run ids sort by time).
CREATE INDEX runs_by_tenant ON runs (tenant, run_id);
-- Recovery and lease claiming look at unfinished runs only.
CREATE INDEX runs_unfinished ON runs (lease_until) WHERE NOT terminal;

-- StartRun is idempotent per (principal, key): the primary key decides races.
CREATE TABLE idempotency_keys (
    principal TEXT NOT NULL,
    key       TEXT NOT NULL,
    run_id    TEXT NOT NULL REFERENCES runs (run_id) DEFERRABLE INITIALLY DEFERRED,
    PRIMARY KEY (principal, key)
);

-- WatchRun events. `id` orders them across runs in commit order, for pollers in other
-- processes; `sequence` is the run's own gapless numbering.
CREATE TABLE run_events (
    id       BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    run_id   TEXT    NOT NULL REFERENCES runs (run_id),
    sequence BIGINT  NOT NULL,
    body     BYTEA   NOT NULL,
    UNIQUE (run_id, sequence)
);

-- CloudEvents committed with the state change that produced them. `position` is the
-- commit order relays and WatchEvents resume from.
CREATE TABLE outbox (
    position   BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    event_id   TEXT    NOT NULL UNIQUE,
    run_id     TEXT    NOT NULL,
    tenant     TEXT    NOT NULL,
    type       TEXT    NOT NULL,
    created_at BIGINT  NOT NULL,
    -- The encoded convene.v1.CloudEvent.
    body       BYTEA   NOT NULL
);
CREATE INDEX outbox_by_run ON outbox (run_id, position);

-- How far each relay (broker publisher) has delivered the outbox.
CREATE TABLE outbox_relays (
    relay      TEXT    NOT NULL PRIMARY KEY,
    position   BIGINT  NOT NULL,
    event_id   TEXT    NOT NULL,
    updated_at BIGINT  NOT NULL
);

-- Every delegation state transition, with the run version it happened at.
CREATE TABLE delegation_ledger (
    run_id               TEXT    NOT NULL REFERENCES runs (run_id),
    delegation_id        TEXT    NOT NULL,
    run_version          BIGINT  NOT NULL,
    state                BIGINT  NOT NULL,
    parent_delegation_id TEXT    NOT NULL,
    profile_id           TEXT    NOT NULL,
    worker_id            TEXT    NOT NULL,
    attempts             BIGINT  NOT NULL,
    recorded_at          BIGINT  NOT NULL,
    PRIMARY KEY (run_id, delegation_id, run_version)
);

-- Every join decision revision of a run.
CREATE TABLE join_decisions (
    run_id      TEXT    NOT NULL REFERENCES runs (run_id),
    revision    BIGINT  NOT NULL,
    run_version BIGINT  NOT NULL,
    outcome     BIGINT  NOT NULL,
    decided_at  BIGINT  NOT NULL,
    -- The encoded convene.v1.JoinDecision.
    body        BYTEA   NOT NULL,
    PRIMARY KEY (run_id, revision)
);
