//! The gRPC service itself under arbitrary requests: each input is a sequence of calls, each a
//! method and a protobuf body decoded as that method's request (anything prost accepts, so
//! every field may hold any value), handed to the real `FenceService` (authentication,
//! conversion, sequencers, ledger) over the in-memory store. It must never panic, and never
//! answer INTERNAL or UNKNOWN: a request the service cannot use gets a clear error naming why.
#![no_main]

use std::sync::Arc;

use fence_proto::v1::fence_server::Fence;
use fence_server::auth::Auth;
use fence_server::clock::ManualClock;
use fence_server::ledger::{Ledger, LedgerConfig};
use fence_server::service::FenceService;
use fence_server::store::MemStore;
use libfuzzer_sys::fuzz_target;
use prost::Message;
use tonic::{Code, Request, Status};

/// A request as it leaves the authentication interceptor (dev mode: the default tenant).
fn authed<T>(body: T) -> Request<T> {
    Auth::Dev
        .authenticate(Request::new(body))
        .expect("dev mode authenticates everything")
}

/// Decodes `body` as `M` and calls the method with it; `None` when it does not decode (the
/// codec answers that INVALID_ARGUMENT before the service is reached).
async fn call<M, R, F, Fut>(body: &[u8], method: F) -> Option<Result<R, Status>>
where
    M: Message + Default,
    F: FnOnce(Request<M>) -> Fut,
    Fut: std::future::Future<Output = Result<tonic::Response<R>, Status>>,
{
    let message = M::decode(body).ok()?;
    Some(method(authed(message)).await.map(tonic::Response::into_inner))
}

fn check<R>(method: u8, answer: Option<Result<R, Status>>) {
    if let Some(Err(status)) = answer {
        assert!(
            !matches!(status.code(), Code::Internal | Code::Unknown),
            "method {method} answered {status:?}"
        );
    }
}

fuzz_target!(|data: &[u8]| {
    // One runtime for the whole fuzzing session; a fresh ledger for every input.
    static RUNTIME: std::sync::LazyLock<tokio::runtime::Runtime> =
        std::sync::LazyLock::new(|| {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap()
        });
    let ledger = Arc::new(Ledger::new(
        MemStore::new(),
        Arc::new(ManualClock::new(1_000_000)),
        LedgerConfig::default(),
    ));
    let service = FenceService::with_sequencers(ledger, 1);
    RUNTIME.block_on(async {
        // Calls: [method, length, body...], repeated.
        let mut rest = data;
        while let [method, len, tail @ ..] = rest {
            let (body, next) = tail.split_at(usize::from(*len).min(tail.len()));
            rest = next;
            let s = &service;
            match method % 20 {
                0 => check(0, call(body, |r| s.register_tool(r)).await),
                1 => check(1, call(body, |r| s.get_tool(r)).await),
                2 => check(2, call(body, |r| s.start_run(r)).await),
                3 => check(3, call(body, |r| s.get_run(r)).await),
                4 => check(4, call(body, |r| s.checkpoint(r)).await),
                5 => check(5, call(body, |r| s.restore(r)).await),
                6 => check(6, call(body, |r| s.fork(r)).await),
                7 => check(7, call(body, |r| s.begin(r)).await),
                8 => check(8, call(body, |r| s.begin_batch(r)).await),
                9 => check(9, call(body, |r| s.complete(r)).await),
                10 => check(10, call(body, |r| s.complete_batch(r)).await),
                11 => check(11, call(body, |r| s.heartbeat(r)).await),
                12 => check(12, call(body, |r| s.reconcile(r)).await),
                13 => check(13, call(body, |r| s.query_outcome(r)).await),
                14 => check(14, call(body, |r| s.list_effects(r)).await),
                15 => check(15, call(body, |r| s.register_credential(r)).await),
                16 => check(16, call(body, |r| s.get_credential(r)).await),
                17 => check(17, call(body, |r| s.list_runs(r)).await),
                18 => check(18, call(body, |r| s.list_tools(r)).await),
                _ => check(19, call(body, |r| s.list_unsettled_effects(r)).await),
            }
        }
    });
});
