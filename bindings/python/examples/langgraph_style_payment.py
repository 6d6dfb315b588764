"""A LangGraph-style agent pays, crashes, restores from a checkpoint, and does NOT pay twice.

Plain Python, no framework: a state dict flows through an "agent" node (the model, which
emits a tool call) and a "tools" node (which executes it), and a checkpointer saves the state
at the start of each turn, as an agent framework does.

What happens (each phase is a separate OS process, so the crash is real):

1. ``first`` process: the turn starts (checkpoint ``turn-1``, saved locally and in Fence); the
   model asks for ``bank_transfer(to="bob", amount=120, reference=<uuid>, requested_at=<now>)``;
   the tools node pays through Fence; then the process dies (``os._exit``) before the framework
   saves the end of the turn.
2. ``resume`` process: it loads the last checkpoint (``turn-1``) and tells Fence
   (``Restore``). The turn is re-run: the model re-generates the call, *almost* the same -- a
   fresh UUID and a new timestamp. Key-based idempotency would see a new request. Fence
   matches it against the replay tape (the tool declares ``reference`` and ``requested_at``
   volatile) and answers REPLAY: the recorded result comes back and the bank is not called.
3. The parent checks the bank's ledger (a file: the outside world survives the crash) and
   exits non-zero if the payment happened twice. (The bank also logs every request it gets:
   with Fence it gets exactly one, since the replay never reaches it. Even if it did, the
   request would carry the same downstream key, which the bank deduplicates.)

``--no-fence`` runs the same agent with the tool calling the bank directly (passing the
model's fresh reference as the idempotency key, as frameworks do): it pays twice and exits 1.

Server address: ``FENCE_ADDR`` (default ``127.0.0.1:50051``); tenant: ``FENCE_TENANT``.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any, Callable

import fence

CRASH_EXIT_CODE = 75


# ---------------------------------------------------------------------------------------------
# The outside world: a payments API with idempotency keys, persisted to a file.
# ---------------------------------------------------------------------------------------------


class BankApi:
    """A fake payments API. It honours idempotency keys, like real payment APIs do."""

    def __init__(self, ledger: Path) -> None:
        self.ledger = ledger
        self.request_log = ledger.with_name(ledger.stem + "-requests.log")

    def _load(self) -> list[dict[str, Any]]:
        return json.loads(self.ledger.read_text()) if self.ledger.exists() else []

    def transfer(self, to: str, amount: int, currency: str, idempotency_key: str) -> dict[str, Any]:
        with self.request_log.open("a") as log:  # every request that reached the bank
            log.write(json.dumps({"to": to, "amount": amount, "idempotency_key": idempotency_key}) + "\n")
        entries = self._load()
        for entry in entries:
            if entry["idempotency_key"] == idempotency_key:
                return entry  # a retry with the same key: no second payment
        entry = {
            "tx": f"tx-{len(entries) + 1}",
            "to": to,
            "amount": amount,
            "currency": currency,
            "idempotency_key": idempotency_key,
        }
        entries.append(entry)
        self.ledger.write_text(json.dumps(entries, indent=2))
        return entry

    def payments(self) -> list[dict[str, Any]]:
        return self._load()

    def requests(self) -> int:
        return len(self.request_log.read_text().splitlines()) if self.request_log.exists() else 0


# ---------------------------------------------------------------------------------------------
# The framework: state, nodes, a checkpointer.
# ---------------------------------------------------------------------------------------------


class FileCheckpointer:
    """Saves named checkpoints of the graph state to a JSON file."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def _all(self) -> list[dict[str, Any]]:
        return json.loads(self.path.read_text()) if self.path.exists() else []

    def put(self, checkpoint_id: str, state: dict[str, Any]) -> None:
        entries = self._all()
        entries.append({"checkpoint_id": checkpoint_id, "state": copy.deepcopy(state)})
        self.path.write_text(json.dumps(entries, indent=2))

    def latest(self) -> dict[str, Any]:
        entries = self._all()
        if not entries:
            raise SystemExit("no checkpoint to resume from")
        return entries[-1]


def agent_node(state: dict[str, Any]) -> dict[str, Any]:
    """The "model": asks to pay the invoice. Non-deterministic, like a real model: every
    generation carries a fresh reference UUID and the current timestamp."""
    call = {
        "id": f"call_{uuid.uuid4().hex[:12]}",
        "name": "bank_transfer",
        "args": {
            "to": "bob",
            "amount": 120,
            "currency": "EUR",
            "reference": str(uuid.uuid4()),
            "requested_at": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        },
    }
    return {"messages": state["messages"] + [{"role": "ai", "tool_calls": [call]}]}


def make_tools_node(tools: dict[str, Callable[..., Any]], fenced_tools: bool) -> Callable[..., Any]:
    def tools_node(state: dict[str, Any], run: fence.Run | None) -> dict[str, Any]:
        calls = state["messages"][-1]["tool_calls"]
        results = []
        for index, call in enumerate(calls):
            tool = tools[call["name"]]
            if fenced_tools:
                # The step comes from the graph position (restored from the checkpoint), not
                # from the model's tool-call id (fresh on every generation).
                step = f"turn-{state['turn']}/tools/{index}"
                output = tool(**call["args"], fence_run=run, fence_step=step)
            else:
                output = tool(**call["args"])
            results.append({"role": "tool", "tool_call_id": call["id"], "content": output})
        return {"messages": state["messages"] + results}

    return tools_node


# ---------------------------------------------------------------------------------------------
# One process of the agent
# ---------------------------------------------------------------------------------------------


def agent_process(phase: str, workdir: Path, use_fence: bool) -> int:
    bank = BankApi(workdir / "bank-ledger.json")
    checkpointer = FileCheckpointer(workdir / "checkpoints.json")
    thread_id = (workdir / "thread_id").read_text().strip()

    client = None
    run = None
    if use_fence:
        client = fence.Client(os.environ.get("FENCE_ADDR", fence.DEFAULT_TARGET), tenant=os.environ.get("FENCE_TENANT"))

        @fence.fenced(
            client,
            tool="bank.transfer",
            cls=fence.OperationClass.NON_RETRYABLE,
            volatile_fields=["reference", "requested_at"],
        )
        def bank_transfer(
            to: str, amount: int, currency: str, reference: str, requested_at: str, downstream_key: str = ""
        ) -> dict[str, Any]:
            # Fence's downstream key, not the model's reference, is the bank's idempotency key.
            return bank.transfer(to, amount, currency, idempotency_key=downstream_key)

        run = fence.Run(thread_id)
        client.start_run(run)
    else:

        def bank_transfer(to: str, amount: int, currency: str, reference: str, requested_at: str) -> dict[str, Any]:
            return bank.transfer(to, amount, currency, idempotency_key=reference)

    tools_node = make_tools_node({"bank_transfer": bank_transfer}, use_fence)

    if phase == "first":
        state: dict[str, Any] = {"turn": 1, "messages": [{"role": "user", "content": "Pay Bob 120 EUR for invoice 42"}]}
        checkpointer.put("turn-1", state)
        if client is not None:
            client.checkpoint(run, "turn-1")
    else:
        saved = checkpointer.latest()
        state = saved["state"]
        if client is not None:
            restored = client.restore(run, saved["checkpoint_id"])
            print(
                f"[resume] restored {saved['checkpoint_id']}: epoch {restored.epoch}, "
                f"{len(restored.tape)} recorded effect(s) on the replay tape"
            )

    state.update(agent_node(state))
    call = state["messages"][-1]["tool_calls"][0]
    print(f"[{phase}] model asked for {call['name']}({json.dumps(call['args'])})")
    state.update(tools_node(state, run))
    print(f"[{phase}] tool result: {json.dumps(state['messages'][-1]['content'])}")

    if phase == "first":
        print("[first] crashing before the framework saves the end of the turn")
        sys.stdout.flush()
        os._exit(CRASH_EXIT_CODE)

    if client is not None:
        step_key = f"{run.run_id}:turn-{state['turn']}/tools/0"
        receipt = client.query_outcome(run=run, step_key=step_key).receipt
        print(
            f"[resume] Fence receipt {receipt.effect_id}: {receipt.state.name}, "
            f"replayed {receipt.replays} time(s), bank API requests so far: {bank.requests()}"
        )

    state["turn"] += 1
    checkpointer.put(f"turn-{state['turn']}", state)
    if client is not None:
        client.checkpoint(run, f"turn-{state['turn']}")
        client.close()
    return 0


# ---------------------------------------------------------------------------------------------
# The driver: first process, crash, resume process, check the ledger.
# ---------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--no-fence", action="store_true", help="call the bank directly (pays twice)")
    parser.add_argument("--phase", choices=["first", "resume"], help=argparse.SUPPRESS)
    parser.add_argument("--workdir", help="where the ledger and checkpoints go (default: a temp dir)")
    args = parser.parse_args(argv)
    use_fence = not args.no_fence

    if args.phase:
        return agent_process(args.phase, Path(args.workdir), use_fence)

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="fence-example-"))
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "thread_id").write_text(f"thread-{uuid.uuid4()}")
    base = [sys.executable, os.path.abspath(__file__), "--workdir", str(workdir)]
    if not use_fence:
        base.append("--no-fence")

    first = subprocess.run([*base, "--phase", "first"])
    if first.returncode != CRASH_EXIT_CODE:
        print(f"the first process should have crashed with {CRASH_EXIT_CODE}, got {first.returncode}")
        return 2
    resume = subprocess.run([*base, "--phase", "resume"])
    if resume.returncode != 0:
        print(f"the resumed process failed ({resume.returncode})")
        return 2

    bank = BankApi(workdir / "bank-ledger.json")
    payments = bank.payments()
    print(f"bank ledger: {len(payments)} payment(s) from {bank.requests()} request(s): {json.dumps(payments)}")
    if len(payments) > 1:
        print("FAIL: the payment happened twice")
        return 1
    if len(payments) == 0:
        print("FAIL: the payment never happened")
        return 2
    if use_fence and bank.requests() != 1:
        print("FAIL: the regenerated call reached the bank again (Fence did not replay it)")
        return 1
    print("OK: paid exactly once; the restored agent's regenerated call was replayed by Fence")
    return 0


if __name__ == "__main__":
    sys.exit(main())
