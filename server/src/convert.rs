//! Conversions between the generated `fence.v1` types and the ledger's domain types. Generated
//! types stop here: requests are validated into commands (a missing or unknown field is
//! INVALID_ARGUMENT naming the field), records become receipts.

use fence_proto::v1 as pb;

use crate::ledger::begin::Begun;
use crate::ledger::credentials::CredentialDef;
use crate::ledger::outcome::{ListQuery, OutcomeKey};
use crate::ledger::records::{
    BranchRecord, CheckpointRecord, CredentialRecord, EffectRecord, RestoreRecord, ToolRecord,
};
use crate::ledger::runs::{CheckpointCmd, ForkCmd, Restored, RunView};
use crate::ledger::{
    BeginCmd, CredentialUse, Decision, EffectId, Finding, LedgerError, Outcome, Refusal, ToolDef,
};
use crate::store::codec::hex;
use crate::store::keys;

type Result<T> = std::result::Result<T, LedgerError>;

/// A receipt for a record (`recorded` false: an unrecorded SAFE_RETRY grant, no effect id).
pub fn receipt(rec: EffectRecord, recorded: bool) -> pb::Receipt {
    // The run key (a hash of tenant and run id) only if an id is shown.
    let shown = recorded || rec.compensates_seq != 0 || rec.compensated_by_seq != 0;
    let rk = shown.then(|| keys::run_key(&rec.tenant, &rec.run_id));
    let id_of = move |seq: u64| match rk {
        Some(run_key) if seq != 0 => EffectId { run_key, seq }.to_string(),
        _ => String::new(),
    };
    pb::Receipt {
        effect_id: if recorded {
            id_of(rec.seq)
        } else {
            String::new()
        },
        run_id: rec.run_id,
        branch: rec.branch_name,
        epoch: rec.epoch,
        position: rec.position,
        tool: rec.tool,
        tool_version: rec.tool_version,
        class: rec.class,
        step_key: rec.step_key,
        intent_fingerprint: hex(&rec.intent_fp),
        request_fingerprint: hex(&rec.request_fp),
        occurrence: rec.occurrence,
        state: rec.state,
        result: rec.result,
        detail: rec.detail,
        downstream_key: rec.downstream_key,
        attempt: rec.attempt,
        lease_expires_at_ms: rec.lease_expires_at_ms,
        created_at_ms: rec.created_at_ms,
        updated_at_ms: rec.updated_at_ms,
        expires_at_ms: rec.expires_at_ms,
        tombstone: rec.tombstone,
        evidence: rec.evidence,
        replays: rec.replays,
        last_replay_epoch: rec.last_replay_epoch,
        credential_hashes: rec.credential_hashes.iter().map(|h| hex(h)).collect(),
        saga_id: rec.saga_id,
        compensation: (!rec.compensation_tool.is_empty()).then_some(pb::Compensation {
            tool: rec.compensation_tool,
            arguments_json: rec.compensation_arguments,
        }),
        compensates_effect_id: id_of(rec.compensates_seq),
        compensated_by_effect_id: id_of(rec.compensated_by_seq),
        arguments_json: rec.arguments_json,
        deliberate_repeat: rec.deliberate_repeat,
        parent_checkpoint_id: rec.parent_checkpoint_id,
    }
}

/// A refusal message.
pub fn refusal(r: Refusal) -> pb::Refusal {
    pb::Refusal {
        reason: r.reason.code(),
        recovery: r.recovery.code(),
        receipt: r.receipt.map(|rec| receipt(*rec, true)),
        message: r.message,
        checkpoint_id: r.checkpoint_id,
        current_epoch: r.current_epoch,
    }
}

/// The Begin response.
pub fn begin_response(b: Begun) -> pb::BeginResponse {
    use pb::decision::Outcome as O;
    let outcome = match b.decision {
        Decision::Execute {
            receipt: rec,
            recorded,
        } => {
            // The receipt holds the same effect id (empty unless recorded): derived once.
            let receipt = receipt(*rec, recorded);
            O::Execute(pb::Execute {
                effect_id: receipt.effect_id.clone(),
                downstream_key: receipt.downstream_key.clone(),
                lease_expires_at_ms: receipt.lease_expires_at_ms,
                attempt: receipt.attempt,
                receipt: Some(receipt),
            })
        }
        Decision::Replay(rec) => O::Replay(pb::Replay {
            receipt: Some(receipt(*rec, true)),
        }),
        Decision::InProgress {
            receipt: rec,
            retry_after_ms,
        } => O::InProgress(pb::InProgress {
            receipt: Some(receipt(*rec, true)),
            retry_after_ms,
        }),
        Decision::Refused(r) => O::Refused(refusal(*r)),
    };
    pb::BeginResponse {
        decision: Some(pb::Decision {
            outcome: Some(outcome),
        }),
        epoch: b.epoch,
    }
}

impl TryFrom<pb::BeginRequest> for BeginCmd {
    type Error = LedgerError;

    fn try_from(r: pb::BeginRequest) -> Result<Self> {
        Ok(Self {
            run_id: r.run_id,
            branch: r.branch,
            epoch: r.epoch,
            tool: r.tool,
            arguments_json: r.arguments_json,
            step_key: r.step_key,
            deliberate_repeat: r.deliberate_repeat,
            credentials: r
                .credentials
                .into_iter()
                .map(|c| CredentialUse {
                    token: c.token,
                    budget: c.budget,
                })
                .collect(),
            lease_ms: r.lease_ms,
            record: r.record,
            saga_id: r.saga_id,
            compensation: r.compensation.map(|c| (c.tool, c.arguments_json)),
            compensates_effect_id: r.compensates_effect_id,
            request_id: r.request_id,
            parent_checkpoint_id: r.parent_checkpoint_id,
        })
    }
}

/// A tool registration from the API (unknown enum values are refused).
pub fn tool_def(r: pb::RegisterToolRequest) -> Result<ToolDef> {
    let t = r
        .tool
        .ok_or_else(|| LedgerError::invalid("tool", "is required"))?;
    let class = pb::OperationClass::try_from(t.class)
        .ok()
        .filter(|c| *c != pb::OperationClass::Unspecified)
        .ok_or_else(|| {
            LedgerError::invalid(
                "tool.class",
                format!(
                    "{} is not SAFE_RETRY, DEDUPLICATE, REQUIRES_EFFECT_CHECK or NON_RETRYABLE",
                    t.class
                ),
            )
        })?;
    let schema = t.intent_schema.unwrap_or_default();
    pb::StringNormalization::try_from(schema.string_normalization).map_err(|_| {
        LedgerError::invalid(
            "tool.intent_schema.string_normalization",
            format!(
                "{} is not a known normalization",
                schema.string_normalization
            ),
        )
    })?;
    Ok(ToolDef {
        name: t.name,
        class: class as i32,
        volatile_fields: schema.volatile_fields,
        normalized_fields: schema.normalized_fields,
        string_rule: schema.string_normalization,
        retention_ms: t.retention_ms,
        lease_ms: t.lease_ms,
    })
}

/// A tool record as the API's spec.
pub fn tool_spec(t: &ToolRecord) -> pb::ToolSpec {
    pb::ToolSpec {
        name: t.name.clone(),
        class: t.class,
        intent_schema: Some(pb::IntentSchema {
            volatile_fields: t.volatile_fields.clone(),
            normalized_fields: t.normalized_fields.clone(),
            string_normalization: t.string_rule,
        }),
        retention_ms: t.retention_ms,
        lease_ms: t.lease_ms,
        version: t.version,
        registered_at_ms: t.registered_at_ms,
    }
}

/// A branch.
pub fn branch_info(run: &crate::ledger::records::RunRecord, b: &BranchRecord) -> pb::BranchInfo {
    pb::BranchInfo {
        name: b.name.clone(),
        parent: b
            .parent
            .and_then(|p| run.branches.get(p as usize))
            .map(|p| p.name.clone())
            .unwrap_or_default(),
        forked_from_checkpoint: b.forked_from_checkpoint.clone(),
        fork_position: b.fork_position,
        reason: b.reason.clone(),
        length: b.length,
        pending_replays: b.tape_seqs.len() as u64,
        pending_carried: b.carried_seqs.len() as u64,
        restored_from_checkpoint: b.restored_from_checkpoint.clone(),
        created_epoch: b.created_epoch,
        created_at_ms: b.created_at_ms,
    }
}

/// A checkpoint.
pub fn checkpoint_info(c: &CheckpointRecord) -> pb::CheckpointInfo {
    pb::CheckpointInfo {
        checkpoint_id: c.checkpoint_id.clone(),
        branch: c.branch_name.clone(),
        position: c.position,
        epoch: c.epoch,
        created_at_ms: c.created_at_ms,
    }
}

fn restore_event(run: &crate::ledger::records::RunRecord, r: &RestoreRecord) -> pb::RestoreEvent {
    let rk = keys::run_key(&run.tenant, &run.run_id);
    pb::RestoreEvent {
        epoch: r.epoch,
        checkpoint_id: r.checkpoint_id.clone(),
        branch: r.branch_name.clone(),
        tape_effect_ids: r
            .tape_seqs
            .iter()
            .map(|s| {
                EffectId {
                    run_key: rk,
                    seq: *s,
                }
                .to_string()
            })
            .collect(),
        at_ms: r.at_ms,
    }
}

/// A run.
pub fn run_info(v: &RunView) -> pb::RunInfo {
    pb::RunInfo {
        run_id: v.run.run_id.clone(),
        epoch: v.run.epoch,
        branches: v
            .run
            .branches
            .iter()
            .map(|b| branch_info(&v.run, b))
            .collect(),
        checkpoints: v.checkpoints.iter().map(checkpoint_info).collect(),
        restores: v
            .restores
            .iter()
            .map(|r| restore_event(&v.run, r))
            .collect(),
        effect_count: v.run.next_seq.saturating_sub(1),
        created_at_ms: v.run.created_at_ms,
    }
}

/// A checkpoint command.
pub fn checkpoint_cmd(r: pb::CheckpointRequest) -> CheckpointCmd {
    CheckpointCmd {
        run_id: r.run_id,
        branch: r.branch,
        epoch: r.epoch,
        checkpoint_id: r.checkpoint_id,
        parent_checkpoint_id: r.parent_checkpoint_id,
    }
}

/// A fork command.
pub fn fork_cmd(r: pb::ForkRequest) -> ForkCmd {
    ForkCmd {
        run_id: r.run_id,
        checkpoint_id: r.checkpoint_id,
        epoch: r.epoch,
        new_branch: r.new_branch,
        reason: r.reason,
    }
}

/// The Restore response.
pub fn restore_response(r: &Restored) -> pb::RestoreResponse {
    pb::RestoreResponse {
        epoch: r.epoch,
        branch: r.branch.clone(),
        tape: r
            .tape
            .iter()
            .map(|rec| receipt(rec.clone(), true))
            .collect(),
    }
}

/// A Complete outcome (exactly one is required).
pub fn outcome(o: Option<pb::complete_request::Outcome>) -> Result<Outcome> {
    use pb::complete_request::Outcome as O;
    match o {
        Some(O::Result(r)) => Ok(Outcome::Completed(r)),
        Some(O::FailedBeforeInput(f)) => Ok(Outcome::FailedBeforeInput(f.detail)),
        Some(O::Unknown(u)) => Ok(Outcome::Unknown(u.detail)),
        None => Err(LedgerError::invalid(
            "outcome",
            "exactly one of result, failed_before_input or unknown is required",
        )),
    }
}

/// A Reconcile finding (exactly one is required).
pub fn finding(o: Option<pb::reconcile_request::Outcome>) -> Result<Finding> {
    use pb::reconcile_request::Outcome as O;
    match o {
        Some(O::CompletedResult(r)) => Ok(Finding::Completed(r)),
        Some(O::FailedBeforeInput(f)) => Ok(Finding::FailedBeforeInput(f.detail)),
        None => Err(LedgerError::invalid(
            "outcome",
            "exactly one of completed_result or failed_before_input is required",
        )),
    }
}

/// A QueryOutcome key (exactly one is required).
pub fn outcome_key(k: Option<pb::query_outcome_request::Key>) -> Result<OutcomeKey> {
    use pb::query_outcome_request::Key as K;
    match k {
        Some(K::EffectId(id)) => Ok(OutcomeKey::EffectId(id)),
        Some(K::StepKey(s)) => Ok(OutcomeKey::StepKey {
            run_id: s.run_id,
            branch: s.branch,
            step_key: s.step_key,
        }),
        Some(K::Intent(i)) => Ok(OutcomeKey::Intent {
            run_id: i.run_id,
            branch: i.branch,
            tool: i.tool,
            arguments_json: i.arguments_json,
        }),
        None => Err(LedgerError::invalid(
            "key",
            "exactly one of effect_id, step_key or intent is required",
        )),
    }
}

/// A page of effects as ListEffects and ListUnsettledEffects answer it.
pub fn effects_page(
    effects: Vec<EffectRecord>,
    next_page_token: String,
) -> pb::ListEffectsResponse {
    pb::ListEffectsResponse {
        effects: effects.into_iter().map(|e| receipt(e, true)).collect(),
        next_page_token,
    }
}

/// A ListEffects query.
pub fn list_query(r: pb::ListEffectsRequest) -> ListQuery {
    ListQuery {
        run_id: r.run_id,
        branch: r.branch,
        saga_id: r.saga_id,
        page_size: r.page_size,
        page_token: r.page_token,
        lineage: r.lineage,
    }
}

/// A credential registration.
pub fn credential_def(r: pb::RegisterCredentialRequest) -> CredentialDef {
    CredentialDef {
        token: r.token,
        budget: r.budget,
        bound_tool: r.bound_tool,
        bound_arguments_json: r.bound_arguments_json,
    }
}

/// A credential's state.
pub fn credential_info(c: &CredentialRecord) -> pb::CredentialInfo {
    pb::CredentialInfo {
        credential_hash: hex(&c.hash),
        budget: c.budget,
        uses: c.uses,
        bound_tool: c.bound_tool.clone(),
        bound_intent_fingerprint: hex(&c.bound_intent),
        spent_by_effect_ids: c
            .spent_by
            .iter()
            .filter_map(|r| {
                let run_key = r.run_key[..].try_into().ok()?;
                Some(
                    EffectId {
                        run_key,
                        seq: r.seq,
                    }
                    .to_string(),
                )
            })
            .collect(),
        created_at_ms: c.created_at_ms,
    }
}
