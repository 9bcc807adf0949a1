//! MCP tools in the catalog: their names, `mcp:<server>/<tool>@<version>`
//! ([`McpToolName`]), and the [`ResourceTemplate`] that builds each call's resource from
//! its arguments.

/// The prefix of every MCP tool's catalog name.
pub const MCP_TOOL_PREFIX: &str = "mcp:";

/// The parts of an MCP tool's catalog name, `mcp:<server>/<tool>@<version>`.
///
/// `<server>` is the name a worker's MCP configuration gives the server (see
/// [`check_mcp_server_name`]); `<tool>` is the name the server lists, 1 to 128 letters,
/// digits, `_`, `-`, `.` or `/` (the MCP tool-name characters); `<version>` is the
/// catalog's own version of the tool (MCP tools have none), so a changed tool can be
/// declared anew.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct McpToolName<'a> {
    /// The server's configured name, e.g. `runbooks`.
    pub server: &'a str,
    /// The tool's name on the server, e.g. `lookup_runbook`.
    pub tool: &'a str,
    /// The catalog's version, e.g. `1`.
    pub version: &'a str,
}

impl<'a> McpToolName<'a> {
    /// `Ok(None)` for a name that is not an MCP tool's (no `mcp:` prefix), the parts of
    /// one that is.
    ///
    /// # Errors
    ///
    /// A name with the `mcp:` prefix but not the form `mcp:<server>/<tool>@<version>`,
    /// saying which part is wrong.
    pub fn parse(name: &'a str) -> Result<Option<Self>, String> {
        let Some(rest) = name.strip_prefix(MCP_TOOL_PREFIX) else {
            return Ok(None);
        };
        let form = "must look like mcp:<server>/<tool>@<version>, e.g. \
                    mcp:runbooks/lookup_runbook@1";
        let (server, rest) = rest
            .split_once('/')
            .ok_or_else(|| format!("{name:?} {form}"))?;
        let (tool, version) = rest
            .rsplit_once('@')
            .ok_or_else(|| format!("{name:?} {form}"))?;
        check_mcp_server_name(server).map_err(|m| format!("{name:?}: server {m}"))?;
        let tool_ok = !tool.is_empty()
            && tool.len() <= 128
            && tool
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.' | '/'));
        if !tool_ok {
            return Err(format!(
                "{name:?}: tool {tool:?} must be 1 to 128 letters, digits, `_`, `-`, `.` or \
                 `/`, as the server lists it"
            ));
        }
        if version.is_empty() || version.chars().any(char::is_whitespace) {
            return Err(format!("{name:?} {form}"));
        }
        Ok(Some(Self {
            server,
            tool,
            version,
        }))
    }
}

/// Checks the name of an MCP server as tool names and worker configurations write it:
/// 1 to 64 letters, digits, `_`, `-` or `.`, starting with a letter or digit.
///
/// # Errors
///
/// What is wrong with the name.
pub fn check_mcp_server_name(name: &str) -> Result<(), String> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && name.starts_with(|c: char| c.is_ascii_alphanumeric())
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'));
    if ok {
        Ok(())
    } else {
        Err(format!(
            "{name:?} must be 1 to 64 letters, digits, `_`, `-` or `.`, starting with a letter \
             or digit"
        ))
    }
}

/// Longest resource template, and longest argument value it takes.
const MAX_TEMPLATE_LEN: usize = 200;

/// How a tool call's resource is built from its arguments: text with `{argument}`
/// placeholders, each naming a top-level argument of the call, e.g. `runbook/{service}`
/// or `change/{service}/{rule_id}`. A template without placeholders names one fixed
/// resource (e.g. `runbooks`).
///
/// The rules, checked when the policy file is loaded:
///
/// - at most 200 characters, no whitespace and no `*` (a resource is not a pattern);
/// - a placeholder is `{name}`, `name` a letter or `_` followed by letters, digits or
///   `_`; braces are used for nothing else;
/// - two placeholders are separated by text (`{a}/{b}`, never `{a}{b}`), so a resource
///   is read back unambiguously.
///
/// A call fills each placeholder with its argument: a string, or a number or boolean
/// written as JSON writes it, of 1 to 200 letters, digits, `.`, `_`, `:`, `@` or `-`,
/// not `.` or `..`. So an argument can never reach past its placeholder: no `/`, no
/// `*`, no whitespace. A missing argument, or one of another type, fails the call
/// before it is authorized. The policy service refuses a resource the template cannot
/// produce ([`matches`](Self::matches)).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResourceTemplate {
    text: String,
    parts: Vec<TemplatePart>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum TemplatePart {
    Text(String),
    Argument(String),
}

/// Why a call's arguments do not fill a [`ResourceTemplate`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TemplateError {
    /// The call lacks an argument the template names.
    #[error("argument `{argument}` is missing; the resource template {template} is filled from it")]
    Missing {
        /// The argument.
        argument: String,
        /// The template.
        template: String,
    },
    /// The argument's value cannot stand in a resource.
    #[error(
        "argument `{argument}` = {value} cannot fill the resource template {template}: {detail}"
    )]
    BadValue {
        /// The argument.
        argument: String,
        /// The value, as given (JSON).
        value: String,
        /// The template.
        template: String,
        /// What is wrong.
        detail: String,
    },
}

impl ResourceTemplate {
    /// Parses a template.
    ///
    /// # Errors
    ///
    /// What breaks the rules listed on [`ResourceTemplate`].
    pub fn parse(text: &str) -> Result<Self, String> {
        if text.is_empty() || text.len() > MAX_TEMPLATE_LEN {
            return Err(format!(
                "{text:?} must be 1 to {MAX_TEMPLATE_LEN} characters, e.g. `runbook/{{service}}`"
            ));
        }
        if let Some(c) = text.chars().find(|c| c.is_whitespace() || *c == '*') {
            return Err(format!(
                "{text:?} must not contain {c:?}: a resource template builds one resource, \
                 it is not a pattern"
            ));
        }
        let mut parts = Vec::new();
        let mut rest = text;
        while !rest.is_empty() {
            match rest.find(['{', '}']) {
                None => {
                    parts.push(TemplatePart::Text(rest.to_owned()));
                    break;
                }
                Some(i) if rest[i..].starts_with('}') => {
                    return Err(format!(
                        "{text:?} has a `}}` that closes no placeholder; write placeholders \
                         as {{argument}}"
                    ));
                }
                Some(i) => {
                    if i > 0 {
                        parts.push(TemplatePart::Text(rest[..i].to_owned()));
                    }
                    let after = &rest[i + 1..];
                    let end = after
                        .find('}')
                        .ok_or_else(|| format!("{text:?} has a `{{` without its `}}`"))?;
                    let name = &after[..end];
                    let valid = name.starts_with(|c: char| c.is_ascii_alphabetic() || c == '_')
                        && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
                    if !valid {
                        return Err(format!(
                            "{text:?}: placeholder {{{name}}} must name an argument: a letter \
                             or `_`, then letters, digits or `_`"
                        ));
                    }
                    if matches!(parts.last(), Some(TemplatePart::Argument(_))) {
                        return Err(format!(
                            "{text:?}: placeholders must be separated by text, e.g. \
                             `{{a}}/{{b}}`, so a resource reads back unambiguously"
                        ));
                    }
                    parts.push(TemplatePart::Argument(name.to_owned()));
                    rest = &after[end + 1..];
                }
            }
        }
        Ok(Self {
            text: text.to_owned(),
            parts,
        })
    }

    /// The template as written.
    pub fn as_str(&self) -> &str {
        &self.text
    }

    /// The arguments the template names, in order.
    pub fn arguments(&self) -> impl Iterator<Item = &str> {
        self.parts.iter().filter_map(|p| match p {
            TemplatePart::Argument(a) => Some(a.as_str()),
            TemplatePart::Text(_) => None,
        })
    }

    /// The resource of a call: each placeholder filled with `value_of(argument)`, the
    /// argument's value as text (`None`: the call lacks it).
    ///
    /// # Errors
    ///
    /// A missing argument, or a value outside the characters a value may use.
    pub fn fill(
        &self,
        mut value_of: impl FnMut(&str) -> Option<String>,
    ) -> Result<String, TemplateError> {
        let mut out = String::with_capacity(self.text.len() + 16);
        for part in &self.parts {
            match part {
                TemplatePart::Text(t) => out.push_str(t),
                TemplatePart::Argument(a) => {
                    let value = value_of(a).ok_or_else(|| TemplateError::Missing {
                        argument: a.clone(),
                        template: self.text.clone(),
                    })?;
                    if let Err(detail) = check_value(&value) {
                        return Err(TemplateError::BadValue {
                            argument: a.clone(),
                            value: format!("{value:?}"),
                            template: self.text.clone(),
                            detail,
                        });
                    }
                    out.push_str(&value);
                }
            }
        }
        Ok(out)
    }

    /// Whether filling the template can produce `resource`.
    pub fn matches(&self, resource: &str) -> bool {
        fn rest_matches(parts: &[TemplatePart], s: &str) -> bool {
            match parts.split_first() {
                None => s.is_empty(),
                Some((TemplatePart::Text(t), rest)) => s
                    .strip_prefix(t.as_str())
                    .is_some_and(|s| rest_matches(rest, s)),
                Some((TemplatePart::Argument(_), rest)) => {
                    // Values are short and templates have few placeholders: try every
                    // length of value that is itself valid.
                    let limit = s.len().min(MAX_TEMPLATE_LEN);
                    (1..=limit).any(|n| {
                        s.is_char_boundary(n)
                            && check_value(&s[..n]).is_ok()
                            && rest_matches(rest, &s[n..])
                    })
                }
            }
        }
        rest_matches(&self.parts, resource)
    }
}

impl std::fmt::Display for ResourceTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.text)
    }
}

/// Checks a value that fills a template's placeholder.
fn check_value(value: &str) -> Result<(), String> {
    if value.is_empty() || value.len() > MAX_TEMPLATE_LEN {
        return Err(format!("must be 1 to {MAX_TEMPLATE_LEN} characters"));
    }
    if value == "." || value == ".." {
        return Err("must not be `.` or `..`".into());
    }
    match value
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | ':' | '@' | '-')))
    {
        Some(c) => Err(format!(
            "{c:?} is not allowed; a value is letters, digits, `.`, `_`, `:`, `@` or `-`"
        )),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mcp_tool_names_split_into_server_tool_and_version() {
        assert_eq!(McpToolName::parse("search_logs@1"), Ok(None));
        assert_eq!(
            McpToolName::parse("mcp:runbooks/lookup_runbook@1"),
            Ok(Some(McpToolName {
                server: "runbooks",
                tool: "lookup_runbook",
                version: "1",
            }))
        );
        // MCP tool names may contain `/`; the server is what comes before the first one.
        let nested = McpToolName::parse("mcp:kb/runbooks/get@2")
            .unwrap()
            .unwrap();
        assert_eq!(
            (nested.server, nested.tool, nested.version),
            ("kb", "runbooks/get", "2")
        );
        let err = McpToolName::parse("mcp:runbooks/lookup runbook@1").unwrap_err();
        assert!(err.contains("tool"), "{err}");
        assert!(check_mcp_server_name("runbooks-http").is_ok());
        assert!(check_mcp_server_name("-x").is_err());
        assert!(check_mcp_server_name("a/b").is_err());
    }

    #[test]
    fn resource_templates_fill_from_arguments_and_match_what_they_produce() {
        let t = ResourceTemplate::parse("change/{service}/{rule_id}").unwrap();
        assert_eq!(t.arguments().collect::<Vec<_>>(), ["service", "rule_id"]);
        let args = |name: &str| match name {
            "service" => Some("risk-gateway".to_owned()),
            "rule_id" => Some("RC-4711".to_owned()),
            _ => None,
        };
        let resource = t.fill(args).unwrap();
        assert_eq!(resource, "change/risk-gateway/RC-4711");
        assert!(t.matches(&resource));
        assert!(!t.matches("change/risk-gateway"));
        assert!(!t.matches("change/risk-gateway/RC-4711/x"));
        assert!(!t.matches("change//RC-4711"));
        assert!(!t.matches("metric/risk-gateway/RC-4711"));

        let fixed = ResourceTemplate::parse("runbooks").unwrap();
        assert_eq!(fixed.fill(|_| None).unwrap(), "runbooks");
        assert!(fixed.matches("runbooks") && !fixed.matches("runbooks/x"));

        let err = t
            .fill(|name| (name == "service").then(|| "x".to_owned()))
            .unwrap_err();
        assert!(err.to_string().contains("`rule_id` is missing"), "{err}");
        for bad in ["../etc", "a/b", "*", "a b", "", ".."] {
            let err = t
                .fill(|name| Some(if name == "service" { bad } else { "ok" }.to_owned()))
                .unwrap_err();
            assert!(err.to_string().contains("`service`"), "{bad:?}: {err}");
        }
        // A value may repeat the text around it; the match still finds the split.
        let dotted = ResourceTemplate::parse("metric/{name}.p95").unwrap();
        let r = dotted.fill(|_| Some("gateway.latency".to_owned())).unwrap();
        assert!(dotted.matches(&r) && !dotted.matches("metric/.p95"));

        for bad in [
            "",
            "runbook/*",
            "runbook/{ service }",
            "{a}{b}",
            "runbook/{1x}",
            "a}b",
            "a{b",
        ] {
            assert!(ResourceTemplate::parse(bad).is_err(), "{bad:?} parsed");
        }
    }
}
