-- The evidence store's catalog: artifact metadata and evidence records, keyed by
-- tenant. Artifact bytes live in the object store, not here. Times are microseconds
-- since the Unix epoch.

-- The first writer's metadata of each artifact; never replaced.
CREATE TABLE artifacts (
    tenant                TEXT    NOT NULL,
    sha256                TEXT    NOT NULL,
    media_type            TEXT    NOT NULL,
    size                  BIGINT  NOT NULL,
    created_by_delegation TEXT    NOT NULL,
    created_by_tool_call  TEXT    NOT NULL,
    created_at            BIGINT  NOT NULL,
    PRIMARY KEY (tenant, sha256)
);

-- Evidence records; immutable once written.
CREATE TABLE evidence (
    tenant         TEXT    NOT NULL,
    evidence_id    TEXT    NOT NULL,
    kind           TEXT    NOT NULL,
    artifact_uri   TEXT    NOT NULL,
    content_hash   TEXT    NOT NULL,
    -- The encoded convene.v1.Evidence.
    body           BYTEA   NOT NULL,
    PRIMARY KEY (tenant, evidence_id)
);
