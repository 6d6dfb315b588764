//! Test support: start the real Fence server in-process on `127.0.0.1:0` (real RocksDB in a
//! temp dir, real gRPC over loopback), with an injectable clock, and connect the generated
//! client to it.

use std::sync::Arc;
use std::time::Duration;

use fence_proto::v1 as pb;
use fence_proto::v1::fence_client::FenceClient;
use fence_server::auth::Auth;
use fence_server::clock::{Clock, ManualClock};
use fence_server::ledger::{Ledger, LedgerConfig};
use fence_server::store::{RocksStore, StoreOptions};
use tokio::sync::oneshot;
use tonic::transport::Channel;

/// A running server.
pub struct TestServer {
    /// `http://127.0.0.1:PORT`.
    pub url: String,
    /// The server's clock (advance it to expire leases and retention).
    pub clock: ManualClock,
    /// The data directory (kept alive for the server's lifetime).
    pub dir: tempfile::TempDir,
    stop: Option<oneshot::Sender<()>>,
    handle: Option<tokio::task::JoinHandle<()>>,
}

/// Server options for tests.
#[derive(Clone)]
pub struct Options {
    /// Authentication mode.
    pub auth: Auth,
    /// Ledger settings.
    pub ledger: LedgerConfig,
    /// TLS (None = plaintext).
    pub tls: Option<tonic::transport::ServerTlsConfig>,
    /// Per-tenant rate limit.
    pub rate_limit: Option<Arc<fence_server::quota::TenantRateLimit>>,
    /// Calls of one Session stream decided at once (0 = the server's default).
    pub max_session_in_flight: usize,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            auth: Auth::Dev,
            ledger: LedgerConfig {
                credential_key: [3; 32],
                ..LedgerConfig::default()
            },
            tls: None,
            rate_limit: None,
            max_session_in_flight: 0,
        }
    }
}

impl TestServer {
    /// Starts a dev-mode server with default settings.
    pub async fn start() -> Self {
        Self::start_with(Options::default()).await
    }

    /// Starts a server with `opts`.
    pub async fn start_with(opts: Options) -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        let clock = ManualClock::new(1_800_000_000_000);
        Self::start_in(dir, clock, opts).await
    }

    /// Starts a server on an existing data dir (to test restarts).
    pub async fn start_in(dir: tempfile::TempDir, clock: ManualClock, opts: Options) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let url = format!("http://{}", listener.local_addr().expect("addr"));
        let path = dir.path().join("ledger");
        let store_clock: Arc<dyn Clock> = Arc::new(clock.clone());
        let ledger = tokio::task::spawn_blocking(move || {
            RocksStore::open(path, &StoreOptions::default())
                .map(|s| Ledger::new(s, store_clock, opts.ledger))
        })
        .await
        .expect("join")
        .expect("open store");
        let (tx, rx) = oneshot::channel::<()>();
        let handle = tokio::spawn(async move {
            let serve = fence_server::ServeOptions {
                auth: opts.auth,
                sweep_interval: Duration::from_millis(50),
                tls: opts.tls,
                rate_limit: opts.rate_limit,
                sequencers: 0,
                inline_commit: true,
                max_streams_per_connection: 64,
                max_session_in_flight: opts.max_session_in_flight,
            };
            fence_server::serve_ledger_with(listener, Arc::new(ledger), serve, async {
                let _ = rx.await;
            })
            .await
            .expect("server");
        });
        Self {
            url,
            clock,
            dir,
            stop: Some(tx),
            handle: Some(handle),
        }
    }

    /// A connected client.
    pub async fn client(&self) -> FenceClient<Channel> {
        FenceClient::connect(self.url.clone())
            .await
            .expect("connect")
    }

    /// A channel to the server (for health and reflection clients).
    pub async fn channel(&self) -> Channel {
        Channel::from_shared(self.url.clone())
            .expect("url")
            .connect()
            .await
            .expect("connect")
    }

    /// Stops the server gracefully and returns its data dir and clock (for a restart).
    pub async fn stop(mut self) -> (tempfile::TempDir, ManualClock) {
        self.shutdown().await;
        let dir = std::mem::replace(&mut self.dir, tempfile::tempdir().expect("temp dir"));
        (dir, self.clock.clone())
    }

    async fn shutdown(&mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        if let Some(h) = self.handle.take() {
            h.await.expect("server task");
        }
    }
}

/// A request carrying the dev-mode tenant header.
pub fn as_tenant<T>(tenant: &str, msg: T) -> tonic::Request<T> {
    let mut r = tonic::Request::new(msg);
    r.metadata_mut()
        .insert("x-fence-tenant", tenant.parse().expect("ascii tenant"));
    r
}

/// A Begin request.
pub fn begin(run: &str, tool: &str, args: &str) -> pb::BeginRequest {
    pb::BeginRequest {
        run_id: run.into(),
        tool: tool.into(),
        arguments_json: args.into(),
        ..Default::default()
    }
}

/// The decision of a Begin response.
pub fn outcome(r: pb::BeginResponse) -> pb::decision::Outcome {
    r.decision
        .and_then(|d| d.outcome)
        .expect("a Begin response always carries a decision")
}

/// The `ErrorInfo.reason` of a status, if any.
pub fn reason_of(status: &tonic::Status) -> Option<String> {
    use tonic_types::StatusExt;
    status
        .get_error_details()
        .error_info()
        .map(|i| i.reason.clone())
}

/// The first `BadRequest` field violation's field, if any.
pub fn bad_field(status: &tonic::Status) -> Option<String> {
    use tonic_types::StatusExt;
    status
        .get_error_details()
        .bad_request()
        .and_then(|b| b.field_violations.first().map(|v| v.field.clone()))
}
