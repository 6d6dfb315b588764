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
