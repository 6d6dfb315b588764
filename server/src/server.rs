//! Wiring: open the ledger (its store compacting with retention applied), serve `fence.v1` plus
//! the standard health and reflection services, recount open effects and sweep the expiry
//! index of older formats in the background, and shut down gracefully (stop accepting, drain
//! in-flight calls, close RocksDB).

use std::future::Future;
use std::io::Write;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use fence_proto::v1::admin_server::AdminServer;
use fence_proto::v1::fence_server::FenceServer;
use tokio::net::TcpListener;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::server::TcpIncoming;
use tonic::transport::{Certificate, Identity, ServerTlsConfig};

use crate::auth::{Auth, AuthConfigError, tenant_of};
use crate::clock::{Clock, SystemClock};
use crate::config::Config;
use crate::ledger::{Ledger, LedgerConfig, Limits};
use crate::quota::TenantRateLimit;
use crate::service::FenceService;
use crate::store::{RocksStore, StoreError, StoreOptions};

/// Why the server could not start or stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// The store could not be opened.
    #[error("cannot open the ledger store: {0}")]
    Store(#[from] StoreError),
    /// The credential key file could not be read or created.
    #[error("credential key file {path}: {why}")]
    CredentialKey {
        /// The path.
        path: String,
        /// What failed.
        why: String,
    },
    /// The tokens file is invalid.
    #[error(transparent)]
    Auth(#[from] AuthConfigError),
    /// The transport failed.
    #[error("gRPC transport error: {0}")]
    Transport(#[from] tonic::transport::Error),
    /// The reflection service could not be built.
    #[error("reflection service: {0}")]
    Reflection(String),
    /// The data dir's record format cannot be served by this build.
    #[error("ledger format: {0}")]
    Format(String),
    /// A TLS file could not be read.
    #[error("TLS file {path}: {why}")]
    Tls {
        /// The path.
        path: String,
        /// What failed.
        why: String,
    },
    /// A background task panicked.
    #[error("internal task failed: {0}")]
    Task(String),
}

/// The store's directory inside a data dir.
pub const LEDGER_DIR: &str = "ledger";
/// The credential key's file inside a data dir (unless `--credential-key-file` says otherwise).
pub const CREDENTIAL_KEY_FILE: &str = "credential.key";

/// Reads the credential key, generating it on first use (mode 0600).
pub fn load_or_create_key(path: &Path) -> Result<[u8; 32], ServeError> {
    let err = |why: String| ServeError::CredentialKey {
        path: path.display().to_string(),
        why,
    };
    match std::fs::read(path) {
        Ok(bytes) => bytes
            .try_into()
            .map_err(|b: Vec<u8>| err(format!("must hold exactly 32 bytes, holds {}", b.len()))),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let key: [u8; 32] = rand::random();
            write_new_key_file(path, &key).map_err(|e| err(e.to_string()))?;
            Ok(key)
        }
        Err(e) => Err(err(e.to_string())),
    }
}

/// Writes a credential key into a new file readable by its owner only, durably; an existing
/// file at `path` is never replaced (`AlreadyExists`).
///
/// The key is written whole under a temporary name and then linked into place, and the
/// directory entry is synced: a crash leaves either no key file (the next start makes one, and
/// no credential was spent under the lost key, since the ledger opens after this returns) or
/// the whole key, never an empty file that would refuse every later start.
pub fn write_new_key_file(path: &Path, key: &[u8; 32]) -> std::io::Result<()> {
    let name = path
        .file_name()
        .ok_or_else(|| std::io::Error::new(std::io::ErrorKind::InvalidInput, "not a file name"))?;
    let mut tmp_name = name.to_os_string();
    tmp_name.push(".tmp");
    let tmp = path.with_file_name(tmp_name);
    // Left by a crash before the link: it never held a key anyone used.
    match std::fs::remove_file(&tmp) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    let mut opts = std::fs::OpenOptions::new();
    opts.write(true).create_new(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut opts, 0o600);
    let mut f = opts.open(&tmp)?;
    f.write_all(key)?;
    f.sync_all()?;
    drop(f);
    // A hard link, unlike a rename, fails rather than replace a key that appeared meanwhile.
    let linked = std::fs::hard_link(&tmp, path);
    std::fs::remove_file(&tmp)?;
    linked?;
    let parent = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    crate::store::sync_dir(parent)
}

/// Opens the ledger described by `config`, with `clock`.
pub fn open_ledger(
    config: &Config,
    clock: Arc<dyn Clock>,
) -> Result<Ledger<RocksStore>, ServeError> {
    open_ledger_with(config, clock, &store_options(config))
}

/// The store options `config` asks for (every write synced).
pub fn store_options(config: &Config) -> StoreOptions {
    StoreOptions {
        block_cache_bytes: config.block_cache_mb << 20,
        memtable_bytes: config.memtable_mb << 20,
        memtable_huge_page_bytes: config.memtable_huge_page_mb << 20,
        sync_writes: true,
        wal_prime_bytes: config.wal_prime_mb << 20,
        compression: config.compression,
        wal_dir: config.wal_dir.clone(),
        rewrite: None,
        rewrite_within_secs: config.retention_compaction_hours.saturating_mul(3600),
    }
}

/// [`open_ledger`] with explicit store options (a bulk load turns `sync_writes` off).
pub fn open_ledger_with(
    config: &Config,
    clock: Arc<dyn Clock>,
    store: &StoreOptions,
) -> Result<Ledger<RocksStore>, ServeError> {
    let cannot_create = |e: std::io::Error| {
        let dir = config.data_dir.display();
        // `create_dir_all` meets a file where the data dir (or one of its parents) should be.
        match e.kind() {
            std::io::ErrorKind::AlreadyExists | std::io::ErrorKind::NotADirectory => {
                StoreError::Engine(format!(
                    "the data dir {dir} is not a directory (or has a file among its parents): \
                     give --data-dir a directory (it is created if missing)"
                ))
            }
            _ => StoreError::Engine(format!("cannot create {dir}: {e}")),
        }
    };
    let existing = existing_ancestor(&config.data_dir).map_err(cannot_create)?;
    std::fs::create_dir_all(&config.data_dir).map_err(cannot_create)?;
    let key_path = config
        .credential_key_file
        .clone()
        .unwrap_or_else(|| config.data_dir.join(CREDENTIAL_KEY_FILE));
    let credential_key = load_or_create_key(&key_path)?;
    // Compaction drops the payload of finished effects past their retention window.
    let store = StoreOptions {
        rewrite: Some(crate::ledger::expiry::retention_rewrite(clock.clone())),
        ..store.clone()
    };
    let store = RocksStore::open(config.data_dir.join(LEDGER_DIR), &store)?;
    sync_created_dirs(&config.data_dir, &existing).map_err(cannot_create)?;
    let ledger_config = LedgerConfig {
        default_lease_ms: config.lease_ms,
        max_lease_ms: config.max_lease_ms,
        default_retention_ms: config.retention_ms,
        credential_key,
        limits: Limits {
            max_arguments_bytes: config.max_arguments_bytes,
            max_result_bytes: config.max_result_bytes,
            max_effects_per_run: config.max_effects_per_run,
            max_batch_calls: config.max_batch_calls.max(1),
            max_page_bytes: config.max_page_bytes.max(1),
            max_cached_runs: config.cached_runs,
            max_cached_effects: config.cached_effects,
            max_filtered_index_entries: config.filtered_index_entries,
            ..Limits::default()
        },
        ..LedgerConfig::default()
    };
    let ledger = Ledger::new(store, clock, ledger_config);
    match ledger.open_format() {
        Ok(_) => Ok(ledger),
        Err(crate::ledger::LedgerError::Store(e)) => Err(ServeError::Store(e)),
        Err(e) => Err(ServeError::Format(e.to_string())),
    }
}

/// The nearest of `dir` and its ancestors that exists (absolute).
fn existing_ancestor(dir: &Path) -> std::io::Result<std::path::PathBuf> {
    let mut at = std::path::absolute(dir)?;
    while !at.exists() {
        if !at.pop() {
            break;
        }
    }
    Ok(at)
}

/// Syncs `dir` and every directory created for it at this start, up to and including
/// `existing` (the ancestor that was there before), so that a data dir made at its first start
/// is still there, with its ledger and key, after a machine crash: a new entry is durable only
/// once its parent directory is synced. When the data dir already existed only it is synced
/// (the ledger's own entry in it may be new).
fn sync_created_dirs(dir: &Path, existing: &Path) -> std::io::Result<()> {
    let mut at = std::path::absolute(dir)?;
    loop {
        crate::store::sync_dir(&at)?;
        if at == existing || !at.pop() {
            return Ok(());
        }
    }
}

/// The authentication `config` asks for (dev mode is logged loudly).
pub fn auth_from(config: &Config) -> Result<Auth, ServeError> {
    match &config.auth_tokens_file {
        Some(path) => Ok(Auth::from_tokens_file(path)?),
        None => {
            tracing::warn!(
                "DEV MODE: no --auth-tokens-file, so calls are NOT authenticated and the tenant is \
                 taken from the x-fence-tenant header. Never expose this server."
            );
            Ok(Auth::Dev)
        }
    }
}

/// The TLS settings `config` asks for (None = plaintext).
pub fn tls_from(config: &Config) -> Result<Option<ServerTlsConfig>, ServeError> {
    let read = |p: &std::path::PathBuf| {
        std::fs::read(p).map_err(|e| ServeError::Tls {
            path: p.display().to_string(),
            why: e.to_string(),
        })
    };
    let (Some(cert), Some(key)) = (&config.tls_cert, &config.tls_key) else {
        return Ok(None);
    };
    let mut tls = ServerTlsConfig::new().identity(Identity::from_pem(read(cert)?, read(key)?));
    if let Some(ca) = &config.tls_client_ca {
        tls = tls.client_ca_root(Certificate::from_pem(read(ca)?));
    }
    Ok(Some(tls))
}

/// How to serve a ledger.
#[derive(Clone)]
pub struct ServeOptions {
    /// Authentication.
    pub auth: Auth,
    /// How often the background pass runs (open-effect gauges, the older formats' expiry
    /// index).
    pub sweep_interval: Duration,
    /// TLS (None = plaintext).
    pub tls: Option<ServerTlsConfig>,
    /// Per-tenant request rate limit (None = unlimited).
    pub rate_limit: Option<Arc<TenantRateLimit>>,
    /// Sequencer threads (0 = half the cores; see [`Config::sequencers`]).
    pub sequencers: usize,
    /// Lone requests decided on the receiving thread (see [`Config::inline_commit`]).
    pub inline_commit: bool,
    /// Concurrent streams per connection (see [`Config::max_streams_per_connection`]).
    pub max_streams_per_connection: u32,
    /// Calls of one Session stream decided at once (0 = the default).
    pub max_session_in_flight: usize,
}

/// Serves until `shutdown` resolves, then drains in-flight calls and closes the store.
pub async fn serve(
    listener: TcpListener,
    config: Config,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServeError> {
    let auth = auth_from(&config)?;
    let tls = tls_from(&config)?;
    let cfg = config.clone();
    let ledger = tokio::task::spawn_blocking(move || open_ledger(&cfg, Arc::new(SystemClock)))
        .await
        .map_err(|e| ServeError::Task(e.to_string()))??;
    let rate_limit = (config.tenant_rate_limit > 0).then(|| {
        let burst = match config.tenant_burst {
            0 => config.tenant_rate_limit,
            b => b,
        };
        Arc::new(TenantRateLimit::new(config.tenant_rate_limit, burst))
    });
    let opts = ServeOptions {
        auth,
        sweep_interval: Duration::from_millis(config.sweep_interval_ms.max(1)),
        tls,
        rate_limit,
        sequencers: config.sequencers,
        inline_commit: config.inline_commit,
        max_streams_per_connection: config.max_streams_per_connection,
        max_session_in_flight: config.max_session_in_flight,
    };
    serve_ledger_with(listener, Arc::new(ledger), opts, shutdown).await
}

/// Serves an already opened ledger in plaintext (embedding and tests with an injected clock).
pub async fn serve_ledger(
    listener: TcpListener,
    ledger: Arc<Ledger<RocksStore>>,
    auth: Auth,
    sweep_interval: Duration,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServeError> {
    let opts = ServeOptions {
        auth,
        sweep_interval,
        tls: None,
        rate_limit: None,
        sequencers: 0,
        inline_commit: true,
        max_streams_per_connection: 64,
        max_session_in_flight: 0,
    };
    serve_ledger_with(listener, ledger, opts, shutdown).await
}

/// Serves an already opened ledger with `opts`.
pub async fn serve_ledger_with(
    listener: TcpListener,
    ledger: Arc<Ledger<RocksStore>>,
    opts: ServeOptions,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServeError> {
    let ServeOptions {
        auth,
        sweep_interval,
        tls,
        rate_limit,
        sequencers,
        inline_commit,
        max_streams_per_connection,
        max_session_in_flight,
    } = opts;
    // What holds the ledger besides this server (an embedder's handles): see the end.
    let held_outside = Arc::strong_count(&ledger);
    let (health_reporter, health_service) = tonic_health::server::health_reporter();
    health_reporter
        .set_serving::<FenceServer<FenceService<RocksStore>>>()
        .await;
    let reflection = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(fence_proto::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1()
        .map_err(|e| ServeError::Reflection(e.to_string()))?;

    let sweeper = tokio::spawn(sweep_loop(ledger.clone(), sweep_interval));
    let admin_auth = auth.clone();
    let admin = InterceptedService::new(
        AdminServer::new(crate::admin::AdminService::new(ledger.clone())),
        move |req| admin_auth.authorize_admin(req),
    );
    // Session streams end when the shutdown begins; the graceful drain would otherwise wait
    // for every caller to close its stream.
    let (stop_sessions, sessions_stopping) = tokio::sync::watch::channel(false);
    let shutdown = async move {
        shutdown.await;
        let _ = stop_sessions.send(true);
    };
    let service = FenceService::with_sequencers(ledger.clone(), sequencers)
        .with_inline_commit(inline_commit)
        .with_rate_limit(rate_limit.clone())
        .with_max_session_in_flight(max_session_in_flight)
        .with_shutdown(sessions_stopping);
    let fence = InterceptedService::new(
        FenceServer::new(service)
            // Room for the largest allowed arguments/results plus framing; the ledger enforces
            // the precise limits with a field-level error.
            .max_decoding_message_size(16 << 20)
            .max_encoding_message_size(64 << 20),
        move |req| {
            let req = auth.authenticate(req)?;
            if let Some(limit) = &rate_limit {
                limit
                    .check(&tenant_of(&req)?)
                    .inspect_err(|_| crate::metrics::rate_limited())?;
            }
            Ok(req)
        },
    );

    tracing::info!(addr = ?listener.local_addr().ok(), tls = tls.is_some(), "serving fence.v1");
    // TCP_NODELAY: without it a response from the blocking pool meets Nagle's algorithm and the
    // client's delayed ACK, about 40 ms per call (tonic ignores its own `tcp_nodelay` setting
    // for a caller-supplied listener). Keepalive notices peers that vanished.
    let incoming = TcpIncoming::from(listener)
        .with_nodelay(Some(true))
        .with_keepalive(Some(Duration::from_secs(60)));
    let mut builder = tonic::transport::Server::builder()
        .trace_fn(crate::trace::rpc_span)
        // What one connection can hold open (and make the server buffer for it) is bounded.
        .max_concurrent_streams(max_streams_per_connection.max(1));
    if let Some(tls) = tls {
        builder = builder.tls_config(tls)?;
    }
    let result = builder
        .add_service(health_service)
        .add_service(reflection)
        .add_service(fence)
        .add_service(admin)
        .serve_with_incoming_shutdown(incoming, shutdown)
        .await;
    sweeper.abort();
    let _ = sweeper.await;
    health_reporter
        .set_not_serving::<FenceServer<FenceService<RocksStore>>>()
        .await;
    // Connection tasks drop their clones of the services (which hold the ledger) a moment
    // after the transport returns, and Session streams' readers and the blocking pool may
    // still be finishing a call: wait for them, so an embedder that restarts on the same data
    // dir finds it closed, not locked.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while Arc::strong_count(&ledger) > held_outside && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    if Arc::strong_count(&ledger) > held_outside {
        tracing::warn!("the ledger is still in use 30 s after the shutdown; closing anyway");
    }
    tracing::info!("drained; closing the ledger");
    // Dropping the last reference closes RocksDB (every write was already synced).
    drop(ledger);
    Ok(result?)
}

async fn sweep_loop(ledger: Arc<Ledger<RocksStore>>, every: Duration) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let l = ledger.clone();
        let swept = tokio::task::spawn_blocking(move || {
            if let Ok(bytes) = l.store().size_bytes() {
                crate::metrics::store_bytes(bytes);
            }
            crate::metrics::recovery_losses(l.store().recovery_losses().len());
            match l.open_census() {
                Ok(census) => crate::metrics::open_effects(&census),
                Err(e) => tracing::warn!(error = %e, "counting open effects failed; will retry"),
            }
            l.sweep_expired(1024)
        });
        match swept.await {
            Ok(Ok(n)) if n > 0 => tracing::debug!(processed = n, "retention sweep"),
            Ok(Err(e)) => tracing::warn!(error = %e, "retention sweep failed; will retry"),
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_new_key_file_holds_the_key_and_leaves_no_temporary_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(CREDENTIAL_KEY_FILE);
        let key = load_or_create_key(&path).unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), key);
        assert_eq!(
            load_or_create_key(&path).unwrap(),
            key,
            "read back, not made anew"
        );
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, [CREDENTIAL_KEY_FILE]);
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(&path).unwrap().permissions().mode();
            assert_eq!(mode & 0o777, 0o600);
        }
    }

    #[test]
    fn a_data_dir_created_several_levels_deep_opens_and_holds_its_ledger_and_key() {
        let root = tempfile::tempdir().unwrap();
        let data_dir = root.path().join("a/b/data");
        let existing = existing_ancestor(&data_dir).unwrap();
        assert_eq!(existing, root.path());
        let config = Config::with_data_dir(&data_dir);
        let ledger = open_ledger(&config, Arc::new(crate::clock::SystemClock)).unwrap();
        drop(ledger);
        assert!(data_dir.join(LEDGER_DIR).join("CURRENT").exists());
        assert_eq!(
            std::fs::read(data_dir.join(CREDENTIAL_KEY_FILE))
                .unwrap()
                .len(),
            32
        );
        // At the next start the data dir exists: it is its own existing ancestor.
        assert_eq!(existing_ancestor(&data_dir).unwrap(), data_dir);
        open_ledger(&config, Arc::new(crate::clock::SystemClock)).unwrap();
    }

    #[test]
    fn a_data_dir_that_is_a_file_is_refused_and_left_alone() {
        let root = tempfile::tempdir().unwrap();
        let file = root.path().join("data");
        std::fs::write(&file, b"not a data dir").unwrap();
        let Err(err) = open_ledger(
            &Config::with_data_dir(&file),
            Arc::new(crate::clock::SystemClock),
        ) else {
            panic!("a file is not a data dir");
        };
        assert!(err.to_string().contains("is not a directory"), "{err}");
        assert_eq!(std::fs::read(&file).unwrap(), b"not a data dir");
        // A file among the parents reads the same.
        let Err(err) = open_ledger(
            &Config::with_data_dir(file.join("below")),
            Arc::new(crate::clock::SystemClock),
        ) else {
            panic!("a file is not a parent of a data dir");
        };
        assert!(err.to_string().contains("is not a directory"), "{err}");
    }

    #[test]
    fn a_temporary_key_left_by_a_crash_is_replaced_and_an_existing_key_never_is() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(CREDENTIAL_KEY_FILE);
        // A crash between creating the temporary file and linking it.
        std::fs::write(dir.path().join("credential.key.tmp"), b"").unwrap();
        write_new_key_file(&path, &[1; 32]).unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), [1; 32]);
        assert!(!dir.path().join("credential.key.tmp").exists());

        let err = write_new_key_file(&path, &[2; 32]).unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::AlreadyExists);
        assert_eq!(
            std::fs::read(&path).unwrap(),
            [1; 32],
            "the first key stays"
        );
        assert!(!dir.path().join("credential.key.tmp").exists());
    }
}
