//! PutArtifactBatch and the worker's handle that uses it, over real sockets, with a real
//! policy service issuing the tokens: a batch stores each put as PutArtifact would under
//! its own token, puts that arrive while one is on its way go out together, large puts
//! and a store without the method get single calls, and a batch too large for the
//! store's message limit is sent again put by put.

use std::sync::Arc;

use crate::support::{Mesh, evidence};
use convene_evidence_store::EvidenceStoreService;
use convene_mesh::auth::request;
use convene_mesh::batch::{BatchingEvidence, MAX_BATCHED_PUT_BYTES};
use convene_mesh::handles::{EvidenceHandle, GrpcEvidenceStore};
use convene_mesh::test_util::{Recording, Sent};
use convene_proto::v1::{self, evidence_store_server::EvidenceStore, put_artifact_batch_result};
use convene_server::GrpcServer;
use convene_server::test_util::TestServer;
use tonic::{Code, Request, Response, Status};

/// A put of `content` whose evidence is `id`.
fn put(content: &[u8], id: &str) -> v1::PutArtifactRequest {
    v1::PutArtifactRequest {
        content: content.to_vec(),
        media_type: "application/json".into(),
        tool_call_id: format!("call-{id}"),
        evidence: Some(evidence(id, "", "")),
    }
}

fn item(token: &str, request: Option<v1::PutArtifactRequest>) -> v1::PutArtifactBatchItem {
    v1::PutArtifactBatchItem {
        token: token.into(),
        request,
        traceparent: String::new(),
    }
}

fn stored(result: &v1::PutArtifactBatchResult) -> &v1::PutArtifactResponse {
    match &result.result {
        Some(put_artifact_batch_result::Result::Response(r)) => r,
        other => panic!("expected a stored put, got {other:?}"),
    }
}

fn failed(result: &v1::PutArtifactBatchResult) -> &v1::ItemStatus {
    match &result.result {
        Some(put_artifact_batch_result::Result::Error(e)) => e,
        other => panic!("expected an error, got {other:?}"),
    }
}

/// `token` with one character of its signature changed.
fn tampered(token: &str) -> String {
    let mut bytes = token.as_bytes().to_vec();
    let last = bytes.len() - 2;
    bytes[last] = if bytes[last] == b'A' { b'B' } else { b'A' };
    String::from_utf8(bytes).expect("ASCII")
}

#[tokio::test]
async fn a_batch_stores_each_put_as_put_artifact_would_under_its_own_token() {
    let mesh = Mesh::start().await;
    let acme = mesh.acme().await;
    let globex = mesh.globex().await;
    let read_only = mesh
        .token(
            "oncall@acme",
            "del-reader",
            &[("evidence:read", "evidence")],
        )
        .await;
    let forged = tampered(&acme);
    let mut client = mesh.client().await;

    // What the bad puts get on their own, to compare with their answers in the batch.
    let mut alone = Vec::new();
    for token in [&forged, &read_only] {
        alone.push(
            client
                .put_artifact(request(put(b"{}", "logs://payment-api/alone"), token))
                .await
                .expect_err("refused alone"),
        );
    }

    let batch = v1::PutArtifactBatchRequest {
        items: vec![
            item(&acme, Some(put(b"{\"rows\": 1}", "logs://payment-api/a"))),
            item(&globex, Some(put(b"{\"rows\": 2}", "logs://payment-api/g"))),
            item(&forged, Some(put(b"{\"rows\": 3}", "logs://payment-api/f"))),
            item("", Some(put(b"{\"rows\": 4}", "logs://payment-api/n"))),
            item(&acme, None),
            item(
                &read_only,
                Some(put(b"{\"rows\": 5}", "logs://payment-api/r")),
            ),
        ],
    };
    let results = client
        .put_artifact_batch(batch)
        .await
        .expect("a batch with bad items is still answered")
        .into_inner()
        .results;
    assert_eq!(results.len(), 6, "one result per item, in order");

    // Each good put is stored in its own token's tenant, with its evidence, as
    // PutArtifact would store it.
    let a = stored(&results[0]);
    let g = stored(&results[1]);
    let a_artifact = a.artifact.as_ref().unwrap();
    assert!(
        a_artifact.uri.starts_with("artifact://acme/"),
        "{a_artifact:?}"
    );
    assert_eq!(a_artifact.created_by_delegation, "del-acme");
    assert!(
        g.artifact
            .as_ref()
            .unwrap()
            .uri
            .starts_with("artifact://globex/")
    );
    let a_evidence = a.evidence.as_ref().expect("evidence recorded");
    assert_eq!(a_evidence.tenant, "acme");
    assert_eq!(a_evidence.delegation_id, "del-acme");
    assert_eq!(a_evidence.artifact_uri, a_artifact.uri);
    assert_eq!(g.evidence.as_ref().unwrap().tenant, "globex");
    let got = client
        .get_artifact(request(
            v1::GetArtifactRequest {
                uri: a_artifact.uri.clone(),
            },
            &acme,
        ))
        .await
        .expect("the batched artifact is served")
        .into_inner();
    assert_eq!(got.content, b"{\"rows\": 1}");

    // The bad ones fail alone, each with what PutArtifact would have said.
    for (result, alone) in [(&results[2], &alone[0]), (&results[5], &alone[1])] {
        let e = failed(result);
        assert_eq!(e.code, alone.code() as i32, "{e:?}");
        assert_eq!(e.message, alone.message());
    }
    assert_eq!(alone[0].code(), Code::Unauthenticated);
    assert_eq!(alone[1].code(), Code::PermissionDenied);
    let no_token = failed(&results[3]);
    assert_eq!(no_token.code, Code::Unauthenticated as i32);
    assert!(no_token.message.contains("items[3].token"), "{no_token:?}");
    let no_request = failed(&results[4]);
    assert_eq!(no_request.code, Code::InvalidArgument as i32);
    assert!(
        no_request.message.contains("items[4].request"),
        "{no_request:?}"
    );

    // Nothing of the refused puts was recorded.
    let found = client
        .get_evidence(request(
            v1::GetEvidenceRequest {
                evidence_ids: vec![
                    "logs://payment-api/a".into(),
                    "logs://payment-api/f".into(),
                    "logs://payment-api/n".into(),
                    "logs://payment-api/r".into(),
                ],
            },
            &acme,
        ))
        .await
        .unwrap()
        .into_inner();
    let ids: Vec<&str> = found
        .evidence
        .iter()
        .map(|e| e.evidence_id.as_str())
        .collect();
    assert_eq!(ids, ["logs://payment-api/a"]);
}

#[tokio::test]
async fn a_batch_of_no_puts_or_of_too_many_is_refused_whole() {
    let mesh = Mesh::start().await;
    let token = mesh.acme().await;
    let mut client = mesh.client().await;
    for n in [0, 257] {
        let items = (0..n)
            .map(|i| item(&token, Some(put(b"{}", &format!("logs://payment-api/{i}")))))
            .collect();
        let refused = client
            .put_artifact_batch(v1::PutArtifactBatchRequest { items })
            .await
            .expect_err("refused");
        assert_eq!(refused.code(), Code::InvalidArgument, "{refused:?}");
        assert!(
            refused.message().contains("1 to 256"),
            "{}",
            refused.message()
        );
    }
    let found = client
        .get_evidence(request(
            v1::GetEvidenceRequest {
                evidence_ids: vec!["logs://payment-api/0".into()],
            },
            &token,
        ))
        .await
        .unwrap()
        .into_inner();
    assert!(found.evidence.is_empty(), "nothing was stored");
}

/// The mesh's store behind a [`Recording`] server accepting messages up to
/// `message_limit`, and a batching handle over it.
struct Batching {
    recording: Recording<EvidenceStoreService>,
    server: TestServer,
    evidence: BatchingEvidence,
}

impl Batching {
    async fn start(mesh: &Mesh, takes_batches: bool, message_limit: usize) -> Self {
        let recording = Recording::new(mesh.store.clone(), takes_batches);
        let server = TestServer::start(
            GrpcServer::new(mesh.config.server.clone()).add_service_with_own_limits(
                v1::evidence_store_server::EvidenceStoreServer::new(recording.clone())
                    .max_decoding_message_size(message_limit)
                    .max_encoding_message_size(message_limit),
            ),
        )
        .await;
        let grpc: EvidenceHandle = Arc::new(GrpcEvidenceStore::new(server.channel().await));
        Self {
            recording,
            server,
            evidence: BatchingEvidence::new(grpc, "test", 1),
        }
    }

    /// Sends `first`, which the server holds; once it is held, sends `rest`, then lets
    /// `first` through: every put of `rest` was handed over while the only slot was
    /// taken. Answers in the order given.
    async fn held_then(
        &self,
        token: &str,
        first: v1::PutArtifactRequest,
        rest: Vec<v1::PutArtifactRequest>,
    ) -> Vec<Result<v1::PutArtifactResponse, Status>> {
        let send = |put: v1::PutArtifactRequest| async move {
            self.evidence
                .put_artifact(request(put, token))
                .await
                .map(Response::into_inner)
        };
        self.recording
            .held_then(send(first), rest.into_iter().map(send))
            .await
    }
}

/// `n` distinct small puts, evidence ids `logs://payment-api/{tag}-{i}`.
fn puts(tag: &str, n: usize) -> Vec<v1::PutArtifactRequest> {
    (0..n)
        .map(|i| {
            put(
                format!("{{\"row\": {i}}}").as_bytes(),
                &format!("logs://payment-api/{tag}-{i}"),
            )
        })
        .collect()
}

/// Asserts every answer stored its put with its evidence, each a different artifact.
fn all_stored(answers: &[Result<v1::PutArtifactResponse, Status>], tag: &str) {
    let mut uris = std::collections::BTreeSet::new();
    for (i, answer) in answers.iter().enumerate() {
        let answer = answer.as_ref().expect("stored");
        assert!(answer.created, "{answer:?}");
        let e = answer.evidence.as_ref().expect("evidence recorded");
        assert_eq!(e.evidence_id, format!("logs://payment-api/{tag}-{i}"));
        assert_eq!(e.delegation_id, "del-acme");
        uris.insert(answer.artifact.as_ref().unwrap().uri.clone());
    }
    assert_eq!(uris.len(), answers.len(), "each put its own artifact");
}

#[tokio::test]
async fn puts_that_arrive_while_one_is_on_its_way_go_out_together() {
    let mesh = Mesh::start().await;
    let token = mesh.acme().await;
    let b = Batching::start(&mesh, true, mesh.store.message_limit()).await;
    let mut all = puts("together", 10);
    let first = all.remove(0);
    let answers = b.held_then(&token, first, all).await;

    assert_eq!(
        b.recording.sent(),
        vec![Sent::Alone, Sent::Batch(9)],
        "the first put went alone, the nine behind it in one message"
    );
    all_stored(&answers, "together");
    b.server.stop().await.expect("clean stop");
}

#[tokio::test]
async fn a_batched_put_fails_as_it_would_alone_and_large_puts_go_alone() {
    let mesh = Mesh::start().await;
    let token = mesh.acme().await;
    let b = Batching::start(&mesh, true, mesh.store.message_limit()).await;
    // Evidence citing another tenant's artifact is refused; alone, for comparison.
    let bad = v1::PutArtifactRequest {
        evidence: Some(evidence(
            "logs://payment-api/bad",
            "artifact://globex/0000000000000000000000000000000000000000000000000000000000000000",
            "",
        )),
        ..put(b"{\"bad\": true}", "logs://payment-api/bad")
    };
    let alone = mesh
        .client()
        .await
        .put_artifact(request(bad.clone(), &token))
        .await
        .expect_err("refused alone");
    let mut good = puts("mixed", 3);
    let large = put(
        &vec![b' '; MAX_BATCHED_PUT_BYTES + 1],
        "logs://payment-api/large",
    );
    let answers = b
        .held_then(
            &token,
            good.remove(0),
            vec![bad, good.remove(0), large, good.remove(0)],
        )
        .await;

    // The bad put shares its batch with the next good one; the large put goes alone
    // and the put behind it in a batch of its own.
    assert_eq!(
        b.recording.sent(),
        vec![Sent::Alone, Sent::Batch(2), Sent::Alone, Sent::Alone],
        "{answers:#?}"
    );
    let batched = answers[1].as_ref().expect_err("refused in the batch too");
    assert_eq!(batched.code(), alone.code());
    assert_eq!(batched.message(), alone.message());
    for i in [0, 2, 3, 4] {
        assert!(
            answers[i].as_ref().is_ok_and(|a| a.created),
            "{:?}",
            answers[i]
        );
    }
    b.server.stop().await.expect("clean stop");
}

#[tokio::test]
async fn without_put_artifact_batch_on_the_server_every_put_goes_alone() {
    let mesh = Mesh::start().await;
    let token = mesh.acme().await;
    let b = Batching::start(&mesh, false, mesh.store.message_limit()).await;
    let mut all = puts("old", 6);
    let first = all.remove(0);
    let answers = b.held_then(&token, first, all).await;
    all_stored(&answers, "old");
    assert_eq!(
        b.recording.sent(),
        [
            vec![Sent::Alone, Sent::RefusedBatch(5)],
            vec![Sent::Alone; 5]
        ]
        .concat(),
        "one refused batch, then each put alone"
    );

    // Once refused, the handle sends no batch again.
    let more = puts("later", 3);
    let answers = futures::future::join_all(
        more.into_iter()
            .map(|p| b.evidence.put_artifact(request(p, &token))),
    )
    .await;
    assert!(answers.iter().all(Result::is_ok), "{answers:?}");
    assert!(
        !b.recording.sent()[7..]
            .iter()
            .any(|s| matches!(s, Sent::RefusedBatch(_) | Sent::Batch(_))),
        "{:?}",
        b.recording.sent()
    );
    b.server.stop().await.expect("clean stop");
}

#[tokio::test]
async fn a_batch_too_large_for_the_stores_message_limit_goes_put_by_put() {
    let mesh = Mesh::start().await;
    let token = mesh.acme().await;
    // Room for one put of 1 KiB and its token, not for nine.
    let b = Batching::start(&mesh, true, 4 * 1024).await;
    let big = |i: usize| {
        let mut content = vec![b' '; 1024];
        content[0] = b'0' + u8::try_from(i).unwrap();
        put(&content, &format!("logs://payment-api/limit-{i}"))
    };
    let answers = b
        .held_then(&token, big(0), (1..10).map(big).collect())
        .await;

    all_stored(&answers, "limit");
    // The batch never reached the service: the server's transport refused it. Every
    // put then went alone.
    assert_eq!(b.recording.sent(), vec![Sent::Alone; 10]);
    b.server.stop().await.expect("clean stop");
}

#[tokio::test]
async fn each_batched_put_is_a_child_of_the_span_its_item_names() {
    let capture = convene_telemetry::test_util::Capture::new();
    let _guard = capture.set_default();
    let mesh = Mesh::start().await;
    let token = mesh.acme().await;
    let callers: Vec<tracing::Span> = (0..2)
        .map(|i| tracing::info_span!(target: "convene_evidence_test", "test.tool_call", test.call = i))
        .collect();
    let parents: Vec<String> = callers
        .iter()
        .map(|s| convene_telemetry::traceparent(s).expect("traced"))
        .collect();
    let batch = tracing::info_span!(target: "convene_evidence_test", "test.batch");
    let items = puts("traced", 3)
        .into_iter()
        .enumerate()
        .map(|(i, p)| v1::PutArtifactBatchItem {
            // The last item names no caller.
            traceparent: parents.get(i).cloned().unwrap_or_default(),
            ..item(&token, Some(p))
        })
        .collect();
    let results = tracing::Instrument::instrument(
        mesh.store
            .put_artifact_batch(Request::new(v1::PutArtifactBatchRequest { items })),
        batch.clone(),
    )
    .await
    .expect("answered")
    .into_inner()
    .results;
    assert!(results.iter().all(|r| stored(r).created));
    let batch_ids = convene_telemetry::traceparent(&batch).expect("traced");
    drop((callers, batch));

    let spans = capture.spans();
    let put_span = |i: usize| {
        let call_id = format!("call-logs://payment-api/traced-{i}");
        spans
            .iter()
            .find(|s| {
                s.name == "evidence.put"
                    && s.attributes.iter().any(|kv| {
                        kv.key.as_str() == "convene.tool.call_id" && kv.value.as_str() == call_id
                    })
            })
            .unwrap_or_else(|| panic!("no put span for {call_id}: {spans:#?}"))
    };
    let ids = |tp: &str| {
        let parts: Vec<&str> = tp.split('-').collect();
        (parts[1].to_owned(), parts[2].to_owned())
    };
    for (i, parent) in parents.iter().enumerate() {
        let span = put_span(i);
        let (trace_id, span_id) = ids(parent);
        assert_eq!(span.span_context.trace_id().to_string(), trace_id);
        assert_eq!(
            span.parent_span_id.to_string(),
            span_id,
            "put {i} is stored under the span that asked for it"
        );
    }
    let orphan = put_span(2);
    let (trace_id, span_id) = ids(&batch_ids);
    assert_eq!(orphan.span_context.trace_id().to_string(), trace_id);
    assert_eq!(
        orphan.parent_span_id.to_string(),
        span_id,
        "an item without trace context is stored under the batch"
    );
}
