//! Tracing end to end: the mesh runs as separate processes exporting over OTLP to a
//! receiver inside this test, and a run's whole causal chain is one trace — run →
//! delegation → worker.execute → tool.call → policy.authorize and evidence.put, the
//! model calls, join.decide and approval.request — across five processes.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use crate::harness::{MeshOptions, Mode, TestMesh, example_spec};
use convene_proto::v1;
use convene_telemetry::test_util::{OtlpReceiver, ReceivedSpan};

const ONCALL: &str = "oncall@acme";
const LIMIT: Duration = Duration::from_secs(30);
/// OTLP span kinds.
const SERVER: i32 = 2;

/// The spans of one trace, with the lookups the assertions need.
struct Trace {
    spans: Vec<ReceivedSpan>,
}

impl Trace {
    fn of(all: &[ReceivedSpan], trace_id: &str) -> Self {
        Self {
            spans: all
                .iter()
                .filter(|s| s.trace_id == trace_id)
                .cloned()
                .collect(),
        }
    }

    fn span(&self, span_id: &str) -> Option<&ReceivedSpan> {
        self.spans.iter().find(|s| s.span_id == span_id)
    }

    fn named(&self, name: &str) -> Vec<&ReceivedSpan> {
        self.spans.iter().filter(|s| s.name == name).collect()
    }

    fn parent(&self, s: &ReceivedSpan) -> Option<&ReceivedSpan> {
        self.span(&s.parent_span_id)
    }

    /// The nearest ancestor that is not a gRPC server span: the span that caused this
    /// one, across the hop.
    fn cause(&self, s: &ReceivedSpan) -> Option<&ReceivedSpan> {
        let mut p = self.parent(s)?;
        while is_rpc_server(p) {
            p = self.parent(p)?;
        }
        Some(p)
    }

    /// Spans named `name` caused by `s`.
    fn caused_by(&self, s: &ReceivedSpan, name: &str) -> Vec<&ReceivedSpan> {
        self.spans
            .iter()
            .filter(|c| c.name == name && self.cause(c).is_some_and(|p| p.span_id == s.span_id))
            .collect()
    }

    fn find(&self, name: &str, key: &str, value: &str) -> &ReceivedSpan {
        self.spans
            .iter()
            .find(|s| s.name == name && s.attr(key) == Some(value))
            .unwrap_or_else(|| panic!("no {name} span with {key} = {value}: {:#?}", self.spans))
    }
}

fn is_rpc_server(s: &ReceivedSpan) -> bool {
    s.kind == SERVER && s.attr("rpc.system") == Some("grpc")
}

fn task<'a>(run: &'a v1::Run, name: &str) -> &'a v1::Delegation {
    run.delegations
        .iter()
        .find(|d| d.task.as_ref().is_some_and(|t| t.name == name))
        .unwrap_or_else(|| panic!("no delegation {name}"))
}

/// The example spec, with the change audit's scopes cut down to `changes:read`: its
/// token still carries `query_metrics@1` (tools come from the profile), so the policy
/// service denies that call for want of `metrics:read`.
fn spec_with_a_denied_call() -> v1::RunSpec {
    let mut spec = example_spec();
    spec.idempotency_key = "trace-denied-call".to_owned();
    let changes = spec
        .delegations
        .iter_mut()
        .find(|d| d.name == "changes")
        .expect("the example has a change audit");
    changes
        .required_scopes
        .retain(|s| s.action == "changes:read");
    assert_eq!(changes.required_scopes.len(), 1);
    spec
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_is_one_trace_across_every_process() {
    let receiver = OtlpReceiver::start().await;
    let mesh = TestMesh::start(
        Mode::Processes,
        MeshOptions {
            env: vec![
                (
                    convene_telemetry::OTEL_EXPORTER_OTLP_ENDPOINT.to_owned(),
                    receiver.endpoint(),
                ),
                // Export within a fraction of a second rather than the default 5 s.
                ("OTEL_BSP_SCHEDULE_DELAY".to_owned(), "200".to_owned()),
            ],
            ..MeshOptions::default()
        },
    )
    .await;

    let incident = mesh.start_run_id(ONCALL, example_spec()).await;
    let denied = mesh.start_run_id(ONCALL, spec_with_a_denied_call()).await;
    let incident = mesh.wait_terminal(ONCALL, &incident, LIMIT).await;
    let denied = mesh.wait_terminal(ONCALL, &denied, LIMIT).await;
    // The trace id GetRun reports is the id of a real exported trace.
    assert_eq!(incident.trace_id.len(), 32);
    assert!(
        incident.trace_parent.contains(&incident.trace_id),
        "the run stores its root span's context: {}",
        incident.trace_parent
    );
    assert_ne!(incident.trace_id, denied.trace_id, "one trace per run");

    // SIGTERM: every process drains and flushes its spans.
    mesh.stop(Duration::from_secs(10)).await;
    let all = receiver
        .wait_for(Duration::from_secs(10), |spans| {
            [&incident, &denied].iter().all(|run| {
                spans
                    .iter()
                    .any(|s| s.trace_id == run.trace_id && s.name == "run")
            })
        })
        .await;

    check_incident(&Trace::of(&all, &incident.trace_id), &incident);
    check_denied_call(&Trace::of(&all, &denied.trace_id), &denied);
}

fn check_incident(trace: &Trace, run: &v1::Run) {
    // One tree: a single root, the run, and no span whose parent was lost.
    let roots: Vec<&ReceivedSpan> = trace
        .spans
        .iter()
        .filter(|s| s.parent_span_id.is_empty())
        .collect();
    assert_eq!(roots.len(), 1, "{roots:#?}");
    let root = roots[0];
    assert_eq!(root.name, "run");
    for s in &trace.spans {
        assert!(
            s.parent_span_id.is_empty() || trace.parent(s).is_some(),
            "{} ({}) has a parent outside the trace",
            s.name,
            s.service
        );
    }
    assert_eq!(root.service, "convene-supervisor");
    assert_eq!(root.attr("convene.run.id"), Some(run.run_id.as_str()));
    assert_eq!(root.attr("convene.tenant"), Some("acme-payments"));
    let goal = &run.spec.as_ref().expect("spec").goal;
    assert_eq!(
        root.attr("convene.goal.hash"),
        Some(convene_core::ids::content_hash(goal.as_bytes()).as_str())
    );
    assert_eq!(root.attr("convene.run.state"), Some("WAITING_INPUT"));
    // Every process of the mesh took part, each under its own service name.
    let services: BTreeSet<&str> = trace.spans.iter().map(|s| s.service.as_str()).collect();
    assert_eq!(
        services,
        [
            "convene-approval",
            "convene-evidence-store",
            "convene-policy",
            "convene-supervisor",
            "convene-worker",
        ]
        .into()
    );

    let plan = trace.named("plan");
    assert!(
        plan.iter()
            .any(|p| p.parent_span_id == root.span_id && p.attr("convene.plan.tasks") == Some("3")),
        "{plan:#?}"
    );

    // One delegation span per delegation, each a child of the run.
    let delegations = trace.named("delegation");
    assert_eq!(delegations.len(), 3, "{delegations:#?}");
    for name in ["logs", "metrics", "changes"] {
        let d = task(run, name);
        let t = d.task.as_ref().expect("task");
        let span = trace.find("delegation", "convene.delegation.id", &t.delegation_id);
        assert_eq!(span.parent_span_id, root.span_id, "{name}");
        assert_eq!(span.attr("convene.delegation.name"), Some(name));
        assert_eq!(
            span.attr("convene.delegation.profile"),
            Some(t.profile_id.as_str())
        );
        assert_eq!(span.attr("convene.delegation.depth"), Some("1"));
        assert_eq!(
            span.attr("convene.delegation.reason"),
            Some(t.goal.as_str())
        );
        let scope = t.scope.as_ref().expect("scope").resources.join(",");
        assert_eq!(span.attr("convene.delegation.scope"), Some(scope.as_str()));
        assert_eq!(span.attr("convene.delegation.state"), Some("COMPLETED"));
        assert_eq!(span.attr("convene.worker.id"), Some(d.worker_id.as_str()));
        assert!(!span.is_error(), "{span:#?}");

        // The worker's execution, across the Worker.Execute hop.
        let executions = trace.caused_by(span, "worker.execute");
        assert_eq!(executions.len(), 1, "{name}: {executions:#?}");
        let exec = executions[0];
        assert_eq!(exec.service, "convene-worker");
        let hop = trace.parent(exec).expect("the Execute call's server span");
        assert!(is_rpc_server(hop), "{hop:#?}");
        assert_eq!(hop.name, "convene.v1.Worker/Execute");
        assert_eq!(hop.attr("rpc.service"), Some("convene.v1.Worker"));
        assert_eq!(hop.attr("rpc.method"), Some("Execute"));
        assert_eq!(hop.attr("rpc.grpc.status_code"), Some("0"));
        assert_eq!(
            exec.attr("convene.delegation.id"),
            Some(t.delegation_id.as_str())
        );
        assert_eq!(exec.attr("convene.task.status"), Some("COMPLETED"));

        // The model's turns.
        let models = trace.caused_by(exec, "model.call");
        assert!(!models.is_empty(), "{name}: no model.call");
        for m in &models {
            assert_eq!(m.attr("gen_ai.provider.name"), Some("playbook"));
            assert_eq!(m.attr("gen_ai.operation.name"), Some("chat"));
            assert!(
                m.attr("gen_ai.request.model")
                    .is_some_and(|m| !m.is_empty()),
                "{m:#?}"
            );
            assert!(m.attr("gen_ai.usage.input_tokens").is_some(), "{m:#?}");
            assert!(m.attr("gen_ai.usage.output_tokens").is_some(), "{m:#?}");
        }

        // Every tool call the result accounts for has its span, and each authorized
        // call's evidence leads back to it.
        let result = d.result.as_ref().expect("result");
        let tools = trace.caused_by(exec, "tool.call");
        let used = result.usage.as_ref().expect("usage").tool_calls as usize;
        assert_eq!(tools.len(), used, "{name}: {tools:#?}");
        for tool in &tools {
            assert_eq!(
                tool.parent_span_id, exec.span_id,
                "tool calls run in the execution"
            );
            let full = tool.attr("convene.tool").expect("tool@version");
            let (tool_name, version) = full.split_once('@').expect("name@version");
            assert_eq!(tool.attr("convene.tool.name"), Some(tool_name));
            assert_eq!(tool.attr("convene.tool.version"), Some(version));
            assert!(
                tool.attr("convene.tool.args_fingerprint")
                    .is_some_and(|f| f.starts_with("sha256:")),
                "{tool:#?}"
            );
            assert_eq!(tool.attr("convene.authz.decision"), Some("allow"));
            assert_eq!(tool.attr("convene.authz.reason"), Some("ALLOWED"));
            assert!(!tool.is_error(), "{tool:#?}");

            let authorize = trace.caused_by(tool, "policy.authorize");
            assert_eq!(authorize.len(), 1, "{tool:#?}");
            let authorize = authorize[0];
            assert_eq!(authorize.service, "convene-policy");
            assert_eq!(authorize.attr("convene.authz.decision"), Some("allow"));
            assert_eq!(authorize.attr("convene.authz.reason"), Some("ALLOWED"));
            assert_eq!(
                authorize.attr("convene.authz.decision_id"),
                tool.attr("convene.authz.decision_id")
            );

            let put = trace.caused_by(tool, "evidence.put");
            assert_eq!(put.len(), 1, "{tool:#?}");
            let put = put[0];
            assert_eq!(put.service, "convene-evidence-store");
            assert!(
                put.attr("convene.artifact.hash")
                    .is_some_and(|h| h.starts_with("sha256:")),
                "{put:#?}"
            );
            assert!(
                put.attr("convene.artifact.size")
                    .and_then(|s| s.parse::<u64>().ok())
                    .is_some_and(|s| s > 0),
                "{put:#?}"
            );
            let evidence_id = tool.attr("convene.evidence.id").expect("the evidence id");
            assert_eq!(put.attr("convene.evidence.id"), Some(evidence_id));
        }
        for e in &result.evidence {
            assert_eq!(
                e.trace_id, run.trace_id,
                "evidence records name the run's trace"
            );
            trace.find("tool.call", "convene.evidence.id", &e.evidence_id);
        }
    }

    // The evidence the three results cite is verified in one call, once the last
    // result is in: before that the join (TIMEOUT_PARTIAL) waits whatever the store says.
    let verifications = trace.named("convene.v1.EvidenceStore/VerifyChain");
    assert_eq!(verifications.len(), 1, "{verifications:#?}");
    assert_eq!(verifications[0].parent_span_id, root.span_id);

    // Every decision revision has its join.decide span, under the run.
    assert!(!run.revisions.is_empty());
    let decisions = trace.named("join.decide");
    for revision in &run.revisions {
        let span = trace.find(
            "join.decide",
            "convene.join.revision",
            &revision.revision.to_string(),
        );
        assert_eq!(span.parent_span_id, root.span_id);
        let outcome = v1::JoinOutcome::try_from(revision.outcome)
            .expect("outcome")
            .as_str_name()
            .trim_start_matches("JOIN_OUTCOME_");
        assert_eq!(span.attr("convene.join.outcome"), Some(outcome));
        assert_eq!(span.attr("convene.join.strategy"), Some("TIMEOUT_PARTIAL"));
        assert_eq!(
            span.attr("convene.join.wait_set"),
            Some("logs,metrics,changes")
        );
        assert_eq!(
            span.attr("convene.join.threshold"),
            Some("count>=2 kinds=impact_metric+causal_signal")
        );
        assert_eq!(
            span.attr("convene.join.conflicts"),
            Some(revision.conflicts.len().to_string().as_str())
        );
        assert_eq!(
            span.attr("convene.join.conflict_topics"),
            Some("primary_cause")
        );
        assert_eq!(
            span.attr("convene.join.missing"),
            Some(revision.missing_required.join(",").as_str())
        );
    }
    // Evaluations before the decision were waiting: they say for what.
    for pending in decisions
        .iter()
        .filter(|s| s.attr("convene.join.outcome") == Some("PENDING"))
    {
        assert!(
            pending.attr("convene.join.waiting_for").is_some(),
            "{pending:#?}"
        );
    }

    // The R3 rollback became an approval request, filed by the decision.
    assert_eq!(run.approval_ids.len(), 1);
    let approval = trace.find(
        "approval.request",
        "convene.approval.id",
        &run.approval_ids[0],
    );
    assert_eq!(approval.service, "convene-approval");
    assert_eq!(approval.attr("convene.approval.risk"), Some("R3"));
    assert_eq!(approval.attr("convene.approval.required"), Some("2"));
    let cause = trace.cause(approval).expect("a cause");
    assert_eq!(cause.name, "join.decide");
}

fn check_denied_call(trace: &Trace, run: &v1::Run) {
    let changes = task(run, "changes");
    let t = changes.task.as_ref().expect("task");
    let delegation = trace.find("delegation", "convene.delegation.id", &t.delegation_id);
    let exec = trace.caused_by(delegation, "worker.execute");
    assert_eq!(exec.len(), 1);
    let tools: BTreeMap<&str, &ReceivedSpan> = trace
        .caused_by(exec[0], "tool.call")
        .into_iter()
        .map(|s| (s.attr("convene.tool").unwrap_or_default(), s))
        .collect();

    // The change listing was allowed; the metrics query was denied by the policy
    // service, and only that span failed.
    let allowed = tools.get("list_changes@1").expect("the change listing");
    assert_eq!(allowed.attr("convene.authz.decision"), Some("allow"));
    assert!(!allowed.is_error());
    let denied = tools.get("query_metrics@1").expect("the metrics query");
    assert_eq!(
        denied.attr("convene.authz.decision"),
        Some("deny"),
        "{denied:#?}"
    );
    assert_ne!(denied.attr("convene.authz.reason"), Some("ALLOWED"));
    assert_eq!(denied.attr("error.type"), Some("permission_denied"));
    assert!(denied.is_error(), "a denied call's span fails: {denied:#?}");
    assert!(
        denied.status_message.contains("denied by policy"),
        "{}",
        denied.status_message
    );
    assert!(
        denied.attr("convene.evidence.id").is_none(),
        "nothing was recorded"
    );
    assert!(trace.caused_by(denied, "evidence.put").is_empty());
    let decision = trace.caused_by(denied, "policy.authorize");
    assert_eq!(decision.len(), 1);
    assert_eq!(decision[0].attr("convene.authz.decision"), Some("deny"));
    assert_eq!(
        decision[0].attr("convene.authz.reason"),
        denied.attr("convene.authz.reason")
    );
    // The decision itself is the policy service's answer, not its failure.
    assert!(!decision[0].is_error());
}
