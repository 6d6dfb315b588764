//! The fault-injection benchmark: simulated agents run multi-step workflows against the
//! simulated world ([`crate::world`]) through one of three protections, while faults strike
//! at every phase of their calls; the world counts what really happened.
//!
//! Arms, run with the same seed (so the same workflows, faults and model drift):
//! - `naive`: no protection; a failed or restored call is simply sent again;
//! - `uuid-key`: the usual idempotency key: the UUID the model wrote into the arguments,
//!   which the downstream deduplicates on (and which a model rewrites on every restore);
//! - `fence`: every call goes through the real Fence server (a `fenced` child process, killed
//!   with SIGKILL and restarted during the run), with its downstream key.
//!
//! Oracles, per arm: effects intended and executed, duplicate effects (one intent executed
//! twice), resurrected credentials (an approval token used twice), false replays (a call with a
//! changed intent answered with another call's result), false forks (a call that changed only
//! volatile fields refused as different), lost acknowledgements (a grant, completion or spent
//! credential that Fence acknowledged and later did not have), and, to be complete, intent
//! changes that executed without anyone deciding so, and intended effects never executed.

mod agent;
mod fence;
mod plain;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::PathBuf;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::Result;

use crate::scenario::{FaultParams, ModelParams, Workflow};
use crate::world::World;

pub use fence::FenceOptions;

/// Which protection an arm uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ArmKind {
    /// No protection.
    Naive,
    /// Deduplication on the UUID the model wrote.
    UuidKey,
    /// Fence.
    Fence,
}

impl ArmKind {
    /// The arm's name in reports and on the command line.
    pub fn name(self) -> &'static str {
        match self {
            ArmKind::Naive => "naive retry",
            ArmKind::UuidKey => "UUID idempotency key",
            ArmKind::Fence => "Fence",
        }
    }

    /// Parses `naive`, `uuid` or `fence`.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "naive" => Some(ArmKind::Naive),
            "uuid" | "uuid-key" => Some(ArmKind::UuidKey),
            "fence" => Some(ArmKind::Fence),
            _ => None,
        }
    }
}

/// Settings of a run.
#[derive(Debug, Clone)]
pub struct Config {
    /// The seed: the same seed gives the same workflows, faults and drift.
    pub seed: u64,
    /// Run enough workflows for at least this many faults (as the naive arm meets them).
    pub faults: u64,
    /// Concurrent agents.
    pub agents: usize,
    /// Fault schedule knobs.
    pub fault_params: FaultParams,
    /// Model knobs.
    pub model: ModelParams,
    /// Fraction of workflows whose framework gives steps durable step keys.
    pub step_key_rate: f64,
    /// The arms to run, in order.
    pub arms: Vec<ArmKind>,
    /// Print every action of this workflow to stderr (debugging).
    pub trace: Option<u64>,
    /// The Fence arm's server.
    pub fence: FenceOptions,
}

impl Config {
    /// The defaults of `fence-faults`.
    pub fn new(seed: u64, faults: u64) -> Self {
        Self {
            seed,
            faults,
            agents: 128,
            fault_params: FaultParams {
                fault_rate: 0.5,
                more_rate: 0.35,
                kill_every: 1000,
            },
            model: ModelParams {
                intent_drift: 0.1,
                fork_rate: 0.5,
                uuid_keep: 0.15,
                uuid_reuse: 0.02,
            },
            step_key_rate: 0.5,
            arms: vec![ArmKind::Naive, ArmKind::UuidKey, ArmKind::Fence],
            trace: None,
            fence: FenceOptions {
                binary: None,
                lease_ms: 300,
                data_dir: None,
            },
        }
    }
}

/// The workflows of a run: enough for the naive arm (which never waits, so this is quick) to
/// meet `cfg.faults` faults. Every arm then runs these same workflows; a step's scheduled
/// faults are met only as often as the step is attempted, so the other arms' counts differ a
/// little (a replayed step is not attempted again). Returns the workflows and the naive arm's
/// fault count.
pub async fn workflows(cfg: &Config) -> (Vec<Workflow>, u64) {
    let quiet = Config {
        trace: None,
        ..cfg.clone()
    };
    let cfg = &quiet;
    let mut out = Vec::new();
    let mut met = 0;
    let mut id = 0;
    while met < cfg.faults {
        let w = Workflow::new(cfg.seed, id, cfg.step_key_rate);
        let world = World::new();
        if w.car_sold_out {
            for g in 0..64 {
                world.sell_out(&w.trip(g));
            }
        }
        let probe = plain::Plain {
            world: &world,
            uuid_key: false,
        };
        let tally = Tally::default();
        agent::run_all(cfg, std::slice::from_ref(&w), &probe, &world, &tally).await;
        met += tally
            .faults
            .into_inner()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .sum::<u64>();
        out.push(w);
        id += 1;
    }
    (out, met)
}

/// Counters an arm's agents share.
#[derive(Debug, Default)]
pub struct Tally {
    faults: Mutex<BTreeMap<&'static str, u64>>,
    planned: Mutex<HashSet<String>>,
    intended: Mutex<HashSet<String>>,
    false_replays: AtomicU64,
    false_forks: AtomicU64,
    refused_changes: AtomicU64,
    forks: AtomicU64,
    restores: AtomicU64,
    abandoned: AtomicU64,
    errors: AtomicU64,
    first_errors: Mutex<Vec<String>>,
}

impl Tally {
    fn fault(&self, name: &'static str) {
        *self
            .faults
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(name)
            .or_default() += 1;
    }

    fn intend(&self, tag: String) {
        self.intended
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(tag);
    }

    fn plan(&self, tag: String) {
        self.planned
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(tag);
    }

    fn bump(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }

    fn error(&self, what: String) {
        Self::bump(&self.errors);
        let mut first = self.first_errors.lock().unwrap_or_else(|e| e.into_inner());
        if first.len() < 20 {
            first.push(what);
        }
    }
}

/// One arm's results.
#[derive(Debug, Clone)]
pub struct ArmReport {
    /// The arm.
    pub arm: ArmKind,
    /// Workflows run.
    pub workflows: u64,
    /// Faults injected, by kind.
    pub faults: BTreeMap<&'static str, u64>,
    /// Distinct intents the agents planned (including deliberate changes).
    pub intended: u64,
    /// Real effects in the world.
    pub executed: u64,
    /// Executions of an intent past its first.
    pub duplicates: u64,
    /// Approval tokens accepted again after their one use.
    pub resurrections: u64,
    /// Calls with a changed intent answered with another call's result.
    pub false_replays: u64,
    /// Calls that changed only volatile fields, refused as different.
    pub false_forks: u64,
    /// Acknowledged grants, completions or credential uses missing afterwards (Fence only).
    pub lost_acks: Option<u64>,
    /// Effects of intent changes nobody decided (a redirected call that executed).
    pub unsanctioned: u64,
    /// Planned intents an agent completed a step for that never happened in the world (it
    /// got another call's result, or its call was redirected).
    pub unresolved: u64,
    /// Intent changes refused (FORK_REQUIRED, ARGUMENT_MISMATCH, CREDENTIAL_CONSUMED).
    pub refused_changes: u64,
    /// Deliberate changes continued on a fork.
    pub forks: u64,
    /// Checkpoint restores.
    pub restores: u64,
    /// `kill -9` of the Fence server.
    pub kills: u64,
    /// Workflows given up (a volatile-only call refused).
    pub abandoned: u64,
    /// Unexpected answers (each one is a finding).
    pub errors: u64,
    /// The first unexpected answers, verbatim.
    pub first_errors: Vec<String>,
    /// Some intents executed more than once, with the idempotency key of each execution.
    pub duplicate_samples: Vec<(String, Vec<Option<String>>)>,
    /// Some intended effects that never happened.
    pub unresolved_samples: Vec<String>,
    /// Wall time of the arm.
    pub elapsed: Duration,
}

impl ArmReport {
    /// Faults injected in total.
    pub fn faults_injected(&self) -> u64 {
        self.faults.values().sum()
    }
}

fn report(
    arm: ArmKind,
    workflows: u64,
    world: &World,
    tally: Tally,
    lost_acks: Option<u64>,
    kills: u64,
    elapsed: Duration,
) -> ArmReport {
    let totals = world.totals();
    let intended = tally
        .intended
        .into_inner()
        .unwrap_or_else(|e| e.into_inner());
    let planned = tally
        .planned
        .into_inner()
        .unwrap_or_else(|e| e.into_inner());
    let duplicates = totals
        .effects
        .values()
        .map(|n| u64::from(n.saturating_sub(1)))
        .sum();
    let executed_tags: HashMap<&String, u32> =
        totals.effects.iter().map(|(k, v)| (k, *v)).collect();
    // Executed, though no plan ever held it: an accidental or redirected change.
    let unsanctioned = totals
        .effects
        .keys()
        .filter(|t| !planned.contains(*t))
        .count() as u64;
    // Believed done, never executed (a sold-out car is never "done"; a deliberate change is
    // planned before its step completes).
    let mut unresolved_samples: Vec<String> = intended
        .iter()
        .filter(|t| !executed_tags.contains_key(t) && !totals.rejected.contains(*t))
        .cloned()
        .collect();
    let unresolved = unresolved_samples.len() as u64;
    unresolved_samples.sort();
    unresolved_samples.truncate(10);
    let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
    ArmReport {
        arm,
        workflows,
        faults: tally.faults.into_inner().unwrap_or_else(|e| e.into_inner()),
        intended: planned.len() as u64,
        executed: totals.executed,
        duplicates,
        resurrections: totals.resurrections,
        false_replays: get(&tally.false_replays),
        false_forks: get(&tally.false_forks),
        lost_acks,
        unsanctioned,
        unresolved,
        refused_changes: get(&tally.refused_changes),
        forks: get(&tally.forks),
        restores: get(&tally.restores),
        kills,
        abandoned: get(&tally.abandoned),
        errors: get(&tally.errors),
        first_errors: tally
            .first_errors
            .into_inner()
            .unwrap_or_else(|e| e.into_inner()),
        duplicate_samples: totals.duplicate_samples.clone(),
        unresolved_samples,
        elapsed,
    }
}

/// Runs every arm of `cfg` and returns their reports, in `cfg.arms` order.
pub async fn run(cfg: &Config) -> Result<Vec<ArmReport>> {
    let (flows, _) = workflows(cfg).await;
    let mut reports = Vec::new();
    for &arm in &cfg.arms {
        let started = Instant::now();
        let world = World::new();
        for w in flows.iter().filter(|w| w.car_sold_out) {
            for g in 0..64 {
                world.sell_out(&w.trip(g));
            }
        }
        let tally = Tally::default();
        let (lost_acks, kills) = match arm {
            ArmKind::Naive | ArmKind::UuidKey => {
                let protection = plain::Plain {
                    world: &world,
                    uuid_key: arm == ArmKind::UuidKey,
                };
                agent::run_all(cfg, &flows, &protection, &world, &tally).await;
                (None, 0)
            }
            ArmKind::Fence => {
                let fence = fence::FenceArm::start(cfg, &world).await?;
                agent::run_all(cfg, &flows, &fence, &world, &tally).await;
                let lost = fence.verify_acks().await?;
                let kills = fence.kills();
                fence.stop().await;
                (Some(lost), kills)
            }
        };
        reports.push(report(
            arm,
            flows.len() as u64,
            &world,
            tally,
            lost_acks,
            kills,
            started.elapsed(),
        ));
    }
    Ok(reports)
}

/// The comparison table (Markdown), one row per arm.
pub fn table(reports: &[ArmReport]) -> String {
    let mut out = String::from(
        "| arm | faults injected | effects intended | effects executed | duplicate effects | resurrected credentials | false replays | false forks | lost acks | unsanctioned intent changes executed | intended never executed |\n\
         |---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for r in reports {
        out.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |\n",
            r.arm.name(),
            r.faults_injected(),
            r.intended,
            r.executed,
            r.duplicates,
            r.resurrections,
            r.false_replays,
            r.false_forks,
            r.lost_acks
                .map_or_else(|| "n/a".to_owned(), |n| n.to_string()),
            r.unsanctioned,
            r.unresolved,
        ));
    }
    out
}

/// The injected faults by kind, and the arms' other counters.
pub fn details(reports: &[ArmReport]) -> String {
    let mut out = String::new();
    let kinds: std::collections::BTreeSet<&str> = reports
        .iter()
        .flat_map(|r| r.faults.keys().copied())
        .collect();
    out.push_str("| fault | ");
    out.push_str(
        &reports
            .iter()
            .map(|r| r.arm.name())
            .collect::<Vec<_>>()
            .join(" | "),
    );
    out.push_str(" |\n|---|");
    out.push_str(&"---:|".repeat(reports.len()));
    out.push('\n');
    for k in kinds {
        out.push_str(&format!("| {k} |"));
        for r in reports {
            out.push_str(&format!(" {} |", r.faults.get(k).copied().unwrap_or(0)));
        }
        out.push('\n');
    }
    out.push('\n');
    for r in reports {
        out.push_str(&format!(
            "{}: {} workflows, {} restores, {} intent changes refused, {} forks, {} kill -9, {} abandoned, {} unexpected answers, {:.1} s\n",
            r.arm.name(),
            r.workflows,
            r.restores,
            r.refused_changes,
            r.forks,
            r.kills,
            r.abandoned,
            r.errors,
            r.elapsed.as_secs_f64()
        ));
        for e in &r.first_errors {
            out.push_str(&format!("  ! {e}\n"));
        }
        if r.arm == ArmKind::Fence {
            for (tag, keys) in &r.duplicate_samples {
                out.push_str(&format!(
                    "  ! executed {} times: {tag} (keys {keys:?})\n",
                    keys.len()
                ));
            }
            for tag in &r.unresolved_samples {
                out.push_str(&format!("  ? intended, never executed: {tag}\n"));
            }
        }
    }
    out
}

/// Where the Fence arm keeps its data when no directory is given.
pub fn default_data_dir() -> PathBuf {
    std::env::temp_dir().join(format!("fence-faults-{}", std::process::id()))
}
