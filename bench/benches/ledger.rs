//! One state-machine decision, `Ledger::begin`, on an existing run over a real RocksDB in a
//! temp dir (WAL synced, as in production): the replay path (known step key, same intent, one
//! durable write for the replay counter), the new-effect path (a new step key: one durable
//! batch), and the refusal path (a duplicate intent: no write, the pure decision cost).

use std::hint::black_box;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use criterion::{Criterion, criterion_main};
use fence_server::clock::SystemClock;
use fence_server::ledger::{BeginCmd, Decision, Ledger, LedgerConfig, OpClass, Outcome, ToolDef};
use fence_server::store::{RocksStore, StoreOptions};

const TENANT: &str = "bench";
const RUN: &str = "run-1";
const TOOL: &str = "bank.transfer";

fn transfer(step_key: &str, amount: u64, reference: u64) -> BeginCmd {
    BeginCmd {
        run_id: RUN.into(),
        tool: TOOL.into(),
        step_key: step_key.into(),
        arguments_json: format!(
            r#"{{"to":"acct-4711","amount":{amount},"currency":"EUR","ref":"ref-{reference:016x}","ts":"2026-03-01T10:00:{:02}Z"}}"#,
            reference % 60
        ),
        ..Default::default()
    }
}

fn ledger(dir: &std::path::Path) -> Ledger<RocksStore> {
    let store = RocksStore::open(dir, &StoreOptions::default()).expect("open store");
    let ledger = Ledger::new(
        store,
        Arc::new(SystemClock),
        LedgerConfig {
            credential_key: [9; 32],
            ..LedgerConfig::default()
        },
    );
    ledger
        .register_tool(
            TENANT,
            ToolDef {
                name: TOOL.into(),
                class: OpClass::NonRetryable.code(),
                volatile_fields: vec!["ref".into(), "ts".into()],
                ..Default::default()
            },
        )
        .expect("register tool");
    ledger
}

fn granted(d: Decision) -> String {
    match d {
        Decision::Execute { receipt, .. } => receipt.id().to_string(),
        other => panic!("expected Execute, got {}", other.kind()),
    }
}

fn begin(c: &mut Criterion) {
    let dir = tempfile::tempdir().expect("temp dir");
    let ledger = ledger(dir.path());
    // An existing run with one completed effect.
    let first = granted(
        ledger
            .begin(TENANT, &transfer("step-0", 100, 0))
            .unwrap()
            .decision,
    );
    ledger
        .complete(TENANT, &first, 1, 0, Outcome::Completed(b"tx-1".to_vec()))
        .unwrap();
    // The same call without a step key is refused as a duplicate intent (no write).
    let mut no_key = transfer("", 100, 1);
    no_key.step_key.clear();

    let mut group = c.benchmark_group("ledger_begin");
    group.sample_size(30);
    group.measurement_time(Duration::from_secs(8));
    let reference = AtomicU64::new(1);
    group.bench_function("replay_existing_step", |b| {
        b.iter(|| {
            // A re-issued call: same step key and intent, fresh volatile fields.
            let r = reference.fetch_add(1, Ordering::Relaxed);
            let cmd = transfer("step-0", 100, r);
            let d = ledger.begin(TENANT, black_box(&cmd)).unwrap().decision;
            assert!(matches!(d, Decision::Replay(_)), "{}", d.kind());
        })
    });
    let step = AtomicU64::new(1);
    group.bench_function("new_effect", |b| {
        b.iter(|| {
            let s = step.fetch_add(1, Ordering::Relaxed);
            let cmd = transfer(&format!("step-{s}"), 100 + s, s);
            let d = ledger.begin(TENANT, black_box(&cmd)).unwrap().decision;
            assert!(matches!(d, Decision::Execute { .. }), "{}", d.kind());
        })
    });
    group.bench_function("refuse_duplicate_intent_no_write", |b| {
        b.iter(|| {
            let d = ledger.begin(TENANT, black_box(&no_key)).unwrap().decision;
            assert!(matches!(d, Decision::Refused(_)), "{}", d.kind());
        })
    });
    group.finish();
}

// In a private module: `criterion_group!` makes a public function without docs.
mod group {
    criterion::criterion_group!(benches, super::begin);
}
criterion_main!(group::benches);
