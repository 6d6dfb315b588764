//! Runs, checkpoints, restores and forks: the history side of the replay-or-fork rule.
//!
//! `Restore` rewinds a branch to a checkpoint: it increments the run's epoch (so every caller
//! from before the restore is fenced off) and puts every non-SAFE_RETRY effect the branch
//! recorded after the checkpoint on the branch's replay tape, which [`begin`](super::begin)
//! consumes. `Fork` starts a new branch at a checkpoint; the parent's effects before the fork
//! point are its lineage, and nothing recorded anywhere is ever undone or hidden.
//!
//! Whatever else is done in the world after a checkpoint (the parent's later effects, for a
//! fork; what branches forked from that point did, for a restore or a fork) is *carried* by
//! the branch that goes on from there: a call equivalent to a carried effect is that effect
//! (it replays and is adopted into the branch's log), never a second one, while any other call
//! is judged as usual.

use super::begin::new_run;
use super::records::{
    BranchRecord, CheckpointRecord, EffectRecord, IndexEntry, RestoreRecord, RunRecord,
};
use super::{
    Ledger, LedgerError, MAIN_BRANCH, OpClass, Reason, Recovery, Refusal, Result, check_epoch,
};
use crate::store::keys::{self, RunKey};
use crate::store::{Batch, Store, codec};

/// What a restore has learnt of the causal order around its checkpoint.
struct Causal {
    /// The checkpoint's strict ancestors.
    ancestors: Vec<String>,
    /// Per checkpoint named by an effect: is it the checkpoint or after it?
    memo: std::collections::HashMap<String, bool>,
}

impl Causal {
    fn new(ancestors: Vec<String>) -> Self {
        Self {
            ancestors,
            memo: std::collections::HashMap::new(),
        }
    }
}

/// Adds a newly created run to its tenant's run index (what `ListRuns` reads): in the batch
/// that first writes the run record, so a listed run always exists.
pub(super) fn index_new_run(batch: &mut Batch, tenant: &str, run_id: &str) {
    batch.put(
        keys::tenant_run(&keys::tenant_key(tenant), run_id),
        Vec::new(),
    );
}

/// A run with its checkpoints and restore history.
#[derive(Debug, Clone, PartialEq)]
pub struct RunView {
    /// The run record (epoch, branches, pending tapes).
    pub run: RunRecord,
    /// Checkpoints in creation order.
    pub checkpoints: Vec<CheckpointRecord>,
    /// Restores, oldest first.
    pub restores: Vec<RestoreRecord>,
}

/// What a restore did.
#[derive(Debug, Clone, PartialEq)]
pub struct Restored {
    /// The new epoch.
    pub epoch: u64,
    /// The branch rewound.
    pub branch: String,
    /// The replay tape, in log order.
    pub tape: Vec<EffectRecord>,
}

/// What a fork did.
#[derive(Debug, Clone, PartialEq)]
pub struct Forked {
    /// The new branch.
    pub branch: BranchRecord,
    /// The effects carried onto it (see [`Ledger::fork`]), in the parent's log order, as they
    /// stood when the fork was made.
    pub carried: Vec<EffectRecord>,
}

/// A checkpoint request.
#[derive(Debug, Clone, Default)]
pub struct CheckpointCmd {
    /// Run id.
    pub run_id: String,
    /// Branch ("" = main).
    pub branch: String,
    /// Caller's epoch.
    pub epoch: u64,
    /// Checkpoint name.
    pub checkpoint_id: String,
    /// The checkpoint it follows ("" = none).
    pub parent_checkpoint_id: String,
}

/// A fork request.
#[derive(Debug, Clone, Default)]
pub struct ForkCmd {
    /// Run id.
    pub run_id: String,
    /// The checkpoint the branch starts from.
    pub checkpoint_id: String,
    /// Caller's epoch.
    pub epoch: u64,
    /// New branch name ("" = "fork-N").
    pub new_branch: String,
    /// Why.
    pub reason: String,
}

impl<S: Store> Ledger<S> {
    /// Creates the run if needed; returns it and whether this call created it.
    pub fn start_run(&self, tenant: &str, run_id: &str) -> Result<(RunView, bool)> {
        self.check_id("run_id", run_id)?;
        let rk = keys::run_key(tenant, run_id);
        let _guard = self.runs.lock(&rk);
        let created = match self.load_run(&rk, tenant, run_id)? {
            Some(_) => false,
            None => {
                let run = new_run(tenant, run_id, self.now());
                let mut batch = Batch::new();
                batch.put(keys::run(&rk), codec::encode(&run));
                index_new_run(&mut batch, tenant, run_id);
                self.commit(batch)?;
                true
            }
        };
        Ok((self.run_view(&rk, tenant, run_id)?, created))
    }

    /// A page of the tenant's runs in run-id order (those whose id starts with
    /// `run_id_prefix`), without their checkpoints and restores, and the next page's token
    /// (`""`: done). A page holds `page_size` runs (0 = 100, at most 1000) or fewer when the
    /// byte budget ends it.
    pub fn list_runs(
        &self,
        tenant: &str,
        run_id_prefix: &str,
        page_size: u32,
        page_token: &str,
    ) -> Result<(Vec<RunView>, String)> {
        if !run_id_prefix.is_empty() {
            self.check_id("run_id_prefix", run_id_prefix)?;
        }
        let tk = keys::tenant_key(tenant);
        let from = if page_token.is_empty() {
            run_id_prefix.to_owned()
        } else {
            codec::unhex(page_token)
                .and_then(|b| String::from_utf8(b).ok())
                .ok_or_else(|| {
                    LedgerError::invalid("page_token", "is not a token this server issued")
                })?
        };
        let (runs, next) = self.page(
            &keys::tenant_run_prefix(&tk, run_id_prefix),
            keys::tenant_run(&tk, &from),
            page_size,
            |k, _| {
                let Some(run_id) = keys::decode_tenant_run(k) else {
                    return Ok(None);
                };
                let rk = keys::run_key(tenant, run_id);
                let key = keys::run(&rk);
                let Some(bytes) = self.store.get(&key)? else {
                    return Ok(None);
                };
                let mut run: RunRecord = codec::decode(&key, &bytes)?;
                self.catch_up_run(&rk, &mut run)?;
                let view = RunView {
                    run,
                    checkpoints: Vec::new(),
                    restores: Vec::new(),
                };
                Ok(Some((view, bytes.len())))
            },
        )?;
        let token = next
            .as_deref()
            .and_then(keys::decode_tenant_run)
            .map_or_else(String::new, |id| codec::hex(id.as_bytes()));
        Ok((runs, token))
    }

    /// A run's state, checkpoints and restore history.
    pub fn get_run(&self, tenant: &str, run_id: &str) -> Result<RunView> {
        self.check_id("run_id", run_id)?;
        let rk = keys::run_key(tenant, run_id);
        self.run_view(&rk, tenant, run_id)
    }

    fn run_view(&self, rk: &RunKey, tenant: &str, run_id: &str) -> Result<RunView> {
        let run = self.require_run(rk, tenant, run_id)?;
        let prefix = keys::checkpoint_prefix(rk);
        let mut checkpoints = self
            .store
            .scan(&prefix, &prefix, usize::MAX)?
            .into_iter()
            .map(|(k, v)| codec::decode::<CheckpointRecord>(&k, &v))
            .collect::<Result<Vec<_>, _>>()?;
        checkpoints.sort_by_key(|c| c.ordinal);
        let prefix = keys::restore_prefix(rk);
        let restores = self
            .store
            .scan(&prefix, &prefix, usize::MAX)?
            .into_iter()
            .map(|(k, v)| codec::decode::<RestoreRecord>(&k, &v))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(RunView {
            run,
            checkpoints,
            restores,
        })
    }

    /// Records a checkpoint at the branch's current logical position.
    pub fn checkpoint(
        &self,
        tenant: &str,
        cmd: &CheckpointCmd,
    ) -> Result<(CheckpointRecord, bool)> {
        self.check_id("run_id", &cmd.run_id)?;
        self.check_id("checkpoint_id", &cmd.checkpoint_id)?;
        if !cmd.branch.is_empty() {
            self.check_id("branch", &cmd.branch)?;
        }
        if !cmd.parent_checkpoint_id.is_empty() {
            self.check_id("parent_checkpoint_id", &cmd.parent_checkpoint_id)?;
        }
        let rk = keys::run_key(tenant, &cmd.run_id);
        let _guard = self.runs.lock(&rk);
        let now = self.now();
        let on_main = cmd.branch.is_empty() || cmd.branch == MAIN_BRANCH;
        let (mut run, created) = match self.load_run(&rk, tenant, &cmd.run_id)? {
            Some(run) => (run, false),
            // A framework may checkpoint before the run's first effect.
            None if cmd.epoch <= 1 && on_main => (new_run(tenant, &cmd.run_id, now), true),
            None => return Err(self.require_run(&rk, tenant, &cmd.run_id).unwrap_err()),
        };
        check_epoch(&run, cmd.epoch)?;
        let branch = run
            .branch_index(&cmd.branch)
            .ok_or_else(|| unknown_branch(&cmd.branch))?;
        let key = keys::checkpoint(&rk, &cmd.checkpoint_id);
        if let Some(existing) = self.get::<CheckpointRecord>(&key)? {
            if existing.branch == branch {
                return Ok((existing, false));
            }
            return Err(LedgerError::AlreadyExists {
                field: "checkpoint_id".into(),
                why: format!(
                    "checkpoint {:?} already exists on branch {:?}",
                    cmd.checkpoint_id, existing.branch_name
                ),
            });
        }
        if run.checkpoint_count >= self.config.limits.max_checkpoints_per_run {
            return Err(LedgerError::ResourceExhausted {
                field: "checkpoint_id".into(),
                why: format!(
                    "run {:?} holds the maximum of {} checkpoints",
                    cmd.run_id, self.config.limits.max_checkpoints_per_run
                ),
            });
        }
        let b = &mut run.branches[branch as usize];
        // While a tape is pending the agent is logically at its first unconsumed entry, not at
        // the end of the log: restoring to this checkpoint later must replay from there. And a
        // checkpoint saved late comes before the first effect that named it as its parent.
        let mut position = b.tape_positions.iter().copied().min().unwrap_or(b.length);
        let mut due_seqs: Vec<u64> = b.due_seqs().collect();
        if let Some(i) = b
            .open_steps
            .iter()
            .position(|o| o.checkpoint_id == cmd.checkpoint_id)
        {
            let open = b.open_steps.remove(i);
            position = position.min(open.position);
            // What was due where it belongs, though consumed since, was due at it too.
            for seq in open.due_seqs {
                if !due_seqs.contains(&seq) {
                    due_seqs.push(seq);
                }
            }
        }
        let b = &run.branches[branch as usize];
        let record = CheckpointRecord {
            checkpoint_id: cmd.checkpoint_id.clone(),
            branch,
            position,
            epoch: run.epoch,
            created_at_ms: now,
            ordinal: run.checkpoint_count,
            branch_name: b.name.clone(),
            parent_checkpoint_id: cmd.parent_checkpoint_id.clone(),
            due_seqs,
            log_length: b.length,
        };
        run.checkpoint_count += 1;
        let b = &mut run.branches[branch as usize];
        b.last_checkpoint_position = b.last_checkpoint_position.max(position);
        b.last_checkpoint_id = cmd.checkpoint_id.clone();
        let mut batch = Batch::new();
        batch.put(key, codec::encode(&record));
        batch.put(keys::run(&rk), codec::encode(&run));
        if created {
            index_new_run(&mut batch, tenant, &cmd.run_id);
        }
        self.commit(batch)?;
        Ok((record, true))
    }

    fn require_checkpoint(&self, rk: &RunKey, checkpoint_id: &str) -> Result<CheckpointRecord> {
        self.get::<CheckpointRecord>(&keys::checkpoint(rk, checkpoint_id))?
            .ok_or_else(|| {
                Refusal::new(
                    Reason::UnknownRecord,
                    Recovery::FixArgument,
                    format!("Checkpoint {checkpoint_id:?} does not exist in this run."),
                )
                .into()
            })
    }

    /// Rewinds a branch to a checkpoint: new epoch, new replay tape.
    pub fn restore(
        &self,
        tenant: &str,
        run_id: &str,
        checkpoint_id: &str,
        expected_epoch: u64,
    ) -> Result<Restored> {
        self.check_id("run_id", run_id)?;
        self.check_id("checkpoint_id", checkpoint_id)?;
        let rk = keys::run_key(tenant, run_id);
        let _guard = self.runs.lock(&rk);
        let now = self.now();
        let mut run = self.require_run(&rk, tenant, run_id)?;
        if expected_epoch != 0 {
            check_epoch(&run, expected_epoch)?;
        }
        let cp = self.require_checkpoint(&rk, checkpoint_id)?;
        // Positions come from the log entry: an adopted effect's record holds its position on
        // the branch that recorded it, not on this one.
        let mut after = Vec::new();
        let mut causal = Causal::new(self.ancestors(&rk, &cp)?);
        for (rec, position) in self.branch_log_from(&rk, cp.branch, cp.position)? {
            if self.causally_after(&rk, &rec, &cp, &mut causal)? {
                after.push((rec, position));
            }
        }
        // What was still due when the checkpoint was taken sits before its position in the
        // log (a restore had rewound or carried it). One the agent has re-issued since, on
        // this line (it answered a call named after the checkpoint), is due again like the
        // rest, in log order; the others stay done (see below). One naming no checkpoint
        // cannot be placed after it, so it stays done as before.
        let mut not_reissued = Vec::new();
        for &seq in &cp.due_seqs {
            if after.iter().any(|(r, _)| r.seq == seq) {
                continue;
            }
            let rec = self.load_seq(&rk, seq)?;
            match rec.log_position(cp.branch) {
                Some(position)
                    if !rec.parent_checkpoint_id.is_empty()
                        && self.causally_after(&rk, &rec, &cp, &mut causal)? =>
                {
                    // Its place is after the checkpoint, where it was re-issued: the agent
                    // restored there is at the checkpoint, not before it (a checkpoint saved
                    // while it is due must not sit before this one).
                    after.push((rec, position.max(cp.position)));
                }
                _ => not_reissued.push(seq),
            }
        }
        // An entry a fork's effect took the place of on this line, that effect adopted here
        // after the checkpoint too, is done, not due: the agent followed the fork at that step.
        // It took that entry's place in the line, too: the tape holds it where the entry was
        // (an entry precedes what supersedes it, so in sequence order a chain of them ends at
        // the first one's place).
        after.sort_by_key(|(r, _)| r.seq);
        let mut superseded = Vec::new();
        for i in 0..after.len() {
            let (done, later) = after.split_at_mut(i);
            let taker = &mut later[0];
            // Only a fork's first new effect supersedes: the common tape does no search.
            if taker.0.supersedes.is_none() {
                continue;
            }
            if let Some((replaced, place)) = done.iter().find(|(r, _)| taker.0.took_place_of(r)) {
                superseded.push(replaced.seq);
                taker.1 = *place;
            }
        }
        after.retain(|(r, _)| {
            let keep = !superseded.contains(&r.seq);
            if !keep {
                not_reissued.push(r.seq);
            }
            keep
        });
        after.sort_by_key(|(_, position)| *position);
        let (tape, positions): (Vec<EffectRecord>, Vec<u64>) = after.into_iter().unzip();
        // What other branches did after the checkpoint stays done too: carried, so that an
        // equivalent call replays it (the tape itself stays this branch's own log, in order).
        let lineage = run.lineage(cp.branch);
        let alternatives: Vec<(u64, u32)> = self
            .done_after(&rk, &run, cp.branch, cp.position)?
            .into_iter()
            .filter(|(rec, _)| !rec.visible_on(&lineage))
            .map(|(rec, source)| (rec.seq, source))
            .collect();
        run.epoch += 1;
        let branch = &mut run.branches[cp.branch as usize];
        for (seq, source) in alternatives {
            branch.carry(seq, source);
        }
        // What was still due when the checkpoint was taken (rewound by an earlier restore or
        // carried, not re-issued yet) stays done: the agent back at the checkpoint has not
        // re-issued it either. The causal tape holds those re-issued after the checkpoint; the
        // rest were made on a line the checkpoint is not after, so they are carried, not due:
        // an equivalent call replays one, and no other call is refused for them (one may have
        // been superseded since, e.g. by a fork's effect the agent followed instead). They sit
        // in this branch's log or are carried already, so this branch's indexes hold them.
        // (What the log holds past the checkpoint on a line that left the checkpoint's history
        // before it, and was not due there, is neither: like a fork from before the restore
        // point, that line is not the agent's.)
        for seq in not_reissued {
            branch.carry(seq, cp.branch);
        }
        // The agent is back at the checkpoint: that is where its causal step starts.
        branch.last_checkpoint_position = cp.position;
        branch.tape_seqs = tape.iter().map(|r| r.seq).collect();
        branch.tape_positions = positions;
        branch.restored_from_checkpoint = if tape.is_empty() {
            String::new()
        } else {
            checkpoint_id.to_owned()
        };
        let event = RestoreRecord {
            epoch: run.epoch,
            checkpoint_id: checkpoint_id.to_owned(),
            branch: cp.branch,
            tape_seqs: branch.tape_seqs.clone(),
            at_ms: now,
            branch_name: branch.name.clone(),
        };
        let branch_name = branch.name.clone();
        let mut batch = Batch::new();
        batch.put(keys::restore(&rk, run.epoch), codec::encode(&event));
        batch.put(keys::run(&rk), codec::encode(&run));
        self.commit(batch)?;
        Ok(Restored {
            epoch: run.epoch,
            branch: branch_name,
            tape: tape.into_iter().map(|r| r.into_view(now)).collect(),
        })
    }

    /// `cp`'s strict ancestors by the recorded parent links, nearest first.
    fn ancestors(&self, rk: &RunKey, cp: &CheckpointRecord) -> Result<Vec<String>> {
        let mut out: Vec<String> = Vec::new();
        let mut parent = cp.parent_checkpoint_id.clone();
        // Each hop reads one checkpoint; the chain is at most the run's checkpoint count.
        while !parent.is_empty()
            && !out.contains(&parent)
            && out.len() <= self.config.limits.max_checkpoints_per_run as usize
        {
            let next = self
                .get::<CheckpointRecord>(&keys::checkpoint(rk, &parent))?
                .map(|c| c.parent_checkpoint_id);
            out.push(parent);
            parent = next.unwrap_or_default();
        }
        Ok(out)
    }

    /// Is `rec` (in the log after `cp`'s position) after `cp` in the run's causal history?
    /// Yes unless every checkpoint it is known to descend from (the one its call named, and
    /// those of the calls it answered as a replay since) has a recorded ancestry showing it
    /// is not after `cp`: then the effect happened before `cp` and only arrived after it (the
    /// framework saved `cp` late, or the effect's report was slow), or on a line beside it.
    /// An effect naming nothing, or a checkpoint not recorded, is placed by arrival (when
    /// unsure, it stays on the tape: fail closed).
    fn causally_after(
        &self,
        rk: &RunKey,
        rec: &EffectRecord,
        cp: &CheckpointRecord,
        causal: &mut Causal,
    ) -> Result<bool> {
        if rec.parent_checkpoint_id.is_empty() {
            return Ok(true);
        }
        for named in std::iter::once(&rec.parent_checkpoint_id).chain(&rec.answered_steps) {
            if self.descends_from(rk, named, cp, causal)? {
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// Is checkpoint `named` `cp` or after it, by the recorded parent links (see
    /// [`causally_after`](Self::causally_after))? Parent links form a tree, so a chain from
    /// `named` that meets one of `cp`'s ancestors before `cp` itself branches off before `cp`:
    /// `named` is before it or beside it, not after.
    fn descends_from(
        &self,
        rk: &RunKey,
        named: &str,
        cp: &CheckpointRecord,
        causal: &mut Causal,
    ) -> Result<bool> {
        if named == cp.checkpoint_id {
            return Ok(true);
        }
        if let Some(&known) = causal.memo.get(named) {
            return Ok(known);
        }
        let mut answer = true;
        let mut cur = named.to_owned();
        for _ in 0..=self.config.limits.max_checkpoints_per_run {
            if causal.ancestors.contains(&cur) {
                answer = false;
                break;
            }
            match self.get::<CheckpointRecord>(&keys::checkpoint(rk, &cur))? {
                // Not recorded (yet): nothing says it is before `cp`; fail closed.
                None => break,
                Some(c) if c.parent_checkpoint_id == cp.checkpoint_id => break,
                // The chain's start, or a checkpoint recorded without its parent: judged by
                // its place in the log, which a late save can only make earlier.
                Some(c) if c.parent_checkpoint_id.is_empty() => {
                    answer = c.branch != cp.branch
                        || (c.position, c.ordinal) > (cp.position, cp.ordinal);
                    break;
                }
                Some(c) => cur = c.parent_checkpoint_id,
            }
        }
        causal.memo.insert(named.to_owned(), answer);
        Ok(answer)
    }

    /// The non-SAFE_RETRY effects in `branch`'s log from `position` on, with their positions
    /// in that log (read-only calls are never matched against a tape, so they never sit on one).
    fn branch_log_from(
        &self,
        rk: &RunKey,
        branch: u32,
        position: u64,
    ) -> Result<Vec<(EffectRecord, u64)>> {
        let prefix = keys::branch_log_prefix(rk, branch);
        let from = keys::branch_log(rk, branch, position);
        let mut out = Vec::new();
        for (k, v) in self.store.scan(&prefix, &from, usize::MAX)? {
            let entry: IndexEntry = codec::decode(&k, &v)?;
            let rec = self.load_seq(rk, entry.seq)?;
            if rec.class() != OpClass::SafeRetry {
                out.push((rec, entry.position));
            }
        }
        Ok(out)
    }

    /// Starts a new branch at a checkpoint. Repeating an identical fork returns the branch.
    ///
    /// A fork never undoes anything: what the parent recorded after the fork point is done in
    /// the world, so it is *carried* onto the new branch (with what the parent itself still
    /// carries). A call on the new branch equivalent to a carried effect replays it instead of
    /// doing it a second time; any other call is a new effect, as a fork is the explicit
    /// divergence.
    pub fn fork(&self, tenant: &str, cmd: &ForkCmd) -> Result<Forked> {
        self.check_id("run_id", &cmd.run_id)?;
        self.check_id("checkpoint_id", &cmd.checkpoint_id)?;
        if !cmd.new_branch.is_empty() {
            self.check_id("new_branch", &cmd.new_branch)?;
        }
        self.check_len(
            "reason",
            cmd.reason.len(),
            self.config.limits.max_detail_bytes,
        )?;
        let rk = keys::run_key(tenant, &cmd.run_id);
        let _guard = self.runs.lock(&rk);
        let now = self.now();
        let mut run = self.require_run(&rk, tenant, &cmd.run_id)?;
        check_epoch(&run, cmd.epoch)?;
        let cp = self.require_checkpoint(&rk, &cmd.checkpoint_id)?;
        let name = if cmd.new_branch.is_empty() {
            format!("fork-{}", run.branches.len())
        } else {
            cmd.new_branch.clone()
        };
        if let Some(i) = run.branch_index(&name) {
            let existing = &run.branches[i as usize];
            if existing.parent == Some(cp.branch)
                && existing.forked_from_checkpoint == cp.checkpoint_id
            {
                let carried = self.load_seqs(&rk, &existing.carried_seqs, now)?;
                return Ok(Forked {
                    branch: existing.clone(),
                    carried,
                });
            }
            return Err(LedgerError::AlreadyExists {
                field: "new_branch".into(),
                why: format!("branch {name:?} already exists with another origin"),
            });
        }
        if run.branches.len() >= self.config.limits.max_branches_per_run {
            return Err(LedgerError::ResourceExhausted {
                field: "new_branch".into(),
                why: format!(
                    "run {:?} holds the maximum of {} branches",
                    cmd.run_id, self.config.limits.max_branches_per_run
                ),
            });
        }
        // Carried: the parent's log from the fork point (its own effects and those it adopted),
        // then everything else done after that point: see `done_after`. Except what the agent
        // had re-issued before the checkpoint while a tape was due (it sits in the log past the
        // checkpoint's position, which is the first due entry's): that is on the new branch's
        // line, so it is adopted into its log instead.
        let mut carried: Vec<(EffectRecord, u32)> = Vec::new();
        let mut reissued: Vec<EffectRecord> = Vec::new();
        let mut causal = Causal::new(self.ancestors(&rk, &cp)?);
        for (rec, position) in self.branch_log_from(&rk, cp.branch, cp.position)? {
            if position < cp.log_length
                && !cp.due_seqs.contains(&rec.seq)
                && !self.causally_after(&rk, &rec, &cp, &mut causal)?
            {
                reissued.push(rec);
            } else {
                carried.push((rec, cp.branch));
            }
        }
        let mut lineage = run.lineage(cp.branch);
        // The new branch's lineage: the parent up to the fork point, then its ancestors.
        lineage[0].1 = cp.position;
        for (rec, source) in self.done_after(&rk, &run, cp.branch, cp.position)? {
            if !rec.visible_on(&lineage)
                && !carried.iter().any(|(r, _)| r.seq == rec.seq)
                && !reissued.iter().any(|r| r.seq == rec.seq)
            {
                carried.push((rec, source));
            }
        }
        // Forked, while entries are due on the parent, from a checkpoint they were due at (the
        // one the parent was restored to, or one saved since): the agent was refused for the
        // first of them and forks to do something else in its place.
        let parent = &run.branches[cp.branch as usize];
        let fork_replaces = parent.tape_seqs.first().copied().filter(|head| {
            parent.restored_from_checkpoint == cp.checkpoint_id || cp.due_seqs.contains(head)
        });
        let mut branch = BranchRecord {
            name,
            fork_replaces,
            parent: Some(cp.branch),
            fork_position: cp.position,
            forked_from_checkpoint: cp.checkpoint_id.clone(),
            reason: cmd.reason.clone(),
            created_epoch: run.epoch,
            created_at_ms: now,
            carried_seqs: carried.iter().map(|(r, _)| r.seq).collect(),
            carried_sources: carried.iter().map(|(_, s)| *s).collect(),
            ..Default::default()
        };
        let mut batch = Batch::new();
        let index = run.branches.len() as u32;
        // The re-issued effects open the new branch's log, in the parent's order, indexed by
        // step key and intent there (the n-th of an intent as its n-th occurrence).
        let mut occurrences: std::collections::HashMap<Vec<u8>, u32> =
            std::collections::HashMap::new();
        for mut rec in reissued {
            let n = occurrences.entry(rec.intent_fp.clone()).or_insert(0);
            *n += 1;
            let entry = super::append_adopted(&mut batch, &rk, index, &mut branch, &mut rec, *n)?;
            if !rec.step_key.is_empty() {
                batch.put(keys::step(&rk, index, &rec.step_key), entry);
            }
            batch.put(keys::effect(&rk, rec.seq), codec::encode(&rec));
        }
        run.branches.push(branch.clone());
        batch.put(keys::run(&rk), codec::encode(&run));
        self.commit(batch)?;
        Ok(Forked {
            branch,
            carried: carried.into_iter().map(|(r, _)| r.into_view(now)).collect(),
        })
    }

    /// What else is done in the world after `position` on `branch`, besides that branch's own
    /// log: what the branch still carries, and the whole history of every branch forked from
    /// it at or after that position (and of everything forked from those), with the branch
    /// whose indexes hold each effect. An agent that comes back to that point has abandoned
    /// those lines of history, but not their effects. SAFE_RETRY calls are left out.
    fn done_after(
        &self,
        rk: &RunKey,
        run: &RunRecord,
        branch: u32,
        position: u64,
    ) -> Result<Vec<(EffectRecord, u32)>> {
        let mut out: Vec<(EffectRecord, u32)> = Vec::new();
        let push = |rec: EffectRecord, source: u32, out: &mut Vec<(EffectRecord, u32)>| {
            if rec.class() != OpClass::SafeRetry && !out.iter().any(|(r, _)| r.seq == rec.seq) {
                out.push((rec, source));
            }
        };
        let own = &run.branches[branch as usize];
        for (seq, source) in own.carried() {
            push(self.load_seq(rk, seq)?, source, &mut out);
        }
        // A child always has a higher index than its parent, so one pass finds every
        // descendant.
        let mut abandoned = vec![false; run.branches.len()];
        for (i, b) in run.branches.iter().enumerate() {
            abandoned[i] = match b.parent {
                Some(p) if p == branch => b.fork_position >= position,
                Some(p) => abandoned[p as usize],
                None => false,
            };
            if !abandoned[i] {
                continue;
            }
            for (rec, _) in self.branch_log_from(rk, i as u32, 0)? {
                push(rec, i as u32, &mut out);
            }
            for (seq, source) in b.carried() {
                push(self.load_seq(rk, seq)?, source, &mut out);
            }
        }
        Ok(out)
    }

    fn load_seqs(&self, rk: &RunKey, seqs: &[u64], now: u64) -> Result<Vec<EffectRecord>> {
        seqs.iter()
            .map(|&s| Ok(self.load_seq(rk, s)?.into_view(now)))
            .collect()
    }
}

fn unknown_branch(name: &str) -> LedgerError {
    Refusal::new(
        Reason::UnknownRecord,
        Recovery::FixArgument,
        format!("Branch {name:?} does not exist in this run."),
    )
    .into()
}
