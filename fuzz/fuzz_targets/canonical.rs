//! Canonicalisation never panics, and its output is a fixed point that every spelling of the
//! same value reaches.
#![no_main]

use fence_server::canonical::{IntentSchema, StringRule, canonical_intent, parse_arguments};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(value) = parse_arguments(text) else {
        return;
    };
    let schema = IntentSchema::new(
        &["request_id".into(), "meta.*".into(), "items.*.nonce".into(), "0".into()],
        &["email".into(), "*.name".into()],
        StringRule::TrimLowercase,
    )
    .expect("a valid schema");
    let c1 = canonical_intent(&value, &schema);
    let s1 = std::str::from_utf8(&c1).expect("the canonical form is UTF-8");
    let v2 = parse_arguments(s1).expect("the canonical form parses");
    assert_eq!(canonical_intent(&v2, &schema), c1, "not a fixed point: {s1}");
    // Another spelling of the same value (pretty, serde's key order) has the same intent.
    let pretty = serde_json::to_string_pretty(&value).expect("serialisable");
    let v3 = parse_arguments(&pretty).expect("pretty form parses");
    assert_eq!(canonical_intent(&v3, &schema), c1);
});
