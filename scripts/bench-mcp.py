#!/usr/bin/env python3
"""Added latency of the MCP gateway: the same calls made to the upstream MCP server directly
and through `fence-mcp` (embedded ledger), in one run, with the official `mcp` SDK over stdio.

    bindings/python/.venv/bin/python scripts/bench-mcp.py [--calls 500] [--gateway target/release/fence-mcp]

Each fenced call is a new effect (a distinct server name): Begin, the upstream call and
Complete, each Fence write fsynced. Prints p50 and p99 per call, and the read-only tool
(passed through unrecorded) for comparison.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client

REPO = Path(__file__).resolve().parents[1]
UPSTREAM = REPO / "bindings" / "python" / "tests" / "mcp" / "upstream_server.py"


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def measure(params: StdioServerParameters, calls: int, tool: str) -> list[float]:
    async with stdio_client(params) as (read, write):
        async with ClientSession(read, write) as session:
            await session.initialize()
            # Warm up (tool registration, connections).
            for i in range(10):
                await session.call_tool(tool, args(tool, f"warm-{i}"))
            out = []
            for i in range(calls):
                start = time.perf_counter()
                result = await session.call_tool(tool, args(tool, f"n-{i}"))
                out.append((time.perf_counter() - start) * 1000)
                assert not result.isError, result
            return out


def args(tool: str, name: str) -> dict[str, Any]:
    return {"name": name, "cpu": 1} if tool == "create_server" else {"customer": name}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=500)
    parser.add_argument("--gateway", default=str(REPO / "target" / "release" / "fence-mcp"))
    a = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-mcp-"))
    env = {**os.environ, "EFFECTS_FILE": str(work / "effects.jsonl")}
    direct = StdioServerParameters(command=sys.executable, args=[str(UPSTREAM)], env=env)
    gateway = StdioServerParameters(
        command=a.gateway,
        args=["--data-dir", str(work / "ledger"), "--", sys.executable, str(UPSTREAM)],
        env=env,
    )
    print(f"{a.calls} calls each, upstream FastMCP over stdio, gateway {a.gateway}")
    print("| path | tool | p50 ms | p99 ms | mean ms |")
    print("|---|---|---:|---:|---:|")
    for tool in ("create_server", "read_balance"):
        for label, params in (("direct", direct), ("through fence-mcp", gateway)):
            samples = asyncio.run(measure(params, a.calls, tool))
            print(
                f"| {label} | {tool} | {percentile(samples, 0.5):.2f} | {percentile(samples, 0.99):.2f} "
                f"| {statistics.fmean(samples):.2f} |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
