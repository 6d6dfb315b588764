//! Decoded records kept between a run's decisions: run records, so that a Begin does not read
//! and decode its run record again, and the records of effects just begun, so that their
//! Complete does not read and decode them again.
//!
//! Coherence rests on three rules the ledger keeps:
//! - every ledger write goes through [`super::Ledger::commit`], which drops the entry of any
//!   run or effect whose record the batch writes, before writing;
//! - an entry is put only by the decision that wrote that very record, under its run's lock,
//!   stamped with the store's [`Durability`] (the generation before the write, the open round
//!   after it); every writer of a run's records holds that lock;
//! - an entry is used only while the store's durability covers its stamp: its round is
//!   durable and no round failed since. Otherwise the record is read from the store, which
//!   makes the reader's answer wait for a round not yet durable, and sees nothing a failed
//!   round lost.
//!
//! A decision *takes* the entry (no copy): if it then writes nothing the next one reads the
//! store. A cache holds at most `capacity` records and is emptied when full, which bounds its
//! memory without bookkeeping per use.

use std::hash::Hash;
use std::sync::{Mutex, MutexGuard};

use foldhash::{HashMap, HashMapExt as _};

use crate::store::Durability;

struct Entry<V> {
    stamp: Durability,
    value: V,
}

/// Decoded records by key (see the module docs).
pub(crate) struct RecordCache<K, V> {
    entries: Mutex<HashMap<K, Entry<V>>>,
    capacity: usize,
}

impl<K: Hash + Eq, V> RecordCache<K, V> {
    /// A cache of at most `capacity` records (0: none).
    pub(crate) fn new(capacity: usize) -> Self {
        Self {
            entries: Mutex::new(HashMap::new()),
            capacity,
        }
    }

    fn entries(&self) -> MutexGuard<'_, HashMap<K, Entry<V>>> {
        // Every change under the lock is a single insert or remove: a panic elsewhere cannot
        // leave the map inconsistent.
        self.entries.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Takes the record out, if it is cached and durable as of `now`.
    pub(crate) fn take(&self, key: &K, now: Durability) -> Option<V> {
        if self.capacity == 0 {
            return None;
        }
        let entry = self.entries().remove(key)?;
        now.covers(entry.stamp).then_some(entry.value)
    }

    /// Keeps `value`, just written with `stamp`.
    pub(crate) fn put(&self, key: K, stamp: Durability, value: V) {
        if self.capacity == 0 {
            return;
        }
        let mut entries = self.entries();
        if entries.len() >= self.capacity && !entries.contains_key(&key) {
            entries.clear();
        }
        entries.insert(key, Entry { stamp, value });
    }

    /// Forgets the record (it is being written by someone else).
    pub(crate) fn forget(&self, key: &K) {
        if self.capacity == 0 {
            return;
        }
        self.entries().remove(key);
    }

    /// Records held.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.entries().len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ledger::records::RunRecord;
    use crate::ledger::test_support::{pay, pay_ledger};
    use crate::store::keys::RunKey;

    type RunCache = RecordCache<RunKey, RunRecord>;

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
    /// one, its counts caught up), and a write of the run by another path (a checkpoint)
    /// forgets it.
    #[test]
    fn a_ledger_keeps_the_record_it_wrote_and_forgets_it_when_another_write_changes_it() {
        use crate::ledger::runs::CheckpointCmd;
        use crate::store::keys;

        let ledger = pay_ledger();
        let rk = keys::run_key("t", "r");
        let stored = || ledger.load_run(&rk, "t", "r").unwrap().unwrap();
        for n in 0..3u64 {
            pay(&ledger, n);
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

    /// Through a ledger: a Begin keeps the record of the effect it recorded (equal to the
    /// stored one); its Complete takes it, answers from it and writes the right record;
    /// another tenant naming the effect finds nothing even while it is cached; and any other
    /// write of the effect forgets it.
    #[test]
    fn a_ledger_keeps_a_begun_effect_for_its_complete_and_forgets_it_when_written() {
        use crate::ledger::records::EffectRecord;
        use crate::ledger::{LedgerError, Outcome, State};
        use crate::store::{Batch, Store, codec, keys};

        let ledger = pay_ledger();
        let rk = keys::run_key("t", "r");
        let stored = |seq: u64| {
            let key = keys::effect(&rk, seq);
            let bytes = ledger.store().get(&key).unwrap().unwrap();
            codec::decode::<EffectRecord>(&key, &bytes).unwrap()
        };
        let begin = |n: u64| pay(&ledger, n);

        let first = begin(1);
        let cached = ledger
            .effect_cache
            .take(&(rk, first.seq), Durability::IMMEDIATE)
            .expect("the Begin kept the effect it recorded");
        assert_eq!(cached, stored(first.seq));
        ledger
            .effect_cache
            .put((rk, first.seq), Durability::IMMEDIATE, cached);

        // Another tenant naming the effect: unknown, as when it is read from the store.
        let id = first.id().to_string();
        let other = ledger.complete("u", &id, first.attempt, 1, Outcome::Completed(vec![9]));
        assert!(
            matches!(other, Err(LedgerError::Refused(ref r)) if r.reason == crate::ledger::Reason::UnknownRecord),
            "{other:?}"
        );

        // Its Complete (the entry was taken by the refusal above; put it back as a Begin
        // would) answers and writes the completed record, and leaves nothing cached.
        ledger
            .effect_cache
            .put((rk, first.seq), Durability::IMMEDIATE, stored(first.seq));
        let done = ledger
            .complete("t", &id, first.attempt, 1, Outcome::Completed(vec![7]))
            .unwrap();
        assert_eq!(done.state(), State::Completed);
        assert_eq!(stored(first.seq).result, vec![7]);
        assert_eq!(stored(first.seq).state(), State::Completed);
        assert!(
            ledger
                .effect_cache
                .take(&(rk, first.seq), Durability::IMMEDIATE)
                .is_none()
        );

        // Any other write of the effect forgets it.
        let second = begin(2);
        let mut batch = Batch::new();
        batch.put(keys::effect(&rk, second.seq), codec::encode(&second));
        ledger.commit(batch).unwrap();
        assert!(
            ledger
                .effect_cache
                .take(&(rk, second.seq), Durability::IMMEDIATE)
                .is_none(),
            "a write of the effect forgot the cached record"
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
