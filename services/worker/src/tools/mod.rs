//! The worker's tools: read-only queries over a data directory, `delegate@1`, which
//! asks the supervisor for child delegations, and the tools of MCP servers the worker
//! mounts from its configuration ([`mcp`]), only those the tool catalog declares.
//!
//! A call goes through two stages. [`Tool::prepare`] checks and normalizes the
//! arguments and says what the call touches (action, resource, time window, row limit)
//! before anything is read, so the loop can ask the policy service first.
//! [`Tool::run`] then performs the call — a read of the data directory on the blocking
//! pool, or a call to another service with the task token ([`ToolEnv`]) — and returns
//! the output as canonical JSON bytes.
//!
//! Outputs are deterministic: the same arguments over the same files give the same
//! bytes (sorted keys, no wall-clock time), so a re-executed delegation stores the same
//! artifact and its evidence keeps its hash. `delegate@1`'s output is the children's
//! outcomes, which are as deterministic as the children themselves; an MCP tool's is its
//! server's answer, as deterministic as the server.
//!
//! Every tool's model-facing schema also offers [`EVIDENCE_KIND_ARG`], which names the
//! kind of evidence a call records; the loop takes it off before the tool sees the
//! arguments, and checks it against the kinds the profile (or the tool's catalog entry)
//! declares for the tool, whose first is the default.
//!
//! Data layout under the directory:
//! - `logs/<service>.jsonl`: one JSON object per line with at least `ts` (RFC 3339);
//! - `metrics/<metric>.json`: `{metric, unit, interval, points: [{ts, value}]}`;
//! - `changes/changes.json`: `{changes: [{change_id, ts, kind, service, ...}]}`.

mod changes;
mod delegate;
mod kind;
mod logs;
pub mod mcp;
mod metrics;

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::SystemTime;

use convene_core::permissions::TimeWindow;
use convene_mesh::handles::SupervisorHandle;
use convene_proto::v1;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::Value;

pub use changes::ListChanges;
pub use delegate::Delegate;
pub use kind::EVIDENCE_KIND_ARG;
pub(crate) use kind::{choose_kind, split_kind, with_kind_arg, with_kinds_offered};
pub use logs::SearchLogs;
pub use metrics::{
    BASELINE_POINTS, CHANGE_PERSISTENCE, CHANGE_THRESHOLD, QueryMetrics, change_point, median,
};

use crate::provider::ToolSpec;

/// Why a tool call could not be prepared or run. Each becomes a failed tool outcome
/// the model reads, so the messages say what to change.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ToolError {
    /// The arguments do not fit the tool.
    #[error("invalid arguments for {tool}: {detail}")]
    InvalidArguments {
        /// The tool.
        tool: Cow<'static, str>,
        /// What is wrong.
        detail: String,
    },
    /// The data file the call needs does not exist.
    #[error("data file {path} not found; no data is available for this {what}")]
    MissingData {
        /// The file.
        path: String,
        /// What the file would hold (`service`, `metric`, ...).
        what: &'static str,
    },
    /// The data file exists but cannot be read or parsed.
    #[error("data file {path} is unreadable: {detail}")]
    BadData {
        /// The file.
        path: String,
        /// What is wrong.
        detail: String,
    },
    /// The service the tool calls refused the call; `detail` is its answer, word for
    /// word, so the model reads what to do instead.
    #[error("{tool} was refused by the {service} ({code}): {detail}")]
    Refused {
        /// The tool.
        tool: Cow<'static, str>,
        /// The service that refused.
        service: &'static str,
        /// The gRPC status code, e.g. `FAILED_PRECONDITION`.
        code: String,
        /// The service's message.
        detail: String,
    },
    /// The service the tool calls denied it on permissions (the task's token does not
    /// allow it); like a policy deny, this ends that path of the investigation.
    #[error("{tool} was denied by the {service} ({code}): {detail}")]
    Denied {
        /// The tool.
        tool: Cow<'static, str>,
        /// The service that denied.
        service: &'static str,
        /// The gRPC status code, e.g. `PERMISSION_DENIED`.
        code: String,
        /// The service's message.
        detail: String,
    },
    /// The service the tool needs cannot be reached: a failure of the mesh, not of the
    /// call, so the task ends as a retryable failure.
    #[error("{tool} could not reach the {service}: {detail}")]
    Unavailable {
        /// The tool.
        tool: Cow<'static, str>,
        /// The service.
        service: &'static str,
        /// What went wrong.
        detail: String,
    },
    /// The tool panicked: a bug in the tool.
    #[error("tool {tool} crashed: {detail}")]
    Crashed {
        /// The tool.
        tool: Cow<'static, str>,
        /// The panic, as the runtime reported it.
        detail: String,
    },
    /// The server that serves the tool (an MCP server) could not run the call: it could
    /// not be started or reached, exited or stopped answering during the call, or
    /// answered with an error. A failure of that call alone, which the model reads; the
    /// task goes on.
    #[error("{tool} failed: {detail}")]
    Failed {
        /// The tool.
        tool: Cow<'static, str>,
        /// What happened, naming the server, and what happens next.
        detail: String,
    },
}

/// A prepared call: normalized arguments and what the call touches.
#[derive(Debug, Clone, PartialEq)]
pub struct PreparedCall {
    /// Tool, `name@version`.
    pub tool: String,
    /// Action the call performs, e.g. `logs:read`.
    pub action: String,
    /// Resource it reads, e.g. `service/payment-api`.
    pub resource: String,
    /// Time window it reads.
    pub window: TimeWindow,
    /// Rows it reads at most.
    pub max_rows: u64,
    /// Scheme of its evidence ids, e.g. `logs`.
    pub scheme: &'static str,
    /// Subject of its evidence ids, e.g. `payment-api`.
    pub subject: String,
    /// Data source, e.g. `logs.payment-api`.
    pub source: String,
    /// Evidence kind recorded when the caller names none.
    pub default_kind: &'static str,
    /// Normalized arguments (defaults applied), the input of [`Tool::run`].
    pub args: Value,
}

impl PreparedCall {
    /// `sha256:` of the canonical JSON of (tool, normalized arguments): the same
    /// question gives the same fingerprint, whatever key order or defaults it was asked
    /// with.
    pub fn fingerprint(&self) -> String {
        let query = serde_json::json!({ "tool": self.tool, "args": self.args });
        convene_core::ids::content_hash(canonical_json(&query).as_bytes())
    }

    /// The data scope the call asks the policy service for.
    pub fn data_scope(&self) -> v1::DataScope {
        v1::DataScope {
            time_range: convene_core::permissions::time_window_to_proto(&self.window),
            max_rows: self.max_rows,
        }
    }
}

/// A tool's output.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolOutput {
    /// The output as parsed JSON, for the model.
    pub value: Value,
    /// The output as stored: canonical JSON bytes.
    pub bytes: Vec<u8>,
    /// Whether a limit cut the read short (the evidence is then DEGRADED).
    pub truncated: bool,
}

impl ToolOutput {
    /// The output `value`, serialized canonically.
    pub fn new(value: Value, truncated: bool) -> Self {
        let bytes = canonical_json(&value).into_bytes();
        Self {
            value,
            bytes,
            truncated,
        }
    }
}

/// What a tool may use while it runs, besides its prepared call.
#[derive(Clone, Copy)]
pub struct ToolEnv<'a> {
    /// The directory the read-only tools query.
    pub data_dir: &'a Path,
    /// The task token: the credential of every call a tool makes on the task's behalf.
    pub token: &'a str,
    /// The supervisor, for `delegate@1`; None when the worker was built without one.
    pub supervisor: Option<&'a SupervisorHandle>,
}

impl std::fmt::Debug for ToolEnv<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The token is a credential: never in logs.
        f.debug_struct("ToolEnv")
            .field("data_dir", &self.data_dir)
            .field("supervisor", &self.supervisor.is_some())
            .finish_non_exhaustive()
    }
}

impl ToolEnv<'_> {
    /// Runs `read` (file I/O) over the data directory on the blocking pool, so a large
    /// file never stalls the async threads.
    ///
    /// # Errors
    ///
    /// What `read` returns, or [`ToolError::Crashed`] when it panics.
    pub async fn read_blocking(
        &self,
        tool: &'static str,
        call: &PreparedCall,
        read: fn(&PreparedCall, &Path) -> Result<ToolOutput, ToolError>,
    ) -> Result<ToolOutput, ToolError> {
        let call = call.clone();
        let dir = self.data_dir.to_owned();
        tokio::task::spawn_blocking(move || read(&call, &dir))
            .await
            .unwrap_or_else(|e| {
                Err(ToolError::Crashed {
                    tool: tool.into(),
                    detail: e.to_string(),
                })
            })
    }
}

/// A tool the agent loop can call.
#[async_trait::async_trait]
pub trait Tool: Send + Sync + std::fmt::Debug {
    /// `name@version`.
    fn name(&self) -> &str;

    /// What the model is told about the tool.
    fn spec(&self) -> ToolSpec;

    /// The kinds of evidence a call may record as its tool declares them (an MCP tool's
    /// catalog entry), the default first; empty, as for the built-in tools, when any
    /// kind may be named and [`PreparedCall::default_kind`] is the default. A profile's
    /// own declaration for the tool takes precedence.
    fn evidence_kinds(&self) -> &[String] {
        &[]
    }

    /// Checks and normalizes `args`; `scope` is the task's time window, the default
    /// window of the call.
    ///
    /// # Errors
    ///
    /// [`ToolError::InvalidArguments`] naming the argument.
    fn prepare(&self, args: &Value, scope: &TimeWindow) -> Result<PreparedCall, ToolError>;

    /// Runs a call prepared by [`prepare`](Self::prepare), after the policy service
    /// allowed it.
    ///
    /// # Errors
    ///
    /// A missing or unreadable data file, or a refusal of the service the tool calls.
    async fn run(&self, call: &PreparedCall, env: &ToolEnv<'_>) -> Result<ToolOutput, ToolError>;
}

/// The tools a worker has: the built-in ones over one data directory, and the MCP tools
/// it mounted ([`with_mcp`](Self::with_mcp)).
#[derive(Debug, Clone)]
pub struct ToolRegistry {
    tools: BTreeMap<String, Arc<dyn Tool>>,
    /// Each built-in tool's spec as models see it, built once.
    specs: BTreeMap<String, Arc<ToolSpec>>,
    /// The mounted MCP tools, whose specs follow their servers' listings.
    mcp: BTreeMap<String, Arc<mcp::McpTool>>,
    data_dir: PathBuf,
}

impl ToolRegistry {
    /// The built-in tools over `data_dir`: the read-only `search_logs@1`,
    /// `query_metrics@1` and `list_changes@1`, and `delegate@1` (which needs the worker
    /// to have a supervisor).
    pub fn builtin(data_dir: impl Into<PathBuf>) -> Self {
        let tools: [Arc<dyn Tool>; 4] = [
            Arc::new(SearchLogs),
            Arc::new(QueryMetrics),
            Arc::new(ListChanges),
            Arc::new(Delegate),
        ];
        Self {
            specs: tools
                .iter()
                .map(|t| (t.name().to_owned(), Arc::new(with_kind_arg(t.spec()))))
                .collect(),
            tools: tools
                .into_iter()
                .map(|t| (t.name().to_owned(), t))
                .collect(),
            mcp: BTreeMap::new(),
            data_dir: data_dir.into(),
        }
    }

    /// The same tools and the MCP tools `mcp` mounted: the tools the catalog declares
    /// for its servers, by their catalog names (`mcp:<server>/<tool>@<version>`).
    #[must_use]
    pub fn with_mcp(mut self, mcp: &mcp::McpTools) -> Self {
        for tool in mcp.tools() {
            let name = tool.name().to_owned();
            self.tools
                .insert(name.clone(), Arc::clone(tool) as Arc<dyn Tool>);
            self.mcp.insert(name, Arc::clone(tool));
        }
        self
    }

    /// The spec of the tool called `name` as models are shown it: the tool's own, with
    /// the [`EVIDENCE_KIND_ARG`] argument added. `None` for an unknown tool, and for an
    /// MCP tool its server does not list (or has not listed yet): such a tool is not
    /// offered.
    pub fn model_spec(&self, name: &str) -> Option<&Arc<ToolSpec>> {
        self.specs
            .get(name)
            .or_else(|| self.mcp.get(name).and_then(|t| t.model_spec()))
    }

    /// The tool called `name` (`name@version`).
    pub fn get(&self, name: &str) -> Option<&Arc<dyn Tool>> {
        self.tools.get(name)
    }

    /// The names of every tool, sorted.
    pub fn names(&self) -> Vec<&str> {
        self.tools.keys().map(String::as_str).collect()
    }

    /// The directory the tools read.
    pub fn data_dir(&self) -> &Path {
        &self.data_dir
    }
}

// ---------------------------------------------------------------------------------------
// Helpers shared by the tools.

/// JSON with object keys sorted at every level and no insignificant whitespace.
pub fn canonical_json(value: &Value) -> String {
    // Keys and scalars are written by serde_json itself, straight into the buffer (no
    // string per key or number); writing into a Vec cannot fail.
    fn write(value: &Value, out: &mut Vec<u8>) {
        match value {
            Value::Object(map) => {
                out.push(b'{');
                let mut entries: Vec<(&String, &Value)> = map.iter().collect();
                entries.sort_unstable_by(|a, b| a.0.cmp(b.0));
                for (i, (k, v)) in entries.into_iter().enumerate() {
                    if i > 0 {
                        out.push(b',');
                    }
                    let _ = serde_json::to_writer(&mut *out, k);
                    out.push(b':');
                    write(v, out);
                }
                out.push(b'}');
            }
            Value::Array(items) => {
                out.push(b'[');
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        out.push(b',');
                    }
                    write(item, out);
                }
                out.push(b']');
            }
            scalar => {
                let _ = serde_json::to_writer(&mut *out, scalar);
            }
        }
    }
    let mut out = Vec::with_capacity(256);
    write(value, &mut out);
    // serde_json writes UTF-8, and so does everything pushed above.
    String::from_utf8(out).unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into_owned())
}

/// Window to read, RFC 3339 UTC bounds [start, end); a bound left out is the task's.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct TimeRangeArg {
    /// Inclusive start, RFC 3339.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("format" = "date-time"))]
    pub start: Option<String>,
    /// Exclusive end, RFC 3339.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("format" = "date-time"))]
    pub end: Option<String>,
}

/// The JSON schema models are shown for arguments of type `T`, generated from the type
/// that parses them (so the two cannot disagree): subschemas inlined, no `$schema` or
/// `title`, `description`s from the doc comments.
pub fn schema_of<T: JsonSchema>() -> Value {
    let schema = schemars::generate::SchemaSettings::default()
        .with(|s| s.inline_subschemas = true)
        .into_generator()
        .into_root_schema_for::<T>();
    let mut value = schema.to_value();
    if let Value::Object(map) = &mut value {
        for meta in ["$schema", "title", "$defs"] {
            map.remove(meta);
        }
    }
    value
}

/// Resolves a call's window: the given bounds, or the task's where one is left out.
/// Bounds are normalized to RFC 3339 with milliseconds.
pub(crate) fn resolve_window(
    tool: &'static str,
    arg: Option<&TimeRangeArg>,
    scope: &TimeWindow,
) -> Result<(TimeWindow, TimeRangeArg), ToolError> {
    let parse = |s: &Option<String>, which: &str| {
        s.as_deref()
            .map(|s| {
                parse_time(s).map_err(|e| ToolError::InvalidArguments {
                    tool: tool.into(),
                    detail: format!("time_range.{which} {s:?} is not an RFC 3339 time ({e})"),
                })
            })
            .transpose()
    };
    let given = arg.cloned().unwrap_or_default();
    let window = TimeWindow {
        start: parse(&given.start, "start")?.or(scope.start),
        end: parse(&given.end, "end")?.or(scope.end),
    };
    if window.is_empty() {
        return Err(ToolError::InvalidArguments {
            tool: tool.into(),
            detail: "time_range.start must lie before time_range.end".into(),
        });
    }
    let normalized = TimeRangeArg {
        start: window.start.map(format_time),
        end: window.end.map(format_time),
    };
    Ok((window, normalized))
}

/// Whether `t` lies in `window`.
pub(crate) fn in_window(t: SystemTime, window: &TimeWindow) -> bool {
    window.start.is_none_or(|s| t >= s) && window.end.is_none_or(|e| t < e)
}

/// Parses an RFC 3339 time in UTC (`Z`), with any fraction of a second.
pub fn parse_time(s: &str) -> Result<SystemTime, humantime::TimestampError> {
    humantime::parse_rfc3339(s)
}

/// Formats a time as RFC 3339 UTC with milliseconds, the form the data uses.
pub fn format_time(t: SystemTime) -> String {
    humantime::format_rfc3339_millis(t).to_string()
}

/// Checks a name that becomes part of a file path (a service or metric): letters,
/// digits, `.`, `_` and `-`, not starting with `.`, so it cannot leave its directory.
pub(crate) fn file_name_arg(
    tool: &'static str,
    arg: &str,
    value: &str,
) -> Result<String, ToolError> {
    let ok = !value.is_empty()
        && value.len() <= 200
        && !value.starts_with('.')
        && value
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'));
    if ok {
        Ok(value.to_owned())
    } else {
        Err(ToolError::InvalidArguments {
            tool: tool.into(),
            detail: format!(
                "{arg} {value:?} must be 1-200 letters, digits, `.`, `_` or `-`, not \
                 starting with `.`"
            ),
        })
    }
}

/// Parses a tool's arguments, naming the tool in the error.
pub(crate) fn parse_args<T: serde::de::DeserializeOwned>(
    tool: &'static str,
    args: &Value,
) -> Result<T, ToolError> {
    let args = if args.is_null() {
        Value::Object(serde_json::Map::new())
    } else {
        args.clone()
    };
    serde_json::from_value(args).map_err(|e| ToolError::InvalidArguments {
        tool: tool.into(),
        detail: e.to_string(),
    })
}

/// Serializes normalized arguments (infallible for the plain structs the tools use).
pub(crate) fn to_args<T: Serialize>(args: &T) -> Value {
    serde_json::to_value(args).unwrap_or(Value::Null)
}

/// Reads a data file, telling a missing file apart from an unreadable one.
pub(crate) fn read_data(path: &Path, what: &'static str) -> Result<String, ToolError> {
    std::fs::read_to_string(path).map_err(|e| {
        if e.kind() == std::io::ErrorKind::NotFound {
            ToolError::MissingData {
                path: path.display().to_string(),
                what,
            }
        } else {
            ToolError::BadData {
                path: path.display().to_string(),
                detail: e.to_string(),
            }
        }
    })
}

/// Rounds to `decimals` places, so outputs carry no floating-point noise.
pub(crate) fn round(x: f64, decimals: i32) -> f64 {
    let factor = 10f64.powi(decimals);
    (x * factor).round() / factor
}

/// A JSON number, or null for a non-finite value (JSON has none).
pub(crate) fn number(x: f64) -> Value {
    serde_json::Number::from_f64(x).map_or(Value::Null, Value::Number)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tool_schemas_come_from_the_types_that_parse_the_arguments() {
        let tools = ToolRegistry::builtin(std::env::temp_dir());
        let window = TimeWindow::default();
        for (name, required, example) in [
            (
                "search_logs@1",
                vec!["service"],
                serde_json::json!({"service": "payment-api", "match": {"error": "X"}, "sample": 2}),
            ),
            (
                "query_metrics@1",
                vec!["metric"],
                serde_json::json!({"metric": "payment.success_rate", "max_rows": 10}),
            ),
            (
                "list_changes@1",
                vec![],
                serde_json::json!({"kind": "risk_rule"}),
            ),
        ] {
            let tool = tools.get(name).unwrap();
            let schema = tool.spec().parameters;
            assert_eq!(schema["type"], "object", "{name}: {schema}");
            assert_eq!(schema["additionalProperties"], false, "{name}: {schema}");
            let listed: Vec<&str> = schema["required"]
                .as_array()
                .map(|r| r.iter().filter_map(Value::as_str).collect())
                .unwrap_or_default();
            assert_eq!(listed, required, "{name}");
            let time_range = &schema["properties"]["time_range"];
            assert!(time_range.to_string().contains("date-time"), "{time_range}");
            // What the schema describes parses; a property it does not list is refused.
            tool.prepare(&example, &window).unwrap();
            let mut extra = example.clone();
            extra["not_in_the_schema"] = serde_json::json!(1);
            assert!(schema["properties"].get("not_in_the_schema").is_none());
            assert!(tool.prepare(&extra, &window).is_err(), "{name}");
        }
        let logs = tools.get("search_logs@1").unwrap().spec().parameters;
        assert_eq!(logs["properties"]["sample"]["maximum"], 5, "{logs}");
        assert!(
            logs["properties"]["service"]["description"]
                .as_str()
                .unwrap()
                .contains("payment-api")
        );
    }

    #[test]
    fn canonical_json_sorts_keys_at_every_level() {
        let a: Value =
            serde_json::from_str(r#"{"b":1,"a":{"d":[1,{"z":0,"y":"x"}],"c":null}}"#).unwrap();
        assert_eq!(
            canonical_json(&a),
            r#"{"a":{"c":null,"d":[1,{"y":"x","z":0}]},"b":1}"#
        );
        // Escapes, non-ASCII text and numbers come out exactly as serde_json writes them.
        let b: Value = serde_json::from_str(
            r#"{"q\"uote":"tab\tnew\nline","é":"ü€","n":[-1.5,1e300,18446744073709551615,true]}"#,
        )
        .unwrap();
        assert_eq!(
            canonical_json(&b),
            r#"{"n":[-1.5,1e+300,18446744073709551615,true],"q\"uote":"tab\tnew\nline","é":"ü€"}"#
        );
        for scalar in b["n"].as_array().unwrap() {
            assert_eq!(canonical_json(scalar), scalar.to_string());
        }
    }

    #[test]
    fn windows_default_to_the_task_and_normalize() {
        let scope = TimeWindow {
            start: Some(parse_time("2026-07-23T01:45:00Z").unwrap()),
            end: Some(parse_time("2026-07-23T02:10:00Z").unwrap()),
        };
        let (w, n) = resolve_window("t@1", None, &scope).unwrap();
        assert_eq!(w, scope);
        assert_eq!(n.start.as_deref(), Some("2026-07-23T01:45:00.000Z"));
        let arg = TimeRangeArg {
            start: Some("2026-07-23T02:00:00Z".into()),
            end: None,
        };
        let (w, n) = resolve_window("t@1", Some(&arg), &scope).unwrap();
        assert_eq!(w.start, Some(parse_time("2026-07-23T02:00:00Z").unwrap()));
        assert_eq!(w.end, scope.end);
        assert_eq!(n.end.as_deref(), Some("2026-07-23T02:10:00.000Z"));
        let bad = TimeRangeArg {
            start: Some("yesterday".into()),
            end: None,
        };
        let err = resolve_window("t@1", Some(&bad), &scope).unwrap_err();
        assert!(err.to_string().contains("time_range.start"), "{err}");
        let inverted = TimeRangeArg {
            start: Some("2026-07-23T02:10:00Z".into()),
            end: Some("2026-07-23T02:00:00Z".into()),
        };
        assert!(resolve_window("t@1", Some(&inverted), &scope).is_err());
    }

    #[test]
    fn file_names_cannot_leave_their_directory() {
        assert!(file_name_arg("t@1", "service", "payment-api").is_ok());
        assert!(file_name_arg("t@1", "metric", "risk.rule_hit_rate.RC-4711").is_ok());
        for bad in ["", "../etc/passwd", ".hidden", "a/b", "a b"] {
            let err = file_name_arg("t@1", "service", bad).unwrap_err();
            assert!(err.to_string().contains("service"), "{err}");
        }
    }

    #[test]
    fn fingerprints_ignore_key_order() {
        let call = |args: Value| PreparedCall {
            tool: "t@1".into(),
            action: "a:read".into(),
            resource: "r".into(),
            window: TimeWindow::unbounded(),
            max_rows: 1,
            scheme: "s",
            subject: "x".into(),
            source: "s.x".into(),
            default_kind: "k",
            args,
        };
        let a = call(serde_json::json!({"x": 1, "y": [1, 2]}));
        let b = call(serde_json::from_str(r#"{"y":[1,2],"x":1}"#).unwrap());
        assert_eq!(a.fingerprint(), b.fingerprint());
        assert!(a.fingerprint().starts_with("sha256:"));
        let c = call(serde_json::json!({"x": 2, "y": [1, 2]}));
        assert_ne!(a.fingerprint(), c.fingerprint());
    }
}
