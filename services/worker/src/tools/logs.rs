//! `search_logs@1`: search one service's JSON-lines log in a time window and aggregate
//! what matched.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::SystemTime;

use convene_core::permissions::TimeWindow;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value, json};

use super::{
    PreparedCall, TimeRangeArg, Tool, ToolEnv, ToolError, ToolOutput, file_name_arg, format_time,
    in_window, number, parse_args, parse_time, read_data, resolve_window, round, schema_of,
    to_args,
};
use crate::provider::ToolSpec;

const NAME: &str = "search_logs@1";
/// Rows scanned at most when the call sets no limit.
const DEFAULT_MAX_ROWS: u64 = 10_000;
/// Sample rows returned when the call asks for none.
const DEFAULT_SAMPLES: u32 = 3;
/// Sample rows returned at most.
const MAX_SAMPLES: u32 = 5;
/// The group key of rows that lack the `group_by` field.
const MISSING_GROUP: &str = "(missing)";

/// `search_logs@1`. Resource `service/<service>`, action `logs:read`, data
/// `<data>/logs/<service>.jsonl`.
#[derive(Debug, Clone, Copy, Default)]
pub struct SearchLogs;

/// The arguments of `search_logs@1`; their schema is what models are shown.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
struct Args {
    /// Service whose log to search, e.g. payment-api.
    service: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    time_range: Option<TimeRangeArg>,
    /// Field equalities every matching row satisfies (values compared as text), e.g.
    /// {"error": "POOL_EXHAUSTED"}.
    #[serde(default, rename = "match", skip_serializing_if = "BTreeMap::is_empty")]
    #[schemars(with = "BTreeMap<String, MatchValue>")]
    matches: BTreeMap<String, Value>,
    /// Substring the row's msg must contain.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    text: Option<String>,
    /// Field to count matches by, e.g. outcome.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    group_by: Option<String>,
    /// Sample rows to return (default 3).
    #[serde(default)]
    #[schemars(range(max = MAX_SAMPLES))]
    sample: Option<u32>,
    /// Rows read at most (default 10,000); a read cut short is recorded as degraded
    /// evidence.
    #[serde(default)]
    #[schemars(range(min = 1))]
    max_rows: Option<u64>,
}

/// A value a `match` field is compared with (as text).
#[derive(JsonSchema)]
#[serde(untagged)]
#[allow(dead_code)]
enum MatchValue {
    Text(String),
    Number(f64),
    Flag(bool),
}

#[async_trait::async_trait]
impl Tool for SearchLogs {
    fn name(&self) -> &str {
        NAME
    }

    fn spec(&self) -> ToolSpec {
        ToolSpec {
            name: NAME.to_owned(),
            description: "Search one service's logs in a time window. Rows match when every \
                          `match` field equals its value and `msg` contains `text`. Returns \
                          the number of rows scanned and matched, the first and last match, \
                          counts by level and by the `group_by` field, and a few sample rows."
                .to_owned(),
            parameters: schema_of::<Args>(),
        }
    }

    fn prepare(&self, args: &Value, scope: &TimeWindow) -> Result<PreparedCall, ToolError> {
        let mut a: Args = parse_args(NAME, args)?;
        a.service = file_name_arg(NAME, "service", &a.service)?;
        let (window, normalized) = resolve_window(NAME, a.time_range.as_ref(), scope)?;
        a.time_range = Some(normalized);
        for (field, value) in &mut a.matches {
            *value =
                Value::String(
                    match_text(value).ok_or_else(|| ToolError::InvalidArguments {
                        tool: NAME.into(),
                        detail: format!("match.{field} must be a string, number or boolean"),
                    })?,
                );
        }
        let sample = a.sample.unwrap_or(DEFAULT_SAMPLES);
        if sample > MAX_SAMPLES {
            return Err(ToolError::InvalidArguments {
                tool: NAME.into(),
                detail: format!("sample {sample} exceeds {MAX_SAMPLES}; ask for fewer rows"),
            });
        }
        a.sample = Some(sample);
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
            action: "logs:read".to_owned(),
            resource: format!("service/{}", a.service),
            window,
            max_rows,
            scheme: "logs",
            subject: a.service.clone(),
            source: format!("logs.{}", a.service),
            default_kind: "log_query",
            args: to_args(&a),
        })
    }

    async fn run(&self, call: &PreparedCall, env: &ToolEnv<'_>) -> Result<ToolOutput, ToolError> {
        env.read_blocking(NAME, call, |call, dir| SearchLogs.read(call, dir))
            .await
    }
}

impl SearchLogs {
    /// Reads `<data>/logs/<service>.jsonl` for a prepared call. Blocking (file I/O).
    ///
    /// # Errors
    ///
    /// A missing or unreadable log file.
    pub fn read(&self, call: &PreparedCall, data_dir: &Path) -> Result<ToolOutput, ToolError> {
        let a: Args = parse_args(NAME, &call.args)?;
        let path = data_dir.join("logs").join(format!("{}.jsonl", a.service));
        let text = read_data(&path, "service")?;
        let max_rows = a.max_rows.unwrap_or(DEFAULT_MAX_ROWS);
        let sample = a.sample.unwrap_or(DEFAULT_SAMPLES) as usize;

        let mut agg = Aggregate::default();
        for line in text.lines().filter(|l| !l.trim().is_empty()) {
            let Some((row, ts)) = parse_row(line) else {
                agg.unparsable += 1;
                continue;
            };
            if !in_window(ts, &call.window) {
                continue;
            }
            if agg.scanned == max_rows {
                agg.truncated = true;
                break;
            }
            agg.scanned += 1;
            if matches(&row, &a) {
                agg.add(row, ts, a.group_by.as_deref(), sample);
            }
        }
        let truncated = agg.truncated || agg.unparsable > 0;
        Ok(ToolOutput::new(agg.into_output(call), truncated))
    }
}

/// The text a match value is compared as.
fn match_text(value: &Value) -> Option<String> {
    match value {
        Value::String(s) => Some(s.clone()),
        Value::Number(n) => Some(n.to_string()),
        Value::Bool(b) => Some(b.to_string()),
        _ => None,
    }
}

fn parse_row(line: &str) -> Option<(Map<String, Value>, SystemTime)> {
    let Value::Object(row) = serde_json::from_str::<Value>(line).ok()? else {
        return None;
    };
    let ts = parse_time(row.get("ts")?.as_str()?).ok()?;
    Some((row, ts))
}

fn matches(row: &Map<String, Value>, a: &Args) -> bool {
    let fields = a.matches.iter().all(|(field, want)| {
        row.get(field)
            .and_then(match_text)
            .is_some_and(|have| Some(have.as_str()) == want.as_str())
    });
    let text = a.text.as_deref().is_none_or(|needle| {
        row.get("msg")
            .and_then(Value::as_str)
            .is_some_and(|msg| msg.contains(needle))
    });
    fields && text
}

#[derive(Default)]
struct Aggregate {
    scanned: u64,
    matched: u64,
    unparsable: u64,
    truncated: bool,
    first: Option<SystemTime>,
    last: Option<SystemTime>,
    by_level: BTreeMap<String, u64>,
    groups: BTreeMap<String, u64>,
    samples: Vec<Value>,
}

impl Aggregate {
    fn add(
        &mut self,
        row: Map<String, Value>,
        ts: SystemTime,
        group_by: Option<&str>,
        samples: usize,
    ) {
        self.matched += 1;
        self.first = Some(self.first.map_or(ts, |f| f.min(ts)));
        self.last = Some(self.last.map_or(ts, |l| l.max(ts)));
        let level = row
            .get("level")
            .and_then(Value::as_str)
            .unwrap_or(MISSING_GROUP);
        *self.by_level.entry(level.to_owned()).or_default() += 1;
        if let Some(field) = group_by {
            let key = row
                .get(field)
                .and_then(match_text)
                .unwrap_or_else(|| MISSING_GROUP.to_owned());
            *self.groups.entry(key).or_default() += 1;
        }
        if self.samples.len() < samples {
            self.samples.push(Value::Object(row));
        }
    }

    fn into_output(self, call: &PreparedCall) -> Value {
        #[allow(clippy::cast_precision_loss)] // counts far below 2^52
        let ratio = |n: u64| number(round(n as f64 / self.matched.max(1) as f64, 4));
        let group_ratio: Map<String, Value> = self
            .groups
            .iter()
            .map(|(k, n)| (k.clone(), ratio(*n)))
            .collect();
        json!({
            "tool": NAME,
            "query": call.args,
            "window": {
                "start": call.window.start.map(format_time),
                "end": call.window.end.map(format_time),
            },
            "scanned": self.scanned,
            "matched": self.matched,
            "truncated": self.truncated,
            "unparsable_rows": self.unparsable,
            "first_ts": self.first.map(format_time),
            "last_ts": self.last.map(format_time),
            "by_level": self.by_level,
            "group_by": call.args.get("group_by"),
            "groups": self.groups,
            "group_ratio": group_ratio,
            "samples": self.samples,
        })
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

    /// The example log's rows, parsed independently of the tool.
    fn rows(service: &str) -> Vec<Map<String, Value>> {
        let text =
            std::fs::read_to_string(data_dir().join(format!("logs/{service}.jsonl"))).unwrap();
        text.lines()
            .map(|l| serde_json::from_str::<Map<String, Value>>(l).unwrap())
            .collect()
    }

    fn search(args: Value) -> Value {
        let call = SearchLogs.prepare(&args, &scope()).unwrap();
        SearchLogs.read(&call, &data_dir()).unwrap().value
    }

    #[test]
    fn pool_exhaustion_counts_and_first_occurrence_match_the_file() {
        let expected: Vec<_> = rows("payment-api")
            .into_iter()
            .filter(|r| r.get("error").and_then(Value::as_str) == Some("POOL_EXHAUSTED"))
            .collect();
        assert!(!expected.is_empty());
        let first = expected
            .iter()
            .map(|r| parse_time(r["ts"].as_str().unwrap()).unwrap())
            .min()
            .unwrap();
        let out = search(json!({
            "service": "payment-api",
            "match": { "error": "POOL_EXHAUSTED" },
            "group_by": "pool",
        }));
        assert_eq!(out["matched"], json!(expected.len()));
        assert_eq!(out["first_ts"], json!(format_time(first)));
        assert_eq!(out["groups"]["payments-primary"], json!(expected.len()));
        assert_eq!(out["group_ratio"]["payments-primary"], json!(1.0));
        assert_eq!(out["samples"].as_array().unwrap().len(), 3);
        assert_eq!(out["truncated"], json!(false));
    }

    #[test]
    fn grouping_by_outcome_counts_every_value() {
        let confirms: Vec<_> = rows("payment-api")
            .into_iter()
            .filter(|r| r["event"] == "payment_confirm")
            .collect();
        let timeouts = confirms
            .iter()
            .filter(|r| r["outcome"] == "timeout")
            .count();
        let out = search(json!({
            "service": "payment-api",
            "match": { "event": "payment_confirm" },
            "group_by": "outcome",
            "sample": 0,
        }));
        assert_eq!(out["matched"], json!(confirms.len()));
        assert_eq!(out["groups"]["timeout"], json!(timeouts));
        let sum: u64 = out["groups"]
            .as_object()
            .unwrap()
            .values()
            .map(|v| v.as_u64().unwrap())
            .sum();
        assert_eq!(sum as usize, confirms.len());
        assert!(out["samples"].as_array().unwrap().is_empty());
    }

    #[test]
    fn window_text_and_row_limit_narrow_the_read() {
        let out = search(json!({
            "service": "risk-gateway",
            "text": "flagged by RC-4711",
            "time_range": { "start": "2026-07-23T02:02:00Z" },
        }));
        let start = parse_time("2026-07-23T02:02:00Z").unwrap();
        let end = parse_time("2026-07-23T02:10:00Z").unwrap();
        let expected = rows("risk-gateway")
            .into_iter()
            .filter(|r| {
                let ts = parse_time(r["ts"].as_str().unwrap()).unwrap();
                ts >= start && ts < end && r["msg"].as_str().unwrap().contains("flagged by RC-4711")
            })
            .count();
        assert_eq!(out["matched"], json!(expected));
        assert_eq!(out["window"]["start"], json!("2026-07-23T02:02:00.000Z"));

        let call = SearchLogs
            .prepare(&json!({"service": "payment-api", "max_rows": 10}), &scope())
            .unwrap();
        let limited = SearchLogs.read(&call, &data_dir()).unwrap();
        assert!(limited.truncated);
        assert_eq!(limited.value["scanned"], json!(10));
    }

    #[test]
    fn output_is_deterministic_and_describes_the_call() {
        let args = json!({"service": "payment-api", "match": {"level": "ERROR"}});
        let call = SearchLogs.prepare(&args, &scope()).unwrap();
        assert_eq!(call.resource, "service/payment-api");
        assert_eq!(call.action, "logs:read");
        assert_eq!(call.max_rows, DEFAULT_MAX_ROWS);
        let a = SearchLogs.read(&call, &data_dir()).unwrap();
        let b = SearchLogs.read(&call, &data_dir()).unwrap();
        assert_eq!(a.bytes, b.bytes);
    }

    #[test]
    fn bad_arguments_and_missing_files_say_what_is_wrong() {
        let err = SearchLogs
            .prepare(
                &json!({"service": "payment-api", "colour": "red"}),
                &scope(),
            )
            .unwrap_err();
        assert!(err.to_string().contains("colour"), "{err}");
        let err = SearchLogs
            .prepare(&json!({"service": "payment-api", "sample": 9}), &scope())
            .unwrap_err();
        assert!(err.to_string().contains("sample"), "{err}");
        let call = SearchLogs
            .prepare(&json!({"service": "ledger"}), &scope())
            .unwrap();
        let err = SearchLogs.read(&call, &data_dir()).unwrap_err();
        assert!(matches!(err, ToolError::MissingData { .. }));
        assert!(err.to_string().contains("ledger.jsonl"), "{err}");
    }
}
