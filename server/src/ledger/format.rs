//! The stored records' format version: checked when a data dir is opened, so a `fenced` never
//! reads records it does not understand, and an older layout is migrated before anything is
//! served.
//!
//! Versions:
//! 1. The layout before the version was recorded (every data dir written before 2026-12-04).
//! 2. Runs list the tool versions their effects were fingerprinted under (`RunRecord` fields 8
//!    and 9). A version-1 run reads with `tracks_tool_versions = false` and is looked up under
//!    every version of a tool, so the migration from 1 rewrites no record: it records the
//!    version.
//! 3. Each tenant's runs are indexed by run id (`keys::tenant_run`, what `ListRuns` reads).
//!    The migration from 1 or 2 adds the index entry of every stored run.
//! 4. Effects not settled yet are indexed (`keys::open`, what the effect-state gauges read).
//!    The migration from 1 to 3 adds the entry of every stored effect that is open.
//! 5. A run record's counts (`next_seq`, each branch's `length`) may lag its effects: a Begin
//!    that changes nothing else rewrites it only every [`super::RUN_RECORD_EVERY`] effects,
//!    and readers catch the counts up from the branch log entries past the stored lengths.
//!    Earlier records are exact, so the migration rewrites nothing; an earlier `fenced` must
//!    not open a format-5 data dir, since it would trust the lagging counts and number two
//!    effects alike.
//! 6. The store's write-ahead log may live outside its directory (`--wal-dir`, recorded by
//!    [`crate::store::wal_dir::MARKER`]). No record changes, so the migration rewrites
//!    nothing; the version exists so that an earlier `fenced`, which knows nothing of the
//!    marker, refuses the data dir instead of opening it without its log and losing every
//!    acknowledged write not yet in a table file.
//! 7. A finished effect is no longer put in the expiry index: the store's compaction makes it
//!    a tombstone once its window has passed ([`super::expiry::retention_rewrite`]). Entries
//!    written before stay and are drained by [`Ledger::sweep_expired`] as they fall due, so
//!    the migration rewrites nothing; an earlier `fenced` must not open a format-7 data dir,
//!    since it would keep the payloads of effects finished under format 7 on disk forever.

use super::records::{EffectRecord, RunRecord};
use super::{Ledger, LedgerError, Result};
use crate::store::{Batch, Store, codec, keys};

/// The format this code writes and reads.
pub const FORMAT_VERSION: u32 = 7;

/// The store's format record (key [`keys::meta`]).
#[derive(Clone, PartialEq, prost::Message)]
pub struct FormatRecord {
    /// The format version of every record in the store.
    #[prost(uint32, tag = "1")]
    pub version: u32,
    /// The `fenced` release that last wrote the version.
    #[prost(string, tag = "2")]
    pub written_by: String,
}

/// What opening found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FormatCheck {
    /// An empty store, now marked with the current version.
    Created,
    /// Already the current version.
    Current,
    /// Migrated from this older version to the current one.
    Migrated {
        /// The version found.
        from: u32,
    },
}

impl<S: Store> Ledger<S> {
    /// Checks the store's format version before anything is served: marks a new store,
    /// migrates an older layout, and refuses a newer one (written by a later `fenced`).
    pub fn open_format(&self) -> Result<FormatCheck> {
        let key = keys::meta();
        let found = match self.store.get(&key)? {
            Some(bytes) => Some(codec::decode::<FormatRecord>(&key, &bytes)?),
            None => None,
        };
        let check = match found {
            Some(f) if f.version == FORMAT_VERSION => return Ok(FormatCheck::Current),
            Some(f) if f.version > FORMAT_VERSION => {
                return Err(LedgerError::invalid(
                    "data_dir",
                    format!(
                        "this data dir holds ledger format {} (written by fenced {}); this fenced {} reads formats up to {FORMAT_VERSION}. Run fenced {} or later on it, or restore a backup taken before the upgrade.",
                        f.version,
                        f.written_by,
                        env!("CARGO_PKG_VERSION"),
                        f.written_by
                    ),
                ));
            }
            Some(f) => FormatCheck::Migrated { from: f.version },
            None if self.store.scan(&[], &[], 1)?.is_empty() => FormatCheck::Created,
            None => FormatCheck::Migrated { from: 1 },
        };
        if let FormatCheck::Migrated { from } = check {
            if from < 3 {
                self.index_every_run()?;
            }
            if from < 4 {
                self.index_open_effects()?;
            }
        }
        // The version is written last: a migration cut short runs again on the next open
        // (each of its steps may be repeated).
        let mut batch = Batch::new();
        batch.put(
            key,
            codec::encode(&FormatRecord {
                version: FORMAT_VERSION,
                written_by: env!("CARGO_PKG_VERSION").to_owned(),
            }),
        );
        self.commit(batch)?;
        if let FormatCheck::Migrated { from } = check {
            tracing::warn!(
                from,
                to = FORMAT_VERSION,
                "migrated the ledger's record format"
            );
        }
        Ok(check)
    }

    /// Format 3: adds every stored run to its tenant's run index.
    fn index_every_run(&self) -> Result<()> {
        self.migrate_each(&keys::run_prefix(), |batch, k, v| {
            let run: RunRecord = codec::decode(k, v)?;
            super::runs::index_new_run(batch, &run.tenant, &run.run_id);
            Ok(())
        })
    }

    /// Format 4: adds every open effect to the open-effect index.
    fn index_open_effects(&self) -> Result<()> {
        self.migrate_each(&keys::effect_kind_prefix(), |batch, k, v| {
            let rec: EffectRecord = codec::decode(k, v)?;
            if let Some((rk, _)) = keys::decode_effect(k)
                && rec.is_open()
            {
                batch.put(keys::open(&rk, rec.seq), Vec::new());
            }
            Ok(())
        })
    }

    /// Calls `each` for every record under `prefix`, writing what it adds a chunk of records
    /// per batch.
    fn migrate_each(
        &self,
        prefix: &[u8],
        mut each: impl FnMut(&mut Batch, &[u8], &[u8]) -> Result<()>,
    ) -> Result<()> {
        self.walk(prefix, prefix.to_vec(), 1024, |chunk| {
            let mut batch = Batch::new();
            for (k, v) in chunk {
                each(&mut batch, k, v)?;
            }
            if !batch.is_empty() {
                self.commit(batch)?;
            }
            Ok(std::ops::ControlFlow::Continue(()))
        })
    }
}
