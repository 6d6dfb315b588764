"""LangGraph integration: a LangGraph agent's side effects happen exactly once.

Three pieces, used together (see the README's LangGraph section)::

    from fence.langgraph import FenceCheckpointer, fenced_tool

    checkpointer = FenceCheckpointer(SqliteSaver(conn), fence.Client("127.0.0.1:50051"))
    tools = [fenced_tool(transfer, checkpointer, volatile_fields=["reference"])]
    graph = builder.compile(checkpointer=checkpointer)

- :class:`FenceCheckpointer` wraps any LangGraph checkpointer. Each LangGraph thread is a Fence
  run; each root checkpoint is recorded on Fence with its parent, so effects are placed in the
  causal history even when LangGraph saves checkpoints late (its default ``durability="async"``
  writes checkpoint N while step N+1's tools run) or only at exit (``"exit"``). Time travel
  (``invoke(None, config_of_an_old_checkpoint)``) is a Fence ``Restore`` of that checkpoint,
  done before the first tool of the run; ``update_state`` on an older checkpoint is a ``Fork``.
  The run handle (branch, epoch) is stored in checkpoint metadata under ``"fence"``, so a
  restarted process continues on the right branch.
- :func:`fenced_tool` wraps a LangChain tool (``@tool``, ``StructuredTool``): each call is
  begun on Fence with the thread's run and the checkpoint the step descends from; a replay
  returns the recorded result without running the tool; a refusal becomes an error
  ``ToolMessage`` whose text is written for the model (the graph never crashes on one).
- :func:`effect` does the same for a side effect inside a node (not a tool), including nodes
  that call ``interrupt()`` and re-run from the top on every resume.
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Iterator, Sequence

from langchain_core.runnables import RunnableConfig
from langchain_core.tools import BaseTool, StructuredTool, ToolException
from langgraph.checkpoint.base import (
    BaseCheckpointSaver,
    ChannelVersions,
    Checkpoint,
    CheckpointMetadata,
    CheckpointTuple,
)

from . import _requests as rq
from .aio import AsyncClient
from .client import Client
from .errors import FenceRefused
from .fenced import fenced
from .types import OperationClass, ReasonCode, Run, StringNormalization

__all__ = ["FenceCheckpointer", "effect", "fenced_tool"]

# LangGraph marks the config of a run's own loads with its runtime (get_state's has none).
_RUN_KEY = "__pregel_runtime"

METADATA_KEY = "fence"
"""Checkpoint metadata key holding the Fence run handle (``{"branch", "epoch"}``)."""


@dataclass
class _Thread:
    """What the checkpointer knows of one LangGraph thread in this process."""

    run: Run
    lock: threading.RLock = field(default_factory=threading.RLock)
    # A time travel to this checkpoint was loaded and not yet applied on Fence.
    travel: str | None = None
    # A call was refused FORK_REQUIRED at this checkpoint: the next run (the user's answer)
    # forks there.
    fork_at: str | None = None
    # That next run has started: fork before its first call or checkpoint.
    fork_now: str | None = None


def _conf(config: RunnableConfig | None) -> dict[str, Any]:
    return dict((config or {}).get("configurable") or {})


class FenceCheckpointer(BaseCheckpointSaver):  # type: ignore[misc]
    """Wraps a LangGraph checkpointer so the graph's effects are fenced by Fence.

    Every checkpointer method is delegated to ``saver`` (both the sync and the async paths,
    each once); root checkpoints are also recorded on Fence. Args:

        saver: the checkpointer that stores the graph's state (``InMemorySaver``,
            ``SqliteSaver``, ``PostgresSaver``...).
        client: the Fence client (sync; async calls run it off the event loop).
        aclient: an async client for async tools (default: one made like ``client``).
        run_prefix: prepended to the thread id to name the Fence run.
    """

    def __init__(
        self,
        saver: BaseCheckpointSaver,
        client: Client,
        *,
        aclient: AsyncClient | None = None,
        run_prefix: str = "",
    ) -> None:
        super().__init__(serde=saver.serde)
        self.saver = saver
        self.client = client
        self._aclient = aclient
        self.run_prefix = run_prefix
        self._threads: dict[str, _Thread] = {}
        self._threads_lock = threading.Lock()
        # fence.langgraph.effect's fenced wrappers, made once per function and options.
        self._effects: dict[tuple[Any, ...], Callable[..., Any]] = {}

    # -- the Fence side ---------------------------------------------------------------------

    @property
    def aclient(self) -> AsyncClient:
        """The async client async tools use (made on first use, like ``client``)."""
        if self._aclient is None:
            self._aclient = AsyncClient(
                self.client.target,
                timeout=self.client.timeout,
                metadata=self.client._metadata,
                sessions=self.client.sessions,
            )
        return self._aclient

    def _thread(self, thread_id: str) -> _Thread:
        with self._threads_lock:
            known = self._threads.get(thread_id)
            if known is not None:
                return known
        # First sight in this process: continue where the stored checkpoints say.
        run = Run(self.run_prefix + thread_id)
        latest = self.saver.get_tuple({"configurable": {"thread_id": thread_id, "checkpoint_ns": ""}})
        handle = (latest.metadata or {}).get(METADATA_KEY) if latest is not None else None
        if isinstance(handle, dict):
            run.branch = str(handle.get("branch") or "")
            run.epoch = int(handle.get("epoch") or 0)
        if run.epoch:
            # Another process may have restored since: the run's epoch is Fence's.
            try:
                run.epoch = self.client.get_run(run).epoch
            except FenceRefused:
                pass
        with self._threads_lock:
            return self._threads.setdefault(thread_id, _Thread(run))

    def _latest_id(self, thread_id: str) -> str | None:
        latest = self.saver.get_tuple({"configurable": {"thread_id": thread_id, "checkpoint_ns": ""}})
        return latest.checkpoint["id"] if latest is not None else None

    def _restore(self, t: _Thread, checkpoint_id: str) -> None:
        try:
            self.client.restore(t.run, checkpoint_id)
        except FenceRefused as err:
            if err.reason != ReasonCode.UNKNOWN_RECORD:
                raise
            # Never recorded on Fence (saved before Fence fenced this graph): nothing to replay.

    def _fork(self, t: _Thread, checkpoint_id: str, reason: str) -> None:
        try:
            self.client.fork(t.run, checkpoint_id, reason=reason)
        except FenceRefused as err:
            if err.reason != ReasonCode.UNKNOWN_RECORD:
                raise

    def call_context(self, config: RunnableConfig) -> tuple[Run, str]:
        """The Fence run and the parent checkpoint id of a call made in a graph step.

        A time travel loaded for this thread is applied first (a ``Restore``), so the call is
        matched against what was done after that checkpoint.
        """
        conf = _conf(config)
        thread_id = conf.get("thread_id")
        if not thread_id:
            raise ValueError("fence.langgraph: the graph config has no thread_id")
        parent = str((conf.get("checkpoint_map") or {}).get("", "") or conf.get("checkpoint_id") or "")
        t = self._thread(str(thread_id))
        with t.lock:
            self._apply_pending(t)
            return t.run, parent

    def _apply_pending(self, t: _Thread) -> None:
        """Applies a loaded time travel (Restore) or a fork the user's new turn calls for."""
        if t.travel is not None:
            travel, t.travel = t.travel, None
            t.fork_now = None
            self._restore(t, travel)
        elif t.fork_now is not None:
            fork_at, t.fork_now = t.fork_now, None
            self._fork(t, fork_at, "a new user turn after a refused change")

    def note_refusal(self, config: RunnableConfig, err: FenceRefused) -> None:
        """Remembers a FORK_REQUIRED refusal: the model was told to ask the user, so the
        user's next turn continues on a new branch from that checkpoint."""
        if err.reason != ReasonCode.FORK_REQUIRED or not err.checkpoint_id:
            return
        thread_id = _conf(config).get("thread_id")
        if thread_id:
            t = self._thread(str(thread_id))
            with t.lock:
                t.fork_at = err.checkpoint_id

    def fork_now(self, config: RunnableConfig, checkpoint_id: str, reason: str) -> None:
        """Forks the thread's run at ``checkpoint_id`` now (a human chose a changed call)."""
        thread_id = _conf(config).get("thread_id")
        if thread_id:
            t = self._thread(str(thread_id))
            with t.lock:
                t.fork_at = None
                self._fork(t, checkpoint_id, reason)

    def _on_load(self, config: RunnableConfig, loaded: CheckpointTuple | None) -> None:
        conf = _conf(config)
        thread_id = conf.get("thread_id")
        if not thread_id or conf.get("checkpoint_ns", ""):
            return
        if _RUN_KEY not in conf:
            # Not a run's load (get_state, update_state, history): an inspection.
            return
        requested = conf.get("checkpoint_id")
        t = self._thread(str(thread_id))
        with t.lock:
            if t.fork_at is not None:
                # A new run after a refused change: the user has had their say.
                t.fork_now, t.fork_at = t.fork_at, None
            if "checkpoint_id" not in conf:
                # A run from the thread's latest state: no time travel.
                t.travel = None
            elif not requested:
                # The run checking whether its addressed checkpoint is superseded.
                return
            elif loaded is not None and self._latest_id(str(thread_id)) != requested:
                # Loading an older checkpoint: time travel if a run follows (applied lazily,
                # before the first call or checkpoint of that run; an inspection does nothing).
                t.travel = str(requested)

    def _on_put(self, config: RunnableConfig, checkpoint: Checkpoint, metadata: CheckpointMetadata) -> CheckpointMetadata:
        conf = _conf(config)
        thread_id = conf.get("thread_id")
        if not thread_id or conf.get("checkpoint_ns", ""):
            return metadata
        parent = conf.get("checkpoint_id")
        source = (metadata or {}).get("source")
        t = self._thread(str(thread_id))
        with t.lock:
            if source == "update" and parent and parent != self._latest_id(str(thread_id)):
                # An edit of an older state is an explicit new line of history.
                t.travel = None
                self._fork(t, str(parent), "update_state on an earlier checkpoint")
            else:
                self._apply_pending(t)
            self.client.checkpoint(
                t.run, checkpoint["id"], parent_checkpoint_id=str(parent or "")
            )
            return {**(metadata or {}), METADATA_KEY: {"branch": t.run.branch, "epoch": t.run.epoch}}  # type: ignore[return-value]

    # -- BaseCheckpointSaver, delegated -------------------------------------------------------

    @property
    def config_specs(self) -> list:  # type: ignore[override]
        return self.saver.config_specs

    def get_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        loaded = self.saver.get_tuple(config)
        self._on_load(config, loaded)
        return loaded

    def list(
        self,
        config: RunnableConfig | None,
        *,
        filter: dict[str, Any] | None = None,
        before: RunnableConfig | None = None,
        limit: int | None = None,
    ) -> Iterator[CheckpointTuple]:
        return self.saver.list(config, filter=filter, before=before, limit=limit)

    def put(
        self,
        config: RunnableConfig,
        checkpoint: Checkpoint,
        metadata: CheckpointMetadata,
        new_versions: ChannelVersions,
    ) -> RunnableConfig:
        metadata = self._on_put(config, checkpoint, metadata)
        return self.saver.put(config, checkpoint, metadata, new_versions)

    def put_writes(
        self,
        config: RunnableConfig,
        writes: Sequence[tuple[str, Any]],
        task_id: str,
        task_path: str = "",
    ) -> None:
        self.saver.put_writes(config, writes, task_id, task_path)

    def delete_thread(self, thread_id: str) -> None:
        self.saver.delete_thread(thread_id)
        with self._threads_lock:
            self._threads.pop(thread_id, None)

    async def aget_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        loaded = await self.saver.aget_tuple(config)
        await asyncio.to_thread(self._on_load, config, loaded)
        return loaded

    async def alist(
        self,
        config: RunnableConfig | None,
        *,
        filter: dict[str, Any] | None = None,
        before: RunnableConfig | None = None,
        limit: int | None = None,
    ) -> AsyncIterator[CheckpointTuple]:
        async for item in self.saver.alist(config, filter=filter, before=before, limit=limit):
            yield item

    async def aput(
        self,
        config: RunnableConfig,
        checkpoint: Checkpoint,
        metadata: CheckpointMetadata,
        new_versions: ChannelVersions,
    ) -> RunnableConfig:
        metadata = await asyncio.to_thread(self._on_put, config, checkpoint, metadata)
        return await self.saver.aput(config, checkpoint, metadata, new_versions)

    async def aput_writes(
        self,
        config: RunnableConfig,
        writes: Sequence[tuple[str, Any]],
        task_id: str,
        task_path: str = "",
    ) -> None:
        await self.saver.aput_writes(config, writes, task_id, task_path)

    async def adelete_thread(self, thread_id: str) -> None:
        await self.saver.adelete_thread(thread_id)
        with self._threads_lock:
            self._threads.pop(thread_id, None)

    def get_next_version(self, current: Any, channel: None) -> Any:
        return self.saver.get_next_version(current, channel)

    def __getattr__(self, name: str) -> Any:
        # Anything else the wrapped saver offers (setup(), conn, delta history...).
        if name == "saver":
            raise AttributeError(name)
        return getattr(self.saver, name)


def _delegate(name: str) -> Any:
    """A method that calls the wrapped saver's method of the same name, nothing more."""
    if name.startswith("a"):

        async def async_method(self: FenceCheckpointer, *args: Any, **kwargs: Any) -> Any:
            return await getattr(self.saver, name)(*args, **kwargs)

        async_method.__name__ = name
        return async_method

    def method(self: FenceCheckpointer, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.saver, name)(*args, **kwargs)

    method.__name__ = name
    return method


# The rest of the saver interface is passed through as is (BaseCheckpointSaver defines these,
# so __getattr__ would not reach the wrapped saver). None of them loads or saves a checkpoint
# of a run, so none has anything to tell Fence.
for _name in (
    "get",
    "aget",
    "get_delta_channel_history",
    "aget_delta_channel_history",
    "delete_for_runs",
    "adelete_for_runs",
    "copy_thread",
    "acopy_thread",
    "prune",
    "aprune",
):
    setattr(FenceCheckpointer, _name, _delegate(_name))


def _injected_args(tool: BaseTool) -> tuple[str, ...]:
    """The tool's arguments the model does not write (``InjectedState``,
    ``InjectedToolCallId``...): in its input schema, not in the schema shown to the model."""
    try:
        every = set(tool.get_input_schema().model_json_schema().get("properties", {}))
        shown = set(tool.tool_call_schema.model_json_schema().get("properties", {}))
    except Exception:  # a tool without pydantic schemas: nothing is injected
        return ()
    return tuple(sorted(every - shown))


def _step_key(parent: str, tool: str, kwargs: dict[str, Any]) -> str:
    # Stable for a re-run of the same step (same checkpoint, same call), new after time travel
    # (a new checkpoint), where Fence matches by intent instead.
    digest = hashlib.blake2b(rq.dumps(kwargs).encode(), digest_size=8).hexdigest()
    return f"lg:{parent or '-'}:{tool}:{digest}"


def fenced_tool(
    tool: BaseTool | Callable[..., Any],
    checkpointer: FenceCheckpointer,
    *,
    cls: OperationClass = OperationClass.NON_RETRYABLE,
    volatile_fields: Sequence[str] = (),
    normalized_fields: Sequence[str] = (),
    string_normalization: StringNormalization = StringNormalization.STRING_NORMALIZATION_UNSPECIFIED,
    credential_args: Sequence[str] = (),
    retention_ms: int = 0,
    lease_ms: int = 0,
    on_fork_required: str = "message",
) -> StructuredTool:
    """A LangChain tool whose calls go through Fence (see the module docs).

    ``tool`` is a ``@tool`` / ``StructuredTool`` (or a plain function, made a tool first).
    The returned tool has the same name, description and argument schema, so the model sees
    the same tool. The options are :func:`fence.fenced`'s: the class, the intent schema
    (``volatile_fields`` the model rewrites on every generation: references, timestamps) and
    ``credential_args`` (parameters holding one-time approvals, spent with the call).
    A refusal is returned to the model as an error ``ToolMessage`` with its sentence.

    ``on_fork_required="interrupt"`` lets a human decide a FORK_REQUIRED refusal (a call that
    differs from what was done before time travel): the graph is interrupted with
    ``{"fence": "FORK_REQUIRED", "tool", "arguments", "message", "recorded"}``; resuming with
    ``True`` (or ``"fork"``) forks the thread's run and performs the changed call, anything
    else returns the refusal to the model.
    """
    if on_fork_required not in ("message", "interrupt"):
        raise ValueError('fenced_tool: on_fork_required is "message" or "interrupt"')
    base = tool if isinstance(tool, BaseTool) else StructuredTool.from_function(tool)
    func = getattr(base, "func", None)
    coroutine = getattr(base, "coroutine", None)
    if func is None and coroutine is None:
        raise TypeError(f"fenced_tool: {base.name!r} has no function to fence (a @tool or StructuredTool is needed)")
    options: dict[str, Any] = dict(
        tool=base.name,
        # What LangGraph injects (the graph state, the tool-call id) is not the call's intent.
        exclude=_injected_args(base),
        cls=cls,
        volatile_fields=volatile_fields,
        normalized_fields=normalized_fields,
        string_normalization=string_normalization,
        credential_args=credential_args,
        retention_ms=retention_ms,
        lease_ms=lease_ms,
    )
    sync_call = fenced(checkpointer.client, **options)(func) if func is not None else None
    async_call: Callable[..., Any] | None = None

    injected = options["exclude"]

    def _visible(kwargs: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in kwargs.items() if k not in injected}

    def fence_options(config: RunnableConfig, kwargs: dict[str, Any]) -> dict[str, Any]:
        run, parent = checkpointer.call_context(config)
        return dict(
            fence_run=run,
            fence_step_key=_step_key(parent, base.name, _visible(kwargs)),
            fence_parent_checkpoint_id=parent,
        )

    def human_chose_fork(config: RunnableConfig, err: FenceRefused, kwargs: dict[str, Any]) -> bool:
        """Whether to fork and perform the changed call; otherwise the refusal stands."""
        if err.reason != ReasonCode.FORK_REQUIRED or on_fork_required != "interrupt":
            checkpointer.note_refusal(config, err)
            return False
        from langgraph.types import interrupt

        answer = interrupt(
            {
                "fence": "FORK_REQUIRED",
                "tool": base.name,
                "arguments": rq.to_jsonable(kwargs),
                "message": str(err),
                "recorded": err.receipt.arguments_json if err.receipt is not None else "",
            }
        )
        if answer is True or answer == "fork":
            checkpointer.fork_now(config, err.checkpoint_id, f"a human chose the changed {base.name} call")
            return True
        checkpointer.note_refusal(config, err)
        return False

    def run(config: RunnableConfig, **kwargs: Any) -> Any:
        if sync_call is None:
            raise ToolException(f"{base.name} can only be called asynchronously")
        try:
            return sync_call(**kwargs, **fence_options(config, kwargs))
        except FenceRefused as err:
            if not human_chose_fork(config, err, _visible(kwargs)):
                raise ToolException(str(err)) from err
        try:
            return sync_call(**kwargs, **fence_options(config, kwargs))
        except FenceRefused as err:
            raise ToolException(str(err)) from err

    async def arun(config: RunnableConfig, **kwargs: Any) -> Any:
        nonlocal async_call
        if coroutine is None:
            return await asyncio.to_thread(run, config, **kwargs)
        if async_call is None:
            async_call = fenced(checkpointer.aclient, **options)(coroutine)
        try:
            opts = await asyncio.to_thread(fence_options, config, kwargs)
            return await async_call(**kwargs, **opts)
        except FenceRefused as err:
            if not human_chose_fork(config, err, _visible(kwargs)):
                raise ToolException(str(err)) from err
        try:
            opts = await asyncio.to_thread(fence_options, config, kwargs)
            return await async_call(**kwargs, **opts)
        except FenceRefused as err:
            raise ToolException(str(err)) from err

    return StructuredTool(
        name=base.name,
        description=base.description,
        args_schema=base.args_schema,
        func=run,
        coroutine=arun,
        return_direct=base.return_direct,
        response_format=base.response_format,
        handle_tool_error=True,
        metadata={**(base.metadata or {}), "fenced": True},
        tags=base.tags,
    )


def effect(
    checkpointer: FenceCheckpointer,
    fn: Callable[..., Any],
    *args: Any,
    tool: str,
    key: str | None = None,
    cls: OperationClass = OperationClass.NON_RETRYABLE,
    volatile_fields: Sequence[str] = (),
    credential_args: Sequence[str] = (),
    **kwargs: Any,
) -> Any:
    """Calls ``fn(*args, **kwargs)`` inside a graph node exactly once across re-runs.

    A node that calls ``interrupt()`` re-runs from the top on every resume; a node re-run after
    a crash or time travel re-runs too. The effect is begun on Fence under a key made of the
    node's task and ``key`` (default: ``tool``; give distinct keys to distinct effects of one
    node), so a re-run of the same task replays the recorded result, and a re-run after time
    travel is matched by intent. Call it from inside a node (it reads the graph config).
    """
    from langgraph.config import get_config

    config = get_config()
    run, parent = checkpointer.call_context(config)
    task = str(_conf(config).get("checkpoint_ns") or parent)
    cache_key = (tool, fn, cls, tuple(volatile_fields), tuple(credential_args))
    wrapped = checkpointer._effects.get(cache_key)
    if wrapped is None:
        wrapped = fenced(
            checkpointer.client,
            tool=tool,
            cls=cls,
            volatile_fields=volatile_fields,
            credential_args=credential_args,
        )(fn)
        checkpointer._effects[cache_key] = wrapped
    return wrapped(
        *args,
        **kwargs,
        fence_run=run,
        fence_step_key=f"lg:{task}:{key or tool}",
        fence_parent_checkpoint_id=parent,
    )
