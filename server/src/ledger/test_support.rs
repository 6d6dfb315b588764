//! Ledgers and calls shared by the ledger's unit tests.

/// A ledger over the in-memory store with tenant "t"'s NON_RETRYABLE tool "pay".
pub(crate) fn pay_ledger() -> crate::ledger::Ledger<crate::store::MemStore> {
    use crate::ledger::{Ledger, LedgerConfig, OpClass, ToolDef};
    let ledger = Ledger::new(
        crate::store::MemStore::new(),
        std::sync::Arc::new(crate::clock::SystemClock),
        LedgerConfig::default(),
    );
    let tool = ToolDef {
        name: "pay".into(),
        class: OpClass::NonRetryable.code(),
        ..Default::default()
    };
    ledger.register_tool("t", tool).unwrap();
    ledger
}

/// Begins step `s{n}` of run "r" with new arguments: a new effect, granted.
pub(crate) fn pay(
    ledger: &crate::ledger::Ledger<crate::store::MemStore>,
    n: u64,
) -> crate::ledger::records::EffectRecord {
    use crate::ledger::{BeginCmd, Decision};
    let cmd = BeginCmd {
        run_id: "r".into(),
        tool: "pay".into(),
        step_key: format!("s{n}"),
        arguments_json: format!("{{\"n\":{n}}}"),
        ..Default::default()
    };
    match ledger.begin("t", &cmd).unwrap().decision {
        Decision::Execute { receipt, .. } => *receipt,
        other => panic!("expected a grant, got {other:?}"),
    }
}
