"""The participant's durable store: its log records and the resource's own
tables in ONE SQLite database, so a log transition and the resource change
that goes with it are one SQLite transaction, and an answer (vote or ack)
is sent only after that transaction's COMMIT returned.

Durability: ``PRAGMA journal_mode=WAL`` and ``PRAGMA synchronous=FULL``:
SQLite syncs the write-ahead log at every COMMIT, so a committed
transaction survives a power cut, and other processes may read the
database while the service runs (the bank's ``balance`` command). On a
filesystem that cannot map shared memory (WAL's index needs it: a FUSE
filesystem with direct I/O, as the harness's power-cut filesystem), open
it with ``journal_mode="delete"``: a rollback journal, with
``synchronous=EXTRA`` so that the journal's unlink, the commit itself, is
synced to its directory before COMMIT returns.

Every call runs on one worker thread that owns the connection, one at a
time (the store's serialization: read the record, step, run the resource,
write, commit), so a :class:`Resource` needs no locking of its own, and a
request never reads a record whose transaction is not committed (a
repeated message cannot be answered ahead of the write it repeats).

Tables (``dtx_`` prefix; the resource's own tables are its business):

- ``dtx_log(incarnation, txid, state, term, recorded_ms)``: one record per
  transaction, keyed by (incarnation, txid); ``state`` holds the
  ``dtx.v1.LocalRecord`` value, ``recorded_ms`` when the record got its
  current state (ms since the Unix epoch).
- ``dtx_term_floor(incarnation, term)``: the highest term of any record
  written for that incarnation, raised in the same transaction as the
  record, never lowered (log GC keeps it).
- ``dtx_branch_mark(incarnation, txid, participant_id, marked_ms)``: a
  branch's YES prepared here whose registration with the cluster is not
  known to be recorded (:mod:`dtx.participant.branch`).
- ``dtx_meta(key, value)``: the schema version and the participant id the
  store serves (another id is refused at open).

u64 values (txids, terms, incarnations) are stored as SQLite's signed
64-bit integers (two's complement); every comparison of them is made in
Python on the unsigned values.
"""

from __future__ import annotations

import abc
import asyncio
import concurrent.futures
import logging
import os
import re
import sqlite3
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from dtx.metadata import RefusalKind
from dtx.participant.log import (
    Do,
    GlobalTxid,
    Kind,
    LogEntry,
    Message,
    Refusal,
    State,
    Vote,
    collectable,
    prepared,
    step,
)

log = logging.getLogger("dtx.participant")

SCHEMA_VERSION = "1"
#: The reason a NO vote gives when the resource named none.
NO_REASON_DEFAULT = "the resource refused"
#: The reason of a NO vote that repeats what the log holds.
ABORTED_HERE_BEFORE = "this transaction was aborted here before (a NO vote, an abort or a tombstone is recorded)"

T = TypeVar("T")


def unix_ms() -> int:
    return time.time_ns() // 1_000_000


def _s64(u: int) -> int:
    """A u64 as SQLite stores it."""
    if not 0 <= u < (1 << 64):
        raise ValueError(f"{u} is not a u64")
    return u - (1 << 64) if u >= (1 << 63) else u


def _u64(s: int) -> int:
    return s + (1 << 64) if s < 0 else s


class Refuse(Exception):  # noqa: N818 - it is a vote, not an error
    """Raised by :meth:`Resource.prepare` to vote NO for ``reason`` (sent to
    the coordinator with the vote); the writes it made are rolled back."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


_CONTROL = re.compile(r"^\s*(BEGIN|COMMIT|END|ROLLBACK|SAVEPOINT|RELEASE|ATTACH|DETACH|VACUUM)\b", re.I)


class SqlTx:
    """The resource's view of the open SQLite transaction: its statements
    become durable together with the log record, or not at all. Statements
    that would end or nest the transaction are refused."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self._conn = conn

    def _check(self, sql: str) -> None:
        if _CONTROL.match(sql):
            raise sqlite3.ProgrammingError(
                f"a resource may not run {sql.split()[0].upper()}: the SDK owns the transaction"
            )

    def execute(self, sql: str, params: Sequence[Any] | dict[str, Any] = ()) -> sqlite3.Cursor:
        self._check(sql)
        return self._conn.execute(sql, params)

    def executemany(self, sql: str, rows: Sequence[Sequence[Any]]) -> sqlite3.Cursor:
        self._check(sql)
        return self._conn.executemany(sql, rows)

    def one(self, sql: str, params: Sequence[Any] | dict[str, Any] = ()) -> Any:
        """The first row of a query, or None."""
        return self.execute(sql, params).fetchone()

    def all(self, sql: str, params: Sequence[Any] | dict[str, Any] = ()) -> list[Any]:
        return self.execute(sql, params).fetchall()


class Resource(abc.ABC):
    """What a service implements: its work under two-phase commit, on its
    own tables in the store's SQLite database. Calls are serialized (one at
    a time, on the store's thread) and run inside the store's transaction,
    which also writes the log record; none may block on the network or end
    the transaction.
    """

    def setup(self, db: SqlTx) -> None:  # noqa: B027 - optional
        """Creates the resource's tables (``CREATE TABLE IF NOT EXISTS``);
        called at every open, in a transaction of its own."""

    @abc.abstractmethod
    def prepare(self, db: SqlTx, txid: GlobalTxid, payload: bytes) -> Vote:
        """Checks and stages the work of ``txid``: write what must hold
        until the decision (locks, pending work). YES: the writes become
        durable with the PREPARED record. NO (or ``raise Refuse(reason)``,
        or any exception): the writes are rolled back. READ_ONLY: the writes
        are rolled back and no phase two follows."""

    @abc.abstractmethod
    def commit(self, db: SqlTx, txid: GlobalTxid) -> None:
        """Makes the prepared work of ``txid`` visible and releases its locks.
        An exception rolls everything back and the Commit is answered
        INTERNAL (the coordinator delivers it again)."""

    @abc.abstractmethod
    def abort(self, db: SqlTx, txid: GlobalTxid) -> None:
        """Rolls the prepared work of ``txid`` back and releases its locks."""


class StoreError(Exception):
    """Why a message was not answered with a vote or an ack."""


class Refused(StoreError):
    """A refusal of the log (stale term, protocol violation): nothing changed."""

    def __init__(self, refusal: Refusal) -> None:
        super().__init__(refusal.message())
        self.refusal = refusal


class Damaged(StoreError):
    """A log record this build cannot read."""


class ResourceFailed(StoreError):
    """The resource raised in commit or abort: nothing changed."""


class StoreUnavailable(StoreError):
    """The store cannot answer now, and nothing changed (answered
    UNAVAILABLE: the coordinator asks again): its database is locked or out
    of reach, or no connection was free in time."""


class StoreBusy(StoreUnavailable):
    """The database was locked by another connection longer than the busy
    timeout: nothing changed; the caller asks again."""


@dataclass(frozen=True)
class StoreFailure:
    """Why the store stopped: a write or a commit (its fsync) failed."""

    path: str
    disk_full: bool
    detail: str

    def __str__(self) -> str:
        what = "the disk is full" if self.disk_full else "a write failed"
        return f"participant store {self.path}: {what} ({self.detail}); stopped: restart the service"


class StoreStopped(StoreError):
    """The store stopped at an earlier failed write; it answers nothing
    until the service is restarted (which reopens what is on disk)."""

    def __init__(self, failure: StoreFailure) -> None:
        super().__init__(str(failure))
        self.failure = failure


@dataclass(frozen=True)
class Answer:
    """A message's answer: a vote (Prepare; a one-phase commit that did not
    commit answers NO) or an ack (Commit, Abort; a one-phase commit that
    committed)."""

    vote: Vote | None
    reason: str = ""

    @property
    def ack(self) -> bool:
        return self.vote is None


ACK = Answer(None)


@dataclass(frozen=True)
class Record:
    """A log record as Inspect shows it."""

    txid: GlobalTxid
    entry: LogEntry | None
    recorded_ms: int


@dataclass(frozen=True)
class Inspection:
    records: list[Record]
    in_doubt: list[Record]
    recent: list[Record]
    in_doubt_count: int
    records_total: int
    oldest_in_doubt_ms: int | None


_SQLITE_BUSY = {5, 6}  # SQLITE_BUSY, SQLITE_LOCKED
_SQLITE_FULL = 13


def _errcode(e: sqlite3.Error) -> int:
    return int(getattr(e, "sqlite_errorcode", 0) or 0) & 0xFF


class ParticipantStore:
    """The durable participant log and the resource's tables in one SQLite
    file. Open it with :meth:`open` (or the constructor) and close it with
    :meth:`close`."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        resource: Resource,
        participant_id: str = "",
        busy_timeout_ms: int = 5000,
        journal_mode: str = "wal",
    ) -> None:
        if journal_mode not in ("wal", "delete"):
            raise StoreError(f"journal_mode must be 'wal' or 'delete', not {journal_mode!r}")
        self.path = Path(path)
        self._journal_mode = journal_mode
        self.resource = resource
        self.participant_id = participant_id
        self._busy_timeout_ms = busy_timeout_ms
        self._failure: StoreFailure | None = None
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="dtx-store")
        self._conn: sqlite3.Connection | None = None
        self._closed = False
        #: Branches whose flow (prepare, register) runs in this process now:
        #: recovery leaves their marks alone (it would fence them out).
        self._branches_running: set[GlobalTxid] = set()
        self._pool.submit(self._open).result()

    @classmethod
    def open(cls, path: str | os.PathLike[str], resource: Resource, participant_id: str = "") -> ParticipantStore:
        return cls(path, resource, participant_id)

    # -- the worker thread ------------------------------------------------

    def _open(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        conn = sqlite3.connect(str(self.path), isolation_level=None, timeout=self._busy_timeout_ms / 1000)
        self._conn = conn
        conn.execute(f"PRAGMA busy_timeout={int(self._busy_timeout_ms)}")
        want = self._journal_mode
        mode = conn.execute(f"PRAGMA journal_mode={want.upper()}").fetchone()[0]
        if str(mode).lower() != want:
            raise StoreError(f"{self.path}: SQLite refused journal_mode={want.upper()} (it is {mode})")
        # WAL: the log synced at every COMMIT (FULL, 2). A rollback journal:
        # also its directory after the unlink that commits (EXTRA, 3).
        sync, level = ("FULL", 2) if want == "wal" else ("EXTRA", 3)
        conn.execute(f"PRAGMA synchronous={sync}")
        if conn.execute("PRAGMA synchronous").fetchone()[0] != level:
            raise StoreError(f"{self.path}: SQLite refused synchronous={sync}")
        conn.execute("BEGIN IMMEDIATE")
        try:
            conn.execute(
                "CREATE TABLE IF NOT EXISTS dtx_meta (key TEXT PRIMARY KEY, value TEXT NOT NULL) WITHOUT ROWID"
            )
            conn.execute(
                "CREATE TABLE IF NOT EXISTS dtx_log ("
                " incarnation INTEGER NOT NULL, txid INTEGER NOT NULL, state INTEGER NOT NULL,"
                " term INTEGER NOT NULL, recorded_ms INTEGER NOT NULL,"
                " PRIMARY KEY (incarnation, txid)) WITHOUT ROWID"
            )
            conn.execute("CREATE INDEX IF NOT EXISTS dtx_log_by_state ON dtx_log (state, recorded_ms)")
            conn.execute(
                "CREATE TABLE IF NOT EXISTS dtx_term_floor ("
                " incarnation INTEGER PRIMARY KEY, term INTEGER NOT NULL)"
            )
            # Branches (dtx.participant.branch): a YES prepared in a
            # handler whose registration with the cluster is not known to
            # be recorded. Written with the YES record, removed once the
            # cluster's answer is known; recovery asks about the rest.
            conn.execute(
                "CREATE TABLE IF NOT EXISTS dtx_branch_mark ("
                " incarnation INTEGER NOT NULL, txid INTEGER NOT NULL, participant_id TEXT NOT NULL,"
                " marked_ms INTEGER NOT NULL, PRIMARY KEY (incarnation, txid)) WITHOUT ROWID"
            )
            meta = dict(conn.execute("SELECT key, value FROM dtx_meta").fetchall())
            version = meta.get("schema_version")
            if version is None:
                conn.execute("INSERT INTO dtx_meta VALUES ('schema_version', ?)", (SCHEMA_VERSION,))
            elif version != SCHEMA_VERSION:
                raise StoreError(
                    f"{self.path}: participant log schema version {version}; this build reads "
                    f"version {SCHEMA_VERSION} only; nothing was changed"
                )
            pid = meta.get("participant_id")
            if self.participant_id:
                if pid is None:
                    conn.execute("INSERT INTO dtx_meta VALUES ('participant_id', ?)", (self.participant_id,))
                elif pid != self.participant_id:
                    raise StoreError(
                        f"{self.path} holds the log of participant {pid!r}, not {self.participant_id!r}: "
                        "two participants must not share a log"
                    )
            elif pid is not None:
                self.participant_id = pid
            self.resource.setup(SqlTx(conn))
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            conn.close()
            self._conn = None
            raise

    @property
    def _db(self) -> sqlite3.Connection:
        if self._conn is None:
            raise StoreError("the store is closed")
        return self._conn

    def _fail(self, e: sqlite3.Error) -> StoreError:
        """A failed statement of the store's own: busy is answered alone;
        anything else stops the store (its writes can no longer be trusted
        to reach the disk) and is logged once."""
        code = _errcode(e)
        if code in _SQLITE_BUSY:
            return StoreBusy(f"{self.path}: the database is locked by another connection ({e})")
        if self._failure is None:
            self._failure = StoreFailure(str(self.path), code == _SQLITE_FULL, str(e))
            log.error("%s", self._failure)
        return StoreStopped(self._failure)

    def _sql(self, sql: str, params: Sequence[Any] = ()) -> sqlite3.Cursor:
        try:
            return self._db.execute(sql, params)
        except sqlite3.Error as e:
            raise self._fail(e) from e

    def _check_running(self) -> None:
        if self._failure is not None:
            raise StoreStopped(self._failure)

    def _begin(self) -> None:
        self._check_running()
        self._sql("BEGIN IMMEDIATE")

    def _commit(self) -> None:
        try:
            self._db.execute("COMMIT")
        except sqlite3.Error as e:
            err = self._fail(e)
            self._rollback()
            raise err from e

    def _rollback(self) -> None:
        try:
            if self._db.in_transaction:
                self._db.execute("ROLLBACK")
        except sqlite3.Error as e:  # pragma: no cover - reported by the next write
            log.error("participant store %s: rollback failed: %s", self.path, e)

    def _entry(self, txid: GlobalTxid) -> LogEntry | None:
        row = self._sql(
            "SELECT state, term FROM dtx_log WHERE incarnation = ? AND txid = ?",
            (_s64(txid.incarnation), _s64(txid.txid)),
        ).fetchone()
        if row is None:
            return None
        try:
            return LogEntry(State(row[0]), _u64(row[1]))
        except ValueError as e:
            raise Damaged(f"the log record of {txid} holds state {row[0]!r}, which this build does not know") from e

    def _floor(self, incarnation: int) -> int:
        row = self._sql("SELECT term FROM dtx_term_floor WHERE incarnation = ?", (_s64(incarnation),)).fetchone()
        return 0 if row is None else _u64(row[0])

    def _put(self, txid: GlobalTxid, before: LogEntry | None, e: LogEntry, floor: int) -> None:
        now = unix_ms()
        if before is None:
            self._sql(
                "INSERT INTO dtx_log (incarnation, txid, state, term, recorded_ms) VALUES (?, ?, ?, ?, ?)",
                (_s64(txid.incarnation), _s64(txid.txid), int(e.state), _s64(e.term), now),
            )
        elif before.state is e.state:
            self._sql(
                "UPDATE dtx_log SET term = ? WHERE incarnation = ? AND txid = ?",
                (_s64(e.term), _s64(txid.incarnation), _s64(txid.txid)),
            )
        else:
            self._sql(
                "UPDATE dtx_log SET state = ?, term = ?, recorded_ms = ? WHERE incarnation = ? AND txid = ?",
                (int(e.state), _s64(e.term), now, _s64(txid.incarnation), _s64(txid.txid)),
            )
        if e.term > floor:
            self._sql(
                "INSERT INTO dtx_term_floor (incarnation, term) VALUES (?, ?)"
                " ON CONFLICT (incarnation) DO UPDATE SET term = excluded.term",
                (_s64(txid.incarnation), _s64(e.term)),
            )

    def _prepare_resource(self, txid: GlobalTxid, payload: bytes) -> tuple[Vote, str]:
        """The resource's vote and NO reason; its writes are kept only for YES."""
        self._sql("SAVEPOINT dtx_resource")
        reason = ""
        try:
            vote = self.resource.prepare(SqlTx(self._db), txid, payload)
            vote = Vote(vote)
        except Refuse as r:
            vote, reason = Vote.NO, r.reason or NO_REASON_DEFAULT
        except Exception as e:  # noqa: BLE001 - a resource that fails votes NO, safely
            log.exception("participant store %s: the resource's prepare of %s raised; voting NO", self.path, txid)
            vote, reason = Vote.NO, f"the resource failed: {e!r}"
        if not self._db.in_transaction:
            raise ResourceFailed(f"the resource's prepare of {txid} ended the store's transaction")
        if vote is not Vote.YES:
            self._sql("ROLLBACK TO dtx_resource")
        self._sql("RELEASE dtx_resource")
        if vote is Vote.NO and not reason:
            reason = NO_REASON_DEFAULT
        return vote, reason

    def _run_resource(self, what: str, fn: Callable[[SqlTx, GlobalTxid], None], txid: GlobalTxid) -> None:
        try:
            fn(SqlTx(self._db), txid)
        except Exception as e:
            log.exception("participant store %s: the resource's %s of %s raised", self.path, what, txid)
            raise ResourceFailed(f"the resource's {what} of {txid} failed: {e!r}") from e
        if not self._db.in_transaction:
            raise ResourceFailed(f"the resource's {what} of {txid} ended the store's transaction")

    def _stage(self, txid: GlobalTxid, msg: Message, payload: bytes) -> Answer:
        """Steps ``msg`` against ``txid``'s record inside the open
        transaction, runs the resource, writes what changed. A refusal or
        error raises; the caller rolls back."""
        before = self._entry(txid)
        floor = self._floor(txid.incarnation)
        after, action = step(before, msg, floor)
        answer = ACK
        record = after
        do = action.do
        if do is Do.REFUSE:
            assert action.refusal is not None
            raise Refused(action.refusal)
        if do is Do.PREPARE_RESOURCE:
            vote, reason = self._prepare_resource(txid, payload)
            record = prepared(msg.term, vote)
            answer = Answer(vote, reason)
        elif do is Do.ONE_PHASE_RESOURCE:
            vote, reason = self._prepare_resource(txid, payload)
            if vote is Vote.YES:
                # Prepared and committed in the same transaction: a crash
                # leaves both or neither (protocol.md allows neither: the
                # next CommitOnePhase starts afresh).
                self._run_resource("commit", self.resource.commit, txid)
                record = LogEntry(State.COMMITTED, msg.term)
            elif vote is Vote.READ_ONLY:
                record = LogEntry(State.COMMITTED, msg.term)
            else:
                record = LogEntry(State.ABORTED, msg.term)
                answer = Answer(Vote.NO, reason)
        elif do is Do.COMMIT_RESOURCE:
            self._run_resource("commit", self.resource.commit, txid)
        elif do is Do.ABORT_RESOURCE:
            self._run_resource("abort", self.resource.abort, txid)
        elif do is Do.VOTE:
            assert action.vote is not None
            answer = Answer(action.vote)
        if record is not None and record != before:
            self._put(txid, before, record, floor)
        if answer.vote is Vote.NO and not answer.reason:
            answer = Answer(Vote.NO, ABORTED_HERE_BEFORE)
        return answer

    def _handle_sync(self, txid: GlobalTxid, msg: Message, payload: bytes) -> Answer:
        self._begin()
        try:
            answer = self._stage(txid, msg, payload)
        except BaseException:
            self._rollback()
            raise
        self._commit()
        return answer

    def _item(self, txid: GlobalTxid, msg: Message, payload: bytes) -> Answer | StoreError:
        self._sql("SAVEPOINT dtx_item")
        try:
            a: Answer | StoreError = self._stage(txid, msg, payload)
        except (Refused, Damaged, ResourceFailed) as e:
            self._sql("ROLLBACK TO dtx_item")
            a = e
        self._sql("RELEASE dtx_item")
        return a

    def _group_sync(
        self,
        decisions: Sequence[tuple[GlobalTxid, Kind, int]],
        prepares: Sequence[tuple[GlobalTxid, int, bytes]],
    ) -> tuple[list[Answer | StoreError], list[Answer | StoreError]]:
        self._begin()
        try:
            done = [self._item(t, Message(k, term), b"") for t, k, term in decisions]
            votes = [self._item(t, Message(Kind.PREPARE, term), p) for t, term, p in prepares]
        except BaseException:
            self._rollback()
            raise
        self._commit()
        return done, votes

    def _recover_sync(self, txid: GlobalTxid, commit: bool) -> Answer | None:
        """Applies a decision read from the cluster to an in-doubt record,
        at the record's own term; None when it is no longer in doubt."""
        self._begin()
        try:
            e = self._entry(txid)
            if e is None or e.state is not State.PREPARED_YES:
                self._rollback()
                return None
            answer = self._stage(txid, Message(Kind.COMMIT if commit else Kind.ABORT, e.term), b"")
        except BaseException:
            self._rollback()
            raise
        self._commit()
        return answer

    def _prepare_branch_sync(self, txid: GlobalTxid, participant_id: str, payload: bytes) -> Answer | LogEntry:
        """A branch's prepare: the resource prepares ``payload`` as for a
        Prepare at the term floor, and a YES is written with its mark, in
        one SQLite transaction. The record found instead when ``txid`` has
        one already (nothing done)."""
        self._begin()
        try:
            before = self._entry(txid)
            if before is not None:
                self._rollback()
                return before
            floor = self._floor(txid.incarnation)
            answer = self._stage(txid, Message(Kind.PREPARE, floor), payload)
            if answer.vote is Vote.YES:
                self._sql(
                    "INSERT OR REPLACE INTO dtx_branch_mark (incarnation, txid, participant_id, marked_ms)"
                    " VALUES (?, ?, ?, ?)",
                    (_s64(txid.incarnation), _s64(txid.txid), participant_id, unix_ms()),
                )
        except BaseException:
            self._rollback()
            raise
        self._commit()
        return answer

    def _branch_marks_sync(self) -> list[tuple[GlobalTxid, str]]:
        self._check_running()
        rows = self._sql("SELECT incarnation, txid, participant_id FROM dtx_branch_mark ORDER BY marked_ms").fetchall()
        return [(GlobalTxid(_u64(inc), _u64(t)), pid) for inc, t, pid in rows]

    def _unmark_branch_sync(self, txid: GlobalTxid) -> None:
        self._begin()
        try:
            self._sql(
                "DELETE FROM dtx_branch_mark WHERE incarnation = ? AND txid = ?",
                (_s64(txid.incarnation), _s64(txid.txid)),
            )
        except BaseException:
            self._rollback()
            raise
        self._commit()

    def _read_entry(self, txid: GlobalTxid) -> LogEntry | None:
        self._check_running()
        return self._entry(txid)

    def _rows(self, sql: str, params: Sequence[Any] = ()) -> list[Record]:
        out = []
        for inc, txid, state, term, ms in self._sql(sql, params).fetchall():
            g = GlobalTxid(_u64(inc), _u64(txid))
            try:
                entry: LogEntry | None = LogEntry(State(state), _u64(term))
            except ValueError as e:
                raise Damaged(f"the log record of {g} holds state {state!r}") from e
            out.append(Record(g, entry, ms))
        return out

    def _floor_sync(self, incarnation: int) -> int:
        self._check_running()
        return self._floor(incarnation)

    def _in_doubt_sync(self, voted_before_ms: int | None) -> list[Record]:
        self._check_running()
        cols = "SELECT incarnation, txid, state, term, recorded_ms FROM dtx_log"
        if voted_before_ms is None:
            return self._rows(f"{cols} WHERE state = ? ORDER BY recorded_ms, incarnation, txid", (int(State.PREPARED_YES),))
        return self._rows(
            f"{cols} WHERE state = ? AND recorded_ms <= ? ORDER BY recorded_ms, incarnation, txid",
            (int(State.PREPARED_YES), voted_before_ms),
        )

    def _inspect_sync(self, incarnation: int, txids: Sequence[int], in_doubt: bool, recent: int, list_max: int) -> Inspection:
        self._check_running()
        cols = "SELECT incarnation, txid, state, term, recorded_ms FROM dtx_log"
        records = []
        for t in txids:
            g = GlobalTxid(incarnation, t)
            found = self._rows(f"{cols} WHERE incarnation = ? AND txid = ?", (_s64(incarnation), _s64(t)))
            records.append(found[0] if found else Record(g, None, 0))
        doubt = (
            self._rows(
                f"{cols} WHERE state = ? ORDER BY recorded_ms, incarnation, txid LIMIT ?",
                (int(State.PREPARED_YES), list_max),
            )
            if in_doubt
            else []
        )
        newest = (
            self._rows(f"{cols} ORDER BY recorded_ms DESC, incarnation DESC, txid DESC LIMIT ?", (recent,))
            if recent > 0
            else []
        )
        count, oldest = self._sql(
            "SELECT COUNT(*), MIN(recorded_ms) FROM dtx_log WHERE state = ?", (int(State.PREPARED_YES),)
        ).fetchone()
        total = self._sql("SELECT COUNT(*) FROM dtx_log").fetchone()[0]
        return Inspection(records, doubt, newest, int(count), int(total), oldest)

    def _gc_candidates_sync(
        self, decided_before_ms: int, after: tuple[int, int, int] | None, limit: int
    ) -> list[tuple[int, GlobalTxid]]:
        self._check_running()
        sql = "SELECT recorded_ms, incarnation, txid FROM dtx_log WHERE state != ? AND recorded_ms <= ?"
        params: list[int] = [int(State.PREPARED_YES), decided_before_ms]
        if after is not None:
            # Row values compare as stored (signed), like the ORDER BY.
            sql += " AND (recorded_ms, incarnation, txid) > (?, ?, ?)"
            params += [after[0], _s64(after[1]), _s64(after[2])]
        rows = self._sql(sql + " ORDER BY recorded_ms, incarnation, txid LIMIT ?", (*params, limit)).fetchall()
        return [(ms, GlobalTxid(_u64(inc), _u64(txid))) for ms, inc, txid in rows]

    def _forget_sync(self, txids: Sequence[GlobalTxid]) -> int:
        self._begin()
        n = 0
        try:
            for t in txids:
                e = self._entry(t)
                if not collectable(e):
                    continue
                self._sql("DELETE FROM dtx_log WHERE incarnation = ? AND txid = ?", (_s64(t.incarnation), _s64(t.txid)))
                n += 1
        except BaseException:
            self._rollback()
            raise
        self._commit()
        return n

    def _write_sync(self, fn: Callable[[SqlTx], T]) -> T:
        self._begin()
        try:
            out = fn(SqlTx(self._db))
        except BaseException:
            self._rollback()
            raise
        self._commit()
        return out

    def _read_sync(self, fn: Callable[[SqlTx], T]) -> T:
        self._check_running()
        return fn(SqlTx(self._db))

    def _close_sync(self) -> None:
        if self._conn is not None:
            try:
                self._conn.close()
            finally:
                self._conn = None

    # -- the async API ----------------------------------------------------

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        if self._closed:
            raise StoreError("the store is closed")
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def handle(self, txid: GlobalTxid, msg: Message, payload: bytes = b"") -> Answer:
        """One coordinator message: step, run the resource, write the record
        and the resource's change in one transaction, commit (fsync), then
        return the answer. Raises :class:`Refused` for a refusal and another
        :class:`StoreError` when the store cannot answer."""
        return await self._run(self._handle_sync, txid, msg, payload)

    async def apply_then_prepare(
        self,
        decisions: Sequence[tuple[GlobalTxid, Kind, int]],
        prepares: Sequence[tuple[GlobalTxid, int, bytes]],
    ) -> tuple[list[Answer | StoreError], list[Answer | StoreError]]:
        """Many decisions (``Kind.COMMIT`` or ``Kind.ABORT`` with the term),
        then many prepares (term and payload), in ONE SQLite transaction:
        each item goes through exactly what its own message does, on the
        writes of the items before it, in its own savepoint, so a refused
        item changes nothing. One result per item: the answer, or the
        error its own call would have failed with. Raises only when the
        store cannot write (then nothing is acked and no vote given)."""
        return await self._run(self._group_sync, list(decisions), list(prepares))

    async def recover(self, txid: GlobalTxid, commit: bool) -> Answer | None:
        """Applies a decision learned from the cluster to an in-doubt record
        at its own term (recovery); None when it is not in doubt now."""
        return await self._run(self._recover_sync, txid, commit)

    async def entry(self, txid: GlobalTxid) -> LogEntry | None:
        """The committed record of ``txid`` (what Inquire answers)."""
        return await self._run(self._read_entry, txid)

    async def term_floor(self, incarnation: int) -> int:
        return await self._run(self._floor_sync, incarnation)

    async def in_doubt(self, voted_before_ms: int | None = None) -> list[Record]:
        """Records holding a YES vote without a decision, oldest first (only
        those voted at or before ``voted_before_ms`` when given)."""
        return await self._run(self._in_doubt_sync, voted_before_ms)

    async def inspect(
        self, incarnation: int, txids: Sequence[int], in_doubt: bool, recent: int, list_max: int = 1000
    ) -> Inspection:
        return await self._run(self._inspect_sync, incarnation, list(txids), in_doubt, recent, list_max)

    async def gc_candidates(
        self, decided_before_ms: int, after: tuple[int, int, int] | None = None, limit: int = 10_000
    ) -> list[tuple[int, GlobalTxid]]:
        """Collectable records (decided, or READ_ONLY votes) that got their
        state at or before ``decided_before_ms``, oldest first, after the
        cursor ``(recorded_ms, incarnation, txid)``."""
        return await self._run(self._gc_candidates_sync, decided_before_ms, after, limit)

    async def forget(self, txids: Sequence[GlobalTxid]) -> int:
        """Removes collectable records (only once the cluster will send
        nothing more for them); the term floors stay. Returns how many."""
        return await self._run(self._forget_sync, list(txids))

    async def write(self, fn: Callable[[SqlTx], T]) -> T:
        """Runs ``fn`` in a transaction of its own, outside any dtx
        transaction (for example the initial rows of a new service)."""
        return await self._run(self._write_sync, fn)

    async def read(self, fn: Callable[[SqlTx], T]) -> T:
        """Runs ``fn`` on the store's thread (reads only)."""
        return await self._run(self._read_sync, fn)

    async def prepare_branch(self, txid: GlobalTxid, participant_id: str, payload: bytes) -> Answer | LogEntry:
        """A branch that prepares where it runs (docs/protocol.md,
        "Branches"; :func:`dtx.participant.branch.join` drives it): the
        resource prepares ``payload`` for ``txid`` as for a Prepare, and a
        YES is written with a mark "branch ``participant_id`` not known to
        be registered" in the same SQLite transaction (synced before this
        returns). Returns the answer, or the record ``txid`` already has
        here (then nothing was done). A YES leaves ``txid`` in the running
        set until :meth:`finish_branch`, so recovery does not ask about a
        branch whose registration is on its way."""
        fresh = txid not in self._branches_running
        self._branches_running.add(txid)
        held = False
        try:
            out = await self._run(self._prepare_branch_sync, txid, participant_id, payload)
            held = isinstance(out, Answer) and out.vote is Vote.YES
            return out
        finally:
            if fresh and not held:
                self._branches_running.discard(txid)

    async def finish_branch(self, txid: GlobalTxid, settled: bool) -> None:
        """The branch flow of ``txid`` in this process ended: ``settled``
        when the cluster's answer is known (registered, or refused and
        rolled back here), so its mark goes; otherwise the mark stays for
        recovery."""
        self._branches_running.discard(txid)
        if settled:
            await self.unmark_branch(txid)

    async def branch_marks(self) -> list[tuple[GlobalTxid, str]]:
        """Every branch mark (transaction, participant id), running or not."""
        return await self._run(self._branch_marks_sync)

    async def unregistered_branches(self) -> list[tuple[GlobalTxid, str]]:
        """The marked branches whose flow does not run in this process now:
        their registration is not known to be recorded (recovery asks the
        cluster with GetBranchDecision)."""
        marks = await self.branch_marks()
        return [(t, pid) for t, pid in marks if t not in self._branches_running]

    def branch_running(self, txid: GlobalTxid) -> bool:
        return txid in self._branches_running

    async def unmark_branch(self, txid: GlobalTxid) -> None:
        """The branch of ``txid`` is settled with the cluster: its mark goes
        (a mark that survives a crash only makes recovery ask again)."""
        await self._run(self._unmark_branch_sync, txid)

    def failure(self) -> StoreFailure | None:
        """Why the store stopped, if it has."""
        return self._failure

    async def stopped(self, poll_s: float = 0.1) -> StoreFailure:
        """Waits until the store stops (a write failed) and says why. A
        service should then exit so that its supervisor restarts it."""
        while self._failure is None:
            await asyncio.sleep(poll_s)
        return self._failure

    def close(self) -> None:
        """Closes the database (waits for the call running, if any)."""
        if self._closed:
            return
        self._closed = True
        if threading.current_thread().name.startswith("dtx-store"):  # pragma: no cover
            raise StoreError("close() called from the store's own thread")
        self._pool.submit(self._close_sync).result()
        self._pool.shutdown(wait=True)


__all__ = [
    "ABORTED_HERE_BEFORE",
    "ACK",
    "Answer",
    "Damaged",
    "Inspection",
    "ParticipantStore",
    "Record",
    "Refuse",
    "Refused",
    "RefusalKind",
    "Resource",
    "ResourceFailed",
    "SqlTx",
    "StoreBusy",
    "StoreError",
    "StoreFailure",
    "StoreStopped",
    "StoreUnavailable",
]
