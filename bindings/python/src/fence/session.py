"""Sessions: Begin, Complete and Heartbeat as messages on one long-lived ``Session`` stream.

A session makes the same decisions as :meth:`fence.Client.begin`, :meth:`~fence.Client.complete`
and :meth:`~fence.Client.heartbeat` (the server decides each call with the unary RPC's own
code), at a fraction of the per-call cost: no HTTP/2 stream, headers or trailers per call.
Many threads (or tasks) may share one session; each call gets its own answer.

The stream opens on the first call and again on the next call after a break. A call in flight
when the stream breaks raises :class:`fence.FenceUnavailable`: it may or may not have been
recorded, and resending it (the same ``request_id`` for a begin, the same outcome for a
complete) gets the same effect back, as with a unary call that failed in transit.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import queue
import threading
from typing import Any, AsyncIterator, Callable, Iterator

import grpc
import grpc.aio

from . import _requests as rq
from . import types as t
from .errors import FenceRpcError, FenceUnavailable, error_from_call_error, error_from_rpc
from .v1 import fence_pb2 as pb

__all__ = ["Session", "AsyncSession"]

# The SessionRequest oneof field of each unary method a session carries.
_FIELD = {"Begin": "begin", "Complete": "complete", "Heartbeat": "heartbeat"}


def carried(rpc: rq.Rpc) -> bool:
    """Whether a session carries this RPC (Begin, Complete and Heartbeat of ``Fence``)."""
    return rpc.service == "Fence" and rpc.method in _FIELD


def _broken(cause: str) -> FenceUnavailable:
    return FenceUnavailable(
        grpc.StatusCode.UNAVAILABLE,
        "the session stream broke before this call was answered "
        f"({cause}); it may or may not have been recorded: resend it "
        "(the same request id or outcome gets the same effect back)",
    )


def _request(rpc: rq.Rpc, call_id: int) -> pb.SessionRequest:
    request = pb.SessionRequest(id=call_id)
    getattr(request, _FIELD[rpc.method]).CopyFrom(rpc.request)
    return request


def _answer(rpc: rq.Rpc, response: pb.SessionResponse) -> Any:
    """The call's converted answer, or raises the error its unary RPC would have raised."""
    kind = response.WhichOneof("result")
    if kind == "error":
        e = response.error
        raise error_from_call_error(e.code, e.message, e.details)
    if kind != _FIELD[rpc.method]:
        raise FenceRpcError(
            grpc.StatusCode.INTERNAL, f"the server answered a {rpc.method} call with {kind!r}"
        )
    return rpc.convert(getattr(response, kind))


def _deadline(timeout: float) -> FenceRpcError:
    return FenceRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, f"no answer within {timeout} s")


class _Link:
    """One open stream (threads): a request queue feeding gRPC, a reader thread answering."""

    def __init__(self, open_stream: Callable[..., Any], metadata: tuple) -> None:
        self._requests: queue.Queue[pb.SessionRequest | None] = queue.Queue()
        self._waiting: dict[int, concurrent.futures.Future[pb.SessionResponse]] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self.broken = False
        self._responses = open_stream(self._outgoing(), metadata=metadata)
        threading.Thread(target=self._read, name="fence-session", daemon=True).start()

    def _outgoing(self) -> Iterator[pb.SessionRequest]:
        while (request := self._requests.get()) is not None:
            yield request

    def _read(self) -> None:
        cause = "the server ended it"
        try:
            for response in self._responses:
                with self._lock:
                    waiter = self._waiting.pop(response.id, None)
                # A call that gave up (its timeout) is no longer waiting.
                if waiter is not None:
                    waiter.set_result(response)
        except grpc.RpcError as err:
            cause = str(error_from_rpc(err))
        self._break(cause)

    def _break(self, cause: str) -> None:
        with self._lock:
            self.broken = True
            waiting, self._waiting = self._waiting, {}
        for waiter in waiting.values():
            waiter.set_exception(_broken(cause))

    def call(self, rpc: rq.Rpc, timeout: float | None) -> Any:
        waiter: concurrent.futures.Future[pb.SessionResponse] = concurrent.futures.Future()
        with self._lock:
            if self.broken:
                raise _broken("it had ended")
            call_id = next(self._ids)
            self._waiting[call_id] = waiter
        self._requests.put(_request(rpc, call_id))
        try:
            response = waiter.result(timeout)
        except concurrent.futures.TimeoutError:
            with self._lock:
                self._waiting.pop(call_id, None)
            raise _deadline(timeout or 0.0) from None
        return _answer(rpc, response)

    def close(self) -> None:
        """Ends the caller's side: the server answers what it read, then ends the stream."""
        self._requests.put(None)


class Session:
    """Begin, Complete and Heartbeat over one ``Session`` stream (see the module docs); made by
    :meth:`fence.Client.session`. Thread-safe; close it (or use it as a context manager) when
    done.

    >>> with client.session() as session:                             # doctest: +SKIP
    ...     began = session.begin(fence.BeginCall("order-7", "mail.send", {"to": "ada"}, step_key="notify"))
    ...     if isinstance(began.decision, fence.Execute):
    ...         session.complete(fence.CompleteCall(began.decision.effect_id, began.decision.attempt, result=b"ok"))
    """

    def __init__(self, open_stream: Callable[..., Any], metadata: tuple, timeout: float | None) -> None:
        self._open = open_stream
        self._metadata = metadata
        self.timeout = timeout
        self._lock = threading.Lock()
        self._link: _Link | None = None

    def _current(self) -> _Link:
        with self._lock:
            if self._link is None or self._link.broken:
                self._link = _Link(self._open, self._metadata)
            return self._link

    def _call(self, rpc: rq.Rpc) -> Any:
        """Sends one Begin, Complete or Heartbeat as a message and returns its answer."""
        return self._current().call(rpc, self.timeout)

    def begin(self, call: rq.BeginCall) -> t.BeginResult:
        """Asks to perform one call, as :meth:`fence.Client.begin` with the same arguments."""
        result: t.BeginResult = self._current().call(call.rpc(), self.timeout)
        return result

    def complete(self, call: rq.CompleteCall) -> t.Receipt:
        """Records a granted effect's outcome, as :meth:`fence.Client.complete`."""
        receipt: t.Receipt = self._current().call(call.rpc(), self.timeout)
        return receipt

    def heartbeat(self, effect_id: str, attempt: int, epoch: int, *, extend_ms: int = 0) -> t.Receipt:
        """Extends a granted effect's lease, as :meth:`fence.Client.heartbeat`."""
        receipt: t.Receipt = self._current().call(
            rq.heartbeat(effect_id, attempt, epoch, extend_ms), self.timeout
        )
        return receipt

    def close(self) -> None:
        """Ends the stream (the server answers what it already read). A later call opens a
        new one."""
        with self._lock:
            link, self._link = self._link, None
        if link is not None:
            link.close()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _AsyncLink:
    """One open stream (asyncio): a request queue feeding grpc.aio, a reader task answering."""

    def __init__(self, open_stream: Callable[..., Any], metadata: tuple) -> None:
        self.loop = asyncio.get_running_loop()
        self._requests: asyncio.Queue[pb.SessionRequest | None] = asyncio.Queue()
        self._waiting: dict[int, asyncio.Future[pb.SessionResponse]] = {}
        self._ids = itertools.count(1)
        self.broken = False
        self._call = open_stream(self._outgoing(), metadata=metadata)
        self._reader = self.loop.create_task(self._read())

    async def _outgoing(self) -> AsyncIterator[pb.SessionRequest]:
        while (request := await self._requests.get()) is not None:
            yield request

    async def _read(self) -> None:
        cause = "the server ended it"
        try:
            async for response in self._call:
                waiter = self._waiting.pop(response.id, None)
                if waiter is not None and not waiter.done():
                    waiter.set_result(response)
        except grpc.RpcError as err:
            cause = str(error_from_rpc(err))
        except asyncio.CancelledError:
            cause = "it was closed"
        self.broken = True
        waiting, self._waiting = self._waiting, {}
        for waiter in waiting.values():
            if not waiter.done():
                waiter.set_exception(_broken(cause))

    async def call(self, rpc: rq.Rpc, timeout: float | None) -> Any:
        if self.broken:
            raise _broken("it had ended")
        call_id = next(self._ids)
        waiter: asyncio.Future[pb.SessionResponse] = self.loop.create_future()
        self._waiting[call_id] = waiter
        self._requests.put_nowait(_request(rpc, call_id))
        try:
            response = await asyncio.wait_for(waiter, timeout)
        except asyncio.TimeoutError:
            self._waiting.pop(call_id, None)
            raise _deadline(timeout or 0.0) from None
        return _answer(rpc, response)

    async def close(self) -> None:
        self._requests.put_nowait(None)
        try:
            await asyncio.wait_for(asyncio.shield(self._reader), 5.0)
        except asyncio.TimeoutError:
            self._reader.cancel()


class AsyncSession:
    """:class:`Session` for asyncio; made by :meth:`fence.AsyncClient.session`. Its stream
    belongs to the event loop of its first call (a call from another loop opens a new one)."""

    def __init__(self, stub: Callable[[], Any], metadata: tuple, timeout: float | None) -> None:
        self._stub = stub
        self._metadata = metadata
        self.timeout = timeout
        self._link: _AsyncLink | None = None

    def _current(self) -> _AsyncLink:
        link = self._link
        if link is None or link.broken or link.loop is not asyncio.get_running_loop():
            link = self._link = _AsyncLink(self._stub().Session, self._metadata)
        return link

    async def _call(self, rpc: rq.Rpc) -> Any:
        """Sends one Begin, Complete or Heartbeat as a message and returns its answer."""
        return await self._current().call(rpc, self.timeout)

    async def begin(self, call: rq.BeginCall) -> t.BeginResult:
        """Asks to perform one call, as :meth:`fence.AsyncClient.begin`."""
        result: t.BeginResult = await self._current().call(call.rpc(), self.timeout)
        return result

    async def complete(self, call: rq.CompleteCall) -> t.Receipt:
        """Records a granted effect's outcome, as :meth:`fence.AsyncClient.complete`."""
        receipt: t.Receipt = await self._current().call(call.rpc(), self.timeout)
        return receipt

    async def heartbeat(self, effect_id: str, attempt: int, epoch: int, *, extend_ms: int = 0) -> t.Receipt:
        """Extends a granted effect's lease, as :meth:`fence.AsyncClient.heartbeat`."""
        receipt: t.Receipt = await self._current().call(
            rq.heartbeat(effect_id, attempt, epoch, extend_ms), self.timeout
        )
        return receipt

    async def close(self) -> None:
        """Ends the stream (the server answers what it already read)."""
        link, self._link = self._link, None
        if link is not None:
            await link.close()

    async def __aenter__(self) -> AsyncSession:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
