//! The ledger: Fence's state machine, in plain Rust with no network in it.
//!
//! It owns every rule of DESIGN.md: operation classes, effect states and leases, the
//! replay-or-fork decision ([`begin`]), checkpoints, restores and forks ([`runs`]), outcomes
//! ([`outcome`]), credentials ([`credentials`]), the tool registry ([`tools`]) and retention
//! ([`expiry`]), and batches of Begins and Completes sharing one sync ([`batch`]). Invariants:
//! - every transition is one atomic [`Batch`], durable before it returns;
//! - every decision touches one run's records (plus the tenant's credentials and tools), and
//!   decisions on one run are serialised by a striped lock, so there are never two live grants
//!   for one effect while different runs proceed in parallel;
//! - a refusal or an invalid request writes nothing.

pub mod batch;
pub mod begin;
mod cache;
pub mod credentials;
pub mod expiry;
pub mod format;
mod index_filter;
pub mod messages;
pub mod outcome;
pub mod records;
pub mod runs;
#[cfg(test)]
pub(crate) mod test_support;
pub mod tools;
pub mod types;
pub mod verify;

use std::ops::ControlFlow;
use std::sync::{Arc, Mutex, MutexGuard};

use prost::Message;

use crate::clock::Clock;
use crate::store::keys::{self, RunKey};
use crate::store::{Batch, Store, codec};
use records::{EffectRecord, RunRecord};
pub use types::*;

/// The root branch's name.
pub const MAIN_BRANCH: &str = "main";

/// Size and count limits; every one is enforced before anything is written.
#[derive(Debug, Clone)]
pub struct Limits {
    /// Maximum bytes of any identifier.
    pub max_id_bytes: usize,
    /// Maximum bytes of a call's JSON arguments.
    pub max_arguments_bytes: usize,
    /// Maximum bytes of a result.
    pub max_result_bytes: usize,
    /// Maximum bytes of reconcile evidence.
    pub max_evidence_bytes: usize,
    /// Maximum bytes of a failure detail or fork reason.
    pub max_detail_bytes: usize,
    /// Maximum bytes of a raw credential.
    pub max_token_bytes: usize,
    /// Maximum credentials presented in one call.
    pub max_credentials_per_call: usize,
    /// Maximum effects recorded in one run.
    pub max_effects_per_run: u64,
    /// Maximum branches of one run.
    pub max_branches_per_run: usize,
    /// Maximum checkpoints of one run.
    pub max_checkpoints_per_run: u32,
    /// Maximum field paths in one intent schema.
    pub max_schema_paths: usize,
    /// Maximum registered versions of one tool.
    pub max_tool_versions: u32,
    /// Maximum calls in one BeginBatch or CompleteBatch.
    pub max_batch_calls: usize,
    /// Bytes of stored records one ListEffects page holds at most (one record always fits).
    pub max_page_bytes: usize,
    /// Tool versions (and, separately, current versions) kept parsed in memory.
    pub max_cached_tools: usize,
    /// Runs whose decoded record is kept between their decisions (0: none).
    pub max_cached_runs: usize,
    /// Effects just begun whose decoded record is kept for their Complete (0: none); records
    /// over [`MAX_CACHED_EFFECT_BYTES`] are not kept.
    pub max_cached_effects: usize,
    /// Step key and intent index entries summarised in memory, all runs together, so that a
    /// Begin skips the lookups of a step key or intent its run never had (0: none); a run
    /// with more than 65,536 such entries is not summarised.
    pub max_filtered_index_entries: usize,
}

/// Entries read per scan while catching a run record up.
const CATCH_UP_PAGE: usize = 256;

/// A Begin that records an effect and changes nothing else in its run record leaves the
/// stored record's counts (`next_seq`, branch lengths) behind, and writes it only every this
/// many effects: a reader that misses the run cache reads at most this many branch log
/// entries past the stored counts (format 5). Small, because a miss is not rare: a second
/// call of one run decided in the same group finds the first one's record not yet durable.
pub const RUN_RECORD_EVERY: u64 = 8;

/// The largest effect record (encoded) the effect cache keeps: with
/// [`Limits::max_cached_effects`], this bounds the cache's memory (64 MiB at the default).
pub const MAX_CACHED_EFFECT_BYTES: usize = 4096;

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_id_bytes: 256,
            max_arguments_bytes: 1 << 20,
            max_result_bytes: 4 << 20,
            max_evidence_bytes: 64 << 10,
            max_detail_bytes: 16 << 10,
            max_token_bytes: 4096,
            max_credentials_per_call: 16,
            max_effects_per_run: 1_000_000,
            max_branches_per_run: 256,
            max_checkpoints_per_run: 10_000,
            max_schema_paths: 64,
            max_tool_versions: 1000,
            max_batch_calls: 128,
            max_page_bytes: 1 << 20,
            max_cached_tools: 10_000,
            max_cached_runs: 65_536,
            max_cached_effects: 16_384,
            max_filtered_index_entries: 2 << 20,
        }
    }
}

/// Ledger settings.
#[derive(Debug, Clone)]
pub struct LedgerConfig {
    /// Lease of a grant when neither the call nor the tool says.
    pub default_lease_ms: u64,
    /// Longest lease a call may ask for.
    pub max_lease_ms: u64,
    /// Retention of finished effects when the tool does not say.
    pub default_retention_ms: u64,
    /// Suggested wait returned with IN_PROGRESS.
    pub in_progress_retry_ms: u64,
    /// Limits.
    pub limits: Limits,
    /// The server secret keying credential hashes.
    pub credential_key: [u8; 32],
}

impl Default for LedgerConfig {
    fn default() -> Self {
        Self {
            default_lease_ms: 30_000,
            max_lease_ms: 24 * 3600 * 1000,
            default_retention_ms: 7 * 24 * 3600 * 1000,
            in_progress_retry_ms: 200,
            limits: Limits::default(),
            credential_key: [0; 32],
        }
    }
}

/// Striped mutexes: a key's stripe serialises every decision on it.
struct Stripes(Box<[Mutex<()>]>);

impl Stripes {
    fn new(n: usize) -> Self {
        Self((0..n).map(|_| Mutex::new(())).collect())
    }

    fn index(&self, key: &[u8]) -> usize {
        // Keys end in hash bytes (run keys, name and credential hashes): their tail spreads
        // well, while their head is a shared kind/tenant prefix.
        let mut b = [0u8; 8];
        let n = key.len().min(8);
        b[..n].copy_from_slice(&key[key.len() - n..]);
        (u64::from_le_bytes(b) % self.0.len() as u64) as usize
    }

    fn lock(&self, key: &[u8]) -> MutexGuard<'_, ()> {
        // The guarded value is (), so a panic elsewhere cannot leave it inconsistent.
        self.0[self.index(key)]
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    /// Locks the stripes of several keys, in a global order (no deadlock).
    fn lock_many(&self, keys: &[&[u8]]) -> Vec<MutexGuard<'_, ()>> {
        let mut idx: Vec<usize> = keys.iter().map(|k| self.index(k)).collect();
        idx.sort_unstable();
        idx.dedup();
        idx.into_iter()
            .map(|i| self.0[i].lock().unwrap_or_else(|e| e.into_inner()))
            .collect()
    }
}

/// The effect ledger over a [`Store`].
pub struct Ledger<S> {
    store: S,
    clock: Arc<dyn Clock>,
    config: LedgerConfig,
    /// Serialises decisions per run (and tool registrations per tenant+name).
    runs: Stripes,
    /// Serialises spending per credential; always taken after a run stripe.
    credentials: Stripes,
    /// Parsed tool versions and current versions.
    tools: tools::ToolCache,
    /// Decoded run records between a run's Begins.
    run_cache: cache::RecordCache<RunKey, RunRecord>,
    /// Decoded records of effects just begun, for their Complete.
    effect_cache: cache::RecordCache<(RunKey, u64), EffectRecord>,
    /// Which step key and intent index entries each run may hold.
    index_filters: index_filter::IndexFilters,
}

impl<S: Store> Ledger<S> {
    /// A ledger over `store`.
    pub fn new(store: S, clock: Arc<dyn Clock>, config: LedgerConfig) -> Self {
        Self {
            store,
            clock,
            tools: tools::ToolCache::new(config.limits.max_cached_tools),
            run_cache: cache::RecordCache::new(config.limits.max_cached_runs),
            effect_cache: cache::RecordCache::new(config.limits.max_cached_effects),
            index_filters: index_filter::IndexFilters::new(
                config.limits.max_filtered_index_entries,
            ),
            config,
            runs: Stripes::new(4096),
            credentials: Stripes::new(1024),
        }
    }

    /// The underlying store.
    pub fn store(&self) -> &S {
        &self.store
    }

    /// The configuration.
    pub fn config(&self) -> &LedgerConfig {
        &self.config
    }

    fn now(&self) -> u64 {
        self.clock.now_ms()
    }

    /// One page of a listing: the entries under `prefix` from key `from` on, read a few at a
    /// time (a record may hold megabytes), each turned by `item` into a listed value and its
    /// size in bytes, or skipped (`None`). A page ends at `page_size` values or before it would
    /// pass the byte budget (`Limits::max_page_bytes`; it always holds at least one value), so
    /// one response never buffers much more than the budget for a client that reads it slowly
    /// or never. Returns the values and the key to resume from (`None`: nothing is left).
    fn page<T>(
        &self,
        prefix: &[u8],
        from: Vec<u8>,
        page_size: u32,
        mut item: impl FnMut(&[u8], &[u8]) -> Result<Option<(T, usize)>>,
    ) -> Result<(Vec<T>, Option<Vec<u8>>)> {
        let page_size = match page_size {
            0 => 100,
            n => n.min(1000) as usize,
        };
        let max_bytes = self.config.limits.max_page_bytes;
        let mut out = Vec::new();
        let mut bytes = 0usize;
        let mut next = None;
        self.walk(prefix, from, 32, |chunk| {
            for (k, v) in chunk {
                let Some((value, size)) = item(k, v)? else {
                    continue;
                };
                if out.len() == page_size || (!out.is_empty() && bytes + size > max_bytes) {
                    next = Some(k.clone());
                    return Ok(ControlFlow::Break(()));
                }
                bytes += size;
                out.push(value);
            }
            Ok(ControlFlow::Continue(()))
        })?;
        Ok((out, next))
    }

    /// Walks the records under `prefix` from key `from` on, `chunk` at a time, handing each
    /// chunk to `f` until `f` breaks or the records end.
    fn walk(
        &self,
        prefix: &[u8],
        mut from: Vec<u8>,
        chunk: usize,
        mut f: impl FnMut(&crate::store::Entries) -> Result<ControlFlow<()>>,
    ) -> Result<()> {
        loop {
            let entries = self.store.scan(prefix, &from, chunk)?;
            if f(&entries)?.is_break() || entries.len() < chunk {
                return Ok(());
            }
            if let Some((mut last, _)) = entries.into_iter().next_back() {
                // The smallest key after `last`.
                last.push(0);
                from = last;
            }
        }
    }

    fn get<M: Message + Default>(&self, key: &[u8]) -> Result<Option<M>> {
        match self.store.get(key)? {
            Some(bytes) => Ok(Some(codec::decode(key, &bytes)?)),
            None => Ok(None),
        }
    }

    /// Writes `batch` durably: every ledger write goes through here (or
    /// [`Ledger::commit_unsynced`]), so that the run cache forgets a run whose record is
    /// being written before it is (and the effect cache an effect), and the index filters
    /// hold every index entry before it is written.
    fn commit(&self, batch: Batch) -> Result<()> {
        self.note_writes(&batch);
        Ok(self.store.write(batch)?)
    }

    /// [`Store::write_unsynced`] through the run cache (see [`Ledger::commit`]).
    fn commit_unsynced(&self, batch: Batch) -> Result<()> {
        self.note_writes(&batch);
        Ok(self.store.write_unsynced(batch)?)
    }

    fn note_writes(&self, batch: &Batch) {
        for op in batch.ops() {
            let key = op.write().0;
            if let Some(rk) = keys::decode_run(key) {
                self.run_cache.forget(&rk);
            } else if let Some(id) = keys::decode_effect(key) {
                self.effect_cache.forget(&id);
            } else if let Some((rk, tag)) = index_filter::key_tag(key) {
                self.index_filters.note(&rk, tag);
            }
        }
    }

    /// Installs the run's index filter if it has none: from a scan of its step key and
    /// intent indexes. The caller holds the run's lock (see [`index_filter`]).
    fn ensure_index_filter(&self, rk: &RunKey) -> Result<()> {
        if self.index_filters.installed(rk) {
            return Ok(());
        }
        let cap = index_filter::MAX_TAGS_PER_RUN;
        let mut tags = Vec::new();
        for prefix in [keys::step_run_prefix(rk), keys::intent_run_prefix(rk)] {
            for (key, _) in self
                .store
                .scan(&prefix, &prefix, cap + 1 - tags.len().min(cap))?
            {
                tags.extend(index_filter::key_tag(&key).map(|(_, tag)| tag));
            }
        }
        let complete = tags.len() <= cap;
        self.index_filters.install(*rk, tags, complete);
        Ok(())
    }

    /// May the run's index hold an entry with `tag` (under `key`: the entry's key, or the
    /// prefix of the entries sought)? In debug builds, a "no" is checked against the store.
    fn index_may_hold(&self, rk: &RunKey, tag: u64, key: &[u8]) -> Result<bool> {
        let may = self.index_filters.may_hold(rk, tag);
        #[cfg(debug_assertions)]
        if !may {
            let found = self.store.scan(key, key, 1)?;
            assert!(
                found.is_empty(),
                "the index filter lacks an entry the store holds: {}",
                codec::hex(&found[0].0)
            );
        }
        #[cfg(not(debug_assertions))]
        let _ = key;
        Ok(may)
    }

    /// Loads a run for a decision that holds its lock and will write it: from the run cache
    /// when it holds the run durably, else as [`Ledger::load_run`] does. The cached copy is
    /// taken out; [`Ledger::commit_run`] puts back what the decision wrote.
    fn take_run(&self, rk: &RunKey, tenant: &str, run_id: &str) -> Result<Option<RunRecord>> {
        match self.run_cache.take(rk, self.store.durability()) {
            Some(run) => Ok(Some(run).filter(|r| r.tenant == tenant && r.run_id == run_id)),
            None => self.load_run(rk, tenant, run_id),
        }
    }

    /// Writes `batch`, which holds `run` as the record of `rk` and `effect` as the record of
    /// one of its effects, and keeps both in the caches, stamped with the store's durability
    /// before and after the write.
    fn commit_run(
        &self,
        batch: Batch,
        rk: RunKey,
        run: RunRecord,
        effect: &EffectRecord,
    ) -> Result<()> {
        let before = self.store.durability();
        self.commit(batch)?;
        let stamp = self.store.write_stamp(before);
        self.run_cache.put(rk, stamp, run);
        if self.config.limits.max_cached_effects > 0
            && effect.encoded_len() <= MAX_CACHED_EFFECT_BYTES
        {
            self.effect_cache
                .put((rk, effect.seq), stamp, effect.clone());
        }
        Ok(())
    }

    /// Loads an effect for a decision that holds its run's lock and will write it: from the
    /// effect cache when it holds the effect durably, else as [`Ledger::require_effect`]
    /// does. The cached copy is taken out.
    fn take_effect(&self, id: &EffectId, tenant: &str) -> Result<EffectRecord> {
        // A cached record was put under the run key its own tenant and run id derive, so the
        // tenant is the only thing left to check.
        match self
            .effect_cache
            .take(&(id.run_key, id.seq), self.store.durability())
        {
            Some(rec) if rec.tenant == tenant => Ok(rec),
            Some(_) => Err(unknown_effect(&id.to_string()).into()),
            None => self.require_effect(id, tenant),
        }
    }

    /// Writes `rec` and keeps the open-effect index in step with its state.
    fn put_effect(&self, batch: &mut Batch, rk: &RunKey, rec: &EffectRecord) {
        batch.put(keys::effect(rk, rec.seq), codec::encode(rec));
        index_open(batch, rk, rec);
    }

    /// Loads a run, checking it belongs to `tenant` (the key is a hash; the record is the truth).
    fn load_run(&self, rk: &RunKey, tenant: &str, run_id: &str) -> Result<Option<RunRecord>> {
        let Some(mut run) = self
            .get::<RunRecord>(&keys::run(rk))?
            .filter(|r| r.tenant == tenant && r.run_id == run_id)
        else {
            return Ok(None);
        };
        self.catch_up_run(rk, &mut run)?;
        Ok(Some(run))
    }

    /// Brings a stored run record's counts up to date: the stored `next_seq` and branch
    /// lengths may lag (see [`RUN_RECORD_EVERY`]), and the branch log entries after the
    /// stored lengths are the truth. Every effect is logged on its branch in the batch that
    /// records it, at a position at or past the length stored before it, and no log entry is
    /// ever deleted; so the entries past each stored length name every effect recorded since.
    pub(crate) fn catch_up_run(&self, rk: &RunKey, run: &mut RunRecord) -> Result<()> {
        let mut next_seq = run.next_seq;
        for (b, branch) in run.branches.iter_mut().enumerate() {
            let prefix = keys::branch_log_prefix(rk, b as u32);
            loop {
                let from = keys::branch_log(rk, b as u32, branch.length);
                let page = self.store.scan(&prefix, &from, CATCH_UP_PAGE)?;
                for (key, value) in &page {
                    let entry: records::IndexEntry = codec::decode(key, value)?;
                    next_seq = next_seq.max(entry.seq + 1);
                    branch.length = branch.length.max(entry.position + 1);
                }
                if page.len() < CATCH_UP_PAGE {
                    break;
                }
            }
        }
        run.next_seq = next_seq;
        Ok(())
    }

    fn require_run(&self, rk: &RunKey, tenant: &str, run_id: &str) -> Result<RunRecord> {
        self.load_run(rk, tenant, run_id)?.ok_or_else(|| {
            Refusal::new(
                Reason::UnknownRecord,
                Recovery::FixArgument,
                format!("Run {run_id:?} does not exist."),
            )
            .into()
        })
    }

    /// Loads an effect by id, as seen by `tenant` (another tenant's effect does not exist).
    fn load_effect(&self, id: &EffectId, tenant: &str) -> Result<Option<EffectRecord>> {
        Ok(self
            .get::<EffectRecord>(&keys::effect(&id.run_key, id.seq))?
            .filter(|e| e.tenant == tenant && keys::run_key(tenant, &e.run_id) == id.run_key))
    }

    fn require_effect(&self, id: &EffectId, tenant: &str) -> Result<EffectRecord> {
        self.load_effect(id, tenant)?
            .ok_or_else(|| unknown_effect(&id.to_string()).into())
    }

    fn load_seq(&self, rk: &RunKey, seq: u64) -> Result<EffectRecord> {
        let key = keys::effect(rk, seq);
        self.get(&key)?.ok_or_else(|| {
            crate::store::StoreError::Corrupt {
                key: codec::hex(&key),
                why: "an index points at a missing effect".into(),
            }
            .into()
        })
    }

    /// Validates an identifier: not empty, not blank, not oversized, no control characters.
    fn check_id(&self, field: &str, value: &str) -> Result<()> {
        check_id(field, value, self.config.limits.max_id_bytes)
    }

    fn check_len(&self, field: &str, len: usize, max: usize) -> Result<()> {
        if len > max {
            return Err(LedgerError::invalid(
                field,
                format!("is {len} bytes; the limit is {max}"),
            ));
        }
        Ok(())
    }
}

/// Validates an identifier (see [`Limits::max_id_bytes`]).
pub fn check_id(field: &str, value: &str, max: usize) -> Result<()> {
    let why = if value.is_empty() {
        "must not be empty".to_owned()
    } else if value.trim().is_empty() {
        "must not be blank".to_owned()
    } else if value.len() > max {
        format!("is {} bytes; the limit is {max}", value.len())
    } else if value.chars().any(char::is_control) {
        "must not contain control characters".to_owned()
    } else {
        return Ok(());
    };
    Err(LedgerError::invalid(field, why))
}

fn unknown_effect(id: &str) -> Refusal {
    Refusal::new(
        Reason::UnknownRecord,
        Recovery::FixArgument,
        format!("Effect {id} does not exist."),
    )
}

/// Checks a request's epoch against the run's.
fn check_epoch(run: &RunRecord, epoch: u64) -> std::result::Result<(), Refusal> {
    let stale = |msg: String| {
        let mut r = Refusal::new(Reason::StaleEpoch, Recovery::RefreshEpoch, msg);
        r.current_epoch = run.epoch;
        r
    };
    if epoch == 0 && run.epoch > 1 {
        return Err(stale(format!(
            "Run {:?} was restored (epoch {}); calls must carry the current epoch.",
            run.run_id, run.epoch
        )));
    }
    if epoch != 0 && epoch < run.epoch {
        return Err(stale(format!(
            "Epoch {epoch} is stale: run {:?} was restored and is at epoch {}.",
            run.run_id, run.epoch
        )));
    }
    if epoch > run.epoch {
        let mut r = Refusal::new(
            Reason::UnknownEpoch,
            Recovery::RefreshEpoch,
            format!(
                "Epoch {epoch} was never issued; run {:?} is at epoch {}.",
                run.run_id, run.epoch
            ),
        );
        r.current_epoch = run.epoch;
        return Err(r);
    }
    Ok(())
}

/// A branch's replay tape and carried effects are stored as parallel lists (the record's
/// layout); these keep each pair of lists in step.
impl records::BranchRecord {
    /// Carries `seq` (held by `source`'s indexes), unless it is carried already.
    pub fn carry(&mut self, seq: u64, source: u32) {
        if !self.carried_seqs.contains(&seq) {
            self.carried_seqs.push(seq);
            self.carried_sources.push(source);
        }
    }

    /// Stops carrying `seq` (it was adopted); false when it was not carried.
    pub fn uncarry(&mut self, seq: u64) -> bool {
        match self.carried_seqs.iter().position(|s| *s == seq) {
            Some(i) => {
                self.carried_seqs.remove(i);
                self.carried_sources.remove(i);
                true
            }
            None => false,
        }
    }

    /// The carried effects and the branches whose indexes hold them.
    pub fn carried(&self) -> impl Iterator<Item = (u64, u32)> + '_ {
        self.carried_seqs
            .iter()
            .copied()
            .zip(self.carried_sources.iter().copied())
    }

    /// Takes `seq` off the replay tape; its log position, or `None` when it was not due.
    pub fn take_from_tape(&mut self, seq: u64) -> Option<u64> {
        let i = self.tape_seqs.iter().position(|s| *s == seq)?;
        self.tape_seqs.remove(i);
        if self.tape_seqs.is_empty() {
            // Nothing is due any more: the branch is no longer replaying that restore.
            self.restored_from_checkpoint.clear();
        }
        Some(self.tape_positions.remove(i))
    }

    /// What is due on the branch: its tape, then its carried effects (what a checkpoint
    /// saved now records as due at it).
    pub fn due_seqs(&self) -> impl Iterator<Item = u64> + '_ {
        self.tape_seqs.iter().chain(&self.carried_seqs).copied()
    }
}

impl RunRecord {
    /// The index of a branch by name ("" = main).
    pub fn branch_index(&self, name: &str) -> Option<u32> {
        let name = if name.is_empty() { MAIN_BRANCH } else { name };
        self.branches
            .iter()
            .position(|b| b.name == name)
            .map(|i| i as u32)
    }

    /// The branch lineage of `branch`: (branch index, log positions visible) from the branch
    /// itself up to "main". A parent contributes only what it recorded before the fork point.
    pub fn lineage(&self, branch: u32) -> Vec<(u32, u64)> {
        let mut out = vec![(branch, u64::MAX)];
        let mut cur = &self.branches[branch as usize];
        while let Some(parent) = cur.parent {
            out.push((parent, cur.fork_position));
            cur = &self.branches[parent as usize];
        }
        out
    }
}

impl EffectRecord {
    /// The effect's public id.
    pub fn id(&self) -> EffectId {
        EffectId {
            run_key: keys::run_key(&self.tenant, &self.run_id),
            seq: self.seq,
        }
    }

    /// The state code as an enum.
    pub fn state(&self) -> State {
        State::from_code(self.state).unwrap_or(State::EffectUnknown)
    }

    /// The class code as an enum.
    pub fn class(&self) -> OpClass {
        OpClass::from_code(self.class).unwrap_or(OpClass::NonRetryable)
    }

    /// Is the effect on a lineage (as returned by [`RunRecord::lineage`]): recorded on one of
    /// its branches before that branch's limit, or adopted by one of them after a fork?
    pub fn visible_on(&self, lineage: &[(u32, u64)]) -> bool {
        let on = |branch: u32, position: u64| {
            lineage
                .iter()
                .any(|&(b, limit)| b == branch && position < limit)
        };
        on(self.branch, self.position) || self.adopted.iter().any(|a| on(a.branch, a.position))
    }

    /// The effect's position in `branch`'s log: where it was recorded, or where that branch
    /// adopted it; `None` when the log does not hold it.
    pub fn log_position(&self, branch: u32) -> Option<u64> {
        (self.branch == branch)
            .then_some(self.position)
            .or_else(|| {
                self.adopted
                    .iter()
                    .find(|a| a.branch == branch)
                    .map(|a| a.position)
            })
    }

    /// Did this effect take `replaced`'s place (see [`EffectRecord::supersedes`])? Only where
    /// its own branch did not re-issue `replaced` as well: a line that did both replaced
    /// nothing.
    pub fn took_place_of(&self, replaced: &EffectRecord) -> bool {
        self.supersedes == Some(replaced.seq) && replaced.log_position(self.branch).is_none()
    }

    /// True while a grant's lease is live at `now`.
    pub fn lease_live(&self, now: u64) -> bool {
        matches!(self.state(), State::Accepted | State::Running) && now < self.lease_expires_at_ms
    }

    /// The record as it stands at `now`: a lapsed lease reads EFFECT_UNKNOWN, and a record
    /// past its retention reads as its tombstone (even before compaction rewrites it).
    pub fn view(&self, now: u64) -> EffectRecord {
        self.clone().into_view(now)
    }

    /// [`EffectRecord::view`] of a record no longer needed as stored (no copy).
    pub fn into_view(mut self, now: u64) -> EffectRecord {
        if matches!(self.state(), State::Accepted | State::Running)
            && now >= self.lease_expires_at_ms
        {
            self.state = State::EffectUnknown.code();
            self.lease_expires_at_ms = 0;
        }
        if self.due_for_tombstone(now) {
            self.make_tombstone();
        }
        self
    }

    /// Is the record a tombstone at `now` (as its view would say)?
    pub fn expired_at(&self, now: u64) -> bool {
        self.tombstone || retention_passed(self.expires_at_ms, now)
    }

    /// Not a tombstone yet, but past its retention window at `now`: what the store's
    /// compaction and the legacy sweep rewrite.
    pub fn due_for_tombstone(&self, now: u64) -> bool {
        !self.tombstone && retention_passed(self.expires_at_ms, now)
    }

    /// Not settled yet: granted, running, or of unknown outcome (as stored; a lapsed lease
    /// is still stored as granted). Such an effect is in the open-effect index.
    pub fn is_open(&self) -> bool {
        matches!(
            self.state(),
            State::Accepted | State::Running | State::EffectUnknown
        )
    }

    /// Drops the payload, keeping identity, fingerprints and the final state.
    pub fn make_tombstone(&mut self) {
        self.tombstone = true;
        self.result.clear();
        self.detail.clear();
        self.evidence.clear();
        self.arguments_json.clear();
        self.compensation_arguments.clear();
    }
}

/// Has a retention window that ends at `expires_at_ms` (0: none, the effect is not finished)
/// passed at `now`? The one definition every reader and rewriter of retention uses.
pub(crate) fn retention_passed(expires_at_ms: u64, now: u64) -> bool {
    expires_at_ms != 0 && now >= expires_at_ms
}

/// Puts `rec` in the open-effect index or takes it out, as its state says.
fn index_open(batch: &mut Batch, rk: &RunKey, rec: &EffectRecord) {
    if rec.is_open() {
        batch.put(keys::open(rk, rec.seq), Vec::new());
    } else {
        batch.delete(keys::open(rk, rec.seq));
    }
}

/// Appends `rec` to branch `index`'s log at its next position, indexes it there as the
/// `occurrence`-th of its intent, and records the adoption on `rec`; returns the index entry
/// (for the caller's step-key indexes). How an effect done on another line joins a branch.
fn append_adopted(
    batch: &mut Batch,
    rk: &RunKey,
    index: u32,
    branch: &mut records::BranchRecord,
    rec: &mut EffectRecord,
    occurrence: u32,
) -> Result<Vec<u8>> {
    let position = branch.length;
    let fp: crate::canonical::Fingerprint =
        rec.intent_fp[..]
            .try_into()
            .map_err(|_| crate::store::StoreError::Corrupt {
                key: codec::hex(&keys::effect(rk, rec.seq)),
                why: "an intent fingerprint is not 32 bytes".into(),
            })?;
    let entry = codec::encode(&records::IndexEntry {
        seq: rec.seq,
        position,
        tool_version: rec.tool_version,
    });
    batch.put(keys::branch_log(rk, index, position), entry.clone());
    batch.put(keys::intent(rk, index, &fp, occurrence), entry.clone());
    rec.adopted.push(records::Adoption {
        branch: index,
        position,
    });
    branch.length += 1;
    Ok(entry)
}
