//! The string templating of playbook claims and actions: `{path}` placeholders filled
//! from a tool's output, with filters (`round:N`, `div:X`, `mul:X`, `time`, `hm`,
//! `secs_before:<time>`, `default:<text>`) applied left to right.

use std::time::{SystemTime, UNIX_EPOCH};

use serde_json::Value;

use super::condition::resolve;
use crate::tools::{self, parse_time};

/// A parsed template: literal text and `{path|filter...}` placeholders.
#[derive(Debug, Clone, PartialEq)]
pub struct Template(Vec<Piece>);

#[derive(Debug, Clone, PartialEq)]
enum Piece {
    Text(String),
    Field { path: String, filters: Vec<Filter> },
}

#[derive(Debug, Clone, PartialEq)]
enum Filter {
    Round(usize),
    Div(f64),
    Mul(f64),
    Time,
    HourMinute,
    SecsBefore(SystemTime),
    Default(String),
}

/// A value between filters: JSON until a filter formats it as text.
enum Rendered {
    Json(Value),
    Text(String),
}

impl Template {
    /// Parses `text`.
    ///
    /// # Errors
    ///
    /// Unbalanced braces, an empty path or an unknown filter, named.
    pub fn parse(text: &str) -> Result<Self, String> {
        let mut pieces = Vec::new();
        let mut literal = String::new();
        let mut chars = text.chars().peekable();
        while let Some(c) = chars.next() {
            match c {
                '{' if chars.peek() == Some(&'{') => {
                    chars.next();
                    literal.push('{');
                }
                '}' if chars.peek() == Some(&'}') => {
                    chars.next();
                    literal.push('}');
                }
                '{' => {
                    let mut inner = String::new();
                    loop {
                        match chars.next() {
                            Some('}') => break,
                            Some(c) => inner.push(c),
                            None => {
                                return Err(format!(
                                    "template {text:?} opens `{{` without closing it; write `{{{{` for a literal brace"
                                ));
                            }
                        }
                    }
                    if !literal.is_empty() {
                        pieces.push(Piece::Text(std::mem::take(&mut literal)));
                    }
                    pieces.push(parse_field(&inner)?);
                }
                '}' => {
                    return Err(format!(
                        "template {text:?} closes `}}` without opening it; write `}}}}` for a literal brace"
                    ));
                }
                c => literal.push(c),
            }
        }
        if !literal.is_empty() {
            pieces.push(Piece::Text(literal));
        }
        Ok(Self(pieces))
    }

    /// The path, when the template is exactly one placeholder without filters.
    pub(super) fn whole_path(&self) -> Option<&str> {
        match self.0.as_slice() {
            [Piece::Field { path, filters }] if filters.is_empty() => Some(path),
            _ => None,
        }
    }

    /// Fills the template from `output`.
    ///
    /// # Errors
    ///
    /// A path the output lacks (without `default`), or a filter that does not fit its
    /// value.
    pub fn render(&self, output: &Value) -> Result<String, String> {
        let mut out = String::new();
        for piece in &self.0 {
            match piece {
                Piece::Text(t) => out.push_str(t),
                Piece::Field { path, filters } => {
                    let mut value = resolve(output, path)
                        .filter(|v| !v.is_null())
                        .map(|v| Rendered::Json(v.clone()));
                    for f in filters {
                        value = apply(f, value, path)?;
                    }
                    match value {
                        None => return Err(format!("`{path}` is not in the output")),
                        Some(Rendered::Text(t)) => out.push_str(&t),
                        Some(Rendered::Json(Value::String(s))) => out.push_str(&s),
                        Some(Rendered::Json(Value::Number(n))) => out.push_str(&plain_number(&n)),
                        Some(Rendered::Json(v)) => out.push_str(&v.to_string()),
                    }
                }
            }
        }
        Ok(out)
    }
}

fn parse_field(inner: &str) -> Result<Piece, String> {
    let mut parts = inner.split('|');
    let path = parts.next().unwrap_or_default().trim().to_owned();
    if path.is_empty() {
        return Err(format!("placeholder {{{inner}}} names no path"));
    }
    let filters = parts
        .map(|f| {
            let (name, arg) = match f.split_once(':') {
                Some((n, a)) => (n.trim(), Some(a.trim())),
                None => (f.trim(), None),
            };
            let number = |what: &str| {
                arg.and_then(|a| a.parse::<f64>().ok())
                    .filter(|x| x.is_finite())
                    .ok_or_else(|| format!("filter `{name}` needs a number, e.g. `{name}:{what}`"))
            };
            Ok(match name {
                "round" => Filter::Round(
                    arg.and_then(|a| a.parse::<usize>().ok())
                        .filter(|n| *n <= 12)
                        .ok_or("filter `round` needs a number of decimals 0-12, e.g. `round:1`")?,
                ),
                "div" => {
                    let d = number("1000")?;
                    if d == 0.0 {
                        return Err("filter `div:0` divides by zero".to_owned());
                    }
                    Filter::Div(d)
                }
                "mul" => Filter::Mul(number("100")?),
                "time" => Filter::Time,
                "hm" => Filter::HourMinute,
                "secs_before" => Filter::SecsBefore(
                    arg.and_then(|a| parse_time(a).ok())
                        .ok_or("filter `secs_before` needs an RFC 3339 time, e.g. `secs_before:2026-07-23T02:02:00Z`")?,
                ),
                "default" => Filter::Default(arg.unwrap_or_default().to_owned()),
                other => {
                    return Err(format!(
                        "unknown filter `{other}`; use round, div, mul, time, hm, secs_before or default"
                    ));
                }
            })
        })
        .collect::<Result<Vec<_>, String>>()?;
    Ok(Piece::Field { path, filters })
}

fn apply(filter: &Filter, value: Option<Rendered>, path: &str) -> Result<Option<Rendered>, String> {
    let Some(value) = value else {
        return Ok(match filter {
            Filter::Default(text) => Some(Rendered::Text(text.clone())),
            _ => None,
        });
    };
    let as_number = || match &value {
        Rendered::Json(v) => v
            .as_f64()
            .ok_or_else(|| format!("`{path}` is not a number")),
        Rendered::Text(t) => t
            .parse::<f64>()
            .map_err(|_| format!("`{path}` is not a number")),
    };
    let as_time = || {
        let text = match &value {
            Rendered::Json(Value::String(s)) | Rendered::Text(s) => s.as_str(),
            Rendered::Json(_) => return Err(format!("`{path}` is not a time")),
        };
        parse_time(text).map_err(|e| format!("`{path}` is not an RFC 3339 time ({e})"))
    };
    let number = |x: f64| Rendered::Json(tools::number(x));
    Ok(Some(match filter {
        Filter::Round(n) => Rendered::Text(format!("{:.*}", *n, as_number()?)),
        Filter::Div(d) => number(as_number()? / d),
        Filter::Mul(m) => number(as_number()? * m),
        Filter::Time => Rendered::Text(clock(as_time()?, true)),
        Filter::HourMinute => Rendered::Text(clock(as_time()?, false)),
        Filter::SecsBefore(until) => {
            let t = as_time()?;
            let secs = match until.duration_since(t) {
                Ok(d) => d.as_secs_f64().round(),
                Err(e) => -e.duration().as_secs_f64().round(),
            };
            number(secs)
        }
        Filter::Default(_) => value,
    }))
}

/// A number as people write it: `42`, not `42.0`, for whole floats.
fn plain_number(n: &serde_json::Number) -> String {
    match n.as_f64() {
        // Whole floats within the range where every integer is exact print as integers.
        #[allow(clippy::cast_possible_truncation)]
        Some(x) if n.is_f64() && x.fract() == 0.0 && x.abs() < 9.0e15 => format!("{}", x as i64),
        _ => n.to_string(),
    }
}

/// `HH:MM:SS` (or `HH:MM`) of a UTC time.
fn clock(t: SystemTime, seconds: bool) -> String {
    let secs = t.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs()) % 86_400;
    let (h, m, s) = (secs / 3600, secs / 60 % 60, secs % 60);
    if seconds {
        format!("{h:02}:{m:02}:{s:02}")
    } else {
        format!("{h:02}:{m:02}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::playbook::tests::output;

    #[test]
    fn templates_fill_paths_and_apply_filters() {
        let out = output();
        let r = |t: &str| Template::parse(t).unwrap().render(&out);
        assert_eq!(r("{groups.timeout} of {matched}").unwrap(), "9 of 116");
        assert_eq!(
            r("{baseline|round:0} ms → {after|div:1000|round:1} s").unwrap(),
            "420 ms → 3.8 s"
        );
        assert_eq!(r("from {first_ts|time}").unwrap(), "from 02:01:18");
        assert_eq!(r("at {first_ts|hm}").unwrap(), "at 02:01");
        assert_eq!(
            r("{first_ts|secs_before:2026-07-23T02:02:00Z} s before").unwrap(),
            "42 s before"
        );
        assert_eq!(
            r("{groups.declined|default:0} declined").unwrap(),
            "0 declined"
        );
        assert_eq!(r("{{literal}}").unwrap(), "{literal}");
        assert_eq!(r("{baseline|mul:2}").unwrap(), "839.96");
        let err = r("{groups.declined}").unwrap_err();
        assert!(err.contains("groups.declined"), "{err}");
        let err = r("{changes.0.rule_id|round:1}").unwrap_err();
        assert!(err.contains("not a number"), "{err}");
    }

    #[test]
    fn template_syntax_errors_are_named() {
        assert!(
            Template::parse("{open")
                .unwrap_err()
                .contains("without closing")
        );
        assert!(
            Template::parse("close}")
                .unwrap_err()
                .contains("without opening")
        );
        assert!(Template::parse("{}").unwrap_err().contains("no path"));
        assert!(
            Template::parse("{x|shout}")
                .unwrap_err()
                .contains("unknown filter")
        );
        assert!(
            Template::parse("{x|round:many}")
                .unwrap_err()
                .contains("round")
        );
        assert!(
            Template::parse("{x|secs_before:noon}")
                .unwrap_err()
                .contains("RFC 3339")
        );
    }
}
