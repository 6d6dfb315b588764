//! Retention: finished effects past their window become tombstones.
//!
//! Reads treat an expired record as its tombstone (`EffectRecord::view`), so a later matching
//! call is answered EXPIRED, never executed as new. The store makes it so on disk as it
//! compacts ([`retention_rewrite`]), dropping the payload and keeping identity, fingerprints
//! and the final state: nothing is written for it when an effect finishes, and nothing read or
//! written again when its window ends. Data dirs written before format 7 also hold an expiry
//! index (by time), which [`Ledger::sweep_expired`] drains.
//!
//! The same background pass counts the effects not settled yet ([`Ledger::open_census`]) from
//! the open-effect index, for the gauges an operator alerts on.

use std::sync::Arc;

use super::records::EffectRecord;
use super::{Ledger, Result, State, retention_passed};
use crate::clock::Clock;
use crate::store::{Batch, Rewrite, Store, codec, keys};

/// What the store's compaction does to the ledger's records: a finished effect past its
/// retention window (by `clock`) becomes its tombstone. Every other record is kept, and so is
/// a record that does not decode (`verify` reports it; compaction must not hide it).
pub fn retention_rewrite(clock: Arc<dyn Clock>) -> Rewrite {
    Rewrite::new(move |key, value| {
        if key.first() != Some(&(keys::Kind::Effect as u8)) {
            return None;
        }
        // Compaction passes every effect record several times in its life: the two fields
        // first, the whole record (its strings allocated) only when it is due.
        let due: RetentionFields = codec::decode(key, value).ok()?;
        if due.tombstone || !retention_passed(due.expires_at_ms, clock.now_ms()) {
            return None;
        }
        let mut rec: EffectRecord = codec::decode(key, value).ok()?;
        rec.make_tombstone();
        crate::metrics::retention_tombstone();
        Some(codec::encode(&rec))
    })
}

/// The fields of an [`EffectRecord`] retention reads, under the same tags: decoding them
/// skips every other field without allocating.
#[derive(Clone, PartialEq, prost::Message)]
struct RetentionFields {
    #[prost(uint64, tag = "24")]
    expires_at_ms: u64,
    #[prost(bool, tag = "25")]
    tombstone: bool,
}

impl<S: Store> Ledger<S> {
    /// Turns up to `limit` records named by the expiry index (written before format 7) into
    /// tombstones as they fall due, taking their entries out; returns how many entries were
    /// processed (0 = nothing was due).
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
                if rec.due_for_tombstone(now) {
                    rec.make_tombstone();
                    batch.put(effect_key, codec::encode(&rec));
                }
            }
            batch.delete(key);
            self.commit(batch)?;
            processed += 1;
        }
        Ok(processed)
    }

    /// Counts the effects not settled yet, by their state as of now (a lapsed lease counts
    /// as unknown), reading the open-effect index and each effect it names.
    pub fn open_census(&self) -> Result<OpenCensus> {
        let now = self.now();
        let mut census = OpenCensus::default();
        let prefix = keys::open_prefix();
        self.walk(&prefix, prefix.clone(), 256, |chunk| {
            for (key, _) in chunk {
                let Some((rk, seq)) = keys::decode_open(key) else {
                    continue;
                };
                let Some(rec) = self.get::<EffectRecord>(&keys::effect(&rk, seq))? else {
                    continue;
                };
                let lapsed = now >= rec.lease_expires_at_ms;
                match rec.state() {
                    State::Accepted if !lapsed => census.accepted += 1,
                    State::Running if !lapsed => census.running += 1,
                    _ => census.unknown += 1,
                }
            }
            Ok(std::ops::ControlFlow::Continue(()))
        })?;
        Ok(census)
    }

    /// A page of `tenant`'s effects not settled yet, across its runs, as of now (a lapsed
    /// lease reads EFFECT_UNKNOWN), optionally only those in `state`, and the next page's
    /// token (`""`: done). Read from the open-effect index, which holds every tenant's.
    pub fn list_unsettled(
        &self,
        tenant: &str,
        state: Option<State>,
        page_size: u32,
        page_token: &str,
    ) -> Result<(Vec<EffectRecord>, String)> {
        if let Some(s) = state
            && !matches!(s, State::Accepted | State::Running | State::EffectUnknown)
        {
            return Err(super::LedgerError::invalid(
                "state",
                "an unsettled effect is ACCEPTED, RUNNING or EFFECT_UNKNOWN",
            ));
        }
        let prefix = keys::open_prefix();
        let mut from = prefix.clone();
        if !page_token.is_empty() {
            let rest = codec::unhex(page_token)
                .filter(|b| b.len() == 24)
                .ok_or_else(|| {
                    super::LedgerError::invalid("page_token", "is not a token this server issued")
                })?;
            from.extend_from_slice(&rest);
        }
        let now = self.now();
        let (effects, next) = self.page(&prefix, from, page_size, |k, _| {
            let Some((rk, seq)) = keys::decode_open(k) else {
                return Ok(None);
            };
            let key = keys::effect(&rk, seq);
            let Some(bytes) = self.store.get(&key)? else {
                return Ok(None);
            };
            let rec: EffectRecord = codec::decode(&key, &bytes)?;
            if rec.tenant != tenant {
                return Ok(None);
            }
            let view = rec.view(now);
            let wanted = view.is_open() && state.is_none_or(|s| view.state() == s);
            Ok(wanted.then_some((view, bytes.len())))
        })?;
        let token = next.map_or_else(String::new, |k| codec::hex(&k[1..]));
        Ok((effects, token))
    }
}

/// The effects not settled yet, by state (see [`Ledger::open_census`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OpenCensus {
    /// Granted, lease live, no progress reported.
    pub accepted: u64,
    /// Granted, lease live, heartbeated.
    pub running: u64,
    /// Outcome unknown (a lapsed lease, or reported so): only a reconcile settles them.
    pub unknown: u64,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::ManualClock;

    fn finished(expires_at_ms: u64) -> (Vec<u8>, Vec<u8>) {
        let rec = EffectRecord {
            tenant: "t".into(),
            run_id: "r".into(),
            seq: 3,
            state: State::Completed.code(),
            result: b"paid".to_vec(),
            arguments_json: r#"{"amount":1}"#.into(),
            intent_fp: vec![7; 32],
            expires_at_ms,
            ..Default::default()
        };
        (
            keys::effect(&keys::run_key("t", "r"), 3),
            codec::encode(&rec),
        )
    }

    #[test]
    fn retention_reads_the_record_s_own_fields() {
        let (key, value) = finished(1234);
        let mut rec: EffectRecord = codec::decode(&key, &value).unwrap();
        let fields: RetentionFields = codec::decode(&key, &value).unwrap();
        assert_eq!(fields.expires_at_ms, 1234);
        assert!(!fields.tombstone);
        rec.make_tombstone();
        let fields: RetentionFields = codec::decode(&key, &codec::encode(&rec)).unwrap();
        assert!(fields.tombstone && fields.expires_at_ms == 1234);
    }

    #[test]
    fn compaction_makes_a_record_due_its_tombstone_and_keeps_everything_else() {
        let clock = ManualClock::new(1000);
        let rewrite = retention_rewrite(Arc::new(clock.clone()));
        let (key, value) = finished(2000);
        assert_eq!(rewrite.apply(&key, &value), None, "not due yet");
        let (open, open_value) = finished(0);
        clock.advance(1000);
        let tomb = rewrite.apply(&key, &value).expect("due");
        let rec: EffectRecord = codec::decode(&key, &tomb).unwrap();
        let mut expected: EffectRecord = codec::decode(&key, &value).unwrap();
        expected.make_tombstone();
        assert_eq!(rec, expected);
        assert_eq!(
            rewrite.apply(&key, &tomb),
            None,
            "a tombstone stays as it is"
        );
        assert_eq!(rewrite.apply(&open, &open_value), None, "not finished");
        let run = keys::run(&keys::run_key("t", "r"));
        assert_eq!(rewrite.apply(&run, &value), None, "not an effect");
        assert_eq!(
            rewrite.apply(&key, b"\xffjunk"),
            None,
            "undecodable: kept for verify"
        );
    }

    #[cfg(feature = "rocksdb")]
    #[test]
    fn each_tombstone_compaction_makes_is_counted() {
        let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
        let handle = recorder.handle();
        let clock = ManualClock::new(5000);
        let rewrite = retention_rewrite(Arc::new(clock));
        metrics::with_local_recorder(&recorder, || {
            let (key, value) = finished(2000);
            let tomb = rewrite.apply(&key, &value).unwrap();
            assert_eq!(rewrite.apply(&key, &tomb), None);
            let (key, value) = finished(9000);
            assert_eq!(rewrite.apply(&key, &value), None);
        });
        let text = handle.render();
        assert!(
            text.lines()
                .any(|l| l == "fence_retention_tombstones_total 1"),
            "{text}"
        );
    }
}
