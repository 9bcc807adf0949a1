//! Which accepted results are independent findings: results whose claims rest on the
//! same artifacts count once toward the join's minimum, and the shared artifacts are
//! flagged in the decision.

use std::collections::{BTreeMap, BTreeSet};

use convene_proto::v1;

use super::{Evaluation, EvidenceFact};

/// Which accepted results are independent of each other (see `Evaluation::independence`, below).
#[derive(Debug, Default)]
pub(super) struct Independence {
    /// Artifacts several accepted results cite.
    pub(super) shared: Vec<v1::SharedEvidence>,
    /// Labels of results not counted, each with the labels of the counted results whose
    /// artifacts it rests on.
    pub(super) not_independent: Vec<(String, Vec<String>)>,
    /// Their delegation ids.
    pub(super) dependent_ids: Vec<String>,
}

impl Evaluation<'_> {
    /// Which accepted results rest on the same artifacts: results whose claims cite the
    /// same set of artifacts (by verified content hash) count once, as the one of them
    /// with the highest weight (the first in plan order among equals). A result citing no
    /// verified evidence counts on its own. Grouping by equal sets keeps the minimum
    /// monotone: removing a result never raises the count or the weight.
    pub(super) fn independence(&self) -> Independence {
        // content hash -> (delegation ids, evidence ids), both in plan order
        let mut cited: BTreeMap<&str, (Vec<String>, Vec<String>)> = BTreeMap::new();
        // support set -> its results (label, delegation id, weight), in plan order
        let mut groups: BTreeMap<BTreeSet<&str>, Vec<(&str, &str, f64)>> = BTreeMap::new();
        for (j, result) in self.accepted() {
            let mut support: BTreeSet<&str> = BTreeSet::new();
            for id in result.claims.iter().flat_map(|c| &c.evidence_refs) {
                if let Some(EvidenceFact::Verified { content_hash, .. }) =
                    self.input.evidence.get(id)
                {
                    support.insert(content_hash.as_str());
                    let entry = cited.entry(content_hash.as_str()).or_default();
                    let delegation = &j.delegation.delegation_id;
                    if !entry.0.contains(delegation) {
                        entry.0.push(delegation.clone());
                    }
                    if !entry.1.contains(id) {
                        entry.1.push(id.clone());
                    }
                }
            }
            if !support.is_empty() {
                groups.entry(support).or_default().push((
                    j.delegation.label(),
                    j.delegation.delegation_id.as_str(),
                    j.weight,
                ));
            }
        }
        let mut out = Independence::default();
        let mut dependent: Vec<(&str, &str, &str)> = Vec::new();
        for members in groups.values().filter(|m| m.len() > 1) {
            let kept = members
                .iter()
                .enumerate()
                .max_by(|(ia, a), (ib, b)| a.2.total_cmp(&b.2).then(ib.cmp(ia)))
                .map_or(0, |(i, _)| i);
            for (i, (label, id, _)) in members.iter().enumerate() {
                if i != kept {
                    dependent.push((label, id, members[kept].0));
                }
            }
        }
        // In plan order, as the reasons are.
        let order: Vec<&str> = self
            .accepted()
            .map(|(j, _)| j.delegation.delegation_id.as_str())
            .collect();
        dependent.sort_by_key(|(_, id, _)| order.iter().position(|o| o == id));
        for (label, id, kept) in dependent {
            out.not_independent
                .push((label.to_owned(), vec![kept.to_owned()]));
            out.dependent_ids.push(id.to_owned());
        }
        out.shared = cited
            .into_iter()
            .filter(|(_, (delegations, _))| delegations.len() > 1)
            .map(
                |(hash, (delegation_ids, evidence_ids))| v1::SharedEvidence {
                    content_hash: hash.to_owned(),
                    delegation_ids,
                    evidence_ids,
                },
            )
            .collect();
        out
    }
}
