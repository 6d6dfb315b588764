//! Verification of a whole store: every record read (so the engine checks its checksums),
//! decoded as its kind's record, and tied to the run it belongs to. What `Admin.VerifyBackup`
//! runs over a backup; it only reads.

use std::collections::{HashMap, HashSet};
use std::ops::ControlFlow;

use prost::Message;

use super::Ledger;
use super::format::{FORMAT_VERSION, FormatRecord};
use super::records::{
    CheckpointRecord, CredentialRecord, EffectRecord, IndexEntry, RestoreRecord, RunRecord,
    ToolHead, ToolRecord,
};
use crate::store::keys::{self, Kind, RunKey};
use crate::store::{Store, codec};

/// Problems listed in a report at most (all of them are counted).
pub const MAX_LISTED_PROBLEMS: usize = 100;

/// What [`Ledger::verify`] found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct VerifyReport {
    /// The format version recorded in the store (0: none recorded).
    pub format_version: u32,
    /// Records read.
    pub records: u64,
    /// Run records.
    pub runs: u64,
    /// Effect records.
    pub effects: u64,
    /// Registered tools (current-version pointers).
    pub tools: u64,
    /// Credential records.
    pub credentials: u64,
    /// The first [`MAX_LISTED_PROBLEMS`] problems, one line each.
    pub problems: Vec<String>,
    /// How many problems there are.
    pub problem_count: u64,
}

impl VerifyReport {
    fn problem(&mut self, key: &[u8], why: impl std::fmt::Display) {
        self.add_problem(format!("record {}: {why}", codec::hex(key)));
    }

    /// Adds a problem found outside the store's records.
    pub fn add_problem(&mut self, why: String) {
        self.problem_count += 1;
        if self.problems.len() < MAX_LISTED_PROBLEMS {
            self.problems.push(why);
        }
    }

    /// True when nothing is wrong.
    pub fn is_sound(&self) -> bool {
        self.problem_count == 0
    }
}

/// The run key that keys of these kinds start with (after the kind byte).
fn run_key_of(key: &[u8]) -> Option<RunKey> {
    key.get(1..17)?.try_into().ok()
}

/// An effect, index entry, checkpoint or restore must belong to a stored run and name only
/// sequence numbers that run issued.
fn check_run(runs: &HashMap<RunKey, u64>, key: &[u8], seq: Option<u64>, report: &mut VerifyReport) {
    match run_key_of(key).and_then(|rk| runs.get(&rk)) {
        None => report.problem(key, "belongs to no stored run"),
        Some(&next) if seq.is_some_and(|s| s == 0 || s >= next) => report.problem(
            key,
            format!(
                "refers to effect {} of a run that issued only {}",
                seq.unwrap_or(0),
                next.saturating_sub(1)
            ),
        ),
        Some(_) => {}
    }
}

fn decodes<M: Message + Default>(key: &[u8], value: &[u8]) -> std::result::Result<M, String> {
    codec::decode::<M>(key, value).map_err(|e| e.to_string())
}

impl<S: Store> Ledger<S> {
    /// Reads and checks every record of the store (see the module docs). Damage is listed in
    /// the report; a storage error (an unreadable block, a checksum mismatch) is one problem
    /// and ends the walk there, so what follows it is not counted.
    pub fn verify(&self) -> VerifyReport {
        let mut report = VerifyReport::default();
        // Every run's next sequence number: runs sort before their effects, indexes and
        // checkpoints (key kinds 0x01 < 0x02..0x07), so each of those finds its run here.
        let mut runs: HashMap<RunKey, u64> = HashMap::new();
        // Open effects not yet met in the open-effect index (which sorts after effects).
        let mut open: HashSet<(RunKey, u64)> = HashSet::new();
        let mut last = Vec::new();
        let walked = self.walk(&[], Vec::new(), 1024, |chunk| {
            for (key, value) in chunk {
                report.records += 1;
                let catch_up = |rk: &RunKey, run: &mut RunRecord| {
                    self.catch_up_run(rk, run).map_err(|e| e.to_string())
                };
                verify_record(key, value, &catch_up, &mut runs, &mut open, &mut report);
            }
            if let Some((key, _)) = chunk.last() {
                last.clone_from(key);
            }
            Ok(ControlFlow::Continue(()))
        });
        if let Err(e) = walked {
            report.problem(&last, format!("the store cannot be read past here: {e}"));
            return report;
        }
        for (rk, seq) in open {
            report.problem(
                &keys::effect(&rk, seq),
                "is not settled but missing from the open-effect index",
            );
        }
        if report.format_version == 0 && report.records > 0 {
            report.problem(&keys::meta(), "no format version is recorded");
        }
        report
    }
}

/// Checks one record (see [`Ledger::verify`]).
fn verify_record(
    key: &[u8],
    value: &[u8],
    catch_up: &dyn Fn(&RunKey, &mut RunRecord) -> std::result::Result<(), String>,
    runs: &mut HashMap<RunKey, u64>,
    open: &mut HashSet<(RunKey, u64)>,
    report: &mut VerifyReport,
) {
    let kind = key.first().copied().unwrap_or(u8::MAX);
    let result: std::result::Result<(), String> = (|| {
        match kind {
            k if k == Kind::Meta as u8 => {
                let f: FormatRecord = decodes(key, value)?;
                if f.version > FORMAT_VERSION {
                    return Err(format!(
                        "format {} is newer than this fenced reads ({FORMAT_VERSION})",
                        f.version
                    ));
                }
                report.format_version = f.version;
            }
            k if k == Kind::Run as u8 => {
                let mut run: RunRecord = decodes(key, value)?;
                let rk = keys::run_key(&run.tenant, &run.run_id);
                if key != keys::run(&rk).as_slice() {
                    return Err(format!(
                        "holds run {:?} of tenant {:?}, which is stored under another key",
                        run.run_id, run.tenant
                    ));
                }
                // The stored count may lag (format 5): the branch logs past it are the truth.
                catch_up(&rk, &mut run)
                    .map_err(|e| format!("its branch logs could not be read: {e}"))?;
                runs.insert(rk, run.next_seq);
                report.runs += 1;
            }
            k if k == Kind::Effect as u8 => {
                let rec: EffectRecord = decodes(key, value)?;
                let Some((rk, seq)) = keys::decode_effect(key) else {
                    return Err("is not an effect key".into());
                };
                if rec.seq != seq {
                    return Err(format!("holds effect {} under number {seq}", rec.seq));
                }
                if rec.is_open() {
                    open.insert((rk, seq));
                }
                check_run(runs, key, Some(seq), report);
                report.effects += 1;
            }
            k if k == Kind::StepKey as u8
                || k == Kind::Intent as u8
                || k == Kind::BranchLog as u8 =>
            {
                let entry: IndexEntry = decodes(key, value)?;
                check_run(runs, key, Some(entry.seq), report);
            }
            k if k == Kind::Checkpoint as u8 => {
                decodes::<CheckpointRecord>(key, value)?;
                check_run(runs, key, None, report);
            }
            k if k == Kind::Restore as u8 => {
                decodes::<RestoreRecord>(key, value)?;
                check_run(runs, key, None, report);
            }
            k if k == Kind::ToolHead as u8 => {
                decodes::<ToolHead>(key, value)?;
                report.tools += 1;
            }
            k if k == Kind::Tool as u8 => {
                decodes::<ToolRecord>(key, value)?;
            }
            k if k == Kind::Credential as u8 => {
                decodes::<CredentialRecord>(key, value)?;
                report.credentials += 1;
            }
            k if k == Kind::Expiry as u8 => {
                if keys::decode_expiry(key).is_none() || !value.is_empty() {
                    return Err("is not an expiry index entry".into());
                }
            }
            k if k == Kind::TenantRun as u8 => {
                if keys::decode_tenant_run(key).is_none() || !value.is_empty() {
                    return Err("is not a run index entry".into());
                }
            }
            k if k == Kind::Open as u8 => {
                let Some((rk, seq)) = keys::decode_open(key).filter(|_| value.is_empty()) else {
                    return Err("is not an open-effect index entry".into());
                };
                if !open.remove(&(rk, seq)) {
                    return Err(format!(
                        "indexes effect {seq} as open, which is settled or absent"
                    ));
                }
            }
            other => return Err(format!("has an unknown record kind {other:#04x}")),
        }
        Ok(())
    })();
    if let Err(why) = result {
        report.problem(key, why);
    }
}
