"""The asyncio client (grpc.aio): the same methods as :class:`fence.Client`, awaited."""

from __future__ import annotations

import asyncio
import weakref
from dataclasses import dataclass
from typing import Any, AsyncIterator, Iterable, Sequence

import grpc
import grpc.aio

from . import _requests as rq
from . import types as t
from .client import DEFAULT_TARGET
from .errors import FenceError, error_from_rpc
from .session import AsyncSession, carried
from .v1 import fence_pb2_grpc

__all__ = ["AsyncClient"]


@dataclass
class _LoopState:
    """What an :class:`AsyncClient` opened in one event loop."""

    loop: weakref.ref[asyncio.AbstractEventLoop]
    channel: grpc.aio.Channel
    stubs: dict[str, Any]
    session: AsyncSession | None = None


class AsyncClient:
    """A Fence client over a ``grpc.aio`` channel; every RPC method is a coroutine.

    ``begin`` answers with a typed decision (:class:`fence.Execute`, :class:`fence.Replay`,
    :class:`fence.InProgress` or :class:`fence.Refusal`), never an exception for a
    well-formed request. Every other RPC raises :class:`fence.FenceRefused` for a domain
    refusal (with ``reason`` and ``recovery`` parsed from the status details) and
    :class:`fence.FenceRpcError` / :class:`fence.FenceUnavailable` for anything else.

    Args:
        target: ``host:port`` of the server.
        tenant: sent as ``x-fence-tenant`` (the server's dev mode); ``None`` = not sent.
        token: sent as ``authorization: Bearer <token>``; ``None`` = not sent.
        timeout: per-call deadline in seconds (``None`` = none).
        channel_credentials: TLS credentials; ``None`` = plaintext.
        channel: an existing channel to use instead (the client does not close it).
        metadata: extra metadata sent with every call.
        sessions: send ``begin``, ``complete`` and ``heartbeat`` (and so every integration
            built on them) as messages on one shared ``Session`` stream per event loop instead
            of one RPC each: the same decisions and errors at a lower cost per call (see
            :meth:`session`). Off by default.

    The client may be created anywhere, at module level included: it opens its channel
    lazily, in the event loop that first uses it, and a new one for each other loop that uses
    it later (``asyncio.run`` twice, a test framework's per-test loops), so it is never
    "attached to a different loop".
    """

    def __init__(
        self,
        target: str = DEFAULT_TARGET,
        *,
        tenant: str | None = None,
        token: str | None = None,
        timeout: float | None = 30.0,
        channel_credentials: grpc.ChannelCredentials | None = None,
        channel: grpc.aio.Channel | None = None,
        metadata: Sequence[tuple[str, str]] = (),
        sessions: bool = False,
    ) -> None:
        self.target = target
        self.timeout = timeout
        self.sessions = sessions
        self._owns_channel = channel is None
        self._credentials = channel_credentials
        self._given = channel
        # Per event loop: the channel opened in it, its stubs and (with `sessions`) the
        # session its calls share. A grpc.aio channel, and a stream, belong to the loop they
        # were opened in.
        self._by_loop: dict[int, _LoopState] = {}
        self._metadata = rq.call_metadata(tenant, token, metadata)

    # -- plumbing ---------------------------------------------------------------------------

    def _loop(self) -> _LoopState:
        """The running loop's channel, stubs and session, the channel opened on first use in
        that loop."""
        loop = asyncio.get_running_loop()
        state = self._by_loop.get(id(loop))
        if state is not None and state.loop() is loop:
            return state
        # Forget channels of loops that are gone (their ids may be reused).
        for key, known in list(self._by_loop.items()):
            alive = known.loop()
            if alive is None or alive.is_closed():
                del self._by_loop[key]
        channel = self._given
        if channel is None:
            if self._credentials is not None:
                channel = grpc.aio.secure_channel(self.target, self._credentials)
            else:
                channel = grpc.aio.insecure_channel(self.target)
        stubs = {
            "Fence": fence_pb2_grpc.FenceStub(channel),
            "Admin": fence_pb2_grpc.AdminStub(channel),
        }
        state = _LoopState(weakref.ref(loop), channel, stubs)
        self._by_loop[id(loop)] = state
        return state

    @property
    def _stubs(self) -> dict[str, Any]:
        """The stubs (by service) of the running loop's channel."""
        return self._loop().stubs

    def _loop_session(self) -> AsyncSession:
        """The running loop's shared session, made on its first call."""
        state = self._loop()
        if state.session is None:
            state.session = self.session()
        return state.session

    async def _call(self, rpc: rq.Rpc) -> Any:
        if self.sessions and carried(rpc):
            return await self._loop_session()._call(rpc)
        method = getattr(self._stubs[rpc.service], rpc.method)
        try:
            response = await method(rpc.request, timeout=self.timeout, metadata=self._metadata)
        except grpc.RpcError as err:
            raise error_from_rpc(err) from None
        return rpc.convert(response)

    async def close(self) -> None:
        """Ends the running loop's session stream (with ``sessions``) and closes the channel
        this client opened in that loop (a channel given to the constructor is left open);
        channels and streams of other loops end with their loop."""
        loop = asyncio.get_running_loop()
        state = self._by_loop.pop(id(loop), None)
        if state is None:
            return
        if state.session is not None:
            await state.session.close()
        if self._owns_channel:
            await state.channel.close(None)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- tool registry ----------------------------------------------------------------------

    async def register_tool(
        self,
        name: str | t.ToolSpec,
        cls: t.OperationClass | None = None,
        *,
        volatile_fields: Iterable[str] = (),
        normalized_fields: Iterable[str] = (),
        string_normalization: t.StringNormalization = t.StringNormalization.STRING_NORMALIZATION_UNSPECIFIED,
        retention_ms: int = 0,
        lease_ms: int = 0,
    ) -> t.ToolRegistration:
        """Registers (or re-registers) a tool; identical re-registration is a no-op."""
        return await self._call(
            rq.register_tool(
                name, cls, volatile_fields, normalized_fields, string_normalization, retention_ms, lease_ms
            )
        )

    async def get_tool(self, name: str, version: int = 0) -> t.ToolSpec:
        """A tool's current definition (or the given version)."""
        return await self._call(rq.get_tool(name, version))

    async def list_tools(self, *, page_size: int = 0, page_token: str = "") -> t.ToolsPage:
        """One page of the registered tools, each at its current version."""
        return await self._call(rq.list_tools(page_size, page_token))

    async def iter_tools(self, *, page_size: int = 0) -> AsyncIterator[t.ToolSpec]:
        """Every registered tool (current versions), following page tokens; in the server's
        stable order, not by name."""
        async for item in rq.follow_pages_async(
            lambda token: self.list_tools(page_size=page_size, page_token=token),
            lambda p: p.tools,
        ):
            yield item

    # -- runs -------------------------------------------------------------------------------

    async def start_run(self, run: rq.RunLike) -> t.StartedRun:
        """Creates the run if needed (idempotent): epoch 1, branch "main"."""
        return await self._call(rq.start_run(run))

    async def get_run(self, run: rq.RunLike) -> t.RunInfo:
        """A run's epoch, branches, checkpoints and restore history."""
        return await self._call(rq.get_run(run))

    async def list_runs(
        self, *, run_id_prefix: str = "", page_size: int = 0, page_token: str = ""
    ) -> t.RunsPage:
        """One page of the tenant's runs in run-id order (those whose id starts with
        ``run_id_prefix``)."""
        return await self._call(rq.list_runs(run_id_prefix, page_size, page_token))

    async def iter_runs(
        self, *, run_id_prefix: str = "", page_size: int = 0
    ) -> AsyncIterator[t.RunInfo]:
        """Every run of the tenant whose id starts with ``run_id_prefix``, following page
        tokens."""
        async for item in rq.follow_pages_async(
            lambda token: self.list_runs(run_id_prefix=run_id_prefix, page_size=page_size, page_token=token),
            lambda p: p.runs,
        ):
            yield item

    async def checkpoint(
        self,
        run: rq.RunLike,
        checkpoint_id: str,
        *,
        branch: str | None = None,
        epoch: int | None = None,
        parent_checkpoint_id: str = "",
    ) -> t.CheckpointResult:
        """Records a named checkpoint on the branch (default: the handle's).

        ``parent_checkpoint_id`` names the checkpoint this one follows: every effect that
        names this checkpoint (or one after it) as its parent is after it, however late this
        call arrives (frameworks save checkpoints in the background)."""
        return await self._call(rq.checkpoint(run, checkpoint_id, branch, epoch, parent_checkpoint_id))

    async def restore(
        self, run: rq.RunLike, checkpoint_id: str, *, expected_epoch: int = 0
    ) -> t.RestoreResult:
        """Rewinds to a checkpoint: new epoch and replay tape. Updates a :class:`fence.Run`."""
        return await self._call(rq.restore(run, checkpoint_id, expected_epoch))

    async def fork(
        self,
        run: rq.RunLike,
        checkpoint_id: str,
        *,
        epoch: int | None = None,
        new_branch: str = "",
        reason: str = "",
    ) -> t.BranchInfo:
        """Creates a branch at a checkpoint. A :class:`fence.Run` handle moves onto it."""
        return await self._call(rq.fork(run, checkpoint_id, epoch, new_branch, reason))

    # -- effects ----------------------------------------------------------------------------

    async def begin(
        self,
        run: rq.RunLike,
        tool: str,
        arguments: rq.JsonArgs,
        *,
        step_key: str = "",
        branch: str | None = None,
        epoch: int | None = None,
        deliberate_repeat: bool = False,
        credentials: Iterable[rq.CredentialArg] = (),
        lease_ms: int = 0,
        record: bool = False,
        saga_id: str = "",
        compensation: t.Compensation | None = None,
        compensates_effect_id: str = "",
        request_id: str = "",
        parent_checkpoint_id: str = "",
    ) -> t.BeginResult:
        """Asks to perform one call of a tool; answers with a typed decision.

        ``request_id``: a nonce made once per logical call and repeated when re-sending it
        (after a lost answer the same requester gets its grant back, with or without a step
        key). ``parent_checkpoint_id``: the checkpoint the call descends from (its causal
        step; see the proto)."""
        return await self._call(
            rq.begin(
                run,
                tool,
                arguments,
                step_key=step_key,
                branch=branch,
                epoch=epoch,
                deliberate_repeat=deliberate_repeat,
                credentials=credentials,
                lease_ms=lease_ms,
                record=record,
                saga_id=saga_id,
                compensation=compensation,
                compensates_effect_id=compensates_effect_id,
                request_id=request_id,
                parent_checkpoint_id=parent_checkpoint_id,
            )
        )

    async def heartbeat(self, effect_id: str, attempt: int, epoch: int, *, extend_ms: int = 0) -> t.Receipt:
        """Extends a granted effect's lease."""
        return await self._call(rq.heartbeat(effect_id, attempt, epoch, extend_ms))

    async def complete(
        self,
        effect_id: str,
        attempt: int,
        epoch: int,
        *,
        result: bytes | None = None,
        failed_before_input: str | None = None,
        unknown: str | None = None,
    ) -> t.Receipt:
        """Records a granted effect's outcome: exactly one of the three keywords."""
        return await self._call(rq.complete(effect_id, attempt, epoch, result, failed_before_input, unknown))

    def session(self) -> AsyncSession:
        """Begin, Complete and Heartbeat over one long-lived ``Session`` stream, as
        :meth:`fence.Client.session`; its stream belongs to the event loop of its first call."""
        return AsyncSession(lambda: self._stubs["Fence"], self._metadata, self.timeout)

    async def begin_batch(self, calls: Iterable[rq.BeginCall]) -> list[t.BeginResult | FenceError]:
        """Begins several calls in one request (parallel tool calls): each is decided as
        :meth:`begin` would decide it alone, in order, and all share one fsync. Returns one
        item per call: its result, or the error it would have raised alone (not raised). The
        request itself failing raises, and then any call may or may not have been recorded."""
        return await self._call(rq.begin_batch(calls))

    async def complete_batch(self, calls: Iterable[rq.CompleteCall]) -> list[t.Receipt | FenceError]:
        """Records several outcomes in one request, each as :meth:`complete` would alone, with
        one fsync for all; one receipt or error per call, as in :meth:`begin_batch`."""
        return await self._call(rq.complete_batch(calls))

    async def reconcile(
        self,
        effect_id: str,
        epoch: int,
        evidence: str,
        *,
        completed_result: bytes | None = None,
        failed_before_input: str | None = None,
    ) -> t.Receipt:
        """Settles an effect whose outcome is unknown, with evidence."""
        return await self._call(rq.reconcile(effect_id, epoch, evidence, completed_result, failed_before_input))

    async def query_outcome(
        self,
        *,
        effect_id: str | None = None,
        run: rq.RunLike | None = None,
        step_key: str | None = None,
        tool: str | None = None,
        arguments: rq.JsonArgs | None = None,
        branch: str | None = None,
    ) -> t.Outcome:
        """What happened: by ``effect_id``, by ``run`` + ``step_key``, or by ``run`` + ``tool``
        + ``arguments`` (intent)."""
        return await self._call(rq.query_outcome(effect_id, run, step_key, tool, arguments, branch))

    async def list_effects(
        self,
        run: rq.RunLike,
        *,
        branch: str = "",
        saga_id: str = "",
        page_size: int = 0,
        page_token: str = "",
    ) -> t.EffectsPage:
        """One page of a run's effects (the audit trail)."""
        return await self._call(rq.list_effects(run, branch, saga_id, page_size, page_token))

    async def iter_effects(
        self, run: rq.RunLike, *, branch: str = "", saga_id: str = "", page_size: int = 0
    ) -> AsyncIterator[t.Receipt]:
        """Every effect of a run, following page tokens."""
        async for item in rq.follow_pages_async(
            lambda token: self.list_effects(run, branch=branch, saga_id=saga_id, page_size=page_size, page_token=token),
            lambda p: p.effects,
        ):
            yield item

    async def list_unsettled_effects(
        self,
        *,
        state: t.EffectState | None = None,
        page_size: int = 0,
        page_token: str = "",
    ) -> t.EffectsPage:
        """One page of the tenant's effects not settled yet, across its runs (granted, running,
        or of unknown outcome); ``state=EffectState.EFFECT_UNKNOWN``: the ones to reconcile."""
        return await self._call(rq.list_unsettled_effects(state, page_size, page_token))

    async def iter_unsettled_effects(
        self, *, state: t.EffectState | None = None, page_size: int = 0
    ) -> AsyncIterator[t.Receipt]:
        """Every effect of the tenant not settled yet, following page tokens."""
        async for item in rq.follow_pages_async(
            lambda token: self.list_unsettled_effects(state=state, page_size=page_size, page_token=token),
            lambda p: p.effects,
        ):
            yield item

    # -- backups (the Admin service) --------------------------------------------------------

    async def create_backup(self, directory: str) -> t.Backup:
        """Writes a consistent copy of the whole ledger into ``directory``, a new absolute path
        on the server's machine, while the server serves; verified before it returns. In token
        mode the client's token must be marked ``admin``."""
        return await self._call(rq.create_backup(directory))

    async def verify_backup(self, directory: str) -> t.BackupReport:
        """Reads and checks every record of a backup on the server's machine."""
        return await self._call(rq.verify_backup(directory))

    async def compact_store(self) -> t.Compacted:
        """Compacts the server's whole store now: finished effects past their retention window
        lose their payload on disk too (the server does this in the background within
        ``--retention-compaction-hours``), and space is reclaimed. It rewrites every table
        file. In token mode the client's token must be marked ``admin``."""
        return await self._call(rq.compact_store())

    # -- credentials ------------------------------------------------------------------------

    async def register_credential(
        self,
        token: bytes | str,
        *,
        budget: int = 0,
        bound_tool: str = "",
        bound_arguments: rq.JsonArgs | None = None,
    ) -> t.CredentialRegistration:
        """Registers a one-time (or n-time) credential; the raw value is only hashed."""
        return await self._call(rq.register_credential(token, budget, bound_tool, bound_arguments))

    async def get_credential(self, token: bytes | str) -> t.CredentialInfo:
        """A credential's use state."""
        return await self._call(rq.get_credential(token))
