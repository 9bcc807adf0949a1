//! MCP tools in the catalog: ListTools serves the catalog to principals, tokens carry
//! only declared MCP tools, and Authorize holds a call to its tool's resource template.

use crate::support::{Harness, LOGS_WORKER, ONCALL, POOL, policy_yaml, reason, scope};
use convene_mesh::auth::request;
use convene_proto::v1::{self, AuthorizeReason};

const LOOKUP: &str = "mcp:runbooks/lookup_runbook@1";
const UNDECLARED: &str = "mcp:runbooks/delete_runbook@1";

/// The test policy with one declared MCP tool, granted to oncall@acme and the
/// logs-investigator profile.
fn mcp_policy() -> String {
    policy_yaml("")
        .replace(
            "tools: [search_logs@1, query_metrics@1, rollback_rule@1]",
            &format!("tools: [search_logs@1, query_metrics@1, rollback_rule@1, \"{LOOKUP}\"]"),
        )
        .replace(
            "      - { action: \"changes:read\", resource: \"change/*\" }\n",
            "      - { action: \"changes:read\", resource: \"change/*\" }\n      - { action: \"runbooks:read\", resource: \"runbook/*\" }\n",
        )
        .replace(
            "      - { action: \"rules:write\", resource: \"rule/*\" }\n      - { action: \"evidence:*\", resource: \"evidence\" }\n",
            "      - { action: \"rules:write\", resource: \"rule/*\" }\n      - { action: \"runbooks:read\", resource: \"runbook/*\" }\n      - { action: \"evidence:*\", resource: \"evidence\" }\n",
        )
        .replace(
            "tools:\n  - { name: search_logs@1",
            &format!(
                "tools:\n  - {{ name: \"{LOOKUP}\", action: \"runbooks:read\", resource: \
                 \"runbook/{{service}}\", risk: R0, description: The runbook of a service, \
                 evidence_kinds: [runbook, causal_signal] }}\n  \
                 - {{ name: search_logs@1"
            ),
        )
}

/// A lookup_runbook call on `resource` over the task's window, as a worker asks for it.
fn lookup_call(h: &Harness, token: &str, resource: &str) -> v1::AuthorizeRequest {
    v1::AuthorizeRequest {
        token: token.into(),
        tool: LOOKUP.into(),
        action: "runbooks:read".into(),
        resource: resource.into(),
        data_scope: Some(v1::DataScope {
            time_range: Some(h.window()),
            max_rows: 0,
        }),
        audience: LOGS_WORKER.into(),
        tenant: String::new(),
        tool_call_id: "call-mcp".into(),
    }
}

#[tokio::test]
async fn list_tools_serves_the_catalog_to_principals_only() {
    let h = Harness::start_with(&mcp_policy()).await;
    let mut client = h.client().await;
    let mcp = client
        .list_tools(request(
            v1::ListToolsRequest {
                name_prefix: "mcp:".into(),
            },
            POOL,
        ))
        .await
        .expect("any principal may read the catalog")
        .into_inner();
    assert_eq!(
        mcp.tools,
        [v1::CatalogTool {
            name: LOOKUP.into(),
            action: "runbooks:read".into(),
            resource_template: "runbook/{service}".into(),
            risk_level: v1::RiskLevel::R0.into(),
            description: "The runbook of a service".into(),
            // The kinds its calls may record, the default first.
            evidence_kinds: vec!["runbook".into(), "causal_signal".into()],
        }]
    );
    let all = client
        .list_tools(request(v1::ListToolsRequest::default(), ONCALL))
        .await
        .unwrap()
        .into_inner();
    let names: Vec<&str> = all.tools.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "list_changes@1",
            LOOKUP,
            "query_metrics@1",
            "rollback_rule@1",
            "search_logs@1"
        ]
    );
    assert!(
        all.tools
            .iter()
            .filter(|t| t.name != LOOKUP)
            .all(|t| t.resource_template.is_empty())
    );

    let anonymous = client
        .list_tools(v1::ListToolsRequest::default())
        .await
        .unwrap_err();
    assert_eq!(
        anonymous.code(),
        tonic::Code::Unauthenticated,
        "{anonymous}"
    );
}

#[tokio::test]
async fn only_declared_mcp_tools_reach_a_token_and_calls_keep_to_the_template() {
    let h = Harness::start_with(&mcp_policy()).await;
    let mut grant = h.logs_grant("del-mcp");
    grant
        .required_scopes
        .push(scope("runbooks:read", "runbook/*"));
    grant
        .task_scope
        .as_mut()
        .unwrap()
        .resources
        .push("runbook/*".into());
    grant.tools = vec!["search_logs@1".into(), LOOKUP.into(), UNDECLARED.into()];
    let issued = h.issue_one("run-mcp", grant).await;
    assert_eq!(issued.tools, [LOOKUP, "search_logs@1"]);
    assert!(
        issued
            .narrowed
            .iter()
            .any(|n| n.contains(UNDECLARED) && n.contains("not among the tools of profile")),
        "{:?}",
        issued.narrowed
    );

    let allowed = h
        .authorize(lookup_call(&h, &issued.token, "runbook/payment-api"))
        .await;
    assert!(allowed.allowed, "{}", allowed.detail);
    assert_eq!(allowed.risk_level, i32::from(v1::RiskLevel::R0));

    // A resource the template cannot produce is refused, even inside the token's scope.
    let off_template = h
        .authorize(lookup_call(&h, &issued.token, "runbook/payment-api/steps"))
        .await;
    assert!(!off_template.allowed);
    assert_eq!(reason(&off_template), AuthorizeReason::ScopeNotGranted);
    assert!(
        off_template.detail.contains("runbook/{service}"),
        "{}",
        off_template.detail
    );

    // An MCP tool the catalog does not declare is unknown, whatever the call says.
    let mut undeclared = lookup_call(&h, &issued.token, "runbook/payment-api");
    undeclared.tool = UNDECLARED.into();
    let refused = h.authorize(undeclared).await;
    assert!(!refused.allowed);
    assert_eq!(reason(&refused), AuthorizeReason::UnknownTool);
    assert!(refused.detail.contains(UNDECLARED), "{}", refused.detail);

    // Every decision is logged, the denials included.
    let decisions = h.decisions();
    assert_eq!(decisions.len(), 3);
    assert_eq!(decisions.iter().filter(|d| d.allowed).count(), 1);
    assert!(decisions.iter().any(|d| d.tool == UNDECLARED && !d.allowed));
}
