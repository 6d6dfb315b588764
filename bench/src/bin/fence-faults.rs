//! `fence-faults`: the fault-injection benchmark. Runs the same seeded workflows and faults
//! through three arms (naive retry, a UUID idempotency key, Fence) and prints what really
//! happened in the simulated world. Exits non-zero if Fence shows a duplicate, a resurrected
//! credential, a false replay or a lost acknowledgement.

use std::path::PathBuf;

use anyhow::{Result, bail};
use clap::Parser;
use fence_bench::faults::{self, ArmKind, Config};

/// Fault-injection benchmark: naive retry vs UUID idempotency key vs Fence.
#[derive(Debug, Parser)]
#[command(name = "fence-faults")]
struct Args {
    /// Seed: the same seed runs the same workflows, faults and model drift.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Run enough workflows for at least this many faults.
    #[arg(long, default_value_t = 10_000)]
    faults: u64,
    /// Concurrent agents.
    #[arg(long, default_value_t = 128)]
    agents: usize,
    /// Probability that a re-written call changes an intent field (amount, recipient, target).
    #[arg(long, default_value_t = 0.1)]
    intent_drift: f64,
    /// Probability that an intent change is deliberate (the owner would fork for it).
    #[arg(long, default_value_t = 0.5)]
    fork_rate: f64,
    /// Probability that a re-written call keeps the previous UUID.
    #[arg(long, default_value_t = 0.15)]
    uuid_keep: f64,
    /// Probability that a new call reuses another call's UUID (a memorised placeholder).
    #[arg(long, default_value_t = 0.02)]
    uuid_reuse: f64,
    /// Fraction of workflows whose framework gives every step a durable step key.
    #[arg(long, default_value_t = 0.5)]
    step_key_rate: f64,
    /// Probability that a step gets a fault.
    #[arg(long, default_value_t = 0.5)]
    fault_rate: f64,
    /// Probability of one more fault on the same step.
    #[arg(long, default_value_t = 0.35)]
    more_rate: f64,
    /// One fault in this many is a `kill -9` of the Fence server (0 = none).
    #[arg(long, default_value_t = 1000)]
    kill_every: u64,
    /// Lease of the Fence server (short, so stalled grants lapse quickly).
    #[arg(long, default_value_t = 300)]
    lease_ms: u64,
    /// The `fenced` binary (default: next to this executable, or $FENCED).
    #[arg(long)]
    fenced: Option<PathBuf>,
    /// Data dir of the Fence arm (default: a temp dir, removed afterwards).
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// Print every action of this workflow to stderr (debugging).
    #[arg(long)]
    trace: Option<u64>,
    /// Arms to run, comma-separated: naive, uuid, fence.
    #[arg(long, default_value = "naive,uuid,fence", value_delimiter = ',')]
    arms: Vec<String>,
}

#[tokio::main]
async fn main() -> Result<()> {
    let a = Args::parse();
    let mut cfg = Config::new(a.seed, a.faults);
    cfg.agents = a.agents;
    cfg.model.intent_drift = a.intent_drift;
    cfg.model.fork_rate = a.fork_rate;
    cfg.model.uuid_keep = a.uuid_keep;
    cfg.model.uuid_reuse = a.uuid_reuse;
    cfg.step_key_rate = a.step_key_rate;
    cfg.fault_params.fault_rate = a.fault_rate;
    cfg.fault_params.more_rate = a.more_rate;
    cfg.fault_params.kill_every = a.kill_every;
    cfg.fence.lease_ms = a.lease_ms;
    cfg.fence.binary = a.fenced;
    cfg.fence.data_dir = a.data_dir;
    cfg.trace = a.trace;
    cfg.arms = a
        .arms
        .iter()
        .map(|s| ArmKind::parse(s).ok_or_else(|| anyhow::anyhow!("unknown arm {s:?}")))
        .collect::<Result<_>>()?;

    let (flows, met) = faults::workflows(&cfg).await;
    eprintln!(
        "seed {}: {} workflows, {met} faults (as the naive arm meets them), {} agents",
        cfg.seed,
        flows.len(),
        cfg.agents
    );
    let reports = faults::run(&cfg).await?;
    println!("{}", faults::table(&reports));
    println!("{}", faults::details(&reports));
    if let Some(f) = reports.iter().find(|r| r.arm == ArmKind::Fence) {
        let bad = f.duplicates + f.resurrections + f.false_replays + f.lost_acks.unwrap_or(0);
        if bad > 0 || f.errors > 0 {
            bail!(
                "Fence failed with seed {}: {} duplicates, {} resurrections, {} false replays, {} lost acks, {} unexpected answers",
                cfg.seed,
                f.duplicates,
                f.resurrections,
                f.false_replays,
                f.lost_acks.unwrap_or(0),
                f.errors
            );
        }
    }
    Ok(())
}
