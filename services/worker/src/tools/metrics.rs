//! `query_metrics@1`: read one metric series in a time window, with its baseline, the
//! point where it changed, and its level after the change.

use std::path::Path;
use std::time::SystemTime;

use convene_core::permissions::TimeWindow;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use super::{
    PreparedCall, TimeRangeArg, Tool, ToolEnv, ToolError, ToolOutput, file_name_arg, format_time,
    in_window, number, parse_args, parse_time, read_data, resolve_window, round, schema_of,
    to_args,
};
use crate::provider::ToolSpec;

const NAME: &str = "query_metrics@1";
/// Points read at most when the call sets no limit.
const DEFAULT_MAX_ROWS: u64 = 10_000;
/// Points at the start of the window whose median is the baseline.
pub const BASELINE_POINTS: usize = 5;
/// Relative deviation from the baseline that counts as a change (5%).
pub const CHANGE_THRESHOLD: f64 = 0.05;
/// Consecutive deviating points a change needs, so one noisy sample is not a change.
pub const CHANGE_PERSISTENCE: usize = 3;

/// `query_metrics@1`. Resource `metric/<metric>`, action `metrics:read`, data
/// `<data>/metrics/<metric>.json`.
#[derive(Debug, Clone, Copy, Default)]
pub struct QueryMetrics;

/// The arguments of `query_metrics@1`; their schema is what models are shown.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
struct Args {
    /// Metric name, e.g. payment.success_rate.
    metric: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    time_range: Option<TimeRangeArg>,
    /// Points read at most (default 10,000); a read cut short is recorded as degraded
    /// evidence.
    #[serde(default)]
    #[schemars(range(min = 1))]
    max_rows: Option<u64>,
}

#[derive(Debug, Deserialize)]
struct Series {
    #[serde(default)]
    unit: String,
    #[serde(default)]
    interval: String,
    points: Vec<Point>,
}

#[derive(Debug, Deserialize)]
struct Point {
    ts: String,
    value: f64,
}

#[async_trait::async_trait]
impl Tool for QueryMetrics {
    fn name(&self) -> &str {
        NAME
    }

    fn spec(&self) -> ToolSpec {
        ToolSpec {
            name: NAME.to_owned(),
            description: format!(
                "Read a metric series in a time window. Returns its points, the baseline \
                 (median of the first {BASELINE_POINTS} points), the change point (first \
                 point from which {CHANGE_PERSISTENCE} consecutive points deviate more than \
                 5% from the baseline), the median after it, min, max and unit."
            ),
            parameters: schema_of::<Args>(),
        }
    }

    fn prepare(&self, args: &Value, scope: &TimeWindow) -> Result<PreparedCall, ToolError> {
        let mut a: Args = parse_args(NAME, args)?;
        a.metric = file_name_arg(NAME, "metric", &a.metric)?;
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
            action: "metrics:read".to_owned(),
            resource: format!("metric/{}", a.metric),
            window,
            max_rows,
            scheme: "metrics",
            subject: a.metric.clone(),
            source: format!("metrics.{}", a.metric),
            default_kind: "metric_series",
            args: to_args(&a),
        })
    }

    async fn run(&self, call: &PreparedCall, env: &ToolEnv<'_>) -> Result<ToolOutput, ToolError> {
        env.read_blocking(NAME, call, |call, dir| QueryMetrics.read(call, dir))
            .await
    }
}

impl QueryMetrics {
    /// Reads `<data>/metrics/<metric>.json` for a prepared call. Blocking (file I/O).
    ///
    /// # Errors
    ///
    /// A missing or unreadable metric file.
    pub fn read(&self, call: &PreparedCall, data_dir: &Path) -> Result<ToolOutput, ToolError> {
        let a: Args = parse_args(NAME, &call.args)?;
        let path = data_dir.join("metrics").join(format!("{}.json", a.metric));
        let shown = path.display().to_string();
        let series: Series =
            serde_json::from_str(&read_data(&path, "metric")?).map_err(|e| ToolError::BadData {
                path: shown.clone(),
                detail: e.to_string(),
            })?;
        let mut points: Vec<(SystemTime, f64)> = Vec::with_capacity(series.points.len());
        for (i, p) in series.points.iter().enumerate() {
            let ts = parse_time(&p.ts).map_err(|e| ToolError::BadData {
                path: shown.clone(),
                detail: format!("points[{i}].ts {:?}: {e}", p.ts),
            })?;
            if in_window(ts, &call.window) {
                points.push((ts, p.value));
            }
        }
        points.sort_by_key(|(ts, _)| *ts);
        let max_rows =
            usize::try_from(a.max_rows.unwrap_or(DEFAULT_MAX_ROWS)).unwrap_or(usize::MAX);
        let truncated = points.len() > max_rows;
        points.truncate(max_rows);
        Ok(ToolOutput::new(
            summarize(call, &series, &points, truncated),
            truncated,
        ))
    }
}

fn summarize(
    call: &PreparedCall,
    series: &Series,
    points: &[(SystemTime, f64)],
    truncated: bool,
) -> Value {
    let values: Vec<f64> = points.iter().map(|(_, v)| *v).collect();
    let baseline = median(&values[..values.len().min(BASELINE_POINTS)]);
    let change = baseline.and_then(|b| change_point(&values, b));
    let after = change.and_then(|i| median(&values[i..]));
    let ratio = match (baseline, after) {
        (Some(b), Some(a)) if b != 0.0 => Some(round(a / b, 4)),
        _ => None,
    };
    let min = values.iter().copied().reduce(f64::min);
    let max = values.iter().copied().reduce(f64::max);
    let opt = |x: Option<f64>| x.map_or(Value::Null, |x| number(round(x, 4)));
    json!({
        "tool": NAME,
        "query": call.args,
        "metric": call.subject,
        "unit": series.unit,
        "interval": series.interval,
        "window": {
            "start": call.window.start.map(format_time),
            "end": call.window.end.map(format_time),
        },
        "count": points.len(),
        "truncated": truncated,
        "points": points
            .iter()
            .map(|(ts, v)| json!({ "ts": format_time(*ts), "value": number(*v) }))
            .collect::<Vec<_>>(),
        "baseline": opt(baseline),
        "baseline_points": values.len().min(BASELINE_POINTS),
        "change_point_ts": change.map(|i| format_time(points[i].0)),
        "after": opt(after),
        "change_ratio": opt(ratio),
        "min": opt(min),
        "max": opt(max),
    })
}

/// The median of `values` (`None` when empty).
pub fn median(values: &[f64]) -> Option<f64> {
    if values.is_empty() {
        return None;
    }
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let mid = sorted.len() / 2;
    Some(if sorted.len() % 2 == 1 {
        sorted[mid]
    } else {
        f64::midpoint(sorted[mid - 1], sorted[mid])
    })
}

/// Index of the change point of `values` against `baseline`: the first point after the
/// baseline points from which [`CHANGE_PERSISTENCE`] consecutive points (or all that
/// remain, if fewer) deviate by more than [`CHANGE_THRESHOLD`] relative to the baseline.
/// A zero baseline counts any non-zero value as a deviation.
pub fn change_point(values: &[f64], baseline: f64) -> Option<usize> {
    let deviates = |v: f64| {
        if baseline == 0.0 {
            v != 0.0
        } else {
            ((v - baseline) / baseline).abs() > CHANGE_THRESHOLD
        }
    };
    (BASELINE_POINTS..values.len()).find(|&i| {
        let end = (i + CHANGE_PERSISTENCE).min(values.len());
        values[i..end].iter().all(|v| deviates(*v))
    })
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

    fn query(metric: &str) -> Value {
        let call = QueryMetrics
            .prepare(&json!({ "metric": metric }), &scope())
            .unwrap();
        QueryMetrics.read(&call, &data_dir()).unwrap().value
    }

    #[test]
    fn median_of_odd_and_even_lengths() {
        assert_eq!(median(&[]), None);
        assert_eq!(median(&[3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), Some(2.5));
    }

    #[test]
    fn change_point_needs_a_persistent_deviation() {
        let base = [100.0, 101.0, 99.0, 100.0, 100.0];
        // A single spike is noise; the step that lasts is the change.
        let mut v = base.to_vec();
        v.extend([120.0, 100.0, 100.0, 80.0, 81.0, 79.0, 80.0]);
        assert_eq!(change_point(&v, 100.0), Some(8));
        // Deviations of 5% or less are not changes.
        let mut flat = base.to_vec();
        flat.extend([104.9, 95.1, 105.0, 95.0]);
        assert_eq!(change_point(&flat, 100.0), None);
        // Fewer than the persistence left at the end: all of them must deviate.
        let mut late = base.to_vec();
        late.extend([100.0, 150.0, 150.0]);
        assert_eq!(change_point(&late, 100.0), Some(6));
        // The baseline points themselves are never the change.
        assert_eq!(change_point(&[1.0, 50.0, 50.0, 50.0, 50.0], 1.0), None);
        assert_eq!(
            change_point(
                &[0.0; 5]
                    .iter()
                    .copied()
                    .chain([0.0, 2.0])
                    .collect::<Vec<_>>(),
                0.0
            ),
            Some(6)
        );
    }

    #[test]
    fn success_rate_matches_the_series_in_the_file() {
        let text =
            std::fs::read_to_string(data_dir().join("metrics/payment.success_rate.json")).unwrap();
        let file: Value = serde_json::from_str(&text).unwrap();
        let points = file["points"].as_array().unwrap();
        let values: Vec<f64> = points
            .iter()
            .map(|p| p["value"].as_f64().unwrap())
            .collect();
        let baseline = median(&values[..BASELINE_POINTS]).unwrap();
        let cp = change_point(&values, baseline).unwrap();

        let out = query("payment.success_rate");
        assert_eq!(out["count"], json!(points.len()));
        assert_eq!(out["unit"], json!("percent"));
        assert_eq!(out["baseline"], json!(round(baseline, 4)));
        assert_eq!(
            out["change_point_ts"],
            json!(format_time(
                parse_time(points[cp]["ts"].as_str().unwrap()).unwrap()
            ))
        );
        assert_eq!(
            out["after"],
            json!(round(median(&values[cp..]).unwrap(), 4))
        );
        // The incident: the rate fell at 02:02 from about 99.6% to about 93.1%.
        assert_eq!(out["change_point_ts"], json!("2026-07-23T02:02:00.000Z"));
        assert_eq!(round(out["baseline"].as_f64().unwrap(), 1), 99.6);
        assert_eq!(round(out["after"].as_f64().unwrap(), 1), 93.1);
    }

    #[test]
    fn a_steady_series_has_no_change_point() {
        let out = query("payment.requests_per_s");
        assert!(out["change_point_ts"].is_null(), "{out}");
        assert!(out["after"].is_null());
        assert!(out["min"].as_f64().unwrap() <= out["max"].as_f64().unwrap());
    }

    #[test]
    fn resource_and_missing_metric() {
        let call = QueryMetrics
            .prepare(&json!({"metric": "risk.rule_hit_rate.RC-4711"}), &scope())
            .unwrap();
        assert_eq!(call.resource, "metric/risk.rule_hit_rate.RC-4711");
        assert_eq!(call.source, "metrics.risk.rule_hit_rate.RC-4711");
        let call = QueryMetrics
            .prepare(&json!({"metric": "payment.refunds"}), &scope())
            .unwrap();
        let err = QueryMetrics.read(&call, &data_dir()).unwrap_err();
        assert!(err.to_string().contains("payment.refunds.json"), "{err}");
    }
}
