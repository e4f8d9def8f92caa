"""End to end on the repository's binaries: a real three-node cluster
(``dtx-dev serve`` processes), two Python banks enlisted in transfers made
through the Python client, the leader killed with SIGKILL in the middle of
the run, and a bank killed with SIGKILL and restarted on its file. Then:
every transfer's outcome is known (UNKNOWN answers are settled by reading
the decision, never counted as failures), each bank applied exactly the
committed ones (once), money is conserved, and nothing is left in doubt at
the banks or unacknowledged at the cluster."""

from __future__ import annotations

import asyncio
import random
import signal
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from dtx.client import (
    Client,
    FailedPrecondition,
    NotApplied,
    NotFound,
    Outcome,
    OneShot,
    OutcomeUnknown,
    ParticipantSpec,
    Unavailable,
)
from dtx.participant import GlobalTxid
from harness import BankProc, Cluster

T = TypeVar("T")
ACCOUNTS = 10
INITIAL = 1000
#: Commit calls under way now (the leader is killed while one is).
COMMITS_IN_FLIGHT = [0]
#: Errors after which the same idempotent call is simply made again.
TRANSIENT = (OutcomeUnknown, Unavailable, NotApplied)


async def again(what: str, call: Callable[[], Awaitable[T]], within_s: float = 90.0) -> T:
    """Makes an idempotent call until it gets a definite answer."""
    until = time.monotonic() + within_s
    while True:
        try:
            return await call()
        except TRANSIENT as e:
            if time.monotonic() >= until:
                raise AssertionError(f"{what}: no definite answer within {within_s} s: {e}") from e
            await asyncio.sleep(0.1)


@dataclass
class Transfer:
    key: str
    txid: int
    incarnation: int
    work: dict[str, str]  # participant id -> payload
    outcome: Outcome
    #: The first answer commit gave (UNKNOWN before settling, possibly).
    first: Outcome


async def transfer(client: Client, key: str, work: dict[str, tuple[str, str]]) -> Transfer:
    """Begin, enlist every participant (id -> (address, payload)), commit;
    an UNKNOWN commit is settled by reading the decision."""
    began = await again(f"begin {key}", lambda: client.begin(key, timeout_ms=15_000, description=key.encode()))
    payloads = {pid: p for pid, (_, p) in work.items()}
    try:
        for pid, (addr, payload) in work.items():
            await again(f"enlist {pid} in {began.txid}", lambda: client.enlist(began.txid, pid, addr, payload.encode()))
    except (FailedPrecondition, NotFound):
        # Decided meanwhile (the reaper, after a long election): go by the
        # recorded decision.
        pass
    COMMITS_IN_FLIGHT[0] += 1
    try:
        first = await again(f"commit {began.txid}", lambda: client.commit(began.txid))
    finally:
        COMMITS_IN_FLIGHT[0] -= 1
    outcome = first
    if outcome is Outcome.UNKNOWN:
        outcome = await client.settle(began.txid, give_up_s=90)
    return Transfer(key, began.txid, began.incarnation, payloads, outcome, first)


async def begin_and_commit(client: Client, key: str, participants: list[ParticipantSpec]) -> OneShot:
    """BeginAndCommit until its outcome is known: an UNKNOWN answer is
    asked again with the same key, which finds the same transaction."""
    until = time.monotonic() + 90
    while True:
        one = await again(f"begin_and_commit {key}", lambda: client.begin_and_commit(key, participants, 15_000))
        if one.outcome is not Outcome.UNKNOWN:
            return one
        assert time.monotonic() < until, f"begin_and_commit {key}: still UNKNOWN after 90 s"
        await asyncio.sleep(0.2)


def expected_balances(transfers: list[Transfer], pid: str, prefix: str) -> dict[str, int]:
    bal = {f"{prefix}{i}": INITIAL for i in range(ACCOUNTS)}
    for t in transfers:
        if t.outcome is Outcome.COMMITTED and pid in t.work:
            for item in t.work[pid].split(";"):
                name, _, delta = item.partition(":")
                bal[name] += int(delta)
    return bal


def settled(bank: BankProc) -> dict[str, object] | None:
    a = bank.audit()
    return a if a["in_doubt"] == 0 and a["locks"] == {} and a["pending"] == [] else None


async def check_the_end(client: Client, banks: dict[str, BankProc], transfers: list[Transfer]) -> None:
    """Every outcome known; each bank applied exactly the committed
    transfers, once; money conserved; nothing in doubt anywhere."""
    assert all(t.outcome in (Outcome.COMMITTED, Outcome.ABORTED) for t in transfers), [
        (t.key, t.outcome) for t in transfers if t.outcome is Outcome.UNKNOWN
    ]
    audits: dict[str, dict[str, object]] = {}
    until = time.monotonic() + 90
    for pid, bank in banks.items():
        while (a := settled(bank)) is None:
            assert time.monotonic() < until, f"{pid} still holds work in doubt: {bank.audit()}"
            await asyncio.sleep(0.2)
        audits[pid] = a
    total = 0
    for pid, a in audits.items():
        bank = banks[pid]
        assert a["applied_twice"] == [], f"{pid} applied a decision twice: {a['applied_twice']}"
        assert a["balances"] == expected_balances(transfers, pid, bank.prefix), pid
        applog = a["applog"]
        assert isinstance(applog, dict)
        for t in transfers:
            if pid not in t.work:
                continue
            tx = str(GlobalTxid(t.incarnation, t.txid))
            if t.outcome is Outcome.COMMITTED:
                assert applog.get(tx) == ["COMMIT"], (pid, t, applog.get(tx))
            else:
                assert "COMMIT" not in applog.get(tx, []), (pid, t, applog.get(tx))
        assert isinstance(a["total"], int)
        total += a["total"]
    assert total == INITIAL * ACCOUNTS * len(banks), "money is conserved"
    # The cluster holds every participant's ack of every decision.
    for t in transfers:
        while True:
            st = await again(f"status {t.txid}", lambda: client.status(t.txid))
            if st.state == "DECIDED" and all(p.acked for p in st.participants):
                break
            assert time.monotonic() < until, f"txid {t.txid} not acked by all: {st}"
            await asyncio.sleep(0.2)
        assert st.decision is t.outcome


async def run_transfers(
    client: Client,
    a: BankProc,
    b: BankProc,
    workers: int,
    each: int,
    tag: str,
    fault: Callable[[list[Transfer]], Coroutine[Any, Any, None]] | None = None,
) -> list[Transfer]:
    rng = random.Random(f"{tag}-seed")
    done: list[Transfer] = []

    async def worker(w: int) -> None:
        for i in range(each):
            amt = rng.randint(1, 20)
            sign = rng.choice((1, -1))
            x, y = rng.randrange(ACCOUNTS), rng.randrange(ACCOUNTS)
            work = {
                a.id: (a.addr, f"a{x}:{-sign * amt}"),
                b.id: (b.addr, f"b{y}:{sign * amt}"),
            }
            done.append(await transfer(client, f"{tag}-w{w}-{i}", work))

    tasks = [asyncio.create_task(worker(w)) for w in range(workers)]
    if fault is not None:
        tasks.append(asyncio.create_task(fault(done)))
    await asyncio.gather(*tasks)
    return done


def summary(what: str, transfers: list[Transfer]) -> None:
    """One line for the test's output (shown with -s, or on failure)."""
    n = {o: sum(t.outcome is o for t in transfers) for o in Outcome}
    unknown_first = sum(t.first is Outcome.UNKNOWN for t in transfers)
    print(
        f"\n{what}: {len(transfers)} transfers, {n[Outcome.COMMITTED]} committed, {n[Outcome.ABORTED]} aborted, "
        f"{n[Outcome.UNKNOWN]} unknown; {unknown_first} commit answers were UNKNOWN first and settled by a read"
    )


async def wait_count(done: list[Transfer], n: int, within_s: float = 120) -> None:
    until = time.monotonic() + within_s
    while len(done) < n:
        assert time.monotonic() < until, f"only {len(done)} transfers ended"
        await asyncio.sleep(0.05)


async def test_transfers_between_two_python_banks_survive_a_leader_kill(
    cluster: Cluster, banks: list[BankProc], tmp_path: Path
) -> None:
    cluster.wait_leader(60)
    a = BankProc(tmp_path, "py-bank-a", "a", cluster.api_addrs, ACCOUNTS, INITIAL)
    b = BankProc(tmp_path, "py-bank-b", "b", cluster.api_addrs, ACCOUNTS, INITIAL)
    banks += [a, b]
    a.start()
    b.start()
    killed: list[int] = []
    ended_at_kill = 0

    async def kill_the_leader(done: list[Transfer]) -> None:
        nonlocal ended_at_kill
        await wait_count(done, 12)
        leader = await asyncio.to_thread(cluster.wait_leader, 60)
        # Kill it while a commit is under way, if one comes within 10 s.
        until = time.monotonic() + 10
        while COMMITS_IN_FLIGHT[0] == 0 and time.monotonic() < until:
            await asyncio.sleep(0.001)
        cluster.kill9(leader)
        killed.append(leader)
        ended_at_kill = len(done)

    async with Client(cluster.api_addrs, deadline_s=20) as client:
        transfers = await run_transfers(client, a, b, workers=4, each=10, tag="kill", fault=kill_the_leader)
        summary(f"leader {killed[0] if killed else None} killed after {ended_at_kill} transfers", transfers)
        assert killed, "the leader was killed during the run"
        new_leader = cluster.wait_leader(60)
        assert new_leader != killed[0]
        committed = [t for t in transfers if t.outcome is Outcome.COMMITTED]
        assert len(committed) >= 10, [(t.key, t.outcome) for t in transfers]
        assert len(transfers) - ended_at_kill >= 10, "transfers went on after the kill"
        # One-phase transfers inside one bank (BeginAndCommit, one participant).
        for i in range(3):
            payload = f"a{i}:-7;a{i + 5}:7"
            one = await begin_and_commit(client, f"one-{i}", [ParticipantSpec(a.id, a.addr, payload.encode())])
            assert one.txid is not None and one.outcome is Outcome.COMMITTED, one
            st = await client.status(one.txid)
            assert st.one_phase and st.decision is Outcome.COMMITTED
            transfers.append(Transfer(f"one-{i}", one.txid, st.incarnation, {a.id: payload}, one.outcome, one.outcome))
        await check_the_end(client, {a.id: a, b.id: b}, transfers)


async def test_a_bank_killed_mid_run_comes_back_from_its_log(
    cluster: Cluster, banks: list[BankProc], tmp_path: Path
) -> None:
    cluster.wait_leader(60)
    a = BankProc(tmp_path, "py-bank-a", "a", cluster.api_addrs, ACCOUNTS, INITIAL)
    b = BankProc(tmp_path, "py-bank-b", "b", cluster.api_addrs, ACCOUNTS, INITIAL)
    banks += [a, b]
    a.start()
    b.start()

    async def kill_bank_b(done: list[Transfer]) -> None:
        await wait_count(done, 8)
        b.kill9()
        await asyncio.sleep(1.0)
        # The same address and file: what it voted and applied is there.
        await asyncio.to_thread(b.start)

    async with Client(cluster.api_addrs, deadline_s=20) as client:
        transfers = await run_transfers(client, a, b, workers=3, each=8, tag="bank", fault=kill_bank_b)
        summary("bank b killed and restarted", transfers)
        assert sum(t.outcome is Outcome.COMMITTED for t in transfers) >= 6
        await check_the_end(client, {a.id: a, b.id: b}, transfers)


async def test_abort_and_refusals_through_the_cluster(
    cluster: Cluster, banks: list[BankProc], tmp_path: Path
) -> None:
    cluster.wait_leader(60)
    a = BankProc(tmp_path, "py-bank-a", "a", cluster.api_addrs, ACCOUNTS, INITIAL)
    banks.append(a)
    a.start()
    async with Client(cluster.api_addrs, deadline_s=20) as client:
        # A client's abort before commit: ABORTED, and a later commit says so.
        t = await again("begin", lambda: client.begin("abort-1"))
        await again("enlist", lambda: client.enlist(t.txid, a.id, a.addr, b"a0:-1"))
        assert await client.abort(t.txid, "changed my mind") is Outcome.ABORTED
        assert await client.commit(t.txid) is Outcome.ABORTED
        # The same key finds the same transaction.
        again_t = await client.begin("abort-1")
        assert again_t.txid == t.txid and again_t.existing
        # A NO vote (no such account) aborts; money untouched.
        t2 = await again("begin", lambda: client.begin("no-1"))
        await again("enlist", lambda: client.enlist(t2.txid, a.id, a.addr, b"nosuch:1"))
        assert await client.commit(t2.txid) is Outcome.ABORTED
        # Enlisting after the decision is refused, definitely.
        try:
            await client.enlist(t2.txid, "late", a.addr, b"a0:1")
            raise AssertionError("enlist after the decision was accepted")
        except FailedPrecondition:
            pass
        try:
            await client.status(10**12)
            raise AssertionError("status of an unknown txid answered")
        except NotFound:
            pass
    audit = a.audit()
    assert audit["total"] == INITIAL * ACCOUNTS and audit["in_doubt"] == 0


async def test_a_commit_without_an_answer_is_unknown_and_then_settles(
    cluster: Cluster, banks: list[BankProc], tmp_path: Path
) -> None:
    """A one-phase commit whose only participant does not answer (stopped
    with SIGSTOP): the cluster may not decide, the client's answer is
    UNKNOWN (never ABORTED, never an error), and once the participant runs
    again the leader's re-drive commits it; reading the decision settles it."""
    cluster.wait_leader(60)
    a = BankProc(tmp_path, "py-bank-a", "a", cluster.api_addrs, ACCOUNTS, INITIAL)
    banks.append(a)
    a.start()
    assert a.proc is not None
    async with Client(cluster.api_addrs, deadline_s=20) as client:
        tx = await again("begin", lambda: client.begin("stalled-1", timeout_ms=60_000))
        await again("enlist", lambda: client.enlist(tx.txid, a.id, a.addr, b"a0:-9;a1:9"))
        a.proc.send_signal(signal.SIGSTOP)
        try:
            async with Client(cluster.api_addrs, deadline_s=7) as impatient:
                t0 = time.monotonic()
                assert await impatient.commit(tx.txid) is Outcome.UNKNOWN
                assert time.monotonic() - t0 < 30
                one = await impatient.begin_and_commit(
                    "stalled-2", [ParticipantSpec(a.id, a.addr, b"a2:-1;a3:1")], 15_000
                )
                assert (one.txid, one.outcome) == (None, Outcome.UNKNOWN)
            st = await client.status(tx.txid)
            assert st.state == "PREPARING" and st.one_phase, st
        finally:
            a.proc.send_signal(signal.SIGCONT)
        assert await client.settle(tx.txid, give_up_s=60) is Outcome.COMMITTED
        again_one = await begin_and_commit(client, "stalled-2", [ParticipantSpec(a.id, a.addr, b"a2:-1;a3:1")])
        assert again_one.outcome is Outcome.COMMITTED and again_one.existing
    audit = a.audit()
    balances = audit["balances"]
    assert isinstance(balances, dict)
    assert (balances["a0"], balances["a1"], balances["a2"], balances["a3"]) == (991, 1009, 999, 1001)
    assert audit["applied_twice"] == [] and audit["in_doubt"] == 0
