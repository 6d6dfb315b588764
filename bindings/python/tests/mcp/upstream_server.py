"""An upstream MCP server (the real `mcp` SDK's FastMCP over stdio) whose tools count real
effects in a JSON-lines file given by $EFFECTS_FILE: a charge, a server creation and a read."""

from __future__ import annotations

import json
import os
import time

from mcp.server.fastmcp import Context, FastMCP
from mcp.types import ToolAnnotations

mcp = FastMCP("upstream")
EFFECTS = os.environ["EFFECTS_FILE"]


def record(kind: str, **fields: object) -> int:
    with open(EFFECTS, "a", encoding="utf-8") as f:
        f.write(json.dumps({"kind": kind, **fields}) + "\n")
    with open(EFFECTS, encoding="utf-8") as f:
        return sum(1 for _ in f)


@mcp.tool()
def charge(customer: str, amount: int, reference: str, ctx: Context) -> dict:
    """Charge a customer (irreversible)."""
    meta = ctx.request_context.meta
    key = getattr(meta, "dev.fence/downstreamKey", None) if meta is not None else None
    traceparent = getattr(meta, "traceparent", None) if meta is not None else None
    n = record("charge", customer=customer, amount=amount, downstream_key=key, traceparent=traceparent)
    if customer == "slow":
        time.sleep(float(os.environ.get("SLOW_SECONDS", "30")))
    return {"charge_id": f"ch_{n}", "amount": amount}


@mcp.tool()
def create_server(name: str, cpu: int) -> str:
    """Create a server."""
    n = record("create", name=name, cpu=cpu)
    return f"server {name} #{n}"


@mcp.tool(annotations=ToolAnnotations(readOnlyHint=True))
def read_balance(customer: str) -> str:
    """Read a balance (read-only)."""
    record("read", customer=customer)
    return f"{customer}: 100"


if __name__ == "__main__":
    if port := os.environ.get("UPSTREAM_HTTP_PORT"):
        # Streamable HTTP at http://127.0.0.1:<port>/mcp.
        mcp.settings.host = "127.0.0.1"
        mcp.settings.port = int(port)
        mcp.run(transport="streamable-http")
    else:
        mcp.run()
