"""Fence any function as a tool: ``@fenced(client, tool=..., cls=..., volatile_fields=[...])``.

The protocol of one fenced call is written once, as a generator that yields the operations it
needs (an RPC, a sleep, the invocation of the function) and receives their results; a sync
and an async driver run it. So a sync and an async tool behave identically:

1. The tool is registered once per decorated function (RegisterTool is idempotent).
2. ``Begin`` with the function's arguments as JSON and the step key ``{run_id}:{step}``.
3. The decision:
   - **execute**: the function runs (the downstream key is passed to it if it has a parameter
     named ``downstream_key``, and :func:`current_execution` tells it the effect id), its
     lease is heartbeated while it runs, then ``Complete`` records its JSON-encoded result.
     If it raises :class:`fence.FailedBeforeInputError` (or a type listed in
     ``failed_before_input``) the effect is recorded ``FAILED_BEFORE_INPUT``; any other
     exception is ambiguous and recorded ``EFFECT_UNKNOWN``. The exception is re-raised.
   - **replay**: the function does not run; the recorded result is JSON-decoded and returned.
   - **in progress**: ``QueryOutcome`` is polled with backoff until the other attempt
     finishes: a completed result is returned, a ``FAILED_BEFORE_INPUT`` effect is begun
     again (re-granted, same downstream key), an unknown one raises
     :class:`fence.FenceEffectUnknown` (a ``DEDUPLICATE`` tool is begun again instead).
   - **refused**: :class:`fence.FenceRefused` with reason, recovery and receipt.
4. A transport failure (UNAVAILABLE / DEADLINE_EXCEEDED) never leads to a blind re-Begin: the
   outcome is queried first (by step key, else by intent) until the server answers; only then
   is the call begun again, where the server's step-key and duplicate-intent checks decide.
   A lost ``Complete`` is checked with ``QueryOutcome`` and re-sent (an identical repeat is
   accepted by the server).

The value returned on execute is the JSON round-trip of the function's result, so an executed
call and its replay return equal values.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import inspect
import json
import threading
import time
import uuid
from dataclasses import dataclass, replace
from typing import Any, Callable, Generator, Iterable, Iterator, Sequence, TypeVar, Union

from . import _requests as rq
from .aio import AsyncClient
from .client import Client
from .errors import (
    FailedBeforeInputError,
    FenceCompletionError,
    FenceEffectUnknown,
    FenceError,
    FenceRefused,
    FenceTimeout,
    FenceUnavailable,
)
from .types import (
    Compensation,
    EffectState,
    Execute,
    InProgress,
    OperationClass,
    ReasonCode,
    Receipt,
    Refusal,
    Replay,
    Run,
    StringNormalization,
)

__all__ = [
    "Execution",
    "FencedTool",
    "WaitPolicy",
    "current_execution",
    "fenced",
    "use_run",
]

F = TypeVar("F", bound=Callable[..., Any])

RESERVED_KEYWORDS = frozenset(
    {
        "fence_run",
        "fence_step",
        "fence_step_key",
        "fence_credentials",
        "fence_deliberate_repeat",
        "fence_lease_ms",
        "fence_saga_id",
        "fence_compensation",
        "fence_compensates_effect_id",
        "fence_parent_checkpoint_id",
        "fence_request_id",
    }
)
"""Call-time keywords a fenced function accepts (and does not pass to the function)."""


@dataclass(frozen=True)
class Execution:
    """The grant a fenced function is running under (see :func:`current_execution`)."""

    tool: str
    run_id: str
    branch: str
    epoch: int
    step_key: str
    effect_id: str
    downstream_key: str
    attempt: int
    lease_expires_at_ms: int


_current_execution: contextvars.ContextVar[Execution | None] = contextvars.ContextVar(
    "fence_current_execution", default=None
)
_current_run: contextvars.ContextVar[Run | None] = contextvars.ContextVar(
    "fence_current_run", default=None
)


def current_execution() -> Execution | None:
    """Inside a fenced function: the grant it runs under (effect id, downstream key...)."""
    return _current_execution.get()


@contextlib.contextmanager
def use_run(run: Run) -> Iterator[Run]:
    """Makes ``run`` the run of fenced calls in this context that pass no ``fence_run``."""
    token = _current_run.set(run)
    try:
        yield run
    finally:
        _current_run.reset(token)


@dataclass(frozen=True)
class WaitPolicy:
    """How long and how often to poll when waiting (in progress, unreachable server).

    ``timeout_s`` bounds each wait (for another attempt's effect, for the server to answer
    after a transport error, for a Complete to be recorded).
    """

    timeout_s: float = 60.0
    initial_backoff_s: float = 0.05
    max_backoff_s: float = 2.0
    multiplier: float = 2.0


class _Backoff:
    def __init__(self, policy: WaitPolicy, first_s: float | None = None) -> None:
        self._policy = policy
        self._next = first_s if first_s and first_s > 0 else policy.initial_backoff_s
        self.deadline = time.monotonic() + policy.timeout_s

    def next(self) -> float:
        delay = min(self._next, self._policy.max_backoff_s)
        self._next = min(self._next * self._policy.multiplier, self._policy.max_backoff_s)
        return max(0.0, min(delay, self.deadline - time.monotonic()))

    def expired(self) -> bool:
        return time.monotonic() >= self.deadline


# ------------------------------------------------------------------------------------------
# Operations the protocol yields to its driver
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Call:
    method: str
    kwargs: dict[str, Any]


@dataclass(frozen=True)
class _Sleep:
    seconds: float


@dataclass(frozen=True)
class _Invoke:
    execution: Execution
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    heartbeat_s: float | None


_Op = Union[_Call, _Sleep, _Invoke]


# ------------------------------------------------------------------------------------------
# Tool definition and one call's request
# ------------------------------------------------------------------------------------------


def _encode_json(value: Any) -> bytes:
    return rq.dumps(value).encode("utf-8")


def _decode_json(raw: bytes) -> Any:
    if not raw:
        return None
    return json.loads(raw.decode("utf-8"))


@dataclass
class _ToolDef:
    name: str
    cls: OperationClass
    volatile_fields: tuple[str, ...]
    normalized_fields: tuple[str, ...]
    string_normalization: StringNormalization
    retention_ms: int
    lease_ms: int
    register: bool
    failed_before_input: tuple[type[BaseException], ...]
    encode: Callable[[Any], bytes]
    decode: Callable[[bytes], Any]
    wait: WaitPolicy
    heartbeat: bool
    registered: bool = False


@dataclass(frozen=True)
class _CallRequest:
    run: Run
    arguments_json: str
    step_key: str
    deliberate_repeat: bool
    credentials: tuple[Any, ...]
    lease_ms: int
    saga_id: str
    compensation: Compensation | None
    compensates_effect_id: str
    request_id: str
    parent_checkpoint_id: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    downstream_param: str | None


def _describe(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text[:1000]


def _add_note(exc: BaseException, note: str) -> None:
    add = getattr(exc, "add_note", None)
    if callable(add):
        add(note)


# ------------------------------------------------------------------------------------------
# The protocol
# ------------------------------------------------------------------------------------------


def _protocol(d: _ToolDef, c: _CallRequest) -> Generator[_Op, Any, Any]:
    if d.register and not d.registered:
        yield _Call(
            "register_tool",
            dict(
                name=d.name,
                cls=d.cls,
                volatile_fields=d.volatile_fields,
                normalized_fields=d.normalized_fields,
                string_normalization=d.string_normalization,
                retention_ms=d.retention_ms,
                lease_ms=d.lease_ms,
            ),
        )
        d.registered = True

    begin_kwargs = dict(
        run=c.run,
        tool=d.name,
        arguments=c.arguments_json,
        step_key=c.step_key,
        deliberate_repeat=c.deliberate_repeat,
        credentials=c.credentials,
        lease_ms=c.lease_ms,
        saga_id=c.saga_id,
        compensation=c.compensation,
        compensates_effect_id=c.compensates_effect_id,
        # One nonce per logical call, repeated on every re-send: a Begin whose answer was
        # lost gets its own grant back instead of waiting out its lease.
        request_id=c.request_id,
        parent_checkpoint_id=c.parent_checkpoint_id,
    )
    backoff = _Backoff(d.wait)
    while True:
        try:
            result = yield _Call("begin", begin_kwargs)
        except FenceUnavailable as lost:
            # The Begin may or may not have been recorded. Never re-begin blindly: ask first.
            yield from _check_after_lost_begin(d, c, lost)
            if backoff.expired():
                raise
            yield _Sleep(backoff.next())
            continue
        decision = result.decision
        if isinstance(decision, Execute):
            return (yield from _execute(d, c, decision, result.epoch))
        if isinstance(decision, Replay):
            return _replayed(d, decision.receipt)
        if isinstance(decision, Refusal):
            raise FenceRefused.from_refusal(decision)
        if isinstance(decision, InProgress):
            settled = yield from _wait_for(d, decision.receipt, decision.retry_after_ms)
            if settled.state in (EffectState.COMPLETED, EffectState.COMPENSATED):
                return _replayed(d, settled)
            if settled.state == EffectState.FAILED_BEFORE_INPUT:
                continue  # certainly did not happen: Begin again (re-granted, same key)
            if settled.state == EffectState.EFFECT_UNKNOWN and d.cls == OperationClass.DEDUPLICATE:
                continue  # a lapsed DEDUPLICATE lease is re-granted with the same key
            if settled.state == EffectState.EFFECT_UNKNOWN:
                raise FenceEffectUnknown(
                    f"fence: the outcome of effect {settled.effect_id} ({d.name}) is unknown; "
                    "check the outside world and Reconcile it with evidence",
                    receipt=settled,
                )
            raise FenceError(
                f"fence: effect {settled.effect_id} ({d.name}) ended in state {settled.state.name}"
            )
        raise FenceError(f"fence: unexpected decision {decision!r}")


def _check_after_lost_begin(
    d: _ToolDef, c: _CallRequest, lost: FenceUnavailable
) -> Generator[_Op, Any, None]:
    """After a Begin failed in transit: query until the server answers.

    Returns when a new Begin is safe (nothing recorded, or the server's own step-key /
    duplicate-intent check decides the new Begin). Raises when it is not.
    """
    if d.cls == OperationClass.SAFE_RETRY:
        return  # read-only: retry freely
    backoff = _Backoff(d.wait)
    while True:
        try:
            if c.step_key:
                outcome = yield _Call("query_outcome", dict(run=c.run, step_key=c.step_key))
            else:
                outcome = yield _Call(
                    "query_outcome", dict(run=c.run, tool=d.name, arguments=c.arguments_json)
                )
            break
        except FenceUnavailable:
            if backoff.expired():
                raise lost from None
            yield _Sleep(backoff.next())
        except FenceRefused as refused:
            if refused.reason == ReasonCode.UNKNOWN_RECORD:
                return  # the run itself does not exist: the lost Begin did not land
            raise
    if outcome.state == EffectState.NOT_FOUND or outcome.receipt is None:
        return  # nothing recorded: the lost Begin did not land
    if c.step_key or not c.deliberate_repeat:
        # A step key (replay / in progress / mismatch by step key) or the duplicate-intent
        # check makes the server answer a new Begin without creating a second effect.
        return
    raise FenceEffectUnknown(
        f"fence: a deliberate repeat of {d.name} without a step key lost its Begin in transit, "
        f"and an identical effect ({outcome.receipt.effect_id}) is recorded: it may be this "
        "call's. Check it before repeating (use a step key to make this unambiguous)",
        receipt=outcome.receipt,
    )


def _replayed(d: _ToolDef, receipt: Receipt) -> Any:
    if receipt.state not in (EffectState.COMPLETED, EffectState.COMPENSATED):
        if receipt.state == EffectState.EFFECT_UNKNOWN:
            raise FenceEffectUnknown(
                f"fence: effect {receipt.effect_id} ({d.name}) has an unknown outcome",
                receipt=receipt,
            )
        raise FenceError(
            f"fence: replay of effect {receipt.effect_id} ({d.name}) in state {receipt.state.name}"
        )
    return d.decode(receipt.result)


def _wait_for(
    d: _ToolDef, receipt: Receipt, retry_after_ms: int
) -> Generator[_Op, Any, Receipt]:
    """Polls QueryOutcome until the effect leaves ACCEPTED/RUNNING; returns its receipt."""
    backoff = _Backoff(d.wait, retry_after_ms / 1000.0 if retry_after_ms else None)
    current = receipt
    while True:
        if backoff.expired():
            raise FenceTimeout(
                f"fence: effect {current.effect_id} ({d.name}) is still {current.state.name} "
                f"after {d.wait.timeout_s}s",
                receipt=current,
            )
        yield _Sleep(backoff.next())
        try:
            outcome = yield _Call("query_outcome", dict(effect_id=receipt.effect_id))
        except FenceUnavailable:
            continue
        if outcome.receipt is None:
            raise FenceError(f"fence: effect {receipt.effect_id} ({d.name}) is no longer found")
        current = outcome.receipt
        if outcome.state not in (EffectState.ACCEPTED, EffectState.RUNNING):
            if outcome.state != current.state:
                # QueryOutcome reads a lapsed lease as EFFECT_UNKNOWN: trust the answer's state.
                current = _with_state(current, outcome.state)
            return current


def _with_state(receipt: Receipt, state: EffectState) -> Receipt:
    return replace(receipt, state=state)


def _heartbeat_interval(d: _ToolDef, c: _CallRequest, ex: Execute) -> float | None:
    if not d.heartbeat or not ex.lease_expires_at_ms:
        return None
    lease_ms = 0
    if ex.receipt is not None:
        start = ex.receipt.updated_at_ms or ex.receipt.created_at_ms
        if start and ex.lease_expires_at_ms > start:
            lease_ms = ex.lease_expires_at_ms - start
    if not lease_ms:
        lease_ms = c.lease_ms or d.lease_ms
    if not lease_ms:
        return None
    return max(lease_ms / 3000.0, 0.02)


def _execute(
    d: _ToolDef, c: _CallRequest, ex: Execute, epoch: int
) -> Generator[_Op, Any, Any]:
    epoch = epoch or c.run.epoch
    execution = Execution(
        tool=d.name,
        run_id=c.run.run_id,
        branch=c.run.branch,
        epoch=epoch,
        step_key=c.step_key,
        effect_id=ex.effect_id,
        downstream_key=ex.downstream_key,
        attempt=ex.attempt,
        lease_expires_at_ms=ex.lease_expires_at_ms,
    )
    kwargs = dict(c.kwargs)
    if c.downstream_param is not None:
        kwargs[c.downstream_param] = ex.downstream_key
    if not ex.recorded:
        # An unrecorded SAFE_RETRY grant: nothing to complete.
        return (yield _Invoke(execution, c.args, kwargs, None))
    try:
        value = yield _Invoke(execution, c.args, kwargs, _heartbeat_interval(d, c, ex))
    except GeneratorExit:
        raise
    except BaseException as exc:
        if isinstance(exc, (FailedBeforeInputError, *d.failed_before_input)):
            outcome: dict[str, Any] = dict(failed_before_input=_describe(exc))
        else:
            outcome = dict(unknown=_describe(exc))
        try:
            yield from _complete(d, ex, epoch, outcome)
        except FenceError as record_err:
            _add_note(exc, f"fence: recording the failure of effect {ex.effect_id} failed: {record_err}")
        raise exc
    try:
        encoded = d.encode(value)
        returned = d.decode(encoded)
    except Exception:
        # The effect happened: that is the fact to record, never EFFECT_UNKNOWN. A result that
        # cannot be encoded is recorded as its text (what a replay returns); this call returns
        # the value itself.
        encoded = _encode_json(_text_of(value))
        returned = value
    try:
        yield from _complete(d, ex, epoch, dict(result=encoded))
    except FenceError as err:
        raise FenceCompletionError(
            f"fence: {d.name} ran (effect {ex.effect_id}) but its result could not be recorded: {err}",
            result=value,
            effect_id=ex.effect_id,
            attempt=ex.attempt,
            epoch=epoch,
        ) from err
    return returned


def _text_of(value: Any) -> str:
    text = str(value)
    return text if len(text) <= 64 * 1024 else text[: 64 * 1024]


_EXPECTED_STATE = {
    "result": EffectState.COMPLETED,
    "failed_before_input": EffectState.FAILED_BEFORE_INPUT,
    "unknown": EffectState.EFFECT_UNKNOWN,
}


def _complete(
    d: _ToolDef, ex: Execute, epoch: int, outcome: dict[str, Any]
) -> Generator[_Op, Any, Receipt]:
    """Complete, surviving transport errors: query what landed before re-sending."""
    (kind, value), = outcome.items()
    backoff = _Backoff(d.wait)
    while True:
        try:
            return (
                yield _Call(
                    "complete",
                    dict(effect_id=ex.effect_id, attempt=ex.attempt, epoch=epoch, **outcome),
                )
            )
        except FenceUnavailable as err:
            lost = err
        while True:
            if backoff.expired():
                raise lost
            yield _Sleep(backoff.next())
            try:
                seen = yield _Call("query_outcome", dict(effect_id=ex.effect_id))
                break
            except FenceUnavailable:
                continue
        if seen.receipt is not None and seen.state == _EXPECTED_STATE[kind]:
            if kind != "result" or seen.receipt.result == value:
                return seen.receipt
        # Not (or not visibly) recorded: send it again; an identical repeat is accepted and a
        # conflicting one is refused by the server.


# ------------------------------------------------------------------------------------------
# Drivers
# ------------------------------------------------------------------------------------------


def _drive_sync(client: Client, gen: Generator[_Op, Any, Any], fn: Callable[..., Any]) -> Any:
    to_send: Any = None
    to_throw: BaseException | None = None
    while True:
        try:
            op = gen.throw(to_throw) if to_throw is not None else gen.send(to_send)
        except StopIteration as stop:
            return stop.value
        to_send, to_throw = None, None
        try:
            if isinstance(op, _Call):
                to_send = getattr(client, op.method)(**op.kwargs)
            elif isinstance(op, _Sleep):
                time.sleep(op.seconds)
            else:
                to_send = _invoke_sync(client, fn, op)
        except BaseException as exc:  # delivered to the protocol, which decides
            to_throw = exc


def _invoke_sync(client: Client, fn: Callable[..., Any], op: _Invoke) -> Any:
    stop = threading.Event()
    beater = None
    if op.heartbeat_s:
        ex = op.execution

        def beat() -> None:
            while not stop.wait(op.heartbeat_s):
                try:
                    client.heartbeat(ex.effect_id, ex.attempt, ex.epoch)
                except FenceRefused:
                    return  # lease lost or effect finished: nothing more to extend
                except FenceError:
                    continue

        beater = threading.Thread(target=beat, name=f"fence-heartbeat-{ex.effect_id}", daemon=True)
        beater.start()
    token = _current_execution.set(op.execution)
    try:
        return fn(*op.args, **op.kwargs)
    finally:
        _current_execution.reset(token)
        stop.set()
        if beater is not None:
            beater.join()


async def _drive_async(
    client: AsyncClient, gen: Generator[_Op, Any, Any], fn: Callable[..., Any]
) -> Any:
    to_send: Any = None
    to_throw: BaseException | None = None
    while True:
        try:
            op = gen.throw(to_throw) if to_throw is not None else gen.send(to_send)
        except StopIteration as stop:
            return stop.value
        to_send, to_throw = None, None
        try:
            if isinstance(op, _Call):
                to_send = await getattr(client, op.method)(**op.kwargs)
            elif isinstance(op, _Sleep):
                await asyncio.sleep(op.seconds)
            else:
                to_send = await _invoke_async(client, fn, op)
        except BaseException as exc:  # delivered to the protocol, which decides
            to_throw = exc


async def _invoke_async(client: AsyncClient, fn: Callable[..., Any], op: _Invoke) -> Any:
    beater = None
    if op.heartbeat_s:
        ex = op.execution
        interval = op.heartbeat_s

        async def beat() -> None:
            while True:
                await asyncio.sleep(interval)
                try:
                    await client.heartbeat(ex.effect_id, ex.attempt, ex.epoch)
                except FenceRefused:
                    return
                except FenceError:
                    continue

        beater = asyncio.ensure_future(beat())
    token = _current_execution.set(op.execution)
    try:
        result = fn(*op.args, **op.kwargs)
        if inspect.isawaitable(result):
            result = await result
        return result
    finally:
        _current_execution.reset(token)
        if beater is not None:
            beater.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await beater


# ------------------------------------------------------------------------------------------
# The decorator
# ------------------------------------------------------------------------------------------


class FencedTool:
    """What :func:`fenced` attaches to the wrapper as ``wrapper.fence``: the definition and
    the call machinery (``call`` / ``acall`` with explicit fence options)."""

    def __init__(
        self,
        client: Client | AsyncClient,
        fn: Callable[..., Any],
        definition: _ToolDef,
        run: Run | Callable[[], Run] | None,
        downstream_key_arg: str | None,
        exclude: frozenset[str],
        credential_args: tuple[str, ...] = (),
    ) -> None:
        self.client = client
        self.fn = fn
        self.definition = definition
        self._default_run = run
        self.is_async = inspect.iscoroutinefunction(fn)
        signature = inspect.signature(fn)
        for name in signature.parameters:
            if name in RESERVED_KEYWORDS:
                raise TypeError(f"fenced: parameter {name!r} of {fn.__qualname__} is reserved")
        self.downstream_param: str | None = None
        if downstream_key_arg and downstream_key_arg in signature.parameters:
            param = signature.parameters[downstream_key_arg]
            if param.kind not in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY):
                raise TypeError(
                    f"fenced: {downstream_key_arg!r} of {fn.__qualname__} must be passable by keyword"
                )
            self.downstream_param = downstream_key_arg
        self.public_signature = signature.replace(
            parameters=[p for n, p in signature.parameters.items() if n != self.downstream_param]
        )
        for name in credential_args:
            if name not in signature.parameters:
                raise TypeError(
                    f"fenced: credential_args names {name!r}, which is not a parameter of "
                    f"{fn.__qualname__}"
                )
        self.credential_args = credential_args
        # A credential is authority, not intent: it is spent, never fingerprinted.
        self.exclude = exclude | frozenset(credential_args)

    @property
    def name(self) -> str:
        """The tool's name."""
        return self.definition.name

    def _prepare(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _CallRequest:
        options = {k: kwargs.pop(k) for k in list(kwargs) if k in RESERVED_KEYWORDS}
        if self.downstream_param is not None and self.downstream_param in kwargs:
            raise TypeError(
                f"fenced: {self.downstream_param!r} is supplied by Fence (the grant's downstream key)"
            )
        bound = self.public_signature.bind(*args, **kwargs)
        bound.apply_defaults()
        declared = tuple(
            bound.arguments[name]
            for name in self.credential_args
            if bound.arguments.get(name) not in (None, "", b"")
        )
        arguments: dict[str, Any] = {}
        for name, param in self.public_signature.parameters.items():
            if name in self.exclude or name not in bound.arguments:
                continue
            value = bound.arguments[name]
            if param.kind == param.VAR_POSITIONAL:
                if value:
                    arguments[name] = list(value)
            elif param.kind == param.VAR_KEYWORD:
                arguments.update({k: v for k, v in value.items() if k not in self.exclude})
            else:
                arguments[name] = value
        try:
            arguments_json = rq.dumps(arguments)
        except (TypeError, ValueError) as err:
            raise TypeError(
                f"fenced: the arguments of {self.name} must be JSON-serialisable "
                f"(exclude non-data parameters with exclude=[...]): {err}"
            ) from err

        run = options.get("fence_run") or _current_run.get()
        if run is None and self._default_run is not None:
            run = self._default_run() if callable(self._default_run) else self._default_run
        if not isinstance(run, Run):
            raise TypeError(
                f"fenced: no run for {self.name}: pass fence_run=Run(...), use fence.use_run(), "
                "or give the decorator run=..."
            )
        step, step_key = options.get("fence_step"), options.get("fence_step_key")
        if step is not None and step_key is not None:
            raise TypeError("fenced: give fence_step or fence_step_key, not both")
        if step is not None:
            step_key = f"{run.run_id}:{step}"
        return _CallRequest(
            run=run,
            arguments_json=arguments_json,
            step_key=step_key or "",
            deliberate_repeat=bool(options.get("fence_deliberate_repeat", False)),
            credentials=tuple(options.get("fence_credentials", ())) + declared,
            lease_ms=int(options.get("fence_lease_ms", 0)),
            saga_id=options.get("fence_saga_id", ""),
            compensation=options.get("fence_compensation"),
            compensates_effect_id=options.get("fence_compensates_effect_id", ""),
            request_id=options.get("fence_request_id") or uuid.uuid4().hex,
            parent_checkpoint_id=options.get("fence_parent_checkpoint_id", ""),
            args=bound.args,
            kwargs=dict(bound.kwargs),
            downstream_param=self.downstream_param,
        )

    def call(self, *args: Any, **kwargs: Any) -> Any:
        """Runs one fenced call of a sync function (same as calling the wrapper)."""
        request = self._prepare(args, kwargs)
        assert isinstance(self.client, Client)
        return _drive_sync(self.client, _protocol(self.definition, request), self.fn)

    async def acall(self, *args: Any, **kwargs: Any) -> Any:
        """Runs one fenced call of an async function (same as awaiting the wrapper)."""
        request = self._prepare(args, kwargs)
        assert isinstance(self.client, AsyncClient)
        return await _drive_async(self.client, _protocol(self.definition, request), self.fn)


def fenced(
    client: Client | AsyncClient,
    *,
    tool: str | None = None,
    cls: OperationClass = OperationClass.NON_RETRYABLE,
    volatile_fields: Sequence[str] = (),
    normalized_fields: Sequence[str] = (),
    string_normalization: StringNormalization = StringNormalization.STRING_NORMALIZATION_UNSPECIFIED,
    retention_ms: int = 0,
    lease_ms: int = 0,
    register: bool = True,
    run: Run | Callable[[], Run] | None = None,
    downstream_key_arg: str | None = "downstream_key",
    exclude: Iterable[str] = (),
    failed_before_input: Iterable[type[BaseException]] = (),
    encode: Callable[[Any], bytes] | None = None,
    decode: Callable[[bytes], Any] | None = None,
    wait: WaitPolicy | None = None,
    heartbeat: bool = True,
    credential_args: Iterable[str] = (),
) -> Callable[[F], F]:
    """Fences a function (sync with :class:`fence.Client`, async with
    :class:`fence.AsyncClient`) as the tool ``tool``.

    The wrapper takes the function's own arguments (they become the call's JSON arguments,
    minus ``exclude``), plus keyword-only fence options: ``fence_run`` (a :class:`fence.Run`;
    else :func:`use_run`'s, else the decorator's ``run``), ``fence_step`` (step key
    ``{run_id}:{step}``) or ``fence_step_key`` (verbatim), ``fence_credentials`` (tokens, or
    ``(token, budget)`` pairs), ``fence_deliberate_repeat``, ``fence_lease_ms``,
    ``fence_saga_id``, ``fence_compensation``, ``fence_compensates_effect_id``,
    ``fence_parent_checkpoint_id`` (the checkpoint the call descends from) and
    ``fence_request_id`` (default: a fresh nonce per call, repeated on its re-sends).

    Args:
        client: the client the calls go through.
        tool: the tool's name (default: the function's qualified name).
        cls: the operation class it is registered with.
        volatile_fields / normalized_fields / string_normalization: its intent schema.
        retention_ms / lease_ms: its retention and default lease (0 = server default).
        register: register the tool on first use (RegisterTool is idempotent).
        run: the default run (a :class:`fence.Run` or a callable returning one).
        downstream_key_arg: if the function has a parameter of this name, the grant's
            downstream key is passed to it (and it is not part of the arguments).
        exclude: parameters left out of the JSON arguments (clients, sessions...).
        failed_before_input: exception types that mean "nothing reached the outside world"
            (besides :class:`fence.FailedBeforeInputError`); any other is ambiguous.
        encode / decode: the result codec (default: JSON).
        wait: polling bounds for in-progress effects and transport failures.
        heartbeat: extend the lease while the function runs.
        credential_args: parameters whose values are one-time credentials (approval tokens,
            signed grants): each non-empty one is spent with the call (as
            ``fence_credentials``), left out of the call's intent, and still passed to the
            function. A spent approval presented again is refused ``CREDENTIAL_CONSUMED``
            unless the call is the exact replay of the effect that spent it.
    """
    definition_args = dict(
        cls=OperationClass(cls),
        volatile_fields=tuple(volatile_fields),
        normalized_fields=tuple(normalized_fields),
        string_normalization=StringNormalization(string_normalization),
        retention_ms=retention_ms,
        lease_ms=lease_ms,
        register=register,
        failed_before_input=tuple(failed_before_input),
        encode=encode or _encode_json,
        decode=decode or _decode_json,
        wait=wait or WaitPolicy(),
        heartbeat=heartbeat,
    )
    excluded = frozenset(exclude)
    credential_names = tuple(credential_args)

    def decorate(fn: F) -> F:
        definition = _ToolDef(name=tool or fn.__qualname__, **definition_args)  # type: ignore[arg-type]
        ft = FencedTool(
            client, fn, definition, run, downstream_key_arg, excluded, credential_names
        )
        if ft.is_async:
            if not isinstance(client, AsyncClient):
                raise TypeError(f"fenced: async {fn.__qualname__} needs a fence.AsyncClient")

            @functools.wraps(fn)
            async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
                return await ft.acall(*args, **kwargs)

            wrapper: Any = async_wrapper
        else:
            if not isinstance(client, Client):
                raise TypeError(f"fenced: sync {fn.__qualname__} needs a fence.Client")

            @functools.wraps(fn)
            def sync_wrapper(*args: Any, **kwargs: Any) -> Any:
                return ft.call(*args, **kwargs)

            wrapper = sync_wrapper
        # Frameworks derive a tool's schema from the signature: hide the downstream key.
        wrapper.__signature__ = ft.public_signature
        wrapper.fence = ft
        return wrapper  # type: ignore[no-any-return]

    return decorate
