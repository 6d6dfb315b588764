//! Ledgers and calls shared by the ledger's unit tests.

/// A ledger over the in-memory store with tenant "t"'s NON_RETRYABLE tool "pay".
pub(crate) fn pay_ledger() -> crate::ledger::Ledger<crate::store::MemStore> {
    pay_ledger_with(crate::ledger::LedgerConfig::default())
}

/// [`pay_ledger`] with `config`.
pub(crate) fn pay_ledger_with(
    config: crate::ledger::LedgerConfig,
) -> crate::ledger::Ledger<crate::store::MemStore> {
    use crate::ledger::{Ledger, OpClass, ToolDef};
    let ledger = Ledger::new(
        crate::store::MemStore::new(),
        std::sync::Arc::new(crate::clock::SystemClock),
        config,
    );
    let tool = ToolDef {
        name: "pay".into(),
        class: OpClass::NonRetryable.code(),
        ..Default::default()
    };
    ledger.register_tool("t", tool).unwrap();
    ledger
}

/// A call of "pay" in `run`, at step `step`, with arguments `{"n": n}`.
pub(crate) fn pay_call(run: &str, step: &str, n: u64) -> crate::ledger::BeginCmd {
    crate::ledger::BeginCmd {
        run_id: run.into(),
        tool: "pay".into(),
        step_key: step.into(),
        arguments_json: format!("{{\"n\":{n}}}"),
        ..Default::default()
    }
}

/// Begins step `s{n}` of run "r" with new arguments: a new effect, granted.
pub(crate) fn pay(
    ledger: &crate::ledger::Ledger<crate::store::MemStore>,
    n: u64,
) -> crate::ledger::records::EffectRecord {
    use crate::ledger::Decision;
    let cmd = pay_call("r", &format!("s{n}"), n);
    match ledger.begin("t", &cmd).unwrap().decision {
        Decision::Execute { receipt, .. } => *receipt,
        other => panic!("expected a grant, got {other:?}"),
    }
}

/// Through a ledger whose caches are off (every Begin reads its run): the stored run record
/// is rewritten only every `RUN_RECORD_EVERY` effects, yet every Begin numbers its effect
/// right after the last, views count every effect, a checkpoint and a restore after a lagging
/// record place and find the recorded effects, and the store verifies clean.
#[test]
fn a_lagging_run_record_is_caught_up_by_every_reader() {
    use crate::ledger::runs::CheckpointCmd;
    use crate::ledger::{BeginCmd, Decision, LedgerConfig, RUN_RECORD_EVERY};
    use crate::store::{Store, codec, keys};

    let mut config = LedgerConfig::default();
    config.limits.max_cached_runs = 0;
    config.limits.max_cached_effects = 0;
    let ledger = pay_ledger_with(config);
    ledger.open_format().unwrap();
    let rk = keys::run_key("t", "r");
    let raw = || {
        let bytes = ledger.store().get(&keys::run(&rk)).unwrap().unwrap();
        codec::decode::<crate::ledger::records::RunRecord>(&keys::run(&rk), &bytes).unwrap()
    };
    let total = 2 * RUN_RECORD_EVERY + 22;
    for n in 0..total {
        assert_eq!(
            pay(&ledger, n).seq,
            n + 1,
            "effect {n} numbered after the last"
        );
        if n == RUN_RECORD_EVERY + 5 {
            let cp = CheckpointCmd {
                run_id: "r".into(),
                checkpoint_id: "cp".into(),
                ..Default::default()
            };
            ledger.checkpoint("t", &cp).unwrap();
        }
    }
    let stored = raw();
    assert!(
        stored.next_seq < total + 1,
        "the record is not rewritten by every Begin (next_seq {})",
        stored.next_seq
    );
    let view = ledger.get_run("t", "r").unwrap();
    assert_eq!(view.run.next_seq, total + 1);
    assert_eq!(view.run.branches[0].length, total);
    assert_eq!(view.checkpoints[0].position, RUN_RECORD_EVERY + 6);
    let (listed, _) = ledger.list_runs("t", "", 10, "").unwrap();
    assert_eq!(listed[0].run.next_seq, total + 1);
    let report = ledger.verify();
    assert!(report.problems.is_empty(), "{:?}", report.problems);

    // Restored to the checkpoint: the effects after it replay in order.
    let restored = ledger.restore("t", "r", "cp", 0).unwrap();
    let n = RUN_RECORD_EVERY + 6;
    let cmd = BeginCmd {
        run_id: "r".into(),
        tool: "pay".into(),
        step_key: format!("s{n}"),
        arguments_json: format!("{{\"n\":{n}}}"),
        epoch: restored.epoch,
        ..Default::default()
    };
    // Never completed, so it is answered as in progress: the same effect, not a new one.
    match ledger.begin("t", &cmd).unwrap().decision {
        Decision::InProgress { receipt, .. } => assert_eq!(receipt.seq, n + 1),
        other => panic!(
            "expected the recorded effect {} found, got {other:?}",
            n + 1
        ),
    }
}
