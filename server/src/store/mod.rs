//! Storage: the narrow seam between the ledger and the bytes on disk.
//!
//! The ledger needs only point reads, bounded prefix scans and one atomic, durable batch per
//! transition ([`Store`]). `RocksStore` is the embedded implementation and [`MemStore`] an
//! in-memory one for fuzzing and embedding in tests of other crates; a distributed
//! transactional store (TiKV, FoundationDB, a distributed SQL database) can implement the same
//! trait. Keys are built in [`keys`]; values are versioned protobuf bodies ([`codec`]).
//! Besides, a store given a [`Rewrite`] applies it to stored values in the background (RocksDB:
//! a compaction filter); that is how retention drops payloads without writing anything when an
//! effect finishes. A store without one loses nothing but disk space: reads already show every
//! rewrite's result.

pub mod codec;
pub mod keys;
mod mem;
#[cfg_attr(not(feature = "rocksdb"), allow(dead_code))]
mod pipeline;
#[cfg(feature = "rocksdb")]
mod rocks;
#[cfg(feature = "rocksdb")]
pub mod wal_dir;

pub use mem::MemStore;
#[cfg(feature = "rocksdb")]
pub use rocks::{RocksStore, StoreOptions};

/// A rewrite a store applies to stored values as it compacts them, in the background: given a
/// record's key and value, its new value, or `None` to keep it as it is.
///
/// It may only make on disk what every read already shows (the ledger's retention: a record
/// past its window is read as its tombstone, and compaction drops its payload), so that when,
/// or whether, a value is rewritten changes no answer. It must depend only on the key, the
/// value and the clock, and rewriting a rewritten value must keep it.
#[derive(Clone)]
pub struct Rewrite(std::sync::Arc<RewriteFn>);

/// The function a [`Rewrite`] applies.
type RewriteFn = dyn Fn(&[u8], &[u8]) -> Option<Vec<u8>> + Send + Sync;

impl Rewrite {
    /// The rewrite `f` does.
    pub fn new(f: impl Fn(&[u8], &[u8]) -> Option<Vec<u8>> + Send + Sync + 'static) -> Self {
        Self(std::sync::Arc::new(f))
    }

    /// The new value of `key`, or `None` to keep `value`.
    pub fn apply(&self, key: &[u8], value: &[u8]) -> Option<Vec<u8>> {
        (self.0)(key, value)
    }
}

impl std::fmt::Debug for Rewrite {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Rewrite")
    }
}

/// Syncs directory `dir` itself, so that the entries created or renamed in it survive a
/// machine crash (a file's own sync does not cover its name).
pub fn sync_dir(dir: &std::path::Path) -> std::io::Result<()> {
    std::fs::File::open(dir)?.sync_all()
}

/// How RocksDB compresses table files (the WAL is never compressed). A change applies to table
/// files written from then on; older ones keep theirs until compaction rewrites them, and every
/// setting reads them all.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum Compression {
    /// Not compressed: the least CPU per table file, the most disk.
    None,
    /// LZ4 at every level: about 1.8x less disk than `none` for a ledger's records.
    Lz4,
    /// LZ4 while records are still being compacted, ZSTD at the last level, where most of
    /// them end up: about 2.2x less disk than `none`, for a little more compaction CPU.
    #[default]
    Lz4Zstd,
}

/// A storage failure. The ledger never acknowledges anything a failed write contained.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The engine refused or failed the operation (disk full, read-only, I/O error...).
    #[error("storage engine error: {0}")]
    Engine(String),
    /// A stored value could not be decoded (corruption or a record from a newer version).
    #[error("corrupt record under key {key}: {why}")]
    Corrupt {
        /// The key, hex-encoded.
        key: String,
        /// What failed.
        why: String,
    },
}

/// One write in a [`Batch`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Op {
    /// Set `key` to `value`.
    Put(Vec<u8>, Vec<u8>),
    /// Remove `key`.
    Delete(Vec<u8>),
}

impl Op {
    /// The key and the value it sets (`None`: the key is removed).
    pub fn write(&self) -> (&[u8], Option<&[u8]>) {
        match self {
            Op::Put(k, v) => (k, Some(v)),
            Op::Delete(k) => (k, None),
        }
    }
}

/// The writes of one transition, applied atomically.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Batch {
    ops: Vec<Op>,
}

impl Batch {
    /// An empty batch.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a put.
    pub fn put(&mut self, key: Vec<u8>, value: Vec<u8>) {
        self.ops.push(Op::Put(key, value));
    }

    /// Adds a delete.
    pub fn delete(&mut self, key: Vec<u8>) {
        self.ops.push(Op::Delete(key));
    }

    /// True when there is nothing to write.
    pub fn is_empty(&self) -> bool {
        self.ops.is_empty()
    }

    /// The writes, in order.
    pub fn ops(&self) -> &[Op] {
        &self.ops
    }
}

/// Key-value pairs returned by [`Store::scan`], in key order.
pub type Entries = Vec<(Vec<u8>, Vec<u8>)>;

/// What runs once a deferred section's writes are durable ([`Store::deferred_then`]): it gets
/// the sync's result, `Err` when nothing the section computed may be acknowledged.
pub type Then = Box<dyn FnOnce(Result<(), StoreError>) + Send>;

/// Where a store's writes stand, for caches of what was written ([`Store::durability`]):
/// anything written while `generation` stays the same, in a round up to `durable_through`, is
/// durable; `open_epoch` is the round a write made now is staged in at the latest.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Durability {
    /// Bumped whenever a round fails: what was staged before it may be lost.
    pub generation: u64,
    /// Every round up to this one is resolved.
    pub durable_through: u64,
    /// The round writes are staged in now.
    pub open_epoch: u64,
}

impl Durability {
    /// A store whose writes are durable when they return (nothing is staged).
    pub const IMMEDIATE: Durability = Durability {
        generation: 0,
        durable_through: u64::MAX,
        open_epoch: 0,
    };

    /// Is a write stamped `stamp` (the generation before it, the open round after it) durable
    /// now, and nothing failed since it was made?
    pub fn covers(&self, stamp: Durability) -> bool {
        self.generation == stamp.generation && self.durable_through >= stamp.open_epoch
    }
}

/// A key-value store with atomic durable batches: what the ledger needs from storage.
///
/// Contract: `write` returns only after the whole batch is durable (on RocksDB: WAL fsynced);
/// a failed `write` applied nothing. Reads see every acknowledged write.
pub trait Store: Send + Sync + 'static {
    /// Reads one key.
    fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, StoreError>;
    /// Returns up to `limit` entries whose key starts with `prefix` and is `>= from`
    /// (pass `prefix` itself to start at the beginning), in key order.
    fn scan(&self, prefix: &[u8], from: &[u8], limit: usize) -> Result<Entries, StoreError>;
    /// Applies the batch atomically and durably.
    fn write(&self, batch: Batch) -> Result<(), StoreError>;

    /// Runs `f` with this thread's writes deferred, then makes them durable with one sync.
    ///
    /// Inside `f`, each [`write`](Store::write) is applied atomically and visible to every
    /// later read at once, but not synced; when `f` returns the store syncs once, and only
    /// if that succeeds does this return `Ok`: everything `f` wrote is then durable. On
    /// `Err`, any of `f`'s writes may or may not have survived, so nothing computed inside
    /// `f` may be acknowledged. Other threads never answer from a deferred write that is not
    /// yet durable (a store that defers makes a read that may have seen one wait until it is
    /// durable). This is how a batch of decisions shares one `fdatasync`. A section inside another
    /// section defers to it: the outer one syncs.
    ///
    /// The default runs `f` with ordinary durable writes.
    fn deferred(&self, f: &mut dyn FnMut()) -> Result<(), StoreError> {
        f();
        Ok(())
    }

    /// [`Store::deferred`] without waiting: runs `f` as a deferred section and calls the
    /// continuation it returns with the sync's result once the section's writes, and every
    /// not yet durable write it read, are durable. The continuation may run on another thread
    /// (a store's committer), after this returns, so it must not block; meanwhile the caller
    /// can go on to its next section. This is how a sequencer decides its next group while
    /// the last one is being written.
    ///
    /// The default runs `f` inside [`Store::deferred`] and then the continuation.
    fn deferred_then(&self, f: Box<dyn FnOnce() -> Then + '_>) {
        let mut f = Some(f);
        let mut then = None;
        let synced = self.deferred(&mut || then = f.take().map(|f| f()));
        if let Some(then) = then {
            then(synced);
        }
    }

    /// Applies the batch atomically, without waiting for it to be durable: for audit data no
    /// answer depends on (a crash may lose it, and everything written after it with it, but
    /// never a durable write). Reads see it at once. The default writes durably.
    fn write_unsynced(&self, batch: Batch) -> Result<(), StoreError> {
        self.write(batch)
    }

    /// Compacts everything stored now, applying the store's [`Rewrite`] to each value, and
    /// returns once done. A store rewrites in the background anyway; this is for tests and
    /// for an operator who wants it done at once. The default has nothing to compact.
    fn compact(&self) -> Result<(), StoreError> {
        Ok(())
    }

    /// Where the store's writes stand. A cache of written values stamps each with the
    /// generation read before the write and the open round read after it, and uses it only
    /// while [`Durability::covers`] the stamp: a value whose round is not durable yet must be
    /// read from the store, which makes the reader's answer wait for that round. The default
    /// is a store whose writes are durable when they return.
    fn durability(&self) -> Durability {
        Durability::IMMEDIATE
    }

    /// The stamp of what this thread has just written, `before` being the durability read
    /// before the write: the generation then, and the round the write was in or any later
    /// one. The default, the round open after the write, is right for every store (it is
    /// made durable no earlier than the write's); a store that knows the write's own round
    /// returns it, so that a value written outside a deferred section (durable on return) is
    /// usable at once.
    fn write_stamp(&self, before: Durability) -> Durability {
        Durability {
            open_epoch: self.durability().open_epoch,
            ..before
        }
    }
}
