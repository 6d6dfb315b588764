"""The LangGraph-style example: paid exactly once with Fence, twice without it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "langgraph_style_payment.py"


def run_example(server: Any, tenant: str, workdir: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, FENCE_ADDR=server.addr, FENCE_TENANT=tenant)
    return subprocess.run(
        [sys.executable, str(EXAMPLE), "--workdir", str(workdir), *extra],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_example_pays_once_with_fence(server: Any, tenant: str, tmp_path: Path) -> None:
    proc = run_example(server, tenant, tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "OK: paid exactly once" in proc.stdout
    ledger = json.loads((tmp_path / "bank-ledger.json").read_text())
    assert len(ledger) == 1
    # The first process really crashed after paying, and the resumed one restored in Fence.
    assert "[first] crashing" in proc.stdout
    assert "[resume] restored turn-1: epoch 2, 1 recorded effect(s)" in proc.stdout
    # Replayed by Fence: the bank got exactly one request, the receipt counts the replay.
    requests = (tmp_path / "bank-ledger-requests.log").read_text().splitlines()
    assert len(requests) == 1
    assert "COMPLETED, replayed 1 time(s), bank API requests so far: 1" in proc.stdout


def test_example_without_fence_pays_twice_and_fails(server: Any, tenant: str, tmp_path: Path) -> None:
    proc = run_example(server, tenant, tmp_path, "--no-fence")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "FAIL: the payment happened twice" in proc.stdout
    assert len(json.loads((tmp_path / "bank-ledger.json").read_text())) == 2
    assert len((tmp_path / "bank-ledger-requests.log").read_text().splitlines()) == 2


LANGGRAPH_EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "langgraph_agent.py"


def run_langgraph_example(server: Any, tenant: str, *extra: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, FENCE_ADDR=server.addr, FENCE_TENANT=tenant)
    return subprocess.run(
        [sys.executable, str(LANGGRAPH_EXAMPLE), *extra], env=env, capture_output=True, text=True, timeout=120
    )


def test_langgraph_example_transfers_once_with_fence(server: Any, tenant: str) -> None:
    proc = run_langgraph_example(server, tenant)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "bank transfers: [('bob', 100)]" in proc.stdout
    assert "OK: paid exactly once" in proc.stdout


def test_langgraph_example_without_fence_transfers_three_times(server: Any, tenant: str) -> None:
    proc = run_langgraph_example(server, tenant, "--no-fence")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "FAIL: paid 3 times" in proc.stdout
