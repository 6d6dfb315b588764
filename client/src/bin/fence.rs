//! `fence`: the operator's command line for a running `fenced` (over gRPC, with the clients'
//! token, tenant and TLS settings).
//!
//! ```text
//! fence health
//! fence run show RUN [--json]
//! fence effects list RUN [--branch B] [--state effect_unknown] [--json]
//! fence effect show EFFECT_ID [--json]
//! fence export RUN   # the run's audit trail: every effect on every branch, one JSON per line
//! fence tools show NAME [--version N] [--json]
//! fence reconcile EFFECT_ID (--failed-before-input | --completed RESULT) --evidence TEXT
//! ```
//!
//! Exit codes: 0 done; 1 the server refused or failed the request; 2 bad usage; 3 the server
//! could not be reached; 4 the run or effect does not exist.

use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use fence_client::{EffectFilter, EffectState, Error, FenceClient, Finding, Receipt};
use tonic::transport::{Certificate, ClientTlsConfig};

/// Inspect and settle what a Fence server recorded.
#[derive(Debug, Parser)]
#[command(name = "fence", version)]
struct Args {
    /// The Fence server.
    #[arg(
        long,
        env = "FENCE_URL",
        default_value = "http://127.0.0.1:50051",
        global = true
    )]
    url: String,
    /// Bearer token (its tenant is the token's).
    #[arg(long, env = "FENCE_TOKEN", global = true, hide_env_values = true)]
    token: Option<String>,
    /// Tenant, for a server in dev mode (no tokens).
    #[arg(long, env = "FENCE_TENANT", global = true)]
    tenant: Option<String>,
    /// PEM CA certificate to verify an https:// server with.
    #[arg(long, env = "FENCE_CA_CERT", global = true)]
    ca_cert: Option<std::path::PathBuf>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Is the server up and serving? (exit 0 if so, 3 if not)
    Health,
    /// A run: epoch, branches, checkpoints, pending replays, restores.
    Run {
        #[command(subcommand)]
        command: RunCommand,
    },
    /// A run's effects.
    Effects {
        #[command(subcommand)]
        command: EffectsCommand,
    },
    /// One effect.
    Effect {
        #[command(subcommand)]
        command: EffectCommand,
    },
    /// Registered tools.
    Tools {
        #[command(subcommand)]
        command: ToolsCommand,
    },
    /// A run's audit trail: every effect it recorded on every branch (rewound and carried
    /// ones included), in recording order, one JSON object per line.
    Export {
        /// The run.
        run_id: String,
    },
    /// Settle an effect whose outcome is unknown, after checking the downstream system.
    Reconcile {
        /// The effect's id.
        effect_id: String,
        /// It did not happen: the next call of it runs it.
        #[arg(
            long,
            conflicts_with = "completed",
            required_unless_present = "completed"
        )]
        failed_before_input: bool,
        /// It happened, with this result: calls of it replay it.
        #[arg(long)]
        completed: Option<String>,
        /// What you checked (kept for audit).
        #[arg(long)]
        evidence: String,
    },
}

#[derive(Debug, Subcommand)]
enum RunCommand {
    /// Show a run.
    Show {
        /// The run.
        run_id: String,
        /// As one JSON object.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Debug, Subcommand)]
enum ToolsCommand {
    /// Show a tool's registration: class, intent schema, retention, lease.
    Show {
        /// The tool's name.
        name: String,
        /// A given version (default: the current one).
        #[arg(long)]
        version: Option<u32>,
        /// As one JSON object.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Debug, Subcommand)]
enum EffectCommand {
    /// Show an effect's receipt.
    Show {
        /// The effect's id.
        effect_id: String,
        /// As one JSON object.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Debug, Subcommand)]
enum EffectsCommand {
    /// List a run's effects (every branch, or one).
    List {
        /// The run.
        run_id: String,
        /// Only this branch's own effects.
        #[arg(long)]
        branch: Option<String>,
        /// Only effects in this state (e.g. effect_unknown, completed, accepted).
        #[arg(long)]
        state: Option<String>,
        /// One JSON object per effect, one per line, instead of a table.
        #[arg(long)]
        json: bool,
    },
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let args = Args::parse();
    match run(args).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(failure) => {
            eprintln!("fence: {}", failure.message);
            ExitCode::from(failure.code)
        }
    }
}

/// Why a command failed, and its exit code.
struct Failure {
    code: u8,
    message: String,
}

impl From<Error> for Failure {
    fn from(e: Error) -> Self {
        let code = match &e {
            Error::Connect(_) => 3,
            Error::Rpc { code, .. } if *code == tonic::Code::Unavailable => 3,
            Error::Rpc { code, .. } if *code == tonic::Code::NotFound => 4,
            Error::Refused { refusal, .. }
                if refusal.reason == fence_client::ReasonCode::UnknownRecord =>
            {
                4
            }
            _ => 1,
        };
        // The refusal's own sentence says what to do; other errors carry their cause.
        let message = match e.refusal() {
            Some(r) => format!("{}: {}", r.reason, r.message),
            None => format!("{e}"),
        };
        Failure { code, message }
    }
}

fn usage(message: String) -> Failure {
    Failure { code: 2, message }
}

async fn connect(args: &Args) -> Result<FenceClient, Failure> {
    let mut builder = FenceClient::builder(args.url.clone())
        .connect_timeout(Duration::from_secs(5))
        .request_timeout(Duration::from_secs(30));
    if let Some(token) = &args.token {
        builder = builder.bearer_token(token.clone());
    }
    if let Some(tenant) = &args.tenant {
        builder = builder.tenant(tenant.clone());
    }
    if let Some(path) = &args.ca_cert {
        let pem = std::fs::read(path)
            .map_err(|e| usage(format!("cannot read {}: {e}", path.display())))?;
        builder = builder.tls(ClientTlsConfig::new().ca_certificate(Certificate::from_pem(pem)));
    }
    builder.connect().await.map_err(|e| Failure {
        code: 3,
        message: format!("cannot reach {}: {e}", args.url),
    })
}

async fn run(args: Args) -> Result<(), Failure> {
    let client = connect(&args).await?;
    match args.command {
        Command::Health => {
            // The cheapest authenticated call: an unknown run answers NOT_FOUND when serving.
            match client.get_run("fence-cli-health-check").await {
                Ok(_) => {}
                Err(e) => {
                    let failure = Failure::from(e);
                    if failure.code != 4 {
                        return Err(failure);
                    }
                }
            }
            println!("serving");
            Ok(())
        }
        Command::Effects {
            command:
                EffectsCommand::List {
                    run_id,
                    branch,
                    state,
                    json,
                },
        } => {
            let wanted = match state {
                Some(s) => Some(EffectState::from_str_name(&s.to_uppercase()).ok_or_else(|| {
                    usage(format!(
                        "--state {s:?} is not a state (accepted, running, completed, failed_before_input, effect_unknown, compensated)"
                    ))
                })?),
                None => None,
            };
            let mut filter = EffectFilter::run(run_id);
            if let Some(b) = branch {
                filter = filter.branch(b);
            }
            let effects: Vec<Receipt> = client
                .list_effects(&filter)
                .await?
                .into_iter()
                .filter(|r| wanted.is_none_or(|w| r.state == w))
                .collect();
            if json {
                for r in &effects {
                    println!("{}", receipt_json(r));
                }
            } else {
                print_table(&effects);
            }
            Ok(())
        }
        Command::Run {
            command: RunCommand::Show { run_id, json },
        } => {
            let run = client.get_run(&run_id).await?;
            if json {
                println!("{}", run_json(&run));
            } else {
                print_run(&run);
            }
            Ok(())
        }
        Command::Effect {
            command: EffectCommand::Show { effect_id, json },
        } => {
            let outcome = client
                .query_outcome(fence_client::OutcomeKey::EffectId(effect_id.clone()))
                .await?;
            let Some(receipt) = outcome.receipt else {
                return Err(Failure {
                    code: 4,
                    message: format!("effect {effect_id} does not exist"),
                });
            };
            if json {
                println!("{}", receipt_json(&receipt));
            } else {
                for (k, v) in receipt_json(&receipt).as_object().into_iter().flatten() {
                    println!(
                        "{k:<16} {}",
                        v.as_str().map_or_else(|| v.to_string(), str::to_owned)
                    );
                }
            }
            Ok(())
        }
        Command::Tools {
            command:
                ToolsCommand::Show {
                    name,
                    version,
                    json,
                },
        } => {
            let tool = client.get_tool(&name, version).await?;
            let line = serde_json::json!({
                "name": tool.def.name,
                "version": tool.version,
                "class": tool.def.class.as_str_name(),
                "volatile_fields": tool.def.intent_schema.volatile_fields,
                "normalized_fields": tool.def.intent_schema.normalized_fields,
                "string_normalization": format!("{:?}", tool.def.intent_schema.string_normalization),
                "retention_ms": tool.def.retention_ms,
                "lease_ms": tool.def.lease_ms,
                "registered_at_ms": tool.registered_at_ms,
            });
            if json {
                println!("{line}");
            } else {
                for (k, v) in line.as_object().into_iter().flatten() {
                    println!(
                        "{k:<22} {}",
                        v.as_str().map_or_else(|| v.to_string(), str::to_owned)
                    );
                }
            }
            Ok(())
        }
        Command::Export { run_id } => {
            // Listed in sequence order: the order Fence recorded them.
            for r in &client.list_effects(&EffectFilter::run(run_id)).await? {
                let mut line = receipt_json(r);
                line["arguments_json"] = serde_json::Value::String(r.arguments_json.clone());
                line["evidence"] = serde_json::Value::String(r.evidence.clone());
                println!("{line}");
            }
            Ok(())
        }
        Command::Reconcile {
            effect_id,
            failed_before_input,
            completed,
            evidence,
        } => {
            let finding = match (failed_before_input, completed) {
                (true, _) => Finding::FailedBeforeInput(evidence.clone()),
                (false, Some(result)) => Finding::Completed(result.into_bytes()),
                (false, None) => {
                    return Err(usage(
                        "say what happened: --failed-before-input or --completed RESULT".into(),
                    ));
                }
            };
            let receipt = client.reconcile(&effect_id, 0, &evidence, finding).await?;
            println!("{} is now {}", receipt.effect_id, receipt.state);
            Ok(())
        }
    }
}

fn print_table(effects: &[Receipt]) {
    println!(
        "{:<50} {:<20} {:<24} {:<24} {:>8} {:>7}",
        "EFFECT", "STATE", "TOOL", "STEP KEY", "POSITION", "ATTEMPT"
    );
    for r in effects {
        println!(
            "{:<50} {:<20} {:<24} {:<24} {:>8} {:>7}",
            r.effect_id,
            r.state,
            r.tool,
            r.step_key.as_deref().unwrap_or("-"),
            r.position,
            r.attempt
        );
    }
}

fn print_run(run: &fence_client::RunInfo) {
    println!(
        "run {} at epoch {}, {} effects",
        run.run_id, run.epoch, run.effect_count
    );
    println!(
        "\n{:<24} {:<24} {:>8} {:>16} {:>15}  RESTORED FROM",
        "BRANCH", "FORKED FROM", "LENGTH", "PENDING REPLAYS", "PENDING CARRIED"
    );
    for b in &run.branches {
        println!(
            "{:<24} {:<24} {:>8} {:>16} {:>15}  {}",
            b.name,
            b.forked_from_checkpoint.as_deref().unwrap_or("-"),
            b.length,
            b.pending_replays,
            b.pending_carried,
            b.restored_from_checkpoint.as_deref().unwrap_or("-")
        );
    }
    println!(
        "\n{:<32} {:<24} {:>8} {:>6}",
        "CHECKPOINT", "BRANCH", "POSITION", "EPOCH"
    );
    for c in &run.checkpoints {
        println!(
            "{:<32} {:<24} {:>8} {:>6}",
            c.checkpoint_id, c.branch, c.position, c.epoch
        );
    }
    if !run.restores.is_empty() {
        println!(
            "\n{:>6} {:<32} {:<24} {:>8}",
            "EPOCH", "RESTORED TO", "BRANCH", "REPLAYS"
        );
        for r in &run.restores {
            println!(
                "{:>6} {:<32} {:<24} {:>8}",
                r.epoch,
                r.checkpoint_id,
                r.branch,
                r.tape_effect_ids.len()
            );
        }
    }
}

fn run_json(run: &fence_client::RunInfo) -> serde_json::Value {
    serde_json::json!({
        "run_id": run.run_id,
        "epoch": run.epoch,
        "effect_count": run.effect_count,
        "created_at_ms": run.created_at_ms,
        "branches": run.branches.iter().map(|b| serde_json::json!({
            "name": b.name,
            "parent": b.parent,
            "forked_from_checkpoint": b.forked_from_checkpoint,
            "fork_position": b.fork_position,
            "length": b.length,
            "pending_replays": b.pending_replays,
            "pending_carried": b.pending_carried,
            "restored_from_checkpoint": b.restored_from_checkpoint,
        })).collect::<Vec<_>>(),
        "checkpoints": run.checkpoints.iter().map(|c| serde_json::json!({
            "checkpoint_id": c.checkpoint_id,
            "branch": c.branch,
            "position": c.position,
            "epoch": c.epoch,
        })).collect::<Vec<_>>(),
        "restores": run.restores.iter().map(|r| serde_json::json!({
            "epoch": r.epoch,
            "checkpoint_id": r.checkpoint_id,
            "branch": r.branch,
            "tape_effect_ids": r.tape_effect_ids,
        })).collect::<Vec<_>>(),
    })
}

fn receipt_json(r: &Receipt) -> serde_json::Value {
    serde_json::json!({
        "effect_id": r.effect_id,
        "run_id": r.run_id,
        "branch": r.branch,
        "epoch": r.epoch,
        "position": r.position,
        "tool": r.tool,
        "tool_version": r.tool_version,
        "class": r.class.as_str_name(),
        "step_key": r.step_key,
        "state": r.state.as_str_name(),
        "result": String::from_utf8_lossy(&r.result),
        "detail": r.detail,
        "downstream_key": r.downstream_key,
        "attempt": r.attempt,
        "created_at_ms": r.created_at_ms,
        "updated_at_ms": r.updated_at_ms,
    })
}
