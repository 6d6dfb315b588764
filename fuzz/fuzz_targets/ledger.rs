//! The ledger's request handling under arbitrary operation sequences (including malformed input):
//! it never panics, never grants one effect twice while a lease is live, never changes a
//! completed result, and never spends a credential beyond its budget.
#![no_main]

use std::collections::HashMap;
use std::sync::Arc;

use arbitrary::Arbitrary;
use fence_server::clock::{Clock, ManualClock};
use fence_server::ledger::credentials::CredentialDef;
use fence_server::ledger::runs::{CheckpointCmd, ForkCmd};
use fence_server::ledger::{
    BeginCmd, CredentialUse, Decision, EffectId, Finding, Ledger, LedgerConfig, OpClass, Outcome,
    ToolDef,
};
use fence_server::store::{MemStore, Store};
use libfuzzer_sys::fuzz_target;

const T: &str = "t";
const TOOLS: [&str; 3] = ["nr", "dd", "ec"];

#[derive(Arbitrary, Debug)]
enum Op {
    Begin {
        tool: u8,
        intent: u8,
        step: Option<u8>,
        deliberate: bool,
        token: Option<u8>,
        branch: u8,
        epoch: u8,
        raw_args: Option<String>,
        raw_run: Option<String>,
    },
    Complete { grant: u8, outcome: u8, result: u8 },
    Reconcile { grant: u8, happened: bool, evidence: String },
    Heartbeat { grant: u8 },
    Advance { ms: u16 },
    Checkpoint { branch: u8 },
    Restore { cp: u8 },
    Fork { cp: u8 },
    Sweep,
}

fuzz_target!(|ops: Vec<Op>| {
    let clock = ManualClock::new(1_000_000);
    let config = LedgerConfig {
        default_lease_ms: 1000,
        default_retention_ms: 5000,
        ..LedgerConfig::default()
    };
    let store = MemStore::with_rewrite(fence_server::ledger::expiry::retention_rewrite(Arc::new(
        clock.clone(),
    )));
    let ledger = Ledger::new(store, Arc::new(clock.clone()), config);
    for (name, class) in TOOLS.iter().zip([OpClass::NonRetryable, OpClass::Deduplicate, OpClass::RequiresEffectCheck]) {
        let def = ToolDef { name: (*name).into(), class: class.code(), volatile_fields: vec!["nonce".into()], ..Default::default() };
        ledger.register_tool(T, def).unwrap();
    }
    for i in 0..3u8 {
        let def = CredentialDef { token: vec![b'k', i], budget: u32::from(i % 2) + 1, ..Default::default() };
        ledger.register_credential(T, &def).unwrap();
    }
    let mut live: HashMap<EffectId, u64> = HashMap::new();
    let mut results: HashMap<EffectId, Vec<u8>> = HashMap::new();
    let mut grants: Vec<(EffectId, u32)> = Vec::new();
    let mut checkpoints: Vec<String> = Vec::new();
    let mut epoch = 1u64;

    for op in ops.into_iter().take(64) {
        let now = clock.now_ms();
        match op {
            Op::Begin { tool, intent, step, deliberate, token, branch, epoch: e, raw_args, raw_run } => {
                let branches = ledger.get_run(T, "run").map(|v| v.run.branches).unwrap_or_default();
                let cmd = BeginCmd {
                    run_id: raw_run.unwrap_or_else(|| "run".into()),
                    branch: branches.get(usize::from(branch) % branches.len().max(1)).map(|b| b.name.clone()).unwrap_or_default(),
                    epoch: if e % 4 == 0 { u64::from(e) } else { epoch },
                    tool: TOOLS[usize::from(tool) % 3].into(),
                    arguments_json: raw_args.unwrap_or_else(|| format!(r#"{{"target":{intent},"nonce":{now}}}"#)),
                    step_key: step.map(|s| format!("s{s}")).unwrap_or_default(),
                    deliberate_repeat: deliberate,
                    credentials: token.map(|t| vec![CredentialUse { token: vec![b'k', t % 4], budget: 1 }]).unwrap_or_default(),
                    ..Default::default()
                };
                let Ok(begun) = ledger.begin(T, &cmd) else { continue };
                match begun.decision {
                    Decision::Execute { receipt, recorded: true } => {
                        let id = receipt.id();
                        if let Some(exp) = live.get(&id) {
                            assert!(*exp <= now, "two live grants of {id}");
                        }
                        assert!(!results.contains_key(&id), "a completed effect was granted again");
                        live.insert(id, receipt.lease_expires_at_ms);
                        grants.push((id, receipt.attempt));
                    }
                    Decision::Replay(rec) => {
                        if let Some(r) = results.get(&rec.id()) {
                            assert_eq!(&rec.result, r, "a replay changed the result");
                        }
                    }
                    _ => {}
                }
            }
            Op::Complete { grant, outcome, result } => {
                let Some(&(id, attempt)) = grants.get(usize::from(grant)) else { continue };
                let outcome = match outcome % 3 {
                    0 => Outcome::Completed(vec![result]),
                    1 => Outcome::FailedBeforeInput("f".into()),
                    _ => Outcome::Unknown("u".into()),
                };
                let completed = matches!(outcome, Outcome::Completed(_));
                if let Ok(rec) = ledger.complete(T, &id.to_string(), attempt, epoch, outcome) {
                    if let Some(prev) = results.get(&id) {
                        assert!(rec.tombstone || prev == &rec.result, "a completed result changed");
                    }
                    if completed && !rec.tombstone {
                        results.insert(id, rec.result);
                    }
                    live.remove(&id);
                }
            }
            Op::Reconcile { grant, happened, evidence } => {
                let Some(&(id, _)) = grants.get(usize::from(grant)) else { continue };
                let finding = if happened { Finding::Completed(vec![1]) } else { Finding::FailedBeforeInput("n".into()) };
                if let Ok(rec) = ledger.reconcile(T, &id.to_string(), epoch, &evidence, finding) {
                    assert!(!evidence.trim().is_empty());
                    if let Some(prev) = results.get(&id) {
                        assert!(rec.tombstone || prev == &rec.result);
                    }
                    if happened && !rec.tombstone {
                        results.insert(id, rec.result);
                    }
                    live.remove(&id);
                }
            }
            Op::Heartbeat { grant } => {
                let Some(&(id, attempt)) = grants.get(usize::from(grant)) else { continue };
                if let Ok(rec) = ledger.heartbeat(T, &id.to_string(), attempt, epoch, 0) {
                    assert!(live.get(&id).is_some_and(|e| *e > now), "heartbeat revived a lapsed grant");
                    live.insert(id, rec.lease_expires_at_ms);
                }
            }
            Op::Advance { ms } => clock.advance(u64::from(ms)),
            Op::Checkpoint { branch } => {
                let Ok(view) = ledger.get_run(T, "run") else { continue };
                let b = &view.run.branches[usize::from(branch) % view.run.branches.len()];
                let id = format!("cp{}", checkpoints.len());
                let cmd = CheckpointCmd { run_id: "run".into(), branch: b.name.clone(), epoch, checkpoint_id: id.clone(), ..Default::default() };
                if ledger.checkpoint(T, &cmd).is_ok() {
                    checkpoints.push(id);
                }
            }
            Op::Restore { cp } => {
                let Some(id) = checkpoints.get(usize::from(cp)) else { continue };
                if let Ok(r) = ledger.restore(T, "run", id, epoch) {
                    epoch = r.epoch;
                }
            }
            Op::Fork { cp } => {
                let Some(id) = checkpoints.get(usize::from(cp)) else { continue };
                let cmd = ForkCmd { run_id: "run".into(), checkpoint_id: id.clone(), epoch, new_branch: String::new(), reason: String::new() };
                let _ = ledger.fork(T, &cmd);
            }
            Op::Sweep => {
                ledger.sweep_expired(100).unwrap();
                ledger.store().compact().unwrap();
            }
        }
    }
    for i in 0..4u8 {
        if let Ok(c) = ledger.get_credential(T, &[b'k', i]) {
            assert!(c.uses <= c.budget, "credential overspent");
        }
    }
});
