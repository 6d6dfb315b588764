//! Decoded run records, kept between a run's decisions so that a Begin does not read and
//! decode its run record again.
//!
//! Coherence rests on three rules the ledger keeps:
//! - every ledger write goes through [`super::Ledger::commit`], which drops the entry of any
//!   run whose record the batch writes, before writing;
//! - an entry is put back only by the Begin that wrote that very record, under its run's
//!   lock, stamped with the store's [`Durability`] (the generation before the write, the
//!   open round after it);
//! - an entry is used only while the store's durability covers its stamp: its round is
//!   durable and no round failed since. Otherwise the record is read from the store, which
//!   makes the reader's answer wait for a round not yet durable, and sees nothing a failed
//!   round lost.
//!
//! A Begin *takes* the entry (no copy): if it then writes nothing the next one reads the
//! store. The cache holds at most `capacity` runs and is emptied when full, which bounds its
//! memory without bookkeeping per use.

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard};

use super::records::RunRecord;
use crate::store::Durability;
use crate::store::keys::RunKey;

struct Entry {
    stamp: Durability,
    run: RunRecord,
}

/// Run records by run key (see the module docs).
pub(crate) struct RunCache {
    entries: Mutex<HashMap<RunKey, Entry>>,
    capacity: usize,
}

impl RunCache {
    /// A cache of at most `capacity` runs (0: none).
    pub(crate) fn new(capacity: usize) -> Self {
        Self {
            entries: Mutex::new(HashMap::new()),
            capacity,
        }
    }

    fn entries(&self) -> MutexGuard<'_, HashMap<RunKey, Entry>> {
        // Every change under the lock is a single insert or remove: a panic elsewhere cannot
        // leave the map inconsistent.
        self.entries.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Takes the run's record out, if it is cached and durable as of `now`.
    pub(crate) fn take(&self, rk: &RunKey, now: Durability) -> Option<RunRecord> {
        if self.capacity == 0 {
            return None;
        }
        let entry = self.entries().remove(rk)?;
        now.covers(entry.stamp).then_some(entry.run)
    }

    /// Keeps `run`, just written with `stamp`.
    pub(crate) fn put(&self, rk: RunKey, stamp: Durability, run: RunRecord) {
        if self.capacity == 0 {
            return;
        }
        let mut entries = self.entries();
        if entries.len() >= self.capacity && !entries.contains_key(&rk) {
            entries.clear();
        }
        entries.insert(rk, Entry { stamp, run });
    }

    /// Forgets the run's record (it is being written by someone else).
    pub(crate) fn forget(&self, rk: &RunKey) {
        if self.capacity == 0 {
            return;
        }
        self.entries().remove(rk);
    }

    /// Runs held.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.entries().len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stamp(generation: u64, open_epoch: u64) -> Durability {
        Durability {
            generation,
            durable_through: 0,
            open_epoch,
        }
    }

    fn now(generation: u64, durable_through: u64) -> Durability {
        Durability {
            generation,
            durable_through,
            open_epoch: durable_through + 1,
        }
    }

    fn run(next_seq: u64) -> RunRecord {
        RunRecord {
            next_seq,
            ..Default::default()
        }
    }

    #[test]
    fn a_record_is_used_only_once_its_round_is_durable_and_nothing_failed() {
        let cache = RunCache::new(8);
        let rk = [7; 16];
        // Its round (5) is not durable yet: read the store (and the entry is gone).
        cache.put(rk, stamp(1, 5), run(3));
        assert!(cache.take(&rk, now(1, 4)).is_none());
        assert!(
            cache.take(&rk, now(1, 5)).is_none(),
            "taken entries are gone"
        );
        // Durable: used, and taken out.
        cache.put(rk, stamp(1, 5), run(3));
        assert_eq!(cache.take(&rk, now(1, 5)).unwrap().next_seq, 3);
        assert!(cache.take(&rk, now(1, 5)).is_none());
        // A round failed since it was written: never used, even once later rounds are durable.
        cache.put(rk, stamp(1, 5), run(3));
        assert!(cache.take(&rk, now(2, 9)).is_none());
        // Forgotten when someone else writes the run.
        cache.put(rk, stamp(2, 9), run(4));
        cache.forget(&rk);
        assert!(cache.take(&rk, now(2, 9)).is_none());
        // A store whose writes are durable at once.
        cache.put(rk, Durability::IMMEDIATE, run(5));
        assert_eq!(cache.take(&rk, Durability::IMMEDIATE).unwrap().next_seq, 5);
    }

    /// Through a ledger: each Begin keeps exactly the record it wrote (equal to the stored
    /// one), and a write of the run by another path (a checkpoint) forgets it.
    #[test]
    fn a_ledger_keeps_the_record_it_wrote_and_forgets_it_when_another_write_changes_it() {
        use crate::clock::SystemClock;
        use crate::ledger::runs::CheckpointCmd;
        use crate::ledger::{BeginCmd, Decision, Ledger, LedgerConfig, OpClass, ToolDef};
        use crate::store::{MemStore, Store, codec, keys};

        let ledger = Ledger::new(
            MemStore::new(),
            std::sync::Arc::new(SystemClock),
            LedgerConfig::default(),
        );
        let tool = ToolDef {
            name: "pay".into(),
            class: OpClass::NonRetryable.code(),
            ..Default::default()
        };
        ledger.register_tool("t", tool).unwrap();
        let rk = keys::run_key("t", "r");
        let stored = || {
            let bytes = ledger.store().get(&keys::run(&rk)).unwrap().unwrap();
            codec::decode::<RunRecord>(&keys::run(&rk), &bytes).unwrap()
        };
        for n in 0..3u64 {
            let cmd = BeginCmd {
                run_id: "r".into(),
                tool: "pay".into(),
                step_key: format!("s{n}"),
                arguments_json: format!("{{\"n\":{n}}}"),
                ..Default::default()
            };
            let begun = ledger.begin("t", &cmd).unwrap();
            assert!(matches!(begun.decision, Decision::Execute { .. }));
            let cached = ledger
                .run_cache
                .take(&rk, Durability::IMMEDIATE)
                .expect("the Begin kept the record it wrote");
            assert_eq!(cached, stored());
            assert_eq!(cached.next_seq, n + 2);
            ledger.run_cache.put(rk, Durability::IMMEDIATE, cached);
        }
        let checkpoint = CheckpointCmd {
            run_id: "r".into(),
            checkpoint_id: "cp".into(),
            ..Default::default()
        };
        ledger.checkpoint("t", &checkpoint).unwrap();
        assert!(
            ledger.run_cache.take(&rk, Durability::IMMEDIATE).is_none(),
            "the checkpoint's write of the run forgot the cached record"
        );
    }

    #[test]
    fn the_cache_holds_at_most_its_capacity_and_none_at_zero() {
        let cache = RunCache::new(3);
        for i in 0..10u8 {
            cache.put([i; 16], Durability::IMMEDIATE, run(i as u64));
            assert!(cache.len() <= 3);
        }
        assert_eq!(
            cache
                .take(&[9; 16], Durability::IMMEDIATE)
                .unwrap()
                .next_seq,
            9
        );
        let off = RunCache::new(0);
        off.put([1; 16], Durability::IMMEDIATE, run(1));
        assert!(off.take(&[1; 16], Durability::IMMEDIATE).is_none());
    }
}
