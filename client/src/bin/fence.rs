//! `fence`: the operator's command line for a running `fenced` (over gRPC, with the clients'
//! token, tenant and TLS settings).
//!
//! ```text
//! fence health
//! fence runs list [--prefix P] [--json]
//! fence run show RUN [--json]
//! fence effects list RUN [--branch B] [--state effect_unknown] [--json]
//! fence effects unsettled [--state effect_unknown] [--json]   # across all runs
//! fence effect show EFFECT_ID [--json]
//! fence export RUN [--format jsonl]   # the audit trail: every effect on every branch, one JSON per line
//! fence tools list [--json]
//! fence tools show NAME [--version N] [--json]
//! fence tools register FILE   # a JSON tool definition, or an array of them ("-": stdin)
//! fence reconcile EFFECT_ID (--failed-before-input | --completed RESULT) --evidence TEXT
//! fence backup create DIR [--json]   # DIR: a new absolute path on the server's machine
//! fence backup verify DIR [--json]
//! fence store compact [--json]   # drop expired payloads on disk now, reclaim space
//! ```
//!
//! Exit codes: 0 done; 1 the server refused or failed the request; 2 bad usage; 3 the server
//! could not be reached; 4 the run, effect or directory does not exist; 5 a backup verified as
//! damaged.

use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use fence_client::{
    EffectFilter, EffectState, Error, FenceClient, Finding, OperationClass, Receipt,
    RegisteredTool, StringNormalization, ToolDef,
};
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
    /// The tenant's runs.
    Runs {
        #[command(subcommand)]
        command: RunsCommand,
    },
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
        /// The output format: `jsonl`, one JSON object per effect and line (the only one).
        #[arg(long, default_value = "jsonl", value_parser = ["jsonl"])]
        format: String,
    },
    /// Back the whole ledger up while the server serves, or verify a backup (needs an admin
    /// token in token mode).
    Backup {
        #[command(subcommand)]
        command: BackupCommand,
    },
    /// The server's store (needs an admin token in token mode).
    Store {
        #[command(subcommand)]
        command: StoreCommand,
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
enum StoreCommand {
    /// Compact the whole store now: finished effects past their retention window lose their
    /// payload on disk too (the server does this in the background within
    /// `--retention-compaction-hours`), and space is reclaimed. Rewrites every table file.
    Compact {
        /// As one JSON object.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Debug, Subcommand)]
enum BackupCommand {
    /// Write a consistent copy of the ledger into DIR, a new directory on the server's
    /// machine; it is verified before the command returns. Restore: start `fenced --data-dir`
    /// on it (or on a copy).
    Create {
        /// The new directory (absolute, on the server's machine).
        dir: String,
        /// As one JSON object.
        #[arg(long)]
        json: bool,
    },
    /// Read and check every record of a backup (exit 5 when it is damaged).
    Verify {
        /// The backup's directory (absolute, on the server's machine).
        dir: String,
        /// As one JSON object.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Debug, Subcommand)]
enum RunsCommand {
    /// List runs in run-id order: epoch, effects, branches, pending replays.
    List {
        /// Only runs whose id starts with this.
        #[arg(long, default_value = "")]
        prefix: String,
        /// One JSON object per run, one per line, instead of a table.
        #[arg(long)]
        json: bool,
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
    /// List the registered tools (current versions), by name.
    List {
        /// One JSON object per tool, one per line (as `tools show --json` prints it).
        #[arg(long)]
        json: bool,
    },
    /// Register tools from a JSON file: one definition or an array of them, each as
    /// `tools show --json` prints it: {"name", "class" (e.g. "NON_RETRYABLE"),
    /// "volatile_fields", "normalized_fields", "string_normalization" ("exact", "trim",
    /// "trim_lowercase"), "retention_ms", "lease_ms"}; only "name" and "class" are required.
    /// An unchanged definition keeps its version.
    Register {
        /// The file ("-" reads standard input).
        file: std::path::PathBuf,
    },
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
    /// List the effects not settled yet across all runs: granted, running, or of unknown
    /// outcome (`--state effect_unknown`: the ones to reconcile).
    Unsettled {
        /// Only effects in this state (accepted, running, effect_unknown).
        #[arg(long)]
        state: Option<String>,
        /// One JSON object per effect, one per line, instead of a table.
        #[arg(long)]
        json: bool,
    },
}

/// The effect state a `--state` flag names.
fn state_flag(state: Option<String>) -> Result<Option<EffectState>, Failure> {
    state
        .map(|s| {
            EffectState::from_str_name(&s.to_uppercase()).ok_or_else(|| {
                usage(format!(
                    "--state {s:?} is not a state (accepted, running, completed, failed_before_input, effect_unknown, compensated)"
                ))
            })
        })
        .transpose()
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
            let wanted = state_flag(state)?;
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
                print_table(&effects, false);
            }
            Ok(())
        }
        Command::Effects {
            command: EffectsCommand::Unsettled { state, json },
        } => {
            let wanted = state_flag(state)?;
            let effects = client.list_unsettled_effects(wanted).await?;
            if json {
                for r in &effects {
                    println!("{}", receipt_json(r));
                }
            } else {
                print_table(&effects, true);
            }
            Ok(())
        }
        Command::Store {
            command: StoreCommand::Compact { json },
        } => {
            let done = client.compact_store().await?;
            let line = serde_json::json!({
                "bytes_before": done.bytes_before,
                "bytes_after": done.bytes_after,
                "took_ms": done.took_ms,
            });
            if json {
                println!("{line}");
            } else {
                println!(
                    "compacted in {} ms: {} bytes before, {} after",
                    done.took_ms, done.bytes_before, done.bytes_after
                );
            }
            Ok(())
        }
        Command::Backup { command } => {
            let (dir, json) = match &command {
                BackupCommand::Create { dir, json } | BackupCommand::Verify { dir, json } => {
                    (dir.clone(), *json)
                }
            };
            if !std::path::Path::new(&dir).is_absolute() {
                return Err(usage(format!(
                    "{dir:?}: give the directory as an absolute path on the server's machine"
                )));
            }
            let (report, mut line) = match command {
                BackupCommand::Create { .. } => {
                    let backup = client.create_backup(&dir).await?;
                    let line = serde_json::json!({
                        "dir": backup.dir,
                        "bytes": backup.bytes,
                        "created_at_ms": backup.created_at_ms,
                    });
                    (backup.report, line)
                }
                BackupCommand::Verify { .. } => (
                    client.verify_backup(&dir).await?,
                    serde_json::json!({ "dir": dir }),
                ),
            };
            line["format_version"] = report.format_version.into();
            line["records"] = report.records.into();
            line["runs"] = report.runs.into();
            line["effects"] = report.effects.into();
            line["tools"] = report.tools.into();
            line["credentials"] = report.credentials.into();
            line["problem_count"] = report.problem_count.into();
            line["problems"] = report.problems.clone().into();
            if json {
                println!("{line}");
            } else {
                for (k, v) in line.as_object().into_iter().flatten() {
                    if k != "problems" {
                        println!(
                            "{k:<16} {}",
                            v.as_str().map_or_else(|| v.to_string(), str::to_owned)
                        );
                    }
                }
                for p in &report.problems {
                    println!("problem          {p}");
                }
            }
            if report.is_sound() {
                Ok(())
            } else {
                Err(Failure {
                    code: 5,
                    message: format!(
                        "{dir}: {} problems found; do not restore from it",
                        report.problem_count
                    ),
                })
            }
        }
        Command::Runs {
            command: RunsCommand::List { prefix, json },
        } => {
            let runs = client.list_runs(&prefix).await?;
            if json {
                for run in &runs {
                    println!("{}", run_summary_json(run));
                }
            } else {
                print_runs(&runs);
            }
            Ok(())
        }
        Command::Tools {
            command: ToolsCommand::List { json },
        } => {
            let mut tools = client.list_tools().await?;
            tools.sort_by(|a, b| a.def.name.cmp(&b.def.name));
            if json {
                for tool in &tools {
                    println!("{}", tool_json(tool));
                }
            } else {
                println!(
                    "{:<32} {:>7} {:<22} {:<13} VOLATILE FIELDS",
                    "TOOL", "VERSION", "CLASS", "RETENTION MS"
                );
                for t in &tools {
                    println!(
                        "{:<32} {:>7} {:<22} {:<13} {}",
                        t.def.name,
                        t.version,
                        t.def.class.as_str_name(),
                        t.def.retention_ms,
                        t.def.intent_schema.volatile_fields.join(",")
                    );
                }
            }
            Ok(())
        }
        Command::Tools {
            command: ToolsCommand::Register { file },
        } => {
            let text = if file.as_os_str() == "-" {
                std::io::read_to_string(std::io::stdin())
            } else {
                std::fs::read_to_string(&file)
            }
            .map_err(|e| usage(format!("cannot read {}: {e}", file.display())))?;
            let defs =
                tool_defs(&text).map_err(|why| usage(format!("{}: {why}", file.display())))?;
            for def in defs {
                let name = def.name.clone();
                let stored = client.register_tool(def).await?;
                let what = if stored.created {
                    "registered"
                } else {
                    "unchanged"
                };
                println!("{name} v{} {what}", stored.value.version);
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
            let line = tool_json(&tool);
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
        Command::Export { run_id, format: _ } => {
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

/// A table of receipts, with a RUN column when they come from several runs.
fn print_table(effects: &[Receipt], with_run: bool) {
    let run = |r: &str| {
        if with_run {
            format!("{r:<32} ")
        } else {
            String::new()
        }
    };
    println!(
        "{}{:<50} {:<20} {:<24} {:<24} {:>8} {:>7}",
        run("RUN"),
        "EFFECT",
        "STATE",
        "TOOL",
        "STEP KEY",
        "POSITION",
        "ATTEMPT"
    );
    for r in effects {
        println!(
            "{}{:<50} {:<20} {:<24} {:<24} {:>8} {:>7}",
            run(&r.run_id),
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

fn print_runs(runs: &[fence_client::RunInfo]) {
    println!(
        "{:<40} {:>6} {:>8} {:>8} {:>16} {:>15}",
        "RUN", "EPOCH", "EFFECTS", "BRANCHES", "PENDING REPLAYS", "PENDING CARRIED"
    );
    for run in runs {
        println!(
            "{:<40} {:>6} {:>8} {:>8} {:>16} {:>15}",
            run.run_id,
            run.epoch,
            run.effect_count,
            run.branches.len(),
            run.branches.iter().map(|b| b.pending_replays).sum::<u64>(),
            run.branches.iter().map(|b| b.pending_carried).sum::<u64>(),
        );
    }
}

/// The string-normalisation names the tool JSON uses.
const NORMALIZATIONS: [(&str, StringNormalization); 3] = [
    ("exact", StringNormalization::Exact),
    ("trim", StringNormalization::Trim),
    ("trim_lowercase", StringNormalization::TrimLowercase),
];

fn tool_json(tool: &RegisteredTool) -> serde_json::Value {
    let schema = &tool.def.intent_schema;
    let normalization = NORMALIZATIONS
        .iter()
        .find(|(_, n)| *n == schema.string_normalization)
        .map_or("exact", |(name, _)| name);
    serde_json::json!({
        "name": tool.def.name,
        "version": tool.version,
        "class": tool.def.class.as_str_name(),
        "volatile_fields": schema.volatile_fields,
        "normalized_fields": schema.normalized_fields,
        "string_normalization": normalization,
        "retention_ms": tool.def.retention_ms,
        "lease_ms": tool.def.lease_ms,
        "registered_at_ms": tool.registered_at_ms,
    })
}

/// Tool definitions from the JSON `tools register` reads (see its help). The fields `tools
/// show --json` adds (`version`, `registered_at_ms`) are accepted and ignored, so its output
/// registers as is; any other field is refused, so a misspelt one cannot go unnoticed.
fn tool_defs(text: &str) -> Result<Vec<ToolDef>, String> {
    use serde_json::Value;
    let value: Value = serde_json::from_str(text).map_err(|e| format!("not JSON: {e}"))?;
    let items = match value {
        Value::Array(items) => items,
        one => vec![one],
    };
    items
        .into_iter()
        .enumerate()
        .map(|(i, item)| {
            let Value::Object(fields) = item else {
                return Err(format!("definition {i} is not a JSON object"));
            };
            let text = |key: &str| -> Result<Option<String>, String> {
                match fields.get(key) {
                    None | Some(Value::Null) => Ok(None),
                    Some(Value::String(s)) => Ok(Some(s.clone())),
                    Some(other) => Err(format!("definition {i}: {key} must be a string, not {other}")),
                }
            };
            let list = |key: &str| -> Result<Vec<String>, String> {
                match fields.get(key) {
                    None | Some(Value::Null) => Ok(Vec::new()),
                    Some(Value::Array(items)) => items
                        .iter()
                        .map(|v| {
                            v.as_str().map(str::to_owned).ok_or_else(|| {
                                format!("definition {i}: {key} must hold strings, not {v}")
                            })
                        })
                        .collect(),
                    Some(other) => Err(format!("definition {i}: {key} must be a list, not {other}")),
                }
            };
            let millis = |key: &str| -> Result<u64, String> {
                match fields.get(key) {
                    None | Some(Value::Null) => Ok(0),
                    Some(v) => v.as_u64().ok_or_else(|| {
                        format!("definition {i}: {key} must be a whole number of milliseconds, not {v}")
                    }),
                }
            };
            const KNOWN: [&str; 9] = [
                "name", "class", "volatile_fields", "normalized_fields", "string_normalization",
                "retention_ms", "lease_ms", "version", "registered_at_ms",
            ];
            if let Some(unknown) = fields.keys().find(|k| !KNOWN.contains(&k.as_str())) {
                return Err(format!(
                    "definition {i}: unknown field {unknown:?} (known: {})",
                    KNOWN.join(", ")
                ));
            }
            let name = text("name")?.ok_or_else(|| format!("definition {i} has no name"))?;
            let class_name = text("class")?.ok_or_else(|| format!("tool {name:?} has no class"))?;
            let class = OperationClass::from_str_name(&class_name.to_uppercase())
                .ok_or_else(|| {
                    format!(
                        "tool {name:?}: class {class_name:?} is not one of SAFE_RETRY, DEDUPLICATE, REQUIRES_EFFECT_CHECK, NON_RETRYABLE"
                    )
                })?;
            let normalization = match text("string_normalization")? {
                None => StringNormalization::Exact,
                Some(n) => NORMALIZATIONS
                    .iter()
                    .find(|(name, _)| name.eq_ignore_ascii_case(&n))
                    .map(|(_, v)| *v)
                    .ok_or_else(|| {
                        format!(
                            "tool {name:?}: string_normalization {n:?} is not one of exact, trim, trim_lowercase"
                        )
                    })?,
            };
            let mut def = ToolDef::new(name, class);
            def.intent_schema.volatile_fields = list("volatile_fields")?;
            def.intent_schema.normalized_fields = list("normalized_fields")?;
            def.intent_schema.string_normalization = normalization;
            def.retention_ms = millis("retention_ms")?;
            def.lease_ms = millis("lease_ms")?;
            Ok(def)
        })
        .collect()
}

fn run_summary_json(run: &fence_client::RunInfo) -> serde_json::Value {
    let mut line = run_json(run);
    if let Some(fields) = line.as_object_mut() {
        // A listing does not carry them (GetRun does): leave them out rather than show none.
        fields.remove("checkpoints");
        fields.remove("restores");
    }
    line
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
