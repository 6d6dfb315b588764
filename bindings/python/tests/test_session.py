"""Sessions (sync and asyncio) against the real server: the same decisions and errors as the
unary methods, shared by threads and tasks, and a new stream after a break."""

from __future__ import annotations

import asyncio
import concurrent.futures
import uuid
from typing import Any

import grpc
import pytest

import fence
from fence import (
    AsyncClient,
    BeginCall,
    CompleteCall,
    EffectState,
    Execute,
    FenceRefused,
    FenceRpcError,
    FenceUnavailable,
    OperationClass,
    ReasonCode,
    Replay,
)


def charge(run_id: str, step: str, amount: int = 4200) -> BeginCall:
    return BeginCall(run_id, "pay", {"amount": amount, "to": "acme", "reference": str(uuid.uuid4())}, step_key=step)


def granted(result: fence.BeginResult) -> Execute:
    assert isinstance(result.decision, Execute), result.decision
    return result.decision


def test_a_session_decides_as_the_unary_methods(client: fence.Client, run_id: str) -> None:
    client.register_tool("pay", OperationClass.NON_RETRYABLE, volatile_fields=["reference"])
    with client.session() as session:
        ex = granted(session.begin(charge(run_id, "pay")))
        lease = session.heartbeat(ex.effect_id, ex.attempt, 0)
        assert lease.state == EffectState.RUNNING
        done = session.complete(CompleteCall(ex.effect_id, ex.attempt, result=b"ch_1"))
        assert done.state == EffectState.COMPLETED

        # The same step again, with a fresh reference: replayed on the session and unary alike.
        for result in (session.begin(charge(run_id, "pay")), client.begin(run_id, "pay", charge(run_id, "pay").arguments, step_key="pay")):
            assert isinstance(result.decision, Replay), result.decision
            assert result.decision.receipt.result == b"ch_1"

        # A different result for the completed effect: the refusal the unary call raises.
        with pytest.raises(FenceRefused) as unary:
            client.complete(ex.effect_id, ex.attempt, 0, result=b"other")
        with pytest.raises(FenceRefused) as streamed:
            session.complete(CompleteCall(ex.effect_id, ex.attempt, result=b"other"))
        assert streamed.value.reason == unary.value.reason
        assert streamed.value.recovery == unary.value.recovery

        # A malformed call names its field, and the session goes on.
        with pytest.raises(FenceRpcError) as bad:
            session.begin(BeginCall("", "pay", {}))
        assert bad.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert [v.field for v in bad.value.field_violations] == ["run_id"]
        granted(session.begin(charge(run_id, "next", amount=1)))


def test_a_client_with_sessions_sends_its_calls_on_one_stream(server: Any, tenant: str, run_id: str) -> None:
    with fence.Client(server.addr, tenant=tenant, timeout=20, sessions=True) as c:
        c.register_tool("pay", OperationClass.NON_RETRYABLE, volatile_fields=["reference"])
        assert c._session is not None and c._session._link is None, "no stream before a call"
        ex = granted(c.begin(run_id, "pay", charge(run_id, "pay").arguments, step_key="pay"))
        stream = c._session._link
        assert stream is not None and not stream.broken
        c.heartbeat(ex.effect_id, ex.attempt, 0)
        c.complete(ex.effect_id, ex.attempt, 0, result=b"ch_1")
        assert c._session._link is stream, "the calls shared the stream"
        replay = c.begin(run_id, "pay", charge(run_id, "pay").arguments, step_key="pay")
        assert isinstance(replay.decision, Replay) and replay.decision.receipt.result == b"ch_1"
    assert c._session._link is None, "closing the client ended its stream"


def test_an_async_client_with_sessions_shares_a_stream_per_loop(server: Any, tenant: str, run_id: str) -> None:
    client = AsyncClient(server.addr, tenant=tenant, timeout=20, sessions=True)

    async def turn(step: str) -> int:
        await client.register_tool("pay", OperationClass.NON_RETRYABLE, volatile_fields=["reference"])
        amount = {"a": 100, "b": 200}[step]
        ex = granted(await client.begin(run_id, "pay", charge(run_id, step, amount).arguments, step_key=step))
        await client.complete(ex.effect_id, ex.attempt, 0, result=step.encode())
        session = client._loop_session()
        assert session._link is not None, "the calls went on the loop's stream"
        await client.close()
        return id(session)

    # Two loops (as two asyncio.run calls): each gets a session of its own.
    assert asyncio.run(turn("a")) != asyncio.run(turn("b"))


def test_threads_share_one_session(client: fence.Client, run_id: str) -> None:
    client.register_tool("pay", OperationClass.NON_RETRYABLE, volatile_fields=["reference"])

    def agent(session: fence.Session, i: int) -> bytes:
        ex = granted(session.begin(charge(f"{run_id}-{i}", "pay")))
        return session.complete(CompleteCall(ex.effect_id, ex.attempt, result=f"ch_{i}".encode())).result

    with client.session() as session, concurrent.futures.ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda i: agent(session, i), range(64)))
    assert results == [f"ch_{i}".encode() for i in range(64)]


def test_a_broken_stream_fails_its_calls_and_the_next_call_reopens(server: Any, tenant: str, run_id: str) -> None:
    with fence.Client(server.addr, tenant=tenant, timeout=20) as c:
        c.register_tool("pay", OperationClass.NON_RETRYABLE, volatile_fields=["reference"])
    with fence.Client(server.addr, tenant=tenant, timeout=20) as client, client.session() as session:
        call = charge(run_id, "pay")
        call.request_id = "req-1"
        ex = granted(session.begin(call))
        # Break the stream from under the session (as a dropped connection would): its reader
        # sees the end and fails what is waiting.
        link = session._link
        assert link is not None
        link._responses.cancel()
        # The next call may meet the broken stream (UNAVAILABLE), never a wrong answer; a
        # retry opens a new stream and gets the same grant back for the same request id.
        try:
            again = session.begin(call)
        except FenceUnavailable:
            again = session.begin(call)
        assert granted(again).effect_id == ex.effect_id


def test_async_session(server: Any, tenant: str, run_id: str) -> None:
    async def scenario() -> None:
        async with AsyncClient(server.addr, tenant=tenant, timeout=20) as client:
            await client.register_tool("pay", OperationClass.NON_RETRYABLE, volatile_fields=["reference"])
            async with client.session() as session:
                ex = granted(await session.begin(charge(run_id, "pay")))
                done = await session.complete(CompleteCall(ex.effect_id, ex.attempt, result=b"ch_1"))
                assert done.state == EffectState.COMPLETED
                again = await session.begin(charge(run_id, "pay"))
                assert isinstance(again.decision, Replay)

                async def agent(i: int) -> bytes:
                    e = granted(await session.begin(charge(f"{run_id}-{i}", "pay")))
                    r = await session.complete(CompleteCall(e.effect_id, e.attempt, result=f"ch_{i}".encode()))
                    return r.result

                results = await asyncio.gather(*(agent(i) for i in range(32)))
                assert results == [f"ch_{i}".encode() for i in range(32)]
                with pytest.raises(FenceRefused) as refused:
                    await session.complete(CompleteCall(ex.effect_id, ex.attempt, result=b"other"))
                assert refused.value.reason != ReasonCode.REASON_CODE_UNSPECIFIED

    asyncio.run(scenario())
