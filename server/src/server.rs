//! Wiring: open the ledger, serve `fence.v1` plus the standard health and reflection services,
//! sweep expired records in the background, and shut down gracefully (stop accepting, drain
//! in-flight calls, close RocksDB).

use std::future::Future;
use std::io::Write;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use fence_proto::v1::fence_server::FenceServer;
use tokio::net::TcpListener;
use tokio_stream::wrappers::TcpListenerStream;
use tonic::service::interceptor::InterceptedService;

use crate::auth::{Auth, AuthConfigError};
use crate::clock::{Clock, SystemClock};
use crate::config::Config;
use crate::ledger::{Ledger, LedgerConfig, Limits};
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
    /// A background task panicked.
    #[error("internal task failed: {0}")]
    Task(String),
}

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
            let mut opts = std::fs::OpenOptions::new();
            opts.write(true).create_new(true);
            #[cfg(unix)]
            std::os::unix::fs::OpenOptionsExt::mode(&mut opts, 0o600);
            let mut f = opts.open(path).map_err(|e| err(e.to_string()))?;
            f.write_all(&key).map_err(|e| err(e.to_string()))?;
            f.sync_all().map_err(|e| err(e.to_string()))?;
            Ok(key)
        }
        Err(e) => Err(err(e.to_string())),
    }
}

/// Opens the ledger described by `config`, with `clock`.
pub fn open_ledger(
    config: &Config,
    clock: Arc<dyn Clock>,
) -> Result<Ledger<RocksStore>, ServeError> {
    std::fs::create_dir_all(&config.data_dir).map_err(|e| {
        StoreError::Engine(format!("cannot create {}: {e}", config.data_dir.display()))
    })?;
    let key_path = config
        .credential_key_file
        .clone()
        .unwrap_or_else(|| config.data_dir.join("credential.key"));
    let credential_key = load_or_create_key(&key_path)?;
    let store = RocksStore::open(
        config.data_dir.join("ledger"),
        &StoreOptions {
            block_cache_bytes: config.block_cache_mb << 20,
        },
    )?;
    let ledger_config = LedgerConfig {
        default_lease_ms: config.lease_ms,
        max_lease_ms: config.max_lease_ms,
        default_retention_ms: config.retention_ms,
        credential_key,
        limits: Limits {
            max_arguments_bytes: config.max_arguments_bytes,
            max_result_bytes: config.max_result_bytes,
            max_effects_per_run: config.max_effects_per_run,
            ..Limits::default()
        },
        ..LedgerConfig::default()
    };
    Ok(Ledger::new(store, clock, ledger_config))
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

/// Serves until `shutdown` resolves, then drains in-flight calls and closes the store.
pub async fn serve(
    listener: TcpListener,
    config: Config,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServeError> {
    let auth = auth_from(&config)?;
    let cfg = config.clone();
    let ledger = tokio::task::spawn_blocking(move || open_ledger(&cfg, Arc::new(SystemClock)))
        .await
        .map_err(|e| ServeError::Task(e.to_string()))??;
    serve_ledger(
        listener,
        Arc::new(ledger),
        auth,
        Duration::from_millis(config.sweep_interval_ms.max(1)),
        shutdown,
    )
    .await
}

/// Serves an already opened ledger (embedding and tests with an injected clock).
pub async fn serve_ledger(
    listener: TcpListener,
    ledger: Arc<Ledger<RocksStore>>,
    auth: Auth,
    sweep_interval: Duration,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServeError> {
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
    let fence = InterceptedService::new(
        FenceServer::new(FenceService::new(ledger.clone()))
            // Room for the largest allowed arguments/results plus framing; the ledger enforces
            // the precise limits with a field-level error.
            .max_decoding_message_size(16 << 20)
            .max_encoding_message_size(64 << 20),
        move |req| auth.authenticate(req),
    );

    tracing::info!(addr = ?listener.local_addr().ok(), "serving fence.v1");
    let result = tonic::transport::Server::builder()
        .add_service(health_service)
        .add_service(reflection)
        .add_service(fence)
        .serve_with_incoming_shutdown(TcpListenerStream::new(listener), shutdown)
        .await;
    sweeper.abort();
    let _ = sweeper.await;
    health_reporter
        .set_not_serving::<FenceServer<FenceService<RocksStore>>>()
        .await;
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
        match tokio::task::spawn_blocking(move || l.sweep_expired(1024)).await {
            Ok(Ok(n)) if n > 0 => tracing::debug!(processed = n, "retention sweep"),
            Ok(Err(e)) => tracing::warn!(error = %e, "retention sweep failed; will retry"),
            _ => {}
        }
    }
}
