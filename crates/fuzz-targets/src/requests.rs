//! The protobuf requests of `proto/convene/v1`, as a service receives them: decoded
//! with prost, then put through the validated conversions of `convene_core` the
//! receiving service applies to them.
//!
//! Where a validation accepts a message, the targets go on as the service does with
//! the validated value (a spec's tasks are built and dispatched, a grant's permissions
//! intersected and written into a token) and check what the next hop relies on: a task
//! the supervisor dispatches passes the worker's check, and a token never carries more
//! than the intersection it was computed from.

use std::time::Duration;

use convene_core::limits::{self, BudgetLedger};
use convene_core::permissions::{
    DataConstraints, Pattern, Permission, PermissionSet, RiskLevel, Terms, TimeWindow, effective,
    effective_tools, task_scope_set, time_window_from_proto,
};
use convene_core::time::{from_duration, from_timestamp};
use convene_core::validate;
use convene_evidence_store::artifacts::{ArtifactRef, is_sha256_hex};
use convene_proto::v1;
use convene_supervisor::plan::{self, Placement};
use prost::Message;

use crate::fixtures;

/// Decodes `data` as a `T`, or `None` when the bytes are not one (or too many).
fn decode<T: Message + Default>(data: &[u8]) -> Option<T> {
    if data.len() > crate::MAX_INPUT {
        return None;
    }
    T::decode(data).ok()
}

/// `StartRunRequest`: the spec as StartRun validates it, then the run StartRun builds
/// from it: its tasks, their dispatch budgets and their token grants.
pub fn start_run_request(data: &[u8]) {
    let Some(req) = decode::<v1::StartRunRequest>(data) else {
        return;
    };
    if !req.template.is_empty() {
        let _ = fixtures::templates().get(&req.template);
    }
    if let Some(spec) = &req.spec {
        run_spec(spec);
    }
}

/// A submitted run spec, from validation to the tasks and grants of its static plan.
pub(crate) fn run_spec(spec: &v1::RunSpec) {
    let now = fixtures::now();
    let Ok(domain) = validate::run_spec(spec, now) else {
        return;
    };
    let l = &domain.limits;
    let _ = limits::plan_batch(domain.plan.len(), l.max_parallel_workers, l.overflow);
    let ledger = BudgetLedger::new(l);
    let _ = ledger.check();
    let policy = fixtures::policy();
    for (i, (planned, wire)) in domain.plan.iter().zip(&spec.delegations).enumerate() {
        let at = Placement {
            run_id: "run-1",
            parent: None,
            depth: 1,
            round: 0,
            call_index: u32::try_from(i).unwrap_or(u32::MAX),
        };
        let mut task = plan::task(planned, wire, at, policy, now, l.deadline);
        task.budget = ledger.dispatch_budget(task.budget.as_ref());
        dispatched(&task, l.max_depth);
    }
}

/// A task the supervisor built from a validated plan and dispatches: the worker must
/// accept it, and its token grant goes to the policy service.
fn dispatched(task: &v1::DelegationTask, max_depth: u32) {
    if let Err(e) = validate::delegation_task(task, "task") {
        panic!(
            "the supervisor built a task from a valid plan that the worker refuses: {e}\n{task:?}"
        );
    }
    let grant = plan::grant(task, max_depth, fixtures::now());
    token_grant(&grant, "grants[0]");
}

/// `DelegateRequest`: each child as the supervisor's proposal check validates it, the
/// batch's width plan, and the tasks built for the children that pass.
pub fn delegate_request(data: &[u8]) {
    let Some(req) = decode::<v1::DelegateRequest>(data) else {
        return;
    };
    let now = fixtures::now();
    let parent_deadline = now + Duration::from_secs(600);
    let _ = limits::check_depth(2, 3);
    let _ = limits::plan_batch(
        req.delegations.len(),
        4,
        convene_core::model::Overflow::Queue,
    );
    let path = [("logs-investigator", "Identify the main error patterns.")];
    let ledger = BudgetLedger::new(&convene_core::model::Limits::defaults(now));
    let policy = fixtures::policy();
    for (i, wire) in req.delegations.iter().enumerate() {
        let Ok(planned) = validate::planned_task(wire, &format!("delegations[{i}]")) else {
            continue;
        };
        if limits::check_loop(&path, &planned.profile_id, &planned.goal).is_err()
            || !policy.profiles.contains_key(&planned.profile_id)
        {
            continue;
        }
        let at = Placement {
            run_id: "run-1",
            parent: Some("del-1"),
            depth: 2,
            round: 0,
            call_index: u32::try_from(i).unwrap_or(u32::MAX),
        };
        let mut task = plan::task(&planned, wire, at, policy, now, parent_deadline);
        task.budget = ledger.dispatch_budget(task.budget.as_ref());
        dispatched(&task, 3);
    }
}

/// `WorkerExecuteRequest`: the Delegation Contract as the worker's Execute checks it.
pub fn worker_execute_request(data: &[u8]) {
    let Some(req) = decode::<v1::WorkerExecuteRequest>(data) else {
        return;
    };
    let Some(task) = &req.task else {
        return;
    };
    if validate::delegation_task(task, "task").is_ok() {
        // A task the worker runs has its token grant asked for in the same shape.
        let grant = plan::grant(task, task.depth.saturating_add(1), fixtures::now());
        token_grant(&grant, "grants[0]");
    }
    authorize_token(&req.task_token, &task.profile_id);
}

/// `IssueTaskTokenRequest`: every grant through the permission conversions and the
/// intersection IssueTaskToken computes, up to the claims of the token.
pub fn issue_task_token_request(data: &[u8]) {
    let Some(req) = decode::<v1::IssueTaskTokenRequest>(data) else {
        return;
    };
    if req.grants.len() > convene_policy::issue::MAX_GRANTS {
        return;
    }
    if !req.parent_token.is_empty() {
        let _ = fixtures::verifier().verify(&req.parent_token, fixtures::now());
    }
    for (i, grant) in req.grants.iter().enumerate() {
        token_grant(grant, &format!("grants[{i}]"));
    }
}

/// One grant: its required scopes, task scope and lifetime converted; the effective
/// permissions of the example's on-call principal for the grant's profile; the claims'
/// scopes written from them, which must read back as a subset of every term.
fn token_grant(grant: &v1::TokenGrantRequest, field: &str) {
    let policy = fixtures::policy();
    let Ok(required) = grant
        .required_scopes
        .iter()
        .enumerate()
        .map(|(j, s)| Permission::from_proto(s, &format!("{field}.required_scopes[{j}]")))
        .collect::<Result<Vec<_>, _>>()
    else {
        return;
    };
    let task_term = match grant.task_scope.as_ref() {
        None => PermissionSet::everything(),
        Some(scope) => {
            let window = match &scope.time_range {
                Some(tr) => match time_window_from_proto(tr, "task_scope.time_range") {
                    Ok(w) => w,
                    Err(_) => return,
                },
                None => TimeWindow::unbounded(),
            };
            match task_scope_set(&scope.resources, window) {
                Ok(set) => set,
                Err(_) => return,
            }
        }
    };
    if let Some(ttl) = &grant.ttl {
        let _ = from_duration(ttl, "ttl");
    }
    let asked: Vec<PermissionSet> = required
        .iter()
        .map(|p| PermissionSet::from_permissions([p.clone()]).intersect(&task_term))
        .collect();
    let asked_all =
        PermissionSet::from_permissions(asked.iter().flat_map(|a| a.permissions().iter().cloned()));
    let Some(principal) = policy.principals.get("oncall@acme") else {
        return;
    };
    let Some(profile) = policy.profiles.get(&grant.profile_id) else {
        return;
    };
    let runtime = PermissionSet::everything();
    let granted = effective(Terms {
        grants: &principal.grants,
        delegable: &principal.delegable,
        capabilities: &profile.capabilities,
        task: &asked_all,
        runtime: &runtime,
    });
    for (term, set) in [
        ("grants", &principal.grants),
        ("capabilities", &profile.capabilities),
        ("task", &asked_all),
    ] {
        assert!(
            granted.is_subset_of(set),
            "the effective permissions exceed the {term} term: {granted:?} ⊄ {set:?}"
        );
    }
    for a in &asked {
        let _ = a.is_subset_of(&granted);
        let _ = a.intersect(&granted);
    }
    let _ = effective_tools(&grant.tools, &profile.tools, |t| {
        policy.tools.contains_key(t)
    });
    let mut claims = fixtures::claims();
    claims.set_permissions(&granted);
    match claims.permissions() {
        Ok(carried) => assert!(
            carried.is_subset_of(&granted),
            "a token's scopes read back wider than the permissions written into them: \
             {carried:?} ⊄ {granted:?}"
        ),
        Err(e) => panic!("a token's scopes written from {granted:?} do not read back: {e}"),
    }
}

/// `AuthorizeRequest`: the data scope as Authorize converts it, the token verified, and
/// the checks of a verified token against the example catalog.
pub fn authorize_request(data: &[u8]) {
    let Some(req) = decode::<v1::AuthorizeRequest>(data) else {
        return;
    };
    authorize(&req);
}

fn authorize(req: &v1::AuthorizeRequest) {
    let data = match req.data_scope.as_ref() {
        None => DataConstraints::unconstrained(),
        Some(scope) => {
            let time = match &scope.time_range {
                Some(tr) => match time_window_from_proto(tr, "data_scope.time_range") {
                    Ok(w) => w,
                    Err(_) => return,
                },
                None => TimeWindow::unbounded(),
            };
            DataConstraints {
                time,
                max_rows: (scope.max_rows > 0).then_some(scope.max_rows),
            }
        }
    };
    let Ok(claims) = fixtures::verifier().verify(&req.token, fixtures::now()) else {
        return;
    };
    let _ = claims.check_audience(&req.audience);
    let policy = fixtures::policy();
    let tool = policy.tools.get(&req.tool);
    let action = match tool {
        Some(t) if req.action.is_empty() && !t.action.contains('*') => t.action.as_str(),
        _ => req.action.as_str(),
    };
    if let Some(tool) = tool {
        let _ = Pattern::parse(&tool.action).map(|p| p.matches(action));
        if let Some(template) = &tool.resource {
            let _ = template.matches(&req.resource);
        }
        if let Some(profile) = policy.profiles.get(&claims.profile_id) {
            let _ = policy.denying_rule(profile, tool);
        }
    }
    if let Ok(scopes) = claims.permissions() {
        let _ = scopes.check(action, &req.resource, &data);
    }
}

/// A task token as a service receives it: verified, then its audience and scopes read.
fn authorize_token(token: &str, profile_id: &str) {
    if let Ok(claims) = fixtures::verifier().verify(token, fixtures::now()) {
        let _ = claims.check_audience(&convene_policy::issue::worker_audience(profile_id));
        let _ = claims.permissions();
    }
}

/// `RequestApprovalRequest`: the parameters' canonical JSON and hash, the lifetime and
/// the risk level as RequestApproval reads them.
pub fn request_approval_request(data: &[u8]) {
    let Some(req) = decode::<v1::RequestApprovalRequest>(data) else {
        return;
    };
    let parameters = req.parameters.unwrap_or_default();
    if let Ok(canonical) = convene_approval::canonical::canonical_json(&parameters) {
        if let Err(e) = serde_json::from_str::<serde_json::Value>(&canonical) {
            panic!("the canonical JSON of approval parameters is not JSON ({e}): {canonical}");
        }
        let _ = convene_approval::canonical::parameters_hash(&parameters);
    }
    if let Some(d) = &req.expires_in
        && let Ok(ttl) = from_duration(d, "expires_in")
    {
        let _ = fixtures::now().checked_add(ttl);
    }
    let _ = RiskLevel::from_proto(req.risk_level).approvals_required();
    let _ = fixtures::policy().risk_of(&req.action);
}

/// `PutArtifactRequest`: the artifact's address from its bytes, and the evidence record's
/// time and scope conversions.
pub fn put_artifact_request(data: &[u8]) {
    let Some(req) = decode::<v1::PutArtifactRequest>(data) else {
        return;
    };
    let artifact = ArtifactRef::of("acme-payments", &req.content);
    let uri = artifact.uri();
    match ArtifactRef::parse(&uri) {
        Ok(back) => assert_eq!(
            back.uri(),
            uri,
            "an artifact's URI does not read back as itself"
        ),
        Err(e) => panic!("the URI of a stored artifact does not parse: {uri}: {e}"),
    }
    if let Some(e) = &req.evidence {
        evidence(e);
    }
}

/// `RecordEvidenceRequest`: the evidence record's references, time and scope.
pub fn record_evidence_request(data: &[u8]) {
    let Some(req) = decode::<v1::RecordEvidenceRequest>(data) else {
        return;
    };
    if let Some(e) = &req.evidence {
        evidence(e);
    }
}

fn evidence(e: &v1::Evidence) {
    if !e.artifact_uri.is_empty() {
        let _ = ArtifactRef::parse(&e.artifact_uri);
    }
    if let Some(hex) = e.content_hash.strip_prefix("sha256:") {
        let _ = is_sha256_hex(hex);
    }
    if let Some(observed) = &e.observed_at {
        let _ = from_timestamp(observed, "evidence.observed_at");
    }
    if let Some(scope) = &e.scope {
        let window = match &scope.time_range {
            Some(tr) => time_window_from_proto(tr, "evidence.scope.time_range").ok(),
            None => Some(TimeWindow::unbounded()),
        };
        if let Some(window) = window {
            let _ = task_scope_set(&scope.resources, window);
        }
    }
}

/// `ResumeRunRequest`: the input as the gateway and the CLI carry it, in the protobuf
/// JSON mapping, which must read back as the same message.
pub fn resume_run_request(data: &[u8]) {
    let Some(req) = decode::<v1::ResumeRunRequest>(data) else {
        return;
    };
    use v1::resume_run_request::Input;
    match &req.input {
        Some(Input::Settle(s)) => json_round_trip(s),
        Some(Input::FollowUp(f)) => {
            json_round_trip(f);
            let _ = fixtures::policy().profiles.get(&f.profile_id);
        }
        Some(Input::Close(_)) | None => {}
    }
}

/// `msg` written in the protobuf JSON mapping reads back as `msg`.
pub(crate) fn json_round_trip<T: convene_proto::json::Named + PartialEq + std::fmt::Debug>(
    msg: &T,
) {
    // NaN is unequal to itself: such a message cannot be compared after the trip.
    #[allow(clippy::eq_op)]
    let comparable = msg == msg;
    let Ok(value) = convene_proto::json::to_value(msg) else {
        return;
    };
    match convene_proto::json::from_value::<T>(value.clone()) {
        Ok(back) => assert!(
            !comparable || back == *msg,
            "JSON round trip changed the message: {msg:?} → {value} → {back:?}"
        ),
        Err(e) => panic!("JSON written for {msg:?} does not read back: {e}: {value}"),
    }
}

/// Every other request type, chosen by the first byte: decoded, and where the receiving
/// service converts a field with `convene_core`, converted.
pub fn other_requests(data: &[u8]) {
    let Some((&which, rest)) = data.split_first() else {
        return;
    };
    match which % 24 {
        0 => {
            if let Some(r) = decode::<v1::RegisterRequest>(rest) {
                for (i, p) in r.profiles.iter().enumerate() {
                    let _ = validate::worker_profile(p, &format!("profiles[{i}]"));
                }
            }
        }
        1 => drop(decode::<v1::HeartbeatRequest>(rest)),
        2 => drop(decode::<v1::DeregisterRequest>(rest)),
        3 => drop(decode::<v1::PlanTurnRequest>(rest)),
        4 => drop(decode::<v1::WorkerCancelRequest>(rest)),
        5 => drop(decode::<v1::GetRunRequest>(rest)),
        6 => drop(decode::<v1::WatchRunRequest>(rest)),
        7 => drop(decode::<v1::CancelRunRequest>(rest)),
        8 => drop(decode::<v1::ListRunsRequest>(rest)),
        9 => drop(decode::<v1::WatchEventsRequest>(rest)),
        10 => drop(decode::<v1::DecideRequest>(rest)),
        11 => drop(decode::<v1::GetApprovalRequest>(rest)),
        12 => drop(decode::<v1::ListApprovalsRequest>(rest)),
        13 => drop(decode::<v1::ApprovalExecuteRequest>(rest)),
        14 => drop(decode::<v1::CancelApprovalRequest>(rest)),
        15 => drop(decode::<v1::ApprovalWatchEventsRequest>(rest)),
        16 => {
            if let Some(r) = decode::<v1::PutArtifactBatchRequest>(rest) {
                for item in r.items.iter().take(256) {
                    authorize_token(&item.token, "logs-investigator");
                    if let Some(e) = item.request.as_ref().and_then(|r| r.evidence.as_ref()) {
                        evidence(e);
                    }
                }
            }
        }
        17 => {
            if let Some(r) = decode::<v1::GetArtifactRequest>(rest) {
                let _ = ArtifactRef::parse(&r.uri);
            }
        }
        18 => drop(decode::<v1::GetEvidenceRequest>(rest)),
        19 => drop(decode::<v1::VerifyChainRequest>(rest)),
        20 => {
            if let Some(r) = decode::<v1::AuthorizeBatchRequest>(rest) {
                for item in r.items.iter().take(256) {
                    if let Some(req) = &item.request {
                        authorize(req);
                    }
                }
            }
        }
        21 => drop(decode::<v1::RevokeRequest>(rest)),
        22 => drop(decode::<v1::GetSigningKeysRequest>(rest)),
        _ => drop(decode::<v1::ListToolsRequest>(rest)),
    }
}
