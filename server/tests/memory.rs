//! Memory under a hostile client: one connection opens many requests for large effect
//! listings and never reads the answers. The server buffers at most its per-connection stream
//! limit times (about six times) the ListEffects page cap, keeps serving other clients, and
//! releases what it held when the connection goes (a second such connection reuses it rather
//! than adding to it). Runs the real `fenced`; the client speaks raw HTTP/2.

mod common;

use std::time::Duration;

use common::fenced::Fenced;
use fence_proto::v1 as pb;
use fence_proto::v1::decision::Outcome as O;
use fence_proto::v1::fence_client::FenceClient;
use prost::Message;
use tokio_stream::StreamExt as _;

/// fenced's resident memory, MiB.
fn rss_mib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap();
    kib / 1024
}

/// One connection with 64 requests for a 1000-effect listing of run "big", none read.
struct Hoarder {
    tasks: Vec<tokio::task::JoinHandle<Result<(), h2::Error>>>,
    connection: tokio::task::JoinHandle<()>,
}

impl Hoarder {
    async fn connect(addr: &str) -> Hoarder {
        let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
        let (send, connection) = h2::client::handshake(tcp).await.unwrap();
        let connection = tokio::spawn(async move {
            let _ = connection.await;
        });
        let msg = pb::ListEffectsRequest {
            run_id: "big".into(),
            page_size: 1000,
            ..Default::default()
        }
        .encode_to_vec();
        let mut framed = vec![0u8];
        framed.extend_from_slice(&(msg.len() as u32).to_be_bytes());
        framed.extend_from_slice(&msg);
        let body = bytes::Bytes::from(framed);
        let tasks = (0..64)
            .map(|_| {
                let send = send.clone();
                let body = body.clone();
                // Each waits for a stream slot (the server allows 16 at a time), then holds its
                // response without reading a byte of it.
                tokio::spawn(async move {
                    let mut send = send.ready().await?;
                    let request = tonic::codegen::http::Request::builder()
                        .method("POST")
                        .uri("/fence.v1.Fence/ListEffects")
                        .header("content-type", "application/grpc")
                        .header("te", "trailers")
                        .body(())
                        .unwrap();
                    let (response, mut stream) = send.send_request(request, false)?;
                    stream.send_data(body, true)?;
                    let held = response.await?.into_body();
                    std::future::pending::<()>().await;
                    drop(held);
                    Ok(())
                })
            })
            .collect();
        Hoarder { tasks, connection }
    }

    /// Drops every stream and the connection (the socket closes).
    fn disconnect(self) {
        for task in &self.tasks {
            task.abort();
        }
        self.connection.abort();
    }
}

/// Prints the peaks (visible with --nocapture), for whoever tunes the bound.
fn trace_peaks(baseline: u64, peaks: &[u64]) {
    eprintln!("fenced RSS: baseline {baseline} MiB, peaks per hostile connection {peaks:?} MiB");
}

#[tokio::test]
async fn unread_responses_are_bounded_and_reused_across_connections() {
    let dir = tempfile::tempdir().unwrap();
    let fenced = Fenced::start(dir.path(), &["--max-streams-per-connection", "16"]);
    let addr = fenced.addr.clone();
    let mut c = FenceClient::connect(format!("http://{addr}"))
        .await
        .unwrap();

    // 160 effects with 100 KB results: a full page (1000) would be 16 MB, a capped one 1 MiB.
    let result = vec![b'r'; 100_000];
    for i in 0..160 {
        let begun = c
            .begin(pb::BeginRequest {
                run_id: "big".into(),
                tool: "report".into(),
                step_key: format!("s{i}"),
                arguments_json: format!(r#"{{"n":{i}}}"#),
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        let Some(O::Execute(ex)) = begun.decision.and_then(|d| d.outcome) else {
            panic!("expected a grant");
        };
        c.complete(pb::CompleteRequest {
            effect_id: ex.effect_id,
            attempt: ex.attempt,
            outcome: Some(pb::complete_request::Outcome::Result(result.clone())),
            ..Default::default()
        })
        .await
        .unwrap();
    }
    let pid = fenced.child.id();
    let baseline = rss_mib(pid);

    // Three rounds of the hostile client, each disconnecting at the end: what one round made
    // the server hold is released and reused by the next, so every round stays within the
    // bound (held memory that accumulated would pass it by the third).
    let mut peaks = Vec::new();
    for round in 0..3 {
        let hoarder = Hoarder::connect(&addr).await;
        tokio::time::sleep(Duration::from_secs(2)).await;
        let loaded = rss_mib(pid);
        peaks.push(loaded);

        // Another client is still served, at once.
        let run = tokio::time::timeout(
            Duration::from_secs(5),
            c.get_run(pb::GetRunRequest {
                run_id: "big".into(),
            }),
        )
        .await
        .expect("another client was not served while one connection hoarded responses")
        .unwrap();
        assert!(run.into_inner().run.is_some());

        // At most 16 streams of 1 MiB pages are buffered for the hostile connection (each a few
        // times over while encoded and sent: about 6 MiB a stream, measured 100 MiB for 16),
        // plus the allocator's slack; unbounded, 64 full 16 MB pages would be gigabytes, and
        // memory held over from earlier rounds would pass this by the third.
        assert!(
            loaded <= baseline + 16 * 6 + 128,
            "round {round}: fenced grew from {baseline} to {loaded} MiB (rounds so far: {peaks:?})"
        );
        hoarder.disconnect();
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    trace_peaks(baseline, &peaks);
}

/// Opens a Session stream that sends up to `calls` Begins of 100 KB arguments (each a new
/// effect, whose grant echoes them) and never reads an answer; returns the held answers and
/// how many calls went out before the server stopped reading.
async fn hoard_session(addr: &str, calls: usize) -> (tonic::Streaming<pb::SessionResponse>, usize) {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    let padding = "p".repeat(100_000);
    let sent = Arc::new(AtomicUsize::new(0));
    let counter = sent.clone();
    let requests = tokio_stream::iter(0..calls).map(move |i| {
        counter.fetch_add(1, Ordering::SeqCst);
        pb::SessionRequest {
            id: i as u64,
            call: Some(pb::session_request::Call::Begin(pb::BeginRequest {
                run_id: format!("hoard-{i}"),
                tool: "report".into(),
                arguments_json: format!(r#"{{"n":{i},"pad":"{padding}"}}"#),
                ..Default::default()
            })),
            ..Default::default()
        }
    });
    let mut hoarder = FenceClient::connect(format!("http://{addr}"))
        .await
        .unwrap();
    let answers = hoarder.session(requests).await.unwrap().into_inner();
    // Wait until the caller can send no more (the server stopped reading).
    let mut last = 0;
    for _ in 0..30 {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let now = sent.load(Ordering::SeqCst);
        if now == last {
            break;
        }
        last = now;
    }
    (answers, sent.load(Ordering::SeqCst))
}

/// A client that reads nothing cannot hold `fenced`'s shutdown: after SIGTERM it drains for
/// `--shutdown-grace-ms`, then exits anyway (everything it acknowledged is already durable).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_never_reads_cannot_hold_the_shutdown() {
    let dir = tempfile::tempdir().unwrap();
    let mut fenced = Fenced::start(dir.path(), &["--shutdown-grace-ms", "500"]);
    let (_answers, _) = hoard_session(&fenced.addr, 1_000).await;
    let exited = tokio::task::spawn_blocking(move || {
        let status = fenced.terminate_within(Duration::from_secs(20));
        (fenced, status)
    })
    .await
    .unwrap()
    .1;
    assert!(
        exited.is_some(),
        "fenced was still draining a stream nobody reads 20 s after SIGTERM"
    );
}

/// One Session stream sending thousands of large calls and never reading an answer: the
/// server decides at most `--max-session-in-flight` of them, stops reading the stream, and
/// holds only those answers, however much the caller sends; other clients are served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_that_never_reads_its_answers_is_held_to_its_in_flight_bound() {
    let dir = tempfile::tempdir().unwrap();
    let fenced = Fenced::start(dir.path(), &["--max-session-in-flight", "64"]);
    let addr = fenced.addr.clone();
    let mut c = FenceClient::connect(format!("http://{addr}"))
        .await
        .unwrap();
    let pid = fenced.child.id();
    let baseline = rss_mib(pid);

    // 4,000 calls of 100 KB arguments each (400 MB), each a new effect whose grant echoes
    // its arguments: unbounded, the server would hold gigabytes.
    const CALLS: usize = 4_000;
    let (_answers, stalled_at) = hoard_session(&addr, CALLS).await;
    let loaded = rss_mib(pid);
    eprintln!(
        "session hoarder: {stalled_at} of {CALLS} calls sent; fenced RSS {baseline} -> {loaded} MiB"
    );
    assert!(
        stalled_at < CALLS / 2,
        "the server kept reading a stream whose answers were never read ({stalled_at} calls)"
    );
    // 64 decided calls and their answers (about 200 KB each), what HTTP/2 windows and the
    // decoder hold, and the allocator's slack.
    assert!(
        loaded <= baseline + 256,
        "fenced grew from {baseline} to {loaded} MiB"
    );
    // Other clients are served meanwhile.
    let other = tokio::time::timeout(
        Duration::from_secs(5),
        c.begin(pb::BeginRequest {
            run_id: "other".into(),
            tool: "report".into(),
            arguments_json: "{}".into(),
            ..Default::default()
        }),
    )
    .await
    .expect("another client was not served while a session hoarded answers")
    .unwrap();
    assert!(other.into_inner().decision.is_some());
}
