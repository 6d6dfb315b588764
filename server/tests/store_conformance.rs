//! One conformance suite for both `Store` implementations: RocksDB and in-memory.

use fence_server::store::{Batch, MemStore, Rewrite, RocksStore, Store, StoreOptions};

fn conformance(s: &dyn Store) {
    assert_eq!(s.get(b"a").unwrap(), None);
    let mut b = Batch::new();
    for k in [&b"a1"[..], b"a2", b"a3", b"b1", b"a\xff", b"\xff\xff"] {
        b.put(k.to_vec(), [k, b"!"].concat());
    }
    s.write(b).unwrap();
    assert_eq!(s.get(b"a2").unwrap(), Some(b"a2!".to_vec()));

    // A batch is applied in order: put then delete of the same key leaves nothing.
    let mut b = Batch::new();
    b.put(b"a4".to_vec(), b"x".to_vec());
    b.delete(b"a4".to_vec());
    b.delete(b"a3".to_vec());
    s.write(b).unwrap();
    assert_eq!(s.get(b"a4").unwrap(), None);
    assert_eq!(s.get(b"a3").unwrap(), None);

    let keys = |v: Vec<(Vec<u8>, Vec<u8>)>| v.into_iter().map(|(k, _)| k).collect::<Vec<_>>();
    // Prefix scans stay inside the prefix, in order, from `from`, up to `limit`.
    assert_eq!(
        keys(s.scan(b"a", b"a", 10).unwrap()),
        vec![b"a1".to_vec(), b"a2".to_vec(), b"a\xff".to_vec()]
    );
    assert_eq!(
        keys(s.scan(b"a", b"a2", 10).unwrap()),
        vec![b"a2".to_vec(), b"a\xff".to_vec()]
    );
    assert_eq!(keys(s.scan(b"a", b"a", 1).unwrap()), vec![b"a1".to_vec()]);
    assert_eq!(
        keys(s.scan(b"a", b"", 10).unwrap()).len(),
        3,
        "a `from` before the prefix starts at it"
    );
    assert_eq!(
        keys(s.scan(b"\xff", b"\xff", 10).unwrap()),
        vec![b"\xff\xff".to_vec()]
    );
    assert_eq!(keys(s.scan(b"c", b"c", 10).unwrap()), Vec::<Vec<u8>>::new());
    assert_eq!(keys(s.scan(b"", b"", 100).unwrap()).len(), 5);
    // An empty batch is fine.
    s.write(Batch::new()).unwrap();
}

#[test]
fn rocks_store_conforms() {
    let dir = tempfile::tempdir().unwrap();
    conformance(&RocksStore::open(dir.path(), &StoreOptions::default()).unwrap());
}

#[test]
fn mem_store_conforms() {
    conformance(&MemStore::new());
}

/// What both stores' `compact` does with a rewrite: exactly the values it asks for change,
/// deleted keys stay deleted, and reads, scans included, see the new values.
fn rewrites(s: &dyn Store) {
    let mut b = Batch::new();
    for k in [&b"r1"[..], b"r2", b"k1", b"gone"] {
        b.put(k.to_vec(), [k, b"!"].concat());
    }
    s.write(b).unwrap();
    let mut b = Batch::new();
    b.delete(b"gone".to_vec());
    s.write(b).unwrap();
    s.compact().unwrap();
    assert_eq!(s.get(b"r1").unwrap(), Some(b"R1!".to_vec()));
    assert_eq!(
        s.get(b"k1").unwrap(),
        Some(b"k1!".to_vec()),
        "not asked for"
    );
    assert_eq!(s.get(b"gone").unwrap(), None);
    assert_eq!(
        s.scan(b"r", b"r", 10).unwrap(),
        vec![
            (b"r1".to_vec(), b"R1!".to_vec()),
            (b"r2".to_vec(), b"R2!".to_vec())
        ]
    );
    s.compact().unwrap();
    assert_eq!(
        s.get(b"r2").unwrap(),
        Some(b"R2!".to_vec()),
        "kept once rewritten"
    );
}

/// Upper-cases the values of keys starting with `r` (idempotent, as a rewrite must be).
fn upper_r() -> Rewrite {
    Rewrite::new(|key, value| {
        (key.first() == Some(&b'r') && value.iter().any(u8::is_ascii_lowercase))
            .then(|| value.to_ascii_uppercase())
    })
}

#[test]
fn rocks_store_applies_its_rewrite_when_it_compacts() {
    let dir = tempfile::tempdir().unwrap();
    let opts = StoreOptions {
        rewrite: Some(upper_r()),
        ..StoreOptions::default()
    };
    rewrites(&RocksStore::open(dir.path(), &opts).unwrap());
}

#[test]
fn mem_store_applies_its_rewrite_when_it_compacts() {
    rewrites(&MemStore::with_rewrite(upper_r()));
}
