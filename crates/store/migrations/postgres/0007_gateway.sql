-- The A2A gateway's tasks: each is the run it started, and belongs to the principal
-- that started it (nobody else can see it). Gateway replicas share this table.
CREATE TABLE a2a_tasks (
    task_id    TEXT    NOT NULL PRIMARY KEY,
    context_id TEXT    NOT NULL,
    tenant     TEXT    NOT NULL,
    principal  TEXT    NOT NULL,
    run_id     TEXT    NOT NULL,
    skill      TEXT    NOT NULL,
    created_at BIGINT NOT NULL
);
-- A message sent again (same message id: the run's idempotency key) finds its task.
CREATE UNIQUE INDEX a2a_tasks_run ON a2a_tasks (principal, run_id);
CREATE INDEX a2a_tasks_listed ON a2a_tasks (principal, created_at, task_id);
