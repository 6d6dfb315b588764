//! `fence-load`: what a durable decision costs.
//!
//! - `fence-load compare`: in one run, the physical floor (a bare `fdatasync` loop on the data
//!   disk, a gRPC round trip on loopback: a health check, or an empty message on a Session
//!   stream for the session transports), Fence (begin+complete per effect over gRPC against
//!   a `fenced` child process, WAL sync on) and, with `--postgres URL`, the same effect ledger
//!   as an idempotency-key table in PostgreSQL with `synchronous_commit=on`, at each
//!   concurrency; then the targets, met or not.
//! - `fence-load scale`: latency and server memory with 0, 1M, 10M... stored effects.
//! - `fence-load cost`: `fenced`'s CPU time per effect (user + system, from /proc) over a
//!   fixed number of effects at each concurrency: a measure that machine noise barely moves;
//!   then the RPC stack's ceilings (empty calls) and the CPU floor per effect.
//! - `fence-load ledger`: the ledger alone in this process (no gRPC), a fixed number of
//!   effects in one function, for `valgrind --tool=callgrind` to count instructions per
//!   effect (see scripts/bench-cost.sh).
//!
//! Build with `cargo build --release --workspace --bins` and run from `target/release`.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};
use fence_bench::callgrind::Callgrind;
use fence_bench::fenced::{Fenced, default_binary};
use fence_bench::load::{self, FenceTransport, Measured, Target};

/// fenced's allocator, so that `ledger` counts the engine's instructions as fenced runs it, and
/// the load generator (on the same cores as what it measures) takes less CPU from either
/// system under test.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Throughput and latency of Fence next to the physical floor and a Postgres peer.
#[derive(Debug, Parser)]
#[command(name = "fence-load")]
struct Args {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, clap::Args)]
struct Common {
    /// The `fenced` binary (default: next to this executable, or $FENCED).
    #[arg(long)]
    fenced: Option<PathBuf>,
    /// An extra argument for `fenced` (repeat it for more), e.g. `--fenced-arg=--metrics-listen
    /// --fenced-arg=127.0.0.1:0` to measure the cost of metrics.
    #[arg(long = "fenced-arg", allow_hyphen_values = true)]
    fenced_args: Vec<String>,
    /// Directory for the server's data and the fdatasync floor (the disk under test).
    /// Default: a new directory under `target/`.
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Concurrency levels (closed-loop workers).
    #[arg(long, value_delimiter = ',', default_value = "1,4,16,64,256")]
    concurrency: Vec<usize>,
    /// Seconds measured per level.
    #[arg(long, default_value_t = 10)]
    seconds: u64,
    /// Warm-up seconds per level (not measured).
    #[arg(long, default_value_t = 2)]
    warmup: u64,
    /// gRPC connections the workers share.
    #[arg(long, default_value_t = 8)]
    connections: usize,
    /// Effects per turn of each worker: 1 = Begin then Complete per effect; K > 1 = K
    /// parallel tool calls begun together and completed together (Fence: BeginBatch and
    /// CompleteBatch; Postgres: one transaction of K inserts, one of K updates). Latency is
    /// per turn, throughput in effects.
    #[arg(long, default_value_t = 1)]
    batch: usize,
    /// Fence's calls as messages on one Session stream per worker instead of one unary RPC
    /// each.
    #[arg(long)]
    session: bool,
    /// Fence's calls as messages on one Session stream per connection, shared by the
    /// workers on it (a process hosting many agents behind one client, as the MCP gateway
    /// sends its calls), instead of one unary RPC each.
    #[arg(long, conflicts_with = "session")]
    shared_sessions: bool,
}

impl Common {
    /// How Fence's calls travel.
    fn transport(&self) -> FenceTransport {
        if self.shared_sessions {
            FenceTransport::SharedSession
        } else if self.session {
            FenceTransport::Session
        } else {
            FenceTransport::Unary
        }
    }
}

#[derive(Debug, Subcommand)]
enum Command {
    /// The floor, Fence and the Postgres peer at each concurrency, in one run.
    Compare {
        #[command(flatten)]
        common: Common,
        /// The Postgres peer (see scripts/bench-postgres.sh), e.g.
        /// postgres://bench@127.0.0.1:54329/bench
        #[arg(long)]
        postgres: Option<String>,
        /// fdatasync calls of the floor loop.
        #[arg(long, default_value_t = 2000)]
        fsyncs: u64,
        /// Also measure the same service served in-process with TCP_NODELAY on accepted
        /// connections (fenced's listener does not set it), to show what that option changes.
        #[arg(long)]
        nodelay_experiment: bool,
    },
    /// Latency and memory of Fence as the number of stored effects grows.
    Scale {
        #[command(flatten)]
        common: Common,
        /// Stored-effect counts to measure at (ascending; each continues the previous preload).
        #[arg(long, value_delimiter = ',', default_value = "0,1000000,10000000")]
        sizes: Vec<u64>,
        /// Preload threads. One is the fastest: the bulk load's writers contend in RocksDB's
        /// write queue (on two cores one thread loads about 58,000 effects/s, two 21,000).
        #[arg(long, default_value_t = 1)]
        preload_threads: usize,
    },
    /// fenced's CPU time per effect over a fixed number of effects at each concurrency.
    Cost {
        #[command(flatten)]
        common: Common,
        /// Effects measured at each concurrency (after 1000 unmeasured ones).
        #[arg(long, default_value_t = 20_000)]
        effects: u64,
        /// Run `fenced` under valgrind's callgrind and count the instructions it executes per
        /// effect and per empty Session message: its counters are zeroed before each measured
        /// loop and dumped after it (`callgrind_control`), so the counts hold exactly the
        /// measured calls, whatever else the machine does. The dumps stay in the work
        /// directory for `callgrind_annotate`. Under valgrind the server runs tens of times
        /// slower, so the other tables' times and CPU are not the server's own.
        #[arg(long)]
        callgrind: bool,
    },
    /// The ledger in this process, no gRPC: a fixed number of begin+complete pairs.
    Ledger {
        /// Effects measured (after `--warmup` unmeasured ones).
        #[arg(long, default_value_t = 2000)]
        effects: u64,
        /// Unmeasured effects first.
        #[arg(long, default_value_t = 200)]
        warmup: u64,
        /// RocksDB in this directory, every write synced as fenced does (default: a new
        /// directory under target/); `--mem` uses the in-memory store instead.
        #[arg(long)]
        dir: Option<PathBuf>,
        /// The in-memory store: the ledger's own work without RocksDB's.
        #[arg(long, conflicts_with = "dir")]
        mem: bool,
        /// Effects decided together between two syncs, each on a run of its own, as a
        /// sequencer decides a group (1: each call synced by itself).
        #[arg(long, default_value_t = 1)]
        group: u64,
        /// Without the run and effect record caches and the index filters (`--cached-runs 0
        /// --cached-effects 0 --filtered-index-entries 0`): what they save.
        #[arg(long)]
        no_caches: bool,
    },
}

fn work_dir(common: &Common) -> Result<PathBuf> {
    let dir = match &common.dir {
        Some(d) => d.clone(),
        None => {
            let exe = std::env::current_exe()?;
            let target = exe
                .parent()
                .and_then(Path::parent)
                .context("target directory")?;
            target.join(format!("fence-load-{}", std::process::id()))
        }
    };
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}

async fn start_fenced(common: &Common, data: &Path, log: &Path) -> Result<Fenced> {
    start_fenced_under(Vec::new(), common, data, log).await
}

/// [`start_fenced`] under `prefix` (see [`Fenced::start`]).
async fn start_fenced_under(
    prefix: Vec<String>,
    common: &Common,
    data: &Path,
    log: &Path,
) -> Result<Fenced> {
    let binary = match &common.fenced {
        Some(b) => b.clone(),
        None => default_binary()?,
    };
    let fenced = Fenced::start(
        prefix,
        binary,
        data.to_path_buf(),
        common.fenced_args.clone(),
        log.to_path_buf(),
        common.connections,
    )
    .await?;
    Ok(fenced)
}

async fn channels(fenced: &Fenced, n: usize) -> Result<Vec<Channel>> {
    let mut out = Vec::with_capacity(n);
    for i in 0..n.max(1) {
        out.push(fenced.channel_for(i).await?);
    }
    Ok(out)
}

use tonic::transport::Channel;

fn row(label: &str, c: usize, m: &Measured) -> String {
    format!(
        "| {label} | {c} | {:.0} | {:.3} | {:.3} | {:.3} | {:.1} | {} |",
        m.throughput(),
        m.p50(),
        m.p99(),
        m.p999(),
        m.p99() / m.p50().max(1e-9),
        steal(m)
    )
}

const HEADER: &str = "| system | concurrency | effects/s | p50 ms | p99 ms | p99.9 ms | p99/p50 | host steal % |\n|---|---:|---:|---:|---:|---:|---:|---:|";

/// The measured window's host steal, in percent of the machine's CPU time (`-`: unknown).
fn steal(m: &Measured) -> String {
    m.steal
        .map_or_else(|| "-".to_owned(), |s| format!("{:.1}", s * 100.0))
}

fn machine() -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("model name"))
                .map(|l| l.trim_start_matches([' ', '\t', ':']).to_owned())
        })
        .unwrap_or_else(|| "unknown".into());
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    format!("{cores} cores, {cpu}")
}

async fn compare(
    common: Common,
    postgres: Option<String>,
    fsyncs: u64,
    nodelay_experiment: bool,
) -> Result<()> {
    let dir = work_dir(&common)?;
    println!("machine: {}; data dir {}", machine(), dir.display());
    let pg_info = match &postgres {
        Some(url) => Some(load::pg_prepare(url).await?),
        None => None,
    };

    // The floor.
    let floor_dir = dir.clone();
    let (append, overwrite) = tokio::task::spawn_blocking(move || -> Result<_> {
        Ok((
            load::fdatasync_floor(&floor_dir, fsyncs, false)?,
            load::fdatasync_floor(&floor_dir, fsyncs, true)?,
        ))
    })
    .await??;
    let data = dir.join("fence-data");
    let fenced = start_fenced(&common, &data, &dir.join("fenced.log")).await?;
    let rtt = load::round_trips(&Target::Health(vec![fenced.channel().await?]), 2000).await?;
    // `fenced` writes its WAL ahead at start (--wal-prime-mb), so its syncs overwrite: the
    // floor takes the overwrite's sync, the lower of the two.
    // A message on a Session stream skips a unary call's stream set-up: the floor of a
    // session transport takes its own round trip (an empty message, refused before any
    // decision).
    let probe = Target::SessionProbe(vec![fenced.channel().await?]);
    let probe = load::round_trips(&probe, 2000).await?;
    let (append, overwrite) = (append.latency, overwrite.latency);
    let (round_trip, via) = match common.transport() {
        load::FenceTransport::Unary => (&rtt, "gRPC round trips (health check)"),
        _ => (&probe, "Session stream round trips"),
    };
    let floor = 2.0 * overwrite.p50() + 2.0 * round_trip.p50();
    println!("\n## The floor\n");
    println!("| what | p50 ms | p99 ms |\n|---|---:|---:|");
    println!(
        "| fdatasync after a 100-byte append | {:.3} | {:.3} |",
        append.p50(),
        append.p99()
    );
    println!(
        "| fdatasync after a 100-byte overwrite (preallocated file) | {:.3} | {:.3} |",
        overwrite.p50(),
        overwrite.p99()
    );
    println!(
        "| gRPC round trip on loopback (health check) | {:.3} | {:.3} |",
        rtt.p50(),
        rtt.p99()
    );
    println!(
        "| round trip of an empty message on a Session stream (refused before any decision) | {:.3} | {:.3} |",
        probe.p50(),
        probe.p99()
    );
    println!("| floor of begin+complete: 2 fdatasync (overwrite) + 2 {via} | {floor:.3} | |");

    // Fence.
    load::register_tool(fenced.channel().await?).await?;
    let chans = channels(&fenced, common.connections).await?;
    let target = Target::fence(chans, common.transport());
    let warmup = Duration::from_secs(common.warmup);
    let measure = Duration::from_secs(common.seconds);
    let mut fence = Vec::new();
    for &c in &common.concurrency {
        let m = load::closed_loop(&target, "cmp", c, common.batch, warmup, measure).await?;
        eprintln!("{}", row(common.transport().label(), c, &m));
        fence.push((c, m));
    }
    let rss = fenced.rss_kib();
    fenced.stop().await;
    drop(target);

    // The experiment: the same service with TCP_NODELAY on accepted connections.
    let mut nodelay = Vec::new();
    if nodelay_experiment {
        let server = load::InProcess::start(&dir.join("nodelay-data"), true).await?;
        let mut chans = Vec::new();
        for _ in 0..common.connections.max(1) {
            chans.push(
                tonic::transport::Endpoint::from_shared(server.url.clone())?
                    .tcp_nodelay(true)
                    .connect()
                    .await?,
            );
        }
        load::register_tool(chans[0].clone()).await?;
        let target = Target::fence(chans, common.transport());
        for &c in &common.concurrency {
            let m = load::closed_loop(&target, "nodelay", c, common.batch, warmup, measure).await?;
            eprintln!("{}", row("Fence, in-process, TCP_NODELAY", c, &m));
            nodelay.push((c, m));
        }
        drop(target);
        server.stop().await;
    }

    // The Postgres peer.
    let mut pg = Vec::new();
    if let Some(url) = &postgres {
        let target = Target::Postgres(url.clone());
        let label = format!("cmp{}", std::process::id());
        for &c in &common.concurrency {
            let m = load::closed_loop(&target, &label, c, common.batch, warmup, measure).await?;
            eprintln!("{}", row("Postgres", c, &m));
            pg.push((c, m));
        }
    }

    if common.batch > 1 {
        println!(
            "\n## parallel tool calls: {} effects per turn (latency per turn)\n",
            common.batch
        );
    } else {
        println!("\n## begin+complete per effect\n");
    }
    if let Some(info) = &pg_info {
        println!("Postgres peer: {info}\n");
    }
    println!("{HEADER}");
    for ((c, f), p) in fence
        .iter()
        .zip(pg.iter().map(Some).chain(std::iter::repeat(None)))
    {
        println!("{}", row(common.transport().label(), *c, f));
        if let Some((_, n)) = nodelay.iter().find(|(k, _)| k == c) {
            println!(
                "{}",
                row("Fence in-process + TCP_NODELAY (experiment)", *c, n)
            );
        }
        if let Some((_, p)) = p {
            println!("{}", row("Postgres", *c, p));
        }
    }
    if let Some(kib) = rss {
        println!(
            "\nfenced RSS after the sweep: {:.1} MiB",
            kib as f64 / 1024.0
        );
    }

    println!("\n## Targets\n");
    targets("fenced", &fence, &pg, floor);
    if !nodelay.is_empty() {
        println!();
        targets(
            "in-process + TCP_NODELAY (experiment)",
            &nodelay,
            &pg,
            floor,
        );
    }
    if common.dir.is_none() {
        let _ = std::fs::remove_dir_all(&dir);
    }
    Ok(())
}

fn targets(label: &str, fence: &[(usize, Measured)], pg: &[(usize, Measured)], floor: f64) {
    let find =
        |v: &[(usize, Measured)], c: usize| v.iter().find(|(k, _)| *k == c).map(|(_, m)| m.clone());
    if let Some(f1) = find(fence, 1) {
        let ratio = f1.p50() / floor;
        println!(
            "- {label}: c=1 p50 {:.3} ms = {ratio:.2}x the floor ({floor:.3} ms), target 1.5x: {}",
            f1.p50(),
            verdict(ratio <= 1.5)
        );
        if let Some(p1) = find(pg, 1) {
            println!(
                "- {label}: c=1 p50 {:.3} ms vs Postgres {:.3} ms: {}",
                f1.p50(),
                p1.p50(),
                verdict(f1.p50() <= p1.p50())
            );
        }
    }
    if let (Some(f64_), Some(p64)) = (find(fence, 64), find(pg, 64)) {
        let ratio = f64_.throughput() / p64.throughput();
        println!(
            "- {label}: c=64 throughput {:.0}/s = {ratio:.2}x Postgres ({:.0}/s), target 2x: {}",
            f64_.throughput(),
            p64.throughput(),
            verdict(ratio >= 2.0)
        );
        println!(
            "- {label}: c=64 p99 {:.3} ms vs Postgres {:.3} ms: {}",
            f64_.p99(),
            p64.p99(),
            verdict(f64_.p99() < p64.p99())
        );
    }
    for (c, m) in fence {
        let r = m.p99() / m.p50();
        // A tail a throttled virtual machine's host made is named as such, not hidden.
        let stolen = match m.steal {
            Some(s) if r > 3.0 && s >= 0.01 => format!(
                " (the host stole {:.1}% of the CPUs' time in this window: on a virtual machine, \
                 its pauses can make the tail; docs/BENCHMARKS.md, \"The tail at every level\")",
                s * 100.0
            ),
            _ => String::new(),
        };
        println!(
            "- {label}: c={c} p99/p50 = {r:.2} (target <= 3): {}{stolen}",
            verdict(r <= 3.0)
        );
    }
}

fn verdict(ok: bool) -> &'static str {
    if ok { "met" } else { "NOT met" }
}

async fn scale(common: Common, sizes: Vec<u64>, threads: usize) -> Result<()> {
    let dir = work_dir(&common)?;
    println!("machine: {}; data dir {}", machine(), dir.display());
    let data = dir.join("fence-data");
    let mut stored = 0u64;
    let warmup = Duration::from_secs(common.warmup);
    let measure = Duration::from_secs(common.seconds);
    let mut lines = Vec::new();
    for (i, &size) in sizes.iter().enumerate() {
        if size < stored {
            bail!("sizes must ascend");
        }
        if size > stored {
            eprintln!(
                "preloading {} effects ({stored} -> {size})...",
                size - stored
            );
            let d = data.clone();
            let (from, to) = (stored, size);
            let took =
                tokio::task::spawn_blocking(move || load::preload(&d, from, to, threads)).await??;
            eprintln!(
                "  {:.0} s ({:.0} effects/s, on-disk {:.2} GiB)",
                took.as_secs_f64(),
                (to - from) as f64 / took.as_secs_f64(),
                load::disk_usage(&data) as f64 / (1u64 << 30) as f64
            );
            stored = size;
        }
        let fenced = start_fenced(&common, &data, &dir.join("fenced.log")).await?;
        if size == 0 {
            load::register_tool(fenced.channel().await?).await?;
        }
        let target = Target::fence(
            channels(&fenced, common.connections).await?,
            common.transport(),
        );
        for &c in &common.concurrency {
            let m = load::closed_loop(
                &target,
                &format!("scale{i}"),
                c,
                common.batch,
                warmup,
                measure,
            )
            .await?;
            let line = format!(
                "| {size} | {c} | {:.0} | {:.3} | {:.3} | {:.3} | {:.1} |",
                m.throughput(),
                m.p50(),
                m.p99(),
                m.p999(),
                fenced.rss_kib().unwrap_or(0) as f64 / 1024.0
            );
            eprintln!("{line}");
            lines.push(line);
        }
        fenced.stop().await;
    }
    println!(
        "\n| stored effects | concurrency | effects/s | p50 ms | p99 ms | p99.9 ms | fenced RSS MiB |\n|---:|---:|---:|---:|---:|---:|---:|"
    );
    for l in lines {
        println!("{l}");
    }
    println!(
        "\non-disk size of the ledger: {:.2} GiB",
        load::disk_usage(&data) as f64 / (1u64 << 30) as f64
    );
    if common.dir.is_none() {
        let _ = std::fs::remove_dir_all(&dir);
    }
    Ok(())
}

async fn cost(common: Common, effects: u64, callgrind: bool) -> Result<()> {
    let dir = work_dir(&common)?;
    println!("machine: {}; data dir {}", machine(), dir.display());
    let dumps = dir.join("callgrind.fenced");
    let prefix = if callgrind {
        Callgrind::prefix(&dumps)
    } else {
        Vec::new()
    };
    let (data, log) = (dir.join("fence-data"), dir.join("fenced.log"));
    let fenced = start_fenced_under(prefix, &common, &data, &log).await?;
    let mut counter = callgrind.then(|| Callgrind::attach(&dumps, fenced.pid()));
    if counter.is_some() {
        println!(
            "fenced runs under callgrind: its times and CPU below are valgrind's, its instruction counts (last table) its own"
        );
    }
    // Instructions per operation of each measured loop, by level: (Fence, health, probe).
    let mut instructions: Vec<(usize, [Option<f64>; 3])> = Vec::new();
    load::register_tool(fenced.channel().await?).await?;
    let target = Target::fence(
        channels(&fenced, common.connections).await?,
        common.transport(),
    );
    let batch = common.batch.max(1) as u64;
    let mut measured = Vec::new();
    println!(
        "\n| concurrency | effects | effects/s | p50 ms | p99 ms | fenced CPU s (user + sys) | fenced CPU us per effect | fenced thread wake-ups per effect | load generator CPU us per effect | host steal % |\n|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    );
    for &c in &common.concurrency {
        let c = c.max(1);
        let turns = |n: u64| (n / (c as u64 * batch)).max(1);
        let warm = load::Budget::Turns(turns(1000));
        load::run_loop(&target, &format!("cost-warm-c{c}"), c, common.batch, warm).await?;
        let own_before = load::process_cpu(std::process::id())?;
        let budget = load::Budget::Turns(turns(effects));
        let label = format!("cost-c{c}");
        let (m, spent) = measured_loop(
            &target,
            &label,
            (c, common.batch),
            budget,
            fenced.pid(),
            &mut counter,
        )
        .await?;
        instructions.push((c, [spent.instructions, None, None]));
        let (cpu, wakes) = (spent.cpu, spent.wakes);
        let own = load::process_cpu(std::process::id())? - own_before;
        println!(
            "| {c} | {} | {:.0} | {:.3} | {:.3} | {:.2} ({:.2} + {:.2}) | {:.0} | {wakes} | {:.0} | {} |",
            m.ops,
            m.throughput(),
            m.p50(),
            m.p99(),
            cpu.total().as_secs_f64(),
            cpu.user.as_secs_f64(),
            cpu.system.as_secs_f64(),
            us_each(cpu.total(), m.ops),
            us_each(own.total(), m.ops),
            steal(&m)
        );
        measured.push((c, m.throughput(), us_each(cpu.total(), m.ops)));
    }
    // The RPC stack's ceilings on the same server and connections, no disk and no ledger:
    // unary health checks, and empty messages on a Session stream per worker (refused before
    // any decision).
    let chans = target.channels().expect("cost measures Fence").to_vec();
    let ceilings = [Target::Health(chans.clone()), Target::SessionProbe(chans)];
    println!(
        "\n| concurrency | health checks/s (tonic ceiling) | fenced CPU us per check | fenced wake-ups per check | empty Session messages/s | fenced CPU us per message | fenced wake-ups per message | Fence calls/s (2 per effect) | Fence / health ceiling | Fence / Session ceiling |\n|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    );
    let mut floors = Vec::new();
    for (level, &(c, fence_rate, fence_cpu)) in measured.iter().enumerate() {
        let mut rates = Vec::new();
        for (i, ceiling) in ceilings.iter().enumerate() {
            let budget = load::Budget::Turns((effects / c as u64).max(1));
            let label = format!("ceiling{i}-c{c}");
            let (m, spent) =
                measured_loop(ceiling, &label, (c, 1), budget, fenced.pid(), &mut counter).await?;
            instructions[level].1[i + 1] = spent.instructions;
            rates.push((
                m.throughput(),
                us_each(spent.cpu.total(), m.ops),
                spent.wakes,
            ));
        }
        let [
            (health, per_check, ref check_wakes),
            (probes, per_message, ref message_wakes),
        ] = rates[..]
        else {
            unreachable!("two ceilings measured")
        };
        let calls = fence_rate * 2.0 / batch as f64;
        println!(
            "| {c} | {health:.0} | {per_check:.0} | {check_wakes} | {probes:.0} | {per_message:.0} | {message_wakes} | {calls:.0} | {:.2} | {:.2} |",
            calls / health.max(1e-9),
            calls / probes.max(1e-9)
        );
        floors.push((c, per_check.min(per_message), fence_cpu));
    }
    fenced.stop().await;
    if let Some(counter) = &counter {
        println!(
            "\n| concurrency | fenced instructions per effect | per health check | per empty Session message | Fence / two Session messages |\n|---:|---:|---:|---:|---:|"
        );
        let cell = |x: Option<f64>| x.map_or_else(|| "-".to_string(), |x| format!("{x:.0}"));
        for (c, [fence, health, probe]) in &instructions {
            let ratio = match (fence, probe) {
                (Some(f), Some(p)) => format!("{:.2}", f / (2.0 * p).max(1.0)),
                _ => "-".into(),
            };
            println!(
                "| {c} | {} | {} | {} | {ratio} |",
                cell(*fence),
                cell(*health),
                cell(*probe)
            );
        }
        println!(
            "\ncallgrind dumps (for callgrind_annotate): {}",
            counter.dumps()
        );
    }

    // The CPU floor: what two calls and two bare syncs cost on this machine, however little
    // the engine does: calls as the cheaper of the two empty gRPC calls above, and as bare
    // TCP echoes (no RPC framework at all). The syncs run on the data dir's file system.
    let sync_dir = dir.clone();
    let (sync, echo) = tokio::task::spawn_blocking(move || -> Result<_> {
        Ok((
            load::fdatasync_floor(&sync_dir, 3000, true)?,
            load::tcp_echo_floor(5000)?,
        ))
    })
    .await??;
    if let (Some(sync_cpu), Some(echo_cpu)) = (sync.cpu_per_op, echo.cpu_per_op) {
        let (sync_us, echo_us) = (sync_cpu.as_secs_f64() * 1e6, echo_cpu.as_secs_f64() * 1e6);
        println!(
            "\nCPU floor per effect: 2 calls + 2 fdatasync of a preallocated file ({sync_us:.0} us CPU each, p50 {:.3} ms); a bare TCP echo costs its server thread {echo_us:.0} us per round trip (p50 {:.3} ms)\n",
            sync.latency.p50(),
            echo.latency.p50()
        );
        println!(
            "| concurrency | floor with gRPC calls (the cheaper empty call), CPU us per effect | floor with bare TCP echoes | fenced CPU us per effect | fenced / gRPC floor |\n|---:|---:|---:|---:|---:|"
        );
        for (c, per_call, fence_cpu) in floors {
            // Concurrent requests share a sync (group commit) and a wake-up, so above c=1 only
            // the calls' share is a floor, measured at that level for gRPC.
            let syncs = if c == 1 { 2.0 * sync_us } else { 0.0 };
            let grpc = 2.0 * per_call + syncs;
            let bare = if c == 1 {
                format!("{:.0}", 2.0 * echo_us + syncs)
            } else {
                "-".to_string()
            };
            println!(
                "| {c} | {grpc:.0}{} | {bare} | {fence_cpu:.0} | {:.2} |",
                if c == 1 { "" } else { " (calls only)" },
                fence_cpu / grpc.max(1e-9)
            );
        }
    }
    // A directory of its own goes, but for the dumps of a callgrind run, named above.
    if common.dir.is_none() && !callgrind {
        let _ = std::fs::remove_dir_all(&dir);
    }
    Ok(())
}

/// What server process `pid` spent on one measured loop.
struct Spent {
    cpu: load::CpuTime,
    /// Its threads' wake-ups per operation, as a table cell.
    wakes: String,
    /// Instructions per operation, when it runs under callgrind.
    instructions: Option<f64>,
}

/// [`load::run_loop`] of `target` at `(concurrency, batch)`, with what it cost server `pid`:
/// its CPU and wake-ups read before and after, and under callgrind (`counter`) its counters
/// zeroed before and dumped after, so they hold exactly this loop's calls.
async fn measured_loop(
    target: &Target,
    label: &str,
    (concurrency, batch): (usize, usize),
    budget: load::Budget,
    pid: u32,
    counter: &mut Option<Callgrind>,
) -> Result<(Measured, Spent)> {
    let (cpu, slices) = (load::process_cpu(pid)?, load::process_slices(pid));
    if let Some(counter) = counter {
        counter.zero().await?;
    }
    let m = load::run_loop(target, label, concurrency, batch, budget).await?;
    let instructions = match counter {
        Some(counter) => Some(counter.dump().await? as f64 / m.ops.max(1) as f64),
        None => None,
    };
    let spent = Spent {
        cpu: load::process_cpu(pid)? - cpu,
        wakes: per_op(slices, load::process_slices(pid), m.ops),
        instructions,
    };
    Ok((m, spent))
}

/// The growth of a count between two readings per one of `ops` operations, for a table cell
/// ("-" where either reading is missing).
fn per_op(before: Option<u64>, after: Option<u64>, ops: u64) -> String {
    match (before, after) {
        (Some(b), Some(a)) => format!("{:.1}", a.saturating_sub(b) as f64 / ops.max(1) as f64),
        _ => "-".into(),
    }
}

/// CPU time `total` per one of `ops` operations, in microseconds.
fn us_each(total: Duration, ops: u64) -> f64 {
    total.as_secs_f64() * 1e6 / ops.max(1) as f64
}

fn ledger(
    effects: u64,
    warmup: u64,
    dir: Option<PathBuf>,
    mem: bool,
    group: u64,
    no_caches: bool,
) -> Result<()> {
    let scratch = match (&dir, mem) {
        (_, true) => None,
        (Some(d), false) => Some(d.clone()),
        (None, false) => {
            let exe = std::env::current_exe()?;
            let target = exe
                .parent()
                .and_then(Path::parent)
                .context("target directory")?;
            Some(target.join(format!("fence-ledger-{}", std::process::id())))
        }
    };
    let took = load::ledger_effects(scratch.as_deref(), warmup, effects, group, !no_caches)?;
    println!(
        "{effects} effects on the {} store in {:.3} s: {:.1} us per effect (wall)",
        if mem { "in-memory" } else { "RocksDB" },
        took.as_secs_f64(),
        took.as_secs_f64() * 1e6 / effects.max(1) as f64
    );
    if let (None, Some(d)) = (dir, scratch) {
        let _ = std::fs::remove_dir_all(d);
    }
    Ok(())
}

#[tokio::main]
async fn main() -> Result<()> {
    match Args::parse().command {
        Command::Compare {
            common,
            postgres,
            fsyncs,
            nodelay_experiment,
        } => compare(common, postgres, fsyncs, nodelay_experiment).await,
        Command::Scale {
            common,
            sizes,
            preload_threads,
        } => scale(common, sizes, preload_threads).await,
        Command::Cost {
            common,
            effects,
            callgrind,
        } => cost(common, effects, callgrind).await,
        Command::Ledger {
            effects,
            warmup,
            dir,
            mem,
            group,
            no_caches,
        } => ledger(effects, warmup, dir, mem, group, no_caches),
    }
}
