//! Tools served by MCP servers ([Model Context Protocol](https://modelcontextprotocol.io)),
//! mounted by a worker from its configuration ([`McpConfig`]) and kept to the same
//! boundaries as the built-in tools.
//!
//! - **Only declared tools.** The policy file's tool catalog declares each MCP tool as
//!   `mcp:<server>/<tool>@<version>` with its action, resource template and risk level.
//!   The worker reads the catalog from the policy service (`Policy.ListTools`,
//!   [`Catalog::fetch`]), so a worker never needs the policy file, and mounts exactly
//!   the declared tools of the servers it is configured with. A tool a server lists
//!   without a catalog entry is never mounted: never offered to a model, never
//!   callable (a call by its name is an unknown tool), whenever the server adds it.
//!   The policy service itself refuses tokens and calls for undeclared tools.
//! - **Offered while listed.** A mounted tool is offered to models while its server's
//!   last listing names it, with the server's `inputSchema` as its parameters and the
//!   catalog's description (the server's when the catalog has none). A
//!   `notifications/tools/list_changed` makes the worker list the tools again.
//! - **Calls go the way of every call.** [`McpTool::prepare`] fills the catalog's
//!   resource template from the call's arguments (see [`ResourceTemplate`]) and asks
//!   for the catalog's action on that resource over the task's window; the agent loop
//!   authorizes it with the policy service; [`McpTool::run`] sends `tools/call`. The
//!   output is `{server, tool, content, structured_content}` (the MCP content blocks and
//!   the structured content, if any), stored as the artifact of an evidence record
//!   `mcp://<server>/<tool>/<run>/<delegation>/<call>`, source `mcp.<server>.<tool>`,
//!   of a kind among the catalog entry's `evidence_kinds` (the first unless the call
//!   names another; any kind, `mcp_result` by default, when the entry declares none).
//! - **A server's failure is the call's, never the task's.** A server that cannot be
//!   started or reached, exits or drops the connection during a call, does not answer
//!   within `call_timeout`, or answers with a JSON-RPC error or a result marked
//!   `isError`, gives a failed tool outcome that says so; the model reads it and goes on.
//!   A lost server is started (stdio) or reached (HTTP) again by the next call; one that
//!   cannot be is tried at most once per [`RECONNECT_PAUSE`].
//! - **Start-up does not wait for servers.** A server that cannot be started or reached
//!   when the worker starts is logged as a warning and the worker serves anyway: its
//!   declared tools stay mounted (so profiles naming them load) but are offered to no
//!   model until the server lists them, and each call of one tries the server again.
//! - **Nothing of the task reaches a server but the call's arguments**: not the task
//!   token, and not the worker's environment (a stdio server gets `PATH`, `HOME` and
//!   the locale, and what its configuration names).
//! - **A bearer token goes to its server alone.** An HTTP server's `bearer_token_env`
//!   token travels in the Authorization header of its requests; should the server quote
//!   it back (in an error, in a tool's result), it is masked where the answer enters the
//!   worker, before the MCP client library logs it, so no log, error, evidence artifact
//!   or model request holds it.

mod config;
mod masked_http;
mod offer;
mod server;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use convene_core::permissions::TimeWindow;
use convene_mesh::auth;
use convene_mesh::handles::PolicyHandle;
use convene_mesh::policy_file::{McpToolName, ResourceTemplate};
use convene_proto::v1;
use serde_json::Value;
use tonic::Code;

pub use config::{
    DEFAULT_CALL_TIMEOUT, DEFAULT_MAX_OUTPUT_BYTES, DEFAULT_START_TIMEOUT, INHERITED_ENV,
    McpConfig, McpServerConfig, Transport,
};
pub use offer::MAX_SPEC_VERSIONS;
pub use server::{McpServer, RECONNECT_PAUSE};

use self::offer::Offer;
use super::{PreparedCall, Tool, ToolEnv, ToolError, ToolOutput};
use crate::provider::ToolSpec;

/// Scheme of MCP tools' evidence ids: `mcp://<server>/<tool>/...`.
pub const EVIDENCE_SCHEME: &str = "mcp";
/// Kind of an MCP call's evidence when the call names none.
pub const DEFAULT_KIND: &str = "mcp_result";
/// How long [`Catalog::fetch`] keeps asking a policy service that cannot be reached.
pub const CATALOG_PATIENCE: Duration = Duration::from_secs(30);

/// Why the MCP tools cannot be mounted.
#[derive(Debug, thiserror::Error)]
pub enum McpError {
    /// The policy service did not give the catalog.
    #[error(
        "cannot read the tool catalog from the policy service ({code:?}: {message}); MCP tools \
         are mounted only as the catalog declares them: check policy_endpoint and the \
         worker-pool credential"
    )]
    Catalog {
        /// The gRPC status code.
        code: Code,
        /// The service's message.
        message: String,
    },
    /// The catalog lists an MCP tool the worker cannot use.
    #[error("the tool catalog lists {name}: {detail}")]
    BadEntry {
        /// The tool.
        name: String,
        /// What is wrong.
        detail: String,
    },
}

/// An MCP tool as the catalog declares it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CatalogEntry {
    /// The catalog name, `mcp:<server>/<tool>@<version>`.
    pub name: String,
    /// The server's configured name.
    pub server: String,
    /// The tool's name on the server.
    pub tool: String,
    /// The action every call performs.
    pub action: String,
    /// How a call's resource is built from its arguments.
    pub resource: ResourceTemplate,
    /// Risk level.
    pub risk: v1::RiskLevel,
    /// What the tool does, as the catalog says.
    pub description: String,
    /// Kinds of evidence its calls may record, the default first; empty: any kind, and
    /// [`DEFAULT_KIND`] by default.
    pub evidence_kinds: Vec<String>,
}

impl CatalogEntry {
    /// The entry of a catalog tool; `Ok(None)` for a tool that is not an MCP tool.
    ///
    /// # Errors
    ///
    /// [`McpError::BadEntry`] for an MCP tool without a usable name, action or template
    /// (a policy service that validated its file never lists one).
    pub fn from_proto(tool: &v1::CatalogTool) -> Result<Option<Self>, McpError> {
        let bad = |detail: String| McpError::BadEntry {
            name: tool.name.clone(),
            detail,
        };
        let Some(parts) = McpToolName::parse(&tool.name).map_err(bad)? else {
            return Ok(None);
        };
        if tool.action.is_empty() || tool.action.ends_with('*') {
            return Err(bad(format!(
                "its action {:?} is not one exact action",
                tool.action
            )));
        }
        let resource = ResourceTemplate::parse(&tool.resource_template)
            .map_err(|m| bad(format!("its resource template: {m}")))?;
        Ok(Some(Self {
            name: tool.name.clone(),
            server: parts.server.to_owned(),
            tool: parts.tool.to_owned(),
            action: tool.action.clone(),
            resource,
            risk: v1::RiskLevel::try_from(tool.risk_level).unwrap_or(v1::RiskLevel::Unspecified),
            description: tool.description.clone(),
            evidence_kinds: tool.evidence_kinds.clone(),
        }))
    }
}

/// The MCP tools the tool catalog declares.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Catalog {
    entries: Vec<CatalogEntry>,
}

impl Catalog {
    /// The MCP tools of a `ListTools` answer.
    ///
    /// # Errors
    ///
    /// An MCP tool the worker cannot use ([`McpError::BadEntry`]).
    pub fn from_response(response: &v1::ListToolsResponse) -> Result<Self, McpError> {
        let mut entries = Vec::new();
        for tool in &response.tools {
            if let Some(entry) = CatalogEntry::from_proto(tool)? {
                entries.push(entry);
            }
        }
        Ok(Self { entries })
    }

    /// Asks the policy service for the catalog's MCP tools, as the principal whose
    /// `credential` is given; a service that cannot be reached yet is asked again for up
    /// to `patience` (services may start in any order).
    ///
    /// # Errors
    ///
    /// [`McpError::Catalog`] when the service refuses or stays unreachable.
    pub async fn fetch(
        policy: &PolicyHandle,
        credential: &str,
        patience: Duration,
    ) -> Result<Self, McpError> {
        let deadline = tokio::time::Instant::now() + patience;
        let mut pause = Duration::from_millis(100);
        loop {
            let request = auth::request(
                v1::ListToolsRequest {
                    name_prefix: convene_mesh::policy_file::MCP_TOOL_PREFIX.to_owned(),
                },
                credential,
            );
            match policy.list_tools(request).await {
                Ok(response) => return Self::from_response(response.get_ref()),
                Err(status)
                    if matches!(status.code(), Code::Unavailable | Code::Unknown)
                        && tokio::time::Instant::now() + pause < deadline =>
                {
                    tracing::info!(error = %status.message(), "the policy service cannot be reached yet; asking for the tool catalog again");
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(Duration::from_secs(2));
                }
                Err(status) => {
                    return Err(McpError::Catalog {
                        code: status.code(),
                        message: status.message().to_owned(),
                    });
                }
            }
        }
    }

    /// The entries, sorted by name.
    pub fn entries(&self) -> &[CatalogEntry] {
        &self.entries
    }
}

/// The MCP servers a worker is configured with and the declared tools they serve.
/// Cloning is cheap: clones share the servers, so the in-process workers of `convene
/// up` share one connection to each server.
#[derive(Debug, Clone, Default)]
pub struct McpTools {
    servers: BTreeMap<String, Arc<McpServer>>,
    tools: Vec<Arc<McpTool>>,
}

impl McpTools {
    /// Mounts the tools `catalog` declares for the servers of `config`, and starts (or
    /// reaches) every server at once. A server that cannot be started or reached is
    /// logged as a warning (see the module docs); mounting itself never fails.
    pub async fn mount(config: &McpConfig, catalog: &Catalog) -> Self {
        let mut servers = BTreeMap::new();
        let mut tools = Vec::new();
        for server_config in &config.servers {
            let offers: Vec<Arc<Offer>> = catalog
                .entries()
                .iter()
                .filter(|e| e.server == server_config.name)
                .map(|e| Arc::new(Offer::new(e.clone())))
                .collect();
            if offers.is_empty() {
                tracing::warn!(
                    server = %server_config.name,
                    "the tool catalog declares no tool of this MCP server \
                     (mcp:{}/<tool>@<version>); nothing of it is mounted",
                    server_config.name
                );
            }
            let server = Arc::new(McpServer::new(server_config.clone(), offers.clone()));
            tools.extend(offers.into_iter().map(|offer| {
                Arc::new(McpTool {
                    offer,
                    server: server.clone(),
                })
            }));
            servers.insert(server_config.name.clone(), server);
        }
        for entry in catalog.entries() {
            if !servers.contains_key(&entry.server) {
                tracing::debug!(
                    tool = %entry.name,
                    "the tool catalog declares a tool of an MCP server this worker is not \
                     configured with"
                );
            }
        }
        futures::future::join_all(servers.values().map(|s| s.start())).await;
        Self { servers, tools }
    }

    /// The mounted tools, one per catalog entry of a configured server, server by server.
    pub fn tools(&self) -> impl Iterator<Item = &Arc<McpTool>> {
        self.tools.iter()
    }

    /// The names of the mounted tools.
    pub fn names(&self) -> Vec<&str> {
        self.tools
            .iter()
            .map(|t| t.offer.entry.name.as_str())
            .collect()
    }

    /// The server configured as `name`.
    pub fn server(&self, name: &str) -> Option<&Arc<McpServer>> {
        self.servers.get(name)
    }

    /// Closes every connection (stdio servers are asked to exit, then killed).
    pub async fn shutdown(&self) {
        futures::future::join_all(self.servers.values().map(|s| s.shutdown())).await;
    }
}

/// A declared tool of an MCP server.
#[derive(Debug)]
pub struct McpTool {
    offer: Arc<Offer>,
    server: Arc<McpServer>,
}

impl McpTool {
    /// The catalog's entry of the tool.
    pub fn entry(&self) -> &CatalogEntry {
        &self.offer.entry
    }

    /// The spec models are offered, or `None` while the server does not list the tool.
    pub fn model_spec(&self) -> Option<&Arc<ToolSpec>> {
        self.offer.model_spec()
    }
}

/// A call argument as the text it fills a resource template with.
fn argument_text(value: &Value) -> Option<String> {
    match value {
        Value::String(s) => Some(s.clone()),
        Value::Number(n) => Some(n.to_string()),
        Value::Bool(b) => Some(b.to_string()),
        _ => None,
    }
}

#[async_trait::async_trait]
impl Tool for McpTool {
    fn name(&self) -> &str {
        &self.offer.entry.name
    }

    fn spec(&self) -> ToolSpec {
        self.offer
            .model_spec()
            .map_or_else(|| self.offer.placeholder(), |s| (**s).clone())
    }

    fn evidence_kinds(&self) -> &[String] {
        &self.offer.entry.evidence_kinds
    }

    fn prepare(&self, args: &Value, scope: &TimeWindow) -> Result<PreparedCall, ToolError> {
        let entry = &self.offer.entry;
        let invalid = |detail: String| ToolError::InvalidArguments {
            tool: entry.name.clone().into(),
            detail,
        };
        let arguments = match args {
            Value::Object(map) => map.clone(),
            Value::Null => serde_json::Map::new(),
            other => {
                return Err(invalid(format!(
                    "the arguments must be a JSON object, not {other}"
                )));
            }
        };
        for name in entry.resource.arguments() {
            if let Some(value) = arguments.get(name)
                && !value.is_null()
                && argument_text(value).is_none()
            {
                return Err(invalid(format!(
                    "argument `{name}` must be a string, number or boolean: it names the \
                     resource the call is authorized on ({})",
                    entry.resource
                )));
            }
        }
        let resource = entry
            .resource
            .fill(|name| arguments.get(name).and_then(argument_text))
            .map_err(|e| invalid(e.to_string()))?;
        Ok(PreparedCall {
            tool: entry.name.clone(),
            action: entry.action.clone(),
            resource,
            // An MCP tool reads what it reads; the call is asked for over the task's
            // window, which the task's token covers.
            window: *scope,
            max_rows: 0,
            scheme: EVIDENCE_SCHEME,
            subject: format!("{}/{}", entry.server, entry.tool),
            source: format!("mcp.{}.{}", entry.server, entry.tool),
            default_kind: DEFAULT_KIND,
            args: Value::Object(arguments),
        })
    }

    async fn run(&self, call: &PreparedCall, _env: &ToolEnv<'_>) -> Result<ToolOutput, ToolError> {
        // Nothing of the environment (the task token in particular) goes to the server.
        self.server.call(&self.offer, &call.args).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lookup() -> v1::CatalogTool {
        v1::CatalogTool {
            name: "mcp:runbooks/lookup_runbook@1".into(),
            action: "runbooks:read".into(),
            resource_template: "runbook/{service}".into(),
            risk_level: v1::RiskLevel::R0.into(),
            description: "The runbook of a service".into(),
            evidence_kinds: vec!["runbook".into()],
        }
    }

    fn tool(entry: CatalogEntry) -> McpTool {
        let offer = Arc::new(Offer::new(entry));
        McpTool {
            server: Arc::new(McpServer::new(
                McpServerConfig::stdio("runbooks", "python3", ["runbooks.py"]),
                vec![offer.clone()],
            )),
            offer,
        }
    }

    #[test]
    fn the_catalog_keeps_mcp_tools_and_refuses_unusable_ones() {
        let builtin = v1::CatalogTool {
            name: "search_logs@1".into(),
            action: "logs:read".into(),
            ..v1::CatalogTool::default()
        };
        let catalog = Catalog::from_response(&v1::ListToolsResponse {
            tools: vec![builtin, lookup()],
        })
        .unwrap();
        let [entry] = catalog.entries() else {
            panic!("one MCP tool: {catalog:?}");
        };
        assert_eq!(
            (entry.server.as_str(), entry.tool.as_str(), entry.risk),
            ("runbooks", "lookup_runbook", v1::RiskLevel::R0)
        );
        assert_eq!(entry.evidence_kinds, ["runbook"]);
        let no_template = v1::CatalogTool {
            resource_template: String::new(),
            ..lookup()
        };
        let err = CatalogEntry::from_proto(&no_template).unwrap_err();
        assert!(err.to_string().contains("resource template"), "{err}");
    }

    #[test]
    fn a_call_asks_for_the_catalog_action_on_the_filled_template() {
        let entry = CatalogEntry::from_proto(&lookup()).unwrap().unwrap();
        let tool = tool(entry);
        let window = TimeWindow::unbounded();
        let call = tool
            .prepare(&serde_json::json!({"service": "payment-api"}), &window)
            .unwrap();
        assert_eq!(call.tool, "mcp:runbooks/lookup_runbook@1");
        assert_eq!(call.action, "runbooks:read");
        assert_eq!(call.resource, "runbook/payment-api");
        assert_eq!(
            (call.scheme, call.subject.as_str(), call.source.as_str()),
            (
                "mcp",
                "runbooks/lookup_runbook",
                "mcp.runbooks.lookup_runbook"
            )
        );
        assert_eq!(call.default_kind, "mcp_result");

        for (args, expected) in [
            (serde_json::json!({}), "`service` is missing"),
            (
                serde_json::json!({"service": {"a": 1}}),
                "string, number or boolean",
            ),
            (serde_json::json!({"service": "../x"}), "`service`"),
            (serde_json::json!(["payment-api"]), "JSON object"),
        ] {
            let err = tool.prepare(&args, &window).unwrap_err().to_string();
            assert!(err.contains(expected), "{args}: {err}");
            assert!(err.contains("mcp:runbooks/lookup_runbook@1"), "{err}");
        }
        // Not listed yet: not offered, but the placeholder names the tool.
        assert!(tool.model_spec().is_none());
        assert_eq!(tool.spec().name, "mcp:runbooks/lookup_runbook@1");
    }
}
