-- Waiting runs and commands for runs.
--
-- A run that waits for people (WAITING_APPROVAL, WAITING_INPUT) is at rest like a
-- finished one (`terminal`), and `waiting`: no replica claims it until a command for
-- it is pending.
ALTER TABLE runs ADD COLUMN waiting BOOLEAN NOT NULL DEFAULT FALSE;
UPDATE runs SET waiting = TRUE WHERE state IN (5, 6);

-- Commands for a run (cancel, resume, an approval it waits for was settled), stored by
-- whichever replica received them and applied by the replica that owns the run, in
-- the commit that carries their effect.
CREATE TABLE run_commands (
    command_id      TEXT    NOT NULL PRIMARY KEY,
    run_id          TEXT    NOT NULL,
    created_at      INTEGER  NOT NULL,
    -- The encoded command.
    body            BLOB    NOT NULL,
    done            BOOLEAN NOT NULL DEFAULT FALSE,
    done_at         INTEGER,
    -- What applying it did: a gRPC status code (0: applied) and its message.
    outcome_code    INTEGER,
    outcome_message TEXT
);
CREATE INDEX run_commands_pending ON run_commands (run_id, created_at) WHERE NOT done;

-- Where each supervisor replica can be reached, for the calls another replica forwards
-- to the owner of a run (a worker's Delegate for a run the receiving replica does not
-- run).
CREATE TABLE supervisor_replicas (
    replica    TEXT    NOT NULL PRIMARY KEY,
    endpoint   TEXT    NOT NULL,
    updated_at INTEGER  NOT NULL
);
