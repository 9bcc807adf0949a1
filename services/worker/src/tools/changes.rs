//! `list_changes@1`: list deployments, configuration and rule changes in a time window.

use std::path::Path;
use std::time::SystemTime;

use convene_core::permissions::TimeWindow;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value, json};

use super::{
    PreparedCall, TimeRangeArg, Tool, ToolEnv, ToolError, ToolOutput, format_time, in_window,
    parse_args, parse_time, read_data, resolve_window, schema_of, to_args,
};
use crate::provider::ToolSpec;

const NAME: &str = "list_changes@1";
/// Changes returned at most when the call sets no limit.
const DEFAULT_MAX_ROWS: u64 = 1_000;

/// `list_changes@1`. Resource `change/log`, action `changes:read`, data
/// `<data>/changes/changes.json`.
#[derive(Debug, Clone, Copy, Default)]
pub struct ListChanges;

/// The arguments of `list_changes@1`; their schema is what models are shown.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
struct Args {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    time_range: Option<TimeRangeArg>,
    /// Only changes of this kind, e.g. risk_rule, deployment, config.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    kind: Option<String>,
    /// Only changes to this service.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    service: Option<String>,
    /// Changes read at most (default 1,000); a read cut short is recorded as degraded
    /// evidence.
    #[serde(default)]
    #[schemars(range(min = 1))]
    max_rows: Option<u64>,
}

#[derive(Debug, Deserialize)]
struct ChangeLog {
    changes: Vec<Map<String, Value>>,
}

#[async_trait::async_trait]
impl Tool for ListChanges {
    fn name(&self) -> &str {
        NAME
    }

    fn spec(&self) -> ToolSpec {
        ToolSpec {
            name: NAME.to_owned(),
            description: "List the changes (deployments, configuration, risk rules) made in \
                          a time window, oldest first, optionally only of one kind or to one \
                          service. Each change has its id, time, kind, service, summary and \
                          owner; rule changes also name the rule, its versions and how to \
                          roll it back."
                .to_owned(),
            parameters: schema_of::<Args>(),
        }
    }

    fn prepare(&self, args: &Value, scope: &TimeWindow) -> Result<PreparedCall, ToolError> {
        let mut a: Args = parse_args(NAME, args)?;
        let (window, normalized) = resolve_window(NAME, a.time_range.as_ref(), scope)?;
        a.time_range = Some(normalized);
        let max_rows = a.max_rows.unwrap_or(DEFAULT_MAX_ROWS);
        if max_rows == 0 {
            return Err(ToolError::InvalidArguments {
                tool: NAME.into(),
                detail: "max_rows must be at least 1".into(),
            });
        }
        a.max_rows = Some(max_rows);
        Ok(PreparedCall {
            tool: NAME.to_owned(),
            action: "changes:read".to_owned(),
            resource: "change/log".to_owned(),
            window,
            max_rows,
            scheme: "changes",
            subject: "log".to_owned(),
            source: "changes.log".to_owned(),
            default_kind: "change_record",
            args: to_args(&a),
        })
    }

    async fn run(&self, call: &PreparedCall, env: &ToolEnv<'_>) -> Result<ToolOutput, ToolError> {
        env.read_blocking(NAME, call, |call, dir| ListChanges.read(call, dir))
            .await
    }
}

impl ListChanges {
    /// Reads `<data>/changes/changes.json` for a prepared call. Blocking (file I/O).
    ///
    /// # Errors
    ///
    /// A missing or unreadable changes file.
    pub fn read(&self, call: &PreparedCall, data_dir: &Path) -> Result<ToolOutput, ToolError> {
        let a: Args = parse_args(NAME, &call.args)?;
        let path = data_dir.join("changes").join("changes.json");
        let shown = path.display().to_string();
        let log: ChangeLog =
            serde_json::from_str(&read_data(&path, "change log")?).map_err(|e| {
                ToolError::BadData {
                    path: shown.clone(),
                    detail: e.to_string(),
                }
            })?;
        let field =
            |c: &Map<String, Value>, k: &str| c.get(k).and_then(Value::as_str).map(str::to_owned);
        let mut selected: Vec<(SystemTime, Map<String, Value>)> = Vec::new();
        for (i, change) in log.changes.into_iter().enumerate() {
            let ts = field(&change, "ts")
                .and_then(|ts| parse_time(&ts).ok())
                .ok_or_else(|| ToolError::BadData {
                    path: shown.clone(),
                    detail: format!("changes[{i}].ts is missing or not an RFC 3339 time"),
                })?;
            let kind_ok = a.kind.is_none() || field(&change, "kind") == a.kind;
            let service_ok = a.service.is_none() || field(&change, "service") == a.service;
            if in_window(ts, &call.window) && kind_ok && service_ok {
                selected.push((ts, change));
            }
        }
        // Oldest first; the change id breaks ties so the order never depends on the file.
        selected.sort_by(|(ta, a), (tb, b)| {
            ta.cmp(tb)
                .then_with(|| field(a, "change_id").cmp(&field(b, "change_id")))
        });
        let max_rows =
            usize::try_from(a.max_rows.unwrap_or(DEFAULT_MAX_ROWS)).unwrap_or(usize::MAX);
        let truncated = selected.len() > max_rows;
        selected.truncate(max_rows);
        let output = json!({
            "tool": NAME,
            "query": call.args,
            "window": {
                "start": call.window.start.map(format_time),
                "end": call.window.end.map(format_time),
            },
            "count": selected.len(),
            "truncated": truncated,
            "changes": selected.into_iter().map(|(_, c)| Value::Object(c)).collect::<Vec<_>>(),
        });
        Ok(ToolOutput::new(output, truncated))
    }
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::*;

    fn data_dir() -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../examples/payment-incident/data")
    }

    fn scope() -> TimeWindow {
        TimeWindow {
            start: Some(parse_time("2026-07-23T01:45:00Z").unwrap()),
            end: Some(parse_time("2026-07-23T02:10:00Z").unwrap()),
        }
    }

    fn file_changes() -> Vec<Map<String, Value>> {
        let text = std::fs::read_to_string(data_dir().join("changes/changes.json")).unwrap();
        serde_json::from_str::<ChangeLog>(&text).unwrap().changes
    }

    fn list(args: Value) -> Value {
        let call = ListChanges.prepare(&args, &scope()).unwrap();
        ListChanges.read(&call, &data_dir()).unwrap().value
    }

    #[test]
    fn only_changes_in_the_window_are_listed() {
        let (start, end) = (scope().start.unwrap(), scope().end.unwrap());
        let expected: Vec<String> = file_changes()
            .iter()
            .filter(|c| {
                let ts = parse_time(c["ts"].as_str().unwrap()).unwrap();
                ts >= start && ts < end
            })
            .map(|c| c["change_id"].as_str().unwrap().to_owned())
            .collect();
        let out = list(json!({}));
        let got: Vec<&str> = out["changes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["change_id"].as_str().unwrap())
            .collect();
        assert_eq!(got, expected);
        assert_eq!(out["count"], json!(expected.len()));
        // The example's one change in the window is the risk-rule change.
        assert_eq!(out["changes"][0]["rule_id"], json!("RC-4711"));
    }

    #[test]
    fn kind_and_service_filter() {
        let wide = json!({"start": "2026-07-23T00:00:00Z", "end": "2026-07-23T03:00:00Z"});
        let all = list(json!({ "time_range": wide }));
        assert_eq!(all["count"], json!(file_changes().len()));
        let rules = list(json!({ "time_range": wide, "kind": "risk_rule" }));
        let expected = file_changes()
            .iter()
            .filter(|c| c["kind"] == "risk_rule")
            .count();
        assert_eq!(rules["count"], json!(expected));
        let payments = list(json!({ "time_range": wide, "service": "payment-api" }));
        assert!(
            payments["changes"]
                .as_array()
                .unwrap()
                .iter()
                .all(|c| c["service"] == "payment-api")
        );
        let none = list(json!({ "kind": "deployment" }));
        assert_eq!(none["count"], json!(0));
    }

    #[test]
    fn missing_change_log_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let call = ListChanges.prepare(&json!({}), &scope()).unwrap();
        let err = ListChanges.read(&call, dir.path()).unwrap_err();
        assert!(err.to_string().contains("changes.json"), "{err}");
        assert_eq!(call.resource, "change/log");
    }
}
