"""Fixtures: the real ``fenced`` binary on an ephemeral port with a temporary data dir.

The binary is ``$FENCED_BIN`` (a relative path is resolved against the repository root), else
``<repo>/target/debug/fenced``. A missing binary is a test failure, not a skip: these tests
exist to run against the real server.
"""

from __future__ import annotations

import os
import queue
import subprocess
import threading
import time
import uuid
from pathlib import Path
from typing import Iterator

import pytest

import fence

REPO_ROOT = Path(__file__).resolve().parents[3]
READY_PREFIX = "fenced listening on "
READY_TIMEOUT_S = float(os.environ.get("FENCED_READY_TIMEOUT", "60"))


def fenced_binary() -> Path:
    raw = os.environ.get("FENCED_BIN")
    path = Path(raw) if raw else Path("target") / "debug" / "fenced"
    if not path.is_absolute():
        path = REPO_ROOT / path
    return path


class FenceServer:
    """One ``fenced`` process: ``addr`` is ``127.0.0.1:PORT`` once started."""

    def __init__(self, binary: Path, data_dir: Path, log_path: Path, extra_args: list[str]) -> None:
        self.binary = binary
        self.data_dir = data_dir
        self.log_path = log_path
        self.extra_args = extra_args
        self.proc: subprocess.Popen[str] | None = None
        self.addr = ""
        self._log = None

    def start(self) -> None:
        if not self.binary.is_file():
            pytest.fail(
                f"fenced binary not found at {self.binary}: build it with "
                "`cargo build -p fence-server --bin fenced` or set FENCED_BIN",
                pytrace=False,
            )
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "a", encoding="utf-8")
        env = {k: v for k, v in os.environ.items() if k not in ("FENCE_LISTEN", "FENCE_DATA_DIR")}
        self.proc = subprocess.Popen(
            [str(self.binary), "--listen", "127.0.0.1:0", "--data-dir", str(self.data_dir), *self.extra_args],
            stdout=subprocess.PIPE,
            stderr=self._log,
            stdin=subprocess.DEVNULL,
            text=True,
            env=env,
        )
        lines: queue.Queue[str | None] = queue.Queue()

        def pump() -> None:
            assert self.proc is not None and self.proc.stdout is not None
            for line in self.proc.stdout:
                lines.put(line)
            lines.put(None)

        threading.Thread(target=pump, name="fenced-stdout", daemon=True).start()
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self.stop()
                pytest.fail(f"fenced printed no ready line within {READY_TIMEOUT_S}s; log: {self.log_tail()}")
            try:
                line = lines.get(timeout=remaining)
            except queue.Empty:
                continue
            if line is None:
                code = self.proc.wait()
                pytest.fail(f"fenced exited ({code}) before it was ready; log: {self.log_tail()}")
            if line.startswith(READY_PREFIX):
                self.addr = line[len(READY_PREFIX):].strip()
                return

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._log is not None:
            self._log.close()
            self._log = None

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text(encoding="utf-8", errors="replace")[-n:]
        except OSError:
            return "<no log>"


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FenceServer]:
    base = tmp_path_factory.mktemp("fenced")
    srv = FenceServer(fenced_binary(), base / "data", base / "fenced.log", [])
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def tenant() -> str:
    """A fresh tenant per test (dev-mode ``x-fence-tenant``): tests cannot see each other."""
    return f"py-{uuid.uuid4().hex[:12]}"


@pytest.fixture(params=[False, True], ids=["unary", "sessions"])
def client(server: FenceServer, tenant: str, request: pytest.FixtureRequest) -> Iterator[fence.Client]:
    """A client of the test's tenant, once with an RPC per call and once with Begin,
    Complete and Heartbeat on a shared Session stream: every rule must hold both ways."""
    with fence.Client(server.addr, tenant=tenant, timeout=20, sessions=request.param) as c:
        yield c


@pytest.fixture
def run_id() -> str:
    return f"run-{uuid.uuid4().hex[:12]}"
