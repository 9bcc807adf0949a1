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
