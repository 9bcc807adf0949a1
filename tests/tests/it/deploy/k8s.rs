//! The Kubernetes manifests (`deploy/k8s`): both overlays render with `kubectl
//! kustomize`, every object passes the Kubernetes schemas (`kubernetes-validate
//! --strict`), and what they say agrees with the code: each convene container with its
//! binary ([`super::binaries`]), each Service and network policy with the pods it means,
//! the policy, profiles and run templates with the examples they copy, and prod with
//! what it promises (replicas, autoscaling, disruption budgets, default deny), and the
//! network policies with every connection the containers are configured to make
//! ([`network`]). Nothing is applied to a cluster here.

use std::collections::BTreeMap;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use serde_json::{Map, Value};

use super::unavailable;
use crate::harness::repo_root;

mod containers;
mod network;

/// The overlays, each a directory under `deploy/k8s/overlays`.
const OVERLAYS: [&str; 2] = ["dev", "prod"];

/// The image every convene container runs (its repository's last path segment).
const IMAGE: &str = "convene";

/// What takes connections from outside the namespace, each a program and its one port:
/// the supervisor's client API and the gateway's A2A over HTTP.
const FRONT_DOORS: [(&str, u16); 2] = [("convene-supervisor", 7400), ("convene-gateway", 7480)];

/// The namespace every object is in.
const NAMESPACE: &str = "convene";

/// The overlays that serve TLS on every listener and call every service over
/// `https://`; the others run plaintext, said so with `CONVENE_INSECURE=true`.
const TLS_OVERLAYS: [&str; 1] = ["prod"];

/// The overlays whose credentials are committed with the source (`credentials/`,
/// dev-only values anyone can read): their services say so in their first log line
/// (`CONVENE_PUBLIC_CREDENTIALS=true`).
const PUBLIC_CREDENTIAL_OVERLAYS: [&str; 1] = ["dev"];

/// The programs that people and agents call with their bearer credentials (the
/// supervisor's API, the gateway's A2A, people deciding approvals): with TLS they ask
/// for no client certificate. Every other service is called by the mesh alone and
/// requires one (mutual TLS).
const CALLED_WITH_BEARERS: [&str; 3] =
    ["convene-supervisor", "convene-gateway", "convene-approval"];

/// One overlay, rendered.
struct Rendered {
    overlay: &'static str,
    /// `kubectl kustomize`'s output.
    text: String,
    objects: Vec<Value>,
}

impl Rendered {
    fn of_kind(&self, kind: &str) -> impl Iterator<Item = &Value> + '_ {
        let kind = kind.to_owned();
        self.objects
            .iter()
            .filter(move |o| o["kind"] == kind.as_str())
    }

    fn get(&self, kind: &str, name: &str) -> Option<&Value> {
        self.of_kind(kind).find(|o| o["metadata"]["name"] == name)
    }

    /// Deployments, StatefulSets, DaemonSets and Jobs: the objects that run pods.
    fn workloads(&self) -> impl Iterator<Item = Workload<'_>> {
        self.objects
            .iter()
            .filter(|o| {
                ["Deployment", "StatefulSet", "DaemonSet", "Job"]
                    .contains(&o["kind"].as_str().unwrap_or_default())
            })
            .map(|object| Workload {
                object,
                pod: &object["spec"]["template"],
            })
    }

    /// The workloads whose pods `service` selects.
    fn selected(&self, service: &Value) -> Vec<Workload<'_>> {
        let selector = serde_json::json!({ "matchLabels": service["spec"]["selector"] });
        self.workloads()
            .filter(|w| selects(&selector, w.labels()))
            .collect()
    }

    /// The most pods `workload` runs: its autoscaler's maximum, else its replicas.
    fn max_replicas(&self, workload: &Workload<'_>) -> u64 {
        let name = &workload.object["metadata"]["name"];
        self.of_kind("HorizontalPodAutoscaler")
            .find(|h| h["spec"]["scaleTargetRef"]["name"] == *name)
            .and_then(|h| h["spec"]["maxReplicas"].as_u64())
            .or(workload.object["spec"]["replicas"].as_u64())
            .unwrap_or(1)
    }

    /// Key `key` of ConfigMap or Secret `name` (decoded), if there.
    fn data(&self, kind: &str, name: &str, key: &str) -> Option<String> {
        let object = self.get(kind, name)?;
        let value = object["data"][key].as_str()?;
        Some(if kind == "Secret" {
            String::from_utf8(base64_decode(value)).expect("Secret values are UTF-8")
        } else {
            value.to_owned()
        })
    }
}

/// An object that runs pods, with its pod template.
#[derive(Clone, Copy)]
struct Workload<'a> {
    object: &'a Value,
    pod: &'a Value,
}

impl Workload<'_> {
    fn id(&self) -> String {
        format!(
            "{}/{}",
            self.object["kind"].as_str().unwrap_or_default(),
            self.object["metadata"]["name"].as_str().unwrap_or_default()
        )
    }

    fn labels(&self) -> &Value {
        &self.pod["metadata"]["labels"]
    }

    fn containers(&self) -> impl Iterator<Item = &Value> {
        let spec = &self.pod["spec"];
        array(&spec["initContainers"])
            .iter()
            .chain(array(&spec["containers"]))
    }

    /// The containers that run the convene image.
    fn convene_containers(&self) -> impl Iterator<Item = &Value> {
        self.containers().filter(|c| {
            let image = c["image"].as_str().unwrap_or_default();
            let repository = image.rsplit_once(':').map_or(image, |(r, _)| r);
            repository.rsplit('/').next() == Some(IMAGE)
        })
    }

    /// Whether its convene containers serve TLS (are given a certificate).
    fn serves_tls(&self) -> bool {
        self.convene_containers().any(|c| {
            array(&c["env"])
                .iter()
                .any(|e| e["name"] == "CONVENE_TLS_CERT")
                || array(&c["args"]).iter().any(|a| {
                    a.as_str()
                        .is_some_and(|a| a == "--tls-cert" || a.starts_with("--tls-cert="))
                })
        })
    }

    /// The program its first convene container runs, e.g. `convene-worker`.
    fn program(&self) -> Option<String> {
        self.convene_containers().next().map(program)
    }
}

fn program(container: &Value) -> String {
    container["command"][0]
        .as_str()
        .unwrap_or(IMAGE)
        .rsplit('/')
        .next()
        .unwrap_or_default()
        .to_owned()
}

fn array(value: &Value) -> &[Value] {
    value.as_array().map_or(&[], Vec::as_slice)
}

fn kubectl() -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join("kubectl"))
        .find(|p| p.is_file())
}

/// Both overlays, rendered once per test binary; None (after saying so) without kubectl.
fn overlays() -> Option<&'static [Rendered]> {
    static RENDERED: OnceLock<Vec<Rendered>> = OnceLock::new();
    let Some(kubectl) = kubectl() else {
        unavailable(
            "kubectl",
            "is not on PATH (it renders the kustomize overlays)",
        );
        return None;
    };
    Some(RENDERED.get_or_init(|| OVERLAYS.map(|o| render(&kubectl, o)).into()))
}

fn render(kubectl: &Path, overlay: &'static str) -> Rendered {
    let dir = repo_root().join("deploy/k8s/overlays").join(overlay);
    let out = std::process::Command::new(kubectl)
        .arg("kustomize")
        .arg(&dir)
        .output()
        .expect("kubectl runs");
    assert!(
        out.status.success(),
        "`kubectl kustomize {}` fails:\n{}",
        dir.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).expect("UTF-8 YAML");
    // kustomize separates its documents with `---` lines.
    let objects = text
        .split("\n---\n")
        .map(|doc| serde_yaml::from_str::<Value>(doc).expect("kustomize writes valid YAML"))
        .filter(|v| !v.is_null())
        .collect();
    Rendered {
        overlay,
        text,
        objects,
    }
}

#[test]
fn the_overlays_render_and_pass_the_kubernetes_schemas() {
    let Some(overlays) = overlays() else { return };
    let Some(python) = std::env::var_os(convene_store::test_util::PYTHON_ENV) else {
        unavailable(
            "kubernetes-validate",
            "is looked for next to CONVENE_TEST_PYTHON, which is unset",
        );
        return;
    };
    let validate = Path::new(&python)
        .parent()
        .expect("CONVENE_TEST_PYTHON names a file")
        .join("kubernetes-validate");
    assert!(
        validate.is_file(),
        "{} is missing: install it with `{} -m pip install 'kubernetes-validate==1.37.*'`",
        validate.display(),
        Path::new(&python).display()
    );
    let dir = tempfile::tempdir().expect("a temporary directory");
    for rendered in overlays {
        assert!(
            !rendered.objects.is_empty(),
            "{} renders nothing",
            rendered.overlay
        );
        let file = dir.path().join(format!("{}.yaml", rendered.overlay));
        std::fs::write(&file, &rendered.text).expect("the rendered overlay is written");
        let out = std::process::Command::new(&validate)
            .args(["--strict", "--quiet"])
            .arg(&file)
            .output()
            .expect("kubernetes-validate runs");
        assert!(
            out.status.success(),
            "overlay {} has objects the Kubernetes schemas refuse:\n{}{}",
            rendered.overlay,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let _ = writeln!(
            std::io::stderr(),
            "overlay {}: {} objects pass kubernetes-validate --strict",
            rendered.overlay,
            rendered.objects.len()
        );
    }
}

/// Whether a LabelSelector (`matchLabels`, `matchExpressions`) selects `labels`.
fn selects(selector: &Value, labels: &Value) -> bool {
    let label = |key: &str| labels[key].as_str();
    let by_labels = selector["matchLabels"]
        .as_object()
        .into_iter()
        .flatten()
        .all(|(k, v)| label(k) == v.as_str());
    let by_expressions = array(&selector["matchExpressions"]).iter().all(|e| {
        let key = e["key"].as_str().unwrap_or_default();
        let values: Vec<&str> = array(&e["values"])
            .iter()
            .filter_map(Value::as_str)
            .collect();
        match e["operator"].as_str() {
            Some("In") => label(key).is_some_and(|l| values.contains(&l)),
            Some("NotIn") => label(key).is_none_or(|l| !values.contains(&l)),
            Some("Exists") => label(key).is_some(),
            Some("DoesNotExist") => label(key).is_none(),
            _ => false,
        }
    });
    by_labels && by_expressions
}

#[test]
fn services_and_network_policies_point_at_pods() {
    let Some(overlays) = overlays() else { return };
    let mut problems = Vec::new();
    for rendered in overlays {
        let overlay = rendered.overlay;
        for service in rendered.of_kind("Service") {
            let name = service["metadata"]["name"].as_str().unwrap_or_default();
            let selector = serde_json::json!({ "matchLabels": service["spec"]["selector"] });
            let targets: Vec<Workload<'_>> = rendered
                .workloads()
                .filter(|w| selects(&selector, w.labels()))
                .collect();
            if targets.is_empty() {
                problems.push(format!("{overlay}: Service {name} selects no pods"));
            }
            for port in array(&service["spec"]["ports"]) {
                let target = if port["targetPort"].is_null() {
                    &port["port"]
                } else {
                    &port["targetPort"]
                };
                for workload in &targets {
                    let declared = workload
                        .containers()
                        .flat_map(|c| array(&c["ports"]))
                        .any(|p| p["name"] == *target || p["containerPort"] == *target);
                    if !declared {
                        problems.push(format!(
                            "{overlay}: Service {name} targets port {target}, which {} does not declare",
                            workload.id()
                        ));
                    }
                }
            }
        }
        // A convene StatefulSet's pods are called by their names under its serviceName,
        // a headless Service of its pods (`convene-worker-0.convene-worker.convene.svc`).
        for workload in rendered.workloads() {
            if workload.object["kind"] != "StatefulSet" || workload.program().is_none() {
                continue;
            }
            let service_name = workload.object["spec"]["serviceName"]
                .as_str()
                .unwrap_or_default();
            let ok = rendered.get("Service", service_name).is_some_and(|s| {
                s["spec"]["clusterIP"] == "None"
                    && rendered
                        .selected(s)
                        .iter()
                        .any(|w| w.object == workload.object)
            });
            if !ok {
                problems.push(format!(
                    "{overlay}: {} names its pods under serviceName {service_name:?}, which is \
                     no headless Service of its pods",
                    workload.id()
                ));
            }
        }
        for policy in rendered.of_kind("NetworkPolicy") {
            let name = policy["metadata"]["name"].as_str().unwrap_or_default();
            let spec = &policy["spec"];
            let subject = &spec["podSelector"];
            let everyone = subject.as_object().is_none_or(Map::is_empty);
            let subjects: Vec<Workload<'_>> = rendered
                .workloads()
                .filter(|w| selects(subject, w.labels()))
                .collect();
            if subjects.is_empty() {
                problems.push(format!(
                    "{overlay}: NetworkPolicy {name} applies to no pods"
                ));
            }
            let rules = array(&spec["ingress"])
                .iter()
                .map(|r| ("from", r))
                .chain(array(&spec["egress"]).iter().map(|r| ("to", r)));
            for (direction, rule) in rules {
                let peers = array(&rule[direction]);
                // Only the front doors (the supervisor's client API, the gateway's A2A)
                // admit connections from outside the namespace; only DNS (in kube-system)
                // is reached in another namespace.
                let outside = peers.is_empty()
                    || peers
                        .iter()
                        .any(|p| p["ipBlock"].is_object() || p["namespaceSelector"].is_object());
                if direction == "from" && outside {
                    let ports: Vec<&Value> =
                        array(&rule["ports"]).iter().map(|p| &p["port"]).collect();
                    let front_door = !everyone
                        && FRONT_DOORS.iter().any(|(program, port)| {
                            subjects
                                .iter()
                                .all(|w| w.program().as_deref() == Some(*program))
                                && ports == [&Value::from(*port)]
                        });
                    if !front_door {
                        problems.push(format!(
                            "{overlay}: NetworkPolicy {name} admits connections from outside the \
                             namespace to something other than the supervisor's API (port 7400) \
                             or the gateway's A2A (port 7480), each alone"
                        ));
                    }
                }
                for peer in peers {
                    if let Some(namespaces) = peer["namespaceSelector"].as_object() {
                        let dns = namespaces
                            .get("matchLabels")
                            .and_then(|l| l.get("kubernetes.io/metadata.name"))
                            == Some(&Value::from("kube-system"))
                            && array(&rule["ports"]).iter().all(|p| p["port"] == 53);
                        if direction == "to" && !dns {
                            problems.push(format!("{overlay}: NetworkPolicy {name} reaches another namespace beyond DNS"));
                        }
                    } else if peer["podSelector"].is_object()
                        && !rendered
                            .workloads()
                            .any(|w| selects(&peer["podSelector"], w.labels()))
                    {
                        problems.push(format!(
                            "{overlay}: NetworkPolicy {name} names peers that match no pods"
                        ));
                    }
                }
            }
        }
    }
    assert!(
        problems.is_empty(),
        "Services and network policies:\n  - {}",
        problems.join("\n  - ")
    );
}

#[test]
fn every_pod_runs_restricted_with_resources() {
    let Some(overlays) = overlays() else { return };
    let mut problems = Vec::new();
    for rendered in overlays {
        let namespace = rendered
            .get("Namespace", "convene")
            .expect("the Namespace convene");
        if namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] != "restricted" {
            problems.push(format!(
                "{}: the namespace does not enforce the restricted Pod Security profile",
                rendered.overlay
            ));
        }
        for workload in rendered.workloads() {
            let pod = &workload.pod["spec"];
            for container in workload.containers() {
                let id = format!(
                    "{}: {}, container {}",
                    rendered.overlay,
                    workload.id(),
                    container["name"].as_str().unwrap_or_default()
                );
                let setting = |key: &str| {
                    let own = &container["securityContext"][key];
                    if own.is_null() {
                        pod["securityContext"][key].clone()
                    } else {
                        own.clone()
                    }
                };
                let expected = [
                    ("runAsNonRoot", setting("runAsNonRoot") == true),
                    // The kubelet can only check a numeric user against runAsNonRoot.
                    (
                        "runAsUser (numeric)",
                        setting("runAsUser").as_u64().is_some_and(|u| u > 0),
                    ),
                    (
                        "seccompProfile RuntimeDefault",
                        setting("seccompProfile")["type"] == "RuntimeDefault",
                    ),
                    (
                        "readOnlyRootFilesystem",
                        container["securityContext"]["readOnlyRootFilesystem"] == true,
                    ),
                    (
                        "allowPrivilegeEscalation: false",
                        container["securityContext"]["allowPrivilegeEscalation"] == false,
                    ),
                    (
                        "capabilities drop ALL",
                        array(&container["securityContext"]["capabilities"]["drop"])
                            .contains(&Value::from("ALL")),
                    ),
                    (
                        "a memory limit",
                        container["resources"]["limits"]["memory"].is_string(),
                    ),
                    (
                        "a CPU request",
                        container["resources"]["requests"]["cpu"].is_string(),
                    ),
                ];
                for (what, ok) in expected {
                    if !ok {
                        problems.push(format!("{id}: lacks {what}"));
                    }
                }
            }
        }
    }
    assert!(
        problems.is_empty(),
        "pods:\n  - {}",
        problems.join("\n  - ")
    );
}

#[test]
fn the_config_files_are_the_examples_and_credentials_match_their_hashes() {
    let Some(overlays) = overlays() else { return };
    let mut problems = Vec::new();
    for rendered in overlays {
        let overlay = rendered.overlay;
        let mut copies = Vec::new();
        let mut policy = None;
        for config_map in rendered.of_kind("ConfigMap") {
            for (key, text) in config_map["data"].as_object().into_iter().flatten() {
                let original = repo_root().join("examples/payment-incident").join(key);
                let Ok(original_text) = std::fs::read_to_string(&original) else {
                    continue;
                };
                let text = text.as_str().unwrap_or_default();
                copies.push(key.clone());
                if key == "policy.yaml" {
                    let copy: Value = serde_yaml::from_str(text).expect("the policy copy is YAML");
                    let mut without = copy.clone();
                    for principal in without["principals"].as_array_mut().into_iter().flatten() {
                        principal
                            .as_object_mut()
                            .map(|p| p.remove("credential_sha256"));
                    }
                    let example: Value = serde_yaml::from_str(&original_text).expect("YAML");
                    if without != example {
                        problems.push(format!(
                            "{overlay}: policy.yaml is not examples/payment-incident/policy.yaml with \
                             credential hashes added: copy the example again and keep the hashes"
                        ));
                    }
                    policy = Some(copy);
                } else if text != original_text {
                    problems.push(format!(
                        "{overlay}: {key} differs from examples/payment-incident/{key}: copy it again \
                         (cp examples/payment-incident/{key} deploy/k8s/...)"
                    ));
                }
            }
        }
        copies.sort();
        assert_eq!(
            copies,
            ["policy.yaml", "profiles.yaml", "run.yaml", "templates.yaml"],
            "{overlay}: the example files in its ConfigMaps"
        );
        let policy = policy.expect("a policy copy");

        // dev_credentials is off: each principal authenticates only by a listed hash.
        let mut hashes: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for principal in array(&policy["principals"]) {
            let id = principal["id"].as_str().unwrap_or_default().to_owned();
            let listed: Vec<String> = array(&principal["credential_sha256"])
                .iter()
                .filter_map(|h| h.as_str().map(str::to_owned))
                .collect();
            let valid = |h: &String| {
                h.contains("CHANGE-ME")
                    || (h.len() == 64 && h.chars().all(|c| c.is_ascii_hexdigit()))
            };
            if listed.is_empty() || !listed.iter().all(valid) {
                problems.push(format!(
                    "{overlay}: principal {id} needs credential_sha256 (the hex sha256 of its credential, \
                     or a CHANGE-ME placeholder)"
                ));
            }
            hashes.insert(id, listed);
        }
        let matches = |id: &str, credential: &str| {
            let listed = hashes.get(id).cloned().unwrap_or_default();
            if listed.iter().any(|h| h.contains("CHANGE-ME")) {
                credential.contains("CHANGE-ME")
            } else {
                listed.contains(&convene_mesh::policy_file::credential_hash(
                    credential.trim(),
                ))
            }
        };
        // The services' own credentials, as their pods read them.
        for secret in rendered.of_kind("Secret").filter(|s| {
            s["metadata"]["name"]
                .as_str()
                .is_some_and(|n| n.starts_with("convene-service-credentials"))
        }) {
            let name = secret["metadata"]["name"].as_str().unwrap_or_default();
            for key in secret["data"]
                .as_object()
                .into_iter()
                .flatten()
                .map(|(k, _)| k)
            {
                let credential = rendered.data("Secret", name, key).unwrap_or_default();
                if !matches(key, &credential) {
                    problems.push(format!(
                        "{overlay}: the credential of {key} in Secret {name} is not one whose hash \
                         policy.yaml lists for principal {key}"
                    ));
                }
            }
        }
        // People's credentials kept beside the overlay (dev).
        let dir = repo_root()
            .join("deploy/k8s/overlays")
            .join(overlay)
            .join("credentials");
        for entry in std::fs::read_dir(&dir).into_iter().flatten() {
            let path = entry.expect("an entry").path();
            let Some(id) = path
                .file_name()
                .and_then(|n| n.to_str())
                .and_then(|n| n.strip_suffix(".secret"))
            else {
                continue;
            };
            let credential = std::fs::read_to_string(&path).expect("a credential file");
            if !matches(id, &credential) {
                problems.push(format!(
                    "{overlay}: policy.yaml lists no hash of credentials/{id}.secret for {id}"
                ));
            }
        }
        // In-cluster PostgreSQL: the URL the services use carries the password it has.
        let password = rendered
            .of_kind("Secret")
            .find(|s| {
                s["metadata"]["name"]
                    .as_str()
                    .is_some_and(|n| n.starts_with("convene-postgres"))
            })
            .and_then(|s| rendered.data("Secret", s["metadata"]["name"].as_str()?, "password"));
        let url = rendered
            .of_kind("Secret")
            .find(|s| {
                s["metadata"]["name"]
                    .as_str()
                    .is_some_and(|n| n.starts_with("convene-database"))
            })
            .and_then(|s| rendered.data("Secret", s["metadata"]["name"].as_str()?, "url"));
        if let (Some(password), Some(url)) = (password, url)
            && !url.contains(&format!(":{password}@"))
        {
            problems.push(format!(
                "{overlay}: the database URL does not carry PostgreSQL's password"
            ));
        }
    }
    assert!(
        problems.is_empty(),
        "config files and credentials:\n  - {}",
        problems.join("\n  - ")
    );
}

#[test]
fn prod_runs_replicated_autoscaled_and_denied_by_default() {
    let Some(overlays) = overlays() else { return };
    let prod = overlays
        .iter()
        .find(|r| r.overlay == "prod")
        .expect("the prod overlay");
    let by_program = |name: &str| {
        prod.workloads()
            .find(|w| w.program().as_deref() == Some(name))
            .unwrap_or_else(|| panic!("prod runs {name}"))
    };

    for program in ["convene-supervisor", "convene-gateway", "convene-approval"] {
        let workload = by_program(program);
        let replicas = workload.object["spec"]["replicas"].as_u64().unwrap_or(1);
        assert!(
            replicas >= 2,
            "prod runs {replicas} {program}(s): give it at least 2"
        );
    }

    let worker = by_program("convene-worker");
    let worker_name = &worker.object["metadata"]["name"];
    let hpa = prod
        .of_kind("HorizontalPodAutoscaler")
        .find(|h| h["spec"]["scaleTargetRef"]["name"] == *worker_name)
        .expect("an autoscaler for the worker Deployment");
    assert_eq!(hpa["apiVersion"], "autoscaling/v2");
    assert_eq!(hpa["spec"]["scaleTargetRef"]["kind"], worker.object["kind"]);
    assert!(
        array(&hpa["spec"]["metrics"])
            .iter()
            .any(|m| m["resource"]["name"] == "cpu"),
        "the worker autoscaler scales on CPU"
    );
    assert!(
        worker.object["spec"]["replicas"].is_null(),
        "the worker Deployment must leave its replica count to the autoscaler"
    );

    // Every workload of more than one pod has a disruption budget.
    for workload in prod.workloads() {
        let name = &workload.object["metadata"]["name"];
        let scaled = prod
            .of_kind("HorizontalPodAutoscaler")
            .find(|h| h["spec"]["scaleTargetRef"]["name"] == *name)
            .and_then(|h| h["spec"]["minReplicas"].as_u64());
        let replicas = scaled
            .or(workload.object["spec"]["replicas"].as_u64())
            .unwrap_or(1);
        if replicas >= 2 {
            assert!(
                prod.of_kind("PodDisruptionBudget")
                    .any(|b| selects(&b["spec"]["selector"], workload.labels())),
                "{} runs {replicas} pods without a PodDisruptionBudget",
                workload.id()
            );
            assert!(
                !workload.pod["spec"]["affinity"]["podAntiAffinity"].is_null(),
                "{} runs {replicas} pods without pod anti-affinity",
                workload.id()
            );
        }
    }

    for rendered in overlays {
        let deny_all = rendered.of_kind("NetworkPolicy").any(|p| {
            let spec = &p["spec"];
            spec["podSelector"].as_object().is_some_and(Map::is_empty)
                && array(&spec["policyTypes"]).len() == 2
                && spec["ingress"].is_null()
                && spec["egress"].is_null()
        });
        assert!(
            deny_all,
            "{}: no default-deny NetworkPolicy (empty podSelector, Ingress and Egress, no rules)",
            rendered.overlay
        );
    }
}

/// Decodes standard base64, ignoring whitespace (kustomize wraps long values).
fn base64_decode(text: &str) -> Vec<u8> {
    const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = Vec::new();
    let (mut bits, mut count) = (0u32, 0);
    for byte in text
        .bytes()
        .filter(|b| !b.is_ascii_whitespace() && *b != b'=')
    {
        let value = ALPHABET.iter().position(|a| *a == byte).expect("base64") as u32;
        bits = (bits << 6) | value;
        count += 6;
        if count >= 8 {
            count -= 8;
            out.push((bits >> count) as u8);
            bits &= (1 << count) - 1;
        }
    }
    out
}

#[test]
fn base64_decodes_as_kubernetes_encodes() {
    assert_eq!(base64_decode("Y3Zu\nX2Rldg=="), b"cvn_dev");
    assert_eq!(base64_decode(""), b"");
}
