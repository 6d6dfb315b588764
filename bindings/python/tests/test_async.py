"""The asyncio client and the async decorator against the real server.

Each test drives its own event loop with ``asyncio.run`` (no pytest plugin needed).
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import grpc
import pytest

import fence
from fence import (
    AsyncClient,
    EffectState,
    Execute,
    FenceRefused,
    OperationClass,
    ReasonCode,
    RecoveryAction,
    Refusal,
    Replay,
    Run,
    WaitPolicy,
    fenced,
)

FAST = WaitPolicy(timeout_s=20.0, initial_backoff_s=0.02, max_backoff_s=0.2)


def args(amount: int = 10, to: str = "bob") -> dict[str, Any]:
    return {"to": to, "amount": amount, "reference": str(uuid.uuid4())}


def test_async_client_grant_replay_mismatch_and_errors(server: Any, tenant: str, run_id: str) -> None:
    async def scenario() -> None:
        async with AsyncClient(server.addr, tenant=tenant, timeout=20) as client:
            await client.register_tool("pay", OperationClass.NON_RETRYABLE, volatile_fields=["reference"])
            run = Run(run_id)
            started = await client.start_run(run)
            assert started.run.epoch == 1
            res = await client.begin(run, "pay", args(), step_key=f"{run_id}:s1")
            assert isinstance(res.decision, Execute)
            ex = res.decision
            receipt = await client.complete(ex.effect_id, ex.attempt, res.epoch, result=b'{"ok":true}')
            assert receipt.state == EffectState.COMPLETED

            rep = await client.begin(run, "pay", args(), step_key=f"{run_id}:s1")
            assert isinstance(rep.decision, Replay)
            assert rep.decision.receipt.result_json() == {"ok": True}

            mis = await client.begin(run, "pay", args(amount=11), step_key=f"{run_id}:s1")
            assert isinstance(mis.decision, Refusal)
            assert mis.decision.reason == ReasonCode.ARGUMENT_MISMATCH

            with pytest.raises(FenceRefused) as err:
                await client.complete(ex.effect_id, ex.attempt, res.epoch, result=b'{"ok":false}')
            assert err.value.reason == ReasonCode.RESULT_CONFLICT
            assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
            assert err.value.recovery != RecoveryAction.RECOVERY_ACTION_UNSPECIFIED

            with pytest.raises(FenceRefused) as nf:
                await client.heartbeat("e" + "0" * 32 + f"{999:016x}", 1, 1)
            assert nf.value.reason == ReasonCode.UNKNOWN_RECORD
            assert nf.value.code == grpc.StatusCode.NOT_FOUND

            effects = [r async for r in client.iter_effects(run)]
            assert [e.effect_id for e in effects] == [ex.effect_id]

    asyncio.run(scenario())


def test_async_decorator_execute_replay_and_refusals(server: Any, tenant: str, run_id: str) -> None:
    sent: list[tuple[str, int, str]] = []

    async def scenario() -> None:
        async with AsyncClient(server.addr, tenant=tenant, timeout=20) as client:

            @fenced(client, tool="bank.transfer", volatile_fields=["reference"], wait=FAST)
            async def transfer(to: str, amount: int, reference: str, downstream_key: str = "") -> dict:
                await asyncio.sleep(0)
                assert fence.current_execution().downstream_key == downstream_key
                sent.append((to, amount, downstream_key))
                return {"tx": f"T{len(sent)}"}

            import inspect

            assert inspect.iscoroutinefunction(transfer)
            run = Run(run_id)
            await client.start_run(run)
            await client.checkpoint(run, "cp")
            assert await transfer(**args(), fence_run=run, fence_step="pay") == {"tx": "T1"}
            assert await transfer(**args(), fence_run=run, fence_step="pay") == {"tx": "T1"}
            assert len(sent) == 1

            with pytest.raises(FenceRefused) as mismatch:
                await transfer(**args(amount=99), fence_run=run, fence_step="pay")
            assert mismatch.value.reason == ReasonCode.ARGUMENT_MISMATCH

            await client.restore(run, "cp")
            assert run.epoch == 2
            with pytest.raises(FenceRefused) as fork_required:
                await transfer(**args(to="carol"), fence_run=run)
            assert fork_required.value.reason == ReasonCode.FORK_REQUIRED
            assert fork_required.value.recovery == RecoveryAction.FORK
            assert await transfer(**args(), fence_run=run, fence_step="pay") == {"tx": "T1"}
            await client.fork(run, fork_required.value.checkpoint_id)
            assert await transfer(**args(to="carol"), fence_run=run) == {"tx": "T2"}
            assert [s[0] for s in sent] == ["bob", "carol"]

    asyncio.run(scenario())


def test_async_in_progress_and_failure_paths(server: Any, tenant: str, run_id: str) -> None:
    async def scenario() -> None:
        async with AsyncClient(server.addr, tenant=tenant, timeout=20) as client:
            release = asyncio.Event()
            started = asyncio.Event()
            runs: list[str] = []

            @fenced(client, tool="vm.create", cls=OperationClass.NON_RETRYABLE, wait=FAST)
            async def create(size: str) -> str:
                runs.append(size)
                started.set()
                await release.wait()
                return f"vm-{size}"

            run = Run(run_id)
            first = asyncio.ensure_future(create("xl", fence_run=run, fence_step="vm"))
            await asyncio.wait_for(started.wait(), 20)
            # A concurrent retry of the same step waits (IN_PROGRESS) instead of running again.
            second = asyncio.ensure_future(create("xl", fence_run=run, fence_step="vm"))
            await asyncio.sleep(0.2)
            assert not second.done()
            release.set()
            assert await asyncio.wait_for(first, 20) == "vm-xl"
            assert await asyncio.wait_for(second, 20) == "vm-xl"
            assert runs == ["xl"]

            @fenced(client, tool="vm.delete", wait=FAST)
            async def delete(name: str) -> None:
                raise ConnectionResetError("connection reset after sending")

            with pytest.raises(ConnectionResetError):
                await delete("vm-1", fence_run=run, fence_step="del")
            outcome = await client.query_outcome(run=run, step_key=f"{run_id}:del")
            assert outcome.state == EffectState.EFFECT_UNKNOWN
            with pytest.raises(FenceRefused) as err:
                await delete("vm-1", fence_run=run, fence_step="del")
            assert err.value.reason == ReasonCode.RECONCILE_REQUIRED

    asyncio.run(scenario())


def test_async_heartbeat_keeps_a_long_call_alive(server: Any, tenant: str, run_id: str) -> None:
    import time

    async def scenario() -> list[EffectState]:
        seen: list[EffectState] = []
        async with AsyncClient(server.addr, tenant=tenant, timeout=20) as client:

            @fenced(client, tool="report.build", wait=FAST)
            async def build(n: int) -> int:
                ex = fence.current_execution()
                assert ex is not None
                while time.time() * 1000 < ex.lease_expires_at_ms + 400:
                    await asyncio.sleep(0.05)
                seen.append((await client.query_outcome(effect_id=ex.effect_id)).state)
                return n

            assert await build(5, fence_run=Run(run_id), fence_step="b", fence_lease_ms=600) == 5
        return seen

    assert asyncio.run(scenario()) == [EffectState.RUNNING]


def test_async_batches(server: Any, tenant: str, run_id: str) -> None:
    async def scenario() -> None:
        async with AsyncClient(server.addr, tenant=tenant, timeout=20) as client:
            await client.register_tool("pay", OperationClass.NON_RETRYABLE, volatile_fields=["reference"])
            run = Run(run_id)
            calls = [fence.BeginCall(run, "pay", args(amount=n), step_key=f"s{n}") for n in (1, 2, 3)]
            grants = [r.decision for r in await client.begin_batch(calls)]
            assert all(isinstance(g, Execute) for g in grants)
            receipts = await client.complete_batch(
                [fence.CompleteCall(g.effect_id, g.attempt, result=b"ok") for g in grants]
            )
            assert [r.state for r in receipts] == [EffectState.COMPLETED] * 3
            replays = await client.begin_batch(calls)
            assert all(isinstance(r.decision, Replay) for r in replays)

    asyncio.run(scenario())


def test_async_client_lists_runs_and_tools(server: Any, tenant: str, run_id: str) -> None:
    async def scenario() -> None:
        async with AsyncClient(server.addr, tenant=tenant, timeout=20) as client:
            await client.register_tool("pay", OperationClass.NON_RETRYABLE)
            for suffix in ("b", "a"):
                await client.start_run(f"{run_id}-{suffix}")
            runs = [r.run_id async for r in client.iter_runs(run_id_prefix=run_id, page_size=1)]
            assert runs == [f"{run_id}-a", f"{run_id}-b"]
            page = await client.list_runs(run_id_prefix=f"{run_id}-b")
            assert [r.run_id for r in page.runs] == [f"{run_id}-b"] and page.next_page_token == ""
            assert [t.name async for t in client.iter_tools()] == ["pay"]

    asyncio.run(scenario())
