//! Retention: finished effects past their window become tombstones.
//!
//! Reads already treat an expired record as its tombstone (`EffectRecord::view`); the sweep
//! makes it so on disk, dropping the payload and keeping identity, fingerprints and the final
//! state, so a later matching call is answered EXPIRED, never executed as new. The expiry index
//! orders records by expiry time, so a sweep reads only what is due.

use super::Ledger;
use super::Result;
use super::records::EffectRecord;
use crate::store::{Batch, Store, codec, keys};

impl<S: Store> Ledger<S> {
    /// Turns up to `limit` expired records into tombstones; returns how many index entries
    /// were processed (0 = nothing was due).
    pub fn sweep_expired(&self, limit: usize) -> Result<usize> {
        let now = self.now();
        let prefix = keys::expiry_prefix();
        let due = self.store.scan(&prefix, &prefix, limit)?;
        let mut processed = 0;
        for (key, _) in due {
            let Some((at, rk, seq)) = keys::decode_expiry(&key) else {
                continue;
            };
            if at > now {
                break;
            }
            let _guard = self.runs.lock(&rk);
            let mut batch = Batch::new();
            let effect_key = keys::effect(&rk, seq);
            if let Some(mut rec) = self.get::<EffectRecord>(&effect_key)? {
                // The entry may be stale (the effect was granted again since): only a record
                // whose current expiry has passed becomes a tombstone.
                if !rec.tombstone && rec.expires_at_ms != 0 && rec.expires_at_ms <= now {
                    rec.make_tombstone();
                    batch.put(effect_key, codec::encode(&rec));
                }
            }
            batch.delete(key);
            self.store.write(batch)?;
            processed += 1;
        }
        Ok(processed)
    }
}
