//! Layered configuration: each layer overrides the one before, unknown keys are
//! rejected with their source named, and `dump` output loads back unchanged.

use std::{fs, net::SocketAddr, path::PathBuf, time::Duration};

use convene_server::{ConfigError, ConfigLoader, Format, ServerSettings, dump};
use serde::{Deserialize, Serialize};

/// A service-shaped config: the shared `server` section plus service keys.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct ExampleConfig {
    server: ServerSettings,
    data_dir: PathBuf,
    store: StoreConfig,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct StoreConfig {
    max_connections: u32,
    wal: bool,
}

impl Default for ExampleConfig {
    fn default() -> Self {
        Self {
            server: ServerSettings::on_port(7001),
            data_dir: PathBuf::from("data"),
            store: StoreConfig::default(),
        }
    }
}

impl Default for StoreConfig {
    fn default() -> Self {
        Self {
            max_connections: 4,
            wal: true,
        }
    }
}

fn addr(s: &str) -> SocketAddr {
    s.parse().expect("test address parses")
}

/// Writes `contents` to `name` in a fresh temporary directory.
fn write_file(name: &str, contents: &str) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().expect("create temp dir");
    let path = dir.path().join(name);
    fs::write(&path, contents).expect("write config file");
    (dir, path)
}

const TOML_FILE: &str = r#"
data_dir = "/var/lib/convene"

[server]
listen = "0.0.0.0:9001"
request_timeout = "45s"
concurrency_limit = 10

[store]
max_connections = 16
"#;

#[test]
fn no_layers_yield_the_defaults() {
    let config: ExampleConfig = ConfigLoader::new().load().unwrap();
    assert_eq!(config, ExampleConfig::default());
    // An empty environment and unrelated variables change nothing either.
    let config: ExampleConfig = ConfigLoader::new()
        .env([("PATH", "/usr/bin"), ("HOME", "/root")])
        .load()
        .unwrap();
    assert_eq!(config, ExampleConfig::default());
}

#[test]
fn file_overrides_defaults_key_by_key() {
    let (_dir, path) = write_file("convene.toml", TOML_FILE);
    let config: ExampleConfig = ConfigLoader::new().file(&path).load().unwrap();
    assert_eq!(config.server.listen, addr("0.0.0.0:9001"));
    assert_eq!(config.server.request_timeout, Some(Duration::from_secs(45)));
    assert_eq!(config.server.concurrency_limit, 10);
    assert_eq!(config.data_dir, PathBuf::from("/var/lib/convene"));
    assert_eq!(config.store.max_connections, 16);
    // Keys the file does not mention keep their defaults, also inside a section it sets.
    assert_eq!(config.store.wal, StoreConfig::default().wal);
    assert_eq!(
        config.server.shutdown_grace,
        ServerSettings::default().shutdown_grace
    );
}

#[test]
fn environment_overrides_the_file() {
    let (_dir, path) = write_file("convene.toml", TOML_FILE);
    let config: ExampleConfig = ConfigLoader::new()
        .file(&path)
        .env([
            ("CONVENE_SERVER__CONCURRENCY_LIMIT", "20"),
            ("CONVENE_SERVER__REQUEST_TIMEOUT", "off"),
            ("CONVENE_STORE__WAL", "false"),
            ("CONVENE_DATA_DIR", "/srv/convene"),
            // Read by the command line itself, not a config key: must not be rejected.
            ("CONVENE_CONFIG", "/elsewhere.toml"),
            ("UNRELATED", "x"),
        ])
        .load()
        .unwrap();
    assert_eq!(config.server.concurrency_limit, 20);
    assert_eq!(config.server.request_timeout, None);
    assert!(!config.store.wal);
    assert_eq!(config.data_dir, PathBuf::from("/srv/convene"));
    // The file's other values survive.
    assert_eq!(config.server.listen, addr("0.0.0.0:9001"));
    assert_eq!(config.store.max_connections, 16);
}

#[test]
fn environment_accepts_ipv6_addresses() {
    let config: ExampleConfig = ConfigLoader::new()
        .env([("CONVENE_SERVER__LISTEN", "[::1]:7100")])
        .load()
        .unwrap();
    assert_eq!(config.server.listen, addr("[::1]:7100"));
}

#[test]
fn flags_override_the_environment() {
    let (_dir, path) = write_file("convene.toml", TOML_FILE);
    let config: ExampleConfig = ConfigLoader::new()
        .file(&path)
        .env([
            ("CONVENE_SERVER__CONCURRENCY_LIMIT", "20"),
            ("CONVENE_SERVER__LISTEN", "127.0.0.1:9002"),
        ])
        .set("server.concurrency_limit", 30)
        .set("store.max_connections", 64)
        .load()
        .unwrap();
    assert_eq!(config.server.concurrency_limit, 30);
    assert_eq!(config.store.max_connections, 64);
    // Keys the flags leave alone keep the env value, and below it the file's.
    assert_eq!(config.server.listen, addr("127.0.0.1:9002"));
    assert_eq!(config.server.request_timeout, Some(Duration::from_secs(45)));
}

#[test]
fn unknown_key_in_a_toml_file_names_the_key_and_the_file() {
    let (_dir, path) = write_file(
        "convene.toml",
        "[server]\nlisten = \"127.0.0.1:1\"\nrequest_timout = \"5s\"\n",
    );
    let err = ConfigLoader::new()
        .file(&path)
        .load::<ExampleConfig>()
        .unwrap_err();
    assert!(matches!(err, ConfigError::Invalid { .. }), "{err:?}");
    let message = err.to_string();
    assert!(message.contains("\"server.request_timout\""), "{message}");
    assert!(message.contains(&path.display().to_string()), "{message}");
    assert!(message.contains("TOML"), "{message}");
}

#[test]
fn unknown_key_in_the_environment_names_the_variable() {
    let err = ConfigLoader::new()
        .env([("CONVENE_SERVER__LISTN", "127.0.0.1:1")])
        .load::<ExampleConfig>()
        .unwrap_err();
    let message = err.to_string();
    assert!(message.contains("listn"), "{message}");
    assert!(message.contains("CONVENE_SERVER__LISTN"), "{message}");
    assert!(message.contains("environment variable"), "{message}");

    // A whole unknown section is rejected too.
    let err = ConfigLoader::new()
        .env([("CONVENE_STOER__WAL", "true")])
        .load::<ExampleConfig>()
        .unwrap_err();
    assert!(err.to_string().contains("stoer"), "{err}");
}

#[test]
fn unknown_key_from_a_flag_names_the_flag_layer() {
    let err = ConfigLoader::new()
        .set("server.bogus", 1)
        .load::<ExampleConfig>()
        .unwrap_err();
    let message = err.to_string();
    assert!(message.contains("\"server.bogus\""), "{message}");
    assert!(message.contains("command-line flag"), "{message}");
}

#[test]
fn wrong_types_name_the_key_and_the_expected_form() {
    let err = ConfigLoader::new()
        .env([("CONVENE_SERVER__SHUTDOWN_GRACE", "10")])
        .load::<ExampleConfig>()
        .unwrap_err();
    let message = err.to_string();
    assert!(
        message.contains("CONVENE_SERVER__SHUTDOWN_GRACE"),
        "{message}"
    );
    assert!(
        message.contains("30s"),
        "hint at the duration form: {message}"
    );

    let (_dir, path) = write_file("c.yaml", "server:\n  request_timeout: soon\n");
    let err = ConfigLoader::new()
        .file(&path)
        .load::<ExampleConfig>()
        .unwrap_err();
    let message = err.to_string();
    assert!(message.contains("\"soon\""), "{message}");
    assert!(message.contains("request_timeout"), "{message}");
}

#[test]
fn yaml_files_work() {
    let (_dir, path) = write_file(
        "convene.yml",
        "server:\n  listen: 0.0.0.0:9005\n  shutdown_grace: 1m 30s\nstore:\n  wal: false\n",
    );
    let config: ExampleConfig = ConfigLoader::new().file(&path).load().unwrap();
    assert_eq!(config.server.listen, addr("0.0.0.0:9005"));
    assert_eq!(config.server.shutdown_grace, Duration::from_secs(90));
    assert!(!config.store.wal);
    assert_eq!(config.store.max_connections, 4);
}

#[test]
fn bad_file_paths_are_explained() {
    let (_dir, path) = write_file("convene.json", "{}");
    let err = ConfigLoader::new()
        .file(&path)
        .load::<ExampleConfig>()
        .unwrap_err();
    assert!(matches!(err, ConfigError::UnknownFormat { .. }), "{err:?}");
    assert!(err.to_string().contains("convene.json"), "{err}");

    let missing = std::env::temp_dir().join("convene-no-such-dir/convene.toml");
    let err = ConfigLoader::new()
        .file(&missing)
        .load::<ExampleConfig>()
        .unwrap_err();
    assert!(matches!(err, ConfigError::Read { .. }), "{err:?}");
    assert!(err.to_string().contains("convene-no-such-dir"), "{err}");

    let (_dir, path) = write_file("broken.toml", "[server\nlisten = ");
    let err = ConfigLoader::new()
        .file(&path)
        .load::<ExampleConfig>()
        .unwrap_err();
    assert!(matches!(err, ConfigError::Invalid { .. }), "{err:?}");
    assert!(err.to_string().contains("broken.toml"), "{err}");
}

#[test]
fn dump_loads_back_to_the_same_value() {
    let config = ExampleConfig {
        server: ServerSettings {
            listen: addr("[::1]:9009"),
            max_message_bytes: 1 << 20,
            request_timeout: None,
            concurrency_limit: 7,
            shutdown_grace: Duration::from_millis(1500),
        },
        data_dir: PathBuf::from("/tmp/convene data"),
        store: StoreConfig {
            max_connections: 9,
            wal: false,
        },
    };
    for (format, name) in [(Format::Toml, "dump.toml"), (Format::Yaml, "dump.yaml")] {
        let text = dump(&config, format).unwrap();
        let (_dir, path) = write_file(name, &text);
        let loaded: ExampleConfig = ConfigLoader::new().file(&path).load().unwrap();
        assert_eq!(loaded, config, "{format} dump:\n{text}");
    }
    // Durations are written the way people write them.
    let toml = dump(&ExampleConfig::default(), Format::Toml).unwrap();
    assert!(toml.contains("request_timeout = \"30s\""), "{toml}");
    assert!(toml.contains("[server]"), "{toml}");
}
