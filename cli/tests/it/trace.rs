//! `convene run --local` with a collector configured: the trace id the assessment
//! prints is the run's exported trace, the Jaeger link points at it, and one process
//! exports everything as `convene`, naming each logical service on its spans.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::time::Duration;

use convene_telemetry::test_util::OtlpReceiver;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_local_prints_the_trace_it_exported_and_its_jaeger_link() {
    let receiver = OtlpReceiver::start().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_convene"))
        .current_dir(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(".."))
        .args(["run", "--local", "examples/payment-incident/run.yaml"])
        .arg("--data-dir")
        .arg(dir.path())
        .env_remove("CONVENE_ENDPOINT")
        .env_remove("OTEL_SDK_DISABLED")
        .env_remove("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        .env("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint())
        // A trailing slash is not doubled in the link.
        .env("CONVENE_JAEGER_URL", "http://jaeger.example:16686/")
        .output()
        .await
        .expect("convene runs");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let trace_id = text
        .lines()
        .find_map(|l| l.strip_prefix("Trace: "))
        .unwrap_or_else(|| panic!("no trace line in:\n{text}"))
        .trim()
        .to_owned();
    assert_eq!(trace_id.len(), 32, "{text}");
    assert!(
        text.contains(&format!(
            "\n  http://jaeger.example:16686/trace/{trace_id}\n"
        )),
        "{text}"
    );

    // `run --local` flushed before exiting: the trace is there, rooted at the run.
    let spans = receiver
        .wait_for(Duration::from_secs(5), |s| {
            s.iter().any(|s| s.trace_id == trace_id && s.name == "run")
        })
        .await;
    let trace: Vec<_> = spans.iter().filter(|s| s.trace_id == trace_id).collect();
    let run = trace
        .iter()
        .find(|s| s.name == "run")
        .unwrap_or_else(|| panic!("no run span in trace {trace_id}: {spans:#?}"));
    assert_eq!(run.service, "convene");
    assert!(trace.iter().all(|s| s.service == "convene"));
    let services: BTreeSet<&str> = trace
        .iter()
        .filter_map(|s| s.attr("convene.service"))
        .collect();
    assert_eq!(
        services,
        [
            "approval",
            "evidence-store",
            "policy",
            "supervisor",
            "worker"
        ]
        .into()
    );
    // In one process no call crosses a socket: the tree has no gRPC server spans.
    assert!(
        trace.iter().all(|s| s.attr("rpc.system").is_none()),
        "{trace:#?}"
    );
    assert_eq!(trace.iter().filter(|s| s.name == "delegation").count(), 3);
}

/// A blocking A2A SendMessage over HTTP+JSON, as `credential`, carrying `traceparent`;
/// the response body.
async fn a2a_send(addr: std::net::SocketAddr, credential: &str, traceparent: &str) -> String {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let body = r#"{"message":{"messageId":"traced-1","role":"ROLE_USER","parts":[{"text":"checkout errors"}]}}"#;
    let request = format!(
        "POST /a2a/rest/message:send HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {credential}\r\n\
         traceparent: {traceparent}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\
         Connection: close\r\n\r\n{body}",
        body.len()
    );
    let mut stream = tokio::net::TcpStream::connect(addr)
        .await
        .expect("connects");
    stream.write_all(request.as_bytes()).await.expect("sends");
    let mut response = String::new();
    stream
        .read_to_string(&mut response)
        .await
        .expect("reads the response");
    assert!(response.starts_with("HTTP/1.1 200"), "{response}");
    response
        .split_once("\r\n\r\n")
        .map(|(_, body)| body.to_owned())
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_a2a_callers_trace_context_continues_into_the_gateway_and_the_run_links_to_it() {
    let receiver = OtlpReceiver::start().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let (port, a2a) = (
        convene_server::test_util::free_port(),
        convene_server::test_util::free_port(),
    );
    let mut up = tokio::process::Command::new(env!("CARGO_BIN_EXE_convene"))
        .current_dir(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(".."))
        .args(["up", "--listen", &format!("127.0.0.1:{port}")])
        .args(["--http-listen", &format!("127.0.0.1:{a2a}")])
        .arg("--data-dir")
        .arg(dir.path())
        .env_remove("CONVENE_DATABASE_URL")
        .env_remove("OTEL_SDK_DISABLED")
        .env_remove("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        .env("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint())
        .env("RUST_LOG", "warn")
        .stdout(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("convene up starts");
    let credential_file = dir.path().join("credentials/oncall@acme.secret");
    crate::support::wait_until("convene up to serve A2A", Duration::from_secs(60), || {
        std::net::TcpStream::connect(("127.0.0.1", a2a)).is_ok() && credential_file.exists()
    });
    let credential = std::fs::read_to_string(&credential_file).expect("credential");

    let (caller_trace, caller_span) = ("4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7");
    let body = a2a_send(
        ([127, 0, 0, 1], a2a).into(),
        credential.trim(),
        &format!("00-{caller_trace}-{caller_span}-01"),
    )
    .await;
    let task: serde_json::Value = serde_json::from_str(&body).expect("a JSON task");
    let run_trace = task["task"]["metadata"]["convene.trace_id"]
        .as_str()
        .unwrap_or_else(|| panic!("no run trace id in {body}"))
        .to_owned();
    assert_ne!(run_trace, caller_trace, "a run is a trace of its own");

    let spans = receiver
        .wait_for(Duration::from_secs(10), |s| {
            s.iter().any(|s| s.name == "run" && s.trace_id == run_trace)
                && s.iter().any(|s| s.name == "SendMessage")
        })
        .await;
    let gateway = spans
        .iter()
        .find(|s| s.name == "SendMessage")
        .unwrap_or_else(|| panic!("no gateway span: {spans:#?}"));
    assert_eq!(
        gateway.trace_id, caller_trace,
        "the caller's trace continues"
    );
    assert_eq!(gateway.parent_span_id, caller_span);
    assert_eq!(gateway.attr("convene.service"), Some("gateway"));
    let run = spans
        .iter()
        .find(|s| s.name == "run" && s.trace_id == run_trace)
        .expect("the run span");
    assert!(
        run.links.iter().any(|(trace, _)| trace == caller_trace),
        "the run links to the caller's trace: {:?}",
        run.links
    );
    let leaked: Vec<_> = spans
        .iter()
        .filter(|s| s.attributes.values().any(|v| v.contains(credential.trim())))
        .collect();
    assert!(
        leaked.is_empty(),
        "the bearer credential is in spans: {leaked:#?}"
    );
    up.kill().await.expect("stops");
}
