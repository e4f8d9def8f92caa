"""Branches on the PostgreSQL participant (``dtx.participant.pg_branch``).

Against a real PostgreSQL with a fake cluster client (the answers of
RegisterBranch and GetBranchDecision as the test says): a registered YES is
a prepared transaction under the participant's gid with its mark gone; what
PREPARE cannot carry (NOTIFY, a temporary table) is a NO registered with
its reason, nothing prepared; a too-late refusal is rolled back before the
handler answers; no answer leaves the prepared transaction and its mark to
recovery, which asks GetBranchDecision (and nothing while the flow runs)
and rolls a non-member back; a mark whose transaction never prepared is
dropped without asking.

On a real cluster (``dtx-dev serve``) with ``examples/branch_bank.py``,
one bank on PostgreSQL (``--postgres``) and one on SQLite: transfers as two
branches commit once at both; the PostgreSQL bank stopped by its failpoint
after its local PREPARE (and its mark) and before registering, then
SIGKILLed, is rolled back by its recovery after the restart (nothing left
in ``pg_prepared_xacts``), and money is conserved.

Skipped without ``DTX_TEST_POSTGRES`` unless ``DTX_REQUIRE_POSTGRES=1``
(tests/pg.py)."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from dtx import metadata as md
from dtx.client import (
    BranchDecision,
    BranchDecisionAnswer,
    BranchRegistration,
    BranchVote,
    Client,
    FailedPrecondition,
    Outcome,
    OutcomeUnknown,
)
from dtx.participant import GlobalTxid, Kind, Message, Recovery, RecoveryOptions, State, Vote
from dtx.participant.branch import AlreadyPrepared, BranchIdentity, BranchRolledBack, BranchUnknown
from harness import BranchBankProc, Cluster, PgBranchBankProc, wait_for
from pg import query, required

try:
    import psycopg  # noqa: F401
except ImportError:
    if required():
        raise
    pytest.skip("psycopg is not installed (scripts/python-deps installs it)", allow_module_level=True)

from dtx.participant.pg_branch import Unpreparable, begin_branch, refuse_unpreparable, run_branch  # noqa: E402
from dtx.participant.postgres import BRANCH_TABLE, PgParticipantStore, gid_of  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import pg_bank  # noqa: E402
from test_branch_cluster import ACCOUNTS, INITIAL, change, code, decided, settled_audit  # noqa: E402

WHO = BranchIdentity("bank-a", "127.0.0.1:1")
T = GlobalTxid(0x1234, 7)


class FakeCluster:
    """RegisterBranch answers ``register`` (an exception to raise, or None:
    registered); GetBranchDecision answers ``decide``; GetDecisions is
    recorded (a branch must never be asked about by txid alone)."""

    def __init__(self) -> None:
        self.register: Exception | None = None
        self.decide: BranchDecisionAnswer = BranchDecisionAnswer(BranchDecision.ABORT, False, True)
        self.registered: list[tuple[int, str, BranchVote, str, int]] = []
        self.asked: list[tuple[int, str, int]] = []
        self.decisions_asked: list[list[int]] = []
        self.hold: asyncio.Event | None = None

    async def register_branch(self, txid: int, pid: str, addr: str, vote: BranchVote, reason: str, inc: int) -> Any:
        self.registered.append((txid, pid, vote, reason, inc))
        if self.hold is not None:
            await self.hold.wait()
        if self.register is not None:
            raise self.register
        return BranchRegistration(term=3, incarnation=inc, existing=False, deadline_unix_ms=0, participant_count=1)

    async def branch_decision(self, txid: int, pid: str, inc: int) -> BranchDecisionAnswer:
        self.asked.append((txid, pid, inc))
        return self.decide

    async def decisions(self, txids: list[int], pid: str, inc: int) -> list[Any]:
        self.decisions_asked.append(list(txids))
        return []

    async def close(self) -> None:
        pass


@pytest.fixture
async def store(pg_db: str) -> AsyncIterator[PgParticipantStore]:
    s = await PgParticipantStore.open(pg_db, pg_bank.PgBank(), "bank-a")
    await pg_bank.install(s, "a", 3, 100)
    try:
        yield s
    finally:
        await s.close()


def recovery(store: PgParticipantStore, fake: FakeCluster) -> Recovery:
    rec = Recovery(store, ["127.0.0.1:1"], "bank-a", RecoveryOptions(log_retention_s=None, prepared_age_min_s=0))
    rec.client = fake  # type: ignore[assignment]
    return rec


def work(payload: bytes, txid: GlobalTxid = T) -> Any:
    return lambda tx: pg_bank.PgBank().prepare(tx, txid, payload)


def prepared(dsn: str) -> list[str]:
    return [g for (g,) in query(dsn, "SELECT gid FROM pg_prepared_xacts WHERE database = current_database()")]


def marks(dsn: str) -> list[tuple[int, int]]:
    m = 1 << 64  # u64s stored as bigints holding their bits
    return [(int(i) % m, int(t) % m) for i, t in query(dsn, f"SELECT incarnation, txid FROM {BRANCH_TABLE}")]


def balances(dsn: str) -> dict[str, int]:
    return {n: int(b) for n, b in query(dsn, "SELECT name, balance FROM bank_accounts")}


def test_the_early_check_refuses_what_prepare_cannot_carry_and_nothing_else() -> None:
    for bad in (
        "NOTIFY jobs",
        "SELECT pg_notify('jobs', 'x')",
        "listen jobs",
        "CREATE TEMP TABLE t (a int)",
        "SELECT 1 INTO TEMPORARY t",
        "DECLARE c CURSOR WITH HOLD FOR SELECT 1",
        "INSERT INTO pg_temp.t VALUES (1)",
        "SELECT 1; NOTIFY x",
    ):
        with pytest.raises(Unpreparable):
            refuse_unpreparable(bad)
    for fine in (
        "SELECT 'NOTIFY jobs'",
        "SELECT 1 -- notify\n",
        "UPDATE temp SET a = 1",
        "INSERT INTO temp VALUES (1)",
        'SELECT "listen" FROM t',
        "DECLARE c CURSOR FOR SELECT 1",
        "SELECT $$ CREATE TEMP TABLE x $$",
    ):
        refuse_unpreparable(fine)


async def test_a_registered_yes_is_prepared_under_the_gid_and_drops_its_mark(
    store: PgParticipantStore, pg_db: str
) -> None:
    fake = FakeCluster()
    j = await run_branch(store, fake, WHO, T, work(b"a0:-5;a1:5;"))
    assert (j.vote, j.term) == (Vote.YES, 3)
    assert fake.registered == [(7, "bank-a", BranchVote.YES, "", 0x1234)]
    floor = await store.term_floor(T.incarnation)
    assert prepared(pg_db) == [gid_of("bank-a", T, floor)]
    assert marks(pg_db) == [] and not store.branch_running(T)
    assert (await store.entry(T)).state is State.PREPARED_YES  # type: ignore[union-attr]
    assert balances(pg_db) == {"a0": 100, "a1": 100, "a2": 100}, "invisible until committed"
    # A second branch of the same txid: refused, nothing done.
    with pytest.raises(AlreadyPrepared):
        async with begin_branch(store, T):
            pass
    # Phase two commits it as any participant's prepared work.
    await store.handle(T, Message(Kind.COMMIT, 4))
    assert prepared(pg_db) == [] and balances(pg_db) == {"a0": 95, "a1": 105, "a2": 100}


async def test_what_prepare_cannot_carry_is_a_registered_no_and_nothing_is_held(
    store: PgParticipantStore, pg_db: str
) -> None:
    fake = FakeCluster()
    # Through the guarded transaction: refused before it is sent.
    async with begin_branch(store, T) as b:
        await b.tx.execute("UPDATE bank_accounts SET balance = balance - 1 WHERE name = 'a0'")
        with pytest.raises(Unpreparable):
            await b.tx.execute("NOTIFY jobs, 'x'")
        j = await b.join(fake, WHO)  # the handler says YES: a NO anyway
    assert j.vote is Vote.NO and "NOTIFY" in j.reason
    assert fake.registered[-1][2] is BranchVote.NO and "NOTIFY" in fake.registered[-1][3]
    # Around the guard (the session itself): found in the transaction at join.
    t2 = GlobalTxid(0x1234, 8)
    async with begin_branch(store, t2) as b:
        await b.tx.connection.execute("CREATE TEMP TABLE scratch (a int)")
        j2 = await b.join(fake, WHO)
    assert j2.vote is Vote.NO and "temporary table" in j2.reason and "scratch" in j2.reason
    assert prepared(pg_db) == [] and marks(pg_db) == []
    for t in (T, t2):
        assert (await store.entry(t)).state is State.ABORTED  # type: ignore[union-attr]
    assert balances(pg_db) == {"a0": 100, "a1": 100, "a2": 100}


async def test_a_too_late_registration_is_rolled_back_before_answering(store: PgParticipantStore, pg_db: str) -> None:
    fake = FakeCluster()
    fake.register = FailedPrecondition("late", grpc.StatusCode.FAILED_PRECONDITION, md.BranchRefusalKind.TOO_LATE)
    with pytest.raises(BranchRolledBack) as e:
        await run_branch(store, fake, WHO, T, work(b"a0:-5;a1:5;"))
    assert e.value.code is grpc.StatusCode.ABORTED
    assert prepared(pg_db) == [] and marks(pg_db) == [] and not store.branch_running(T)
    assert (await store.entry(T)).state is State.ABORTED  # type: ignore[union-attr]
    # The rows are free again: another branch takes them.
    j = await run_branch(store, FakeCluster(), WHO, GlobalTxid(0x1234, 9), work(b"a0:-1;"))
    assert j.vote is Vote.YES


async def test_no_answer_leaves_the_prepared_branch_to_recovery_which_rolls_a_non_member_back(
    store: PgParticipantStore, pg_db: str
) -> None:
    fake = FakeCluster()
    rec = recovery(store, fake)
    # While the registration is in flight, recovery asks nothing about it.
    fake.hold = asyncio.Event()
    fake.register = OutcomeUnknown("timed out")
    flow = asyncio.create_task(run_branch(store, fake, WHO, T, work(b"a2:-7;")))
    await asyncio.to_thread(wait_for, "the registration in flight", lambda: bool(fake.registered), 10)
    assert marks(pg_db) == [(0x1234, 7)] and len(prepared(pg_db)) == 1
    await rec.pass_once()
    assert fake.asked == [] and fake.decisions_asked == [], "a running branch is left alone"
    fake.hold.set()
    with pytest.raises(BranchUnknown) as e:
        await flow
    assert e.value.code is grpc.StatusCode.UNKNOWN
    assert marks(pg_db) == [(0x1234, 7)] and len(prepared(pg_db)) == 1, "kept for recovery"
    # Recovery: GetBranchDecision, not a member, ABORT: rolled back.
    await rec.pass_once()
    assert fake.asked == [(7, "bank-a", 0x1234)] and fake.decisions_asked == []
    assert prepared(pg_db) == [] and marks(pg_db) == []
    assert (await store.entry(T)).state is State.ABORTED  # type: ignore[union-attr]
    assert balances(pg_db)["a2"] == 100
    # A mark whose transaction never prepared (a crash in between) is
    # dropped without asking.
    query(pg_db, f"INSERT INTO {BRANCH_TABLE} VALUES ('bank-a', 5, 5, 0)")
    await rec.pass_once()
    assert marks(pg_db) == [] and len(fake.asked) == 1


# -- on a real cluster ---------------------------------------------------------


async def check_end(
    client: Client, banks: list[BranchBankProc], applied: dict[str, dict[str, int]], txs: dict[int, Outcome], inc: int
) -> None:
    """Each bank's balances are the initial ones plus exactly ``applied``;
    a committed transaction shows at most one COMMIT in a bank's apply log,
    an aborted one none; money is conserved
    across the banks (transfers go from one to the other); nothing held;
    the cluster has every ack."""
    total = 0
    for b in banks:
        a = await settled_audit(b)
        want = {f"{b.prefix}{i}": INITIAL for i in range(ACCOUNTS)}
        for acct, d in applied.get(b.id, {}).items():
            want[acct] += d
        assert a["balances"] == want, (b.id, a)
        assert a["applied_twice"] == [], a
        total += a["total"]
        for txid, out in txs.items():
            log = a["applog"].get(str(GlobalTxid(inc, txid)), [])
            assert "COMMIT" not in log or (out is Outcome.COMMITTED and log == ["COMMIT"]), (b.id, txid, out, log)
    assert total == INITIAL * ACCOUNTS * len(banks), "money conserved across the banks"
    for txid, out in txs.items():
        st = await client.status(txid)
        for _ in range(150):
            if st.state == "DECIDED" and all(p.acked for p in st.participants):
                break
            await asyncio.sleep(0.2)
            st = await client.status(txid)
        assert st.state == "DECIDED" and all(p.acked for p in st.participants), st
        assert st.decision is out, (txid, st)


FAILPOINT = "participant_branch_prepared_before_register"


@pytest.fixture
def pcluster(tmp_path: Path, pg_db: str) -> Any:
    c = Cluster(tmp_path / "cluster")
    c.start_all()
    try:
        c.wait_leader(60)
        yield c
    finally:
        c.stop_all()


def pg_bank_proc(tmp_path: Path, cluster: Cluster, pg_db: str, **env: str) -> PgBranchBankProc:
    return PgBranchBankProc(
        tmp_path, "bank-a", "a", cluster.api_addrs, accounts=ACCOUNTS, initial=INITIAL, extra_env=dict(env),
        postgres=pg_db,
    )  # fmt: skip


async def test_transfers_as_branches_with_one_bank_on_postgresql_commit_once_at_both(
    tmp_path: Path, pcluster: Cluster, pg_db: str, banks: list[Any]
) -> None:
    a = pg_bank_proc(tmp_path, pcluster, pg_db)
    b = BranchBankProc(tmp_path, "bank-b", "b", pcluster.api_addrs, accounts=ACCOUNTS, initial=INITIAL)
    banks += [a, b]
    a.start()
    b.start()
    applied: dict[str, dict[str, int]] = {"bank-a": {}, "bank-b": {}}
    txs: dict[int, Outcome] = {}
    inc = 0
    async with Client(pcluster.api_addrs, deadline_s=15) as client:
        for i in range(5):
            amt = 10 + i
            x, y = i % ACCOUNTS, (i + 1) % ACCOUNTS
            began = await client.begin(f"pg-branch-transfer-{i}", timeout_ms=20_000)
            inc = began.incarnation
            ra, rb = await asyncio.gather(
                change(a, began.txid, inc, {f"a{x}": -amt}), change(b, began.txid, inc, {f"b{y}": amt})
            )
            assert code(ra) is grpc.StatusCode.OK and code(rb) is grpc.StatusCode.OK, (ra, rb)
            assert ra.balances[0].balance_if_committed == INITIAL + applied["bank-a"].get(f"a{x}", 0) - amt
            st = await client.status(began.txid)
            assert sorted(p.id for p in st.participants) == ["bank-a", "bank-b"], st
            assert await decided(client, began.txid) is Outcome.COMMITTED
            txs[began.txid] = Outcome.COMMITTED
            applied["bank-a"][f"a{x}"] = applied["bank-a"].get(f"a{x}", 0) - amt
            applied["bank-b"][f"b{y}"] = applied["bank-b"].get(f"b{y}", 0) + amt
        # A change the PostgreSQL bank refuses registers NO: aborted at once.
        began = await client.begin("pg-branch-refused", timeout_ms=20_000)
        rb = await change(b, began.txid, inc, {"b0": -5})
        ra = await change(a, began.txid, inc, {"a0": -10 * INITIAL})
        assert code(rb) is grpc.StatusCode.OK
        assert code(ra) is grpc.StatusCode.FAILED_PRECONDITION and "too little" in ra.details(), ra
        st = await client.status(began.txid)
        assert st.state == "DECIDED" and st.decision is Outcome.ABORTED, st
        txs[began.txid] = Outcome.ABORTED
        assert code(await change(a, began.txid, inc, {"a1": 1})) is grpc.StatusCode.ALREADY_EXISTS
        await check_end(client, [a, b], applied, txs, inc)
        # Committed once at both banks.
        logs_a, logs_b = a.audit()["applog"], b.audit()["applog"]
        for txid, out in txs.items():
            if out is Outcome.COMMITTED:
                g = str(GlobalTxid(inc, txid))
                assert logs_a[g] == ["COMMIT"] and logs_b[g] == ["COMMIT"], (g, logs_a, logs_b)
    assert prepared(pg_db) == [] and marks(pg_db) == []


async def test_a_postgresql_bank_killed_between_its_prepare_and_registering_is_rolled_back_by_recovery(
    tmp_path: Path, pcluster: Cluster, pg_db: str, banks: list[Any]
) -> None:
    a = pg_bank_proc(tmp_path, pcluster, pg_db, DTX_PY_FAILPOINTS=f"{FAILPOINT}=stop")
    b = BranchBankProc(tmp_path, "bank-b", "b", pcluster.api_addrs, accounts=ACCOUNTS, initial=INITIAL)
    banks += [a, b]
    a.start()
    b.start()
    async with Client(pcluster.api_addrs, deadline_s=15) as client:
        began = await client.begin("pg-branch-crash", timeout_ms=60_000)
        inc, txid = began.incarnation, began.txid
        rb = await change(b, txid, inc, {"b0": -9, "b1": 9})
        assert code(rb) is grpc.StatusCode.OK, rb
        call = asyncio.create_task(change(a, txid, inc, {"a0": -4, "a1": 4}, timeout=60))
        # bank-a prepared in PostgreSQL (its mark committed first) and
        # stopped itself before registering: kill it.
        await asyncio.to_thread(wait_for, "bank-a at its failpoint", a.stopped_by_itself, 30)
        a.kill9()
        assert code(await call) is not grpc.StatusCode.OK
        g = GlobalTxid(inc, txid)
        assert [p for p in prepared(pg_db) if p.startswith("dtx:")] and len(prepared(pg_db)) == 1, prepared(pg_db)
        assert marks(pg_db) == [(g.incarnation, g.txid)]
        st = await client.status(txid)
        assert [p.id for p in st.participants] == ["bank-b"], "bank-a never registered"
        # Restarted without the failpoint: recovery asks GetBranchDecision,
        # the cluster fences bank-a out and answers ABORT: ROLLBACK PREPARED.
        a.extra_env = {}
        a.start()
        after = await settled_audit(a)
        assert prepared(pg_db) == [] and marks(pg_db) == []
        assert "fenced out" in a.log.read_text() or "not in its transaction" in a.log.read_text()
        with pytest.raises(FailedPrecondition) as e:
            await client.register_branch(txid, "bank-a", a.addr, BranchVote.YES, "", inc)
        assert e.value.branch_refusal is md.BranchRefusalKind.FENCED
        d = await client.branch_decision(txid, "bank-a", inc)
        assert (d.decision, d.member) == (BranchDecision.ABORT, False)
        # The caller commits anyway: without bank-a's work, which never applies.
        assert await decided(client, txid) is Outcome.COMMITTED
        assert after["balances"] == {f"a{i}": INITIAL for i in range(ACCOUNTS)}
        await check_end(client, [a, b], {"bank-b": {"b0": -9, "b1": 9}}, {txid: Outcome.COMMITTED}, inc)
    assert prepared(pg_db) == []
