"""Bearer-token authentication: the client's ``token=`` reaches the server's auth."""

from __future__ import annotations

import subprocess
import uuid
from pathlib import Path
from typing import Iterator

import grpc
import pytest

import fence
from conftest import FenceServer, fenced_binary


@pytest.fixture(scope="module")
def auth_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[FenceServer, str, str]]:
    base = tmp_path_factory.mktemp("fenced-auth")
    binary = fenced_binary()
    alice, bob = f"tok-{uuid.uuid4().hex}", f"tok-{uuid.uuid4().hex}"
    lines = []
    for tenant, token in (("alice", alice), ("bob", bob)):
        if not binary.is_file():
            pytest.fail(f"fenced binary not found at {binary}", pytrace=False)
        digest = subprocess.run([str(binary), "hash-token", token], capture_output=True, text=True, check=True)
        lines.append(f"{tenant} {digest.stdout.strip()}")
    tokens = base / "tokens"
    tokens.write_text("\n".join(lines) + "\n")
    srv = FenceServer(binary, base / "data", base / "fenced.log", ["--auth-tokens-file", str(tokens)])
    srv.start()
    try:
        yield srv, alice, bob
    finally:
        srv.stop()


def test_token_authenticates_and_isolates_tenants(auth_server: tuple[FenceServer, str, str]) -> None:
    srv, alice_token, bob_token = auth_server
    run_id = f"run-{uuid.uuid4().hex[:8]}"
    with fence.Client(srv.addr, token=alice_token) as alice, fence.Client(srv.addr, token=bob_token) as bob:
        res = alice.begin(run_id, "mail.send", {"to": "x@example.com"}, step_key=f"{run_id}:1")
        assert isinstance(res.decision, fence.Execute)
        # Bob's tenant does not see Alice's run.
        with pytest.raises(fence.FenceRefused) as hidden:
            bob.get_run(run_id)
        assert hidden.value.reason == fence.ReasonCode.UNKNOWN_RECORD
        assert alice.get_run(run_id).effect_count == 1

    with fence.Client(srv.addr) as anonymous:
        with pytest.raises(fence.FenceRpcError) as err:
            anonymous.start_run(run_id)
        assert err.value.code == grpc.StatusCode.UNAUTHENTICATED
    with fence.Client(srv.addr, token="wrong") as wrong:
        with pytest.raises(fence.FenceRpcError) as err2:
            wrong.start_run(run_id)
        assert err2.value.code == grpc.StatusCode.UNAUTHENTICATED


def test_dev_tenant_header_isolates(server: FenceServer) -> None:
    run_id = f"run-{uuid.uuid4().hex[:8]}"
    with fence.Client(server.addr, tenant="t1") as t1, fence.Client(server.addr, tenant="t2") as t2:
        t1.start_run(run_id)
        with pytest.raises(fence.FenceRefused) as err:
            t2.get_run(run_id)
        assert err.value.reason == fence.ReasonCode.UNKNOWN_RECORD
        assert err.value.code == grpc.StatusCode.NOT_FOUND


def test_missing_binary_path_is_resolved_against_the_repo(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FENCED_BIN", "target/debug/fenced")
    assert fenced_binary() == Path(__file__).resolve().parents[3] / "target" / "debug" / "fenced"
