//! Batches (`Ledger::begin_many`, `Ledger::complete_many`): each call is decided exactly as if
//! sent alone, in order (also as a property over random calls cut into random batches), and
//! everything is durable when the batch returns.

mod common;

use common::*;
use fence_server::ledger::batch::CompleteCmd;
use fence_server::ledger::outcome::OutcomeKey;
use fence_server::ledger::{BeginCmd, CredentialUse, Decision, OpClass, Outcome, Reason, State};
use fence_server::store::{RocksStore, StoreOptions};
use proptest::prelude::*;

const PAY: &str = "bank.transfer";

fn setup() -> Harness {
    with_tools(harness())
}

fn with_tools(h: Harness) -> Harness {
    h.tool(PAY, OpClass::NonRetryable, &["ts"]);
    h
}

fn pay(step: &str, amount: u32) -> BeginCmd {
    keyed(
        "run",
        step,
        PAY,
        &format!(r#"{{"to":"bob","amount":{amount},"ts":"{step}"}}"#),
    )
}

/// A mix that exercises every kind of answer within one batch: new effects, a call that sees
/// an effect recorded earlier in the same batch, a mismatch, an invalid call, a keyless
/// repeat.
fn mixed_calls() -> Vec<BeginCmd> {
    vec![
        pay("s1", 100),
        pay("s2", 200),
        // The same step again: in progress (granted two calls earlier, in this batch).
        pay("s1", 100),
        // The same step with another amount: a mismatch.
        pay("s1", 999),
        // Malformed arguments: this call's error only.
        keyed("run", "s3", PAY, "{not json"),
        call("run", PAY, r#"{"to":"carol","amount":5}"#),
        // The same keyless intent again while the previous call runs: in progress.
        call("run", PAY, r#"{"to":"carol","amount":5}"#),
        // Another run in the same batch.
        keyed("other-run", "s1", PAY, r#"{"to":"dave","amount":1}"#),
    ]
}

#[test]
fn a_batch_decides_each_call_exactly_as_if_sent_alone_in_order() {
    let batched = setup();
    let alone = setup();
    let cmds = mixed_calls();

    let answers = batched.ledger.begin_many(T, &cmds).unwrap();
    assert_eq!(answers.len(), cmds.len());
    for (cmd, answer) in cmds.iter().zip(answers) {
        let single = alone.ledger.begin(T, cmd);
        match (answer, single) {
            (Ok(b), Ok(s)) => assert_eq!(b, s, "{cmd:?}"),
            (Err(b), Err(s)) => assert_eq!(b.to_string(), s.to_string(), "{cmd:?}"),
            (b, s) => panic!("{cmd:?}: batch {b:?}, alone {s:?}"),
        }
    }
    // Byte for byte the same ledger.
    assert_eq!(batched.snapshot(), alone.snapshot());

    // And the kinds of answer are the ones the calls ask for.
    let answers = setup().ledger.begin_many(T, &cmds).unwrap();
    let kinds: Vec<String> = answers
        .iter()
        .map(|a| match a {
            Ok(b) => b.decision.kind().to_string(),
            Err(e) => format!("error: {e}"),
        })
        .collect();
    assert!(matches!(
        &answers[2],
        Ok(b) if matches!(b.decision, Decision::InProgress { .. })
    ));
    refused(
        answers[3].as_ref().unwrap().decision.clone(),
        Reason::ArgumentMismatch,
    );
    assert!(kinds[4].starts_with("error: "), "{kinds:?}");
    assert!(matches!(
        &answers[6],
        Ok(b) if matches!(b.decision, Decision::InProgress { .. })
    ));
    executed(answers[7].as_ref().unwrap().decision.clone());
}

#[test]
fn everything_a_batch_answered_is_on_disk_when_it_returns() {
    let Harness { ledger, dir, .. } = with_tools(rocksdb_harness());
    let answers = ledger.begin_many(T, &mixed_calls()).unwrap();
    let granted: Vec<_> = answers
        .into_iter()
        .filter_map(|a| match a.ok()?.decision {
            Decision::Execute { receipt, .. } => Some(*receipt),
            _ => None,
        })
        .collect();
    assert_eq!(granted.len(), 4);
    let done: Vec<CompleteCmd> = granted
        .iter()
        .map(|r| CompleteCmd {
            effect_id: r.id().to_string(),
            attempt: r.attempt,
            epoch: 0,
            outcome: Outcome::Completed(format!("tx-{}", r.seq).into_bytes()),
        })
        .collect();
    for r in ledger.complete_many(T, &done).unwrap() {
        assert_eq!(
            r.unwrap().state,
            fence_server::ledger::State::Completed.code()
        );
    }
    drop(ledger);

    // Reopen the directory: every grant and completion is there.
    let store = RocksStore::open(dir.path(), &StoreOptions::default()).unwrap();
    let ledger = fence_server::ledger::Ledger::new(
        store,
        std::sync::Arc::new(fence_server::clock::ManualClock::new(1_700_000_000_000)),
        fence_server::ledger::LedgerConfig {
            credential_key: [7; 32],
            ..Default::default()
        },
    );
    for r in &granted {
        let stored = ledger
            .query_outcome(T, &OutcomeKey::EffectId(r.id().to_string()))
            .unwrap()
            .expect("an acknowledged grant survives");
        assert_eq!(stored.state, State::Completed.code());
        assert_eq!(stored.result, format!("tx-{}", r.seq).into_bytes());
    }
    // A keyed call re-issued replays.
    let again = ledger.begin(T, &pay("s2", 200)).unwrap().decision;
    assert_eq!(replayed(again).downstream_key, granted[1].downstream_key);
}

#[test]
fn a_batch_completes_each_effect_as_if_reported_alone() {
    let batched = setup();
    let alone = setup();
    let mut ids = Vec::new();
    for h in [&batched, &alone] {
        ids = h
            .ledger
            .begin_many(T, &[pay("s1", 1), pay("s2", 2)])
            .unwrap()
            .into_iter()
            .map(|r| executed(r.unwrap().decision).id().to_string())
            .collect();
    }
    let done = |id: &str, outcome: Outcome| CompleteCmd {
        effect_id: id.to_owned(),
        attempt: 1,
        epoch: 0,
        outcome,
    };
    let unknown_id = ids[1].replace(|c: char| c.is_ascii_digit(), "0");
    let cmds = [
        done(&ids[0], Outcome::Completed(b"tx-1".to_vec())),
        // Another result for the effect just completed in this batch: a conflict.
        done(&ids[0], Outcome::Completed(b"tx-other".to_vec())),
        done(&unknown_id, Outcome::Completed(b"tx-?".to_vec())),
        done(
            &ids[1],
            Outcome::FailedBeforeInput("connection refused".into()),
        ),
    ];
    let answers = batched.ledger.complete_many(T, &cmds).unwrap();
    assert_eq!(answers.len(), cmds.len());
    for (cmd, answer) in cmds.iter().zip(answers) {
        let single = alone.ledger.complete(
            T,
            &cmd.effect_id,
            cmd.attempt,
            cmd.epoch,
            cmd.outcome.clone(),
        );
        match (answer, single) {
            (Ok(b), Ok(s)) => assert_eq!(b, s, "{cmd:?}"),
            (Err(b), Err(s)) => assert_eq!(b.to_string(), s.to_string(), "{cmd:?}"),
            (b, s) => panic!("{cmd:?}: batch {b:?}, alone {s:?}"),
        }
    }
    assert_eq!(batched.snapshot(), alone.snapshot());
    let again = batched.ledger.complete_many(T, &cmds[1..2]).unwrap();
    refused_err(again.into_iter().next().unwrap(), Reason::ResultConflict);
}

#[test]
fn a_one_time_credential_is_spent_once_even_within_one_batch() {
    let h = setup();
    let with_token = |step: &str, amount: u32| BeginCmd {
        credentials: vec![CredentialUse {
            token: b"approval-77".to_vec(),
            budget: 1,
        }],
        ..pay(step, amount)
    };
    let answers = h
        .ledger
        .begin_many(T, &[with_token("s1", 100), with_token("s2", 200)])
        .unwrap();
    executed(answers[0].as_ref().unwrap().decision.clone());
    refused(
        answers[1].as_ref().unwrap().decision.clone(),
        Reason::CredentialConsumed,
    );
}

#[test]
fn an_empty_or_oversized_batch_is_refused_and_writes_nothing() {
    let h = setup();
    let before = h.snapshot();
    invalid(h.ledger.begin_many(T, &[]), "calls");
    let many: Vec<BeginCmd> = (0..129).map(|i| pay(&format!("s{i}"), i)).collect();
    invalid(h.ledger.begin_many(T, &many), "calls");
    invalid(h.ledger.complete_many(T, &[]), "completions");
    assert_eq!(h.snapshot(), before);
    // The limit itself is accepted.
    let answers = h.ledger.begin_many(T, &many[..128]).unwrap();
    assert!(answers.iter().all(|a| a.is_ok()));
}

/// One random call: a tool class, an intent, maybe a step key, a credential, a repeat flag.
fn random_call() -> impl Strategy<Value = BeginCmd> {
    (
        0..2usize,
        0..3u8,
        prop::option::of(0..4u8),
        prop::option::of(0..2u8),
        prop::bool::weighted(0.1),
        0..3u8,
    )
        .prop_map(|(tool, intent, step, token, deliberate, run)| BeginCmd {
            step_key: step.map(|s| format!("s{s}")).unwrap_or_default(),
            credentials: token
                .map(|t| {
                    vec![CredentialUse {
                        token: format!("tok-{t}").into_bytes(),
                        budget: 2,
                    }]
                })
                .unwrap_or_default(),
            deliberate_repeat: deliberate,
            ..call(
                &format!("run-{run}"),
                [PAY, "crm.upsert"][tool],
                &format!(r#"{{"to":"bob","amount":{intent},"ts":"{step:?}"}}"#),
            )
        })
}

fn setup_props() -> Harness {
    let h = setup();
    h.tool("crm.upsert", OpClass::Deduplicate, &["ts"]);
    h
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(32), ..ProptestConfig::default() })]

    /// Any sequence of calls, cut into batches anywhere and completed in batches, leaves the
    /// same answers and the same ledger, byte for byte, as the calls sent one by one.
    #[test]
    fn batches_are_their_calls_sent_one_by_one(
        calls in prop::collection::vec(random_call(), 1..24),
        cuts in prop::collection::vec(1..6usize, 1..24),
    ) {
        let batched = setup_props();
        let alone = setup_props();
        let mut rest = &calls[..];
        let mut cut = cuts.iter().cycle();
        while !rest.is_empty() {
            let n = (*cut.next().unwrap()).min(rest.len());
            let (batch, tail) = rest.split_at(n);
            rest = tail;
            let answers = batched.ledger.begin_many(T, batch).unwrap();
            let mut done_batched = Vec::new();
            for (cmd, answer) in batch.iter().zip(answers) {
                let single = alone.ledger.begin(T, cmd);
                prop_assert_eq!(format!("{answer:?}"), format!("{single:?}"));
                if let Ok(b) = answer
                    && let Decision::Execute { receipt, recorded: true } = b.decision
                {
                    done_batched.push(CompleteCmd {
                        effect_id: receipt.id().to_string(),
                        attempt: receipt.attempt,
                        epoch: 0,
                        outcome: Outcome::Completed(format!("r{}", receipt.seq).into_bytes()),
                    });
                }
            }
            // Complete half of what was granted, in one batch.
            done_batched.truncate(done_batched.len().div_ceil(2));
            if !done_batched.is_empty() {
                let answers = batched.ledger.complete_many(T, &done_batched).unwrap();
                for (c, answer) in done_batched.iter().zip(answers) {
                    let single =
                        alone.ledger.complete(T, &c.effect_id, c.attempt, c.epoch, c.outcome.clone());
                    prop_assert_eq!(format!("{answer:?}"), format!("{single:?}"));
                }
            }
        }
        prop_assert_eq!(batched.snapshot(), alone.snapshot());
    }
}
