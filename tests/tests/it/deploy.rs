//! The deployment material stays true to the code: every binary the image copies is a
//! binary of the workspace (and every workspace binary is in the image), and every
//! port it exposes is a service's default listen port. No container engine runs here,
//! so this is what keeps the Dockerfile from rotting.

use std::collections::BTreeSet;

use crate::harness::repo_root;

/// The workspace's binaries, as `cargo metadata` lists them.
fn workspace_binaries() -> BTreeSet<String> {
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

/// Each service's default listen port, as its configuration module declares it
/// (`pub const DEFAULT_PORT: u16 = ...;` in `services/<service>/src/config.rs`).
fn default_ports() -> BTreeSet<u16> {
    let services = repo_root().join("services");
    std::fs::read_dir(&services)
        .expect("services/")
        .map(|entry| entry.expect("an entry").path().join("src/config.rs"))
        .filter_map(|config| std::fs::read_to_string(config).ok())
        .filter_map(|text| {
            text.lines()
                .find_map(|l| l.strip_prefix("pub const DEFAULT_PORT: u16 = "))
                .map(|v| v.trim_end_matches(';').parse().expect("a port number"))
        })
        .collect()
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
        copied,
        workspace_binaries(),
        "the image's binaries are the workspace's"
    );

    let exposed: BTreeSet<u16> = dockerfile
        .lines()
        .filter_map(|l| l.strip_prefix("EXPOSE "))
        .flat_map(|ports| ports.split_whitespace().map(|p| p.parse().expect("a port")))
        .collect();
    let defaults = default_ports();
    assert_eq!(defaults.len(), 5, "five services, five ports: {defaults:?}");
    assert_eq!(
        exposed, defaults,
        "the image exposes the default listen ports"
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
