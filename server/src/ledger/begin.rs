//! Begin: the replay-or-fork decision.
//!
//! A call is matched, in this order:
//! 1. against the branch's pending replay tape (after a restore): by step key, else by intent
//!    fingerprint, the n-th identical intent matching the n-th recorded one;
//! 2. against the branch lineage (the branch and its ancestors up to each fork point): a known
//!    step key with the same intent is the same effect, with another intent ARGUMENT_MISMATCH;
//! 3. a repeat of an intent within the call's causal step, under no key or a new one, is that
//!    call again (a suspected duplicate once completed; DEDUPLICATE tools replay it), unless
//!    the effect is due here again (carried by a restore to a checkpoint before the call it
//!    answered): then it is the re-issued call, answered as in 4;
//! 4. against the effects carried onto the branch (done after a fork point, or due when the
//!    checkpoint restored to was taken; see [`Ledger::fork`]): by step key where the lineage
//!    does not know it, else by intent, the earliest first. An equivalent call replays the
//!    carried effect and adopts it into this branch's log; a different one is simply new (the
//!    fork was the explicit divergence);
//! 5. without a step key, an identical intent anywhere on the lineage is a suspected
//!    duplicate;
//! 6. while a tape is pending, a call that matched nothing is divergent: FORK_REQUIRED.
//!
//! A matched effect is answered from its state (replay, in progress, re-grant, reconcile).
//! Anything that would record a new effect, or refuse as duplicate or divergent, first passes
//! the credential gate: a spent credential refuses, unless the call is the exact replay of the
//! effect that spent it. The new effect, its indexes, the run and the credentials' uses are one
//! atomic batch.

use serde_json::Value;

use super::index_filter;
use super::messages;
use super::records::{
    BranchRecord, CredentialRecord, EffectRecord, EffectRef, IndexEntry, OpenStep, RunRecord,
};
use super::tools::{Fingerprints, Tool, note_tool_version};
use super::{
    BeginCmd, Decision, EffectId, Ledger, LedgerError, MAIN_BRANCH, OpClass, Reason, Recovery,
    Refusal, Result, State, check_epoch,
};
use crate::canonical::{self, Fingerprint};
use crate::store::keys::{self, RunKey};
use crate::store::{Batch, Store, codec};

/// How many named but not yet recorded checkpoints a branch remembers.
const MAX_OPEN_STEPS: usize = 64;
/// How many other causal steps an effect remembers answering (see
/// `EffectRecord::answered_steps`).
const MAX_ANSWERED_STEPS: usize = 16;

/// The answer to a Begin and the run's current epoch (0 if the run does not exist).
#[derive(Debug, Clone, PartialEq)]
pub struct Begun {
    /// The decision.
    pub decision: Decision,
    /// The run's current epoch.
    pub epoch: u64,
}

/// A validated call and what the decision needs about it.
struct Call<'a> {
    tenant: &'a str,
    cmd: &'a BeginCmd,
    rk: RunKey,
    run: RunRecord,
    /// The run is created by this call (its record is not stored yet).
    new: bool,
    branch: u32,
    tool: std::sync::Arc<Tool>,
    /// The call's fingerprints by tool version (those its run holds effects of, and the
    /// current one).
    fps: Fingerprints,
    /// The parsed arguments.
    args: &'a Value,
    request_fp: Fingerprint,
    credential_hashes: &'a [[u8; 32]],
    compensates_seq: u64,
    now: u64,
    /// The step key's name key, derived once (a call looks its step up and indexes it);
    /// `None` for a call without a step key.
    step_name: Option<keys::NameKey>,
}

impl Call<'_> {
    /// The key of the call's step key in branch `b`'s step index.
    fn step_index_key(&self, b: u32) -> Vec<u8> {
        keys::step_named(&self.rk, b, &self.step_name())
    }

    /// The step key's name key.
    fn step_name(&self) -> keys::NameKey {
        self.step_name
            .unwrap_or_else(|| keys::name_key(&self.cmd.step_key))
    }

    fn class(&self) -> OpClass {
        self.tool.class()
    }

    fn fp(&self) -> &Fingerprint {
        self.fps.current()
    }

    /// Is `rec` the same intent as this call, judged under the schema version `rec` was
    /// fingerprinted with?
    fn same_intent(&self, rec: &EffectRecord) -> bool {
        rec.tool == self.tool.record.name
            && self
                .fps
                .get(rec.tool_version)
                .is_some_and(|fp| fp[..] == rec.intent_fp[..])
    }

    fn branch(&self) -> &BranchRecord {
        &self.run.branches[self.branch as usize]
    }

    /// Is `rec` (held by branch `b`'s index at `position`) in this call's causal step? When
    /// both name the checkpoint they descend from, the same one; otherwise both on this
    /// branch with no checkpoint between them.
    fn same_causal_step(&self, rec: &EffectRecord, b: u32, position: u64) -> bool {
        match (&self.cmd.parent_checkpoint_id, &rec.parent_checkpoint_id) {
            (p, q) if !p.is_empty() && !q.is_empty() => p == q || rec.answered_steps.contains(p),
            _ => self.after_last_checkpoint(b, position),
        }
    }

    /// Is the index entry of branch `b` at `position` in this branch's log after its latest
    /// checkpoint (the causal step of a call that names no checkpoint)?
    fn after_last_checkpoint(&self, b: u32, position: u64) -> bool {
        b == self.branch && position >= self.branch().last_checkpoint_position
    }

    /// Is the effect visible on this call's lineage?
    fn visible(&self, rec: &EffectRecord) -> bool {
        rec.visible_on(&self.run.lineage(self.branch))
    }

    /// Where the effect `seq`, known to be this call's, was found.
    fn via(&self, seq: u64) -> Via {
        let branch = self.branch();
        if branch.tape_seqs.contains(&seq) {
            Via::Tape
        } else if branch.carried_seqs.contains(&seq) {
            Via::Carried
        } else {
            Via::Lineage
        }
    }
}

/// Where a matched effect was found, which says what answering it changes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Via {
    /// On the call's lineage: nothing.
    Lineage,
    /// On the branch's pending replay tape: the entry is consumed.
    Tape,
    /// Carried onto this fork from its parent: the effect is adopted into the branch's log.
    Carried,
}

/// How a call relates to what is recorded.
enum Match {
    /// The same effect.
    Existing { rec: EffectRecord, via: Via },
    /// Its step key is recorded with another intent.
    Mismatch(EffectRecord),
    /// Its intent is recorded and it has no step key.
    Duplicate(EffectRecord),
    /// A tape is pending and this call is not on it.
    Divergent(EffectRecord),
    /// Nothing matches: a new effect, the n-th of its intent on the lineage.
    New { occurrence: u32 },
}

/// What the credential gate found.
enum Gate {
    /// Every credential may be spent; the records to update.
    Pass(Vec<CredentialRecord>),
    /// A spent credential presented by the exact replay of the effect that spent it.
    ExactReplay(Box<EffectRecord>),
    /// Refused.
    Refused(Refusal),
}

/// A Begin's work that needs no run state: validated, its arguments parsed, its keys and
/// hashes derived, and its fingerprint under the tool's current version (as cached) computed.
/// [`Ledger::prepare_begin`] does it on the caller's thread, so that the run's sequencer,
/// which every call of the run waits on, only decides.
pub struct PreparedBegin {
    cmd: BeginCmd,
    args: Value,
    rk: RunKey,
    compensates_seq: u64,
    credential_hashes: Vec<[u8; 32]>,
    request_fp: Fingerprint,
    /// The step key's name key (`None` for a call without a step key).
    step_name: Option<keys::NameKey>,
    /// The call's fingerprint under the tool version the cache held as current; the decision
    /// uses it only if that version is still current then.
    fingerprint: Option<(u32, Fingerprint)>,
}

impl PreparedBegin {
    /// The call.
    pub fn cmd(&self) -> &BeginCmd {
        &self.cmd
    }

    /// Its run's sequencer route ([`crate::sequencer::route_of`]).
    pub fn route(&self) -> u64 {
        crate::sequencer::route_of_key(&self.rk)
    }
}

impl<S: Store> Ledger<S> {
    /// Validates a Begin and derives what needs no run state ([`PreparedBegin`]). Reads
    /// nothing from the store: it may run on any thread.
    pub fn prepare_begin(&self, tenant: &str, cmd: BeginCmd) -> Result<PreparedBegin> {
        let args = self.validate_begin(&cmd)?;
        let rk = keys::run_key(tenant, &cmd.run_id);
        let compensates_seq = self.compensates_seq(&cmd, &rk)?;
        let credential_hashes = cmd
            .credentials
            .iter()
            .map(|c| self.credential_hash(tenant, &c.token))
            .collect();
        let fingerprint = self
            .cached_current_tool(tenant, &cmd.tool)
            .map(|tool| (tool.record.version, tool.fingerprint(&args)));
        Ok(PreparedBegin {
            request_fp: canonical::request_fingerprint(&cmd.tool, &cmd.arguments_json),
            step_name: (!cmd.step_key.is_empty()).then(|| keys::name_key(&cmd.step_key)),
            args,
            rk,
            compensates_seq,
            credential_hashes,
            fingerprint,
            cmd,
        })
    }

    /// Decides a prepared Begin (see [`Ledger::begin`]).
    pub fn begin_prepared(&self, tenant: &str, prepared: &PreparedBegin) -> Result<Begun> {
        let mut epoch = 0;
        let decision = self.decide(tenant, prepared, &mut epoch)?;
        Ok(Begun { decision, epoch })
    }

    /// Decides one call of a tool. See the module docs for the order of the rules.
    pub fn begin(&self, tenant: &str, cmd: &BeginCmd) -> Result<Begun> {
        self.begin_prepared(tenant, &self.prepare_begin(tenant, cmd.clone())?)
    }

    fn decide(&self, tenant: &str, prepared: &PreparedBegin, epoch: &mut u64) -> Result<Decision> {
        let cmd = &prepared.cmd;
        let rk = prepared.rk;
        let _run_guard = self.runs.lock(&rk);
        let now = self.now();
        let (run, new) = match self.take_run(&rk, tenant, &cmd.run_id)? {
            Some(run) => (run, false),
            None if cmd.epoch <= 1 && (cmd.branch.is_empty() || cmd.branch == MAIN_BRANCH) => {
                (new_run(tenant, &cmd.run_id, now), true)
            }
            None => {
                return Ok(Refusal::new(
                    Reason::UnknownRecord,
                    Recovery::FixArgument,
                    format!(
                        "Run {:?} does not exist; start it on branch \"main\" at epoch 1.",
                        cmd.run_id
                    ),
                )
                .into());
            }
        };
        *epoch = run.epoch;
        if let Err(refusal) = check_epoch(&run, cmd.epoch) {
            return Ok(refusal.into());
        }
        let Some(branch) = run.branch_index(&cmd.branch) else {
            return Ok(Refusal::new(
                Reason::UnknownRecord,
                Recovery::FixArgument,
                format!(
                    "Branch {:?} does not exist in run {:?}.",
                    cmd.branch, cmd.run_id
                ),
            )
            .into());
        };

        let tool = self.current_tool(tenant, &cmd.tool)?;
        let fps = self.fingerprints(
            tenant,
            &tool,
            &prepared.args,
            Some(&run),
            prepared.fingerprint,
        )?;
        let call = Call {
            tenant,
            cmd,
            rk,
            run,
            new,
            branch,
            request_fp: prepared.request_fp,
            tool,
            fps,
            args: &prepared.args,
            credential_hashes: &prepared.credential_hashes,
            compensates_seq: prepared.compensates_seq,
            now,
            step_name: prepared.step_name,
        };

        if call.class() == OpClass::SafeRetry && !cmd.record && cmd.credentials.is_empty() {
            // Read-only and not asked to record: nothing to write, nothing to fence.
            let rec = self.new_effect_record(&call, 0, 1);
            return Ok(Decision::Execute {
                receipt: Box::new(rec),
                recorded: false,
            });
        }

        self.ensure_index_filter(&rk)?;
        match self.match_call(&call)? {
            Match::Existing { rec, via } => self.answer_existing(call, rec, via),
            Match::Mismatch(rec) => {
                let view = rec.view(now);
                if view.tombstone {
                    return Ok(expired(view).into());
                }
                Ok(Refusal::new(
                    Reason::ArgumentMismatch,
                    Recovery::FixArgument,
                    messages::ARGUMENT_MISMATCH,
                )
                .with_receipt(view)
                .into())
            }
            other => {
                let tk = (!call.credential_hashes.is_empty()).then(|| keys::tenant_key(tenant));
                let cred_keys: Vec<Vec<u8>> = tk
                    .iter()
                    .flat_map(|tk| {
                        call.credential_hashes
                            .iter()
                            .map(|h| keys::credential(tk, h))
                    })
                    .collect();
                let refs: Vec<&[u8]> = cred_keys.iter().map(Vec::as_slice).collect();
                let _cred_guards = self.credentials.lock_many(&refs);
                let creds = match self.credential_gate(&call)? {
                    Gate::Pass(creds) => creds,
                    Gate::ExactReplay(rec) => {
                        let via = call.via(rec.seq);
                        return self.answer_existing(call, *rec, via);
                    }
                    Gate::Refused(refusal) => return Ok(refusal.into()),
                };
                match other {
                    Match::Duplicate(rec) => {
                        let view = rec.view(now);
                        if view.tombstone {
                            return Ok(expired(view).into());
                        }
                        Ok(Refusal::new(
                            Reason::DuplicateIntent,
                            Recovery::ConfirmRepeat,
                            messages::DUPLICATE_INTENT,
                        )
                        .with_receipt(view)
                        .into())
                    }
                    Match::Divergent(rec) => {
                        let mut r = Refusal::new(
                            Reason::ForkRequired,
                            Recovery::Fork,
                            messages::FORK_REQUIRED,
                        )
                        .with_receipt(rec.view(now));
                        r.checkpoint_id = call.branch().restored_from_checkpoint.clone();
                        Ok(r.into())
                    }
                    Match::New { occurrence } => self.record_new(call, occurrence, creds),
                    Match::Existing { .. } | Match::Mismatch(_) => {
                        unreachable!("answered above")
                    }
                }
            }
        }
    }

    fn validate_begin(&self, cmd: &BeginCmd) -> Result<Value> {
        let limits = &self.config.limits;
        self.check_id("run_id", &cmd.run_id)?;
        if !cmd.branch.is_empty() {
            self.check_id("branch", &cmd.branch)?;
        }
        self.check_id("tool", &cmd.tool)?;
        if !cmd.step_key.is_empty() {
            self.check_id("step_key", &cmd.step_key)?;
        }
        if !cmd.saga_id.is_empty() {
            self.check_id("saga_id", &cmd.saga_id)?;
        }
        if !cmd.request_id.is_empty() {
            self.check_id("request_id", &cmd.request_id)?;
        }
        if !cmd.parent_checkpoint_id.is_empty() {
            self.check_id("parent_checkpoint_id", &cmd.parent_checkpoint_id)?;
        }
        self.check_len(
            "arguments_json",
            cmd.arguments_json.len(),
            limits.max_arguments_bytes,
        )?;
        let args = canonical::parse_arguments(&cmd.arguments_json)
            .map_err(|e| LedgerError::invalid("arguments_json", e.to_string()))?;
        if cmd.lease_ms > self.config.max_lease_ms {
            return Err(LedgerError::invalid(
                "lease_ms",
                format!(
                    "exceeds the maximum lease of {} ms",
                    self.config.max_lease_ms
                ),
            ));
        }
        if cmd.credentials.len() > limits.max_credentials_per_call {
            return Err(LedgerError::invalid(
                "credentials",
                format!(
                    "{} credentials; the limit is {}",
                    cmd.credentials.len(),
                    limits.max_credentials_per_call
                ),
            ));
        }
        for (i, c) in cmd.credentials.iter().enumerate() {
            let field = format!("credentials[{i}].token");
            if c.token.is_empty() {
                return Err(LedgerError::invalid(field, "must not be empty"));
            }
            self.check_len(&field, c.token.len(), limits.max_token_bytes)?;
            if cmd.credentials[..i].iter().any(|p| p.token == c.token) {
                return Err(LedgerError::invalid(field, "is presented twice"));
            }
        }
        if let Some((tool, arguments)) = &cmd.compensation {
            self.check_id("compensation.tool", tool)?;
            self.check_len(
                "compensation.arguments_json",
                arguments.len(),
                limits.max_arguments_bytes,
            )?;
            canonical::parse_arguments(arguments)
                .map_err(|e| LedgerError::invalid("compensation.arguments_json", e.to_string()))?;
        }
        Ok(args)
    }

    /// The effect a compensation undoes: it must be an effect of the same run.
    fn compensates_seq(&self, cmd: &BeginCmd, rk: &RunKey) -> Result<u64> {
        if cmd.compensates_effect_id.is_empty() {
            return Ok(0);
        }
        let id: EffectId = cmd
            .compensates_effect_id
            .parse()
            .map_err(|why: &str| LedgerError::invalid("compensates_effect_id", why))?;
        if id.run_key != *rk {
            return Err(LedgerError::invalid(
                "compensates_effect_id",
                "must be an effect of the same run",
            ));
        }
        Ok(id.seq)
    }

    fn match_call(&self, call: &Call<'_>) -> Result<Match> {
        if call.class() == OpClass::SafeRetry {
            // Read-only calls are recorded for audit only; they never replay or refuse.
            let (count, _) = self.lineage_intent(call)?;
            return Ok(Match::New {
                occurrence: count + 1,
            });
        }
        let tape = &call.branch().tape_seqs;
        // Tape entries are in this branch's log, so its own indexes find them (adopted ones too).
        let here = [call.branch];
        // 1. The call's own step: on the tape, else on the lineage.
        if !call.cmd.step_key.is_empty() {
            if !tape.is_empty()
                && let Some(seq) = self.step_entry_among(call, &here, tape)?
            {
                let rec = self.load_seq(&call.rk, seq)?;
                return Ok(if call.same_intent(&rec) {
                    Match::Existing {
                        rec,
                        via: Via::Tape,
                    }
                } else {
                    Match::Divergent(rec)
                });
            }
            if let Some(m) = self.match_step(call)? {
                return Ok(m);
            }
        }
        // 2. A due tape entry of the same intent, the n-th identical intent matching the n-th
        //    recorded one, whatever step key the call carries: frameworks mint new keys after
        //    time travel, and restore matches as a fork does (the new key becomes an alias).
        if !tape.is_empty()
            && let Some(seq) = self.earliest_intent_among(call, &here, tape, None)?
        {
            return Ok(Match::Existing {
                rec: self.load_seq(&call.rk, seq)?,
                via: Via::Tape,
            });
        }
        // 3. A repeat within the call's causal step, under no key or a new one: a retry of a
        //    call this step already made is that call, before anything else could answer it.
        let (count, same_step, latest) = self.repeated_intent(call)?;
        if let Some(rec) = same_step {
            // Unless that effect is due here again (a restore to a checkpoint before the
            // call it answered carried it): then this is that call re-issued, and the due
            // effect answers it, as a tape entry would.
            if call.branch().carried_seqs.contains(&rec.seq)
                && let Some(m) = self.match_carried(call)?
            {
                return Ok(m);
            }
            if let Some(m) = self.answer_repeat(call, rec) {
                return Ok(m);
            }
        }
        // 4. What abandoned lines of history did (see `match_carried`).
        if let Some(m) = self.match_carried(call)? {
            return Ok(m);
        }
        // 5. Without a key, a repeat of an intent anywhere on the lineage.
        if call.cmd.step_key.is_empty()
            && let Some(rec) = latest
            && let Some(m) = self.answer_repeat(call, rec)
        {
            return Ok(m);
        }
        if let Some(&due) = tape.first() {
            // A recorded effect is due and this call is not it: fail closed.
            return Ok(Match::Divergent(self.load_seq(&call.rk, due)?));
        }
        Ok(Match::New {
            occurrence: count + 1,
        })
    }

    /// The effect the call's step key names on its lineage, if any.
    fn match_step(&self, call: &Call<'_>) -> Result<Option<Match>> {
        let name = call.step_name();
        for (b, limit) in call.run.lineage(call.branch) {
            let key = keys::step_named(&call.rk, b, &name);
            if !self.index_may_hold(&call.rk, index_filter::step_tag(b, &name), &key)? {
                continue;
            }
            if let Some(entry) = self.get::<IndexEntry>(&key)?
                && entry.position < limit
            {
                let rec = self.load_seq(&call.rk, entry.seq)?;
                return Ok(Some(if call.same_intent(&rec) {
                    Match::Existing {
                        rec,
                        via: Via::Lineage,
                    }
                } else {
                    Match::Mismatch(rec)
                }));
            }
        }
        Ok(None)
    }

    /// How many effects of the call's intent its lineage holds, the latest one in the call's
    /// causal step (descending from the same checkpoint, or with no checkpoint between
    /// them), and the latest one anywhere on the lineage. DEDUPLICATE calls under their own
    /// key are new effects by definition, so they have neither.
    fn repeated_intent(
        &self,
        call: &Call<'_>,
    ) -> Result<(u32, Option<EffectRecord>, Option<EffectRecord>)> {
        let entries = self.lineage_intent_entries(&call.rk, &call.run, call.branch, &call.fps)?;
        let count = entries.len() as u32;
        if !call.cmd.step_key.is_empty() && call.class() == OpClass::Deduplicate {
            return Ok((count, None, None));
        }
        let mut latest_first = entries;
        latest_first.sort_unstable_by_key(|(_, e)| std::cmp::Reverse(e.seq));
        // A call naming no checkpoint is placed by position alone: only the record that is
        // answered is read (the common path makes no extra reads).
        let positional = call.cmd.parent_checkpoint_id.is_empty();
        let mut latest = None;
        for (b, entry) in latest_first {
            if positional && !call.after_last_checkpoint(b, entry.position) {
                if latest.is_none() && call.cmd.step_key.is_empty() {
                    latest = Some(self.load_seq(&call.rk, entry.seq)?);
                }
                continue;
            }
            let rec = self.load_seq(&call.rk, entry.seq)?;
            if call.same_causal_step(&rec, b, entry.position) {
                return Ok((count, Some(rec), None));
            }
            if latest.is_none() && call.cmd.step_key.is_empty() {
                latest = Some(rec);
            }
        }
        Ok((count, None, latest))
    }

    /// How a repeat of `rec`'s intent under no step key or a new one is answered: from the
    /// recorded effect's state, as its own key would be (in progress while leased, reconcile
    /// while unknown, granted again after it certainly failed); only a finished effect makes
    /// it a suspected duplicate, and only there does `deliberate_repeat` make a second effect
    /// (`None`). A DEDUPLICATE repeat is the same effect whatever its state.
    fn answer_repeat(&self, call: &Call<'_>, rec: EffectRecord) -> Option<Match> {
        let view = rec.view(call.now);
        let finished = matches!(view.state(), State::Completed | State::Compensated);
        if call.class() == OpClass::Deduplicate || (!finished && !view.tombstone) {
            return Some(Match::Existing {
                rec,
                via: Via::Lineage,
            });
        }
        if call.cmd.deliberate_repeat {
            return None;
        }
        Some(Match::Duplicate(rec))
    }

    /// Matches against the effects this branch carries (done in the world after its starting
    /// point, on another line of history); `None` when the call is none of them. A call is
    /// the carried effect of its step key when that has the same intent, else the earliest
    /// carried effect of its intent: the branch's plan may name its steps differently, but
    /// an intent already done there is done, and a new step key does not make it new.
    fn match_carried(&self, call: &Call<'_>) -> Result<Option<Match>> {
        let branch = call.branch();
        if branch.carried_seqs.is_empty() {
            return Ok(None);
        }
        let mut sources = branch.carried_sources.clone();
        sources.sort_unstable();
        sources.dedup();
        let carried = &branch.carried_seqs;
        if !call.cmd.step_key.is_empty()
            && let Some(seq) = self.step_entry_among(call, &sources, carried)?
        {
            let rec = self.load_seq(&call.rk, seq)?;
            if call.same_intent(&rec) {
                return Ok(Some(Match::Existing {
                    rec,
                    via: Via::Carried,
                }));
            }
        }
        Ok(
            match self.earliest_intent_among(call, &sources, carried, branch.fork_replaces)? {
                Some(seq) => Some(Match::Existing {
                    rec: self.load_seq(&call.rk, seq)?,
                    via: Via::Carried,
                }),
                None => None,
            },
        )
    }

    /// The effect among `seqs` that one of `branches` indexes under the call's step key.
    fn step_entry_among(
        &self,
        call: &Call<'_>,
        branches: &[u32],
        seqs: &[u64],
    ) -> Result<Option<u64>> {
        for &b in branches {
            if let Some(entry) = self.get::<IndexEntry>(&call.step_index_key(b))?
                && seqs.contains(&entry.seq)
            {
                return Ok(Some(entry.seq));
            }
        }
        Ok(None)
    }

    /// The earliest effect among `seqs` (in their order) that one of `branches` indexes under
    /// the call's intent: the n-th identical intent matches the n-th recorded one. `last`, if
    /// among them, is taken only when no other is (a fork's replaced entry: its call was
    /// changed on the fork, so an identical intent there is another call's).
    fn earliest_intent_among(
        &self,
        call: &Call<'_>,
        branches: &[u32],
        seqs: &[u64],
        last: Option<u64>,
    ) -> Result<Option<u64>> {
        let mut best: Option<usize> = None;
        let mut fallback = None;
        for &b in branches {
            for fp in call.fps.distinct() {
                let prefix = keys::intent_prefix(&call.rk, b, &fp);
                for (k, v) in self.store.scan(&prefix, &prefix, usize::MAX)? {
                    let entry: IndexEntry = codec::decode(&k, &v)?;
                    if call.fps.get(entry.tool_version) != Some(&fp) {
                        continue;
                    }
                    if Some(entry.seq) == last && seqs.contains(&entry.seq) {
                        fallback = Some(entry.seq);
                    } else if let Some(i) = seqs.iter().position(|s| *s == entry.seq) {
                        best = Some(best.map_or(i, |b| b.min(i)));
                    }
                }
            }
        }
        Ok(best.map(|i| seqs[i]).or(fallback))
    }

    /// How many effects of this intent the call's lineage holds, and the latest one.
    fn lineage_intent(&self, call: &Call<'_>) -> Result<(u32, Option<u64>)> {
        self.lineage_intent_of(&call.rk, &call.run, call.branch, &call.fps)
    }

    /// How many effects of an intent (fingerprints indexed by tool version) the lineage of
    /// `branch` holds, and the latest one. Each index entry is compared under the tool version
    /// it was recorded with.
    pub(super) fn lineage_intent_of(
        &self,
        rk: &RunKey,
        run: &RunRecord,
        branch: u32,
        fps: &Fingerprints,
    ) -> Result<(u32, Option<u64>)> {
        let entries = self.lineage_intent_entries(rk, run, branch, fps)?;
        let latest = entries.iter().map(|(_, e)| e.seq).max();
        Ok((entries.len() as u32, latest))
    }

    /// The index entries of an intent on the lineage of `branch`, one per effect, each with
    /// the branch whose index holds it.
    fn lineage_intent_entries(
        &self,
        rk: &RunKey,
        run: &RunRecord,
        branch: u32,
        fps: &Fingerprints,
    ) -> Result<Vec<(u32, IndexEntry)>> {
        let distinct = fps.distinct();
        let mut out: Vec<(u32, IndexEntry)> = Vec::new();
        for (b, limit) in run.lineage(branch) {
            for fp in &distinct {
                let prefix = keys::intent_prefix(rk, b, fp);
                if !self.index_may_hold(rk, index_filter::intent_tag(b, fp), &prefix)? {
                    continue;
                }
                for (k, v) in self.store.scan(&prefix, &prefix, usize::MAX)? {
                    let entry: IndexEntry = codec::decode(&k, &v)?;
                    if entry.position < limit
                        && fps.get(entry.tool_version) == Some(fp)
                        && !out.iter().any(|(_, e)| e.seq == entry.seq)
                    {
                        out.push((b, entry));
                    }
                }
            }
        }
        Ok(out)
    }

    /// Does the intent a credential is bound to (fingerprinted under the tool version current
    /// when it was issued) equal the call's, under any version of the tool?
    fn bound_intent_matches(&self, call: &Call<'_>, cred: &CredentialRecord) -> Result<bool> {
        if call.fps.iter().any(|fp| fp[..] == cred.bound_intent[..]) {
            return Ok(true);
        }
        let every = self.fingerprints(call.tenant, &call.tool, call.args, None, None)?;
        Ok(every.iter().any(|fp| fp[..] == cred.bound_intent[..]))
    }

    /// Checks every presented credential; see [`Gate`].
    fn credential_gate(&self, call: &Call<'_>) -> Result<Gate> {
        if call.credential_hashes.is_empty() {
            return Ok(Gate::Pass(Vec::new()));
        }
        let tk = keys::tenant_key(call.tenant);
        let mut pass = Vec::with_capacity(call.credential_hashes.len());
        for (hash, presented) in call.credential_hashes.iter().zip(&call.cmd.credentials) {
            let Some(cred) = self.get::<CredentialRecord>(&keys::credential(&tk, hash))? else {
                pass.push(CredentialRecord {
                    hash: hash.to_vec(),
                    budget: presented.budget.max(1),
                    uses: 0,
                    created_at_ms: call.now,
                    tenant: call.tenant.to_owned(),
                    ..Default::default()
                });
                continue;
            };
            if !cred.bound_tool.is_empty() && cred.bound_tool != call.tool.record.name {
                return Ok(Gate::Refused(Refusal::new(
                    Reason::CredentialMismatch,
                    Recovery::Reauthenticate,
                    format!(
                        "This credential is only valid for tool {:?}.",
                        cred.bound_tool
                    ),
                )));
            }
            if !cred.bound_intent.is_empty() && !self.bound_intent_matches(call, &cred)? {
                return Ok(Gate::Refused(Refusal::new(
                    Reason::CredentialMismatch,
                    Recovery::Reauthenticate,
                    messages::CREDENTIAL_OTHER_CALL,
                )));
            }
            if cred.uses >= cred.budget {
                for spent in cred.spent_by.iter().rev() {
                    if spent.run_key[..] != call.rk[..] {
                        continue;
                    }
                    let rec = self.load_seq(&call.rk, spent.seq)?;
                    if call.same_intent(&rec) && call.visible(&rec) {
                        return Ok(Gate::ExactReplay(Box::new(rec)));
                    }
                }
                let mut refusal = Refusal::new(
                    Reason::CredentialConsumed,
                    Recovery::Reauthenticate,
                    messages::CREDENTIAL_CONSUMED,
                );
                if let Some(last) = cred.spent_by.last()
                    && let Ok(rk) = RunKey::try_from(&last.run_key[..])
                    && let Some(rec) = self.get::<EffectRecord>(&keys::effect(&rk, last.seq))?
                {
                    refusal = refusal.with_receipt(rec.view(call.now));
                }
                return Ok(Gate::Refused(refusal));
            }
            pass.push(cred);
        }
        Ok(Gate::Pass(pass))
    }

    /// Answers a call that is an already recorded effect.
    fn answer_existing(
        &self,
        mut call: Call<'_>,
        mut rec: EffectRecord,
        via: Via,
    ) -> Result<Decision> {
        let now = call.now;
        let view = rec.view(now);
        if view.tombstone {
            return Ok(expired(view).into());
        }
        let own_grant =
            !call.cmd.request_id.is_empty() && rec.grant_request_id == call.cmd.request_id;
        if matches!(view.state(), State::Accepted | State::Running) && !own_grant {
            // Another attempt holds it: the caller waits and comes back. Nothing is consumed
            // (a tape entry or a carried effect stays due), so the call that comes back once
            // it finished gets its result, not a refusal as a repeat.
            return Ok(Decision::InProgress {
                receipt: Box::new(view),
                retry_after_ms: self.config.in_progress_retry_ms,
            });
        }
        let mut batch = Batch::new();
        let mut rec_changed = false;
        let mut counted = false;
        let mut tape_position = None;
        let state_before = rec.state;
        // The due entry this call consumes, if any (a late checkpoint must count it as due).
        let mut consumed = None;
        match via {
            Via::Lineage => {}
            Via::Tape => {
                let branch = &mut call.run.branches[call.branch as usize];
                tape_position = branch.take_from_tape(rec.seq);
                consumed = tape_position.map(|_| rec.seq);
                batch.put(keys::run(&call.rk), codec::encode(&call.run));
            }
            Via::Carried => {
                consumed = call
                    .branch()
                    .carried_seqs
                    .contains(&rec.seq)
                    .then_some(rec.seq);
                self.adopt(&mut call, &mut rec, &mut batch)?;
                rec_changed = true;
            }
        }
        // Where the effect sits in this branch's log, if it is in it (adopted ones included).
        let in_this_log = tape_position.or_else(|| rec.log_position(call.branch));
        // The effect answers a call descending from a checkpoint not saved yet: that checkpoint
        // must come before it, as before a new effect.
        if let Some(position) = in_this_log
            && self.note_open_step(&mut call, position, consumed)?
        {
            batch.put(keys::run(&call.rk), codec::encode(&call.run));
        }
        let decision = match view.state() {
            State::Completed | State::Compensated => {
                rec.replays += 1;
                rec.last_replay_epoch = call.run.epoch;
                counted = true;
                Decision::Replay(Box::new(rec.view(now)))
            }
            // The same requester re-sending after a lost response gets its own grant back
            // (any other caller was answered IN_PROGRESS above).
            State::Accepted | State::Running => Decision::Execute {
                receipt: Box::new(view),
                recorded: true,
            },
            State::FailedBeforeInput => {
                rec_changed = true;
                self.regrant(&call, &mut rec)
            }
            State::EffectUnknown | State::RejectedDuplicate | State::NotFound
                if matches!(rec.class(), OpClass::Deduplicate | OpClass::SafeRetry) =>
            {
                // Idempotent downstream under the same key: granting again is safe.
                rec_changed = true;
                self.regrant(&call, &mut rec)
            }
            State::EffectUnknown | State::RejectedDuplicate | State::NotFound => {
                return Ok(Refusal::new(
                    Reason::ReconcileRequired,
                    Recovery::Reconcile,
                    messages::RECONCILE_REQUIRED,
                )
                .with_receipt(view)
                .into());
            }
        };
        let parent = &call.cmd.parent_checkpoint_id;
        if !parent.is_empty()
            && *parent != rec.parent_checkpoint_id
            && !rec.answered_steps.contains(parent)
        {
            // The effect now answers a call of this causal step too (a restored agent's
            // re-issued call): a retry of that call is a repeat of it, not a new effect.
            if rec.answered_steps.len() >= MAX_ANSWERED_STEPS {
                rec.answered_steps.remove(0);
            }
            rec.answered_steps.push(parent.clone());
            rec_changed = true;
        }
        if via != Via::Carried && !call.cmd.step_key.is_empty() && call.cmd.step_key != rec.step_key
        {
            // The same effect under the caller's new name for the step: an alias, so the
            // step key is bound from now on (adoption does this for carried effects).
            let step = call.step_index_key(call.branch);
            if self.store.get(&step)?.is_none() {
                let entry = IndexEntry {
                    seq: rec.seq,
                    position: in_this_log.unwrap_or(rec.position),
                    tool_version: rec.tool_version,
                };
                batch.put(step, codec::encode(&entry));
            }
        }
        // The replay counters are an audit trail, not part of any answer: when they are all
        // that changed, they are written without waiting for a sync (a crash may lose the
        // latest counts, never anything an answer depended on).
        let durable = rec_changed || !batch.is_empty();
        if rec.state != state_before {
            self.put_effect(&mut batch, &call.rk, &rec);
        } else if rec_changed || counted {
            batch.put(keys::effect(&call.rk, rec.seq), codec::encode(&rec));
        }
        if durable {
            self.commit(batch)?;
        } else if counted {
            self.commit_unsynced(batch)?;
        }
        Ok(decision)
    }

    /// Adopts a carried effect into the call's branch: it takes the next position in the
    /// branch's log and is indexed there by step key and intent, so the branch's later
    /// lookups, checkpoints and restores treat it as its own.
    ///
    /// An effect already in the branch's log (one a restore carried because it was still due
    /// at the checkpoint, see `Ledger::restore`) keeps its place: a second log entry and
    /// intent slot would count it twice. It is only indexed under the step keys.
    fn adopt(&self, call: &mut Call<'_>, rec: &mut EffectRecord, batch: &mut Batch) -> Result<()> {
        let b = call.branch;
        let entry = match rec.log_position(b) {
            Some(position) => codec::encode(&IndexEntry {
                seq: rec.seq,
                position,
                tool_version: rec.tool_version,
            }),
            None => {
                // One past every occurrence of this intent on the lineage: a free index slot.
                let (count, _) = self.lineage_intent(call)?;
                let branch = &mut call.run.branches[b as usize];
                super::append_adopted(batch, &call.rk, b, branch, rec, count + 1)?
            }
        };
        // Indexed under the call's step key (how this branch names the step) and the
        // effect's own; a step this branch already recorded for itself keeps its meaning.
        let mut step_keys = vec![call.cmd.step_key.as_str(), rec.step_key.as_str()];
        step_keys.dedup();
        for step_key in step_keys.into_iter().filter(|k| !k.is_empty()) {
            let step = keys::step(&call.rk, b, step_key);
            if self.store.get(&step)?.is_none() {
                batch.put(step, entry.clone());
            }
        }
        // A fork's effect the agent brings back here took the place of an entry due here:
        // that entry is not re-issued any more (the agent did this instead), so it is no
        // longer due, only done (carried: an equivalent call still replays it).
        let replaced = match rec.supersedes {
            Some(seq) if call.branch().tape_seqs.contains(&seq) => {
                let replaced = self.load_seq(&call.rk, seq)?;
                rec.took_place_of(&replaced).then_some(seq)
            }
            _ => None,
        };
        let branch = &mut call.run.branches[b as usize];
        branch.uncarry(rec.seq);
        if let Some(replaced) = replaced {
            branch.take_from_tape(replaced);
            branch.carry(replaced, b);
        }
        batch.put(keys::run(&call.rk), codec::encode(&call.run));
        Ok(())
    }

    /// Grants an effect again (same id, same downstream key, next attempt).
    fn regrant(&self, call: &Call<'_>, rec: &mut EffectRecord) -> Decision {
        let lease = self.lease_for(call);
        rec.attempt += 1;
        rec.state = State::Accepted.code();
        rec.expires_at_ms = 0;
        rec.grant_request_id = call.cmd.request_id.clone();
        rec.epoch = call.run.epoch;
        rec.lease_ms = lease;
        rec.lease_expires_at_ms = call.now + lease;
        rec.updated_at_ms = call.now;
        Decision::Execute {
            receipt: Box::new(rec.clone()),
            recorded: true,
        }
    }

    fn lease_for(&self, call: &Call<'_>) -> u64 {
        [call.cmd.lease_ms, call.tool.record.lease_ms]
            .into_iter()
            .find(|l| *l > 0)
            .unwrap_or(self.config.default_lease_ms)
    }

    fn new_effect_record(&self, call: &Call<'_>, seq: u64, occurrence: u32) -> EffectRecord {
        let lease = self.lease_for(call);
        let branch = call.branch();
        let retention = match call.tool.record.retention_ms {
            0 => self.config.default_retention_ms,
            r => r,
        };
        let (compensation_tool, compensation_arguments) =
            call.cmd.compensation.clone().unwrap_or_default();
        EffectRecord {
            tenant: call.tenant.to_owned(),
            run_id: call.cmd.run_id.clone(),
            seq,
            branch: call.branch,
            branch_name: branch.name.clone(),
            position: branch.length,
            epoch: call.run.epoch,
            tool: call.tool.record.name.clone(),
            tool_version: call.tool.record.version,
            class: call.tool.record.class,
            step_key: call.cmd.step_key.clone(),
            intent_fp: call.fp().to_vec(),
            request_fp: call.request_fp.to_vec(),
            occurrence,
            state: State::Accepted.code(),
            downstream_key: downstream_key(call, occurrence),
            attempt: 1,
            lease_ms: lease,
            lease_expires_at_ms: call.now + lease,
            created_at_ms: call.now,
            updated_at_ms: call.now,
            retention_ms: retention,
            credential_hashes: call.credential_hashes.iter().map(|h| h.to_vec()).collect(),
            saga_id: call.cmd.saga_id.clone(),
            compensation_tool,
            compensation_arguments,
            compensates_seq: call.compensates_seq,
            arguments_json: call.cmd.arguments_json.clone(),
            deliberate_repeat: call.cmd.deliberate_repeat,
            grant_request_id: call.cmd.request_id.clone(),
            parent_checkpoint_id: call.cmd.parent_checkpoint_id.clone(),
            ..Default::default()
        }
    }

    /// Records a new effect, its indexes and its credential uses in one batch.
    fn record_new(
        &self,
        mut call: Call<'_>,
        occurrence: u32,
        mut creds: Vec<CredentialRecord>,
    ) -> Result<Decision> {
        let limits = &self.config.limits;
        let seq = call.run.next_seq.max(1);
        if seq > limits.max_effects_per_run {
            return Err(LedgerError::ResourceExhausted {
                field: "run_id".into(),
                why: format!(
                    "run {:?} holds the maximum of {} effects",
                    call.cmd.run_id, limits.max_effects_per_run
                ),
            });
        }
        let mut rec = self.new_effect_record(&call, seq, occurrence);
        // A fork's first new effect is the call it was forked for: it replaces the entry that
        // call was refused for (see `adopt`).
        let branch = &mut call.run.branches[call.branch as usize];
        let replaces = branch.fork_replaces.filter(|_| !branch.fork_replaced);
        branch.fork_replaced |= replaces.is_some();
        rec.supersedes = replaces;
        let index = IndexEntry {
            seq,
            position: rec.position,
            tool_version: rec.tool_version,
        };
        let mut batch = Batch::new();
        self.put_effect(&mut batch, &call.rk, &rec);
        if !call.cmd.step_key.is_empty() {
            batch.put(call.step_index_key(call.branch), codec::encode(&index));
        }
        batch.put(
            keys::intent(&call.rk, call.branch, call.fp(), occurrence),
            codec::encode(&index),
        );
        batch.put(
            keys::branch_log(&call.rk, call.branch, rec.position),
            codec::encode(&index),
        );
        if !creds.is_empty() {
            let tk = keys::tenant_key(call.tenant);
            for cred in &mut creds {
                cred.uses += 1;
                cred.spent_by.push(EffectRef {
                    run_key: call.rk.to_vec(),
                    seq,
                });
                let hash: [u8; 32] = cred.hash[..].try_into().expect("hashes are 32 bytes");
                batch.put(keys::credential(&tk, &hash), codec::encode(&*cred));
            }
        }
        call.run.next_seq = seq + 1;
        let noted = note_tool_version(&mut call.run, &rec.tool, rec.tool_version);
        let opened = self.note_open_step(&mut call, rec.position, None)?;
        call.run.branches[call.branch as usize].length += 1;
        // The stored record's counts may lag (readers catch them up from the branch logs, see
        // `Ledger::catch_up_run`); it is written when anything else in it changes, and every
        // `RUN_RECORD_EVERY` effects so that catching up stays short.
        if call.new
            || noted
            || opened
            || replaces.is_some()
            || seq.is_multiple_of(super::RUN_RECORD_EVERY)
        {
            batch.put(keys::run(&call.rk), codec::encode(&call.run));
        }
        if call.new {
            super::runs::index_new_run(&mut batch, call.tenant, &call.cmd.run_id);
        }
        self.commit_run(batch, call.rk, call.run, &rec)?;
        Ok(Decision::Execute {
            receipt: Box::new(rec),
            recorded: true,
        })
    }

    /// Remembers where the first effect naming a not yet recorded checkpoint sits in the
    /// branch's log: the checkpoint, when it arrives late, is placed before it (see
    /// [`Ledger::checkpoint`]).
    /// `consumed` is the due entry the call consumed (it was due where the checkpoint
    /// belongs). Returns whether the run record changed.
    fn note_open_step(
        &self,
        call: &mut Call<'_>,
        position: u64,
        consumed: Option<u64>,
    ) -> Result<bool> {
        let parent = &call.cmd.parent_checkpoint_id;
        let branch = call.branch();
        if parent.is_empty()
            || branch.last_checkpoint_id == *parent
            || branch.open_steps.iter().any(|o| &o.checkpoint_id == parent)
            || self
                .store
                .get(&keys::checkpoint(&call.rk, parent))?
                .is_some()
        {
            return Ok(false);
        }
        let branch = &mut call.run.branches[call.branch as usize];
        let due_seqs = consumed.into_iter().chain(branch.due_seqs()).collect();
        let open = &mut branch.open_steps;
        if open.len() >= MAX_OPEN_STEPS {
            // A checkpoint that never arrived; forgetting it only places it by arrival.
            open.remove(0);
        }
        open.push(OpenStep {
            checkpoint_id: parent.clone(),
            position,
            due_seqs,
        });
        Ok(true)
    }

    /// The keyed hash a credential is stored under (the raw value never is).
    pub fn credential_hash(&self, tenant: &str, token: &[u8]) -> [u8; 32] {
        let mut h = blake3::Hasher::new_keyed(&self.config.credential_key);
        h.update(&(tenant.len() as u64).to_be_bytes());
        h.update(tenant.as_bytes());
        h.update(token);
        *h.finalize().as_bytes()
    }
}

/// A fresh run record: epoch 1, branch "main".
pub(super) fn new_run(tenant: &str, run_id: &str, now: u64) -> RunRecord {
    RunRecord {
        tenant: tenant.to_owned(),
        run_id: run_id.to_owned(),
        epoch: 1,
        next_seq: 1,
        created_at_ms: now,
        branches: vec![BranchRecord {
            name: MAIN_BRANCH.to_owned(),
            created_epoch: 1,
            created_at_ms: now,
            ..Default::default()
        }],
        checkpoint_count: 0,
        tracks_tool_versions: true,
        tool_versions: Vec::new(),
    }
}

/// The downstream idempotency key: from the effect's identity, never from the attempt.
fn downstream_key(call: &Call<'_>, occurrence: u32) -> String {
    static CONTEXT: keys::DeriveKey = keys::DeriveKey::new("fence.v1 downstream key");
    let hash = keys::hash_parts(
        &CONTEXT,
        &[
            call.tenant.as_bytes(),
            call.cmd.run_id.as_bytes(),
            call.branch().name.as_bytes(),
            call.cmd.step_key.as_bytes(),
            &call.fp()[..],
        ],
        &occurrence.to_be_bytes(),
    );
    let mut key = [0u8; 6 + 32];
    key[..6].copy_from_slice(b"fence-");
    codec::hex_into(&hash.as_bytes()[..16], &mut key[6..]);
    String::from_utf8(key.to_vec()).expect("hex digits are ASCII")
}

fn expired(view: EffectRecord) -> Refusal {
    Refusal::new(Reason::Expired, Recovery::Stop, messages::EXPIRED).with_receipt(view)
}
