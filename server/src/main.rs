//! `fenced`: parse the configuration, set up logging, bind, print the bound address, serve
//! until SIGTERM or SIGINT, then drain and exit.

use std::io::Write;

use anyhow::Context;
use clap::Parser;
use fence_server::Config;
use tracing_subscriber::EnvFilter;
use tracing_subscriber::prelude::*;

/// mimalloc: a fifth less CPU per effect under load than glibc's malloc (docs/BENCHMARKS.md),
/// and freed memory goes back to the system instead of staying with the process.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    // `fenced hash-token <token>` prints the line-format hash for a tokens file.
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("hash-token") {
        let token = args.get(2).context("usage: fenced hash-token <token>")?;
        println!("{}", fence_server::auth::Auth::hash_token(token));
        return Ok(());
    }
    let config = Config::parse();
    let logs = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_filter(EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info")));
    let (spans, exporter) = match &config.otlp_endpoint {
        Some(endpoint) => {
            let (layer, exporter) =
                fence_server::otel::layer(endpoint).map_err(anyhow::Error::msg)?;
            (Some(layer), Some(exporter))
        }
        None => (None, None),
    };
    tracing_subscriber::registry().with(logs).with(spans).init();
    if let Some(endpoint) = &config.otlp_endpoint {
        tracing::info!(%endpoint, "exporting one span per RPC over OTLP");
    }

    let listener = tokio::net::TcpListener::bind(config.listen)
        .await
        .with_context(|| format!("cannot listen on {}", config.listen))?;
    let addr = listener.local_addr()?;
    // The first stdout line: scripts and tests read the bound address from it (a second one
    // gives the metrics listener's, when there is one).
    let mut out = std::io::stdout().lock();
    writeln!(out, "fenced listening on {addr}")?;
    out.flush()?;
    drop(out);
    if let Some(metrics) = config.metrics_listen {
        let listener = tokio::net::TcpListener::bind(metrics)
            .await
            .with_context(|| format!("cannot listen for metrics on {metrics}"))?;
        let metrics = listener.local_addr()?;
        fence_server::metrics::serve(listener).map_err(anyhow::Error::msg)?;
        // Best effort: a launcher that read only the first line may have closed stdout.
        let mut out = std::io::stdout().lock();
        let _ = writeln!(out, "fenced metrics on {metrics}").and_then(|()| out.flush());
        tracing::info!(%metrics, "serving Prometheus metrics at /metrics");
    }
    tracing::info!(%addr, data_dir = %config.data_dir.display(), "fenced starting");

    let grace = std::time::Duration::from_millis(config.shutdown_grace_ms);
    let (signalled, on_signal) = tokio::sync::oneshot::channel::<()>();
    let shutdown = async move {
        shutdown_signal().await;
        let _ = signalled.send(());
    };
    let serve = fence_server::serve(listener, config, shutdown);
    let served = tokio::select! {
        served = serve => Some(served),
        () = async {
            if on_signal.await.is_ok() {
                tokio::time::sleep(grace).await;
            } else {
                std::future::pending::<()>().await;
            }
        } => None,
    };
    let Some(served) = served else {
        // Every answer was sent after its sync: what is still in flight was never
        // acknowledged, so leaving now (as a kill would) loses nothing a caller was told.
        tracing::warn!(
            grace_ms = grace.as_millis() as u64,
            "in-flight calls did not drain within the shutdown grace; exiting with them open"
        );
        if let Some(exporter) = exporter {
            let _ = tokio::task::spawn_blocking(move || exporter.shutdown()).await;
        }
        std::process::exit(0);
    };
    if let Some(exporter) = exporter {
        // Blocks while the last spans are sent: off the async threads.
        let _ = tokio::task::spawn_blocking(move || exporter.shutdown()).await;
    }
    served?;
    tracing::info!("fenced stopped");
    Ok(())
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
    tracing::info!("shutdown requested; draining in-flight calls");
}
