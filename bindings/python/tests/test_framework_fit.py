"""What a framework needs from the binding, against the real server: rich argument and result
types, declared credential parameters, request ids, model-readable refusals, causal
checkpoints, and an AsyncClient made outside any event loop."""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import decimal
import enum
import uuid
from typing import Any

import pytest

import fence
from fence import FenceRefused, OperationClass, ReasonCode, Run, fenced
from fence import _requests as rq

try:
    import pydantic
except ImportError:  # pragma: no cover - pydantic is in the test requirements
    pydantic = None  # type: ignore[assignment]


class Currency(enum.Enum):
    EUR = "EUR"
    USD = "USD"


@dataclasses.dataclass
class Payee:
    iban: str
    since: datetime.date


def test_rich_values_encode_deterministically() -> None:
    when = datetime.datetime(2026, 1, 2, 3, 4, 5, tzinfo=datetime.timezone.utc)
    value = {
        "b": Payee("DE00", datetime.date(2020, 5, 1)),
        "a": Currency.EUR,
        "amount": decimal.Decimal("100.000000000000001"),
        "id": uuid.UUID(int=7),
        "at": when,
        "tags": {"y", "x"},
    }
    text = rq.dumps(value)
    assert text == rq.dumps(dict(reversed(list(value.items()))))
    assert '"amount":100.000000000000001' in text  # exact digits, not a float
    assert '"a":"EUR"' in text and '"tags":["x","y"]' in text
    assert '"since":"2020-05-01"' in text and "2026-01-02T03:04:05+00:00" in text
    with pytest.raises(TypeError):
        rq.dumps({"x": object()})
    with pytest.raises(ValueError):
        rq.dumps({"x": decimal.Decimal("NaN")})


@pytest.mark.skipif(pydantic is None, reason="pydantic not installed")
def test_pydantic_arguments_and_results_round_trip(client: fence.Client, run_id: str) -> None:
    class Transfer(pydantic.BaseModel):
        to: str
        amount: decimal.Decimal
        currency: Currency

    class Receipt(pydantic.BaseModel):
        tx: str
        at: datetime.datetime

    calls: list[Transfer] = []

    @fenced(client, tool="bank.transfer.pyd", run=Run(run_id))
    def transfer(order: Transfer) -> Receipt:
        calls.append(order)
        return Receipt(tx=f"T{len(calls)}", at=datetime.datetime(2026, 1, 1))

    first = transfer(Transfer(to="bob", amount=decimal.Decimal("10.50"), currency=Currency.EUR))
    assert first == {"tx": "T1", "at": "2026-01-01T00:00:00"}
    # A repeat in the same run: the same intent (10.5 == 10.50), a suspected duplicate.
    with pytest.raises(FenceRefused) as refused:
        transfer(Transfer(to="bob", amount=decimal.Decimal("10.5"), currency=Currency.EUR))
    assert refused.value.reason == ReasonCode.DUPLICATE_INTENT
    assert len(calls) == 1


def test_an_unencodable_result_is_recorded_completed_as_text(client: fence.Client, run_id: str) -> None:
    class Opaque:
        def __str__(self) -> str:
            return "opaque-result-42"

    ran: list[int] = []

    @fenced(client, tool="opaque.effect", run=Run(run_id))
    def effect(n: int) -> Any:
        ran.append(n)
        return Opaque()

    value = effect(1)
    assert isinstance(value, Opaque)
    outcome = client.query_outcome(run=Run(run_id), tool="opaque.effect", arguments={"n": 1})
    assert outcome.state == fence.EffectState.COMPLETED
    assert outcome.receipt is not None and b"opaque-result-42" in outcome.receipt.result
    assert ran == [1]


def test_credential_args_spend_the_approval_without_plumbing(client: fence.Client, run_id: str) -> None:
    paid: list[tuple[str, int]] = []

    @fenced(client, tool="payments.pay", credential_args=["approval_token"], run=Run(run_id))
    def pay(to: str, amount: int, approval_token: str) -> str:
        assert approval_token == "approval-xyz"  # the function still gets it
        paid.append((to, amount))
        return "paid"

    assert pay("bob", 5, approval_token="approval-xyz") == "paid"
    # The spent approval presented for a different payment is refused, with a model-readable
    # sentence as the exception's text.
    with pytest.raises(FenceRefused) as refused:
        pay("mallory", 500, approval_token="approval-xyz")
    err = refused.value
    assert err.reason == ReasonCode.CREDENTIAL_CONSUMED
    assert str(err) == err.message
    assert "approval" in str(err).lower() and "CREDENTIAL_CONSUMED" not in str(err)
    assert paid == [("bob", 5)]
    # The token is not part of the intent: the receipt's arguments do not hold it.
    outcome = client.query_outcome(run=Run(run_id), tool="payments.pay", arguments={"to": "bob", "amount": 5})
    assert outcome.receipt is not None and "approval-xyz" not in outcome.receipt.arguments_json


def test_credential_args_must_name_parameters(client: fence.Client) -> None:
    with pytest.raises(TypeError, match="not a parameter"):

        @fenced(client, tool="x", credential_args=["nope"])
        def f(a: int) -> int:
            return a


def test_a_resent_begin_with_its_request_id_gets_the_grant_back(client: fence.Client, run_id: str) -> None:
    client.register_tool("bank.wire", OperationClass.NON_RETRYABLE, volatile_fields=["ref"])
    first = client.begin(Run(run_id), "bank.wire", {"to": "bob", "ref": "a"}, request_id="req-1")
    again = client.begin(Run(run_id), "bank.wire", {"to": "bob", "ref": "b"}, request_id="req-1")
    assert isinstance(first.decision, fence.Execute) and isinstance(again.decision, fence.Execute)
    assert again.decision.effect_id == first.decision.effect_id
    other = client.begin(Run(run_id), "bank.wire", {"to": "bob", "ref": "c"}, request_id="req-2")
    assert isinstance(other.decision, fence.InProgress)


def test_a_late_checkpoint_still_precedes_the_effects_that_name_it(client: fence.Client, run_id: str) -> None:
    client.register_tool("bank.send", OperationClass.NON_RETRYABLE, volatile_fields=["ref"])
    run = Run(run_id)
    client.checkpoint(run, "cp-1")
    result = client.begin(run, "bank.send", {"to": "bob", "ref": "1"}, parent_checkpoint_id="cp-2")
    assert isinstance(result.decision, fence.Execute)
    client.complete(result.decision.effect_id, result.decision.attempt, result.epoch, result=b'"ok"')
    # The checkpoint the call descended from is saved after it ran (background durability).
    client.checkpoint(run, "cp-2", parent_checkpoint_id="cp-1")
    restored = client.restore(run, "cp-2")
    assert [r.effect_id for r in restored.tape] == [result.decision.effect_id]
    again = client.begin(run, "bank.send", {"to": "bob", "ref": "2"}, step_key="new-key", parent_checkpoint_id="cp-2")
    assert isinstance(again.decision, fence.Replay)
    assert again.decision.receipt.effect_id == result.decision.effect_id


def test_an_async_client_made_outside_a_loop_works_in_several_loops(server: Any, tenant: str, run_id: str) -> None:
    # Made outside any event loop, as an application's module-level client is.
    client = fence.AsyncClient(server.addr, tenant=tenant, timeout=20)

    async def once(n: int) -> str:
        started = await client.start_run(Run(f"{run_id}-{n}"))
        return started.run.run_id

    # Two loops in a row (asyncio.run twice): never "attached to a different loop".
    assert asyncio.run(once(1)) == f"{run_id}-1"
    assert asyncio.run(once(2)) == f"{run_id}-2"

    async def close() -> None:
        await client.close()

    asyncio.run(close())


def test_get_tool_of_a_name_never_registered_is_not_found(client: fence.Client) -> None:
    with pytest.raises(FenceRefused) as err:
        client.get_tool("never.registered.tool")
    assert err.value.reason == ReasonCode.UNKNOWN_RECORD
    assert err.value.code is not None and err.value.code.name == "NOT_FOUND"


def test_numbers_are_compared_exactly_end_to_end(client: fence.Client, run_id: str) -> None:
    client.register_tool("ledger.post", OperationClass.NON_RETRYABLE)
    run = Run(run_id)
    first = client.begin(run, "ledger.post", '{"amount":100}')
    assert isinstance(first.decision, fence.Execute)
    client.complete(first.decision.effect_id, first.decision.attempt, first.epoch, result=b"1")
    # One number spelled differently: the same intent.
    same = client.begin(run, "ledger.post", '{"amount":1.00e+2}')
    assert isinstance(same.decision, fence.Refusal)
    assert same.decision.reason == ReasonCode.DUPLICATE_INTENT
    # A different number that floating point would confuse: a new intent.
    other = client.begin(run, "ledger.post", '{"amount":100.000000000000001}')
    assert isinstance(other.decision, fence.Execute)
    big = client.begin(run, "ledger.post", '{"amount":18446744073709551617}')
    assert isinstance(big.decision, fence.Execute)
    client.complete(big.decision.effect_id, big.decision.attempt, big.epoch, result=b"2")
    bigger = client.begin(run, "ledger.post", '{"amount":18446744073709551616}')
    assert isinstance(bigger.decision, fence.Execute)
