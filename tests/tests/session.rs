//! The Session RPC end to end: calls on one stream are decided exactly as their unary RPCs,
//! answered by id, rate limited per call, bounded in flight, and ended by a graceful shutdown.

use std::collections::HashMap;
use std::time::Duration;

use fence_proto::v1 as pb;
use fence_proto::v1::decision::Outcome as O;
use fence_tests::*;
use pb::session_request::Call;
use pb::session_response::Result as Answer;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Code;

/// One open Session stream: send calls, read answers.
struct Stream {
    calls: mpsc::Sender<pb::SessionRequest>,
    answers: tonic::Streaming<pb::SessionResponse>,
}

impl Stream {
    async fn open(srv: &TestServer, tenant: &str) -> Stream {
        let (calls, rx) = mpsc::channel(1024);
        let answers = srv
            .client()
            .await
            .session(as_tenant(tenant, ReceiverStream::new(rx)))
            .await
            .expect("a session opens")
            .into_inner();
        Stream { calls, answers }
    }

    async fn send(&self, id: u64, call: Call) {
        self.send_raw(pb::SessionRequest {
            id,
            call: Some(call),
            ..Default::default()
        })
        .await;
    }

    async fn send_raw(&self, request: pb::SessionRequest) {
        self.calls.send(request).await.expect("the stream is open");
    }

    async fn next(&mut self) -> pb::SessionResponse {
        tokio::time::timeout(Duration::from_secs(10), self.answers.message())
            .await
            .expect("an answer within 10 s")
            .expect("the stream is healthy")
            .expect("the stream has not ended")
    }

    /// Sends one call and waits for its answer (nothing else in flight).
    async fn call(&mut self, id: u64, call: Call) -> Answer {
        self.send(id, call).await;
        let answer = self.next().await;
        assert_eq!(answer.id, id, "the answer echoes its call's id");
        answer.result.expect("an answer always has a result")
    }
}

fn begun(answer: Answer) -> pb::BeginResponse {
    match answer {
        Answer::Begin(b) => b,
        other => panic!("expected a Begin answer, got {other:?}"),
    }
}

/// A call's error as the status its unary RPC would have failed with.
fn status(answer: Answer) -> tonic::Status {
    match answer {
        Answer::Error(e) => {
            tonic::Status::with_details(Code::from(e.code), e.message, e.details.into())
        }
        other => panic!("expected an error, got {other:?}"),
    }
}

fn granted(b: pb::BeginResponse) -> pb::Execute {
    match outcome(b) {
        O::Execute(e) => e,
        other => panic!("expected Execute, got {other:?}"),
    }
}

fn complete(effect_id: &str, attempt: u32, result: &[u8]) -> Call {
    Call::Complete(pb::CompleteRequest {
        effect_id: effect_id.into(),
        attempt,
        outcome: Some(pb::complete_request::Outcome::Result(result.to_vec())),
        ..Default::default()
    })
}

fn effect_of(e: &pb::Execute) -> (String, u32) {
    let r = e.receipt.as_ref().expect("a grant has a receipt");
    (r.effect_id.clone(), r.attempt)
}

#[tokio::test]
async fn session_calls_are_decided_as_their_unary_rpcs() {
    let srv = TestServer::start().await;
    let mut s = Stream::open(&srv, "acme").await;
    let call = || pb::BeginRequest {
        step_key: "charge".into(),
        ..begin(
            "order-1",
            "payments.charge",
            r#"{"amount":100,"nonce":"a"}"#,
        )
    };

    let grant = granted(begun(s.call(1, Call::Begin(call())).await));
    let (effect_id, attempt) = effect_of(&grant);
    let hb = s
        .call(
            2,
            Call::Heartbeat(pb::HeartbeatRequest {
                effect_id: effect_id.clone(),
                attempt,
                ..Default::default()
            }),
        )
        .await;
    assert!(matches!(hb, Answer::Heartbeat(_)), "{hb:?}");
    let done = s.call(3, complete(&effect_id, attempt, b"ch_1")).await;
    let Answer::Complete(done) = done else {
        panic!("expected a Complete answer, got {done:?}")
    };
    assert_eq!(done.receipt.unwrap().result, b"ch_1");

    // The same call again, on the stream and as a unary RPC: both replay the recorded result.
    match outcome(begun(s.call(4, Call::Begin(call())).await)) {
        O::Replay(r) => assert_eq!(r.receipt.unwrap().result, b"ch_1"),
        other => panic!("expected Replay, got {other:?}"),
    }
    let unary = srv
        .client()
        .await
        .begin(as_tenant("acme", call()))
        .await
        .unwrap()
        .into_inner();
    match outcome(unary) {
        O::Replay(r) => assert_eq!(r.receipt.unwrap().effect_id, effect_id),
        other => panic!("expected Replay, got {other:?}"),
    }

    // Errors are the unary RPC's statuses, and the stream goes on after them.
    let bad = status(
        s.call(5, Call::Begin(begin("", "payments.charge", "{}")))
            .await,
    );
    assert_eq!(bad.code(), Code::InvalidArgument);
    assert_eq!(bad_field(&bad).as_deref(), Some("run_id"));
    let stale = status(s.call(6, complete(&effect_id, attempt, b"other")).await);
    assert_eq!(stale.code(), Code::FailedPrecondition, "{stale:?}");
    let empty = pb::SessionRequest {
        id: 7,
        ..Default::default()
    };
    s.send_raw(empty).await;
    let answer = s.next().await;
    assert_eq!(answer.id, 7);
    let empty = status(answer.result.unwrap());
    assert_eq!(empty.code(), Code::InvalidArgument);
    assert_eq!(bad_field(&empty).as_deref(), Some("call"));

    // Another tenant's stream sees none of it.
    let mut other = Stream::open(&srv, "globex").await;
    let foreign = status(other.call(1, complete(&effect_id, attempt, b"ch_1")).await);
    assert_eq!(foreign.code(), Code::NotFound, "{foreign:?}");
    granted(begun(other.call(2, Call::Begin(call())).await));
}

#[tokio::test]
async fn one_runs_calls_are_decided_in_order_and_every_call_is_answered_by_id() {
    let srv = TestServer::start_with(Options {
        // Far fewer in flight than sent: the server must hold the rest back, not lose them.
        max_session_in_flight: 4,
        ..Options::default()
    })
    .await;
    let mut s = Stream::open(&srv, "acme").await;
    // 200 calls sent without waiting: 100 steps of one run, and one step each of 100 runs.
    for i in 0..100u64 {
        let mut one_run = begin("batch", "mail.send", &format!(r#"{{"to":"u{i}"}}"#));
        one_run.step_key = format!("s{i}");
        s.send(i, Call::Begin(one_run)).await;
        let many_runs = begin(&format!("run-{i}"), "mail.send", r#"{"to":"all"}"#);
        s.send(1000 + i, Call::Begin(many_runs)).await;
    }
    let mut seq_of = HashMap::new();
    for _ in 0..200 {
        let answer = s.next().await;
        let grant = granted(begun(answer.result.unwrap()));
        let receipt = grant.receipt.unwrap();
        assert!(
            seq_of.insert(answer.id, receipt.position).is_none(),
            "one answer per id"
        );
    }
    // Within the run, each step was decided after the ones sent before it.
    let seqs: Vec<u64> = (0..100).map(|i| seq_of[&i]).collect();
    assert_eq!(seqs, (0..100).collect::<Vec<_>>());
    assert!((1000..1100).all(|i| seq_of[&i] == 0));
}

#[tokio::test]
async fn the_rate_limit_is_taken_per_call_and_the_stream_goes_on() {
    let limit = std::sync::Arc::new(fence_server::quota::TenantRateLimit::new(1, 3));
    let srv = TestServer::start_with(Options {
        rate_limit: Some(limit),
        ..Options::default()
    })
    .await;
    // Opening the stream takes one token; the burst of 3 leaves two calls.
    let mut s = Stream::open(&srv, "noisy").await;
    let mut refused = None;
    for i in 0..6u64 {
        let call = begin(&format!("r{i}"), "mail.send", "{}");
        match s.call(i, Call::Begin(call)).await {
            Answer::Begin(_) => {}
            other => {
                refused = Some((i, status(other)));
                break;
            }
        }
    }
    let (i, refusal) = refused.expect("the burst must run out within 6 immediate calls");
    assert!(i >= 2, "refused too early: call {i}");
    assert_eq!(refusal.code(), Code::ResourceExhausted);
    assert_eq!(reason_of(&refusal).as_deref(), Some("LIMIT_EXCEEDED"));
    // The stream is still open: a call after the bucket refills is decided.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let later = s
        .call(99, Call::Begin(begin("later", "mail.send", "{}")))
        .await;
    assert!(matches!(later, Answer::Begin(_)), "{later:?}");
}

#[tokio::test]
async fn a_graceful_shutdown_ends_open_streams_with_unavailable() {
    let srv = TestServer::start().await;
    let mut s = Stream::open(&srv, "acme").await;
    granted(begun(
        s.call(1, Call::Begin(begin("r", "mail.send", "{}"))).await,
    ));
    // The stream stays open (the caller never closes it); the shutdown must not wait on it.
    let stopped = tokio::time::timeout(Duration::from_secs(10), srv.stop()).await;
    assert!(
        stopped.is_ok(),
        "the server did not stop with a session open"
    );
    let end = tokio::time::timeout(Duration::from_secs(10), s.answers.message())
        .await
        .expect("the stream ends");
    match end {
        Err(status) => assert_eq!(status.code(), Code::Unavailable, "{status:?}"),
        Ok(other) => panic!("expected UNAVAILABLE, got {other:?}"),
    }
}
