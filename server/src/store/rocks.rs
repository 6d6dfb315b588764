//! The embedded [`Store`]: RocksDB with one column family, written through a commit pipeline.
//!
//! Durable writes are staged in memory and made durable in rounds, one RocksDB write and one
//! WAL sync per round ([`pipeline`](super::pipeline)): RocksDB itself holds only durable
//! data, and reads consult the staged writes first. A sequencer's group
//! ([`Store::deferred_then`]) is one round. Intent index scans, one per Begin, go through a prefix filter (see
//! [`INTENT_PREFIX_EXTRACTOR`]).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, RwLock};

use rocksdb::{
    BlockBasedIndexType, BlockBasedOptions, Cache, ColumnFamilyDescriptor, DB, DBCompressionType,
    Direction, IteratorMode, Options, ReadOptions, WriteBatch, WriteOptions,
};

use super::pipeline::{self, Pipeline};
use super::wal_dir::{self, Placement};
use super::{Batch, Compression, Entries, Op, Rewrite, Store, StoreError, Then};

/// The column family holding every ledger record (keys are self-describing by their prefix).
pub const LEDGER_CF: &str = "ledger";

/// Tuning for [`RocksStore::open`].
#[derive(Debug, Clone)]
pub struct StoreOptions {
    /// Block cache size in bytes.
    pub block_cache_bytes: usize,
    /// Memtable size in bytes (RocksDB's `write_buffer_size`).
    pub memtable_bytes: usize,
    /// The size of the huge pages the memtable is allocated in (RocksDB's
    /// `memtable_huge_page_size`), or 0 for ordinary pages. The pages must be reserved by the
    /// administrator (`vm.nr_hugepages`); where none are free RocksDB allocates ordinary memory
    /// instead, so this never fails an open.
    pub memtable_huge_page_bytes: usize,
    /// Sync the WAL before a write returns. Only a bulk load that closes the store before
    /// anything is served may turn this off: an unsynced write can be lost to a machine
    /// crash, and nothing served from this store may depend on one. Without it writes go
    /// straight to RocksDB, past the commit pipeline, and write no WAL: they are durable
    /// once the store is flushed ([`RocksStore::flush`]) or closed.
    pub sync_writes: bool,
    /// Bytes of write-ahead log written ahead at open into each of two files (see
    /// [`RocksStore::open`]), so that the syncs of this process's first two memtables
    /// overwrite space a file already has instead of growing it. 0 turns it off.
    pub wal_prime_bytes: u64,
    /// How table files are compressed.
    pub compression: Compression,
    /// A directory for the write-ahead log instead of the store's own (typically on another
    /// device): see [`wal_dir`](super::wal_dir) for how a store is tied to it. `None` keeps
    /// the log where it is; a store whose log was moved refuses to open without its directory.
    pub wal_dir: Option<PathBuf>,
    /// What compaction rewrites (the ledger's retention, see [`Rewrite`]); `None` keeps every
    /// value as written.
    pub rewrite: Option<Rewrite>,
    /// Seconds after which a table file is compacted again even if no write overlaps it
    /// (RocksDB's `periodic_compaction_seconds`), so that the rewrite reaches every value
    /// within this much of being due. 0 leaves it to RocksDB (30 days with a rewrite).
    pub rewrite_within_secs: u64,
}

impl Default for StoreOptions {
    fn default() -> Self {
        Self {
            block_cache_bytes: 128 << 20,
            memtable_bytes: 64 << 20,
            memtable_huge_page_bytes: 0,
            sync_writes: true,
            wal_prime_bytes: 0,
            compression: Compression::default(),
            wal_dir: None,
            rewrite: None,
            rewrite_within_secs: 86_400,
        }
    }
}

/// RocksDB behind the [`Store`] seam.
///
/// After a failed write (disk full, read-only filesystem, I/O error) RocksDB may stay in a
/// background-error state that only reopening clears. The store then reopens on the next call:
/// while the trouble lasts every call fails with [`StoreError::Engine`] (UNAVAILABLE), and once
/// space returns it recovers without a restart. A round is one WAL record, so a failed write
/// applied all or nothing.
pub struct RocksStore {
    /// Boxed: the store is moved around by value, and its pipeline's state is large.
    engine: Box<Engine>,
}

/// The database and what serves it.
struct Engine {
    db: RwLock<Option<DB>>,
    needs_reopen: AtomicBool,
    path: PathBuf,
    opts: StoreOptions,
    pipeline: Pipeline,
    /// What RocksDB's recovery dropped at the last open (see [`RocksStore::recovery_losses`]).
    losses: Mutex<Vec<String>>,
    /// True while the database is open read-only because it could not be reopened for
    /// writing: reads are served, writes retry the reopen.
    read_only: AtomicBool,
    /// Opened with [`RocksStore::open_read_only`]: never reopened for writing.
    inspect_only: bool,
    /// Where the write-ahead log is, and the lock on its directory if it is not `path`.
    /// Declared after `db`: fields drop in order, so the lock outlives the open database.
    wal: Placement,
}

impl std::fmt::Debug for RocksStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RocksStore")
            .field("path", &self.engine.path)
            .finish()
    }
}

impl Drop for RocksStore {
    fn drop(&mut self) {
        // Audit writes wait for the next round; there is none after this one.
        let _ = self.engine.pipeline.flush(self.engine.as_ref());
    }
}

fn engine(e: rocksdb::Error) -> StoreError {
    StoreError::Engine(e.into_string())
}

/// The one way every transition is written: WAL on, fsync before returning (unless a bulk
/// load said otherwise).
fn write_options(sync: bool) -> WriteOptions {
    let mut w = WriteOptions::default();
    w.set_sync(sync);
    w.disable_wal(false);
    w
}

/// A bulk load's writes (`sync_writes` off): no WAL at all. Its store is flushed to synced
/// SST files before anything is served from it (see [`StoreOptions::sync_writes`]), so a
/// log would only be written, never read; without it the load does no write system call
/// per batch.
fn bulk_write_options() -> WriteOptions {
    let mut w = WriteOptions::default();
    w.set_sync(false);
    w.disable_wal(true);
    w
}

fn open_db(path: &Path, opts: &StoreOptions, wal: Option<&Path>) -> Result<DB, StoreError> {
    let (mut db_opts, cfs) = db_options(opts)?;
    if let Some(wal) = wal {
        db_opts.set_wal_dir(wal);
    }
    DB::open_cf_descriptors(&db_opts, path, cfs).map_err(|e| opening(path, e.into_string()))
}

/// An open's error, said plainly where it is the usual one: the store is open already.
/// RocksDB locks the store's `LOCK` file for as long as one process has it open for writing
/// (another process gets `While lock file: <LOCK>: ...`, this one `lock hold by current
/// process, ...: <LOCK>`), which is what lets the ledger cache what it reads. Other failures
/// on the file (`While open a file for lock`: permissions, a full disk) keep their own words.
fn opening(path: &Path, message: String) -> StoreError {
    let lock = path.join("LOCK");
    let held = message.contains("While lock file") || message.contains("lock hold by current");
    if held && message.contains(&*lock.to_string_lossy()) {
        return StoreError::Engine(format!(
            "{} is already open (its lock file {} is held): one process serves a data dir at a \
             time; stop the process that has it open, or give this one a data dir of its own \
             (RocksDB: {message})",
            path.display(),
            lock.display(),
        ));
    }
    StoreError::Engine(message)
}

/// The database read-only: what serves reads while it cannot be opened for writing (a full
/// disk: opening writes a new WAL and manifest). It recovers the WAL into memory, writes
/// nothing, and refuses every write.
fn open_db_read_only(
    path: &Path,
    opts: &StoreOptions,
    wal: Option<&Path>,
) -> Result<DB, StoreError> {
    let (mut db_opts, cfs) = db_options(opts)?;
    if let Some(wal) = wal {
        db_opts.set_wal_dir(wal);
    }
    DB::open_cf_descriptors_read_only(&db_opts, path, cfs, false).map_err(engine)
}

/// Opens the store in `path` as it is (its log in its own directory), flushes every memtable
/// and closes it: afterwards its WAL holds nothing a table file does not, so the log can move.
fn flush_for_wal_move(path: &Path, opts: &StoreOptions) -> Result<(), StoreError> {
    let db = open_db(path, opts, None)?;
    let cf = cf(&db);
    db.flush_cf(cf).map_err(engine)?;
    db.flush().map_err(engine)?;
    for property in [
        "rocksdb.num-entries-active-mem-table",
        "rocksdb.num-entries-imm-mem-tables",
    ] {
        let left = db.property_int_value_cf(cf, property).map_err(engine)?;
        if left != Some(0) {
            return Err(StoreError::Engine(format!(
                "moving the write-ahead log: {property} is {left:?} after a flush"
            )));
        }
    }
    drop(db);
    Ok(())
}

fn db_options(opts: &StoreOptions) -> Result<(Options, Vec<ColumnFamilyDescriptor>), StoreError> {
    let mut db_opts = Options::default();
    db_opts.create_if_missing(true);
    db_opts.create_missing_column_families(true);
    // Two cores: one flush and one compaction thread, not RocksDB's default of one job.
    db_opts.increase_parallelism(2);
    db_opts.set_max_background_jobs(2);
    // Let the WAL write of one group overlap the memtable insert of the previous one.
    db_opts.set_enable_pipelined_write(true);
    // Recycle WAL files instead of creating new ones: fewer metadata fsyncs per segment. A
    // bulk load writes no WAL, which RocksDB allows only without recycling.
    db_opts.set_recycle_log_file_num(if opts.sync_writes { 4 } else { 0 });

    let mut table = BlockBasedOptions::default();
    // Most ledger reads are point lookups of keys that do not exist yet (a new step key, a
    // new intent): a bloom filter answers those without touching data blocks.
    table.set_bloom_filter(10.0, false);
    // Keep index and filter blocks in the cache so memory is bounded by one knob.
    table.set_cache_index_and_filter_blocks(true);
    table.set_pin_l0_filter_and_index_blocks_in_cache(true);
    // Partition them into 4 KiB blocks under a small pinned top level. A whole-file index or
    // filter of a 64 MiB table is about a megabyte: larger than a block-cache shard's fair
    // share, so data blocks kept evicting it and every lookup re-read and re-checksummed a
    // megabyte (finding F8 in docs/BENCHMARKS.md: latency tripled by 1M stored effects).
    table.set_index_type(BlockBasedIndexType::TwoLevelIndexSearch);
    table.set_partition_filters(true);
    table.set_metadata_block_size(4096);
    table.set_pin_top_level_index_and_filter(true);
    table.set_block_cache(&Cache::new_lru_cache(opts.block_cache_bytes));
    let mut cf_opts = Options::default();
    cf_opts.set_block_based_table_factory(&table);
    cf_opts.set_write_buffer_size(opts.memtable_bytes.max(1 << 20));
    // Under load an insert descends a skip list spread over the whole memtable, a TLB miss at
    // most levels with 4 KiB pages; huge pages took a tenth off `fenced`'s CPU per effect at
    // concurrency 64 (docs/BENCHMARKS.md).
    if opts.memtable_huge_page_bytes > 0 {
        cf_opts.set_memtable_huge_page_size(opts.memtable_huge_page_bytes);
    }
    // Set either way: RocksDB's own default is LZ4 when it is built in.
    let (upper, last) = match opts.compression {
        Compression::None => (DBCompressionType::None, DBCompressionType::None),
        Compression::Lz4 => (DBCompressionType::Lz4, DBCompressionType::Lz4),
        Compression::Lz4Zstd => (DBCompressionType::Lz4, DBCompressionType::Zstd),
    };
    cf_opts.set_compression_type(upper);
    cf_opts.set_bottommost_compression_type(last);
    // The same for the memtable: a bloom filter over its whole keys answers a lookup of a key
    // it does not hold without searching its skip list (a binary search over hundreds of
    // thousands of keys that shared long prefixes was a fifth of fenced's CPU under load).
    // Its size is this fraction of the memtable's: 2% is about 27 bits per key for the
    // 400,000 entries a 64 MiB memtable holds here, which misses far under 1% of absent keys.
    // It is allocated and zeroed by the write that switches memtables, while every writer
    // waits: at 10% (6.7 MB) that was 4 ms of page faults per switch, a share of c=64's p99.
    cf_opts.set_memtable_prefix_bloom_ratio(MEMTABLE_BLOOM_RATIO);
    cf_opts.set_memtable_whole_key_filtering(true);
    // Every Begin scans its intent's index prefix, almost always to find nothing (a new
    // intent). Without a prefix filter that scan seeks the memtable's skip list and the index
    // of every table file: a tenth of fenced's CPU under load. With this extractor the
    // filters also hold intent prefixes, so such a scan is answered by them.
    cf_opts.set_prefix_extractor(rocksdb::SliceTransform::create(
        INTENT_PREFIX_EXTRACTOR,
        intent_prefix,
        Some(is_intent_key),
    ));
    // Keys under a run start with kind and run key. A group's writes land one or a few per
    // run, scattered over a memtable of hundreds of thousands of keys, so each insert
    // searched the skip list from its top level through cold cache lines: a third of the
    // sequencer's CPU under load. With this hint RocksDB keeps, for each prefix (see
    // [`INSERT_HINT_PREFIX_LEN`]), the place it last inserted at and starts the next insert
    // of that prefix from there. The C API has no setter for it; the options string is
    // RocksDB's documented way in. It applies to single-writer memtable inserts, which is how
    // the commit pipeline writes. Each hint (about 250 bytes) lives in its memtable and goes
    // with it at the flush: at most one per key, so memory stays bounded by the memtable size
    // as before.
    let cf_opts = cf_opts
        .get_options_from_string(format!(
            "memtable_insert_with_hint_prefix_extractor=rocksdb.FixedPrefix.{INSERT_HINT_PREFIX_LEN}"
        ))
        .map_err(engine)?;

    let mut cf_opts = cf_opts;
    if let Some(rewrite) = &opts.rewrite {
        cf_opts.set_compaction_filter_factory(RewriteFactory(rewrite.clone()));
        if opts.rewrite_within_secs > 0 {
            cf_opts.set_periodic_compaction_seconds(opts.rewrite_within_secs);
        }
    }

    let cfs = vec![ColumnFamilyDescriptor::new(LEDGER_CF, cf_opts)];
    Ok((db_opts, cfs))
}

/// The name RocksDB logs and records in its OPTIONS file for the rewrite's filter.
const REWRITE_NAME: &std::ffi::CStr = c"fence.rewrite";

/// Makes a [`RewriteFilter`] for each compaction (RocksDB runs one filter per compaction job,
/// on that job's thread).
struct RewriteFactory(Rewrite);

impl rocksdb::compaction_filter_factory::CompactionFilterFactory for RewriteFactory {
    type Filter = RewriteFilter;

    fn create(
        &mut self,
        _: rocksdb::compaction_filter_factory::CompactionFilterContext,
    ) -> RewriteFilter {
        RewriteFilter {
            rewrite: self.0.clone(),
            value: Vec::new(),
        }
    }

    fn name(&self) -> &std::ffi::CStr {
        REWRITE_NAME
    }
}

/// Applies a [`Rewrite`] to each value one compaction job reads.
struct RewriteFilter {
    rewrite: Rewrite,
    /// The last new value, owned here until RocksDB has copied it.
    value: Vec<u8>,
}

impl rocksdb::compaction_filter::CompactionFilter for RewriteFilter {
    #[allow(unsafe_code)]
    fn filter(&mut self, _level: u32, key: &[u8], value: &[u8]) -> rocksdb::CompactionDecision {
        let Some(new) = self.rewrite.apply(key, value) else {
            return rocksdb::CompactionDecision::Keep;
        };
        self.value = new;
        // SAFETY: rust-rocksdb's `Decision::Change` asks for a `'static` slice only because it
        // cannot name this call's lifetime. RocksDB's C API copies the new value into its own
        // string as soon as this returns (`new_value->assign` in `rocksdb_compactionfilter_t::
        // Filter`), before it calls this filter again, and `self.value` is neither changed nor
        // dropped until then.
        let value: &'static [u8] =
            unsafe { std::slice::from_raw_parts(self.value.as_ptr(), self.value.len()) };
        rocksdb::CompactionDecision::Change(value)
    }

    fn name(&self) -> &std::ffi::CStr {
        REWRITE_NAME
    }
}

/// The memtable bloom filter's size as a fraction of the memtable's (see `db_options`).
const MEMTABLE_BLOOM_RATIO: f64 = 0.02;

/// The length of the prefix memtable inserts are hinted by: the kind and 8 bytes. Under a
/// run those are 8 bytes of its run key (a hash: as distinct between runs as all 16). Under
/// the expiry index of formats before 7, ordered by time, they are the expiry millisecond, so
/// that its entries of one millisecond share a hint instead of each adding one never used
/// again.
const INSERT_HINT_PREFIX_LEN: usize = 1 + 8;

/// The prefix extractor's name, stored in every table file it filtered: a file written under
/// another name (or none) is read without its prefix filter, never with a wrong one. Change
/// the name whenever [`intent_prefix`] changes.
const INTENT_PREFIX_EXTRACTOR: &str = "fence.intent-prefix.v1";

/// The length of an intent index key's prefix: kind, run, branch and fingerprint (the
/// occurrence follows).
const INTENT_PREFIX_LEN: usize = 1 + 16 + 4 + 32;

/// The prefix extractor's domain: intent index keys and their prefixes.
fn is_intent_key(key: &[u8]) -> bool {
    key.len() >= INTENT_PREFIX_LEN && key[0] == super::keys::Kind::Intent as u8
}

/// An intent index key's (run, branch, fingerprint) prefix: what one Begin scans.
fn intent_prefix(key: &[u8]) -> &[u8] {
    &key[..key.len().min(INTENT_PREFIX_LEN)]
}

/// Writes `bytes` of write-ahead log ahead, twice, so that the WAL files this process writes
/// next overwrite files of at least that size instead of appending to new ones.
///
/// Why: on ext4 (and most filesystems) an `fdatasync` after an append must also write the
/// inode, since the file's size changed; after an overwrite it writes only the data. On the
/// benchmark machine that is 150 against 105 us per sync, and every acknowledged write waits
/// for one. RocksDB reuses this process's obsolete WAL files (`recycle_log_file_num`), oldest
/// first, so from its third memtable on it overwrites by itself; the prime makes that true
/// from the first write, as Postgres does by zero-filling WAL segments before it needs them.
/// Two files, not one: the first memtable switch needs a file the recycle list does not have
/// yet, and a new one appends for a whole memtable (finding F11 in docs/BENCHMARKS.md).
///
/// How: `bytes` of WAL-only log data (`put_log_data`: never in a memtable or table file) into
/// the live WAL, a flush (which makes it obsolete, so that it joins the recycle list, and
/// switches to a new WAL), the same into that one, and a flush again: the switch reuses the
/// first file, the second joins the list behind it. Each fill's last write is synced and
/// holds the deletion of a key that never holds a value, [`keys::wal_prime`], so that the
/// memtable is not empty and a flush switches WAL files. The clean-up that fills the recycle
/// list runs after a flush returns, so the switch is retried until the live WAL is a primed
/// file and another waits in the list. Each flush leaves a table file of one tombstone, which
/// compaction removes.
///
/// Both together take at most an eighth of the filesystem's free space, and nothing when that
/// is under two megabytes: a nearly full disk keeps its room for the ledger.
fn prime_wal(db: &DB, path: &Path, bytes: u64) -> Result<(), StoreError> {
    const CHUNK: usize = 1 << 20;
    let free = rustix::fs::statvfs(path)
        .map_err(|e| StoreError::Engine(format!("{}: {e}", path.display())))?;
    let bytes = bytes.min(free.f_bavail.saturating_mul(free.f_frsize) / 16);
    if bytes < CHUNK as u64 {
        return Ok(());
    }
    let cf = cf(db);
    let key = super::keys::wal_prime();
    // A megabyte per write, so the prime never holds more than that in memory; the last
    // write syncs them all.
    let filler = vec![0u8; CHUNK];
    let fill = || -> Result<(), StoreError> {
        let mut left = bytes;
        while left > 0 {
            let n = left.min(CHUNK as u64) as usize;
            left -= n as u64;
            let mut batch = WriteBatch::default();
            batch.put_log_data(&filler[..n]);
            if left == 0 {
                batch.delete_cf(cf, &key);
            }
            db.write_opt(batch, &write_options(left == 0))
                .map_err(engine)?;
        }
        db.flush_cf(cf).map_err(engine)
    };
    fill()?;
    fill()?;
    let mut live = 0;
    for _ in 0..50 {
        let waiting;
        (live, waiting) = wal_sizes(path)?;
        if live >= bytes && waiting >= bytes {
            return Ok(());
        }
        std::thread::sleep(std::time::Duration::from_millis(2));
        if live < bytes {
            let mut switch = WriteBatch::default();
            switch.delete_cf(cf, &key);
            db.write_opt(switch, &write_options(true)).map_err(engine)?;
            db.flush_cf(cf).map_err(engine)?;
        }
    }
    if live >= bytes {
        // The next WAL file appends for a memtable, as it would without the second fill.
        tracing::debug!("the second primed WAL file is not waiting to be reused");
        return Ok(());
    }
    Err(StoreError::Engine(
        "RocksDB did not reuse the primed WAL file".into(),
    ))
}

/// The WAL files in `path`, as (number, size), oldest first.
fn wal_logs(path: &Path) -> Result<Vec<(u64, u64)>, StoreError> {
    wal_dir::log_files(path)?
        .into_iter()
        .map(|(number, file)| {
            let len = std::fs::metadata(&file)
                .map_err(|e| StoreError::Engine(format!("{}: {e}", file.display())))?
                .len();
            Ok((number, len))
        })
        .collect()
}

/// The size of the newest WAL file in `path` (the one RocksDB writes) and the largest of the
/// others (after a flush: the ones waiting to be reused), 0 where there is none.
fn wal_sizes(path: &Path) -> Result<(u64, u64), StoreError> {
    let mut logs = wal_logs(path)?;
    let live = logs.pop().map_or(0, |(_, len)| len);
    let waiting = logs.iter().map(|&(_, len)| len).max().unwrap_or(0);
    Ok((live, waiting))
}

fn cf(db: &DB) -> &rocksdb::ColumnFamily {
    db.cf_handle(LEDGER_CF)
        .expect("the ledger column family is created at open")
}

impl RocksStore {
    /// Opens (creating if needed) the store in `path`.
    ///
    /// With [`StoreOptions::wal_prime_bytes`], it then writes that much write-ahead log ahead
    /// into each of two files (together at most an eighth of the free space), so that the
    /// syncs of this process's first two memtables overwrite a WAL file instead of growing
    /// it. A prime that fails is logged and skipped (the store is served as without it); the
    /// reopen after a write error never primes.
    pub fn open(path: impl AsRef<Path>, opts: &StoreOptions) -> Result<Self, StoreError> {
        let path = path.as_ref().to_path_buf();
        let wal = wal_dir::place(&path, opts.wal_dir.as_deref(), || {
            flush_for_wal_move(&path, opts)
        })?;
        let db = open_db(&path, opts, wal.dir.as_deref())?;
        let losses = report_recovery(&path);
        let primed = if opts.wal_prime_bytes > 0 && opts.sync_writes {
            prime_wal(
                &db,
                wal.dir.as_deref().unwrap_or(&path),
                opts.wal_prime_bytes,
            )
        } else {
            Ok(())
        };
        let store = Self::with_db_open(db, path, opts, losses, false, wal)?;
        if let Err(e) = primed {
            tracing::warn!(path = %store.engine.path.display(), error = %e, "could not write the write-ahead log ahead; its first syncs will also write the file's size");
            // A failed write may leave RocksDB refusing writes until it is reopened.
            store.engine.needs_reopen.store(true, Ordering::Release);
        }
        Ok(store)
    }

    /// Opens an existing store read-only (a backup, or a data dir to inspect): nothing in the
    /// directory is written, and every write is refused. A directory that holds no store is
    /// an error. A store whose write-ahead log was moved is read with the log where its
    /// marker says it is, whatever [`StoreOptions::wal_dir`] says.
    pub fn open_read_only(path: impl AsRef<Path>, opts: &StoreOptions) -> Result<Self, StoreError> {
        let path = path.as_ref().to_path_buf();
        let wal = wal_dir::for_read_only(&path)?;
        let db = open_db_read_only(&path, opts, wal.dir.as_deref())?;
        Self::with_db_open(db, path, opts, Vec::new(), true, wal)
    }

    fn with_db_open(
        db: DB,
        path: PathBuf,
        opts: &StoreOptions,
        losses: Vec<String>,
        inspect_only: bool,
        wal: Placement,
    ) -> Result<Self, StoreError> {
        let engine = Box::new(Engine {
            db: RwLock::new(Some(db)),
            needs_reopen: AtomicBool::new(false),
            path,
            opts: opts.clone(),
            pipeline: Pipeline::new(),
            losses: Mutex::new(losses),
            read_only: AtomicBool::new(inspect_only),
            inspect_only,
            wal,
        });
        Ok(Self { engine })
    }

    /// Writes a consistent copy of the store into `dir`, which must not exist, while it goes on
    /// serving: a RocksDB checkpoint (memtables flushed, table files hard-linked where the
    /// filesystem allows, copied otherwise). It holds every write acknowledged before the call.
    pub fn checkpoint_to(&self, dir: &Path) -> Result<(), StoreError> {
        self.engine.with_db(|db| {
            rocksdb::checkpoint::Checkpoint::new(db)
                .and_then(|c| c.create_checkpoint(dir))
                .map_err(engine)
        })
    }

    /// What RocksDB's recovery dropped when the store was last opened (or reopened after an
    /// error): its own log lines, one per loss (e.g. "000004.log: dropping 101 bytes;
    /// Corruption: truncated record body"). Empty when recovery lost nothing. A torn tail of
    /// the write-ahead log is a write that was never synced, so never acknowledged; anything
    /// else here means the disk lost synced data.
    pub fn recovery_losses(&self) -> Vec<String> {
        self.engine
            .losses
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Bytes the store holds: its table files and memtables (RocksDB's own figures).
    pub fn size_bytes(&self) -> Result<u64, StoreError> {
        self.engine.with_db_for_read(|db| {
            let cf = cf(db);
            let property = |name: &str| {
                db.property_int_value_cf(cf, name)
                    .map_err(engine)
                    .map(|v| v.unwrap_or(0))
            };
            Ok(
                property("rocksdb.total-sst-files-size")?
                    + property("rocksdb.size-all-mem-tables")?,
            )
        })
    }

    /// The directory the store lives in.
    pub fn path(&self) -> &Path {
        &self.engine.path
    }

    /// Flushes memtables to SST files (used before measuring on-disk size).
    pub fn flush(&self) -> Result<(), StoreError> {
        self.engine
            .with_db(|db| db.flush_cf(cf(db)).map_err(engine))
    }

    /// Reads from RocksDB alone, past the staged writes.
    fn engine_scan(&self, prefix: &[u8], from: &[u8], limit: usize) -> Result<Entries, StoreError> {
        self.engine.with_db_for_read(|db| {
            let mut ro = ReadOptions::default();
            if let Some(end) = prefix_end(prefix) {
                ro.set_iterate_upper_bound(end);
            }
            if prefix.len() == INTENT_PREFIX_LEN && is_intent_key(prefix) {
                // One intent's entries: the prefix filters may skip whole tables.
                ro.set_prefix_same_as_start(true);
            } else {
                // Any other range is read in total order, past the prefix filters.
                ro.set_total_order_seek(true);
            }
            let start = if from < prefix { prefix } else { from };
            let iter =
                db.iterator_cf_opt(cf(db), ro, IteratorMode::From(start, Direction::Forward));
            let mut out = Vec::new();
            for item in iter {
                let (k, v) = item.map_err(engine)?;
                if !k.starts_with(prefix) || out.len() >= limit {
                    break;
                }
                out.push((k.into_vec(), v.into_vec()));
            }
            Ok(out)
        })
    }

    /// Writes straight to RocksDB, unsynced: only for a bulk load (`sync_writes` off).
    fn write_direct(&self, batch: &Batch) -> Result<(), StoreError> {
        crate::metrics::store_write("unsynced");
        self.engine.write_ops(batch.ops(), false)
    }
}

impl Engine {
    /// Runs `f` on the open database, reopening it first after a failed write.
    fn with_db<T>(&self, f: impl FnOnce(&DB) -> Result<T, StoreError>) -> Result<T, StoreError> {
        if self.inspect_only {
            return Err(StoreError::Engine(format!(
                "{} is open read-only (for inspection); nothing may be written to it",
                self.path.display()
            )));
        }
        if self.needs_reopen.load(Ordering::Acquire) {
            self.reopen()?;
        }
        self.current_db(f)
    }

    /// Runs a read on the open database. While it is open read-only (it could not be reopened
    /// for writing) reads are served from it without another attempt: writes retry.
    fn with_db_for_read<T>(
        &self,
        f: impl FnOnce(&DB) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        if self.needs_reopen.load(Ordering::Acquire) && !self.read_only.load(Ordering::Acquire) {
            // A failed reopen that fell back to read-only still serves this read.
            let _ = self.reopen();
        }
        self.current_db(f)
    }

    fn current_db<T>(&self, f: impl FnOnce(&DB) -> Result<T, StoreError>) -> Result<T, StoreError> {
        let guard = self.db.read().unwrap_or_else(|e| e.into_inner());
        let db = guard
            .as_ref()
            .ok_or_else(|| StoreError::Engine("the store is reopening after an error".into()))?;
        f(db)
    }

    fn reopen(&self) -> Result<(), StoreError> {
        let mut guard = self.db.write().unwrap_or_else(|e| e.into_inner());
        if !self.needs_reopen.load(Ordering::Acquire) {
            return Ok(());
        }
        // Close first: RocksDB holds a lock file on the directory.
        *guard = None;
        let wal = self.wal.dir.as_deref();
        let db = match open_db(&self.path, &self.opts, wal) {
            Ok(db) => db,
            Err(e) => {
                // Serve reads while writes cannot be made (a full disk): read-only, until a
                // write's reopen succeeds.
                match open_db_read_only(&self.path, &self.opts, wal) {
                    Ok(db) => {
                        *guard = Some(db);
                        if !self.read_only.swap(true, Ordering::AcqRel) {
                            tracing::warn!(path = %self.path.display(), error = %e, "the ledger cannot be opened for writing; serving reads read-only, refusing writes until it can");
                        }
                    }
                    Err(ro) => {
                        tracing::warn!(path = %self.path.display(), error = %ro, "the ledger cannot be opened, even read-only");
                    }
                }
                return Err(e);
            }
        };
        *guard = Some(db);
        self.read_only.store(false, Ordering::Release);
        *self.losses.lock().unwrap_or_else(|e| e.into_inner()) = report_recovery(&self.path);
        self.needs_reopen.store(false, Ordering::Release);
        tracing::warn!(path = %self.path.display(), "ledger store reopened after a write error");
        Ok(())
    }

    /// Writes `ops` as one atomic RocksDB batch (a bulk load's, unsynced).
    fn write_ops(&self, ops: &[Op], sync: bool) -> Result<(), StoreError> {
        let batch = self.batch(&mut ops.iter().map(Op::write))?;
        self.write_batch(batch, sync)
    }

    fn batch(
        &self,
        writes: &mut dyn Iterator<Item = (&[u8], Option<&[u8]>)>,
    ) -> Result<WriteBatch, StoreError> {
        self.with_db(|db| {
            let cf = cf(db);
            let mut wb = WriteBatch::default();
            for (k, v) in writes {
                match v {
                    Some(v) => wb.put_cf(cf, k, v),
                    None => wb.delete_cf(cf, k),
                }
            }
            Ok(wb)
        })
    }

    fn write_batch(&self, batch: WriteBatch, sync: bool) -> Result<(), StoreError> {
        if batch.is_empty() {
            return Ok(());
        }
        if sync {
            crate::metrics::wal_sync();
        }
        let options = if self.opts.sync_writes {
            write_options(sync)
        } else {
            bulk_write_options()
        };
        let started = std::time::Instant::now();
        let result = self.with_db(|db| db.write_opt(batch, &options).map_err(engine));
        if sync && result.is_ok() {
            crate::metrics::wal_synced(started.elapsed());
        }
        if result.is_err() {
            // RocksDB may now refuse every write until reopened; do that on the next call.
            self.needs_reopen.store(true, Ordering::Release);
        }
        result
    }
}

/// A round is one RocksDB write batch, synced. (The column family's id is what a batch
/// records, and it survives a reopen between the copy and the write.)
impl pipeline::Sink for Engine {
    fn round<'s>(
        &'s self,
        writes: &mut dyn Iterator<Item = (&[u8], Option<&[u8]>)>,
    ) -> Result<Box<dyn FnOnce() -> Result<(), StoreError> + 's>, StoreError> {
        let batch = self.batch(writes)?;
        Ok(Box::new(move || self.write_batch(batch, true)))
    }
}

/// Reads what the recovery of the open that just finished dropped from RocksDB's info log
/// (`LOG`, which RocksDB starts afresh at every open) and says so in fenced's own log.
fn report_recovery(path: &Path) -> Vec<String> {
    let Ok(log) = std::fs::read_to_string(path.join("LOG")) else {
        return Vec::new();
    };
    let losses: Vec<String> = log
        .lines()
        .filter(|l| l.contains("dropping") || l.contains("Corruption"))
        .map(|l| {
            // Keep RocksDB's message, without its timestamp, thread and source location.
            let message = l.rsplit_once("] ").map_or(l, |(_, m)| m);
            message.trim().to_owned()
        })
        .collect();
    for loss in &losses {
        tracing::warn!(
            path = %path.display(),
            loss = %loss,
            "recovering the ledger dropped bytes of its write-ahead log (a torn tail is a write that was never synced, so never acknowledged; anything else means the disk lost synced data)"
        );
    }
    losses
}

/// The smallest key greater than every key starting with `prefix` (None if there is none).
fn prefix_end(prefix: &[u8]) -> Option<Vec<u8>> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return Some(end);
        }
    }
    None
}

impl Store for RocksStore {
    fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, StoreError> {
        // Staged first: an entry leaves the overlay only after RocksDB has it.
        let pipeline = &self.engine.pipeline;
        if let Some((value, seen)) = pipeline.get(key) {
            pipeline.depend(seen, self.engine.as_ref())?;
            return Ok(value);
        }
        self.engine
            .with_db_for_read(|db| db.get_cf(cf(db), key).map_err(engine))
    }

    fn scan(&self, prefix: &[u8], from: &[u8], limit: usize) -> Result<Entries, StoreError> {
        let start = if from < prefix { prefix } else { from };
        let end = prefix_end(prefix);
        let staged = self.engine.pipeline.range(start, end.as_deref());
        if staged.entries.is_empty() {
            return self.engine_scan(prefix, from, limit);
        }
        // Each staged entry may replace or delete one of RocksDB's: read that many more.
        let found = self.engine_scan(prefix, from, limit.saturating_add(staged.entries.len()))?;
        if let Some(seen) = staged.seen {
            self.engine.pipeline.depend(seen, self.engine.as_ref())?;
        }
        Ok(pipeline::merge(found, staged.entries, limit))
    }

    fn write(&self, batch: Batch) -> Result<(), StoreError> {
        if !self.engine.opts.sync_writes {
            return self.write_direct(&batch);
        }
        let pipeline = &self.engine.pipeline;
        crate::metrics::store_write(if pipeline.in_section() {
            "deferred"
        } else {
            "synced"
        });
        pipeline.write(batch, self.engine.as_ref())
    }

    fn write_unsynced(&self, batch: Batch) -> Result<(), StoreError> {
        if !self.engine.opts.sync_writes {
            return self.write_direct(&batch);
        }
        crate::metrics::store_write("unsynced");
        self.engine.pipeline.write_unsynced(batch)
    }

    /// Compacts the whole key range, bottom level included, applying the rewrite (also after
    /// a bulk load, so that what is measured next does not pay for the load's compaction debt).
    fn compact(&self) -> Result<(), StoreError> {
        self.engine.with_db(|db| {
            let mut all = rocksdb::CompactOptions::default();
            all.set_bottommost_level_compaction(rocksdb::BottommostLevelCompaction::Force);
            db.compact_range_cf_opt(cf(db), None::<&[u8]>, None::<&[u8]>, &all);
            Ok(())
        })
    }

    fn deferred(&self, f: &mut dyn FnMut()) -> Result<(), StoreError> {
        if !self.engine.opts.sync_writes {
            f();
            return Ok(());
        }
        self.engine.pipeline.deferred(f, self.engine.as_ref())
    }

    fn durability(&self) -> super::Durability {
        if !self.engine.opts.sync_writes {
            return super::Durability::IMMEDIATE;
        }
        self.engine.pipeline.durability()
    }

    fn write_stamp(&self, before: super::Durability) -> super::Durability {
        let after = self.durability();
        // Inside a section the write was staged in the open round; outside, it returned once
        // durable, so every round durable now covers it.
        let open_epoch = if self.engine.pipeline.in_section() {
            after.open_epoch
        } else {
            after.durable_through
        };
        super::Durability {
            open_epoch,
            ..before
        }
    }

    fn deferred_then(&self, f: Box<dyn FnOnce() -> Then + '_>) {
        if !self.engine.opts.sync_writes {
            let then = f();
            then(Ok(()));
            return;
        }
        self.engine.pipeline.deferred_then(f, self.engine.as_ref())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_end_is_the_next_prefix() {
        assert_eq!(prefix_end(&[1, 2]), Some(vec![1, 3]));
        assert_eq!(prefix_end(&[1, 0xff]), Some(vec![2]));
        assert_eq!(prefix_end(&[0xff, 0xff]), None);
    }

    #[test]
    fn a_store_open_for_writing_cannot_be_opened_again() {
        let dir = tempfile::tempdir().unwrap();
        let first = RocksStore::open(dir.path(), &StoreOptions::default()).unwrap();
        let Err(err) = RocksStore::open(dir.path(), &StoreOptions::default()) else {
            panic!("a second open is refused");
        };
        let message = err.to_string();
        assert!(message.contains("is already open"), "{message}");
        assert!(
            message.contains(&*dir.path().join("LOCK").to_string_lossy()),
            "{message}"
        );
        // A read-only open takes no lock (backups are verified that way), and the first
        // store is untouched.
        let mut batch = Batch::new();
        batch.put(b"k".to_vec(), b"v".to_vec());
        first.write(batch).unwrap();
        drop(RocksStore::open_read_only(dir.path(), &StoreOptions::default()).unwrap());
        assert_eq!(first.get(b"k").unwrap(), Some(b"v".to_vec()));
    }

    #[test]
    fn only_a_held_lock_reads_as_a_store_already_open() {
        let path = Path::new("/d/ledger");
        let says = |m: &str| opening(path, m.to_owned()).to_string();
        for held in [
            "IO error: While lock file: /d/ledger/LOCK: Resource temporarily unavailable",
            "IO error: lock hold by current process, acquire time 1 acquiring thread 2: /d/ledger/LOCK: No locks available",
        ] {
            assert!(says(held).contains("is already open"), "{held}");
        }
        let denied = "IO error: While open a file for lock: /d/ledger/LOCK: Permission denied";
        assert_eq!(says(denied), format!("storage engine error: {denied}"));
    }

    #[test]
    fn writes_go_to_table_files_once_they_pass_the_memtable_size() {
        // Table-file bytes after `mib` MiB of writes under `memtable_bytes`, waiting up to
        // `wait` for a background flush.
        let sst_bytes = |memtable_bytes: usize, mib: u32, wait: std::time::Duration| {
            let dir = tempfile::tempdir().unwrap();
            let opts = StoreOptions {
                memtable_bytes,
                ..StoreOptions::default()
            };
            let s = RocksStore::open(dir.path(), &opts).unwrap();
            for i in 0..mib * 16 {
                let mut b = Batch::new();
                b.put(i.to_be_bytes().to_vec(), vec![7u8; 64 << 10]);
                s.write(b).unwrap();
            }
            let sst = || {
                s.engine.with_db_for_read(|db| {
                    Ok(db
                        .property_int_value_cf(cf(db), "rocksdb.total-sst-files-size")
                        .map_err(engine)?
                        .unwrap_or(0))
                })
            };
            let deadline = std::time::Instant::now() + wait;
            while sst().unwrap() == 0 && std::time::Instant::now() < deadline {
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            sst().unwrap()
        };
        let none = std::time::Duration::ZERO;
        assert_eq!(
            sst_bytes(64 << 20, 4, none),
            0,
            "4 MiB fit a 64 MiB memtable"
        );
        // Flushes run in the background.
        let flushed = sst_bytes(1 << 20, 4, std::time::Duration::from_secs(10));
        assert!(flushed > 0, "4 MiB pass a 1 MiB memtable");
    }

    /// The prime leaves the live WAL at least its size, and what is written into it (past
    /// its end too) reads back after reopening, primed or not, with nothing dropped.
    #[test]
    fn a_primed_wal_is_the_live_one_and_keeps_every_write() {
        let dir = tempfile::tempdir().unwrap();
        let primed = StoreOptions {
            wal_prime_bytes: 1 << 20,
            ..StoreOptions::default()
        };
        let value = vec![7u8; 4096];
        let write = |s: &RocksStore, from: u32, to: u32| {
            for i in from..to {
                let mut b = Batch::new();
                b.put([&[9u8][..], &i.to_be_bytes()].concat(), value.clone());
                s.write(b).unwrap();
            }
        };
        let held = |s: &RocksStore| s.scan(&[9], &[9], 10_000).unwrap().len();
        {
            let s = RocksStore::open(dir.path(), &primed).unwrap();
            assert!(wal_sizes(dir.path()).unwrap().0 >= 1 << 20);
            // Past the primed megabyte: the rest appends.
            write(&s, 0, 400);
        }
        {
            let s = RocksStore::open(dir.path(), &primed).unwrap();
            assert!(s.recovery_losses().is_empty(), "{:?}", s.recovery_losses());
            assert_eq!(held(&s), 400);
            assert!(wal_sizes(dir.path()).unwrap().0 >= 1 << 20);
            write(&s, 400, 500);
        }
        let s = RocksStore::open(dir.path(), &StoreOptions::default()).unwrap();
        assert!(s.recovery_losses().is_empty(), "{:?}", s.recovery_losses());
        assert_eq!(held(&s), 500);
        // The prime's key never holds a value: the metadata kind holds nothing here.
        assert!(s.scan(&[0], &[0], 10).unwrap().is_empty());
    }

    /// The WAL file after the first memtable switch is primed too: a file that was new there
    /// would append (and write its inode with every sync) for a whole memtable.
    #[test]
    fn the_wal_after_the_first_memtable_switch_is_primed_too() {
        let dir = tempfile::tempdir().unwrap();
        let opts = StoreOptions {
            wal_prime_bytes: 2 << 20,
            memtable_bytes: 1 << 20,
            ..StoreOptions::default()
        };
        let s = RocksStore::open(dir.path(), &opts).unwrap();
        let (live, waiting) = wal_sizes(dir.path()).unwrap();
        assert!(live >= 2 << 20 && waiting >= 2 << 20, "{live} {waiting}");
        let first = wal_logs(dir.path()).unwrap().last().unwrap().0;
        // 4 KiB writes until RocksDB switches to another WAL file (a 1 MiB memtable is full
        // after about 256 of them), then a few more into the new one.
        let mut after_switch = None;
        for i in 0u32..2048 {
            let mut b = Batch::new();
            b.put([&[9u8][..], &i.to_be_bytes()].concat(), vec![7u8; 4096]);
            s.write(b).unwrap();
            let newest = wal_logs(dir.path()).unwrap().last().unwrap().0;
            if newest != first && after_switch.is_none() {
                after_switch = Some(i);
            }
            if after_switch.is_some_and(|at| i >= at + 16) {
                break;
            }
        }
        assert!(after_switch.is_some(), "no memtable switch after 8 MiB");
        // About 64 KiB were written into the live file: its size is the prime's.
        let (live, _) = wal_sizes(dir.path()).unwrap();
        assert!(live >= 2 << 20, "the second WAL file holds {live} bytes");
    }

    /// Table files are compressed as configured: a ledger's kind of records takes less disk
    /// with LZ4 than without, and less again with ZSTD at the last level; and a store reads
    /// every record whichever setting wrote it.
    #[test]
    fn table_files_are_compressed_as_configured_and_read_under_any_setting() {
        // JSON much like an effect record's: repeated field names, distinct values.
        let record = |i: u32| {
            format!(
                r#"{{"tool":"payments.transfer","arguments":{{"amount":{},"currency":"EUR","to":"acct-{}"}},"state":"completed","result":{{"ok":true,"id":"tx-{i:08}"}}}}"#,
                i % 9973,
                i % 977
            )
            .into_bytes()
        };
        let key = |i: u32| [&[9u8][..], &i.to_be_bytes()].concat();
        let write = |s: &RocksStore, from: u32, to: u32| {
            for chunk in (from..to).collect::<Vec<_>>().chunks(1000) {
                let mut b = Batch::new();
                for &i in chunk {
                    b.put(key(i), record(i));
                }
                s.write(b).unwrap();
            }
        };
        // Flushed, and rewritten into the last level (not merely moved there, as a lone file
        // would be), so that both settings of `Lz4Zstd` apply.
        let settle = |s: &RocksStore| {
            s.engine
                .with_db_for_read(|db| {
                    db.flush_cf(cf(db)).map_err(engine)?;
                    let mut rewrite = rocksdb::CompactOptions::default();
                    rewrite
                        .set_bottommost_level_compaction(rocksdb::BottommostLevelCompaction::Force);
                    db.compact_range_cf_opt(cf(db), None::<&[u8]>, None::<&[u8]>, &rewrite);
                    Ok(db
                        .property_int_value_cf(cf(db), "rocksdb.total-sst-files-size")
                        .map_err(engine)?
                        .unwrap_or(0))
                })
                .unwrap()
        };
        let with = |compression| StoreOptions {
            compression,
            ..StoreOptions::default()
        };
        let mut sizes = Vec::new();
        for compression in [Compression::None, Compression::Lz4, Compression::Lz4Zstd] {
            let dir = tempfile::tempdir().unwrap();
            let s = RocksStore::open(dir.path(), &with(compression)).unwrap();
            write(&s, 0, 20_000);
            sizes.push(settle(&s));
        }
        assert!(sizes[0] > sizes[1] * 3 / 2, "none, lz4: {sizes:?}");
        assert!(sizes[1] > sizes[2], "lz4, lz4-zstd: {sizes:?}");

        // One data dir written under two settings, read under each.
        let dir = tempfile::tempdir().unwrap();
        {
            let s = RocksStore::open(dir.path(), &with(Compression::Lz4Zstd)).unwrap();
            write(&s, 0, 5_000);
            settle(&s);
        }
        {
            let s = RocksStore::open(dir.path(), &with(Compression::None)).unwrap();
            write(&s, 5_000, 10_000);
            settle(&s);
        }
        for compression in [Compression::Lz4Zstd, Compression::None] {
            let s = RocksStore::open(dir.path(), &with(compression)).unwrap();
            let held = s.scan(&[9], &[9], 20_000).unwrap();
            assert_eq!(held.len(), 10_000);
            for (i, (k, v)) in held.iter().enumerate() {
                assert_eq!((k, v), (&key(i as u32), &record(i as u32)));
            }
        }
    }

    #[test]
    fn batches_are_durable_and_scans_stay_in_their_prefix() {
        let dir = tempfile::tempdir().unwrap();
        {
            let s = RocksStore::open(dir.path(), &StoreOptions::default()).unwrap();
            let mut b = Batch::new();
            for k in [vec![1, 1], vec![1, 2], vec![1, 3], vec![2, 0]] {
                b.put(k.clone(), k);
            }
            b.delete(vec![1, 3]);
            s.write(b).unwrap();
        }
        // Reopen: everything acknowledged is there.
        let s = RocksStore::open(dir.path(), &StoreOptions::default()).unwrap();
        let all = s.scan(&[1], &[1], 10).unwrap();
        assert_eq!(
            all.iter().map(|(k, _)| k.clone()).collect::<Vec<_>>(),
            vec![vec![1, 1], vec![1, 2]]
        );
        assert_eq!(s.scan(&[1], &[1, 2], 10).unwrap().len(), 1);
        assert_eq!(s.scan(&[1], &[1], 1).unwrap().len(), 1);
        assert_eq!(s.get(&[2, 0]).unwrap(), Some(vec![2, 0]));
        assert_eq!(s.get(&[1, 3]).unwrap(), None);
    }

    /// Memtable inserts start from their run prefix's last insert (RocksDB's insert hints).
    /// The option is in effect for the ledger's column family, and writes that interleave
    /// prefixes, overwrite and delete keys, and mix in keys shorter than a prefix read back
    /// exactly, from the memtable and after a reopen.
    #[test]
    fn hinted_memtable_inserts_read_back_exactly() {
        use rand::{Rng, SeedableRng};
        let dir = tempfile::tempdir().unwrap();
        let mut model = std::collections::BTreeMap::new();
        let mut rng = rand::rngs::StdRng::seed_from_u64(18);
        {
            let s = RocksStore::open(dir.path(), &StoreOptions::default()).unwrap();
            for _ in 0..200 {
                let mut b = Batch::new();
                for _ in 0..rng.random_range(1..20) {
                    // A few runs under a few kinds, so prefixes repeat across batches.
                    let mut key = vec![rng.random_range(1..4u8)];
                    key.extend_from_slice(&[rng.random_range(0..6u8); 16]);
                    if rng.random_bool(0.1) {
                        key.truncate(rng.random_range(1..INSERT_HINT_PREFIX_LEN + 4));
                    } else {
                        key.extend_from_slice(&rng.random_range(0..50u64).to_be_bytes());
                    }
                    if rng.random_bool(0.2) {
                        b.delete(key.clone());
                        model.remove(&key);
                    } else {
                        let value = rng.random::<u64>().to_be_bytes().to_vec();
                        b.put(key.clone(), value.clone());
                        model.insert(key, value);
                    }
                }
                s.write(b).unwrap();
            }
            let all = s.scan(&[], &[], usize::MAX).unwrap();
            assert_eq!(
                all.into_iter().collect::<Vec<_>>(),
                model.clone().into_iter().collect::<Vec<_>>()
            );
        }
        let s = RocksStore::open(dir.path(), &StoreOptions::default()).unwrap();
        for (k, v) in &model {
            assert_eq!(s.get(k).unwrap().as_ref(), Some(v));
        }
        let all = s.scan(&[], &[], usize::MAX).unwrap();
        assert_eq!(
            all.into_iter().collect::<Vec<_>>(),
            model.into_iter().collect::<Vec<_>>()
        );

        let text = options_file(dir.path());
        let hinted = format!(
            "memtable_insert_with_hint_prefix_extractor=rocksdb.FixedPrefix.{INSERT_HINT_PREFIX_LEN}"
        );
        assert!(
            text.contains(&hinted),
            "the ledger's column family is hinted"
        );
    }

    /// A memtable on huge pages is in effect for the ledger's column family and holds writes
    /// exactly like one on ordinary pages, whether or not the machine has huge pages reserved
    /// (RocksDB falls back to ordinary memory where it has none).
    #[test]
    fn a_memtable_on_huge_pages_reads_back_exactly() {
        let dir = tempfile::tempdir().unwrap();
        let opts = StoreOptions {
            memtable_huge_page_bytes: 2 << 20,
            memtable_bytes: 1 << 20,
            ..StoreOptions::default()
        };
        let key = |i: u32| [&[9u8][..], &i.to_be_bytes()].concat();
        {
            let s = RocksStore::open(dir.path(), &opts).unwrap();
            // 3 MiB through a 1 MiB memtable: memtables on huge pages are switched and flushed.
            for i in 0..768u32 {
                let mut b = Batch::new();
                b.put(key(i), vec![(i % 251) as u8; 4096]);
                s.write(b).unwrap();
            }
            assert_eq!(
                s.get(&key(767)).unwrap(),
                Some(vec![(767 % 251) as u8; 4096])
            );
        }
        let s = RocksStore::open(dir.path(), &opts).unwrap();
        for i in (0..768u32).step_by(37) {
            assert_eq!(s.get(&key(i)).unwrap(), Some(vec![(i % 251) as u8; 4096]));
        }
        assert_eq!(s.scan(&[9], &[9], usize::MAX).unwrap().len(), 768);
        let text = options_file(dir.path());
        assert!(
            text.contains("memtable_huge_page_size=2097152"),
            "in effect"
        );
    }

    #[test]
    fn compaction_applies_the_rewrite_to_every_value_it_asks_for_and_keeps_the_rest() {
        use std::sync::Arc;
        use std::sync::atomic::AtomicBool;
        let dir = tempfile::tempdir().unwrap();
        let due = Arc::new(AtomicBool::new(false));
        let rewrite = {
            let due = due.clone();
            Rewrite::new(move |key, value| {
                (key[0] == 9 && due.load(Ordering::Relaxed) && value.starts_with(b"old"))
                    .then(|| [&b"new"[..], &value[3..]].concat())
            })
        };
        let opts = StoreOptions {
            memtable_bytes: 1 << 20,
            rewrite: Some(rewrite),
            ..StoreOptions::default()
        };
        let key = |kind: u8, i: u32| [&[kind][..], &i.to_be_bytes()].concat();
        let value = |head: &[u8], i: u32| [head, &[(i % 251) as u8; 1000][..]].concat();
        let s = RocksStore::open(dir.path(), &opts).unwrap();
        // 4 MB through a 1 MiB memtable: in several table files and the memtable.
        for chunk in (0..2000u32).collect::<Vec<_>>().chunks(100) {
            let mut b = Batch::new();
            for &i in chunk {
                b.put(key(9, i), value(b"old", i));
                b.put(key(8, i), value(b"old", i));
            }
            s.write(b).unwrap();
        }
        s.compact().unwrap();
        assert_eq!(
            s.get(&key(9, 7)).unwrap(),
            Some(value(b"old", 7)),
            "not asked"
        );
        due.store(true, Ordering::Relaxed);
        s.compact().unwrap();
        for i in 0..2000 {
            assert_eq!(s.get(&key(9, i)).unwrap(), Some(value(b"new", i)));
            assert_eq!(s.get(&key(8, i)).unwrap(), Some(value(b"old", i)));
        }
        drop(s);
        // The rewritten values are what is stored, with or without the rewrite.
        let s = RocksStore::open(dir.path(), &StoreOptions::default()).unwrap();
        assert_eq!(s.get(&key(9, 1999)).unwrap(), Some(value(b"new", 1999)));
        assert_eq!(s.scan(&[9], &[9], usize::MAX).unwrap().len(), 2000);
        drop(s);
        let s = RocksStore::open(dir.path(), &opts).unwrap();
        drop(s);
        let text = options_file(dir.path());
        assert!(text.contains("periodic_compaction_seconds=86400"), "{text}");
        assert!(text.contains("fence.rewrite"), "the filter is in effect");
    }

    /// The newest OPTIONS file RocksDB wrote in `dir`: the options a store was opened with.
    fn options_file(dir: &Path) -> String {
        let newest = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| {
                p.file_name()
                    .unwrap()
                    .to_string_lossy()
                    .starts_with("OPTIONS-")
            })
            .max()
            .expect("RocksDB writes an OPTIONS file");
        std::fs::read_to_string(newest).unwrap()
    }

    /// Intent scans go through the prefix filters, every other range in total order; both
    /// find exactly what is stored, in the memtable and in table files, including table files
    /// written before the store had a prefix extractor.
    #[test]
    fn intent_scans_through_prefix_filters_find_exactly_their_entries() {
        use crate::store::keys;
        let dir = tempfile::tempdir().unwrap();
        let (rk, other_rk) = (keys::run_key("t", "r"), keys::run_key("t", "other"));
        let (fp, other_fp) = ([7u8; 32], [8u8; 32]);
        let put = |b: &mut Batch, k: Vec<u8>| b.put(k.clone(), k);
        {
            // A data dir from before the extractor: plain options, one table file.
            let mut legacy = Options::default();
            legacy.create_if_missing(true);
            legacy.create_missing_column_families(true);
            let db = DB::open_cf(&legacy, dir.path(), [LEDGER_CF]).unwrap();
            let cf = db.cf_handle(LEDGER_CF).unwrap();
            db.put_cf(cf, keys::intent(&rk, 0, &fp, 1), b"old").unwrap();
            db.flush_cf(cf).unwrap();
        }
        let s = RocksStore::open(dir.path(), &StoreOptions::default()).unwrap();
        let mut b = Batch::new();
        put(&mut b, keys::intent(&rk, 0, &fp, 2));
        put(&mut b, keys::intent(&rk, 0, &other_fp, 1));
        put(&mut b, keys::intent(&rk, 1, &fp, 1));
        put(&mut b, keys::intent(&other_rk, 0, &fp, 1));
        put(&mut b, keys::effect(&rk, 1));
        s.write(b).unwrap();
        s.flush().unwrap();
        let mut b = Batch::new();
        put(&mut b, keys::intent(&rk, 0, &fp, 3));
        put(&mut b, keys::intent(&rk, 0, &other_fp, 2));
        s.write(b).unwrap();

        let keys_of = |prefix: &[u8]| -> Vec<Vec<u8>> {
            s.scan(prefix, prefix, usize::MAX)
                .unwrap()
                .into_iter()
                .map(|(k, _)| k)
                .collect()
        };
        assert_eq!(
            keys_of(&keys::intent_prefix(&rk, 0, &fp)),
            (1..=3)
                .map(|n| keys::intent(&rk, 0, &fp, n))
                .collect::<Vec<_>>()
        );
        assert_eq!(
            keys_of(&keys::intent_prefix(&rk, 0, &other_fp)),
            (1..=2)
                .map(|n| keys::intent(&rk, 0, &other_fp, n))
                .collect::<Vec<_>>()
        );
        assert!(keys_of(&keys::intent_prefix(&rk, 2, &fp)).is_empty());
        assert!(keys_of(&keys::intent_prefix(&other_rk, 0, &other_fp)).is_empty());
        // Shorter and longer ranges than one intent: total order, across prefixes.
        assert_eq!(keys_of(&[keys::Kind::Intent as u8]).len(), 7);
        assert_eq!(keys_of(&keys::intent(&rk, 0, &fp, 2)).len(), 1);
        assert_eq!(keys_of(&[]).len(), 8);
        // A point read of an intent key is unaffected.
        assert_eq!(
            s.get(&keys::intent(&rk, 0, &fp, 1)).unwrap(),
            Some(b"old".to_vec())
        );
    }

    /// A store that cannot be reopened for writing after a failed write (here another
    /// instance holds the directory's lock; in production a full or read-only disk) serves
    /// reads read-only and refuses writes, until a write's reopen succeeds.
    #[test]
    fn reads_are_served_read_only_while_writes_cannot_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let a = RocksStore::open(dir.path(), &StoreOptions::default()).unwrap();
        let mut b = Batch::new();
        b.put(vec![1], vec![1]);
        a.write(b).unwrap();
        // As after a failed write: the next call reopens; meanwhile another opener holds the
        // directory, so the read-write reopen fails.
        a.engine.needs_reopen.store(true, Ordering::Release);
        *a.engine.db.write().unwrap() = None;
        let holder = RocksStore::open(dir.path(), &StoreOptions::default()).unwrap();
        for _ in 0..3 {
            assert_eq!(a.get(&[1]).unwrap(), Some(vec![1]));
            assert_eq!(a.scan(&[1], &[1], 10).unwrap().len(), 1);
            let mut w = Batch::new();
            w.put(vec![2], vec![2]);
            assert!(matches!(a.write(w), Err(StoreError::Engine(_))));
        }
        drop(holder);
        let mut w = Batch::new();
        w.put(vec![2], vec![2]);
        a.write(w).unwrap();
        assert_eq!(a.get(&[2]).unwrap(), Some(vec![2]));
    }

    #[test]
    fn a_torn_wal_tail_dropped_on_recovery_is_reported() {
        let dir = tempfile::tempdir().unwrap();
        {
            let s = RocksStore::open(dir.path(), &StoreOptions::default()).unwrap();
            for i in 0..100u32 {
                let mut b = Batch::new();
                b.put(i.to_be_bytes().to_vec(), vec![7u8; 100]);
                s.write(b).unwrap();
            }
            assert!(s.recovery_losses().is_empty());
        }
        // A crash in the middle of the last WAL append.
        for entry in std::fs::read_dir(dir.path()).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_some_and(|e| e == "log") {
                let len = std::fs::metadata(&path).unwrap().len();
                let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
                f.set_len(len - 30).unwrap();
            }
        }
        let s = RocksStore::open(dir.path(), &StoreOptions::default()).unwrap();
        let losses = s.recovery_losses();
        assert_eq!(losses.len(), 1, "{losses:?}");
        assert!(losses[0].contains("dropping"), "{losses:?}");
        assert_eq!(s.scan(&[], &[], usize::MAX).unwrap().len(), 99);
        drop(s);
        // The next open recovered cleanly: nothing to report.
        let s = RocksStore::open(dir.path(), &StoreOptions::default()).unwrap();
        assert!(s.recovery_losses().is_empty(), "{:?}", s.recovery_losses());
    }

    /// A bulk load writes no WAL: what it wrote is on disk once the store is flushed, and
    /// closing it flushes the rest.
    #[test]
    fn a_bulk_load_is_on_disk_after_a_flush_or_after_closing() {
        let dir = tempfile::tempdir().unwrap();
        let put = |s: &RocksStore, k: u8| {
            let mut b = Batch::new();
            b.put(vec![7, k], vec![k]);
            s.write(b).unwrap();
        };
        {
            let bulk = StoreOptions {
                sync_writes: false,
                ..StoreOptions::default()
            };
            let s = RocksStore::open(dir.path(), &bulk).unwrap();
            put(&s, 1);
            s.flush().unwrap();
            put(&s, 2);
        }
        let mut logged = 0;
        for entry in std::fs::read_dir(dir.path()).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_some_and(|e| e == "log") {
                logged += std::fs::metadata(&path).unwrap().len();
                // Not needed: the SST files alone hold the writes.
                std::fs::remove_file(path).unwrap();
            }
        }
        assert!(logged < 1024, "a bulk load wrote {logged} bytes of WAL");
        let s = RocksStore::open(dir.path(), &StoreOptions::default()).unwrap();
        assert_eq!(s.get(&[7, 1]).unwrap(), Some(vec![1]));
        assert_eq!(s.get(&[7, 2]).unwrap(), Some(vec![2]));
    }

    /// A write outside a section is durable on return, so its stamp is covered at once; one
    /// inside a section is covered only once the section's round is durable.
    #[test]
    fn a_write_stamp_is_covered_exactly_when_the_write_is_durable() {
        let dir = tempfile::tempdir().unwrap();
        let s = RocksStore::open(dir.path(), &StoreOptions::default()).unwrap();
        let put = |k: u8| {
            let mut b = Batch::new();
            b.put(vec![7, k], vec![k]);
            b
        };
        let before = s.durability();
        s.write(put(1)).unwrap();
        let stamp = s.write_stamp(before);
        assert!(s.durability().covers(stamp), "{stamp:?}");

        let mut inside = None;
        s.deferred(&mut || {
            let before = s.durability();
            s.write(put(2)).unwrap();
            let stamp = s.write_stamp(before);
            assert!(
                !s.durability().covers(stamp),
                "staged, not durable: {stamp:?}"
            );
            inside = Some(stamp);
        })
        .unwrap();
        assert!(s.durability().covers(inside.unwrap()));
    }

    #[test]
    fn a_read_never_returns_a_deferred_write_before_it_is_durable() {
        let dir = tempfile::tempdir().unwrap();
        let s = RocksStore::open(dir.path(), &StoreOptions::default()).unwrap();
        let (wrote_tx, wrote_rx) = std::sync::mpsc::channel();
        let (read_tx, read_rx) = std::sync::mpsc::channel();
        let s = &s;
        let in_engine = |key: &[u8]| {
            s.engine
                .with_db_for_read(|db| db.get_cf(cf(db), key).map_err(engine))
                .unwrap()
        };
        std::thread::scope(|scope| {
            scope.spawn(move || {
                s.deferred(&mut || {
                    let mut b = Batch::new();
                    b.put(vec![9, 1], vec![1]);
                    s.write(b).unwrap();
                    // Staged: visible, but not in RocksDB (so not durable) yet.
                    assert_eq!(in_engine(&[9, 1]), None);
                    // Inside the section, reads do not wait for it.
                    assert_eq!(s.get(&[9, 1]).unwrap(), Some(vec![1]));
                    assert_eq!(s.scan(&[9], &[9], 10).unwrap().len(), 1);
                    wrote_tx.send(()).unwrap();
                    read_rx.recv().unwrap();
                })
                .unwrap();
            });
            wrote_rx.recv().unwrap();
            // Another thread sees the write, and only once it is durable.
            assert_eq!(s.get(&[9, 1]).unwrap(), Some(vec![1]));
            assert_eq!(in_engine(&[9, 1]), Some(vec![1]));
            read_tx.send(()).unwrap();
        });
        assert!(s.engine.pipeline.settled());
        let mut b = Batch::new();
        b.put(vec![9, 2], vec![2]);
        s.write(b).unwrap();
        assert_eq!(in_engine(&[9, 2]), Some(vec![2]));
    }

    #[test]
    fn a_deferred_section_is_durable_when_it_returns() {
        let dir = tempfile::tempdir().unwrap();
        {
            let s = RocksStore::open(dir.path(), &StoreOptions::default()).unwrap();
            s.deferred(&mut || {
                for i in 0..10u8 {
                    let mut b = Batch::new();
                    b.put(vec![8, i], vec![i]);
                    s.write(b).unwrap();
                }
            })
            .unwrap();
            assert!(s.engine.pipeline.settled());
        }
        let s = RocksStore::open(dir.path(), &StoreOptions::default()).unwrap();
        assert_eq!(s.scan(&[8], &[8], 100).unwrap().len(), 10);
    }

    /// Scans merge staged writes with RocksDB's: a staged put replaces, a staged delete
    /// hides, and the limit counts what is returned.
    #[test]
    fn scans_see_staged_puts_and_deletes_over_stored_entries() {
        let dir = tempfile::tempdir().unwrap();
        let s = RocksStore::open(dir.path(), &StoreOptions::default()).unwrap();
        let mut b = Batch::new();
        for i in 0..6u8 {
            b.put(vec![5, i], vec![0]);
        }
        s.write(b).unwrap();
        s.deferred(&mut || {
            let mut b = Batch::new();
            b.delete(vec![5, 0]);
            b.delete(vec![5, 1]);
            b.put(vec![5, 2], vec![2]);
            b.put(vec![5, 9], vec![9]);
            s.write(b).unwrap();
            let all = s.scan(&[5], &[5], 100).unwrap();
            assert_eq!(
                all,
                vec![
                    (vec![5, 2], vec![2]),
                    (vec![5, 3], vec![0]),
                    (vec![5, 4], vec![0]),
                    (vec![5, 5], vec![0]),
                    (vec![5, 9], vec![9]),
                ]
            );
            assert_eq!(s.scan(&[5], &[5], 2).unwrap(), all[..2].to_vec());
            assert_eq!(s.scan(&[5], &[5, 4], 100).unwrap(), all[2..].to_vec());
            assert_eq!(s.get(&[5, 0]).unwrap(), None);
        })
        .unwrap();
        // The same once it is all in RocksDB.
        assert!(s.engine.pipeline.settled());
        assert_eq!(s.scan(&[5], &[5], 100).unwrap().len(), 5);
        assert_eq!(s.get(&[5, 0]).unwrap(), None);
    }
}
