"""The example bank with its own API, ``bank.v1.Bank`` (the Rust bank's
``examples/bank/proto/bank/v1/bank.proto``), whose ``Change`` joins the
caller's transaction as a **branch** (docs/protocol.md, "Branches"): the
handler checks and prepares the change on the bank's SQLite store (the
accounts stay locked), registers the bank in the transaction with its
vote (``RegisterBranch``), and only then answers with the balances the
change leaves. The coordinator sends it no Prepare; the decision reaches
its participant service (``dtx.v1.ParticipantService``, on ``--listen``)
as any participant's, and recovery settles a branch whose registration is
not known.

The accounts, the payload format and the participant service are
``bank.py``'s (imported, not copied), so a bank serving branches is also
an ordinary participant: a client may enlist it with a payload in the same
transaction, or in another.

Commands::

    python examples/branch_bank.py serve --listen 127.0.0.1:7301 --app-listen 127.0.0.1:7311 \\
        --id bank-a --db bank-a.db --cluster 127.0.0.1:7201,127.0.0.1:7202 \\
        [--prefix a --accounts 10 --initial 1000] [--ready-file F]
    python examples/branch_bank.py balance --db bank-a.db --account a0     # one number
    python examples/branch_bank.py audit --db bank-a.db                    # JSON (with branch_marks)

With ``--postgres CONNINFO`` instead of ``--db`` (serve, balance, audit),
the bank is ``pg_bank.py``'s (accounts in PostgreSQL, the same resource
imported) and ``Change`` is a PostgreSQL branch
(:mod:`dtx.participant.pg_branch`): the change runs in a PostgreSQL
transaction bound to the txid, the mark is committed, then ``PREPARE
TRANSACTION``, then the registration.

A caller: ``Begin`` at the cluster, then ``bank.v1.Bank/Change`` at each
bank with ``x-dtx-txid`` and ``x-dtx-incarnation`` in the metadata
(``dtx.metadata.attach_txid(md, began.txid, began.incarnation)``), then
``Commit`` when every change answered, ``Abort`` otherwise.

Errors of ``Change`` (as the Rust bank's): INVALID_ARGUMENT (no
transaction in the metadata, or a bad change: nothing done);
FAILED_PRECONDITION (refused: too little money, an unknown account or one
held by another transaction; registered as a NO vote, so the transaction
aborts); ABORTED (the transaction no longer takes members, or this bank
was fenced out: the change was rolled back); ALREADY_EXISTS (this bank
already has work in the transaction); UNKNOWN (whether the registration
was recorded is not known: the caller should abort; recovery settles it);
UNAVAILABLE or INTERNAL (the store).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import re
import signal
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
try:
    import dtx  # noqa: F401
except ImportError:  # run from a checkout: sdk/python is the parent of examples/
    sys.path.insert(0, str(HERE.parent))
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import grpc  # noqa: E402
import grpc.aio  # noqa: E402

import bank  # noqa: E402  (examples/bank.py: the resource, accounts and audit)
import bank_api  # noqa: E402
from dtx.client import Client  # noqa: E402
from dtx.participant import RecoveryOptions, SqlTx, Vote, serve  # noqa: E402
from dtx.participant.branch import BranchError, BranchIdentity, join, transaction_of  # noqa: E402

pb, pb_grpc = bank_api.load()

#: Most changes one call may carry (the Rust bank's CHANGES_PER_CALL_MAX).
CHANGES_PER_CALL_MAX = 64
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def work_of(changes: Any) -> bytes:
    """The changes as the bank's prepared-work payload (``account:delta;``
    items, what ``bank.Bank.prepare`` reads); ValueError saying what is
    wrong with them."""
    if not changes:
        raise ValueError("no changes: give at least one account and delta")
    if len(changes) > CHANGES_PER_CALL_MAX:
        raise ValueError(f"{len(changes)} changes in one call; at most {CHANGES_PER_CALL_MAX}")
    seen: set[str] = set()
    out = []
    for c in changes:
        if not _NAME.match(c.account):
            raise ValueError(f"account name {c.account!r}: use 1 to 64 letters, digits, '-' or '_'")
        if c.delta == 0:
            raise ValueError(f"account {c.account!r}: a change of 0 changes nothing")
        if c.account in seen:
            raise ValueError(f"account {c.account!r} appears twice; give each account once")
        seen.add(c.account)
        out.append(f"{c.account}:{c.delta};")
    return "".join(out).encode()


async def _pg_balances(store: Any, names: list[str]) -> dict[str, int | None]:
    async def rd(tx: Any) -> dict[str, int | None]:
        rows = await tx.all("SELECT name, balance FROM bank_accounts WHERE name = ANY(%s)", (names,))
        found = {n: int(b) for n, b in rows}
        return {n: found.get(n) for n in names}

    return await store.read(rd)  # type: ignore[no-any-return]


def _balance(db: SqlTx, name: str) -> int | None:
    row = db.one("SELECT balance FROM bank_accounts WHERE name = ?", (name,))
    return None if row is None else int(row[0])


class BankApi(pb_grpc.BankServicer):  # type: ignore[misc,name-defined]
    """``bank.v1.Bank`` over a bank's store, which is participant ``who``
    and registers through ``client``."""

    def __init__(self, store: Any, client: Client, who: BranchIdentity, postgres: bool = False) -> None:
        self.store = store
        self.client = client
        self.who = who
        #: The store is a PgParticipantStore: Change is a PostgreSQL branch.
        self.postgres = postgres

    async def _join(self, txid: Any, work: bytes) -> Any:
        if not self.postgres:
            return await join(self.store, self.client, self.who, txid, work)
        from dtx.participant.pg_branch import run_branch

        resource = self.store.resource  # pg_bank.PgBank: the same checks as its Prepare
        return await run_branch(
            self.store, self.client, self.who, txid, lambda tx: resource.prepare(tx, txid, work)
        )

    async def _balances(self, names: list[str]) -> dict[str, int | None]:
        if self.postgres:
            return await _pg_balances(self.store, names)
        return await self.store.read(lambda db: {n: _balance(db, n) for n in names})  # type: ignore[no-any-return]

    async def Change(self, request: Any, context: grpc.aio.ServicerContext) -> Any:  # noqa: N802
        try:
            txid = transaction_of(context)
        except BranchError as e:
            await context.abort(e.code, str(e))
        try:
            work = work_of(list(request.changes))
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        try:
            joined = await self._join(txid, work)
        except BranchError as e:
            await context.abort(e.code, str(e))
        if joined.vote is not Vote.YES:
            # Registered as NO: the transaction aborts.
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"{self.who.participant_id} refused the change: {joined.reason or 'nothing to change'}",
            )
        # The accounts are held by the transaction until its decision: exact.
        names = [c.account for c in request.changes]
        now = await self._balances(names)
        return pb.ChangeReply(
            balances=[
                pb.AccountBalance(account=c.account, balance_if_committed=(now[c.account] or 0) + c.delta)
                for c in request.changes
            ]
        )

    async def Balances(self, request: Any, context: grpc.aio.ServicerContext) -> Any:  # noqa: N802
        accounts = list(request.accounts)
        if not accounts or len(accounts) > CHANGES_PER_CALL_MAX:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{len(accounts)} accounts asked; ask for 1 to {CHANGES_PER_CALL_MAX}",
            )
        found = await self._balances(accounts)
        for n in accounts:
            if found[n] is None:
                await context.abort(grpc.StatusCode.NOT_FOUND, f"no account {n!r} at {self.who.participant_id}")
        return pb.BalancesReply(balances=[pb.CommittedBalance(account=n, balance=found[n]) for n in accounts])


async def run_serve(a: argparse.Namespace) -> int:
    cluster = [c for c in (a.cluster or "").split(",") if c]
    if not cluster:
        print("Error: --cluster is needed: a branch registers itself with the cluster", file=sys.stderr)
        return 2
    if a.postgres:
        import pg_bank
        from dtx.participant.postgres import PgOptions, PgParticipantStore

        store: Any = await PgParticipantStore.open(a.postgres, pg_bank.PgBank(), a.id, PgOptions())
        await pg_bank.install(store, a.prefix, a.accounts, a.initial)
    else:
        store = await bank.open_bank(a.db, a.id, a.prefix, a.accounts, a.initial, a.journal_mode)
    server = await serve(store, a.id, a.listen, cluster, RecoveryOptions(interval_s=0.5))
    client = Client(cluster, deadline_s=a.register_deadline_s, attempt_timeout_s=min(2.0, a.register_deadline_s))
    app = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    pb_grpc.add_BankServicer_to_server(
        BankApi(store, client, BranchIdentity(a.id, server.address), postgres=bool(a.postgres)), app
    )
    port = app.add_insecure_port(a.app_listen)
    if port == 0:
        raise OSError(f"cannot listen on {a.app_listen}")
    await app.start()
    app_addr = f"{a.app_listen.rsplit(':', 1)[0]}:{port}"
    if a.ready_file:
        tmp = a.ready_file + ".tmp"
        Path(tmp).write_text(f"{server.address}\n{app_addr}\n")
        os.replace(tmp, a.ready_file)
    where = f"PostgreSQL {store.target}" if a.postgres else f"db {a.db}"
    print(f"bank {a.id} serves on {server.address}, bank.v1.Bank on {app_addr} ({where})", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    stopped = asyncio.create_task(store.stopped())
    waiter = asyncio.create_task(stop.wait())
    await asyncio.wait({stopped, waiter}, return_when=asyncio.FIRST_COMPLETED)
    for t in (stopped, waiter):
        t.cancel()
    await asyncio.gather(stopped, waiter, return_exceptions=True)
    await app.stop(1.0)
    await server.stop(1.0)
    await client.close()
    failure = store.failure()
    if a.postgres:
        await store.close()
    else:
        store.close()
    if failure is not None:
        print(f"Error: {failure}", file=sys.stderr, flush=True)
        return 1
    return 0


def pg_audit(conninfo: str) -> dict[str, object]:
    """``pg_bank.audit`` and the branch marks (``dtx_participant_branch``)."""
    import pg_bank
    import psycopg

    out = pg_bank.audit(conninfo)
    with psycopg.connect(conninfo, autocommit=True) as c:
        try:
            marks = c.execute("SELECT count(*) FROM dtx_participant_branch").fetchone()[0]  # type: ignore[index]
        except psycopg.errors.UndefinedTable:
            marks = 0
    out["branch_marks"] = marks
    return out


def audit(db: str) -> dict[str, object]:
    """``bank.audit`` and the branch marks (registrations not known)."""
    out = bank.audit(db)
    conn = bank._read(db)
    try:
        marks = conn.execute("SELECT COUNT(*) FROM dtx_branch_mark").fetchone()[0]
    except Exception:  # noqa: BLE001 - a store opened before branches existed
        marks = 0
    out["branch_marks"] = marks
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="branch_bank.py", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="serve one bank (participant service and bank.v1.Bank) until SIGTERM")
    s.add_argument("--listen", required=True, help="the participant service's host:port (the cluster calls it)")
    s.add_argument("--app-listen", required=True, help="bank.v1.Bank's host:port (callers call it)")
    s.add_argument("--id", required=True, help="participant id, as registered")
    where = s.add_mutually_exclusive_group(required=True)
    where.add_argument("--db", help="the SQLite file (accounts and participant log)")
    where.add_argument("--postgres", help="libpq connection string: the bank on PostgreSQL (pg_bank.py's)")
    s.add_argument("--prefix", default="a", help="account name prefix (a -> a0, a1, ...)")
    s.add_argument("--accounts", type=int, default=10)
    s.add_argument("--initial", type=int, default=1000)
    s.add_argument("--cluster", default="", help="coordinator API addresses, comma-separated (registration, recovery)")
    s.add_argument("--register-deadline-s", type=float, default=8.0, help="one registration's budget, retries included")
    s.add_argument("--ready-file", default="", help="write the bound addresses here once serving (two lines)")
    s.add_argument("--journal-mode", choices=["wal", "delete"], default="wal")
    s.add_argument("--log-level", default=os.environ.get("DTX_PY_LOG", "WARNING"))
    b = sub.add_parser("balance", help="print one account's committed balance")
    bw = b.add_mutually_exclusive_group(required=True)
    bw.add_argument("--db")
    bw.add_argument("--postgres")
    b.add_argument("--account", required=True)
    au = sub.add_parser("audit", help="print balances, locks, in-doubt count, branch marks and apply log as JSON")
    aw = au.add_mutually_exclusive_group(required=True)
    aw.add_argument("--db")
    aw.add_argument("--postgres")
    a = p.parse_args(argv)
    if a.cmd == "serve":
        logging.basicConfig(level=a.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        return asyncio.run(run_serve(a))
    if a.cmd == "balance":
        if a.postgres:
            import pg_bank

            return pg_bank.run_balance(a)
        return bank.run_balance(a)
    print(json.dumps(pg_audit(a.postgres) if a.postgres else audit(a.db), sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
