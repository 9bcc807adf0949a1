//! The deployment material stays true to the code. No container engine or cluster runs
//! here, so these checks are what keeps it from rotting:
//!
//! - the image (`deploy/docker/Dockerfile`) copies exactly the workspace's binaries and
//!   exposes exactly the services' default listen ports (gRPC, and the gateway's HTTP);
//! - the Kubernetes overlays (`deploy/k8s`) render, pass the Kubernetes schemas and agree
//!   with the binaries, the examples and each other ([`k8s`]);
//! - the compose file (`deploy/compose.yaml`) agrees with the binaries ([`compose`]).
//!
//! What a container asks of a binary is checked by the binary itself ([`binaries`]):
//! its `--help` and `--dump-config`, as `cargo test` built it.

use std::collections::BTreeSet;
use std::io::Write as _;
use std::path::PathBuf;
use std::sync::OnceLock;

use crate::harness::repo_root;

mod binaries;
mod compose;
mod k8s;

/// Where the image keeps the repository's `examples/` directory.
const IMAGE_EXAMPLES: &str = "/usr/share/convene/examples/";

/// A path under the repository's `examples/`, as the image holds it under
/// [`IMAGE_EXAMPLES`].
fn examples_path(relative: &str) -> PathBuf {
    repo_root().join("examples").join(relative)
}

/// The calling test cannot run without `what`, which `how`: says so, or fails when
/// `CONVENE_TEST_REQUIRE_SERVICES` forbids skips.
fn unavailable(what: &str, how: &str) {
    let test = convene_store::test_util::current_test();
    assert!(
        !convene_store::test_util::services_required(),
        "{test} needs {what}, which {how}; {} is set, so it may not be skipped",
        convene_store::test_util::REQUIRE_SERVICES_ENV
    );
    // Past the harness's capture: a skip must be seen.
    let _ = writeln!(
        std::io::stderr(),
        "skipped: {test} needs {what}, which {how}"
    );
}

/// A URL found in a variable or an argument: `https://convene-policy:7401`.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Url {
    /// `http`, `https`, `nats`, ...
    scheme: String,
    host: String,
    port: u16,
}

/// Every URL with a port in `text`, e.g. both of `[http://a:7400, https://b.c:7400]`.
fn urls(text: &str) -> Vec<Url> {
    text.split(|c: char| c.is_whitespace() || "[],\"'".contains(c))
        .filter_map(|word| word.split_once("://"))
        .filter_map(|(scheme, rest)| {
            let authority = rest.split(['/', '?']).next()?;
            let host_port = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
            let (host, port) = host_port.rsplit_once(':')?;
            Some(Url {
                scheme: scheme.to_ascii_lowercase(),
                host: host.to_owned(),
                port: port.parse().ok()?,
            })
        })
        .collect()
}

/// The `host:port` of every URL in `text` whose host is a bare name (a Service or a
/// compose service), e.g. `convene-policy:7401` in `http://convene-policy:7401` or in
/// `[http://a:7400, http://b:7400]`. Addresses, `localhost` and dotted names are left
/// out: nothing here can tell whether they answer.
fn url_hosts(text: &str) -> Vec<(String, u16)> {
    urls(text)
        .into_iter()
        .filter(|url| {
            !url.host.is_empty()
                && url.host != "localhost"
                && !url.host.contains(['.', '$', '['])
                && url.host.parse::<std::net::IpAddr>().is_err()
        })
        .map(|url| (url.host, url.port))
        .collect()
}

/// The workspace's binaries, as `cargo metadata` lists them (asked once).
fn workspace_binaries() -> &'static BTreeSet<String> {
    static BINARIES: OnceLock<BTreeSet<String>> = OnceLock::new();
    BINARIES.get_or_init(list_workspace_binaries)
}

fn list_workspace_binaries() -> BTreeSet<String> {
    let out = std::process::Command::new(env!("CARGO"))
        .args([
            "metadata",
            "--format-version",
            "1",
            "--no-deps",
            "--offline",
        ])
        .current_dir(repo_root())
        .output()
        .expect("cargo metadata runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let metadata: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    metadata["packages"]
        .as_array()
        .expect("packages")
        .iter()
        .flat_map(|p| p["targets"].as_array().cloned().unwrap_or_default())
        .filter(|t| {
            t["kind"]
                .as_array()
                .is_some_and(|k| k.iter().any(|k| k == "bin"))
        })
        .map(|t| t["name"].as_str().expect("name").to_owned())
        .collect()
}

/// The services' default listen ports, as their configuration modules declare them
/// (`services/<service>/src/config.rs`): each one's gRPC port (`pub const DEFAULT_PORT:
/// u16 = ...;`), and the HTTP ports of those that also serve HTTP (`pub const
/// DEFAULT_HTTP_LISTEN: SocketAddr = ...;`, the port its last number).
fn default_ports() -> (BTreeSet<u16>, BTreeSet<u16>) {
    let services = repo_root().join("services");
    let configs: Vec<String> = std::fs::read_dir(&services)
        .expect("services/")
        .map(|entry| entry.expect("an entry").path().join("src/config.rs"))
        .filter_map(|config| std::fs::read_to_string(config).ok())
        .collect();
    let grpc = configs
        .iter()
        .filter_map(|text| {
            text.lines()
                .find_map(|l| l.strip_prefix("pub const DEFAULT_PORT: u16 = "))
                .map(|v| v.trim_end_matches(';').parse().expect("a port number"))
        })
        .collect();
    let http = configs
        .iter()
        .filter_map(|text| {
            let start = text.find("pub const DEFAULT_HTTP_LISTEN: SocketAddr =")?;
            let declaration = &text[start..];
            let declaration = &declaration[..declaration.find(';').expect("a `;`")];
            let port = declaration
                .split(|c: char| !c.is_ascii_digit())
                .rfind(|n| !n.is_empty())
                .and_then(|n| n.parse().ok())
                .unwrap_or_else(|| panic!("no port in {declaration:?}"));
            Some(port)
        })
        .collect();
    (grpc, http)
}

#[test]
fn the_image_copies_every_workspace_binary_and_exposes_the_default_ports() {
    let dockerfile = std::fs::read_to_string(repo_root().join("deploy/docker/Dockerfile"))
        .expect("deploy/docker/Dockerfile");
    let copied: BTreeSet<String> = dockerfile
        .lines()
        .filter(|l| l.starts_with("COPY --from=build /src/target/release/"))
        .map(|l| {
            let from = l.split_whitespace().nth(2).expect("a source");
            from.rsplit('/').next().expect("a file name").to_owned()
        })
        .collect();
    assert_eq!(
        &copied,
        workspace_binaries(),
        "the image's binaries are the workspace's"
    );

    let exposed: BTreeSet<u16> = dockerfile
        .lines()
        .filter_map(|l| l.strip_prefix("EXPOSE "))
        .flat_map(|ports| ports.split_whitespace().map(|p| p.parse().expect("a port")))
        .collect();
    let (grpc, http) = default_ports();
    assert_eq!(grpc.len(), 6, "six services, six gRPC ports: {grpc:?}");
    assert_eq!(
        http.len(),
        1,
        "one service (the gateway) also serves HTTP: {http:?}"
    );
    let defaults: BTreeSet<u16> = grpc.union(&http).copied().collect();
    assert_eq!(
        exposed, defaults,
        "the image exposes the default listen ports (gRPC and HTTP)"
    );

    // Built by the toolchain the repository pins.
    let toolchain = std::fs::read_to_string(repo_root().join("rust-toolchain.toml"))
        .expect("rust-toolchain.toml");
    let pinned = toolchain
        .lines()
        .find_map(|l| l.strip_prefix("channel = "))
        .expect("a pinned channel")
        .trim_matches('"');
    let minor = pinned.rsplit_once('.').map_or(pinned, |(m, _)| m);
    assert!(
        dockerfile.contains(&format!("FROM rust:{minor}-")),
        "the builder image is Rust {minor}"
    );
    // The sources go in, the build output and local state do not.
    let ignore = std::fs::read_to_string(repo_root().join(".dockerignore")).expect(".dockerignore");
    for path in ["/target", "/.convene", "/.git"] {
        assert!(
            ignore.lines().any(|l| l == path),
            ".dockerignore lacks {path}"
        );
    }
}

#[test]
fn url_hosts_are_the_bare_names_of_urls() {
    assert_eq!(
        url_hosts("[http://convene-supervisor-peers:7400, http://10.0.0.1:7400]"),
        [("convene-supervisor-peers".to_owned(), 7400)]
    );
    assert_eq!(
        url_hosts("postgres://convene:secret@postgres:5432/convene?pool_max_conns=8"),
        [("postgres".to_owned(), 5432)]
    );
    assert!(url_hosts("http://localhost:16686 https://db.example.com:5432 plain").is_empty());
    assert_eq!(
        urls("[https://convene-supervisor-0.convene-supervisor-peers.convene.svc:7400]"),
        [Url {
            scheme: "https".to_owned(),
            host: "convene-supervisor-0.convene-supervisor-peers.convene.svc".to_owned(),
            port: 7400
        }]
    );
}
