//! Authorize: one decision per tool call, in a fixed order, each deny naming what would
//! have to change.
//!
//! The order is: the token verifies (signature, key, validity window); it is not revoked
//! (by itself or through its run; checked with the count for a call that passes every
//! other check, and before any other reason for one that does not); the presenter is the
//! worker of the profile the token names (`worker:<profile>`: the audience is bound to it,
//! a request may only repeat it, and under mutual TLS the caller's certificate must name
//! `worker`); the tenant matches;
//! the tool is in the catalog and in the token; no runtime rule denies the tool to the
//! token's profile; the tool's catalog action covers the asked action; the resource is
//! one the tool's catalog resource template can produce (MCP tools); the token's scopes
//! cover action, resource and data scope; and finally the call is counted against
//! `max_calls`. Only a call that passes every check consumes a call.

use std::sync::Arc;
use std::time::SystemTime;

use convene_core::permissions::{
    DataConstraints, Denial, Pattern, TimeWindow, time_window_from_proto,
};
use convene_mesh::policy_file::Tool;
use convene_proto::v1::{self, AuthorizeReason};
use convene_tokens::Claims;

use crate::Error;
use crate::decision_log::{AuthorizeRecord, LogEntry};
use crate::issue::{describe, describe_data, list};
use crate::service::Inner;
use crate::state::{Call, Counted, DecisionOf, Revocation, RevokeTarget};

/// A decision before it is logged.
enum Outcome {
    /// Every check passed: the call is to be counted.
    Pass(Claims),
    /// Refused.
    Deny {
        /// The verified claims, when the token verified.
        claims: Option<Claims>,
        reason: AuthorizeReason,
        /// What would have to change.
        detail: String,
    },
}

impl Outcome {
    fn deny(claims: Option<Claims>, reason: AuthorizeReason, detail: String) -> Self {
        Self::Deny {
            claims,
            reason,
            detail,
        }
    }

    fn claims(&self) -> Option<&Claims> {
        match self {
            Outcome::Pass(claims) => Some(claims),
            Outcome::Deny { claims, .. } => claims.as_ref(),
        }
    }
}

/// A decision as it is logged and answered.
struct Verdict {
    allowed: bool,
    reason: AuthorizeReason,
    detail: String,
    calls_used: u32,
}

impl Verdict {
    /// The decision on a call that passed every check, once counted.
    fn of_count(
        counted: &Counted,
        max_calls: u32,
        action: &str,
        resource: &str,
        tool: &str,
    ) -> Self {
        match *counted {
            Counted::Allowed { used } => Verdict {
                allowed: true,
                reason: AuthorizeReason::Allowed,
                detail: format!(
                    "allowed: `{action}` on `{resource}` with tool `{tool}` (call {used} of {max_calls})"
                ),
                calls_used: used,
            },
            Counted::LimitExceeded { used, max } => Verdict {
                allowed: false,
                reason: AuthorizeReason::CallLimitExceeded,
                detail: format!(
                    "the token's {max} authorized calls are used up (max_calls); ask the \
                     supervisor for a new task token"
                ),
                calls_used: used,
            },
            Counted::Revoked {
                ref revocation,
                used,
            } => Verdict {
                allowed: false,
                reason: AuthorizeReason::Revoked,
                detail: revoked_detail(revocation),
                calls_used: used,
            },
        }
    }
}

/// Why a revoked token is refused, and what to do.
fn revoked_detail(revocation: &Revocation) -> String {
    match &revocation.target {
        RevokeTarget::Token(id) => format!(
            "token {id} was revoked ({}); ask the supervisor for a new task token",
            revocation.reason
        ),
        RevokeTarget::Run(id) => format!(
            "run {id} was revoked ({}); every token of the run is refused",
            revocation.reason
        ),
        RevokeTarget::Lease { run_id, epoch } => format!(
            "the token was issued under an earlier lease epoch of run {run_id}, and {}; only \
             tokens of epoch {epoch} or later act for the run",
            revocation.reason
        ),
    }
}

impl Inner {
    /// Decides, logs and answers one Authorize request.
    pub(crate) async fn authorize(
        &self,
        request: &v1::AuthorizeRequest,
    ) -> Result<v1::AuthorizeResponse, Error> {
        let data = data_constraints(request.data_scope.as_ref())?;
        let now = self.clock.now();
        let tool = self.policy.tools.get(&request.tool);
        let outcome = match self.decide(request, tool, &data, now).await? {
            // A revocation takes precedence over every other reason a verified token is
            // refused for. A call that passed is checked inside its count instead.
            Outcome::Deny {
                claims: Some(claims),
                reason,
                detail,
            } => match self
                .state
                .is_revoked(&claims.token_id, &claims.run_id, claims.lease_epoch)
                .await?
            {
                Some(revocation) => Outcome::deny(
                    Some(claims),
                    AuthorizeReason::Revoked,
                    revoked_detail(&revocation),
                ),
                None => Outcome::deny(Some(claims), reason, detail),
            },
            outcome => outcome,
        };

        let decision_id = uuid::Uuid::now_v7().to_string();
        let time = humantime::format_rfc3339_millis(now).to_string();
        let claims = outcome.claims();
        let field = |f: fn(&Claims) -> &String| claims.map(f).cloned().unwrap_or_default();
        // The record of this decision, but for the verdict: owned, since the count and
        // its record may be written by the database's writer task.
        let base = AuthorizeRecord {
            decision_id: decision_id.clone(),
            time,
            token_id: field(|c| &c.token_id),
            run_id: field(|c| &c.run_id),
            delegation_id: field(|c| &c.delegation_id),
            tenant: field(|c| &c.tenant),
            principal: field(|c| &c.subject),
            profile_id: field(|c| &c.profile_id),
            audience: request.audience.clone(),
            tool: request.tool.clone(),
            action: request.action.clone(),
            resource: request.resource.clone(),
            tool_call_id: request.tool_call_id.clone(),
            allowed: false,
            reason: String::new(),
            detail: String::new(),
            calls_used: 0,
            lease_epoch: claims.map_or(0, |c| c.lease_epoch),
        };
        let record = move |verdict: &Verdict| {
            LogEntry::Authorize(AuthorizeRecord {
                allowed: verdict.allowed,
                reason: verdict.reason.as_str_name().to_owned(),
                detail: verdict.detail.clone(),
                calls_used: verdict.calls_used,
                ..base.clone()
            })
        };

        // A decision is answered only once it is logged: an allow that the log lost would
        // be a tool call nobody can account for.
        let verdict = match &outcome {
            Outcome::Pass(claims) => {
                // The last step: count the call, and log the decision with the count (in
                // one transaction when the log is in the state's database).
                let call = Call {
                    token_id: &claims.token_id,
                    run_id: &claims.run_id,
                    lease_epoch: claims.lease_epoch,
                    max_calls: claims.max_calls,
                    expires_at: claims.expiry().unwrap_or(now),
                    now,
                };
                let max_calls = claims.max_calls;
                let action = effective_action(request, tool).to_owned();
                let resource = request.resource.clone();
                let tool_name = request.tool.clone();
                let verdict_of = Arc::new(move |counted: &Counted| {
                    Verdict::of_count(counted, max_calls, &action, &resource, &tool_name)
                });
                let decide = verdict_of.clone();
                let decision: DecisionOf = Arc::new(move |counted| record(&decide(counted)));
                let counted = self
                    .state
                    .record_call_logged(call, &*self.log, decision)
                    .await?;
                verdict_of(&counted)
            }
            Outcome::Deny {
                claims,
                reason,
                detail,
            } => {
                let calls_used = match claims {
                    Some(c) => self.state.calls_used(&c.token_id).await?,
                    None => 0,
                };
                let verdict = Verdict {
                    allowed: false,
                    reason: *reason,
                    detail: detail.clone(),
                    calls_used,
                };
                self.log.append(record(&verdict)).await?;
                verdict
            }
        };
        let Verdict {
            allowed,
            reason,
            detail,
            calls_used,
        } = verdict;
        tracing::debug!(
            %decision_id,
            allowed,
            reason = reason.as_str_name(),
            tool = %request.tool,
            token_id = claims.map_or("", |c| c.token_id.as_str()),
            "authorization decided"
        );

        let risk_level = tool.map_or(v1::RiskLevel::Unspecified, |t| t.risk.to_proto());
        Ok(v1::AuthorizeResponse {
            allowed,
            reason: reason.into(),
            detail,
            decision_id,
            calls_used,
            risk_level: risk_level.into(),
        })
    }

    async fn decide(
        &self,
        request: &v1::AuthorizeRequest,
        tool: Option<&Tool>,
        data: &DataConstraints,
        now: SystemTime,
    ) -> Result<Outcome, Error> {
        let keys = self.keys.current();
        let claims = match keys.verifier.verify(&request.token, now) {
            Ok(claims) => claims,
            Err(e) => return Ok(Outcome::deny(None, e.reason(), e.to_string())),
        };
        // Who presents a token to Authorize is the worker holding it, for the profile
        // the token names: the audience is bound to that, never taken from the caller.
        // A request naming another audience (the supervisor's, the evidence store's,
        // another profile's worker) is refused.
        let presenter = crate::issue::worker_audience(&claims.profile_id);
        if !request.audience.is_empty() && request.audience != presenter {
            let detail = format!(
                "the token is presented by {presenter}, the worker of the profile it names; \
                 audience `{}` is not who presents it (the audience is bound to the \
                 presenter, not chosen by the request)",
                request.audience
            );
            return Ok(Outcome::deny(
                Some(claims),
                AuthorizeReason::WrongAudience,
                detail,
            ));
        }
        if let Err(e) = claims.check_audience(&presenter) {
            return Ok(Outcome::deny(Some(claims), e.reason(), e.to_string()));
        }
        if !request.tenant.is_empty() && request.tenant != claims.tenant {
            let detail = format!(
                "the resource belongs to tenant `{}` but the token is bound to tenant `{}`; a \
                 task token never crosses tenants",
                request.tenant, claims.tenant
            );
            return Ok(Outcome::deny(
                Some(claims),
                AuthorizeReason::WrongTenant,
                detail,
            ));
        }
        let Some(tool) = tool else {
            let detail = format!(
                "tool `{}` is not in the tool catalog; known tools: {}",
                request.tool,
                list(self.policy.tools.keys())
            );
            return Ok(Outcome::deny(
                Some(claims),
                AuthorizeReason::UnknownTool,
                detail,
            ));
        };
        if !claims.tools.contains(&tool.name) {
            let detail = format!(
                "tool `{}` is not among the token's tools [{}]; ask for a token whose tools \
                 include it",
                tool.name,
                claims.tools.join(", ")
            );
            return Ok(Outcome::deny(
                Some(claims),
                AuthorizeReason::ToolNotGranted,
                detail,
            ));
        }
        match self.policy.profiles.get(&claims.profile_id) {
            None => {
                let detail = format!(
                    "profile `{}` is no longer in the policy file; its tokens may not call tools",
                    claims.profile_id
                );
                return Ok(Outcome::deny(
                    Some(claims),
                    AuthorizeReason::PolicyDenied,
                    detail,
                ));
            }
            Some(profile) => {
                if let Some(rule) = self.policy.denying_rule(profile, tool) {
                    let detail = format!(
                        "runtime rule `{}` denies tools of risk {} and above to profile {}, and \
                         tool `{}` is {}; request an approval for the action instead",
                        rule.name, rule.deny_from, profile.id, tool.name, tool.risk
                    );
                    return Ok(Outcome::deny(
                        Some(claims),
                        AuthorizeReason::PolicyDenied,
                        detail,
                    ));
                }
            }
        }
        let action = effective_action(request, Some(tool));
        if !action_covered(&tool.action, action) {
            let detail = if action.is_empty() {
                format!(
                    "action is empty and tool `{}` performs `{}`, a pattern; name the action \
                     the call performs",
                    tool.name, tool.action
                )
            } else {
                format!(
                    "tool `{}` performs `{}`, which does not cover action `{action}`; use a tool \
                     whose catalog action covers it",
                    tool.name, tool.action
                )
            };
            return Ok(Outcome::deny(
                Some(claims),
                AuthorizeReason::ScopeNotGranted,
                detail,
            ));
        }
        if let Some(template) = &tool.resource
            && !template.matches(&request.resource)
        {
            let detail = format!(
                "tool `{}` touches resources shaped `{template}` (its catalog resource \
                 template), and `{}` is not one; name the resource the call's arguments fill \
                 the template with",
                tool.name, request.resource
            );
            return Ok(Outcome::deny(
                Some(claims),
                AuthorizeReason::ScopeNotGranted,
                detail,
            ));
        }
        let scopes = match claims.permissions() {
            Ok(scopes) => scopes,
            Err(e) => return Ok(Outcome::deny(Some(claims), e.reason(), e.to_string())),
        };
        match scopes.check(action, &request.resource, data) {
            Ok(()) => {}
            Err(Denial::ScopeNotGranted) => {
                let detail = format!(
                    "no scope of the token covers `{action}` on `{}`; the token allows {}",
                    request.resource,
                    describe(&scopes)
                );
                return Ok(Outcome::deny(
                    Some(claims),
                    AuthorizeReason::ScopeNotGranted,
                    detail,
                ));
            }
            Err(Denial::DataScopeExceeded) => {
                let detail = format!(
                    "the token covers `{action}` on `{}` but not the asked data scope ({}); the \
                     token allows {}: narrow the time range or the rows to fit",
                    request.resource,
                    describe_data(data),
                    describe(&scopes)
                );
                return Ok(Outcome::deny(
                    Some(claims),
                    AuthorizeReason::DataScopeExceeded,
                    detail,
                ));
            }
        }
        // Counting the call is the caller's last step, together with logging it.
        Ok(Outcome::Pass(claims))
    }
}

/// The asked action, or the tool's catalog action when none was named and the catalog
/// names exactly one.
fn effective_action<'a>(request: &'a v1::AuthorizeRequest, tool: Option<&'a Tool>) -> &'a str {
    match tool {
        Some(t) if request.action.is_empty() && !t.action.contains('*') => &t.action,
        _ => &request.action,
    }
}

/// Whether the catalog action pattern of a tool covers `action`.
fn action_covered(catalog_action: &str, action: &str) -> bool {
    !action.is_empty() && Pattern::parse(catalog_action).is_ok_and(|p| p.matches(action))
}

/// The request's data scope as constraints (unset: unconstrained).
fn data_constraints(scope: Option<&v1::DataScope>) -> Result<DataConstraints, Error> {
    let Some(scope) = scope else {
        return Ok(DataConstraints::unconstrained());
    };
    let time = match &scope.time_range {
        Some(tr) => time_window_from_proto(tr, "data_scope.time_range")?,
        None => TimeWindow::unbounded(),
    };
    Ok(DataConstraints {
        time,
        max_rows: (scope.max_rows > 0).then_some(scope.max_rows),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn catalog_actions_cover_exact_and_prefix_actions() {
        assert!(action_covered("logs:read", "logs:read"));
        assert!(action_covered("logs:*", "logs:read"));
        assert!(!action_covered("logs:read", "logs:write"));
        assert!(!action_covered("logs:*", ""));
    }

    #[test]
    fn data_scope_is_described_for_the_caller() {
        assert_eq!(
            describe_data(&DataConstraints::unconstrained()),
            "no time range, no row limit"
        );
        let data = data_constraints(Some(&v1::DataScope {
            time_range: Some(v1::TimeRange {
                start: Some(prost_types::Timestamp {
                    seconds: 0,
                    nanos: 0,
                }),
                end: None,
            }),
            max_rows: 10,
        }))
        .unwrap();
        assert_eq!(
            describe_data(&data),
            "time [1970-01-01T00:00:00Z, unbounded), max_rows 10"
        );
        let bad = data_constraints(Some(&v1::DataScope {
            time_range: Some(v1::TimeRange {
                start: Some(prost_types::Timestamp {
                    seconds: 10,
                    nanos: 0,
                }),
                end: Some(prost_types::Timestamp {
                    seconds: 5,
                    nanos: 0,
                }),
            }),
            max_rows: 0,
        }))
        .unwrap_err();
        assert!(bad.to_string().contains("data_scope.time_range"), "{bad}");
    }
}
