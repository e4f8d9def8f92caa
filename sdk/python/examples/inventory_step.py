"""An example saga step service on the Python SDK (``dtx.saga``): an
inventory whose forward action ``reserve`` takes stock for an order and
whose compensation ``release`` gives it back, with the inbox in the same
SQLite file as the stock.

Input (JSON): ``{"order": "o-1", "sku": "sku-0", "qty": 2}`` (other keys are
ignored). ``reserve`` answers FAILED for an unknown SKU, a quantity below 1
or too little stock; OK with the reservation's version (``held:<operation
id>``) as the resource version. ``release`` checks the precondition against
the reservation's current version (STALE when it moved on), puts the stock
back and answers OK with the version ``released:<operation id>``. The status
query is ``reservation``.

Commands::

    python examples/inventory_step.py serve --listen 127.0.0.1:7401 --db inv.db [--skus 10 --stock 1000]
    python examples/inventory_step.py stock --db inv.db --sku sku-0      # one number
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sqlite3
import sys
from pathlib import Path

try:
    import dtx  # noqa: F401
except ImportError:  # run from a checkout: sdk/python is the parent of examples/
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dtx.participant import SqlTx
from dtx.saga import StepCall, StepHandler, StepResult, StepStore, serve_steps


def parse(call: StepCall) -> tuple[str, str, int] | str:
    """(order, sku, qty), or why the input is not one."""
    try:
        d = json.loads(call.input.decode("utf-8"))
        return str(d["order"]), str(d["sku"]), int(d["qty"])
    except (UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
        return f"the input is not {{order, sku, qty}} JSON: {e}"


class Inventory(StepHandler):
    def setup(self, db: SqlTx) -> None:
        db.execute("CREATE TABLE IF NOT EXISTS inv_stock (sku TEXT PRIMARY KEY, qty INTEGER NOT NULL)")
        db.execute(
            "CREATE TABLE IF NOT EXISTS inv_reservations ("
            " op TEXT PRIMARY KEY, order_id TEXT NOT NULL, sku TEXT NOT NULL, qty INTEGER NOT NULL,"
            " version TEXT NOT NULL)"
        )

    def knows_query(self, query: str) -> bool:
        return query == "reservation"

    def forward(self, db: SqlTx, call: StepCall) -> StepResult:
        if call.action != "reserve":
            return StepResult.failed(f"no forward action {call.action!r} here")
        p = parse(call)
        if isinstance(p, str):
            return StepResult.failed(p)
        order, sku, qty = p
        if qty < 1:
            return StepResult.failed(f"cannot reserve {qty} of {sku}")
        row = db.one("SELECT qty FROM inv_stock WHERE sku = ?", (sku,))
        if row is None:
            return StepResult.failed(f"no SKU {sku!r} here")
        if row[0] < qty:
            return StepResult.failed(f"{sku} has {row[0]} in stock, fewer than {qty}")
        version = f"held:{call.operation_id}"
        db.execute("UPDATE inv_stock SET qty = qty - ? WHERE sku = ?", (qty, sku))
        db.execute(
            "INSERT INTO inv_reservations (op, order_id, sku, qty, version) VALUES (?, ?, ?, ?, ?)",
            (call.operation_id, order, sku, qty, version),
        )
        return StepResult.ok(resource_version=version, output=json.dumps({"reserved": qty, "sku": sku}).encode())

    def compensate(self, db: SqlTx, call: StepCall) -> StepResult:
        if call.action != "release":
            return StepResult.failed(f"no compensation {call.action!r} here")
        row = db.one("SELECT sku, qty, version FROM inv_reservations WHERE op = ?", (call.forward_operation_id,))
        if row is None:
            return StepResult.noop(f"no reservation by {call.forward_operation_id!r} here")
        sku, qty, version = row
        stale = call.check_precondition(version)
        if stale is not None:
            return stale
        if version.startswith("released:"):
            return StepResult.ok(resource_version=version)
        released = f"released:{call.operation_id}"
        db.execute("UPDATE inv_stock SET qty = qty + ? WHERE sku = ?", (qty, sku))
        db.execute("UPDATE inv_reservations SET version = ? WHERE op = ?", (released, call.forward_operation_id))
        return StepResult.ok(resource_version=released)


async def run_serve(a: argparse.Namespace) -> int:
    store = StepStore(a.db, Inventory())

    def stock(tx: SqlTx) -> None:
        if tx.one("SELECT COUNT(*) FROM inv_stock")[0] == 0:
            tx.executemany("INSERT INTO inv_stock VALUES (?, ?)", [(f"sku-{i}", a.stock) for i in range(a.skus)])

    await store.write(stock)
    server = await serve_steps(store, a.listen)
    if a.ready_file:
        Path(a.ready_file + ".tmp").write_text(server.address + "\n")
        os.replace(a.ready_file + ".tmp", a.ready_file)
    print(f"inventory step service serves on {server.address} (db {a.db})", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(1.0)
    store.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="inventory_step.py", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="serve the step service until SIGTERM")
    s.add_argument("--listen", required=True)
    s.add_argument("--db", required=True)
    s.add_argument("--skus", type=int, default=10)
    s.add_argument("--stock", type=int, default=1000)
    s.add_argument("--ready-file", default="")
    s.add_argument("--log-level", default=os.environ.get("DTX_PY_LOG", "WARNING"))
    st = sub.add_parser("stock", help="print one SKU's stock")
    st.add_argument("--db", required=True)
    st.add_argument("--sku", required=True)
    a = p.parse_args(argv)
    if a.cmd == "serve":
        logging.basicConfig(level=a.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        return asyncio.run(run_serve(a))
    conn = sqlite3.connect(a.db, timeout=5.0)
    row = conn.execute("SELECT qty FROM inv_stock WHERE sku = ?", (a.sku,)).fetchone()
    if row is None:
        print(f"no SKU {a.sku!r}", file=sys.stderr)
        return 1
    print(row[0])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
