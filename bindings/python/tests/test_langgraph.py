"""A real LangGraph agent (StateGraph + ToolNode, real checkpointers) protected by
``fence.langgraph`` against the real ``fenced``: time travel, drift, forks by update_state,
approvals, interrupts and restarts, in every durability mode, sync and async.

The user code is the integration as the README shows it: a FenceCheckpointer around the
checkpointer and ``fenced_tool`` around each tool. The scripted chat model rewrites volatile
fields on every generation (a fresh uuid4 reference, a new timestamp, shuffled key order), as
a real model does; a flag drifts an intent field.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import itertools
import random
import re
import sqlite3
import threading
import time
import uuid
from pathlib import Path
from typing import Annotated, Any, Callable, Iterator, Sequence

import pytest

pytest.importorskip("langgraph")

from langchain_core.callbacks import CallbackManagerForLLMRun  # noqa: E402
from langchain_core.language_models.chat_models import BaseChatModel  # noqa: E402
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, ToolMessage  # noqa: E402
from langchain_core.outputs import ChatGeneration, ChatResult  # noqa: E402
from langchain_core.tools import InjectedToolCallId, tool  # noqa: E402
from langgraph.checkpoint.memory import InMemorySaver  # noqa: E402
from langgraph.checkpoint.sqlite import SqliteSaver  # noqa: E402
from langgraph.checkpoint.sqlite.aio import AsyncSqliteSaver  # noqa: E402

import aiosqlite  # noqa: E402
from langgraph.graph import END, START, MessagesState, StateGraph  # noqa: E402
from langgraph.prebuilt import InjectedState, ToolNode, tools_condition  # noqa: E402
from langgraph.types import Command, interrupt  # noqa: E402

import fence  # noqa: E402
from fence.langgraph import FenceCheckpointer, effect, fenced_tool  # noqa: E402

DURABILITY = ["async", "sync", "exit"]
SECRET = b"approval-signing-key"


# ------------------------------------------------------------------------------------------
# The outside world: APIs that count real effects
# ------------------------------------------------------------------------------------------


class World:
    """A fake bank, cloud and payments API. Payments check signed approvals without
    remembering them (as a JWT check does), so only Fence stops a spent approval."""

    def __init__(self) -> None:
        self.transfers: list[tuple[str, int]] = []
        self.servers: list[dict[str, Any]] = []
        self.payments: list[tuple[str, int, str]] = []
        self.charges: list[str] = []
        self.lock = threading.Lock()

    def transfer(self, to: str, amount: int) -> dict[str, Any]:
        with self.lock:
            self.transfers.append((to, amount))
            return {"tx": f"T{len(self.transfers)}", "to": to, "amount": amount}

    def pay(self, to: str, amount: int, approval: str) -> str:
        expected = hmac.new(SECRET, f"{to}:{amount}".encode(), hashlib.sha256).hexdigest()
        if not hmac.compare_digest(expected, approval):
            raise PermissionError("approval does not match this payment")
        with self.lock:
            self.payments.append((to, amount, approval))
            return f"P{len(self.payments)}"


def approval_for(to: str, amount: int) -> str:
    return hmac.new(SECRET, f"{to}:{amount}".encode(), hashlib.sha256).hexdigest()


# ------------------------------------------------------------------------------------------
# A scripted chat model
# ------------------------------------------------------------------------------------------


class ScriptedModel(BaseChatModel):
    """Answers "pay <to> <amount> [and <to> <amount>]" with transfer calls (volatile fields
    fresh on every generation, keys shuffled), "server <name> <cpu>" with a create-server call,
    "approved pay <to> <amount>" with a payment carrying its approval, and a tool result with a
    summary. ``drift`` adds 1 to every amount (a model changing its mind)."""

    drift: bool = False
    reverse: bool = False

    @property
    def _llm_type(self) -> str:
        return "scripted"

    def bind_tools(self, tools: Sequence[Any], **kwargs: Any) -> ScriptedModel:  # type: ignore[override]
        return self

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        last = messages[-1]
        if isinstance(last, ToolMessage):
            results = []
            for m in reversed(messages):
                if not isinstance(m, ToolMessage):
                    break
                results.append(f"{m.status}:{m.content}")
            return self._answer(AIMessage(content="done " + " | ".join(reversed(results))))
        text = str(last.content)
        calls: list[dict[str, Any]] = []
        bump = 1 if self.drift else 0
        if m := re.fullmatch(r"approved pay (\w+) (\d+)", text):
            to, amount = m.group(1), int(m.group(2))
            calls.append(self._call("pay", {"to": to, "amount": amount + bump, "approval_token": approval_for(to, amount)}))
        elif m := re.fullmatch(r"server (\w+) (\d+)", text):
            spec = {"region": "eu-west", "cpu": int(m.group(2)) + bump, "ram_gb": 4}
            calls.append(self._call("create_server", {"name": m.group(1), "spec": _shuffled(spec), "request_id": str(uuid.uuid4())}))
        elif text.startswith("pay "):
            for to, amount in re.findall(r"(\w+) (\d+)", text[4:]):
                calls.append(self._call("transfer", {"to": to, "amount": int(amount) + bump, "reference": str(uuid.uuid4()), "timestamp": time.time()}))
            if self.reverse:
                calls.reverse()
        else:
            return self._answer(AIMessage(content="ok"))
        return self._answer(AIMessage(content="", tool_calls=calls))

    @staticmethod
    def _call(name: str, args: dict[str, Any]) -> dict[str, Any]:
        return {"name": name, "args": _shuffled(args), "id": f"call_{uuid.uuid4().hex[:12]}", "type": "tool_call"}

    @staticmethod
    def _answer(message: AIMessage) -> ChatResult:
        return ChatResult(generations=[ChatGeneration(message=message)])


def _shuffled(d: dict[str, Any]) -> dict[str, Any]:
    items = list(d.items())
    random.shuffle(items)
    return dict(items)


# ------------------------------------------------------------------------------------------
# The agent, protected as the README shows
# ------------------------------------------------------------------------------------------


class Agent:
    """One LangGraph agent over a checkpointer, with Fence around it."""

    def __init__(
        self,
        world: World,
        model: ScriptedModel,
        saver: Any,
        client: fence.Client | None,
        durability: str,
        use_async: bool,
        on_fork_required: str = "message",
    ) -> None:
        self.world, self.model, self.durability, self.use_async = world, model, durability, use_async
        # One event loop for the agent's whole life, as an async application has.
        self.loop = asyncio.new_event_loop() if use_async else None
        if isinstance(saver, SaverKind):
            saver = saver.make(self.loop)

        @tool
        def transfer(to: str, amount: int, reference: str, timestamp: float) -> dict:
            """Transfer money."""
            return world.transfer(to, amount)

        @tool
        def create_server(name: str, spec: dict, request_id: str) -> dict:
            """Create a server."""
            world.servers.append({"name": name, "spec": spec})
            return {"server": name}

        @tool
        def pay(to: str, amount: int, approval_token: str) -> str:
            """Pay with an approval."""
            return world.pay(to, amount, approval_token)

        tools: list[Any] = [transfer, create_server, pay]
        self.checkpointer: Any = saver
        if client is not None:  # None: the baseline, LangGraph alone
            # --- the integration: these lines are all a user writes -----------------------
            self.checkpointer = FenceCheckpointer(saver, client)
            tools = [
                fenced_tool(
                    transfer,
                    self.checkpointer,
                    volatile_fields=["reference", "timestamp"],
                    on_fork_required=on_fork_required,
                ),
                fenced_tool(create_server, self.checkpointer, volatile_fields=["request_id"]),
                fenced_tool(pay, self.checkpointer, credential_args=["approval_token"]),
            ]
            # -------------------------------------------------------------------------------

        def agent(state: MessagesState) -> dict:
            return {"messages": [model.bind_tools(tools).invoke(state["messages"])]}

        builder = StateGraph(MessagesState)
        builder.add_node("agent", agent)
        builder.add_node("tools", ToolNode(tools))
        builder.add_edge(START, "agent")
        builder.add_conditional_edges("agent", tools_condition)
        builder.add_edge("tools", "agent")
        self.graph = builder.compile(checkpointer=self.checkpointer)

    def invoke(self, value: Any, config: dict[str, Any]) -> dict[str, Any]:
        if self.loop is not None:
            return self.loop.run_until_complete(self.graph.ainvoke(value, config, durability=self.durability))
        return self.graph.invoke(value, config, durability=self.durability)

    def get_state(self, config: dict[str, Any]) -> Any:
        if self.loop is not None:
            return self.loop.run_until_complete(self.graph.aget_state(config))
        return self.graph.get_state(config)

    def update_state(self, config: dict[str, Any], values: dict[str, Any]) -> dict[str, Any]:
        if self.loop is not None:
            return self.loop.run_until_complete(self.graph.aupdate_state(config, values))
        return self.graph.update_state(config, values)

    def history(self, thread: str) -> list[Any]:
        config = {"configurable": {"thread_id": thread}}
        if self.loop is not None:

            async def collect() -> list[Any]:
                return [s async for s in self.graph.aget_state_history(config)]

            return self.loop.run_until_complete(collect())
        return list(self.graph.get_state_history(config))

    def say(self, thread: str, text: str) -> dict[str, Any]:
        return self.invoke({"messages": [HumanMessage(text)]}, {"configurable": {"thread_id": thread}})

    def before(self, thread: str, node: str, nth_from_end: int = 0) -> dict[str, Any]:
        """The config of a checkpoint whose next node is ``node`` (the latest such by default)."""
        history = [s for s in self.history(thread) if s.next == (node,)]
        return history[nth_from_end].config

    def rewind(self, thread: str, text: str) -> dict[str, Any]:
        """Time travel to the end of the thread's first turn, and say ``text`` again there: the
        model re-generates what it did then. Works in every durability mode (``"exit"`` saves
        only the end of each turn)."""
        history = [s for s in self.history(thread) if s.next == () and s.values.get("messages")]
        return self.invoke({"messages": [HumanMessage(text)]}, history[-1].config)

    def tool_messages(self, result: dict[str, Any]) -> list[ToolMessage]:
        return [m for m in result["messages"] if isinstance(m, ToolMessage)]


class SaverKind:
    """A checkpointer to make: in memory, or SQLite (``AsyncSqliteSaver`` in an async agent,
    made in its event loop)."""

    def __init__(self, kind: str, path: Path) -> None:
        self.kind, self.path = kind, path

    def make(self, loop: asyncio.AbstractEventLoop | None) -> Any:
        if self.kind == "memory":
            return InMemorySaver()
        if loop is None:
            return SqliteSaver(sqlite3.connect(self.path, check_same_thread=False))

        async def open_async() -> Any:
            return AsyncSqliteSaver(await aiosqlite.connect(self.path))

        return loop.run_until_complete(open_async())


@pytest.fixture(params=["memory", "sqlite"])
def saver(request: pytest.FixtureRequest, tmp_path: Path) -> SaverKind:
    return SaverKind(request.param, tmp_path / "checkpoints.db")


def last_text(result: dict[str, Any]) -> str:
    return str(result["messages"][-1].content)


def errors(result: dict[str, Any]) -> list[str]:
    """The refusals the model read in this turn (since the last user message)."""
    messages = result["messages"]
    start = max((i for i, m in enumerate(messages) if isinstance(m, HumanMessage)), default=0)
    return [str(m.content) for m in messages[start:] if isinstance(m, ToolMessage) and m.status == "error"]


# ------------------------------------------------------------------------------------------
# Scenarios
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("durability", DURABILITY)
def test_time_travel_before_the_model_replays_the_transfer(client: fence.Client, saver: Any, durability: str, use_async: bool) -> None:
    world = World()
    agent = Agent(world, ScriptedModel(), saver, client, durability, use_async)
    thread = f"t-{uuid.uuid4().hex[:8]}"
    agent.say(thread, "hello")
    first = agent.say(thread, "pay bob 100")
    assert world.transfers == [("bob", 100)]
    for _ in range(2):
        # Time travel to before the model node: the model re-generates the call with a new
        # reference and timestamp. LangGraph alone would transfer again.
        again = agent.rewind(thread, "pay bob 100")
        assert errors(again) == []
        assert agent.tool_messages(again)[-1].content == agent.tool_messages(first)[-1].content
    assert world.transfers == [("bob", 100)]


@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("durability", DURABILITY)
def test_replaying_the_tools_step_and_reordered_parallel_calls(client: fence.Client, saver: Any, durability: str, use_async: bool) -> None:
    world = World()
    model = ScriptedModel()
    agent = Agent(world, model, saver, client, durability, use_async)
    thread = f"t-{uuid.uuid4().hex[:8]}"
    agent.say(thread, "hello")
    agent.say(thread, "pay bob 100 carol 50")
    assert sorted(world.transfers) == [("bob", 100), ("carol", 50)]
    if durability != "exit":  # "exit" saves no checkpoint between the model and the tools
        # The tools step again, with the very same arguments.
        again = agent.invoke(None, agent.before(thread, "tools"))
        assert errors(again) == []
    # From before the model, which now emits the two calls in the other order.
    model.reverse = True
    again = agent.rewind(thread, "pay bob 100 carol 50")
    assert errors(again) == []
    assert sorted(world.transfers) == [("bob", 100), ("carol", 50)]


@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("durability", DURABILITY)
def test_a_drifted_amount_is_refused_to_the_model_and_a_new_turn_proceeds(client: fence.Client, saver: Any, durability: str, use_async: bool) -> None:
    world = World()
    model = ScriptedModel()
    agent = Agent(world, model, saver, client, durability, use_async)
    thread = f"t-{uuid.uuid4().hex[:8]}"
    agent.say(thread, "hello")
    agent.say(thread, "pay bob 100")
    model.drift = True
    drifted = agent.rewind(thread, "pay bob 100")
    # Refused as an error ToolMessage the model reads; the graph did not crash.
    (refusal,) = errors(drifted)
    assert "asking the user" in refusal.lower()
    assert world.transfers == [("bob", 100)]
    # The user's next turn: the agent proceeds on a new line of history.
    model.drift = False
    nxt = agent.say(thread, "pay dave 7")
    assert errors(nxt) == []
    assert world.transfers == [("bob", 100), ("dave", 7)]


@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("durability", DURABILITY)
def test_the_same_transfer_in_two_user_turns_is_two_effects(client: fence.Client, saver: Any, durability: str, use_async: bool) -> None:
    world = World()
    agent = Agent(world, ScriptedModel(), saver, client, durability, use_async)
    thread = f"t-{uuid.uuid4().hex[:8]}"
    agent.say(thread, "pay bob 100")
    second = agent.say(thread, "pay bob 100")
    assert errors(second) == []
    assert world.transfers == [("bob", 100), ("bob", 100)]


@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("durability", DURABILITY)
def test_update_state_to_another_recipient_forks_and_a_cosmetic_edit_replays(client: fence.Client, saver: Any, durability: str, use_async: bool) -> None:
    if durability == "exit":
        pytest.skip('"exit" saves no checkpoint between the model and the tools to edit')
    world = World()
    agent = Agent(world, ScriptedModel(), saver, client, durability, use_async)
    thread = f"t-{uuid.uuid4().hex[:8]}"
    agent.say(thread, "pay bob 100")
    before_tools = agent.before(thread, "tools")
    state = agent.get_state(before_tools)
    ai: AIMessage = state.values["messages"][-1]

    def edited(**changes: Any) -> AIMessage:
        call = dict(ai.tool_calls[0])
        call["args"] = {**call["args"], **changes}
        return AIMessage(content="", tool_calls=[call], id=ai.id)

    # A cosmetic edit (only a volatile field): the same transfer, replayed.
    cosmetic = agent.update_state(before_tools, {"messages": [edited(reference="edited")]})
    assert errors(agent.invoke(None, cosmetic)) == []
    assert world.transfers == [("bob", 100)]
    # A human redirects the payment: an explicit new line of history, which executes.
    redirected = agent.update_state(before_tools, {"messages": [edited(to="carol")]})
    assert errors(agent.invoke(None, redirected)) == []
    assert world.transfers == [("bob", 100), ("carol", 100)]


@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("durability", DURABILITY)
def test_nested_spec_drift_on_create_server_is_refused(client: fence.Client, saver: Any, durability: str, use_async: bool) -> None:
    world = World()
    model = ScriptedModel()
    agent = Agent(world, model, saver, client, durability, use_async)
    thread = f"t-{uuid.uuid4().hex[:8]}"
    agent.say(thread, "hello")
    agent.say(thread, "server web1 2")
    # The same spec in another key order and a fresh request id: replayed.
    assert errors(agent.rewind(thread, "server web1 2")) == []
    model.drift = True
    assert len(errors(agent.rewind(thread, "server web1 2"))) == 1
    assert [s["name"] for s in world.servers] == ["web1"]


@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("durability", DURABILITY)
def test_a_spent_approval_is_not_accepted_again(client: fence.Client, saver: Any, durability: str, use_async: bool) -> None:
    world = World()
    model = ScriptedModel()
    agent = Agent(world, model, saver, client, durability, use_async)
    thread = f"t-{uuid.uuid4().hex[:8]}"
    agent.say(thread, "hello")
    agent.say(thread, "approved pay shop 30")
    assert len(world.payments) == 1
    # Replayed from before the model and from before the tools: the same payment, replayed.
    assert errors(agent.rewind(thread, "approved pay shop 30")) == []
    if durability != "exit":
        assert errors(agent.invoke(None, agent.before(thread, "tools"))) == []
    # The amount edited, the approval presented again: refused, never paid.
    model.drift = True
    drifted = agent.rewind(thread, "approved pay shop 30")
    assert len(errors(drifted)) == 1
    assert len(world.payments) == 1


@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
def test_a_node_effect_runs_once_across_interrupts(client: fence.Client, saver: Any, use_async: bool) -> None:
    world = World()
    loop = asyncio.new_event_loop() if use_async else None
    checkpointer = FenceCheckpointer(saver.make(loop), client)
    runs = itertools.count()

    def approve_and_charge(state: MessagesState) -> dict:
        next(runs)
        # Runs again from the top on every resume: the charge must happen once.
        charge = effect(checkpointer, world.transfer, "merchant", 42, tool="charge")
        first = interrupt("approve the charge?")
        refund = effect(checkpointer, world.transfer, "customer", 5, tool="refund")
        second = interrupt("confirm the refund?")
        return {"messages": [AIMessage(content=f"{charge['tx']} {refund['tx']} {first} {second}")]}

    builder = StateGraph(MessagesState)
    builder.add_node("approve_and_charge", approve_and_charge)
    builder.add_edge(START, "approve_and_charge")
    builder.add_edge("approve_and_charge", END)
    graph = builder.compile(checkpointer=checkpointer)
    config = {"configurable": {"thread_id": f"t-{uuid.uuid4().hex[:8]}"}}

    def invoke(value: Any) -> dict[str, Any]:
        if loop is not None:
            return loop.run_until_complete(graph.ainvoke(value, config))
        return graph.invoke(value, config)

    invoke({"messages": [HumanMessage("go")]})
    invoke(Command(resume="yes"))
    result = invoke(Command(resume="sure"))
    assert last_text(result) == "T1 T2 yes sure"
    assert world.transfers == [("merchant", 42), ("customer", 5)]
    assert next(runs) == 3


def test_a_restarted_process_continues_on_the_right_branch(client: fence.Client, tmp_path: Path) -> None:
    world = World()
    db = tmp_path / "restart.db"
    thread = f"t-{uuid.uuid4().hex[:8]}"

    def process() -> tuple[Agent, sqlite3.Connection]:
        conn = sqlite3.connect(db, check_same_thread=False)
        return Agent(world, ScriptedModel(), SqliteSaver(conn), client, "async", False), conn

    agent, conn = process()
    agent.say(thread, "pay bob 100")
    # A fork by update_state, then the process dies.
    before_tools = agent.before(thread, "tools")
    ai = agent.get_state(before_tools).values["messages"][-1]
    call = {**ai.tool_calls[0], "args": {**ai.tool_calls[0]["args"], "to": "carol"}}
    forked = agent.update_state(before_tools, {"messages": [AIMessage(content="", tool_calls=[call], id=ai.id)]})
    agent.invoke(None, forked)
    conn.close()

    agent, conn = process()
    # The new process continues the thread where it was (the fork), and time travel there
    # replays.
    assert errors(agent.invoke(None, agent.before(thread, "tools"))) == []
    assert world.transfers == [("bob", 100), ("carol", 100)]
    assert errors(agent.say(thread, "pay dave 1")) == []
    assert world.transfers == [("bob", 100), ("carol", 100), ("dave", 1)]
    conn.close()


def test_without_fence_langgraph_repeats_effects_and_accepts_spent_approvals(saver: SaverKind) -> None:
    """The baseline the README compares with: the same scenarios, LangGraph alone."""
    world = World()
    agent = Agent(world, ScriptedModel(), saver, None, "async", False)
    agent.say("baseline", "hello")
    agent.say("baseline", "pay bob 100")
    agent.rewind("baseline", "pay bob 100")
    agent.rewind("baseline", "pay bob 100")
    assert world.transfers == [("bob", 100)] * 3
    agent.say("approvals", "hello")
    agent.say("approvals", "approved pay shop 30")
    agent.rewind("approvals", "approved pay shop 30")
    assert len(world.payments) == 2  # the same signed approval, accepted twice


@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
def test_a_human_decides_a_changed_call_through_interrupt(client: fence.Client, use_async: bool) -> None:
    world = World()
    model = ScriptedModel()
    agent = Agent(world, model, SaverKind("memory", Path()), client, "async", use_async, on_fork_required="interrupt")
    thread = f"t-{uuid.uuid4().hex[:8]}"
    config = {"configurable": {"thread_id": thread}}
    agent.say(thread, "hello")
    agent.say(thread, "pay bob 100")
    model.drift = True
    paused = agent.rewind(thread, "pay bob 100")
    (question,) = paused["__interrupt__"]
    assert question.value["fence"] == "FORK_REQUIRED" and question.value["arguments"]["amount"] == 101
    assert world.transfers == [("bob", 100)]
    # The human says no: the model reads the refusal; nothing is transferred.
    declined = agent.invoke(Command(resume=False), config)
    assert len(errors(declined)) == 1 and world.transfers == [("bob", 100)]
    # Again, and this time the human approves the change: it is made on a new branch.
    paused = agent.rewind(thread, "pay bob 100")
    assert "__interrupt__" in paused
    approved = agent.invoke(Command(resume="fork"), config)
    assert errors(approved) == []
    assert world.transfers == [("bob", 100), ("bob", 101)]


@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
@pytest.mark.filterwarnings("ignore:create_react_agent has been moved")
def test_create_react_agent_streamed_with_pydantic_tools(client: fence.Client, use_async: bool) -> None:
    from langgraph.prebuilt import create_react_agent
    from pydantic import BaseModel

    class Receipt(BaseModel):
        tx: str
        amount: int

    class TransferArgs(BaseModel):
        to: str
        amount: int
        reference: str
        timestamp: float

    sent: list[TransferArgs] = []

    @tool(args_schema=TransferArgs)
    def transfer(to: str, amount: int, reference: str, timestamp: float) -> Receipt:
        """Transfer money."""
        sent.append(TransferArgs(to=to, amount=amount, reference=reference, timestamp=timestamp))
        return Receipt(tx=f"T{len(sent)}", amount=amount)

    checkpointer = FenceCheckpointer(InMemorySaver(), client)
    tools = [fenced_tool(transfer, checkpointer, volatile_fields=["reference", "timestamp"])]
    graph = create_react_agent(ScriptedModel(), tools, checkpointer=checkpointer)
    thread = f"t-{uuid.uuid4().hex[:8]}"
    config = {"configurable": {"thread_id": thread}}
    loop = asyncio.new_event_loop() if use_async else None

    def stream(value: Any, cfg: dict[str, Any]) -> list[Any]:
        if loop is not None:

            async def collect() -> list[Any]:
                return [c async for c in graph.astream(value, cfg, stream_mode="values")]

            return loop.run_until_complete(collect())
        return list(graph.stream(value, cfg, stream_mode="values"))

    stream({"messages": [HumanMessage("hello")]}, config)
    first = stream({"messages": [HumanMessage("pay bob 100")]}, config)[-1]
    end_of_first_turn = [s for s in graph.get_state_history(config) if s.next == () and s.values.get("messages")][-1]
    again = stream({"messages": [HumanMessage("pay bob 100")]}, end_of_first_turn.config)[-1]
    assert len(sent) == 1
    tool_results = [m.content for m in (*first["messages"], *again["messages"]) if isinstance(m, ToolMessage)]
    assert len(tool_results) == 2 and tool_results[0] == tool_results[1]
    assert "T1" in tool_results[1] and errors(again) == []


@pytest.mark.filterwarnings("ignore:create_react_agent has been moved")
def test_injected_state_and_tool_call_id_are_not_the_intent(client: fence.Client) -> None:
    from langgraph.prebuilt import create_react_agent

    world = World()
    seen_ids: list[str] = []

    @tool
    def transfer(
        to: str,
        amount: int,
        reference: str,
        timestamp: float,
        state: Annotated[dict, InjectedState],
        tool_call_id: Annotated[str, InjectedToolCallId],
    ) -> dict:
        """Transfer money."""
        assert state["messages"]  # the function still gets what LangGraph injects
        seen_ids.append(tool_call_id)
        return world.transfer(to, amount)

    checkpointer = FenceCheckpointer(InMemorySaver(), client)
    tools = [fenced_tool(transfer, checkpointer, volatile_fields=["reference", "timestamp"])]
    graph = create_react_agent(ScriptedModel(), tools, checkpointer=checkpointer)
    config = {"configurable": {"thread_id": f"t-{uuid.uuid4().hex[:8]}"}}
    graph.invoke({"messages": [HumanMessage("hello")]}, config)
    graph.invoke({"messages": [HumanMessage("pay bob 100")]}, config)
    end_of_first_turn = [s for s in graph.get_state_history(config) if s.next == () and s.values.get("messages")][-1]
    # The state (its messages) and the tool-call id differ on the replay: the same transfer.
    again = graph.invoke({"messages": [HumanMessage("pay bob 100")]}, end_of_first_turn.config)
    assert errors(again) == []
    assert world.transfers == [("bob", 100)] and len(seen_ids) == 1
