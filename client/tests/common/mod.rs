//! Test harness: the real Fence server in-process (RocksDB in a temp dir, an ephemeral port),
//! restartable on the same address and data dir; a fake downstream API that counts every
//! commit; and a tower layer that loses chosen responses after the server answered them.
#![allow(dead_code)]

use std::collections::HashMap;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use fence_client::{BoxError, FenceClient, RetryPolicy};
use tokio::net::{TcpListener, TcpSocket};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tonic::codegen::http;
use tonic::transport::{Channel, Endpoint};
use tower::Service;

/// The server, running in this process until stopped.
pub struct TestServer {
    pub addr: SocketAddr,
    pub dir: tempfile::TempDir,
    config: fence_server::Config,
    shutdown: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<()>>,
}

fn listener_on(addr: SocketAddr) -> TcpListener {
    let socket = TcpSocket::new_v4().unwrap();
    // Restarting on the same port right after the old listener closed.
    socket.set_reuseaddr(true).unwrap();
    socket.bind(addr).unwrap();
    socket.listen(1024).unwrap()
}

impl TestServer {
    pub async fn start() -> TestServer {
        TestServer::start_with(|_, _| {}).await
    }

    /// Starts with the default config changed by `configure` (given the temp dir, for files
    /// such as certificates or a tokens file).
    pub async fn start_with(
        configure: impl FnOnce(&mut fence_server::Config, &std::path::Path),
    ) -> TestServer {
        let dir = tempfile::tempdir().unwrap();
        let mut config = fence_server::Config::with_data_dir(dir.path().join("data"));
        configure(&mut config, dir.path());
        let listener = listener_on("127.0.0.1:0".parse().unwrap());
        let addr = listener.local_addr().unwrap();
        let mut server = TestServer {
            addr,
            dir,
            config,
            shutdown: None,
            task: None,
        };
        server.serve(listener);
        server
    }

    fn serve(&mut self, listener: TcpListener) {
        let config = self.config.clone();
        let (tx, rx) = oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            fence_server::serve(listener, config, async {
                let _ = rx.await;
            })
            .await
            .expect("the server failed");
        });
        self.shutdown = Some(tx);
        self.task = Some(task);
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Stops the server (draining in-flight calls, closing the store).
    pub async fn stop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        if let Some(task) = self.task.take() {
            task.await.unwrap();
        }
    }

    /// Starts it again on the same address and data dir.
    pub async fn restart(&mut self) {
        self.stop().await;
        let listener = listener_on(self.addr);
        self.serve(listener);
    }

    /// A client with a fast retry policy (tests wait for leases of a few hundred ms).
    pub async fn client(&self) -> FenceClient {
        builder(&self.url()).connect().await.unwrap()
    }

    /// A client whose transport is `channel` wrapped in a [`Faults`] layer.
    pub async fn faulty_client(&self) -> (FenceClient, Faults) {
        self.faulty_client_with(|b| b).await
    }

    /// [`TestServer::faulty_client`] with the builder changed by `configure`.
    pub async fn faulty_client_with(
        &self,
        configure: impl FnOnce(fence_client::FenceClientBuilder) -> fence_client::FenceClientBuilder,
    ) -> (FenceClient, Faults) {
        let channel = Endpoint::from_shared(self.url())
            .unwrap()
            .connect()
            .await
            .unwrap();
        let faults = Faults::new(channel);
        let client = configure(builder(&self.url()))
            .build_with_service(faults.clone())
            .unwrap();
        (client, faults)
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
    }
}

pub fn fast_policy() -> RetryPolicy {
    RetryPolicy {
        max_attempts: 3,
        initial_backoff: Duration::from_millis(20),
        max_backoff: Duration::from_millis(200),
        transient_timeout: Duration::from_secs(20),
        in_progress_timeout: Duration::from_secs(20),
    }
}

pub fn builder(url: &str) -> fence_client::FenceClientBuilder {
    FenceClient::builder(url)
        .request_timeout(Duration::from_secs(5))
        .retry_policy(fast_policy())
}

pub fn unique(prefix: &str) -> String {
    format!("{prefix}-{}", uuid::Uuid::new_v4())
}

/// Polls `cond` every 10 ms until it holds; panics after 20 s.
pub async fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while !cond() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A fake external API: every commit is logged (so a double effect is visible), keyed by the
/// idempotency key the caller sent.
#[derive(Default, Clone)]
pub struct Downstream {
    log: Arc<Mutex<Vec<(String, String)>>>,
}

impl Downstream {
    /// Commits `what` under `key`; returns the result the API would answer.
    pub fn commit(&self, what: &str, key: &str) -> Vec<u8> {
        let mut log = self.log.lock().unwrap();
        log.push((what.to_owned(), key.to_owned()));
        format!("{what}#{}", log.len()).into_bytes()
    }

    /// How many commits of `what` happened.
    pub fn count(&self, what: &str) -> usize {
        self.log
            .lock()
            .unwrap()
            .iter()
            .filter(|(w, _)| w == what)
            .count()
    }

    /// The result of the commit made under `key`, if any (an outcome check's lookup).
    pub fn lookup(&self, key: &str) -> Option<Vec<u8>> {
        let log = self.log.lock().unwrap();
        log.iter()
            .position(|(_, k)| k == key)
            .map(|i| format!("{}#{}", log[i].0, i + 1).into_bytes())
    }

    /// The order of commits.
    pub fn history(&self) -> Vec<String> {
        self.log
            .lock()
            .unwrap()
            .iter()
            .map(|(w, _)| w.clone())
            .collect()
    }
}

fn count(counts: &Mutex<HashMap<String, u32>>, method: &str) -> u32 {
    counts
        .lock()
        .unwrap()
        .get(&format!("/fence.v1.Fence/{method}"))
        .copied()
        .unwrap_or(0)
}

type ResponseFuture =
    Pin<Box<dyn Future<Output = Result<http::Response<tonic::body::Body>, BoxError>> + Send>>;

/// A tower service around a channel that can lose the response of chosen RPCs *after* the
/// server answered them (the request was applied; the caller sees `UNAVAILABLE`), and counts
/// the answers per RPC.
#[derive(Clone)]
pub struct Faults {
    inner: Channel,
    drop_next: Arc<Mutex<HashMap<String, u32>>>,
    sent: Arc<Mutex<HashMap<String, u32>>>,
    answered: Arc<Mutex<HashMap<String, u32>>>,
    dropped: Arc<AtomicU32>,
}

impl Faults {
    fn new(inner: Channel) -> Faults {
        Faults {
            inner,
            drop_next: Arc::default(),
            sent: Arc::default(),
            answered: Arc::default(),
            dropped: Arc::default(),
        }
    }

    /// Loses the responses of the next `n` calls of `method` (e.g. "Begin").
    pub fn lose_responses(&self, method: &str, n: u32) {
        *self
            .drop_next
            .lock()
            .unwrap()
            .entry(format!("/fence.v1.Fence/{method}"))
            .or_default() += n;
    }

    /// How many calls of `method` were sent (answered or not).
    pub fn sent(&self, method: &str) -> u32 {
        count(&self.sent, method)
    }

    /// How many calls of `method` the server answered (lost or not).
    pub fn answered(&self, method: &str) -> u32 {
        count(&self.answered, method)
    }

    /// How many responses were lost so far.
    pub fn lost(&self) -> u32 {
        self.dropped.load(Ordering::SeqCst)
    }
}

impl Service<http::Request<tonic::body::Body>> for Faults {
    type Response = http::Response<tonic::body::Body>;
    type Error = BoxError;
    type Future = ResponseFuture;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, request: http::Request<tonic::body::Body>) -> ResponseFuture {
        // The ready service is the one to call; leave a fresh clone in its place.
        let clone = self.inner.clone();
        let mut ready = std::mem::replace(&mut self.inner, clone);
        let path = request.uri().path().to_owned();
        let lose = {
            let mut plan = self.drop_next.lock().unwrap();
            match plan.get_mut(&path) {
                Some(n) if *n > 0 => {
                    *n -= 1;
                    true
                }
                _ => false,
            }
        };
        *self.sent.lock().unwrap().entry(path.clone()).or_default() += 1;
        let answered = self.answered.clone();
        let dropped = self.dropped.clone();
        Box::pin(async move {
            // Unary gRPC: the response headers come after the handler returned.
            let response = ready.call(request).await?;
            *answered.lock().unwrap().entry(path.clone()).or_default() += 1;
            if lose {
                dropped.fetch_add(1, Ordering::SeqCst);
                drop(response);
                return Err(Box::new(tonic::Status::unavailable(format!(
                    "injected fault: the response of {path} was lost"
                ))) as BoxError);
            }
            Ok(response)
        })
    }
}

/// Runs the `fence` command line with `args` (in a blocking thread: the server may run on the
/// test's runtime), with none of its environment variables set.
pub async fn fence_cli(args: &[&str]) -> std::process::Output {
    let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
    tokio::task::spawn_blocking(move || {
        std::process::Command::new(env!("CARGO_BIN_EXE_fence"))
            .args(&args)
            .env_remove("FENCE_URL")
            .env_remove("FENCE_TOKEN")
            .env_remove("FENCE_TENANT")
            .output()
            .unwrap()
    })
    .await
    .unwrap()
}
