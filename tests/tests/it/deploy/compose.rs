//! `deploy/compose.yaml` agrees with the binaries as the Kubernetes manifests do: each
//! convene container runs a workspace binary with flags and variables it accepts, listens
//! where its published port and its callers expect (plaintext, said so, or TLS), and
//! finds the files it is given. No
//! container engine runs here, so this is what keeps the compose file from rotting.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_json::Value;

use super::binaries::{self, Launch};
use super::{IMAGE_EXAMPLES, examples_path, url_hosts, urls};
use crate::harness::repo_root;

fn compose() -> Value {
    let path = repo_root().join("deploy/compose.yaml");
    let text = std::fs::read_to_string(&path).expect("deploy/compose.yaml");
    let mut yaml: serde_yaml::Value = serde_yaml::from_str(&text).expect("compose.yaml is YAML");
    yaml.apply_merge().expect("compose.yaml's merge keys apply");
    serde_json::to_value(yaml).expect("compose.yaml as JSON values")
}

/// A value as compose passes it, `${VAR:-default}` taken at its default.
fn interpolate(value: &str) -> String {
    let mut out = String::new();
    let mut rest = value;
    while let Some(start) = rest.find("${") {
        out.push_str(&rest[..start]);
        let after = &rest[start + 2..];
        let end = after.find('}').expect("a closing brace");
        if let Some((_, default)) = after[..end].split_once(":-") {
            out.push_str(default);
        }
        rest = &after[end + 1..];
    }
    out.push_str(rest);
    out
}

fn scalar(value: &Value) -> String {
    match value {
        Value::String(s) => interpolate(s),
        Value::Null => String::new(),
        other => other.to_string(),
    }
}

#[test]
fn the_compose_file_agrees_with_the_binaries() {
    let compose = compose();
    let deploy = repo_root().join("deploy");
    for include in compose["include"].as_array().into_iter().flatten() {
        let file = deploy.join(include.as_str().expect("an included file"));
        assert!(
            file.is_file(),
            "compose.yaml includes {}, which is missing",
            file.display()
        );
    }
    let services = compose["services"].as_object().expect("services");
    let mut problems = Vec::new();
    let mut checked = 0;
    for (name, service) in services {
        let image = service["image"].as_str().unwrap_or_default();
        if !image.starts_with("convene:") {
            continue;
        }
        let scratch = tempfile::tempdir().expect("a temporary directory");
        // Container paths of bind mounts map onto the repository; volumes onto scratch.
        let mut mounts: Vec<(String, PathBuf)> = Vec::new();
        for volume in service["volumes"].as_array().into_iter().flatten() {
            let spec = volume.as_str().expect("short volume syntax");
            let mut parts = spec.split(':');
            let (source, target) = (
                parts.next().unwrap_or_default(),
                parts.next().unwrap_or_default(),
            );
            let local = if source.starts_with('.') {
                let local = deploy.join(source);
                if !local.exists() {
                    problems.push(format!("compose {name}: mounts {source}, which is missing"));
                }
                local
            } else {
                let local = scratch.path().join(source);
                std::fs::create_dir_all(&local).expect("a scratch volume");
                local
            };
            mounts.push((target.to_owned(), local));
        }
        mounts.sort_by_key(|(target, _)| std::cmp::Reverse(target.len()));
        let map = |value: String, problems: &mut Vec<String>| {
            if let Some(relative) = value.strip_prefix(IMAGE_EXAMPLES)
                && !examples_path(relative).exists()
            {
                problems.push(format!(
                    "compose {name}: names {value}, which examples/ lacks"
                ));
            }
            match mounts
                .iter()
                .find(|(t, _)| value == *t || value.starts_with(&format!("{t}/")))
            {
                Some((target, local)) => format!("{}{}", local.display(), &value[target.len()..]),
                None => value,
            }
        };

        let entrypoint: Vec<String> = service["entrypoint"]
            .as_array()
            .into_iter()
            .flatten()
            .map(scalar)
            .collect();
        let command: Vec<String> = service["command"]
            .as_array()
            .into_iter()
            .flatten()
            .map(scalar)
            .collect();
        let mut words = entrypoint.into_iter().chain(command);
        let program = words.next().unwrap_or_else(|| "convene".to_owned());
        let mut launch = Launch {
            origin: format!("compose {name}"),
            program: program.rsplit('/').next().unwrap_or_default().to_owned(),
            ..Launch::default()
        };
        for word in words {
            launch.args.push(map(word, &mut problems));
        }
        let environment: BTreeMap<String, String> = match &service["environment"] {
            Value::Object(vars) => vars.iter().map(|(k, v)| (k.clone(), scalar(v))).collect(),
            Value::Array(vars) => vars
                .iter()
                .filter_map(|v| {
                    v.as_str()?
                        .split_once('=')
                        .map(|(k, v)| (k.to_owned(), interpolate(v)))
                })
                .collect(),
            _ => BTreeMap::new(),
        };
        let mut calls_https = false;
        for (var, value) in environment {
            for (host, _) in url_hosts(&value) {
                if !services.contains_key(&host)
                    && !compose_includes_service(&compose, &deploy, &host)
                {
                    problems.push(format!(
                        "compose {name}: {var} names {host}, which is no service"
                    ));
                }
            }
            // A convene service is called https:// exactly when it serves TLS.
            for url in urls(&value) {
                let Some(target) = services.get(&url.host).filter(|s| {
                    s["image"]
                        .as_str()
                        .is_some_and(|i| i.starts_with("convene:"))
                }) else {
                    continue;
                };
                let tls = target["environment"]["CONVENE_TLS_CERT"].is_string();
                calls_https |= url.scheme == "https";
                let scheme = if tls { "https" } else { "http" };
                if url.scheme != scheme {
                    problems.push(format!(
                        "compose {name}: {var} calls {}://{}, which serves {}: call it {scheme}://",
                        url.scheme,
                        url.host,
                        if tls { "TLS" } else { "plaintext" }
                    ));
                }
            }
            let value = map(value, &mut problems);
            launch.env.push((var, value));
        }
        checked += 1;

        let Some(checked_service) = binaries::check(&launch, &mut problems) else {
            // A client command: the credential it acts with must be where it looks.
            if let (Some(data_dir), Some(principal)) = (launch.flag("data-dir"), launch.flag("as"))
            {
                let credential = map(
                    format!("{data_dir}/credentials/{principal}.secret"),
                    &mut problems,
                );
                if !Path::new(&credential).is_file() {
                    problems.push(format!(
                        "compose {name}: acts as {principal}, whose credential is not mounted"
                    ));
                }
            }
            continue;
        };
        let Some(dump) = checked_service.dump else {
            continue;
        };
        if binaries::lookup(&dump, &["dev_credentials"]) == Some(&Value::Bool(true)) {
            problems.push(format!(
                "compose {name}: dev_credentials is on; the mesh runs as a cluster does"
            ));
        }
        // Listening on 0.0.0.0 takes TLS or CONVENE_INSECURE=true; TLS files are mounted,
        // and https:// calls to the services have a CA.
        binaries::transport(&launch, &mut problems);
        for (var, file) in binaries::tls_files(&launch) {
            if !Path::new(file).is_file() {
                problems.push(format!(
                    "compose {name}: {var} names {file}, which is not mounted"
                ));
            }
        }
        if calls_https && launch.var("CONVENE_TLS_CA").is_none() {
            problems.push(format!(
                "compose {name}: calls https:// endpoints without CONVENE_TLS_CA to verify them"
            ));
        }
        let listening = binaries::listen_addrs(&dump, &launch.origin, &mut problems);
        for (key, listen) in &listening {
            if !listen.ip().is_unspecified() {
                problems.push(format!(
                    "compose {name}: listens on {listen} ({key}), which other containers cannot reach"
                ));
            }
        }
        let ports: Vec<String> = listening
            .iter()
            .map(|(_, l)| l.port().to_string())
            .collect();
        for port in service["ports"].as_array().into_iter().flatten() {
            let published = scalar(port);
            let inside = published.rsplit(':').next().unwrap_or_default();
            if !ports.iter().any(|p| p == inside) {
                problems.push(format!(
                    "compose {name}: publishes {published}, but listens on {}",
                    ports.join(" and ")
                ));
            }
        }
    }
    assert!(
        checked >= 7,
        "only {checked} convene containers in compose.yaml"
    );
    assert!(
        problems.is_empty(),
        "compose.yaml disagrees with the binaries:\n  - {}",
        problems.join("\n  - ")
    );
}

/// Whether a file compose.yaml includes defines service `host` (Jaeger's).
fn compose_includes_service(compose: &Value, deploy: &Path, host: &str) -> bool {
    compose["include"]
        .as_array()
        .into_iter()
        .flatten()
        .any(|file| {
            let text = std::fs::read_to_string(deploy.join(file.as_str().unwrap_or_default()))
                .unwrap_or_default();
            serde_yaml::from_str::<Value>(&text).is_ok_and(|v| v["services"][host].is_object())
        })
}

#[test]
fn compose_interpolation_takes_defaults() {
    assert_eq!(interpolate("${X:-http://a:1/v1}"), "http://a:1/v1");
    assert_eq!(interpolate("${X:-}"), "");
    assert_eq!(interpolate("plain"), "plain");
}
