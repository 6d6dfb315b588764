//! A durable store transition: `RocksStore::write` of the batches the ledger really writes
//! for one effect (captured from a real `Ledger::begin` and `Ledger::complete`), WAL synced.
//! This is the floor under every acknowledged decision: one fsync'd RocksDB write.

use std::hint::black_box;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use criterion::{Criterion, Throughput, criterion_main};
use fence_server::clock::SystemClock;
use fence_server::ledger::{BeginCmd, Decision, Ledger, LedgerConfig, Outcome};
use fence_server::store::{Batch, Op, RocksStore, Store, StoreError, StoreOptions};

/// A store that remembers the last batch it wrote.
struct Capturing {
    inner: RocksStore,
    last: Mutex<Option<Batch>>,
}

impl Store for Capturing {
    fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, StoreError> {
        self.inner.get(key)
    }

    fn scan(
        &self,
        prefix: &[u8],
        from: &[u8],
        limit: usize,
    ) -> Result<Vec<(Vec<u8>, Vec<u8>)>, StoreError> {
        self.inner.scan(prefix, from, limit)
    }

    fn write(&self, batch: Batch) -> Result<(), StoreError> {
        *self.last.lock().expect("lock") = Some(batch.clone());
        self.inner.write(batch)
    }
}

/// The batches of a new effect (begin) and of its completion, as the ledger writes them.
fn typical_batches(dir: &std::path::Path) -> (Batch, Batch) {
    let store = Capturing {
        inner: RocksStore::open(dir, &StoreOptions::default()).expect("open"),
        last: Mutex::new(None),
    };
    let ledger = Ledger::new(store, Arc::new(SystemClock), LedgerConfig::default());
    let cmd = BeginCmd {
        run_id: "wf-2026-03-01-7f3a".into(),
        tool: "bank.transfer".into(),
        step_key: "wf-2026-03-01-7f3a:pay-supplier".into(),
        arguments_json: r#"{"to":"acct-4711","amount":1250.5,"currency":"EUR","ref":"9b1deb4d-3b7d-4bad-9bdd-2b0d7b3dcb6d","ts":"2026-03-01T10:00:00Z"}"#.into(),
        ..Default::default()
    };
    let Decision::Execute { receipt, .. } = ledger.begin("tenant-a", &cmd).unwrap().decision else {
        panic!("expected a grant");
    };
    let begin = ledger.store().last.lock().unwrap().take().expect("a batch");
    ledger
        .complete(
            "tenant-a",
            &receipt.id().to_string(),
            1,
            0,
            Outcome::Completed(br#"{"transfer_id":"tx-000042","status":"settled"}"#.to_vec()),
        )
        .unwrap();
    let complete = ledger.store().last.lock().unwrap().take().expect("a batch");
    (begin, complete)
}

fn bytes(batch: &Batch) -> u64 {
    batch
        .ops()
        .iter()
        .map(|op| match op {
            Op::Put(k, v) => k.len() + v.len(),
            Op::Delete(k) => k.len(),
        } as u64)
        .sum()
}

fn write(c: &mut Criterion) {
    let capture_dir = tempfile::tempdir().expect("temp dir");
    let (begin, complete) = typical_batches(capture_dir.path());
    let dir = tempfile::tempdir().expect("temp dir");
    let store = RocksStore::open(dir.path(), &StoreOptions::default()).expect("open");
    let mut group = c.benchmark_group("rocks_store_write_synced");
    group.sample_size(30);
    group.measurement_time(Duration::from_secs(8));
    for (name, batch) in [("begin_batch", &begin), ("complete_batch", &complete)] {
        group.throughput(Throughput::Bytes(bytes(batch)));
        group.bench_function(format!("{name}_{}_ops", batch.ops().len()), |b| {
            b.iter_batched(
                || batch.clone(),
                |batch| store.write(black_box(batch)).expect("write"),
                criterion::BatchSize::SmallInput,
            )
        });
    }
    group.finish();
}

// In a private module: `criterion_group!` makes a public function without docs.
mod group {
    criterion::criterion_group!(benches, super::write);
}
criterion_main!(group::benches);
