-- Run labels, for ListRuns filters.
--
-- A run's labels (its spec's) are fixed when it is created and written here in the
-- transaction that stores the run, one row per label; ListRuns keeps a run when each
-- label it asks for has a row with exactly that value. The primary key answers that
-- check for one run; the second index finds the runs of one label value.
CREATE TABLE run_labels (
    run_id TEXT NOT NULL REFERENCES runs (run_id),
    key    TEXT NOT NULL,
    value  TEXT NOT NULL,
    PRIMARY KEY (run_id, key)
);
CREATE INDEX run_labels_by_value ON run_labels (key, value, run_id);
-- The time window of ListRuns needs no index of its own: pages follow `runs_by_tenant`
-- newest first, and the window only skips rows along it. SQLite, which keeps no
-- statistics here, would use an index on (tenant, created_at) for a first page and
-- sort the whole window to cut it.

-- Runs stored before this migration have their labels only inside the encoded run
-- (`runs.body`, protobuf bytes), which SQL cannot read. They are listed here, and the
-- supervisor copies their labels into `run_labels` when it opens the database, taking
-- each run off this list in the same transaction (`SqlRunStore::open`); until then
-- they match no label filter. (So do runs that a supervisor of an earlier version,
-- still running beside upgraded ones, stores after this migration.)
CREATE TABLE run_labels_backfill (
    run_id TEXT NOT NULL PRIMARY KEY
);
INSERT INTO run_labels_backfill (run_id) SELECT run_id FROM runs;
