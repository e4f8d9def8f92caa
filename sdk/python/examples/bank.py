"""The example bank on the Python participant SDK: accounts in the same
SQLite file as the participant log, moved under two-phase commit.

The payload of a participant's work is ``account:delta`` items separated by
``;`` (``a3:-25``), as the Rust bank's (examples/bank/src/lib.rs). Accounts
touched by a prepared transaction stay locked until the decision; a Prepare
that finds a locked account, an unknown one or too little money votes NO
(conflicting transfers abort instead of waiting). A payload whose every
delta is 0 only reads (the accounts exist and are not locked): it votes
READ_ONLY.

Commands::

    python examples/bank.py serve --listen 127.0.0.1:7301 --id bank-a --db bank-a.db \\
        [--prefix a --accounts 10 --initial 1000] [--cluster 127.0.0.1:7201,...] [--ready-file F]
    python examples/bank.py balance --db bank-a.db --account a0     # one number
    python examples/bank.py audit --db bank-a.db                    # JSON

``balance`` and ``audit`` read the file while the service runs (SQLite's
WAL lets readers in beside the writer).
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

from dtx.participant import (
    GlobalTxid,
    ParticipantStore,
    RecoveryOptions,
    Refuse,
    Resource,
    SqlTx,
    Vote,
    serve,
)


def parse_work(payload: bytes) -> list[tuple[str, int]] | None:
    """``account:delta;...`` as pairs; None when malformed."""
    try:
        text = payload.decode("utf-8")
    except UnicodeDecodeError:
        return None
    out = []
    for item in text.split(";"):
        if not item:
            continue
        name, sep, delta = item.partition(":")
        if not sep or not name:
            return None
        try:
            out.append((name, int(delta)))
        except ValueError:
            return None
    return out


class Bank(Resource):
    """Accounts (``bank_accounts``), the locks of prepared work
    (``bank_locks``), the prepared work itself (``bank_pending``) and the
    apply log (``bank_applog``: one row per decision applied to a
    transaction's work, written with the work, so a second apply would show
    as a second row)."""

    def setup(self, db: SqlTx) -> None:
        db.execute("CREATE TABLE IF NOT EXISTS bank_accounts (name TEXT PRIMARY KEY, balance INTEGER NOT NULL)")
        db.execute("CREATE TABLE IF NOT EXISTS bank_locks (name TEXT PRIMARY KEY, holder TEXT NOT NULL)")
        db.execute("CREATE TABLE IF NOT EXISTS bank_pending (tx TEXT PRIMARY KEY, payload BLOB NOT NULL)")
        db.execute(
            "CREATE TABLE IF NOT EXISTS bank_applog ("
            " tx TEXT NOT NULL, n INTEGER NOT NULL, outcome TEXT NOT NULL, PRIMARY KEY (tx, n))"
        )

    def prepare(self, db: SqlTx, txid: GlobalTxid, payload: bytes) -> Vote:
        work = parse_work(payload)
        if work is None:
            raise Refuse(f"payload is not a list of account:change items separated by ';' ({len(payload)} bytes)")
        tx = str(txid)
        for name, delta in work:
            row = db.one("SELECT balance FROM bank_accounts WHERE name = ?", (name,))
            if row is None:
                raise Refuse(f"no account {name!r} here")
            holder = db.one("SELECT holder FROM bank_locks WHERE name = ?", (name,))
            if holder is not None and holder[0] != tx:
                raise Refuse(f"account {name!r} is locked by prepared transaction {holder[0]}")
            if row[0] + delta < 0:
                raise Refuse(f"account {name!r} has {row[0]}, too little for a change of {delta}")
        if all(delta == 0 for _, delta in work):
            return Vote.READ_ONLY
        for name, _ in work:
            db.execute("INSERT OR REPLACE INTO bank_locks (name, holder) VALUES (?, ?)", (name, tx))
        db.execute("INSERT OR REPLACE INTO bank_pending (tx, payload) VALUES (?, ?)", (tx, payload))
        return Vote.YES

    def _pending(self, db: SqlTx, tx: str) -> list[tuple[str, int]]:
        row = db.one("SELECT payload FROM bank_pending WHERE tx = ?", (tx,))
        return (parse_work(row[0]) or []) if row is not None else []

    def _log_apply(self, db: SqlTx, tx: str, outcome: str) -> None:
        n = db.one("SELECT COUNT(*) FROM bank_applog WHERE tx = ?", (tx,))[0]
        db.execute("INSERT INTO bank_applog (tx, n, outcome) VALUES (?, ?, ?)", (tx, n, outcome))

    def commit(self, db: SqlTx, txid: GlobalTxid) -> None:
        tx = str(txid)
        for name, delta in self._pending(db, tx):
            db.execute("UPDATE bank_accounts SET balance = balance + ? WHERE name = ?", (delta, name))
            db.execute("DELETE FROM bank_locks WHERE name = ? AND holder = ?", (name, tx))
        db.execute("DELETE FROM bank_pending WHERE tx = ?", (tx,))
        self._log_apply(db, tx, "COMMIT")

    def abort(self, db: SqlTx, txid: GlobalTxid) -> None:
        tx = str(txid)
        for name, _ in self._pending(db, tx):
            db.execute("DELETE FROM bank_locks WHERE name = ? AND holder = ?", (name, tx))
        db.execute("DELETE FROM bank_pending WHERE tx = ?", (tx,))
        self._log_apply(db, tx, "ABORT")


async def open_bank(
    db: str, participant_id: str, prefix: str, accounts: int, initial: int, journal_mode: str = "wal"
) -> ParticipantStore:
    """Opens the bank's store, creating the accounts the first time."""
    store = ParticipantStore(db, Bank(), participant_id, journal_mode=journal_mode)

    def create(tx: SqlTx) -> None:
        if tx.one("SELECT COUNT(*) FROM bank_accounts")[0] == 0:
            tx.executemany(
                "INSERT INTO bank_accounts (name, balance) VALUES (?, ?)",
                [(f"{prefix}{i}", initial) for i in range(accounts)],
            )

    await store.write(create)
    return store


async def run_serve(a: argparse.Namespace) -> int:
    store = await open_bank(a.db, a.id, a.prefix, a.accounts, a.initial, a.journal_mode)
    cluster = [c for c in (a.cluster or "").split(",") if c]
    server = await serve(
        store,
        a.id,
        a.listen,
        cluster,
        RecoveryOptions(interval_s=0.5),
    )
    if a.ready_file:
        tmp = a.ready_file + ".tmp"
        Path(tmp).write_text(server.address + "\n")
        os.replace(tmp, a.ready_file)
    print(f"bank {a.id} serves on {server.address} (db {a.db})", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    stopped = asyncio.create_task(store.stopped())
    waiter = asyncio.create_task(stop.wait())
    await asyncio.wait({stopped, waiter}, return_when=asyncio.FIRST_COMPLETED)
    await server.stop(1.0)
    failure = store.failure()
    store.close()
    if failure is not None:
        print(f"Error: {failure}", file=sys.stderr, flush=True)
        return 1
    return 0


def _read(db: str) -> sqlite3.Connection:
    if not Path(db).exists():
        raise SystemExit(f"no bank database at {db}")
    conn = sqlite3.connect(db, timeout=5.0)
    conn.execute("PRAGMA busy_timeout=5000")
    return conn


def run_balance(a: argparse.Namespace) -> int:
    conn = _read(a.db)
    row = conn.execute("SELECT balance FROM bank_accounts WHERE name = ?", (a.account,)).fetchone()
    if row is None:
        print(f"no account {a.account!r} in {a.db}", file=sys.stderr)
        return 1
    print(row[0])
    return 0


def audit(db: str) -> dict[str, object]:
    """Balances, locks, pending work, in-doubt records and the apply log."""
    conn = _read(db)
    conn.execute("BEGIN")  # one snapshot
    balances = dict(conn.execute("SELECT name, balance FROM bank_accounts ORDER BY name").fetchall())
    locks = dict(conn.execute("SELECT name, holder FROM bank_locks").fetchall())
    prepared = conn.execute("SELECT tx, payload FROM bank_pending ORDER BY tx").fetchall()
    pending = [r[0] for r in prepared]
    in_doubt = conn.execute("SELECT COUNT(*) FROM dtx_log WHERE state = 2").fetchone()[0]
    applog: dict[str, list[str]] = {}
    for tx, outcome in conn.execute("SELECT tx, outcome FROM bank_applog ORDER BY tx, n").fetchall():
        applog.setdefault(tx, []).append(outcome)
    conn.execute("COMMIT")
    return {
        "total": sum(balances.values()),
        "balances": balances,
        "locks": locks,
        "pending": pending,
        "in_doubt": in_doubt,
        "applog": applog,
        "applied_twice": sorted(tx for tx, o in applog.items() if len(o) > 1),
        # The work each prepared transaction holds (its accounts locked),
        # as the payload text: what a checker needs of an in-doubt entry.
        "prepared": [{"tx": tx, "work": bytes(payload).decode("utf-8", "replace")} for tx, payload in prepared],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bank.py", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="serve one bank participant until SIGTERM")
    s.add_argument("--listen", required=True, help="host:port (port 0: any; see --ready-file)")
    s.add_argument("--id", required=True, help="participant id, as enlisted")
    s.add_argument("--db", required=True, help="the SQLite file (accounts and participant log)")
    s.add_argument("--prefix", default="a", help="account name prefix (a -> a0, a1, ...)")
    s.add_argument("--accounts", type=int, default=10)
    s.add_argument("--initial", type=int, default=1000)
    s.add_argument("--cluster", default="", help="coordinator API addresses, comma-separated (recovery)")
    s.add_argument("--ready-file", default="", help="write the bound host:port here once serving")
    s.add_argument(
        "--journal-mode",
        choices=["wal", "delete"],
        default="wal",
        help="SQLite's journal: wal, or delete on a filesystem that cannot map shared memory (FUSE with direct I/O)",
    )
    s.add_argument("--log-level", default=os.environ.get("DTX_PY_LOG", "WARNING"))
    b = sub.add_parser("balance", help="print one account's committed balance")
    b.add_argument("--db", required=True)
    b.add_argument("--account", required=True)
    au = sub.add_parser("audit", help="print balances, locks, in-doubt count and apply log as JSON")
    au.add_argument("--db", required=True)
    a = p.parse_args(argv)
    if a.cmd == "serve":
        logging.basicConfig(level=a.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        return asyncio.run(run_serve(a))
    if a.cmd == "balance":
        return run_balance(a)
    print(json.dumps(audit(a.db), sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
