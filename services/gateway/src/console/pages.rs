//! The console's pages: server-rendered HTML (maud escapes every value), readable
//! without JavaScript, one stylesheet embedded in the binary.

use convene_proto::v1;
use maud::{DOCTYPE, Markup, html};

use super::sessions::Session;

/// The stylesheet, served at `/console/assets/console.css`.
pub const STYLESHEET: &str = include_str!("console.css");

/// A run's state as people read it: the enum's name, lower case, words apart.
pub fn run_state(state: i32) -> String {
    v1::RunState::try_from(state)
        .map_or("RUN_STATE_UNSPECIFIED", |s| s.as_str_name())
        .trim_start_matches("RUN_STATE_")
        .to_ascii_lowercase()
        .replace('_', " ")
}

/// The states the runs list filters by, with their query values.
pub const STATES: [(&str, v1::RunState); 11] = [
    ("pending", v1::RunState::Pending),
    ("running", v1::RunState::Running),
    ("waiting-input", v1::RunState::WaitingInput),
    ("waiting-approval", v1::RunState::WaitingApproval),
    ("succeeded", v1::RunState::Succeeded),
    ("partial", v1::RunState::Partial),
    ("failed", v1::RunState::Failed),
    ("rejected", v1::RunState::Rejected),
    ("budget-exhausted", v1::RunState::BudgetExhausted),
    ("no-progress", v1::RunState::NoProgress),
    ("cancelled", v1::RunState::Cancelled),
];

fn delegation_state(state: i32) -> &'static str {
    v1::DelegationState::try_from(state)
        .map(|s| s.as_str_name())
        .unwrap_or("DELEGATION_STATE_UNSPECIFIED")
        .trim_start_matches("DELEGATION_STATE_")
}

/// A timestamp as people read it (UTC), or nothing.
pub fn time(ts: Option<&prost_types::Timestamp>) -> String {
    ts.and_then(|t| {
        chrono::DateTime::from_timestamp(t.seconds, u32::try_from(t.nanos).unwrap_or(0))
    })
    .map(|t| t.format("%Y-%m-%d %H:%M:%S UTC").to_string())
    .unwrap_or_default()
}

/// The frame of every page: the navigation (with sign-out for a session) and `body`.
pub fn layout(title: &str, session: Option<&Session>, body: &Markup) -> Markup {
    html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                meta name="viewport" content="width=device-width, initial-scale=1";
                title { (title) " · convene" }
                link rel="stylesheet" href="/console/assets/console.css";
                script src="/console/assets/console.js" defer {}
            }
            body {
                a.skip href="#main" { "Skip to content" }
                header {
                    nav aria-label="Console" {
                        span.brand { "convene" }
                        @if let Some(session) = session {
                            a href="/console/runs" { "Runs" }
                            a href="/console/approvals" { "Approvals" }
                            span.who { "Signed in as " strong { (session.principal) } " (" (session.tenant) ")" }
                            form.inline method="post" action="/console/sign-out" {
                                input type="hidden" name="csrf" value=(session.csrf);
                                button type="submit" { "Sign out" }
                            }
                        }
                    }
                }
                main #main tabindex="-1" { (body) }
            }
        }
    }
}

/// The sign-in form, with what went wrong last time; it carries `csrf`, the token of
/// the browser's pre-session cookie.
pub fn sign_in(error: Option<&str>, csrf: &str) -> Markup {
    layout(
        "Sign in",
        None,
        &html! {
            h1 { "Sign in" }
            @if let Some(error) = error {
                p.error role="alert" { (error) }
            }
            form method="post" action="/console/sign-in" {
                input type="hidden" name="csrf" value=(csrf);
                label for="credential" { "Credential" }
                input #credential type="password" name="credential" autocomplete="current-password" required;
                p.hint { "The bearer credential you call the API with (`convene runs list --credential …`)." }
                button type="submit" { "Sign in" }
            }
        },
    )
}

/// A page saying what went wrong, with a way back.
pub fn problem(title: &str, message: &str, session: Option<&Session>) -> Markup {
    layout(
        title,
        session,
        &html! {
            h1 { (title) }
            p role="alert" { (message) }
            p { a href="/console/runs" { "Back to the runs" } }
        },
    )
}

/// The filters of the runs list, as the form and the links carry them.
#[derive(Debug, Clone, Default, serde::Deserialize)]
pub struct RunFilters {
    /// A state's query value (see [`STATES`]); empty: any.
    #[serde(default)]
    pub state: String,
    /// `key=value`; empty: any.
    #[serde(default)]
    pub label: String,
    /// RFC 3339 or a duration ago (`2h`); empty: any time.
    #[serde(default)]
    pub since: String,
    /// Runs created before this (RFC 3339 or a duration ago); empty: up to now.
    #[serde(default)]
    pub until: String,
    /// The page to show (ListRuns' page token); empty: the first.
    #[serde(default)]
    pub page: String,
    /// Runs per page (1 to 100); unset: 50.
    #[serde(default)]
    pub size: Option<u32>,
}

impl RunFilters {
    /// The query string of these filters on page `page`.
    pub fn query(&self, page: &str) -> String {
        let mut q = url::form_urlencoded::Serializer::new(String::new());
        for (k, v) in [
            ("state", &self.state),
            ("label", &self.label),
            ("since", &self.since),
            ("until", &self.until),
        ] {
            if !v.is_empty() {
                q.append_pair(k, v);
            }
        }
        if let Some(size) = self.size {
            q.append_pair("size", &size.to_string());
        }
        if !page.is_empty() {
            q.append_pair("page", page);
        }
        q.finish()
    }
}

/// The runs list: the filters, a table of runs, and the next page's link.
pub fn runs(session: &Session, filters: &RunFilters, runs: &[v1::Run], next: &str) -> Markup {
    layout(
        "Runs",
        Some(session),
        &html! {
            h1 { "Runs" }
            form.filters method="get" action="/console/runs" role="search" {
                label for="state" { "State" }
                select #state name="state" {
                    option value="" selected[filters.state.is_empty()] { "any" }
                    @for (value, state) in STATES {
                        option value=(value) selected[filters.state == value] { (run_state(state as i32)) }
                    }
                }
                label for="label" { "Label" }
                input #label name="label" value=(filters.label) placeholder="service=payment-api";
                label for="since" { "Since" }
                input #since name="since" value=(filters.since) placeholder="2h or 2026-12-06T02:00:00Z";
                label for="until" { "Until" }
                input #until name="until" value=(filters.until) placeholder="30m or 2026-12-06T03:00:00Z";
                button type="submit" { "Filter" }
            }
            @if runs.is_empty() {
                p { "No runs match." }
            } @else {
                table {
                    caption.visually-hidden { "Runs, newest first" }
                    thead { tr {
                        th scope="col" { "Run" } th scope="col" { "State" }
                        th scope="col" { "Goal" } th scope="col" { "Created" }
                    } }
                    tbody {
                        @for run in runs {
                            tr {
                                td { a href={ "/console/runs/" (run.run_id) } { code { (run.run_id) } } }
                                td { span class={ "state state-" (run.state) } { (run_state(run.state)) } }
                                td { (run.spec.as_ref().map_or("", |s| s.goal.as_str())) }
                                td { (time(run.created_at.as_ref())) }
                            }
                        }
                    }
                }
            }
            @if !next.is_empty() {
                p { a rel="next" href={ "/console/runs?" (filters.query(next)) } { "Next page" } }
            }
        },
    )
}

/// A run: its summary, its delegations and the join's decision.
pub fn run(session: &Session, run: &v1::Run, jaeger: Option<&str>) -> Markup {
    let decision = run.decision.as_ref();
    let name_of = |id: &str| {
        run.delegations
            .iter()
            .filter_map(|d| d.task.as_ref())
            .find(|t| t.delegation_id == id)
            .map_or_else(
                || id.to_owned(),
                |t| format!("{} ({})", t.name, t.profile_id),
            )
    };
    layout(
        &format!("Run {}", run.run_id),
        Some(session),
        &html! {
            h1 { "Run " code { (run.run_id) } }
            div hidden data-live={ "/console/runs/" (run.run_id) "/events?after=" (run.version) } {}
            dl.summary {
                dt { "State" } dd { span class={ "state state-" (run.state) } { (run_state(run.state)) } }
                dt { "Goal" } dd { (run.spec.as_ref().map_or("", |s| s.goal.as_str())) }
                dt { "Started by" } dd { (run.principal) }
                dt { "Created" } dd { (time(run.created_at.as_ref())) }
                @if !run.terminal_reason.is_empty() {
                    dt { "Why it ended" } dd { (run.terminal_reason) }
                }
                @if let Some(jaeger) = jaeger {
                    @if !run.trace_id.is_empty() {
                        dt { "Trace" }
                        dd { a href={ (jaeger.trim_end_matches('/')) "/trace/" (run.trace_id) } { "Open in Jaeger" } }
                    }
                }
            }
            h2 { "Delegations" }
            table {
                thead { tr {
                    th scope="col" { "Delegation" } th scope="col" { "Profile" } th scope="col" { "Round" }
                    th scope="col" { "State" } th scope="col" { "Attempts" }
                    th scope="col" { "Dispatched" } th scope="col" { "Completed" }
                } }
                tbody {
                    @for d in &run.delegations {
                        @let task = d.task.clone().unwrap_or_default();
                        @let turns = d.result.as_ref().and_then(|r| r.usage.as_ref()).map_or(0, |u| u.iterations);
                        tr {
                            td {
                                (task.name)
                                @if turns > 0 {
                                    " " a href={ "/console/conversation?" (url::form_urlencoded::Serializer::new(String::new()).append_pair("run", &task.run_id).append_pair("delegation", &task.delegation_id).finish()) } { "conversation" }
                                }
                            }
                            td { (task.profile_id) }
                            td { (task.round) }
                            td { span class={ "dstate dstate-" (d.state) } { (delegation_state(d.state)) } }
                            td { (d.attempts) }
                            td { (time(d.dispatched_at.as_ref())) }
                            td { (time(d.completed_at.as_ref())) }
                        }
                    }
                }
            }
            @if !run.approval_ids.is_empty() {
                h2 { "Approval requests" }
                ul { @for id in &run.approval_ids { li { a href={ "/console/approvals/" (id) } { code { (id) } } } } }
            }
            @if !run.human_decisions.is_empty() {
                h2 { "Decisions people took" }
                ul.human {
                    @for h in &run.human_decisions {
                        li {
                            strong { (h.decided_by) } " "
                            (v1::HumanDecisionKind::try_from(h.kind).map_or("UNSPECIFIED", |k| k.as_str_name()).trim_start_matches("HUMAN_DECISION_KIND_").to_ascii_lowercase())
                            @if !h.topic.is_empty() { " " code { (h.topic) } }
                            @if !h.value.is_empty() { ": " strong { (h.value) } }
                            @if !h.goal.is_empty() { ": " (h.goal) }
                            " at " (time(h.decided_at.as_ref()))
                            @if !h.rationale.is_empty() { " — " (h.rationale) }
                        }
                    }
                }
            }
            h2 { "Decision" }
            @match decision {
                None => p { "The join has not decided yet." },
                Some(decision) => {
                    p { "Outcome: " strong { (v1::JoinOutcome::try_from(decision.outcome).map(|o| o.as_str_name()).unwrap_or("UNSPECIFIED").trim_start_matches("JOIN_OUTCOME_")) } }
                    @if !decision.accepted.is_empty() {
                        h3 { "Accepted" }
                        ul { @for id in &decision.accepted { li { (name_of(id)) } } }
                    }
                    @if !decision.rejected.is_empty() {
                        h3 { "Rejected" }
                        ul { @for r in &decision.rejected {
                            li { (name_of(&r.delegation_id)) ": "
                                (v1::RejectionReason::try_from(r.reason).map(|x| x.as_str_name()).unwrap_or("UNSPECIFIED"))
                                @if !r.detail.is_empty() { " — " (r.detail) } }
                        } }
                    }
                    @if !decision.missing_required.is_empty() {
                        h3 { "Missing" }
                        ul { @for m in &decision.missing_required { li { (m) } } }
                    }
                    @if !decision.missing_evidence_kinds.is_empty() {
                        h3 { "Missing evidence" }
                        ul { @for k in &decision.missing_evidence_kinds { li { "no accepted result cites evidence of kind " code { (k) } } } }
                    }
                    @if !decision.shared_evidence.is_empty() {
                        h3 { "Evidence shared by several results" }
                        ul { @for shared in &decision.shared_evidence {
                            li { code { (shared.content_hash) } ", cited by " (shared.delegation_ids.iter().map(|id| name_of(id)).collect::<Vec<_>>().join(", ")) }
                        } }
                    }
                    @for conflict in &decision.conflicts {
                        section.conflict aria-label={ "Conflict on " (conflict.topic) } {
                            h3 { "Conflict: " (conflict.topic) }
                            div.sides {
                                @for claim in &conflict.claims {
                                    article.side {
                                        h4 { (name_of(&claim.delegation_id)) }
                                        p { strong { (claim.value) } }
                                        p { (claim.statement) }
                                        @if !claim.evidence_refs.is_empty() {
                                            p { "Evidence:" }
                                            ul { @for e in &claim.evidence_refs {
                                                li { a href={ "/console/evidence?" (url::form_urlencoded::Serializer::new(String::new()).append_pair("id", e).finish()) } { code { (e) } } }
                                            } }
                                        }
                                    }
                                }
                            }
                        }
                    }
                }
            }
            (super::resume::forms(run, &session.csrf))
        },
    )
}
