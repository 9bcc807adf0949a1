-- Lease epochs. A run's epoch is 1 under the replica that created it and one more at
-- each claim; `claimed_from` is the owner whose expired lease the last claim took over
-- (NULL when the lease was free).
ALTER TABLE runs ADD COLUMN lease_epoch BIGINT NOT NULL DEFAULT 0;
ALTER TABLE runs ADD COLUMN claimed_from TEXT;

-- The policy service's lease fences: a token of the run whose lease epoch is below
-- `epoch` is refused, and none is issued for such an epoch again.
CREATE TABLE lease_fences (
    run_id    TEXT   NOT NULL PRIMARY KEY,
    epoch     BIGINT NOT NULL,
    fenced_at BIGINT NOT NULL
);
-- Verifiers fetch the fences set since their last fetch (GetSigningKeys).
CREATE INDEX lease_fences_by_time ON lease_fences (fenced_at);
