//! The cost benchmarks' load generator: begin+complete per effect over real gRPC on loopback
//! against a `fenced` child process (WAL sync on, the server's default), the same effect
//! ledger done the usual way (an idempotency-key table in PostgreSQL with
//! `synchronous_commit=on`), and the physical floor under both (a bare `fdatasync` loop on the
//! same disk, and a gRPC round trip that touches no disk).
//!
//! Every measurement is a closed loop: `concurrency` workers each issue one effect after the
//! other for a fixed time; latencies after the warm-up go into an HDR histogram (microseconds).

use std::future::Future;
use std::io::Write;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use fence_proto::v1 as pb;
use fence_proto::v1::decision::Outcome;
use fence_proto::v1::fence_client::FenceClient;
use fence_server::clock::SystemClock;
use fence_server::ledger::records::EffectRecord;
use fence_server::ledger::{BeginCmd, Decision, OpClass, Outcome as LedgerOutcome, ToolDef};
use hdrhistogram::Histogram;
use tonic::transport::Channel;

/// The tenant every load request uses (dev mode's default).
pub const TENANT: &str = "default";
/// The tool every load request calls.
pub const TOOL: &str = "bench.transfer";

/// Latencies of one measurement.
#[derive(Debug, Clone)]
pub struct Measured {
    /// Operations completed in the measured window.
    pub ops: u64,
    /// The measured window.
    pub window: Duration,
    /// Latency histogram, microseconds.
    pub hist: Histogram<u64>,
    /// The share of the machine's CPU time its hypervisor took away (*steal* in
    /// `/proc/stat`) during the measured window, when known. On a virtual machine whose host
    /// pauses its CPUs, that is where a tail at low concurrency comes from.
    pub steal: Option<f64>,
}

impl Measured {
    fn new(window: Duration) -> Self {
        Self {
            ops: 0,
            window,
            hist: new_hist(),
            steal: None,
        }
    }

    /// Operations per second.
    pub fn throughput(&self) -> f64 {
        self.ops as f64 / self.window.as_secs_f64().max(1e-9)
    }

    /// A quantile in milliseconds.
    pub fn ms(&self, q: f64) -> f64 {
        self.hist.value_at_quantile(q) as f64 / 1000.0
    }

    /// p50 in milliseconds.
    pub fn p50(&self) -> f64 {
        self.ms(0.50)
    }

    /// p99 in milliseconds.
    pub fn p99(&self) -> f64 {
        self.ms(0.99)
    }

    /// p99.9 in milliseconds.
    pub fn p999(&self) -> f64 {
        self.ms(0.999)
    }
}

/// The machine's CPU ticks so far, from `/proc/stat`: (stolen by the hypervisor, all).
fn cpu_ticks() -> Option<(u64, u64)> {
    parse_cpu_ticks(&std::fs::read_to_string("/proc/stat").ok()?)
}

/// [`cpu_ticks`] from the text of `/proc/stat`: the first line's user, nice, system, idle,
/// iowait, irq, softirq and steal (guest time is already counted in user and nice).
fn parse_cpu_ticks(stat: &str) -> Option<(u64, u64)> {
    let line = stat.lines().next()?.strip_prefix("cpu ")?;
    let ticks: Vec<u64> = line
        .split_whitespace()
        .take(8)
        .map(str::parse)
        .collect::<Result<_, _>>()
        .ok()?;
    (ticks.len() == 8).then(|| (ticks[7], ticks.iter().sum()))
}

/// The share of CPU time stolen between two [`cpu_ticks`] readings.
fn steal_between(before: Option<(u64, u64)>, after: Option<(u64, u64)>) -> Option<f64> {
    let ((s0, t0), (s1, t1)) = (before?, after?);
    let total = t1.checked_sub(t0).filter(|&t| t > 0)?;
    Some(s1.saturating_sub(s0) as f64 / total as f64)
}

/// A histogram of 1 µs to 100 s with three significant digits.
pub fn new_hist() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 100_000_000, 3).expect("valid histogram bounds")
}

fn micros(d: Duration) -> u64 {
    (d.as_micros() as u64).clamp(1, 100_000_000)
}

/// One part of the floor: its latency and the CPU it costs.
#[derive(Debug)]
pub struct Floor {
    /// Latency of each operation.
    pub latency: Measured,
    /// The CPU time (user + system) of the thread doing the floor's side of each operation,
    /// when the kernel reports it (`/proc/thread-self/schedstat`): the work no program doing
    /// that operation can avoid.
    pub cpu_per_op: Option<Duration>,
}

/// The bare `fdatasync` floor: `count` appends of 100 bytes to a new file in `dir`, each
/// followed by `fdatasync` (std's `sync_data`). With `preallocated`, the file is written
/// first and the loop overwrites it in place (no size change to flush), as a WAL that
/// recycles its files does.
pub fn fdatasync_floor(dir: &Path, count: u64, preallocated: bool) -> Result<Floor> {
    let path = dir.join(format!("fdatasync-floor-{}.bin", std::process::id()));
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(true)
        .write(true)
        .open(&path)
        .with_context(|| format!("create {}", path.display()))?;
    let record = [0x5au8; 100];
    if preallocated {
        for _ in 0..count {
            file.write_all(&record)?;
        }
        file.sync_all()?;
        use std::io::Seek;
        file.seek(std::io::SeekFrom::Start(0))?;
    }
    let cpu_before = thread_cpu();
    let started = Instant::now();
    let mut m = Measured::new(Duration::ZERO);
    for _ in 0..count {
        let t = Instant::now();
        file.write_all(&record)?;
        file.sync_data()?;
        m.hist.record(micros(t.elapsed()))?;
        m.ops += 1;
    }
    m.window = started.elapsed();
    let cpu_per_op = cpu_per_op(cpu_before, count);
    drop(file);
    std::fs::remove_file(&path)?;
    Ok(Floor {
        latency: m,
        cpu_per_op,
    })
}

/// The calling thread's CPU since `before`, per one of `count` operations.
fn cpu_per_op(before: Option<Duration>, count: u64) -> Option<Duration> {
    let spent = thread_cpu()?.saturating_sub(before?);
    (count > 0).then(|| spent / u32::try_from(count).unwrap_or(u32::MAX))
}

/// The bare network floor: `count` round trips of 100 bytes over loopback TCP (no delay) to
/// an echo thread, after `count / 10` unmeasured ones. `cpu_per_op` is the echo thread's CPU
/// per round trip: what a server that does nothing but read a request and write an answer
/// costs per call, with no RPC framework at all.
pub fn tcp_echo_floor(count: u64) -> Result<Floor> {
    use std::io::Read;
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let warm = count / 10;
    let echo = std::thread::spawn(move || -> std::io::Result<Option<Duration>> {
        let (mut conn, _) = listener.accept()?;
        conn.set_nodelay(true)?;
        let mut buf = [0u8; 100];
        let mut before = None;
        for i in 0..warm + count {
            if i == warm {
                before = thread_cpu();
            }
            conn.read_exact(&mut buf)?;
            conn.write_all(&buf)?;
        }
        Ok(cpu_per_op(before, count))
    });
    let mut conn = std::net::TcpStream::connect(addr)?;
    conn.set_nodelay(true)?;
    let mut buf = [7u8; 100];
    let mut m = Measured::new(Duration::ZERO);
    let mut started = Instant::now();
    for i in 0..warm + count {
        if i == warm {
            started = Instant::now();
        }
        let t = Instant::now();
        conn.write_all(&buf)?;
        conn.read_exact(&mut buf)?;
        if i >= warm {
            m.hist.record(micros(t.elapsed()))?;
            m.ops += 1;
        }
    }
    m.window = started.elapsed();
    let cpu_per_op = echo
        .join()
        .map_err(|_| anyhow::anyhow!("the echo thread panicked"))??;
    Ok(Floor {
        latency: m,
        cpu_per_op,
    })
}

/// The calling thread's CPU time (user + system) so far, from `/proc/thread-self/schedstat`,
/// whose first field counts nanoseconds on the CPU (`/proc/PID/stat` counts 10 ms ticks,
/// too coarse for a loop of a few thousand syscalls). `None` where the kernel does not
/// report it.
pub fn thread_cpu() -> Option<Duration> {
    parse_schedstat(&std::fs::read_to_string("/proc/thread-self/schedstat").ok()?)
}

/// The time on the CPU in a `schedstat` line (`<ns on cpu> <ns waiting> <timeslices>`).
fn parse_schedstat(line: &str) -> Option<Duration> {
    let ns = line.split_whitespace().next()?.parse().ok()?;
    Some(Duration::from_nanos(ns))
}

/// The timeslices in a `schedstat` line: how many times the thread was put on a CPU.
fn schedstat_slices(line: &str) -> Option<u64> {
    line.split_whitespace().nth(2)?.parse().ok()
}

/// How many times the threads of process `pid` now alive have been put on a CPU (the sum of
/// `/proc/PID/task/*/schedstat`'s timeslices): near the count of their wake-ups, each of which
/// costs a context switch and, on an idle core, an interrupt. A thread that ends between two
/// readings takes its count with it, so this suits a process whose threads live long (a
/// server's workers). `None` where the kernel does not report it.
pub fn process_slices(pid: u32) -> Option<u64> {
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).ok()?;
    let mut total = 0;
    for task in tasks.flatten() {
        // A thread may end between the listing and the read: it no longer counts.
        if let Ok(line) = std::fs::read_to_string(task.path().join("schedstat")) {
            total += schedstat_slices(&line)?;
        }
    }
    Some(total)
}

/// `count` round trips of one worker on `target` (a ceiling: [`Target::Health`] or
/// [`Target::SessionProbe`]), after `count / 10` unmeasured ones: the network and gRPC cost
/// of one call, with no disk in it.
pub async fn round_trips(target: &Target, count: u64) -> Result<Measured> {
    run_loop(
        target,
        "round-trips-warm",
        1,
        1,
        Budget::Turns((count / 10).max(1)),
    )
    .await?;
    run_loop(target, "round-trips", 1, 1, Budget::Turns(count)).await
}

/// Arguments of the `n`-th load effect: intent fields plus volatile ones, ~150 bytes.
pub fn arguments(worker: u64, n: u64) -> String {
    format!(
        r#"{{"to":"acct-{}","amount":{},"currency":"EUR","ref":"{:08x}-{:04x}-4000-8000-{:012x}","ts":"2026-03-01T10:{:02}:{:02}Z"}}"#,
        n % 5000,
        100 + n % 100_000,
        worker,
        n & 0xffff,
        n,
        (n / 60) % 60,
        n % 60
    )
}

/// Registers the load tool on a server.
pub async fn register_tool(channel: Channel) -> Result<()> {
    FenceClient::new(channel)
        .register_tool(pb::RegisterToolRequest {
            tool: Some(pb::ToolSpec {
                name: TOOL.into(),
                class: pb::OperationClass::NonRetryable as i32,
                intent_schema: Some(pb::IntentSchema {
                    volatile_fields: vec!["ref".into(), "ts".into()],
                    ..Default::default()
                }),
                ..Default::default()
            }),
        })
        .await
        .context("register the load tool")?;
    Ok(())
}

/// What a closed-loop measurement needs: one turn of `batch` effects, begun and completed.
trait EffectClient: Send + 'static {
    /// Effects per turn.
    fn batch(&self) -> u64;
    /// Turn `n` (effects `n * batch ..`).
    fn effect(&mut self, worker: u64, n: u64) -> impl Future<Output = Result<()>> + Send;
}

/// One health check per turn (see [`Target::Health`]).
struct HealthChecks(tonic_health::pb::health_client::HealthClient<Channel>);

impl EffectClient for HealthChecks {
    fn batch(&self) -> u64 {
        1
    }

    async fn effect(&mut self, _worker: u64, _n: u64) -> Result<()> {
        self.0
            .check(tonic_health::pb::HealthCheckRequest {
                service: String::new(),
            })
            .await
            .context("health check")?;
        Ok(())
    }
}

/// One empty message per turn on a Session stream of the worker's own (see
/// [`Target::SessionProbe`]).
struct SessionProbes {
    calls: tokio::sync::mpsc::Sender<pb::SessionRequest>,
    answers: tonic::Streaming<pb::SessionResponse>,
}

impl SessionProbes {
    async fn open(channel: Channel) -> Result<Self> {
        let (calls, rx) = tokio::sync::mpsc::channel(1);
        let answers = FenceClient::new(channel)
            .session(tokio_stream::wrappers::ReceiverStream::new(rx))
            .await
            .context("open a Session stream")?
            .into_inner();
        Ok(Self { calls, answers })
    }
}

impl EffectClient for SessionProbes {
    fn batch(&self) -> u64 {
        1
    }

    async fn effect(&mut self, _worker: u64, n: u64) -> Result<()> {
        let call = pb::SessionRequest {
            id: n,
            ..Default::default()
        };
        self.calls
            .send(call)
            .await
            .context("the Session stream closed")?;
        let answer = self
            .answers
            .message()
            .await
            .context("Session stream")?
            .context("the Session stream ended")?;
        // The server refuses a message with no call in it before any decision: an error
        // answer for this message is the round trip this measures, anything else a bug.
        match answer.result {
            Some(pb::session_response::Result::Error(_)) if answer.id == n => Ok(()),
            other => bail!("expected the refusal of empty message {n}, got {other:?}"),
        }
    }
}

/// The completion of effect `n`'s grant.
fn completion(ex: pb::Execute, worker: u64, n: u64) -> pb::CompleteRequest {
    pb::CompleteRequest {
        effect_id: ex.effect_id,
        attempt: ex.attempt,
        outcome: Some(pb::complete_request::Outcome::Result(
            format!("tx-{worker}-{n}").into_bytes(),
        )),
        ..Default::default()
    }
}

struct FenceEffects {
    client: FenceClient<Channel>,
    run_id: String,
    batch: u64,
}

impl FenceEffects {
    fn call(&self, worker: u64, n: u64) -> pb::BeginRequest {
        pb::BeginRequest {
            run_id: self.run_id.clone(),
            tool: TOOL.into(),
            step_key: format!("s{n}"),
            arguments_json: arguments(worker, n),
            ..Default::default()
        }
    }

    /// A turn of parallel tool calls: one BeginBatch, one CompleteBatch.
    async fn turn(&mut self, worker: u64, n: u64) -> Result<()> {
        let first = n * self.batch;
        let calls = (first..first + self.batch)
            .map(|i| self.call(worker, i))
            .collect();
        let begun = self
            .client
            .begin_batch(pb::BeginBatchRequest { calls })
            .await?
            .into_inner();
        let mut completions = Vec::with_capacity(begun.results.len());
        for (i, r) in (first..).zip(begun.results) {
            let Some(pb::begin_result::Result::Response(resp)) = r.result else {
                bail!("expected an answer for a new effect, got {r:?}");
            };
            let Some(Outcome::Execute(ex)) = resp.decision.and_then(|d| d.outcome) else {
                bail!("expected a grant for a new effect");
            };
            completions.push(completion(ex, worker, i));
        }
        let done = self
            .client
            .complete_batch(pb::CompleteBatchRequest { completions })
            .await?
            .into_inner();
        if let Some(e) = done.results.iter().find_map(|r| match &r.result {
            Some(pb::complete_result::Result::Response(_)) => None,
            other => Some(format!("{other:?}")),
        }) {
            bail!("a completion failed: {e}");
        }
        Ok(())
    }
}

impl EffectClient for FenceEffects {
    fn batch(&self) -> u64 {
        self.batch
    }

    async fn effect(&mut self, worker: u64, n: u64) -> Result<()> {
        if self.batch > 1 {
            return self.turn(worker, n).await;
        }
        let begun = self.client.begin(self.call(worker, n)).await?.into_inner();
        let Some(Outcome::Execute(ex)) = begun.decision.and_then(|d| d.outcome) else {
            bail!("expected a grant for a new effect");
        };
        self.client.complete(completion(ex, worker, n)).await?;
        Ok(())
    }
}

/// Fence over one [`fence_client::Session`] stream per worker (an agent's session): each
/// effect is a Begin and a Complete message on it; a turn of K parallel calls sends K Begins
/// at once, then K Completes.
struct SessionEffects {
    session: fence_client::Session,
    run_id: String,
    batch: u64,
}

impl SessionEffects {
    async fn one(&self, worker: u64, n: u64) -> Result<()> {
        let call = fence_client::EffectCall::new(&self.run_id, TOOL, arguments(worker, n))
            .step_key(format!("s{n}"));
        let fence_client::Decision::Execute(grant) = self.session.begin(&call).await?.decision
        else {
            bail!("expected a grant for a new effect");
        };
        let result = fence_client::Completion::Result(format!("tx-{worker}-{n}").into_bytes());
        self.session
            .complete(&grant.effect_id, grant.attempt, 0, result)
            .await?;
        Ok(())
    }
}

impl EffectClient for SessionEffects {
    fn batch(&self) -> u64 {
        self.batch
    }

    async fn effect(&mut self, worker: u64, n: u64) -> Result<()> {
        let first = n * self.batch;
        let turn = (first..first + self.batch).map(|i| self.one(worker, i));
        futures::future::try_join_all(turn).await?;
        Ok(())
    }
}

struct PgEffects {
    client: tokio_postgres::Client,
    batch: u64,
    begin: tokio_postgres::Statement,
    complete: tokio_postgres::Statement,
    run_id: String,
    schema: fence_server::canonical::IntentSchema,
}

impl PgEffects {
    /// The fingerprint the usual way computes too, so a retry can be compared.
    fn fingerprint(&self, args: &str) -> Result<[u8; 32]> {
        let value = fence_server::canonical::parse_arguments(args)?;
        let canonical = fence_server::canonical::canonical_intent(&value, &self.schema);
        Ok(fence_server::canonical::intent_fingerprint(
            TOOL, &canonical,
        ))
    }

    /// A turn of parallel tool calls the usual way: one transaction inserting every key, one
    /// updating every row (statements pipelined on the connection; one commit each).
    async fn turn(&mut self, worker: u64, n: u64) -> Result<()> {
        let first = n * self.batch;
        let rows: Vec<(String, String, [u8; 32])> = (first..first + self.batch)
            .map(|i| {
                let args = arguments(worker, i);
                let fp = self.fingerprint(&args)?;
                Ok((format!("s{i}"), args, fp))
            })
            .collect::<Result<_>>()?;
        let (begin, complete, run_id) = (&self.begin, &self.complete, &self.run_id);
        let tx = self.client.transaction().await?;
        let inserted = futures::future::try_join_all(rows.iter().map(|(step, args, fp)| {
            let tx = &tx;
            async move {
                let fp: &[u8] = &fp[..];
                tx.query_opt(begin, &[&TENANT, run_id, step, &fp, args])
                    .await
            }
        }))
        .await?;
        if inserted.iter().any(Option::is_none) {
            bail!("expected new rows for new effects");
        }
        tx.commit().await?;
        let results: Vec<Vec<u8>> = (first..first + self.batch)
            .map(|i| format!("tx-{worker}-{i}").into_bytes())
            .collect();
        let tx = self.client.transaction().await?;
        let updated = futures::future::try_join_all(rows.iter().zip(&results).map(
            |((step, _, _), result)| {
                let tx = &tx;
                async move { tx.execute(complete, &[&TENANT, run_id, step, result]).await }
            },
        ))
        .await?;
        if updated.iter().any(|u| *u != 1) {
            bail!("complete updated {updated:?} rows");
        }
        tx.commit().await?;
        Ok(())
    }
}

impl EffectClient for PgEffects {
    fn batch(&self) -> u64 {
        self.batch
    }

    async fn effect(&mut self, worker: u64, n: u64) -> Result<()> {
        if self.batch > 1 {
            return self.turn(worker, n).await;
        }
        let args = arguments(worker, n);
        let fp = self.fingerprint(&args)?;
        let step = format!("s{n}");
        let row = self
            .client
            .query_opt(
                &self.begin,
                &[&TENANT, &self.run_id, &step, &&fp[..], &args],
            )
            .await?;
        if row.is_none() {
            bail!("expected a new row for a new effect");
        }
        let result = format!("tx-{worker}-{n}").into_bytes();
        let updated = self
            .client
            .execute(&self.complete, &[&TENANT, &self.run_id, &step, &result])
            .await?;
        if updated != 1 {
            bail!("complete updated {updated} rows");
        }
        Ok(())
    }
}

/// The idempotency-key table of the Postgres peer (created by `scripts/bench-postgres.sh`).
pub const PG_SCHEMA: &str = "CREATE TABLE IF NOT EXISTS effects (
    tenant text NOT NULL,
    run_id text NOT NULL,
    step_key text NOT NULL,
    intent_fp bytea NOT NULL,
    arguments text NOT NULL,
    state smallint NOT NULL,
    result bytea,
    lease_expires_at timestamptz,
    created_at timestamptz NOT NULL DEFAULT now(),
    updated_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant, run_id, step_key)
)";

const PG_BEGIN: &str =
    "INSERT INTO effects (tenant, run_id, step_key, intent_fp, arguments, state, lease_expires_at)
    VALUES ($1, $2, $3, $4, $5, 1, now() + interval '30 seconds')
    ON CONFLICT (tenant, run_id, step_key) DO NOTHING
    RETURNING state";

const PG_COMPLETE: &str =
    "UPDATE effects SET state = 3, result = $4, lease_expires_at = NULL, updated_at = now()
    WHERE tenant = $1 AND run_id = $2 AND step_key = $3 AND state = 1";

async fn pg_client(url: &str) -> Result<tokio_postgres::Client> {
    let (client, connection) = tokio_postgres::connect(url, tokio_postgres::NoTls)
        .await
        .with_context(|| format!("connect to {url}"))?;
    tokio::spawn(async move {
        if let Err(e) = connection.await {
            eprintln!("postgres connection: {e}");
        }
    });
    Ok(client)
}

/// Checks the Postgres peer is reachable, with `synchronous_commit` on, and creates the table.
pub async fn pg_prepare(url: &str) -> Result<String> {
    let client = pg_client(url).await?;
    client.batch_execute(PG_SCHEMA).await?;
    let sync: String = client
        .query_one("SHOW synchronous_commit", &[])
        .await?
        .get(0);
    let fsync: String = client.query_one("SHOW fsync", &[]).await?.get(0);
    let method: String = client.query_one("SHOW wal_sync_method", &[]).await?.get(0);
    let version: String = client.query_one("SHOW server_version", &[]).await?.get(0);
    if sync != "on" || fsync != "on" {
        bail!(
            "the Postgres peer must run with synchronous_commit=on and fsync=on (has {sync}, {fsync})"
        );
    }
    Ok(format!(
        "PostgreSQL {version}, synchronous_commit={sync}, fsync={fsync}, wal_sync_method={method}"
    ))
}

/// A Session stream of its own over `channel`.
fn session_over(channel: Channel) -> Result<fence_client::Session> {
    Ok(fence_client::FenceClient::builder("unused")
        .build_with_service(channel)?
        .session())
}

/// How Fence's calls travel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FenceTransport {
    /// One unary RPC per call.
    Unary,
    /// Each worker's calls on a Session stream of its own (an agent's session).
    Session,
    /// The calls of all the workers on one connection on one Session stream: a process
    /// hosting many agents behind one client, as the MCP gateway sends its calls (a
    /// `FenceClient` built with `sessions(true)` shares one stream among its clones).
    SharedSession,
}

impl FenceTransport {
    /// The label of Fence's rows.
    pub fn label(self) -> &'static str {
        match self {
            FenceTransport::Unary => "Fence",
            FenceTransport::Session => "Fence (session)",
            FenceTransport::SharedSession => "Fence (shared session)",
        }
    }
}

impl Target {
    /// Fence over `channels`, its calls sent as `transport` says.
    pub fn fence(channels: Vec<Channel>, transport: FenceTransport) -> Target {
        match transport {
            FenceTransport::Unary => Target::Fence(channels),
            FenceTransport::Session => Target::FenceSession(channels),
            FenceTransport::SharedSession => Target::FenceSharedSession(channels),
        }
    }

    /// The channels of a Fence target.
    pub fn channels(&self) -> Option<&[Channel]> {
        match self {
            Target::Fence(c)
            | Target::FenceSession(c)
            | Target::FenceSharedSession(c)
            | Target::Health(c)
            | Target::SessionProbe(c) => Some(c),
            Target::Postgres(_) => None,
        }
    }
}

/// Which system a closed loop drives.
#[derive(Debug, Clone)]
pub enum Target {
    /// Fence over these channels (workers share them round-robin), one unary RPC per call.
    Fence(Vec<Channel>),
    /// Fence over these channels, each worker's calls on its own Session stream.
    FenceSession(Vec<Channel>),
    /// Fence over these channels, the workers on one connection sharing one Session stream.
    FenceSharedSession(Vec<Channel>),
    /// The standard gRPC health check over these channels, one call per turn: the RPC stack's
    /// ceiling on the same server, with no disk and no ledger in it.
    Health(Vec<Channel>),
    /// Empty messages on a Session stream per worker over these channels, one per turn: the
    /// server refuses each before any decision, so this is the stream transport's ceiling,
    /// with no disk and no ledger in it.
    SessionProbe(Vec<Channel>),
    /// The Postgres peer at this URL (one connection per worker).
    Postgres(String),
}

/// How long each closed-loop worker runs.
#[derive(Debug, Clone, Copy)]
pub enum Budget {
    /// For `warmup` (not measured), then `measure`.
    Timed {
        /// Unmeasured seconds first.
        warmup: Duration,
        /// The measured window.
        measure: Duration,
    },
    /// Exactly this many turns per worker, all measured (the window is the wall time).
    Turns(u64),
}

/// Runs `concurrency` closed-loop workers for `warmup + measure`; `label` keeps run ids
/// unique across measurements. Each worker's turn is `batch` effects: 1 = Begin then Complete
/// per effect; more = that many parallel tool calls, begun together and completed together
/// (Fence: BeginBatch and CompleteBatch; Postgres: one transaction for each half). Latency is
/// per turn; throughput counts effects.
pub async fn closed_loop(
    target: &Target,
    label: &str,
    concurrency: usize,
    batch: usize,
    warmup: Duration,
    measure: Duration,
) -> Result<Measured> {
    run_loop(
        target,
        label,
        concurrency,
        batch,
        Budget::Timed { warmup, measure },
    )
    .await
}

/// Runs `concurrency` closed-loop workers within `budget` (see [`closed_loop`]).
pub async fn run_loop(
    target: &Target,
    label: &str,
    concurrency: usize,
    batch: usize,
    budget: Budget,
) -> Result<Measured> {
    let start = Instant::now() + Duration::from_millis(200);
    let limit = match budget {
        Budget::Timed { warmup, measure } => Limit {
            measure_from: start + warmup,
            end: Some(start + warmup + measure),
            turns: u64::MAX,
        },
        Budget::Turns(turns) => Limit {
            measure_from: start,
            end: None,
            turns,
        },
    };
    let failures = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::with_capacity(concurrency);
    // One stream per connection, shared by the workers on it, for a shared-session target.
    let shared: Vec<fence_client::Session> = match target {
        Target::FenceSharedSession(channels) => channels
            .iter()
            .map(|c| session_over(c.clone()))
            .collect::<Result<_>>()?,
        _ => Vec::new(),
    };
    for w in 0..concurrency as u64 {
        let run_id = format!("load-{label}-c{concurrency}-w{w}");
        let failures = failures.clone();
        match target {
            Target::Fence(channels) => {
                let client = FenceEffects {
                    client: FenceClient::new(channels[w as usize % channels.len()].clone()),
                    run_id,
                    batch: batch.max(1) as u64,
                };
                tasks.push(tokio::spawn(worker(client, w, start, limit, failures)));
            }
            Target::FenceSession(_) | Target::FenceSharedSession(_) => {
                let client = SessionEffects {
                    session: match target {
                        Target::FenceSession(channels) => {
                            session_over(channels[w as usize % channels.len()].clone())?
                        }
                        _ => shared[w as usize % shared.len()].clone(),
                    },
                    run_id,
                    batch: batch.max(1) as u64,
                };
                tasks.push(tokio::spawn(worker(client, w, start, limit, failures)));
            }
            Target::Health(channels) => {
                let client = HealthChecks(tonic_health::pb::health_client::HealthClient::new(
                    channels[w as usize % channels.len()].clone(),
                ));
                tasks.push(tokio::spawn(worker(client, w, start, limit, failures)));
            }
            Target::SessionProbe(channels) => {
                let client =
                    SessionProbes::open(channels[w as usize % channels.len()].clone()).await?;
                tasks.push(tokio::spawn(worker(client, w, start, limit, failures)));
            }
            Target::Postgres(url) => {
                let client = pg_client(url).await?;
                let begin = client.prepare(PG_BEGIN).await?;
                let complete = client.prepare(PG_COMPLETE).await?;
                let c = PgEffects {
                    client,
                    batch: batch.max(1) as u64,
                    begin,
                    complete,
                    run_id,
                    schema: fence_server::canonical::IntentSchema::new(
                        &["ref".into(), "ts".into()],
                        &[],
                        fence_server::canonical::StringRule::Exact,
                    )?,
                };
                tasks.push(tokio::spawn(worker(c, w, start, limit, failures)));
            }
        }
    }
    // The host's steal over the measured window (read when it opens, and after the last
    // worker ended: a timed window ends with its last turn).
    let ticks_at_open = tokio::spawn(async move {
        tokio::time::sleep_until(limit.measure_from.into()).await;
        cpu_ticks()
    });
    let mut total = Measured::new(match budget {
        Budget::Timed { measure, .. } => measure,
        Budget::Turns(_) => Duration::ZERO,
    });
    for t in tasks {
        let m = t.await.context("worker task")??;
        total.ops += m.ops;
        total.hist.add(&m.hist)?;
    }
    total.steal = steal_between(ticks_at_open.await.ok().flatten(), cpu_ticks());
    if let Budget::Turns(_) = budget {
        total.window = start.elapsed();
    }
    let failed = failures.load(Ordering::Relaxed);
    if failed > 0 {
        bail!("{failed} effects failed during the measurement");
    }
    Ok(total)
}

/// When a worker measures and stops.
#[derive(Debug, Clone, Copy)]
struct Limit {
    measure_from: Instant,
    end: Option<Instant>,
    turns: u64,
}

async fn worker<C: EffectClient>(
    mut client: C,
    w: u64,
    start: Instant,
    limit: Limit,
    failures: Arc<AtomicU64>,
) -> Result<Measured> {
    tokio::time::sleep_until(start.into()).await;
    let mut m = Measured::new(limit.end.map_or(Duration::ZERO, |e| e - limit.measure_from));
    let mut n = 0u64;
    while n < limit.turns {
        let t = Instant::now();
        if limit.end.is_some_and(|end| t >= end) {
            break;
        }
        n += 1;
        if let Err(e) = client.effect(w, n).await {
            if failures.fetch_add(1, Ordering::Relaxed) < 5 {
                eprintln!("worker {w}: effect {n} failed: {e:#}");
            }
            continue;
        }
        if t >= limit.measure_from {
            m.hist.record(micros(t.elapsed()))?;
            m.ops += client.batch();
        }
    }
    Ok(m)
}

/// Fills the ledger in `data_dir` (the layout `fenced --data-dir` uses) with completed
/// effects, in-process through the real ledger, from `threads` threads at once. It is a bulk
/// load: writes skip the WAL sync, and before the store closes the memtables are flushed to
/// (synced) SST files and the whole range is compacted, so the records are on disk before
/// `fenced` opens them; what is measured afterwards is served with every write synced.
/// Effects go to runs of 1000 named after their number, so a preload can be continued from
/// where it stopped.
pub fn preload(data_dir: &Path, from: u64, to: u64, threads: usize) -> Result<Duration> {
    let config = fence_server::Config::with_data_dir(data_dir);
    let store = fence_server::store::StoreOptions {
        sync_writes: false,
        ..fence_server::server::store_options(&config)
    };
    let ledger = fence_server::server::open_ledger_with(&config, Arc::new(SystemClock), &store)
        .context("open the ledger")?;
    register_load_tool(&ledger)?;
    let next = AtomicU64::new(from);
    let started = Instant::now();
    let progress = AtomicU64::new(0);
    std::thread::scope(|s| -> Result<()> {
        let mut handles = Vec::new();
        for t in 0..threads.max(1) {
            let (ledger, next, progress) = (&ledger, &next, &progress);
            handles.push(s.spawn(move || -> Result<()> {
                loop {
                    // Each thread takes 1000 effects (one run) at a time.
                    let base = next.fetch_add(1000, Ordering::Relaxed);
                    if base >= to {
                        return Ok(());
                    }
                    let run_id = format!("preload-{:09}", base / 1000);
                    for n in base..(base + 1000).min(to) {
                        load_effect(ledger, &run_id, t as u64, n)?;
                    }
                    let done = progress.fetch_add(1000, Ordering::Relaxed) + 1000;
                    if done % 500_000 == 0 {
                        eprintln!(
                            "  preloaded {} effects ({:.0}/s)",
                            from + done,
                            done as f64 / started.elapsed().as_secs_f64()
                        );
                    }
                }
            }));
        }
        for h in handles {
            h.join()
                .map_err(|_| anyhow::anyhow!("a preload thread panicked"))??;
        }
        Ok(())
    })?;
    ledger.store().flush()?;
    // A bulk load writes far faster than a served store ever does; settle its compaction debt
    // here so that the measurement sees a store in its steady shape.
    fence_server::store::Store::compact(ledger.store())?;
    Ok(started.elapsed())
}

/// The ledger's own work per effect, in this process (no gRPC): a ledger opened over
/// `data_dir` as `fenced` opens it (every write synced), or over the in-memory store, the load
/// tool registered and `warmup` effects done, then `effects` begin+complete pairs in
/// [`measured_effects`]. Returns the wall time of the measured part. Run it under
/// `valgrind --tool=callgrind --collect-atstart=no --toggle-collect='*measured_effects*'` to
/// count the instructions of exactly the measured effects.
///
/// `group` > 1 decides the pairs `group` at a time in one deferred section, each on a run of
/// its own, as a sequencer decides the calls of that many agents between two syncs.
/// `caches` false turns the run and effect record caches and the index filters off.
pub fn ledger_effects(
    data_dir: Option<&Path>,
    warmup: u64,
    effects: u64,
    group: u64,
    caches: bool,
) -> Result<Duration> {
    let clock = Arc::new(SystemClock);
    match data_dir {
        Some(dir) => {
            let mut config = fence_server::Config::with_data_dir(dir);
            if !caches {
                config.cached_runs = 0;
                config.cached_effects = 0;
                config.filtered_index_entries = 0;
            }
            let ledger = fence_server::server::open_ledger(&config, clock)?;
            time_effects(&ledger, warmup, effects, group)
        }
        None => {
            let mut config = fence_server::ledger::LedgerConfig::default();
            if !caches {
                config.limits.max_cached_runs = 0;
                config.limits.max_cached_effects = 0;
                config.limits.max_filtered_index_entries = 0;
            }
            let ledger = fence_server::ledger::Ledger::new(
                fence_server::store::MemStore::new(),
                clock,
                config,
            );
            time_effects(&ledger, warmup, effects, group)
        }
    }
}

fn time_effects<S: fence_server::store::Store>(
    ledger: &fence_server::ledger::Ledger<S>,
    warmup: u64,
    effects: u64,
    group: u64,
) -> Result<Duration> {
    register_load_tool(ledger)?;
    effects_from(ledger, 1_000_000, warmup, group)?;
    let started = Instant::now();
    measured_effects(ledger, effects, group)?;
    Ok(started.elapsed())
}

/// The measured effects: the function a callgrind run toggles collection on (never inlined,
/// so its name stays in the binary; the warm-up calls `effects_from` outside it).
#[inline(never)]
pub fn measured_effects<S: fence_server::store::Store>(
    ledger: &fence_server::ledger::Ledger<S>,
    effects: u64,
    group: u64,
) -> Result<()> {
    effects_from(ledger, 0, effects, group)
}

/// `effects` begin+complete pairs through the ledger, numbered from `first`, 100 per run;
/// `group` > 1: `group` at a time on as many runs, as a sequencer sees them under load: each
/// deferred section decides one group's Begins after the Completes of the group before (an
/// agent completes an effect after its Begin was answered, so in a later group).
#[inline(never)]
fn effects_from<S: fence_server::store::Store>(
    ledger: &fence_server::ledger::Ledger<S>,
    first: u64,
    effects: u64,
    group: u64,
) -> Result<()> {
    if group <= 1 {
        for n in first..first + effects {
            let receipt = begin_effect(ledger, &format!("cost-{}", n / 100), 0, n)?;
            complete_effect(ledger, n, &receipt)?;
        }
        return Ok(());
    }
    let end = first + effects;
    let mut n = first;
    let mut begun: Vec<(u64, Box<EffectRecord>)> = Vec::new();
    while n < end || !begun.is_empty() {
        let upto = (n + group).min(end);
        let mut done = Ok(());
        let mut next = Vec::new();
        ledger.store().deferred(&mut || {
            done = begun
                .drain(..)
                .try_for_each(|(i, receipt)| complete_effect(ledger, i, &receipt))
                .and_then(|()| {
                    (n..upto).try_for_each(|i| {
                        let run = format!("cost-{}-{}", i % group, i / (100 * group));
                        next.push((i, begin_effect(ledger, &run, 0, i)?));
                        Ok(())
                    })
                });
        })?;
        done?;
        begun = next;
        n = upto;
    }
    Ok(())
}

/// CPU time a process has used, all its threads.
#[derive(Debug, Clone, Copy, Default)]
pub struct CpuTime {
    /// In user mode.
    pub user: Duration,
    /// In the kernel on its behalf.
    pub system: Duration,
}

impl CpuTime {
    /// User plus system.
    pub fn total(&self) -> Duration {
        self.user + self.system
    }
}

impl std::ops::Sub for CpuTime {
    type Output = CpuTime;
    fn sub(self, rhs: CpuTime) -> CpuTime {
        CpuTime {
            user: self.user.saturating_sub(rhs.user),
            system: self.system.saturating_sub(rhs.system),
        }
    }
}

/// CPU time (user and system) a process has used, all its threads, from `/proc/PID/stat`.
pub fn process_cpu(pid: u32) -> Result<CpuTime> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .with_context(|| format!("read /proc/{pid}/stat"))?;
    // Fields after the command name (which may hold spaces) start at field 3 (state).
    let rest = stat
        .rsplit_once(')')
        .map(|(_, r)| r)
        .context("malformed /proc stat")?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of the whole line: 11 and 12 after the state.
    let ticks = |i: usize| -> Result<Duration> {
        let t: u64 = fields
            .get(i)
            .and_then(|f| f.parse().ok())
            .context("malformed /proc stat times")?;
        // USER_HZ is 100 on every Linux ABI the server builds for.
        Ok(Duration::from_millis(t * 10))
    };
    Ok(CpuTime {
        user: ticks(11)?,
        system: ticks(12)?,
    })
}

/// Registers the load tool on an in-process ledger.
fn register_load_tool<S: fence_server::store::Store>(
    ledger: &fence_server::ledger::Ledger<S>,
) -> Result<()> {
    ledger.register_tool(
        TENANT,
        ToolDef {
            name: TOOL.into(),
            class: OpClass::NonRetryable.code(),
            volatile_fields: vec!["ref".into(), "ts".into()],
            ..Default::default()
        },
    )?;
    Ok(())
}

/// Effect `n` of `worker` on `run_id` through an in-process ledger: granted, then completed.
fn load_effect<S: fence_server::store::Store>(
    ledger: &fence_server::ledger::Ledger<S>,
    run_id: &str,
    worker: u64,
    n: u64,
) -> Result<()> {
    let receipt = begin_effect(ledger, run_id, worker, n)?;
    complete_effect(ledger, n, &receipt)
}

/// Begins effect `n` of `worker` on `run_id`; returns its receipt.
fn begin_effect<S: fence_server::store::Store>(
    ledger: &fence_server::ledger::Ledger<S>,
    run_id: &str,
    worker: u64,
    n: u64,
) -> Result<Box<EffectRecord>> {
    let cmd = BeginCmd {
        run_id: run_id.to_owned(),
        tool: TOOL.into(),
        step_key: format!("s{n}"),
        arguments_json: arguments(worker, n),
        ..Default::default()
    };
    let Decision::Execute { receipt, .. } = ledger.begin(TENANT, &cmd)?.decision else {
        bail!("expected a grant for effect {n}");
    };
    Ok(receipt)
}

/// Completes effect `n`, granted as `receipt`.
fn complete_effect<S: fence_server::store::Store>(
    ledger: &fence_server::ledger::Ledger<S>,
    n: u64,
    receipt: &EffectRecord,
) -> Result<()> {
    ledger.complete(
        TENANT,
        &receipt.id().to_string(),
        receipt.attempt,
        0,
        LedgerOutcome::Completed(format!("tx-{n}").into_bytes()),
    )?;
    Ok(())
}

/// Bytes under `path` (recursively).
pub fn disk_usage(path: &Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(path) else {
        return 0;
    };
    entries
        .flatten()
        .map(|e| match e.metadata() {
            Ok(m) if m.is_dir() => disk_usage(&e.path()),
            Ok(m) => m.len(),
            Err(_) => 0,
        })
        .sum()
}

/// An in-process Fence server over `data_dir`, exactly as `fenced` wires the ledger and the
/// service, except that accepted connections get `TCP_NODELAY`. It exists to measure what
/// that one socket option changes; the numbers reported as Fence's come from `fenced`.
pub struct InProcess {
    /// `http://127.0.0.1:PORT`.
    pub url: String,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<()>,
}

impl InProcess {
    /// Starts it.
    pub async fn start(data_dir: &Path, nodelay: bool) -> Result<Self> {
        use fence_proto::v1::fence_server::FenceServer;
        use fence_server::auth::Auth;
        use fence_server::service::FenceService;
        use tonic::service::interceptor::InterceptedService;

        let config = fence_server::Config::with_data_dir(data_dir);
        let ledger = Arc::new(
            tokio::task::spawn_blocking(move || {
                fence_server::server::open_ledger(&config, Arc::new(SystemClock))
            })
            .await??,
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let url = format!("http://{}", listener.local_addr()?);
        let incoming =
            tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(nodelay));
        let (health, health_service) = tonic_health::server::health_reporter();
        health
            .set_serving::<FenceServer<FenceService<fence_server::store::RocksStore>>>()
            .await;
        let auth = Auth::Dev;
        let fence =
            InterceptedService::new(FenceServer::new(FenceService::new(ledger)), move |req| {
                auth.authenticate(req)
            });
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            let served = tonic::transport::Server::builder()
                .add_service(health_service)
                .add_service(fence)
                .serve_with_incoming_shutdown(incoming, async {
                    let _ = rx.await;
                })
                .await;
            if let Err(e) = served {
                eprintln!("in-process server: {e}");
            }
        });
        Ok(Self {
            url,
            stop: Some(tx),
            task,
        })
    }

    /// Stops it and waits until the store is closed.
    pub async fn stop(mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        let _ = (&mut self.task).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_hosts_steal_is_read_from_proc_stat() {
        let stat =
            "cpu  2028988 0 281848 601126 79718 0 25972 37881 0 0\ncpu0 1 2 3 4 5 6 7 8 0 0\n";
        let (steal, all) = parse_cpu_ticks(stat).unwrap();
        assert_eq!(steal, 37881);
        assert_eq!(all, 2028988 + 281848 + 601126 + 79718 + 25972 + 37881);
        assert_eq!(parse_cpu_ticks("intr 1 2 3"), None);
        assert_eq!(parse_cpu_ticks("cpu  1 2 3"), None, "too few fields");
        let share = steal_between(Some((10, 1000)), Some((60, 2000))).unwrap();
        assert!((share - 0.05).abs() < 1e-12, "{share}");
        assert_eq!(steal_between(Some((10, 1000)), Some((10, 1000))), None);
        assert_eq!(steal_between(None, Some((10, 1000))), None);
        #[cfg(target_os = "linux")]
        assert!(cpu_ticks().is_some());
    }

    /// Every wake-up of a thread puts it on a CPU once more, and a process counts all of its
    /// threads' (other test threads may end meanwhile, so the sum is checked against this
    /// thread's own count, which is part of it).
    #[cfg(target_os = "linux")]
    #[test]
    fn a_process_counts_its_threads_wake_ups() {
        let own = || {
            schedstat_slices(&std::fs::read_to_string("/proc/thread-self/schedstat").unwrap())
                .unwrap()
        };
        let before = own();
        for _ in 0..20 {
            std::thread::sleep(Duration::from_millis(1));
        }
        let after = own();
        assert!(after >= before + 20, "{before} -> {after}");
        let all = process_slices(std::process::id()).expect("schedstat on Linux");
        assert!(all >= after, "{all} < {after}");
        assert_eq!(process_slices(u32::MAX), None, "no such process");
    }

    #[test]
    fn a_threads_cpu_time_is_read_in_nanoseconds() {
        assert_eq!(
            parse_schedstat("1770329 383689 3\n"),
            Some(Duration::from_nanos(1_770_329))
        );
        assert_eq!(parse_schedstat(""), None);
        assert_eq!(parse_schedstat("x 1 2"), None);
        assert_eq!(schedstat_slices("1770329 383689 3\n"), Some(3));
        assert_eq!(schedstat_slices("1770329 383689"), None);
        #[cfg(target_os = "linux")]
        {
            // The reading grows while the thread computes (bounded by the wall clock, so a
            // reading that never moves fails instead of spinning forever).
            let before = thread_cpu().expect("schedstat on Linux");
            let spin = Instant::now();
            let mut x = 0u64;
            let mut spent = Duration::ZERO;
            while spent < Duration::from_millis(5) && spin.elapsed() < Duration::from_secs(10) {
                for _ in 0..10_000 {
                    x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(7));
                }
                spent = thread_cpu().unwrap() - before;
            }
            assert!(spent >= Duration::from_millis(5), "{spent:?}");
        }
    }

    /// The floor loop times every sync and says what CPU each cost.
    #[test]
    fn the_fdatasync_floor_measures_latency_and_cpu() {
        let dir = tempfile::tempdir().unwrap();
        for preallocated in [false, true] {
            let floor = fdatasync_floor(dir.path(), 20, preallocated).unwrap();
            assert_eq!(floor.latency.ops, 20);
            assert_eq!(floor.latency.hist.len(), 20);
            #[cfg(target_os = "linux")]
            assert!(floor.cpu_per_op.unwrap() > Duration::ZERO);
        }
        assert_eq!(
            std::fs::read_dir(dir.path()).unwrap().count(),
            0,
            "file removed"
        );
    }

    /// The echo floor times every measured round trip and says what the echo side cost.
    #[test]
    fn the_tcp_echo_floor_measures_round_trips_and_the_echo_threads_cpu() {
        let floor = tcp_echo_floor(200).unwrap();
        assert_eq!(floor.latency.ops, 200);
        assert_eq!(floor.latency.hist.len(), 200);
        assert!(floor.latency.window > Duration::ZERO);
        #[cfg(target_os = "linux")]
        assert!(floor.cpu_per_op.unwrap() > Duration::ZERO);
    }

    /// Every transport of the load generator does its effects against a real server: a
    /// closed loop of a fixed number of turns, none failing (`run_loop` fails on any).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn every_fence_transport_completes_its_effects() {
        let dir = tempfile::tempdir().unwrap();
        let server = InProcess::start(dir.path(), true).await.unwrap();
        let mut channels = Vec::new();
        for _ in 0..2 {
            let endpoint = tonic::transport::Endpoint::from_shared(server.url.clone()).unwrap();
            channels.push(endpoint.connect().await.unwrap());
        }
        register_tool(channels[0].clone()).await.unwrap();
        for transport in [
            FenceTransport::Unary,
            FenceTransport::Session,
            FenceTransport::SharedSession,
        ] {
            let target = Target::fence(channels.clone(), transport);
            let label = format!("{transport:?}");
            let m = run_loop(&target, &label, 6, 1, Budget::Turns(15)).await;
            let m = m.unwrap_or_else(|e| panic!("{}: {e:#}", transport.label()));
            assert_eq!(m.ops, 6 * 15, "{}", transport.label());
        }
        // The RPC stack's ceilings on the same server: every turn answered as expected
        // (a probe answered with anything but its refusal fails the loop).
        for (name, target) in [
            ("health", Target::Health(channels.clone())),
            ("session probe", Target::SessionProbe(channels.clone())),
        ] {
            let m = run_loop(&target, name, 6, 1, Budget::Turns(15)).await;
            let m = m.unwrap_or_else(|e| panic!("{name}: {e:#}"));
            assert_eq!(m.ops, 6 * 15, "{name}");
            // The floor's round trips: only the measured ones counted.
            let m = round_trips(&target, 20).await;
            let m = m.unwrap_or_else(|e| panic!("{name} round trips: {e:#}"));
            assert_eq!((m.ops, m.hist.len()), (20, 20), "{name}");
        }
        server.stop().await;
    }

    /// A preload writes no WAL and relies on its flush: what it loaded must be there, and
    /// answered as recorded, when the data dir is opened as `fenced` opens it.
    #[test]
    fn a_preloaded_store_replays_what_it_loaded_after_reopening() {
        let dir = tempfile::tempdir().unwrap();
        preload(dir.path(), 0, 2_500, 1).unwrap();
        let config = fence_server::Config::with_data_dir(dir.path());
        let ledger = fence_server::server::open_ledger(&config, Arc::new(SystemClock)).unwrap();
        for n in [0, 999, 1_000, 2_499] {
            let cmd = BeginCmd {
                run_id: format!("preload-{:09}", n / 1000),
                tool: TOOL.into(),
                step_key: format!("s{n}"),
                arguments_json: arguments(0, n),
                ..Default::default()
            };
            let decision = ledger.begin(TENANT, &cmd).unwrap().decision;
            assert_eq!(decision.kind(), "replay", "effect {n}");
        }
        // A preload continued from where it stopped adds to the same store.
        drop(ledger);
        preload(dir.path(), 2_500, 3_000, 1).unwrap();
        let ledger = fence_server::server::open_ledger(&config, Arc::new(SystemClock)).unwrap();
        let cmd = BeginCmd {
            run_id: "preload-000000002".into(),
            tool: TOOL.into(),
            step_key: "s2999".into(),
            arguments_json: arguments(0, 2_999),
            ..Default::default()
        };
        assert_eq!(
            ledger.begin(TENANT, &cmd).unwrap().decision.kind(),
            "replay"
        );
    }
}
