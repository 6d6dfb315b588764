//! Prometheus metrics: what is recorded (names and labels, all of bounded cardinality: no
//! run, effect or tenant ids) and, with `fenced --metrics-listen ADDR`, the admin listener
//! that serves them at `GET /metrics`. Without a listener no recorder is installed and every
//! recording is a no-op (one atomic load).
//!
//! | metric | type | labels |
//! |---|---|---|
//! | `fence_rpc_requests_total` | counter | `method`, `code` (gRPC status name) |
//! | `fence_rpc_duration_seconds` | histogram | `method` |
//! | `fence_decisions_total` | counter | `decision` (execute, replay, in_progress, refused), `reason` (the refusal reason, or "") |
//! | `fence_group_commits_total` | counter | `result` (ok, failed): sequencer groups, one WAL sync each |
//! | `fence_group_commit_requests` | histogram | requests decided per group |
//! | `fence_inline_commits_total` | counter | lone requests decided on the receiving thread (`--inline-commit`), each also a group |
//! | `fence_rate_limited_total` | counter | calls refused by `--tenant-rate-limit` |
//! | `fence_store_writes_total` | counter | `durability` (synced, deferred: synced with its group, unsynced: audit counters) |
//! | `fence_wal_syncs_total` | counter | WAL syncs asked of RocksDB (writes per sync = writes / syncs) |
//! | `fence_wal_sync_seconds` | histogram | each synced write's time in RocksDB: WAL write, `fdatasync`, memtable insert (every acknowledged decision waits for one) |
//! | `fence_store_bytes` | gauge | the store's table files and memtables (updated every background pass, `--sweep-interval-ms`) |
//! | `fence_store_recovery_losses` | gauge | what RocksDB's recovery dropped from its WAL at the last open (logged at WARN, one line each) |
//! | `fence_retention_tombstones_total` | counter | finished effects past their retention window whose payload compaction dropped (each counted when its table file is rewritten) |
//! | `fence_open_effects` | gauge | `state` (accepted, running: lease live; effect_unknown: needs a reconcile), updated every background pass |

use std::time::Instant;

use crate::ledger::Decision;

/// Records one finished RPC.
pub fn rpc(method: &'static str, started: Instant, code: tonic::Code) {
    metrics::counter!("fence_rpc_requests_total", "method" => method, "code" => code_name(code))
        .increment(1);
    metrics::histogram!("fence_rpc_duration_seconds", "method" => method)
        .record(started.elapsed().as_secs_f64());
}

/// Records one Begin decision.
pub fn decision(d: &Decision) {
    let (decision, reason) = match d {
        Decision::Execute { .. } => ("execute", ""),
        Decision::Replay(_) => ("replay", ""),
        Decision::InProgress { .. } => ("in_progress", ""),
        Decision::Refused(r) => (
            "refused",
            fence_proto::v1::ReasonCode::try_from(r.reason.code())
                .map_or("UNKNOWN", |c| c.as_str_name()),
        ),
    };
    metrics::counter!("fence_decisions_total", "decision" => decision, "reason" => reason)
        .increment(1);
}

/// Records one sequencer group: how many requests it decided and whether its sync held.
pub fn group_commit(requests: usize, ok: bool) {
    let result = if ok { "ok" } else { "failed" };
    metrics::counter!("fence_group_commits_total", "result" => result).increment(1);
    metrics::histogram!("fence_group_commit_requests").record(requests as f64);
}

/// Records a lone request decided and committed on the thread that received it.
pub fn inline_commit() {
    metrics::counter!("fence_inline_commits_total").increment(1);
}

/// Records an effect record that compaction made a tombstone (from RocksDB's threads).
pub fn retention_tombstone() {
    metrics::counter!("fence_retention_tombstones_total").increment(1);
}

/// Records a call refused by the per-tenant rate limit.
pub fn rate_limited() {
    metrics::counter!("fence_rate_limited_total").increment(1);
}

/// Records one store write of the given durability.
pub fn store_write(durability: &'static str) {
    metrics::counter!("fence_store_writes_total", "durability" => durability).increment(1);
}

/// Records one WAL sync.
pub fn wal_sync() {
    metrics::counter!("fence_wal_syncs_total").increment(1);
}

/// Records how long one synced write took.
pub fn wal_synced(took: std::time::Duration) {
    metrics::histogram!("fence_wal_sync_seconds").record(took.as_secs_f64());
}

/// Sets the store's size.
pub fn store_bytes(bytes: u64) {
    metrics::gauge!("fence_store_bytes").set(bytes as f64);
}

/// Sets how many losses RocksDB's recovery reported at the last open.
pub fn recovery_losses(n: usize) {
    metrics::gauge!("fence_store_recovery_losses").set(n as f64);
}

/// Sets the gauges of effects not settled yet.
pub fn open_effects(census: &crate::ledger::expiry::OpenCensus) {
    for (state, n) in [
        ("accepted", census.accepted),
        ("running", census.running),
        ("effect_unknown", census.unknown),
    ] {
        metrics::gauge!("fence_open_effects", "state" => state).set(n as f64);
    }
}

fn code_name(code: tonic::Code) -> &'static str {
    use tonic::Code as C;
    match code {
        C::Ok => "OK",
        C::Cancelled => "CANCELLED",
        C::Unknown => "UNKNOWN",
        C::InvalidArgument => "INVALID_ARGUMENT",
        C::DeadlineExceeded => "DEADLINE_EXCEEDED",
        C::NotFound => "NOT_FOUND",
        C::AlreadyExists => "ALREADY_EXISTS",
        C::PermissionDenied => "PERMISSION_DENIED",
        C::ResourceExhausted => "RESOURCE_EXHAUSTED",
        C::FailedPrecondition => "FAILED_PRECONDITION",
        C::Aborted => "ABORTED",
        C::OutOfRange => "OUT_OF_RANGE",
        C::Unimplemented => "UNIMPLEMENTED",
        C::Internal => "INTERNAL",
        C::Unavailable => "UNAVAILABLE",
        C::DataLoss => "DATA_LOSS",
        C::Unauthenticated => "UNAUTHENTICATED",
    }
}

/// Installs the Prometheus recorder (once per process) and serves its text at `GET /metrics`
/// (any other path: 404) on `listener`, until the process ends.
#[cfg(feature = "rocksdb")]
pub fn serve(listener: tokio::net::TcpListener) -> Result<(), String> {
    use http_body_util::Full;
    use hyper::body::Bytes;
    use hyper::{Response, StatusCode};

    let handle = metrics_exporter_prometheus::PrometheusBuilder::new()
        .install_recorder()
        .map_err(|e| format!("cannot install the metrics recorder: {e}"))?;
    tokio::spawn(async move {
        loop {
            let (stream, _) = match listener.accept().await {
                Ok(accepted) => accepted,
                Err(e) => {
                    tracing::warn!(error = %e, "metrics listener: accept failed");
                    continue;
                }
            };
            let handle = handle.clone();
            tokio::spawn(async move {
                let service = hyper::service::service_fn(move |req: hyper::Request<_>| {
                    let response = if req.uri().path() == "/metrics" {
                        handle.run_upkeep();
                        Response::builder()
                            .header("content-type", "text/plain; version=0.0.4")
                            .body(Full::new(Bytes::from(handle.render())))
                    } else {
                        Response::builder()
                            .status(StatusCode::NOT_FOUND)
                            .body(Full::new(Bytes::from_static(b"metrics are at /metrics\n")))
                    };
                    async move { response }
                });
                let io = hyper_util::rt::TokioIo::new(stream);
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(io, service)
                    .await;
            });
        }
    });
    Ok(())
}
