//! Configuration: flags, each with an environment variable, and defaults that run a working
//! single-node service out of the box (data in `./fence-data`).

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::Parser;

/// `fenced` settings.
#[derive(Debug, Clone, Parser)]
#[command(
    name = "fenced",
    version,
    about = "Fence: make AI agents' side effects happen exactly once"
)]
pub struct Config {
    /// Address to listen on (port 0 picks a free port; the bound address is printed).
    #[arg(long, env = "FENCE_LISTEN", default_value = "127.0.0.1:50051")]
    pub listen: SocketAddr,

    /// Directory of the RocksDB ledger (created if missing).
    #[arg(long, env = "FENCE_DATA_DIR", default_value = "fence-data")]
    pub data_dir: PathBuf,

    /// Directory for the ledger's write-ahead log instead of `<data-dir>/ledger` (created if
    /// missing), typically on a separate device: every acknowledged write waits for a sync of
    /// this log, and on a shared disk those syncs queue behind the table files that flushes
    /// and compactions write. At the first start with it an existing ledger is flushed and
    /// its log moves there; from then on the ledger refuses to start without it, and the
    /// directory serves that one ledger only. A directory moved elsewhere is found again
    /// by the id in its `FENCE-WAL-OWNER` file.
    #[arg(long, env = "FENCE_WAL_DIR")]
    pub wal_dir: Option<PathBuf>,

    /// Default lease of a grant, in milliseconds.
    #[arg(long, env = "FENCE_LEASE_MS", default_value_t = 30_000)]
    pub lease_ms: u64,

    /// Longest lease a call may ask for, in milliseconds.
    #[arg(long, env = "FENCE_MAX_LEASE_MS", default_value_t = 86_400_000)]
    pub max_lease_ms: u64,

    /// Default retention of finished effects before they become tombstones, in milliseconds.
    #[arg(long, env = "FENCE_RETENTION_MS", default_value_t = 604_800_000)]
    pub retention_ms: u64,

    /// At most how many hours after its retention window a finished effect's payload stays on
    /// disk: the store compacts every table file again at least this often, and compaction
    /// makes each record past its window a tombstone (RocksDB's periodic compaction). Reads
    /// show the tombstone at once either way. Shorter rewrites the store more often; 0 leaves
    /// it to RocksDB (30 days).
    #[arg(long, env = "FENCE_RETENTION_COMPACTION_HOURS", default_value_t = 24)]
    pub retention_compaction_hours: u64,

    /// How often the background pass runs, in milliseconds: it recounts the open-effect
    /// gauges and drains the expiry index that data dirs written before format 7 hold.
    #[arg(long, env = "FENCE_SWEEP_INTERVAL_MS", default_value_t = 60_000)]
    pub sweep_interval_ms: u64,

    /// After SIGTERM or SIGINT, how long in-flight calls may drain (milliseconds) before
    /// `fenced` exits anyway. A client that never reads its answers would otherwise hold the
    /// shutdown forever; exiting loses nothing acknowledged (every answer follows its sync).
    #[arg(long, env = "FENCE_SHUTDOWN_GRACE_MS", default_value_t = 10_000)]
    pub shutdown_grace_ms: u64,

    /// File holding the 32-byte secret that keys credential hashes. Default:
    /// `<data-dir>/credential.key`, generated on first start.
    #[arg(long, env = "FENCE_CREDENTIAL_KEY_FILE")]
    pub credential_key_file: Option<PathBuf>,

    /// Bearer tokens file (`<tenant> <blake3-hex-of-token> [revoked]` per line). Without it the
    /// server runs in dev mode: no authentication, tenant from `x-fence-tenant`.
    #[arg(long, env = "FENCE_AUTH_TOKENS_FILE")]
    pub auth_tokens_file: Option<PathBuf>,

    /// PEM certificate chain for TLS. With `--tls-key`, the server accepts only TLS.
    #[arg(long, env = "FENCE_TLS_CERT", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,

    /// PEM private key for TLS.
    #[arg(long, env = "FENCE_TLS_KEY", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,

    /// PEM CA bundle: when set, clients must present a certificate it signed (mutual TLS).
    #[arg(long, env = "FENCE_TLS_CLIENT_CA", requires = "tls_cert")]
    pub tls_client_ca: Option<PathBuf>,

    /// Sustained requests per second allowed per tenant (0 = unlimited).
    #[arg(long, env = "FENCE_TENANT_RATE_LIMIT", default_value_t = 0)]
    pub tenant_rate_limit: u32,

    /// Burst size of the per-tenant rate limit (0 = one second's worth).
    #[arg(long, env = "FENCE_TENANT_BURST", default_value_t = 0)]
    pub tenant_burst: u32,

    /// Maximum bytes of a call's JSON arguments.
    #[arg(long, env = "FENCE_MAX_ARGUMENTS_BYTES", default_value_t = 1 << 20)]
    pub max_arguments_bytes: usize,

    /// Maximum bytes of a result.
    #[arg(long, env = "FENCE_MAX_RESULT_BYTES", default_value_t = 4 << 20)]
    pub max_result_bytes: usize,

    /// Maximum effects recorded in one run.
    #[arg(long, env = "FENCE_MAX_EFFECTS_PER_RUN", default_value_t = 1_000_000)]
    pub max_effects_per_run: u64,

    /// Maximum calls in one BeginBatch or CompleteBatch.
    #[arg(long, env = "FENCE_MAX_BATCH_CALLS", default_value_t = 128)]
    pub max_batch_calls: usize,

    /// Calls of one Session stream decided at once; the server reads no further calls of that
    /// stream until one is answered (flow control holds them), which bounds what one stream
    /// can make the server buffer.
    #[arg(long, env = "FENCE_MAX_SESSION_IN_FLIGHT", default_value_t = 256)]
    pub max_session_in_flight: usize,

    /// Runs whose decoded record is kept between their decisions (about a kilobyte each); 0
    /// turns the cache off. The cache is emptied when it is full.
    #[arg(long, env = "FENCE_CACHED_RUNS", default_value_t = 65_536)]
    pub cached_runs: usize,

    /// Effects just begun whose decoded record is kept for their Complete (at most 4 KiB
    /// each); 0 turns the cache off. The cache is emptied when it is full.
    #[arg(long, env = "FENCE_CACHED_EFFECTS", default_value_t = 16_384)]
    pub cached_effects: usize,

    /// Step key and intent index entries summarised in memory (all runs together, about 20
    /// bytes each at most), so that a Begin skips the lookups of a step key or intent its run
    /// never had; 0 turns the summaries off. They are dropped when this is exceeded.
    #[arg(long, env = "FENCE_FILTERED_INDEX_ENTRIES", default_value_t = 2 << 20)]
    pub filtered_index_entries: usize,

    /// Write-ahead log written ahead at start, in MiB (about one memtable's worth), into two
    /// files, so that the first two memtables' syncs overwrite a file instead of growing it: a
    /// sync that grows a file also writes its inode, about a third more per acknowledged write
    /// on ext4. Later WAL files reuse old ones anyway. 0 turns it off (a data dir then holds
    /// twice this much less).
    #[arg(long, env = "FENCE_WAL_PRIME_MB", default_value_t = 64)]
    pub wal_prime_mb: u64,

    /// How table files are compressed: `lz4-zstd` (LZ4 while records are still being
    /// compacted, ZSTD at the last level, where most of them end up: about 2.2x less disk
    /// than `none`), `lz4` (about 1.8x), or `none`. Files already written keep theirs until
    /// compaction rewrites them; every setting reads them all.
    #[arg(long, env = "FENCE_COMPRESSION", value_enum, default_value_t = crate::store::Compression::Lz4Zstd)]
    pub compression: crate::store::Compression,

    /// RocksDB block cache, in MiB.
    #[arg(long, env = "FENCE_BLOCK_CACHE_MB", default_value_t = 128)]
    pub block_cache_mb: usize,

    /// RocksDB memtable size, in MiB: what is written is held in this many (two at most, one
    /// being flushed) before it goes to a table file. Smaller ones make each write's insert
    /// cheaper (a shallower skip list) and flush more often. At least 1 (0 is taken as 1).
    #[arg(long, env = "FENCE_MEMTABLE_MB", default_value_t = 64)]
    pub memtable_mb: usize,

    /// Allocate the memtable in huge pages of this many MiB (2 on x86-64), 0 for ordinary
    /// pages. The pages must be reserved first (`sysctl vm.nr_hugepages=N`, about
    /// 2 x --memtable-mb / page size of them); where none are free the memtable takes ordinary
    /// memory. Under load a memtable insert misses the TLB at most levels of its skip list:
    /// huge pages took about a tenth off the CPU per effect at concurrency 64.
    #[arg(long, env = "FENCE_MEMTABLE_HUGE_PAGE_MB", default_value_t = 0)]
    pub memtable_huge_page_mb: usize,

    /// Concurrent requests (HTTP/2 streams) one connection may have open; more wait. With
    /// --max-page-bytes, this bounds what one connection that never reads its responses can
    /// make the server buffer (about streams x 6 x page bytes, measured).
    #[arg(long, env = "FENCE_MAX_STREAMS_PER_CONNECTION", default_value_t = 64)]
    pub max_streams_per_connection: u32,

    /// Bytes of stored records one listing page (ListEffects, ListRuns, ListTools) holds at
    /// most; a page ends before it would pass them (one record always fits, so a page may hold
    /// one larger record).
    #[arg(long, env = "FENCE_MAX_PAGE_BYTES", default_value_t = 1 << 20)]
    pub max_page_bytes: usize,

    /// Serve Prometheus metrics at http://ADDR/metrics (an admin listener, plain HTTP: keep it
    /// off public interfaces). Off by default; port 0 picks a free port, printed on stdout as
    /// "fenced metrics on ADDR".
    #[arg(long, env = "FENCE_METRICS_LISTEN")]
    pub metrics_listen: Option<SocketAddr>,

    /// Export one OpenTelemetry span per RPC over OTLP/gRPC to this collector (e.g.
    /// http://127.0.0.1:4317), with the decision, reason, tool, class and effect id as
    /// attributes and the caller's `traceparent` as parent. Off by default. The SDK's
    /// `OTEL_*` variables tune the export (e.g. `OTEL_BSP_SCHEDULE_DELAY`).
    #[arg(long, env = "FENCE_OTLP_ENDPOINT")]
    pub otlp_endpoint: Option<String>,

    /// Sequencer threads: the decisions that write (Begin, Complete, Heartbeat and their
    /// batches) are committed in groups, one WAL sync per group, by this many threads, each
    /// owning the runs that hash to it. 0 = half the cores (at least one).
    #[arg(long, env = "FENCE_SEQUENCERS", default_value_t = 0)]
    pub sequencers: usize,

    /// Decide and commit a lone request on the thread that received it, when its sequencer is
    /// idle and its last group was a lone request too: at low concurrency a request then
    /// costs no hand-off to the sequencer thread and none back. Under load every request is
    /// queued to its sequencer either way. At most one less thread than the runtime's workers
    /// does so at once (none with one worker). `false` always queues.
    #[arg(long, env = "FENCE_INLINE_COMMIT", default_value_t = true, action = clap::ArgAction::Set)]
    pub inline_commit: bool,
}

impl Config {
    /// The settings with every default, for `data_dir` (tests and embedding).
    pub fn with_data_dir(data_dir: impl Into<PathBuf>) -> Self {
        let mut c = Self::parse_from(["fenced"]);
        c.data_dir = data_dir.into();
        c
    }
}
