//! The key encoding. Every key is a one-byte [`Kind`] prefix followed by fixed-width parts:
//! 16-byte hashes of variable-length names and big-endian integers, so that byte order is the
//! order the ledger scans in (a run's effects by sequence, a branch's log by position, expiry
//! by time). Every key under a run starts with `kind || run_key`, and the run key is a hash of
//! `(tenant, run_id)`: a tenant's records can only be addressed through its own tenant name.
//!
//! Prefix bytes are never reused: retire a kind by leaving its byte unused.

/// Hash of `(tenant, run_id)`: the fixed-width identity of a run in keys.
pub type RunKey = [u8; 16];
/// Hash of a tenant name.
pub type TenantKey = [u8; 16];
/// Hash of a name (step key, checkpoint id, tool name).
pub type NameKey = [u8; 16];

/// The record kinds, in key order.
#[repr(u8)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Kind {
    /// Store metadata (format version).
    Meta = 0x00,
    /// A run: epoch, branches, pending replay tapes.
    Run = 0x01,
    /// An effect record, by run and sequence number.
    Effect = 0x02,
    /// Step key index: (run, branch, step key) -> effect.
    StepKey = 0x03,
    /// Intent index: (run, branch, intent fingerprint, occurrence) -> effect.
    Intent = 0x04,
    /// A branch's effect log: (run, branch, position) -> effect.
    BranchLog = 0x05,
    /// A checkpoint, by run and name.
    Checkpoint = 0x06,
    /// A restore event, by run and the epoch it created.
    Restore = 0x07,
    /// The current version of a tool, by tenant and name.
    ToolHead = 0x08,
    /// A tool version, by tenant, name and version.
    Tool = 0x09,
    /// A credential, by tenant and keyed hash.
    Credential = 0x0A,
    /// Expiry index: (expires_at, run, sequence) -> nothing. Written before format 7 only;
    /// the sweep drains what is left of it.
    Expiry = 0x0B,
    /// A tenant's runs, by run id: (tenant, run_id bytes) -> nothing (format 3).
    TenantRun = 0x0C,
    /// Effects not settled yet (granted, running, or of unknown outcome): (run, sequence) ->
    /// nothing (format 4).
    Open = 0x0D,
}

/// A blake3 key-derivation hasher for a fixed context. Deriving the context key is a full
/// compression (about 10,000 instructions); cloning the derived state is a copy.
pub struct DeriveKey {
    context: &'static str,
    prototype: std::sync::OnceLock<blake3::Hasher>,
}

impl DeriveKey {
    /// The hasher of `context` (derived on first use).
    pub const fn new(context: &'static str) -> Self {
        Self {
            context,
            prototype: std::sync::OnceLock::new(),
        }
    }

    /// A fresh hasher, equal to `blake3::Hasher::new_derive_key(context)`.
    pub fn hasher(&self) -> blake3::Hasher {
        self.prototype
            .get_or_init(|| blake3::Hasher::new_derive_key(self.context))
            .clone()
    }
}

static RUN_KEY: DeriveKey = DeriveKey::new("fence.v1 run key");
static TENANT_KEY: DeriveKey = DeriveKey::new("fence.v1 tenant key");
static NAME_KEY: DeriveKey = DeriveKey::new("fence.v1 name key");

fn hash16(context: &DeriveKey, parts: &[&[u8]]) -> [u8; 16] {
    let mut out = [0u8; 16];
    out.copy_from_slice(&hash_parts(context, parts, &[]).as_bytes()[..16]);
    out
}

/// blake3 under `context` over `parts`, each prefixed with its length as a big-endian u64
/// (so ("ab","c") and ("a","bc") differ), then `tail`. The bytes are gathered and hashed in
/// one update: blake3 hashes a stream, so this equals an update per piece, and each update
/// call costs more than hashing a short piece.
pub fn hash_parts(context: &DeriveKey, parts: &[&[u8]], tail: &[u8]) -> blake3::Hash {
    let len = parts.iter().map(|p| 8 + p.len()).sum::<usize>() + tail.len();
    let mut bytes = Vec::with_capacity(len);
    for p in parts {
        bytes.extend_from_slice(&(p.len() as u64).to_be_bytes());
        bytes.extend_from_slice(p);
    }
    bytes.extend_from_slice(tail);
    let mut h = context.hasher();
    h.update(&bytes);
    h.finalize()
}

/// Bytes of the prefix every key under one run starts with (`kind || run_key`). Keys of other
/// kinds (tenant, tool, credential, expiry) also start with a kind and 16 bytes.
pub const RUN_PREFIX_LEN: usize = 1 + 16;

/// The run key of `(tenant, run_id)`.
pub fn run_key(tenant: &str, run_id: &str) -> RunKey {
    hash16(&RUN_KEY, &[tenant.as_bytes(), run_id.as_bytes()])
}

/// The key of a tenant name.
pub fn tenant_key(tenant: &str) -> TenantKey {
    hash16(&TENANT_KEY, &[tenant.as_bytes()])
}

/// The key of a name within a run or tenant.
pub fn name_key(name: &str) -> NameKey {
    hash16(&NAME_KEY, &[name.as_bytes()])
}

struct KeyBuf(Vec<u8>);

impl KeyBuf {
    fn new(kind: Kind, cap: usize) -> Self {
        let mut v = Vec::with_capacity(cap + 1);
        v.push(kind as u8);
        Self(v)
    }
    fn bytes(mut self, b: &[u8]) -> Self {
        self.0.extend_from_slice(b);
        self
    }
    fn u32(self, n: u32) -> Self {
        self.bytes(&n.to_be_bytes())
    }
    fn u64(self, n: u64) -> Self {
        self.bytes(&n.to_be_bytes())
    }
}

/// The store-format metadata key.
pub fn meta() -> Vec<u8> {
    vec![Kind::Meta as u8]
}

/// A key that never holds a value: the write-ahead log prime deletes it so that a flush has
/// a memtable to switch (see `RocksStore::open`).
pub fn wal_prime() -> Vec<u8> {
    let mut k = meta();
    k.extend_from_slice(b"wal-prime");
    k
}

/// A run record.
pub fn run(rk: &RunKey) -> Vec<u8> {
    KeyBuf::new(Kind::Run, 16).bytes(rk).0
}

/// An effect record.
pub fn effect(rk: &RunKey, seq: u64) -> Vec<u8> {
    KeyBuf::new(Kind::Effect, 24).bytes(rk).u64(seq).0
}

/// All effects of a run.
pub fn effect_prefix(rk: &RunKey) -> Vec<u8> {
    KeyBuf::new(Kind::Effect, 16).bytes(rk).0
}

/// The run key of a run record's key.
pub fn decode_run(key: &[u8]) -> Option<RunKey> {
    if key.len() != RUN_PREFIX_LEN || key[0] != Kind::Run as u8 {
        return None;
    }
    key[1..].try_into().ok()
}

/// The sequence number of an effect key.
pub fn decode_effect(key: &[u8]) -> Option<(RunKey, u64)> {
    if key.len() != 25 || key[0] != Kind::Effect as u8 {
        return None;
    }
    let rk: RunKey = key[1..17].try_into().ok()?;
    Some((rk, u64::from_be_bytes(key[17..25].try_into().ok()?)))
}

/// A step key index entry.
pub fn step(rk: &RunKey, branch: u32, step_key: &str) -> Vec<u8> {
    step_named(rk, branch, &name_key(step_key))
}

/// [`step`] with the step key's [`name_key`] already derived (one derivation per call).
pub fn step_named(rk: &RunKey, branch: u32, name: &NameKey) -> Vec<u8> {
    KeyBuf::new(Kind::StepKey, 36)
        .bytes(rk)
        .u32(branch)
        .bytes(name)
        .0
}

/// Every step key index entry of a run, on all its branches.
pub fn step_run_prefix(rk: &RunKey) -> Vec<u8> {
    KeyBuf::new(Kind::StepKey, 16).bytes(rk).0
}

/// The run, branch and step name key of a step key index entry's key.
pub fn decode_step(key: &[u8]) -> Option<(RunKey, u32, NameKey)> {
    if key.len() != 37 || key[0] != Kind::StepKey as u8 {
        return None;
    }
    Some((
        key[1..17].try_into().ok()?,
        u32::from_be_bytes(key[17..21].try_into().ok()?),
        key[21..37].try_into().ok()?,
    ))
}

/// Every intent index entry of a run, on all its branches.
pub fn intent_run_prefix(rk: &RunKey) -> Vec<u8> {
    KeyBuf::new(Kind::Intent, 16).bytes(rk).0
}

/// The run, branch and intent fingerprint of an intent index entry's key.
pub fn decode_intent(key: &[u8]) -> Option<(RunKey, u32, [u8; 32])> {
    if key.len() != 57 || key[0] != Kind::Intent as u8 {
        return None;
    }
    Some((
        key[1..17].try_into().ok()?,
        u32::from_be_bytes(key[17..21].try_into().ok()?),
        key[21..53].try_into().ok()?,
    ))
}

/// An intent index entry.
pub fn intent(rk: &RunKey, branch: u32, fp: &[u8; 32], occurrence: u32) -> Vec<u8> {
    KeyBuf::new(Kind::Intent, 56)
        .bytes(rk)
        .u32(branch)
        .bytes(fp)
        .u32(occurrence)
        .0
}

/// All occurrences of an intent on one branch.
pub fn intent_prefix(rk: &RunKey, branch: u32, fp: &[u8; 32]) -> Vec<u8> {
    KeyBuf::new(Kind::Intent, 52)
        .bytes(rk)
        .u32(branch)
        .bytes(fp)
        .0
}

/// A branch log entry.
pub fn branch_log(rk: &RunKey, branch: u32, position: u64) -> Vec<u8> {
    KeyBuf::new(Kind::BranchLog, 28)
        .bytes(rk)
        .u32(branch)
        .u64(position)
        .0
}

/// A branch's whole log.
pub fn branch_log_prefix(rk: &RunKey, branch: u32) -> Vec<u8> {
    KeyBuf::new(Kind::BranchLog, 20).bytes(rk).u32(branch).0
}

/// A checkpoint.
pub fn checkpoint(rk: &RunKey, checkpoint_id: &str) -> Vec<u8> {
    KeyBuf::new(Kind::Checkpoint, 32)
        .bytes(rk)
        .bytes(&name_key(checkpoint_id))
        .0
}

/// All checkpoints of a run.
pub fn checkpoint_prefix(rk: &RunKey) -> Vec<u8> {
    KeyBuf::new(Kind::Checkpoint, 16).bytes(rk).0
}

/// A restore event.
pub fn restore(rk: &RunKey, epoch: u64) -> Vec<u8> {
    KeyBuf::new(Kind::Restore, 24).bytes(rk).u64(epoch).0
}

/// All restore events of a run.
pub fn restore_prefix(rk: &RunKey) -> Vec<u8> {
    KeyBuf::new(Kind::Restore, 16).bytes(rk).0
}

/// A tool's current-version pointer.
pub fn tool_head(tk: &TenantKey, name: &str) -> Vec<u8> {
    KeyBuf::new(Kind::ToolHead, 32)
        .bytes(tk)
        .bytes(&name_key(name))
        .0
}

/// One version of a tool.
pub fn tool(tk: &TenantKey, name: &str, version: u32) -> Vec<u8> {
    tool_by_name_key(tk, &name_key(name), version)
}

/// A credential.
pub fn credential(tk: &TenantKey, hash: &[u8; 32]) -> Vec<u8> {
    KeyBuf::new(Kind::Credential, 48).bytes(tk).bytes(hash).0
}

/// A tool's current-version pointer, by the hash of its name (as listed by a scan).
pub fn tool_head_prefix(tk: &TenantKey) -> Vec<u8> {
    KeyBuf::new(Kind::ToolHead, 16).bytes(tk).0
}

/// One version of a tool, by the hash of its name.
pub fn tool_by_name_key(tk: &TenantKey, nk: &NameKey, version: u32) -> Vec<u8> {
    KeyBuf::new(Kind::Tool, 36)
        .bytes(tk)
        .bytes(nk)
        .u32(version)
        .0
}

/// The name hash of a tool head key.
pub fn decode_tool_head(key: &[u8]) -> Option<NameKey> {
    if key.len() != 33 || key[0] != Kind::ToolHead as u8 {
        return None;
    }
    key[17..33].try_into().ok()
}

/// A tenant's run index entry. The run id is the key's last part, unhashed, so a tenant's
/// runs scan in run-id order and a run-id prefix is a key prefix.
pub fn tenant_run(tk: &TenantKey, run_id: &str) -> Vec<u8> {
    KeyBuf::new(Kind::TenantRun, 16 + run_id.len())
        .bytes(tk)
        .bytes(run_id.as_bytes())
        .0
}

/// A tenant's runs whose id starts with `run_id_prefix` (`""`: all of them).
pub fn tenant_run_prefix(tk: &TenantKey, run_id_prefix: &str) -> Vec<u8> {
    tenant_run(tk, run_id_prefix)
}

/// The run id of a tenant run index key (None if it is not one, or not UTF-8).
pub fn decode_tenant_run(key: &[u8]) -> Option<&str> {
    if key.len() < 17 || key[0] != Kind::TenantRun as u8 {
        return None;
    }
    std::str::from_utf8(&key[17..]).ok()
}

/// An open-effect index entry.
pub fn open(rk: &RunKey, seq: u64) -> Vec<u8> {
    KeyBuf::new(Kind::Open, 24).bytes(rk).u64(seq).0
}

/// The whole open-effect index.
pub fn open_prefix() -> Vec<u8> {
    vec![Kind::Open as u8]
}

/// Decodes an open-effect index key.
pub fn decode_open(key: &[u8]) -> Option<(RunKey, u64)> {
    if key.len() != 25 || key[0] != Kind::Open as u8 {
        return None;
    }
    let rk: RunKey = key[1..17].try_into().ok()?;
    Some((rk, u64::from_be_bytes(key[17..25].try_into().ok()?)))
}

/// All effect records (every run's).
pub fn effect_kind_prefix() -> Vec<u8> {
    vec![Kind::Effect as u8]
}

/// All run records (every tenant's): what a format migration walks.
pub fn run_prefix() -> Vec<u8> {
    vec![Kind::Run as u8]
}

/// An expiry index entry.
pub fn expiry(at_ms: u64, rk: &RunKey, seq: u64) -> Vec<u8> {
    KeyBuf::new(Kind::Expiry, 32)
        .u64(at_ms)
        .bytes(rk)
        .u64(seq)
        .0
}

/// The whole expiry index.
pub fn expiry_prefix() -> Vec<u8> {
    vec![Kind::Expiry as u8]
}

/// Decodes an expiry index key.
pub fn decode_expiry(key: &[u8]) -> Option<(u64, RunKey, u64)> {
    if key.len() != 33 || key[0] != Kind::Expiry as u8 {
        return None;
    }
    let at = u64::from_be_bytes(key[1..9].try_into().ok()?);
    let rk: RunKey = key[9..25].try_into().ok()?;
    let seq = u64::from_be_bytes(key[25..33].try_into().ok()?);
    Some((at, rk, seq))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Keys are stored: gathering the pieces into one update must hash exactly what an
    /// update per piece did.
    #[test]
    fn hashing_parts_at_once_equals_an_update_per_piece() {
        static CONTEXT: DeriveKey = DeriveKey::new("fence.v1 test parts");
        let parts: [&[u8]; 3] = [b"tenant", b"", b"run \xff"];
        let mut h = CONTEXT.hasher();
        for p in parts {
            h.update(&(p.len() as u64).to_be_bytes());
            h.update(p);
        }
        h.update(&7u32.to_be_bytes());
        assert_eq!(
            hash_parts(&CONTEXT, &parts, &7u32.to_be_bytes()),
            h.finalize()
        );
        // And the run key, stored in every data dir, is still what it always was.
        let mut h = RUN_KEY.hasher();
        for p in [&b"t"[..], b"r"] {
            h.update(&(p.len() as u64).to_be_bytes());
            h.update(p);
        }
        assert_eq!(run_key("t", "r")[..], h.finalize().as_bytes()[..16]);
    }

    #[test]
    fn a_cloned_derive_key_hasher_equals_a_fresh_one() {
        let fresh = blake3::Hasher::new_derive_key("fence.v1 run key")
            .update(b"x")
            .finalize();
        assert_eq!(RUN_KEY.hasher().update(b"x").finalize(), fresh);
        assert_eq!(RUN_KEY.hasher().update(b"x").finalize(), fresh);
    }
    use proptest::prelude::*;

    #[test]
    fn kinds_are_distinct_and_ordered() {
        let kinds = [
            Kind::Meta,
            Kind::Run,
            Kind::Effect,
            Kind::StepKey,
            Kind::Intent,
            Kind::BranchLog,
            Kind::Checkpoint,
            Kind::Restore,
            Kind::ToolHead,
            Kind::Tool,
            Kind::Credential,
            Kind::Expiry,
            Kind::TenantRun,
            Kind::Open,
        ];
        for w in kinds.windows(2) {
            assert!((w[0] as u8) < (w[1] as u8));
        }
    }

    #[test]
    fn runs_are_scoped_by_tenant() {
        assert_ne!(run_key("a", "r"), run_key("b", "r"));
        assert_ne!(run_key("ab", "c"), run_key("a", "bc"));
        assert_eq!(run_key("a", "r"), run_key("a", "r"));
    }

    #[test]
    fn prefixes_contain_their_keys() {
        let rk = run_key("t", "r");
        assert!(effect(&rk, 7).starts_with(&effect_prefix(&rk)));
        let fp = [9u8; 32];
        assert!(intent(&rk, 2, &fp, 3).starts_with(&intent_prefix(&rk, 2, &fp)));
        assert!(branch_log(&rk, 2, 3).starts_with(&branch_log_prefix(&rk, 2)));
        assert!(checkpoint(&rk, "c").starts_with(&checkpoint_prefix(&rk)));
        assert!(restore(&rk, 2).starts_with(&restore_prefix(&rk)));
        assert!(expiry(1, &rk, 2).starts_with(&expiry_prefix()));
        let tk = tenant_key("t");
        assert!(tenant_run(&tk, "run-7").starts_with(&tenant_run_prefix(&tk, "run-")));
        assert!(!tenant_run(&tenant_key("u"), "run-7").starts_with(&tenant_run_prefix(&tk, "")));
        assert_eq!(decode_tenant_run(&tenant_run(&tk, "run-7")), Some("run-7"));
        assert!(tool_head(&tk, "pay").starts_with(&tool_head_prefix(&tk)));
        assert_eq!(
            decode_tool_head(&tool_head(&tk, "pay")),
            Some(name_key("pay"))
        );
        assert_eq!(
            tool_by_name_key(&tk, &name_key("pay"), 3),
            tool(&tk, "pay", 3)
        );
        assert!(run(&rk).starts_with(&run_prefix()));
        assert!(open(&rk, 9).starts_with(&open_prefix()));
        assert_eq!(decode_open(&open(&rk, 9)), Some((rk, 9)));
        assert!(effect(&rk, 9).starts_with(&effect_kind_prefix()));
        // A neighbouring branch's log is not inside this branch's prefix.
        assert!(!branch_log(&rk, 3, 0).starts_with(&branch_log_prefix(&rk, 2)));
    }

    #[test]
    fn index_keys_decode_to_their_run_branch_and_name() {
        let rk = run_key("t", "r");
        let fp = [9u8; 32];
        let intent_key = intent(&rk, 0x0102_0304, &fp, 7);
        assert!(intent_key.starts_with(&intent_run_prefix(&rk)));
        assert_eq!(decode_intent(&intent_key), Some((rk, 0x0102_0304, fp)));
        let step_key = step(&rk, 5, "charge");
        assert!(step_key.starts_with(&step_run_prefix(&rk)));
        assert_eq!(decode_step(&step_key), Some((rk, 5, name_key("charge"))));
        // Other kinds, and the prefixes themselves, decode to nothing.
        assert_eq!(decode_intent(&step_key), None);
        assert_eq!(decode_step(&intent_key), None);
        assert_eq!(decode_intent(&intent_prefix(&rk, 1, &fp)), None);
        assert_eq!(decode_step(&effect(&rk, 1)), None);
        assert!(!intent(&run_key("t", "s"), 0, &fp, 1).starts_with(&intent_run_prefix(&rk)));
    }

    proptest! {
        #[test]
        fn effect_keys_round_trip_and_sort_by_sequence(a in any::<u64>(), b in any::<u64>()) {
            let rk = run_key("t", "r");
            prop_assert_eq!(decode_effect(&effect(&rk, a)), Some((rk, a)));
            prop_assert_eq!(a.cmp(&b), effect(&rk, a).cmp(&effect(&rk, b)));
        }

        #[test]
        fn expiry_keys_round_trip_and_sort_by_time(a in any::<u64>(), b in any::<u64>(), s in any::<u64>()) {
            let rk = run_key("t", "r");
            prop_assert_eq!(decode_expiry(&expiry(a, &rk, s)), Some((a, rk, s)));
            prop_assert_eq!(a.cmp(&b), expiry(a, &rk, s).cmp(&expiry(b, &rk, s)));
        }

        #[test]
        fn log_positions_sort_numerically(a in any::<u64>(), b in any::<u64>()) {
            let rk = run_key("t", "r");
            prop_assert_eq!(a.cmp(&b), branch_log(&rk, 1, a).cmp(&branch_log(&rk, 1, b)));
        }
    }
}
