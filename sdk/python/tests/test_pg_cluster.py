"""End to end with a Python bank on PostgreSQL (``examples/pg_bank.py``) and
a Python bank on SQLite (``examples/bank.py``) in the same transfers, on a
real three-node cluster (``dtx-dev serve`` processes), through the Python
client: the leader killed with SIGKILL mid-run, and the PostgreSQL bank
killed with SIGKILL mid-run (its prepared transactions stay in PostgreSQL)
and restarted. Then every outcome is known (UNKNOWN answers settled by
reading the decision), each bank applied exactly the committed transfers
once, money is conserved, nothing is prepared or held at either bank and
every participant's ack is recorded at the cluster. Skipped without
``DTX_TEST_POSTGRES`` unless ``DTX_REQUIRE_POSTGRES=1`` (tests/pg.py)."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

from dtx.client import Client, Outcome, ParticipantSpec
from harness import BankProc, Cluster, PgBankProc
from pg import query
from test_cluster import (
    ACCOUNTS,
    COMMITS_IN_FLIGHT,
    INITIAL,
    Transfer,
    begin_and_commit,
    check_the_end,
    run_transfers,
    summary,
    wait_count,
)


def two_banks(tmp_path: Path, cluster: Cluster, pg_db: str) -> tuple[PgBankProc, BankProc]:
    a = PgBankProc(tmp_path, "py-pg-bank-a", "a", cluster.api_addrs, ACCOUNTS, INITIAL, postgres=pg_db)
    b = BankProc(tmp_path, "py-bank-b", "b", cluster.api_addrs, ACCOUNTS, INITIAL)
    return a, b


async def test_transfers_between_a_postgresql_and_a_sqlite_bank_survive_a_leader_kill(
    cluster: Cluster, banks: list[BankProc], tmp_path: Path, pg_db: str
) -> None:
    cluster.wait_leader(60)
    a, b = two_banks(tmp_path, cluster, pg_db)
    banks += [a, b]
    a.start()
    b.start()
    killed: list[int] = []
    ended_at_kill = 0

    async def kill_the_leader(done: list[Transfer]) -> None:
        nonlocal ended_at_kill
        await wait_count(done, 12)
        leader = await asyncio.to_thread(cluster.wait_leader, 60)
        until = time.monotonic() + 10
        while COMMITS_IN_FLIGHT[0] == 0 and time.monotonic() < until:
            await asyncio.sleep(0.001)
        cluster.kill9(leader)
        killed.append(leader)
        ended_at_kill = len(done)

    async with Client(cluster.api_addrs, deadline_s=20) as client:
        transfers = await run_transfers(client, a, b, workers=4, each=10, tag="pgkill", fault=kill_the_leader)
        summary(f"leader {killed[0] if killed else None} killed after {ended_at_kill} transfers", transfers)
        assert killed, "the leader was killed during the run"
        assert cluster.wait_leader(60) != killed[0]
        assert sum(t.outcome is Outcome.COMMITTED for t in transfers) >= 10, [(t.key, t.outcome) for t in transfers]
        assert len(transfers) - ended_at_kill >= 10, "transfers went on after the kill"
        # One-phase commits at the PostgreSQL bank alone.
        for i in range(3):
            payload = f"a{i}:-7;a{i + 5}:7"
            one = await begin_and_commit(client, f"pg-one-{i}", [ParticipantSpec(a.id, a.addr, payload.encode())])
            assert one.txid is not None and one.outcome is Outcome.COMMITTED, one
            st = await client.status(one.txid)
            assert st.one_phase and st.decision is Outcome.COMMITTED
            transfers.append(Transfer(f"pg-one-{i}", one.txid, st.incarnation, {a.id: payload}, one.outcome, one.outcome))
        await check_the_end(client, {a.id: a, b.id: b}, transfers)


async def test_the_postgresql_bank_killed_mid_run_comes_back_with_its_prepared_transactions(
    cluster: Cluster, banks: list[BankProc], tmp_path: Path, pg_db: str
) -> None:
    cluster.wait_leader(60)
    a, b = two_banks(tmp_path, cluster, pg_db)
    banks += [a, b]
    a.start()
    b.start()
    held_at_kill: list[int] = []

    def prepared_now() -> int:
        return int(query(pg_db, "SELECT count(*) FROM pg_prepared_xacts WHERE database = current_database()")[0][0])

    def stop_holding_prepared() -> int:
        """Stops the bank (SIGSTOP) at a moment it holds a prepared
        transaction; returns how many it holds then."""
        assert a.proc is not None
        until = time.monotonic() + 30
        while time.monotonic() < until:
            if prepared_now() == 0:
                time.sleep(0.001)
                continue
            a.proc.send_signal(signal.SIGSTOP)
            n = prepared_now()
            if n > 0:
                return n
            a.proc.send_signal(signal.SIGCONT)  # decided meanwhile: again
        raise AssertionError("the PostgreSQL bank never held a prepared transaction for long enough")

    async def kill_the_pg_bank(done: list[Transfer]) -> None:
        await wait_count(done, 8)
        held_at_kill.append(await asyncio.to_thread(stop_holding_prepared))
        a.kill9()
        await asyncio.sleep(1.0)
        # The same address and database: what it prepared is in PostgreSQL.
        await asyncio.to_thread(a.start)

    async with Client(cluster.api_addrs, deadline_s=20) as client:
        transfers = await run_transfers(client, a, b, workers=3, each=8, tag="pgbank", fault=kill_the_pg_bank)
        summary(f"PostgreSQL bank killed with {held_at_kill} prepared, and restarted", transfers)
        assert held_at_kill and held_at_kill[0] > 0, "the PostgreSQL bank was killed holding prepared transactions"
        assert sum(t.outcome is Outcome.COMMITTED for t in transfers) >= 6
        await check_the_end(client, {a.id: a, b.id: b}, transfers)
