//! `fence-mcp`: put Fence in front of any MCP server.
//!
//! ```text
//! fence-mcp --data-dir ~/.fence-mcp -- npx -y @modelcontextprotocol/server-everything
//! fence-mcp --fence-url https://fence.internal:50051 --token $FENCE_TOKEN -- python server.py
//! ```
//!
//! The host (Claude Desktop/Code, an `mcp` SDK client...) launches this command instead of the
//! upstream server's and talks MCP over stdio; the upstream server runs as a child process.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, bail};
use clap::Parser;
use fence_client::{Certificate, ClientTlsConfig, FenceClient};
use fence_mcp::{ClientTenants, Gateway, GatewayConfig, Upstream, Upstreams};
use rmcp::RoleClient;
use rmcp::ServiceExt;
use rmcp::service::RunningService;
use rmcp::transport::{StreamableHttpClientTransport, TokioChildProcess, stdio};
use tokio::net::TcpListener;

/// Fence any MCP server's tools: each tools/call happens exactly once.
#[derive(Debug, Parser)]
#[command(name = "fence-mcp", version, about, long_about = None)]
struct Args {
    /// A Fence server to record effects in (e.g. http://127.0.0.1:50051). Without it, an
    /// embedded ledger in --data-dir is used (the same server code, in this process).
    #[arg(long, env = "FENCE_URL", conflicts_with = "data_dir")]
    fence_url: Option<String>,

    /// The embedded ledger's directory (used when no --fence-url is given).
    #[arg(long, env = "FENCE_MCP_DATA_DIR", default_value = "fence-mcp-data")]
    data_dir: PathBuf,

    /// Bearer token for the Fence server (its tenant is the token's).
    #[arg(long, env = "FENCE_TOKEN")]
    token: Option<String>,

    /// PEM CA certificate to verify an https:// Fence server with (TLS).
    #[arg(long, env = "FENCE_CA_CERT")]
    fence_ca_cert: Option<PathBuf>,

    /// Tenant for a Fence server in dev mode (no tokens); ignored with a token.
    #[arg(long, env = "FENCE_TENANT")]
    tenant: Option<String>,

    /// The run of calls whose `_meta` names none: one durable run for this client, so a call
    /// re-issued on a new connection is still recognised.
    #[arg(long, env = "FENCE_MCP_RUN_ID", default_value = "mcp-default")]
    run_id: String,

    /// A TOML file of per-tool settings (class, volatile fields, credential arguments,
    /// retention, the argument that receives the downstream key).
    #[arg(long, env = "FENCE_MCP_CONFIG")]
    config: Option<PathBuf>,

    /// How long after a call without a step key completed an identical call counts as its
    /// re-issue (a broken stream re-sent with a new request id) and gets its result, in ms.
    #[arg(long, default_value_t = 120_000)]
    reissue_window_ms: u64,

    /// How long one upstream tool call may take, in ms. Past it the call may or may not have
    /// happened: it is recorded unknown (never retried blind) and must be reconciled.
    #[arg(long, env = "FENCE_MCP_UPSTREAM_TIMEOUT_MS", default_value_t = 60_000)]
    upstream_timeout_ms: u64,

    /// Serve MCP over streamable HTTP at http://ADDR/mcp instead of stdio (e.g.
    /// 127.0.0.1:8931; port 0 picks a free port, printed on stdout).
    #[arg(long, env = "FENCE_MCP_LISTEN")]
    listen: Option<std::net::SocketAddr>,

    /// With --listen: clients must present a bearer token listed in this file (`fenced`'s
    /// format: `<tenant> <blake3-hex-of-token> [revoked]` per line), and each client's effects
    /// are recorded in its tenant, which other clients cannot see.
    #[arg(long, env = "FENCE_MCP_CLIENT_TOKENS_FILE", requires = "listen")]
    client_tokens_file: Option<PathBuf>,

    /// Also list the gateway's own tools (fence_checkpoint, fence_restore, fence_fork,
    /// fence_outcome) so a host can checkpoint, restore and fork through MCP alone. Off by
    /// default: a model should not time-travel by itself.
    #[arg(long, env = "FENCE_MCP_FENCE_TOOLS")]
    fence_tools: bool,

    /// How the gateway sends its Begin, Complete and Heartbeat calls to Fence: `session`
    /// (messages on one long-lived Session stream, the default) or `unary` (one RPC each).
    /// The decisions are the same.
    #[arg(long, env = "FENCE_MCP_FENCE_TRANSPORT", default_value = "session", value_parser = ["session", "unary"])]
    fence_transport: String,

    /// An upstream MCP server reached over streamable HTTP (e.g. http://127.0.0.1:8000/mcp),
    /// instead of a command.
    #[arg(long, env = "FENCE_MCP_UPSTREAM_URL")]
    upstream_url: Option<String>,

    /// The upstream MCP server's command and arguments (after `--`), started as a child
    /// process speaking MCP on stdio. Several upstreams (their tools namespaced
    /// `<name>__<tool>`) are named in --config instead (`[upstreams.<name>]`, with `command`
    /// or `url`).
    #[arg(last = true, conflicts_with = "upstream_url")]
    upstream: Vec<String>,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    // stdout is the MCP channel: logs go to stderr.
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .init();
    let args = Args::parse();
    let config = match &args.config {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading {}", path.display()))?;
            GatewayConfig::from_toml(&text)
                .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?
        }
        None => GatewayConfig::default(),
    };
    let url = match &args.fence_url {
        Some(url) => url.clone(),
        None => embedded_ledger(&args.data_dir).await?,
    };
    let mut tls = None;
    if url.starts_with("https://") || args.fence_ca_cert.is_some() {
        let mut config = ClientTlsConfig::new();
        if let Some(path) = &args.fence_ca_cert {
            let pem = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
            config = config.ca_certificate(Certificate::from_pem(pem));
        }
        tls = Some(config);
    }
    let base = {
        let url = url.clone();
        let tls = tls.clone();
        let sessions = args.fence_transport == "session";
        move || {
            let builder = FenceClient::builder(url.clone()).sessions(sessions);
            match &tls {
                Some(tls) => builder.tls(tls.clone()),
                None => builder,
            }
        }
    };
    let mut builder = base();
    if let Some(token) = &args.token {
        builder = builder.bearer_token(token.clone());
    } else if let Some(tenant) = &args.tenant {
        builder = builder.tenant(tenant.clone());
    }
    let fence = builder
        .connect_lazy()
        .context("configuring the Fence client")?;

    let mut list = Vec::new();
    if !config.upstreams.is_empty() {
        if args.upstream_url.is_some() || !args.upstream.is_empty() {
            bail!("the upstreams are named in --config; give none on the command line");
        }
        for (name, up) in &config.upstreams {
            let service = connect(up.url.as_deref(), &up.command)
                .await
                .with_context(|| format!("upstream {name:?}"))?;
            list.push(Upstream {
                name: name.clone(),
                service,
            });
        }
    } else {
        let service = connect(args.upstream_url.as_deref(), &args.upstream).await?;
        list.push(Upstream {
            name: String::new(),
            service,
        });
    }
    let upstreams = Upstreams::new(list).map_err(|e| anyhow::anyhow!(e))?;

    let client_tenants = match &args.client_tokens_file {
        None => None,
        Some(path) => {
            if args.token.is_some() {
                bail!(
                    "--client-tokens-file records each client in its own tenant, which needs a Fence server in dev mode or the embedded ledger, not --token"
                );
            }
            let auth = fence_server::auth::Auth::from_tokens_file(path)?;
            let make = move |tenant: &str| base().tenant(tenant.to_owned()).connect_lazy();
            Some(ClientTenants::new(auth, Box::new(make)))
        }
    };

    let gateway = Gateway::new(
        upstreams,
        fence,
        config,
        args.run_id,
        Duration::from_millis(args.reissue_window_ms),
        Duration::from_millis(args.upstream_timeout_ms),
    )
    .with_fence_tools(args.fence_tools);
    let gateway = match client_tenants {
        Some(clients) => gateway.with_client_tenants(clients),
        None => gateway,
    };
    match args.listen {
        None => {
            let service = gateway
                .serve(stdio())
                .await
                .context("serving MCP on stdio")?;
            service.waiting().await?;
        }
        Some(addr) => serve_http(gateway, addr).await?,
    }
    Ok(())
}

/// Connects to one upstream MCP server: over streamable HTTP at `url`, else as a child process
/// running `command`.
async fn connect(
    url: Option<&str>,
    command: &[String],
) -> anyhow::Result<RunningService<RoleClient, ()>> {
    if let Some(url) = url {
        // HTTPS upstreams use ring, as the Fence client's TLS does.
        let _ = rustls::crypto::ring::default_provider().install_default();
        return ()
            .serve(StreamableHttpClientTransport::from_uri(url))
            .await
            .with_context(|| format!("connecting to the upstream MCP server at {url}"));
    }
    let Some((program, rest)) = command.split_first() else {
        bail!("give the upstream server's command after --, or --upstream-url");
    };
    let mut child = tokio::process::Command::new(program);
    child.args(rest);
    ().serve(TokioChildProcess::new(child).context("starting the upstream MCP server")?)
        .await
        .context("connecting to the upstream MCP server")
}

/// Serves the gateway over MCP's streamable HTTP transport at `/mcp` until Ctrl-C.
async fn serve_http(gateway: Gateway, addr: std::net::SocketAddr) -> anyhow::Result<()> {
    use rmcp::transport::streamable_http_server::{
        StreamableHttpServerConfig, StreamableHttpService, session::local::LocalSessionManager,
    };
    let service = StreamableHttpService::new(
        move || Ok(gateway.clone()),
        LocalSessionManager::default().into(),
        StreamableHttpServerConfig::default(),
    );
    let router = axum::Router::new().nest_service("/mcp", service);
    let listener = TcpListener::bind(addr)
        .await
        .with_context(|| format!("listening on {addr}"))?;
    // One line on stdout for whoever started us (port 0 picks one).
    println!(
        "fence-mcp listening on http://{}/mcp",
        listener.local_addr()?
    );
    axum::serve(listener, router)
        .with_graceful_shutdown(async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await?;
    Ok(())
}

/// Starts the Fence server in this process on a loopback port, over `data_dir`; returns its
/// URL. It is the same server code as `fenced`, so the embedded ledger has the same rules.
async fn embedded_ledger(data_dir: &std::path::Path) -> anyhow::Result<String> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let config = fence_server::config::Config::try_parse_from([
        "fenced".as_ref(),
        "--listen".as_ref(),
        addr.to_string().as_ref(),
        "--data-dir".as_ref(),
        data_dir.as_os_str(),
    ])?;
    tokio::spawn(async move {
        if let Err(e) = fence_server::server::serve(listener, config, std::future::pending()).await
        {
            tracing::error!(error = %e, "the embedded Fence ledger stopped");
            std::process::exit(1);
        }
    });
    Ok(format!("http://{addr}"))
}
