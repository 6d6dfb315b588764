//! Outcomes: heartbeats, completions, reconciliation, queries and the audit listing.
//!
//! The rules that matter here: an unknown outcome is never relabelled FAILED_BEFORE_INPUT
//! except by `reconcile` with evidence; a completion that contradicts a recorded result is
//! refused (RESULT_CONFLICT); an identical repeat of a transition is acknowledged without
//! writing; every state change sets or clears the record's expiry.

use super::records::{EffectRecord, IndexEntry, RunRecord};
use super::{
    EffectId, Finding, Ledger, LedgerError, Outcome, Reason, Recovery, Refusal, Result, State,
    check_epoch,
};
use crate::store::keys::{self, RunKey};
use crate::store::{Batch, Store, codec};

/// How to find an effect for `query_outcome`.
#[derive(Debug, Clone)]
pub enum OutcomeKey {
    /// By effect id.
    EffectId(String),
    /// By step key on a branch lineage.
    StepKey {
        /// Run id.
        run_id: String,
        /// Branch ("" = main).
        branch: String,
        /// Step key.
        step_key: String,
    },
    /// By intent on a branch lineage: the latest occurrence.
    Intent {
        /// Run id.
        run_id: String,
        /// Branch ("" = main).
        branch: String,
        /// Tool.
        tool: String,
        /// JSON arguments.
        arguments_json: String,
    },
}

/// A page of the audit listing.
#[derive(Debug, Clone, Default)]
pub struct ListQuery {
    /// Run id.
    pub run_id: String,
    /// Only this branch's own effects ("" = all).
    pub branch: String,
    /// Only this saga's effects ("" = all).
    pub saga_id: String,
    /// Page size (0 = 100, at most 1000).
    pub page_size: u32,
    /// Cursor from the previous page ("" = start).
    pub page_token: String,
    /// With `branch`: the branch's whole lineage, not just its own effects.
    pub lineage: bool,
}

fn refuse(
    reason: Reason,
    recovery: Recovery,
    msg: &str,
    rec: &EffectRecord,
    now: u64,
) -> LedgerError {
    Refusal::new(reason, recovery, msg)
        .with_receipt(rec.view(now))
        .into()
}

impl<S: Store> Ledger<S> {
    fn parse_effect_id(&self, effect_id: &str) -> Result<EffectId> {
        self.check_id("effect_id", effect_id)?;
        effect_id
            .parse()
            .map_err(|why: &str| LedgerError::invalid("effect_id", why))
    }

    /// Loads an effect for a transition, checking the caller's epoch.
    ///
    /// `attempt` is the grant the caller names (0: none). A report from a granted attempt is
    /// about an effect that was started, whatever the run's epoch since: the effect id and
    /// attempt are its capability, and losing its result to a restore would turn a known
    /// outcome into EFFECT_UNKNOWN. So only an epoch never issued is refused there; a stale
    /// epoch fences new work (Begin, Reconcile, a report naming no attempt), not facts.
    fn effect_for_update(
        &self,
        tenant: &str,
        id: &EffectId,
        epoch: u64,
        attempt: u32,
    ) -> Result<EffectRecord> {
        let rec = self.take_effect(id, tenant)?;
        let granted = attempt != 0 && attempt <= rec.attempt;
        // The run's epoch never falls below the epoch the effect was granted at, so a granted
        // attempt's report at or below that epoch needs no read of the run (the common
        // Complete: one read, not two).
        if !granted || epoch > rec.epoch {
            let run = self.require_run(&id.run_key, tenant, &rec.run_id)?;
            if !granted || epoch > run.epoch {
                check_epoch(&run, epoch)?;
            }
        }
        Ok(rec)
    }

    /// Marks a record finished at `now`: its retention clock starts.
    fn finish(rec: &mut EffectRecord, now: u64) {
        rec.lease_expires_at_ms = 0;
        rec.updated_at_ms = now;
        // No index entry: compaction finds it past its window (`expiry::retention_rewrite`).
        rec.expires_at_ms = now.saturating_add(rec.retention_ms.max(1));
    }

    /// Extends a live lease (a long-running tool's heartbeat).
    pub fn heartbeat(
        &self,
        tenant: &str,
        effect_id: &str,
        attempt: u32,
        epoch: u64,
        extend_ms: u64,
    ) -> Result<EffectRecord> {
        let id = self.parse_effect_id(effect_id)?;
        if extend_ms > self.config.max_lease_ms {
            return Err(LedgerError::invalid(
                "extend_ms",
                format!(
                    "exceeds the maximum lease of {} ms",
                    self.config.max_lease_ms
                ),
            ));
        }
        let _guard = self.runs.lock(&id.run_key);
        let now = self.now();
        let mut rec = self.effect_for_update(tenant, &id, epoch, attempt)?;
        if attempt > rec.attempt {
            return Err(LedgerError::invalid("attempt", "was never granted"));
        }
        if attempt != 0 && attempt < rec.attempt {
            return Err(refuse(
                Reason::LeaseLost,
                Recovery::WaitAndQuery,
                "A newer attempt holds this effect's lease; stop and query its outcome.",
                &rec,
                now,
            ));
        }
        if !rec.lease_live(now) {
            let (reason, recovery, msg) = match rec.state() {
                State::Accepted | State::Running => (
                    Reason::LeaseLost,
                    Recovery::Reconcile,
                    "The lease lapsed before this heartbeat; the outcome is now unknown.",
                ),
                _ => (
                    Reason::InvalidTransition,
                    Recovery::Stop,
                    "This effect is no longer running.",
                ),
            };
            return Err(refuse(reason, recovery, msg, &rec, now));
        }
        let extend = if extend_ms == 0 {
            rec.lease_ms
        } else {
            extend_ms
        };
        rec.state = State::Running.code();
        rec.lease_expires_at_ms = now + extend;
        rec.updated_at_ms = now;
        let mut batch = Batch::new();
        self.put_effect(&mut batch, &id.run_key, &rec);
        self.commit(batch)?;
        Ok(rec)
    }

    /// Records how a granted effect ended.
    pub fn complete(
        &self,
        tenant: &str,
        effect_id: &str,
        attempt: u32,
        epoch: u64,
        outcome: Outcome,
    ) -> Result<EffectRecord> {
        let id = self.parse_effect_id(effect_id)?;
        let limits = &self.config.limits;
        match &outcome {
            Outcome::Completed(r) => self.check_len("result", r.len(), limits.max_result_bytes)?,
            Outcome::FailedBeforeInput(d) | Outcome::Unknown(d) => {
                self.check_len("detail", d.len(), limits.max_detail_bytes)?
            }
        }
        let _guard = self.runs.lock(&id.run_key);
        let now = self.now();
        let mut rec = self.effect_for_update(tenant, &id, epoch, attempt)?;
        if attempt > rec.attempt {
            return Err(LedgerError::invalid("attempt", "was never granted"));
        }
        if rec.expired_at(now) {
            return Err(refuse(
                Reason::Expired,
                Recovery::Stop,
                "This effect is past its retention window.",
                &rec,
                now,
            ));
        }
        let superseded = attempt != 0 && attempt < rec.attempt;
        let state = rec.state();
        // A superseded attempt may still report a success (it is the truth about the effect),
        // but not a failure: the newer attempt owns the grant now.
        if superseded
            && matches!(state, State::Accepted | State::Running)
            && !matches!(outcome, Outcome::Completed(_))
        {
            return Err(refuse(
                Reason::LeaseLost,
                Recovery::WaitAndQuery,
                "A newer attempt holds this effect.",
                &rec,
                now,
            ));
        }
        let mut batch = Batch::new();
        match outcome {
            Outcome::Completed(result) => match state {
                State::Completed | State::Compensated => {
                    if rec.result != result {
                        return Err(refuse(
                            Reason::ResultConflict,
                            Recovery::Stop,
                            "This effect already completed with a different result.",
                            &rec,
                            now,
                        ));
                    }
                    return Ok(rec.into_view(now));
                }
                // The effect happened: that is true whatever the lease or an earlier report said.
                _ => {
                    rec.state = State::Completed.code();
                    rec.result = result;
                    Self::finish(&mut rec, now);
                    if rec.compensates_seq != 0 {
                        self.mark_compensated(&mut batch, &id.run_key, &rec, now)?;
                    }
                }
            },
            Outcome::FailedBeforeInput(detail) => match state {
                State::FailedBeforeInput => return Ok(rec.into_view(now)),
                State::Accepted | State::Running if rec.lease_live(now) => {
                    rec.state = State::FailedBeforeInput.code();
                    rec.detail = detail;
                    Self::finish(&mut rec, now);
                }
                State::Accepted | State::Running | State::EffectUnknown => {
                    return Err(refuse(
                        Reason::ReconcileRequired,
                        Recovery::Reconcile,
                        "The outcome is unknown (the lease lapsed or it was reported unknown); only Reconcile with evidence can mark it as not having happened.",
                        &rec,
                        now,
                    ));
                }
                _ => {
                    return Err(refuse(
                        Reason::InvalidTransition,
                        Recovery::Stop,
                        "This effect already completed; it cannot have failed before input.",
                        &rec,
                        now,
                    ));
                }
            },
            Outcome::Unknown(detail) => match state {
                State::EffectUnknown => return Ok(rec.into_view(now)),
                State::Accepted | State::Running => {
                    rec.state = State::EffectUnknown.code();
                    rec.detail = detail;
                    rec.lease_expires_at_ms = 0;
                    rec.updated_at_ms = now;
                }
                _ => {
                    return Err(refuse(
                        Reason::InvalidTransition,
                        Recovery::Stop,
                        "This effect's outcome is already settled.",
                        &rec,
                        now,
                    ));
                }
            },
        }
        self.put_effect(&mut batch, &id.run_key, &rec);
        self.commit(batch)?;
        Ok(rec.into_view(now))
    }

    /// When a compensation completes, its target becomes COMPENSATED in the same batch.
    fn mark_compensated(
        &self,
        batch: &mut Batch,
        rk: &RunKey,
        comp: &EffectRecord,
        now: u64,
    ) -> Result<()> {
        let Some(mut target) = self.get::<EffectRecord>(&keys::effect(rk, comp.compensates_seq))?
        else {
            return Ok(());
        };
        target.compensated_by_seq = comp.seq;
        if target.state() == State::Completed {
            target.state = State::Compensated.code();
        }
        target.updated_at_ms = now;
        self.put_effect(batch, rk, &target);
        Ok(())
    }

    /// Settles an unknown outcome with evidence from an outcome check.
    pub fn reconcile(
        &self,
        tenant: &str,
        effect_id: &str,
        epoch: u64,
        evidence: &str,
        finding: Finding,
    ) -> Result<EffectRecord> {
        let id = self.parse_effect_id(effect_id)?;
        let limits = &self.config.limits;
        if evidence.trim().is_empty() {
            return Err(Refusal::new(
                Reason::EvidenceRequired,
                Recovery::Reconcile,
                "Reconcile needs evidence of what the outcome check found.",
            )
            .into());
        }
        self.check_len("evidence", evidence.len(), limits.max_evidence_bytes)?;
        match &finding {
            Finding::Completed(r) => {
                self.check_len("completed_result", r.len(), limits.max_result_bytes)?
            }
            Finding::FailedBeforeInput(d) => self.check_len(
                "failed_before_input.detail",
                d.len(),
                limits.max_detail_bytes,
            )?,
        }
        let _guard = self.runs.lock(&id.run_key);
        let now = self.now();
        let mut rec = self.effect_for_update(tenant, &id, epoch, 0)?;
        let view = rec.view(now);
        if view.tombstone {
            return Err(refuse(
                Reason::Expired,
                Recovery::Stop,
                "This effect is past its retention window.",
                &rec,
                now,
            ));
        }
        match (view.state(), &finding) {
            (State::Accepted | State::Running, _) => {
                return Err(refuse(
                    Reason::InvalidTransition,
                    Recovery::WaitAndQuery,
                    "This effect is still running under a live lease; wait for it.",
                    &rec,
                    now,
                ));
            }
            (State::Completed | State::Compensated, Finding::Completed(r)) if *r == rec.result => {
                return Ok(view);
            }
            (State::FailedBeforeInput, Finding::FailedBeforeInput(_)) => return Ok(view),
            (State::Completed | State::Compensated, _) => {
                return Err(refuse(
                    Reason::InvalidTransition,
                    Recovery::Stop,
                    "This effect already completed with a recorded result.",
                    &rec,
                    now,
                ));
            }
            _ => {}
        }
        let mut batch = Batch::new();
        match finding {
            Finding::Completed(result) => {
                rec.state = State::Completed.code();
                rec.result = result;
            }
            Finding::FailedBeforeInput(detail) => {
                rec.state = State::FailedBeforeInput.code();
                rec.detail = detail;
            }
        }
        rec.evidence = evidence.to_owned();
        Self::finish(&mut rec, now);
        if rec.state() == State::Completed && rec.compensates_seq != 0 {
            self.mark_compensated(&mut batch, &id.run_key, &rec, now)?;
        }
        self.put_effect(&mut batch, &id.run_key, &rec);
        self.commit(batch)?;
        Ok(rec.into_view(now))
    }

    /// What happened: the effect as it stands now, or `None`.
    pub fn query_outcome(&self, tenant: &str, key: &OutcomeKey) -> Result<Option<EffectRecord>> {
        let now = self.now();
        let found = match key {
            OutcomeKey::EffectId(effect_id) => {
                let id = self.parse_effect_id(effect_id)?;
                self.load_effect(&id, tenant)?
            }
            OutcomeKey::StepKey {
                run_id,
                branch,
                step_key,
            } => {
                self.check_id("step_key.step_key", step_key)?;
                let Some((rk, run, b)) = self.lineage_if_exists(tenant, run_id, branch)? else {
                    return Ok(None);
                };
                let mut found = None;
                for (bi, limit) in run.lineage(b) {
                    if let Some(entry) = self.get::<IndexEntry>(&keys::step(&rk, bi, step_key))?
                        && entry.position < limit
                    {
                        found = Some(self.load_seq(&rk, entry.seq)?);
                        break;
                    }
                }
                found
            }
            OutcomeKey::Intent {
                run_id,
                branch,
                tool,
                arguments_json,
            } => {
                self.check_id("intent.tool", tool)?;
                self.check_len(
                    "intent.arguments_json",
                    arguments_json.len(),
                    self.config.limits.max_arguments_bytes,
                )?;
                let args = crate::canonical::parse_arguments(arguments_json)
                    .map_err(|e| LedgerError::invalid("intent.arguments_json", e.to_string()))?;
                let Some((rk, run, b)) = self.lineage_if_exists(tenant, run_id, branch)? else {
                    return Ok(None);
                };
                let current = self.current_tool(tenant, tool)?;
                let fps = self.fingerprints(tenant, &current, &args, Some(&run), None)?;
                match self.lineage_intent_of(&rk, &run, b, &fps)?.1 {
                    Some(seq) => Some(self.load_seq(&rk, seq)?),
                    None => None,
                }
            }
        };
        Ok(found.map(|r| r.into_view(now)))
    }

    /// Like `lineage_for_query`, but a missing run or branch is `None`: a query's answer is
    /// then NOT_FOUND, not an error.
    fn lineage_if_exists(
        &self,
        tenant: &str,
        run_id: &str,
        branch: &str,
    ) -> Result<Option<(RunKey, RunRecord, u32)>> {
        self.check_id("run_id", run_id)?;
        if !branch.is_empty() {
            self.check_id("branch", branch)?;
        }
        let rk = keys::run_key(tenant, run_id);
        Ok(self
            .load_run(&rk, tenant, run_id)?
            .and_then(|run| run.branch_index(branch).map(|b| (rk, run, b))))
    }

    fn lineage_for_query(
        &self,
        tenant: &str,
        run_id: &str,
        branch: &str,
    ) -> Result<(RunKey, RunRecord, u32)> {
        self.check_id("run_id", run_id)?;
        let rk = keys::run_key(tenant, run_id);
        let run = self.require_run(&rk, tenant, run_id)?;
        let b = run.branch_index(branch).ok_or_else(|| {
            LedgerError::from(Refusal::new(
                Reason::UnknownRecord,
                Recovery::FixArgument,
                format!("Branch {branch:?} does not exist in run {run_id:?}."),
            ))
        })?;
        Ok((rk, run, b))
    }

    /// A page of a run's effects in recording order, and the next page's cursor ("" = done).
    pub fn list_effects(&self, tenant: &str, q: &ListQuery) -> Result<(Vec<EffectRecord>, String)> {
        // Which (branch, visible positions) to keep; None = everything.
        let (rk, visible): (RunKey, Option<Vec<(u32, u64)>>) = if q.branch.is_empty() {
            self.check_id("run_id", &q.run_id)?;
            let rk = keys::run_key(tenant, &q.run_id);
            self.require_run(&rk, tenant, &q.run_id)?;
            (rk, None)
        } else {
            let (rk, run, b) = self.lineage_for_query(tenant, &q.run_id, &q.branch)?;
            let visible = if q.lineage {
                run.lineage(b)
            } else {
                vec![(b, u64::MAX)]
            };
            (rk, Some(visible))
        };
        if !q.saga_id.is_empty() {
            self.check_id("saga_id", &q.saga_id)?;
        }
        let cursor: u64 = if q.page_token.is_empty() {
            1
        } else {
            q.page_token.parse().map_err(|_| {
                LedgerError::invalid("page_token", "is not a token this server issued")
            })?
        };
        let now = self.now();
        let (out, next) = self.page(
            &keys::effect_prefix(&rk),
            keys::effect(&rk, cursor),
            q.page_size,
            |k, v| {
                let rec: EffectRecord = codec::decode(k, v)?;
                let keep = visible.as_ref().is_none_or(|v| rec.visible_on(v))
                    && (q.saga_id.is_empty() || rec.saga_id == q.saga_id);
                Ok(keep.then(|| (rec.into_view(now), v.len())))
            },
        )?;
        let token = next
            .and_then(|k| keys::decode_effect(&k))
            .map_or_else(String::new, |(_, seq)| seq.to_string());
        Ok((out, token))
    }
}
