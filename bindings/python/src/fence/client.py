"""The synchronous client: one method per ``fence.v1.Fence`` RPC, typed in and out."""

from __future__ import annotations

from typing import Any, Iterable, Iterator, Sequence

import grpc

from . import _requests as rq
from . import types as t
from .errors import FenceError, error_from_rpc
from .session import Session, carried
from .v1 import fence_pb2_grpc

__all__ = ["Client", "DEFAULT_TARGET"]

DEFAULT_TARGET = "127.0.0.1:50051"


class Client:
    """A Fence client over a gRPC channel.

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
            built on them) as messages on one shared ``Session`` stream instead of one RPC
            each: the same decisions and errors at a lower cost per call (see
            :meth:`session`). Off by default.
    """

    def __init__(
        self,
        target: str = DEFAULT_TARGET,
        *,
        tenant: str | None = None,
        token: str | None = None,
        timeout: float | None = 30.0,
        channel_credentials: grpc.ChannelCredentials | None = None,
        channel: grpc.Channel | None = None,
        metadata: Sequence[tuple[str, str]] = (),
        sessions: bool = False,
    ) -> None:
        self.target = target
        self.timeout = timeout
        self.sessions = sessions
        self._owns_channel = channel is None
        if channel is None:
            if channel_credentials is not None:
                channel = grpc.secure_channel(target, channel_credentials)
            else:
                channel = grpc.insecure_channel(target)
        self._channel = channel
        self._stubs = {
            "Fence": fence_pb2_grpc.FenceStub(channel),
            "Admin": fence_pb2_grpc.AdminStub(channel),
        }
        self._metadata = rq.call_metadata(tenant, token, metadata)
        self._session = self.session() if sessions else None

    # -- plumbing ---------------------------------------------------------------------------

    def _call(self, rpc: rq.Rpc) -> Any:
        if self._session is not None and carried(rpc):
            return self._session._call(rpc)
        method = getattr(self._stubs[rpc.service], rpc.method)
        try:
            response = method(rpc.request, timeout=self.timeout, metadata=self._metadata)
        except grpc.RpcError as err:
            raise error_from_rpc(err) from None
        return rpc.convert(response)

    def close(self) -> None:
        """Ends the client's session stream (with ``sessions``) and closes the channel (if
        this client created it)."""
        if self._session is not None:
            self._session.close()
        if self._owns_channel:
            self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- tool registry ----------------------------------------------------------------------

    def register_tool(
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
        return self._call(
            rq.register_tool(
                name, cls, volatile_fields, normalized_fields, string_normalization, retention_ms, lease_ms
            )
        )

    def get_tool(self, name: str, version: int = 0) -> t.ToolSpec:
        """A tool's current definition (or the given version)."""
        return self._call(rq.get_tool(name, version))

    def list_tools(self, *, page_size: int = 0, page_token: str = "") -> t.ToolsPage:
        """One page of the registered tools, each at its current version."""
        return self._call(rq.list_tools(page_size, page_token))

    def iter_tools(self, *, page_size: int = 0) -> Iterator[t.ToolSpec]:
        """Every registered tool (current versions), following page tokens; in the server's
        stable order, not by name."""
        yield from rq.follow_pages(
            lambda token: self.list_tools(page_size=page_size, page_token=token),
            lambda p: p.tools,
        )

    # -- runs -------------------------------------------------------------------------------

    def start_run(self, run: rq.RunLike) -> t.StartedRun:
        """Creates the run if needed (idempotent): epoch 1, branch "main"."""
        return self._call(rq.start_run(run))

    def get_run(self, run: rq.RunLike) -> t.RunInfo:
        """A run's epoch, branches, checkpoints and restore history."""
        return self._call(rq.get_run(run))

    def list_runs(
        self, *, run_id_prefix: str = "", page_size: int = 0, page_token: str = ""
    ) -> t.RunsPage:
        """One page of the tenant's runs in run-id order (those whose id starts with
        ``run_id_prefix``)."""
        return self._call(rq.list_runs(run_id_prefix, page_size, page_token))

    def iter_runs(self, *, run_id_prefix: str = "", page_size: int = 0) -> Iterator[t.RunInfo]:
        """Every run of the tenant whose id starts with ``run_id_prefix``, following page
        tokens."""
        yield from rq.follow_pages(
            lambda token: self.list_runs(run_id_prefix=run_id_prefix, page_size=page_size, page_token=token),
            lambda p: p.runs,
        )

    def checkpoint(
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
        return self._call(rq.checkpoint(run, checkpoint_id, branch, epoch, parent_checkpoint_id))

    def restore(
        self, run: rq.RunLike, checkpoint_id: str, *, expected_epoch: int = 0
    ) -> t.RestoreResult:
        """Rewinds to a checkpoint: new epoch and replay tape. Updates a :class:`fence.Run`."""
        return self._call(rq.restore(run, checkpoint_id, expected_epoch))

    def fork(
        self,
        run: rq.RunLike,
        checkpoint_id: str,
        *,
        epoch: int | None = None,
        new_branch: str = "",
        reason: str = "",
    ) -> t.BranchInfo:
        """Creates a branch at a checkpoint. A :class:`fence.Run` handle moves onto it."""
        return self._call(rq.fork(run, checkpoint_id, epoch, new_branch, reason))

    # -- effects ----------------------------------------------------------------------------

    def begin(
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
        return self._call(
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

    def heartbeat(self, effect_id: str, attempt: int, epoch: int, *, extend_ms: int = 0) -> t.Receipt:
        """Extends a granted effect's lease."""
        return self._call(rq.heartbeat(effect_id, attempt, epoch, extend_ms))

    def complete(
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
        return self._call(rq.complete(effect_id, attempt, epoch, result, failed_before_input, unknown))

    def session(self) -> Session:
        """Begin, Complete and Heartbeat over one long-lived ``Session`` stream: the same
        decisions as :meth:`begin`, :meth:`complete` and :meth:`heartbeat` at a lower cost per
        call, shareable by threads. The stream opens on the first call; close the session (or
        use it as a context manager) when done."""
        return Session(self._stubs["Fence"].Session, self._metadata, self.timeout)

    def begin_batch(self, calls: Iterable[rq.BeginCall]) -> list[t.BeginResult | FenceError]:
        """Begins several calls in one request (parallel tool calls): each is decided as
        :meth:`begin` would decide it alone, in order, and all share one fsync. Returns one
        item per call: its result, or the error it would have raised alone (not raised). The
        request itself failing raises, and then any call may or may not have been recorded."""
        return self._call(rq.begin_batch(calls))

    def complete_batch(self, calls: Iterable[rq.CompleteCall]) -> list[t.Receipt | FenceError]:
        """Records several outcomes in one request, each as :meth:`complete` would alone, with
        one fsync for all; one receipt or error per call, as in :meth:`begin_batch`."""
        return self._call(rq.complete_batch(calls))

    def reconcile(
        self,
        effect_id: str,
        epoch: int,
        evidence: str,
        *,
        completed_result: bytes | None = None,
        failed_before_input: str | None = None,
    ) -> t.Receipt:
        """Settles an effect whose outcome is unknown, with evidence."""
        return self._call(rq.reconcile(effect_id, epoch, evidence, completed_result, failed_before_input))

    def query_outcome(
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
        return self._call(rq.query_outcome(effect_id, run, step_key, tool, arguments, branch))

    def list_effects(
        self,
        run: rq.RunLike,
        *,
        branch: str = "",
        saga_id: str = "",
        page_size: int = 0,
        page_token: str = "",
    ) -> t.EffectsPage:
        """One page of a run's effects (the audit trail)."""
        return self._call(rq.list_effects(run, branch, saga_id, page_size, page_token))

    def iter_effects(
        self, run: rq.RunLike, *, branch: str = "", saga_id: str = "", page_size: int = 0
    ) -> Iterator[t.Receipt]:
        """Every effect of a run, following page tokens."""
        yield from rq.follow_pages(
            lambda token: self.list_effects(run, branch=branch, saga_id=saga_id, page_size=page_size, page_token=token),
            lambda p: p.effects,
        )

    def list_unsettled_effects(
        self,
        *,
        state: t.EffectState | None = None,
        page_size: int = 0,
        page_token: str = "",
    ) -> t.EffectsPage:
        """One page of the tenant's effects not settled yet, across its runs (granted, running,
        or of unknown outcome); ``state=EffectState.EFFECT_UNKNOWN``: the ones to reconcile."""
        return self._call(rq.list_unsettled_effects(state, page_size, page_token))

    def iter_unsettled_effects(
        self, *, state: t.EffectState | None = None, page_size: int = 0
    ) -> Iterator[t.Receipt]:
        """Every effect of the tenant not settled yet, following page tokens."""
        yield from rq.follow_pages(
            lambda token: self.list_unsettled_effects(state=state, page_size=page_size, page_token=token),
            lambda p: p.effects,
        )

    # -- backups (the Admin service) --------------------------------------------------------

    def create_backup(self, directory: str) -> t.Backup:
        """Writes a consistent copy of the whole ledger into ``directory``, a new absolute path
        on the server's machine, while the server serves; verified before it returns. In token
        mode the client's token must be marked ``admin``."""
        return self._call(rq.create_backup(directory))

    def verify_backup(self, directory: str) -> t.BackupReport:
        """Reads and checks every record of a backup on the server's machine."""
        return self._call(rq.verify_backup(directory))

    def compact_store(self) -> t.Compacted:
        """Compacts the server's whole store now: finished effects past their retention window
        lose their payload on disk too (the server does this in the background within
        ``--retention-compaction-hours``), and space is reclaimed. It rewrites every table
        file. In token mode the client's token must be marked ``admin``."""
        return self._call(rq.compact_store())

    # -- credentials ------------------------------------------------------------------------

    def register_credential(
        self,
        token: bytes | str,
        *,
        budget: int = 0,
        bound_tool: str = "",
        bound_arguments: rq.JsonArgs | None = None,
    ) -> t.CredentialRegistration:
        """Registers a one-time (or n-time) credential; the raw value is only hashed."""
        return self._call(rq.register_credential(token, budget, bound_tool, bound_arguments))

    def get_credential(self, token: bytes | str) -> t.CredentialInfo:
        """A credential's use state."""
        return self._call(rq.get_credential(token))
