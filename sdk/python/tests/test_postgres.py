"""The PostgreSQL participant (``dtx.participant.postgres``) against a real
server: the work prepared by ``PREPARE TRANSACTION`` under the Rust SDK's
gids with the ``committed`` marker inside it, the participant table of
docs/protocol.md (tombstones, repeats, refusals), terms, the term floor, a
term raised while prepared, one-phase commits, what a new store object sees
(a restart), recovery's listing, log GC, Inspect, the handler's lock
timeout, ``synchronous_commit``, and a log written the Rust SDK's way.

Each test has a database of its own (tests/pg.py); skipped without
``DTX_TEST_POSTGRES`` unless ``DTX_REQUIRE_POSTGRES=1``."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from dtx.metadata import RefusalKind
from dtx.participant import GlobalTxid, Kind, LogEntry, Message, Refuse, Refused, State, StoreError, Vote
from pg import query, required

try:
    import psycopg
except ImportError:
    if required():
        raise
    pytest.skip("psycopg is not installed (scripts/python-deps installs it)", allow_module_level=True)

from dtx.participant.postgres import (  # noqa: E402
    FLOOR_TABLE,
    LOG_INC_TABLE,
    LOG_TABLE,
    RAISED_TABLE,
    PgOptions,
    PgParticipantStore,
    PgResource,
    PgTx,
    check_participant_id,
    gid_of,
    parse_gid,
)

INC = 0xC0FFEE


class Ledger(PgResource):
    """Payload ``+N`` adds N to the counter (its row locked ``NOWAIT``: a
    held row refuses); ``ro`` reads; ``no`` refuses; ``boom`` raises;
    ``wait`` locks the row WITHOUT NOWAIT (the handler's lock timeout ends
    the wait); ``swallow`` hides a failed statement and says YES;
    ``commit`` tries to end the SDK's transaction; ``slow`` sleeps 0.5 s
    then adds 1. Counts its calls in memory (rows written in a prepared
    transaction are not visible)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    async def prepare(self, tx: PgTx, txid: GlobalTxid, payload: bytes) -> Vote:
        p = payload.decode()
        self.calls.append((str(txid), p))
        if p == "ro":
            await tx.one("SELECT v FROM counter WHERE k = 'value'")
            return Vote.READ_ONLY
        if p == "no":
            return Vote.NO
        if p == "boom":
            raise RuntimeError("boom")
        if p == "wait":
            await tx.one("SELECT v FROM counter WHERE k = 'value' FOR UPDATE")
            return Vote.YES
        if p == "swallow":
            try:
                await tx.execute("SELECT * FROM no_such_table")
            except psycopg.Error:
                pass
            return Vote.YES
        if p == "commit":
            await tx.execute("COMMIT")
            return Vote.YES
        if p == "slow":
            await tx.execute("SELECT pg_sleep(0.5)")
            p = "+1"
        try:
            await tx.one("SELECT v FROM counter WHERE k = 'value' FOR UPDATE NOWAIT")
        except psycopg.errors.LockNotAvailable:
            raise Refuse("locked") from None
        await tx.execute("UPDATE counter SET v = v + %s WHERE k = 'value'", (int(p),))
        await tx.execute("INSERT INTO applied (tx) VALUES (%s)", (str(txid),))
        return Vote.YES


async def install(store: PgParticipantStore) -> None:
    async def create(tx: PgTx) -> None:
        await tx.execute("CREATE TABLE IF NOT EXISTS counter (k text PRIMARY KEY, v bigint NOT NULL)")
        await tx.execute("INSERT INTO counter VALUES ('value', 0) ON CONFLICT DO NOTHING")
        await tx.execute("CREATE TABLE IF NOT EXISTS applied (tx text NOT NULL)")

    await store.write(create)


def g(txid: int, inc: int = INC) -> GlobalTxid:
    return GlobalTxid(inc, txid)


def m(kind: Kind, term: int = 10) -> Message:
    return Message(kind, term)


def value(dsn: str) -> int:
    return int(query(dsn, "SELECT v FROM counter WHERE k = 'value'")[0][0])


def gids(dsn: str) -> list[str]:
    return [r[0] for r in query(dsn, "SELECT gid FROM pg_prepared_xacts WHERE database = current_database() ORDER BY gid")]


async def refused(kind: RefusalKind, coro: Any) -> None:
    with pytest.raises(Refused) as e:
        await coro
    assert e.value.refusal.kind is kind, e.value


@pytest.fixture
async def store(pg_db: str) -> AsyncIterator[PgParticipantStore]:
    s = await PgParticipantStore.open(pg_db, Ledger(), "p1")
    await install(s)
    try:
        yield s
    finally:
        await s.close()


async def reopen(old: PgParticipantStore) -> PgParticipantStore:
    """A new store object on the same database: what a restart sees."""
    await old.close()
    return await PgParticipantStore.open(old.conninfo, Ledger(), old.participant_id)


def test_gids_are_the_rust_sdks() -> None:
    assert gid_of("bank-a", GlobalTxid(0, 42), 7) == "dtx:v1:bank-a:42:7"
    assert gid_of("bank-a", GlobalTxid(0xC0FFEE, 42), 7) == "dtx:v2:bank-a:0000000000c0ffee:42:7"
    top = (1 << 64) - 1
    longest = gid_of("x" * 128, GlobalTxid(top, top), top)
    assert len(longest) == 194 < 200
    assert parse_gid("dtx:v1:bank-a:42:7") == ("bank-a", GlobalTxid(0, 42), 7)
    assert parse_gid("dtx:v2:bank-a:0000000000c0ffee:42:7") == ("bank-a", GlobalTxid(0xC0FFEE, 42), 7)
    for bad in ("dtx:v1:bank-a:42", "dtx:v1:bank-a:+4:7", "dtx:v2:b:0000000000000000:1:1", "dtx:v2:b:c0ffee:1:1", "x"):
        assert parse_gid(bad) is None, bad
    for bad_id in ("", "a:b", "a\nb", "x" * 129):
        with pytest.raises(ValueError):
            check_participant_id(bad_id)


async def test_yes_prepares_the_work_with_its_marker_and_commit_makes_it_visible(
    store: PgParticipantStore, pg_db: str
) -> None:
    t = g(1, 0)
    assert (await store.handle(t, m(Kind.PREPARE), b"+5")).vote is Vote.YES
    # Prepared under the v1 gid; the work and the marker are inside it.
    assert gids(pg_db) == ["dtx:v1:p1:1:10"]
    assert value(pg_db) == 0
    assert query(pg_db, f"SELECT count(*) FROM {LOG_TABLE}") == [(0,)]
    assert await store.entry(t) == LogEntry(State.PREPARED_YES, 10)
    # A repeat with another payload: YES, the work not run again.
    assert (await store.handle(t, m(Kind.PREPARE), b"+9")).vote is Vote.YES
    assert len(store.resource.calls) == 1  # type: ignore[attr-defined]
    assert (await store.handle(t, m(Kind.COMMIT))).ack
    assert gids(pg_db) == [] and value(pg_db) == 5
    assert query(pg_db, f"SELECT participant, txid, state, term FROM {LOG_TABLE}") == [("p1", 1, "committed", 10)]
    # The gid is gone: the marker decides a repeat, which applies nothing.
    assert (await store.handle(t, m(Kind.COMMIT))).ack
    assert (await store.handle(t, m(Kind.COMMIT, 12))).ack
    assert value(pg_db) == 5 and query(pg_db, "SELECT count(*) FROM applied") == [(1,)]
    assert await store.entry(t) == LogEntry(State.COMMITTED, 12)
    await refused(RefusalKind.ABORT_AFTER_COMMIT, store.handle(t, m(Kind.ABORT, 12)))
    assert (await store.handle(t, m(Kind.PREPARE, 12), b"+1")).vote is Vote.YES


async def test_other_incarnations_use_the_v2_gid_and_their_own_table(store: PgParticipantStore, pg_db: str) -> None:
    assert (await store.handle(g(1), m(Kind.PREPARE), b"+2")).vote is Vote.YES
    assert gids(pg_db) == ["dtx:v2:p1:0000000000c0ffee:1:10"]
    # The same txid of incarnation 0 is another transaction.
    assert await store.entry(g(1, 0)) is None
    assert (await store.handle(g(1, 0), m(Kind.ABORT))).ack
    assert (await store.handle(g(1), m(Kind.COMMIT))).ack
    assert query(pg_db, f"SELECT incarnation, txid, state FROM {LOG_INC_TABLE}") == [(INC, 1, "committed")]
    assert query(pg_db, f"SELECT txid, state FROM {LOG_TABLE}") == [(1, "tombstone")]
    assert value(pg_db) == 2


async def test_no_and_read_only_roll_the_work_back_and_are_recorded(store: PgParticipantStore, pg_db: str) -> None:
    a = await store.handle(g(1), m(Kind.PREPARE), b"no")
    assert a.vote is Vote.NO and a.reason
    assert await store.entry(g(1)) == LogEntry(State.ABORTED, 10)
    again = await store.handle(g(1), m(Kind.PREPARE), b"+1")
    assert again.vote is Vote.NO
    assert len(store.resource.calls) == 1  # type: ignore[attr-defined]
    await refused(RefusalKind.COMMIT_AFTER_ABORT, store.handle(g(1), m(Kind.COMMIT)))
    assert (await store.handle(g(1), m(Kind.ABORT))).ack

    assert (await store.handle(g(2), m(Kind.PREPARE), b"ro")).vote is Vote.READ_ONLY
    assert await store.entry(g(2)) == LogEntry(State.PREPARED_READ_ONLY, 10)
    assert (await store.handle(g(2), m(Kind.PREPARE), b"+1")).vote is Vote.READ_ONLY
    assert (await store.handle(g(2), m(Kind.COMMIT))).ack
    assert (await store.handle(g(2), m(Kind.ABORT))).ack
    # A failing handler, and one that hides a failed statement, vote NO.
    boom = await store.handle(g(3), m(Kind.PREPARE), b"boom")
    assert boom.vote is Vote.NO and "boom" in boom.reason
    hidden = await store.handle(g(4), m(Kind.PREPARE), b"swallow")
    assert hidden.vote is Vote.NO and "failed" in hidden.reason
    # A handler may not end the SDK's transaction.
    ended = await store.handle(g(5), m(Kind.PREPARE), b"commit")
    assert ended.vote is Vote.NO and "COMMIT" in ended.reason
    assert gids(pg_db) == [] and value(pg_db) == 0


async def test_an_abort_before_the_prepare_leaves_a_tombstone(store: PgParticipantStore, pg_db: str) -> None:
    assert (await store.handle(g(1), m(Kind.ABORT))).ack
    assert await store.entry(g(1)) == LogEntry(State.TOMBSTONE, 10)
    late = await store.handle(g(1), m(Kind.PREPARE), b"+1")
    assert late.vote is Vote.NO and "before its Prepare" in late.reason
    one = await store.handle(g(1), m(Kind.COMMIT_ONE_PHASE), b"+1")
    assert one.vote is Vote.NO
    await refused(RefusalKind.COMMIT_AFTER_ABORT, store.handle(g(1), m(Kind.COMMIT)))
    assert store.resource.calls == []  # type: ignore[attr-defined]
    # A Commit of a transaction never seen is refused and records nothing.
    await refused(RefusalKind.COMMIT_WITHOUT_PREPARE, store.handle(g(2), m(Kind.COMMIT)))
    assert await store.entry(g(2)) is None
    # Inquire records nothing either.
    assert await store.entry(g(3)) is None
    assert query(pg_db, f"SELECT count(*) FROM {LOG_INC_TABLE}") == [(1,)]


async def test_aborting_a_prepared_transaction_rolls_its_work_back(store: PgParticipantStore, pg_db: str) -> None:
    assert (await store.handle(g(1), m(Kind.PREPARE), b"+3")).vote is Vote.YES
    # Its row is held: another transaction refuses (NOWAIT), never waits.
    held = await store.handle(g(2), m(Kind.PREPARE), b"+1")
    assert held.vote is Vote.NO and held.reason == "locked"
    assert (await store.handle(g(1), m(Kind.ABORT, 11))).ack
    assert gids(pg_db) == [] and value(pg_db) == 0
    assert await store.entry(g(1)) == LogEntry(State.ABORTED, 11)
    assert (await store.handle(g(1), m(Kind.ABORT, 11))).ack
    await refused(RefusalKind.COMMIT_AFTER_ABORT, store.handle(g(1), m(Kind.COMMIT, 11)))
    assert query(pg_db, "SELECT count(*) FROM applied") == [(0,)]


async def test_stale_terms_are_refused_and_change_nothing(store: PgParticipantStore, pg_db: str) -> None:
    assert (await store.handle(g(1), m(Kind.PREPARE, 10), b"+1")).vote is Vote.YES
    await refused(RefusalKind.STALE_TERM, store.handle(g(1), m(Kind.COMMIT, 9)))
    await refused(RefusalKind.STALE_TERM, store.handle(g(1), m(Kind.ABORT, 9)))
    assert gids(pg_db) == [gid_of("p1", g(1), 10)]
    assert (await store.handle(g(1), m(Kind.COMMIT, 10))).ack
    await refused(RefusalKind.STALE_TERM, store.handle(g(1), m(Kind.COMMIT, 9)))
    assert value(pg_db) == 1


async def test_a_term_raised_while_prepared_fences_until_the_decision_also_after_a_restart(
    store: PgParticipantStore, pg_db: str
) -> None:
    assert (await store.handle(g(1), m(Kind.PREPARE, 10), b"+1")).vote is Vote.YES
    # A new leader's repeated Prepare: YES, and the term is raised to 12
    # (the gid cannot be renamed: the raised term has its own row).
    assert (await store.handle(g(1), m(Kind.PREPARE, 12), b"+1")).vote is Vote.YES
    assert await store.entry(g(1)) == LogEntry(State.PREPARED_YES, 12)
    assert query(pg_db, f"SELECT txid, term FROM {RAISED_TABLE}") == [(1, 12)]
    await refused(RefusalKind.STALE_TERM, store.handle(g(1), m(Kind.COMMIT, 11)))
    await refused(RefusalKind.STALE_TERM, store.handle(g(1), m(Kind.PREPARE, 11), b"+1"))
    store = await reopen(store)
    try:
        assert await store.entry(g(1)) == LogEntry(State.PREPARED_YES, 12)
        await refused(RefusalKind.STALE_TERM, store.handle(g(1), m(Kind.COMMIT, 10)))
        assert (await store.handle(g(1), m(Kind.COMMIT, 12))).ack
        # The decided row carries the term from then on; the raised row goes.
        assert await store.entry(g(1)) == LogEntry(State.COMMITTED, 12)
        assert query(pg_db, f"SELECT count(*) FROM {RAISED_TABLE}") == [(0,)]
        assert value(pg_db) == 1
    finally:
        await store.close()


async def test_the_term_floor_refuses_a_deposed_leaders_new_transactions_and_survives_a_restart(
    store: PgParticipantStore, pg_db: str
) -> None:
    assert (await store.handle(g(1), m(Kind.PREPARE, 20), b"+1")).vote is Vote.YES
    assert await store.term_floor(INC) == 20
    await refused(RefusalKind.STALE_TERM, store.handle(g(2), m(Kind.PREPARE, 15), b"+1"))
    await refused(RefusalKind.STALE_TERM, store.handle(g(3), m(Kind.COMMIT_ONE_PHASE, 15), b"+1"))
    # Below the floor an Abort still leaves its tombstone, a Commit is still
    # a commit without prepare.
    assert (await store.handle(g(4), m(Kind.ABORT, 15))).ack
    assert await store.entry(g(4)) == LogEntry(State.TOMBSTONE, 15)
    await refused(RefusalKind.COMMIT_WITHOUT_PREPARE, store.handle(g(5), m(Kind.COMMIT, 15)))
    # Another incarnation has its own floor.
    assert (await store.handle(g(2, 0), m(Kind.PREPARE, 15), b"ro")).vote is Vote.READ_ONLY
    assert (await store.handle(g(1), m(Kind.ABORT, 20))).ack
    store = await reopen(store)
    try:
        assert await store.term_floor(INC) == 20
        await refused(RefusalKind.STALE_TERM, store.handle(g(6), m(Kind.PREPARE, 19), b"+1"))
        assert query(pg_db, f"SELECT incarnation, term FROM {FLOOR_TABLE} ORDER BY incarnation") == [
            (0, 15),
            (INC, 20),
        ]
    finally:
        await store.close()


async def test_concurrent_messages_never_lower_the_floor(store: PgParticipantStore, pg_db: str) -> None:
    terms = list(range(30, 10, -1))
    await asyncio.gather(*(store.handle(g(100 + t), m(Kind.ABORT, t)) for t in terms))
    assert query(pg_db, f"SELECT term FROM {FLOOR_TABLE} WHERE incarnation = %s", (INC,)) == [(30,)]


async def test_one_phase_commits(store: PgParticipantStore, pg_db: str) -> None:
    assert (await store.handle(g(1), m(Kind.COMMIT_ONE_PHASE), b"+2")).ack
    assert gids(pg_db) == [] and value(pg_db) == 2
    assert await store.entry(g(1)) == LogEntry(State.COMMITTED, 10)
    assert (await store.handle(g(1), m(Kind.COMMIT_ONE_PHASE, 11), b"+2")).ack
    await refused(RefusalKind.ABORT_AFTER_COMMIT, store.handle(g(1), m(Kind.ABORT, 11)))
    # (The floor is 11 now.)
    no = await store.handle(g(2), m(Kind.COMMIT_ONE_PHASE, 11), b"no")
    assert no.vote is Vote.NO
    assert await store.entry(g(2)) == LogEntry(State.ABORTED, 11)
    assert (await store.handle(g(3), m(Kind.COMMIT_ONE_PHASE, 11), b"ro")).ack
    assert await store.entry(g(3)) == LogEntry(State.COMMITTED, 11)
    # A prepared transaction: the one-phase commit is its decision.
    assert (await store.handle(g(4), m(Kind.PREPARE, 11), b"+5")).vote is Vote.YES
    assert (await store.handle(g(4), m(Kind.COMMIT_ONE_PHASE, 12), b"+5")).ack
    assert await store.entry(g(4)) == LogEntry(State.COMMITTED, 12)
    assert gids(pg_db) == [] and value(pg_db) == 7
    assert query(pg_db, "SELECT count(*) FROM applied") == [(2,)]


async def test_a_handler_waiting_for_a_prepared_row_votes_no_at_the_default_lock_timeout(
    store: PgParticipantStore, pg_db: str
) -> None:
    assert store.options.handler_lock_timeout_ms == 1000
    assert (await store.handle(g(1), m(Kind.PREPARE), b"+1")).vote is Vote.YES
    t0 = time.monotonic()
    a = await store.handle(g(2), m(Kind.PREPARE), b"wait")
    took = time.monotonic() - t0
    assert a.vote is Vote.NO and "handler_lock_timeout_ms = 1000" in a.reason and "55P03" in a.reason, a
    assert 0.9 <= took < 10, took
    assert await store.entry(g(2)) == LogEntry(State.ABORTED, 10)
    # The decision frees the row; the first transaction is untouched.
    assert (await store.handle(g(1), m(Kind.COMMIT))).ack
    assert value(pg_db) == 1


async def test_sessions_commit_synchronously_whatever_the_database_says(pg_db: str) -> None:
    dbname = query(pg_db, "SELECT current_database()")[0][0]
    query(pg_db, f'ALTER DATABASE "{dbname}" SET synchronous_commit = off')
    assert query(pg_db, "SHOW synchronous_commit") == [("off",)]
    s = await PgParticipantStore.open(pg_db, Ledger(), "p1")
    try:
        await install(s)

        async def show(tx: PgTx) -> Any:
            return (await tx.one("SHOW synchronous_commit"))[0]

        assert await s.read(show) == "on"
        assert (await s.handle(g(1), m(Kind.COMMIT_ONE_PHASE), b"+1")).ack
    finally:
        await s.close()


async def test_recovery_lists_prepared_transactions_and_applies_decisions_at_their_term(
    store: PgParticipantStore, pg_db: str
) -> None:
    assert (await store.handle(g(1), m(Kind.PREPARE, 10), b"+1")).vote is Vote.YES
    assert (await store.handle(g(2, 0), m(Kind.ABORT, 10))).ack
    [r] = await store.in_doubt()
    assert r.txid == g(1) and r.entry == LogEntry(State.PREPARED_YES, 10)
    # A young vote is left to the coordinator...
    assert await store.in_doubt(voted_before_ms=int(time.time() * 1000) - 60_000) == []
    # ...unless it was prepared before this process opened the store.
    store = await reopen(store)
    try:
        assert [x.txid for x in await store.in_doubt(voted_before_ms=int(time.time() * 1000) - 60_000)] == [g(1)]
        assert (await store.handle(g(1), m(Kind.PREPARE, 13), b"+1")).vote is Vote.YES
        a = await store.recover(g(1), commit=True)
        assert a is not None and a.ack
        assert await store.entry(g(1)) == LogEntry(State.COMMITTED, 13)
        assert await store.recover(g(1), commit=True) is None
        assert await store.in_doubt() == [] and value(pg_db) == 1
    finally:
        await store.close()


async def test_inspect_gc_and_groups(store: PgParticipantStore, pg_db: str) -> None:
    assert (await store.handle(g(1), m(Kind.PREPARE), b"+1")).vote is Vote.YES
    assert (await store.handle(g(2), m(Kind.ABORT))).ack
    assert (await store.handle(g(3), m(Kind.COMMIT_ONE_PHASE), b"ro")).ack
    ins = await store.inspect(INC, [1, 2, 3, 4], in_doubt=True, recent=10)
    assert [(r.txid.txid, r.entry) for r in ins.records] == [
        (1, LogEntry(State.PREPARED_YES, 10)),
        (2, LogEntry(State.TOMBSTONE, 10)),
        (3, LogEntry(State.COMMITTED, 10)),
        (4, None),
    ]
    assert [r.txid for r in ins.in_doubt] == [g(1)] and ins.in_doubt_count == 1
    assert ins.records_total == 3 and len(ins.recent) == 3 and ins.oldest_in_doubt_ms
    # Decisions first: the riding Commit frees the row the Prepare needs.
    done, votes = await store.apply_then_prepare([(g(1), Kind.COMMIT, 10)], [(g(5), 10, b"+2"), (g(1), 10, b"+2")])
    assert [getattr(x, "ack", None) for x in done] == [True]
    assert [getattr(x, "vote", None) for x in votes] == [Vote.YES, Vote.YES]
    assert (await store.handle(g(5), m(Kind.COMMIT))).ack
    assert value(pg_db) == 3
    # GC: decided rows go; the floor stays; a prepared transaction is never a candidate.
    assert (await store.handle(g(6), m(Kind.PREPARE), b"+1")).vote is Vote.YES
    cands = await store.gc_candidates(int(time.time() * 1000) + 1000)
    assert sorted(t.txid for _, t in cands) == [1, 2, 3, 5]
    page = await store.gc_candidates(int(time.time() * 1000) + 1000, limit=2)
    rest = await store.gc_candidates(
        int(time.time() * 1000) + 1000, after=(page[-1][0], page[-1][1].incarnation, page[-1][1].txid)
    )
    assert [t for _, t in page + rest] == [t for _, t in cands]
    assert await store.forget([t for _, t in cands]) == 4
    assert await store.term_floor(INC) == 10
    await refused(RefusalKind.STALE_TERM, store.handle(g(9), m(Kind.PREPARE, 9), b"+1"))
    assert (await store.handle(g(6), m(Kind.ABORT))).ack


async def test_a_cancelled_call_still_finishes_its_step(store: PgParticipantStore, pg_db: str) -> None:
    call = asyncio.create_task(store.handle(g(1), m(Kind.PREPARE), b"slow"))
    await asyncio.sleep(0.1)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    # Nothing half done: the Prepare went to its end (the answer dropped).
    until = time.monotonic() + 10
    while await store.entry(g(1)) is None:
        assert time.monotonic() < until
        await asyncio.sleep(0.05)
    assert await store.entry(g(1)) == LogEntry(State.PREPARED_YES, 10)
    assert (await store.handle(g(1), m(Kind.PREPARE), b"slow")).vote is Vote.YES
    assert (await store.handle(g(1), m(Kind.COMMIT))).ack
    assert value(pg_db) == 1


async def test_a_log_written_by_the_rust_sdk_is_read_the_same(pg_db: str) -> None:
    s = await PgParticipantStore.open(pg_db, Ledger(), "bank-r")
    try:
        await install(s)
        # A decided row and a transaction prepared with its marker inside, as
        # participant-sdk/src/postgres.rs writes them.
        query(pg_db, f"INSERT INTO {LOG_TABLE} VALUES ('bank-r', 5, 'committed', 3, 0)")
        c = await psycopg.AsyncConnection.connect(pg_db, autocommit=True)
        await c.execute("BEGIN")
        await c.execute("UPDATE counter SET v = v + 4 WHERE k = 'value'")
        await c.execute(f"INSERT INTO {LOG_TABLE} VALUES ('bank-r', 6, 'committed', 4, 0)")
        await c.execute("PREPARE TRANSACTION 'dtx:v1:bank-r:6:4'")
        await c.close()
        assert await s.entry(GlobalTxid(0, 5)) == LogEntry(State.COMMITTED, 3)
        assert (await s.handle(GlobalTxid(0, 5), m(Kind.COMMIT, 3))).ack
        assert await s.entry(GlobalTxid(0, 6)) == LogEntry(State.PREPARED_YES, 4)
        assert [r.txid for r in await s.in_doubt()] == [GlobalTxid(0, 6)]
        assert (await s.handle(GlobalTxid(0, 6), m(Kind.COMMIT, 4))).ack
        assert value(pg_db) == 4 and gids(pg_db) == []
        assert await s.entry(GlobalTxid(0, 6)) == LogEntry(State.COMMITTED, 4)
    finally:
        await s.close()


async def test_opening_checks_max_prepared_transactions(pg_db: str) -> None:
    with pytest.raises(StoreError, match="max_prepared_transactions"):
        await PgParticipantStore.open(pg_db, Ledger(), "p1", PgOptions(concurrency=100_000))
