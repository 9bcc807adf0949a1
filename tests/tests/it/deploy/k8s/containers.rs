//! Each convene container of the rendered overlays, as its binary will see it: its
//! variables resolved (ConfigMaps, Secrets, the downward API, `$(VAR)`), its ConfigMap
//! and Secret volumes written to a scratch directory, and every path into a volume mapped
//! there; then checked by the binary ([`binaries::check`]) and against what the binary
//! says it does (listen port, data directory).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use super::{Rendered, Workload, array, overlays, program};
use crate::deploy::binaries::{self, Launch};
use crate::deploy::{examples_path, url_hosts};

#[test]
fn every_convene_container_agrees_with_its_binary() {
    let Some(overlays) = overlays() else { return };
    let mut problems = Vec::new();
    let mut checked = 0;
    for rendered in overlays {
        for workload in rendered.workloads() {
            for container in workload.convene_containers() {
                let scratch = tempfile::tempdir().expect("a temporary directory");
                let (launch, mounts) =
                    launch(rendered, workload, container, scratch.path(), &mut problems);
                check_container(rendered, container, &launch, &mounts, &mut problems);
                checked += 1;
            }
        }
    }
    assert!(checked >= 12, "only {checked} convene containers found");
    assert!(
        problems.is_empty(),
        "the manifests disagree with the binaries:\n  - {}",
        problems.join("\n  - ")
    );
}

/// A volume mounted into a container, mapped onto this machine.
struct Mount {
    path: String,
    local: PathBuf,
    /// `configMap`, `secret`, `emptyDir`, `persistentVolumeClaim`, ...
    source: String,
    /// The keys of a Secret or ConfigMap volume.
    keys: Vec<String>,
}

/// The container as its binary will see it: variables resolved (ConfigMaps, Secrets,
/// the downward API, `$(VAR)`), ConfigMap and Secret volumes written under `scratch`,
/// and every path into a volume mapped there.
fn launch(
    rendered: &Rendered,
    workload: Workload<'_>,
    container: &Value,
    scratch: &Path,
    problems: &mut Vec<String>,
) -> (Launch, Vec<Mount>) {
    let origin = format!(
        "{}: {}, container {}",
        rendered.overlay,
        workload.id(),
        container["name"].as_str().unwrap_or_default()
    );
    let mut mounts = Vec::new();
    for mount in array(&container["volumeMounts"]) {
        let path = mount["mountPath"].as_str().expect("a mountPath").to_owned();
        let volume = array(&workload.pod["spec"]["volumes"])
            .iter()
            .find(|v| v["name"] == mount["name"])
            .or_else(|| {
                // A StatefulSet's claim templates are volumes too.
                array(&workload.object["spec"]["volumeClaimTemplates"])
                    .iter()
                    .find(|t| t["metadata"]["name"] == mount["name"])
            });
        let Some(volume) = volume else {
            problems.push(format!(
                "{origin}: mounts volume {}, which the pod lacks",
                mount["name"]
            ));
            continue;
        };
        let local = scratch.join(path.trim_start_matches('/'));
        std::fs::create_dir_all(&local).expect("a scratch directory");
        let (source, files) = volume_files(rendered, volume, &origin, problems);
        for (file, content) in &files {
            std::fs::write(local.join(file), content).expect("a mounted file is written");
        }
        mounts.push(Mount {
            path,
            local,
            source,
            keys: files.into_keys().collect(),
        });
    }
    // The longest mount path first, so nested mounts win.
    mounts.sort_by_key(|m| std::cmp::Reverse(m.path.len()));

    let mut launch = Launch {
        origin: origin.clone(),
        program: program(container),
        ..Launch::default()
    };
    let map = |value: &str, what: &str, problems: &mut Vec<String>| {
        map_path(value, &mounts, &format!("{origin}: {what}"), problems)
    };
    let command = array(&container["command"]);
    for arg in command.iter().skip(1).chain(array(&container["args"])) {
        let arg = arg.as_str().expect("string arguments");
        launch.args.push(map(arg, "an argument", problems));
    }
    for var in array(&container["env"]) {
        let name = var["name"].as_str().expect("a variable name").to_owned();
        let from = &var["valueFrom"];
        let value = if let Some(value) = var["value"].as_str() {
            expand(value, &launch.env)
        } else if let Some(field) = from["fieldRef"]["fieldPath"].as_str() {
            match field {
                "metadata.name" => format!(
                    "{}-7d4b9c-x2x7q",
                    workload.object["metadata"]["name"]
                        .as_str()
                        .unwrap_or_default()
                ),
                "metadata.namespace" => "convene".to_owned(),
                "status.podIP" => "10.244.1.17".to_owned(),
                other => other.to_owned(),
            }
        } else {
            let (kind, reference) = if from["secretKeyRef"].is_object() {
                launch.secret_vars.insert(name.clone());
                ("Secret", &from["secretKeyRef"])
            } else {
                ("ConfigMap", &from["configMapKeyRef"])
            };
            let (object, key) = (
                reference["name"].as_str().unwrap_or_default(),
                reference["key"].as_str().unwrap_or_default(),
            );
            match rendered.data(kind, object, key) {
                Some(value) => value,
                None if reference["optional"] == true => continue,
                None => {
                    problems.push(format!(
                        "{origin}: {name} comes from key {key:?} of {kind} {object}, which is not there"
                    ));
                    continue;
                }
            }
        };
        let value = map(&value, &name, problems);
        launch.env.push((name, value));
    }
    assert!(
        container["envFrom"].is_null(),
        "{origin}: list variables one by one in `env` (not `envFrom`), so each is checked"
    );
    (launch, mounts)
}

/// The files a volume holds, by name (ConfigMap and Secret volumes), and its kind.
fn volume_files(
    rendered: &Rendered,
    volume: &Value,
    origin: &str,
    problems: &mut Vec<String>,
) -> (String, BTreeMap<String, String>) {
    let object = volume.as_object().expect("a volume");
    let source = object
        .keys()
        .find(|k| *k != "name")
        .cloned()
        .unwrap_or_else(|| "persistentVolumeClaim".to_owned());
    let (kind, name) = match source.as_str() {
        "configMap" => ("ConfigMap", &volume["configMap"]["name"]),
        "secret" => ("Secret", &volume["secret"]["secretName"]),
        _ => return (source, BTreeMap::new()),
    };
    let name = name.as_str().unwrap_or_default();
    let Some(object) = rendered.get(kind, name) else {
        problems.push(format!(
            "{origin}: mounts {kind} {name}, which is not there"
        ));
        return (source, BTreeMap::new());
    };
    let items = array(&volume[&source]["items"]);
    let keys: Vec<(String, String)> = if items.is_empty() {
        object["data"]
            .as_object()
            .into_iter()
            .flat_map(Map::keys)
            .map(|k| (k.clone(), k.clone()))
            .collect()
    } else {
        items
            .iter()
            .map(|i| {
                (
                    i["key"].as_str().unwrap_or_default().to_owned(),
                    i["path"].as_str().unwrap_or_default().to_owned(),
                )
            })
            .collect()
    };
    let mut files = BTreeMap::new();
    for (key, path) in keys {
        match rendered.data(kind, name, &key) {
            Some(content) => {
                files.insert(path, content);
            }
            None => problems.push(format!(
                "{origin}: mounts key {key:?} of {kind} {name}, which is not there"
            )),
        }
    }
    (source, files)
}

/// `value` with a path into a volume mapped onto its local copy. A path into a
/// ConfigMap or Secret volume must name a file it holds; a path into the image's
/// examples must exist in the repository's.
fn map_path(value: &str, mounts: &[Mount], what: &str, problems: &mut Vec<String>) -> String {
    if let Some(relative) = value.strip_prefix(crate::deploy::IMAGE_EXAMPLES)
        && !examples_path(relative).exists()
    {
        problems.push(format!(
            "{what} names {value}, but the image's examples (examples/ here) hold no {relative}"
        ));
    }
    let Some(mount) = mounts.iter().find(|m| {
        value == m.path
            || value
                .strip_prefix(&m.path)
                .is_some_and(|r| r.starts_with('/'))
    }) else {
        return value.to_owned();
    };
    let local = PathBuf::from(format!(
        "{}{}",
        mount.local.display(),
        &value[mount.path.len()..]
    ));
    if ["configMap", "secret"].contains(&mount.source.as_str())
        && value != mount.path
        && !local.exists()
    {
        problems.push(format!(
            "{what} names {value}, which the {} mounted at {} does not hold (it holds {:?})",
            mount.source, mount.path, mount.keys
        ));
    }
    local.display().to_string()
}

/// Kubernetes' `$(VAR)` expansion over the variables defined before.
fn expand(value: &str, defined: &[(String, String)]) -> String {
    let mut out = String::new();
    let mut rest = value;
    while let Some(start) = rest.find("$(") {
        out.push_str(&rest[..start]);
        let after = &rest[start + 2..];
        match after.find(')') {
            Some(end) => {
                let name = &after[..end];
                match defined.iter().rev().find(|(n, _)| n == name) {
                    Some((_, v)) => out.push_str(v),
                    None => out.push_str(&rest[start..start + 3 + end]),
                }
                rest = &after[end + 1..];
            }
            None => {
                out.push_str(&rest[start..]);
                rest = "";
            }
        }
    }
    out.push_str(rest);
    out
}

/// What a convene container must be beyond what its binary accepts: reachable on the
/// port it declares and probes, its data directory writable, no development credentials,
/// JSON logs, traces exported, and every endpoint it names a Service of the overlay.
fn check_container(
    rendered: &Rendered,
    container: &Value,
    launch: &Launch,
    mounts: &[Mount],
    problems: &mut Vec<String>,
) {
    let origin = &launch.origin;
    if launch
        .flag("log-format")
        .or(launch.var("CONVENE_LOG_FORMAT"))
        != Some("json")
    {
        problems.push(format!(
            "{origin}: give it `--log-format json` (log collectors read JSON)"
        ));
    }
    if launch.var("OTEL_EXPORTER_OTLP_ENDPOINT").is_none() {
        problems.push(format!(
            "{origin}: OTEL_EXPORTER_OTLP_ENDPOINT is unset: its spans go nowhere"
        ));
    }
    for (name, value) in &launch.env {
        for (host, port) in url_hosts(value) {
            let known = rendered
                .get("Service", &host)
                .is_some_and(|s| array(&s["spec"]["ports"]).iter().any(|p| p["port"] == port));
            if !known {
                problems.push(format!(
                    "{origin}: {name} names {host}:{port}, which no Service of the overlay serves"
                ));
            }
        }
    }
    let Some(service) = binaries::check(launch, problems) else {
        return;
    };
    let Some(dump) = service.dump else { return };

    if binaries::lookup(&dump, &["dev_credentials"]) == Some(&Value::Bool(true)) {
        problems.push(format!(
            "{origin}: dev_credentials is on: in a cluster every credential is a Secret and \
             its hash is in the policy file (CONVENE_DEV_CREDENTIALS=false)"
        ));
    }
    let listening = binaries::listen_addrs(&dump, origin, problems);
    for (key, listen) in &listening {
        if !listen.ip().is_unspecified() {
            problems.push(format!(
                "{origin}: listens on {listen} ({key}), which other pods cannot reach: listen \
                 on 0.0.0.0"
            ));
        }
        let port = listen.port();
        if !array(&container["ports"])
            .iter()
            .any(|p| p["containerPort"] == port)
        {
            problems.push(format!(
                "{origin}: listens on port {port} ({key}) but does not declare it"
            ));
        }
    }
    // Health is served on the gRPC port: the probes ask there.
    let port = listening[0].1.port();
    for probe in ["startupProbe", "readinessProbe", "livenessProbe"] {
        let spec = &container[probe];
        if spec.is_null() {
            if probe != "startupProbe" {
                problems.push(format!("{origin}: has no {probe}"));
            }
            continue;
        }
        if spec["grpc"]["port"] != port {
            problems.push(format!(
                "{origin}: its {probe} must be a gRPC probe (grpc.health.v1.Health) on port \
                 {port}, the port it listens on"
            ));
        }
    }
    // The root file system is read-only: the data directory must be a volume.
    if let Some(data_dir) = binaries::lookup(&dump, &["data_dir"]).and_then(Value::as_str) {
        let writable = mounts.iter().any(|m| {
            !["configMap", "secret"].contains(&m.source.as_str())
                && Path::new(data_dir).starts_with(&m.local)
        });
        if !writable {
            problems.push(format!(
                "{origin}: its data directory {data_dir} is on the read-only root file system: \
                 mount a volume there"
            ));
        }
        // A signing-key ring from a Secret is read where the policy service keeps it.
        for mount in mounts
            .iter()
            .filter(|m| m.keys.iter().any(|k| k == "signing-keys.json"))
        {
            if mount.local != Path::new(data_dir).join("policy/keys") {
                problems.push(format!(
                    "{origin}: mounts a signing-key ring at {}, but the policy service reads \
                     it from <data_dir>/policy/keys",
                    mount.path
                ));
            }
        }
    }
}

#[test]
fn variables_expand_as_kubernetes_expands_them() {
    let defined = [("POD_IP".to_owned(), "10.0.0.1".to_owned())];
    assert_eq!(
        expand("http://$(POD_IP):7410", &defined),
        "http://10.0.0.1:7410"
    );
    assert_eq!(expand("$(UNSET)/x", &defined), "$(UNSET)/x");
}
