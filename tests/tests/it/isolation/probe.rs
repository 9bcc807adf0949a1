//! The probes of one tenant into the other's objects: each call that takes an id, with
//! the other tenant's ids and with ids nobody has; listings, pages and streams; what
//! the caller receives, scanned for anything of the other tenant.

use std::collections::BTreeSet;

use convene_mesh::auth::request;
use convene_proto::v1::{
    self, evidence_store_server::EvidenceStore as _, resume_run_request::Input,
};
use futures::StreamExt as _;
use tonic::{Code, Status};

use super::calls::{
    approval_stream, cancel_approval, cancel_run, decide, execute, get_approval, list_approvals,
    list_runs, outbox, record, record_evidence, resume,
};
use super::{Findings, Made, REQUESTED, Rng, STARTED, Tenant, made_up, scrub};
use crate::harness::TestMesh;

/// The subject's approval id of an approval event (`approvals/<id>`).
fn approval_of(e: &v1::CloudEvent) -> &str {
    e.subject.trim_start_matches("approvals/")
}

/// A call that names a run.
#[derive(Debug, Clone, Copy)]
enum RunCall {
    Get,
    Watch,
    Cancel,
    Close,
    Settle,
}

impl RunCall {
    const ALL: [Self; 5] = [
        Self::Get,
        Self::Watch,
        Self::Cancel,
        Self::Close,
        Self::Settle,
    ];

    fn name(self) -> &'static str {
        match self {
            Self::Get => "GetRun",
            Self::Watch => "WatchRun",
            Self::Cancel => "CancelRun",
            Self::Close => "ResumeRun (close)",
            Self::Settle => "ResumeRun (settle)",
        }
    }
}

/// A call that names an approval request, and who makes it.
#[derive(Debug, Clone, Copy)]
enum ApprovalCall {
    Get,
    Approve,
    Reject,
    Execute,
    Cancel,
}

impl ApprovalCall {
    const ALL: [Self; 5] = [
        Self::Get,
        Self::Approve,
        Self::Reject,
        Self::Execute,
        Self::Cancel,
    ];

    fn name(self) -> &'static str {
        match self {
            Self::Get => "GetApproval",
            Self::Approve => "Decide (approve)",
            Self::Reject => "Decide (reject)",
            Self::Execute => "Execute",
            Self::Cancel => "CancelApproval",
        }
    }
}

/// What of the other tenant's a resume of the caller's own waiting run names.
#[derive(Debug, Clone, Copy)]
enum Named {
    /// A delegation, chosen as a side of the conflict.
    Delegation,
    /// Evidence, cited for the choice.
    Evidence,
    /// A ticket, presented for the wait.
    Ticket,
}

impl Named {
    const ALL: [Self; 3] = [Self::Delegation, Self::Evidence, Self::Ticket];

    fn what(self) -> &'static str {
        match self {
            Self::Delegation => "ResumeRun choosing the other tenant's delegation",
            Self::Evidence => "ResumeRun citing the other tenant's evidence",
            Self::Ticket => "ResumeRun under the other tenant's ticket",
        }
    }
}

/// One tenant probing the other's objects.
pub(super) struct View<'a> {
    mesh: &'a TestMesh,
    me: Tenant,
    /// A task token of `me` that may read and store evidence.
    token: &'a str,
    mine: &'a Made,
    other: &'a Made,
    /// What must never reach `me`: the other tenant's ids, people and name.
    foreign: Vec<String>,
}

impl<'a> View<'a> {
    pub(super) fn new(
        mesh: &'a TestMesh,
        me: Tenant,
        them: Tenant,
        token: &'a str,
        mine: &'a Made,
        other: &'a Made,
    ) -> Self {
        let own = mine.ids();
        let mut foreign: Vec<String> = other
            .ids()
            .into_iter()
            .filter(|id| !own.contains(id))
            .map(str::to_owned)
            .collect();
        foreign.extend([them.name, them.oncall, them.alice, them.bob].map(str::to_owned));
        Self {
            mesh,
            me,
            token,
            mine,
            other,
            foreign,
        }
    }

    pub(super) async fn all(&self, rng: &mut Rng, f: &mut Findings) {
        self.runs(rng, f).await;
        self.own_runs(rng, f).await;
        self.approvals(rng, f).await;
        self.evidence(rng, f).await;
        self.artifacts(rng, f).await;
        self.events(rng, f).await;
        self.lists(rng, f).await;
    }

    /// Records whatever of the other tenant `text`, something `me` received, names
    /// (the other tenant's ids `me`'s own objects carry aside).
    fn scan(&self, f: &mut Findings, what: &str, text: &str) {
        let text = scrub(text, self.mine.borrowed.iter().map(String::as_str));
        let named: Vec<&String> = self
            .foreign
            .iter()
            .filter(|id| text.contains(id.as_str()))
            .collect();
        f.check(
            named.is_empty(),
            &format!("{what} names nothing of the other tenant"),
            || {
                let at = text.find(named[0].as_str()).unwrap_or(0);
                let from = text.floor_char_boundary(at.saturating_sub(200));
                let to = text.ceil_char_boundary((at + 200).min(text.len()));
                format!("{named:?} in …{}…", &text[from..to])
            },
        );
    }

    /// Checks that a call with the other tenant's ids (`theirs`) answered as the same
    /// call with ids nobody has (`none`): the same refusal, word for word once the ids
    /// are replaced by a placeholder, with `code` if given, never PERMISSION_DENIED.
    fn same_refusal(
        &self,
        f: &mut Findings,
        what: &str,
        code: Option<Code>,
        theirs: (&[&str], Result<String, Status>),
        none: (&[&str], Result<String, Status>),
    ) {
        let ((ids, theirs), (nones, none)) = (theirs, none);
        match (theirs, none) {
            (Ok(answer), _) => f.add(
                format!("{what} answers the other tenant's id"),
                format!("{ids:?}: {answer}"),
            ),
            (Err(_), Ok(answer)) => f.add(
                format!("{what} answers an id nobody has"),
                format!("{nones:?}: {answer}"),
            ),
            (Err(a), Err(b)) => {
                let (ma, mb) = (
                    scrub(a.message(), ids.iter().copied()),
                    scrub(b.message(), nones.iter().copied()),
                );
                self.scan(f, what, &ma);
                f.check(
                    a.code() != Code::PermissionDenied,
                    &format!("{what} is not PERMISSION_DENIED for the other tenant's id"),
                    || format!("{ids:?}: {a:?}"),
                );
                if let Some(code) = code {
                    f.check(
                        a.code() == code,
                        &format!("{what} is {code:?} for the other tenant's id"),
                        || format!("{ids:?}: {a:?}"),
                    );
                }
                f.check(
                    a.code() == b.code() && ma == mb,
                    &format!("{what} answers the other tenant's id as one nobody has"),
                    || format!("{:?} {ma:?} vs {:?} {mb:?}", a.code(), b.code()),
                );
            }
        }
    }

    fn credential(&self, who: &str) -> String {
        self.mesh.credential(who)
    }

    async fn run_call(
        &self,
        call: RunCall,
        run_id: &str,
        ticket: Option<v1::RunTicket>,
        delegation: &str,
        evidence: &[String],
    ) -> Result<String, Status> {
        let supervisor = self.mesh.supervisor();
        let cred = self.credential(self.me.oncall);
        let run_id = run_id.to_owned();
        match call {
            RunCall::Get => supervisor
                .get_run(request(v1::GetRunRequest { run_id }, &cred))
                .await
                .map(|r| format!("{r:?}")),
            RunCall::Watch => {
                let stream = supervisor
                    .watch_run(request(
                        v1::WatchRunRequest {
                            run_id,
                            after_sequence: 0,
                        },
                        &cred,
                    ))
                    .await?;
                Ok(format!(
                    "{:?}",
                    stream.into_inner().collect::<Vec<_>>().await
                ))
            }
            RunCall::Cancel => cancel_run(self.mesh, self.me.oncall, &run_id)
                .await
                .map(|r| format!("{r:?}")),
            RunCall::Close => resume(
                self.mesh,
                self.me.oncall,
                &run_id,
                ticket,
                Input::Close(v1::CloseRun {}),
            )
            .await
            .map(|r| format!("{r:?}")),
            RunCall::Settle => {
                let settle = v1::SettleConflict {
                    topic: "primary_cause".to_owned(),
                    delegation_id: delegation.to_owned(),
                    evidence_ids: evidence.to_vec(),
                };
                resume(
                    self.mesh,
                    self.me.oncall,
                    &run_id,
                    ticket,
                    Input::Settle(settle),
                )
                .await
                .map(|r| format!("{r:?}"))
            }
        }
    }

    /// Every call naming a run, with the other tenant's runs; the filters naming them.
    async fn runs(&self, rng: &mut Rng, f: &mut Findings) {
        let delegations: Vec<&String> = self.other.delegations.iter().collect();
        let evidence: Vec<String> = self.other.evidence.iter().take(2).cloned().collect();
        for run_id in self.other.runs.keys() {
            let none = made_up(rng, run_id);
            let ticket = self.other.tickets.get(run_id).cloned();
            let delegation = rng.pick(&delegations).map_or("", |d| d.as_str());
            for call in RunCall::ALL {
                let theirs = self
                    .run_call(call, run_id, ticket.clone(), delegation, &evidence)
                    .await;
                let nobody = self
                    .run_call(call, &none, ticket.clone(), delegation, &evidence)
                    .await;
                let what = call.name();
                self.same_refusal(
                    f,
                    what,
                    Some(Code::NotFound),
                    (&[run_id], theirs),
                    (&[&none], nobody),
                );
            }
            // What names the run: only `me`'s own requests that name it.
            for (id, named) in [(run_id.as_str(), true), (none.as_str(), false)] {
                let expect: BTreeSet<&str> = self
                    .mine
                    .approvals
                    .iter()
                    .filter(|(_, r)| named && r.as_str() == id)
                    .map(|(a, _)| a.as_str())
                    .collect();
                let ((listed, _), seen) = list_approvals(self.mesh, self.me.oncall, 50, id).await;
                self.scan(f, "ListApprovals of a run", &seen);
                f.check(
                    listed.iter().map(String::as_str).collect::<BTreeSet<_>>() == expect,
                    "ListApprovals of the other tenant's run lists only the caller's requests naming it",
                    || format!("{id}: {listed:?}, expected {expect:?}"),
                );
                let events = approval_stream(self.mesh, self.me.oncall, "", id).await;
                let ok = events.as_ref().is_ok_and(|events| {
                    events.iter().all(|e| expect.contains(approval_of(e)))
                        && expect.iter().all(|a| {
                            events
                                .iter()
                                .any(|e| approval_of(e) == *a && e.r#type == REQUESTED)
                        })
                });
                f.check(
                    ok,
                    "Approval.WatchEvents of the other tenant's run streams only the caller's requests naming it",
                    || format!("{id}: {events:?}, expected {expect:?}"),
                );
                self.scan(f, "Approval.WatchEvents of a run", &format!("{events:?}"));
                let events = outbox(self.mesh, self.me.oncall, "", id).await;
                let ok = events.as_ref().is_ok_and(|events| {
                    events.iter().all(|e| {
                        e.tenant_id == self.me.name
                            && e.correlation_id == id
                            && expect.contains(approval_of(e))
                    })
                });
                f.check(
                    ok,
                    "WatchEvents of the other tenant's run streams only the caller's events",
                    || format!("{id}: {events:?}"),
                );
                self.scan(f, "WatchEvents of a run", &format!("{events:?}"));
            }
            // A page that resumes after the run: the caller's runs that sort below it.
            let expect: Vec<String> = self
                .mine
                .runs
                .keys()
                .rev()
                .filter(|r| r.as_str() < run_id.as_str())
                .cloned()
                .collect();
            let ((listed, _), seen) = list_runs(self.mesh, self.me.oncall, 500, &[], run_id).await;
            self.scan(f, "ListRuns after the other tenant's run", &seen);
            f.check(
                listed == expect,
                "ListRuns after the other tenant's run id lists the caller's runs below it",
                || format!("{run_id}: {listed:?}, expected {expect:?}"),
            );
        }
    }

    /// `me`'s own waiting runs, resumed with the other tenant's delegation, evidence and
    /// ticket ids: refused as ids nobody has are.
    async fn own_runs(&self, rng: &mut Rng, f: &mut Findings) {
        let delegations: Vec<&String> = self.other.delegations.iter().collect();
        let evidence: Vec<&String> = self
            .other
            .evidence
            .difference(&self.mine.evidence)
            .collect();
        let tickets: Vec<&String> = self.other.ticket_ids.iter().collect();
        let settle = |delegation: &str, evidence: Option<&str>| {
            Input::Settle(v1::SettleConflict {
                topic: "primary_cause".to_owned(),
                delegation_id: delegation.to_owned(),
                evidence_ids: evidence.into_iter().map(str::to_owned).collect(),
            })
        };
        for (run_id, side) in &self.mine.sides {
            let Some(ticket) = self.mine.tickets.get(run_id) else {
                continue;
            };
            for named in Named::ALL {
                let pool = match named {
                    Named::Delegation => &delegations,
                    Named::Evidence => &evidence,
                    Named::Ticket => &tickets,
                };
                let Some(id) = rng.pick(pool).map(|id| id.as_str()) else {
                    continue;
                };
                let none = made_up(rng, id);
                let ask = async |id: &str| {
                    let (ticket, input) = match named {
                        Named::Delegation => (ticket.clone(), settle(id, None)),
                        Named::Evidence => (ticket.clone(), settle(side, Some(id))),
                        Named::Ticket => (
                            v1::RunTicket {
                                id: id.to_owned(),
                                ..ticket.clone()
                            },
                            Input::Close(v1::CloseRun {}),
                        ),
                    };
                    resume(self.mesh, self.me.oncall, run_id, Some(ticket), input)
                        .await
                        .map(|r| format!("{r:?}"))
                };
                let (theirs, nobody) = (ask(id).await, ask(&none).await);
                self.same_refusal(f, named.what(), None, (&[id], theirs), (&[&none], nobody));
            }
        }
    }

    async fn approval_call(
        &self,
        call: ApprovalCall,
        id: &str,
        hash: &str,
    ) -> Result<String, Status> {
        let (mesh, me) = (self.mesh, self.me);
        match call {
            ApprovalCall::Get => get_approval(mesh, me.oncall, id)
                .await
                .map(|a| format!("{a:?}")),
            ApprovalCall::Approve => decide(mesh, me.alice, id, hash, v1::VoteDecision::Approve)
                .await
                .map(|a| format!("{a:?}")),
            ApprovalCall::Reject => decide(mesh, me.bob, id, hash, v1::VoteDecision::Reject)
                .await
                .map(|a| format!("{a:?}")),
            ApprovalCall::Execute => execute(mesh, me.alice, id, hash)
                .await
                .map(|a| format!("{a:?}")),
            ApprovalCall::Cancel => cancel_approval(mesh, me.oncall, id)
                .await
                .map(|a| format!("{a:?}")),
        }
    }

    /// Every call naming a request, with the other tenant's requests.
    async fn approvals(&self, rng: &mut Rng, f: &mut Findings) {
        for id in self.other.approvals.keys() {
            let none = made_up(rng, id);
            let hash = format!("sha256:{}", rng.hex(64));
            for call in ApprovalCall::ALL {
                let theirs = self.approval_call(call, id, &hash).await;
                let nobody = self.approval_call(call, &none, &hash).await;
                self.same_refusal(
                    f,
                    call.name(),
                    Some(Code::NotFound),
                    (&[id], theirs),
                    (&[&none], nobody),
                );
            }
        }
    }

    /// Who reads evidence: `me`'s on-call engineer, and a task token of `me`.
    fn readers(&self) -> [(&'static str, String); 2] {
        [
            ("a principal", self.credential(self.me.oncall)),
            ("a task token", self.token.to_owned()),
        ]
    }

    /// GetEvidence and VerifyChain with the other tenant's evidence ids: answered as ids
    /// nobody has, both by a principal and by a task token.
    async fn evidence(&self, rng: &mut Rng, f: &mut Findings) {
        let theirs: Vec<String> = self
            .other
            .evidence
            .difference(&self.mine.evidence)
            .cloned()
            .collect();
        if theirs.is_empty() {
            return;
        }
        let nobody: Vec<String> = theirs.iter().map(|id| made_up(rng, id)).collect();
        let store = self.mesh.evidence();
        for (who, cred) in self.readers() {
            let get = async |ids: &[String]| {
                store
                    .get_evidence(request(
                        v1::GetEvidenceRequest {
                            evidence_ids: ids.to_vec(),
                        },
                        &cred,
                    ))
                    .await
                    .map(tonic::Response::into_inner)
            };
            let (a, b) = (get(&theirs).await, get(&nobody).await);
            let what = format!("GetEvidence as {who}");
            self.scan(
                f,
                &what,
                &scrub(&format!("{a:?}"), theirs.iter().map(String::as_str)),
            );
            f.check(
                matches!((&a, &b), (Ok(a), Ok(b)) if a.evidence.is_empty() && a.missing == theirs && b.missing == nobody),
                &format!("{what} finds none of the other tenant's evidence, as for ids nobody has"),
                || format!("{a:?} vs {b:?}"),
            );
            let verify = async |ids: &[String]| {
                let claims = ids
                    .iter()
                    .enumerate()
                    .map(|(i, id)| v1::ChainClaim {
                        claim_id: format!("claim-{i}"),
                        evidence_refs: vec![id.clone()],
                    })
                    .collect();
                store
                    .verify_chain(request(
                        v1::VerifyChainRequest {
                            claims,
                            rehash_content: true,
                        },
                        &cred,
                    ))
                    .await
                    .map(tonic::Response::into_inner)
            };
            let (a, b) = (verify(&theirs).await, verify(&nobody).await);
            let what = format!("VerifyChain as {who}");
            self.scan(
                f,
                &what,
                &scrub(&format!("{a:?}"), theirs.iter().map(String::as_str)),
            );
            let same = |a: &v1::VerifyChainResponse, b: &v1::VerifyChainResponse| {
                !a.intact
                    && a.evidence.is_empty()
                    && a.links.len() == theirs.len()
                    && b.links.len() == nobody.len()
                    && a.links
                        .iter()
                        .zip(&b.links)
                        .zip(theirs.iter().zip(&nobody))
                        .all(|((la, lb), (ta, tb))| {
                            la.status == v1::LinkStatus::EvidenceUnknown as i32
                                && la.status == lb.status
                                && la.artifact_uri.is_empty()
                                && scrub(&la.detail, [ta.as_str()])
                                    == scrub(&lb.detail, [tb.as_str()])
                        })
            };
            f.check(
                matches!((&a, &b), (Ok(a), Ok(b)) if same(a, b)),
                &format!("{what} knows none of the other tenant's evidence, as for ids nobody has"),
                || format!("{a:?} vs {b:?}"),
            );
        }
    }

    /// GetArtifact with the other tenant's artifact URIs (by a principal and by a task
    /// token), and RecordEvidence citing them: answered as URIs nobody has.
    async fn artifacts(&self, rng: &mut Rng, f: &mut Findings) {
        let store = self.mesh.evidence();
        for uri in self.other.artifacts.difference(&self.mine.artifacts) {
            let sha = uri.rsplit('/').next().unwrap_or_default();
            let own = format!("artifact://{}/{sha}", self.me.name);
            let mut nobody = vec![
                made_up(rng, uri),
                format!("artifact://{}/{}", self.me.name, rng.hex(64)),
            ];
            if !self.mine.artifacts.contains(&own) {
                nobody.push(own);
            }
            for (who, cred) in self.readers() {
                let get = async |uri: &str| {
                    store
                        .get_artifact(request(
                            v1::GetArtifactRequest {
                                uri: uri.to_owned(),
                            },
                            &cred,
                        ))
                        .await
                        .map(|r| format!("{:?}", r.into_inner().artifact))
                };
                let theirs = get(uri).await;
                for none in &nobody {
                    let none_sha = none.rsplit('/').next().unwrap_or_default();
                    let answer = get(none).await;
                    self.same_refusal(
                        f,
                        &format!("GetArtifact as {who}"),
                        Some(Code::NotFound),
                        (&[uri, sha], theirs.clone()),
                        (&[none, none_sha], answer),
                    );
                }
            }
            let none = &nobody[1];
            let none_sha = none.rsplit('/').next().unwrap_or_default();
            let (id, none_id) = (
                format!("logs://isolation/{}/{}", rng.uuid(), rng.hex(16)),
                format!("logs://isolation/{}/{}", rng.uuid(), rng.hex(16)),
            );
            let theirs = record_evidence(
                self.mesh,
                self.token,
                record(&id, uri, &format!("sha256:{sha}")),
            )
            .await
            .map(|e| format!("{e:?}"));
            let answer = record_evidence(
                self.mesh,
                self.token,
                record(&none_id, none, &format!("sha256:{none_sha}")),
            )
            .await
            .map(|e| format!("{e:?}"));
            self.same_refusal(
                f,
                "RecordEvidence citing an artifact",
                None,
                (&[uri, sha, &id], theirs),
                (&[none, none_sha, &none_id], answer),
            );
        }
    }

    /// Event streams resumed after the other tenant's event ids.
    async fn events(&self, rng: &mut Rng, f: &mut Findings) {
        let (mesh, who) = (self.mesh, self.me.oncall);
        let theirs: Vec<&String> = self.other.events.difference(&self.mine.events).collect();
        let mut resumed = Vec::new();
        for _ in 0..4 {
            let Some(id) = rng.pick(&theirs) else { break };
            let none = made_up(rng, id);
            for after in [id.to_string(), none] {
                match outbox(mesh, who, &after, "").await {
                    Ok(events) => resumed.push((after, events)),
                    Err(s) => f.add(
                        "WatchEvents resumes after any event id".to_owned(),
                        format!("{after}: {s:?}"),
                    ),
                }
            }
        }
        // What a resumed stream shows is a stretch of what the caller's whole stream
        // shows (read after it, so it may have grown since).
        let full: Vec<String> = outbox(mesh, who, "", "")
            .await
            .expect("WatchEvents")
            .into_iter()
            .map(|e| e.id)
            .collect();
        for (after, events) in resumed {
            let ids: Vec<String> = events.iter().map(|e| e.id.clone()).collect();
            self.scan(f, "WatchEvents after an event id", &format!("{events:?}"));
            f.check(
                ids.is_empty() || full.windows(ids.len()).any(|w| w == ids.as_slice()),
                "WatchEvents after the other tenant's event id streams a stretch of the caller's own",
                || format!("after {after}: {ids:?} not in {full:?}"),
            );
        }
        let theirs: Vec<&String> = self
            .other
            .approval_events
            .difference(&self.mine.approval_events)
            .collect();
        for _ in 0..4 {
            let Some(id) = rng.pick(&theirs) else { break };
            let none = made_up(rng, id);
            let stream = async |after: &str| {
                approval_stream(mesh, who, after, "")
                    .await
                    .map(|events| format!("{events:?}"))
            };
            let (a, b) = (stream(id).await, stream(&none).await);
            self.same_refusal(
                f,
                "Approval.WatchEvents after an event id",
                None,
                (&[id], a),
                (&[&none], b),
            );
        }
    }

    /// Listings, pages and streams: exactly the caller's own objects; and the caller's
    /// own evidence and artifacts are found, so the refusals above are not blanket ones.
    async fn lists(&self, rng: &mut Rng, f: &mut Findings) {
        let (mesh, who, mine) = (self.mesh, self.me.oncall, self.mine);
        let expect: Vec<String> = mine.runs.keys().rev().cloned().collect();
        let n = u32::try_from(expect.len()).expect("a few runs");
        for size in [500, n, 1 + rng.below(3) as u32] {
            let ((ids, pages), seen) = list_runs(mesh, who, size, &[], "").await;
            self.scan(f, "ListRuns", &seen);
            f.check(
                ids == expect && pages == n.div_ceil(size).max(1),
                "ListRuns pages show exactly the caller's runs",
                || format!("pages of {size}: {pages} pages, {ids:?}, expected {expect:?}"),
            );
        }
        for state in mine.runs.values().collect::<BTreeSet<_>>() {
            let expect: Vec<&String> = mine
                .runs
                .iter()
                .rev()
                .filter(|(_, s)| *s == state)
                .map(|(id, _)| id)
                .collect();
            let ((ids, _), seen) = list_runs(mesh, who, 500, &[*state], "").await;
            self.scan(f, "ListRuns by state", &seen);
            f.check(
                ids.iter().collect::<Vec<_>>() == expect,
                "ListRuns by state shows exactly the caller's runs in it",
                || format!("state {state}: {ids:?}, expected {expect:?}"),
            );
        }
        let expect: BTreeSet<&str> = mine.approvals.keys().map(String::as_str).collect();
        let n = u32::try_from(expect.len()).expect("a few requests");
        for size in [500, 1 + rng.below(3) as u32] {
            let ((ids, pages), seen) = list_approvals(mesh, who, size, "").await;
            self.scan(f, "ListApprovals", &seen);
            let set: BTreeSet<&str> = ids.iter().map(String::as_str).collect();
            f.check(
                set == expect && set.len() == ids.len() && pages == n.div_ceil(size).max(1),
                "ListApprovals pages show exactly the caller's requests",
                || format!("pages of {size}: {pages} pages, {ids:?}, expected {expect:?}"),
            );
        }
        let events = outbox(mesh, who, "", "").await.expect("WatchEvents");
        self.scan(f, "WatchEvents", &format!("{events:?}"));
        let named: BTreeSet<&str> = mine
            .runs
            .keys()
            .chain(mine.approvals.values())
            .map(String::as_str)
            .chain([""])
            .collect();
        let strays: Vec<&v1::CloudEvent> = events
            .iter()
            .filter(|e| e.tenant_id != self.me.name || !named.contains(e.correlation_id.as_str()))
            .collect();
        let unstarted: Vec<&String> = mine
            .runs
            .keys()
            .filter(|r| {
                !events
                    .iter()
                    .any(|e| e.r#type == STARTED && &e.correlation_id == *r)
            })
            .collect();
        f.check(
            strays.is_empty() && unstarted.is_empty(),
            "WatchEvents streams exactly the caller's events",
            || format!("not the caller's: {strays:?}; runs without run.started: {unstarted:?}"),
        );
        let events = approval_stream(mesh, who, "", "")
            .await
            .expect("Approval.WatchEvents");
        self.scan(f, "Approval.WatchEvents", &format!("{events:?}"));
        let strays: Vec<&v1::CloudEvent> = events
            .iter()
            .filter(|e| e.tenant_id != self.me.name || !mine.approvals.contains_key(approval_of(e)))
            .collect();
        let unrequested: Vec<&String> = mine
            .approvals
            .keys()
            .filter(|a| {
                !events
                    .iter()
                    .any(|e| e.r#type == REQUESTED && approval_of(e) == a.as_str())
            })
            .collect();
        f.check(
            strays.is_empty() && unrequested.is_empty(),
            "Approval.WatchEvents streams exactly the caller's events",
            || format!("not the caller's: {strays:?}; requests without an event: {unrequested:?}"),
        );
        // The caller's own evidence and artifacts, as each reader.
        let own: Vec<String> = mine.evidence.iter().cloned().collect();
        let store = mesh.evidence();
        for (reader, cred) in self.readers() {
            let found = store
                .get_evidence(request(
                    v1::GetEvidenceRequest {
                        evidence_ids: own.clone(),
                    },
                    &cred,
                ))
                .await
                .map(tonic::Response::into_inner);
            self.scan(f, "GetEvidence", &format!("{found:?}"));
            f.check(
                found.as_ref().is_ok_and(|r| {
                    r.missing.is_empty()
                        && r.evidence.len() == own.len()
                        && r.evidence.iter().all(|e| e.tenant == self.me.name)
                }),
                "GetEvidence finds the caller's own evidence",
                || format!("as {reader}: {found:?}"),
            );
            for uri in &mine.artifacts {
                let got = store
                    .get_artifact(request(v1::GetArtifactRequest { uri: uri.clone() }, &cred))
                    .await;
                f.check(
                    got.is_ok(),
                    "GetArtifact finds the caller's own artifacts",
                    || format!("as {reader}, {uri}: {got:?}"),
                );
            }
        }
    }
}
