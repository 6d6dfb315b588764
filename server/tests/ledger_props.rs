//! Property tests of the state machine over random interleavings, against a real RocksDB
//! ledger with a manual clock.
//!
//! 1. begin / complete / heartbeat / expire / reconcile / compact on random keys, the clock now
//!    and then past the retention window: never two live
//!    grants of one effect, never a lost or changed completed result, never a second new
//!    execution of an unkeyed non-retryable intent without `deliberate_repeat`.
//! 2. begin / complete / checkpoint / restore / fork with credentials: on every branch lineage no
//!    intent executes twice without an explicit fork, and no credential is spent beyond its
//!    budget.

mod common;

use std::collections::{HashMap, HashSet};

use common::*;
use fence_server::ledger::outcome::{ListQuery, OutcomeKey};
use fence_server::ledger::records::EffectRecord;
use fence_server::ledger::runs::{CheckpointCmd, ForkCmd};
use fence_server::ledger::{
    BeginCmd, CredentialUse, Decision, EffectId, Finding, LedgerError, OpClass, Outcome,
};
use fence_server::store::Store;
use proptest::prelude::*;

const TOOLS: [(&str, OpClass); 3] = [
    ("nr", OpClass::NonRetryable),
    ("dd", OpClass::Deduplicate),
    ("ec", OpClass::RequiresEffectCheck),
];

#[derive(Debug, Clone)]
enum Op {
    Begin {
        tool: usize,
        intent: u8,
        step: Option<u8>,
        deliberate: bool,
        drift: u32,
    },
    Complete {
        grant: usize,
        outcome: u8,
        result: u8,
    },
    Heartbeat {
        grant: usize,
    },
    Reconcile {
        grant: usize,
        happened: bool,
        result: u8,
    },
    Advance {
        ms: u64,
    },
    /// The store compacts everything: finished effects past their window become tombstones.
    Compact,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0..3usize, 0..3u8, prop::option::of(0..3u8), prop::bool::weighted(0.1), any::<u32>())
            .prop_map(|(tool, intent, step, deliberate, drift)| Op::Begin { tool, intent, step, deliberate, drift }),
        3 => (0..8usize, 0..3u8, 0..2u8).prop_map(|(grant, outcome, result)| Op::Complete { grant, outcome, result }),
        1 => (0..8usize).prop_map(|grant| Op::Heartbeat { grant }),
        1 => (0..8usize, any::<bool>(), 0..2u8).prop_map(|(grant, happened, result)| Op::Reconcile { grant, happened, result }),
        2 => (0..2 * LEASE).prop_map(|ms| Op::Advance { ms }),
        1 => Just(Op::Advance { ms: RETENTION }),
        1 => Just(Op::Compact),
    ]
}

fn args(intent: u8, drift: u32) -> String {
    // `nonce` is volatile for every tool: drift must never matter.
    format!(r#"{{"nonce":{drift},"target":{intent}}}"#)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(48), ..ProptestConfig::default() })]

    #[test]
    fn grants_are_exclusive_and_results_are_never_lost(ops in prop::collection::vec(op(), 1..40)) {
        let h = harness();
        for (name, class) in TOOLS {
            h.tool(name, class, &["nonce"]);
        }
        // effect -> lease expiry of its live grant
        let mut live: HashMap<EffectId, u64> = HashMap::new();
        // effect -> completed result
        let mut results: HashMap<EffectId, Vec<u8>> = HashMap::new();
        // grants handed out: (effect, attempt)
        let mut grants: Vec<(EffectId, u32)> = Vec::new();
        // intents with a recorded effect
        let mut all_intents_seen: HashSet<(usize, u8)> = HashSet::new();

        for op in ops {
            let now = fence_server::clock::Clock::now_ms(&h.clock);
            match op {
                Op::Begin { tool, intent, step, deliberate, drift } => {
                    let mut cmd = call("run", TOOLS[tool].0, &args(intent, drift));
                    cmd.deliberate_repeat = deliberate;
                    if let Some(s) = step {
                        cmd.step_key = format!("{}-{s}", TOOLS[tool].0);
                    }
                    match h.begin(&cmd) {
                        Decision::Execute { receipt, .. } => {
                            let id = receipt.id();
                            if let Some(exp) = live.get(&id) {
                                prop_assert!(*exp <= now, "two live grants of {id}");
                            }
                            prop_assert!(!results.contains_key(&id), "a completed effect was granted again");
                            let new_unkeyed = step.is_none() && receipt.attempt == 1 && !deliberate
                                && TOOLS[tool].1 != OpClass::Deduplicate;
                            if new_unkeyed {
                                prop_assert!(!all_intents_seen.contains(&(tool, intent)),
                                    "an unkeyed non-retryable intent executed twice");
                            }
                            if receipt.attempt == 1 {
                                all_intents_seen.insert((tool, intent));
                            }
                            live.insert(id, receipt.lease_expires_at_ms);
                            grants.push((id, receipt.attempt));
                        }
                        Decision::Replay(rec) => {
                            prop_assert_eq!(Some(&rec.result), results.get(&rec.id()));
                        }
                        Decision::InProgress { receipt, .. } => {
                            prop_assert!(receipt.lease_expires_at_ms > now);
                        }
                        Decision::Refused(_) => {}
                    }
                }
                Op::Complete { grant, outcome, result } => {
                    let Some(&(id, attempt)) = grants.get(grant) else { continue };
                    let outcome = match outcome {
                        0 => Outcome::Completed(vec![result]),
                        1 => Outcome::FailedBeforeInput("f".into()),
                        _ => Outcome::Unknown("u".into()),
                    };
                    let completed = matches!(outcome, Outcome::Completed(_));
                    match h.ledger.complete(T, &id.to_string(), attempt, 0, outcome.clone()) {
                        Ok(rec) => {
                            if let Some(prev) = results.get(&id) {
                                prop_assert_eq!(prev, &rec.result, "a completed result changed");
                            }
                            if completed {
                                results.insert(id, rec.result.clone());
                            }
                            live.remove(&id);
                        }
                        Err(LedgerError::Refused(_)) => {}
                        Err(e) => prop_assert!(false, "unexpected error {e}"),
                    }
                }
                Op::Heartbeat { grant } => {
                    let Some(&(id, attempt)) = grants.get(grant) else { continue };
                    if let Ok(rec) = h.ledger.heartbeat(T, &id.to_string(), attempt, 0, 0) {
                        prop_assert!(live.get(&id).is_some_and(|e| *e > now), "heartbeat revived a lapsed grant");
                        live.insert(id, rec.lease_expires_at_ms);
                    }
                }
                Op::Reconcile { grant, happened, result } => {
                    let Some(&(id, _)) = grants.get(grant) else { continue };
                    let finding = if happened { Finding::Completed(vec![result]) } else { Finding::FailedBeforeInput("n".into()) };
                    if let Ok(rec) = h.ledger.reconcile(T, &id.to_string(), 0, "checked", finding) {
                        prop_assert!(live.get(&id).is_none_or(|e| *e <= now), "reconciled a live grant");
                        if let Some(prev) = results.get(&id) {
                            prop_assert_eq!(prev, &rec.result);
                        }
                        if happened {
                            results.insert(id, rec.result.clone());
                        }
                        live.remove(&id);
                    }
                }
                Op::Advance { ms } => h.clock.advance(ms),
                Op::Compact => h.ledger.store().compact().unwrap(),
            }
        }
        // Nothing acknowledged is lost: every completed result reads back (or is a tombstone).
        for (id, result) in &results {
            let rec = h.ledger.query_outcome(T, &OutcomeKey::EffectId(id.to_string())).unwrap().unwrap();
            prop_assert!(rec.tombstone || &rec.result == result);
        }
        h.assert_sound();
    }
}

#[derive(Debug, Clone)]
enum HOp {
    Begin {
        intent: u8,
        token: Option<u8>,
        drift: u32,
        branch: u8,
    },
    Complete {
        grant: usize,
    },
    Checkpoint,
    Restore {
        cp: u8,
    },
    Fork {
        cp: u8,
    },
}

fn hop() -> impl Strategy<Value = HOp> {
    prop_oneof![
        5 => (0..4u8, prop::option::of(0..3u8), any::<u32>(), 0..3u8)
            .prop_map(|(intent, token, drift, branch)| HOp::Begin { intent, token, drift, branch }),
        3 => (0..10usize).prop_map(|grant| HOp::Complete { grant }),
        1 => Just(HOp::Checkpoint),
        1 => (0..4u8).prop_map(|cp| HOp::Restore { cp }),
        1 => (0..4u8).prop_map(|cp| HOp::Fork { cp }),
    ]
}

/// Effects visible on `branch`'s lineage (its own, adopted ones included), and the effects still
/// carried onto it from its parent: from the ledger's own run record and audit listing.
fn lineage_effects(h: &Harness, branch: u32) -> (Vec<EffectRecord>, Vec<EffectRecord>) {
    let run = h.ledger.get_run(T, "run").unwrap().run;
    let lineage = run.lineage(branch);
    let carried = &run.branches[branch as usize].carried_seqs;
    let (all, _) = h
        .ledger
        .list_effects(
            T,
            &ListQuery {
                run_id: "run".into(),
                page_size: 1000,
                ..Default::default()
            },
        )
        .unwrap();
    all.into_iter()
        .filter(|e| e.visible_on(&lineage) || carried.contains(&e.seq))
        .partition(|e| e.visible_on(&lineage))
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(48), ..ProptestConfig::default() })]

    #[test]
    fn no_intent_executes_twice_on_a_lineage_and_no_credential_overspends(ops in prop::collection::vec(hop(), 1..40)) {
        let h = harness();
        h.tool("pay", OpClass::NonRetryable, &["nonce"]);
        let budgets = [1u32, 1, 2];
        for (i, b) in budgets.iter().enumerate() {
            h.ledger.register_credential(T, &fence_server::ledger::credentials::CredentialDef {
                token: format!("tok-{i}").into_bytes(), budget: *b, ..Default::default()
            }).unwrap();
        }
        h.ledger.start_run(T, "run").unwrap();
        let mut epoch = 1u64;
        let mut checkpoints: Vec<String> = Vec::new();
        let mut grants: Vec<(EffectId, u32)> = Vec::new();

        for op in ops {
            let run = h.ledger.get_run(T, "run").unwrap().run;
            match op {
                HOp::Begin { intent, token, drift, branch } => {
                    let b = (branch as usize) % run.branches.len();
                    let cmd = BeginCmd {
                        epoch,
                        branch: run.branches[b].name.clone(),
                        credentials: token.map(|t| vec![CredentialUse { token: format!("tok-{t}").into_bytes(), budget: 1 }]).unwrap_or_default(),
                        ..call("run", "pay", &args(intent, drift))
                    };
                    let (visible_before, carried_before) = lineage_effects(&h, b as u32);
                    if let Decision::Execute { receipt, .. } = h.begin(&cmd)
                        && receipt.attempt == 1
                    {
                        prop_assert!(
                            !visible_before.iter().any(|e| e.intent_fp == receipt.intent_fp),
                            "intent {intent} executed twice on branch {}", cmd.branch
                        );
                        // What the parent did after the fork point is done in the world too.
                        prop_assert!(
                            !carried_before.iter().any(|e| e.intent_fp == receipt.intent_fp),
                            "intent {intent} carried onto branch {} executed again", cmd.branch
                        );
                        grants.push((receipt.id(), 1));
                    }
                }
                HOp::Complete { grant } => {
                    if let Some(&(id, attempt)) = grants.get(grant) {
                        let _ = h.ledger.complete(T, &id.to_string(), attempt, epoch, Outcome::Completed(b"ok".to_vec()));
                    }
                }
                HOp::Checkpoint => {
                    let name = format!("cp{}", checkpoints.len());
                    let b = run.branches.len() - 1;
                    h.ledger.checkpoint(T, &CheckpointCmd { run_id: "run".into(), branch: run.branches[b].name.clone(), epoch, checkpoint_id: name.clone(), ..Default::default() }).unwrap();
                    checkpoints.push(name);
                }
                HOp::Restore { cp } => {
                    if let Some(name) = checkpoints.get(cp as usize) {
                        epoch = h.ledger.restore(T, "run", name, epoch).unwrap().epoch;
                    }
                }
                HOp::Fork { cp } => {
                    if let Some(name) = checkpoints.get(cp as usize) {
                        h.ledger.fork(T, &ForkCmd { run_id: "run".into(), checkpoint_id: name.clone(), epoch, new_branch: String::new(), reason: "prop".into() }).unwrap();
                    }
                }
            }
        }
        // On every lineage, each intent was executed at most once.
        let run = h.ledger.get_run(T, "run").unwrap().run;
        for b in 0..run.branches.len() as u32 {
            let (effects, _) = lineage_effects(&h, b);
            let mut fps = HashSet::new();
            for e in &effects {
                prop_assert!(fps.insert(e.intent_fp.clone()), "duplicate intent on lineage of branch {b}");
            }
        }
        // No credential is spent beyond its budget, and every use is an effect that records it.
        let (all, _) = h.ledger.list_effects(T, &ListQuery { run_id: "run".into(), page_size: 1000, ..Default::default() }).unwrap();
        for (i, budget) in budgets.iter().enumerate() {
            let token = format!("tok-{i}");
            let cred = h.ledger.get_credential(T, token.as_bytes()).unwrap();
            prop_assert!(cred.uses <= *budget);
            let spenders = all.iter().filter(|e| e.credential_hashes.contains(&cred.hash)).count();
            prop_assert_eq!(spenders as u32, cred.uses);
        }
        h.assert_sound();
    }
}
