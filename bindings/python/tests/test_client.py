"""The sync client against the real server: decisions, refusals and structured errors."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import grpc
import pytest

import fence
from fence import (
    EffectState,
    Execute,
    FenceRefused,
    FenceRpcError,
    OperationClass,
    ReasonCode,
    RecoveryAction,
    Refusal,
    Replay,
    Run,
)

TRANSFER = "bank.transfer"


def transfer_args(amount: int = 100, to: str = "bob", **extra: object) -> dict:
    args = {
        "to": to,
        "amount": amount,
        "currency": "EUR",
        "reference": str(uuid.uuid4()),
        "timestamp": "2025-01-01T00:00:00Z",
    }
    args.update(extra)
    return args


def register_transfer(client: fence.Client, cls: OperationClass = OperationClass.NON_RETRYABLE) -> None:
    reg = client.register_tool(TRANSFER, cls, volatile_fields=["reference", "timestamp"])
    assert reg.tool.name == TRANSFER
    assert reg.tool.cls == cls
    assert reg.tool.version >= 1


def execute(result: fence.BeginResult) -> Execute:
    assert isinstance(result.decision, Execute), result.decision
    return result.decision


def refusal(result: fence.BeginResult) -> Refusal:
    assert isinstance(result.decision, Refusal), result.decision
    return result.decision


def test_register_tool_is_idempotent_and_versioned(client: fence.Client) -> None:
    first = client.register_tool("crm.update", OperationClass.DEDUPLICATE, volatile_fields=["request_id"])
    again = client.register_tool("crm.update", OperationClass.DEDUPLICATE, volatile_fields=["request_id"])
    assert first.created and not again.created
    assert again.tool.version == first.tool.version
    changed = client.register_tool("crm.update", OperationClass.NON_RETRYABLE, volatile_fields=["request_id"])
    assert changed.created and changed.tool.version == first.tool.version + 1
    current = client.get_tool("crm.update")
    assert current.cls == OperationClass.NON_RETRYABLE
    assert client.get_tool("crm.update", first.tool.version).cls == OperationClass.DEDUPLICATE
    assert current.intent_schema.volatile_fields == ("request_id",)


def test_grant_then_complete_then_query(client: fence.Client, run_id: str) -> None:
    register_transfer(client)
    run = Run(run_id)
    started = client.start_run(run)
    assert started.created and started.run.epoch == 1
    assert [b.name for b in started.run.branches] == ["main"]

    res = client.begin(run, TRANSFER, transfer_args(), step_key=f"{run_id}:pay")
    assert res.kind is fence.DecisionKind.EXECUTE
    ex = execute(res)
    assert ex.effect_id and ex.downstream_key and ex.attempt == 1
    assert ex.lease_expires_at_ms > 0
    assert ex.receipt is not None and ex.receipt.state == EffectState.ACCEPTED
    assert ex.receipt.cls == OperationClass.NON_RETRYABLE
    assert res.epoch == 1 and run.epoch == 1  # the handle learned its epoch

    receipt = client.complete(ex.effect_id, ex.attempt, res.epoch, result=b'{"tx":"T1"}')
    assert receipt.state == EffectState.COMPLETED
    assert receipt.result_json() == {"tx": "T1"}

    by_step = client.query_outcome(run=run, step_key=f"{run_id}:pay")
    assert by_step.state == EffectState.COMPLETED
    assert by_step.receipt is not None and by_step.receipt.effect_id == ex.effect_id
    by_id = client.query_outcome(effect_id=ex.effect_id)
    assert by_id.receipt is not None and by_id.receipt.result == b'{"tx":"T1"}'
    by_intent = client.query_outcome(run=run, tool=TRANSFER, arguments=transfer_args())
    assert by_intent.state == EffectState.COMPLETED
    nothing = client.query_outcome(run=run, step_key=f"{run_id}:never")
    assert nothing.state == EffectState.NOT_FOUND and nothing.receipt is None

    effects = list(client.iter_effects(run))
    assert [e.effect_id for e in effects] == [ex.effect_id]


def test_replay_same_step_same_intent_despite_volatile_fields(client: fence.Client, run_id: str) -> None:
    register_transfer(client)
    step = f"{run_id}:pay"
    first = execute(client.begin(run_id, TRANSFER, transfer_args(), step_key=step))
    client.complete(first.effect_id, first.attempt, 1, result=b'{"tx":"T1"}')

    # A regenerated call: fresh UUID, new timestamp, keys in another order.
    regenerated = json.dumps(
        {"timestamp": "2025-06-30T12:00:00Z", "reference": str(uuid.uuid4()), "currency": "EUR", "amount": 100, "to": "bob"}
    )
    res = client.begin(run_id, TRANSFER, regenerated, step_key=step)
    assert isinstance(res.decision, Replay), res.decision
    assert res.decision.receipt.effect_id == first.effect_id
    assert res.decision.receipt.result_json() == {"tx": "T1"}
    assert res.decision.receipt.downstream_key == first.downstream_key


def test_argument_mismatch(client: fence.Client, run_id: str) -> None:
    register_transfer(client)
    step = f"{run_id}:pay"
    first = execute(client.begin(run_id, TRANSFER, transfer_args(amount=100), step_key=step))
    client.complete(first.effect_id, first.attempt, 1, result=b"{}")
    ref = refusal(client.begin(run_id, TRANSFER, transfer_args(amount=900), step_key=step))
    assert ref.reason == ReasonCode.ARGUMENT_MISMATCH
    assert ref.recovery == RecoveryAction.FIX_ARGUMENT
    assert ref.receipt is not None and ref.receipt.effect_id == first.effect_id
    assert ref.message


def test_duplicate_intent_without_step_key_and_deliberate_repeat(client: fence.Client, run_id: str) -> None:
    register_transfer(client)
    first = execute(client.begin(run_id, TRANSFER, transfer_args()))
    client.complete(first.effect_id, first.attempt, 1, result=b'{"tx":"T1"}')

    ref = refusal(client.begin(run_id, TRANSFER, transfer_args()))
    assert ref.reason == ReasonCode.DUPLICATE_INTENT
    assert ref.recovery == RecoveryAction.CONFIRM_REPEAT
    assert ref.receipt is not None and ref.receipt.effect_id == first.effect_id

    second = execute(client.begin(run_id, TRANSFER, transfer_args(), deliberate_repeat=True))
    assert second.effect_id != first.effect_id
    assert second.downstream_key != first.downstream_key
    assert second.receipt is not None and second.receipt.occurrence == 2


def test_deduplicate_without_step_key_replays(client: fence.Client, run_id: str) -> None:
    client.register_tool("crm.upsert", OperationClass.DEDUPLICATE, volatile_fields=["request_id"])
    first = execute(client.begin(run_id, "crm.upsert", {"id": 7, "request_id": "a"}))
    client.complete(first.effect_id, first.attempt, 1, result=b'"ok"')
    res = client.begin(run_id, "crm.upsert", {"id": 7, "request_id": "b"})
    assert isinstance(res.decision, Replay) and res.decision.receipt.effect_id == first.effect_id


def test_restore_replays_equivalent_and_requires_fork_for_divergent(client: fence.Client, run_id: str) -> None:
    register_transfer(client)
    run = Run(run_id)
    client.start_run(run)
    cp = client.checkpoint(run, "before-pay")
    assert cp.created and cp.checkpoint.position == 0
    paid = execute(client.begin(run, TRANSFER, transfer_args(to="bob")))
    client.complete(paid.effect_id, paid.attempt, run.epoch, result=b'{"tx":"T1"}')

    restored = client.restore(run, "before-pay")
    assert restored.epoch == 2 and run.epoch == 2
    assert [r.effect_id for r in restored.tape] == [paid.effect_id]

    # A zombie from before the restore is fenced off.
    stale = refusal(client.begin(run_id, TRANSFER, transfer_args(to="bob"), epoch=1))
    assert stale.reason == ReasonCode.STALE_EPOCH
    assert stale.recovery == RecoveryAction.REFRESH_EPOCH
    assert stale.current_epoch == 2

    # A divergent call where the recorded payment is due: fork first.
    ref = refusal(client.begin(run, TRANSFER, transfer_args(to="carol")))
    assert ref.reason == ReasonCode.FORK_REQUIRED
    assert ref.recovery == RecoveryAction.FORK
    assert ref.checkpoint_id == "before-pay"
    assert ref.receipt is not None and ref.receipt.effect_id == paid.effect_id

    # The equivalent call (fresh volatile fields) replays.
    rep = client.begin(run, TRANSFER, transfer_args(to="bob"))
    assert isinstance(rep.decision, Replay), rep.decision
    assert rep.decision.receipt.effect_id == paid.effect_id
    assert rep.decision.receipt.result_json() == {"tx": "T1"}

    # Forking makes the divergent call a new effect on a new branch.
    branch = client.fork(run, ref.checkpoint_id, new_branch="to-carol", reason="redirected to Carol")
    assert branch.name == "to-carol" and run.branch == "to-carol"
    assert branch.parent == "main" and branch.forked_from_checkpoint == "before-pay"
    carol = execute(client.begin(run, TRANSFER, transfer_args(to="carol")))
    assert carol.effect_id != paid.effect_id
    assert carol.receipt is not None and carol.receipt.branch == "to-carol"
    info = client.get_run(run)
    assert info.epoch == 2
    assert info.branch("to-carol") is not None
    assert [r.checkpoint_id for r in info.restores] == ["before-pay"]


def test_credential_consumed_stays_consumed(client: fence.Client, run_id: str) -> None:
    register_transfer(client)
    token = f"approval-{uuid.uuid4()}".encode()
    reg = client.register_credential(token, budget=1)
    assert reg.created and reg.credential.budget == 1 and reg.credential.uses == 0
    assert token.hex() not in reg.credential.credential_hash

    run = Run(run_id)
    client.start_run(run)
    client.checkpoint(run, "start")
    spent = execute(client.begin(run, TRANSFER, transfer_args(amount=5), step_key=f"{run_id}:a", credentials=[token]))
    client.complete(spent.effect_id, spent.attempt, run.epoch, result=b'{"tx":"T5"}')
    info = client.get_credential(token)
    assert info.uses == 1 and info.spent_by_effect_ids == (spent.effect_id,)

    ref = refusal(client.begin(run, TRANSFER, transfer_args(amount=6), step_key=f"{run_id}:b", credentials=[token]))
    assert ref.reason == ReasonCode.CREDENTIAL_CONSUMED
    assert ref.recovery == RecoveryAction.REAUTHENTICATE

    # The exact replay of the effect that spent it gets the recorded result, not a new use.
    rep = client.begin(run, TRANSFER, transfer_args(amount=5), step_key=f"{run_id}:a", credentials=[token])
    assert isinstance(rep.decision, Replay) and rep.decision.receipt.effect_id == spent.effect_id

    # Authority does not resurrect on a restore + fork either.
    client.restore(run, "start")
    client.fork(run, "start", new_branch="retry")
    again = refusal(client.begin(run, TRANSFER, transfer_args(amount=7), credentials=[token]))
    assert again.reason == ReasonCode.CREDENTIAL_CONSUMED
    assert client.get_credential(token).uses == 1


def test_effect_unknown_requires_reconcile_with_evidence(client: fence.Client, run_id: str) -> None:
    register_transfer(client)
    step = f"{run_id}:pay"
    ex = execute(client.begin(run_id, TRANSFER, transfer_args(), step_key=step))
    assert client.complete(ex.effect_id, ex.attempt, 1, unknown="timeout after send").state == EffectState.EFFECT_UNKNOWN
    ref = refusal(client.begin(run_id, TRANSFER, transfer_args(), step_key=step))
    assert ref.reason == ReasonCode.RECONCILE_REQUIRED
    assert ref.recovery == RecoveryAction.RECONCILE

    with pytest.raises(fence.FenceError) as no_evidence:
        client.reconcile(ex.effect_id, 1, "  ", failed_before_input="bank has no record")
    e = no_evidence.value
    assert isinstance(e, (FenceRefused, FenceRpcError))
    assert getattr(e, "reason", None) == ReasonCode.EVIDENCE_REQUIRED or any(
        v.field == "evidence" for v in e.field_violations
    ), e
    assert client.query_outcome(effect_id=ex.effect_id).state == EffectState.EFFECT_UNKNOWN

    settled = client.reconcile(ex.effect_id, 1, "bank ledger lookup: no transfer with key", failed_before_input="not sent")
    assert settled.state == EffectState.FAILED_BEFORE_INPUT
    again = execute(client.begin(run_id, TRANSFER, transfer_args(), step_key=step))
    assert again.effect_id == ex.effect_id and again.downstream_key == ex.downstream_key
    assert again.attempt == ex.attempt + 1


# ------------------------------------------------------------------------------------------
# Structured errors from non-Begin RPCs
# ------------------------------------------------------------------------------------------


def test_result_conflict_is_a_structured_refusal(client: fence.Client, run_id: str) -> None:
    register_transfer(client)
    ex = execute(client.begin(run_id, TRANSFER, transfer_args()))
    client.complete(ex.effect_id, ex.attempt, 1, result=b'{"tx":"T1"}')
    # An identical repeat is fine.
    assert client.complete(ex.effect_id, ex.attempt, 1, result=b'{"tx":"T1"}').state == EffectState.COMPLETED
    with pytest.raises(FenceRefused) as err:
        client.complete(ex.effect_id, ex.attempt, 1, result=b'{"tx":"T2"}')
    e = err.value
    assert e.code == grpc.StatusCode.FAILED_PRECONDITION
    assert e.reason == ReasonCode.RESULT_CONFLICT
    assert e.recovery != RecoveryAction.RECOVERY_ACTION_UNSPECIFIED
    assert e.effect_id == ex.effect_id
    assert e.message
    assert e.details is not None and e.details.error_domain == fence.ERROR_DOMAIN


def test_unknown_effect_is_not_found_with_reason(client: fence.Client) -> None:
    with pytest.raises(FenceRefused) as err:
        client.complete("e" + "0" * 32 + f"{999:016x}", 1, 1, result=b"{}")
    assert err.value.code == grpc.StatusCode.NOT_FOUND
    assert err.value.reason == ReasonCode.UNKNOWN_RECORD
    assert err.value.recovery != RecoveryAction.RECOVERY_ACTION_UNSPECIFIED


def test_malformed_effect_id_is_invalid_argument_naming_the_field(client: fence.Client) -> None:
    with pytest.raises(FenceRpcError) as err:
        client.complete("no-such-effect", 1, 1, result=b"{}")
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert [v.field for v in err.value.field_violations] == ["effect_id"]


def test_restore_unknown_checkpoint_is_refused(client: fence.Client, run_id: str) -> None:
    client.start_run(run_id)
    with pytest.raises(FenceRefused) as err:
        client.restore(run_id, "no-such-checkpoint")
    assert err.value.reason == ReasonCode.UNKNOWN_RECORD
    assert err.value.code == grpc.StatusCode.NOT_FOUND


@pytest.mark.parametrize("bad_run_id", ["", "   ", "x" * 300])
def test_invalid_identifier_names_the_field(client: fence.Client, bad_run_id: str) -> None:
    with pytest.raises(fence.FenceError) as err:
        client.begin(bad_run_id, TRANSFER, transfer_args())
    e = err.value
    assert isinstance(e, (FenceRefused, FenceRpcError))
    assert e.code == grpc.StatusCode.INVALID_ARGUMENT
    assert any(v.field == "run_id" for v in e.field_violations), e.field_violations


def test_stale_epoch_on_complete_is_structured(client: fence.Client, run_id: str) -> None:
    register_transfer(client)
    run = Run(run_id)
    client.start_run(run)
    client.checkpoint(run, "c0")
    ex = execute(client.begin(run, TRANSFER, transfer_args()))
    client.restore(run, "c0")
    # A report naming no attempt is new work: fenced off by the restore.
    with pytest.raises(FenceRefused) as err:
        client.complete(ex.effect_id, 0, 1, result=b"{}")
    assert err.value.reason == ReasonCode.STALE_EPOCH
    assert err.value.recovery == RecoveryAction.REFRESH_EPOCH
    # The granted attempt's result is a fact: recorded whatever the epoch.
    done = client.complete(ex.effect_id, ex.attempt, 1, result=b"{}")
    assert done.state == fence.EffectState.COMPLETED


def test_batch_answers_each_call_as_if_sent_alone(client: fence.Client, run_id: str) -> None:
    register_transfer(client)
    run = Run(run_id)
    results = client.begin_batch(
        [
            fence.BeginCall(run, TRANSFER, transfer_args(100), step_key="flight"),
            fence.BeginCall(run, TRANSFER, transfer_args(200), step_key="hotel"),
            # The same step with another amount, granted earlier in this batch: a mismatch.
            fence.BeginCall(run, TRANSFER, transfer_args(999), step_key="flight"),
            # Malformed arguments: this call's error only, as Begin would have raised it.
            fence.BeginCall(run, TRANSFER, "{not json", step_key="car"),
        ]
    )
    assert len(results) == 4
    flight, hotel = execute(results[0]), execute(results[1])
    assert flight.downstream_key != hotel.downstream_key
    assert refusal(results[2]).reason == ReasonCode.ARGUMENT_MISMATCH
    bad = results[3]
    assert isinstance(bad, FenceRpcError) and bad.code == grpc.StatusCode.INVALID_ARGUMENT
    assert [v.field for v in bad.field_violations] == ["arguments_json"]

    done = client.complete_batch(
        [
            fence.CompleteCall(flight.effect_id, flight.attempt, result=b'{"pnr":"P1"}'),
            fence.CompleteCall(flight.effect_id, flight.attempt, result=b'{"pnr":"other"}'),
            fence.CompleteCall(hotel.effect_id, hotel.attempt, failed_before_input="connection refused"),
        ]
    )
    assert isinstance(done[0], fence.Receipt) and done[0].state == EffectState.COMPLETED
    assert isinstance(done[1], FenceRefused) and done[1].reason == ReasonCode.RESULT_CONFLICT
    assert isinstance(done[2], fence.Receipt) and done[2].state == EffectState.FAILED_BEFORE_INPUT

    again = client.begin_batch([fence.BeginCall(run, TRANSFER, transfer_args(100), step_key="flight")])
    assert isinstance(again[0].decision, Replay)
    assert again[0].decision.receipt.result_json() == {"pnr": "P1"}

    with pytest.raises(FenceRpcError) as empty:
        client.begin_batch([])
    assert empty.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_runs_and_tools_are_listed_page_by_page(client: fence.Client, run_id: str) -> None:
    register_transfer(client)
    client.register_tool(fence.ToolSpec(name="kb.search", cls=OperationClass.SAFE_RETRY))
    for suffix in ("c", "a", "b"):
        client.start_run(f"{run_id}-{suffix}")
    client.start_run("other-run")

    # Run-id order, a prefix, and pages of two that follow on from each other.
    first = client.list_runs(run_id_prefix=run_id, page_size=2)
    assert [r.run_id for r in first.runs] == [f"{run_id}-a", f"{run_id}-b"]
    assert first.next_page_token
    rest = client.list_runs(run_id_prefix=run_id, page_size=2, page_token=first.next_page_token)
    assert [r.run_id for r in rest.runs] == [f"{run_id}-c"] and rest.next_page_token == ""
    assert [r.run_id for r in client.iter_runs(page_size=1)] == [
        "other-run",
        f"{run_id}-a",
        f"{run_id}-b",
        f"{run_id}-c",
    ]
    assert all(r.epoch == 1 and r.branches[0].name == "main" for r in client.iter_runs())

    tools = {t.name: t for t in client.iter_tools(page_size=1)}
    assert set(tools) == {TRANSFER, "kb.search"}
    assert tools["kb.search"].cls == OperationClass.SAFE_RETRY and tools["kb.search"].version == 1


def test_unsettled_effects_are_listed_across_runs(client: fence.Client, run_id: str) -> None:
    register_transfer(client)
    first = execute(client.begin(f"{run_id}-a", TRANSFER, transfer_args(to="ann"), step_key="s"))
    second = execute(client.begin(f"{run_id}-b", TRANSFER, transfer_args(to="bob"), step_key="s"))
    client.complete(second.effect_id, second.attempt, 1, result=b'{"tx":"T2"}')
    unsettled = list(client.iter_unsettled_effects(page_size=1))
    assert [(r.run_id, r.effect_id) for r in unsettled] == [(f"{run_id}-a", first.effect_id)]
    assert unsettled[0].state == EffectState.ACCEPTED
    page = client.list_unsettled_effects(state=EffectState.EFFECT_UNKNOWN)
    assert page.effects == () and page.next_page_token == ""


def test_a_backup_is_written_and_verified(client: fence.Client, run_id: str, tmp_path: Path) -> None:
    register_transfer(client)
    ex = execute(client.begin(run_id, TRANSFER, transfer_args(), step_key="s"))
    client.complete(ex.effect_id, ex.attempt, 1, result=b'{"tx":"T1"}')
    backup = client.create_backup(str(tmp_path / "backup"))
    assert backup.report.sound and backup.report.effects >= 1 and backup.report.runs >= 1
    assert (tmp_path / "backup" / "credential.key").exists()
    again = client.verify_backup(backup.dir)
    assert again.sound and again.effects == backup.report.effects
    with pytest.raises(fence.FenceError) as err:
        client.create_backup(str(tmp_path / "backup"))
    assert err.value.code == grpc.StatusCode.ALREADY_EXISTS


def test_the_store_is_compacted_on_demand(client: fence.Client, run_id: str) -> None:
    register_transfer(client)
    ex = execute(client.begin(run_id, TRANSFER, transfer_args(), step_key="s"))
    client.complete(ex.effect_id, ex.attempt, 1, result=b'{"tx":"T1"}')
    done = client.compact_store()
    assert isinstance(done, fence.types.Compacted)
    assert done.bytes_after > 0
    # Compaction changes no answer: the effect replays as before.
    again = client.begin(run_id, TRANSFER, transfer_args(), step_key="s")
    assert isinstance(again.decision, Replay), again.decision
    assert again.decision.receipt.effect_id == ex.effect_id
    assert again.decision.receipt.result == b'{"tx":"T1"}'
