//! Canonicalisation + fingerprint cost by argument size: strict parse, volatile-field removal,
//! canonical serialisation and the blake3 intent fingerprint, i.e. everything Fence does to a
//! call's arguments before it touches storage.

use std::hint::black_box;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_main};
use fence_server::canonical::{self, IntentSchema, StringRule};

/// Arguments shaped like a real tool call (intent fields, volatile ids, a growing item list)
/// of at least `target` bytes.
fn arguments_of_size(target: usize) -> String {
    let mut items = Vec::new();
    let mut n = 0u32;
    loop {
        let args = serde_json::json!({
            "to": "acct-4711",
            "amount": 1250.5,
            "currency": "EUR",
            "ref": "9b1deb4d-3b7d-4bad-9bdd-2b0d7b3dcb6d",
            "ts": "2026-03-01T10:00:00Z",
            "meta": {"trace_id": "4bf92f3577b34da6a3ce929d0e0e4736", "attempt": 1},
            "items": items,
        })
        .to_string();
        if args.len() >= target {
            return args;
        }
        items.push(serde_json::json!({
            "sku": format!("sku-{n:06}"),
            "qty": n % 7 + 1,
            "price": 9.99 + f64::from(n),
            "nonce": format!("{:016x}", u64::from(n).wrapping_mul(0x9E37_79B9_7F4A_7C15)),
        }));
        n += 1;
    }
}

fn canonicalise(c: &mut Criterion) {
    let schema = IntentSchema::new(
        &[
            "ref".into(),
            "ts".into(),
            "meta".into(),
            "items.*.nonce".into(),
        ],
        &["currency".into()],
        StringRule::TrimLowercase,
    )
    .expect("valid schema");
    let mut group = c.benchmark_group("canonical_intent+fingerprint");
    for (label, size) in [
        ("100B", 100),
        ("1KiB", 1 << 10),
        ("10KiB", 10 << 10),
        ("100KiB", 100 << 10),
    ] {
        let args = arguments_of_size(size);
        group.throughput(Throughput::Bytes(args.len() as u64));
        group.bench_with_input(BenchmarkId::from_parameter(label), &args, |b, args| {
            b.iter(|| {
                let value = canonical::parse_arguments(black_box(args)).expect("valid JSON");
                let canonical = canonical::canonical_intent(&value, &schema);
                black_box(canonical::intent_fingerprint("bank.transfer", &canonical))
            })
        });
    }
    group.finish();
}

// In a private module: `criterion_group!` makes a public function without docs.
mod group {
    criterion::criterion_group!(benches, super::canonicalise);
}
criterion_main!(group::benches);
