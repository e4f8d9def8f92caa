"""The example bank on PostgreSQL, on the Python SDK's PostgreSQL participant
(``dtx.participant.postgres``): the same accounts, payloads and answers as
``examples/bank.py``, with the balances in a PostgreSQL table and the work
prepared by PostgreSQL itself.

The payload is ``account:delta`` items separated by ``;`` (``a3:-25``). A
Prepare locks the account rows (``SELECT ... FOR UPDATE NOWAIT``) and
updates them in the open transaction; ``PREPARE TRANSACTION`` keeps the
change and its row locks until the decision (``COMMIT PREPARED`` makes it
visible, ``ROLLBACK PREPARED`` drops it). An unknown account, one a
prepared transaction holds, or too little money votes NO (never a wait:
waiting on a prepared transaction's rows can deadlock across databases); a
payload whose every delta is 0 only reads: READ_ONLY.

The apply log: each Prepare that votes YES also inserts ``(tx, 'COMMIT')``
into ``bank_applog`` inside the transaction it prepares, so the row becomes
visible exactly when that transaction commits and never when it is rolled
back. The table has no unique key on purpose: a transaction applied twice
would show as two rows.

Commands::

    python examples/pg_bank.py serve --listen 127.0.0.1:7301 --id bank-a \\
        --postgres 'host=127.0.0.1 port=5432 user=bank dbname=bank_a' \\
        [--prefix a --accounts 10 --initial 1000] [--cluster 127.0.0.1:7201,...] [--ready-file F]
    python examples/pg_bank.py balance --postgres CONNINFO --account a0     # one number
    python examples/pg_bank.py audit --postgres CONNINFO                    # JSON

The accounts are created (``--accounts`` of ``--initial`` each) only when
the table does not exist yet: a restarted bank touches no row, since the
rows its prepared transactions hold stay locked until its own recovery
resolves them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
from pathlib import Path

try:
    import dtx  # noqa: F401
except ImportError:  # run from a checkout: sdk/python is the parent of examples/
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import psycopg

from dtx.participant import GlobalTxid, RecoveryOptions, Refuse, Vote, serve
from dtx.participant.postgres import PgOptions, PgParticipantStore, PgResource, PgTx, parse_gid

from bank import parse_work  # noqa: E402  (examples/bank.py: the same payloads)

ACCOUNTS = """CREATE TABLE IF NOT EXISTS bank_accounts (
    name text PRIMARY KEY,
    balance bigint NOT NULL CHECK (balance >= 0))"""
APPLOG = """CREATE TABLE IF NOT EXISTS bank_applog (
    tx text NOT NULL,
    outcome text NOT NULL)"""


class PgBank(PgResource):
    async def prepare(self, tx: PgTx, txid: GlobalTxid, payload: bytes) -> Vote:
        work = parse_work(payload)
        if work is None:
            raise Refuse(f"payload is not a list of account:change items separated by ';' ({len(payload)} bytes)")
        for name, delta in work:
            try:
                row = await tx.one("SELECT balance FROM bank_accounts WHERE name = %s FOR UPDATE NOWAIT", (name,))
            except psycopg.errors.LockNotAvailable:
                raise Refuse(f"account {name!r} is locked by another transfer in progress") from None
            if row is None:
                raise Refuse(f"no account {name!r} here")
            if row[0] + delta < 0:
                raise Refuse(f"account {name!r} has {row[0]}, too little for a change of {delta}")
            if delta:
                await tx.execute("UPDATE bank_accounts SET balance = balance + %s WHERE name = %s", (delta, name))
        if all(delta == 0 for _, delta in work):
            return Vote.READ_ONLY
        # Visible when (and only when) this transaction commits.
        await tx.execute("INSERT INTO bank_applog (tx, outcome) VALUES (%s, 'COMMIT')", (str(txid),))
        return Vote.YES


async def install(store: PgParticipantStore, prefix: str, accounts: int, initial: int) -> None:
    """The tables, and the accounts when the table is new (see the module doc)."""

    async def create(tx: PgTx) -> None:
        if (await tx.one("SELECT to_regclass('bank_applog') IS NOT NULL"))[0] is False:
            await tx.execute(APPLOG)
        if (await tx.one("SELECT to_regclass('bank_accounts') IS NOT NULL"))[0]:
            return
        await tx.execute(ACCOUNTS)
        await tx.executemany(
            "INSERT INTO bank_accounts (name, balance) VALUES (%s, %s)",
            [(f"{prefix}{i}", initial) for i in range(accounts)],
        )

    await store.write(create)


async def run_serve(a: argparse.Namespace) -> int:
    store = await PgParticipantStore.open(a.postgres, PgBank(), a.id, PgOptions(concurrency=a.concurrency))
    await install(store, a.prefix, a.accounts, a.initial)
    cluster = [c for c in (a.cluster or "").split(",") if c]
    server = await serve(store, a.id, a.listen, cluster, RecoveryOptions(interval_s=0.5))
    if a.ready_file:
        tmp = a.ready_file + ".tmp"
        Path(tmp).write_text(server.address + "\n")
        os.replace(tmp, a.ready_file)
    print(f"bank {a.id} serves on {server.address} (PostgreSQL {store.target})", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(1.0)
    await store.close()
    return 0


def run_balance(a: argparse.Namespace) -> int:
    with psycopg.connect(a.postgres, autocommit=True) as c:
        row = c.execute("SELECT balance FROM bank_accounts WHERE name = %s", (a.account,)).fetchone()
    if row is None:
        print(f"no account {a.account!r}", file=sys.stderr)
        return 1
    print(row[0])
    return 0


def audit(conninfo: str) -> dict[str, object]:
    """Balances, the accounts prepared transactions hold, the transactions
    prepared (in doubt) and the apply log. ``locks`` maps an account to the
    transaction whose prepared update holds its row (the row's ``xmax`` is
    that prepared transaction's xid)."""
    with psycopg.connect(conninfo) as c:
        c.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        with c.transaction():
            gids = c.execute(
                "SELECT gid, transaction::text FROM pg_prepared_xacts WHERE database = current_database()"
            ).fetchall()
            balances = dict(c.execute("SELECT name, balance FROM bank_accounts ORDER BY name").fetchall())
            held = c.execute(
                "SELECT a.name, p.gid FROM bank_accounts a JOIN pg_prepared_xacts p ON a.xmax = p.transaction"
                " WHERE p.database = current_database()"
            ).fetchall()
            applog: dict[str, list[str]] = {}
            for tx, outcome in c.execute("SELECT tx, outcome FROM bank_applog ORDER BY tx").fetchall():
                applog.setdefault(tx, []).append(outcome)

    def tx_of(gid: str) -> str:
        p = parse_gid(gid)
        return str(p[1]) if p is not None else gid

    pending = sorted(tx_of(g) for g, _ in gids)
    return {
        "total": sum(balances.values()),
        "balances": balances,
        "locks": {name: tx_of(gid) for name, gid in held},
        "pending": pending,
        "in_doubt": len(gids),
        "prepared": [{"gid": g, "tx": tx_of(g)} for g, _ in sorted(gids)],
        "applog": applog,
        "applied_twice": sorted(tx for tx, o in applog.items() if len(o) > 1),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pg_bank.py", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="serve one bank participant until SIGTERM")
    s.add_argument("--listen", required=True, help="host:port (port 0: any; see --ready-file)")
    s.add_argument("--id", required=True, help="participant id, as enlisted")
    s.add_argument("--postgres", required=True, help="libpq connection string of the bank's database")
    s.add_argument("--prefix", default="a", help="account name prefix (a -> a0, a1, ...)")
    s.add_argument("--accounts", type=int, default=10)
    s.add_argument("--initial", type=int, default=1000)
    s.add_argument("--cluster", default="", help="coordinator API addresses, comma-separated (recovery)")
    s.add_argument("--concurrency", type=int, default=8, help="Prepares at once (PostgreSQL connections)")
    s.add_argument("--ready-file", default="", help="write the bound host:port here once serving")
    s.add_argument("--log-level", default=os.environ.get("DTX_PY_LOG", "WARNING"))
    b = sub.add_parser("balance", help="print one account's committed balance")
    b.add_argument("--postgres", required=True)
    b.add_argument("--account", required=True)
    au = sub.add_parser("audit", help="print balances, held accounts, in-doubt transactions and apply log as JSON")
    au.add_argument("--postgres", required=True)
    a = p.parse_args(argv)
    if a.cmd == "serve":
        logging.basicConfig(level=a.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        return asyncio.run(run_serve(a))
    if a.cmd == "balance":
        return run_balance(a)
    print(json.dumps(audit(a.postgres), sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
