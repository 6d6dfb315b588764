//! Prometheus metrics: `fenced --metrics-listen` serves them, and the counters move with real
//! calls (decisions by kind and reason, RPCs by method and code, group commits).

mod common;

use common::fenced::Fenced;
use fence_proto::v1 as pb;
use fence_proto::v1::decision::Outcome as O;
use fence_proto::v1::fence_client::FenceClient;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// GET `path` from the metrics listener: (status line, body).
async fn get(addr: &str, path: &str) -> (String, String) {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut raw = String::new();
    s.read_to_string(&mut raw).await.unwrap();
    let (head, body) = raw.split_once("\r\n\r\n").unwrap();
    (head.lines().next().unwrap().to_owned(), body.to_owned())
}

/// The value of the sample whose line starts with `series` (name and labels as rendered).
fn sample(metrics: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    metrics.lines().find_map(|l| {
        let (series, value) = l.rsplit_once(' ')?;
        let (n, rest) = series.split_once('{').unwrap_or((series, ""));
        (n == name
            && labels
                .iter()
                .all(|(k, v)| rest.contains(&format!("{k}=\"{v}\""))))
        .then(|| value.parse().ok())?
    })
}

fn call(step: &str, amount: u32) -> pb::BeginRequest {
    pb::BeginRequest {
        run_id: "r".into(),
        tool: "pay".into(),
        step_key: step.into(),
        arguments_json: format!(r#"{{"amount":{amount}}}"#),
        ..Default::default()
    }
}

#[tokio::test]
async fn counters_move_with_real_calls() {
    let dir = tempfile::tempdir().unwrap();
    let mut fenced = Fenced::start(dir.path(), &["--metrics-listen", "127.0.0.1:0"]);
    let metrics = fenced.metrics_addr();
    let mut c = FenceClient::connect(fenced.url()).await.unwrap();

    let begun = c.begin(call("a", 1)).await.unwrap().into_inner();
    let Some(O::Execute(ex)) = begun.decision.and_then(|d| d.outcome) else {
        panic!("expected a grant")
    };
    c.complete(pb::CompleteRequest {
        effect_id: ex.effect_id,
        attempt: ex.attempt,
        outcome: Some(pb::complete_request::Outcome::Result(b"ok".to_vec())),
        ..Default::default()
    })
    .await
    .unwrap();
    // A replay, and a refusal: the same step with other arguments.
    c.begin(call("a", 1)).await.unwrap();
    c.begin(call("a", 2)).await.unwrap();
    // An invalid request.
    c.begin(pb::BeginRequest {
        run_id: String::new(),
        ..call("b", 1)
    })
    .await
    .unwrap_err();
    // On a Session stream: a grant, and a message holding no call.
    let (calls, outgoing) = tokio::sync::mpsc::channel(4);
    let mut answers = c
        .session(tokio_stream::wrappers::ReceiverStream::new(outgoing))
        .await
        .unwrap()
        .into_inner();
    for request in [
        pb::SessionRequest {
            id: 1,
            call: Some(pb::session_request::Call::Begin(call("s", 7))),
            ..Default::default()
        },
        pb::SessionRequest {
            id: 2,
            ..Default::default()
        },
    ] {
        calls.send(request).await.unwrap();
        answers.message().await.unwrap().unwrap();
    }

    let (status, body) = get(&metrics, "/metrics").await;
    assert!(status.contains("200"), "{status}");
    let d = |decision, reason| {
        sample(
            &body,
            "fence_decisions_total",
            &[("decision", decision), ("reason", reason)],
        )
    };
    assert_eq!(d("execute", ""), Some(2.0), "{body}");
    assert_eq!(d("replay", ""), Some(1.0), "{body}");
    assert_eq!(d("refused", "ARGUMENT_MISMATCH"), Some(1.0), "{body}");
    let rpcs = |method, code| {
        sample(
            &body,
            "fence_rpc_requests_total",
            &[("method", method), ("code", code)],
        )
    };
    assert_eq!(rpcs("Begin", "OK"), Some(3.0), "{body}");
    assert_eq!(rpcs("Begin", "INVALID_ARGUMENT"), Some(1.0), "{body}");
    assert_eq!(rpcs("Complete", "OK"), Some(1.0), "{body}");
    // Session calls are counted per call, under their own names.
    assert_eq!(rpcs("Session/Begin", "OK"), Some(1.0), "{body}");
    assert_eq!(rpcs("Session", "INVALID_ARGUMENT"), Some(1.0), "{body}");
    assert!(
        sample(&body, "fence_group_commits_total", &[("result", "ok")]).unwrap_or(0.0) >= 1.0,
        "{body}"
    );
    assert!(body.contains("fence_rpc_duration_seconds"), "{body}");
    // A grant and a completion were written durably, each group with its sync; the replay's
    // audit counters were not synced.
    let synced = sample(
        &body,
        "fence_store_writes_total",
        &[("durability", "deferred")],
    );
    assert!(synced.unwrap_or(0.0) >= 2.0, "{body}");
    assert_eq!(
        sample(
            &body,
            "fence_store_writes_total",
            &[("durability", "unsynced")]
        ),
        Some(1.0),
        "{body}"
    );
    assert!(
        sample(&body, "fence_wal_syncs_total", &[]).unwrap_or(0.0) >= 2.0,
        "{body}"
    );
    assert!(
        sample(&body, "fence_wal_sync_seconds_count", &[]).unwrap_or(0.0) >= 2.0,
        "{body}"
    );
    assert!(
        sample(&body, "fence_store_bytes", &[]).unwrap_or(0.0) > 0.0,
        "{body}"
    );
    // A clean start: RocksDB's recovery dropped nothing.
    assert_eq!(
        sample(&body, "fence_store_recovery_losses", &[]),
        Some(0.0),
        "{body}"
    );
    // No run, effect or tenant ids in any label.
    assert!(!body.contains("\"r\""), "{body}");
    let (status, _) = get(&metrics, "/other").await;
    assert!(status.contains("404"), "{status}");
}

/// A launcher that reads only the address line and closes stdout does not take the server
/// down when it then prints the metrics line.
#[tokio::test]
async fn a_launcher_reading_only_the_first_line_does_not_stop_the_server() {
    let dir = tempfile::tempdir().unwrap();
    let mut fenced = Fenced::start(dir.path(), &["--metrics-listen", "127.0.0.1:0"]);
    fenced.close_stdout();
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    let mut c = FenceClient::connect(fenced.url()).await.unwrap();
    c.begin(call("a", 1)).await.unwrap();
    assert!(fenced.child.try_wait().unwrap().is_none(), "fenced exited");
}

/// The open-effect gauges follow a grant until it is settled (updated every sweep).
#[tokio::test]
async fn open_effect_gauges_follow_grants_until_settled() {
    let dir = tempfile::tempdir().unwrap();
    let mut fenced = Fenced::start(
        dir.path(),
        &[
            "--metrics-listen",
            "127.0.0.1:0",
            "--sweep-interval-ms",
            "50",
        ],
    );
    let metrics = fenced.metrics_addr();
    let mut c = FenceClient::connect(fenced.url()).await.unwrap();
    let gauge_reaches = |state: &'static str, want: f64| {
        let metrics = metrics.clone();
        async move {
            for _ in 0..200 {
                let (_, body) = get(&metrics, "/metrics").await;
                if sample(&body, "fence_open_effects", &[("state", state)]) == Some(want) {
                    return;
                }
                tokio::time::sleep(std::time::Duration::from_millis(25)).await;
            }
            panic!("fence_open_effects{{state={state:?}}} never reached {want}");
        }
    };
    gauge_reaches("accepted", 0.0).await;
    let begun = c.begin(call("a", 1)).await.unwrap().into_inner();
    let Some(O::Execute(ex)) = begun.decision.and_then(|d| d.outcome) else {
        panic!("expected a grant")
    };
    gauge_reaches("accepted", 1.0).await;
    c.complete(pb::CompleteRequest {
        effect_id: ex.effect_id,
        attempt: ex.attempt,
        outcome: Some(pb::complete_request::Outcome::Result(b"ok".to_vec())),
        ..Default::default()
    })
    .await
    .unwrap();
    gauge_reaches("accepted", 0.0).await;
    // A grant whose lease lapses: unknown, the gauge to alert on.
    let lapsing = pb::BeginRequest {
        lease_ms: 1,
        ..call("b", 2)
    };
    c.begin(lapsing).await.unwrap();
    gauge_reaches("effect_unknown", 1.0).await;
}
