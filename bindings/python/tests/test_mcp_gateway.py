"""The MCP gateway (`fence-mcp`) between a real MCP client and a real MCP server (the `mcp`
SDK from PyPI on both sides, over stdio), with the real Fence server: retries, re-issues,
restores, read-only tools, malformed `_meta`, tenants.

The gateway binary is ``$FENCE_MCP_BIN``, else ``<repo>/target/debug/fence-mcp``.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import uuid
from pathlib import Path
from typing import Any, Awaitable, Callable

import pytest

mcp = pytest.importorskip("mcp")

from mcp import ClientSession, StdioServerParameters  # noqa: E402
from mcp.client.stdio import stdio_client  # noqa: E402

import fence  # noqa: E402
from conftest import FenceServer, fenced_binary  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[3]
UPSTREAM = Path(__file__).resolve().parent / "mcp" / "upstream_server.py"


def gateway_binary() -> Path:
    raw = os.environ.get("FENCE_MCP_BIN")
    path = Path(raw) if raw else REPO_ROOT / "target" / "debug" / "fence-mcp"
    if not path.is_file():
        pytest.fail(f"fence-mcp not found at {path}: cargo build -p fence-mcp", pytrace=False)
    return path


class World:
    """The upstream server's effects, as it recorded them."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def effects(self, kind: str | None = None) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        rows = [json.loads(line) for line in self.path.read_text().splitlines() if line]
        return [r for r in rows if kind is None or r["kind"] == kind]


def run_session(args: list[str], world: World, body: Callable[[ClientSession], Awaitable[Any]]) -> Any:
    """Starts the gateway (which starts the upstream server) and runs ``body`` in a session."""
    params = StdioServerParameters(
        command=str(gateway_binary()),
        args=[*args, "--", sys.executable, str(UPSTREAM)],
        env={**os.environ, "EFFECTS_FILE": str(world.path)},
    )

    async def main() -> Any:
        async with stdio_client(params) as (read, write):
            async with ClientSession(read, write) as session:
                await session.initialize()
                return await body(session)

    return asyncio.run(main())


@pytest.fixture
def world(tmp_path: Path) -> World:
    return World(tmp_path / "effects.jsonl")


@pytest.fixture
def embedded(tmp_path: Path) -> list[str]:
    """Gateway arguments for an embedded ledger in a temp dir."""
    return ["--data-dir", str(tmp_path / "ledger")]


def fence_of(result: Any) -> dict[str, Any]:
    assert result.isError, result
    return result.structuredContent["fence"]


def test_tools_are_listed_through(world: World, embedded: list[str]) -> None:
    async def body(s: ClientSession) -> Any:
        return await s.list_tools()

    names = {t.name for t in run_session(embedded, world, body).tools}
    assert {"charge", "create_server", "read_balance"} <= names


@pytest.mark.parametrize("transport", ["session", "unary"])
def test_a_reissued_call_with_volatile_drift_is_one_effect(
    world: World, embedded: list[str], tmp_path: Path, transport: str
) -> None:
    config = tmp_path / "gateway.toml"
    config.write_text('[tools.charge]\nvolatile_fields = ["reference"]\n')

    async def body(s: ClientSession) -> Any:
        first = await s.call_tool("charge", {"customer": "bob", "amount": 5, "reference": str(uuid.uuid4())})
        # The client's stream broke after the upstream commit; it re-issues the call as a new
        # request, and the model wrote a new reference.
        again = await s.call_tool("charge", {"customer": "bob", "amount": 5, "reference": str(uuid.uuid4())})
        return first, again

    first, again = run_session([*embedded, "--config", str(config), "--fence-transport", transport], world, body)
    assert not first.isError and not again.isError
    assert again.content[0].text == first.content[0].text
    charges = world.effects("charge")
    assert len(charges) == 1
    # The upstream got the grant's downstream key in _meta.
    assert charges[0]["downstream_key"].startswith("fence-")


def test_a_reissue_on_a_new_connection_is_recognised(world: World, embedded: list[str]) -> None:
    async def charge(s: ClientSession) -> Any:
        return await s.call_tool("create_server", {"name": "web1", "cpu": 2})

    first = run_session(embedded, world, charge)
    again = run_session(embedded, world, charge)  # a new gateway process, same client
    assert again.content[0].text == first.content[0].text
    assert len(world.effects("create")) == 1


def test_a_read_only_tool_passes_through_unrecorded(world: World, embedded: list[str]) -> None:
    async def body(s: ClientSession) -> Any:
        return [await s.call_tool("read_balance", {"customer": "bob"}) for _ in range(2)]

    results = run_session(embedded, world, body)
    assert all(not r.isError for r in results)
    assert len(world.effects("read")) == 2


def test_a_malformed_meta_is_a_clear_error_and_records_nothing(world: World, embedded: list[str]) -> None:
    async def body(s: ClientSession) -> Any:
        return await s.call_tool("charge", {"customer": "bob", "amount": 5, "reference": "r"}, meta={"dev.fence/epoch": "two"})

    result = run_session(embedded, world, body)
    info = fence_of(result)
    assert info["reason"] == "INVALID_META" and "dev.fence/epoch" in info["detail"]
    assert world.effects() == []


def test_after_a_restore_a_changed_call_is_refused_structured_then_forked_once(server: Any, tenant: str, world: World, tmp_path: Path) -> None:
    client = fence.Client(server.addr, tenant=tenant)
    run = fence.Run(f"mcp-{uuid.uuid4().hex[:8]}")
    client.checkpoint(run, "before-charge")
    config = tmp_path / "gateway.toml"
    config.write_text('[tools.charge]\nvolatile_fields = ["reference"]\n')
    args = ["--fence-url", f"http://{server.addr}", "--tenant", tenant, "--config", str(config)]
    meta = {"dev.fence/runId": run.run_id}

    async def charge(s: ClientSession, amount: int, extra: dict[str, Any]) -> Any:
        return await s.call_tool("charge", {"customer": "bob", "amount": amount, "reference": str(uuid.uuid4())}, meta={**meta, **extra})

    async def first(s: ClientSession) -> Any:
        return await charge(s, 5, {})

    assert not run_session(args, world, first).isError
    restored = client.restore(run, "before-charge")

    async def drifted(s: ClientSession) -> Any:
        return await charge(s, 50, {"dev.fence/epoch": restored.epoch})

    refusal = fence_of(run_session(args, world, drifted))
    assert refusal["reason"] == "FORK_REQUIRED" and refusal["checkpointId"] == "before-charge"
    assert refusal["receipt"]["state"] == "COMPLETED"
    # The host forks (its user chose the change) and calls again on the new branch: once.
    branch = client.fork(run, "before-charge", reason="the user raised the amount")

    async def on_fork(s: ClientSession) -> Any:
        first = await charge(s, 50, {"dev.fence/epoch": restored.epoch, "dev.fence/branch": branch.name, "dev.fence/stepKey": "raise"})
        again = await charge(s, 50, {"dev.fence/epoch": restored.epoch, "dev.fence/branch": branch.name, "dev.fence/stepKey": "raise"})
        return first, again

    done, again = run_session(args, world, on_fork)
    assert not done.isError and not again.isError
    assert again.content[0].text == done.content[0].text
    assert [c["amount"] for c in world.effects("charge")] == [5, 50]
    client.close()


def test_a_hosts_trace_context_reaches_fence_and_the_upstream(world: World, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:

    # A Fence server logging each request's span (with the caller's trace id) at debug level.
    monkeypatch.setenv("RUST_LOG", "fence_server=debug")
    srv = FenceServer(fenced_binary(), tmp_path / "data", tmp_path / "fenced.log", [])
    srv.start()
    trace_id = uuid.uuid4().hex
    traceparent = f"00-{trace_id}-{uuid.uuid4().hex[:16]}-01"
    try:
        async def charge(s: ClientSession) -> Any:
            return await s.call_tool(
                "charge", {"customer": "ann", "amount": 3, "reference": "r"}, meta={"traceparent": traceparent}
            )

        assert not run_session(["--fence-url", f"http://{srv.addr}", "--tenant", "traced"], world, charge).isError
    finally:
        srv.stop()
    log = srv.log_path.read_text(encoding="utf-8")
    begins = [line for line in log.splitlines() if "Begin" in line and trace_id in line]
    completes = [line for line in log.splitlines() if "Complete" in line and trace_id in line]
    assert begins and completes, log[-3000:]
    # The host's _meta is passed upstream as it came, trace context included.
    assert [c["traceparent"] for c in world.effects("charge")] == [traceparent]


def test_two_tenants_do_not_see_each_other(server: Any, world: World) -> None:
    a, b = f"mcp-a-{uuid.uuid4().hex[:6]}", f"mcp-b-{uuid.uuid4().hex[:6]}"

    async def create(s: ClientSession) -> Any:
        return await s.call_tool("create_server", {"name": "shared-name", "cpu": 1})

    for tenant in (a, b):
        assert not run_session(["--fence-url", f"http://{server.addr}", "--tenant", tenant], world, create).isError
    # Each tenant's call was its own effect: neither replayed the other's.
    assert len(world.effects("create")) == 2
    with fence.Client(server.addr, tenant=a) as ca, fence.Client(server.addr, tenant=b) as cb:
        effects_a = list(ca.iter_effects(fence.Run("mcp-default")))
        effects_b = list(cb.iter_effects(fence.Run("mcp-default")))
    assert len(effects_a) == 1 and len(effects_b) == 1
    assert effects_a[0].effect_id != effects_b[0].effect_id


def test_an_upstream_timeout_is_unknown_and_a_retry_must_reconcile(world: World, embedded: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLOW_SECONDS", "5")
    args = [*embedded, "--upstream-timeout-ms", "500"]

    async def body(s: ClientSession) -> Any:
        call = {"customer": "slow", "amount": 9, "reference": "r1"}
        return await s.call_tool("charge", call), await s.call_tool("charge", call)

    first, retry = run_session(args, world, body)
    # The call was sent and did not answer: it may have happened. Never retried blind.
    assert fence_of(first)["reason"] == "RECONCILE_REQUIRED"
    assert fence_of(retry)["reason"] == "RECONCILE_REQUIRED"
    assert len(world.effects("charge")) == 1


def test_a_host_checkpoints_restores_and_forks_through_the_gateway_tools(world: World, embedded: list[str], tmp_path: Path) -> None:
    config = tmp_path / "gateway.toml"
    config.write_text('[tools.charge]\nvolatile_fields = ["reference"]\n')
    args = [*embedded, "--config", str(config), "--fence-tools"]

    def charge(amount: int, meta: dict[str, Any]) -> Callable[[ClientSession], Awaitable[Any]]:
        async def body(s: ClientSession) -> Any:
            return await s.call_tool("charge", {"customer": "ann", "amount": amount, "reference": str(uuid.uuid4())}, meta=meta)

        return body

    async def tools(s: ClientSession) -> Any:
        return {t.name for t in (await s.list_tools()).tools}

    assert {"fence_checkpoint", "fence_restore", "fence_fork", "fence_outcome"} <= run_session(args, world, tools)
    assert "fence_restore" not in run_session(embedded, world, tools)  # hidden unless enabled

    async def call(s: ClientSession, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
        result = await s.call_tool(name, arguments)
        assert not result.isError, result
        return result.structuredContent

    async def checkpoint(s: ClientSession) -> Any:
        return await call(s, "fence_checkpoint", {"checkpoint_id": "cp-1"})

    run_session(args, world, checkpoint)
    assert not run_session(args, world, charge(10, {})).isError

    async def restore(s: ClientSession) -> Any:
        return await call(s, "fence_restore", {"checkpoint_id": "cp-1"})

    restored = run_session(args, world, restore)
    assert restored["epoch"] == 2 and len(restored["tape"]) == 1
    # The same charge after the restore replays; a changed one is refused until a fork.
    assert not run_session(args, world, charge(10, {"dev.fence/epoch": 2})).isError
    run_session(args, world, restore)
    refusal = fence_of(run_session(args, world, charge(20, {"dev.fence/epoch": 3})))
    assert refusal["reason"] == "FORK_REQUIRED"

    async def fork(s: ClientSession) -> Any:
        return await call(s, "fence_fork", {"checkpoint_id": "cp-1", "epoch": 3, "new_branch": "bigger"})

    assert run_session(args, world, fork)["branch"] == "bigger"
    done = run_session(args, world, charge(20, {"dev.fence/epoch": 3, "dev.fence/branch": "bigger"}))
    assert not done.isError
    assert [c["amount"] for c in world.effects("charge")] == [10, 20]

    async def outcome(s: ClientSession) -> Any:
        return await call(s, "fence_outcome", {"effect_id": refusal["effectId"]})

    assert run_session(args, world, outcome)["state"] == "COMPLETED"


def gateway_pids(data_dir: Path) -> list[int]:
    """The fence-mcp processes serving ``data_dir`` (from /proc: no procps needed)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv and argv[0].endswith(b"fence-mcp") and str(data_dir).encode() in argv:
            pids.append(int(entry.name))
    return pids


def test_the_gateway_killed_mid_call_loses_nothing_and_runs_nothing_twice(world: World, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import signal
    import time

    data_dir = tmp_path / f"ledger-{uuid.uuid4().hex[:8]}"
    config = tmp_path / "gateway.toml"
    config.write_text("[tools.charge]\nlease_ms = 1500\n")
    args = ["--data-dir", str(data_dir), "--config", str(config)]
    monkeypatch.setenv("SLOW_SECONDS", "4")
    done_call = {"customer": "bob", "amount": 1, "reference": "r-done"}
    slow_call = {"customer": "slow", "amount": 2, "reference": "r-slow"}

    seen: dict[str, Any] = {}

    async def first(s: ClientSession) -> None:
        seen["done"] = await s.call_tool("charge", done_call)
        task = asyncio.ensure_future(s.call_tool("charge", slow_call))
        # Once the upstream is inside the slow charge, kill -9 the gateway.
        for _ in range(200):
            if world.effects("charge")[1:]:
                break
            await asyncio.sleep(0.05)
        gateway = gateway_pids(data_dir)
        assert gateway, "the gateway process was not found"
        for pid in gateway:
            os.kill(pid, signal.SIGKILL)
        seen["killed"] = True
        await asyncio.wait_for(task, 10)  # the cut-off call never answers

    # The session ends with the killed process; what matters is what the ledger kept.
    with pytest.raises(BaseException):
        run_session(args, world, first)
    assert seen.get("killed") and not seen["done"].isError
    time.sleep(0.2)

    async def after(s: ClientSession) -> Any:
        return await s.call_tool("charge", done_call), await s.call_tool("charge", slow_call)

    replayed, slow = run_session(args, world, after)
    # The acknowledged charge is still recorded: the re-issue gets its result, not a new charge.
    assert not replayed.isError
    assert replayed.content[0].text == seen["done"].content[0].text
    # The charge cut off by the kill may have happened: unknown, never run again blind.
    assert fence_of(slow)["reason"] == "RECONCILE_REQUIRED"
    assert [c["customer"] for c in world.effects("charge")] == ["bob", "slow"]


def test_streamable_http_downstream_reissues_across_connections(world: World, tmp_path: Path) -> None:
    import subprocess

    from mcp.client.streamable_http import streamable_http_client

    config = tmp_path / "gateway.toml"
    config.write_text('[tools.charge]\nvolatile_fields = ["reference"]\n')
    proc = subprocess.Popen(
        [str(gateway_binary()), "--listen", "127.0.0.1:0", "--data-dir", str(tmp_path / "http-ledger"),
         "--config", str(config), "--", sys.executable, str(UPSTREAM)],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        env={**os.environ, "EFFECTS_FILE": str(world.path)},
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("fence-mcp listening on "), line
        url = line.split()[-1]

        async def call_once(token: str | None = None) -> Any:
            import httpx

            headers = {"Authorization": f"Bearer {token}"} if token else {}
            async with httpx.AsyncClient(headers=headers, timeout=30) as http:
                async with streamable_http_client(url, http_client=http) as (read, write, _):
                    async with ClientSession(read, write) as session:
                        await session.initialize()
                        return await session.call_tool("charge", {"customer": "zoe", "amount": 3, "reference": str(uuid.uuid4())})

        # The stream broke; the client re-issues on a new connection with a fresh reference.
        first = asyncio.run(call_once())
        again = asyncio.run(call_once())
        assert not first.isError and not again.isError
        assert again.content[0].text == first.content[0].text
        assert len(world.effects("charge")) == 1
        # Two authenticated clients each get their own durable run: the same call from each is
        # its own effect, and each one's re-issue is recognised.
        for token in ("client-a", "client-b"):
            mine = asyncio.run(call_once(token))
            assert asyncio.run(call_once(token)).content[0].text == mine.content[0].text
        assert len(world.effects("charge")) == 3
    finally:
        proc.terminate()
        proc.wait(timeout=15)


def test_a_streamable_http_upstream_is_fenced(world: World, embedded: list[str]) -> None:
    import socket
    import subprocess
    import time

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    upstream = subprocess.Popen(
        [sys.executable, str(UPSTREAM)],
        env={**os.environ, "EFFECTS_FILE": str(world.path), "UPSTREAM_HTTP_PORT": str(port)},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        for _ in range(100):
            with socket.socket() as probe:
                if probe.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.1)
        params = StdioServerParameters(
            command=str(gateway_binary()),
            args=[*embedded, "--upstream-url", f"http://127.0.0.1:{port}/mcp"],
            env=dict(os.environ),
        )

        async def main() -> Any:
            async with stdio_client(params) as (read, write):
                async with ClientSession(read, write) as s:
                    await s.initialize()
                    call = {"name": "web9", "cpu": 4}
                    return await s.call_tool("create_server", call), await s.call_tool("create_server", call)

        first, again = asyncio.run(main())
        assert not first.isError and again.content[0].text == first.content[0].text
        assert len(world.effects("create")) == 1
    finally:
        upstream.terminate()
        upstream.wait(timeout=15)


def test_several_upstreams_are_namespaced(world: World, embedded: list[str], tmp_path: Path) -> None:
    config = tmp_path / "gateway.toml"
    upstream = json.dumps([sys.executable, str(UPSTREAM)])
    config.write_text(
        f"[upstreams.pay]\ncommand = {upstream}\n[upstreams.ops]\ncommand = {upstream}\n"
        '[tools."pay__charge"]\nvolatile_fields = ["reference"]\n'
        '[tools."ops__charge"]\nvolatile_fields = ["reference"]\n'
    )
    params = StdioServerParameters(
        command=str(gateway_binary()),
        args=[*embedded, "--config", str(config)],
        env={**os.environ, "EFFECTS_FILE": str(world.path)},
    )

    async def main() -> Any:
        async with stdio_client(params) as (read, write):
            async with ClientSession(read, write) as s:
                await s.initialize()
                names = {t.name for t in (await s.list_tools()).tools}
                call = lambda: {"customer": "kim", "amount": 7, "reference": str(uuid.uuid4())}  # noqa: E731
                results = [
                    await s.call_tool("pay__charge", call()),
                    await s.call_tool("pay__charge", call()),
                    await s.call_tool("ops__charge", call()),
                    await s.call_tool("nope__charge", call()),
                ]
                return names, results

    names, (first, again, other, unknown) = asyncio.run(main())
    assert {"pay__charge", "ops__charge", "pay__read_balance", "ops__create_server"} <= names
    assert not first.isError and again.content[0].text == first.content[0].text
    assert not other.isError
    assert fence_of(unknown)["reason"] == "UNKNOWN_TOOL"
    # One charge per upstream: the re-issue on "pay" was recognised, "ops" is another tool.
    assert len(world.effects("charge")) == 2


def test_configured_string_normalisation_makes_spellings_one_intent(world: World, embedded: list[str], tmp_path: Path) -> None:
    config = tmp_path / "gateway.toml"
    config.write_text('[tools.create_server]\nnormalized_fields = ["name"]\nstring_normalization = "trim_lowercase"\n')

    async def body(s: ClientSession) -> Any:
        return [await s.call_tool("create_server", {"name": name, "cpu": 2}) for name in ("Web1", " web1 ")]

    first, again = run_session([*embedded, "--config", str(config)], world, body)
    assert not first.isError and again.content[0].text == first.content[0].text
    assert len(world.effects("create")) == 1


def test_http_clients_with_tokens_are_recorded_in_their_own_tenants(world: World, server: Any, tmp_path: Path) -> None:
    import hashlib
    import subprocess

    import httpx
    from mcp.client.streamable_http import streamable_http_client

    def token_hash(token: str) -> str:
        # fenced prints the blake3 hash a tokens file needs.
        return subprocess.run(
            [str(REPO_ROOT / "target" / "debug" / "fenced"), "hash-token", token],
            capture_output=True, text=True, check=True,
        ).stdout.split()[-1]

    suffix = hashlib.sha256(str(tmp_path).encode()).hexdigest()[:8]
    tenants = {"token-alice": f"alice-{suffix}", "token-bob": f"bob-{suffix}"}
    tokens_file = tmp_path / "clients.tokens"
    tokens_file.write_text("".join(f"{t} {token_hash(k)}\n" for k, t in tenants.items()))
    proc = subprocess.Popen(
        [str(gateway_binary()), "--listen", "127.0.0.1:0", "--fence-url", f"http://{server.addr}",
         "--client-tokens-file", str(tokens_file), "--", sys.executable, str(UPSTREAM)],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        env={**os.environ, "EFFECTS_FILE": str(world.path)},
    )
    try:
        assert proc.stdout is not None
        url = proc.stdout.readline().split()[-1]

        async def create(token: str | None) -> Any:
            headers = {"Authorization": f"Bearer {token}"} if token else {}
            async with httpx.AsyncClient(headers=headers, timeout=30) as http:
                async with streamable_http_client(url, http_client=http) as (read, write, _):
                    async with ClientSession(read, write) as session:
                        await session.initialize()
                        return await session.call_tool("create_server", {"name": "shared", "cpu": 1})

        for token in tenants:
            assert not asyncio.run(create(token)).isError
        # An unknown token, or none: refused, nothing done.
        for token in ("token-mallory", None):
            assert fence_of(asyncio.run(create(token)))["reason"] == "UNAUTHENTICATED"
        assert len(world.effects("create")) == 2
        # Each tenant sees its own client's effect, in that client's run, and not the other's.
        for token, tenant in tenants.items():
            run = fence.Run(f"mcp-default-{token_hash(token)[:16]}")
            with fence.Client(server.addr, tenant=tenant) as mine:
                assert [e.tool for e in mine.iter_effects(run)] == ["create_server"]
            other = next(t for t in tenants.values() if t != tenant)
            with fence.Client(server.addr, tenant=other) as theirs:
                with pytest.raises(fence.FenceRefused):
                    list(theirs.iter_effects(run))
    finally:
        proc.terminate()
        proc.wait(timeout=15)
