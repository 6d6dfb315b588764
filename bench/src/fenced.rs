//! The real `fenced` binary as a child process: started on `127.0.0.1:0` over a data dir,
//! killed with SIGKILL and restarted on the same data dir, and measured (`VmRSS`).
//!
//! Callers get the current channel through a watch: `None` while the server is down, so an
//! RPC that failed because of a kill waits for the restart instead of spinning.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use tokio::sync::{Mutex, watch};
use tonic::transport::{Channel, Endpoint};

/// Where `fenced` is: `$FENCED`, else next to the running executable (`target/<profile>/`),
/// also when that executable is a test in `target/<profile>/deps/`.
pub fn default_binary() -> Result<PathBuf> {
    if let Some(p) = std::env::var_os("FENCED") {
        return Ok(PathBuf::from(p));
    }
    let exe = std::env::current_exe().context("current executable")?;
    let dir = exe.parent().context("executable directory")?;
    for d in [Some(dir), dir.parent()].into_iter().flatten() {
        let candidate = d.join("fenced");
        if candidate.is_file() {
            return Ok(candidate);
        }
    }
    bail!(
        "cannot find fenced next to {}; build it (cargo build --workspace) or set FENCED",
        exe.display()
    )
}

struct Running {
    child: Child,
    url: String,
}

/// A supervised `fenced` child process.
pub struct Fenced {
    launch: Arc<Launch>,
    running: Mutex<Option<Running>>,
    channel: watch::Sender<Option<Vec<Channel>>>,
    connections: usize,
    kills: AtomicU64,
    pid: AtomicU64,
    url: std::sync::Mutex<String>,
}

/// How the server is started, each time alike.
struct Launch {
    /// A program `binary` runs under, with its arguments (empty: none), e.g. valgrind.
    prefix: Vec<String>,
    binary: PathBuf,
    data_dir: PathBuf,
    args: Vec<String>,
    log: PathBuf,
}

impl std::fmt::Debug for Fenced {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fenced")
            .field("binary", &self.launch.binary)
            .field("data_dir", &self.launch.data_dir)
            .finish()
    }
}

impl Launch {
    /// Starts the server and reads its ready line (blocking).
    fn spawn(&self) -> Result<Running> {
        let Launch {
            prefix,
            binary,
            data_dir,
            args,
            log,
        } = self;
        let stderr = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
            .with_context(|| format!("open {}", log.display()))?;
        let mut command = match prefix.split_first() {
            Some((program, rest)) => {
                let mut c = Command::new(program);
                c.args(rest).arg(binary);
                c
            }
            None => Command::new(binary),
        };
        let mut child = command
            .args(["--listen", "127.0.0.1:0", "--data-dir"])
            .arg(data_dir)
            .args(args)
            .env(
                "RUST_LOG",
                std::env::var("FENCED_LOG").unwrap_or_else(|_| "warn".into()),
            )
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::from(stderr))
            .spawn()
            .with_context(|| {
                let under: String = prefix.iter().map(|p| format!("{p} ")).collect();
                format!("spawn {under}{}", binary.display())
            })?;
        let mut line = String::new();
        BufReader::new(child.stdout.take().context("child stdout")?)
            .read_line(&mut line)
            .context("read the ready line")?;
        let Some(addr) = line.trim().strip_prefix("fenced listening on ") else {
            let _ = child.kill();
            let _ = child.wait();
            bail!(
                "fenced did not start (ready line {line:?}); see {}",
                log.display()
            );
        };
        Ok(Running {
            url: format!("http://{addr}"),
            child,
        })
    }
}

/// `n` separate HTTP/2 connections to `url`.
async fn connect(url: &str, n: usize) -> Result<Vec<Channel>> {
    let endpoint = Endpoint::from_shared(url.to_owned())?
        .connect_timeout(Duration::from_secs(5))
        .tcp_nodelay(true);
    let mut out = Vec::with_capacity(n);
    // The ready line is printed before the store is open: retry until it answers.
    for _ in 0..3000 {
        if let Ok(ch) = endpoint.connect().await {
            out.push(ch);
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    if out.is_empty() {
        bail!("cannot connect to {url}");
    }
    while out.len() < n.max(1) {
        out.push(endpoint.connect().await?);
    }
    Ok(out)
}

impl Fenced {
    /// Starts `binary` over `data_dir` with extra flags, run under `prefix` when it is not
    /// empty (a program and its arguments that execs it, e.g. `valgrind --tool=callgrind`:
    /// [`Fenced::pid`] is then that program's); its stderr goes to `log`. Callers share
    /// `connections` HTTP/2 connections (see [`Fenced::channel_for`]).
    pub async fn start(
        prefix: Vec<String>,
        binary: PathBuf,
        data_dir: PathBuf,
        args: Vec<String>,
        log: PathBuf,
        connections: usize,
    ) -> Result<Self> {
        let launch = Arc::new(Launch {
            prefix,
            binary,
            data_dir,
            args,
            log,
        });
        let l = launch.clone();
        let running = tokio::task::spawn_blocking(move || l.spawn()).await??;
        let channel = connect(&running.url, connections).await?;
        let pid = AtomicU64::new(u64::from(running.child.id()));
        let url = std::sync::Mutex::new(running.url.clone());
        Ok(Self {
            url,
            launch,
            running: Mutex::new(Some(running)),
            channel: watch::channel(Some(channel)).0,
            connections,
            kills: AtomicU64::new(0),
            pid,
        })
    }

    /// A channel to the running server, waiting through a restart (at most a minute).
    pub async fn channel(&self) -> Result<Channel> {
        self.channel_for(0).await
    }

    /// Connection `i` (modulo their number), waiting through a restart (at most a minute).
    /// Agents are separate processes in real life: give each its own connection.
    pub async fn channel_for(&self, i: usize) -> Result<Channel> {
        let mut rx = self.channel.subscribe();
        let chans = tokio::time::timeout(Duration::from_secs(60), rx.wait_for(Option::is_some))
            .await
            .context("fenced is not back after a minute")?
            .context("the supervisor is gone")?;
        let chans = chans.as_ref().expect("waited for Some");
        Ok(chans[i % chans.len()].clone())
    }

    /// The server's current URL (`http://127.0.0.1:PORT`).
    pub fn url(&self) -> String {
        self.url.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// The server's process id.
    pub fn pid(&self) -> u32 {
        self.pid.load(Ordering::Relaxed) as u32
    }

    /// How many times it was killed.
    pub fn kills(&self) -> u64 {
        self.kills.load(Ordering::Relaxed)
    }

    /// The server's resident memory (`VmRSS`), in KiB.
    pub fn rss_kib(&self) -> Option<u64> {
        rss_kib(self.pid())
    }

    /// `kill -9`, then a restart on the same data dir (on a new port). A failed start is
    /// retried, so callers waiting for the server are never left waiting for nothing.
    pub async fn kill_and_restart(&self) -> Result<()> {
        let mut running = self.running.lock().await;
        self.channel.send_replace(None);
        if let Some(mut r) = running.take() {
            // std's Child::kill is SIGKILL on Unix; reap the child whatever kill says.
            let killed = r.child.kill();
            tokio::task::spawn_blocking(move || r.child.wait())
                .await?
                .context("reap fenced")?;
            killed.context("SIGKILL fenced")?;
            self.kills.fetch_add(1, Ordering::Relaxed);
        }
        let mut failure = None;
        for attempt in 1..=5 {
            match self.spawn_and_connect().await {
                Ok((r, channel)) => {
                    self.pid.store(u64::from(r.child.id()), Ordering::Relaxed);
                    *self.url.lock().unwrap_or_else(|e| e.into_inner()) = r.url.clone();
                    *running = Some(r);
                    self.channel.send_replace(Some(channel));
                    return Ok(());
                }
                Err(e) => {
                    eprintln!("fenced restart, try {attempt}: {e:#}");
                    failure = Some(e);
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            }
        }
        Err(failure.expect("five failed tries"))
    }

    async fn spawn_and_connect(&self) -> Result<(Running, Vec<Channel>)> {
        let launch = self.launch.clone();
        let mut r = tokio::task::spawn_blocking(move || launch.spawn()).await??;
        match connect(&r.url, self.connections).await {
            Ok(channel) => Ok((r, channel)),
            Err(e) => {
                let _ = r.child.kill();
                let _ = tokio::task::spawn_blocking(move || r.child.wait()).await;
                Err(e)
            }
        }
    }

    /// Stops the server (SIGKILL: everything it acknowledged is already durable).
    pub async fn stop(&self) {
        let mut running = self.running.lock().await;
        self.channel.send_replace(None);
        if let Some(mut r) = running.take() {
            let _ = r.child.kill();
            let _ = tokio::task::spawn_blocking(move || r.child.wait()).await;
        }
    }
}

impl Drop for Fenced {
    fn drop(&mut self) {
        if let Ok(mut running) = self.running.try_lock()
            && let Some(r) = running.as_mut()
        {
            let _ = r.child.kill();
            let _ = r.child.wait();
        }
    }
}

/// `VmRSS` of a process, in KiB.
pub fn rss_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}
