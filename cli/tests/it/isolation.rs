//! Tenants never meet through the client commands, black-box: with one tenant's
//! credential, every command that takes an id answers the other tenant's ids exactly as
//! it answers ids nobody has (the same exit status, the same output once the id is
//! replaced by a placeholder), and the listings show the caller's own objects and
//! nothing of the other tenant. Both tenants run the payment incident: one run left
//! waiting for input with its rollback request pending, one cancelled.

use std::collections::BTreeSet;
use std::process::Output;

use serde_json::Value;

use crate::mesh::{LIMIT, Mesh, json};
use crate::support::{repo_root, wait_for};

/// A tenant and its people.
#[derive(Debug, Clone, Copy)]
struct Tenant {
    name: &'static str,
    oncall: &'static str,
    alice: &'static str,
    bob: &'static str,
}

const ACME: Tenant = Tenant {
    name: "acme-payments",
    oncall: "oncall@acme",
    alice: "alice@acme",
    bob: "bob@acme",
};
const GLOBEX: Tenant = Tenant {
    name: "globex",
    oncall: "oncall@globex",
    alice: "alice@globex",
    bob: "bob@globex",
};

/// The example policy with globex staffed as acme is.
fn policy() -> String {
    let text = std::fs::read_to_string(repo_root().join("examples/payment-incident/policy.yaml"))
        .expect("the example policy");
    let anchor = "  # Services of the mesh.\n";
    assert!(
        text.contains(anchor),
        "the example policy lists its people first"
    );
    let mut people = String::new();
    for (who, roles) in [
        (
            "oncall",
            "runs:start, runs:read, runs:resolve, approvals:request, evidence:read",
        ),
        (
            "alice",
            "runs:read, approvals:decide, approvals:execute, evidence:read",
        ),
        (
            "bob",
            "runs:read, approvals:decide, approvals:execute, evidence:read",
        ),
    ] {
        people.push_str(&format!(
            "  - id: {who}@globex\n    tenant: globex\n    kind: human\n    roles: [{roles}]\n"
        ));
        if who == "oncall" {
            people.push_str(
                "    grants:\n      - { action: \"logs:read\", resource: \"service/*\" }\n      \
                 - { action: \"metrics:read\", resource: \"metric/*\" }\n      \
                 - { action: \"changes:read\", resource: \"change/*\" }\n      \
                 - { action: \"evidence:*\", resource: \"evidence\" }\n",
            );
        }
    }
    text.replacen(anchor, &format!("{people}{anchor}"), 1)
}

/// An id of the same shape as `id` that nobody has: every digit of each run of eight or
/// more hex digits (the UUIDs and hashes ids are made of) moved on by seven.
fn made_up(id: &str) -> String {
    let is_hex = |c: &char| c.is_ascii_digit() || ('a'..='f').contains(c);
    let chars: Vec<char> = id.chars().collect();
    let mut out = String::with_capacity(id.len());
    let mut i = 0;
    while i < chars.len() {
        let run = chars[i..].iter().take_while(|c| is_hex(c)).count().max(1);
        for c in &chars[i..i + run] {
            match c.to_digit(16) {
                Some(d) if run >= 8 => out.extend(char::from_digit((d + 7) % 16, 16)),
                _ => out.push(*c),
            }
        }
        i += run;
    }
    assert_ne!(out, id, "{id} has no part to vary");
    out
}

/// What one tenant made, from its own commands' output.
#[derive(Debug, Default)]
struct Made {
    /// The waiting run: its id, its ticket and its `changes` delegation.
    waiting: (String, String, String),
    runs: BTreeSet<String>,
    approvals: BTreeSet<String>,
    delegations: BTreeSet<String>,
    evidence: BTreeSet<String>,
    artifacts: BTreeSet<String>,
    tickets: BTreeSet<String>,
    events: BTreeSet<String>,
}

impl Made {
    fn ids(&self) -> impl Iterator<Item = &String> {
        self.runs
            .iter()
            .chain(&self.approvals)
            .chain(&self.delegations)
            .chain(&self.evidence)
            .chain(&self.artifacts)
            .chain(&self.tickets)
            .chain(&self.events)
    }
}

/// The payment incident as `t`'s on-call engineer, under idempotency key `key`, until
/// it stops; the run as it then stands, and its rollback request's id.
fn incident(mesh: &Mesh, t: Tenant, key: &str) -> (Value, String) {
    let spec = mesh.example_spec(key);
    let spec = spec.to_str().expect("UTF-8 path");
    let run = json(&mesh.ok(t.oncall, &["run", spec, "--json"]));
    let run_id = run["runId"].as_str().expect("runId").to_owned();
    let approval = wait_for("the rollback approval request", LIMIT, || {
        let listed = json(&mesh.ok(t.oncall, &["approvals", "list", "--run", &run_id, "--json"]));
        listed["approvals"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|a| a["action"] == "rule:rollback")
            .and_then(|a| a["approvalId"].as_str().map(str::to_owned))
            .ok_or(listed)
    });
    let run = json(&mesh.ok(t.oncall, &["runs", "get", &run_id, "--json"]));
    (run, approval)
}

/// `t`'s objects: one run waiting for input with its request pending, one cancelled.
fn make(mesh: &Mesh, t: Tenant) -> Made {
    let mut made = Made::default();
    for (i, cancel) in [(1, false), (2, true)] {
        let (mut run, approval) = incident(mesh, t, &format!("isolation-{}-{i}", t.name));
        let run_id = run["runId"].as_str().expect("runId").to_owned();
        if let Some(ticket) = run["ticket"]["id"].as_str() {
            made.tickets.insert(ticket.to_owned());
        }
        let delegation = |name: &str| {
            run["delegations"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|d| &d["task"])
                .find(|task| task["name"] == name)
                .and_then(|task| task["delegationId"].as_str())
                .expect("a delegation of the example")
                .to_owned()
        };
        if cancel {
            mesh.ok(t.oncall, &["runs", "cancel", &run_id, "--json"]);
            run = json(&mesh.ok(t.oncall, &["runs", "get", &run_id, "--json"]));
            assert_eq!(run["state"], "RUN_STATE_CANCELLED", "{run:#}");
        } else {
            assert_eq!(run["state"], "RUN_STATE_WAITING_INPUT", "{run:#}");
            let ticket = run["ticket"]["id"].as_str().expect("a ticket").to_owned();
            made.waiting = (run_id.clone(), ticket, delegation("changes"));
        }
        for d in run["delegations"].as_array().into_iter().flatten() {
            made.delegations
                .extend(d["task"]["delegationId"].as_str().map(str::to_owned));
            for e in d["result"]["evidence"].as_array().into_iter().flatten() {
                made.evidence
                    .extend(e["evidenceId"].as_str().map(str::to_owned));
                made.artifacts
                    .extend(e["artifactUri"].as_str().map(str::to_owned));
            }
        }
        made.runs.insert(run_id);
        made.approvals.insert(approval);
    }
    for line in mesh.ok(t.oncall, &["events", "--json"]).lines() {
        made.events
            .extend(json(line)["id"].as_str().map(str::to_owned));
    }
    assert!(
        !made.events.is_empty() && !made.evidence.is_empty(),
        "{made:#?}"
    );
    made
}

/// A command's outcome with `ids` replaced by a placeholder: exit status, stdout, stderr.
fn scrubbed(out: &Output, ids: &[&str]) -> (Option<i32>, String, String) {
    let scrub = |bytes: &[u8]| {
        ids.iter()
            .fold(String::from_utf8_lossy(bytes).into_owned(), |t, id| {
                t.replace(id, "<id>")
            })
    };
    (out.status.code(), scrub(&out.stdout), scrub(&out.stderr))
}

/// One tenant's client commands, with the other's objects in view.
struct Caller<'a> {
    mesh: &'a Mesh,
    me: Tenant,
    mine: &'a Made,
    /// What must never reach `me`: the other tenant's ids, people and name.
    foreign: Vec<String>,
}

impl Caller<'_> {
    /// Panics if `text`, something `me` was shown by `what`, names anything of the
    /// other tenant.
    fn scan(&self, what: &str, text: &str) {
        let named: Vec<&String> = self
            .foreign
            .iter()
            .filter(|id| text.contains(id.as_str()))
            .collect();
        assert!(
            named.is_empty(),
            "{} ran `{what}` and was shown {named:?} of the other tenant:\n{text}",
            self.me.name
        );
    }

    /// Runs `args` as `who` with `theirs` (the other tenant's id) in it, then with an
    /// id nobody has of the same shape: both must end alike, the same exit status and
    /// the same output once the id is replaced by a placeholder. Returns that outcome.
    fn alike(&self, who: &str, args: &[&str], theirs: &str) -> (Option<i32>, String, String) {
        let none = made_up(theirs);
        let run = |id: &str| {
            let args: Vec<&str> = args
                .iter()
                .map(|a| if *a == theirs { id } else { a })
                .collect();
            scrubbed(&self.mesh.run(who, &args), &[id])
        };
        let (a, b) = (run(theirs), run(&none));
        let what = args.join(" ");
        self.scan(&what, &format!("{}\n{}", a.1, a.2));
        assert_eq!(
            a, b,
            "{} ran `{what}`: the other tenant's id {theirs} is told apart from {none}, an id nobody has",
            self.me.name
        );
        assert!(
            !a.2.contains("not permitted"),
            "{} ran `{what}` and was refused as not permitted: {}",
            self.me.name,
            a.2
        );
        a
    }

    /// Every command that takes an id, with the other tenant's ids.
    fn probe(&self, other: &Made) {
        let me = self.me;
        let hash = format!("sha256:{}", "ab".repeat(32));
        let (their_run, their_ticket, their_side) = &other.waiting;
        let their_run = their_run.as_str();
        for their in &other.runs {
            let their = their.as_str();
            let refusals: [&[&str]; 8] = [
                &["runs", "get", their],
                &["runs", "get", their, "--json"],
                &["runs", "cancel", their],
                &["runs", "resolve", their, "--close", "--rationale", "r"],
                &[
                    "runs",
                    "resolve",
                    their,
                    "--topic",
                    "primary_cause",
                    "--choose",
                    "changes",
                    "--rationale",
                    "r",
                ],
                &[
                    "runs",
                    "resolve",
                    their,
                    "--follow-up-profile",
                    "logs-investigator",
                    "--goal",
                    "g",
                    "--rationale",
                    "r",
                ],
                &["evidence", "verify", their],
                &["evidence", "verify", their, "--json"],
            ];
            for args in refusals {
                let (status, _, err) = self.alike(me.oncall, args, their);
                assert_eq!(status, Some(1), "`{}`: {err}", args.join(" "));
                assert!(err.contains("(NotFound)"), "`{}`: {err}", args.join(" "));
            }
            // Filters naming the run: nothing, as for a run nobody has.
            for args in [
                &["approvals", "list", "--run", their][..],
                &["approvals", "list", "--run", their, "--json"],
                &["events", "--run", their],
                &["events", "--run", their, "--json"],
            ] {
                let (status, out, _) = self.alike(me.oncall, args, their);
                assert_eq!(status, Some(0), "`{}`", args.join(" "));
                assert!(
                    !out.contains("approvalId") && !out.contains("tenantid"),
                    "{out}"
                );
            }
        }
        // The waiting run under its own ticket, as its owner would resume it.
        let args = [
            "runs",
            "resolve",
            their_run,
            "--topic",
            "primary_cause",
            "--choose",
            their_side,
            "--rationale",
            "r",
            "--ticket",
            their_ticket,
        ];
        let (status, _, err) = self.alike(me.oncall, &args, their_run);
        assert_eq!(
            (status, err.contains("(NotFound)")),
            (Some(1), true),
            "{err}"
        );
        for their in &other.approvals {
            let their = their.as_str();
            for (who, verb) in [
                (me.alice, "approve"),
                (me.bob, "reject"),
                (me.alice, "execute"),
            ] {
                let args = ["approvals", verb, their, "--hash", &hash];
                let (status, _, err) = self.alike(who, &args, their);
                assert_eq!(
                    (status, err.contains("(NotFound)")),
                    (Some(1), true),
                    "{err}"
                );
            }
        }
        // `me`'s own waiting run, resumed naming the other tenant's delegation, evidence
        // or ticket: refused as for ids nobody has.
        let (own, _, side) = &self.mine.waiting;
        let their_evidence = other.evidence.iter().next().expect("evidence");
        let cases: [(&[&str], &str); 3] = [
            (
                &["--topic", "primary_cause", "--choose", their_side],
                their_side,
            ),
            (
                &[
                    "--topic",
                    "primary_cause",
                    "--choose",
                    side,
                    "--evidence",
                    their_evidence,
                ],
                their_evidence,
            ),
            (&["--close", "--ticket", their_ticket], their_ticket),
        ];
        for (input, their) in cases {
            let mut args = vec!["runs", "resolve", own, "--rationale", "r"];
            args.extend(input);
            let (status, _, err) = self.alike(me.oncall, &args, their);
            assert_eq!(status, Some(1), "`{}`: {err}", args.join(" "));
        }
        // Events after the other tenant's event: only `me`'s own.
        for their in other.events.iter().take(3) {
            let out = self
                .mesh
                .ok(me.oncall, &["events", "--after", their, "--json"]);
            self.scan("events --after", &out);
            for line in out.lines() {
                assert_eq!(json(line)["tenantid"], me.name, "{line}");
            }
        }
    }

    /// The listings: exactly `me`'s own objects.
    fn lists(&self) {
        let me = self.me;
        for args in [
            &["runs", "list", "--limit", "500"][..],
            &["approvals", "list"],
            &["events"],
        ] {
            let out = self.mesh.ok(me.oncall, args);
            self.scan(&args.join(" "), &out);
        }
        let runs = json(
            &self
                .mesh
                .ok(me.oncall, &["runs", "list", "--limit", "500", "--json"]),
        );
        self.scan("runs list --json", &runs.to_string());
        let listed: BTreeSet<String> = runs["runs"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|r| r["runId"].as_str().map(str::to_owned))
            .collect();
        assert_eq!(listed, self.mine.runs, "{runs:#}");
        let approvals = json(&self.mesh.ok(me.oncall, &["approvals", "list", "--json"]));
        self.scan("approvals list --json", &approvals.to_string());
        let listed: BTreeSet<String> = approvals["approvals"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|a| a["approvalId"].as_str().map(str::to_owned))
            .collect();
        assert_eq!(listed, self.mine.approvals, "{approvals:#}");
        let events = self.mesh.ok(me.oncall, &["events", "--json"]);
        self.scan("events --json", &events);
        for line in events.lines() {
            let event = json(line);
            assert_eq!(event["tenantid"], me.name, "{line}");
        }
        for run_id in &self.mine.runs {
            assert!(
                events.lines().any(|l| {
                    let e = json(l);
                    e["type"] == "dev.convene.run.started.v1"
                        && e["correlationid"] == run_id.as_str()
                }),
                "no run.started of {run_id} in:\n{events}"
            );
        }
    }
}

#[test]
fn client_commands_answer_the_other_tenants_ids_as_ids_nobody_has() {
    let dir = tempfile::tempdir().expect("tempdir");
    let policy_file = dir.path().join("policy.yaml");
    std::fs::write(&policy_file, policy()).expect("policy written");
    let mesh = Mesh::start_with(|cmd| {
        cmd.arg("--policy").arg(&policy_file);
    });
    let acme = make(&mesh, ACME);
    let globex = make(&mesh, GLOBEX);
    for (me, them, mine, other) in [
        (ACME, GLOBEX, &acme, &globex),
        (GLOBEX, ACME, &globex, &acme),
    ] {
        let own: BTreeSet<&String> = mine.ids().collect();
        let mut foreign: Vec<String> = other
            .ids()
            .filter(|id| !own.contains(id))
            .cloned()
            .collect();
        foreign.extend([them.name, them.oncall, them.alice, them.bob].map(str::to_owned));
        let caller = Caller {
            mesh: &mesh,
            me,
            mine,
            foreign,
        };
        caller.probe(other);
        caller.lists();
    }
    // Nothing of either tenant changed: each run stands as it did, each request too.
    for (t, made) in [(ACME, &acme), (GLOBEX, &globex)] {
        let (waiting, ..) = &made.waiting;
        for run_id in &made.runs {
            let run = json(&mesh.ok(t.oncall, &["runs", "get", run_id, "--json"]));
            let want = if run_id == waiting {
                "RUN_STATE_WAITING_INPUT"
            } else {
                "RUN_STATE_CANCELLED"
            };
            assert_eq!(run["state"], want, "{run:#}");
        }
        let approvals = json(&mesh.ok(t.oncall, &["approvals", "list", "--json"]));
        for a in approvals["approvals"].as_array().into_iter().flatten() {
            assert!(a["votes"].as_array().is_none_or(Vec::is_empty), "{a:#}");
            assert!(a["execution"].is_null(), "{a:#}");
        }
    }
}
