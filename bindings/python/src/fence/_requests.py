"""Request builders and response converters shared by the sync and async clients.

Every public client method is ``(rpc name, request, converter)``: built here once, so the two
clients differ only in whether they await the call.
"""

from __future__ import annotations

import base64
import dataclasses
import datetime
import decimal
import enum
import ipaddress
import json
import pathlib
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable, Iterable, Iterator, Protocol, TypeVar, Union

from . import errors
from . import types as t
from .v1 import fence_pb2 as pb

RunLike = Union[t.Run, str]
"""A run handle (:class:`fence.Run`) or just a run id."""

JsonArgs = Any
"""Tool arguments: a JSON string (sent as is) or any JSON-serialisable Python value."""


@dataclass(frozen=True)
class Rpc:
    """One prepared call: the stub method name, the request and how to convert the answer,
    and the service it belongs to (``Fence``, or ``Admin`` for backups)."""

    method: str
    request: Any
    convert: Callable[[Any], Any]
    service: str = "Fence"


class _Page(Protocol):
    @property
    def next_page_token(self) -> str: ...


_P = TypeVar("_P", bound=_Page)
_T = TypeVar("_T")


def follow_pages(fetch: Callable[[str], _P], items: Callable[[_P], Iterable[_T]]) -> Iterator[_T]:
    """Every item of a listing: ``fetch(token)`` page after page until the token is empty."""
    token = ""
    while True:
        page = fetch(token)
        yield from items(page)
        if not page.next_page_token:
            return
        token = page.next_page_token


async def follow_pages_async(
    fetch: Callable[[str], Awaitable[_P]], items: Callable[[_P], Iterable[_T]]
) -> AsyncIterator[_T]:
    """:func:`follow_pages` for the asyncio client."""
    token = ""
    while True:
        page = await fetch(token)
        for item in items(page):
            yield item
        if not page.next_page_token:
            return
        token = page.next_page_token


def to_jsonable(value: Any) -> Any:
    """``value`` as plain JSON data, the same every time for the same value.

    Pydantic models are dumped by pydantic (aliases, field serializers); dataclasses
    become objects; datetimes, dates and times ISO 8601 strings; enums their value; UUIDs
    their canonical string; Decimals their exact digits (as a JSON number, so the server
    compares them exactly); sets sorted lists; bytes base64. Anything else raises
    ``TypeError``.
    """
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, enum.Enum):
        return to_jsonable(value.value)
    if isinstance(value, (int, float)):
        return value
    if isinstance(value, decimal.Decimal):
        if not value.is_finite():
            raise ValueError(f"{value} is not a JSON number")
        return _ExactNumber.of(value)
    if isinstance(value, dict):
        return {_key(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted((to_jsonable(v) for v in value), key=dumps)
    if isinstance(value, (datetime.datetime, datetime.date, datetime.time)):
        return value.isoformat()
    if isinstance(value, datetime.timedelta):
        return value.total_seconds()
    if isinstance(value, uuid.UUID):
        return str(value)
    if isinstance(value, (bytes, bytearray, memoryview)):
        return base64.b64encode(bytes(value)).decode("ascii")
    dump = getattr(value, "model_dump", None)
    if callable(dump) and hasattr(type(value), "model_fields"):
        # pydantic v2: the model's own dump (aliases, field serializers), in Python mode so
        # Decimals stay exact numbers; where a value only pydantic can encode remains, its
        # JSON mode is the model's notion of its JSON form.
        try:
            return to_jsonable(dump(mode="python", by_alias=True))
        except (TypeError, ValueError):
            return to_jsonable(dump(mode="json", by_alias=True))
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (pathlib.PurePath, ipaddress.IPv4Address, ipaddress.IPv6Address)):
        return str(value)
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def _key(key: Any) -> str:
    if isinstance(key, str):
        return key
    if isinstance(key, enum.Enum):
        return str(key.value)
    if isinstance(key, uuid.UUID):
        return str(key)
    if isinstance(key, (int, float, bool)) or key is None:
        return json.dumps(key)
    raise TypeError(f"object keys must be strings, not {type(key).__name__}")


@dataclass(frozen=True)
class _ExactNumber:
    """A Decimal to be written with its exact digits (``json`` would go through float)."""

    text: str

    @classmethod
    def of(cls, value: decimal.Decimal) -> "_ExactNumber":
        # Plain digits for ordinary magnitudes, exponent form beyond (both valid JSON).
        return cls(format(value, "f") if -30 < value.adjusted() < 30 else str(value))


def _write(value: Any, out: list[str]) -> None:
    if isinstance(value, _ExactNumber):
        out.append(value.text)
    elif isinstance(value, dict):
        out.append("{")
        for i, key in enumerate(sorted(value)):
            if i:
                out.append(",")
            out.append(json.dumps(key, ensure_ascii=False))
            out.append(":")
            _write(value[key], out)
        out.append("}")
    elif isinstance(value, list):
        out.append("[")
        for i, item in enumerate(value):
            if i:
                out.append(",")
            _write(item, out)
        out.append("]")
    else:
        out.append(json.dumps(value, ensure_ascii=False, allow_nan=False))


def dumps(value: Any) -> str:
    """Compact, deterministic JSON of ``value`` (see :func:`to_jsonable`): sorted keys, no
    whitespace. The server canonicalises again; this keeps requests and audits stable."""
    out: list[str] = []
    _write(to_jsonable(value), out)
    return "".join(out)


def arguments_json(arguments: JsonArgs) -> str:
    """A JSON string as is, anything else serialised."""
    if isinstance(arguments, str):
        return arguments
    return dumps(arguments)


def run_id_of(run: RunLike) -> str:
    return run.run_id if isinstance(run, t.Run) else run


def branch_of(run: RunLike, branch: str | None) -> str:
    if branch is not None:
        return branch
    return run.branch if isinstance(run, t.Run) else ""


def epoch_of(run: RunLike, epoch: int | None) -> int:
    if epoch is not None:
        return epoch
    return run.epoch if isinstance(run, t.Run) else 0


def _token(token: bytes | str) -> bytes:
    return token.encode("utf-8") if isinstance(token, str) else bytes(token)


CredentialArg = Union[bytes, str, tuple]
"""A credential to spend: raw bytes/str (budget 0 = one-time) or ``(token, budget)``."""


def credential_uses(credentials: Iterable[CredentialArg]) -> list[pb.CredentialUse]:
    uses = []
    for c in credentials:
        if isinstance(c, tuple):
            token, budget = c
            uses.append(pb.CredentialUse(token=_token(token), budget=int(budget)))
        else:
            uses.append(pb.CredentialUse(token=_token(c)))
    return uses


# ------------------------------------------------------------------------------------------


def register_tool(
    name_or_spec: str | t.ToolSpec,
    cls: t.OperationClass | None,
    volatile_fields: Iterable[str],
    normalized_fields: Iterable[str],
    string_normalization: t.StringNormalization,
    retention_ms: int,
    lease_ms: int,
) -> Rpc:
    if isinstance(name_or_spec, t.ToolSpec):
        spec = name_or_spec
    else:
        if cls is None:
            raise TypeError("register_tool: cls (the OperationClass) is required")
        spec = t.ToolSpec(
            name=name_or_spec,
            cls=t.OperationClass(cls),
            intent_schema=t.IntentSchema(
                volatile_fields=tuple(volatile_fields),
                normalized_fields=tuple(normalized_fields),
                string_normalization=t.StringNormalization(string_normalization),
            ),
            retention_ms=retention_ms,
            lease_ms=lease_ms,
        )
    return Rpc(
        "RegisterTool",
        pb.RegisterToolRequest(tool=spec.to_proto()),
        lambda r: t.ToolRegistration(t.ToolSpec.from_proto(r.tool), r.created),
    )


def get_tool(name: str, version: int) -> Rpc:
    return Rpc(
        "GetTool",
        pb.GetToolRequest(name=name, version=version),
        lambda r: t.ToolSpec.from_proto(r.tool),
    )


def list_tools(page_size: int, page_token: str) -> Rpc:
    return Rpc(
        "ListTools",
        pb.ListToolsRequest(page_size=page_size, page_token=page_token),
        lambda r: t.ToolsPage(tuple(t.ToolSpec.from_proto(x) for x in r.tools), r.next_page_token),
    )


def start_run(run: RunLike) -> Rpc:
    def convert(r: pb.StartRunResponse) -> t.StartedRun:
        started = t.StartedRun(t.RunInfo.from_proto(r.run), r.created)
        # A new handle (epoch 0) learns the run's epoch; a handle with an epoch keeps it.
        if isinstance(run, t.Run) and run.epoch == 0:
            run.epoch = started.run.epoch
        return started

    return Rpc("StartRun", pb.StartRunRequest(run_id=run_id_of(run)), convert)


def get_run(run: RunLike) -> Rpc:
    return Rpc(
        "GetRun", pb.GetRunRequest(run_id=run_id_of(run)), lambda r: t.RunInfo.from_proto(r.run)
    )


def list_runs(run_id_prefix: str, page_size: int, page_token: str) -> Rpc:
    return Rpc(
        "ListRuns",
        pb.ListRunsRequest(run_id_prefix=run_id_prefix, page_size=page_size, page_token=page_token),
        lambda r: t.RunsPage(tuple(t.RunInfo.from_proto(x) for x in r.runs), r.next_page_token),
    )


def checkpoint(
    run: RunLike,
    checkpoint_id: str,
    branch: str | None,
    epoch: int | None,
    parent_checkpoint_id: str = "",
) -> Rpc:
    return Rpc(
        "Checkpoint",
        pb.CheckpointRequest(
            run_id=run_id_of(run),
            branch=branch_of(run, branch),
            epoch=epoch_of(run, epoch),
            checkpoint_id=checkpoint_id,
            parent_checkpoint_id=parent_checkpoint_id,
        ),
        lambda r: t.CheckpointResult(t.CheckpointInfo.from_proto(r.checkpoint), r.created),
    )


def restore(run: RunLike, checkpoint_id: str, expected_epoch: int) -> Rpc:
    def convert(r: pb.RestoreResponse) -> t.RestoreResult:
        result = t.RestoreResult(
            epoch=r.epoch, branch=r.branch, tape=tuple(t.Receipt.from_proto(x) for x in r.tape)
        )
        if isinstance(run, t.Run):
            run.epoch = result.epoch
            if result.branch:
                run.branch = result.branch
        return result

    return Rpc(
        "Restore",
        pb.RestoreRequest(
            run_id=run_id_of(run), checkpoint_id=checkpoint_id, expected_epoch=expected_epoch
        ),
        convert,
    )


def fork(
    run: RunLike, checkpoint_id: str, epoch: int | None, new_branch: str, reason: str
) -> Rpc:
    def convert(r: pb.ForkResponse) -> t.BranchInfo:
        branch = dataclasses.replace(
            t.BranchInfo.from_proto(r.branch),
            carried=tuple(t.Receipt.from_proto(c) for c in r.carried),
        )
        if isinstance(run, t.Run):
            run.branch = branch.name
        return branch

    return Rpc(
        "Fork",
        pb.ForkRequest(
            run_id=run_id_of(run),
            checkpoint_id=checkpoint_id,
            epoch=epoch_of(run, epoch),
            new_branch=new_branch,
            reason=reason,
        ),
        convert,
    )


def begin(
    run: RunLike,
    tool: str,
    arguments: JsonArgs,
    *,
    step_key: str,
    branch: str | None,
    epoch: int | None,
    deliberate_repeat: bool,
    credentials: Iterable[CredentialArg],
    lease_ms: int,
    record: bool,
    saga_id: str,
    compensation: t.Compensation | None,
    compensates_effect_id: str,
    request_id: str = "",
    parent_checkpoint_id: str = "",
) -> Rpc:
    request = pb.BeginRequest(
        run_id=run_id_of(run),
        branch=branch_of(run, branch),
        epoch=epoch_of(run, epoch),
        tool=tool,
        arguments_json=arguments_json(arguments),
        step_key=step_key,
        deliberate_repeat=deliberate_repeat,
        credentials=credential_uses(credentials),
        lease_ms=lease_ms,
        record=record,
        saga_id=saga_id,
        compensates_effect_id=compensates_effect_id,
        request_id=request_id,
        parent_checkpoint_id=parent_checkpoint_id,
    )
    if compensation is not None:
        request.compensation.CopyFrom(compensation.to_proto())

    def convert(r: pb.BeginResponse) -> t.BeginResult:
        result = t.BeginResult(t.decision_from_proto(r.decision), r.epoch)
        # A handle that sent epoch 0 learns the epoch it was accepted in. A refusal never
        # moves the handle (a STALE_EPOCH caller must refresh deliberately).
        if (
            isinstance(run, t.Run)
            and epoch is None
            and run.epoch == 0
            and result.epoch
            and not isinstance(result.decision, t.Refusal)
        ):
            run.epoch = result.epoch
        return result

    return Rpc("Begin", request, convert)


def heartbeat(effect_id: str, attempt: int, epoch: int, extend_ms: int) -> Rpc:
    return Rpc(
        "Heartbeat",
        pb.HeartbeatRequest(effect_id=effect_id, attempt=attempt, epoch=epoch, extend_ms=extend_ms),
        lambda r: t.Receipt.from_proto(r.receipt),
    )


def complete(
    effect_id: str,
    attempt: int,
    epoch: int,
    result: bytes | None,
    failed_before_input: str | None,
    unknown: str | None,
) -> Rpc:
    given = [x is not None for x in (result, failed_before_input, unknown)]
    if sum(given) != 1:
        raise TypeError("complete: give exactly one of result, failed_before_input, unknown")
    request = pb.CompleteRequest(effect_id=effect_id, attempt=attempt, epoch=epoch)
    if result is not None:
        request.result = bytes(result)
    elif failed_before_input is not None:
        request.failed_before_input.detail = failed_before_input
    else:
        request.unknown.detail = unknown or ""
    return Rpc("Complete", request, lambda r: t.Receipt.from_proto(r.receipt))


@dataclass
class BeginCall:
    """One call of a :meth:`fence.Client.begin_batch`: the arguments of :meth:`fence.Client.begin`."""

    run: RunLike
    tool: str
    arguments: JsonArgs
    step_key: str = ""
    branch: str | None = None
    epoch: int | None = None
    deliberate_repeat: bool = False
    credentials: Iterable[CredentialArg] = ()
    lease_ms: int = 0
    record: bool = False
    saga_id: str = ""
    compensation: t.Compensation | None = None
    compensates_effect_id: str = ""
    request_id: str = ""
    parent_checkpoint_id: str = ""

    def rpc(self) -> Rpc:
        return begin(
            self.run,
            self.tool,
            self.arguments,
            step_key=self.step_key,
            branch=self.branch,
            epoch=self.epoch,
            deliberate_repeat=self.deliberate_repeat,
            credentials=self.credentials,
            lease_ms=self.lease_ms,
            record=self.record,
            saga_id=self.saga_id,
            compensation=self.compensation,
            compensates_effect_id=self.compensates_effect_id,
            request_id=self.request_id,
            parent_checkpoint_id=self.parent_checkpoint_id,
        )


@dataclass
class CompleteCall:
    """One completion of a :meth:`fence.Client.complete_batch`: exactly one of ``result``,
    ``failed_before_input`` and ``unknown``."""

    effect_id: str
    attempt: int
    epoch: int = 0
    result: bytes | None = None
    failed_before_input: str | None = None
    unknown: str | None = None

    def rpc(self) -> Rpc:
        return complete(
            self.effect_id, self.attempt, self.epoch, self.result, self.failed_before_input, self.unknown
        )


def _batch(method: str, request: Any, field: str, rpcs: list[Rpc]) -> Rpc:
    """A batch RPC whose answer is one converted response, or the error the call would have
    raised alone, per call."""
    getattr(request, field).extend(r.request for r in rpcs)

    def convert(response: Any) -> list[Any]:
        if len(response.results) != len(rpcs):
            raise errors.FenceError(
                f"the server answered {len(response.results)} results for {len(rpcs)} calls"
            )
        out: list[Any] = []
        for rpc, result in zip(rpcs, response.results):
            if result.WhichOneof("result") == "response":
                out.append(rpc.convert(result.response))
            else:
                e = result.error
                out.append(errors.error_from_call_error(e.code, e.message, e.details))
        return out

    return Rpc(method, request, convert)


def begin_batch(calls: Iterable[BeginCall]) -> Rpc:
    return _batch("BeginBatch", pb.BeginBatchRequest(), "calls", [c.rpc() for c in calls])


def complete_batch(calls: Iterable[CompleteCall]) -> Rpc:
    return _batch("CompleteBatch", pb.CompleteBatchRequest(), "completions", [c.rpc() for c in calls])


def reconcile(
    effect_id: str,
    epoch: int,
    evidence: str,
    completed_result: bytes | None,
    failed_before_input: str | None,
) -> Rpc:
    if (completed_result is None) == (failed_before_input is None):
        raise TypeError("reconcile: give exactly one of completed_result, failed_before_input")
    request = pb.ReconcileRequest(effect_id=effect_id, epoch=epoch, evidence=evidence)
    if completed_result is not None:
        request.completed_result = bytes(completed_result)
    else:
        request.failed_before_input.detail = failed_before_input or ""
    return Rpc("Reconcile", request, lambda r: t.Receipt.from_proto(r.receipt))


def _outcome(r: pb.QueryOutcomeResponse) -> t.Outcome:
    return t.Outcome(
        t.EffectState(r.state), t.Receipt.from_optional(r.receipt, r.HasField("receipt"))
    )


def query_outcome(
    effect_id: str | None,
    run: RunLike | None,
    step_key: str | None,
    tool: str | None,
    arguments: JsonArgs | None,
    branch: str | None,
) -> Rpc:
    request = pb.QueryOutcomeRequest()
    if effect_id is not None:
        if any(x is not None for x in (step_key, tool, arguments)):
            raise TypeError("query_outcome: give effect_id, or run+step_key, or run+tool+arguments")
        request.effect_id = effect_id
    elif step_key is not None:
        if run is None or tool is not None or arguments is not None:
            raise TypeError("query_outcome: a step key query takes run and step_key only")
        request.step_key.run_id = run_id_of(run)
        request.step_key.branch = branch_of(run, branch)
        request.step_key.step_key = step_key
    elif tool is not None:
        if run is None or arguments is None:
            raise TypeError("query_outcome: an intent query takes run, tool and arguments")
        request.intent.run_id = run_id_of(run)
        request.intent.branch = branch_of(run, branch)
        request.intent.tool = tool
        request.intent.arguments_json = arguments_json(arguments)
    else:
        raise TypeError("query_outcome: give effect_id, or run+step_key, or run+tool+arguments")
    return Rpc("QueryOutcome", request, _outcome)


def list_effects(
    run: RunLike, branch: str, saga_id: str, page_size: int, page_token: str
) -> Rpc:
    return Rpc(
        "ListEffects",
        pb.ListEffectsRequest(
            run_id=run_id_of(run),
            branch=branch,
            saga_id=saga_id,
            page_size=page_size,
            page_token=page_token,
        ),
        lambda r: t.EffectsPage(
            tuple(t.Receipt.from_proto(x) for x in r.effects), r.next_page_token
        ),
    )


def create_backup(directory: str) -> Rpc:
    return Rpc(
        "CreateBackup",
        pb.CreateBackupRequest(dir=directory),
        lambda r: t.Backup(r.dir, r.bytes, r.created_at_ms, t.BackupReport.from_proto(r.report)),
        service="Admin",
    )


def verify_backup(directory: str) -> Rpc:
    return Rpc(
        "VerifyBackup",
        pb.VerifyBackupRequest(dir=directory),
        lambda r: t.BackupReport.from_proto(r.report),
        service="Admin",
    )


def compact_store() -> Rpc:
    return Rpc(
        "CompactStore",
        pb.CompactStoreRequest(),
        lambda r: t.Compacted(r.bytes_before, r.bytes_after, r.took_ms),
        service="Admin",
    )


def list_unsettled_effects(state: t.EffectState | None, page_size: int, page_token: str) -> Rpc:
    return Rpc(
        "ListUnsettledEffects",
        pb.ListUnsettledEffectsRequest(
            state=pb.EffectState.Name(int(state or 0)), page_size=page_size, page_token=page_token
        ),
        lambda r: t.EffectsPage(
            tuple(t.Receipt.from_proto(x) for x in r.effects), r.next_page_token
        ),
    )


def register_credential(
    token: bytes | str, budget: int, bound_tool: str, bound_arguments: JsonArgs | None
) -> Rpc:
    return Rpc(
        "RegisterCredential",
        pb.RegisterCredentialRequest(
            token=_token(token),
            budget=budget,
            bound_tool=bound_tool,
            bound_arguments_json="" if bound_arguments is None else arguments_json(bound_arguments),
        ),
        lambda r: t.CredentialRegistration(t.CredentialInfo.from_proto(r.credential), r.created),
    )


def get_credential(token: bytes | str) -> Rpc:
    return Rpc(
        "GetCredential",
        pb.GetCredentialRequest(token=_token(token)),
        lambda r: t.CredentialInfo.from_proto(r.credential),
    )


def call_metadata(tenant: str | None, token: str | None, extra: Iterable[tuple[str, str]]) -> tuple:
    md: list[tuple[str, str]] = []
    if tenant is not None:
        md.append(("x-fence-tenant", tenant))
    if token is not None:
        md.append(("authorization", f"Bearer {token}"))
    md.extend(extra)
    return tuple(md)
