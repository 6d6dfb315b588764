"""A real LangGraph agent whose transfers happen exactly once, however it is replayed.

The agent (StateGraph + ToolNode on a SQLite checkpointer) pays Bob 100. Then the user time
travels to before the payment and asks again, twice, as LangGraph's own docs show; the model
(a scripted stand-in, so no API key is needed) re-generates the call with a new reference and
timestamp each time. With Fence the bank sees one transfer and the agent gets the recorded
result; with ``--no-fence`` it sees three.

    target/debug/fenced --listen 127.0.0.1:50051 --data-dir /tmp/fence-data &
    FENCE_ADDR=127.0.0.1:50051 python examples/langgraph_agent.py [--no-fence]

Exits 0 when the bank saw exactly one transfer, 1 otherwise.
"""

from __future__ import annotations

import argparse
import os
import re
import sqlite3
import sys
import tempfile
import time
import uuid
from typing import Any

from langchain_core.language_models.chat_models import BaseChatModel
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, ToolMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from langchain_core.tools import tool
from langgraph.checkpoint.sqlite import SqliteSaver
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode, tools_condition

import fence
from fence.langgraph import FenceCheckpointer, fenced_tool

BANK: list[tuple[str, int]] = []


@tool
def transfer(to: str, amount: int, reference: str, timestamp: float) -> dict:
    """Transfer money to someone."""
    BANK.append((to, amount))
    return {"tx": f"T{len(BANK)}", "to": to, "amount": amount}


class FakeModel(BaseChatModel):
    """Calls `transfer` for "pay <to> <amount>", with fresh volatile fields every time."""

    @property
    def _llm_type(self) -> str:
        return "fake"

    def bind_tools(self, tools: Any, **kwargs: Any) -> FakeModel:  # type: ignore[override]
        return self

    def _generate(self, messages: list[BaseMessage], stop: Any = None, run_manager: Any = None, **kw: Any) -> ChatResult:
        last = messages[-1]
        if isinstance(last, ToolMessage):
            message = AIMessage(content=f"Done: {last.content}")
        elif m := re.fullmatch(r"pay (\w+) (\d+)", str(last.content)):
            args = {"to": m.group(1), "amount": int(m.group(2)), "reference": str(uuid.uuid4()), "timestamp": time.time()}
            message = AIMessage(content="", tool_calls=[{"name": "transfer", "args": args, "id": uuid.uuid4().hex}])
        else:
            message = AIMessage(content="Hello! What should I pay?")
        return ChatResult(generations=[ChatGeneration(message=message)])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--no-fence", action="store_true", help="run the same agent without Fence")
    args = parser.parse_args()

    db = sqlite3.connect(os.path.join(tempfile.mkdtemp(), "checkpoints.db"), check_same_thread=False)
    checkpointer: Any = SqliteSaver(db)
    tools: list[Any] = [transfer]
    if not args.no_fence:
        # --- Fence: these three lines are the whole integration ---------------------------
        client = fence.Client(os.environ.get("FENCE_ADDR", "127.0.0.1:50051"), tenant=os.environ.get("FENCE_TENANT"))
        checkpointer = FenceCheckpointer(checkpointer, client)
        tools = [fenced_tool(transfer, checkpointer, volatile_fields=["reference", "timestamp"])]
        # ------------------------------------------------------------------------------------

    model = FakeModel()
    builder = StateGraph(MessagesState)
    builder.add_node("agent", lambda state: {"messages": [model.bind_tools(tools).invoke(state["messages"])]})
    builder.add_node("tools", ToolNode(tools))
    builder.add_edge(START, "agent")
    builder.add_conditional_edges("agent", tools_condition)
    builder.add_edge("tools", "agent")
    graph = builder.compile(checkpointer=checkpointer)

    config = {"configurable": {"thread_id": f"example-{uuid.uuid4().hex[:8]}"}}
    graph.invoke({"messages": [HumanMessage("hello")]}, config)
    first = graph.invoke({"messages": [HumanMessage("pay bob 100")]}, config)
    print(f"first turn:   {first['messages'][-1].content}")
    # Time travel: back to the end of the first turn, and the same request again (twice).
    history = [s for s in graph.get_state_history(config) if s.next == () and s.values.get("messages")]
    for n in (1, 2):
        again = graph.invoke({"messages": [HumanMessage("pay bob 100")]}, history[-1].config)
        print(f"time travel {n}: {again['messages'][-1].content}")
    print(f"bank transfers: {BANK}")
    if len(BANK) == 1:
        print("OK: paid exactly once")
        return 0
    print(f"FAIL: paid {len(BANK)} times")
    return 1


if __name__ == "__main__":
    sys.exit(main())
