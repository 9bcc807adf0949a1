-- Lease epochs and who wrote what. A run's epoch is 1 under the replica that created it
-- and one more at each claim by a replica that did not hold it; `claimed_from` is the
-- owner whose lease the last claim took over (NULL when the lease was free).
ALTER TABLE runs ADD COLUMN lease_epoch BIGINT NOT NULL DEFAULT 0;
ALTER TABLE runs ADD COLUMN claimed_from TEXT;

-- The supervisor replica that wrote each run event, outbox event and ledger row (NULL
-- when the supervisor leases no runs, and for events imported from the approval service).
ALTER TABLE run_events ADD COLUMN replica TEXT;
ALTER TABLE outbox ADD COLUMN replica TEXT;
ALTER TABLE delegation_ledger ADD COLUMN replica TEXT;

-- The policy service's lease fences: a token of the run whose lease epoch is below
-- `epoch` is refused, and none is issued for such an epoch again.
CREATE TABLE lease_fences (
    run_id    TEXT   NOT NULL PRIMARY KEY,
    epoch     BIGINT NOT NULL,
    fenced_at BIGINT NOT NULL
);
-- Verifiers fetch the fences set since their last fetch (GetSigningKeys).
CREATE INDEX lease_fences_by_time ON lease_fences (fenced_at);
