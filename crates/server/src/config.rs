//! Layered configuration: defaults → config file → `CONVENE_*` environment → flags.
//!
//! Any `T: Serialize + DeserializeOwned + Default` whose structs carry
//! `#[serde(deny_unknown_fields)]` can be loaded with a [`ConfigLoader`]; a struct may
//! also flatten a shared section (`#[serde(flatten)]`, e.g. [`ServiceCommon`]) and keep
//! `deny_unknown_fields` on itself: serde then still refuses unknown keys (those the
//! outer struct and the flattened one both ignore), and the loader names their source
//! (see [`ConfigLoader::section`]). Each layer overrides the ones before it, key by key:
//!
//! 1. `T::default()`;
//! 2. a config file, TOML (`.toml`) or YAML (`.yaml`, `.yml`), chosen by extension;
//! 3. environment variables `CONVENE_<KEY>`, nested keys joined with `__`
//!    (`CONVENE_SERVER__LISTEN=0.0.0.0:7001` sets `server.listen`), read from an
//!    injected source so tests never touch the process environment;
//! 4. overrides from the command line, as dotted keys (`server.listen`).
//!
//! A key that `T` does not know is an error that names the key and the layer it came
//! from, so a typo never silently falls back to a default. [`dump`] writes the effective
//! configuration back out for `--dump-config`.

use std::{
    collections::BTreeMap,
    fmt,
    path::{Path, PathBuf},
};

use figment::{
    Figment, Metadata, Profile, Provider,
    providers::{Format as _, Serialized, Toml, Yaml},
    value::{Dict, Map, Value},
};
use serde::{Serialize, de::DeserializeOwned};

/// Prefix of the environment variables the loader reads.
pub const ENV_PREFIX: &str = "CONVENE_";

/// Separator of nested keys in environment variable names.
pub const ENV_SEPARATOR: &str = "__";

/// `CONVENE_*` variables that the command line reads itself and that are therefore not
/// configuration keys: the env layer skips them instead of rejecting them as unknown.
pub const RESERVED_ENV_VARS: &[&str] = &[
    "CONVENE_CONFIG",
    "CONVENE_LOG_FORMAT",
    "CONVENE_PUBLIC_CREDENTIALS",
    // Read by the `convene` client commands, which a shell exporting them may also use
    // to start services. (CONVENE_APPROVAL_ENDPOINT is not here: it names the same
    // thing as the supervisor's `approval_endpoint` key.)
    "CONVENE_ENDPOINT",
    "CONVENE_CREDENTIAL",
    "CONVENE_JAEGER_URL",
    "CONVENE_LISTEN",
    // The model every `openai` worker profile uses; read by the worker (and by
    // `convene up`) itself, and harmless to every other service.
    "CONVENE_MODEL",
    // TLS, read by the flags of every binary (`crate::tls::TlsArgs`).
    "CONVENE_TLS_CERT",
    "CONVENE_TLS_KEY",
    "CONVENE_TLS_CLIENT_CA",
    "CONVENE_TLS_CA",
    "CONVENE_INSECURE",
];

/// Variables with this prefix belong to the test suites (the database and broker servers
/// tests use) and are inherited by the binaries those tests start; services ignore them.
pub const TEST_ENV_PREFIX: &str = "CONVENE_TEST_";

/// A configuration file format.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    /// TOML (`.toml`), the default.
    #[default]
    Toml,
    /// YAML (`.yaml` or `.yml`).
    Yaml,
}

impl Format {
    /// The format a file's extension says it is in.
    ///
    /// # Errors
    ///
    /// [`Error::UnknownFormat`] for any extension other than `.toml`, `.yaml`, `.yml`.
    pub fn from_path(path: &Path) -> Result<Self, Error> {
        match path.extension().and_then(|e| e.to_str()) {
            Some(ext) if ext.eq_ignore_ascii_case("toml") => Ok(Format::Toml),
            Some(ext) if ext.eq_ignore_ascii_case("yaml") || ext.eq_ignore_ascii_case("yml") => {
                Ok(Format::Yaml)
            }
            _ => Err(Error::UnknownFormat {
                path: path.to_owned(),
            }),
        }
    }
}

impl fmt::Display for Format {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Format::Toml => "TOML",
            Format::Yaml => "YAML",
        })
    }
}

/// Why configuration could not be loaded or written.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The config file's extension does not say which format it is in.
    #[error(
        "config file {}: unknown format; name it *.toml, *.yaml or *.yml",
        path.display()
    )]
    UnknownFormat {
        /// The file.
        path: PathBuf,
    },
    /// The config file cannot be read.
    #[error("config file {} cannot be read: {source}", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// A layer holds an unknown key, a value of the wrong type, or does not parse.
    /// Each problem names the key and the layer (file path, environment variable or
    /// flag) it came from.
    #[error("invalid configuration:\n  - {}", problems.join("\n  - "))]
    Invalid {
        /// One line per problem.
        problems: Vec<String>,
    },
    /// The configuration cannot be written in the requested format.
    #[error("cannot write the configuration as {format}: {message}")]
    Dump {
        /// The requested format.
        format: Format,
        /// What the serializer reported.
        message: String,
    },
}

impl From<figment::Error> for Error {
    fn from(error: figment::Error) -> Self {
        Error::Invalid {
            problems: error.into_iter().map(|e| e.to_string()).collect(),
        }
    }
}

/// Builds a configuration from its layers. See the [module docs](self) for the order.
#[derive(Clone, Debug, Default)]
pub struct ConfigLoader {
    file: Option<PathBuf>,
    env: BTreeMap<String, String>,
    overrides: Vec<(String, Value)>,
    sections: Vec<SectionCheck>,
}

/// Extracts a flattened section on its own, for its errors' sake (see
/// [`ConfigLoader::section`]).
type SectionCheck = fn(&Figment) -> figment::Result<()>;

impl ConfigLoader {
    /// A loader with no file, no environment and no overrides: it yields `T::default()`.
    pub fn new() -> Self {
        Self::default()
    }

    /// Reads this config file (TOML or YAML, by extension) over the defaults. The file
    /// must exist: a path given explicitly that is missing is an error, not a silent
    /// fallback to defaults.
    pub fn file(mut self, path: impl Into<PathBuf>) -> Self {
        self.file = Some(path.into());
        self
    }

    /// Reads `CONVENE_*` variables from `vars` over the file. Other variables and the
    /// [`RESERVED_ENV_VARS`] are ignored. Production passes `std::env::vars()`; tests
    /// pass a literal list.
    pub fn env<I, K, V>(mut self, vars: I) -> Self
    where
        I: IntoIterator<Item = (K, V)>,
        K: Into<String>,
        V: Into<String>,
    {
        self.env = vars
            .into_iter()
            .map(|(k, v)| (k.into(), v.into()))
            .filter(|(k, _)| {
                k.starts_with(ENV_PREFIX)
                    && !k.starts_with(TEST_ENV_PREFIX)
                    && !RESERVED_ENV_VARS.contains(&k.as_str())
            })
            .collect();
        self
    }

    /// Sets the dotted `key` (e.g. `server.listen`) to `value`, over every other layer.
    /// This is how command-line flags reach the configuration.
    ///
    /// # Panics
    ///
    /// If `value` cannot be represented as a configuration value (e.g. a map with
    /// non-string keys), which is a programming error at the call site.
    pub fn set(mut self, key: impl Into<String>, value: impl Serialize) -> Self {
        let key = key.into();
        let value = Value::serialize(value)
            .unwrap_or_else(|e| panic!("override {key:?} is not a configuration value: {e}"));
        self.overrides.push((key, value));
        self
    }

    /// [`set`](Self::set) when a flag gave a value (`Some`), for the optional flags a
    /// binary's parser leaves unset.
    pub fn set_some(self, key: impl Into<String>, value: Option<impl Serialize>) -> Self {
        match value {
            Some(value) => self.set(key, value),
            None => self,
        }
    }

    /// [`set_some`](Self::set_some) for a path flag, as the path is displayed.
    pub fn set_path(self, key: impl Into<String>, path: Option<&std::path::Path>) -> Self {
        self.set_some(key, path.map(|p| p.display().to_string()))
    }

    /// Checks the keys of `S`, a section that the loaded type flattens
    /// (`#[serde(flatten)]`), on their own before the whole is loaded.
    ///
    /// serde deserializes a flattened section from a buffered copy of the values, which
    /// has lost where each came from: a bad value of one of its keys (or an unknown key
    /// of one of its nested tables) would be reported without the key's name and source.
    /// Extracted on its own first, `S` is read straight from the layers, so its errors
    /// name the key and the file, variable or flag as everywhere else. `S` must not deny
    /// unknown fields itself: the other keys are the outer struct's.
    pub fn section<S: DeserializeOwned>(mut self) -> Self {
        self.sections
            .push(|figment| figment.extract::<S>().map(drop));
        self
    }

    /// Merges the layers and deserializes `T`.
    ///
    /// # Errors
    ///
    /// [`Error::UnknownFormat`] or [`Error::Read`] for a bad config file path, and
    /// [`Error::Invalid`] for unknown keys, wrong types or syntax errors, naming the key
    /// and its source.
    pub fn load<T>(&self) -> Result<T, Error>
    where
        T: Serialize + DeserializeOwned + Default,
    {
        let mut figment = Figment::from(Serialized::defaults(T::default()));
        if let Some(path) = &self.file {
            let format = Format::from_path(path)?;
            // Checked here because figment treats a missing file as an empty one.
            std::fs::metadata(path).map_err(|source| Error::Read {
                path: path.clone(),
                source,
            })?;
            figment = match format {
                Format::Toml => figment.merge(FileLayer {
                    data: Toml::file_exact(path),
                    path,
                    format,
                }),
                Format::Yaml => figment.merge(FileLayer {
                    data: Yaml::file_exact(path),
                    path,
                    format,
                }),
            };
        }
        figment = figment.merge(EnvLayer { vars: &self.env });
        figment = figment.merge(OverrideLayer {
            overrides: &self.overrides,
        });
        for check in &self.sections {
            check(&figment)?;
        }
        figment
            .extract()
            .map_err(|error| name_unknown_keys(&figment, error))
    }
}

/// Gives the unknown top-level keys that serde reports without a place their key and
/// source. A struct that flattens a section refuses the keys nobody took only once it
/// has read them all, outside figment's walk of the values, so the error carries
/// neither; figment knows where each key came from.
fn name_unknown_keys(figment: &Figment, errors: figment::Error) -> Error {
    let problems = errors
        .into_iter()
        .map(|mut error| {
            if error.path.is_empty()
                && let figment::error::Kind::Message(message) = &error.kind
                && let Some(key) = message
                    .strip_prefix("unknown field `")
                    .and_then(|rest| rest.strip_suffix('`'))
                && let Some(metadata) = figment.find_metadata(key)
            {
                error.path = vec![key.to_owned()];
                error.metadata = Some(metadata.clone());
                error.profile = Some(Profile::Default);
            }
            error.to_string()
        })
        .collect();
    Error::Invalid { problems }
}

/// Writes `value` in `format`, for `--dump-config`: every key, those that are unset
/// (`None`) as comments in their section (`# replica_id =`), so the output shows what
/// can be set. It loads back as a config file of that format and yields the same value.
///
/// # Errors
///
/// [`Error::Dump`] if the value has a shape the format cannot express.
pub fn dump<T: Serialize>(value: &T, format: Format) -> Result<String, Error> {
    let fail = |message: String| Error::Dump { format, message };
    // Written from the value itself, so keys keep their declared order; the unset ones
    // are found through its JSON form, where they are nulls.
    let json = serde_json::to_value(value).map_err(|e| fail(e.to_string()))?;
    let mut unset = Vec::new();
    let set = without_nulls(json, &mut Vec::new(), &mut unset);
    let text = match format {
        Format::Toml => toml::to_string_pretty(value)
            .or_else(|_| toml::to_string_pretty(&set))
            .map_err(|e| fail(e.to_string()))?,
        Format::Yaml => {
            let text = serde_yaml::to_string(value).map_err(|e| fail(e.to_string()))?;
            // serde_yaml writes an unset key as `key: null`: it is left out, and then
            // put back as a comment like TOML's.
            text.lines()
                .filter(|l| !is_yaml_null(l))
                .map(|l| format!("{l}\n"))
                .collect()
        }
    };
    Ok(with_unset_keys(&text, &unset, format))
}

/// Whether `line` is a mapping key whose value is null (`  key: null`).
fn is_yaml_null(line: &str) -> bool {
    line.trim_start().strip_suffix(": null").is_some_and(|key| {
        !key.is_empty() && key.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
    })
}

/// `value` without its null members; the path of each null member of a table (not of
/// an array, which a config file cannot show unset) goes to `unset`.
fn without_nulls(
    value: serde_json::Value,
    path: &mut Vec<String>,
    unset: &mut Vec<Vec<String>>,
) -> serde_json::Value {
    use serde_json::Value as V;
    match value {
        V::Object(members) => V::Object(
            members
                .into_iter()
                .filter_map(|(key, member)| {
                    path.push(key.clone());
                    let kept = if member.is_null() {
                        unset.push(path.clone());
                        None
                    } else {
                        Some((key, without_nulls(member, path, unset)))
                    };
                    path.pop();
                    kept
                })
                .collect(),
        ),
        V::Array(items) => V::Array(
            items
                .into_iter()
                .filter(|item| !item.is_null())
                .map(|item| without_nulls(item, path, &mut Vec::new()))
                .collect(),
        ),
        other => other,
    }
}

/// `text` with a comment line for each unset key, in its table: after the table's
/// header (TOML) or key (YAML), or first for top-level keys.
fn with_unset_keys(text: &str, unset: &[Vec<String>], format: Format) -> String {
    let mut lines: Vec<String> = text.lines().map(str::to_owned).collect();
    // Deepest first, and backwards within a table, so insertions keep the order.
    let mut unset: Vec<&Vec<String>> = unset.iter().collect();
    unset.sort();
    for path in unset.into_iter().rev() {
        let Some((key, table)) = path.split_last() else {
            continue;
        };
        let (at, line) = match format {
            Format::Toml => {
                let at = if table.is_empty() {
                    // After the top-level keys: before the blank line of the first table
                    // and the comments put there already.
                    let first = lines
                        .iter()
                        .position(|l| l.starts_with('['))
                        .unwrap_or(lines.len());
                    let blanks = lines[..first]
                        .iter()
                        .rev()
                        .take_while(|l| l.is_empty() || l.starts_with("# "))
                        .count();
                    Some(first - blanks)
                } else {
                    let header = format!("[{}]", table.join("."));
                    lines.iter().position(|l| *l == header).map(|i| i + 1)
                };
                (at, format!("# {key} ="))
            }
            Format::Yaml => {
                let mut at = Some(0);
                for (depth, name) in table.iter().enumerate() {
                    let wanted = format!("{}{name}:", "  ".repeat(depth));
                    at = at.and_then(|from| {
                        lines[from..]
                            .iter()
                            .position(|l| *l == wanted)
                            .map(|i| from + i + 1)
                    });
                }
                (at, format!("{}# {key}:", "  ".repeat(table.len())))
            }
        };
        // A table that is not shown (it has no set key) has no place for the comment.
        if let Some(at) = at {
            lines.insert(at, line);
        }
    }
    let mut out = lines.join("\n");
    out.push('\n');
    out
}

/// Names a key the way the user wrote it, `server.listen`, without figment's profile.
fn dotted_key(_: &Profile, keys: &[&str]) -> String {
    keys.join(".")
}

/// The config file layer: figment's file provider, with keys in errors written as in
/// the file (`server.listen`, not `default.server.listen`).
struct FileLayer<'a, F: figment::providers::Format> {
    data: figment::providers::Data<F>,
    path: &'a Path,
    format: Format,
}

impl<F: figment::providers::Format> Provider for FileLayer<'_, F> {
    fn metadata(&self) -> Metadata {
        Metadata::from(format!("{} file", self.format), self.path).interpolater(dotted_key)
    }

    fn data(&self) -> figment::Result<Map<Profile, Dict>> {
        self.data.data()
    }
}

/// The environment layer. Its metadata maps key paths back to variable names, so an
/// error for `server.bogus` says `CONVENE_SERVER__BOGUS`.
struct EnvLayer<'a> {
    vars: &'a BTreeMap<String, String>,
}

impl Provider for EnvLayer<'_> {
    fn metadata(&self) -> Metadata {
        Metadata::named("environment variable").interpolater(|_: &Profile, keys: &[&str]| {
            let upper: Vec<String> = keys.iter().map(|k| k.to_ascii_uppercase()).collect();
            format!("{ENV_PREFIX}{}", upper.join(ENV_SEPARATOR))
        })
    }

    fn data(&self) -> figment::Result<Map<Profile, Dict>> {
        let mut dict = Dict::new();
        for (name, raw) in self.vars {
            let path: Vec<String> = name[ENV_PREFIX.len()..]
                .split(ENV_SEPARATOR)
                .map(str::to_ascii_lowercase)
                .collect();
            if path.iter().any(String::is_empty) {
                return Err(format!(
                    "environment variable {name} has an empty key segment; \
                     write nested keys as CONVENE_SECTION__KEY"
                )
                .into());
            }
            // Parsed like figment's own env provider: numbers and booleans become typed
            // values, anything else stays a string.
            let value: Value = raw.parse().unwrap_or_else(|never| match never {});
            insert_path(&mut dict, &path, value);
        }
        Ok(Profile::Default.collect(dict))
    }
}

/// The command-line layer: dotted keys set by flags.
struct OverrideLayer<'a> {
    overrides: &'a [(String, Value)],
}

impl Provider for OverrideLayer<'_> {
    fn metadata(&self) -> Metadata {
        Metadata::named("command-line flag").interpolater(dotted_key)
    }

    fn data(&self) -> figment::Result<Map<Profile, Dict>> {
        let mut dict = Dict::new();
        for (key, value) in self.overrides {
            let path: Vec<String> = key.split('.').map(str::to_owned).collect();
            if path.iter().any(String::is_empty) {
                return Err(format!("override key {key:?} has an empty segment").into());
            }
            insert_path(&mut dict, &path, value.clone());
        }
        Ok(Profile::Default.collect(dict))
    }
}

/// Inserts `value` at `path`, creating intermediate tables. A later value for the same
/// path, or a scalar where a table is needed, replaces what was there.
fn insert_path(dict: &mut Dict, path: &[String], value: Value) {
    let Some((last, parents)) = path.split_last() else {
        return;
    };
    let mut current = dict;
    for key in parents {
        let entry = current
            .entry(key.clone())
            .or_insert_with(|| Value::from(Dict::new()));
        if entry.as_dict().is_none() {
            *entry = Value::from(Dict::new());
        }
        current = match entry {
            Value::Dict(_, inner) => inner,
            _ => unreachable!("entry was just made a table"),
        };
    }
    current.insert(last.clone(), value);
}

/// `serde(with = ...)` for a [`Duration`](std::time::Duration) written in humantime form
/// (`"30s"`, `"1m 30s"`, `"250ms"`).
pub mod duration {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer, de::Error as _};

    /// Writes the duration as e.g. `"1m 30s"`.
    pub fn serialize<S: Serializer>(value: &Duration, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(&humantime::format_duration(*value))
    }

    /// Reads a duration such as `"30s"`, `"1m 30s"` or `"250ms"`.
    pub fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Duration, D::Error> {
        let text = DurationText::deserialize(deserializer)?;
        humantime::parse_duration(&text.0).map_err(|e| {
            D::Error::custom(format!(
                "invalid duration {:?} ({e}); write e.g. \"30s\", \"1m 30s\" or \"250ms\"",
                text.0
            ))
        })
    }

    /// A duration's source text. Bare numbers are refused with a hint rather than guessed
    /// at, since `30` could mean seconds or milliseconds.
    pub(super) struct DurationText(pub(super) String);

    impl<'de> Deserialize<'de> for DurationText {
        fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
            struct Visitor;
            impl serde::de::Visitor<'_> for Visitor {
                type Value = DurationText;
                fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                    f.write_str("a duration with a unit, e.g. \"30s\" or \"250ms\"")
                }
                fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<DurationText, E> {
                    Ok(DurationText(v.to_owned()))
                }
            }
            deserializer.deserialize_str(Visitor)
        }
    }
}

/// `serde(with = ...)` for an `Option<Duration>` where `"off"` means `None` (TOML has no
/// null), otherwise as in [`duration`].
pub mod optional_duration {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer, de::Error as _};

    use super::duration::DurationText;

    /// The word that disables the duration.
    pub const OFF: &str = "off";

    /// Writes `None` as `"off"` and a duration as e.g. `"30s"`.
    pub fn serialize<S: Serializer>(
        value: &Option<Duration>,
        serializer: S,
    ) -> Result<S::Ok, S::Error> {
        match value {
            Some(d) => super::duration::serialize(d, serializer),
            None => serializer.serialize_str(OFF),
        }
    }

    /// Reads `"off"` as `None`, otherwise a duration such as `"30s"`.
    pub fn deserialize<'de, D: Deserializer<'de>>(
        deserializer: D,
    ) -> Result<Option<Duration>, D::Error> {
        let text = DurationText::deserialize(deserializer)?;
        if text.0.eq_ignore_ascii_case(OFF) {
            return Ok(None);
        }
        humantime::parse_duration(&text.0).map(Some).map_err(|e| {
            D::Error::custom(format!(
                "invalid duration {:?} ({e}); write e.g. \"30s\", or \"{OFF}\" to disable",
                text.0
            ))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn format_follows_the_extension() {
        assert_eq!(
            Format::from_path(Path::new("a/b.toml")).ok(),
            Some(Format::Toml)
        );
        assert_eq!(
            Format::from_path(Path::new("b.YAML")).ok(),
            Some(Format::Yaml)
        );
        assert_eq!(
            Format::from_path(Path::new("b.yml")).ok(),
            Some(Format::Yaml)
        );
        let err = Format::from_path(Path::new("conf.json")).unwrap_err();
        assert!(err.to_string().contains("conf.json"), "{err}");
        assert!(err.to_string().contains("*.toml"), "{err}");
        assert!(Format::from_path(Path::new("noext")).is_err());
    }

    #[test]
    fn insert_path_builds_nested_tables_and_replaces_scalars() {
        let mut dict = Dict::new();
        let path = |p: &str| p.split('.').map(str::to_owned).collect::<Vec<_>>();
        insert_path(&mut dict, &path("a.b.c"), Value::from(1));
        insert_path(&mut dict, &path("a.d"), Value::from("x"));
        // A scalar in the way of a deeper key becomes a table.
        insert_path(&mut dict, &path("a.d.e"), Value::from(true));
        let value = Value::from(dict);
        assert_eq!(value.find_ref("a.b.c").and_then(Value::to_i128), Some(1));
        assert_eq!(value.find_ref("a.d.e").and_then(Value::to_bool), Some(true));
    }

    /// A service config flattening the shared section, as the services declare theirs.
    #[derive(Debug, Default, PartialEq, Serialize, serde::Deserialize)]
    #[serde(deny_unknown_fields, default)]
    struct Flattened {
        #[serde(flatten)]
        common: crate::ServiceCommon,
        limit: usize,
    }

    fn load_flattened(env: &[(&str, &str)]) -> Result<Flattened, Error> {
        ConfigLoader::new()
            .section::<crate::ServiceCommon>()
            .env(env.iter().copied())
            .load()
    }

    #[test]
    fn a_flattened_section_keeps_its_keys_at_the_top_and_unknown_keys_refused() {
        let config = load_flattened(&[
            ("CONVENE_DATA_DIR", "/srv/convene"),
            ("CONVENE_DEV_CREDENTIALS", "false"),
            ("CONVENE_LIMIT", "3"),
        ])
        .unwrap();
        assert_eq!(config.common.data_dir, PathBuf::from("/srv/convene"));
        assert!(!config.common.dev_credentials);
        assert_eq!(config.limit, 3);
        let dumped = dump(&config, Format::Toml).unwrap();
        assert!(dumped.contains("data_dir = \"/srv/convene\""), "{dumped}");
        assert!(
            dumped.contains("limit = 3") && dumped.contains("[server]"),
            "{dumped}"
        );

        // Unknown keys, at the top and in a nested table of the shared section, are
        // refused with the key and the variable that set it.
        for (var, key) in [
            ("CONVENE_LIMTI", "limti"),
            ("CONVENE_SERVER__LISTN", "listn"),
        ] {
            let err = load_flattened(&[(var, "1")]).unwrap_err().to_string();
            assert!(err.contains(key) && err.contains(var), "{err}");
        }
        // A bad value of a shared key names the key too.
        let err = load_flattened(&[("CONVENE_DEV_CREDENTIALS", "maybe")])
            .unwrap_err()
            .to_string();
        assert!(err.contains("CONVENE_DEV_CREDENTIALS"), "{err}");
    }

    /// Keys left unset in a nested table and at the top.
    #[derive(Debug, Default, PartialEq, Serialize, serde::Deserialize)]
    #[serde(deny_unknown_fields, default)]
    struct WithOptions {
        #[serde(flatten)]
        common: crate::ServiceCommon,
        replica_id: Option<String>,
        nested: Nested,
    }

    #[derive(Debug, Default, PartialEq, Serialize, serde::Deserialize)]
    #[serde(deny_unknown_fields, default)]
    struct Nested {
        endpoint: Option<String>,
        size: u32,
    }

    #[test]
    fn a_dump_shows_unset_keys_as_comments_and_loads_back() {
        let config = WithOptions {
            nested: Nested {
                endpoint: None,
                size: 4,
            },
            ..WithOptions::default()
        };
        let dir = tempfile::tempdir().unwrap();
        for (format, file, comments) in [
            (
                Format::Toml,
                "c.toml",
                [
                    "# database_url =",
                    "# replica_id =",
                    "[nested]\n# endpoint =\n",
                ],
            ),
            (
                Format::Yaml,
                "c.yaml",
                [
                    "# database_url:",
                    "# replica_id:",
                    "nested:\n  # endpoint:\n",
                ],
            ),
        ] {
            let dumped = dump(&config, format).unwrap();
            let at = |needle: &str| {
                dumped
                    .find(needle)
                    .unwrap_or_else(|| panic!("{format}: no {needle:?} in\n{dumped}"))
            };
            // In order, the top-level ones before the first table.
            assert!(
                at(comments[0]) < at(comments[1]) && at(comments[1]) < at(comments[2]),
                "{format}:\n{dumped}"
            );
            let path = dir.path().join(file);
            std::fs::write(&path, &dumped).unwrap();
            let loaded: WithOptions = ConfigLoader::new()
                .section::<crate::ServiceCommon>()
                .file(&path)
                .load()
                .unwrap_or_else(|e| panic!("{format}: {e}\n{dumped}"));
            assert_eq!(loaded, config, "{format}");
        }
    }
}
