//! The record format version: a new data dir is marked, one written before versions were
//! recorded is migrated on open (and its records still read), and one written by a newer
//! format is refused with a message saying what to run instead.

use std::sync::Arc;

use fence_server::clock::SystemClock;
use fence_server::ledger::format::{FORMAT_VERSION, FormatCheck, FormatRecord};
use fence_server::ledger::{BeginCmd, Decision};
use fence_server::server::{ServeError, open_ledger};
use fence_server::store::{Batch, Store, codec, keys};

/// A ledger as `fenced` opens it.
type Served = fence_server::ledger::Ledger<fence_server::store::RocksStore>;

fn open(dir: &std::path::Path) -> Result<Served, ServeError> {
    open_ledger(
        &fence_server::Config::with_data_dir(dir),
        Arc::new(SystemClock),
    )
}

fn format_of(ledger: &Served) -> Option<u32> {
    let bytes = ledger.store().get(&keys::meta()).unwrap()?;
    Some(
        codec::decode::<FormatRecord>(&keys::meta(), &bytes)
            .unwrap()
            .version,
    )
}

/// Marks the data dir as written in `version` by release `written_by`.
fn mark_format(batch: &mut Batch, version: u32, written_by: &str) {
    batch.put(
        keys::meta(),
        codec::encode(&FormatRecord {
            version,
            written_by: written_by.into(),
        }),
    );
}

fn call(step: &str) -> BeginCmd {
    BeginCmd {
        run_id: "r".into(),
        tool: "pay".into(),
        step_key: step.into(),
        arguments_json: r#"{"amount":1}"#.into(),
        ..Default::default()
    }
}

#[test]
fn a_new_data_dir_is_marked_with_the_current_format() {
    let dir = tempfile::tempdir().unwrap();
    let ledger = open(dir.path()).unwrap();
    assert_eq!(format_of(&ledger), Some(FORMAT_VERSION));
    assert_eq!(ledger.open_format().unwrap(), FormatCheck::Current);
}

#[test]
fn a_data_dir_from_before_format_versions_is_migrated_and_still_read() {
    let dir = tempfile::tempdir().unwrap();
    let recorded = {
        let ledger = open(dir.path()).unwrap();
        let Decision::Execute { receipt, .. } = ledger.begin("t", &call("s1")).unwrap().decision
        else {
            panic!("expected a grant")
        };
        // As written before versions: no format record, and a run that lists no tool versions.
        let mut batch = Batch::new();
        batch.delete(keys::meta());
        let rk = keys::run_key("t", "r");
        let bytes = ledger.store().get(&keys::run(&rk)).unwrap().unwrap();
        let mut run: fence_server::ledger::records::RunRecord =
            codec::decode(&keys::run(&rk), &bytes).unwrap();
        run.tracks_tool_versions = false;
        run.tool_versions.clear();
        batch.put(keys::run(&rk), codec::encode(&run));
        // Nor the indexes of later formats (runs by tenant, open effects).
        batch.delete(keys::tenant_run(&keys::tenant_key("t"), "r"));
        batch.delete(keys::open(&rk, receipt.seq));
        ledger.store().write(batch).unwrap();
        receipt
    };
    let ledger = open(dir.path()).unwrap();
    assert_eq!(format_of(&ledger), Some(FORMAT_VERSION));
    // The migration indexed the run and its open effect.
    assert_eq!(ledger.list_runs("t", "", 0, "").unwrap().0.len(), 1);
    assert_eq!(ledger.open_census().unwrap().accepted, 1);
    let report = ledger.verify();
    assert!(report.is_sound(), "{:?}", report.problems);
    // The old run's effect is found as before: the same step is the same effect.
    match ledger
        .begin(
            "t",
            &BeginCmd {
                request_id: String::new(),
                ..call("s1")
            },
        )
        .unwrap()
        .decision
    {
        Decision::InProgress { receipt, .. } => assert_eq!(receipt.id(), recorded.id()),
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_data_dir_in_a_newer_format_is_refused_naming_what_to_run() {
    let dir = tempfile::tempdir().unwrap();
    {
        let ledger = open(dir.path()).unwrap();
        let mut batch = Batch::new();
        mark_format(&mut batch, FORMAT_VERSION + 1, "9.9.9");
        ledger.store().write(batch).unwrap();
    }
    let err = match open(dir.path()) {
        Ok(_) => panic!("a newer format was opened"),
        Err(e) => e,
    };
    let message = err.to_string();
    assert!(matches!(err, ServeError::Format(_)), "{message}");
    assert!(
        message.contains(&format!("format {}", FORMAT_VERSION + 1)),
        "{message}"
    );
    assert!(message.contains("fenced 9.9.9"), "{message}");
}

#[test]
fn a_format_2_data_dir_gets_its_runs_indexed_and_listed() {
    let dir = tempfile::tempdir().unwrap();
    // More runs than the migration indexes in one batch, in two tenants.
    let ids: Vec<String> = (0..1100).map(|i| format!("run-{i:05}")).collect();
    {
        let ledger = open(dir.path()).unwrap();
        ledger
            .store()
            .deferred(&mut || {
                for (i, id) in ids.iter().enumerate() {
                    let tenant = if i % 2 == 0 { "a" } else { "b" };
                    ledger.start_run(tenant, id).unwrap();
                }
            })
            .unwrap();
        // As format 2 wrote it: no run index.
        let mut batch = Batch::new();
        for (i, id) in ids.iter().enumerate() {
            let tenant = if i % 2 == 0 { "a" } else { "b" };
            batch.delete(keys::tenant_run(&keys::tenant_key(tenant), id));
        }
        mark_format(&mut batch, 2, "0.1.0");
        ledger.store().write(batch).unwrap();
        assert!(ledger.list_runs("a", "", 0, "").unwrap().0.is_empty());
    }
    let ledger = open(dir.path()).unwrap();
    assert_eq!(format_of(&ledger), Some(FORMAT_VERSION));
    for (tenant, parity) in [("a", 0), ("b", 1)] {
        let mut listed = Vec::new();
        let mut token = String::new();
        loop {
            let (page, next) = ledger.list_runs(tenant, "", 1000, &token).unwrap();
            listed.extend(page.into_iter().map(|v| v.run.run_id));
            if next.is_empty() {
                break;
            }
            token = next;
        }
        let expected: Vec<String> = ids
            .iter()
            .enumerate()
            .filter(|(i, _)| i % 2 == parity)
            .map(|(_, id)| id.clone())
            .collect();
        assert_eq!(listed, expected, "tenant {tenant}");
    }
}

/// Format 5: a run record is rewritten only every few effects, so the one on disk lags; a
/// reopened data dir (nothing cached) still numbers the next effect right after the last and
/// counts every effect. A format-4 data dir (exact records) is migrated without a rewrite.
#[test]
fn a_reopened_data_dir_numbers_after_the_last_effect_though_its_run_record_lags() {
    let dir = tempfile::tempdir().unwrap();
    let effects = 3 * fence_server::ledger::RUN_RECORD_EVERY + 3;
    {
        let ledger = open(dir.path()).unwrap();
        for n in 1..=effects {
            let cmd = BeginCmd {
                arguments_json: format!(r#"{{"amount":{n}}}"#),
                ..call(&format!("s{n}"))
            };
            let Decision::Execute { receipt, .. } = ledger.begin("t", &cmd).unwrap().decision
            else {
                panic!("expected a grant")
            };
            assert_eq!(receipt.seq, n);
        }
        let rk = keys::run_key("t", "r");
        let bytes = ledger.store().get(&keys::run(&rk)).unwrap().unwrap();
        let stored: fence_server::ledger::records::RunRecord =
            codec::decode(&keys::run(&rk), &bytes).unwrap();
        assert!(stored.next_seq <= effects, "the stored record lags");
        // As format 4 marked it (its records were exact; these lag, which format 5 reads).
        let mut batch = Batch::new();
        mark_format(&mut batch, 4, "0.1.0");
        ledger.store().write(batch).unwrap();
    }
    let ledger = open(dir.path()).unwrap();
    assert_eq!(format_of(&ledger), Some(FORMAT_VERSION));
    let view = ledger.get_run("t", "r").unwrap();
    assert_eq!(view.run.next_seq, effects + 1);
    assert_eq!(view.run.branches[0].length, effects);
    let next = BeginCmd {
        arguments_json: r#"{"amount":0}"#.into(),
        ..call("next")
    };
    let Decision::Execute { receipt, .. } = ledger.begin("t", &next).unwrap().decision else {
        panic!("expected a grant")
    };
    assert_eq!(receipt.seq, effects + 1, "numbered right after the last");
    let report = ledger.verify();
    assert!(report.is_sound(), "{:?}", report.problems);
}

/// Format 6: the write-ahead log may live outside the data dir. A format-5 data dir is
/// migrated without a rewrite (its effects replay as before), and once its log is in a
/// directory of its own the data dir says format 6 or later, which every earlier `fenced`
/// refuses instead of opening it without its log.
#[test]
fn a_format_5_data_dir_is_migrated_and_keeps_its_effects_with_its_log_elsewhere() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let wal = dir.path().join("wal");
    {
        let ledger = open(&data).unwrap();
        ledger.begin("t", &call("s1")).unwrap();
        let mut batch = Batch::new();
        mark_format(&mut batch, 5, "0.1.0");
        ledger.store().write(batch).unwrap();
    }
    let config = fence_server::Config {
        wal_dir: Some(wal.clone()),
        ..fence_server::Config::with_data_dir(&data)
    };
    let ledger = open_ledger(&config, Arc::new(SystemClock)).unwrap();
    assert_eq!(format_of(&ledger), Some(FORMAT_VERSION));
    let again = ledger.begin("t", &call("s1")).unwrap().decision;
    assert!(
        matches!(again, Decision::InProgress { .. }),
        "the effect begun under format 5 is still there, in progress: {again:?}"
    );
    drop(ledger);
    match open(&data) {
        Ok(_) => panic!("opened without its write-ahead log"),
        Err(e) => assert!(e.to_string().contains("--wal-dir"), "{e}"),
    }
}

/// Format 7: a finished effect is no longer indexed by expiry; the store's compaction makes it
/// a tombstone. A format-6 data dir keeps its expiry entries, and the sweep still turns the
/// effects they name into tombstones as they fall due and takes the entries out.
#[test]
fn a_format_6_data_dirs_expiry_entries_are_still_swept_and_new_effects_need_none() {
    let dir = tempfile::tempdir().unwrap();
    let rk = keys::run_key("t", "r");
    let finish = |ledger: &Served, step: &str| {
        let cmd = BeginCmd {
            arguments_json: format!(r#"{{"amount":1,"to":"{step}"}}"#),
            ..call(step)
        };
        let decision = ledger.begin("t", &cmd).unwrap().decision;
        let Decision::Execute { receipt, .. } = decision else {
            panic!("expected a grant: {decision:?}")
        };
        ledger
            .complete(
                "t",
                &receipt.id().to_string(),
                receipt.attempt,
                0,
                fence_server::ledger::Outcome::Completed(b"paid".to_vec()),
            )
            .unwrap()
    };
    let stored = |ledger: &Served, seq: u64| {
        let key = keys::effect(&rk, seq);
        codec::decode::<fence_server::ledger::records::EffectRecord>(
            &key,
            &ledger.store().get(&key).unwrap().unwrap(),
        )
        .unwrap()
    };
    let expiry_entries = |ledger: &Served| {
        let prefix = keys::expiry_prefix();
        ledger
            .store()
            .scan(&prefix, &prefix, usize::MAX)
            .unwrap()
            .len()
    };
    let old = {
        let ledger = open(dir.path()).unwrap();
        ledger
            .register_tool(
                "t",
                fence_server::ledger::ToolDef {
                    name: "pay".into(),
                    class: 4,
                    retention_ms: 1,
                    ..Default::default()
                },
            )
            .unwrap();
        let old = finish(&ledger, "s1");
        assert_eq!(
            expiry_entries(&ledger),
            0,
            "format 7 writes no expiry entry"
        );
        // As format 6 left it: the finished effect in the expiry index.
        let mut batch = Batch::new();
        mark_format(&mut batch, 6, "0.1.0");
        batch.put(keys::expiry(old.expires_at_ms, &rk, old.seq), Vec::new());
        ledger.store().write(batch).unwrap();
        old
    };
    let ledger = open(dir.path()).unwrap();
    assert_eq!(format_of(&ledger), Some(FORMAT_VERSION));
    let new = finish(&ledger, "s2");
    std::thread::sleep(std::time::Duration::from_millis(5));
    assert_eq!(ledger.sweep_expired(100).unwrap(), 1);
    assert_eq!(expiry_entries(&ledger), 0);
    assert!(stored(&ledger, old.seq).tombstone, "swept");
    assert!(
        !stored(&ledger, new.seq).tombstone,
        "the sweep never saw the new effect"
    );
    // fenced's store compacts with retention applied: the new effect's payload goes too.
    ledger.store().compact().unwrap();
    let new = stored(&ledger, new.seq);
    assert!(new.tombstone && new.result.is_empty(), "{new:?}");
    let report = ledger.verify();
    assert!(report.is_sound(), "{:?}", report.problems);
}
