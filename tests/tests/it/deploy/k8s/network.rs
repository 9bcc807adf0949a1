//! The network policies against what the containers are configured to reach and serve:
//! every endpoint a container's configuration names (its variables, flags and config
//! file: the other services, the worker registries, the database, NATS, the OTLP
//! collector, the model server, S3) has an egress rule of the caller that lets the
//! connection out and, inside the namespace, an ingress rule of the callee that lets it
//! in; every port a pod declares is admitted by an ingress rule (unless only the
//! kubelet's probes use it, which network policies do not govern); and the supervisor's
//! client API admits the clients the overlay names, not every source.

use std::net::IpAddr;

use serde_json::Value;

use super::containers::{in_namespace, launch};
use super::{NAMESPACE, Rendered, Workload, array, overlays, selects};

/// Variables whose URLs no container of the pod calls: the address agents are told to
/// use (`CONVENE_PUBLIC_URL`, through the overlay's ingress) and the link printed for
/// people (`CONVENE_JAEGER_URL`, through `kubectl port-forward`).
const NOT_CALLED: [&str; 2] = ["CONVENE_PUBLIC_URL", "CONVENE_JAEGER_URL"];

/// Variables naming the container's own address, which the supervisors call: a worker's
/// (`CONVENE_ADVERTISE`, where they dispatch) and a supervisor's
/// (`CONVENE_ADVERTISE_ENDPOINT`, where its peers forward calls for its runs).
const ADVERTISED: [&str; 2] = ["CONVENE_ADVERTISE", "CONVENE_ADVERTISE_ENDPOINT"];

/// The label that lets a pod call the supervisor's client API.
const CLIENT_LABEL: &str = "convene.dev/client";

/// An endpoint named by a container: a URL's scheme, host and port (the scheme's default
/// when the URL gives none).
#[derive(Debug, Clone, PartialEq, Eq)]
struct Endpoint {
    scheme: String,
    host: String,
    port: u16,
}

/// Every `scheme://host[:port]` of `text` whose scheme is one a service is reached by.
fn endpoints(text: &str) -> Vec<Endpoint> {
    text.split(|c: char| c.is_whitespace() || "[],\"'".contains(c))
        .filter_map(|word| word.split_once("://"))
        .filter_map(|(scheme, rest)| {
            let scheme = scheme.to_ascii_lowercase();
            let default = match scheme.as_str() {
                "http" => 80,
                "https" => 443,
                "postgres" | "postgresql" => 5432,
                "nats" => 4222,
                _ => return None,
            };
            let authority = rest.split(['/', '?']).next()?;
            let host_port = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
            // (No IPv6 literals: `[` and `]` end words, for lists.)
            let (host, port) = match host_port.rsplit_once(':') {
                Some((host, port)) => (host, port.parse().ok()?),
                None => (host_port, default),
            };
            (!host.is_empty()).then(|| Endpoint {
                scheme,
                host: host.to_owned(),
                port,
            })
        })
        .collect()
}

/// Where a connection goes: pods of the overlay (on a port number, and its name when
/// the pods declare one), or an address outside the cluster, known or not.
enum Destination<'a> {
    Pods {
        service: String,
        pods: Vec<Workload<'a>>,
        port: u16,
        port_name: Option<String>,
    },
    /// An IP address outside the overlay's pods.
    Address(IpAddr, u16),
    /// A host name outside the namespace: its addresses are not known here.
    Outside(String, u16),
}

/// The destination of `endpoint`: a Service's pods (its port translated to the pods'),
/// an address, or a host elsewhere. None for a Service the overlay lacks (reported by the
/// containers' test) and for loopback.
fn destination<'a>(rendered: &'a Rendered, endpoint: &Endpoint) -> Option<Destination<'a>> {
    if endpoint.host == "localhost" {
        return None;
    }
    if let Ok(ip) = endpoint.host.parse::<IpAddr>() {
        return (!ip.is_loopback()).then_some(Destination::Address(ip, endpoint.port));
    }
    let Some((service_name, _pod)) = in_namespace(&endpoint.host) else {
        return Some(Destination::Outside(endpoint.host.clone(), endpoint.port));
    };
    let service = rendered.get("Service", service_name)?;
    let port = array(&service["spec"]["ports"])
        .iter()
        .find(|p| p["port"] == endpoint.port)?;
    let target = if port["targetPort"].is_null() {
        &port["port"]
    } else {
        &port["targetPort"]
    };
    let pods = rendered.selected(service);
    let (port, port_name) = {
        let declared = pods
            .iter()
            .flat_map(|w| w.containers())
            .flat_map(|c| array(&c["ports"]))
            .find(|p| p["name"] == *target || p["containerPort"] == *target)?;
        (
            u16::try_from(declared["containerPort"].as_u64()?).ok()?,
            declared["name"].as_str().map(str::to_owned),
        )
    };
    Some(Destination::Pods {
        service: service_name.to_owned(),
        pods,
        port,
        port_name,
    })
}

/// Whether a rule's `ports` let `port` (named `name` by its pod) through.
fn ports_allow(rule: &Value, port: u16, name: Option<&str>) -> bool {
    let ports = array(&rule["ports"]);
    ports.is_empty()
        || ports.iter().any(|p| {
            let end = p["endPort"].as_u64();
            match &p["port"] {
                Value::Null => true,
                Value::Number(n) => n.as_u64().is_some_and(|n| {
                    n == u64::from(port) || end.is_some_and(|e| (n..=e).contains(&u64::from(port)))
                }),
                Value::String(s) => Some(s.as_str()) == name,
                _ => false,
            }
        })
}

/// Whether a peer (`podSelector`, `namespaceSelector`, or both) matches pods labelled
/// `labels` in this namespace.
fn peer_matches_pod(peer: &Value, labels: &Value) -> bool {
    if peer["ipBlock"].is_object() {
        return false;
    }
    let namespace_ok = match peer["namespaceSelector"].as_object() {
        None => true,
        Some(selector) if selector.is_empty() => true,
        Some(_) => selects(
            &peer["namespaceSelector"],
            &serde_json::json!({ "kubernetes.io/metadata.name": NAMESPACE }),
        ),
    };
    let pod_ok = match peer["podSelector"].as_object() {
        None => peer["namespaceSelector"].is_object(),
        Some(_) => selects(&peer["podSelector"], labels),
    };
    namespace_ok && pod_ok
}

/// Whether an ipBlock peer covers `ip`.
fn block_covers(peer: &Value, ip: IpAddr) -> bool {
    let in_cidr = |cidr: &str| {
        let Some((net, bits)) = cidr.split_once('/') else {
            return false;
        };
        let (Ok(net), Ok(bits)) = (net.parse::<IpAddr>(), bits.parse::<u32>()) else {
            return false;
        };
        match (net, ip) {
            (IpAddr::V4(net), IpAddr::V4(ip)) => {
                let mask = u32::MAX.checked_shl(32 - bits).unwrap_or(0);
                u32::from(net) & mask == u32::from(ip) & mask
            }
            (IpAddr::V6(net), IpAddr::V6(ip)) => {
                let mask = u128::MAX.checked_shl(128 - bits).unwrap_or(0);
                u128::from(net) & mask == u128::from(ip) & mask
            }
            _ => false,
        }
    };
    let block = &peer["ipBlock"];
    block["cidr"].as_str().is_some_and(in_cidr)
        && !array(&block["except"])
            .iter()
            .filter_map(Value::as_str)
            .any(in_cidr)
}

/// The rules of one direction (`Egress`, `Ingress`) that apply to pods labelled
/// `labels`, or None when no policy of that direction selects them (all is allowed).
fn rules<'a>(rendered: &'a Rendered, labels: &Value, direction: &str) -> Option<Vec<&'a Value>> {
    let key = direction.to_ascii_lowercase();
    let policies: Vec<&Value> = rendered
        .of_kind("NetworkPolicy")
        .filter(|p| selects(&p["spec"]["podSelector"], labels))
        .filter(|p| {
            let types = array(&p["spec"]["policyTypes"]);
            if types.is_empty() {
                direction == "Ingress" || !p["spec"]["egress"].is_null()
            } else {
                types.contains(&Value::from(direction))
            }
        })
        .collect();
    (!policies.is_empty()).then(|| {
        policies
            .into_iter()
            .flat_map(|p| array(&p["spec"][&key]))
            .collect()
    })
}

/// Whether the caller's egress lets a connection to `destination` out.
fn egress_allows(rendered: &Rendered, caller: &Value, destination: &Destination<'_>) -> bool {
    let Some(rules) = rules(rendered, caller, "Egress") else {
        return true;
    };
    rules.iter().any(|rule| {
        let peers = array(&rule["to"]);
        match destination {
            Destination::Pods {
                pods,
                port,
                port_name,
                ..
            } => {
                ports_allow(rule, *port, port_name.as_deref())
                    && (peers.is_empty()
                        || pods
                            .iter()
                            .all(|pod| peers.iter().any(|p| peer_matches_pod(p, pod.labels()))))
            }
            Destination::Address(ip, port) => {
                ports_allow(rule, *port, None)
                    && (peers.is_empty() || peers.iter().any(|p| block_covers(p, *ip)))
            }
            Destination::Outside(_, port) => {
                ports_allow(rule, *port, None)
                    && (peers.is_empty() || peers.iter().any(|p| p["ipBlock"].is_object()))
            }
        }
    })
}

/// Whether `pod`'s ingress lets a connection from pods labelled `caller` in on `port`.
fn ingress_allows(
    rendered: &Rendered,
    pod: &Workload<'_>,
    caller: &Value,
    port: u16,
    port_name: Option<&str>,
) -> bool {
    let Some(rules) = rules(rendered, pod.labels(), "Ingress") else {
        return true;
    };
    rules.iter().any(|rule| {
        let peers = array(&rule["from"]);
        ports_allow(rule, port, port_name)
            && (peers.is_empty() || peers.iter().any(|p| peer_matches_pod(p, caller)))
    })
}

/// Endpoints, each with what names it (a variable, an argument, the config file).
type Named = Vec<(String, Endpoint)>;

/// What a container calls, and the addresses of its own it advertises (which the
/// supervisors call), each endpoint with the variable (or argument, or config file)
/// naming it; and where the container is declared.
fn called(
    rendered: &Rendered,
    workload: Workload<'_>,
    container: &Value,
) -> (String, Named, Named) {
    let scratch = tempfile::tempdir().expect("a temporary directory");
    // What is wrong with the container itself is the containers' test's to report.
    let (launch, _mounts) = launch(
        rendered,
        workload,
        container,
        scratch.path(),
        &mut Vec::new(),
    );
    let mut calls = Vec::new();
    let mut advertised = Vec::new();
    for (name, value) in &launch.env {
        if NOT_CALLED.contains(&name.as_str()) {
            continue;
        }
        let list = if ADVERTISED.contains(&name.as_str()) {
            &mut advertised
        } else {
            &mut calls
        };
        list.extend(endpoints(value).into_iter().map(|e| (name.clone(), e)));
    }
    for arg in &launch.args {
        calls.extend(
            endpoints(arg)
                .into_iter()
                .map(|e| ("an argument".to_owned(), e)),
        );
    }
    if let Some(file) = launch.flag("config")
        && let Ok(text) = std::fs::read_to_string(file)
    {
        calls.extend(
            endpoints(&text)
                .into_iter()
                .map(|e| ("its --config file".to_owned(), e)),
        );
    }
    // Artifacts in S3 without an endpoint of their own: AWS's, over HTTPS.
    if launch.var("CONVENE_ARTIFACTS__STORE") == Some("s3")
        && launch.var("CONVENE_ARTIFACTS__ENDPOINT").is_none()
    {
        calls.push((
            "CONVENE_ARTIFACTS__STORE=s3".to_owned(),
            Endpoint {
                scheme: "https".to_owned(),
                host: "s3.amazonaws.com".to_owned(),
                port: 443,
            },
        ));
    }
    (launch.origin, calls, advertised)
}

#[test]
fn network_policies_let_through_every_connection_the_configuration_makes() {
    let Some(overlays) = overlays() else { return };
    let mut problems = Vec::new();
    let mut checked = 0;
    for rendered in overlays {
        let overlay = rendered.overlay;
        // Ports someone is configured to call, per workload.
        let mut named: Vec<(String, u16)> = Vec::new();
        for workload in rendered.workloads() {
            for container in workload.convene_containers() {
                let (origin, calls, advertised) = called(rendered, workload, container);
                let supervisors: Vec<Workload<'_>> = rendered
                    .workloads()
                    .filter(|w| w.program().as_deref() == Some("convene-supervisor"))
                    .collect();
                let callers: Vec<(String, &Value, Endpoint)> = calls
                    .into_iter()
                    .map(|(what, e)| (format!("{origin}: {what}"), workload.labels(), e))
                    .chain(advertised.into_iter().flat_map(|(what, e)| {
                        let origin = &origin;
                        supervisors.iter().map(move |s| {
                            (
                                format!("{overlay}: {} calling {what} of {origin}", s.id()),
                                s.labels(),
                                e.clone(),
                            )
                        })
                    }))
                    .collect();
                for (who, caller, endpoint) in callers {
                    let Some(destination) = destination(rendered, &endpoint) else {
                        continue;
                    };
                    checked += 1;
                    let target = match &destination {
                        Destination::Pods {
                            service,
                            port,
                            pods,
                            ..
                        } => {
                            for pod in pods {
                                named.push((pod.id(), *port));
                            }
                            format!("Service {service} (pod port {port})")
                        }
                        Destination::Address(ip, port) => format!("{ip}:{port}"),
                        Destination::Outside(host, port) => {
                            format!("{host}:{port} (outside the cluster)")
                        }
                    };
                    if !egress_allows(rendered, caller, &destination) {
                        problems.push(format!(
                            "{who} names {}://{}:{}, but no egress rule lets it reach {target}",
                            endpoint.scheme, endpoint.host, endpoint.port
                        ));
                    }
                    if let Destination::Pods {
                        pods,
                        port,
                        port_name,
                        ..
                    } = &destination
                    {
                        for pod in pods {
                            if !ingress_allows(rendered, pod, caller, *port, port_name.as_deref()) {
                                problems.push(format!(
                                    "{who} names {}://{}:{}, but no ingress rule of {} admits it \
                                     on port {port}",
                                    endpoint.scheme,
                                    endpoint.host,
                                    endpoint.port,
                                    pod.id()
                                ));
                            }
                        }
                    }
                }
            }
        }
        // Every port a pod declares is admitted from somewhere, unless only its own
        // probes use it (the kubelet's connections are not subject to policies).
        for workload in rendered.workloads() {
            for container in workload.containers() {
                for port in array(&container["ports"]) {
                    let number = port["containerPort"]
                        .as_u64()
                        .and_then(|n| u16::try_from(n).ok())
                        .expect("a containerPort");
                    let name = port["name"].as_str();
                    let probed = ["startupProbe", "readinessProbe", "livenessProbe"]
                        .iter()
                        .any(|probe| {
                            let spec = &container[*probe];
                            ["grpc", "tcpSocket", "httpGet"].iter().any(|h| {
                                let p = &spec[*h]["port"];
                                *p == number || (name.is_some() && p.as_str() == name)
                            })
                        });
                    let called = named.contains(&(workload.id(), number));
                    if probed && !called {
                        continue;
                    }
                    let admitted = rules(rendered, workload.labels(), "Ingress")
                        .is_none_or(|rules| rules.iter().any(|r| ports_allow(r, number, name)));
                    if !admitted {
                        problems.push(format!(
                            "{overlay}: {} listens on port {number}{}, but no NetworkPolicy \
                             admits connections to it",
                            workload.id(),
                            name.map(|n| format!(" ({n})")).unwrap_or_default()
                        ));
                    }
                }
            }
        }
        // The supervisor's client API: the clients the overlay names (pods labelled
        // convene.dev/client, the ingress controller's namespace), not any source.
        let supervisor = rendered
            .workloads()
            .find(|w| w.program().as_deref() == Some("convene-supervisor"))
            .expect("a supervisor");
        for rule in rules(rendered, supervisor.labels(), "Ingress").unwrap_or_default() {
            let peers = array(&rule["from"]);
            if peers.is_empty() {
                problems.push(format!(
                    "{overlay}: a NetworkPolicy admits any source to the supervisor: name its \
                     clients (pods labelled {CLIENT_LABEL}: \"true\", the ingress controller's \
                     namespace)"
                ));
            }
            for peer in peers {
                let Some(namespaces) = peer["namespaceSelector"].as_object() else {
                    continue;
                };
                let by_name = namespaces
                    .get("matchLabels")
                    .and_then(|l| l.get("kubernetes.io/metadata.name"))
                    .is_some();
                let clients = peer["podSelector"]["matchLabels"][CLIENT_LABEL] == "true";
                if !by_name && !clients {
                    problems.push(format!(
                        "{overlay}: a NetworkPolicy admits {peer} to the supervisor: from \
                         other namespaces, admit only pods labelled {CLIENT_LABEL}: \"true\" \
                         or a namespace by name (kubernetes.io/metadata.name)"
                    ));
                }
            }
        }
        let admits_clients =
            |peer: &Value| peer["podSelector"]["matchLabels"][CLIENT_LABEL] == "true";
        let admits_a_namespace = |peer: &Value| {
            peer["podSelector"].is_null()
                && peer["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"]
                    .is_string()
        };
        let api_rules: Vec<&Value> = rules(rendered, supervisor.labels(), "Ingress")
            .unwrap_or_default()
            .into_iter()
            .filter(|r| ports_allow(r, 7400, Some("grpc")))
            .collect();
        for (what, found) in [
            (
                format!("pods labelled {CLIENT_LABEL}: \"true\""),
                api_rules
                    .iter()
                    .any(|r| array(&r["from"]).iter().any(admits_clients)),
            ),
            (
                "the ingress controller's namespace".to_owned(),
                api_rules
                    .iter()
                    .any(|r| array(&r["from"]).iter().any(admits_a_namespace)),
            ),
        ] {
            if !found {
                problems.push(format!(
                    "{overlay}: the supervisor's client API (7400) does not admit {what}"
                ));
            }
        }
    }
    assert!(checked >= 40, "only {checked} connections found");
    assert!(
        problems.is_empty(),
        "network policies against the configuration:\n  - {}",
        problems.join("\n  - ")
    );
}

#[test]
fn endpoints_are_read_with_their_default_ports() {
    let got = endpoints(
        "[https://a.b:7500, http://c] postgres://u:p@db.example:6432/x?y nats://nats \
         https://models.example/v1 ftp://x:1",
    );
    let got: Vec<(&str, &str, u16)> = got
        .iter()
        .map(|e| (e.scheme.as_str(), e.host.as_str(), e.port))
        .collect();
    assert_eq!(
        got,
        [
            ("https", "a.b", 7500),
            ("http", "c", 80),
            ("postgres", "db.example", 6432),
            ("nats", "nats", 4222),
            ("https", "models.example", 443),
        ]
    );
}

#[test]
fn ip_blocks_cover_addresses_but_their_exceptions() {
    let block = serde_json::json!({
        "ipBlock": { "cidr": "0.0.0.0/0", "except": ["10.0.0.0/8"] }
    });
    assert!(block_covers(&block, "52.1.2.3".parse().unwrap()));
    assert!(!block_covers(&block, "10.1.2.3".parse().unwrap()));
    let one = serde_json::json!({ "ipBlock": { "cidr": "172.18.0.1/32" } });
    assert!(block_covers(&one, "172.18.0.1".parse().unwrap()));
    assert!(!block_covers(&one, "172.18.0.2".parse().unwrap()));
}
