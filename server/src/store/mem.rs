//! An in-memory [`Store`]: a sorted map behind a lock. Not durable; for fuzzing the ledger and for
//! tests that need no disk. It passes the same conformance suite as the RocksDB store.

use std::collections::BTreeMap;
use std::ops::Bound;
use std::sync::Mutex;

use super::{Batch, Entries, Op, Rewrite, Store, StoreError};

/// A [`Store`] in memory.
#[derive(Debug, Default)]
pub struct MemStore {
    map: Mutex<BTreeMap<Vec<u8>, Vec<u8>>>,
    /// Applied to every value by [`Store::compact`], the only compaction this store has.
    rewrite: Option<Rewrite>,
}

impl MemStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }

    /// An empty store whose [`Store::compact`] applies `rewrite`.
    pub fn with_rewrite(rewrite: Rewrite) -> Self {
        Self {
            rewrite: Some(rewrite),
            ..Self::default()
        }
    }

    fn map(&self) -> std::sync::MutexGuard<'_, BTreeMap<Vec<u8>, Vec<u8>>> {
        // A panic while holding the lock cannot leave a half-applied batch: batches are applied
        // to a copy-free map only after validation, and `write` never panics midway.
        self.map.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Store for MemStore {
    fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, StoreError> {
        Ok(self.map().get(key).cloned())
    }

    fn scan(&self, prefix: &[u8], from: &[u8], limit: usize) -> Result<Entries, StoreError> {
        let start = if from < prefix { prefix } else { from };
        Ok(self
            .map()
            .range::<[u8], _>((Bound::Included(start), Bound::Unbounded))
            .take_while(|(k, _)| k.starts_with(prefix))
            .take(limit)
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect())
    }

    fn write(&self, batch: Batch) -> Result<(), StoreError> {
        let mut map = self.map();
        for op in batch.ops() {
            match op {
                Op::Put(k, v) => {
                    map.insert(k.clone(), v.clone());
                }
                Op::Delete(k) => {
                    map.remove(k);
                }
            }
        }
        Ok(())
    }

    fn compact(&self) -> Result<(), StoreError> {
        if let Some(rewrite) = &self.rewrite {
            for (k, v) in self.map().iter_mut() {
                if let Some(new) = rewrite.apply(k, v) {
                    *v = new;
                }
            }
        }
        Ok(())
    }
}
