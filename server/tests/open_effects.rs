//! The open-effect index and its census (what the `fence_open_effects` gauges show): an effect
//! is counted from its grant until it is settled, as accepted or running while its lease is
//! live and as unknown once it lapses or is reported so; `verify` finds the index in step with
//! the records after every transition.

mod common;

use common::*;
use fence_server::ledger::expiry::OpenCensus;
use fence_server::ledger::{Finding, OpClass, Outcome};

fn census(h: &Harness) -> OpenCensus {
    h.ledger.open_census().unwrap()
}

fn counts(accepted: u64, running: u64, unknown: u64) -> OpenCensus {
    OpenCensus {
        accepted,
        running,
        unknown,
    }
}

#[test]
fn effects_are_counted_from_their_grant_until_they_are_settled() {
    let h = harness();
    h.tool("pay", OpClass::NonRetryable, &[]);
    h.tool("fetch", OpClass::Deduplicate, &[]);
    assert_eq!(census(&h), counts(0, 0, 0));

    let a = executed(h.begin(&keyed("r", "a", "pay", r#"{"to":"ann"}"#)));
    let b = executed(h.begin(&keyed("r", "b", "pay", r#"{"to":"bob"}"#)));
    assert_eq!(census(&h), counts(2, 0, 0));
    h.assert_sound();

    // A heartbeat: running.
    h.ledger
        .heartbeat(T, &b.id().to_string(), b.attempt, 0, LEASE)
        .unwrap();
    assert_eq!(census(&h), counts(1, 1, 0));

    // Completed: settled, out of the index.
    complete(&h, &a, "tx-1");
    assert_eq!(census(&h), counts(0, 1, 0));
    h.assert_sound();

    // The executor vanishes: its lease lapses and the effect is unknown until reconciled.
    h.clock.advance(2 * LEASE);
    assert_eq!(census(&h), counts(0, 0, 1));
    h.ledger
        .reconcile(
            T,
            &b.id().to_string(),
            0,
            "no transfer in the bank's ledger",
            Finding::FailedBeforeInput("checked".into()),
        )
        .unwrap();
    assert_eq!(census(&h), counts(0, 0, 0));
    h.assert_sound();

    // Failed before input, then granted again: open again.
    let again = executed(h.begin(&keyed("r", "b", "pay", r#"{"to":"bob"}"#)));
    assert_eq!(again.id(), b.id());
    assert_eq!(census(&h), counts(1, 0, 0));
    // Reported unknown by its executor: unknown at once, lease or not.
    h.ledger
        .complete(
            T,
            &again.id().to_string(),
            again.attempt,
            0,
            Outcome::Unknown("timed out after dispatch".into()),
        )
        .unwrap();
    assert_eq!(census(&h), counts(0, 0, 1));
    h.assert_sound();

    // A DEDUPLICATE effect whose outcome is unknown is granted again under its key: open.
    let f = executed(h.begin(&keyed("r", "f", "fetch", r#"{"url":"x"}"#)));
    h.clock.advance(2 * LEASE);
    assert_eq!(census(&h), counts(0, 0, 2));
    let f2 = executed(h.begin(&keyed("r", "f", "fetch", r#"{"url":"x"}"#)));
    assert_eq!(f2.id(), f.id());
    assert_eq!(census(&h), counts(1, 0, 1));
    complete(&h, &f2, "body");
    assert_eq!(census(&h), counts(0, 0, 1));
    h.assert_sound();
}

#[test]
fn a_tenants_unsettled_effects_are_listed_across_its_runs() {
    use fence_server::ledger::State;
    let h = harness();
    h.tool("pay", OpClass::NonRetryable, &[]);
    let a = executed(h.begin(&keyed("run-a", "s", "pay", r#"{"to":"ann"}"#)));
    let b = executed(h.begin(&keyed("run-b", "s", "pay", r#"{"to":"bob"}"#)));
    let done = executed(h.begin(&keyed("run-b", "t", "pay", r#"{"to":"cat"}"#)));
    complete(&h, &done, "tx");
    // Another tenant's grant is not listed.
    h.ledger
        .register_tool(
            "tenant-b",
            fence_server::ledger::ToolDef {
                name: "pay".into(),
                class: OpClass::NonRetryable.code(),
                ..Default::default()
            },
        )
        .unwrap();
    h.ledger
        .begin("tenant-b", &keyed("run-a", "s", "pay", r#"{"to":"dan"}"#))
        .unwrap();

    let ids = |effects: Vec<fence_server::ledger::records::EffectRecord>| -> Vec<u64> {
        effects
            .iter()
            .map(|e| e.seq + 1000 * u64::from(e.run_id == "run-b"))
            .collect()
    };
    let (all, next) = h.ledger.list_unsettled(T, None, 0, "").unwrap();
    assert_eq!(next, "");
    let mut listed = ids(all);
    listed.sort_unstable();
    assert_eq!(listed, [a.seq, 1000 + b.seq]);

    // One lapses: only it is unknown; pages of one follow on from each other.
    h.ledger
        .heartbeat(T, &b.id().to_string(), b.attempt, 0, 10 * LEASE)
        .unwrap();
    h.clock.advance(2 * LEASE);
    let (unknown, _) = h
        .ledger
        .list_unsettled(T, Some(State::EffectUnknown), 0, "")
        .unwrap();
    assert_eq!(unknown.len(), 1);
    assert_eq!(unknown[0].id(), a.id());
    assert_eq!(unknown[0].state(), State::EffectUnknown);
    let (first, token) = h.ledger.list_unsettled(T, None, 1, "").unwrap();
    assert_eq!(first.len(), 1);
    let (second, last) = h.ledger.list_unsettled(T, None, 1, &token).unwrap();
    assert_eq!(second.len(), 1);
    assert_ne!(first[0].id(), second[0].id());
    assert_eq!(last, "", "nothing of this tenant follows");

    // A settled state is not an unsettled one; a forged token is refused.
    assert!(
        h.ledger
            .list_unsettled(T, Some(State::Completed), 0, "")
            .is_err()
    );
    assert!(h.ledger.list_unsettled(T, None, 0, "zz").is_err());
}
