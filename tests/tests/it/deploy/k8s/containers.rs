//! Each convene container of the rendered overlays, as its binary will see it: its
//! variables resolved (ConfigMaps, Secrets, the downward API, `$(VAR)`), its ConfigMap
//! and Secret volumes written to a scratch directory, and every path into a volume mapped
//! there; then checked by the binary ([`binaries::check`]) and against what the binary
//! says it does (listen port, data directory), and against the overlay's TLS: how it
//! serves, how it is probed, how it calls the others.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use super::{
    CALLED_WITH_BEARERS, NAMESPACE, PUBLIC_CREDENTIAL_OVERLAYS, Rendered, TLS_OVERLAYS, Workload,
    array, overlays, program,
};
use crate::deploy::binaries::{self, Launch, Transport};
use crate::deploy::{Url, examples_path, url_hosts, urls};

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
pub(super) struct Mount {
    path: String,
    local: PathBuf,
    /// `configMap`, `secret`, `emptyDir`, `persistentVolumeClaim`, ...
    source: String,
    /// The ConfigMap or Secret it holds, by name.
    object: String,
    /// The keys of a Secret or ConfigMap volume.
    keys: Vec<String>,
}

/// The container as its binary will see it: variables resolved (ConfigMaps, Secrets,
/// the downward API, `$(VAR)`), ConfigMap and Secret volumes written under `scratch`,
/// and every path into a volume mapped there.
pub(super) fn launch(
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
        let object = volume[&source]["secretName"]
            .as_str()
            .or(volume[&source]["name"].as_str())
            .unwrap_or_default()
            .to_owned();
        for (file, content) in &files {
            std::fs::write(local.join(file), content).expect("a mounted file is written");
        }
        mounts.push(Mount {
            path,
            local,
            source,
            object,
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
            let expanded = expand(value, &launch.env);
            if expanded.contains("$(") {
                problems.push(format!(
                    "{origin}: {name} = {value:?} refers to a variable not defined before it, \
                     which Kubernetes leaves unexpanded (a patch's variables go first)"
                ));
            }
            expanded
        } else if let Some(field) = from["fieldRef"]["fieldPath"].as_str() {
            match field {
                // A StatefulSet's first pod, a Deployment's pod.
                "metadata.name" => {
                    let name = workload.object["metadata"]["name"]
                        .as_str()
                        .unwrap_or_default();
                    if workload.object["kind"] == "StatefulSet" {
                        format!("{name}-0")
                    } else {
                        format!("{name}-7d4b9c-x2x7q")
                    }
                }
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
/// ports it declares and probes, its data directory writable, no development credentials
/// (and public ones said to be public), JSON logs, traces exported, every endpoint it
/// names a Service of the overlay, and with TLS the supervisor's internal listener
/// requiring client certificates.
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
    check_endpoints(rendered, launch, problems);
    let Some(service) = binaries::check(launch, problems) else {
        return;
    };
    let Some(dump) = service.dump else { return };
    let tls = matches!(
        check_transport(rendered, launch, mounts, problems),
        Some(Transport::Tls { .. })
    );
    if tls && launch.program == "convene-worker" {
        check_registries(rendered, launch, &dump, problems);
    }

    // An overlay whose credentials are committed with the source says so in the first
    // log line of every service (--public-credentials); one whose credentials are yours
    // must not.
    let public = PUBLIC_CREDENTIAL_OVERLAYS.contains(&rendered.overlay);
    let said = launch.args.iter().any(|a| a == "--public-credentials")
        || launch
            .var("CONVENE_PUBLIC_CREDENTIALS")
            .is_some_and(|v| v == "true");
    if public != said {
        problems.push(if public {
            format!(
                "{origin}: overlay {} runs on credentials committed with the source: set                  CONVENE_PUBLIC_CREDENTIALS=true, so its first log line says they are public",
                rendered.overlay
            )
        } else {
            format!(
                "{origin}: CONVENE_PUBLIC_CREDENTIALS is set, but overlay {}'s credentials are                  your own",
                rendered.overlay
            )
        });
    }
    // With TLS, the supervisor's internal listener (the worker registry) requires the
    // workers' client certificates, from its own identity's CA.
    if tls && binaries::lookup(&dump, &["internal_listen"]).is_some() {
        match binaries::lookup(&dump, &["internal_client_ca"]).and_then(Value::as_str) {
            Some(file) if Path::new(file).is_file() => {
                let identity = launch.program.replacen("convene-", "convene-tls-", 1);
                let secret = mounts
                    .iter()
                    .find(|m| m.source == "secret" && Path::new(file).starts_with(&m.local));
                if secret.is_none_or(|m| m.object != identity) {
                    problems.push(format!(
                        "{origin}: internal_client_ca must be ca.crt of its Secret {identity}"
                    ));
                }
            }
            _ => problems.push(format!(
                "{origin}: its internal listener serves TLS without requiring client                  certificates: set CONVENE_INTERNAL_CLIENT_CA to the mesh's CA (only workers                  register there)"
            )),
        }
    }
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
    // Health is served on the gRPC port: the probes ask there. The kubelet's gRPC
    // probes speak plaintext, so a TLS listener is probed by a TCP connect (the port is
    // bound once the service is ready, and closed when it drains).
    let port = listening[0].1.port();
    for probe in ["startupProbe", "readinessProbe", "livenessProbe"] {
        let spec = &container[probe];
        if spec.is_null() {
            if probe != "startupProbe" {
                problems.push(format!("{origin}: has no {probe}"));
            }
            continue;
        }
        let handlers: Vec<&String> = spec
            .as_object()
            .into_iter()
            .flat_map(Map::keys)
            .filter(|k| ["grpc", "tcpSocket", "httpGet", "exec"].contains(&k.as_str()))
            .collect();
        let (handler, what) = if tls {
            (
                "tcpSocket",
                "a tcpSocket probe (its listener serves TLS, which gRPC probes cannot speak)",
            )
        } else {
            ("grpc", "a gRPC probe (grpc.health.v1.Health)")
        };
        if handlers != [handler] || spec[handler]["port"] != port {
            problems.push(format!(
                "{origin}: its {probe} must be {what} on port {port}, the port it listens on"
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

/// The container's TLS as its overlay wants it: TLS overlays serve TLS on every
/// listener (mutual TLS unless people and agents call it), from files of a mounted
/// Secret; the others plaintext, said so (`CONVENE_INSECURE=true`).
fn check_transport(
    rendered: &Rendered,
    launch: &Launch,
    mounts: &[Mount],
    problems: &mut Vec<String>,
) -> Option<Transport> {
    let origin = &launch.origin;
    let transport = binaries::transport(launch, problems)?;
    let expected = if TLS_OVERLAYS.contains(&rendered.overlay) {
        Transport::Tls {
            client_ca: !CALLED_WITH_BEARERS.contains(&launch.program.as_str()),
        }
    } else {
        Transport::Plaintext
    };
    if transport != expected {
        let want = match expected {
            Transport::Tls { client_ca: true } => {
                "TLS that requires client certificates (CONVENE_TLS_CERT, CONVENE_TLS_KEY, \
                 CONVENE_TLS_CLIENT_CA): only the mesh calls it"
            }
            Transport::Tls { client_ca: false } => {
                "TLS without client certificates (CONVENE_TLS_CERT, CONVENE_TLS_KEY, no \
                 CONVENE_TLS_CLIENT_CA): people and agents call it with bearer credentials"
            }
            Transport::Plaintext => "plaintext, said so with CONVENE_INSECURE=true",
        };
        problems.push(format!(
            "{origin}: serves {transport:?}; overlay {} wants {want}",
            rendered.overlay
        ));
    }
    // Each service its own identity: the Secret convene-tls-<service>.
    let identity = launch.program.replacen("convene-", "convene-tls-", 1);
    for (var, file) in binaries::tls_files(launch) {
        let secret = mounts
            .iter()
            .find(|m| m.source == "secret" && Path::new(file).starts_with(&m.local));
        match secret {
            Some(m) if Path::new(file).is_file() => {
                if m.object != identity {
                    problems.push(format!(
                        "{origin}: {var} is a file of Secret {}, but its identity is Secret \
                         {identity}",
                        m.object
                    ));
                }
            }
            _ => problems.push(format!(
                "{origin}: {var} must name a key of a mounted Secret (tls.crt, tls.key, \
                 ca.crt); it names {file}"
            )),
        }
    }
    Some(transport)
}

/// The Service, and the pod for a pod's own name, that `host` names in the namespace:
/// `svc`, `svc.convene.svc` or `pod.svc.convene.svc` (with or without
/// `.cluster.local`). None for anything else: addresses, `localhost`, other domains.
pub(super) fn in_namespace(host: &str) -> Option<(&str, Option<&str>)> {
    if host.is_empty()
        || host == "localhost"
        || host.contains(['$', '[', ':'])
        || host.parse::<std::net::IpAddr>().is_ok()
    {
        return None;
    }
    let host = host.strip_suffix(".cluster.local").unwrap_or(host);
    let local = match host.strip_suffix(&format!(".{NAMESPACE}.svc")) {
        Some(local) => local,
        None if !host.contains('.') => host,
        None => return None,
    };
    match local.split_once('.') {
        None => Some((local, None)),
        Some((pod, service)) if !service.contains('.') => Some((service, Some(pod))),
        Some(_) => None,
    }
}

/// Every http(s) endpoint the container names that leads into the namespace: its
/// Service (and pod) exist, and it is called `https://` exactly when the convene pods
/// behind it serve TLS, with a CA to verify them.
fn check_endpoints(rendered: &Rendered, launch: &Launch, problems: &mut Vec<String>) {
    let origin = &launch.origin;
    let named = launch
        .env
        .iter()
        .map(|(n, v)| (n.as_str(), v.as_str()))
        .chain(launch.args.iter().map(|a| ("an argument", a.as_str())));
    for (name, value) in named {
        for url in urls(value) {
            if !["http", "https"].contains(&url.scheme.as_str()) {
                continue;
            }
            let Some((service_name, pod)) = in_namespace(&url.host) else {
                continue;
            };
            let Some(service) = rendered.get("Service", service_name) else {
                // Bare names are reported with every other scheme's (url_hosts).
                if url.host.contains('.') {
                    problems.push(format!(
                        "{origin}: {name} names {}, but no Service {service_name} is in the overlay",
                        url.host
                    ));
                }
                continue;
            };
            if !array(&service["spec"]["ports"])
                .iter()
                .any(|p| p["port"] == url.port)
            {
                if url.host.contains('.') {
                    problems.push(format!(
                        "{origin}: {name} names port {} of Service {service_name}, which it lacks",
                        url.port
                    ));
                }
                continue;
            }
            if let Some(pod) = pod {
                check_pod_name(
                    rendered,
                    service,
                    pod,
                    &format!("{origin}: {name}"),
                    problems,
                );
            }
            let targets: Vec<Workload<'_>> = rendered
                .selected(service)
                .into_iter()
                .filter(|w| w.convene_containers().next().is_some())
                .collect();
            if targets.is_empty() {
                continue; // Jaeger, PostgreSQL: not convene's listeners.
            }
            let tls = targets.iter().any(Workload::serves_tls);
            let scheme = if tls { "https" } else { "http" };
            if url.scheme != scheme {
                problems.push(format!(
                    "{origin}: {name} calls {}://{}:{}, but the pods of Service {service_name} \
                     serve {}: call it {scheme}://",
                    url.scheme,
                    url.host,
                    url.port,
                    if tls { "TLS" } else { "plaintext" }
                ));
            }
            if url.scheme == "https" && launch.var("CONVENE_TLS_CA").is_none() {
                problems.push(format!(
                    "{origin}: {name} calls {}, but CONVENE_TLS_CA names no CA to verify it with",
                    url.host
                ));
            }
        }
    }
}

/// A pod's own name under a headless Service is a pod of the StatefulSet named after
/// it: `<statefulset>-<ordinal>`, the ordinal below its most replicas.
fn check_pod_name(
    rendered: &Rendered,
    service: &Value,
    pod: &str,
    what: &str,
    problems: &mut Vec<String>,
) {
    let service_name = service["metadata"]["name"].as_str().unwrap_or_default();
    let owner = rendered.workloads().find(|w| {
        w.object["kind"] == "StatefulSet" && w.object["spec"]["serviceName"] == service_name
    });
    let Some(owner) = owner else {
        problems.push(format!(
            "{what} names pod {pod} of Service {service_name}, whose pods have no names of \
             their own (no StatefulSet has it as serviceName)"
        ));
        return;
    };
    let name = owner.object["metadata"]["name"]
        .as_str()
        .unwrap_or_default();
    let ordinal = pod
        .strip_prefix(name)
        .and_then(|rest| rest.strip_prefix('-'))
        .and_then(|n| n.parse::<u64>().ok());
    let replicas = rendered.max_replicas(&owner);
    if ordinal.is_none_or(|n| n >= replicas) {
        problems.push(format!(
            "{what} names pod {pod} of Service {service_name}, which is none of the pods of \
             {} ({name}-0 to {name}-{})",
            owner.id(),
            replicas.saturating_sub(1)
        ));
    }
}

/// A worker keeps itself registered with every supervisor replica. An `https://` name
/// is one connection, not resolved to every replica (the certificate names the host,
/// not its addresses), so with TLS the registries are each replica by its own name.
fn check_registries(
    rendered: &Rendered,
    launch: &Launch,
    dump: &Value,
    problems: &mut Vec<String>,
) {
    let origin = &launch.origin;
    let Some(supervisor) = rendered
        .workloads()
        .find(|w| w.program().as_deref() == Some("convene-supervisor"))
    else {
        problems.push(format!(
            "{origin}: no supervisor in the overlay to register with"
        ));
        return;
    };
    let service = supervisor.object["spec"]["serviceName"]
        .as_str()
        .unwrap_or_default();
    let name = supervisor.object["metadata"]["name"]
        .as_str()
        .unwrap_or_default();
    let expected: std::collections::BTreeSet<String> = (0..rendered.max_replicas(&supervisor))
        .map(|n| format!("{name}-{n}.{service}"))
        .collect();
    let listed: std::collections::BTreeSet<String> =
        array(binaries::lookup(dump, &["registry_endpoints"]).unwrap_or(&Value::Null))
            .iter()
            .filter_map(Value::as_str)
            .flat_map(urls)
            .map(|Url { host, .. }| match in_namespace(&host) {
                Some((service, Some(pod))) => format!("{pod}.{service}"),
                _ => host,
            })
            .collect();
    if listed != expected {
        problems.push(format!(
            "{origin}: with TLS, its registry_endpoints must be every supervisor replica by its \
             own name, https://<pod>.{service}.{NAMESPACE}.svc:<port> ({expected:?}); they are \
             {listed:?}"
        ));
    }
}

#[test]
fn hosts_in_the_namespace_are_services_and_pods() {
    assert_eq!(
        in_namespace("convene-policy"),
        Some(("convene-policy", None))
    );
    assert_eq!(
        in_namespace("convene-gateway.convene.svc"),
        Some(("convene-gateway", None))
    );
    assert_eq!(
        in_namespace("convene-worker-3.convene-worker.convene.svc.cluster.local"),
        Some(("convene-worker", Some("convene-worker-3")))
    );
    for elsewhere in [
        "localhost",
        "10.244.1.17",
        "agents.example.com",
        "x.other.svc",
        "$(POD_NAME).convene-worker.convene.svc",
    ] {
        assert_eq!(in_namespace(elsewhere), None, "{elsewhere}");
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
