//! Batches: several Begins (or Completes) in one request, sharing one durable sync.
//!
//! An agent whose model emits parallel tool calls begins them together and completes them
//! together. Each call in a batch is decided exactly as if it had been sent alone, in the
//! batch's order (a later call sees what an earlier one recorded), and each gets its own
//! answer or error. What a batch saves is the wait: the calls' writes are deferred
//! ([`Store::deferred`]) and made durable by one sync before any answer is returned. A batch
//! is not a transaction: a refused or invalid call does not undo the others. If the final
//! sync fails the whole batch fails and none of its answers may be used; every call may or
//! may not have been recorded, and resending the batch (with the same request ids) gets the
//! same effects back.

use super::begin::{Begun, PreparedBegin};
use super::{BeginCmd, Ledger, LedgerError, Outcome, Result};
use crate::ledger::records::EffectRecord;
use crate::store::Store;

/// One Complete in a batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CompleteCmd {
    /// The effect id from the grant.
    pub effect_id: String,
    /// The attempt from the grant (0 = the current one).
    pub attempt: u32,
    /// The caller's epoch (0 = untracked).
    pub epoch: u64,
    /// How the effect ended.
    pub outcome: Outcome,
}

impl<S: Store> Ledger<S> {
    /// Decides every call of `cmds` in order, then makes all their writes durable with one
    /// sync. The outer `Err` means the sync failed and no answer may be used.
    pub fn begin_many(&self, tenant: &str, cmds: &[BeginCmd]) -> Result<Vec<Result<Begun>>> {
        self.check_batch("calls", cmds.len())?;
        let calls = cmds
            .iter()
            .map(|cmd| self.prepare_begin(tenant, cmd.clone()))
            .collect();
        self.begin_many_prepared(tenant, calls)
    }

    /// [`Ledger::begin_many`] of calls already prepared ([`Ledger::prepare_begin`], on the
    /// caller's thread), each either prepared or refused by its preparation; a refused call
    /// keeps its error in its place.
    pub fn begin_many_prepared(
        &self,
        tenant: &str,
        calls: Vec<Result<PreparedBegin>>,
    ) -> Result<Vec<Result<Begun>>> {
        self.check_batch("calls", calls.len())?;
        let mut out = Vec::with_capacity(calls.len());
        let mut calls = Some(calls);
        self.store.deferred(&mut || {
            let calls = calls.take().unwrap_or_default();
            out.extend(calls.into_iter().map(|call| {
                let prepared = call?;
                self.begin_prepared(tenant, &prepared)
            }));
        })?;
        Ok(out)
    }

    /// Records every outcome of `cmds` in order, then makes all their writes durable with one
    /// sync. The outer `Err` means the sync failed and no answer may be used.
    pub fn complete_many(
        &self,
        tenant: &str,
        cmds: &[CompleteCmd],
    ) -> Result<Vec<Result<EffectRecord>>> {
        self.check_batch("completions", cmds.len())?;
        let mut out = Vec::with_capacity(cmds.len());
        self.store.deferred(&mut || {
            out.extend(cmds.iter().map(|c| {
                self.complete(tenant, &c.effect_id, c.attempt, c.epoch, c.outcome.clone())
            }))
        })?;
        Ok(out)
    }

    /// Checks a batch's size: 1 to [`Limits::max_batch_calls`](super::Limits) calls.
    pub fn check_batch(&self, field: &str, len: usize) -> Result<()> {
        let max = self.config.limits.max_batch_calls;
        if len == 0 {
            return Err(LedgerError::invalid(field, "must not be empty"));
        }
        if len > max {
            return Err(LedgerError::invalid(
                field,
                format!("{len} in one batch; the limit is {max}"),
            ));
        }
        Ok(())
    }
}
