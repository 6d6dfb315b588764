//! Shared harness for the ledger tests: a real RocksDB ledger in a temp dir with a manual clock.
#![allow(dead_code)]

pub mod fenced;

use std::sync::Arc;

use fence_server::clock::ManualClock;
use fence_server::ledger::records::EffectRecord;
use fence_server::ledger::{
    BeginCmd, Decision, Ledger, LedgerConfig, LedgerError, OpClass, Reason, Refusal, ToolDef,
};
use fence_server::store::{Batch, Entries, MemStore, RocksStore, Store, StoreError, StoreOptions};

pub const T: &str = "tenant-a";
pub const LEASE: u64 = 10_000;
pub const RETENTION: u64 = 3_600_000;

/// The store under a test ledger: RocksDB in a temp dir, or, with `FENCE_TEST_STORE=mem`, the
/// in-memory store, so that every ledger rule is shown to hold whatever the storage engine
/// (`scripts/test.sh` runs the ledger suites both ways).
pub enum TestStore {
    Rocks(RocksStore),
    Mem(MemStore),
}

impl TestStore {
    fn store(&self) -> &dyn Store {
        match self {
            TestStore::Rocks(s) => s,
            TestStore::Mem(s) => s,
        }
    }
}

impl Store for TestStore {
    fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, StoreError> {
        self.store().get(key)
    }
    fn scan(&self, prefix: &[u8], from: &[u8], limit: usize) -> Result<Entries, StoreError> {
        self.store().scan(prefix, from, limit)
    }
    fn write(&self, batch: Batch) -> Result<(), StoreError> {
        self.store().write(batch)
    }
    fn deferred(&self, f: &mut dyn FnMut()) -> Result<(), StoreError> {
        self.store().deferred(f)
    }
    fn write_unsynced(&self, batch: Batch) -> Result<(), StoreError> {
        self.store().write_unsynced(batch)
    }
    fn compact(&self) -> Result<(), StoreError> {
        self.store().compact()
    }
}

pub struct Harness {
    pub ledger: Ledger<TestStore>,
    pub clock: ManualClock,
    pub dir: tempfile::TempDir,
}

/// A ledger over the store `FENCE_TEST_STORE` names (RocksDB by default; see [`TestStore`]).
pub fn harness() -> Harness {
    let mem = match std::env::var("FENCE_TEST_STORE").as_deref() {
        Ok("mem") => true,
        Ok("rocksdb") | Err(_) => false,
        Ok(other) => panic!("FENCE_TEST_STORE={other:?}: use rocksdb or mem"),
    };
    harness_on(mem)
}

/// A ledger over RocksDB whatever `FENCE_TEST_STORE` says: for tests of what is on disk.
pub fn rocksdb_harness() -> Harness {
    harness_on(false)
}

fn harness_on(mem: bool) -> Harness {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(1_700_000_000_000);
    // Compaction applies retention as `fenced`'s store does.
    let rewrite = fence_server::ledger::expiry::retention_rewrite(Arc::new(clock.clone()));
    let store = if mem {
        TestStore::Mem(MemStore::with_rewrite(rewrite))
    } else {
        let opts = StoreOptions {
            rewrite: Some(rewrite),
            ..StoreOptions::default()
        };
        TestStore::Rocks(RocksStore::open(dir.path(), &opts).unwrap())
    };
    let config = LedgerConfig {
        default_lease_ms: LEASE,
        default_retention_ms: RETENTION,
        credential_key: [7; 32],
        ..LedgerConfig::default()
    };
    let ledger = Ledger::new(store, Arc::new(clock.clone()), config);
    // Marked as fenced marks a new data dir, so `verify` checks it as a served store.
    ledger.open_format().unwrap();
    Harness { ledger, clock, dir }
}

impl Harness {
    pub fn tool(&self, name: &str, class: OpClass, volatile: &[&str]) {
        self.ledger
            .register_tool(
                T,
                ToolDef {
                    name: name.into(),
                    class: class.code(),
                    volatile_fields: volatile.iter().map(|s| s.to_string()).collect(),
                    ..Default::default()
                },
            )
            .unwrap();
    }

    pub fn begin(&self, cmd: &BeginCmd) -> Decision {
        self.ledger.begin(T, cmd).unwrap().decision
    }

    /// The store's records are sound (`Ledger::verify`): each decodes, belongs to its run,
    /// and the indexes agree with the records (the open-effect index included).
    #[track_caller]
    pub fn assert_sound(&self) {
        let report = self.ledger.verify();
        assert!(report.is_sound(), "{:#?}", report.problems);
    }

    /// Every key and value in the store: to prove a refusal changed nothing.
    pub fn snapshot(&self) -> Vec<(Vec<u8>, Vec<u8>)> {
        self.ledger.store().scan(&[], &[], usize::MAX).unwrap()
    }
}

/// Cases of a property test: `default` in CI, `PROPTEST_CASES` when set (a longer search for a
/// rare interleaving).
pub fn cases(default: u32) -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(default)
}

pub fn call(run: &str, tool: &str, args: &str) -> BeginCmd {
    BeginCmd {
        run_id: run.into(),
        tool: tool.into(),
        arguments_json: args.into(),
        ..Default::default()
    }
}

pub fn keyed(run: &str, step: &str, tool: &str, args: &str) -> BeginCmd {
    BeginCmd {
        step_key: step.into(),
        ..call(run, tool, args)
    }
}

#[track_caller]
pub fn executed(d: Decision) -> EffectRecord {
    match d {
        Decision::Execute { receipt, recorded } => {
            assert!(recorded, "expected a recorded grant");
            *receipt
        }
        other => panic!("expected Execute, got {other:?}"),
    }
}

#[track_caller]
pub fn replayed(d: Decision) -> EffectRecord {
    match d {
        Decision::Replay(r) => *r,
        other => panic!("expected Replay, got {other:?}"),
    }
}

#[track_caller]
pub fn refused(d: Decision, reason: Reason) -> Refusal {
    match d {
        Decision::Refused(r) if r.reason == reason => *r,
        other => panic!("expected refusal {reason:?}, got {other:?}"),
    }
}

#[track_caller]
pub fn refused_err<T: std::fmt::Debug>(r: Result<T, LedgerError>, reason: Reason) -> Refusal {
    match r {
        Err(LedgerError::Refused(x)) if x.reason == reason => *x,
        other => panic!("expected refusal {reason:?}, got {other:?}"),
    }
}

#[track_caller]
pub fn invalid<T: std::fmt::Debug>(r: Result<T, LedgerError>, field: &str) {
    match r {
        Err(LedgerError::InvalidArgument { field: f, .. }) if f == field => {}
        other => panic!("expected InvalidArgument on {field}, got {other:?}"),
    }
}

pub fn complete(h: &Harness, rec: &EffectRecord, result: &str) -> EffectRecord {
    h.ledger
        .complete(
            T,
            &rec.id().to_string(),
            rec.attempt,
            0,
            fence_server::ledger::Outcome::Completed(result.as_bytes().to_vec()),
        )
        .unwrap()
}
