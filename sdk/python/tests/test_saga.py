"""The saga step service helper (``dtx.saga``): the inbox's rules on the
store (once per operation id with the business writes, fingerprints, NOOP
compensations that fence their forward operation, STALE changing nothing,
Fence, a failing handler recording nothing), the wire codes, and the
conformance kit's step rules (``dtx-dev conformance step-service``)
against the example inventory (``examples/inventory_step.py``) as a real
process the kit starts and kills with SIGKILL: every rule passes."""

from __future__ import annotations

import json
import os
import shlex
import sqlite3
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import grpc.aio
import pytest

from dtx._pb import saga_pb2 as spb
from dtx._pb import saga_pb2_grpc as sgrpc
from dtx.participant import SqlTx
from dtx.saga import (
    FENCED_REASON,
    Conflict,
    InvalidCall,
    Outcome,
    StepCall,
    StepHandler,
    StepResult,
    StepStore,
    serve_steps,
)
from harness import LOOPBACK, SDK_DIR, ensure_binaries, free_port

INVENTORY = SDK_DIR / "examples" / "inventory_step.py"
sys.path.insert(0, str(SDK_DIR / "examples"))
from inventory_step import Inventory  # noqa: E402


class Boom(Inventory):
    """The inventory, whose ``explode`` action writes and then raises."""

    def forward(self, db: SqlTx, call: StepCall) -> StepResult:
        if call.action == "explode":
            db.execute("UPDATE inv_stock SET qty = 0")
            raise RuntimeError("boom")
        return super().forward(db, call)


def call(op: str, qty: int = 1, fp: str = "fp-1", action: str = "reserve", **kw: str) -> StepCall:
    return StepCall(
        saga_id=7,
        step=1,
        operation_id=op,
        action=action,
        input=json.dumps({"order": "o-1", "sku": "sku-0", "qty": qty}).encode(),
        fingerprint=fp,
        **kw,  # type: ignore[arg-type]
    )


def release(op: str, forward_op: str, precondition: str = "") -> StepCall:
    return call(op, action="release", forward_operation_id=forward_op, precondition=precondition)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[StepStore]:
    s = StepStore(tmp_path / "inv.db", Boom())
    s._pool.submit(
        lambda: s._db.execute("INSERT INTO inv_stock VALUES ('sku-0', 10)")  # type: ignore[func-returns-value]
    ).result()
    yield s
    s.close()


def stock(store: StepStore) -> int:
    conn = sqlite3.connect(store.path)
    try:
        return int(conn.execute("SELECT qty FROM inv_stock WHERE sku = 'sku-0'").fetchone()[0])
    finally:
        conn.close()


async def test_a_forward_runs_once_per_operation_id_and_fingerprints_guard_it(store: StepStore) -> None:
    first = await store.forward(call("1.1.f", 3))
    assert first.outcome is Outcome.OK and first.resource_version == "held:1.1.f"
    assert first.downstream_operation_id == "1.1.f" and json.loads(first.output) == {"reserved": 3, "sku": "sku-0"}
    assert await store.forward(call("1.1.f", 3)) == first
    assert await store.forward(call("1.1.f", 5, fp="")) == first  # no fingerprint: the stored reply
    assert stock(store) == 7
    with pytest.raises(Conflict, match="fingerprint"):
        await store.forward(call("1.1.f", 3, fp="fp-2"))
    with pytest.raises(Conflict, match="was a forward call here"):
        await store.compensate(release("1.1.f", "1.1.f"))
    with pytest.raises(InvalidCall):
        await store.forward(call(""))
    with pytest.raises(InvalidCall):
        await store.compensate(release("1.1.c", ""))
    # A FAILED forward keeps no writes and answers FAILED again.
    failed = await store.forward(call("2.1.f", 100))
    assert failed.outcome is Outcome.FAILED
    assert await store.forward(call("2.1.f", 1)) == failed
    assert stock(store) == 7


async def test_compensations_noop_fence_and_stale(store: StepStore) -> None:
    # Never ran: NOOP, and the forward operation is fenced.
    noop = await store.compensate(release("3.1.c", "3.1.f"))
    assert noop.outcome is Outcome.NOOP
    late = await store.forward(call("3.1.f"))
    assert late.outcome is Outcome.FAILED and late.reason == FENCED_REASON
    assert stock(store) == 10
    # STALE changes nothing; the right version undoes it, once.
    done = await store.forward(call("4.1.f", 4))
    stale = await store.compensate(release("4.1.c1", "4.1.f", "held:other"))
    assert stale.outcome is Outcome.STALE and stock(store) == 6
    undone = await store.compensate(release("4.1.c2", "4.1.f", done.resource_version))
    assert undone.outcome is Outcome.OK and stock(store) == 10
    assert await store.compensate(release("4.1.c2", "4.1.f", done.resource_version)) == undone
    assert stock(store) == 10
    # Fence of an unseen operation: not applied, then FAILED for good.
    assert await store.fence("5.1.f") is None
    rec = await store.status("5.1.f")
    assert rec is not None and rec.result.outcome is Outcome.FAILED
    assert (await store.forward(call("5.1.f"))).outcome is Outcome.FAILED
    assert await store.status("6.1.f") is None and await store.status("6.1.f") is None


async def test_a_failing_handler_records_nothing_and_changes_nothing(store: StepStore) -> None:
    with pytest.raises(RuntimeError, match="boom"):
        await store.forward(call("8.1.f", action="explode"))
    assert await store.status("8.1.f") is None
    assert stock(store) == 10
    assert (await store.forward(call("8.1.f"))).outcome is Outcome.OK


async def test_the_wire_codes(tmp_path: Path) -> None:
    s = StepStore(tmp_path / "w.db", Inventory())
    server = await serve_steps(s, "127.0.0.1:0")
    ch = grpc.aio.insecure_channel(server.address)
    try:
        stub = sgrpc.SagaStepServiceStub(ch)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.Forward(spb.StepCall(operation_id="", action="reserve"))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.Status(spb.StepStatusRequest(operation_id="1.1.f", query="nope"))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        r = await stub.Forward(spb.StepCall(operation_id="1.1.f", action="reserve", input=b"{}", fingerprint="a"))
        assert r.outcome == spb.STEP_OUTCOME_FAILED
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.Forward(spb.StepCall(operation_id="1.1.f", action="reserve", fingerprint="b"))
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        st = await stub.Status(spb.StepStatusRequest(operation_id="1.1.f", query="reservation"))
        assert st.applied and st.reply.outcome == spb.STEP_OUTCOME_FAILED
    finally:
        await ch.close()
        await server.stop(0)
        s.close()


def test_the_inventory_step_service_passes_every_step_rule_across_kill_9(tmp_path: Path) -> None:
    exe = ensure_binaries()
    addr = f"{LOOPBACK}:{free_port()}"
    db = tmp_path / "inv.db"
    start = (
        f"PYTHONPATH={shlex.quote(str(SDK_DIR))} exec {shlex.quote(sys.executable)} {shlex.quote(str(INVENTORY))} "
        f"serve --listen {addr} --db {shlex.quote(str(db))}"
    )
    p = subprocess.run(
        [
            str(exe),
            "conformance",
            "step-service",
            "--address",
            addr,
            "--forward-action",
            "reserve",
            "--compensate-action",
            "release",
            "--status-query",
            "reservation",
            "--input",
            '{"order":"kit-{saga}","sku":"sku-0","qty":1}',
            "--failed-input",
            '{"order":"kit-{saga}","sku":"sku-0","qty":1000000}',
            "--versioned",
            "--start",
            start,
            "--start-log",
            str(tmp_path / "started.log"),
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "RUST_LOG": "warn"},
    )
    try:
        report = json.loads(p.stdout)
    except json.JSONDecodeError:
        raise AssertionError(f"the kit printed no JSON (exit {p.returncode}):\n{p.stdout}\n{p.stderr}") from None
    rules = {r["id"]: r["verdict"] for r in report["rules"]}
    bad = [r for r in report["rules"] if r["verdict"] != "passed"]
    assert bad == [], json.dumps(bad, indent=1)[:20000]
    assert len(rules) == 17 and sum(k.startswith("step.crash.") for k in rules) == 4, rules
    assert p.returncode == 0, p.stderr
