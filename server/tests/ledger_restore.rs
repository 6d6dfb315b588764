//! Checkpoint, restore and fork (the replay-or-fork rule) and the credential ledger
//! (authority does not resurrect), against a real RocksDB ledger.

mod common;

use common::*;
use fence_server::ledger::credentials::CredentialDef;
use fence_server::ledger::outcome::{ListQuery, OutcomeKey};
use fence_server::ledger::records::EffectRecord;
use fence_server::ledger::runs::{CheckpointCmd, ForkCmd};
use fence_server::ledger::{BeginCmd, CredentialUse, Decision, OpClass, Reason, Recovery, State};

const TRANSFER: &str = "bank.transfer";

fn transfer(to: &str, amount: u32, reference: &str) -> String {
    format!(r#"{{"to":"{to}","amount":{amount},"reference":"{reference}","ts":"{reference}-ts"}}"#)
}

fn setup() -> Harness {
    let h = harness();
    h.tool(TRANSFER, OpClass::NonRetryable, &["reference", "ts"]);
    h.tool("kb.search", OpClass::SafeRetry, &[]);
    h
}

fn checkpoint(h: &Harness, run: &str, branch: &str, epoch: u64, id: &str) {
    h.ledger
        .checkpoint(
            T,
            &CheckpointCmd {
                run_id: run.into(),
                branch: branch.into(),
                epoch,
                checkpoint_id: id.into(),
                ..Default::default()
            },
        )
        .unwrap();
}

/// Every effect of run "run", on any branch.
fn all_effects(h: &Harness) -> Vec<EffectRecord> {
    let query = ListQuery {
        run_id: "run".into(),
        ..Default::default()
    };
    h.ledger.list_effects(T, &query).unwrap().0
}

fn on(epoch: u64, branch: &str, cmd: BeginCmd) -> BeginCmd {
    BeginCmd {
        epoch,
        branch: branch.into(),
        ..cmd
    }
}

/// ACRFence scenario 1: transfer committed, crash, restore to a checkpoint before it, the model
/// re-issues it with a new reference UUID and timestamp: REPLAY, one transfer in the world.
#[test]
fn a_restored_agent_reissuing_a_committed_transfer_gets_a_replay() {
    let h = setup();
    checkpoint(&h, "run", "", 0, "cp-before-transfer");
    let rec = executed(h.begin(&call("run", TRANSFER, &transfer("bob", 100, "uuid-1"))));
    complete(&h, &rec, "tx-1");

    let restored = h.ledger.restore(T, "run", "cp-before-transfer", 0).unwrap();
    assert_eq!(restored.epoch, 2);
    assert_eq!(restored.tape.len(), 1);
    let again = replayed(h.begin(&on(
        2,
        "main",
        call("run", TRANSFER, &transfer("bob", 100, "uuid-2")),
    )));
    assert_eq!(again.result, b"tx-1");
    assert_eq!(again.last_replay_epoch, 2);
    // The tape is consumed: the branch is back on the normal path.
    let run = h.ledger.get_run(T, "run").unwrap();
    assert!(run.run.branches[0].tape_seqs.is_empty());
    let effects = all_effects(&h);
    assert_eq!(effects.len(), 1, "one transfer in the world");
    // A new intent after the tape is consumed is a new effect.
    executed(h.begin(&on(
        2,
        "",
        call("run", TRANSFER, &transfer("dave", 5, "uuid-3")),
    )));
}

/// ACRFence scenario 2: restored and redirected: FORK_REQUIRED until an explicit fork.
#[test]
fn a_redirected_call_after_restore_requires_a_fork_then_is_a_new_effect() {
    let h = setup();
    checkpoint(&h, "run", "", 0, "cp1");
    let first = executed(h.begin(&call("run", TRANSFER, &transfer("bob", 100, "u1"))));
    complete(&h, &first, "tx-1");
    h.ledger.restore(T, "run", "cp1", 0).unwrap();

    let before = h.snapshot();
    for redirected in [transfer("carol", 100, "u2"), transfer("bob", 1000, "u3")] {
        let r = refused(
            h.begin(&on(2, "", call("run", TRANSFER, &redirected))),
            Reason::ForkRequired,
        );
        assert_eq!(r.recovery, Recovery::Fork);
        assert_eq!(r.checkpoint_id, "cp1");
        assert_eq!(r.receipt.unwrap().id(), first.id());
    }
    // Also with a step key that is not on the tape, and with "deliberate" set: fail closed.
    refused(
        h.begin(&on(
            2,
            "",
            keyed("run", "new-step", TRANSFER, &transfer("carol", 1, "u")),
        )),
        Reason::ForkRequired,
    );
    refused(
        h.begin(&on(
            2,
            "",
            BeginCmd {
                deliberate_repeat: true,
                ..call("run", TRANSFER, &transfer("carol", 100, "u4"))
            },
        )),
        Reason::ForkRequired,
    );
    assert_eq!(before, h.snapshot(), "refusals change nothing");

    let forked = h
        .ledger
        .fork(
            T,
            &ForkCmd {
                run_id: "run".into(),
                checkpoint_id: "cp1".into(),
                epoch: 2,
                new_branch: "".into(),
                reason: "pay carol instead".into(),
            },
        )
        .unwrap();
    let branch = forked.branch;
    assert_eq!(branch.name, "fork-1");
    // The transfer to bob is done in the world: it is carried onto the fork.
    assert_eq!(
        forked.carried.iter().map(|r| r.id()).collect::<Vec<_>>(),
        vec![first.id()]
    );
    let carol = executed(h.begin(&on(
        2,
        &branch.name,
        call("run", TRANSFER, &transfer("carol", 100, "u5")),
    )));
    assert_ne!(carol.downstream_key, first.downstream_key);
    assert_eq!(carol.branch_name, "fork-1");
    // Re-issued on the fork (new reference), the transfer to bob replays: never a second one.
    let bob = replayed(h.begin(&on(
        2,
        &branch.name,
        call("run", TRANSFER, &transfer("bob", 100, "u6")),
    )));
    assert_eq!(
        (bob.id(), bob.result.as_slice()),
        (first.id(), &b"tx-1"[..])
    );
    // The parent's effect stays done and listed; nothing is hidden.
    let all = all_effects(&h);
    assert_eq!(all.len(), 2);
    assert_eq!(all[0].state(), State::Completed);
    // Adopted, the replayed transfer is on the fork's lineage now: a keyless repeat of it is
    // a suspected duplicate there, as on any branch that did it.
    refused(
        h.begin(&on(
            2,
            &branch.name,
            call("run", TRANSFER, &transfer("bob", 100, "u7")),
        )),
        Reason::DuplicateIntent,
    );
    // Forking again with the same name and origin is idempotent.
    let again = h
        .ledger
        .fork(
            T,
            &ForkCmd {
                run_id: "run".into(),
                checkpoint_id: "cp1".into(),
                epoch: 2,
                new_branch: "fork-1".into(),
                reason: String::new(),
            },
        )
        .unwrap();
    assert_eq!(again.branch.name, "fork-1");
    assert!(again.carried.is_empty(), "the carried transfer was adopted");
}

/// Matching by step key on the tape, and divergence at a keyed step.
#[test]
fn keyed_calls_match_the_tape_by_step_key() {
    let h = setup();
    checkpoint(&h, "run", "", 0, "cp1");
    let a = executed(h.begin(&keyed("run", "run:1", TRANSFER, &transfer("bob", 1, "a"))));
    complete(&h, &a, "tx-a");
    let b = executed(h.begin(&keyed("run", "run:2", TRANSFER, &transfer("bob", 2, "b"))));
    complete(&h, &b, "tx-b");
    h.ledger.restore(T, "run", "cp1", 0).unwrap();
    // Out of order is fine for keyed calls.
    assert_eq!(
        replayed(h.begin(&on(
            2,
            "",
            keyed("run", "run:2", TRANSFER, &transfer("bob", 2, "b2"))
        )))
        .result,
        b"tx-b"
    );
    let r = refused(
        h.begin(&on(
            2,
            "",
            keyed("run", "run:1", TRANSFER, &transfer("eve", 1, "a2")),
        )),
        Reason::ForkRequired,
    );
    assert_eq!(r.receipt.unwrap().id(), a.id());
    assert_eq!(
        replayed(h.begin(&on(
            2,
            "",
            keyed("run", "run:1", TRANSFER, &transfer("bob", 1, "a3"))
        )))
        .result,
        b"tx-a"
    );
    // A consumed keyed step replays on the normal path too.
    replayed(h.begin(&on(
        2,
        "",
        keyed("run", "run:2", TRANSFER, &transfer("bob", 2, "b9")),
    )));
}

/// The n-th identical intent matches the n-th recorded one.
#[test]
fn identical_intents_on_the_tape_match_by_occurrence() {
    let h = setup();
    checkpoint(&h, "run", "", 0, "cp1");
    let one = executed(h.begin(&call("run", TRANSFER, &transfer("bob", 5, "x1"))));
    complete(&h, &one, "tx-1");
    let two = executed(h.begin(&BeginCmd {
        deliberate_repeat: true,
        ..call("run", TRANSFER, &transfer("bob", 5, "x2"))
    }));
    complete(&h, &two, "tx-2");
    h.ledger.restore(T, "run", "cp1", 0).unwrap();
    assert_eq!(
        replayed(h.begin(&on(2, "", call("run", TRANSFER, &transfer("bob", 5, "y1"))))).result,
        b"tx-1"
    );
    assert_eq!(
        replayed(h.begin(&on(2, "", call("run", TRANSFER, &transfer("bob", 5, "y2"))))).result,
        b"tx-2"
    );
    // A third identical call is back on the normal path: a suspected duplicate.
    refused(
        h.begin(&on(2, "", call("run", TRANSFER, &transfer("bob", 5, "y3")))),
        Reason::DuplicateIntent,
    );
}

/// Read-only calls pass through a pending tape and never sit on it.
#[test]
fn safe_retry_calls_pass_a_pending_tape() {
    let h = setup();
    checkpoint(&h, "run", "", 0, "cp1");
    let t = executed(h.begin(&call("run", TRANSFER, &transfer("bob", 1, "a"))));
    complete(&h, &t, "tx");
    executed(h.begin(&BeginCmd {
        record: true,
        ..call("run", "kb.search", r#"{"q":"balance"}"#)
    }));
    let restored = h.ledger.restore(T, "run", "cp1", 0).unwrap();
    assert_eq!(
        restored.tape.len(),
        1,
        "the recorded read is not on the tape"
    );
    assert!(matches!(
        h.begin(&on(2, "", call("run", "kb.search", r#"{"q":"other"}"#))),
        Decision::Execute {
            recorded: false,
            ..
        }
    ));
    replayed(h.begin(&on(2, "", call("run", TRANSFER, &transfer("bob", 1, "b")))));
}

/// A zombie from before the restore can start nothing.
#[test]
fn stale_epochs_are_refused_and_change_nothing() {
    let h = setup();
    checkpoint(&h, "run", "", 0, "cp1");
    let rec = executed(h.begin(&call("run", TRANSFER, &transfer("bob", 1, "a"))));
    h.ledger.restore(T, "run", "cp1", 1).unwrap();
    let before = h.snapshot();
    for epoch in [0, 1] {
        let r = refused(
            h.begin(&on(
                epoch,
                "",
                call("run", TRANSFER, &transfer("zed", 9, "z")),
            )),
            Reason::StaleEpoch,
        );
        assert_eq!(r.current_epoch, 2);
        assert_eq!(r.recovery, Recovery::RefreshEpoch);
        // Reports naming no granted attempt are new work too (the granted attempt's own
        // reports are facts and are recorded: see ledger_framework_fit.rs).
        refused_err(
            h.ledger.complete(
                T,
                &rec.id().to_string(),
                0,
                epoch,
                fence_server::ledger::Outcome::Completed(b"x".to_vec()),
            ),
            Reason::StaleEpoch,
        );
        refused_err(
            h.ledger.heartbeat(T, &rec.id().to_string(), 0, epoch, 0),
            Reason::StaleEpoch,
        );
        refused_err(
            h.ledger.fork(
                T,
                &ForkCmd {
                    run_id: "run".into(),
                    checkpoint_id: "cp1".into(),
                    epoch,
                    ..Default::default()
                },
            ),
            Reason::StaleEpoch,
        );
        refused_err(
            h.ledger.checkpoint(
                T,
                &CheckpointCmd {
                    run_id: "run".into(),
                    branch: "".into(),
                    epoch,
                    checkpoint_id: "z".into(),
                    ..Default::default()
                },
            ),
            Reason::StaleEpoch,
        );
    }
    refused(
        h.begin(&on(3, "", call("run", TRANSFER, &transfer("zed", 9, "z")))),
        Reason::UnknownEpoch,
    );
    // A compare-and-set restore with the wrong epoch loses.
    refused_err(h.ledger.restore(T, "run", "cp1", 1), Reason::StaleEpoch);
    assert_eq!(before, h.snapshot());
}

/// ACRFence scenario 4: five crash-restore cycles in a row, still one effect.
#[test]
fn five_crash_restore_cycles_still_make_one_effect() {
    let h = setup();
    checkpoint(&h, "run", "", 0, "cp1");
    let rec = executed(h.begin(&call("run", TRANSFER, &transfer("bob", 100, "u0"))));
    complete(&h, &rec, "tx-1");
    for cycle in 1..=5u64 {
        let restored = h.ledger.restore(T, "run", "cp1", 0).unwrap();
        assert_eq!(restored.epoch, cycle + 1);
        let again = replayed(h.begin(&on(
            restored.epoch,
            "",
            call("run", TRANSFER, &transfer("bob", 100, &format!("u{cycle}"))),
        )));
        assert_eq!(again.id(), rec.id());
        // Sometimes the agent crashes right after the replay and checkpoints nothing new.
    }
    let all = all_effects(&h);
    assert_eq!(all.len(), 1);
    assert_eq!(all[0].replays, 5);
    assert_eq!(h.ledger.get_run(T, "run").unwrap().restores.len(), 5);
}

/// A restore while the agent is mid-tape: a checkpoint taken during replay sits at the agent's
/// logical position, so restoring to it replays the rest of the tape.
#[test]
fn a_checkpoint_taken_during_replay_sits_at_the_logical_position() {
    let h = setup();
    checkpoint(&h, "run", "", 0, "cp0");
    for (i, to) in ["a", "b", "c"].iter().enumerate() {
        let r = executed(h.begin(&call("run", TRANSFER, &transfer(to, 1, &i.to_string()))));
        complete(&h, &r, to);
    }
    h.ledger.restore(T, "run", "cp0", 0).unwrap();
    replayed(h.begin(&on(2, "", call("run", TRANSFER, &transfer("a", 1, "x")))));
    checkpoint(&h, "run", "", 2, "cp-mid");
    let cp = h
        .ledger
        .get_run(T, "run")
        .unwrap()
        .checkpoints
        .into_iter()
        .find(|c| c.checkpoint_id == "cp-mid")
        .unwrap();
    assert_eq!(cp.position, 1);
    let restored = h.ledger.restore(T, "run", "cp-mid", 0).unwrap();
    assert_eq!(restored.tape.len(), 2);
    assert_eq!(
        replayed(h.begin(&on(3, "", call("run", TRANSFER, &transfer("b", 1, "y"))))).result,
        b"b"
    );
}

/// A fork's lineage is the parent's log up to the fork point, plus its own; what the parent did
/// after the fork point is carried: the same step replays, a redefined step is new.
#[test]
fn a_fork_sees_its_parent_before_the_fork_point_and_carries_the_rest() {
    let h = setup();
    let early = executed(h.begin(&keyed("run", "s1", TRANSFER, &transfer("bob", 1, "a"))));
    complete(&h, &early, "tx-early");
    checkpoint(&h, "run", "", 0, "cp1");
    let late = executed(h.begin(&keyed("run", "s2", TRANSFER, &transfer("bob", 2, "b"))));
    complete(&h, &late, "tx-late");
    let later = executed(h.begin(&keyed("run", "s3", TRANSFER, &transfer("bob", 3, "b"))));
    complete(&h, &later, "tx-later");
    let forked = h
        .ledger
        .fork(
            T,
            &ForkCmd {
                run_id: "run".into(),
                checkpoint_id: "cp1".into(),
                epoch: 1,
                new_branch: "alt".into(),
                reason: "try".into(),
            },
        )
        .unwrap();
    assert_eq!(
        forked.carried.iter().map(|r| r.id()).collect::<Vec<_>>(),
        vec![late.id(), later.id()]
    );
    // Before the fork point: visible, replays.
    assert_eq!(
        replayed(h.begin(&on(
            1,
            "alt",
            keyed("run", "s1", TRANSFER, &transfer("bob", 1, "z"))
        )))
        .result,
        b"tx-early"
    );
    refused(
        h.begin(&on(
            1,
            "alt",
            call("run", TRANSFER, &transfer("bob", 1, "z")),
        )),
        Reason::DuplicateIntent,
    );
    // After the fork point, the same step with the same intent is the carried effect: replayed.
    let carried = replayed(h.begin(&on(
        1,
        "alt",
        keyed("run", "s2", TRANSFER, &transfer("bob", 2, "c")),
    )));
    assert_eq!(
        (carried.id(), carried.result.as_slice()),
        (late.id(), &b"tx-late"[..])
    );
    // A carried step redefined on the fork is a new effect (the fork is the divergence)...
    let fresh = executed(h.begin(&on(
        1,
        "alt",
        keyed("run", "s3", TRANSFER, &transfer("carol", 3, "c")),
    )));
    assert_ne!(fresh.id(), later.id());
    // ...and from then on the step means what the fork made it mean.
    refused(
        h.begin(&on(
            1,
            "alt",
            keyed("run", "s3", TRANSFER, &transfer("bob", 3, "d")),
        )),
        Reason::ArgumentMismatch,
    );
    // The lineage view: the parent's effects before the fork point, then the branch's own.
    let (lineage, _) = h
        .ledger
        .list_effects(
            T,
            &ListQuery {
                run_id: "run".into(),
                branch: "alt".into(),
                lineage: true,
                ..Default::default()
            },
        )
        .unwrap();
    assert_eq!(
        lineage.iter().map(|e| e.id()).collect::<Vec<_>>(),
        vec![early.id(), late.id(), fresh.id()]
    );
    let (own, _) = h
        .ledger
        .list_effects(
            T,
            &ListQuery {
                run_id: "run".into(),
                branch: "alt".into(),
                ..Default::default()
            },
        )
        .unwrap();
    assert_eq!(
        own.iter().map(|e| e.id()).collect::<Vec<_>>(),
        vec![late.id(), fresh.id()],
        "the branch's own log: the adopted effect and its new one"
    );
    // Unknown branch / checkpoint.
    refused(
        h.begin(&on(1, "nope", call("run", TRANSFER, "{}"))),
        Reason::UnknownRecord,
    );
    refused_err(
        h.ledger.restore(T, "run", "missing", 0),
        Reason::UnknownRecord,
    );
}

fn token(t: &str) -> Vec<CredentialUse> {
    vec![CredentialUse {
        token: t.as_bytes().to_vec(),
        budget: 1,
    }]
}

/// ACRFence scenario 3: a one-time token spent before the restore stays spent, on the restored
/// branch and on a fork.
#[test]
fn a_spent_one_time_token_stays_spent_across_restore_and_fork() {
    let h = setup();
    h.tool("cloud.delete", OpClass::NonRetryable, &["request_id"]);
    checkpoint(&h, "run", "", 0, "cp1");
    let del = executed(h.begin(&BeginCmd {
        credentials: token("otp-123"),
        ..call("run", "cloud.delete", r#"{"vm":"prod-1","request_id":"a"}"#)
    }));
    complete(&h, &del, "deleted");
    let cred = h.ledger.get_credential(T, b"otp-123").unwrap();
    assert_eq!((cred.uses, cred.budget), (1, 1));

    h.ledger.restore(T, "run", "cp1", 0).unwrap();
    // The exact replay of the effect that spent it gets the recorded result, not a new use...
    let again = replayed(h.begin(&on(
        2,
        "",
        BeginCmd {
            credentials: token("otp-123"),
            ..call("run", "cloud.delete", r#"{"vm":"prod-1","request_id":"b"}"#)
        },
    )));
    assert_eq!(again.result, b"deleted");
    assert_eq!(h.ledger.get_credential(T, b"otp-123").unwrap().uses, 1);
    // ...but any other use is refused, before FORK_REQUIRED.
    let before = h.snapshot();
    let r = refused(
        h.begin(&on(
            2,
            "",
            BeginCmd {
                credentials: token("otp-123"),
                ..call("run", "cloud.delete", r#"{"vm":"prod-2","request_id":"c"}"#)
            },
        )),
        Reason::CredentialConsumed,
    );
    assert_eq!(r.recovery, Recovery::Reauthenticate);
    assert_eq!(r.receipt.unwrap().id(), del.id());
    assert_eq!(before, h.snapshot());

    // On a fork from before the spend, the spending effect is carried: its exact replay gets
    // the recorded result (no new use), any other use is refused.
    h.ledger
        .fork(
            T,
            &ForkCmd {
                run_id: "run".into(),
                checkpoint_id: "cp1".into(),
                epoch: 2,
                new_branch: "f".into(),
                reason: "".into(),
            },
        )
        .unwrap();
    refused(
        h.begin(&on(
            2,
            "f",
            BeginCmd {
                credentials: token("otp-123"),
                ..call("run", "cloud.delete", r#"{"vm":"prod-3","request_id":"d"}"#)
            },
        )),
        Reason::CredentialConsumed,
    );
    let on_fork = replayed(h.begin(&on(
        2,
        "f",
        BeginCmd {
            credentials: token("otp-123"),
            ..call("run", "cloud.delete", r#"{"vm":"prod-1","request_id":"e"}"#)
        },
    )));
    assert_eq!(
        (on_fork.id(), on_fork.result.as_slice()),
        (del.id(), &b"deleted"[..])
    );
    assert_eq!(h.ledger.get_credential(T, b"otp-123").unwrap().uses, 1);
    // In another run too: a credential belongs to the tenant, not to a run.
    refused(
        h.begin(&BeginCmd {
            credentials: token("otp-123"),
            ..call("other-run", "cloud.delete", r#"{"vm":"prod-1"}"#)
        }),
        Reason::CredentialConsumed,
    );
    // Another tenant's identical token is another credential.
    assert!(matches!(
        h.ledger
            .begin(
                "tenant-b",
                &BeginCmd {
                    credentials: token("otp-123"),
                    ..call("run", "cloud.delete", r#"{"vm":"prod-1"}"#)
                }
            )
            .unwrap()
            .decision,
        Decision::Execute { .. }
    ));
}

/// The permission-prompt pattern: an approval bound to one exact call runs it once; the second
/// identical call replays the first's result.
#[test]
fn an_approved_call_runs_once_and_its_repeat_replays() {
    let h = setup();
    h.tool("fs.delete", OpClass::NonRetryable, &["request_id"]);
    let (cred, created) = h
        .ledger
        .register_credential(
            T,
            &CredentialDef {
                token: b"approval-7".to_vec(),
                budget: 1,
                bound_tool: "fs.delete".into(),
                bound_arguments_json: r#"{"path":"/tmp/x"}"#.into(),
            },
        )
        .unwrap();
    assert!(created && cred.uses == 0);
    let approved = || BeginCmd {
        credentials: token("approval-7"),
        ..call("run", "fs.delete", r#"{"path":"/tmp/x","request_id":"r1"}"#)
    };
    let rec = executed(h.begin(&approved()));
    complete(&h, &rec, "deleted");
    let second = replayed(h.begin(&BeginCmd {
        arguments_json: r#"{"request_id":"r2","path":"/tmp/x"}"#.into(),
        ..approved()
    }));
    assert_eq!(second.id(), rec.id());
    // The approval is for that exact call only.
    refused(
        h.begin(&BeginCmd {
            arguments_json: r#"{"path":"/etc"}"#.into(),
            ..approved()
        }),
        Reason::CredentialMismatch,
    );
    refused(
        h.begin(&BeginCmd {
            tool: "other".into(),
            ..approved()
        }),
        Reason::CredentialMismatch,
    );
}

#[test]
fn multi_use_credentials_are_spent_up_to_their_budget() {
    let h = setup();
    h.ledger
        .register_credential(
            T,
            &CredentialDef {
                token: b"api-3".to_vec(),
                budget: 3,
                ..Default::default()
            },
        )
        .unwrap();
    for i in 0..3 {
        executed(h.begin(&BeginCmd {
            credentials: token("api-3"),
            ..call("run", "t", &format!("{i}"))
        }));
    }
    refused(
        h.begin(&BeginCmd {
            credentials: token("api-3"),
            ..call("run", "t", "9")
        }),
        Reason::CredentialConsumed,
    );
    let c = h.ledger.get_credential(T, b"api-3").unwrap();
    assert_eq!((c.uses, c.spent_by.len()), (3, 3));
}

#[test]
fn raw_credentials_are_never_stored() {
    let h = setup();
    let secret = b"super-secret-token-value";
    executed(h.begin(&BeginCmd {
        credentials: vec![CredentialUse {
            token: secret.to_vec(),
            budget: 1,
        }],
        ..call("run", "t", "{}")
    }));
    for (k, v) in h.snapshot() {
        assert!(!k.windows(secret.len()).any(|w| w == secret));
        assert!(!v.windows(secret.len()).any(|w| w == secret));
    }
    let q = h
        .ledger
        .query_outcome(
            T,
            &OutcomeKey::StepKey {
                run_id: "run".into(),
                branch: "".into(),
                step_key: "x".into(),
            },
        )
        .unwrap();
    assert!(q.is_none());
}

fn complete_at(
    h: &Harness,
    rec: &fence_server::ledger::records::EffectRecord,
    epoch: u64,
    result: &str,
) {
    h.ledger
        .complete(
            T,
            &rec.id().to_string(),
            rec.attempt,
            epoch,
            fence_server::ledger::Outcome::Completed(result.as_bytes().to_vec()),
        )
        .unwrap();
}

fn fork(h: &Harness, checkpoint: &str, epoch: u64, name: &str) -> Vec<u64> {
    h.ledger
        .fork(
            T,
            &ForkCmd {
                run_id: "run".into(),
                checkpoint_id: checkpoint.into(),
                epoch,
                new_branch: name.into(),
                reason: "replan".into(),
            },
        )
        .unwrap()
        .carried
        .iter()
        .map(|r| r.seq)
        .collect()
}

/// The fault benchmark's sibling-fork pattern (workflow 3381 of seed 1): restored to a point
/// before an earlier fork, the agent forks again and re-issues what the first fork did. The
/// first fork's effects are done in the world: carried, they replay on the second.
#[test]
fn a_second_fork_from_the_same_point_replays_what_the_first_one_did() {
    let h = setup();
    h.tool("email.send", OpClass::NonRetryable, &["ts"]);
    checkpoint(&h, "run", "", 0, "cp");
    // On main after the checkpoint: an accidental redirect, so a restore must fork.
    let wrong = executed(h.begin(&call("run", TRANSFER, &transfer("mallory", 9, "a"))));
    complete(&h, &wrong, "tx-wrong");
    h.ledger.restore(T, "run", "cp", 0).unwrap();
    refused(
        h.begin(&on(2, "", call("run", TRANSFER, &transfer("emp", 9, "b")))),
        Reason::ForkRequired,
    );
    assert_eq!(fork(&h, "cp", 2, "f1"), [wrong.seq]);
    let pay = executed(h.begin(&on(
        2,
        "f1",
        call("run", TRANSFER, &transfer("emp", 9, "c")),
    )));
    complete_at(&h, &pay, 2, "tx-pay");
    let mail = executed(h.begin(&on(
        2,
        "f1",
        call("run", "email.send", r#"{"to":"o","ts":1}"#),
    )));
    complete_at(&h, &mail, 2, "sent");

    // The agent crashes and its framework restores main's checkpoint (before f1 began): what
    // f1 did is carried by main now, and the redirect is due again.
    h.ledger.restore(T, "run", "cp", 0).unwrap();
    let run = h.ledger.get_run(T, "run").unwrap().run;
    assert_eq!(run.branches[0].carried_seqs, [pay.seq, mail.seq]);
    assert_eq!(run.branches[0].tape_seqs, [wrong.seq]);
    // A new call while the redirect is due must fork.
    refused(
        h.begin(&on(3, "", call("run", TRANSFER, &transfer("bob", 1, "e")))),
        Reason::ForkRequired,
    );
    // The second fork carries main's effects and what f1 did: re-issued there, f1's replay.
    assert_eq!(fork(&h, "cp", 3, "f2"), [wrong.seq, pay.seq, mail.seq]);
    let again = replayed(h.begin(&on(
        3,
        "f2",
        call("run", TRANSFER, &transfer("emp", 9, "f")),
    )));
    assert_eq!(
        (again.id(), again.result.as_slice()),
        (pay.id(), &b"tx-pay"[..])
    );
    let mail_again = replayed(h.begin(&on(
        3,
        "f2",
        call("run", "email.send", r#"{"to":"o","ts":2}"#),
    )));
    assert_eq!(mail_again.id(), mail.id());
    executed(h.begin(&on(
        3,
        "f2",
        call("run", TRANSFER, &transfer("bob", 1, "g")),
    )));
    let all = all_effects(&h);
    assert_eq!(
        all.len(),
        4,
        "one redirect, one payment, one e-mail and the new transfer in the world"
    );
}

/// The keyed variant (workflow 1283 of seed 1): a framework that names a re-planned step anew
/// does not make a done intent new. Restored to before a fork, the agent re-issues the fork's
/// intent under yet another step key, on main: the carried effect replays, and the new key is
/// indexed to it, so a later restore replays it by that key too.
#[test]
fn a_carried_intent_replays_under_a_new_step_key() {
    let h = setup();
    checkpoint(&h, "run", "", 0, "cp");
    let small = executed(h.begin(&keyed("run", "s0-g0", TRANSFER, &transfer("bob", 8, "a"))));
    complete(&h, &small, "tx-8");
    h.ledger.restore(T, "run", "cp", 0).unwrap();
    refused(
        h.begin(&on(
            2,
            "",
            keyed("run", "s0-g1", TRANSFER, &transfer("bob", 64, "b")),
        )),
        Reason::ForkRequired,
    );
    fork(&h, "cp", 2, "f1");
    let big = executed(h.begin(&on(
        2,
        "f1",
        keyed("run", "s0-g1", TRANSFER, &transfer("bob", 64, "c")),
    )));
    complete_at(&h, &big, 2, "tx-64");

    h.ledger.restore(T, "run", "cp", 0).unwrap();
    // On main, under a third name: the transfer of 64 is done (on f1), so it replays.
    let replay = replayed(h.begin(&on(
        3,
        "main",
        keyed("run", "s0-g2", TRANSFER, &transfer("bob", 64, "d")),
    )));
    assert_eq!(replay.id(), big.id());
    // Adopted, the effect is main's under both names: another intent under either is a
    // mismatch, not a new effect.
    for key in ["s0-g1", "s0-g2"] {
        refused(
            h.begin(&on(
                3,
                "",
                keyed("run", key, TRANSFER, &transfer("bob", 65, "e")),
            )),
            Reason::ArgumentMismatch,
        );
    }
    // Adopted into main's log under "s0-g2": after another restore, it is on the tape.
    checkpoint(&h, "run", "", 3, "cp2");
    let restored = h.ledger.restore(T, "run", "cp", 0).unwrap();
    assert!(restored.tape.iter().any(|r| r.id() == big.id()));
    let by_key = replayed(h.begin(&on(
        4,
        "",
        keyed("run", "s0-g2", TRANSFER, &transfer("bob", 64, "f")),
    )));
    assert_eq!(by_key.id(), big.id());
    let all = all_effects(&h);
    assert_eq!(all.len(), 2, "one transfer of 8 and one of 64");
}

/// Checkpoint creates an unknown run only where Begin would (branch "main", epoch 0 or 1): a
/// framework checkpoints before its first tool call. Elsewhere the run is NOT_FOUND, and
/// nothing is written.
#[test]
fn a_checkpoint_creates_an_unknown_run_only_on_main_at_its_first_epoch() {
    let h = setup();
    let before = h.snapshot();
    for (branch, epoch) in [("fix", 1), ("", 2)] {
        let err = h
            .ledger
            .checkpoint(
                T,
                &CheckpointCmd {
                    run_id: "new-run".into(),
                    branch: branch.into(),
                    epoch,
                    checkpoint_id: "cp".into(),
                    ..Default::default()
                },
            )
            .unwrap_err();
        assert_eq!(tonic_code(err), tonic::Code::NotFound);
    }
    assert_eq!(h.snapshot(), before);
    checkpoint(&h, "new-run", "", 0, "cp");
    let run = h.ledger.get_run(T, "new-run").unwrap();
    assert_eq!(run.run.epoch, 1);
    assert_eq!(run.checkpoints.len(), 1);
}

fn tonic_code(e: fence_server::ledger::LedgerError) -> tonic::Code {
    tonic::Status::from(e).code()
}

/// A checkpoint saved while a replay tape was due (a framework resuming from a restored
/// checkpoint saves a new one before re-issuing anything), then a crash and a restore to it:
/// the effects still due there are not causally after it (they name older checkpoints), yet
/// the agent has not re-issued them. They stay done: re-issued, they replay.
#[test]
fn a_restore_to_a_checkpoint_saved_while_a_tape_was_due_keeps_the_due_effects_done() {
    let h = setup();
    let save = |id: &str, parent: &str, epoch: u64| {
        h.ledger
            .checkpoint(
                T,
                &CheckpointCmd {
                    run_id: "run".into(),
                    epoch,
                    checkpoint_id: id.into(),
                    parent_checkpoint_id: parent.into(),
                    ..Default::default()
                },
            )
            .unwrap();
    };
    let pay = |to: &str, reference: &str, parent: &str, epoch: u64| BeginCmd {
        parent_checkpoint_id: parent.into(),
        ..on(
            epoch,
            "",
            call("run", TRANSFER, &transfer(to, 5, reference)),
        )
    };
    save("cp0", "", 1);
    let a = executed(h.begin(&pay("ann", "r1", "cp0", 1)));
    complete(&h, &a, "tx-ann");
    save("cp1", "cp0", 1);
    let b = executed(h.begin(&pay("bob", "r2", "cp1", 1)));
    complete(&h, &b, "tx-bob");
    save("cp2", "cp1", 1);

    let restored = h.ledger.restore(T, "run", "cp0", 0).unwrap();
    assert_eq!(restored.tape.len(), 2);
    // Resumed from cp0, the framework saves its state before the first call.
    save("cp0-resumed", "cp0", 2);
    let restored = h.ledger.restore(T, "run", "cp0-resumed", 0).unwrap();
    assert!(
        restored.tape.is_empty(),
        "nothing was done after cp0-resumed"
    );
    let run = h.ledger.get_run(T, "run").unwrap().run;
    assert_eq!(run.branches[0].carried_seqs, [a.seq, b.seq]);

    // Re-issued with fresh references: both replay; nothing runs twice.
    let again = replayed(h.begin(&pay("ann", "r3", "cp0-resumed", 3)));
    assert_eq!(again.id(), a.id());
    let again = replayed(h.begin(&pay("bob", "r4", "cp0-resumed", 3)));
    assert_eq!(again.id(), b.id());
    // A new intent is a new effect, not refused for what was carried.
    executed(h.begin(&pay("cat", "r5", "cp0-resumed", 3)));
}

/// A drifted call is refused, forked and done on the fork; a restore to the same checkpoint
/// on main then takes the agent back there, and its call is answered by the fork's effect.
/// That effect took the place of the entry first recorded in the call's step: the entry is
/// no longer due (the calls re-issued after it are matched to their own entries, and no later
/// call is refused for it), yet stays done (an equivalent call still replays it). See
/// `ledger_framework_props::a_forked_call_taken_back_to_its_branch_leaves_no_superseded_entry_due`.
#[test]
fn a_forked_effect_taken_back_to_main_supersedes_the_due_entry_of_its_step() {
    let h = setup();
    let save = |id: &str, parent: &str, branch: &str, epoch: u64| {
        h.ledger
            .checkpoint(
                T,
                &CheckpointCmd {
                    run_id: "run".into(),
                    branch: branch.into(),
                    epoch,
                    checkpoint_id: id.into(),
                    parent_checkpoint_id: parent.into(),
                },
            )
            .unwrap();
    };
    let pay = |to: &str, reference: &str, parent: &str, branch: &str, epoch: u64| BeginCmd {
        parent_checkpoint_id: parent.into(),
        ..on(
            epoch,
            branch,
            call("run", TRANSFER, &transfer(to, 5, reference)),
        )
    };
    save("cp0", "", "", 1);
    let ann = executed(h.begin(&pay("ann", "r1", "cp0", "", 1)));
    complete(&h, &ann, "tx-ann");
    save("cp1", "cp0", "", 1);
    let bob = executed(h.begin(&pay("bob", "r2", "cp1", "", 1)));
    complete(&h, &bob, "tx-bob");

    h.ledger.restore(T, "run", "cp0", 0).unwrap();
    refused(
        h.begin(&pay("cat", "r3", "cp0", "", 2)),
        Reason::ForkRequired,
    );
    fork(&h, "cp0", 2, "pay-cat");
    let cat = executed(h.begin(&pay("cat", "r4", "cp0", "pay-cat", 2)));
    complete(&h, &cat, "tx-cat");

    // Back on main at cp0: ann and bob due, cat carried from the fork.
    let restored = h.ledger.restore(T, "run", "cp0", 0).unwrap();
    assert_eq!(restored.branch, "main");
    let tape: Vec<u64> = restored.tape.iter().map(|r| r.seq).collect();
    assert_eq!(tape, [ann.seq, bob.seq]);
    let again = replayed(h.begin(&pay("cat", "r5", "cp0", "", 3)));
    assert_eq!(again.id(), cat.id());
    let main = &h.ledger.get_run(T, "run").unwrap().run.branches[0];
    assert_eq!(
        main.tape_seqs,
        [bob.seq],
        "cat took ann's place in step cp0"
    );
    assert!(main.carried_seqs.contains(&ann.seq), "ann stays done");

    // Bob is still due: anything else is refused for him (fail closed), with his receipt.
    let before = h.snapshot();
    let r = refused(
        h.begin(&pay("dan", "r6", "cp0", "", 3)),
        Reason::ForkRequired,
    );
    assert_eq!(r.receipt.unwrap().id(), bob.id());
    assert_eq!(before, h.snapshot(), "the refusal changes nothing");
    save("cp1-again", "cp0", "", 3);
    let again = replayed(h.begin(&pay("bob", "r7", "cp1-again", "", 3)));
    assert_eq!(again.id(), bob.id());
    // Ann's call re-issued anyway replays her transfer: it does not run a second time.
    let again = replayed(h.begin(&pay("ann", "r8", "cp1-again", "", 3)));
    assert_eq!(again.id(), ann.id());
    // With nothing due, a new intent is a new effect.
    executed(h.begin(&pay("dan", "r9", "cp1-again", "", 3)));
    let effects = all_effects(&h);
    assert_eq!(effects.len(), 4, "ann, bob, cat and dan, each once");
    h.assert_sound();
}
