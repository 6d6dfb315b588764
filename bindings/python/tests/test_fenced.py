"""The @fenced decorator (sync) against the real server, including injected transport faults."""

from __future__ import annotations

import threading
import uuid
from typing import Any, Callable

import grpc
import pytest

import fence
from fence import (
    EffectState,
    FailedBeforeInputError,
    FenceEffectUnknown,
    FenceRefused,
    FenceUnavailable,
    OperationClass,
    ReasonCode,
    RecoveryAction,
    Run,
    WaitPolicy,
    fenced,
)


class Bank:
    """A downstream API that records every transfer it executes."""

    def __init__(self) -> None:
        self.transfers: list[dict[str, Any]] = []
        self.lock = threading.Lock()

    def transfer(self, to: str, amount: int, idempotency_key: str) -> dict[str, Any]:
        with self.lock:
            self.transfers.append({"to": to, "amount": amount, "key": idempotency_key})
            return {"tx": f"T{len(self.transfers)}", "to": to, "amount": amount}


class FaultyClient(fence.Client):
    """A real client that records calls and can lose a call in transit.

    ``faults[method]`` is a list of modes consumed one per call: ``"before"`` fails without
    sending; ``"after"`` sends (the server applies it) and then reports UNAVAILABLE, like a
    connection dropped before the answer arrived; ``None`` passes.
    """

    def __init__(self, *args: Any, faults: dict[str, list[str | None]] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.faults = faults or {}
        self.calls: list[str] = []
        self.on_call: Callable[[str], None] | None = None

    def _through(self, method: str, real: Callable[[], Any]) -> Any:
        self.calls.append(method)
        if self.on_call is not None:
            self.on_call(method)
        plan = self.faults.get(method)
        mode = plan.pop(0) if plan else None
        if mode == "before":
            raise FenceUnavailable(grpc.StatusCode.UNAVAILABLE, f"injected: {method} lost before send")
        result = real()
        if mode == "after":
            raise FenceUnavailable(grpc.StatusCode.UNAVAILABLE, f"injected: {method} answer lost")
        return result

    def begin(self, *args: Any, **kwargs: Any) -> Any:
        return self._through("begin", lambda: super(FaultyClient, self).begin(*args, **kwargs))

    def complete(self, *args: Any, **kwargs: Any) -> Any:
        return self._through("complete", lambda: super(FaultyClient, self).complete(*args, **kwargs))

    def query_outcome(self, *args: Any, **kwargs: Any) -> Any:
        return self._through("query_outcome", lambda: super(FaultyClient, self).query_outcome(*args, **kwargs))


FAST = WaitPolicy(timeout_s=20.0, initial_backoff_s=0.02, max_backoff_s=0.2)


def make_transfer(client: fence.Client, bank: Bank, **options: Any) -> Callable[..., Any]:
    @fenced(
        client,
        tool="bank.transfer",
        cls=OperationClass.NON_RETRYABLE,
        volatile_fields=["reference", "timestamp"],
        wait=FAST,
        **options,
    )
    def transfer(to: str, amount: int, reference: str, timestamp: str, downstream_key: str = "") -> dict:
        assert fence.current_execution() is not None
        assert fence.current_execution().downstream_key == downstream_key
        return bank.transfer(to, amount, downstream_key)

    return transfer


def call_args(to: str = "bob", amount: int = 100) -> dict[str, Any]:
    return {"to": to, "amount": amount, "reference": str(uuid.uuid4()), "timestamp": str(uuid.uuid4())}


@pytest.fixture
def bank() -> Bank:
    return Bank()


def test_executes_once_then_replays(client: fence.Client, run_id: str, bank: Bank) -> None:
    transfer = make_transfer(client, bank)
    run = Run(run_id)
    first = transfer(**call_args(), fence_run=run, fence_step="pay")
    assert first == {"tx": "T1", "to": "bob", "amount": 100}
    assert run.epoch == 1
    # The regenerated call (new reference and timestamp) replays: the bank is not called.
    again = transfer(**call_args(), fence_run=run, fence_step="pay")
    assert again == first
    assert len(bank.transfers) == 1
    # The bank got Fence's downstream key as its idempotency key.
    outcome = client.query_outcome(run=run, step_key=f"{run_id}:pay")
    assert outcome.state == EffectState.COMPLETED
    assert outcome.receipt is not None
    assert bank.transfers[0]["key"] == outcome.receipt.downstream_key
    assert outcome.receipt.result_json() == first
    assert client.get_tool("bank.transfer").intent_schema.volatile_fields == ("reference", "timestamp")


def test_signature_hides_the_downstream_key(client: fence.Client, bank: Bank) -> None:
    import inspect

    transfer = make_transfer(client, bank)
    assert list(inspect.signature(transfer).parameters) == ["to", "amount", "reference", "timestamp"]
    assert transfer.fence.name == "bank.transfer"


def test_use_run_context_and_argument_mismatch(client: fence.Client, run_id: str, bank: Bank) -> None:
    transfer = make_transfer(client, bank)
    with fence.use_run(Run(run_id)):
        transfer(**call_args(amount=100), fence_step="pay")
        with pytest.raises(FenceRefused) as err:
            transfer(**call_args(amount=999), fence_step="pay")
    assert err.value.reason == ReasonCode.ARGUMENT_MISMATCH
    assert err.value.recovery == RecoveryAction.FIX_ARGUMENT
    assert err.value.receipt is not None and err.value.receipt.state == EffectState.COMPLETED
    assert len(bank.transfers) == 1


def test_duplicate_intent_then_deliberate_repeat(client: fence.Client, run_id: str, bank: Bank) -> None:
    transfer = make_transfer(client, bank, run=Run(run_id))
    transfer(**call_args())
    with pytest.raises(FenceRefused) as err:
        transfer(**call_args())
    assert err.value.reason == ReasonCode.DUPLICATE_INTENT
    assert err.value.recovery == RecoveryAction.CONFIRM_REPEAT
    assert len(bank.transfers) == 1
    transfer(**call_args(), fence_deliberate_repeat=True)
    assert len(bank.transfers) == 2
    assert bank.transfers[0]["key"] != bank.transfers[1]["key"]


def test_failed_before_input_is_regranted_with_the_same_key(client: fence.Client, run_id: str) -> None:
    keys: list[str] = []
    attempts: list[int] = []

    @fenced(client, tool="mail.send", cls=OperationClass.NON_RETRYABLE, volatile_fields=["msg_id"], wait=FAST)
    def send(to: str, msg_id: str, downstream_key: str = "") -> str:
        keys.append(downstream_key)
        attempts.append(fence.current_execution().attempt)
        if len(keys) == 1:
            raise FailedBeforeInputError("SMTP connection refused before sending")
        return "sent"

    run = Run(run_id)
    with pytest.raises(FailedBeforeInputError):
        send("a@example.com", "m1", fence_run=run, fence_step="mail")
    seen = client.query_outcome(run=run, step_key=f"{run_id}:mail")
    assert seen.state == EffectState.FAILED_BEFORE_INPUT
    assert send("a@example.com", "m2", fence_run=run, fence_step="mail") == "sent"
    assert keys[0] == keys[1] and attempts == [1, 2]


def test_configured_exception_types_mean_failed_before_input(client: fence.Client, run_id: str) -> None:
    @fenced(client, tool="dns.set", failed_before_input=[ConnectionRefusedError], wait=FAST)
    def set_record(name: str) -> None:
        raise ConnectionRefusedError("nope")

    run = Run(run_id)
    with pytest.raises(ConnectionRefusedError):
        set_record("a", fence_run=run, fence_step="dns")
    assert client.query_outcome(run=run, step_key=f"{run_id}:dns").state == EffectState.FAILED_BEFORE_INPUT


def test_ambiguous_exception_records_effect_unknown(client: fence.Client, run_id: str) -> None:
    calls = []

    @fenced(client, tool="vm.create", cls=OperationClass.NON_RETRYABLE, wait=FAST)
    def create_vm(size: str) -> str:
        calls.append(size)
        raise TimeoutError("timed out after sending")

    run = Run(run_id)
    with pytest.raises(TimeoutError):
        create_vm("xl", fence_run=run, fence_step="vm")
    assert client.query_outcome(run=run, step_key=f"{run_id}:vm").state == EffectState.EFFECT_UNKNOWN
    with pytest.raises(FenceRefused) as err:
        create_vm("xl", fence_run=run, fence_step="vm")
    assert err.value.reason == ReasonCode.RECONCILE_REQUIRED
    assert err.value.recovery == RecoveryAction.RECONCILE
    assert calls == ["xl"]


def test_in_progress_waits_for_the_other_attempt(server: Any, tenant: str, run_id: str, bank: Bank) -> None:
    client = FaultyClient(server.addr, tenant=tenant)
    transfer = make_transfer(client, bank)
    run = Run(run_id)
    client.register_tool("bank.transfer", OperationClass.NON_RETRYABLE, volatile_fields=["reference", "timestamp"])
    # Another worker holds the grant.
    holder = client.begin(run, "bank.transfer", {"to": "bob", "amount": 5, "reference": "r", "timestamp": "t"},
                          step_key=f"{run_id}:pay", lease_ms=30_000)
    assert isinstance(holder.decision, fence.Execute)
    polled = threading.Event()
    client.on_call = lambda m: polled.set() if m == "query_outcome" else None
    results: list[Any] = []
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            results.append(transfer(to="bob", amount=5, reference="r2", timestamp="t2", fence_run=run, fence_step="pay"))
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    t = threading.Thread(target=worker)
    t.start()
    assert polled.wait(20), "the fenced call never polled QueryOutcome"
    client.complete(holder.decision.effect_id, holder.decision.attempt, 1, result=b'{"tx":"OTHER"}')
    t.join(30)
    assert not t.is_alive()
    assert errors == []
    assert results == [{"tx": "OTHER"}]
    assert bank.transfers == []
    client.close()


def test_lost_begin_answer_is_queried_then_the_grant_comes_back(server: Any, tenant: str, run_id: str, bank: Bank) -> None:
    # The Begin lands (the server records and grants it) but its answer is lost.
    client = FaultyClient(server.addr, tenant=tenant, faults={"begin": ["after"]})
    transfer = make_transfer(client, bank)
    run = Run(run_id)
    # The re-sent Begin carries the same request id: the server hands this call its own grant
    # back (not IN_PROGRESS until the lease lapses), so the transfer runs exactly once.
    result = transfer(**call_args(), fence_run=run, fence_step="pay", fence_lease_ms=500)
    assert result["tx"] == "T1"
    # It asked what happened before asking again.
    assert client.calls[:3] == ["begin", "query_outcome", "begin"]
    assert len(bank.transfers) == 1
    outcome = client.query_outcome(run=run, step_key=f"{run_id}:pay")
    assert outcome.state == EffectState.COMPLETED
    assert outcome.receipt is not None and outcome.receipt.attempt == 1
    client.close()


def test_a_grant_lost_by_another_process_is_never_run_blindly(server: Any, tenant: str, run_id: str, bank: Bank) -> None:
    # A process was granted the step and died before answering: its grant is not this
    # process's to use (another request id), so the effect ends unknown, never run twice.
    client = FaultyClient(server.addr, tenant=tenant)
    transfer = make_transfer(client, bank)
    run = Run(run_id)
    transfer.fence.definition.registered = False
    client.register_tool("bank.transfer", OperationClass.NON_RETRYABLE, volatile_fields=["reference", "timestamp"])
    lost = client.begin(run, "bank.transfer", call_args(), step_key=f"{run_id}:pay", lease_ms=500, request_id="dead-process")
    assert isinstance(lost.decision, fence.Execute)
    with pytest.raises((FenceEffectUnknown, FenceRefused)) as err:
        transfer(**call_args(), fence_run=run, fence_step="pay")
    assert err.value.recovery == RecoveryAction.RECONCILE
    assert err.value.receipt is not None
    assert bank.transfers == []
    assert client.query_outcome(run=run, step_key=f"{run_id}:pay").state == EffectState.EFFECT_UNKNOWN
    client.close()


def test_begin_lost_before_send_is_begun_again_after_checking(server: Any, tenant: str, run_id: str, bank: Bank) -> None:
    client = FaultyClient(server.addr, tenant=tenant, faults={"begin": ["before"]})
    transfer = make_transfer(client, bank)
    result = transfer(**call_args(), fence_run=Run(run_id), fence_step="pay")
    assert result["tx"] == "T1"
    assert client.calls[:3] == ["begin", "query_outcome", "begin"]
    assert len(bank.transfers) == 1
    client.close()


def test_lost_complete_answer_is_confirmed_by_query(server: Any, tenant: str, run_id: str, bank: Bank) -> None:
    client = FaultyClient(server.addr, tenant=tenant, faults={"complete": ["after"]})
    transfer = make_transfer(client, bank)
    run = Run(run_id)
    result = transfer(**call_args(), fence_run=run, fence_step="pay")
    assert result["tx"] == "T1"
    assert client.calls.count("complete") == 1 and "query_outcome" in client.calls
    assert len(bank.transfers) == 1
    assert client.query_outcome(run=run, step_key=f"{run_id}:pay").state == EffectState.COMPLETED
    client.close()


def test_complete_lost_before_send_is_resent(server: Any, tenant: str, run_id: str, bank: Bank) -> None:
    client = FaultyClient(server.addr, tenant=tenant, faults={"complete": ["before"]})
    transfer = make_transfer(client, bank)
    run = Run(run_id)
    transfer(**call_args(), fence_run=run, fence_step="pay")
    assert client.calls.count("complete") == 2
    assert len(bank.transfers) == 1
    assert client.query_outcome(run=run, step_key=f"{run_id}:pay").state == EffectState.COMPLETED
    client.close()


def test_restore_fork_and_credentials_through_the_decorator(client: fence.Client, run_id: str, bank: Bank) -> None:
    transfer = make_transfer(client, bank)
    run = Run(run_id)
    client.start_run(run)
    client.checkpoint(run, "plan")
    approval = f"approval-{uuid.uuid4()}"
    transfer(**call_args(to="bob"), fence_run=run, fence_credentials=[approval])
    assert len(bank.transfers) == 1

    client.restore(run, "plan")
    # While the payment to Bob is due on the replay tape, a different call is divergent...
    with pytest.raises(FenceRefused) as err:
        transfer(**call_args(to="carol"), fence_run=run)
    assert err.value.reason == ReasonCode.FORK_REQUIRED
    assert err.value.recovery == RecoveryAction.FORK
    assert err.value.checkpoint_id == "plan"
    # ...and the equivalent regenerated call is replayed, even though it presents the spent
    # approval again.
    assert transfer(**call_args(to="bob"), fence_run=run, fence_credentials=[approval])["tx"] == "T1"
    branch = client.fork(run, err.value.checkpoint_id, reason="pay Carol instead")
    assert run.branch != "main"
    # The payment to Bob is carried onto the fork: done, and replayed if the model re-issues it.
    assert branch.pending_carried == 1 and len(branch.carried) == 1
    assert branch.carried[0].state == EffectState.COMPLETED
    assert transfer(**call_args(to="bob"), fence_run=run, fence_credentials=[approval])["tx"] == "T1"
    # On the fork the spent approval is still spent...
    with pytest.raises(FenceRefused) as spent:
        transfer(**call_args(to="carol"), fence_run=run, fence_credentials=[approval])
    assert spent.value.reason == ReasonCode.CREDENTIAL_CONSUMED
    assert spent.value.recovery == RecoveryAction.REAUTHENTICATE
    # ...and a fresh one works.
    transfer(**call_args(to="carol"), fence_run=run, fence_credentials=[f"approval-{uuid.uuid4()}"])
    assert [t["to"] for t in bank.transfers] == ["bob", "carol"]


def test_stale_handle_is_fenced(client: fence.Client, run_id: str, bank: Bank) -> None:
    transfer = make_transfer(client, bank)
    zombie = Run(run_id)
    transfer(**call_args(amount=1), fence_run=zombie, fence_step="one")
    fresh = Run(run_id)
    client.checkpoint(fresh, "cp", epoch=1)
    client.restore(fresh, "cp")
    with pytest.raises(FenceRefused) as err:
        transfer(**call_args(amount=2), fence_run=zombie, fence_step="two")
    assert err.value.reason == ReasonCode.STALE_EPOCH
    assert err.value.current_epoch == 2
    assert zombie.epoch == 1  # a refusal never moves the handle
    assert len(bank.transfers) == 1


def test_safe_retry_runs_every_time(client: fence.Client, run_id: str) -> None:
    calls = []

    @fenced(client, tool="bank.balance", cls=OperationClass.SAFE_RETRY)
    def balance(account: str) -> int:
        calls.append(account)
        return 42

    run = Run(run_id)
    assert balance("acc", fence_run=run) == 42
    assert balance("acc", fence_run=run) == 42
    assert calls == ["acc", "acc"]


def test_arguments_must_be_json_and_excluded_params_are_left_out(client: fence.Client, run_id: str) -> None:
    class Session:
        pass

    seen = []

    @fenced(client, tool="crm.note", cls=OperationClass.DEDUPLICATE, exclude=["session"])
    def note(session: Session, text: str, *tags: str, **extra: Any) -> dict:
        seen.append(text)
        return {"text": text, "tags": list(tags), "extra": extra}

    run = Run(run_id)
    out = note(Session(), "hi", "a", "b", fence_run=run, lang="en")
    assert out == {"text": "hi", "tags": ["a", "b"], "extra": {"lang": "en"}}
    receipt = client.query_outcome(run=run, tool="crm.note", arguments={"text": "hi", "tags": ["a", "b"], "lang": "en"})
    assert receipt.state == EffectState.COMPLETED
    # Same intent, no step key, DEDUPLICATE: replayed without running.
    assert note(Session(), "hi", "a", "b", fence_run=run, lang="en") == out
    assert seen == ["hi"]

    @fenced(client, tool="crm.bad")
    def bad(obj: object) -> None:
        raise AssertionError("must not run")

    with pytest.raises(TypeError):
        bad(object(), fence_run=run)


def test_reserved_and_mismatched_usage_is_rejected(client: fence.Client) -> None:
    with pytest.raises(TypeError):

        @fenced(client, tool="x")
        def uses_reserved(fence_run: str) -> None: ...

    with pytest.raises(TypeError):

        @fenced(client, tool="x")
        async def async_with_sync_client() -> None: ...

    @fenced(client, tool="y")
    def no_run() -> None: ...

    with pytest.raises(TypeError):
        no_run()


@pytest.mark.parametrize("heartbeat", [True, False])
def test_heartbeat_keeps_a_long_call_alive(client: fence.Client, run_id: str, heartbeat: bool) -> None:
    import time

    seen: list[EffectState] = []

    @fenced(client, tool="report.build", heartbeat=heartbeat, wait=FAST)
    def build(n: int) -> int:
        ex = fence.current_execution()
        assert ex is not None
        # Work for longer than the grant's lease (same machine, so the clocks agree).
        while time.time() * 1000 < ex.lease_expires_at_ms + 400:
            time.sleep(0.05)
        seen.append(client.query_outcome(effect_id=ex.effect_id).state)
        return n

    run = Run(run_id)
    assert build(3, fence_run=run, fence_step="build", fence_lease_ms=600) == 3
    # Heartbeats extended the lease (RUNNING); without them it lapsed (reads EFFECT_UNKNOWN).
    assert seen == [EffectState.RUNNING if heartbeat else EffectState.EFFECT_UNKNOWN]
