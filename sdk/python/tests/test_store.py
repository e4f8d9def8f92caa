"""The SQLite store: the log record and the resource's change in one
transaction, what survives a reopen, the grouped calls, the term floor,
and the guards (another participant's log, a resource that tries to end
the transaction)."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from dtx.metadata import RefusalKind
from dtx.participant import (
    GlobalTxid,
    Kind,
    LogEntry,
    Message,
    ParticipantStore,
    Refuse,
    Refused,
    Resource,
    SqlTx,
    State,
    StoreError,
    Vote,
)
from dtx.participant.store import ABORTED_HERE_BEFORE, ResourceFailed


class Counter(Resource):
    """Payload ``+N``: stage N for the counter (locked by one transaction at
    a time); ``ro``: read only; ``no``: refuse; ``boom``: raise. Counts
    every call, in its own table, inside the store's transaction."""

    def __init__(self) -> None:
        self.fail_commit = False

    def setup(self, db: SqlTx) -> None:
        db.execute("CREATE TABLE IF NOT EXISTS counter (k TEXT PRIMARY KEY, v INTEGER NOT NULL)")
        db.execute("INSERT OR IGNORE INTO counter VALUES ('value', 0)")
        db.execute("CREATE TABLE IF NOT EXISTS staged (tx TEXT PRIMARY KEY, n INTEGER NOT NULL)")
        db.execute("CREATE TABLE IF NOT EXISTS calls (what TEXT, tx TEXT)")

    def prepare(self, db: SqlTx, txid: GlobalTxid, payload: bytes) -> Vote:
        db.execute("INSERT INTO calls VALUES ('prepare', ?)", (str(txid),))
        p = payload.decode()
        if p == "ro":
            return Vote.READ_ONLY
        if p == "no":
            return Vote.NO
        if p == "boom":
            raise RuntimeError("boom")
        if db.one("SELECT COUNT(*) FROM staged")[0] > 0:
            raise Refuse("locked")
        db.execute("INSERT INTO staged VALUES (?, ?)", (str(txid), int(p)))
        return Vote.YES

    def commit(self, db: SqlTx, txid: GlobalTxid) -> None:
        db.execute("INSERT INTO calls VALUES ('commit', ?)", (str(txid),))
        if self.fail_commit:
            raise RuntimeError("commit failed")
        row = db.one("SELECT n FROM staged WHERE tx = ?", (str(txid),))
        if row is not None:
            db.execute("UPDATE counter SET v = v + ? WHERE k = 'value'", (row[0],))
        db.execute("DELETE FROM staged WHERE tx = ?", (str(txid),))

    def abort(self, db: SqlTx, txid: GlobalTxid) -> None:
        db.execute("INSERT INTO calls VALUES ('abort', ?)", (str(txid),))
        db.execute("DELETE FROM staged WHERE tx = ?", (str(txid),))


def g(txid: int, inc: int = 7) -> GlobalTxid:
    return GlobalTxid(inc, txid)


def m(kind: Kind, term: int = 10) -> Message:
    return Message(kind, term)


def peek(path: Path, sql: str) -> list[tuple[object, ...]]:
    """What another process sees: a connection of its own."""
    conn = sqlite3.connect(path)
    try:
        return conn.execute(sql).fetchall()
    finally:
        conn.close()


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return tmp_path / "p.db"


@pytest.fixture
def store(path: Path):  # type: ignore[no-untyped-def]
    s = ParticipantStore(path, Counter(), "p1")
    yield s
    s.close()


def test_the_database_is_wal_with_full_sync(store: ParticipantStore, path: Path) -> None:
    assert peek(path, "PRAGMA journal_mode") == [("wal",)]

    # The store's own connection: FULL (2).
    assert store._pool.submit(lambda: store._db.execute("PRAGMA synchronous").fetchone()[0]).result() == 2


async def test_yes_keeps_the_staged_work_with_the_record_and_a_repeat_does_not_run_it(
    store: ParticipantStore, path: Path
) -> None:
    a = await store.handle(g(1), m(Kind.PREPARE), b"5")
    assert a.vote is Vote.YES
    assert peek(path, "SELECT tx, n FROM staged") == [(str(g(1)), 5)]
    assert await store.entry(g(1)) == LogEntry(State.PREPARED_YES, 10)
    # A repeat, with another payload: the recorded vote, the resource not called.
    a = await store.handle(g(1), m(Kind.PREPARE, 11), b"9")
    assert a.vote is Vote.YES
    assert peek(path, "SELECT COUNT(*) FROM calls WHERE what = 'prepare'") == [(1,)]
    assert await store.entry(g(1)) == LogEntry(State.PREPARED_YES, 11)
    assert (await store.handle(g(1), m(Kind.COMMIT, 11))).ack
    assert (await store.handle(g(1), m(Kind.COMMIT, 11))).ack
    assert peek(path, "SELECT v FROM counter") == [(5,)]
    assert peek(path, "SELECT COUNT(*) FROM calls WHERE what = 'commit'") == [(1,)]
    with pytest.raises(Refused) as r:
        await store.handle(g(1), m(Kind.ABORT, 11))
    assert r.value.refusal.kind is RefusalKind.ABORT_AFTER_COMMIT


async def test_no_and_read_only_drop_the_staged_writes(store: ParticipantStore, path: Path) -> None:
    a = await store.handle(g(1), m(Kind.PREPARE), b"no")
    assert a.vote is Vote.NO and a.reason == "the resource refused"
    a = await store.handle(g(2), m(Kind.PREPARE), b"ro")
    assert a.vote is Vote.READ_ONLY
    a = await store.handle(g(3), m(Kind.PREPARE), b"boom")
    assert a.vote is Vote.NO and "boom" in a.reason
    # Every call wrote a 'calls' row inside the savepoint: all rolled back.
    assert peek(path, "SELECT COUNT(*) FROM calls") == [(0,)]
    assert await store.entry(g(1)) == LogEntry(State.ABORTED, 10)
    assert await store.entry(g(2)) == LogEntry(State.PREPARED_READ_ONLY, 10)
    a = await store.handle(g(1), m(Kind.PREPARE), b"5")
    assert a.vote is Vote.NO and a.reason == ABORTED_HERE_BEFORE
    # A refusal names its reason.
    assert (await store.handle(g(4), m(Kind.PREPARE), b"1")).vote is Vote.YES
    a = await store.handle(g(5), m(Kind.PREPARE), b"1")
    assert a.vote is Vote.NO and a.reason == "locked"


async def test_a_failing_commit_changes_nothing_and_a_redelivery_applies_it_once(path: Path) -> None:
    res = Counter()
    store = ParticipantStore(path, res, "p1")
    try:
        assert (await store.handle(g(1), m(Kind.PREPARE), b"3")).vote is Vote.YES
        res.fail_commit = True
        with pytest.raises(ResourceFailed):
            await store.handle(g(1), m(Kind.COMMIT))
        assert await store.entry(g(1)) == LogEntry(State.PREPARED_YES, 10)
        assert peek(path, "SELECT COUNT(*) FROM calls WHERE what = 'commit'") == [(0,)]
        res.fail_commit = False
        assert (await store.handle(g(1), m(Kind.COMMIT))).ack
        assert peek(path, "SELECT v FROM counter") == [(3,)]
    finally:
        store.close()


async def test_records_the_floor_and_the_work_survive_a_reopen(path: Path) -> None:
    s = ParticipantStore(path, Counter(), "p1")
    assert (await s.handle(g(1), m(Kind.PREPARE, 9), b"4")).vote is Vote.YES
    assert (await s.handle(g(2), m(Kind.ABORT, 3))).ack
    s.close()
    s = ParticipantStore(path, Counter(), "p1")
    try:
        assert await s.entry(g(1)) == LogEntry(State.PREPARED_YES, 9)
        assert await s.entry(g(2)) == LogEntry(State.TOMBSTONE, 3)
        assert await s.term_floor(7) == 9
        assert [r.txid for r in await s.in_doubt()] == [g(1)]
        with pytest.raises(Refused) as r:
            await s.handle(g(3), m(Kind.PREPARE, 8), b"1")
        assert r.value.refusal.kind is RefusalKind.STALE_TERM
        # Another incarnation has its own floor.
        assert (await s.handle(g(3, inc=8), m(Kind.ABORT, 1))).ack
        assert (await s.handle(g(1), m(Kind.COMMIT, 9))).ack
        assert peek(path, "SELECT v FROM counter") == [(4,)]
    finally:
        s.close()


async def test_a_rollback_journal_syncs_its_directory_and_keeps_what_it_committed(path: Path) -> None:
    # journal_mode="delete": for filesystems without shared memory maps
    # (the harness's power-cut filesystem), with synchronous=EXTRA.
    s = ParticipantStore(path, Counter(), "p1", journal_mode="delete")
    try:
        conn = sqlite3.connect(str(path))
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "delete"
        conn.close()
        assert (await s.handle(g(1), m(Kind.PREPARE, 9), b"4")).vote is Vote.YES
        assert (await s.handle(g(1), m(Kind.COMMIT, 9))).ack
    finally:
        s.close()
    assert not Path(str(path) + "-wal").exists()
    s = ParticipantStore(path, Counter(), "p1", journal_mode="delete")
    try:
        assert await s.entry(g(1)) == LogEntry(State.COMMITTED, 9)
        assert peek(path, "SELECT v FROM counter") == [(4,)]
        # The store's own connection runs with EXTRA (3).
        assert s._pool.submit(lambda: s._db.execute("PRAGMA synchronous").fetchone()[0]).result() == 3
    finally:
        s.close()
    with pytest.raises(StoreError, match="journal_mode"):
        ParticipantStore(path, Counter(), "p1", journal_mode="truncate")


async def test_a_log_serves_one_participant_id(path: Path) -> None:
    ParticipantStore(path, Counter(), "p1").close()
    with pytest.raises(StoreError, match="p1"):
        ParticipantStore(path, Counter(), "p2")
    # Without an id it takes the one recorded.
    s = ParticipantStore(path, Counter())
    assert s.participant_id == "p1"
    s.close()


async def test_a_resource_may_not_end_the_transaction(tmp_path: Path) -> None:
    class Rogue(Counter):
        def prepare(self, db: SqlTx, txid: GlobalTxid, payload: bytes) -> Vote:
            db.execute("COMMIT")
            return Vote.YES

    s = ParticipantStore(tmp_path / "r.db", Rogue(), "p1")
    try:
        a = await s.handle(g(1), m(Kind.PREPARE), b"1")
        assert a.vote is Vote.NO and "SDK owns the transaction" in a.reason
    finally:
        s.close()


async def test_the_group_applies_decisions_first_and_each_item_alone(store: ParticipantStore, path: Path) -> None:
    assert (await store.handle(g(1), m(Kind.PREPARE), b"2")).vote is Vote.YES
    assert (await store.handle(g(9, inc=8), m(Kind.PREPARE, 20), b"ro")).vote is Vote.READ_ONLY
    done, votes = await store.apply_then_prepare(
        [
            (g(1), Kind.COMMIT, 10),
            (g(1), Kind.COMMIT, 10),
            (g(2), Kind.ABORT, 10),
            (g(3), Kind.COMMIT, 10),
            (g(9, inc=8), Kind.ABORT, 19),
        ],
        [(g(4), 10, b"6"), (g(4), 10, b"7"), (g(2), 10, b"1"), (g(5), 10, b"1")],
    )
    assert [d.ack if not isinstance(d, StoreError) else type(d).__name__ for d in done] == [
        True,
        True,
        True,
        "Refused",
        "Refused",
    ]
    assert isinstance(done[3], Refused) and done[3].refusal.kind is RefusalKind.COMMIT_WITHOUT_PREPARE
    assert isinstance(done[4], Refused) and done[4].refusal.kind is RefusalKind.STALE_TERM
    # The commit freed the lock before the prepares: item 1 votes YES,
    # item 2 repeats it, the tombstoned txid votes NO, item 4 finds the lock.
    assert [v.vote if not isinstance(v, StoreError) else v for v in votes] == [
        Vote.YES,
        Vote.YES,
        Vote.NO,
        Vote.NO,
    ]
    assert peek(path, "SELECT v FROM counter") == [(2,)]
    assert peek(path, "SELECT tx, n FROM staged") == [(str(g(4)), 6)]
    assert await store.entry(g(3)) is None
    assert await store.entry(g(2)) == LogEntry(State.TOMBSTONE, 10)


async def test_u64_ids_and_terms_above_2_63(store: ParticipantStore) -> None:
    big = GlobalTxid((1 << 64) - 1, (1 << 63) + 5)
    assert (await store.handle(big, m(Kind.PREPARE, (1 << 63) + 1), b"1")).vote is Vote.YES
    assert await store.entry(big) == LogEntry(State.PREPARED_YES, (1 << 63) + 1)
    assert await store.term_floor(big.incarnation) == (1 << 63) + 1
    with pytest.raises(Refused):
        await store.handle(big, m(Kind.COMMIT, 5))
    [r] = await store.in_doubt()
    assert r.txid == big


async def test_gc_forgets_decided_records_but_keeps_the_floor(store: ParticipantStore) -> None:
    assert (await store.handle(g(1), m(Kind.PREPARE, 12), b"1")).vote is Vote.YES
    assert (await store.handle(g(1), m(Kind.COMMIT, 12))).ack
    assert (await store.handle(g(2), m(Kind.PREPARE, 12), b"1")).vote is Vote.YES
    cands = await store.gc_candidates(2**62)
    assert [t for _, t in cands] == [g(1)]
    assert await store.forget([g(1), g(2)]) == 1  # the in-doubt one is never forgotten
    assert await store.entry(g(1)) is None
    assert await store.entry(g(2)) is not None
    assert await store.term_floor(7) == 12
    # A re-sent one-phase commit from a deposed leader is refused by the floor.
    with pytest.raises(Refused):
        await store.handle(g(1), m(Kind.COMMIT_ONE_PHASE, 11), b"1")


async def test_one_phase_commits_at_once_and_repeats_its_answer(store: ParticipantStore, path: Path) -> None:
    assert (await store.handle(g(1), m(Kind.COMMIT_ONE_PHASE), b"5")).ack
    assert await store.entry(g(1)) == LogEntry(State.COMMITTED, 10)
    assert (await store.handle(g(1), m(Kind.COMMIT_ONE_PHASE), b"5")).ack
    assert peek(path, "SELECT v FROM counter") == [(5,)]
    a = await store.handle(g(2), m(Kind.COMMIT_ONE_PHASE), b"no")
    assert a.vote is Vote.NO
    assert await store.entry(g(2)) == LogEntry(State.ABORTED, 10)
    assert (await store.handle(g(3), m(Kind.COMMIT_ONE_PHASE), b"ro")).ack
    assert await store.entry(g(3)) == LogEntry(State.COMMITTED, 10)
    assert peek(path, "SELECT COUNT(*) FROM staged") == [(0,)]
