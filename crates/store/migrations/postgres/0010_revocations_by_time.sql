-- Verifiers fetch the revocations made since their last fetch (GetSigningKeys).
CREATE INDEX revocations_by_time ON revocations (revoked_at);
