//! The state machine's transitions and refusals on the normal path (no restore), each against a
//! real RocksDB ledger with a manual clock.

mod common;

use common::*;
use fence_server::ledger::CredentialUse;
use fence_server::ledger::credentials::CredentialDef;
use fence_server::ledger::outcome::{ListQuery, OutcomeKey};
use fence_server::ledger::records::{EffectRecord, RunRecord};
use fence_server::ledger::{
    BeginCmd, Decision, Finding, LedgerError, OpClass, Outcome, Reason, Recovery, State, ToolDef,
};
use fence_server::store::{Batch, Store, codec, keys};

const TRANSFER: &str = "bank.transfer";
const ARGS: &str = r#"{"to":"bob","amount":100,"reference":"u-1","ts":"2026-01-01T00:00:00Z"}"#;
const DRIFTED: &str =
    r#"{ "ts":"2026-01-01T00:09:13Z", "amount":100.0, "reference":"u-2", "to":"bob" }"#;
const REDIRECTED: &str =
    r#"{"to":"carol","amount":100,"reference":"u-3","ts":"2026-01-01T00:00:00Z"}"#;

fn bank(h: &Harness) {
    h.tool(TRANSFER, OpClass::NonRetryable, &["reference", "ts"]);
}

#[test]
fn a_first_call_is_granted_and_a_keyed_repeat_replays_its_result() {
    let h = harness();
    bank(&h);
    let rec = executed(h.begin(&keyed("r1", "r1:pay", TRANSFER, ARGS)));
    assert_eq!(rec.state(), State::Accepted);
    assert_eq!(rec.attempt, 1);
    assert!(rec.downstream_key.starts_with("fence-"));
    let done = complete(&h, &rec, "tx-1");
    assert_eq!(done.state(), State::Completed);

    // Same step key, volatile drift only (new reference, new timestamp, key order, 100.0).
    let again = replayed(h.begin(&keyed("r1", "r1:pay", TRANSFER, DRIFTED)));
    assert_eq!(again.result, b"tx-1");
    assert_eq!(again.id(), rec.id());
    assert_eq!(again.replays, 1);
}

#[test]
fn a_known_step_key_with_another_intent_is_an_argument_mismatch_and_writes_nothing() {
    let h = harness();
    bank(&h);
    let rec = executed(h.begin(&keyed("r1", "r1:pay", TRANSFER, ARGS)));
    complete(&h, &rec, "tx-1");
    let before = h.snapshot();
    let r = refused(
        h.begin(&keyed("r1", "r1:pay", TRANSFER, REDIRECTED)),
        Reason::ArgumentMismatch,
    );
    assert_eq!(r.recovery, Recovery::FixArgument);
    assert_eq!(r.receipt.unwrap().id(), rec.id());
    assert_eq!(before, h.snapshot());
}

#[test]
fn an_unkeyed_repeat_of_a_non_retryable_intent_is_a_suspected_duplicate() {
    let h = harness();
    bank(&h);
    let first = executed(h.begin(&call("r1", TRANSFER, ARGS)));
    complete(&h, &first, "tx-1");
    let before = h.snapshot();
    let r = refused(
        h.begin(&call("r1", TRANSFER, DRIFTED)),
        Reason::DuplicateIntent,
    );
    assert_eq!(r.recovery, Recovery::ConfirmRepeat);
    assert_eq!(r.receipt.unwrap().result, b"tx-1");
    assert_eq!(before, h.snapshot());

    // A deliberate repetition is a second, distinct effect with its own downstream key.
    let second = executed(h.begin(&BeginCmd {
        deliberate_repeat: true,
        ..call("r1", TRANSFER, DRIFTED)
    }));
    assert_ne!(second.id(), first.id());
    assert_eq!(second.occurrence, 2);
    assert_ne!(second.downstream_key, first.downstream_key);
    // Another intent is simply a new effect.
    executed(h.begin(&call("r1", TRANSFER, REDIRECTED)));
    // Another run is independent.
    executed(h.begin(&call("r2", TRANSFER, ARGS)));
}

#[test]
fn requires_effect_check_tools_also_refuse_unkeyed_duplicates() {
    let h = harness();
    h.tool(
        "cloud.create",
        OpClass::RequiresEffectCheck,
        &["request_id"],
    );
    let rec = executed(h.begin(&call(
        "r1",
        "cloud.create",
        r#"{"name":"vm1","request_id":"a"}"#,
    )));
    complete(&h, &rec, "vm1-id");
    refused(
        h.begin(&call(
            "r1",
            "cloud.create",
            r#"{"name":"vm1","request_id":"b"}"#,
        )),
        Reason::DuplicateIntent,
    );
}

#[test]
fn an_unregistered_tool_is_non_retryable() {
    let h = harness();
    let rec = executed(h.begin(&call("r1", "mystery", r#"{"x":1}"#)));
    assert_eq!(rec.class(), OpClass::NonRetryable);
    assert_eq!(rec.tool_version, 0);
    complete(&h, &rec, "done");
    refused(
        h.begin(&call("r1", "mystery", r#"{ "x" : 1.0 }"#)),
        Reason::DuplicateIntent,
    );
}

#[test]
fn deduplicate_tools_replay_an_unkeyed_repeat() {
    let h = harness();
    h.tool("mail.send", OpClass::Deduplicate, &["message_id"]);
    let rec = executed(h.begin(&call("r1", "mail.send", r#"{"to":"a@x","message_id":"1"}"#)));
    complete(&h, &rec, "sent");
    let again = replayed(h.begin(&call("r1", "mail.send", r#"{"message_id":"2","to":"a@x"}"#)));
    assert_eq!(again.result, b"sent");
}

#[test]
fn a_second_attempt_under_a_live_lease_is_in_progress_never_a_second_execution() {
    let h = harness();
    bank(&h);
    let rec = executed(h.begin(&keyed("r1", "r1:pay", TRANSFER, ARGS)));
    match h.begin(&keyed("r1", "r1:pay", TRANSFER, DRIFTED)) {
        Decision::InProgress {
            receipt,
            retry_after_ms,
        } => {
            assert_eq!(receipt.id(), rec.id());
            assert!(retry_after_ms > 0);
        }
        other => panic!("expected InProgress, got {other:?}"),
    }
    // Also for an unkeyed duplicate of a running DEDUPLICATE effect.
    h.tool("mail.send", OpClass::Deduplicate, &[]);
    executed(h.begin(&call("r1", "mail.send", r#"{"to":"a"}"#)));
    assert!(matches!(
        h.begin(&call("r1", "mail.send", r#"{"to":"a"}"#)),
        Decision::InProgress { .. }
    ));
}

#[test]
fn heartbeats_extend_the_lease_and_a_superseded_attempt_loses_it() {
    let h = harness();
    h.tool("mail.send", OpClass::Deduplicate, &[]);
    let rec = executed(h.begin(&keyed("r1", "s", "mail.send", "{}")));
    let id = rec.id().to_string();
    h.clock.advance(LEASE - 1);
    let beat = h.ledger.heartbeat(T, &id, 1, 0, 0).unwrap();
    assert_eq!(beat.state(), State::Running);
    h.clock.advance(LEASE - 1);
    // Still live thanks to the heartbeat.
    assert!(matches!(
        h.begin(&keyed("r1", "s", "mail.send", "{}")),
        Decision::InProgress { .. }
    ));
    // Lapse: a DEDUPLICATE effect is granted again, same id and downstream key.
    h.clock.advance(2);
    let again = executed(h.begin(&keyed("r1", "s", "mail.send", "{}")));
    assert_eq!((again.id(), again.attempt), (rec.id(), 2));
    assert_eq!(again.downstream_key, rec.downstream_key);
    // The first attempt's heartbeat is now refused.
    let r = refused_err(h.ledger.heartbeat(T, &id, 1, 0, 0), Reason::LeaseLost);
    assert_eq!(r.recovery, Recovery::WaitAndQuery);
}

fn lapsed_effect_needs_reconcile(class: OpClass) {
    let h = harness();
    h.tool("t", class, &[]);
    let rec = executed(h.begin(&keyed("r1", "s", "t", r#"{"a":1}"#)));
    let id = rec.id().to_string();
    h.clock.advance(LEASE);
    // The lapsed lease is an unknown outcome, not "free to run again".
    let r = refused(
        h.begin(&keyed("r1", "s", "t", r#"{"a":1}"#)),
        Reason::ReconcileRequired,
    );
    assert_eq!(r.recovery, Recovery::Reconcile);
    assert_eq!(r.receipt.unwrap().state(), State::EffectUnknown);
    let q = h
        .ledger
        .query_outcome(T, &OutcomeKey::EffectId(id.clone()))
        .unwrap()
        .unwrap();
    assert_eq!(q.state(), State::EffectUnknown);
    // The executor cannot relabel it "failed before input" after the fact.
    refused_err(
        h.ledger
            .complete(T, &id, 1, 0, Outcome::FailedBeforeInput("oops".into())),
        Reason::ReconcileRequired,
    );
    // Reconcile needs evidence.
    let before = h.snapshot();
    refused_err(
        h.ledger
            .reconcile(T, &id, 0, "  ", Finding::FailedBeforeInput("no".into())),
        Reason::EvidenceRequired,
    );
    assert_eq!(before, h.snapshot());
    // With evidence it may be granted again, same id and downstream key.
    let settled = h
        .ledger
        .reconcile(
            T,
            &id,
            0,
            "bank ledger has no entry for fence key",
            Finding::FailedBeforeInput("not sent".into()),
        )
        .unwrap();
    assert_eq!(settled.state(), State::FailedBeforeInput);
    assert_eq!(settled.evidence, "bank ledger has no entry for fence key");
    let again = executed(h.begin(&keyed("r1", "s", "t", r#"{"a":1}"#)));
    assert_eq!((again.id(), again.attempt), (rec.id(), 2));
    assert_eq!(again.downstream_key, rec.downstream_key);
}

#[test]
fn a_lapsed_non_retryable_effect_is_unknown_until_reconciled() {
    lapsed_effect_needs_reconcile(OpClass::NonRetryable);
}

#[test]
fn a_lapsed_effect_check_effect_is_unknown_until_reconciled() {
    lapsed_effect_needs_reconcile(OpClass::RequiresEffectCheck);
}

#[test]
fn reconcile_as_completed_records_the_result_and_replays_it() {
    let h = harness();
    bank(&h);
    let rec = executed(h.begin(&keyed("r1", "s", TRANSFER, ARGS)));
    let id = rec.id().to_string();
    // Refused while the lease is live: the executor may still report.
    refused_err(
        h.ledger
            .reconcile(T, &id, 0, "ev", Finding::Completed(b"tx".to_vec())),
        Reason::InvalidTransition,
    );
    h.ledger
        .complete(T, &id, 1, 0, Outcome::Unknown("timeout after send".into()))
        .unwrap();
    let done = h
        .ledger
        .reconcile(
            T,
            &id,
            0,
            "bank says tx-9",
            Finding::Completed(b"tx-9".to_vec()),
        )
        .unwrap();
    assert_eq!(done.state(), State::Completed);
    assert_eq!(
        replayed(h.begin(&keyed("r1", "s", TRANSFER, ARGS))).result,
        b"tx-9"
    );
}

#[test]
fn failed_before_input_under_a_live_lease_allows_a_new_attempt() {
    let h = harness();
    bank(&h);
    let rec = executed(h.begin(&keyed("r1", "s", TRANSFER, ARGS)));
    let id = rec.id().to_string();
    h.ledger
        .complete(
            T,
            &id,
            1,
            0,
            Outcome::FailedBeforeInput("connect refused".into()),
        )
        .unwrap();
    // Repeating the same report is acknowledged without change.
    h.ledger
        .complete(
            T,
            &id,
            1,
            0,
            Outcome::FailedBeforeInput("connect refused".into()),
        )
        .unwrap();
    let again = executed(h.begin(&keyed("r1", "s", TRANSFER, DRIFTED)));
    assert_eq!((again.id(), again.attempt), (rec.id(), 2));
    assert_eq!(again.downstream_key, rec.downstream_key);
    // A report from the superseded first attempt is refused.
    refused_err(
        h.ledger
            .complete(T, &id, 1, 0, Outcome::Unknown("late".into())),
        Reason::LeaseLost,
    );
}

#[test]
fn completions_are_idempotent_and_never_change_a_recorded_result() {
    let h = harness();
    bank(&h);
    let rec = executed(h.begin(&keyed("r1", "s", TRANSFER, ARGS)));
    let id = rec.id().to_string();
    complete(&h, &rec, "tx-1");
    complete(&h, &rec, "tx-1");
    let before = h.snapshot();
    let r = refused_err(
        h.ledger
            .complete(T, &id, 1, 0, Outcome::Completed(b"tx-2".to_vec())),
        Reason::ResultConflict,
    );
    assert_eq!(r.receipt.unwrap().result, b"tx-1");
    refused_err(
        h.ledger
            .complete(T, &id, 1, 0, Outcome::FailedBeforeInput("x".into())),
        Reason::InvalidTransition,
    );
    refused_err(
        h.ledger
            .complete(T, &id, 1, 0, Outcome::Unknown("x".into())),
        Reason::InvalidTransition,
    );
    assert_eq!(before, h.snapshot());
}

#[test]
fn a_late_success_settles_an_unknown_outcome() {
    let h = harness();
    bank(&h);
    let rec = executed(h.begin(&keyed("r1", "s", TRANSFER, ARGS)));
    h.clock.advance(LEASE * 3);
    let done = complete(&h, &rec, "tx-late");
    assert_eq!(done.state(), State::Completed);
    assert_eq!(
        replayed(h.begin(&keyed("r1", "s", TRANSFER, ARGS))).result,
        b"tx-late"
    );
}

#[test]
fn completing_what_does_not_exist_is_not_found_and_changes_nothing() {
    let h = harness();
    bank(&h);
    let rec = executed(h.begin(&keyed("r1", "s", TRANSFER, ARGS)));
    let before = h.snapshot();
    let mut ghost = rec.id();
    ghost.seq += 41;
    refused_err(
        h.ledger.complete(
            T,
            &ghost.to_string(),
            0,
            0,
            Outcome::Completed(b"x".to_vec()),
        ),
        Reason::UnknownRecord,
    );
    // Another tenant cannot see it either.
    refused_err(
        h.ledger.complete(
            "tenant-b",
            &rec.id().to_string(),
            0,
            0,
            Outcome::Completed(b"x".to_vec()),
        ),
        Reason::UnknownRecord,
    );
    invalid(
        h.ledger
            .complete(T, "e123", 0, 0, Outcome::Completed(vec![])),
        "effect_id",
    );
    invalid(
        h.ledger.complete(T, "", 0, 0, Outcome::Completed(vec![])),
        "effect_id",
    );
    invalid(
        h.ledger
            .complete(T, &rec.id().to_string(), 9, 0, Outcome::Completed(vec![])),
        "attempt",
    );
    assert_eq!(before, h.snapshot());
}

#[test]
fn bad_ids_keys_and_arguments_are_refused_before_anything_is_written() {
    let h = harness();
    let before = h.snapshot();
    let long = "x".repeat(257);
    for (cmd, field) in [
        (call("", "t", "{}"), "run_id"),
        (call("   ", "t", "{}"), "run_id"),
        (call(&long, "t", "{}"), "run_id"),
        (call("r\u{0}1", "t", "{}"), "run_id"),
        (call("r", "", "{}"), "tool"),
        (keyed("r", " ", "t", "{}"), "step_key"),
        (keyed("r", &long, "t", "{}"), "step_key"),
        (call("r", "t", "{"), "arguments_json"),
        (call("r", "t", ""), "arguments_json"),
        (
            call("r", "t", r#"{"amount":1,"amount":100}"#),
            "arguments_json",
        ),
        (
            call("r", "t", &format!("\"{}\"", "a".repeat(1 << 20))),
            "arguments_json",
        ),
        (
            BeginCmd {
                credentials: vec![fence_server::ledger::CredentialUse {
                    token: vec![],
                    budget: 1,
                }],
                ..call("r", "t", "{}")
            },
            "credentials[0].token",
        ),
        (
            BeginCmd {
                compensates_effect_id: "nope".into(),
                ..call("r", "t", "{}")
            },
            "compensates_effect_id",
        ),
    ] {
        invalid(h.ledger.begin(T, &cmd), field);
    }
    assert_eq!(before, h.snapshot());
}

#[test]
fn bad_tool_registrations_are_refused() {
    let h = harness();
    let before = h.snapshot();
    let def = |class: i32, volatile: &[&str]| ToolDef {
        name: "t".into(),
        class,
        volatile_fields: volatile.iter().map(|s| s.to_string()).collect(),
        ..Default::default()
    };
    invalid(h.ledger.register_tool(T, def(0, &[])), "tool.class");
    invalid(h.ledger.register_tool(T, def(9, &[])), "tool.class");
    invalid(
        h.ledger.register_tool(T, def(4, &["a..b"])),
        "tool.intent_schema",
    );
    invalid(
        h.ledger.register_tool(
            T,
            ToolDef {
                name: "".into(),
                ..def(4, &[])
            },
        ),
        "tool.name",
    );
    assert_eq!(before, h.snapshot());
}

#[test]
fn re_registration_is_versioned_and_never_changes_what_a_receipt_means() {
    let h = harness();
    let (v1, created) = h
        .ledger
        .register_tool(
            T,
            ToolDef {
                name: "pay".into(),
                class: 4,
                volatile_fields: vec!["ref".into()],
                ..Default::default()
            },
        )
        .unwrap();
    assert!(created);
    // Identical re-registration: same version.
    let (same, created) = h
        .ledger
        .register_tool(
            T,
            ToolDef {
                name: "pay".into(),
                class: 4,
                volatile_fields: vec!["ref".into()],
                ..Default::default()
            },
        )
        .unwrap();
    assert!(!created);
    assert_eq!(same.version, v1.version);

    let recorded = executed(h.begin(&keyed(
        "r1",
        "s",
        "pay",
        r#"{"amt":5,"ref":"a","memo":"x"}"#,
    )));
    complete(&h, &recorded, "ok");
    assert_eq!(recorded.tool_version, 1);

    // v2 declares `memo` volatile too.
    let (v2, created) = h
        .ledger
        .register_tool(
            T,
            ToolDef {
                name: "pay".into(),
                class: 4,
                volatile_fields: vec!["ref".into(), "memo".into()],
                ..Default::default()
            },
        )
        .unwrap();
    assert!(created);
    assert_eq!(v2.version, 2);
    // Under the receipt's own schema (v1) the memo was part of the intent: still a mismatch.
    refused(
        h.begin(&keyed(
            "r1",
            "s",
            "pay",
            r#"{"amt":5,"ref":"b","memo":"y"}"#,
        )),
        Reason::ArgumentMismatch,
    );
    // The recorded call itself still replays.
    replayed(h.begin(&keyed(
        "r1",
        "s",
        "pay",
        r#"{"amt":5,"ref":"c","memo":"x"}"#,
    )));
    // A new effect is fingerprinted under v2.
    let new = executed(h.begin(&keyed(
        "r1",
        "s2",
        "pay",
        r#"{"amt":6,"ref":"a","memo":"x"}"#,
    )));
    assert_eq!(new.tool_version, 2);
    replayed_or_in_progress(h.begin(&keyed(
        "r1",
        "s2",
        "pay",
        r#"{"amt":6,"ref":"z","memo":"other"}"#,
    )));
}

/// Registers `pay` with `volatile` as its volatile fields (a new version when they change).
fn pay_tool(h: &Harness, volatile: &[&str]) {
    h.tool("pay", OpClass::NonRetryable, volatile);
}

/// A keyless repeat is found through the intent index under the version its receipt was
/// recorded with, though the call is now fingerprinted under a newer schema: the run
/// remembers which versions it holds, and a run written before it remembered (no list) is
/// searched under every version.
#[test]
fn a_keyless_repeat_is_found_under_the_version_its_receipt_was_recorded_with() {
    let h = harness();
    pay_tool(&h, &["ref"]);
    let args = r#"{"amt":5,"ref":"a","memo":"x"}"#;
    let first = executed(h.begin(&call("r1", "pay", args)));
    complete(&h, &first, "ok");
    let other_run = executed(h.begin(&call("r2", "pay", args)));
    complete(&h, &other_run, "ok");
    // v2 makes `memo` volatile: the call's v2 fingerprint differs from the receipts' (v1).
    pay_tool(&h, &["ref", "memo"]);
    let again = r#"{"amt":5,"ref":"b","memo":"x"}"#;
    let dup = refused(h.begin(&call("r1", "pay", again)), Reason::DuplicateIntent);
    assert_eq!(dup.receipt.unwrap().id(), first.id());

    // r2 as a run record written before runs tracked their tool versions.
    let rk = keys::run_key(T, "r2");
    let bytes = h.ledger.store().get(&keys::run(&rk)).unwrap().unwrap();
    let mut run: RunRecord = codec::decode(&keys::run(&rk), &bytes).unwrap();
    assert!(run.tracks_tool_versions);
    assert_eq!(run.tool_versions.len(), 1);
    run.tracks_tool_versions = false;
    run.tool_versions.clear();
    let mut batch = Batch::new();
    batch.put(keys::run(&rk), codec::encode(&run));
    h.ledger.store().write(batch).unwrap();
    let dup = refused(h.begin(&call("r2", "pay", again)), Reason::DuplicateIntent);
    assert_eq!(dup.receipt.unwrap().id(), other_run.id());

    // A fresh run has no v1 effects: the call is new there.
    let fresh = executed(h.begin(&call("r3", "pay", again)));
    assert_eq!(fresh.tool_version, 2);
}

/// A Begin is prepared (parsed, hashed, fingerprinted under the tool version the cache holds
/// as current) before its run's sequencer decides it. When the tool is re-registered in
/// between, the decision fingerprints the call under the new version, never the stale one.
#[test]
fn a_call_prepared_before_its_tool_changed_is_decided_under_the_new_version() {
    let h = harness();
    // Registration caches the version, so the next call is prepared under it.
    pay_tool(&h, &["ref"]);
    let prepared = h
        .ledger
        .prepare_begin(T, call("r1", "pay", r#"{"amt":5,"ref":"a","memo":"x"}"#))
        .unwrap();
    // v2 makes `memo` volatile.
    pay_tool(&h, &["ref", "memo"]);
    let begun = h.ledger.begin_prepared(T, &prepared).unwrap().decision;
    let first = executed(begun);
    assert_eq!(first.tool_version, 2);
    complete(&h, &first, "ok");
    // Under v2 a call differing only in `memo` and `ref` is the same intent: an unkeyed
    // repeat. (Under the v1 fingerprint it would have been a new effect.)
    let dup = refused(
        h.begin(&call("r1", "pay", r#"{"amt":5,"ref":"b","memo":"y"}"#)),
        Reason::DuplicateIntent,
    );
    assert_eq!(dup.receipt.unwrap().id(), first.id());
    // And a prepared call whose tool did not change is decided as an unprepared one is.
    let prepared = h
        .ledger
        .prepare_begin(T, call("r1", "pay", r#"{"amt":5,"ref":"c","memo":"z"}"#))
        .unwrap();
    refused(
        h.ledger.begin_prepared(T, &prepared).unwrap().decision,
        Reason::DuplicateIntent,
    );
}

/// A credential bound to a call under one tool version still admits that call after the
/// tool's schema changed, on a run that never used the old version.
#[test]
fn a_credential_bound_under_an_older_tool_version_still_admits_its_call() {
    let h = harness();
    pay_tool(&h, &["ref"]);
    h.ledger
        .register_credential(
            T,
            &CredentialDef {
                token: b"approval-1".to_vec(),
                budget: 1,
                bound_tool: "pay".into(),
                bound_arguments_json: r#"{"amt":5,"memo":"x"}"#.into(),
            },
        )
        .unwrap();
    pay_tool(&h, &["ref", "memo"]);
    let approved = BeginCmd {
        credentials: vec![CredentialUse {
            token: b"approval-1".to_vec(),
            budget: 1,
        }],
        ..call("fresh-run", "pay", r#"{"amt":5,"ref":"q","memo":"x"}"#)
    };
    executed(h.begin(&approved));
}

fn replayed_or_in_progress(d: Decision) {
    assert!(
        matches!(d, Decision::InProgress { .. } | Decision::Replay(_)),
        "{d:?}"
    );
}

#[test]
fn safe_retry_calls_write_nothing_unless_asked_and_are_never_refused() {
    let h = harness();
    h.tool("kb.search", OpClass::SafeRetry, &[]);
    let before = h.snapshot();
    match h.begin(&call("r1", "kb.search", r#"{"q":"x"}"#)) {
        Decision::Execute {
            recorded: false,
            receipt,
        } => assert_eq!(receipt.seq, 0),
        other => panic!("{other:?}"),
    }
    assert_eq!(before, h.snapshot());
    let a = executed(h.begin(&BeginCmd {
        record: true,
        ..call("r1", "kb.search", r#"{"q":"x"}"#)
    }));
    let b = executed(h.begin(&BeginCmd {
        record: true,
        ..call("r1", "kb.search", r#"{"q":"x"}"#)
    }));
    assert_ne!(a.id(), b.id());
}

#[test]
fn retention_leaves_a_tombstone_answered_expired_never_executed_again() {
    let h = harness();
    h.ledger
        .register_tool(
            T,
            ToolDef {
                name: TRANSFER.into(),
                class: 4,
                volatile_fields: vec!["reference".into(), "ts".into()],
                retention_ms: 60_000,
                ..Default::default()
            },
        )
        .unwrap();
    let rec = executed(h.begin(&keyed("r1", "s", TRANSFER, ARGS)));
    let done = complete(&h, &rec, "tx-1");
    let key = keys::effect(&keys::run_key(T, "r1"), rec.seq);
    let stored = |h: &Harness| -> EffectRecord {
        codec::decode(&key, &h.ledger.store().get(&key).unwrap().unwrap()).unwrap()
    };
    h.clock.advance(59_999);
    h.ledger.store().compact().unwrap();
    assert_eq!(
        stored(&h),
        done,
        "within its window compaction keeps the record"
    );
    h.clock.advance(1);
    // Before any compaction, reads already see the tombstone.
    let r = refused(
        h.begin(&keyed("r1", "s", TRANSFER, DRIFTED)),
        Reason::Expired,
    );
    assert!(r.receipt.as_ref().unwrap().tombstone);
    // On disk the record keeps its payload until the store compacts it: then it is the
    // tombstone reads showed, and nothing else in the store changed.
    assert!(!stored(&h).tombstone && !stored(&h).result.is_empty());
    let others = |h: &Harness| {
        let mut all = h.snapshot();
        all.retain(|(k, _)| *k != key);
        all
    };
    let before = others(&h);
    h.ledger.store().compact().unwrap();
    let on_disk = stored(&h);
    assert!(on_disk.tombstone);
    assert!(on_disk.result.is_empty() && on_disk.arguments_json.is_empty());
    assert_eq!(on_disk.intent_fp, rec.intent_fp);
    assert_eq!(
        others(&h),
        before,
        "compaction rewrote only the expired record"
    );
    h.ledger.store().compact().unwrap();
    assert_eq!(stored(&h), on_disk, "a tombstone is kept as it is");
    h.assert_sound();
    let q = h
        .ledger
        .query_outcome(T, &OutcomeKey::EffectId(rec.id().to_string()))
        .unwrap()
        .unwrap();
    assert!(q.tombstone);
    assert_eq!(q.state(), State::Completed);
    assert!(q.result.is_empty() && q.arguments_json.is_empty());
    assert_eq!(q.intent_fp, rec.intent_fp);
    // Both by step key and by an unkeyed identical intent: EXPIRED, not a new execution.
    refused(h.begin(&keyed("r1", "s", TRANSFER, ARGS)), Reason::Expired);
    refused(h.begin(&call("r1", TRANSFER, ARGS)), Reason::Expired);
    refused_err(
        h.ledger.complete(
            T,
            &rec.id().to_string(),
            1,
            0,
            Outcome::Completed(b"tx-1".to_vec()),
        ),
        Reason::Expired,
    );
}

#[test]
fn outcomes_can_be_queried_by_step_key_effect_id_or_intent() {
    let h = harness();
    bank(&h);
    let rec = executed(h.begin(&keyed("r1", "r1:pay", TRANSFER, ARGS)));
    complete(&h, &rec, "tx-1");
    let by_step = h
        .ledger
        .query_outcome(
            T,
            &OutcomeKey::StepKey {
                run_id: "r1".into(),
                branch: "".into(),
                step_key: "r1:pay".into(),
            },
        )
        .unwrap()
        .unwrap();
    let by_intent = h
        .ledger
        .query_outcome(
            T,
            &OutcomeKey::Intent {
                run_id: "r1".into(),
                branch: "main".into(),
                tool: TRANSFER.into(),
                arguments_json: DRIFTED.into(),
            },
        )
        .unwrap()
        .unwrap();
    assert_eq!(by_step.id(), rec.id());
    assert_eq!(by_intent.id(), rec.id());
    assert!(
        h.ledger
            .query_outcome(
                T,
                &OutcomeKey::StepKey {
                    run_id: "r1".into(),
                    branch: "".into(),
                    step_key: "other".into()
                }
            )
            .unwrap()
            .is_none()
    );
    assert!(
        h.ledger
            .query_outcome("tenant-b", &OutcomeKey::EffectId(rec.id().to_string()))
            .unwrap()
            .is_none()
    );
    // A run that does not exist: the answer is "nothing recorded", not an error.
    assert!(
        h.ledger
            .query_outcome(
                T,
                &OutcomeKey::StepKey {
                    run_id: "nope".into(),
                    branch: "".into(),
                    step_key: "s".into()
                }
            )
            .unwrap()
            .is_none()
    );
}

#[test]
fn list_effects_pages_through_everything_in_recording_order() {
    let h = harness();
    let mut ids = Vec::new();
    for i in 0..7 {
        ids.push(executed(h.begin(&call("r1", "t", &format!(r#"{{"i":{i}}}"#)))).id());
    }
    let mut seen = Vec::new();
    let mut token = String::new();
    loop {
        let (page, next) = h
            .ledger
            .list_effects(
                T,
                &ListQuery {
                    run_id: "r1".into(),
                    page_size: 3,
                    page_token: token.clone(),
                    ..Default::default()
                },
            )
            .unwrap();
        assert!(page.len() <= 3);
        seen.extend(page.iter().map(|e| e.id()));
        if next.is_empty() {
            break;
        }
        token = next;
    }
    assert_eq!(seen, ids);
    invalid(
        h.ledger.list_effects(
            T,
            &ListQuery {
                run_id: "r1".into(),
                page_token: "x".into(),
                ..Default::default()
            },
        ),
        "page_token",
    );
}

#[test]
fn completing_a_compensation_marks_its_target_compensated_atomically() {
    let h = harness();
    let fwd = executed(h.begin(&BeginCmd {
        saga_id: "trip".into(),
        compensation: Some(("hotel.cancel".into(), r#"{"booking":"b1"}"#.into())),
        ..keyed("r1", "trip:hotel", "hotel.book", r#"{"room":1}"#)
    }));
    complete(&h, &fwd, "b1");
    let comp = executed(h.begin(&BeginCmd {
        saga_id: "trip".into(),
        compensates_effect_id: fwd.id().to_string(),
        ..keyed(
            "r1",
            "trip:hotel:compensate",
            "hotel.cancel",
            r#"{"booking":"b1"}"#,
        )
    }));
    complete(&h, &comp, "cancelled");
    let target = h
        .ledger
        .query_outcome(T, &OutcomeKey::EffectId(fwd.id().to_string()))
        .unwrap()
        .unwrap();
    assert_eq!(target.state(), State::Compensated);
    assert_eq!(target.compensated_by_seq, comp.seq);
    // The compensation itself replays: it never runs twice.
    replayed(h.begin(&BeginCmd {
        compensates_effect_id: fwd.id().to_string(),
        ..keyed(
            "r1",
            "trip:hotel:compensate",
            "hotel.cancel",
            r#"{"booking":"b1"}"#,
        )
    }));
    let (saga, _) = h
        .ledger
        .list_effects(
            T,
            &ListQuery {
                run_id: "r1".into(),
                saga_id: "trip".into(),
                ..Default::default()
            },
        )
        .unwrap();
    assert_eq!(saga.len(), 2);
}

#[test]
fn concurrent_identical_calls_get_exactly_one_grant() {
    let h = std::sync::Arc::new(harness());
    bank(&h);
    let grants: Vec<bool> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..16)
            .map(|i| {
                let h = h.clone();
                s.spawn(move || {
                    let args = format!(r#"{{"to":"bob","amount":100,"reference":"u-{i}"}}"#);
                    matches!(
                        h.begin(&keyed("r1", "r1:pay", TRANSFER, &args)),
                        Decision::Execute { .. }
                    )
                })
            })
            .collect();
        handles.into_iter().map(|j| j.join().unwrap()).collect()
    });
    assert_eq!(grants.iter().filter(|g| **g).count(), 1);
    let (all, _) = h
        .ledger
        .list_effects(
            T,
            &ListQuery {
                run_id: "r1".into(),
                ..Default::default()
            },
        )
        .unwrap();
    assert_eq!(all.len(), 1);
}

#[test]
fn limits_on_counts_refuse_without_writing() {
    let dir = tempfile::tempdir().unwrap();
    let store = fence_server::store::RocksStore::open(dir.path(), &Default::default()).unwrap();
    let mut config = fence_server::ledger::LedgerConfig::default();
    config.limits.max_effects_per_run = 2;
    let ledger = fence_server::ledger::Ledger::new(
        store,
        std::sync::Arc::new(fence_server::clock::SystemClock),
        config,
    );
    ledger.begin(T, &call("r", "t", "1")).unwrap();
    ledger.begin(T, &call("r", "t", "2")).unwrap();
    let before = ledger.store().scan(&[], &[], usize::MAX).unwrap();
    assert!(matches!(
        ledger.begin(T, &call("r", "t", "3")),
        Err(LedgerError::ResourceExhausted { .. })
    ));
    assert_eq!(before, ledger.store().scan(&[], &[], usize::MAX).unwrap());
}

#[test]
fn size_limits_on_results_evidence_and_details_refuse_without_writing() {
    let h = harness();
    let rec = executed(h.begin(&keyed("r1", "s", "t", "{}")));
    let id = rec.id().to_string();
    let before = h.snapshot();
    let big = vec![b'x'; (4 << 20) + 1];
    invalid(
        h.ledger
            .complete(T, &id, 1, 0, Outcome::Completed(big.clone())),
        "result",
    );
    invalid(
        h.ledger
            .complete(T, &id, 1, 0, Outcome::Unknown("d".repeat(20_000))),
        "detail",
    );
    h.clock.advance(LEASE);
    invalid(
        h.ledger
            .reconcile(T, &id, 0, &"e".repeat(70_000), Finding::Completed(vec![])),
        "evidence",
    );
    invalid(
        h.ledger.reconcile(T, &id, 0, "ev", Finding::Completed(big)),
        "completed_result",
    );
    assert_eq!(before, h.snapshot());
}

#[test]
fn count_limits_on_branches_and_checkpoints_refuse_without_writing() {
    use fence_server::ledger::runs::{CheckpointCmd, ForkCmd};
    let dir = tempfile::tempdir().unwrap();
    let store = fence_server::store::RocksStore::open(dir.path(), &Default::default()).unwrap();
    let mut config = fence_server::ledger::LedgerConfig::default();
    config.limits.max_checkpoints_per_run = 1;
    config.limits.max_branches_per_run = 2;
    let ledger = fence_server::ledger::Ledger::new(
        store,
        std::sync::Arc::new(fence_server::clock::SystemClock),
        config,
    );
    let cp = |id: &str| CheckpointCmd {
        run_id: "r".into(),
        branch: "".into(),
        epoch: 0,
        checkpoint_id: id.into(),
        ..Default::default()
    };
    ledger.checkpoint(T, &cp("c1")).unwrap();
    let before = ledger.store().scan(&[], &[], usize::MAX).unwrap();
    assert!(matches!(
        ledger.checkpoint(T, &cp("c2")),
        Err(LedgerError::ResourceExhausted { .. })
    ));
    let fork = |name: &str| ForkCmd {
        run_id: "r".into(),
        checkpoint_id: "c1".into(),
        epoch: 0,
        new_branch: name.into(),
        reason: String::new(),
    };
    ledger.fork(T, &fork("b1")).unwrap();
    let mid = ledger.store().scan(&[], &[], usize::MAX).unwrap();
    assert_ne!(before, mid);
    assert!(matches!(
        ledger.fork(T, &fork("b2")),
        Err(LedgerError::ResourceExhausted { .. })
    ));
    assert_eq!(mid, ledger.store().scan(&[], &[], usize::MAX).unwrap());
}

#[test]
fn a_lost_grant_is_recovered_by_the_same_request_id_and_only_by_it() {
    let h = harness();
    bank(&h);
    let first = || BeginCmd {
        request_id: "req-1".into(),
        ..keyed("r1", "r1:pay", TRANSFER, ARGS)
    };
    let grant = executed(h.begin(&first()));
    // The response was lost; the same requester re-sends: the same grant, not IN_PROGRESS.
    let again = executed(h.begin(&first()));
    assert_eq!(
        (again.id(), again.attempt, again.downstream_key.clone()),
        (grant.id(), 1, grant.downstream_key.clone())
    );
    // Anyone else (another request id, or none) waits.
    for other in [
        BeginCmd {
            request_id: "req-2".into(),
            ..keyed("r1", "r1:pay", TRANSFER, ARGS)
        },
        keyed("r1", "r1:pay", TRANSFER, ARGS),
    ] {
        assert!(matches!(h.begin(&other), Decision::InProgress { .. }));
    }
    // Once completed, the same request id replays like everyone else.
    complete(&h, &grant, "tx");
    replayed(h.begin(&first()));
    // After the lease lapses the grant is unknown, whoever asks.
    let lapsing = executed(h.begin(&BeginCmd {
        request_id: "req-3".into(),
        ..keyed("r1", "r1:other", TRANSFER, REDIRECTED)
    }));
    h.clock.advance(LEASE);
    refused(
        h.begin(&BeginCmd {
            request_id: "req-3".into(),
            ..keyed("r1", "r1:other", TRANSFER, REDIRECTED)
        }),
        Reason::ReconcileRequired,
    );
    let _ = lapsing;
}

#[test]
fn an_unkeyed_repeat_of_an_effect_that_failed_before_input_is_granted_again() {
    let h = harness();
    bank(&h);
    let first = executed(h.begin(&call("r1", TRANSFER, ARGS)));
    h.ledger
        .complete(
            T,
            &first.id().to_string(),
            1,
            0,
            Outcome::FailedBeforeInput("connect refused".into()),
        )
        .unwrap();
    // Not a duplicate: the first never happened. Same effect, same downstream key, attempt 2.
    let again = executed(h.begin(&call("r1", TRANSFER, DRIFTED)));
    assert_eq!((again.id(), again.attempt), (first.id(), 2));
    assert_eq!(again.downstream_key, first.downstream_key);
    complete(&h, &again, "tx-1");
    // Once it happened, an unkeyed repeat is a suspected duplicate again.
    refused(
        h.begin(&call("r1", TRANSFER, ARGS)),
        Reason::DuplicateIntent,
    );
}

/// Counts the store's durable and unsynced writes.
#[derive(Default)]
struct CountingStore {
    inner: fence_server::store::MemStore,
    durable: std::sync::atomic::AtomicUsize,
    unsynced: std::sync::atomic::AtomicUsize,
}

impl Store for CountingStore {
    fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, fence_server::store::StoreError> {
        self.inner.get(key)
    }
    fn scan(
        &self,
        prefix: &[u8],
        from: &[u8],
        limit: usize,
    ) -> Result<fence_server::store::Entries, fence_server::store::StoreError> {
        self.inner.scan(prefix, from, limit)
    }
    fn write(&self, batch: Batch) -> Result<(), fence_server::store::StoreError> {
        self.durable
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        self.inner.write(batch)
    }
    fn write_unsynced(&self, batch: Batch) -> Result<(), fence_server::store::StoreError> {
        self.unsynced
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        self.inner.write(batch)
    }
}

/// A replay's answer depends on nothing it writes: it waits for no sync. Its audit counters
/// are still recorded (unsynced), and a replay that consumes something (here: binds a new step
/// key as an alias) writes durably.
#[test]
fn a_replay_waits_for_no_sync_unless_its_answer_depends_on_a_write() {
    use std::sync::atomic::Ordering::SeqCst;
    let ledger = fence_server::ledger::Ledger::new(
        CountingStore::default(),
        std::sync::Arc::new(fence_server::clock::ManualClock::new(1_700_000_000_000)),
        fence_server::ledger::LedgerConfig::default(),
    );
    ledger
        .register_tool(
            T,
            ToolDef {
                name: TRANSFER.into(),
                class: OpClass::NonRetryable.code(),
                volatile_fields: vec!["reference".into(), "ts".into()],
                ..Default::default()
            },
        )
        .unwrap();
    ledger
        .checkpoint(
            T,
            &fence_server::ledger::runs::CheckpointCmd {
                run_id: "r1".into(),
                checkpoint_id: "cp-0".into(),
                ..Default::default()
            },
        )
        .unwrap();
    let rec = match ledger
        .begin(T, &keyed("r1", "pay", TRANSFER, ARGS))
        .unwrap()
        .decision
    {
        Decision::Execute { receipt, .. } => receipt,
        other => panic!("{other:?}"),
    };
    ledger
        .complete(
            T,
            &rec.id().to_string(),
            rec.attempt,
            0,
            Outcome::Completed(b"tx".to_vec()),
        )
        .unwrap();
    let store = ledger.store();
    let durable = store.durable.load(SeqCst);
    for n in 1..=3u32 {
        match ledger
            .begin(T, &keyed("r1", "pay", TRANSFER, DRIFTED))
            .unwrap()
            .decision
        {
            Decision::Replay(r) => assert_eq!(r.replays, n),
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(store.durable.load(SeqCst), durable, "a plain replay synced");
    assert_eq!(store.unsynced.load(SeqCst), 3);
    // After a restore to before the effect, the agent's re-issued call replays it from the
    // tape, and consuming the tape entry is part of later answers: that is written durably.
    let restored = ledger.restore(T, "r1", "cp-0", 0).unwrap();
    assert_eq!(restored.tape.len(), 1);
    let durable = store.durable.load(SeqCst);
    match ledger
        .begin(
            T,
            &BeginCmd {
                epoch: restored.epoch,
                ..call("r1", TRANSFER, DRIFTED)
            },
        )
        .unwrap()
        .decision
    {
        Decision::Replay(_) => {}
        other => panic!("{other:?}"),
    }
    assert_eq!(store.durable.load(SeqCst), durable + 1);
}

/// A ListEffects page ends before it would pass 1 MiB of records, whatever its size asks for,
/// so one response never buffers more than that; following the tokens still lists everything.
#[test]
fn effect_listings_are_paged_by_bytes_as_well_as_by_count() {
    let h = harness();
    bank(&h);
    let big = vec![b'x'; 400_000];
    for i in 0..5 {
        let rec = executed(h.begin(&keyed(
            "r1",
            &format!("s{i}"),
            TRANSFER,
            &format!(r#"{{"to":"bob","amount":{i}}}"#),
        )));
        h.ledger
            .complete(
                T,
                &rec.id().to_string(),
                rec.attempt,
                0,
                Outcome::Completed(big.clone()),
            )
            .unwrap();
    }
    let mut pages = Vec::new();
    let mut token = String::new();
    loop {
        let (page, next) = h
            .ledger
            .list_effects(
                T,
                &ListQuery {
                    run_id: "r1".into(),
                    page_size: 1000,
                    page_token: token.clone(),
                    ..Default::default()
                },
            )
            .unwrap();
        pages.push(page.len());
        if next.is_empty() {
            break;
        }
        token = next;
    }
    // Two 400 KB results fit in 1 MiB, a third would not.
    assert_eq!(pages, [2, 2, 1]);
}
