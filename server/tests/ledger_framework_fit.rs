//! The rules a real agent framework needs (DESIGN.md, "The replay-or-fork rule", as refined
//! for frameworks): causal checkpoints that may arrive late, restore matching by intent under
//! new step keys, repeats answered from the recorded effect's state, and results of granted
//! attempts recorded whatever the epoch. Against a real RocksDB ledger.

mod common;

use common::*;
use fence_server::ledger::outcome::{ListQuery, OutcomeKey};
use fence_server::ledger::runs::CheckpointCmd;
use fence_server::ledger::{BeginCmd, Decision, OpClass, Outcome, Reason, Recovery, State};

const TRANSFER: &str = "bank.transfer";
const CHARGE: &str = "payments.charge";

fn transfer(to: &str, amount: u32, reference: &str) -> String {
    format!(r#"{{"to":"{to}","amount":{amount},"reference":"{reference}"}}"#)
}

fn setup() -> Harness {
    let h = harness();
    h.tool(TRANSFER, OpClass::NonRetryable, &["reference"]);
    h.tool(CHARGE, OpClass::Deduplicate, &["reference"]);
    h
}

fn checkpoint(h: &Harness, run: &str, epoch: u64, id: &str, parent: &str) {
    h.ledger
        .checkpoint(
            T,
            &CheckpointCmd {
                run_id: run.into(),
                epoch,
                checkpoint_id: id.into(),
                parent_checkpoint_id: parent.into(),
                ..Default::default()
            },
        )
        .unwrap();
}

/// A call descending from checkpoint `parent`.
fn from(parent: &str, epoch: u64, cmd: BeginCmd) -> BeginCmd {
    BeginCmd {
        parent_checkpoint_id: parent.into(),
        epoch,
        ..cmd
    }
}

fn effects(h: &Harness, run: &str) -> usize {
    h.ledger
        .list_effects(
            T,
            &ListQuery {
                run_id: run.into(),
                ..Default::default()
            },
        )
        .unwrap()
        .0
        .len()
}

/// `cmd` marked as a deliberate repeat.
fn deliberate(cmd: BeginCmd) -> BeginCmd {
    BeginCmd {
        deliberate_repeat: true,
        ..cmd
    }
}

/// Reports how the first attempt of `rec` ended, at the untracked epoch.
fn report(h: &Harness, rec: &fence_server::ledger::records::EffectRecord, outcome: Outcome) {
    h.ledger
        .complete(T, &rec.id().to_string(), 1, 0, outcome)
        .unwrap();
}

fn in_progress(d: Decision) {
    assert!(
        matches!(d, Decision::InProgress { .. }),
        "expected IN_PROGRESS, got {d:?}"
    );
}

// ---- 1. Checkpoints are points in the causal history ----------------------------------------

/// LangGraph's default durability writes checkpoint N in the background while step N+1's tools
/// already run: the transfer reaches Fence before the checkpoint it descends from. Restoring
/// that checkpoint must still replay it.
#[test]
fn a_checkpoint_saved_after_its_step_ran_still_precedes_the_steps_effects() {
    let h = setup();
    checkpoint(&h, "run", 0, "cp-1", "");
    let first = executed(h.begin(&from(
        "cp-1",
        0,
        call("run", TRANSFER, &transfer("ann", 5, "r1")),
    )));
    complete(&h, &first, "tx-ann");
    // Step 2's tool runs (descending from cp-2) before cp-2 is saved.
    let rec = executed(h.begin(&from(
        "cp-2",
        0,
        call("run", TRANSFER, &transfer("bob", 100, "r2")),
    )));
    complete(&h, &rec, "tx-bob");
    checkpoint(&h, "run", 0, "cp-2", "cp-1");

    let restored = h.ledger.restore(T, "run", "cp-2", 0).unwrap();
    assert_eq!(
        restored.tape.iter().map(|r| r.seq).collect::<Vec<_>>(),
        vec![rec.seq],
        "exactly the effects after cp-2: bob's transfer, not ann's"
    );
    let again = replayed(h.begin(&from(
        "cp-2",
        2,
        keyed(
            "run",
            "tool-call-new",
            TRANSFER,
            &transfer("bob", 100, "r9"),
        ),
    )));
    assert_eq!(again.result, b"tx-bob");
    assert_eq!(effects(&h, "run"), 2);
}

/// Without the new fields the arrival order stands: a late checkpoint is placed where it
/// arrives, as before.
#[test]
fn without_parent_ids_a_checkpoint_is_placed_where_it_arrives() {
    let h = setup();
    let rec = executed(h.begin(&call("run", TRANSFER, &transfer("bob", 100, "r2"))));
    complete(&h, &rec, "tx-bob");
    checkpoint(&h, "run", 0, "cp-late", "");
    let restored = h.ledger.restore(T, "run", "cp-late", 0).unwrap();
    assert!(restored.tape.is_empty());
}

/// An effect that descends from an *earlier* checkpoint but arrives after a later one was
/// recorded is not on the later checkpoint's tape.
#[test]
fn an_effect_of_an_earlier_step_arriving_late_is_not_after_a_later_checkpoint() {
    let h = setup();
    checkpoint(&h, "run", 0, "cp-1", "");
    checkpoint(&h, "run", 0, "cp-2", "cp-1");
    // A slow report from step 1 (it names cp-1) arrives after cp-2 was saved.
    let slow = executed(h.begin(&from(
        "cp-1",
        0,
        call("run", TRANSFER, &transfer("ann", 5, "r1")),
    )));
    complete(&h, &slow, "tx-ann");
    let next = executed(h.begin(&from(
        "cp-2",
        0,
        call("run", TRANSFER, &transfer("bob", 7, "r2")),
    )));
    complete(&h, &next, "tx-bob");
    let tape: Vec<u64> = h
        .ledger
        .restore(T, "run", "cp-2", 0)
        .unwrap()
        .tape
        .iter()
        .map(|r| r.seq)
        .collect();
    assert_eq!(tape, vec![next.seq]);
    // Restoring cp-1 replays both, in order.
    let tape: Vec<u64> = h
        .ledger
        .restore(T, "run", "cp-1", 0)
        .unwrap()
        .tape
        .iter()
        .map(|r| r.seq)
        .collect();
    assert_eq!(tape, vec![slow.seq, next.seq]);
}

/// A checkpoint recorded without its parent is judged by its place in the log: when unsure,
/// an effect stays on the tape (fail closed: never a second execution).
#[test]
fn an_unknown_ancestry_keeps_the_effect_on_the_tape() {
    let h = setup();
    checkpoint(&h, "run", 0, "cp-1", "");
    let rec = executed(h.begin(&from(
        "cp-x",
        0,
        call("run", TRANSFER, &transfer("bob", 1, "r")),
    )));
    complete(&h, &rec, "tx");
    // cp-x is recorded later without a parent: it is after cp-1 in the log.
    checkpoint(&h, "run", 0, "cp-x", "");
    let restored = h.ledger.restore(T, "run", "cp-1", 0).unwrap();
    assert_eq!(restored.tape.len(), 1);
}

// ---- 2. Restore and fork match alike; a new step key alone is not a new effect --------------

/// After time travel LangGraph's step counter shifts, so the re-issued call carries a step key
/// the tape does not know. Its intent equals the due entry's: REPLAY, and the new key becomes
/// an alias of the effect.
#[test]
fn after_a_restore_a_new_step_key_with_the_due_intent_replays() {
    let h = setup();
    checkpoint(&h, "run", 0, "cp", "");
    let rec = executed(h.begin(&keyed(
        "run",
        "step-3:call-a",
        TRANSFER,
        &transfer("bob", 100, "u1"),
    )));
    complete(&h, &rec, "tx-1");
    h.ledger.restore(T, "run", "cp", 0).unwrap();

    let new_key = BeginCmd {
        epoch: 2,
        ..keyed(
            "run",
            "step-5:call-b",
            TRANSFER,
            &transfer("bob", 100, "u2"),
        )
    };
    let again = replayed(h.begin(&new_key));
    assert_eq!(again.seq, rec.seq);
    // The alias: the new key now names that effect, so a retry under it replays at once and
    // other arguments under it are a mismatch.
    assert_eq!(replayed(h.begin(&new_key)).seq, rec.seq);
    let other = BeginCmd {
        arguments_json: transfer("carol", 100, "u3"),
        ..new_key
    };
    refused(h.begin(&other), Reason::ArgumentMismatch);
    assert_eq!(effects(&h, "run"), 1);
}

/// A changed intent under a new key after a restore is still divergent: FORK_REQUIRED, with a
/// message for a model.
#[test]
fn after_a_restore_a_changed_intent_under_a_new_key_must_fork() {
    let h = setup();
    checkpoint(&h, "run", 0, "cp", "");
    let rec = executed(h.begin(&keyed("run", "k1", TRANSFER, &transfer("bob", 100, "u1"))));
    complete(&h, &rec, "tx-1");
    h.ledger.restore(T, "run", "cp", 0).unwrap();
    let r = refused(
        h.begin(&BeginCmd {
            epoch: 2,
            ..keyed("run", "k2", TRANSFER, &transfer("bob", 1000, "u2"))
        }),
        Reason::ForkRequired,
    );
    assert_eq!(r.recovery, Recovery::Fork);
    assert!(!r.message.to_lowercase().contains("fork"), "{}", r.message);
    assert_eq!(r.receipt.unwrap().seq, rec.seq);
}

/// A model retrying a step mints a new tool-call id: the same transfer under a new step key in
/// the same causal step is a suspected duplicate, exactly as without a key.
#[test]
fn a_new_step_key_in_the_same_causal_step_is_a_suspected_duplicate() {
    let h = setup();
    let rec = executed(h.begin(&keyed(
        "run",
        "call-1",
        TRANSFER,
        &transfer("bob", 100, "u1"),
    )));
    complete(&h, &rec, "tx-1");
    let r = refused(
        h.begin(&keyed(
            "run",
            "call-2",
            TRANSFER,
            &transfer("bob", 100, "u2"),
        )),
        Reason::DuplicateIntent,
    );
    assert_eq!(r.receipt.unwrap().result, b"tx-1");
    // Deliberately: a second effect.
    executed(h.begin(&deliberate(keyed(
        "run",
        "call-3",
        TRANSFER,
        &transfer("bob", 100, "u3"),
    ))));
    assert_eq!(effects(&h, "run"), 2);
}

/// The same intent in a *later* causal step (a checkpoint between, or a different parent
/// checkpoint) under a new step key is a new effect: the user asked again.
#[test]
fn a_new_step_key_in_a_later_causal_step_is_a_new_effect() {
    let h = setup();
    let rec = executed(h.begin(&keyed(
        "run",
        "call-1",
        TRANSFER,
        &transfer("bob", 100, "u1"),
    )));
    complete(&h, &rec, "tx-1");
    checkpoint(&h, "run", 0, "cp-1", "");
    executed(h.begin(&keyed(
        "run",
        "call-2",
        TRANSFER,
        &transfer("bob", 100, "u2"),
    )));

    // With parent checkpoint ids: the same parent is the same step, another is not.
    let a = executed(h.begin(&from(
        "cp-a",
        0,
        keyed("run2", "c1", TRANSFER, &transfer("x", 1, "u")),
    )));
    complete(&h, &a, "ok");
    refused(
        h.begin(&from(
            "cp-a",
            0,
            keyed("run2", "c2", TRANSFER, &transfer("x", 1, "v")),
        )),
        Reason::DuplicateIntent,
    );
    executed(h.begin(&from(
        "cp-b",
        0,
        keyed("run2", "c3", TRANSFER, &transfer("x", 1, "w")),
    )));
}

/// DEDUPLICATE tools are idempotent under their key: a new key is a new effect by definition.
#[test]
fn a_deduplicate_tool_under_a_new_key_is_a_new_effect() {
    let h = setup();
    let rec = executed(h.begin(&keyed(
        "run",
        "k1",
        CHARGE,
        r#"{"amount":1,"reference":"a"}"#,
    )));
    complete(&h, &rec, "ch-1");
    executed(h.begin(&keyed(
        "run",
        "k2",
        CHARGE,
        r#"{"amount":1,"reference":"b"}"#,
    )));
}

/// Concurrent calls of one intent under any mix of step keys execute it once.
#[test]
fn concurrent_calls_of_one_intent_under_different_keys_execute_once() {
    let h = std::sync::Arc::new(setup());
    let threads: Vec<_> = (0..8)
        .map(|i| {
            let h = h.clone();
            std::thread::spawn(move || {
                let cmd = match i % 3 {
                    0 => call("run", TRANSFER, &transfer("bob", 100, &format!("u{i}"))),
                    _ => keyed(
                        "run",
                        &format!("k{i}"),
                        TRANSFER,
                        &transfer("bob", 100, &format!("u{i}")),
                    ),
                };
                h.begin(&cmd)
            })
        })
        .collect();
    let answers: Vec<Decision> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    let grants = answers
        .iter()
        .filter(|d| matches!(d, Decision::Execute { .. }))
        .count();
    assert_eq!(grants, 1, "{answers:?}");
    assert!(
        answers
            .iter()
            .all(|d| matches!(d, Decision::Execute { .. } | Decision::InProgress { .. })),
        "{answers:?}"
    );
    assert_eq!(effects(&h, "run"), 1);
}

// ---- 3. A keyless repeat answers from the recorded effect's state ---------------------------

#[test]
fn a_keyless_repeat_while_the_first_runs_is_in_progress() {
    let h = setup();
    executed(h.begin(&call("run", TRANSFER, &transfer("bob", 100, "u1"))));
    in_progress(h.begin(&call("run", TRANSFER, &transfer("bob", 100, "u2"))));
    // deliberate_repeat does not start a second one while the first runs.
    in_progress(h.begin(&deliberate(call(
        "run",
        TRANSFER,
        &transfer("bob", 100, "u3"),
    ))));
    assert_eq!(effects(&h, "run"), 1);
}

/// Following a refusal's advice must never double-charge: an unknown outcome is
/// RECONCILE_REQUIRED, with or without deliberate_repeat.
#[test]
fn a_keyless_repeat_of_an_unknown_effect_must_reconcile_even_if_deliberate() {
    let h = setup();
    let rec = executed(h.begin(&call("run", TRANSFER, &transfer("bob", 100, "u1"))));
    report(&h, &rec, Outcome::Unknown("timeout".into()));
    for deliberate in [false, true] {
        let r = refused(
            h.begin(&BeginCmd {
                deliberate_repeat: deliberate,
                ..call("run", TRANSFER, &transfer("bob", 100, "u2"))
            }),
            Reason::ReconcileRequired,
        );
        assert_eq!(r.recovery, Recovery::Reconcile);
    }
    // A lapsed lease reads as unknown too.
    executed(h.begin(&call("run", TRANSFER, &transfer("carol", 1, "v1"))));
    h.clock.advance(LEASE + 1);
    refused(
        h.begin(&deliberate(call(
            "run",
            TRANSFER,
            &transfer("carol", 1, "v2"),
        ))),
        Reason::ReconcileRequired,
    );
    assert_eq!(effects(&h, "run"), 2);
}

#[test]
fn a_keyless_repeat_after_a_failure_before_input_is_granted_again_with_the_same_key() {
    let h = setup();
    let rec = executed(h.begin(&call("run", TRANSFER, &transfer("bob", 100, "u1"))));
    report(
        &h,
        &rec,
        Outcome::FailedBeforeInput("connection refused".into()),
    );
    let again = executed(h.begin(&call("run", TRANSFER, &transfer("bob", 100, "u2"))));
    assert_eq!(again.seq, rec.seq);
    assert_eq!(again.attempt, 2);
    assert_eq!(again.downstream_key, rec.downstream_key);
}

#[test]
fn a_keyless_repeat_of_a_completed_effect_is_a_duplicate() {
    let h = setup();
    let rec = executed(h.begin(&call("run", TRANSFER, &transfer("bob", 100, "u1"))));
    complete(&h, &rec, "tx");
    let r = refused(
        h.begin(&call("run", TRANSFER, &transfer("bob", 100, "u2"))),
        Reason::DuplicateIntent,
    );
    assert_eq!(r.recovery, Recovery::ConfirmRepeat);
    assert!(!r.message.contains("deliberate_repeat"), "{}", r.message);
}

/// A Begin re-sent with its request_id after the answer was lost gets its grant back, with or
/// without a step key.
#[test]
fn a_resent_begin_without_a_step_key_gets_its_grant_back() {
    let h = setup();
    let cmd = BeginCmd {
        request_id: "req-1".into(),
        ..call("run", TRANSFER, &transfer("bob", 100, "u1"))
    };
    let first = executed(h.begin(&cmd));
    let again = executed(h.begin(&cmd));
    assert_eq!((again.seq, again.attempt), (first.seq, first.attempt));
    // Another requester waits.
    in_progress(h.begin(&BeginCmd {
        request_id: "req-2".into(),
        ..cmd.clone()
    }));
    assert_eq!(effects(&h, "run"), 1);
}

// ---- 4. A granted attempt's result is a fact --------------------------------------------------

/// A restore lands while the tool runs; its Complete carries the old epoch and is recorded, and
/// the restored agent's re-issued call waits, then replays the result.
#[test]
fn a_complete_from_the_granted_attempt_is_recorded_after_a_restore() {
    let h = setup();
    checkpoint(&h, "run", 0, "cp", "");
    let rec = executed(h.begin(&call("run", TRANSFER, &transfer("bob", 100, "u1"))));
    h.ledger.restore(T, "run", "cp", 0).unwrap();

    in_progress(h.begin(&BeginCmd {
        epoch: 2,
        ..call("run", TRANSFER, &transfer("bob", 100, "u2"))
    }));
    // The heartbeat and the result of the attempt holding the grant, at the old epoch.
    h.ledger
        .heartbeat(T, &rec.id().to_string(), rec.attempt, 1, 0)
        .unwrap();
    let done = h
        .ledger
        .complete(
            T,
            &rec.id().to_string(),
            rec.attempt,
            1,
            Outcome::Completed(b"tx-1".to_vec()),
        )
        .unwrap();
    assert_eq!(done.state(), State::Completed);
    let again = replayed(h.begin(&BeginCmd {
        epoch: 2,
        ..call("run", TRANSFER, &transfer("bob", 100, "u3"))
    }));
    assert_eq!(again.result, b"tx-1");
    assert_eq!(effects(&h, "run"), 1);
}

/// New work at a stale epoch stays fenced: a Complete naming no attempt, and Reconcile.
#[test]
fn a_stale_epoch_still_fences_reports_that_name_no_attempt() {
    let h = setup();
    checkpoint(&h, "run", 0, "cp", "");
    let rec = executed(h.begin(&call("run", TRANSFER, &transfer("bob", 100, "u1"))));
    h.ledger.restore(T, "run", "cp", 0).unwrap();
    refused_err(
        h.ledger.complete(
            T,
            &rec.id().to_string(),
            0,
            1,
            Outcome::Completed(b"x".to_vec()),
        ),
        Reason::StaleEpoch,
    );
    // An epoch never issued is refused whatever the attempt.
    refused_err(
        h.ledger.complete(
            T,
            &rec.id().to_string(),
            rec.attempt,
            9,
            Outcome::Completed(b"x".to_vec()),
        ),
        Reason::UnknownEpoch,
    );
    let q = h
        .ledger
        .query_outcome(T, &OutcomeKey::EffectId(rec.id().to_string()))
        .unwrap()
        .unwrap();
    assert_eq!(q.state(), State::Accepted);
}

// ---- 8. Unregistered tools -------------------------------------------------------------------

#[test]
fn get_tool_of_a_name_never_registered_is_unknown() {
    let h = setup();
    let r = refused_err(
        h.ledger.registered_tool(T, "never.registered", 0),
        Reason::UnknownRecord,
    );
    assert!(r.message.contains("never registered"), "{}", r.message);
    assert_eq!(h.ledger.registered_tool(T, TRANSFER, 0).unwrap().version, 1);
    refused_err(
        h.ledger.registered_tool(T, TRANSFER, 2),
        Reason::UnknownRecord,
    );
}
