//! The gateway's own tools (`fence_checkpoint`, `fence_restore`, `fence_fork`,
//! `fence_outcome`): run history a host can reach through MCP alone, listed only when enabled
//! (`--fence-tools`), since a model should not time-travel by itself.

use std::sync::Arc;

use fence_client::{Error as FenceError, FenceClient, OutcomeKey};
use rmcp::model::{CallToolResult, JsonObject, Tool};
use serde_json::{Value, json};

/// The names of the gateway's tools.
pub const NAMES: [&str; 4] = [
    "fence_checkpoint",
    "fence_restore",
    "fence_fork",
    "fence_outcome",
];

fn schema(properties: Value, required: &[&str]) -> Arc<JsonObject> {
    let value = json!({"type": "object", "properties": properties, "required": required});
    Arc::new(value.as_object().cloned().unwrap_or_default())
}

/// The gateway's tools, as listed to the host.
pub fn definitions() -> Vec<Tool> {
    let run = json!({"type": "string", "description": "The Fence run (default: the gateway's default run)."});
    vec![
        Tool::new(
            "fence_checkpoint",
            "Record a checkpoint of the run: a point the host may later restore or fork from.",
            schema(
                json!({"run_id": run, "checkpoint_id": {"type": "string"},
                       "parent_checkpoint_id": {"type": "string"}, "branch": {"type": "string"},
                       "epoch": {"type": "integer", "minimum": 0}}),
                &["checkpoint_id"],
            ),
        ),
        Tool::new(
            "fence_restore",
            "Restore the run to a checkpoint: calls after it must replay what was done or fork.",
            schema(
                json!({"run_id": run, "checkpoint_id": {"type": "string"}}),
                &["checkpoint_id"],
            ),
        ),
        Tool::new(
            "fence_fork",
            "Start a new branch of the run at a checkpoint: different calls there are new effects.",
            schema(
                json!({"run_id": run, "checkpoint_id": {"type": "string"},
                       "epoch": {"type": "integer", "minimum": 0}, "new_branch": {"type": "string"},
                       "reason": {"type": "string"}}),
                &["checkpoint_id"],
            ),
        ),
        Tool::new(
            "fence_outcome",
            "What happened to a call: by effect id, or by step key on the run.",
            schema(
                json!({"run_id": run, "effect_id": {"type": "string"}, "step_key": {"type": "string"},
                       "branch": {"type": "string"}}),
                &[],
            ),
        ),
    ]
}

fn text(args: &JsonObject, name: &str) -> Result<Option<String>, String> {
    match args.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) if !s.is_empty() => Ok(Some(s.clone())),
        Some(other) => Err(format!("{name} must be a non-empty string, not {other}")),
    }
}

fn number(args: &JsonObject, name: &str) -> Result<u64, String> {
    match args.get(name) {
        None | Some(Value::Null) => Ok(0),
        Some(v) => v
            .as_u64()
            .ok_or_else(|| format!("{name} must be a non-negative integer, not {v}")),
    }
}

/// Runs the gateway's tool `name` (one of [`NAMES`]).
pub async fn call(
    fence: &FenceClient,
    default_run: &str,
    name: &str,
    args: &JsonObject,
) -> CallToolResult {
    match run(fence, default_run, name, args).await {
        Ok(value) => CallToolResult::structured(value),
        Err(Failure::Invalid(why)) => CallToolResult::structured_error(
            json!({"fence": {"reason": "INVALID_ARGUMENT", "detail": why}}),
        ),
        Err(Failure::Fence(e)) => {
            CallToolResult::structured_error(json!({"fence": fence_error(&e)}))
        }
    }
}

enum Failure {
    Invalid(String),
    Fence(FenceError),
}

impl From<String> for Failure {
    fn from(why: String) -> Self {
        Failure::Invalid(why)
    }
}

impl From<FenceError> for Failure {
    fn from(e: FenceError) -> Self {
        Failure::Fence(e)
    }
}

fn fence_error(e: &FenceError) -> Value {
    match e {
        FenceError::Refused { refusal, .. } => json!({
            "reason": refusal.reason.as_str_name(),
            "recovery": refusal.recovery.as_str_name(),
            "message": refusal.message,
        }),
        other => json!({"reason": "FENCE_ERROR", "detail": other.to_string()}),
    }
}

async fn run(
    fence: &FenceClient,
    default_run: &str,
    name: &str,
    args: &JsonObject,
) -> Result<Value, Failure> {
    let run_id = text(args, "run_id")?.unwrap_or_else(|| default_run.to_owned());
    let checkpoint = || -> Result<String, Failure> {
        Ok(text(args, "checkpoint_id")?.ok_or_else(|| "checkpoint_id is required".to_owned())?)
    };
    Ok(match name {
        "fence_checkpoint" => {
            let stored = fence
                .checkpoint_after(
                    &run_id,
                    &text(args, "branch")?.unwrap_or_default(),
                    number(args, "epoch")?,
                    &checkpoint()?,
                    &text(args, "parent_checkpoint_id")?.unwrap_or_default(),
                )
                .await?;
            json!({"checkpoint_id": stored.value.checkpoint_id, "branch": stored.value.branch,
                   "position": stored.value.position, "created": stored.created})
        }
        "fence_restore" => {
            let restored = fence.restore(&run_id, &checkpoint()?, None).await?;
            json!({"epoch": restored.epoch, "branch": restored.branch,
                   "tape": restored.tape.iter().map(|r| r.effect_id.clone()).collect::<Vec<_>>()})
        }
        "fence_fork" => {
            let forked = fence
                .fork(
                    &run_id,
                    &checkpoint()?,
                    number(args, "epoch")?,
                    text(args, "new_branch")?.as_deref(),
                    &text(args, "reason")?.unwrap_or_default(),
                )
                .await?;
            json!({"branch": forked.branch.name,
                   "carried": forked.carried.iter().map(|r| r.effect_id.clone()).collect::<Vec<_>>()})
        }
        _ => {
            let key = match (text(args, "effect_id")?, text(args, "step_key")?) {
                (Some(id), _) => OutcomeKey::EffectId(id),
                (None, Some(step_key)) => OutcomeKey::StepKey {
                    run_id,
                    branch: text(args, "branch")?,
                    step_key,
                },
                (None, None) => return Err("give effect_id or step_key".to_owned().into()),
            };
            let outcome = fence.query_outcome(key).await?;
            json!({"state": outcome.state.as_str_name(),
                   "effect_id": outcome.receipt.as_ref().map(|r| r.effect_id.clone()),
                   "result": outcome.receipt.as_ref().map(|r| String::from_utf8_lossy(&r.result).into_owned())})
        }
    })
}
