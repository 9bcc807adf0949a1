//! Verifying the evidence results cite: the evidence store's `VerifyChain` answers
//! become the join's facts, asked for the staged results together when possible.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use convene_core::join::{self, EvidenceFact};
use convene_mesh::auth::request;
use convene_proto::v1;
use tracing::Instrument as _;

use super::{RunActor, backoff, status_is_transient};
use crate::error::Error;

impl RunActor {
    /// Asks the evidence store about every evidence id the result cites, with the
    /// delegation's own token (so the tenant is the token's).
    pub(super) async fn verify_evidence(&mut self, index: usize, result: &v1::TaskResult) {
        let cited = join::cited_evidence_ids(std::slice::from_ref(result));
        self.verify_cited(index, cited).await;
    }

    /// Asks about the evidence ids `cited` by delegation `index` that are not verified
    /// yet, with the delegation's own token. Unanswered, they count as unknown.
    pub(super) async fn verify_cited(&mut self, index: usize, cited: BTreeSet<String>) {
        let token = self.slots[index].token.clone();
        let unknown: Vec<String> = cited
            .into_iter()
            .filter(|id| !self.facts.contains_key(id))
            .collect();
        if unknown.is_empty() || token.is_empty() {
            return;
        }
        if let Err(e) = self.verify_chain(&token, unknown).await {
            tracing::warn!(run_id = %self.run.run_id, error = %e, "evidence could not be verified; it counts as unknown");
        }
    }

    /// Verifies the evidence cited by the staged results not verified yet, in one call:
    /// a run's delegations share its tenant, so any one of their tokens reads all of it.
    /// If that call fails (that token expired, say), each result is asked about with its
    /// own token, as when results arrive one at a time.
    pub(super) async fn verify_staged(&mut self) {
        let mut staged = self.staging.take_unverified();
        if staged.len() == 1 {
            // One result: asked about as when results come alone.
            let (index, cited) = staged.remove(0);
            let span = self.slots[index].span.clone();
            return self.verify_cited(index, cited).instrument(span).await;
        }
        let Some((token, ids)) = chain_ask(&staged, &self.facts, |index| {
            self.slots[index].token.as_str()
        }) else {
            return;
        };
        let span = self.span.clone();
        let Err(e) = self.verify_chain(&token, ids).instrument(span).await else {
            return;
        };
        tracing::debug!(run_id = %self.run.run_id, error = %e, "verifying the staged results' evidence together failed; asking for each");
        for (index, cited) in staged {
            let span = self.slots[index].span.clone();
            self.verify_cited(index, cited).instrument(span).await;
        }
    }

    /// One `VerifyChain` call (retried while the failure is transient) for `ids`, with
    /// `token`; records what it says of each id in the join's facts.
    pub(super) async fn verify_chain(
        &mut self,
        token: &str,
        ids: Vec<String>,
    ) -> Result<(), Error> {
        let req = v1::VerifyChainRequest {
            claims: vec![v1::ChainClaim {
                claim_id: "cited".to_owned(),
                evidence_refs: ids,
            }],
            // The bytes are read and hashed again: an artifact replaced or corrupted in
            // storage after the worker stored it fails its result (HASH_MISMATCH), not
            // only one whose record is wrong. Results are verified once the join may
            // decide, so this is as late as the join can look.
            rehash_content: true,
        };
        let mut attempt = 1u32;
        let answer = loop {
            match self
                .deps
                .evidence
                .verify_chain(request(req.clone(), token))
                .await
            {
                Ok(r) => break r.into_inner(),
                Err(s) if status_is_transient(s.code()) && attempt < 3 => {
                    tokio::time::sleep(backoff(&self.deps.settings, attempt)).await;
                    attempt += 1;
                }
                Err(s) => return Err(s.into()),
            }
        };
        let kinds: HashMap<&str, &v1::Evidence> = answer
            .evidence
            .iter()
            .map(|e| (e.evidence_id.as_str(), e))
            .collect();
        for link in &answer.links {
            let fact = match v1::LinkStatus::try_from(link.status) {
                Ok(v1::LinkStatus::Ok) => match kinds.get(link.evidence_id.as_str()) {
                    Some(e) => EvidenceFact::Verified {
                        kind: e.kind.clone(),
                        content_hash: e.content_hash.clone(),
                        kind_defaulted: e.kind_defaulted,
                    },
                    None => EvidenceFact::Unknown,
                },
                Ok(v1::LinkStatus::ArtifactMissing) => EvidenceFact::ArtifactMissing,
                Ok(v1::LinkStatus::HashMismatch | v1::LinkStatus::ArtifactCorrupted) => {
                    EvidenceFact::HashMismatch
                }
                _ => EvidenceFact::Unknown,
            };
            self.facts.insert(link.evidence_id.clone(), fact);
        }
        Ok(())
    }
}

/// What one `VerifyChain` call for the `staged` results asks: every evidence id they cite
/// that `known` has no fact for, once each (result by result), and the token of the first
/// staged delegation that has one. None when there is nothing to ask or no token to ask
/// with.
fn chain_ask<'a>(
    staged: &[(usize, BTreeSet<String>)],
    known: &BTreeMap<String, EvidenceFact>,
    token_of: impl Fn(usize) -> &'a str,
) -> Option<(String, Vec<String>)> {
    let mut seen = BTreeSet::new();
    let ids: Vec<String> = staged
        .iter()
        .flat_map(|(_, cited)| cited)
        .filter(|id| !known.contains_key(*id) && seen.insert(*id))
        .cloned()
        .collect();
    let token = staged
        .iter()
        .map(|(index, _)| token_of(*index))
        .find(|t| !t.is_empty())?;
    (!ids.is_empty()).then(|| (token.to_owned(), ids))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cited(ids: &[&str]) -> BTreeSet<String> {
        ids.iter().map(|s| (*s).to_owned()).collect()
    }

    #[test]
    fn results_taken_together_are_verified_in_one_ask() {
        let tokens = ["", "token-b", "token-c"];
        let staged = vec![
            (0, cited(&["ev://logs/1"])),
            (1, cited(&["ev://logs/1", "ev://metrics/2"])),
            (2, cited(&["ev://changes/3", "ev://known/4"])),
        ];
        let known = BTreeMap::from([("ev://known/4".to_owned(), EvidenceFact::Unknown)]);
        let (token, ids) = chain_ask(&staged, &known, |i| tokens[i]).expect("an ask");
        // The first delegation without a token is passed over; the run's tenant is the
        // same whichever of its tokens asks.
        assert_eq!(token, "token-b");
        // Every id once, none already known.
        assert_eq!(ids, ["ev://logs/1", "ev://metrics/2", "ev://changes/3"]);
    }

    #[test]
    fn nothing_is_asked_without_new_ids_or_a_token() {
        let known = BTreeMap::from([("ev://a".to_owned(), EvidenceFact::ArtifactMissing)]);
        let staged = vec![(0, cited(&["ev://a"])), (1, cited(&[]))];
        assert_eq!(chain_ask(&staged, &known, |_| "token"), None);
        let staged = vec![(0, cited(&["ev://b"]))];
        assert_eq!(chain_ask(&staged, &known, |_| ""), None);
        assert_eq!(chain_ask(&[], &known, |_| "token"), None);
    }
}
