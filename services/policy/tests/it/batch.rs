//! AuthorizeBatch and the handle that uses it, over real sockets: a batch decides each
//! call as Authorize would, calls that arrive while one is on its way go out together,
//! an older policy service without the method still gets every call, and each batched
//! decision's span stays in the trace of the call that asked for it.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use crate::support::{Harness, range, reason};
use convene_mesh::batch::BatchingPolicy;
use convene_mesh::handles::{GrpcPolicy, PolicyHandle};
use convene_mesh::test_util::{Recording, Sent};
use convene_policy::PolicyService;
use convene_proto::v1::{
    self, AuthorizeReason, authorize_batch_result, policy_server::Policy as _,
};
use convene_server::GrpcServer;
use convene_server::test_util::TestServer;
use convene_telemetry::test_util::Capture;
use tonic::{Code, Request, Response, Status};
use tracing::Instrument as _;

/// The harness's service behind a [`Recording`] server, and a batching handle over it.
struct Batching {
    recording: Recording<PolicyService>,
    server: TestServer,
    policy: BatchingPolicy,
}

impl Batching {
    async fn start(h: &Harness, takes_batches: bool) -> Self {
        let recording = Recording::new(h.service.clone(), takes_batches);
        let server = TestServer::start(
            GrpcServer::new(h.config.server.clone())
                .add_service(v1::policy_server::PolicyServer::new(recording.clone())),
        )
        .await;
        let grpc: PolicyHandle = Arc::new(GrpcPolicy::new(server.channel().await));
        Self {
            recording,
            server,
            policy: BatchingPolicy::new(grpc, "test", 1),
        }
    }

    /// Sends `first`, which the server holds; once it is held, sends `rest`, then lets
    /// `first` through: every call of `rest` was handed over while the only slot was
    /// taken. Answers in the order given.
    async fn held_then(
        &self,
        first: v1::AuthorizeRequest,
        rest: Vec<v1::AuthorizeRequest>,
        spans: Option<Vec<tracing::Span>>,
    ) -> Vec<Result<v1::AuthorizeResponse, Status>> {
        let mut spans = spans.map(Vec::into_iter);
        let mut next_span = move || {
            spans
                .as_mut()
                .and_then(Iterator::next)
                .unwrap_or_else(tracing::Span::none)
        };
        let first_span = next_span();
        let rest_spans: Vec<tracing::Span> = rest.iter().map(|_| next_span()).collect();
        let send = |call: v1::AuthorizeRequest, span: tracing::Span| async move {
            self.policy
                .authorize(Request::new(call))
                .instrument(span)
                .await
                .map(Response::into_inner)
        };
        self.recording
            .held_then(
                send(first, first_span),
                rest.into_iter().zip(rest_spans).map(|(c, s)| send(c, s)),
            )
            .await
    }
}

fn calls(h: &Harness, token: &str, n: usize) -> Vec<v1::AuthorizeRequest> {
    (0..n)
        .map(|i| v1::AuthorizeRequest {
            tool_call_id: format!("call-{i}"),
            ..h.search_call(token)
        })
        .collect()
}

fn decision(result: &v1::AuthorizeBatchResult) -> &v1::AuthorizeResponse {
    match &result.result {
        Some(authorize_batch_result::Result::Decision(d)) => d,
        other => panic!("expected a decision, got {other:?}"),
    }
}

#[tokio::test]
async fn a_batch_decides_each_call_as_authorize_would() {
    let h = Harness::start().await;
    let token = h.issue_one("run-batch", h.logs_grant("del-1")).await.token;
    let mut tampered = token.clone().into_bytes();
    let last = tampered.len() - 2;
    tampered[last] = if tampered[last] == b'A' { b'B' } else { b'A' };
    let tampered = String::from_utf8(tampered).expect("ASCII");
    let mut call = calls(&h, &token, 2);
    let other_tool = v1::AuthorizeRequest {
        tool: "query_metrics@1".into(),
        action: "metrics:read".into(),
        resource: "metric/payment-api-errors".into(),
        tool_call_id: "call-metrics".into(),
        ..h.search_call(&token)
    };
    let items = vec![
        Some(call.remove(0)),
        Some(v1::AuthorizeRequest {
            tool_call_id: "call-forged".into(),
            ..h.search_call(&tampered)
        }),
        None,
        Some(other_tool),
        Some(call.remove(0)),
    ];
    let batch = v1::AuthorizeBatchRequest {
        items: items
            .into_iter()
            .map(|request| v1::AuthorizeBatchItem {
                request,
                traceparent: String::new(),
            })
            .collect(),
    };
    let results = h
        .client()
        .await
        .authorize_batch(batch)
        .await
        .expect("a batch with bad items is still answered")
        .into_inner()
        .results;

    assert_eq!(results.len(), 5, "one result per item, in order");
    let (first, last) = (decision(&results[0]), decision(&results[4]));
    assert!(first.allowed && last.allowed, "{first:?} {last:?}");
    assert_eq!(
        BTreeSet::from([first.calls_used, last.calls_used]),
        BTreeSet::from([1, 2]),
        "both allowed calls counted against the one token"
    );
    let forged = decision(&results[1]);
    assert!(!forged.allowed);
    assert!(
        matches!(
            reason(forged),
            AuthorizeReason::BadSignature | AuthorizeReason::Malformed
        ),
        "{forged:?}"
    );
    match &results[2].result {
        Some(authorize_batch_result::Result::Error(e)) => {
            assert_eq!(e.code, Code::InvalidArgument as i32);
            assert!(e.message.contains("items[2].request"), "{}", e.message);
        }
        other => panic!("a missing request is an error of its item: {other:?}"),
    }
    let not_granted = decision(&results[3]);
    assert!(!not_granted.allowed);
    assert_eq!(reason(not_granted), AuthorizeReason::ToolNotGranted);

    // Each decided item is its own entry of the decision log, under its own id.
    let log = h.decisions();
    assert_eq!(log.len(), 4, "{log:#?}");
    let logged: BTreeSet<_> = log.iter().map(|d| d.decision_id.as_str()).collect();
    for i in [0, 1, 3, 4] {
        assert!(logged.contains(decision(&results[i]).decision_id.as_str()));
    }
    let again = h.authorize(h.search_call(&token)).await;
    assert_eq!(again.calls_used, 3);
}

#[tokio::test]
async fn a_batch_of_no_calls_or_of_too_many_is_refused_whole() {
    let h = Harness::start().await;
    let token = h.issue_one("run-sizes", h.logs_grant("del-1")).await.token;
    for n in [0, 257] {
        let items = calls(&h, &token, n)
            .into_iter()
            .map(|c| v1::AuthorizeBatchItem {
                request: Some(c),
                traceparent: String::new(),
            })
            .collect();
        let refused = h
            .client()
            .await
            .authorize_batch(v1::AuthorizeBatchRequest { items })
            .await
            .expect_err("refused");
        assert_eq!(refused.code(), Code::InvalidArgument, "{refused:?}");
        assert!(
            refused.message().contains("1 to 256"),
            "{}",
            refused.message()
        );
    }
    assert!(h.decisions().is_empty(), "nothing was decided");
}

#[tokio::test]
async fn calls_that_arrive_while_one_is_on_its_way_go_out_together() {
    let h = Harness::start().await;
    let token = h
        .issue_one("run-together", h.logs_grant("del-1"))
        .await
        .token;
    let b = Batching::start(&h, true).await;
    let mut all = calls(&h, &token, 10);
    let first = all.remove(0);
    let answers = b.held_then(first, all, None).await;

    assert_eq!(
        b.recording.sent(),
        vec![Sent::Alone, Sent::Batch(9)],
        "the first call went alone, the nine behind it in one message"
    );
    let answers: Vec<v1::AuthorizeResponse> =
        answers.into_iter().map(|a| a.expect("answered")).collect();
    assert!(answers.iter().all(|a| a.allowed), "{answers:#?}");
    let used: BTreeSet<u32> = answers.iter().map(|a| a.calls_used).collect();
    assert_eq!(used, (1..=10).collect(), "each call counted once");
    let log = h.decisions();
    let logged: BTreeSet<&str> = log.iter().map(|d| d.tool_call_id.as_str()).collect();
    let expected: Vec<String> = (0..10).map(|i| format!("call-{i}")).collect();
    assert_eq!(logged, expected.iter().map(String::as_str).collect());
    for answer in &answers {
        assert!(
            log.iter().any(|d| d.decision_id == answer.decision_id),
            "every answer is a logged decision"
        );
    }
    b.server.stop().await.expect("clean stop");
}

#[tokio::test]
async fn a_batched_call_fails_as_it_would_alone() {
    let h = Harness::start().await;
    let token = h.issue_one("run-bad", h.logs_grant("del-1")).await.token;
    let b = Batching::start(&h, true).await;
    let backwards = v1::AuthorizeRequest {
        data_scope: Some(v1::DataScope {
            time_range: Some(range(h.t0, h.t0 - Duration::from_secs(60))),
            max_rows: 0,
        }),
        tool_call_id: "call-backwards".into(),
        ..h.search_call(&token)
    };
    let alone = h
        .client()
        .await
        .authorize(backwards.clone())
        .await
        .expect_err("a time range that ends before it starts is refused");
    let mut good = calls(&h, &token, 2);
    let answers = b
        .held_then(good.remove(0), vec![backwards, good.remove(0)], None)
        .await;

    assert_eq!(b.recording.sent(), vec![Sent::Alone, Sent::Batch(2)]);
    let batched = answers[1].as_ref().expect_err("refused in the batch too");
    assert_eq!(batched.code(), alone.code());
    assert_eq!(batched.message(), alone.message());
    assert!(answers[0].as_ref().is_ok_and(|a| a.allowed));
    assert!(
        answers[2].as_ref().is_ok_and(|a| a.allowed),
        "one bad call does not sink its batch"
    );
    b.server.stop().await.expect("clean stop");
}

#[tokio::test]
async fn without_authorize_batch_on_the_server_every_call_goes_alone() {
    let h = Harness::start().await;
    let token = h.issue_one("run-old", h.logs_grant("del-1")).await.token;
    let b = Batching::start(&h, false).await;
    let mut all = calls(&h, &token, 6);
    let first = all.remove(0);
    let answers = b.held_then(first, all, None).await;

    assert!(
        answers.iter().all(|a| a.as_ref().is_ok_and(|a| a.allowed)),
        "{answers:#?}"
    );
    let mut expected = vec![Sent::Alone, Sent::RefusedBatch(5)];
    expected.extend([Sent::Alone; 5]);
    assert_eq!(b.recording.sent(), expected);

    // It remembers: calls made together later are sent one by one, never batched again.
    let later = futures::future::join_all(calls(&h, &token, 8).into_iter().map(|c| {
        let policy = &b.policy;
        async move { policy.authorize(Request::new(c)).await }
    }))
    .await;
    assert!(
        later
            .iter()
            .all(|a| a.as_ref().is_ok_and(|a| a.get_ref().allowed))
    );
    let sent = b.recording.sent();
    assert_eq!(sent.len(), 15, "{sent:?}");
    assert!(sent[7..].iter().all(|s| *s == Sent::Alone), "{sent:?}");
    assert_eq!(h.decisions().len(), 14);
    b.server.stop().await.expect("clean stop");
}

fn traced(i: usize) -> tracing::Span {
    tracing::info_span!(target: "convene_policy_test", "test.tool_call", test.call = i)
}

// A current-thread runtime: the handle's task and the callers run on this thread, where
// the capture is the default subscriber.
#[tokio::test]
async fn each_batched_call_carries_the_trace_context_of_the_span_that_asked() {
    let capture = Capture::new();
    let _guard = capture.set_default();
    let h = Harness::start().await;
    let token = h.issue_one("run-traced", h.logs_grant("del-1")).await.token;
    let b = Batching::start(&h, true).await;
    let callers: Vec<tracing::Span> = (0..4).map(traced).collect();
    let expected: Vec<String> = callers[1..]
        .iter()
        .map(|s| convene_telemetry::traceparent(s).expect("traced"))
        .collect();
    let mut all = calls(&h, &token, 4);
    let first = all.remove(0);
    let answers = b.held_then(first, all, Some(callers)).await;
    assert!(answers.iter().all(|a| a.as_ref().is_ok_and(|a| a.allowed)));
    assert_eq!(b.recording.sent(), vec![Sent::Alone, Sent::Batch(3)]);
    let sent = b.recording.traceparents();
    assert_eq!(sent, expected, "each item names its own caller's span");

    let spans = capture.spans();
    let batch = spans
        .iter()
        .find(|s| s.name == "policy.authorize_batch")
        .expect("the batch has a span of its own");
    let linked: BTreeSet<String> = batch
        .links
        .iter()
        .map(|l| l.span_context.span_id().to_string())
        .collect();
    let callers: BTreeSet<String> = expected
        .iter()
        .map(|tp| tp.split('-').nth(2).expect("span id").to_owned())
        .collect();
    assert_eq!(linked, callers, "the batch links to each call it carried");
    b.server.stop().await.expect("clean stop");
}

#[tokio::test]
async fn each_batched_decision_is_a_child_of_the_span_its_item_names() {
    let capture = Capture::new();
    let _guard = capture.set_default();
    let h = Harness::start().await;
    let token = h
        .issue_one("run-parents", h.logs_grant("del-1"))
        .await
        .token;
    let callers: Vec<tracing::Span> = (0..3).map(traced).collect();
    let parents: Vec<String> = callers
        .iter()
        .map(|s| convene_telemetry::traceparent(s).expect("traced"))
        .collect();
    let batch = tracing::info_span!(target: "convene_policy_test", "test.batch");
    let items = calls(&h, &token, 4)
        .into_iter()
        .enumerate()
        .map(|(i, c)| v1::AuthorizeBatchItem {
            request: Some(c),
            // The last item names no caller.
            traceparent: parents.get(i).cloned().unwrap_or_default(),
        })
        .collect();
    let results = h
        .service
        .authorize_batch(Request::new(v1::AuthorizeBatchRequest { items }))
        .instrument(batch.clone())
        .await
        .expect("answered")
        .into_inner()
        .results;
    assert!(results.iter().all(|r| decision(r).allowed));
    let batch_ids = convene_telemetry::traceparent(&batch).expect("traced");
    drop((callers, batch));

    let spans = capture.spans();
    let decided = |call_id: &str| {
        spans
            .iter()
            .find(|s| {
                s.name == "policy.authorize"
                    && s.attributes.iter().any(|kv| {
                        kv.key.as_str() == "convene.tool.call_id" && kv.value.as_str() == call_id
                    })
            })
            .unwrap_or_else(|| panic!("no decision span for {call_id}: {spans:#?}"))
    };
    let ids = |tp: &str| {
        let parts: Vec<&str> = tp.split('-').collect();
        (parts[1].to_owned(), parts[2].to_owned())
    };
    for (i, parent) in parents.iter().enumerate() {
        let d = decided(&format!("call-{i}"));
        let (trace_id, span_id) = ids(parent);
        assert_eq!(d.span_context.trace_id().to_string(), trace_id);
        assert_eq!(
            d.parent_span_id.to_string(),
            span_id,
            "call-{i} is decided under the span that asked for it"
        );
    }
    let orphan = decided("call-3");
    let (trace_id, span_id) = ids(&batch_ids);
    assert_eq!(orphan.span_context.trace_id().to_string(), trace_id);
    assert_eq!(
        orphan.parent_span_id.to_string(),
        span_id,
        "an item without trace context is decided under the batch"
    );
}
