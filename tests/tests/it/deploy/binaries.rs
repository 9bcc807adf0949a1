//! A convene process as a manifest starts it, checked against the binary it names: the
//! binary is the workspace's, every flag is in its `--help`, and every `CONVENE_*`
//! variable is a key of its configuration that `--dump-config` shows with the value the
//! manifest gives. The binary is the judge: a variable it refuses (unknown keys are
//! errors) is reported by name, whatever the manifest's author believed.

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Command, Output};

use serde_json::Value;

/// A process as a manifest (a container, a compose service) starts it, its paths already
/// mapped onto this machine.
#[derive(Debug, Default)]
pub struct Launch {
    /// Where it is declared, for messages: `dev: Deployment/convene-worker, container worker`.
    pub origin: String,
    /// The program the manifest runs, by name: `convene-worker`.
    pub program: String,
    /// Its arguments.
    pub args: Vec<String>,
    /// Its environment, resolved, in order.
    pub env: Vec<(String, String)>,
    /// The variables whose values come from Secrets: never printed.
    pub secret_vars: BTreeSet<String>,
}

impl Launch {
    /// The value of variable `name`, if set.
    pub fn var(&self, name: &str) -> Option<&str> {
        self.env
            .iter()
            .rev()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    /// The value of flag `--name`, as `--name VALUE` or `--name=VALUE`.
    pub fn flag(&self, name: &str) -> Option<&str> {
        let long = format!("--{name}");
        let mut args = self.args.iter();
        while let Some(arg) = args.next() {
            if *arg == long {
                return args.next().map(String::as_str);
            }
            if let Some(value) = arg.strip_prefix(&format!("{long}=")) {
                return Some(value);
            }
        }
        None
    }

    /// `text` with every secret value of this process replaced, for messages.
    fn redact(&self, text: &str) -> String {
        self.env
            .iter()
            .filter(|(name, value)| self.secret_vars.contains(name) && !value.is_empty())
            .fold(text.to_owned(), |text, (_, value)| {
                text.replace(value, "<secret>")
            })
    }

    /// A process's standard error as one line of a message, secrets redacted.
    fn error_line(&self, stderr: &[u8]) -> String {
        let text = String::from_utf8_lossy(stderr);
        self.redact(&text.lines().map(str::trim).collect::<Vec<_>>().join(" "))
    }

    /// The value of `name` for a message: `<from a Secret>` for secret ones.
    fn shown(&self, name: &str, value: &str) -> String {
        if self.secret_vars.contains(name) {
            "<from a Secret>".to_owned()
        } else {
            format!("{value:?}")
        }
    }
}

/// A workspace binary as `cargo test` built it, next to this test binary
/// (`target/<profile>/`).
pub fn built_binary(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("the test binary's path");
    let dir = exe
        .parent()
        .and_then(std::path::Path::parent)
        .expect("the test binary lives in target/<profile>/deps");
    dir.join(format!("{name}{}", std::env::consts::EXE_SUFFIX))
}

/// Reserved variables (no configuration key, no flag) that a binary reads itself.
const READ_WITHOUT_FLAG: &[(&str, &str)] = &[
    ("convene-worker", "CONVENE_MODEL"),
    ("convene-gateway", "CONVENE_JAEGER_URL"),
];

/// How a service's listeners serve, as its flags and variables say.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transport {
    /// TLS with a certificate and its key; `client_ca`: callers must present a
    /// certificate (mutual TLS).
    Tls { client_ca: bool },
    /// Plaintext, allowed off loopback by `--insecure` (`CONVENE_INSECURE=true`).
    Plaintext,
}

/// The value of a TLS setting: flag `--name` or variable `var`.
fn setting<'a>(launch: &'a Launch, flag: &str, var: &str) -> Option<&'a str> {
    launch
        .flag(flag)
        .or_else(|| launch.var(var))
        .filter(|v| !v.is_empty())
}

/// The files of `launch`'s TLS settings that it names: certificate, key, client CA and
/// CA, by variable name.
pub fn tls_files(launch: &Launch) -> Vec<(&'static str, &str)> {
    [
        ("tls-cert", "CONVENE_TLS_CERT"),
        ("tls-key", "CONVENE_TLS_KEY"),
        ("tls-client-ca", "CONVENE_TLS_CLIENT_CA"),
        ("tls-ca", "CONVENE_TLS_CA"),
    ]
    .into_iter()
    .filter_map(|(flag, var)| setting(launch, flag, var).map(|v| (var, v)))
    .collect()
}

/// How a service that listens on a non-loopback address serves: TLS (a certificate
/// and its key) or plaintext it says it means (`CONVENE_INSECURE=true`), exactly one;
/// anything else makes the binary exit at start, or is ambiguous, and goes to
/// `problems` (then None).
pub fn transport(launch: &Launch, problems: &mut Vec<String>) -> Option<Transport> {
    let origin = &launch.origin;
    let cert = setting(launch, "tls-cert", "CONVENE_TLS_CERT").is_some();
    let key = setting(launch, "tls-key", "CONVENE_TLS_KEY").is_some();
    let client_ca = setting(launch, "tls-client-ca", "CONVENE_TLS_CLIENT_CA").is_some();
    let insecure = if launch.args.iter().any(|a| a == "--insecure") {
        true
    } else {
        match launch.var("CONVENE_INSECURE") {
            None => false,
            Some("true") => true,
            Some("false") => false,
            Some(other) => {
                problems.push(format!(
                    "{origin}: CONVENE_INSECURE is {other:?}: say `true` or `false`"
                ));
                return None;
            }
        }
    };
    if cert != key {
        problems.push(format!(
            "{origin}: serving TLS takes both CONVENE_TLS_CERT and CONVENE_TLS_KEY, not one"
        ));
        return None;
    }
    match (cert, insecure) {
        (true, false) => Some(Transport::Tls { client_ca }),
        (false, true) => {
            if client_ca {
                problems.push(format!(
                    "{origin}: CONVENE_TLS_CLIENT_CA without a certificate of its own to serve \
                     TLS with (CONVENE_TLS_CERT, CONVENE_TLS_KEY)"
                ));
            }
            Some(Transport::Plaintext)
        }
        (true, true) => {
            problems.push(format!(
                "{origin}: both TLS (CONVENE_TLS_CERT) and CONVENE_INSECURE=true: drop \
                 CONVENE_INSECURE, which only matters for plaintext"
            ));
            None
        }
        (false, false) => {
            problems.push(format!(
                "{origin}: listens off loopback in plaintext, which the binary refuses at \
                 start (exit status 2): give it CONVENE_TLS_CERT and CONVENE_TLS_KEY, or \
                 CONVENE_INSECURE=true where plaintext is meant"
            ));
            None
        }
    }
}

/// What [`check`] learned of a service: its effective configuration.
pub struct Service {
    /// `--dump-config` as YAML, read into JSON values; None when even the variables
    /// it knows did not give one (the problems say why).
    pub dump: Option<Value>,
}

/// Checks `launch` against its binary, adding what is wrong to `problems`. For a service
/// (its `--help` offers `--dump-config`) also returns its effective configuration.
pub fn check(launch: &Launch, problems: &mut Vec<String>) -> Option<Service> {
    let origin = &launch.origin;
    let workspace = super::workspace_binaries();
    if !workspace.contains(&launch.program) {
        problems.push(format!(
            "{origin}: runs {:?}, which is not a binary of the workspace ({workspace:?})",
            launch.program
        ));
        return None;
    }
    let binary = built_binary(&launch.program);
    assert!(
        binary.exists(),
        "{} is missing: build it with `cargo build -p {}` (`cargo test --workspace` builds \
         every binary)",
        binary.display(),
        package_of(&launch.program)
    );

    // `convene serve policy --flag`: the subcommand is part of the program.
    let subcommands: Vec<&String> = launch
        .args
        .iter()
        .take_while(|a| !a.starts_with('-'))
        .collect();
    let rest = &launch.args[subcommands.len()..];
    let invoke = || {
        let mut command = Command::new(&binary);
        command.args(&subcommands).env_clear();
        command
    };

    let help = run(invoke().arg("--help"));
    assert!(
        help.status.success(),
        "{} {subcommands:?} --help failed: {}",
        launch.program,
        String::from_utf8_lossy(&help.stderr)
    );
    let help = String::from_utf8_lossy(&help.stdout).into_owned();
    let (flags, flag_vars) = help_flags(&help);
    let known_problems = problems.len();
    for arg in rest.iter().filter(|a| a.starts_with("--")) {
        let name = arg.split('=').next().unwrap_or(arg);
        if !flags.contains(name) {
            problems.push(format!(
                "{origin}: {name} is not a flag of `{} {}` (its --help lists {flags:?})",
                launch.program,
                subcommands
                    .iter()
                    .map(|s| s.as_str())
                    .collect::<Vec<_>>()
                    .join(" ")
            ));
        }
    }
    if !flags.contains("--dump-config") {
        return None;
    }
    if problems.len() > known_problems {
        // An unknown flag fails every run; the variables are checked once it is fixed.
        return Some(Service { dump: None });
    }

    // Variables the command line reads (`[env: X]`) or the binary reads itself are not
    // configuration keys; every other CONVENE_* one must be.
    let reserved: BTreeSet<&str> = convene_server::config::RESERVED_ENV_VARS
        .iter()
        .copied()
        .collect();
    let keys: Vec<&(String, String)> = launch
        .env
        .iter()
        .filter(|(name, _)| {
            name.starts_with(convene_server::config::ENV_PREFIX)
                && !flag_vars.contains(name)
                && !reserved.contains(name.as_str())
        })
        .collect();
    // A reserved variable (no configuration key) must be one this binary reads: through
    // a flag (its --help names it, as for CONVENE_TLS_CERT or CONVENE_INSECURE), or
    // itself. Otherwise it is ignored, whatever the manifest meant by it.
    for (name, _) in &launch.env {
        if reserved.contains(name.as_str())
            && !flag_vars.contains(name)
            && !READ_WITHOUT_FLAG.contains(&(launch.program.as_str(), name.as_str()))
        {
            problems.push(format!(
                "{origin}: sets {name}, which `{}` ignores: no flag of its --help reads it \
                 (it lists {flag_vars:?})",
                launch.program
            ));
        }
    }
    let dump_with = |env: &[&(String, String)]| {
        let mut command = invoke();
        command.args(rest).arg("--dump-config=yaml");
        command.envs(env.iter().map(|(n, v)| (n, v)));
        run(&mut command)
    };
    let all: Vec<&(String, String)> = launch.env.iter().collect();
    let mut output = dump_with(&all);
    let mut refused = BTreeSet::new();
    if !output.status.success() {
        // Which variables does it refuse? Each alone (the others' problems aside).
        for var in &keys {
            let alone = dump_with(&[*var]);
            if !alone.status.success() {
                refused.insert(var.0.clone());
                problems.push(format!(
                    "{origin}: {} is refused by `{} --dump-config` (nested keys are joined \
                     with `__`): {}",
                    var.0,
                    launch.program,
                    launch.error_line(&alone.stderr)
                ));
            }
        }
        let known: Vec<&(String, String)> = launch
            .env
            .iter()
            .filter(|(n, _)| !refused.contains(n))
            .collect();
        output = dump_with(&known);
        if !output.status.success() {
            problems.push(format!(
                "{origin}: `{} --dump-config` fails with the manifest's flags and variables: {}",
                launch.program,
                launch.error_line(&output.stderr)
            ));
            return Some(Service { dump: None });
        }
    }
    let dump: Value = serde_yaml::from_slice(&output.stdout).expect("--dump-config=yaml is YAML");

    for (name, value) in keys.iter().filter(|(n, _)| !refused.contains(n)) {
        let path: Vec<String> = name[convene_server::config::ENV_PREFIX.len()..]
            .split(convene_server::config::ENV_SEPARATOR)
            .map(str::to_lowercase)
            .collect();
        match lookup(&dump, &path) {
            None | Some(Value::Null) => problems.push(format!(
                "{origin}: {name} sets `{}`, which `{} --dump-config` does not show",
                path.join("."),
                launch.program
            )),
            Some(dumped) if !same(value, dumped) => problems.push(format!(
                "{origin}: {name} = {} but the effective `{}` is {}",
                launch.shown(name, value),
                path.join("."),
                if launch.secret_vars.contains(name) {
                    "different".to_owned()
                } else {
                    dumped.to_string()
                }
            )),
            Some(_) => {}
        }
    }
    Some(Service { dump: Some(dump) })
}

/// The addresses a service listens on, by configuration key, as its dumped
/// configuration says: `server.listen` (gRPC: its API, health and reflection); for a
/// service that also serves HTTP (the gateway's A2A), `http_listen` unless it is `off`;
/// for the supervisor, `internal_listen` (the worker registry) when set.
/// A value that is no address is reported in `problems` and left out.
pub fn listen_addrs(
    dump: &Value,
    origin: &str,
    problems: &mut Vec<String>,
) -> Vec<(&'static str, SocketAddr)> {
    let listen = lookup(dump, &["server", "listen"])
        .and_then(Value::as_str)
        .and_then(|l| l.parse().ok())
        .expect("a service's dump has server.listen");
    let mut addrs = vec![("server.listen", listen)];
    match lookup(dump, &["http_listen"]).and_then(Value::as_str) {
        None | Some("off") => {}
        Some(http) => match http.parse() {
            Ok(addr) => addrs.push(("http_listen", addr)),
            Err(_) => problems.push(format!(
                "{origin}: its effective http_listen {http:?} is neither an address nor `off`"
            )),
        },
    }
    if let Some(internal) = lookup(dump, &["internal_listen"]).and_then(Value::as_str) {
        match internal.parse() {
            Ok(addr) => addrs.push(("internal_listen", addr)),
            Err(_) => problems.push(format!(
                "{origin}: its effective internal_listen {internal:?} is not an address"
            )),
        }
    }
    addrs
}

/// The value at `path` of a dumped configuration.
pub fn lookup<'a>(dump: &'a Value, path: &[impl AsRef<str>]) -> Option<&'a Value> {
    path.iter()
        .try_fold(dump, |value, key| value.get(key.as_ref()))
}

/// Whether a variable's text gives the dumped value.
fn same(text: &str, dumped: &Value) -> bool {
    match dumped {
        Value::String(s) => s == text,
        Value::Bool(b) => text.parse::<bool>().is_ok_and(|t| t == *b),
        Value::Number(n) => n.to_string() == text,
        Value::Array(_) | Value::Object(_) => {
            serde_yaml::from_str::<Value>(text).is_ok_and(|v| v == *dumped)
        }
        Value::Null => false,
    }
}

/// The long flags a `--help` text lists, and the variables it names (`[env: X=]`).
fn help_flags(help: &str) -> (BTreeSet<String>, BTreeSet<String>) {
    let mut flags = BTreeSet::new();
    let mut vars = BTreeSet::new();
    for line in help.lines().map(str::trim_start) {
        if line.starts_with('-') {
            for word in line.split([' ', ',']) {
                if let Some(flag) = word.strip_prefix("--") {
                    let name = flag
                        .split(['=', '[', '<'])
                        .next()
                        .unwrap_or(flag)
                        .trim_end_matches(']');
                    if !name.is_empty() {
                        flags.insert(format!("--{name}"));
                    }
                }
            }
        }
        if let Some((_, after)) = line.split_once("[env: ") {
            let var = after.split(['=', ']']).next().unwrap_or_default();
            vars.insert(var.to_owned());
        }
    }
    (flags, vars)
}

/// The package that builds binary `name`.
fn package_of(name: &str) -> &str {
    if name == "convene" {
        "convene-cli"
    } else {
        name
    }
}

fn run(command: &mut Command) -> Output {
    command
        .output()
        .unwrap_or_else(|e| panic!("{command:?} cannot start: {e}"))
}

#[test]
fn help_flags_and_variables_are_read_from_clap_help() {
    let help = "Options:\n      --listen <ADDR>\n          Address\n      \
                --dump-config[=<FORMAT>]\n  -h, --help\n          [env: CONVENE_CONFIG=]\n";
    let (flags, vars) = help_flags(help);
    assert_eq!(
        flags,
        BTreeSet::from(["--listen", "--dump-config", "--help"].map(String::from))
    );
    assert_eq!(vars, BTreeSet::from(["CONVENE_CONFIG".to_owned()]));
}

#[test]
fn variable_text_compares_with_typed_values() {
    assert!(same("false", &Value::Bool(false)));
    assert!(same("8", &serde_json::json!(8)));
    assert!(same(
        "[http://a:7400]",
        &serde_json::json!(["http://a:7400"])
    ));
    assert!(!same("x", &Value::Null));
}

/// The checks catch what a binary does not know, and keep secrets out of what they say.
#[test]
fn a_binary_refuses_unknown_flags_and_variables_by_name() {
    let worker = |args: &[&str], env: &[(&str, &str)]| Launch {
        origin: "a made-up container".to_owned(),
        program: "convene-worker".to_owned(),
        args: args.iter().map(|a| (*a).to_owned()).collect(),
        env: env
            .iter()
            .map(|(n, v)| ((*n).to_owned(), (*v).to_owned()))
            .collect(),
        secret_vars: BTreeSet::from(["CONVENE_DATABASE_URL".to_owned()]),
    };
    let mut problems = Vec::new();
    check(
        &worker(&["--log-format", "json", "--no-such-flag"], &[]),
        &mut problems,
    );
    assert_eq!(problems.len(), 1, "{problems:?}");
    assert!(problems[0].contains("--no-such-flag"), "{problems:?}");

    let mut problems = Vec::new();
    let launch = worker(
        &["--log-format", "json"],
        &[
            ("CONVENE_CAPACITY", "4"),
            ("CONVENE_WORKER_ID", "w-1"),
            ("CONVENE_CAPACITTY", "4"),
            // The worker keeps no database: not a key of its configuration.
            ("CONVENE_DATABASE_URL", "postgres://u:hunter2@db:5432/x"),
            // Read by its flags: accepted.
            ("CONVENE_INSECURE", "true"),
            ("CONVENE_TLS_CA", "/etc/convene/tls/ca.crt"),
            // Reserved for the client commands: the worker ignores it.
            ("CONVENE_ENDPOINT", "http://convene-supervisor:7400"),
        ],
    );
    let dump = check(&launch, &mut problems)
        .and_then(|s| s.dump)
        .expect("the known variables give a configuration");
    assert_eq!(lookup(&dump, &["capacity"]), Some(&serde_json::json!(4)));
    assert_eq!(problems.len(), 3, "{problems:?}");
    assert!(problems[0].contains("CONVENE_ENDPOINT"), "{problems:?}");
    assert!(problems[1].contains("CONVENE_CAPACITTY"), "{problems:?}");
    assert!(problems[2].contains("CONVENE_DATABASE_URL"), "{problems:?}");
    assert!(
        !problems.concat().contains("hunter2"),
        "a secret leaked: {problems:?}"
    );
}

/// A service off loopback serves TLS or says it means plaintext, exactly one of them.
#[test]
fn a_service_serves_tls_or_says_plaintext() {
    let with = |args: &[&str], env: &[(&str, &str)]| Launch {
        origin: "a made-up container".to_owned(),
        program: "convene-policy".to_owned(),
        args: args.iter().map(|a| (*a).to_owned()).collect(),
        env: env
            .iter()
            .map(|(n, v)| ((*n).to_owned(), (*v).to_owned()))
            .collect(),
        ..Launch::default()
    };
    let transport_of = |launch: &Launch| {
        let mut problems = Vec::new();
        let transport = transport(launch, &mut problems);
        (transport, problems)
    };
    let cert = ("CONVENE_TLS_CERT", "/tls/tls.crt");
    let key = ("CONVENE_TLS_KEY", "/tls/tls.key");
    let client_ca = ("CONVENE_TLS_CLIENT_CA", "/tls/ca.crt");

    assert_eq!(
        transport_of(&with(&[], &[cert, key])),
        (Some(Transport::Tls { client_ca: false }), vec![])
    );
    assert_eq!(
        transport_of(&with(&[], &[cert, key, client_ca])),
        (Some(Transport::Tls { client_ca: true }), vec![])
    );
    assert_eq!(
        transport_of(&with(&["--tls-cert", "/c", "--tls-key=/k"], &[])),
        (Some(Transport::Tls { client_ca: false }), vec![])
    );
    assert_eq!(
        transport_of(&with(&[], &[("CONVENE_INSECURE", "true")])),
        (Some(Transport::Plaintext), vec![])
    );
    assert_eq!(
        transport_of(&with(&["--insecure"], &[])),
        (Some(Transport::Plaintext), vec![])
    );
    for (launch, says) in [
        (with(&[], &[]), "CONVENE_INSECURE=true"),
        (with(&[], &[("CONVENE_INSECURE", "false")]), "exit status 2"),
        (
            with(&[], &[("CONVENE_INSECURE", "yes")]),
            "`true` or `false`",
        ),
        (with(&[], &[cert]), "not one"),
        (
            with(&[], &[cert, key, ("CONVENE_INSECURE", "true")]),
            "drop CONVENE_INSECURE",
        ),
    ] {
        let (transport, problems) = transport_of(&launch);
        assert_eq!(transport, None, "{launch:?}");
        assert!(
            problems.len() == 1 && problems[0].contains(says),
            "{launch:?}: {problems:?}"
        );
    }
    assert_eq!(
        tls_files(&with(&["--tls-ca", "/ca"], &[cert, key])),
        [
            ("CONVENE_TLS_CERT", "/tls/tls.crt"),
            ("CONVENE_TLS_KEY", "/tls/tls.key"),
            ("CONVENE_TLS_CA", "/ca"),
        ]
    );
}

/// A service told that its credentials are public (the dev overlay's and the compose
/// file's `CONVENE_PUBLIC_CREDENTIALS=true`) says so in its first log line, before
/// anything else: that they are public and the mesh is for a private cluster only.
#[test]
fn a_service_on_public_credentials_says_so_first() {
    use std::io::{BufRead as _, BufReader};
    for name in [
        "convene-policy",
        "convene-evidence-store",
        "convene-approval",
        "convene-supervisor",
        "convene-worker",
        "convene-gateway",
    ] {
        let dir = tempfile::tempdir().expect("tempdir");
        let port = convene_server::test_util::free_port();
        let mut cmd = Command::new(built_binary(name));
        cmd.args(["--listen", &format!("127.0.0.1:{port}")])
            .env("CONVENE_PUBLIC_CREDENTIALS", "true")
            .env("CONVENE_DATA_DIR", dir.path())
            .env("RUST_LOG", "info")
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped());
        if name != "convene-worker" {
            cmd.env("CONVENE_DATABASE_URL", "memory");
        }
        if name == "convene-gateway" {
            cmd.env("CONVENE_HTTP_LISTEN", "off");
        }
        let mut child = cmd.spawn().expect("the binary starts");
        let first = BufReader::new(child.stderr.take().expect("stderr"))
            .lines()
            .next()
            .and_then(Result::ok)
            .unwrap_or_default();
        let _ = child.kill();
        let _ = child.wait();
        assert!(
            first.contains("PUBLIC CREDENTIALS") && first.contains("private cluster only"),
            "{name}: the first log line is {first:?}"
        );
    }
}
